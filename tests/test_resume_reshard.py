"""`lctrain resume RUN --set parallel...`: a checkpoint written by one parallel layout continues on another.

The reference is an uninterrupted 1-process run of all the steps. Each resharded run trains the first half in one
layout, then `resume` converts the checkpoint to DeepSpeed's universal form and trains the rest in another; its
losses must be the reference's. Tolerance: the losses are fp32 sums over the same tokens in another order and on other
ranks (a few ulps per step; 1e-5 relative is ~100x that), while a checkpoint restored wrongly (moments lost, a shard
in the wrong place, the wrong step) changes the first resumed loss by far more, as the negative control shows.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from train_helpers import clean_env, losses, one_error_line, prepared_workdir, reference_run, run_cli_train, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.compat.deepspeed import loading_universal
from lctrain.config import load_config, settings, with_overrides
from lctrain.errors import UserError
from lctrain.parallel.groups import init_topology
from lctrain.rundir import RunDir
from lctrain.train import reshard
from lctrain.train.command import train
from lctrain.train.runplan import Prepared
from lctrain.train.trainer import Trainer

STEPS = 4
ARCH = (
    "{model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 1, tie_word_embeddings: false}"
)
LOSS_RTOL = 1e-5


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [
        "data.seq_len=128",
        "data.token_budget=12000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.global_batch=4",
        "train.micro_batch=1",
        "train.warmup_steps=0",
        "train.lr=3e-3",
        "train.grad_clip=0",
        "checkpoint.every_steps=2",
        "checkpoint.hf_last=0",
        "parallel.zero_stage=2",
        f"model.arch={ARCH}",
    ]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "reshard", overrides)


@pytest.fixture(scope="module")
def reference(workdir):
    return reference_run(workdir, overrides)


def resume(run_dir: Path, items: list[str]) -> str:
    """`lctrain resume RUN --set ...` in a subprocess (it may launch ranks); its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "lctrain.cli", "resume", str(run_dir), *set_args(items)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def assert_continues_the_reference(run_dir: Path, reference: Path) -> None:
    got, want = losses(run_dir), losses(reference)
    assert len(got) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0)


def assert_resharded(run_dir: Path, out: str, changed: str, parallel: dict) -> None:
    """Converted once, for the keys that changed, and the run's config now says the new layout."""
    step = RunDir(run_dir).checkpoint(STEPS // 2)
    assert f"resuming on another parallel layout ({changed} changed): converting {step.name}" in out
    assert reshard.universal_dir(step).is_dir()
    assert not (step / "latest_universal").exists()  # DeepSpeed's marker would name the temporary directory
    written = yaml.safe_load(RunDir(run_dir).config_file.read_text())["parallel"]
    assert {k: written[k] for k in parallel} == parallel


def train_half(workdir: Path, name: str, extra: list[str]) -> Path:
    """The first half of a run, in this process (1 process: no launcher)."""
    run_dir = workdir / name
    train(load_config(None, overrides(workdir / "data", run_dir) + [f"train.steps={STEPS // 2}", *extra]))
    return run_dir


def resume_here(run_dir: Path, items: list[str]):
    result = CliRunner().invoke(app, ["resume", str(run_dir), *set_args(items)])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.slow  # ~7 s with the reference run: `make test` keeps the exact check of the load below
def test_a_zero2_checkpoint_continues_as_zero1(workdir, reference):
    """In this process, the conversion and the universal load without a launcher: ZeRO-2 -> ZeRO-1; the leftover of
    a conversion killed before is not taken for a finished one."""
    run_dir = train_half(workdir, "zero2_to_1", [])
    killed = RunDir(run_dir).checkpoint(STEPS // 2) / ".tmp-universal"  # what a conversion killed mid-way leaves
    killed.mkdir()
    (killed / "zero").write_text("half")
    out = resume_here(run_dir, [f"train.steps={STEPS}", "parallel.zero_stage=1"])
    assert_resharded(run_dir, out, "parallel.zero_stage", {"zero_stage": 1})
    assert not killed.exists()
    assert_continues_the_reference(run_dir, reference)


@pytest.mark.slow  # ~6 s: a half run, a refused resume and one that converts again, in this process
def test_a_conversion_that_cannot_be_loaded_is_removed_and_made_again(workdir, reference):
    """A complete universal conversion is never redone, so one damaged after it was written (a parameter's fp32
    state truncated) failed this resume and every later one, with advice to start the run over."""
    run_dir = train_half(workdir, "damaged_conversion", [])
    step = RunDir(run_dir).checkpoint(STEPS // 2)
    reshard.convert(step, ["parallel.zero_stage"], 1)
    fp32 = next(reshard.universal_dir(step).glob("zero/*/fp32.pt"))
    fp32.write_bytes(fp32.read_bytes()[:100])
    result = CliRunner().invoke(
        app, ["resume", str(run_dir), *set_args([f"train.steps={STEPS}", "parallel.zero_stage=1"])]
    )
    assert one_error_line(result) == (
        f"error: {run_dir}: no checkpoint could be loaded (tried step_2); the universal conversion of step_2 could "
        f"not be loaded and is removed: 'lctrain resume {run_dir}' converts it again"
    )
    assert "warning: checkpoint step_2 is damaged (its universal conversion: " in result.output
    assert not reshard.universal_dir(step).exists() and step.is_dir()
    out = resume_here(run_dir, [])  # config.yaml says ZeRO-1 since the refused resume
    assert_resharded(run_dir, out, "parallel.zero_stage", {"zero_stage": 1})
    assert_continues_the_reference(run_dir, reference)


@pytest.mark.slow  # ~7 s: a half run and its resume, in this process
def test_a_resume_may_split_the_step_otherwise_and_tile_the_mlp(workdir, reference):
    """What `lctrain plan` offers a run that ran out of memory (checkpointing explorer: resume refused both): one
    window per pass becomes two (the step's windows stay the same) and the MLP runs in sequence slices."""
    run_dir = train_half(workdir, "micro_batch_2", [])
    out = resume_here(run_dir, [f"train.steps={STEPS}", "train.micro_batch=2", "model.tiled_mlp=2"])
    assert "converting" not in out
    assert_continues_the_reference(run_dir, reference)


@pytest.mark.slow
def test_a_restore_that_loses_adams_moments_is_told_apart(workdir, reference):
    """Negative control: the same conversion with Adam's first moments zeroed before the load. The first resumed loss
    is computed before any update from the restored weights, so it still matches; the next one, after an update
    with the wrong moments, must be far outside the tolerance, or the comparisons above could not see a bad restore."""
    run_dir = train_half(workdir, "moments_lost", [])
    step = RunDir(run_dir).checkpoint(STEPS // 2)
    reshard.convert(step, ["parallel.zero_stage"], 1)
    moments = list(reshard.universal_dir(step).glob("zero/*/exp_avg.pt"))
    assert moments
    for path in moments:  # ZeRO-1/2's universal files hold {"param": tensor, ...}
        state = torch.load(path)
        torch.save({k: torch.zeros_like(v) if torch.is_tensor(v) else v for k, v in state.items()}, path)
    out = resume_here(run_dir, [f"train.steps={STEPS}", "parallel.zero_stage=1"])
    assert "converting" not in out  # the universal checkpoint there is loaded as it is
    got, want = losses(run_dir), losses(reference)
    assert got[STEPS // 2] == pytest.approx(want[STEPS // 2], rel=LOSS_RTOL)
    assert abs(got[STEPS // 2 + 1] - want[STEPS // 2 + 1]) > 100 * LOSS_RTOL * abs(want[STEPS // 2 + 1])


def optimizer_state(engine) -> tuple[list, list]:
    """(each fp32 master partition with its Adam state, each group's hyperparameters) of a ZeRO engine. ZeRO-3 hands
    its flat partitions to the inner optimizer only during a step; ZeRO-1/2 and bf16's optimizer keep them there."""
    zero = engine.optimizer
    inner = zero.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or [p for g in inner.param_groups for p in g["params"]]
    state = [(flat.detach().clone(), {k: v.clone() for k, v in inner.state[flat].items()}) for flat in flats]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return state, groups


@pytest.mark.parametrize(
    "zero_stage, dtype",
    [
        (3, "float32"),
        pytest.param(1, "bfloat16", marks=pytest.mark.slow),  # DeepSpeed's BF16_Optimizer: bf16 with ZeRO-1
        pytest.param(2, "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_the_universal_load_restores_the_optimizer_exactly(workdir, zero_stage, dtype):
    """The universal load against the ordinary load of the same checkpoint, and one step after each: the fp32
    weights, Adam's moments and step count, and each group's hyperparameters are the same to the bit. (DeepSpeed
    0.19.8 alone gives ZeRO-3's norms' group the matrices' weight decay and both groups one step counter, which then
    counts two per update: lctrain.compat.deepspeed.loading_universal puts both right.)"""
    run_dir = train_half(
        workdir, f"state_zero{zero_stage}_{dtype}", [f"parallel.zero_stage={zero_stage}", f"model.dtype={dtype}"]
    )
    step = RunDir(run_dir).checkpoint(STEPS // 2)
    reshard.convert(step, ["parallel.offload_optimizer"], zero_stage)
    cfg = RunDir(run_dir).read_config()
    topo = init_topology(cfg)
    prepared = Prepared.of(cfg, topo.layout)
    states = []
    for universal in (False, True):
        trainer = Trainer(cfg, topo, vocab_size=prepared.packed.manifest.tokenizer.vocab_size, plan=prepared.plan)
        if universal:
            with loading_universal(trainer.engine):
                trainer.engine.load_checkpoint(str(step), tag=reshard.UNIVERSAL, load_optimizer_states=True)
        else:
            trainer.engine.load_checkpoint(str(step.parent), tag=step.name, load_optimizer_states=True)
        loaded = optimizer_state(trainer.engine)
        trainer.train_step(trainer.read_windows(prepared.packed, STEPS // 2))
        states.append((loaded, optimizer_state(trainer.engine)))
    (ordinary, ordinary_after), (universal, universal_after) = states
    for want, got in ((ordinary, universal), (ordinary_after, universal_after)):
        assert got[1] == want[1]  # hyperparameters, weight decay per group included
        for (flat_w, state_w), (flat_g, state_g) in zip(want[0], got[0], strict=True):
            assert torch.equal(flat_g, flat_w)
            assert state_g.keys() == state_w.keys()
            for key in state_w:
                assert torch.equal(state_g[key], state_w[key]), key
    assert len({float(s["step"]) for _, s in universal_after[0]}) == 1


def full_states(engine) -> dict[str, list[torch.Tensor]]:
    """{name: [fp32 master weight, Adam's moments, step]} of every parameter, whole, at any ZeRO stage (DeepSpeed's
    public `safe_get_full_*`, which gather a partitioned one; at ZeRO-1/2 after a universal load only)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    (step,) = {float(s["step"]) for s in engine.optimizer.optimizer.state.values()}
    return {
        name: [
            safe_get_full_fp32_param(p),
            safe_get_full_optimizer_state(p, "exp_avg"),
            safe_get_full_optimizer_state(p, "exp_avg_sq"),
            torch.tensor(step),
        ]
        for name, p in engine.module.named_parameters()
    }


def converted_states(universal: Path, names) -> dict[str, list[torch.Tensor]]:
    """The same, read from the files of DeepSpeed's conversion: ZeRO-1/2's hold {"param": tensor} and a step.pt,
    ZeRO-3's the flat tensor and its step in optimizer_state.pt."""
    optim = torch.load(universal / "zero" / "optimizer_state.pt", weights_only=False)
    states = {}
    for name in names:
        folder = universal / "zero" / name
        tensors = [torch.load(folder / f"{key}.pt", weights_only=False) for key in ("fp32", "exp_avg", "exp_avg_sq")]
        tensors = [t["param"] if isinstance(t, dict) else t for t in tensors]
        if (folder / "step.pt").is_file():
            step = torch.load(folder / "step.pt", weights_only=False)
        else:
            step = optim["optimizer_state_dict"]["state"][0]["step"]
        states[name] = [*tensors, torch.tensor(float(step))]
    return states


@pytest.mark.parametrize(
    "before, after, dtype",
    [
        (3, 1, "float32"),  # the rewrite of every parameter's state; the other ways are slow-marked for the budget
        pytest.param(2, 3, "float32", marks=pytest.mark.slow),
        pytest.param(1, 3, "bfloat16", marks=pytest.mark.slow),  # from DeepSpeed's BF16_Optimizer
        pytest.param(3, 2, "bfloat16", marks=pytest.mark.slow),
    ],
)
def test_a_checkpoint_loads_in_the_other_zero_family_with_every_parameters_state(
    workdir, before, after, dtype, monkeypatch
):
    """ZeRO-1/2 <-> ZeRO-3 (refused until DeepSpeed 0.19.8's two forms of the universal checkpoint were completed
    into each other): every parameter's fp32 weight, Adam moments and step, loaded at the other stage, are those of
    DeepSpeed's conversion for the checkpoint's own stage, to the bit (which are the ordinary load's:
    test_the_universal_load_restores_the_optimizer_exactly). The checkpoint is first converted for its own family
    (a resume on another world size), then completed for the other with a kill's leftover in a parameter's folder;
    every file the two wrote was synced to the disk (checkpoint.sync_files) before it got its name."""
    run_dir = train_half(
        workdir, f"family_{before}_{after}_{dtype}", [f"parallel.zero_stage={before}", f"model.dtype={dtype}"]
    )
    step = RunDir(run_dir).checkpoint(STEPS // 2)
    universal = reshard.universal_dir(step)
    synced, real_fsync = set(), os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.add(Path(os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    reshard.convert(step, ["parallel.nproc_per_node"], before)
    assert not reshard.converted_for(step, after)
    cfg = with_overrides(RunDir(run_dir).read_config(), [f"parallel.zero_stage={after}"], "test")
    topo = init_topology(cfg)
    prepared = Prepared.of(cfg, topo.layout)
    trainer = Trainer(cfg, topo, vocab_size=prepared.packed.manifest.tokenizer.vocab_size, plan=prepared.plan)
    names = [name for name, _ in trainer.engine.module.named_parameters()]
    want = converted_states(universal, names)
    leftover = universal / "zero" / names[0] / ".tmp-fp32.pt"
    leftover.write_bytes(b"half")
    assert reshard.convert(step, ["parallel.zero_stage"], after) > 0
    assert reshard.converted_for(step, after) and reshard.converted_for(step, before) and not leftover.exists()
    assert reshard.convert(step, ["parallel.zero_stage"], after) == 0.0
    for file in universal.rglob("*.pt"):
        partial = step / ".tmp-universal" / file.relative_to(universal)
        assert {partial, file.with_name(".tmp-" + file.name)} & synced, file
    with loading_universal(trainer.engine):
        trainer.engine.load_checkpoint(str(step), tag=reshard.UNIVERSAL, load_optimizer_states=True)
    assert trainer.engine.global_steps == STEPS // 2
    got = full_states(trainer.engine)
    assert got.keys() == want.keys()
    for name, tensors in want.items():
        for w, g in zip(tensors, got[name], strict=True):
            assert torch.equal(g, w.view_as(g)), name


@pytest.mark.slow  # ~10 s: a half run at ZeRO-3 and its resume at ZeRO-2, in this process
def test_a_zero3_checkpoint_continues_as_zero2(workdir, reference):
    """The conversion from ZeRO-3 and its completion for ZeRO-1/2 in one go, through `lctrain resume`: the losses
    continue the reference's."""
    run_dir = train_half(workdir, "zero3_to_2", ["parallel.zero_stage=3"])
    out = resume_here(run_dir, [f"train.steps={STEPS}", "parallel.zero_stage=2"])
    assert_resharded(run_dir, out, "parallel.zero_stage", {"zero_stage": 2})
    assert_continues_the_reference(run_dir, reference)


@pytest.mark.slow  # ~3 s with the reference run's 6 s, which no fast test needs
def test_a_zero3_run_with_selective_checkpointing_resumes(workdir, reference):
    """Without a layout change. ZeRO-3's load left its persistent parameters gathered and the first step released
    them after use, so each checkpointed layer's recomputation gathered what its forward had not: selective
    checkpointing stopped the first resumed step ("aten.view.default invocation index N encountered during backward
    but not found in storage"; SmolLM2-135M, every ZeRO-3 resume). Checkpointing changes no loss in fp32."""
    run_dir = train_half(workdir, "zero3_selective", ["parallel.zero_stage=3", "model.checkpointing=selective"])
    out = resume_here(run_dir, [f"train.steps={STEPS}"])
    assert "converting" not in out
    assert_continues_the_reference(run_dir, reference)


@pytest.mark.slow  # ~4 s: a half run at ZeRO-3 and a refused resume, in this process
def test_a_checkpoint_with_all_parameters_in_one_group_is_named_so(workdir, monkeypatch):
    """What lctrain before the fix of `param_groups` wrote for a ZeRO-3 run from pretrained weights (one group, every
    parameter a 1-D shard at the split) is refused naming the groups, not as a torn file."""
    from lctrain.train import trainer

    two_groups = trainer.param_groups
    with monkeypatch.context() as m:
        m.setattr(trainer, "param_groups", lambda *a: [{**two_groups(*a)[0], "params": list(a[0].parameters())}])
        run_dir = train_half(workdir, "one_group", ["parallel.zero_stage=3"])
    result = CliRunner().invoke(app, ["resume", str(run_dir), *set_args([f"train.steps={STEPS}"])])
    assert one_error_line(result).startswith(f"error: {run_dir}: no checkpoint could be loaded")
    assert (
        "warning: checkpoint step_2 is damaged (its optimizer state has another number of parameter groups than "
        "this run's 2: lctrain before 2026-11-29 put every parameter of a ZeRO-3 run from pretrained weights in one "
        "group, which this version cannot load); trying the one before it"
    ) in result.output


@pytest.mark.slow
def test_two_ranks_continue_on_one(workdir, reference):
    """A requeue on a smaller allocation: 2 data-parallel ranks (ZeRO-2) -> 1 process."""
    run_dir = workdir / "two_to_one"
    run_cli_train(overrides, workdir, run_dir.name, [f"train.steps={STEPS // 2}", "parallel.nproc_per_node=2"])
    out = resume(run_dir, [f"train.steps={STEPS}", "parallel.nproc_per_node=1"])
    assert_resharded(run_dir, out, "parallel.nproc_per_node", {"nproc_per_node": 1})
    assert_continues_the_reference(run_dir, reference)
    # the next resume loads the new layout's own checkpoint: nothing to convert
    out = resume(run_dir, [f"train.steps={STEPS + 1}"])
    assert "converting" not in out and len(losses(run_dir)) == STEPS + 1


@pytest.mark.slow
def test_a_zero0_run_continues_on_two_ranks_with_sequence_parallelism(workdir, reference):
    """ZeRO-0 (the CPU default's stage) was refused any layout change, though its one checkpoint file holds the whole
    model and torch's optimizer state: 1 process -> Ulysses SP 2, loaded as it is, each rank continuing rank 0's RNG."""
    run_dir = train_half(workdir, "zero0_one_to_sp2", ["parallel.zero_stage=0"])
    out = resume(run_dir, [f"train.steps={STEPS}", "parallel.nproc_per_node=2", "parallel.sequence_parallel=2"])
    assert "converting" not in out and not reshard.universal_dir(RunDir(run_dir).checkpoint(STEPS // 2)).exists()
    assert_continues_the_reference(run_dir, reference)


@pytest.mark.slow
def test_a_damaged_file_of_another_ranks_part_falls_back_on_every_rank(workdir, reference):
    """2 ranks at ZeRO-3, rank 1's optimizer file of the last checkpoint truncated: ZeRO-3's load runs collectives,
    and rank 1 failing inside them left rank 0 waiting for ever (resume explorer: a hang; a deleted file: a gloo
    traceback). Every rank checks every file against the sizes the checkpoint recorded before any loads."""
    run_dir = workdir / "z3_damaged"
    run_cli_train(overrides, workdir, run_dir.name, ["parallel.nproc_per_node=2", "parallel.zero_stage=3"])
    shutil.copytree(run_dir, workdir / "z3_zeroed")
    shutil.copytree(run_dir, workdir / "z3_flipped")
    damaged = RunDir(run_dir).checkpoint(STEPS) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = damaged.stat().st_size
    damaged.write_bytes(damaged.read_bytes()[:1000])
    out = resume(run_dir, [f"train.steps={STEPS + 1}"])
    assert (
        f"warning: checkpoint step_{STEPS} is damaged ({damaged.name} has 1,000 bytes, not the {size:,} written); "
        f"trying the one before it"
    ) in out
    # the same size, its first 4 KB zeroed (verify explorer: still a hang with the sizes checked alone), in a
    # checkpoint written before checksums were kept: the archives' structure shows it
    zeroed = workdir / "z3_zeroed" / damaged.relative_to(run_dir)
    with zeroed.open("r+b") as f:
        f.write(bytes(4096))
    state = json.loads((zeroed.parent / "trainer_state.json").read_text())
    del state["checksums"]
    (zeroed.parent / "trainer_state.json").write_text(json.dumps(state))
    out = resume(workdir / "z3_zeroed", [f"train.steps={STEPS + 1}"])
    assert f"warning: checkpoint step_{STEPS} is damaged ({damaged.name}: BadZipFile: " in out
    assert len(losses(workdir / "z3_zeroed")) == STEPS + 1
    # the same size and structure, one byte of a tensor flipped: loaded, it trained on from other moments; its
    # checksum, taken by one rank, is agreed on by both
    with (workdir / "z3_flipped" / damaged.relative_to(run_dir)).open("r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    flipped = resume(workdir / "z3_flipped", [f"train.steps={STEPS + 1}"])
    assert (
        f"warning: checkpoint step_{STEPS} is damaged ({damaged.name} holds other bytes than it was written with: "
        f"its xxh3-128 checksum differs); trying the one before it"
    ) in flipped
    torch.testing.assert_close(
        torch.tensor(losses(workdir / "z3_flipped")), torch.tensor(losses(run_dir)), rtol=LOSS_RTOL, atol=0
    )
    assert f"warning: resuming from step_{STEPS // 2}" in out and len(losses(run_dir)) == STEPS + 1
    # steps 3-4 trained again from step_2, as the uninterrupted run trained them
    torch.testing.assert_close(
        torch.tensor(losses(run_dir)[:STEPS]), torch.tensor(losses(reference)), rtol=LOSS_RTOL, atol=0
    )


@pytest.mark.slow
def test_one_process_continues_on_two_ranks_with_sequence_parallelism(workdir, reference):
    """More GPUs, and the sequence split over them: 1 process (ZeRO-3) -> Ulysses SP 2 (ZeRO-3)."""
    run_dir = train_half(workdir, "one_to_sp2", ["parallel.zero_stage=3"])
    out = resume(run_dir, [f"train.steps={STEPS}", "parallel.nproc_per_node=2", "parallel.sequence_parallel=2"])
    assert_resharded(
        run_dir,
        out,
        "parallel.sequence_parallel, parallel.nproc_per_node",
        {"nproc_per_node": 2, "sequence_parallel": 2, "zero_stage": 3},
    )
    assert_continues_the_reference(run_dir, reference)


def layout(**parallel) -> dict:
    items = [f"parallel.{k}={v}" for k, v in parallel.items()]
    return settings(with_overrides(load_config(None), items, "test"))


def test_layout_changes_name_the_parallel_keys_only():
    before = layout(nproc_per_node=8, zero_stage=2)
    assert reshard.layout_changes(before, layout(nproc_per_node=8, zero_stage=2)) == []
    assert reshard.layout_changes(before, layout(nproc_per_node=4, zero_stage=1, offload_optimizer=True)) == [
        "parallel.zero_stage",
        "parallel.nproc_per_node",
        "parallel.offload_optimizer",
    ]
    assert reshard.layout_changes(None, before) == []  # a checkpoint from before states stored their settings


@pytest.mark.parametrize(
    "before, after, refusal",
    [
        ({"zero_stage": 2}, {"zero_stage": 3}, None),
        ({"zero_stage": 3}, {"zero_stage": 1, "nproc_per_node": 2}, None),
        ({"zero_stage": 0}, {"zero_stage": 0, "nproc_per_node": 2, "sequence_parallel": 2}, None),
        (
            {"zero_stage": 2},
            {"zero_stage": 0},
            "checkpoint step_2 was written with parallel.zero_stage=2 and the run now asks for zero_stage=0; a "
            "checkpoint moves between ZeRO stages 1-3 only .*: keep zero_stage=2",
        ),
        ({"zero_stage": 0, "nproc_per_node": 2}, {"zero_stage": 1}, "keep zero_stage=0"),
        ({"zero_stage": 1}, {"zero_stage": 2, "nproc_per_node": 2, "sequence_parallel": 2}, None),
        ({"zero_stage": 3}, {"zero_stage": 3, "offload_params": True, "num_nodes": 2}, None),
    ],
)
def test_which_layout_changes_convert(before, after, refusal):
    check = lambda: reshard.check_reshardable(layout(**before), layout(**after), "run/config.yaml", "step_2")  # noqa: E731
    if refusal is None:
        check()
    else:
        with pytest.raises(UserError, match=refusal):
            check()


def test_only_a_change_between_zero0_layouts_loads_without_the_universal_checkpoint():
    assert not reshard.needs_universal(layout(zero_stage=0), layout(zero_stage=0, nproc_per_node=4))
    assert reshard.needs_universal(layout(zero_stage=1), layout(zero_stage=1, nproc_per_node=4))
    assert reshard.needs_universal(layout(zero_stage=3), layout(zero_stage=2))


def test_a_conversion_without_adams_step_is_a_damaged_checkpoint_not_a_traceback(tmp_path):
    """A ZeRO-1/2 conversion's step lives in each parameter's step.pt; without any, the completion for ZeRO-3 raises
    one of the errors a damaged checkpoint raises (checkpoint.DAMAGED: a warning line, the checkpoint before tried),
    not StopIteration."""
    from lctrain.compat.deepspeed import universal_for_stage
    from lctrain.train.checkpoint import DAMAGED

    (tmp_path / "zero" / "w").mkdir(parents=True)
    torch.save({"module": {}, "param_shapes": [], "ds_version": "0.19.8"}, tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"param_groups": [{}]}, tmp_path / "zero" / "optimizer_state.pt")
    with pytest.raises(DAMAGED, match="no parameter's step.pt"):
        universal_for_stage(tmp_path, 3)


def test_each_new_rank_continues_an_old_ranks_rng():
    four = layout(nproc_per_node=4)
    assert [reshard.rng_rank(r, four) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [reshard.rng_rank(r, layout(nproc_per_node=8)) for r in range(2)] == [0, 1]


def test_the_ranks_old_rng_states_are_those_they_continue():
    assert reshard.rng_ranks(layout(nproc_per_node=4), layout(nproc_per_node=2)) == [0, 1]
    assert reshard.rng_ranks(layout(nproc_per_node=2), layout(nproc_per_node=8)) == [0, 1]


def test_a_checkpoint_without_a_needed_rng_state_is_passed_over_for_the_next(tmp_path, monkeypatch, capsys):
    """The ranks fall back from a checkpoint they cannot load to the next, so the one converted must be one they can
    load: a checkpoint lacking an RNG state a new rank continues with is not converted, the one before it is."""
    from lctrain.train import command

    converted = []
    monkeypatch.setattr(reshard, "convert", lambda path, *args: converted.append(path.name) or 1.0)
    written_by_two = layout(nproc_per_node=2, zero_stage=2)
    states = []
    for step, ranks in ((4, [0]), (2, [0, 1])):
        path = tmp_path / f"step_{step}"
        path.mkdir()
        for rank in ranks:
            (path / f"rng_rank{rank}.pt").touch()
        states.append((path, {"step": step, "config": written_by_two}))
    cfg = with_overrides(load_config(None), ["parallel.nproc_per_node=1", "parallel.zero_stage=2"], "test")
    command._convert_for_layout(cfg, states)
    assert converted == ["step_4"]  # one rank now: it continues rank 0's state, which step_4 has

    converted.clear()
    # four ranks: 2 and 3 continue the states of 0 and 1
    cfg = with_overrides(load_config(None), ["parallel.nproc_per_node=4", "parallel.zero_stage=2"], "test")
    command._convert_for_layout(cfg, states)
    assert converted == ["step_2"]
    assert "warning: checkpoint step_4 is not converted: rng_rank1.pt missing" in capsys.readouterr().err


def test_a_checkpoint_whose_bytes_changed_is_passed_over_for_the_next_unconverted(tmp_path, monkeypatch, capsys):
    """A file of the newest checkpoint changed after it was written (the same size, one byte other): converting it
    would carry the damage into the universal checkpoint, which loads without complaint. The one before it is
    converted, as loading falls back."""
    from lctrain.checksums import file_checksums
    from lctrain.train import command

    converted = []
    monkeypatch.setattr(reshard, "convert", lambda path, *args: converted.append(path.name) or 1.0)
    written_by_two = layout(nproc_per_node=2, zero_stage=2)
    states = []
    for step in (4, 2):
        path = tmp_path / f"step_{step}"
        path.mkdir()
        for rank in (0, 1):
            (path / f"rng_rank{rank}.pt").write_bytes(bytes([rank]) * 100)
        checksums = {f.name: file_checksums(f)[0] for f in path.iterdir()}
        states.append((path, {"step": step, "config": written_by_two, "checksums": checksums}))
    (tmp_path / "step_4" / "rng_rank1.pt").write_bytes(bytes([1]) * 99 + b"x")
    cfg = with_overrides(load_config(None), ["parallel.nproc_per_node=1", "parallel.zero_stage=2"], "test")
    command._convert_for_layout(cfg, states)
    assert converted == ["step_2"]
    assert (
        "warning: checkpoint step_4 could not be converted (rng_rank1.pt holds other bytes than it was written with: "
        "its xxh3-128 checksum differs)"
    ) in capsys.readouterr().err


def test_resume_keeps_its_run_directory(tmp_path):
    result = CliRunner().invoke(app, ["resume", str(tmp_path), "--set", "train.run_dir=elsewhere"])
    assert one_error_line(result) == (
        f"error: --set train.run_dir=elsewhere: a run resumes in its own directory, {tmp_path}; train.run_dir stays"
    )


@pytest.mark.slow  # four half runs on 2 cores
def test_a_resume_clips_gradients_at_the_configs_new_norm_under_zero(workdir):
    """ZeRO-1/2's optimizer restored the checkpoint's clipping norm over the config's, and saved it again: a resume
    with `--set train.grad_clip` said it continued 'with the new values' and clipped at the old one for good. The
    reference is ZeRO-0 in fp32, whose engine clips with its config: both layouts, trained unclipped for the first
    half and resumed at a norm below every step's gradient norm, must continue alike."""
    clipped = [f"train.steps={STEPS}", "train.grad_clip=0.01"]
    ends = {}
    for stage in (0, 2):
        run_dir = train_half(workdir, f"clip_zero{stage}", [f"parallel.zero_stage={stage}"])
        resume_here(run_dir, clipped)
        ends[stage] = RunDir(run_dir).read_metrics()
    resumed = [r for r in ends[0] if r["step"] > STEPS // 2]
    assert all(r["grad_norm"] > 0.1 for r in resumed)  # the norm clips every resumed step
    got, want = (torch.tensor([r["loss"] for r in ends[s]]) for s in (2, 0))
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0)
