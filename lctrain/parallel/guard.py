"""What a launcher starts on every process for `lctrain.parallel.launch.run_on_ranks`:
`python -m lctrain.parallel.guard WORKDIR`, a small parent of the rank's real process (`lctrain.parallel.rank`).

A process killed by the OS (the out-of-memory killer's SIGKILL) cannot say so itself, and the launchers tell it only
in their own words (torchrun's multi-line report, DeepSpeed's exit code, neither naming the rank reliably). The guard
sees the exact end of its rank and writes it to `WORKDIR/ranks.exit.RANK.json` (pid, exit code or signal, time), so
`run_on_ranks` can name the first rank to die and how. It then ends exactly as its rank did, so the launcher sees what
it would have seen without it. It imports neither torch nor lctrain's training code: it costs a Python start-up and
a few MB per rank."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from lctrain.lifetime import POLL_S, is_alive

EXIT_PREFIX = "ranks.exit."  # + rank + ".json"
RANK_MODULE = "lctrain.parallel.rank"


def exit_file(workdir: Path, rank: int) -> Path:
    return Path(workdir) / f"{EXIT_PREFIX}{rank}.json"


FORWARDED = (signal.SIGTERM, signal.SIGINT)  # how a launcher stops its ranks


def main() -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("workdir", type=Path)
    args, _ = parser.parse_known_args()  # DeepSpeed's launcher adds --local_rank: the rank reads it
    rank = int(os.environ.get("RANK", "0"))
    launcher = psutil.Process(os.getppid())
    # The rank starts with SIGTERM's default whatever the launcher's (`supervise` starts one ignoring it): a rank that
    # has not installed its own handling yet ends on it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    child = subprocess.Popen([sys.executable, "-m", RANK_MODULE, *sys.argv[1:]])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    while True:
        try:
            code = child.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            if not is_alive(launcher):  # killed itself: its ranks must not train on alone
                child.terminate()
    record = {"rank": rank, "pid": child.pid, "code": code, "time": time.time()}
    exit_file(args.workdir, rank).write_text(json.dumps(record))
    if code < 0:  # end as the rank did: the launcher reports and handles the same signal
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
