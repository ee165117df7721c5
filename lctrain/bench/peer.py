"""lctrain against its peers in one run: the same model shape, window, dtype and batch through lctrain's trainer,
torchtitan, and plain transformers + SDPA + fused AdamW; tokens/s of every run and the ratio lctrain/peer.

    python scripts/bench_peer.py                      # one GPU: llama-1b at 32K and 64K, full and document
    python scripts/bench_peer.py --model tiny --lengths 256 --device cpu --peers lctrain transformers --steps 1

Every run is a fresh process (`python -m lctrain.bench.peer --one ...`: no allocator cache, compiled kernel or warm
state carries from one peer to the next), and the peers alternate A/B/B/A over `--rounds` for each (length, mode),
so a drift of the machine (clocks, a neighbour) falls on every peer alike; the ratio is of the peers' median tokens/s.

What each peer runs, one optimizer step = forward, backward, gradient clipping at 1.0 and AdamW:
- `lctrain`: `Trainer.train_step` (its engine `auto`, ZeRO-1 with fp32 master weights on a GPU, fused AdamW), in mode
  `full` or `intra_doc` (document).
- `torchtitan` (0.2.2, the newest that runs on a released PyTorch; 0.3.0 needs a nightly): its Llama-3 `Transformer`
  at lctrain's shape (layers, width, heads, KV heads, MLP width, vocabulary; untied output as its own), its full
  activation checkpointing, fp32 weights under bf16 autocast, fused AdamW, no torch.compile (its default). Full
  attention is its default SDPA (cuDNN first, causal); document mode is its varlen attention in bf16 (flex in fp32)
  with its `block_causal` mask, which starts a document after every end-of-sequence token: it reads marks at the
  token before every lctrain anchor (`document_ends`), so it masks what `intra_doc` masks, with the same positions.
- `transformers`: `AutoModelForCausalLM` with `attn_implementation="sdpa"`, transformers' gradient checkpointing,
  fp32 weights under bf16 autocast, `torch.optim.AdamW(fused=True)`, its own loss; document mode passes position ids
  that restart at every anchor, from which transformers builds its packed-sequence mask.

Activation checkpointing is the same for all (`--checkpointing`: full by default on a GPU, none on the CPU; selective
is each peer's own policy). Each peer's own speed-ups are opt-in, so the default compares like with like:
`--lctrain-set model.fused_kernels=liger` (or any lctrain config item) and `--titan-compile` (torchtitan's
`compile.enable`: each decoder layer compiled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from rich.table import Table

from lctrain.compat.transformers import enable_activation_checkpointing
from lctrain.console import plain_console
from lctrain.data.layouts import slimpajama_like_layouts, window_ids
from lctrain.measure import peak_bytes, reset_peak, timed
from lctrain.shapes import SHAPES, hf_arch
from lctrain.units import to_gb

PEERS = ("lctrain", "torchtitan", "transformers")
MODES = ("full", "document")
LCTRAIN_MODES = {"full": "full", "document": "intra_doc"}
ANCHOR = 1  # the anchor token id of the windows (lctrain's `builtin` tokenizers' BOS)
DTYPES = ("bfloat16", "float32")
CHECKPOINTING = ("full", "selective", "none")


@dataclass(frozen=True)
class RunSpec:
    """One measured run: a peer, the model shape (`lctrain.shapes`), window length, mode, and the step's settings."""

    peer: str
    model: str
    seq_len: int
    mode: str
    batch: int
    dtype: str
    steps: int
    warmup: int
    checkpointing: str  # one of CHECKPOINTING
    device: str
    seed: int = 0
    lctrain_set: tuple[str, ...] = ()  # lctrain's own further `--set` items (its runs only)
    titan_compile: bool = False  # torchtitan compiles each decoder layer (its `compile.enable`)

    def argv(self) -> list[str]:
        """The command-line argument of `--one` that describes this run (`from_argv` reads it back)."""
        return [json.dumps(dataclasses.asdict(self))]

    @classmethod
    def from_argv(cls, argv: list[str]) -> RunSpec:
        values = json.loads(argv[0])
        return cls(**{**values, "lctrain_set": tuple(values["lctrain_set"])})

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


def schedule(peers: list[str], lengths: list[int], modes: list[str], rounds: int, **common) -> list[RunSpec]:
    """The runs in order: for each length and mode, `rounds` rounds of every peer in turn, the order reversed every
    other round and every other (length, mode) (A/B/B/A, then B/A/A/B): no peer always runs first or on the heels of
    the same one, also with one round."""
    blocks = [(length, mode) for length in lengths for mode in modes]
    return [
        RunSpec(peer=peer, seq_len=length, mode=mode, **common)
        for b, (length, mode) in enumerate(blocks)
        for r in range(rounds)
        for peer in (peers if (b + r) % 2 == 0 else peers[::-1])
    ]


def windows(spec: RunSpec) -> tuple[np.ndarray, list[list[int]]]:
    """The batch every peer trains on: `[batch, seq_len]` token ids of seeded SlimPajama-like windows
    (`lctrain.data.layouts`, as scripts/bench_train.py), the anchor at every document start, and their layouts."""
    seg_lens = slimpajama_like_layouts(spec.seq_len, spec.batch, spec.seed)
    return window_ids(seg_lens, vocab=SHAPES[spec.model].vocab, anchor=ANCHOR, seed=spec.seed), seg_lens


def document_positions(ids: np.ndarray, anchor: int = ANCHOR) -> np.ndarray:
    """Positions that restart at 0 at every anchor token and count up to the next: the document starts as
    transformers' packed-sequence mask reads them."""
    positions = np.empty_like(ids)
    for row, out in zip(ids, positions):
        starts = np.flatnonzero(row == anchor)
        if len(starts) == 0 or starts[0] != 0:
            raise ValueError("a window must start with the anchor token")
        index = np.arange(len(row))
        out[:] = index - starts[np.searchsorted(starts, index, side="right") - 1]
    return positions


# ---------------------------------------------------------------- the peers' steps


def _lctrain_step(spec: RunSpec, device: torch.device) -> Callable[[], None]:
    # the trainer and its config on use: `--help` and the driver need neither (start-up time)
    from lctrain.config import load_config
    from lctrain.parallel.groups import init_topology
    from lctrain.train.trainer import Trainer

    gpu = device.type == "cuda"
    cfg = load_config(
        None,
        [
            f"data.seq_len={spec.seq_len}",
            f"attention.mode={LCTRAIN_MODES[spec.mode]}",
            "attention.engine=auto",
            f"model.dtype={spec.dtype}",
            f"model.checkpointing={spec.checkpointing}",
            f"model.arch={json.dumps(hf_arch(SHAPES[spec.model]))}",
            f"train.global_batch={spec.batch}",
            f"train.micro_batch={spec.batch}",
            "train.fused_optimizer=true",
            f"parallel.zero_stage={1 if gpu else 0}",  # bf16 needs ZeRO's fp32 master weights
            *spec.lctrain_set,
        ],
    )
    trainer = Trainer(cfg, init_topology(cfg), vocab_size=SHAPES[spec.model].vocab)
    ids, seg_lens = windows(spec)
    window = {
        "input_ids": ids,
        "seg_lens": [np.array(s) for s in seg_lens],
        "seg_doc": [np.arange(len(s)) for s in seg_lens],
        "tag_lens": [np.zeros(len(s), dtype=np.int64) for s in seg_lens],
    }
    return lambda: trainer.train_step([window])


def _autocast(spec: RunSpec, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.dtype == "bfloat16")


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=2e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def _transformers_step(spec: RunSpec, device: torch.device) -> Callable[[], None]:
    # transformers on use, as the trainer (start-up time)
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = hf_arch(SHAPES[spec.model])
    config = AutoConfig.for_model(arch.pop("model_type"), **arch, max_position_embeddings=spec.seq_len)
    with device:
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    if spec.checkpointing == "selective":
        raise SystemExit("transformers has no selective activation checkpointing of its own: --checkpointing full")
    if spec.checkpointing == "full":
        enable_activation_checkpointing(model, {"use_reentrant": False})
    model.train()
    optimizer = _adamw(model)
    ids_np, _ = windows(spec)
    ids = torch.as_tensor(ids_np, device=device)
    positions = torch.as_tensor(document_positions(ids_np), device=device) if spec.mode == "document" else None

    def step():
        with _autocast(spec, device):
            loss = model(input_ids=ids, position_ids=positions, labels=ids).loss
        loss.backward()
        _optimizer_step(model, optimizer)

    return step


def document_ends(ids: np.ndarray, anchor: int = ANCHOR) -> np.ndarray:
    """1 at the last token of every document but a window's last, else 0: the token before each anchor. torchtitan
    0.2 reads document boundaries as "after each end-of-sequence token", so these marks, read with end-of-sequence id
    1, start its documents exactly at lctrain's anchors."""
    ends = np.zeros_like(ids)
    ends[:, :-1] = ids[:, 1:] == anchor
    return ends


def _torchtitan_step(spec: RunSpec, device: torch.device) -> Callable[[], None]:
    # torchtitan is a peer, not a dependency of lctrain: imported by its runner only (and it imports triton)
    import torch.nn.functional as F
    from torchtitan.config.job_config import ActivationCheckpoint, Compile
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.models.llama3.infra.parallelize import apply_compile

    from lctrain.compat.torchtitan import op_sac_save_list

    shape = SHAPES[spec.model]
    if spec.mode == "document":
        attention = {"attn_type": "varlen" if spec.dtype == "bfloat16" else "flex", "attn_mask_type": "block_causal"}
    else:  # its default: SDPA (cuDNN first), causal
        attention = {"attn_type": "sdpa", "attn_mask_type": "causal"}
    args = TransformerModelArgs(
        dim=shape.hidden,
        n_layers=shape.layers,
        n_heads=shape.heads,
        n_kv_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        # its SwiGLU width is int(multiplier * int(8 * dim / 3)) rounded up to multiple_of: exactly lctrain's
        multiple_of=1,
        ffn_dim_multiplier=(shape.intermediate + 0.5) / int(8 * shape.hidden / 3),
        max_seq_len=spec.seq_len,
        **attention,
    )
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    torch.manual_seed(spec.seed)
    with torch.no_grad():  # as its trainer calls it
        model.init_weights(buffer_device=device)
    built = (len(model.layers), model.layers["0"].attention.head_dim, model.layers["0"].feed_forward.w1.out_features)
    if built != (shape.layers, shape.head_dim, shape.intermediate):
        raise SystemExit(f"torchtitan's model (layers, head dim, MLP width) = {built}: not {spec.model}'s")
    if spec.checkpointing != "none":  # its own policies; `selective` is its op-level one, as its Llama-3 recipes
        policy = ActivationCheckpoint(mode=spec.checkpointing, selective_ac_option="op")
        apply_ac(model, policy, model_compile_enabled=spec.titan_compile, op_sac_save_list=op_sac_save_list())
    if spec.titan_compile:  # after checkpointing, as its parallelize_llama orders them
        apply_compile(model, Compile(enable=True))
    model.train()
    optimizer = _adamw(model)
    ids_np, _ = windows(spec)
    tokens = torch.as_tensor(ids_np, device=device)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    ends = torch.as_tensor(document_ends(ids_np), device=device)
    tokenizer = SimpleNamespace(eos_id=1)  # the one field of a tokenizer its mask builders read: the marks' value

    def step():
        masks = model.get_attention_masks(ends, tokenizer) if spec.mode == "document" else None
        with _autocast(spec, device):
            logits = model(tokens, masks)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        _optimizer_step(model, optimizer)

    return step


RUNNERS: dict[str, Callable[[RunSpec, torch.device], Callable[[], None]]] = {
    "lctrain": _lctrain_step,
    "torchtitan": _torchtitan_step,
    "transformers": _transformers_step,
}


def measure(spec: RunSpec) -> dict:
    """Build `spec.peer`'s step, run `warmup` untimed steps and `steps` timed ones: the median step's seconds,
    tokens/s and the peak memory of the timed steps."""
    device = torch.device(spec.device)
    step = RUNNERS[spec.peer](spec, device)
    for _ in range(spec.warmup):
        step()
    scope = reset_peak(device)
    seconds = statistics.median(timed(step, device)[1] for _ in range(spec.steps))
    return {
        "step_s": seconds,
        "tokens_per_s": spec.tokens / seconds,
        "peak_gb": to_gb(peak_bytes(device)),
        "peak_scope": scope,
    }


# ---------------------------------------------------------------- the driver


def run_fresh(spec: RunSpec, timeout: float, log: Path) -> dict:
    """`measure(spec)` in a fresh process; its row, or the row with the error that ended it. The process's stderr is
    appended to `log` whole: a row keeps one line of it, too little to tell why a run on a lent GPU failed."""
    row = dataclasses.asdict(spec)
    command = [sys.executable, "-m", "lctrain.bench.peer", "--one", *spec.argv()]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # TimeoutExpired holds bytes whatever `text` asked for
        _append_log(log, spec, f"timed out after {timeout:.0f} s", (e.stderr or b"").decode(errors="replace"))
        return {**row, "error": f"timed out after {timeout:.0f} s (stderr in {log})"}
    _append_log(log, spec, f"exit {proc.returncode}", proc.stderr)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {**row, "error": f"exit {proc.returncode}: {tail} (stderr in {log})"}
    return {**row, **json.loads(lines[-1])}


def _append_log(log: Path, spec: RunSpec, outcome: str, stderr: str) -> None:
    with log.open("a") as f:
        f.write(f"=== {spec.peer} L={spec.seq_len} {spec.mode}: {outcome}\n{stderr.rstrip()}\n")


def ratios(rows: list[dict]) -> list[dict]:
    """Per (length, mode): each peer's median tokens/s over its completed runs, and lctrain's over it."""
    out = []
    for key in dict.fromkeys((r["seq_len"], r["mode"]) for r in rows):
        rates: dict[str, list[float]] = {}
        for r in rows:
            if (r["seq_len"], r["mode"]) == key and "tokens_per_s" in r:
                rates.setdefault(r["peer"], []).append(r["tokens_per_s"])
        ours = statistics.median(rates["lctrain"]) if "lctrain" in rates else None
        for peer, values in rates.items():
            if peer == "lctrain":
                continue
            theirs = statistics.median(values)
            out.append(
                {
                    "seq_len": key[0],
                    "mode": key[1],
                    "peer": peer,
                    "lctrain_tokens_per_s": ours,
                    "peer_tokens_per_s": theirs,
                    "ratio": ours / theirs if ours is not None else None,
                    "runs": len(values),
                }
            )
    return out


def row_table(rows: list[dict]) -> Table:
    table = Table(title="runs, in the order run (each a fresh process)")
    for col in ("L", "mode", "peer", "step s", "tokens/s", "peak GB", "note"):
        table.add_column(col, justify="right")
    for r in rows:
        done = "tokens_per_s" in r
        table.add_row(
            str(r["seq_len"]),
            r["mode"],
            r["peer"],
            f"{r['step_s']:.3f}" if done else "-",
            f"{r['tokens_per_s']:,.0f}" if done else "-",
            f"{r['peak_gb']:.1f}" if done else "-",
            r.get("error", ""),
        )
    return table


def ratio_table(summary: list[dict]) -> Table:
    table = Table(title="lctrain / peer (median tokens/s)")
    for col in ("L", "mode", "peer", "lctrain tokens/s", "peer tokens/s", "lctrain / peer"):
        table.add_column(col, justify="right")
    for s in summary:
        ours = s["lctrain_tokens_per_s"]
        table.add_row(
            str(s["seq_len"]),
            s["mode"],
            s["peer"],
            f"{ours:,.0f}" if ours is not None else "-",
            f"{s['peer_tokens_per_s']:,.0f}",
            f"{s['ratio']:.2f}x" if s["ratio"] is not None else "-",
        )
    return table


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama-1b", help="a model shape (lctrain.shapes)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--batch", type=int, default=1, help="windows per step")
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (their median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every peer per (length, mode), alternating")
    ap.add_argument(
        "--checkpointing",
        choices=CHECKPOINTING,
        default=None,
        help="activation checkpointing of every decoder layer in every peer, each by its own policy (default: full "
        "on a GPU, none on the CPU; selective: lctrain's model.checkpointing=selective, torchtitan's op-level "
        "policy; transformers has none)",
    )
    ap.add_argument(
        "--lctrain-set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="lctrain's runs only: further config items, e.g. model.fused_kernels=liger",
    )
    ap.add_argument(
        "--titan-compile", action="store_true", help="torchtitan's runs only: torch.compile of each decoder layer"
    )
    ap.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/bench_peer.json")
    args = ap.parse_args(argv)
    for name in ("lengths", "batch", "steps", "rounds"):
        values = getattr(args, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            ap.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if len(set(args.peers)) != len(args.peers):
        ap.error("--peers names a peer twice")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.checkpointing = args.checkpointing or ("full" if gpu else "none")
    if args.checkpointing == "selective" and "transformers" in args.peers:
        ap.error("--checkpointing selective: transformers has no selective policy of its own; leave it out of --peers")
    if args.lctrain_set:
        from lctrain.config import load_config  # on use: the driver needs the config only to check these items
        from lctrain.errors import UserError

        try:
            load_config(None, args.lctrain_set)
        except UserError as e:
            ap.error(f"--lctrain-set: {e}")
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--one"]:
        print(json.dumps(measure(RunSpec.from_argv(argv[1:]))), flush=True)
        from lctrain.parallel.groups import release_single_process  # lctrain's run made a process group

        release_single_process()  # else NCCL warns at exit that it was never destroyed
        return
    args = parse_args(argv)
    specs = schedule(
        args.peers,
        args.lengths,
        args.modes,
        args.rounds,
        model=args.model,
        batch=args.batch,
        dtype=args.dtype,
        steps=args.steps,
        warmup=args.warmup,
        checkpointing=args.checkpointing,
        device=args.device,
        seed=args.seed,
        lctrain_set=tuple(args.lctrain_set),
        titan_compile=args.titan_compile,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    console = plain_console(width=160)
    log = out.with_suffix(".log")
    log.write_text("")
    rows = []
    for i, spec in enumerate(specs, 1):
        rows.append(run_fresh(spec, args.timeout, log))
        r = rows[-1]
        result = r.get("error") or f"{r['tokens_per_s']:,.0f} tokens/s"
        console.print(f"[{i}/{len(specs)}] L={spec.seq_len} {spec.mode} {spec.peer}: {result}")
        # written after every run, so a run stopped at a time limit keeps what it measured
        out.write_text(json.dumps({"args": vars(args), "rows": rows, "ratios": ratios(rows)}, indent=1))
    console.print(row_table(rows))
    console.print(ratio_table(ratios(rows)))
    print(f"wrote {out} (each run's stderr in {log})")


if __name__ == "__main__":
    main()
