"""`lctrain train` with a fault injected: the process SIGKILLs itself once DeepSpeed has written the files of step
STEP's resume checkpoint, before the checkpoint is complete (the case "killed inside a checkpoint write").

    python tests/kill_in_checkpoint.py STEP [--set key=value ...]
"""

import os
import signal
import sys

from lctrain.config import load_config
from lctrain.train.command import train


def main(argv: list[str]) -> None:
    step = int(argv[0])
    overrides = [value for flag, value in zip(argv[1::2], argv[2::2]) if flag == "--set"]

    def kill(at: int) -> None:
        if at == step:
            os.kill(os.getpid(), signal.SIGKILL)

    train(load_config(None, overrides), before_checkpoint_complete=kill)


if __name__ == "__main__":
    main(sys.argv[1:])
