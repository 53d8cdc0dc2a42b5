"""Build step: ship the repository's kernels inside the package.

The kernels stay at the top of the repository (``cuda_src/`` for CUDA C++, ``ptx/`` for
hand-written PTX), where the docs, benchmarks and examples name them. A normal build (a wheel,
``pip install .``, an sdist's wheel) copies them into the built package as
``orchestra/_kernels/cuda_src/`` and ``orchestra/_kernels/ptx/``; an editable install copies
nothing, because there the checkout itself is on the path. `orchestra.compiler.sources` looks in
the package first and in the checkout second, so both installs find them through the same calls
(`kernel_source_dir()`, `ptx_source_dir()`). Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
#: Repository directory -> directory inside the package (orchestra.compiler.sources reads these).
KERNEL_DIRS = {"cuda_src": "orchestra/_kernels/cuda_src", "ptx": "orchestra/_kernels/ptx"}
#: What counts as a kernel source or header (orchestra.compiler.sources.SOURCE_SUFFIXES).
SUFFIXES = {".cu", ".cuh", ".h", ".hpp", ".inl", ".ptx"}


class BuildPyWithKernels(build_py):
    """`build_py` that also copies ``cuda_src/`` and ``ptx/`` into the built package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the editable install reads the checkout's directories
        for repo_dir, package_dir in KERNEL_DIRS.items():
            src_root = ROOT / repo_dir
            if not src_root.is_dir():
                raise SystemExit(f"setup.py: {src_root} is missing: the kernels ship from there")
            for src in sorted(src_root.rglob("*")):
                if src.is_file() and src.suffix in SUFFIXES:
                    dst = Path(self.build_lib) / package_dir / src.relative_to(src_root)
                    self.mkpath(str(dst.parent))
                    self.copy_file(str(src), str(dst))


setup(cmdclass={"build_py": BuildPyWithKernels})
