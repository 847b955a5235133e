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
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
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


def mib(n_bytes: int) -> float:
    return n_bytes / 2**20
