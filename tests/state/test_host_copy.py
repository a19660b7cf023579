"""HostBuffers: a snapshot equals the state (torch.save bytes, values, sharing), holds no live
memory, reuses its buffers from the second snapshot on, and copies what is not a plain tensor
on its own."""

from __future__ import annotations

import io

import numpy as np
import torch

from runner.state.host_copy import HostBuffers


def _saved(obj: object) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def _tied_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    model[1].weight = model[0].weight  # tied: one storage under two names
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_obj": model}


def test_snapshot_saves_the_same_bytes_and_keeps_tied_weights_shared() -> None:
    state = _tied_state()
    model = state.pop("model_obj")
    buffers = HostBuffers()
    copy = buffers.snapshot(state)
    assert _saved(copy) == _saved(state)  # same files in both save modes
    tied = copy["model"]["0.weight"], copy["model"]["1.weight"]  # type: ignore[index]
    assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()
    live = {p.untyped_storage().data_ptr() for p in model.parameters()}  # type: ignore[attr-defined]
    assert not live & {t.untyped_storage().data_ptr() for t in copy["model"].values()}  # type: ignore[attr-defined]
    unique = 50 * 16 + 50  # tied weight once, bias
    assert buffers.nbytes <= 1.1 * 4 * (unique * 3) + 64  # weights + AdamW m, v (+ step scalars)


def test_buffers_are_reused_and_a_later_change_does_not_reach_the_snapshot() -> None:
    weights = torch.zeros(1000)
    buffers = HostBuffers()
    first = buffers.snapshot({"w": weights})["w"]
    where = first.data_ptr()
    weights.add_(1.0)  # the loop's next step
    assert float(first.sum()) == 0.0
    second = buffers.snapshot({"w": weights})["w"]
    assert second.data_ptr() == where and float(second.sum()) == 1000.0  # no new allocation
    buffers.release()
    assert buffers.nbytes == 0


def test_views_share_one_copy_and_keep_their_offsets() -> None:
    base = torch.arange(100, dtype=torch.float32)
    copy = HostBuffers().snapshot({"a": base[10:20], "b": base[50:55].view(5, 1)})
    assert torch.equal(copy["a"], base[10:20]) and torch.equal(copy["b"], base[50:55].view(5, 1))
    assert copy["a"].untyped_storage().data_ptr() == copy["b"].untyped_storage().data_ptr()


def test_what_is_not_a_plain_tensor_is_copied_on_its_own_and_objects_are_deep_copied() -> None:
    conj = torch.randn(3, dtype=torch.cfloat).conj()  # a view with its conjugate bit set
    sparse = torch.eye(3).to_sparse()
    array = np.zeros(3)
    copy = HostBuffers().snapshot({"conj": conj, "sparse": sparse, "array": array, "n": [1, (2,)]})
    array[0] = 5.0  # the caller changes its object after the snapshot
    assert torch.equal(copy["conj"], conj)
    assert torch.equal(copy["sparse"].to_dense(), torch.eye(3))
    assert copy["array"][0] == 0.0 and copy["n"] == [1, (2,)]
