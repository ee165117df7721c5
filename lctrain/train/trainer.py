"""The `Trainer` every worker runs, and `run`, the worker body.

`run` is what every rank executes, under a launcher or as the only process (the command edge, train/command.py,
decides which): the process groups, then a `Trainer` whose `train_step` does one optimizer step and whose
`TrainState` the resume checkpoints hold.

One optimizer step = `global_batch` windows: each data-parallel rank reads `grad_accum` micro-batches, each
sequence-parallel rank keeps its contiguous slice of the tokens (parallel/layout.py), and the step's loss is the sum
of token losses over all ranks divided by the number of valid labels in the step (train/loss.py), so any layout
computes the same update as one process.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from shlex import quote

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
from torch.profiler import record_function

from lctrain import fused
from lctrain.activation_checkpointing import keeps_attention
from lctrain.attention import make_batch
from lctrain.compat.deepspeed import (
    checkpoint_offload_context,
    no_bf16_optimizer_memory_report,
    sequence_parallel_bf16_norm,
    set_gradient_clipping,
)
from lctrain.config import Config, config_fingerprint, settings, settings_changes, shown_changes
from lctrain.console import launched_rank, say, survive_closed_outputs
from lctrain.costmodel import (
    ModelShape,
    count_params,
    full_square_pairs,
    hardware_step_flops,
    step_flops,
    visible_pairs,
)
from lctrain.disk import RunDisk
from lctrain.errors import RunFailed, UserError, WriteFailed, cited, is_environment_error, remedy_of
from lctrain.eval.perplexity import heldout_rows
from lctrain.hardware import device_peak_flops
from lctrain.lifetime import StopRequest, Terminated, is_supervised, supervisor_gone
from lctrain.measure import largest_peak_bytes, reset_peak, timed
from lctrain.memory import need, plan_memory
from lctrain.model import build_model, write_model_changes
from lctrain.parallel.groups import Topology, end_process_groups, init_topology, release_single_process, under_launcher
from lctrain.parallel.layout import ParallelLayout
from lctrain.parallel.ulysses import wrap_model
from lctrain.parallel.watchdog import HangRecord, StepWatchdog, end_process
from lctrain.profiling import ProfiledSteps, StepProfiler
from lctrain.rundir import RunDir, step_of
from lctrain.tokenizer import load_tokenizer, resolve_anchor, write_anchor
from lctrain.train import checkpoint as ckpt
from lctrain.train import reshard
from lctrain.train.data import collate, dataset_record
from lctrain.train.deepspeed_config import deepspeed_config, grad_divisor
from lctrain.train.determinism import deterministic_algorithms
from lctrain.train.heldout import HeldoutLoss
from lctrain.train.loss import CausalLMLossSum, reruns_lm_head
from lctrain.train.metrics import StepLogger, quiet_libraries
from lctrain.train.report import PlannedMemory, RunEnd, RunStart, banner, profile_line, summary
from lctrain.train.runplan import Prepared, RunPlan
from lctrain.train.schedule import (
    heldout_due,
    hf_checkpoint_steps,
    learning_rate,
    lr_factor,
    resume_checkpoint_after,
    resume_checkpoint_due,
    resumed_rate_note,
    warmup_warning,
)
from lctrain.train.session import diverged_step, record_end, session_record, software_note
from lctrain.units import to_gb

# Fault injection for tests: called on rank 0 with the step after DeepSpeed has written its files of that step's
# resume checkpoint and before the checkpoint is complete.
CheckpointHook = Callable[[int], None]

# Said at once when a SIGTERM comes (a 64K-token step can take minutes: the log shows that the signal was seen).
SIGTERM_SAID = (
    "SIGTERM: finishing the step under way on every rank, then writing its checkpoint (ranks still starting stop at "
    "once: nothing to keep)"
)

# What a step writes, in the words of the messages when a write fails: a step with both writes them in this order.
CHECKPOINT, EXPORT = "resume checkpoint", "evaluation export"


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def param_groups(model: torch.nn.Module, weight_decay: float, decay_norms_and_biases: bool) -> list[dict]:
    """AdamW groups: matrices (embeddings, projections) decay; norms and biases (the 1-D tensors) decay only with
    `decay_norms_and_biases`, as in the paper's released code, which decays every parameter. Two groups either way,
    so the setting changes a group's decay, not the optimizer's layout. A parameter's own shape: a ZeRO-3 run from
    pretrained weights loads them already partitioned (`HfDeepSpeedConfig`), each a 1-D shard that keeps its shape in
    `ds_shape`."""
    matrices, vectors = [], []
    for p in model.parameters():
        if p.requires_grad:
            (matrices if len(getattr(p, "ds_shape", p.shape)) >= 2 else vectors).append(p)
    return [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": vectors, "weight_decay": weight_decay if decay_norms_and_biases else 0.0},
    ]


def _new_wandb_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class TrainState:
    """What a resume checkpoint restores beyond DeepSpeed's state and the RNG: the optimizer steps taken (which is
    also the data cursor, train/data.py) and the Weights & Biases run to continue."""

    step: int = 0
    wandb_id: str = field(default_factory=_new_wandb_id)

    def record(self, cfg: Config, layout: ParallelLayout, dataset: dict) -> dict:
        """The checkpoint's trainer_state.json: this state, plus what `resume` checks the config and the prepared
        dataset (`train.data.dataset_record`) against."""
        return {
            "step": self.step,
            "windows_consumed": cfg.windows_read(self.step),
            "dataset": dataset,
            "config_fingerprint": config_fingerprint(cfg),
            "world_size": layout.world,
            "sp": layout.sp,
            "wandb_id": self.wandb_id,
            "time": time.time(),
            "config": settings(cfg),
        }

    @classmethod
    def from_record(cls, record: dict) -> TrainState:
        return cls(step=int(record["step"]), wandb_id=record.get("wandb_id") or _new_wandb_id())


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean token loss of the step over every rank
    valid_labels: int
    grad_norm: float | None  # None where DeepSpeed does not report it
    pairs: int  # visible attention pairs of the step's windows, for MFU


def run(
    cfg: Config,
    rd: RunDir,
    resuming: bool,
    prepared: Prepared | None = None,
    *,
    before_checkpoint_complete: CheckpointHook | None = None,
) -> RunDir:
    """The worker body: every rank runs this, under a launcher or as the only process. `prepared`: what the command
    edge of this process checked (preflight); a launched worker, which has none, checks its own here."""
    if launched_rank():  # no `lctrain.cli.main` of its own: its console's reader going away must not end the run
        survive_closed_outputs()
    # before anything touches the GPU: cuBLAS reads its workspace setting once, at its first call
    with deterministic_algorithms(cfg.train.deterministic):
        topo = init_topology(cfg, prepared.plan.layout if prepared is not None else None)
        quiet_libraries(topo.is_main)
        try:
            _seed_everything(cfg.seed)
            prepared = prepared or Prepared.of(cfg, topo.layout)
            if topo.is_main:  # before the model is built: a refusal here costs seconds, not the run
                latest = ckpt.latest_checkpoint(rd) if resuming else None  # resumed from (or, if damaged, before)
                check_output_dirs(cfg, rd, step_of(latest) or 0 if latest is not None else 0)
            packed = prepared.packed
            trainer = Trainer(
                cfg,
                topo,
                vocab_size=packed.manifest.tokenizer.vocab_size,
                plan=prepared.plan,
                tokenizer=load_tokenizer(cfg.resolve_source(cfg.data.tokenizer)),
                run_dir=rd,
                before_checkpoint_complete=before_checkpoint_complete,
            )
            if topo.is_main:
                write_model_changes(rd.model_changes_file, trainer.changes)
                write_anchor(rd.path, trainer.anchor)
            if resuming:
                trainer.load_checkpoint()
            start_step, started = trainer.state.step, time.monotonic()
            session = None  # rank 0's record in sessions.jsonl, completed with how the session ended
            if topo.is_main:
                session = session_record(cfg, start_step, topo.layout.world, str(topo.device), trainer.peak_flops)
                sessions = rd.read_sessions()
                rd.append_session(session)
                print(banner(trainer.run_start()), flush=True)
                for note in filter(
                    None, [software_note(sessions[-1] if sessions else None, session), warmup_warning(cfg.train)]
                ):
                    say(note)
            if session is not None:
                trainer.session_ended = lambda e: record_end(rd, session, trainer.state.step, e, trainer.diverged_at)
            try:
                trainer.fit(packed)
            except BaseException as e:
                # a killed `lctrain train` takes its ranks with it: recorded as a kill is (the start only), not as
                # the failure the collective met ("Connection closed by peer")
                if session is not None and not supervisor_gone():
                    record_end(rd, session, trainer.state.step, e, trainer.diverged_at)
                    if under_launcher() and not is_supervised() and _unexplained(e):
                        say(_crash_line(rd, trainer.state.step, e))
                raise
            if session is not None:
                record_end(rd, session, trainer.state.step, None, trainer.diverged_at)
                print(summary(trainer.run_end(start_step, time.monotonic() - started)), flush=True)
            end_process_groups()  # the ranks of a launcher the user started exit straight after this
        finally:
            release_single_process()
    return rd


class Trainer:
    """The model under DeepSpeed on this rank, and what one run does with it: `train_step`, logging, checkpoints.

    Construction is the setup: the DeepSpeed config of the layout, the model with the attention engine resolved
    once (`lctrain.model.build_model`), wrapped in DeepSpeed-Ulysses under sequence parallelism, and the DeepSpeed
    engine with AdamW and the learning-rate schedule. `plan`: the layout and batch split this process checked (by
    default checked here, on the topology's layout). `run_dir` and `tokenizer` are needed only by `fit` and the
    checkpoints (a benchmark calls `train_step` alone)."""

    def __init__(
        self,
        cfg: Config,
        topo: Topology,
        *,
        vocab_size: int,
        plan: RunPlan | None = None,
        tokenizer=None,
        run_dir: RunDir | None = None,
        before_checkpoint_complete: CheckpointHook | None = None,
    ):
        self.cfg, self.topo, self.layout = cfg, topo, topo.layout
        plan = plan or RunPlan.of(cfg, self.layout)
        self.batches = plan.batches
        self.run_dir, self.tokenizer = run_dir, tokenizer
        self.anchor = resolve_anchor(tokenizer, cfg.data.anchor, cfg.data.tokenizer) if tokenizer is not None else None
        self.before_checkpoint_complete = before_checkpoint_complete
        self.state = TrainState()
        self.dataset: dict | None = None  # `fit`'s prepared dataset (`dataset_record`), for its checkpoints
        # rank 0's: the step of the run whose loss first passed `divergence_warning`'s bound, said once, in this
        # session or read back from an earlier one's metrics (`load_checkpoint`); the metrics records from there on
        # say "diverged", and so do the end summary and the session's end record (the run still ends 'done')
        self.diverged_at: int | None = None
        self.session_ended: Callable[[BaseException], None] | None = None  # rank 0's: completes its sessions.jsonl line
        ds_config = deepspeed_config(cfg, plan, gpu=topo.device.type == "cuda")
        hf_ds_config = None
        if cfg.parallel.zero_stage == 3 and cfg.model.name_or_path:
            # Keeps the reference alive while from_pretrained runs: transformers then loads the weights straight
            # into ZeRO-3 shards instead of a full copy per process.
            from transformers.integrations import HfDeepSpeedConfig

            hf_ds_config = HfDeepSpeedConfig(ds_config)
        self.lm, self.attention, self.changes = build_model(cfg, vocab_size=vocab_size, device=topo.device)
        self.attention_kept = keeps_attention(self.attention.name)  # of the engine Ulysses may wrap below
        if self.layout.sp > 1:
            self.attention = wrap_model(self.lm, self.attention, topo.sp_group)
        model = CausalLMLossSum(
            self.lm, fused_loss_sum=fused.loss_sum(cfg.model.fused_kernels), gradients=cfg.train.loss_gradients
        )
        self.shape = ModelShape.from_hf_config(self.lm.config)
        self.n_dense = self.shape.linear_params()
        with no_bf16_optimizer_memory_report():
            self.engine, _, _, _ = deepspeed.initialize(
                model=model,
                model_parameters=param_groups(model, cfg.train.weight_decay, cfg.train.decay_norms_and_biases),
                config=ds_config,
                mpu=topo.mpu,
                lr_scheduler=partial(_lambda_lr, train_cfg=cfg.train),
            )
        sequence_parallel_bf16_norm(self.engine)  # bf16 ZeRO-1 with sequence parallelism measures its norm
        del hf_ds_config
        # DeepSpeed reports the gradient norm for ZeRO and mixed precision only; plain fp32 without ZeRO keeps the
        # reduced gradients in .grad, where we can measure it before the step.
        self.own_grad_norm = cfg.parallel.zero_stage == 0 and cfg.model.dtype == "float32"
        if cfg.model.offload_activations:
            self.offload = checkpoint_offload_context()
        else:
            self.offload = contextlib.nullcontext()

    def read_windows(self, packed, step_index: int) -> list[dict]:
        """This rank's micro-batches of update `step_index`: collated windows, before `make_batch`."""
        dp_rank = self.layout.dp_rank(self.topo.rank)
        return [
            collate(packed, self.batches.rows(step_index, m, dp_rank, seed=self.cfg.seed, n=len(packed)))
            for m in range(self.batches.grad_accum)
        ]

    def train_step(self, windows: list[dict]) -> StepResult:
        """One optimizer step over this rank's micro-batches (collated windows, `train.data.collate`)."""
        cfg, topo = self.cfg, self.topo
        micro, pairs, valid = [], 0, 0
        for raw in windows:
            if topo.sp_rank == 0:  # the group's other ranks hold the same windows: count each window once
                pairs += sum(
                    visible_pairs(sl, sd, cfg.attention.mode, cfg.data.seq_len)
                    for sl, sd in zip(raw["seg_lens"], raw["seg_doc"])
                )
            batch = make_batch(
                raw["input_ids"], raw["seg_lens"], cfg.attention.mode, seg_doc=raw["seg_doc"], tag_lens=raw["tag_lens"]
            )
            local = batch.shard(topo.sp, topo.sp_rank)
            valid += local.valid_labels()  # counted on the host: read back from the device, a synchronisation
            micro.append(local.to(topo.device))
        # one all-reduce: valid labels of the whole step (the loss denominator) and attention pairs (for MFU).
        # Reduced tensors live on the device: an nccl process group has no CPU backend.
        counts = torch.tensor(
            [float(valid), float(pairs)],
            dtype=torch.float64,
            device=topo.device,
        )
        dist.all_reduce(counts)
        n_valid = max(counts[0].item(), 1.0)
        scale = grad_divisor(cfg, self.layout) / n_valid
        loss_sum = torch.zeros((), dtype=torch.float64, device=topo.device)
        grad_norm = None
        for i, b in enumerate(micro):
            # Offloaded hidden states come back only while the context is active, so it spans the forward and the
            # backward of each micro-batch, which only this loop holds together (not the loss module, not the model).
            with self.offload:
                with record_function("lctrain.forward"):
                    token_loss_sum = self.engine(b)
                with record_function("lctrain.backward"):
                    self.engine.backward(token_loss_sum * scale, scale_wrt_gas=False)
            if i == len(micro) - 1 and self.own_grad_norm:
                grad_norm = _grad_norm(self.engine.module)
            with record_function("lctrain.optimizer"):
                self.engine.step()
            loss_sum += token_loss_sum.detach().double()
        dist.all_reduce(loss_sum)
        if grad_norm is None:  # every rank: DeepSpeed's norm is reduced over the ranks, and `fit` checks it on each
            grad_norm = self.engine.get_global_grad_norm()
        return StepResult(
            loss=loss_sum.item() / n_valid,
            valid_labels=int(n_valid),
            grad_norm=float(grad_norm) if grad_norm is not None else None,
            pairs=int(counts[1].item()),
        )

    def step_flops(self, tokens: int, pairs: int) -> float:
        return step_flops(self.n_dense, self.shape.layers, self.shape.width, tokens, pairs)

    def full_square_flops(self) -> float:
        """`step_flops` of one step with every window's whole L x L square of pairs (costmodel.full_square_pairs)."""
        cfg = self.cfg
        return self.step_flops(cfg.tokens_per_step, cfg.train.global_batch * full_square_pairs(cfg.data.seq_len))

    def hardware_flops(self, tokens: int, pairs: int) -> float:
        """`step_flops` and what this run's activation checkpointing, tiled MLP and chunked loss rerun
        (costmodel.hardware_step_flops, which `estimate` counts with too)."""
        model = self.cfg.model
        return hardware_step_flops(
            self.shape,
            self.n_dense,
            tokens,
            pairs,
            model.checkpointing_mode,
            tiled_mlp=bool(model.tiled_mlp),
            attention_kept=self.attention_kept,
            lm_head_rerun=reruns_lm_head(
                self.cfg.train.micro_batch,
                self.cfg.data.seq_len // self.layout.sp,
                model.fused_kernels,
                self.cfg.train.loss_gradients,
            ),
        )

    def metrics(
        self, step_index: int, result: StepResult, seconds: float, peak: float | None, peak_mem: int, mem_scope: str
    ) -> dict:
        """The metrics.jsonl record of update `step_index`: `peak_mem_gb` the highest rank's `peak_mem` bytes in GB
        (10^9 bytes), the peak since `reset_peak` returned `mem_scope` (the step, or the process's life where the
        host's peak cannot be reset)."""
        cfg = self.cfg
        tokens = cfg.tokens_per_step
        step = step_index + 1
        return {
            "step": step,
            "loss": result.loss,
            "lr": learning_rate(step_index, cfg.train),
            "grad_norm": result.grad_norm,
            "tokens": cfg.tokens_read(step),
            "valid_labels": result.valid_labels,
            "step_time_s": seconds,
            "tokens_per_s": tokens / seconds,
            "mfu": self.step_flops(tokens, result.pairs) / seconds / (peak * self.layout.world) if peak else None,
            "mfu_full_square": self.full_square_flops() / seconds / (peak * self.layout.world) if peak else None,
            "hfu": self.hardware_flops(tokens, result.pairs) / seconds / (peak * self.layout.world) if peak else None,
            "peak_mem_gb": to_gb(peak_mem),
            "peak_mem_scope": mem_scope,
        }

    @cached_property
    def peak_flops(self) -> float | None:
        """The device's peak FLOP/s MFU divides by (`device_peak_flops`), None where unknown; measured once on a CPU,
        and recorded in the session's line of sessions.jsonl, since a measured peak differs between runs."""
        return device_peak_flops(self.topo.device, self.cfg.logging.peak_tflops, self.cfg.model.dtype)

    def run_start(self) -> RunStart:
        """The facts of the start banner."""
        cfg, layout = self.cfg, self.layout
        gpu = self.topo.device.type == "cuda"
        # the config's world: a launcher the user started with another was refused (command._check_launcher_world)
        device, host = need(plan_memory(cfg, self.shape, gpu), gpu)
        planned = PlannedMemory(to_gb(device) if gpu else None, to_gb(host))
        disk = RunDisk.of(cfg, self.shape.param_count())
        return RunStart(
            name=cfg.name,
            run_dir=self.run_dir.path,
            model=cfg.model.name_or_path or f"{cfg.model.arch.get('model_type', 'model')} (model.arch, random init)",
            params=count_params(self.lm),
            dense_params=self.n_dense,
            rope=dict(self.lm.config.rope_parameters or {}),
            max_positions=self.lm.config.max_position_embeddings,
            changes=self.changes,
            anchor_token=self.anchor.token,
            anchor_id=self.anchor.id,
            mode=cfg.attention.mode,
            engine=self.attention.name,
            seq_len=cfg.data.seq_len,
            global_batch=cfg.train.global_batch,
            tokens_per_step=cfg.tokens_per_step,
            micro_batch=cfg.train.micro_batch,
            grad_accum=self.batches.grad_accum,
            layout=layout,
            zero_stage=cfg.parallel.zero_stage,
            device=self.topo.device.type,
            steps=cfg.train.steps,
            start_step=self.state.step,
            planned=planned,
            disk_peak_gb=to_gb(disk.plan.total),
            disk_free_gb=to_gb(disk.free),
        )

    def run_end(self, start_step: int, wall_s: float) -> RunEnd:
        """The facts of the end summary, after `fit` trained from `start_step` in `wall_s` seconds (rank 0)."""
        rd = self.run_dir
        logged = rd.read_metrics()
        records = [r for r in logged if r["step"] > start_step]
        return RunEnd(
            run_dir=rd.path,
            last=records[-1] if records else None,
            steps=self.cfg.train.steps,
            start_step=start_step,
            tokens_per_step=self.cfg.tokens_per_step,
            wall_s=wall_s,
            peak_mem_gb=max((r["peak_mem_gb"] for r in records), default=None),
            diverged=next((r for r in logged if r["step"] == self.diverged_at), None),
            checkpoint=ckpt.latest_checkpoint(rd),
            exports=rd.exports(),
            metrics_file=rd.metrics_file,
            start_over=lower_rate_start_over(rd, self.cfg),
        )

    def fit(self, packed) -> None:
        """Train from `state.step` to `train.steps`, logging every step and writing the scheduled checkpoints."""
        cfg, topo = self.cfg, self.topo
        total = cfg.train.steps
        self.dataset = dataset_record(packed.manifest)
        hf_steps = hf_checkpoint_steps(total, cfg.checkpoint)
        peak = self.peak_flops
        logger = StepLogger(self.run_dir, cfg, self.state.step, total, self.state.wandb_id) if topo.is_main else None
        profiler = self.step_profiler()
        # Under lctrain's own launcher the command that launched the ranks says it when the SIGTERM reaches it: a
        # SIGTERM only the ranks get there is the launcher's, after another rank died, and no step will be finished.
        own_launcher = is_supervised() and under_launcher()
        said = SIGTERM_SAID if topo.is_main and not own_launcher else None
        stop = StopRequest(said) if cfg.checkpoint.on_sigterm else None
        # a launcher the user started resumes the run itself: its command line is theirs
        resume = None if is_supervised() or not under_launcher() else _launcher_resume(self.run_dir)
        watchdog = StepWatchdog(
            cfg.train.step_timeout_minutes and 60 * cfg.train.step_timeout_minutes,
            topo.rank,
            self.run_dir.ranks_dir,
            world=topo.layout.world,
            then=lambda: ckpt.resume_hint(self.run_dir, resume),
            on_hang=self.hung,
        )
        heldout = self.heldout_loss(packed)
        try:
            with stop or contextlib.nullcontext():
                self._steps(packed, hf_steps, peak, logger, profiler, stop, watchdog, heldout)
        finally:
            watchdog.close()
            profiler.close()
            if logger is not None:
                logger.close()

    def _steps(
        self,
        packed,
        hf_steps: range,
        peak: float | None,
        logger: StepLogger | None,
        profiler: StepProfiler,
        stop: StopRequest | None,
        watchdog: StepWatchdog,
        heldout: HeldoutLoss | None,
    ) -> None:
        """`fit`'s loop; on a `stop` request, the run ends after the step under way with a checkpoint of it. The
        `watchdog` watches the steps its module says."""
        cfg, topo = self.cfg, self.topo
        total = cfg.train.steps
        first = self.state.step
        for step_index in range(first, total):
            watched = step_index > first and not profiler.slowed(step_index)
            if watched:
                watchdog.arm(step_index + 1)
            mem_scope = reset_peak(topo.device)
            profiler.before(step_index)
            result, seconds = timed(lambda i=step_index: self.train_step(self.read_windows(packed, i)), topo.device)
            profiler.after(step_index)
            try:
                check_finite(result, step_index, cfg, self.run_dir)
            except RunFailed:
                if self.diverged_at is None:  # the session's record says so, as metrics.jsonl would have
                    self.diverged_at = step_index + 1
                raise
            peak_mem = largest_peak_bytes(topo.device)
            self.state.step = step_index + 1
            scored = heldout is not None and heldout_due(self.state.step, total, cfg.train.heldout_every)
            held = timed(lambda: heldout(self.engine), topo.device) if scored else None
            if logger is not None:
                warning = divergence_warning(
                    result.loss, self.state.step, self.shape.vocab, warned=self.diverged_at is not None
                )
                if warning is not None:
                    self.diverged_at = self.state.step
                record = self.metrics(step_index, result, seconds, peak, peak_mem, mem_scope)
                if held is not None:  # its time is the step's own, not in step_time_s
                    (loss, _), held_s = held
                    record |= {"heldout_loss": loss, "heldout_ppl": math.exp(loss), "heldout_time_s": held_s}
                diverged = self.diverged_at is not None
                logger.log({**record, "profiled": profiler.slowed(step_index), "diverged": diverged})
                if warning is not None:  # after the step's own line
                    say(warning)
            if watched:
                watchdog.disarm()
            if profiler.finished(step_index) and topo.is_main:  # after the step's own line
                print(profile_line(profiler.out, cfg.logging.profile.ranks, profiler.top), flush=True)
            # the resume checkpoint first: an export that fails (a full disk) then loses no step of the run, and
            # `lctrain export` can write the export from the checkpoint
            saved = resume_checkpoint_due(self.state.step, total, cfg.checkpoint)
            if saved:
                self.save_checkpoint()
            exported = self.state.step in hf_steps
            if exported:
                self.export_hf()
            if exported or saved or profiler.finished(step_index):
                ckpt.barrier()  # peers that waited for a rank's writes start the next (watched) step with it
            if stop is not None and self.state.step < total and self.stop_agreed(stop):
                if not saved:
                    self.save_checkpoint()
                raise Terminated(
                    f"stopped by SIGTERM after step {self.state.step} of {total}, checkpoint "
                    f"{self.run_dir.checkpoint(self.state.step).name} written; 'lctrain resume "
                    f"{self.run_dir}' continues from it"
                )

    def heldout_loss(self, packed) -> HeldoutLoss | None:
        """The held-out scorer of `train.heldout_every` (None: off, or no window held out, which rank 0 says)."""
        cfg = self.cfg
        if not cfg.train.heldout_every:
            return None
        rows, _ = heldout_rows(len(packed), cfg.windows_read(), cfg.seed, cfg.eval.ppl_windows)
        if not rows:
            if self.topo.is_main:
                say(
                    f"warning: train.heldout_every: no held-out window to score (eval.ppl_windows = "
                    f"{cfg.eval.ppl_windows}, and train.steps x train.global_batch = {cfg.windows_read():,} window "
                    f"reads of the {len(packed):,} prepared); the run logs no held-out loss"
                )
            return None
        return HeldoutLoss(packed, rows, self.topo)

    def hung(self, record: HangRecord) -> None:
        """The step watchdog's end of this process; rank 0 says first in sessions.jsonl how the session ended."""
        if self.session_ended is not None:
            self.session_ended(record.what)
        end_process(record)

    def stop_agreed(self, stop: StopRequest) -> bool:
        """Whether any rank was asked to stop (every rank decides alike: one all-reduce at the step's end, where a
        checkpoint holds exactly the steps taken)."""
        asked = torch.tensor([1.0 if stop.requested else 0.0], device=self.topo.device)
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        return asked.item() > 0

    def step_profiler(self) -> StepProfiler:
        """`logging.profile` on this rank: which steps the run profiles (none where they are behind a resumed
        run), and whether this rank writes a trace of them."""
        cfg, topo = self.cfg.logging.profile, self.topo
        steps = ProfiledSteps.of(cfg.start, cfg.steps, self.cfg.train.steps, resumed_at=self.state.step)
        if cfg.start is not None and steps is None and topo.is_main:
            say(
                f"logging.profile: steps {cfg.start}-{cfg.start + cfg.steps - 1} are before step "
                f"{self.state.step + 1}, where this run resumes: nothing is profiled"
            )
        return StepProfiler(
            steps,
            self.run_dir.profile_dir,
            writes=cfg.ranks == "all" or topo.rank in cfg.ranks,
            rank=topo.rank,
            device=topo.device,
            memory=cfg.memory,
        )

    def export_hf(self) -> None:
        """The evaluation export of the current step (all ranks call: ZeRO-3 gathers the shards)."""
        with _write_of_step(self.run_dir, self.state.step, self.cfg.train.steps, EXPORT):
            ckpt.save_hf(
                self.engine,
                self.lm,
                self.tokenizer,
                self.anchor,
                self.run_dir,
                self.state.step,
                rank=self.topo.rank,
                zero_stage=self.cfg.parallel.zero_stage,
                cfg=self.cfg,
            )

    def save_checkpoint(self) -> None:
        """The resume checkpoint of the current step: DeepSpeed's state, every rank's RNG and the `TrainState`."""
        with _write_of_step(self.run_dir, self.state.step, self.cfg.train.steps, CHECKPOINT):
            ckpt.save_resume(
                self.engine,
                self.run_dir,
                self.state.step,
                self.state.record(self.cfg, self.layout, self.dataset),
                rank=self.topo.rank,
                keep=self.cfg.checkpoint.keep,
                sync=self.cfg.checkpoint.sync_files,
                before_complete=self.before_checkpoint_complete,
            )

    def load_checkpoint(self) -> None:
        """Restore the newest checkpoint every rank can load; a damaged one is reported and the one before it tried.
        The ranks decide together (one all-reduce per try), so they never resume from different steps."""
        rd, topo = self.run_dir, self.topo
        if topo.is_main:
            ckpt.remove_leftovers(rd)
        tried, reconvert = [], []
        for path in ckpt.resume_candidates(rd):
            changed = ckpt.changed_on_disk(path, topo.device)  # every rank, before a load that would take its bytes
            record, why, conversion_failed = (
                ckpt.Restored(None, changed)
                if changed
                else ckpt.load_resume(self.engine, path, rank=topo.rank, now=settings(self.cfg))
            )
            failed = torch.tensor([float(record is None), float(conversion_failed)], device=topo.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed[0].item() == 0:
                if tried and topo.is_main:
                    say(f"warning: resuming from {path.name}: the newer {', '.join(tried)} could not be loaded")
                self.state = TrainState.from_record(record)
                apply_optimizer_settings(self.engine, self.cfg.train, self.state.step)
                if topo.is_main:
                    if record.get("config_fingerprint") != config_fingerprint(self.cfg):
                        changes = settings_changes(record["config"], settings(self.cfg)) if "config" in record else {}
                        named = f" ({shown_changes(changes)})" if changes else ""
                        say(
                            f"note: {rd.config_file} changed since checkpoint {path.name}{named}; continuing with "
                            f"the new values"
                        )
                        rate = resumed_rate_note(self.state.step, record.get("config"), self.cfg.train)
                        if rate:
                            say(rate)
                    logged = rd.truncate_metrics(self.state.step)
                    if logged < self.state.step:
                        say(
                            f"warning: {rd.metrics_file} ends at step {logged}, checkpoint {path.name} at step "
                            f"{self.state.step} (the file was truncated or removed); its curve will miss steps "
                            f"{logged + 1}-{self.state.step}"
                        )
                    # the weights resumed from are of a diverged run when a step up to the checkpoint's diverged
                    self.diverged_at = diverged_step(rd.read_metrics())
                    if self.diverged_at is not None:
                        say(
                            f"note: the run had diverged at step {self.diverged_at} ({rd.metrics_file}), and "
                            f"{path.name} continues it: this session's steps are marked diverged too; to train without "
                            f"it, start over with a lower train.lr, or resume a checkpoint from before step "
                            f"{self.diverged_at}"
                        )
                return
            if topo.is_main:
                say(
                    f"warning: checkpoint {path.name} is damaged ({why or 'on another rank'}); trying the one before it"
                )
                if failed[1].item():
                    # the conversion, not the checkpoint, failed on some rank: a complete conversion is never redone,
                    # so this one would fail every later resume too
                    reshard.discard_conversion(path)
                    reconvert.append(path.name)
            tried.append(path.name)
        if reconvert:
            raise UserError(
                f"{rd}: no checkpoint could be loaded (tried {', '.join(tried)}); the universal conversion of "
                f"{reconvert[0]} could not be loaded and is removed: {cited(f'lctrain resume {quote(str(rd.path))}')} "
                f"converts it again"
            )
        raise UserError(
            f"{rd}: no checkpoint could be loaded (tried {', '.join(tried) or 'none'}); start the run "
            f"again with {cited(rd.start_over_command())}"
        )


def lower_rate_start_over(rd: RunDir, cfg: Config) -> str:
    """`lctrain train --force` of this run with a tenth of its train.lr: advice after a divergence, to copy whole."""
    return rd.start_over_command([f"train.lr={cfg.train.lr / 10:g}"])


def check_finite(result: StepResult, step_index: int, cfg: Config, rd: RunDir) -> None:
    """Stop, before anything of the step is logged or saved, at a loss or gradient norm that is not a number: every
    later step would be too, and a checkpoint of it would hold broken weights. Every rank sees the same reduced
    values, so every rank stops here (`RunFailed`: exit code 1). Under float16 DeepSpeed's loss scaler skips a step
    whose gradients overflowed (a normal event), so only the loss counts there."""
    checked = {"loss": result.loss}
    if cfg.model.dtype != "float16" and result.grad_norm is not None:
        checked["gradient norm"] = result.grad_norm
    bad = [f"{name} is {value}" for name, value in checked.items() if not math.isfinite(value)]
    if not bad:
        return
    step = step_index + 1
    last = ckpt.latest_checkpoint(rd)
    # a checkpoint's weights are judged by the loss of the step after it, computed on them
    rose = loss_rise(rd.read_metrics(), step_of(last) + 1) if last is not None else None
    lower = cited(lower_rate_start_over(rd, cfg))
    resume = cited(f"lctrain resume {quote(str(rd))}")
    earlier = [p.name for p in ckpt.complete_checkpoints(rd) if step_of(p) < step_of(last)] if last else []
    instead = (
        f"resume {earlier[-1]}, the newest kept before it (write its name into {rd.checkpoints / ckpt.LATEST}, lower "
        f"train.lr in {rd.config_file}, then {resume})"
        if earlier
        else "no earlier checkpoint is kept"
    )
    if last is None:
        then = f"no checkpoint was written before it: start over with a lower train.lr, e.g. {lower}"
    elif rose is not None:
        at, best, best_step = rose
        then = (
            f"the last checkpoint, {last.name}, had diverged already (loss {at:.4g} at step {step_of(last) + 1}, "
            f"computed on its weights; {best:.4g} at step {best_step}), so resuming it diverges again whatever the "
            f"rate: start over with a lower train.lr, e.g. {lower}, or {instead}"
        )
    elif step_of(last) == step - 1:
        # the step's loss and gradient are computed on the checkpoint's weights, before any rate of its own applies
        then = (
            f"this step computes on the weights of the last checkpoint, {last.name}, so resuming it fails here again "
            f"whatever the rate: start over with a lower train.lr, e.g. {lower}, or {instead}"
        )
    else:
        then = f"the last checkpoint is {last.name}: lower train.lr in {rd.config_file}, then {resume}"
    lr = learning_rate(step_index, cfg.train)
    raise RunFailed(
        f"step {step}: the {' and the '.join(bad)}; training stopped without logging or saving this step. "
        f"Likely cause: a learning rate too high (train.lr = {cfg.train.lr:g}, {lr:g} at this step) "
        f"or an overflow of the precision (model.dtype = {cfg.model.dtype}); {then}"
    )


# A loss this many times the lowest logged before it, or above the loss of guessing uniformly over the vocabulary
# (ln V) by this factor, is a divergence, not noise: a spike of a healthy run stays well under both.
DIVERGED = 2.0


def loss_rise(records: list[dict], step: int | None) -> tuple[float, float, int] | None:
    """(the loss logged at `step`, the lowest logged before it, that step) when the first is over DIVERGED times the
    second: the weights of `step` had diverged already. None otherwise, or without those records."""
    at = next((r["loss"] for r in records if r["step"] == step), None)
    before = [(r["loss"], r["step"]) for r in records if r["step"] < (step or 0) and math.isfinite(r["loss"])]
    if at is None or not before:
        return None
    best, best_step = min(before)
    return (at, best, best_step) if at > DIVERGED * best else None


def divergence_warning(loss: float, step: int, vocab: int, warned: bool) -> str | None:
    """One warning a session, the first time a step's loss passes DIVERGED x ln(vocab), the loss of guessing
    uniformly: the run is diverging. Its loss is finite, so the run goes on to the end (exit code 0): the metrics
    records from that step on and the end summary say it diverged, for the script that reads them."""
    uniform = math.log(vocab)
    if warned or not loss > DIVERGED * uniform:
        return None
    return (
        f"warning: step {step}: loss {loss:.4g} is over {DIVERGED:g} x that of guessing uniformly over the "
        f"{vocab:,}-token vocabulary ({uniform:.2f}): training is diverging; lower train.lr and start over, or resume "
        f"a checkpoint from before (the newest checkpoint.keep are kept)"
    )


@contextlib.contextmanager
def _write_of_step(rd: RunDir, step: int, total: int, what: str):
    """A full disk or a lost permission while writing the step's resume checkpoint or evaluation export (`what`) is
    the user's to fix, not a crash: the complete checkpoints are intact (each is renamed into place), so say in one
    line what failed, the remedy for its cause and what continues the run."""
    try:
        yield
    except WriteFailed as e:
        cause, path, error = e.cause, e.path, e.__cause__ or e
    except UserError:
        raise
    except Exception as e:  # one not through `errors.writing` (a gather's file, a library's own write)
        if not is_environment_error(e):
            raise
        own = isinstance(e, OSError)
        cause = e.strerror if own and e.strerror else " ".join(str(e).split())[:200]
        path = e.filename if own and e.filename else rd.export(step) if what == EXPORT else rd.checkpoint(step)
        error = e
    else:
        return
    raise UserError(
        f"{rd}: cannot write the step {step} {what} ({cause}) at {path}; {remedy_of(error)}"
        f"{_what_continues(rd, step, total, what)}"
    ) from None


def _unexplained(e: BaseException) -> bool:
    """An error that ends a rank with only its traceback: not a UserError (its own line), a stop or a Ctrl-C."""
    return isinstance(e, Exception) and not isinstance(e, UserError)


def _crash_line(rd: RunDir, step: int, e: Exception) -> str:
    """Rank 0's one line, under a launcher the user started, when it fails with a traceback: most often another rank
    died (gloo's "Connection closed by peer", NCCL's error), which only that launcher's summary names, and the same
    resume continues either way. lctrain's own launcher names a dead rank itself."""
    first = next(iter(str(e).strip().splitlines()), "")
    return (
        f"error: rank 0 failed in step {step + 1} with {type(e).__name__}: {first[:300]} (its traceback follows; "
        f"when a collective failed, another rank stopped first: the launcher's summary names it); "
        f"{ckpt.resume_hint(rd, _launcher_resume(rd))}"
    )


def _launcher_resume(rd: RunDir) -> str:
    """The resume to run under a launcher the user started: their launcher's command line, then lctrain's."""
    return f"... -m lctrain.cli resume {rd.path}"


def _what_continues(rd: RunDir, step: int, total: int, what: str) -> str:
    """What gets the run (and a failed export) back once the cause is fixed: `lctrain resume` from the newest
    checkpoint (none: a new start), which first writes the export of a step whose resume checkpoint is complete
    (`export.write_unwritten_exports`), then trains the rest of the run."""
    last = ckpt.latest_checkpoint(rd)
    if last is None:
        return f"; {ckpt.resume_hint(rd)}"
    if what == EXPORT and step_of(last) == step:
        command = cited(f"lctrain resume {quote(str(rd.path))}")
        more = f" and continues from {last.name}" if step < total else ""
        return f", then {command} writes it from checkpoint {last.name}{more}"
    return f", then {ckpt.resume_hint(rd)}" if (step_of(last) or 0) < total else ""


def check_output_dirs(cfg: Config, rd: RunDir, start_step: int) -> None:
    """Before the first step, on the rank that writes them: the directories this session's resume checkpoints and
    evaluation exports go into can be created and written (`checkpoint.check_output_dir`), each checked only if a
    step after `start_step` writes into it; a run refused here trained nothing."""
    total, plan = cfg.train.steps, cfg.checkpoint
    if plan.on_sigterm or resume_checkpoint_after(start_step, total, plan):
        ckpt.check_output_dir(rd.checkpoints, "resume checkpoints")
    exports = hf_checkpoint_steps(total, plan)
    if exports and exports[-1] > start_step:
        ckpt.check_output_dir(rd.exports_dir, "evaluation exports")


def _grad_norm(module: torch.nn.Module) -> float:
    """Norm of the reduced gradients (identical on every rank without ZeRO), before clipping, accumulated in float64:
    torch's fp32 norm of a 4M-element embedding gradient is off by ~1e-4 on a CPU (one long vectorised sum)."""
    norms = [
        torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64)
        for p in module.parameters()
        if p.grad is not None
    ]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _lambda_lr(optimizer, train_cfg):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, train=train_cfg))


def apply_optimizer_settings(engine, train, next_index: int) -> None:
    """Give the optimizer the config's learning rate, betas, eps and gradient clipping after a checkpoint's state
    restored those it was written with (the scheduler's `base_lrs`, every parameter group's values, the ZeRO
    optimizer's clipping norm): a resume may change them (docs/training.md), e.g. a lower `train.lr` after a
    divergence. `next_index`: the 0-based index of the next update, whose rate the group must hold now (LambdaLR set
    it after the last step)."""
    set_gradient_clipping(engine, train.grad_clip)
    scheduler = engine.lr_scheduler
    scheduler.base_lrs = [train.lr] * len(scheduler.base_lrs)
    for group in scheduler.optimizer.param_groups:
        group.update(lr=learning_rate(next_index, train), betas=tuple(train.betas), eps=train.eps)
