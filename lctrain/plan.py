"""`lctrain plan` and `train`'s memory check: a config's per-rank memory plan (lctrain/memory.py) against the memory
of the machine it will run on: a known GPU by name, `--gpu-mem`, or, without a GPU, the host's available memory; held
to WARN_FRACTION of it (`Budget.planned`), the share above which `train` warns."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import torch
from rich.table import Table

from lctrain.config import Config, with_overrides
from lctrain.console import plain_console
from lctrain.disk import RunDisk
from lctrain.errors import UserError
from lctrain.hardware import known_gpu
from lctrain.memory import (
    HOST_RUNTIME_BYTES,
    SEARCH_LIMIT,
    WARN_FRACTION,
    Budget,
    faster_fit,
    fixes,
    longest_seq_len,
    plan_memory,
    searched_to_the_limit,
)
from lctrain.model import model_shape
from lctrain.parallel.layout import layout_of
from lctrain.train.data import BatchPlan
from lctrain.units import GB, gb_to_bytes, option_gb_to_bytes


def _positive(value: float | None, option: str) -> int | None:
    return None if value is None else option_gb_to_bytes(value, option)


def local_budget(gpu_mem_gb: float | None = None, host_mem_gb: float | None = None) -> tuple[Budget, bool]:
    """(the budget, whether its device size is known for certain: a GPU of the table or --gpu-mem)."""
    device = _positive(gpu_mem_gb, "--gpu-mem")
    host = _positive(host_mem_gb, "--host-mem") or psutil.virtual_memory().available
    if device is not None:
        return Budget(device, host, f"{gpu_mem_gb:g} GB per GPU (--gpu-mem)"), True
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        known = known_gpu(name)
        size = gb_to_bytes(known.memory_gb) if known else torch.cuda.get_device_properties(0).total_memory
        return Budget(size, host, f"{name}, {size / GB:.0f} GB"), known is not None
    return Budget(None, host, f"CPU: {host / GB:.1f} GB of host memory available"), False


def machine_memory() -> int:
    """This machine's memory and swap, in bytes: what no process can exceed, however much is free now."""
    return psutil.virtual_memory().total + psutil.swap_memory().total


def memory_warning(cfg: Config) -> str | None:
    """`train`'s check: None when the plan fits in WARN_FRACTION of the memory; a one-line warning naming the memory
    above it; a UserError naming the settings that would fit in WARN_FRACTION when it exceeds a known GPU's memory,
    or on a CPU the machine's memory and swap (between the available memory and that, only a warning)."""
    memory, known = local_budget()
    budget = memory.planned()
    shape = model_shape(cfg)
    plan = plan_memory(cfg, shape, budget.gpu)
    over = budget.over(plan)
    if not over:
        return None
    device, host = budget.need(plan)
    per_gpu = f"{device / GB:.1f} GB per GPU and " if budget.gpu else ""
    summary = (
        f"the memory plan needs {per_gpu}{host / GB:.1f} GB of host memory ({memory.label}; `lctrain plan` itemises it)"
    )
    # On a CPU everything is host memory, of which only the available part is the budget: a plan beyond the
    # machine's whole memory and swap is refused too (the kernel's out-of-memory killer would end it without a word).
    beyond = (memory.gpu and known and not memory.fits(plan)) or (not memory.gpu and host > machine_memory())
    if beyond:
        found = [f for f in fixes(cfg, shape, budget) if f.fits]
        hint = (
            ("; these would fit: " + "; ".join(" ".join(f.overrides) for f in found[:3]))
            if found
            else "; no setting `lctrain plan` knows of fits it: a smaller model (model.name_or_path, model.arch) or "
            "a shorter data.seq_len"
        )
        machine = "" if memory.gpu else f", more than this machine's {machine_memory() / GB:.1f} GB of memory and swap"
        raise UserError(f"{cfg.source_file or 'config'} does not fit: {summary}{machine}{hint}")
    return (
        f"warning: {summary}: above {WARN_FRACTION:.0%} of the {' and the '.join(over)} memory, this run may run "
        f"out of memory"
    )


def _gb(n: int) -> str:
    return f"{n / GB:,.2f}"


def report(cfg: Config, memory: Budget) -> dict:
    """Everything `lctrain plan` prints, as JSON-ready data: the plan against `memory` held to WARN_FRACTION of it."""
    budget = memory.planned()
    shape = model_shape(cfg)
    plan = plan_memory(cfg, shape, budget.gpu)
    device, host = budget.need(plan)
    faster = faster_fit(cfg, shape, budget)
    longest = longest_seq_len(cfg, shape, budget)
    run_disk = RunDisk.of(cfg, shape.param_count())
    return {
        "config": cfg.source_file,
        # a --set model.name_or_path plans another model than the config file's name says
        "model": cfg.model.name_or_path or f"{cfg.model.arch['model_type']} (model.arch)",
        "seq_len": cfg.data.seq_len,
        "budget": memory.label,
        "device_memory_bytes": memory.device,
        "host_memory_bytes": memory.host,
        "budget_fraction": WARN_FRACTION,
        "device_budget_bytes": budget.device,
        "host_budget_bytes": budget.host,
        "items": [vars(i) for i in plan.items],
        "ranks_per_host": plan.ranks_per_host,
        "cpu_allocator_bytes": 0 if budget.gpu else plan.cpu_allocator_bytes(),
        "device_need_bytes": device,
        "host_need_bytes": host,
        "fits": budget.fits(plan),
        "over": budget.over(plan),
        "longest_seq_len": longest,
        "longest_is_a_lower_bound": longest is not None and searched_to_the_limit(cfg, longest),
        "fixes": [vars(f) | {"overrides": list(f.overrides)} for f in fixes(cfg, shape, budget)],
        "faster": None if faster is None else vars(faster) | {"overrides": list(faster.overrides)},
        "disk": {
            "run_dir": str(run_disk.path),
            "peak_bytes": run_disk.plan.total,
            "peak": run_disk.plan.words(),
            "written_bytes": run_disk.written,
            "free_bytes": run_disk.free,
            "fits": run_disk.refusal() is None,
        },
    }


def print_report(r: dict, stderr: bool = False) -> None:
    console = plain_console(stderr=stderr)
    stem = Path(r["config"] or "config").stem
    table = Table(title=f"memory per rank: {stem}, model {r['model']}, seq_len {r['seq_len']:,}")
    for col in ("item", "GB", "where", "kind"):
        table.add_column(col, justify="right" if col == "GB" else "left")
    for i in r["items"]:
        table.add_row(i["name"], _gb(i["bytes"]), i["where"], i["kind"])
    console.print(table)
    console.print(
        "states add up with the largest of the backward's start (saved activations and the largest of the loss and "
        "a transient), its end (gradients, the first layer's saved activations and the largest transient), the "
        "optimizer step (gradients and its items) and the engine's construction"
    )
    share = f"{r['budget_fraction']:.0%}"
    if r["device_memory_bytes"] is not None:
        console.print(
            f"device: {_gb(r['device_need_bytes'])} GB needed of {_gb(r['device_budget_bytes'])} GB, {share} of "
            f"{_gb(r['device_memory_bytes'])} GB (runtime overhead included)"
        )
    kept = (
        f", {_gb(r['cpu_allocator_bytes'])} GB per rank that the CPU allocator keeps of freed tensors"
        if r["cpu_allocator_bytes"]
        else ""
    )
    console.print(
        f"host: {_gb(r['host_need_bytes'])} GB needed for {r['ranks_per_host']} rank(s) of "
        f"{_gb(r['host_budget_bytes'])} GB, {share} of {_gb(r['host_memory_bytes'])} GB ({r['budget']}; "
        f"{_gb(HOST_RUNTIME_BYTES)} GB runtime per process{kept})"
    )
    verdict = "[bold green]FITS[/] in" if r["fits"] else "[bold red]DOES NOT FIT[/] in"
    memory = "memory" if r["fits"] else f"{' and the '.join(r['over'])} memory"
    console.print(
        f"{verdict} {share} of the {memory} (`lctrain train` warns above it: the caching allocator fragments)"
    )
    longest = r["longest_seq_len"]
    if not longest:
        console.print("no seq_len fits with these settings")
    elif r["longest_is_a_lower_bound"]:
        console.print(f"longest seq_len that fits: at least {longest:,} (the search stops at {SEARCH_LIMIT:,} tokens)")
    else:
        console.print(f"longest seq_len that fits: {longest:,}")
    if r["faster"]:
        f = r["faster"]
        console.print(
            f"faster and fits: --set {' '.join(f['overrides'])} ({_gb(f['device'])} GB per GPU, "
            f"{_gb(f['host'])} GB host): keeps each layer's attention output, so the backward does not rerun attention"
        )
    d = r["disk"]
    held = f"{_gb(d['written_bytes'])} GB of it written already, " if d["written_bytes"] else ""
    verdict = "" if d["fits"] else ": [bold red]DOES NOT FIT[/] (`lctrain train` refuses it: checkpoint.check_disk)"
    console.print(
        f"disk: {_gb(d['peak_bytes'])} GB at the run's peak in {d['run_dir']}: {d['peak']}; {held}"
        f"{_gb(d['free_bytes'])} GB free there{verdict}"
    )
    if not r["fits"] and r["fixes"]:
        fix_table = Table(
            title="settings that lower the memory (each alone, and the cheapest combination of those faster than "
            "the first to fit alone)"
        )
        for col in ("--set", "device GB", "host GB", "fits"):
            fix_table.add_column(col)
        for f in r["fixes"]:
            fix_table.add_row(" ".join(f["overrides"]), _gb(f["device"]), _gb(f["host"]), "yes" if f["fits"] else "no")
        console.print(fix_table)


def with_nproc(cfg: Config, nproc: int) -> Config:
    """`cfg` on `nproc` processes per node (`--nproc`), refusing a layout that cannot run in one line naming
    `--nproc`, not a `--set` the user did not type."""
    derived = with_overrides(cfg, [f"parallel.nproc_per_node={nproc}"], f"--nproc {nproc}")
    try:
        BatchPlan.of(derived, layout_of(derived))
    except UserError as e:
        raise UserError(f"--nproc {nproc}: {e}") from None
    return derived


def plan(
    cfg: Config,
    gpu_mem_gb: float | None = None,
    host_mem_gb: float | None = None,
    json_path: str | None = None,
    nproc: int | None = None,
) -> dict:
    """`lctrain plan`: print the plan against this machine's (or the given) memory, on `nproc` processes per node
    (default the config's); optionally write it as JSON, to standard output for `json_path` "-" (the table then goes
    to standard error, so that a script can pipe the JSON alone, e.g. to jq)."""
    memory, _ = local_budget(gpu_mem_gb, host_mem_gb)
    r = report(cfg if nproc is None else with_nproc(cfg, nproc), memory)
    print_report(r, stderr=json_path == "-")
    if json_path == "-":
        sys.stdout.write(json.dumps(r, indent=1) + "\n")
    elif json_path:
        try:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(r, indent=1))
        except OSError as e:
            raise UserError(f"--json {json_path}: cannot write the plan ({e.strerror})") from None
    return r
