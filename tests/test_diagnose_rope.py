"""`lctrain diagnose rope` (paper §2.2, Eq. 4 and 5, Figures 1 and 7) on tiny models, against the loop-based
implementations of the formulas in rope_reference.py, written from the model's own eager attention (Hugging Face
`eager`, `output_attentions=True`) and from its own q/k projections and rotary frequencies.

Shift-invariance breaks in fp32 too once positions are large: at 4,000,000 an fp32 rotation angle is rounded to 0.25,
so D(X, 0, 4e6) is far above rounding level in fp32, where the code under test and the references compute the same
function to fp32 precision. That is where the values are compared; bf16 is checked for what the paper reports.
"""

import json
import math
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
from rope_reference import reference_eq4, reference_eq5
from torch.utils.flop_counter import FlopCounterMode
from train_helpers import one_error_line
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.diagnostics import rope_drift as rd
from lctrain.diagnostics.probe_text import packed_document_spans, probe_sequences
from lctrain.errors import UserError
from lctrain.tokenizer import builtin_model_file

V, D, LAYERS, H, KV, HD, T = 512, 64, 2, 4, 2, 16, 32
FAR = 4_000_000  # exactly representable in fp32 (< 2**24); its angle ulp is 0.25 rad
SHIFTS = (0, 16, 100, FAR)
LENGTHS = (16, 32)
# Largest difference of one attention weight between the probe and HF eager attention in fp32 (same operations,
# other kernels): ~8 ulp of 1.0, above what softmax over <= 32 keys of O(10) logits in two layers accumulates.
EPS_WEIGHT = 1e-6


def tiny_config(**kw):
    return AutoConfig.for_model(
        "llama",
        hidden_size=D,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=KV,
        vocab_size=V,
        max_position_embeddings=64,
        rope_theta=10000.0,
        **kw,
    )


def sharp_model(impl=rd.PROBE_IMPL):
    """A tiny random Llama (grouped-query: 2 KV heads for 4 heads) whose q/k are scaled up so that attention is
    peaked (max weight ~0.5), as in trained models, rather than nearly uniform."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config()).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    rd._register()
    model.set_attn_implementation(impl)
    return model


def sequence(n=T, seed=1):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def plan(**kw):
    args = dict(
        seq_len=T,
        shifts=SHIFTS,
        delta2=16,
        logit_lengths=LENGTHS,
        vary_delta2=False,
        shift_batch=2,
        chunk_bytes=1 << 30,
    )
    return rd.Plan(**{**args, **kw})


def measured(model, ids, p):
    with torch.inference_mode():
        return rd.measure_sequence(model, ids, p)


# ---- Eq. 4 and Eq. 5 against the references --------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_result():
    return measured(sharp_model(), sequence(), plan())


@pytest.fixture(scope="module")
def eager():
    return sharp_model("eager")


def test_eq4_total_and_per_key_match_the_loop_reference(fp32_result, eager):
    ids = sequence()
    # |D − D_ref| <= Σ_{l,h,j} n_j Σ_i 2·EPS_WEIGHT = 2·L·H·T·EPS_WEIGHT (each column has 1/n_j entries)
    bound = 2 * LAYERS * H * T * EPS_WEIGHT
    for d1, got in zip(SHIFTS, fp32_result["D"]):
        want, per_key = reference_eq4(eager, ids, d1, 16)
        assert abs(got - want) <= bound, (d1, got, want)
        if d1 == FAR:
            assert want > 30 * bound  # the comparison is not between two rounding noises
    want, per_key = reference_eq4(eager, ids, 0, 16)
    assert len(fp32_result["per_token"]) == T
    for j, (got, ref) in enumerate(zip(fp32_result["per_token"], per_key)):
        assert abs(got - ref) <= 2 * LAYERS * H * EPS_WEIGHT, j
    assert sum(fp32_result["per_token"]) == pytest.approx(fp32_result["D"][0], rel=1e-12)


def test_eq4_per_key_at_a_far_shift(eager):
    ids = sequence()
    with torch.inference_mode():
        sums = rd.key_sums(sharp_model(), ids, 0, (FAR,), plan(), lambda: None)
    got = rd.per_key_difference(sums)[0].tolist()
    _, want = reference_eq4(eager, ids, FAR, 0)
    assert max(want) > 100 * 2 * LAYERS * H * EPS_WEIGHT
    for j, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 2 * LAYERS * H * EPS_WEIGHT, j


def test_eq5_unscaled_and_scaled_match_the_loop_reference(eager):
    ids = sequence()
    model = sharp_model()
    with torch.inference_mode():
        got, scaling = rd.first_logit_difference(model, ids, 0, FAR, 1 << 30)
    want = reference_eq5(eager, ids, 0, FAR)
    # fp32 logits of magnitude ~|q||k| carry ~1e-6 relative error (16-term dot products after two layers); the far
    # shift moves them by ~1e-2 relative, so agreement to 1e-3 relative separates the formula from rounding
    assert want > 0.1
    assert got == pytest.approx(want, rel=1e-3)
    assert scaling == HD**-0.5
    scaled = rd.summarize([{"D": [0.0], "per_token": [0.0], "D_logit": [got], "logit_scaling": scaling}], True)
    assert scaled["D_logit"][0] == pytest.approx(want * HD**-0.5, rel=1e-3)


def test_eq5_against_length_matches_the_reference_per_length(eager):
    ids = sequence()
    got = measured(sharp_model(), ids, plan(shifts=(0,), delta2=FAR))["D_logit"]
    for length, value in zip(LENGTHS, got):
        want = reference_eq5(eager, ids[:length], 0, FAR)
        assert want > 0.1 and value == pytest.approx(want, rel=1e-3), length


@pytest.mark.parametrize("shifts, vary", [((100,), False), ((0, 16, 100, 7), True)])
def test_per_token_split_is_at_delta1_zero_and_passes_are_counted(shifts, vary):
    """Without Δ1 = 0 in the sweep the split gets its own pass; the progress bar's total is the passes made."""
    model, ids = sharp_model(), sequence()
    calls = []
    p = plan(shifts=shifts, delta2=FAR, vary_delta2=vary, shift_batch=1)
    with torch.inference_mode():
        got = rd.measure_sequence(model, ids, p, lambda: calls.append(1))
        at_zero = rd.measure_sequence(model, ids, plan(shifts=(0,), delta2=FAR, shift_batch=1))
    assert got["per_token"] == at_zero["per_token"]
    assert len(calls) == p.passes() == len(shifts) + (0 not in shifts) + vary * (len(shifts) - 1) + len(LENGTHS)
    assert p.tokens() == (2 * T * (p.passes() - len(LENGTHS)) + 2 * sum(LENGTHS))


@pytest.mark.parametrize("kw", [{}, dict(shifts=(0, 16, 100, 7), vary_delta2=True, shift_batch=3, seq_len=24)])
def test_estimated_flops_are_those_torch_counts(kw):
    """The FLOPs behind the printed throughput against torch's own count (FlopCounterMode) of one sequence's
    measurement: every matmul run (the decoder's projections, the probe's q·kᵀ and weights·V over whole T x T
    squares). The vocabulary projection, which the decoder alone does not run, is not in it: counting it inflated a
    CPU's throughput past its peak."""
    model, p = sharp_model(), plan(**kw)
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        rd.measure_sequence(model, sequence(), p)
    assert rd.estimate_flops(model, p) == counter.get_total_flops()


# ---- properties the paper reports --------------------------------------------------------------------------------


def bf16_cases(cases=("bf16_rope_bf16", "bf16")):
    model = sharp_model()
    p = plan(shifts=(0, 16, 100), vary_delta2=True)
    ids = sequence()
    out = {}
    with torch.inference_mode():
        for name, m, _ in rd.case_models(model, ("fp32", *cases), seed=0):
            out[name] = rd.measure_sequence(m, ids, p)
    return out


@pytest.fixture(scope="module")
def cases():
    return bf16_cases()


def test_equal_shifts_give_exactly_zero(cases):
    for r in cases.values():
        assert r["D"][1] == 0.0  # Δ1 = Δ2 = 16
        assert r["D_vary_delta2"][0] == 0.0  # Δ1 = Δ2 = 0


def test_fp32_at_rounding_level_bf16_far_above(cases):
    fp32 = cases["fp32"]
    bound = 2 * LAYERS * H * T * EPS_WEIGHT
    for i in (0, 2):
        assert fp32["D"][i] < bound
        for name in ("bf16", "bf16_rope_bf16"):
            assert cases[name]["D"][i] > 100 * fp32["D"][i]
            assert cases[name]["D_logit"][1] > 100 * fp32["D_logit"][1]


def test_bf16_cases_keep_fp32_rotary_frequencies():
    model = sharp_model()
    for name, m, _ in rd.case_models(model, ("fp32", "bf16"), seed=0):
        assert m.model.rotary_emb.inv_freq.dtype == torch.float32
        assert m.model.layers[0].self_attn.q_proj.weight.dtype == (torch.float32 if name == "fp32" else torch.bfloat16)


def test_random_case_is_pytorch_default_init():
    model = sharp_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kept = rd.reinit_random(model, seed=3)
    assert kept == []
    for name, module in model.model.named_modules():
        if isinstance(module, torch.nn.Linear):
            bound = 1 / math.sqrt(module.in_features)  # kaiming_uniform_(a=sqrt(5)): sqrt(6 / (6 fan_in))
            w = module.weight
            assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound, name
            assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1), name
    emb = model.model.embed_tokens.weight
    assert emb.mean().abs() < 0.05 and emb.std().item() == pytest.approx(1.0, rel=0.03)  # N(0, 1): 32K draws
    assert all(
        torch.equal(n.weight, torch.ones_like(n.weight))
        for n in model.model.modules()
        if type(n).__name__.endswith("RMSNorm")
    )
    assert not torch.equal(
        before["model.layers.0.self_attn.q_proj.weight"], model.model.layers[0].self_attn.q_proj.weight
    )
    again = sharp_model()
    rd.reinit_random(again, seed=3)
    assert torch.equal(again.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)


def test_probe_accumulates_per_layer_not_per_model():
    """Head groups of one head give the same sums as all heads at once: nothing needs the whole [H, T, T]."""
    model, ids = sharp_model(), sequence()
    with torch.inference_mode():
        whole = rd.key_sums(model, ids, 16, (0, 100), plan(), lambda: None)
        grouped = rd.key_sums(model, ids, 16, (0, 100), plan(chunk_bytes=1), lambda: None)
    assert torch.allclose(whole, grouped, rtol=1e-5, atol=1e-9)


# ---- probe text ----------------------------------------------------------------------------------------------------


def test_packed_document_spans():
    # window 0: doc a (5) | doc b (3); window 1: b continued (4) | header-only tail (1); window 2: a new doc (8)
    windows = [
        (np.array([5, 3]), np.array([0, 0])),
        (np.array([7, 1]), np.array([0, 0])),
        (np.array([8]), np.array([0])),
    ]
    assert list(packed_document_spans(windows, 8, 4)) == [(0, 0, True), (2, 0, True)]
    assert list(packed_document_spans(windows, 8, 3)) == [(0, 0, True), (0, 5, True), (2, 0, True)]
    assert list(packed_document_spans(windows, 8, 8)) == [(0, 0, False), (2, 0, True)]


@pytest.fixture(scope="module")
def tokenizer():
    from lctrain.tokenizer import load_tokenizer

    return load_tokenizer("builtin:mistral-7b-v0.1")


SPM = spm.SentencePieceProcessor(model_file=str(builtin_model_file("mistral-7b-v0.1")))


@pytest.fixture(scope="module")
def stdlib_text(tmp_path_factory):
    """Real text that ships with Python: standard-library sources as .txt files, and some as .jsonl records."""
    src = Path(sysconfig.get_path("stdlib"))
    out = tmp_path_factory.mktemp("text")
    names = ("argparse", "typing", "inspect", "tarfile", "pathlib")
    for name in names:
        shutil.copy(src / f"{name}.py", out / f"{name}.txt")
    records = [{"text": (src / f"{n}.py").read_text()} for n in ("json/decoder", "csv")]
    (out / "more.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return out


def test_local_text_sequences(stdlib_text, tokenizer):
    got = probe_sequences(stdlib_text, tokenizer, 300, 6, vocab_size=len(tokenizer), seed=0)
    assert len(got.sequences) == 6 and len(set(got.origins)) == 6
    assert got.anchor == {"token": tokenizer.bos_token, "id": tokenizer.bos_token_id} == {"token": "<s>", "id": 1}
    for ids, origin in zip(got.sequences, got.origins):
        path, _, line = origin.partition(":") if origin.endswith((":1", ":2")) else (origin, "", "")
        text = (
            json.loads(Path(path).read_text().splitlines()[int(line) - 1])["text"] if line else Path(path).read_text()
        )
        want = [tokenizer.bos_token_id] + SPM.encode(text)[:299]  # the reference tokenizer itself
        assert ids.tolist() == want


def test_local_text_errors(stdlib_text, tokenizer, tmp_path):
    with pytest.raises(UserError, match="need 50"):
        probe_sequences(stdlib_text, tokenizer, 300, 50, vocab_size=len(tokenizer))
    with pytest.raises(UserError, match="0 of its 7 documents have 10,000,000 tokens"):
        probe_sequences(stdlib_text, tokenizer, 10_000_000, 1, vocab_size=len(tokenizer))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not a JSON object"):
        probe_sequences(bad, tokenizer, 4, 2, vocab_size=len(tokenizer))
    with pytest.raises(UserError, match="no such file"):
        probe_sequences(tmp_path / "missing", tokenizer, 4, 1, vocab_size=len(tokenizer))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="--text takes"):
        probe_sequences(tmp_path / "x.csv", tokenizer, 4, 1, vocab_size=len(tokenizer))


def test_capitalised_extensions_are_text_too(tokenizer, tmp_path):
    """`NOTES.TXT` and `CORPUS.JSONL` were refused ("--text takes ...") or passed over in a folder."""
    (tmp_path / "NOTES.TXT").write_text("plain words " * 20)
    (tmp_path / "CORPUS.JSONL").write_text(json.dumps({"text": "json words " * 20}) + "\n")
    got = probe_sequences(tmp_path, tokenizer, 8, 2, vocab_size=len(tokenizer))
    assert sorted(o.rpartition("/")[2] for o in got.origins) == ["CORPUS.JSONL:1", "NOTES.TXT"]


def test_a_text_given_twice_is_one_sample(tmp_path, tokenizer):
    """A corpus can hold one text twice (the standard library has copies): the copy is no second sample."""
    src = Path(sysconfig.get_path("stdlib"))
    texts = [(src / f"{n}.py").read_text() for n in ("csv", "csv", "json/decoder")]
    corpus = tmp_path / "copies.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    got = probe_sequences(corpus, tokenizer, 300, 2, vocab_size=len(tokenizer))
    assert got.origins == [f"{corpus}:1", f"{corpus}:3"]
    assert got.sequences[0].tolist() != got.sequences[1].tolist()
    with pytest.raises(UserError, match="2 of its 3 documents have 300 tokens .*, not counting 1 that repeat"):
        probe_sequences(corpus, tokenizer, 300, 3, vocab_size=len(tokenizer))


# ---- the command ---------------------------------------------------------------------------------------------------

TINY = [
    "--set",
    "model.arch.num_hidden_layers=1",
    "--set",
    "model.arch.hidden_size=32",
    "--set",
    "model.arch.intermediate_size=64",
]


def test_cli_end_to_end_on_real_text(stdlib_text, tmp_path):
    out = tmp_path / "diag"
    r = CliRunner().invoke(
        app,
        [
            "diagnose",
            "rope",
            "tiny_anchor",
            "--text",
            str(stdlib_text),
            "--samples",
            "2",
            "--seq-len",
            "48",
            "--max-len",
            "64",
            "--shifts",
            "0,16,200",
            "--cases",
            "all",
            "--vary-delta2",
            "--scaled-logits",
            "--out",
            str(out),
            *TINY,
        ],
    )
    assert r.exit_code == 0, r.output
    printed = "".join(r.output.split())  # rich wraps lines at the terminal width
    # a tiny model's work in GFLOP (it printed "0.0 TFLOP"), 3 significant digits
    assert re.search(r"\)=\d\.\d+GFLOPpercase", printed) and "timing:fp32" in printed
    # the work per sequence (64 tokens: the longest logit length), then for a case's 2 sequences
    p = rd.Plan(48, (0, 16, 200), rd.DELTA2, (64,), True, 4, 1)
    assert (p.passes(), p.tokens()) == (3, 2 * 3 * 48 + 2 * 64)  # each sweep: one pass of its reference and 2 shifts
    assert "2sequencesof64tokens" in printed
    per_case = f"({p.tokens():,}tokenspersequence,6passesand{2 * p.tokens():,}tokenspercase)"
    assert f"measuredin3forwardpassesofthedecoder{per_case}" in printed
    data = json.loads((out / "rope_drift.json").read_text())
    assert list(data["cases"]) == ["fp32", "bf16_rope_bf16", "bf16", "random"]
    assert data["samples"] == 2 and data["text"]["sequences"] == 2 and data["logit_lengths"] == [64]
    for v in data["cases"].values():
        assert len(v["D_per_sample"]) == 2 and len(v["D_per_sample"][0]) == 3 and v["D"][1] == 0.0
        assert len(v["per_token"]) == 48 and len(v["D_vary_delta2_per_sample"]) == 2
        assert v["D"][0] == pytest.approx(sum(x[0] for x in v["D_per_sample"]) / 2)
    assert data["cases"]["random"]["kept_parameters"] == []
    assert max(data["cases"]["fp32"]["D"]) < 1e-4 < min(data["cases"]["bf16"]["D"][i] for i in (0, 2))
    for png in ("rope_figure1.png", "rope_figure7.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and (out / png).stat().st_size > 10_000


def test_cli_default_text_is_the_prepared_dataset(tmp_path):
    from lctrain.config import load_config
    from lctrain.data.prepare import prepare

    data = tmp_path / "prepared"
    overrides = [
        f"data.output_dir={data}",
        "data.seq_len=256",
        "data.token_budget=20000",
        "data.synthetic.num_docs=200",
    ]
    line = one_error_line(
        CliRunner().invoke(app, ["diagnose", "rope", "tiny_anchor", *sum((["--set", o] for o in overrides), [])])
    )
    assert "lctrain prepare -c tiny_anchor" in line and "--text" in line
    prepare(load_config(None, overrides))
    out = tmp_path / "diag"
    args = [
        "diagnose",
        "rope",
        "tiny_anchor",
        "--samples",
        "3",
        "--seq-len",
        "64",
        "--max-len",
        "64",
        "--shifts",
        "0,16",
        "--cases",
        "bf16",
        "--out",
        str(out),
        *TINY,
        *sum((["--set", o] for o in overrides), []),
    ]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    text = json.loads((out / "rope_drift.json").read_text())["text"]
    assert text["path"] == str(data) and text["sequences"] == 3 and text["origins"][0] == "window 0, token 0"
    assert text["anchor"] == {"token": "<s>", "id": 1}  # the prepared dataset's, from its manifest


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shifts", "0,-4"], "--shifts 0,-4: expected distinct non-negative"),
        (["--shifts", "0,a"], "--shifts 0,a: expected comma-separated"),
        (["--shifts", "2,2"], "expected distinct"),
        (["--cases", "fp16"], "--cases fp16: expected some of"),
        (["--samples", "0"], "need samples >= 1"),
        (["--seq-len", "200000"], "need 2 <= seq_len <= 16384"),
    ],
)
def test_cli_bad_arguments(args, message):
    line = one_error_line(CliRunner().invoke(app, ["diagnose", "rope", "tiny_anchor", *args]))
    assert message in line


def test_cli_model_directory_without_text_and_with_short_text(tmp_path, tokenizer):
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tokenizer),
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    line = one_error_line(CliRunner().invoke(app, ["diagnose", "rope", str(tmp_path / "m"), "--max-len", "64"]))
    assert "no text to probe" in line and "--text PATH" in line
    (tmp_path / "short.txt").write_text("A sentence far shorter than the sequence asked for.")
    line = one_error_line(
        CliRunner().invoke(
            app,
            [
                "diagnose",
                "rope",
                str(tmp_path / "m"),
                "--text",
                str(tmp_path / "short.txt"),
                "--seq-len",
                "64",
                "--max-len",
                "64",
            ],
        )
    )
    assert "0 of its 1 documents have 64 tokens" in line


def test_a_run_directory_given_as_model_points_to_its_newest_export(tmp_path):
    """A run directory holds no config.json: the refusal names the export to diagnose instead."""
    for step in (2, 10, 4):
        (tmp_path / "hf" / f"step_{step}").mkdir(parents=True)
    with pytest.raises(UserError, match=rf"its hf/step_N exports, e.g. {tmp_path / 'hf' / 'step_10'}$"):
        rd.model_source(str(tmp_path))
    with pytest.raises(UserError, match=r"nor a config YAML$"):
        rd.model_source(str(tmp_path / "hf"))  # no exports below: nothing more to say
