"""The DeepSpeed config, derived from the lctrain YAML so nobody writes DeepSpeed JSON by hand."""

from __future__ import annotations

from lctrain.config import Config
from lctrain.errors import UserError
from lctrain.parallel.groups import grad_accum_steps

# Never let DeepSpeed print its own per-step lines: the trainer's progress bar and metrics.jsonl report steps.
_QUIET_STEPS = 10**9


def check_precision(cfg: Config) -> None:
    """DeepSpeed keeps fp32 master weights for bf16/fp16 models only inside its ZeRO optimizers; stage 0 would
    update bf16 weights directly, which loses the small updates of continual pretraining (lr 2e-5)."""
    if cfg.model.dtype != "float32" and cfg.parallel.zero_stage == 0:
        raise UserError(f"{cfg.source_file or 'config'}: model.dtype = {cfg.model.dtype} needs parallel.zero_stage "
                        f">= 1 (fp32 master weights); set parallel.zero_stage: 1, or model.dtype: float32")


def build_ds_config(cfg: Config, world: int, use_torch_adam: bool) -> dict:
    """`use_torch_adam`: torch's AdamW instead of DeepSpeed's fused/CPU Adam (no op compilation; CPU runs)."""
    t, p = cfg.train, cfg.parallel
    gas = grad_accum_steps(cfg, world)
    zero: dict = {"stage": p.zero_stage}
    if p.zero_stage >= 1:
        # reduce_scatter fixes how ZeRO-3 averages gradients (parallel/loss.py: deepspeed_grad_divisor)
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_scatter=True)
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if p.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if p.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    ds: dict = {
        "train_batch_size": t.global_batch,  # = micro_batch x gas x data-parallel size (check_layout)
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": t.lr, "betas": list(t.betas), "eps": t.eps, "weight_decay": t.weight_decay,
                       "torch_adam": use_torch_adam},
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
    if p.sequence_parallel > 1:
        ds["sequence_parallel_size"] = p.sequence_parallel
    return ds
