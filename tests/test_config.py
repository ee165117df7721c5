"""The config tree: loading, `base:` inheritance, overrides, validation errors, fingerprints."""

import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

import lctrain
from lctrain.cli import main
from lctrain.config import (
    apply_overrides,
    bundled_config_names,
    config_fingerprint,
    data_dir,
    data_fingerprint,
    load_config,
    max_steps,
    reread_warning,
    run_dir,
    settings,
    settings_changes,
    write_resolved,
)
from lctrain.errors import UserError
from lctrain.parallel.groups import pick_backend
from lctrain.parallel.layout import layout_of


def _write(path, obj):
    path.write_text(yaml.safe_dump(obj))
    return path


def test_default_is_the_embedded_tiny_config():
    cfg = load_config()
    assert cfg.name == "tiny_anchor"
    assert cfg.data.source == "synthetic" and cfg.model.arch is not None
    assert cfg.source_file.endswith("tiny_anchor.yaml")


def test_overrides_parse_yaml_values_and_create_nested_keys():
    cfg = load_config(
        None,
        [
            "data.seq_len=2048",
            "train.betas=[0.8, 0.9]",
            "attention.mode=full",
            "model.rope_scaling={type: linear, factor: 2.0}",
        ],
    )
    assert cfg.data.seq_len == 2048
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.attention.mode == "full"
    assert cfg.model.rope_scaling == {"type": "linear", "factor": 2.0}


def test_base_inheritance_merges_sections_key_by_key(tmp_path):
    _write(
        tmp_path / "_base.yaml",
        {
            "name": "b",
            "data": {"seq_len": 4096, "mixture": "upsampled"},
            "model": {"arch": {"model_type": "llama", "hidden_size": 64}},
        },
    )
    child = _write(
        tmp_path / "child.yaml",
        {"base": "_base.yaml", "name": "c", "data": {"seq_len": 8192}, "model": {"arch": {"model_type": "mistral"}}},
    )
    cfg = load_config(str(child))
    assert cfg.name == "c"
    assert cfg.data.seq_len == 8192 and cfg.data.mixture == "upsampled"
    # an architecture dict is replaced whole, never merged field by field: a mix of two models is no model
    assert cfg.model.arch == {"model_type": "mistral"}


def test_a_base_is_found_beside_its_config_wherever_lctrain_runs(tmp_path, monkeypatch):
    """A `base:` missing beside its file was read from the working directory: the same config meant another run
    depending on where lctrain started (config explorer)."""
    _write(tmp_path / "user_base.yaml", {"base": "tiny_anchor", "train": {"steps": 3}})
    (tmp_path / "sub").mkdir()
    child = _write(tmp_path / "sub" / "child.yaml", {"base": "user_base.yaml"})
    monkeypatch.chdir(tmp_path)  # where a user_base.yaml is, but not beside child.yaml
    with pytest.raises(UserError, match=r"^config 'user_base.yaml' not found \(neither a file beside the config whose"):
        load_config(str(child))
    _write(tmp_path / "sub" / "beside.yaml", {"base": "../user_base.yaml"})
    assert load_config(str(tmp_path / "sub" / "beside.yaml")).train.steps == 3


@pytest.mark.parametrize("name", ["llama2_64k_anchr", "LLAMA2_64K_ANCHOR"])
def test_a_mistyped_bundled_config_name_is_answered_with_the_near_one(name):
    with pytest.raises(UserError, match=r"did you mean 'llama2_64k_anchor'\? run 'lctrain configs'"):
        load_config(name)


def test_base_loop_is_reported(tmp_path):
    _write(tmp_path / "a.yaml", {"base": "b.yaml"})
    _write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(UserError, match="loops"):
        load_config(str(tmp_path / "a.yaml"))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("attention.mode=anchr", r"attention.mode = 'anchr' is not allowed; expected 'full', 'intra_doc'"),
        ("data.mixtur=natural", r"unknown key 'data.mixtur'; did you mean 'mixture'\? allowed keys here: source, path"),
        ("train.lr=-1", r"train.lr = -1: Input should be greater than 0"),
        ("data.source=local", r"data: data.path is required"),
        # a path without data.source=local was ignored: the synthetic corpus trained instead of the user's files
        ("data.path=corpus.jsonl", r"data: data.path is read only when data.source is 'local', and it is 'synthetic'"),
        ("data.hub_name=me/corpus", r"data: data.hub_name is read only when data.source is 'hub', and it is 'synth"),
        (
            "model.name_or_path=x",
            r"model: both model.name_or_path .* set model.arch=null \(e.g. --set model.arch=null\)$",
        ),
        ("model.arch=null", r"model: set one of model.name_or_path \(hub name or directory\) and model.arch$"),
        ("bogus=1", r"unknown key 'bogus'"),
        ("train.steps=true", r"train.steps = True: a boolean; expected a number"),
        ("logging.peak_tflops=false", r"logging.peak_tflops = False: a boolean; expected a number"),
    ],
)
def test_bad_values_name_file_key_and_allowed_values(override, expected, tmp_path):
    """A bad value is named where it was written: the --set that gave it, or the config file."""
    with pytest.raises(UserError, match=expected) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert msg.startswith(f"--set {override}: ") and "\n" not in msg
    key, value = override.split("=")
    path = tmp_path / "mine.yaml"
    tiny = str(Path(lctrain.__file__).parent / "configs" / "tiny_anchor.yaml")
    path.write_text(yaml.safe_dump(apply_overrides({"base": tiny}, [f"{key}={value}"])))
    with pytest.raises(UserError, match=expected) as err:
        load_config(str(path), ["seed=3"])
    assert str(err.value).startswith(f"{path}: ")


def test_a_sections_rule_names_the_set_it_is_about_not_its_neighbours():
    """A rule across data's fields names the --set that gave the key its message names, not every --set of data (a
    --set data.seed beside it was blamed too: data explorer)."""
    with pytest.raises(UserError) as err:
        load_config(None, ["data.seed=3", "data.short_doc_tokens=10", "train.steps=2"])
    assert str(err.value).startswith("--set data.short_doc_tokens=10: data: data.short_doc_tokens down-sample")


def test_bad_override_syntax_and_missing_config():
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_config(None, ["data.seq_len"])
    with pytest.raises(UserError, match="not found"):
        load_config("no_such_config")
    with pytest.raises(UserError, match="is a value, not a section"):
        load_config(None, ["seed.x=1"])


def test_a_directory_given_as_config_names_the_config_inside(tmp_path):
    from lctrain.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.write_config(load_config(None))
    with pytest.raises(UserError) as err:
        load_config(str(run))
    assert str(err.value) == f"config '{run}' is a directory; its config is {run}/config.yaml"
    with pytest.raises(UserError) as err:
        load_config(str(tmp_path))
    assert str(err.value) == f"config '{tmp_path}' is a directory; give a YAML file"


def test_invalid_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndata:\n  seq_len: [1, 2\n")
    with pytest.raises(UserError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(str(bad))


def test_files_that_are_not_configs(tmp_path):
    cases = {
        "empty.yaml": (b"", r"empty.yaml: the config is empty; give at least 'base: tiny_anchor'"),
        "dup.yaml": (
            b"base: tiny_anchor\ntrain:\n  steps: 5\n  steps: 6\n",
            r"dup.yaml:4: invalid YAML \(key 'steps' appears twice in one mapping\)",
        ),
        "bytes.yaml": (bytes(range(128, 256)), r"bytes.yaml: not UTF-8 text"),
        "utf16.yaml": ("base: tiny_anchor\n".encode("utf-16"), r"utf16.yaml: not UTF-8 text"),
    }
    for name, (content, match) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=match):
            load_config(str(tmp_path / name))
    bom = tmp_path / "bom.yaml"  # a UTF-8 byte-order mark (Windows editors) is not an error
    bom.write_bytes("\ufeffbase: tiny_anchor\ntrain:\n  steps: 5\n".encode("utf-8"))
    assert load_config(str(bom)).train.steps == 5


def test_fingerprints_separate_data_from_training_settings():
    a = load_config()
    b = load_config(None, ["train.lr=0.5", "data.num_workers=3", "data.output_dir=/tmp/x"])
    c = load_config(None, ["data.seq_len=2048"])
    assert data_fingerprint(a.data) == data_fingerprint(b.data) != data_fingerprint(c.data)
    assert config_fingerprint(a) != config_fingerprint(b)
    assert data_dir(a) == data_dir(load_config(None, ["train.steps=3"]))
    assert data_dir(b).as_posix() == "/tmp/x"
    assert run_dir(a).name == "tiny_anchor"


def test_a_data_key_added_later_keeps_old_fingerprints_at_its_default(monkeypatch):
    """A dataset prepared before a data key existed keeps its directory name under an lctrain that has the key, as
    long as the key is at its default; set away from it, the key makes another dataset."""
    import lctrain.config as config

    assert set(config._DATA_FINGERPRINT_KEYS) <= set(config.DataConfig.model_fields)
    # min_doc_tokens plays a key added after the fingerprint's keys were fixed
    later = tuple(k for k in config._DATA_FINGERPRINT_KEYS if k != "min_doc_tokens")
    monkeypatch.setattr(config, "_DATA_FINGERPRINT_KEYS", later)
    cfg = load_config()
    before = cfg.data.model_dump(
        mode="json", exclude={"num_workers", "output_dir", "strict", "shard_tokens", "sources", "min_doc_tokens"}
    )
    old = hashlib.sha256(json.dumps(before, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert data_fingerprint(cfg.data) == old
    changed = load_config(None, [f"data.min_doc_tokens={cfg.data.min_doc_tokens + 1}"])
    assert data_fingerprint(changed.data) != old


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["data.seq_len=512", "attention.mode=intra_doc"])
    path = write_resolved(cfg, tmp_path)
    again = load_config(str(path))
    assert config_fingerprint(again) == config_fingerprint(cfg)
    assert path.read_text().startswith(f"# resolved lctrain config; fingerprint {config_fingerprint(cfg)}")


def test_every_bundled_config_reloads_from_its_resolved_yaml_and_lays_out(tmp_path):
    """What a run keeps of a bundled config (its resolved YAML) reloads to the same settings, every one that
    fingerprints the run and its prepared data, and its ranks split into whole sequence-parallel groups, each rank an
    equal slice of a window."""
    names = bundled_config_names()
    assert "tiny_anchor" in names
    for name in names:
        cfg = load_config(name)
        again = load_config(str(write_resolved(cfg, tmp_path / name)))
        assert settings(again) == settings(cfg), name
        layout = layout_of(cfg)
        assert layout.dp * layout.sp == cfg.parallel.world and cfg.data.seq_len % layout.sp == 0, name


def test_cli_bad_config_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["show-config", "--set", "attention.mode=nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "attention.mode" in err and len(err.splitlines()) == 1


# The bounds as docs/config.md states them: 10^9 steps, 2^20 windows a step.
STEP_COUNTS = (
    "train.steps",
    "train.warmup_steps",
    "checkpoint.every_steps",
    "checkpoint.hf_every",
    "checkpoint.hf_last",
    "logging.log_every",
    "logging.profile.steps",
)


@pytest.mark.parametrize(
    "key, most",
    [(k, 1_000_000_000) for k in STEP_COUNTS] + [("train.global_batch", 2**20), ("train.micro_batch", 2**20)],
)
def test_step_counts_and_batches_have_an_upper_bound_named_in_one_line(key, most, capsys):
    """A fuzzed `--set train.steps=10**18` was accepted and trained on as a run of years; the bounds are past any real
    run and keep a run's counts exact in float64 and int64."""
    assert _get(load_config(None, [f"{key}={most}"]), key) == most
    for value in (most + 1, 10**18, 2**63, 10**30):
        with pytest.raises(SystemExit) as exc:
            main(["show-config", "--set", f"{key}={value}"])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --set {key}={value}: {key} = {value}: Input should be less than or equal to {most}"


def test_the_longest_run_at_the_largest_batch_counts_its_windows_exactly():
    cfg = load_config(None, ["train.steps=1000000000", "train.global_batch=1048576", "train.micro_batch=1"])
    windows = cfg.windows_read()
    assert windows == 1_000_000_000 * 1_048_576 and windows < 2**53  # exact as a float64 too
    assert int(float(windows)) == windows and int(float(windows - 1)) == windows - 1


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _show_config(capsys, args: list[str]) -> str:
    """What `lctrain show-config ARGS` prints (exit code 0)."""
    with pytest.raises(SystemExit) as exc:
        main(["show-config", *args])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    return out


def _line_comments(out: str) -> dict[str, str]:
    """The comment at the end of each key's line of show-config's YAML by dotted key: what a null or auto is."""
    path: list[str] = []
    comments = {}
    for line in out.splitlines():
        found = re.match(r"( *)(\w+):( .*)?$", line)
        if found:
            indent, key, rest = found[1], found[2], found[3] or ""
            path[len(indent) // 2 :] = [key]
            if "  # " in rest:
                comments[".".join(path)] = rest.split("  # ", 1)[1]
    return comments


def test_cli_show_config_prints_resolved_yaml(capsys):
    out = _show_config(capsys, ["--set", "data.seq_len=4096"])
    shown = yaml.safe_load(out)
    assert shown["data"]["seq_len"] == 4096
    assert shown == settings(load_config(None, ["data.seq_len=4096"]))


@pytest.mark.parametrize(
    "name, items",
    [
        (None, []),
        ("tiny_anchor_sp2", ["eval.tasks=null", "attention.engine=auto", "model.tiled_mlp=auto", "data.seq_len=512"]),
        ("llama2_64k_table2_yarn_5m", ["model.rope_theta=null", "eval.exclude=[cwe]", "train.run_dir=null"]),
    ],
)
def test_cli_show_config_output_loads_as_the_same_config(capsys, tmp_path, name, items):
    """`lctrain show-config > frozen.yaml` keeps the config's own values (a null or auto stays so; what it resolves to
    on this machine is a comment), so `-c frozen.yaml` is the same config: same settings, fingerprint and prepared data
    directory, and showing it again prints the same YAML. A run directory's copy has no comments."""
    args = [*(["-c", name] if name else []), *[a for item in items for a in ("--set", item)]]
    cfg = load_config(name, items)
    out = _show_config(capsys, args)
    assert yaml.safe_load(out) == settings(cfg)
    assert out.startswith(f"# resolved lctrain config; fingerprint {config_fingerprint(cfg)}\n")
    comments = _line_comments(out)
    assert comments["data.output_dir"] == str(data_dir(cfg)) and comments["train.run_dir"] == str(run_dir(cfg))
    assert comments["parallel.backend"].startswith(f"{pick_backend(cfg)} on this machine (nccl with CUDA, else gloo)")
    frozen = tmp_path / "frozen.yaml"
    frozen.write_text(out)
    again = load_config(str(frozen))
    assert config_fingerprint(again) == config_fingerprint(cfg) and data_dir(again) == data_dir(cfg)
    assert _show_config(capsys, ["-c", str(frozen)]) == out
    written = write_resolved(cfg, tmp_path / "run").read_text()
    fingerprint = f"# resolved lctrain config; fingerprint {config_fingerprint(cfg)}\n"
    assert written == fingerprint + yaml.safe_dump(settings(cfg), sort_keys=False)


def test_cli_show_config_shows_the_values_used(capsys):
    """What a null or auto resolves to (a random init's Table 1 base and training length, the tokenizer's anchor) as
    a comment at the end of its line, not in the header, and the changes training makes to the model's config as
    comment lines."""
    out = _show_config(capsys, ["--set", "data.seq_len=65536", "--set", "model.rope_theta=null"])
    shown, comments = yaml.safe_load(out), _line_comments(out)
    assert shown["model"]["rope_theta"] is None and shown["data"]["anchor"] == "auto"
    assert comments["model.rope_theta"] == "5000000.0" and comments["model.max_position_embeddings"] == "65536"
    assert comments["model.rope_scaling"] == "{rope_type: default}" and comments["data.anchor"].startswith("<s> ")
    assert "#   rope_parameters.rope_theta: 10000.0 -> 5000000.0 (the paper's Table 1 base for data.seq_len" in out
    assert "\n  anchor: auto  # <s> (id 1; auto: the BOS the tokenizer puts before every text)\n" in out
    assert "# data.anchor" not in out and "# parallel.backend" not in out


def test_cli_show_config_shortens_a_long_list_in_its_comment(capsys):
    out = _show_config(capsys, ["--set", "eval.tasks=null", "--set", "eval.exclude=[]"])
    comment = _line_comments(out)["eval.tasks"]
    assert yaml.safe_load(out)["eval"]["tasks"] is None
    assert comment.startswith("[niah_single_1, niah_single_2, ") and comment.endswith(" more]") and len(comment) <= 100
    shown, more = comment[1:-1].split(", ... ")
    assert len(shown.split(", ")) + int(more.split()[0]) == 13


@pytest.mark.parametrize(
    "items, value, comment, note",
    [
        (["model.gradient_checkpointing=true"], None, "full (model.gradient_checkpointing: true)", None),
        (
            ["model.checkpointing=selective"],
            "selective",
            None,
            "# model.checkpointing: selective (model.gradient_checkpointing is not read)",
        ),
    ],
)
def test_cli_show_config_says_which_checkpointing_switch_decides(capsys, items, value, comment, note):
    out = _show_config(capsys, [a for item in items for a in ("--set", item)])
    assert yaml.safe_load(out)["model"]["checkpointing"] == value
    assert _line_comments(out).get("model.checkpointing") == comment
    assert (note in out) if note else "is not read" not in out


def test_cli_show_config_refuses_what_train_refuses_and_notes_what_another_machine_resolves(capsys):
    """An architecture that cannot be built is `train`'s one-line refusal (it was a note saying it would be resolved
    when the model is loaded); an engine this CPU cannot run is a note, as the GPU machine that trains resolves it."""
    with pytest.raises(SystemExit) as exc:
        main(["show-config", "--set", "model.arch.num_attention_heads=3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: model.arch: cannot build a 'llama' config") and "attention heads (3)" in err
    out = _show_config(capsys, ["--set", "attention.engine=varlen"])
    assert yaml.safe_load(out)["attention"]["engine"] == "varlen" and "attention.engine" not in _line_comments(out)
    assert "# model settings left null: resolved when the model is loaded (on this machine: attention.engine" in out


UPSAMPLED = "data.mixture=upsampled"


@pytest.mark.parametrize(
    "shares, message",
    [
        ("{C4: 0.5, Foo: 0.5}", "data.domain_shares: unknown domain 'Foo'; known domains: CommonCrawl, C4, GitHub"),
        ("{C4: -0.5, GitHub: 1.5}", "data.domain_shares: C4 = -0.5: a share is a number >= 0"),
        ("{C4: true}", "data.domain_shares: C4 = True: a share is a number >= 0"),
        ("{C4: '0.5', GitHub: 0.5}", "data.domain_shares: C4 = '0.5': a share is a number >= 0"),
        ("{C4: .nan, GitHub: 1.0}", "data.domain_shares: C4 = nan: a share is a number >= 0"),
        ("{C4: 0.5, GitHub: 0.4}", "data.domain_shares: the shares sum to 0.9; they must sum to 1 (within 0.01 for 2"),
        ("{}", "data.domain_shares: expected a mapping of domain -> token share"),
        ("0.5", "data.domain_shares = 0.5: expected a mapping of domain -> token share"),
    ],
)
def test_domain_shares_refuses_bad_input_in_one_line(shares, message):
    with pytest.raises(UserError) as err:
        load_config(None, [UPSAMPLED, f"data.domain_shares={shares}"])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_domain_shares_need_the_upsampled_mixture():
    with pytest.raises(UserError, match="data: data.domain_shares sets the targets of mixture 'upsampled'"):
        load_config(None, ["data.domain_shares={C4: 1.0}"])


def test_domain_shares_accept_rounded_tables():
    # Table 1's whole percents sum to 102% (7 shares, each off by at most 0.5%); Table 9's to 99.98%
    table1 = (
        "{CommonCrawl: 0.58, C4: 0.20, GitHub: 0.07, ArXiv: 0.06, Book: 0.05, Wikipedia: 0.04, StackExchange: 0.02}"
    )
    assert load_config(None, [UPSAMPLED, f"data.domain_shares={table1}"]).data.domain_shares["C4"] == 0.20
    table9 = (
        "{CommonCrawl: 0.5814, C4: 0.1953, GitHub: 0.0661, ArXiv: 0.0586, Book: 0.0469, Wikipedia: 0.0351, "
        "StackExchange: 0.0164}"
    )
    assert load_config(None, [UPSAMPLED, f"data.domain_shares={table9}"]).data.domain_shares["Book"] == 0.0469
    with pytest.raises(UserError, match="sum to 1.08"):
        load_config(None, [UPSAMPLED, "data.domain_shares={C4: 0.58, CommonCrawl: 0.50}"])


def test_domain_shares_in_a_config_replace_its_base_shares(tmp_path):
    base = _write(
        tmp_path / "base.yaml",
        {"base": "tiny_anchor", "data": {"mixture": "upsampled", "domain_shares": {"C4": 0.5, "CommonCrawl": 0.5}}},
    )
    child = _write(tmp_path / "child.yaml", {"base": str(base), "data": {"domain_shares": {"GitHub": 1.0}}})
    assert load_config(str(child)).data.domain_shares == {"GitHub": 1.0}


def test_weight_decay_of_norms_and_biases_is_opt_in():
    assert load_config().train.decay_norms_and_biases is False
    assert load_config(None, ["train.decay_norms_and_biases=true"]).train.decay_norms_and_biases is True


def test_reread_warning_counts_the_steps_that_read_windows_twice():
    # the paper's 128K recipe on a 2.0B-token budget: 2000 x 8 x 131,072 = 2,097,152,000 tokens wanted,
    # 2,000,000,000 // 131,072 = 15,258 windows there; 15,258 // 8 = 1,907 steps read fresh windows
    cfg = load_config(
        None, ["data.seq_len=131072", "data.token_budget=2000000000", "train.steps=2000", "train.global_batch=8"]
    )
    line = reread_warning(cfg, 15_258)
    assert line == (
        "warning: 2,000 steps x 8 windows x 131,072 tokens = 2,097,152,000 tokens, 97,255,424 more than "
        "the data has (15,258 windows, 1,999,896,576 tokens): the last 93 steps re-read windows; set "
        "data.token_budget=2098200576 (and prepare again) or lower train.steps"
    )
    assert reread_warning(cfg, 16_000) is None
    assert "the last step re-reads windows; " in reread_warning(cfg, 15_999)
    # the input ran out before the budget: a larger budget would change nothing, more data or fewer steps would;
    # the steps leave eval.ppl_windows (8) held out: (15,258 - 8) // 8
    ran_out = (
        "; the input ran out before data.token_budget: add input data (and prepare again) or set train.steps=1906 "
        "(which leaves eval.ppl_windows = 8 unread for perplexity)"
    )
    assert reread_warning(cfg, 15_258, source_exhausted=True).endswith(ran_out)
    enough_budget = load_config(
        None, ["data.seq_len=131072", "data.token_budget=3000000000", "train.steps=2000", "train.global_batch=8"]
    )
    assert reread_warning(enough_budget, 15_258).endswith(ran_out)
    # a resume continues on its dataset (a data change is refused): fewer steps alone help, or nothing
    assert reread_warning(cfg, 15_258, resuming=True).endswith(
        "steps re-read windows; set train.steps=1906 (which leaves eval.ppl_windows = 8 unread for perplexity)"
    )
    three = load_config(None, ["data.seq_len=1024", "train.steps=100", "train.global_batch=8", "eval.ppl_windows=8"])
    assert reread_warning(three, 3, resuming=True).endswith(
        "re-read windows; a resume continues on this dataset: start the run over on more data to read each window once"
    )


def _fix_of(line: str) -> str:
    return line.split(" windows; ", 1)[1]


@pytest.mark.parametrize(
    ("windows", "overrides", "fix"),
    [
        # 10 windows, 8 held out for perplexity: 2 left, fewer than one step's 8
        (10, [], "or set train.global_batch=2 or set eval.ppl_windows=2"),
        # 2 data-parallel ranks x micro-batch 1: a global batch of 3 would not split evenly
        (11, ["parallel.nproc_per_node=2"], "or set train.global_batch=2 or set eval.ppl_windows=3"),
        (11, ["parallel.nproc_per_node=4"], "or set eval.ppl_windows=3"),
        # fewer windows than one step and than the held-out ones: no single setting helps
        (3, [], ""),
    ],
)
def test_reread_warning_without_one_step_of_data_names_what_helps(windows, overrides, fix):
    """train.steps must be >= 1, so when the windows hold no whole step besides the held-out ones the advice is more
    data or a smaller batch or held-out set, each value computed to give one step."""
    settings = ["data.seq_len=1024", "data.token_budget=1000000", "train.steps=100", "train.global_batch=8"]
    settings += ["train.micro_batch=1", "eval.ppl_windows=8", *overrides]
    line = reread_warning(load_config(None, settings), windows, source_exhausted=True)
    ran_out = "the input ran out before data.token_budget: add input data (and prepare again)"
    assert _fix_of(line) == f"{ran_out} {fix}".strip()
    for value in fix.split(" or set ")[1:]:
        cfg = load_config(None, [*settings, value])
        assert max_steps(windows, cfg.eval.ppl_windows, cfg.train.global_batch) >= 1, value


def test_reread_warning_with_too_small_a_budget_for_one_step_names_no_fewer_steps():
    base = ["data.seq_len=1024", "train.steps=2000", "train.global_batch=8", "eval.ppl_windows=8"]
    cfg = load_config(None, [*base, "data.token_budget=4096"])
    assert _fix_of(reread_warning(cfg, 4)) == "set data.token_budget=16392192 (and prepare again)"
    cfg = load_config(None, [*base, "data.token_budget=12288"])
    assert _fix_of(reread_warning(cfg, 12)) == (
        "set data.token_budget=16392192 (and prepare again) or set train.global_batch=4 or set eval.ppl_windows=4"
    )


def test_with_overrides_derives_a_validated_config():
    from lctrain.config import with_overrides

    cfg = load_config("tiny_anchor")
    derived = with_overrides(cfg, ["data.seq_len=512", "attention.mode=full"], "a check")
    assert (derived.data.seq_len, derived.attention.mode, derived.source_file) == (512, "full", cfg.source_file)
    assert (cfg.data.seq_len, cfg.attention.mode) == (1024, "anchor")  # the original is untouched
    with pytest.raises(UserError, match=r"tiny_anchor.yaml \(a check\).*attention.mode"):
        with_overrides(cfg, ["attention.mode=sparse"], "a check")


def test_float16_is_refused_on_a_machine_without_cuda_in_one_line():
    """DeepSpeed's fp16 optimizer asks the accelerator for fp16 support: on CPU a 59-line traceback, after the model
    was built. `train` checks the machine's rules before anything starts (test_fused.py runs it for liger's)."""
    from lctrain.config import check_on_this_machine

    cfg = load_config(None, ["model.dtype=float16", "parallel.zero_stage=1"])
    with pytest.raises(UserError, match=r"model.dtype = float16 .* needs CUDA, and this machine has none"):
        check_on_this_machine(cfg, cuda_available=False)
    check_on_this_machine(cfg, cuda_available=True)  # the same config plans and loads anywhere


def test_a_refusal_names_the_set_that_gave_the_value_not_the_config_file(tmp_path):
    """Checks past the schema (the precision rule, a missing hostfile, the machine's rules) name the `--set` that
    gave a key they are about, as the schema's own errors do; a value from the file is the file's."""
    from lctrain.config import check_on_this_machine
    from lctrain.parallel.launch import worker_command
    from lctrain.train.runplan import RunPlan

    with pytest.raises(UserError, match=r"^--set model.dtype=bfloat16: model.dtype = bfloat16 needs parallel.zero"):
        RunPlan.of(load_config(None, ["model.dtype=bfloat16"]))
    two_nodes = ["parallel.num_nodes=2", f"parallel.hostfile={tmp_path / 'hosts'}"]
    with pytest.raises(UserError, match=rf"^--set parallel.hostfile={tmp_path / 'hosts'}: .*: no such file"):
        worker_command(load_config(None, two_nodes), ["lctrain.cli"])
    half = load_config(None, ["model.dtype=float16", "parallel.zero_stage=1"])
    with pytest.raises(UserError, match=r"^--set .*--set model.dtype=float16: model.dtype = float16 trains"):
        check_on_this_machine(half, cuda_available=False)
    from_file = load_config(None, ["train.lr=0.5"])
    assert from_file.origin("model.dtype") == from_file.source_file
    assert from_file.origin("train") == "--set train.lr=0.5"


def test_a_setting_added_since_a_checkpoint_counts_as_its_default():
    """A checkpoint of an older lctrain lacks the keys added since: at their defaults they are no change (a resume
    of a 2026-11-23 run was refused for `data.anchor None -> 'auto'`, `data.shard_tokens None -> 268435456`,
    `model.tiled_mlp None -> 0`); set otherwise, they are one, from the default."""
    now = settings(load_config(None, []))
    before = json.loads(json.dumps(now))
    del before["data"]["anchor"], before["data"]["shard_tokens"], before["model"]["tiled_mlp"]
    assert settings_changes(before, now) == {}
    shorter = settings(load_config(None, ["data.shard_tokens=1048576"]))
    assert settings_changes(before, shorter) == {"data.shard_tokens": (268435456, 1048576)}
    del now["model"]["tiled_mlp"]  # a key this lctrain no longer has
    assert settings_changes(settings(load_config(None, [])), now) == {"model.tiled_mlp": (0, None)}


def test_resuming_a_checkpoint_without_a_dataset_record_says_it_cannot_check(capsys):
    from lctrain.train.command import check_same_dataset

    cfg = load_config(None, [])
    check_same_dataset(cfg, {}, manifest=None, checkpoint="step_10", start_over="lctrain train --force")
    said = " ".join(capsys.readouterr().err.split())
    assert said.startswith("warning: checkpoint step_10 was written before lctrain recorded the dataset")
    assert "cannot be checked" in said
