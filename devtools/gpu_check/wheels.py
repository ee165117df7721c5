"""Building the wheelhouse of an offline machine, on a connected one (`gpu_check.py wheels`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

from devtools.gpu_check import ROOT
from devtools.wheelhouse import carried_requirements, plan_install, read_freeze, read_wheel

# `pip freeze` on the lent GPU machine (python3 of its image, 2026-11-26): what the wheelhouse need not carry
DEVICE_FREEZE = Path(__file__).with_name("device_freeze.txt")


def pip_download_finder(dest: Path, python_version: str, platforms: list[str], pins: dict[str, str | None]):
    """`find` for plan_install that downloads a wheel for the target with pip: the version `pins` (the tested lock,
    constraints.txt) names where it fits, else the newest. A package published only as a source distribution
    (DeepSpeed) is built into a wheel here, which works for pure-Python packages."""

    def newest(name: str) -> set[Path]:
        return {p for p in dest.glob("*.whl") if canonicalize_name(p.name.split("-")[0]) == name}

    def find(req):
        name = canonicalize_name(req.name)
        before = newest(name)
        pin = pins.get(name)
        spec = (
            f"{req.name}=={pin}"
            if pin and req.specifier.contains(pin, prereleases=True)
            else f"{req.name}{req.specifier}"
        )
        plat = [a for p in platforms for a in ("--platform", p)]
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            *plat,
            "--dest",
            str(dest),
            spec,
        ]
        if subprocess.call(cmd, stderr=subprocess.DEVNULL):
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--wheel-dir",
                str(dest),
                spec,
            ]
            if subprocess.call(cmd, stderr=subprocess.DEVNULL):
                return None
        got = newest(name) - before or newest(name)
        return read_wheel(max(got, key=lambda p: p.stat().st_mtime)) if got else None

    return find


def build_wheelhouse(args) -> None:
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    have = read_freeze(Path(args.have).read_text().splitlines())
    reqs = carried_requirements(ROOT / "pyproject.toml", args.extras)
    env = {
        "python_version": args.python_version,
        "python_full_version": f"{args.python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
    }
    pins = read_freeze((ROOT / "constraints.txt").read_text().splitlines())
    finder = pip_download_finder(dest, args.python_version, args.platform, pins)
    plan = plan_install(reqs, have, finder, environment=env)
    planned = {w.path.resolve() for w in plan.install}
    names = {w.name for w in plan.install}
    for path in sorted(dest.glob("*.whl")):
        # a version the walk downloaded, then chose again (two versions in one wheelhouse stop an install)
        if path.resolve() not in planned and read_wheel(path).name in names:
            path.unlink()
            print(f"removed {path.name} (another version of it is planned)")
    for w in plan.install:
        print(f"wheel  {w.path.name}")
    for k in plan.kept:
        print(f"kept   {k}")
    for u in plan.unavailable:
        print(f"MISSING {u}")
    size = sum(w.path.stat().st_size for w in plan.install)
    print(f"{len(plan.install)} wheels, {size / 2**20:.1f} MiB in {dest}")
    if not plan.ok:
        raise SystemExit(1)
