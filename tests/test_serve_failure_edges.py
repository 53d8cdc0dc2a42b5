"""The serving engine's failure paths with unusual errors and backends (CPU): exception types
that refuse attributes, a KeyboardInterrupt-like error with requests queued behind it, a bucket
build that fails while the dynamic-batching queue holds more requests, and backend staging
with extra names or ndarray subclasses. Every request must complete (no hang), every output
must equal the numpy reference, and close() must return."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from orchestra.serve import Batching, Engine, EngineClosed, NumpyBackend
from orchestra.serve.errors import ServeConfigTypeError, ServeConfigValueError

from test_serve import ROW, SPEC_IN, SPEC_OUT, GatedBackend, f, rows


class _RefusesAttributes(Exception):
    """An exception type that refuses every attribute (``__traceback__``, ``__notes__``)."""

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is read-only ({name})")


class _RefusesWithTypeError(Exception):
    def __setattr__(self, name, value):
        raise TypeError(f"read-only ({name})")


class _SlotsNoNewAttributes(Exception):
    """Takes ``__notes__`` (and the traceback) but no other attribute."""

    def __setattr__(self, name, value):
        if name not in ("__notes__", "__traceback__"):
            raise AttributeError(name)
        super().__setattr__(name, value)


def _notes_tuple():
    e = ValueError("notes are a tuple")
    e.__notes__ = ("the user's note",)
    return e


def _close_within(engine, seconds=5.0) -> bool:
    t = threading.Thread(target=engine.close, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def _engine(fn, **kw):
    return Engine(backend=NumpyBackend(fn, device_thread=kw.pop("device_thread", False)),
                  inputs=SPEC_IN, outputs=SPEC_OUT, buckets=[4], instances=1, **kw)


@pytest.mark.parametrize("device_thread", [False, True])
@pytest.mark.parametrize("make", [_RefusesAttributes, _RefusesWithTypeError, _notes_tuple],
                         ids=["refuses-attributes", "refuses-with-type-error", "notes-tuple"])
def test_a_launch_error_that_refuses_attributes_fails_only_its_request(make, device_thread):
    """An error whose type refuses attribute setting (or whose ``__notes__`` is not a list)
    still fails its own request's future, and the engine serves on and closes: recording
    where it arose must never raise out of the failure path (which would leave the instance
    leased and every later request waiting forever)."""
    shared = make()

    def fn(d):
        if d["x"][0, 0] < -50:
            raise shared
        return f(d["x"])

    logging.disable(logging.CRITICAL)
    try:
        e = _engine(fn, device_thread=device_thread)
        xs = [rows(2, k) for k in range(6)]
        for x in xs[::2]:
            x[0, 0] = -100
        futs = [e.submit(x) for x in xs]
        for k, (x, fut) in enumerate(zip(xs, futs)):
            if k % 2 == 0:
                assert fut.exception(timeout=5) is shared
            else:
                assert fut.result(timeout=5).tobytes() == f(x).tobytes()
        assert e.stats()["engine"]["queued"] == 0
        assert _close_within(e)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("make", [_SlotsNoNewAttributes, _notes_tuple],
                         ids=["no-new-attributes", "notes-tuple"])
def test_the_same_error_failing_several_launches_gets_one_note(make):
    """One note of where the error arose however many launches it fails, also for a type
    that takes no new attributes; a ``__notes__`` that is not a list is left alone."""
    shared = make()
    before = len(getattr(shared, "__notes__", ()))

    def fn(d):
        raise shared

    with _engine(fn) as e:
        for k in range(3):
            assert e.submit(rows(2, k)).exception(timeout=5) is shared
    if isinstance(shared.__notes__, tuple):  # add_note refuses it: left as it was
        assert shared.__notes__ == ("the user's note",) and shared.__traceback__ is None
        return
    notes = list(shared.__notes__)
    assert len(notes) == before + 1, notes
    assert notes[-1].startswith("raised at (most recent call last):")
    assert "in fn\n    raise shared" in notes[-1]
    assert shared.__traceback__ is None


class _Interrupt(BaseException):
    """A KeyboardInterrupt-like error (not an Exception)."""


@pytest.mark.parametrize("batching", [None, Batching(max_batch=4, max_delay_us=0)],
                         ids=["plain", "batching"])
def test_an_interrupted_launch_hands_its_instance_to_the_queued_requests(batching):
    """A launch failing with a BaseException that is not an Exception (here raised by the
    instance's wait in the completion thread) fails its own requests with `EngineClosed`
    and re-raises in the thread that ran it; the requests queued behind it for the same
    instance still run (the instance goes to them) and close() returns."""
    go = threading.Event()

    def fn(d):
        if d["x"][0, 0] < -50:
            go.wait(5)
            raise _Interrupt("interrupted")
        return f(d["x"])

    logging.disable(logging.CRITICAL)
    e = _engine(fn, device_thread=True, batching=batching)
    try:
        e.warmup()
        bad = rows(2, 0)
        bad[0, 0] = -100
        first = e.submit(bad)  # leases the one instance, its run waits for `go`
        xs = [rows(1, k) for k in range(1, 4)]
        queued = [e.submit(x) for x in xs]
        go.set()
        assert isinstance(first.exception(timeout=5), EngineClosed)
        for x, q in zip(xs, queued):
            assert q.result(timeout=5).tobytes() == f(x).tobytes()
        assert e.stats()["engine"]["queued"] == 0
    finally:
        go.set()
        assert _close_within(e)
        logging.disable(logging.NOTSET)


class _SlowBadBucket(GatedBackend):
    """The 4-row bucket's build waits for ``gate`` and returns staging without the input."""

    def __init__(self):
        super().__init__(auto=True)
        self.gate = threading.Event()

    def create(self, rows_, index, inputs, outputs):
        if rows_ == 4:
            self.gate.wait(5)
        inst = super().create(rows_, index, inputs, outputs)
        if rows_ == 4:
            del inst.inputs["x"]
        return inst


@pytest.mark.parametrize("dispatch", ["caller", "thread"])
@pytest.mark.parametrize("max_batch", [4, 16])
def test_a_failed_build_with_requests_queued_behind_its_batch_never_stalls_them(dispatch,
                                                                                max_batch):
    """Dynamic batching: the head's bucket build fails (a bad staging) while more requests
    queue behind it. The batch that waited for the build fails with the config error; the
    requests after it are batched again and run (on the bucket that fits them, or fail with
    the same build error when it is the failing bucket): none waits forever."""
    backend = _SlowBadBucket()
    e = Engine(backend=backend, inputs=SPEC_IN, outputs=SPEC_OUT, buckets=[4, 16],
               instances=1, batching=Batching(max_batch=max_batch, max_delay_us=0),
               dispatch=dispatch)
    try:
        e.warmup([16])
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("head", e.submit(rows(3))))
        t.start()
        time.sleep(0.1)  # the head's build (in that thread, or the dispatcher's) is waiting
        later = [e.submit(rows(2, k)) for k in range(3)]
        backend.gate.set()
        t.join(5)
        outcomes = []
        for x, fut in [(rows(3), box["head"])] + [(rows(2, k), q) for k, q in enumerate(later)]:
            exc = fut.exception(timeout=5)  # TimeoutError here: a stalled request
            if exc is None:
                assert fut.result().tobytes() == f(x).tobytes()
                outcomes.append("ok")
            else:
                assert isinstance(exc, ServeConfigTypeError), exc
                assert "4-row instance's inputs['x']" in str(exc)
                outcomes.append("config")
        if max_batch == 4:  # every batch runs on the failing bucket (each tries the build)
            assert outcomes == ["config"] * 4
        else:  # the head's batch may have grown past the 4-row bucket while it built
            assert outcomes[1:] == ["ok"] * 3 or outcomes == ["config"] + ["ok"] * 3
        assert e.stats()["engine"]["queued"] == 0
    finally:
        backend.gate.set()
        assert _close_within(e)


class _Sub(np.ndarray):
    pass


def _extra_input(inst):
    inst.inputs["z"] = np.zeros((inst.rows, 2), np.float32)


def _extra_output(inst):
    inst.outputs["z"] = np.zeros((inst.rows, 2), np.float32)


def _subclass_output(inst):
    inst.outputs["y"] = inst.outputs["y"].view(_Sub)


def _matrix_output(inst):
    inst.outputs["y"] = np.asmatrix(inst.outputs["y"])


def _memmap_input(inst, tmp=[]):  # noqa: B006 - the test's temporary directory
    inst.inputs["x"] = np.memmap(tmp[0] / f"x{inst.rows}-{inst.index}", dtype=np.float32,
                                 mode="w+", shape=(inst.rows, ROW))


def _missing_output(inst):
    del inst.outputs["y"]


@pytest.mark.parametrize("spoil, error, match", [
    (_extra_input, ServeConfigValueError,
     r"4-row instance's inputs has 'z', which the engine does not declare"),
    (_extra_output, ServeConfigValueError,
     r"4-row instance's outputs has 'z', which the engine does not declare"),
    (_subclass_output, ServeConfigTypeError,
     r"outputs\['y'\] must be a numpy.ndarray \(plain.*got _Sub.*numpy.asarray"),
    (_matrix_output, ServeConfigTypeError,
     r"outputs\['y'\] must be a numpy.ndarray \(plain.*got matrix"),
    (_memmap_input, ServeConfigTypeError,
     r"inputs\['x'\] must be a numpy.ndarray \(plain.*got memmap"),
    (_missing_output, ServeConfigTypeError,
     r"4-row instance's outputs\['y'\] is missing \(it has \[\]\)"),
], ids=["extra-input", "extra-output", "subclass", "matrix", "memmap", "missing"])
def test_staging_with_extra_names_or_ndarray_subclasses_is_refused(spoil, error, match,
                                                                   tmp_path):
    """Staging the engine would mishandle: an input it does not declare (a batch's
    concatenation looks it up in the requests: KeyError at the first batch), an undeclared
    output (returned to callers as if declared), an ndarray subclass (callers would get
    that subclass: a matrix, a memmap without its file). The 4-row bucket fails with a
    config error naming the array; the 16-row bucket serves on; nothing stays open."""
    _memmap_input.__defaults__[0][:] = [tmp_path]

    class Spoiled(GatedBackend):
        def create(self, rows_, index, inputs, outputs):
            inst = super().create(rows_, index, inputs, outputs)
            if rows_ == 4:
                spoil(inst)
            return inst

    backend = Spoiled(auto=True)
    e = Engine(backend=backend, inputs=SPEC_IN, outputs=SPEC_OUT, buckets=[4, 16],
               instances=2, batching=Batching(max_batch=4, max_delay_us=1000))
    try:
        futs = [e.submit(rows(1, k)) for k in range(3)]  # one batch of 3 rows: bucket 4
        for fut in futs:
            with pytest.raises(error, match=match):
                fut.result(timeout=5)
        y = e.submit(rows(10)).result(timeout=5)
        assert type(y) is np.ndarray and y.tobytes() == f(rows(10)).tobytes()
    finally:
        assert _close_within(e)
    assert backend.instances and all(i.closed for i in backend.instances)
