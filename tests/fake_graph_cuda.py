"""A stand-in driver API for the CUDA graph and stream-capture calls, for CPU tests of the
graph executors (`cuda_graph.capture`, `cuda_graph.build`, `cuda_graph.exec`).

`FakeGraphDriver` is a `DriverAPI` look-alike: `install` makes it the process's default driver
API for the test (one monkeypatch); executors can also be given it with ``driver=``.

"Device memory" is host memory (numpy arrays); a launched graph runs its nodes at once, in
creation order (a valid topological order: every node is created after its dependencies).
What it models, because the executors rely on it:

- node parameters are *copied* when a node is added or set (``cuGraphExec*NodeSetParams``), as
  the driver does: a kernel node keeps the bytes of its packed argument struct, a memcpy node its
  addresses; rewriting the Python-side records later changes nothing until the next SetParams;
- per-node updates must name a node of the graph the exec was *instantiated* from;
- ``cuGraphExecUpdate`` accepts only a topologically identical graph (same node count, kinds and
  dependency indices), else ``CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE`` with
  ``CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED`` and the first differing node;
- graph allocations get their address when the node is created; launching a graph whose
  allocation from the previous launch is still live fails unless the exec was instantiated
  with AUTO_FREE_ON_LAUNCH; a graph with memory nodes is instantiated at most once;
- stream capture: capture sequences, per-stream dependency sets, events carrying dependency
  sets into other streams (fork / join), ``cuStreamGetCaptureInfo``, ``cuStreamIsCapturing``,
  ``cuStreamQuery`` during a capture returns ``CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`` and
  invalidates the sequence, ``cuStreamEndCapture`` returns ``CUDA_ERROR_STREAM_CAPTURE_UNJOINED``
  when a stream's work is not reachable from the origin, and every stream of the sequence leaves
  capture mode whatever the outcome; ``cuStreamBeginCaptureToGraph`` captures into an existing
  graph (a body), ``cuStreamUpdateCaptureDependencies`` sets a stream's dependency set;
- control flow: ``cuGraphConditionalHandleCreate`` (a handle per graph, its default and
  ASSIGN_DEFAULT flag), conditional nodes through ``cuGraphAddNode`` (the driver makes the body
  graphs and writes them into ``phGraph_out``), child graph nodes (``cuGraphAddChildGraphNode``
  clones, ``cuGraphChildGraphNodeGetGraph`` gives the embedded graph), empty nodes; a launch
  resets every handle with a default, marks the others undefined (0xBAD), and runs IF / ELSE,
  WHILE and SWITCH on the value a kernel set (``FakeKernel.behave`` calls
  ``set_conditional``); body nodes run with the parameters they were added with;
- programmatic edges: edge data per dependency (``cuGraphAddDependencies``, captured PDL
  launches), ``cuGraphGetEdges``; ``cuGraphNodeSetEnabled`` on kernel, memcpy and memset nodes
  of an exec (``CUDA_ERROR_INVALID_VALUE`` for the others, as the driver answers for child graph
  nodes), disabled nodes skipped by launches.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import types
from collections import Counter

import numpy as np
from cuda.bindings import driver

from orchestra.execute.kernels import KernelResolver
from orchestra.execute.lowering.copy import COPY_KERNEL_NAME, COPY_PARAMS
from tests import fake_cuda
from tests.fake_cuda import FakeAPI, FakeHandle, FakeKernel

R = driver.CUresult
OK = R.CUDA_SUCCESS
CS = driver.CUstreamCaptureStatus
MT = driver.CUmemorytype
_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_ids = itertools.count(1)


def _handle() -> FakeHandle:
    return FakeHandle(0x10000 + next(_ids))


class FakeDevice(fake_cuda.FakeDevice):
    """The eager fake's device, plus what graph code reads: a handle, a context, pushed()."""

    handle = 0
    context = driver.CUcontext(0xC0)  # a real handle type: node param structs insist

    @contextlib.contextmanager
    def pushed(self):
        yield self


class FakeGraphKernel(FakeKernel):
    """burn with a real ``CUfunction`` handle (the node param structs insist on one)."""

    registry: dict[int, "FakeGraphKernel"] = {}

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        h = 0x7000 + next(_ids)
        self.function = driver.CUfunction(h)
        FakeGraphKernel.registry[h] = self


PROGRAMMATIC = int(driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
PORT_PROGRAMMATIC = int(driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC)
UNDEFINED = 0xBAD  # a handle without a default, before a kernel sets it


class GNode:
    def __init__(self, graph, kind, deps, params, edges=None):
        self.id = _handle()
        self.graph = graph
        self.kind = kind
        self.deps = [int(d) for d in deps]
        self.params = params
        # per dependency: (type, from_port) of its edge data (0, 0: a full edge)
        self.edges = list(edges) if edges is not None else [(0, 0)] * len(self.deps)

    def index_deps(self):
        pos = {n.id: i for i, n in enumerate(self.graph.nodes)}
        return tuple(sorted(pos[d] for d in self.deps))


class FGraph:
    def __init__(self):
        self.id = _handle()
        self.nodes: list[GNode] = []
        self.instantiated = 0
        self.destroyed = False
        self.handles: dict[int, tuple[int, int]] = {}  # handle -> (default, flags)
        self.owned = False  # a body / embedded child graph: its node owns it

    def add(self, kind, deps, params, edges=None):
        ids = {n.id for n in self.nodes}
        for d in deps:
            assert int(d) in ids, f"dependency {d} is not a node of this graph"
        assert len(set(map(int, deps))) == len(deps), "duplicate dependencies"
        n = GNode(self, kind, deps, params, edges)
        self.nodes.append(n)
        return n

    def node(self, h):
        for n in self.nodes:
            if int(n.id) == int(h):
                return n
        raise KeyError(h)

    def has_memory_nodes(self):
        return any(n.kind in ("alloc", "free") for n in self.nodes)

    def tree(self):
        """This graph and every body / child graph inside it."""
        out = [self]
        for n in self.nodes:
            for g in n.params.get("bodies", ()) if isinstance(n.params, dict) else ():
                out += g.tree()
        return out


class FExec:
    def __init__(self, graph: FGraph, flags: int):
        self.id = _handle()
        self.graph = graph
        self.flags = flags
        self.index = {n.id: i for i, n in enumerate(graph.nodes)}  # instantiation graph ids
        self.kinds = [n.kind for n in graph.nodes]
        self.topology = [(n.kind, n.index_deps()) for n in graph.nodes]
        self.slots = [dict(n.params) for n in graph.nodes]
        self.live: set[int] = set()
        self.launches = 0
        self.disabled: set[int] = set()  # indices of disabled nodes
        self.handle_graph: FGraph | None = None  # the graph of the last exec update, if any


class Seq:
    def __init__(self, origin, mode, graph=None):
        self.id = next(_ids)
        self.graph = FGraph() if graph is None else graph
        self.into = graph is not None  # cuStreamBeginCaptureToGraph
        self.origin = origin
        self.mode = mode
        self.status = CS.CU_STREAM_CAPTURE_STATUS_ACTIVE
        self.streams: set[int] = {origin}


class FakeGraphDriver(FakeAPI):
    """The fake: the graph/capture calls as methods, and the driver layer's objects (streams
    whose ``query`` goes through the fake, events, the device); parameter records are the real
    cuda-bindings structs."""

    def __init__(self):
        super().__init__(FakeDevice())
        self.graphs: dict[int, FGraph] = {}
        self.execs: dict[int, FExec] = {}
        self.mem: dict[int, np.ndarray] = {}  # base -> bytes (pool allocations)
        self.vas: dict[int, np.ndarray] = {}  # graph allocation addresses -> backing bytes
        self.capture: dict[int, Seq] = {}  # stream -> its capture sequence
        self.deps: dict[int, list] = {}  # stream -> capture dependency set
        self.events: dict[int, tuple] = {}  # event -> (seq or None, deps)
        self.counts: Counter = Counter()
        self.log: list = []
        self.fail: dict[str, int] = {}
        self.attributes: list = []
        self.dot_files: list = []
        self.copy_kernels: list = []  # (dst, src, n, system_fence) of every copy kernel run
        self.cond: dict[int, int] = {}  # conditional handle -> its value during a launch
        self.handle_graph: dict[int, FGraph] = {}  # handle -> the graph it was created on
        self.iterations: Counter = Counter()  # conditional node id -> body runs (WHILE)
        self._keep: list = []  # phGraph_out arrays the "driver" owns

    def stream(self, device=None, priority=0):
        return FakeStream(device, priority, fake=self)

    def event(self, device=None):
        return FakeEvent(device)

    def launch_host_func(self, stream, fn_address, token):
        """`DriverAPI.launch_host_func`: the driver's own cuLaunchHostFunc entry point."""
        err = self._call("cuLaunchHostFunc")
        if err:
            return int(err)
        (err,) = self._enqueue(stream, "host", {"fn": int(fn_address), "user": int(token)})
        return int(err)

    def exec_update(self, exec_, graph):
        """`DriverAPI.exec_update`: ``(CUresult, result, errorNode, errorFromNode)`` ints."""
        err, info = self.cuGraphExecUpdate(exec_, graph)
        en, ef = info.errorNode, info.errorFromNode
        return (int(err), int(info.result), None if en is None else int(en),
                None if ef is None else int(ef))

    # -- bookkeeping ------------------------------------------------------------------------

    def _call(self, name, detail=None):
        self.counts[name] += 1
        self.log.append((name, detail))
        if self.fail.get(name) == self.counts[name]:
            return R.CUDA_ERROR_INVALID_VALUE
        return OK

    @property
    def live_graphs(self):
        return [g for g in self.graphs.values() if not g.destroyed and not g.owned]

    def _bytes(self, ptr, nbytes, what):
        for table in (self.mem, self.vas):
            for base, arr in table.items():
                if base <= ptr and ptr + nbytes <= base + arr.nbytes:
                    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        raise AssertionError(f"{what}: [{ptr:#x}, +{nbytes}) is not inside device memory")

    def _is_device(self, ptr, nbytes) -> bool:
        return any(base <= ptr and ptr + nbytes <= base + arr.nbytes
                   for table in (self.mem, self.vas) for base, arr in table.items())

    # what FakeKernel.behave functions read and write device memory with
    def f32(self, ptr, n=1):
        return self._bytes(int(ptr), 4 * n, "kernel access").view(np.float32)

    def u32(self, ptr, n=1):
        return self._bytes(int(ptr), 4 * n, "kernel access").view(np.uint32)

    def i32(self, ptr, n=1):
        return self.u32(ptr, n).view(np.int32)

    def set_conditional(self, handle, value):
        assert int(handle) in self.cond, f"handle {handle} is not a handle of the launched graph"
        self.cond[int(handle)] = int(value) & 0xFFFFFFFF

    def _new_memory(self, nbytes, table):
        arr = np.empty(nbytes + 256, np.uint8)
        ptr = (arr.ctypes.data + 255) // 256 * 256
        table[ptr] = arr[ptr - arr.ctypes.data:][:nbytes]
        return ptr

    # -- snapshots of node parameters (the driver copies them) ------------------------------

    @staticmethod
    def _memcpy_snapshot(p):
        src_host = int(p.srcMemoryType) == int(MT.CU_MEMORYTYPE_HOST)
        dst_host = int(p.dstMemoryType) == int(MT.CU_MEMORYTYPE_HOST)
        assert int(p.Height) == 1 and int(p.Depth) == 1, "1-D copies only"
        return {"src": int(p.srcHost) if src_host else int(p.srcDevice),
                "dst": int(p.dstHost) if dst_host else int(p.dstDevice),
                "src_host": src_host, "dst_host": dst_host, "n": int(p.WidthInBytes)}

    @staticmethod
    def _kernel_snapshot(func, grid, block, smem, params_addr):
        k = FakeGraphKernel.registry[int(func)]
        base = ctypes.c_void_p.from_address(params_addr).value
        return {"kernel": k, "args": ctypes.string_at(base, k.layout.size),
                "grid": tuple(grid), "block": tuple(block), "smem": smem}

    def _run(self, kind, p, flags=0, live=None):
        if kind == "memcpy":
            if not p["src_host"]:
                self._bytes(p["src"], p["n"], "copy source")
            if not p["dst_host"]:
                self._bytes(p["dst"], p["n"], "copy destination")
            ctypes.memmove(p["dst"], p["src"], p["n"])
        elif kind == "kernel" and p["kernel"].name == COPY_KERNEL_NAME:
            k = p["kernel"]
            k.launches += 1
            s = k.layout.struct_type.from_buffer_copy(p["args"])
            dst, src, n, fence = (getattr(s, f) for f in k.layout.field_names)
            self.copy_kernels.append((int(dst), int(src), int(n), int(fence)))
            sides = [self._is_device(x, n) for x in (dst, src)]
            assert sides.count(True) == 1, "a copy kernel moves bytes between host and device"
            ctypes.memmove(dst, src, n)
        elif kind == "kernel":
            k = p["kernel"]
            k.launches += 1
            s = k.layout.struct_type.from_buffer_copy(p["args"])
            if k.behave is not None:
                k.behave(self, s)
                return OK
            x, y, n, iters, sc, sh = (getattr(s, f) for f in k.layout.field_names)
            v = self._bytes(x, 4 * n, "kernel input").view(np.float32).copy()
            for _ in range(iters):
                v = v * np.float32(sc) + np.float32(sh)
            self._bytes(y, 4 * n, "kernel output").view(np.float32)[:] = v
        elif kind == "memset":
            es = p["es"]
            dt = {1: np.uint8, 2: np.uint16, 4: np.uint32}[es]
            self._bytes(p["dst"], p["count"] * es, "memset").view(dt)[:] = p["value"]
        elif kind == "host":
            _HOSTFN(p["fn"])(p["user"])
        elif kind == "conditional":
            return self._run_conditional(p, flags, live)
        elif kind == "graph":
            return self._run_nodes(p["graph"].nodes, None, flags, live)
        elif kind == "alloc":
            if live is not None:
                if p["dptr"] in live:
                    return R.CUDA_ERROR_INVALID_VALUE  # the previous launch's allocation is live
                live.add(p["dptr"])
        elif kind == "free":
            if live is not None:
                live.discard(p["dptr"])
        return OK

    def _run_nodes(self, nodes, slots=None, flags=0, live=None, disabled=()):
        for i, n in enumerate(nodes):
            if n.kind in ("event", "empty") or i in disabled:
                continue
            err = self._run(n.kind, slots[i] if slots is not None else n.params, flags, live)
            if err:
                return err
        return OK

    def _run_conditional(self, p, flags, live):
        h, typ, bodies = p["handle"], p["type"], p["bodies"]
        T = driver.CUgraphConditionalNodeType
        value = self.cond[h]
        if typ == int(T.CU_GRAPH_COND_TYPE_IF):
            chosen = bodies[0] if value else (bodies[1] if len(bodies) > 1 else None)
            return self._run_nodes(chosen.nodes, None, flags, live) if chosen else OK
        if typ == int(T.CU_GRAPH_COND_TYPE_SWITCH):
            return self._run_nodes(bodies[value].nodes, None, flags, live) \
                if value < len(bodies) else OK
        runs = 0
        while self.cond[h]:
            runs += 1
            assert runs < 100000, "a WHILE body never cleared its condition"
            err = self._run_nodes(bodies[0].nodes, None, flags, live)
            if err:
                return err
        self.iterations[p["node"]] += runs
        return OK

    # -- explicit graphs --------------------------------------------------------------------

    def cuGraphCreate(self, flags):
        self._call("cuGraphCreate")
        g = FGraph()
        self.graphs[int(g.id)] = g
        return (OK, g.id)

    def _graph(self, h):
        g = self.graphs[int(h)]
        assert not g.destroyed, "graph used after cuGraphDestroy"
        return g

    def _add(self, name, hgraph, deps, n, kind, params):
        deps = list(deps or [])
        assert len(deps) == n, f"{name}: numDependencies {n} != {len(deps)}"
        err = self._call(name, kind)
        if err:
            return (err, None)
        node = self._graph(hgraph).add(kind, deps, params)
        return (OK, node.id)

    def cuGraphAddMemAllocNode(self, hgraph, deps, n, params):
        assert int(params.poolProps.location.id) == 0
        pinned = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert params.poolProps.allocType == pinned
        ptr = self._new_memory(int(params.bytesize), self.vas)
        params.dptr = ptr  # the driver writes the address into the caller's struct
        return self._add("cuGraphAddMemAllocNode", hgraph, deps, n, "alloc",
                         {"dptr": ptr, "n": int(params.bytesize)})

    def cuGraphMemAllocNodeGetParams(self, node):
        raise AssertionError("the executor should not need to read an alloc node back")

    def cuGraphAddMemFreeNode(self, hgraph, deps, n, dptr):
        return self._add("cuGraphAddMemFreeNode", hgraph, deps, n, "free", {"dptr": int(dptr)})

    def cuGraphAddMemcpyNode(self, hgraph, deps, n, p, ctx):
        assert ctx == FakeDevice.context
        return self._add("cuGraphAddMemcpyNode", hgraph, deps, n, "memcpy",
                         self._memcpy_snapshot(p))

    def cuGraphAddKernelNode(self, hgraph, deps, n, p):
        snap = self._kernel_snapshot(p.func, (p.gridDimX, p.gridDimY, p.gridDimZ),
                                     (p.blockDimX, p.blockDimY, p.blockDimZ),
                                     p.sharedMemBytes, int(p.kernelParams))
        return self._add("cuGraphAddKernelNode", hgraph, deps, n, "kernel", snap)

    def cuGraphKernelNodeSetAttribute(self, node, attr, value):
        assert isinstance(value, driver.CUkernelNodeAttrValue)
        self.attributes.append((int(node), attr, value))
        return (self._call("cuGraphKernelNodeSetAttribute"),)

    def cuGraphAddMemsetNode(self, hgraph, deps, n, p, ctx):
        return self._add("cuGraphAddMemsetNode", hgraph, deps, n, "memset",
                         {"dst": int(p.dst), "value": int(p.value), "es": int(p.elementSize),
                          "count": int(p.width)})

    def cuGraphAddHostNode(self, hgraph, deps, n, p):
        return self._add("cuGraphAddHostNode", hgraph, deps, n, "host",
                         {"fn": int(p.fn), "user": int(p.userData)})

    def cuGraphAddEventRecordNode(self, hgraph, deps, n, event):
        return self._add("cuGraphAddEventRecordNode", hgraph, deps, n, "event", {"ev": int(event)})

    def cuGraphAddEmptyNode(self, hgraph, deps, n):
        return self._add("cuGraphAddEmptyNode", hgraph, deps, n, "empty", {})

    def cuGraphConditionalHandleCreate(self, hgraph, ctx, default, flags):
        err = self._call("cuGraphConditionalHandleCreate")
        if err:
            return (err, None)
        assert ctx == FakeDevice.context
        g = self._graph(hgraph)
        h = 0x5000_0000 + next(_ids)
        g.handles[h] = (int(default), int(flags))
        self.handle_graph[h] = g
        return (OK, driver.CUgraphConditionalHandle(h))

    def cuGraphAddNode(self, hgraph, deps, edata, n, params):
        deps = list(deps or [])
        assert len(deps) == n, f"cuGraphAddNode: numDependencies {n} != {len(deps)}"
        err = self._call("cuGraphAddNode", int(params.type))
        if err:
            return (err, None)
        g = self._graph(hgraph)
        assert int(params.type) == int(driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL), \
            "the fake adds conditional nodes through cuGraphAddNode only"
        c = params.conditional
        h, size = int(c.handle), int(c.size)
        assert self.handle_graph.get(h) is g, "the handle was created on another graph"
        assert c.ctx == FakeDevice.context
        bodies = [FGraph() for _ in range(size)]
        for b in bodies:
            b.owned = True
            self.graphs[int(b.id)] = b
        arr = (ctypes.c_void_p * size)(*[int(b.id) for b in bodies])
        self._keep.append(arr)  # "CUDA-owned array": valid while the fake lives
        ctypes.c_uint64.from_address(int(c.getPtr()) + 16).value = ctypes.addressof(arr)
        edges = [(int(e.type), int(e.from_port)) for e in edata] if edata else None
        node = g.add("conditional", deps, {"handle": h, "type": int(c.type), "bodies": bodies},
                     edges)
        node.params["node"] = int(node.id)
        return (OK, node.id)

    def cuGraphAddChildGraphNode(self, hgraph, deps, n, child):
        embedded = FGraph()
        embedded.owned = True
        source = self._graph(child)
        assert not source.nodes, "the fake clones empty child graphs only"
        self.graphs[int(embedded.id)] = embedded
        return self._add("cuGraphAddChildGraphNode", hgraph, deps, n, "graph",
                         {"graph": embedded, "bodies": [embedded]})

    def cuGraphChildGraphNodeGetGraph(self, node):
        self._call("cuGraphChildGraphNodeGetGraph")
        for g in self.graphs.values():
            for gn in g.nodes:
                if int(gn.id) == int(node) and gn.kind == "graph":
                    return (OK, gn.params["graph"].id)
        return (R.CUDA_ERROR_INVALID_VALUE, None)

    def cuGraphAddDependencies(self, hgraph, from_, to, edata, n):
        err = self._call("cuGraphAddDependencies")
        if err:
            return (err,)
        g = self._graph(hgraph)
        from_, to = list(from_), list(to)
        assert len(from_) == len(to) == n
        for i, (a, b) in enumerate(zip(from_, to)):
            node = g.node(b)
            g.node(a)
            assert int(a) not in node.deps, "duplicate edge"
            e = edata[i] if edata else None
            node.deps.append(int(a))
            node.edges.append((int(e.type), int(e.from_port)) if e is not None else (0, 0))
        return (OK,)

    def cuGraphGetEdges(self, hgraph, num=0):
        g = self._graph(hgraph)
        edges = [(d, n.id, t) for n in g.nodes for d, t in zip(n.deps, n.edges)]
        if not num:
            return (OK, None, None, None, len(edges))
        out_from, out_to, out_data = [], [], []
        for d, nid, (typ, port) in edges[:num]:
            e = driver.CUgraphEdgeData()
            e.type, e.from_port = typ, port
            out_from.append(driver.CUgraphNode(d))
            out_to.append(driver.CUgraphNode(int(nid)))
            out_data.append(e)
        return (OK, out_from, out_to, out_data, len(edges))

    def cuGraphDestroy(self, h):
        self._call("cuGraphDestroy")
        self._graph(h).destroyed = True
        return (OK,)

    def cuGraphDebugDotPrint(self, h, path, flags):
        g = self._graph(h)
        lines = ["digraph fake {"]
        for n in g.nodes:
            lines.append(f'  n{int(n.id)} [label="{n.kind}"];')
            lines += [f"  n{d} -> n{int(n.id)};" for d in n.deps]
        lines.append("}")
        with open(path.decode() if isinstance(path, bytes) else path, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.dot_files.append(path)
        return (OK,)

    # -- execs ------------------------------------------------------------------------------

    def cuGraphInstantiate(self, h, flags):
        err = self._call("cuGraphInstantiate", int(flags))
        if err:
            return (err, None)
        g = self._graph(h)
        if g.has_memory_nodes() and g.instantiated:
            return (R.CUDA_ERROR_INVALID_VALUE, None)  # one exec per graph with memory nodes
        g.instantiated += 1
        e = FExec(g, int(flags))
        self.execs[int(e.id)] = e
        return (OK, e.id)

    def _exec(self, h):
        e = self.execs[int(h)]
        assert e.graph is not None, "exec used after cuGraphExecDestroy"
        return e

    def cuGraphUpload(self, h, stream):
        self._exec(h)
        return (self._call("cuGraphUpload"),)

    def cuGraphLaunch(self, h, stream):
        err = self._call("cuGraphLaunch")
        if err:
            return (err,)
        e = self._exec(h)
        if e.flags & 1:  # AUTO_FREE_ON_LAUNCH: free what the previous launch left allocated
            e.live.clear()
        self.cond = {}
        # every handle: its default when it has one, else undefined; after an exec update, the
        # updating graph's handles (the driver matches handles by creation order: on an H200 a
        # WHILE and an IF / ELSE updated in place ran the new graph's bodies and limits)
        for g in (e.handle_graph or e.graph).tree():
            for hh, (default, flags) in g.handles.items():
                self.cond[hh] = default if flags & 1 else UNDEFINED
        for i, (kind, p) in enumerate(zip(e.kinds, e.slots)):
            if kind in ("event", "empty") or i in e.disabled:
                continue
            err = self._run(kind, p, e.flags, e.live)
            if err:
                return (err,)
        e.launches += 1
        return (OK,)

    def cuGraphNodeSetEnabled(self, h, node, enabled):
        err = self._call("cuGraphNodeSetEnabled", int(enabled))
        if err:
            return (err,)
        e = self._exec(h)
        i = e.index.get(int(node))
        if i is None or e.kinds[i] not in ("kernel", "memcpy", "memset"):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        (e.disabled.discard if enabled else e.disabled.add)(i)
        return (OK,)

    def cuGraphNodeGetEnabled(self, h, node):
        e = self._exec(h)
        i = e.index.get(int(node))
        if i is None or e.kinds[i] not in ("kernel", "memcpy", "memset"):
            return (R.CUDA_ERROR_INVALID_VALUE, None)
        return (OK, 0 if i in e.disabled else 1)

    def cuGraphExecDestroy(self, h):
        self._call("cuGraphExecDestroy")
        e = self._exec(h)
        e.graph = None
        return (OK,)

    def _slot(self, e, node):
        i = e.index.get(int(node))
        if i is None:
            raise KeyError(node)
        return i

    def cuGraphExecMemcpyNodeSetParams(self, h, node, p, ctx):
        err = self._call("cuGraphExecMemcpyNodeSetParams")
        if err:
            return (err,)
        e = self._exec(h)
        try:
            i = self._slot(e, node)
        except KeyError:
            return (R.CUDA_ERROR_INVALID_VALUE,)  # not a node of the instantiation graph
        new, old = self._memcpy_snapshot(p), e.slots[i]
        if any(new[k] != old[k] for k in ("src_host", "dst_host", "n")):
            return (R.CUDA_ERROR_INVALID_VALUE,)  # memory types and extent may not change
        e.slots[i] = new
        return (OK,)

    def cuGraphExecKernelNodeSetParams(self, h, node, p):
        err = self._call("cuGraphExecKernelNodeSetParams")
        if err:
            return (err,)
        e = self._exec(h)
        try:
            i = self._slot(e, node)
        except KeyError:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        e.slots[i] = self._kernel_snapshot(p.func, (p.gridDimX, p.gridDimY, p.gridDimZ),
                                           (p.blockDimX, p.blockDimY, p.blockDimZ),
                                           p.sharedMemBytes, int(p.kernelParams))
        return (OK,)

    def cuGraphExecMemsetNodeSetParams(self, h, node, p, ctx):
        err = self._call("cuGraphExecMemsetNodeSetParams")
        if err:
            return (err,)
        assert ctx == FakeDevice.context
        e = self._exec(h)
        try:
            i = self._slot(e, node)
        except KeyError:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        old = e.slots[i]
        new = {"dst": int(p.dst), "value": int(p.value), "es": int(p.elementSize),
               "count": int(p.width)}
        if (new["es"], new["count"]) != (old["es"], old["count"]):
            return (R.CUDA_ERROR_INVALID_VALUE,)  # only the pointer and value may change
        e.slots[i] = new
        return (OK,)

    def cuGraphExecUpdate(self, h, hgraph):
        self._call("cuGraphExecUpdate")
        e = self._exec(h)
        g = self._graph(hgraph)
        topo = [(n.kind, n.index_deps()) for n in g.nodes]
        info = types.SimpleNamespace(result=0, errorNode=None, errorFromNode=None)
        if len(topo) != len(e.topology):
            info.result = 2
            return (R.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, info)
        for i, (a, b) in enumerate(zip(topo, e.topology)):
            if a != b:
                info.result = 3 if a[0] != b[0] else 2
                info.errorNode = g.nodes[i].id
                return (R.CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, info)
        e.slots = [dict(n.params) for n in g.nodes]
        e.handle_graph = g
        return (OK, info)

    def cuDeviceGetGraphMemAttribute(self, dev, attr):
        used = sum(int(a.nbytes) for a in self.vas.values())
        return (OK, used)

    def cuDeviceGraphMemTrim(self, dev):
        return (OK,)

    # -- stream capture ---------------------------------------------------------------------

    def cuStreamBeginCapture(self, stream, mode):
        self._call("cuStreamBeginCapture", int(mode))
        s = int(stream)
        if s in self.capture:
            return (R.CUDA_ERROR_ILLEGAL_STATE,)
        seq = Seq(s, mode)
        self.capture[s] = seq
        self.deps[s] = []
        self.graphs[int(seq.graph.id)] = seq.graph  # nodes may be added to it while capturing
        return (OK,)

    def cuStreamBeginCaptureToGraph(self, stream, hgraph, deps, edata, n, mode):
        self._call("cuStreamBeginCaptureToGraph", int(mode))
        s = int(stream)
        if s in self.capture:
            return (R.CUDA_ERROR_ILLEGAL_STATE,)
        seq = Seq(s, mode, self._graph(hgraph))
        self.capture[s] = seq
        self.deps[s] = list(deps or [])
        return (OK,)

    def cuStreamUpdateCaptureDependencies(self, stream, deps, edata, n, flags):
        self._call("cuStreamUpdateCaptureDependencies", int(flags))
        s = int(stream)
        if s not in self.capture:
            return (R.CUDA_ERROR_ILLEGAL_STATE,)
        deps = list(deps or [])
        assert len(deps) == n
        if int(flags) == 1:  # CU_STREAM_SET_CAPTURE_DEPENDENCIES
            self.deps[s] = deps
        else:
            self.deps[s] = self.deps[s] + [d for d in deps if int(d) not in map(int, self.deps[s])]
        return (OK,)

    def _capturing(self, stream):
        return self.capture.get(int(stream))

    def _leave(self, seq):
        for s in list(seq.streams):
            self.capture.pop(s, None)
            self.deps.pop(s, None)

    def cuStreamEndCapture(self, stream):
        self._call("cuStreamEndCapture")
        s = int(stream)
        seq = self.capture.get(s)
        if seq is None or seq.origin != s:
            return (R.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, None)
        if seq.status != CS.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            self._leave(seq)
            seq.graph.destroyed = not seq.into  # the driver discards what it captured
            return (R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None)
        # every stream's dependency set must be reachable from the origin's
        byid = {int(n.id): n for n in seq.graph.nodes}
        reach, stack = set(), list(self.deps[s])
        while stack:
            d = int(stack.pop())
            if d not in reach:
                reach.add(d)
                stack.extend(byid[d].deps)
        unjoined = [t for t in seq.streams if t != s and any(int(d) not in reach
                                                              for d in self.deps[t])]
        self._leave(seq)
        if unjoined:
            seq.graph.destroyed = not seq.into
            return (R.CUDA_ERROR_STREAM_CAPTURE_UNJOINED, None)
        g = seq.graph
        self.graphs[int(g.id)] = g
        return (OK, g.id)

    def cuStreamIsCapturing(self, stream):
        seq = self._capturing(stream)
        return (OK, CS.CU_STREAM_CAPTURE_STATUS_NONE if seq is None else seq.status)

    def cuStreamGetCaptureInfo(self, stream):
        seq = self._capturing(stream)
        if seq is None:
            return (OK, CS.CU_STREAM_CAPTURE_STATUS_NONE, 0, None, [], [], 0)
        deps = list(self.deps[int(stream)])
        return (OK, seq.status, seq.id, seq.graph.id, deps, [None] * len(deps), len(deps))

    def cuStreamQuery(self, stream):
        self._call("cuStreamQuery")
        seq = self._capturing(stream)
        if seq is not None:
            seq.status = CS.CU_STREAM_CAPTURE_STATUS_INVALIDATED
            return (R.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
        return (OK,)

    def cuEventRecord(self, event, stream):
        err = self._call("cuEventRecord")
        if err:
            return (err,)
        seq = self._capturing(stream)
        if seq is not None and seq.status != CS.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            return (R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,)
        self.events[int(event)] = (seq, list(self.deps.get(int(stream), [])) if seq else [])
        return (OK,)

    def cuEventRecordWithFlags(self, event, stream, flags):
        seq = self._capturing(stream)
        if seq is not None:
            return self._enqueue(stream, "event", {"ev": int(event)})
        return self.cuEventRecord(event, stream)

    def cuStreamWaitEvent(self, stream, event, flags):
        err = self._call("cuStreamWaitEvent")
        if err:
            return (err,)
        s = int(stream)
        ev_seq, ev_deps = self.events.get(int(event), (None, []))
        seq = self._capturing(s)
        if ev_seq is not None:
            if ev_seq.status != CS.CU_STREAM_CAPTURE_STATUS_ACTIVE:
                return (R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,)
            if seq is None:  # joins the capture (a fork)
                self.capture[s] = ev_seq
                ev_seq.streams.add(s)
                self.deps[s] = list(ev_deps)
            elif seq is ev_seq:
                merged = list(self.deps[s])
                merged += [d for d in ev_deps if int(d) not in {int(x) for x in merged}]
                self.deps[s] = merged
            else:
                return (R.CUDA_ERROR_STREAM_CAPTURE_MERGE,)
        return (OK,)

    def _enqueue(self, stream, kind, params, programmatic=False):
        """A stream operation: a node when capturing, else run now. ``programmatic``: a PDL
        launch, whose edges from kernel nodes the capture makes programmatic."""
        seq = self._capturing(stream)
        if seq is None:
            return (self._run(kind, params),)
        if seq.status != CS.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            return (R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,)
        deps = self.deps[int(stream)]
        edges = None
        if programmatic:
            edges = [(PROGRAMMATIC, PORT_PROGRAMMATIC) if seq.graph.node(d).kind == "kernel"
                     else (0, 0) for d in deps]
        node = seq.graph.add(kind, deps, params, edges)
        self.deps[int(stream)] = [node.id]
        return (OK,)

    def cuMemAllocFromPoolAsync(self, nbytes, pool, stream):
        err = self._call("cuMemAllocFromPoolAsync", nbytes)
        if err:
            return (err, None)
        seq = self._capturing(stream)
        if seq is None:
            return (OK, driver.CUdeviceptr(self._new_memory(nbytes, self.mem)))
        ptr = self._new_memory(nbytes, self.vas)
        (err,) = self._enqueue(stream, "alloc", {"dptr": ptr, "n": nbytes})
        return (err, driver.CUdeviceptr(ptr) if not err else None)

    def cuMemFreeAsync(self, dptr, stream):
        err = self._call("cuMemFreeAsync")
        if err:
            return (err,)
        if self._capturing(stream) is None:
            self.mem.pop(int(dptr))
            return (OK,)
        return self._enqueue(stream, "free", {"dptr": int(dptr)})

    def cuMemFree(self, dptr):
        self._call("cuMemFree")
        return (OK,)

    def cuMemcpy3DAsync(self, p, stream):
        err = self._call("cuMemcpy3DAsync")
        if err:
            return (err,)
        return self._enqueue(stream, "memcpy", self._memcpy_snapshot(p))

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):
        err = self._call("cuMemcpyDtoDAsync")
        if err:
            return (err,)
        return self._enqueue(stream, "memcpy", {"src": int(src), "dst": int(dst), "src_host": False,
                                                "dst_host": False, "n": int(nbytes)})

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        err = self._call("cuLaunchKernel")
        if err:
            return (err,)
        return self._enqueue(stream, "kernel",
                             self._kernel_snapshot(func, (gx, gy, gz), (bx, by, bz), smem, params))

    def cuLaunchKernelEx(self, config, func, params, extra):
        err = self._call("cuLaunchKernelEx")
        if err:
            return (err,)
        pss = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        pdl = any(int(a.id) == int(pss) and a.value.programmaticStreamSerializationAllowed
                  for a in list(config.attrs)[:int(config.numAttrs)])
        return self._enqueue(stream=config.hStream, kind="kernel", params=self._kernel_snapshot(
            func, (config.gridDimX, config.gridDimY, config.gridDimZ),
            (config.blockDimX, config.blockDimY, config.blockDimZ), config.sharedMemBytes,
            params), programmatic=pdl)

    def _memset(self, name, es, dst, value, count, stream):
        err = self._call(name)
        if err:
            return (err,)
        return self._enqueue(stream, "memset", {"dst": int(dst), "value": int(value), "es": es,
                                                "count": int(count)})

    def cuMemsetD8Async(self, dst, value, count, stream):
        return self._memset("cuMemsetD8Async", 1, dst, value, count, stream)

    def cuMemsetD16Async(self, dst, value, count, stream):
        return self._memset("cuMemsetD16Async", 2, dst, value, count, stream)

    def cuMemsetD32Async(self, dst, value, count, stream):
        return self._memset("cuMemsetD32Async", 4, dst, value, count, stream)



class FakeStream:
    """An orchestra-Stream look-alike whose ``query`` goes through the fake driver (``fake``:
    the driver given, else the last one installed)."""

    installed: FakeGraphDriver | None = None

    def __init__(self, device=None, priority=0, fake=None):
        self.fake = fake if fake is not None else FakeStream.installed
        self.device = device
        self.priority = priority
        self.handle = _handle()
        self.closed = False
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1

    def query(self):
        from orchestra.driver.check import error_from_result

        (err,) = self.fake.cuStreamQuery(self.handle)
        if err:
            raise error_from_result("cuStreamQuery", err)
        return True

    def close(self):
        self.closed = True


class FakeEvent:
    def __init__(self, device=None, timing=False):
        self.handle = _handle()
        self.closed = False

    def close(self):
        self.closed = True


class FakePool:
    handle = "pool"


def install(monkeypatch) -> FakeGraphDriver:
    """A new fake, made the process's default driver API for the test; returns it."""
    fake = FakeGraphDriver()
    FakeStream.installed = fake
    return fake.install(monkeypatch)


def fake_graph_kernel(ref, device=None) -> FakeGraphKernel:
    """A `KernelResolver` loader for the graph fake: the copy kernel for its `KernelRef` (run
    by name: it moves bytes), burn for every other."""
    if ref.name == COPY_KERNEL_NAME:
        return FakeGraphKernel(COPY_PARAMS, COPY_KERNEL_NAME)
    return FakeGraphKernel()


def resolver(fake, kernels=None) -> KernelResolver:
    """A resolver whose kernels are fakes: ``kernels[ref.name]`` (a ``FakeGraphKernel``) for
    the names given, else the copy kernel for its `KernelRef` (run by name: it moves bytes),
    burn for every other."""
    kernels = kernels or {}
    return KernelResolver(fake.device,
                          lambda ref, d: kernels.get(ref.name) or fake_graph_kernel(ref, d))
