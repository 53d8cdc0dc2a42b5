"""The target architecture, checked before any compiler runs: a virtual ``compute_XY`` makes PTX
or is refused (never silently a cubin for sm_XY), an architecture the NVRTC in use does not
offer (``nvrtcGetSupportedArchs``) is an `UnsupportedArchError` listing those it does, an
``a`` / ``f`` variant the architecture lacks is refused, and a `KernelRef` never sets the
architecture in its options. Through `compile`, `link_ptx`, `orchestra compile --arch` and
`KernelRef`. No GPU needed (NVRTC and nvJitLink run on the host)."""

from __future__ import annotations

import json
import pickle

import pytest

import orchestra.compiler.nvrtc as nv
import orchestra.compiler.ptx as px
from orchestra.cli.main import main
from orchestra.compiler import compile as nvrtc_compile
from orchestra.compiler import link_ptx
from orchestra.compiler.target import normalize_arch, split_arch, virtual_arch
from orchestra.errors import (
    CompilerArgumentValueError,
    NodeFieldValueError,
    OrchestraError,
    UnsupportedArchError,
)

SAXPY = ('extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {\n'
         '    int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
         '    if (i < n) y[i] = a * x[i] + y[i];\n}\n')


@pytest.fixture
def no_compiler(monkeypatch):
    """NVRTC and nvJitLink fail the test if they run: the refusal must come first."""
    def refuse(*a, **k):
        raise AssertionError("the compiler ran")
    monkeypatch.setattr(nv, "_run_nvrtc", refuse)
    monkeypatch.setattr(px, "_run_nvjitlink", refuse)


@pytest.fixture
def nvrtc_offers(monkeypatch):
    """Pretend the NVRTC in use is 13.0 offering sm_75 .. sm_120 (nvJitLink the same)."""
    monkeypatch.setattr(nv, "supported_archs", lambda: (75, 80, 86, 89, 90, 100, 120))
    monkeypatch.setattr(nv, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(px, "nvjitlink_version", lambda: (13, 0))


OFFERED = "sm_75, sm_80, sm_86, sm_89, sm_90, sm_100, sm_120"


# -- reading an architecture -----------------------------------------------------------------------


@pytest.mark.parametrize("given,expected", [
    ("sm_90", ("sm_90", False)), ("compute_90", ("sm_90", True)), ("90", ("sm_90", False)),
    ((9, 0), ("sm_90", False)), ("9.0", ("sm_90", False)), ("sm_90a", ("sm_90a", False)),
    ("compute_90a", ("sm_90a", True)), ("sm_100f", ("sm_100f", False)),
    ("COMPUTE_120", ("sm_120", True)),
])
def test_split_arch(given, expected):
    assert split_arch(given) == expected
    assert virtual_arch(given) == "compute_" + expected[0][3:]


@pytest.mark.parametrize("given,message", [
    ("sm_80a", "GPU architecture 'sm_80a': the architecture-specific variant 'a' exists from "
               "compute capability 9.0 on (sm_90a); use sm_80"),
    ("sm_90f", "GPU architecture 'sm_90f': the family-specific variant 'f' exists from compute "
               "capability 10.0 on (sm_100f); use sm_90"),
    ((9, "x"), "unknown GPU architecture (9, 'x'): pass a name like arch=\"sm_90\" (compute "
               "capability 9.0), or a compute capability such as (9, 0)"),
    ((True, 0), "unknown GPU architecture (True, 0)"),
])
def test_split_arch_refuses_what_is_not_an_architecture(given, message):
    with pytest.raises(CompilerArgumentValueError) as info:
        split_arch(given)
    assert str(info.value).startswith(message)


def test_the_real_nvrtc_offers_a_sorted_list_without_sm_35():
    archs = nv.supported_archs()
    assert list(archs) == sorted(archs) and 90 in archs and 35 not in archs
    assert nv.check_arch_supported("sm_90a") == "sm_90a"


# -- the Python compile API ------------------------------------------------------------------------


def test_an_arch_nvrtc_does_not_offer_is_refused_with_the_list(no_compiler, nvrtc_offers):
    with pytest.raises(UnsupportedArchError) as info:
        nvrtc_compile(SAXPY, arch="sm_35")
    err = info.value
    assert str(err) == (f"NVRTC 13.0 cannot compile for sm_35: it supports {OFFERED} "
                        "(nvrtcGetSupportedArchs); pass one of those, or use a CUDA toolkit "
                        "whose NVRTC supports sm_35")
    assert isinstance(err, CompilerArgumentValueError) and isinstance(err, ValueError)
    assert isinstance(err, OrchestraError)
    assert err.arch == "sm_35" and err.supported[0] == "sm_75" and err.compiler == "NVRTC 13.0"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is UnsupportedArchError and str(back) == str(err)
    for arch, real in (("sm_121", "sm_121"), ("compute_110", "sm_110"),
                       ("sm_103a", "sm_103a")):  # too new for this NVRTC, PTX or not
        with pytest.raises(UnsupportedArchError, match=f"^NVRTC 13.0 cannot compile for {real}:"):
            nvrtc_compile(SAXPY, arch=arch, ptx=True)


def test_the_device_arch_is_checked_too(no_compiler, nvrtc_offers, monkeypatch):
    monkeypatch.setattr(nv, "default_arch", lambda: "sm_70")
    with pytest.raises(UnsupportedArchError, match=r"^NVRTC 13\.0 cannot compile for sm_70 \(the "
                                                   r"current device's architecture\): it supports "
                                                   r"sm_75, "):
        nvrtc_compile(SAXPY)


def test_the_real_nvrtc_refuses_sm_35_before_it_runs(no_compiler):
    with pytest.raises(UnsupportedArchError) as info:
        nvrtc_compile(SAXPY, arch="sm_35")
    assert info.value.supported == tuple(f"sm_{a}" for a in nv.supported_archs())
    assert "sm_90" in str(info.value)


def test_compute_arch_without_ptx_is_refused_and_with_ptx_makes_ptx(no_compiler):
    with pytest.raises(CompilerArgumentValueError) as info:
        nvrtc_compile(SAXPY, arch="compute_90")
    assert str(info.value) == ("'compute_90' is a virtual architecture: NVRTC makes PTX for it, "
                               "not a cubin; for compute_90 PTX pass ptx=True, for a cubin pass "
                               "arch=\"sm_90\"")
    assert type(info.value) is CompilerArgumentValueError


def test_compute_arch_with_ptx_is_the_same_ptx_as_sm_arch_with_ptx():
    res = nvrtc_compile(SAXPY, arch="compute_90", ptx=True)
    assert res.ptx and b".target sm_90" in res.cubin and b".entry saxpy" in res.cubin
    assert "--gpu-architecture=compute_90" in res.options and res.arch == "sm_90"
    again = nvrtc_compile(SAXPY, arch="sm_90", ptx=True)
    assert again.cache_hit and again.key == res.key and again.cubin == res.cubin


def test_link_ptx_refuses_virtual_and_unsupported_archs(no_compiler, nvrtc_offers):
    ptx = (b"//\n.version 8.0\n.target sm_90\n.address_size 64\n"
           b".visible .entry k() { ret; }\n")
    with pytest.raises(CompilerArgumentValueError, match=r"^'compute_90' is a virtual "
                                                         r"architecture: nvJitLink links PTX into"
                                                         r" a cubin for a real one; pass "
                                                         r"arch=\"sm_90\"$"):
        link_ptx(ptx, arch="compute_90")
    with pytest.raises(UnsupportedArchError, match=r"^nvJitLink 13\.0 cannot compile for sm_35: "
                                                   f"it supports {OFFERED} "):
        link_ptx(ptx, arch="sm_35")


def test_link_ptx_leaves_the_refusal_to_nvjitlink_of_another_version(nvrtc_offers, monkeypatch):
    monkeypatch.setattr(px, "nvjitlink_version", lambda: (13, 2))
    px.check_link_arch("sm_35")  # no NVRTC list to judge by: nvJitLink itself decides


# -- orchestra compile --arch ----------------------------------------------------------------------


@pytest.fixture
def saxpy(tmp_path):
    src = tmp_path / "saxpy.cu"
    src.write_text(SAXPY)
    return src


def test_cli_compute_arch_writes_ptx(saxpy, capsys):
    assert main(["compile", str(saxpy), "--arch", "compute_90"]) == 0
    out = saxpy.with_suffix(".ptx")
    text = out.read_bytes()
    assert b".target sm_90" in text and b".entry saxpy" in text and text[:4] != b"\x7fELF"
    line, kernel = capsys.readouterr().out.strip().splitlines()
    assert line == f"wrote {out} ({out.stat().st_size} bytes, PTX for compute_90)"
    assert kernel == "  kernel saxpy" and not saxpy.with_suffix(".cubin").exists()


def test_cli_unsupported_arch_is_refused_with_the_list(saxpy, capsys, no_compiler,
                                                       nvrtc_offers):
    assert main(["compile", str(saxpy), "--arch", "sm_35"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"orchestra compile: --arch sm_35: NVRTC 13.0 cannot compile for sm_35: it supports "
        f"{OFFERED} (nvrtcGetSupportedArchs); pass one of those, or use a CUDA toolkit whose "
        f"NVRTC supports sm_35")
    assert main(["compile", str(saxpy), "--arch", "sm_35", "--json"]) == 2
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["type"] == "UsageError" and "it supports sm_75, " in err["message"]
    assert not saxpy.with_suffix(".cubin").exists()


def test_cli_real_nvrtc_refuses_sm_35(saxpy, capsys, no_compiler):
    assert main(["compile", str(saxpy), "--arch", "sm_35"]) == 2
    msg = capsys.readouterr().err
    assert "cannot compile for sm_35: it supports sm_" in msg and "sm_90" in msg


@pytest.mark.parametrize("argv_tail,message", [
    (["--arch", "sm_80a"], "--arch sm_80a: GPU architecture 'sm_80a': the architecture-specific"
                           " variant 'a' exists from compute capability 9.0 on (sm_90a); use "
                           "sm_80"),
    (["--arch", "sm_90", "-O=-arch=sm_80"], "-O -arch=sm_80 sets the target architecture: pass "
                                            "--arch instead (with --ptx, or --arch compute_XY, "
                                            "for PTX)"),
    (["--arch", "hopper"], "--arch hopper: unknown GPU architecture; pass a name like --arch "
                           "sm_90 or a compute capability like --arch 9.0"),
])
def test_cli_arch_refusals(saxpy, capsys, no_compiler, argv_tail, message):
    assert main(["compile", str(saxpy)] + argv_tail) == 2
    assert capsys.readouterr().err.strip() == f"orchestra compile: {message}"


def test_cli_compute_arch_for_a_ptx_input_is_refused(tmp_path, capsys, no_compiler):
    from orchestra.compiler import ptx_source_dir

    path = tmp_path / "cp_async.ptx"
    path.write_bytes((ptx_source_dir() / "cp_async.ptx").read_bytes())
    assert main(["compile", str(path), "--arch", "compute_90"]) == 2
    assert capsys.readouterr().err.strip() == (
        "orchestra compile: --arch compute_90 is a virtual architecture: nvJitLink links a .ptx "
        "file into a cubin for a real one: pass --arch sm_90")


def test_cli_unsupported_arch_for_a_ptx_input(tmp_path, capsys, no_compiler, nvrtc_offers):
    from orchestra.compiler import ptx_source_dir

    path = tmp_path / "cp_async.ptx"
    path.write_bytes((ptx_source_dir() / "cp_async.ptx").read_bytes())
    assert main(["compile", str(path), "--arch", "sm_35"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "orchestra compile: --arch sm_35: nvJitLink 13.0 cannot compile for sm_35: it supports "
        "sm_75, ")


# -- KernelRef options -----------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["-arch=sm_35", "--gpu-architecture=compute_90",
                                    "-gpu-architecture=sm_90", "--arch=sm_80"])
def test_kernel_ref_options_never_set_the_architecture(option):
    from orchestra.graph import KernelRef

    with pytest.raises(NodeFieldValueError) as info:
        KernelRef("cuda_src/burn.cu", "burn", options=("-O3", option))
    assert str(info.value) == (
        f"KernelRef burn: option {option!r} sets the target architecture, which is the device's:"
        " an executor compiles each kernel for the GPU that runs it; drop the option")
    assert isinstance(info.value, ValueError)
    assert KernelRef("cuda_src/burn.cu", "burn", options=("-O3", "-lineinfo")).options == (
        "-O3", "-lineinfo")


def test_the_graph_and_the_compiler_agree_on_the_architecture_options():
    from orchestra.graph.kernel_ref import ARCH_OPTIONS

    assert ARCH_OPTIONS == nv.ARCH_OPTIONS


def test_normalize_arch_is_for_real_architectures():
    assert normalize_arch("sm_90a") == "sm_90a"
    with pytest.raises(CompilerArgumentValueError, match="virtual architecture"):
        normalize_arch("compute_90")


# -- the command line: what the output holds and what its name says ---------------------------------


def test_cli_names_a_virtual_arch_it_cannot_target_as_given(no_compiler, nvrtc_offers, capsys):
    assert main(["compile", "burn.cu", "--arch", "compute_12"]) == 2
    err = capsys.readouterr().err
    assert err == ("orchestra compile: --arch compute_12: NVRTC 13.0 cannot compile for "
                   "compute_12: it supports " + OFFERED.replace("sm_", "compute_") +
                   " (nvrtcGetSupportedArchs); pass one of those, or use a CUDA toolkit whose "
                   "NVRTC supports compute_12\n")


@pytest.mark.parametrize("args, message", [
    (["--arch", "compute_90", "-o", "k.cubin"],
     "-o k.cubin: --arch compute_90 makes PTX, not a cubin; name the output .ptx, or pass "
     "--arch sm_90 for a cubin"),
    (["--arch", "sm_90", "--ptx", "-o", "k.cubin"],
     "-o k.cubin: --ptx makes PTX, not a cubin; name the output .ptx, or drop --ptx"),
    (["--arch", "sm_90", "-o", "k.ptx"],
     "-o k.ptx: this makes a cubin, not PTX; name the output .cubin, or pass --ptx for PTX"),
])
def test_cli_refuses_an_output_name_that_says_the_other_kind(no_compiler, nvrtc_offers, capsys,
                                                              tmp_path, monkeypatch, args,
                                                              message):
    # PTX written as k.cubin was read back as a cubin (and a cubin as k.ptx as PTX) by the
    # loaders and by `orchestra compile k.ptx`
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "burn.cu", *args]) == 2
    assert capsys.readouterr().err == f"orchestra compile: {message}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, message", [
    ("", "options: an empty option '': drop it (NVRTC takes it for an unknown one)"),
    ("  ", "options: an empty option '  ': drop it"),
    ("-DN=4\0-lineinfo", "options: '-DN=4\\x00-lineinfo' contains a NUL character: NVRTC reads "
                         "an option as a C string and would drop what follows it; remove it"),
])
def test_an_empty_or_nul_option_is_refused_before_nvrtc(saxpy, capsys, no_compiler, option,
                                                         message):
    # was NVRTC_ERROR_INVALID_OPTION "unrecognized option  found" (exit 4, a compile error),
    # and a NUL silently cut the option short
    with pytest.raises(CompilerArgumentValueError) as info:
        nvrtc_compile(saxpy, arch="sm_90", options=("-lineinfo", option))
    assert str(info.value).startswith(message) and isinstance(info.value, ValueError)
    assert main(["compile", str(saxpy), "--arch", "sm_90", f"-O={option}"]) == 2
    assert capsys.readouterr().err.startswith(f"orchestra compile: {message}")
