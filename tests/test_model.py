"""build_model: RoPE base and scaling, context length, dtype, checkpointing, fp32 rotary, engine, user errors."""

import copy
import logging
import math

import pytest
import torch

from lctrain.attention import make_batch
from lctrain.compat.transformers import attn_implementation_of
from lctrain.config import Config, load_config
from lctrain.errors import UserError
from lctrain.model import build_model, default_rope_theta, rotary_in_fp32

ARCH = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.2,
}


def config(*overrides, arch=ARCH):
    # without the demo's explicit base: the random-init default is what is tested
    cfg = load_config(None, ["data.seq_len=64", "model.dtype=float32", "model.rope_theta=null", *overrides])
    if arch is not None:
        cfg.model.arch = dict(arch)
    return cfg


def rotary(model):
    return model.model.rotary_emb


@pytest.mark.parametrize(
    "seq_len,theta", [(1024, 1e6), (16384, 1e6), (32768, 1e6), (65536, 5e6), (131072, 1e7), (262144, 5e7)]
)
def test_default_rope_theta_follows_table_1(seq_len, theta):
    assert default_rope_theta(seq_len) == theta


def test_rope_theta_and_context_length_defaults_and_overrides():
    model = build_model(config("data.seq_len=131072"), vocab_size=100).model
    assert model.config.rope_parameters["rope_theta"] == 1e7
    assert model.config.max_position_embeddings == 131072
    head_dim = 64 // 4
    want = 1.0 / (1e7 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    torch.testing.assert_close(rotary(model).inv_freq.double(), want, rtol=1e-6, atol=0)

    model = build_model(config("model.rope_theta=12345", "model.max_position_embeddings=4096"), vocab_size=100).model
    assert model.config.rope_parameters["rope_theta"] == 12345
    assert model.config.max_position_embeddings == 4096


def test_rope_scaling_passes_through():
    plain = build_model(config(), vocab_size=100).model
    linear = build_model(config("model.rope_scaling={rope_type: linear, factor: 4.0}"), vocab_size=100).model
    assert linear.config.rope_parameters["rope_type"] == "linear"
    torch.testing.assert_close(rotary(linear).inv_freq, rotary(plain).inv_freq / 4)

    arch = {**ARCH, "max_position_embeddings": 32}
    yarn = build_model(config("model.rope_scaling={rope_type: yarn, factor: 2.0}", arch=arch), vocab_size=100).model
    params = yarn.config.rope_parameters
    assert params["rope_type"] == "yarn" and params["factor"] == 2.0
    assert params["original_max_position_embeddings"] == 32  # the model's own length, not the training length
    assert rotary(yarn).rope_type == "yarn"

    dynamic = build_model(config("model.rope_scaling={type: dynamic, factor: 2.0}"), vocab_size=100).model
    assert dynamic.config.rope_parameters["rope_type"] == "dynamic"
    with pytest.raises(UserError, match="rope_scaling.rope_type = 'ntk-magic' is unknown"):
        build_model(config("model.rope_scaling={rope_type: ntk-magic, factor: 2.0}"), vocab_size=100)


# Llama-2-7B's rotary layout (head_dim 4096 / 32 = 128) and pretraining length (4K) in a model small enough to build
LLAMA2_ROTARY = {
    **ARCH,
    "hidden_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def paper_model(name):
    """The model of a bundled paper config, with Llama-2's rotary layout instead of its 7B weights."""
    raw = load_config(name).model_dump(mode="json", exclude={"source_file"})
    raw["model"].update(name_or_path=None, arch=LLAMA2_ROTARY, dtype="float32", gradient_checkpointing=False)
    return build_model(Config.model_validate(raw), vocab_size=100).model


def rope_inv_freq(base, dim):
    """theta_i = base^(-2i/d), i = 0 .. d/2 - 1 (the paper's Equation 6), one by one in float64."""
    return torch.tensor([base ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


# inv_freq is computed in fp32 as exp(x * ln(base)) with |x * ln(base)| < 25: a few fp32 ulps of 25 (2e-6 each)
INV_FREQ_RTOL = 1e-5


@pytest.mark.parametrize("row,base", [("10k", 1e4), ("1m", 1e6), ("5m", 5e6), ("10m", 1e7)])
def test_table2_ntk_rows_are_static_ntk_aware_rope(row, base):
    model = paper_model(f"llama2_64k_table2_ntk_{row}")
    d, s = 128, 16  # head dimension; s = T_new / T_origin = 64K / 4K
    ntk_base = base * s ** (d / (d - 2))  # LocalLLaMA (2023): base' = base * s^(d / (d - 2))
    assert model.config.rope_parameters["rope_type"] == "default"
    assert math.isclose(model.config.rope_parameters["rope_theta"], ntk_base, rel_tol=1e-12)
    got = rotary(model).inv_freq.double()
    torch.testing.assert_close(got, rope_inv_freq(ntk_base, d), rtol=INV_FREQ_RTOL, atol=0)
    plain = rope_inv_freq(base, d)
    # the lowest frequency drops by s (plain RoPE would keep every one)
    assert got[0] == 1.0 and math.isclose(got[-1] / plain[-1], 1 / s, rel_tol=1e-4)


def test_table2_yarn_rows_follow_the_yarn_paper():
    model = paper_model("llama2_64k_table2_yarn_1m")
    params = model.config.rope_parameters
    assert (params["rope_type"], params["factor"], params["original_max_position_embeddings"]) == ("yarn", 16.0, 4096)
    assert model.config.max_position_embeddings == 65536 and params["rope_theta"] == 1e6
    # Peng et al. (2023): a dimension making r = L_orig / wavelength > beta = 32 turns keeps theta_i, one with
    # r < alpha = 1 is interpolated to theta_i / s, those between ramp from one to the other; attention scaled by
    # 0.1 ln s + 1. (transformers rounds the ramp's ends to whole dimensions, so inside it only the bounds hold.)
    d, s, original = 128, 16, 4096
    theta = rope_inv_freq(1e6, d)
    r = original * theta / (2 * math.pi)
    got = rotary(model).inv_freq.double()
    kept, interpolated = r > 32, r < 1
    assert kept.sum() >= 10 and interpolated.sum() >= 10
    torch.testing.assert_close(got[kept], theta[kept], rtol=INV_FREQ_RTOL, atol=0)
    torch.testing.assert_close(got[interpolated], theta[interpolated] / s, rtol=INV_FREQ_RTOL, atol=0)
    assert bool(((got >= theta / s * (1 - INV_FREQ_RTOL)) & (got <= theta * (1 + INV_FREQ_RTOL))).all())
    assert math.isclose(rotary(model).attention_scaling, 0.1 * math.log(s) + 1, rel_tol=1e-12)


@pytest.mark.parametrize("row,base", [("1m", 1e6), ("5m", 5e6), ("10m", 1e7)])
def test_table2_rope_rows_are_plain_rope(row, base):
    model = paper_model(f"llama2_64k_table2_rope_{row}")
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": base}
    torch.testing.assert_close(rotary(model).inv_freq.double(), rope_inv_freq(base, 128), rtol=INV_FREQ_RTOL, atol=0)


def test_dynamic_ntk_within_the_training_length_is_plain_rope_and_says_so(caplog):
    plain = build_model(config("model.rope_theta=10000"), vocab_size=100).model
    with caplog.at_level(logging.WARNING, logger="lctrain.model"):
        dynamic = build_model(
            config("model.rope_theta=10000", "model.rope_scaling={rope_type: dynamic, factor: 16}"), vocab_size=100
        ).model
    assert "the paper's NTK-aware scaling is model.rope_scaling: {rope_type: ntk}" in caplog.text
    assert torch.equal(rotary(dynamic).inv_freq, rotary(plain).inv_freq)


def test_a_models_own_dynamic_ntk_within_the_training_length_says_so_too(caplog):
    """The model's own `dynamic` scaling is kept, and does as little: said as for model.rope_scaling."""
    own = {**ARCH, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with caplog.at_level(logging.WARNING, logger="lctrain.model"):
        dynamic = build_model(config("model.rope_theta=10000", arch=own), vocab_size=100).model
    assert "the model's own rope_type 'dynamic' scaling (kept): 'dynamic' NTK rescales only past" in caplog.text
    assert dynamic.config.rope_parameters["rope_type"] == "dynamic"
    plain = build_model(config("model.rope_theta=10000"), vocab_size=100).model
    assert torch.equal(rotary(dynamic).inv_freq, rotary(plain).inv_freq)


@pytest.mark.parametrize(
    "scaling,match",
    [
        ("{rope_type: ntk}", "factor = None: rope_type 'ntk' needs a factor >= 1"),
        ("{rope_type: ntk, factor: 0.5}", "factor = 0.5: rope_type 'ntk' needs a factor >= 1"),
        ("{rope_type: ntk, factor: true}", "factor = True: rope_type 'ntk' needs a factor >= 1"),
        (
            "{rope_type: ntk, factor: 16, original_max_position_embeddings: 4096}",
            "rope_type 'ntk' takes only factor .* not original_max_position_embeddings",
        ),
    ],
)
def test_ntk_user_errors(scaling, match):
    with pytest.raises(UserError, match=match):
        build_model(config(f"model.rope_scaling={scaling}"), vocab_size=100)


@pytest.mark.parametrize(
    "scaling,match",
    [
        ("{rope_type: linear, factor: 0.5}", "factor = 0.5: rope_type 'linear' needs a factor >= 1"),
        ("{rope_type: yarn, factor: 0.5, original_max_position_embeddings: 32}", "rope_type 'yarn' needs a factor"),
        ("{rope_type: dynamic, factor: '2'}", "factor = '2': rope_type 'dynamic' needs a factor >= 1"),
        ("{rope_type: yarn, factor: 4.0}", "rope_type 'yarn' extends the model's context .* model.arch names none"),
        ("{rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0}", "model.arch names none"),
    ],
)
def test_scaling_user_errors(scaling, match):
    """transformers only logs a factor below 1; a model.arch naming no context length has no original one."""
    with pytest.raises(UserError, match=match):
        build_model(config(f"model.rope_scaling={scaling}"), vocab_size=100)


def test_a_scaled_arch_extends_from_the_length_it_names():
    """Not from its config class's default (Llama's 2048), which YaRN's ramp and attention factor would follow."""
    named = {**ARCH, "max_position_embeddings": 32}
    yarn = build_model(config("model.rope_scaling={rope_type: yarn, factor: 4.0}", arch=named), vocab_size=100).model
    assert yarn.config.rope_parameters["original_max_position_embeddings"] == 32
    given = "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 16}"
    assert (
        build_model(config(f"model.rope_scaling={given}"), vocab_size=100).model.config.rope_parameters[
            "original_max_position_embeddings"
        ]
        == 16
    )


def test_dtype_engine_and_seeded_init():
    model, engine, _ = build_model(config("model.dtype=bfloat16"), vocab_size=100)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert engine.name == "sdpa" and attn_implementation_of(model.config) == engine.hf_name == "lctrain_sdpa"
    again = build_model(config("model.dtype=bfloat16"), vocab_size=100).model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    other = build_model(config("model.dtype=bfloat16", "seed=1"), vocab_size=100).model
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_random_init_on_the_gpu_is_seeded_and_leaves_the_callers_rng_alone():
    # the weights are drawn on the device (a random 7B takes minutes on a host's cores): same seed, same weights
    state = torch.cuda.get_rng_state()
    model = build_model(config("model.dtype=bfloat16"), vocab_size=100, device="cuda").model
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    again = build_model(config("model.dtype=bfloat16"), vocab_size=100, device="cuda").model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    other = build_model(config("model.dtype=bfloat16", "seed=1"), vocab_size=100, device="cuda").model
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(3, 100, (2, 64))
    ids[:, [0, 17, 40]] = 1
    batch = make_batch(ids, [[17, 23, 24], [17, 23, 24]], "anchor", seg_doc=[[0, 1, 2], [0, 1, 0]])
    grads = []
    for ckpt in (False, True):
        model = build_model(config(f"model.gradient_checkpointing={ckpt}"), vocab_size=100).model.train()
        enabled = [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        assert any(enabled) == ckpt
        model(**batch.model_kwargs(labels=True), use_cache=False).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _rotate(q, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, q, cos, sin)[0]


def test_rope_fp32_rotation_matches_fp32_computation():
    model = build_model(config("model.dtype=bfloat16"), vocab_size=100).model
    fp32_rope = copy.deepcopy(model)
    assert rotary_in_fp32(fp32_rope) == 1
    positions = torch.arange(100_000, 100_064)[None]
    x = torch.zeros(1, 64, 64, dtype=torch.bfloat16)
    q = torch.randn(1, 4, 64, 16).bfloat16()
    # the fp32 computation: the same bf16 inputs rotated in fp32, straight from the RoPE formula
    inv = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    angles = positions[0, :, None].float() * inv
    emb = torch.cat([angles, angles], -1)
    exact = _rotate(q.float(), emb.cos()[None], emb.sin()[None]).double()

    cos, sin = rotary(model)(x, positions)
    assert cos.dtype == torch.bfloat16
    plain_err = (_rotate(q, cos, sin).double() - exact).abs().mean()
    cos, sin = rotary(fp32_rope)(x, positions)
    assert cos.dtype == torch.float32
    rotated = _rotate(q, cos, sin)
    assert rotated.dtype == torch.float32
    # the rotation itself is the fp32 one; what is left after the engines' cast to bf16 is one rounding
    torch.testing.assert_close(rotated.double(), exact, atol=1e-6, rtol=0)
    fp32_err = (rotated.bfloat16().double() - exact).abs().mean()
    assert fp32_err < 0.8 * plain_err, (fp32_err, plain_err)


def test_rope_fp32_model_is_closer_to_fp32_than_plain_bf16():
    model = build_model(config("attention.mode=full"), vocab_size=1000).model.eval()
    plain = copy.deepcopy(model).to(torch.bfloat16)
    fp32_rope = copy.deepcopy(model).to(torch.bfloat16)
    rotary_in_fp32(fp32_rope)
    ids = torch.randint(3, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    errs = {"plain": 0.0, "rope_fp32": 0.0}
    segments = make_batch(ids, [[64]], "full").attention_kwargs()  # one causal window, at shifted positions below
    with torch.no_grad():
        for offset in (30_000, 100_000):
            pos = torch.arange(offset, offset + 64)[None]
            want = model(input_ids=ids, position_ids=pos, **segments).logits
            for name, m in (("plain", plain), ("rope_fp32", fp32_rope)):
                got = m(input_ids=ids, position_ids=pos, **segments).logits
                assert got.dtype == torch.bfloat16
                errs[name] += (got.float() - want).abs().mean().item()
    assert errs["rope_fp32"] < errs["plain"], errs


@pytest.mark.parametrize(
    "overrides,arch,match",
    [
        (["attention.engine=varlen"], ARCH, "needs a CUDA GPU"),
        ([], {k: v for k, v in ARCH.items() if k != "model_type"}, "needs a model_type"),
        ([], {**ARCH, "attention_dropout": 0.1}, "attention dropout"),
        ([], {**ARCH, "model_type": "no-such-model"}, "'no-such-model' is not a transformers model type"),
        ([], {**ARCH, "model_type": "lama"}, "did you mean llama"),
        (
            [],
            {**ARCH, "num_hidden_layer": 3},
            "model.arch.num_hidden_layer is not a 'llama' configuration key; did you mean num_hidden_layers",
        ),
        ([], {**ARCH, "num_attention_heads": 5, "num_key_value_heads": 5}, "not a multiple of the number of attention"),
        ([], {**ARCH, "hidden_size": "abc"}, "hidden_size = 'abc' must be a positive integer"),
        ([], {**ARCH, "hidden_size": -8}, "hidden_size = -8 must be a positive integer"),
        ([], {**ARCH, "num_attention_heads": 0}, "num_attention_heads = 0 must be a positive integer"),
        ([], {**ARCH, "num_hidden_layers": True}, "num_hidden_layers = True must be a positive integer"),
        ([], {**ARCH, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads = 3"),
    ],
)
def test_user_errors(overrides, arch, match):
    with pytest.raises(UserError, match=match):
        build_model(config(*overrides, arch=arch), vocab_size=100)


def test_anchor_outside_vocabulary_is_a_user_error():
    # the built-in tokenizer's anchor (BOS) is id 1; a 1-token vocabulary cannot hold it
    with pytest.raises(UserError, match="anchor token id 1"):
        build_model(config(), vocab_size=1)
    build_model(config("attention.mode=intra_doc"), vocab_size=1)


def test_from_pretrained_directory(tmp_path):
    saved = build_model(config("model.rope_theta=10000"), vocab_size=100).model
    saved.save_pretrained(tmp_path)
    pretrained = ("model.arch=null", f"model.name_or_path={tmp_path}")
    loaded, _, changes = build_model(config("data.seq_len=65536", *pretrained, arch=None))
    # the model's own base, its context length raised to the training length
    assert loaded.config.rope_parameters["rope_theta"] == 10000
    assert loaded.config.max_position_embeddings == 65536
    assert attn_implementation_of(loaded.config) == "lctrain_sdpa"
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), loaded.parameters()))
    assert [(c.key, c.old, c.new) for c in changes] == [
        ("max_position_embeddings", 64, 65536),
        ("attn_implementation", None, "lctrain_sdpa"),
    ]
    # the paper's base only when the config sets it
    theta = build_model(config("data.seq_len=65536", "model.rope_theta=5000000", *pretrained, arch=None)).model
    assert theta.config.rope_parameters["rope_theta"] == 5e6

    missing = config("model.arch=null", f"model.name_or_path={tmp_path / 'absent'}", arch=None)
    with pytest.raises(UserError, match="cannot be loaded"):
        build_model(missing)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(UserError, match="cannot load the weights"):
        build_model(config("model.arch=null", f"model.name_or_path={tmp_path}", arch=None))


def saved_tensor_count(model, batch) -> int:
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model(**batch.model_kwargs(labels=True), use_cache=False)
    return len(kept)


def test_a_pretrained_model_is_built_for_training_and_checkpoints(tmp_path):
    """from_pretrained returns an eval-mode model, where transformers skips checkpointing: built here, a pretrained
    model trains with its layers checkpointed (autograd keeps far fewer tensors than without)."""
    build_model(config(), vocab_size=100).model.save_pretrained(tmp_path)
    ids = torch.randint(3, 100, (1, 64))
    batch = make_batch(ids, [[64]], "anchor", seg_doc=[[0]])
    saved = {}
    for mode in ("none", "full"):
        cfg = config("model.arch=null", f"model.name_or_path={tmp_path}", f"model.checkpointing={mode}", arch=None)
        model = build_model(cfg).model
        assert model.training
        saved[mode] = saved_tensor_count(model, batch)
    assert saved["full"] < saved["none"] / 2, saved
