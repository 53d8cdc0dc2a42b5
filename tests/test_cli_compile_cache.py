"""`orchestra compile` kernel listings, --strict, --json, non-UTF-8 input and the -O=-I route,
and `orchestra cache info|clear` (NVRTC and nvJitLink run on the CPU; no GPU needed)."""

from __future__ import annotations

import json
import os

import pytest

from orchestra.cli.main import main
from orchestra.compiler import cache, ptx_source_dir

TEMPLATES = r"""
template <typename T> __global__ void scale(T* p, T a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] *= a;
}
extern "C" __global__ void plain_c(float* p) { p[0] = 1.0f; }
__device__ int counter;
"""
NO_KERNEL = "template <int N> __global__ void never_instantiated(int* p) { p[0] = N; }\n"


def run_json(capsys, argv):
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def templates(tmp_path):
    src = tmp_path / "t.cu"
    src.write_text(TEMPLATES)
    return src


def test_compile_lists_name_expressions_with_lowered_names_and_extern_c_by_name(templates,
                                                                              capsys):
    argv = ["compile", str(templates), "--arch", "sm_90", "--name-expression", "scale<float>",
            "--name-expression", "&counter"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    cubin = templates.with_suffix(".cubin")
    assert out[0] == f"wrote {cubin} ({cubin.stat().st_size} bytes, cubin for sm_90)"
    assert sorted(out[1:3]) == ["  kernel plain_c", "  kernel scale<float> -> _Z5scaleIfEvPT_S0_i"]
    assert out[3:] == ["  variable &counter -> counter"]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("cubin for sm_90) (cache hit)")


def test_compile_ptx_output_lists_its_entries(templates, capsys):
    assert main(["compile", str(templates), "--arch", "sm_90", "--ptx",
                 "--name-expression", "scale<int>"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(out[1:]) == ["  kernel plain_c", "  kernel scale<int> -> _Z5scaleIiEvPT_S0_i"]


def test_compile_json_success_and_cache_hit(templates, capsys):
    argv = ["compile", str(templates), "--arch", "90", "--json", "--name-expression",
            "scale<double>", "-o", str(templates.parent / "out.cubin")]
    code, doc = run_json(capsys, argv)
    assert code == 0
    assert doc["arch"] == "sm_90" and doc["cache_hit"] is False and doc["warnings"] == []
    (rec,) = doc["outputs"]
    out = templates.parent / "out.cubin"
    assert rec["output"] == str(out) and rec["bytes"] == out.stat().st_size
    assert rec["format"] == "cubin" and rec["target"] == "sm_90" and rec["input"] == str(templates)
    by_name = {k["name"]: k for k in doc["kernels"]}
    assert by_name == {
        "scale<double>": {"name": "scale<double>", "lowered_name": "_Z5scaleIdEvPT_S0_i",
                          "name_expression": "scale<double>", "output": str(out)},
        "plain_c": {"name": "plain_c", "lowered_name": "plain_c", "name_expression": None,
                    "output": str(out)},
    }
    code, doc = run_json(capsys, argv)
    assert code == 0 and doc["cache_hit"] is True and doc["outputs"][0]["cache_hit"] is True


def test_compile_json_for_a_ptx_input(tmp_path, capsys):
    ptx = tmp_path / "cp_async.ptx"
    ptx.write_bytes((ptx_source_dir() / "cp_async.ptx").read_bytes())
    code, doc = run_json(capsys, ["compile", str(ptx), "--arch", "sm_90", "--json"])
    assert code == 0 and doc["cache_hit"] is False
    assert [k["name"] for k in doc["kernels"]] == ["cp_async_scale"]
    code, doc = run_json(capsys, ["compile", str(ptx), "--arch", "sm_90", "--json"])
    assert doc["cache_hit"] is True


def test_zero_kernels_warns_and_strict_fails(tmp_path, capsys):
    src = tmp_path / "none.cu"
    src.write_text(NO_KERNEL)
    out = src.with_suffix(".cubin")
    assert main(["compile", str(src), "--arch", "sm_90"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"wrote {out} ({out.stat().st_size} bytes, cubin for sm_90)"]
    (warning,) = captured.err.strip().splitlines()
    assert warning.startswith(f"orchestra compile: warning: {out} holds no kernel: ")
    assert "--name-expression" in warning
    out.unlink()
    assert main(["compile", str(src), "--arch", "sm_90", "--strict"]) == 1
    captured = capsys.readouterr()
    (err,) = captured.err.strip().splitlines()
    assert err.startswith(f"orchestra compile: {out} holds no kernel") and "not written" in err
    assert captured.out == "" and not out.exists()


def test_zero_kernels_under_json(tmp_path, capsys):
    src = tmp_path / "empty.cu"
    src.write_text("")
    code, doc = run_json(capsys, ["compile", str(src), "--arch", "sm_90", "--json"])
    assert code == 0 and doc["kernels"] == [] and len(doc["warnings"]) == 1
    assert "holds no kernel" in doc["warnings"][0]
    code, doc = run_json(capsys, ["compile", str(src), "--arch", "sm_90", "--json", "--strict"])
    assert code == 1 and doc["error"]["type"] == "NoKernelsError"
    assert "holds no kernel" in doc["error"]["message"] and set(doc) == {"error"}


def test_non_utf8_input_names_the_file(tmp_path, capsys):
    src = tmp_path / "binary.cu"
    src.write_bytes(b'extern "C" __global__ void k() {}\n\xff\xfe\x00')
    assert main(["compile", str(src), "--arch", "sm_90"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err == (f"orchestra compile: {src} is not UTF-8 text (byte 0xff at offset 34): a "
                   "kernel source must be UTF-8 CUDA C++ or PTX; is it a binary file (a .cubin?) "
                   "or saved in another encoding?")
    code, doc = run_json(capsys, ["compile", str(src), "--arch", "sm_90", "--json"])
    assert code == 2 and doc["error"]["type"] == "UsageError"
    assert str(src) in doc["error"]["message"]


def test_non_utf8_source_in_the_library_is_a_value_error_naming_the_file(tmp_path):
    import orchestra.compiler as oc
    from orchestra.compiler.sources import SourceEncodingError
    from orchestra.errors import OrchestraError

    src = tmp_path / "latin1.cu"
    src.write_bytes("// caf\xe9\n".encode("latin-1"))
    with pytest.raises(SourceEncodingError, match=r"latin1\.cu is not UTF-8 text \(byte 0xe9 at "
                                                  r"offset 6\)") as info:
        oc.compile(src, arch="sm_90")
    assert isinstance(info.value, ValueError) and isinstance(info.value, OrchestraError)


def test_json_errors_are_one_object(tmp_path, capsys):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k() { int x = ; }\n')
    code, doc = run_json(capsys, ["compile", str(bad), "--arch", "sm_90", "--json"])
    assert code == 4 and doc["error"]["type"] == "CompileError"  # exit 4: a compile error
    assert "bad.cu(1)" in doc["error"]["message"]
    code, doc = run_json(capsys, ["compile", str(tmp_path / "nope.cu"), "--arch", "sm_90",
                                  "--json"])
    assert code == 2 and doc == {"error": {"type": "UsageError",
                                           "message": f"no such file: {tmp_path / 'nope.cu'}"}}


def test_cli_option_include_dir_edit_recompiles(tmp_path, capsys):
    """The CLI's -O=-I<dir> route: editing the header is a miss and shows in the listing."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "kname.h").write_text("#define KNAME k_cli1\n")
    src = tmp_path / "src" / "k.cu"
    src.parent.mkdir()
    src.write_text('#include "kname.h"\nextern "C" __global__ void KNAME(int* p) { p[0] = 1; }\n')
    argv = ["compile", str(src), "--arch", "sm_90", f"-O=-I{inc}", "--json"]
    _, doc = run_json(capsys, argv)
    assert [k["name"] for k in doc["kernels"]] == ["k_cli1"] and not doc["cache_hit"]
    _, doc = run_json(capsys, argv)
    assert doc["cache_hit"]
    (inc / "kname.h").write_text("#define KNAME k_cli2\n")
    _, doc = run_json(capsys, argv)
    assert [k["name"] for k in doc["kernels"]] == ["k_cli2"] and not doc["cache_hit"]
    assert main(["compile", str(src), "--arch", "sm_90", "-O=-I", f"-O={inc}"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["  kernel k_cli2"]


# -- orchestra cache ---------------------------------------------------------------------------


def test_cache_info_text_and_json(templates, capsys, monkeypatch):
    assert main(["compile", str(templates), "--arch", "sm_90"]) == 0
    capsys.readouterr()
    entries = sorted(cache.cache_dir().glob("*.bin"))
    total = sum(p.stat().st_size for p in entries)
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "256M")
    assert main(["cache", "info"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"location  {cache.cache_dir()}",
        "enabled   yes",
        "entries   1",
        f"size      {total / 1024:.1f} KiB ({total} bytes)",
        f"cap       256.0 MiB ({256 << 20} bytes); set with ORCHESTRA_CACHE_MAX_BYTES",
    ]
    for argv in (["cache", "info", "--json"], ["cache", "--json", "info"]):
        code, doc = run_json(capsys, argv)
        assert code == 0 and doc == {"location": str(cache.cache_dir()), "entries": 1,
                                     "bytes": total, "max_bytes": 256 << 20, "enabled": True}
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "none")
    monkeypatch.setenv("ORCHESTRA_NO_CACHE", "1")
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "enabled   no (ORCHESTRA_NO_CACHE is set)" in out and "cap       none (unlimited)" in out


def test_cache_clear_text_and_json(templates, capsys):
    assert main(["compile", str(templates), "--arch", "sm_90"]) == 0
    assert main(["compile", str(templates), "--arch", "sm_80"]) == 0
    capsys.readouterr()
    total = sum(p.stat().st_size for p in cache.cache_dir().glob("*.bin"))
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"removed 2 entries ({total / 1024:.1f} KiB) from {cache.cache_dir()}")
    assert not list(cache.cache_dir().glob("*.bin"))
    code, doc = run_json(capsys, ["cache", "clear", "--json"])
    assert code == 0 and doc == {"location": str(cache.cache_dir()), "removed": 0,
                                 "bytes_freed": 0}


def test_cache_bad_cap_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setenv(cache.MAX_BYTES_ENV, "12Q")
    assert main(["cache", "info"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == [
        "orchestra cache: ORCHESTRA_CACHE_MAX_BYTES='12Q' is not a size: give bytes (500000000), "
        "a number with K, M, G or T (512M, 2G, 1.5GiB), or 0 / none / unlimited for no cap"]
    code, doc = run_json(capsys, ["cache", "clear", "--json"])
    assert code == 2 and doc["error"]["type"] == "CacheConfigError"


def test_cache_info_on_a_missing_directory_creates_nothing(tmp_path, capsys, monkeypatch):
    d = tmp_path / "absent"
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(d))
    code, doc = run_json(capsys, ["cache", "info", "--json"])
    assert code == 0 and doc["entries"] == 0 and doc["bytes"] == 0 and not d.exists()
    assert main(["cache", "clear"]) == 0 and not os.path.exists(d)
