"""`lctrain check sp`: sequence parallelism changes no logit (the paper's Table 8).

The paper (§5, "Accuracy"): "We evaluated the numerical accuracy of our method by measuring the differences in logits
(the outputs of the forward pass) when processing the same training data sequence with a context length of 32K on 8
A100 GPUs." Zigzag ring attention differed from one GPU by up to 0.75; "our AnchorContext implementation showed zero
difference in logits when compared to using FlashAttention2 without any distributed training" (Table 8).

This check runs one window through the model twice with the same weights and dtype: on one process (rank 0, the
engine alone) and under DeepSpeed-Ulysses on P processes (`lctrain.parallel.ulysses`, the wiring training uses), then
gathers the P sequence slices of the logits on rank 0 and reports max |Δ logits| and mean |Δ| per attention mode.

Why Ulysses is exact in principle: each rank projects q, k, v for its own L/P tokens (RoPE with their true positions);
the all-to-all moves whole heads, so after it one rank holds every token of H/P heads and computes each of those
heads' attention over the full window, exactly as the single process does; a second all-to-all moves the outputs
back. No partial softmax is ever combined across ranks, which ring attention does (rescaling and adding per-block
results in another order than a single kernel: the likely source of its 0.75).
What can still differ is rounding: the projections and MLPs multiply L/P rows instead of L, and the attention kernel
sees H/P heads instead of H, and a kernel may block or order its reductions differently for other shapes.

Measured on CPU (2 gloo processes, the sdpa engine): max |Δ logits| = 0 exactly, in all four modes, in fp32 and in
bf16 (`lctrain check sp` on tiny_anchor, 1024 tokens, 8 documents; and the test's 2-layer model with 4 query heads and
1 KV head at 128 tokens). Bit-identical, not merely close, because on this CPU (PyTorch 2.13, x86) a row of `X @ W` is
the same whether X has L or L/P rows, and scaled_dot_product_attention of a head is the same whether the call holds H
or H/P heads (both checked directly, fp32 and bf16). That is a property of the kernels, not of the layout: a GPU
matmul may pick a split-K kernel by shape and then round differently, so the test bounds the difference by fp32
rounding of the logits' magnitude rather than requiring 0, and a layout without the all-to-all exceeds that bound
by four orders of magnitude.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn

from lctrain.attention import MODES, Batch, make_batch, resolve_engine
from lctrain.config import Config, data_dir, load_config, with_overrides, write_resolved
from lctrain.costmodel import ModelShape
from lctrain.errors import UserError, output_dir
from lctrain.hardware import usable_cpus
from lctrain.model import build_model, load_hf_config, model_shape
from lctrain.parallel.groups import init_topology, pick_backend, release_single_process
from lctrain.parallel.launch import OutOfMemory, run_on_ranks
from lctrain.parallel.layout import kv_replication, layout_of
from lctrain.parallel.ulysses import wrap_model
from lctrain.progress_bar import ProgressBar
from lctrain.tokenizer import anchor_token_id, load_tokenizer
from lctrain.train.data import open_checked

# Documents in a synthetic window: enough that the document masks and anchor positions differ from full attention.
SYNTHETIC_DOCS = 8
# Tokens per chunk when comparing logits: keeps the fp32 difference of an [L, V] pair at 8K x V at a time.
DIFF_CHUNK_TOKENS = 8192
RESULT_FILE = "check_sp.json"
WINDOW_FILE = "window.npz"


def synthetic_window(
    seq_len: int, vocab: int, anchor_id: int, sp: int, seed: int, docs: int = SYNTHETIC_DOCS
) -> dict[str, np.ndarray]:
    """A seeded window of `docs` documents (fewer when too short), each starting with the anchor, random token ids
    after it. No document boundary falls on a slice boundary of `sp` ranks, so documents span the slices and a
    layout error at a boundary shows."""
    rng = np.random.default_rng(seed)
    slice_len = seq_len // sp
    candidates = np.array([t for t in range(1, seq_len) if t % slice_len])
    n_cuts = min(max(docs, 1) - 1, len(candidates))
    cuts = np.sort(rng.choice(candidates, size=n_cuts, replace=False)) if n_cuts else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([[0], cuts]).astype(np.int64)
    seg_lens = np.diff(np.concatenate([starts, [seq_len]])).astype(np.int64)
    ids = rng.integers(0, vocab, size=seq_len, dtype=np.int64)
    ids[ids == anchor_id] = (anchor_id + 1) % vocab  # the anchor appears only where a document starts
    ids[starts] = anchor_id
    return {
        "input_ids": ids,
        "seg_lens": seg_lens,
        "seg_doc": np.arange(len(seg_lens), dtype=np.int64),
        "tag_lens": np.zeros(len(seg_lens), dtype=np.int64),
    }


def logit_diff(ref: torch.Tensor, got: torch.Tensor, chunk_tokens: int = DIFF_CHUNK_TOKENS) -> dict:
    """max and mean |ref - got| over every logit of `[B, L, V]` tensors, in fp32 (exact for bf16/fp16 inputs),
    the largest |ref| (the scale any rounding bound is relative to) and the token where the largest difference is."""
    if ref.shape != got.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref.shape)} vs {tuple(got.shape)}")
    ref2, got2 = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    max_abs, total, ref_max, worst_token = 0.0, 0.0, 0.0, 0
    for start in range(0, ref2.shape[0], chunk_tokens):
        r = ref2[start : start + chunk_tokens].float()
        d = (r - got2[start : start + chunk_tokens].float()).abs()
        per_token = d.amax(dim=-1)
        chunk_max = float(per_token.max())
        if chunk_max > max_abs:
            max_abs, worst_token = chunk_max, start + int(per_token.argmax())
        total += float(d.double().sum())
        ref_max = max(ref_max, float(r.abs().max()))
    return {"max_abs": max_abs, "mean_abs": total / ref2.numel(), "ref_max_abs": ref_max, "worst_token": worst_token}


def allowed_processes() -> int:
    """Processes this machine can give one device each: its GPUs, else the CPU cores this process may use."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return usable_cpus()


def check_config(cfg: Config, nproc: int | None, dtype: str | None) -> Config:
    """`cfg` laid out for a P-process Ulysses run of one window, refusing what cannot run before any process
    starts. `nproc` None: the config's own parallel.sequence_parallel where it has one, else 2."""
    given = f"--nproc {nproc}"
    if nproc is None:
        nproc = max(cfg.parallel.sequence_parallel, 2)
        given = f"{nproc} processes (--nproc's default: the config's parallel.sequence_parallel, at least 2)"
    if nproc < 2:
        raise UserError(f"{given}: sequence parallelism needs at least 2 processes")
    allowed = allowed_processes()
    if nproc > allowed:
        where = "GPUs" if torch.cuda.is_available() else "CPU cores available to this process"
        raise UserError(f"{given}: this machine has {allowed} {where}; use --nproc <= {allowed}")
    layout = [f"parallel.nproc_per_node={nproc}", f"parallel.sequence_parallel={nproc}", "parallel.num_nodes=1"]
    cfg = with_overrides(cfg, layout + ([f"model.dtype={dtype}"] if dtype else []), f"--nproc {nproc}")
    shape = ModelShape.from_hf_config(load_hf_config(cfg))
    kv_replication(shape.heads, shape.kv_heads, nproc, f"{cfg.source_file or 'config'} with {given}")
    layout_of(cfg, nproc)
    return cfg


def pick_window(cfg: Config, row: int) -> tuple[dict[str, np.ndarray], str, int]:
    """Window `row` of the config's prepared dataset if there is one, else a seeded synthetic window; with where it
    came from and the vocabulary size to build the model with (the dataset's tokenizer, as training does)."""
    if (data_dir(cfg) / "manifest.json").is_file():
        packed = open_checked(cfg)
        if not 0 <= row < len(packed):
            raise UserError(
                f"--window {row}: the prepared dataset {data_dir(cfg)} has {len(packed)} windows; "
                f"choose 0 .. {len(packed) - 1}"
            )
        item = packed[row]
        window = {k: np.asarray(item[k], dtype=np.int64) for k in ("input_ids", "seg_lens", "seg_doc", "tag_lens")}
        vocab = packed.manifest.tokenizer.vocab_size
        segments = len(window["seg_lens"])
        return window, f"prepared dataset {data_dir(cfg)}, window {row}: {segments} segment(s)", vocab
    anchor = anchor_token_id(load_tokenizer(cfg.resolve_source(cfg.data.tokenizer)), cfg.data.anchor)
    vocab = model_shape(cfg).vocab
    window = synthetic_window(cfg.data.seq_len, vocab, anchor, cfg.parallel.sequence_parallel, seed=cfg.seed + row)
    return (
        window,
        (
            f"synthetic (no prepared dataset at {data_dir(cfg)}): {len(window['seg_lens'])} documents, "
            f"seed {cfg.seed + row}"
        ),
        vocab,
    )


def check_sp(
    cfg: Config,
    *,
    nproc: int | None = None,
    modes: list[str] | None = None,
    dtype: str | None = None,
    window: int = 0,
    out: str | None = None,
) -> dict:
    """Run the comparison on P ranks for one window, print the per-mode table and return (and write) the JSON
    result; `modes` default to all four."""
    chosen = list(modes or MODES)
    if window < 0:
        raise UserError(f"--window {window}: a window index is 0 or more")
    cfg = check_config(cfg, nproc, dtype)
    win, source, vocab = pick_window(cfg, window)
    if len(win["seg_lens"]) == 1 and chosen != ["full"]:
        print(
            f"note: window {window} is one document: every mode attends as full attention does there, so the modes "
            f"are not told apart; --window picks another",
            flush=True,
        )
    out_dir = output_dir(Path(out) if out else Path("check_sp") / cfg.name)
    write_resolved(cfg, out_dir)
    np.savez(out_dir / WINDOW_FILE, **win)
    (out_dir / RESULT_FILE).unlink(missing_ok=True)
    request = {"out_dir": str(out_dir.resolve()), "modes": chosen, "window_source": source, "vocab_size": vocab}
    outcome = run_on_ranks(cfg, f"{__name__}:compare_on_ranks", request, out_dir)
    if isinstance(outcome, OutOfMemory):
        raise UserError(
            f"rank {outcome.rank} ran out of memory comparing {cfg.data.seq_len} tokens ({outcome.message}); "
            f"use more processes (--nproc) or a shorter data.seq_len"
        )
    result = outcome.result
    (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result), flush=True)
    print(f"wrote {out_dir / RESULT_FILE}", flush=True)
    return result


def format_table(result: dict) -> str:
    lines = [
        f"{result['config']}: one process vs DeepSpeed-Ulysses over {result['world']} processes "
        f"({result['backend']}, {result['device']}), {result['seq_len']} tokens, {result['window_source']}",
        "",
        "| mode | engine | dtype | max |Δ logits| | mean |Δ logits| | max |logit| |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["modes"]:
        lines.append(
            f"| {r['mode']} | {r['engine']} | {result['dtype']} | {r['max_abs']:.3g} | {r['mean_abs']:.3g} "
            f"| {r['ref_max_abs']:.3g} |"
        )
    lines += [
        "",
        "0 = bit-identical logits. The paper's Table 8 (32K, 8 GPUs): 0 for DeepSpeed-Ulysses "
        "(AnchorContext), 0.75 for zigzag ring attention in full attention.",
    ]
    return "\n".join(lines)


def _forward_logits(lm, batch: Batch, device: torch.device) -> torch.Tensor:
    return lm(**batch.to(device).model_kwargs(), use_cache=False).logits


def _check_same_weights(lm) -> None:
    """Every rank must hold the very weights rank 0 computes the reference with; one checksum per tensor, compared
    by an all-reduce of its maximum and minimum over the ranks."""
    # deepspeed on use: it takes seconds to import (start-up time)
    import deepspeed.comm as dist

    sums = torch.stack([p.detach().double().sum() for p in lm.parameters()])
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if not torch.equal(low, high):
        raise UserError(
            "the model's weights differ between the processes, so their logits cannot be compared; "
            "build the model from model.name_or_path, or from model.arch with a fixed seed"
        )


def _gather_sequence(local: torch.Tensor, topo) -> torch.Tensor | None:
    """The sequence-parallel group's slices of `[B, L/P, V]` concatenated in rank order on rank 0; None elsewhere."""
    # deepspeed on use: it takes seconds to import (start-up time)
    import deepspeed.comm as dist

    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(topo.sp)] if topo.is_main else None
    dist.gather(local, parts, dst=0, group=topo.sp_group)
    return torch.cat(parts, dim=1) if topo.is_main else None


@torch.inference_mode()
def compare_on_ranks(request: dict) -> dict | None:
    """Every rank (`run_on_ranks`): build the model, and per mode the 1-process logits (rank 0) and the Ulysses
    logits (all ranks); rank 0 returns the result."""
    out_dir = Path(request["out_dir"])
    cfg = load_config(str(out_dir / "config.yaml"))
    with np.load(out_dir / WINDOW_FILE) as f:
        win = {k: f[k] for k in f.files}
    topo = init_topology(cfg)
    try:
        lm = build_model(cfg, vocab_size=request["vocab_size"], device=topo.device).model.eval()
        _check_same_weights(lm)
        rows = []
        progress = ProgressBar(
            TextColumn("[bold]check sp"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            disable=not topo.is_main,
        )
        with progress:
            task = progress.add_task("check", total=len(request["modes"]), info="")
            for mode in request["modes"]:
                progress.update(task, info=mode)
                single = resolve_engine(cfg.attention.engine, mode, topo.device, dtype=cfg.model.dtype)
                batch = make_batch(
                    win["input_ids"][None],
                    [win["seg_lens"]],
                    mode,
                    seg_doc=[win["seg_doc"]],
                    tag_lens=[win["tag_lens"]],
                )
                lm.set_attn_implementation(single.hf_name)
                ref = _forward_logits(lm, batch, topo.device) if topo.is_main else None
                wrap_model(lm, single, topo.sp_group)
                local = _forward_logits(lm, batch.shard(topo.sp, topo.sp_rank), topo.device)
                gathered = _gather_sequence(local, topo)
                if topo.is_main:
                    rows.append(
                        {
                            "mode": mode,
                            "engine": single.name,
                            "shard_tokens": local.shape[1],
                            **logit_diff(ref, gathered),
                        }
                    )
                    del ref, gathered  # two [L, V] logits: free them before the next mode's forwards
                progress.advance(task)
        if not topo.is_main:
            return None
        return {
            "config": cfg.name,
            "world": topo.world,
            "backend": pick_backend(cfg),
            "device": torch.cuda.get_device_name(topo.device) if topo.device.type == "cuda" else "cpu",
            "dtype": cfg.model.dtype,
            "seq_len": int(len(win["input_ids"])),
            "documents": int(len(win["seg_lens"])),
            "window_source": request["window_source"],
            "modes": rows,
        }
    finally:
        release_single_process()
