"""orchestra.driver: checked CUDA driver calls and the objects that own driver handles.

Every driver call goes through `cu`. Every object here owns one handle, releases it on
``close()`` (idempotent, also via ``with``) or, if forgotten, from a finalizer, and never
touches a primary context that was already released at interpreter exit. ``obj.lease()``
(a `Lease`) defers that release past a ``close()`` until the last lease ends, for work that
still refers to the handle (docs/errors.md, "Lifetimes").
`live_handles()` counts the handles held now, by kind (leak accounting);
`deferred_releases()` those closed but still leased.

Interop (docs/interop.md): `device_view` / `host_view` read other libraries' memory (DLPack,
the CUDA Array Interface) into an `ExternalArray` / numpy view, checked and ordered;
`DeviceBuffer` and its typed `BufferView` export both protocols; `Stream.from_handle` wraps other
libraries' streams (``__cuda_stream__``; the default streams as a `DefaultStream`, for ordering
only), and `order_after` / `order_before` order work between streams.

Beside streams and events: stream capture (`CaptureSession`, `capture`), the graph allocator's
memory (`graph_memory`), and the driver entry points called through ctypes where cuda-bindings'
wrappers fall short (`entry_points`).
"""

from orchestra.driver.capture import (
    CaptureSession,
    UnjoinedStreamError,
    capture_status,
    is_capturing,
)
from orchestra.driver.check import cu, device_available, ensure_initialized
from orchestra.driver.device import Device, DeviceLimits, context_alive, device_count, devices
from orchestra.driver.event import Event
from orchestra.driver.export import BufferView
from orchestra.driver.graph_memory import GraphMemory, graph_memory, trim_graph_memory
from orchestra.driver.host import (
    HostRegistration,
    PinnedBuffer,
    PinnedRanges,
    is_pinned,
    pinned_ranges,
    register_host,
)
from orchestra.driver.interop import ExternalArray, device_view, host_view
from orchestra.driver.live import deferred_releases, leaked, live_handles
from orchestra.driver.memory import DeviceBuffer, MemoryPool
from orchestra.driver.owner import Lease, Owner, Resource, ResourceClosedError
from orchestra.driver.ordering import order_after, order_before
from orchestra.driver.stream import DefaultStream, Stream

__all__ = [
    "cu", "ensure_initialized", "device_available",
    "Device", "DeviceLimits", "device_count", "devices", "context_alive",
    "Stream", "DefaultStream", "Event", "MemoryPool", "DeviceBuffer", "BufferView",
    "device_view", "host_view", "ExternalArray", "order_after", "order_before",
    "PinnedBuffer", "HostRegistration", "register_host", "is_pinned", "PinnedRanges",
    "pinned_ranges",
    "Owner", "Resource", "Lease", "ResourceClosedError", "live_handles", "leaked",
    "deferred_releases",
    "CaptureSession", "UnjoinedStreamError", "capture_status", "is_capturing",
    "GraphMemory", "graph_memory", "trim_graph_memory",
]
