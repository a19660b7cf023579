"""A loop using StopController + install_signal_handlers exactly as an entry point would.

Each "step" sleeps a little; SIGUSR1 writes a checkpoint file and continues; SIGTERM/SIGINT
end the loop with a deliberately slow final save (so a test can send more signals during it),
then exit 75. Prints one line per event so the test can follow along.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from runner.atomicity.files import atomic_write_chunks
from runner.errors import EXIT_PREEMPTED
from runner.preemption.signals import install_signal_handlers
from runner.preemption.stop import StopController


def main() -> int:
    out = Path(sys.argv[1])
    controller = StopController()
    restore = install_signal_handlers(controller, grace_seconds=30.0)
    step = 0
    print("ready", flush=True)
    try:
        while not controller.stop_requested:
            time.sleep(0.01)
            step += 1
            reason = controller.take_checkpoint_request()
            if reason is not None:
                (out / f"ckpt_{step:06d}").write_text(reason)
                print(f"checkpoint {step} {reason}", flush=True)
        print(f"saving {step}", flush=True)

        def slow_chunks() -> object:
            for i in range(20):
                time.sleep(0.05)
                yield bytes([i]) * 1000

        atomic_write_chunks(out / "final.bin", slow_chunks())  # type: ignore[arg-type]
        print(f"saved {step} stops={controller.stop_count} reason={controller.reason}", flush=True)
        return EXIT_PREEMPTED
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
