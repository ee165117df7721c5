"""`lctrain diagnose rope`: how far bf16 breaks RoPE's relative-position property (the paper's Section 2, Figure 1).

RoPE attention depends, in exact arithmetic, only on relative positions, so shifting every position id of an input X
by a constant Δ must leave every attention weight unchanged. With the weights A^{l,h}(X, Δ) of layer l and head h
when the position ids are Δ, Δ+1, ..., Δ+N-1, this module measures

    D(X, Δ1, Δ2) = 1/(L·H) Σ_{l,h} 1/N Σ_i Σ_{j<=i} |A^{l,h}_{ij}(X, Δ1) - A^{l,h}_{ij}(X, Δ2)|      (Eq. 4)

(the mean over layers, heads and queries of the L1 distance between the two attention rows; 0 <= D <= 2), its
per-key-token split d_j (the terms with key j; Σ_j d_j = D), the first token's share d_0 / D and its ratio to the mean
of the other tokens' d_j. Each attention row sums to 1, so what the first token's weight gains the others lose: its
share is at most 1/2 even when it carries all of the error at its source; the ratio shows how it dwarfs any other
single token (the paper's Figure 1, middle). And

    D_logit(N) = 1/(L·H·N) Σ_{l,h,i} |s^{l,h}_{i0}(X, Δ1) - s^{l,h}_{i0}(X, Δ2)|                        (Eq. 5)

the mean absolute difference of the scaled attention logits s = q·k/√d of every query with the first token, against
the sequence length N. The whole forward pass runs at each shift, so differences of earlier layers propagate, as they
do in training. Three precisions: fp32; bf16 (HF default: the rotation in bf16); bf16 with the rotation in fp32
before the bf16 cast (`model.rope_fp32`). Logits are computed in the model's dtype, softmax in fp32, as in eager
attention. X is seeded essay text (lctrain.eval.filler) after the tokenizer's BOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lctrain.config import Config
from lctrain.errors import UserError
from lctrain.tokenizer import text_encoder

SHIFTS = (0, 2, 4, 6, 8, 10, 12, 14, 15, 17, 18, 20, 22, 50, 100, 200, 500, 1000, 2000)
DELTA2 = 16
LOGIT_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
PROBE_IMPL = "lctrain_rope_probe"
VARIANTS = ("fp32", "bf16", "bf16+rope_fp32")


@dataclass
class Probe:
    """Accumulates, over the layers of one forward pass of a 2-sequence batch (shift Δ1, shift Δ2), either the
    attention-weight differences or the first-token logit differences."""

    kind: str  # "weights" | "first_logit"
    layers: int = 0
    d_sum: float = 0.0
    per_token: torch.Tensor | None = None
    logit_sum: float = 0.0

    def add_weights(self, diff: torch.Tensor) -> None:  # diff [H, N, N] = |A(Δ1) - A(Δ2)|
        heads, n, _ = diff.shape
        per_key = diff.sum(dim=(0, 1)).double() / (heads * n)
        self.per_token = per_key if self.per_token is None else self.per_token + per_key
        self.d_sum += float(per_key.sum())
        self.layers += 1

    def add_first_logit(self, diff: torch.Tensor) -> None:  # diff [H, N]
        self.logit_sum += float(diff.double().mean())
        self.layers += 1


def probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, rope_probe=None, **kwargs):
    """An HF attention implementation that computes causal attention like eager attention and records the
    difference between batch element 0 (shift Δ1) and 1 (shift Δ2) into `rope_probe`."""
    dtype = value.dtype  # with an fp32 rotation q/k arrive in fp32; training casts them back before the kernel
    q, k = query.to(dtype), key.to(dtype)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
    n = q.shape[2]
    if rope_probe is None or rope_probe.kind == "weights":
        logits = torch.matmul(q, k.transpose(-1, -2)) * scaling
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        weights = torch.softmax(logits.float().masked_fill(future, float("-inf")), dim=-1)
        if rope_probe is not None:
            rope_probe.add_weights((weights[0] - weights[1]).abs())
        out = torch.matmul(weights.to(dtype), v)
    else:
        first = torch.matmul(q, k[:, :, :1].transpose(-1, -2)).squeeze(-1) * scaling
        rope_probe.add_first_logit((first[0].float() - first[1].float()).abs())
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_IMPL, probe_attention)


def probe_input(tokenizer, n: int, seed: int = 0) -> torch.Tensor:
    """N token ids: BOS (the first token the paper singles out) then seeded essay text."""
    from lctrain.eval.filler import Essay

    essay, k = Essay(seed), 64
    encoder = text_encoder(tokenizer)
    ids: list[int] = []
    while len(ids) < n:
        ids = encoder.encode(" ".join(essay.sentences(k)))
        k *= 2
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return torch.tensor([[bos] + ids[: n - 1]])


def _shifted_pair(ids: torch.Tensor, d1: int, d2: int, device) -> dict:
    n = ids.shape[1]
    pos = torch.arange(n)
    return {"input_ids": ids.repeat(2, 1).to(device), "position_ids": torch.stack([pos + d1, pos + d2]).to(device)}


@torch.inference_mode()
def measure(model, ids: torch.Tensor, long_ids: torch.Tensor, shifts=SHIFTS, delta2: int = DELTA2,
            logit_lengths=LOGIT_LENGTHS) -> dict:
    """For one model: D against Δ1 on `ids`; per-token d_j and the first token's share at Δ1 = 0; D_logit on the
    first `length` tokens of `long_ids` for each length."""
    _register()
    model.set_attn_implementation(PROBE_IMPL)
    device = next(model.parameters()).device

    def run(kind: str, x: torch.Tensor, d1: int) -> Probe:
        probe = Probe(kind)
        # the decoder alone: the attention layers are what is measured, the vocabulary projection would only cost
        model.get_decoder()(**_shifted_pair(x, d1, delta2, device), use_cache=False, rope_probe=probe)
        if probe.layers == 0:
            raise UserError(f"{type(model).__name__}: its attention layers do not go through the Hugging Face "
                            f"attention interface, so the RoPE diagnostic cannot observe them")
        return probe

    d_curve, p0 = [], None
    for d1 in shifts:
        p = run("weights", ids, d1)
        d_curve.append(p.d_sum / p.layers)
        if d1 == 0:
            p0 = p
    if p0 is None:  # the per-token split is taken at Δ1 = 0; one more pass when the shifts leave it out
        p0 = run("weights", ids, 0)
    per_token = (p0.per_token / p0.layers).tolist()
    total = sum(per_token)
    logit_curve = []
    for length in logit_lengths:
        p = run("first_logit", long_ids[:, :length], 0)
        logit_curve.append(p.logit_sum / p.layers)
    others = per_token[1:]
    rest = sum(others) / len(others) if others else 0.0
    return {"D": d_curve, "per_token": per_token, "first_token_share": per_token[0] / total if total > 0 else 0.0,
            "first_token_vs_others": per_token[0] / rest if rest > 0 else float("inf") if per_token[0] > 0 else 0.0,
            "D_logit": logit_curve}


@dataclass
class ModelSource:
    """Where the diagnosed model comes from: an lctrain config (`model.arch` or `model.name_or_path`, with the
    config's RoPE settings, as training would build it) or a hub name / model directory used as it is."""

    spec: str
    cfg: Config | None = None  # set when `spec` is a config
    _first_weights: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.cfg.name if self.cfg is not None else self.spec

    def tokenizer(self):
        from lctrain.tokenizer import load_tokenizer

        return load_tokenizer(self.cfg.data.tokenizer if self.cfg is not None else self.spec)

    def load(self, dtype: str, device: str):
        """The model in `dtype` ("float32" | "bfloat16"). A random-init config gets the weights of its first load
        (fp32 in `diagnose_rope`) in every later load, so the precisions compare the same model."""
        if self.cfg is None:
            from transformers import AutoModelForCausalLM

            from lctrain.compat.transformers import load_errors

            try:
                model = AutoModelForCausalLM.from_pretrained(self.spec, dtype=getattr(torch, dtype))
            except load_errors() as e:
                raise UserError(f"'{self.spec}' cannot be loaded as a Hugging Face model ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:160]}); pass a local model directory, a hub name that is "
                                f"cached, or an lctrain config") from None
            return model.to(device).eval()
        from lctrain.model import build_model

        cfg = self.cfg.model_copy(deep=True)
        cfg.model.dtype = dtype
        cfg.model.rope_fp32 = False
        model = build_model(cfg, device=device).eval()
        if cfg.model.arch is not None:
            if not self._first_weights:
                self._first_weights = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
            else:
                model.load_state_dict(self._first_weights)
        return model


def model_source(spec: str, overrides: list[str] | tuple = ()) -> ModelSource:
    """A bundled config name or YAML path -> its config; a directory or anything else -> a Hugging Face model."""
    from lctrain.config import bundled_config_names, load_config

    path = Path(spec)
    is_config = spec.endswith((".yaml", ".yml")) or (not path.exists() and spec in bundled_config_names())
    if is_config:
        return ModelSource(spec, load_config(spec, overrides))
    if overrides:
        raise UserError("--set applies to an lctrain config; pass a config name or YAML file as MODEL to use it")
    if path.exists() and not (path / "config.json").is_file():
        raise UserError(f"{path}: not a Hugging Face model directory (no config.json) nor a config YAML")
    return ModelSource(spec)


# The attention-difference needs full seq_len x seq_len maps per head (4 bytes each, two shifts): 16K tokens is
# 2 GiB per head map pair already; the paper's setting is 4096.
MAX_SEQ_LEN = 16384


def diagnose_rope(spec: str, *, overrides: list[str] | tuple = (), seq_len: int = 1024, max_len: int = 8192,
                  shifts=SHIFTS, delta2: int = DELTA2, device: str | None = None, out: str | None = None,
                  seed: int = 0) -> Path:
    """Run the three precisions on one model; write rope_drift.json and rope_drift.png to `out` (default
    diagnose/<name>) and print a table. Returns the output directory."""
    from lctrain.eval.runner import pick_device
    from lctrain.model import rotary_in_fp32

    if not (2 <= seq_len <= MAX_SEQ_LEN) or max_len < 64:
        raise UserError(f"--seq-len {seq_len} / --max-len {max_len}: need 2 <= seq_len <= {MAX_SEQ_LEN} (the "
                        f"difference holds seq_len x seq_len attention maps; the paper uses 4096) and max_len >= 64")
    src = model_source(spec, overrides)
    dev = pick_device(device)
    model = src.load("float32", dev)  # first: a model that cannot be loaded is the likelier mistake
    logit_lengths = tuple(L for L in LOGIT_LENGTHS if L <= max_len)
    long_ids = probe_input(src.tokenizer(), max(seq_len, max(logit_lengths)), seed)
    ids = long_ids[:, :seq_len]
    variants = {}
    variants["fp32"] = measure(model, ids, long_ids, shifts, delta2, logit_lengths)
    del model
    model = src.load("bfloat16", dev)
    variants["bf16"] = measure(model, ids, long_ids, shifts, delta2, logit_lengths)
    rotary_in_fp32(model)
    variants["bf16+rope_fp32"] = measure(model, ids, long_ids, shifts, delta2, logit_lengths)
    del model
    results = {
        "model": src.name,
        "device": dev,
        "seq_len": seq_len,
        "shifts": list(shifts),
        "delta2": delta2,
        "logit_lengths": list(logit_lengths),
        "variants": variants,
        "definitions": {
            "D": "mean over layers, heads and queries of sum_j |A_ij(Δ1) - A_ij(Δ2)| (attention weights, position "
                 "ids shifted by Δ); 0 in exact arithmetic",
            "per_token": "the part of D(0, Δ2) carried by each key token j; sums to D",
            "first_token_share": "per_token[0] / D(0, Δ2)",
            "D_logit": "mean over layers, heads and queries of |q_i·k_0/sqrt(d) at Δ1=0 - the same at Δ2|",
        },
    }
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(src.name).name or src.name)
    out_dir = Path(out) if out else Path("diagnose") / safe
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rope_drift.json").write_text(json.dumps(results, indent=2))
    from lctrain.eval.plots import plot_rope_drift

    plot_rope_drift(results, out_dir / "rope_drift.png")
    print_rope_table(results, out_dir)
    return out_dir


def print_rope_table(results: dict, out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    v = results["variants"]
    names = list(v)
    table = Table(title=f"RoPE drift of {results['model']}: attention difference D(X, Δ1, Δ2={results['delta2']}), "
                        f"N={results['seq_len']}")
    table.add_column("Δ1", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    for i, d1 in enumerate(results["shifts"]):
        table.add_row(str(d1), *(f"{v[n]['D'][i]:.3e}" for n in names))
    table.add_row("first-token share", *(f"{100 * v[n]['first_token_share']:.1f}%" for n in names))
    table.add_row("first token / others", *(f"{v[n]['first_token_vs_others']:.1f}x" for n in names))
    console.print(table)
    lt = Table(title=f"first-token logit difference D_logit (Δ1=0, Δ2={results['delta2']}) against sequence length")
    lt.add_column("N", justify="right")
    for n in names:
        lt.add_column(n, justify="right")
    for i, L in enumerate(results["logit_lengths"]):
        lt.add_row(str(L), *(f"{v[n]['D_logit'][i]:.3e}" for n in names))
    console.print(lt)
    console.print(f"wrote {out_dir}/rope_drift.json, rope_drift.png")
