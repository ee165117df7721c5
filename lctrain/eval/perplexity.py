"""Perplexity on prepared windows that training never saw, for comparison with the RULER scores (the paper shows
that perplexity fails to track long-context ability).

Training reads the windows in the order of `lctrain.train.data.stream_rows` (an epoch-wise seeded permutation), so
the held-out windows are those outside the first `train.steps * train.global_batch` positions of that stream. A window
is scored with plain causal attention over all of it, positions 0..L-1, whatever mask the run trained with (a
document sees the window's earlier documents, as at inference: full attention's training condition); targets that
cannot be predicted from the text (each segment's anchor and its domain-tag tokens) are left out. Which windows are
held out follows the run's seed and train.steps, so runs of other seeds score other text.

Perplexity at a shorter length L scores the first L tokens of each held-out window (positions 0..L-1, the window's
opening anchor included). A window packs documents, mostly far shorter than L, one after another, so past a
document's end a target's context is other documents: the number measures prediction at positions up to L in packed
windows, not the modelling of one long document. YaRN (Peng et al. 2023) evaluates context-window extension
differently: single long documents (Proof-pile documents of at least 128K tokens) truncated at each evaluated
length, every target's context its own document; the two agree only where a window is one document. Under causal
attention the first L tokens' predictions do not depend on the tokens after them, so one forward pass over the whole
window gives every length at once: the sums of its per-target losses up to each L. The lengths are nested prefixes,
so a longer length's number includes the shorter ones' targets; cutting windows into L-token pieces instead would
start most pieces mid-document without the anchor every training sequence starts with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lctrain.config import data_dir, data_fingerprint
from lctrain.data.store import PackedData, open_packed
from lctrain.errors import UserError
from lctrain.tokenizer import resolve_anchor, tokenizer_fingerprint
from lctrain.train.data import dataset_change, dataset_record, stream_rows


@dataclass
class Heldout:
    packed: PackedData | None = None  # the dataset, opened once; None when there is none to score
    rows: list[int] = field(default_factory=list)  # the windows to score
    available: int = 0  # how many held-out windows exist
    note: str = ""

    @property
    def path(self) -> Path | None:
        return self.packed.path if self.packed is not None else None

    @property
    def window(self) -> int | None:
        """Tokens per held-out window."""
        return self.packed.manifest.seq_len if self.packed is not None else None


def heldout_rows(num_windows: int, consumed: int, seed: int, limit: int) -> tuple[list[int], int]:
    """Up to `limit` rows (ascending) that the first `consumed` positions of the training stream do not cover,
    and how many such rows exist."""
    if consumed >= num_windows:
        return [], 0
    used = set(stream_rows(seed, num_windows, 0, consumed))
    free = [r for r in range(num_windows) if r not in used]
    return free[:limit], len(free)


def check_same_tokenizer(packed: PackedData, tokenizer, model_dir: Path) -> None:
    """Refuse a dataset whose ids come from another tokenizer than the model's: its perplexity would be a number
    about nothing."""
    record = packed.manifest.tokenizer
    ours = tokenizer_fingerprint(tokenizer)
    if record.fingerprint == ours:
        return
    raise UserError(
        f"{packed.path}: prepared with tokenizer {record.name} (vocabulary {record.vocab_size}, fingerprint "
        f"{record.fingerprint}), but the model in {model_dir} uses another (vocabulary {len(tokenizer)}, fingerprint "
        f"{ours}); its ids would be scored as other tokens: prepare the perplexity data with the model's tokenizer "
        f"(data.tokenizer) and pass it as --ppl-data"
    )


# what a --ppl-data that is no dataset (or a damaged one) needs: the user named it, not a config
PPL_REBUILD = "--ppl-data takes a dataset directory 'lctrain prepare' wrote, whole: prepare it again with its config"


def select_heldout(tgt, ppl_data: str | None, tokenizer) -> Heldout:
    """The windows to score for `tgt` (a runner Target) with its `tokenizer`: a given dataset dir (all of it unless
    it is the run's own data), else the run's prepared data minus what training consumed; a note says why there are
    none. A dataset of another tokenizer is refused."""
    cfg = tgt.cfg
    limit = cfg.eval.ppl_windows
    if limit == 0:
        return Heldout(note="disabled (eval.ppl_windows = 0)")
    if ppl_data:
        path = Path(ppl_data)
    elif tgt.kind == "run":
        path = data_dir(cfg)
        if not path.is_absolute() and not path.exists() and (tgt.path / path).exists():
            path = tgt.path / path
        if not (path / "manifest.json").is_file():
            return Heldout(note=f"skipped: the run's prepared dataset {path} is not here; pass --ppl-data DIR")
    else:
        return Heldout(note="skipped: no dataset to score; pass --ppl-data DIR (a prepared dataset)")
    packed = open_packed(path, rebuild=PPL_REBUILD) if ppl_data else open_packed(path)
    check_same_tokenizer(packed, tokenizer, tgt.checkpoints[0][1])
    n = len(packed)
    own = tgt.kind == "run" and packed.manifest.data_fingerprint == data_fingerprint(cfg.data)
    consumed = cfg.windows_read() if own else 0
    rows, available = heldout_rows(n, consumed, cfg.seed, limit)
    if not rows:
        return Heldout(
            packed,
            [],
            0,
            f"none held out: training consumed {consumed} window reads of the {n} windows in "
            f"{path}; prepare a larger token budget or pass --ppl-data DIR",
        )
    rebuilt = rebuilt_since_training(tgt.path, packed.manifest, path) if own else None
    if rebuilt is not None:  # scored, said beside the number
        return Heldout(packed, rows, available, rebuilt)
    anchor = resolve_anchor(tokenizer, cfg.data.anchor)
    if packed.manifest.anchor.id != anchor.id:
        # scored as it is, said beside the number: segments open with a token the model did not train on there
        return Heldout(
            packed,
            rows,
            available,
            f"{path} starts its segments with {packed.manifest.anchor.token}, the model's data.anchor is "
            f"{anchor.token}: the perplexity is of differently anchored text",
        )
    return Heldout(packed, rows, available)


def rebuilt_since_training(run: Path, manifest, path: Path) -> str | None:
    """How the run's own dataset (`manifest`, at `path`) differs from the one the run trained on, as its newest
    resume checkpoint recorded it, or None (the same, or nothing recorded to compare with). A `prepare --force` from
    other input keeps the data fingerprint: the windows held out by number may then hold text the run trained on."""
    # torch and DeepSpeed with the checkpoint module, on use: this module loads without torch (start-up time)
    from lctrain.rundir import RunDir
    from lctrain.train import checkpoint as ckpt

    last = ckpt.latest_checkpoint(RunDir(run))
    recorded = ((ckpt.readable_state(last) if last is not None else None) or {}).get("dataset")
    change = dataset_change(recorded, dataset_record(manifest)) if recorded is not None else None
    if change is None:
        return None
    return (
        f"{path} was prepared again since the run trained on it ({change}): its held-out windows may hold text the "
        f"run trained on"
    )


def target_mask(window: dict) -> np.ndarray:
    """mask[t] is True when input t+1 is a target predictable from the text: training's label rule
    (`attention.modes.shifted_labels`) without the anchor targets (each segment's anchor, tags, the last token and
    other documents' chunks are left out), as training's held-out loss scores it (`train.heldout.heldout_batch`)."""
    # torch and lctrain.attention (torch) on use: this module loads without torch (start-up time)
    from lctrain.attention import IGNORE_INDEX
    from lctrain.train.heldout import heldout_batch

    return (heldout_batch(window).labels[0] != IGNORE_INDEX).numpy()


def target_nll(model, window: dict, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Per position t of one window: the negative log-likelihood of token t+1 (float64) and whether it counts
    (`target_mask`). The vocabulary projection runs in chunks so a 128K window does not materialize 128K x vocab
    logits at once; the model's own transform of its logits (`train.loss.logit_transform`) follows it."""
    # torch on use: this module loads without it (start-up time of the light commands)
    import torch

    from lctrain.train.loss import logit_transform

    transform = logit_transform(model.config)
    ids = torch.as_tensor(window["input_ids"], dtype=torch.long, device=model.device)[None]
    L = ids.shape[1]
    with torch.inference_mode():
        hidden = model.get_decoder()(
            input_ids=ids, position_ids=torch.arange(L, device=model.device)[None], use_cache=False
        ).last_hidden_state[0]
        head = model.get_output_embeddings()
        parts = []
        for lo in range(0, L - 1, chunk):
            hi = min(lo + chunk, L - 1)
            logits = head(hidden[lo:hi]).float()
            if transform is not None:
                logits = transform(logits)
            parts.append(torch.nn.functional.cross_entropy(logits, ids[0, lo + 1 : hi + 1], reduction="none"))
    return torch.cat(parts).double().cpu().numpy(), target_mask(window)[: L - 1]


def perplexity_lengths(window: int, lengths: list[int]) -> list[int]:
    """The lengths perplexity is scored at on `window`-token windows: those of `lengths` that fit, and the window."""
    return sorted({L for L in lengths if 1 < L <= window} | {window})


def prefix_nll(model, window: dict, lengths: list[int]) -> dict[int, tuple[float, int]]:
    """{L: (summed NLL, target count) of the window's first L tokens}, from one forward pass over the window."""
    n = len(window["input_ids"])
    too_long = [L for L in lengths if L > n]
    if too_long:
        raise ValueError(f"lengths {too_long} exceed the {n}-token window")
    nll, keep = target_nll(model, window)
    counted = np.where(keep, nll, 0.0)
    return {L: (float(counted[: L - 1].sum()), int(keep[: L - 1].sum())) for L in lengths}


def perplexity_by_length(model, packed, rows: list[int], lengths: list[int]) -> dict[int, float]:
    """{L: perplexity of the first L tokens of each window in `rows`}, the targets of all windows pooled."""
    if not rows:
        raise UserError("no windows to compute perplexity on")
    totals = {L: [0.0, 0] for L in lengths}
    for r in rows:
        for L, (nll, count) in prefix_nll(model, packed[r], lengths).items():
            totals[L][0] += nll
            totals[L][1] += count
    return {L: math.exp(nll / max(count, 1)) for L, (nll, count) in totals.items()}


def perplexity(model, packed, rows: list[int]) -> float:
    """Perplexity of the whole windows in `rows`."""
    window = packed.manifest.seq_len
    return perplexity_by_length(model, packed, rows, [window])[window]
