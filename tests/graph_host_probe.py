#!/usr/bin/env python3
"""Which host-function path works on this GPU / driver / cuda-bindings? One variant per process.

    python3 tests/graph_host_probe.py --list
    python3 tests/graph_host_probe.py capture-5            # one variant, in this process
    python3 tests/graph_host_probe.py all [--timeout 45] [--log FILE]
                                                           # every variant in its own child

A variant prints one line ``PASS <variant>: ...``, ``FAIL <variant>: ...`` or ``SKIP ...`` and
exits 0 (PASS / SKIP) or 1 (FAIL). ``all`` runs each in a child process (``sys.executable``)
with a timeout and prints a table with the child's return code: -11 is a segfault (SIGSEGV),
-6 an abort, "timeout" a hang (a deadlock, e.g. a blocking call holding the GIL a host function
needs). A crashing child's last stderr lines (faulthandler's thread dump) follow the table.

Variants (N = number of graph launches; "raise": the host function raises every time):

    env                 versions: Python, cuda-bindings, driver, GPU, where the driver's
                        cuLaunchHostFunc entry point is found
    eager-1, eager-5, eager-raise
                        orchestra EagerExecutor: cuLaunchHostFunc per run (the driver's entry point)
    capture-1, capture-5, capture-raise
                        orchestra CaptureExecutor: host function captured into a graph
    build-1, build-5, build-raise
                        orchestra GraphBuildExecutor: cuGraphAddHostNode
    raw-ctypes-1, raw-ctypes-5, raw-ctypes-raise
                        no orchestra: raw capture of the driver's own cuLaunchHostFunc
                        (cuGetProcAddress, called through ctypes) with a ctypes trampoline
    raw-bindings-1, raw-bindings-5
                        no orchestra: raw capture of cuda-bindings' cuLaunchHostFunc (the call
                        the capture executor made before the fix; cuda-bindings <= 13.3 wraps
                        fn/userData in a record its wrapper frees after the first call)
    raw-addnode-5       no orchestra: cuGraphAddHostNode with CUDA_HOST_NODE_PARAMS
    hostfunc-5          a raw capture through orchestra's HostCallbacks + launch_host_func (the
                        capture executor's host path without the executor), 5 launches
    bindings-callable   does cuda-bindings accept a Python callable as CUhostFn? (SKIP if not;
                        else a raw capture with it, 5 launches)

The orchestra graph variants run the graph of tests/test_graphs_gpu.py's host-node test:
HostFunc fill (writes the pinned input) -> Alloc -> H2D -> D2H -> Free, output checked after
every launch; "raise" builds a graph of one HostFunc that raises and expects
`HostFunctionError` from each of 3 launches.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

VARIANTS: dict[str, str] = {}
TOKEN = 42


def variant(name: str, doc: str = ""):
    def deco(fn):
        VARIANTS[name] = doc or (fn.__doc__ or "").strip().splitlines()[0]
        _FUNCS[name] = fn
        return fn
    return deco


_FUNCS: dict = {}


class Fail(Exception):
    pass


# -- environment ------------------------------------------------------------------------------


def _versions() -> str:
    from cuda.bindings import driver as d

    try:
        from importlib.metadata import version

        cb = version("cuda-bindings")
    except Exception:  # noqa: BLE001
        cb = getattr(__import__("cuda.bindings", fromlist=["__version__"]), "__version__", "?")
    (err,) = d.cuInit(0)[:1]
    err_v, drv = d.cuDriverGetVersion()
    name = "?"
    try:
        err_d, dev = d.cuDeviceGet(0)
        err_n, raw = d.cuDeviceGetName(64, dev)
        name = raw.split(b"\0", 1)[0].decode()
    except Exception:  # noqa: BLE001
        pass
    from orchestra.driver import entry_points

    fn = entry_points.driver_launch_host_func(d)
    return (f"python {sys.version.split()[0]}, cuda-bindings {cb}, driver API {drv}, "
            f"GPU {name}, driver cuLaunchHostFunc entry: "
            f"{entry_points.driver_launch_host_func_source() if fn else 'NOT FOUND'}")


@variant("env", "versions of Python, cuda-bindings, the driver; the GPU")
def v_env():
    return _versions()


# -- raw cuda-bindings helpers (no orchestra) -----------------------------------------------


def _ok(res, what):
    err = res[0]
    if int(err):
        raise Fail(f"{what} failed: {err!r}")
    return res[1] if len(res) == 2 else (res[1:] if len(res) > 2 else None)


class _Raw:
    """A context on device 0, one non-blocking stream, a ctypes trampoline counting calls."""

    def __init__(self, raises: bool = False):
        from cuda.bindings import driver as d

        self.d = d
        _ok(d.cuInit(0), "cuInit")
        dev = _ok(d.cuDeviceGet(0), "cuDeviceGet")
        self.ctx = _ok(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self.dev = dev
        _ok(d.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.stream = _ok(d.cuStreamCreate(int(d.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                          "cuStreamCreate")
        self.calls: list = []

        def host(user):
            self.calls.append(user)
            if raises:
                raise RuntimeError("boom (expected)")

        self.fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(host)
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value

    def capture(self, enqueue):
        d = self.d
        mode = d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _ok(d.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        try:
            enqueue()
        finally:
            graph = _ok(d.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        return graph

    def run(self, graph, launches: int) -> str:
        d = self.d
        exe = _ok(d.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        try:
            for i in range(launches):
                _ok(d.cuGraphLaunch(exe, self.stream), f"cuGraphLaunch #{i + 1}")
                _ok(d.cuStreamSynchronize(self.stream), f"cuStreamSynchronize #{i + 1}")
                if len(self.calls) != i + 1 or self.calls[-1] != TOKEN:
                    raise Fail(f"after launch #{i + 1}: host function calls {self.calls[:8]} "
                               f"(want {i + 1} calls with userData {TOKEN})")
        finally:
            d.cuGraphExecDestroy(exe)
            d.cuGraphDestroy(graph)
        return f"{launches} launches, host function called {len(self.calls)} times"

    def close(self):
        d = self.d
        d.cuStreamDestroy(self.stream)
        d.cuDevicePrimaryCtxRelease(self.dev)


def _raw_ctypes(launches: int, raises: bool = False) -> str:
    from orchestra.driver import entry_points

    r = _Raw(raises)
    try:
        entry = entry_points.driver_launch_host_func(r.d)
        if entry is None:
            raise Fail("the driver's cuLaunchHostFunc entry point was not found")

        def enqueue():
            err = entry(int(r.stream), r.address, TOKEN)
            if err:
                raise Fail(f"cuLaunchHostFunc (driver entry point) returned {err}")

        out = r.run(r.capture(enqueue), launches)
        return out + f" (entry point from {entry_points.driver_launch_host_func_source()})"
    finally:
        r.close()


def _raw_bindings(launches: int) -> str:
    r = _Raw()
    try:
        def enqueue():
            _ok((r.d.cuLaunchHostFunc(r.stream, r.d.CUhostFn(r.address), TOKEN)[0], None),
                "cuda.bindings cuLaunchHostFunc")

        return r.run(r.capture(enqueue), launches)
    finally:
        r.close()


for _n in (1, 5):
    variant(f"raw-ctypes-{_n}", f"raw capture, driver entry point via ctypes, {_n} launches")(
        lambda n=_n: _raw_ctypes(n))
    variant(f"raw-bindings-{_n}", f"raw capture, cuda-bindings cuLaunchHostFunc, {_n} launches")(
        lambda n=_n: _raw_bindings(n))


@variant("hostfunc-5", "raw capture through orchestra's HostCallbacks + launch_host_func, 5 "
                      "launches (the capture executor's host path, no executor)")
def v_hostfunc():
    from orchestra.driver.entry_points import launch_host_func
    from orchestra.execute.hostfunc import HostCallbacks

    r = _Raw()
    try:
        cb = HostCallbacks()
        calls = []
        token = cb.add(lambda: calls.append(TOKEN), "probe")
        r.calls = calls

        def enqueue():
            err = launch_host_func(r.d, r.stream, cb.address, token)
            if err:
                raise Fail(f"launch_host_func returned {err}")

        out = r.run(r.capture(enqueue), 5)
        errors = cb.take_errors()
        if errors:
            raise Fail(f"the trampoline recorded errors: {errors}")
        return out
    finally:
        r.close()


@variant("raw-ctypes-raise", "raw capture, driver entry point; the ctypes callback raises")
def v_raw_ctypes_raise():
    return _raw_ctypes(3, raises=True) + " (ctypes printed and ignored the exceptions)"


@variant("raw-addnode-5", "raw cuGraphAddHostNode (CUDA_HOST_NODE_PARAMS), 5 launches")
def v_raw_addnode():
    r = _Raw()
    d = r.d
    try:
        graph = _ok(d.cuGraphCreate(0), "cuGraphCreate")
        p = d.CUDA_HOST_NODE_PARAMS()
        p.fn = d.CUhostFn(r.address)
        p.userData = TOKEN
        raw = (ctypes.c_uint64 * 2).from_address(int(p.getPtr()))
        if raw[0] != r.address or raw[1] != TOKEN:
            raise Fail(f"CUDA_HOST_NODE_PARAMS holds fn={raw[0]:#x} userData={raw[1]} "
                       f"(set {r.address:#x}, {TOKEN}): cuda-bindings rewrote them")
        _ok(d.cuGraphAddHostNode(graph, None, 0, p), "cuGraphAddHostNode")
        return r.run(graph, 5)
    finally:
        r.close()


@variant("bindings-callable", "does cuda-bindings take a Python callable as CUhostFn?")
def v_bindings_callable():
    from cuda.bindings import driver as d

    calls = []
    try:
        fn = d.CUhostFn(lambda user: calls.append(user))
    except Exception as exc:  # noqa: BLE001
        return ("SKIP", f"cuda-bindings takes no Python callable for CUhostFn "
                        f"({type(exc).__name__}: {exc}); only C function addresses")
    r = _Raw()
    try:
        def enqueue():
            _ok((d.cuLaunchHostFunc(r.stream, fn, TOKEN)[0], None), "cuLaunchHostFunc")

        r.calls = calls
        return r.run(r.capture(enqueue), 5)
    finally:
        r.close()


# -- orchestra variants -----------------------------------------------------------------------


def _fill_graph(dev, n=1024):
    """The GPU test's graph: fill (host) -> alloc -> H2D -> D2H -> free; bindings; counter."""
    import numpy as np

    from orchestra.driver import PinnedBuffer
    from orchestra.graph import Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostFunc
    from orchestra.graph import HostToDevice, TaskGraph

    g = TaskGraph()
    x = Buffer("x", 4 * n)
    hin, hout = HostBuffer("hin", 4 * n), HostBuffer("hout", 4 * n)
    a = PinnedBuffer.empty(n, np.float32, dev)
    b = PinnedBuffer.empty(n, np.float32, dev)
    av, bv = a.array, b.array
    counter = []

    def fill():
        av[:] = len(counter)
        counter.append(1)

    g.add(HostFunc("fill", fill, writes=(hin,)))
    g.add(Alloc("ax", x))
    g.add(HostToDevice("up", hin, x))
    g.add(DeviceToHost("down", x, hout))
    g.add(Free("fx", x))
    return g, {"hin": av, "hout": bv}, counter, bv, (a, b)


def _raise_graph():
    from orchestra.graph import HostFunc, TaskGraph

    def boom():
        raise RuntimeError("boom (expected)")

    g = TaskGraph()
    g.add(HostFunc("bad", boom))
    return g


def _graph_executor(kind):
    from orchestra.driver import Device
    from orchestra.execute.cuda_graph.capture import CaptureExecutor
    from orchestra.execute.cuda_graph.build import GraphBuildExecutor

    dev = Device.get(0)
    cls = CaptureExecutor if kind == "capture" else GraphBuildExecutor
    return dev, cls(dev)


def _orchestra_graph(kind: str, launches: int) -> str:
    dev, ex = _graph_executor(kind)
    g, bindings, counter, out, pins = _fill_graph(dev)
    try:
        exe = ex.build(g, None, bindings)
        try:
            for i in range(launches):
                out[:] = -1
                exe.launch(sync=True)
                if len(counter) != i + 1 or not (out == i).all():
                    raise Fail(f"after launch #{i + 1}: host function ran {len(counter)} times, "
                               f"output {out[:4]}... (want {i})")
        finally:
            exe.close()
        return f"{launches} launches, host node ran every launch, outputs right"
    finally:
        ex.close()
        for p in pins:
            p.close()


def _orchestra_graph_raise(kind: str, launches: int = 3) -> str:
    from orchestra.execute import HostFunctionError

    dev, ex = _graph_executor(kind)
    try:
        exe = ex.build(_raise_graph(), None, {})
        try:
            for i in range(launches):
                try:
                    exe.launch(sync=True)
                except HostFunctionError as exc:
                    if "bad" not in str(exc):
                        raise Fail(f"launch #{i + 1}: HostFunctionError without the node name: "
                                   f"{exc}") from exc
                else:
                    raise Fail(f"launch #{i + 1}: no HostFunctionError")
        finally:
            exe.close()
        return f"{launches} launches, HostFunctionError naming the node each time"
    finally:
        ex.close()


def _eager(runs: int) -> str:
    from orchestra.driver import Device
    from orchestra.execute import EagerExecutor

    dev = Device.get(0)
    g, bindings, counter, out, pins = _fill_graph(dev)
    try:
        with EagerExecutor(dev) as ex:
            for i in range(runs):
                out[:] = -1
                ex.run(g, None, bindings)
                if len(counter) != i + 1 or not (out == i).all():
                    raise Fail(f"after run #{i + 1}: host function ran {len(counter)} times, "
                               f"output {out[:4]}... (want {i})")
        return f"{runs} runs, host function ran every run, outputs right"
    finally:
        for p in pins:
            p.close()


def _eager_raise(runs: int = 3) -> str:
    from orchestra.driver import Device
    from orchestra.execute import EagerExecutor, HostFunctionError

    with EagerExecutor(Device.get(0)) as ex:
        g = _raise_graph()
        for i in range(runs):
            try:
                ex.run(g, None, {})
            except HostFunctionError as exc:
                if "bad" not in str(exc):
                    raise Fail(f"run #{i + 1}: HostFunctionError without the node name") from exc
            else:
                raise Fail(f"run #{i + 1}: no HostFunctionError")
    return f"{runs} runs, HostFunctionError naming the node each time"


for _n in (1, 5):
    variant(f"eager-{_n}", f"orchestra eager, {_n} runs")(lambda n=_n: _eager(n))
    variant(f"capture-{_n}", f"orchestra capture, {_n} launches")(
        lambda n=_n: _orchestra_graph("capture", n))
    variant(f"build-{_n}", f"orchestra graph-build, {_n} launches")(
        lambda n=_n: _orchestra_graph("graph-build", n))
variant("eager-raise", "orchestra eager, a raising host function, 3 runs")(_eager_raise)
variant("capture-raise", "orchestra capture, a raising host function, 3 launches")(
    lambda: _orchestra_graph_raise("capture"))
variant("build-raise", "orchestra graph-build, a raising host function, 3 launches")(
    lambda: _orchestra_graph_raise("graph-build"))

ORDER = ["env", "eager-1", "eager-5", "eager-raise", "raw-ctypes-1", "raw-ctypes-5",
         "raw-ctypes-raise", "raw-addnode-5", "raw-bindings-1", "raw-bindings-5", "hostfunc-5",
         "bindings-callable", "capture-1", "capture-5", "capture-raise", "build-1", "build-5",
         "build-raise"]
assert sorted(ORDER) == sorted(VARIANTS), set(ORDER) ^ set(VARIANTS)


# -- running ----------------------------------------------------------------------------------


def run_one(name: str) -> int:
    faulthandler.enable()  # a segfault prints every thread's stack to stderr
    try:  # no core file for an expected crash (raw-bindings-5 with cuda-bindings <= 13.3)
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    t0 = time.perf_counter()
    try:
        res = _FUNCS[name]()
        status, detail = res if isinstance(res, tuple) else ("PASS", res)
    except Fail as exc:
        status, detail = "FAIL", str(exc)
    except BaseException as exc:  # noqa: BLE001 - one line, whatever it was
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    dt = time.perf_counter() - t0
    print(f"{status} {name}: {detail} [{dt:.2f} s]", flush=True)
    return 1 if status == "FAIL" else 0


def _rc_text(rc) -> str:
    if rc is None:
        return "timeout"
    if rc < 0:
        try:
            return f"{rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return str(rc)
    return str(rc)


def run_all(names: list[str], timeout: float, log: str | None = None) -> int:
    rows, crashed = [], []
    logf = open(log, "w") if log else None  # noqa: SIM115 - closed below
    for name in names:
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), name],
                               capture_output=True, text=True, timeout=timeout, cwd=_ROOT)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as exc:
            rc = None
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        dt = time.perf_counter() - t0
        if logf is not None:
            logf.write(f"=== {name}: rc {_rc_text(rc)}, {dt:.1f} s\n--- stdout\n{out}\n"
                       f"--- stderr\n{err}\n")
            logf.flush()
        lines = [ln for ln in out.splitlines()
                 if ln.startswith(("PASS ", "FAIL ", "SKIP "))]
        line = lines[-1] if lines else ""
        if rc is None:
            status = "HANG"
        elif rc < 0:
            status = "CRASH"
        else:
            status = line.split(" ", 1)[0] if line else ("PASS" if rc == 0 else "FAIL")
            if rc and status == "PASS":
                status = "FAIL"
        if ": " in line:
            detail = line.split(": ", 1)[1]
        elif rc is None:
            detail = f"no result within {timeout:g} s (a hang); stderr tail below"
        elif rc < 0:
            detail = f"killed by signal {_rc_text(rc)} before a result; stderr tail below"
        else:
            detail = (err.strip().splitlines()[-1:] or [""])[0]
        rows.append((name, _rc_text(rc), status, f"{dt:.1f}", detail))
        print(f"  {name:<18} rc={_rc_text(rc):<14} {status:<5} {dt:5.1f} s  {detail[:100]}",
              flush=True)
        if status in ("CRASH", "HANG") and err.strip():
            crashed.append((name, err.strip().splitlines()[-14:]))
    print("\nsummary:")
    w = max(len(r[0]) for r in rows)
    print(f"  {'variant':<{w}}  {'rc':<14} {'status':<6} {'s':>5}  detail")
    for name, rc, status, dt, detail in rows:
        print(f"  {name:<{w}}  {rc:<14} {status:<6} {dt:>5}  {detail[:110]}")
    for name, tail in crashed:
        print(f"\n--- {name}: last stderr lines ---")
        print("\n".join(ln[:160] for ln in tail))
    if logf is not None:
        logf.close()
        print(f"\nfull child output: {log}")
    bad = [r[0] for r in rows if r[2] in ("FAIL", "CRASH", "HANG")]
    known = {"raw-bindings-5"}  # cuda-bindings <= 13.3: its wrapper frees its record (see doc)
    unexpected = [b for b in bad if b not in known]
    print("\nverdict: " + ("every variant passed" if not bad else
                           "not passing: " + ", ".join(bad)))
    if "raw-bindings-5" in bad and "raw-bindings-1" not in bad and "raw-ctypes-5" not in bad:
        print("  raw-bindings-5 not passing while raw-bindings-1 and raw-ctypes-5 pass confirms "
              "that cuda-bindings' cuLaunchHostFunc, once captured, calls through a record "
              "freed by the first launch (the capture executor's path before the fix; it now "
              "calls the driver's entry point, as raw-ctypes-5 does).")
    elif "raw-bindings-5" in bad:
        print("  raw-bindings-5 not passing, but so does raw-bindings-1 or raw-ctypes-5: "
              "inconclusive about the cuda-bindings wrapper; read the details.")
    elif "raw-bindings-5" in names:
        print("  raw-bindings-5 passed: this cuda-bindings passes fn/userData straight through "
              "(no one-shot wrapper).")
    if unexpected:
        print("  UNEXPECTED: " + ", ".join(unexpected))
    return 1 if unexpected else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", help="variant names, or 'all'")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=45.0,
                    help="seconds per child with 'all' (default 45)")
    ap.add_argument("--log", help="with 'all': write every child's stdout and stderr here")
    args = ap.parse_args(argv)
    if args.list or not args.variants:
        for name in ORDER:
            print(f"{name:<18} {VARIANTS[name]}")
        return 0 if args.list else 2
    if args.variants == ["all"]:
        return run_all(ORDER, args.timeout, args.log)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variant(s): {', '.join(unknown)}; see --list", file=sys.stderr)
        return 2
    if len(args.variants) > 1:
        return run_all(args.variants, args.timeout, args.log)
    return run_one(args.variants[0])


if __name__ == "__main__":
    sys.exit(main())
