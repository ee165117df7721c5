"""`model.tiled_mlp`: DeepSpeed's TiledMLP computes each decoder MLP in sequence shards and leaves the losses and
gradients unchanged up to fp32 rounding, in one process and under Ulysses SP=2 with ZeRO-3.

References: the gated-MLP formula written out with torch.nn.functional on copies of the weights (one MLP), the
untiled run of the same config (training), `torch.chunk` itself (the shard count), the config key's bad values.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from train_helpers import equivalence_run, losses, prepared_workdir, reference_run, run_cli_train

from lctrain.compat.deepspeed import exact_shards
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.model import auto_mlp_shards, build_model, tile_mlps

STEPS = 3
# hidden 32: `auto` cuts a rank's micro-batch of 2 x 64 tokens (SP=2 of 128) into ceil(128 / 32) = 4 shards
ARCH = (
    "{model_type: llama, hidden_size: 32, intermediate_size: 88, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, tie_word_embeddings: false}"
)


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return equivalence_run(data_dir, run_dir, steps=STEPS, micro_batch=2, arch=ARCH)


pytestmark = pytest.mark.usefixtures("one_thread")


def llama_mlp(hidden=32, intermediate=88):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu")).float()


def formula_mlp(gate, up, down, x):
    """Llama's gated MLP written out: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class _Decoder(torch.nn.Module):
    """The shape `tile_mlps` walks: model.get_decoder().layers[i].mlp."""

    def __init__(self, mlps):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Module() for _ in mlps)
        for layer, mlp in zip(self.layers, mlps):
            layer.mlp = mlp

    def get_decoder(self):
        return self


# fp32 rounding: each output is one dot product over 32 (then 88) terms, each weight gradient a sum over the 20 tokens
# regrouped into shards; a few ulps (1.2e-7) of values of order 1, so 1e-5 relative and absolute leaves 10x room while
# a missing or repeated shard changes a weight gradient by a whole token's share (> 1e-2 here).
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shards", [1, 2, 3, 6, 64])
def test_one_mlp_matches_the_formula_forward_and_backward(shards):
    """20 rows (batch 2 x 10 tokens): 3 and 6 do not divide them (6 asks are really 5 pieces), 64 exceeds them."""
    mlp = llama_mlp()
    gate, up, down = (
        p.detach().clone().requires_grad_() for p in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    )
    x = torch.randn(2, 10, 32)
    grad_out = torch.randn(2, 10, 32)
    x_ref, x_tiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = formula_mlp(gate, up, down, x_ref)
    want.backward(grad_out)

    calls = []
    mlp.gate_proj.register_forward_hook(lambda *_: calls.append(1))
    assert tile_mlps(_Decoder([mlp]), shards) == 1
    got = mlp(x_tiled)
    got.backward(grad_out)

    # forward without grad over the 10 positions, then the recompute in backward over the 20 flattened rows
    pieces = len(torch.chunk(torch.empty(20), shards))
    assert len(calls) == len(torch.chunk(torch.empty(10), pieces)) + pieces
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(x_tiled.grad, x_ref.grad, **TOL)
    for param, ref in ((mlp.gate_proj.weight, gate), (mlp.up_proj.weight, up), (mlp.down_proj.weight, down)):
        torch.testing.assert_close(param.grad, ref.grad, **TOL)
        assert param.ds_grad_is_ready  # ZeRO reduces the gradient once the last shard has added to it


def test_exact_shards_is_what_torch_chunk_cuts():
    for rows in range(1, 41):
        for shards in range(1, 46):
            assert exact_shards(rows, shards) == len(torch.chunk(torch.empty(rows), shards)), (rows, shards)


def test_auto_shards_is_tokens_over_hidden_rounded_up():
    assert [auto_mlp_shards(t, 32) for t in (1, 32, 33, 64, 128, 131_072)] == [1, 1, 2, 2, 4, 4096]


@pytest.mark.parametrize("value", ["-1", "2.5", "true", "many"])
def test_bad_values_end_in_one_line(value):
    with pytest.raises(
        UserError, match=r"model\.tiled_mlp.*expected 0 \(off\), a number of shards >= 1, or auto"
    ) as err:
        load_config(None, [f"model.tiled_mlp={value}"])
    assert "\n" not in str(err.value)


def test_a_model_without_a_gated_mlp_is_refused():
    cfg = load_config(
        None,
        [
            "model.arch={model_type: phi, hidden_size: 32, intermediate_size: 64, "
            "num_hidden_layers: 1, num_attention_heads: 4}",
            "attention.mode=full",
            "model.tiled_mlp=2",
        ],
    )
    with pytest.raises(UserError, match=r"model.tiled_mlp: PhiForCausalLM has no Llama-style gated MLP") as err:
        build_model(cfg)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "tiled", overrides)


@pytest.fixture(scope="module")
def reference(workdir):
    return reference_run(workdir, overrides)


# Losses of fp32 runs whose weight gradients differ by rounding (shard sums regrouped): a few ulps per step, so 1e-5
# relative is ~100x that, as for the parallel-equivalence runs; a wrong tiling (a shard missing from a gradient)
# moves the loss after one lr 3e-3 step by far more.
LOSS_RTOL = 1e-5


def test_training_with_tiled_mlp_has_the_same_losses(reference, workdir, monkeypatch):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    from lctrain.train.command import train

    shard_counts = []
    apply = TiledMLP.apply

    def counted(fn, mlp, x, shards, params):
        shard_counts.append(shards)
        return apply(fn, mlp, x, shards, params)

    monkeypatch.setattr(TiledMLP, "apply", counted)
    tiled = train(load_config(None, overrides(workdir / "data", workdir / "tiled3") + ["model.tiled_mlp=3"]))
    assert shard_counts == [3] * 2 * STEPS  # both layers' MLPs, one micro-batch a step
    torch.testing.assert_close(torch.tensor(losses(tiled)), torch.tensor(losses(reference)), rtol=LOSS_RTOL, atol=0)


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_sp2_zero3_with_automatic_tiled_mlp_has_the_same_losses(reference, workdir):
    """Ulysses SP=2 with ZeRO-3 and `auto` (each rank cuts its 64 tokens x 2 windows into 4 shards, the same count
    on both ranks; ZeRO-3 gathers the MLP weights in every shard's forward, so a disagreement would hang, not pass)
    against the untiled 1-process run: SP=2 equals one process untiled (tests/test_parallel_equivalence.py, same
    tolerance), so this is tiled on vs off under SP=2 in one launch instead of two."""
    run_dir = run_cli_train(
        overrides,
        workdir,
        "sp2_auto",
        [
            "parallel.nproc_per_node=2",
            "parallel.sequence_parallel=2",
            "parallel.zero_stage=3",
            "parallel.launcher=torchrun",
            "model.tiled_mlp=auto",
        ],
        timeout=300,
    )
    assert len(losses(run_dir)) == STEPS
    torch.testing.assert_close(torch.tensor(losses(run_dir)), torch.tensor(losses(reference)), rtol=LOSS_RTOL, atol=0)
