"""The executors' side of the lifetime rule on a real GPU (skipped without one; docs/errors.md,
"Lifetimes"), plus re-pointed external buffers, two threads replaying one exec and a long
replay loop.

Every case runs in a child process (``tests/test_lifetimes_gpu.run_child``: a crash is a failed
test, not a hung or poisoned suite; the child prints OK last). The lifetime cases, for the
eager, capture and graph-build executors, close one resource under a built exec (eager: under a
queued run): the external device buffers, the pinned buffers, the staging pool or the host
registrations behind the bound arrays. Then the replays are right (a decoy allocation shows the
memory was not handed out again), binding the closed object again is refused with a specific
error, and once the exec is closed (eager: the run synchronized) ``live_handles()``, the pool's
used bytes and the graph memory in use are back at their baseline.
"""

import pytest

from tests.test_lifetimes_gpu import run_child

pytestmark = pytest.mark.gpu

COMMON = '''
import threading
import time

from orchestra.app.job import burn_kernel_ref
from orchestra.driver import DeviceBuffer, graph_memory, trim_graph_memory
from orchestra.execute import (
    CaptureExecutor, ClosedBindingError, EagerExecutor, GraphBuildExecutor, GraphRunner,
    StagingPool,
)
from orchestra.graph import (
    Alloc, Buffer, DeviceToHost, Free, HostBuffer, HostToDevice, In, KernelNode, Out, TaskGraph,
)

EXECUTORS = {"eager": EagerExecutor, "capture": CaptureExecutor,
             "graph-build": GraphBuildExecutor}
MEMORY = ("device_buffer", "pinned_buffer", "host_registration")


def io_graph(external):
    g = TaskGraph()
    x, y = Buffer("x", NB), Buffer("y", NB)
    if not external:
        g.add(Alloc("ax", x))
        g.add(Alloc("ay", y))
    g.add(HostToDevice("up", HostBuffer("hin", NB), x))
    g.add(KernelNode("k", burn_kernel_ref(), GRID, 256, (In(x), Out(y), N, 3, 0.5, 1.0)))
    g.add(DeviceToHost("down", y, HostBuffer("hout", NB)))
    if not external:
        g.add(Free("fx", x))
        g.add(Free("fy", y))
    return g


def expect_refused(fn, *fragments):
    try:
        fn()
    except ClosedBindingError as exc:
        for f in fragments:
            assert f in str(exc), (f, str(exc))
    else:
        raise AssertionError("no ClosedBindingError")


trail = []  # (step, pool used bytes, graph memory used) along a case: shown when one fails


def mark(step):
    dev.synchronize()
    trail.append((step, pool.used_bytes, graph_memory(dev).used))


def memory_at_baseline(used0, gm0, what):
    s.synchronize()
    gc.collect()
    mark("end")
    now = live_handles()
    assert {k: now[k] for k in MEMORY} == {k: base_live[k] for k in MEMORY}, (what, now)
    assert deferred_releases() == base_deferred, (what, deferred_releases())
    assert pool.used_bytes == used0, (what, pool.used_bytes, used0, trail)
    # a destroyed exec's graph memory stays with the driver (used and reserved) until a trim,
    # for bare cuda-python too; after the trim nothing may be left: no exec still holds any
    trim_graph_memory(dev)
    mark("trimmed")
    assert graph_memory(dev).used == gm0, (what, graph_memory(dev).used, gm0, trail)
'''

LIFETIME = COMMON + '''
KIND, WHAT = "@KIND@", "@WHAT@"
external = WHAT == "device_buffer"
eager = KIND == "eager"
g = io_graph(external)
used0, gm0 = pool.used_bytes, graph_memory(dev).used
ex = EXECUTORS[KIND](dev)
keep_open = []  # resources this case does not close (closed at the end)
closers = []  # what the case closes under the exec / the queued run
bind = {}
if WHAT == "device_buffer":
    xb, yb = DeviceBuffer.allocate(NB, s), DeviceBuffer.allocate(NB, s)
    ptrs = (xb.ptr, yb.ptr)
    pin_in, pin_out = PinnedBuffer.empty(N, np.float32, dev), PinnedBuffer.empty(N, np.float32, dev)
    keep_open += [pin_in, pin_out]
    hin, hout = pin_in.array, pin_out.array
    bind.update(x=xb, y=yb)
    closers += [xb, yb]
    refused = ("x", xb, "DeviceBuffer")
elif WHAT == "pinned_buffer":
    pin_in, pin_out = PinnedBuffer.empty(N, np.float32, dev), PinnedBuffer.empty(N, np.float32, dev)
    hin, hout = pin_in.array, pin_out.array
    closers += [pin_in] + ([] if eager else [pin_out])  # eager reads its output after the sync
    keep_open += [pin_out] if eager else []
    refused = ("hin", hin, "PinnedBuffer")
elif WHAT == "staging_pool":
    stage = StagingPool(2, NB, dev)
    hin = stage.view(0)
    if eager:
        pin_out = PinnedBuffer.empty(N, np.float32, dev)
        keep_open.append(pin_out)
        hout = pin_out.array
    else:
        hout = stage.view(1)
    closers.append(stage)
    refused = ("hin", hin, "PinnedBuffer")
else:
    hin, hout = np.zeros(N, np.float32), np.zeros(N, np.float32)  # pageable until registered
    reg_in, reg_out = register_host(hin), register_host(hout)
    closers += [reg_in] + ([] if eager else [reg_out])
    keep_open += [reg_out] if eager else []
    refused = ("hin", hin, "HostRegistration")
bind.update(hin=hin, hout=hout)
data = rng.standard_normal(N).astype(np.float32)
hin[:] = data
hout[:] = np.nan
where = "the eager executor's run" if eager else f"a {KIND} GraphExec"
if eager:
    ex.run(g, bindings=bind, sync=False)  # queued
    for c in closers:
        c.close()
    name, obj, what = refused
    expect_refused(lambda: ex.run(g, bindings={**bind, name: obj}),
                   f"binding {name} ({where})", f"the {what} bound to it is closed")
    ex.synchronize()  # the queued run is done: the closed memory goes now
    assert deferred_releases() == base_deferred, ("not released at the sync",
                                                  deferred_releases())
    assert hout.tobytes() == burn_ref(data, 3).tobytes(), "eager: wrong output"
    print(KIND, WHAT, "queued run right; closed memory released at the synchronize")
else:
    mark("executor made")
    exe = ex.build(g, None, bind)
    mark("built")
    exe.launch(sync=True)
    mark("launched")
    assert hout.tobytes() == burn_ref(data, 3).tobytes()
    for c in closers:
        c.close()
    assert all(c.closed for c in closers)
    assert deferred_releases() != base_deferred, "nothing was deferred"
    mark("closed under the exec")
    decoy = DeviceBuffer.allocate(NB, s)
    decoy.memset(0xFF, s)
    s.synchronize()
    mark("decoy")
    if external:
        assert all(disjoint(decoy.ptr, p, NB) for p in ptrs), "closed memory handed out again"
    for i in range(3):
        data = rng.standard_normal(N).astype(np.float32)
        hin[:] = data  # the exec's lease keeps this memory valid
        hout[:] = np.nan
        exe.replay()
        assert hout.tobytes() == burn_ref(data, 3).tobytes(), f"replay {i} after the close"
    mark("replayed")
    name, obj, what = refused
    expect_refused(lambda: exe.replay({name: obj}), f"binding {name} ({where})",
                   f"the {what} bound to it is closed")
    check = PinnedBuffer.empty(N, np.float32, dev)
    decoy.copy_to_host(check, s, sync=True)
    assert (check.view(np.uint8) == 0xFF).all(), "a replay wrote another allocation"
    decoy.close()
    check.close()
    del hin, hout, bind, obj
    mark("decoy closed")
    exe.close()  # the closed resources' releases run now
    mark("exec closed")
    assert deferred_releases() == base_deferred, ("not released at the exec's close",
                                                  deferred_releases())
    print(KIND, WHAT, "3 replays right after the close; released when the exec closed")
ex.close()  # (eager: its prepared plan leases what is still open)
mark("executor closed")
for o in keep_open:
    o.close()
memory_at_baseline(used0, gm0, f"{KIND} {WHAT}")
at_baseline(MEMORY + ("stream", "event"))
'''


@pytest.mark.parametrize("what", ["device_buffer", "pinned_buffer", "staging_pool",
                                  "host_registration"])
@pytest.mark.parametrize("kind", ["eager", "capture", "graph-build"])
def test_a_resource_closed_under_a_built_exec_or_a_queued_run(kind, what):
    run_child(LIFETIME.replace("@KIND@", kind).replace("@WHAT@", what), timeout=60)


RUNNER = COMMON + '''
KIND = "@KIND@"
g = io_graph(True)
used0, gm0 = pool.used_bytes, graph_memory(dev).used
xs = [DeviceBuffer.allocate(NB, s) for _ in range(3)]
y = DeviceBuffer.allocate(NB, s)
pin_in, pin_out = PinnedBuffer.empty(N, np.float32, dev), PinnedBuffer.empty(N, np.float32, dev)
s.synchronize()
runner = GraphRunner(KIND, dev)
x, first = xs[0], None
for i in range(100):
    if i and i % 10 == 0:
        x = xs[(i // 10) % 3]  # every tenth run another input buffer: re-pointed in place
    data = rng.standard_normal(N).astype(np.float32)
    pin_in.array[:] = data
    pin_out.array[:] = np.nan
    r = runner.run(g, None, {"x": x, "y": y, "hin": pin_in.array, "hout": pin_out.array})
    assert pin_out.array.tobytes() == burn_ref(data, 3).tobytes(), f"run {i} wrong"
    first = first or runner.last_exec
    assert runner.last_exec is first, "rebuilt"
assert first.repoint_updates == 0, first.last_update
print(KIND, "100 runs right, one exec, 9 re-points in place")
runner.close()
for b in xs + [y, pin_in, pin_out]:
    b.close()
memory_at_baseline(used0, gm0, KIND)
'''


@pytest.mark.parametrize("kind", ["capture", "graph"])
def test_graph_runner_with_external_buffers_rebound_every_tenth_run(kind):
    run_child(RUNNER.replace("@KIND@", kind), timeout=60)


THREADS = COMMON + '''
KIND = "@KIND@"
g = io_graph(False)
ex = EXECUTORS[KIND](dev)
seed_in = PinnedBuffer.empty(N, np.float32, dev)
seed_out = PinnedBuffer.empty(N, np.float32, dev)
exe = ex.build(g, None, {"hin": seed_in.array, "hout": seed_out.array})
bad, done = [], []
start = threading.Barrier(2)


def worker(seed):
    pin_in = PinnedBuffer.empty(N, np.float32, dev)  # each thread's own arrays
    pin_out = PinnedBuffer.empty(N, np.float32, dev)
    r = np.random.default_rng(seed)
    start.wait()
    for i in range(200):
        data = (r.standard_normal(N) + 100 * seed).astype(np.float32)
        pin_in.array[:] = data
        pin_out.array[:] = np.nan
        exe.replay({"hin": pin_in.array, "hout": pin_out.array})  # from this thread
        if pin_out.array.tobytes() != burn_ref(data, 3).tobytes():
            bad.append((seed, i))
    done.append(seed)
    exe.synchronize()
    pin_in.close()
    pin_out.close()


threads = [threading.Thread(target=worker, args=(k,)) for k in (1, 2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert sorted(done) == [1, 2] and bad == [], bad[:5]
assert exe.launches == 400
print(KIND, "2 threads x 200 replays, every output its caller's")
exe.close()
ex.close()
seed_in.close()
seed_out.close()
at_baseline(MEMORY + ("stream", "event"))
'''


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_c13_two_threads_replaying_one_exec_each_get_their_own_output(kind):
    run_child(THREADS.replace("@KIND@", kind), timeout=60)


C20 = COMMON + '''
from orchestra.graph import build_pipeline

KIND = "@KIND@"
BATCHES, PER = 1024, 1024  # 1,024 batches of 4 KiB


def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


g, bs = build_pipeline(BATCHES, [4 * PER] * BATCHES, burn_kernel_ref(),
                       host_in=HostBuffer("host_in", 4 * PER * BATCHES),
                       host_out=HostBuffer("host_out", 4 * PER * BATCHES), scalars=(1, 0.5, 1.0))
ins = [PinnedBuffer.empty(BATCHES * PER, np.float32, dev) for _ in range(2)]
out = PinnedBuffer.empty(BATCHES * PER, np.float32, dev)
for p in ins:
    p.array[:] = rng.standard_normal(BATCHES * PER).astype(np.float32)
ex = EXECUTORS[KIND](dev)
exe = ex.build(g, None, {"host_in": ins[0].array, "host_out": out.array})
t0 = time.perf_counter()
for i in range(50):  # warm: everything allocated that a replay loop will ever allocate
    exe.replay({"host_in": ins[i % 2].array}, sync=False)
exe.synchronize()
gc.collect()
rss0, used0, gm0 = rss_kib(), pool.used_bytes, graph_memory(dev)
samples = []
for i in range(1000):
    exe.replay({"host_in": ins[(i // 10) % 2].array} if i % 10 == 0 else None, sync=False)
    if i % 100 == 99:
        exe.synchronize()
        gc.collect()
        samples.append(rss_kib())
exe.synchronize()
elapsed = time.perf_counter() - t0
src = ins[(999 // 10) % 2].array
assert out.array[:PER].tobytes() == burn_ref(src[:PER], 1).tobytes(), "wrong output"
assert out.array[-PER:].tobytes() == burn_ref(src[-PER:], 1).tobytes(), "wrong output"
gc.collect()
rss1, used1, gm1 = rss_kib(), pool.used_bytes, graph_memory(dev)
print(f"{KIND}: 1000 replays of {len(g)} nodes in {elapsed:.2f} s; RSS {rss0} -> {rss1} KiB "
      f"(every 100: {samples}); pool used {used0} -> {used1}; graph memory used "
      f"{gm0.used} -> {gm1.used}, reserved {gm0.reserved} -> {gm1.reserved}")
assert rss1 - rss0 < 32 * 1024, "RSS grew by more than 32 MiB over 1000 replays"
assert used1 == used0 and gm1.used == gm0.used and gm1.reserved <= gm0.reserved
assert exe._state.retired == [] and len(exe._state.keep) == 1
exe.close()
ex.close()
for p in ins + [out]:
    p.close()
at_baseline(MEMORY + ("stream", "event"))
'''


@pytest.mark.parametrize("kind", ["capture", "graph-build"])
def test_c20_1024_small_batches_replayed_1000_times_without_memory_growth(kind):
    run_child(C20.replace("@KIND@", kind), timeout=120)
