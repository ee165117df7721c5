"""DeepSpeed internals lctrain relies on, each naming the release it was written against (0.19.8); tests/test_compat.py
fails when the installed release is another, so an upgrade re-checks every entry here."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import logging
import math
import os
import sys
import types
from pathlib import Path

from lctrain.errors import writing
from lctrain.files import TEMPORARY_PREFIX, fsync_path
from lctrain.lifetime import exit_with_parent

DEEPSPEED_VERSION = "0.19.8"


def disable_cpu_shm_comm_op() -> None:
    """CPU runs communicate over gloo. DeepSpeed's CPU backend would otherwise JIT-build its shared-memory all-reduce
    op, and deciding whether it can runs `deepspeed.ops`' probe of every op builder: compiler subprocesses, a
    `cannot find -laio` error on machines without libaio, seconds per process. 0.19.8 computes the module attribute
    `__compatible_ops__` lazily and reads it only to decide on that op (`deepspeed.comm.torch.build_shm_op`), so
    placing the answer there first skips both the probe and the build."""
    # deepspeed on use: it takes seconds to import (start-up time)
    import deepspeed.ops

    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


_CPU_FALLBACK_NOTICE = "Setting accelerator to CPU"


def _not_cpu_fallback_notice(record: logging.LogRecord) -> bool:
    return _CPU_FALLBACK_NOTICE not in record.getMessage()


def quiet_cpu_fallback_notice() -> None:
    """0.19.8 warns "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    from every process that imports it on a machine without CUDA (lctrain's, each rank's, accelerate's
    `save_pretrained` in `example-model`): the first lines of every command on a CPU, where the CPU is the device
    asked for. A filter on its logger ("DeepSpeed", which it fetches by name when it builds it), set before it is
    imported and without importing it; its other warnings pass. A GPU that CUDA cannot see still shows: the training
    banner names the device."""
    logging.getLogger("DeepSpeed").addFilter(_not_cpu_fallback_notice)


@contextlib.contextmanager
def no_bf16_optimizer_memory_report():
    """DeepSpeed 0.19.8's `BF16_Optimizer` (bf16 with ZeRO 0-1) prints a memory report at four points of its set-up,
    forced past every log level (`see_memory_usage(..., force=True)`, plain `print`: 15 lines before lctrain's
    banner, in every run's log). It also resets the device's peak-memory counters; lctrain reports its own memory
    plan and per-step peak. Silenced for the engine's construction only."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.runtime import bf16_optimizer

    report = bf16_optimizer.see_memory_usage
    bf16_optimizer.see_memory_usage = lambda *args, **kwargs: None
    try:
        yield
    finally:
        bf16_optimizer.see_memory_usage = report


@contextlib.contextmanager
def no_bf16_optimizer_load_print():
    """0.19.8's `BF16_Optimizer._load_legacy_checkpoint` (every resume of a bf16 run with ZeRO 0-1) prints
    `_load_legacy_checkpoint current_rank_sd[BASE_OPTIMIZER_STATE]` with a bare `print`, once per rank, into the
    run's log between lctrain's resume line and its banner. A module-level `print` shadows the builtin for that
    module's functions alone, and only while a checkpoint loads; what lctrain and other modules print passes."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.runtime import bf16_optimizer

    bf16_optimizer.print = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del bf16_optimizer.print


def grad_divisor(zero_stage: int, dp: int, world: int) -> int:
    """What DeepSpeed 0.19.8 divides the summed gradients by: the data-parallel size for ZeRO 0-2 (the engine's
    `gradient_average` over its data-parallel group), but all ranks (data x sequence parallel) for ZeRO-3's
    reduce-scatter path (`DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`, which divides by the size of the
    sequence-data-parallel group ZeRO shards over), which the layout's DeepSpeed config always selects."""
    return world if zero_stage == 3 else dp


def sequence_parallel_groups(sp: int):
    """DeepSpeed 0.19.8's own Ulysses process-group module: (this rank's sequence-parallel group, the module).
    The module is passed to `deepspeed.initialize(mpu=...)`: the engine reads the sequence-data-parallel group and
    sizes from it (`get_sequence_parallel_world_size`, `get_sequence_data_parallel_group`, ...), which is how ZeRO
    learns to shard over every rank. Its group accessor asserts when the groups do not exist yet."""
    # deepspeed on use: it takes seconds to import (start-up time)
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state

    try:
        group = sp_state.get_sequence_parallel_group()
    except AssertionError:
        sp_state.initialize_sequence_parallel(sequence_parallel_size=sp)
        group = sp_state.get_sequence_parallel_group()
    return group, sp_state


def sequence_parallel_bf16_norm(engine) -> None:
    """Let 0.19.8's `BF16_Optimizer` (bf16 with ZeRO-1, fp32 gradient accumulation: lctrain's bf16 ZeRO-1) measure
    the gradient norm under sequence parallelism. It is handed the engine's `mpu`, which under Ulysses is
    `parallel_state_sp`, and that module aliases the model-parallel rank, size and group to the sequence-parallel
    ones (`get_model_parallel_rank = get_sequence_parallel_rank`). The engine (`groups._get_model_parallel_world_size`)
    and ZeRO-1/2's `DeepSpeedZeroOptimizer` recognise it (`hasattr(mpu, 'initialize_sequence_parallel')`: no model
    parallelism); `BF16_Optimizer` does not: its `get_grads_for_norm` keeps a gradient only on "tensor-parallel rank"
    0, so every sequence-parallel rank but the first collects none and `get_global_norm_of_tensors` fails with
    "stack expects a non-empty TensorList" (any dp, ZeRO-1 + bf16 + sequence_parallel > 1). Its gradients are the
    full ones, all-reduced over every rank, so without an `mpu` each rank measures the whole norm itself, as in
    plain data parallelism; the optimizer reads `mpu` for the norm and clipping only, and the engine keeps its own
    (groups, checkpoint metadata)."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    optimizer = engine.optimizer
    if isinstance(optimizer, BF16_Optimizer) and hasattr(optimizer.mpu, "initialize_sequence_parallel"):
        optimizer.mpu = None


def set_gradient_clipping(engine, max_norm: float) -> None:
    """The gradient norm the engine's optimizer clips to. 0.19.8's ZeRO-1/2 and bf16 optimizers keep it in
    `clip_grad`, which loading a checkpoint sets to the checkpoint's value (`DeepSpeedZeroOptimizer._load_global_state`,
    `BF16_Optimizer.load_state_dict`) over the config's `gradient_clipping`, and save it again with every checkpoint;
    where the optimizer has none (ZeRO-0 in fp32) the engine clips with the config's own."""
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = max_norm


@contextlib.contextmanager
def saves_synced(engine):
    """`engine.save_checkpoint` whose files are on the disk when it returns, as torch.distributed.checkpoint's
    `FileSystemWriter(sync_files=True)` makes its own: 0.19.8's `TorchCheckpointEngine.save` is `torch.save` alone,
    whose data the kernel writes back later, so a machine that crashed (not a killed process) soon after the
    checkpoint was marked complete could leave files of the right sizes whose blocks never reached the disk. Every
    rank's engine saves through its `checkpoint_engine`, so each syncs the files it wrote itself (on a shared
    filesystem, the writer's client holds the data)."""
    checkpoint_engine = engine.checkpoint_engine
    save = checkpoint_engine.save

    def synced(state_dict, path):
        save(state_dict, path)
        fsync_path(Path(path))

    checkpoint_engine.save = synced
    try:
        yield
    finally:
        checkpoint_engine.save = save


def zero3_full_state_dict(engine) -> dict:
    """The full 16-bit state dict gathered from ZeRO-3 shards (all ranks call; rank 0 gets the tensors). DeepSpeed
    0.19.8 has it only as the private `DeepSpeedEngine._zero3_consolidated_16bit_state_dict`, which its public
    `save_16bit_model` calls before writing the file itself; lctrain writes with `save_pretrained` instead."""
    return engine._zero3_consolidated_16bit_state_dict()


def to_universal_checkpoint(source: Path, out: Path, workers: int) -> None:
    """Write DeepSpeed's universal checkpoint of the ZeRO checkpoint in `source` into `out`: every parameter's fp32
    master weight and Adam moments unpartitioned (`out/zero/<param>/`), plus the model-state files, which a run of
    another world size, sequence-parallel degree or ZeRO stage of the same family loads with `loading_universal`.
    0.19.8 offers it as the script `deepspeed/checkpoint/ds_to_universal.py`, whose `main` takes its parsed
    arguments. A plain (non-Megatron) model records no `universal_checkpoint_info`: the script's
    `inject_missing_state` supplies the empty one such a model has. Its tqdm bars (stderr) show the progress of a
    conversion that takes minutes for a 7B model; its `print`s of each stage are kept out of lctrain's log, and
    shown when it fails. It also writes a `latest_universal` file beside `out` naming `out` for a load without a tag;
    lctrain always names the tag, and `out` is renamed after, so the file would name a directory that is gone:
    removed."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(out),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), conversion_workers_die_with_this_process():
            ds_to_universal.main(args)
    except BaseException:
        sys.stderr.write(chatter.getvalue())
        raise
    (out.parent / "latest_universal").unlink(missing_ok=True)


_MODEL_STATES = {False: "mp_rank_00_model_states.pt", True: "zero_pp_rank_0_mp_rank_00_model_states.pt"}
_STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def universal_loads_in(universal: Path, zero_stage: int) -> bool:
    """Whether a ZeRO-`zero_stage` engine (1-3) loads the universal checkpoint in `universal` as it is: its metadata
    file is there, which `universal_for_stage` writes last."""
    return (universal / _MODEL_STATES[zero_stage == 3]).is_file()


def universal_for_stage(universal: Path, zero_stage: int, sync: bool = False) -> None:
    """Make the universal checkpoint in `universal` loadable by a ZeRO-`zero_stage` engine (1-3), whichever ZeRO
    family wrote it.

    0.19.8's conversion writes what the loader of the family it read expects, and its ZeRO-1/2 and ZeRO-3 loaders
    read different forms of the same state (each refused the other's):
    - the file of the run's metadata (the step, the scheduler's state; the weights come from `zero/`):
      `mp_rank_00_model_states.pt` for ZeRO-1/2, `zero_pp_rank_0_mp_rank_00_model_states.pt` for ZeRO-3
      (`DeepSpeedEngine._get_all_ckpt_names`); the other's is written without its `module` weights, which a universal
      load does not read (`_load_checkpoint`);
    - `zero/optimizer_state.pt`: ZeRO-3 reads Adam's step and the groups' settings from `optimizer_state_dict`
      (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`), ZeRO-1/2 the groups from `param_groups` and the
      release from `ds_version` (`_load_global_state`);
    - each parameter's `zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`: ZeRO-1/2 reads `{"param": tensor}` in the
      parameter's shape and the step from `step.pt` (`universal_checkpoint.load_hp_checkpoint_state`); a ZeRO-3
      conversion writes the flat tensor alone and no `step.pt`. ZeRO-3 reads either form.
    Each file is written under a temporary name and renamed, the metadata file last (`universal_loads_in`); a kill
    leaves a temporary file, which the next call removes (the ZeRO-1/2 loader would take any `*.pt` in a parameter's
    folder for a state) before it finishes the work. `sync`: each file is on the disk before its rename, so the
    metadata file is there after a machine's crash only with the files before it."""
    import torch  # on use: this module loads without it (the CLI's start-up time)

    def save(obj, path: Path) -> None:
        tmp = path.with_name(TEMPORARY_PREFIX + path.name)
        with writing(path, "the universal checkpoint"):
            torch.save(obj, tmp)
            if sync:
                fsync_path(tmp)
            os.replace(tmp, path)

    for stale in universal.glob(f"zero/*/{TEMPORARY_PREFIX}*"):
        stale.unlink()
    wanted, other = universal / _MODEL_STATES[zero_stage == 3], universal / _MODEL_STATES[zero_stage != 3]
    if wanted.is_file():
        return
    meta = torch.load(other, map_location="cpu", mmap=True, weights_only=False)
    optim_file = universal / "zero" / "optimizer_state.pt"
    optim = torch.load(optim_file, map_location="cpu", weights_only=False)
    if zero_stage == 3:
        if "optimizer_state_dict" not in optim:  # a ZeRO-1/2 conversion: every parameter's step.pt holds the step
            step_file = next(universal.glob("zero/*/step.pt"), None)
            if step_file is None:  # a damaged conversion: the resume says so in one line and tries the one before
                raise ValueError(f"{universal}: no parameter's step.pt (a ZeRO-1/2 conversion holds one for each)")
            step = torch.load(step_file, weights_only=False)
            sd = {"state": {0: {"step": step}}, "param_groups": optim["param_groups"]}
            save({**optim, "optimizer_state_dict": sd}, optim_file)
    else:
        step = optim["optimizer_state_dict"]["state"][0]["step"]
        for name, shape in ((n, s) for group in meta["param_shapes"] for n, s in group.items()):
            folder = universal / "zero" / name
            for key in _STATE_KEYS:
                state = torch.load(folder / f"{key}.pt", map_location="cpu", mmap=True, weights_only=False)
                if torch.is_tensor(state):
                    save({"param": state.view(shape)}, folder / f"{key}.pt")
            if not (folder / "step.pt").is_file():
                save(step, folder / "step.pt")
        if "ds_version" not in optim:
            save({**optim, "ds_version": meta["ds_version"]}, optim_file)
    save({**meta, "module": {}}, wanted)


@contextlib.contextmanager
def conversion_workers_die_with_this_process():
    """0.19.8's `ds_to_universal` extracts and merges on a `ProcessPoolExecutor` of forked workers: after a `kill -9`
    of this process (the out-of-memory killer, likeliest while the whole optimizer state is read) they waited
    forever on their task queue, whose write end each holds, and held the run directory's lock they inherited, so
    every later `resume` was refused. The module's name is given a pool whose workers watch this process and exit
    when it is gone (`lifetime.exit_with_parent`), for the conversion only. Its tqdm bars are drawn on a terminal
    only (`disable=None`): in a log file they were lines of carriage returns."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.checkpoint import ds_to_universal

    real_pool, real_tqdm = ds_to_universal.ProcessPoolExecutor, ds_to_universal.tqdm
    ds_to_universal.ProcessPoolExecutor = functools.partial(real_pool, initializer=exit_with_parent)
    ds_to_universal.tqdm = types.SimpleNamespace(tqdm=functools.partial(real_tqdm.tqdm, disable=None))
    try:
        yield
    finally:
        ds_to_universal.ProcessPoolExecutor, ds_to_universal.tqdm = real_pool, real_tqdm


def _not_tp_size_notice(record: logging.LogRecord) -> bool:
    return "MPU is not provided" not in record.getMessage()


@contextlib.contextmanager
def loading_universal(engine):
    """`engine.load_checkpoint` reading a universal checkpoint. 0.19.8 reads the choice from the engine's config
    (`checkpoint.load_universal`) at each load and nowhere else, so one engine can load a universal checkpoint and
    fall back to an ordinary one; the public config would fix it for the engine's life.

    ZeRO-1/2's universal load asks the optimizer's `mpu` for the tensor-parallel size; under sequence parallelism
    that is DeepSpeed's own `parallel_state_sp`, which has no such function (AttributeError). lctrain has no tensor
    parallelism, so the load runs with no `mpu`, which it reads as tensor-parallel size 1, and warns "MPU is not
    provided, setting tp size to 1" on every rank: right, and not shown.

    0.19.8's ZeRO-3 universal load gives every parameter group the first group's hyperparameters
    (`load_hp_checkpoint_state_from_checkpoint_dir_stage3`: "Generally, the hyperparameters of each parameter should
    be the same"), so the norms' and biases' group (no weight decay unless `train.decay_norms_and_biases`) would be
    decayed from then on: measured, the second step after such a resume lost 2e-5 of the loss's relative agreement.
    Each group's weight decay is put back as the engine was built with it, which `resume` has checked is the
    checkpoint's (`train.weight_decay` and `decay_norms_and_biases` are fixed by a checkpoint). The same load also
    gives every group's Adam state one shared `step` tensor, which torch's Adam increments in place once per group:
    the second group's step would count two per update, and its bias correction drift. Each state gets its own."""
    import torch  # on use: this module loads without it (the CLI's start-up time)

    config, log, optimizer = engine._config, logging.getLogger("DeepSpeed"), engine.optimizer
    before, mpu = config.load_universal_checkpoint, getattr(optimizer, "mpu", None)
    decay = [group["weight_decay"] for group in optimizer.param_groups]
    config.load_universal_checkpoint = True
    log.addFilter(_not_tp_size_notice)
    if mpu is not None:
        optimizer.mpu = None
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
        log.removeFilter(_not_tp_size_notice)
        if mpu is not None:
            optimizer.mpu = mpu
        for group, value in zip(optimizer.param_groups, decay, strict=True):
            group["weight_decay"] = value
        for state in getattr(optimizer, "optimizer", optimizer).state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def exact_shards(rows: int, shards: int) -> int:
    """The number of pieces `torch.chunk` really cuts `rows` into when asked for `shards` (fewer when the chunk size
    ceil(rows / shards) does not fit that often: 10 rows in 6 asks -> 5 pieces of 2). DeepSpeed 0.19.8's TiledMLP
    backward marks the weights' gradients ready (`ds_grad_is_ready`) only at piece number `shards`, and ZeRO's
    gradient hooks (stage 1-2 and 3) skip a gradient that is not ready, so it must be given the exact count or the
    MLP gradients would never be reduced."""
    size = math.ceil(rows / min(shards, rows))
    return math.ceil(rows / size)


def tiled_mlp_apply(fn, mlp, x, shards: int, params: list):
    """`ulysses_sp.TiledMLP.apply` with the piece count `torch.chunk` really cuts (`exact_shards`): `fn(mlp, x)` on
    slices of the sequence, recomputed slice by slice in the backward."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    return TiledMLP.apply(fn, mlp, x, exact_shards(x.numel() // x.shape[-1], shards), params)


def checkpoint_offload_context():
    """DeepSpeed 0.19.8's `CheckpointHiddenStatesOffload` (runtime/activation_checkpointing/offload_activations.py,
    which `deepspeed` does not export): saved-tensor hooks that move the hidden states each transformers
    `GradientCheckpointingLayer` checkpoints (its first positional argument, when the layer is training with
    `gradient_checkpointing` set) to pinned host memory on a side stream, and copy them back when the backward
    unpacks them. It finds them by wrapping `GradientCheckpointingLayer.__call__` while a context is active, and
    leaving the context drops whatever was not restored, so one context must hold a forward *and* its backward. The
    newest layer input stays on the device (the backward needs it first). A synchronized device (DeepSpeed's CPU
    accelerator) has no copy streams and its tensors are already in host memory: there every marked tensor is
    skipped and stays where it is, which is the same computation with no saving. Reusable: entering resets it and
    keeps its pool of host buffers for the next micro-batch.

    One change: DeepSpeed's unpack keeps every restored hidden state on the device until the context exits (its
    `_restore_tensor(cache=True)`, for graphs backpropagated twice), so by the end of the backward all of them are
    back and the step's peak is not lowered: measured on an H100 (a 16-layer, hidden-2048 Llama at 32K tokens, bf16),
    the memory after the forward fell from 2.52 to 0.77 GiB but the peak rose from 5.93 to 7.34 GiB. The trainer
    backpropagates each graph once, so here a restored hidden state is handed over (`cache=False`) and freed once its
    layer's recomputation has used it; a second unpack of one tensor fails loudly ("no longer tracked")."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        CheckpointHiddenStatesOffload,
        _OffloadedTensorRef,
    )

    class HandOverOffload(CheckpointHiddenStatesOffload):
        def _unpack_tensor(self, maybe_ref):
            if isinstance(maybe_ref, _OffloadedTensorRef):
                return self._restore_tensor(maybe_ref.tensor_id, cache=False)
            return maybe_ref

    return HandOverOffload()


# The files of a DeepSpeed 0.19.8 checkpoint (`engine.save_checkpoint`, one tag directory) that hold the module: ZeRO
# 0-2 write the whole module's state dict (its own dtype: the bf16 weights of a mixed-precision run, not the fp32
# master copy) into one file; ZeRO-3 one file per rank whose 'module' holds empty placeholders for the parameters,
# which live only as the fp32 partitions of the optimizer files.
MODULE_FILE = "mp_rank_00_model_states.pt"
ZERO3_MODULE_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def module_state_dict(checkpoint: Path) -> dict:
    """The module's state dict in a ZeRO 0-2 checkpoint directory (keys as the module DeepSpeed wrapped names them),
    memory-mapped: a tensor is read when it is used, and the optimizer state beside it in ZeRO-0's file not at all.
    DeepSpeed's `zero_to_fp32` reads the fp32 master weights instead and refuses ZeRO-1 bf16 checkpoints, whose
    optimizer files are BF16_Optimizer's."""
    import torch  # on use: this module loads without it (the CLI's start-up time)

    # weights_only=False: the file pickles DeepSpeed's own objects beside the tensors
    return torch.load(checkpoint / MODULE_FILE, map_location="cpu", mmap=True, weights_only=False)["module"]


def zero3_fp32_state_dict(checkpoint: Path) -> dict:
    """The fp32 master weights of a ZeRO-3 checkpoint directory, by the wrapped module's parameter names (tied
    parameters one object under both names), plus its buffers, without an engine or process group: 0.19.8's
    `zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)`. Each parameter is a `GatheredTensor`
    whose `contiguous()` concatenates its slices of every rank's partition into one fp32 tensor, and the optimizer
    files are memory-mapped (their Adam moments dropped), so what it holds at once is the partitions' pages and the
    tensor being gathered. Its prints of each stage and its tqdm bars are kept out of the log: `lctrain export`
    reports its own progress, and a checkpoint it cannot read in one line."""
    # deepspeed on use: it takes seconds to import (start-up time)
    from deepspeed.utils import zero_to_fp32

    bar = zero_to_fp32.tqdm
    zero_to_fp32.tqdm = functools.partial(bar, disable=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                str(checkpoint.parent), tag=checkpoint.name, lazy_mode=True
            )
    finally:
        zero_to_fp32.tqdm = bar
