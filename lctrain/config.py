"""The typed configuration tree: YAML load, `base:` inheritance, `--set a.b=c` overrides, validation, fingerprints.

Every stage takes a `Config`. A config file may name a `base:` config (a bundled name or a path, relative to the
file) whose values it overrides key by key; that keeps the Table 1 configs short and their differences visible.
"""

from __future__ import annotations

import hashlib
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lctrain.errors import UserError

DEFAULT_CONFIG = "tiny_anchor"
DOMAINS = ("CommonCrawl", "C4", "GitHub", "ArXiv", "Book", "Wikipedia", "StackExchange", "other")


_NUMBER_TYPES = (int, float, int | None, float | None)


def check_domain_shares(shares: Any) -> None:
    """A target token share per known domain: finite, non-negative, summing to 1 up to rounding to whole percents
    (0.5% per share given, so Table 1's rounded 58/20/7/6/5/4/2 = 102% passes, as does Table 9's 99.98%)."""
    if not isinstance(shares, dict) or not shares:
        raise ValueError("expected a mapping of domain -> token share, e.g. {CommonCrawl: 0.6, C4: 0.4}")
    for domain, share in shares.items():
        if domain not in DOMAINS:
            raise ValueError(f"unknown domain {domain!r}; known domains: {', '.join(DOMAINS)}")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) or share < 0:
            raise ValueError(f"{domain} = {share!r}: a share is a number >= 0 (e.g. 0.58 for 58%)")
    total = sum(shares.values())
    tolerance = 0.005 * len(shares)
    if abs(total - 1.0) > tolerance:
        raise ValueError(
            f"the shares sum to {total:.4g}; they must sum to 1 (within {tolerance:.3g} for "
            f"{len(shares)} shares rounded to whole percents)"
        )


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, data: Any) -> Any:
        # pydantic's lax mode reads `true` as 1 for a number field; `--set train.steps=true` is a mistake, not 1 step
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if isinstance(data.get(name), bool) and field.annotation in _NUMBER_TYPES:
                    raise ValueError(f"{name} = {data[name]} is a boolean; expected a number")
        return data


class SyntheticConfig(_Section):
    """A seeded generator of SlimPajama-like documents (7 domains, long-tailed lengths)."""

    num_docs: int = Field(2000, ge=1)
    median_words: int = Field(300, ge=1)
    max_words: int = Field(200_000, ge=1)
    long_doc_fraction: float = Field(0.01, ge=0.0, le=1.0)


class DataConfig(_Section):
    source: Literal["synthetic", "hub", "local"] = "synthetic"
    path: str | None = None
    hub_name: str = "cerebras/SlimPajama-627B"
    hub_split: str = "train"
    tokenizer: str = "builtin:mistral-7b-v0.1"
    anchor: str = Field(
        "auto",
        min_length=1,
        description="the token that starts every segment and every prompt: bos, eos, one token of the vocabulary "
        "(e.g. '<|endoftext|>'), or auto = the tokenizer's BOS if it puts it before every text (Llama, Mistral, "
        "Llama-3), else <|endoftext|> if the vocabulary has it (Qwen, SmolLM2), else EOS; a BOS the tokenizer does "
        "not add to plain text is a chat marker (SmolLM2's <|im_start|>), not what a base model saw between "
        "documents",
    )
    seq_len: int = Field(1024, ge=8)
    token_budget: int = Field(2_000_000, ge=1)
    mixture: Literal["slimpajama", "upsampled"] = "slimpajama"
    domain_shares: dict[str, float] | None = Field(
        None, description="upsampled: target token share per domain; None = the paper's UpSampledMix-128K (Table 9)"
    )
    short_doc_tokens: int = Field(4096, ge=1)
    down_sample_ratio: float = Field(0.1, ge=0.0, le=1.0)
    domain_tags: bool = False
    interleave_chunks: bool = False
    min_doc_tokens: int = Field(1, ge=1)
    seed: int = 0
    num_workers: int = Field(0, ge=0, description="tokenizer processes; 0 = all cores")
    output_dir: str | None = None
    strict: bool = False
    shuffle_buffer_tokens: int = Field(
        16_777_216, ge=0, description="documents are shuffled through a seeded buffer of this many tokens"
    )
    shard_tokens: int = Field(
        1 << 28,
        ge=1,
        description="tokens per Arrow shard of the prepared dataset (4 bytes each); an interrupted prepare resumes "
        "from its last complete shard",
    )
    synthetic: SyntheticConfig = SyntheticConfig()

    @model_validator(mode="after")
    def _source_needs_path(self):
        if self.source == "local" and not self.path:
            raise ValueError("data.path is required when data.source is 'local'")
        return self

    @field_validator("domain_shares", mode="before")
    @classmethod
    def _shares_are_a_distribution(cls, shares: Any) -> Any:
        if shares is not None:
            check_domain_shares(shares)
        return shares

    @model_validator(mode="after")
    def _shares_need_the_upsampled_mixture(self):
        if self.domain_shares is not None and self.mixture != "upsampled":
            raise ValueError(
                "domain_shares sets the targets of mixture 'upsampled'; the 'slimpajama' mixture keeps "
                "the source's own shares (set data.mixture=upsampled)"
            )
        return self


class ModelConfig(_Section):
    name_or_path: str | None = None
    arch: dict[str, Any] | None = None
    rope_theta: float | None = Field(
        None,
        gt=0,
        description="RoPE base; None keeps a pretrained model's own (model.arch: the paper's Table 1 base for "
        "data.seq_len, unless the arch sets one)",
    )
    rope_scaling: dict[str, Any] | None = Field(
        None,
        description="RoPE scaling (rope_type: linear, dynamic, yarn, llama3, ... or lctrain's static ntk, with its "
        "parameters); None keeps the model's own",
    )
    max_position_embeddings: int | None = Field(
        None,
        ge=1,
        description="the model's context length; None keeps the model's own, raised to data.seq_len if smaller",
    )
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    gradient_checkpointing: bool = False
    rope_fp32: bool = False
    tiled_mlp: Literal["auto"] | int = Field(
        0,
        description="run each decoder MLP in this many sequence shards with DeepSpeed's TiledMLP (0 = off; "
        "'auto' = ceil(tokens per rank / hidden_size), the largest over the ranks)",
    )
    offload_activations: bool = Field(
        False,
        description="keep the checkpointed hidden states in host memory between forward and backward "
        "(DeepSpeed's checkpoint offload; needs gradient_checkpointing)",
    )

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _tiled_mlp_is_a_count(cls, value: Any) -> Any:
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError("expected 0 (off), a number of shards >= 1, or auto")
        return value

    @model_validator(mode="after")
    def _one_source(self):
        if (self.name_or_path is None) == (self.arch is None):
            raise ValueError("set exactly one of model.name_or_path (hub name or directory) and model.arch")
        return self

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self):
        if self.offload_activations and not self.gradient_checkpointing:
            raise ValueError(
                "offload_activations moves the hidden states that gradient checkpointing keeps, so it "
                "needs model.gradient_checkpointing=true"
            )
        return self


class AttentionConfig(_Section):
    mode: Literal["full", "intra_doc", "intra_doc_reset", "anchor"] = "anchor"
    engine: Literal["auto", "sdpa", "flex", "varlen", "reference"] = "auto"


class TrainConfig(_Section):
    steps: int = Field(2000, ge=1)
    global_batch: int = Field(8, ge=1)
    micro_batch: int = Field(1, ge=1)
    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    decay_norms_and_biases: bool = Field(
        False, description="also decay norm weights and biases (the paper's released code decays every parameter)"
    )
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    grad_clip: float = Field(1.0, ge=0)
    torch_adam: bool = Field(
        False,
        description="torch's AdamW also where DeepSpeed's CPU Adam would run (an offloaded optimizer on a GPU): "
        "no C++ op to build, a slower host step, and host memory for its out-of-place temporaries",
    )
    run_dir: str | None = None


class ParallelConfig(_Section):
    nproc_per_node: int = Field(1, ge=1)
    num_nodes: int = Field(1, ge=1)
    hostfile: str | None = None
    sequence_parallel: int = Field(1, ge=1)
    zero_stage: int = Field(2, ge=0, le=3)
    offload_optimizer: bool = False
    offload_params: bool = False
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    launcher: Literal["deepspeed", "torchrun"] = "deepspeed"


class CheckpointConfig(_Section):
    every_steps: int = Field(100, ge=1)
    keep: int = Field(2, ge=1)
    hf_every: int = Field(10, ge=1)
    hf_last: int = Field(50, ge=0)
    save_final: bool = Field(True, description="a resume checkpoint after the last step (off for throughput runs)")


class LoggingConfig(_Section):
    wandb: Literal["disabled", "offline", "online"] = "disabled"
    wandb_project: str = "lctrain"
    log_every: int = Field(1, ge=1)
    peak_tflops: float | None = Field(
        None, gt=0, description="per-device peak for MFU; None: known GPU or measured CPU"
    )


class EvalConfig(_Section):
    lengths: list[int] = [4096, 8192, 16384, 32768, 65536, 131072]
    tasks: list[str] | None = Field(None, description="RULER tasks to score; None = all 13")
    exclude: list[str] = Field([], description="tasks left out (the paper's Llama-2: niah_multikey_3, cwe)")
    samples_per_task: int = Field(25, ge=1)
    ruler_data: str | None = Field(None, description="RULER's prepared data (<length>/data/<task>/validation.jsonl)")
    squad_path: str | None = Field(None, description="SQuAD JSON for the offline suite's qa_1")
    hotpotqa_path: str | None = Field(None, description="HotpotQA JSON for the offline suite's qa_2")
    seed: int = 0
    ppl_windows: int = Field(8, ge=0, description="held-out windows scored for perplexity; 0 = skip")

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
    def _known_tasks(self):
        from lctrain.eval.ruler import TASK_NAMES

        for key, names in (("tasks", self.tasks or []), ("exclude", self.exclude)):
            unknown = [t for t in names if t not in TASK_NAMES]
            if unknown:
                raise ValueError(f"{key}: unknown task(s) {', '.join(unknown)}; RULER's tasks: {', '.join(TASK_NAMES)}")
        return self


class Config(_Section):
    name: str = "run"
    description: str = ""
    seed: int = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig(arch={"model_type": "llama"})
    attention: AttentionConfig = AttentionConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    source_file: str | None = Field(None, description="where this config was loaded from (set by the loader)")
    workdir: str | None = Field(
        None,
        description="the directory relative paths in this config resolve against; None = the current one. A run "
        "directory's config.yaml records where `lctrain train` ran, so the run resumes from anywhere",
    )

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
    candidates = []
    if relative_to is not None:
        candidates.append(relative_to / name_or_path)
    candidates.append(Path(name_or_path))
    stem = name_or_path[:-5] if name_or_path.endswith(".yaml") else name_or_path
    candidates.append(bundled_config_dir() / f"{stem}.yaml")
    for c in candidates:
        if c.is_file():
            return c
    raise UserError(
        f"config '{name_or_path}' not found (neither a file nor a bundled config); "
        f"run 'lctrain configs' to list the bundled ones"
    )


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        keys = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in keys:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark
                )
            keys.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml.load(path.read_text(encoding="utf-8-sig"), Loader=_StrictLoader)  # a UTF-8 BOM is fine
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
_REPLACED_WHOLE = ("arch", "rope_scaling", "domain_shares")


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in _REPLACED_WHOLE:
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
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
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
        node[keys[-1]] = value
    return raw


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _format_validation_error(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = tuple(p for p in e["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    if e["type"] == "extra_forbidden":
        allowed = ", ".join(k for k in _allowed_keys(Config, loc) if k not in NOT_SETTINGS)
        return f"{source}: unknown key '{key}'; allowed keys here: {allowed}"
    if e["type"] == "literal_error":
        return f"{source}: {key} = {e.get('input')!r} is not allowed; expected {e['ctx']['expected']}"
    msg = e["msg"].removeprefix("Value error, ")
    if isinstance(e.get("input"), dict):
        return f"{source}: {key}: {msg}"
    if loc:
        return f"{source}: {key} = {e.get('input')!r}: {msg}"
    return f"{source}: {msg}"


def validate(raw: dict, source: str = "<config>") -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise UserError(_format_validation_error(err, source)) from None


def load_config(name_or_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a config by path or bundled name (default: the embedded tiny CPU config), apply overrides, validate."""
    path = _locate(name_or_path or DEFAULT_CONFIG)
    raw = apply_overrides(_load_raw(path), overrides)
    raw.pop("source_file", None)
    cfg = validate(raw, source=str(path))
    cfg.source_file = str(path)
    return cfg


def with_overrides(cfg: Config, overrides: list[str] | tuple[str, ...], why: str) -> Config:
    """`cfg` with `--set`-style overrides applied and validated again (a stage deriving the config it runs: a measured
    point, a sequence-parallel check); `why` names the derivation in error messages. Keeps `source_file` and
    `workdir`."""
    raw = apply_overrides(settings(cfg), overrides)
    derived = validate(raw, f"{cfg.source_file or 'config'} ({why})")
    derived.source_file, derived.workdir = cfg.source_file, cfg.workdir
    return derived


# ---------------------------------------------------------------- fingerprints and resolved output

# Fields that change how a stage runs but not what it produces.
_DATA_FIELDS_NOT_IN_FINGERPRINT = ("num_workers", "output_dir", "strict", "shard_tokens")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def settings(cfg: Config) -> dict:
    """The run's settings as JSON values: what fingerprints, checkpoints and comparisons see."""
    return cfg.model_dump(mode="json", exclude=set(NOT_SETTINGS))


def config_fingerprint(cfg: Config) -> str:
    return _digest(settings(cfg))


def data_fingerprint(data: DataConfig) -> str:
    return _digest(data.model_dump(mode="json", exclude=set(_DATA_FIELDS_NOT_IN_FINGERPRINT)))


def data_dir(cfg: Config) -> Path:
    """Where the prepared dataset of this config lives: `data.output_dir`, else one directory per data fingerprint,
    so configs that differ only in training settings share one prepared dataset."""
    if cfg.data.output_dir:
        return cfg.resolve_path(cfg.data.output_dir)
    return cfg.resolve_path("prepared") / data_fingerprint(cfg.data)[:12]


def reread_warning(cfg: Config, windows: int) -> str | None:
    """One line when training reads more windows (`train.steps` x `train.global_batch`) than `windows` hold, else
    None. Reading runs through the windows in order (train/data.py), so the re-read windows are the last steps',
    which hold every evaluation checkpoint."""
    needed = cfg.train.steps * cfg.train.global_batch
    if needed <= windows:
        return None
    seq_len = cfg.data.seq_len
    rereading_steps = cfg.train.steps - windows // cfg.train.global_batch
    return (
        f"warning: {cfg.train.steps:,} steps x {cfg.train.global_batch} windows x {seq_len:,} tokens = "
        f"{needed * seq_len:,} tokens, {(needed - windows) * seq_len:,} more than the data has ({windows:,} "
        f"windows, {windows * seq_len:,} tokens): the last {rereading_steps:,} steps re-read windows; set "
        f"data.token_budget={needed * seq_len} (and prepare again) or lower train.steps"
    )


def run_dir(cfg: Config) -> Path:
    return cfg.resolve_path(cfg.train.run_dir) if cfg.train.run_dir else cfg.resolve_path("runs") / cfg.name


def to_yaml(
    cfg: Config,
    used: dict[str, Any] | None = None,
    notes: list[str] | tuple[str, ...] = (),
    *,
    workdir: bool = False,
) -> str:
    """The config as YAML; `used` replaces values by dotted key (what a null or `auto` resolves to: `show-config`)
    and `notes` become comment lines after the header. With `workdir`, also where its relative paths resolve (a run
    directory's copy). The fingerprint is the config's own."""
    tree = settings(cfg)
    for key, value in (used or {}).items():
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node[section]
        node[name] = value
    body = yaml.safe_dump(tree, sort_keys=False)
    if workdir:
        body += yaml.safe_dump({"workdir": str(Path(cfg.workdir or ".").absolute())})
    header = "".join(f"# {line}\n" for line in notes)
    return f"# resolved lctrain config; fingerprint {config_fingerprint(cfg)}\n{header}{body}"


def write_resolved(cfg: Config, directory: Path, filename: str = "config.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / filename
    out.write_text(to_yaml(cfg))
    return out
