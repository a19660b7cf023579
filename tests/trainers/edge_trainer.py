"""Trainers for `runner run` at its edges (stdlib only, no training): ones that ignore SIGTERM,
exit with codes retrying cannot fix, leave processes behind, or interleave stdout and stderr.

Usage: edge_trainer.py MODE [ARG]
  stubborn DIR      commit seed step 5 (temp name, rename), wait until it is adopted, print
                    "ready", then ignore SIGTERM and sleep
  clean-stop N      commit seed step 5, log loss for steps 1..N in loss.jsonl, wait until
                    adopted, print "ready"; on SIGTERM exit 0 without writing anything
  exit CODE         print "attempt $RUNNER_ATTEMPT" and exit CODE
  leave-setsid DIR  start a helper that leaves our session (setsid) and double-forks; the
                    survivor ignores SIGTERM and sleeps; its pid goes to DIR/pids. Print
                    "ready", wait for DIR/go, exit 0
  leave-group DIR   start a helper in our process group that ignores SIGTERM and sleeps (its
                    output not on our pipes); its pid goes to DIR/pids. Print "ready"; on
                    SIGTERM commit seed step 1 and exit 0
  leave-pipes DIR   as leave-setsid, but the helper keeps our stdout and stderr open; exit 0
                    at once
  crash-leaving DIR attempt 1: as leave-setsid, then exit 1 without waiting. Later attempts:
                    print whether attempt 1's helper is still alive, exit 0
  interleave        print "out A$n", "err B$n" (stderr), "out C$n", paused between, exit 1
  orphans N         run `os.system("true &")` N times (each `true` is orphaned: re-parented
                    to the supervisor), print "ready", sleep (SIGTERM ends it)
  wait-go DIR       create DIR/ready, wait for DIR/go, exit 0
  stubborn-pipes DIR  as leave-pipes, then ignore SIGTERM, print "ready" and sleep
  helper PIDFILE    (internal) ignore SIGTERM, append our pid to PIDFILE, sleep
  daemon PIDFILE    (internal) setsid, fork, the parent exits; the child runs `helper`
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

N_PARAMS = 4


def say(line: str, *, err: bool = False) -> None:
    stream = sys.stderr if err else sys.stdout
    print(line, file=stream, flush=True)


def commit_seed(step: int) -> Path:
    ckpt_dir = Path(os.environ["RUNNER_CKPT_DIR"])
    data = struct.pack("<ii", step, N_PARAMS) + struct.pack(f"<{3 * N_PARAMS}f", *[0.5] * 12)
    tmp = ckpt_dir / f".tmp-step_{step:06d}.bin-{os.getpid()}"
    tmp.write_bytes(data)
    final = ckpt_dir / f"step_{step:06d}.bin"
    os.rename(tmp, final)
    return ckpt_dir / f"step_{step:06d}" / "manifest.json"


def wait_for(path: Path, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            say(f"timed out waiting for {path}", err=True)
            sys.exit(9)
        time.sleep(0.02)


def start_helper(pidfile: Path, *, detach: bool, keep_pipes: bool = False) -> None:
    mode = "daemon" if detach else "helper"
    out = None if keep_pipes else subprocess.DEVNULL
    subprocess.Popen(
        [sys.executable, __file__, mode, str(pidfile)],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=out,
    )
    wait_for(pidfile)


def helper(pidfile: Path) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tmp = pidfile.with_name(f"{pidfile.name}.{os.getpid()}")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, pidfile)  # whole or absent: the trainer waits for it
    time.sleep(600)
    return 0


def daemon(pidfile: Path) -> int:
    os.setsid()
    if os.fork() > 0:
        os._exit(0)  # the survivor is orphaned: re-parented to the nearest subreaper
    return helper(pidfile)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def main() -> int:
    mode = sys.argv[1]
    arg = sys.argv[2] if len(sys.argv) > 2 else ""
    if mode == "helper":
        return helper(Path(arg))
    if mode == "daemon":
        return daemon(Path(arg))
    if mode == "exit":
        say(f"attempt {os.environ.get('RUNNER_ATTEMPT')}")
        return int(arg)
    if mode == "stubborn":
        wait_for(commit_seed(5))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("ready")
        time.sleep(600)
        return 0
    if mode == "clean-stop":
        with open(Path(os.environ["RUNNER_RUN_DIR"]) / "loss.jsonl", "a") as f:
            for step in range(1, int(arg) + 1):
                f.write(f'{{"step": {step}, "loss": 1.0}}\n')
        wait_for(commit_seed(5))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        say("ready")
        time.sleep(600)
        return 0
    if mode == "leave-setsid":
        start_helper(Path(arg) / "pids", detach=True)
        say("ready")
        wait_for(Path(arg) / "go")
        return 0
    if mode == "leave-group":
        start_helper(Path(arg) / "pids", detach=False)
        stop: list[int] = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        say("ready")
        while not stop:
            time.sleep(0.02)
        commit_seed(1)
        return 0
    if mode == "leave-pipes":
        start_helper(Path(arg) / "pids", detach=True, keep_pipes=True)
        say("ready")
        return 0
    if mode == "crash-leaving":
        pidfile = Path(arg) / "pids"
        if os.environ.get("RUNNER_ATTEMPT") == "1":
            start_helper(pidfile, detach=True)
            say("attempt 1 left a helper and crashes")
            return 1
        pids = [int(p) for p in pidfile.read_text().split()]
        say(f"attempt {os.environ.get('RUNNER_ATTEMPT')}: leftover alive: "
            f"{'yes' if any(alive(p) for p in pids) else 'no'}")  # fmt: skip
        return 0
    if mode == "orphans":
        for _ in range(int(arg)):
            os.system("true &")  # the shell exits at once, leaving `true` to the subreaper
        say("ready")
        time.sleep(600)
        return 0
    if mode == "wait-go":
        (Path(arg) / "ready").touch()
        wait_for(Path(arg) / "go", timeout=60)
        return 0
    if mode == "stubborn-pipes":
        start_helper(Path(arg) / "pids", detach=True, keep_pipes=True)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        say("ready")
        time.sleep(600)
        return 0
    if mode == "interleave":
        n = os.environ.get("RUNNER_ATTEMPT")
        for line, err in ((f"out A{n}", False), (f"err B{n}", True), (f"out C{n}", False)):
            say(line, err=err)
            time.sleep(0.1)
        return 1
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
