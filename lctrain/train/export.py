"""`lctrain export RUN_DIR [--step N] [--out DIR] [--force]`: the evaluation export of a resume checkpoint.

A run writes `hf/step_N/` only at the steps of `checkpoint.hf_every` / `hf_last`; its resume checkpoints
(`checkpoints/step_N/`) hold the weights of other steps in DeepSpeed's format. This turns one of them into exactly what
training would have exported at its step: the same files, model card and export record, written by the same
function (`checkpoint.write_export`), on the CPU, without a DeepSpeed engine, a process group or the base model's
weights. The model is built on the meta device from the run's config as training built it (the base model's config,
lctrain's changes to it, its generation config), and `save_pretrained` writes the checkpoint's tensors:

- ZeRO 0-2: the module's state dict in `mp_rank_00_model_states.pt`, memory-mapped: the weights in the dtype they
  trained in (bf16 under mixed precision), as the module held them; about one copy of the weights passes through
  memory.
- ZeRO-3: the module holds no weights there, only each rank's partition of the fp32 master weights: they are gathered
  one parameter at a time from the memory-mapped optimizer files (DeepSpeed's `zero_to_fp32`) and cast to the
  model's dtype, which is what the bf16 weights were (DeepSpeed copies the fp32 partition into them after each step);
  one copy of the weights in that dtype, plus the partitions' pages.

The run's settings are those the checkpoint recorded (`trainer_state.json`), so the model card says what the weights
of that step trained with, even after `resume --set train.steps=...` rewrote config.yaml.

One export at a time writes a target: a second one is refused in one line naming the first's pid (`TargetLock`, the
run lock's primitive), and so is one of a step whose export the training running in the run writes itself. An export
may run beside the training of its run; a checkpoint that training's `checkpoint.keep` removes while the export reads
it is said to be that, not damage. The export marks the run as read (`lifetime.Reading`): a new run started over in
it (`train --force`) is refused meanwhile, as it is while `lctrain eval` reads the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from lctrain.compat.deepspeed import MODULE_FILE, ZERO3_MODULE_FILE, module_state_dict, zero3_fp32_state_dict
from lctrain.compat.transformers import pretrained_generation_config
from lctrain.config import Config
from lctrain.console import no_library_bars
from lctrain.errors import UserError, output_dir
from lctrain.export_record import EXPORT_RECORD, read_export_record
from lctrain.lifetime import Reading, lock_holder
from lctrain.model import apply_changes, config_changes, load_hf_config
from lctrain.rundir import RunDir, step_of
from lctrain.tokenizer import load_tokenizer, recorded_anchor, resolve_anchor
from lctrain.train import checkpoint as ckpt
from lctrain.train.loss import CausalLMLossSum
from lctrain.train.schedule import hf_checkpoint_steps
from lctrain.units import to_gb


def export_checkpoint(
    run_dir: str | Path, step: int | None = None, out: str | Path | None = None, force: bool = False
) -> Path:
    """Write the evaluation export of `run_dir`'s resume checkpoint of `step` (default: the latest complete one) into
    `out` (default: the run's `hf/step_N/`); an export already there is replaced only with `force`. Returns `out`."""
    run = RunDir(Path(run_dir))
    not_run = run.not_a_run()
    if not_run is not None:
        raise UserError(f"{run}: {not_run}; give the directory `lctrain train` wrote (runs/NAME)")
    checkpoint = _checkpoint(run, step)
    state, why = ckpt.state_or_why(checkpoint)
    if state is None:
        raise _damaged(run, checkpoint, why, missing=not (checkpoint / ckpt.STATE_FILE).is_file())
    why = ckpt.damaged_archive(checkpoint)  # named here: the loaders' own errors say little (torch's mmap hint)
    if why:
        raise _damaged(run, checkpoint, why, missing=False)
    step = state["step"]
    target = Path(out) if out is not None else run.export(step)
    option = "--out" if out is not None else None
    if option is not None:
        output_dir(target.parent, option)  # where the lock goes: one line if it cannot be created
    # the run marked as read: a `train --force` there meanwhile would delete the checkpoint and hf/ under the export
    reading = Reading(run.path, "lctrain export", f"the export of {checkpoint.name} into {target.absolute()}")
    with reading, ckpt.TargetLock(target, option):
        if option is None:
            _refuse_an_export_training_writes(run, step, target)
        return _export(run, checkpoint, state, target, force, option)


def write_unwritten_exports(run: RunDir) -> list[int]:
    """Write the evaluation exports a stopped session owed. Training writes a step's resume checkpoint, then its
    export (a failed export then loses no step), so a session killed between the two resumes after that step and
    would never write the export: its run ends without the final model's export, with nothing said, and `lctrain
    eval` averages what is there. Each complete checkpoint whose step its training was due to export (its recorded
    `checkpoint.hf_every` / `hf_last`) and which has no `hf/step_N/` gets it here, as `lctrain export` writes it (the
    killed export's temporary directory replaced). `lctrain resume` and `train --resume-if-exists` call this under
    the run's lock. An export training wrote and the user removed since (to free disk) is not written again
    (`_exports_written`): one line names those, and `lctrain export` writes one on request.

    Returns the steps whose owed export could not be written, their checkpoint damaged since (a warning each): the
    resume is not complete at such a step, falls back past its checkpoint (`Trainer.load_checkpoint`) and trains it
    again, writing the checkpoint and the export anew."""
    owed, removed = _owed_exports(run)
    damaged = []
    newest = ckpt.complete_checkpoints(run)[-1:]
    for checkpoint, state, target, why in owed:
        step = state["step"]
        stopped = f"{target} was not written (its session stopped between checkpoint {checkpoint.name} and that export)"
        if why:
            damaged.append(step)
            then = (
                f"the resume goes back to an earlier checkpoint and writes it when it trains step {step} again"
                if [checkpoint] == newest
                else f"'lctrain export {run} --step N' writes another step's"
            )
            print(f"warning: {stopped}, and that checkpoint is damaged ({why}): not written; {then}", flush=True)
            continue
        print(f"{stopped}: writing it from the checkpoint", flush=True)
        with ckpt.TargetLock(target, None, command="lctrain resume", wait=True):
            _export(run, checkpoint, state, target, False, None)
    if removed:
        print(
            f"{', '.join(map(str, removed))}: written by training and removed since, not written again "
            f"('lctrain export {run} --step N' writes one from its checkpoint)",
            flush=True,
        )
    return damaged


def unwritable_exports(run: RunDir) -> list[int]:
    """`write_unwritten_exports`'s steps, found without writing or saying anything: the ranks of a launcher the user
    started but its rank 0 (which writes) call this to agree with it on where the run stands. The exports rank 0
    writes meanwhile are of undamaged checkpoints, which this leaves out whether it sees them written or not."""
    return [state["step"] for _, state, _, why in _owed_exports(run)[0] if why]


def _owed_exports(run: RunDir) -> tuple[list[tuple[Path, dict, Path, str]], list[Path]]:
    """The exports a stopped session owed, each as (checkpoint, its trainer state, the export's directory, why the
    checkpoint cannot give it: '' if it can), and those training wrote and the user removed since."""
    owed, removed = [], []
    written_before = None
    for checkpoint in ckpt.complete_checkpoints(run):
        state = ckpt.readable_state(checkpoint)
        if state is None:
            continue
        step = state["step"]
        target = run.export(step)
        if target.exists():
            continue
        cfg = _trained_config(run, state)
        if step not in hf_checkpoint_steps(cfg.train.steps, cfg.checkpoint):
            continue
        written_before = written_before or _exports_written(run)
        if written_before(step):
            removed.append(target)
            continue
        files = _files_read(cfg, state, checkpoint)
        why = ckpt.damaged_archive(checkpoint) or ckpt.changed_file(checkpoint, state, files)
        owed.append((checkpoint, state, target, why))
    return owed, removed


def _exports_written(run: RunDir) -> Callable[[int], bool]:
    """Whether training wrote a step's export, from the run's records read once: a session trains on after a step
    only once its export is written (a failed one ends the session), so a later step in metrics.jsonl says it was, as
    does a session that ended at the step finished or stopped by SIGTERM (which stops after the step's writes). A
    session killed, interrupted or failed at the step may have stopped between its checkpoint and its export."""
    last = max((record["step"] for record in run.read_metrics()), default=0)
    clean = ("finished", "stopped by SIGTERM")
    ended = {s.get("end_step") for s in run.read_sessions() if s.get("outcome") in clean}
    return lambda step: step < last or step in ended


def _refuse_an_export_training_writes(run: RunDir, step: int, target: Path) -> None:
    """Refuse `hf/step_N` while the training running in `run` is yet to write it itself: a step of its
    `checkpoint.hf_every` / `hf_last` schedule after the one its session started at, whose export is not there and
    after which it logged no step yet. It writes that export right after the step's resume checkpoint, which is when
    this one can start, through the same temporary directory: it would wait for this export (its `TargetLock`) and
    write the step again."""
    holder = lock_holder(run.path)
    if holder is None or (target / EXPORT_RECORD).is_file():
        return
    sessions = run.read_sessions()
    started = sessions[-1].get("start_step", 0) if sessions else 0
    try:
        cfg, logged = run.read_config(), run.read_metrics()
    except UserError:
        return  # a damaged config or metrics file: the training's schedule is not known, the export goes on
    if step <= started or (logged and logged[-1]["step"] > step):
        return
    if step not in hf_checkpoint_steps(cfg.train.steps, cfg.checkpoint):
        return
    pid = holder.get("pid", "it")
    raise UserError(
        f"{target}: the training running in {run} (pid {pid}) writes this export itself (checkpoint.hf_every / "
        f"hf_last); wait for it to write it, or stop the training (kill {pid}), or export to another --out"
    )


def _export(run: RunDir, checkpoint: Path, state: dict, target: Path, force: bool, option: str | None) -> Path:
    """`export_checkpoint`'s work, under the target's lock."""
    step = state["step"]
    _check_target(target, force, option)
    cfg = _trained_config(run, state)
    dtype = getattr(torch, cfg.model.dtype)
    tokenizer = load_tokenizer(cfg.resolve_source(cfg.data.tokenizer))
    anchor = resolve_anchor(tokenizer, cfg.data.anchor, cfg.data.tokenizer)
    recorded = recorded_anchor(run.path)
    if recorded is not None and recorded.id != anchor.id:
        raise UserError(
            f"{run}: its anchor.json records {recorded.token} (id {recorded.id}) but data.tokenizer and data.anchor "
            f"now give {anchor.token} (id {anchor.id}); restore the tokenizer the run trained with"
        )
    no_library_bars()
    zero3 = _zero3(cfg, state, checkpoint)
    why = ckpt.changed_file(checkpoint, state, _files_read(cfg, state, checkpoint))
    if why:
        raise _damaged(run, checkpoint, why)
    how = f"gathering ZeRO-3's fp32 partitions into {cfg.model.dtype}" if zero3 else f"reading {MODULE_FILE}"
    print(f"export: checkpoint {checkpoint.name} of {run} -> {target} ({how})", flush=True)
    started = time.monotonic()
    state_dict = _weights(run, checkpoint, zero3, dtype)
    lm = _skeleton(cfg, state_dict, dtype, run, checkpoint)
    ckpt.write_export(target, lm, tokenizer, anchor, step, cfg, state_dict=state_dict)
    size = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    print(
        f"export: wrote {target} (step {step}, {to_gb(size):.2f} GB, {time.monotonic() - started:.0f} s); "
        f"AutoModelForCausalLM.from_pretrained('{target}') loads it, `lctrain eval` scores it",
        flush=True,
    )
    return target


def _zero3(cfg: Config, state: dict, checkpoint: Path) -> bool:
    """Whether the checkpoint holds ZeRO-3's partitions: the stage it recorded; one written before checkpoints
    recorded their settings, by its files."""
    return cfg.parallel.zero_stage == 3 if "config" in state else (checkpoint / ZERO3_MODULE_FILE).is_file()


def _files_read(cfg: Config, state: dict, checkpoint: Path) -> list[str] | None:
    """The checkpoint's files an export reads, for `checkpoint.changed_file` (None: all, ZeRO-3's partitions)."""
    return None if _zero3(cfg, state, checkpoint) else [MODULE_FILE]


def _checkpoint(run: RunDir, step: int | None) -> Path:
    """The complete checkpoint to export: of `step`, else the latest."""
    done = ckpt.complete_checkpoints(run)
    have = f"its complete checkpoints: {', '.join(p.name for p in done)}" if done else "it has none"
    if step is None:
        latest = ckpt.latest_checkpoint(run)
        if latest is None:
            raise UserError(
                f"{run}: no complete resume checkpoint in {run.checkpoints} to export (a run writes them every "
                f"checkpoint.every_steps steps and at its end)"
            )
        return latest
    found = [p for p in done if step_of(p) == step]
    if not found:
        raise UserError(f"{run}: no complete checkpoint of step {step} ({have}); give one of them to --step")
    return found[-1]


def _damaged(run: RunDir, checkpoint: Path, why: str, missing: bool = False) -> UserError:
    """The refusal of a checkpoint that cannot be read (`why`); `missing`: a file of it is not there."""
    removed = _removed_by_training(run, checkpoint) if missing else None
    if removed is not None:
        return removed
    others = [p.name for p in ckpt.complete_checkpoints(run) if p != checkpoint]
    then = f"export another with --step ({', '.join(others)})" if others else "it is the run's only checkpoint"
    return UserError(f"{checkpoint}: damaged ({why}); {then}")


def _removed_by_training(run: RunDir, checkpoint: Path) -> UserError | None:
    """The refusal of a checkpoint the training running in `run` removed (or is removing) under the export, by
    `checkpoint.keep`: while the run's lock is held, one gone or older than the `keep` newest complete ones. None
    otherwise (no training running, or a checkpoint it keeps: damage)."""
    holder = lock_holder(run.path)
    if holder is None:
        return None
    try:
        keep = run.read_config().checkpoint.keep
    except UserError:
        keep = None
    kept = ckpt.complete_checkpoints(run)[-keep:] if keep else None
    if checkpoint.is_dir() and (kept is None or checkpoint in kept):
        return None
    pid = f"pid {holder['pid']}; " if "pid" in holder else ""
    setting = f"checkpoint.keep={keep}" if keep else "checkpoint.keep"
    return UserError(
        f"{checkpoint} was removed by the training running in {run} ({pid}{setting}); export again, or export a "
        f"step it keeps"
    )


def _check_target(target: Path, force: bool, option: str | None) -> None:
    """Refuse to replace an export without `force`, and anything but an export (or an empty directory) at all."""
    if target.exists() and not target.is_dir():
        raise UserError(f"{option or 'the export'} {target}: a file is in the way; remove it or choose another --out")
    if target.is_dir() and any(target.iterdir()):
        # an export records itself; in the run's own hf/, an export of an lctrain from before the record has only its
        # config.json. Elsewhere (--out) a config.json alone is some model's folder: the base model trained from
        ours = (target / EXPORT_RECORD).is_file() or (option is None and (target / "config.json").is_file())
        if not ours:
            raise UserError(
                f"{target}: a directory that is not an export is in the way (--force replaces only an export); "
                f"choose another --out"
            )
        if not force:
            record = _quiet_record(target)
            what = f"the export of step {record.step}" if record is not None else "an export"
            raise UserError(f"{target}: {what} is already there; --force replaces it, or choose another --out")
    if option is not None:
        output_dir(target.parent, option)


def _quiet_record(target: Path):
    try:
        return read_export_record(target)
    except UserError:
        return None


def _trained_config(run: RunDir, state: dict) -> Config:
    """The config the checkpoint's weights trained with: its recorded settings (the paths resolving as the run's
    config.yaml says), else (a checkpoint written before checkpoints recorded them) config.yaml's."""
    now = run.read_config()
    saved = state.get("config")
    if saved is None:
        return now
    try:
        return Config.model_validate({**saved, "workdir": now.workdir, "source_file": str(run.config_file)})
    except ValueError:  # pydantic's ValidationError: settings of another lctrain version
        return now


def _weights(run: RunDir, checkpoint: Path, zero3: bool, dtype: torch.dtype) -> dict:
    """The language model's state dict in the checkpoint (the loss wrapper's prefix stripped), tied weights one
    tensor under both names, as `save_pretrained` expects them."""
    try:
        if not zero3:
            return CausalLMLossSum.lm_state_dict(module_state_dict(checkpoint))
        gathered, done = {}, {}
        for name, tensor in zero3_fp32_state_dict(checkpoint).items():
            if id(tensor) in done:  # a tied parameter: the same object under both names
                gathered[name] = gathered[done[id(tensor)]]
                continue
            full = tensor.contiguous()
            gathered[name] = full.to(dtype) if full.is_floating_point() else full
            done[id(tensor)] = name
        return CausalLMLossSum.lm_state_dict(gathered)
    except ckpt.DAMAGED as e:
        if ckpt.machine_failure(e):
            raise
        if isinstance(e, FileNotFoundError) and e.filename:
            why = f"{Path(e.filename).name} is missing"
        else:
            why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        # read while training's `checkpoint.keep` removes it: a file gone, or the checkpoint no longer complete
        missing = isinstance(e, FileNotFoundError) or checkpoint not in ckpt.complete_checkpoints(run)
        raise _damaged(run, checkpoint, why, missing) from None


def _configured(cfg: Config, vocab_size: int | None):
    """The Hugging Face config the run trained: the model's own with lctrain's changes (`model.config_changes`), as
    `build_model` applies them. The attention implementation is not saved with a config: the export's is eager."""
    hf_config = load_hf_config(cfg)
    apply_changes(hf_config, config_changes(hf_config, cfg, vocab_size=vocab_size, attn_implementation="eager"))
    hf_config.standardize_rope_params()
    return hf_config


def _meta_model(hf_config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="eager")


def _skeleton(cfg: Config, state_dict: dict, dtype: torch.dtype, run: RunDir, checkpoint: Path):
    """The run's model without weights (meta tensors), for `save_pretrained(state_dict=...)`: its config and
    generation config are what the trained model's were. A `model.arch` model's vocabulary is the checkpoint's
    embedding rows (training sizes it from the prepared dataset's tokenizer); the checkpoint must hold exactly the
    model's tensors, in their shapes."""
    lm = _meta_model(_configured(cfg, None), dtype)
    if cfg.model.arch is not None:
        embedding = lm.get_input_embeddings().weight
        name = next(n for n, p in lm.named_parameters() if p is embedding)
        rows = state_dict[name].shape[0] if name in state_dict else None
        if rows is not None and rows != lm.config.vocab_size:
            lm = _meta_model(_configured(cfg, rows), dtype)
    else:
        lm.generation_config = pretrained_generation_config(cfg.resolve_source(cfg.model.name_or_path))
    expected = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state_dict.items()}
    if expected != found:
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        shapes = [k for k in expected if k in found and expected[k] != found[k]]
        detail = "; ".join(
            f"{what}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
            for what, keys in (("missing", missing), ("not in the model", extra), ("other shapes", shapes))
            if keys
        )
        raise UserError(
            f"{checkpoint}: its weights are not those of the model {run.config_file} describes ({detail}); was the "
            f"config edited since? restore it"
        )
    return lm
