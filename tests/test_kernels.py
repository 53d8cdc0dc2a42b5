"""CPU tests of the kernel library (no GPU needed): every kernel compiles for sm_90 through
orchestra.compiler, name expressions resolve to kernels present in the cubin, the hand-written
PTX links to a cubin with nvJitLink, parameters are readable, each source states its launch
requirements, the PDL wait check (case C12) reads PTX right, and the numpy references and the
check runner behave."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestra.compiler import compile, link_ptx, normalize_params, parse_params
from orchestra.app.kernels_bench import catalog as cat
from orchestra.app.kernels_bench import reference as ref
from orchestra.app.kernels_bench.pdl import (
    PdlWithoutWaitError,
    entry_points,
    kernel_waits_on_grid_dependency,
    kernels_waiting_on_grid_dependency,
    require_grid_dependency_wait,
)

ARCH = "sm_90"
CU_SOURCES = sorted({s.source for s in cat.SPECS if not s.is_ptx})
RUNNER = Path(__file__).with_name("kernel_checks.py")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """One NVRTC compile per source file for the whole module (the autouse cache fixture gives
    every test its own cache, so compile here once instead of once per test)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path_factory.mktemp("kernels-cache")))
        for src, specs in cat.sources().items():
            if specs[0].is_ptx:
                out[src] = link_ptx(specs[0].path(), arch=ARCH)
            else:
                exprs = tuple(s.name for s in specs if s.name_expression)
                out[src] = compile(specs[0].path(), arch=ARCH, name_expressions=exprs)
    return out


@pytest.mark.parametrize("source", CU_SOURCES)
def test_cu_compiles_for_sm90_with_a_clean_log(compiled, source):
    res = compiled[source]
    assert res.cubin[:4] == b"\x7fELF"
    assert res.arch == ARCH
    assert "warning" not in res.log.lower(), res.log


@pytest.mark.parametrize("spec", [s for s in cat.SPECS if not s.is_ptx], ids=lambda s: s.key)
def test_every_kernel_is_in_its_cubin(compiled, spec):
    res = compiled[spec.source]
    lowered = res.lowered_names.get(spec.name, spec.name)
    assert lowered in res.kernel_names(), (spec.key, res.kernel_names())


def test_pipeline_block_name_expressions_resolve_to_four_instantiations(compiled):
    res = compiled["pipeline_block.cu"]
    exprs = [f"pipeline_block<{s}>" for s in cat.STAGE_COUNTS]
    lowered = [res.lowered_names[e] for e in exprs]
    assert len(set(lowered)) == 4
    for s, name in zip(cat.STAGE_COUNTS, lowered):
        assert name.startswith("_Z14pipeline_blockILi") and f"ILi{s}E" in name
        assert name in res.kernel_names()


def test_ptx_links_to_a_cubin_for_sm90(compiled):
    cubin = compiled["cp_async.ptx"]
    assert cubin[:4] == b"\x7fELF"
    from orchestra.compiler import kernel_names

    assert "cp_async_scale" in kernel_names(cubin)


def test_ptx_uses_the_cp_async_group_instructions():
    text = cat.spec("cp_async_scale").path().read_text()
    code = re.sub(r"//[^\n]*", "", text)
    for instr in ("cp.async.cg.shared.global", "cp.async.ca.shared.global",
                  "cp.async.commit_group", "cp.async.wait_group", "cp.async.wait_all"):
        assert instr in code, instr
    assert re.search(r"^\.version 8\.0$", code, re.M) and re.search(r"^\.target sm_80$", code,
                                                                      re.M)


def test_ptx_never_copies_past_the_end_of_x():
    """memcheck checks a cp.async's whole cp-size, src-size or not: the ragged tail must be
    copied float by float (4-byte cp.async.ca), never as a 16-byte copy with a src-size."""
    code = re.sub(r"//[^\n]*", "", cat.spec("cp_async_scale").path().read_text())
    copies = re.findall(r"cp\.async\.(ca|cg)\.shared\.global\s+\[[^\]]*\],\s*\[[^\]]*\],\s*"
                        r"([^;]*);", code)
    assert copies, "no cp.async copies found"
    assert all("," not in size for _, size in copies), copies  # no src-size operand
    assert ("cg", "16") in copies
    assert [c for c in copies if c == ("ca", "4")] and all(
        s == "4" for q, s in copies if q == "ca"), copies


def test_ptx_params_match_the_entry_declaration():
    params = normalize_params(cat.CP_ASYNC_PARAMS)
    assert [p.size for p in params] == [8, 8, 8, 4]
    text = cat.spec("cp_async_scale").path().read_text()
    decl = re.search(r"\.entry cp_async_scale\((.*?)\)", text, re.S).group(1)
    types = re.findall(r"\.param \.(\w+)", decl)
    assert types == ["u64", "u64", "u64", "f32"]


@pytest.mark.parametrize("spec", [s for s in cat.SPECS if s.params is None], ids=lambda s: s.key)
def test_parameters_are_read_from_the_source(spec):
    params = parse_params(spec.path().read_text(), spec.name)
    assert params and all(p.size in (4, 8) for p in params)


def test_template_params_are_explicit_and_match():
    params = normalize_params(cat.spec("pipeline_block<1>").params)
    assert [p.ctype for p in params] == ["const float*", "float*", "unsigned long long", "float",
                                         "float"]


@pytest.mark.parametrize("path", sorted({s.path() for s in cat.SPECS}), ids=lambda p: p.name)
def test_each_source_states_its_launch_requirements(path):
    head = path.read_text()[:6000].lower()
    assert "launch requirements" in head or "kernels (" in head or "kernel 1:" in head
    for word in ("block", "grid", "shared memory"):
        assert word in head, f"{path.name}: header comment does not mention {word!r}"


def test_block_pipeline_is_made_by_the_whole_block_and_never_by_one_warp():
    """DESIGN note: a unified block-scope pipeline is used by every thread of its group."""
    src = cat.spec("pipeline_block<1>").path().read_text()
    assert "cuda::make_pipeline(block, &state)" in src
    ws = cat.spec("warp_specialized").path().read_text()
    # partitioned pipelines with explicit roles, each over the warps that use it, and quit()
    assert ws.count("cuda::pipeline_role::producer") == 2
    assert ws.count("cuda::pipeline_role::consumer") == 2
    assert "make_pipeline(block" not in ws
    assert ws.count(".quit()") >= 4


# -- programmatic dependent launch: the wait check (case C12) ------------------------------------

@pytest.fixture(scope="module")
def pdl_ptx(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path_factory.mktemp("pdl-cache")))
        res = compile(cat.spec("pdl_primary").path(), arch=ARCH, ptx=True)
    return res.cubin.decode()


def test_pdl_kernels_wait_where_they_must(pdl_ptx):
    waits = kernels_waiting_on_grid_dependency(pdl_ptx)
    assert waits == {"pdl_primary": False, "pdl_secondary": True, "pdl_secondary_nowait": False,
                     "pdl_chain_step": True, "pdl_chain_step_after_wait": True,
                     "pdl_spin": False}
    assert "griddepcontrol.launch_dependents" in entry_points(pdl_ptx)["pdl_primary"]


def test_chain_links_trigger_before_and_after_their_wait(pdl_ptx):
    bodies = entry_points(pdl_ptx)

    def order(name):
        body = bodies[name]
        return body.index("griddepcontrol.launch_dependents"), body.index("griddepcontrol.wait")

    trig, wait = order("pdl_chain_step")
    assert trig < wait  # the next link may launch before this one waits
    trig, wait = order("pdl_chain_step_after_wait")
    assert wait < trig


def test_pdl_is_refused_for_a_consumer_that_never_waits(pdl_ptx):
    require_grid_dependency_wait(pdl_ptx, "pdl_secondary")
    require_grid_dependency_wait(pdl_ptx, "pdl_chain_step")
    require_grid_dependency_wait(pdl_ptx, "pdl_chain_step_after_wait")
    with pytest.raises(PdlWithoutWaitError, match="pdl_secondary_nowait never executes"):
        require_grid_dependency_wait(pdl_ptx, "pdl_secondary_nowait")


def test_ptx_text_gives_the_lowered_entry_of_a_template():
    ptx, entry = cat.ptx_text(cat.spec("pipeline_block<3>"))
    assert entry == "_Z14pipeline_blockILi3EEvPKfPfyff"
    assert entry in entry_points(ptx)
    assert kernel_waits_on_grid_dependency(ptx, entry) is False


_SYNTHETIC = """
.version 8.0
.target sm_90
.address_size 64
.func helper() { griddepcontrol.wait; ret; }
.func (.param .b32 r) middle(.param .b32 a) { call.uni helper, (); ret; }
.func (.param .b32 r) proto(.param .b32 a);
.visible .entry through_calls(.param .u64 p) .maxntid 128, 1, 1
{ call.uni (retval0), middle, (param0); ret; }
.visible .entry commented() { // griddepcontrol.wait;
  /* griddepcontrol.wait; */ ret; }
.visible .entry predicated() { @%p1 griddepcontrol.wait; ret; }
.visible .entry plain() { griddepcontrol.launch_dependents; ret; }
"""


def test_wait_scan_follows_calls_and_ignores_comments_and_prototypes():
    assert kernels_waiting_on_grid_dependency(_SYNTHETIC) == {
        "through_calls": True, "commented": False, "predicated": True, "plain": False}
    assert kernel_waits_on_grid_dependency(_SYNTHETIC.encode() + b"\0", "through_calls")
    with pytest.raises(ValueError, match="name the one"):
        kernel_waits_on_grid_dependency(_SYNTHETIC)
    with pytest.raises(ValueError, match="no kernel 'missing'"):
        kernel_waits_on_grid_dependency(_SYNTHETIC, "missing")


# -- references and launch helpers ---------------------------------------------------------------

def test_cluster_reference_of_one_block_clusters_mirrors_its_own_tile():
    x = np.arange(10, dtype=np.float32)
    y = ref.cluster_dsmem(x, block=4, cluster=1, grid=3)
    pad = np.zeros(12, np.float32)
    pad[:10] = x
    want = (pad.reshape(3, 4) + 0.5 * pad.reshape(3, 4)[:, ::-1]).reshape(-1)[:10]
    assert np.array_equal(y, want)
    y2 = ref.cluster_dsmem(x, block=4, cluster=2, grid=4)
    assert y2[0] == x[0] + 0.5 * x[7] and y2[4] == x[4] + 0.5 * x[3]


def test_primitives_reference_mirrors_inside_each_short_or_full_tile():
    x = np.arange(11, dtype=np.float32)
    y = ref.pipeline_primitives(x, block=2)  # tiles of 8: [0..7], [8..10]
    assert y[0] == 3.5 and y[7] == 3.5 and y[8] == 9.0 and y[10] == 9.0


def test_ragged_offsets_and_segment_references():
    rng = np.random.default_rng(0)
    off = ref.ragged_offsets(rng, 50, 9)
    assert off.dtype == np.uint32 and off[0] == 0 and np.all(np.diff(off.astype(np.int64)) >= 0)
    x = rng.standard_normal(int(off[-1])).astype(np.float32)
    scan = ref.early_exit_segments(x, off)
    sums = ref.early_exit_warps(x, off)
    for s in range(50):
        b, e = int(off[s]), int(off[s + 1])
        if e > b:
            assert scan[e - 1] == pytest.approx(sums[s], rel=1e-4, abs=1e-5)
        else:
            assert sums[s] == 0


def test_launch_requirement_helpers():
    assert cat.pipeline_block_smem(4, 256) == 32 * 1024  # under the 48 KiB default
    assert cat.pipeline_block_tile(256) == 2048
    assert cat.cluster_grid(1, 128, 4) == 4 and cat.cluster_grid(129, 128, 2) == 2
    assert cat.cluster_grid(3 * 128 + 1, 128, 4) == 4
    with pytest.raises(KeyError, match="known"):
        cat.spec("nope")


def test_pattern_is_exact_under_the_bench_transform():
    from orchestra.app.kernels_bench.common import pattern
    from orchestra.app.kernels_bench.stages import A, B

    x = pattern(0, 5000).astype(np.float64)
    y32 = np.float32(A) * pattern(0, 5000) + np.float32(B)
    assert np.array_equal(y32.astype(np.float64), A * x + B)  # no rounding anywhere


# -- the GPU check runner, as far as it goes without a GPU --------------------------------------

def test_check_runner_lists_every_kernel():
    out = subprocess.run([sys.executable, str(RUNNER), "--list"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    names = out.stdout.split()
    for s in cat.STAGE_COUNTS:
        assert f"pipeline_block_{s}" in names
    for name in ("pipeline_thread", "pipeline_primitives", "producer_consumer",
                 "warp_specialized", "early_exit_segments", "early_exit_warps", "pdl_pair",
                 "pdl_c12", "pdl_chain", "cluster_dsmem", "cluster_dsmem_pair",
                 "cp_async_scale"):
        assert name in names


def test_check_runner_refuses_unknown_names():
    out = subprocess.run([sys.executable, str(RUNNER), "no_such_check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "unknown check" in out.stderr


def test_bench_cli_is_registered():
    from orchestra.cli.main import build_parser

    args = build_parser().parse_args(["bench", "stages", "--mib", "64", "--json"])
    assert args.mib == 64 and args.json and callable(args.func)
    args = build_parser().parse_args(["bench", "pdl", "--kernels", "10"])
    assert args.kernels == 10 and callable(args.func)


# -- launching the PDL chain: the launch config is built once -------------------------------------

def test_ex_launch_builds_its_launch_config_once_per_configuration_and_stream(monkeypatch):
    from types import SimpleNamespace

    from cuda.bindings import driver

    from orchestra.compiler import LaunchConfig
    from orchestra.kernel import module as mod

    sent = []
    fake = SimpleNamespace(cuLaunchKernelEx=lambda cfg, f, a, e: (sent.append(cfg), (0,))[1])
    monkeypatch.setattr(mod, "_drv", lambda: fake)
    k = object.__new__(mod.Kernel)
    k._ex, k.function, k.name, k.layout = {}, "function", "link", None
    checked = []
    k.launch_config = lambda *a, **kw: (checked.append(a), LaunchConfig.make(*a, **kw))[1]
    k._args_address = lambda args: (args, 0x1234)
    s1 = SimpleNamespace(handle=driver.CUstream(0x5000))
    s2 = SimpleNamespace(handle=driver.CUstream(0x6000))
    for _ in range(3):
        k.launch(s1, 1, 256, (), pdl=True)
    k.launch(s2, 1, 256, (), pdl=True)
    k.launch(s1, 2, 256, (), pdl=True)
    assert len(checked) == 3  # (s1, grid 1), (s2, grid 1), (s1, grid 2)
    assert sent[0] is sent[1] is sent[2]
    assert sent[3] is not sent[0] and int(sent[3].hStream) == 0x6000
    assert sent[4].gridDimX == 2 and sent[0].numAttrs == 1
    assert int(sent[0].attrs[0].value.programmaticStreamSerializationAllowed) == 1


# -- prebuilt cubins, one process per check, the sanitizer loop -----------------------------------

def test_prebuilt_cubins_are_built_without_a_gpu_and_refused_when_stale(tmp_path):
    import json

    out = tmp_path / "cubins"
    proc = subprocess.run([sys.executable, str(RUNNER), "--build-cubins", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "--cubins" in proc.stdout
    assert {p.name for p in out.glob("*.cubin")} == {f"{src}.cubin" for src in cat.sources()}
    meta = json.loads((out / "pipeline_block.cu.json").read_text())
    assert meta["arch"] == "sm_90" and meta["compiler"].startswith("nvrtc ")
    assert meta["lowered_names"]["pipeline_block<2>"] == "_Z14pipeline_blockILi2EEvPKfPfyff"
    assert (out / "cp_async.ptx.cubin").read_bytes()[:4] == b"\x7fELF"

    class Dev:
        ordinal, arch = 0, "sm_90"

    meta["sha256"] = "0" * 64
    (out / "pipeline_block.cu.json").write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match="another version of pipeline_block.cu"):
        cat._load_prebuilt(cat.spec("pipeline_block<2>"), Dev(), out)
    Dev.arch = "sm_100"
    with pytest.raises(RuntimeError, match="is for sm_90"):
        cat._load_prebuilt(cat.spec("warp_specialized"), Dev(), out)
    with pytest.raises(RuntimeError, match="--build-cubins"):
        cat._load_prebuilt(cat.spec("warp_specialized"), Dev(), tmp_path / "nothing")


def test_isolated_checks_each_get_a_process_and_a_summary():
    """Without a GPU every child fails (no device); the parent still runs each and sums up."""
    from orchestra.driver.check import device_available

    if device_available():
        pytest.skip("this test expects the checks to fail for want of a GPU")
    out = subprocess.run([sys.executable, str(RUNNER), "--isolate", "pdl_c12", "pdl_pair"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "0 of 2 checks passed (one process each); failed: pdl_c12, pdl_pair" in out.stdout


def test_sanitizer_loop_runs_every_tool_on_every_check_and_tabulates(tmp_path):
    san, py = tmp_path / "san", tmp_path / "py"
    san.write_text("""#!/bin/bash
[ "$1" = --version ] && { echo "fake version 1"; exit 0; }
tool=$2; shift 4
"$@"; rc=$?
[ "$tool" = racecheck ] && echo "==== RACECHECK SUMMARY: 0 hazards displayed (0 errors)" \
                       || echo "==== ERROR SUMMARY: 0 errors"
[ "$tool" = synccheck ] && [ "${@: -1}" = a_check ] && exit 99
exit $rc
""")
    py.write_text("""#!/bin/bash
[ "$2" = --list ] && { printf 'a_check\\nb_check\\n'; exit 0; }
name=${@: -1}
[ "$name" = b_check ] && [ "$2" != --small ] && exit 3
echo "PASS $name (0.0 s)"
""")
    san.chmod(0o755)
    py.chmod(0o755)
    script = Path(__file__).with_name("run_sanitizers.sh")
    env = {"PATH": "/usr/bin:/bin", "SANITIZER": str(san), "PYTHON": str(py),
           "LOGDIR": str(tmp_path / "logs")}
    out = subprocess.run(["bash", str(script), "memcheck", "synccheck"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(re.match(r"memcheck\s+a_check\s+ok\s", ln) for ln in lines), out.stdout
    assert any(re.match(r"synccheck\s+a_check\s+ERRORS\s", ln) for ln in lines), out.stdout
    assert any(re.match(r"b_check\s+ok\s+ok", ln) for ln in lines), out.stdout
    assert (tmp_path / "logs" / "synccheck.a_check.log").is_file()
