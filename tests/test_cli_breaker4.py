"""More of a new user's odd inputs to `orchestra plan` / `orchestra compile` / `orchestra cache`
(no GPU): each refused with a message that says what to change (exit 2), or done as asked."""

from __future__ import annotations

import pytest

import orchestra.cli.job_options as jo
from orchestra.cli.main import main
from tests.test_cli_nufix import _KERNEL, compiles_without_the_cache


@pytest.fixture
def small_host(monkeypatch):
    monkeypatch.setattr(jo, "host_memory_bytes", lambda: 16 << 30)


@pytest.mark.parametrize("argv", [["--batch-mib", "1e300"],
                                  ["--batch-mib", "1e13", "--batches", "2"]])
@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_job_beyond_64_bit_sizes_is_a_usage_error(small_host, capsys, command, argv):
    # plan printed a plan with 300-digit byte counts (run refused it by the host's memory);
    # then a Buffer of 1e306 bytes reached the graph, which no CUDA size can count
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"orchestra {command}: the job needs ")
    # run refuses it by this machine's memory first; plan, which only warns of that, by the
    # 64-bit sizes
    why = ("beyond the 16 EiB a 64-bit size can count" if command == "plan"
           else "but this machine has 16.0 GiB")
    assert err.endswith(f"{why}; pass a smaller --batch-mib or fewer --batches")
    assert len(err) < 300


def test_fmt_bytes_of_huge_sizes():
    assert jo.fmt_bytes(3 << 50) == "3.00 PiB"
    assert jo.fmt_bytes(18 << 60) == "18.0 EiB"
    assert jo.fmt_bytes(10**306) == "8.67e+287 EiB"
    assert jo.fmt_bytes(6 << 40) == "6.00 TiB"


def test_a_cache_dir_that_cannot_be_created_warns_and_compiles(tmp_path, monkeypatch, capsys):
    # was "orchestra compile: [Errno 13] Permission denied: ..." (exit 2), no cubin written:
    # a cache location that is not a folder warned and compiled; one that cannot be made failed
    from pathlib import Path

    from orchestra.compiler import cache

    where = tmp_path / "ro" / "cache"
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **k):
        if self == where:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(where))
    with pytest.raises(cache.CacheDirError, match=r"cannot be created \(Permission denied\)"):
        cache.cache_dir()
    compiles_without_the_cache(tmp_path, capsys,
                               f"ORCHESTRA_CACHE_DIR={where} cannot be created (Permission denied)")
    assert main(["cache", "info", "--json"]) == 0  # info creates nothing: nothing to refuse
    assert '"entries": 0' in capsys.readouterr().out


def test_a_folder_by_an_entrys_name_is_no_entry(tmp_path, monkeypatch):
    # info counted it (4096 bytes) and clear "removed 0 entries" of the 1 info showed
    from orchestra.compiler import cache

    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path))
    path = cache.store("nvrtc", "a" * 64, b"image", "", {})
    (tmp_path / f"nvrtc-{'b' * 64}.bin").mkdir()
    info = cache.cache_info()
    assert (info.entries, info.bytes) == (1, path.stat().st_size)
    assert cache.cache_clear() == (1, info.bytes)
    assert cache.cache_info().entries == 0



def _empty(p):
    (p / "e.npy").write_bytes(b"")
    return p / "e.npy"


def _folder(p):
    (p / "d.npy").mkdir()
    return p / "d.npy"


def _fifo(p):
    import os

    os.mkfifo(p / "pipe.npy")
    return p / "pipe.npy"


@pytest.mark.parametrize("make, message", [
    (_empty, " is empty (0 bytes): not a .npy file"),  # was numpy's EOFError: exit 70
    (_folder, " is a directory: pass a .npy file"),
    (_fifo, " is not a regular file (a pipe, a socket or a device)"),  # np.load hung
    (lambda p: p / "missing.npy", ": no such file"),
])
@pytest.mark.parametrize("command", ["plan", "run"])
def test_input_files_that_are_no_npy_file(tmp_path, capsys, command, make, message):
    path = make(tmp_path)
    assert main([command, "--input", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"orchestra {command}: {path}{message}")  # MainJob's message too
    assert err.count("\n") == 1  # one line, no traceback


def test_an_npz_archive_is_still_named_as_one(tmp_path, capsys):
    import numpy as np

    np.savez(tmp_path / "a.npz", x=np.zeros(3, np.float32))
    assert main(["plan", "--input", str(tmp_path / "a.npz")]) == 2
    assert "not a .npy array (NpzFile)" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["", "  "])
def test_compile_with_an_empty_arch_says_so(tmp_path, capsys, arch):
    # was "no CUDA device to take the target architecture from: pass --arch" (it was passed)
    src = tmp_path / "k.cu"
    src.write_text(_KERNEL)
    assert main(["compile", str(src), "--arch", arch]) == 2
    assert capsys.readouterr().err == (
        f"orchestra compile: --arch {arch!r} is empty: pass a target such as --arch sm_90, or "
        "leave --arch out to compile for the current GPU\n")


def test_compile_output_that_is_a_folder(tmp_path, capsys):
    # was "[Errno 21] Is a directory: 'out'" after compiling
    src = tmp_path / "k.cu"
    src.write_text(_KERNEL)
    (tmp_path / "out").mkdir()
    assert main(["compile", str(src), "--arch", "sm_90", "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"orchestra compile: -o {str(tmp_path / 'out')!r} is a directory: pass a file name, "
        f"e.g. -o {tmp_path / 'out' / 'k.cubin'}\n")


def test_compile_output_that_cannot_be_written(tmp_path, capsys):
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    src = tmp_path / "k.cu"
    src.write_text(_KERNEL)
    assert main(["compile", str(src), "--arch", "sm_90", "-o", "/dev/full"]) == 2
    assert capsys.readouterr().err == ("orchestra compile: -o /dev/full: cannot be written "
                                       "(No space left on device)\n")


def test_compile_input_that_is_a_pipe(tmp_path, capsys):
    path = _fifo(tmp_path)  # was "no such file" (it is there)
    assert main(["compile", str(path), "--arch", "sm_90"]) == 2
    assert capsys.readouterr().err == (f"orchestra compile: {path} is not a regular file (a "
                                       "pipe, a socket or a device): give a .cu or .ptx file\n")
