"""`lctrain diagnose rope`: the attention difference under a positional shift (paper Eq. 4/5, Figure 1) on tiny
models: exactly 0 for Δ1 = Δ2, rounding level in fp32, much larger in bf16, where a first-token attention sink (as
pretrained LLMs have) carries the bulk of it."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.eval.rope_drift import measure

V, D, H, HD = 512, 64, 4, 16
SHIFTS = (0, 16, 100, 1000)


def sink_model(dtype, strength=0.4):
    """A tiny random Llama with an attention sink on token 0: token 0 (BOS) has its own embedding direction u_b,
    every other token shares u_c, and in each head the lowest-frequency rotary pair of k reads u_b and of q reads u_c,
    so every query puts ~70% of its attention on token 0."""
    cfg = AutoConfig.for_model("llama", hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=H,
                               num_key_value_heads=H, vocab_size=V, max_position_embeddings=16384, rope_theta=10000.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    u_b, u_c = torch.linalg.qr(torch.randn(D, 2))[0].T
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.mul_(0.3).add_(u_c)
        emb[1] = u_b * D**0.5
        for layer in model.model.layers:
            for h in range(H):
                for dim in (HD // 2 - 1, HD - 1):
                    layer.self_attn.q_proj.weight[h * HD + dim] = strength * u_c
                    layer.self_attn.k_proj.weight[h * HD + dim] = strength * u_b
    return model.to(dtype)


@pytest.fixture(scope="module")
def results():
    torch.manual_seed(1)
    ids = torch.cat([torch.tensor([[1]]), torch.randint(3, V, (1, 255))], dim=1)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[name] = measure(sink_model(dtype), ids[:, :128], ids, shifts=SHIFTS, logit_lengths=(64, 256))
    return out


def test_zero_when_shifts_are_equal(results):
    for r in results.values():
        assert r["D"][SHIFTS.index(16)] == 0.0


def test_fp32_at_rounding_level_bf16_far_above(results):
    fp32, bf16 = results["fp32"], results["bf16"]
    for i, shift in enumerate(SHIFTS):
        if shift != 16:
            assert fp32["D"][i] < 1e-6
            assert bf16["D"][i] > 100 * fp32["D"][i]
    assert min(bf16["D_logit"]) > 100 * max(fp32["D_logit"])


def test_first_token_carries_the_bf16_difference(results):
    bf16 = results["bf16"]
    # rows of attention sum to 1, so token 0's share is at most 1/2: what it loses the others gain
    assert 0.4 < bf16["first_token_share"] <= 0.5
    assert bf16["first_token_vs_others"] > 20
    assert bf16["per_token"][0] == max(bf16["per_token"])
    assert sum(bf16["per_token"]) == pytest.approx(bf16["D"][0], rel=1e-6)


def test_measure_keeps_the_model_usable():
    model = sink_model(torch.float32)
    ids = torch.randint(3, V, (1, 32))
    measure(model, ids, ids, shifts=(0,), logit_lengths=(16,))
    assert model.config._attn_implementation == "lctrain_rope_probe"
    model.set_attn_implementation("sdpa")
    ref = AutoModelForCausalLM.from_config(model.config)
    ref.load_state_dict(model.state_dict())
    assert torch.allclose(model(ids).logits, ref.eval()(ids).logits, atol=1e-5)


def test_cli_on_a_tiny_config(tmp_path):
    out = tmp_path / "diag"
    r = CliRunner().invoke(app, ["diagnose", "rope", "tiny_anchor", "--seq-len", "32", "--max-len", "64",
                                 "--set", "model.arch.num_hidden_layers=1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "rope_drift.json").read_text())
    assert set(data["variants"]) == {"fp32", "bf16", "bf16+rope_fp32"}
    assert data["logit_lengths"] == [64] and len(data["variants"]["bf16"]["D"]) == len(data["shifts"]) == 19
    assert max(data["variants"]["fp32"]["D"]) < 1e-5 < min(data["variants"]["bf16"]["D"])
    png = out / "rope_drift.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


def test_cli_bad_model(tmp_path):
    r = CliRunner().invoke(app, ["diagnose", "rope", str(tmp_path)])
    assert r.exit_code == 2 and r.output.strip().startswith("error: ") and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(app, ["diagnose", "rope", "tiny_anchor", "--max-len", "10"])
    assert r.exit_code == 2 and "--max-len" in r.output


def test_model_directory(tmp_path):
    from lctrain.eval.rope_drift import diagnose_rope
    from lctrain.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, vocab_size=len(tok), max_position_embeddings=4096)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    out = diagnose_rope(str(tmp_path / "m"), seq_len=32, max_len=64, shifts=(0, 16, 50), out=str(tmp_path / "d"))
    data = json.loads((out / "rope_drift.json").read_text())
    assert data["model"] == str(tmp_path / "m") and data["shifts"] == [0, 16, 50]
    for v in data["variants"].values():
        assert v["D"][1] == 0.0 and len(v["per_token"]) == 32
