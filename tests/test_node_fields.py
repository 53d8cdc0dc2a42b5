"""Wrong Python types (and values) for graph-record fields name the record, the field and what it
must be, at construction: `NodeFieldTypeError` (a `GraphError` and a ``TypeError``) or
`NodeFieldValueError` (a `GraphError` and a ``ValueError``). Before, ``grid=1.0`` or ``after=3``
surfaced as ``'float' object is not iterable``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orchestra.errors import GraphError, NodeFieldError, NodeFieldTypeError, NodeFieldValueError
from orchestra.graph import (
    Alloc,
    Buffer,
    BufferRange,
    DeviceToHost,
    Free,
    HostBuffer,
    HostFunc,
    HostToDevice,
    In,
    InOut,
    KernelNode,
    KernelRef,
    Memset,
    Out,
)

K = KernelRef("k.cu", "k", params=("const float* x", "float* y", "int n"))
X, Y = Buffer("x", 64), Buffer("y", 64)
H = HostBuffer("h", 64)

T, V = NodeFieldTypeError, NodeFieldValueError

CASES = [
    # KernelNode: the examples of the issue first
    (lambda: KernelNode("k", K, 1.0, 1), T,
     "KernelNode k: grid must be an int or a tuple of 1-3 ints, got float 1.0"),
    (lambda: KernelNode("k", K, 1, 1, after=3), T,
     "KernelNode k: after must be a node name (str) or a list/tuple of node names, got int 3"),
    (lambda: KernelNode("k", K, 1, 1, after=["a", 3]), T,
     "KernelNode k: after[1] must be a node name (str), got int 3"),
    (lambda: KernelNode("k", K, 1, "256"), T,
     "KernelNode k: block must be an int or a tuple of 1-3 ints, got str '256'"),
    (lambda: KernelNode("k", K, (1, 2, 3, 4), 1), T,
     "KernelNode k: grid must be an int or a tuple of 1-3 ints, got tuple (1, 2, 3, 4)"),
    (lambda: KernelNode("k", K, (2, 1.5), 1), T,
     "KernelNode k: grid must be an int or a tuple of 1-3 ints, got tuple (2, 1.5)"),
    (lambda: KernelNode("k", K, (2, True), 1), T,
     "KernelNode k: grid must be an int or a tuple of 1-3 ints, got tuple (2, True)"),
    (lambda: KernelNode("k", K, 0, 1), V,
     "KernelNode k: grid must be positive (an int or a tuple of 1-3 ints >= 1), got (0, 1, 1)"),
    (lambda: KernelNode("k", K, 1, (32, -1)), V,
     "KernelNode k: block must be positive (an int or a tuple of 1-3 ints >= 1), got (32, -1, 1)"),
    (lambda: KernelNode("k", K, 1, 1, args=5), T,
     "KernelNode k: args must be a tuple or list of kernel arguments, got int 5"),
    (lambda: KernelNode("k", K, 1, 1, shared_mem=1.5), T,
     "KernelNode k: shared_mem must be an int >= 0 (bytes), got float 1.5"),
    (lambda: KernelNode("k", K, 1, 1, shared_mem=-1), V,
     "KernelNode k: shared_mem must be an int >= 0 (bytes), got int -1"),
    (lambda: KernelNode("k", K, 1, 1, attributes=3), T,
     "KernelNode k: attributes must be a mapping of launch attribute name -> value, got int 3"),
    (lambda: KernelNode("k", "k.cu", 1, 1), T,
     "KernelNode k: kernel must be a KernelRef, got str 'k.cu'"),
    (lambda: KernelNode("k", K, 1, 1, (In(X), H)), T,
     "KernelNode k: argument 1 is host buffer h; kernels take device buffers"),
    (lambda: KernelNode("k", K, 1, 1, (In(H),)), T,
     "KernelNode k: argument 0 is host buffer h; kernels take device buffers"),
    (lambda: KernelNode("k", K, 1, 1, ("x",)), T,
     "KernelNode k: argument 0 ('x') is neither a scalar nor a buffer"
     " (In/Out/InOut/Buffer/BufferRange) or a Condition"),
    # every node: name, batch, device
    (lambda: KernelNode(3, K, 1, 1), T, "KernelNode: name must be a non-empty str, got int 3"),
    (lambda: Alloc("", X), V, "Alloc: name must be a non-empty str, got str ''"),
    (lambda: Alloc("a", X, batch="1"), T, "Alloc a: batch must be an int or None, got str '1'"),
    (lambda: Free("f", X, device=-1), V,
     "Free f: device must be a device ordinal (an int >= 0) or None, got int -1"),
    (lambda: Free("f", X, device="0"), T,
     "Free f: device must be a device ordinal (an int >= 0) or None, got str '0'"),
    # Alloc / Free
    (lambda: Alloc("a", H), T, "Alloc a: buffer must be a device Buffer (not a range or host"
     " buffer), got HostBuffer HostBuffer(name='h', nbytes=64)"),
    (lambda: Free("f", 64), T,
     "Free f: buffer must be a device Buffer (not a range or host buffer), got int 64"),
    # copies
    (lambda: HostToDevice("u", 3, X), T,
     "HostToDevice u: src must be a Buffer, HostBuffer or BufferRange, got int 3"),
    (lambda: HostToDevice("u", H, "x"), T,
     "HostToDevice u: dst must be a Buffer, HostBuffer or BufferRange, got str 'x'"),
    (lambda: HostToDevice("u", X, Y), T, "HostToDevice u: src must be a host buffer; got x"
     " (device)"),
    (lambda: DeviceToHost("d", X, Y), T, "DeviceToHost d: dst must be a host buffer; got y"
     " (device)"),
    (lambda: DeviceToHost("d", X, H.range(0, 32)), V,
     "DeviceToHost d: src x[0:64] has 64 bytes but dst h[0:32] has 32; sizes must match"),
    # Memset
    (lambda: Memset("m", X, 1.0), T, "Memset m: value must be an int that fits 1 byte(s), got"
     " float 1.0"),
    (lambda: Memset("m", X, 256), V, "Memset m: value must be an int that fits 1 byte(s); got 256"),
    (lambda: Memset("m", X, 0, element_size=3), V,
     "Memset m: element_size must be 1, 2 or 4; got 3"),
    (lambda: Memset("m", X, 0, element_size="4"), T,
     "Memset m: element_size must be 1, 2 or 4 (bytes), got str '4'"),
    (lambda: Memset("m", H, 0), T, "Memset m: dst must be a device buffer; got h (host)"),
    # HostFunc
    (lambda: HostFunc("f", 3), T, "HostFunc f: fn must be callable (a function taking no"
     " arguments), got int 3"),
    (lambda: HostFunc("f", print, reads=3), T,
     "HostFunc f: reads must be a list/tuple of buffers or ranges, got int 3"),
    (lambda: HostFunc("f", print, writes=[H, "y"]), T,
     "HostFunc f: writes[1] must be a Buffer, HostBuffer or BufferRange, got str 'y'"),
    # buffers and ranges
    (lambda: Buffer("x", 1.0), T, "Buffer x: nbytes must be a positive int (bytes), got float 1.0"),
    (lambda: Buffer("x", 0), V, "Buffer x: nbytes must be a positive int (bytes), got int 0"),
    (lambda: Buffer(7, 64), T, "Buffer: name must be a non-empty str, got int 7"),
    (lambda: Buffer("x", 64, device=1.0), T,
     "Buffer x: device must be a device ordinal (an int >= 0), got float 1.0"),
    (lambda: HostBuffer("h", -4), V, "HostBuffer h: nbytes must be a positive int (bytes), got"
     " int -4"),
    (lambda: X.range(1.5, 2), T, "range of x: offset must be an int >= 0, got float 1.5"),
    (lambda: X.range(0, 0), V, "range of x: an empty range (0 bytes) touches nothing"),
    (lambda: X.range(60, 8), V, "range [60, 68) is out of bounds of x (64 bytes)"),
    (lambda: BufferRange("x", 0, 4), T, "BufferRange: buffer must be a Buffer or HostBuffer, got"
     " str 'x'"),
    (lambda: In(3), T, "In(...) must be a Buffer, HostBuffer or BufferRange, got int 3"),
    (lambda: Out(None), T, "Out(...) must be a Buffer, HostBuffer or BufferRange, got NoneType"
     " None"),
    (lambda: InOut("y"), T, "InOut(...) must be a Buffer, HostBuffer or BufferRange, got str 'y'"),
    # KernelRef
    (lambda: KernelRef(3, "k"), T, "KernelRef k: source must be a path (str or Path) or the"
     " source text (str), got int 3"),
    (lambda: KernelRef("", "k"), V, "KernelRef k: source must be a non-empty str, got str ''"),
    (lambda: KernelRef("k.cu", None), T, "KernelRef: name must be a non-empty str, got NoneType"
     " None"),
    (lambda: KernelRef("k.cu", "k", name_expression=3), T,
     "KernelRef k: name_expression must be a str or None, got int 3"),
    (lambda: KernelRef("k.cu", "k", params=3), T,
     "KernelRef k: params must be None or a list/tuple of C parameter declarations (str), got"
     " int 3"),
    (lambda: KernelRef("k.cu", "k", params=["int n", 4]), T,
     "KernelRef k: params[1] must be a C parameter declaration (str), got int 4"),
    (lambda: KernelRef("k.cu", "k", options=3), T,
     "KernelRef k: options must be a str or a list/tuple of str, got int 3"),
    (lambda: KernelRef("k.cu", "k", options=("-O3", b"-lineinfo")), T,
     "KernelRef k: options[1] must be a str, got bytes b'-lineinfo'"),
]


@pytest.mark.parametrize("make,cls,message", CASES, ids=[c[2][:60] for c in CASES])
def test_field_errors_name_the_record_the_field_and_the_type(make, cls, message):
    with pytest.raises(cls) as info:
        make()
    err = info.value
    assert type(err) is cls
    assert isinstance(err, NodeFieldError) and isinstance(err, GraphError)
    assert isinstance(err, TypeError if cls is T else ValueError)
    assert str(err) == message


def test_good_records_still_normalize():
    k = KernelNode("k", K, [4, 2], 128, [In(X), Out(Y), 16], attributes={"pdl": True},
                   after="a")
    assert k.grid == (4, 2, 1) and k.block == (128, 1, 1) and k.after == ("a",)
    assert k.args == (In(X), Out(Y), 16) and k.attributes == (("pdl", True),)
    assert HostToDevice("u", H, X).src == H.whole  # a buffer becomes its whole range
    assert HostFunc("f", print, reads=H).reads == (H.whole,)  # a single buffer is one range
    assert KernelRef(Path("k.cu"), "k").source == "k.cu"  # a Path is kept as str
    assert KernelRef("k.cu", "k", options="-O3").options == ("-O3",)
    assert Memset("m", X, np.int32(7)).unsigned_value == 7  # numpy ints are ints


@pytest.mark.parametrize("grid, block, message", [
    (2**40, 256, "grid x = 1099511627776 is above CUDA's limit of 2147483647 (gridDim.x on "
                 "every GPU): use fewer blocks (a grid-stride loop in the kernel) or split the "
                 "launch"),
    ((1, 65536), 256, "grid y = 65536 is above CUDA's limit of 65535 (gridDim.y on every GPU), "
                      "in grid (1, 65536, 1): put the blocks in grid x (up to 2**31-1) instead"),
    ((1, 1, 65536), 1, "grid z = 65536 is above CUDA's limit of 65535 (gridDim.z on every "
                       "GPU), in grid (1, 1, 65536): put the blocks in grid x"),
    (1, 2048, "block x = 2048 is above CUDA's limit of 1024 (blockDim.x on every GPU): use "
              "fewer threads per block and more blocks"),
    (1, (1, 1025), "block y = 1025 is above CUDA's limit of 1024 (blockDim.y on every GPU)"),
    (1, (1, 1, 128), "block z = 128 is above CUDA's limit of 64 (blockDim.z on every GPU), "
                     "in block (1, 1, 128)"),
    (1, (64, 32), "block (64, 32, 1) has 2048 threads, above CUDA's limit of 1024 threads per "
                  "block: use fewer threads per block and more blocks"),
    (2**4000, 1, "grid x = 1.318e+1204 (a 4001-bit int) is above CUDA's limit"),
])
def test_kernel_node_refuses_a_grid_or_block_past_cuda_limits(grid, block, message):
    # was accepted here and refused only at the launch, after the plan was made
    with pytest.raises(NodeFieldValueError) as info:
        KernelNode("k", K, grid, block)
    assert str(info.value).startswith("KernelNode k: " + message)
    assert isinstance(info.value, ValueError)


def test_kernel_node_takes_the_largest_legal_launch_and_numpy_ints():
    k = KernelNode("k", K, (2**31 - 1, 65535, 65535), (1024, 1, 1))
    assert k.grid == (2**31 - 1, 65535, 65535) and k.block == (1024, 1, 1)
    assert KernelNode("k", K, 1, (16, 16, 4)).block == (16, 16, 4)  # 1024 threads, z = 4
    k = KernelNode("k", K, np.int64(40), (np.int32(128), 2))  # was a NodeFieldTypeError
    assert k.grid == (40, 1, 1) and k.block == (128, 2, 1)
    assert all(type(v) is int for v in k.grid + k.block)  # packed for the driver as ints


def test_kernel_node_checks_stay_out_of_cuda():
    import subprocess
    import sys

    code = ("import sys; from orchestra.graph import KernelNode, KernelRef\n"
            "try:\n    KernelNode('k', KernelRef('k.cu', 'k'), 2**40, 1)\n"
            "except ValueError as e:\n    print(e)\n"
            "print(any(m.startswith('cuda') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.endswith("split the launch\nFalse\n")


def test_build_pipeline_refuses_a_later_batch_whose_grid_is_past_the_limit():
    from orchestra.graph import build_pipeline

    # the first batch is checked; the later ones are made without checks (trusted): the
    # larger last batch's grid must still be refused, naming it
    with pytest.raises(NodeFieldValueError, match=r"KernelNode b2\.kernel: grid x = "
                                                  r"2147483648 is above CUDA's limit"):
        build_pipeline(3, [4096, 4096, 4 * 32 * 2**31], K,
                       block=32)


def test_numpy_sizes_and_offsets_become_python_ints():
    # nbytes / offsets stayed numpy scalars, and b.range(np.uint64(4)) said
    # "nbytes must be an int >= 0, got NoneType None" (the nbytes it was not given)
    b = Buffer("b", np.uint64(16), np.int32(1))
    assert (b.nbytes, b.device) == (16, 1) and type(b.nbytes) is int and type(b.device) is int
    r = b.range(np.uint64(4))
    assert (r.offset, r.nbytes) == (4, 12) and type(r.offset) is type(r.nbytes) is int
    r = BufferRange(HostBuffer("h", np.int64(8)), np.int64(2), np.int16(6))
    assert (r.offset, r.nbytes, r.end) == (2, 6, 8) and type(r.buffer.nbytes) is int
    assert Buffer("b", np.int64(16)) == Buffer("b", 16)
    k = KernelNode("k", K, 1, 1, shared_mem=np.int64(64))
    assert k.shared_mem == 64 and type(k.shared_mem) is int


def test_shared_mem_past_an_unsigned_int_is_refused_when_the_node_is_made():
    KernelNode("k", K, 1, 1, shared_mem=2**32 - 1)  # the device's limit is checked at launch
    with pytest.raises(NodeFieldValueError, match=r"KernelNode k: shared_mem must be an int >= 0 "
                                                  r"\(bytes\) below 2\*\*32 \(cuLaunchKernel's "
                                                  r"unsigned int sharedMemBytes\)"):
        KernelNode("k", K, 1, 1, shared_mem=2**40)
