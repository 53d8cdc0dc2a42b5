"""Loaded code: `Module` (a cubin/PTX loaded as a CUDA library), `Kernel` (one entry point with
argument packing and checked launches) and `load_kernel` (compile + load + look up, memoized).

Loading uses the context-independent library API: ``cuLibraryLoadData`` loads the image,
``cuLibraryGetKernel`` + ``cuKernelGetFunction`` give the ``CUfunction`` of the device's primary
context (made current first with ``Device.make_current``), which launches go through.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any
from pathlib import Path

from orchestra.compiler.args import ArgLayout, PackedArgs
from orchestra.compiler.elf import ElfError, is_elf, kernel_names, kernel_params
from orchestra.compiler.launch import LaunchConfig, build_launch_config, check_launch
from orchestra.compiler.nvrtc import CompileResult, prepare_compile
from orchestra.compiler.params import normalize_params, parse_params
from orchestra.compiler.ptx import (
    check_ptx_loadable,
    is_ptx,
    link_ptx,
    ptx_isa_version,
)
from orchestra.driver.owner import Resource
from orchestra.errors import (
    ArgumentNeedsStreamError,
    CompilerArgumentTypeError,
    CudaError,
    DriverArgumentTypeError,
    DriverArgumentValueError,
    KernelArgumentTypeError,
    NotFoundError,
    ParamDeclarationValueError,
)


class KernelNotFoundError(NotFoundError):
    """No kernel of that name in a module; the message lists the kernels present.

    Attributes: ``name`` (asked for), ``available`` (tuple of lowered names present).
    A `KeyError` subclass (``except KeyError`` catches it) with a readable message.
    """

    def __init__(self, name: str, available=()):
        self.name = name
        self.available = tuple(available)
        listed = ", ".join(self.available) if self.available else "none"
        self.text = (f"no kernel named {name!r} in the module; kernels present: {listed}"
                     " (C++ kernels have mangled names: declare them extern \"C\" or load them"
                     " with name_expression=)")
        super().__init__(self.text)

    def __str__(self) -> str:
        return self.text

    def __reduce__(self):
        return (type(self), (self.name, self.available))


def _drv():
    from cuda.bindings import driver

    return driver


def _device_api():
    from orchestra.driver.device import as_device, context_alive

    return as_device, context_alive


def _cu(fn, *args):
    from orchestra.driver.check import cu

    return cu(fn, *args)


def driver_version() -> int:
    """``cuDriverGetVersion``: the CUDA version the driver supports, e.g. 13000 for 13.0."""
    return int(_cu(_drv().cuDriverGetVersion))


class Module(Resource):
    """A loaded image (cubin, fatbin or PTX) for one device: a ``CUlibrary``.

    Make it with `Module.load`. ``close()`` unloads it (``cuLibraryUnload``; idempotent); the
    driver layer's `Owner` finalizer does it for a module that is dropped, and skips the call
    once the device's primary context has been released at interpreter exit. `Kernel` objects
    keep their module alive.

    Lifetime: `lease` keeps the library loaded for a built exec or queued work that launches
    its kernels. `close()` while a lease is out returns at once and the module reads as closed
    (``library`` raises `ResourceClosedError`, `kernel` refuses, no new lease), but the kernels
    it handed out keep working and ``cuLibraryUnload`` runs when the last lease ends
    (docs/errors.md, "Lifetimes").

    Thread-safety: may be shared between threads: `kernel` looks kernels up once each under the
    module's lock (then returns the same `Kernel`), and `close` / `lease` go through the
    `Owner`'s lock.
    """

    def __init__(self, library, image: bytes, device, *, lowered_names=None, source=None):
        from cuda.bindings import driver

        from orchestra.driver.check import cu
        from orchestra.driver.owner import Owner

        self.device = device
        self.lowered_names = dict(lowered_names or {})
        self.source = source
        self._image = image  # kept alive for the library's lifetime
        self._kernels: dict = {}
        self._lock = threading.Lock()
        self._own = Owner(self, library, functools.partial(cu, driver.cuLibraryUnload), device,
                          "Module")

    @property
    def library(self):
        """The ``CUlibrary``; `ResourceClosedError` (a ``ValueError``) once closed."""
        return self._own.handle

    def lease(self):
        """A `Lease` that keeps the library loaded (and its kernels launchable) until it is
        released, even if the module is closed meanwhile. `ResourceClosedError` if closed
        already. Release it only after the launches that use its kernels have completed."""
        return self._own.lease()

    @classmethod
    def load(cls, image, device=None, *, source=None, lowered_names=None) -> "Module":
        """Load ``image`` on ``device`` (default: device 0) with ``cuLibraryLoadData``.

        ``image``: a `CompileResult`, cubin/fatbin bytes, PTX text (bytes or str), or a path
        to a ``.cubin``/``.fatbin``/``.ptx`` file. PTX is JIT-compiled by the driver; before
        that its ``.version`` is compared with ``cuDriverGetVersion`` and `PtxVersionError`
        names both when the driver is too old. ``source`` (CUDA C++ text) lets
        `kernel` read parameter declarations; ``lowered_names`` maps name expressions to
        lowered names (taken from a `CompileResult`).

        Raises `CudaError` for a driver refusal, `NoDeviceError` without a GPU.
        """
        as_device, _ = _device_api()
        dev = as_device(device)
        if isinstance(image, CompileResult):
            lowered_names = {**image.lowered_names, **(lowered_names or {})}
            data = image.cubin
        elif isinstance(image, (bytes, bytearray, memoryview)):
            data = bytes(image)
        elif isinstance(image, str) and is_ptx(image):
            data = image.encode("utf-8")
        elif isinstance(image, (str, os.PathLike)):
            data = Path(image).read_bytes()
        else:
            raise CompilerArgumentTypeError(
                "Module.load takes a CompileResult, image bytes, PTX text or a"
                f" path, got {type(image).__name__}")
        if is_ptx(data):
            check_ptx_loadable(ptx_isa_version(data), driver_version())
            data = data.rstrip(b"\0") + b"\0"  # the driver reads PTX as a C string
        dev.make_current()
        d = _drv()
        library = _cu(d.cuLibraryLoadData, data, [], [], 0, [], [], 0)
        return cls(library, data, dev, lowered_names=lowered_names, source=source)

    def close(self) -> None:
        """Unload the library (``cuLibraryUnload``); idempotent. Kernels become unusable once
        it is unloaded: now, or, while a `lease` is out, when the last lease ends."""
        self._own.close()

    def kernel_names(self) -> list[str]:
        """Lowered names of the kernels in the library (``cuLibraryGetKernelCount``,
        ``cuLibraryEnumerateKernels``, ``cuKernelGetName``); the cubin's ELF symbol table when
        the driver cannot say."""
        d = _drv()
        try:
            count = _cu(d.cuLibraryGetKernelCount, self.library)
            handles = _cu(d.cuLibraryEnumerateKernels, count, self.library) if count else []
            names = []
            for h in handles:
                n = _cu(d.cuKernelGetName, h)
                names.append(n.decode() if isinstance(n, bytes) else str(n))
            return names
        except Exception:  # noqa: BLE001 - fall back to the image itself
            if is_elf(self._image):
                try:
                    return kernel_names(self._image)
                except ElfError:
                    pass
            return []

    def kernel(self, name: str, params=None) -> "Kernel":
        """The `Kernel` called ``name``: a lowered name (``extern "C"`` kernels: their plain
        name) or a name expression this module was compiled with.

        ``params``: explicit parameter types (`Param` objects or C type strings such as
        ``("const float*", "float*", "int")``); default: parsed from the module's ``source``.

        Raises `KernelNotFoundError` (a ``KeyError``) listing the kernels present.
        """
        if self.closed:
            from orchestra.driver.owner import ResourceClosedError

            raise ResourceClosedError("this Module is closed: load it again to look up "
                                      f"kernel {name!r}", "Module")
        explicit = None if params is None else normalize_params(params)
        key = (name, explicit)
        k = self._kernels.get(key)
        if k is not None:
            return k
        with self._lock:
            k = self._kernels.get(key)
            if k is not None:
                return k
            lowered = self.lowered_names.get(name, name)
            d = _drv()
            self.device.make_current()
            err, handle = d.cuLibraryGetKernel(self.library, lowered.encode("utf-8"))
            if int(err):
                if err == d.CUresult.CUDA_ERROR_NOT_FOUND:
                    raise KernelNotFoundError(name, self.kernel_names())
                from orchestra.driver.check import error_from_result

                raise error_from_result("cuLibraryGetKernel", err, context=name)
            func = _cu(d.cuKernelGetFunction, handle)
            params_error = None
            if explicit is not None:
                declared = explicit
            elif self.source is not None and lowered == name:
                try:
                    declared = parse_params(self.source, name)
                except ValueError as exc:
                    declared, params_error = None, str(exc)
            else:
                declared = None
                params_error = (f"the parameters of kernel {name!r} are unknown (no source to"
                                " read them from, or a name expression); pass params="
                                " explicitly, e.g. params=(\"const float*\", \"float*\", \"int\")")
            k = Kernel(self, name, lowered, handle, func, declared, params_error)
            self._kernels[key] = k
            return k

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"device {self.device.ordinal}"
        return f"<Module {state}>"


_NOTHING = object()  # matches no argument: an empty fast path
_NO_CALL = (_NOTHING, None, None, None, None, None, None)


class Kernel:
    """One kernel of a loaded `Module`, ready to launch.

    Attributes: ``name`` (as asked), ``lowered_name``, ``module``, ``device``, ``function``
    (``CUfunction``), ``handle`` (``CUkernel``), ``params`` (tuple of `Param`, or None when
    unknown), ``layout`` (`ArgLayout`, or None).

    Thread-safety: may be shared between threads; `launch` may be called from several threads at
    once. The remembered last launch, configuration and stream are tuples read and replaced whole,
    the per-configuration caches are dicts updated by whole entries, and `check` opts in to dynamic
    shared memory (``cuFuncSetAttribute``) under the kernel's lock. Launches from several threads
    onto one stream interleave in whatever order the calls happen: give each thread its own stream,
    or order them. A `PackedArgs` passed to `launch` must not be rewritten by another thread
    meanwhile.
    """

    # `launch`'s fast path (the instance's own once it has launched)
    _last_call: tuple = _NO_CALL
    _tuple_memo: tuple = (_NOTHING, None)

    def __init__(self, module: Module, name: str, lowered: str, handle, function, params,
                 params_error=None):
        self.module = module
        self.device = module.device
        self.name = name
        self.lowered_name = lowered
        self.handle = handle
        self.function = function
        self.params = params
        self.layout = ArgLayout(params, lowered if lowered.isidentifier() else "kernel") \
            if params is not None else None
        self._params_error = params_error
        self._attributes: KernelAttributes | None = None
        # current CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._dyn_smem: int | None = None
        self._plain: dict = {}  # (grid, block, shared_mem) -> (gx, gy, gz, bx, by, bz, smem)
        self._last_dims: tuple = (None, None, None, None)  # (grid, block, smem, dims) of the last
        self._last_stream: tuple = (None, None, None)  # (Stream, its open marker, handle)
        # the last repeatable plain launch: (args as given, stream, grid, block, shared_mem,
        # the stream's open marker, the cuLaunchKernel arguments); `launch`'s fast path
        self._last_call = _NO_CALL
        self._tuple_memo = (_NOTHING, None)  # (tuple of plain scalars, its PackedArgs)
        self._ex: dict = {}  # (launch key, stream) -> CUlaunchConfig (checked, built)
        self._pointer_specs = None  # for protocol arguments (_interop_args), built on first use
        self._lock = threading.Lock()
        if params is not None:
            self._verify_params()

    # -- parameters -------------------------------------------------------------------------

    def _verify_params(self) -> None:
        """Compare the declared parameters with the image's: their count, offsets and sizes.

        A cubin's own parameter table (`elf.kernel_params`) is read first, with no driver call;
        a PTX-loaded module asks the driver (``cuFuncGetParamCount`` where it exists, then
        ``cuFuncGetParamInfo`` for the declared indices only: probing past the end would raise
        a driver error that compute-sanitizer reports). A mismatch is
        `ParamDeclarationValueError` (a ``ValueError``)."""
        image = self.module._image
        actual = kernel_params(image, self.lowered_name) if is_elf(image) else None
        if actual is None:
            actual = self._params_from_driver()
            if actual is None:
                return  # cannot tell: skip the check
        layout = self._need_layout()  # set: the parameters were declared
        declared = [(o, p.size) for o, p in zip(layout.offsets, self.params)]
        if len(actual) != len(declared):
            raise ParamDeclarationValueError(
                f"kernel {self.name} takes {len(actual)} parameters in the image, but"
                f" {len(declared)} were declared: {layout.signature}; fix params=")
        for idx, ((ao, asz), (do, dsz), p) in enumerate(zip(actual, declared, self.params)):
            if ao != do or asz != dsz:
                raise ParamDeclarationValueError(
                    f"kernel {self.name}: parameter {idx} ({p}) is {dsz} bytes at offset {do}"
                    f" as declared, but the image has {asz} bytes at offset {ao}; fix params=")

    def _params_from_driver(self) -> list[tuple[int, int]] | None:
        d = _drv()
        count = None
        try:
            err, n = d.cuFuncGetParamCount(self.function)
            if not int(err):
                count = int(n)
        except Exception:  # noqa: BLE001 - drivers/bindings before 13.1
            count = None
        actual = []
        try:
            for i in range(min(len(self.params) if count is None else count, 4096)):
                err, offset, size = d.cuFuncGetParamInfo(self.function, i)
                if int(err):
                    if count is None and err == d.CUresult.CUDA_ERROR_INVALID_VALUE:
                        break  # the image has fewer parameters than declared
                    return None
                actual.append((int(offset), int(size)))
        except Exception:  # noqa: BLE001 - older driver/bindings: nothing to compare with
            return None
        return actual

    def _need_layout(self) -> ArgLayout:
        if self.layout is None:
            raise KernelArgumentTypeError(
                self._params_error or f"kernel {self.name}: parameters unknown;"
                " pass params= to Module.kernel/load_kernel")
        return self.layout

    def pack(self, args) -> PackedArgs:
        """Validate and pack ``args`` (sequence in declaration order or mapping name ->
        value) into a reusable `PackedArgs` (see `orchestra.compiler.args`)."""
        return self._need_layout().pack(args)

    # -- attributes ---------------------------------------------------------------------------

    @property
    def attributes(self) -> "KernelAttributes":
        """Register count, static shared memory, max threads per block and more
        (``cuFuncGetAttribute``), queried once."""
        attributes = self._attributes
        if attributes is None:
            attributes = self._attributes = KernelAttributes.query(self.function)
            self._dyn_smem = attributes.max_dynamic_shared_bytes
        return attributes

    def occupancy(self, block, shared_mem: int = 0) -> int:
        """Max resident blocks per SM for ``block`` threads and ``shared_mem`` bytes of dynamic
        shared memory (``cuOccupancyMaxActiveBlocksPerMultiprocessor``)."""
        cfg = LaunchConfig.make(1, block, shared_mem)
        self.device.make_current()
        return int(_cu(_drv().cuOccupancyMaxActiveBlocksPerMultiprocessor, self.function,
                   cfg.threads_per_block, cfg.shared_mem))

    # -- launch -------------------------------------------------------------------------------

    def check(self, cfg: LaunchConfig) -> None:
        """Check ``cfg`` against the device's and this kernel's limits and opt in to more than
        48 KiB of dynamic shared memory when needed (``cuFuncSetAttribute``
        ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``). Raises ``ValueError`` naming the
        limit. Used by `launch` (once per distinct configuration) and the graph executors."""
        dev = self.device
        a = self.attributes
        with self._lock:
            need = check_launch(
                cfg, dev.limits, kernel_name=self.name,
                kernel_max_threads=a.max_threads_per_block, static_shared=a.static_shared_bytes,
                max_dynamic_shared=self._dyn_smem, compute_capability=dev.compute_capability,
                sm_count=dev.sm_count,
                occupancy=(lambda t, s: self.occupancy(t, s)) if cfg.cooperative else None,
                non_portable_cluster=a.non_portable_cluster_size_allowed)
            if need:
                d = _drv()
                dev.make_current()
                _cu(d.cuFuncSetAttribute, self.function,
                    d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, need)
                self._dyn_smem = need

    def _dims(self, grid, block, shared_mem):
        """The checked launch dimensions of a configuration (cached per configuration), now
        remembered as the last one."""
        try:
            dims = self._plain[(grid, block, shared_mem)]
        except (KeyError, TypeError):
            dims = self._prepare_plain(grid, block, shared_mem)
        if _immutable_dims(grid, block):  # a list could change before the next launch
            self._last_dims = (grid, block, shared_mem, dims)
        return dims

    def _stream_handle(self, stream):
        """``stream``'s ``CUstream`` (a `Stream`'s handle, `ResourceClosedError` once closed;
        anything else through `_launch_handle`), an owned `Stream` remembered for the next
        launch."""
        if type(stream) is not _Stream:
            return _launch_handle(stream)
        handle = stream.handle
        live = getattr(stream, "_live", None)
        if type(live) is list:  # an owned orchestra Stream: remembered while it is open
            self._last_stream = (stream, live, handle)
        return handle

    def _prepare_plain(self, grid, block, shared_mem):
        cfg = LaunchConfig.make(grid, block, shared_mem)
        self.check(cfg)
        dims = cfg.grid + cfg.block + (cfg.shared_mem,)
        try:
            self._plain[(grid, block, shared_mem)] = dims
        except TypeError:  # unhashable (a list): checked again next time
            pass
        return dims

    def _args_address(self, args):
        if type(args) is PackedArgs:
            if args.layout is self.layout or (self.layout is not None
                                              and args.layout.params == self.layout.params):
                return args, args.address
            raise KernelArgumentTypeError(
                f"these PackedArgs were packed for {args.layout.signature}, not for"
                f" {self._need_layout().signature}")
        packed = self.pack(args)
        return packed, packed.address

    def launch(self, stream, grid, block, args, shared_mem: int = 0, **attributes) -> None:
        """``launch(stream, grid, block, args, shared_mem=0, *, cooperative=False,
        cluster=None, pdl=False, priority=None)``: enqueue the kernel on ``stream``.

        Args:
            stream: a `Stream` (its ``.handle``), a non-null ``CUstream``, or another library's
                stream with ``__cuda_stream__`` (``torch.cuda.Stream()``,
                ``cupy.cuda.Stream(non_blocking=True)``, a cuda.core stream); never a default
                stream (``torch.cuda.current_stream()`` is the legacy default stream unless a
                ``torch.cuda.stream(s)`` block is active): launch on an orchestra stream and
                order it with `orchestra.driver.order_after` / `order_before` instead.
            grid, block: int or 1-3 tuple (blocks per grid, threads per block).
            args: a sequence/mapping (validated and packed now) or `PackedArgs` from
                `pack` (reused as is: no repacking). A pointer parameter also takes an object
                with ``__dlpack__`` or ``__cuda_array_interface__`` (torch CUDA tensors, CuPy
                and numba arrays): checked by `orchestra.driver.device_view` (device,
                C-contiguous, the pointee's dtype for ``T*`` of a scalar ``T`` other than
                ``void`` / ``char`` types, writable unless the parameter is ``const T*``) and
                ordered on ``stream`` (DLPack: the producer orders its work before ``stream``;
                the CUDA Array Interface: an event on its ``stream``). The launch is
                asynchronous: as with raw pointers, the caller keeps such an object alive until
                the kernel has completed (orchestra lets go of it when ``launch`` returns).
            shared_mem: dynamic shared memory per block, bytes. Above 48 KiB the kernel is
                opted in automatically up to the device's opt-in limit.
            cooperative, cluster, pdl, priority: launch attributes (see
                `orchestra.compiler.launch`); any of them makes this a ``cuLaunchKernelEx``.

        Limits are checked before the launch (once per distinct configuration, then cached):
        ``ValueError`` names the limit exceeded; argument errors are ``TypeError``/
        ``ValueError`` naming the parameter (an unknown keyword is `KernelArgumentTypeError`);
        a driver refusal is `CudaError` naming ``cuLaunchKernel``/``cuLaunchKernelEx`` and the
        kernel.

        Host cost: launching again with the very stream (an orchestra `Stream`, open), grid,
        block and `PackedArgs` (or the very tuple of plain int / float / bool / None values) of
        the last launch without attributes makes the same ``cuLaunchKernel`` call again with
        no checks or conversions (they were made for that launch; a field rewritten with
        `PackedArgs.set` is passed as rewritten). Thread-safe: the remembered launch is one
        tuple, read and replaced whole.
        """
        # The fast path: the very args, stream, grid, block and shared_mem of the last
        # repeatable plain launch (one tuple, read atomically), the stream still open (its
        # `_live` marker): that launch's driver arguments again. The attributes arrive as
        # **attributes: keyword-only defaults would cost four dict lookups per call.
        a0, s0, g0, b0, m0, live, call = self._last_call
        if (args is a0 and stream is s0 and grid is g0 and block is b0 and shared_mem == m0
                and live and not attributes):
            (err,) = _launch(*call)
            if err:
                self._launch_failed(err)
            return None
        if attributes:
            cooperative, cluster, pdl, priority = _attributes(attributes)
            if cooperative or cluster is not None or pdl or priority is not None:
                return self._launch_ex(stream, grid, block, args, shared_mem, cooperative,
                                       cluster, pdl, priority)
        return self._launch_plain(stream, grid, block, args, shared_mem)

    def _launch_plain(self, stream, grid, block, args, shared_mem) -> None:
        """`launch` without attributes, past its fast path: the configuration checked (once
        per distinct one, then cached), the arguments packed (unless `PackedArgs`), the
        stream's handle resolved; a launch worth repeating is remembered for the fast path."""
        # The last configuration and stream are remembered as one tuple each (read
        # atomically): the same objects as last time cost identity tests, not a key tuple,
        # its hash and three property calls. A configuration is checked once
        # (`_prepare_plain`); a remembered stream's handle is used only while the stream is
        # open (`Stream._live`), so a closed Stream still raises `ResourceClosedError`.
        last = self._last_dims
        if last[0] is grid and last[1] is block and last[2] == shared_mem:
            dims = last[3]
        else:
            dims = self._dims(grid, block, shared_mem)
        views = None
        given = args
        if type(args) is PackedArgs and args.layout is self.layout:
            address = args.address
            repeatable = True  # its struct stays where it is: a rewritten field is passed
        else:
            packed = self._packed_tuple(args)
            repeatable = packed is not None  # immutable values: packing them again is alike
            if repeatable:
                args, address = packed, packed.address
            else:
                try:
                    args, address = self._args_address(args)
                    repeatable = args is given  # PackedArgs of an equal layout
                except ArgumentNeedsStreamError:  # a torch / CuPy array: ordered on the stream
                    args, address, views = self._interop_args(args, stream)
        ls = self._last_stream
        if ls[0] is stream and ls[1]:  # ls[1]: the Stream's open marker, emptied at close
            handle = ls[2]
        else:
            handle = self._stream_handle(stream)
        gx, gy, gz, bx, by, bz, smem = dims
        call = (self.function, gx, gy, gz, bx, by, bz, smem, handle, address, 0)
        if views is None:
            (err,) = _launch(*call)
        else:
            try:
                (err,) = _launch(*call)
            finally:
                _release_all(views)
        if err:
            self._launch_failed(err)
        ls = self._last_stream
        # an orchestra Stream (remembered while it is open), immutable dimensions
        if repeatable and ls[0] is stream and _immutable_dims(grid, block):
            self._last_call = (given, stream, grid, block, shared_mem, ls[1], call)
        return None

    def _packed_tuple(self, args):
        """The `PackedArgs` packed for ``args`` before when ``args`` is the very tuple of plain
        scalars (int, float, bool, None) of the last plain launch: immutable, so it packs to
        the same bytes; None otherwise (pack it)."""
        if type(args) is not tuple:
            return None
        memo = self._tuple_memo
        if memo[0] is args:
            return memo[1]
        for v in args:
            if type(v) not in _PLAIN:
                return None
        packed = self.pack(args)
        self._tuple_memo = (args, packed)
        return packed

    def _launch_failed(self, err):
        from orchestra.driver.check import error_from_result

        raise error_from_result("cuLaunchKernel", err, context=f"kernel {self.name}")

    def _interop_args(self, args, stream):
        """Pack ``args`` whose pointer arguments include DLPack / CUDA Array Interface objects:
        each becomes a checked `ExternalArray` ordered on ``stream``; returns ``(PackedArgs,
        address, views)``. On an error every view taken so far is released."""
        from orchestra.compiler.args import speaks_device_protocol
        from orchestra.driver.interop import device_view

        layout = self._need_layout()
        values = list(layout.ordered(args))
        if type(stream) is not _Stream:  # refuse a stream that cannot take the launch before
            _launch_handle(stream)        # any producer orders its work on it
        consumer = _order_stream(stream, self.device)
        specs = self._pointer_specs
        if specs is None:  # per pointer parameter: (index, pointee dtype, writable, label)
            specs = self._pointer_specs = tuple(
                (i, pointee_dtype(p.ctype), not p.const,
                 f"kernel {self.name}: parameter {p.name} ({p.ctype})")
                for i, p in enumerate(layout.params) if p.kind == "pointer")
        views = []
        try:
            for i, dtype, writable, label in specs:
                v = values[i]
                if speaks_device_protocol(v) and not hasattr(type(v), "ptr"):
                    view = device_view(v, stream=consumer, device=self.device, dtype=dtype,
                                       writable=writable, what=label)
                    views.append(view)
                    values[i] = view.ptr
            packed = layout.pack(values)
        except BaseException:
            _release_all(views)
            raise
        return packed, packed.address, views

    def launch_config(self, grid, block, shared_mem: int = 0, *, cooperative=False,
                      cluster=None, pdl=False, priority=None) -> LaunchConfig:
        """A checked `LaunchConfig` (for graph kernel nodes): same checks as `launch`."""
        cfg = LaunchConfig.make(grid, block, shared_mem, cooperative=cooperative,
                                cluster=cluster, pdl=pdl, priority=priority)
        self.check(cfg)
        return cfg

    def _launch_ex(self, stream, grid, block, args, shared_mem, cooperative, cluster, pdl,
                   priority):
        handle = stream.handle if type(stream) is _Stream else _launch_handle(stream)
        key = (grid, block, shared_mem, cooperative, cluster, pdl, priority)
        # The CUlaunchConfig (dims, stream, attribute list) is built once per configuration and
        # stream and reused: building it costs several microseconds, as much as the launch.
        try:
            config = self._ex[key, int(handle)]
        except (KeyError, TypeError):
            config = self._prepare_ex(key, handle)
        views = None
        if type(args) is PackedArgs and args.layout is self.layout:
            address = args.address
        else:
            try:
                args, address = self._args_address(args)
            except ArgumentNeedsStreamError:
                args, address, views = self._interop_args(args, stream)
        try:
            (err,) = _drv().cuLaunchKernelEx(config, self.function, address, 0)
        finally:
            if views:
                _release_all(views)
        if err:
            from orchestra.driver.check import error_from_result

            raise error_from_result("cuLaunchKernelEx", err, context=f"kernel {self.name}")

    def _prepare_ex(self, key, handle):
        grid, block, shared_mem, cooperative, cluster, pdl, priority = key
        cfg = self.launch_config(grid, block, shared_mem, cooperative=cooperative,
                                 cluster=cluster, pdl=pdl, priority=priority)
        config = build_launch_config(cfg, handle)
        try:
            if len(self._ex) >= 256:  # many streams or shapes: start over rather than grow
                self._ex.clear()
            self._ex[key, int(handle)] = config
        except TypeError:  # unhashable (a list): checked and built again next time
            pass
        return config

    def __repr__(self) -> str:
        sig = self.layout.signature if self.layout is not None else f"{self.name}(?)"
        return f"<Kernel {sig} on device {self.device.ordinal}>"


# cuLaunchKernel bound once at import: one attribute lookup less per launch.
from cuda.bindings.driver import cuLaunchKernel as _launch  # noqa: E402

from orchestra.driver.stream import Stream as _Stream  # noqa: E402  (the launch fast path)


_ATTRIBUTES = ("cooperative", "cluster", "pdl", "priority")


def _attributes(given: dict) -> tuple:
    """``(cooperative, cluster, pdl, priority)`` from `Kernel.launch`'s keyword arguments
    (defaults False, None, False, None); `KernelArgumentTypeError` for any other keyword."""
    unknown = [k for k in given if k not in _ATTRIBUTES]
    if unknown:
        raise KernelArgumentTypeError(
            f"Kernel.launch() got an unexpected keyword argument {unknown[0]!r}; its launch "
            f"attributes are {', '.join(_ATTRIBUTES)}")
    get = given.get
    return get("cooperative", False), get("cluster"), get("pdl", False), get("priority")


def _launch_signature():
    """`Kernel.launch`'s documented signature (its attributes keyword-only), for help() and
    inspect: the function itself takes them as ``**attributes``."""
    import inspect

    P = inspect.Parameter
    pos = [P(n, P.POSITIONAL_OR_KEYWORD) for n in ("self", "stream", "grid", "block", "args")]
    pos.append(P("shared_mem", P.POSITIONAL_OR_KEYWORD, default=0, annotation=int))
    kw = [P(n, P.KEYWORD_ONLY, default=d)
          for n, d in zip(_ATTRIBUTES, (False, None, False, None))]
    return inspect.Signature(pos + kw, return_annotation=None)


Kernel.launch.__signature__ = _launch_signature()  # type: ignore[attr-defined]

_PLAIN = frozenset({int, float, bool, type(None)})  # immutable scalars: a tuple of them packs alike


def _immutable_dims(grid, block) -> bool:
    """True for a grid and block given as ints or tuples of ints (a list could change between
    launches: its identity says nothing about its values)."""
    for d in (grid, block):
        if type(d) is not int and (type(d) is not tuple or any(type(x) is not int for x in d)):
            return False
    return True


def _release_all(views) -> None:
    for view in views:
        view.release()


_BYTE_POINTEES = frozenset({"void", "char", "signed char", "unsigned char", "int8_t",
                            "uint8_t"})


def pointee_dtype(ctype: str):
    """The numpy dtype a ``T*`` parameter points to, for the dtype check of protocol
    arguments: None (any dtype) for ``void*``, the ``char`` / byte types (raw bytes), pointers to
    pointers and types orchestra does not know (``__half*``, structs)."""
    import numpy as np

    from orchestra.compiler.params import SCALAR_TYPES

    base = ctype.strip()
    if not base.endswith("*") or base[:-1].rstrip().endswith("*"):
        return None
    base = base[:-1].strip()
    if base.startswith("const "):
        base = base[6:].strip()
    if base in _BYTE_POINTEES or base not in SCALAR_TYPES:
        return None
    return np.dtype(SCALAR_TYPES[base][0])


def _order_stream(stream, device):
    """``stream`` as something `device_view` orders on: an orchestra stream as is, another
    library's stream (``__cuda_stream__``), a ``CUstream`` or an object with ``.handle``
    wrapped without being owned."""
    from orchestra.driver.stream import DefaultStream, Stream

    if isinstance(stream, (Stream, DefaultStream)):
        return stream
    if hasattr(type(stream), "__cuda_stream__"):
        return Stream.from_handle(stream, device)  # keeps the framework's stream object alive
    return Stream.from_handle(_launch_handle(stream), device)


def _launch_handle(stream):
    """The ``CUstream`` to launch on for anything but an orchestra `Stream`: an object with
    ``__cuda_stream__`` (torch, CuPy, cuda.core, numba streams; read first, so a default stream
    is recognized whatever else the object has), an object with ``.handle`` (an external
    `Stream` wrapper; a `DefaultStream` refuses there), or a non-null ``CUstream``. Default
    streams are refused with `DriverArgumentValueError` saying to order instead; anything else
    with `DriverArgumentTypeError`."""
    if hasattr(type(stream), "__cuda_stream__"):
        from orchestra.driver.stream import DEFAULT_HANDLES, ORDERING_ONLY, stream_value

        value = stream_value(stream)
        if value in DEFAULT_HANDLES:
            raise DriverArgumentValueError(
                f"launch: the {type(stream).__name__} is the "
                f"{'per-thread' if value == 2 else 'legacy'} default stream (handle {value}); "
                + ORDERING_ONLY)
        return _drv().CUstream(value)
    handle = getattr(stream, "handle", None)
    if handle is not None:
        return handle
    return _raw_stream(stream)


def _raw_stream(stream):
    """Accept a raw ``CUstream`` (not the legacy/NULL stream); refuse everything else."""
    if stream is None:
        raise DriverArgumentValueError(
            "launch needs a Stream: orchestra never enqueues on the legacy default"
            " stream (pass a Stream(device) created non-blocking)")
    if type(stream).__name__ == "CUstream":
        if int(stream) == 0:
            raise DriverArgumentValueError(
                "CUstream 0 is the legacy default stream: pass a Stream instead")
        if int(stream) in (1, 2):  # CU_STREAM_LEGACY, CU_STREAM_PER_THREAD
            from orchestra.driver.stream import ORDERING_ONLY

            raise DriverArgumentValueError(
                f"CUstream {int(stream)} is a default stream: " + ORDERING_ONLY)
        return stream
    raise DriverArgumentTypeError(f"launch needs a Stream (with .handle) or a CUstream, got"
                                  f" {type(stream).__name__}")


class KernelAttributes:
    """A kernel's attributes (``cuFuncGetAttribute``).

    ``num_regs`` (registers per thread), ``static_shared_bytes``, ``max_threads_per_block``,
    ``local_bytes`` (per thread), ``const_bytes``, ``max_dynamic_shared_bytes`` (current
    opt-in), ``ptx_version`` and ``binary_version`` (major*10+minor),
    ``non_portable_cluster_size_allowed``.

    Thread-safety: plain values set once, when queried (``cuFuncGetAttribute``), and never changed
    by orchestra: may be shared between threads (do not assign to its fields).
    """

    __slots__ = ("num_regs", "static_shared_bytes", "max_threads_per_block", "local_bytes",
                 "const_bytes", "max_dynamic_shared_bytes", "ptx_version", "binary_version",
                 "non_portable_cluster_size_allowed")
    num_regs: int
    static_shared_bytes: int
    max_threads_per_block: int
    local_bytes: int
    const_bytes: int
    max_dynamic_shared_bytes: int
    ptx_version: int
    binary_version: int
    non_portable_cluster_size_allowed: bool

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw[k])

    @classmethod
    def query(cls, function) -> "KernelAttributes":
        d = _drv()
        A = d.CUfunction_attribute

        def get(attr, default=None):
            try:
                return int(_cu(d.cuFuncGetAttribute, attr, function))
            except CudaError:
                if default is None:
                    raise
                return default

        return cls(
            num_regs=get(A.CU_FUNC_ATTRIBUTE_NUM_REGS),
            static_shared_bytes=get(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
            max_threads_per_block=get(A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            local_bytes=get(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
            const_bytes=get(A.CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES),
            max_dynamic_shared_bytes=get(A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES),
            ptx_version=get(A.CU_FUNC_ATTRIBUTE_PTX_VERSION, 0),
            binary_version=get(A.CU_FUNC_ATTRIBUTE_BINARY_VERSION, 0),
            non_portable_cluster_size_allowed=bool(
                get(A.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 0)),
        )

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}

    def __repr__(self) -> str:
        return "KernelAttributes(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) \
            + ")"


_memo_lock = threading.Lock()
_modules: dict = {}


def load_kernel(path_or_source, name: str, *, name_expression=None, options=(), params=None,
                device=None, include_dirs=()) -> Kernel:
    """Compile (cached), load and look up one kernel; memoized per (device, cache key).

    Args:
        path_or_source: a ``.cu`` file (a bare name is looked up in ``cuda_src/``), CUDA C++
            text, or a ``.ptx`` file / PTX text (linked with nvJitLink for the device's arch).
        name: the kernel's name (``extern "C"``), or any label when ``name_expression`` is
            given.
        name_expression: for C++ (templated, namespaced) kernels, e.g. ``"scale<float>"``;
            needs ``params=``.
        options: extra NVRTC options.
        params: explicit parameter types; default: parsed from the source.
        device: a `Device`, an ordinal or None (device 0).

    Returns a `Kernel`. Raises what `compile`, `Module.load` and `Module.kernel` raise.
    """
    as_device, _ = _device_api()
    dev = as_device(device)
    explicit = None if params is None else normalize_params(params)
    ptx_input = False
    if isinstance(path_or_source, (bytes, bytearray)):
        ptx_input = is_ptx(bytes(path_or_source))
    elif isinstance(path_or_source, (str, os.PathLike)):
        s = os.fspath(path_or_source)
        ptx_input = s.endswith(".ptx") or (isinstance(path_or_source, str) and "\n" in s
                                            and is_ptx(s))
    if ptx_input:
        cubin = link_ptx(path_or_source, arch=dev.arch)
        import hashlib

        memo_key: tuple[Any, ...] = (dev.ordinal, "ptx", hashlib.sha256(cubin).hexdigest())
        with _memo_lock:
            module = _modules.get(memo_key)
            if module is None or module.closed:
                module = _modules[memo_key] = Module.load(cubin, dev)
        return module.kernel(name, params=explicit)

    exprs = (name_expression,) if name_expression else ()
    job = prepare_compile(path_or_source, arch=dev.arch, options=options,
                          name_expressions=exprs, include_dirs=include_dirs)
    memo_key = (dev.ordinal, job.key)
    with _memo_lock:
        module = _modules.get(memo_key)
        if module is None or module.closed:
            result = job.run()
            module = _modules[memo_key] = Module.load(result, dev, source=job.source.text)
    if name_expression:
        if explicit is None:
            explicit = _params_for_expression(job.source.text, name_expression)
        return module.kernel(name_expression, params=explicit)
    return module.kernel(name, params=explicit)


def _params_for_expression(source: str, expr: str):
    """Parameters for a name expression naming a non-template kernel (``ns::k``/``&k``);
    None (explicit params needed) for templates."""
    base = expr.strip().lstrip("&").strip()
    if "<" in base:
        return None
    short = base.split("::")[-1]
    try:
        return parse_params(source, short)
    except ValueError:
        return None


def clear_memo() -> None:
    """Forget every memoized module of `load_kernel` (they stay loaded while referenced)."""
    with _memo_lock:
        _modules.clear()


__all__ = ["Kernel", "KernelAttributes", "KernelNotFoundError", "Module", "clear_memo",
           "driver_version", "load_kernel"]
