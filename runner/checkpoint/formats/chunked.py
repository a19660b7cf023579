"""Chunked layout (format `torch-chunked`): one process's state split into size-limited
files, for states too big for one file. Not per-rank shards: every chunk belongs to the same
state, and any process can load the whole.

    skeleton.pt          the state with every tensor replaced by {"__runner_tensor__": key}
    chunk_00000.pt ...   torch files mapping tensor keys to tensors, each at most ~chunk_bytes
                         (a single larger tensor gets a chunk of its own)
    index.json           {"schema": "2", "skeleton", "chunks": [{path, size, sha256, tensors}]}

Every file is written atomically and listed in the manifest; the index repeats each chunk's
sha256 and says which tensors it holds, so a chunk can be checked and loaded on its own.
Tensor keys are the tensor's path in the state ("model/fc.weight", "optimizer/state/0/exp_avg").

Index schema "1" (manifest schema 2, format `torch-sharded`) named the list "shards" and its
files `shard_NNNNN.pt`; it is read as is (the files are where its index says).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runner.checkpoint.manifest import check_relative_path
from runner.errors import IntegrityError

if TYPE_CHECKING:
    from runner.checkpoint.staging import Staging

INDEX_NAME = "index.json"
SKELETON_NAME = "skeleton.pt"
INDEX_SCHEMA = "2"
# index schema -> the key of its list of chunk files ("1": the torch-sharded layout)
_CHUNK_LISTS = {"1": "shards", INDEX_SCHEMA: "chunks"}
_MARKER = "__runner_tensor__"


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data in a nested state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _like(original: dict[Any, Any], items: dict[Any, Any]) -> dict[Any, Any]:
    """Keep an OrderedDict an OrderedDict, with the module versions state_dict() attaches."""
    if not isinstance(original, OrderedDict):
        return items
    result: OrderedDict[Any, Any] = OrderedDict(items)
    metadata = getattr(original, "_metadata", None)
    if metadata is not None:
        result._metadata = metadata  # type: ignore[attr-defined]
    return result


def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Copy of the structure with tensors replaced by markers; tensors collected by path."""
    if isinstance(obj, torch.Tensor):
        key = path or "."
        while key in tensors:  # a key containing "/" could collide with a nested path
            key += "'"
        tensors[key] = obj
        return {_MARKER: key}
    if isinstance(obj, dict):
        out = {k: _split(v, f"{path}/{k}" if path else str(k), tensors) for k, v in obj.items()}
        return _like(obj, out)
    if isinstance(obj, list | tuple):
        items = [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor], *, source: str) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_MARKER}:
            key = obj[_MARKER]
            if key not in tensors:
                raise IntegrityError(f"{source}: tensor {key!r} is in no chunk")
            return tensors[key]
        return _like(obj, {k: _join(v, tensors, source=source) for k, v in obj.items()})
    if isinstance(obj, list):
        return [_join(v, tensors, source=source) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_join(v, tensors, source=source) for v in obj)
    return obj


def write_chunked(stage: Staging, state: dict[str, Any], *, chunk_bytes: int) -> None:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "", tensors)
    groups: list[list[str]] = [[]]
    filled = 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if groups[-1] and filled + size > chunk_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(key)
        filled += size
    chunks = []
    for i, keys in enumerate(groups):
        entry = stage.write_torch(f"chunk_{i:05d}.pt", {k: tensors[k] for k in keys})
        chunks.append(
            {"path": entry.path, "size": entry.size, "sha256": entry.sha256, "tensors": keys}
        )
    stage.write_torch(SKELETON_NAME, skeleton)
    index = {"schema": INDEX_SCHEMA, "skeleton": SKELETON_NAME, "chunks": chunks}
    stage.write_bytes(INDEX_NAME, (json.dumps(index, indent=1) + "\n").encode())


def read_chunked(
    step_dir: Path, *, listed: dict[str, tuple[int, str]], mmap: bool = False
) -> dict[str, Any]:
    """Load a chunked state whose files the caller has already verified against the manifest
    (`listed`: path -> (size, sha256)). The index must agree with the manifest."""
    source = f"{step_dir}/{INDEX_NAME}"
    try:
        index = json.loads((step_dir / INDEX_NAME).read_bytes())
        schema = str(index.get("schema"))
        chunks = index[_CHUNK_LISTS[schema]] if schema in _CHUNK_LISTS else None
        skeleton_name = index["skeleton"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"{source}: unreadable chunk index ({exc})") from exc
    if chunks is None:
        raise IntegrityError(f"{source}: unknown index schema {index.get('schema')!r}")
    tensors: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        path = check_relative_path(chunk["path"], source=source)
        if listed.get(path) != (chunk["size"], chunk["sha256"]):
            raise IntegrityError(
                f"{source}: chunk {path!r} is not listed in the manifest with the same size "
                "and sha256; the checkpoint is inconsistent"
            )
        loaded = torch.load(step_dir / path, weights_only=True, map_location="cpu", mmap=mmap)
        if not isinstance(loaded, dict) or set(loaded) != set(chunk["tensors"]):
            raise IntegrityError(f"{source}: chunk {path!r} does not hold the tensors indexed")
        tensors.update(loaded)
    skeleton_path = check_relative_path(skeleton_name, source=source)
    if skeleton_path not in listed:
        raise IntegrityError(f"{source}: skeleton {skeleton_path!r} is not in the manifest")
    skeleton = torch.load(step_dir / skeleton_path, weights_only=True, map_location="cpu")
    state = _join(skeleton, tensors, source=source)
    if not isinstance(state, dict):
        raise IntegrityError(f"{source}: the skeleton is not a dict")
    return state
