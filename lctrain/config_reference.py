"""docs/config.md, generated from the config schema (lctrain/config.py): every key with its domain, default and
description, so the reference cannot drift from what `load_config` accepts. `lctrain show-config --reference` prints
it, `make docs` writes it, and tests/test_config_reference.py fails when the file is stale."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from lctrain.config import NOT_SETTINGS, REPLACED_WHOLE, Config

REFERENCE_FILE = "docs/config.md"
REGENERATE = "make docs"

_HEADER = """# Config reference

Generated from the config schema (`lctrain/config.py`) by `{regenerate}` (`lctrain show-config --reference`); do not
edit by hand.

A config is a YAML file of the sections below. `base: NAME_OR_PATH` names a config it inherits from (a bundled one,
see `lctrain configs`, or a path relative to the file), overriding it key by key; the mappings {replaced}
replace the base's value whole instead of merging into it. Any key can be overridden on the
command line with `--set KEY=VALUE` (VALUE is YAML, e.g. `--set train.betas=[0.9,0.95]`; `KEY=null` clears a key,
and an empty VALUE is refused: it is what an unset shell variable leaves). A mapping given for a section merges into
it key by key as a file merges into its `base:` (`--set 'train={{steps: 4, lr: 1e-4}}'` keeps the other `train` keys);
one given for one of those mappings replaces it whole. Files and `--set` values are read as YAML 1.2 (core schema), not
PyYAML's YAML 1.1: `010` is 10 (`0o10` is 8, `0x10` 16), `1e-4` a number, only `true`/`false` booleans, and `yes`,
`off`, `1:00` or `2024-01-01` text. A `--set` VALUE with a comment (` #`) is refused rather than cut short: quote it
(`--set 'description="run #3"'`); so is a number, boolean or null for a key that takes text (`--set 'name="0123"'`).
`lctrain show-config` prints the resolved config with the values a `null` or `auto` resolves to. A value outside its
domain, an unknown key or a broken rule between keys is refused in one line naming the key, before anything runs.
The defaults are what a key takes when neither the file nor its `base:` chain sets it; the bundled configs set most
of them.
"""


@dataclass(frozen=True)
class FieldDoc:
    key: str  # dotted, e.g. "train.betas"
    domain: str
    default: Any
    description: str


def _bound_text(metadata: list) -> str:
    lower = upper = None
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            lower = f"[{m.ge}"
        elif isinstance(m, annotated_types.Gt):
            lower = f"({m.gt}"
        elif isinstance(m, annotated_types.Le):
            upper = f"{m.le}]"
        elif isinstance(m, annotated_types.Lt):
            upper = f"{m.lt})"
    if lower and upper:
        return f" in {lower}, {upper}"
    if lower:
        return f" {'≥' if lower[0] == '[' else '>'} {lower[1:]}"
    if upper:
        return f" {'≤' if upper[-1] == ']' else '<'} {upper[:-1]}"
    return ""


def _min_length(metadata: list) -> int:
    return max((m.min_length for m in metadata if isinstance(m, annotated_types.MinLen)), default=0)


def _flatten(annotation: Any, metadata: list) -> tuple[Any, list]:
    """The type under any `Annotated` layers, with their metadata (FieldInfo's from `Field(...)` unpacked)."""
    while typing.get_origin(annotation) is Annotated:
        annotation, *more = typing.get_args(annotation)
        for m in more:
            metadata = metadata + (m.metadata if isinstance(m, FieldInfo) else [m])
    return annotation, metadata


def domain_text(annotation: Any, metadata: list | None = None) -> str:
    """A type and its constraints in words: `integer ≥ 1`, `finite number in [0, 1)`, `one of a, b`, ..."""
    annotation, metadata = _flatten(annotation, list(metadata or []))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        # a Field's constraints on `X | None` apply to X
        text = " or ".join(domain_text(a, metadata) for a in args if a is not type(None))
        return f"{text}, or null" if type(None) in args else text
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args) if len(args) > 1 else f"`{args[0]}`"
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "integer" + _bound_text(metadata)
    if annotation is float:
        finite = any(getattr(m, "allow_inf_nan", True) is False for m in metadata)
        return ("finite number" if finite else "number") + _bound_text(metadata)
    if annotation is str:
        return "non-empty string" if _min_length(metadata) else "string"
    if origin is tuple:
        return "[" + ", ".join(domain_text(a) for a in args) + "]"
    if origin is list:
        kind = "non-empty list" if _min_length(metadata) else "list"
        item = _section(args[0])
        if item is not None:
            return f"{kind} of mappings (the keys of `[]` below)"
        return f"{kind} of ({domain_text(args[0])})"
    if origin is dict:
        return "mapping" if args[1] is Any else f"mapping of {domain_text(args[0])} to {domain_text(args[1])}"
    raise TypeError(f"no description of the type {annotation!r}; teach config_reference.domain_text")


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _item_section(annotation: Any) -> type[BaseModel] | None:
    """The section of a list of sections (`list[SourceConfig] | None` -> SourceConfig), else None."""
    for a in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(a) is list and _section(typing.get_args(a)[0]) is not None:
            return typing.get_args(a)[0]
    return None


def field_docs(model: type[BaseModel] = Config, prefix: str = "", defaults: dict | None = None) -> list[FieldDoc]:
    """Every leaf key of `model`, depth first in declaration order; the defaults are those of an empty config."""
    defaults = defaults if defaults is not None else Config().model_dump(mode="json")
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section(field.annotation)
        if section is not None:
            out += field_docs(section, f"{key}.", defaults[name])
            continue
        domain = domain_text(field.annotation, field.metadata)
        out.append(FieldDoc(key, domain, defaults[name], field.description or ""))
        item = _item_section(field.annotation)
        if item is not None:
            # an item's defaults are its own fields' (a required field has none: shown as "required")
            item_defaults = {n: "required" if f.is_required() else f.default for n, f in item.model_fields.items()}
            out += field_docs(item, f"{key}[].", item_defaults)
    return out


def section_docs(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str]]:
    """`(dotted section, description)` of every section, depth first."""
    out = []
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            out.append((f"{prefix}{name}", field.description or ""))
            out += section_docs(section, f"{prefix}{name}.")
        item = _item_section(field.annotation)
        if item is not None:
            out.append((f"{prefix}{name}[]", " ".join(item.__doc__.split()).rstrip(".")))
    return out


def _inline(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(docs: list[FieldDoc]) -> list[str]:
    rows = ["| key | domain | default | description |", "|---|---|---|---|"]
    for d in docs:
        rows.append(f"| `{d.key}` | {_cell(d.domain)} | `{_cell(_inline(d.default))}` | {_cell(d.description)} |")
    return rows


def reference_markdown() -> str:
    """The text of docs/config.md."""
    docs = field_docs()
    replaced = ", ".join(f"`{d.key}`" for d in docs if d.key.rsplit(".", 1)[-1] in REPLACED_WHOLE)
    lines = [_HEADER.format(replaced=replaced, regenerate=REGENERATE)]
    top = [d for d in docs if "." not in d.key and d.key not in NOT_SETTINGS]
    lines += ["## Top level", "", *_table(top), ""]
    for section, description in section_docs():
        rows = [d for d in docs if d.key.rsplit(".", 1)[0] == section]
        lines += [f"## `{section}`", "", f"{description[0].upper()}{description[1:]}.", "", *_table(rows), ""]
    recorded = [d for d in docs if d.key in NOT_SETTINGS]
    lines += [
        "## Recorded by lctrain",
        "",
        "Keys about a config rather than settings of the run: in no fingerprint and no comparison.",
        "",
        *_table(recorded),
    ]
    return "\n".join(lines) + "\n"
