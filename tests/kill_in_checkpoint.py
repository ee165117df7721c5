"""`lctrain train` with a fault injected: the process SIGKILLs itself once DeepSpeed has written the files of step
STEP's resume checkpoint, before the checkpoint is complete (the case "killed inside a checkpoint write"); with
`--signal TERM`, it sends itself that signal instead (a scheduler's SIGTERM arriving during the write).

    python tests/kill_in_checkpoint.py STEP [--signal NAME] [--set key=value ...]
"""

import os
import signal
import sys

from lctrain.config import load_config
from lctrain.train.command import train


def main(argv: list[str]) -> None:
    step = int(argv[0])
    options = list(zip(argv[1::2], argv[2::2]))
    overrides = [value for flag, value in options if flag == "--set"]
    sig = next((signal.Signals[f"SIG{value}"] for flag, value in options if flag == "--signal"), signal.SIGKILL)

    def kill(at: int) -> None:
        if at == step:
            os.kill(os.getpid(), sig)

    try:
        train(load_config(None, overrides), before_checkpoint_complete=kill)
    except KeyboardInterrupt as e:  # as the command line ends it: its words on stderr, 143
        print(e, file=sys.stderr)
        sys.exit(143)


if __name__ == "__main__":
    main(sys.argv[1:])
