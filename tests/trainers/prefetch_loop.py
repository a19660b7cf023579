"""A nanoGPT-style loop on TrainSession that fetches the next batch right after the forward
pass, as nanoGPT's train.py does (`X, Y = get_batch('train')` before the backward). The batch
is drawn with the global RNG (which the session restores); the one fetched ahead is in no
checkpoint unless `--batch-in-extra` puts its holder in `ModuleTrainState(extra=...)`.

Usage: python prefetch_loop.py [--batch-in-extra] [--steps N] [--step-seconds S]
(run dir `runs/gpt`, relative: `runner drill` runs each copy in its own directory).
"""

from __future__ import annotations

from runner.preemption.early import install_early_handlers

install_early_handlers()

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from runner.config import RunConfig  # noqa: E402
from runner.preemption import StopController, exit_process, install_signal_handlers  # noqa: E402
from runner.session import TrainSession  # noqa: E402
from runner.state import ModuleTrainState  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-in-extra", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = torch.randint(0, 32, (4000,), generator=torch.Generator().manual_seed(1))
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - 9, (8,))
        x = torch.stack([data[i : i + 8] for i in ix])
        y = torch.stack([data[i + 1 : i + 9] for i in ix])
        return x, y

    nxt: dict[str, torch.Tensor] = {}
    extra = {"batch": nxt} if args.batch_in_extra else {}
    state = ModuleTrainState(model=model, optimizer=opt, extra=extra)
    config = RunConfig(run_dir="runs/gpt", steps=args.steps, ckpt_every=5, save_mode="sync")
    stop = StopController()
    install_signal_handlers(stop, grace_seconds=config.grace_seconds)
    with TrainSession(config, state=state, stop=stop) as session:
        if "x" not in nxt:  # a fresh start (a resume with the batch in extra has it back)
            nxt["x"], nxt["y"] = get_batch()
        while not session.should_stop:
            x, y = nxt["x"], nxt["y"]
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, 32), y.view(-1))
            nxt["x"], nxt["y"] = get_batch()  # prefetch while the GPU would be busy
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.advance(loss=loss.item())
            session.step_done()
            time.sleep(args.step_seconds)
    exit_process(session.exit_code)


if __name__ == "__main__":
    main()
