"""One check of a memory size given in GB (`units.option_gb_to_bytes`), with one message for `plan` and `init`, and one
share of memory a plan is held to (`Budget.planned`), which `init` plans against."""

import re

import pytest
from train_helpers import one_error_line
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.errors import UserError
from lctrain.memory import Budget
from lctrain.units import option_gb_to_bytes


def test_a_size_in_gb_in_bytes():
    assert option_gb_to_bytes(1.5, "--gpu-mem") == 1_500_000_000


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), 1e300])
def test_no_size_is_refused(value):
    refused = rf"^--host-mem = {re.escape(str(value))}: expected a memory size in GB, > 0 and at most 1,000,000$"
    with pytest.raises(UserError, match=refused):
        option_gb_to_bytes(value, "--host-mem")


@pytest.mark.parametrize(
    "command",
    [["plan"], ["init", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "65536", "--gpus", "8"]],
)
def test_plan_and_init_refuse_a_size_in_one_form(command):
    result = CliRunner().invoke(app, [*command, "--gpu-mem", "0"])
    assert one_error_line(result) == "error: --gpu-mem = 0.0: expected a memory size in GB, > 0 and at most 1,000,000"


def test_the_planned_share_is_nine_tenths():
    planned = Budget(80 * 10**9, 512 * 10**9, "80 GB").planned()
    assert (planned.device, planned.host, planned.label) == (72 * 10**9, 460_800_000_000, "90% of 80 GB")
    assert Budget(None, 10, "host").planned().device is None
