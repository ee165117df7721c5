"""What a `--set KEY=VALUE` (and a config file) means: a mapping for a section merges into it, one for a free-form
mapping replaces it; values are YAML 1.2 core scalars (`010` is 10, `yes` and dates are text); a comment or a
non-text value for a text key is refused in one line that says how to quote it."""

import json
import math
import shlex
import typing

import pytest
import yaml
from pydantic import BaseModel

import lctrain.config as config_module
from lctrain.config import (
    REPLACED_WHOLE,
    Config,
    bundled_config_dir,
    bundled_config_names,
    config_fingerprint,
    dump_yaml,
    load_config,
    load_yaml,
    settings,
)
from lctrain.errors import UserError
from lctrain.experiments.extend import eval_settings

# The embedded default config's (lctrain/configs/tiny_anchor.yaml) values, written out: what a --set of one key of a
# section must leave as they are.
TINY_TRAIN = {"steps": 60, "global_batch": 4, "micro_batch": 2, "lr": 1.0e-3, "weight_decay": 0.1, "warmup_steps": 5}
TINY_SYNTHETIC = {"num_docs": 1500, "median_words": 250, "max_words": 20000}
UPSAMPLED = "data.mixture=upsampled"


def _refused(*overrides: str) -> str:
    with pytest.raises(UserError) as err:
        load_config(None, list(overrides))
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def _suggested(msg: str) -> str:
    """The `--set ITEM` a message suggests, as the shell would pass ITEM."""
    return shlex.split(msg.rsplit("--set ", 1)[1].removesuffix(")").split(")")[0])[0]


# ---------------------------------------------------------------- a mapping for a section merges into it


@pytest.mark.parametrize(
    ("override", "section", "given", "kept"),
    [
        ("train={steps: 4}", "train", {"steps": 4}, TINY_TRAIN),
        ("train={lr: 1e-4, warmup_steps: 0}", "train", {"lr": 1e-4, "warmup_steps": 0}, TINY_TRAIN),
        ("data.synthetic={num_docs: 10}", "data.synthetic", {"num_docs": 10}, TINY_SYNTHETIC),
        ("data={synthetic: {num_docs: 10}}", "data.synthetic", {"num_docs": 10}, TINY_SYNTHETIC),
    ],
)
def test_a_mapping_for_a_section_merges_into_it_key_by_key(override, section, given, kept):
    cfg = load_config(None, [override])
    node = settings(cfg)
    for part in section.split("."):
        node = node[part]
    assert node == {**node, **kept, **given}
    # the same config as the keys given one by one
    dotted = [f"{section}.{k}={json.dumps(v)}" for k, v in given.items()]
    assert settings(cfg) == settings(load_config(None, dotted))


def test_a_mapping_for_a_free_form_mapping_replaces_it():
    arch = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96}
    cfg = load_config(None, [f"model.arch={json.dumps(arch)}"])
    assert cfg.model.arch == arch  # tiny_anchor's num_hidden_layers etc. are not kept
    shares = {"C4": 0.5, "CommonCrawl": 0.5}
    for override in (f"data.domain_shares={json.dumps(shares)}", f"data={{domain_shares: {json.dumps(shares)}}}"):
        table9 = load_config(None, [UPSAMPLED, "data.domain_shares={CommonCrawl: 0.3, C4: 0.3, Book: 0.4}"])
        assert table9.data.domain_shares == {"CommonCrawl": 0.3, "C4": 0.3, "Book": 0.4}
        cfg = load_config(None, [UPSAMPLED, "data.domain_shares={CommonCrawl: 0.3, C4: 0.3, Book: 0.4}", override])
        assert cfg.data.domain_shares == shares  # Book's 0.4 is gone, not kept beside them
    two = load_config(None, ["model.rope_scaling={rope_type: linear, factor: 2.0}", "model.rope_scaling={factor: 4.0}"])
    assert two.model.rope_scaling == {"factor": 4.0}
    assert load_config(None, ["model={rope_scaling: {factor: 4.0}}"]).model.rope_scaling == {"factor": 4.0}


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield prefix + name, field
        for arg in [field.annotation, *typing.get_args(field.annotation)]:
            if isinstance(arg, type) and issubclass(arg, BaseModel) and typing.get_origin(arg) is None:
                yield from _fields(arg, f"{prefix}{name}.")


def test_every_free_form_mapping_of_the_schema_is_replaced_whole_and_every_section_merged():
    """`base:` and `--set` merge sections and replace free-form mappings by one list (REPLACED_WHOLE): a mapping field
    added to the schema must be in it, or a file or a --set would silently keep the old mapping's other entries."""
    mappings, sections = [], []
    for key, field in _fields(Config):
        options = [typing.get_origin(a) or a for a in [field.annotation, *typing.get_args(field.annotation)]]
        if dict in options:
            mappings.append(key)
        if any(isinstance(a, type) and issubclass(a, BaseModel) for a in options):
            sections.append(key)
    assert sorted(mappings) == ["data.domain_shares", "model.arch", "model.rope_scaling"]
    assert {k.rsplit(".", 1)[-1] for k in mappings} == set(REPLACED_WHOLE)
    assert {"data", "data.synthetic", "train", "eval", "logging.profile"} <= set(sections)
    # data.sources is a list of sections: a list replaces, it does not merge
    assert "data.sources" not in sections


def test_a_complete_eval_dump_as_experiment_extend_passes_it_gives_the_same_config_as_replacing_eval():
    """`lctrain experiment extend` runs `lctrain eval RUN --set eval=<json.dumps(eval_settings(cfg))>`: merging the
    whole dump must leave no value of the run's own eval section behind (its tasks list included)."""
    for other in (["eval.lengths=[2048]", "eval.samples_per_task=3", "eval.exclude=[cwe]"], ["eval.ppl_windows=0"]):
        now = eval_settings(load_config("llama2_64k_anchor", other))
        assert now["tasks"] is None
        run = load_config(None)
        assert run.eval.tasks == ["niah_single_1", "vt", "fwe"]  # tiny_anchor's own, which the dump clears
        merged = load_config(None, [f"eval={json.dumps(now)}"])
        assert settings(merged) == {**settings(run), "eval": now}
        assert config_fingerprint(merged) == config_fingerprint(Config.model_validate({**settings(run), "eval": now}))


# ---------------------------------------------------------------- YAML 1.2 core scalars


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("010", 10),
        ("011", 11),
        ("007", 7),
        ("-12", -12),
        ("+5", 5),
        ("0o10", 8),
        ("0x1F", 31),
        ("1.5", 1.5),
        ("1.", 1.0),
        (".5", 0.5),
        ("1e5", 100000.0),
        ("1E-4", 0.0001),
        ("2.0e-05", 2e-05),
        ("-.inf", -math.inf),
        (".Inf", math.inf),
        ("true", True),
        ("True", True),
        ("FALSE", False),
        ("null", None),
        ("~", None),
        ("", None),
        # YAML 1.1's implicit types, text now
        ("1:00", "1:00"),
        ("2024-01-01", "2024-01-01"),
        ("2024-01-01 12:00:00", "2024-01-01 12:00:00"),
        ("yes", "yes"),
        ("No", "No"),
        ("on", "on"),
        ("OFF", "OFF"),
        ("y", "y"),
        ("1_000", "1_000"),
        ("0b101", "0b101"),
        ("tRue", "tRue"),
        ("0X1F", "0X1F"),
        ("-0x1F", "-0x1F"),
        ("!!str 010", "010"),
        ("'010'", "010"),
        ("[010, yes, 1e3]", [10, "yes", 1000.0]),
        ("{on: 1, 2024-01-01: off}", {"on": 1, "2024-01-01": "off"}),
    ],
)
def test_yaml_reads_core_schema_scalars(text, value):
    got = load_yaml(text)
    assert got == value and type(got) is type(value)


def test_yaml_nan_and_refusals():
    assert math.isnan(load_yaml(".nan")) and math.isnan(load_yaml(".NaN"))
    for bad in ("!!bool yes", "!!int abc", "{a: 1, a: 2}"):
        with pytest.raises(yaml.YAMLError):
            load_yaml(bad)


@pytest.mark.parametrize(
    ("override", "key", "before", "now"),
    [
        ("seed=010", "seed", 8, 10),  # `printf %03d` seeds 010 and 008 were both 8
        ("seed=011", "seed", 9, 11),
        ("seed=0o10", "seed", 8, 8),
        ("train.lr=1e-4", "train.lr", 1e-4, 1e-4),  # a string pydantic read as a float, a float now
        ("description=yes", "description", "refused: True is not a string", "yes"),
        ("name=2024-01-01", "name", "refused: a date is not a string", "2024-01-01"),
    ],
)
def test_set_values_as_yaml_1_2(override, key, before, now):
    cfg = load_config(None, [override])
    node = settings(cfg)
    for part in key.split("."):
        node = node[part]
    assert node == now and type(node) is type(now)


@pytest.mark.parametrize("value", ["yes", "on", "y", "1", "'true'"])
def test_a_boolean_is_true_or_false_only(value):
    """YAML 1.1's yes/on, text, and numbers were read as true by pydantic's lax mode (config explorer)."""
    assert "model.rope_fp32 = " in _refused(f"model.rope_fp32={value}")
    assert "not a boolean; expected true or false" in _refused(f"model.rope_fp32={value}")


def test_sexagesimal_is_not_a_number():
    assert "train.steps = '1:00'" in _refused("train.steps=1:00")  # YAML 1.1: 60


def test_a_config_file_reads_yaml_1_2_too(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: tiny_anchor\nname: 2024-01-01\ndescription: yes\nseed: 010\ntrain:\n  lr: 1e-4\n")
    cfg = load_config(str(path))
    assert (cfg.name, cfg.description, cfg.seed, cfg.train.lr) == ("2024-01-01", "yes", 10, 1e-4)


# text that yaml.safe_dump writes plain because YAML 1.1 reads it as text, and YAML 1.2 reads as a number
AMBIGUOUS_TEXT = ["08", "09", "1e5", "1e-5", "1.5e3", "0o17", "+.5", "-.5"]


@pytest.mark.parametrize("text", [*AMBIGUOUS_TEXT, "010", "yes", "2024-01-01", "1:00", "null", "~", "", "x #y", "x"])
def test_dump_yaml_writes_text_both_yaml_versions_read_back_as_text(text):
    written = dump_yaml({"name": text})
    assert load_yaml(written) == {"name": text} == yaml.safe_load(written)


def test_a_config_with_ambiguous_text_round_trips_through_dump_yaml(tmp_path):
    assert all(load_yaml(yaml.safe_dump(text)) != text for text in AMBIGUOUS_TEXT)  # what dump_yaml is for
    cfg = load_config(None, ['name="08"', 'description="1e5"', 'logging.wandb_project="0o17"'])
    assert (cfg.name, cfg.description) == ("08", "1e5")
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(settings(cfg), sort_keys=False))
    assert settings(load_config(str(path))) == settings(cfg)


@pytest.mark.parametrize("name", bundled_config_names())
def test_a_bundled_config_loads_as_it_did_under_yaml_safe_load(name, monkeypatch):
    cfg = load_config(name)
    monkeypatch.setattr(config_module, "load_yaml", yaml.safe_load)  # the reader before YAML 1.2
    before = load_config(name)
    assert settings(cfg) == settings(before)
    assert config_fingerprint(cfg) == config_fingerprint(before)


def test_every_bundled_yaml_file_reads_as_under_yaml_safe_load():
    files = sorted(bundled_config_dir().glob("*.yaml"))  # the `_` bases too
    assert len(files) > len(bundled_config_names())
    for path in files:
        text = path.read_text()
        assert load_yaml(text) == yaml.safe_load(text), path.name


# ---------------------------------------------------------------- refused, with how to quote it


@pytest.mark.parametrize(
    ("override", "dropped", "meant"),
    [
        ("description=x #y", "'#y'", "x #y"),
        ("description=#3", "'#3'", "#3"),
        ("data.path=/data/run #3", "'#3'", "/data/run #3"),
        ("description=[run 1] # the second", "'# the second'", None),
        ("train.betas=[0.9, 0.95] # the paper's", '"# the paper\'s"', None),
    ],
)
def test_a_comment_in_a_set_value_is_refused_with_how_to_quote_it(override, dropped, meant):
    msg = _refused(override)
    assert msg.startswith(f"--set '{override}': ") and "starts a YAML comment" in msg and f"drop {dropped}" in msg
    if meant is None:  # not text: the value without its comment is the fix
        return
    fixed = _suggested(msg)
    key = override.split("=", 1)[0]
    node = settings(load_config(None, [fixed, "data.source=local"] if key == "data.path" else [fixed]))
    for part in key.split("."):
        node = node[part]
    assert node == meant


def test_a_hash_inside_text_or_quotes_is_kept():
    assert load_config(None, ["description=a#b"]).description == "a#b"
    assert load_config(None, ['description="x #y"']).description == "x #y"
    assert load_config(None, ["description='x #y'"]).description == "x #y"
    assert load_config(None, ["eval.exclude=['cwe']"]).eval.exclude == ["cwe"]
    # a tab before '#' is no YAML PyYAML reads: the value is its text, whole, as any value YAML cannot read
    assert load_config(None, ["description=run 1\t# the second"]).description == "run 1\t# the second"


@pytest.mark.parametrize(
    ("override", "read_as", "meant"),
    [
        ("name=0123", "0123 as the int 123", "0123"),
        ("name=12", "12 as the int 12", "12"),
        ("description=true", "true as the boolean true", "true"),
        ("description=null", "null as null (no value)", "null"),
        ("data.tokenizer=1e5", "1e5 as the float 100000.0", "1e5"),
    ],
)
def test_a_non_text_value_for_a_text_key_is_refused_with_how_to_quote_it(override, read_as, meant):
    msg = _refused(override)
    key = override.split("=", 1)[0]
    assert msg.startswith(f"--set {override}: {key} takes text, and YAML reads {read_as}; quote it: --set ")
    node = settings(load_config(None, [_suggested(msg)]))
    for part in key.split("."):
        node = node[part]
    assert node == meant


def test_a_non_text_value_inside_a_section_mapping_is_named():
    msg = _refused("data={tokenizer: 12}")
    assert msg == (
        "--set data={tokenizer: 12}: data.tokenizer takes text, and YAML reads its value as the int 12; quote it"
    )


def test_null_for_a_key_that_may_be_null_still_clears_it():
    assert load_config(None, ["model.name_or_path=null", "model.name_or_path=~"]).model.name_or_path is None
    assert load_config(None, ["eval.tasks=null"]).eval.tasks is None


def test_a_key_twice_in_a_set_mapping_is_refused():
    assert _refused("train={steps: 4, steps: 5}") == (
        "--set 'train={steps: 4, steps: 5}': key 'steps' appears twice in one mapping"
    )


def test_a_written_config_reads_back_the_same_whatever_its_strings_look_like(tmp_path):
    """A run's config.yaml (`write_resolved`, `to_yaml`) holds text that YAML 1.2 would read as numbers, quoted: a run
    named "08" resumes as "08"."""
    from lctrain.config import config_fingerprint, write_resolved

    cfg = load_config(None, ["name='08'", "description='1e5'"])
    again = load_config(str(write_resolved(cfg, tmp_path)))
    assert (again.name, again.description) == ("08", "1e5")
    assert config_fingerprint(again) == config_fingerprint(cfg)


def test_an_evaluation_length_named_twice_is_refused():
    """`eval.lengths=[4096,4096]` was accepted (config explorer): a length scored twice, or a typo for another."""
    assert "eval.lengths names 4096 more than once" in _refused("eval.lengths=[4096,8192,4096]")
