"""One home for the tokens of a step and the windows and tokens of a run (Config.tokens_per_step, windows_read,
tokens_read), against the products written out here, and the places that report them."""

from lctrain.config import load_config, reread_warning, tokens_to_prepare
from lctrain.parallel.layout import layout_of
from lctrain.reports.throughput import point_config
from lctrain.train.trainer import TrainState

STEPS, BATCH, SEQ_LEN = 7, 4, 512


def cfg(*more):
    return load_config(None, [f"train.steps={STEPS}", f"train.global_batch={BATCH}", f"data.seq_len={SEQ_LEN}", *more])


def test_tokens_and_windows_of_steps():
    c = cfg()
    assert c.tokens_per_step == 4 * 512
    assert c.windows_read() == 7 * 4 and c.windows_read(3) == 3 * 4 and c.windows_read(0) == 0
    assert c.tokens_read() == 7 * 4 * 512 and c.tokens_read(2) == 2 * 4 * 512
    assert tokens_to_prepare(STEPS, BATCH, SEQ_LEN, 5) == (7 * 4 + 5) * 512


def test_the_checkpoint_records_the_windows_read():
    c = cfg()
    assert TrainState(step=3).record(c, layout_of(c), {})["windows_consumed"] == 3 * 4


def test_reread_warning_counts_the_runs_tokens():
    line = reread_warning(cfg("data.token_budget=100000"), windows=20)
    assert f"{7 * 4 * 512:,} tokens, {(7 * 4 - 20) * 512:,} more than the data has" in line


def test_a_measured_point_prepares_exactly_its_steps_windows(tmp_path):
    point = point_config(cfg(), "anchor", 1024, steps=3, warmup=2, work=tmp_path)
    assert point.data.token_budget == (2 + 3) * 4 * 1024 and point.tokens_per_step == 4 * 1024
