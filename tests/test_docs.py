"""The docs users navigate: every relative link in README.md and docs/*.md names a file that exists, and README keeps
the two fresh-machine commands that CI runs; cluster.md's sbatch outcome line runs on every sessions file."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# docs/config.md is generated from the config schema by another command; a link to it is allowed before it exists
GENERATED = {ROOT / "docs" / "config.md"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file(page):
    for target in relative_links(page):
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists() or path in GENERATED, f"{page.relative_to(ROOT)}: broken link {target}"


def test_the_link_check_sees_links_and_catches_a_broken_one(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](docs/x.md) [b](https://example.org) [c](#here)\n```\n[d](in/code.md)\n```\n")
    assert relative_links(page) == ["docs/x.md"]
    assert not (tmp_path / "docs/x.md").exists()


def test_readme_has_the_fresh_machine_commands():
    readme = (ROOT / "README.md").read_text()
    assert "make install && lctrain prepare && lctrain train" in readme
    assert "make test" in readme


def test_the_docs_the_readme_promises_exist_and_the_code_cites_them():
    for name in (
        "data",
        "training",
        "memory",
        "evaluation",
        "diagnostics",
        "performance",
        "troubleshooting",
        "cluster",
        "design",
        "architecture",
    ):
        assert (ROOT / "docs" / f"{name}.md").is_file(), name
    cited = [p for p in (ROOT / "lctrain").rglob("*.py") if "DESIGN" in p.read_text()]
    assert not cited, f"cite docs/design.md, not DESIGN.md: {cited}"


@pytest.mark.parametrize(
    "sessions,outcome",
    [
        ('{"start_step": 0}\n{"start_step": 4, "outcome": "stopped by SIGTERM"}\n', "stopped by SIGTERM"),
        ('{"start_step": 0, "outcome": "finished"}\n{"start_step": 4}\n', ""),  # killed: its start only
        (None, ""),  # stopped while starting: no sessions.jsonl
    ],
)
def test_the_sbatch_scripts_outcome_line_reads_every_sessions_file(tmp_path, sessions, outcome):
    """cluster.md's line that turns torchrun's exit code 1 into lctrain's 143 for a SIGTERM stop, run by bash on the
    records a session leaves: it failed with a KeyError on a session killed before it ended."""
    line = next(x for x in (ROOT / "docs" / "cluster.md").read_text().splitlines() if x.startswith("outcome=$("))
    if sessions is not None:
        (tmp_path / "runs" / "NAME").mkdir(parents=True)
        (tmp_path / "runs" / "NAME" / "sessions.jsonl").write_text(sessions)
    script = f'set -e\n{line.replace("python -c", shlex.quote(sys.executable) + " -c")}\nprintf %s "$outcome"'
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, outcome, "")
