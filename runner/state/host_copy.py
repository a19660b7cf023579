"""A snapshot of a train state in host memory that is allocated once and reused by every save.

A background save (runner.session.background) must not read the live tensors: the loop's next
optimizer step changes them in place. So the loop copies the state into host buffers at the
step boundary (the only part of a save it waits for) and the saver writes the copies.

- Buffers are keyed by where a tensor sits in the state (its path of dict keys / list
  indices) and reused while shape, dtype and layout stay the same: after the first save a
  snapshot allocates nothing, and the host memory stays at the size of the state's tensors.
- Tensors that share storage (a tied embedding and output layer, views) are copied once,
  into one buffer, and stay shared in the snapshot as they are in the state.
- A CUDA tensor goes to pinned memory with a non-blocking copy issued on a side stream that
  first waits for the compute stream; one synchronisation of that stream ends the snapshot,
  so the copies overlap each other and the loop waits once.
- A DTensor (FSDP2's shard) is copied as its local shard and rebuilt as a DTensor around the
  host buffer, same mesh and placements, so DCP writes the same chunks it would write from
  the live one.
- Everything that is not a tensor is rebuilt (dicts, lists, tuples) or kept (immutable
  scalars), so the snapshot is the state at this step even when the loop later mutates a
  container in place.

At most one snapshot is alive at a time: the caller (one save in flight) must be done with
the previous snapshot before taking the next, since it overwrites the same buffers.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

Path = tuple[Hashable, ...]


class HostBuffers:
    """Reusable host memory for snapshots of one train state (see the module doc)."""

    def __init__(self) -> None:
        self._buffers: dict[Path, tuple[torch.Tensor, bool]] = {}  # path -> (bytes, pinned)
        self._side_stream: Any = None  # torch.cuda.Stream, made on the first CUDA copy

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers now."""
        return sum(buffer.numel() for buffer, _ in self._buffers.values())

    def snapshot(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in this object's host buffers."""
        copier = _Copier(self._buffers, self._stream_for(state))
        copied = copier.copy(state, ())
        copier.finish()
        # a tensor that left the state (fewer params, a cleared optimizer) frees its buffer
        for path in set(self._buffers) - copier.used:
            del self._buffers[path]
        return copied

    def release(self) -> None:
        """Free every buffer (at exit; a later snapshot allocates them again)."""
        self._buffers.clear()
        self._side_stream = None

    def _stream_for(self, state: Any) -> Any:
        if not _has_cuda_tensor(state):
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        return self._side_stream


class _Copier:
    """One snapshot pass: walks the state, copying each tensor into its buffer."""

    def __init__(self, buffers: dict[Path, tuple[torch.Tensor, bool]], stream: Any) -> None:
        self._buffers = buffers
        self._stream = stream
        self.used: set[Path] = set()
        # storage already copied in this pass: (device, data pointer)
        self._copied: dict[tuple[str, int], Any] = {}  # -> the host UntypedStorage
        if stream is not None:
            # the side stream copies what the compute stream has finished writing
            stream.wait_stream(torch.cuda.current_stream())

    def copy(self, value: Any, path: Path) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, dict):
            return _same_mapping(value, {k: self.copy(v, (*path, k)) for k, v in value.items()})
        if isinstance(value, list):
            return [self.copy(item, (*path, i)) for i, item in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self.copy(item, (*path, i)) for i, item in enumerate(value))
        return value  # ints, floats, strings, None: immutable

    def finish(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()  # the one wait: every copy has landed

    def _tensor(self, tensor: torch.Tensor, path: Path) -> torch.Tensor:
        if hasattr(tensor, "device_mesh"):  # a DTensor (imported only when there is one)
            from torch.distributed.tensor import DTensor

            assert isinstance(tensor, DTensor)
            local = self._plain(tensor.to_local(), path)
            return DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        return self._plain(tensor, path)

    def _plain(self, tensor: torch.Tensor, path: Path) -> torch.Tensor:
        tensor = tensor.detach()
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
        pinned = device.type == "cuda"
        held = self._buffers.get(path)
        if held is not None and held[0].numel() == size and held[1] == pinned:
            buffer = held[0]
        else:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            self._buffers[path] = (buffer, pinned)
        source = torch.empty(0, dtype=torch.uint8, device=device)
        source.set_(storage, 0, (size,), (1,))
        if self._stream is not None and device.type == "cuda":
            with torch.cuda.stream(self._stream):
                buffer.copy_(source, non_blocking=True)
                # the live storage must outlive the copy: the allocator is told it is in use
                source.record_stream(self._stream)
        else:
            buffer.copy_(source)
        return buffer.untyped_storage()


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


def _has_cuda_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cuda"  # a DTensor's device is its local shard's
    if isinstance(value, dict):
        return any(_has_cuda_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_cuda_tensor(item) for item in value)
    return False
