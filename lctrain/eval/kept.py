"""What an interrupted `lctrain eval` keeps for the next one: its answers and perplexities, under the same settings.

An evaluation of several checkpoints at 64K-128K takes hours; a preemption or Ctrl-C should cost the answer under
way, not the ones before. While it runs, every answer goes to `predictions.jsonl.partial` as it is made (runner.py)
and `eval.resume.json` holds the settings it runs under (`key`: the suite, lengths, samples, seed, backend, device,
anchor, the held-out windows, and each checkpoint's files, with `ANSWERING`) with the perplexities measured so far.
A new evaluation under the same key reuses both (a line torn by the kill is dropped); under another key, or with no
such file, it starts over. The completed evaluation renames the predictions and removes the state (runner.evaluate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lctrain.errors import writing
from lctrain.export_record import read_export_record
from lctrain.files import replace_file

STATE = "eval.resume.json"
# The version of how lctrain answers under a key's settings, which the key records: version 2 encodes --ruler-data
# prompts as RULER does (a chat template's special-token text read as the token, one BOS) and ends a generation at the
# anchor and every end token of the generation config, so answers kept by version 1 (no "answering" in its key) are
# not the ones it makes under the same settings. Raise it with every such change.
ANSWERING = 2

AnswerKey = tuple[str, str, int, int]  # checkpoint, task, length, sample index


def checkpoint_files(directory: Path) -> dict | list[list]:
    """What identifies a checkpoint's weights without reading them: an lctrain export's record (its step and its
    files' checksums, checked against the files when the export is opened), which a copied run directory keeps; else
    each file's name, size and modification time. Either changes when a resume that trained on exports the step
    again."""
    record = read_export_record(directory)
    if record is not None:
        return record.model_dump(mode="json")
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in Path(directory).iterdir() if p.is_file())


def answer_key(record: dict) -> AnswerKey:
    return record["checkpoint"], record["task"], int(record["length"]), int(record["index"])


@dataclass
class Kept:
    """The answers (by `AnswerKey`, predictions.jsonl records) and perplexities ({checkpoint: {length: ppl}}) an
    interrupted evaluation under `key` left in `out_dir`."""

    out_dir: Path
    key: dict  # the caller's settings and `ANSWERING`
    predictions: Path
    answers: dict[AnswerKey, dict] = field(default_factory=dict)
    perplexity: dict[str, dict[int, float]] = field(default_factory=dict)

    @classmethod
    def read(cls, out_dir: Path, predictions: Path, key: dict) -> Kept:
        """What `out_dir` keeps under `key`, the predictions file rewritten to exactly the kept answers (so lines
        appended from here on follow whole ones); nothing, and both files started over, under another key or
        another version of how answers are made (`ANSWERING`)."""
        kept = cls(out_dir, {**key, "answering": ANSWERING}, predictions)
        state = _read_json(out_dir / STATE)
        if state is not None and state.get("key") == kept.key and predictions.is_file():
            kept.answers = _whole_records(predictions)
            kept.perplexity = {
                c: {int(L): float(v) for L, v in per.items()} for c, per in state.get("perplexity", {}).items()
            }
        replace_file(predictions, "".join(json.dumps(r) + "\n" for r in kept.answers.values()), "eval's predictions")
        kept.save()
        return kept

    def save(self) -> None:
        state = {
            "key": self.key,
            "perplexity": {c: {str(L): v for L, v in p.items()} for c, p in self.perplexity.items()},
        }
        replace_file(self.out_dir / STATE, json.dumps(state, indent=1), "eval's resume state")

    def add_perplexity(self, checkpoint: str, per_length: dict[int, float]) -> None:
        self.perplexity[checkpoint] = per_length
        self.save()

    def finish(self) -> None:
        with writing(self.out_dir / STATE, "eval's resume state"):
            (self.out_dir / STATE).unlink(missing_ok=True)


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _whole_records(path: Path) -> dict[AnswerKey, dict]:
    """The predictions of `path` that were written whole (the last line may be torn by a kill)."""
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            out[answer_key(record)] = record
        except (ValueError, KeyError, TypeError):
            continue
    return out
