"""Live-tensor byte accounting for CPU runs, where there is no caching allocator to ask.

``LiveTensorTracker`` is a ``TorchDispatchMode``: every op's output tensors are accounted
by their *untyped storage* (so views, reshapes and in-place results are not counted twice),
and a ``weakref.finalize`` on that storage takes the bytes off again the moment the last
tensor using it dies. It reports the bytes currently live and the peak, both counting only
storages created while the tracker was active (plus any ``track``-ed explicitly): inputs
and parameters created before are the baseline, not counted.

Usage::

    with LiveTensorTracker() as mem:
        y = layer(x)
        fwd_peak = mem.peak_bytes
        mem.reset_peak()
        y.backward(g)
    print(fwd_peak, mem.peak_bytes, mem.current_bytes)

Collectives write into tensors the caller allocated, so they are counted; memory a kernel
allocates internally and frees before returning (workspace) is not visible, exactly like a
fused kernel's on-chip scratch. The autograd engine propagates the mode to backward ops.

``StepTracker`` extends it to a training step of a sharded model (the rank emulator's
tracker): only the compute device's tensors, storages FSDP2 resizes behind the dispatcher
re-measured, offloaded host bytes subtracted. ``storage_bytes`` counts the distinct
storages behind a set of tensors (the state: parameters, gradients, optimizer moments).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The real tensors behind ``t``: a DTensor's local shard, any wrapper subclass's inner
    tensors (a wrapper's own ``untyped_storage()`` reports the global size)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                yield from plain_tensors(inner)
    else:
        yield t


@dataclass
class PeakRecord:
    bytes: int = 0
    op: str = ""
    """The op whose output set the peak (where in the computation it happened)."""


@dataclass
class _StorageEntry:
    nbytes: int
    finalizer: weakref.finalize = field(repr=False)


class LiveTensorTracker(TorchDispatchMode):
    """Current and peak bytes of live tensor storages created under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._storages: dict[int, _StorageEntry] = {}
        self.current_bytes = 0
        self.peak = PeakRecord()

    @property
    def peak_bytes(self) -> int:
        return self.peak.bytes

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (e.g. between forward and backward)."""
        with self._lock:
            self.peak = PeakRecord(self.current_bytes, "reset")

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors created outside the mode (e.g. inputs) from now on."""
        for t in tensors:
            self._account(t, "track")

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages.pop(key, None)
            if entry is not None:
                self.current_bytes -= entry.nbytes

    def _account(self, t: torch.Tensor, op: str, input_storages: frozenset[int] = frozenset()) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage._cdata  # the C++ StorageImpl, unique while it is alive
        nbytes = storage.nbytes()
        with self._lock:
            entry = self._storages.get(key)
            if entry is None and key in input_storages:
                return  # a view of (or in-place op on) memory that existed before: baseline
            if entry is None:
                finalizer = weakref.finalize(storage, self._release, key)
                finalizer.atexit = False
                self._storages[key] = _StorageEntry(nbytes, finalizer)
                self.current_bytes += nbytes
            elif entry.nbytes != nbytes:  # resized in place (out= ops, resize_)
                self.current_bytes += nbytes - entry.nbytes
                entry.nbytes = nbytes
            if self.current_bytes > self.peak.bytes:
                self.peak = PeakRecord(self.current_bytes, op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Outputs sharing an input's storage (views, in-place, out=) allocate nothing new.
        input_storages = frozenset(
            plain.untyped_storage()._cdata for leaf in tree_leaves((args, kwargs))
            if isinstance(leaf, torch.Tensor) for plain in plain_tensors(leaf) if plain.device.type != "meta"
        )
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for plain in plain_tensors(leaf):
                    self._account(plain, name, input_storages)
        return out


class StepTracker(LiveTensorTracker):
    """``LiveTensorTracker`` for a training step of a sharded model.

    * Wrapper subclasses (DTensor) are accounted by their local tensors, as in the base class.
    * Storages resized in place without an op (FSDP2 frees and re-allocates unsharded
      parameters and all-gather buffers with ``untyped_storage().resize_()``, which no
      dispatch mode sees) are re-measured: those an op touches, at that op; all of them
      before a new peak is recorded and when ``refresh()`` is called.
    * Only tensors on ``device_type`` are accounted (on CUDA the host copies of offloaded
      activations and CPU scalars are not device memory).
    * ``host_bytes()`` (bytes of tracked tensors that are really host memory, i.e. offloaded
      block inputs on CPU) is subtracted from every reading.
    """

    def __init__(self, device_type: str, host_bytes: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.host_bytes = host_bytes or (lambda: 0)
        self.device_peak = 0
        self.device_peak_op = ""

    def _resync(self, keys) -> None:
        """Re-read the sizes of these tracked storages. The storages are fetched under the lock
        but measured, and let go, outside it: dropping the last reference runs ``_release``,
        which takes the (non-reentrant) lock."""
        found, alive = [], None
        with self._lock:
            for key in keys:
                entry = self._storages.get(key)
                alive = entry.finalizer.peek() if entry is not None else None
                if alive is not None:
                    found.append((key, alive[0]))
            del alive
        sizes = [(key, storage.nbytes()) for key, storage in found]
        del found
        with self._lock:
            for key, nbytes in sizes:
                entry = self._storages.get(key)
                if entry is not None and entry.nbytes != nbytes:
                    self.current_bytes += nbytes - entry.nbytes
                    entry.nbytes = nbytes

    def refresh(self) -> None:
        """Re-measure every tracked storage (sizes changed by ``resize_`` outside any op)."""
        with self._lock:
            keys = list(self._storages)
        self._resync(keys)

    def device_bytes(self) -> int:
        return self.current_bytes - self.host_bytes()

    def reset_peak(self) -> None:
        self.refresh()
        super().reset_peak()
        self.device_peak, self.device_peak_op = self.device_bytes(), "reset"

    @property
    def peak_bytes(self) -> int:
        return self.device_peak

    def _account(self, t: torch.Tensor, op: str, input_storages: frozenset[int] = frozenset()) -> None:
        super()._account(t, op, input_storages)
        if self.device_bytes() > self.device_peak:
            self.refresh()  # a storage freed by resize_(0) since the last op must not set a peak
            if self.device_bytes() > self.device_peak:
                self.device_peak, self.device_peak_op = self.device_bytes(), op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [plain for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)
                  for plain in plain_tensors(leaf) if plain.device.type != "meta"]
        input_storages = frozenset(plain.untyped_storage()._cdata for plain in inputs)
        self._resync(input_storages)  # re-allocated by resize_ before this op used them
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for plain in plain_tensors(leaf):
                    if plain.device.type == self.device_type:
                        self._account(plain, name, input_storages)
        return out


def storage_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for plain in plain_tensors(t):
            if plain.device.type == "meta":
                continue
            storage = plain.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def mib(n_bytes: int) -> float:
    return n_bytes / 2**20
