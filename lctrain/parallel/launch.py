"""Running work on every process of a config's layout under DeepSpeed's or torch's launcher.

`run_on_ranks(cfg, "package.module:function", request, workdir)` starts `lctrain.parallel.rank` on every process; each
calls `function(request)` and rank 0's return value comes back as `Finished(result)`. The ranks report through files
in `workdir` (shared by every node, as a run directory is), so the caller gets typed outcomes instead of exit codes:
an out-of-memory on any rank is `OutOfMemory`, a rank's UserError is raised here as that UserError (a `RunFailed`
as a `RunFailed`: its exit code is the rank's), anything else is `RanksFailed` with the launcher's exit code, and
ranks that stopped on a SIGTERM (`stop_on_sigterm`) `Terminated` with rank 0's words. A process killed from outside
(a rank SIGKILLed by the out-of-memory killer, the launcher itself) is `ProcessKilled`, one line naming it and the
signal: `lctrain.parallel.guard`, the parent of every rank, records how its rank ended. The launcher's own standard
error (torch elastic's multi-line report, DeepSpeed's log) goes to `WORKDIR/launcher.log`, with the ranks' standard
error. This module knows none of its callers."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psutil
import torch

from lctrain.config import Config, check_on_this_machine
from lctrain.errors import RunFailed, UserError, error_of
from lctrain.lifetime import CRASH_SIGNALS, Terminated, death_of, signal_name, supervise
from lctrain.parallel.groups import free_port, launcher_free_env
from lctrain.parallel.guard import EXIT_PREFIX
from lctrain.parallel.records import read_records
from lctrain.parallel.watchdog import HANG_PREFIX, hang_summary


def launcher_env() -> dict:
    """The launched processes' environment: ours without what this process set for its own run, and torchrun's
    logging (`LOGLEVEL`, read by torch elastic) at errors unless the user chose a level: its warnings (the
    OMP_NUM_THREADS default, closing signals) would sit among the training lines, and a failed rank reports itself."""
    env = launcher_free_env()
    env.setdefault("LOGLEVEL", "ERROR")
    return env


# What torchrun handles without SIGTERM: on SIGTERM it would SIGTERM its workers and SIGKILL them 30 s later, cutting
# short the checkpoint they stop to write (`supervise` starts it with SIGTERM ignored instead).
TORCHRUN_SIGNALS_BUT_SIGTERM = "SIGINT,SIGHUP,SIGQUIT"


def worker_command(cfg: Config, worker: list[str], stop_on_sigterm: bool = False) -> list[str]:
    """The launcher command that runs `python -m <worker...>` on every process of `cfg`'s layout; `stop_on_sigterm`:
    torchrun leaves SIGTERM to the workers."""
    p = cfg.parallel
    if p.launcher == "torchrun":
        if p.num_nodes > 1:
            raise UserError(
                f"{cfg.origin('parallel.launcher', 'parallel.num_nodes')}: parallel.launcher = torchrun cannot "
                f"start other nodes; "
                f"run 'torchrun --nnodes {p.num_nodes} ... -m lctrain.cli train' on every node, or set "
                f"parallel.launcher: deepspeed with parallel.hostfile"
            )
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(p.nproc_per_node),
            "--nnodes",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            *(["--signals-to-handle", TORCHRUN_SIGNALS_BUT_SIGTERM] if stop_on_sigterm else []),
            "-m",
        ] + worker
    # The runner logs every spawned command at info level among the training lines; on one node its one warning is
    # that there is no hostfile, which is what one node means, and its one error the exit code of a rank that failed
    # ("[ERROR] [launch.py:259:sigkill_handler] [...] exits with return code = 2"), which lctrain's own last line
    # names with its cause. Across nodes its warnings and errors (ssh, the hostfile) are the diagnosis.
    log_level = "warning" if p.num_nodes > 1 else "critical"
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--master_port",
        str(free_port()),
        "--log_level",
        log_level,
    ]
    if p.num_nodes > 1:
        hostfile = cfg.resolve_path(p.hostfile) if p.hostfile else None
        if hostfile is None:
            raise UserError(
                f"{cfg.origin('parallel.num_nodes')}: parallel.num_nodes = {p.num_nodes} needs "
                f"parallel.hostfile naming the hosts (DeepSpeed hostfile: 'host slots=8' per line)"
            )
        if not hostfile.is_file():
            raise UserError(
                f"{cfg.origin('parallel.hostfile')}: parallel.hostfile = {p.hostfile}: no such file ({hostfile}); "
                f"write the DeepSpeed hostfile ('host slots=8' per line) there, or name the one you have"
            )
        cmd += ["--hostfile", str(hostfile), "--num_nodes", str(p.num_nodes), "--num_gpus", str(p.nproc_per_node)]
    else:
        cmd += ["--num_gpus", str(p.nproc_per_node)]
    return cmd + ["--module"] + worker


RANK_MODULE = "lctrain.parallel.rank"
GUARD_MODULE = "lctrain.parallel.guard"  # what the launcher starts: it runs RANK_MODULE and records how it ended
LAUNCHER_LOG = "launcher.log"
REQUEST_FILE = "ranks.request.json"
RESULT_FILE = "ranks.result.json"
FAILURE_PREFIX = "ranks.failure."  # + rank + ".json", written by a rank that ended in a failure it can name
STOPPED = "stopped"  # the kind of failure record of a rank that stopped on request (`Terminated`)


@dataclass(frozen=True)
class Finished:
    """Every rank returned; `result` is rank 0's return value (after a JSON round trip)."""

    result: object


@dataclass(frozen=True)
class OutOfMemory:
    """A rank ran out of device or host memory (the lowest such rank, with its exception's message)."""

    rank: int
    message: str


class RanksFailed(SystemExit):
    """The ranks failed otherwise (their output is above). A SystemExit with the launcher's exit code, so that, not
    handled, the command ends with that code and no traceback, as a launcher's failure always has."""

    def __init__(self, exit_code: int):
        super().__init__(exit_code)
        self.exit_code = exit_code


class ProcessKilled(RunFailed):
    """A process of the run was killed by a signal it did not raise itself: `who` ("rank 1 (pid 4242)", "the
    launcher torchrun"), `signal` ("SIGKILL"). Its one line names the likely cause; callers add what to run next
    (`ProcessKilled.what`)."""

    def __init__(self, who: str, signal_name: str, log: Path):
        self.who, self.signal, self.log = who, signal_name, log
        super().__init__(f"{self.what}; run the command again")

    @property
    def what(self) -> str:
        stack = ", with the rank's Python stack at the crash," if self.signal in CRASH_SIGNALS else ""
        return f"{self.who} {death_of(self.signal)}; the launcher's report{stack} is in {self.log}"


class RanksHung(RunFailed):
    """A step overran `train.step_timeout_minutes` (lctrain.parallel.watchdog): `summary` names the rank that hung and
    where the others waited. `what` adds where the ranks' stacks are; callers add what to run next."""

    def __init__(self, summary: str, log: Path):
        self.summary, self.log = summary, log
        super().__init__(self.what)

    @property
    def what(self) -> str:
        return f"{self.summary}; every rank's stack is in {self.log}"


def failure_file(workdir: Path, rank: int) -> Path:
    return workdir / f"{FAILURE_PREFIX}{rank}.json"


def run_on_ranks(
    cfg: Config,
    function: str,
    request: dict,
    workdir: str | Path,
    *,
    stop_on_sigterm: bool = False,
    say_on_sigterm: str | None = None,
) -> Finished | OutOfMemory:
    """Call `function(request)` ("package.module:function", importable by every rank; `request` JSON-able) on every
    process of `cfg`'s layout and wait. Ctrl-C or SIGTERM stops them all (lifetime.supervise); a kill of this process
    ends them too (the ranks exit with their supervisor). With `stop_on_sigterm`, a SIGTERM is passed to the ranks
    instead, which stop where `function` polls its `lifetime.StopRequest` (and raise `Terminated`); this returns
    when they have, raising `Terminated` with what rank 0 said. `say_on_sigterm`: printed when this process passes
    a SIGTERM on (the ranks' `StopRequest` says nothing here: a SIGTERM that reaches them alone comes from the
    launcher when another rank died, or was sent to one rank by hand)."""
    check_on_this_machine(cfg, torch.cuda.is_available())
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / LAUNCHER_LOG
    stale = [
        log,
        workdir / RESULT_FILE,
        *workdir.glob(f"{FAILURE_PREFIX}*.json"),
        *workdir.glob(f"{EXIT_PREFIX}*"),
        *workdir.glob(f"{HANG_PREFIX}*"),
    ]
    for path in stale:
        path.unlink(missing_ok=True)
    (workdir / REQUEST_FILE).write_text(json.dumps({"function": function, "request": request}))
    cmd = worker_command(cfg, [GUARD_MODULE, str(workdir.resolve())], stop_on_sigterm)
    try:
        rc = supervise(
            cmd,
            env=launcher_env(),
            stderr=log,
            on_terminate=partial(_pass_sigterm_to_ranks, say_on_sigterm) if stop_on_sigterm else None,
        )
    except Terminated:
        raise Terminated(_stopped_words(workdir)) from None
    if rc == 0:
        return Finished(json.loads((workdir / RESULT_FILE).read_text())["result"])
    if rc < 0:  # the launcher itself; its ranks end with it (their guards stop them)
        raise ProcessKilled(f"the launcher ({cfg.parallel.launcher})", signal_name(-rc), log)
    failures = {f["rank"]: f for f in read_records(workdir, FAILURE_PREFIX)}
    if any(f["kind"] == STOPPED for f in failures.values()):  # a SIGTERM sent to the ranks alone
        raise Terminated(_stopped_words(workdir))
    oom = next((f for _, f in sorted(failures.items()) if f["kind"] == "out_of_memory"), None)
    if oom is not None:
        return OutOfMemory(rank=oom["rank"], message=oom["message"])
    refused = next((f for _, f in sorted(failures.items()) if f["kind"] == "user_error"), None)
    if refused is not None:
        raise error_of(refused["message"], refused.get("exit_code", UserError.exit_code))
    hangs = read_records(workdir, HANG_PREFIX)
    if hangs:  # the ranks that ended on the watchdog's word were not the cause: the hung rank was
        raise RanksHung(hang_summary(hangs, cfg.parallel.world), log)
    # The first rank to end badly is the cause; the others were stopped by the launcher or lost their peers.
    ended = sorted((e for e in read_records(workdir, EXIT_PREFIX) if e["code"] != 0), key=lambda e: e["time"])
    first = ended[0] if ended else None
    if first is not None and first["code"] < 0 and first["rank"] not in failures:
        raise ProcessKilled(f"rank {first['rank']} (pid {first['pid']})", signal_name(-first["code"]), log)
    crash = failures.get(first["rank"]) if first is not None else None
    crash = crash or next((f for _, f in sorted(failures.items())), None)
    who, cause = "the ranks", ""
    if crash is not None:
        print(crash["message"].rstrip(), file=sys.stderr)  # its traceback
        who = f"rank {crash['rank']}"
    elif first is None:
        # no rank started (no ssh to a node, no pdsh for DeepSpeed's multi-node launcher): the launcher's last error
        who = f"the launcher ({cfg.parallel.launcher}), before any rank started,"
        cause = last_error_line(log)
        cause = f": {cause}" if cause else ""
    print(f"error: {who} failed (exit code {rc}){cause}; the launcher's report is in {log}", file=sys.stderr)
    raise RanksFailed(rc)


def _pass_sigterm_to_ranks(say: str | None, launcher: psutil.Process) -> None:
    """SIGTERM to the guards of this host's ranks, which pass it to their rank: a rank's request stops them all (they
    agree at the step's end), so the ranks of other hosts need none."""
    if say is not None:
        print(say, flush=True)
    for p in launcher.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if GUARD_MODULE in p.cmdline():
                p.send_signal(signal.SIGTERM)


def _stopped_words(workdir: Path) -> str:
    """What rank 0 said when it stopped on a SIGTERM (`Terminated`'s message), else "" (it did not get that far)."""
    said = [f["message"] for f in read_records(workdir, FAILURE_PREFIX) if f["kind"] == STOPPED and f["rank"] == 0]
    return said[0] if said else ""


def last_error_line(log: Path) -> str:
    """The last line of a launcher's log that names an error (`...Error: ...`, `error: ...`), else ""."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line.strip() for line in lines if "Error:" in line or line.lstrip().lower().startswith("error")]
    return errors[-1] if errors else ""
