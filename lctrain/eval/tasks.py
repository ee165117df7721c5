"""The offline RULER-style suite: RULER's 13 tasks (Hsieh et al. 2024) generated deterministically from a seed, with
our own haystack text, templates and examples. Its scores are NOT comparable with published RULER numbers (the
paper's Tables 4-6); for those, score RULER's own data (`lctrain.eval.ruler`, `lctrain eval --ruler-data`).

Each task turns (seed, length, sample index) into a prompt of at most `length - max_new_tokens` tokens, counted with
the evaluated model's tokenizer, and the strings a correct answer contains. A task is built from a number of haystack
units (sentences, distractor needles, list words, documents); `fit_units` finds the largest number that fits.
Generation lengths and metrics are RULER's (`lctrain.eval.ruler.TASKS`).

Needle depth: the first (queried) needle of sample i of n sits at depth (i + 0.5) / n of the haystack, so the samples
sweep the context evenly; further needles sit at seeded random depths.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lctrain.errors import UserError
from lctrain.eval.filler import NOISE_PARAGRAPH, Essay, pseudo_words
from lctrain.eval.ruler import TASKS, Sample

_ADJECTIVES = (
    "amber",
    "bold",
    "calm",
    "dusty",
    "eager",
    "faint",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "mellow",
    "narrow",
    "odd",
    "pale",
    "quick",
    "rusty",
    "silent",
    "tidy",
    "upbeat",
    "vivid",
    "wary",
    "young",
    "zesty",
    "brisk",
    "crisp",
    "dim",
    "fierce",
    "grand",
    "humble",
    "lucky",
    "noble",
    "proud",
    "rapid",
    "sharp",
)
_NOUNS = (
    "anchor",
    "badger",
    "candle",
    "dolphin",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pebble",
    "quarry",
    "ribbon",
    "saddle",
    "tunnel",
    "violin",
    "walnut",
    "canyon",
    "beacon",
    "cobbler",
    "ferret",
    "glacier",
    "hammock",
    "magnet",
    "oyster",
    "parrot",
    "rocket",
)


@dataclass(frozen=True)
class Built:
    """What a task produces for a given number of haystack units."""

    prompt: str
    answers: tuple[str, ...]
    needles: tuple[tuple[str, float], ...] = ()  # (needle text, intended depth in [0, 1])


@dataclass(frozen=True)
class TaskSpec:
    name: str
    build: Callable[[random.Random, int, float, int], Built]  # (rng, haystack units, first needle depth, length)
    max_units: int | None = None
    description: str = ""

    @property
    def max_new_tokens(self) -> int:
        return TASKS[self.name].max_new_tokens

    @property
    def metric(self) -> str:
        return TASKS[self.name].metric


# ---------------------------------------------------------------- keys, values, haystacks


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


_MAKERS = {"words": _word_key, "numbers": _number, "uuids": _uuid}
_SINGULAR = {"numbers": "number", "uuids": "uuid", "words": "word"}


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = make(rng)
        if v not in out:
            out.append(v)
    return out


def _insert(units: list[str], items: list[tuple[str, float]]) -> list[str]:
    """Insert each (text, depth) at unit boundary round(depth * len(units)); later insertions first keeps the
    boundaries of earlier ones valid."""
    out = list(units)
    n = len(units)
    for text, depth in sorted(items, key=lambda x: x[1], reverse=True):
        out.insert(round(depth * n), text)
    return out


def _noise_units(n: int) -> list[str]:
    sentences = [s.strip() + "." for s in NOISE_PARAGRAPH.split(".") if s.strip()]
    return [sentences[i % len(sentences)] for i in range(n)]


# ---------------------------------------------------------------- needle in a haystack


def _niah(haystack: str, key_type: str, value_type: str, num_k: int = 1, num_v: int = 1, num_q: int = 1, seed: int = 0):
    essay = Essay(seed)

    def build(rng: random.Random, n: int, depth: float, length: int) -> Built:
        keys = _distinct(rng, _MAKERS[key_type], num_k)
        values = [_distinct(rng, _MAKERS[value_type], num_v) for _ in keys]
        noun = value_type
        needles = []
        for ki, key in enumerate(keys):
            for vi, value in enumerate(values[ki]):
                d = depth if (ki, vi) == (0, 0) else rng.random()
                needles.append((f"One of the special magic {noun} for {key} is: {value}.", d))
        if haystack == "noise":
            units = _noise_units(n)
        elif haystack == "essay":
            units = essay.sentences(n)
        else:  # a haystack made of distractor needles
            units = [
                f"One of the special magic {noun} for {k} is: {_MAKERS[value_type](rng)}."
                for k in (_MAKERS[key_type](rng) for _ in range(n))
                if k not in keys
            ]
        context = (" " if haystack != "needle" else "\n").join(_insert(units, needles))
        queried = keys[:num_q]
        answers = tuple(v for vs in values[:num_q] for v in vs)
        one = _SINGULAR[noun]
        if num_q > 1:
            query = ", ".join(queried[:-1]) + f" and {queried[-1]}"
            ask = f"What are all the special magic {noun} for {query} mentioned in the text above?"
            lead = f"The special magic {noun} for {query} mentioned in the text above are"
        elif num_v > 1:
            ask = f"What are all the special magic {noun} for {queried[0]} mentioned in the text above?"
            lead = f"The special magic {noun} for {queried[0]} mentioned in the text above are"
        else:
            ask = f"What is the special magic {one} for {queried[0]} mentioned in the text above?"
            lead = f"The special magic {one} for {queried[0]} mentioned in the text above is"
        prompt = (
            f"Some special magic {noun} are hidden in the text below. Remember them: you will be asked about "
            f"them afterwards.\n\n{context}\n\nQuestion: {ask}\nAnswer: {lead}"
        )
        return Built(prompt, answers, tuple(needles))

    return build


# ---------------------------------------------------------------- variable tracking


def _vt(num_hops: int = 4):
    def build(rng: random.Random, n: int, depth: float, length: int) -> Built:
        names = _distinct(
            rng, lambda r: "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)), num_hops + 1
        )
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
        # the chain must be read in order: its first link at `depth`, the others at sorted later depths
        depths = [depth] + sorted(depth + (1 - depth) * rng.random() for _ in chain[1:])
        needles = list(zip(chain, depths))
        context = " ".join(_insert(_noise_units(n), needles))
        prompt = (
            "Memorize and track the chain of variable assignments hidden in the text below.\n\n"
            f"{context}\n\nQuestion: Find all variables that are assigned the value {value} in the text above.\n"
            f"Answer: According to the chain of variable assignments in the text above, {len(names)} variables are "
            f"assigned the value {value}, they are:"
        )
        return Built(prompt, tuple(names), tuple(needles))

    return build


# ---------------------------------------------------------------- word extraction


def _cwe(num_common: int = 10):
    def build(rng: random.Random, n: int, depth: float, length: int) -> Built:
        # RULER's frequencies; short contexts cannot hold 30 copies of 10 words, so they use 2 and 1 as RULER does
        freq_common, freq_rare = (30, 3) if length >= 4096 else (2, 1)
        words = pseudo_words(rng, num_common + n)
        common, rare = words[:num_common], words[num_common:]
        seq = common * freq_common + rare * freq_rare
        rng.shuffle(seq)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(seq))
        prompt = (
            "Below is a numbered list of words. Some of them appear more often than others; memorize the ones that "
            f"appear most often.\n\n{listing}\n\nQuestion: What are the {num_common} most common words in the list "
            f"above?\nAnswer: The {num_common} words that appear most often in the list are:"
        )
        return Built(prompt, tuple(common))

    return build


def zipf_counts(total: int, alpha: float = 2.0) -> list[int]:
    """Occurrence counts of ranked words summing to about `total`, proportional to rank^-alpha (at least 1 each)."""
    ranks = max(10, int(total**0.5))
    weights = [r**-alpha for r in range(1, ranks + 1)]
    norm = sum(weights)
    return [max(1, round(total * w / norm)) for w in weights]


def _fwe(top: int = 3):
    def build(rng: random.Random, n: int, depth: float, length: int) -> Built:
        counts = zipf_counts(max(n, 40))
        words = pseudo_words(rng, len(counts), syllables=(2, 2))
        seq = [w for w, c in zip(words, counts) for _ in range(c)]
        rng.shuffle(seq)
        lines = [" ".join(seq[i : i + 12]) for i in range(0, len(seq), 12)]
        context = " ....\n".join(lines)
        prompt = (
            "Read the following coded text and track how often each coded word occurs. Find the three most "
            f"frequent coded words.\n\n{context}\n\nQuestion: Ignore the dots '....'. What are the three most frequent "
            "words in the coded text above?\nAnswer: According to the coded text above, the three most frequent "
            "words are:"
        )
        return Built(prompt, tuple(words[:top]))

    return build


# ---------------------------------------------------------------- question answering from a local file


@dataclass(frozen=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    gold: tuple[str, ...]  # the documents that hold the answer


@dataclass
class QAData:
    items: list[QAItem]
    documents: list[str] = field(default_factory=list)  # every document, gold ones included
    format: str = ""


def _parse_squad(raw: dict) -> QAData:
    data = QAData([], format="squad")
    for article in raw["data"]:
        for para in article.get("paragraphs", []):
            ctx = para.get("context", "")
            data.documents.append(ctx)
            for qa in para.get("qas", []):
                answers = tuple(dict.fromkeys(a["text"] for a in qa.get("answers", []) if a.get("text")))
                if answers and not qa.get("is_impossible", False):
                    data.items.append(QAItem(qa["question"], answers, (ctx,)))
    return data


def _parse_hotpot(raw: list) -> QAData:
    data = QAData([], format="hotpotqa")
    for ex in raw:
        docs = {title: " ".join(sents) for title, sents in ex["context"]}
        data.documents.extend(docs.values())
        gold_titles = dict.fromkeys(t for t, _ in ex.get("supporting_facts", [])) or docs
        data.items.append(
            QAItem(ex["question"], (str(ex["answer"]),), tuple(docs[t] for t in gold_titles if t in docs))
        )
    return data


QA_FORMATS = {"qa_1": "SQuAD", "qa_2": "HotpotQA"}  # RULER's qa_1 and qa_2 (scripts/synthetic.yaml)
_QA_OPTION = {"qa_1": "--squad FILE (or eval.squad_path)", "qa_2": "--hotpotqa FILE (or eval.hotpotqa_path)"}


def load_qa(path: str | Path, task: str) -> QAData:
    """Read the local file of `task`: SQuAD (v1/v2 JSON: data/paragraphs/qas) for qa_1, HotpotQA (a JSON list with
    context/supporting_facts) for qa_2, the datasets RULER's two QA tasks draw from."""
    path = Path(path)
    want = QA_FORMATS[task]
    hint = f"pass {_QA_OPTION[task]} a {want} JSON file"
    try:
        raw = json.loads(path.read_text(encoding="utf-8-sig"))
    except OSError as e:
        raise UserError(f"{path}: cannot read the {task} file ({e.strerror}); {hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e}); {hint}") from None
    if isinstance(raw, dict) and isinstance(raw.get("data"), list):
        fmt, parse = "SQuAD", _parse_squad
    elif isinstance(raw, list) and raw and isinstance(raw[0], dict) and "context" in raw[0] and "question" in raw[0]:
        fmt, parse = "HotpotQA", _parse_hotpot
    else:
        raise UserError(
            f"{path}: neither SQuAD ('data' -> 'paragraphs' -> 'qas') nor HotpotQA (a list of "
            f"{{question, answer, context}}) format; {hint}"
        )
    if fmt != want:
        raise UserError(f"{path}: a {fmt} file, but {task} is RULER's {want} task; {hint}")
    try:
        data = parse(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # only the first entry decides the format: a later malformed one must not end in a traceback
        raise UserError(f"{path}: malformed {fmt} entry ({type(e).__name__}: {e})") from None
    data.documents = list(dict.fromkeys(data.documents))
    if not data.items:
        raise UserError(f"{path}: no answerable questions found")
    return data


def _qa(data: QAData):
    def build(rng: random.Random, n: int, depth: float, length: int) -> Built:
        item = data.items[rng.randrange(len(data.items))]
        pool = [d for d in data.documents if d not in item.gold]
        rng.shuffle(pool)
        docs = list(pool[:n])
        for g in item.gold:
            docs.insert(round(depth * len(docs)), g)
        body = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        instruction = (
            "Answer the question based on the given documents. Only give the answer and do not output any other words."
        )
        prompt = (
            f"{instruction}\n\nThe following are the given documents.\n\n{body}\n\n{instruction}\n\n"
            f"Question: {item.question}\nAnswer:"
        )
        return Built(prompt, item.answers, tuple((g, depth) for g in item.gold))

    return build


# ---------------------------------------------------------------- the registry


def task_specs(seed: int = 0, qa: dict[str, QAData] | None = None) -> dict[str, TaskSpec]:
    """RULER's tasks in its order; qa_1 and qa_2 only with their data ({task: QAData})."""
    specs = [
        TaskSpec("niah_single_1", _niah("noise", "words", "numbers", seed=seed), description="noise haystack, number"),
        TaskSpec("niah_single_2", _niah("essay", "words", "numbers", seed=seed), description="essay haystack, number"),
        TaskSpec("niah_single_3", _niah("essay", "words", "uuids", seed=seed), description="essay haystack, uuid"),
        TaskSpec(
            "niah_multikey_1", _niah("essay", "words", "numbers", num_k=4, seed=seed), description="4 keys, 1 queried"
        ),
        TaskSpec(
            "niah_multikey_2",
            _niah("needle", "words", "numbers", seed=seed),
            description="haystack of distractor needles",
        ),
        TaskSpec(
            "niah_multikey_3",
            _niah("needle", "uuids", "uuids", seed=seed),
            description="needle haystack, uuid keys and values",
        ),
        TaskSpec(
            "niah_multivalue",
            _niah("essay", "words", "numbers", num_v=4, seed=seed),
            description="4 values for one key",
        ),
        TaskSpec(
            "niah_multiquery",
            _niah("essay", "words", "numbers", num_k=4, num_q=4, seed=seed),
            description="4 keys queried",
        ),
        TaskSpec("vt", _vt(), description="variable tracking, 1 chain of 4 hops"),
        TaskSpec("cwe", _cwe(), description="common words extraction"),
        TaskSpec("fwe", _fwe(), description="frequent words extraction"),
    ]
    for task, data in (qa or {}).items():
        specs.append(
            TaskSpec(task, _qa(data), max_units=len(data.documents), description=f"question answering ({data.format})")
        )
    return {s.name: s for s in specs}


def unscorable_qa(names: list[str], paths: dict[str, str | None]) -> dict[str, str]:
    """{QA task of the set: why it cannot be scored} for those without a local file."""
    return {t: f"no {QA_FORMATS[t]} file; pass {_QA_OPTION[t]}" for t in QA_FORMATS if t in names and not paths.get(t)}


# ---------------------------------------------------------------- fitting to a token length


def _sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    return random.Random(f"{seed}:{task}:{length}:{index}")


def fit_units(count: Callable[[int], int], budget: int, max_units: int | None = None, start: int = 16) -> int:
    """The largest n with count(n) <= budget, for count non-decreasing in n; -1 if even n = 0 does not fit.

    Tokenizing a 128K-token prompt takes a fraction of a second, so the search extrapolates the tokens per unit to
    overshoot once, then narrows [fits, too long] by interpolation (a few steps; counts are nearly linear in n) and
    finishes by bisection, which keeps the answer exact."""
    c0 = count(0)
    if c0 > budget:
        return -1
    lo, c_lo, hi, c_hi = 0, c0, None, None
    probe = max(1, start) if max_units is None else min(max(1, start), max_units)
    while hi is None:
        if probe <= lo:  # max_units reached and fits
            return lo
        c = count(probe)
        if c > budget:
            hi, c_hi = probe, c
            break
        lo, c_lo = probe, c
        rate = (c - c0) / probe
        guess = lo + (budget - c_lo) / rate if rate > 0 else 2 * lo
        probe = max(2 * lo if rate <= 0 else lo + 1, int(guess * 1.01) + 1)
        if max_units is not None:
            probe = min(probe, max_units)
    interpolations = 4
    while hi - lo > 1:
        n = (lo + hi) // 2
        if interpolations > 0:
            interpolations -= 1
            guess = lo + int((budget - c_lo) * (hi - lo) / max(c_hi - c_lo, 1))
            if lo < guess < hi:
                n = guess
        c = count(n)
        if c <= budget:
            lo, c_lo = n, c
        else:
            hi, c_hi = n, c
    return lo


def generate(
    spec: TaskSpec, length: int, num_samples: int, seed: int, count_tokens: Callable[[str], int]
) -> list[Sample]:
    """`num_samples` samples of one task whose prompts fit in `length - spec.max_new_tokens` tokens."""
    budget = length - spec.max_new_tokens

    def build(index: int, n: int) -> Built:
        return spec.build(_sample_rng(seed, spec.name, length, index), n, (index + 0.5) / num_samples, length)

    def fit(index: int, start: int = 16) -> int:
        n = fit_units(lambda k: count_tokens(build(index, k).prompt), budget, spec.max_units, start)
        if n < 0:
            need = count_tokens(build(index, 0).prompt) + spec.max_new_tokens
            raise UserError(
                f"--lengths {length}: too short for task {spec.name}, which needs at least {need} tokens "
                f"with an empty haystack; use longer lengths or --exclude {spec.name}"
            )
        return n

    n0 = fit(0)
    samples = []
    for i in range(num_samples):
        built = build(i, n0)
        tokens = count_tokens(built.prompt)
        if not 0.98 * budget <= tokens <= budget:
            # this sample's keys or words tokenize longer or shorter than sample 0's: fit it on its own
            built = build(i, fit(i, start=n0))
            tokens = count_tokens(built.prompt)
        samples.append(
            Sample(
                spec.name,
                length,
                i,
                built.prompt,
                built.answers,
                spec.max_new_tokens,
                spec.metric,
                tokens,
                built.needles,
            )
        )
    return samples
