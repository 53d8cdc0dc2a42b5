"""Kernel arguments out of their C type's range: every scalar kind the packer supports refuses a
value it cannot hold with a `KernelArgumentValueError` naming the parameter, its C type and the
range, never a Python ``OverflowError`` (``float(10**400)``) or a ``ValueError`` from printing a
huge int; the values at the ends of each range pack to the bytes numpy gives. The launch paths
(`Kernel.launch`, a graph kernel node, an eager run) raise the same error before anything is
launched or created. No GPU needed."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from orchestra.compiler.args import ArgLayout, int_text, value_text
from orchestra.compiler.params import normalize_params
from orchestra.errors import (
    KernelArgumentError,
    KernelArgumentTypeError,
    KernelArgumentValueError,
    OrchestraError,
)

HUGE = (10 ** 400, -(10 ** 400), 10 ** 5000, 2 ** 1024, -(2 ** 1024))  # 10**5000: str() raises

# C type -> (numpy dtype, lowest, highest)
INTS = {
    "signed char": ("int8", -128, 127),
    "unsigned char": ("uint8", 0, 255),
    "short": ("int16", -32768, 32767),
    "unsigned short": ("uint16", 0, 65535),
    "int": ("int32", -2 ** 31, 2 ** 31 - 1),
    "unsigned int": ("uint32", 0, 2 ** 32 - 1),
    "long long": ("int64", -2 ** 63, 2 ** 63 - 1),
    "size_t": ("uint64", 0, 2 ** 64 - 1),
}


def _one(ctype):
    return ArgLayout(normalize_params((f"{ctype} v",)), "k")


def _refused(layout, value, cls=KernelArgumentValueError):
    with pytest.raises(cls) as info:
        layout.pack([value])
    err = info.value
    assert type(err) is cls and isinstance(err, OrchestraError)
    assert isinstance(err, ValueError if cls is KernelArgumentValueError else TypeError)
    return str(err)


@pytest.mark.parametrize("ctype", sorted(INTS))
def test_integer_ends_pack_and_one_past_is_refused_with_the_range(ctype):
    dtype, lo, hi = INTS[ctype]
    layout = _one(ctype)
    for v in (lo, hi):
        assert bytes(layout.pack([v])) == np.array(v, dtype).tobytes()
        assert bytes(layout.pack([np.dtype(dtype).type(v)])) == np.array(v, dtype).tobytes()
    for v in (lo - 1, hi + 1):
        msg = _refused(layout, v)
        assert msg == (f"parameter v ({ctype}): {v} does not fit in {dtype}: pass an int from"
                       f" {lo} to {hi}")


@pytest.mark.parametrize("ctype", sorted(INTS))
@pytest.mark.parametrize("value", HUGE, ids=["1e400", "-1e400", "1e5000", "2^1024", "-2^1024"])
def test_huge_ints_are_refused_with_a_short_message(ctype, value):
    dtype, lo, hi = INTS[ctype]
    msg = _refused(_one(ctype), value)
    assert msg.startswith(f"parameter v ({ctype}): ") and f"from {lo} to {hi}" in msg
    assert len(msg) < 200  # the magnitude, never the digits
    assert int_text(value) in msg


def test_int_text_is_exact_when_small_and_a_magnitude_when_huge():
    assert int_text(2 ** 64) == "18446744073709551616"
    assert int_text(-(10 ** 40) + 1) == str(-(10 ** 40) + 1)
    assert int_text(10 ** 400) == "1.000e+400 (a 1329-bit int)"
    assert int_text(-3 * 10 ** 5000) == "-3.000e+5000 (a 16612-bit int)"
    assert int_text(2 ** 1024) == "1.798e+308 (a 1025-bit int)"
    assert value_text(10 ** 5000).startswith("1.000e+5000") and value_text(1.5) == "1.5"
    assert value_text(True) == "True" and value_text(7) == "7"


@pytest.mark.parametrize("ctype,dtype,fmax", [
    ("float", "float32", "3.4028235e+38"), ("double", "float64", "1.7976931348623157e+308")])
def test_floats_beyond_the_range_are_refused_and_nan_inf_pass(ctype, dtype, fmax):
    layout = _one(ctype)
    fmt = "<f" if dtype == "float32" else "<d"
    for v in HUGE:  # float(v) alone raises OverflowError for each of these
        with pytest.raises(OverflowError):
            float(v)
        msg = _refused(layout, v)
        assert msg == (f"parameter v ({ctype}): the int {int_text(v)} does not fit in {dtype}:"
                       f" pass a value from -{fmax} to {fmax} (nan and +-inf pass as they are)")
    # the first int float() cannot convert, and the last one it can (to DBL_MAX)
    first_over = 2 ** 1024 - 2 ** 970
    _refused(layout, first_over)
    if dtype == "float64":
        assert layout.pack([2 ** 1024 - 2 ** 971]).values() == (np.finfo(np.float64).max,)
        msg = _refused(layout, first_over - 1)  # converts, to DBL_MAX: not exact
        assert "is not exactly representable in float64" in msg
    else:
        msg = _refused(layout, 10 ** 39)
        assert msg == (f"parameter v (float): the int 1000000000000000000000000000000000000000"
                       f" does not fit in float32: pass a value from -{fmax} to {fmax} (nan and"
                       f" +-inf pass as they are)")
        msg = _refused(layout, -3.5e38)
        assert msg.startswith("parameter v (float): -3.5e+38 does not fit in float32")
        # FLT_MAX, and a double that rounds to it, pack as FLT_MAX
        fl = float(np.finfo(np.float32).max)
        for v in (fl, 3.4028235e38):
            assert bytes(layout.pack([v])) == np.float32(fl).tobytes()
    for v in (math.nan, math.inf, -math.inf, np.dtype(dtype).type("nan"),
              np.dtype(dtype).type("-inf")):
        (got,) = struct.unpack(fmt, bytes(layout.pack([v])))
        assert (math.isnan(got) and math.isnan(v)) or got == v
    # the wrong numpy float dtype stays a type error, even for nan
    other = np.float64 if dtype == "float32" else np.float32
    assert "does not match the declared" in _refused(layout, other("nan"), KernelArgumentTypeError)


class _BigInt(int):
    pass


@pytest.mark.parametrize("ctype", ["float", "double", "int", "size_t"])
def test_int_subclasses_beyond_the_range_are_refused(ctype):
    msg = _refused(_one(ctype), _BigInt(10 ** 400))
    assert "1.000e+400 (a 1329-bit int)" in msg


@pytest.mark.parametrize("ctype,label", [("float*", "address"),
                                         ("cudaGraphConditionalHandle", "handle")])
def test_pointers_and_handles_take_64_bits(ctype, label):
    layout = _one(ctype)
    top = 2 ** 64 - 1
    assert layout.pack([top]).values() == (top,)
    assert layout.pack([np.uint64(top)]).values() == (top,)
    for v in (-1, 2 ** 64, np.int64(-1)) + HUGE:
        msg = _refused(layout, v)
        assert msg == (f"parameter v ({ctype}): {label} {int_text(int(v))} is not a 64-bit"
                       f" unsigned value (0 to 18446744073709551615)")


def test_bool_refuses_huge_ints_as_a_type_error_with_a_short_message():
    msg = _refused(_one("bool"), 10 ** 5000, KernelArgumentTypeError)
    assert msg == ("parameter v (bool): expected a bool (True/False), got int "
                   f"{int_text(10 ** 5000)}")
    assert _one("bool").pack([True]).values() == (True,)
    assert _one("bool").pack([np.bool_(False)]).values() == (False,)


def test_set_keeps_the_old_value_when_a_new_one_is_out_of_range():
    layout = ArgLayout(normalize_params(("float s", "int n", "double d")), "k")
    packed = layout.pack([0.5, 3, 2.0])
    before = bytes(packed)
    for key, name, value in (("s", "s", 10 ** 400), ("n", "n", 2 ** 31),
                             ("d", "d", -(10 ** 400)), (0, "s", 1e39)):
        with pytest.raises(KernelArgumentValueError, match=f"^parameter {name} .*does not fit"):
            packed.set(key, value)
    assert bytes(packed) == before


# -- the launch paths ------------------------------------------------------------------------------


def test_a_graph_kernel_node_names_the_node_parameter_type_and_range():
    from orchestra.app.job.graphs import BURN_PARAMS
    from orchestra.execute.kernel_args import resolve_kernel_node
    from orchestra.graph import Buffer, In, KernelNode, KernelRef, Out
    from tests.fake_cuda import FakeKernel

    ref = KernelRef("cuda_src/burn.cu", "burn", params=BURN_PARAMS)
    x, y = Buffer("x", 4096), Buffer("y", 4096)
    cases = [
        ((In(x), Out(y), 1024, 3, 10 ** 400, 1.0),
         "kernel node k: parameter s (float): the int 1.000e+400 (a 1329-bit int) does not fit"
         " in float32: pass a value from -3.4028235e+38 to 3.4028235e+38 (nan and +-inf pass as"
         " they are)"),
        ((In(x), Out(y), -1, 3, 0.5, 1.0),
         "kernel node k: parameter n (size_t): -1 does not fit in uint64: pass an int from 0 to"
         " 18446744073709551615"),
        ((In(x), Out(y), 1024, 10 ** 5000, 0.5, 1.0),
         f"kernel node k: parameter iters (int): {int_text(10 ** 5000)} does not fit in int32:"
         " pass an int from -2147483648 to 2147483647"),
    ]
    for args, message in cases:
        with pytest.raises(KernelArgumentValueError) as info:
            resolve_kernel_node(KernelNode("k", ref, 1, 256, args), FakeKernel())
        assert str(info.value) == message and isinstance(info.value, KernelArgumentError)
    with pytest.raises(KernelArgumentTypeError) as info:  # a huge int for a pointer
        resolve_kernel_node(KernelNode("k", ref, 1, 256, (10 ** 5000, Out(y), 1, 3, 0.5, 1.0)),
                            FakeKernel())
    assert f"not {int_text(10 ** 5000)} (0 means NULL)" in str(info.value)
    # NaN and inf are kernel arguments like any other float
    ka = resolve_kernel_node(KernelNode("k", ref, 1, 256, (In(x), Out(y), 8, 3, math.nan,
                                                            -math.inf)), FakeKernel())
    s, t = ka.packed.get("s"), ka.packed.get("t")
    assert math.isnan(s) and t == -math.inf


def test_an_eager_run_refuses_before_it_creates_anything(monkeypatch):
    from orchestra.execute import EagerExecutor, KernelResolver
    from tests.fake_cuda import FakeCuda, FakeKernel
    from tests.test_bad_input import Ext, K, assert_nothing_happened, one_kernel_graph
    from orchestra.graph import Buffer, In, Out

    fake = FakeCuda(monkeypatch)
    x, y = Buffer("x", 4096), Buffer("y", 4096)
    ex = EagerExecutor(kernel_resolver=KernelResolver(fake.device, lambda r, d: FakeKernel()))
    with pytest.raises(KernelArgumentValueError,
                       match=r"kernel node k: parameter t \(float\): the int -1\.000e\+400"):
        ex.run(one_kernel_graph(K, (In(x), Out(y), 1024, 3, 0.5, -(10 ** 400))),
               bindings={"x": Ext(4096), "y": Ext(4096)})
    assert_nothing_happened(fake, ex)


@pytest.mark.parametrize("kw, match", [
    ({"shared_mem": 10**5000}, r"shared_mem must be a byte count from 0 to 4294967295 \(an "
                               r"unsigned int\), got 1\.000e\+5000 \(a 16610-bit int\)"),
    ({"shared_mem": 2**32}, r"from 0 to 4294967295 \(an unsigned int\), got 4294967296"),
    ({"shared_mem": -(10**5000)}, r"byte count >= 0, got -1\.000e\+5000"),
    ({"priority": 10**5000}, r"priority must be an int from -2147483648 to 2147483647, got "
                             r"1\.000e\+5000"),
    ({"priority": -(2**31) - 1}, r"priority must be an int from -2147483648 to 2147483647, got "
                                 r"-2147483649"),
])
def test_launch_config_refuses_out_of_range_shared_memory_and_priority(kw, match):
    from orchestra.compiler.launch import LaunchConfig
    from orchestra.errors import LaunchConfigValueError

    with pytest.raises(LaunchConfigValueError, match=match):
        LaunchConfig.make(1, 32, **kw)
    assert LaunchConfig.make(1, 32, shared_mem=2**32 - 1, priority=-(2**31)).priority == -(2**31)


@pytest.mark.parametrize("flag", ["pdl", "cooperative"])
def test_launch_flags_are_bools_not_truthy_values(flag):
    from orchestra.compiler.launch import LaunchConfig
    from orchestra.errors import LaunchConfigTypeError

    # bool("no") is True: pdl="no" turned programmatic dependent launch on
    for value in ("no", "false", 2, 1.0, None, [0]):
        with pytest.raises(LaunchConfigTypeError, match=f"{flag} must be True or False, got "):
            LaunchConfig.make(1, 32, **{flag: value})
    for value, want in ((True, True), (False, False), (1, True), (0, False),
                        (np.True_, True), (np.False_, False)):
        assert getattr(LaunchConfig.make(1, 32, **{flag: value}), flag) is want
