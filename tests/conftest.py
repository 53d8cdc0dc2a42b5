"""Shared test setup: the `gpu` marker skips with a reason when no CUDA device is present,
and every test gets its own cubin cache directory so runs never share state."""

import pytest

from orchestra.driver.check import device_available

_HAVE_GPU = None


def _have_gpu() -> bool:
    global _HAVE_GPU
    if _HAVE_GPU is None:
        _HAVE_GPU = device_available()
    return _HAVE_GPU


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _have_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (no CUDA device found)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ORCHESTRA_CACHE_DIR", str(tmp_path_factory.mktemp("cubin-cache")))


# GPU fixtures shared by the *_gpu test files (only gpu-marked tests use them, and those are
# skipped without a device before any fixture runs)


@pytest.fixture(scope="module")
def dev():
    """Device 0, current on this thread."""
    from orchestra.driver import Device

    d = Device.get(0)
    d.make_current()
    return d


@pytest.fixture(scope="module")
def pool(dev):
    """Device 0's default memory pool (release threshold and dependencies configured)."""
    from orchestra.driver import MemoryPool

    return MemoryPool.default(dev)
