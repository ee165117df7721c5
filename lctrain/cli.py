"""The `lctrain` command line: parse, load the config, call one stage function. No logic of its own."""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Optional

import typer

from lctrain.config import bundled_config_names, load_config, to_yaml
from lctrain.errors import UserError

app = typer.Typer(
    help="Long-context continual pretraining with AnchorAttention: prepare data, train, resume, evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[
    Optional[str],
    typer.Option("--config", "-c", help="YAML file or bundled config name (see `lctrain configs`); "
                 "default: the embedded tiny CPU config"),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="override a config value, e.g. --set data.seq_len=4096 (repeatable)"),
]


def user_errors(fn):
    """Turn a UserError into one line on stderr and exit code 2; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(UserError.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


@app.command()
@user_errors
def prepare(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    strict: Annotated[bool, typer.Option(help="stop at the first bad input record, naming file and line")] = False,
    force: Annotated[bool, typer.Option(help="rebuild even if a complete dataset with this fingerprint exists")] = False,
):
    """Tokenize and pack a corpus into fixed-length windows with document boundaries (DESIGN §2)."""
    from lctrain.data.prepare import prepare as run_prepare

    overrides = list(set_ or []) + (["data.strict=true"] if strict else [])
    run_prepare(load_config(config, overrides), force=force)


@app.command()
@user_errors
def configs():
    """List the bundled configs (usable as `--config NAME`)."""
    for name in bundled_config_names():
        cfg = load_config(name)
        typer.echo(f"{name:40s} {cfg.description}")


@app.command("show-config")
@user_errors
def show_config(config: ConfigOpt = None, set_: SetOpt = None):
    """Print the resolved config (after `base:` inheritance and overrides) with its fingerprint."""
    typer.echo(to_yaml(load_config(config, list(set_ or []))), nl=False)


def main(argv: Optional[list[str]] = None) -> None:
    app(args=argv if argv is not None else sys.argv[1:], prog_name="lctrain")


if __name__ == "__main__":
    main()
