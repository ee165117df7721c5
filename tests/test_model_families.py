"""Model families beyond Llama through build_model, the loss and the perplexity, each against plain transformers
(eager, fp32): logit transforms (Gemma-2's final soft-capping, Cohere's logit_scale, Granite's logits_scaling),
attention soft-capping and the sliding window refused or removed consistently, attention sinks refused, partial
rotary kept."""

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from train_helpers import set_args, show_config_refusal
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from lctrain.attention import ENGINES, make_batch
from lctrain.cli import app
from lctrain.compat.transformers import sdpa_refused
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.eval.perplexity import target_nll
from lctrain.model import build_model
from lctrain.train.loss import CausalLMLossSum, logit_transform

VOCAB = 100
SEQ = 32
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ,
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
GEMMA2 = {"model_type": "gemma2", **SMALL, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8}
# each with a transform far from 1, so a loss without it is far from the model's
TRANSFORMED = {
    "cohere": {"model_type": "cohere", **SMALL, "logit_scale": 4.0},
    "granite": {"model_type": "granite", **SMALL, "logits_scaling": 0.25},
    "gemma2_final_cap": {**GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": 0.5},
    # the other model types of loss._LOGIT_SCALES, each against its own class's loss
    "cohere2": {"model_type": "cohere2", **SMALL, "logit_scale": 4.0},
    "cohere2_moe": {"model_type": "cohere2_moe", **SMALL, "logit_scale": 4.0},
    "granitemoe": {"model_type": "granitemoe", **SMALL, "logits_scaling": 0.25},
    "granitemoeshared": {"model_type": "granitemoeshared", **SMALL, "logits_scaling": 0.25},
    "granitemoehybrid": {"model_type": "granitemoehybrid", **SMALL, "logits_scaling": 0.25},
    "hyperclovax": {"model_type": "hyperclovax", **SMALL, "logits_scaling": 4.0},
}


def config(arch, *overrides):
    cfg = load_config(
        None,
        [
            f"data.seq_len={SEQ}",
            "model.dtype=float32",
            "model.rope_theta=null",
            "attention.mode=full",
            "attention.engine=reference",
            *overrides,
        ],
    )
    cfg.model.arch = dict(arch)
    return cfg


def build(arch, *overrides):
    return build_model(config(arch, *overrides), vocab_size=VOCAB)


def eager_copy(model):
    """The same weights in a model transformers builds itself from the trained config, with its own attention."""
    hf = copy.deepcopy(model.config)
    ref = AutoModelForCausalLM.from_config(hf, attn_implementation="eager", dtype=torch.float32)
    ref.load_state_dict(model.state_dict())
    return ref.eval()


def ids_of(seed=0):
    return torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "name",
    # granitemoehybrid's Mamba layers run their slow reference path on a CPU (6 s): with the slow tests
    [pytest.param(n, marks=pytest.mark.slow) if n == "granitemoehybrid" else n for n in sorted(TRANSFORMED)],
)
def test_loss_and_perplexity_apply_the_models_logit_transform(name):
    model = build(TRANSFORMED[name]).model.eval()
    assert logit_transform(model.config) is not None
    ids = ids_of()
    batch = make_batch(ids, [[SEQ]], "full")
    ref = eager_copy(model)
    with torch.no_grad():
        ours = CausalLMLossSum(model)(batch) / batch.valid_labels()
        theirs = ref(input_ids=ids, labels=ids).loss
        # the transform matters: the plain head's loss is another number
        plain = F.cross_entropy(
            ref.get_output_embeddings()(ref.model(input_ids=ids).last_hidden_state)[0, :-1], ids[0, 1:]
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert abs(plain - theirs) > 1e-2

    # evaluation loads the export with transformers' own attention, as `ref` is
    window = {"input_ids": ids[0].tolist(), "seg_lens": [SEQ], "seg_doc": [0], "tag_lens": [0]}
    nll, _ = target_nll(ref, window)
    with torch.no_grad():
        per_token = F.cross_entropy(ref(input_ids=ids).logits[0, :-1].float(), ids[0, 1:], reduction="none")
    np.testing.assert_allclose(nll, per_token.double().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gradients", ["forward", "recompute"])
def test_the_chunked_loss_applies_the_transform_in_every_chunk(gradients):
    model = build(TRANSFORMED["cohere"]).model.eval()
    ids = ids_of(1)
    batch = make_batch(ids, [[SEQ]], "full")
    ref = eager_copy(model)
    (CausalLMLossSum(model, chunk_tokens=5, gradients=gradients)(batch) / batch.valid_labels()).backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    for (name, ours), theirs in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_fused_loss_refuses_a_model_that_transforms_its_logits():
    model = build(TRANSFORMED["granite"]).model
    with pytest.raises(UserError, match=r"transforms them \(logits_scaling = 0.25\).*fused_kernels=compile or none"):
        CausalLMLossSum(model, fused_loss_sum=lambda head, hidden, labels: hidden.sum())


def test_an_unknown_logit_scale_is_refused():
    hf = AutoConfig.for_model("llama", **SMALL)
    hf.logits_scaling = 4.0
    with pytest.raises(UserError, match="model logits_scaling = 4.0: lctrain does not know how model type 'llama'"):
        logit_transform(hf)
    assert logit_transform(AutoConfig.for_model("granite", **SMALL)) is None  # logits_scaling 1: nothing to apply


def test_attention_softcapping_is_refused_at_configuration():
    with pytest.raises(UserError, match=r"attn_logit_softcapping = 5.0: .*set attn_logit_softcapping: null"):
        build({**GEMMA2, "attn_logit_softcapping": 5.0})


def _reference_call(**kwargs):
    q = k = v = torch.randn(1, 4, SEQ, 16, generator=torch.Generator().manual_seed(0))
    seg = make_batch(ids_of(), [[SEQ]], "full").model_kwargs()
    seg.pop("input_ids", None)
    seg.pop("position_ids", None)
    return ENGINES["reference"].attention(None, q, k, v, **seg, **kwargs)


def test_show_config_on_a_cpu_checks_a_flex_config_as_train_on_a_gpu_does():
    """flex cannot run on a CPU; show-config there still refuses the model train would refuse."""
    with pytest.raises(UserError) as err:
        build({**GEMMA2, "attn_logit_softcapping": 5.0})
    arch = json.dumps({**GEMMA2, "attn_logit_softcapping": 5.0})
    assert show_config_refusal([f"model.arch={arch}", "attention.engine=flex", "model.dtype=float32"]) == (
        f"error: {err.value}"
    )
    fine = json.dumps({**GEMMA2, "attn_logit_softcapping": None})
    shown = CliRunner().invoke(app, ["show-config", *set_args([f"model.arch={fine}", "attention.engine=flex"])])
    assert shown.exit_code == 0, shown.output
    assert "attention.engine: flex does not run here" in shown.output and "layer_types" in shown.output


def test_the_engines_refuse_softcap_and_a_window_they_would_drop():
    with pytest.raises(UserError, match="softcap = 5.0"):
        _reference_call(softcap=5.0)
    with pytest.raises(UserError, match=f"sliding window of 8 over {SEQ} keys"):
        _reference_call(sliding_window=8)
    out, _ = _reference_call(softcap=None, sliding_window=SEQ)  # a window over every key masks nothing
    torch.testing.assert_close(out, _reference_call()[0])


def test_gemma2_with_an_sdpa_engine_is_one_line_from_show_config_as_from_train():
    arch = {**GEMMA2, "attn_logit_softcapping": None}
    with pytest.raises(UserError, match=r"attention.engine = sdpa \(sdpa\).*'gemma2'.*reference") as err:
        build(arch, "attention.engine=sdpa")
    overrides = [f"model.arch={json.dumps(arch)}", "attention.engine=sdpa", "model.dtype=float32"]
    assert show_config_refusal(overrides) == f"error: {err.value}"
    assert not sdpa_refused(AutoConfig.for_model("llama"), "lctrain_sdpa")
    assert not sdpa_refused(AutoConfig.for_model("gemma2"), "lctrain_reference")


SLIDING = {
    "qwen2": {"model_type": "qwen2", **SMALL, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "gemma2": {**GEMMA2, "attn_logit_softcapping": None, "final_logit_softcapping": None},
}


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_an_export_without_the_window_loads_and_generates(name, tmp_path):
    built = build(SLIDING[name])
    changed = {c.key: c.new for c in built.changes}
    assert set(changed["layer_types"]) == {"full_attention"}
    if name == "qwen2":
        assert changed["sliding_window"] is None and changed["use_sliding_window"] is False
    else:  # Gemma-2 builds its sliding mask whatever the layer types: the window stays, widened to the context
        assert changed["sliding_window"] == SEQ
    for key, value in changed.items():
        if not key.startswith("rope_parameters.") and key not in ("attn_implementation", "dtype"):
            assert getattr(built.model.config, key) == value
    built.model.save_pretrained(tmp_path)
    for impl in ("eager", "sdpa") if name == "qwen2" else ("eager",):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=impl).eval()
        out = loaded.generate(ids_of()[:, :5], max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 8)


def test_a_gemma2_export_attends_fully_where_layer_types_are_unknown(tmp_path):
    """transformers releases before `layer_types` slide every other layer (the first of each pair) by
    `sliding_window`: the export's window, run so, computes what the full-attention model trained."""
    built = build(SLIDING["gemma2"])
    built.model.save_pretrained(tmp_path)
    full = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    older = AutoConfig.from_pretrained(tmp_path)
    older.layer_types = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(older.num_hidden_layers)
    ]
    sliding = AutoModelForCausalLM.from_pretrained(tmp_path, config=older, attn_implementation="eager").eval()
    ids = ids_of()[:, :SEQ]
    torch.testing.assert_close(sliding(ids).logits, full(ids).logits, rtol=0, atol=0)
    older.sliding_window = SLIDING["gemma2"]["sliding_window"]  # the base's window, as exports kept it before
    kept = AutoModelForCausalLM.from_pretrained(tmp_path, config=older, attn_implementation="eager").eval()
    assert not torch.allclose(kept(ids).logits, full(ids).logits)


PARTIAL = {
    "phi": {"model_type": "phi", **SMALL, "num_key_value_heads": 4, "partial_rotary_factor": 0.5},
    "phi3": {"model_type": "phi3", **SMALL, "partial_rotary_factor": 0.5},
}
# Phi-3 admits only longrope scaling, with a factor per rotated pair: 16 x 0.5 / 2 = 4 of them
SCALED = {
    "phi": "{rope_type: yarn, factor: 2.0}",
    "phi3": "{rope_type: longrope, short_factor: [1.0, 1.0, 1.0, 1.0], long_factor: [2.0, 2.0, 2.0, 2.0]}",
}


def test_phi3_longrope_records_the_original_length_it_trains_with():
    scaling = SCALED["phi3"].replace("}", ", original_max_position_embeddings: 16}")
    built = build(PARTIAL["phi3"], f"model.rope_scaling={scaling}")
    assert built.model.config.rope_parameters["original_max_position_embeddings"] == 16
    assert ("original_max_position_embeddings", 4096, 16) in [(c.key, c.old, c.new) for c in built.changes]


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_rope_scaling_keeps_the_partial_rotary_factor(name, scaled):
    scaling = SCALED[name] if scaled else "{rope_type: default}"
    built = build(PARTIAL[name], f"model.rope_scaling={scaling}", "model.rope_theta=10000")
    model = built.model.eval()
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert not any(c.key.endswith("partial_rotary_factor") for c in built.changes)
    for change in built.changes:  # every recorded change is what the model has
        if change.key.startswith("rope_parameters."):
            assert model.config.rope_parameters.get(change.key.removeprefix("rope_parameters.")) == change.new
    # transformers' own model of the same family and rotary parameters, built from its config class
    params = {k: v for k, v in model.config.rope_parameters.items()}
    arch = {k: v for k, v in PARTIAL[name].items() if k not in ("model_type", "partial_rotary_factor")}
    hf = AutoConfig.for_model(name, **{**arch, "vocab_size": VOCAB, "max_position_embeddings": SEQ})
    hf.rope_parameters = params
    ref = AutoModelForCausalLM.from_config(hf, attn_implementation="eager", dtype=torch.float32).eval()
    rotary = model.model.rotary_emb.inv_freq
    assert rotary.numel() == 16 * 0.5 / 2
    torch.testing.assert_close(rotary, ref.model.rotary_emb.inv_freq)
    ref.load_state_dict(model.state_dict())
    ids = ids_of(2)
    batch = make_batch(ids, [[SEQ]], "full")
    with torch.no_grad():
        torch.testing.assert_close(
            CausalLMLossSum(model)(batch) / batch.valid_labels(), ref(input_ids=ids, labels=ids).loss
        )


def test_rope_diagnosis_says_what_its_probe_leaves_out():
    from lctrain.diagnostics.rope_drift import unmeasured_attention

    gemma2 = AutoConfig.for_model("gemma2", **SMALL, attn_logit_softcapping=50.0, sliding_window=8)
    note = unmeasured_attention(gemma2)
    assert "attn_logit_softcapping = 50.0" in note and "sliding_window = 8" in note
    assert unmeasured_attention(AutoConfig.for_model("mistral", **SMALL, sliding_window=8)) is not None
    # Qwen2 ships a window it does not use; a Gemma-2 whose layers all attend fully uses none
    assert unmeasured_attention(AutoConfig.for_model("qwen2", **SMALL)) is None
    full = AutoConfig.for_model("gemma2", **SMALL, attn_logit_softcapping=None, layer_types=["full_attention"] * 2)
    assert unmeasured_attention(full) is None


def test_attention_sinks_are_refused_where_they_would_be_dropped():
    """gpt-oss passes each head's sink logit to the attention function as `s_aux`; an engine that took it into its
    **kwargs unread trained another attention (explorer: a step-1 loss 8.7e-3 from the model's, equal to the model's
    with its sinks at -inf)."""
    arch = {"model_type": "gpt_oss", **SMALL, "head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1}
    model = build(arch).model
    assert any(name.endswith("self_attn.sinks") for name, _ in model.named_parameters())
    with pytest.raises(UserError, match="attention has sinks"):
        model(**make_batch(ids_of(), [[SEQ]], "full").model_kwargs())
    with pytest.raises(UserError, match="s_aux"):
        _reference_call(s_aux=torch.zeros(4))


MLA = {
    "model_type": "deepseek_v3",
    **SMALL,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,  # value heads narrower than the query/key heads (24)
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
}


@pytest.mark.parametrize("mode", ["anchor", "full"])
def test_multi_head_latent_attention_through_the_sdpa_engine_equals_the_reference(mode):
    """DeepSeek-V3's value heads are narrower than its query/key heads: the sdpa engine reshaped them to the query's
    size (a traceback at the first step, models explorer); against the reference engine (the dense mask)."""
    ids = ids_of()
    ids[0, [0, 11, 20]] = 1
    batch = make_batch(ids, [[11, 9, SEQ - 20]], mode)
    losses = []
    for engine in ("reference", "sdpa"):
        torch.manual_seed(0)
        model = CausalLMLossSum(build(MLA, f"attention.mode={mode}", f"attention.engine={engine}").model)
        losses.append(model(batch))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
