"""A snapshot of a train state in host memory that is allocated once and reused by every save.

A background save (runner.session.background) must not read the live tensors: the loop's next
optimizer step changes them in place. So the loop copies the state into host buffers at the
step boundary (the only part of a save it waits for) and the saver writes the copies.

- Buffers are keyed by where a tensor sits in the state (its path of dict keys / list
  indices) and reused while its storage's size stays the same: after the first save a
  snapshot allocates nothing, and the host memory stays at the size of the state's tensors.
- Tensors that share storage (a tied embedding and output layer, views) are copied once,
  into one buffer, and stay shared in the snapshot as they are in the state.
- A CUDA tensor goes to page-locked memory: a buffer of exactly its size registered with the
  driver (torch's pinned allocator would round each block up to a power of two, up to twice
  the state) and a non-blocking copy on a side stream of its device that first waits for
  that device's current stream; one synchronisation per device ends the snapshot, so the
  copies overlap each other and the loop waits once.
- A DTensor (FSDP2's shard) is copied as its local shard and rebuilt as a DTensor with the
  same spec around the host buffer (not `from_local`, which would move it back to the mesh's
  device), so DCP plans and writes the same chunks it would from the live one.
- Anything else that is not a plain dense tensor (sparse, conjugate or negative views, tensor
  subclasses) gets a fresh CPU copy of its own, not a buffer; containers (dicts, lists,
  tuples) are rebuilt, immutable scalars kept and any other object deep-copied, so the
  snapshot is the state at this step even when the loop later mutates it in place.

At most one snapshot is alive at a time: the caller (one save in flight) must be done with
the previous snapshot before taking the next, since it overwrites the same buffers.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

log = logging.getLogger(__name__)

Path = tuple[Hashable, ...]
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


class _Buffer:
    """One host buffer: `size` bytes, page-locked (registered with CUDA) when `pinned`."""

    def __init__(self, size: int, *, pinned: bool) -> None:
        self.tensor = torch.empty(size, dtype=torch.uint8)
        self.wants_pin = pinned
        self.pinned = pinned and size > 0 and _register(self.tensor)

    def release(self) -> None:
        if self.pinned:
            _unregister(self.tensor)
            self.pinned = False


class HostBuffers:
    """Reusable host memory for snapshots of one train state (see the module doc)."""

    def __init__(self) -> None:
        self._buffers: dict[Path, _Buffer] = {}
        self._side_streams: dict[torch.device, Any] = {}  # CUDA device -> its copy stream

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers now."""
        return sum(buffer.tensor.numel() for buffer in self._buffers.values())

    def snapshot(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in this object's host buffers."""
        copier = _Copier(self)
        try:
            copied = copier.copy(state, ())
        finally:
            copier.finish()  # even after a failure: no copy may still be landing
        # a tensor that left the state (fewer params, a cleared optimizer) frees its buffer
        for path in set(self._buffers) - copier.used:
            self._buffers.pop(path).release()
        return copied

    def release(self) -> None:
        """Free every buffer (at exit; a later snapshot allocates them again)."""
        for buffer in self._buffers.values():
            buffer.release()
        self._buffers.clear()
        self._side_streams.clear()

    def buffer(self, path: Path, size: int, *, pinned: bool) -> torch.Tensor:
        held = self._buffers.get(path)
        if held is None or held.tensor.numel() != size or held.wants_pin != pinned:
            if held is not None:
                held.release()
            held = _Buffer(size, pinned=pinned)
            if pinned and size and not held.pinned:
                log.warning("could not page-lock %d bytes of host memory: copying unpinned", size)
            self._buffers[path] = held
        return held.tensor

    def side_stream(self, device: torch.device) -> Any:
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device=device)
        return stream


class _Copier:
    """One snapshot pass: walks the state, copying each tensor into its buffer."""

    def __init__(self, buffers: HostBuffers) -> None:
        self._buffers = buffers
        self.used: set[Path] = set()
        # storage already copied in this pass: (device, data pointer) -> its host storage
        self._copied: dict[tuple[str, int], Any] = {}
        self._streams: dict[torch.device, Any] = {}  # CUDA devices copied from in this pass

    def copy(self, value: Any, path: Path) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, dict):
            return _same_mapping(value, {k: self.copy(v, (*path, k)) for k, v in value.items()})
        if isinstance(value, list):
            return [self.copy(item, (*path, i)) for i, item in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self.copy(item, (*path, i)) for i, item in enumerate(value))
        if isinstance(value, _IMMUTABLE):
            return value
        return copy.deepcopy(value)  # an object of the caller's: the loop may change it

    def finish(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()  # the one wait per device: every copy has landed

    def _tensor(self, tensor: torch.Tensor, path: Path) -> torch.Tensor:
        if hasattr(tensor, "device_mesh"):  # a DTensor (imported only when there is one)
            from torch.distributed.tensor import DTensor

            assert isinstance(tensor, DTensor)
            local = self._tensor(tensor.to_local(), path)
            # the same spec (mesh, placements, global shape) around the host shard
            return DTensor(local, tensor._spec, requires_grad=False)
        if not _plain(tensor):
            return tensor.detach().to("cpu", copy=True)
        return self._plain(tensor.detach(), path)

    def _plain(self, tensor: torch.Tensor, path: Path) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        host_storage: Any = self._copied.get(key) if storage.nbytes() else None
        if host_storage is None:
            host_storage = self._copy_storage(storage, tensor.device, path)
            if storage.nbytes():
                self._copied[key] = host_storage
        # the same view of the host copy as `tensor` is of its storage (offset, shape, stride)
        view = torch.empty(0, dtype=tensor.dtype)
        view.set_(host_storage, tensor.storage_offset(), tensor.shape, tensor.stride())
        return view

    def _copy_storage(self, storage: Any, device: torch.device, path: Path) -> Any:
        """The whole storage behind a tensor into its buffer (a view copies its base once)."""
        self.used.add(path)
        size = storage.nbytes()
        on_cuda = device.type == "cuda"
        buffer = self._buffers.buffer(path, size, pinned=on_cuda)
        source = torch.empty(0, dtype=torch.uint8, device=device)
        source.set_(storage, 0, (size,), (1,))
        if on_cuda:
            stream = self._stream(device)
            with torch.cuda.stream(stream):
                buffer.copy_(source, non_blocking=True)
        else:
            buffer.copy_(source)
        return buffer.untyped_storage()

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self._buffers.side_stream(device)
            # the side stream copies what this device's compute stream has finished writing
            stream.wait_stream(torch.cuda.current_stream(device))
        return stream


def _plain(tensor: torch.Tensor) -> bool:
    """A dense, strided tensor of torch's own type whose bytes are its values."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _same_mapping(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """`items` as the kind of mapping `original` is: a module's state_dict is an OrderedDict
    whose `_metadata` (per-module versions) load_state_dict reads and torch.save writes."""
    if type(original) is dict:
        return items
    rebuilt = type(original)(items) if isinstance(original, OrderedDict) else dict(items)
    metadata = getattr(original, "_metadata", None)
    if metadata is not None:
        rebuilt._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
    return rebuilt


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer` for the CUDA driver (exactly its size); False when it refuses."""
    code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1)
    return int(code) == 0  # 1: portable (any device); nonzero: a cudaError, stay pageable


def _unregister(buffer: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    if code != 0:
        log.warning("could not release page-locked host memory (cudaError %d)", code)
