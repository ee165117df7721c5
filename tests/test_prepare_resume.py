"""`prepare` killed with SIGKILL once a shard is complete resumes from its last complete shard: the output (every shard,
the resolved config, the manifest but its timings and checksum) is byte-identical to an uninterrupted run's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lctrain.config import load_config
from lctrain.data.prepare import prepare
from lctrain.data.progress import PROGRESS

# ~50 shards of 64 windows; the demo's synthetic corpus holds more than the budget
OVER = ["data.seq_len=128", "data.token_budget=400000", "data.shard_tokens=8192"]


def dataset_bytes(out: Path) -> dict:
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = json.loads(files.pop("manifest.json"))
    del manifest["build"], manifest["checksum"]
    return files | {"manifest.json": manifest}


@pytest.mark.slow
def test_kill_9_mid_prepare_then_resume_gives_the_same_bytes(tmp_path):
    out = tmp_path / "out"
    over = [*OVER, f"data.output_dir={out}"]
    reference = dataset_bytes(prepare(load_config(None, over)).rename(tmp_path / "reference"))

    args = [x for o in over for x in ("--set", o)]
    cmd = [sys.executable, "-c", "from lctrain.cli import app; app()", "prepare", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    progress = tmp_path / ".out.partial" / PROGRESS
    try:
        deadline = time.monotonic() + 120
        while not progress.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, f"prepare ended before a shard was complete: {proc.stderr.read().decode()}"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not out.exists()
    done = len(list((tmp_path / ".out.partial" / "data").iterdir()))  # complete shards and the one being written

    data = prepare(load_config(None, over))
    resumed = json.loads((data / "manifest.json").read_text())["build"]["resumed_after_shards"]
    assert 1 <= resumed <= done < 50
    assert dataset_bytes(out) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "reference"]


def test_ctrl_c_after_a_shard_says_that_the_same_command_resumes(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from lctrain.cli import app
    from lctrain.data.progress import Partial

    save = Partial.save

    def saved_then_ctrl_c(self, key, state):
        save(self, key, state)
        raise KeyboardInterrupt

    args = [x for o in ["data.seq_len=128", "data.token_budget=20000", "data.shard_tokens=8192"] for x in ("--set", o)]
    args += ["--set", f"data.output_dir={tmp_path / 'out'}"]
    monkeypatch.setattr(Partial, "save", saved_then_ctrl_c)
    stopped = CliRunner().invoke(app, ["prepare", *args])
    assert stopped.exit_code == 130
    said = "interrupted; the same 'lctrain prepare' again resumes after its last complete shard"
    *progress, last = stopped.stderr.strip().splitlines()
    # before it: the progress bar's lines, and the warning that training would re-read windows of so small a budget
    assert last == said and all(line.startswith(("prepare ", "warning: ")) for line in progress), stopped.stderr
    monkeypatch.setattr(Partial, "save", save)
    again = CliRunner().invoke(app, ["prepare", *args])
    assert again.exit_code == 0 and "resuming an interrupted prepare after its last complete shard (1 shard(s)" in (
        again.output
    )


def test_an_interrupted_rebuild_beside_a_current_dataset_is_named(tmp_path):
    """A `prepare --force` stopped mid-way leaves `.NAME.partial/` beside the complete dataset; the next plain
    `prepare` has nothing to do, and says what the leftover holds rather than leave the space taken unsaid."""
    out = tmp_path / "out"
    over = ["data.seq_len=128", "data.token_budget=2000", f"data.output_dir={out}"]
    prepare(load_config(None, over))
    left = tmp_path / ".out.partial"
    (left / "data").mkdir(parents=True)
    (left / "data" / "shard-00000.arrow").write_bytes(b"\0" * 1000)
    from typer.testing import CliRunner

    from lctrain.cli import app

    result = CliRunner().invoke(app, ["prepare", *[x for o in over for x in ("--set", o)]])
    assert result.exit_code == 0
    said = " ".join(result.output.split())
    assert (
        f"note: {left} holds an interrupted rebuild (0.00 GB): 'lctrain prepare --force' resumes it, or delete it"
        in said
    )
