"""The install stage: lctrain and the dependencies the machine lacks, from the wheelhouse."""

from __future__ import annotations

from devtools.gpu_check import ROOT
from devtools.gpu_check.runner import Runner, python
from devtools.wheelhouse import carried_requirements, installed_distributions, plan_install, wheel_finder


def stage_install(run: Runner, args) -> None:
    r = run.result
    reqs = carried_requirements(ROOT / "pyproject.toml", args.extras)
    have = installed_distributions()
    if args.wheels:
        plan = plan_install(reqs, have, wheel_finder(args.wheels))
    else:
        plan = plan_install(reqs, have, lambda req: None)
    r.data["plan"] = plan.summary()
    r.columns = ["distribution", "action"]
    r.rows = [[w.path.name, "install from wheelhouse"] for w in plan.install]
    r.rows += [[k, "kept (machine's own version)"] for k in plan.kept]
    r.rows += [[u, "UNAVAILABLE"] for u in plan.unavailable]
    if not plan.ok:
        r.fail(
            f"missing and not in the wheelhouse ({args.wheels or 'no --wheels given'}): "
            f"{'; '.join(plan.unavailable)}; build one with `scripts/gpu_check.py wheels --have FREEZE`"
        )
        return
    pip = python() + ["-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--quiet"]
    if plan.install:
        run.run(pip + [str(w.path) for w in plan.install])
    run.run(pip + ["--no-build-isolation", "--editable", str(ROOT)])
    r.notes.append(
        f"{len(plan.install)} installed from the wheelhouse, {len(plan.present)} already present, "
        f"{len(plan.kept)} kept at the machine's version"
    )
