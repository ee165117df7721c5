"""The console outside a terminal (a log file, a pipe): lines unwrapped, tables laid out wide enough for a row."""

import io

from rich.table import Table

from lctrain.console import LOG_WIDTH, plain_console

CELL = "niah_multikey_3 at 131,072 tokens, runs/llama2_128k_anchor/hf/step_2000"


def _table_lines(**kwargs) -> list[str]:
    out = io.StringIO()
    table = Table(title="scores")
    for name in ("task", "checkpoint", "score"):
        table.add_column(name)
    table.add_row(CELL, CELL, "97.50")
    plain_console(file=out, **kwargs).print(table)
    return out.getvalue().splitlines()


def test_a_table_in_a_log_keeps_each_row_on_one_line(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    lines = _table_lines()
    assert len(lines) == 6  # title, top border, header, rule, the row, bottom border
    row = next(line for line in lines if "97.50" in line)
    assert row.count(CELL) == 2
    assert 2 * len(CELL) < max(map(len, lines)) <= LOG_WIDTH


def test_the_width_asked_for_or_set_in_columns_still_decides(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert max(map(len, _table_lines(width=80))) == 80
    monkeypatch.setenv("COLUMNS", "100")
    assert max(map(len, _table_lines())) == 100


def test_a_long_line_is_never_wrapped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    out = io.StringIO()
    plain_console(file=out).print("path " + "x" * 300)
    assert out.getvalue() == "path " + "x" * 300 + "\n"
