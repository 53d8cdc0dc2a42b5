"""CPU tests of the compile cache: the key covers every header reachable through any include
route (case C18: a header in a ``-I`` directory edited between two compiles), the size cap with
least-recently-used eviction, its environment variable, and `cache_info` / `cache_clear`.

NVRTC runs on the CPU. Each test has its own cache directory (tests/conftest.py). The kernels
here take their name from a header (``#define KNAME k_v1``), so the cubin's symbol table shows
which header NVRTC really read.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import orchestra.compiler as oc
from orchestra.compiler import cache, headers, nvrtc as nvrtc_mod
from orchestra.compiler.elf import kernel_names
from orchestra.compiler.includes import system_include_dirs
from orchestra.errors import CompileError, OrchestraError

ARCH = "sm_90"
OLD = time.time() - 3600  # an mtime old enough for the header memo to trust


def kernel_src(include: str = '"kname.h"') -> str:
    return f'#include {include}\nextern "C" __global__ void KNAME(int* p) {{ p[0] = 1; }}\n'


def write_source(tmp_path: Path, text: str) -> Path:
    """``text`` as ``src/k.cu`` under ``tmp_path``."""
    src = tmp_path / "src" / "k.cu"
    src.parent.mkdir()
    src.write_text(text)
    return src


def write_header(path: Path, name: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#pragma once\n#define KNAME {name}\n")
    return path


@pytest.fixture
def case(tmp_path):
    """A source in src/ including "kname.h", which lives in inc/ (reachable only via -I)."""
    src = write_source(tmp_path, kernel_src())
    write_header(tmp_path / "inc" / "kname.h", "k_v1")
    return src, tmp_path / "inc"


@pytest.fixture
def count_nvrtc(monkeypatch):
    calls = []
    real = nvrtc_mod._run_nvrtc

    def wrapped(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(nvrtc_mod, "_run_nvrtc", wrapped)
    return calls


ROUTES = {
    "include_dirs=": lambda inc: dict(include_dirs=[inc]),
    "-I<dir>": lambda inc: dict(options=(f"-I{inc}",)),
    "-I <dir>": lambda inc: dict(options=("-I", str(inc))),
    "-I=<dir>": lambda inc: dict(options=(f"-I={inc}",)),
    "--include-path=<dir>": lambda inc: dict(options=(f"--include-path={inc}",)),
    "--include-path <dir>": lambda inc: dict(options=("--include-path", str(inc))),
}


def compile_names(src, **kw):
    res = oc.compile(src, arch=ARCH, **kw)
    return res, kernel_names(res.cubin)


def recompiles_to(name: str, src, **kw):
    """Compile ``src``; assert it missed the cache and the cubin's one kernel is ``name``."""
    res, names = compile_names(src, **kw)
    assert not res.cache_hit and names == [name]
    return res


@pytest.mark.parametrize("route", list(ROUTES))
def test_editing_a_header_recompiles_on_every_include_route(route, case, count_nvrtc):
    src, inc = case
    kw = ROUTES[route](inc)
    a = recompiles_to("k_v1", src, **kw)
    b, _ = compile_names(src, **kw)
    assert b.cache_hit and b.key == a.key and len(count_nvrtc) == 1
    write_header(inc / "kname.h", "k_v2")
    c, names = compile_names(src, **kw)
    assert not c.cache_hit and c.key != a.key and names == ["k_v2"]  # the edit is in the cubin
    d, _ = compile_names(src, **kw)
    assert d.cache_hit and d.cubin == c.cubin and len(count_nvrtc) == 2


def test_c18_header_in_an_options_include_dir_edited_between_compiles(case):
    src, inc = case
    opts = (f"-I{inc}", "-lineinfo")
    first = oc.compile(src, arch=ARCH, options=opts)
    write_header(inc / "kname.h", "k_edited")
    second = oc.compile(src, arch=ARCH, options=opts)
    assert not second.cache_hit
    assert kernel_names(first.cubin) == ["k_v1"] and kernel_names(second.cubin) == ["k_edited"]


def test_relative_include_dir_is_taken_from_the_working_directory(case, monkeypatch):
    src, inc = case
    monkeypatch.chdir(inc.parent)
    a, names = compile_names(src, options=("-Iinc",))
    assert names == ["k_v1"]
    write_header(inc / "kname.h", "k_v2")
    recompiles_to("k_v2", src, options=("-Iinc",))


def test_nested_header_edit_recompiles(tmp_path):
    """k.cu -> outer.h (in a) -> "inner.h" (next to outer.h) and <deep.h> (in b) -> KNAME."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "outer.h").write_text('#pragma once\n#include "inner.h"\n')
    (a / "inner.h").write_text("#pragma once\n#include <deep.h>\n")
    write_header(b / "deep.h", "k_deep1")
    src = tmp_path / "k.cu"
    src.write_text(kernel_src("<outer.h>"))
    opts = (f"-I{a}", "-I", str(b))
    r1, names = compile_names(src, options=opts)
    assert names == ["k_deep1"]
    write_header(b / "deep.h", "k_deep2")
    r2 = recompiles_to("k_deep2", src, options=opts)
    (a / "inner.h").write_text("#pragma once\n#include <deep.h>\n// edited, same includes\n")
    r3, names = compile_names(src, options=opts)
    assert not r3.cache_hit and names == ["k_deep2"] and r3.key != r2.key


def test_header_added_to_an_earlier_directory_shadows_a_later_one(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    write_header(second / "kname.h", "k_second")
    src = write_source(tmp_path, kernel_src("<kname.h>"))
    opts = (f"-I{first}", f"-I{second}")
    a, names = compile_names(src, options=opts)
    assert names == ["k_second"]
    assert compile_names(src, options=opts)[0].cache_hit
    write_header(first / "kname.h", "k_first")  # now found first: NVRTC reads this one
    recompiles_to("k_first", src, options=opts)


def test_header_next_to_the_including_file_shadows_the_search_path(tmp_path):
    """``#include "x"`` looks beside the including header before the -I directories."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "outer.h").write_text('#pragma once\n#include "kname.h"\n')
    write_header(b / "kname.h", "k_b")
    src = write_source(tmp_path, kernel_src("<outer.h>"))
    opts = (f"-I{b}", f"-I{a}")
    assert compile_names(src, options=opts)[1] == ["k_b"]
    write_header(a / "kname.h", "k_beside")
    recompiles_to("k_beside", src, options=opts)
    write_header(src.parent / "kname.h", "k_src")  # not beside outer.h: changes nothing
    r2, names = compile_names(src, options=opts)
    assert names == ["k_beside"]


def test_a_header_that_appears_later_changes_the_key(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    src = write_source(tmp_path, '#if __has_include("opt.h")\n#include "opt.h"\n#else\n'
                       '#define KNAME k_none\n#endif\n'
                       'extern "C" __global__ void KNAME(int* p) { p[0] = 1; }\n')
    a, names = compile_names(src, include_dirs=[inc])
    assert names == ["k_none"]
    assert compile_names(src, include_dirs=[inc])[0].cache_hit
    write_header(inc / "opt.h", "k_opt")
    recompiles_to("k_opt", src, include_dirs=[inc])
    (inc / "opt.h").unlink()
    c, names = compile_names(src, include_dirs=[inc])
    assert c.cache_hit and c.key == a.key and names == ["k_none"]


def test_include_under_a_false_if_is_still_followed(tmp_path):
    """Conservative scan: a header under ``#if 0`` is part of the key (an extra miss at worst)."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "unused.h").write_text("#define UNUSED 1\n")
    src = tmp_path / "k.cu"
    src.write_text('#if 0\n#include "unused.h"\n#endif\n'
                   'extern "C" __global__ void k(int* p) { p[0] = 1; }\n')
    a = oc.compile(src, arch=ARCH, include_dirs=[inc])
    (inc / "unused.h").write_text("#define UNUSED 2\n")
    b = oc.compile(src, arch=ARCH, include_dirs=[inc])
    assert not b.cache_hit and b.cubin == a.cubin


def test_pre_include_header_is_part_of_the_key(case):
    src, inc = case
    src.write_text('extern "C" __global__ void KNAME(int* p) { p[0] = 1; }\n')
    opts = ("-include", "kname.h", f"-I{inc}")
    assert compile_names(src, options=opts)[1] == ["k_v1"]
    write_header(inc / "kname.h", "k_v2")
    recompiles_to("k_v2", src, options=opts)


def test_include_next_follows_the_later_directory(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "kname.h").write_text("#include_next <kname.h>\n")
    write_header(b / "kname.h", "k_next1")
    src = write_source(tmp_path, kernel_src("<kname.h>"))
    opts = (f"-I{a}", f"-I{b}")
    assert compile_names(src, options=opts)[1] == ["k_next1"]
    write_header(b / "kname.h", "k_next2")
    recompiles_to("k_next2", src, options=opts)


def test_inline_source_quote_includes_resolve_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_header(tmp_path / "kname.h", "k_cwd1")
    a, names = compile_names(kernel_src())
    assert names == ["k_cwd1"]
    write_header(tmp_path / "kname.h", "k_cwd2")
    recompiles_to("k_cwd2", kernel_src())


def test_system_headers_count_by_version_not_content(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text('#include <cuda/std/cstdint>\n'
                   'extern "C" __global__ void k(cuda::std::uint32_t* p) { p[0] = 1; }\n')
    job = oc.prepare_compile(src, arch=ARCH)
    versioned, files = headers.header_key(job.source.text, job.source.name, job.options,
                                          system_include_dirs())
    kinds = {k for _d, v in versioned for k, _ver in v}
    assert kinds == {"CCCL", "cudart"}
    assert [f[0] for f in files] == ["<program>"]  # no CCCL file was read for the key
    (edge,) = files[0][2]
    assert edge.endswith(os.path.join("cuda", "std", "cstdint")) and "cccl" in edge


def test_user_dir_holding_cuda_headers_counts_by_its_version(tmp_path):
    """A CCCL of the caller's own in a -I dir: its headers are versioned, not hashed."""
    cccl = tmp_path / "mycccl"
    (cccl / "cuda" / "std" / "__cccl").mkdir(parents=True)
    (cccl / "cuda" / "std" / "__cccl" / "version.h").write_text("#define CCCL_VERSION 3001000\n")
    (cccl / "cuda" / "thing.h").write_text("#define THING 1\n")
    key = headers.header_key('#include <cuda/thing.h>\n', "inline.cu", (f"-I{cccl}",))
    versioned, files = key
    assert (str(cccl), (("CCCL", (3, 1, 0)),)) in versioned
    assert len(files) == 1 and files[0][2] == (str(cccl / "cuda" / "thing.h"),)


def test_unchanged_headers_are_not_reread(tmp_path, monkeypatch):
    """The key of an unchanged compile stats the headers and reads none of them."""
    inc = tmp_path / "inc"
    write_header(inc / "kname.h", "k1")
    (inc / "outer.h").write_text('#include "kname.h"\n')
    for p in inc.iterdir():
        os.utime(p, (OLD, OLD))
    text = kernel_src('"outer.h"')
    opts = (f"-I{inc}",)
    headers.clear_memo()
    reads = []
    real_open = open

    def counting_open(path, *a, **k):
        reads.append(os.path.basename(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(headers, "open", counting_open, raising=False)
    k1 = headers.header_key(text, "inline.cu", opts)
    assert sorted(reads) == ["kname.h", "outer.h"]
    reads.clear()
    assert headers.header_key(text, "inline.cu", opts) == k1 and reads == []
    write_header(inc / "kname.h", "k22")  # new size and mtime: read again, once
    k2 = headers.header_key(text, "inline.cu", opts)
    assert k2 != k1 and reads == ["kname.h"]
    reads.clear()
    headers.header_key(text, "inline.cu", opts)
    assert reads == ["kname.h"]  # still fresh (mtime within the settle window): re-read


def test_same_size_edit_within_the_timestamp_granularity_is_seen(tmp_path):
    inc = tmp_path / "inc"
    h = write_header(inc / "kname.h", "k_a")
    opts = (f"-I{inc}",)
    k1 = headers.header_key(kernel_src(), "inline.cu", opts)
    st = h.stat()
    h.write_text(h.read_text().replace("k_a", "k_b"))  # same size
    os.utime(h, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same mtime
    assert headers.header_key(kernel_src(), "inline.cu", opts) != k1


def _age(*paths, t=OLD):
    for p in paths:
        os.utime(p, (t, t))


@pytest.fixture
def settled_tree(tmp_path):
    """first/ (empty) and second/kname.h, all with old mtimes: the whole-result memo applies."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    write_header(second / "kname.h", "k_second")
    src = write_source(tmp_path, kernel_src("<kname.h>"))
    _age(second / "kname.h", src, first, second, src.parent, tmp_path)
    headers.clear_memo()
    return src, first, second, (f"-I{first}", f"-I{second}")


def _scans(monkeypatch):
    calls = []
    real = headers._scan_headers

    def wrapped(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(headers, "_scan_headers", wrapped)
    return calls


def test_settled_tree_key_is_answered_by_stats_alone(settled_tree, monkeypatch):
    src, first, second, opts = settled_tree
    scans = _scans(monkeypatch)
    k1 = headers.header_key(src.read_text(), str(src), opts)
    k2 = headers.header_key(src.read_text(), str(src), opts)
    assert k1 == k2 and len(scans) == 1  # the second key re-resolved nothing


def test_settled_tree_shadowing_header_added_later(settled_tree):
    src, first, second, opts = settled_tree
    a, names = compile_names(src, options=opts)
    assert names == ["k_second"] and compile_names(src, options=opts)[0].cache_hit
    write_header(first / "kname.h", "k_first")
    _age(first / "kname.h", first, t=OLD + 5)  # still settled, but a new signature
    recompiles_to("k_first", src, options=opts)


def test_settled_tree_same_size_edit_with_the_old_mtime_restored(settled_tree):
    """An edit that keeps size and mtime (``cp -p``) still changes the ctime."""
    src, first, second, opts = settled_tree
    assert compile_names(src, options=opts)[1] == ["k_second"]
    h = second / "kname.h"
    st = h.stat()
    time.sleep(0.01)  # let the ctime clock tick
    h.write_text(h.read_text().replace("k_second", "k_secnd2"))
    os.utime(h, ns=(st.st_atime_ns, st.st_mtime_ns))
    recompiles_to("k_secnd2", src, options=opts)


def test_settled_tree_new_subdirectory_header(settled_tree):
    src, first, second, opts = settled_tree
    src.write_text(kernel_src("<sub/kname.h>"))
    write_header(second / "sub" / "kname.h", "k_sub_second")
    _age(src, second / "sub" / "kname.h", second / "sub", second)
    assert compile_names(src, options=opts)[1] == ["k_sub_second"]
    assert compile_names(src, options=opts)[0].cache_hit
    write_header(first / "sub" / "kname.h", "k_sub_first")  # creates first/sub
    _age(first / "sub" / "kname.h", first / "sub", first, t=OLD + 5)
    recompiles_to("k_sub_first", src, options=opts)


@pytest.mark.parametrize("opts, dirs, pre, src_inc", [
    (("-I/a", "-I", "/b", "-I=/c", "--include-path=/d", "--include-path", "/e", "-I /f"),
     ("/a", "/b", "/c", "/d", "/e", "/f"), (), True),
    (("-Irel", "-include", "p.h", "--pre-include=q.h", "--no-source-include"),
     ("/w/rel",), ("p.h", "q.h"), False),
    (("-I/a", "-I/a", "-DX=1", "-I"), ("/a", "/w"), (), True),
    (("-I", "-DX"), ("/w/-DX",), (), True),  # NVRTC takes the next item whatever it is
    (("--use-bundled-headers=/nv", "-I/x"), ("/nv", "/nv/cccl", "/x"), (), True),
])
def test_search_path_parsing(opts, dirs, pre, src_inc):
    assert headers.search_path(opts, cwd="/w") == (dirs, pre, src_inc)


def test_key_lists_every_search_dir_in_compile_errors(tmp_path):
    inc = tmp_path / "optinc"
    inc.mkdir()
    src = tmp_path / "k.cu"
    src.write_text('#include "missing.h"\nextern "C" __global__ void k() {}\n')
    with pytest.raises(CompileError) as info:
        oc.compile(src, arch=ARCH, options=(f"-I{inc}",))
    assert str(inc) in info.value.include_dirs


@pytest.mark.parametrize("flag", ["-MD", "-M", "--generate-dependencies",
                                  "--dependency-output=deps.d"])
def test_nvrtc_has_no_dependency_output(flag, tmp_path):
    """Why headers.py scans includes itself: NVRTC refuses nvcc's dependency options. (If a
    future NVRTC accepts one, this fails and the choice in headers.py is worth revisiting.)"""
    with pytest.raises(CompileError, match="unrecognized option|NVRTC_ERROR_INVALID_OPTION"):
        oc.compile('extern "C" __global__ void k() {}\n', arch=ARCH, options=(flag,))


def test_kernel_ref_options_reach_the_key(case, monkeypatch):
    """KernelRef(options=...) -> KernelResolver's loader -> load_kernel -> prepare_compile."""
    from orchestra.kernel import module as mod
    from orchestra.execute.kernels import KernelResolver
    from orchestra.graph import KernelRef

    src, inc = case
    loaded = []

    class FakeModule:
        closed = False

        def __init__(self, result):
            self.result = result

        def kernel(self, name, params=None):
            return self.result

    def fake_load(cls, image, device=None, **kw):
        loaded.append(image)
        return FakeModule(image)

    class Dev:
        ordinal, arch = 98, ARCH

    monkeypatch.setattr(mod, "_device_api", lambda: (lambda d: d, lambda o: False))
    monkeypatch.setattr(mod.Module, "load", classmethod(fake_load))
    mod.clear_memo()
    try:
        ref = KernelRef(str(src), "KNAME", params=("int* p",), options=("-I", str(inc)))
        r1 = KernelResolver(Dev()).resolve(ref)
        assert kernel_names(r1.cubin) == ["k_v1"] and not r1.cache_hit
        write_header(inc / "kname.h", "k_v2")
        r2 = KernelResolver(Dev()).resolve(ref)
        assert not r2.cache_hit and kernel_names(r2.cubin) == ["k_v2"]
        assert len(loaded) == 2
        mod.clear_memo()
        r3 = KernelResolver(Dev()).resolve(ref)
        assert r3.cache_hit and r3.cubin == r2.cubin
    finally:
        mod.clear_memo()


# --------------------------------------------------------------------------------------------
# size cap, eviction, info / clear


@pytest.mark.parametrize("text, value", [
    ("1024", 1024), ("1K", 1024), ("1k", 1024), ("2M", 2 << 20), ("2MB", 2 << 20),
    ("2MiB", 2 << 20), ("1.5G", 3 << 29), ("3 GiB", 3 << 30), ("1T", 1 << 40), ("7B", 7),
    (" 512m ", 512 << 20), ("0", None), ("0K", None), ("none", None), ("unlimited", None),
    ("UNLIMITED", None),
    ("99999999999999999999999999", 99999999999999999999999999),  # was 1e26 rounded by a float
    (".5K", 512), ("0.001K", 1),
])
def test_parse_size(text, value):
    assert cache.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-1", "1X", "1iB", "G", "1e9", "1..2M", "12 34"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(cache.CacheConfigError, match="ORCHESTRA_CACHE_MAX_BYTES=.*is not a size"):
        cache.parse_size(text)


def test_max_bytes_env(monkeypatch):
    monkeypatch.delenv(cache.MAX_BYTES_ENV, raising=False)
    assert cache.max_bytes() == cache.DEFAULT_MAX_BYTES == 1 << 30
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "")
    assert cache.max_bytes() == cache.DEFAULT_MAX_BYTES
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "64M")
    assert cache.max_bytes() == 64 << 20
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "lots")
    with pytest.raises(cache.CacheConfigError) as info:
        cache.max_bytes()
    assert isinstance(info.value, OrchestraError) and isinstance(info.value, ValueError)
    assert "'lots'" in str(info.value)


def test_bad_cap_stops_a_compile_before_nvrtc(monkeypatch, count_nvrtc):
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "ten gigs")
    with pytest.raises(cache.CacheConfigError, match="ten gigs"):
        oc.compile("saxpy.cu", arch=ARCH)
    assert count_nvrtc == []


def _store(name: str, size: int = 1000, mtime: float | None = None) -> Path:
    key = cache.make_key("nvrtc", name)
    p = cache.store("nvrtc", key, b"\x7fELF" + b"x" * (size - 4), "", {})
    if mtime is not None:
        os.utime(p, (mtime, mtime))
    return p


def _key(name: str) -> str:
    return cache.make_key("nvrtc", name)


def test_lru_eviction_order_with_hits_refreshing_recency(monkeypatch):
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "unlimited")
    paths = {n: _store(n, mtime=OLD + i) for i, n in enumerate("abc")}
    entry_size = paths["a"].stat().st_size
    assert cache.load("nvrtc", _key("a")) is not None  # a hit: a is now the most recent
    assert paths["a"].stat().st_mtime > OLD + 10
    monkeypatch.setenv(cache.MAX_BYTES_ENV, str(3 * entry_size))
    _store("d")  # 4 entries > cap: the least recently used (b) goes
    assert {n for n, p in paths.items() if p.exists()} == {"a", "c"}
    assert cache.load("nvrtc", _key("b")) is None
    os.utime(paths["c"], (OLD + 20, OLD + 20))
    os.utime(paths["a"], (OLD + 30, OLD + 30))
    _store("e")  # evicts c (older than a), keeps a, d, e
    assert not paths["c"].exists() and paths["a"].exists()
    assert cache.cache_info().entries == 3
    assert cache.cache_info().bytes <= 3 * entry_size


def test_eviction_keeps_the_entry_just_written_even_above_the_cap(monkeypatch):
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "10")
    _store("old", mtime=OLD)
    new = _store("new", size=5000)
    assert new.exists() and cache.cache_info().entries == 1
    assert cache.load("nvrtc", _key("new")) is not None


def test_no_cap_keeps_everything(monkeypatch):
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "0")
    for i in range(5):
        _store(str(i), size=100_000)
    assert cache.cache_info().entries == 5 and cache.cache_info().max_bytes is None


def test_real_compiles_are_evicted_lru(monkeypatch, count_nvrtc):
    a = oc.compile("saxpy.cu", arch=ARCH)
    os.utime(cache.entry_path("nvrtc", a.key), (OLD, OLD))
    b = oc.compile("vector_add.cu", arch=ARCH)
    size_b = cache.entry_path("nvrtc", b.key).stat().st_size
    monkeypatch.setenv(cache.MAX_BYTES_ENV, str(size_b + 100))
    c = oc.compile("saxpy.cu", arch=ARCH, options=("-DX=1",))
    assert not cache.entry_path("nvrtc", a.key).exists()
    assert not cache.entry_path("nvrtc", b.key).exists()  # two entries do not fit: b too
    assert cache.entry_path("nvrtc", c.key).exists()
    assert not oc.compile("saxpy.cu", arch=ARCH).cache_hit


def test_vanished_entries_are_misses_not_errors(monkeypatch):
    p = _store("gone")
    p.unlink()
    assert cache.load("nvrtc", _key("gone")) is None
    # an entry listed, then deleted by another process before we unlink it
    ghost = cache.cache_dir() / f"nvrtc-{'0' * 64}.bin"
    real_scan = cache._scan

    def scan_with_ghost(d):
        entries, temps = real_scan(d)
        return [(0, ghost.name, 10**9, str(ghost))] + entries, temps

    monkeypatch.setattr(cache, "_scan", scan_with_ghost)
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "1M")
    kept = _store("kept")
    assert kept.exists()
    # a hit whose entry is evicted between the read and the touch still returns the entry
    monkeypatch.setattr(cache.os, "utime", lambda *a, **k: (_ for _ in ()).throw(
        FileNotFoundError("evicted")))
    assert cache.load("nvrtc", _key("kept")) is not None


def test_concurrent_writers_readers_and_clear_never_fail(monkeypatch):
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "20K")
    errors = []

    def worker(t):
        try:
            for i in range(40):
                _store(f"{t}-{i}", size=1500)
                cache.load("nvrtc", _key(f"{t}-{i - 1}"))
                if t == 0 and i % 10 == 0:
                    cache.cache_clear()
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    info = cache.cache_info()
    assert info.bytes <= 20 * 1024 + 6 * 1600  # at most one in-flight entry per writer over


def test_stale_temporary_files_are_removed(monkeypatch):
    d = cache.cache_dir()
    stale, fresh = d / ".nvrtc-dead.tmp", d / ".nvrtc-live.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (OLD - 7200, OLD - 7200))
    _store("x")
    assert not stale.exists() and fresh.exists()


def test_cache_info_and_clear(tmp_path, monkeypatch):
    d = tmp_path / "not-yet"
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(d))
    info = oc.cache_info()
    assert (info.location, info.entries, info.bytes, info.enabled) == (d, 0, 0, True)
    assert info.max_bytes == cache.DEFAULT_MAX_BYTES and not d.exists()  # info creates nothing
    a = oc.compile("saxpy.cu", arch=ARCH)
    oc.link_ptx(oc.ptx_source_dir() / "cp_async.ptx", arch=ARCH)
    (d / "unrelated.txt").write_text("not ours")
    files = sorted(d.glob("*.bin"))
    info = oc.cache_info()
    assert info.entries == 2 == len(files)
    assert info.bytes == sum(p.stat().st_size for p in files)
    assert info.as_dict() == {"location": str(d), "entries": 2, "bytes": info.bytes,
                              "max_bytes": 1 << 30, "enabled": True}
    monkeypatch.setenv("ORCHESTRA_NO_CACHE", "1")
    assert oc.cache_info().enabled is False
    monkeypatch.delenv("ORCHESTRA_NO_CACHE")
    assert oc.cache_clear() == (2, info.bytes)
    assert oc.cache_info().entries == 0 and (d / "unrelated.txt").exists()
    assert not oc.compile("saxpy.cu", arch=ARCH).cache_hit
    assert oc.compile("saxpy.cu", arch=ARCH).cubin == a.cubin


@pytest.mark.parametrize("value, enabled", [
    ("1", False), ("yes", False), ("true", False), ("anything", False),
    ("", True), ("0", True), ("false", True), ("False", True), ("no", True), (" off ", True),
])
def test_no_cache_reads_the_usual_spellings_of_no(monkeypatch, value, enabled):
    # ORCHESTRA_NO_CACHE=false turned the cache off
    monkeypatch.setenv("ORCHESTRA_NO_CACHE", value)
    assert cache.cache_enabled() is enabled


def test_a_relative_cache_dir_is_shown_as_the_folder_it_is(tmp_path, monkeypatch):
    # info showed "relative/dir", which names a different folder in every working directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", "relative/dir")
    info = oc.cache_info()
    assert info.location == tmp_path / "relative" / "dir" and info.location.is_absolute()
    assert not (tmp_path / "relative").exists()  # info creates nothing
