"""`lctrain inspect` on a small prepared dataset: shares against the raw rows and the manifest, attention work per
mode against dense masks, the PNG, and a missing directory."""

import json

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_config
from lctrain.reports.inspect_data import inspect, window_pairs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from lctrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("inspect") / "data"
    return prepare(
        load_config(
            None,
            ["data.seq_len=256", "data.token_budget=12000", f"data.output_dir={out}", "data.interleave_chunks=true"],
        )
    )


def dense_pairs(seq_len, seg_lens, seg_doc):
    """Visible pairs counted on the boolean masks the reference attention engine uses (docs/design.md §3)."""
    import torch

    from lctrain.attention import make_batch
    from lctrain.attention.modes import MODES, dense_mask

    out = {}
    for mode in MODES:
        batch = make_batch(torch.zeros(1, seq_len, dtype=torch.long), [seg_lens], mode, seg_doc=[seg_doc])
        out[mode] = int(dense_mask(batch.segments.layout, mode).sum())
    return out


def test_window_pairs_against_dense_masks(data):
    from lctrain.data.store import open_packed

    packed = open_packed(data)
    seen_multi_chunk = False
    for i in range(len(packed)):
        w = packed[i]
        got = window_pairs(256, w["seg_lens"], w["seg_doc"])
        ref = dense_pairs(256, w["seg_lens"], w["seg_doc"])
        assert got == ref
        # a later chunk of a document does not see its earlier chunks' anchors, so anchor never exceeds intra_doc
        assert got["anchor"] <= got["intra_doc"] <= got["full"]
        seen_multi_chunk |= len(set(w["seg_doc"].tolist())) < len(w["seg_doc"])
    assert seen_multi_chunk, "interleaved data should have documents split into chunks within a window"


def test_inspect_outputs(data, tmp_path):
    out = inspect(data, out=tmp_path / "i")
    stats = json.loads((out / "dataset_stats.json").read_text())
    manifest = json.loads((data / "manifest.json").read_text())
    assert stats["tokens"] == manifest["num_tokens"] == sum(v["tokens"] for v in stats["domains"].values())
    assert sum(v["token_share"] for v in stats["domains"].values()) == pytest.approx(1.0)
    assert sum(v["segment_share"] for v in stats["domains"].values()) == pytest.approx(1.0)
    for d, v in stats["domains"].items():
        assert v["documents"] == manifest["stats"]["domains"][d]["documents"]
    assert stats["length_histogram"]["counts"] == manifest["stats"]["length_histogram"]["counts"]
    assert stats["attention_pairs"]["full"] == stats["windows"] * 256 * 257 // 2
    assert 0 < stats["attention_saving"]["intra_doc"] < 1
    png = out / "dataset.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


def test_an_out_that_cannot_be_a_directory_is_one_line(data, tmp_path):
    (tmp_path / "f").write_text("a file")
    r = CliRunner().invoke(app, ["inspect", str(data), "--out", str(tmp_path / "f" / "i")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"--out {tmp_path / 'f' / 'i'}: cannot create the directory (Not a directory)" in " ".join(r.output.split())


def test_a_run_directory_is_inspected_as_the_dataset_it_trains_on(data, tmp_path):
    from lctrain.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.write_config(load_config(None, [f"data.output_dir={data}"]))
    r = CliRunner().invoke(app, ["inspect", str(run), "--out", str(tmp_path / "i")])
    assert r.exit_code == 0, r.output
    assert f"{run} is a run directory; its dataset: {data}" in " ".join(r.output.split())
    reference = inspect(data, out=tmp_path / "reference")
    read = json.loads((tmp_path / "i" / "dataset_stats.json").read_text())
    assert read == json.loads((reference / "dataset_stats.json").read_text())


def test_a_run_directory_whose_dataset_is_gone_says_to_prepare_it(tmp_path):
    from lctrain.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.write_config(load_config(None, [f"data.output_dir={tmp_path / 'gone'}"]))
    r = CliRunner().invoke(app, ["inspect", str(run)])
    assert r.exit_code == 2 and f"error: {tmp_path / 'gone'}: no prepared dataset here" in r.output
    assert "lctrain prepare" in r.output


def test_inspect_cli_missing_dir(tmp_path):
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "lctrain prepare" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_a_domain_asked_for_and_not_written_is_shown_with_its_target(tmp_path):
    """An upsampled mixture too small for every domain: the domains it aimed at and wrote nothing of are rows with 0
    tokens, beside the share prepare aimed at (from the manifest), as prepare's own table shows them."""
    from lctrain.data.prepare import prepare

    overrides = ["data.seq_len=256", "data.token_budget=12000", "data.mixture=upsampled"]
    data = prepare(load_config(None, [*overrides, f"data.output_dir={tmp_path / 'data'}"]))
    targets = {
        d: v["target_tokens_share"]
        for d, v in json.loads((data / "manifest.json").read_text())["stats"]["domains"].items()
    }
    stats = json.loads((inspect(data, out=tmp_path / "i") / "dataset_stats.json").read_text())
    assert {d: v["target_token_share"] for d, v in stats["domains"].items()} == targets
    empty = [d for d, v in stats["domains"].items() if v["tokens"] == 0 and targets[d]]
    assert empty  # the fixture's point: 46 windows cannot hold every domain
    shown = CliRunner().invoke(app, ["inspect", str(data), "--out", str(tmp_path / "j")], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    rows = {line.split("│")[1].strip(): line for line in shown.output.splitlines() if line.count("│") == 8}
    for d in empty:
        assert rows[d].split("│")[5].strip() == "0" and rows[d].split("│")[7].strip() == f"{100 * targets[d]:.1f}%"
