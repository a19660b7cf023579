"""The seed binary format `step_NNNNNN.bin` (little-endian, 8 + 12·n bytes):

    [int32 step][int32 n_params][n × f32 weights][n × f32 m][n × f32 v]

Weights are the model's parameters in `model.parameters()` order, flattened and concatenated;
m and v are the AdamW moments (`exp_avg`, `exp_avg_sq`) of the same parameters. The mapping to
a train state uses its "param_names" (named_parameters() order) and assumes, as the seed
trainers do, that the optimizer was built over `model.parameters()`, so optimizer parameter
index i is param_names[i].

A seed-bin checkpoint's fingerprint is the sha256 of the three regions (bytes 8 to the end):
equal fingerprints mean equal weights and moments, whatever the step header says.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.atomicity.files import HashingFileWriter, read_chunks
from runner.checkpoint.layout import parse_seed_bin
from runner.errors import IntegrityError, SchemaError

if TYPE_CHECKING:
    import torch


HEADER = struct.Struct("<ii")
INT32_MAX = 2**31 - 1
_F32 = "<f4"  # numpy dtype string; numpy and torch are imported only where arrays are made


@dataclass(frozen=True, kw_only=True)
class SeedHeader:
    step: int
    n_params: int
    size: int

    @property
    def regions(self) -> dict[str, int]:
        """Byte offset of each region."""
        n = self.n_params
        return {"weights": HEADER.size, "m": HEADER.size + 4 * n, "v": HEADER.size + 8 * n}


def expected_size(n_params: int) -> int:
    return HEADER.size + 12 * n_params


def read_header(path: Path) -> SeedHeader:
    """Parse and validate the header against the file size (IntegrityError if they disagree)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER.size)
    except FileNotFoundError as exc:
        raise IntegrityError(f"{path}: seed file does not exist") from exc
    if len(raw) < HEADER.size:
        raise IntegrityError(f"{path}: {size} bytes is too short for the 8-byte seed header")
    step, n_params = HEADER.unpack(raw)
    if step < 0 or n_params < 0:
        raise IntegrityError(f"{path}: negative step ({step}) or n_params ({n_params}) in header")
    if size != expected_size(n_params):
        raise IntegrityError(
            f"{path}: size {size} bytes disagrees with its header (n_params={n_params} needs "
            f"8 + 12*{n_params} = {expected_size(n_params)}); the file is truncated or not a "
            "seed checkpoint"
        )
    named = parse_seed_bin(path.name)
    if named is not None and named != step:
        raise IntegrityError(f"{path}: file name says step {named}, header says step {step}")
    return SeedHeader(step=step, n_params=n_params, size=size)


def hash_seed_file(path: Path) -> tuple[int, str, str]:
    """(size, sha256 of the file, fingerprint = sha256 of bytes 8..end) in one read."""
    whole = hashlib.sha256()
    body = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in read_chunks(f):
            whole.update(chunk)
            skip = max(0, HEADER.size - size)
            body.update(memoryview(chunk)[skip:])
            size += len(chunk)
    return size, whole.hexdigest(), body.hexdigest()


# -- train state -> seed --------------------------------------------------------------------


def _param_index(state: dict[str, Any], *, source: str) -> tuple[list[str], list[Any]]:
    names = state.get("param_names") or []
    if not names:
        raise SchemaError(
            f"{source}: the state records no parameter names (a migrated v1 checkpoint); "
            "resume it once so it is re-saved as v2, then convert"
        )
    groups = state.get("optimizer", {}).get("param_groups", [])
    ids = [pid for group in groups for pid in group["params"]]
    if len(ids) != len(names):
        raise SchemaError(
            f"{source}: optimizer holds {len(ids)} parameters, the model {len(names)}; the "
            "seed format needs one optimizer over model.parameters()"
        )
    return list(names), ids


def _f32_bytes(tensor: torch.Tensor) -> memoryview:
    import torch

    array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
    return array.astype(_F32, copy=False).data.cast("B")


def iter_seed_chunks(state: dict[str, Any], *, source: str = "state") -> Iterator[memoryview]:
    """The seed file of a v2 train state as a stream of chunks, one tensor at a time."""
    import torch

    names, ids = _param_index(state, source=source)
    model = state["model"]
    opt_state = state["optimizer"].get("state", {})
    params = [model[name] for name in names]
    n_params = sum(p.numel() for p in params)
    step = int(state["counters"]["step"])
    if not 0 <= step <= INT32_MAX or n_params > INT32_MAX:
        raise SchemaError(f"{source}: step {step} or {n_params} parameters overflow int32")
    yield memoryview(HEADER.pack(step, n_params))
    for p in params:
        yield _f32_bytes(p)
    for key in ("exp_avg", "exp_avg_sq"):
        for pid, p in zip(ids, params, strict=True):
            moment = opt_state.get(pid, {}).get(key)
            if moment is None:  # no update yet: AdamW's moments start at zero
                moment = torch.zeros_like(p, dtype=torch.float32)
            elif moment.numel() != p.numel():
                raise SchemaError(f"{source}: {key} of {names[ids.index(pid)]} has wrong shape")
            yield _f32_bytes(moment)


def write_seed_file(state: dict[str, Any], dst: Path, *, source: str = "state") -> tuple[int, str]:
    """Write a train state as a seed file atomically; returns (size, sha256)."""
    with HashingFileWriter(Path(dst)) as out:
        for chunk in iter_seed_chunks(state, source=source):
            out.write(chunk)
        out.commit()
    return out.size, out.sha256


# -- seed -> train state --------------------------------------------------------------------


def _read_region(f: Any, *, offset: int, numel: int) -> torch.Tensor:
    import numpy as np
    import torch

    out = np.empty(numel, dtype=_F32)
    f.seek(offset)
    if f.readinto(out.data.cast("B")) != numel * 4:
        raise IntegrityError(f"{f.name}: ended early while reading {numel} floats at {offset}")
    return torch.from_numpy(out)


def seed_to_state(path: Path, *, like: dict[str, Any]) -> dict[str, Any]:
    """Map a seed file onto a v2 train state shaped like `like` (e.g. the state captured from
    a freshly built model and AdamW): parameters and moments come from the file, everything
    else (RNG, sampler, scheduler) from `like`."""
    import torch

    path = Path(path)
    header = read_header(path)
    names, ids = _param_index(like, source=str(path))
    template = like["model"]
    n_params = sum(template[name].numel() for name in names)
    if n_params != header.n_params:
        raise IntegrityError(
            f"{path}: holds {header.n_params} parameters, the model has {n_params}; "
            "it belongs to a different model"
        )
    model: OrderedDict[str, Any] = OrderedDict(template)
    if hasattr(template, "_metadata"):
        model._metadata = template._metadata  # type: ignore[attr-defined]
    opt_state: dict[Any, Any] = {}
    regions = header.regions
    offset = 0
    with open(path, "rb") as f:
        for name, pid in zip(names, ids, strict=True):
            ref = template[name]
            numel = ref.numel()
            moments = {}
            for which in ("weights", "m", "v"):
                flat = _read_region(f, offset=regions[which] + 4 * offset, numel=numel)
                moments[which] = flat.view(ref.shape).to(ref.dtype)
            model[name] = moments["weights"]
            opt_state[pid] = {
                "step": torch.tensor(float(header.step)),
                "exp_avg": moments["m"],
                "exp_avg_sq": moments["v"],
            }
            offset += numel
    optimizer = {**like["optimizer"], "state": opt_state}
    counters = {**like.get("counters", {}), "step": header.step}
    return {**like, "model": model, "optimizer": optimizer, "counters": counters}
