"""`lctrain diagnose rope`: how far bf16 breaks RoPE's relative-position property (the paper's Section 2.2, Figure 1,
Appendix B Figure 7).

RoPE depends in exact arithmetic only on relative positions, so shifting every position id must leave attention
unchanged. The paper: "if the original position indices are [0, 1, ..., L-1], after applying the shift they become
[Δ, Δ+1, ..., Δ+L-1]", and with ATTN^{l,h}(X, Δ) the attention matrix of head h in layer l under the shift Δ

    D(X, Δ1, Δ2) = Σ_{l,h} Σ_{j=1}^{L} n ⊙ ( Σ_{i=1}^{L} |ATTN^{l,h}_{ij}(X, Δ1) − ATTN^{l,h}_{ij}(X, Δ2)| )  (Eq. 4)

"the normalization vector n = [1/L, 1/(L−1), ..., 1] is applied element-wise (denoted by ⊙) to account for the
varying number of elements in lower triangular matrices due to causal masking": i is the query, j the key, and key
column j (1-based) has L−j+1 queries that see it. D is a sum over layers and heads (not a mean), of per-key means.
The per-token difference (Figure 1, middle: "without summing over t_row") is the key-j term of that sum, d_j; D is
Σ_j d_j. Over several sequences X, D and d_j are averaged; the per-sequence values are kept (Figure 7, left).

    D_logit = (1/T) Σ_{l,h} Σ_{i=1}^{T} |A^{l,h}_{i,j=1}(Δ1) − A^{l,h}_{i,j=1}(Δ2)|  (Eq. 5)

with the attention logits A_ij = q_iᵀ k_j of Eq. 1, where the paper drops the 1/√d factor "to simplify notation"
(`--scaled-logits` reports the logits times the model's attention scaling instead), at Δ1 = 0 and Δ2 = 16 for each
sequence length T.

How it is computed. Each forward pass runs the whole decoder on a batch of one sequence at several shifts: element 0
at the reference shift, the others at the compared shifts, so differences of earlier layers propagate, as they do in
training. An attention implementation registered with Hugging Face (`probe_attention`) computes causal attention
itself, head group by head group, and adds each layer's differences to a `DriftProbe`; no [layers, heads, T, T]
tensor is ever held. Logits are accumulated in fp32 from q and k rounded to the compute dtype, softmax in fp32, the
weights rounded to the compute dtype before they multiply V: what FlashAttention2 does. A shift equal to the
reference is the same computation, so its difference is 0 without a pass.

Cases (`CASES`): "fp32" — the model in fp32. "bf16" — as the paper ran it: "the rotation matrix is applied outside
the FlashAttention2 module using Float32 precision", q and k cast to bf16 after it (`model.rope_fp32`).
"bf16_rope_bf16" — an extra: bf16 with the rotation in bf16, the Hugging Face default. "random" — "random
initialized parameters (initialized with kaiming_uniform_ in PyTorch by default) in BFloat16", rotation in fp32 as
for "bf16"; see `reinit_random` for what exactly is re-initialised. The bf16 cases round the fp32 parameters to bf16;
the rotary frequencies stay fp32, as Hugging Face loads them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from rich.table import Table
from transformers import AttentionInterface, AutoModelForCausalLM

from lctrain.attention.engines.common import expand_kv_heads, unify_dtypes
from lctrain.compat.transformers import load_errors
from lctrain.config import Config, bundled_config_names, data_dir, load_config
from lctrain.console import no_library_bars, plain_console
from lctrain.costmodel import ModelShape, step_flops
from lctrain.diagnostics.probe_text import probe_sequences
from lctrain.errors import UserError, output_dir
from lctrain.eval.runner import pick_device
from lctrain.measure import peak_bytes, reset_peak, timed
from lctrain.model import build_model, rotary_in_fp32, unloadable_because
from lctrain.progress_bar import counted_bar
from lctrain.reports.plots import plot_rope_figure1, plot_rope_figure7
from lctrain.rundir import RunDir
from lctrain.tokenizer import ANCHOR_AUTO, load_tokenizer, recorded_anchor
from lctrain.units import GiB, to_gb

SHIFTS = (0, 2, 4, 6, 8, 10, 12, 14, 15, 17, 18, 20, 22, 50, 100, 200, 500, 1000, 2000)
DELTA2 = 16
LOGIT_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
SAMPLES = 50
SEQ_LEN = 4096
PROBE_IMPL = "lctrain_rope_probe"
CASES = {
    "fp32": "fp32",
    "bf16": "bf16, rotation in fp32 (the paper's bf16)",
    "random": "random init (kaiming_uniform_), bf16, rotation in fp32",
    "bf16_rope_bf16": "bf16, rotation in bf16 (HF default; extra)",
}
DEFAULT_CASES = ("fp32", "bf16", "random")
# One loaded model serves every case, converted in place in this order: fp32, its parameters rounded to bf16, the
# rotation moved to fp32, the decoder re-initialised.
_CASE_ORDER = ("fp32", "bf16_rope_bf16", "bf16", "random")
MAX_SEQ_LEN = 16384
# The [batch, heads, T, T] fp32 temporaries of one head group of the probe (logits, weights, their difference, a
# softmax temporary): at most this many bytes, so a 7B model at 8192 tokens fits next to its weights.
_CHUNK_BYTES = {"cpu": GiB, "cuda": 8 * GiB}


def key_normalisation(length: int) -> torch.Tensor:
    """Eq. 4's n = [1/L, 1/(L−1), ..., 1] (float64): key j (0-based) is seen by the L − j queries i >= j."""
    return 1.0 / torch.arange(length, 0, -1, dtype=torch.float64)


def attention_difference(key_sums: torch.Tensor) -> torch.Tensor:
    """Eq. 4 from Σ_{l,h,i} |ΔATTN_ij| per key j (last dimension): D = Σ_j n_j · key_sums_j."""
    return (key_sums * key_normalisation(key_sums.shape[-1])).sum(-1)


def per_key_difference(key_sums: torch.Tensor) -> torch.Tensor:
    """The per-token difference d_j = n_j · Σ_{l,h,i} |ΔATTN_ij|; Σ_j d_j = D."""
    return key_sums * key_normalisation(key_sums.shape[-1])


@dataclass
class DriftProbe:
    """Filled by `probe_attention` in one forward pass of a batch whose element 0 has the reference shift and
    elements 1.. the compared shifts. Per compared element: `key_sums[b, j]` = Σ_{l,h,i} |ATTN_ij − ATTN^ref_ij|
    (when `weights`), and `first_logit_sums[b]` = Σ_{l,h,i} |A_i0 − A^ref_i0| with the unscaled logits A = q·k."""

    weights: bool
    chunk_bytes: int
    layers: int = 0
    scaling: float | None = None
    key_sums: torch.Tensor | None = None
    first_logit_sums: torch.Tensor | None = None

    def heads_per_chunk(self, batch: int, heads: int, length: int) -> int:
        return max(1, min(heads, self.chunk_bytes // (4 * batch * length * length * 4)))

    def add(self, logits: torch.Tensor, weights: torch.Tensor) -> None:  # [B, heads of the group, T, T], fp32
        first = (logits[1:, :, :, 0] - logits[:1, :, :, 0]).abs().sum(dim=2).double().sum(dim=1)
        self.first_logit_sums = first if self.first_logit_sums is None else self.first_logit_sums + first
        if self.weights:
            diff = (weights[1:] - weights[:1]).abs_()
            keys = diff.sum(dim=2).double().sum(dim=1)  # over queries i, then heads
            self.key_sums = keys if self.key_sums is None else self.key_sums + keys


def probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, rope_probe=None, **kwargs):
    """A Hugging Face attention implementation: causal attention computed in head groups like FlashAttention2
    (fp32 logits of dtype-rounded q and k, fp32 softmax, weights in the value dtype times V), feeding `rope_probe`.
    The mask is built here (causal, no padding: the probe's batches are one sequence at several shifts)."""
    q, k, v = unify_dtypes(query, key, value)  # the rotation in fp32 gives fp32 q and k, cast as the engines cast them
    k, v = expand_kv_heads(k, q.shape[1], dim=1), expand_kv_heads(v, q.shape[1], dim=1)
    dtype = v.dtype
    scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
    batch, heads, n, _ = q.shape
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    out = torch.empty_like(q)
    step = rope_probe.heads_per_chunk(batch, heads, n) if rope_probe is not None else heads
    for h in range(0, heads, step):
        part = slice(h, h + step)
        logits = torch.matmul(q[:, part].float(), k[:, part].float().transpose(-1, -2))
        weights = torch.softmax((logits * scaling).masked_fill_(future, float("-inf")), dim=-1)
        if rope_probe is not None:
            rope_probe.add(logits, weights)
        out[:, part] = torch.matmul(weights.to(dtype), v[:, part])
    if rope_probe is not None:
        rope_probe.layers += 1
        rope_probe.scaling = float(scaling)
    return out.transpose(1, 2).contiguous(), None


def unmeasured_attention(config) -> str | None:
    """A note naming what the model's own attention does that `probe_attention` (plain causal attention) leaves out,
    or None: the drift is then measured on another attention than the model runs."""
    parts = []
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        parts.append(f"attention soft-capping (attn_logit_softcapping = {cap})")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    slides = getattr(config, "use_sliding_window", True) is not False and (
        layer_types is None or "sliding_attention" in layer_types
    )
    if window is not None and slides:
        parts.append(f"the sliding window (sliding_window = {window})")
    if not parts:
        return None
    return f"measured with plain causal attention, without the model's {' and '.join(parts)}"


def _register() -> None:
    AttentionInterface.register(PROBE_IMPL, probe_attention)


def _run(model, ids: torch.Tensor, shifts: list[int], probe: DriftProbe) -> DriftProbe:
    """One pass of the decoder (the vocabulary projection is not measured) over `ids` at each of `shifts`."""
    n = ids.shape[0]
    pos = torch.arange(n, device=ids.device)
    model.get_decoder()(
        input_ids=ids.expand(len(shifts), n),
        position_ids=torch.stack([pos + s for s in shifts]),
        use_cache=False,
        rope_probe=probe,
    )
    if probe.layers == 0:
        raise UserError(
            f"{type(model).__name__}: its attention layers do not go through the Hugging Face attention "
            f"interface, so the RoPE diagnostic cannot observe them"
        )
    return probe


@dataclass
class Plan:
    """What one case measures on each sequence."""

    seq_len: int
    shifts: tuple[int, ...]
    delta2: int
    logit_lengths: tuple[int, ...]
    vary_delta2: bool
    shift_batch: int
    chunk_bytes: int

    def groups(self, reference: int, shifts) -> list[list[int]]:
        """Indices of `shifts` per forward pass; a shift equal to the reference needs none."""
        todo = [i for i, s in enumerate(shifts) if s != reference]
        return [todo[i : i + self.shift_batch] for i in range(0, len(todo), self.shift_batch)]

    def sweeps(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """The attention-weight sweeps on each sequence, name -> (reference shift, compared shifts): Δ1 against Δ2
        (Figure 1, left), Δ1 = 0 for the per-token split when the first sweep lacks it (Figure 1, middle), Δ2
        against Δ1 = 0 (Figure 7, right)."""
        out = {"D": (self.delta2, self.shifts)}
        if 0 not in self.shifts:
            out["per_token"] = (self.delta2, (0,))
        if self.vary_delta2:
            out["D_vary_delta2"] = (0, self.shifts)
        return out

    def passes(self) -> int:
        """Forward passes per sequence."""
        return sum(len(self.groups(*sweep)) for sweep in self.sweeps().values()) + len(self.logit_lengths)

    def tokens(self) -> int:
        """Tokens (batch elements x length) through the decoder per sequence."""
        return sum(
            (len(g) + 1) * self.seq_len for sweep in self.sweeps().values() for g in self.groups(*sweep)
        ) + 2 * sum(self.logit_lengths)

    def pairs(self) -> int:
        """(query, key) pairs whose logits and weights `probe_attention` computes in each layer per sequence: the
        whole T x T square of every batch element (the causal half is masked, not skipped)."""
        return sum(
            (len(g) + 1) * self.seq_len**2 for sweep in self.sweeps().values() for g in self.groups(*sweep)
        ) + 2 * sum(n**2 for n in self.logit_lengths)


def key_sums(model, ids: torch.Tensor, reference: int, shifts, plan: Plan, advance: Callable[[], None]) -> torch.Tensor:
    """[len(shifts), T] float64: Σ_{l,h,i} |ATTN_ij(X, s) − ATTN_ij(X, reference)| for each shift s."""
    out = torch.zeros(len(shifts), ids.shape[0], dtype=torch.float64)
    for group in plan.groups(reference, shifts):
        probe = _run(model, ids, [reference, *(shifts[i] for i in group)], DriftProbe(True, plan.chunk_bytes))
        out[group] = probe.key_sums.cpu()
        advance()
    return out


def first_logit_difference(model, ids: torch.Tensor, delta1: int, delta2: int, chunk_bytes: int) -> tuple[float, float]:
    """Eq. 5 on `ids` (T tokens): (D_logit with unscaled logits, the model's attention scaling)."""
    probe = _run(model, ids, [delta2, delta1], DriftProbe(False, chunk_bytes))
    return float(probe.first_logit_sums[0]) / ids.shape[0], probe.scaling


def measure_sequence(model, ids: torch.Tensor, plan: Plan, advance: Callable[[], None] = lambda: None) -> dict:
    """Every quantity for one sequence `ids` (at least max(seq_len, logit lengths) tokens, on the model's device)."""
    x = ids[: plan.seq_len]
    sums = {name: key_sums(model, x, *sweep, plan, advance) for name, sweep in plan.sweeps().items()}
    at_zero = sums["per_token"][0] if "per_token" in sums else sums["D"][plan.shifts.index(0)]
    result = {"D": attention_difference(sums["D"]).tolist(), "per_token": per_key_difference(at_zero).tolist()}
    if "D_vary_delta2" in sums:
        result["D_vary_delta2"] = attention_difference(sums["D_vary_delta2"]).tolist()
    logits = []
    for length in plan.logit_lengths:
        logits.append(first_logit_difference(model, ids[:length], 0, plan.delta2, plan.chunk_bytes))
        advance()
    result["D_logit"] = [v for v, _ in logits]
    result["logit_scaling"] = logits[0][1] if logits else None
    return result


def first_token_share(per_token: list[float]) -> float:
    total = sum(per_token)
    return per_token[0] / total if total > 0 else 0.0


def summarize(per_sequence: list[dict], scaled: bool) -> dict:
    """Means over the sequences, with the per-sequence values kept (Figure 7)."""

    def mean(key):
        return torch.tensor([r[key] for r in per_sequence], dtype=torch.float64).mean(0).tolist()

    scale = per_sequence[0]["logit_scaling"] if scaled and per_sequence[0]["logit_scaling"] is not None else 1.0
    per_token = mean("per_token")
    others = per_token[1:]
    rest = sum(others) / len(others) if others else 0.0
    out = {
        "D": mean("D"),
        "D_per_sample": [r["D"] for r in per_sequence],
        "per_token": per_token,
        "first_token_share": first_token_share(per_token),
        "first_token_share_per_sample": [first_token_share(r["per_token"]) for r in per_sequence],
        "first_token_vs_others": per_token[0] / rest if rest > 0 else 0.0,
        "D_logit": [v * scale for v in mean("D_logit")],
        "D_logit_per_sample": [[v * scale for v in r["D_logit"]] for r in per_sequence],
        "logit_scaling": per_sequence[0]["logit_scaling"],
    }
    if "D_vary_delta2" in per_sequence[0]:
        out["D_vary_delta2"] = mean("D_vary_delta2")
        out["D_vary_delta2_per_sample"] = [r["D_vary_delta2"] for r in per_sequence]
    return out


def reinit_random(model, seed: int) -> list[str]:
    """The paper's random case, in place: in the decoder (what is measured; a tied output head is left alone), every
    module that defines `reset_parameters` is reset by it, which for nn.Linear is PyTorch's default
    `kaiming_uniform_(a=√5)` (weights uniform in ±1/√fan_in, biases likewise) and for nn.Embedding N(0, 1); norm
    modules without one (RMSNorm) get weight 1 and bias 0, their constructors' values. Seeded. Returns the names of
    parameters that are none of these and keep their values."""
    devices = [model.device.index or 0] if model.device.type == "cuda" else []
    decoder = model.get_decoder()
    reset = set()
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        for name, module in decoder.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif type(module).__name__.endswith("Norm"):
                for key, p in own.items():
                    p.fill_(1.0 if key == "weight" else 0.0)
            else:
                continue
            reset.update(f"{name}.{key}" if name else key for key in own)
    return [n for n, _ in decoder.named_parameters() if n not in reset]


class ModelSource:
    """Where the diagnosed model comes from: an lctrain config (`model.arch` = a seeded random init, or
    `model.name_or_path`, with the config's RoPE settings, as training builds it) or a model directory / hub name."""

    def __init__(self, spec: str, cfg: Config | None = None):
        self.spec = spec
        self.cfg = cfg

    @property
    def name(self) -> str:
        return self.cfg.name if self.cfg is not None else self.spec

    def tokenizer(self):
        return load_tokenizer(self.cfg.data.tokenizer if self.cfg is not None else self.spec)

    def anchor(self) -> str:
        """What starts a probe: the config's `data.anchor`, the anchor a checkpoint trained with, else auto."""
        if self.cfg is not None:
            return self.cfg.data.anchor
        recorded = recorded_anchor(Path(self.spec)) if Path(self.spec).is_dir() else None
        return recorded.token if recorded is not None else ANCHOR_AUTO

    def default_text(self) -> Path:
        path = data_dir(self.cfg) if self.cfg is not None else None
        if path is None or not path.exists():
            prepare = f"run 'lctrain prepare -c {self.spec}' first, or " if self.cfg is not None else ""
            raise UserError(
                f"no text to probe {self.name} with: {prepare}pass --text PATH (a prepared dataset "
                f"directory, a .txt/.jsonl file or a folder of them)"
            )
        return path

    def load(self, dtype: str, device: str):
        no_library_bars()  # a "Loading weights" bar per case would tear through diagnose's own
        if self.cfg is None:
            try:
                model = AutoModelForCausalLM.from_pretrained(self.spec, dtype=getattr(torch, dtype))
            except load_errors() as e:
                raise UserError(
                    f"'{self.spec}' cannot be loaded as a Hugging Face model ({unloadable_because(self.spec, e)}); "
                    f"pass a local model directory, a hub name that is cached, or an lctrain config"
                ) from None
            return model.to(device).eval()
        cfg = self.cfg.model_copy(deep=True)
        cfg.model.dtype = dtype
        cfg.model.rope_fp32 = False
        return build_model(cfg, device=device).model.eval()


def model_source(spec: str, overrides: list[str] | tuple = ()) -> ModelSource:
    """A bundled config name or YAML path -> its config; a directory or anything else -> a Hugging Face model."""
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")) or (not path.exists() and spec in bundled_config_names()):
        return ModelSource(spec, load_config(spec, overrides))
    if overrides:
        raise UserError("--set applies to an lctrain config; pass a config name or YAML file as MODEL to use it")
    if path.exists() and not (path / "config.json").is_file():
        exports = RunDir(path).exports()
        hint = f"; a run directory's models are its hf/step_N exports, e.g. {exports[-1]}" if exports else ""
        raise UserError(f"{path}: not a Hugging Face model directory (no config.json) nor a config YAML{hint}")
    return ModelSource(spec)


def case_models(model, cases, seed: int) -> Iterator[tuple[str, object, dict]]:
    """(case, model, notes) for each selected case in `_CASE_ORDER`, converting `model` (loaded in fp32, or in bf16
    when fp32 is not asked for) in place between them."""
    last = max(_CASE_ORDER.index(c) for c in cases)
    for name in _CASE_ORDER[: last + 1]:
        notes = {}
        if name == "bf16_rope_bf16":
            for p in model.parameters():  # not model.to(): the rotary frequencies stay fp32, as HF loads them
                p.data = p.data.to(torch.bfloat16)
        elif name == "bf16":
            rotary_in_fp32(model)
        elif name == "random":
            notes["kept_parameters"] = reinit_random(model, seed)
        if name in cases:
            yield name, model, notes


def parse_shifts(text: str | None, option: str = "--shifts") -> tuple[int, ...]:
    if text is None:
        return SHIFTS
    try:
        shifts = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UserError(f"{option} {text}: expected comma-separated non-negative integers, e.g. 0,2,4,100") from None
    if not shifts or min(shifts) < 0 or len(set(shifts)) != len(shifts):
        raise UserError(f"{option} {text}: expected distinct non-negative integers (position ids start at Δ)")
    return shifts


def parse_cases(text: str | None) -> tuple[str, ...]:
    if text is None:
        return DEFAULT_CASES
    cases = tuple(c.strip() for c in text.split(",") if c.strip())
    if text.strip() == "all":
        return tuple(CASES)
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise UserError(f"--cases {text}: expected some of {', '.join(CASES)} (or all)")
    return cases


def _check(seq_len: int, max_len: int, samples: int, delta2: int, shift_batch: int) -> None:
    if not (2 <= seq_len <= MAX_SEQ_LEN) or max_len < 64:
        raise UserError(
            f"--seq-len {seq_len} / --max-len {max_len}: need 2 <= seq_len <= {MAX_SEQ_LEN} (the paper "
            f"uses 4096) and max_len >= 64"
        )
    if samples < 1 or shift_batch < 1 or delta2 < 0:
        raise UserError(
            f"--samples {samples}, --shift-batch {shift_batch}, --delta2 {delta2}: need samples >= 1, "
            f"shift-batch >= 1 and delta2 >= 0"
        )


def estimate_flops(model, plan: Plan) -> float:
    """Forward FLOPs per sequence of what `_run` runs, one forward pass of the cost model: the decoder layers'
    projections on every token (not the vocabulary projection, which the decoder alone leaves out) and the probe's
    attention over `Plan.pairs` in every layer."""
    shape = ModelShape.from_hf_config(model.config)
    return step_flops(shape.decoder_linear_params(), shape.layers, shape.width, plan.tokens(), plan.pairs(), passes=1)


def diagnose_rope(
    src: ModelSource,
    *,
    text: str | None = None,
    samples: int = SAMPLES,
    seq_len: int = SEQ_LEN,
    max_len: int = 8192,
    shifts=SHIFTS,
    delta2: int = DELTA2,
    cases=DEFAULT_CASES,
    scaled_logits: bool = False,
    vary_delta2: bool = False,
    shift_batch: int = 4,
    device: str | None = None,
    out: str | None = None,
    seed: int = 0,
) -> Path:
    """Run the cases on one model (`model_source`: a Hugging Face model, or an lctrain config); write rope_drift.json,
    rope_figure1.png and rope_figure7.png to `out` (default diagnose/<name>) and print tables. Returns the output
    directory."""
    _check(seq_len, max_len, samples, delta2, shift_batch)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(src.name).name or src.name)
    out_dir = output_dir(Path(out) if out else Path("diagnose") / safe)
    dev = pick_device(device)
    console = plain_console()
    started = time.perf_counter()
    model = src.load("float32" if "fp32" in cases else "bfloat16", dev)  # first: a bad model is the likelier mistake
    loaded = time.perf_counter() - started
    text_path = Path(text) if text else src.default_text()
    logit_lengths = tuple(n for n in LOGIT_LENGTHS if n <= max_len)
    length = max(seq_len, *logit_lengths)
    vocab = model.get_input_embeddings().num_embeddings
    probe_text = probe_sequences(text_path, src.tokenizer(), length, samples, vocab, seed, src.anchor())
    plan = Plan(
        seq_len,
        tuple(shifts),
        delta2,
        logit_lengths,
        vary_delta2,
        shift_batch,
        _CHUNK_BYTES["cuda" if dev.startswith("cuda") else "cpu"],
    )
    flops = estimate_flops(model, plan) * samples
    console.print(
        f"{src.name} on {dev} (loaded in {loaded:.1f} s): {len(cases)} case(s) x {samples} sequences of "
        f"{length:,} tokens from {text_path}, each opening with the anchor {probe_text.anchor['token']} (id "
        f"{probe_text.anchor['id']}) and measured in {plan.passes()} forward passes of the decoder ({plan.tokens():,} "
        f"tokens per sequence, {samples * plan.passes()} passes and {samples * plan.tokens():,} tokens per case) = "
        f"{f'{flops / 1e12:,.1f} TFLOP' if flops >= 1e11 else f'{flops / 1e9:,.3g} GFLOP'} per case"
    )
    unmeasured = unmeasured_attention(model.config)
    if unmeasured:
        console.print(f"note: {unmeasured}")
    _register()
    model.set_attn_implementation(PROBE_IMPL)
    ids = [torch.from_numpy(s).to(dev) for s in probe_text.sequences]
    probe_device = torch.device(dev)

    def measure_all(m, advance: Callable[[], None]) -> list[dict]:
        return [measure_sequence(m, x, plan, advance) for x in ids]

    results_cases, timing = {}, {}
    with counted_bar() as bar, torch.inference_mode():
        jobs = {c: bar.add_task(c, total=samples * plan.passes()) for c in cases}
        for name, m, notes in case_models(model, cases, seed):
            reset_peak(probe_device)
            per_sequence, seconds = timed(partial(measure_all, m, partial(bar.advance, jobs[name])), probe_device)
            timing[name] = {"seconds": round(seconds, 3), "tflops_per_s": round(flops / seconds / 1e12, 3)}
            if probe_device.type == "cuda":
                timing[name]["peak_memory_gb"] = round(to_gb(peak_bytes(probe_device)), 2)
            results_cases[name] = {"label": CASES[name], **summarize(per_sequence, scaled_logits), **notes}
    del model
    results = {
        "model": src.name,
        "device": dev,
        "seq_len": seq_len,
        "samples": samples,
        "text": probe_text.describe(text_path),
        "shifts": list(shifts),
        "delta2": delta2,
        "vary_delta2": vary_delta2,
        "logit_lengths": list(logit_lengths),
        "logits": "scaled by the attention scaling (q·k/√d)" if scaled_logits else "unscaled (q·k, Eq. 1)",
        "cases": results_cases,
        "note": unmeasured,
        "timing": {"load_seconds": round(loaded, 3), "estimated_tflop_per_case": round(flops / 1e12, 3), **timing},
        # "highest": fp32 matmuls are true fp32 (no TF32), which the fp32 case relies on
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "definitions": {
            "D": "Eq. 4: sum over layers l and heads h of sum_j n_j sum_i |ATTN_ij(X, Δ1) - ATTN_ij(X, Δ2)|, n_j = "
            "1/(L-j+1) for key j = 1..L; mean over the sequences (D_per_sample: each); at Δ1 = Δ2 exactly 0",
            "per_token": "d_j, the key-j term of D at Δ1 = 0 (sum_j d_j = D); mean over the sequences",
            "first_token_share": "per_token[0] / sum(per_token)",
            "D_logit": "Eq. 5: (1/T) sum over l, h, i of |A_i1(Δ1=0) - A_i1(Δ2)| for each T in logit_lengths, "
            "A = q·k (times logit_scaling when logits are scaled)",
            "D_vary_delta2": "Figure 7 (right): D(X, Δ1 = 0, Δ2) for Δ2 in shifts",
        },
    }
    (out_dir / "rope_drift.json").write_text(json.dumps(results, indent=2))
    plot_rope_figure1(results, out_dir / "rope_figure1.png")
    plot_rope_figure7(results, out_dir / "rope_figure7.png")
    print_rope_table(results, out_dir, console)
    return out_dir


def print_rope_table(results: dict, out_dir: Path, console) -> None:
    v = results["cases"]
    names = list(v)
    table = Table(
        title=f"RoPE drift of {results['model']}: D(X, Δ1, Δ2={results['delta2']}) (Eq. 4), T="
        f"{results['seq_len']}, mean of {results['samples']} sequences"
    )
    table.add_column("Δ1", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    for i, d1 in enumerate(results["shifts"]):
        table.add_row(str(d1), *(f"{v[n]['D'][i]:.4g}" for n in names))
    table.add_row("first-token share", *(f"{100 * v[n]['first_token_share']:.1f}%" for n in names))
    table.add_row("first token / others", *(f"{v[n]['first_token_vs_others']:.1f}x" for n in names))
    console.print(table)
    lt = Table(title=f"first-token logit difference D_logit (Eq. 5, Δ1=0, Δ2={results['delta2']}, {results['logits']})")
    lt.add_column("T", justify="right")
    for n in names:
        lt.add_column(n, justify="right")
    for i, length in enumerate(results["logit_lengths"]):
        lt.add_row(str(length), *(f"{v[n]['D_logit'][i]:.4g}" for n in names))
    console.print(lt)
    t = results["timing"]
    console.print(
        "timing: "
        + ", ".join(
            f"{n} {t[n]['seconds']:.1f} s ({t[n]['tflops_per_s']:.2f} TFLOP/s"
            + (f", peak {t[n]['peak_memory_gb']:.1f} GB)" if "peak_memory_gb" in t[n] else ")")
            for n in names
        )
        + f"; model load {t['load_seconds']:.1f} s"
    )
    console.print(f"wrote {out_dir}/rope_drift.json, rope_figure1.png, rope_figure7.png")
