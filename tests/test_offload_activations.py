"""`model.offload_activations`: DeepSpeed's checkpoint offload leaves the gradients and losses bit-for-bit unchanged
(it only moves the checkpointed hidden states and copies them back), in one process and under Ulysses SP=2 with
ZeRO-3, alone and with the tiled MLP.

On a CPU run DeepSpeed's engine offloads nothing (its CPU accelerator is synchronized, the tensors already live in
host memory), so the tests that must see the copy-out and copy-back happen run it with `_as_if_asynchronous`: the
same CPU accelerator, except that it says it is not synchronized, so every marked hidden state but the newest is
copied into a host buffer, dropped, and copied back into fresh memory in the backward, as on a GPU.

References: the run or backward without the offload (identical computation, so the tolerance is zero: a copy is
exact and the operations and their order are the same), and the config key's bad combination.
"""

from pathlib import Path

import pytest
import torch
from train_helpers import equivalence_run, losses, prepared_workdir, run_cli_train

from lctrain.attention import make_batch
from lctrain.compat.deepspeed import checkpoint_offload_context
from lctrain.config import load_config
from lctrain.errors import UserError
from lctrain.model import build_model
from lctrain.train.loss import CausalLMLossSum

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 3
ARCH = (
    f"{{model_type: llama, hidden_size: 32, intermediate_size: 88, num_hidden_layers: {LAYERS}, "
    "num_attention_heads: 4, num_key_value_heads: 2, tie_word_embeddings: false}"
)
STEPS = 3


class _AsIfAsynchronous:
    """DeepSpeed's CPU accelerator claiming to be an asynchronous device: the offload engine then really copies."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def is_synchronized_device(self):
        return False

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


@pytest.fixture
def as_if_asynchronous(monkeypatch):
    import deepspeed.runtime.activation_checkpointing.offload_activations as offload
    from deepspeed.accelerator import get_accelerator

    accelerator = _AsIfAsynchronous(get_accelerator())
    monkeypatch.setattr(offload, "get_accelerator", lambda: accelerator)


def _model():
    cfg = load_config(
        None,
        [f"model.arch={ARCH}", "model.dtype=float32", "model.gradient_checkpointing=true", "attention.mode=anchor"],
    )
    return CausalLMLossSum(build_model(cfg, vocab_size=100).model.train())


def _batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 64), generator=generator)
    ids[:, [0, 17, 40]] = 1
    return make_batch(ids, [[17, 23, 24], [17, 23, 24]], "anchor", seg_doc=[[0, 1, 2], [0, 1, 0]])


def _grads(model, batch, context=None):
    model.zero_grad(set_to_none=True)
    if context is None:
        loss = model(batch)
        loss.backward()
    else:
        with context:
            loss = model(batch)
            loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


def test_offloaded_hidden_states_give_identical_gradients(as_if_asynchronous):
    model, batch = _model(), _batch()
    want = _grads(model, batch)
    context = checkpoint_offload_context()
    _assert_same(_grads(model, batch, context), want)
    # one hidden state per checkpointed layer; all but the newest left for host memory and came back
    assert context.stats.marked_tensors == LAYERS
    assert context.stats.offloaded_tensors == context.stats.restored_tensors == LAYERS - 1
    assert context.stats.kept_last_tensors == 1
    _assert_same(
        _grads(model, batch, context), want
    )  # the trainer's reuse of one context, micro-batch after micro-batch


def test_on_cpu_the_hidden_states_stay_and_nothing_changes():
    model, batch = _model(), _batch()
    want = _grads(model, batch)
    context = checkpoint_offload_context()
    _assert_same(_grads(model, batch, context), want)
    assert context.stats.marked_tensors == context.stats.skipped_marked_tensors == LAYERS
    assert context.stats.offloaded_tensors == 0


def test_without_gradient_checkpointing_is_one_line():
    with pytest.raises(
        UserError, match=r"model: model.offload_activations .* needs model.gradient_checkpointing=true"
    ) as err:
        load_config(None, ["model.offload_activations=true", "model.gradient_checkpointing=false"])
    assert "\n" not in str(err.value)


def overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return equivalence_run(data_dir, run_dir, steps=STEPS, micro_batch=1, arch=ARCH) + [
        "model.dtype=float32",
        "model.gradient_checkpointing=true",
    ]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return prepared_workdir(tmp_path_factory, "offload", overrides)


def _train(workdir: Path, name: str, extra: list[str]) -> list[float]:
    from lctrain.train.command import train

    return losses(train(load_config(None, overrides(workdir / "data", workdir / name) + extra)))


@pytest.fixture
def contexts(monkeypatch):
    """The offload contexts the trainers build, to read what they moved."""
    import lctrain.train.trainer as trainer

    made = []

    def recorded():
        made.append(checkpoint_offload_context())
        return made[-1]

    monkeypatch.setattr(trainer, "checkpoint_offload_context", recorded)
    return made


@pytest.mark.parametrize("tiled", ["0", "3"])
def test_training_with_offload_has_identical_losses(workdir, tiled, as_if_asynchronous, contexts):
    """Two micro-batches a step: the trainer's one context serves each forward and its backward in turn."""
    want = _train(workdir, f"plain_tiled{tiled}", [f"model.tiled_mlp={tiled}"])
    got = _train(workdir, f"offload_tiled{tiled}", [f"model.tiled_mlp={tiled}", "model.offload_activations=true"])
    assert len(got) == STEPS and got == want
    [context] = contexts
    assert context.stats.offloaded_tensors == context.stats.restored_tensors == LAYERS - 1  # the last micro-batch


SP2 = [
    "parallel.nproc_per_node=2",
    "parallel.sequence_parallel=2",
    "parallel.zero_stage=3",
    "parallel.launcher=torchrun",
    "model.tiled_mlp=auto",
]


@pytest.fixture(scope="module")
def sp2_offload(workdir):
    """Two gloo processes on the CPU path (every hidden state is marked and skipped, nothing leaves): DeepSpeed's
    hooks and the marker it wraps around transformers' layers under Ulysses and ZeRO-3, with the tiled MLP."""
    return run_cli_train(overrides, workdir, "sp2_offload", SP2 + ["model.offload_activations=true"], timeout=300)


# SP=2 against one process regroups sums (attention heads, ZeRO-3 reduce-scatter, tiled MLP shards): the tolerance
# of tests/test_parallel_equivalence.py.
LOSS_RTOL = 1e-5


@pytest.mark.slow  # over 20 s on 2 cores: make test-slow
def test_sp2_zero3_with_offload_and_tiled_mlp_matches_one_process(workdir, sp2_offload):
    want = _train(workdir, "one_process", [])
    assert len(losses(sp2_offload)) == STEPS
    torch.testing.assert_close(torch.tensor(losses(sp2_offload)), torch.tensor(want), rtol=LOSS_RTOL, atol=0)


@pytest.mark.slow
def test_sp2_zero3_with_offload_and_tiled_mlp_has_identical_losses(workdir, sp2_offload):
    want = run_cli_train(overrides, workdir, "sp2_plain", SP2, timeout=300)
    assert losses(sp2_offload) == losses(want)


def test_each_restored_hidden_state_is_freed_after_its_layer(as_if_asynchronous):
    """The point of the offload is a lower peak: a hidden state copied back for its layer's recomputation must not
    stay alive until the step ends (DeepSpeed's own unpack keeps them all, so the backward ends holding every one).
    Measured with the allocator's totals. On the CPU the host buffers are the same memory, so the offloaded step
    holds a little more than the plain one: up to two originals until their copies are reaped (DeepSpeed's
    `max_fwd_stash_count`) and one restored copy in flight, i.e. within 4 hidden states (3.2 measured). Keeping the
    restored ones adds one per offloaded layer on top (7 here; 10.2 hidden states over the plain step measured with
    DeepSpeed's own unpack)."""
    from lctrain.measure import cpu_peak_bytes

    layers, batch_rows, length, hidden = 8, 2, 512, 64
    arch = (
        f"{{model_type: llama, hidden_size: {hidden}, intermediate_size: 96, num_hidden_layers: {layers}, "
        f"num_attention_heads: 4, num_key_value_heads: 2, tie_word_embeddings: false}}"
    )
    cfg = load_config(
        None,
        [f"model.arch={arch}", "model.dtype=float32", "model.gradient_checkpointing=true", "attention.mode=intra_doc"],
    )
    ids = torch.randint(3, 50, (batch_rows, length), generator=torch.Generator().manual_seed(0))
    batch = make_batch(ids, [[length]] * batch_rows, "intra_doc")
    hidden_state = batch_rows * length * hidden * 4

    def peak(context):
        def setup():
            return CausalLMLossSum(build_model(cfg, vocab_size=50).model.train())

        def step(model):
            with context:
                model(batch).backward()

        return cpu_peak_bytes(setup, step)[0]

    import contextlib

    context = checkpoint_offload_context()
    assert peak(context) - peak(contextlib.nullcontext()) <= 4 * hidden_state
    assert context.stats.offloaded_tensors == layers - 1
