"""`lctrain experiment extend`: the paper's headline comparison (Table 5: full attention, intra-document attention and
AnchorAttention extending one model's context with the same data, tokens and schedule), small and offline
(docs/experiment.md): the example model SmolLM2-135M-Instruct extended 4x, 8K -> 32K, on Python's shipped text.

Every option is checked before anything is written (the steps against the windows the token budget makes, the
checkpoints against the steps), and the evaluation's task set and lengths against the model's tokenizer before any
run is trained (`check_evaluation`): refused later, a bad value left files behind, or trained every run before each
evaluation failed, again at every rerun.

Stages, each said as it starts and skipped when a rerun finds it done:
1. inputs: the example model and the corpus under OUT, where the bundled configs `smollm2_32k_<mode>` look for them
   (`--model DIR`: a model directory `lctrain example-model` already wrote);
2. prepare: once, into OUT/prepared/<data fingerprint>: the runs' data settings are one, so every run reads the same
   windows (each run's recorded config carries that fingerprint, and `train` refuses data prepared otherwise);
3. sizing, with `--train-seconds` only: a few steps of the first mode measure tokens/s, which picks the steps;
4. train: every mode and seed, `lctrain train` (`lctrain resume` for a run stopped after a checkpoint) in a fresh
   process, into OUT/runs/<mode>_s<seed>;
5. eval: `lctrain eval` of every run in a fresh process: its evaluation checkpoints (the last steps), the config's
   needle tasks and lengths, held-out perplexity, under the experiment's eval settings (`--eval-lengths`, `--set
   eval.*`); training reads none of them, so a rerun that changes only those evaluates the trained runs again;
6. report: `lctrain report`'s comparison of the runs (`lctrain.reports.compare`), in OUT/report.

Every subprocess is given `workdir=OUT`, so the bundled configs' relative paths resolve under OUT from anywhere.
OUT/experiment.json records the plan, the prepared dataset, the sizing and every run, a run's failed stage included.
A stage that fails stops the experiment; with `--keep-going` a run's training or evaluation that fails is said,
recorded and left out, the other runs go on and are reported, and the command still ends in an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import statistics
import sys
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import psutil

from lctrain import example_model
from lctrain.config import (
    Config,
    config_fingerprint,
    data_dir,
    data_fingerprint,
    load_config,
    max_steps,
    settings,
    settings_changes,
    shown_changes,
)
from lctrain.data.shipped_text import write_jsonl
from lctrain.data.store import open_packed
from lctrain.errors import RunFailed, UserError, check_creatable
from lctrain.eval import ruler
from lctrain.eval.runner import offline_tasks, qa_files, shortfall, too_short
from lctrain.eval.score import DEFAULT_LAST
from lctrain.files import replace_file
from lctrain.lifetime import STOPPED, Terminated, death_of, signal_name, supervise
from lctrain.reports.compare import print_report, rewritten_exports, write_report
from lctrain.reports.trained_windows import Windows, trained_windows
from lctrain.rundir import RunDir
from lctrain.tokenizer import load_tokenizer, resolve_anchor, text_encoder
from lctrain.train import checkpoint as ckpt

MODES = ("full", "intra_doc", "anchor")
# what --modes may add: the paper's "+ Reset" row of Table 5 (in fp32, as on a CPU, it trains as intra_doc does while
# no document is cut into interleaved chunks, the bundled configs' data: the mask is the same, the positions differ
# by one offset per document and RoPE is relative; the paper's difference comes from bf16 rounding at large
# positions. The report says when its runs met these conditions: lctrain.reports.compare._same_as_reset)
OPTIONAL_MODES = ("intra_doc_reset",)
CONFIG = "smollm2_32k_{mode}"  # the bundled configs; every run is one of them with the experiment's overrides
MODEL_DIR = "models/smollm2-135m"  # relative to OUT, where the bundled configs look
CORPUS = "corpus/shipped.jsonl"
STATE_FILE = "experiment.json"
REPORT_DIR = "report"
MEASURE_RUN = "measure"
MEASURE_STEPS = 4  # the first step pays for warm-up: the sizing times the others
# On a CPU: fp32 (no bf16 master weights to keep, so no ZeRO; the loss comparable with transformers' fp32 forward)
# and the CPU attention engine.
CPU_SETTINGS = ("model.dtype=float32", "parallel.zero_stage=0", "attention.engine=sdpa")
# The paper saves an evaluation checkpoint every 10 of its 2000 steps: a 200th of the run apart (at least 1 step).
PAPER_SPACING = 200
RERUN = "run the same `lctrain experiment extend` again"


def say(stage: str, text: str) -> None:
    print(f"[experiment] {stage}: {text}", flush=True)


class StageFailed(UserError):
    """A stage's command that ended badly; `failure` says which and how (what --keep-going records of a run). Its
    exit code is the stage's own where that said "fix the command" (2), else 1: the stage ran and failed (a NaN, a
    rank out of memory, killed), as `RunFailed` says."""

    def __init__(self, failure: str, stage_code: int | None = None):
        refused = stage_code == UserError.exit_code
        # the same command would meet the same refusal: what the stage named has to change first
        then = "correct what its error names, then run `lctrain experiment extend` again" if refused else RERUN
        super().__init__(f"{failure}; {then} to continue from what is finished")
        self.failure = failure
        self.exit_code = UserError.exit_code if refused else RunFailed.exit_code


def lctrain_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lctrain.cli", *args]


def set_args(overrides: list[str]) -> list[str]:
    return [a for item in overrides for a in ("--set", item)]


def default_eval_lengths(seq_len: int) -> list[int]:
    """The native length of a 4x extension, 2x and 4x: 8K, 16K and 32K for 32K windows."""
    return [seq_len // 4, seq_len // 2, seq_len]


def checkpoint_spacing(steps: int, checkpoints: int) -> tuple[int, int]:
    """(checkpoint.hf_every, checkpoint.hf_last): `checkpoints` evaluation checkpoints ending at the last step, the
    paper's spacing (a 200th of the run) when the run is long enough, every step otherwise."""
    if checkpoints < 1:
        raise UserError(f"--checkpoints {checkpoints}: evaluate at least 1 checkpoint")
    if checkpoints > steps:
        raise UserError(f"--checkpoints {checkpoints}: a run of {steps} step(s) has at most {steps} checkpoints")
    every = max(1, min(steps // PAPER_SPACING, (steps - 1) // max(checkpoints - 1, 1)))
    return every, every * checkpoints


def steps_for_tokens(tokens: int, tokens_per_step: int) -> int:
    """Whole optimizer steps of `tokens_per_step` in `tokens` (rounded down, so a run never exceeds it)."""
    steps = tokens // tokens_per_step
    if steps < 1:
        raise UserError(f"--tokens {tokens:,}: less than one step of {tokens_per_step:,} tokens")
    return steps


def sized_steps(seconds: float, tokens_per_s: float, tokens_per_step: int, checkpoints: int, limit: int) -> int:
    """Steps that fill `seconds` of training at the measured rate, at least `checkpoints`, at most `limit`."""
    return min(limit, max(checkpoints, math.floor(seconds * tokens_per_s / tokens_per_step)))


@dataclass(frozen=True)
class Experiment:
    """What the command was asked for; every config it runs derives from it."""

    out: Path
    seq_len: int
    modes: tuple[str, ...]
    seeds: int
    checkpoints: int
    eval_lengths: tuple[int, ...]
    device: str  # cpu | cuda
    model: Path | None  # an existing example model directory, else OUT/MODEL_DIR
    overrides: tuple[str, ...]  # the user's --set, applied to every run

    def shared_overrides(self) -> list[str]:
        """Every config's: prepare's and each run's."""
        model = [f"model.name_or_path={self.model}", f"data.tokenizer={self.model}"] if self.model else []
        return [
            f"workdir={self.out}",
            *model,
            f"data.seq_len={self.seq_len}",
            f"eval.lengths={json.dumps(list(self.eval_lengths))}",
            *(CPU_SETTINGS if self.device == "cpu" else ()),
            *self.overrides,
        ]

    def config(self, mode: str, extra: list[str] | tuple[str, ...] = ()) -> Config:
        return load_config(CONFIG.format(mode=mode), [*self.shared_overrides(), *extra])

    def runs(self) -> list[tuple[str, int]]:
        return [(mode, seed) for seed in range(self.seeds) for mode in self.modes]

    def run_dir(self, mode: str, seed: int) -> Path:
        return self.out / "runs" / f"{mode}_s{seed}"

    def run_overrides(self, mode: str, seed: int, steps: int) -> list[str]:
        every, last = checkpoint_spacing(steps, self.checkpoints)
        return [
            f"name={mode}_s{seed}",
            *self.description(mode, seed),
            f"seed={seed}",
            f"train.run_dir={self.run_dir(mode, seed)}",
            f"train.steps={steps}",
            f"checkpoint.hf_every={every}",
            f"checkpoint.hf_last={last}",
        ]

    @cached_property
    def model_name(self) -> str:
        """The trained model's directory name (every mode trains the same model), read from the config once."""
        return Path(self.config(self.modes[0]).model.name_or_path).name

    def description(self, mode: str, seed: int) -> list[str]:
        """The run's `description` override, unless the user set one: the bundled config's names SmolLM2 at 32K,
        which another model or --seq-len would make untrue in the run's config.yaml."""
        if any(o.split("=", 1)[0].strip() == "description" for o in self.overrides):
            return []
        from lctrain.reports.plots import length_label

        windows = length_label(self.seq_len)
        said = f"{self.model_name} at {windows} windows, {mode} attention, seed {seed} (lctrain experiment extend)"
        return [f"description={json.dumps(said)}"]

    def env(self) -> dict:
        # a CPU experiment trains on the CPU even where CUDA is present (training takes CUDA whenever it sees it)
        return {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if self.device == "cpu" else dict(os.environ)

    def run(self, what: str, args: list[str]) -> None:
        """One lctrain command in a fresh process, its output passed through; a failure is one line. SIGTERM is
        passed on to it, and this waits for it to stop where it keeps its work (training: a checkpoint)."""
        try:
            rc = supervise(lctrain_command(*args), self.env(), on_terminate=_pass_sigterm)
        except Terminated:
            raise Terminated(f"{what} stopped by SIGTERM; {RERUN} to continue from what is finished") from None
        if rc == 0:
            return
        if rc < 0:
            how = death_of(signal_name(-rc))
        elif rc in STOPPED:  # stopped by someone else: it said nothing, being supervised
            how = f"was stopped by {STOPPED[rc]} (from outside: a scheduler or a user)"
        else:
            how = f"failed (exit code {rc}; its output is above)"
        raise StageFailed(f"{what} {how}", rc)


def _pass_sigterm(stage: psutil.Process) -> None:
    stage.send_signal(signal.SIGTERM)


class State:
    """OUT/experiment.json: written after every stage, so a rerun and a reader see what is done."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            self.data = {}  # a torn file records nothing a rerun can trust: every stage checks its own outputs

    def save(self) -> None:
        replace_file(self.path, json.dumps(self.data, indent=2), "the experiment's state")


def ensure_model(exp: Experiment) -> None:
    model = exp.model or exp.out / MODEL_DIR
    if example_model.is_built(model):
        say("inputs", f"example model {model}: present")
    elif exp.model is not None:
        raise UserError(f"--model {model}: not a directory `lctrain example-model` wrote (no {example_model.DONE})")
    else:
        say("inputs", f"building the example model into {model}")
        example_model.build(model)


def ensure_corpus(exp: Experiment) -> None:
    corpus = exp.out / CORPUS
    if corpus.is_file():
        say("inputs", f"corpus {corpus}: present")
    else:
        info = write_jsonl(corpus)
        say("inputs", f"wrote {corpus} (Python {info['python']}, fingerprint {info['fingerprint']})")


def check_evaluation(exp: Experiment, lengths_given: bool) -> None:
    """Refuse, before any run is trained, eval settings that each run's evaluation would refuse once trained (and
    again at every rerun): a task set with nothing to score, or evaluation lengths too short for a task's prompt, in
    this command's own options. Counted with the model's tokenizer and anchor, as `lctrain eval` counts them, before
    the example model is built (a refused command writes nothing); RULER data (`--set eval.ruler_data`) brings its own
    lengths."""
    cfg = exp.config(exp.modes[0])
    ev = cfg.eval
    names, _ = ruler.select_task_set(ev.tasks, list(ev.exclude))
    if ev.ruler_data:
        return
    specs, _ = offline_tasks(names, ev.seed, qa_files(cfg))
    model = exp.model or exp.out / MODEL_DIR
    built = example_model.is_built(model)
    if exp.model is not None and not built:
        return  # not a model `lctrain example-model` wrote: `ensure_model` refuses it
    if not built and cfg.resolve_path(cfg.data.tokenizer) == model:  # the example model is built after this check
        tokenizer = example_model.load_tokenizer()
    else:
        tokenizer = load_tokenizer(cfg.resolve_source(cfg.data.tokenizer))
    encoder = text_encoder(tokenizer).prompted(resolve_anchor(tokenizer, cfg.data.anchor, cfg.data.tokenizer))
    short = too_short(specs, list(exp.eval_lengths), ev.samples_per_task, ev.seed, encoder)
    if not short:
        return
    need = max(n for _, n in short.values())
    leave_out = f"--set eval.exclude=[{','.join(sorted({*ev.exclude, *short}))}]"
    lengths = ",".join(map(str, exp.eval_lengths))
    if lengths_given:
        raise UserError(
            f"--eval-lengths {lengths}: {shortfall(short)}; give --eval-lengths of at least {need}, or leave the "
            f"tasks out ({leave_out})"
        )
    raise UserError(
        f"--seq-len {exp.seq_len}: evaluates at {lengths} (seq_len/4, /2 and seq_len), {shortfall(short)}; use "
        f"--seq-len {4 * need} or more, give --eval-lengths of at least {need}, or leave the tasks out ({leave_out})"
    )


def prepare_once(exp: Experiment, state: State, steps: int | None) -> dict:
    """The one prepared dataset every run reads: {path, data_fingerprint, windows}. `steps`, when already known, only
    keeps prepare's warning about re-read windows to the steps that will run (steps are no data setting)."""
    configs = [exp.config(mode) for mode in exp.modes]
    fingerprints = {data_fingerprint(c.data) for c in configs}
    if len(fingerprints) != 1:  # the modes' configs differ in data settings: the comparison would not be one
        raise UserError(f"the modes' configs prepare different data ({', '.join(sorted(fingerprints))})")
    path = data_dir(configs[0])
    if (path / "manifest.json").is_file():
        say("prepare", f"{path}: present")
    else:
        say("prepare", f"tokenizing and packing the corpus once for every run into {path}")
        known = [f"train.steps={steps}"] if steps is not None else []
        overrides = set_args([*exp.shared_overrides(), *known])
        exp.run("lctrain prepare", ["prepare", "-c", CONFIG.format(mode=exp.modes[0]), *overrides])
    packed = open_packed(path)
    prepared = {"path": str(path), "data_fingerprint": packed.manifest.data_fingerprint, "windows": len(packed)}
    state.data["prepared"] = prepared
    state.save()
    return prepared


def measure_tokens_per_s(exp: Experiment) -> float:
    """Training tokens/s of the first mode (full attention when it runs: the most attention work), timed over the
    steps after the first of a short run in OUT/measure."""
    mode = "full" if "full" in exp.modes else exp.modes[0]
    run = exp.out / MEASURE_RUN
    overrides = [
        *exp.shared_overrides(),
        f"name={MEASURE_RUN}",
        f"train.run_dir={run}",
        f"train.steps={MEASURE_STEPS}",
        "checkpoint.hf_last=0",
        "checkpoint.save_final=false",
    ]
    say("sizing", f"{MEASURE_STEPS} steps of {mode} to measure training throughput ({run})")
    exp.run("the sizing run", ["train", "-c", CONFIG.format(mode=mode), *set_args(overrides), "--force"])
    records = RunDir(run).read_metrics()[1:]
    if not records:
        raise UserError(f"{run}: the sizing run logged no step after the first")
    return statistics.median(float(r["tokens_per_s"]) for r in records)


def step_limit(cfg: Config, windows: int, holding: str, steps: int | None, checkpoints: int) -> int:
    """The most steps that read each of `windows` windows (`holding`: where they are, in words) at most once beside
    the held-out ones; refused when that is fewer than `checkpoints`, or than `steps` when given."""
    batch, held = cfg.train.global_batch, cfg.eval.ppl_windows
    limit = max_steps(windows, held, batch)
    if limit < checkpoints:
        raise UserError(
            f"the {windows} windows {holding} leave {limit} step(s) of {batch} beside {held} held-out windows, fewer "
            f"than --checkpoints {checkpoints}; raise data.token_budget (--set) or lower --seq-len or "
            f"train.global_batch"
        )
    if steps is not None and steps > limit:
        raise UserError(
            f"{steps} steps x {batch} windows read more than the {windows} windows {holding} leave beside {held} "
            f"held out for perplexity: give --steps or --tokens of at most {limit} steps "
            f"({limit * cfg.tokens_per_step:,} tokens), or raise data.token_budget (--set)"
        )
    return limit


def choose_steps(exp: Experiment, state: State, prepared: dict, given: int | None, seconds: float | None) -> int:
    """Steps per run: `given` (--steps, or --tokens in whole steps), else sized from measured throughput, else the
    configs' own; never more than the prepared windows hold beside the held-out ones."""
    cfg = exp.config(exp.modes[0])
    per_step = cfg.tokens_per_step
    chosen = None if seconds is not None else given if given is not None else cfg.train.steps
    limit = step_limit(cfg, prepared["windows"], f"prepared in {prepared['path']}", chosen, exp.checkpoints)
    if seconds is not None:
        recorded = state.data.get("sizing") or {}
        if recorded.get("train_seconds") == seconds and recorded.get("limit") == limit:
            say("sizing", f"{recorded['steps']} steps, as measured before ({recorded['tokens_per_s']:,.0f} tokens/s)")
            return int(recorded["steps"])
        rate = measure_tokens_per_s(exp)
        chosen = sized_steps(seconds, rate, per_step, exp.checkpoints, limit)
        why = "the prepared windows' limit" if chosen == limit else f"{seconds:g} s of training per run"
        say("sizing", f"{rate:,.0f} tokens/s: {chosen} steps of {per_step:,} tokens per run ({why})")
        state.data["sizing"] = {
            "train_seconds": seconds,
            "tokens_per_s": rate,
            "steps": chosen,
            "limit": limit,
            "why": why,
        }
        state.save()
    return chosen


def is_trained(rd: RunDir, steps: int) -> bool:
    records = rd.read_metrics()
    return bool(records) and int(records[-1]["step"]) >= steps and ckpt.latest_checkpoint(rd) is not None


def trained_settings(cfg: Config) -> dict:
    return {section: value for section, value in settings(cfg).items() if section not in ("eval", "description")}


def check_trained_runs(exp: Experiment, steps: int) -> None:
    """Refuse, before anything is recorded or trained, a run directory trained with other settings than the plan's
    (a rerun with other steps, --set or --seq-len): experiment.json must keep describing the runs there."""
    for mode, seed in exp.runs():
        where = exp.run_dir(mode, seed)
        rd = RunDir(where)
        if not rd.is_run():
            continue
        recorded = rd.read_config()
        planned = exp.config(mode, exp.run_overrides(mode, seed, steps))
        # training reads no eval setting: a change of those only is the eval stage's, which evaluates again
        if trained_settings(recorded) != trained_settings(planned):
            raise UserError(
                f"{where}: trained with other settings than this experiment's (config fingerprint "
                f"{config_fingerprint(recorded)[:12]}, now {config_fingerprint(planned)[:12]}: other steps, "
                f"--set or --seq-len?); use another --out, or delete {where}"
            )


def warn_identical_modes(exp: Experiment, steps: int) -> None:
    """Say before training when no window the runs will read holds more than one document: there every mode computes
    the same (`lctrain.reports.trained_windows`), so the runs would differ by nothing but rounding."""
    if len(exp.modes) < 2:
        return
    counted = [
        trained_windows(exp.config(mode, exp.run_overrides(mode, seed, steps)), steps) for mode, seed in exp.runs()
    ]
    found = [w for w in counted if isinstance(w, Windows)]
    read = {r for w in found for r in w.rows}
    if found and not any(w.multi_document for w in found):
        say(
            "train",
            f"warning: none of the {len(read)} windows the runs will train on holds more than one document, so "
            f"{', '.join(exp.modes)} will train identically (one mask, the same positions); read more windows "
            f"(--steps, train.global_batch) or pack more documents per window (a longer --seq-len) for the modes to "
            f"differ",
        )


def train_run(exp: Experiment, rd: RunDir, label: str, args: list[str], steps: int) -> None:
    """One run: skipped when finished, resumed from its checkpoint, else trained (again)."""
    where = rd.path
    if rd.is_run():
        if is_trained(rd, steps):
            say("train", f"{label}: {where} finished, skipped")
        elif ckpt.latest_checkpoint(rd) is not None:
            say("train", f"{label}: resuming {where}")
            exp.run(f"lctrain resume {where}", ["resume", str(where)])
        else:
            say("train", f"{label}: {where} stopped before its first checkpoint; starting it again")
            exp.run(f"lctrain train ({label})", ["train", *args, "--force"])
    else:
        say("train", f"{label}: {steps} steps into {where}")
        exp.run(f"lctrain train ({label})", ["train", *args])


def record_failure(state: State, where: Path, mode: str, seed: int, stage: str, failure: StageFailed) -> None:
    """Recorded whether or not the experiment goes on: experiment.json says why its last attempt at the run ended."""
    state.data.setdefault("runs", {}).setdefault(where.name, {}).update(
        {"mode": mode, "seed": seed, "run_dir": str(where), "failed": {"stage": stage, "error": failure.failure}}
    )
    state.save()


def going_on_without(
    state: State, where: Path, mode: str, seed: int, stage: str, failure: StageFailed, keep_going: bool
) -> str:
    """A run's `stage` failed: recorded; with `keep_going` said in one line and the stage returned (the experiment
    goes on without the run), else the failure goes on up and stops the experiment."""
    record_failure(state, where, mode, seed, stage, failure)
    if not keep_going:
        raise failure
    say(stage, f"{failure.failure}; going on without this run (--keep-going)")
    return stage


def train_runs(exp: Experiment, state: State, steps: int, keep_going: bool) -> dict[str, str]:
    """Train every run not trained yet (`check_trained_runs` has refused those trained otherwise); returns the runs
    whose training failed ({run name: "train"}), only with `keep_going`: without it the first failure stops here."""
    runs = exp.runs()
    failed = {}
    for i, (mode, seed) in enumerate(runs, 1):
        where = exp.run_dir(mode, seed)
        rd = RunDir(where)
        label = f"{mode}, seed {seed} ({i} of {len(runs)})"
        args = [
            "-c",
            CONFIG.format(mode=mode),
            *set_args([*exp.shared_overrides(), *exp.run_overrides(mode, seed, steps)]),
        ]
        try:
            train_run(exp, rd, label, args, steps)
        except StageFailed as e:
            failed[where.name] = going_on_without(state, where, mode, seed, "train", e, keep_going)
            continue
        # updated, not replaced: the eval stage's record of how the run was evaluated stays with it
        record = state.data.setdefault("runs", {}).setdefault(where.name, {})
        record.update(
            {
                "mode": mode,
                "seed": seed,
                "run_dir": str(where),
                "steps": steps,
                "data_fingerprint": data_fingerprint(rd.read_config().data),
                "exports": [p.name for p in rd.exports()],
            }
        )
        # an evaluation's failure stays recorded until the eval stage runs it again
        if record.get("failed", {}).get("stage") == "train":
            del record["failed"]
        state.save()
    return failed


def eval_settings(cfg: Config) -> dict:
    return settings(cfg)["eval"]


def results_digest(results: bytes) -> str:
    return hashlib.sha256(results).hexdigest()


def evaluated_with(rd: RunDir, record) -> dict | None:
    """The eval settings the run's eval/results.json was written with: those `record` (the run's "evaluated" in
    experiment.json) holds beside the file's digest. None when there is nothing to keep: no results, torn ones, ones of
    other checkpoints than the latest exports `lctrain eval` scores now (evaluated before training ended) or of exports
    written again since (`rewritten_exports`, as `lctrain report` refuses them), or ones rewritten since the record
    (`lctrain eval` by hand, with settings not known here)."""
    results = rd.eval_dir / "results.json"
    if not results.is_file():
        return None
    raw = results.read_bytes()
    try:
        done = json.loads(raw)
    except ValueError:
        return None
    if done.get("checkpoints") != [p.name for p in rd.exports()][-DEFAULT_LAST:] or rewritten_exports(rd, done):
        return None
    if isinstance(record, dict):
        return record.get("eval") if record.get("results_sha256") == results_digest(raw) else None
    # no record (an experiment.json from before it was kept): this command ran `lctrain eval` without --set then, so
    # with the run's own config's settings
    return eval_settings(rd.read_config())


def evaluate_runs(exp: Experiment, state: State, steps: int, skip: dict[str, str], keep_going: bool) -> dict[str, str]:
    """`lctrain eval` of every run but those in `skip` (their training failed) under the experiment's eval settings,
    given whole on its command line (a run's config.yaml keeps those it trained with); a run evaluated under them
    already is skipped. Returns the runs whose evaluation failed ({run name: "eval"}), as `train_runs` does."""
    runs = []
    for i, (mode, seed) in enumerate(exp.runs(), 1):
        where = exp.run_dir(mode, seed)
        label = f"{mode}, seed {seed} ({i} of {len(exp.runs())})"
        if where.name in skip:
            runs.append((mode, seed, label, where, None, None))
            continue
        now = eval_settings(exp.config(mode, exp.run_overrides(mode, seed, steps)))
        before = evaluated_with(RunDir(where), state.data["runs"][where.name].get("evaluated"))
        runs.append((mode, seed, label, where, now, before))
    changed: dict[str, tuple] = {}
    for *_, now, before in runs:
        if before is not None and before != now:
            changed.update(settings_changes({"eval": before}, {"eval": now}))
    if changed:
        say("eval", f"eval settings changed ({shown_changes(changed)}): re-evaluating the trained runs")
    failed = {}
    for mode, seed, label, where, now, before in runs:
        if where.name in skip:
            say("eval", f"{label}: not evaluated, its training failed")
            continue
        if before == now:
            say("eval", f"{label}: {where / 'eval'} finished, skipped")
        else:
            say("eval", f"{label}: every evaluation checkpoint of {where}")
            args = ["eval", str(where), "--device", exp.device, "--set", f"eval={json.dumps(now)}"]
            try:
                exp.run(f"lctrain eval {where}", args)
            except StageFailed as e:
                failed[where.name] = going_on_without(state, where, mode, seed, "eval", e, keep_going)
                continue
        results = (RunDir(where).eval_dir / "results.json").read_bytes()
        record = state.data["runs"][where.name]
        record["evaluated"] = {"eval": now, "results_sha256": results_digest(results)}
        record.pop("failed", None)
        state.save()
    return failed


def report_runs(exp: Experiment, state: State, failed: dict[str, str]) -> dict:
    """The report of the runs trained and evaluated; its line names those `failed` ({run name: stage}) left out and
    what that leaves to compare, and a RunFailed after it names them again: a script sees the experiment failed
    (exit code 1)."""
    runs = [(m, s) for m, s in exp.runs() if exp.run_dir(m, s).name not in failed]
    names = [exp.run_dir(m, s).name for m, s in exp.runs()]
    left_out = ", ".join(f"{name} ({failed[name]} failed)" for name in names if name in failed)
    if not runs:
        raise RunFailed(
            f"every run failed: {left_out}; no report written ({exp.out / STATE_FILE} records why); {RERUN} to retry "
            f"them"
        )
    report_dir = exp.out / REPORT_DIR
    scope = f"{len(runs)} runs into {report_dir}"
    if failed:
        scope = f"{len(runs)} of {len(exp.runs())} runs into {report_dir}, leaving out {left_out}"
    modes = [m for m in exp.modes if m in {mode for mode, _ in runs}]
    if len(modes) == 1 < len(exp.modes):
        scope += f"; only {modes[0]} is left, with no other mode to compare it with"
    elif modes[0] != exp.modes[0]:
        scope += f"; {modes[0]} is the reference row in place of {exp.modes[0]}"
    say("report", scope)
    why = [f"{name} ({failed[name]} failed; {exp.out / STATE_FILE} records why)" for name in names if name in failed]
    report = write_report([exp.run_dir(m, s) for m, s in runs], report_dir, exp.checkpoints, why)
    print_report(report, report_dir)
    state.data["report"] = str(report_dir)
    state.save()
    if failed:
        raise RunFailed(
            f"{len(failed)} of {len(exp.runs())} runs failed: {left_out}, left out of the report "
            f"({exp.out / STATE_FILE} records why); {RERUN} to retry them (a run with a checkpoint resumes from it)"
        )
    return report


def pick_device(device: str) -> str:
    # torch on use: `lctrain --help` does not pay for it (start-up time)
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise UserError(f"--device {device}: choose auto, cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: CUDA is not available on this machine; use --device cpu")
    return device


def extend(
    out: str | Path,
    *,
    seq_len: int = 32768,
    steps: int | None = None,
    tokens: int | None = None,
    train_seconds: float | None = None,
    seeds: int = 1,
    modes: tuple[str, ...] = MODES,
    checkpoints: int = 5,
    eval_lengths: list[int] | None = None,
    device: str = "auto",
    model: str | Path | None = None,
    overrides: tuple[str, ...] = (),
    keep_going: bool = False,
) -> dict:
    """Run (or continue) the experiment in `out`; returns the report `write_report` wrote. With `keep_going`, a run
    whose training or evaluation fails is left out and the others go on; the report is written without it, then a
    RunFailed names it."""
    # the first check, and one that creates nothing: a refused command writes nothing
    check_creatable(Path(out), Path(out))
    if sum(x is not None for x in (steps, tokens, train_seconds)) > 1:
        raise UserError("give one of --steps, --tokens and --train-seconds")
    if steps is not None and steps < 1:
        raise UserError(f"--steps {steps}: train at least 1 step")
    if train_seconds is not None and not 0 < train_seconds < math.inf:
        raise UserError(f"--train-seconds {train_seconds}: expected a time in seconds > 0")
    if seeds < 1:
        raise UserError(f"--seeds {seeds}: run at least 1 seed")
    if checkpoints < 1:
        raise UserError(f"--checkpoints {checkpoints}: evaluate at least 1 checkpoint")
    allowed = MODES + OPTIONAL_MODES
    unknown = [m for m in modes if m not in allowed]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise UserError(f"--modes {','.join(modes)}: expected some of {', '.join(allowed)}, each once")
    if seq_len < 8 or seq_len % 4:
        raise UserError(f"--seq-len {seq_len}: expected a multiple of 4 (the 4x ladder evaluates seq_len/4 and /2)")
    lengths = sorted(set(eval_lengths or default_eval_lengths(seq_len)))
    if lengths[-1] > seq_len:
        raise UserError(f"--eval-lengths: {lengths[-1]} is beyond the {seq_len}-token windows trained on")
    exp = Experiment(
        Path(out).absolute(),
        seq_len,
        tuple(modes),
        seeds,
        checkpoints,
        tuple(lengths),
        pick_device(device),
        Path(model).absolute() if model is not None else None,
        tuple(overrides),
    )
    cfg = exp.config(exp.modes[0])  # a bad --set is refused here, before anything is built
    per_step = cfg.tokens_per_step
    given = steps if steps is not None else steps_for_tokens(tokens, per_step) if tokens is not None else None
    windows = cfg.data.token_budget // seq_len  # the most that prepare packs
    planned = None if train_seconds is not None else given if given is not None else cfg.train.steps
    step_limit(
        cfg, windows, f"of --seq-len {seq_len} in data.token_budget = {cfg.data.token_budget:,}", planned, checkpoints
    )
    if planned is not None:
        checkpoint_spacing(planned, checkpoints)
    check_evaluation(exp, eval_lengths is not None)  # the model's tokenizer counts the prompts
    ensure_model(exp)
    exp.out.mkdir(parents=True, exist_ok=True)
    state = State(exp.out / STATE_FILE)
    ensure_corpus(exp)
    prepared = prepare_once(exp, state, given)
    chosen = choose_steps(exp, state, prepared, given, train_seconds)
    check_trained_runs(exp, chosen)  # a refused plan is never recorded
    warn_identical_modes(exp, chosen)
    state.data["plan"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(exp).items()}
    state.data["steps"] = chosen
    state.data["tokens_per_run"] = cfg.tokens_read(chosen)
    state.save()
    failed = train_runs(exp, state, chosen, keep_going)
    failed |= evaluate_runs(exp, state, chosen, failed, keep_going)
    return report_runs(exp, state, failed)
