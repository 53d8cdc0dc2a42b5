"""`Kernel.launch` on the CPU (the driver's ``cuLaunchKernel`` swapped for a recorder): the
remembered configuration and stream save work without skipping a check: a new configuration is
checked before its launch, a closed stream is refused, raw streams keep their checks, unpacked
arguments are packed and checked."""

from __future__ import annotations

import contextlib
import types

import pytest
from cuda.bindings import driver

import orchestra.kernel.module as km
from orchestra.compiler.args import ArgLayout
from orchestra.compiler.params import normalize_params
from orchestra.driver import owner as owner_mod
from orchestra.driver.owner import Owner
from orchestra.driver.stream import Stream
from orchestra.driver.owner import ResourceClosedError

PARAMS = ("const float* x", "float* y", "size_t n", "int iters", "float s", "float t")


_DEV = types.SimpleNamespace(ordinal=0, pushed=contextlib.nullcontext)


def _Stream(handle):
    """A real `Stream` object around a fake handle (no driver): its `Owner` and the open
    marker `Stream.__init__` sets up."""
    s = Stream.__new__(Stream)
    s.device, s.priority = _DEV, 0
    s._live = [True]
    s._own = Owner(s, handle, lambda h: None, _DEV, "Stream", on_close=s._live.clear)
    return s


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(owner_mod, "context_alive", lambda ordinal: True)
    calls = []
    monkeypatch.setattr(km, "_launch", lambda *a: (calls.append(a), (0,))[1])
    k = km.Kernel.__new__(km.Kernel)
    k.name, k.function = "burn", "fn"
    k.layout = ArgLayout(normalize_params(PARAMS), "burn")
    k._plain, k._ex, k._dyn_smem, k._attributes = {}, {}, None, None
    k._last_dims, k._last_stream = (None,) * 4, (None,) * 3
    checked = []

    def check(cfg):
        checked.append((cfg.grid, cfg.block, cfg.shared_mem))
        if cfg.block[0] > 1024:
            raise ValueError("block too large")

    k.check = check
    return k, calls, checked


def test_the_same_configuration_is_checked_once_and_launched_as_given(kernel):
    k, calls, checked = kernel
    s = _Stream("h1")
    packed = k.pack([1 << 20, 2 << 20, 100, 1, 0.5, 1.0])
    for _ in range(3):
        k.launch(s, 64, 256, packed)
    assert checked == [((64, 1, 1), (256, 1, 1), 0)]
    assert calls == [("fn", 64, 1, 1, 256, 1, 1, 0, "h1", packed.address, 0)] * 3
    k.launch(s, (64, 2), 256, packed)  # another configuration: checked before its launch
    assert checked[-1] == ((64, 2, 1), (256, 1, 1), 0) and calls[-1][1:4] == (64, 2, 1)
    k.launch(s, 64, 256, packed)  # back to the first: cached, not checked again
    assert len(checked) == 2 and calls[-1][1:4] == (64, 1, 1)
    with pytest.raises(ValueError, match="block too large"):
        k.launch(s, 64, 2048, packed)
    assert len(calls) == 5  # nothing launched
    k.launch(s, (64, 1, 1), [256], packed)  # equal values in new objects: the cache by value
    assert calls[-1][1:7] == (64, 1, 1, 256, 1, 1)


def test_a_remembered_stream_is_refused_once_closed(kernel):
    k, calls, _ = kernel
    a, b = _Stream("ha"), _Stream("hb")
    packed = k.pack([1, 2, 3, 1, 0.5, 1.0])
    k.launch(a, 1, 32, packed)
    k.launch(b, 1, 32, packed)
    k.launch(a, 1, 32, packed)
    assert [c[8] for c in calls] == ["ha", "hb", "ha"]
    assert k._last_stream[0] is a  # the fast path remembered it
    a.close()
    with pytest.raises(ResourceClosedError, match="Stream is closed"):
        k.launch(a, 1, 32, packed)
    assert len(calls) == 3
    k.launch(b, 1, 32, packed)
    b.close()
    with pytest.raises(ResourceClosedError):
        k.launch(b, 1, 32, packed)  # the stream launched on last, closed: refused too


def test_raw_streams_keep_their_checks(kernel):
    k, calls, _ = kernel
    packed = k.pack([1, 2, 3, 1, 0.5, 1.0])
    raw = driver.CUstream(0x1234)
    k.launch(raw, 1, 32, packed)
    assert int(calls[-1][8]) == 0x1234
    with pytest.raises(ValueError, match="legacy default stream"):
        k.launch(driver.CUstream(0), 1, 32, packed)
    with pytest.raises(ValueError, match="legacy default"):
        k.launch(None, 1, 32, packed)
    with pytest.raises(TypeError, match="needs a Stream"):
        k.launch(types.SimpleNamespace(), 1, 32, packed)
    assert len(calls) == 1


def test_unpacked_arguments_are_packed_and_checked(kernel):
    k, calls, _ = kernel
    s = _Stream("h")
    k.launch(s, 1, 32, [1 << 20, 2 << 20, 7, 2, 0.5, 1.0])
    assert len(calls) == 1 and calls[0][9] != 0
    with pytest.raises(TypeError):
        k.launch(s, 1, 32, [1 << 20, 2 << 20, 7, 2.5, 0.5, 1.0])  # a float for int iters
    assert len(calls) == 1


# -- the repeated launch: the very stream, dimensions and arguments of the last one ---------


def test_a_repeated_launch_makes_the_same_call_without_checks_and_passes_rewritten_fields(
        kernel, monkeypatch):
    k, calls, checked = kernel
    s = _Stream("h")
    packed = k.pack([1 << 20, 2 << 20, 100, 1, 0.5, 1.0])
    k.launch(s, 64, 256, packed)
    # past the first launch nothing is looked up again: the remembered call is made as is
    monkeypatch.setattr(k, "_launch_plain", lambda *a: pytest.fail("not the fast path"))
    for i in range(3):
        packed.set("iters", i + 2)  # rewritten in place: the next launch passes it
        k.launch(s, 64, 256, packed)
        assert calls[-1] == ("fn", 64, 1, 1, 256, 1, 1, 0, "h", packed.address, 0)
        assert packed.get("iters") == i + 2
    assert len(calls) == 4 and len(checked) == 1


def test_a_repeated_launch_still_refuses_a_closed_stream_and_honours_any_change(kernel):
    k, calls, checked = kernel
    s, other = _Stream("h"), _Stream("o")
    packed = k.pack([1, 2, 3, 1, 0.5, 1.0])
    other_args = k.pack([4, 5, 6, 1, 0.5, 1.0])
    k.launch(s, 8, 128, packed)
    k.launch(s, 8, 128, packed)
    k.launch(s, 8, 128, other_args)  # other arguments
    assert calls[-1][9] == other_args.address
    k.launch(other, 8, 128, other_args)  # another stream
    assert calls[-1][8] == "o"
    k.launch(other, 8, 128, other_args, 1024)  # dynamic shared memory
    assert calls[-1][7] == 1024 and checked[-1] == ((8, 1, 1), (128, 1, 1), 1024)
    k.launch(other, 8, 128, other_args)
    assert calls[-1][7] == 0
    other.close()
    with pytest.raises(ResourceClosedError, match="Stream is closed"):
        k.launch(other, 8, 128, other_args)
    n = len(calls)
    with pytest.raises(ValueError, match="block too large"):  # a new block: checked first
        k.launch(s, 8, 4096, packed)
    assert len(calls) == n


def test_a_list_grid_changed_in_place_is_read_again(kernel):
    k, calls, checked = kernel
    s = _Stream("h")
    packed = k.pack([1, 2, 3, 1, 0.5, 1.0])
    grid = [4, 1]
    k.launch(s, grid, 32, packed)
    grid[0] = 9  # the same list, new values: its identity says nothing
    k.launch(s, grid, 32, packed)
    assert [c[1] for c in calls] == [4, 9]
    block = [32]
    k.launch(s, 4, block, packed)
    block[0] = 2048
    with pytest.raises(ValueError, match="block too large"):
        k.launch(s, 4, block, packed)


def test_a_tuple_of_plain_values_packs_once_and_anything_else_every_time(kernel, monkeypatch):
    k, calls, _ = kernel
    s = _Stream("h")
    packs = []
    real_pack = k.pack
    monkeypatch.setattr(k, "pack", lambda a: (packs.append(a), real_pack(a))[1])
    args = (1 << 20, 2 << 20, 7, 2, 0.5, 1.0)
    for _ in range(3):
        k.launch(s, 1, 32, args)
    assert len(packs) == 1 and len({c[9] for c in calls}) == 1
    struct = real_pack(args)
    assert bytes(struct) == km.PackedArgs.__bytes__(k._tuple_memo[1])
    # an equal tuple is another object: packed and checked again (a float for int iters is
    # refused even though 2.0 == 2)
    with pytest.raises(TypeError, match="iters"):
        k.launch(s, 1, 32, (1 << 20, 2 << 20, 7, 2.0, 0.5, 1.0))
    # a list may change between launches: packed every time, with its new values
    values = [1 << 20, 2 << 20, 7, 2, 0.5, 1.0]
    k.launch(s, 1, 32, values)
    values[3] = 3
    k.launch(s, 1, 32, values)
    assert len(packs) == 4 and packs[-1][3] == 3

    class Buf:  # a pointer argument whose address is read at every launch
        reads = 0

        @property
        def ptr(self):
            Buf.reads += 1
            return 1 << 30

    with_buf = (Buf(), 2 << 20, 7, 2, 0.5, 1.0)
    k.launch(s, 1, 32, with_buf)
    k.launch(s, 1, 32, with_buf)
    assert Buf.reads == 2


def test_launch_attributes_are_keywords_and_unknown_ones_are_refused(kernel):
    import inspect

    k, calls, _ = kernel
    s = _Stream("h")
    packed = k.pack([1, 2, 3, 1, 0.5, 1.0])
    k.launch(s, 1, 32, packed, cooperative=False, cluster=None, pdl=False, priority=None)
    assert len(calls) == 1  # every attribute at its default: a plain cuLaunchKernel
    with pytest.raises(TypeError, match="unexpected keyword argument 'pld'.*pdl") as info:
        k.launch(s, 1, 32, packed, pld=True)
    from orchestra.errors import KernelArgumentTypeError

    assert isinstance(info.value, KernelArgumentTypeError)
    assert len(calls) == 1
    sig = inspect.signature(km.Kernel.launch)
    kinds = {n: p.kind for n, p in sig.parameters.items()}
    assert [n for n, kd in kinds.items() if kd is inspect.Parameter.KEYWORD_ONLY] == [
        "cooperative", "cluster", "pdl", "priority"]
    assert sig.parameters["shared_mem"].default == 0


def test_out_of_range_arguments_are_refused_before_the_launch(kernel):
    """A value the parameter's C type cannot hold is a `KernelArgumentValueError` naming the
    parameter, its type and the range (never an ``OverflowError``), and nothing is launched;
    NaN and inf are floats like any other."""
    from orchestra.errors import KernelArgumentValueError

    k, calls, _ = kernel
    s = _Stream("h")
    with pytest.raises(KernelArgumentValueError) as info:
        k.launch(s, 1, 32, [1 << 20, 2 << 20, 7, 2, 10 ** 400, 1.0])
    assert str(info.value) == (
        "parameter s (float): the int 1.000e+400 (a 1329-bit int) does not fit in float32: pass"
        " a value from -3.4028235e+38 to 3.4028235e+38 (nan and +-inf pass as they are)")
    with pytest.raises(KernelArgumentValueError, match=r"parameter iters \(int\): 2147483648 does"
                                                       r" not fit in int32: pass an int from"
                                                       r" -2147483648 to 2147483647"):
        k.launch(s, 1, 32, {"x": 0, "y": 0, "n": 7, "iters": 2 ** 31, "s": 0.5, "t": 1.0})
    with pytest.raises(KernelArgumentValueError, match=r"parameter n \(size_t\): -1 does not fit"
                                                       r" in uint64: pass an int from 0 to"
                                                       r" 18446744073709551615"):
        k.launch(s, 1, 32, [0, 0, -1, 2, 0.5, 1.0])
    assert calls == []
    k.launch(s, 1, 32, [0, 0, 7, 2, float("nan"), float("-inf")])
    assert len(calls) == 1
