"""The typed configuration tree: YAML load, `base:` inheritance, `--set a.b=c` overrides, validation, fingerprints.

Every stage takes a `Config`. A config file may name a `base:` config (a bundled name or a path, relative to the
file) whose values it overrides key by key; that keeps the Table 1 configs short and their differences visible.
`--set KEY=VALUE` overrides the same way: a mapping for a section (`train={steps: 4}`) merges into it. Files and
`--set` values are read as YAML 1.2 core (`load_yaml`): `010` is 10, `1:00`, `yes` and `2024-01-01` are text.

The models are the contract: every field carries its description and its domain (ranges, finiteness, enumerations,
cross-field rules), so a value outside it is refused at load in one line naming the key, and docs/config.md is
generated from them (lctrain/config_reference.py). What depends on the machine rather than on the config (CUDA for
the nccl backend) is checked by `check_on_this_machine` before a run starts, so a GPU config still loads on a laptop.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import re
import shlex
import types
from collections.abc import Hashable
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from lctrain.errors import UserError, first_and_more
from lctrain.eval.ruler import TASK_NAMES
from lctrain.parallel.layout import layout_of

DEFAULT_CONFIG = "tiny_anchor"
DOMAINS = ("CommonCrawl", "C4", "GitHub", "ArXiv", "Book", "Wikipedia", "StackExchange", "other")

# numpy's legacy seeding (np.random.seed, which training calls) takes 0 <= seed < 2**32
SEED_LIMIT = 2**32
# The most optimizer steps a run may ask for (and any count or interval of steps), and the most windows one step reads.
# The steps the prepared token budget could feed are not known when the config loads, so these bound what no run
# reaches (10^9 steps are 32 years at a second a step; the largest published batches are a few thousand windows) while
# keeping a run's counts exact: steps x windows per step stays under 2^53, exact in the float64 of the learning-rate
# schedule and the ETA and in the int64 step and sample counters of DeepSpeed, TensorBoard and W&B; the tokens a run
# counts (metrics.jsonl's `tokens`, an int64 to W&B and pandas) are those of the steps it took, which no run brings near
# 2^63. Unbounded, a fuzzed value ran on as a run of years, or, as a batch, filled the memory before its first step.
MAX_STEPS = 10**9
MAX_WINDOWS_PER_STEP = 2**20
# The validation context key that says whether this machine has CUDA (`check_on_this_machine`).
CUDA_AVAILABLE = "cuda_available"


def _not_a_boolean(value: Any) -> Any:
    # pydantic's lax mode reads `true` as 1 for a number field; `--set train.steps=true` is a mistake, not 1 step
    if isinstance(value, bool):
        raise ValueError("a boolean; expected a number")
    return value


def _finite(value: Any) -> Any:
    # before the range check, which would call nan "not greater than 0"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("not a finite number")
    return _not_a_boolean(value)


def _a_boolean(value: Any) -> Any:
    # pydantic's lax mode reads 'yes', 'on', 'y' and 1 as true; YAML 1.2, which lctrain reads, has only true and false
    if not isinstance(value, bool):
        raise ValueError("not a boolean; expected true or false")
    return value


Bool = Annotated[bool, BeforeValidator(_a_boolean)]
Int = Annotated[int, BeforeValidator(_not_a_boolean)]
Float = Annotated[float, BeforeValidator(_finite), AllowInfNan(False)]
Seed = Annotated[Int, Field(ge=0, lt=SEED_LIMIT)]
Text = Annotated[str, Field(min_length=1)]
Beta = Annotated[Float, Field(ge=0, lt=1)]
Length = Annotated[Int, Field(ge=1)]
Steps = Annotated[Int, Field(le=MAX_STEPS)]  # a count or an interval of optimizer steps
Windows = Annotated[Int, Field(le=MAX_WINDOWS_PER_STEP)]  # windows of one optimizer step


def check_domain_shares(shares: Any, domains: tuple[str, ...] | None = DOMAINS) -> None:
    """A target token share per known domain: finite, non-negative, summing to 1 up to rounding to whole percents
    (0.5% per share given, so Table 1's rounded 58/20/7/6/5/4/2 = 102% passes, as does Table 9's 99.98%).
    `domains`: the names a share may have; None when they are not knowable before reading (a source's domain_field)."""
    if not isinstance(shares, dict) or not shares:
        raise ValueError("expected a mapping of domain -> token share, e.g. {CommonCrawl: 0.6, C4: 0.4}")
    for domain, share in shares.items():
        if domains is not None and domain not in domains:
            raise ValueError(f"unknown domain {domain!r}; known domains: {', '.join(domains)}")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
            raise ValueError(f"{domain} = {share!r}: a share is a number >= 0 (e.g. 0.58 for 58%)")
    total = sum(shares.values())
    tolerance = 0.005 * len(shares)
    if abs(total - 1.0) > tolerance:
        raise ValueError(
            f"the shares sum to {total:.4g}; they must sum to 1 (within {tolerance:.3g} for "
            f"{len(shares)} shares rounded to whole percents)"
        )


def check_source_shares(sources) -> None:
    """`token_share` on every source or on none, summing to 1 within the same rounding as `domain_shares`."""
    missing = [s.name for s in sources if s.token_share is None]
    if missing:
        raise ValueError(
            f"data.sources: token_share is given on some sources but not on {', '.join(missing)}; give it on every "
            f"source (summing to 1) or use weight on all"
        )
    total = sum(s.token_share for s in sources)
    tolerance = 0.005 * len(sources)
    if abs(total - 1.0) > tolerance:
        raise ValueError(
            f"data.sources: the token shares sum to {total:.4g}; they must sum to 1 (within {tolerance:.3g} for "
            f"{len(sources)} shares)"
        )


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class SyntheticConfig(_Section):
    """A seeded generator of SlimPajama-like documents (7 domains, long-tailed lengths)."""

    num_docs: Int = Field(2000, ge=1, description="documents the generator yields (data.source: synthetic)")
    median_words: Int = Field(300, ge=1, description="median document length in words, before per-domain factors")
    max_words: Int = Field(200_000, ge=1, description="the longest document, in words (longer draws are cut to it)")
    long_doc_fraction: Float = Field(
        0.01, ge=0.0, le=1.0, description="share of documents drawn from the long tail (16x the median up to max_words)"
    )


DEFAULT_HUB = "cerebras/SlimPajama-627B"


class SourceConfig(_Section):
    """Each item of `data.sources`: one corpus (local files or a hub dataset), its text field, its domains and its
    weight."""

    name: Text = Field(description="the source's name: its domain unless domain_field is set, and its key in messages")
    path: Text | None = Field(
        None,
        description="local files: a .jsonl/.json/.parquet/.jsonl.zst/.json.zst file, a directory of them or a glob",
    )
    hub: Text | None = Field(None, description="a Hugging Face hub dataset, streamed (exactly one of path and hub)")
    subset: Text | None = Field(None, description="hub: the dataset's subset (its config name); null = its default")
    split: Text = Field("train", description="hub: the split; path: the subdirectory read if present")
    text_field: Text = Field(
        "text",
        description="the record field that holds the document's text (a string); a dotted key reads a nested field "
        "(e.g. doc.body)",
    )
    domain_field: Text | None = Field(
        None,
        description="a dotted record key whose value is the document's domain (e.g. meta.redpajama_set_name); "
        "null = the source's name; records without it take the source's name",
    )
    weight: Float = Field(
        1.0, gt=0, description="relative sampling weight: documents are drawn from the sources in these proportions"
    )
    token_share: Float | None = Field(
        None,
        gt=0,
        le=1,
        description="instead of weight: the fraction of the prepared tokens (anchors and tags included) that comes "
        "from this source (the paper's way of giving domain shares); given on every source or on none, summing to 1",
    )

    @model_validator(mode="after")
    def _one_location(self):
        if (self.path is None) == (self.hub is None):
            raise ValueError(f"source {self.name!r}: set exactly one of path and hub")
        if self.token_share is not None and "weight" in self.model_fields_set:
            raise ValueError(f"source {self.name!r}: set weight or token_share, not both")
        if self.subset is not None and self.hub is None:
            raise ValueError(f"source {self.name!r}: subset needs hub")
        return self


def source_domains(sources: list[SourceConfig]) -> tuple[str, ...] | None:
    """The domains of `data.sources` when knowable before reading (no source has a domain_field), else None."""
    if any(s.domain_field for s in sources):
        return None
    return tuple(s.name for s in sources)


class DataConfig(_Section):
    source: Literal["synthetic", "hub", "local"] = Field(
        "synthetic",
        description="where documents come from: the seeded synthetic generator, a Hugging Face hub dataset "
        "(data.hub_name, streamed) or local files (data.path)",
    )
    path: Text | None = Field(
        None,
        description="data.source local (and only then: refused with another source): a .jsonl/.json/.parquet/"
        ".jsonl.zst/.json.zst file, a directory of them (its data.hub_split subdirectory if there is one) or a glob; "
        "relative to where lctrain runs",
    )
    hub_name: Text = Field(
        DEFAULT_HUB, description="data.source hub (another name is refused with another source): the dataset's hub name"
    )
    hub_split: Text = Field(
        "train", description="the hub dataset's split; with data.source local, the subdirectory read if present"
    )
    sources: list[SourceConfig] | None = Field(
        None,
        description="several corpora drawn document by document by weight or token share (replaces data.source, "
        "data.path and data.hub_name); each {name, path | hub (+ subset, split), text_field, domain_field, weight | "
        "token_share}; null = data.source",
    )
    tokenizer: Text = Field(
        "builtin:mistral-7b-v0.1",
        description="a hub name, a local tokenizer or model directory, or a tokenizer bundled with lctrain "
        "(builtin:NAME); for a pretrained model, its own (prepare and train refuse one whose ids mean other tokens "
        "to the model)",
    )
    anchor: Text = Field(
        "auto",
        description="the token that starts every segment and every prompt: bos, eos, one token of the vocabulary "
        "(e.g. '<|endoftext|>'), or auto = the tokenizer's BOS if it puts it before every text (Llama, Mistral, "
        "Llama-3), else <|endoftext|> if the vocabulary has it (Qwen, SmolLM2), else EOS; a BOS the tokenizer does "
        "not add to plain text is a chat marker (SmolLM2's <|im_start|>), not what a base model saw between "
        "documents",
    )
    seq_len: Int = Field(1024, ge=8, description="tokens per packed window: the training context length")
    token_budget: Int = Field(2_000_000, ge=1, description="tokens to prepare (whole windows of data.seq_len)")
    mixture: Literal["slimpajama", "upsampled"] = Field(
        "slimpajama",
        description="slimpajama: documents in the source's own proportions; upsampled: each domain filled to its "
        "token share (data.domain_shares) with short documents down-sampled (Fu et al. 2024)",
    )
    domain_shares: dict[str, float] | None = Field(
        None,
        description=f"upsampled: the target token share of each domain ({', '.join(DOMAINS)}; with data.sources, "
        "their domains), each >= 0, summing to 1 (0.5% per share for rounding); null = the paper's "
        "UpSampledMix-128K (Table 9); needs data.mixture=upsampled",
    )
    short_doc_tokens: Int = Field(
        4096, ge=1, description="upsampled: documents shorter than this are kept with probability down_sample_ratio"
    )
    down_sample_ratio: Float = Field(
        0.1, ge=0.0, le=1.0, description="upsampled: the probability a document shorter than short_doc_tokens is kept"
    )
    domain_tags: Bool = Field(
        False, description="a domain tag after each segment's anchor (the paper's AnchorAttention + Tag)"
    )
    interleave_chunks: Bool = Field(
        False,
        description="split each window's documents into 2-3 chunks and interleave them, keeping each document's "
        "chunk order (the paper's Fig. 5)",
    )
    min_doc_tokens: Int = Field(1, ge=1, description="documents with fewer tokens are skipped (counted as too_short)")
    seed: Seed = Field(0, description="seeds the file order, the shuffle buffer, the mixture and the chunking")
    num_workers: Int = Field(
        0,
        ge=0,
        description="tokenizer processes, at most one per usable CPU core; 0 = all cores (one under a 2M-token "
        "budget, where starting processes costs more than they save)",
    )
    output_dir: Text | None = Field(
        None, description="where the prepared dataset goes; null = prepared/<data fingerprint> (shared by configs)"
    )
    strict: Bool = Field(
        False, description="stop at the first malformed input record, naming file and line, instead of counting it"
    )
    shuffle_buffer_tokens: Int = Field(
        16_777_216, ge=0, description="documents are shuffled through a seeded buffer of this many tokens"
    )
    shard_tokens: Int = Field(
        1 << 28,
        ge=1,
        description="tokens per Arrow shard of the prepared dataset (4 bytes each); an interrupted prepare resumes "
        "from its last complete shard",
    )
    synthetic: SyntheticConfig = Field(
        SyntheticConfig(), description="the synthetic generator (data.source: synthetic)"
    )

    @model_validator(mode="after")
    def _source_needs_path(self):
        if self.source == "local" and not self.path:
            raise ValueError("data.path is required when data.source is 'local'")
        if self.sources is None:
            # a path or dataset given beside another source would be ignored: training on other data than the user's
            if self.path is not None and self.source != "local":
                raise ValueError(
                    f"data.path is read only when data.source is 'local', and it is '{self.source}': set "
                    "data.source=local to use the files, or data.path=null"
                )
            if self.hub_name != DEFAULT_HUB and self.source != "hub":
                raise ValueError(
                    f"data.hub_name is read only when data.source is 'hub', and it is '{self.source}': set "
                    "data.source=hub to stream that dataset, or leave data.hub_name out"
                )
        return self

    @field_validator("domain_shares", mode="before")
    @classmethod
    def _shares_are_a_distribution(cls, shares: Any, info: ValidationInfo) -> Any:
        if shares is not None:
            # lctrain.data imports this module: imported here, once both are loaded
            from lctrain.data.mixture import shares_by_domain

            sources = info.data.get("sources")
            read = shares_by_domain(shares, {s.name for s in sources or ()}) if isinstance(shares, dict) else shares
            check_domain_shares(read, DOMAINS if sources is None else source_domains(sources))
        return shares

    @model_validator(mode="after")
    def _sources_replace_the_single_source(self):
        if self.sources is None:
            return self
        if not self.sources:
            raise ValueError("data.sources is empty; list at least one source or set data.sources=null")
        if self.path is not None or self.source != "synthetic" or self.hub_name != DEFAULT_HUB:
            raise ValueError(
                "data.sources replaces data.source, data.path and data.hub_name; set data.path=null and "
                "data.source=synthetic, or data.sources=null"
            )
        names = [s.name for s in self.sources]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"data.sources: duplicate source name(s) {', '.join(duplicates)}; names must be unique")
        if self.mixture == "upsampled" and self.domain_shares is None:
            raise ValueError("data.mixture=upsampled with data.sources needs data.domain_shares keyed by their domains")
        shared = [s.name for s in self.sources if s.token_share is not None]
        if shared:
            check_source_shares(self.sources)
            if self.mixture == "upsampled":
                raise ValueError(
                    "data.sources' token_share and data.mixture=upsampled both set token shares; use one of them"
                )
        return self

    @model_validator(mode="after")
    def _shares_need_the_upsampled_mixture(self):
        if self.domain_shares is not None and self.mixture != "upsampled":
            raise ValueError(
                "data.domain_shares sets the targets of mixture 'upsampled'; the 'slimpajama' mixture keeps "
                "the source's own shares (set data.mixture=upsampled)"
            )
        # compared with the defaults, not model_fields_set: a resolved config.yaml spells every value out
        changed = [
            k
            for k in ("short_doc_tokens", "down_sample_ratio")
            if getattr(self, k) != type(self).model_fields[k].default
        ]
        if changed and self.mixture != "upsampled":
            # ignored, they would still change the data fingerprint: the same data rebuilt under another name
            raise ValueError(
                f"{' and '.join(f'data.{k}' for k in changed)} down-sample the short documents of mixture "
                f"'upsampled' and are not read by the '{self.mixture}' mixture: set data.mixture=upsampled, or "
                f"leave {'them' if len(changed) > 1 else 'it'} out"
            )
        return self


class ModelConfig(_Section):
    name_or_path: Text | None = Field(
        None,
        description="a pretrained model: hub name or local directory (exactly one of this and model.arch; to use "
        "it on a config that sets model.arch, also set model.arch=null)",
    )
    arch: dict[str, Any] | None = Field(
        None,
        description="a randomly initialised model: a Hugging Face config as a mapping with its model_type (e.g. "
        "{model_type: llama, hidden_size: 64, ...}); exactly one of this and model.name_or_path; its vocab_size, "
        "at least the tokenizer's, defaults to the tokenizer's",
    )
    rope_theta: Float | None = Field(
        None,
        gt=0,
        description="RoPE base; null keeps a pretrained model's own (model.arch: the paper's Table 1 base for "
        "data.seq_len, unless the arch sets one)",
    )
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="RoPE scaling (rope_type: linear, dynamic, yarn, llama3, ... or lctrain's static ntk, with its "
        "parameters; factor >= 1; yarn, llama3 and longrope extend from original_max_position_embeddings, by default "
        "the model's own context length); null keeps the model's own",
    )
    max_position_embeddings: Int | None = Field(
        None,
        ge=1,
        description="the model's context length; null keeps the model's own, raised to data.seq_len if smaller "
        "(a model.arch that names none: data.seq_len)",
    )
    dtype: Literal["bfloat16", "float32", "float16"] = Field(
        "bfloat16", description="the weights' and the computation's dtype (bf16/fp16 keep fp32 master weights)"
    )
    gradient_checkpointing: Bool = Field(
        False, description="the older switch: true is model.checkpointing=full (used when checkpointing is null)"
    )
    checkpointing: Literal["full", "selective", "selective_matmul", "none"] | None = Field(
        None,
        description="activation checkpointing per decoder layer: full recomputes the layer's forward in the backward; "
        "selective keeps the attention kernel's outputs (and log-sum-exp) so the backward does not rerun attention "
        "(not the flex engine's, whose compiled kernel it cannot see: there selective is full); "
        "selective_matmul also keeps every matmul's output (not with model.fused_kernels, which write into them); "
        "none keeps everything; null follows gradient_checkpointing",
    )
    rope_fp32: Bool = Field(False, description="rotate q/k in fp32 before the bf16 attention")
    tiled_mlp: Literal["auto"] | Annotated[int, Field(ge=0)] = Field(
        0,
        description="run each decoder MLP in this many sequence shards with DeepSpeed's TiledMLP (0 = off; "
        "'auto' = ceil(tokens per rank / hidden_size), the largest over the ranks)",
    )
    offload_activations: Bool = Field(
        False,
        description="keep the checkpointed hidden states in host memory between forward and backward "
        "(DeepSpeed's checkpoint offload; needs gradient_checkpointing)",
    )
    fused_kernels: Literal["none", "liger", "compile"] = Field(
        "none",
        description="fused kernels for the memory-bound work of each decoder layer, on this model instance only: "
        "none (transformers' own), liger (Liger-Kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy; "
        "Llama models on CUDA with triton), compile (torch.compile of each layer's norms and MLP and the final "
        "norm; attention stays eager)",
    )

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _tiled_mlp_is_a_count(cls, value: Any) -> Any:
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError("expected 0 (off), a number of shards >= 1, or auto")
        return value

    @model_validator(mode="after")
    def _one_source(self):
        if self.name_or_path is None and self.arch is None:
            raise ValueError("set one of model.name_or_path (hub name or directory) and model.arch")
        if self.name_or_path is not None and self.arch is not None:
            raise ValueError(
                "both model.name_or_path (a pretrained model) and model.arch (a random init) are set; to train "
                "the model at model.name_or_path, set model.arch=null (e.g. --set model.arch=null)"
            )
        return self

    @property
    def checkpointing_mode(self) -> str:
        """The checkpointing the model trains with: `checkpointing` when set, else `gradient_checkpointing`'s."""
        if self.checkpointing is not None:
            return self.checkpointing
        return "full" if self.gradient_checkpointing else "none"

    @model_validator(mode="after")
    def _one_checkpointing(self):
        if self.gradient_checkpointing and self.checkpointing == "none":
            raise ValueError(
                "gradient_checkpointing=true contradicts checkpointing=none; set only model.checkpointing "
                "(full, selective, selective_matmul or none)"
            )
        return self

    @model_validator(mode="after")
    def _fused_kernels_combine(self):
        if self.fused_kernels == "liger" and self.rope_fp32:
            raise ValueError(
                "model.fused_kernels=liger rotates q/k in Liger's kernel, in their own dtype, so it cannot keep "
                "model.rope_fp32's fp32 rotation; set one of them"
            )
        if self.fused_kernels != "none" and self.checkpointing_mode == "selective_matmul":
            # torch checks a kept tensor's version counter: the compiled MLP's in-place write trips it (a backward
            # error); Liger's Triton RoPE writes into the q/k projections' outputs without bumping it (a silent one)
            raise ValueError(
                f"model.fused_kernels={self.fused_kernels} writes in place into matmul outputs that "
                f"model.checkpointing=selective_matmul keeps for the backward; set model.checkpointing=selective "
                f"(it keeps the attention's outputs) or model.fused_kernels=none"
            )
        if self.fused_kernels != "none" and self.tiled_mlp:
            raise ValueError(
                f"model.fused_kernels={self.fused_kernels} replaces the MLP that model.tiled_mlp shards; set "
                f"model.tiled_mlp=0 or model.fused_kernels=none"
            )
        return self

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self):
        if self.offload_activations and self.checkpointing_mode == "none":
            raise ValueError(
                "model.offload_activations moves the hidden states that gradient checkpointing keeps, so it "
                "needs model.gradient_checkpointing=true (or model.checkpointing full or selective)"
            )
        return self


class AttentionConfig(_Section):
    mode: Literal["full", "intra_doc", "intra_doc_reset", "anchor"] = Field(
        "anchor",
        description="what a token sees: full = every earlier token of the window; intra_doc = its own document's; "
        "intra_doc_reset = its own document's, positions restarting at 0; anchor = its own document's and the "
        "anchor, every anchor at position 0",
    )
    engine: Literal["auto", "sdpa", "flex", "varlen", "reference"] = Field(
        "auto",
        description="the attention kernel: auto (CPU: sdpa; GPU: sdpa for full, varlen for document modes in "
        "bf16/fp16, flex in fp32), sdpa, flex (GPU), varlen (GPU), reference (dense mask, tests)",
    )


class TrainConfig(_Section):
    steps: Steps = Field(
        2000,
        ge=1,
        description="optimizer updates; at most 10^9, which no run takes (32 years at a second a step), so that step "
        "counts stay exact in the schedule's float64 and the step counters' int64",
    )
    global_batch: Windows = Field(
        8,
        ge=1,
        description="windows per optimizer update, over all data-parallel ranks; at most 2^20 (hundreds of times the "
        "largest published batches), so that the windows a run reads stay exact in float64 and int64",
    )
    micro_batch: Windows = Field(1, ge=1, description="windows per forward pass on one rank (the rest is accumulation)")
    lr: Float = Field(2e-5, gt=0, description="peak learning rate (AdamW)")
    weight_decay: Float = Field(0.1, ge=0, description="AdamW's decoupled weight decay")
    decay_norms_and_biases: Bool = Field(
        False, description="also decay norm weights and biases (the paper's released code decays every parameter)"
    )
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW's (beta1, beta2), each in [0, 1)")
    eps: Float = Field(1e-8, gt=0, description="AdamW's epsilon")
    warmup_steps: Steps = Field(0, ge=0, description="linear warmup from lr/warmup_steps to lr over this many steps")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant",
        description="the learning rate after warmup: constant, or decaying towards 0, which it reaches after the "
        "last update (the last step's rate is one step's decay above it)",
    )
    grad_clip: Float = Field(1.0, ge=0, description="clip the gradients' global norm to this; 0 = no clipping")
    torch_adam: Bool = Field(
        False,
        description="torch's AdamW also where DeepSpeed's CPU Adam would run (an offloaded optimizer on a GPU): "
        "no C++ op to build, a slower host step, and host memory for its out-of-place temporaries",
    )
    fused_optimizer: Bool = Field(
        False,
        description="torch's AdamW with fused=True (one kernel for the whole update; on CPU and CUDA); not with "
        "DeepSpeed's CPU Adam, already one fused C++ step",
    )
    loss_gradients: Literal["forward", "recompute"] = Field(
        "forward",
        description="where the chunked loss computes its gradients: forward (each chunk's, right after its logits, "
        "scaled in the backward by the incoming gradient, as Liger's fused loss: the LM head runs once; the hidden "
        "states' gradient and an fp32 lm_head gradient are held until the backward) or recompute (each chunk's "
        "logits again in the backward: the LM head's forward runs twice); with model.fused_kernels=liger, Liger's "
        "fused loss replaces both",
    )
    deterministic: Bool = Field(
        False,
        description="steps that repeat bit for bit on a GPU: PyTorch's deterministic kernels (an op with none is an "
        "error naming it), cuBLAS's fixed workspace, flash-attn's deterministic backward; a slower attention "
        "backward. CPU steps repeat bit for bit either way (lctrain/train/determinism.py)",
    )
    step_timeout_minutes: Float | None = Field(
        10,
        gt=0,
        description="a step not finished after this many minutes (or 5x the slowest step so far, if longer) ends "
        "the run as hung, naming the rank that hung and showing every rank's stack; not the first step of a "
        "session, nor checkpoint writes (lctrain/parallel/watchdog.py); null = wait for "
        "the process group's own timeout (30 minutes), whose error names a waiting rank",
    )
    heldout_every: Steps = Field(
        0,
        ge=0,
        description="the held-out loss every this many steps and at the last (heldout_loss and heldout_ppl in "
        "metrics.jsonl, the step line and the loggers): the eval.ppl_windows windows training never reads, scored "
        "as `lctrain eval` scores perplexity (full causal attention whatever attention.mode, anchor targets left "
        "out), so comparable between modes; a forward pass per window, shared by the data-parallel replicas; 0 = never",
    )
    run_dir: Text | None = Field(None, description="the run directory; null = runs/<name>")


class ParallelConfig(_Section):
    nproc_per_node: Int = Field(1, ge=1, description="processes (GPUs) per node")
    num_nodes: Int = Field(1, ge=1, description="nodes; lctrain launches several through DeepSpeed's parallel.hostfile")
    hostfile: Text | None = Field(
        None, description="DeepSpeed's hostfile for several nodes (lines like 'node1 slots=8')"
    )
    sequence_parallel: Int = Field(
        1, ge=1, description="Ulysses sequence-parallel degree: ranks sharing one window (divides the world size)"
    )
    zero_stage: Int = Field(
        2, ge=0, le=3, description="DeepSpeed ZeRO stage: 0 off, 1 optimizer states, 2 + gradients, 3 + weights"
    )
    offload_optimizer: Bool = Field(
        False, description="keep the optimizer states and master weights in host memory (needs zero_stage >= 1)"
    )
    offload_params: Bool = Field(False, description="keep the ZeRO-3 weight shards in host memory (needs zero_stage 3)")
    overlap_comm: Bool | None = Field(
        None,
        description="run ZeRO's gradient reduction and weight gathering on their own CUDA streams, beside the compute; "
        "null = DeepSpeed's default for the stage: on for ZeRO-3, off for ZeRO-1 and 2 (where it keeps two reduce "
        "buckets)",
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the dtype a bf16 run's gradients are reduced in across ranks: float32, as torchtitan's default "
        "and DeepSpeed's own under sequence parallelism, makes the result independent of the number of ranks "
        "(in float32, 2 ranks of SmolLM2-135M equal the 1-process run's losses and gradient norms to the printed "
        "digits; in bfloat16 their third loss differs by 1e-3); bfloat16 halves the bytes of the reduction and of its "
        "bucket",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend: auto = nccl with CUDA, else gloo; nccl needs CUDA"
    )
    launcher: Literal["deepspeed", "torchrun"] = Field(
        "deepspeed", description="what starts the processes when a run needs several"
    )

    @model_validator(mode="after")
    def _offload_needs_zero(self):
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(
                f"parallel.offload_params offloads ZeRO-3's weight shards, so it needs parallel.zero_stage=3 "
                f"(it is {self.zero_stage})"
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError(
                "parallel.offload_optimizer offloads the ZeRO optimizer's partition, so it needs "
                "parallel.zero_stage >= 1 (it is 0)"
            )
        if self.overlap_comm and self.zero_stage == 0:
            raise ValueError(
                "parallel.overlap_comm overlaps ZeRO's communication with compute, so it needs parallel.zero_stage "
                ">= 1 (it is 0)"
            )
        return self

    @property
    def world(self) -> int:
        """The processes the run asks for (parallel.nproc_per_node x parallel.num_nodes)."""
        return self.nproc_per_node * self.num_nodes

    @model_validator(mode="after")
    def _backend_has_its_devices(self, info: ValidationInfo):
        cuda = (info.context or {}).get(CUDA_AVAILABLE)
        if self.backend == "nccl" and cuda is False:
            raise ValueError(
                "parallel.backend = nccl needs CUDA, which this machine does not have; set parallel.backend=auto "
                "(gloo on CPU) or run on GPUs"
            )
        return self


class CheckpointConfig(_Section):
    every_steps: Steps = Field(100, ge=1, description="a resume checkpoint every this many steps")
    keep: Int = Field(2, ge=1, description="resume checkpoints kept (the newest)")
    hf_every: Steps = Field(
        10, ge=1, description="an evaluation checkpoint (hf/step_N) every this many steps, counted back from the last"
    )
    hf_last: Steps = Field(
        50, ge=0, description="the steps, counted back from the last, that hold evaluation checkpoints; 0 = none"
    )
    save_final: Bool = Field(True, description="a resume checkpoint after the last step (off for throughput runs)")
    check_disk: Bool = Field(
        True,
        description="refuse to start (or resume) a run whose resume checkpoints and evaluation exports would, at "
        "their peak, take more than the free space of the run directory's filesystem (`lctrain plan` shows the "
        "peak): the paper's schedule writes its exports in the last 50 steps. false: start all the same (space to be "
        "freed during the run)",
    )
    sync_files: Bool = Field(
        True,
        description="every rank waits until the files it wrote are on the disk (fsync) before a resume checkpoint "
        "counts as complete, as torch.distributed.checkpoint does by default: after a machine crash (not a killed "
        "process) `latest` names no checkpoint whose data was still in memory; the same for a resume's universal "
        "conversion. false: the write-back is left to the kernel (a filesystem whose fsync is slow)",
    )
    on_sigterm: Bool = Field(
        True,
        description="on SIGTERM (a scheduler's time limit or preemption), finish the step under way, write a resume "
        "checkpoint of it and stop (exit code 143), so that a resume loses nothing; false: stop at once, as Ctrl-C "
        "does. A launcher you start gives its ranks its own grace (torchrun's and DeepSpeed's: 30 s after they are "
        "signalled): docs/cluster.md",
    )


class ProfileConfig(_Section):
    start: Steps | None = Field(
        None,
        ge=1,
        description="the first training step profiled (numbered as metrics.jsonl's step); null: no profile. The "
        "trace goes to the run directory's profile/ (lctrain/profiling.py)",
    )
    steps: Steps = Field(2, ge=1, description="how many steps are profiled from `start`")
    ranks: Literal["all"] | list[Annotated[Int, Field(ge=0)]] = Field(
        [0], min_length=1, description="the ranks that write a trace: a list of global ranks, or all"
    )

    @field_validator("ranks", mode="before")
    @classmethod
    def _all_or_ranks(cls, ranks: Any) -> Any:
        # one message for both forms: the union's own errors named a branch ("ranks.literal['all']")
        if ranks == "all" or (
            isinstance(ranks, list) and ranks and all(type(r) is int and r >= 0 for r in ranks)  # noqa: E721
        ):
            return ranks
        raise ValueError("expected all, or a list of global ranks (integers >= 0)")

    memory: Bool = Field(
        False,
        description="also record every tensor allocation in the trace, and on CUDA write the allocator's snapshot "
        "(rank<r>.memory.pickle, for pytorch.org/memory_viz): larger files, slower profiled steps",
    )


class LoggingConfig(_Section):
    wandb: Literal["disabled", "offline", "online"] = Field("disabled", description="Weights & Biases logging")
    wandb_project: Text = Field("lctrain", description="the Weights & Biases project")
    tensorboard: Bool = Field(
        False,
        description="also write the step metrics as TensorBoard event files in the run directory's tensorboard/ "
        "(needs the tensorboard package: pip install 'lctrain[tensorboard]')",
    )
    log_every: Steps = Field(
        1,
        ge=1,
        description="print the step line (and log to W&B and TensorBoard) every this many steps, and the last "
        "step; metrics.jsonl keeps every step",
    )
    peak_tflops: Float | None = Field(
        None, gt=0, description="per-device peak for MFU; null: known GPU or measured CPU"
    )
    profile: ProfileConfig = Field(
        ProfileConfig(), description="a PyTorch profiler trace of chosen steps (where a step's time goes)"
    )


class EvalConfig(_Section):
    lengths: list[Length] = Field(
        [4096, 8192, 16384, 32768, 65536, 131072], min_length=1, description="context lengths evaluated, in tokens"
    )
    tasks: list[Text] | None = Field(None, min_length=1, description="RULER tasks to score; null = all 13")
    exclude: list[Text] = Field([], description="tasks left out (the paper's Llama-2: niah_multikey_3, cwe)")
    samples_per_task: Int = Field(25, ge=1, description="samples per task and length")
    ruler_data: Text | None = Field(None, description="RULER's prepared data (<length>/data/<task>/validation.jsonl)")
    anchor_prompts: bool = Field(
        False,
        description="with RULER's data: every prompt starts with the training anchor, also where the tokenizer puts no "
        "BOS before a text (Qwen, SmolLM2): the model as trained, unlike RULER's own encoding (eval --anchor-prompts)",
    )
    squad_path: Text | None = Field(None, description="SQuAD JSON for the offline suite's qa_1")
    hotpotqa_path: Text | None = Field(None, description="HotpotQA JSON for the offline suite's qa_2")
    seed: Seed = Field(0, description="seeds the offline suite's samples")
    ppl_windows: Int = Field(8, ge=0, description="held-out windows scored for perplexity; 0 = skip")

    @model_validator(mode="before")
    @classmethod
    def _qa_path_was_split(cls, data: Any) -> Any:
        # run directories written before RULER's two QA tasks were split carry `qa_path: null`
        if isinstance(data, dict) and "qa_path" in data:
            data = dict(data)
            if data.pop("qa_path") is not None:
                raise ValueError("qa_path is now eval.squad_path (task qa_1) and eval.hotpotqa_path (task qa_2)")
        return data

    @model_validator(mode="after")
    def _lengths_once(self):
        twice = sorted({n for n in self.lengths if self.lengths.count(n) > 1})
        if twice:
            raise ValueError(f"eval.lengths names {', '.join(map(str, twice))} more than once; name each length once")
        return self

    @model_validator(mode="after")
    def _known_tasks(self):
        for key, names in (("tasks", self.tasks or []), ("exclude", self.exclude)):
            unknown = [t for t in names if t not in TASK_NAMES]
            if unknown:
                raise ValueError(
                    f"eval.{key}: unknown task(s) {', '.join(unknown)}; RULER's tasks: {', '.join(TASK_NAMES)}"
                )
        return self


class Config(_Section):
    name: Text = Field("run", description="the run's name: its directory under runs/ and its wandb name")
    description: str = Field("", description="one line saying what the config is for (`lctrain configs`)")
    seed: Seed = Field(0, description="seeds model initialisation, the training data order and python/numpy/torch")
    data: DataConfig = Field(DataConfig(), description="the corpus, its tokenization and packing (`lctrain prepare`)")
    model: ModelConfig = Field(
        ModelConfig(arch={"model_type": "llama"}), description="the model and the changes training makes to it"
    )
    attention: AttentionConfig = Field(AttentionConfig(), description="the attention mask and its kernel")
    train: TrainConfig = Field(TrainConfig(), description="the optimizer, its schedule and the batch")
    parallel: ParallelConfig = Field(ParallelConfig(), description="processes, sequence parallelism and ZeRO")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="resume and evaluation checkpoints")
    logging: LoggingConfig = Field(LoggingConfig(), description="metrics and their loggers")
    eval: EvalConfig = Field(EvalConfig(), description="`lctrain eval`: RULER-style tasks and perplexity")
    source_file: str | None = Field(None, description="where this config was loaded from (set by the loader)")
    workdir: str | None = Field(
        None,
        description="the directory relative paths in this config resolve against; null = the current one. A run "
        "directory's config.yaml records where `lctrain train` ran, so the run resumes from anywhere",
    )

    @model_validator(mode="after")
    def _fused_kernels_fit_the_run(self, info: ValidationInfo):
        if self.model.fused_kernels == "liger" and self.parallel.zero_stage == 3:
            # Liger's fused loss reads lm_head.weight outside lm_head's forward, where ZeRO-3 has not gathered it
            raise ValueError(
                "model.fused_kernels=liger reads lm_head's weight outside its forward, which ZeRO-3 partitions; "
                "use parallel.zero_stage <= 2 or model.fused_kernels=compile"
            )
        cuda = (info.context or {}).get(CUDA_AVAILABLE)
        if self.model.fused_kernels == "liger" and cuda is False:
            raise ValueError(
                "model.fused_kernels=liger runs Triton kernels, which need CUDA, and this machine has none; set "
                "model.fused_kernels=compile or none"
            )
        if self.model.dtype == "float16" and cuda is False:
            raise ValueError(
                "model.dtype = float16 trains through DeepSpeed's fp16 optimizer (loss scaling), which needs CUDA, and "
                "this machine has none; set model.dtype=bfloat16 (with parallel.zero_stage >= 1) or float32"
            )
        if self.train.fused_optimizer and cuda and self.parallel.offload_optimizer and not self.train.torch_adam:
            raise ValueError(
                "train.fused_optimizer is torch's fused AdamW, but an offloaded optimizer on a GPU runs DeepSpeed's "
                "CPU Adam (already one fused C++ step); set train.torch_adam=true or train.fused_optimizer=false"
            )
        return self

    @model_validator(mode="after")
    def _context_holds_the_window(self):
        own = self.model.max_position_embeddings
        if own is not None and own < self.data.seq_len:
            raise ValueError(
                f"model.max_position_embeddings = {own:,} is below data.seq_len = {self.data.seq_len:,}: the model "
                f"would train on positions past its stated context; set it to at least data.seq_len, or null (the "
                f"model's own, raised to data.seq_len)"
            )
        return self

    @model_validator(mode="after")
    def _profile_within_the_run(self):
        start = self.logging.profile.start
        if start is not None and start > self.train.steps:
            raise ValueError(
                f"logging.profile.start {start} is after the run's last step (train.steps {self.train.steps}); "
                f"set it to a step of the run, or null"
            )
        ranks = self.logging.profile.ranks
        world = self.parallel.world
        if ranks != "all" and max(ranks) >= world:
            raise ValueError(
                f"logging.profile.ranks {ranks}: the run has ranks 0-{world - 1} "
                f"(parallel.nproc_per_node x parallel.num_nodes)"
            )
        return self

    @field_validator("name")
    @classmethod
    def _name_is_a_directory_name(cls, name: str) -> str:
        if "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError("the name is one directory name under runs/ (no '/', not '.' or '..')")
        return name

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on: `train.global_batch` windows of `data.seq_len` tokens."""
        return self.train.global_batch * self.data.seq_len

    def windows_read(self, steps: int | None = None) -> int:
        """Window reads of the first `steps` optimizer steps (default `train.steps`): `train.global_batch` each."""
        return (self.train.steps if steps is None else steps) * self.train.global_batch

    def tokens_read(self, steps: int | None = None) -> int:
        """Tokens the first `steps` optimizer steps (default `train.steps`) train on."""
        return self.windows_read(steps) * self.data.seq_len

    # the `--set` items it was loaded with (load_config): `origin` names them in messages
    _overrides: tuple[str, ...] = PrivateAttr(default=())

    @property
    def overrides(self) -> tuple[str, ...]:
        """The `--set` items it was loaded with, as given."""
        return self._overrides

    def origin(self, *keys: str) -> str:
        """Where the values of `keys` (dotted) come from, for a message about them: the `--set` items that gave one
        (or a key inside one), else the config file. A value mistyped on the command line is not the file's."""
        given = [item for item in self._overrides if _overridden(item, keys)]
        return ", ".join(f"--set {item}" for item in given) if given else (self.source_file or "config")

    def overridden(self, key: str) -> bool:
        """Whether a `--set` item it was loaded with gave `key` (dotted), or a section holding it."""
        return any(_overridden(item, (key,)) for item in self._overrides)

    def resolve_path(self, value: str | Path) -> Path:
        """A path setting of this config (data.path, data.output_dir, parallel.hostfile, ...), relative to `workdir`."""
        path = Path(value)
        return path if path.is_absolute() or self.workdir is None else Path(self.workdir) / path

    def resolve_source(self, spec: str) -> str:
        """A tokenizer or model setting: the local file or directory it names when there is one (relative to
        `workdir`), else the setting itself (a hub name, a `builtin:` tokenizer)."""
        local = self.resolve_path(spec)
        return str(local) if self.workdir is not None and local.exists() else spec


# Fields about a config rather than settings of the run: in no fingerprint, no comparison, no printed config.
NOT_SETTINGS = frozenset({"source_file", "workdir"})

# ---------------------------------------------------------------- loading


def bundled_config_dir() -> Path:
    return Path(str(resources.files("lctrain") / "configs"))


def bundled_config_names() -> list[str]:
    return sorted(p.stem for p in bundled_config_dir().glob("*.yaml") if not p.stem.startswith("_"))


def _locate(name_or_path: str, relative_to: Path | None = None) -> Path:
    # a `base:` is relative to the file that names it, never to where lctrain runs: a config means the same anywhere
    candidates = [Path(name_or_path) if relative_to is None else relative_to / name_or_path]
    stem = name_or_path[:-5] if name_or_path.endswith(".yaml") else name_or_path
    candidates.append(bundled_config_dir() / f"{stem}.yaml")
    for c in candidates:
        if c.is_file():
            return c
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is not None:  # a run directory, most likely: the config it trains with is inside
        inside = folder / "config.yaml"
        hint = f"its config is {inside}" if inside.is_file() else "give a YAML file"
        raise UserError(f"config '{name_or_path}' is a directory; {hint}")
    near = _near(stem.lower(), bundled_config_names())
    where = "a file" if relative_to is None else f"a file beside the config whose base it is ({relative_to})"
    raise UserError(
        f"config '{name_or_path}' not found (neither {where} nor a bundled config); "
        f"{near}run 'lctrain configs' to list the bundled ones"
    )


def _near(word: str, choices: list[str]) -> str:
    """ "did you mean 'x'? " for the choice closest to a mistyped `word`, "" when none is close."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.75)
    return f"did you mean '{close[0]}'? " if close else ""


class _StrictLoader(yaml.SafeLoader):
    """lctrain's one YAML reader, of config files and `--set` values alike (`load_yaml`): YAML 1.2's core-schema
    scalars, and a key given twice in one mapping refused (plain YAML keeps the last one silently).

    PyYAML reads YAML 1.1, whose implicit types silently change what a script wrote: `010` is 8 (octal), `1:00` is 60
    (base 60), `2024-01-01` a date, `yes`/`no`/`on`/`off` booleans, `1_000` 1000, while `1e5` stays a string. Here,
    as in YAML 1.2's core schema: an int is decimal (`010` is 10), `0o` octal or `0x` hex; a float `1.5`, `1e5`,
    `.inf`, `.nan`; a boolean only true/false (True, TRUE, ...); null `null`/`~`/empty; anything else is a string.
    An explicit tag (`!!str 010`) works as in PyYAML; `<<` is a plain key (YAML 1.2 has no merge keys)."""

    yaml_implicit_resolvers: dict = {}  # its own, filled below: SafeLoader's are YAML 1.1's

    def construct_mapping(self, node, deep=False):
        keys = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # `[a]: 1`: refused below, as a key that cannot be one
                continue
            if key in keys:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark
                )
            keys.add(key)
        return super().construct_mapping(node, deep=deep)

    def _scalar(self, node, convert):
        text = self.construct_scalar(node)
        try:
            return convert(text)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"{text!r} is not a {node.tag.rsplit(':', 1)[-1]}", node.start_mark
            ) from None


def _int12(text: str) -> int:
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.removeprefix("+"))
    base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


def _bool12(text: str) -> bool:
    if text.lower() not in ("true", "false"):  # `!!bool yes`
        raise ValueError(text)
    return text.lower() == "true"


def _float12(text: str) -> float:
    special = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
    return special[text.lower()] if text.lower() in special else float(text)


_StrictLoader.add_constructor("tag:yaml.org,2002:bool", lambda loader, node: loader._scalar(node, _bool12))
_StrictLoader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: loader._scalar(node, _int12))
_StrictLoader.add_constructor("tag:yaml.org,2002:float", lambda loader, node: loader._scalar(node, _float12))
# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution); an int before a float, which `10` matches too
_CORE_SCALARS = (
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    (
        "float",
        r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        "-+.0123456789",
    ),
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
)


class _Dumper(yaml.SafeDumper):
    """YAML that both lctrain (`load_yaml`, YAML 1.2) and a YAML 1.1 reader (PyYAML's safe_load) read back as the
    value written: a string either would read as another type is quoted (`'08'`, `'1e5'`, `'yes'`), where
    `yaml.safe_dump` leaves `08` and `1e5` plain, which YAML 1.2 reads as numbers."""


for _tag, _pattern, _first in _CORE_SCALARS:
    for _cls in (_StrictLoader, _Dumper):  # the loader's only resolvers; the dumper's beside YAML 1.1's
        _cls.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_pattern})$"), list(_first))


def load_yaml(text: str) -> Any:
    """`text` read as lctrain reads every config file and `--set` value (`_StrictLoader`: YAML 1.2 core scalars)."""
    return yaml.load(text, Loader=_StrictLoader)


def dump_yaml(data: Any, **options: Any) -> str:
    """`data` as YAML that `load_yaml` (and `yaml.safe_load`) reads back as `data`: `yaml.safe_dump`'s `options`."""
    return yaml.dump(data, Dumper=_Dumper, **options)


def _read_yaml(path: Path) -> dict:
    try:
        raw = load_yaml(path.read_text(encoding="utf-8-sig"))  # a UTF-8 BOM is fine
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; a config is a YAML file (save it as UTF-8)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if raw is None:  # not the defaults: those are a 7B run at 1K, which nobody means by an empty file
        raise UserError(
            f"{path}: the config is empty; give at least 'base: tiny_anchor' (or another bundled config "
            f"from 'lctrain configs') and the values to change"
        )
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a config must be a mapping of sections, got {type(raw).__name__}")
    return raw


# Mappings a config replaces as a whole: a user's `domain_shares` merged into the paper's would no longer sum to 1.
REPLACED_WHOLE = ("arch", "rope_scaling", "domain_shares")


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in REPLACED_WHOLE:
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _load_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path.resolve() in seen:
        raise UserError(f"{path}: 'base:' chain loops back to itself")
    raw = _read_yaml(path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    base_path = _locate(str(base), relative_to=path.parent)
    return _deep_merge(_load_raw(base_path, seen + (path.resolve(),)), raw)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item or not item.split("=", 1)[0].strip():
        raise UserError(f"--set '{item}': expected KEY=VALUE, e.g. --set data.seq_len=4096")
    key, value = item.split("=", 1)
    if not value.strip():
        # `--set model.name_or_path=$MODEL` with MODEL unset would clear the key: for a key that may be null, a
        # silently different run (the default config's random model)
        field = _field_of(key.strip())
        if field is None:
            advice = f"give {key.strip()}=VALUE"
        elif type(None) in get_args(field.annotation):
            advice = f"to clear the key write {key.strip()}=null"
        else:
            advice = f"{key.strip()} takes a value (its default: {field.get_default(call_default_factory=True)!r})"
        raise UserError(f"--set '{item}': no value after '=' (an unset shell variable?); {advice}")
    key, text = key.strip(), value.strip()
    try:
        parsed = load_yaml(value)  # as a config file reads it: YAML 1.2 core scalars (`010` is 10, `1:00` text)
    except yaml.constructor.ConstructorError as e:
        if "appears twice" in str(e.problem):
            raise UserError(f"--set '{item}': {e.problem}") from None
        return key.split("."), value
    except yaml.YAMLError:  # not YAML (`[a`, `@home`): the text itself
        return key.split("."), value
    comment = _yaml_comment(value)
    if comment is not None:
        # YAML would drop it silently (`description=x #y` -> 'x'); refused rather than kept as text, as the value is
        # YAML (a list, a mapping, a quoted string) and reads here as the same line of a config file would
        mark = "a leading '#'" if comment == 0 else "' #'"
        quoted = shlex.quote(f"{key}={json.dumps(text, ensure_ascii=False)}")
        raise UserError(
            f"--set '{item}': {mark} starts a YAML comment, which would drop {value[comment:].strip()!r}; quote the "
            f"value to keep it (--set {quoted}) or leave the comment out"
        )
    wrong = _text_given_another_type(key.split("."), parsed)
    if wrong is not None:
        where, got = wrong
        if where == key:
            read, fix = text, f": --set {shlex.quote(f'{key}={json.dumps(text, ensure_ascii=False)}')}"
        else:
            read, fix = "its value", ""
        # named as a value outside its key's domain is (`validate`): `--set KEY=VALUE: ...`
        raise UserError(f"--set {item}: {where} takes text, and YAML reads {read} as {_read_as(got)}; quote it{fix}")
    return key.split("."), parsed


def _yaml_comment(text: str) -> int | None:
    """Where a YAML comment starts in `text` (a `#` at its start or after a space, outside any token), or None."""
    if "#" not in text:
        return None
    try:
        spans = [(t.start_mark.index, t.end_mark.index) for t in yaml.scan(text, Loader=_StrictLoader)]
    except yaml.YAMLError:
        return None
    return next(
        (
            i
            for i, c in enumerate(text)
            if c == "#" and (i == 0 or text[i - 1].isspace()) and not any(a <= i < b for a, b in spans)
        ),
        None,
    )


def _is_section(keys: list[str]) -> bool:
    """Whether the dotted `keys` name a section of the schema (`train`, `data.synthetic`), which a mapping merges
    into; not a value, a free-form mapping (`model.arch`, `data.domain_shares`) or a list of sections included."""
    *parents, name = keys
    section = _section_of(Config, tuple(parents))
    field = section.model_fields.get(name) if section is not None else None
    return field is not None and any(
        get_origin(a) is None and isinstance(a, type) and issubclass(a, BaseModel) for a in _options(field.annotation)
    )


def _options(annotation: Any) -> tuple:
    """The types a field's annotation allows: `Text | None` -> (str, NoneType)."""
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return tuple(get_args(a)[0] if get_origin(a) is Annotated else a for a in options)


def _text_given_another_type(keys: list[str], value: Any) -> tuple[str, Any] | None:
    """The first (dotted key, value) where `value`, given for `keys`, puts a number, boolean or null that the field
    does not take in a field that takes text (`name`, `data.tokenizer`): text YAML read as another type."""
    if isinstance(value, dict):
        if not _is_section(keys):
            return None
        found = (_text_given_another_type([*keys, k], v) for k, v in value.items() if isinstance(k, str))
        return next((f for f in found if f is not None), None)
    field = _field_of(".".join(keys))
    if field is None or isinstance(value, (str, list)):
        return None
    options = _options(field.annotation)
    takes_text_only = str in options and set(options) <= {str, type(None)}
    return (".".join(keys), value) if takes_text_only and not (value is None and type(None) in options) else None


def _read_as(value: Any) -> str:
    """What YAML read a scalar as, for a message: `the int 123`, `the boolean true`, `null`."""
    if value is None:
        return "null (no value)"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    return f"the {type(value).__name__} {value!r}"


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """`raw` with the `--set KEY=VALUE` items applied in order. A mapping given for a section (`train={steps: 4}`)
    merges into it key by key, as a config file merges into its `base:` (`_deep_merge`); one given for a value, a
    free-form mapping (`model.arch`, `data.domain_shares`) included, replaces it."""
    raw = json.loads(json.dumps(raw))
    for item in overrides:
        keys, value = parse_override(item)
        node = raw
        for k in keys[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise UserError(f"--set '{item}': '{k}' is a value, not a section")
            node = nxt
        if isinstance(value, dict) and isinstance(node.get(keys[-1]), dict) and _is_section(keys):
            value = _deep_merge(node[keys[-1]], value)
        node[keys[-1]] = value
    return raw


def _section_of(model: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The section class at `path` (names, and list indices which stay in the section: data.sources[0]) below
    `model`; None where a name is not a section."""
    for part in path:
        if isinstance(part, int):
            continue
        ann = getattr(model.model_fields.get(part), "annotation", None)
        # `list[Section] | None` -> Section
        items = [a for arg in get_args(ann) for a in (get_args(arg) or (arg,))] if get_args(ann) else [ann]
        sections = [a for a in items if isinstance(a, type) and issubclass(a, BaseModel)]
        if not sections:
            return None
        model = sections[0]
    return model


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    section = _section_of(model, loc[:-1])
    return list(section.model_fields) if section is not None else []


def _field_of(dotted: str):
    """The schema's field of a dotted key (`train.lr`), None for a key the schema does not have."""
    *sections, name = dotted.split(".")
    section = _section_of(Config, tuple(sections))
    return section.model_fields.get(name) if section is not None else None


def _dotted(loc: tuple) -> str:
    """`('train', 'betas', 1)` -> `train.betas[1]`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).removeprefix(".")


def _format_validation_error(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = tuple(p for p in e["loc"])
    key = _dotted(loc) or "(top level)"
    if e["type"] == "extra_forbidden":
        keys = [k for k in _allowed_keys(Config, loc) if k not in NOT_SETTINGS]
        return f"{source}: unknown key '{key}'; {_near(str(loc[-1]), keys)}allowed keys here: {', '.join(keys)}"
    if e["type"] == "literal_error":
        return f"{source}: {key} = {e.get('input')!r} is not allowed; expected {e['ctx']['expected']}"
    msg = e["msg"].removeprefix("Value error, ")
    if not loc:  # a rule across sections: its message names the keys
        return f"{source}: {msg}"
    if isinstance(e.get("input"), dict):
        return f"{source}: {key}: {msg}"
    return f"{source}: {key} = {e.get('input')!r}: {msg}"


def validate(
    raw: dict, source: str = "<config>", context: dict | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """`raw` as a Config, or a UserError of one line naming `source` (or the `--set` among `overrides` that gave the
    key at fault) and the key; `context`: facts about this machine the schema's machine-dependent rules read
    (`check_on_this_machine`)."""
    try:
        return Config.model_validate(raw, context=context)
    except ValidationError as err:
        raise UserError(_format_validation_error(err, _blamed(err, source, overrides))) from None


def _overridden(item: str, keys: tuple[str, ...]) -> bool:
    """Whether the `--set` `item` gives one of `keys`, a key inside one, or a section holding one."""
    k = item.split("=", 1)[0].strip()
    return any(k == key or k.startswith((key + ".", key + "[")) or key.startswith(k + ".") for key in keys)


def _blamed(err: ValidationError, source: str, overrides: list[str] | tuple[str, ...]) -> str:
    """The `--set` that gave the first error's key (the last one, as it wins), else `source`: a mistyped value on the
    command line is not the config file's."""
    first = err.errors()[0]
    key = _dotted(tuple(first["loc"]))
    keys = [(item, item.split("=", 1)[0].strip()) for item in reversed(overrides)]
    for item, k in keys:
        if key == k or key.startswith((k + ".", k + "[")):
            return f"--set {item}"
    # a rule across a section's fields (data.path is required with data.source local), or across sections: the
    # --sets the rule's message names, else (a section's rule) every --set in that section
    named = [f"--set {item}" for item, k in keys if k in first["msg"] and (not key or k.startswith(key + "."))]
    within = [f"--set {item}" for item, k in keys if key and k.startswith(key + ".")]
    return ", ".join(named or within) or source


def check_on_this_machine(cfg: Config, cuda_available: bool) -> None:
    """The schema's rules that depend on the machine a run starts on (the nccl backend needs CUDA), checked before
    any process starts; loading alone does not check them, so a GPU config loads and plans on any machine."""
    validate(
        settings(cfg), cfg.source_file or "config", context={CUDA_AVAILABLE: cuda_available}, overrides=cfg._overrides
    )


def schema_defaults(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The schema's defaults with `overrides` and no config file (what a bare model directory is evaluated under),
    knowing which `--set` items gave what (`Config.overridden`)."""
    cfg = validate(apply_overrides({}, overrides), "--set", overrides=overrides)
    cfg._overrides = tuple(overrides)
    return cfg


def load_config(name_or_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a config by path or bundled name (default: the embedded tiny CPU config), apply overrides, validate."""
    if name_or_path is not None and not name_or_path.strip():
        raise UserError("config '': an empty name (an unset shell variable?); leave --config out for the default")
    path = _locate(DEFAULT_CONFIG if name_or_path is None else name_or_path)
    raw = apply_overrides(_load_raw(path), overrides)
    raw.pop("source_file", None)
    cfg = validate(raw, source=str(path), overrides=overrides)
    cfg.source_file = str(path)
    cfg._overrides = tuple(overrides)
    return cfg


def with_overrides(cfg: Config, overrides: list[str] | tuple[str, ...], why: str) -> Config:
    """`cfg` with `--set`-style overrides applied and validated again (a stage deriving the config it runs: a measured
    point, a sequence-parallel check); `why` names the derivation in error messages. Keeps `source_file` and
    `workdir`."""
    raw = apply_overrides(settings(cfg), overrides)
    derived = validate(raw, f"{cfg.source_file or 'config'} ({why})")
    derived.source_file, derived.workdir, derived._overrides = cfg.source_file, cfg.workdir, cfg._overrides
    return derived


# ---------------------------------------------------------------- fingerprints and resolved output

# Fields that change how a stage runs but not what it produces.
_DATA_FIELDS_NOT_IN_FINGERPRINT = ("num_workers", "output_dir", "strict", "shard_tokens")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def settings(cfg: Config) -> dict:
    """The run's settings as JSON values: what fingerprints, checkpoints and comparisons see."""
    return cfg.model_dump(mode="json", exclude=set(NOT_SETTINGS))


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@functools.cache
def _default_settings() -> dict:
    return _flat(settings(Config()))


def settings_changes(before: dict, now: dict) -> dict[str, tuple]:
    """The keys (dotted) whose value differs between two `settings`, with (before, now). A key `before` lacks is a
    setting lctrain added since `before` was recorded (a checkpoint's, an older run's): it counts as its default, the
    behaviour before the key existed, so an upgrade does not read as an edit; any other key one side lacks is None
    there."""
    a, b = _flat(before), _flat(now)
    defaults = _default_settings()
    a = {**{k: defaults[k] for k in b if k not in a and k in defaults}, **a}
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def shown_changes(changes: dict[str, tuple], most: int = 4) -> str:
    """`key before -> now, ...` for a message, the first `most` and a count of the rest."""
    return first_and_more([f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()], most)


def config_fingerprint(cfg: Config) -> str:
    return _digest(settings(cfg))


# The data keys every fingerprint covers: those of 2026-11-27, but data.sources. A key added later (and data.sources)
# enters a fingerprint only when set away from its default, so a dataset prepared before the key existed keeps its
# name (the prepared/ directory train looks in) under an lctrain that has it; append no key here.
_DATA_FINGERPRINT_KEYS = (
    "source",
    "path",
    "hub_name",
    "hub_split",
    "tokenizer",
    "anchor",
    "seq_len",
    "token_budget",
    "mixture",
    "domain_shares",
    "short_doc_tokens",
    "down_sample_ratio",
    "domain_tags",
    "interleave_chunks",
    "min_doc_tokens",
    "seed",
    "shuffle_buffer_tokens",
    "synthetic",
)


@functools.cache
def _default_data() -> dict:
    return DataConfig().model_dump(mode="json")


def data_fingerprint(data: DataConfig) -> str:
    dumped = data.model_dump(mode="json", exclude=set(_DATA_FIELDS_NOT_IN_FINGERPRINT))
    defaults = _default_data()
    return _digest({k: v for k, v in dumped.items() if k in _DATA_FINGERPRINT_KEYS or v != defaults[k]})


def data_dir(cfg: Config) -> Path:
    """Where the prepared dataset of this config lives: `data.output_dir`, else one directory per data fingerprint,
    so configs that differ only in training settings share one prepared dataset."""
    if cfg.data.output_dir:
        return cfg.resolve_path(cfg.data.output_dir)
    return cfg.resolve_path("prepared") / data_fingerprint(cfg.data)[:12]


def tokens_to_prepare(steps: int, global_batch: int, seq_len: int, held_out: int) -> int:
    """The `data.token_budget` that gives every step windows no step read before and leaves `held_out` windows
    (`eval.ppl_windows`) that training never reads, for `lctrain eval`'s held-out perplexity."""
    return (steps * global_batch + held_out) * seq_len


def max_steps(windows: int, held_out: int, global_batch: int) -> int:
    """The most steps that read each prepared window at most once and leave `held_out` windows for perplexity (the
    inverse of `tokens_to_prepare`)."""
    return max(0, windows - held_out) // global_batch


def reread_warning(
    cfg: Config, windows: int, source_exhausted: bool = False, settings_left_out: bool = False, resuming: bool = False
) -> str | None:
    """One line when training reads more windows (`train.steps` x `train.global_batch`) than `windows` hold, else
    None. Reading runs through the windows in order (train/data.py), so the re-read windows are the last steps',
    which hold every evaluation checkpoint. `source_exhausted`: the input ran out before `data.token_budget`, so a
    larger budget would not help; `settings_left_out`: the data settings turned documents of it away (a minimum
    length, the mixture's shares or down-sampling), which letting in would help as well; `resuming`: a resume, which
    continues on its dataset (a data change is refused), so only fewer steps help."""
    needed = cfg.windows_read()
    if needed <= windows:
        return None
    seq_len, batch, held = cfg.data.seq_len, cfg.train.global_batch, cfg.eval.ppl_windows
    fits = windows // batch
    ran_out = source_exhausted or cfg.data.token_budget >= cfg.tokens_read()
    if ran_out:
        more = (
            "the input ran out before data.token_budget, with documents the data settings left out (prepare names "
            "them): add input data or let them in (and prepare again)"
            if settings_left_out
            else "the input ran out before data.token_budget: add input data (and prepare again)"
        )
    else:
        more = f"set data.token_budget={tokens_to_prepare(cfg.train.steps, batch, seq_len, held)} (and prepare again)"
    steps = max_steps(windows, held, batch)
    if steps:
        kept = f" (which leaves eval.ppl_windows = {held} unread for perplexity)" if held else ""
        fewer = [f"set train.steps={steps}{kept}" if ran_out or resuming else "lower train.steps"]
    else:
        # train.steps >= 1: the windows must hold one step's besides the held-out ones, so fewer steps cannot help
        # a step's windows split evenly over the data-parallel ranks' micro-batches (train/data.py BatchPlan)
        split = cfg.train.micro_batch * layout_of(cfg).dp
        fewer = []
        if windows - held >= split:
            fewer.append(f"set train.global_batch={(windows - held) // split * split}")
        if windows >= batch:
            fewer.append(f"set eval.ppl_windows={windows - batch}")
    if resuming:  # its dataset and batch are the checkpoint's
        more = None
        fewer = [f for f in fewer if not f.startswith("set train.global_batch")]
    fix = " or ".join(filter(None, [more, *fewer])) or (
        "a resume continues on this dataset: start the run over on more data to read each window once"
    )
    rereading = cfg.train.steps - fits
    last = "the last step re-reads" if rereading == 1 else f"the last {rereading:,} steps re-read"
    return (
        f"warning: {cfg.train.steps:,} steps x {cfg.train.global_batch} windows x {seq_len:,} tokens = "
        f"{cfg.tokens_read():,} tokens, {(needed - windows) * seq_len:,} more than the data has ({windows:,} "
        f"windows, {windows * seq_len:,} tokens): {last} windows; {fix}"
    )


def run_dir(cfg: Config) -> Path:
    return cfg.resolve_path(cfg.train.run_dir) if cfg.train.run_dir else cfg.resolve_path("runs") / cfg.name


# The longest a list or mapping shown in a comment gets before its last items become a count.
_COMMENT_WIDTH = 100


def _one_line(value: Any, width: int = _COMMENT_WIDTH, *, text: bool = False) -> str:
    """`value` compact on one line, for a comment: a scalar as YAML writes it (a string quoted where YAML would; with
    `text`, as is), a list `[a, b]`, a mapping `{k: v}`; one longer than `width` keeps its first items and counts the
    rest (`... 9 more`). A character a YAML comment cannot hold (a line break, a control character) is escaped."""
    if isinstance(value, dict | list | tuple):
        opening, closing = "{}" if isinstance(value, dict) else "[]"
        pairs = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        items = [_one_line(v, width) if k is None else f"{_one_line(k)}: {_one_line(v, width)}" for k, v in pairs]
        shown = items
        for n in range(len(items) - 1, 0, -1):
            if len(", ".join(shown)) + 2 <= width:
                break
            shown = [*items[:n], f"... {len(items) - n} more"]
        return opening + ", ".join(shown) + closing
    if isinstance(value, str) and (text or not value.isprintable()):
        shown = value if text else json.dumps(value, ensure_ascii=False)
    else:
        shown = yaml.safe_dump(value, width=math.inf, allow_unicode=True).removesuffix("\n...\n").strip()
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in shown)


def _comment_resolved(body: str, used: dict[str, Any], notes: list[str]) -> tuple[str, list[str]]:
    """`body` (YAML) with what each key of `used` resolves to as a comment at the end of its line (a block list's or
    mapping's on its key's line), followed by the rest of its note, the one of `notes` that starts `KEY: `:
    `anchor: auto  # <s> (id 1; ...)`, `backend: auto  # gloo on this machine (...)`; and the notes left."""
    lines, notes = body.split("\n"), list(notes)
    where: dict[str, int] = {}

    def walk(node: yaml.MappingNode, prefix: str) -> None:
        for k, v in node.value:
            block = isinstance(v, yaml.CollectionNode) and not v.flow_style
            where[prefix + k.value] = k.start_mark.line if block else v.end_mark.line
            if isinstance(v, yaml.MappingNode):
                walk(v, f"{prefix}{k.value}.")

    walk(yaml.compose(body), "")
    for key, value in used.items():
        comment = _one_line(value)
        note = next((n for n in notes if n.startswith(f"{key}: ")), None)
        if note is not None:
            notes.remove(note)
            said = note.removeprefix(f"{key}: ")
            rest = next((said.removeprefix(p) for p in (f"auto is {comment}", comment) if said.startswith(p)), None)
            comment += _one_line(f"; {said}" if rest is None else rest, text=True)
        if key in where:
            lines[where[key]] += f"  # {comment}"
        else:
            notes.append(f"{key}: {comment}")
    return "\n".join(lines), notes


def to_yaml(
    cfg: Config,
    used: dict[str, Any] | None = None,
    notes: list[str] | tuple[str, ...] = (),
    *,
    workdir: bool = False,
) -> str:
    """The config as YAML, with its own values (it loads as the same config); `notes` become comment lines after the
    header. `used` (by dotted key, what a null or `auto` resolves to on this machine: `show-config`) becomes a comment
    at the end of its key's line, with the note about that key (moved from the header). With `workdir`, also where its
    relative paths resolve (a run directory's copy). The fingerprint is the config's own."""
    body = dump_yaml(settings(cfg), sort_keys=False)
    header = f"# resolved lctrain config; fingerprint {config_fingerprint(cfg)}\n"
    if used:
        body, notes = _comment_resolved(body, used, list(notes))
        header += (
            "# the config's own values (this loads as the same config); a comment after a null or auto: what it "
            "resolves to on this machine\n"
        )
    if workdir:
        body += dump_yaml({"workdir": str(Path(cfg.workdir or ".").absolute())})
    return header + "".join(f"# {line}\n" for line in notes) + body


def write_resolved(cfg: Config, directory: Path, filename: str = "config.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / filename
    out.write_text(to_yaml(cfg))
    return out
