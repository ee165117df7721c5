"""`lctrain eval`: RULER scores for every evaluation checkpoint of a run (or one model directory), their average
across checkpoints (the paper's protocol, §4.2), held-out perplexity, and the report (table, JSON, PNG).

Two suites: RULER's own prepared data (`--ruler-data`, read by `lctrain.eval.ruler`), whose scores compare with
published RULER numbers, and the offline RULER-style generator (`lctrain.eval.tasks`), whose scores do not. Both score
the config's task set (`eval.tasks` minus `eval.exclude`: the paper's Llama-2 configs leave out niah_multikey_3 and
cwe) with RULER's metrics, and a task of the set that cannot be scored is named at the top of the report.

A single-document prompt needs nothing but causal attention, so the checkpoints are loaded with the model's stock
`sdpa` attention (`eager` where sdpa would not compute the model: Gemma-2's soft-capping): bf16 on a GPU, fp32 on a
CPU.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote

from rich.markup import escape
from rich.table import Table

from lctrain.compat.transformers import load_errors, sdpa_refused
from lctrain.config import Config, load_config, schema_defaults
from lctrain.console import no_library_bars, plain_console
from lctrain.errors import UserError, WriteFailed, remedy_of, writing
from lctrain.eval import ruler
from lctrain.eval import score as scoring
from lctrain.eval.kept import Kept, checkpoint_files
from lctrain.eval.perplexity import perplexity_by_length, perplexity_lengths, select_heldout
from lctrain.eval.ruler import Sample
from lctrain.eval.tasks import (
    QA_FORMATS,
    TaskSpec,
    build_sample,
    generate,
    load_qa,
    task_specs,
    unscorable_qa,
)
from lctrain.export_record import EXPORT_RECORD, read_export_record, verify_export
from lctrain.files import TEMPORARY_PREFIX, replace_file, temporary_of
from lctrain.lifetime import Reading, RunLock, lock_holder
from lctrain.progress_bar import counted_bar
from lctrain.rundir import RunDir, by_step, step_of
from lctrain.tokenizer import load_tokenizer, recorded_anchor, resolve_anchor, text_encoder

OFFLINE_LABEL = "RULER-style v2 (not comparable with published RULER numbers)"
# predictions.jsonl while an evaluation runs: renamed with results.json when it completes
PARTIAL_PREDICTIONS = "predictions.jsonl.partial"
PLOT = "ruler.png"
# held in the output directory while an evaluation writes there (`EvalLock`), removed when it ends
EVAL_LOCK = ".lctrain-eval.lock"
# the machine's refusals that another output directory avoids: their remedy (`errors.remedy_of`) gains --out DIR
_ELSEWHERE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# The longest length any command parses: 16M tokens, beyond every model's context (the longest published, 10M). Past
# it a typo (999999999) reached the sample generator, which aborted in native code for want of memory.
MAX_LENGTH = 1 << 24
# How far beyond a model's own context `lctrain eval` scores: the paper evaluates its 64K runs at 128K (Tables 4 and
# 5), twice their context, where vanilla RoPE already loses up to 31 points (Table 4). Further out a score measures
# a model that lost its positions, at the cost of prompts many times those it was made for.
EXTRAPOLATION = 4


@dataclass
class Target:
    """What `lctrain eval` was pointed at: a run directory (with its config) or a single model directory."""

    kind: str  # "run" | "model"
    path: Path
    cfg: Config
    checkpoints: list[tuple[str, Path]] = field(default_factory=list)
    # whether cfg's data.tokenizer may stand in for a checkpoint saved without one: a run's (it trained with it), or
    # one the user named for this model (--set data.tokenizer); never a default's or a --config's, another model's
    tokenizer_fallback: bool = True


def parse_lengths(text: str, option: str = "--lengths") -> list[int]:
    """'4k,8k,128k' or '4096,8192' -> [4096, 8192, ...] (k = 1024); errors name the command's `option`."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"(\d+)\s*([kK]?)", item)
        if not m or int(m.group(1)) <= 0:
            raise UserError(f"{option} '{text}': '{item}' is not a length; use e.g. {option} 4k,8k,16k or 4096,8192")
        length = int(m.group(1)) * (1024 if m.group(2) else 1)
        if length > MAX_LENGTH:
            raise UserError(
                f"{option} '{text}': {length:,} tokens is beyond any model's context; use lengths of at most "
                f"{MAX_LENGTH // 1024}k ({MAX_LENGTH:,} tokens)"
            )
        out.append(length)
    return sorted(set(out))


def parse_names(text: str | None, required: str | None = None) -> list[str] | None:
    """'a, b' -> ['a', 'b']; None when not given. `required`: the option's name, when naming nothing is refused (an
    empty `--tasks "$TASKS"` fell back to every task)."""
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    if required and not names:
        raise UserError(f"{required} '{text}': names nothing; give comma-separated names, or leave the option out")
    return names


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def find_checkpoints(run: RunDir) -> list[tuple[str, Path]]:
    """The run's evaluation checkpoints `hf/step_N/`, in step order, each verified against its record (one without
    its config.json is damage; those without a record are named in a warning)."""
    exports, unrecorded = run.exports(), []
    for d in exports:
        if not _is_model_dir(d):
            raise UserError(f"{d}/config.json: missing; restore the export, or delete {d} to evaluate the others")
        if not verify_export(d, step_of(d)):
            unrecorded.append(d.name)
    if unrecorded:
        print(
            f"warning: {run.exports_dir}: {', '.join(unrecorded)} without {EXPORT_RECORD} (exported before lctrain "
            f"recorded exports, or the record deleted): evaluated unchecked, under their directories' steps",
            file=sys.stderr,
            flush=True,
        )
    return [(d.name, d) for d in exports]


def export_digest(directory: Path) -> str | None:
    """What identifies an export's weights without reading them: the SHA-256 of its record (`export.json`: its step
    and every file's size and checksums, checked against the files when `lctrain eval` opens it), as JSON with sorted
    keys. An export written again (a run started over with `train --force`, `lctrain export --force`) has another;
    None for one without a record. `results.json` keeps it per checkpoint (`export_records`), for `lctrain report` to
    tell results of other weights than the run's exports now hold."""
    record = read_export_record(directory)
    if record is None:
        return None
    canonical = json.dumps(record.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def latest_exports(ckpts: list[tuple[str, Path]], last: int | None, run: Path) -> list[tuple[str, Path]]:
    """The latest `last` of a run's exports (default the paper's 5, or all of fewer): those `eval` scores and
    averages, as the paper averages RULER over its last five checkpoints (§4.2). A note names those left out."""
    n = scoring.DEFAULT_LAST if last is None else last
    names = [name for name, _ in ckpts]
    if n > len(ckpts) and last is not None:
        raise UserError(
            f"--last {n}: {run} has {len(ckpts)} evaluation checkpoint(s) ({', '.join(names)}); use --last "
            f"{len(ckpts)} or fewer"
        )
    protocol = ", the paper's protocol (its last five, §4.2)" if n == scoring.DEFAULT_LAST else f" (--last {n})"
    if n < len(ckpts):
        print(
            f"note: evaluating the latest {n} of the run's {len(ckpts)} checkpoints ({', '.join(names[-n:])}) and "
            f"averaging over them{protocol}; {', '.join(names[:-n])} left out: --last {len(ckpts)} evaluates every one",
            flush=True,
        )
    return ckpts[-n:]


def resolve_target(
    target: str | Path, config: str | None = None, overrides: list[str] | tuple = (), last: int | None = None
) -> Target:
    """What `target` names (a run directory or a model directory) with its config; of a run, the latest `last`
    exports (`latest_exports`)."""
    path = Path(target)
    if not path.exists():
        raise UserError(f"{path}: no such run or model directory")
    if _is_model_dir(path):
        if last is not None:
            raise UserError(f"--last {last}: {path} is a model directory (one checkpoint), not a run directory")
        verify_export(path, step_of(path))
        cfg = load_config(config, overrides) if config else schema_defaults(overrides)
        named = cfg.overridden("data.tokenizer")
        return Target("model", path, cfg, [(path.name or str(path), path)], tokenizer_fallback=named)
    rd = RunDir(path)
    if rd.is_run() or rd.exports_dir.is_dir():
        if not rd.is_run():
            raise UserError(f"{rd.config_file}: missing; a run directory written by `lctrain train` has one")
        if config is not None:
            raise UserError(
                f"--config {config}: {path} is a run directory, evaluated under its own {rd.config_file.name}; change "
                f"its eval settings with --set eval.KEY=VALUE"
            )
        cfg = rd.read_config(overrides)
        scoring.check_last(last)  # the arguments before the checkpoints' checks
        ckpts = find_checkpoints(rd)
        if not ckpts:
            # training's checkpoint module imports DeepSpeed's and torch's: on use, for this hint alone (start-up time)
            from lctrain.train.checkpoint import latest_checkpoint

            last = latest_checkpoint(rd)
            export = f"; `lctrain export {quote(str(path))}` writes one of {last.name}" if last is not None else ""
            raise UserError(
                f"{path}/hf: no evaluation checkpoints (hf/step_N/ with config.json); they are written in "
                f"the last checkpoint.hf_last steps of training, or pass a model directory instead{export}"
            )
        return Target("run", path, cfg, latest_exports(ckpts, last, path))
    raise UserError(
        f"{path}: neither a run directory (config.yaml, hf/step_N/) nor a Hugging Face model directory (config.json)"
    )


def training_progress(tgt: Target) -> dict | None:
    """How far the run trained, for a run target (None for a model directory): {"steps": the last step its metrics,
    resume checkpoints or evaluation exports reached, "train_steps": its train.steps, "finished": whether it got
    there}. A run killed before its last step still has evaluation checkpoints, whose scores are not the finished
    run's: a report must not count it as a full replicate."""
    if tgt.kind != "run":
        return None
    rd = RunDir(tgt.path)
    try:
        records = rd.read_metrics()
    except UserError:
        records = []  # a damaged metrics file: the checkpoints and exports still show how far it got
    stepped = by_step([*(rd.checkpoints.iterdir() if rd.checkpoints.is_dir() else []), *rd.exports()])
    steps = max([r["step"] for r in records[-1:]] + [step_of(p) for p in stepped], default=0)
    return {"steps": steps, "train_steps": tgt.cfg.train.steps, "finished": steps >= tgt.cfg.train.steps}


def _setting_path(cfg: Config, value: str | None) -> str | None:
    """A path from the config (not the command line): relative to where its run was trained."""
    return str(cfg.resolve_path(value)) if value else None


def load_eval_tokenizer(model_dir: Path, cfg: Config, fallback: bool = True):
    """The checkpoint's own tokenizer; a checkpoint saved without one falls back to `data.tokenizer` where `fallback`
    (`Target.tokenizer_fallback`), else is refused: prompts in another tokenizer's ids score nothing."""
    if any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        # transformers on use: this module loads without it (start-up time)
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(model_dir))
        except load_errors() as e:
            raise UserError(
                f"{model_dir}: cannot load its tokenizer ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                f"restore its tokenizer files"
            ) from None
    if not fallback:
        raise UserError(
            f"{model_dir}: no tokenizer ({', '.join(_TOKENIZER_FILES)}); copy the model's tokenizer files into it, or "
            f"name its tokenizer: --set data.tokenizer=DIR_OR_HUB_NAME"
        )
    return load_tokenizer(cfg.resolve_source(cfg.data.tokenizer))


def eval_anchor(model_dir: Path, cfg: Config, tokenizer):
    """What every prompt starts with: the anchor the checkpoint trained with (its `anchor.json`), else the config's
    `data.anchor` for this tokenizer (a model directory not trained here: the default rule)."""
    return recorded_anchor(model_dir) or resolve_anchor(tokenizer, cfg.data.anchor)


def pick_device(device: str | None) -> str:
    # torch on use: this module loads without it (start-up time of the light commands)
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device}: not a device; use cuda, cuda:N, cpu or auto") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if device.startswith("mps") and not torch.backends.mps.is_available():
        raise UserError(f"--device {device}: Apple's MPS is not available on this machine; use --device cpu")
    return device


def eval_dtype(device: str):
    """What a checkpoint is evaluated in: bf16 on a GPU, fp32 on a CPU."""
    # torch on use: this module loads without it (start-up time)
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def eval_attention(hf_config) -> str:
    """The attention implementation a checkpoint is evaluated with: transformers' `sdpa`, else `eager` where sdpa
    would compute another model or is refused: attention soft-capping (`attn_logit_softcapping`, which sdpa has no
    step for) or a model class without sdpa (Gemma-2, `compat.transformers.sdpa_refused`)."""
    if getattr(hf_config, "attn_logit_softcapping", None) is not None or sdpa_refused(hf_config, "sdpa"):
        return "eager"
    return "sdpa"


# the model types whose fall-back to eager attention was said on stderr: once per model type and process
_EAGER_SAID: set[str] = set()


def _say_eager(hf_config) -> None:
    model_type = getattr(hf_config, "model_type", "?")
    if model_type in _EAGER_SAID:
        return
    _EAGER_SAID.add(model_type)
    cap = getattr(hf_config, "attn_logit_softcapping", None)
    why = (
        f"sdpa would drop its attention soft-capping (attn_logit_softcapping = {cap}), which eager applies"
        if cap is not None
        else "transformers runs no sdpa for it"
    )
    print(
        f"note: model type '{model_type}' is evaluated with transformers' eager attention ({why}): slower than sdpa, "
        f"with memory quadratic in the prompt's length",
        file=sys.stderr,
    )


def _sdpa_refusal(e: BaseException) -> bool:
    """Whether `from_pretrained` refused the model for its sdpa attention (a class `sdpa_refused` cannot look up:
    remote code)."""
    return isinstance(e, ValueError) and "sdpa" in str(e)


def load_model(model_dir: Path, device: str):
    """A checkpoint for evaluation, in `eval_dtype` and with the attention `eval_attention` chooses, eager where
    transformers refuses sdpa for the model; a fall-back to eager is said once on stderr."""
    # transformers on use: this module loads without it (start-up time)
    from transformers import AutoConfig, AutoModelForCausalLM

    no_library_bars()  # a "Loading weights" bar per checkpoint would tear through eval's own bar
    try:
        hf_config = AutoConfig.from_pretrained(str(model_dir))
        impl = eval_attention(hf_config)
        load = {"dtype": eval_dtype(device)}
        try:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=impl, **load)
        except ValueError as e:
            if impl == "eager" or not _sdpa_refusal(e):
                raise
            impl = "eager"
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=impl, **load)
    except load_errors() as e:
        raise UserError(
            f"{model_dir}: cannot load the model ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    if impl == "eager":
        _say_eager(hf_config)
    return model.to(device).eval()


def model_context(model_dir: Path) -> int | None:
    """The positions a model directory's config.json says the model was made for: its max_position_embeddings
    (which training raises to data.seq_len), or the original context its RoPE scaling stretches by its factor where
    that is longer (a YaRN config that keeps the base model's 4096); None when it says neither or cannot be read
    (loading the model says why)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        own = int(config["max_position_embeddings"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    rope = config.get("rope_scaling") or config.get("rope_parameters")  # transformers 4's key, 5's
    try:
        original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
        return max(own, int((original or own) * float(rope.get("factor") or 1)))
    except (AttributeError, TypeError, ValueError):
        return own


@dataclass(frozen=True)
class Lengths:
    """The lengths an evaluation scores, where they came from as its refusals name them (`source`: --lengths, the
    config's eval.lengths, or --ruler-data's length directories) and the `option` that chooses others."""

    lengths: list[int]
    source: str
    option: str


def offline_lengths(lengths: list[int] | None, ev) -> Lengths:
    """The offline suite's lengths: `lengths` (--lengths), else the config's eval.lengths."""
    if lengths:
        return Lengths(lengths, "--lengths", "--lengths")
    return Lengths(sorted(set(ev.lengths)), "eval.lengths", "--lengths (or eval.lengths)")


def refuse_unrunnable(tgt: Target, asked: Lengths, longest: int, backend: str, device: str) -> None:
    """`check_context`, then with the hf backend `check_memory` for a prompt plus generation of `longest` tokens
    (vLLM places its own cache, and refuses a length when its engine starts)."""
    check_context(tgt, asked)
    if backend == "hf":
        check_memory(tgt, longest, device)


def check_context(tgt: Target, asked: Lengths) -> None:
    """Refuse lengths beyond `EXTRAPOLATION` times the model's context (`model_context`) before any work: a typo or a
    run's default eval.lengths on a model trained short otherwise generated samples for minutes, or aborted in native
    code out of memory, before a model was loaded. A run's checkpoints share one config: the first one's decides."""
    name, path = tgt.checkpoints[0]
    context = model_context(path)
    if context is None:
        return
    most = EXTRAPOLATION * context
    beyond = [L for L in asked.lengths if L > most]
    if beyond:
        raise UserError(
            f"{asked.source} {','.join(map(str, beyond))}: more than {EXTRAPOLATION}x the {context:,} positions "
            f"{name} was made for (max_position_embeddings and RoPE scaling of {path}/config.json); lctrain "
            f"evaluates up to {EXTRAPOLATION}x a model's context (the paper 2x: its 64K runs at 128K): use "
            f"{asked.option} of at most {most}"
        )


def check_memory(tgt: Target, tokens: int, device: str) -> None:
    """Refuse, before any sample is generated, a prompt of `tokens` whose KV cache and prefill activations alone
    cannot fit in the memory free now: `generation.plan_generation`'s rule, which the loaded model's plan (`plan_for`)
    applies again with its weights counted. A config transformers cannot read is left to the model's load."""
    # torch and transformers on use: this module loads without them (start-up time)
    import torch
    from transformers import AutoConfig

    from lctrain.eval.generation import free_memory, plan_generation

    try:
        config = AutoConfig.from_pretrained(str(tgt.checkpoints[0][1]))  # a run's checkpoints share their shape
    except load_errors():
        return
    free, host = free_memory(torch.device(device))
    plan_generation(config, tokens, eval_dtype(device).itemsize, free, host, attention=eval_attention(config))


def greedy_generate(model, tokenizer, encoder, sample: Sample, plan, ends: list[int], cache=None) -> str:
    """The greedy answer to `sample` under a `generation.GenerationPlan` (and its reusable `planned_cache`), up to
    its `max_new_tokens`, one of the `ends` ids (`generation.stop_ids`), or the token after which its score cannot
    change (`answered`): `encoder` turns the prompt into the ids the model reads (its suite's: `TextEncoder.prompted`
    or `ruler.PromptEncoder`), `tokenizer` decodes."""
    # eval.generation imports torch/transformers: on use (start-up time)
    from lctrain.eval.generation import greedy_ids

    ids = encoder.encode(sample.prompt, specials=True)
    done = answered(tokenizer, sample)
    new = greedy_ids(model, ids, sample.max_new_tokens, plan, cache=cache, eos=ends, stop=done)
    return tokenizer.decode(new, skip_special_tokens=True)


def answered(tokenizer, sample: Sample):
    """stop(new ids) for `sample`'s generation: true once the text so far is `score.settled`."""
    return lambda new: scoring.settled(sample.metric, sample.answers, tokenizer.decode(new, skip_special_tokens=True))


def until_answered(tokenizer, sample: Sample, new: list[int]) -> list[int]:
    """A full continuation cut where the HF path's generation stops (`answered`), so both backends record the same
    prediction. A settled text stays settled as it grows, so the first settled prefix is found by bisection: a few
    decodes per sample, not one per token (RULER's full sets are thousands of samples)."""
    done = answered(tokenizer, sample)
    if not done(new):
        return new
    lo, hi = 1, len(new)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if done(new[:mid]) else (mid + 1, hi)
    return new[:lo]


@dataclass
class Suite:
    """The samples one evaluation scores, one source per task and length (a list, or a RULER file read again for
    each checkpoint), and what of its task set it cannot score."""

    label: str
    sources: list[Sequence[Sample] | ruler.TaskFile]
    lengths: list[int]
    longest: int  # most tokens of a prompt plus its generation
    not_scored: list[dict] = field(default_factory=list)  # {"task": name | None, "length": L | None, "why": text}
    notes: dict[str, str] = field(default_factory=dict)


def scored_samples(suite: Suite) -> int | dict[str, dict[str, int]]:
    """Samples per task as scored: one number where every task and length has as many, else {task: {length: n}}
    (RULER's files may hold fewer than --samples asks, or differ in size): what `report` compares."""
    counts: dict[str, dict[str, int]] = {}
    for src in suite.sources:
        task, length = (src.task, src.length) if isinstance(src, ruler.TaskFile) else (src[0].task, src[0].length)
        counts.setdefault(task, {})[str(length)] = len(src)
    numbers = {n for per in counts.values() for n in per.values()}
    return numbers.pop() if len(numbers) == 1 else counts


def _counter(encoder):
    return lambda text: len(encoder.encode(text, specials=True))


def qa_files(cfg: Config, squad: str | None = None, hotpotqa: str | None = None) -> dict[str, str | None]:
    """The local files of the offline suite's qa_1 (SQuAD) and qa_2 (HotpotQA): `squad` and `hotpotqa` (the
    options), else the config's eval.squad_path and eval.hotpotqa_path."""
    return {
        "qa_1": squad or _setting_path(cfg, cfg.eval.squad_path),
        "qa_2": hotpotqa or _setting_path(cfg, cfg.eval.hotpotqa_path),
    }


def offline_tasks(
    names: list[str], seed: int, qa_paths: dict[str, str | None]
) -> tuple[dict[str, TaskSpec], dict[str, str]]:
    """The built-in generator's specs of the tasks of the set it can score, and those it cannot ({task: why}: qa_1/qa_2
    without their local SQuAD/HotpotQA files); refused when none is left."""
    missing = unscorable_qa(names, qa_paths)
    runnable = [t for t in names if t not in missing]
    if not runnable:
        raise UserError(f"no task of the set can be scored: {'; '.join(f'{t}: {w}' for t, w in missing.items())}")
    specs = task_specs(seed, {t: load_qa(qa_paths[t], t) for t in QA_FORMATS if t in runnable})
    return {t: specs[t] for t in runnable}, missing


def too_short(
    specs: dict[str, TaskSpec], lengths: list[int], num_samples: int, seed: int, encoder
) -> dict[str, tuple[int, int]]:
    """{task: (the shortest of `lengths` too short for it, the tokens its samples need there)} for every task with
    a sample whose prompt with an empty haystack, plus its generation, does not fit in a length: exactly the samples
    `tasks.generate` refuses, since a prompt only grows with its haystack. Found in a fraction of a second, before any
    sample is generated, so that the refusal names where the lengths came from and no sample is generated in vain."""
    count = _counter(encoder)
    short = {}
    for name, spec in specs.items():
        for length in sorted(lengths):
            need = max(
                count(build_sample(spec, seed, length, i, num_samples, 0).prompt)  # as the generator draws it
                for i in range(num_samples)
            )
            if need + spec.max_new_tokens > length:
                short[name] = (length, need + spec.max_new_tokens)
                break
    return short


def shortfall(short: dict[str, tuple[int, int]]) -> str:
    """`too_short`'s findings in words: what each task needs at the length too short for it."""
    tasks = ", ".join(f"{t} ({need:,} tokens at {length})" for t, (length, need) in short.items())
    return f"too short for the prompt and generation of {tasks}, with an empty haystack"


def offline_suite(
    specs: dict[str, TaskSpec], missing: dict[str, str], lengths: list[int], num_samples: int, seed: int, encoder
) -> Suite:
    """The built-in generator's samples of the tasks `offline_tasks` found scorable (`missing`: those it did not)."""
    count = _counter(encoder)
    sources: list[list[Sample]] = []
    with counted_bar() as bar:
        job = bar.add_task("generating task samples", total=len(specs) * len(lengths))
        for spec in specs.values():
            for length in lengths:
                sources.append(generate(spec, length, num_samples, seed, count))
                bar.advance(job)
    longest = max(s.num_tokens + s.max_new_tokens for src in sources for s in src)
    return Suite(
        OFFLINE_LABEL, sources, lengths, longest, [{"task": t, "length": None, "why": w} for t, w in missing.items()]
    )


def ruler_suite(
    root: Path, names: list[str], lengths: list[int] | None, limit: int | None, encoder: ruler.PromptEncoder
) -> Suite:
    """RULER's own prepared data under `root` (`<length>/data/<task>/validation.jsonl`): every length found there,
    or `lengths`; the first `limit` samples of each file, or all of them as RULER scores them, their prompts counted
    by `encoder`."""
    found = ruler.data_lengths(root)
    wanted = lengths or found
    if not wanted:
        raise UserError(
            f"--ruler-data {root}: no length directories (<length>/data/<task>/{ruler.SUBSET_FILE}); "
            f"pass the folder RULER's scripts/run.sh fills, <ROOT_DIR>/<model>/synthetic"
        )
    files: list[ruler.TaskFile] = []
    not_scored: list[dict] = []
    notes: dict[str, str] = {}
    absent: dict[str, list[int]] = {}
    present = [L for L in wanted if L in found]
    not_scored += [
        {"task": None, "length": L, "why": f"no directory {root / str(L)}"} for L in wanted if L not in found
    ]
    with counted_bar() as bar:
        job = bar.add_task("reading RULER data", total=len(names) * len(present))
        for length in present:
            for task in names:
                path = ruler.task_file(root, length, task)
                if path is None:
                    absent.setdefault(task, []).append(length)
                else:
                    scanned = ruler.scan_task(path, task, length, limit, encoder)
                    if len(scanned):
                        files.append(scanned)
                    else:
                        not_scored.append({"task": task, "length": length, "why": f"{path}: no samples (empty file)"})
                    if scanned.note:
                        notes[f"{task} at {length}"] = scanned.note
                bar.advance(job)
    for task, missing in absent.items():
        where = f"{root}/<length>/data/{task}/{ruler.SUBSET_FILE}"
        if len(missing) == len(present):
            not_scored.append({"task": task, "length": None, "why": f"no data at any length (expected {where})"})
        else:
            not_scored += [{"task": task, "length": L, "why": f"no file (expected {where})"} for L in missing]
    if not files:
        raise UserError(
            f"--ruler-data {root}: no RULER data for tasks {', '.join(names)} at lengths "
            f"{', '.join(map(str, wanted))}; expected <length>/data/<task>/{ruler.SUBSET_FILE}"
        )
    scored_lengths = sorted({f.length for f in files})
    not_scored += [
        {"task": None, "length": L, "why": "no data for any task of the set"}
        for L in present
        if L not in scored_lengths
    ]
    longest = max(max(f.num_tokens) + ruler.TASKS[f.task].max_new_tokens for f in files)
    return Suite(f"RULER (NVIDIA/RULER data in {root})", files, scored_lengths, longest, not_scored, notes)


def _json_table(table: dict) -> dict:
    return {t: {str(L): v for L, v in per.items()} for t, per in table.items()}


def _hf_answers(model, tokenizer, encoder, plan, ends, cache):
    """Answers a batch of samples one by one (lazily, so each is recorded as soon as it is made) with the HF model
    under a generation plan, in one cache allocated for the checkpoint."""
    return lambda batch: (greedy_generate(model, tokenizer, encoder, s, plan, ends, cache) for s in batch)


def _vllm_answers(generator, tokenizer, encoder):
    def answer(batch):
        new = generator.greedy(
            [encoder.encode(s.prompt, specials=True) for s in batch], [s.max_new_tokens for s in batch]
        )
        return [
            tokenizer.decode(until_answered(tokenizer, s, ids), skip_special_tokens=True) for s, ids in zip(batch, new)
        ]

    return answer


def score_checkpoints(
    tgt: Target,
    suite: Suite,
    tokenizer,
    encoder,
    device: str,
    heldout,
    kept: Kept,
    backend: str = "hf",
    anchor_id: int | None = None,
):
    """Greedy answers of every checkpoint to every sample: ({checkpoint: {task: {length: [metric]}}}, perplexity per
    checkpoint {checkpoint: {length: ppl}} at the suite's lengths that fit the held-out window and the window itself,
    notes, how generation held its memory per checkpoint); every prediction goes to `kept.predictions` as it is made,
    and what an interrupted evaluation under the same settings left (`kept`) is used, not measured again: a
    checkpoint with every answer and its perplexity kept is not even loaded. `backend`: "hf" (the planned generation
    of lctrain.eval.generation) or "vllm". `anchor_id`: the anchor, which ends a generation too: training taught the
    model to predict it where a document ends (`lctrain.attention.modes.shifted_labels`)."""
    # transformers and eval.generation (torch) on use (start-up time)
    from transformers import AutoConfig

    from lctrain.eval.generation import VllmGenerator, plan_for, planned_cache, stop_ids

    per_sample: dict[str, dict[str, dict[int, list[float]]]] = {}
    ppl: dict[str, dict[int, float]] = {}
    notes: dict[str, str] = {}
    memory: dict[str, str] = {}
    with _appending(kept.predictions) as pred_file, counted_bar() as bar:
        job = bar.add_task("evaluating", total=len(tgt.checkpoints) * sum(len(src) for src in suite.sources))
        for ckpt_name, ckpt_dir in tgt.checkpoints:
            bar.update(job, description=f"evaluating {ckpt_name}")
            batches = [list(src) for src in suite.sources]  # one task file at a time: vLLM batches within it
            fresh = [
                [s for s in batch if (ckpt_name, s.task, s.length, s.index) not in kept.answers] for batch in batches
            ]
            model = generator = cache = answer = None
            if any(fresh):
                ends = stop_ids(ckpt_dir, tokenizer.eos_token_id, anchor_id)
                if backend == "vllm":
                    generator = VllmGenerator(ckpt_dir, suite.longest, ends)
                    memory[ckpt_name] = generator.describe()
                    answer = _vllm_answers(generator, tokenizer, encoder)
                else:
                    model = load_model(ckpt_dir, device)
                    plan = plan_for(model, suite.longest)  # stops here, before any answer, when the longest cannot fit
                    memory[ckpt_name] = plan.describe()
                    cache = planned_cache(model, plan)  # allocated (and page-locked) once for every sample
                    answer = _hf_answers(model, tokenizer, encoder, plan, ends, cache)
            else:
                memory[ckpt_name] = "every answer kept from the interrupted evaluation"
            model_config = model.config if model is not None else AutoConfig.from_pretrained(str(ckpt_dir))
            limit = getattr(model_config, "max_position_embeddings", None)
            # the last generated token is never read back: a RULER sample of Llama-2's 4096 tokens plus its BOS
            # takes positions 0-4095
            positions = suite.longest - 1
            if limit and positions > limit:
                notes[f"{ckpt_name}: max_position_embeddings"] = (
                    f"{limit} < the {positions} positions the longest sample takes (its prompt and generation but the "
                    f"last token): scores beyond it measure extrapolation"
                )
            table = per_sample.setdefault(ckpt_name, {})
            for batch, todo in zip(batches, fresh):
                made = dict(zip(((s.task, s.length, s.index) for s in todo), answer(todo))) if todo else {}
                for s in batch:
                    prediction = made.get((s.task, s.length, s.index))
                    if prediction is not None:
                        record = {
                            "checkpoint": ckpt_name,
                            "task": s.task,
                            "length": s.length,
                            "index": s.index,
                            "tokens": s.num_tokens,
                            "answers": list(s.answers),
                            "prediction": prediction,
                            "score": scoring.sample_score(s.metric, s.answers, prediction),
                        }
                        with writing(kept.predictions, "eval's predictions"):
                            pred_file.write(json.dumps(record) + "\n")
                            pred_file.flush()  # whole lines, for the next evaluation should this one be stopped
                    else:
                        record = kept.answers[(ckpt_name, s.task, s.length, s.index)]
                    table.setdefault(s.task, {}).setdefault(s.length, []).append(record["score"])
                    bar.advance(job)
            if generator is not None:
                generator.close()
            if cache is not None:
                cache.close()
            if heldout.rows and ckpt_name in kept.perplexity:
                ppl[ckpt_name] = kept.perplexity[ckpt_name]
            elif heldout.rows:
                model = model or load_model(ckpt_dir, device)
                ppl_lengths = perplexity_lengths(heldout.window, suite.lengths)
                ppl[ckpt_name] = perplexity_by_length(model, heldout.packed, heldout.rows, ppl_lengths)
                kept.add_perplexity(ckpt_name, ppl[ckpt_name])
            del model, answer, cache  # the closure holds the model and cache too: all go before the next loads
    return per_sample, ppl, notes, memory


class EvalLock(RunLock):
    """Held by `lctrain eval` for its whole evaluation into `out_dir` (the run lock's primitive, its file removed at
    the end): a second evaluation into the same directory is refused in one line naming the first. Two at once
    rewrote each other's predictions and resume state, and the second to finish found its predictions renamed away."""

    def __init__(self, out_dir: Path):
        super().__init__(out_dir, "lctrain eval", name=EVAL_LOCK, remove=True)

    def busy(self, holder: str, pid: str) -> str:
        return (
            f"{self.path.parent}: another evaluation is writing its report there, {holder}; wait for it to finish "
            f"or stop it (kill {pid}), or evaluate into another --out"
        )

    def cannot_create(self, e: OSError) -> UserError:
        return WriteFailed(self.path.parent, "eval's output directory", e.strerror or str(e), _or_elsewhere(e))


@contextmanager
def evaluating(tgt: Target, out_dir: Path) -> Iterator[None]:
    """Held by an evaluation (RULER's, the harness's) from start to end: its output directory's `EvalLock`, and its
    `Reading` mark on the run it scores, with which `lctrain train --force` refuses to delete the run's exports and
    report under it. A model directory is refused as the output directory: the report went among the model's files."""
    if _is_model_dir(out_dir):
        raise UserError(
            f"--out {out_dir}: a model directory (it holds config.json); the evaluation would write its report among "
            f"the model's files: pick another directory for --out (by default {RunDir(tgt.path).eval_dir})"
        )
    reading = Reading(tgt.path, "lctrain eval", f"the evaluation into {out_dir.absolute()}")
    with reading if tgt.kind == "run" else nullcontext(), EvalLock(out_dir):
        yield


@contextmanager
def eval_writes(out_dir: Path) -> Iterator[None]:
    """A write into eval's output directory that the machine refused (`errors.writing`'s `WriteFailed`) says that the
    report can go elsewhere (--out DIR), and names the file, not its temporary."""
    try:
        yield
    except WriteFailed as e:
        number = getattr(e.__cause__, "errno", None)
        if number not in _ELSEWHERE or not e.path.is_relative_to(out_dir):
            raise
        path = e.path.with_name(e.path.name.removeprefix(TEMPORARY_PREFIX))
        raise WriteFailed(path, e.what, e.cause, _or_elsewhere(e.__cause__)) from e.__cause__


def _or_elsewhere(e: BaseException) -> str:
    return f"{remedy_of(e)} (eval's: --out DIR)"


@contextmanager
def _appending(path: Path) -> Iterator:
    with writing(path, "eval's predictions"):
        f = path.open("a")
    with f:
        yield f


def plot(results: dict, path: Path) -> None:
    """ruler.png, replaced whole: a full disk leaves the earlier one or none, never a torn image."""
    # reports.plots imports matplotlib: on use (start-up time)
    from lctrain.reports.plots import plot_ruler

    tmp = temporary_of(path)
    with writing(path, "eval's plot"):
        try:
            plot_ruler(results, tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def unfinished_note(tgt: Target, training: dict) -> str:
    """The note of a run evaluated before its last step: resume it, or, while it is being trained (its lock held),
    wait for it."""
    done = (
        f"trained {training['steps']} of its {training['train_steps']} steps (train.steps), last evaluation "
        f"checkpoint {tgt.checkpoints[-1][0]}: not the finished run's scores"
    )
    holder = lock_holder(tgt.path)
    if holder is None:
        return f"{done}; `lctrain resume {tgt.path}`, then evaluate again"
    pid = f" (pid {holder['pid']})" if "pid" in holder else ""
    return f"{done}; still training{pid}: evaluate again when it ends"


def rope_fp32_note(tgt: Target, device: str) -> str | None:
    """The note of a run trained with `model.rope_fp32` evaluated in 16 bits: eval loads its exports as transformers
    and vLLM do, whose rotation runs in the model's dtype."""
    dtype = str(eval_dtype(device)).removeprefix("torch.")
    if tgt.kind != "run" or not tgt.cfg.model.rope_fp32 or dtype == "float32":
        return None
    return (
        f"the run rotated q/k in fp32 in training (model.rope_fp32); eval runs its exports as transformers and vLLM "
        f"do, rotating them in {dtype}: the scores are of the model as others run it"
    )


def evaluate(
    tgt: Target,
    *,
    lengths: list[int] | None = None,
    tasks: list[str] | None = None,
    exclude: list[str] | None = None,
    samples: int | None = None,
    ruler_data: str | None = None,
    squad: str | None = None,
    hotpotqa: str | None = None,
    out: str | Path | None = None,
    device: str | None = None,
    ppl_data: str | None = None,
    backend: str = "hf",
    anchor_prompts: bool | None = None,
) -> Path:
    """Score every checkpoint of the resolved run or model (`resolve_target`) on RULER's data (`ruler_data` or
    eval.ruler_data) or else the offline RULER-style suite; write results.json, predictions.jsonl and ruler.png to
    `out` (default RUN_DIR/eval or MODEL_DIR/eval) and print the report. `lengths`, `tasks` and `exclude` default to
    the config's eval section; `anchor_prompts` (default eval.anchor_prompts): RULER's prompts start with the anchor
    also where the tokenizer puts no BOS before a text (`ruler.PromptEncoder`). Returns the output directory."""
    if backend not in ("hf", "vllm"):
        raise UserError(f"--backend {backend}: choose hf (lctrain's planned generation) or vllm")
    if backend == "vllm":  # refused before any sample is made
        from lctrain.eval.generation import NO_VLLM

        try:
            importlib.import_module("vllm")
        except ImportError:
            raise UserError(NO_VLLM) from None
    ev = tgt.cfg.eval
    if samples is not None and samples < 1:
        raise UserError(f"--samples {samples}: need at least 1 sample per task and length")
    names, excluded = ruler.select_task_set(tasks or ev.tasks, exclude if exclude is not None else list(ev.exclude))
    data_dir = ruler_data or _setting_path(tgt.cfg, ev.ruler_data)
    if anchor_prompts is not None and not data_dir:  # the config's value is for the runs given RULER's data
        flag = "--anchor-prompts" if anchor_prompts else "--ruler-prompts"
        raise UserError(
            f"{flag}: the offline suite's prompts start with the anchor, as the training data's documents; it changes "
            f"how RULER's own data (--ruler-data) is encoded"
        )
    anchored = ev.anchor_prompts if anchor_prompts is None else anchor_prompts
    out_dir = Path(out) if out else RunDir(tgt.path).eval_dir
    dev = pick_device(device)
    # the offline suite's lengths are refused before its samples are generated; RULER data's once read (a length
    # directory it scores, its samples' own token counts), before any model loads
    asked = None if data_dir else offline_lengths(lengths, ev)
    if asked is not None:
        refuse_unrunnable(tgt, asked, max(asked.lengths), backend, dev)

    # one evaluation at a time writes a report: two at once renamed each other's predictions away
    with evaluating(tgt, out_dir), eval_writes(out_dir), ExitStack() as reading:
        tokenizer = load_eval_tokenizer(tgt.checkpoints[0][1], tgt.cfg, tgt.tokenizer_fallback)
        anchor = eval_anchor(tgt.checkpoints[0][1], tgt.cfg, tokenizer)
        # before the task samples are made: a --ppl-data that is no dataset is refused at once
        heldout = select_heldout(tgt, ppl_data, tokenizer)
        if heldout.path is not None:  # `prepare --force` of it meanwhile is refused, as while a training reads it
            reading.enter_context(Reading(heldout.path, "lctrain eval", f"the evaluation into {out_dir.absolute()}"))
        if data_dir:
            encoder = ruler.PromptEncoder(tokenizer, anchor, anchored=anchored)
            suite = ruler_suite(Path(data_dir), names, lengths or None, samples, encoder)
            found = Lengths(suite.lengths, "--lengths" if lengths else f"--ruler-data {data_dir}: length", "--lengths")
            refuse_unrunnable(tgt, found, suite.longest, backend, dev)
        else:
            encoder = text_encoder(tokenizer).prompted(anchor)
            specs, missing = offline_tasks(names, ev.seed, qa_files(tgt.cfg, squad, hotpotqa))
            num_samples = samples if samples is not None else ev.samples_per_task
            short = too_short(specs, asked.lengths, num_samples, ev.seed, encoder)
            if short:
                raise UserError(
                    f"{asked.source} {','.join(map(str, asked.lengths))}: {shortfall(short)}; use {asked.option} of "
                    f"at least {max(need for _, need in short.values())}, or --exclude {','.join(short)}"
                )
            suite = offline_suite(specs, missing, asked.lengths, num_samples, ev.seed, encoder)
        prompt_start = encoder.prompt_start if data_dir else ruler.PROMPT_START_ANCHOR
        # taken before any answer: the exports the scores are of, as `resolve_target` verified them
        digests = {name: export_digest(path) for name, path in tgt.checkpoints}
        key = {
            "target": str(tgt.path),
            "checkpoints": [[name, checkpoint_files(path)] for name, path in tgt.checkpoints],
            "suite": suite.label,
            "task_set": names,
            "lengths": suite.lengths,
            "samples": samples,
            "eval": {k: v for k, v in ev.model_dump(mode="json").items() if k not in ("tasks", "exclude", "lengths")},
            "data": [str(data_dir) if data_dir else None, squad, hotpotqa, ppl_data],
            "backend": backend,
            "device": dev,
            "anchor": anchor.record(),
            "prompt_start": prompt_start,
            "heldout": [str(heldout.path) if heldout.path else None, heldout.rows],
        }
        kept = Kept.read(out_dir, out_dir / PARTIAL_PREDICTIONS, key)
        if kept.answers or kept.perplexity:
            print(
                f"resuming the interrupted evaluation in {out_dir}: {len(kept.answers)} answers and the perplexity of "
                f"{len(kept.perplexity)} checkpoint(s) kept, made under the same settings",
                flush=True,
            )
        per_sample, ppl, notes, memory = score_checkpoints(
            tgt, suite, tokenizer, encoder, dev, heldout, kept, backend, anchor.id
        )
        rope_note = rope_fp32_note(tgt, dev)
        if rope_note:
            notes["model.rope_fp32"] = rope_note
        training = training_progress(tgt)
        if training and not training["finished"]:
            notes["unfinished run"] = unfinished_note(tgt, training)

        scores = {
            c: {t: {L: scoring.task_score(v) for L, v in per.items()} for t, per in tb.items()}
            for c, tb in per_sample.items()
        }
        average = scoring.average_checkpoints(scores)
        task_mean = {c: scoring.mean_over_tasks(tb) for c, tb in scores.items()}
        task_mean["average"] = scoring.mean_over_tasks(average)
        results = {
            "suite": suite.label,
            "not_scored": suite.not_scored,
            "task_set": names,
            "excluded": excluded,
            "target": str(tgt.path),
            "kind": tgt.kind,
            "training": training,
            "ruler_data": str(data_dir) if data_dir else None,
            "checkpoints": [c for c, _ in tgt.checkpoints],
            # {checkpoint: `export_digest`, None for an export without a record}: which weights were scored
            "export_records": digests,
            "device": dev,
            "anchor": anchor.record(),
            "prompt_start": prompt_start,  # what a prompt that does not start a document is given first
            "tasks": [t for t in names if t in average],
            "lengths": suite.lengths,
            "samples_per_task": scored_samples(suite),
            "seed": None if data_dir else ev.seed,
            "notes": {**suite.notes, **notes},
            "generation_backend": backend,
            "generation_memory": memory,
            "scores": {c: _json_table(tb) for c, tb in scores.items()},
            "average": _json_table(average),
            "task_mean": _json_table(task_mean),
            "overall": sum(task_mean["average"].values()) / len(task_mean["average"]),
        }
        whole = {c: per[heldout.window] for c, per in ppl.items()}
        results["perplexity"] = {
            "data": str(heldout.path) if heldout.path else None,
            "windows": len(heldout.rows),
            # which windows: they depend on the run's seed and train.steps (perplexity.heldout_rows), so runs of other
            # seeds score other text, which `lctrain report` notes
            "rows": heldout.rows,
            "data_fingerprint": heldout.packed.manifest.data_fingerprint if heldout.packed is not None else None,
            "heldout_available": heldout.available,
            "per_checkpoint": whole,  # the whole windows
            "average": sum(whole.values()) / len(whole) if whole else None,
            "note": heldout.note,
            "window": heldout.window,
            # the first L tokens of each window (lctrain.eval.perplexity): {checkpoint: {L: ppl}}
            "per_length": {c: {str(L): v for L, v in per.items()} for c, per in ppl.items()},
        }
        # an evaluation stopped before this point leaves the earlier one's results.json and predictions.jsonl as
        # they were, a pair; written as it goes, predictions.jsonl was cut to the new run's first lines beside the
        # old results
        with writing(out_dir / "predictions.jsonl", "eval's predictions"):
            (out_dir / PARTIAL_PREDICTIONS).replace(out_dir / "predictions.jsonl")
        replace_file(out_dir / "results.json", json.dumps(results, indent=2), "eval's results")
        kept.finish()
        try:
            plot(results, out_dir / PLOT)
        except WriteFailed:
            print_report(results, out_dir, plotted=False)  # the scores are saved: show them before the error
            raise
        print_report(results, out_dir)
        return out_dir


def not_scored_lines(results: dict) -> list[str]:
    """What of the task set the scores leave out, one line each: the top of the report."""
    # matplotlib, via reports.plots, on use (start-up time)
    from lctrain.reports.plots import length_label

    lines = []
    for e in results["not_scored"]:
        what = e["task"] or "every task"
        at = f" at {length_label(e['length'])}" if e["length"] is not None else ""
        lines.append(f"{what}{at}: {e['why']}")
    return lines


def print_report(results: dict, out_dir: Path, plotted: bool = True) -> None:
    # matplotlib, via reports.plots, on use (start-up time)
    from lctrain.reports.plots import length_label

    console = plain_console()
    console.print(f"[bold]{escape(results['suite'])}[/bold]")
    task_set = results["task_set"]
    excluded = f" (excluded: {', '.join(results['excluded'])})" if results["excluded"] else ""
    console.print(f"task set: {len(task_set)} of RULER's 13 tasks{excluded}")
    missing = not_scored_lines(results)
    if missing:
        console.print(
            f"[bold red]NOT SCORED: {len(missing)} part{'s' * (len(missing) > 1)} of the task set; the means "
            f"below leave {'them' if len(missing) > 1 else 'it'} out:[/bold red]"
        )
        for line in missing:
            console.print(f"[red]  {escape(line)}[/red]")
    lengths = [str(L) for L in results["lengths"]]
    n = len(results["checkpoints"])
    title = f"averaged over {n} checkpoint{'s' * (n > 1)} ({', '.join(results['checkpoints'])})"
    table = Table(title=title)
    table.add_column("task")
    for L in results["lengths"]:
        table.add_column(length_label(L), justify="right")
    for t in results["tasks"]:
        row = results["average"][t]
        table.add_row(t, *(f"{row[L]:.2f}" if L in row else "-" for L in lengths))
    table.add_row("[bold]mean[/bold]", *(f"[bold]{results['task_mean']['average'][L]:.2f}[/bold]" for L in lengths))
    if missing:
        table.add_row(
            "tasks in the mean",
            *(f"{sum(L in results['average'][t] for t in results['tasks'])}/{len(task_set)}" for L in lengths),
        )
    console.print(table)
    if n > 1:
        per = Table(title="mean over tasks, per checkpoint")
        per.add_column("checkpoint")
        for L in results["lengths"]:
            per.add_column(length_label(L), justify="right")
        for c in results["checkpoints"]:
            per.add_row(c, *(f"{results['task_mean'][c][L]:.2f}" for L in lengths))
        console.print(per)
    for what, note in results["notes"].items():
        console.print(f"note: {escape(what)}: {escape(note)}")
    for ckpt, plan in results["generation_memory"].items():
        console.print(f"generation memory, {escape(ckpt)}: {escape(plan)}")
    ppl = results.get("perplexity") or {}
    if ppl.get("note"):
        console.print(f"perplexity: {ppl['note']}")
    for c, v in (ppl.get("per_checkpoint") or {}).items():
        console.print(f"perplexity {c}: {v:.3f} on {ppl['windows']} held-out windows of {ppl['data']}")
        shorter = {L: p for L, p in ppl["per_length"][c].items() if int(L) != ppl["window"]}
        if shorter:
            at = ", ".join(f"{p:.3f} at {length_label(int(L))}" for L, p in shorter.items())
            console.print(f"  on the first L tokens of each window: {at}")
    console.print(f"wrote {out_dir}/results.json, predictions.jsonl{', ' + PLOT if plotted else ''}")
