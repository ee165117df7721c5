"""The offline RULER-style suite: RULER's 13 tasks (Hsieh et al. 2024) generated deterministically from a seed, with
our own haystack text, words and templates. Its scores are NOT comparable with published RULER numbers (the
paper's Tables 4-6); for those, score RULER's own data (`lctrain.eval.ruler`, `lctrain eval --ruler-data`).

The tasks follow RULER's definitions (what is asked, how many needles, keys, values and repeats). The differences
kept that bear on difficulty are in the docstrings of `_niah`, `_cwe` and `_fwe`; and every task is zero-shot, where
RULER puts one solved example before its vt and cwe questions. Suite v2 (`lctrain.eval.runner.OFFLINE_LABEL`)
changed v1's samples: distinct needle keys from a larger word list (`_niah`), fwe's answer (`_fwe`) and cwe's
repeats below 4096 tokens (`_cwe`).

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from lctrain.errors import UserError
from lctrain.eval.filler import KEY_ADJECTIVES, KEY_NOUNS, NOISE_PARAGRAPH, Essay, pseudo_words
from lctrain.eval.ruler import TASKS, Sample


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
    # what bounds max_units where a prompt must fill its length (a length that needs more units is refused); empty
    # where a shorter prompt is what the data allows (QA: the file's documents)
    bound: str = ""

    @property
    def max_new_tokens(self) -> int:
        return TASKS[self.name].max_new_tokens

    @property
    def metric(self) -> str:
        return TASKS[self.name].metric


# ---------------------------------------------------------------- keys, values, haystacks


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(KEY_ADJECTIVES)}-{rng.choice(KEY_NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


_MAKERS = {"words": _word_key, "numbers": _number, "uuids": _uuid}
_SINGULAR = {"numbers": "number", "uuids": "uuid", "words": "word"}


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int, taken: Iterable[str] = ()) -> list[str]:
    """`n` distinct values of `make`, none of them in `taken`, drawn one after another: the first n of n + 1."""
    seen = set(taken)
    out: list[str] = []
    while len(out) < n:
        v = make(rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def _needle_keys(rng: random.Random, key_type: str, n: int) -> list[str]:
    """The keys of a sample's needles: distinct, and word keys share no word (no adjective, no noun) with each
    other, so that no key is a near-copy of a queried one."""
    if key_type != "words":
        return _distinct(rng, _MAKERS[key_type], n)
    return [f"{a}-{b}" for a, b in zip(rng.sample(KEY_ADJECTIVES, n), rng.sample(KEY_NOUNS, n))]


def _haystack_words(needle_keys: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The adjectives and nouns left for distractor keys: none of the needles' words."""
    used = {w for k in needle_keys for w in k.split("-")}
    return tuple(a for a in KEY_ADJECTIVES if a not in used), tuple(b for b in KEY_NOUNS if b not in used)


def _distractor_keys(rng: random.Random, key_type: str, needle_keys: list[str], n: int) -> list[str]:
    """`n` keys for a haystack of distractor needles: distinct, none a needle's key, and word keys share no word
    with a needle's key. At most `_max_distractors(key_type, len(needle_keys))` of them."""
    if key_type != "words":
        return _distinct(rng, _MAKERS[key_type], n, set(needle_keys))
    adjectives, nouns = _haystack_words(needle_keys)
    if n > len(adjectives) * len(nouns):
        raise ValueError(f"{n} distractor keys asked for, {len(adjectives) * len(nouns)} exist")
    return _distinct(rng, lambda r: f"{r.choice(adjectives)}-{r.choice(nouns)}", n)


def _max_distractors(key_type: str, num_keys: int) -> int | None:
    """How many distinct distractor keys there are for a sample with `num_keys` needle keys; None: unbounded."""
    if key_type != "words":
        return None
    return (len(KEY_ADJECTIVES) - num_keys) * (len(KEY_NOUNS) - num_keys)


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
    """RULER's niah tasks: `num_k` keys with `num_v` values each, the first `num_q` keys queried, every value of a
    queried key an answer. A key occurs only in its own num_v needles, and needle keys share no word (adjective,
    noun) with each other; a haystack of distractor needles (niah_multikey_2, niah_multikey_3) has distinct keys,
    none a needle's key or sharing a word with one. So a question has one answer and no near-copy of its key.
    RULER draws from 912 adjectives x 6,782 nouns (6.2M keys) with replacement: its keys are distinct in practice
    (4K niah_multikey_2: 161 needles, 161 keys) and a 128K sample has a few distractors sharing the queried key's
    adjective. Suite v1 drew from 36 x 32 = 1,152 keys with replacement: at 128K, 5,540 distractor needles held
    about 1,145 distinct keys (up to 14 repeats) and about 300 shared a word with the queried key.

    niah_multiquery lists its 4 keys in the order they were drawn, the first being the key whose needle sweeps
    the depths (the module's docstring), the other three at random depths; RULER lists them in random order.
    Every value is needed either way (string_match_all), so we keep ours, which ties the first query to the swept
    depth."""
    essay = Essay(seed)

    def build(rng: random.Random, n: int, depth: float, length: int) -> Built:
        keys = _needle_keys(rng, key_type, num_k)
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
        else:  # a haystack of distractor needles, each with a key of its own
            units = [
                f"One of the special magic {noun} for {k} is: {_MAKERS[value_type](rng)}."
                for k in _distractor_keys(rng, key_type, keys, n)
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
    """RULER's cwe: a list of `num_common` words repeated 30 times each among other words 3 times each (6 and 1 times
    below 4096 tokens, where 300 copies would not leave room for the others), the answer the `num_common`. RULER
    also puts one solved example list before the question; ours, like every task of the suite, is zero-shot."""

    def build(rng: random.Random, n: int, depth: float, length: int) -> Built:
        freq_common, freq_rare = (30, 3) if length >= 4096 else (6, 1)
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


FWE_NOISE = "...."  # fwe's most frequent "word", which the question says to ignore


def zipf_counts(total: int, alpha: float = 2.0, distinct: int = 5) -> list[int]:
    """Occurrence counts of ranked words summing to about `total`, proportional to rank^-alpha (at least 1 each), the
    first `distinct` strictly decreasing (rounding ties 2, 2 at ranks 4 and 5 for totals 59-61: the upper one gains
    one), so that fwe's answer (ranks 2-4) is never tied with the next word."""
    ranks = max(10, int(total**0.5))
    weights = [r**-alpha for r in range(1, ranks + 1)]
    norm = sum(weights)
    counts = [max(1, round(total * w / norm)) for w in weights]
    for r in range(distinct - 2, -1, -1):
        counts[r] = max(counts[r], counts[r + 1] + 1)
    return counts


def _fwe(top: int = 3):
    """RULER's fwe: coded words whose counts follow a Zipf law (alpha 2), the first rank being the noise FWE_NOISE
    (about 60% of the text), the answer the `top` words of ranks 2 to top + 1: the most frequent words once the dots
    are ignored. Suite v1 had no noise rank (the dots only ended lines of 12 words) and answered ranks 1-3, more
    frequent words with a wider gap to the next (the third answer 16/9 = 1.78 times as frequent as the fourth word,
    against 25/16 = 1.56 here and in RULER)."""

    def build(rng: random.Random, n: int, depth: float, length: int) -> Built:
        counts = zipf_counts(max(n, 40))
        words = [FWE_NOISE] + pseudo_words(rng, len(counts) - 1, syllables=(2, 2))
        seq = [w for w, c in zip(words, counts) for _ in range(c)]
        rng.shuffle(seq)
        prompt = (
            "Read the following coded text and track how often each coded word occurs. Find the three most "
            f"frequent coded words.\n\n{' '.join(seq)}\n\nQuestion: Ignore the dots '{FWE_NOISE}'. What are the three "
            "most frequent words in the coded text above?\nAnswer: According to the coded text above, the three "
            "most frequent words are:"
        )
        return Built(prompt, tuple(words[1 : top + 1]))

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
            max_units=_max_distractors("words", 1),
            description="haystack of distractor needles",
            bound=f"its haystack holds at most {_max_distractors('words', 1):,} distractor needles (one per key)",
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


def build_sample(spec: TaskSpec, seed: int, length: int, index: int, num_samples: int, units: int) -> Built:
    """Sample `index` of `num_samples` of task `spec` at `length` with a haystack of `units`, drawn as `generate`
    draws it: its own seeding, its first needle's depth."""
    rng = random.Random(f"{seed}:{spec.name}:{length}:{index}")
    return spec.build(rng, units, (index + 0.5) / num_samples, length)


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
        return build_sample(spec, seed, length, index, num_samples, n)

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
    if spec.bound and n0 == spec.max_units:
        most = count_tokens(build(0, n0).prompt)
        if most < 0.98 * budget:
            raise UserError(
                f"--lengths {length}: too long for task {spec.name}: {spec.bound}, about "
                f"{most + spec.max_new_tokens:,} tokens; use shorter lengths or --exclude {spec.name}"
            )
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
