"""Which documents enter the packed stream: the natural SlimPajama mixture, or Fu et al. (2024) per-source length
upsampling.

`upsampled` gives each domain a target token share of the budget (`data.domain_shares`, by default the paper's
UpSampledMix-128K); within a domain, documents shorter than `short_doc_tokens` are kept with probability
`down_sample_ratio` and longer ones always, until the domain's share is full. Documents of a domain without a share
(by default `other`) are not used. `SourceShares` fills `data.sources`' token shares. After a build, `share_misses`
names the domains or sources whose achieved share is off.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np

from lctrain.config import DOMAINS
from lctrain.data.encode import REDPAJAMA_SET_NAMES

# SlimPajama-627B's token shares per domain, as its release publishes them (Soboleva et al. 2023); Fu et al. (2024)
# upsample long documents while keeping these overall shares. `data.domain_shares` selects them.
SLIMPAJAMA_TOKEN_SHARES = {
    "CommonCrawl": 0.522,
    "C4": 0.267,
    "GitHub": 0.052,
    "ArXiv": 0.046,
    "Book": 0.042,
    "Wikipedia": 0.038,
    "StackExchange": 0.033,
    "other": 0.0,
}
# The paper's UpSampledMix-128K, Table 9 "Token Ratio" ("the token count of each domain divided by the total token
# count of the dataset"); Table 1 rounds them to 58/20/7/6/5/4/2. They sum to 99.98%: `Mixture` normalizes.
UPSAMPLED_MIX_128K_TOKEN_SHARES = {
    "CommonCrawl": 0.5814,
    "C4": 0.1953,
    "GitHub": 0.0661,
    "ArXiv": 0.0586,
    "Book": 0.0469,
    "Wikipedia": 0.0351,
    "StackExchange": 0.0164,
    "other": 0.0,
}


# How far (absolute) a domain's achieved token share may be from its target before `prepare` warns. The paper states
# its mixtures in whole percents (Table 1 rounds Table 9 to 58/20/7/6/5/4/2, and data.domain_shares accepts sums off
# by 0.5% per share for that rounding), so a miss under one point is below the precision of the targets themselves;
# a larger one is another mixture than the one asked for (the paper's two mixtures differ by 0.3 to 7 points per
# domain). The mixture itself errs by up to one document per domain, which only a larger budget makes small.
SHARE_TOLERANCE = 0.01


def shares_by_domain(shares: dict[str, float], source_names: Collection[str] = ()) -> dict[str, float]:
    """`data.domain_shares` keyed by the domains documents are read as: a SlimPajama set name means the domain its
    records are read as (`RedPajamaArXiv` -> `ArXiv`, `lctrain.data.encode`), unless a source has that name (its
    records' domain). Two keys naming one domain are a ValueError, which the config's validation reports."""
    shares_of, key_of = {}, {}
    for key, share in shares.items():
        domain = key if key in source_names else REDPAJAMA_SET_NAMES.get(key, key)
        if domain in shares_of:
            raise ValueError(
                f"{key_of[domain]} and {key} both name the domain {domain} (SlimPajama's set names are read without "
                f"their RedPajama prefix); keep one of them"
            )
        shares_of[domain], key_of[domain] = share, key
    return shares_of


def keyed_by_domain(data) -> dict[str, float] | None:
    """`shares_by_domain` of a validated `data` section; None without domain_shares."""
    if data.domain_shares is None:
        return None
    return shares_by_domain(data.domain_shares, {s.name for s in data.sources or ()})


def target_shares(domain_shares: dict[str, float] | None, domains: tuple[str, ...] = DOMAINS) -> dict[str, float]:
    """Token share per domain of `domains` (summing to 1) that the `upsampled` mixture fills: `domain_shares`
    normalized (domains it leaves out get none), or the paper's UpSampledMix-128K."""
    shares = UPSAMPLED_MIX_128K_TOKEN_SHARES if domain_shares is None else domain_shares
    total = sum(shares.values())
    return {d: shares.get(d, 0.0) / total for d in domains}


class Mixture:
    """Decides per document whether it is used; counts what it turned away and why."""

    def __init__(
        self,
        kind: str,
        budget_tokens: int,
        short_doc_tokens: int,
        down_sample_ratio: float,
        rng: np.random.Generator,
        domain_shares: dict[str, float] | None = None,
        domains: tuple[str, ...] = DOMAINS,
        capacity: int | None = None,
    ):
        """`domains`: the domain names by id known now; `capacity`: how many ids there may be (domains found while
        reading get ids after these, and no share)."""
        capacity = capacity or len(domains)
        self.kind = kind
        self.rng = rng
        self.short = short_doc_tokens
        self.ratio = down_sample_ratio
        self.shares = target_shares(domain_shares, domains) if kind == "upsampled" else None
        self.targets = None
        if self.shares is not None:
            self.targets = np.zeros(capacity)
            self.targets[: len(domains)] = [self.shares[d] * budget_tokens for d in domains]
        self.admitted = np.zeros(capacity, dtype=np.int64)
        self.dropped = {"short_doc_downsampled": 0, "domain_share_full": 0, "domain_without_share": 0}
        # per domain, for the warning that names them (the manifest keeps the total)
        self.without_share = np.zeros(capacity, dtype=np.int64)

    def admit(self, domain: int, doc_tokens: int, size: int) -> bool:
        """`doc_tokens` is the document's length, `size` the tokens it will occupy (anchor and tag included)."""
        if self.targets is None:
            self.admitted[domain] += size
            return True
        if self.targets[domain] <= 0:
            self.dropped["domain_without_share"] += 1
            self.without_share[domain] += 1
            return False
        if self.admitted[domain] >= self.targets[domain]:
            if not self.all_full():
                self.dropped["domain_share_full"] += 1
                return False
            # every share is full but the windows are not (continuation anchors take room): grow all shares alike
            self.targets *= 1.01
        # one draw per candidate document, so the stream of decisions does not depend on earlier outcomes
        keep = self.rng.random() < self.ratio
        if doc_tokens < self.short and not keep:
            self.dropped["short_doc_downsampled"] += 1
            return False
        self.admitted[domain] += size
        return True

    def all_full(self) -> bool:
        if self.targets is None:
            return False
        wanted = self.targets > 0
        return bool(np.all(self.admitted[wanted] >= self.targets[wanted]))

    def target_shares(self) -> dict[str, float] | None:
        return self.shares


def share_misses(shares: dict[str, tuple[float, float]]) -> list[tuple[str, float, float]]:
    """(name, target, achieved) of `shares` (name -> (target, achieved) token share: the domains of the `upsampled`
    mixture, the sources of `data.sources` with token shares) that miss their target by more than `SHARE_TOLERANCE`,
    or have a target and no tokens, the worst first."""
    misses = [
        (name, target, achieved)
        for name, (target, achieved) in shares.items()
        if abs(achieved - target) > SHARE_TOLERANCE or (target > 0 and not achieved)
    ]
    return sorted(misses, key=lambda m: -abs(m[2] - m[1]))


def normalized(shares: list[float]) -> list[float]:
    """`data.sources`' token shares as fractions of their sum: they are accepted summing to 1 up to rounding (0.5%
    per share, `check_source_shares`), and as `target_shares` does for domains the targets must fill the budget."""
    total = sum(shares)
    return [s / total for s in shares]


class SourceShares:
    """`data.sources` with a `token_share` each: a document of source i is packed while the tokens packed from it
    (its anchors and tags in every window included, `placed`) are below its share of the budget; the draw already
    picks documents in the share proportions, so this only corrects for sources whose documents are longer or
    shorter than the others'. A document longer than what its source's share has left is cut to its head that fits
    (one long document would otherwise overshoot the share by any amount; skipping it instead would lose the long
    documents that long-context training wants most): a share then overshoots by at most its anchors and tags in the
    windows the cut document continues into. Without token shares every document is admitted whole. Counts the
    written tokens per source, for the achieved shares."""

    def __init__(self, shares: list[float | None], budget_tokens: int):
        self.targets = None if None in shares else np.array(normalized(shares), dtype=np.float64) * budget_tokens
        self.admitted = np.zeros(len(shares), dtype=np.int64)
        self.written = np.zeros(len(shares), dtype=np.int64)
        self.dropped = {"source_share_full": 0, "source_share_cut_tokens": 0} if self.targets is not None else {}

    def admit(self, source: int, header: int, tokens: int) -> int:
        """How many of a document's `tokens` (its head) to pack; `header`: its anchor and tag. 0: not packed."""
        if self.targets is None:
            return tokens
        if self.admitted[source] >= self.targets[source]:
            if not np.all(self.admitted >= self.targets):
                self.dropped["source_share_full"] += 1
                return 0
            # every share is full but the windows are not (continuation anchors take room): grow all shares alike
            self.targets *= 1.01
        # at least one token, so that the share is full afterwards whatever header the room is smaller than
        take = min(tokens, max(1, math.ceil(self.targets[source] - self.admitted[source]) - header))
        self.dropped["source_share_cut_tokens"] += tokens - take
        return take

    def placed(self, source: int, tokens: int) -> None:
        self.admitted[source] += tokens

    def add_written(self, tokens_by_source: dict[int, int]) -> None:
        for source, n in tokens_by_source.items():
            self.written[source] += n

    def achieved(self) -> list[float]:
        """Each source's share of the tokens written so far."""
        total = int(self.written.sum())
        return [float(n) / total if total else 0.0 for n in self.written]
