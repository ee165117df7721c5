"""`train(cfg)` and `resume(run_dir)`: the DeepSpeed training loop over the packed windows.

One optimizer step = `global_batch` windows: each data-parallel group reads `gas` micro-batches (train/data.py),
each sequence-parallel rank keeps its contiguous slice of the tokens, and the step's loss is the sum of token
losses over all ranks divided by the number of valid labels in the step (parallel/loss.py), so any layout computes
the same update as one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from lctrain.config import (Config, config_fingerprint, load_config, reread_warning, run_dir as config_run_dir,
                            write_resolved)
from lctrain.errors import UserError, is_environment_error
from lctrain.lifetime import RunLock
from lctrain.parallel import launch
from lctrain.parallel.ds_config import check_precision
from lctrain.parallel.groups import (check_layout, grad_accum_steps, init_topology, release_single_process,
                                     requested_world, under_launcher)
from lctrain.train import checkpoint as ckpt
from lctrain.train.checkpoint import write_atomic
from lctrain.train.data import collate, micro_batch_rows, open_checked
from lctrain.costmodel import attention_width, dense_params, step_flops, visible_pairs
from lctrain.train.metrics import (StepLogger, device_peak_flops, import_wandb, peak_memory_gb, reset_peak_memory,
                                   truncate_metrics)
from lctrain.train.schedule import hf_checkpoint_steps, lr_factor, resume_checkpoint_due


def train(cfg: Config, force: bool = False) -> Path:
    """Start a run in `run_dir(cfg)`; refuses a directory that already has checkpoints unless `force`."""
    rd = config_run_dir(cfg)
    leader = _leader()
    if leader:
        preflight(cfg)
    with _run_lock(rd, "lctrain train", leader):
        if leader:
            if ckpt.complete_checkpoints(rd) and not force:
                raise UserError(f"{rd}: this run already has checkpoints; continue it with 'lctrain resume {rd}', "
                                f"or start over with 'lctrain train --force'")
            # A new run: what an earlier attempt left without a complete checkpoint to resume from (its metrics,
            # evaluation exports, partial checkpoints) belongs to no run, and would mix into this one.
            shutil.rmtree(rd / "checkpoints", ignore_errors=True)
            shutil.rmtree(rd / "hf", ignore_errors=True)
            (rd / "metrics.jsonl").unlink(missing_ok=True)
            write_resolved(cfg, rd)
            write_atomic(rd / ORIGIN_FILE, json.dumps({"cwd": os.getcwd()}))
        if requested_world(cfg) > 1 and not under_launcher():
            launch.relaunch(cfg, rd, resume=False)
            return rd
        return run(cfg, rd, resuming=False)


def resume(run_dir: str | Path) -> Path:
    """Continue the run in `run_dir` from its last complete checkpoint, with nothing but that directory: relative
    paths in its config (the prepared data, a local model or tokenizer) resolve against the directory `train`
    was started from, whatever the current one."""
    rd = Path(run_dir).absolute()
    config_file = rd / "config.yaml"
    if not config_file.is_file():
        raise UserError(f"{run_dir}: not a run directory (no config.yaml); start a run with 'lctrain train'")
    leader = _leader()
    with _run_lock(rd, "lctrain resume", leader), _working_directory(_origin(rd)):
        if ckpt.latest_checkpoint(rd) is None:
            raise UserError(f"{rd}: no complete checkpoint to resume from; start the run again with "
                            f"'lctrain train --config {config_file} --force'")
        cfg = load_config(str(config_file))
        states = [(p, ckpt.readable_state(p)) for p in ckpt.resume_candidates(rd)]
        states = [(p, s) for p, s in states if s is not None]
        done = max((int(s["step"]) for _, s in states), default=0)
        if done >= cfg.train.steps:
            if leader:
                print(f"{rd} is complete: step {done} of {cfg.train.steps}; nothing to resume (raise train.steps in "
                      f"{config_file} to train further)", flush=True)
            return rd
        if leader and states:
            check_resumable(cfg, states[0][1], f"{config_file}", states[0][0].name)
            preflight(cfg)
        if requested_world(cfg) > 1 and not under_launcher():
            launch.relaunch(cfg, rd, resume=True)
            return rd
        return run(cfg, rd, resuming=True)


# Where `train` was started, so that `resume` resolves the run's relative paths as `train` did.
ORIGIN_FILE = "origin.json"


def _origin(rd: Path) -> Optional[Path]:
    try:
        cwd = Path(json.loads((rd / ORIGIN_FILE).read_text())["cwd"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a run started before this file existed: the current directory, as before
    return cwd if cwd.is_dir() else None


@contextlib.contextmanager
def _working_directory(path: Optional[Path]):
    if path is None:
        yield
        return
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


# Settings a checkpoint fixes: the model it holds, the data order it continues, and how DeepSpeed partitioned its
# state. Anything else (steps, learning rate, logging, checkpoint and eval schedule, engine) may change on resume.
_FIXED_BY_CHECKPOINT = ("seed", "model.", "data.", "attention.mode", "train.global_batch", "train.micro_batch",
                        "parallel.zero_stage", "parallel.sequence_parallel", "parallel.nproc_per_node",
                        "parallel.num_nodes", "parallel.offload_optimizer", "parallel.offload_params")
# ...except these, which change how the same computation runs (or where a dataset is found), not what it computes.
_FREE_KEYS = ("data.num_workers", "data.strict", "data.output_dir", "model.gradient_checkpointing")


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resumable(cfg: Config, state: dict, source: str, checkpoint: str) -> None:
    """Refuse, in one line naming the keys, a config edited since the checkpoint in a way it cannot resume with."""
    saved = state.get("config")
    if saved is None:
        return  # a checkpoint from before configs were stored: the fingerprint warning in `run` is all there is
    before, now = _flatten(saved), _flatten(cfg.model_dump(mode="json", exclude={"source_file"}))
    changed = [k for k in sorted(set(before) | set(now))
               if before.get(k) != now.get(k) and k.startswith(_FIXED_BY_CHECKPOINT) and k not in _FREE_KEYS]
    if changed:
        shown = ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise UserError(f"{source}: {shown}{more} changed since checkpoint {checkpoint}; a checkpoint resumes only "
                        f"with the model, data, batch and parallel layout it was written with: restore them, or start "
                        f"over with 'lctrain train --config {source} --force'")


def _leader() -> bool:
    """The process that checks, writes the run directory and holds its lock: the only one, or rank 0 of a
    launcher the user started (the workers lctrain launches itself run `run`, under their parent's lock)."""
    return not under_launcher() or int(os.environ.get("RANK", "0")) == 0


def _run_lock(rd: Path, command: str, leader: bool):
    return RunLock(rd, command) if leader else contextlib.nullcontext()


def preflight(cfg: Config) -> None:
    """Everything that can be checked before any process starts, so the user gets one line and exit code 2."""
    check_layout(cfg, int(os.environ["WORLD_SIZE"]) if under_launcher() else None)
    check_precision(cfg)
    reread = reread_warning(cfg, len(open_checked(cfg)))
    if reread:
        print(reread, flush=True)
    if cfg.logging.wandb != "disabled":
        import_wandb(cfg)
    if cfg.model.arch is not None:
        from lctrain.model import load_hf_config
        from lctrain.parallel.ulysses import kv_replication

        mc = load_hf_config(cfg)  # a bad model.arch is refused here, before any process starts
        if cfg.parallel.sequence_parallel > 1:
            kv_replication(mc.num_attention_heads, getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads,
                           cfg.parallel.sequence_parallel, cfg.source_file or "config")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def param_groups(model: torch.nn.Module, weight_decay: float, decay_norms_and_biases: bool) -> list[dict]:
    """AdamW groups: matrices (embeddings, projections) decay; norms and biases (the 1-D tensors) decay only with
    `decay_norms_and_biases`, as in the paper's released code, which decays every parameter. Two groups either way,
    so the setting changes a group's decay, not the optimizer's layout."""
    matrices, vectors = [], []
    for p in model.parameters():
        if p.requires_grad:
            (matrices if p.ndim >= 2 else vectors).append(p)
    return [{"params": matrices, "weight_decay": weight_decay},
            {"params": vectors, "weight_decay": weight_decay if decay_norms_and_biases else 0.0}]


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def run(cfg: Config, rd: Path, resuming: bool) -> Path:
    """The worker body: every rank runs this, under a launcher or as the only process."""
    topo = init_topology(cfg)
    try:
        return _run(cfg, rd, resuming, topo)
    finally:
        release_single_process()


def _run(cfg: Config, rd: Path, resuming: bool, topo) -> Path:
    import deepspeed
    import deepspeed.comm as dist

    from lctrain.attention.registry import HF_PREFIX
    from lctrain.compat.transformers import attn_implementation
    from lctrain.model import build_model
    from lctrain.parallel.ds_config import build_ds_config
    from lctrain.parallel.loss import CausalLMLossSum, deepspeed_grad_divisor
    from lctrain.parallel.ulysses import register_ulysses
    from lctrain.tokenizer import load_tokenizer

    _seed_everything(cfg.seed)
    packed = open_checked(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    vocab_size = int(packed.manifest["tokenizer"]["vocab_size"])

    use_torch_adam = topo.device.type == "cpu" or not cfg.parallel.offload_optimizer
    ds_config = build_ds_config(cfg, topo.world, use_torch_adam=use_torch_adam)
    hf_ds_config = None
    if cfg.parallel.zero_stage == 3 and cfg.model.name_or_path:
        # Keeps the reference alive while from_pretrained runs: transformers then loads the weights straight into
        # ZeRO-3 shards instead of a full copy per process.
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)
    lm = build_model(cfg, vocab_size=vocab_size, device=topo.device)
    if topo.sp > 1:
        # Ulysses wraps the engine the model was built with (resolved once, from the model's dtype and device)
        engine_name = attn_implementation(lm).removeprefix(HF_PREFIX)
        mc = lm.config
        impl = register_ulysses(engine_name, topo.sp_group, mc.num_attention_heads,
                                getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads)
        lm.set_attn_implementation(impl)
    model = CausalLMLossSum(lm)
    n_dense, layers, width = dense_params(lm), lm.config.num_hidden_layers, attention_width(lm.config)

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, cfg.train.weight_decay, cfg.train.decay_norms_and_biases),
        config=ds_config,
        mpu=topo.mpu, lr_scheduler=partial(_lambda_lr, train_cfg=cfg.train))
    del hf_ds_config

    start_step, wandb_id = 0, uuid.uuid4().hex[:12]
    if resuming:
        path, state = _load_first_good_checkpoint(engine, rd, topo)
        start_step, wandb_id = int(state["step"]), state.get("wandb_id", wandb_id)
        if topo.is_main and state.get("config_fingerprint") != config_fingerprint(cfg):
            print(f"warning: {rd}/config.yaml changed since checkpoint {path.name}; continuing with the new values",
                  flush=True)
        if topo.is_main:
            truncate_metrics(rd, start_step)

    total = cfg.train.steps
    gas = grad_accum_steps(cfg, topo.world)
    hf_steps = set(hf_checkpoint_steps(total, cfg.checkpoint))
    peak = device_peak_flops(topo.device, cfg.logging.peak_tflops)
    logger = StepLogger(rd, cfg, start_step, total, wandb_id) if topo.is_main else None
    grad_divisor = deepspeed_grad_divisor(cfg.parallel.zero_stage, topo.dp, topo.world)
    # DeepSpeed reports the gradient norm for ZeRO and mixed precision only; plain fp32 without ZeRO keeps the
    # reduced gradients in .grad, where we can measure it before the step.
    own_grad_norm = cfg.parallel.zero_stage == 0 and cfg.model.dtype == "float32"
    try:
        for step_index in range(start_step, total):
            t0 = time.perf_counter()
            reset_peak_memory(topo.device)
            micro, pairs = _micro_batches(cfg, topo, packed, step_index, gas)
            # one all-reduce: valid labels of the whole step (the loss denominator) and attention pairs (for MFU).
            # Reduced tensors live on the device: an nccl process group has no CPU backend.
            counts = torch.tensor([float(sum(int((b["labels"] != -100).sum()) for b in micro)), float(pairs)],
                                  dtype=torch.float64, device=topo.device)
            dist.all_reduce(counts)
            n_valid = max(counts[0].item(), 1.0)
            loss_sum = torch.zeros((), dtype=torch.float64, device=topo.device)
            grad_norm = None
            for i, b in enumerate(micro):
                token_loss_sum = engine(**b)
                engine.backward(token_loss_sum * (grad_divisor / n_valid), scale_wrt_gas=False)
                if i == gas - 1 and own_grad_norm:
                    grad_norm = _grad_norm(engine.module)
                engine.step()
                loss_sum += token_loss_sum.detach().double()
            dist.all_reduce(loss_sum)
            step = step_index + 1
            dt = time.perf_counter() - t0
            if topo.is_main:
                tokens = cfg.train.global_batch * cfg.data.seq_len
                flops = step_flops(n_dense, layers, width, tokens, int(counts[1].item()))
                grad_norm = engine.get_global_grad_norm() if grad_norm is None else grad_norm
                logger.log({
                    "step": step, "loss": loss_sum.item() / n_valid, "lr": cfg.train.lr * lr_factor(step_index,
                                                                                                  cfg.train),
                    "grad_norm": float(grad_norm) if grad_norm is not None else None, "tokens": step * tokens,
                    "valid_labels": int(n_valid), "step_time_s": dt, "tokens_per_s": tokens / dt,
                    "mfu": flops / dt / (peak * topo.world) if peak else None,
                    "peak_mem_gb": peak_memory_gb(topo.device),
                })
            if step in hf_steps:
                with _checkpoint_write(rd, step):
                    ckpt.save_hf(engine, lm, tokenizer, rd, step, rank=topo.rank, zero_stage=cfg.parallel.zero_stage)
            if resume_checkpoint_due(step, total, cfg.checkpoint):
                state = {"step": step, "windows_consumed": step * cfg.train.global_batch,
                         "config_fingerprint": config_fingerprint(cfg), "world_size": topo.world, "sp": topo.sp,
                         "wandb_id": wandb_id, "time": time.time(),
                         "config": cfg.model_dump(mode="json", exclude={"source_file"})}
                with _checkpoint_write(rd, step):
                    ckpt.save_resume(engine, rd, step, state, rank=topo.rank, keep=cfg.checkpoint.keep)
    finally:
        if logger is not None:
            logger.close()
    return rd


def _load_first_good_checkpoint(engine, rd: Path, topo) -> tuple[Path, dict]:
    """The newest checkpoint every rank can load; a damaged one is reported and the one before it tried. The ranks
    decide together (one all-reduce per try), so they never resume from different steps."""
    import deepspeed.comm as dist

    tried = []
    for path in ckpt.resume_candidates(rd):
        state, why = ckpt.load_resume(engine, path, rank=topo.rank)
        failed = torch.tensor([0.0 if state is not None else 1.0], device=topo.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() == 0:
            if tried and topo.is_main:
                print(f"warning: resuming from {path.name}: the newer {', '.join(tried)} could not be loaded",
                      flush=True)
            return path, state
        if topo.is_main:
            print(f"warning: checkpoint {path.name} is damaged ({why or 'on another rank'}); trying the one before it",
                  flush=True)
        tried.append(path.name)
    raise UserError(f"{rd}: no checkpoint could be loaded (tried {', '.join(tried) or 'none'}); start the run again "
                    f"with 'lctrain train --config {rd / 'config.yaml'} --force'")


@contextlib.contextmanager
def _checkpoint_write(rd: Path, step: int):
    """A full disk or a lost permission while writing a checkpoint is the user's to fix, not a crash: the last
    complete checkpoint is intact (checkpoints are renamed into place), so say so in one line."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if not is_environment_error(e):
            raise
        why = e.strerror if isinstance(e, OSError) and e.strerror else "the write failed; is the disk full?"
        raise UserError(f"{rd}: cannot write the step {step} checkpoint ({why}); free disk space or fix "
                        f"permissions, then 'lctrain resume {rd}' continues from the last complete checkpoint") from None


def _micro_batches(cfg: Config, topo, packed, step_index: int, gas: int) -> tuple[list[dict], int]:
    """This rank's micro-batches of one step (its sequence slice, on its device) and their visible attention pairs
    (0 on all but the first rank of a sequence-parallel group)."""
    from lctrain.attention import PER_TOKEN_KEYS, make_batch
    from lctrain.parallel.ulysses import shard_sequence

    micro, pairs = [], 0
    for m in range(gas):
        rows = micro_batch_rows(step_index, m, topo.dp_rank, dp=topo.dp, micro_batch=cfg.train.micro_batch,
                                global_batch=cfg.train.global_batch, seed=cfg.seed, n=len(packed))
        raw = collate(packed, rows)
        if topo.sp_rank == 0:  # the group's other ranks hold the same windows: count each window once
            pairs += sum(visible_pairs(sl, sd, cfg.attention.mode, cfg.data.seq_len)
                         for sl, sd in zip(raw["seg_lens"], raw["seg_doc"]))
        batch = make_batch(raw["input_ids"], raw["seg_lens"], cfg.attention.mode, seg_doc=raw["seg_doc"],
                           tag_lens=raw["tag_lens"])
        micro.append(_to_device(shard_sequence(batch, PER_TOKEN_KEYS, topo.sp, topo.sp_rank), topo.device))
    return micro, pairs


def _grad_norm(module: torch.nn.Module) -> float:
    """Norm of the reduced gradients (identical on every rank without ZeRO), before clipping."""
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _lambda_lr(optimizer, train_cfg):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, train=train_cfg))
