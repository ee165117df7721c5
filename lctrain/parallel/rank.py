"""What runs on every process for `lctrain.parallel.launch.run_on_ranks`: `python -m lctrain.parallel.rank WORKDIR`,
started by the launcher's `lctrain.parallel.guard`. It calls the requested function with the request and reports
through files in WORKDIR: rank 0's return value, or the failure a rank can name (out of memory, a UserError or an
environment failure such as a full disk, else its traceback)."""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

from lctrain.compat.deepspeed import quiet_cpu_fallback_notice
from lctrain.console import survive_closed_outputs
from lctrain.errors import UserError, environment_error_message
from lctrain.lifetime import Terminated, exit_with_parent, exit_with_supervisor
from lctrain.parallel.groups import end_process_groups
from lctrain.parallel.launch import REQUEST_FILE, RESULT_FILE, STOPPED, failure_file

# PyTorch's CPU allocator reports a failed allocation as a plain RuntimeError with this text.
_CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(e, RuntimeError) and _CPU_ALLOCATOR_FAILED in str(e)
    )


def resolve(function: str):
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)


def report_failure(workdir: Path, rank: int, kind: str, message: str, **more) -> None:
    record = {"rank": rank, "kind": kind, "message": message, **more}
    failure_file(workdir, rank).write_text(json.dumps(record))


def main(argv: list[str] | None = None) -> None:
    # stdout is the command's (`lctrain check sp | head -1`): its reader going away must not end the rank's work
    survive_closed_outputs()
    # A crash in native code (gloo's or a kernel's abort, a segfault) kills the rank before Python can report it:
    # faulthandler writes the Python stack of every thread to stderr (the launcher's log) first.
    faulthandler.enable()
    quiet_cpu_fallback_notice()
    exit_with_supervisor()
    exit_with_parent()  # the guard: if it is killed, nothing would report this rank's end
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--local_rank", type=int, default=None, help="set by DeepSpeed's launcher; unused")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    spec = json.loads((args.workdir / REQUEST_FILE).read_text())
    try:
        result = resolve(spec["function"])(spec["request"])
    except Terminated as e:  # stopped on request where its work is kept (lifetime.StopRequest)
        report_failure(args.workdir, rank, STOPPED, str(e))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)
    except KeyboardInterrupt:  # Ctrl-C, passed on by the command that launched the ranks, which says it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)
    except Exception as e:
        if is_out_of_memory(e):
            report_failure(args.workdir, rank, "out_of_memory", " ".join(str(e).split()))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # no teardown: the other ranks wait in a collective this rank never joins
        message = str(e) if isinstance(e, UserError) else environment_error_message(e)
        if message is None:
            # the launcher's stderr goes to a log: the caller shows the first failing rank's traceback
            report_failure(args.workdir, rank, "crash", traceback.format_exc())
            raise
        # its exit code too: a RunFailed (a NaN loss) is raised again as one by the launching command (exit code 1)
        code = e.exit_code if isinstance(e, UserError) else UserError.exit_code
        report_failure(args.workdir, rank, "user_error", message, exit_code=code)
        raise SystemExit(code) from None
    end_process_groups()
    if rank == 0:
        (args.workdir / RESULT_FILE).write_text(json.dumps({"result": result}))
    # Its work done and reported, the rank exits as multiprocessing's workers do, without the interpreter's teardown:
    # native libraries' static destructors run there, and kineto's (after a profiled memory measurement) aborted a
    # rank whose work had succeeded ("terminate called without an active exception"), about 1 launch in 6 on 2 cores.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
