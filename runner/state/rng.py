"""Capture and restore every global random number generator a training loop draws from.

The captured state is made only of tensors, ints, floats, strings, None, lists and dicts, so a
checkpoint holding it loads with ``torch.load(weights_only=True)``: no pickled generator objects
and no numpy arrays.

Covered: Python's ``random`` module, numpy's legacy global ``RandomState`` (what
``np.random.rand`` and friends use), torch's CPU generator and the generator of every CUDA device.
Generators a program creates itself (``np.random.default_rng()``, ``torch.Generator()``,
``random.Random()``) are not global; their owners must save them (``ResumableSampler`` does).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from runner.errors import IntegrityError

log = logging.getLogger(__name__)

RNG_KEYS = ("python", "numpy", "torch_cpu", "cuda")


def capture_rng() -> dict[str, Any]:
    """Snapshot of every global generator, in weights-only-loadable form."""
    version, py_state, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    cuda: list[torch.Tensor] = []
    # is_initialized(): a process that never touched CUDA has nothing to save, and asking would
    # initialise a context (hundreds of MB, seconds) just to read default seeds.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [t.clone() for t in torch.cuda.get_rng_state_all()]
    return {
        "python": {
            "version": int(version),
            # 625 words of the Mersenne Twister (each < 2**32), plus the position word.
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss_next": None if gauss_next is None else float(gauss_next),
        },
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_cpu": torch.get_rng_state().clone(),
        "cuda": cuda,
        # Not a generator, but it decides the bits too: CPU kernels split reductions by thread.
        "torch_threads": torch.get_num_threads(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put every global generator back where `capture_rng` found it.

    Raises IntegrityError when a section is missing or malformed. CUDA states are restored on
    as many devices as both the checkpoint and this machine have; a difference is logged because
    the random streams of the extra devices then differ from the saved run.
    """
    missing = [k for k in RNG_KEYS if k not in state]
    if missing:
        raise IntegrityError(
            f"train state: RNG section lacks {missing}; the checkpoint was written by a tool "
            "that does not save RNG state and cannot be resumed bit-exactly"
        )
    try:
        py = state["python"]
        random.setstate(
            (int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"])
        )
        npst = state["numpy"]
        np.random.set_state(
            (
                str(npst["kind"]),
                npst["keys"].numpy().astype(np.uint32),
                int(npst["pos"]),
                int(npst["has_gauss"]),
                float(npst["cached_gaussian"]),
            )
        )
        torch.set_rng_state(state["torch_cpu"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise IntegrityError(f"train state: RNG section is malformed ({exc!r})") from exc
    _restore_cuda(list(state["cuda"]))
    saved_threads = state.get("torch_threads")
    if saved_threads is not None and int(saved_threads) != torch.get_num_threads():
        log.warning(
            "checkpoint was written with %d torch intra-op thread(s), this process uses %d: "
            "CPU results will not be bit-identical to an uninterrupted run "
            "(use torch.set_num_threads(%d) to match)",
            int(saved_threads),
            torch.get_num_threads(),
            int(saved_threads),
        )


def _restore_cuda(saved: list[torch.Tensor]) -> None:
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved and available == 0:
        log.warning(
            "checkpoint holds RNG state for %d CUDA device(s) but none is available: "
            "GPU random streams (dropout on GPU) will differ from the saved run",
            len(saved),
        )
        return
    if saved and len(saved) != available:
        log.warning(
            "checkpoint holds RNG state for %d CUDA device(s), this machine has %d: "
            "restoring the first %d",
            len(saved),
            available,
            min(len(saved), available),
        )
    for index, device_state in enumerate(saved[:available]):
        torch.cuda.set_rng_state(device_state, device=index)
