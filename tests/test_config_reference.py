"""docs/config.md is the schema's reference: every key, with a description, and never stale."""

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from lctrain.cli import main
from lctrain.config import Config, SourceConfig
from lctrain.config_reference import REFERENCE_FILE, field_docs, reference_markdown

ROOT = Path(__file__).resolve().parent.parent


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaf_keys(ann, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    if model is Config:  # the keys of each item of a list of sections
        out += _leaf_keys(SourceConfig, "data.sources[].")
    return out


def test_docs_config_md_is_the_generated_reference():
    written = (ROOT / REFERENCE_FILE).read_text(encoding="utf-8")
    assert written == reference_markdown(), f"{REFERENCE_FILE} is stale: regenerate it with `make docs`"


def test_every_key_has_a_row_with_a_description():
    keys = _leaf_keys(Config)
    assert len(keys) > 80
    docs = {d.key: d for d in field_docs()}
    assert sorted(docs) == sorted(keys)
    assert not [k for k, d in docs.items() if not d.description.strip()], "every config field needs a description"
    text = reference_markdown()
    for key in keys:
        assert f"| `{key}` |" in text


def _row(key: str) -> list[str]:
    line = next(line for line in reference_markdown().splitlines() if line.startswith(f"| `{key}` |"))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


@pytest.mark.parametrize(
    "key, domain, default",
    [
        ("seed", "integer in [0, 4294967296)", "`0`"),
        ("data.seed", "integer in [0, 4294967296)", "`0`"),
        ("train.betas", "[finite number in [0, 1), finite number in [0, 1)]", "`[0.9, 0.95]`"),
        ("train.lr", "finite number > 0", "`2.0e-05`"),
        ("train.weight_decay", "finite number ≥ 0", "`0.1`"),
        ("parallel.zero_stage", "integer in [0, 3]", "`2`"),
        ("parallel.backend", "one of `auto`, `nccl`, `gloo`", "`auto`"),
        ("eval.lengths", "non-empty list of (integer ≥ 1)", "`[4096, 8192, 16384, 32768, 65536, 131072]`"),
        ("model.rope_theta", "finite number > 0, or null", "`null`"),
        ("model.tiled_mlp", "`auto` or integer ≥ 0", "`0`"),
        ("model.arch", "mapping, or null", "`{model_type: llama}`"),  # an empty config's default model
    ],
)
def test_rows_give_the_domain_and_default(key, domain, default):
    assert _row(key)[1:3] == [domain, default]


def test_defaults_in_the_reference_are_an_empty_configs():
    defaults = Config().model_dump(mode="json")
    # an item of data.sources: its fields' own defaults, a required one shown as "required"
    defaults["data"]["sources[]"] = {
        n: "required" if f.is_required() else f.default for n, f in SourceConfig.model_fields.items()
    }
    for d in field_docs():
        node = defaults
        for part in d.key.split("."):
            node = node[part]
        assert node == d.default, d.key
        assert yaml.safe_load(_row(d.key)[2].strip("`")) == (list(node) if isinstance(node, tuple) else node)


def test_cli_prints_the_reference(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["show-config", "--reference"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == reference_markdown()
    with pytest.raises(SystemExit) as exc:
        main(["show-config", "--reference", "--set", "train.lr=1"])
    assert exc.value.code == 2
    assert "leave out --config and --set" in capsys.readouterr().err
