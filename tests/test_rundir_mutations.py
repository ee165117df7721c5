"""Mutation test of a run directory: every file a finished run holds (config.yaml, metrics.jsonl, model_changes.json,
anchor.json, checkpoints/latest, each checkpoint's trainer_state.json, DeepSpeed and RNG state, hf/step_N exports,
the lock) is damaged in turn (missing keys, wrong types, truncated or zeroed, swapped between steps, deleted), and
`lctrain resume`, `lctrain eval`, `lctrain show-config` and `lctrain plot` answer one line naming the file (or fall back
to an older checkpoint saying why), never a traceback and never a silent continuation on another step's state.

One tiny run (4 steps, checkpoints and exports at steps 2 and 4) is built once per module; each case damages a copy
whose config asks for a 5th step, so that a resume that is not refused trains that step."""

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from train_helpers import one_error_line, set_args
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.rundir import RunDir

ARCH = (
    "{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, tie_word_embeddings: true}"
)
CK4, CK2 = "checkpoints/step_4", "checkpoints/step_2"

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(root: Path) -> list[str]:
    return [
        "data.seq_len=64",
        "data.token_budget=2000",
        "data.synthetic.num_docs=100",
        f"data.output_dir={root / 'data'}",
        f"model.arch={ARCH}",
        f"train.run_dir={root / 'run'}",
        "train.steps=4",
        "train.global_batch=2",
        "train.micro_batch=1",
        "checkpoint.every_steps=2",
        "checkpoint.hf_every=2",
    ]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mutations")
    for command in ("prepare", "train"):
        result = CliRunner().invoke(app, [command] + set_args(tiny(root)))
        assert result.exit_code == 0, result.output
    return root / "run"


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run whose config asks for one step more."""
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    config = copy / "config.yaml"
    config.write_text(config.read_text().replace("steps: 4\n", "steps: 5\n", 1))
    return copy


# ---------------------------------------------------------------- mutations


def zeroed(path: Path) -> None:
    path.write_bytes(b"\0" * path.stat().st_size)


def head_zeroed(path: Path) -> None:
    """Its first 4 KB zeroed, its size kept (a size check does not see it)."""
    with path.open("r+b") as f:
        f.write(bytes(min(4096, path.stat().st_size)))


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def yaml_cut(inside_a_key: bool):
    """Truncate a YAML file near its middle, where the outcome does not hang on the byte count: just inside a
    mapping key (no colon follows: invalid YAML), or at the start of that key's line (parses, later keys lost). Half
    the bytes would land on either depending on the length of the temporary paths the file holds."""

    def cut(path: Path) -> None:
        text = path.read_text()
        key = re.compile(r"^( *)[a-z_]{3,}:", re.M).search(text, len(text) // 2)
        path.write_text(text[: key.start(0) + (len(key.group(1)) + 2 if inside_a_key else 0)])

    return cut


def unrecorded(mutation):
    """`mutation`, with the export's record deleted: the export is then a model directory taken as it is."""

    def edit(path: Path) -> None:
        mutation(path)
        (path.parent / "export.json").unlink()

    return edit


def deleted(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def text(content: str):
    def write(path: Path) -> None:
        path.write_text(content)

    return write


def json_key(key: str, value=KeyError):
    """Set `key` of a JSON object file to `value`, or remove it."""

    def edit(path: Path) -> None:
        record = json.loads(path.read_text())
        if value is KeyError:
            record.pop(key)
        else:
            record[key] = value
        path.write_text(json.dumps(record))

    return edit


def yaml_section(section: str, value=KeyError):
    """Set a top-level section of a YAML file to `value`, or remove it."""

    def edit(path: Path) -> None:
        tree = yaml.safe_load(path.read_text())
        if value is KeyError:
            tree.pop(section)
        else:
            tree[section] = value
        path.write_text(yaml.safe_dump(tree))

    return edit


def swapped(name: str):
    """Exchange checkpoint step_2's and step_4's `name` (called on the checkpoints directory)."""

    def swap(checkpoints: Path) -> None:
        a, b, tmp = checkpoints / "step_2" / name, checkpoints / "step_4" / name, checkpoints / "swap"
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)

    return swap


# (file, mutation, what `lctrain resume` says): "error: <regex>" refuses in one line; "warning: <regex>" resumes
# after saying it (from the checkpoint before a damaged one, or with a gap in the curve).
RESUME = [
    ("config.yaml", zeroed, r"error: .*config.yaml: invalid YAML"),
    ("config.yaml", yaml_cut(inside_a_key=True), r"error: .*config.yaml:\d+: invalid YAML"),
    ("config.yaml", yaml_cut(inside_a_key=False), r"error: .*config.yaml: no \w+ section \(truncated or edited\?\)"),
    ("config.yaml", deleted, r"error: .*: not a run directory \(no config.yaml\)"),
    ("config.yaml", text("[1, 2]\n"), r"error: .*config.yaml: a config must be a mapping"),
    ("config.yaml", yaml_section("data"), r"error: .*config.yaml: no data section \(truncated or edited\?\); restore"),
    ("metrics.jsonl", zeroed, r"error: .*metrics.jsonl:1: not a step record"),
    ("metrics.jsonl", text('{"step": 1}\n[3]\n{"step": 2}\n'), r"error: .*metrics.jsonl:2: not a step record"),
    ("metrics.jsonl", text('{"step": 3}\n{"step": 1}\n'), r"error: .*metrics.jsonl:2: step 1 does not follow step 3"),
    ("metrics.jsonl", text('{"step": "2"}\n'), r"error: .*metrics.jsonl:1: step '2' does not follow step 0"),
    ("metrics.jsonl", truncated, r"warning: .*metrics.jsonl ends at step \d, checkpoint step_4 at step 4"),
    ("metrics.jsonl", deleted, r"warning: .*metrics.jsonl ends at step 0, checkpoint step_4 at step 4"),
    ("checkpoints/latest", text("../../somewhere\n"), None),
    ("checkpoints/latest", zeroed, None),
    (CK4, deleted, r"warning: .*checkpoints/latest names step_4, which is missing or incomplete"),
    (f"{CK4}/trainer_state.json", zeroed, r"warning: checkpoint step_4 is damaged \(trainer_state.json is unreadable"),
    (f"{CK4}/trainer_state.json", text("[]"), r"warning: checkpoint step_4 is damaged \(trainer_state.json is not a"),
    (f"{CK4}/trainer_state.json", json_key("step"), r"damaged \(trainer_state.json has no integer 'step'\)"),
    (f"{CK4}/trainer_state.json", json_key("step", "4"), r"damaged \(trainer_state.json has no integer 'step'\)"),
    (f"{CK4}/trainer_state.json", json_key("step", 2), r"damaged \(trainer_state.json is of step 2, not 4"),
    (f"{CK4}/trainer_state.json", json_key("config", [1]), r"damaged \(trainer_state.json: config of the wrong type"),
    (f"{CK4}/trainer_state.json", json_key("wandb_id", 5), r"damaged \(trainer_state.json: wandb_id of the wrong"),
    ("checkpoints", swapped("trainer_state.json"), r"error: .*: no checkpoint has a readable trainer_state.json"),
    ("checkpoints", swapped("rng_rank0.pt"), r"error: .*: no checkpoint could be loaded \(tried step_4, step_2\)"),
    ("checkpoints", swapped("mp_rank_00_model_states.pt"), r"error: .*no checkpoint could be loaded"),
    (f"{CK4}/rng_rank0.pt", deleted, r"warning: checkpoint step_4 is damaged \(rng_rank0.pt is missing\)"),
    (f"{CK4}/rng_rank0.pt", zeroed, r"warning: checkpoint step_4 is damaged"),
    (f"{CK4}/mp_rank_00_model_states.pt", deleted, r"damaged \(mp_rank_00_model_states.pt is missing\)"),
    (f"{CK4}/mp_rank_00_model_states.pt", truncated, r"damaged \(mp_rank_00_model_states.pt has [\d,]+ bytes, not the"),
    (f"{CK4}/mp_rank_00_model_states.pt", head_zeroed, r"damaged \(mp_rank_00_model_states.pt holds other bytes "),
    (f"{CK4}/rng_rank0.pt", head_zeroed, r"damaged \(rng_rank0.pt holds other bytes than it was written with: "),
    ("model_changes.json", zeroed, None),  # written again by every start
    ("anchor.json", text("{}"), None),  # written again by every start
    (".lctrain.lock", text("[1]"), None),  # only its flock counts
]
# The refusals, which build no model: the default suite's share.
FAST = {0, 2, 3, 5, 6, 8, 22}


def _case_id(case) -> str:
    rel, mutate, _ = case
    name = mutate.__qualname__.split(".")[0]
    return f"{rel}-{name}"


def _resume_cases():
    for i, case in enumerate(RESUME):
        marks = () if i in FAST else (pytest.mark.slow,)
        yield pytest.param(*case, id=f"{i}-{_case_id(case)}", marks=marks)


@pytest.mark.parametrize("rel, mutate, expected", list(_resume_cases()))
def test_resume_of_a_damaged_run_directory(run, rel, mutate, expected):
    mutate(run / rel)
    result = CliRunner().invoke(app, ["resume", str(run)])
    assert "Traceback" not in result.output and not isinstance(result.exception, Exception), result.output
    if expected is not None and expected.startswith("error: "):
        assert_match(expected, one_error_line(result))
        return
    assert result.exit_code == 0, result.output
    if expected is not None:
        assert any(_match(expected, line) for line in result.output.splitlines()), result.output
    else:
        assert "warning: checkpoint" not in result.output, result.output
    assert [r["step"] for r in RunDir(run).read_metrics()][-1:] == [5]  # resumed, and trained the 5th step


def _match(pattern: str, line: str):
    return re.search(pattern, line)


def assert_match(pattern: str, line: str) -> None:
    assert _match(pattern, line), line


# (file, mutation, command, the one error line): eval reads the exports and the config, plot the metrics,
# show-config the config.
EVAL = ["eval", "{run}", "--lengths", "256", "--samples", "1", "--tasks", "niah_single_1"]
EVAL_2 = ["eval", "{run}/hf/step_2", "--lengths", "256", "--samples", "1", "--tasks", "niah_single_1"]
EVAL_4 = [a.replace("step_2", "step_4") for a in EVAL_2]
READERS = [
    # An export is checked against its record (export.json) first: its files, its step.
    ("hf/step_4/config.json", deleted, EVAL, r"hf/step_4/config.json: missing; restore the export, or delete"),
    ("hf/step_4/config.json", zeroed, EVAL, r"hf/step_4/config.json: not the file this export wrote"),
    ("hf/step_4/model.safetensors", truncated, EVAL, r"hf/step_4/model.safetensors: [\d,]+ bytes, not the [\d,]+"),
    ("hf", swapped("model.safetensors"), EVAL, r"hf/step_2/model.safetensors: not the file this export wrote"),
    ("hf/step_2/tokenizer.json", zeroed, EVAL, r"hf/step_2/tokenizer.json: not the file this export wrote"),
    ("hf/step_4/export.json", zeroed, EVAL, r"hf/step_4/export.json: not an export record"),
    ("hf/step_4/export.json", json_key("step", 2), EVAL, r"hf/step_4/export.json: records step 2, not 4"),
    ("hf/step_4/export.json", json_key("files", {}), EVAL, r"not an export record \(files: .*at least 1"),
    # Without its record (a model directory given on its own), the loaders' own refusals.
    ("hf/step_4/config.json", unrecorded(zeroed), EVAL_4, r"hf/step_4: cannot load .*config.json' is not a valid"),
    ("hf/step_4/model.safetensors", unrecorded(truncated), EVAL_4, r"hf/step_4: cannot load the model \(Safetensor"),
    ("hf/step_2/tokenizer.json", unrecorded(zeroed), EVAL_2, r"hf/step_2: cannot load its tokenizer \(JSONDecode"),
    ("hf/step_2/anchor.json", unrecorded(text('{"token": 1}')), EVAL_2, r"anchor.json: not an anchor record"),
    ("config.yaml", yaml_section("model"), EVAL, r"config.yaml: no model section"),
    ("config.yaml", yaml_section("train", 5), ["plot", "{run}", "--out", "{run}/c.png"], r"config.yaml: .*train"),
    ("metrics.jsonl", zeroed, ["plot", "{run}", "--out", "{run}/c.png"], r"metrics.jsonl:1: not a step record"),
    (
        "config.yaml",
        yaml_cut(inside_a_key=True),
        ["show-config", "-c", "{run}/config.yaml"],
        r"config.yaml:\d+: invalid YAML",
    ),
]


@pytest.mark.slow  # eval loads each export (~2 s a case)
@pytest.mark.parametrize(
    "rel, mutate, command, expected",
    [pytest.param(*case, id=f"{case[2][0]}-{_case_id((case[0], case[1], None))}") for case in READERS],
)
def test_eval_plot_and_show_config_of_a_damaged_run_directory(run, rel, mutate, command, expected):
    mutate(run / rel)
    line = one_error_line(CliRunner().invoke(app, [a.format(run=run) for a in command]))
    assert_match(expected, line)


@pytest.mark.slow  # eval loads each export
def test_an_export_without_its_record_is_evaluated_with_a_warning(run):
    """As a run exported before lctrain recorded its exports: evaluated, and said to be unchecked."""
    (run / "hf" / "step_4" / "export.json").unlink()
    result = CliRunner().invoke(app, [a.format(run=run) for a in EVAL])
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warning) == 1 and re.search(r"hf: step_4 without export.json .*evaluated unchecked", warning[0])
