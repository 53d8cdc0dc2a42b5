"""The graph-building API given what a caller might pass by mistake: each gets a GraphError
subclass (NodeFieldTypeError / NodeFieldValueError, keeping TypeError / ValueError) naming the
argument, before the first batch is made; never a builtin error from inside."""

from __future__ import annotations

import inspect

import pytest

from orchestra.errors import NodeFieldTypeError, NodeFieldValueError
from orchestra.graph import Alloc, Buffer, HostBuffer, KernelRef, build_pipeline
from orchestra.graph.batch import _PIPELINE_KEYWORDS, add_batch

K = KernelRef("k.cu", "k")


@pytest.mark.parametrize("batches, error", [
    (1.5, NodeFieldTypeError), ("2", NodeFieldTypeError), (True, NodeFieldTypeError),
    (-1, NodeFieldValueError), (10**30, NodeFieldValueError),
])
def test_build_pipeline_batches(batches, error):
    with pytest.raises(error, match="build_pipeline: batches must be an int from 0"):
        build_pipeline(batches, 4096, K)


@pytest.mark.parametrize("batch_bytes", [4.0, float("nan"), "4096", None])
def test_build_pipeline_batch_bytes_of_the_wrong_type(batch_bytes):
    with pytest.raises(NodeFieldTypeError, match="batch_bytes must be an int"):
        build_pipeline(2, batch_bytes, K)


def test_build_pipeline_batch_bytes_as_numpy_ints():
    import numpy as np

    g, batches = build_pipeline(2, np.int64(4096), K)
    assert [b.input.nbytes for b in batches] == [4096, 4096]
    assert type(batches[0].input.nbytes) is int


@pytest.mark.parametrize("in_flight, error", [
    (1.5, NodeFieldTypeError), ("2", NodeFieldTypeError), (True, NodeFieldTypeError),
    (0, NodeFieldValueError),
])
def test_build_pipeline_in_flight(in_flight, error):
    with pytest.raises(error, match="in_flight must be None or an int >= 1"):
        build_pipeline(5, 4096, K, in_flight=in_flight)


def test_build_pipeline_unknown_keyword_is_named_before_any_batch():
    with pytest.raises(NodeFieldTypeError, match="unknown keyword.*bogus.*block"):
        build_pipeline(2, 4096, K, bogus=1)


def test_the_keywords_build_pipeline_passes_on_are_add_batchs():
    own = {"graph", "index", "nbytes", "host_in", "host_out", "alloc_after", "kernel"}
    assert _PIPELINE_KEYWORDS == set(inspect.signature(add_batch).parameters) - own


@pytest.mark.parametrize("block", [0, -3, (0, 1, 1), ()])
def test_a_block_of_no_threads_is_the_kernel_nodes_field_error(block):
    # the default grid divided the elements by block[0]: ZeroDivisionError / IndexError
    with pytest.raises(NodeFieldValueError if block != () else NodeFieldTypeError,
                       match="KernelNode b0.kernel: block must"):
        build_pipeline(2, 4096, K, block=block)


@pytest.mark.parametrize("cls", [Buffer, HostBuffer])
def test_buffers_beyond_a_64_bit_size(cls):
    assert cls("x", 2**64 - 1).nbytes == 2**64 - 1
    with pytest.raises(NodeFieldValueError, match=r"nbytes must be a positive int \(bytes\) below 2\*\*64 \(CUDA sizes are 64-bit\), got int 18446744073709551616"):
        cls("x", 2**64)
    with pytest.raises(NodeFieldValueError, match=r"got int 1\.000e\+400 \(a 1329-bit int\)"):
        cls("x", 10**400)  # by its magnitude, not 400 digits


def test_device_ordinals_beyond_a_c_int():
    assert Buffer("x", 4, device=2**31 - 1).device == 2**31 - 1
    with pytest.raises(NodeFieldValueError, match=r"device must be a device ordinal \(an int >= 0\)"
                                                   r" below 2\*\*31 \(a C int\), got int 2147483648"):
        Buffer("x", 4, device=2**31)
    with pytest.raises(NodeFieldValueError, match="device must be a device ordinal"):
        Alloc("a", Buffer("x", 4), device=10**30)


def test_range_with_offset_none_names_the_offset():
    with pytest.raises(NodeFieldTypeError, match="range of b: offset must be an int >= 0, got "
                                                 "NoneType None"):
        Buffer("b", 16).range(None)
