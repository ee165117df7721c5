"""Every engine against an independent dense-mask attention built directly from the docs/design.md §3 table.

The reference here is written from the table with plain Python loops over segment lists (not from make_batch's
metadata) and computed in float64; engines run in fp32 (tight tolerance) and bf16 (loose), forward and backward.
"""

import random

import pytest
import torch

from lctrain.attention import ENGINES, MODES, make_batch
from lctrain.errors import UserError


def table_mask(seg_lens, seg_doc, mode):
    """visible[q][k] for one row, straight from the table: causal, plus the mode's document rule. A document's later
    chunks (paper Fig. 5) are bare text, so in `anchor` mode too a token sees its document and, in it, one anchor."""
    doc_of = [d for n, d in zip(seg_lens, seg_doc) for _ in range(n)]
    L = len(doc_of)
    mask = torch.zeros(L, L, dtype=torch.bool)
    for q in range(L):
        for k in range(q + 1):
            mask[q, k] = mode == "full" or doc_of[q] == doc_of[k]
    return mask


def dense_attention(q, k, v, masks, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~masks[:, None], float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def test_table_mask_hand_example():
    # [A x] [A y y] [z z] with the third segment a second chunk of document 0 (no anchor of its own)
    m = table_mask([2, 3, 2], [0, 1, 0], "anchor").int().tolist()
    assert m[6] == [1, 1, 0, 0, 0, 1, 1]  # z sees doc 0's anchor and x, and itself
    assert m[2] == [0, 0, 1, 0, 0, 0, 0]  # an anchor sees only itself
    assert m[4] == [0, 0, 1, 1, 1, 0, 0]
    assert table_mask([2, 3, 2], [0, 1, 0], "intra_doc").int().tolist() == m
    assert table_mask([2, 3, 2], [0, 1, 0], "full")[6].int().tolist() == [1] * 7


def random_layout(L, rng, kind):
    if kind == "single":
        return [L], [0], [rng.randint(0, 3)]
    if kind == "one_token_docs":
        lens = [1] * (L - 5) + [5]
    elif kind == "tiny":
        lens = []
        while sum(lens) < L:
            lens.append(min(rng.randint(1, 4), L - sum(lens)))
    else:  # long-tailed lengths, with tags and interleaved chunks of documents
        lens = []
        while sum(lens) < L:
            lens.append(min(int(rng.paretovariate(1.2) * 3), L - sum(lens)))
    n = len(lens)
    if kind == "interleaved":
        docs = [rng.randrange(max(1, n // 2)) for _ in range(n)]
    else:
        docs = list(range(n))
    # only a document's first segment carries an anchor and a tag
    tags = [rng.randint(0, min(2, n_ - 1)) if d not in docs[:i] else 0 for i, (n_, d) in enumerate(zip(lens, docs))]
    return lens, docs, tags


LAYOUT_KINDS = ("single", "one_token_docs", "tiny", "long_tail", "interleaved")


def make_case(mode, dtype, heads=(4, 2), L=48, seed=0, kinds=LAYOUT_KINDS):
    rng = random.Random(seed)
    rows = [random_layout(L, rng, kind) for kind in kinds]
    B = len(rows)
    ids = torch.randint(3, 500, (B, L))
    batch = make_batch(ids, [r[0] for r in rows], mode, seg_doc=[r[1] for r in rows], tag_lens=[r[2] for r in rows])
    masks = torch.stack([table_mask(r[0], r[1], mode) for r in rows])
    gen = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    q, k, v = (torch.randn(B, h, L, 16, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv))
    w = torch.randn(B, L, H, 16, generator=gen, dtype=torch.float64)
    return batch, masks, (q, k, v), w


def run_engine(name, batch, qkv, w, dtype, backward=True):
    leaves = [t.to(dtype).requires_grad_(backward) for t in qkv]
    out, weights = ENGINES[name].attention(None, *leaves, None, scaling=0.25, **batch.attention_kwargs())
    assert weights is None
    grads = torch.autograd.grad((out.double() * w).sum(), leaves) if backward else None
    return out.double(), grads


def reference(masks, qkv, w):
    leaves = [t.clone().requires_grad_(True) for t in qkv]
    out = dense_attention(*leaves, masks, 0.25)
    return out, torch.autograd.grad((out * w).sum(), leaves)


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("engine", ["sdpa", "reference"])
def test_engine_matches_table_forward_backward(engine, mode, dtype):
    batch, masks, qkv, w = make_case(mode, dtype)
    want, want_grads = reference(masks, qkv, w)
    got, grads = run_engine(engine, batch, qkv, w, dtype)
    torch.testing.assert_close(got, want, **TOL[dtype])
    for g, wg, name in zip(grads, want_grads, "qkv"):
        scale = 4 if dtype == torch.bfloat16 else 1  # bf16 gradients accumulate more rounding
        torch.testing.assert_close(
            g.double(),
            wg,
            atol=TOL[dtype]["atol"] * scale,
            rtol=TOL[dtype]["rtol"] * scale,
            msg=lambda m, name=name: f"grad {name}: {m}",
        )


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (2, 1)], ids=["mha", "gqa3", "mqa"])
def test_sdpa_head_layouts(heads):
    batch, masks, qkv, w = make_case("anchor", torch.float32, heads=heads, seed=3)
    want, _ = reference(masks, qkv, w)
    got, _ = run_engine("sdpa", batch, qkv, w, torch.float32, backward=False)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_sdpa_plan_covers_every_token_once_and_is_built_once_per_batch():
    from lctrain.attention.engines.sdpa import build_sdpa_plan

    batch, _, qkv, w = make_case("anchor", torch.float32, seed=5)
    seg = batch.segments
    assert seg.multi_segment_docs  # the interleaved row: a document's chunks gathered into one job
    plan = build_sdpa_plan(seg.layout)
    assert sorted(plan.order.tolist()) == list(range(seg.batch * seg.length))
    assert sum(G * n for G, n in plan.causal) == seg.batch * seg.length
    # equal-length documents share one kernel call: fewer calls than documents
    assert len(plan.causal) < seg.layout.num_docs

    run_engine("sdpa", batch, qkv, w, torch.float32, backward=False)
    key = ("sdpa", torch.device("cpu"))
    cached = seg.cached(key, lambda: pytest.fail("plan rebuilt"))
    run_engine("sdpa", batch, qkv, w, torch.float32, backward=False)  # a second layer
    assert seg.cached(key, lambda: pytest.fail("plan rebuilt")) is cached


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mode", MODES)
def test_flex_forward_on_cpu(mode):
    pytest.importorskip("torch.nn.attention.flex_attention")
    batch, masks, qkv, w = make_case(mode, torch.float32, L=40, seed=1)
    want, _ = reference(masks, qkv, w)
    got, _ = run_engine("flex", batch, qkv, w, torch.float32, backward=False)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("name", ["sdpa", "reference", "flex", "varlen"])
def test_no_segments_fails_closed(name):
    """Without the batch's segments an engine refuses to run, naming the caller, instead of guessing causal
    attention (which would train a document mode as `full` without a word)."""
    q, k, v = (torch.randn(1, h, 9, 8) for h in (4, 2, 2))

    class SomeAttention(torch.nn.Module):
        pass

    with pytest.raises(UserError, match="got no segment metadata .* from SomeAttention"):
        ENGINES[name].attention(SomeAttention(), q, k, v, None, scaling=0.5)


def test_mismatched_segments_are_rejected():
    batch, _, qkv, w = make_case("anchor", torch.float32)
    with pytest.raises(ValueError, match="describes a"):
        ENGINES["sdpa"].attention(None, *(t[:, :, :10].float() for t in qkv), None, **batch.attention_kwargs())


def test_fp32_rotated_qk_are_cast_to_value_dtype():
    batch, masks, (q, k, v), w = make_case("intra_doc", torch.bfloat16)
    out, _ = ENGINES["sdpa"].attention(
        None, q.float(), k.float(), v.bfloat16(), None, scaling=0.25, **batch.attention_kwargs()
    )
    assert out.dtype == torch.bfloat16


def per_sequence_causal(with_gqa: bool):
    """A CPU stand-in for `torch.nn.attention.varlen.varlen_attn`: causal attention within each cu_seqlens range,
    written as a plain loop. `with_gqa`: the newer signature with `enable_gqa` (PyTorch > 2.11), else the 2.11 one,
    which needs as many K/V heads as query heads."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):
        assert torch.equal(cu_q, cu_k) and window_size == (-1, 0)  # causal, queries are the keys
        gqa = kw.pop("enable_gqa", False)
        assert not kw and (with_gqa or not gqa) and (gqa or k.shape[1] == q.shape[1])
        bounds = cu_q.tolist()
        assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa
            )
            out[a:b] = o[0].transpose(0, 1)
        return out

    if with_gqa:
        return attend

    def attend_211(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    return attend_211


@pytest.mark.parametrize("with_gqa", [True, False], ids=["torch-gqa", "torch-2.11"])
@pytest.mark.parametrize("mode", MODES)
def test_varlen_plan_on_cpu_matches_table(mode, with_gqa, monkeypatch):
    """The varlen plan (cu_seqlens, max_seqlen) and the call around the kernel, checked on CPU: the same
    per-sequence causal attention, run from the plan, equals the dense reference of the mode."""
    from torch.nn.attention import varlen

    from lctrain.attention.engines import varlen as engine

    monkeypatch.setattr(varlen, "varlen_attn", per_sequence_causal(with_gqa))
    monkeypatch.setattr(engine, "flash_attn_available", lambda: False)
    engine.torch_varlen_takes_gqa.cache_clear()
    try:
        batch, masks, qkv, w = make_case(mode, torch.float32, heads=(6, 2), seed=7)
        seg = batch.segments
        plan = engine.build_varlen_plan(seg.layout, mode, "cpu")
        want, _ = reference(masks, qkv, w)
        got = engine.varlen_from_plan(*(t.float() for t in qkv), plan, 0.25)
        torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    finally:
        engine.torch_varlen_takes_gqa.cache_clear()


def test_varlen_refuses_value_heads_of_another_size():
    """Multi-head latent attention (DeepSeek-V3): the varlen kernels take one head size for q, k and v."""
    from lctrain.attention.engines import varlen as engine

    batch, _, (q, k, v), _ = make_case("anchor", torch.float32, heads=(6, 2), seed=7)
    plan = engine.build_varlen_plan(batch.segments.layout, "anchor", "cpu")
    with pytest.raises(UserError, match="set attention.engine=sdpa or flex"):
        engine.varlen_from_plan(q, k, v[..., :-2], plan, 0.25)


GPU_TOL = {torch.bfloat16: dict(atol=5e-2, rtol=5e-2), torch.float32: dict(atol=2e-3, rtol=2e-3)}  # fp32: TF32 dots
GPU_GRAD_SCALE = {torch.bfloat16: 4, torch.float32: 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("engine", ["flex", "varlen", "sdpa"])
def test_gpu_engines_match_table(engine, mode, dtype):
    if engine == "varlen" and dtype == torch.float32:
        batch, _, qkv, _ = make_case(mode, dtype, L=64)
        with pytest.raises(UserError, match="bfloat16 or float16"):
            ENGINES[engine].attention(
                None, *(t.to("cuda", dtype) for t in qkv), None, scaling=0.25, **batch.attention_kwargs()
            )
        return
    for seed, heads in ((0, (8, 2)), (1, (4, 4))):  # grouped-query and multi-head
        batch, masks, qkv, w = make_case(mode, dtype, L=256, seed=seed, heads=heads)
        want, want_grads = reference(masks, qkv, w)
        leaves = [t.to("cuda", dtype).requires_grad_(True) for t in qkv]
        out, _ = ENGINES[engine].attention(None, *leaves, None, scaling=0.25, **batch.attention_kwargs())
        grads = torch.autograd.grad((out.double() * w.cuda()).sum(), leaves)
        tol = GPU_TOL[dtype]
        torch.testing.assert_close(out.double().cpu(), want, **tol)
        for g, wg, name in zip(grads, want_grads, "qkv"):
            k = GPU_GRAD_SCALE[dtype]
            torch.testing.assert_close(
                g.double().cpu(),
                wg,
                atol=tol["atol"] * k,
                rtol=tol["rtol"] * k,
                msg=lambda m, name=name: f"grad {name}: {m}",
            )
