"""A seeded generator of SlimPajama-like documents: the 7 domains in SlimPajama's document proportions, long-tailed
per-domain lengths (most documents short, ArXiv and books long, a few past 128K tokens when `max_words` allows),
and text made of words (English prose, code, LaTeX, Q&A) so that tokenization behaves like on real text.

Document `i` depends only on `(seed, i)`, so workers can generate any slice of the corpus independently.
"""

from __future__ import annotations

import numpy as np

# domain -> (share of documents, median length relative to `median_words`, lognormal sigma, long-tail weight).
# Document shares and mean lengths follow SlimPajama-627B (590M documents; C4 ~480 tokens per document,
# CommonCrawl ~1.8K, ArXiv ~19K, books ~130K), which reproduces its token shares to within a few points.
DOMAIN_PROFILE = {
    "CommonCrawl": (0.297, 2.4, 1.0, 1.0),
    "C4": (0.580, 1.0, 0.8, 0.2),
    "GitHub": (0.027, 2.0, 1.2, 1.0),
    "ArXiv": (0.0026, 24.0, 0.6, 5.0),
    "Book": (0.00033, 180.0, 0.7, 20.0),
    "Wikipedia": (0.043, 1.6, 1.0, 0.5),
    "StackExchange": (0.050, 1.3, 0.9, 0.3),
}
SYNTHETIC_DOMAINS = tuple(DOMAIN_PROFILE)
_DOC_SHARES = np.array([p[0] for p in DOMAIN_PROFILE.values()])
_CUM_DOC_SHARES = np.cumsum(_DOC_SHARES / _DOC_SHARES.sum())

_COMMON = """the of and to a in is that for it as was with be by on not he this are or his from at which but have an
they you were her she there been one all we their has would when if so no will more about can its into than them
only other new some what time these two may then do first any my now such like our over man me even most made after
also did many before must through back years where much your way well down should because each just those people
how too little state good very make world still own see men work long get here between both life being under never
day same another know while last might us great old year off come since against go came right used take three
states himself few house use during without again place around however home small found thought went say part once
general high upon school every does got united left number course war until always away something fact though
water less public put think almost hand enough far took head yet government system better set told nothing night
end why called didn eyes find going look asked later knew point next city business give group toward young let
room president side social given present several order national possible rather second face per among form
important often things looked early white case john become large big need four within felt along children saw best
church ever least power development light thing seemed family interest want members mind country area others done
turned although open god service certain kind problem began different door thus help sense means whole matter
perhaps itself york times law human line above name example action company hands local show whether five history
gave today either act feet across taken past quite anything seen having death week experience body word half
really field car words already themselves information tell together college shall money period held keep sure
probably free seems political real behind cannot miss question air office making brought whose special major
heard problems federal became study ago moment available known result street economic boy position reason change
south board individual job society areas west close turn love community true court force full seem wife future age
wanted department voice center woman control common policy necessary following front sometimes six girl clear
further land run students provide feel party able mother music education university model data energy research
method results analysis function value process theory network training language learning sequence attention""".split()

_SYLLABLES = (
    "ka ro mi ta le su no ve pi da re lo ni ma to ke sa ri mu po ja ze fi gu ba the ion ent ter str con "
    "pro ex ment ing ly al ic"
).split()
_FILLER = (
    "def return class import self for in if else while try except with yield lambda None True False int "
    "str list dict len range print value index result data"
).split()
_LATEX = (
    r"\frac{a}{b} x_{i} \alpha \beta \sum_{i=1}^{n} \mathbb{R} \int_0^1 f(x)\,dx \lambda \theta_{t} "
    r"\mathcal{O}(n) \leq \geq \nabla \cdot"
).split()


def _vocabulary() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(12345)
    rare = set()
    while len(rare) < 3000:
        rare.add("".join(rng.choice(_SYLLABLES, size=int(rng.integers(2, 5)))))
    words = list(dict.fromkeys(_COMMON)) + sorted(rare)
    ranks = np.arange(len(words), dtype=np.float64)
    p = 1.0 / (ranks + 2.7) ** 1.07  # Zipf-Mandelbrot, close to English word frequencies
    return np.array(words, dtype=object), p / p.sum()


_WORDS, _WORD_P = _vocabulary()
_CUM_P = np.cumsum(_WORD_P)


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    return _WORDS[np.minimum(np.searchsorted(_CUM_P, rng.random(n)), len(_WORDS) - 1)]


def _prose(rng: np.random.Generator, n: int) -> str:
    """Sentences of 5-30 words, capitalized and ended with a period, paragraphs of about 6 sentences."""
    w = _words(rng, n)
    ends = np.cumsum(rng.integers(5, 31, size=n // 5 + 2))
    ends = ends[ends < n]
    starts = np.concatenate([[0], ends])
    starts = starts[starts < n]
    w[starts] = [s.capitalize() for s in w[starts]]
    seps = np.full(n, " ", dtype=object)
    seps[ends - 1] = ". "
    paragraph_ends = ends[rng.random(len(ends)) < 0.17] - 1
    seps[paragraph_ends] = ".\n\n"
    seps[n - 1] = "."
    return "".join((w + seps).tolist())


def _code(rng: np.random.Generator, n: int) -> str:
    lines = []
    left = n
    while left > 0:
        name = "_".join(_words(rng, 2))
        args = ", ".join(_words(rng, int(rng.integers(1, 4))))
        body = []
        for _ in range(int(rng.integers(2, 8))):
            lhs, rhs, op = _words(rng, 1)[0], _words(rng, 1)[0], rng.choice(["+", "-", "*", "//"])
            body.append(f"    {lhs} = {rhs} {op} {int(rng.integers(0, 100))}")
        body.append(f"    return {rng.choice(_FILLER)}({args.split(', ')[0]})")
        lines.append(f"def {name}({args}):\n" + "\n".join(body) + "\n")
        left -= 8 + 5 * len(body)
    return "\n".join(lines)


def _latex(rng: np.random.Generator, n: int) -> str:
    parts = []
    left = n
    while left > 0:
        k = int(min(left, rng.integers(40, 200)))
        parts.append(f"\\section{{{' '.join(_words(rng, 3)).title()}}}\n")
        parts.append(_prose(rng, k))
        parts.append(f" ${' '.join(rng.choice(_LATEX, size=4))}$\n\n")
        left -= k + 10
    return "".join(parts)


def _wikipedia(rng: np.random.Generator, n: int) -> str:
    title = " ".join(_words(rng, 2)).title()
    out = [f"{title}\n\n", _prose(rng, min(n, 60))]
    left = n - 60
    while left > 0:
        k = int(min(left, rng.integers(50, 300)))
        out.append(f"\n\n== {' '.join(_words(rng, 2)).title()} ==\n\n{_prose(rng, k)}")
        left -= k
    return "".join(out)


def _book(rng: np.random.Generator, n: int) -> str:
    out, left, chapter = [], n, 1
    while left > 0:
        k = int(min(left, rng.integers(2000, 6000)))
        out.append(f"CHAPTER {chapter}\n\n{_prose(rng, k)}\n\n")
        left -= k
        chapter += 1
    return "".join(out)


def _stackexchange(rng: np.random.Generator, n: int) -> str:
    q = max(5, n // 3)
    text = f"Q: {_prose(rng, q)[:-1]}?\n\nA: {_prose(rng, max(1, n - q))}"
    if rng.random() < 0.3:
        text += "\n\n" + _code(rng, 20)
    return text


_STYLES = {
    "CommonCrawl": _prose,
    "C4": _prose,
    "GitHub": _code,
    "ArXiv": _latex,
    "Book": _book,
    "Wikipedia": _wikipedia,
    "StackExchange": _stackexchange,
}


def document_length_words(
    rng: np.random.Generator, domain: str, median_words: int, max_words: int, long_doc_fraction: float
) -> int:
    _, rel, sigma, long_weight = DOMAIN_PROFILE[domain]
    median = median_words * rel
    if rng.random() < min(1.0, long_doc_fraction * long_weight):
        # the long tail: log-uniform between 16x the domain median and max_words
        lo = min(max_words, 16 * median)
        n = float(np.exp(rng.uniform(np.log(lo), np.log(max_words))))
    else:
        n = rng.lognormal(np.log(median), sigma)
    return int(np.clip(n, 5, max_words))


def _shape(rng: np.random.Generator, median_words: int, max_words: int, long_doc_fraction: float) -> tuple[str, int]:
    i = int(np.searchsorted(_CUM_DOC_SHARES, rng.random(), side="right"))
    domain = SYNTHETIC_DOMAINS[min(i, len(SYNTHETIC_DOMAINS) - 1)]  # rounding can leave the last sum below 1
    return domain, document_length_words(rng, domain, median_words, max_words, long_doc_fraction)


def document_shape(
    seed: int, index: int, median_words: int, max_words: int, long_doc_fraction: float
) -> tuple[str, int]:
    """`(domain, length in words)` of document `index`, without generating its text."""
    return _shape(np.random.default_rng([seed, index]), median_words, max_words, long_doc_fraction)


def generate(seed: int, index: int, median_words: int, max_words: int, long_doc_fraction: float) -> tuple[str, str]:
    """Document `index` of the corpus with this seed: `(text, domain)`."""
    rng = np.random.default_rng([seed, index])
    domain, n = _shape(rng, median_words, max_words, long_doc_fraction)
    return _STYLES[domain](rng, n), domain
