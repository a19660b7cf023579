"""The demo job's parts: generated corpus, vocabulary, windows, model, build_demo."""

from __future__ import annotations

import hashlib

import pytest
import torch

from runner.demo.components import DemoConfig, build_demo, resolve_device, warmup_cosine
from runner.demo.corpus import generate_corpus
from runner.demo.data import CharVocab, WindowDataset
from runner.demo.model import TinyGPT
from runner.errors import ConfigError

CORPUS_SHA256 = "6c828e43cf44072151cbe0c5443426a8d9257dd007c76c02bdc0715fb96dec8d"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_corpus_is_the_same_bytes_everywhere() -> None:
    text = generate_corpus()
    assert len(text) == 200_024
    assert hashlib.sha256(text.encode()).hexdigest() == CORPUS_SHA256
    assert text.startswith("Juno follows the old node beside the narrow lanterns.\nDay 1. ")
    assert generate_corpus(seed=1, size=1000) != generate_corpus(seed=2, size=1000)


def test_vocab_round_trip_and_unknown_character() -> None:
    vocab = CharVocab("hello world")
    assert vocab.chars == " dehlorw"
    assert vocab.decode(vocab.encode("low rod")) == "low rod"
    with pytest.raises(ValueError, match="'z' is not in the vocabulary"):
        vocab.encode("z")


def test_windows_are_shifted_by_one_and_do_not_overlap() -> None:
    tokens = torch.arange(20)
    data = WindowDataset(tokens, context=4, limit=3)
    assert len(data) == 3
    inputs, targets = data.batch([2, 0])
    assert inputs.tolist() == [[8, 9, 10, 11], [0, 1, 2, 3]]
    assert targets.tolist() == [[9, 10, 11, 12], [1, 2, 3, 4]]
    with pytest.raises(ConfigError, match="no window"):
        WindowDataset(torch.arange(3), context=4)


def test_model_is_causal() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=11, context=8, d_model=16, n_heads=2, dropout=0.0).eval()
    idx = torch.randint(0, 11, (1, 8))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 11
    a, b = model(idx), model(changed)
    assert torch.equal(a[0, :5], b[0, :5])
    assert not torch.equal(a[0, 5:], b[0, 5:])
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    factor = warmup_cosine(DemoConfig(total_steps=100, warmup_steps=10))
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(55) == pytest.approx(0.1 + 0.9 * 0.5)
    assert factor(100) == pytest.approx(0.1)


def test_build_demo_trains_and_keeps_counters() -> None:
    demo = build_demo(seed=0, device="cpu", batch_size=8, total_steps=30, max_samples=40)
    assert demo.device == torch.device("cpu")
    assert demo.sampler.batches_per_epoch == 5
    losses = [demo.train_step() for _ in range(30)]
    assert demo.done
    assert demo.loss_history == losses
    assert demo.counters.step == 30 and demo.counters.samples_seen == 240
    assert (demo.counters.epoch, demo.counters.batch_in_epoch) == (6, 0)
    assert losses[0] > 3.5  # ~ln(48) untrained
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8


def test_same_seed_same_run_other_seed_other_run() -> None:
    def run(seed: int) -> str:
        demo = build_demo(seed=seed, device="cpu", batch_size=4, total_steps=3, max_samples=20)
        while not demo.done:
            demo.train_step()
        return demo.fingerprint()

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_device_and_settings_are_validated() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(ConfigError, match="unknown device 'tpu9'"):
        resolve_device("tpu9")
    with pytest.raises(ConfigError, match="unknown demo setting"):
        build_demo(seed=0, device="cpu", batch_size=4, total_steps=3, depth=9)
    with pytest.raises(ConfigError, match="--steps must be >= 1"):
        build_demo(seed=0, device="cpu", batch_size=4, total_steps=0)
    with pytest.raises(ConfigError, match="not divisible by n_heads=3"):
        build_demo(seed=0, device="cpu", batch_size=4, total_steps=3, n_heads=3)
