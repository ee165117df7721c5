"""`lctrain eval`: RULER-style scores for every evaluation checkpoint of a run (or one model directory), their
average across checkpoints (the paper's protocol, §4.2), held-out perplexity, and the report (table, JSON, PNG).

A single-document prompt needs nothing but causal attention, so the checkpoints are loaded with the model's stock
`sdpa` attention: bf16 on a GPU, fp32 on a CPU.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from lctrain.config import Config, apply_overrides, load_config, validate
from lctrain.errors import UserError
from lctrain.eval import score as scoring
from lctrain.eval.perplexity import perplexity, select_heldout
from lctrain.eval.tasks import QA_TASK, Sample, generate, load_qa, select_tasks, task_specs
from lctrain.tokenizer import text_encoder

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class Target:
    """What `lctrain eval` was pointed at: a run directory (with its config) or a single model directory."""

    kind: str  # "run" | "model"
    path: Path
    cfg: Config
    checkpoints: list[tuple[str, Path]] = field(default_factory=list)


def parse_lengths(text: str) -> list[int]:
    """'4k,8k,128k' or '4096,8192' -> [4096, 8192, ...] (k = 1024)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"(\d+)\s*([kK]?)", item)
        if not m or int(m.group(1)) <= 0:
            raise UserError(f"--lengths '{text}': '{item}' is not a length; use e.g. --lengths 4k,8k,16k or 4096,8192")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return sorted(set(out))


def parse_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def find_checkpoints(run: Path) -> list[tuple[str, Path]]:
    """The run's evaluation checkpoints `hf/step_N/`, in step order."""
    hf = run / "hf"
    found = []
    if hf.is_dir():
        for d in hf.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and _is_model_dir(d):
                found.append((int(m.group(1)), d))
    return [(d.name, d) for _, d in sorted(found)]


def resolve_target(target: str | Path, config: str | None = None, overrides: list[str] | tuple = ()) -> Target:
    path = Path(target)
    if not path.exists():
        raise UserError(f"{path}: no such run or model directory")
    if _is_model_dir(path):
        cfg = load_config(config, overrides) if config else validate(apply_overrides({}, overrides), "--set")
        return Target("model", path, cfg, [(path.name or str(path), path)])
    if (path / "config.yaml").is_file() or (path / "hf").is_dir():
        if not (path / "config.yaml").is_file():
            raise UserError(f"{path}/config.yaml: missing; a run directory written by `lctrain train` has one")
        cfg = load_config(str(path / "config.yaml"), overrides)
        ckpts = find_checkpoints(path)
        if not ckpts:
            raise UserError(f"{path}/hf: no evaluation checkpoints (hf/step_N/ with config.json); they are written in "
                            f"the last checkpoint.hf_last steps of training, or pass a model directory instead")
        return Target("run", path, cfg, ckpts)
    raise UserError(f"{path}: neither a run directory (config.yaml, hf/step_N/) nor a Hugging Face model directory "
                    f"(config.json)")


def load_eval_tokenizer(model_dir: Path, cfg: Config):
    """The checkpoint's own tokenizer; a checkpoint saved without one falls back to the run's `data.tokenizer`."""
    if any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    from lctrain.tokenizer import load_tokenizer

    return load_tokenizer(cfg.data.tokenizer)


def pick_device(device: str | None) -> str:
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device}: not a device; use cuda, cuda:N, cpu or auto") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return device


def load_model(model_dir: Path, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    from lctrain.compat.transformers import load_errors

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    except load_errors() as e:
        raise UserError(f"{model_dir}: cannot load the model ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    return model.to(device).eval()


def greedy_generate(model, tokenizer, encoder, prompt: str, max_new_tokens: int) -> str:
    """`encoder` turns the prompt into ids (exactly as the model's reference tokenizer), `tokenizer` decodes."""
    import torch
    from transformers import GenerationConfig

    ids = torch.tensor([encoder.encode(prompt, specials=True)], device=model.device)
    eos = tokenizer.eos_token_id
    # use_cache explicitly: training checkpoints are saved with use_cache=False (packed windows need no cache)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True, eos_token_id=eos,
                           pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _progress():
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), transient=False)


def build_samples(names: list[str], lengths: list[int], num_samples: int, seed: int, encoder,
                  qa_path: str | None) -> list[Sample]:
    qa = load_qa(qa_path) if QA_TASK in names else None
    specs = task_specs(seed, qa)

    def count(text: str) -> int:
        return len(encoder.encode(text, specials=True))

    samples: list[Sample] = []
    with _progress() as bar:
        job = bar.add_task("generating task samples", total=len(names) * len(lengths))
        for name in names:
            for length in lengths:
                samples.extend(generate(specs[name], length, num_samples, seed, count))
                bar.advance(job)
    return samples


def _json_table(table: dict) -> dict:
    return {t: {str(L): v for L, v in per.items()} for t, per in table.items()}


def evaluate(
    target: str | Path,
    *,
    config: str | None = None,
    overrides: list[str] | tuple = (),
    lengths: str | None = None,
    tasks: str | None = None,
    exclude: str | None = None,
    samples: int | None = None,
    qa: str | None = None,
    out: str | Path | None = None,
    device: str | None = None,
    ppl_data: str | None = None,
) -> Path:
    """Score every checkpoint of `target` on the RULER-style tasks; write results.json, predictions.jsonl and
    ruler.png to `out` (default RUN_DIR/eval or MODEL_DIR/eval) and print the tables. Returns the output directory."""
    tgt = resolve_target(target, config, overrides)
    ev = tgt.cfg.eval
    lengths_ = parse_lengths(lengths) if lengths else sorted(set(ev.lengths))
    num_samples = samples if samples is not None else ev.samples_per_task
    if num_samples < 1:
        raise UserError(f"--samples {num_samples}: need at least 1 sample per task and length")
    qa_path = qa or ev.qa_path
    names, skipped = select_tasks(parse_names(tasks) or ev.tasks, parse_names(exclude) or list(ev.exclude), qa_path)
    out_dir = Path(out) if out else tgt.path / "eval"
    dev = pick_device(device)

    tokenizer = load_eval_tokenizer(tgt.checkpoints[0][1], tgt.cfg)
    encoder = text_encoder(tokenizer)
    all_samples = build_samples(names, lengths_, num_samples, ev.seed, encoder, qa_path)
    heldout = select_heldout(tgt, ppl_data)
    ppl: dict[str, float] = {}
    notes: dict[str, str] = {}

    per_sample: dict[str, dict[str, dict[int, list[float]]]] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    predictions_path = out_dir / "predictions.jsonl"
    with predictions_path.open("w") as pred_file, _progress() as bar:
        job = bar.add_task("evaluating", total=len(tgt.checkpoints) * len(all_samples))
        for ckpt_name, ckpt_dir in tgt.checkpoints:
            bar.update(job, description=f"evaluating {ckpt_name}")
            model = load_model(ckpt_dir, dev)
            limit = getattr(model.config, "max_position_embeddings", None)
            if limit and lengths_[-1] > limit:
                notes[f"{ckpt_name}: max_position_embeddings"] = (
                    f"{limit} < longest length {lengths_[-1]}: scores beyond it measure extrapolation")
            table = per_sample.setdefault(ckpt_name, {})
            for s in all_samples:
                pred = greedy_generate(model, tokenizer, encoder, s.prompt, s.max_new_tokens)
                value = scoring.METRICS[s.metric](pred, s.answers)
                table.setdefault(s.task, {}).setdefault(s.length, []).append(value)
                pred_file.write(json.dumps({"checkpoint": ckpt_name, "task": s.task, "length": s.length,
                                            "index": s.index, "tokens": s.num_tokens, "answers": list(s.answers),
                                            "prediction": pred, "score": value}) + "\n")
                bar.advance(job)
            if heldout.rows:
                ppl[ckpt_name] = perplexity(model, heldout.packed, heldout.rows)
            del model

    scores = {c: {t: {L: scoring.task_score(v) for L, v in per.items()} for t, per in tb.items()}
              for c, tb in per_sample.items()}
    average = scoring.average_checkpoints(scores)
    task_mean = {c: scoring.mean_over_tasks(tb) for c, tb in scores.items()}
    task_mean["average"] = scoring.mean_over_tasks(average)
    results = {
        "target": str(tgt.path),
        "kind": tgt.kind,
        "checkpoints": [c for c, _ in tgt.checkpoints],
        "device": dev,
        "tasks": names,
        "lengths": lengths_,
        "samples_per_task": num_samples,
        "seed": ev.seed,
        "skipped": skipped,
        "notes": notes,
        "scores": {c: _json_table(tb) for c, tb in scores.items()},
        "average": _json_table(average),
        "task_mean": _json_table(task_mean),
        "overall": sum(task_mean["average"].values()) / len(lengths_),
    }
    results["perplexity"] = {"data": str(heldout.path) if heldout.path else None, "windows": len(heldout.rows),
                             "heldout_available": heldout.available, "per_checkpoint": ppl,
                             "average": sum(ppl.values()) / len(ppl) if ppl else None, "note": heldout.note}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    from lctrain.eval.plots import plot_ruler

    plot_ruler(results, out_dir / "ruler.png")
    print_report(results, out_dir)
    return out_dir


def print_report(results: dict, out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from lctrain.eval.plots import length_label

    console = Console()
    lengths = [str(L) for L in results["lengths"]]
    n = len(results["checkpoints"])
    title = f"RULER-style scores, averaged over {n} checkpoint{'s' * (n > 1)} ({', '.join(results['checkpoints'])})"
    table = Table(title=title)
    table.add_column("task")
    for L in results["lengths"]:
        table.add_column(length_label(L), justify="right")
    for t in results["tasks"]:
        table.add_row(t, *(f"{results['average'][t][L]:.1f}" for L in lengths))
    table.add_row("[bold]mean[/bold]", *(f"[bold]{results['task_mean']['average'][L]:.1f}[/bold]" for L in lengths))
    console.print(table)
    if n > 1:
        per = Table(title="mean over tasks, per checkpoint")
        per.add_column("checkpoint")
        for L in results["lengths"]:
            per.add_column(length_label(L), justify="right")
        for c in results["checkpoints"]:
            per.add_row(c, *(f"{results['task_mean'][c][L]:.1f}" for L in lengths))
        console.print(per)
    for t, why in results["skipped"].items():
        console.print(f"skipped {t}: {why}")
    for what, note in results["notes"].items():
        console.print(f"note: {what} {note}")
    ppl = results.get("perplexity") or {}
    if ppl.get("note"):
        console.print(f"perplexity: {ppl['note']}")
    for c, v in (ppl.get("per_checkpoint") or {}).items():
        console.print(f"perplexity {c}: {v:.3f} on {ppl['windows']} held-out windows of {ppl['data']}")
    console.print(f"wrote {out_dir}/results.json, predictions.jsonl, ruler.png")
