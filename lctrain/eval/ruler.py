"""RULER (Hsieh et al. 2024, github.com/NVIDIA/RULER) as the paper uses it: its 13 tasks with their generation
lengths and metrics, the paper's task sets, and reading the data RULER's own preparation writes.

Learned from NVIDIA/RULER (commit c3f5e3b), not copied:
- `scripts/synthetic.yaml` and `scripts/config_tasks.sh`: the 13 tasks of the `synthetic` benchmark and the base task
  each one instantiates (niah, variable_tracking, common_words_extraction, freq_words_extraction, qa);
- `scripts/data/synthetic/constants.py`: `tokens_to_generate` per base task;
- `scripts/eval/synthetic/constants.py`: the metric per base task (`string_match_all`, or `string_match_part` for qa);
- `scripts/run.sh` and `scripts/data/prepare.py`: the layout `<root>/<model>/synthetic/<max_seq_length>/data/<task>/
  validation.jsonl`, one JSON object a line with `index`, `input`, `outputs` (the expected strings), `length` (prompt
  plus generation, in the preparing tokenizer's tokens) and `answer_prefix`;
- `scripts/pred/call_api.py`: the model is prompted with `input + answer_prefix`;
- `scripts/pred/model_wrappers.py` and `scripts/data/tokenizer.py`: the prompt is encoded by the model's Hugging Face
  tokenizer, `tokenizer(prompts)`, which reads a chat template's special-token text as the token; `length` counts
  `tokenizer.tokenize(prompt)`, no BOS.

The paper (§4.2): "unlike the official evaluation, which measures overall performance across all 13 tasks, we exclude
two tasks (NIAH-Multikey 3 and Common Word Extraction) for the LLaMA-2-7B model [...] for other advanced models
(LLaMA-3-8B, Mistral-7B-v0.3, Qwen-1.5-1.8B) [...] we use all 13 tasks."
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lctrain.errors import UserError

if TYPE_CHECKING:
    from lctrain.tokenizer import Anchor

# base task -> (tokens_to_generate, metric); metric "all": fraction of expected strings found, "part": any found
_BASE_TASKS = {
    "niah": (128, "all"),
    "variable_tracking": (30, "all"),
    "common_words_extraction": (120, "all"),
    "freq_words_extraction": (50, "all"),
    "qa": (32, "part"),
}


@dataclass(frozen=True)
class RulerTask:
    name: str
    base: str
    max_new_tokens: int
    metric: str


TASKS = {
    name: RulerTask(name, base, *_BASE_TASKS[base])
    for name, base in (
        ("niah_single_1", "niah"),
        ("niah_single_2", "niah"),
        ("niah_single_3", "niah"),
        ("niah_multikey_1", "niah"),
        ("niah_multikey_2", "niah"),
        ("niah_multikey_3", "niah"),
        ("niah_multivalue", "niah"),
        ("niah_multiquery", "niah"),
        ("vt", "variable_tracking"),
        ("cwe", "common_words_extraction"),
        ("fwe", "freq_words_extraction"),
        ("qa_1", "qa"),
        ("qa_2", "qa"),
    )
}
TASK_NAMES = tuple(TASKS)


@dataclass(frozen=True)
class Sample:
    """One prompt to complete and score, from either suite."""

    task: str
    length: int
    index: int
    prompt: str
    answers: tuple[str, ...]
    max_new_tokens: int
    metric: str  # "all": fraction of the answers found; "part": 1 if any is found (QA)
    num_tokens: int  # the tokens the model reads for the prompt, its start (anchor or BOS) included
    needles: tuple[tuple[str, float], ...] = ()


def select_task_set(tasks: list[str] | None, exclude: list[str]) -> tuple[list[str], list[str]]:
    """The task set in RULER's order (`tasks`, default all 13, minus `exclude`) and the excluded names."""
    for source, names in (("--tasks", tasks or []), ("--exclude", exclude)):
        unknown = [t for t in names if t not in TASKS]
        if unknown:
            raise UserError(f"{source}: unknown task(s) {', '.join(unknown)}; RULER's tasks: {', '.join(TASK_NAMES)}")
    wanted = [t for t in TASK_NAMES if (tasks is None or t in tasks) and t not in exclude]
    if not wanted:
        raise UserError("no task left to run after --tasks/--exclude (eval.tasks/eval.exclude)")
    return wanted, [t for t in TASK_NAMES if t in exclude]


# ---------------------------------------------------------------- RULER's prepared data

SUBSET_FILE = "validation.jsonl"


def data_lengths(root: Path) -> list[int]:
    """The sequence lengths prepared under `root` (its numeric subdirectories)."""
    if not root.is_dir():
        raise UserError(
            f"--ruler-data {root}: no such directory; pass the folder RULER's scripts/run.sh fills "
            f"(<ROOT_DIR>/<model>/synthetic, holding <length>/data/<task>/{SUBSET_FILE})"
        )
    return sorted(int(d.name) for d in root.iterdir() if d.is_dir() and d.name.isdigit() and int(d.name) > 0)


def task_file(root: Path, length: int, task: str) -> Path | None:
    """RULER's run.sh writes `<length>/data/<task>/validation.jsonl`; prepare.py called by hand with
    `--save_dir <root>/<length>` writes `<length>/<task>/validation.jsonl`."""
    for path in (root / str(length) / "data" / task / SUBSET_FILE, root / str(length) / task / SUBSET_FILE):
        if path.is_file():
            return path
    return None


def _record(path: Path, lineno: int, line: str) -> dict:
    where = f"{path}:{lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg}); a RULER data file has one JSON object per line") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deep; a RULER data file has one flat JSON object per line") from None
    if not isinstance(rec, dict):
        raise UserError(f"{where}: a {type(rec).__name__}, not a JSON object with input and outputs")
    if not isinstance(rec.get("input"), str):
        raise UserError(f"{where}: no text field 'input'; is this the output of RULER's scripts/data/prepare.py?")
    outputs = rec.get("outputs")
    if not (isinstance(outputs, list) and outputs and all(isinstance(o, str) for o in outputs)):
        raise UserError(f"{where}: 'outputs' must be a non-empty list of strings (the expected answers)")
    if not isinstance(rec.get("answer_prefix", ""), str):
        raise UserError(f"{where}: 'answer_prefix' must be a string")
    if "length" in rec and (isinstance(rec["length"], bool) or not isinstance(rec["length"], int) or rec["length"] < 1):
        raise UserError(f"{where}: 'length' must be a positive integer token count (RULER's tokens of the sample)")
    return rec


# results.json's `prompt_start`: the anchor first (the offline suite, `--anchor-prompts`), or what RULER's own
# `tokenizer(prompt)` puts first (RULER's data): the same for a tokenizer whose BOS is the anchor
PROMPT_START_ANCHOR = "anchor"
PROMPT_START_RULER = "the tokenizer's own (as RULER)"


class PromptEncoder:
    """RULER's prompts as RULER encodes them: by the model's Hugging Face tokenizer, with which RULER sized the data
    (its `length`) and which its prediction runs. That tokenizer reads text spelling one of its added tokens as the
    token, so a chat template's `[INST]` or `<|start_header_id|>` reaches the model as the control token it was tuned
    on; lctrain's `TextEncoder` encodes such text as text, as the training data's documents and the offline suite's
    prompts need. A prompt starts as RULER's `tokenizer(prompt)` starts it, with the BOS the tokenizer puts before a
    text (Llama's and Mistral's `<s>`, the anchor they trained with), and with nothing for a tokenizer that puts none
    (Qwen, SmolLM2), whose scores then compare with published RULER numbers; `anchored` puts the anchor first there
    too, as every training document started. Never twice: a prompt that already starts a document, with the anchor
    or that BOS (a template's `<s>` or `<|begin_of_text|>`), keeps its own, where RULER's `tokenizer(prompt)` puts
    two. `encode` answers as `TextEncoder.encode` does, `specials` adding the start."""

    def __init__(self, tokenizer, anchor: Anchor, anchored: bool = False):
        # on use: the config, which imports this module, loads without numpy (start-up time)
        from lctrain.tokenizer import special_affixes

        bos = special_affixes(tokenizer)[0]
        self.tokenizer, self.anchor = tokenizer, anchor
        self.starts = {anchor.id, *bos}
        self.start = [anchor.id] if anchored else list(bos)

    @property
    def prompt_start(self) -> str:
        """What a prompt not already starting a document starts with, as results.json records it."""
        return PROMPT_START_ANCHOR if self.start == [self.anchor.id] else PROMPT_START_RULER

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, without the anchor: the tokens RULER's `length` counts."""
        if not texts:
            return []
        # not verbose: a long prompt passes most tokenizers' model_max_length, which transformers warns about
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def prompted(self, ids: list[int]) -> list[int]:
        """A prompt's ids as the model reads them."""
        return ids if ids[:1] and ids[0] in self.starts else [*self.start, *ids]

    def encode(self, text: str, specials: bool = False) -> list[int]:
        ids = self.encode_batch([text])[0]
        return self.prompted(ids) if specials else ids


@dataclass(frozen=True)
class TaskFile:
    """One RULER data file, checked and measured: iterating it re-reads its samples, so a full benchmark (500
    samples x 13 tasks x up to 128K tokens: gigabytes of text) is never held in memory at once."""

    path: Path
    task: str
    length: int
    lines: tuple[int, ...]  # line numbers of the samples used
    num_tokens: tuple[int, ...]  # the tokens the model reads for their prompts
    note: str | None = None

    def __len__(self) -> int:
        return len(self.lines)

    def __iter__(self) -> Iterator[Sample]:
        spec = TASKS[self.task]
        for (lineno, rec), tokens in zip(_records(self.path, len(self.lines)), self.num_tokens):
            yield Sample(
                self.task,
                self.length,
                lineno,
                _prompt(rec),
                tuple(rec["outputs"]),
                spec.max_new_tokens,
                spec.metric,
                tokens,
            )


def _prompt(rec: dict) -> str:
    return rec["input"] + rec.get("answer_prefix", "")


def _records(path: Path, limit: int | None) -> Iterator[tuple[int, dict]]:
    """(line number, record) of the first `limit` non-blank lines (all when None), each checked."""
    taken = 0
    try:
        with path.open(encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and taken >= limit:
                    return
                if line.strip():
                    taken += 1
                    yield lineno, _record(path, lineno, line)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


_COUNT_BATCH = 8  # prompts tokenized together: fast tokenizers spread a batch over the cores


def scan_task(path: Path, task: str, length: int, limit: int | None, encoder: PromptEncoder) -> TaskFile:
    """Check the first `limit` samples (all when None) of one RULER data file and count their prompt tokens with
    `encoder`; the note says when the evaluated tokenizer counts them differently from the tokenizer that prepared
    them (RULER sizes its haystacks with it, so a different tokenizer makes a '128K' sample longer or shorter than
    128K)."""
    lines, counts, ruler_counts, recorded, pending = [], [], [], [], []

    def count() -> None:
        for ids in encoder.encode_batch(pending):
            ruler_counts.append(len(ids))
            counts.append(len(encoder.prompted(ids)))
        pending.clear()

    for lineno, rec in _records(path, limit):
        lines.append(lineno)
        pending.append(_prompt(rec))
        if "length" in rec:
            recorded.append(rec["length"])
        if len(pending) == _COUNT_BATCH:
            count()
    count()
    totals = [c + TASKS[task].max_new_tokens for c in ruler_counts]
    note = _length_note(totals, recorded, length)
    if limit is not None and len(lines) < limit:
        fewer = f"{len(lines)} sample(s) in {path}, fewer than --samples {limit}"
        note = f"{fewer}; {note}" if note else fewer
    return TaskFile(path, task, length, tuple(lines), tuple(counts), note)


def _length_note(totals: list[int], recorded: list[int], length: int) -> str | None:
    """`totals`: each prompt's tokens plus its generation budget, counted as RULER's `length` counts them."""
    if not totals:
        return None
    if max(totals) > length:
        return (
            f"prompts plus generation reach {max(totals)} tokens with this tokenizer, over {length}: "
            f"the data was prepared with another tokenizer"
        )
    if len(recorded) == len(totals):
        ratio = sum(totals) / sum(recorded)
        # the tokenizer that prepared the data counts `length` exactly; one differing in a detail (a space split
        # otherwise) moves a count by a token or two, never by 2%
        if abs(ratio - 1) > 0.02:
            return (
                f"this tokenizer counts {ratio:.0%} of the tokens RULER recorded ('length'): the data was "
                f"prepared with another tokenizer"
            )
    return None
