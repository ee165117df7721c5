"""`lctrain init`: a commented config of the paper's recipe adapted to one base model, a context length and a GPU
count. The model's shape comes from the known-shape table (lctrain/shapes.py) or a local/cached config.json, never a
weight download; the parallel layout is the first whose memory plan (lctrain/memory.py) fits, in the order
`choose_layout` gives."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from shlex import quote
from typing import Any

import yaml
from transformers import AutoConfig

from lctrain.compat.transformers import attn_implementation_of, sdpa_refused
from lctrain.config import (
    Config,
    DataConfig,
    EvalConfig,
    bundled_config_names,
    load_config,
    load_yaml,
    tokens_to_prepare,
    validate,
)
from lctrain.costmodel import ModelShape
from lctrain.data.sources import resolve_local_files
from lctrain.disk import plan_disk
from lctrain.errors import UserError
from lctrain.memory import SELECTIVE, Budget, plan_memory, replan
from lctrain.model import config_changes, default_rope_theta, model_shape, require_engines, require_rope
from lctrain.parallel.layout import ParallelLayout, kv_replication
from lctrain.shapes import HUB_NAMES, POSITIONS, SHAPES, Positions
from lctrain.tokenizer import BUILTIN_PREFIX, load_tokenizer
from lctrain.train.runplan import RunPlan
from lctrain.units import GB, option_gb_to_bytes

# The paper's recipe (section 4.1 and its released code): 8 windows per step, 2000 steps, AdamW at a constant 2e-5.
PAPER_WINDOWS_PER_STEP = 8
PAPER_STEPS = 2000
MODES = ("full", "intra_doc", "intra_doc_reset", "anchor")


@dataclass(frozen=True)
class BaseModel:
    """What `init` knows of the model without its weights."""

    name_or_path: str  # as the YAML will name it: a hub name, or a local directory made absolute
    stem: str  # for the file and run names
    shape: ModelShape
    positions: Positions
    source: str  # where the shape came from, for the YAML's comment
    # its Hugging Face config when init has it (a directory's, a cached one's): what train changes in it, and which
    # attention engine runs it
    hf_config: Any = None


@dataclass(frozen=True)
class Layout:
    zero_stage: int
    sequence_parallel: int
    offload_optimizer: bool
    tiled_mlp: bool
    offload_activations: bool
    device_bytes: int = 0  # the plan's needs, once planned
    host_bytes: int = 0

    def described(self) -> str:
        """As the summary line and the refusal name it."""
        extra = [
            name
            for name, on in (
                ("optimizer offloaded to the host", self.offload_optimizer),
                ("tiled MLP", self.tiled_mlp),
                ("activations offloaded to the host", self.offload_activations),
            )
            if on
        ]
        return ", ".join([f"ZeRO-{self.zero_stage}", f"sequence parallel {self.sequence_parallel}", *extra])


# The model's own memory savers, tried only once no layout fits without them: each slows every layer (optimizer
# offload, tried before them, slows the step's end only). Tiled MLP first: its saving is measured (docs/memory.md)
# and its cost is one more MLP forward per layer, which `lctrain estimate` counts; activation offload's copies
# overlap the compute, but its GPU peak is only planned so far (docs/memory.md), so it comes after, then both.
SAVERS = ((False, False), (True, False), (False, True), (True, True))  # (tiled_mlp, offload_activations)


def _hf_base(name_or_path: str, hf, stem: str, source: str) -> BaseModel:
    require_rope(hf, name_or_path)
    require_engines(hf, name_or_path)
    rope = dict(hf.rope_parameters)
    if "rope_theta" not in rope:
        raise UserError(
            f"{name_or_path}: model type '{hf.model_type}' has no single RoPE base (rope_parameters.rope_theta: "
            f"one per layer type?); lctrain init reads one"
        )
    return BaseModel(
        name_or_path,
        stem,
        ModelShape.from_hf_config(hf),
        Positions(float(rope["rope_theta"]), int(hf.max_position_embeddings), rope.get("rope_type", "default")),
        source,
        hf,
    )


def base_model(spec: str) -> BaseModel:
    """The base model `spec` names: a local Hugging Face directory (its config.json), a known base model's hub name,
    or a hub name whose config is in the local Hugging Face cache. Refuses anything else in one line."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {spec}: the directory has no config.json (not a Hugging Face model directory)")
        try:
            hf = AutoConfig.from_pretrained(path)
        except (OSError, ValueError, TypeError) as e:
            raise UserError(f"--model {spec}: config.json cannot be read ({' '.join(str(e).split())[:200]})") from None
        return _hf_base(str(path.resolve()), hf, path.resolve().name.lower(), f"{path / 'config.json'}")
    if spec in HUB_NAMES:
        key = HUB_NAMES[spec]
        return BaseModel(spec, key, SHAPES[key], POSITIONS[key], "lctrain's table of known base models", _cached(spec))
    try:
        hf = AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, TypeError):
        raise UserError(
            f"--model {spec}: not a local model directory, not a known base model ({', '.join(sorted(HUB_NAMES))}) "
            "and not in the Hugging Face cache; download its config.json first or pass a directory"
        ) from None
    return _hf_base(spec, hf, spec.rsplit("/", 1)[-1].lower(), "its config.json in the Hugging Face cache")


def _cached(spec: str):
    """The config.json of hub model `spec` in the local Hugging Face cache, else None (never a download)."""
    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def attention_engine(base: BaseModel) -> tuple[str, str | None]:
    """(attention.engine, the YAML comment saying why when it is not auto): auto picks sdpa on a CPU and in full mode,
    which transformers refuses for a model class without sdpa (Gemma-2: its attention soft-caps the logits, which
    sdpa cannot); flex runs it on any CUDA GPU."""
    hf = base.hf_config
    if hf is None or not sdpa_refused(hf, "sdpa"):
        return "auto", None
    # Gemma-2's class has no sdpa for its soft-capping, which it applies whenever its config sets it
    soft = " (its attention soft-capping needs a step sdpa lacks)" if hasattr(hf, "attn_logit_softcapping") else ""
    why = (
        f"flex, not auto: transformers runs no sdpa for model type '{hf.model_type}'{soft}, and auto means sdpa on a "
        f"CPU and in full mode. flex runs on a CUDA GPU; varlen is faster there in bfloat16 with flash-attn; "
        f"reference on a CPU (small tests: dense scores)"
    )
    cap = getattr(hf, "attn_logit_softcapping", None)
    if cap is not None:
        why += (
            f". This model soft-caps attention logits (attn_logit_softcapping = {cap}), which no lctrain engine "
            f"computes: train refuses it until the model's config.json sets attn_logit_softcapping: null (another "
            f"model than the one given)"
        )
    return "flex", why


def model_changes(base: BaseModel, cfg: Config) -> list[str]:
    """What train changes in the model's config for `cfg` (`lctrain.model.config_changes`, the one list of them
    show-config, the train banner and model_changes.json show), one description each; the attention implementation
    is left out: it depends on the machine (show-config says it there). Empty when init has no config of the model."""
    hf = base.hf_config
    if hf is None:
        return []
    changes = config_changes(hf, cfg, vocab_size=None, attn_implementation=attn_implementation_of(hf))
    return [c.describe() for c in changes]


def rope_base(own: float, seq_len: int) -> tuple[float, str]:
    """The RoPE base to train at and why: the paper's rule (section 4.3: "1M for 32K, 5M for 64K, 10M for 128K, and
    50M for 256K"; Table 1 lists the first three), unless the model's own base is already higher (a base is never
    lowered behind a model)."""
    rule = default_rope_theta(seq_len)
    if own > rule:
        return own, f"the model's own base, above the paper's {rule:,.0f} for {seq_len:,} tokens: kept"
    return rule, (
        f"the paper's base for {seq_len:,}-token windows (its rule: 1M for 32K, 5M for 64K, 10M for 128K, 50M for "
        f"256K); the model's own is {own:,.0f}"
    )


def eval_lengths(seq_len: int) -> list[int]:
    """RULER's lengths to evaluate a model trained on `seq_len`-token windows: the paper's, doubling from 4K, up to the
    training length and including it (Table 2 scores its 64K models at 4K-64K, Table 5 its 128K ones at 4K-128K);
    a longer length is a generalisation study, asked for with `--lengths`."""
    below = [n for n in (4096 << i for i in range(seq_len.bit_length())) if n < seq_len]
    return [*below, seq_len]


def _sp_sizes(shape: ModelShape, gpus: int, seq_len: int) -> list[int]:
    """The sequence-parallel sizes to try, those that keep the paper's batch (`batch_for`) first, then the nearest
    batch, each smallest first. A larger batch at the paper's learning rate is another recipe (16 windows per step on
    16 GPUs are twice the paper's tokens per step), while sequence parallelism within a node leaves each GPU the same
    FLOPs for a little all-to-all traffic; the bundled paper configs train 64K windows at SP 4 on 8 GPUs."""
    usable = [s for s in range(1, gpus + 1) if gpus % s == 0 and seq_len % s == 0 and shape.heads % s == 0]
    return sorted(usable, key=lambda s: (batch_for(gpus // s), s))


def batch_for(dp: int) -> int:
    """The paper's 8 windows per step, raised to a multiple of the data-parallel replicas when there are more."""
    return math.ceil(PAPER_WINDOWS_PER_STEP / dp) * dp


def choose_layout(raw: dict, shape: ModelShape, budget: Budget, gpus: int) -> tuple[Layout, int]:
    """The first layout whose plan fits `budget`, and how many were tried: without the model's memory savers
    (`SAVERS`) before with them; within those, no optimizer offload before any; then sequence-parallel groups within
    a node before groups across nodes (Ulysses' all-to-alls, four per layer on the step's critical path, over the
    node's links rather than the network: ZeRO-3 within a node before ZeRO-2 across two); then the lowest ZeRO stage
    (1: bf16 needs ZeRO's fp32 master weights); then the sequence-parallel sizes of `_sp_sizes`. `raw` is the config
    without its parallel and batch settings. Refuses in one line naming what was tried and the plan that came
    nearest."""
    seq_len = raw["data"]["seq_len"]
    sp_sizes = _sp_sizes(shape, gpus, seq_len)
    per_node = raw["parallel"]["nproc_per_node"]
    groups = [[sp for sp in sp_sizes if sp <= per_node], [sp for sp in sp_sizes if sp > per_node]]
    tried, nearest, nearest_over = 0, None, math.inf
    for tiled, offload_activations in SAVERS:
        for offload in (False, True):
            for group, zero in itertools.product(groups, (1, 2, 3)):  # bf16 keeps fp32 master weights: ZeRO >= 1
                for sp in group:
                    tried += 1
                    layout = Layout(zero, sp, offload, tiled, offload_activations)
                    plan = plan_memory(validate(_with_layout(raw, layout, gpus), "lctrain init"), shape, gpu=True)
                    device, host = budget.need(plan)
                    layout = dataclasses.replace(layout, device_bytes=device, host_bytes=host)
                    if budget.fits(plan):
                        return layout, tried
                    over = max(device / budget.device, host / budget.host)
                    if over < nearest_over:
                        nearest, nearest_over = layout, over
    # the sequence-parallel groups must divide the heads: more GPUs split the sequence further only in the next one
    larger = [s for s in range(max(sp_sizes) + 1, shape.heads + 1) if shape.heads % s == 0 and seq_len % s == 0]
    more_gpus = (
        f"more GPUs (--gpus, a multiple of {larger[0]}: the next sequence-parallel size the model's {shape.heads} "
        f"heads allow)"
        if larger
        else "more GPUs (--gpus)"
    )
    raise UserError(
        f"no layout fits {gpus} GPU(s) of {budget.label} at seq_len {seq_len:,}: tried {tried} (ZeRO 1-3 x sequence "
        f"parallel {', '.join(map(str, sorted(sp_sizes)))} x optimizer offload or not, each without and with tiled "
        f"MLP and activation offload); the nearest ({nearest.described()}) needs {nearest.device_bytes / GB:.1f} GB "
        f"per GPU and {nearest.host_bytes / GB:.1f} GB of host memory per node; use {more_gpus}, more memory "
        f"(--gpu-mem, --host-mem) or a shorter --seq-len"
    )


def _selective_layouts(raw: dict, layout: Layout, shape: ModelShape, gpus: int) -> list[tuple[int, int]]:
    """The (sequence-parallel size, ZeRO stage) pairs `choose_checkpointing` tries, the cheapest first: the layout's
    own; its ZeRO-1 raised to ZeRO-2 (which shards the gradients too and moves the same bytes: a reduce-scatter and an
    all-gather where ZeRO-1 all-reduces); then each larger sequence-parallel group within a node that keeps the batch
    (each GPU's FLOPs stay the same for a little all-to-all traffic over the node's links, far less than the attention
    forward whole-layer recomputation reruns at these lengths)."""
    zeros = [layout.zero_stage] + ([2] if layout.zero_stage == 1 else [])
    batch = batch_for(ParallelLayout(gpus, layout.sequence_parallel).dp)
    larger = [
        sp
        for sp in _sp_sizes(shape, gpus, raw["data"]["seq_len"])
        if layout.sequence_parallel < sp <= raw["parallel"]["nproc_per_node"]
        and batch_for(ParallelLayout(gpus, sp).dp) == batch
    ]
    return [(sp, zero) for sp in [layout.sequence_parallel, *sorted(larger)] for zero in zeros]


def choose_checkpointing(
    raw: dict, layout: Layout, shape: ModelShape, budget: Budget, gpus: int
) -> tuple[dict, Layout, str, str]:
    """Selective checkpointing when a plan with it fits `budget` on the layout chosen with whole-layer
    checkpointing, or on the first of `_selective_layouts` where it does; else `raw` as it is. The config, its layout
    with the planned needs, the YAML comment that says why, and what selective changed of the layout ('' when
    nothing, else e.g. 'sequence parallel 2'). Selective keeps each layer's attention output, so the
    backward does not rerun attention: the 1B model's full-attention step at 64K took 3.68 s against 4.31 s with
    whole layers on one H100 (docs/performance.md)."""
    cfg = validate(raw, "lctrain init")
    tried = []
    for sp, zero in _selective_layouts(raw, layout, shape, gpus):
        fix = replan(cfg, [SELECTIVE, f"parallel.sequence_parallel={sp}", f"parallel.zero_stage={zero}"], shape, budget)
        tried.append((sp, zero, fix))
        if fix.fits:
            chosen = dataclasses.replace(
                layout, zero_stage=zero, sequence_parallel=sp, device_bytes=fix.device, host_bytes=fix.host
            )
            laid = _with_layout(raw, chosen, gpus)
            selective = laid | {"model": laid["model"] | {"checkpointing": "selective"}}
            new, old = _changes(layout, sp, zero)
            at = f" at {new} ({old} fits only whole layers)" if new else ""
            why = f"selective{at}: the backward does not rerun attention; each layer's attention output is kept"
            return selective, chosen, why, new
    # the nearest to fit names what selective would need
    sp, zero, fix = min(tried, key=lambda t: max(t[2].device / budget.device, t[2].host / budget.host))
    new, _ = _changes(layout, sp, zero)
    at = f" at {new}" if new else ""
    need, limit = (
        (f"{fix.device / GB:.1f} GB per GPU", f"{budget.device / GB:.1f} GB per GPU")
        if fix.device > budget.device
        else (f"{fix.host / GB:.1f} GB of host memory", f"{budget.host / GB:.1f} GB per node")
    )
    return (
        raw,
        layout,
        f"full: selective (the backward would not rerun attention) needs {need}{at}, over init's budget of {limit} "
        f"({budget.label})",
        "",
    )


def _changes(layout: Layout, sp: int, zero: int) -> tuple[str, str]:
    """What of (`sp`, `zero`) differs from `layout`, as a comment names it, and the layout's own values of it
    (('', '') when nothing does)."""
    pairs = [(f"sequence parallel {sp}", f"sequence parallel {layout.sequence_parallel}")] * (
        sp != layout.sequence_parallel
    ) + [(f"ZeRO-{zero}", f"ZeRO-{layout.zero_stage}")] * (zero != layout.zero_stage)
    return " and ".join(p[0] for p in pairs), " and ".join(p[1] for p in pairs)


def _with_layout(raw: dict, layout: Layout, gpus: int) -> dict:
    per_node = raw["parallel"]["nproc_per_node"]
    global_batch = batch_for(ParallelLayout(gpus, layout.sequence_parallel).dp)
    savers = ({"tiled_mlp": "auto"} if layout.tiled_mlp else {}) | (
        {"offload_activations": True} if layout.offload_activations else {}
    )
    return raw | {
        "model": raw["model"] | savers,
        "parallel": raw["parallel"]
        | {
            "sequence_parallel": layout.sequence_parallel,
            "zero_stage": layout.zero_stage,
            "offload_optimizer": layout.offload_optimizer,
            "num_nodes": gpus // per_node,
        },
        "train": raw["train"]
        | {"global_batch": global_batch, "steps": PAPER_STEPS * PAPER_WINDOWS_PER_STEP // global_batch},
    }


def choose_tokenizer(base: BaseModel, given: str | None) -> tuple[str, str]:
    """(data.tokenizer, why): `--tokenizer` when given (a local one must load), else the model's own: its hub name,
    or its directory when that holds a tokenizer `prepare` can load. A directory without one is refused in one line:
    only the user knows which tokenizer the model was trained with."""
    if given is not None:
        if given.startswith(BUILTIN_PREFIX) or Path(given).expanduser().exists():
            try:
                tok = load_tokenizer(given)
            except UserError as e:
                raise UserError(f"--tokenizer {given}: {e}") from None
            top = max(tok.get_vocab().values())
            if top >= base.shape.vocab:  # as `prepare` and `train` refuse it (tokenizer.check_matches_model)
                raise UserError(
                    f"--tokenizer {given}: its ids reach {top:,}, past the {base.shape.vocab:,} embedding rows of "
                    f"--model {base.name_or_path}; pass the model's own tokenizer"
                )
            return (
                given if given.startswith(BUILTIN_PREFIX) else str(Path(given).expanduser().resolve())
            ), "--tokenizer"
        return given, "--tokenizer (a hub name: downloaded by `lctrain prepare`)"
    if not Path(base.name_or_path).is_dir():
        return base.name_or_path, "the model's own (its hub repository)"
    try:
        load_tokenizer(base.name_or_path)
    except UserError:
        raise UserError(
            f"--model {base.name_or_path}: the directory holds no tokenizer lctrain can load (tokenizer.json, "
            "tokenizer.model, ...); pass --tokenizer with the model's tokenizer (a directory, a .model file or a hub "
            "name), or save it into the directory"
        ) from None
    return base.name_or_path, "the model's own (its directory)"


@dataclass(frozen=True)
class Exclude:
    """RULER tasks left out of the average, as the bundled configs of the model leave them."""

    tasks: list[str]
    configs: list[str]  # the bundled configs of the model; none when no bundled config trains it


def paper_exclude(base: BaseModel) -> Exclude:
    """`eval.exclude` of the bundled configs training `base` (the paper's models), read from those configs so that
    they stay its one home: an init config scores RULER as the bundled ones do, and its averages compare with the
    paper's. They agree for each model (tests/test_init_config.py); the first one's is taken. A local directory is
    the known base model of its shape and positions (a downloaded Llama-2-7B is meta-llama/Llama-2-7b-hf)."""
    name = known_hub_name(base) or base.name_or_path
    configs = [load_config(n) for n in bundled_config_names()]
    mine = [c for c in configs if c.model.name_or_path == name]
    return Exclude(list(mine[0].eval.exclude) if mine else [], [c.name for c in mine])


def known_hub_name(base: BaseModel) -> str | None:
    """The hub name of the known base model `base` is, by name or by its shape and positions."""
    if base.name_or_path in HUB_NAMES:
        return base.name_or_path
    return next(
        (hub for hub, key in HUB_NAMES.items() if SHAPES[key] == base.shape and POSITIONS[key] == base.positions),
        None,
    )


def _eval_exclude(exclude: Exclude) -> str:
    """The eval section's exclude line with the comment that says where it comes from."""
    if not exclude.configs:
        why = (
            "none left out: no bundled config trains this model (the paper leaves tasks out only for Llama-2-7B, "
            "section 4.2)"
        )
    else:
        more = len(exclude.configs) - 1
        named = exclude.configs[0] + (f" and {more} more" if more else "")
        why = (
            f"left out of RULER's average as in the bundled configs of this model ({named}) and the paper "
            f"(section 4.2, appendix D), so that the averages compare with the paper's"
            if exclude.tasks
            else f"none left out, as in the bundled configs of this model ({named}) and the paper (section 4.2)"
        )
    return f"{_comment(why)}\n  exclude: {yaml.safe_dump(exclude.tasks, default_flow_style=True).strip()}"


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def wandb_mode() -> tuple[str, str]:
    """(logging.wandb, the YAML comment): offline when Weights & Biases is installed here, else disabled, since
    `train` refuses a wandb mode it cannot import."""
    if installed("wandb"):
        return "offline", "Weights & Biases, offline (wandb sync uploads); online or disabled also work"
    return (
        "disabled",
        "Weights & Biases is not installed here: pip install 'lctrain[wandb]', then set offline or online",
    )


def _recipe(
    base: BaseModel,
    seq_len: int,
    gpus_per_node: int,
    mode: str,
    name: str,
    theta: float,
    tokenizer: str,
    data: str | None = None,
    engine: str = "auto",
) -> dict:
    """The settings that do not depend on the layout; `data`: a local corpus, else SlimPajama from the hub."""
    source = {"source": "local", "path": data} if data else {"source": "hub", "hub_name": SLIMPAJAMA}
    return {
        "name": name,
        "data": {
            **source,
            "tokenizer": tokenizer,
            "anchor": "auto",
            "seq_len": seq_len,
            "mixture": "slimpajama",
        },
        "model": {
            "name_or_path": base.name_or_path,
            "rope_theta": theta,
            "dtype": "bfloat16",
            "checkpointing": "full",
        },
        "attention": {"mode": mode, "engine": engine},
        "train": {
            "micro_batch": 1,
            "lr": 2.0e-5,
            "weight_decay": 0.1,
            "decay_norms_and_biases": True,
            "betas": [0.9, 0.95],
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "grad_clip": 1.0,
        },
        "parallel": {"nproc_per_node": gpus_per_node, "launcher": "deepspeed"},
    }


def _v(value) -> str:
    """One YAML scalar (a string quoted only when YAML needs it)."""
    # quoted where lctrain's YAML 1.2 reader or a YAML 1.1 one (08, 1e5, yes) would read the text as another value
    quoted = isinstance(value, str) and (load_yaml(value) != value or yaml.safe_load(value) != value)
    return json.dumps(value) if quoted else str(value)


def _comment(text: str) -> str:
    """`text` as comment lines of the YAML's sections."""
    return textwrap.fill(text, 118, initial_indent="  # ", subsequent_indent="  # ", break_on_hyphens=False)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


SLIMPAJAMA = "cerebras/SlimPajama-627B"


def _data_source(d: dict) -> str:
    """The data section's lines saying where the text comes from, with what the other choice would be."""
    if d["source"] == "local":
        return f"""  # your corpus (--data): a jsonl/parquet file, folder or glob (docs/data.md); the paper's SlimPajama
  # from the hub instead: source: hub and hub_name: {SLIMPAJAMA}
  source: local
  path: {_v(d["path"])}"""
    return f"""  # SlimPajama streamed from the hub, as in the paper. Your own corpus: source: local and path: a
  # jsonl/parquet file, folder or glob (docs/data.md), or `lctrain init --data PATH`.
  source: hub
  hub_name: {_v(d["hub_name"])}"""


def render(
    base: BaseModel,
    raw: dict,
    layout: Layout,
    why_theta: str,
    why_checkpointing: str,
    moved: str,
    budget: Budget,
    tried: int,
    why_tokenizer: str,
    wandb: tuple[str, str],
    exclude: Exclude,
    command: str,
    why_engine: str | None = None,
) -> str:
    """The YAML text of `raw` with comments saying where each choice comes from; `command`: the `lctrain init`
    command line that writes it again."""
    d, m, t, p = raw["data"], raw["model"], raw["train"], raw["parallel"]
    cfg = validate(raw, "lctrain init")  # the config the text writes, for the quantities it derives
    gpus = cfg.parallel.world
    dp = ParallelLayout(gpus, layout.sequence_parallel).dp
    held_out = EvalConfig.model_fields["ppl_windows"].default
    tokens = tokens_to_prepare(t["steps"], t["global_batch"], d["seq_len"], held_out)
    s = base.shape
    scaling_note = (
        f"\n  # the model's own rope_type '{base.positions.rope_type}' scaling is kept (rope_scaling: null); set\n"
        "  # model.rope_scaling: {rope_type: default} for the paper's plain RoPE at this base"
        if base.positions.rope_type != "default"
        else ""
    )
    offload = (
        "\n  offload_optimizer: true   # Adam states in host memory: nothing fit on the GPUs without it"
        if layout.offload_optimizer
        else ""
    )
    savers = (
        "\n  # nothing fit without the tiled MLP (docs/memory.md): each layer's MLP runs in slices of the sequence, one"
        "\n  # more MLP forward per layer (lctrain estimate counts it)\n  tiled_mlp: auto"
        if layout.tiled_mlp
        else ""
    ) + (
        "\n  # nothing fit without activation offload (docs/memory.md): the checkpointed hidden states wait in host"
        "\n  # memory, copied out and back beside the compute\n  offload_activations: true"
        if layout.offload_activations
        else ""
    )
    moved_note = (
        f",\n  # then {moved}, the first where selective checkpointing fits (model.checkpointing)" if moved else ""
    )
    changes = model_changes(base, cfg)
    changed = (
        "\n  # train changes the model's config so (show-config lists them on the machine that trains, the run's"
        "\n  # model_changes.json and each export's README.md record them):"
        + "".join(
            "\n" + textwrap.fill(c, 118, initial_indent="  #   ", subsequent_indent="  #     ", break_on_hyphens=False)
            for c in changes
        )
        if changes
        else ""
    )
    engine = raw["attention"]["engine"]
    engine_line = f"{_comment(why_engine)}\n  engine: {engine}" if why_engine else f"  engine: {engine}"
    nodes = (
        f"\n  # {p['num_nodes']} nodes: set hostfile: FILE, a DeepSpeed hostfile listing them (docs/cluster.md)"
        if p["num_nodes"] > 1
        else ""
    )
    return f"""# Written by `{command}`:
# the paper's recipe (AnchorAttention, arXiv 2411.13476, section 4.1) adapted to this model. Check it with
#   lctrain show-config -c THIS_FILE  and  lctrain plan -c THIS_FILE --gpu-mem GB_PER_GPU
# then run  lctrain prepare -c THIS_FILE  and  lctrain train -c THIS_FILE  (docs/training.md).
# Model shape from {base.source}: {s.layers} layers, hidden {s.hidden}, {s.heads} heads / {s.kv_heads} KV heads,
# head dim {s.head_dim}, intermediate {s.intermediate}, vocabulary {s.vocab}; own RoPE base \
{_num(base.positions.rope_theta)}, own context
# {base.positions.max_positions:,} tokens.
name: {_v(raw["name"])}
description: {_v(f"{base.stem}, {d['seq_len'] // 1024}K windows, {raw['attention']['mode']} attention (lctrain init)")}
data:
{_data_source(d)}
  tokenizer: {_v(d["tokenizer"])}   # {why_tokenizer}
  # the token that starts every segment and prompt; auto = the tokenizer's BOS when it adds one to plain text, else
  # <|endoftext|>, else EOS (`lctrain prepare` says which)
  anchor: {d["anchor"]}
  seq_len: {d["seq_len"]}
  # ({t["steps"]} steps x {t["global_batch"]} windows + {held_out} held out for perplexity) x {d["seq_len"]:,} tokens:
  # training reads each window at most once and leaves {held_out} unread (eval.ppl_windows)
  token_budget: {tokens}
  mixture: {d["mixture"]}
model:
  name_or_path: {_v(m["name_or_path"])}
  # {why_theta}{scaling_note}
  rope_theta: {_num(m["rope_theta"])}
  # max_position_embeddings is left to the model: raised to seq_len when lower, never lowered{changed}
  dtype: {m["dtype"]}
{_comment(why_checkpointing)}
  checkpointing: {m["checkpointing"]}{savers}
attention:
  mode: {raw["attention"]["mode"]}   # full, intra_doc, intra_doc_reset or anchor (the paper's AnchorAttention)
{engine_line}
train:
  steps: {t["steps"]}
  # {t["global_batch"]} windows per step ({cfg.tokens_per_step:,} tokens) over {dp} data-parallel \
replica(s): the paper's {PAPER_WINDOWS_PER_STEP}{
        "" if t["global_batch"] == PAPER_WINDOWS_PER_STEP else ", raised to a multiple of the replicas"
    }
  global_batch: {t["global_batch"]}
  micro_batch: 1
  lr: 2.0e-5
  weight_decay: 0.1
  decay_norms_and_biases: true   # the paper's released code decays every parameter, norms and biases included
  betas: [0.9, 0.95]
  lr_schedule: constant
  warmup_steps: 0
  grad_clip: 1.0
  # the held-out loss every 100 steps and at the last (eval.ppl_windows windows training never reads, scored as
  # `lctrain eval` scores perplexity, whatever the attention mode): a forward pass per window
  heldout_every: 100
parallel:
  nproc_per_node: {p["nproc_per_node"]}
  num_nodes: {p["num_nodes"]}{nodes}
  launcher: deepspeed
  # The first layout that fits (lctrain plan, {budget.label}; {tried} tried, in
  # order: without tiled MLP and activation offload before with, no optimizer offload before it, sequence-parallel
  # groups within a node before groups across nodes, the lowest ZeRO stage, the sequence-parallel sizes that keep
  # the paper's batch before the others, smallest first){moved_note}:
  # {layout.device_bytes / GB:.1f} GB per GPU, {layout.host_bytes / GB:.1f} GB of host memory per node.
  # Ulysses sequence parallel over {layout.sequence_parallel} GPU(s): {s.heads // layout.sequence_parallel} query \
heads and {d["seq_len"] // layout.sequence_parallel:,} tokens per rank.
  sequence_parallel: {layout.sequence_parallel}
  zero_stage: {layout.zero_stage}{offload}
checkpoint:
  # resume checkpoints every 100 steps (the last 2 kept); Hugging Face exports every 10 steps over the last 50,
  # the checkpoints the paper averages RULER over
  every_steps: 100
  keep: 2
  hf_every: 10
  hf_last: 50
logging:
  # {wandb[1]}
  wandb: {wandb[0]}
eval:
  # RULER at the training length, and below it at 4K, 8K, 16K, ... (none under 4K), as the paper scores its 64K
  # and 128K models (Tables 2 and 5)
  lengths: {_v(eval_lengths(d["seq_len"]))}
  tasks: null   # RULER's 13 tasks (docs/evaluation.md)
{_eval_exclude(exclude)}
"""


def init_config(
    model: str,
    seq_len: int,
    gpus: int,
    mode: str = "anchor",
    out: str | None = None,
    gpu_mem_gb: float = 80.0,
    host_mem_gb: float = 512.0,
    gpus_per_node: int = 8,
    force: bool = False,
    tokenizer: str | None = None,
    data: str | None = None,
) -> tuple[Path, Config, Layout]:
    """Write the config; (its path, the config as written, the layout chosen). `data`: the corpus (`data.path`,
    checked to hold input files now), else SlimPajama from the hub."""
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: expected at least 1 GPU")
    if gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {gpus_per_node}: expected at least 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise UserError(f"--gpus {gpus}: more than one node needs a multiple of --gpus-per-node {gpus_per_node}")
    if seq_len < 1024 or seq_len % 1024:
        raise UserError(f"--seq-len {seq_len}: expected a multiple of 1024 (e.g. 65536)")
    if mode not in MODES:
        raise UserError(f"--mode {mode}: expected one of {', '.join(MODES)}")
    memory = Budget(
        option_gb_to_bytes(gpu_mem_gb, "--gpu-mem"),
        option_gb_to_bytes(host_mem_gb, "--host-mem"),
        f"{gpu_mem_gb:g} GB per GPU and of {host_mem_gb:g} GB per node",
    )
    base = base_model(model)
    per_node = min(gpus, gpus_per_node)
    name = f"{base.stem}_{seq_len // 1024}k_{mode}"
    path = Path(out or f"{name}.yaml")
    if path.exists() and not force:
        raise UserError(f"{path} exists; choose another --out or pass --force to overwrite it")
    theta, why_theta = rope_base(base.positions.rope_theta, seq_len)
    command = init_command(model, seq_len, gpus, mode, gpu_mem_gb, host_mem_gb, gpus_per_node, tokenizer, data)
    tokenizer, why_tokenizer = choose_tokenizer(base, tokenizer)
    # planned within the share of memory under which `train` starts without a memory warning
    budget = memory.planned()
    if data:
        try:
            resolve_local_files(data, DataConfig.model_fields["hub_split"].default, 0)
        except UserError as e:
            raise UserError(str(e).replace(f"data.path = '{data}'", f"--data {data}")) from None
    engine, why_engine = attention_engine(base)
    recipe = _recipe(base, seq_len, per_node, mode, name, theta, tokenizer, data, engine)
    layout, tried = choose_layout(recipe, base.shape, budget, gpus)
    raw = _with_layout(recipe, layout, gpus)
    raw, layout, why_checkpointing, moved = choose_checkpointing(raw, layout, base.shape, budget, gpus)
    text = render(
        base,
        raw,
        layout,
        why_theta,
        why_checkpointing,
        moved,
        budget,
        tried,
        why_tokenizer,
        wandb_mode(),
        paper_exclude(base),
        command,
        why_engine,
    )
    cfg = validate(load_yaml(text), str(path))  # what is written is what was planned, checked as train would
    RunPlan.of(cfg)
    kv_replication(base.shape.heads, base.shape.kv_heads, layout.sequence_parallel, str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        raise UserError(f"--out {path}: cannot write the config ({e.strerror})") from None
    return path, cfg, layout


def init_command(
    model: str,
    seq_len: int,
    gpus: int,
    mode: str,
    gpu_mem_gb: float,
    host_mem_gb: float,
    gpus_per_node: int,
    tokenizer: str | None,
    data: str | None,
) -> str:
    """The `lctrain init` command line with every option the plan depends on, the memory sizes among them: rerun on
    another machine, the defaults (80 GB GPUs) would plan another layout."""
    words = [
        "lctrain init",
        f"--model {quote(model)}",
        f"--seq-len {seq_len}",
        f"--gpus {gpus}",
        f"--mode {mode}",
        f"--gpu-mem {gpu_mem_gb:g}",
        f"--host-mem {host_mem_gb:g}",
        f"--gpus-per-node {gpus_per_node}",
    ]
    words += [f"--tokenizer {quote(tokenizer)}"] if tokenizer else []
    words += [f"--data {quote(data)}"] if data else []
    return " ".join(words)


def summary(path: Path, cfg: Config, layout: Layout) -> str:
    """The line `lctrain init` prints: the layout, the batch, named as a departure from the paper's where it is one
    (its tokens per step at the paper's learning rate), and the disk the run's outputs take (`disk.plan_disk`)."""
    t = cfg.train
    batch = f"{t.global_batch} windows per step x {t.steps} steps"
    if t.global_batch != PAPER_WINDOWS_PER_STEP:
        dp = ParallelLayout(cfg.parallel.world, layout.sequence_parallel).dp
        batch += (
            f" ({cfg.tokens_per_step:,} tokens per step at the paper's lr {t.lr:g}: the paper's "
            f"{PAPER_WINDOWS_PER_STEP} windows raised to a multiple of {dp} data-parallel replicas)"
        )
    else:
        batch += " (the paper's batch)"
    peak = plan_disk(cfg, model_shape(cfg).param_count()).total
    return (
        f"wrote {path}: {layout.described()}, {layout.device_bytes / GB:.1f} GB planned per GPU; {batch}; "
        f"{peak / GB:,.1f} GB of checkpoints and exports on the disk at the run's peak; "
        f"next: lctrain show-config -c {quote(str(path))}, lctrain prepare -c {quote(str(path))}, lctrain train -c "
        f"{quote(str(path))}"
    )
