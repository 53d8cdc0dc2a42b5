"""CPU tests of orchestra.compiler: NVRTC to cubin, the cache, errors, name expressions, PTX
linking and version checks, parameter parsing, argument packing and launch checks.

NVRTC and nvJitLink run on the CPU; nothing here needs a GPU. Each test has its own cache
directory (tests/conftest.py sets ORCHESTRA_CACHE_DIR).
"""

from __future__ import annotations

import contextlib
import ctypes
import pickle
import re
import stat
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import orchestra.compiler as oc
from orchestra.compiler import cache, nvrtc as nvrtc_mod, ptx as ptx_mod
from orchestra.compiler.args import ArgLayout
from orchestra.compiler.elf import defined_names, kernel_names, symbols
from orchestra.compiler.includes import describe_versions
from orchestra.compiler.launch import LaunchConfig, check_launch, normalize_dims
from orchestra.compiler.params import Param, normalize_params, parse_params
from orchestra.errors import CompileError
from tests.helpers import TINY_PTX

ARCH = "sm_90"
KERNEL_DIR = oc.kernel_source_dir()
PTX_DIR = oc.ptx_source_dir()
CU_FILES = sorted(KERNEL_DIR.glob("*.cu"))
PTX_FILES = sorted(PTX_DIR.glob("*.ptx"))
_ATTR = r"(?:__\w+__\s*\([^)]*\)\s*)*"
_EXTERN_C_RE = re.compile(r'extern\s+"C"\s+' + _ATTR + r"__global__\s+" + _ATTR + r"void\s+"
                          + _ATTR + r"(\w+)\s*\(")

TEMPLATE_SRC = r"""
template <typename T> __global__ void scale(T* p, T a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] *= a;
}
namespace ns { __global__ void plain(float* p) { p[0] = 1.0f; } }
__device__ int counter;
"""

def _entries(namespace="nvrtc"):
    return sorted(cache.cache_dir().glob(f"{namespace}-*.bin"))


@pytest.fixture
def count_nvrtc(monkeypatch):
    """Counts calls of the one NVRTC entry point."""
    calls = []
    real = nvrtc_mod._run_nvrtc

    def wrapped(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(nvrtc_mod, "_run_nvrtc", wrapped)
    return calls


def _forbid_nvrtc(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("NVRTC was called on a cache hit")

    monkeypatch.setattr(nvrtc_mod, "_run_nvrtc", boom)
    from cuda.bindings import nvrtc

    for fn in ("nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcVersion"):
        monkeypatch.setattr(nvrtc, fn, boom)


# --------------------------------------------------------------------------------------------
# every kernel of the repository compiles


def test_kernel_dirs_exist():
    assert KERNEL_DIR.is_dir()
    assert {"saxpy.cu", "vector_add.cu", "burn.cu"} <= {p.name for p in CU_FILES}


@pytest.mark.parametrize("path", CU_FILES, ids=[p.name for p in CU_FILES])
def test_every_cuda_src_file_compiles_to_sm90_cubin(path):
    res = oc.compile(path, arch=ARCH)
    assert res.cubin[:4] == b"\x7fELF"
    assert res.arch == ARCH and not res.ptx
    present = kernel_names(res.cubin)
    declared = _EXTERN_C_RE.findall(path.read_text())
    # (files holding only templates get kernels only through name expressions)
    assert present or not declared, f"{path.name}: no kernel in the cubin"
    for name in declared:
        assert name in present, f"{path.name}: kernel {name} missing from {present}"
    assert "--gpu-architecture=sm_90" in res.options and "-std=c++17" in res.options


@pytest.mark.parametrize("path", CU_FILES, ids=[p.name for p in CU_FILES])
def test_extern_c_kernel_params_parse_or_ask_for_params(path):
    text = path.read_text()
    for name in _EXTERN_C_RE.findall(text):
        try:
            params = parse_params(text, name)
        except ValueError as exc:
            assert "params=" in str(exc)
        else:
            ArgLayout(params, name)  # every parsed signature can be packed


@pytest.mark.parametrize("path", PTX_FILES, ids=[p.name for p in PTX_FILES])
def test_every_ptx_file_links_to_sm90_cubin(path):
    cubin = oc.link_ptx(path, arch=ARCH)
    assert cubin[:4] == b"\x7fELF"
    assert kernel_names(cubin)


@pytest.mark.parametrize("name,params", [
    ("saxpy", ("float a", "const float* x", "const float* y", "float* out", "size_t n")),
    ("vector_add", ("const float* a", "const float* b", "float* c", "size_t n")),
    ("burn", ("const float* x", "float* y", "size_t n", "int iters", "float s", "float t")),
])
def test_repository_kernel_params(name, params):
    got = parse_params((KERNEL_DIR / f"{name}.cu").read_text(), name)
    assert got == normalize_params(params)


def test_pipeline_headers_compile_without_include_dirs():
    src = r"""
#include <cuda/pipeline>
#include <cuda/barrier>
#include <cooperative_groups.h>
#include <cooperative_groups/memcpy_async.h>
#include <cuda_pipeline_primitives.h>
namespace cg = cooperative_groups;
extern "C" __global__ void copy_pipe(const float* in, float* out, size_t n) {
    __shared__ float tile[256];
    auto block = cg::this_thread_block();
    cuda::pipeline<cuda::thread_scope_thread> pipe = cuda::make_pipeline();
    size_t i = blockIdx.x * blockDim.x + threadIdx.x;
    pipe.producer_acquire();
    if (i < n) cuda::memcpy_async(&tile[threadIdx.x], &in[i], sizeof(float), pipe);
    pipe.producer_commit();
    cuda::pipeline_consumer_wait_prior<0>(pipe);
    if (i < n) out[i] = tile[threadIdx.x];
    pipe.consumer_release();
    __pipeline_memcpy_async(&tile[threadIdx.x], &in[0], sizeof(float));
    __pipeline_commit();
    __pipeline_wait_prior(0);
    cg::memcpy_async(block, tile, in, sizeof(float) * 32);
    cg::wait(block);
}
"""
    res = oc.compile(src, arch=ARCH)
    assert "copy_pipe" in kernel_names(res.cubin)
    assert any("cccl" in d for d in res.include_dirs)


# --------------------------------------------------------------------------------------------
# cache


def test_cache_hit_does_not_call_nvrtc_and_returns_identical_bytes(monkeypatch):
    first = oc.compile("saxpy.cu", arch=ARCH)
    assert not first.cache_hit
    assert len(_entries()) == 1
    _forbid_nvrtc(monkeypatch)
    second = oc.compile("saxpy.cu", arch=ARCH)
    assert second.cache_hit
    assert second.cubin == first.cubin
    assert second.log == first.log and second.options == first.options
    assert second.nvrtc_version == first.nvrtc_version


def test_cache_dir_mode_and_location(tmp_path, monkeypatch):
    d = tmp_path / "fresh" / "cache"
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(d))
    oc.compile("vector_add.cu", arch=ARCH)
    assert d.is_dir()
    assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0  # 0o700 (never wider)
    assert len(list(d.glob("nvrtc-*.bin"))) == 1
    assert not list(d.glob("*.tmp"))


def test_default_cache_dir_uses_platformdirs(monkeypatch):
    import platformdirs

    monkeypatch.delenv("ORCHESTRA_CACHE_DIR")
    assert cache.cache_dir(create=False) == Path(platformdirs.user_cache_dir()) / "orchestra"


@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "empty",
                                    "append"])
def test_corrupted_cache_entry_is_discarded_and_recompiled(damage, count_nvrtc):
    good = oc.compile("vector_add.cu", arch=ARCH)
    (path,) = _entries()
    data = bytearray(path.read_bytes())
    if damage == "flip-payload":
        data[cache.HEADER_SIZE + 100] ^= 0x01
    elif damage == "flip-header":
        data[12] ^= 0xFF  # inside the checksum
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data += b"junk"
    path.write_bytes(bytes(data))
    assert cache.load("nvrtc", good.key) is None
    assert not path.exists()  # the bad entry was deleted, never loaded
    again = oc.compile("vector_add.cu", arch=ARCH)
    assert not again.cache_hit
    assert again.cubin == good.cubin
    assert len(count_nvrtc) == 2
    assert cache.decode_entry(path.read_bytes()) is not None  # rewritten whole


def test_cache_entry_format_roundtrip():
    data = cache.encode_entry(b"\x7fELFxyz", "log text", {"k<int>": "_Z1kIiEvv"})
    magic, version = struct.unpack_from("<8sI", data)
    assert magic == cache.MAGIC and version == cache.FORMAT_VERSION
    entry = cache.decode_entry(data)
    assert entry.image == b"\x7fELFxyz" and entry.log == "log text"
    assert entry.names == {"k<int>": "_Z1kIiEvv"}


def test_cache_key_covers_every_input():
    base = dict(arch=ARCH)
    keys = {
        oc.prepare_compile("saxpy.cu", **base).key,
        oc.prepare_compile("saxpy.cu", arch="sm_80").key,
        oc.prepare_compile("saxpy.cu", arch=ARCH, options=("-DX=1",)).key,
        oc.prepare_compile("saxpy.cu", arch=ARCH, ptx=True).key,
        oc.prepare_compile("saxpy.cu", arch=ARCH, name_expressions=("saxpy",)).key,
        oc.prepare_compile("vector_add.cu", **base).key,
    }
    assert len(keys) == 6
    assert oc.prepare_compile("saxpy.cu", **base).key == oc.prepare_compile(
        KERNEL_DIR / "saxpy.cu", **base).key
    assert cache.make_key("a", "bc") != cache.make_key("a", "b", "c")
    assert cache.make_key("nvrtc", "x") != cache.make_key("nvjitlink", "x")


def test_editing_an_included_project_header_recompiles(tmp_path):
    (tmp_path / "inc").mkdir()
    header = tmp_path / "inc" / "scale.cuh"
    header.write_text("#pragma once\n#define SCALE 2.0f\n")
    (tmp_path / "inner.cuh").write_text('#pragma once\n#include "inc/scale.cuh"\n')
    src = tmp_path / "k.cu"
    src.write_text('#include "inner.cuh"\n'
                   'extern "C" __global__ void k(float* p) { p[0] *= SCALE; }\n')
    a = oc.compile(src, arch=ARCH)
    b = oc.compile(src, arch=ARCH)
    assert not a.cache_hit and b.cache_hit
    header.write_text("#pragma once\n#define SCALE 3.0f\n")
    c = oc.compile(src, arch=ARCH)
    assert not c.cache_hit and c.key != a.key and c.cubin != a.cubin


def test_no_cache_env_disables_cache(monkeypatch, count_nvrtc):
    monkeypatch.setenv("ORCHESTRA_NO_CACHE", "1")
    a = oc.compile("saxpy.cu", arch=ARCH)
    b = oc.compile("saxpy.cu", arch=ARCH)
    assert not a.cache_hit and not b.cache_hit
    assert len(count_nvrtc) == 2
    assert not _entries()


# --------------------------------------------------------------------------------------------
# errors


def test_syntax_error_reports_line_number_options_and_dirs(tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" __global__ void k(float* p) {\n'
                   '    p[0] = 1.0f;\n'
                   '    p[1] = undefined_thing;\n'
                   '}\n')
    with pytest.raises(CompileError) as info:
        oc.compile(src, arch=ARCH)
    err = info.value
    msg = str(err)
    assert f"{src}(3)" in msg and "undefined_thing" in msg
    assert "broken.cu(3)" in err.log
    assert "--gpu-architecture=sm_90" in err.options
    assert str(tmp_path) in err.include_dirs
    assert err.call == "nvrtcCompileProgram"
    assert not _entries()  # failures are not cached


def test_inline_source_error_line(tmp_path):
    with pytest.raises(CompileError, match=r"inline\.cu\(2\)"):
        oc.compile('extern "C" __global__ void k() {\n  int x = ;\n}\n', arch=ARCH)


def test_missing_include_lists_directories_and_versions(tmp_path):
    extra = tmp_path / "myinc"
    extra.mkdir()
    src = tmp_path / "k.cu"
    src.write_text('#include "does_not_exist.cuh"\nextern "C" __global__ void k() {}\n')
    with pytest.raises(CompileError) as info:
        oc.compile(src, arch=ARCH, include_dirs=[extra])
    msg = str(info.value)
    assert '"does_not_exist.cuh"' in msg and "cannot open source file" in msg
    assert "include directories tried" in msg
    for d in (tmp_path, extra, KERNEL_DIR):
        assert str(d) in info.value.include_dirs and str(d) in msg
    assert any("cccl" in d for d in info.value.include_dirs)
    major, minor = oc.nvrtc_version()
    assert f"NVRTC {major}.{minor}" in msg
    assert "CCCL " in msg


def test_headers_of_another_cuda_version_are_reported(tmp_path):
    old = tmp_path / "cuda12" / "include"
    (old / "cuda" / "std" / "__cccl").mkdir(parents=True)
    (old / "cuda" / "std" / "__cccl" / "version.h").write_text("#define CCCL_VERSION 2008000\n")
    (old / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  12080\n")
    summary, warnings = describe_versions((13, 5), [str(old)])
    assert "CCCL 2.8.0" in summary and "cudart 12.8" in summary and "NVRTC 13.5" in summary
    assert len(warnings) == 2 and all("another CUDA version" in w for w in warnings)
    src = tmp_path / "k.cu"
    src.write_text('#include <cuda/nonexistent_header>\nextern "C" __global__ void k() {}\n')
    with pytest.raises(CompileError) as info:
        oc.compile(src, arch=ARCH, include_dirs=[old])
    msg = str(info.value)
    assert "CCCL 2.8.0" in msg and "another CUDA version" in msg
    major, minor = oc.nvrtc_version()
    assert f"NVRTC {major}.{minor}" in msg


def test_arch_option_is_refused():
    with pytest.raises(ValueError, match='arch="sm_XY"'):
        oc.compile("saxpy.cu", arch=ARCH, options=("-arch=sm_80",))


def test_missing_file_name_is_file_not_found():
    with pytest.raises(FileNotFoundError, match="nope_not_here.cu"):
        oc.compile("nope_not_here.cu", arch=ARCH)


def test_no_gpu_and_no_arch_says_pass_arch():
    from orchestra.driver.check import device_available

    if device_available():
        pytest.skip("a GPU is present: the default arch comes from it")
    with pytest.raises(ValueError, match=r'arch="sm_90"'):
        oc.compile("saxpy.cu")


@pytest.mark.parametrize("given,expected", [
    ("sm_90", "sm_90"), ("90", "sm_90"), (90, "sm_90"), ((9, 0), "sm_90"), ("9.0", "sm_90"),
    ("sm_90a", "sm_90a"), ("sm_100", "sm_100"), ("sm_100f", "sm_100f"), ((12, 1), "sm_121"),
])
def test_normalize_arch(given, expected):
    assert oc.normalize_arch(given) == expected


def test_normalize_arch_refuses_a_virtual_architecture():
    # compute_80 names PTX; normalize_arch is for a real architecture (a cubin)
    with pytest.raises(ValueError, match=r"'compute_80' is a virtual architecture: NVRTC makes "
                                         r"PTX for it, not a cubin; for compute_80 PTX pass "
                                         r"ptx=True, for a cubin pass arch=\"sm_80\""):
        oc.normalize_arch("compute_80")


def test_normalize_arch_refuses_junk():
    with pytest.raises(ValueError, match="unknown GPU architecture"):
        oc.normalize_arch("hopper")


def test_ptx_output():
    res = oc.compile("saxpy.cu", arch=ARCH, ptx=True)
    assert res.ptx and res.cubin.lstrip().startswith(b"//")
    assert b".entry saxpy" in res.cubin and b".target sm_90" in res.cubin
    assert "--gpu-architecture=compute_90" in res.options
    assert oc.ptx_isa_version(res.cubin)[0] >= 8


def test_compile_result_write(tmp_path):
    res = oc.compile("saxpy.cu", arch=ARCH)
    out = oc.default_output_path(tmp_path / "saxpy.cu")
    assert out.name == "saxpy.cubin"
    assert oc.default_output_path("x/k.cu", ptx=True) == Path("x/k.ptx")
    res.write(out)
    assert out.read_bytes() == res.cubin
    src = tmp_path / "k.cu"
    src.write_text((KERNEL_DIR / "saxpy.cu").read_text())
    res2, path = oc.compile_to_file(src, arch=ARCH, ptx=True)
    assert path == tmp_path / "k.ptx" and path.read_bytes() == res2.cubin and res2.ptx
    res3, path3 = oc.compile_to_file(src, tmp_path / "out.cubin", arch=ARCH)
    assert path3.read_bytes()[:4] == b"\x7fELF"
    with pytest.raises(ValueError, match="out="):
        oc.compile_to_file('extern "C" __global__ void k() {}', arch=ARCH)


def test_compile_error_pickles():
    err = CompileError("summary", "log", ("-x",), ("/inc",), "nvrtcCompileProgram")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and back.options == ("-x",)
    nerr = oc.NameExpressionError("s", "l", ("-o",), (), "c", ("a<int>",), {"b": "_Zb"})
    back = pickle.loads(pickle.dumps(nerr))
    assert back.missing == ("a<int>",) and back.resolved == {"b": "_Zb"}


# --------------------------------------------------------------------------------------------
# name expressions (case C11)


def test_name_expressions_resolve_and_exist_in_the_cubin():
    exprs = ("scale<float>", "scale<double>", "ns::plain", "&counter")
    res = oc.compile(TEMPLATE_SRC, arch=ARCH, name_expressions=exprs)
    assert set(res.lowered_names) == set(exprs)
    names = defined_names(res.cubin)
    for e in exprs:
        assert res.lowered_names[e] in names
    assert res.lowered_names["scale<float>"] == "_Z5scaleIfEvPT_S0_i"
    assert res.lowered_names["&counter"] == "counter"
    entries = kernel_names(res.cubin)
    assert res.lowered_names["ns::plain"] in entries
    # cached lowered names come back on a hit
    again = oc.compile(TEMPLATE_SRC, arch=ARCH, name_expressions=exprs)
    assert again.cache_hit and again.lowered_names == res.lowered_names


def test_non_matching_name_expression_is_named_and_others_resolve():
    exprs = ("scale<float>", "scael<int>", "scale<int>")
    with pytest.raises(oc.NameExpressionError) as info:
        oc.compile(TEMPLATE_SRC, arch=ARCH, name_expressions=exprs)
    err = info.value
    assert err.missing == ("scael<int>",)
    assert "'scael<int>'" in str(err)
    assert set(err.resolved) == {"scale<float>", "scale<int>"}
    assert err.resolved["scale<int>"] == "_Z5scaleIiEvPT_S0_i"
    assert isinstance(err, CompileError)


def test_empty_lowered_name_is_an_error(monkeypatch):
    real = nvrtc_mod._run_nvrtc

    def no_lowered_name(text, name, options, exprs, ptx):
        out = real(text, name, options, exprs, ptx)
        lowered = dict(out.lowered)
        lowered["scale<int>"] = ""
        return nvrtc_mod._NvrtcOutput(out.ok, out.call, out.status, out.image, out.log, lowered)

    monkeypatch.setattr(nvrtc_mod, "_run_nvrtc", no_lowered_name)
    with pytest.raises(oc.NameExpressionError) as info:
        oc.compile(TEMPLATE_SRC, arch=ARCH, name_expressions=("scale<float>", "scale<int>"))
    assert info.value.missing == ("scale<int>",)
    assert "scale<float>" in info.value.resolved


def test_lowered_name_absent_from_symbol_table_is_an_error(monkeypatch):
    real = nvrtc_mod._run_nvrtc

    def wrong_name(text, name, options, exprs, ptx):
        out = real(text, name, options, exprs, ptx)
        lowered = dict(out.lowered, **{"scale<int>": "_Z_not_in_the_image"})
        return nvrtc_mod._NvrtcOutput(out.ok, out.call, out.status, out.image, out.log, lowered)

    monkeypatch.setattr(nvrtc_mod, "_run_nvrtc", wrong_name)
    with pytest.raises(oc.NameExpressionError, match="scale<int>"):
        oc.compile(TEMPLATE_SRC, arch=ARCH, name_expressions=("scale<float>", "scale<int>"))


def test_elf_reader_on_a_real_cubin():
    res = oc.compile(TEMPLATE_SRC, arch=ARCH, name_expressions=("scale<float>",))
    syms = {s.name: s for s in symbols(res.cubin)}
    assert syms["_Z5scaleIfEvPT_S0_i"].entry and syms["_Z5scaleIfEvPT_S0_i"].kind == "func"
    assert syms["counter"].kind == "object" and not syms["counter"].entry
    with pytest.raises(ValueError):
        symbols(b"not an elf at all, really not")


# --------------------------------------------------------------------------------------------
# PTX: version check (case C08) and nvJitLink


@pytest.mark.parametrize("ptx_version,driver,ok", [
    ((9, 5), 13000, False),   # NVRTC 13.5 PTX on a CUDA 13.0 driver
    ((9, 0), 13000, True),
    ((9, 0), 12090, False),
    ((8, 8), 12080, False),   # needs 12.9
    ((8, 8), 12090, True),
    ((8, 6), 12060, False),   # ISA 8.6 came with CUDA 12.7
    ((8, 0), 13000, True),
    ((7, 8), 11080, True),
])
def test_ptx_version_against_driver(ptx_version, driver, ok):
    if ok:
        oc.check_ptx_loadable(ptx_version, driver)
        return
    with pytest.raises(oc.PtxVersionError) as info:
        oc.check_ptx_loadable(ptx_version, driver)
    msg = str(info.value)
    assert f"PTX ISA {ptx_version[0]}.{ptx_version[1]}" in msg
    assert f"CUDA {driver // 1000}.{driver % 1000 // 10}" in msg and str(driver) in msg
    assert pickle.loads(pickle.dumps(info.value)).driver_version == driver


def test_required_cuda_for_ptx_table():
    assert oc.required_cuda_for_ptx((8, 6)) == (12, 7)
    assert oc.required_cuda_for_ptx((9, 5)) == (13, 5)
    assert oc.required_cuda_for_ptx((9, 9)) == (13, 9)  # beyond any table: ISA 9.x is CUDA 13.x
    assert oc.required_cuda_for_ptx((7, 0)) == (11, 0)


def test_ptx_isa_version_parsing():
    assert oc.ptx_isa_version(TINY_PTX) == (8, 0)
    assert oc.ptx_isa_version(b"//x\n  .version 9.5\n.target sm_90\n") == (9, 5)
    with pytest.raises(ValueError):
        oc.ptx_isa_version("no version here")
    assert ptx_mod.is_ptx(TINY_PTX) and not ptx_mod.is_ptx(b"\x7fELF....")


def test_nvrtc_ptx_needs_newer_driver_than_13_0():
    res = oc.compile("vector_add.cu", arch=ARCH, ptx=True)
    need = oc.required_cuda_for_ptx(oc.ptx_isa_version(res.cubin))
    if need <= (13, 0):
        pytest.skip("this NVRTC writes PTX a 13.0 driver reads")
    with pytest.raises(oc.PtxVersionError):
        oc.check_ptx_loadable(oc.ptx_isa_version(res.cubin), 13000)


def test_link_ptx_gives_a_cubin_and_is_cached(tmp_path, monkeypatch):
    cubin = oc.link_ptx(TINY_PTX, arch=ARCH)
    assert cubin[:4] == b"\x7fELF"
    assert kernel_names(cubin) == ["add_one"]
    assert len(_entries("nvjitlink")) == 1 and not _entries("nvrtc")

    def boom(*a, **k):
        raise AssertionError("nvJitLink was called on a cache hit")

    monkeypatch.setattr(ptx_mod, "_run_nvjitlink", boom)
    p = tmp_path / "tiny.ptx"
    p.write_text(TINY_PTX)
    assert oc.link_ptx(p, arch=ARCH) == cubin
    assert oc.link_ptx(TINY_PTX.encode(), arch="90") == cubin


def test_link_ptx_error_carries_the_log():
    bad = TINY_PTX.replace("add.f32", "bogus.f32")
    with pytest.raises(CompileError) as info:
        oc.link_ptx(bad, arch=ARCH)
    assert "bogus" in info.value.log
    assert "-arch=sm_90" in info.value.options
    assert info.value.call in ("nvJitLinkAddData", "nvJitLinkComplete")


def test_link_ptx_refuses_non_ptx():
    with pytest.raises(ValueError, match="not PTX"):
        oc.link_ptx('extern "C" __global__ void k() {}', arch=ARCH)


# --------------------------------------------------------------------------------------------
# parameter declarations


def test_parse_params_declarations():
    src = r"""
    // saxpy(int) in a comment must not match
    template <int N> __global__ void tk(float* p);
    extern "C" __global__ void __launch_bounds__(256)
    k1(float a, const float* __restrict__ x, float const *y, float* out, size_t n) { }
    __global__ void k2(unsigned long long a, signed char b, std::int32_t c, const int d,
                       float* const e, const double* const* f, double, bool g = true,
                       unsigned u, long l, short s, uint8_t q, ptrdiff_t pd) {}
    extern "C" __global__ void k3(void);
    extern "C" __global__ void k4() {}
    """
    k1 = parse_params(src, "k1")
    assert [p.name for p in k1] == ["a", "x", "y", "out", "n"]
    assert [p.ctype for p in k1] == ["float", "const float*", "const float*", "float*",
                                     "size_t"]
    assert [p.kind for p in k1] == ["scalar", "pointer", "pointer", "pointer", "scalar"]
    assert [p.const for p in k1] == [False, True, True, False, False]
    k2 = parse_params(src, "k2")
    assert [(p.ctype, p.dtype) for p in k2] == [
        ("unsigned long long", "uint64"), ("signed char", "int8"), ("int32_t", "int32"),
        ("int", "int32"), ("float*", "ptr"), ("const double* const*", "ptr"),
        ("double", "float64"), ("bool", "bool"), ("unsigned int", "uint32"),
        ("long", "int64"), ("short", "int16"), ("uint8_t", "uint8"), ("ptrdiff_t", "int64")]
    assert k2[6].name == "arg6" and k2[5].const and not k2[4].const
    assert parse_params(src, "k3") == () and parse_params(src, "k4") == ()
    with pytest.raises(ValueError, match="template"):
        parse_params(src, "tk")
    with pytest.raises(ValueError, match="no __global__ declaration"):
        parse_params(src, "absent")


@pytest.mark.parametrize("decl", ["__half h", "float& r", "float a[4]", "MyStruct s",
                                  "const __grid_constant__ CUtensorMap m"])
def test_unknown_param_types_ask_for_explicit_params(decl):
    with pytest.raises(ValueError, match="params="):
        parse_params(f'extern "C" __global__ void k({decl}) {{}}', "k")


def test_explicit_params():
    ps = normalize_params(("const float*", "float*", "int", "float"))
    assert [p.name for p in ps] == ["arg0", "arg1", "arg2", "arg3"]
    assert ps[0].const and ps[0].kind == "pointer" and ps[2].kind == "scalar"
    mixed = normalize_params([Param("x", "const float*", "pointer", True), "size_t n"])
    assert mixed[1] == Param("n", "size_t", "scalar")
    with pytest.raises(ValueError, match="duplicate"):
        normalize_params(("int n", "float n"))
    with pytest.raises(TypeError):
        normalize_params((3,))


# --------------------------------------------------------------------------------------------
# argument packing (case C09)

SAXPY = ArgLayout(parse_params((KERNEL_DIR / "saxpy.cu").read_text(), "saxpy"), "saxpy")


class FakeBuffer:
    def __init__(self, ptr):
        self.ptr = ptr


def test_pack_layout_and_bytes():
    layout = ArgLayout(normalize_params(("float a", "const float* x", "int n", "double d",
                                         "char c", "unsigned short u", "bool b")), "k")
    assert layout.offsets == (0, 8, 16, 24, 32, 34, 36)
    assert layout.size == 40
    packed = layout.pack([1.5, FakeBuffer(0x7F0000001000), -7, 0.1, -3, 65535, True])
    expected = struct.pack("<f4xQi4xdbxHb3x", 1.5, 0x7F0000001000, -7, 0.1, -3, 65535, 1)
    assert bytes(packed) == expected
    base = ctypes.addressof(packed.struct)
    assert list(packed.pointers) == [base + o for o in layout.offsets]
    assert packed.address == ctypes.addressof(packed.pointers)


def test_float_for_double_keeps_precision_and_float_rounds_to_float32():
    layout = ArgLayout(normalize_params(("double d", "float f")), "k")
    x = 0.1 + 1e-12
    packed = layout.pack([x, x])
    raw = bytes(packed)
    assert raw[:8] == np.float64(x).tobytes()
    assert struct.unpack("<d", raw[:8])[0] == x
    assert raw[8:12] == np.float32(x).tobytes()
    assert layout.pack([np.float64(x), np.float32(x)]).values()[0] == x
    with pytest.raises(ValueError, match=r"parameter f \(float\): 1e\+39 does not fit in float32"):
        layout.pack([1.0, 1e39])
    assert layout.pack([2, 3]).values() == (2.0, 3.0)  # ints are fine for float params


def test_int_that_does_not_fit():
    layout = ArgLayout(normalize_params(("int n", "size_t m", "unsigned char c")), "k")
    with pytest.raises(ValueError) as info:
        layout.pack([4294967296, 0, 0])
    assert str(info.value) == ("parameter n (int): 4294967296 does not fit in int32: pass an int"
                               " from -2147483648 to 2147483647")
    with pytest.raises(ValueError, match=r"parameter m \(size_t\): -1 does not fit in uint64"):
        layout.pack([0, -1, 0])
    with pytest.raises(ValueError, match="does not fit in uint8"):
        layout.pack([0, 0, 256])
    ok = layout.pack([-(2 ** 31), 2 ** 64 - 1, 255])
    assert ok.values() == (-(2 ** 31), 2 ** 64 - 1, 255)


def test_float_where_integer_is_declared():
    with pytest.raises(TypeError, match=r"parameter n \(size_t\): got a float \(3.0\)"):
        SAXPY.pack([2.0, 0, 0, 0, 3.0])
    with pytest.raises(TypeError, match="parameter n"):
        SAXPY.pack([2.0, 0, 0, 0, np.float32(3.0)])


def test_bool_only_for_bool_params():
    with pytest.raises(TypeError, match="bool"):
        SAXPY.pack([2.0, 0, 0, 0, True])
    layout = ArgLayout(normalize_params(("bool flag",)), "k")
    assert layout.pack([np.bool_(True)]).values() == (True,)
    with pytest.raises(TypeError, match="flag"):
        layout.pack([1])


def test_wrong_number_of_arguments_shows_signature():
    sig = "saxpy(float a, const float* x, const float* y, float* out, size_t n)"
    with pytest.raises(TypeError) as info:
        SAXPY.pack([2.0, 0, 0, 0])
    assert sig in str(info.value) and "takes 5 arguments, got 4" in str(info.value)
    with pytest.raises(TypeError, match="got 6"):
        SAXPY.pack([2.0, 0, 0, 0, 1, 2])
    with pytest.raises(TypeError, match=r"missing argument\(s\) \['n'\]"):
        SAXPY.pack({"a": 1.0, "x": 0, "y": 0, "out": 0})


def test_buffer_where_scalar_belongs():
    with pytest.raises(TypeError, match=r"parameter n \(size_t\): got a buffer"):
        SAXPY.pack([2.0, 0, 0, 0, FakeBuffer(4096)])
    with pytest.raises(TypeError, match=r"parameter a \(float\): got a buffer"):
        SAXPY.pack([np.zeros(3, np.float32), 0, 0, 0, 1])


def test_numpy_scalar_dtype_must_match():
    with pytest.raises(TypeError, match=r"numpy int64 scalar does not match the declared uint64"):
        SAXPY.pack([2.0, 0, 0, 0, np.int64(5)])
    with pytest.raises(TypeError, match="float64 scalar does not match the declared float32"):
        SAXPY.pack([np.float64(2.0), 0, 0, 0, 5])
    ok = SAXPY.pack([np.float32(2.0), 0, 0, 0, np.uint64(5)])
    assert ok.values()[0] == 2.0 and ok.values()[4] == 5


def test_pointer_arguments():
    ok = SAXPY.pack([1.0, FakeBuffer(0x1000), None, 0x3000, 10])
    assert ok.values()[1:4] == (0x1000, 0, 0x3000)
    for bad, pattern in [(1.5, "needs device memory"), (np.zeros(4), "numpy array"),
                         ("0x10", "needs device memory"), (True, "needs device memory")]:
        with pytest.raises(TypeError, match=pattern) as info:
            SAXPY.pack([1.0, bad, 0, 0, 1])
        assert "parameter x (const float*)" in str(info.value)
    with pytest.raises(ValueError, match="address"):
        SAXPY.pack([1.0, -1, 0, 0, 1])


def test_packed_args_set_rewrites_one_field():
    packed = SAXPY.pack([2.0, 0x1000, 0x2000, 0x3000, 100])
    pointers = list(packed.pointers)
    before = bytes(packed)
    packed.set("a", 0.5)
    packed.set(4, 7)
    packed.set("out", FakeBuffer(0x4000))
    after = bytes(packed)
    assert packed.values() == (0.5, 0x1000, 0x2000, 0x4000, 7)
    assert after[8:24] == before[8:24]  # x, y untouched
    assert list(packed.pointers) == pointers  # same memory, nothing rebuilt
    with pytest.raises(ValueError, match="does not fit"):
        packed.set("n", -5)
    assert packed.get("n") == 7  # unchanged after a failed set
    with pytest.raises(KeyError, match="no parameter 'm'"):
        packed.set("m", 1)
    copy = packed.copy()
    copy.set("n", 9)
    assert packed.get("n") == 7 and copy.get("n") == 9


def test_kernel_without_params_packs_to_null():
    layout = ArgLayout((), "k")
    packed = layout.pack([])
    assert packed.address == 0 and bytes(packed) == b""


# --------------------------------------------------------------------------------------------
# launch configuration checks (pure functions)

H200 = SimpleNamespace(
    max_threads_per_block=1024, max_block_dim=(1024, 1024, 64),
    max_grid_dim=(2147483647, 65535, 65535), max_shared_memory_per_block=49152,
    max_shared_memory_per_block_optin=232448, cooperative_launch=True, cluster_launch=True,
    least_stream_priority=0, greatest_stream_priority=-5)


def test_normalize_dims():
    assert normalize_dims(7, "grid") == (7, 1, 1)
    assert normalize_dims((2, 3), "grid") == (2, 3, 1)
    assert normalize_dims([2, 3, 4], "block") == (2, 3, 4)
    with pytest.raises(ValueError):
        normalize_dims(0, "grid")
    with pytest.raises(ValueError):
        normalize_dims((1, 2, 3, 4), "grid")
    with pytest.raises(TypeError):
        normalize_dims(2.0, "grid")


def _check(**kw):
    grid = kw.pop("grid", 1)
    block = kw.pop("block", 128)
    smem = kw.pop("shared_mem", 0)
    cfg = LaunchConfig.make(grid, block, smem, **{k: kw.pop(k) for k in
                                                 ("cooperative", "cluster", "pdl", "priority")
                                                 if k in kw})
    return check_launch(cfg, H200, kernel_name="k", **kw)


def test_launch_limits():
    assert _check() == 0
    with pytest.raises(ValueError, match=r"2048 threads, above the device's max threads per block \(1024\)"):
        _check(block=2048)
    with pytest.raises(ValueError, match="max block dims"):
        _check(block=(1, 1, 128))
    with pytest.raises(ValueError, match=r"grid dimension y = 65536 exceeds the device's max grid dims"):
        _check(grid=(1, 65536))
    with pytest.raises(ValueError, match="kernel's max threads per block"):
        _check(block=1024, kernel_max_threads=512)


def test_shared_memory_opt_in():
    assert _check(shared_mem=48 * 1024) == 0
    assert _check(shared_mem=100 * 1024) == 100 * 1024  # needs the opt-in attribute
    assert _check(shared_mem=100 * 1024, max_dynamic_shared=100 * 1024) == 0  # already set
    with pytest.raises(ValueError, match="opt-in limit"):
        _check(shared_mem=232448 + 1)
    with pytest.raises(ValueError, match="opt-in limit"):
        _check(shared_mem=232448, static_shared=1024)


def test_launch_attribute_checks():
    assert _check(grid=8, cluster=2) == 0
    with pytest.raises(ValueError, match="does not divide grid"):
        _check(grid=9, cluster=2)
    with pytest.raises(ValueError, match="max cluster size 8"):
        _check(grid=16, cluster=16)
    assert _check(grid=16, cluster=16, non_portable_cluster=True) == 0
    with pytest.raises(ValueError, match="thread block clusters"):
        check_launch(LaunchConfig.make(8, 128, cluster=2),
                     SimpleNamespace(**{**vars(H200), "cluster_launch": False}))
    with pytest.raises(ValueError, match="compute capability 9.0"):
        _check(pdl=True, compute_capability=(8, 0))
    assert _check(pdl=True, compute_capability=(9, 0)) == 0
    assert _check(grid=132 * 4, cooperative=True, sm_count=132, occupancy=4) == 0
    with pytest.raises(ValueError, match=r"co-resident \(132 SMs x 4 blocks per SM"):
        _check(grid=132 * 4 + 1, cooperative=True, sm_count=132, occupancy=lambda t, s: 4)
    assert _check(priority=-5) == 0
    with pytest.raises(ValueError, match="priority range"):
        _check(priority=-6)
    assert LaunchConfig.make(1, 1, priority=0).needs_ex
    assert not LaunchConfig.make(1, 1).needs_ex


def test_launch_attributes_build():
    cfg = LaunchConfig.make((8, 2), 128, 1024, cluster=(2, 1), pdl=True, priority=-1,
                            cooperative=True)
    config = oc.build_launch_config(cfg, 0)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (8, 2, 1)
    assert config.sharedMemBytes == 1024 and config.numAttrs == 4
    ids = [int(a.id) for a in config.attrs]
    from cuda.bindings import driver

    A = driver.CUlaunchAttributeID
    assert ids == [int(A.CU_LAUNCH_ATTRIBUTE_COOPERATIVE),
                   int(A.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION),
                   int(A.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION),
                   int(A.CU_LAUNCH_ATTRIBUTE_PRIORITY)]
    assert config.attrs[1].value.clusterDim.x == 2
    assert config.attrs[3].value.priority == -1
    assert len(oc.launch_attribute_values(cfg)) == 4


def test_kernel_not_found_error_is_a_readable_key_error():
    err = oc.KernelNotFoundError("sxapy", ("saxpy", "burn"))
    assert isinstance(err, KeyError)
    assert str(err).startswith("no kernel named 'sxapy' in the module; kernels present: saxpy, burn")
    assert pickle.loads(pickle.dumps(err)).available == ("saxpy", "burn")


def test_source_dirs():
    assert (KERNEL_DIR / "saxpy.cu").is_file()
    assert PTX_DIR.name == "ptx"
    assert oc.kernel_source_dir() == Path(__file__).resolve().parent.parent / "cuda_src"


# --------------------------------------------------------------------------------------------
# Module / Kernel plumbing against a fake driver (what the GPU run then confirms for real)


class FakeDevice:
    """Stands in for `Device`. Ordinal 99 has no live context, so closing a module on it (or its
    finalizer) skips ``cuLibraryUnload``; `pushed` is there for a finalizer that runs while
    another test fakes ``context_alive``. Tests still close every module they load."""

    ordinal = 99
    arch = "sm_90"
    compute_capability = (9, 0)
    sm_count = 132
    limits = H200

    def make_current(self):
        return self

    def pushed(self):
        return contextlib.nullcontext(self)


SAXPY_PARAM_INFO = [(0, 4), (8, 8), (16, 8), (24, 8), (32, 8)]


@pytest.fixture
def fake_driver(monkeypatch):
    from cuda.bindings import driver

    from orchestra.kernel import module as mod

    ok = driver.CUresult.CUDA_SUCCESS
    A = driver.CUfunction_attribute
    rec = SimpleNamespace(launches=[], ex_launches=[], set_attrs=[], loaded=[],
                          param_info=SAXPY_PARAM_INFO, snapshot_params=None, values=[])
    attrs = {A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: 1024,
             A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: 0,
             A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: 48 * 1024,
             A.CU_FUNC_ATTRIBUTE_NUM_REGS: 16}

    def get_kernel(lib, name):
        if name in (b"saxpy", b"burn"):
            return (ok, "kernel:" + name.decode())
        return (driver.CUresult.CUDA_ERROR_NOT_FOUND, None)

    def param_info(func, i):
        if i < len(rec.param_info):
            return (ok,) + rec.param_info[i]
        return (driver.CUresult.CUDA_ERROR_INVALID_VALUE, 0, 0)

    fakes = {
        "cuLibraryLoadData": lambda data, *a: (rec.loaded.append(data), (ok, "library"))[1],
        "cuLibraryGetKernel": get_kernel,
        "cuKernelGetFunction": lambda k: (ok, "function:" + k.split(":")[1]),
        "cuFuncGetParamCount": lambda f: (ok, len(rec.param_info)),
        "cuFuncGetParamInfo": param_info,
        "cuFuncGetAttribute": lambda a, f: (ok, attrs.get(a, 0)),
        "cuFuncSetAttribute": lambda f, a, v: (rec.set_attrs.append((f, a, v)), (ok,))[1],
        "cuLibraryGetKernelCount": lambda lib: (ok, 1),
        "cuLibraryEnumerateKernels": lambda n, lib: (ok, ["kernel:saxpy"]),
        "cuKernelGetName": lambda k: (ok, k.split(":")[1].encode()),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor": lambda f, t, s: (ok, 4),
        "cuLaunchKernelEx": lambda cfg, f, kp, extra: (rec.ex_launches.append(
            (cfg, f, kp, extra)), (ok,))[1],
        "cuDriverGetVersion": lambda: (ok, 13000),
    }
    for name, fn in fakes.items():
        monkeypatch.setattr(driver, name, fn)
    def launch(*a):
        # the driver copies the values during the call: read them now, as it would
        rec.launches.append(a)
        if rec.snapshot_params is not None:
            rec.values.append(_deref_args(a[9], rec.snapshot_params))
        return (ok,)

    monkeypatch.setattr(mod, "_launch", launch)
    monkeypatch.setattr(mod, "_device_api", lambda: (lambda d: d, lambda o: False))
    return rec


class FakeStream:
    from cuda.bindings.driver import CUstream

    handle = CUstream(0x5000)


def _deref_args(address: int, params):
    """Read kernel arguments through the void** array exactly as the driver does."""
    ptrs = (ctypes.c_void_p * len(params)).from_address(address)
    out = []
    for p, ptr in zip(params, ptrs):
        ctype = {"float32": ctypes.c_float, "float64": ctypes.c_double, "int32": ctypes.c_int32,
                 "uint64": ctypes.c_uint64, "ptr": ctypes.c_uint64}[p.dtype]
        out.append(ctype.from_address(ptr).value)
    return out


def test_module_kernel_launch_plumbing(fake_driver):
    res = oc.compile("saxpy.cu", arch=ARCH)
    module = oc.Module.load(res, FakeDevice(), source=(KERNEL_DIR / "saxpy.cu").read_text())
    assert fake_driver.loaded == [res.cubin]
    k = module.kernel("saxpy")
    assert module.kernel("saxpy") is k
    assert [p.name for p in k.params] == ["a", "x", "y", "out", "n"]
    fake_driver.snapshot_params = k.params
    k.launch(FakeStream(), 40, 256, [2.5, 0x1000, 0x2000, 0x3000, 10000])
    (call,) = fake_driver.launches
    assert call[0] == "function:saxpy"
    assert call[1:8] == (40, 1, 1, 256, 1, 1, 0)
    assert int(call[8]) == 0x5000 and call[10] == 0
    assert isinstance(call[9], int)
    assert fake_driver.values[0] == [2.5, 0x1000, 0x2000, 0x3000, 10000]
    # prepacked: the very same address goes to the driver, nothing is repacked
    packed = k.pack([1.0, 0x1000, 0x2000, 0x3000, 5])
    k.launch(FakeStream(), (40,), (256, 1), packed)
    k.launch(FakeStream(), (40,), (256, 1), packed)
    assert fake_driver.launches[1][9] == fake_driver.launches[2][9] == packed.address
    assert fake_driver.values[1] == [1.0, 0x1000, 0x2000, 0x3000, 5]
    packed.set("a", -3.0)
    assert _deref_args(packed.address, k.params)[0] == -3.0
    with pytest.raises(oc.KernelNotFoundError, match="kernels present: saxpy"):
        module.kernel("sxapy")
    with pytest.raises(ValueError, match="legacy default stream"):
        k.launch(None, 1, 32, packed)
    with pytest.raises(ValueError, match="max threads per block"):
        k.launch(FakeStream(), 1, 2048, packed)
    assert len(fake_driver.launches) == 3
    module.close()
    module.close()
    assert module.closed


def test_kernel_shared_memory_opt_in_and_ex_launch(fake_driver, request):
    from cuda.bindings import driver

    res = oc.compile("saxpy.cu", arch=ARCH)
    module = oc.Module.load(res, FakeDevice(), source=(KERNEL_DIR / "saxpy.cu").read_text())
    request.addfinalizer(module.close)
    k = module.kernel("saxpy")
    args = [2.0, 0, 0, 0, 1]
    k.launch(FakeStream(), 1, 128, args, shared_mem=64 * 1024)
    k.launch(FakeStream(), 1, 128, args, shared_mem=64 * 1024)
    assert fake_driver.set_attrs == [
        ("function:saxpy",
         driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
         64 * 1024)]
    assert fake_driver.launches[-1][7] == 64 * 1024
    with pytest.raises(ValueError, match="opt-in limit"):
        k.launch(FakeStream(), 1, 128, args, shared_mem=300 * 1024)
    k.launch(FakeStream(), 8, 128, args, cluster=2, pdl=True)
    (cfg, f, kp, extra), = fake_driver.ex_launches
    assert f == "function:saxpy" and extra == 0 and isinstance(kp, int)
    assert cfg.numAttrs == 2 and cfg.gridDimX == 8 and cfg.blockDimX == 128
    with pytest.raises(ValueError, match="co-resident"):
        k.launch(FakeStream(), 132 * 4 + 1, 128, args, cooperative=True)
    assert k.occupancy(128) == 4
    assert k.attributes.num_regs == 16


def test_declared_params_checked_against_param_info(fake_driver, request):
    res = oc.compile("saxpy.cu", arch=ARCH)
    module = oc.Module.load(res, FakeDevice())
    request.addfinalizer(module.close)
    with pytest.raises(ValueError, match="takes 5 parameters in the image, but 2"):
        module.kernel("saxpy", params=("float*", "int"))
    with pytest.raises(ValueError, match="parameter 0 .* offset 0"):
        module.kernel("saxpy", params=("double", "const float*", "const float*", "float*",
                                       "size_t"))
    k = module.kernel("saxpy", params=("float", "const float*", "const float*", "float*",
                                       "size_t"))
    assert k.params[1].const
    # no source and no params: packing asks for params=
    with pytest.raises(TypeError, match="params="):
        module.kernel("burn").pack([])


def test_ptx_module_load_refuses_newer_ptx_than_driver(fake_driver):
    ptx = TINY_PTX.replace(".version 8.0", ".version 9.5")
    with pytest.raises(oc.PtxVersionError, match=r"PTX ISA 9\.5 .*CUDA 13\.5.*CUDA 13\.0"):
        oc.Module.load(ptx, FakeDevice())
    assert not fake_driver.loaded
    with oc.Module.load(TINY_PTX, FakeDevice()):
        assert fake_driver.loaded[-1].endswith(b"\0")


def test_load_kernel_memoizes_per_device_and_key(fake_driver, request):
    from orchestra.kernel import module as mod

    mod.clear_memo()
    request.addfinalizer(mod.clear_memo)
    a = oc.load_kernel("saxpy.cu", "saxpy", device=FakeDevice())
    request.addfinalizer(a.module.close)
    b = oc.load_kernel(KERNEL_DIR / "saxpy.cu", "saxpy", device=FakeDevice())
    assert a is b and len(fake_driver.loaded) == 1
    c = oc.load_kernel("saxpy.cu", "saxpy", device=FakeDevice(), options=("-DX=1",))
    request.addfinalizer(c.module.close)
    assert c is not a and len(fake_driver.loaded) == 2


def test_kernel_params_read_from_the_cubin_parameter_table():
    from orchestra.compiler.elf import kernel_params

    res = oc.compile(KERNEL_DIR / "saxpy.cu", arch=ARCH)
    # saxpy(float a, const float* x, const float* y, float* out, size_t n)
    assert kernel_params(res.cubin, "saxpy") == [(0, 4), (8, 8), (16, 8), (24, 8), (32, 8)]
    assert kernel_params(res.cubin, "no_such_kernel") is None


def test_int_not_exactly_representable_in_a_float_parameter_is_refused():
    layout = ArgLayout(normalize_params(("float a", "double b")), "k")
    layout.pack([2**24, 2**53])  # exact
    with pytest.raises(ValueError, match="parameter a .*not exactly representable in float32"):
        layout.pack([2**24 + 1, 0.0])
    with pytest.raises(ValueError, match="parameter b .*not exactly representable in float64"):
        layout.pack([0.0, 2**53 + 1])
    packed = layout.pack([0.5, 2**53])
    assert packed.values() == (0.5, float(2**53))
