"""Memory of one training rank, in bytes, before anything is launched: `lctrain plan` and `train`'s preflight.

Itemised, each item on the accelerator ("device") or in host memory ("host"):

- model states (ZeRO, Rajbhandari et al. 2020): model-dtype weights, gradients, fp32 master weights and the two fp32
  Adam moments (without ZeRO and under ZeRO-1 the gradients are `param.grad`, made during the backward: kind
  `gradient`, below). ZeRO-1 shards the master weights and moments over all ranks, ZeRO-2 also the gradients, ZeRO-3
  also the weights; `offload_optimizer` moves master weights, moments and fp32 gradient partition to the host,
  `offload_params` the ZeRO-3 weight shard. DeepSpeed 0.19.8 (stage_1_and_2.py) keeps ZeRO-1's gradients in full in
  `param.grad` until the step and copies this rank's partition to fp32 there; a bf16 run's ZeRO-1 (fp32 gradient
  accumulation, no offload) runs DeepSpeed's BF16_Optimizer instead, which also keeps an fp32 copy of every gradient
  on every rank, not of this rank's partition (`runs_bf16_optimizer`);
- activations: with activation checkpointing one hidden state per layer (in host memory with
  `offload_activations`), plus under `selective` checkpointing each layer's attention output and log-sum-exp (and
  under `selective_matmul` every projection's output: `kept_bytes`), else every layer's saved tensors
  (`layer_saved_bytes`: what autograd keeps of a Hugging Face Llama decoder layer run through an lctrain engine,
  counted with `saved_tensors_hooks`); the `reference` engine's dense scores and masks (`reference_scores`);
- the backward peak of one layer: its forward recomputed under checkpointing (the MLP's intermediates for the rank's
  tokens or for one `tiled_mlp` shard); the layer's gradients reuse what its freed saved tensors held (measured on
  CPU, tests/test_memory.py), so they add nothing of their own;
- the loss chunk's logits (train/loss.py): fp32 log-probabilities and their gradients for one chunk, in the loss's
  forward (`train.loss_gradients=forward`, with several chunks: beside the gradients it holds until the backward,
  lm_head's in fp32 and the hidden states') or at the start of the backward (`recompute`: with several chunks,
  lm_head's gradient from the first chunk's backward beside the next one's);
- the optimizer step's own tensors (ZeRO-3's flattened fp32 gradients, torch AdamW's out-of-place denominator), and
  under ZeRO-3 with an offloaded optimizer the second fp32 gradient buffer, the page-locked buffers' rounding to a
  power of two (`pinned_bytes`) and the unpinned copy DeepSpeed pins the gradient partition from, once all other
  states exist;
- DeepSpeed's buffers, sized by the DeepSpeed config the layout builds (DeepSpeed's defaults where it sets none):
  the contiguous-gradient reduce bucket (ZeRO >= 1, in fp32 under sequence parallelism; DeepSpeed 0.19.8 sometimes
  holds the last step's bucket while it allocates the next, one bucket more, which the WARN_FRACTION margin is for)
  and, under ZeRO-3, the parameters gathered at once;
- a fixed runtime overhead per process (`DEVICE_RUNTIME_BYTES`, `HOST_RUNTIME_BYTES`).

States add up. The transients (a layer's recomputation, a loss chunk) happen at different moments of the backward, so
only the largest adds to the saved activations. The `param.grad` gradients appear during the backward while the
saved activations are freed, so they add to the transients at its end, not to the saved activations at its start
(the loss's backward, where a long window peaks), except what the first layer saved, which its backward, the last,
still needs; the optimizer step comes after the backward has freed the activations, and the construction's copy
before either, so the peak is the states plus the largest of the four (`MemoryPlan.total`). On the CPU the host's
allocator keeps some freed memory (`CPU_ALLOCATOR_FRACTION`). A plan is held to `WARN_FRACTION` of each memory
(`Budget.planned`).

Sequence parallelism divides the tokens of every per-token tensor by `sp`, except inside the attention engine, where
DeepSpeed-Ulysses' all-to-all gives each rank the whole sequence for `heads / sp` heads: the same number of elements,
held beside the local copies the projections keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lctrain.activation_checkpointing import keeps_attention
from lctrain.config import Config, with_overrides
from lctrain.costmodel import ModelShape
from lctrain.errors import UserError
from lctrain.model import auto_mlp_shards, training_mlp_rows
from lctrain.parallel.layout import ParallelLayout, kv_replication
from lctrain.search import longest_fitting
from lctrain.train.deepspeed_config import deepspeed_config, uses_torch_adam
from lctrain.train.loss import DEFAULT_CHUNK_TOKENS, positions_per_chunk
from lctrain.train.runplan import RunPlan
from lctrain.units import GiB

# The CUDA context (about 0.5 GB on Hopper with lazy module loading), cuBLAS workspaces and the NCCL communicators'
# buffers: device memory a training process holds outside PyTorch's allocator.
DEVICE_RUNTIME_BYTES = GiB
# The process itself in host memory: Python, the code and CPU-side state of torch, transformers and DeepSpeed (the RSS
# of a process that has imported them and built a tiny model is about 1 GB).
HOST_RUNTIME_BYTES = GiB
# On the CPU, memory glibc's malloc keeps after tensors are freed: blocks below its mmap threshold (which grows to 32
# MiB) go back to its heap, not to the OS, so the resident set stays above the live tensors. Measured on SmolLM2-135M
# (fp32, 1K-2K tokens, with and without checkpointing; tests/test_memory_real_model.py, docs/memory.md): 0.5-1.3 GB
# above the tensors' peak and the process's own 0.5 GB, 12-30% of the tensors' peak. HOST_RUNTIME_BYTES covers 0.57
# GB of it; this fraction of the tensors' peak the rest (the host need then within -2%..+9% of the measured peak).
CPU_ALLOCATOR_FRACTION = 0.1
# Fraction of the memory a plan is held to (`Budget.planned`: `plan`'s FITS, its fixes and longest seq_len, `init`'s
# layouts) and above which `train` warns: PyTorch's caching allocator fragments, so a plan this close to the limit may
# still run out of memory.
WARN_FRACTION = 0.9
FP32 = 4
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# Kinds of item: model states live through the step; parameter gradients are made during the backward, as the
# activations are freed, and live until the step; saved activations from the forward to their layer's backward, those
# of the first layer until the backward's end (its backward comes last, beside nearly all gradients); the loss chunk's
# logits at the backward's start; a transient within one phase of the backward (a layer recomputed); the gradients'
# reduction after the backward (beside all gradients, once the activations are freed); what the optimizer step
# allocates (after the backward); and a copy made while the engine is built (beside the states, before any step).
STATE, GRAD, SAVED, SAVED_TO_END, LOSS, TRANSIENT, REDUCE, STEP, BUILD = (
    "state",
    "gradient",
    "saved",
    "saved to end",
    "loss",
    "transient",
    "reduce",
    "step",
    "build",
)


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    where: str  # "device" or "host"
    kind: str = STATE


@dataclass(frozen=True)
class MemoryPlan:
    """The items of one rank, and how many ranks share one host."""

    items: tuple[Item, ...]
    ranks_per_host: int

    def total(self, where: str) -> int:
        """Peak bytes in `where`: the states, and the largest of the backward's start (the saved activations and the
        largest of the loss chunk and a transient; no parameter has its gradient yet), the backward's end (every
        gradient and the larger of a transient beside what the first layer saved, and the reduction's copy; the other
        activations are freed), the optimizer step's (the gradients and its items) and the engine construction's
        copies. Within the backward the gradients grow by a layer's parameters as the activations shrink by a layer's,
        so the largest sum is at one of its ends (measured on SmolLM2-135M on CPU, tests/test_memory_real_model.py:
        its 2K-token step peaks in the loss's backward, before any gradient)."""
        here = [i for i in self.items if i.where == where]

        def largest(*kinds: str) -> int:
            return max((i.bytes for i in here if i.kind in kinds), default=0)

        def summed(kind: str) -> int:
            return sum(i.bytes for i in here if i.kind == kind)

        start = summed(SAVED) + summed(SAVED_TO_END) + largest(LOSS, TRANSIENT)
        end = summed(GRAD) + max(summed(SAVED_TO_END) + largest(TRANSIENT), summed(REDUCE))
        step = summed(GRAD) + summed(STEP)
        return summed(STATE) + max(start, end, step, largest(BUILD))

    def cpu_allocator_bytes(self) -> int:
        """What the host's allocator keeps of freed tensors when this rank computes on the CPU."""
        return int(CPU_ALLOCATOR_FRACTION * (self.total("device") + self.total("host")))

    def host_bytes(self) -> int:
        """Host memory of this host's ranks: their host items and each process's runtime."""
        return self.ranks_per_host * (self.total("host") + HOST_RUNTIME_BYTES)


@dataclass(frozen=True)
class Budget:
    """Memory to plan against: `device` bytes per accelerator, or None when the ranks compute on the host's CPU
    (then every item lands in host memory); `host` bytes of one host."""

    device: int | None
    host: int
    label: str

    @property
    def gpu(self) -> bool:
        return self.device is not None

    def need(self, plan: MemoryPlan) -> tuple[int, int]:
        """(bytes needed on one device, bytes needed on one host), runtime overheads included."""
        return need(plan, self.gpu)

    def fits(self, plan: MemoryPlan) -> bool:
        return not self.over(plan)

    def over(self, plan: MemoryPlan) -> list[str]:
        """The memories `plan` needs more of than this budget holds: "device", "host", both or none."""
        device, host = self.need(plan)
        sizes = (("device", device, self.device), ("host", host, self.host))
        return [where for where, n, size in sizes if size is not None and n > size]

    def planned(self) -> Budget:
        """The share of this memory a plan is held to: WARN_FRACTION of the device's and of the host's."""
        device = None if self.device is None else int(WARN_FRACTION * self.device)
        return Budget(device, int(WARN_FRACTION * self.host), f"{WARN_FRACTION:.0%} of {self.label}")


def need(plan: MemoryPlan, gpu: bool) -> tuple[int, int]:
    """(bytes needed on one device, bytes needed on one host) by `plan`, runtime overheads included; on the CPU
    (`gpu` False) every item lands in host memory and the device needs 0."""
    host = plan.host_bytes()
    if not gpu:
        return 0, host + plan.ranks_per_host * (plan.total("device") + plan.cpu_allocator_bytes())
    return plan.total("device") + DEVICE_RUNTIME_BYTES, host


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype]


def layer_saved_bytes(shape: ModelShape, tokens: int, mlp_tokens: int, b: int, scores: int = 0) -> int:
    """What autograd keeps of one Llama decoder layer over `tokens` tokens, `mlp_tokens` of them through the MLP
    (0 under TiledMLP, which keeps only its input). Per token: each RMSNorm its fp32 input, fp32 inverse norm and
    normed output; the projections' inputs; the engine's q and k, v (repeated to all heads), output and fp32
    log-sum-exp; o_proj's input; the MLP's gate, up, activation and their product. The `reference` engine (`scores`
    elements of dense scores, `reference_scores`) keeps q, k and v for its two matmuls, and its softmax's fp32 output
    and that output's copy in the model's dtype (the same tensor in fp32) instead of an output and log-sum-exp."""
    norms = 2 * (shape.hidden * (FP32 + b) + FP32)
    projections = 2 * shape.hidden * b
    if scores:
        attention = 3 * shape.width * b
        dense = scores * (FP32 + (b if b != FP32 else 0))
    else:
        attention, dense = 5 * shape.width * b + shape.heads * FP32, 0
    return tokens * (norms + projections + attention) + mlp_tokens * 4 * shape.intermediate * b + dense


def kept_bytes(shape: ModelShape, tokens: int, b: int, mode: str, scores: int = 0, attention_kept: bool = True) -> int:
    """What selective checkpointing (lctrain/activation_checkpointing.py) keeps of one layer beyond its input: the
    attention kernel's output and fp32 log-sum-exp; with `selective_matmul` also every projection's output (q, k, v,
    o, gate, up, down). The `reference` engine (`scores` elements of dense scores) has no kernel to keep: `selective`
    keeps nothing of its attention, `selective_matmul` its two matmuls' outputs (the scores and the weighted
    values). `attention_kept` false (flex's compiled kernel, `activation_checkpointing.keeps_attention`): nothing
    of the attention."""
    if mode not in ("selective", "selective_matmul"):
        return 0
    if scores:
        kept = 0 if mode == "selective" else (scores + tokens * shape.width) * b
    elif attention_kept:
        kept = tokens * (shape.width * b + shape.heads * FP32)
    else:
        kept = 0
    if mode == "selective_matmul":
        kept += tokens * (shape.width + 2 * shape.kv_width + 2 * shape.hidden + 2 * shape.intermediate) * b
    return kept


def reference_scores(shape: ModelShape, cfg: Config, layout: ParallelLayout) -> int:
    """Elements of one layer's attention scores on a rank under the `reference` engine, which builds them dense:
    micro_batch x heads / sp x seq_len x seq_len (Ulysses gives each rank the whole sequence for its heads); 0 for
    the other engines, whose kernels never hold them."""
    if cfg.attention.engine != "reference":
        return 0
    return cfg.train.micro_batch * shape.heads // layout.sp * cfg.data.seq_len**2


def logits_bytes(shape: ModelShape, tokens: int, b: int, chunked: bool) -> int:
    """One loss chunk: fp32 log-probabilities, their gradient and the logits' fp32 gradient; when the loss runs in
    several chunks, beside lm_head's logits in the model's dtype, which both chunked losses hold while a chunk's
    gradients are computed (one chunk's frees them after the softmax; measured, tests/test_loss_gradients.py)."""
    return tokens * shape.vocab * (3 * FP32 + (b if chunked else 0))


def loss_items(shape: ModelShape, cfg: Config, seq_tokens: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[Item]:
    """What the loss of one micro-batch holds (train/loss.py), `seq_tokens` positions of each window on this rank:
    a chunk's logits, and with several chunks the gradients made before the backward reaches lm_head."""
    b = dtype_bytes(cfg.model.dtype)
    micro_batch = cfg.train.micro_batch
    per_chunk = positions_per_chunk(micro_batch, seq_tokens, chunk_tokens)
    logits = logits_bytes(shape, micro_batch * per_chunk, b, chunked=per_chunk < seq_tokens)
    head = shape.vocab * shape.hidden
    if per_chunk == seq_tokens:
        return [Item("loss chunk logits", logits, "device", LOSS)]
    # the hidden states' gradient, whole beside the last chunk's logits (recompute) or from the forward on
    hidden_grad = Item(
        "hidden states' gradient from the loss", micro_batch * seq_tokens * shape.hidden * b, "device", SAVED
    )
    if cfg.train.loss_gradients == "forward" and cfg.model.fused_kernels != "liger":
        # the loss's forward computes the gradients and holds them until its backward: lm_head's summed in fp32; each
        # chunk's own lm_head gradient exists beside its logits
        return [
            Item("loss chunk logits and lm_head gradient", logits + head * b, "device", LOSS),
            Item("lm_head gradient from the loss's forward", head * FP32, "device", SAVED),
            hidden_grad,
        ]
    items = [Item("loss chunk logits", logits, "device", LOSS), hidden_grad]
    if cfg.parallel.zero_stage < 2:
        # lm_head's gradient exists from the first chunk's backward on, beside the next chunk's logits
        items.append(Item("lm_head gradient during the loss", head * b, "device", SAVED))
    return items


def _zero_settings(ds_config: dict) -> dict:
    """The ZeRO settings DeepSpeed will run with: the layout's, DeepSpeed's defaults for the rest."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**ds_config["zero_optimization"]).model_dump()


def allreduce_elements() -> int:
    """Elements DeepSpeed's engine flattens at once to all-reduce gradients without ZeRO."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

    return MEMORY_OPT_ALLREDUCE_SIZE


def runs_bf16_optimizer(ds_config: dict) -> bool:
    """Whether DeepSpeed 0.19.8 steps with its BF16_Optimizer rather than ZeRO's: bf16 weights with fp32 gradient
    accumulation at ZeRO-1 without optimizer offload (engine.py, `_do_optimizer_sanity_check`). It accumulates every
    gradient in one flat fp32 buffer per parameter group on every rank (bf16_optimizer.py, `fp32_groups_gradients_flat`:
    4 bytes per parameter, where ZeRO's optimizer holds this rank's partition) and all-reduces those buffers in place
    (engine.py, `buffered_allreduce_fallback`), in the communication dtype: no reduce bucket. Measured on two ranks:
    tests/test_memory_ranks.py."""
    zero = ds_config["zero_optimization"]
    return (
        ds_config.get("bf16", {}).get("enabled", False)
        and ds_config.get("data_types", {}).get("grad_accum_dtype") == "fp32"
        and zero["stage"] == 1
        and "offload_optimizer" not in zero
    )


def reduce_element_bytes(ds_config: dict, model_bytes: int) -> int:
    """Bytes per element of DeepSpeed's reduce bucket (of BF16_Optimizer's all-reduce: `runs_bf16_optimizer`): ZeRO's
    own ZeRO-1 accumulates in fp32; ZeRO-2 and 3 and BF16_Optimizer reduce in the communication dtype, which under
    sequence parallelism is `seq_parallel_communication_data_type` (DeepSpeed 0.19.8's engine sets it over
    `communication_data_type`, fp32 by default), else `communication_data_type`, else the model's dtype."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.runtime.config import get_communication_data_type
    from deepspeed.runtime.constants import (
        SEQ_PARALLEL_COMMUNICATION_DATA_TYPE,
        SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT,
    )

    if ds_config["zero_optimization"]["stage"] == 1 and not runs_bf16_optimizer(ds_config):
        return FP32
    if ds_config.get("sequence_parallel_size", 1) > 1:
        dtype = get_communication_data_type(
            ds_config, SEQ_PARALLEL_COMMUNICATION_DATA_TYPE, SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT
        )
    else:
        dtype = get_communication_data_type(ds_config)
    return model_bytes if dtype is None else dtype.itemsize


def optimizer_partition(shape: ModelShape, cfg: Config, world: int) -> tuple[bool, int]:
    """(whether the optimizer steps on the host, the parameters of this rank's optimizer partition)."""
    stage, n = cfg.parallel.zero_stage, shape.param_count()
    return cfg.parallel.offload_optimizer and stage >= 1, n if stage == 0 else math.ceil(n / world)


def pinned_bytes(n: int, gpu: bool) -> int:
    """Host memory of an `n`-byte page-locked buffer: PyTorch's CUDA host allocator rounds every block up to a power
    of two (CachingHostAllocator, PowerOf2Ceil), so 27 GB of fp32 gradients take 34.4 GB."""
    return 1 << (n - 1).bit_length() if gpu and n > 0 else n


def model_state_items(
    shape: ModelShape, cfg: Config, world: int, zero: dict, reduce_bytes: int, gpu: bool, bf16_optimizer: bool = False
) -> list[Item]:
    """The model states of one rank (module docstring); `bf16_optimizer`: DeepSpeed steps with its BF16_Optimizer
    (`runs_bf16_optimizer`), `reduce_bytes` being then the bytes per element of its all-reduce."""
    p, stage = cfg.parallel, cfg.parallel.zero_stage
    n = shape.param_count()
    b = dtype_bytes(cfg.model.dtype)
    offloaded, shard = optimizer_partition(shape, cfg, world)
    optimizer_where = "host" if offloaded else "device"
    items = [
        Item(
            "weights" + (" (ZeRO-3 shard)" if stage == 3 else ""),
            n * b // (world if stage == 3 else 1),
            "host" if p.offload_params and stage == 3 else "device",
        )
    ]
    if stage == 0:
        items.append(Item("gradients", n * b, "device", GRAD))
        # DeepSpeed 0.19.8 without ZeRO all-reduces the gradients after the backward, even in one process, through a
        # flattened copy of up to MEMORY_OPT_ALLREDUCE_SIZE elements (engine.py: buffered_allreduce_fallback)
        items.append(Item("gradients flattened for the all-reduce", min(n, allreduce_elements()) * b, "device", REDUCE))
    else:
        if stage == 1:
            items.append(Item("gradients (param.grad until the step)", n * b, "device", GRAD))
        # An offloaded optimizer's host buffers that DeepSpeed page-locks (offload_optimizer.pin_memory): ZeRO-3 its
        # two fp32 gradient buffers (stage3.py: the reduced partitions are copied into the fp32 master's own .grad for
        # the host step); ZeRO-1/2 the fp32 master, its gradient and a model-dtype copy for the upload
        # (stage_1_and_2.py). Each is made unpinned and copied into page-locked memory once the states before it exist.
        locked = gpu and offloaded
        grad_bytes = pinned_bytes(shard * FP32, locked)
        if bf16_optimizer:
            items.append(Item("fp32 gradients (BF16_Optimizer: every parameter's)", n * FP32, "device"))
            if reduce_bytes != FP32:  # each group's buffer cast for its all-reduce: the largest holds nearly all
                items.append(Item("gradients cast for the all-reduce", n * reduce_bytes, "device", REDUCE))
        else:
            items.append(Item("fp32 gradient partition", grad_bytes, optimizer_where))
        if offloaded and stage == 3:
            items.append(Item("fp32 gradients of the host step", grad_bytes, "host"))
        items.append(Item("fp32 master weights", pinned_bytes(shard * FP32, locked and stage < 3), optimizer_where))
        if offloaded and stage < 3:
            items.append(Item("model-dtype partition for the upload", pinned_bytes(shard * b, locked), "host"))
        if locked:
            items.append(Item("unpinned copy while the engine is built", shard * FP32, "host", BUILD))
    items.append(Item("Adam moments (fp32)", 2 * shard * FP32, optimizer_where))
    if stage >= 1 and not bf16_optimizer:
        bucket = zero["reduce_bucket_size"] * reduce_bytes
        items.append(Item("DeepSpeed reduce bucket", bucket, "device"))
        if stage < 3 and zero["overlap_comm"]:
            # ZeRO-1/2 overlapping the reduction fill one bucket while the other is reduced (stage_1_and_2.py)
            items.append(Item("DeepSpeed second reduce bucket (parallel.overlap_comm)", bucket, "device"))
    if stage == 3:
        unit = max(shape.layer_params(), shape.vocab * shape.hidden)  # the largest module gathered whole
        live = min(zero["max_live_parameters"], unit + zero["prefetch_bucket_size"], n)
        items.append(Item("ZeRO-3 gathered parameters", live * b, "device"))
    return items


def optimizer_step_items(shape: ModelShape, cfg: Config, world: int, gpu: bool, torch_adam: bool) -> list[Item]:
    """What the optimizer step allocates for itself (measured on CPU, tests/test_memory.py): ZeRO-3 without optimizer
    offload flattens the rank's gradient partition into one fp32 tensor; torch's AdamW computes its denominator out of
    place, `sqrt(v) / c` per tensor with both alive at once (single-tensor, on the CPU) or `sqrt(v)` for every tensor
    of the group at once (foreach, on a GPU). DeepSpeed's CPU Adam (an offloaded optimizer on a GPU) works in place."""
    stage = cfg.parallel.zero_stage
    offloaded, shard = optimizer_partition(shape, cfg, world)
    where = "host" if offloaded else "device"
    items = []
    if stage == 3 and not offloaded:
        items.append(Item("gradients flattened for the step", shard * FP32, "device", STEP))
    if torch_adam:
        # ZeRO >= 1 steps on one flat partition per parameter group, ZeRO-0 on the model's own tensors
        largest = shard if stage else max(shape.vocab, shape.intermediate) * shape.hidden
        foreach = gpu and not offloaded
        items.append(Item("AdamW temporaries", (shard if foreach else 2 * largest) * FP32, where, STEP))
    return items


def per_layer_items(name: str, per_layer: int, layers: int, where: str) -> list[Item]:
    """`per_layer` saved bytes of each of `layers` layers: the first layer's until the backward's end."""
    rest = [Item(f"{name}, layers 2-{layers}", (layers - 1) * per_layer, where, SAVED)] if layers > 1 else []
    return [*rest, Item(f"{name}, layer 1", per_layer, where, SAVED_TO_END)]


def activation_items(shape: ModelShape, cfg: Config, layout: ParallelLayout) -> list[Item]:
    m = cfg.model
    b = dtype_bytes(m.dtype)
    seq_tokens = cfg.data.seq_len // layout.sp
    tokens = training_mlp_rows(cfg, layout)
    shards = auto_mlp_shards(tokens, shape.hidden) if m.tiled_mlp == "auto" else m.tiled_mlp
    shard_tokens = math.ceil(tokens / shards) if shards else tokens
    # the engine's whole-sequence q, k, v and output under Ulysses, beside the local ones the projections keep
    all_to_all = 4 * tokens * shape.width * b if layout.sp > 1 else 0
    final_norm = tokens * (shape.hidden * (FP32 + b) + FP32)
    items = [*loss_items(shape, cfg, seq_tokens), Item("final norm", final_norm, "device", SAVED)]
    scores = reference_scores(shape, cfg, layout)
    if scores:
        # one boolean [seq_len, seq_len] mask per window, cached in its batch, which the trainer holds for the step
        windows = RunPlan.of(cfg, layout).batches.global_batch // layout.dp
        items.append(Item("reference engine's dense masks", windows * cfg.data.seq_len**2, "device"))
    # a layer's backward through the reference engine's softmax: the fp32 gradients of its output and of its input
    score_grads = 2 * FP32 * scores
    mode = m.checkpointing_mode
    if mode != "none":
        # the recomputed layer's kept tensors are the cached ones, not new allocations
        kept = kept_bytes(shape, tokens, b, mode, scores, keeps_attention(cfg.attention.engine))
        hidden_where = "host" if m.offload_activations else "device"
        items += per_layer_items("checkpointed hidden states", tokens * shape.hidden * b, shape.layers, hidden_where)
        items.append(
            Item(
                "one layer recomputed",
                layer_saved_bytes(shape, tokens, shard_tokens, b, scores) + all_to_all - kept + score_grads,
                "device",
                TRANSIENT,
            )
        )
        if kept:
            items += per_layer_items(f"kept by {mode} checkpointing", kept, shape.layers, "device")
    else:
        stored_mlp = 0 if shards else tokens
        layer = layer_saved_bytes(shape, tokens, stored_mlp, b, scores) + all_to_all
        items += per_layer_items("activations", layer, shape.layers, "device")
        if score_grads:
            items.append(Item("reference engine's score gradients", score_grads, "device", TRANSIENT))
        if shards:
            items.append(
                Item("one MLP shard recomputed", shard_tokens * 4 * shape.intermediate * b, "device", TRANSIENT)
            )
    return items


def plan_memory(cfg: Config, shape: ModelShape, gpu: bool = True) -> MemoryPlan:
    """The memory of one rank of `cfg` (a model of `shape`) on a GPU, or with `gpu=False` on the CPU. Refuses in one
    line, as `train` does, a layout that cannot run: one whose heads do not split over the sequence-parallel ranks."""
    plan = RunPlan.of(cfg)
    layout = plan.layout
    if layout.sp > 1:
        kv_replication(shape.heads, shape.kv_heads, layout.sp, cfg.origin("parallel.sequence_parallel", "model"))
    torch_adam = uses_torch_adam(cfg, gpu)
    ds_config = deepspeed_config(cfg, plan, gpu=gpu)
    items = (
        model_state_items(
            shape,
            cfg,
            layout.world,
            _zero_settings(ds_config),
            reduce_element_bytes(ds_config, dtype_bytes(cfg.model.dtype)),
            gpu,
            runs_bf16_optimizer(ds_config),
        )
        + optimizer_step_items(shape, cfg, layout.world, gpu, torch_adam)
        + activation_items(shape, cfg, layout)
    )
    return MemoryPlan(tuple(items), cfg.parallel.nproc_per_node)


# where the search for the longest window stops: 16M tokens, 128x the paper's longest
SEARCH_LIMIT = 1 << 24


def longest_seq_len(cfg: Config, shape: ModelShape, budget: Budget, limit: int = SEARCH_LIMIT) -> int | None:
    """The longest data.seq_len below `limit`, a multiple of sequence_parallel x 1024, whose plan fits; None if none
    does. One within a step of `limit` (`searched_to_the_limit`) is a lower bound: the search stopped there."""
    step = cfg.parallel.sequence_parallel * 1024

    def fits(seq_len: int) -> bool:
        return budget.fits(
            plan_memory(with_overrides(cfg, [f"data.seq_len={seq_len}"], "longest length"), shape, budget.gpu)
        )

    return longest_fitting(fits, step, limit - 1, step)


def searched_to_the_limit(cfg: Config, longest: int, limit: int = SEARCH_LIMIT) -> bool:
    """Whether `longest_seq_len` stopped at its limit rather than at a window that does not fit."""
    return longest + cfg.parallel.sequence_parallel * 1024 >= limit


SELECTIVE = "model.checkpointing=selective"


@dataclass(frozen=True)
class Candidate:
    """A setting that lowers a rank's memory, as `--set` overrides. Combined, a candidate replaces the earlier one of
    its `group` (one sequence-parallel size, one checkpointing)."""

    overrides: tuple[str, ...]
    group: str


def candidate_fixes(cfg: Config) -> list[Candidate]:
    """Settings that lower a rank's memory from `cfg` as it is, the cheapest in speed first: an attention kernel in
    place of the `reference` engine (faster, and no dense scores), one window per pass, each larger sequence-parallel
    group (no more compute; a rank's all-to-all bytes stay about the same as the group grows), ZeRO-2 (the gradients
    reduce-scattered into partitions during the backward, at every micro-batch under gradient accumulation: bf16's
    ZeRO-1 keeps every gradient twice, `runs_bf16_optimizer`), ZeRO-3 (one more all-gather of the weights per pass,
    overlapped with compute), tiled MLP (one more MLP forward per layer),
    checkpointing selective then full (each layer's forward rerun but for attention, then with it), and the offloads,
    over PCIe: the hidden states, then the optimizer step on the CPU, then the weights in every pass. `fixes` leaves
    out what `cfg`'s checks refuse (a group size that does not divide the heads, the window or the batch)."""
    p, m = cfg.parallel, cfg.model
    world = p.world
    out = [Candidate(("attention.engine=auto",), "engine")] if cfg.attention.engine == "reference" else []
    if cfg.train.micro_batch > 1:
        # the same step in more, smaller passes (at long windows the matmuls stay large)
        out.append(Candidate(("train.micro_batch=1",), "micro_batch"))
    out += [
        Candidate((f"parallel.sequence_parallel={sp}",), "sequence_parallel")
        for sp in range(p.sequence_parallel + 1, world + 1)
        if world % sp == 0
    ]
    if p.zero_stage < 2:
        out.append(Candidate(("parallel.zero_stage=2",), "zero_stage"))
    if p.zero_stage < 3:
        out.append(Candidate(("parallel.zero_stage=3",), "zero_stage"))
    if m.tiled_mlp == 0:
        out.append(Candidate(("model.tiled_mlp=auto",), "tiled_mlp"))
    mode = m.checkpointing_mode
    if mode in ("none", "selective_matmul") and keeps_attention(cfg.attention.engine):
        out.append(Candidate((SELECTIVE,), "checkpointing"))
    if mode != "full":
        # the older switch when the config uses it (with checkpointing named, the two would contradict)
        full = "model.gradient_checkpointing=true" if m.checkpointing is None else "model.checkpointing=full"
        out.append(Candidate((full,), "checkpointing"))
    if not m.offload_activations:
        out.append(Candidate(("model.offload_activations=true",), "offload_activations"))
    if not p.offload_optimizer:
        stage = () if p.zero_stage else ("parallel.zero_stage=1",)
        out.append(Candidate(("parallel.offload_optimizer=true", *stage), "offload_optimizer"))
    if not p.offload_params:
        stage = () if p.zero_stage == 3 else ("parallel.zero_stage=3",)
        out.append(Candidate(("parallel.offload_params=true", *stage), "offload_params"))
    return out


@dataclass(frozen=True)
class Fix:
    overrides: tuple[str, ...]
    device: int
    host: int
    fits: bool


def replan(cfg: Config, overrides: list[str], shape: ModelShape, budget: Budget) -> Fix:
    """`cfg` with `overrides` planned against `budget`: its needs and whether it fits."""
    plan = plan_memory(with_overrides(cfg, overrides, "memory fix"), shape, budget.gpu)
    device, host = budget.need(plan)
    return Fix(tuple(overrides), device, host, budget.fits(plan))


def _replan_if_it_runs(cfg: Config, overrides: list[str], shape: ModelShape, budget: Budget) -> Fix | None:
    """`replan`, or None when `cfg`'s checks refuse `overrides` (a fix that cannot run is no fix)."""
    try:
        return replan(cfg, overrides, shape, budget)
    except UserError:
        return None


_ZERO_STAGE = "parallel.zero_stage="


def _combined(candidates: list[Candidate]) -> list[str]:
    """The overrides of `candidates`, the last of each group, each override once, with one ZeRO stage: the highest
    they ask for (a candidate only ever raises it, to what its offload needs; a lower one after ZeRO-3 would leave
    offload_params without it)."""
    last = {c.group: c for c in candidates}
    given = [o for c in candidates if last[c.group] is c for o in c.overrides]
    stages = [int(o.removeprefix(_ZERO_STAGE)) for o in given if o.startswith(_ZERO_STAGE)]
    rest = list(dict.fromkeys(o for o in given if not o.startswith(_ZERO_STAGE)))
    return rest + ([f"{_ZERO_STAGE}{max(stages)}"] if stages else [])


def _excess(fix: Fix, budget: Budget) -> int:
    """Bytes `fix` needs beyond `budget`, on the device and the host together."""
    device = max(0, fix.device - budget.device) if budget.device is not None else 0
    return device + max(0, fix.host - budget.host)


def _cheapest_combination(cfg: Config, candidates: list[Candidate], shape: ModelShape, budget: Budget) -> Fix | None:
    """Candidates added one at a time, each time the cheapest in speed that the checks accept and that lowers what the
    combination needs beyond the budget (one that did not may once another is in: a larger sequence-parallel group
    under ZeRO-3), up to the first combination that fits; then, the slowest first, each dropped that the combination
    fits without (a larger sequence-parallel group falls back to the smaller one before it). So no offload when a fit
    without one exists. When none fits, the combination that comes nearest; None when no candidate lowers the need."""
    chosen: list[Candidate] = []
    fix = None
    over = _excess(replan(cfg, [], shape, budget), budget)
    while fix is None or not fix.fits:
        for candidate in (c for c in candidates if c not in chosen):
            tried = _replan_if_it_runs(cfg, _combined([*chosen, candidate]), shape, budget)
            if tried is not None and _excess(tried, budget) < over:
                chosen, fix, over = [*chosen, candidate], tried, _excess(tried, budget)
                break
        else:
            return fix
    for candidate in reversed(chosen):
        fewer = [c for c in chosen if c is not candidate]
        tried = _replan_if_it_runs(cfg, _combined(fewer), shape, budget) if fewer else None
        if tried is not None and tried.fits:
            chosen, fix = fewer, tried
    return fix


def _lowers(fix: Fix, base: Fix) -> bool:
    """Whether `fix` needs less of one memory than `base` (ZeRO-3's buffers on one GPU raise both)."""
    return fix.device < base.device or fix.host < base.host


def fixes(cfg: Config, shape: ModelShape, budget: Budget) -> list[Fix]:
    """Each candidate setting that `cfg`'s checks accept, re-planned, with its predicted needs: those that fit first,
    the cheapest in speed first (`candidate_fixes`' order), then those that do not by total need. Before the first
    that fits alone (or last when none does), the cheapest combination of the candidates cheaper than it
    (`_cheapest_combination`; with the highest ZeRO stage any of them asks for, e.g. ZeRO-3 over the ZeRO-1 that
    optimizer offload alone needs): a larger sequence-parallel group under ZeRO-3 fits where alone only an offload
    does. When nothing fits alone, the combination of all of them that comes nearest is listed even if it does not
    fit."""
    candidates = candidate_fixes(cfg)
    base = replan(cfg, [], shape, budget)
    alone = [
        (i, f)
        for i, c in enumerate(candidates)
        if (f := _replan_if_it_runs(cfg, list(c.overrides), shape, budget)) and _lowers(f, base)
    ]
    first_fit = min((i for i, f in alone if f.fits), default=len(candidates))
    # every cheaper candidate: one refused alone may run beside another (activation offload beside checkpointing)
    combined = _cheapest_combination(cfg, candidates[:first_fit], shape, budget) if first_fit else None
    wanted = combined is not None and _lowers(combined, base) and (combined.fits or first_fit == len(candidates))
    if wanted and all(set(combined.overrides) != set(f.overrides) for _, f in alone):
        alone.append((first_fit - 0.5, combined))
    return [
        f for _, f in sorted(alone, key=lambda a: (not a[1].fits, a[0] if a[1].fits else 0, a[1].device + a[1].host))
    ]


def faster_fit(cfg: Config, shape: ModelShape, budget: Budget) -> Fix | None:
    """Selective checkpointing when `cfg` recomputes whole layers (`full`) and the plan with it fits: the same memory
    saving but for each layer's attention output, and a backward that does not rerun attention."""
    if cfg.model.checkpointing_mode != "full" or not keeps_attention(cfg.attention.engine):
        return None
    fix = _replan_if_it_runs(cfg, [SELECTIVE], shape, budget)
    return fix if fix is not None and fix.fits else None
