"""Which packed windows each rank trains on at each step.

The order is a pure function of (seed, number of windows): an epoch-wise seeded permutation, consumed
`global_batch` windows per step. Step s, micro-batch m, data-parallel rank r reads the windows at stream offsets
`s*G + (m*dp + r)*mb ... + mb`. All sequence-parallel ranks of a group read the same windows and keep their slice.
The data cursor of a checkpoint is therefore the number of steps taken; no loader state has to be restored.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from shlex import quote

import numpy as np

from lctrain.checksums import digest
from lctrain.config import DEFAULT_CONFIG, Config, bundled_config_dir, data_dir, data_fingerprint, run_dir
from lctrain.data.store import MANIFEST, open_packed
from lctrain.errors import UserError
from lctrain.parallel.layout import LAYOUT_KEYS, ParallelLayout
from lctrain.rundir import RunDir
from lctrain.tokenizer import load_tokenizer, resolve_anchor


def prepare_command(cfg: Config) -> str:
    """The prepare command for this config: bare for the embedded default, by name for a bundled one."""
    src = Path(cfg.source_file) if cfg.source_file else None
    if src is None or src.resolve() == (bundled_config_dir() / f"{DEFAULT_CONFIG}.yaml").resolve():
        arg = ""
    elif src.resolve().parent == bundled_config_dir().resolve():
        arg = f" --config {src.stem}"
    else:
        arg = f" --config {quote(str(src))}"
    return f"lctrain prepare{arg}"


def prepare_hint(cfg: Config, force: bool = False) -> str:
    command = prepare_command(cfg) + (" --force" if force else "")
    return f"run '{command}' (with the same --set overrides) first"


def _moved_run_hint(cfg: Config, path: Path) -> str | None:
    """For a run moved away from the `workdir` its config.yaml records (a project directory moved or copied whole),
    where `path`, its dataset there, is missing: preparing with that config would rebuild the dataset at the old
    place; `--set workdir=` finds the one beside it (a resume, or `train` starting the run over). None for any other
    config."""
    run = RunDir.whose_config(cfg)
    if run is None or cfg.workdir is None:
        return None
    old = Path(cfg.workdir)
    named = run_dir(cfg)
    # where its config says it is: not moved (a copy below the old workdir is moved, as one elsewhere)
    if run.path.resolve() == named.resolve() or not path.is_relative_to(old):
        return None
    # where the run's relative paths are now: as far above the run as the workdir was above it, or the current one
    depth = len(named.relative_to(old).parts) if named.is_relative_to(old) else 0
    dirs = ([run.path.parents[depth - 1]] if 0 < depth <= len(run.path.parents) else []) + [Path.cwd()]
    now = next((d for d in dirs if (d / path.relative_to(old) / MANIFEST).is_file()), None)
    new = quote(str(now)) if now else "DIR"
    what = "" if now else f", DIR the directory that holds {path.relative_to(old)} (prepared there) now"
    return (
        f"the run has moved from {old}, the workdir its config.yaml records: add '--set workdir={new}' to the "
        f"command, as in 'lctrain resume {quote(str(run.path))} --set workdir={new}'{what}"
    )


# The data settings a manifest records as they are in the config: a changed one is named when the fingerprints differ.
_RECORDED = (
    "seq_len",
    "mixture",
    "token_budget",
    "domain_tags",
    "interleave_chunks",
    "short_doc_tokens",
    "down_sample_ratio",
    "seed",
)


def dataset_record(manifest) -> dict:
    """What identifies the windows a run reads, for its checkpoints: their number (with the seed, the order: see the
    module's docstring) and their content (the shards' checksums, with the windows each shard holds). A rebuild from
    other input files keeps the data fingerprint, which holds the settings only, and changes this."""
    content = digest("".join(shard.checksum for shard in manifest.shards).encode())
    return {
        "windows": manifest.num_windows,
        "content": content,
        "shard_windows": [shard.num_windows for shard in manifest.shards],
    }


def dataset_change(recorded: dict, now: dict) -> str | None:
    """How the dataset differs from the one a checkpoint `recorded` (None: the same)."""
    if recorded["windows"] != now["windows"]:
        return f"it had {recorded['windows']:,} windows, now {now['windows']:,}, rebuilt from other input"
    if recorded["content"] == now["content"]:
        return None
    cut = recorded.get("shard_windows")  # not in a checkpoint written before lctrain recorded it
    if cut is not None and cut != now["shard_windows"]:
        # the checksums are the shard files': windows cut at other places give other checksums whatever they hold
        return (
            f"the same {now['windows']:,} windows cut into {len(now['shard_windows'])} shards where the run's were "
            f"{len(cut)} (another data.shard_tokens?), so their content cannot be compared; prepare again with "
            f"the run's data.shard_tokens"
        )
    return (
        f"the same {now['windows']:,} windows, with other content ({recorded['content']} -> {now['content']}), "
        f"rebuilt from other input"
    )


def open_checked(cfg: Config):
    """The prepared dataset of `cfg`, refusing a missing or damaged one (`open_packed`) or one built from different
    data settings, each in one line naming the file, what differs and the command that rebuilds it."""
    path = data_dir(cfg)
    if not (path / MANIFEST).is_file():
        raise UserError(
            f"{path}: no prepared dataset for this config; {_moved_run_hint(cfg, path) or prepare_hint(cfg)}"
        )
    packed = open_packed(path, rebuild=f"run '{prepare_command(cfg)}' (with the same --set overrides) to rebuild it")
    manifest = packed.manifest
    anchor = resolve_anchor(load_tokenizer(cfg.resolve_source(cfg.data.tokenizer)), cfg.data.anchor, cfg.data.tokenizer)
    if manifest.data_fingerprint != data_fingerprint(cfg.data):
        changed = [
            f"data.{k} {getattr(manifest, k)} -> {getattr(cfg.data, k)}"
            for k in _RECORDED
            if getattr(manifest, k) != getattr(cfg.data, k)
        ]
        if manifest.anchor.id != anchor.id:
            changed.append(f"data.anchor {manifest.anchor.token} -> {anchor.token}")
        what = ", ".join(changed) or "a setting the manifest does not show, such as data.path or data.tokenizer"
        raise UserError(
            f"{path}/{MANIFEST}: the dataset was prepared with other data settings ({what}); "
            f"{prepare_hint(cfg, force=True)}"
        )
    if manifest.seq_len != cfg.data.seq_len:
        raise UserError(
            f"{path}/{MANIFEST}: seq_len {manifest.seq_len} != data.seq_len {cfg.data.seq_len}; {prepare_hint(cfg)}"
        )
    if manifest.anchor.id != anchor.id:
        raise UserError(
            f"{path}/{MANIFEST}: the dataset's segments start with anchor {manifest.anchor.token} (id "
            f"{manifest.anchor.id}), data.anchor = {cfg.data.anchor} is {anchor.token} (id {anchor.id}); "
            f"{prepare_hint(cfg, force=True)}"
        )
    return packed


@lru_cache(maxsize=4)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def stream_rows(seed: int, n: int, start: int, count: int) -> list[int]:
    """Rows at positions start..start+count-1 of the endless epoch-permuted stream over n windows."""
    out = []
    for pos in range(start, start + count):
        epoch, i = divmod(pos, n)
        out.append(int(_epoch_permutation(seed, epoch, n)[i]))
    return out


def micro_batch_rows(
    step_index: int, micro: int, dp_rank: int, *, dp: int, micro_batch: int, global_batch: int, seed: int, n: int
) -> list[int]:
    """Rows of micro-batch `micro` of update `step_index` (0-based) for data-parallel rank `dp_rank`."""
    start = step_index * global_batch + (micro * dp + dp_rank) * micro_batch
    return stream_rows(seed, n, start, micro_batch)


@dataclass(frozen=True)
class BatchPlan:
    """What one optimizer step reads: `global_batch` windows, `grad_accum` micro-batches of `micro_batch` windows on
    each of the `dp` data-parallel ranks (every rank of a sequence-parallel group reads the same windows)."""

    global_batch: int
    micro_batch: int
    dp: int

    @classmethod
    def of(cls, cfg: Config, layout: ParallelLayout) -> BatchPlan:
        """`cfg`'s batch on `layout`, refusing in one line a global batch the ranks cannot split evenly."""
        t = cfg.train
        if t.global_batch % (t.micro_batch * layout.dp):
            raise UserError(
                f"{cfg.origin('train.global_batch', 'train.micro_batch', *LAYOUT_KEYS)}: train.global_batch = "
                f"{t.global_batch} is not divisible by "
                f"train.micro_batch x data-parallel size = {t.micro_batch} x {layout.dp}; change train.global_batch "
                f"or train.micro_batch"
            )
        return cls(global_batch=t.global_batch, micro_batch=t.micro_batch, dp=layout.dp)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.global_batch // (self.micro_batch * self.dp)

    def rows(self, step_index: int, micro: int, dp_rank: int, *, seed: int, n: int) -> list[int]:
        """Rows of micro-batch `micro` of update `step_index` (0-based) that data-parallel rank `dp_rank` reads."""
        return micro_batch_rows(
            step_index,
            micro,
            dp_rank,
            dp=self.dp,
            micro_batch=self.micro_batch,
            global_batch=self.global_batch,
            seed=seed,
            n=n,
        )


def collate(packed, rows: list[int]) -> dict:
    """Stack windows into `[B, L]` ids with ragged per-window segment lists (make_batch's input)."""
    items = [packed[r] for r in rows]
    return {
        "input_ids": np.stack([np.asarray(it["input_ids"], dtype=np.int64) for it in items]),
        "seg_lens": [np.asarray(it["seg_lens"], dtype=np.int64) for it in items],
        "seg_doc": [np.asarray(it["seg_doc"], dtype=np.int64) for it in items],
        "tag_lens": [np.asarray(it["tag_lens"], dtype=np.int64) for it in items],
    }
