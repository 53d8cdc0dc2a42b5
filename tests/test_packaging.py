"""The wheel ships the kernels: build one from a copy of the sources (no network: the installed
setuptools, no build isolation), check that it holds every file of cuda_src/ and ptx/ byte for
byte under orchestra/_kernels/, and that orchestra run from the unpacked wheel, in a directory
far from the checkout, finds them: `kernel_source_dir()` points into the wheel and
`orchestra compile burn.cu --arch sm_90` builds a cubin (NVRTC runs on the CPU)."""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "orchestra", "cuda_src",
           "ptx")



def _can_build_wheels() -> bool:
    """setuptools >= 77: bdist_wheel built in, and the SPDX license string of pyproject.toml
    (PEP 639) understood."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    from importlib import metadata

    major, minor = (int(x) for x in metadata.version("setuptools").split(".")[:2])
    return (major, minor) >= (77, 0)


needs_setuptools = pytest.mark.skipif(
    not _can_build_wheels(),
    reason="building a wheel offline needs setuptools >= 77 here (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.cubin"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("orchestra-*.whl")
    return whl


def kernel_files():
    for d in ("cuda_src", "ptx"):
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in (".cu", ".cuh", ".h", ".hpp", ".inl", ".ptx"):
                yield d, p


@needs_setuptools
def test_wheel_holds_every_kernel_byte_for_byte(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        files = list(kernel_files())
        assert len(files) >= 12  # 11 CUDA C++ kernels and the PTX one, at least
        for d, p in files:
            member = f"orchestra/_kernels/{d}/{p.relative_to(ROOT / d).as_posix()}"
            assert member in names, member
            assert z.read(member) == p.read_bytes(), member
        assert "orchestra/py.typed" in names
        assert "orchestra/__main__.py" in names and "orchestra/cli/main.py" in names
        assert not [n for n in names if n.startswith(("tests/", "cuda_src/", "ptx/"))]
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "orchestra = orchestra.cli.main:main" in z.read(entry).decode()


@needs_setuptools
def test_unpacked_wheel_finds_its_kernels_from_any_directory(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site),
           "ORCHESTRA_CACHE_DIR": str(tmp_path / "cache")}
    for var in ("ORCHESTRA_KERNEL_DIR", "ORCHESTRA_PTX_DIR"):
        env.pop(var, None)
    probe = ("import orchestra, orchestra.compiler as c; print(orchestra.__file__); "
             "print(c.kernel_source_dir()); print(c.ptx_source_dir())")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    init, kdir, pdir = proc.stdout.split()
    assert Path(init).is_relative_to(site)  # the wheel's package, not the checkout's
    assert Path(kdir) == site / "orchestra" / "_kernels" / "cuda_src"
    assert Path(pdir) == site / "orchestra" / "_kernels" / "ptx"
    proc = subprocess.run([sys.executable, "-m", "orchestra", "compile", "burn.cu", "--arch",
                           "sm_90"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    cubin = work / "burn.cubin"
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    assert proc.stdout.strip().startswith(f"wrote burn.cubin ({cubin.stat().st_size} bytes, "
                                          "cubin for sm_90)")


def test_checkout_lookup_without_the_packaged_copies():
    """In the checkout (editable install) there is no orchestra/_kernels: the sources module
    falls back to the repository's own directories."""
    from orchestra.compiler import sources

    if (ROOT / "orchestra" / "_kernels").exists():
        pytest.skip("orchestra/_kernels exists in this checkout")
    if os.environ.get("ORCHESTRA_KERNEL_DIR") or os.environ.get("ORCHESTRA_PTX_DIR"):
        pytest.skip("a kernel directory override is set")
    if not Path(sources.__file__).resolve().is_relative_to(ROOT):
        pytest.skip("orchestra is not imported from this checkout")
    assert sources.kernel_source_dir() == ROOT / "cuda_src"
    assert sources.ptx_source_dir() == ROOT / "ptx"


def test_kernel_dir_override(monkeypatch, tmp_path):
    from orchestra.compiler import sources

    monkeypatch.setenv("ORCHESTRA_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("ORCHESTRA_PTX_DIR", str(tmp_path / "p"))
    assert sources.kernel_source_dir() == tmp_path.resolve()
    assert sources.ptx_source_dir() == (tmp_path / "p").resolve()
