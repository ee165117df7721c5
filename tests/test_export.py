"""How a trained model leaves lctrain: the evaluation export (`checkpoint.write_export`) and `lctrain export`.

`lctrain export` of a resume checkpoint writes exactly the files training exported at that step (weights bit for
bit, config, tokenizer, model card, export record), for ZeRO-0's module file and ZeRO-3's fp32 partitions (bf16: the
cast gives the weights training held); config.json carries the RoPE keys transformers 4.x reads, and transformers 5
loads it to the same config and logits; the weights are sharded at 5GB with every shard in the record; the model
card says how to prompt the model.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from train_helpers import TINY_ARCH, one_error_line, prepared_workdir, run_cli_train
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.export_record import EXPORT_RECORD, read_export_record, verify_export
from lctrain.files import TEMPORARY_PREFIX
from lctrain.rundir import RunDir
from lctrain.tokenizer import Anchor, load_tokenizer
from lctrain.train import checkpoint as ckpt
from lctrain.train.export import unwritable_exports

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 4

# the runs: ZeRO-0 in fp32 (the default stage); ZeRO-1 in bf16, whose module file holds the bf16 weights (DeepSpeed's
# zero_to_fp32 refuses its optimizer files); ZeRO-3 in bf16, whose weights are fp32 partitions cast at export
RUNS = {
    "zero0": [],
    "zero1_bf16": ["parallel.zero_stage=1", "model.dtype=bfloat16"],
    "zero3_bf16": ["parallel.zero_stage=3", "model.dtype=bfloat16"],
}


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [
        "data.seq_len=128",
        "data.token_budget=12000",
        f"data.output_dir={data_dir}",
        f"train.run_dir={run_dir}",
        f"train.steps={STEPS}",
        "train.global_batch=2",
        "train.micro_batch=1",
        "train.warmup_steps=1",
        "checkpoint.every_steps=2",
        "checkpoint.keep=2",
        "checkpoint.hf_every=2",
        "checkpoint.hf_last=4",
        f"model.arch={TINY_ARCH}",
    ]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "export", overrides)


def trained(workdir: Path, name: str, extra: list[str] = ()) -> Path:
    """A run of STEPS steps with resume checkpoints and exports at steps 2 and 4, trained in this process once."""
    from lctrain.train.command import train

    run_dir = workdir / name
    if not (run_dir / "hf" / f"step_{STEPS}").is_dir():
        train(load_config(None, overrides(workdir / "data", run_dir) + list(extra)))
    return run_dir


@pytest.fixture(scope="module")
def zero0(workdir):
    return trained(workdir, "zero0")


def export(*args) -> str:
    result = CliRunner().invoke(app, ["export", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def refused(*args) -> str:
    return one_error_line(CliRunner().invoke(app, ["export", *map(str, args)]))


def assert_same_export(got: Path, want: Path) -> None:
    """Every file byte for byte (export.json's checksums included), and the weights tensor for tensor."""
    from safetensors.torch import load_file

    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
    for f in want.iterdir():
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name
    a, b = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in b)
    assert verify_export(got, None) and read_export_record(got).step == read_export_record(want).step


@pytest.mark.parametrize("name", sorted(RUNS))
def test_export_of_a_resume_checkpoint_is_what_training_exported(workdir, tmp_path, name):
    run = trained(workdir, name, RUNS[name])
    out = tmp_path / "exported"
    said = export(run, "--step", 2, "--out", out)
    assert said.startswith(f"export: checkpoint step_2 of {run} -> {out}")
    assert ("gathering ZeRO-3's fp32 partitions into bfloat16" in said) == (name == "zero3_bf16")
    assert f"export: wrote {out} (step 2" in said
    assert_same_export(out, RunDir(run).export(2))
    assert json.loads((out / "config.json").read_text())["dtype"] == ("float32" if name == "zero0" else "bfloat16")


def test_export_of_a_run_from_a_pretrained_model_with_yarn(workdir, tmp_path):
    """model.name_or_path: the export's config is the base's with lctrain's changes (YaRN here, also in the
    top-level form transformers 4.x reads), and its generation config the base's own."""
    from transformers import GenerationConfig

    base = workdir / "base"
    if not base.is_dir():
        lm = tiny_lm({"rope_type": "default", "rope_theta": 10000.0})
        lm.config.max_position_embeddings = 64
        lm.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.7)
        lm.save_pretrained(base)
        load_tokenizer("builtin:mistral-7b-v0.1").save_pretrained(base)
    extra = ["model.arch=null", f"model.name_or_path={base}", "model.rope_scaling={rope_type: yarn, factor: 2.0}"]
    run = trained(workdir, "pretrained_yarn", extra)
    export(run, "--step", 2, "--out", tmp_path / "exported")
    assert_same_export(tmp_path / "exported", RunDir(run).export(2))
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 1e6  # tiny_anchor's model.rope_theta
    assert json.loads((tmp_path / "exported" / "generation_config.json").read_text())["temperature"] == 0.7
    card = (tmp_path / "exported" / ckpt.MODEL_CARD).read_text()
    assert f"- base model: `{base}`" in card
    assert "## Changes to the base model's config" in card
    assert "- rope_parameters.rope_type: 'default' -> 'yarn' (model.rope_scaling (rope_type yarn))" in card


def test_the_model_card_says_the_sliding_window_was_removed(tmp_path):
    """A Mistral with a window shorter than data.seq_len trains and is exported without it: the card says so, from
    the one list of lctrain's changes (`model.config_changes`), without what the export does not hold."""
    from transformers import MistralConfig

    from lctrain.model import apply_changes, config_changes, load_hf_config
    from lctrain.tokenizer import resolve_anchor
    from lctrain.train.model_card import model_card

    base = tmp_path / "mistral"
    MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        sliding_window=256,
    ).save_pretrained(base)
    cfg = load_config(None, ["model.arch=null", f"model.name_or_path={base}", "data.seq_len=1024"])
    trained = load_hf_config(cfg)
    apply_changes(trained, config_changes(trained, cfg, vocab_size=None, attn_implementation="eager"))
    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    card = model_card(cfg, trained, tok, resolve_anchor(tok), 2, "float32")
    assert "- sliding_window: 256 -> None (shorter than data.seq_len = 1024)" in card
    assert "The base model's sliding window was removed: every layer attended to all earlier tokens" in card
    assert "use_cache" not in card and "attn_implementation" not in card

    # a window at least as long as the training windows is kept, and the card says nothing of it
    cfg = load_config(None, ["model.arch=null", f"model.name_or_path={base}", "data.seq_len=256"])
    card = model_card(cfg, load_hf_config(cfg), tok, resolve_anchor(tok), 2, "float32")
    assert "sliding" not in card


def test_the_model_card_says_documents_carried_domain_tags():
    """An AnchorAttention + Tag run's card said every document started with the anchor, and nothing of the tag each
    one had after it, nor that lctrain's evaluation prompts carry none; a model.rope_fp32 run's, nothing of its
    rotation in fp32 (what eval notes of a run, not of its export directory)."""
    from lctrain.model import load_hf_config
    from lctrain.tokenizer import resolve_anchor
    from lctrain.train.model_card import model_card

    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    cards = {}
    for tags in (True, False):
        cfg = load_config(None, [f"data.domain_tags={str(tags).lower()}"])
        cards[tags] = model_card(cfg, load_hf_config(cfg), tok, resolve_anchor(tok), 2, "float32")
    assert "- domain tags (data.domain_tags, the paper's AnchorAttention + Tag): each document's anchor" in cards[True]
    assert "lctrain's evaluation puts none in its prompts" in cards[True]
    assert "tag" not in cards[False].lower()
    cfg = load_config(None, ["model.rope_fp32=true"])
    card = model_card(cfg, load_hf_config(cfg), tok, resolve_anchor(tok), 2, "float32")
    assert "(q and k rotated in fp32, model.rope_fp32; transformers rotates them in the model's dtype)" in card


@pytest.mark.slow
def test_export_of_a_two_rank_zero3_checkpoint(workdir, tmp_path):
    """Two launched ranks: each holds half of every parameter's fp32 partition, which the export joins."""
    extra = ["parallel.nproc_per_node=2", "parallel.zero_stage=3", "parallel.launcher=torchrun", "model.dtype=bfloat16"]
    run = run_cli_train(overrides, workdir, "zero3_two_ranks", extra)
    assert len(list((run / "checkpoints" / "step_4").glob("*_optim_states.pt"))) == 2
    export(run, "--out", tmp_path / "exported")
    assert_same_export(tmp_path / "exported", RunDir(run).export(4))


def test_default_latest_checkpoint_into_the_run_and_no_overwrite_without_force(zero0, tmp_path):
    run = shutil.copytree(zero0, tmp_path / "run")
    line = refused(run)
    assert line == (
        f"error: {run}/hf/step_4: the export of step 4 is already there; --force replaces it, or choose another --out"
    )
    export(run, "--force")
    assert_same_export(RunDir(run).export(4), RunDir(zero0).export(4))
    shutil.rmtree(run / "hf")
    said = export(run)
    assert f"export: checkpoint step_4 of {run} -> {run}/hf/step_4" in said
    assert_same_export(RunDir(run).export(4), RunDir(zero0).export(4))
    assert [p.name for p in RunDir(run).exports()] == ["step_4"]  # nothing else left in hf/


def killed_in_its_last_export(run: Path) -> None:
    """`run` as a session killed with -9 in its last step's export leaves it: the export's temporary directory, and
    the session's line of sessions.jsonl with its start only."""
    rd = RunDir(run)
    shutil.rmtree(rd.export(4))
    killed = run / "hf" / f"{TEMPORARY_PREFIX}step_4"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"torn")
    *before, last = rd.read_sessions()
    started = {k: v for k, v in last.items() if k not in ("ended", "end_step", "diverged", "diverged_at", "outcome")}
    rd.sessions_file.write_text("".join(json.dumps(r) + "\n" for r in [*before, started]))


def test_resume_writes_the_exports_a_killed_session_left_unwritten(zero0, tmp_path):
    """Killed after a step's resume checkpoint, in its export: the run resumed after that step and never wrote it
    (its end state without the final export, 'complete, nothing to resume'). Resume writes it from the checkpoint,
    what training wrote, and the killed export's temporary directory goes."""
    run = shutil.copytree(zero0, tmp_path / "run")
    killed_in_its_last_export(run)
    said = CliRunner().invoke(app, ["resume", str(run)])
    assert said.exit_code == 0, said.output
    assert f"{run}/hf/step_4 was not written (its session stopped between checkpoint step_4 and" in said.output
    assert_same_export(RunDir(run).export(4), RunDir(zero0).export(4))
    assert f"{run} is complete: step 4 of 4; nothing to resume" in said.output
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_2", "step_4"]
    again = CliRunner().invoke(app, ["resume", str(run)])
    assert again.exit_code == 0 and "was not written" not in again.output


def test_resume_owing_the_export_of_a_damaged_checkpoint_falls_back_and_trains_it_again(zero0, tmp_path):
    """Killed in step 4's export, and step 4's checkpoint damaged since (a byte flipped): the owed export stopped the
    resume with the export's refusal (and, had it been skipped, the run was 'complete' without its final export). It
    warns, the resume falls back to step 2's checkpoint and trains steps 3 and 4 again, writing step 4's checkpoint
    and export as the uninterrupted run did."""
    run = shutil.copytree(zero0, tmp_path / "run")
    killed_in_its_last_export(run)
    module = run / "checkpoints" / "step_4" / "mp_rank_00_model_states.pt"
    data = bytearray(module.read_bytes())
    data[-100] ^= 1
    module.write_bytes(bytes(data))
    assert unwritable_exports(RunDir(run)) == [4]  # what the other ranks of a user's launcher decide by
    said = CliRunner().invoke(app, ["resume", str(run)])
    assert said.exit_code == 0, said.output
    assert (
        f"warning: {run}/hf/step_4 was not written (its session stopped between checkpoint step_4 and that export), "
        f"and that checkpoint is damaged (mp_rank_00_model_states.pt holds other bytes than it was written with: its "
        f"xxh3-128 checksum differs): not written; the resume goes back to an earlier checkpoint and writes it when "
        f"it trains step 4 again"
    ) in said.output
    assert "trying the one before it" in said.output
    assert [r["step"] for r in RunDir(run).read_metrics()][-2:] == [3, 4]
    assert_same_export(RunDir(run).export(4), RunDir(zero0).export(4))
    assert ckpt.changed_file(run / "checkpoints" / "step_4", ckpt.readable_state(run / "checkpoints" / "step_4")) == ""
    assert unwritable_exports(RunDir(run)) == []


def test_resume_leaves_out_the_exports_the_user_removed(zero0, tmp_path):
    """Exports training wrote and the user deleted (to free disk) were written again by every resume, each said to be
    one 'its session stopped' before writing: training wrote step 2's before step 3 (metrics.jsonl), and step 4's
    before its session finished (sessions.jsonl)."""
    run = shutil.copytree(zero0, tmp_path / "run")
    for step in (2, 4):
        shutil.rmtree(RunDir(run).export(step))
    said = CliRunner().invoke(app, ["resume", str(run)])
    assert said.exit_code == 0, said.output
    assert "was not written" not in said.output and RunDir(run).exports() == []
    assert (
        f"{run}/hf/step_2, {run}/hf/step_4: written by training and removed since, not written again ('lctrain "
        f"export {run} --step N' writes one from its checkpoint)"
    ) in said.output
    # killed in the export of step 4 after the user removed step 2's: step 4's alone is owed
    shutil.copytree(RunDir(zero0).export(4), RunDir(run).export(4))
    killed_in_its_last_export(run)
    said = CliRunner().invoke(app, ["resume", str(run)])
    assert f"{run}/hf/step_4 was not written (its session stopped" in said.output
    assert f"{run}/hf/step_2: written by training and removed since" in said.output
    assert [p.name for p in RunDir(run).exports()] == ["step_4"]


def test_refusals_each_in_one_line(zero0, workdir, tmp_path):
    assert refused(tmp_path) == f"error: {tmp_path}: not a run directory (no config.yaml); give the directory " + (
        "`lctrain train` wrote (runs/NAME)"
    )
    assert "a prepared dataset" in refused(workdir / "data")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(zero0 / "config.yaml", bare)
    assert refused(bare).startswith(f"error: {bare}: no complete resume checkpoint in {bare}/checkpoints to export")
    assert refused(zero0, "--step", 3) == (
        f"error: {zero0}: no complete checkpoint of step 3 (its complete checkpoints: step_2, step_4); give one of "
        f"them to --step"
    )
    # a file or a directory that is not an export is never replaced, with --force neither
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    line = refused(zero0, "--out", tmp_path / "notes", "--force")
    assert "a directory that is not an export is in the way" in line
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"
    # nor a model's folder (the base model the run trained from has a config.json, but no export record)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    assert "a directory that is not an export is in the way" in refused(zero0, "--out", tmp_path / "base", "--force")
    assert (tmp_path / "base" / "config.json").read_text() == "{}"


def test_a_damaged_checkpoint_is_refused_naming_the_others(zero0, tmp_path):
    run = shutil.copytree(zero0, tmp_path / "run")
    module = run / "checkpoints" / "step_4" / "mp_rank_00_model_states.pt"
    module.write_bytes(module.read_bytes()[: module.stat().st_size // 2])
    line = refused(run, "--out", tmp_path / "x")
    assert line.startswith(f"error: {run}/checkpoints/step_4: damaged (")
    assert line.endswith("export another with --step (step_2)")
    assert not (tmp_path / "x").exists()
    module.write_bytes(bytes(4096) + (run / "checkpoints" / "step_2" / module.name).read_bytes()[4096:])
    line = refused(run, "--out", tmp_path / "x")  # the size written, its first 4 KB zeroed: the file named
    assert "damaged (mp_rank_00_model_states.pt: BadZipFile: " in line and not (tmp_path / "x").exists()
    module.write_bytes((run / "checkpoints" / "step_2" / module.name).read_bytes())  # step 2's weights as step 4's
    line = refused(run, "--out", tmp_path / "x")
    assert "damaged (mp_rank_00_model_states.pt holds other bytes than it was written with" in line
    (run / "checkpoints" / "step_2" / ckpt.STATE_FILE).write_text("")
    line = refused(run, "--step", 2, "--out", tmp_path / "x")
    assert line == (
        f"error: {run}/checkpoints/step_2: damaged (trainer_state.json is unreadable (JSONDecodeError)); export "
        f"another with --step (step_4)"
    )


def test_a_zero3_checkpoint_missing_a_partition_is_refused(workdir, tmp_path):
    run = shutil.copytree(trained(workdir, "zero3_bf16", RUNS["zero3_bf16"]), tmp_path / "run")
    for f in (run / "checkpoints" / "step_4").glob("*_optim_states.pt"):
        f.unlink()
    line = refused(run, "--out", tmp_path / "x")
    assert line.startswith(f"error: {run}/checkpoints/step_4: damaged (")


def test_model_card(zero0):
    card = (RunDir(zero0).export(2) / ckpt.MODEL_CARD).read_text()
    for fact in (
        "# tiny_anchor, step 2",
        "- base model: none, random init from model.arch (llama, 2 layers, hidden size 64)",
        "- attention in training: `anchor`",
        "- RoPE as trained: base (rope_theta) 1,000,000, no scaling",
        "- training length: 128 tokens (data.seq_len)",
        "- step: 2 of 4 (train.steps)",
        "- tokens seen: 512 (2 steps x 2 windows x 128 tokens)",
        "- weights: float32, the model's training dtype (model.dtype)",
        "- anchor: `<s>` (id 1)",
        "## Changes to the base model's config",
        "lctrain trained with these changes to the model.arch config",
        "- rope_parameters.rope_theta: 10000.0 -> 1000000.0 (model.rope_theta)",
        "- exported by lctrain ",
        "ids = [1] + tok(text, add_special_tokens=False, split_special_tokens=True).input_ids",
        "eos_token_id=[2, 1]",
    ):
        assert fact in card, fact
    assert ckpt.MODEL_CARD in read_export_record(RunDir(zero0).export(2)).files


# ------------------------------------------------------------------ config.json for transformers 4.x and 5


def tiny_lm(rope: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=4096,
        rope_parameters=rope,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:mistral-7b-v0.1")


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 5e6},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024},
    "linear": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_config_carries_the_legacy_rope_keys_and_loads_unchanged(tmp_path, tokenizer, kind):

    out = ckpt.write_export(
        tmp_path / "step_3", tiny_lm(ROPES[kind]), tokenizer, Anchor("<s>", 1, "test"), 3, load_config(None, [])
    )
    saved = json.loads((out / "config.json").read_text())
    params = saved["rope_parameters"]
    assert saved["rope_theta"] == params["rope_theta"] == ROPES[kind]["rope_theta"]
    if kind == "default":
        assert "rope_scaling" not in saved
    else:  # transformers 4.x's form: the parameters without the base
        assert saved["rope_scaling"] == {k: v for k, v in params.items() if k != "rope_theta"}
    assert_loads_as_without(out, ("rope_theta", "rope_scaling"), tmp_path / "plain")


def assert_loads_as_without(out, legacy: tuple[str, ...], plain):
    """transformers 5 loads the export `out` as the same export without its `legacy` keys, as 5 writes it: the same
    config (some classes keep a legacy key in it too, e.g. GPT-NeoX a top-level rope_theta, which 5 does not read)
    and the same logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = json.loads((out / "config.json").read_text())
    shutil.copytree(out, plain)
    (plain / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k not in legacy}, indent=2))
    a, b = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(plain)
    assert a.rope_parameters == b.rope_parameters == saved["rope_parameters"]
    loaded = json.loads(a.to_json_string())
    assert {k: v for k, v in loaded.items() if k not in legacy} == json.loads(b.to_json_string())
    ids = torch.arange(3, 200)[None]
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        want = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)(ids).logits
    assert torch.equal(got, want)
    assert verify_export(out, 3)  # the config was rewritten before the record


def test_a_gpt_neox_export_carries_the_names_transformers_4_reads_for_it(tmp_path, tokenizer):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25}
    config = GPTNeoXConfig(
        vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    config.rope_parameters = rope
    lm = GPTNeoXForCausalLM(config)
    out = ckpt.write_export(tmp_path / "step_3", lm, tokenizer, Anchor("<s>", 1, "test"), 3, load_config(None, []))
    saved = json.loads((out / "config.json").read_text())
    assert saved["rope_parameters"] == rope
    assert saved["rotary_emb_base"] == saved["rope_theta"] == 5e6 and saved["rotary_pct"] == 0.25
    legacy = ("rope_theta", "partial_rotary_factor", "rotary_emb_base", "rotary_pct")
    assert_loads_as_without(out, legacy, tmp_path / "plain")


def test_legacy_rope_keys_only_where_transformers_4_reads_them():
    from lctrain.compat.transformers import legacy_rope_keys

    partial = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    assert legacy_rope_keys(partial) == {"rope_theta": 1e4, "partial_rotary_factor": 0.5}
    assert legacy_rope_keys({**partial, "partial_rotary_factor": 0.4}) == {"rope_theta": 1e4}  # kept as it is
    nested = {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    assert legacy_rope_keys(nested) == {} and legacy_rope_keys({"model_type": "gpt2"}) == {}
    # a stale base at the top level (4.x would read it) is replaced; GPT-NeoX's 4.x names are written too, as
    # 4.57's GPTNeoXConfig sets rope_theta from rotary_emb_base (default 10000) over a top-level rope_theta
    neox = {"model_type": "gpt_neox", **partial}
    assert legacy_rope_keys(neox) == {
        **legacy_rope_keys(partial),
        "rotary_emb_base": 1e4,
        "rotary_pct": 0.5,
    }
    stale = {**neox, "rope_theta": 1e4, "rope_parameters": {**partial["rope_parameters"], "rope_theta": 5e6}}
    assert legacy_rope_keys(stale) == {
        "rope_theta": 5e6,
        "partial_rotary_factor": 0.5,
        "rotary_emb_base": 5e6,
        "rotary_pct": 0.5,
    }


def test_weights_in_5gb_shards_each_in_the_record(tmp_path, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    assert ckpt.MAX_SHARD_SIZE == "5GB"
    monkeypatch.setattr(ckpt, "MAX_SHARD_SIZE", "1MB")  # the tiny model's 4 MB in several shards
    lm = tiny_lm(ROPES["default"])
    out = ckpt.write_export(tmp_path / "step_1", lm, tokenizer, Anchor("<s>", 1, "test"), 1, load_config(None, []))
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    recorded = read_export_record(out).files
    assert set(shards) | {"model.safetensors.index.json", "config.json", ckpt.MODEL_CARD} <= set(recorded)
    assert set(recorded) == {p.name for p in out.iterdir()} - {EXPORT_RECORD}
    assert verify_export(out, 1)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in lm.state_dict().items())


def test_cli_help_lists_export():
    result = CliRunner().invoke(app, ["export", "--help"])
    assert result.exit_code == 0 and "--step" in result.output and "--force" in result.output
