"""`lctrain plot`: several runs' metrics.jsonl curves on one PNG, the plotted data equal to the records, bad input one
line."""

from pathlib import Path

import pytest
from PIL import Image
from train_helpers import one_error_line
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.reports.curves import curves, read_run, series
from lctrain.rundir import RunDir


def fake_run(root: Path, name: str, mode: str, losses: list[float], mfu=0.3) -> Path:
    """A run directory with a config and metrics records written as the trainer writes them, without training."""
    rd = RunDir(root / name)
    rd.write_config(load_config(None, [f"name={name}", f"attention.mode={mode}"]))
    for i, loss in enumerate(losses, start=1):
        rd.append_metrics(
            {"step": i, "loss": loss, "tokens_per_s": 1000.0 + 10 * i, "mfu": None if i == 1 else mfu, "lr": 1e-3}
        )
    return rd.path


@pytest.fixture
def runs(tmp_path):
    return [
        fake_run(tmp_path, "tiny_full", "full", [10.4, 9.1, 8.2]),
        fake_run(tmp_path, "tiny_anchor", "anchor", [10.4, 8.9, 7.9, 7.5]),
    ]


def test_the_plotted_series_are_the_records(runs):
    by_metric = curves([read_run(p) for p in runs], ["loss", "tokens_per_s", "mfu"])
    for metric, lines in by_metric.items():
        assert [c.label for c in lines] == ["tiny_full (full)", "tiny_anchor (anchor)"]
        for c, path in zip(lines, runs):
            records = RunDir(path).read_metrics()
            kept = [r for r in records if r[metric] is not None]
            assert c.steps == [r["step"] for r in kept]
            assert c.values == [r[metric] for r in kept]
    assert by_metric["mfu"][0].steps == [2, 3]  # the step without an MFU is left out, not drawn as 0


def test_series_of_records():
    records = [{"step": 1, "loss": 3.0, "mfu": None}, {"step": 2, "loss": 2.5, "mfu": 0.4}]
    assert series(records, "loss") == ([1, 2], [3.0, 2.5])
    assert series(records, "mfu") == ([2], [0.4])


def test_runs_with_the_same_name_are_told_apart_by_directory(tmp_path):
    a = fake_run(tmp_path / "a", "tiny", "anchor", [1.0])
    b = fake_run(tmp_path / "b", "tiny", "anchor", [2.0])
    lines = curves([read_run(a), read_run(b)], ["loss"])["loss"]
    assert [c.label for c in lines] == [f"{a} (anchor)", f"{b} (anchor)"]


def test_the_command_writes_one_png_with_a_panel_per_metric(runs, tmp_path):
    out = tmp_path / "figs" / "full_vs_anchor.png"
    result = CliRunner().invoke(app, ["plot", *map(str, runs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    width, height = Image.open(out).size
    assert width > 1.5 * height  # two panels side by side: loss and tokens/s

    one = tmp_path / "lr.png"
    assert CliRunner().invoke(app, ["plot", str(runs[0]), "--metric", "lr", "--out", str(one)]).exit_code == 0
    assert Image.open(one).size[0] < width


def test_the_held_out_loss_is_drawn_by_default_where_a_run_scored_it(runs, tmp_path, monkeypatch):
    """`train.heldout_every` records `heldout_loss` at some steps only: by default its panel comes after the loss's,
    each run's curve its scored steps (a run without it has an empty curve); runs without it get the two panels."""
    import lctrain.reports.curves as curves_module

    drawn = []
    monkeypatch.setattr(curves_module, "plot_curves", lambda c, path: drawn.append(c) or path)
    RunDir(runs[1]).append_metrics({"step": 5, "loss": 7.2, "heldout_loss": 7.6, "tokens_per_s": 1050.0, "lr": 1e-3})
    assert CliRunner().invoke(app, ["plot", *map(str, runs), "--out", str(tmp_path / "a.png")]).exit_code == 0
    assert list(drawn[0]) == ["loss", "heldout_loss", "tokens_per_s"]
    assert [(c.steps, c.values) for c in drawn[0]["heldout_loss"]] == [([], []), ([5], [7.6])]
    assert CliRunner().invoke(app, ["plot", str(runs[0]), "--out", str(tmp_path / "b.png")]).exit_code == 0
    assert list(drawn[1]) == ["loss", "tokens_per_s"]


def test_utilisation_in_percent_as_the_logs_print_it_against_whole_steps(runs, tmp_path, monkeypatch):
    import lctrain.reports.plots as plots

    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.setdefault("fig", fig) and path)
    plots.plot_curves(curves([read_run(r) for r in runs], ["mfu", "loss"]), tmp_path / "c.png")
    drawn["fig"].canvas.draw()
    mfu, loss = ([t.get_text() for t in ax.get_yticklabels()] for ax in drawn["fig"].axes)
    assert mfu and all(t.endswith("%") for t in mfu) and 30.0 in {float(t[:-1]) for t in mfu}  # the runs' 0.3
    assert loss and not any(t.endswith("%") for t in loss)
    for ax in drawn["fig"].axes:  # 3 and 4 steps: matplotlib's default locator put ticks at 1.5, 2.5, ...
        steps = [t.get_text().replace("\u2212", "-") for t in ax.get_xticklabels()]
        assert steps and all(float(t).is_integer() for t in steps), steps


def test_bad_input_is_one_line(runs, tmp_path):
    (tmp_path / "empty").mkdir()
    dataset = RunDir(tmp_path / "dataset")  # prepare writes its config.yaml beside the manifest
    dataset.write_config(load_config(None))
    (dataset.path / "manifest.json").write_text("{}")
    cases = [
        ([str(tmp_path / "empty")], "empty: not a run directory (no config.yaml)"),
        ([str(tmp_path / "nosuch")], "nosuch: no such run directory"),
        ([str(dataset)], "dataset: a prepared dataset (it holds manifest.json), not a run directory"),
        ([str(runs[0]), "--metric", "perplexity"], "--metric perplexity: not in these runs' metrics.jsonl; one of"),
    ]
    for args, expected in cases:
        line = one_error_line(CliRunner().invoke(app, ["plot", *args, "--out", str(tmp_path / "x.png")]))
        assert expected in line
    assert not (tmp_path / "x.png").exists()


def test_a_run_without_steps_is_refused(tmp_path):
    rd = RunDir(tmp_path / "new")
    rd.write_config(load_config(None))
    with pytest.raises(UserError, match="no step recorded yet"):
        read_run(rd.path)
