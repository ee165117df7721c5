"""`train(cfg)` and `resume(run_dir)`: the command edge of training.

They check what can be checked before any process starts (`preflight`, whose `Prepared` the worker body then uses
as it is), hold the run directory's lock, and decide once whether this process trains or starts its workers under
a launcher (`run_on_ranks` of `train_on_rank`, which calls `lctrain.train.trainer.run` on every process).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from shlex import quote

import torch

from lctrain import disk, fused
from lctrain.config import (
    Config,
    bundled_config_dir,
    check_on_this_machine,
    data_dir,
    parse_override,
    reread_warning,
    settings,
    settings_changes,
    shown_changes,
)
from lctrain.console import say
from lctrain.costmodel import ModelShape
from lctrain.data.prepare import input_change, settings_left_out, tokenizer_change
from lctrain.errors import RunFailed, UserError, cited, first_and_more
from lctrain.lifetime import Reading
from lctrain.model import (
    check_heads_split,
    check_model_class,
    load_hf_config,
    model_shape,
    shape_without_download,
)
from lctrain.parallel.groups import check_launcher_env, under_launcher
from lctrain.parallel.launch import LAUNCHER_LOG, OutOfMemory, ProcessKilled, RanksHung, run_on_ranks
from lctrain.parallel.layout import WORLD_KEYS, layout_of
from lctrain.parallel.rank import is_out_of_memory
from lctrain.rundir import RunDir, train_command
from lctrain.tokenizer import check_matches_model
from lctrain.train import checkpoint as ckpt
from lctrain.train import reshard, session
from lctrain.train.data import dataset_change, dataset_record, prepare_command
from lctrain.train.metrics import import_wandb, tensorboard_writer_class
from lctrain.train.runplan import Prepared, RunPlan
from lctrain.train.trainer import SIGTERM_SAID, CheckpointHook, run


def train(cfg: Config, force: bool = False, *, before_checkpoint_complete: CheckpointHook | None = None) -> Path:
    """Start a run in `RunDir.of(cfg)`; refuses a directory where a run finished anything (checkpoints, metrics,
    evaluation exports) unless `force`."""
    check_launcher_env()
    refuse_another_runs_config(cfg)
    rd = RunDir.of(cfg)
    unfit = rd.not_for_a_run()
    if unfit is not None:  # --force or not: the run's config.yaml and outputs would land among its files
        raise UserError(f"train.run_dir = {rd}: {unfit}; set train.run_dir to another directory")
    leader = _leader()
    # marked before preflight opens it: the dataset preflight checks is the one the run reads
    with _reading_dataset(cfg, rd, leader):
        prepared = preflight(cfg) if leader else None
        with _run_lock(rd, "lctrain train", leader):
            if leader:
                if not force:
                    refuse_to_replace(rd)
                # A new run: what is left (partial checkpoints of an interrupted write, or everything under --force)
                # belongs to no run, and would mix into this one.
                rd.clear_outputs(force)
                rd.write_config(cfg)
            _start(cfg, rd, prepared, resuming=False, before_checkpoint_complete=before_checkpoint_complete)
            return rd.path


def train_or_resume(cfg: Config) -> Path:
    """`lctrain train --resume-if-exists`, one command for a job's first start and its requeues: a run directory with
    a complete checkpoint is resumed, with what `cfg` sets otherwise than the run's config.yaml as `--set` changes
    (checked as `resume` checks them: more steps or another layout pass, another model or data is refused, named as
    the run of another config where not the user's `--set` flags ask for it); one without a checkpoint (stopped
    before its first) starts over; anything else starts the run."""
    refuse_another_runs_config(cfg)
    rd = RunDir.of(cfg)
    last = ckpt.latest_checkpoint(rd) if rd.is_run() else None
    if last is not None:
        changes = {
            k: v for k, v in settings_changes(settings(rd.read_config()), settings(cfg)).items() if k != "train.run_dir"
        }
        start_over = _start_over(cfg)
        refuse_another_config(cfg, rd, _fixed(changes), last.name, start_over)
        if _leader():
            said = f", with {shown_changes(changes)}" if changes else ""
            print(f"{rd} has a checkpoint: resuming it (--resume-if-exists){said}", flush=True)
        return resume(rd.path, [f"{k}={json.dumps(now)}" for k, (_, now) in changes.items()], start_over=start_over)
    if rd.is_run() and _leader():
        print(f"{rd} stopped before its first checkpoint: starting it again (--resume-if-exists)", flush=True)
    return train(cfg, force=rd.is_run())


def refuse_another_runs_config(cfg: Config) -> None:
    """Refuse the config.yaml of a copied or moved run that names, as its file has it, the run it came from: `train`
    would start over that run, deleting it under --force, where the user named the copy."""
    run = RunDir.whose_config(cfg)
    there = run.elsewhere(run.read_config()) if run is not None else None
    if there is None or RunDir.of(cfg).path.resolve() != there.resolve():
        return  # its own directory, or one the overrides chose
    raise UserError(
        f"{cfg.source_file} is the config of the copied or moved run {run}, and its train.run_dir names {there}; "
        f"add '--set train.run_dir={quote(str(run.path))}' to act on the copy, or give {there}'s own config"
    )


def refuse_another_config(cfg: Config, rd: RunDir, fixed: dict[str, tuple], checkpoint: str, start_over: str) -> None:
    """Refuse to resume `rd` with `cfg` when they differ in what its checkpoint fixes (`fixed`, from the run's config
    to `cfg`): as a change the user's `--set` flags ask for when they give every one of them (the wording of
    `check_resumable`), else as the run of another config: a job script's config pointed at another run's directory."""
    if not fixed:
        return
    if all(cfg.overridden(key) for key in fixed):
        raise _changed_since(cfg, fixed, checkpoint, start_over)
    raise UserError(
        f"{rd} holds a run of another config than {cfg.source_file} ({shown_changes(fixed, most=3)}), and its "
        f"checkpoint {checkpoint} resumes only with the model, data and batch it was written with; set train.run_dir "
        f"to another directory, start over there (deleting that run) with {cited(start_over)}, or resume it with its "
        f"own config: {cited(f'lctrain resume {quote(str(rd))}')}"
    )


def refuse_to_replace(rd: RunDir) -> None:
    """Raise, naming what is there, when `rd` holds anything a run finished: only `--force` deletes it."""
    checkpoints = [f"{rd.checkpoints.name}/{p.name}" for p in ckpt.complete_checkpoints(rd)]
    finished = checkpoints + rd.finished_outputs()
    if not finished:
        return
    shown = first_and_more(finished, 8)
    if checkpoints:
        choices = (
            f"continue it with {cited(f'lctrain resume {quote(str(rd))}')}, or start over (deleting them): the same "
            f"command with --force"
        )
    else:
        choices = (
            "it has no checkpoint to resume from: start over (deleting them), the same command with --force, or "
            "set train.run_dir to another directory"
        )
    raise UserError(f"{rd}: a run already wrote {shown} here; {choices}")


def resume(
    run_dir: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    start_over: str | None = None,
    before_checkpoint_complete: CheckpointHook | None = None,
) -> Path:
    """Continue the run in `run_dir` from its last complete checkpoint, with nothing but that directory: relative
    paths in its config (the prepared data, a local model or tokenizer) resolve against the directory `train`
    was started from, whatever the current one. `overrides` (`--set KEY=VALUE`) change the run's config.yaml for
    this and later resumes: more steps, another parallel layout (the checkpoint is converted: reshard.py).
    `start_over`: the command a refusal advises to start the run over with, the user's own (`train
    --resume-if-exists` passes its config and `--set` flags); by default the run's config.yaml with `overrides`."""
    check_launcher_env()
    moved = [o for o in overrides if parse_override(o)[0] == ["train", "run_dir"]]
    if moved:
        raise UserError(f"--set {moved[0]}: a run resumes in its own directory, {run_dir}; train.run_dir stays")
    rd = RunDir(Path(run_dir).absolute())
    why = rd.not_a_run()
    if why is not None:
        raise UserError(f"{run_dir}: {why}; give the train.run_dir of a run started with 'lctrain train'")
    start_over = start_over or rd.start_over_command(overrides)
    leader = _leader()
    with _run_lock(rd, "lctrain resume", leader), contextlib.ExitStack() as reading:
        if ckpt.latest_checkpoint(rd) is None:
            raise UserError(
                f"{rd}: no complete checkpoint to resume from; start the run again with {cited(start_over)}"
            )
        cfg = rd.read_config(overrides)
        reading.enter_context(_reading_dataset(cfg, rd, leader))
        named = ckpt.latest_named(rd)
        if leader and named is not None and named != ckpt.latest_checkpoint(rd):
            say(
                f"warning: {rd.checkpoints / ckpt.LATEST} names {named.name}, which is missing or incomplete; "
                f"resuming from the newest complete checkpoint",
            )
        states = [(p, ckpt.readable_state(p)) for p in ckpt.resume_candidates(rd)]
        states = [(p, s) for p, s in states if s is not None]
        if not states:  # before any process builds a model: none of them could resume
            raise UserError(
                f"{rd}: no checkpoint has a readable {ckpt.STATE_FILE}; start the run again with {cited(start_over)}"
            )
        # on use: the export reads checkpoints with DeepSpeed's tools (start-up time of the other commands)
        from lctrain.train.export import unwritable_exports, write_unwritten_exports

        unwritable = write_unwritten_exports(rd) if leader else unwritable_exports(rd)
        done = max((int(s["step"]) for _, s in states if s["step"] not in unwritable), default=0)
        if done >= cfg.train.steps:
            if leader:
                of = f"step {done} of {cfg.train.steps}" if done == cfg.train.steps else f"{done} steps trained"
                print(
                    f"{rd} is complete: {of}; nothing to resume (to train further: "
                    f"lctrain resume {quote(str(run_dir))} --set train.steps=N, N > {done})",
                    flush=True,
                )
            return rd.path
        prepared = None
        if leader:
            # the layout's refusal names where it was asked for: the --set flags, else the edited config.yaml
            layout = [f"--set {o}" for o in overrides if parse_override(o)[0][0] == "parallel"]
            source = " ".join(layout) or f"{rd.config_file}"
            check_resumable(cfg, states[0][1], source, states[0][0].name, start_over)
            prepared = preflight(cfg, resuming=True)
            check_same_dataset(cfg, states[0][1], prepared.packed.manifest, states[0][0].name, start_over)
            if overrides:
                rd.write_config(cfg)  # what launched ranks and later resumes read
            _convert_for_layout(cfg, states)
        _start(cfg, rd, prepared, resuming=True, before_checkpoint_complete=before_checkpoint_complete)
        return rd.path


def _convert_for_layout(cfg: Config, states: list[tuple[Path, dict]]) -> None:
    """Convert the checkpoint the ranks will load first, if it was written with another parallel layout (but for
    ZeRO-0: `reshard.needs_universal`); one that cannot be converted (damaged, or without an RNG state a new rank
    continues with) is reported and the next tried, as loading falls back (Trainer.load_checkpoint): the ranks find
    the one they reach converted."""
    now = settings(cfg)
    for path, state in states:
        changed = reshard.layout_changes(state.get("config"), now)
        if not changed:
            return
        lacking = [ckpt.rng_file(r) for r in reshard.rng_ranks(state["config"], now)]
        lacking = [name for name in lacking if not (path / name).is_file()]
        universal = reshard.needs_universal(state["config"], now)
        if lacking:
            what = "is not converted" if universal else "cannot continue on this layout"
            say(f"warning: checkpoint {path.name} {what}: {', '.join(lacking)} missing")
            continue
        if not universal:
            return
        why = "" if reshard.converted_for(path, cfg.parallel.zero_stage) else ckpt.changed_file(path, state)
        if why:
            say(f"warning: checkpoint {path.name} could not be converted ({why})")
            continue
        try:
            seconds = reshard.convert(path, changed, cfg.parallel.zero_stage, cfg.checkpoint.sync_files)
        except ckpt.DAMAGED as e:
            if ckpt.machine_failure(e):
                raise
            say(f"warning: checkpoint {path.name} could not be converted ({type(e).__name__}: {e})")
            continue
        if seconds:
            print(f"converted {path.name} in {seconds:.0f} s", flush=True)
        return


def train_on_rank(request: dict) -> None:
    """What every launched process runs: the run directory's config, checked in this process by `run`."""
    rd = RunDir(request["run_dir"])
    run(rd.read_config(), rd, request["resume"])


def _start(
    cfg: Config,
    rd: RunDir,
    prepared: Prepared | None,
    resuming: bool,
    before_checkpoint_complete: CheckpointHook | None,
) -> None:
    """The one place that decides who trains: this process, or the workers a launcher starts (when the layout asks
    for several processes and no launcher started this one). `prepared` is None only for the ranks of a launcher
    the user started that are not its leader: they check their own."""
    if under_launcher() or prepared.plan.layout.world == 1:
        try:
            run(cfg, rd, resuming, prepared, before_checkpoint_complete=before_checkpoint_complete)
        except Exception as e:
            if not is_out_of_memory(e) or under_launcher():  # a launched rank reports its own (parallel/rank.py)
                raise
            raise _out_of_memory(rd, "the run", " ".join(str(e).split())[:300]) from None
    else:
        if before_checkpoint_complete is not None:
            raise ValueError("fault injection reaches only a run in this process, not launched workers")
        request = {"run_dir": str(rd.path.resolve()), "resume": resuming}
        layout = prepared.plan.layout
        # the ranks' start-up (imports, process groups, the model on every rank) is silent and can take minutes
        print(
            f"starting {layout.world} processes under {cfg.parallel.launcher} (its log: "
            f"{rd.ranks_dir / LAUNCHER_LOG}); the run's banner follows once every rank has built the model",
            flush=True,
        )
        began = session.now()
        try:
            outcome = run_on_ranks(
                cfg,
                f"{__name__}:train_on_rank",
                request,
                rd.ranks_dir,
                stop_on_sigterm=cfg.checkpoint.on_sigterm,
                say_on_sigterm=SIGTERM_SAID,
            )
        except (ProcessKilled, RanksHung) as e:
            raise _session_failed(rd, RunFailed(f"{e.what}; {ckpt.resume_hint(rd)}"), began, cause=True) from None
        except BaseException as e:
            _session_failed(rd, e, began)
            raise
        if isinstance(outcome, OutOfMemory):
            raise _session_failed(rd, _out_of_memory(rd, f"rank {outcome.rank}", outcome.message), began)


def _session_failed(rd: RunDir, error: BaseException, began: str, cause: bool = False) -> BaseException:
    """`error`, after completing this session's line of sessions.jsonl (begun at `began` or later) with it where rank 0
    could not (a rank killed, hung, out of memory: the launcher stops rank 0 before it says how the session ended),
    or, with `cause`, in place of the error rank 0 recorded (`session.complete_last_session`)."""
    session.complete_last_session(rd, error, began, cause)
    return error


def _out_of_memory(rd: RunDir, who: str, message: str) -> RunFailed:
    return RunFailed(f"{who} ran out of memory ({message}); `lctrain plan` shows what fits; {ckpt.resume_hint(rd)}")


# Settings a checkpoint fixes: the model it holds, the data order it continues (each step's windows: train.global_batch;
# train.micro_batch only splits them, as the data-parallel size does), and the weight decay of the optimizer's
# parameter groups (loading the optimizer state restores the saved groups' decay, and which groups decay).
# The parallel layout may change (lctrain/train/reshard.py), and so may anything else (steps; learning rate, betas, eps
# and gradient clipping, which the trainer gives the restored optimizer again: `apply_optimizer_settings`; logging,
# checkpoint and eval schedule, engine).
_FIXED_BY_CHECKPOINT = (
    "seed",
    "model.",
    "data.",
    "attention.mode",
    "train.global_batch",
    "train.weight_decay",
    "train.decay_norms_and_biases",
)
# ...except these, which change how the same computation runs (or where a dataset is found), not what it computes.
_FREE_KEYS = (
    "data.num_workers",
    "data.strict",
    "data.output_dir",
    "model.gradient_checkpointing",
    "model.checkpointing",
    "model.offload_activations",
    "model.fused_kernels",  # the same function through other kernels (tests/test_fused.py)
    "model.tiled_mlp",  # the same MLP in sequence slices (model.py)
)


def _fixed(changes: dict[str, tuple]) -> dict[str, tuple]:
    """The `changes` (of `settings_changes`) a checkpoint cannot resume with."""
    return {k: v for k, v in changes.items() if k.startswith(_FIXED_BY_CHECKPOINT) and k not in _FREE_KEYS}


def _changed_since(cfg: Config, changed: dict[str, tuple], checkpoint: str, start_over: str) -> UserError:
    return UserError(
        f"{cfg.origin(*changed)}: {shown_changes(changed)} changed since checkpoint {checkpoint}; a checkpoint "
        f"resumes only with the model, data and batch it was written with: restore them, or start over with "
        f"{cited(start_over)}"
    )


def check_resumable(cfg: Config, state: dict, source: str, checkpoint: str, start_over: str) -> None:
    """Refuse, in one line naming the keys, a config edited since the checkpoint in a way it cannot resume with;
    `start_over`: the command that starts the run over as asked."""
    saved = state.get("config")
    if saved is None:
        return  # a checkpoint from before configs were stored: the fingerprint warning in `run` is all there is
    changed = _fixed(settings_changes(saved, settings(cfg)))
    if changed:
        raise _changed_since(cfg, changed, checkpoint, start_over)
    reshard.check_reshardable(saved, settings(cfg), source, checkpoint)


def check_same_dataset(cfg: Config, state: dict, manifest, checkpoint: str, start_over: str) -> None:
    """Refuse to resume on a prepared dataset other than the checkpoint's: its windows, in an order that depends on
    their number, would be read from the checkpoint's step on as if they were the same (some twice, some never). A
    `prepare --force` after the corpus changed rebuilds the directory under the same data fingerprint."""
    if state.get("dataset") is None:
        say(
            f"warning: checkpoint {checkpoint} was written before lctrain recorded the dataset a run trains on: "
            f"whether {data_dir(cfg)} holds the windows it trained on cannot be checked (prepared again since, from "
            f"other input or by another lctrain, the resumed steps read other windows)",
        )
        return
    change = dataset_change(state["dataset"], dataset_record(manifest))
    if change is not None:
        raise UserError(
            f"{data_dir(cfg)}: the prepared dataset changed since checkpoint {checkpoint} ({change}); resuming "
            f"would read other windows than the run's. Restore the dataset the run trained "
            f"on, or start over on this one with {cited(start_over)}"
        )


def _start_over(cfg: Config) -> str:
    """The user's `lctrain train` of `cfg` (its config, a bundled one by name, and its `--set` flags) with `--force`:
    what starts its run over as they asked it."""
    source = Path(cfg.source_file)
    config = source.stem if source.parent == bundled_config_dir() else source
    return train_command(config, cfg.overrides, "--force")


def _leader() -> bool:
    """The process that checks, writes the run directory and holds its lock: the only one, or rank 0 of a
    launcher the user started (the workers lctrain launches itself run `run`, under their parent's lock)."""
    return not under_launcher() or int(os.environ.get("RANK", "0")) == 0


def _run_lock(rd: RunDir, command: str, leader: bool):
    return rd.lock(command) if leader else contextlib.nullcontext()


def _reading_dataset(cfg: Config, rd: RunDir, leader: bool):
    """The run's mark on its prepared dataset, which `prepare --force` refuses to replace while it lives: held by the
    leader for the whole run (the workers it launches end with it)."""
    if not leader:
        return contextlib.nullcontext()
    return Reading(data_dir(cfg), "lctrain train", f"the training in {rd.path.absolute()}")


def _check_launcher_world(cfg: Config) -> None:
    """Refuse a launcher the user started with another number of processes than the config asks for: the run would
    train on the launcher's, while its config.yaml records the config's, which `lctrain resume` (its own launcher),
    `plan`, `estimate` and `report` then read."""
    world, p = int(os.environ["WORLD_SIZE"]), cfg.parallel
    if world == p.world:
        return
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    fix = (
        f"--set parallel.nproc_per_node={per_node} --set parallel.num_nodes={world // per_node}"
        if per_node and world % per_node == 0
        else "set parallel.nproc_per_node x parallel.num_nodes to it"
    )
    raise UserError(
        f"{cfg.origin(*WORLD_KEYS)}: the launcher started {world} processes (WORLD_SIZE) where the config asks for "
        f"parallel.nproc_per_node x parallel.num_nodes = {p.nproc_per_node} x {p.num_nodes} = {p.world}; "
        f"make them match: {fix} (the run directory records the layout it trains on)"
    )


def _check_disk(cfg: Config) -> None:
    """Refuse a run whose outputs at their peak (`disk.plan_disk`) do not fit beside what the run directory holds
    now: a full disk at the last steps' exports is found after the whole run's time. A model whose shape needs a
    download is not checked (as for memory)."""
    if not shape_without_download(cfg):
        return
    refusal = disk.RunDisk.of(cfg, model_shape(cfg).param_count()).refusal()
    if refusal:
        raise UserError(refusal)


def preflight(cfg: Config, resuming: bool = False) -> Prepared:
    """Everything that can be checked before any process starts, so the user gets one line and exit code 2; the
    checked plan and dataset, for a run in this process (`resuming`: a resume's)."""
    check_on_this_machine(cfg, torch.cuda.is_available())
    if cfg.model.fused_kernels == "liger":
        fused.require_liger("cuda" if torch.cuda.is_available() else "cpu")
    if under_launcher():
        _check_launcher_world(cfg)
    plan = RunPlan.of(cfg, layout_of(cfg))
    if cfg.model.arch is not None or Path(cfg.resolve_source(cfg.model.name_or_path)).is_dir():
        # a bad model.arch, a model without RoPE: refused here, before the dataset is opened or anything launched
        ModelShape.from_hf_config(load_hf_config(cfg))
    check_heads_split(cfg)
    check_matches_model(cfg)
    check_model_class(cfg)
    if shape_without_download(cfg):  # an unknown hub name is not downloaded just to plan
        from lctrain.plan import memory_warning

        warning = memory_warning(cfg)  # refuses a plan beyond a known GPU's or the machine's memory: before the data
        if warning:
            say(warning)
    if cfg.checkpoint.check_disk:
        _check_disk(cfg)
    prepared = Prepared.of(cfg, plan=plan)
    changed = input_change(cfg, prepared.packed.manifest)
    if changed:  # prepare refuses to call it prepared; a run may still want the data it has: said, not refused
        again = f"'{prepare_command(cfg)} --force' first"
        say(
            f"warning: {prepared.packed.path} was prepared from other input files than data's now ({changed.words}); "
            f"this run trains on the prepared windows: to train on the input as it is, run {again}"
            if changed.sizes
            else f"warning: {prepared.packed.path}: {changed.words}; to train on its text as it is now, run {again}",
        )
    manifest = prepared.packed.manifest
    retokenized = tokenizer_change(cfg, manifest)
    if retokenized:  # said as a changed input is: the run's exports carry the tokenizer as it is now
        say(
            f"warning: {prepared.packed.path} was prepared before data.tokenizer = '{cfg.data.tokenizer}' changed: "
            f"{retokenized}; this run trains on the prepared ids, which its exports' tokenizer would not give: run "
            f"'{prepare_command(cfg)} --force' first"
        )
    reread = reread_warning(
        cfg, len(prepared.packed), manifest.source_exhausted, settings_left_out(manifest), resuming=resuming
    )
    if reread:
        say(reread)
    if cfg.logging.wandb != "disabled":
        import_wandb(cfg)
    if cfg.logging.tensorboard:
        tensorboard_writer_class(cfg)
    return prepared
