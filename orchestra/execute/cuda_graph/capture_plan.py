"""The step list of one stream capture, and the check that every stream is joined (pure Python).

A capture of a `Plan` runs on an *origin* stream that is not one of the plan's streams:

    begin   origin                      cuStreamBeginCapture(origin, mode)
    fork    s      (every plan stream)   record a fork event on origin, s waits for it
    ...     the plan's own steps in plan.issue_order() (nodes, event records and waits)
    join    s      (every plan stream)   record a join event on s, origin waits for it
    end     origin                      cuStreamEndCapture(origin)

`capture_steps` builds that list; every plan stream is forked before its first step and joined
after its last, by construction. `check_capture_steps` proves it for any step list (it is what
the tests run against hand-made lists too): a stream that does work in the capture without
having been forked (its work would run eagerly instead of being captured), or whose last work
is not followed by a join before the end (``cuStreamEndCapture`` would fail with
``CUDA_ERROR_STREAM_CAPTURE_UNJOINED``), raises `UnjoinedStreamError` naming it.
"""

from __future__ import annotations

import attrs

from orchestra.driver.capture import UnjoinedStreamError
from orchestra.errors import OrchestraError
from orchestra.schedule import Plan, RecordEvent, RunNode, WaitEvent

ORIGIN = "<origin>"


@attrs.frozen
class CaptureStep:
    """One step of a capture: ``op`` is ``begin``, ``fork``, ``join``, ``end`` (on ``stream``)
    or ``plan`` (``step`` is the plan's `RunNode` / `RecordEvent` / `WaitEvent` on
    ``stream``).

    Immutable: may be shared between threads freely.
    """

    op: str
    stream: str
    step: object = None


def capture_steps(plan: Plan, issue=None) -> list[CaptureStep]:
    """The capture of ``plan``: begin, fork every stream, the plan's steps in issue order
    (``issue``: a precomputed ``plan.issue_order()``), join every stream, end."""
    issue = plan.issue_order() if issue is None else issue
    out = [CaptureStep("begin", ORIGIN)]
    out += [CaptureStep("fork", s) for s in plan.stream_names]
    out += [CaptureStep("plan", s, st) for s, st in issue]
    out += [CaptureStep("join", s) for s in plan.stream_names]
    out.append(CaptureStep("end", ORIGIN))
    return out


def check_capture_steps(steps) -> None:
    """Raise `UnjoinedStreamError` unless every stream that works in the capture was forked
    before its first work and joined after its last, and the capture begins and ends on one
    origin stream. Plan event waits also bring a stream into the capture (CUDA's own rule), so
    a stream that only waits for an event recorded by a captured stream counts as forked."""
    steps = list(steps)
    if not steps or steps[0].op != "begin":
        raise OrchestraError("a capture must begin with cuStreamBeginCapture on its origin stream")
    if steps[-1].op != "end" or steps[-1].stream != steps[0].stream:
        raise OrchestraError("a capture must end with cuStreamEndCapture on the stream it began on")
    origin = steps[0].stream
    in_capture = {origin}
    recorded_in_capture: set[str] = set()
    dirty: dict[str, str] = {}  # stream -> what it did last without being joined since
    not_forked: list[str] = []
    for st in steps[1:-1]:
        s = st.stream
        if st.op == "fork":
            in_capture.add(s)
        elif st.op == "join":
            if s not in in_capture:
                not_forked.append(s)
            dirty.pop(s, None)
        elif st.op == "plan":
            step = st.step
            if isinstance(step, WaitEvent) and step.event in recorded_in_capture:
                in_capture.add(s)  # waiting for a captured event joins the capture
            if s not in in_capture:
                if s not in not_forked:
                    not_forked.append(s)
                continue
            if isinstance(step, RecordEvent):
                recorded_in_capture.add(step.event)
            if s != origin:
                what = step.node if isinstance(step, RunNode) else f"event {step.event}"
                dirty[s] = what
        elif st.op in ("begin", "end"):
            raise OrchestraError(f"capture step {st.op} on {s} in the middle of a capture")
        else:
            raise OrchestraError(f"unknown capture step {st.op!r}")
    if not_forked:
        raise UnjoinedStreamError(not_forked, "they were never forked from the origin, so their "
                                  "work would run outside the capture")
    if dirty:
        raise UnjoinedStreamError(sorted(dirty), "last work: " + ", ".join(
            f"{s}: {w}" for s, w in sorted(dirty.items())))


__all__ = ["CaptureStep", "ORIGIN", "UnjoinedStreamError", "capture_steps",
           "check_capture_steps"]
