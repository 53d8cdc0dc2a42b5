"""Case C16 on the GPU: a program initializes CUDA through orchestra, then forks (the default
start method of multiprocessing on Linux) and the child uses orchestra.

The child gets `CudaForkError` (it says CUDA is not fork-safe and how to use spawn), closing
objects it inherited calls no driver function, and the parent keeps working: it runs the kernel
again on a new and on a pre-fork stream with exact output. The spawn start method, which the
error recommends, works. Each case runs in a fresh interpreter (a script file, so spawn can
re-import it) with a timeout, so a crash or a hang fails the test instead of the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent(r'''
    import json
    import multiprocessing as mp
    import sys

    import numpy as np

    from orchestra.compiler import load_kernel
    from orchestra.driver import Device, DeviceBuffer, PinnedBuffer, Stream, live_handles
    from orchestra.driver.check import forked_after_init
    from orchestra.errors import CudaForkError

    SRC = """
    extern "C" __global__ void scale(float* x, float a, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) x[i] = x[i] * a + 1.0f;
    }
    """
    N = 1 << 16


    def run_kernel(a, stream=None):
        """H2D, x = x * a + 1, D2H; True when the output equals numpy's exactly."""
        kernel = load_kernel(SRC, "scale")
        s = stream if stream is not None else Stream()
        host = PinnedBuffer.empty(N, np.float32)
        host.array[:] = np.arange(N, dtype=np.float32)
        dev = DeviceBuffer.allocate(host.nbytes, s)
        dev.copy_from_host(host, s)
        kernel.launch(s, (N + 255) // 256, 256, (dev, float(a), N))
        dev.copy_to_host(host, s, sync=True)
        got = host.array.copy()
        dev.free(s)
        s.synchronize()
        host.close()
        if stream is None:
            s.close()
        want = np.arange(N, dtype=np.float32) * np.float32(a) + np.float32(1.0)
        return bool(np.array_equal(got, want))


    def outcome(fn):
        try:
            fn()
        except CudaForkError as err:
            return ["CudaForkError", err.call, err.name, str(err)]
        except Exception as err:  # noqa: BLE001 - reported to the test
            return [type(err).__name__, str(err)]
        return "no error"


    def forked_child(conn, stream, pinned, old_stream):
        out = {"forked": forked_after_init()}
        out["device"] = outcome(lambda: Device.get(0))
        out["run"] = outcome(lambda: run_kernel(2.0))
        out["close_inherited"] = outcome(lambda: (stream.close(), pinned.close()))
        conn.send(out)
        # Last, and reported on its own: a driver call on an object inherited from the parent
        # reaches the driver, whose behaviour in a forked child is undefined (it fails with an
        # initialization error in practice).
        conn.send({"inherited_stream": outcome(old_stream.synchronize)})
        conn.close()


    def spawned_child(conn):
        conn.send({"forked": forked_after_init(), "run": run_kernel(2.0)})
        conn.close()


    def main(mode):
        result = {"parent_before": run_kernel(2.0)}
        before = live_handles()  # after the first run: the memoized module stays loaded
        stream, old_stream = Stream(), Stream()
        pinned = PinnedBuffer(4096)
        ctx = mp.get_context(mode)
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        if mode == "fork":
            proc = ctx.Process(target=forked_child,
                               args=(child_conn, stream, pinned, old_stream))
        else:
            proc = ctx.Process(target=spawned_child, args=(child_conn,))
        proc.start()
        child_conn.close()
        result["child"] = parent_conn.recv() if parent_conn.poll(90) else "timed out"
        if mode == "fork" and result["child"] != "timed out":
            extra = parent_conn.recv() if parent_conn.poll(30) else {"inherited_stream":
                                                                       "timed out"}
            result["child"].update(extra)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        result["exitcode"] = proc.exitcode
        result["parent_forked"] = forked_after_init()
        result["parent_after_new_stream"] = run_kernel(3.0)
        result["parent_after_old_stream"] = run_kernel(-0.5, old_stream)
        stream.close()
        old_stream.close()
        pinned.close()
        result["leaked"] = {k: v for k, v in live_handles().items() if v != before.get(k, 0)}
        print("RESULT", json.dumps(result))
        sys.stdout.flush()


    if __name__ == "__main__":
        main(sys.argv[1])
''')


def _run(tmp_path, mode):
    script = tmp_path / "fork_case.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc


def test_forked_child_gets_a_fork_error_and_the_parent_keeps_working(tmp_path):
    res, proc = _run(tmp_path, "fork")
    assert res["parent_before"] is True
    child = res["child"]
    assert child != "timed out", proc.stderr
    assert child["forked"] is True
    # the first orchestra call that needs the driver refuses, without calling it
    kind, call, name, text = child["device"]
    assert (kind, call, name) == ("CudaForkError", "", "")
    assert text.startswith("this process was forked after CUDA was initialized in its parent")
    assert 'multiprocessing.get_context("spawn")' in text
    assert child["run"][0] == "CudaForkError"
    assert child["close_inherited"] == "no error"  # releases are skipped in the child
    # an object inherited from the parent reaches the driver (undefined in a forked child);
    # when the call fails, the error is the fork error, never a bare CudaError
    inherited = child["inherited_stream"]
    assert inherited in ("no error", "timed out") \
        or inherited[:2] == ["CudaForkError", "cuStreamSynchronize"], inherited
    if inherited != "timed out":
        assert res["exitcode"] == 0, proc.stderr
    # the parent: unchanged, and its kernels still give exact results on new and old streams
    assert res["parent_forked"] is False
    assert res["parent_after_new_stream"] is True
    assert res["parent_after_old_stream"] is True
    assert res["leaked"] == {}


def test_the_spawn_start_method_the_error_recommends_works(tmp_path):
    res, proc = _run(tmp_path, "spawn")
    assert res["parent_before"] is True
    assert res["child"] == {"forked": False, "run": True}, proc.stderr
    assert res["exitcode"] == 0
    assert res["parent_after_new_stream"] is True and res["parent_after_old_stream"] is True
    assert res["leaked"] == {}
