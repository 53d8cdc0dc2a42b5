"""Host copies lowered to the copy kernel, on the CPU: the choice per copy (size, mode,
per-node / per-build / per-executor overrides, devices that cannot), the graph spec's kinds, the
plan printout, every executor running copy kernels on the fake drivers (which run the copy
kernel by name: it moves the bytes), replays that rebind host arrays behind copy kernels, the
crossover table on disk and its measurement's arithmetic, traces, the copy kernel's source, and
the eager executor's driver calls per run."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest

import orchestra.compiler as oc
from orchestra.app.job.graphs import BURN_PARAMS
from orchestra.cli.main import main
from orchestra.compiler.params import parse_params
from orchestra.execute import (
    DEFAULT_CROSSOVER,
    CopyCrossover,
    CopyLoweringError,
    CopyPolicy,
    EagerExecutor,
    KernelResolver,
)
from orchestra.execute import copy_table
from orchestra.execute.copy_tuning import crossover_size, with_lowering
from orchestra.execute.cuda_graph.spec import translate
from orchestra.execute.lowering.copy import COPY_PARAMS, CopyKernelArgs
from orchestra.execute.lowering.copy_policy import copy_grid
from orchestra.graph import (
    Buffer,
    DeviceToHost,
    HostBuffer,
    HostFunc,
    HostToDevice,
    In,
    KernelNode,
    KernelRef,
    Out,
    TaskGraph,
)
from orchestra.schedule import schedule
from orchestra.trace import spans_from_event_pairs
from orchestra.trace.chrome import to_chrome_trace
from tests.fake_cuda import FakeCuda, fake_kernel, patch_eager_tracer
from tests.graphs_for_tests import (
    burn_pipeline,
    burn_reference,
    check_burn_outputs,
    fake_drivers,
    fake_executor,
)

KIB, MIB = 1 << 10, 1 << 20
BURN = KernelRef("burn.cu", "burn", params=BURN_PARAMS)
KINDS = ("eager", "capture", "graph-build")
N = 4096  # bytes per batch: below every default crossover


def pipeline(batches=3, nbytes=N, seed=0):
    return burn_pipeline(BURN, batches, nbytes, seed=seed)


@pytest.fixture
def fakes(monkeypatch):
    """(eager fake, graph fake), both with devices whose kernels address host memory."""
    return fake_drivers(monkeypatch, kernel_host_access=True)


def executor(kind, fakes, **kw):
    return fake_executor(kind, fakes, eager_kernel=fake_kernel, **kw)


def run(ex, kind, g, bind, **kw):
    if kind == "eager":
        return ex.run(g, bindings=bind, **kw)
    exe = ex.run(g, None, bind, **kw)
    exe.close()
    return exe


def copy_log(fakes, kind):
    return (fakes[0] if kind == "eager" else fakes[1]).copy_kernels


def h2d(nbytes, lowering="auto", name=None):
    return HostToDevice(name or f"h2d{nbytes}", HostBuffer(f"h{nbytes}", nbytes),
                        Buffer(f"d{nbytes}", nbytes), lowering=lowering)


def d2h(nbytes, lowering="auto"):
    return DeviceToHost(f"d2h{nbytes}", Buffer(f"e{nbytes}", nbytes),
                        HostBuffer(f"g{nbytes}", nbytes), lowering=lowering)


# -- the choice per copy ----------------------------------------------------------------------


def test_auto_chooses_by_size_mode_and_direction():
    table = CopyCrossover(graph_h2d=256 * KIB, graph_d2h=64 * KIB, eager_h2d=16 * KIB,
                          eager_d2h=0, source="test")
    graph = CopyPolicy("auto", "graph", table, True)
    eager = CopyPolicy("auto", "eager", table, True)
    assert graph.choose(h2d(4 * KIB)) == "kernel"
    assert graph.choose(h2d(256 * KIB - 1)) == "kernel"
    assert graph.choose(h2d(256 * KIB)) == "copy-engine"  # below the crossover only
    assert graph.choose(d2h(64 * KIB - 16)) == "kernel"
    assert graph.choose(d2h(64 * KIB)) == "copy-engine"
    assert eager.choose(h2d(4 * KIB)) == "kernel"
    assert eager.choose(h2d(64 * KIB)) == "copy-engine"
    assert eager.choose(d2h(1)) == "copy-engine"  # 0: never
    assert "64 KiB >= 64 KiB (test crossover, graph d2h)" in graph.reason(d2h(64 * KIB))


def test_the_default_crossover():
    graph = CopyPolicy("auto", "graph", DEFAULT_CROSSOVER, True)
    eager = CopyPolicy("auto", "eager", DEFAULT_CROSSOVER, True)
    assert [graph.choose(h2d(s)) for s in (4 * KIB, 64 * KIB, 256 * KIB, 16 * MIB)] == \
        ["kernel", "kernel", "copy-engine", "copy-engine"]
    assert eager.choose(h2d(4 * KIB)) == "copy-engine"
    assert "every copy on the copy engines" in eager.summary()
    assert "below 256 KiB (h2d) / 256 KiB (d2h)" in graph.summary()


def test_the_most_specific_choice_wins():
    small, big = 4 * KIB, 64 * MIB
    build_kernel = CopyPolicy("kernel", "graph", DEFAULT_CROSSOVER, True)
    build_engine = CopyPolicy("copy-engine", "graph", DEFAULT_CROSSOVER, True)
    assert build_kernel.choose(h2d(big)) == "kernel"
    assert build_engine.choose(h2d(small)) == "copy-engine"
    # the node's own lowering beats the build's
    assert build_kernel.choose(h2d(small, "copy-engine")) == "copy-engine"
    assert build_engine.choose(h2d(big, "kernel")) == "kernel"
    assert build_engine.reason(h2d(big, "kernel")) == "node lowering='kernel'"
    assert build_kernel.reason(h2d(small)) == "copy_lowering='kernel'"


def test_a_device_that_cannot_address_host_memory():
    p = CopyPolicy("auto", "graph", DEFAULT_CROSSOVER, False, "device 0 (old)")
    assert p.choose(h2d(4 * KIB)) == "copy-engine"  # auto: quietly the copy engines
    with pytest.raises(CopyLoweringError, match="node h2d4096 asks for lowering='kernel'.*"
                                                "device 0 \\(old\\) cannot address"):
        p.choose(h2d(4 * KIB, "kernel"))
    with pytest.raises(CopyLoweringError, match="copy_lowering='kernel' was asked for"):
        CopyPolicy("kernel", "graph", DEFAULT_CROSSOVER, False).choose(h2d(4 * KIB))


def test_unknown_lowerings_are_refused_where_given():
    with pytest.raises(ValueError, match="lowering must be one of 'auto', 'kernel', "
                                         "'copy-engine'; got 'gpu'"):
        h2d(4 * KIB, "gpu")
    with pytest.raises(TypeError, match="lowering must be one of"):
        h2d(4 * KIB, 1)
    with pytest.raises(CopyLoweringError, match="copy_lowering must be one of"):
        CopyPolicy("sm")
    fake = FakeCuda()
    with pytest.raises(CopyLoweringError):
        EagerExecutor(fake.device, driver=fake, copy_lowering="sm")


def test_copy_grid_follows_the_measured_best_grids():
    assert [copy_grid(n, 132) for n in (1, 4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB)] == \
        [1, 4, 16, 64, 132, 132]
    assert copy_grid(64 * MIB, 4) == 4  # never more blocks than SMs


# -- the graph spec and the plan printout -----------------------------------------------------


def test_spec_kinds_follow_the_policy():
    g, _, _ = pipeline(2)
    kinds = Counter(n.kind for n in translate(g).nodes)
    assert kinds["memcpy"] == 4 and kinds["kernel"] == 2  # no policy: copy engines
    spec = translate(g, copies=CopyPolicy("auto", "graph", DEFAULT_CROSSOVER, True))
    kinds = Counter(n.kind for n in spec.nodes)
    assert kinds["memcpy"] == 0 and kinds["kernel"] == 6
    h = spec.node("b0.h2d")
    assert (h.kind, h.source_kind, h.direction) == ("kernel", "h2d", "h2d")
    big, _, _ = pipeline(1, 1 * MIB)
    kinds = Counter(n.kind for n in translate(
        big, copies=CopyPolicy("auto", "graph", DEFAULT_CROSSOVER, True)).nodes)
    assert kinds["memcpy"] == 2 and kinds["kernel"] == 1


def _plan_lines(capsys, *argv):
    assert main(["plan", "--batches", "2", *argv]) == 0
    return capsys.readouterr().out


def test_plan_printout_marks_copy_kernels(capsys):
    out = _plan_lines(capsys, "--batch-mib", "0.0625", "--executor", "graph")
    assert re.search(r"run    b0\.h2d   \[copy kernel\]", out)
    assert re.search(r"run    b1\.d2h   \[copy kernel\]", out)
    assert "copies (graph executor): 4, 4 as copy kernels, 0 on copy engines" in out
    out = _plan_lines(capsys, "--batch-mib", "0.0625", "--executor", "eager")
    assert "[copy kernel]" not in out
    assert "4, 0 as copy kernels, 4 on copy engines" in out
    out = _plan_lines(capsys, "--batch-mib", "0.0625", "--executor", "eager",
                      "--copy-lowering", "kernel")
    assert out.count("[copy kernel]") == 4
    out = _plan_lines(capsys, "--batch-mib", "1", "--executor", "capture")
    assert "0 as copy kernels" in out  # 1 MiB is above the default crossover
    assert main(["plan", "--batches", "2", "--batch-mib", "0.0625", "--executor", "graph",
                 "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["copy_lowering"]
    assert (info["copies"], info["copy_kernels"], info["mode"]) == (4, 4, "graph")
    assert info["crossover"]["graph_h2d"] == 256 * KIB


# -- every executor runs copy kernels ---------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_executor_runs_copy_kernels_with_the_right_bytes(fakes, kind):
    eager, graph = fakes
    g, bs, bind = pipeline(3)
    with executor(kind, fakes, copy_lowering="kernel") as ex:
        res = run(ex, kind, g, bind)
    check_burn_outputs(bs, bind)
    log = copy_log(fakes, kind)
    assert len(log) == 6
    # no host function in the graph: no copy ends with the system-scope fence
    assert [f for *_, f in log] == [0] * 6
    hosts = {int(bind[b.host_in.buffer.name].ctypes.data) for b in bs}
    outs = {int(bind[b.host_out.buffer.name].ctypes.data) for b in bs}
    assert {src for _, src, _, _ in log} & hosts == hosts  # the H2Ds read the inputs
    assert {dst for dst, _, _, _ in log} & outs == outs  # the D2Hs write the outputs
    for dst, src, n, fence in log:
        assert n == N
    if kind == "eager":
        assert res.copy_kernels == 6
        assert eager.counts["cuLaunchKernel"] == 9
        assert not eager.counts["cuMemcpyHtoDAsync"] and not eager.counts["cuMemcpyDtoHAsync"]
    else:
        assert res.copy_kernels == 6
        assert not graph.counts["cuGraphAddMemcpyNode"] and not graph.counts["cuMemcpy3DAsync"]
        launches = "cuGraphAddKernelNode" if kind == "graph-build" else "cuLaunchKernel"
        assert graph.counts[launches] == 9


@pytest.mark.parametrize("kind", KINDS)
def test_d2h_copy_kernels_fence_when_a_host_function_reads_host_memory(fakes, kind):
    """With a HostFunc in the graph, every D2H copy kernel ends with __threadfence_system()
    (its stores reach host memory before a host thread reads them in stream order); the
    host function sees the right bytes."""
    g, bs, bind = pipeline(3)
    seen = {}
    last = bs[-1]

    def look():
        seen["out"] = bind[last.host_out.buffer.name].copy()

    g.add(HostFunc("look", look, reads=(last.host_out,)))  # after the D2H: it reads its bytes
    with executor(kind, fakes, copy_lowering="kernel") as ex:
        run(ex, kind, g, bind)
    check_burn_outputs(bs, bind)
    np.testing.assert_array_equal(seen["out"], bind[last.host_out.buffer.name])
    log = copy_log(fakes, kind)
    outs = {int(bind[b.host_out.buffer.name].ctypes.data) for b in bs}
    assert sorted((dst in outs, fence) for dst, _, _, fence in log) == (
        [(False, 0)] * 3 + [(True, 1)] * 3)


@pytest.mark.parametrize("kind", ("capture", "graph-build"))
def test_graph_executors_choose_automatically_and_records_say_kernel(fakes, kind):
    from orchestra.graph import Alloc, Free

    g, bs, bind = pipeline(2)
    big = Buffer("big", 1 * MIB)
    g.add(Alloc("big.alloc", big))
    g.add(HostToDevice("big.h2d", HostBuffer("big_in", 1 * MIB), big))
    g.add(Free("big.free", big))
    bind["big_in"] = np.zeros(MIB, np.uint8)
    with executor(kind, fakes) as ex:
        exe = ex.build(g, bindings=bind)
        exe.launch(sync=True)
        kinds = {n: r.kind for n, r in exe._records.items()}
        assert exe.copy_kernels == 4
        exe.close()
    check_burn_outputs(bs, bind)
    assert kinds["b0.h2d"] == kinds["b1.d2h"] == "kernel"
    assert kinds["big.h2d"] == "memcpy"  # 1 MiB: above the default crossover


@pytest.mark.parametrize("kind", KINDS)
def test_per_node_and_per_build_overrides(fakes, kind):
    g, bs, bind = pipeline(2)
    g2 = with_lowering(g, h2d="copy-engine")
    with executor(kind, fakes) as ex:
        run(ex, kind, g2, bind, copy_lowering="kernel")  # the nodes' own choice wins for h2d
        check_burn_outputs(bs, bind)
        log = copy_log(fakes, kind)
        outs = {int(bind[b.host_out.buffer.name].ctypes.data) for b in bs}
        assert len(log) == 2 and {dst for dst, *_ in log} == outs  # only the D2H copies
        log.clear()
        run(ex, kind, g, bind, copy_lowering="copy-engine")
        assert log == []
    with executor(kind, fakes, copy_lowering="copy-engine") as ex:
        run(ex, kind, with_lowering(g, d2h="kernel"), bind)
        assert len(copy_log(fakes, kind)) == 2


def test_eager_keeps_one_prepared_program_per_lowering(fakes):
    eager, _ = fakes
    g, bs, bind = pipeline(2)
    with executor("eager", fakes) as ex:
        for lowering in ("kernel", "copy-engine", "kernel", None):
            for b in bs:
                bind[b.host_out.buffer.name][:] = np.nan
            ex.run(g, bindings=bind, copy_lowering=lowering)
            check_burn_outputs(bs, bind)
        assert len(ex._prepared) == 3  # "kernel", "copy-engine" and the executor's "auto"
    assert eager.counts["cuMemcpyHtoDAsync"] == 2 * 2  # the two copy-engine runs
    assert len(eager.copy_kernels) == 2 * 4


def test_explicit_kernel_copies_on_a_device_that_cannot_are_refused_before_any_call(fakes):
    eager, graph = fakes
    eager.device.kernel_host_access = False
    graph.device.kernel_host_access = False
    g, bs, bind = pipeline(1)
    for kind in KINDS:
        with executor(kind, fakes) as ex:
            with pytest.raises(CopyLoweringError):
                run(ex, kind, g, bind, copy_lowering="kernel")
            run(ex, kind, g, bind)  # auto: the copy engines
            check_burn_outputs(bs, bind)
    assert not eager.copy_kernels and not graph.copy_kernels


@pytest.mark.parametrize("kind", KINDS)
def test_odd_sizes_and_offsets_reach_the_kernel(fakes, kind):
    """Copies of ragged sizes at odd offsets into and out of one device buffer: every byte
    lands where it should, and the kernel gets the offset addresses and sizes."""
    sizes = (1, 15, 17, 1000, 4099)
    total = sum(sizes) + 3
    g = TaskGraph()
    hin, hout, dev = HostBuffer("in", total), HostBuffer("out", total), Buffer("dev", total)
    from orchestra.graph import Alloc, Free

    g.add(Alloc("alloc", dev))
    off = 3
    for i, n in enumerate(sizes):
        g.add(HostToDevice(f"up{i}", hin.range(off, n), dev.range(off, n)))
        off += n
    off = 3
    for i, n in enumerate(sizes):
        g.add(DeviceToHost(f"down{i}", dev.range(off, n), hout.range(off, n)))
        off += n
    g.add(Free("free", dev))
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, total, dtype=np.uint8)
    y = np.zeros(total, np.uint8)
    with executor(kind, fakes, copy_lowering="kernel") as ex:
        run(ex, kind, g, {"in": x, "out": y})
    assert (y[3:] == x[3:]).all() and (y[:3] == 0).all()
    log = copy_log(fakes, kind)
    assert sorted(n for _, _, n, _ in log) == sorted(sizes * 2)
    starts = {src - x.ctypes.data for _, src, _, _ in log if 0 <= src - x.ctypes.data < total}
    assert starts == {3, 4, 19, 36, 1036}


# -- replays rebind host arrays behind copy kernels -------------------------------------------


@pytest.mark.parametrize("kind", ("capture", "graph-build"))
def test_replay_rebinds_host_arrays_of_copy_kernels(fakes, kind):
    _, graph = fakes
    g, bs, bind = pipeline(3)
    ins = {b.host_in.buffer.name for b in bs}
    other = {k: (v * np.float32(2) if k in ins else np.full_like(v, np.nan))
             for k, v in bind.items()}
    with executor(kind, fakes, copy_lowering="kernel") as ex:
        exe = ex.build(g, bindings=bind)
        exe.launch(sync=True)
        check_burn_outputs(bs, bind)
        before = graph.counts["cuGraphExecKernelNodeSetParams"]
        exe.replay(other)
        check_burn_outputs(bs, other)
        # one SetParams per copy kernel whose host array changed, none for memcpy nodes
        assert graph.counts["cuGraphExecKernelNodeSetParams"] - before == 6
        assert not graph.counts["cuGraphExecMemcpyNodeSetParams"]
        for b in bs:
            bind[b.host_out.buffer.name][:] = np.nan
        exe.replay(bind)  # back on the first arrays
        check_burn_outputs(bs, bind)
        exe.replay(bind)  # the same objects: no SetParams at all
        assert graph.counts["cuGraphExecKernelNodeSetParams"] - before == 12
        exe.close()


@pytest.mark.parametrize("kind", ("capture", "graph-build"))
def test_update_keeps_copy_kernels(fakes, kind):
    g, bs, bind = pipeline(2)
    g2, bs2, bind2 = pipeline(2, seed=5)
    with executor(kind, fakes, copy_lowering="kernel") as ex:
        exe = ex.build(g, bindings=bind)
        exe.launch(sync=True)
        res = exe.update(g2, bindings=bind2)
        assert res.updated
        exe.launch(sync=True)
        check_burn_outputs(bs2, bind2)
        exe.close()


def test_eager_rebinding_writes_the_copy_kernels_host_field(fakes):
    """Eager: the copy kernel's host pointer is written by the binding table when the array
    changes, not by the step on every run."""
    eager, _ = fakes
    g, bs, bind = pipeline(2)
    other = {k: v.copy() for k, v in bind.items()}
    with executor("eager", fakes, copy_lowering="kernel") as ex:
        for i in range(4):
            b = (bind, other)[i % 2]
            for name in (x.host_out.buffer.name for x in bs):
                b[name][:] = np.nan
            ex.run(g, bindings=b)
            check_burn_outputs(bs, b)
    ins = {int(b[x.host_in.buffer.name].ctypes.data) for b in (bind, other) for x in bs}
    hosts = [src for _, src, _, _ in eager.copy_kernels if src in ins]  # the H2D copies
    assert len(hosts) == 8 and hosts[:2] != hosts[2:4] and hosts[:2] == hosts[4:6]


# -- traces -----------------------------------------------------------------------------------


def test_eager_trace_marks_copy_kernels(fakes, monkeypatch):
    patch_eager_tracer(monkeypatch)
    g, bs, bind = pipeline(2)
    with executor("eager", fakes, copy_lowering="kernel") as ex:
        res = ex.run(g, bindings=bind, trace=True)
    spans = {s.name: s for s in res.timeline.spans}
    assert spans["b0.h2d"].lowering == "copy-kernel" and spans["b0.h2d"].engine == "upload"
    assert spans["b0.kernel"].lowering is None
    assert res.timeline.meta["copy_kernels"] == 4
    chrome = to_chrome_trace(res.timeline)
    cats = {e["name"]: e["cat"] for e in chrome["traceEvents"] if e.get("ph") == "X"}
    assert cats["b1.d2h"] == "download,copy-kernel" and cats["b1.kernel"] == "compute"


def test_spans_from_event_pairs_reads_the_lowered_meta():
    node = h2d(4 * KIB)
    tl = spans_from_event_pairs(0.0, [("s", node, 1.0, 2.0)],
                                {"lowered": {node.name: "copy-kernel"}},
                                elapsed=lambda a, b: b - a)
    assert tl.spans[0].lowering == "copy-kernel" and "lowered" not in tl.meta


# -- the crossover table ----------------------------------------------------------------------


def test_the_crossover_is_kept_per_device_in_the_cache(fakes):
    eager, _ = fakes
    dev = eager.device
    copy_table.forget_crossovers()
    assert copy_table.load_crossover(dev) is DEFAULT_CROSSOVER
    table = CopyCrossover(64 * KIB, 128 * KIB, 16 * KIB, 0, "measured today")
    assert copy_table.save_crossover(dev, table) is not None
    copy_table.forget_crossovers()  # read from disk, as another process would
    assert copy_table.load_crossover(dev) == table
    ex = EagerExecutor(dev, driver=eager, kernel_resolver=KernelResolver(dev, fake_kernel))
    assert ex.copy_policy().crossover == table and ex.copy_policy().mode == "eager"

    class Other:
        name, arch, sm_count, kernel_host_access = "Other GPU", "sm_90", 4, True

    assert copy_table.load_crossover(Other()) is DEFAULT_CROSSOVER  # keyed by the device
    dev.kernel_host_access = False
    assert copy_table.load_crossover(dev) is DEFAULT_CROSSOVER  # cannot run copy kernels


def test_crossover_arithmetic():
    sizes = (4, 16, 64, 256)
    eng = {4: 10.0, 16: 10.0, 64: 10.0, 256: 10.0}
    assert crossover_size(sizes, eng, {4: 5.0, 16: 6.0, 64: 11.0, 256: 12.0}) == 64
    # within the margin counts as the copy engines' win
    assert crossover_size(sizes, eng, {4: 5.0, 16: 9.8, 64: 11.0, 256: 12.0}) == 16
    # a noisy win above the crossover does not move it down
    assert crossover_size(sizes, eng, {4: 5.0, 16: 11.0, 64: 9.0, 256: 12.0}) == 256
    assert crossover_size(sizes, eng, {s: 20.0 for s in sizes}) == 0  # engines win everywhere
    assert crossover_size(sizes, eng, {s: 1.0 for s in sizes}) == 512  # kernels everywhere
    assert crossover_size(sizes, {}, {}) == 0


def test_with_lowering_keeps_the_graph():
    g, _, _ = pipeline(2)
    g2 = with_lowering(g, h2d="kernel")
    assert [n.name for n in g2.nodes] == [n.name for n in g.nodes]
    assert set(g2.edges) == set(g.edges)
    assert {n.lowering for n in g2.nodes if n.kind == "h2d"} == {"kernel"}
    assert {n.lowering for n in g2.nodes if n.kind == "d2h"} == {"auto"}


# -- the copy kernel --------------------------------------------------------------------------


def test_the_copy_kernel_compiles_for_sm90_with_its_vector_path_and_fence():
    from orchestra.compiler.sources import kernel_source_dir

    path = kernel_source_dir() / "copy.cu"
    res = oc.compile(path, arch="sm_90")
    assert res.cubin[:4] == b"\x7fELF"
    ptx = oc.compile(path, arch="sm_90", ptx=True).cubin
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    assert "ld.global.v4.u32" in ptx and "st.global.v4.u32" in ptx  # 16-byte words
    assert "ld.global.u8" in ptx  # the head, tail and unaligned paths
    assert "membar.sys" in ptx  # __threadfence_system for D2H
    params = parse_params(path.read_text(), "orchestra_copy")
    assert [p.ctype for p in params] == [c.rsplit(" ", 1)[0] for c in COPY_PARAMS]


def test_resolved_copy_kernels_launch_with_the_chosen_grid(fakes):
    g, _, bind = pipeline(1, 64 * KIB)
    with executor("graph-build", fakes, copy_lowering="kernel") as ex:
        exe = ex.build(g, bindings=bind)
        ka = exe._built.copies["b0.h2d"]
        assert isinstance(ka, CopyKernelArgs)
        assert ka.config.grid == (min(16, fakes[1].device.sm_count), 1, 1)
        assert ka.config.block == (256, 1, 1)
        exe.close()


# -- eager: driver calls per run --------------------------------------------------------------


def request_graph(external: bool):
    nb = 64 * KIB
    from orchestra.graph import Alloc, Free

    hin, hout = HostBuffer("host_in", nb), HostBuffer("host_out", nb)
    din, dout = Buffer("d_in", nb), Buffer("d_out", nb)
    g = TaskGraph()
    if not external:
        g.add(Alloc("alloc_in", din))
        g.add(Alloc("alloc_out", dout))
    g.add(HostToDevice("h2d", hin, din))
    g.add(KernelNode("kernel", BURN, 64, 256, (In(din), Out(dout), nb // 4, 1, 0.5, 1.0)))
    g.add(DeviceToHost("d2h", dout, hout))
    if not external:
        g.add(Free("free_in", din))
        g.add(Free("free_out", dout))
    return g


class _DeviceBuffer:
    def __init__(self, fake, nbytes):
        ptr, = [fake.cuMemAllocFromPoolAsync(nbytes, None, 0)[1]]
        self.ptr, self.nbytes = int(ptr), nbytes


@pytest.mark.parametrize("external", (True, False))
@pytest.mark.parametrize("lowering", ("copy-engine", "kernel"))
def test_one_request_makes_one_driver_call_per_node_and_no_event(fakes, external, lowering):
    eager, _ = fakes
    g = request_graph(external)
    x = np.random.default_rng(2).standard_normal(16 * KIB).astype(np.float32)
    y = np.zeros_like(x)
    bind = {"host_in": x, "host_out": y}
    if external:
        bind.update(d_in=_DeviceBuffer(eager, 64 * KIB), d_out=_DeviceBuffer(eager, 64 * KIB))
    with executor("eager", fakes, copy_lowering=lowering) as ex:
        plan = ex.prepare(g, policy="by-engine", streams=1)
        assert plan.event_count == 0 and len(plan.streams) == 1
        for i in range(3):
            y[:] = np.nan
            eager.log.clear()
            res = ex.run(g, plan, bind)
            np.testing.assert_array_equal(y, burn_reference(x, 1))
            calls = [c[0] for c in eager.log]
            assert calls.count("sync") == 1 and calls[-1] == "sync"
            assert len(eager.driver_calls()) == len(g) == res.steps
            assert not {"cuEventRecord", "cuStreamWaitEvent"} & set(calls)
            assert res.nodes == len(g) and res.events == res.waits == 0 and res.streams == 1


def test_eager_runs_on_three_streams_count_their_events(fakes):
    eager, _ = fakes
    g, bs, bind = pipeline(4)
    with executor("eager", fakes) as ex:
        plan = ex.prepare(g)
        ex.run(g, plan, bind)
        eager.log.clear()
        res = ex.run(g, plan, bind)
    check_burn_outputs(bs, bind)
    n = len(eager.driver_calls())
    assert n == res.steps == len(g) + res.events + res.waits
    assert res.events == plan.event_count


def test_the_benchmarks_goal_lines():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_copy_lowering.py"
    spec = importlib.util.spec_from_file_location("bench_copy_lowering", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def rows(bare, auto):
        return [{"contender": "bare", **bare}, {"contender": "graph auto", **auto}]

    lines = bench.goals({
        "1024x64KiB@1": rows({"host_us": 4000, "gpu_ms": 5.0, "wall_ms": 5.2},
                             {"host_us": 40, "gpu_ms": 4.0, "wall_ms": 4.1}),
        "4096x4KiB@1": rows({"host_us": 26000, "gpu_ms": 26.0, "wall_ms": 26.0},
                            {"host_us": 70, "gpu_ms": 11.0, "wall_ms": 11.0}),
        "64x16MiB": rows({"host_us": 500, "gpu_ms": 21.9, "wall_ms": 22.0},
                         {"host_us": 500, "gpu_ms": 22.6, "wall_ms": 22.6}),
    })
    assert "goal host <= 100 µs and GPU <= 0.85x: met" in lines[0]
    assert "2.36x faster" in lines[1] and "goal >= 2.5x: NOT met" in lines[1]
    assert "goal within 2% of bare: NOT met" in lines[2]
    # with the by-engine row of the same exec, the line says what the auto policy gained
    lanes = bench.goals({"4096x4KiB@1": [
        {"contender": "bare", "host_us": 28007, "gpu_ms": 28.0, "wall_ms": 28.0},
        {"contender": "graph auto", "plan": "round-robin x16", "host_us": 110,
         "gpu_ms": 2.5, "wall_ms": 2.8},
        {"contender": "graph auto by-engine", "plan": "by-engine x3", "host_us": 146,
         "gpu_ms": 11.9, "wall_ms": 11.9}]})
    assert "graph auto (round-robin x16) host 110 µs" in lanes[0]
    assert "10.00x faster than bare (by-engine x3: 2.35x, so the auto policy 4.25x faster)" \
        in lanes[0] and "goal >= 2.5x: met" in lanes[0]


def test_each_direction_is_judged_by_the_best_variant_on_either_side():
    from orchestra.execute.copy_tuning import direction_times

    # D2H as kernels alone loses to the engines, but every copy as a kernel wins by far: the
    # D2H side of that comparison is the both-kernel run (a graph with no memcpy node)
    ms = {4096: {"copy-engine": 2.0, "h2d-kernel": 1.8, "d2h-kernel": 2.1, "both-kernel": 1.0},
          65536: {"copy-engine": 2.2, "h2d-kernel": 1.8, "d2h-kernel": 2.3, "both-kernel": 1.2},
          1 << 20: {"copy-engine": 1.9, "h2d-kernel": 2.2, "d2h-kernel": 2.0,
                    "both-kernel": 2.4}}
    eng, ker = direction_times(ms, "d2h")
    assert eng == {4096: 1.8, 65536: 1.8, 1 << 20: 1.9}
    assert ker == {4096: 1.0, 65536: 1.2, 1 << 20: 2.0}
    sizes = sorted(ms)
    assert crossover_size(sizes, eng, ker) == 1 << 20  # kernels below 1 MiB
    eng, ker = direction_times(ms, "h2d")
    assert eng == {4096: 2.0, 65536: 2.2, 1 << 20: 1.9}
    assert ker == {4096: 1.0, 65536: 1.2, 1 << 20: 2.2}
    assert crossover_size(sizes, eng, ker) == 1 << 20
    # the old rule (D2H kernels against all engines) would have kept D2H on the engines
    old = {s: ms[s]["copy-engine"] for s in sizes}
    assert crossover_size(sizes, old, {s: ms[s]["d2h-kernel"] for s in sizes}) == 0
