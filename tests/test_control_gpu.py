"""Graph control flow on a real GPU (skipped without one): conditional nodes take the branch a
kernel chose (IF / ELSE, SWITCH), a WHILE node runs the exact number of iterations chosen on
the GPU and matches numpy, on both graph executors (and the eager host-driven equivalent);
nested conditionals; child graphs; programmatic edges counted from ``cuGraphGetEdges`` with
outputs right; node enable / disable changes the output; the WHILE example runs.

The kernels are compiled by NVRTC from the source below (no headers): they set conditions
with ``cudaGraphSetConditional`` through a ``cudaGraphConditionalHandle`` argument, guarded
with ``if (h)`` because the eager executor passes handle 0 and reads the flag instead.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestra.app.kernels_bench.pdlchain import _programmatic_edges
from orchestra.compiler.sources import kernel_source_dir
from orchestra.driver import DeviceBuffer, PinnedBuffer, Stream
from orchestra.execute import CaptureExecutor, EagerExecutor, GraphBuildExecutor
from orchestra.execute.errors import ExecutorArgumentValueError
from orchestra.graph import (
    Alloc,
    Buffer,
    ChildGraph,
    Condition,
    DeviceToHost,
    Free,
    HostBuffer,
    HostToDevice,
    If,
    In,
    InOut,
    KernelNode,
    KernelRef,
    Memset,
    Out,
    Switch,
    TaskGraph,
    While,
)
from tests.graphs_for_tests import branch_graph

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]

SOURCE = r"""
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

extern "C" __global__ void set_cond(cudaGraphConditionalHandle h, const unsigned int* src,
                                    unsigned int* flag)
{
    unsigned int v = *src;
    *flag = v;
    if (h) cudaGraphSetConditional(h, v);
}

extern "C" __global__ void add_to(int* acc, int k) { atomicAdd(acc, k); }

// One loop iteration on one block: v = v * 0.5 + 1 (exact in float32: 0.5 scales exactly),
// then thread 0 counts and decides whether to go on.
extern "C" __global__ void while_step(cudaGraphConditionalHandle h, int* counter,
                                      unsigned int* flag, int limit, float* v, int n)
{
    for (int i = threadIdx.x; i < n; i += blockDim.x) v[i] = v[i] * 0.5f + 1.0f;
    if (threadIdx.x == 0) {
        int c = *counter + 1;
        *counter = c;
        unsigned int more = c < limit ? 1u : 0u;
        *flag = more;
        if (h) cudaGraphSetConditional(h, more);
    }
}

extern "C" __global__ void scale_add(const float* x, float* y, int n, float s, float t)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s + t;
}
"""

SETTER = KernelRef(SOURCE, "set_cond")
ADD = KernelRef(SOURCE, "add_to")
STEP = KernelRef(SOURCE, "while_step")
SCALE = KernelRef(SOURCE, "scale_add")


@pytest.fixture(scope="module")
def executors(dev):
    with EagerExecutor(dev) as e, CaptureExecutor(dev) as c, GraphBuildExecutor(dev) as b:
        yield {"eager": e, "capture": c, "graph-build": b}


@pytest.fixture
def pinned(dev):
    made = []

    def make(n, dtype):
        p = PinnedBuffer.empty((n,), dtype, dev)
        made.append(p)
        return p.array

    yield make
    for p in made:
        p.close()


def adds(*ks):
    acc = Buffer("acc", 4)
    out = []
    for i, k in enumerate(ks):
        body = TaskGraph()
        body.add(KernelNode(f"add{i}", ADD, 1, 1, (InOut(acc), k)))
        out.append(body)
    return out


def outcomes(ex, kind, g, values, pinned):
    choice, out = pinned(1, np.uint32), pinned(1, np.int32)
    got = []
    if kind == "eager":
        for v in values:
            choice[0], out[0] = v, -1
            ex.run(g, bindings={"choice": choice, "out": out})
            got.append(int(out[0]))
        return got
    choice[0] = values[0]
    exe = ex.build(g, bindings={"choice": choice, "out": out})
    try:
        for v in values:
            choice[0], out[0] = v, -1
            exe.launch(sync=True)  # the same pinned array: the upload reads the new value
            got.append(int(out[0]))
    finally:
        exe.close()
    return got


@pytest.mark.parametrize("kind", ["capture", "graph-build", "eager"])
def test_if_else_and_switch_take_the_branch_the_kernel_chose(executors, pinned, kind):
    ex = executors[kind]
    then, otherwise = adds(1, 10)
    g = branch_graph(SETTER, lambda c: If("branch", c, then, otherwise))
    assert outcomes(ex, kind, g, (1, 0, 5, 0), pinned) == [1, 10, 1, 10]
    (only,) = adds(1)
    g = branch_graph(SETTER, lambda c: If("branch", c, only))
    assert outcomes(ex, kind, g, (0, 1), pinned) == [0, 1]
    cases = adds(1, 10, 100)
    s = branch_graph(SETTER, lambda c: Switch("switch", c, cases))
    assert outcomes(ex, kind, s, (0, 1, 2, 7), pinned) == [1, 10, 100, 0]


def while_graph(limit, n, external=False):
    """vin -> v; counter = 0; WHILE: v = v * 0.5 + 1, counter += 1 until ``limit``; v and the
    counter back to the host. The graph allocates and frees counter, flag and v, unless
    ``external`` (then they are device buffers the caller binds: no memory nodes)."""
    counter, fl, v = Buffer("counter", 4), Buffer("flag", 4), Buffer("v", 4 * n)
    go = Condition("go", default=1, flag=fl)
    body = TaskGraph()
    body.add(KernelNode("step", STEP, 1, 256, (go, InOut(counter), Out(fl), limit, InOut(v), n)))
    g = TaskGraph()
    if not external:
        for b in (counter, fl, v):
            g.add(Alloc(f"a_{b.name}", b))
    g.add(HostToDevice("up", HostBuffer("vin", 4 * n), v))
    g.add(Memset("zero", counter, 0))
    g.add(While("loop", go, body))
    g.add(DeviceToHost("down_v", v, HostBuffer("vout", 4 * n)))
    g.add(DeviceToHost("down_counter", counter, HostBuffer("count", 4)))
    if not external:
        for b in (counter, fl, v):
            g.add(Free(f"f_{b.name}", b))
    return g


@pytest.mark.parametrize("kind", ["capture", "graph-build", "eager"])
def test_while_runs_the_exact_number_of_iterations_and_matches_numpy(executors, pinned, kind):
    ex = executors[kind]
    n = 1000
    vin, vout, count = pinned(n, np.float32), pinned(n, np.float32), pinned(1, np.int32)
    vin[:] = (np.random.default_rng(4).standard_normal(n) * 100).astype(np.float32)
    for limit in (1, 37, 200):
        ref = vin.copy()
        for _ in range(limit):
            ref = ref * np.float32(0.5) + np.float32(1)
        vout[:], count[0] = np.nan, -1
        bind = {"vin": vin, "vout": vout, "count": count}
        g = while_graph(limit, n)
        if kind == "eager":
            ex.run(g, bindings=bind)
        else:
            exe = ex.run(g, bindings=bind)
            exe.replay()  # again: the handle's default (1) is back at every launch
            exe.close()
        assert int(count[0]) == limit
        assert vout.tobytes() == ref.tobytes()


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_update_of_graphs_with_conditional_nodes_runs_the_new_graph(executors, pinned, kind):
    """update() of an exec holding a WHILE (new limit, new host arrays) and an IF / ELSE (new
    constants in both bodies): the next launches run the new graph, whether the driver took
    the update in place or the exec was instantiated anew."""
    ex = executors[kind]
    n = 1000
    vin, count = pinned(n, np.float32), pinned(1, np.int32)
    vin[:] = (np.random.default_rng(5).standard_normal(n) * 100).astype(np.float32)
    vout = pinned(n, np.float32)
    exe = ex.build(while_graph(37, n), bindings={"vin": vin, "vout": vout, "count": count})
    try:
        exe.launch(sync=True)
        assert int(count[0]) == 37
        vout2, count2 = pinned(n, np.float32), pinned(1, np.int32)
        vout2[:], count2[0] = np.nan, -1
        res = exe.update(while_graph(9, n), bindings={"vin": vin, "vout": vout2,
                                                     "count": count2})
        print(f"\n{kind} WHILE update: {res}")
        for _ in range(2):
            exe.launch(sync=True)
            ref = vin.copy()
            for _ in range(9):
                ref = ref * np.float32(0.5) + np.float32(1)
            assert int(count2[0]) == 9
            assert vout2.tobytes() == ref.tobytes()
    finally:
        exe.close()
    choice, out = pinned(1, np.uint32), pinned(1, np.int32)
    then, otherwise = adds(1, 10)
    choice[0] = 1
    exe = ex.build(branch_graph(SETTER, lambda c: If("branch", c, then, otherwise)),
                   bindings={"choice": choice, "out": out})
    try:
        exe.launch(sync=True)
        assert int(out[0]) == 1
        then, otherwise = adds(2, 20)
        res = exe.update(branch_graph(SETTER, lambda c: If("branch", c, then, otherwise)))
        print(f"{kind} IF update: {res}")
        got = []
        for v in (1, 0, 1):
            choice[0], out[0] = v, -1
            exe.launch(sync=True)
            got.append(int(out[0]))
        assert got == [2, 20, 2]
    finally:
        exe.close()


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_a_conditional_graph_without_memory_nodes_updates_in_place(dev, executors, pinned,
                                                                   kind):
    """On external buffers cuGraphExecUpdate takes the new WHILE limit in place (the driver
    matches the handles by creation order) and the launches run it."""
    n = 1000
    s = Stream(dev)
    bufs = {k: DeviceBuffer.allocate(nb, s) for k, nb in (("counter", 4), ("flag", 4),
                                                           ("v", 4 * n))}
    s.synchronize()
    vin, vout, count = pinned(n, np.float32), pinned(n, np.float32), pinned(1, np.int32)
    vin[:] = np.random.default_rng(6).standard_normal(n).astype(np.float32)
    exe = executors[kind].build(while_graph(37, n, external=True),
                                bindings={"vin": vin, "vout": vout, "count": count, **bufs})
    try:
        exe.launch(sync=True)
        assert int(count[0]) == 37
        res = exe.update(while_graph(9, n, external=True))
        print(f"\n{kind} WHILE update on external buffers: {res}")
        assert res.updated and not res.reinstantiated
        ref = vin.copy()
        for _ in range(9):
            ref = ref * np.float32(0.5) + np.float32(1)
        for _ in range(2):
            count[0] = -1
            exe.launch(sync=True)
            assert int(count[0]) == 9 and vout.tobytes() == ref.tobytes()
    finally:
        exe.close()
        for b in bufs.values():
            b.close()
        s.close()


@pytest.mark.parametrize("kind", ["capture", "graph-build", "eager"])
def test_nested_if_inside_while(executors, pinned, kind):
    counter, fl, acc, fl2 = (Buffer(n, 4) for n in ("counter", "flag", "acc", "flag2"))
    v = Buffer("v", 4 * 256)
    go = Condition("go", default=1, flag=fl)
    more = Condition("more", flag=fl2)
    then, otherwise = adds(1, 100)
    body = TaskGraph()
    body.add(KernelNode("step", STEP, 1, 256, (go, InOut(counter), Out(fl), 4, InOut(v), 256)))
    body.add(KernelNode("copy_flag", SETTER, 1, 1, (more, In(fl), Out(fl2))))
    body.add(If("inner", more, then, otherwise))
    g = TaskGraph()
    for b in (counter, fl, acc, fl2, v):
        g.add(Alloc(f"a_{b.name}", b))
    g.add(Memset("zero", counter, 0))
    g.add(Memset("zero_acc", acc, 0))
    g.add(Memset("zero_v", v, 0))
    g.add(While("loop", go, body))
    g.add(DeviceToHost("down", acc, HostBuffer("out", 4)))
    for b in (counter, fl, acc, fl2, v):
        g.add(Free(f"f_{b.name}", b))
    out = pinned(1, np.int32)
    ex = executors[kind]
    if kind == "eager":
        ex.run(g, bindings={"out": out})
    else:
        ex.run(g, bindings={"out": out}).close()
    assert int(out[0]) == 3 * 1 + 100  # go is 1 after steps 1-3 (then), 0 after step 4 (else)


@pytest.mark.parametrize("kind", ["capture", "graph-build", "eager"])
def test_a_child_graph_runs_its_kernels(executors, pinned, kind):
    n = 4096
    x, y, z = Buffer("x", 4 * n), Buffer("y", 4 * n), Buffer("z", 4 * n)
    body = TaskGraph()
    body.add(KernelNode("k1", SCALE, n // 256, 256, (In(x), Out(y), n, 2.0, 1.0)))
    body.add(KernelNode("k2", SCALE, n // 256, 256, (In(y), Out(z), n, 0.5, 3.0)))
    g = TaskGraph()
    for b in (x, y, z):
        g.add(Alloc(f"a_{b.name}", b))
    g.add(HostToDevice("up", HostBuffer("hin", 4 * n), x))
    g.add(ChildGraph("child", body))
    g.add(DeviceToHost("down", z, HostBuffer("hout", 4 * n)))
    for b in (x, y, z):
        g.add(Free(f"f_{b.name}", b))
    hin, hout = pinned(n, np.float32), pinned(n, np.float32)
    hin[:] = np.arange(n, dtype=np.float32)
    hout[:] = np.nan
    ex = executors[kind]
    if kind == "eager":
        ex.run(g, bindings={"hin": hin, "hout": hout})
    else:
        ex.run(g, bindings={"hin": hin, "hout": hout}).close()
    want = (hin * np.float32(2) + np.float32(1)) * np.float32(0.5) + np.float32(3)
    np.testing.assert_allclose(hout, want, rtol=1e-6)


def pdl_chain(links, n, bufs):
    step = KernelRef(str(kernel_source_dir() / "pdl.cu"), "pdl_chain_step")
    g = TaskGraph()
    for i in range(links):
        src, dst = bufs[i % 2], bufs[(i + 1) % 2]
        g.add(KernelNode(f"link{i}", step, 1, 256, (In(src), Out(dst), n),
                         attributes={"pdl": True} if i else {}))
    return g


@pytest.mark.parametrize("kind", ["graph-build", "capture"])
def test_programmatic_edges_counted_from_the_graph_and_outputs_right(dev, executors, kind):
    if dev.compute_capability < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    n, links = 256, 8
    stream = Stream(dev)
    bufs = (Buffer("b0", 4 * n), Buffer("b1", 4 * n))
    dbufs = [DeviceBuffer.allocate(4 * n, stream) for _ in range(2)]
    pin = PinnedBuffer.empty((n,), np.float32, dev)
    try:
        x0 = np.random.default_rng(5).standard_normal(n).astype(np.float32)
        pin.array[:] = x0
        dbufs[0].copy_from_host(pin, stream, sync=True)
        g = pdl_chain(links, n, bufs)
        exe = executors[kind].build(g, bindings={"b0": dbufs[0], "b1": dbufs[1]})
        try:
            assert _programmatic_edges(exe.cugraph) == links - 1
            exe.launch(sync=True)
        finally:
            exe.close()
        dbufs[links % 2].copy_to_host(pin, stream, sync=True)
        want = x0.copy()
        for _ in range(links):
            want = want + np.float32(1)
        assert pin.array.tobytes() == want.tobytes()
    finally:
        for b in dbufs:
            b.free(stream)
        stream.synchronize()
        pin.close()
        stream.close()


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_disabling_a_kernel_changes_the_output_and_a_child_node_is_refused(executors, pinned,
                                                                          kind):
    n = 4096
    x, y = Buffer("x", 4 * n), Buffer("y", 4 * n)
    body = TaskGraph()
    body.add(Memset("inner", x, 0))
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(HostToDevice("up", HostBuffer("hin", 4 * n), x))
    g.add(KernelNode("first", SCALE, n // 256, 256, (In(x), Out(y), n, 2.0, 0.0)))
    g.add(KernelNode("extra", SCALE, n // 256, 256, (In(y), Out(y), n, 1.0, 5.0)))
    g.add(ChildGraph("child", body))
    g.add(DeviceToHost("down", y, HostBuffer("hout", 4 * n)))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    hin, hout = pinned(n, np.float32), pinned(n, np.float32)
    hin[:] = np.arange(n, dtype=np.float32)
    exe = executors[kind].build(g, bindings={"hin": hin, "hout": hout})
    try:
        exe.launch(sync=True)
        np.testing.assert_array_equal(hout, hin * 2 + 5)
        exe.disable("extra")
        exe.launch(sync=True)
        np.testing.assert_array_equal(hout, hin * 2)
        exe.enable("extra")
        exe.launch(sync=True)
        np.testing.assert_array_equal(hout, hin * 2 + 5)
        with pytest.raises(ExecutorArgumentValueError, match="child is a graph node"):
            exe.disable("child")
    finally:
        exe.close()


def test_the_while_example_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "while_converge.py"),
                           "--n", "1024", "--repeat", "3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "OK: every result within the bound" in out
    for name in ("graph-build", "capture", "eager (host loop)"):
        assert name in out
    print(out)


def test_bench_pdl_has_the_built_graph_row_with_programmatic_edges():
    import json

    proc = subprocess.run([sys.executable, "-m", "orchestra.cli.main", "bench", "pdl",
                           "--kernels", "100", "--repeats", "1", "--json"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    built = [r for r in rep["results"] if r["mode"] == "graph-build"]
    assert built and all(r["verified"] for r in built)
    assert {r["programmatic_edges"] for r in built if r["pdl"]} == {99}
    assert {r["programmatic_edges"] for r in built if not r["pdl"]} == {0}
    captured = [r for r in rep["results"] if r["mode"] == "graph" and r["pdl"]]
    print({r["kernel"]: (r["us_per_kernel"], r["detail"]) for r in built + captured})
