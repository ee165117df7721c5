"""Resume checkpoints (DeepSpeed state + trainer state) and evaluation checkpoints (Hugging Face format).

Crash safety: every checkpoint is written under a temporary name in the same directory and renamed once complete;
`checkpoints/latest` names the newest complete one and is replaced (atomically) only after the rename; older ones
are pruned only after that. A kill at any moment therefore leaves the previous complete checkpoint and a stale
temporary directory, which the next save or resume removes. Against a machine's crash, every rank syncs the files it
wrote to the disk before the checkpoint is made complete (`checkpoint.sync_files`). The trainer state records every
file's size and content checksum, so a file changed after it was written (a flipped byte, another step's file of the
same size) is a damaged checkpoint, not other weights loaded without a word.

    run_dir/checkpoints/step_20/   DeepSpeed files, trainer_state.json, rng_rank<R>.pt
    run_dir/checkpoints/latest     "step_20"
    run_dir/hf/step_20/            save_pretrained weights (5GB shards) + tokenizer, anchor.json, README.md (the model
                                   card), export.json (its step, files); written by `write_export`, which
                                   `lctrain export` (export.py) also writes through from a resume checkpoint

(the paths are `lctrain.rundir.RunDir`'s.)
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import tempfile
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from shlex import quote
from typing import NamedTuple

import numpy as np
import torch

from lctrain.checksums import file_checksums
from lctrain.compat.deepspeed import (
    loading_universal,
    no_bf16_optimizer_load_print,
    saves_synced,
    zero3_full_state_dict,
)
from lctrain.compat.transformers import config_json_text, legacy_rope_keys
from lctrain.config import Config
from lctrain.errors import UserError, WriteFailed, cited, is_environment_error, remedy_of, writing
from lctrain.export_record import write_export_record
from lctrain.files import TEMPORARY_PREFIX, fsync_path, readable_as_config_json, replace_file
from lctrain.lifetime import RunLock
from lctrain.rundir import RunDir, by_step, step_of
from lctrain.tokenizer import Anchor, save_tokenizer, write_anchor
from lctrain.train import reshard
from lctrain.train.loss import CausalLMLossSum
from lctrain.train.model_card import model_card

STATE_FILE = "trainer_state.json"
LATEST = "latest"


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place; an older one with the same name (a re-run step) goes only after."""
    fsync_path(tmp)
    old = None
    if final.exists():
        old = final.with_name(TEMPORARY_PREFIX + "old-" + final.name)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.startswith(TEMPORARY_PREFIX) and (path / STATE_FILE).is_file()


def complete_checkpoints(run: RunDir) -> list[Path]:
    """The complete checkpoints, oldest step first."""
    if not run.checkpoints.is_dir():
        return []
    return by_step(p for p in run.checkpoints.iterdir() if _is_complete(p))


def resume_candidates(run: RunDir) -> list[Path]:
    """Complete checkpoints to resume from, best first: the one `latest` names, then the others newest first. A
    checkpoint damaged after it was completed (a truncated file, an emptied state) is skipped for the next."""
    latest = latest_checkpoint(run)
    rest = [p for p in reversed(complete_checkpoints(run)) if p != latest]
    return ([latest] if latest is not None else []) + rest


def readable_state(path: Path) -> dict | None:
    """The trainer state of a checkpoint, or None if it cannot be read (empty, torn, edited, another step's)."""
    return state_or_why(path)[0]


# The fields of trainer_state.json besides `step`, and their JSON types. Each may be absent (`config` is in
# checkpoints written since resume compares configs); one that is there with another type is damage.
_STATE_FIELDS = {
    "windows_consumed": int,
    "config_fingerprint": str,
    "world_size": int,
    "sp": int,
    "wandb_id": str,
    "time": (int, float),
    "config": dict,
    "files": dict,
    "checksums": dict,
}


def state_or_why(path: Path) -> tuple[dict | None, str]:
    """(the trainer state of checkpoint `path`, "") or (None, why it is not one): the one reader of
    trainer_state.json. Its step must be the directory's own: a state moved between checkpoints would resume
    another step's weights as this one's."""
    try:
        state = read_state(path)
    except (OSError, ValueError) as e:
        return None, f"{STATE_FILE} is unreadable ({type(e).__name__})"
    if not isinstance(state, dict):
        return None, f"{STATE_FILE} is not a JSON object"
    step = state.get("step")
    if type(step) is not int:
        return None, f"{STATE_FILE} has no integer 'step'"
    expected = step_of(path)
    if expected is not None and step != expected:
        return None, f"{STATE_FILE} is of step {step}, not {expected} (moved from another checkpoint?)"
    wrong = [k for k, kind in _STATE_FIELDS.items() if k in state and not _is(state[k], kind)]
    if wrong:
        return None, f"{STATE_FILE}: {', '.join(wrong)} of the wrong type"
    why = _files_problem(path, state.get("files", {}))  # checkpoints written before the record have none
    return (None, why) if why else (state, "")


def _file_sizes(path: Path) -> dict[str, int]:
    """{name: bytes} of the files every rank wrote into checkpoint `path`."""
    return {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}


def hash_shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The files (`sizes`: {name: bytes}) each of `world` ranks hashes, largest first to the least loaded rank: the
    one file of ZeRO-0/1/2's whole model states is one rank's share, the optimizer's shards spread over the others."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = min(range(world), key=lambda r: (loads[r], r))
        shares[least].append(name)
        loads[least] += sizes[name]
    return shares


def changed_files(path: Path, checksums: dict, names: list[str]) -> list[str]:
    """Those of `names` whose bytes in checkpoint `path` are not the ones their recorded checksum (`checksums`, the
    trainer state's) was taken of: a flipped byte inside a tensor, or another checkpoint's file of the same size,
    which the sizes and the archives' structure do not show and which loads as other weights (a 2-process run resumed
    from a weight file with one byte changed: loss 26872 at its next step, taken for a divergence)."""
    return [n for n in names if (path / n).is_file() and file_checksums(path / n)[0] != checksums.get(n)]


def changed_file(path: Path, state: dict, names: list[str] | None = None) -> str:
    """Why the first of `names` (default: every file recorded) of checkpoint `path`, whose trainer state is `state`,
    no longer holds the bytes it was written with ('' if none, or if `state` records no checksums: a checkpoint
    written before lctrain kept them). In this process alone; a run's ranks share the work (`changed_on_disk`)."""
    checksums = state.get("checksums") or {}
    names = sorted(checksums) if names is None else [n for n in names if n in checksums]
    changed = changed_files(path, checksums, names)
    return _why_changed(changed[0]) if changed else ""


def changed_on_disk(path: Path, device: torch.device | str = "cpu") -> str:
    """`changed_file` of checkpoint `path` with the hashing shared by a run's ranks (`hash_shares`), which agree on
    the first file changed: every rank calls this. '' as well where its state is refused (`load_resume` says why).
    Each rank reads about 1/world of the checkpoint once more (SmolLM2-135M's 1.9 GB: 0.8 s on one core)."""
    state = readable_state(path) or {}
    checksums, sizes = state.get("checksums") or {}, state.get("files") or {}
    names = sorted(checksums)
    world, rank = _world_and_rank()
    share = hash_shares({n: sizes.get(n, 0) for n in names}, world)[rank]
    changed = changed_files(path, checksums, share)
    first = torch.tensor([min((names.index(n) for n in changed), default=len(names))], device=device)
    if world > 1:
        torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MIN)
    index = int(first.item())
    return _why_changed(names[index]) if index < len(names) else ""


def _why_changed(name: str) -> str:
    return f"{name} holds other bytes than it was written with: its xxh3-128 checksum differs"


def _world_and_rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def _checksums_of_ranks(path: Path, sizes: dict[str, int]) -> dict[str, str]:
    """{name: checksum of every byte} of checkpoint `path`'s files (`sizes`, rank 0's listing), each rank hashing its
    share (`hash_shares`): the files are still in the page cache of the ranks that wrote them on one node, and no one
    rank reads the whole checkpoint (a 7B model's: ~100 GB)."""
    world, rank = _world_and_rank()
    share = hash_shares(sizes, world)[rank]
    mine = {n: file_checksums(path / n)[0] for n in share}
    if world == 1:
        return mine
    gathered: list[dict[str, str]] = [{} for _ in range(world)]
    torch.distributed.all_gather_object(gathered, mine)
    return {n: c for part in gathered for n, c in part.items()}


def _files_problem(path: Path, files: dict) -> str:
    """Why checkpoint `path` lacks a file it was written with, or holds one of another size ('' if none): a stat per
    file, for every reader of the state; `load_resume` reads the archives' structure too."""
    for name, size in files.items():
        if not isinstance(size, int) or isinstance(size, bool):
            return f"{STATE_FILE}: the size of {name} is not a number"
        try:
            got = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if got != size:
            return f"{name} has {got:,} bytes, not the {size:,} written"
    return ""


def damaged_archive(path: Path) -> str:
    """The first of checkpoint `path`'s torch.save archives that would not load, with why ('' if none)."""
    return next((f"{f.name}: {why}" for f in sorted(path.glob("*.pt")) if (why := _unreadable_archive(f))), "")


def _unreadable_archive(file: Path) -> str:
    """Why torch.save's zip archive `file` would not load ('' if it would): its directory and its pickled structure,
    read with their CRC checks. The tensors' bytes are left unread (the whole checkpoint's size in reads); the
    pickles, kilobytes, are where a load would fail."""
    try:
        with zipfile.ZipFile(file) as archive:
            for member in archive.infolist():
                if member.filename.endswith(".pkl"):
                    archive.read(member)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:  # an OSError is the machine's, not the file's
        return f"{type(e).__name__}: {e}"
    return ""


def _is(value, kind) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def resume_hint(run: RunDir, resume: str | None = None) -> str:
    """What continues `run` once it has stopped: `lctrain resume RUN` (or `resume`, the command to say instead) from
    its newest complete checkpoint, or a new start when none was written yet."""
    last = latest_checkpoint(run)
    if last is None:
        return f"no checkpoint was written yet: {cited(run.start_over_command())} starts it over"
    return f"{cited(resume or f'lctrain resume {quote(str(run.path))}')} continues from {last.name}"


def latest_checkpoint(run: RunDir) -> Path | None:
    """The checkpoint `latest` names; if that file is missing or stale, the newest complete checkpoint."""
    named = latest_named(run)
    if named is not None and _is_complete(named):
        return named
    done = complete_checkpoints(run)
    return done[-1] if done else None


def latest_named(run: RunDir) -> Path | None:
    """The checkpoint `checkpoints/latest` names, whether or not it is there; None without a readable marker or
    for a name that is not a checkpoint's (`step_N`: never a path out of the directory)."""
    try:
        name = (run.checkpoints / LATEST).read_bytes().decode().strip()
    except (OSError, ValueError):
        return None
    return run.checkpoints / name if step_of(name) is not None else None


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def barrier() -> None:
    """Every rank waits for the others here (a checkpoint's writes, any rank's)."""
    # deepspeed on use: it takes seconds to import (start-up time)
    import deepspeed.comm as dist

    # NCCL's barrier guesses its device unless told: a UserWarning at every checkpoint of a one-GPU run, whose
    # process group DeepSpeed binds to no device (seen on an H200, 2026-11-26)
    nccl = torch.distributed.get_backend() == "nccl"
    dist.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)


def check_output_dir(path: Path, what: str) -> None:
    """Refuse, before a run's first step, a directory of its `what` ("resume checkpoints", "evaluation exports") that
    cannot be created or written where the run puts it: a file in its place or in one of its parents, a read-only
    filesystem or parent, a lost permission. One line naming the path and the cause, where the first write would
    otherwise fail only once the steps before it are trained. A directory created and removed inside it is the probe
    (what a checkpoint's write does first); the directories this check created are removed again."""
    blocker = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        where = "is a file where it goes" if blocker == path else f"cannot be created: {blocker} is a file"
        raise UserError(
            f"{path}: the directory of the {what} {where}; move or remove the file, then run the command again"
        )
    missing = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=TEMPORARY_PREFIX + "probe-", dir=path))
    except OSError as e:
        raise UserError(
            f"{path}: cannot create the directory of the {what} or write into it ({e.strerror or e}); "
            f"{remedy_of(e)}, then run the command again"
        ) from None
    finally:
        for p in missing:
            with contextlib.suppress(OSError):
                p.rmdir()


def save_resume(
    engine,
    run: RunDir,
    step: int,
    state: dict,
    *,
    rank: int,
    keep: int,
    sync: bool = True,
    before_complete: Callable[[int], None] | None = None,
) -> Path:
    """Write the resume checkpoint of `step` (all ranks call this) and prune older ones; `sync`: every rank's files
    are on the disk before the checkpoint is complete (`checkpoint.sync_files`). `before_complete(step)` runs on rank
    0 once every rank's files are written and before the checkpoint is complete (fault injection)."""
    root, final = run.checkpoints, run.checkpoint(step)
    tmp = root / (TEMPORARY_PREFIX + final.name)
    try:
        if rank == 0:
            with writing(root, "the checkpoints directory"):
                root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            with writing(tmp, "the resume checkpoint"):
                # made here: DeepSpeed only logs a failed makedirs (a full disk, a read-only mount), and its next
                # write fails with a RuntimeError naming no cause
                tmp.mkdir()
        barrier()
        with writing(tmp, "the resume checkpoint"), saves_synced(engine) if sync else contextlib.nullcontext():
            engine.save_checkpoint(str(root), tag=tmp.name, save_latest=False)
            torch.save({**rng_state(), "step": step}, tmp / rng_file(rank))
            if sync:
                fsync_path(tmp / rng_file(rank))
    except BaseException as e:
        if rank == 0:  # a full disk's space back for the session's record and the resume (the others' parts too)
            _release_files(e)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    sizes = _broadcast(_file_sizes(tmp) if rank == 0 else None)
    checksums = _checksums_of_ranks(tmp, sizes)
    if rank == 0:
        if before_complete is not None:
            before_complete(step)
        state = {**state, "files": sizes, "checksums": checksums}
        replace_file(tmp / STATE_FILE, json.dumps(state, indent=1), "a checkpoint file")
        with writing(final, "the resume checkpoint"):
            _replace_dir(tmp, final)
        replace_file(root / LATEST, final.name + "\n", "a checkpoint file")
        prune(run, keep)
    barrier()
    return final


def _broadcast(value):
    """Rank 0's `value` on every rank: one listing of a checkpoint for all (a shared file system may show a rank a
    directory before another rank's files are in it)."""
    if _world_and_rank()[0] == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _release_files(error: BaseException) -> None:
    """Clear the finished frames of `error`'s chain: a failed write's frames (torch.save's zip writer) hold its file
    open, so removing the file would free no space while the error lives (verify explorer: a 40 MB tmpfs stayed full
    until the process ended)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def remove_leftovers(run: RunDir) -> None:
    """Remove what interrupted checkpoint writes left (a kill, a full disk): on a full disk, the space a resume
    needs before it writes anything (metrics.jsonl's cut, a universal conversion)."""
    for stale in run.checkpoints.glob(TEMPORARY_PREFIX + "*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def prune(run: RunDir, keep: int) -> None:
    """Remove all but the `keep` newest complete checkpoints, and leftovers of interrupted writes."""
    remove_leftovers(run)
    done = complete_checkpoints(run)
    for old in done[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)


# What loading a damaged checkpoint raises: torch.load on a truncated file (RuntimeError from the zip reader,
# EOFError, UnpicklingError), a torn or empty JSON state (ValueError), a missing file (OSError; DeepSpeed asserts
# that its model-state file exists: AssertionError), an RNG state of another form (TypeError from its setters).
DAMAGED = (
    OSError,
    RuntimeError,
    EOFError,
    ValueError,
    KeyError,
    TypeError,
    AssertionError,
    pickle.UnpicklingError,
)


def machine_failure(e: BaseException) -> bool:
    """Failures of the machine while loading (out of memory, a device or collective error, permissions, a full disk),
    which DAMAGED's broad types also catch."""
    return (
        isinstance(e, torch.OutOfMemoryError)
        or is_environment_error(e)
        or (isinstance(e, RuntimeError) and any(k in str(e) for k in ("CUDA", "NCCL", "out of memory")))
    )


class Restored(NamedTuple):
    """What `load_resume` gives: the checkpoint's trainer state, or None and why this rank could not restore it;
    `conversion_failed`: its universal conversion (reshard.py) is what failed to load, so converting it again may
    succeed where this one cannot."""

    state: dict | None
    why: str = ""
    conversion_failed: bool = False


def load_resume(engine, path: Path, *, rank: int, now: dict | None = None) -> Restored:
    """Restore DeepSpeed state and this rank's RNG from a complete checkpoint: its trainer state, or None and why,
    if this rank's part cannot be loaded or is another step's (files moved between checkpoints). `now`: the run's
    settings; a checkpoint written with another parallel layout loads from its universal form (reshard.py)."""
    state, why = state_or_why(path)
    if state is None:
        return Restored(None, why)
    # every rank reads every file's structure before any loads: a ZeRO-3 load runs collectives, and a rank that met a
    # damaged file inside them left the others waiting (2 ranks, an optimizer file truncated or its first 4 KB zeroed:
    # a hang; the sizes `state_or_why` checks see only the first)
    damaged = damaged_archive(path)
    if damaged:
        return Restored(None, damaged)
    step = state["step"]
    changed = reshard.layout_changes(state.get("config"), now) if now is not None else []
    universal = bool(changed) and reshard.needs_universal(state["config"], now)
    if universal and not reshard.converted_for(path, now["parallel"]["zero_stage"]):
        return Restored(
            None, f"it was written with another parallel layout ({', '.join(changed)}) and is not converted"
        )
    try:
        loaded = _load_deepspeed_state(engine, path, universal)
    except DAMAGED as e:
        return Restored(None, _conversion(universal) + _why_damaged(e, engine), conversion_failed=universal)
    if loaded is None:
        why = "DeepSpeed found no loadable state (another parallel layout or DeepSpeed version?)"
        return Restored(None, _conversion(universal) + why, conversion_failed=universal)
    if engine.global_steps != step:
        return Restored(
            None, f"DeepSpeed's state is of step {engine.global_steps}, not {step} (moved from another checkpoint?)"
        )
    own_rng = rng_file(reshard.rng_rank(rank, state["config"]) if changed else rank)
    try:
        rng = torch.load(path / own_rng, weights_only=False)
        if not isinstance(rng, dict):
            return Restored(None, f"{own_rng} is not an RNG state")
        if rng.get("step", step) != step:  # checkpoints written before the RNG state recorded its step have none
            return Restored(None, f"{own_rng} is of step {rng['step']}, not {step} (moved from another checkpoint?)")
        set_rng_state(rng)
    except DAMAGED as e:
        return Restored(None, _why_damaged(e, engine))
    return Restored(state)


def _conversion(universal: bool) -> str:
    return "its universal conversion: " if universal else ""


def _load_deepspeed_state(engine, path: Path, universal: bool):
    """DeepSpeed's state of checkpoint `path`, from its universal form if `universal`; DeepSpeed's load path, or
    None where it found nothing to load."""
    if universal:
        with loading_universal(engine):
            loaded, _ = engine.load_checkpoint(
                str(path), tag=reshard.UNIVERSAL, load_optimizer_states=True, load_lr_scheduler_states=True
            )
    else:
        with no_bf16_optimizer_load_print():
            loaded, _ = engine.load_checkpoint(
                str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
            )
    if loaded is not None and engine.zero_optimization_partition_weights():
        # ZeRO-3's load leaves its persistent parameters (the norms) gathered, and its first step releases every
        # parameter after use: a checkpointed layer's forward then did not gather them and its recomputation did,
        # which selective checkpointing takes for a nondeterministic region ("aten.view.default invocation index N
        # encountered during backward but not found in storage"). Partitioned, as a new engine's are.
        engine.empty_partition_cache()
    return loaded


def _why_damaged(e: BaseException, engine) -> str:
    """Why loading failed with `e`, one of DAMAGED's types; a failure of the machine is raised again: falling back
    to an older checkpoint would hide it."""
    if machine_failure(e):
        raise e
    if isinstance(e, FileNotFoundError):
        return f"{Path(e.filename or '').name or 'a file'} is missing"
    if isinstance(e, AssertionError) and not str(e):  # DeepSpeed's check that its model-state file exists
        return "a DeepSpeed state file is missing"
    if isinstance(e, ValueError) and "different number of parameter groups" in str(e):  # torch's Optimizer
        return (
            f"its optimizer state has another number of parameter groups than this run's "
            f"{len(engine.optimizer.param_groups)}: lctrain before 2026-11-29 put every parameter of a ZeRO-3 run "
            f"from pretrained weights in one group, which this version cannot load"
        )
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


@contextlib.contextmanager
def _with_kv_cache(lm):
    """Training turns the model's KV cache off (`use_cache: false`, lctrain.model); an export saved so made every
    plain `generate()` of its users recompute the whole prefix per token (9x slower at 1K tokens, quadratic in the
    length). Saved with the cache on, the training model's config restored after."""
    configs = [c for c in (lm.config, getattr(lm, "generation_config", None)) if hasattr(c, "use_cache")]
    before = [c.use_cache for c in configs]
    for c in configs:
        c.use_cache = True
    try:
        yield
    finally:
        for c, value in zip(configs, before):
            c.use_cache = value


def save_hf(
    engine,
    lm,
    tokenizer,
    anchor: Anchor,
    run: RunDir,
    step: int,
    *,
    rank: int,
    zero_stage: int,
    cfg: Config,
) -> Path:
    """Export the model of `step` into `run`'s `hf/step_N/` (`write_export`) with the `anchor` trained with (all ranks
    call: ZeRO-3 gathers the shards). `cfg`: the run's config, for the model card."""
    if zero_stage == 3:
        full = zero3_full_state_dict(engine)
        state_dict = CausalLMLossSum.lm_state_dict(full) if rank == 0 else None
    else:
        state_dict = None
    if rank == 0:
        with TargetLock(run.export(step), None, command="lctrain train", wait=True):
            write_export(run.export(step), lm, tokenizer, anchor, step, cfg, state_dict=state_dict)
    barrier()
    return run.export(step)


class TargetLock(RunLock):
    """Held while an export's `target` is checked and written (`write_export`): a lock file beside it (where its
    temporary directory goes too), removed when done. A second `lctrain export` of the same target is refused: two
    at once wrote each other's files into one temporary directory. The training's own export (`save_hf`, `wait`)
    waits for one instead: the step's export is part of the run."""

    def __init__(self, target: Path, option: str | None, command: str = "lctrain export", wait: bool = False):
        super().__init__(target.parent, command, name=f".lctrain-export-{target.name}.lock", remove=True)
        self.target, self.option, self.wait = target, option, wait

    def busy(self, holder: str, pid: str) -> str:
        return (
            f"{self.target}: another export is writing it, {holder}; wait for it to finish or stop it (kill {pid}), "
            f"or export to another --out"
        )

    def cannot_create(self, e: OSError) -> UserError:
        if is_environment_error(e):  # a full disk, a read-only filesystem: worded as any write's failure
            return WriteFailed(e.filename or self.path, "the export's lock file", e.strerror or str(e), remedy_of(e))
        why = e.strerror or e
        if self.wait:  # the training's own export, into the run's hf/: it has no --out to choose
            run = RunDir(self.target.parent.parent)
            return UserError(
                f"{run.exports_dir}: cannot create the lock file {self.path.name} of the training's evaluation export "
                f"of step {step_of(self.target)} ({why}); the run's exports go into this directory: fix it, or set "
                f"checkpoint.hf_last=0 to train without them ('lctrain export' writes one from a resume checkpoint "
                f"later); {resume_hint(run)}"
            )
        if self.option is None:  # `lctrain export RUN`, into the run's hf/step_N
            return UserError(
                f"the export {self.target}: cannot create its lock file {self.path} ({why}); export to another "
                f"directory with --out"
            )
        return UserError(
            f"{self.option} {self.target}: cannot create its lock file {self.path} ({why}); "
            f"choose another {self.option}"
        )


# save_pretrained's default is 50GB, one 13 GB file for a 7B model in bf16; the hub's own uploads use 5GB shards.
MAX_SHARD_SIZE = "5GB"
MODEL_CARD = "README.md"


def write_export(
    final: Path,
    lm,
    tokenizer,
    anchor: Anchor,
    step: int,
    cfg: Config,
    *,
    state_dict: dict | None = None,
) -> Path:
    """Write an evaluation export of `step` into the directory `final`: `lm`'s `save_pretrained` (its weights, or
    `state_dict`'s when given: gathered from ZeRO-3 shards, or read from a checkpoint for a model without weights) in
    shards of `MAX_SHARD_SIZE`, its config.json with the top-level RoPE keys transformers 4.x reads, the tokenizer,
    `anchor.json`, the model card (`model_card`, from the run's config `cfg`) and
    last the export record of every file. Written into a temporary directory renamed into place, so the export
    appears whole or not at all. Training (`save_hf`) and `lctrain export` (lctrain/train/export.py) both write
    through here."""
    tmp = final.with_name(TEMPORARY_PREFIX + final.name)
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = _weights_dtype(lm, state_dict)  # save_pretrained empties `state_dict` as it writes the shards
    try:
        with writing(tmp, "the evaluation export"), _with_kv_cache(lm):
            # its progress bar is off (metrics.quiet_libraries, console.no_library_bars)
            lm.save_pretrained(str(tmp), state_dict=state_dict, max_shard_size=MAX_SHARD_SIZE)
            _add_legacy_rope_keys(tmp / "config.json")
            readable_as_config_json(tmp)
            save_tokenizer(tokenizer, tmp)  # with its SentencePiece model: `lctrain eval` encodes prompts exactly
            write_anchor(tmp, anchor)  # prompts start with it
            card = model_card(cfg, lm.config, tokenizer, anchor, step, dtype)
            (tmp / MODEL_CARD).write_text(card)
            write_export_record(tmp, step)  # last: eval scores these files, and only these, as this step
            _replace_dir(tmp, final)
    except BaseException:
        # on a full disk, the part written is space the user needs back; Ctrl-C leaves nothing to resume from either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _add_legacy_rope_keys(config_file: Path) -> None:
    """transformers 4.x (what many vLLM, lm-eval and TGI installs run) reads the RoPE base from the top level of
    config.json only and would load the model at its class default (10000) without error; transformers 5 loads the
    file with them to the same config (`compat.transformers.legacy_rope_keys`)."""
    config = json.loads(config_file.read_text())
    legacy = legacy_rope_keys(config)
    if legacy:
        config_file.write_text(config_json_text({**config, **legacy}))


def _weights_dtype(lm, state_dict: dict | None) -> str:
    """The dtype the export's weights are saved in: the module's (the bf16 weights of a mixed-precision run)."""
    tensors = state_dict.values() if state_dict is not None else lm.parameters()
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), None)
    return str(dtype).removeprefix("torch.")
