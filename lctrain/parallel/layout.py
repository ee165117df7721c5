"""The parallel layout of a run, in one object: world size, sequence- and data-parallel degrees, and everything
derived from them (gradient accumulation, the gradient divisor, the DeepSpeed config, the Ulysses wrapping and the
batch sharding).

Ranks are laid out sequence-parallel-major: ranks `g*P .. g*P+P-1` form sequence-parallel group `g`, so the
all-to-alls of one group stay on one node (fast links) and data-parallel replicas span nodes. ZeRO shards over
all ranks (DeepSpeed's "sequence data parallel" group).

One optimizer step = `global_batch` windows: each data-parallel rank reads `grad_accum` micro-batches
(train/data.py), and each sequence-parallel rank keeps its contiguous `L/P` slice of the per-token tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from lctrain.compat.deepspeed import grad_divisor
from lctrain.config import Config
from lctrain.errors import UserError

# Never let DeepSpeed print its own per-step lines: the trainer's progress bar and metrics.jsonl report steps.
_QUIET_STEPS = 10**9


def check_precision(cfg: Config) -> None:
    """DeepSpeed keeps fp32 master weights for bf16/fp16 models only inside its ZeRO optimizers; stage 0 would
    update bf16 weights directly, which loses the small updates of continual pretraining (lr 2e-5)."""
    if cfg.model.dtype != "float32" and cfg.parallel.zero_stage == 0:
        raise UserError(
            f"{cfg.source_file or 'config'}: model.dtype = {cfg.model.dtype} needs parallel.zero_stage "
            f">= 1 (fp32 master weights); set parallel.zero_stage: 1, or model.dtype: float32"
        )


def uses_torch_adam(cfg: Config, gpu: bool) -> bool:
    """torch's AdamW, unless the optimizer is offloaded from a GPU: then DeepSpeed's CPU Adam (a C++ op built on first
    use, in place and faster), except with `train.torch_adam`."""
    return cfg.train.torch_adam or not (gpu and cfg.parallel.offload_optimizer)


@dataclass(frozen=True)
class ParallelLayout:
    world: int
    sp: int
    micro_batch: int
    global_batch: int
    seq_len: int
    zero_stage: int

    @classmethod
    def from_config(cls, cfg: Config, world: int | None = None) -> ParallelLayout:
        """The layout of `cfg` on `world` processes (default: the processes it asks for), refusing one that cannot
        run in one line naming the keys and a fix."""
        p, t = cfg.parallel, cfg.train
        layout = cls(
            world=world or p.nproc_per_node * p.num_nodes,
            sp=p.sequence_parallel,
            micro_batch=t.micro_batch,
            global_batch=t.global_batch,
            seq_len=cfg.data.seq_len,
            zero_stage=p.zero_stage,
        )
        layout.validate(cfg.source_file or "config")
        return layout

    def validate(self, source: str) -> None:
        if self.world % self.sp:
            raise UserError(
                f"{source}: world size {self.world} (parallel.nproc_per_node x parallel.num_nodes) is not "
                f"divisible by parallel.sequence_parallel = {self.sp}"
            )
        if self.global_batch % (self.micro_batch * self.dp):
            raise UserError(
                f"{source}: train.global_batch = {self.global_batch} is not divisible by train.micro_batch "
                f"x data-parallel size = {self.micro_batch} x {self.dp}; change train.global_batch or "
                f"train.micro_batch"
            )
        if self.seq_len % self.sp:
            raise UserError(
                f"{source}: data.seq_len = {self.seq_len} is not divisible by parallel.sequence_parallel = {self.sp}"
            )

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def grad_divisor(self) -> int:
        """What DeepSpeed divides the summed gradients by; the trainer multiplies the loss by it so that the ranks'
        gradient contributions simply add up."""
        return grad_divisor(self.zero_stage, self.dp, self.world)

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp

    def dp_rank(self, rank: int) -> int:
        return rank // self.sp

    def deepspeed_config(self, cfg: Config, use_torch_adam: bool) -> dict:
        """The DeepSpeed config, derived from the lctrain YAML so nobody writes DeepSpeed JSON by hand.
        `use_torch_adam`: torch's AdamW instead of DeepSpeed's fused/CPU Adam (no op compilation; CPU runs)."""
        check_precision(cfg)
        t, p = cfg.train, cfg.parallel
        zero: dict = {"stage": p.zero_stage}
        if p.zero_stage >= 1:
            # reduce_scatter fixes how ZeRO-3 averages gradients (compat/deepspeed.py: grad_divisor)
            zero.update(overlap_comm=False, contiguous_gradients=True, reduce_scatter=True)
        if p.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if p.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        if p.zero_stage == 3:
            zero.update(stage3_gather_16bit_weights_on_model_save=True)
        ds: dict = {
            "train_batch_size": self.global_batch,  # = micro_batch x grad_accum x dp (validate)
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "gradient_clipping": t.grad_clip,
            "zero_optimization": zero,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": t.lr,
                    "betas": list(t.betas),
                    "eps": t.eps,
                    "weight_decay": t.weight_decay,
                    "torch_adam": use_torch_adam,
                },
            },
            "steps_per_print": _QUIET_STEPS,
            "wall_clock_breakdown": False,
        }
        if use_torch_adam and p.offload_optimizer:
            ds["zero_force_ds_cpu_optimizer"] = False
        if cfg.model.dtype == "bfloat16":
            # fp32 master weights and fp32 gradient accumulation: bf16 only in the forward/backward math.
            ds["bf16"] = {"enabled": True}
            ds["data_types"] = {"grad_accum_dtype": "fp32"}
        elif cfg.model.dtype == "float16":
            ds["fp16"] = {"enabled": True, "initial_scale_power": 16}
        if self.sp > 1:
            ds["sequence_parallel_size"] = self.sp
        return ds

    def micro_batch_rows(self, step_index: int, micro: int, rank: int, *, seed: int, n: int) -> list[int]:
        """Rows of micro-batch `micro` of update `step_index` (0-based) that `rank` reads; all ranks of a
        sequence-parallel group read the same windows."""
        from lctrain.train.data import micro_batch_rows

        return micro_batch_rows(
            step_index,
            micro,
            self.dp_rank(rank),
            dp=self.dp,
            micro_batch=self.micro_batch,
            global_batch=self.global_batch,
            seed=seed,
            n=n,
        )

    def shard(self, batch: dict, rank: int) -> dict:
        """`rank`'s contiguous 1/sp slice of the per-token tensors; every other entry is shared unchanged."""
        if self.sp == 1:
            return batch
        import torch

        from lctrain.attention import PER_TOKEN_KEYS

        out = {}
        for key, value in batch.items():
            if key in PER_TOKEN_KEYS and isinstance(value, torch.Tensor):
                step = value.shape[1] // self.sp
                lo = self.sp_rank(rank) * step
                out[key] = value[:, lo : lo + step]
            else:
                out[key] = value
        return out

    def wrap_attention(self, lm, sp_group) -> None:
        """Under sequence parallelism, run the engine the model was built with inside DeepSpeed-Ulysses."""
        if self.sp == 1:
            return
        from lctrain.attention.registry import HF_PREFIX
        from lctrain.compat.transformers import attn_implementation
        from lctrain.costmodel import ModelShape
        from lctrain.parallel.ulysses import register_ulysses

        shape = ModelShape.from_hf_config(lm.config)
        engine = attn_implementation(lm).removeprefix(HF_PREFIX)
        lm.set_attn_implementation(register_ulysses(engine, sp_group, shape.heads, shape.kv_heads))
