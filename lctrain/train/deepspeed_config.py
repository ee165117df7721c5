"""The DeepSpeed config of a run, derived from the lctrain YAML so nobody writes DeepSpeed JSON by hand; the one
function the trainer builds its engine from and the memory planner sizes DeepSpeed's buffers from."""

from __future__ import annotations

from lctrain.compat.deepspeed import grad_divisor as compat_grad_divisor
from lctrain.config import Config
from lctrain.parallel.layout import ParallelLayout
from lctrain.train.runplan import RunPlan

# Never let DeepSpeed print its own per-step lines: the trainer's progress bar and metrics.jsonl report steps.
_QUIET_STEPS = 10**9


def uses_torch_adam(cfg: Config, gpu: bool) -> bool:
    """torch's AdamW, unless the optimizer is offloaded from a GPU: then DeepSpeed's CPU Adam (a C++ op built on first
    use, in place and faster), except with `train.torch_adam`."""
    return cfg.train.torch_adam or not (gpu and cfg.parallel.offload_optimizer)


def overlaps_comm(cfg: Config) -> bool:
    """`parallel.overlap_comm`, its null resolved to DeepSpeed's default for the ZeRO stage (on for ZeRO-3 only)."""
    p = cfg.parallel
    return p.zero_stage == 3 if p.overlap_comm is None else p.overlap_comm


def grad_divisor(cfg: Config, layout: ParallelLayout) -> int:
    """What DeepSpeed divides the summed gradients by; the trainer multiplies the loss by it so that the ranks'
    gradient contributions simply add up."""
    return compat_grad_divisor(cfg.parallel.zero_stage, layout.dp, layout.world)


def deepspeed_config(cfg: Config, plan: RunPlan, *, gpu: bool) -> dict:
    """The DeepSpeed config of `cfg` on its checked `plan`; `gpu` decides the optimizer (`uses_torch_adam`: torch's
    AdamW needs no op compilation and runs on CPU)."""
    batches = plan.batches
    torch_adam = uses_torch_adam(cfg, gpu)
    t, p = cfg.train, cfg.parallel
    zero: dict = {"stage": p.zero_stage}
    if p.zero_stage >= 1:
        # reduce_scatter fixes how ZeRO-3 averages gradients (compat/deepspeed.py: grad_divisor)
        zero.update(overlap_comm=overlaps_comm(cfg), contiguous_gradients=True, reduce_scatter=True)
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if p.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if p.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True)
    ds: dict = {
        "train_batch_size": batches.global_batch,  # = micro_batch x grad_accum x dp (BatchPlan.of)
        "train_micro_batch_size_per_gpu": batches.micro_batch,
        "gradient_accumulation_steps": batches.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": list(t.betas),
                "eps": t.eps,
                "weight_decay": t.weight_decay,
                "torch_adam": torch_adam,
                # DeepSpeed hands unknown parameters to torch's AdamW (its CPU Adam is already fused)
                **({"fused": True} if torch_adam and t.fused_optimizer else {}),
            },
        },
        "steps_per_print": _QUIET_STEPS,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer, whose figures nobody reads (lctrain times its own steps), synchronised the
        # device twice per micro-batch, at the forward and at the step
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    if torch_adam and p.offload_optimizer:
        ds["zero_force_ds_cpu_optimizer"] = False
    if cfg.model.dtype == "bfloat16":
        # fp32 master weights and fp32 gradient accumulation: bf16 only in the forward/backward math; the reduction
        # across ranks in parallel.reduce_dtype (DeepSpeed's default is bf16, but fp32 under sequence parallelism)
        ds["bf16"] = {"enabled": True}
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        reduce = {"float32": "fp32", "bfloat16": "bf16"}[p.reduce_dtype]
        ds["communication_data_type"] = reduce
        if plan.layout.sp > 1:
            ds["seq_parallel_communication_data_type"] = reduce
    elif cfg.model.dtype == "float16":
        ds["fp16"] = {"enabled": True, "initial_scale_power": 16}
    if plan.layout.sp > 1:
        ds["sequence_parallel_size"] = plan.layout.sp
    return ds
