"""Greedy generation after a long prompt, planned to fit in memory: the one generation path of `lctrain eval`.

At the paper's lengths the KV cache, not the weights, decides what fits. For Llama-2-7B (32 layers, 32 KV heads of
128 dimensions, bf16) one prompt token holds 32 x 2 x 4096 x 2 bytes = 512 KiB of cache, so a 128K prompt holds
64 GiB of cache beside 13.5 GB of weights: more than an 80 GB GPU has once the prefill's activations are added.
Two measures bound the device memory:

- **chunked prefill**: the prompt goes through the model `prefill_chunk` tokens at a time, appending to the cache,
  so activations scale with the chunk, not the prompt, and only the last position's logits are computed;
- **offloaded cache** (when the whole cache does not fit on the device): transformers' `DynamicCache(offloading=True)`
  keeps the cache in host memory and brings one layer's keys and values to the device while the next is prefetched,
  so the device holds two layers' cache instead of all of them, at the price of host-device copies per layer.

Device memory for a prompt of T tokens plus N generated ones (`plan_generation`): weights, plus the cache of T + N
tokens (all layers on the device, or two layers with offloading), plus the activations of one prefill chunk of c
tokens (q, k, v and output projections, the MLP's gate, up and product, and the c x (T + N) attention mask). If even
the offloaded plan does not fit, `lctrain eval` stops before generating, saying the longest prompt that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lctrain.costmodel import ModelShape
from lctrain.errors import UserError

PREFILL_CHUNK = 8192
# what the plan leaves free for the allocator's fragmentation and the kernels' own workspaces
HEADROOM = 0.10


def kv_cache_bytes(config, tokens: int, dtype_bytes: int, layers: int | None = None) -> int:
    """Keys and values of `tokens` positions in `layers` layers (default all)."""
    m = ModelShape.from_hf_config(config)
    return (m.layers if layers is None else layers) * 2 * m.kv_heads * m.head_dim * tokens * dtype_bytes


def prefill_activation_bytes(config, chunk: int, context: int, dtype_bytes: int) -> int:
    """Peak activations of one decoder layer for a chunk of `chunk` new tokens attending to `context` positions."""
    m = ModelShape.from_hf_config(config)
    projections = chunk * (2 * m.heads + 2 * m.kv_heads) * m.head_dim * dtype_bytes  # q, k, v, attention output
    mlp = 3 * chunk * m.intermediate * dtype_bytes  # gate, up and their product live together
    hidden = 2 * chunk * m.hidden * dtype_bytes  # the residual stream and the normed input
    mask = chunk * context  # boolean mask of the chunk's queries over the cache
    return projections + mlp + hidden + mask + m.vocab * 4  # last position's fp32 logits


@dataclass(frozen=True)
class GenerationPlan:
    offload: bool
    prefill_chunk: int
    tokens: int
    device_bytes: int  # what the plan needs on the device beside the weights
    host_bytes: int  # what it needs in host memory (the offloaded cache)
    available_bytes: int

    def describe(self) -> str:
        where = "KV cache offloaded to host memory" if self.offload else "KV cache on the device"
        gb = 1e9
        return (f"{self.tokens} tokens: {where}, prefill in chunks of {self.prefill_chunk}; "
                f"{self.device_bytes / gb:.1f} GB on the device beside the weights "
                f"(of {self.available_bytes / gb:.1f} GB free)"
                + (f", {self.host_bytes / gb:.1f} GB in host memory" if self.offload else ""))


def _needs(config, tokens: int, chunk: int, dtype_bytes: int, offload: bool) -> tuple[int, int]:
    cache = kv_cache_bytes(config, tokens, dtype_bytes)
    act = prefill_activation_bytes(config, min(chunk, tokens), tokens, dtype_bytes)
    if offload:
        return kv_cache_bytes(config, tokens, dtype_bytes, layers=2) + act, cache
    return cache + act, 0


def _fitting(config, tokens: int, dtype_bytes: int, device_free: int, host_free: int | None,
             chunk: int) -> GenerationPlan | None:
    """The cheapest plan for `tokens` within the free memory (less HEADROOM), or None."""
    for offload in [False] if host_free is None else [False, True]:
        device, host = _needs(config, tokens, chunk, dtype_bytes, offload)
        if device <= device_free * (1 - HEADROOM) and (not offload or host <= host_free * (1 - HEADROOM)):
            return GenerationPlan(offload, chunk, tokens, device, host, device_free)
    return None


def plan_generation(config, tokens: int, dtype_bytes: int, device_free: int, host_free: int | None,
                    prefill_chunk: int = PREFILL_CHUNK) -> GenerationPlan:
    """The cheapest plan that fits `tokens` (prompt + generated) into `device_free` bytes beside the weights;
    `host_free` None means the device is the host (CPU), where offloading saves nothing."""
    plan = _fitting(config, tokens, dtype_bytes, device_free, host_free, prefill_chunk)
    if plan is not None:
        return plan
    lo, hi = 0, 1  # the longest that fits, by doubling then bisection
    while _fitting(config, hi, dtype_bytes, device_free, host_free, prefill_chunk) and hi < 1 << 26:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fitting(config, mid, dtype_bytes, device_free, host_free, prefill_chunk) else (lo, mid)
    offload = host_free is not None
    device, host = _needs(config, tokens, prefill_chunk, dtype_bytes, offload)
    if offload and device <= device_free * (1 - HEADROOM):
        short = (f"its KV cache, offloaded, needs {host / 1e9:.1f} GB of host memory and "
                 f"{host_free / 1e9:.1f} GB are available")
    else:
        short = (f"it needs {device / 1e9:.1f} GB beside the weights (KV cache{' offloaded' if offload else ''} and "
                 f"one prefill chunk) and {device_free / 1e9:.1f} GB are free")
    raise UserError(f"a {tokens}-token prompt does not fit for generation: {short}; the longest that fits here is "
                    f"{lo} tokens: evaluate shorter lengths (--lengths) or on a machine with more memory")


def free_memory(device) -> tuple[int, int | None]:
    """(bytes free on `device`, bytes free in host memory or None when the device is the host)."""
    import psutil
    import torch

    host = psutil.virtual_memory().available
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # what PyTorch's allocator holds but no tensor uses (an earlier checkpoint's cache) is free to this process
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), host
    return host, None


def plan_for(model, tokens: int) -> GenerationPlan:
    """The plan for `tokens` on the model's own device and dtype."""
    free, host = free_memory(model.device)
    return plan_generation(model.config, tokens, model.dtype.itemsize, free, host)


def greedy_ids(model, ids: list[int], max_new: int, plan: GenerationPlan, *, eos: int | None = None,
               stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """Greedy continuation of `ids` under `plan`: up to `max_new` tokens, ending after `eos` or once `stop(new ids)`
    is true (the stop strings of a task)."""
    import torch
    from transformers import DynamicCache

    if not ids or max_new < 1:
        raise ValueError("greedy generation needs a prompt token and room for at least one new token")
    if plan.offload and model.device.type != "cuda":
        raise ValueError("an offloaded KV cache streams layers to a CUDA device; on the host it saves nothing")
    cache = DynamicCache(config=model.config, offloading=plan.offload)
    x = torch.tensor([ids], device=model.device)
    new: list[int] = []
    with torch.inference_mode():
        for start in range(0, len(ids), plan.prefill_chunk):
            out = model(input_ids=x[:, start:start + plan.prefill_chunk], past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
        while True:
            nxt = int(out.logits[0, -1].argmax())
            new.append(nxt)
            if len(new) >= max_new or nxt == eos or (stop is not None and stop(new)):
                break
            out = model(input_ids=torch.tensor([[nxt]], device=model.device), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
    return new


class VllmGenerator:
    """Greedy generation by vLLM (`--backend vllm`, optional: `pip install vllm`), what long-context evaluation
    normally runs on: a paged KV cache in `gpu_memory_utilization` of the GPU and continuous batching of a task
    file's prompts. lctrain encodes the prompts (exact ids) and decodes the answers; vLLM sees token ids only.
    A `max_len` whose KV cache vLLM cannot place on the GPU is refused when the engine starts, in one line."""

    GPU_MEMORY_UTILIZATION = 0.9

    def __init__(self, model_dir, max_len: int, eos: int | None, seed: int = 0):
        try:
            import vllm
        except ImportError:
            raise UserError("--backend vllm needs vLLM: pip install vllm (or use the default --backend hf)") from None
        self.vllm, self.eos, self.max_len = vllm, eos, max_len
        try:
            self.llm = vllm.LLM(model=str(model_dir), dtype="bfloat16", max_model_len=max_len, seed=seed,
                                skip_tokenizer_init=True, gpu_memory_utilization=self.GPU_MEMORY_UTILIZATION)
        except ValueError as e:  # vLLM's refusal of a max_model_len whose cache does not fit
            raise UserError(f"{model_dir}: vLLM cannot serve {max_len}-token sequences on this GPU "
                            f"({str(e).splitlines()[0][:300]}); evaluate shorter lengths or use --backend hf, whose "
                            f"offloaded cache fits longer prompts") from None

    def describe(self) -> str:
        return (f"{self.max_len} tokens: vLLM, paged KV cache in {self.GPU_MEMORY_UTILIZATION:.0%} of the GPU's "
                f"memory, continuous batching")

    def greedy(self, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
        """The greedy continuation of each prompt, up to its `max_new` tokens, ending after EOS."""
        stops = [self.eos] if self.eos is not None else []
        params = [self.vllm.SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=stops, detokenize=False)
                  for n in max_new]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def close(self) -> None:
        import gc

        import torch

        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
