"""Graph control flow on the CPU: conditions and their handle arguments, body graphs, the
verifier and the scheduler through bodies, the driver's body restrictions, conditional nodes
(IF / ELSE, WHILE, SWITCH) and child graphs on every executor, programmatic edges, node
enable / disable.

The executors run on the fake drivers of tests/fake_cuda.py (eager) and tests/fake_graph_cuda.py
(capture, graph-build), whose "device memory" is host memory and whose kernels are Python
functions reading their packed arguments (the fake graph driver runs conditional nodes the way
the driver does: IF / ELSE, SWITCH, WHILE on the handle a kernel set), so outputs are checked
against plain Python references."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda.bindings import driver as _d

from orchestra.compiler.args import ArgLayout
from orchestra.compiler.params import normalize_params, parse_params
from orchestra.errors import (
    KernelArgumentTypeError,
    NameCollisionError,
    NodeFieldTypeError,
    NodeFieldValueError,
)
from orchestra.execute.kernel_args import resolve_kernel_node
from orchestra.graph import (
    Access,
    Buffer,
    Condition,
    HostBuffer,
    In,
    KernelNode,
    KernelRef,
    Mode,
    Out,
    TaskGraph,
)
from tests.fake_cuda import FakeKernel

SET_PARAMS = ("cudaGraphConditionalHandle h", "const unsigned int* src", "unsigned int* flag")
SETTER = KernelRef("set.cu", "set_cond", params=SET_PARAMS)


# -- conditions and their handle arguments ---------------------------------------------------


def test_a_condition_is_plain_data_with_checked_fields():
    flag = Buffer("flag", 16)
    c = Condition("c", default=1, flag=flag)
    assert c.flag == flag.range(0, 4) and c.flags == 1 and c.key == ("condition", "c")
    assert Condition("d").flags == 0 and Condition("d") == Condition("d")
    assert c.whole.nbytes == 8 and not c.is_host
    with pytest.raises(NodeFieldValueError, match="default must fit an unsigned 32-bit"):
        Condition("c", default=1 << 32)
    with pytest.raises(NodeFieldValueError, match="default"):
        Condition("c", default=-1)
    with pytest.raises(NodeFieldTypeError, match="flag must be a device Buffer"):
        Condition("c", flag=HostBuffer("h", 4))
    with pytest.raises(NodeFieldValueError, match="flag must be 4 bytes at a 4-byte aligned"):
        Condition("c", flag=flag.range(2, 4))
    with pytest.raises(NodeFieldValueError, match="on device 1, the condition on 0"):
        Condition("c", flag=Buffer("f1", 4, device=1))


def test_the_handle_parameter_type_is_parsed_and_packed_as_64_bits():
    src = ("extern \"C\" __global__ void set_cond(cudaGraphConditionalHandle h, "
           "const unsigned int* v) { }")
    h, v = parse_params(src, "set_cond")
    assert (h.kind, h.ctype, h.size, h.dtype, h.is_handle) == (
        "handle", "cudaGraphConditionalHandle", 8, "uint64", True)
    assert not h.is_pointer and v.is_pointer
    layout = ArgLayout((h, v), "set_cond")
    packed = layout.pack((_d.CUgraphConditionalHandle(0xFFFF_0000_1234), 0))
    assert packed.get("h") == 0xFFFF_0000_1234 and layout.size == 16
    packed.set("h", (1 << 64) - 1)
    packed.set(0, None)
    assert packed.get(0) == 0
    with pytest.raises(KernelArgumentTypeError, match="needs a conditional handle"):
        packed.set("h", 1.5)
    with pytest.raises(KernelArgumentTypeError, match="needs a conditional handle"):
        packed.set("h", True)
    assert normalize_params(["CUgraphConditionalHandle h"])[0].is_handle


def test_a_kernel_taking_a_condition_writes_it():
    c = Condition("c")
    src, flag = Buffer("src", 4), Buffer("flag", 4)
    k = KernelNode("set", SETTER, 1, 1, (c, In(src), Out(flag)))
    assert Access(c.whole, Mode.WRITE) in k.accesses()
    g = TaskGraph()
    g.add(k)
    assert g.conditions == (c,) and g.buffer("c") is c
    assert {b.name for b in g.buffers} == {"src", "flag"}  # a condition is no device buffer
    with pytest.raises(NameCollisionError, match="buffer name 'src' already names Buffer"):
        g.add(KernelNode("k2", SETTER, 1, 1, (Condition("src"), In(src), Out(flag))))


def test_resolve_packs_a_handle_field_and_refuses_a_condition_for_another_type():
    c = Condition("c")
    src, flag = Buffer("src", 4), Buffer("flag", 4)
    kernel = FakeKernel(SET_PARAMS, "set_cond")
    ka = resolve_kernel_node(KernelNode("set", SETTER, 1, 1, (c, In(src), Out(flag))), kernel)
    assert [(h.index, h.condition) for h in ka.handles] == [(0, "c")]
    assert [p.buffer for p in ka.pointers] == ["src", "flag"]
    ka.bind_handles({"c": 0xABCDEF})
    assert ka.packed.get("h") == 0xABCDEF
    ka.bind_handles({})
    assert ka.packed.get("h") == 0
    other = FakeKernel(("unsigned long long h", "const unsigned int* src", "unsigned int* flag"),
                       "set_cond")
    with pytest.raises(KernelArgumentTypeError,
                       match="argument 0 is condition c but parameter h is unsigned long long; "
                             "declare it cudaGraphConditionalHandle"):
        resolve_kernel_node(KernelNode("set", SETTER, 1, 1, (c, In(src), Out(flag))), other)
    assert ctypes.sizeof(ka.packed.struct) == 24
