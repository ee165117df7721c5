"""The schema is the contract: every value outside a field's domain, drawn from the field's own annotation and
constraints, is refused by `load_config` in one line naming the key (before any process starts), and configs drawn
from the domains (with the rules between keys kept) are accepted as given."""

import math
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import annotated_types
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from lctrain.cli import main
from lctrain.config import DEFAULT_HUB, Config, DataConfig, check_on_this_machine, dump_yaml, load_config
from lctrain.errors import UserError
from lctrain.eval.ruler import TASK_NAMES

# Derandomized: CI draws the same examples every run (a failure is reproducible, never a flake); run with
# `--hypothesis-seed=N` and derandomize off to explore further.
FAST = settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- the domains, read from the models


@dataclass
class Domain:
    kind: str  # int, float, str, bool, literal, list, tuple, dict, section
    nullable: bool = False
    lo: float | None = None
    lo_open: bool = False
    hi: float | None = None
    hi_open: bool = False
    finite: bool = False
    min_length: int = 0
    choices: tuple = ()
    items: list["Domain"] = field(default_factory=list)  # list: one; tuple: one per position
    or_int: "Domain | None" = None  # a literal that also takes an integer (model.tiled_mlp)


def _domain(annotation: Any, metadata: list) -> Domain:
    while typing.get_origin(annotation) is Annotated:
        annotation, *more = typing.get_args(annotation)
        for m in more:
            metadata = metadata + (m.metadata if isinstance(m, FieldInfo) else [m])
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            d = _domain(rest[0], metadata)
        else:  # Literal[...] | int
            (lit,) = [a for a in rest if typing.get_origin(a) is Literal]
            (num,) = [a for a in rest if typing.get_origin(a) is not Literal]
            d = _domain(lit, [])
            d.or_int = _domain(num, metadata)
        d.nullable = type(None) in args
        return d
    if typing.get_origin(annotation) is Literal:
        return Domain("literal", choices=args)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return Domain("section")
    d = Domain(
        {bool: "bool", int: "int", float: "float", str: "str"}.get(annotation)
        or {list: "list", tuple: "tuple", dict: "dict"}[typing.get_origin(annotation)]
    )
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            d.lo = m.ge
        elif isinstance(m, annotated_types.Gt):
            d.lo, d.lo_open = m.gt, True
        elif isinstance(m, annotated_types.Le):
            d.hi = m.le
        elif isinstance(m, annotated_types.Lt):
            d.hi, d.hi_open = m.lt, True
        elif isinstance(m, annotated_types.MinLen):
            d.min_length = m.min_length
        elif getattr(m, "allow_inf_nan", True) is False:
            d.finite = True
    if d.kind == "list":
        d.items = [_domain(args[0], [])]
    elif d.kind == "tuple":
        d.items = [_domain(a, []) for a in args]
    return d


def leaves(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, Domain]:
    out = {}
    for name, info in model.model_fields.items():
        d = _domain(info.annotation, list(info.metadata))
        if d.kind == "section":
            out.update(leaves(info.annotation, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = d
    return out


LEAVES = leaves()
# set by the loader itself (an override of it is dropped), so it has no value a user can get wrong
SETTABLE = sorted(k for k in LEAVES if k != "source_file")


# ---------------------------------------------------------------- invalid values


def _words():
    return st.text("abcdefghij", min_size=1, max_size=6).map(lambda s: f"x{s}")


def _numbers_outside(d: Domain) -> list[st.SearchStrategy]:
    """Numbers outside a numeric domain's bounds; for an integer, fractional ones; for a finite one, nan and inf."""
    out = [st.booleans()]
    if d.lo is not None:
        below = d.lo if d.lo_open else (d.lo - 1 if d.kind == "int" else math.nextafter(d.lo, -math.inf))
        out.append(
            st.integers(max_value=int(math.floor(below)))
            if d.kind == "int"
            else st.floats(max_value=below, allow_nan=False, allow_infinity=False)
        )
    if d.hi is not None:
        above = d.hi if d.hi_open else (d.hi + 1 if d.kind == "int" else math.nextafter(d.hi, math.inf))
        out.append(
            st.integers(min_value=int(math.ceil(above)))
            if d.kind == "int"
            else st.floats(min_value=above, allow_nan=False, allow_infinity=False)
        )
    if d.kind == "int":
        out.append(st.integers(-(10**6), 10**6).map(lambda i: i + 0.5))
    if d.finite:
        out.append(st.sampled_from([math.nan, math.inf, -math.inf]))
    return out


def invalid(d: Domain) -> st.SearchStrategy:
    """Values outside `d`, whatever the other keys hold."""
    options = [st.just([1, 2, 3, 4, 5]) if d.kind not in ("list", "tuple") else st.just({"a": 1})]
    if not d.nullable:
        options.append(st.none())
    if d.kind in ("int", "float"):
        options += [_words(), st.just({"a": 1}), *_numbers_outside(d)]
    elif d.kind == "str":
        options += [st.integers(), st.floats(allow_nan=False), st.booleans(), st.just({"a": 1})]
        if d.min_length:
            options.append(st.just(""))
    elif d.kind == "bool":
        # not what pydantic's lax mode reads as a boolean (true/false, yes/no, on/off, 1/0, ...)
        options += [_words(), st.integers(2, 10**6), st.just(0.5)]
    elif d.kind == "literal":
        options += [_words().filter(lambda s: s not in d.choices), st.booleans()]
        options += _numbers_outside(d.or_int) if d.or_int is not None else [st.integers(), st.floats()]
    elif d.kind == "list":
        options += [st.integers(), _words(), st.lists(invalid(d.items[0]), min_size=1, max_size=3)]
        if d.min_length:
            options.append(st.just([]))
    elif d.kind == "tuple":
        n = len(d.items)
        fill = [valid(x) for x in d.items]
        options += [st.integers(), st.tuples(*fill[:-1]).map(list), st.tuples(*fill, fill[0]).map(list)]
        for i in range(n):  # one position outside its domain, the others within theirs
            options.append(st.tuples(*[invalid(x) if j == i else fill[j] for j, x in enumerate(d.items)]).map(list))
    elif d.kind == "dict":
        options += [st.integers(), _words(), st.booleans()]
    return st.one_of(options)


def _yaml(value: Any) -> str:
    """`value` as the VALUE of `--set KEY=VALUE` (YAML: .nan, .inf, quoted strings that look like numbers)."""
    return dump_yaml(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


@pytest.mark.parametrize("key", SETTABLE)
@FAST
@given(data=st.data())
def test_a_value_outside_a_fields_domain_is_refused_in_one_line_naming_it(key, data):
    value = data.draw(invalid(LEAVES[key]), label=key)
    with pytest.raises(UserError) as err:
        load_config(None, [f"{key}={_yaml(value)}"])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--set {key}="), msg  # named where it was written
    assert key in msg, msg


# ---------------------------------------------------------------- valid configs


def _text():
    return st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=12)


def valid(d: Domain) -> st.SearchStrategy:
    if d.kind == "int":
        lo = None if d.lo is None else int(d.lo) + d.lo_open
        hi = None if d.hi is None else int(d.hi) - d.hi_open
        s = st.integers(lo if lo is not None else -(10**9), hi if hi is not None else 10**12)
    elif d.kind == "float":
        s = st.floats(
            d.lo if d.lo is not None else -1e12,
            d.hi if d.hi is not None else 1e12,
            exclude_min=d.lo_open,
            exclude_max=d.hi_open,
            allow_nan=False,
        )
    elif d.kind == "str":
        s = _text() if d.min_length else st.one_of(st.just(""), _text())
    elif d.kind == "bool":
        s = st.booleans()
    elif d.kind == "literal":
        s = st.sampled_from(d.choices)
        if d.or_int is not None:
            s = st.one_of(s, valid(d.or_int))
    elif d.kind == "list":
        s = st.lists(valid(d.items[0]), min_size=d.min_length, max_size=4)
    elif d.kind == "tuple":
        s = st.tuples(*[valid(x) for x in d.items]).map(list)
    else:
        raise AssertionError(f"no free domain for {d}")
    return st.one_of(st.none(), s) if d.nullable else s


# Keys whose valid values depend on other keys (the rules between them, stated here independently of the
# schema's validators) or on a list of names: drawn together by `coupled`.
COUPLED = {
    "name",
    "model.name_or_path",
    "model.arch",
    "model.rope_scaling",
    "model.gradient_checkpointing",
    "model.checkpointing",
    "model.offload_activations",
    "model.fused_kernels",
    "model.tiled_mlp",
    "model.rope_fp32",
    "model.max_position_embeddings",
    "data.seq_len",
    "data.source",
    "data.path",
    "data.hub_name",
    "data.mixture",
    "data.domain_shares",
    "data.short_doc_tokens",
    "data.down_sample_ratio",
    "data.sources",
    "parallel.zero_stage",
    "parallel.offload_optimizer",
    "parallel.offload_params",
    "parallel.overlap_comm",
    "eval.tasks",
    "eval.exclude",
    "eval.lengths",
    "logging.profile.start",
    "logging.profile.ranks",
}
SHARE_DOMAINS = ["CommonCrawl", "C4", "GitHub", "ArXiv", "Book", "Wikipedia", "StackExchange"]


@st.composite
def coupled(draw) -> dict[str, Any]:
    v: dict[str, Any] = {}
    # the run's name is one directory name under runs/
    v["name"] = draw(_text().filter(lambda s: not ({"/", "\\"} & set(s)) and s.strip() not in (".", "..")))
    if draw(st.booleans()):  # exactly one model source
        v["model.name_or_path"], v["model.arch"] = draw(_text()), None
    else:
        arch = {"model_type": "llama", "hidden_size": draw(st.sampled_from([64, 128])), "num_hidden_layers": 2}
        v["model.name_or_path"], v["model.arch"] = None, arch
    v["model.rope_scaling"] = draw(
        st.one_of(st.none(), st.builds(lambda f: {"rope_type": "linear", "factor": f}, st.floats(1, 64)))
    )
    v["model.gradient_checkpointing"] = gc = draw(st.booleans())
    # the older switch on with an explicit "none" contradicts it; null follows the older switch
    v["model.checkpointing"] = mode = draw(
        st.sampled_from([None, "full", "selective", "selective_matmul", "none"]).filter(
            lambda m: not (gc and m == "none")
        )
    )
    checkpointed = (mode or ("full" if gc else "none")) != "none"
    v["model.offload_activations"] = checkpointed and draw(st.booleans())
    v["data.source"] = draw(st.sampled_from(["synthetic", "hub", "local"]))
    # a path is read only from local files, a dataset name from the hub, each refused with another source
    # (tests/test_config.py)
    v["data.path"] = draw(_text()) if v["data.source"] == "local" else None
    v["data.hub_name"] = draw(_text()) if v["data.source"] == "hub" else DEFAULT_HUB
    v["data.mixture"] = draw(st.sampled_from(["slimpajama", "upsampled"]))
    shares = None
    if v["data.mixture"] == "upsampled" and draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(SHARE_DOMAINS), min_size=1, max_size=7, unique=True))
        weights = draw(st.lists(st.integers(0, 100), min_size=len(names), max_size=len(names)).filter(any))
        shares = {n: w / sum(weights) for n, w in zip(names, weights)}
    v["data.domain_shares"] = shares
    # down-sampling is the upsampled mixture's: set with another mixture it is refused (tests/test_mixture_reports.py)
    for key in ("data.short_doc_tokens", "data.down_sample_ratio"):
        default = DataConfig.model_fields[key.removeprefix("data.")].default
        v[key] = draw(valid(LEAVES[key])) if v["data.mixture"] == "upsampled" else default
    # data.sources replaces data.source and data.path: its own rules are tests/test_data_sources_mix.py's
    v["data.sources"] = None
    stage = draw(st.integers(0, 3))
    v["parallel.zero_stage"] = stage
    v["parallel.offload_optimizer"] = stage >= 1 and draw(st.booleans())
    v["parallel.offload_params"] = stage == 3 and draw(st.booleans())
    # overlapping ZeRO's communication needs ZeRO
    v["parallel.overlap_comm"] = draw(st.one_of(st.none(), st.just(False), st.just(stage >= 1)))
    # fused kernels replace the MLP that tiled_mlp shards and write into matmul outputs (not selective_matmul's to
    # keep); liger rotates in its own kernel (not rope_fp32's fp32) and reads lm_head's weight outside its forward
    # (not under ZeRO-3)
    v["model.fused_kernels"] = fused = draw(
        st.sampled_from(["none", "liger", "compile"]).filter(
            lambda f: not (f == "liger" and stage == 3) and not (f != "none" and mode == "selective_matmul")
        )
    )
    v["model.tiled_mlp"] = 0 if fused != "none" else draw(st.one_of(st.just("auto"), st.integers(0, 8)))
    v["model.rope_fp32"] = fused != "liger" and draw(st.booleans())
    # a context length set is at least the training window
    v["data.seq_len"] = seq_len = draw(valid(LEAVES["data.seq_len"]))
    own = draw(valid(LEAVES["model.max_position_embeddings"]))
    v["model.max_position_embeddings"] = own if own is None else max(own, seq_len)
    v["eval.tasks"] = draw(st.one_of(st.none(), st.lists(st.sampled_from(TASK_NAMES), min_size=1, unique=True)))
    v["eval.exclude"] = draw(st.lists(st.sampled_from(TASK_NAMES), unique=True))
    # each length once
    v["eval.lengths"] = draw(st.lists(valid(LEAVES["eval.lengths"].items[0]), min_size=1, max_size=4, unique=True))
    return v


@st.composite
def valid_config(draw) -> dict[str, Any]:
    values = draw(coupled())
    for key in SETTABLE:
        if key not in COUPLED and draw(st.booleans()):  # about half the keys, the rest inherited
            values[key] = draw(valid(LEAVES[key]), label=key)
    return values


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return list(node) if isinstance(node, tuple) else node


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(values=valid_config())
def test_configs_drawn_from_the_domains_are_accepted_as_given(values):
    cfg = load_config(None, [f"{k}={_yaml(v)}" for k, v in values.items()])
    for key, value in values.items():
        assert _get(cfg, key) == value, key


def test_the_domains_cover_every_field():
    """Every field has a domain the two strategies above know, and the coupled keys are fields."""
    assert COUPLED <= set(LEAVES)
    for key, d in LEAVES.items():
        invalid(d)
        if key not in COUPLED and d.kind != "dict":
            valid(d)
    assert LEAVES["seed"] == LEAVES["data.seed"] == LEAVES["eval.seed"]
    assert (LEAVES["seed"].lo, LEAVES["seed"].hi, LEAVES["seed"].hi_open) == (0, 2**32, True)
    assert all(LEAVES[k].finite for k, d in LEAVES.items() if d.kind == "float")


# ---------------------------------------------------------------- issue 22's examples and the rules between keys


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=-1", "seed = -1: Input should be greater than or equal to 0"),
        ("seed=4294967296", "seed = 4294967296: Input should be less than 4294967296"),
        ("data.seed=-5", "data.seed = -5: Input should be greater than or equal to 0"),
        ("eval.seed=4294967296", "eval.seed = 4294967296: Input should be less than 4294967296"),
        ("train.betas=[0.9, 1.5]", "train.betas[1] = 1.5: Input should be less than 1"),
        ("train.betas=[-0.1, 0.9]", "train.betas[0] = -0.1: Input should be greater than or equal to 0"),
        ("train.lr=.inf", "train.lr = inf: not a finite number"),
        ("train.lr=.nan", "train.lr = nan: not a finite number"),
        ("train.weight_decay=-0.1", "train.weight_decay = -0.1: Input should be greater than or equal to 0"),
        ("train.grad_clip=.nan", "train.grad_clip = nan: not a finite number"),
        ("model.rope_theta=-.inf", "model.rope_theta = -inf: not a finite number"),
        ("eval.lengths=[]", "eval.lengths = []: List should have at least 1 item"),
        ("eval.lengths=[4096, 0]", "eval.lengths[1] = 0: Input should be greater than or equal to 1"),
        ("name=../x", "name = '../x': the name is one directory name under runs/"),
        ("name=..", "name = '..': the name is one directory name under runs/"),
        (
            "parallel.offload_params=true",
            "parallel: parallel.offload_params offloads ZeRO-3's weight shards, so it needs parallel.zero_stage=3 "
            "(it is 0)",
        ),
        (
            "parallel.offload_optimizer=true",
            "parallel: parallel.offload_optimizer offloads the ZeRO optimizer's partition, so it needs "
            "parallel.zero_stage >= 1 (it is 0)",
        ),
    ],
)
def test_issue_examples_are_refused_in_one_line(override, message):
    with pytest.raises(UserError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_offload_rules_accept_the_stages_they_need():
    for stage in (1, 2, 3):
        assert load_config(None, [f"parallel.zero_stage={stage}", "parallel.offload_optimizer=true"])
    cfg = load_config(None, ["parallel.zero_stage=3", "parallel.offload_params=true"])
    assert cfg.parallel.offload_params
    with pytest.raises(UserError, match=r"needs parallel.zero_stage=3 \(it is 2\)"):
        load_config(None, ["parallel.zero_stage=2", "parallel.offload_params=true", "parallel.offload_optimizer=true"])


def test_nccl_loads_anywhere_and_is_refused_on_a_machine_without_cuda():
    cfg = load_config(None, ["parallel.backend=nccl"])  # a GPU config is read and planned on a laptop
    check_on_this_machine(cfg, cuda_available=True)
    check_on_this_machine(load_config(), cuda_available=False)
    with pytest.raises(UserError, match=r"^--set parallel.backend=nccl: parallel: parallel.backend = nccl needs CUDA"):
        check_on_this_machine(cfg, cuda_available=False)


@pytest.mark.parametrize(
    "override, key",
    [
        ("parallel.backend=nccl", "parallel.backend"),
        ("seed=4294967296", "seed"),
        ("train.betas=[0.9, 1.5]", "train.betas[1]"),
        ("parallel.offload_params=true", "parallel.offload_params"),
    ],
)
def test_train_refuses_before_any_process_starts(override, key, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--set", override])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and key in err and len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())  # no run directory, no prepared data: nothing started
