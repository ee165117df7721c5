"""The run directory: every path of a run and the format of its files, in one value.

    RUN/config.yaml          the resolved config, with `workdir`: where its relative paths resolve
    RUN/.lctrain.lock        held while anything trains the run (lctrain.lifetime.RunLock)
    RUN/metrics.jsonl        one JSON record per optimizer step, appended
    RUN/checkpoints/step_N/  resume checkpoints (lctrain.train.checkpoint: their files and `latest`)
    RUN/hf/step_N/           evaluation checkpoints (save_pretrained weights + tokenizer; lctrain.export_record)
    RUN/eval/                `lctrain eval`'s report
    RUN/tensorboard/         `logging.tensorboard`'s event files
    RUN/profile/steps_A-B/   `logging.profile`'s traces of steps A to B (lctrain.profiling)

Runs written by earlier versions name checkpoints `step_00000020` and keep the directory `train` ran in in
`origin.json` (their config.yaml has no `workdir`); both are still read, so such a run resumes.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from shlex import quote

import yaml

from lctrain.config import Config, load_config, run_dir, to_yaml
from lctrain.data.manifest import MANIFEST
from lctrain.errors import UserError, first_and_more, writing
from lctrain.files import replace_file
from lctrain.lifetime import RunLock, refuse_while_read

_STEP = re.compile(r"^step_(\d+)$")
# What lctrain writes in eval/ (lctrain.eval: results, predictions, their partial state, the plot, the harness's)
_EVAL_FILES = frozenset(
    {"results.json", "predictions.jsonl", "predictions.jsonl.partial", "eval.resume.json", "ruler.png", "harness.json",
     "harness"}
)  # fmt: skip


def _written_by_lctrain(directory: str, name: str) -> bool:
    """Whether `name` in the run's `directory` (checkpoints, hf, profile, eval, tensorboard) is of a kind lctrain
    writes there; hidden names are its temporary files and locks."""
    if name.startswith("."):
        return True
    if directory in ("checkpoints", "hf"):
        return bool(_STEP.match(name)) or name == "latest"
    if directory == "profile":
        return name.startswith(("steps_", "rank"))
    if directory == "tensorboard":
        return name.startswith("events.out.tfevents")
    return name in _EVAL_FILES


# What `from_pretrained` loads a model's weights from, beside its config.json: one file or the index of its shards, in
# safetensors or torch's format (an lctrain export's, a hub download's, a fine-tune's).
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def train_command(config: str | Path, overrides: Iterable[str] = (), *options: str) -> str:
    """`lctrain train --config CONFIG --set ITEM ... OPTIONS`, every word shell-quoted: advice to copy whole."""
    sets = "".join(f" --set {quote(item)}" for item in overrides)
    return f"lctrain train --config {quote(str(config))}{sets}" + "".join(f" {option}" for option in options)


# Sections every run's config.yaml holds (`write_config` writes them all, and so did every earlier version).
_RUN_SECTIONS = ("data", "model", "train")


def step_name(step: int) -> str:
    """The directory name of step `step`'s checkpoint and evaluation export."""
    return f"step_{step}"


def step_of(path: str | Path) -> int | None:
    """The step a `step_N` directory holds (an older run's `step_00000020` too); None for any other name."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def by_step(paths: Iterable[Path]) -> list[Path]:
    """The `step_N` directories among `paths`, oldest step first; of an older run's `step_00000020` and a `step_20`
    written after it resumed, the current name counts as the newer."""
    stepped = [(step_of(p), p) for p in paths]
    return [p for s, p in sorted((sp for sp in stepped if sp[0] is not None), key=lambda sp: _age(*sp))]


def _age(step: int, path: Path) -> tuple[int, bool]:
    return step, path.name == step_name(step)


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @classmethod
    def of(cls, cfg: Config) -> RunDir:
        """The run directory `cfg` trains into: `train.run_dir`, else runs/<name>."""
        return cls(run_dir(cfg))

    def __str__(self) -> str:
        return str(self.path)

    # ------------------------------------------------------------ config

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    def holds_dataset(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def model_weights(self) -> str | None:
        """The weights file (`_WEIGHT_FILES`) of the model this directory holds beside its config.json, None when it
        holds none: a base model's folder or an export, where a run's files would mix with the model's."""
        if not (self.path / "config.json").is_file():
            return None
        return next((name for name in _WEIGHT_FILES if (self.path / name).is_file()), None)

    def not_for_a_run(self) -> str | None:
        """Why this directory must not become a run directory, for a one-line refusal; None when it may: a prepared
        dataset or a model's folder would get the run's config.yaml, checkpoints and metrics among its own files (and
        `--force` would clear them there)."""
        if self.holds_dataset():
            return f"a prepared dataset (it holds {MANIFEST}), not a run directory"
        weights = self.model_weights()
        if weights is not None:
            return f"a model's folder (it holds config.json and {weights}), not a run directory"
        return None

    def not_a_run(self) -> str | None:
        """None for a run directory, else why it is not one, for a one-line refusal. A prepared dataset holds a
        config.yaml too (prepare writes its resolved config beside the manifest): it is told apart by its manifest."""
        if self.holds_dataset():
            return f"a prepared dataset (it holds {MANIFEST}), not a run directory"
        if not self.path.exists():
            return "no such run directory"
        if not self.config_file.is_file():
            return "not a run directory (no config.yaml)"
        return None

    def is_run(self) -> bool:
        return self.not_a_run() is None

    @classmethod
    def whose_config(cls, cfg: Config) -> RunDir | None:
        """The run `cfg` was loaded from the config.yaml of (a resume's, `train --config RUN/config.yaml`); None for
        any other file. A run's own is told from a config file that only has its name by the `workdir` that
        `write_config` records, which `cfg` was loaded with (an earlier version's run: origin.json beside it)."""
        if cfg.source_file is None or Path(cfg.source_file).name != "config.yaml":
            return None
        run = cls(Path(cfg.source_file).absolute().parent)
        if not run.is_run():
            return None
        return run if cfg.workdir is not None or (run.path / "origin.json").is_file() else None

    def elsewhere(self, cfg: Config) -> Path | None:
        """The run directory `cfg` names when it is not this one: a copied or moved run's config.yaml keeps the
        train.run_dir and workdir of the run it came from."""
        there = run_dir(cfg)
        return None if there.resolve() == self.path.resolve() else there

    def start_over_command(self, overrides: Iterable[str] = ()) -> str:
        """`lctrain train --force` that starts this run over here, with the `--set` items `overrides` (those of the
        refused `resume`, so that it trains what was asked), for advice: with train.run_dir set to this directory when
        its config.yaml names another (`elsewhere`), which the command would otherwise delete and train."""
        try:
            pin = self.elsewhere(self.read_config()) is not None
        except UserError:
            pin = True  # unreadable now: the override that cannot name another directory
        where = [f"train.run_dir={self.path.absolute()}"] if pin else []
        return train_command(self.config_file, [*where, *overrides], "--force")

    def write_config(self, cfg: Config) -> Path:
        """The resolved config, with the directory its relative paths resolve against, so that `read_config` from any
        directory (a resume, a launched worker, another node) means the same files."""
        with writing(self.path, "the run directory"):
            self.path.mkdir(parents=True, exist_ok=True)
        # replaced whole: the ranks of a launcher the user started read it while `resume --set` rewrites it
        replace_file(self.config_file, to_yaml(cfg, workdir=True), "the run's config")
        return self.config_file

    def read_config(self, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        """The run's config; a copy missing a section `write_config` always writes (truncated, or edited by hand)
        is refused rather than read with that section's defaults."""
        cfg = load_config(str(self.config_file), overrides)
        raw = yaml.safe_load(self.config_file.read_text())
        missing = [s for s in _RUN_SECTIONS if s not in raw] if "base" not in raw else []
        if missing:
            raise UserError(
                f"{self.config_file}: no {', '.join(missing)} section (truncated or edited?); restore it: "
                f"{self.checkpoints.name}/step_N/trainer_state.json holds the config each checkpoint trained with"
            )
        if cfg.workdir is None:
            cfg.workdir = self._origin()
        return cfg

    def _origin(self) -> str | None:
        """Where `train` ran, for a run written before config.yaml recorded it; None (the current directory, as
        then) when that is not known either."""
        try:
            cwd = Path(json.loads((self.path / "origin.json").read_text())["cwd"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return str(cwd) if cwd.is_dir() else None

    def lock(self, command: str) -> RunLock:
        return RunLock(self.path, command)

    # ------------------------------------------------------------ checkpoints and exports

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_name(step)

    @property
    def exports_dir(self) -> Path:
        return self.path / "hf"

    def export(self, step: int) -> Path:
        return self.exports_dir / step_name(step)

    def exports(self) -> list[Path]:
        """The evaluation exports `hf/step_N/`, in step order."""
        return by_step(self.exports_dir.iterdir()) if self.exports_dir.is_dir() else []

    @property
    def model_changes_file(self) -> Path:
        """What lctrain changed in the model's config (`lctrain.model.config_changes`), written at start."""
        return self.path / "model_changes.json"

    @property
    def ranks_dir(self) -> Path:
        """Where the launched processes of a multi-process run take their request and report their outcome."""
        return self.path / "ranks"

    @property
    def eval_dir(self) -> Path:
        return self.path / "eval"

    @property
    def profile_dir(self) -> Path:
        return self.path / "profile"

    def finished_outputs(self) -> list[str]:
        """What a run finished here besides its checkpoints, by name: its evaluation exports, and its metrics once
        they reach the run's last step. The metrics of a run stopped before its first checkpoint are no result:
        nothing can continue them, and a new run replaces them."""
        exports = [f"{self.exports_dir.name}/{p.name}" for p in self.exports()]
        return [self.metrics_file.name] * self._metrics_complete() + exports

    def _metrics_complete(self) -> bool:
        if not self.metrics_file.is_file():
            return False
        try:
            records = self.read_metrics()
            return bool(records) and int(records[-1]["step"]) >= self.read_config().train.steps
        except UserError:
            return True  # a damaged metrics file or config cannot show the run unfinished: keep it

    def clear_outputs(self, force: bool = False) -> None:
        """Remove what a new run in this directory replaces: checkpoints, exports, profiles, metrics, sessions, the
        evaluation of its exports (`eval/`, `lctrain eval`'s default output: a report would show the old run's scores
        as the new one's) and TensorBoard's event files (TensorBoard draws every file in the directory as one run).
        Only these: anything else in the directory is the user's and stays; a symlink in their place (say eval/
        pointing to a shared results folder) is left as it is, the files it points to untouched. Without `force` (a
        plain `train`, which clears what a run killed before its first checkpoint left) a file in those directories
        that lctrain does not write there is refused, not deleted: a project folder used as the run directory may
        hold the user's own eval/ or profile/. Refused while an evaluation reads the run (its `Reading` mark,
        lctrain.eval.runner): its exports and report would go under it."""
        refuse_while_read(self.path, "starting a run over here")
        if not force:
            self._refuse_foreign_outputs()
        for directory in (self.checkpoints, self.exports_dir, self.profile_dir, self.eval_dir, self.tensorboard_dir):
            shutil.rmtree(directory, ignore_errors=True)  # refuses a symlink: kept
        self.metrics_file.unlink(missing_ok=True)
        self.sessions_file.unlink(missing_ok=True)

    def _refuse_foreign_outputs(self) -> None:
        directories = (self.checkpoints, self.exports_dir, self.profile_dir, self.eval_dir, self.tensorboard_dir)
        foreign = [
            entry
            for directory in directories
            if directory.is_dir() and not directory.is_symlink()
            for entry in sorted(directory.iterdir())
            if not _written_by_lctrain(directory.name, entry.name)
        ]
        if foreign:
            named = first_and_more([str(p) for p in foreign], 3)
            raise UserError(
                f"{self.path}: a new run clears checkpoints/, hf/, profile/, eval/ and tensorboard/ of what an earlier "
                f"run left, and lctrain did not write {named}: move them elsewhere, choose another train.run_dir, or "
                f"start over with --force, which deletes them"
            )

    # ------------------------------------------------------------ sessions

    @property
    def sessions_file(self) -> Path:
        """One line per `train` and `resume` of the run: what it ran under (lctrain.train.session)."""
        return self.path / "sessions.jsonl"

    def append_session(self, record: dict) -> None:
        _append_line(self.sessions_file, record, "the sessions record")

    def read_sessions(self) -> list[dict]:
        """The session records; a line torn by a kill while it was appended is left out."""
        if not self.sessions_file.is_file():
            return []
        out = []
        for line in self.sessions_file.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out

    # ------------------------------------------------------------ metrics

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def tensorboard_dir(self) -> Path:
        """TensorBoard's event files (`logging.tensorboard`): `tensorboard --logdir RUN_DIR/tensorboard`."""
        return self.path / "tensorboard"

    def append_metrics(self, record: dict) -> None:
        _append_line(self.metrics_file, record, "the metrics")

    def read_metrics(self) -> list[dict]:
        """The step records, in file order; none when there is no file yet."""
        return [record for _, record in self._metric_lines()]

    def truncate_metrics(self, last_step: int) -> int:
        """Drop the records of steps after `last_step` (written before a crash, redone after resume); the last
        step kept (0 for none)."""
        kept = [(line, record) for line, record in self._metric_lines() if record["step"] <= last_step]
        if self.metrics_file.is_file():  # replaced whole: a kill while it is rewritten keeps the history
            replace_file(self.metrics_file, "".join(line + "\n" for line, _ in kept), "the metrics")
        return kept[-1][1]["step"] if kept else 0

    def _metric_lines(self) -> list[tuple[str, dict]]:
        """(line, record) of each record: a JSON object with an integer `step`, steps increasing (a resume drops the
        records after its checkpoint before it appends). The last line may be torn (a run killed while appending
        it: the start of a record) and is then left out; anything else that is not a record is an error."""
        if not self.metrics_file.is_file():
            return []
        lines = self.metrics_file.read_bytes().decode(errors="replace").splitlines()
        out = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = record["step"]
            except (ValueError, KeyError, TypeError, IndexError):
                if i == len(lines) - 1 and line.startswith("{") and "\ufffd" not in line and "\0" not in line:
                    break
                raise UserError(
                    f"{self.metrics_file}:{i + 1}: not a step record; remove the line or restore the file"
                ) from None
            if type(step) is not int or (out and step <= out[-1][1]["step"]):
                raise UserError(
                    f"{self.metrics_file}:{i + 1}: step {step!r} does not follow step "
                    f"{out[-1][1]['step'] if out else 0}; remove the line or restore the file"
                )
            out.append((line, record))
        return out


def _append_line(path: Path, record: dict, what: str) -> None:
    """One JSON line appended: a kill while it is written tears that line only, which the readers leave out."""
    with writing(path, what), open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
