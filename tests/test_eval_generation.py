"""Long-prompt generation (lctrain.eval.generation): chunked prefill and the offloaded cache give the tokens of
transformers' own greedy `generate`; the memory plan against the paper's worked numbers for Llama-2-7B and a
hand count of the cache; a prompt that cannot fit fails in one line naming the longest that does; generation ends at
every end token of the model's generation_config."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from lctrain.errors import UserError
from lctrain.eval.generation import (
    GenerationPlan,
    greedy_ids,
    kv_cache_bytes,
    plan_generation,
    planned_cache,
    prefill_activation_bytes,
    stop_ids,
)

GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny():
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def hf_greedy(model, ids, max_new):
    gen = GenerationConfig(
        max_new_tokens=max_new, do_sample=False, num_beams=1, use_cache=True, eos_token_id=None, pad_token_id=0
    )
    x = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        return model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen)[
            0, len(ids) :
        ].tolist()


def check_equals_generate(model, chunk, resident):
    ids = torch.randint(3, 256, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    plan = GenerationPlan(
        resident_layers=resident,
        layers=3,
        prefill_chunk=chunk,
        tokens=62,
        device_bytes=0,
        host_bytes=0,
        available_bytes=0,
    )
    assert greedy_ids(model, ids, 12, plan) == hf_greedy(model, ids, 12)


# On the CPU the "offloaded" layers take the same path with synchronous copies: which buffer holds which prefix,
# and which layer is prefetched into which staging buffer, are checked here; the streams on a GPU.
@pytest.mark.parametrize("chunk,resident", [(1, 3), (7, 3), (64, 3), (1, 1), (7, 0), (64, 2)])
def test_chunked_prefill_equals_generate(tiny, chunk, resident):
    check_equals_generate(tiny, chunk, resident)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the offloaded cache streams layers to a CUDA device")
@pytest.mark.parametrize("chunk,resident", [(1, 0), (5, 1), (5, 2), (64, 3)])  # 64: one pass, no mask
def test_offloaded_cache_equals_generate_on_gpu(tiny, chunk, resident):
    check_equals_generate(tiny.to("cuda"), chunk, resident)
    tiny.to("cpu")


@pytest.mark.parametrize("resident", [3, 1])
def test_one_cache_serves_sample_after_sample(tiny, resident):
    """eval allocates the cache once per checkpoint: a longer sample, then a shorter one, then the first again, each
    as transformers generates it alone."""
    plan = GenerationPlan(resident, 3, 7, 62, 0, 0, 0)
    cache = planned_cache(tiny, plan)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (50, 9)]
    try:
        for ids in prompts + prompts[:1]:
            assert greedy_ids(tiny, ids, 12, plan, cache=cache) == hf_greedy(tiny, ids, 12)
        with pytest.raises(ValueError, match="another generation plan"):
            greedy_ids(tiny, prompts[1], 4, GenerationPlan(3, 3, 8, 62, 0, 0, 0), cache=cache)
    finally:
        cache.close()


def test_cache_refuses_more_tokens_than_planned(tiny):
    plan = GenerationPlan(3, 3, 8, 20, 0, 0, 0)
    with pytest.raises(ValueError, match="exceed the plan's 20"):
        greedy_ids(tiny, list(range(10, 25)), 6, plan)


def test_generation_stops_at_eos_and_stop_condition(tiny):
    ids = list(range(10, 40))
    plan = GenerationPlan(3, 3, 8, 50, 0, 0, 0)
    full = greedy_ids(tiny, ids, 10, plan)
    assert greedy_ids(tiny, ids, 10, plan, eos=full[3]) == full[: full.index(full[3]) + 1]
    assert greedy_ids(tiny, ids, 10, plan, stop=lambda new: len(new) == 4) == full[:4]
    with pytest.raises(ValueError):
        greedy_ids(tiny, [], 4, plan)


def test_generation_ends_at_every_end_token_of_the_generation_config(tiny, tmp_path):
    """Llama-3-Instruct's generation_config lists two end tokens, `<|end_of_text|>` and `<|eot_id|>` (128001,
    128009), its tokenizer's EOS only the first: a turn's `<|eot_id|>` ends its generation too, as in transformers'
    `generate`. Without generation_config.json, config.json's eos_token_id, as transformers derives it."""
    ids = list(range(10, 40))
    plan = GenerationPlan(3, 3, 8, 50, 0, 0, 0)
    full = greedy_ids(tiny, ids, 10, plan)
    k = next(k for k in range(2, 10) if full[k] not in full[:k])
    eos, unused = next((i, j) for i in range(3, 256) for j in range(i + 1, 256) if {i, j}.isdisjoint(full))
    tiny.config.save_pretrained(tmp_path)  # eos_token_id 2
    assert stop_ids(tmp_path, None) == [2] and stop_ids(tmp_path, eos) == [eos, 2]
    GenerationConfig(eos_token_id=[unused, full[k]]).save_pretrained(tmp_path)
    assert stop_ids(tmp_path, eos) == [eos, unused, full[k]] and stop_ids(tmp_path, unused) == [unused, full[k]]
    assert greedy_ids(tiny, ids, 10, plan, eos=[eos]) == full
    assert greedy_ids(tiny, ids, 10, plan, eos=stop_ids(tmp_path, eos)) == full[: k + 1]
    GenerationConfig(eos_token_id=full[k]).save_pretrained(tmp_path)
    assert stop_ids(tmp_path, eos) == [eos, full[k]]


LLAMA2_7B = AutoConfig.for_model(
    "llama",
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
)


def test_kv_cache_of_llama2_7b_at_128k():
    # 32 layers x (k, v) x 32 heads x 128 dims x 2 bytes per token: 512 KiB, 64 GiB for 128K tokens
    per_token = 0
    for _layer in range(32):
        for _kv in range(2):
            per_token += 32 * 128 * 2
    assert kv_cache_bytes(LLAMA2_7B, 1, 2) == per_token == 512 * 1024
    assert kv_cache_bytes(LLAMA2_7B, 131072, 2) == 64 * GIB
    assert kv_cache_bytes(LLAMA2_7B, 131072, 2, layers=2) == 4 * GIB


def test_plan_llama2_7b_on_an_80gb_gpu():
    weights = 13.5e9
    free = int(80e9 - weights)
    # 64K: the 32 GiB cache fits beside the weights, and so do the whole prompt's activations: one pass, no mask.
    # By hand: 65664 x 512 KiB of cache, and 65664 x (4 x 4096 x 2 + 3 x 11008 x 2 + 2 x 4096 x 2) + 32000 x 4 B
    plan = plan_generation(LLAMA2_7B, 65536 + 128, 2, free, host_free=200 * GIB)
    assert plan.offload is False and plan.one_pass and plan.prefill_chunk == 65664
    one_pass = 65664 * (4 * 4096 * 2 + 3 * 11008 * 2 + 2 * 4096 * 2) + 32000 * 4
    assert plan.device_bytes == 65664 * 512 * 1024 + one_pass
    assert "prefill in one pass" in plan.describe()
    # 42 GB free: 90% of it holds the cache (34.4 GB) and an 8K chunk (1.5 GB with its mask), not the one pass (7.6 GB)
    chunked = plan_generation(LLAMA2_7B, 65536 + 128, 2, int(42e9), host_free=200 * GIB)
    assert (chunked.offload, chunked.prefill_chunk) == (False, 8192)
    assert chunked.device_bytes == 65664 * 512 * 1024 + 8192 * (115200 + 65664) + 32000 * 4
    assert "prefill in chunks of 8192" in chunked.describe()
    # 128K: 64 GiB of cache does not fit in the 66.5 GB left. By hand: a layer's cache is 131200 x 2 x 4096 x 2 B
    # = 2.15 GB, one 8K prefill chunk's activations 8192 x (4 x 4096 x 2 + 3 x 11008 x 2 + 2 x 4096 x 2 + 131200)
    # + 32000 x 4 B = 2.01 GB, and 90% of 66.5 GB is 59.85 GB: (r + 2 staging) x 2.15 + 2.01 <= 59.85 gives r = 24
    # resident layers, so 8 are offloaded (17.2 GB of host memory)
    layer = 131200 * 2 * 4096 * 2
    chunk = 8192 * (4 * 4096 * 2 + 3 * 11008 * 2 + 2 * 4096 * 2 + 131200) + 32000 * 4
    resident = max(r for r in range(33) if (r + 2) * layer + chunk <= free * 0.9)
    plan = plan_generation(LLAMA2_7B, 131072 + 128, 2, free, host_free=200 * GIB)
    assert (plan.resident_layers, plan.layers) == (resident, 32) == (24, 32)
    assert plan.host_bytes == 8 * layer and plan.device_bytes == 26 * layer + chunk
    assert plan.prefill_chunk == 8192  # an offloaded cache is prefilled in chunks
    assert "8 of 32 layers offloaded" in plan.describe()
    # without the host memory for those 8 layers it cannot run at all
    with pytest.raises(UserError, match=r"longest that fits here is \d+ tokens") as e:
        plan_generation(LLAMA2_7B, 131072 + 128, 2, free, host_free=8 * GIB)
    assert "8 of 32 layers offloaded, needs 17.2 GB of host memory and 8.6 GB are available" in str(e.value)
    longest = int(str(e.value).split("longest that fits here is ")[1].split()[0])
    assert 100_000 < longest < 131072
    assert plan_generation(LLAMA2_7B, longest, 2, free, host_free=8 * GIB)
    with pytest.raises(UserError):
        plan_generation(LLAMA2_7B, longest + 1, 2, free, host_free=8 * GIB)


@pytest.mark.parametrize("window", [{"sliding_window": 4096}, {"sliding_window": 4096, "use_sliding_window": False}])
def test_a_sliding_windows_mask_is_counted_in_one_pass_too(window):
    """transformers gives SDPA a full prompt x prompt mask for a model with a window (Mistral-7B-v0.1's 4096), one
    pass or not; a window the model does not use (Qwen2's) needs none."""
    config = copy.deepcopy(LLAMA2_7B)
    for key, value in window.items():
        setattr(config, key, value)
    plain = plan_generation(LLAMA2_7B, 65664, 2, int(66.5e9), host_free=200 * GIB)
    plan = plan_generation(config, 65664, 2, int(66.5e9), host_free=200 * GIB)
    assert plain.one_pass and plan.one_pass
    masked = window.get("use_sliding_window", True)
    assert plan.device_bytes - plain.device_bytes == (65664 * 65664 if masked else 0)


def test_eager_attention_scores_are_planned_as_measured():
    """Gemma-2 is evaluated with eager attention, which holds every head's chunk x context scores: a one-pass prefill
    of T tokens is planned with them, at least what one attention forward is measured to hold, and not far above."""
    from memory_helpers import PeakBytes
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding

    config = AutoConfig.for_model(
        "gemma2",
        hidden_size=256,
        intermediate_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=50.0,
        num_hidden_layers=2,
        max_position_embeddings=4096,
        sliding_window=4096,
        vocab_size=256,
        attn_implementation="eager",
    )
    tokens = 1024
    attention = Gemma2Attention(config, layer_idx=1).eval()
    x = torch.randn(1, tokens, config.hidden_size)
    cos_sin = Gemma2RotaryEmbedding(config)(x, torch.arange(tokens)[None])
    mask = torch.full((1, 1, tokens, tokens), float("-inf")).triu(1)
    with torch.no_grad(), PeakBytes() as measured:
        attention(x, cos_sin, mask)
    scores = 8 * tokens * tokens * 8  # float32 scores and their float32 softmax
    assert scores < measured.peak
    planned = prefill_activation_bytes(config, tokens, tokens, 4, "eager")
    assert measured.peak <= planned <= 1.25 * measured.peak
    assert planned - prefill_activation_bytes(config, tokens, tokens, 4) == scores
    # bf16 on a GPU: the bf16 scores, their float32 softmax and its cast back
    assert (
        prefill_activation_bytes(config, tokens, tokens, 2, "eager")
        - prefill_activation_bytes(config, tokens, tokens, 2)
        == 8 * tokens * tokens * 8
    )
    sdpa = plan_generation(config, tokens, 4, 10**9, None)
    eager = plan_generation(config, tokens, 4, 10**9, None, attention="eager")
    assert eager.device_bytes - sdpa.device_bytes == scores


def test_cpu_plan_never_offloads():
    with pytest.raises(UserError, match="longest that fits"):
        plan_generation(LLAMA2_7B, 131072, 4, 64 * GIB, host_free=None)
    assert plan_generation(LLAMA2_7B, 8192, 4, 64 * GIB, host_free=None).offload is False
