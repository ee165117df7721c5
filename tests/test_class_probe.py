"""A model class lctrain's engines cannot train is refused by `init`, `prepare` and `train` before any work, from a
meta-device probe (`lctrain.attention.class_probe`), whose verdict is checked here against what a real forward
through a lctrain engine does with a packed batch: StableLM's decoder layers drop the segments (the engine refused
at train's first step, after prepare), Falcon looks its attention classes up by name (a KeyError traceback)."""

import pytest
import torch
from train_helpers import one_error_line, set_args
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from lctrain.attention import ENGINES
from lctrain.attention.batch import make_batch
from lctrain.attention.class_probe import OWN_ATTENTION, engines_refused
from lctrain.attention.registry import register_all
from lctrain.cli import app
from lctrain.errors import UserError

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
FALCON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64, new_decoder_architecture=True)


def tiny_config(model_type: str):
    extra = FALCON if model_type == "falcon" else {**SMALL, "num_key_value_heads": 2}
    return AutoConfig.for_model(model_type, **extra)


def trains_with_an_engine(config) -> bool:
    """The reference: a real forward of the class through lctrain's reference engine on a packed batch of two
    documents, as training's first step runs it."""
    register_all()
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ENGINES["reference"].hf_name)
        batch = make_batch(torch.randint(1, 60, (1, 16)), [[10, 6]], "intra_doc")
        model(**batch.model_kwargs(), use_cache=False)
    except UserError as e:
        assert "segment metadata" in str(e)
        return False
    except KeyError:
        return False
    return True


@pytest.mark.parametrize(
    "model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma", "olmo2", "gpt_neox", "stablelm", "nemotron", "falcon"]
)
def test_the_probe_agrees_with_a_real_forward(model_type):
    config = tiny_config(model_type)
    implementation = config._attn_implementation
    why = engines_refused(config)
    assert config._attn_implementation == implementation  # the caller's config is left as it was
    assert (why is None) == trains_with_an_engine(config)
    if model_type in ("stablelm", "nemotron"):
        assert why.startswith(f"its attention ({type(config).__name__.removesuffix('Config')}Attention) gets no")
    if model_type == "falcon":
        assert why == OWN_ATTENTION


def test_a_class_whose_attention_never_calls_the_registered_function_is_refused(monkeypatch):
    """A class computing attention itself would train every document mode as plain causal attention: the engines,
    which refuse a call without segments, are never called."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(
        modeling_llama.LlamaAttention, "forward", lambda self, hidden_states, **kw: (hidden_states, None)
    )
    assert engines_refused(tiny_config("llama")) == OWN_ATTENTION


@pytest.fixture
def stablelm(tmp_path):
    from transformers import StableLmConfig, StableLmForCausalLM

    path = tmp_path / "stablelm"
    StableLmForCausalLM(
        StableLmConfig(**{**SMALL, "vocab_size": 32000, "max_position_embeddings": 4096})
    ).save_pretrained(path)
    return path


def test_init_prepare_and_train_refuse_such_a_model_before_any_work(stablelm, tmp_path):
    runner = CliRunner()
    out = tmp_path / "slm.yaml"
    args = ["init", "--model", str(stablelm), "--seq-len", "1024", "--gpus", "1", "--out", str(out)]
    line = one_error_line(runner.invoke(app, [*args, "--tokenizer", "builtin:mistral-7b-v0.1"]))
    assert f"error: {stablelm}: model type 'stablelm': its attention (StableLmAttention) gets no document" in line
    assert not out.exists()
    over = [
        "model.arch=null",
        f"model.name_or_path={stablelm}",
        "data.seq_len=64",
        "data.token_budget=6400",
        f"data.output_dir={tmp_path / 'prepared'}",
        f"train.run_dir={tmp_path / 'run'}",
    ]
    for command in ("prepare", "train"):
        line = one_error_line(runner.invoke(app, [command, *set_args(over)]))
        assert f"error: model.name_or_path = '{stablelm}': model type 'stablelm': its attention" in line, command
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "run").exists()


def test_prepare_refuses_a_hub_name_whose_config_is_in_the_cache(stablelm, tmp_path, monkeypatch):
    """`init` read a hub name's config from the Hugging Face cache and refused StableLM; `prepare` and `train` of a
    config naming it skipped the probe (verify explorer: Falcon then ended train in a KeyError traceback)."""
    import lctrain.model

    real = AutoConfig.from_pretrained

    def cached(name, *args, **kwargs):  # the cache holds tiny/stablelm; nothing is downloaded
        if name == "tiny/stablelm" and kwargs.get("local_files_only"):
            return real(stablelm)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(lctrain.model.AutoConfig, "from_pretrained", cached)
    over = [
        "model.arch=null",
        "model.name_or_path=tiny/stablelm",
        "data.tokenizer=builtin:mistral-7b-v0.1",
        "data.seq_len=64",
        "data.token_budget=6400",
        f"data.output_dir={tmp_path / 'prepared'}",
    ]
    line = one_error_line(CliRunner().invoke(app, ["prepare", *set_args(over)]))
    assert "error: model.name_or_path = 'tiny/stablelm': model type 'stablelm': its attention" in line
    assert not (tmp_path / "prepared").exists()
