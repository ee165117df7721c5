"""Greedy generation after a long prompt, planned to fit in memory: the one generation path of `lctrain eval`.

At the paper's lengths the KV cache, not the weights, decides what fits. For Llama-2-7B (32 layers, 32 KV heads of
128 dimensions, bf16) one prompt token holds 32 x 2 x 4096 x 2 bytes = 512 KiB of cache, so a 128K prompt holds
64 GiB of cache beside 13.5 GB of weights: more than an 80 GB GPU has once the prefill's activations are added.
Two measures bound the device memory:

- **chunked prefill**: the prompt goes through the model `prefill_chunk` tokens at a time, appending to the cache,
  so activations scale with the chunk, not the prompt, and only the last position's logits are computed. When the
  whole prompt's activations fit beside a cache kept entirely on the device, it goes through in one pass instead:
  its attention is then causal without a mask, which SDPA runs on its fastest kernel (FlashAttention on a GPU),
  where every chunk after the first attends to the cache through a boolean mask, which only the slower kernels take;
- **partly offloaded cache** (when the whole cache does not fit on the device): as many layers as fit keep their
  keys and values on the device; the others live in pinned host memory and are streamed to the device one layer at a
  time through two staging buffers, the next layer's copy overlapping the current layer's compute.

Every layer's cache is one buffer of the plan's full length, allocated once (`PlannedCache`). transformers'
`DynamicCache` instead concatenates per token (copying the whole cache each step) and, offloaded, lets PyTorch's
pinned-memory cache round every growing copy up to a power of two and keep the old ones: at 128K that asked for more
than the 128 GiB of host memory of an H100 machine, which killed the process (measured on an H100, 2026-11-23).

Device memory for a prompt of T tokens plus N generated ones (`plan_generation`): weights, plus the cache of T + N
tokens for the resident layers, plus two staging layers when any layer is offloaded, plus the activations of one
prefill chunk of c tokens (q, k, v and output projections, the MLP's gate, up and product, and the c x (T + N)
attention mask, none for a single pass of a model without a sliding window; with eager attention, which Gemma-2 is
evaluated with, also the heads x c x (T + N) attention scores: quadratic in the prompt where a chunk is the whole
prompt). Host memory: the cache of the
offloaded layers. If even the most offloaded plan does not fit, `lctrain eval` stops before generating, saying the
longest prompt that fits.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from transformers.cache_utils import Cache, DynamicLayer

from lctrain.compat.transformers import attn_implementation_of, load_errors
from lctrain.costmodel import ModelShape
from lctrain.errors import UserError
from lctrain.search import longest_fitting
from lctrain.units import to_gb

PREFILL_CHUNK = 8192
# what the plan leaves free for the allocator's fragmentation and the kernels' own workspaces
HEADROOM = 0.10
# A prompt that does not fit names the longest that does, searched below this many tokens (beyond any model here).
MAX_TOKENS = 1 << 26


def kv_cache_bytes(config, tokens: int, dtype_bytes: int, layers: int | None = None) -> int:
    """Keys and values of `tokens` positions in `layers` layers (default all)."""
    m = ModelShape.from_hf_config(config)
    return (m.layers if layers is None else layers) * 2 * m.kv_width * tokens * dtype_bytes


def sliding_window(config) -> int | None:
    """The model's attention window, or None when it attends to every earlier position (Qwen2 ships a window it
    does not use: `use_sliding_window: false`)."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


def prefill_activation_bytes(config, chunk: int, context: int, dtype_bytes: int, attention: str = "sdpa") -> int:
    """Peak activations of one decoder layer for a chunk of `chunk` new tokens attending to `context` positions,
    with transformers' `attention` implementation."""
    m = ModelShape.from_hf_config(config)
    # transformers passes SDPA a boolean mask of the chunk over the cache, except to a single pass over the whole
    # prompt of a model without a window (causal attention needs none)
    masked = chunk < context or sliding_window(config) is not None
    projections = chunk * 2 * (m.width + m.kv_width) * dtype_bytes  # q, k, v, attention output
    mlp = 3 * chunk * m.intermediate * dtype_bytes  # gate, up and their product live together
    hidden = 2 * chunk * m.hidden * dtype_bytes  # the residual stream and the normed input
    mask = chunk * context if masked else 0
    scores = m.heads * chunk * context * eager_score_bytes(dtype_bytes) if attention == "eager" else 0
    return projections + mlp + hidden + mask + scores + m.vocab * torch.float32.itemsize  # last position's logits


def eager_score_bytes(dtype_bytes: int) -> int:
    """Bytes per attention score that transformers' eager attention holds at once: the scores in the model's dtype
    and their softmax in float32, plus its cast back to a 16-bit dtype (while the float32 one is alive)."""
    return dtype_bytes + torch.float32.itemsize + (dtype_bytes if dtype_bytes < torch.float32.itemsize else 0)


@dataclass(frozen=True)
class GenerationPlan:
    resident_layers: int  # layers whose cache stays on the device; the others are streamed from host memory
    layers: int
    prefill_chunk: int
    tokens: int
    device_bytes: int  # what the plan needs on the device beside the weights
    host_bytes: int  # what it needs in host memory (the offloaded layers' cache)
    available_bytes: int

    @property
    def offload(self) -> bool:
        return self.resident_layers < self.layers

    @property
    def one_pass(self) -> bool:
        return self.prefill_chunk >= self.tokens

    def describe(self) -> str:
        where = (
            f"KV cache of {self.layers - self.resident_layers} of {self.layers} layers offloaded to host memory "
            f"({to_gb(self.host_bytes):.1f} GB)"
            if self.offload
            else "KV cache on the device"
        )
        return (
            f"{self.tokens} tokens: {where}, "
            f"{'prefill in one pass' if self.one_pass else f'prefill in chunks of {self.prefill_chunk}'}; "
            f"{to_gb(self.device_bytes):.1f} GB on the device beside the weights "
            f"(of {to_gb(self.available_bytes):.1f} GB free)"
        )


STAGING_LAYERS = 2  # an offloaded layer computes in one staging buffer while the next is copied into the other


def _needs(config, tokens: int, chunk: int, dtype_bytes: int, resident: int, attention: str) -> tuple[int, int]:
    """(device bytes beside the weights, host bytes) with `resident` layers' cache on the device."""
    layers = ModelShape.from_hf_config(config).layers
    offloaded = layers - resident
    on_device = resident + (STAGING_LAYERS if offloaded else 0)
    act = prefill_activation_bytes(config, min(chunk, tokens), tokens, dtype_bytes, attention)
    return (
        kv_cache_bytes(config, tokens, dtype_bytes, layers=on_device) + act,
        kv_cache_bytes(config, tokens, dtype_bytes, layers=offloaded),
    )


def _most_resident(
    config, tokens: int, dtype_bytes: int, device_free: int, chunk: int, can_offload: bool, attention: str
) -> tuple[int, int, int] | None:
    """(resident layers, device bytes, host bytes) keeping the most layers on the device within its free memory
    (less HEADROOM), or None when not even the fully offloaded cache fits."""
    layers = ModelShape.from_hf_config(config).layers
    for resident in range(layers, -1 if can_offload else layers - 1, -1):
        device, host = _needs(config, tokens, chunk, dtype_bytes, resident, attention)
        if device <= device_free * (1 - HEADROOM):
            return resident, device, host
    return None


def _fitting(
    config, tokens: int, dtype_bytes: int, device_free: int, host_free: int | None, chunk: int, attention: str
) -> GenerationPlan | None:
    """The plan for `tokens` with the fewest layers offloaded, or None. Offloading more layers only needs more host
    memory, so the most resident plan that fits the device decides."""
    best = _most_resident(config, tokens, dtype_bytes, device_free, chunk, host_free is not None, attention)
    if best is None:
        return None
    resident, device, host = best
    if host and host > host_free * (1 - HEADROOM):
        return None
    return GenerationPlan(resident, ModelShape.from_hf_config(config).layers, chunk, tokens, device, host, device_free)


def plan_generation(
    config,
    tokens: int,
    dtype_bytes: int,
    device_free: int,
    host_free: int | None,
    prefill_chunk: int = PREFILL_CHUNK,
    attention: str = "sdpa",
) -> GenerationPlan:
    """The plan that fits `tokens` (prompt + generated) into `device_free` bytes beside the weights with the fewest
    layers offloaded, prefilling in one pass when that fits with no layer offloaded, else in chunks of
    `prefill_chunk` (the module docstring says why); `host_free` None means the device is the host (CPU), where
    offloading saves nothing; `attention` is transformers' attention implementation of the model."""
    whole = _fitting(config, tokens, dtype_bytes, device_free, host_free, tokens, attention)
    if whole is not None and not whole.offload:
        return whole
    plan = _fitting(config, tokens, dtype_bytes, device_free, host_free, prefill_chunk, attention)
    if plan is not None:
        return plan
    longest = (
        longest_fitting(
            lambda n: _fitting(config, n, dtype_bytes, device_free, host_free, prefill_chunk, attention) is not None,
            0,
            MAX_TOKENS - 1,
        )
        or 0
    )
    layers = ModelShape.from_hf_config(config).layers
    offload = host_free is not None
    best = _most_resident(config, tokens, dtype_bytes, device_free, prefill_chunk, offload, attention)
    if best is not None:  # the device has room: host memory for the offloaded layers ran out
        resident, _, host = best
        short = (
            f"its KV cache, {layers - resident} of {layers} layers offloaded, needs {to_gb(host):.1f} GB of host "
            f"memory and {to_gb(host_free):.1f} GB are available"
        )
    else:
        device, _ = _needs(config, tokens, prefill_chunk, dtype_bytes, 0 if offload else layers, attention)
        short = (
            f"it needs {to_gb(device):.1f} GB beside the weights (KV cache{' offloaded' if offload else ''} and "
            f"one prefill chunk) and {to_gb(device_free):.1f} GB are free"
        )
    raise UserError(
        f"a {tokens}-token prompt does not fit for generation: {short}; the longest that fits here is "
        f"{longest} tokens: evaluate shorter lengths (--lengths) or on a machine with more memory"
    )


def free_memory(device) -> tuple[int, int | None]:
    """(bytes free on `device`, bytes free in host memory or None when the device is the host)."""
    host = psutil.virtual_memory().available
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # what PyTorch's allocator holds but no tensor uses (an earlier checkpoint's cache) is free to this process
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), host
    return host, None


def plan_for(model, tokens: int) -> GenerationPlan:
    """The plan for `tokens` on the model's own device, dtype and attention."""
    free, host = free_memory(model.device)
    attention = attn_implementation_of(model.config)
    return plan_generation(model.config, tokens, model.dtype.itemsize, free, host, attention=attention)


PAGE = 4096


def _host_buffer(shape: tuple[int, ...], dtype, pin: bool):
    """An uninitialised host tensor of exactly its size, page-locked with cudaHostRegister when `pin` (so copies to
    the device run asynchronously at full speed). Not `pin_memory=True`: PyTorch's pinned-memory cache rounds each
    allocation up to a power of two, which would double a 1.0x GiB layer. Returns (tensor, registered address)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not pin:
        return torch.empty(shape, dtype=dtype), None
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    region = raw[start : start + nbytes]
    if int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), nbytes, 0)) != 0:
        raise UserError(
            f"cannot page-lock {to_gb(nbytes):.1f} GB of host memory for the offloaded KV cache "
            f"(cudaHostRegister failed; see `ulimit -l`); evaluate shorter lengths (--lengths)"
        )
    return region.view(dtype).view(shape), region.data_ptr()


class _BufferLayer:
    """One layer's keys and values, filled up to `length`: [1, kv heads, capacity, head dim] buffers on the device,
    or token-major [capacity, kv heads, head dim] ones in host memory for a streamed layer."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.length = 0


def planned_cache(model, plan: GenerationPlan):
    """A transformers `Cache` holding the KV cache of a generation under `plan` (see the module docstring), reusable
    for every sample the plan covers (`greedy_ids` resets it): the buffers are allocated and page-locked once. Call
    `close()` when done: it releases the page-locked host memory."""
    m = ModelShape.from_hf_config(model.config)
    device, dtype = model.device, model.dtype
    stream = device.type == "cuda"

    class Layer(DynamicLayer):
        """What transformers asks of a cache layer, answered from the planned buffers."""

        def __init__(self, buffers: _BufferLayer):
            super().__init__()
            self.buffers = buffers
            self.is_initialized = True
            self.dtype, self.device = dtype, device

        def get_seq_length(self) -> int:
            return self.buffers.length

        def offload(self):
            pass

        def prefetch(self):
            pass

    class PlannedCache(Cache):
        def __init__(self):
            shape = (1, m.kv_heads, plan.tokens, m.head_dim)
            # Streamed layers are kept token-major, [tokens, kv heads, head dim], so that a cached prefix is one
            # contiguous block: a head-major prefix is strided, and PyTorch gathers it on the CPU before the copy.
            streamed = (plan.tokens, m.kv_heads, m.head_dim)
            self.registered: list[int] = []
            self.store = []
            for i in range(m.layers):
                if i < plan.resident_layers:
                    self.store.append(
                        _BufferLayer(
                            torch.empty(shape, dtype=dtype, device=device),
                            torch.empty(shape, dtype=dtype, device=device),
                        )
                    )
                    continue
                (k, pk), (v, pv) = (_host_buffer(streamed, dtype, stream) for _ in range(2))
                self.registered += [p for p in (pk, pv) if p is not None]
                self.store.append(_BufferLayer(k, v))
            self.staging = [
                (torch.empty(streamed, dtype=dtype, device=device), torch.empty(streamed, dtype=dtype, device=device))
                for _ in range(min(STAGING_LAYERS, plan.layers - plan.resident_layers))
            ]
            self.copy_stream = torch.cuda.Stream(device) if stream and plan.offload else None
            self.prefetched: set[int] = set()
            self.plan = plan
            super().__init__(layers=[Layer(b) for b in self.store])

        def reset(self) -> None:
            """Empty for the next sample; a copy still in flight from the last one finishes first."""
            if self.copy_stream is not None:
                torch.cuda.current_stream(device).wait_stream(self.copy_stream)
            for b in self.store:
                b.length = 0
            self.prefetched.clear()

        def _slot(self, layer: int):
            return self.staging[(layer - plan.resident_layers) % STAGING_LAYERS]

        def _fetch(self, layer: int) -> None:
            """Copy the cached prefix of an offloaded layer into its staging buffers."""
            b, (k, v) = self.store[layer], self._slot(layer)
            k[: b.length].copy_(b.keys[: b.length], non_blocking=True)
            v[: b.length].copy_(b.values[: b.length], non_blocking=True)

        def _prefetch_after(self, layer: int) -> None:
            """Start copying the next offloaded layer (the first one of the next forward, after the last) while
            this one computes, unless it would land in the staging buffer this layer is about to read."""
            first = plan.resident_layers
            nxt = first + (layer - first + 1) % (plan.layers - first)
            if self._slot(nxt) is self._slot(layer):
                return
            if self.copy_stream is None:
                self._fetch(nxt)
            else:
                # after everything queued so far: the reads of the previous layer in that buffer, our host writes
                self.copy_stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(self.copy_stream):
                    self._fetch(nxt)
            self.prefetched.add(nxt)

        def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
            b = self.store[layer_idx]
            n, new = b.length, key_states.shape[-2]
            if n + new > plan.tokens:
                raise ValueError(f"the cache was planned for {plan.tokens} tokens; {n + new} asked")
            if layer_idx < plan.resident_layers:
                b.keys[..., n : n + new, :].copy_(key_states)
                b.values[..., n : n + new, :].copy_(value_states)
                b.length = n + new
                return b.keys[..., : n + new, :], b.values[..., : n + new, :]
            keys, values = self._slot(layer_idx)
            if layer_idx in self.prefetched:
                if self.copy_stream is not None:
                    torch.cuda.current_stream(device).wait_stream(self.copy_stream)
                self.prefetched.discard(layer_idx)
            else:
                self._fetch(layer_idx)
            b.length = n + new
            new_keys, new_values = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
            b.keys[n : n + new].copy_(new_keys, non_blocking=True)
            b.values[n : n + new].copy_(new_values, non_blocking=True)
            keys[n : n + new].copy_(new_keys)
            values[n : n + new].copy_(new_values)
            self._prefetch_after(layer_idx)
            return keys[: n + new].permute(1, 0, 2)[None], values[: n + new].permute(1, 0, 2)[None]

        def close(self) -> None:
            if self.registered:
                torch.cuda.synchronize(device)
                for ptr in self.registered:
                    torch.cuda.cudart().cudaHostUnregister(ptr)
            self.registered, self.store, self.staging, self.layers = [], [], [], []

    return PlannedCache()


GENERATION_CONFIG = "generation_config.json"


def stop_ids(model_dir, *known: int | None) -> list[int]:
    """The ids that end a generation: `known` (the tokenizer's EOS; lctrain's evaluation adds the anchor) and every
    `eos_token_id` of the model's generation config, one id or a list, as transformers' `generate` (RULER's
    prediction) stops: Llama-3-Instruct ends its turn with `<|eot_id|>`, which its tokenizer's EOS `<|end_of_text|>`
    is not. A model directory without generation_config.json is given one from its config.json when transformers
    loads it, and so here."""
    # transformers on use, as torch (start-up time)
    from transformers import AutoConfig, GenerationConfig

    path = Path(model_dir)
    try:
        if (path / GENERATION_CONFIG).is_file():
            config = GenerationConfig.from_pretrained(str(path))
        else:
            config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(path)))
    except load_errors() as e:
        raise UserError(
            f"{path}: cannot read its end-of-generation tokens ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            f"restore its {GENERATION_CONFIG} and config.json"
        ) from None
    listed = config.eos_token_id
    ids = [*known, *(listed if isinstance(listed, list) else [listed])]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def greedy_ids(
    model,
    ids: list[int],
    max_new: int,
    plan: GenerationPlan,
    *,
    cache=None,
    eos: int | Collection[int] | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy continuation of `ids` under `plan`: up to `max_new` tokens, ending after `eos` (an id, or several:
    `stop_ids`) or once `stop(new ids)` is true (the stop strings of a task). `cache`: a `planned_cache` of this plan
    to reuse (the caller closes it); without one, a cache is made for this call and closed after it."""
    if not ids or max_new < 1:
        raise ValueError("greedy generation needs a prompt token and room for at least one new token")
    if len(ids) + max_new > plan.tokens:
        raise ValueError(f"a {len(ids)}-token prompt and {max_new} new tokens exceed the plan's {plan.tokens}")
    if cache is not None and cache.plan != plan:
        raise ValueError("the cache was planned for another generation plan")
    ends = {eos} if isinstance(eos, int) else set(eos or ())
    own = cache is None
    cache = planned_cache(model, plan) if own else cache
    cache.reset()
    x = torch.tensor([ids], device=model.device)
    new: list[int] = []
    try:
        with torch.inference_mode():
            for start in range(0, len(ids), plan.prefill_chunk):
                out = model(
                    input_ids=x[:, start : start + plan.prefill_chunk],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            while True:
                nxt = int(out.logits[0, -1].argmax())
                new.append(nxt)
                if len(new) >= max_new or nxt in ends or (stop is not None and stop(new)):
                    break
                out = model(
                    input_ids=torch.tensor([[nxt]], device=model.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
    finally:
        if own:
            cache.close()
    return new


NO_VLLM = "--backend vllm needs vLLM: pip install vllm (or use the default --backend hf)"


class VllmGenerator:
    """Greedy generation by vLLM (`--backend vllm`, optional: `pip install vllm`), what long-context evaluation
    normally runs on: a paged KV cache in `gpu_memory_utilization` of the GPU and continuous batching of a task
    file's prompts. lctrain encodes the prompts (exact ids) and decodes the answers; vLLM sees token ids only.
    A `max_len` whose KV cache vLLM cannot place on the GPU is refused when the engine starts, in one line."""

    GPU_MEMORY_UTILIZATION = 0.9

    def __init__(self, model_dir, max_len: int, eos: Collection[int], seed: int = 0):
        try:
            # optional dependency: vllm
            import vllm
        except ImportError:
            raise UserError(NO_VLLM) from None
        self.vllm, self.eos, self.max_len = vllm, eos, max_len
        try:
            self.llm = vllm.LLM(
                model=str(model_dir),
                dtype="bfloat16",
                max_model_len=max_len,
                seed=seed,
                skip_tokenizer_init=True,
                gpu_memory_utilization=self.GPU_MEMORY_UTILIZATION,
            )
        except ValueError as e:  # vLLM's refusal of a max_model_len whose cache does not fit
            raise UserError(
                f"{model_dir}: vLLM cannot serve {max_len}-token sequences on this GPU "
                f"({str(e).splitlines()[0][:300]}); evaluate shorter lengths or use --backend hf, whose "
                f"offloaded cache fits longer prompts"
            ) from None

    def describe(self) -> str:
        return (
            f"{self.max_len} tokens: vLLM, paged KV cache in {self.GPU_MEMORY_UTILIZATION:.0%} of the GPU's "
            f"memory, continuous batching"
        )

    def greedy(self, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
        """The greedy continuation of each prompt, up to its `max_new` tokens, ending after any of the `eos` ids."""
        params = [
            self.vllm.SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=list(self.eos), detokenize=False)
            for n in max_new
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def close(self) -> None:
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
