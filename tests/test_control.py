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
import types
from typing import ClassVar

import attrs
import numpy as np
import pytest
from cuda.bindings import driver as _d

from orchestra.compiler.args import ArgLayout
from orchestra.compiler.griddep import PdlWithoutWaitError
from orchestra.driver.capture import (
    CaptureSession,
    CaptureToGraph,
    add_captured_node,
    capture_status,
    is_capturing,
)
from orchestra.driver.check import cu
from orchestra.compiler.params import normalize_params, parse_params
from orchestra.errors import (
    GraphError,
    HazardError,
    KernelArgumentTypeError,
    KernelArgumentValueError,
    NameCollisionError,
    NodeFieldTypeError,
    NodeFieldValueError,
)
from orchestra.execute import EagerExecutor, KernelResolver
from orchestra.execute.cuda_graph.build import GraphBuildExecutor
from orchestra.execute.cuda_graph.capture import CaptureExecutor
from orchestra.execute.cuda_graph.spec import translate
from orchestra.execute.errors import BindingError, ExecutorArgumentValueError
from orchestra.execute.kernel_args import resolve_kernel_node
from orchestra.execute.lowering import LOWERINGS, Lowering
from orchestra.execute.lowering.conditional import EagerConditionError
from orchestra.execute.resources import StreamPool
from orchestra.execute.lowering.restrictions import (
    CHILD_GRAPH,
    CONDITIONAL_BODY,
    BodyRestrictionError,
    check_body,
)
from orchestra.graph import (
    Access,
    Alloc,
    Buffer,
    Condition,
    DeviceToHost,
    Free,
    HostBuffer,
    HostFunc,
    HostToDevice,
    In,
    KernelNode,
    KernelRef,
    Memset,
    Mode,
    Node,
    Out,
    TaskGraph,
)
from orchestra.graph.bodies import body_accesses, container_of, walk
from orchestra.graph.nodes import ChildGraph, Conditional, If, Switch, While
from orchestra.schedule import CostModel, PlanBuilder, schedule, verify, verify_graph_edges
from tests import fake_graph_cuda as fg
from tests.fake_cuda import FakeCuda, FakeKernel
from tests.graphs_for_tests import branch_graph, burn_reference, fake_executor
from tests.test_lowering import BURN, KINDS, executor, fakes, run  # noqa: F401

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


# -- body graphs ------------------------------------------------------------------------------


@attrs.frozen
class Group(Node):
    """A test kind holding one body (what child graphs and conditionals build on)."""

    body: TaskGraph
    kind: ClassVar[str] = "group"

    @property
    def bodies(self):
        return (self.body,)

    def accesses(self):
        return body_accesses(self.bodies)


@attrs.frozen
class Branching(Node):
    """A test kind that tests a condition and holds bodies (a conditional's shape)."""

    condition: Condition
    branches: tuple = ()
    kind: ClassVar[str] = "test"

    @property
    def tests(self):
        return self.condition

    @property
    def bodies(self):
        return self.branches

    def accesses(self):
        return body_accesses(self.bodies) + (Access(self.condition.whole, Mode.READ),)


SCALE = KernelRef("scale.cu", "scale", params=("const float* x", "float* y", "int n"))


def scale(name, x, y):
    return KernelNode(name, SCALE, 1, 32, (In(x), Out(y), x.nbytes // 4))


def test_body_accesses_are_the_bodies_ranges_as_a_whole():
    a, b, c = Buffer("a", 64), Buffer("b", 64), Buffer("c", 64)
    body = TaskGraph()
    body.add(scale("s1", a, b))
    body.add(scale("s2", b, c))
    got = {(acc.buffer.name, acc.mode) for acc in body_accesses((body,))}
    # a only read; b written then read; c written: read-modify-writes seen from outside
    assert got == {("a", Mode.READ), ("b", Mode.READ_WRITE), ("c", Mode.READ_WRITE)}
    other = TaskGraph()
    other.add(scale("s3", c, a.range(0, 32)))
    got = {(str(acc.range), acc.mode) for acc in body_accesses((body, other))}
    assert ("a[0:32]", Mode.READ_WRITE) in got and ("a[0:64]", Mode.READ) in got


def test_edges_run_through_a_node_with_a_body():
    x, y, z = Buffer("x", 64), Buffer("y", 64), Buffer("z", 64)
    body = TaskGraph()
    body.add(scale("inner", x, y))
    g = TaskGraph()
    g.add(scale("before", z, x))
    g.add(Group("group", body))
    g.add(scale("after", y, z))
    assert g.edges == {("before", "group"), ("group", "after"), ("before", "after")}  # WAR z
    assert g.edge_reason("before", "group").startswith("RAW")
    assert [(n.name, tuple(c.name for c in chain)) for n, chain in walk(g)] == [
        ("before", ()), ("group", ()), ("inner", ("group",)), ("after", ())]
    assert container_of(g) == {"before": None, "group": None, "inner": "group", "after": None}


def test_names_are_unique_across_bodies_and_a_body_cannot_hold_itself():
    x, y = Buffer("x", 64), Buffer("y", 64)
    body = TaskGraph()
    body.add(scale("k", x, y))
    g = TaskGraph()
    g.add(scale("k", y, x))
    g.add(Group("group", body))
    with pytest.raises(NameCollisionError, match="'k' is used in the graph and in the body of "
                                                 "group"):
        g.validate()
    g2 = TaskGraph()
    g2.add(Group("g1", body))
    g2.add(Group("g2", body))  # one body in two places: its names twice
    with pytest.raises(NameCollisionError, match="body of g1 and in the body of g2"):
        g2.validate()
    loop = TaskGraph()
    loop.add(scale("k", x, y))
    with pytest.raises(GraphError, match="a body of it is the graph it is added to"):
        loop.add(Group("self", loop))
    outer, inner = TaskGraph(), TaskGraph()
    inner.add(Group("back", outer))
    outer.add(Group("in", inner))
    with pytest.raises(GraphError, match="holds the graph it is in"):
        list(walk(outer))


def test_a_body_with_a_cycle_is_refused():
    x = Buffer("x", 64)
    body = TaskGraph()
    body.add(Memset("a", x, 0, after=("b",)))
    body.add(Memset("b", x, 1))
    g = TaskGraph()
    g.add(Group("group", body))
    with pytest.raises(GraphError, match="cycle"):
        g.validate()


def setter(name, cond, src, flag):
    return KernelNode(name, SETTER, 1, 1, (cond, In(src), Out(flag)))


def test_condition_rules():
    src, flag = Buffer("src", 4), Buffer("flag", 4)
    c = Condition("c")
    ok = TaskGraph()
    ok.add(setter("set", c, src, flag))
    ok.add(Branching("t", c))
    ok.validate()
    assert ok.edges == {("set", "t")}  # the setter writes the condition the test reads

    two = TaskGraph()
    two.add(Branching("t1", c))
    two.add(Branching("t2", c))
    with pytest.raises(GraphError, match="tested by t1 and by t2.*single conditional node"):
        two.validate()

    orphan = TaskGraph()
    orphan.add(setter("set", Condition("d"), src, flag))
    with pytest.raises(GraphError, match="kernel set sets condition d, but no conditional"):
        orphan.validate()

    late = TaskGraph()
    late.add(Branching("t", c))
    late.add(setter("set", c, src, flag))
    with pytest.raises(GraphError, match="kernel set sets condition c after t tests it"):
        late.validate()

    d = Condition("d", default=1)
    both = TaskGraph()
    both.add(setter("set", d, src, flag))
    both.add(Branching("t", d))
    with pytest.raises(GraphError, match="condition d has a default .1. and kernel set also"):
        both.validate()

    body = TaskGraph()
    body.add(setter("again", d, src, flag))  # a loop body sets its own condition: fine
    loop = TaskGraph()
    loop.add(Branching("loop", d, (body,)))
    loop.validate()

    outside = TaskGraph()  # a setter in another body than the tester's
    inner = TaskGraph()
    inner.add(setter("deep", c, src, flag))
    outside.add(Group("elsewhere", inner))
    outside.add(Branching("t", c))
    with pytest.raises(GraphError, match="sets condition c from the body of elsewhere, but t "
                                         "tests it in the graph"):
        outside.validate()


# -- the verifier and the scheduler through bodies; programmatic edges ------------------------


def loop_graph():
    """alloc x, y; before writes x; group (body: x -> y); after reads y; frees."""
    x, y = Buffer("x", 64), Buffer("y", 64)
    body = TaskGraph()
    body.add(scale("inner", x, y))
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(Memset("before", x, 0))
    g.add(Group("group", body))
    g.add(scale("after", y, x))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    return g


def kinds(findings):
    return sorted((f.kind, f.nodes) for f in findings)


def test_a_plan_that_orders_through_the_group_is_clean():
    g = loop_graph()
    assert verify(schedule(g, "by-engine", 3), g) == []
    assert verify(schedule(g, "round-robin", 2), g) == []
    assert verify_graph_edges(g) == []


def test_the_verifier_catches_a_race_with_a_body_access():
    g = loop_graph()
    # two streams, no events: the group reads x (its body does) unordered after before's write
    plan = (PlanBuilder().stream("a").run("ax", "ay", "before").stream("b")
            .run("group", "after", "fx", "fy").build())
    found = verify(plan, g)
    assert ("RAW", ("before", "group")) in kinds(found)
    raw = next(f for f in found if f.nodes == ("before", "group"))
    assert raw.buffer == "x" and "no event orders before before group" in raw.message


def test_the_verifier_catches_a_write_after_a_body_read_and_a_use_after_free():
    x, y, z = Buffer("x", 64), Buffer("y", 64), Buffer("z", 64)
    body = TaskGraph()
    body.add(scale("inner", x, y))  # the body reads x
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Group("group", body))
    g.add(scale("overwrite", z, x))  # writes x after the group read it (WAR)
    g.add(Free("fx", x))
    # the overwrite on its own stream, unordered with the group; the free before the group
    plan = (PlanBuilder().stream("a").run("ax", "fx", "group").stream("b")
            .run("overwrite").build())
    found = kinds(verify(plan, g))
    assert ("WAR", ("group", "overwrite")) in found
    assert ("USE_AFTER_FREE", ("fx", "group")) in found


def test_the_verifier_catches_a_free_racing_the_body():
    g = loop_graph()
    edges = set(g.edges) - {("group", "fy"), ("after", "fy")}  # fy no longer after the body
    found = verify_graph_edges(g, edges)
    assert ("FREE_RACE", ("after", "fy")) in kinds(found)  # the last use of y, then the body
    assert ("FREE_RACE", ("group", "fy")) not in kinds(found)  # ordering after orders it
    found = verify_graph_edges(g, set(g.edges) - {("before", "group")})
    assert ("RAW", ("before", "group")) in kinds(found)  # the body reads what before writes


def test_findings_inside_a_body_name_the_body():
    x = Buffer("x", 64)
    body = TaskGraph()
    body.add(Free("f1", x))
    body.add(Free("f2", x))
    g = TaskGraph()
    g.add(Group("group", body))
    found = verify_graph_edges(g)
    assert found and all(f.message.startswith("in the body of group: ") for f in found)
    assert {f.kind for f in found} <= {"DOUBLE_FREE", "USE_BEFORE_ALLOC"}


def chain_graph():
    """p writes y from x; c reads y writes z; d reads y (and z) writes w."""
    x, y, z, w = (Buffer(n, 64) for n in "xyzw")
    g = TaskGraph()
    g.add(scale("p", x, y))
    g.add(scale("c", y, z))
    g.add(KernelNode("d", SCALE, 1, 32, (In(z), Out(w), 16), after=("c",)))
    return g


def test_a_programmatic_edge_orders_only_a_consumer_that_waits():
    g = chain_graph()
    edges = {("p", "c"), ("c", "d")}
    assert verify_graph_edges(g, edges, programmatic={("p", "c")}, waits={"c"}.__contains__) == []
    found = verify_graph_edges(g, edges, programmatic={("p", "c")}, waits=lambda n: False)
    raw = [f for f in found if f.kind == "RAW"]
    assert [(f.nodes, f.buffer) for f in raw] == [(("p", "c"), "y")]
    assert "programmatic edge p -> c orders nothing: c never executes griddepcontrol.wait" \
        in raw[0].message
    # without waits= no consumer is known to wait: the edge orders nothing
    assert [f.nodes for f in verify_graph_edges(g, edges, programmatic={("p", "c")})
            if f.kind == "RAW"] == [("p", "c")]


def test_a_non_waiting_consumer_breaks_the_order_of_what_follows_it_too():
    x, y, z, w = (Buffer(n, 64) for n in "xyzw")
    g = TaskGraph()
    g.add(scale("p", x, y))
    g.add(KernelNode("c", SCALE, 1, 32, (In(z), Out(w), 16), after=("p",)))
    g.add(scale("d", y, z.range(0, 32)))  # reads y: after p only through c
    edges = {("p", "c"), ("c", "d")}
    assert verify_graph_edges(g, edges, programmatic={("p", "c")}, waits=lambda n: True) == []
    found = verify_graph_edges(g, edges, programmatic={("p", "c")}, waits=lambda n: False)
    assert ("RAW", ("p", "d")) in kinds(found) and ("ORDER", ("p", "c")) in kinds(found)


def test_a_node_with_a_body_costs_its_dearest_body_once():
    model = CostModel(kernel_us=5.0, memset_gbps=1.0)
    a, b = TaskGraph(), TaskGraph()
    x = Buffer("x", 64)
    a.add(scale("k1", x, x.range(0, 32)))
    a.add(scale("k2", x, x.range(32, 32)))
    b.add(Memset("m", x, 0))
    node = Branching("t", Condition("c"), (a, b))
    assert model.cost(node) == 10.0
    assert model.cost(Group("g", b)) == pytest.approx(64 / 1e3)


# -- the driver's body restrictions -------------------------------------------------------------


class GroupLowering(Lowering):
    node_type = Group
    graph_node = "graph"
    driver_node_type = "CU_GRAPH_NODE_TYPE_GRAPH"


@pytest.fixture
def group_entry(monkeypatch):
    monkeypatch.setitem(LOWERINGS, Group, GroupLowering())


def body_with(*nodes):
    body = TaskGraph()
    for n in nodes:
        body.add(n)
    return body


@pytest.mark.parametrize("bad,kind", [
    (lambda x: Alloc("alloc", Buffer("t", 64)), "graph memory allocation"),
    (lambda x: Free("free", x), "graph memory free"),
    (lambda x: HostFunc("host", lambda: None, reads=(HostBuffer("h", 8),)), "host function"),
])
def test_a_conditional_body_refuses_host_and_memory_nodes_naming_them(group_entry, bad, kind):
    x = Buffer("x", 64)
    ok = body_with(scale("k", x, x.range(0, 32)), Memset("m", x, 0),
                   DeviceToHost("d2h", x, HostBuffer("out", 64)))
    check_body(Group("g", ok), CONDITIONAL_BODY)  # kernels, memsets, copies: fine
    with pytest.raises(BodyRestrictionError) as info:
        check_body(Group("loop", body_with(scale("k", x, x.range(0, 32)), bad(x))),
                   CONDITIONAL_BODY)
    err = info.value
    assert f"({kind}" in str(err) or kind in str(err)
    assert "cannot be in the body of loop" in str(err)
    assert "Conditional Node Body Graph Requirements" in str(err)
    assert err.container == "loop" and err.node == bad(x).name
    assert isinstance(err, GraphError) and isinstance(err, ValueError)


def test_restrictions_apply_at_any_depth_and_child_graphs_refuse_their_own(group_entry):
    x = Buffer("x", 64)
    inner = Group("inner", body_with(HostFunc("h", lambda: None)))
    with pytest.raises(BodyRestrictionError, match="node h .* cannot be in the body of inner, "
                                                   "inside outer"):
        check_body(Group("outer", body_with(inner)), CONDITIONAL_BODY)
    check_body(Group("outer", body_with(inner)), CHILD_GRAPH)  # host nodes: fine in a child
    with pytest.raises(BodyRestrictionError, match="a child graph may hold only"):
        check_body(Group("child", body_with(Free("f", x))), CHILD_GRAPH)


# -- the lowering's capabilities for bodies -----------------------------------------------------


def test_side_streams_are_one_per_depth_and_never_plan_streams():
    fake = FakeCuda()
    pool = StreamPool(fake.device, fake)
    s1, s2 = pool.side(1), pool.side(2)
    assert s1 is not s2 and pool.side(1) is s1 and pool.streams == [s1, s2]
    assert pool.by_priority == {}  # take_streams never hands them out
    pool.drop(s1)
    assert pool.side(1) is not s1 and len(pool.streams) == 3


def test_a_node_added_to_a_capture_and_a_capture_into_a_body_graph(monkeypatch):
    fake = fg.install(monkeypatch)
    origin, side = fake.stream(), fake.stream()
    x = fake._new_memory(64, fake.vas)
    with CaptureSession(origin, api=fake) as cap:
        fake.cuMemsetD8Async(x, 1, 64, origin.handle)
        body = cu(fake.cuGraphCreate, 0)

        def add(graph, deps, edge_data):
            assert int(graph) == int(cap.capturing_graph()) and len(deps) == 1
            return cu(fake.cuGraphAddChildGraphNode, graph, deps, len(deps), body)

        node = add_captured_node(origin, add, fake)
        assert [int(d) for d in capture_status(origin, fake)[1]] == [int(node)]
        embedded = cu(fake.cuGraphChildGraphNodeGetGraph, node)
        with CaptureToGraph(side, embedded, api=fake):
            fake.cuMemsetD8Async(x, 2, 32, side.handle)
        assert not is_capturing(side, fake)
        fake.cuMemsetD8Async(x, 3, 16, origin.handle)
    g = fake.graphs[int(cap.graph)]
    assert [n.kind for n in g.nodes] == ["memset", "graph", "memset"]
    assert [n.kind for n in fake.graphs[int(embedded)].nodes] == ["memset"]
    exe = cu(fake.cuGraphInstantiate, cap.graph, 0)
    cu(fake.cuGraphLaunch, exe, origin.handle)
    assert bytes(fake._bytes(x, 64, "x")) == b"\x03" * 16 + b"\x02" * 16 + b"\x01" * 32


def test_capture_to_graph_ends_the_capture_when_the_block_fails(monkeypatch):
    fake = fg.install(monkeypatch)
    side = fake.stream()
    g = cu(fake.cuGraphCreate, 0)
    with pytest.raises(ZeroDivisionError):
        with CaptureToGraph(side, g, api=fake):
            1 / 0
    assert not is_capturing(side, fake)


# -- child graphs -------------------------------------------------------------------------------


def child_graph(n=256, *, host_inside=False, calls=None):
    """up -> child(burn x -> y [, a host function]) -> down; frees. Returns (graph, bind)."""
    x, y = Buffer("x", 4 * n), Buffer("y", 4 * n)
    hin, hout = HostBuffer("hin", 4 * n), HostBuffer("hout", 4 * n)
    body = TaskGraph()
    body.add(KernelNode("burn", BURN, 1, 256, (In(x), Out(y), n, 3, 0.5, 1.0)))
    if host_inside:
        body.add(HostFunc("note", lambda: calls.append("note"), reads=(y,)))
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(HostToDevice("up", hin, x))
    g.add(ChildGraph("child", body))
    g.add(DeviceToHost("down", y, hout))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    rng = np.random.default_rng(1)
    return g, {"hin": rng.standard_normal(n).astype(np.float32),
               "hout": np.full(n, np.nan, np.float32)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_child_graph_runs_on_every_executor(fakes, kind):
    calls = []
    g, bind = child_graph(host_inside=True, calls=calls)
    with executor(kind, fakes) as ex:
        run(ex, kind, g, bind)
    np.testing.assert_array_equal(bind["hout"], burn_reference(bind["hin"]))
    assert calls == ["note"]
    assert translate(g).node("child").kind == "graph"
    if kind != "eager":
        fake = fakes[1]
        top = [gr for gr in fake.graphs.values() if gr.instantiated][-1]
        child = next(n for n in top.nodes if n.kind == "graph")
        assert [n.kind for n in child.params["graph"].nodes] == ["kernel", "host"]
        assert [n.kind for n in top.nodes if n.kind != "event"] == [
            "alloc", "alloc", "memcpy", "graph", "memcpy", "free", "free"]


@pytest.mark.parametrize("kind", KINDS)
def test_host_functions_inside_and_outside_a_child_share_one_table(fakes, kind):
    calls = []
    g, bind = child_graph(host_inside=True, calls=calls)
    g.add(HostFunc("outer", lambda: calls.append("outer"), reads=(HostBuffer("hout", 1024),)))
    with executor(kind, fakes) as ex:
        if kind == "eager":
            ex.run(g, bindings=bind)
            ex.run(g, bindings=bind)
        else:
            exe = ex.run(g, None, bind)
            exe.replay()
            exe.close()
    assert calls == ["note", "outer"] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_child_graph_refuses_graph_memory_before_any_driver_call(fakes, kind):
    x = Buffer("x", 64)
    body = TaskGraph()
    body.add(Alloc("inner_alloc", x))
    body.add(Memset("m", x, 0))
    body.add(Free("inner_free", x))
    g = TaskGraph()
    g.add(ChildGraph("child", body))
    eager, graph = fakes
    with executor(kind, fakes) as ex:
        with pytest.raises(BodyRestrictionError, match="node inner_alloc .* cannot be in the "
                                                       "body of child: a child graph"):
            run(ex, kind, g, {})
    assert eager.driver_calls() == []
    assert not {"cuGraphCreate", "cuStreamBeginCapture"} & set(graph.counts)


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_replays_rebind_outside_a_child_and_refuse_inside_it(fakes, kind):
    n = 256
    x, y = Buffer("x", 4 * n), Buffer("y", 4 * n)
    body = TaskGraph()
    body.add(KernelNode("burn", BURN, 1, 256, (In(x), Out(y), n, 3, 0.5, 1.0)))
    body.add(DeviceToHost("inner_down", y, HostBuffer("hout", 4 * n)))
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(HostToDevice("up", HostBuffer("hin", 4 * n), x))
    g.add(ChildGraph("child", body))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    out = np.zeros(n, np.float32)
    with executor(kind, fakes) as ex:
        exe = ex.build(g, bindings={"hin": a, "hout": out})
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, burn_reference(a))
        exe.replay({"hin": b})  # the upload is outside the child: rebound per node
        np.testing.assert_array_equal(out, burn_reference(b))
        with pytest.raises(BindingError, match="hout is used by node inner_down inside the "
                                               "body of child"):
            exe.replay({"hout": np.zeros(n, np.float32)})
        with pytest.raises(KernelArgumentValueError, match="kernel node burn is inside the "
                                                           "body of child"):
            exe.replay(scalars={"burn": {"iters": 1}})
        np.testing.assert_array_equal(out, burn_reference(b))  # nothing changed
        exe.close()


# -- conditional nodes --------------------------------------------------------------------------


ADD = KernelRef("add.cu", "add_to", params=("int* acc", "int k"))
STEP = KernelRef("step.cu", "while_step", params=(
    "cudaGraphConditionalHandle h", "int* counter", "unsigned int* flag", "int limit"))


def _set_cond(fake, s):  # (h, const unsigned* src, unsigned* flag): flag = *src; set h
    v = int(fake.u32(s.a1)[0])
    fake.u32(s.a2)[0] = v
    if s.a0:  # handle 0: no graph (eager), as `if (h) cudaGraphSetConditional(h, v)`
        fake.set_conditional(s.a0, v)


def _add_to(fake, s):  # (int* acc, int k)
    fake.i32(s.a0)[0] += s.a1


def _while_step(fake, s):  # (h, int* counter, unsigned* flag, int limit)
    c = int(fake.i32(s.a1)[0]) + 1
    fake.i32(s.a1)[0] = c
    v = 1 if c < s.a3 else 0
    fake.u32(s.a2)[0] = v
    if s.a0:
        fake.set_conditional(s.a0, v)


KERNELS = {"set_cond": (SET_PARAMS, _set_cond), "add_to": (ADD.params, _add_to),
           "while_step": (STEP.params, _while_step)}


def control_executor(kind, fakes, **kw):
    if kind == "eager":
        made = {name: FakeKernel(p, name, behave=b) for name, (p, b) in KERNELS.items()}
        return fake_executor(kind, fakes, eager_kernel=lambda r, d: made[r.name], **kw)
    made = {name: fg.FakeGraphKernel(p, name, behave=b) for name, (p, b) in KERNELS.items()}
    return fake_executor(kind, fakes, eager_kernel=None, graph_kernels=made, **kw)


def adds(*ks):
    """Bodies adding k to acc (one body per k)."""
    acc = Buffer("acc", 4)
    out = []
    for i, k in enumerate(ks):
        body = TaskGraph()
        body.add(KernelNode(f"add{i}", ADD, 1, 1, (acc, k)))
        out.append(body)
    return out


def run_choice(ex, kind, g, choice):
    out = np.full(1, -1, np.int32)
    run(ex, kind, g, {"choice": np.array([choice], np.uint32), "out": out})
    return int(out[0])


@pytest.mark.parametrize("kind", KINDS)
def test_if_else_takes_the_branch_the_kernel_chose(fakes, kind):
    then, otherwise = adds(1, 10)
    g = branch_graph(SETTER, lambda c: If("branch", c, then, otherwise))
    with control_executor(kind, fakes) as ex:
        assert [run_choice(ex, kind, g, v) for v in (1, 0, 7)] == [1, 10, 1]
    assert translate(g).node("branch").kind == "conditional"
    if kind != "eager":
        fake = fakes[1]
        top = [gr for gr in fake.graphs.values() if gr.instantiated][-1]
        node = next(n for n in top.nodes if n.kind == "conditional")
        assert node.params["type"] == int(_d.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF)
        assert [[n.kind for n in b.nodes] for b in node.params["bodies"]] == [["kernel"]] * 2
        assert top.handles == {node.params["handle"]: (0, 0)}  # no default: flags 0
        setter = next(n for n in top.nodes if n.kind == "kernel")  # its first field: the handle
        assert int.from_bytes(setter.params["args"][:8], "little") == node.params["handle"]


@pytest.mark.parametrize("kind", KINDS)
def test_if_without_else_and_switch(fakes, kind):
    (then,) = adds(1)
    g = branch_graph(SETTER, lambda c: If("branch", c, then))
    cases = adds(1, 10, 100)
    s = branch_graph(SETTER, lambda c: Switch("switch", c, cases))
    with control_executor(kind, fakes) as ex:
        assert [run_choice(ex, kind, g, v) for v in (0, 1)] == [0, 1]
        assert [run_choice(ex, kind, s, v) for v in (0, 1, 2, 7)] == [1, 10, 100, 0]


def while_graph(limit, default=1):
    counter, fl = Buffer("counter", 4), Buffer("flag", 4)
    cond = Condition("go", default=default, flag=fl)
    body = TaskGraph()
    body.add(KernelNode("step", STEP, 1, 1, (cond, counter, Out(fl), limit)))
    g = TaskGraph()
    g.add(Alloc("a_counter", counter))
    g.add(Alloc("a_flag", fl))
    g.add(Memset("zero", counter, 0))
    g.add(Memset("flag_on", fl, 1))  # the eager equivalent starts from the default as well
    g.add(While("loop", cond, body))
    g.add(DeviceToHost("down", counter, HostBuffer("out", 4)))
    g.add(Free("f_counter", counter))
    g.add(Free("f_flag", fl))
    return g


@pytest.mark.parametrize("kind", KINDS)
def test_while_runs_the_number_of_iterations_chosen_on_the_gpu(fakes, kind):
    eager, graph = fakes
    with control_executor(kind, fakes) as ex:
        for limit in (1, 5, 37):
            out = np.zeros(1, np.int32)
            g = while_graph(limit)
            run(ex, kind, g, {"out": out})
            assert int(out[0]) == limit
    if kind == "eager":  # one flag read after each run of the body (the first test: default)
        flag_reads = len(eager.calls("cuMemcpyDtoHAsync")) - 3  # less the 3 runs' downloads
        assert flag_reads == 1 + 5 + 37
    else:
        assert sorted(graph.iterations.values()) == [1, 5, 37]
        top = [gr for gr in graph.graphs.values() if gr.instantiated][-1]
        assert list(top.handles.values()) == [(1, 1)]  # default 1, CU_GRAPH_COND_ASSIGN_DEFAULT


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_a_replay_flips_the_branch_and_the_loop_restarts_each_launch(fakes, kind):
    then, otherwise = adds(1, 10)
    g = branch_graph(SETTER, lambda c: If("branch", c, then, otherwise))
    out = np.zeros(1, np.int32)
    with control_executor(kind, fakes) as ex:
        exe = ex.build(g, bindings={"choice": np.array([1], np.uint32), "out": out})
        exe.launch(sync=True)
        assert out[0] == 1
        exe.replay({"choice": np.array([0], np.uint32)})  # the upload is outside the bodies
        assert out[0] == 10
        exe.close()
        w = ex.build(while_graph(4), bindings={"out": out})
        for _ in range(3):
            w.replay()
            assert out[0] == 4  # the handle's default comes back at every launch
        w.close()


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_an_exec_update_of_conditional_graphs_runs_the_new_bodies(fakes, kind):
    out = np.zeros(1, np.int32)
    with control_executor(kind, fakes) as ex:
        w = ex.build(while_graph(4), bindings={"out": out})
        w.launch(sync=True)
        assert out[0] == 4
        out2 = np.zeros(1, np.int32)
        res = w.update(while_graph(9), bindings={"out": out2})
        assert res.updated or res.reinstantiated
        for _ in range(2):
            out2[0] = -1
            w.launch(sync=True)
            assert out2[0] == 9 and out[0] == 4
        w.close()
        then, otherwise = adds(1, 10)
        choice = np.array([0], np.uint32)
        exe = ex.build(branch_graph(SETTER, lambda c: If("branch", c, then, otherwise)),
                       bindings={"choice": choice, "out": out})
        exe.launch(sync=True)
        assert out[0] == 10
        then, otherwise = adds(2, 20)
        res = exe.update(branch_graph(SETTER, lambda c: If("branch", c, then, otherwise)))
        assert res.updated or res.reinstantiated
        got = []
        for v in (1, 0):
            choice[0] = v
            exe.launch(sync=True)
            got.append(int(out[0]))
        assert got == [2, 20]
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_nested_conditionals_get_their_handles_on_their_body_graphs(fakes, kind):
    counter, fl, acc, fl2 = Buffer("counter", 4), Buffer("flag", 4), Buffer("acc", 4), \
        Buffer("flag2", 4)
    go = Condition("go", default=1, flag=fl)
    odd = Condition("odd", flag=fl2)
    inner_then, inner_else = adds(1, 100)
    body = TaskGraph()
    body.add(KernelNode("step", STEP, 1, 1, (go, counter, Out(fl), 4)))
    body.add(KernelNode("set_odd", SETTER, 1, 1, (odd, In(fl), Out(fl2))))  # odd = go's flag
    body.add(If("inner", odd, inner_then, inner_else))
    g = TaskGraph()
    for b in (counter, fl, acc, fl2):
        g.add(Alloc(f"a_{b.name}", b))
    g.add(Memset("zero", counter, 0))
    g.add(Memset("zero_acc", acc, 0))
    g.add(While("loop", go, body))
    g.add(DeviceToHost("down", acc, HostBuffer("out", 4)))
    for b in (counter, fl, acc, fl2):
        g.add(Free(f"f_{b.name}", b))
    out = np.zeros(1, np.int32)
    with control_executor(kind, fakes) as ex:
        run(ex, kind, g, {"out": out})
    assert int(out[0]) == 3 * 1 + 100  # go stays 1 for 3 iterations, the 4th clears it
    if kind != "eager":
        top = [gr for gr in fakes[1].graphs.values() if gr.instantiated][-1]
        loop = next(n for n in top.nodes if n.kind == "conditional")
        (lbody,) = loop.params["bodies"]
        inner = next(n for n in lbody.nodes if n.kind == "conditional")
        assert list(top.handles) == [loop.params["handle"]]
        assert list(lbody.handles) == [inner.params["handle"]]


@pytest.mark.parametrize("kind", KINDS)
def test_a_body_with_a_host_function_is_refused_before_any_driver_call(fakes, kind):
    body = TaskGraph()
    body.add(HostFunc("host", lambda: None))
    g = branch_graph(SETTER, lambda c: If("branch", c, body))
    eager, graph = fakes
    with control_executor(kind, fakes) as ex:
        with pytest.raises(BodyRestrictionError, match="node host .HostFunc: a host function "
                                                       "node. cannot be in the body of branch"):
            run_choice(ex, kind, g, 1)
    assert eager.driver_calls() == []
    assert not {"cuGraphCreate", "cuStreamBeginCapture"} & set(graph.counts)


def test_eager_refuses_a_condition_without_a_flag_naming_the_graph_executors(fakes):
    (then,) = adds(1)
    g = branch_graph(SETTER, lambda c: If("branch", c, then), flag=False)
    eager, _ = fakes
    with control_executor("eager", fakes) as ex:
        with pytest.raises(EagerConditionError, match="capture or graph-build executor"):
            run_choice(ex, "eager", g, 1)
    assert eager.driver_calls() == []
    with control_executor("graph-build", fakes) as ex:  # the graph executors need no flag
        assert run_choice(ex, "graph-build", g, 1) == 1


def test_captured_bodies_come_from_a_side_stream_in_relaxed_mode(fakes):
    then, otherwise = adds(1, 10)
    g = branch_graph(SETTER, lambda c: If("branch", c, then, otherwise))
    _, graph = fakes
    with control_executor("capture", fakes) as ex:
        assert run_choice(ex, "capture", g, 0) == 10
        sides = list(ex._stream_pool.sides)
        assert not set(map(id, sides)) & {id(s) for s in ex._stream_pool.by_priority.get(0, [])}
    relaxed = int(_d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    begins = [d for c, d in graph.log if c == "cuStreamBeginCaptureToGraph"]
    assert begins == [relaxed, relaxed] and len(sides) == 1
    assert graph.counts["cuStreamUpdateCaptureDependencies"] == 1
    assert graph.counts["cuGraphConditionalHandleCreate"] == 1


def test_conditional_fields_are_checked():
    c = Condition("c")
    (body,) = adds(1)
    with pytest.raises(NodeFieldTypeError, match="If b: then must be a TaskGraph"):
        If("b", c, "not a graph")
    with pytest.raises(NodeFieldTypeError, match="condition must be a Condition"):
        While("w", "c", body)
    with pytest.raises(NodeFieldTypeError, match="cases must be a non-empty list"):
        Switch("s", c, [])
    with pytest.raises(NodeFieldTypeError, match="Conditional is the base of If"):
        Conditional("x", c)
    s = Switch("s", c, [body])
    assert s.bodies == (body,) and s.tests is c and s.kind == "conditional"


# -- programmatic edges -------------------------------------------------------------------------


def pdl_chain(links=4, n=256, pdl=True):
    """x -> burn -> y -> burn -> x ... (external buffers), pdl on every link but the first."""
    bufs = (Buffer("b0", 4 * n), Buffer("b1", 4 * n))
    g = TaskGraph()
    g.add(HostToDevice("up", HostBuffer("hin", 4 * n), bufs[0]))
    for i in range(links):
        src, dst = bufs[i % 2], bufs[(i + 1) % 2]
        g.add(KernelNode(f"link{i}", BURN, 1, 256, (In(src), Out(dst), n, 1, 0.5, 1.0),
                         attributes={"pdl": True} if (pdl and i) else {}))
    g.add(DeviceToHost("down", bufs[links % 2], HostBuffer("hout", 4 * n)))
    return g, bufs


def test_the_translation_marks_programmatic_edges_only_between_kernels_into_a_pdl_consumer():
    g, _ = pdl_chain(3)
    spec = translate(g)
    assert spec.programmatic_edges == {("link0", "link1"), ("link1", "link2")}
    assert spec.node("link0").programmatic == ()  # no pdl attribute: full edges only
    assert "up" in spec.node("link0").deps
    plain, _ = pdl_chain(3, pdl=False)
    assert translate(plain).programmatic_edges == frozenset()
    assert spec.topology() != translate(plain).topology()  # edge data is topology


def _bound(fake, bufs, n=256):
    out = {}
    for b in bufs:
        ptr = fake._new_memory(b.nbytes, fake.vas)
        out[b.name] = types.SimpleNamespace(ptr=ptr, nbytes=b.nbytes)
    return out


def chain_reference(x, links):
    v = x.copy()
    for _ in range(links):
        v = v * np.float32(0.5) + np.float32(1)
    return v


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_programmatic_edges_are_built_only_into_waiting_consumers(fakes, kind):
    _, fake = fakes
    g, bufs = pdl_chain(4)
    x = np.arange(256, dtype=np.float32)
    out = np.zeros(256, np.float32)
    bind = {"hin": x, "hout": out, **_bound(fake, bufs)}
    with executor(kind, fakes) as ex:
        exe = ex.build(g, bindings=bind)
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, chain_reference(x, 4))
        err, src, dst, data, count = fake.cuGraphGetEdges(exe.cugraph, 64)
        kinds_of = {int(n.id): n.kind for n in fake.graphs[int(exe.cugraph)].nodes}
        prog = [(kinds_of[int(a)], kinds_of[int(b)], int(e.from_port))
                for a, b, e in zip(src, dst, data) if int(e.type) == fg.PROGRAMMATIC]
        assert prog == [("kernel", "kernel", fg.PORT_PROGRAMMATIC)] * 3  # links 1, 2, 3
        full = [int(e.type) for e in data].count(0)
        assert full == count - 3
        exe.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_pdl_consumer_that_never_waits_is_refused(fakes, kind, monkeypatch):
    eager, graph = fakes
    g, bufs = pdl_chain(3)
    nowait = {"eager": FakeKernel(waits=False), "graph": fg.FakeGraphKernel(waits=False)}
    if kind == "eager":
        ex = EagerExecutor(eager.device, driver=eager, kernel_resolver=KernelResolver(
            eager.device, lambda r, d: nowait["eager"]))
        bind = {"hin": np.zeros(256, np.float32), "hout": np.zeros(256, np.float32),
                **{b.name: types.SimpleNamespace(ptr=0, nbytes=b.nbytes) for b in bufs}}
    else:
        cls = CaptureExecutor if kind == "capture" else GraphBuildExecutor
        ex = cls(graph.device, driver=graph, kernel_resolver=KernelResolver(
            graph.device, lambda r, d: nowait["graph"]))
        bind = {"hin": np.zeros(256, np.float32), "hout": np.zeros(256, np.float32),
                **_bound(graph, bufs)}
    with ex:
        if kind == "graph-build":  # the verifier sees the programmatic edge orders nothing
            with pytest.raises(HazardError, match="programmatic edge link0 -> link1 orders "
                                                  "nothing: link1 never executes"):
                run(ex, kind, g, bind)
        with pytest.raises(PdlWithoutWaitError, match="never executes griddepcontrol.wait"):
            if kind == "eager":
                ex.run(g, bindings=bind)
            else:
                ex.verify = False
                run(ex, kind, g, bind)
    assert eager.driver_calls() == []
    assert not {"cuGraphCreate", "cuStreamBeginCapture"} & set(graph.counts)


def test_the_resolver_reads_the_wait_from_the_kernels_ptx():
    from orchestra.compiler.sources import kernel_source_dir

    dev = types.SimpleNamespace(arch="sm_90")
    resolver = KernelResolver(dev, lambda r, d: object())
    pdl = str(kernel_source_dir() / "pdl.cu")
    assert resolver.waits_on_grid_dependency(KernelRef(pdl, "pdl_chain_step")) is True
    assert resolver.waits_on_grid_dependency(KernelRef(pdl, "pdl_secondary_nowait")) is False
    own = KernelResolver(dev, lambda r, d: FakeKernel(waits=False))
    assert own.waits_on_grid_dependency(BURN) is False  # a fake answers for itself


# -- node enable / disable ----------------------------------------------------------------------


def optional_graph(n=256, child=True):
    """up -> burn x->y -> extra burn y->y (optional) -> down; a child graph and a memory node."""
    x, y = Buffer("x", 4 * n), Buffer("y", 4 * n)
    g = TaskGraph()
    g.add(Alloc("ax", x))
    g.add(Alloc("ay", y))
    g.add(HostToDevice("up", HostBuffer("hin", 4 * n), x))
    g.add(KernelNode("burn", BURN, 1, 256, (In(x), Out(y), n, 1, 0.5, 1.0)))
    g.add(KernelNode("extra", BURN, 1, 256, (In(y), Out(y), n, 1, 0.5, 1.0)))
    if child:
        body = TaskGraph()
        body.add(Memset("inner_memset", x, 0))
        g.add(ChildGraph("child", body))
    g.add(DeviceToHost("down", y, HostBuffer("hout", 4 * n)))
    g.add(Free("fx", x))
    g.add(Free("fy", y))
    return g


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_disabling_a_node_changes_the_output_without_re_instantiating(fakes, kind):
    _, fake = fakes
    x = np.arange(256, dtype=np.float32)
    out = np.zeros(256, np.float32)
    with executor(kind, fakes) as ex:
        exe = ex.build(optional_graph(), bindings={"hin": x, "hout": out})
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, chain_reference(x, 2))
        exe.disable("extra")
        assert not exe.is_enabled("extra") and exe.disabled == {"extra"}
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, chain_reference(x, 1))
        exe.enable("extra")
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, chain_reference(x, 2))
        assert fake.counts["cuGraphInstantiate"] == 1
        assert fake.log.count(("cuGraphNodeSetEnabled", 0)) == 1
        exe.disable("extra")
        result = exe.update(optional_graph())  # same shape: the node stays switched off
        assert result.updated or result.reinstantiated
        exe.launch(sync=True)
        np.testing.assert_array_equal(out, chain_reference(x, 1))
        exe.close()


@pytest.mark.parametrize("node,match", [
    ("ax", "ax is a mem_alloc node: cuGraphNodeSetEnabled switches kernel, memcpy and memset "
           "nodes only"),
    ("child", "child is a graph node"),
    ("inner_memset", "inner_memset is inside the body of child: only nodes at the top"),
    ("nope", "'nope' is not a node of this graph .switchable nodes: burn, down, extra, up."),
])
def test_nodes_the_driver_cannot_switch_are_refused_by_name_before_the_call(fakes, node, match):
    _, fake = fakes
    out = np.zeros(256, np.float32)
    with executor("graph-build", fakes) as ex:
        exe = ex.build(optional_graph(), bindings={"hin": np.zeros(256, np.float32),
                                                   "hout": out})
        with pytest.raises(ExecutorArgumentValueError, match=match):
            exe.disable("extra", node)  # checked all before any call: extra stays on
        assert exe.is_enabled("extra") and fake.counts["cuGraphNodeSetEnabled"] == 0
        exe.close()


# -- the WHILE example's graph, on the fakes ----------------------------------------------------


def _load_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "while_converge.py"
    spec = importlib.util.spec_from_file_location("while_converge", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _jacobi(fake, s):
    """The example's kernel in numpy (float32, the same operation order)."""
    h, xp, yp, bp, n, diag, tol, flagp, itp, max_iters, resp = (
        getattr(s, f"a{i}") for i in range(11))
    x, y, b = fake.f32(xp, n), fake.f32(yp, n), fake.f32(bp, n)
    d = np.float32(diag)

    def sweep(src, dst):
        l = np.concatenate(([0], src[:-1])).astype(np.float32)
        r = np.concatenate((src[1:], [0])).astype(np.float32)
        dst[:] = (b + l + r) / d

    sweep(x, y)
    sweep(y, x)
    l = np.concatenate(([0], x[:-1])).astype(np.float32)
    r = np.concatenate((x[1:], [0])).astype(np.float32)
    res = np.float32(np.max(np.abs(b - (d * x - l - r))))
    it = int(fake.i32(itp)[0]) + 1
    fake.i32(itp)[0] = it
    fake.f32(resp)[0] = res
    more = 1 if (res > np.float32(tol) and it < max_iters) else 0
    fake.u32(flagp)[0] = more
    if h:
        fake.set_conditional(h, more)


@pytest.mark.parametrize("kind", KINDS)
def test_the_while_example_graph_converges_on_every_executor(fakes, kind):
    ex_mod = _load_example()
    n, diag, tol = 256, 2.2, 1e-5
    g = ex_mod.solve_graph(n, diag, tol, 10_000)
    assert translate(g).node("solve").kind == "conditional"
    assert verify(schedule(g), g) == [] and verify_graph_edges(g) == []
    eager, graph = fakes
    rng = np.random.default_rng(0)
    b = rng.uniform(-1, 1, n).astype(np.float32)
    bind = {"host_b": b, "host_x0": np.zeros(n, np.float32), "host_x": np.zeros(n, np.float32),
            "host_iters": np.zeros(1, np.int32), "host_residual": np.zeros(1, np.float32)}
    params = ex_mod.JACOBI
    if kind == "eager":
        k = FakeKernel(parse_params(ex_mod.SOURCE, "jacobi_iteration"), "jacobi_iteration",
                       behave=_jacobi)
        ex = EagerExecutor(eager.device, driver=eager,
                           kernel_resolver=KernelResolver(eager.device, lambda r, d: k))
    else:
        k = fg.FakeGraphKernel(parse_params(ex_mod.SOURCE, "jacobi_iteration"),
                               "jacobi_iteration", behave=_jacobi)
        cls = CaptureExecutor if kind == "capture" else GraphBuildExecutor
        ex = cls(graph.device, driver=graph, kernel_resolver=fg.resolver(
            graph, {params.name: k}))
    with ex:
        run(ex, kind, g, bind)
    exact = ex_mod.thomas(diag, b.astype(np.float64))
    iters = int(bind["host_iters"][0])
    assert 10 < iters < 100 and bind["host_residual"][0] <= tol
    assert np.max(np.abs(bind["host_x"] - exact)) <= 10 * tol / (diag - 2)
    # the reference solve itself: A x = b
    ax = diag * exact - np.concatenate(([0], exact[:-1])) - np.concatenate((exact[1:], [0]))
    np.testing.assert_allclose(ax, b, atol=1e-12)
