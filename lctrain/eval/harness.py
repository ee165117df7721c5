"""`lctrain eval --harness`: the paper's Table 7 (LongBench, HellaSwag, MMLU) through EleutherAI's
lm-evaluation-harness, on the evaluation checkpoints `lctrain eval` scores (a run's latest `--last`), averaged over
them like the RULER scores.

The paper (§4.2, Table 7) reports "LongBench ICL", HellaSwag and MMLU to show that long-context training keeps the
model's short-context abilities; Appendix E (Table 12) splits LongBench into its six categories. The harness owns the
tasks, prompts, few-shot sampling and metrics, so scores compare with anyone else's harness numbers; lctrain supplies
the model through `CheckpointLM`, an `lm_eval.api.model.LM` over a loaded checkpoint:

- every request starts with the anchor every training segment started with (`data.anchor`; `runner.eval_anchor`);
- `loglikelihood` keeps the last `max_length` tokens of context + continuation (the harness's own rule for HF models);
- `generate_until` drops the *middle* of a prompt longer than `max_length - max_gen_toks`, as LongBench's own
  `pred.py` does ("truncate to fit max_length (we suggest truncate in the middle, since the left and right side may
  contain crucial instructions)"), and decodes greedily until a stop string.

lm-evaluation-harness is an optional extra (`pip install 'lctrain[harness]'`, with LongBench's metric dependencies);
its tasks download their datasets from the hub on first use, so an offline machine needs them in the `datasets` cache
(`HF_DATASETS_CACHE`). Each task runs with the shots its YAML names, 0 where it names none, as none of Table 7's do
(LongBench's ICL examples are part of its prompts), unless `--harness-fewshot` sets one number for every task of the
run, LongBench's too: a 5-shot MMLU is a run of its own.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from lctrain.console import plain_console
from lctrain.errors import UserError
from lctrain.eval.runner import eval_anchor, evaluating, load_eval_tokenizer, load_model, pick_device
from lctrain.progress_bar import ProgressBar
from lctrain.rundir import RunDir
from lctrain.tokenizer import resolve_anchor, text_encoder

# Names a user types -> the harness task or group. Any other harness task name passes through unchanged.
TABLE7 = {"longbench": "longbench", "hellaswag": "hellaswag", "mmlu": "mmlu"}
# LongBench's category groups in the harness -> the paper's Appendix E column (Table 12); "ICL" is Table 7's column.
LONGBENCH_CATEGORIES = {
    "longbench_code": "Code Completion",
    "longbench_fewshot": "ICL",
    "longbench_multi": "Multi-Doc QA",
    "longbench_single": "Single-Doc QA",
    "longbench_summarization": "Summarization",
    "longbench_synthetic": "Synthetic",
}
# The metric shown for a task in the table; every numeric metric the harness returns is kept in the JSON.
HEADLINE_METRICS = ("score", "acc_norm", "acc", "exact_match")


def import_harness():
    try:
        # optional dependency: lm-eval (the `harness` extra)
        import lm_eval
    except ImportError:
        raise UserError("--harness needs lm-evaluation-harness: pip install 'lctrain[harness]'") from None
    return lm_eval


def _cut_at_stops(text: str, stops: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def _make_lm_class():
    """Built on first use, so that importing lctrain does not import the harness."""
    # optional dependency lm-eval, and torch with it: this module imports without either
    import torch
    import torch.nn.functional as F
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class CheckpointLM(LM):
        def __init__(self, model, tokenizer, max_length: int, batch_size: int = 1, progress=None, anchor=None):
            super().__init__()
            self.model, self.tokenizer = model, tokenizer
            self.encoder = text_encoder(tokenizer)  # text -> ids exactly as the model's reference tokenizer
            self.max_length, self.batch_size = max_length, batch_size
            self.progress = progress  # called with the number of requests finished
            self.bos = (anchor or resolve_anchor(tokenizer)).id  # what every prompt starts with

        @property
        def eot_token_id(self):
            return self.tokenizer.eos_token_id

        def encode(self, text: str) -> list[int]:
            return self.encoder.encode(text) if text else []

        def _done(self, n: int = 1):
            if self.progress is not None:
                self.progress(n)

        def _logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
            """log P(continuation | context) and whether greedy decoding would produce it, for (context ids,
            continuation ids) pairs; each sequence keeps its last `max_length` tokens."""
            out: list[tuple[float, bool]] = []
            for start in range(0, len(pairs), self.batch_size):
                chunk = pairs[start : start + self.batch_size]
                longest = max(len(cont) for _, cont in chunk)
                if longest > self.max_length:
                    raise UserError(
                        f"a harness continuation of {longest} tokens is longer than the harness max "
                        f"length {self.max_length}; raise --harness-max-len"
                    )
                rows = [(ctx + cont)[-(self.max_length + 1) :][:-1] for ctx, cont in chunk]
                width = max(len(r) for r in rows)
                ids = torch.full((len(rows), width), self.eot_token_id or 0, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, r in enumerate(rows):
                    ids[i, : len(r)] = torch.tensor(r)
                    mask[i, : len(r)] = 1
                with torch.inference_mode():
                    logits = self.model(
                        input_ids=ids.to(self.model.device), attention_mask=mask.to(self.model.device)
                    ).logits.float()
                for i, (r, (_, cont)) in enumerate(zip(rows, chunk)):
                    logp = F.log_softmax(logits[i, len(r) - len(cont) : len(r)], dim=-1)
                    target = torch.tensor(cont, device=logp.device)
                    total = float(logp.gather(1, target[:, None]).sum())
                    out.append((total, bool((logp.argmax(-1) == target).all())))
                self._done(len(chunk))
            return out

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            pairs = []
            for req in requests:
                context, continuation = req.args
                # The harness puts word-boundary spaces into the continuation, and a context's trailing whitespace
                # goes there too, as lm-eval's own models move it: tokenizers join a space to the word after it, so
                # "is " + "Paris" split after the context's ids left the continuation no token of its own (every
                # choice scored 0). Tokenizing the joined text keeps the ids a real document would have, and the
                # context's ids are its prefix up to the boundary.
                kept = context.rstrip()
                context, continuation = kept, context[len(kept) :] + continuation
                whole = self.encode(context + continuation)
                n_ctx = len(self.encode(context))
                pairs.append(([self.bos] + whole[:n_ctx], whole[n_ctx:]))
            return self._logprobs(pairs)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            out = []
            for req in requests:
                (text,) = req.args
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        token_list=self.encode(text), prefix_token=self.bos, max_seq_len=self.max_length, context_len=1
                    )
                ]
                out.append(sum(lp for lp, _ in self._logprobs([(list(c), list(t)) for c, t in windows])))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for req in requests:
                context, kwargs = req.args
                kwargs = dict(kwargs or {})
                stops = kwargs.get("until") or []
                stops = [stops] if isinstance(stops, str) else list(stops)
                max_new = int(kwargs.get("max_gen_toks", 256))
                ids = [self.bos] + self.encode(context)
                room = self.max_length - max_new
                if room < 2:
                    raise UserError(
                        f"harness max length {self.max_length} leaves no room for a prompt before "
                        f"{max_new} generated tokens; raise --harness-max-len"
                    )
                if len(ids) > room:
                    ids = ids[: room // 2] + ids[len(ids) - (room - room // 2) :]
                out.append(_cut_at_stops(self._greedy(ids, max_new, stops), stops))
                self._done()
            return out

        def _greedy(self, ids: list[int], max_new: int, stops: list[str]) -> str:
            # torch/transformers on use: this module imports without them (start-up time)
            from lctrain.eval.generation import greedy_ids, plan_for

            def decode(new: list[int]) -> str:
                return self.tokenizer.decode(new, skip_special_tokens=True)

            new = greedy_ids(
                self.model,
                ids,
                max_new,
                plan_for(self.model, len(ids) + max_new),
                eos=self.eot_token_id,
                stop=(lambda n: any(s in decode(n) for s in stops)) if stops else None,
            )
            return decode(new)

    return CheckpointLM


def checkpoint_lm(model, tokenizer, max_length: int, batch_size: int = 1, progress=None, anchor=None):
    """An `lm_eval` LM over a loaded causal LM (see the module docstring for its prompt rules); its prompts start
    with `anchor` (a `tokenizer.Anchor`; None: the tokenizer's default, `resolve_anchor`)."""
    import_harness()
    return _make_lm_class()(model, tokenizer, max_length, batch_size, progress, anchor)


def _task_manager(names: list[str], include_path: str | None):
    """A task index that knows `names`. Indexing the harness's ~15,000 bundled tasks takes 15-20 s, so a run that
    names only tasks of its own `--harness-tasks` directory indexes that directory alone."""
    # optional dependency: lm-eval
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(names) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


def _missing_module(e: BaseException | None) -> str | None:
    """The top-level module whose absence raised `e`: lm-eval's task code re-raises it as an ImportError of its own
    that names the extra but not the module, so the name is on the error it replaced."""
    while e is not None:
        if isinstance(e, ModuleNotFoundError) and e.name:
            return e.name.split(".")[0]
        e = e.__cause__ or e.__context__
    return None


def resolve_tasks(names: list[str], include_path: str | None):
    """The harness's task index and loaded tasks for `names` (Table 7 aliases or any harness task/group), their
    datasets loaded. Done before any model is loaded, so an unknown name or a dataset that cannot be had fails in one
    line at once."""
    import_harness()
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--harness-tasks {include_path}: not a directory of task YAML files")
    wanted = [TABLE7.get(n, n) for n in names]
    manager = _task_manager(wanted, include_path)
    known = set(manager.all_tasks)
    for n in wanted:
        if n not in known:
            close = difflib.get_close_matches(n, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; `lm-eval ls tasks` lists them"
            raise UserError(f"--harness {n}: not a task or group of lm-evaluation-harness{hint}")
    try:
        return manager, manager.load(wanted)
    except ImportError as e:  # a task's own metric code, imported on load, needs what only an lm-eval extra installs
        missing = _missing_module(e)
        what = f"the Python module {missing}, which is not installed" if missing else "a module that does not import"
        # lm-eval's own message, where it wrote one, names the extra that installs it
        said = "" if isinstance(e, ModuleNotFoundError) else f" (lm-eval: {_first_line(e)})"
        raise UserError(
            f"--harness {','.join(names)}: a task needs {what}{said}; pip install 'lctrain[harness]' installs "
            f"LongBench's; other tasks' come with their lm-eval extra, pip install 'lm-eval[EXTRA]'"
        ) from None
    except Exception as e:  # the harness surfaces hub, cache and format errors of `datasets` as many types
        raise UserError(
            f"--harness {','.join(names)}: a task's dataset could not be loaded ({type(e).__name__}: "
            f"{_first_line(e)}); the harness downloads it from the hub on first use: run once with network "
            f"access, or point HF_DATASETS_CACHE at a cache that has it"
        ) from None


def numeric_metrics(results: dict) -> dict[str, dict[str, float]]:
    """`{task or group: {metric: value}}` from the harness's `results` (keys like 'acc,none'; stderr dropped)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric = key.split(",")[0]
            if metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                out.setdefault(task, {})[metric] = float(value)
    return out


def average_over_checkpoints(per_checkpoint: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The mean of each (task, metric) over the checkpoints that report it (the paper's §4.2 protocol)."""
    sums: dict[tuple[str, str], list[float]] = {}
    for table in per_checkpoint.values():
        for task, metrics in table.items():
            for metric, value in metrics.items():
                sums.setdefault((task, metric), []).append(value)
    avg: dict[str, dict[str, float]] = {}
    for (task, metric), values in sorted(sums.items()):
        avg.setdefault(task, {})[metric] = sum(values) / len(values)
    return avg


def headline(metrics: dict[str, float]) -> tuple[str, float] | None:
    for m in HEADLINE_METRICS:
        if m in metrics:
            return m, metrics[m]
    return None


@dataclass
class HarnessSettings:
    tasks: list[str]
    include_path: str | None = None
    num_fewshot: int | None = None
    limit: float | None = None
    max_length: int | None = None
    batch_size: int = 1


def evaluate_harness(
    tgt, settings: HarnessSettings, *, out: str | Path | None = None, device: str | None = None
) -> dict:
    """`lctrain eval TARGET --harness ...`: score a resolved run or model (`runner.resolve_target`, see
    `run_harness`)."""
    if not settings.tasks:
        raise UserError("--harness: name at least one task, e.g. --harness longbench,hellaswag,mmlu")
    if settings.limit is not None and not 0 < settings.limit < math.inf:
        raise UserError(
            f"--harness-limit {settings.limit}: give a number of documents per task (>= 1) or a fraction of them "
            f"(between 0 and 1)"
        )
    if settings.batch_size < 1:
        raise UserError(f"--harness-batch {settings.batch_size}: need at least 1")
    if settings.max_length is not None and settings.max_length < 2:
        raise UserError(f"--harness-max-len {settings.max_length}: need at least 2 tokens (default data.seq_len)")
    return run_harness(tgt, settings, Path(out) if out else RunDir(tgt.path).eval_dir, pick_device(device))


def run_harness(target, settings: HarnessSettings, out_dir: Path, device: str) -> dict:
    """Score every checkpoint of a resolved `runner.Target` with the harness; write `harness.json`, print the table."""
    lm_eval = import_harness()
    manager, _ = resolve_tasks(settings.tasks, settings.include_path)
    wanted = [TABLE7.get(n, n) for n in settings.tasks]
    # one evaluation at a time writes into out_dir (`EvalLock`): two at once overwrote each other's harness.json
    with evaluating(target, out_dir):
        max_length = settings.max_length if settings.max_length is not None else target.cfg.data.seq_len
        tokenizer = load_eval_tokenizer(target.checkpoints[0][1], target.cfg, target.tokenizer_fallback)
        anchor = eval_anchor(target.checkpoints[0][1], target.cfg, tokenizer)
        per_checkpoint: dict[str, dict[str, dict[str, float]]] = {}
        # the harness builds its requests inside simple_evaluate, so the bar counts requests answered, without a total
        with ProgressBar(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed} requests"), TimeElapsedColumn()
        ) as bar:
            job = bar.add_task("harness", total=None)
            for name, path in target.checkpoints:
                bar.update(job, description=f"harness {name}", completed=0)
                model = load_model(path, device)
                lm = checkpoint_lm(
                    model, tokenizer, max_length, settings.batch_size, lambda n: bar.advance(job, n), anchor
                )
                res = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=wanted,
                    num_fewshot=settings.num_fewshot,
                    limit=settings.limit,
                    task_manager=manager,
                    log_samples=False,
                    bootstrap_iters=0,
                    verbosity="ERROR",
                )
                per_checkpoint[name] = numeric_metrics(res["results"])
                del model, lm
        report = {
            "target": str(target.path),
            "checkpoints": [c for c, _ in target.checkpoints],
            "device": device,
            "tasks": wanted,
            "num_fewshot": settings.num_fewshot,
            "limit": settings.limit,
            "max_length": max_length,
            "harness_version": getattr(lm_eval, "__version__", None),
            "per_checkpoint": per_checkpoint,
            "average": average_over_checkpoints(per_checkpoint),
        }
        (out_dir / "harness.json").write_text(json.dumps(report, indent=2))
        print_harness_report(report, out_dir)
        return report


def print_harness_report(report: dict, out_dir: Path) -> None:
    n = len(report["checkpoints"])
    table = Table(
        title=f"lm-evaluation-harness, averaged over {n} checkpoint{'s' * (n > 1)} ({', '.join(report['checkpoints'])})"
    )
    table.add_column("task")
    table.add_column("paper column")
    table.add_column("metric")
    table.add_column("score", justify="right")
    avg = report["average"]
    rows = list(report["tasks"])
    if "longbench" in rows:
        rows += [c for c in LONGBENCH_CATEGORIES if c in avg]
    for task in rows:
        head = headline(avg.get(task, {}))
        if head is None:
            table.add_row(task, "", "", "no score")
            continue
        metric, value = head
        # every headline metric is a fraction in the harness, LongBench's `score` too (its metrics.py scores a perfect
        # answer 1.0, unlike LongBench's own eval.py); the paper's Tables 7 and 12 print percent
        shown = value * 100
        column = LONGBENCH_CATEGORIES.get(task, {"hellaswag": "HellaSwag", "mmlu": "MMLU"}.get(task, ""))
        table.add_row(task, column, metric, f"{shown:.2f}")
    console = plain_console()
    console.print(table)
    console.print(f"wrote {out_dir}/harness.json")
