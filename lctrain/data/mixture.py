"""Which documents enter the packed stream: the natural SlimPajama mixture, or Fu et al. (2024) per-source length
upsampling.

`upsampled` gives each domain its SlimPajama token share of the budget; within a domain, documents shorter than
`short_doc_tokens` are kept with probability `down_sample_ratio` and longer ones always, until the domain's share is
full. Documents of domain `other` have no share in that mixture and are not used.
"""

from __future__ import annotations

import numpy as np

from lctrain.config import DOMAINS

# SlimPajama-627B token shares per domain (Shen et al. 2023; the AnchorAttention paper's Table 9).
SLIMPAJAMA_TOKEN_SHARES = {
    "CommonCrawl": 0.522, "C4": 0.267, "GitHub": 0.052, "ArXiv": 0.046, "Book": 0.042, "Wikipedia": 0.038,
    "StackExchange": 0.033, "other": 0.0,
}


class Mixture:
    """Decides per document whether it is used; counts what it turned away and why."""

    def __init__(self, kind: str, budget_tokens: int, short_doc_tokens: int, down_sample_ratio: float,
                 rng: np.random.Generator):
        self.kind = kind
        self.rng = rng
        self.short = short_doc_tokens
        self.ratio = down_sample_ratio
        self.targets = np.array([SLIMPAJAMA_TOKEN_SHARES[d] * budget_tokens for d in DOMAINS]) \
            if kind == "upsampled" else None
        self.admitted = np.zeros(len(DOMAINS), dtype=np.int64)
        self.dropped = {"short_doc_downsampled": 0, "domain_share_full": 0, "domain_without_share": 0}

    def admit(self, domain: int, doc_tokens: int, size: int) -> bool:
        """`doc_tokens` is the document's length, `size` the tokens it will occupy (anchor and tag included)."""
        if self.targets is None:
            self.admitted[domain] += size
            return True
        if self.targets[domain] <= 0:
            self.dropped["domain_without_share"] += 1
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
        if self.targets is None:
            return None
        return {d: SLIMPAJAMA_TOKEN_SHARES[d] for d in DOMAINS}
