"""Driver-level failures as one line of the error family (CPU; fake driver modules).

- a driver older than CUDA 13 is `DriverTooOldError` (a `NoDeviceError`), not "no CUDA device";
- cuda-bindings' ``FunctionNotFoundError`` (a driver without an entry point) and an unimportable
  ``cuda.bindings`` are `DriverBindingError`; `orchestra devices` prints one line, exit 2;
- fork safety (case C16): a child forked after CUDA was initialized gets `CudaForkError`, the
  parent keeps working (run in a fresh interpreter, so the forking process is single-threaded).
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from cuda.bindings import driver as real_driver

from orchestra.cli.main import main
from orchestra.driver import check
from orchestra.errors import (
    CudaError,
    CudaForkError,
    DriverBindingError,
    DriverTooOldError,
    NoDeviceError,
    OrchestraError,
)

OK = real_driver.CUresult.CUDA_SUCCESS

try:  # cuda-bindings' own class (a private module: the name is what orchestra matches)
    from cuda.bindings._internal.utils import FunctionNotFoundError
except ImportError:  # pragma: no cover - another cuda-bindings layout
    class FunctionNotFoundError(RuntimeError):
        pass


def _fake_driver(version=13000, *, count=None, calls=None):
    """A stand-in for ``cuda.bindings.driver``: ``count`` is what cuDeviceGetCount does."""
    calls = [] if calls is None else calls

    def cuDriverGetVersion():
        calls.append("cuDriverGetVersion")
        return (OK, version)

    def cuInit(flags):
        calls.append("cuInit")
        return (OK,)

    def cuDeviceGetCount():
        calls.append("cuDeviceGetCount")
        return count() if callable(count) else (OK, 1 if count is None else count)

    return SimpleNamespace(cuDriverGetVersion=cuDriverGetVersion, cuInit=cuInit,
                           cuDeviceGetCount=cuDeviceGetCount, CUresult=real_driver.CUresult,
                           cuGetErrorString=real_driver.cuGetErrorString)


@pytest.fixture
def fake(monkeypatch):
    """Install a fake driver module for `check` (not initialized); returns a setter."""
    monkeypatch.setattr(check, "_initialized", False)
    monkeypatch.setattr(check, "_forked", False)

    def install(drv):
        monkeypatch.setattr(check, "_driver", lambda: drv)
        return drv
    return install


# -- an old driver ----------------------------------------------------------------------------


@pytest.mark.parametrize("version,text", [(12040, "12.4"), (11080, "11.8"), (12090, "12.9")])
def test_an_old_driver_is_reported_as_too_old(fake, version, text):
    calls = []
    fake(_fake_driver(version, calls=calls))
    with pytest.raises(DriverTooOldError) as info:
        check.ensure_initialized()
    err = info.value
    assert isinstance(err, NoDeviceError) and isinstance(err, OrchestraError)
    assert (err.found, err.required) == (version, 13000)
    assert str(err) == (f"the NVIDIA driver supports CUDA {text} (cuDriverGetVersion = {version});"
                        " orchestra needs CUDA 13.0 or newer, which is NVIDIA driver R580 or"
                        " newer: update the driver")
    assert "no CUDA device" not in str(err)
    assert calls == ["cuDriverGetVersion"]  # refused before cuInit
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is DriverTooOldError and str(back) == str(err) and back.found == version
    assert check.device_available() is False  # still "no usable device" for test skipping


def test_a_new_enough_driver_initializes(fake):
    calls = []
    fake(_fake_driver(13000, calls=calls))
    check.ensure_initialized()
    assert calls == ["cuDriverGetVersion", "cuInit", "cuDeviceGetCount"]
    assert check._initialized is True


def test_orchestra_devices_with_an_old_driver_prints_one_line_and_exits_3(fake, capsys):
    fake(_fake_driver(12020))
    assert main(["devices"]) == 3  # no usable GPU (orchestra.cli.exit_codes)
    out, errtext = capsys.readouterr()
    assert out == ""
    lines = errtext.strip().splitlines()
    assert lines == ["orchestra devices: the NVIDIA driver supports CUDA 12.2 (cuDriverGetVersion ="
                     " 12020); orchestra needs CUDA 13.0 or newer, which is NVIDIA driver R580"
                     " or newer: update the driver"]


# -- binding-level failures -------------------------------------------------------------------


def _missing(name):
    def fn(*args):
        raise FunctionNotFoundError(f"function {name} is not found")
    fn.__name__ = name
    return fn


def test_a_missing_entry_point_is_a_driver_binding_error(fake):
    fake(_fake_driver())
    with pytest.raises(DriverBindingError) as info:
        check.cu(_missing("cuLibraryEnumerateKernels"), 1)
    err = info.value
    assert isinstance(err, NoDeviceError) and isinstance(err.__cause__, FunctionNotFoundError)
    assert re.fullmatch(
        r"cuLibraryEnumerateKernels: the NVIDIA driver has no entry point for it \(function"
        r" cuLibraryEnumerateKernels is not found\); orchestra needs CUDA 13\.0 \(driver R580 or"
        r" newer\), the driver here supports (CUDA \d+\.\d+|an unknown CUDA version): update the"
        r" NVIDIA driver", str(err)), str(err)


def test_orchestra_devices_with_a_missing_entry_point_prints_one_line_and_exits_3(fake, capsys):
    fake(_fake_driver(count=_missing("cuDeviceGetCount")))
    assert main(["devices"]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "orchestra devices: cuDeviceGetCount: the NVIDIA driver has no entry point for it"), lines


def test_the_cli_turns_a_raw_binding_failure_into_one_line(monkeypatch, capsys):
    # A FunctionNotFoundError from a binding call outside cu() (a hot path that checks the
    # CUresult itself) still ends as one line and exit 3 (no usable GPU).
    import orchestra.cli.devices as devices

    def rows():
        raise FunctionNotFoundError("function cuDeviceGetName is not found")
        yield  # pragma: no cover

    monkeypatch.setattr(devices, "_rows", rows)
    assert main(["devices"]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no entry point" in lines[0] and \
        "function cuDeviceGetName is not found" in lines[0], lines


def test_other_runtime_errors_are_not_swallowed(monkeypatch):
    def cuBroken():
        raise RuntimeError("a bug, not a missing entry point")

    with pytest.raises(RuntimeError, match="a bug") as info:
        check.cu(cuBroken)
    assert not isinstance(info.value, OrchestraError)


def test_an_unimportable_cuda_bindings_is_a_driver_binding_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # `from cuda.bindings import` fails
    with pytest.raises(DriverBindingError, match=r"^cuda\.bindings \(cuda-python's driver"
                       r" bindings\) cannot be imported: ModuleNotFoundError: .*; reinstall it"
                       r" with pip install 'cuda-bindings>=13,<14'$") as info:
        check._driver()
    assert isinstance(info.value, NoDeviceError)


def test_a_driver_library_that_cannot_load_stays_no_device(fake):
    class DynamicLibNotFoundError(RuntimeError):  # cuda.pathfinder's class name
        pass

    def cuDriverGetVersion():
        raise DynamicLibNotFoundError('"cuda" is an NVIDIA driver library')

    drv = _fake_driver()
    drv.cuDriverGetVersion = cuDriverGetVersion
    fake(drv)
    with pytest.raises(NoDeviceError) as info:
        check.ensure_initialized()
    assert type(info.value) is NoDeviceError
    assert str(info.value) == ('no CUDA device: orchestra needs an NVIDIA GPU and its driver'
                               ' (libcuda.so) for this (the driver library could not be loaded:'
                               ' "cuda" is an NVIDIA driver library)')


def test_cu_success_path_is_unchanged():
    def cuFake(a, b):
        return (OK, a + b)

    def cuPair():
        return (OK, 1, 2)

    def cuNone():
        return (OK,)

    assert check.cu(cuFake, 2, 3) == 5 and check.cu(cuPair) == (1, 2) and check.cu(cuNone) is None


# -- fork safety (case C16) -------------------------------------------------------------------

FORK_SCRIPT = textwrap.dedent('''
    import json, os, sys
    from orchestra.driver import check
    from orchestra.driver import device as device_mod
    from orchestra.errors import CudaError, CudaForkError, NoDeviceError

    def cuStreamSynchronize(stream):
        return (3,)  # CUDA_ERROR_NOT_INITIALIZED: what a driver call returns in such a child

    def child_report():
        out = {"forked": check.forked_after_init(), "alive": device_mod.context_alive(0),
               "devices": len(device_mod._devices)}
        try:
            check.ensure_initialized()
            out["init"] = "no error"
        except CudaForkError as err:
            out["init"] = [type(err).__name__, isinstance(err, RuntimeError),
                           isinstance(err, CudaError), err.code, str(err)]
        except NoDeviceError as err:
            out["init"] = ["NoDeviceError", str(err)]
        try:
            check.cu(cuStreamSynchronize, 1)
            out["cu"] = "no error"
        except CudaError as err:
            out["cu"] = [type(err).__name__, err.call, err.name, str(err)]
        return out

    def fork_and_report():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.write(w, json.dumps(child_report()).encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        _, status = os.waitpid(pid, 0)
        return json.loads(data), os.waitstatus_to_exitcode(status)

    # 1. the parent has not touched CUDA: a child may use orchestra normally
    before, code_before = fork_and_report()
    # 2. the parent initialized CUDA (as cuInit would) and retained device 0's context
    check._initialized = True
    device_mod._alive[0] = True
    device_mod._devices[0] = object()
    after, code_after = fork_and_report()
    # 3. the parent keeps working: its state is untouched and its errors are plain CudaErrors
    parent = {"forked": check.forked_after_init(), "initialized": check._initialized,
              "alive": device_mod.context_alive(0), "devices": len(device_mod._devices)}
    try:
        check.cu(cuStreamSynchronize, 1)
    except CudaError as err:
        parent["cu"] = type(err).__name__
    print(json.dumps({"before": before, "after": after, "codes": [code_before, code_after],
                      "parent": parent}))
''')


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork (POSIX)")
def test_forked_child_after_init_gets_a_fork_error():
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["codes"] == [0, 0]

    before = res["before"]  # forked before CUDA was touched: not a fork error
    assert before["forked"] is False
    assert before["init"] == "no error" or before["init"][0] == "NoDeviceError"
    assert before["cu"][0] == "CudaError"

    after = res["after"]  # forked after cuInit
    assert after["forked"] is True
    assert after["alive"] is False and after["devices"] == 0  # parent's contexts forgotten
    kind, is_runtime, is_cuda, code, text = after["init"]
    assert (kind, is_runtime, is_cuda, code) == ("CudaForkError", True, True, 0)
    assert text.startswith("this process was forked after CUDA was initialized in its parent")
    assert 'multiprocessing.get_context("spawn")' in text and "fork()" in text
    kind, call, name, text = after["cu"]
    assert (kind, call, name) == ("CudaForkError", "cuStreamSynchronize",
                                  "CUDA_ERROR_NOT_INITIALIZED")
    assert text.startswith("cuStreamSynchronize: CUDA_ERROR_NOT_INITIALIZED")
    assert "this process was forked after CUDA was initialized" in text

    assert res["parent"] == {"forked": False, "initialized": True, "alive": True, "devices": 1,
                             "cu": "CudaError"}


def test_fork_error_keeps_its_fields_through_context_and_pickling():
    err = CudaForkError("cuMemAllocAsync", 3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error")
    moved = err.with_context("node b0.alloc_in")
    assert type(moved) is CudaForkError and moved.context == "node b0.alloc_in"
    assert str(moved).startswith("cuMemAllocAsync: CUDA_ERROR_NOT_INITIALIZED (initialization"
                                 " error) [node b0.alloc_in]: this process was forked")
    back = pickle.loads(pickle.dumps(moved))
    assert type(back) is CudaForkError and str(back) == str(moved)
    assert not err.sticky
    assert str(CudaForkError()).startswith("this process was forked")
