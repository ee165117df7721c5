"""`train.loss_gradients`: the chunked loss computing its gradients in its forward equals the loss that recomputes
each chunk's logits in its backward, and both equal cross-entropy over the full logits (the reference), under an
incoming gradient other than 1 (the trainer's normalisation), a bias, a model's logit transform, ignored labels and
frozen parts, in one process and under ZeRO-3 over two."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from train_helpers import clean_env

from lctrain.errors import UserError
from lctrain.train.loss import LOSS_GRADIENTS, CausalLMLossSum, LogitTransform, chunked_loss_sum, reruns_lm_head

pytestmark = pytest.mark.usefixtures("one_thread")

SCALE = 0.37  # the trainer's backward passes grad_divisor / valid labels, never 1
SOFTCAP = LogitTransform((("mul", "logit_scale", 0.5), ("softcap", "final_logit_softcapping", 3.0)))


def case(bias: bool, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(16, 50, bias=bias).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hidden = torch.randn(2, 37, 16, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 37), generator=gen)
    labels[0, -1] = -100
    labels[1, :12] = -100  # a whole chunk of row 1 ignored
    return head, hidden, labels


def full_loss(head, hidden, labels, transform=None):
    """Cross-entropy over the full fp32 logits."""
    logits = F.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float())
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")


def reference(head, hidden, labels, transform=None):
    """`full_loss` and its gradients under the incoming gradient SCALE."""
    loss = full_loss(head, hidden, labels, transform)
    return loss, torch.autograd.grad(loss * SCALE, [hidden, *head.parameters()])


def ours(head, hidden, labels, gradients, transform=None, chunk_tokens=10):
    loss = chunked_loss_sum(head, hidden, labels, chunk_tokens, transform, gradients)
    return loss, torch.autograd.grad(loss * SCALE, [hidden, *head.parameters()])


@pytest.mark.parametrize("gradients", LOSS_GRADIENTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transform", [None, SOFTCAP], ids=["plain", "scale+softcap"])
def test_both_losses_equal_the_full_logits_in_fp32(gradients, bias, transform):
    head, hidden, labels = case(bias)
    want, want_grads = reference(head, hidden, labels, transform)
    got, got_grads = ours(head, hidden, labels, gradients, transform)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


def test_in_bf16_the_forward_gradients_are_as_close_to_fp32_as_the_recomputed_ones():
    """bf16 rounds differently in the two (the forward loss scales bf16 gradients, sums lm_head's in fp32): each is
    held to its distance from the fp32 reference, against the recomputing loss's own distance."""
    head, hidden, labels = case(True, torch.bfloat16)
    _, exact = reference(head, hidden, labels)
    errors = {}
    for gradients in LOSS_GRADIENTS:
        _, grads = ours(head, hidden, labels, gradients)
        errors[gradients] = [float((g.float() - e).norm() / e.norm()) for g, e in zip(grads, exact, strict=True)]
    for fwd, rec in zip(errors["forward"], errors["recompute"], strict=True):
        assert fwd <= max(2 * rec, 2**-8), errors  # bf16's unit roundoff: 2^-8


@pytest.mark.parametrize("frozen", ["head", "hidden"])
def test_what_needs_no_gradient_gets_none_and_the_rest_is_exact(frozen):
    head, hidden, labels = case(True)
    if frozen == "head":
        head.requires_grad_(False)
        wanted = [hidden]
    else:
        hidden = hidden.detach()
        wanted = list(head.parameters())
    want = torch.autograd.grad(full_loss(head, hidden, labels), wanted)
    got = torch.autograd.grad(chunked_loss_sum(head, hidden, labels, 10, gradients="forward"), wanted)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_without_grad_the_loss_is_the_same_and_the_head_keeps_its_forward():
    head, hidden, labels = case(False)
    with torch.no_grad():
        got = chunked_loss_sum(head, hidden, labels, 10, gradients="forward")
    torch.testing.assert_close(got, full_loss(head, hidden, labels))
    chunked_loss_sum(head, hidden, labels, 10, gradients="forward").backward()
    assert "forward" not in vars(head)  # the loss ran as the head's forward only for its call


@pytest.mark.parametrize("gradients", LOSS_GRADIENTS)
def test_the_heads_hooks_bracket_every_read_of_its_weight(gradients):
    """ZeRO-3 gathers lm_head's weight in hooks around its forward and its backward and releases it after each: the
    `forward` loss runs as the head's forward, once; the recomputing loss calls the head again per chunk in its
    backward. Here the hooks hide the weight outside the head's calls, so a read outside them fails."""
    head, hidden, labels = case(False)
    want, (want_hidden, want_weight) = reference(head, hidden, labels)
    weight = head.weight.data
    calls = []

    def gather(module, args):
        module.weight.data = weight
        calls.append(args[0].shape[1])

    def regather(module, grad_out):
        module.weight.data = weight

    def release(module, *_):
        module.weight.data = torch.empty(0)

    head.register_forward_pre_hook(gather)
    head.register_forward_hook(release)
    head.register_full_backward_pre_hook(regather)
    head.register_full_backward_hook(release)
    release(head)
    loss = chunked_loss_sum(head, hidden, labels, 10, gradients=gradients)
    (loss * SCALE).backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(hidden.grad, want_hidden)
    torch.testing.assert_close(head.weight.grad, want_weight)
    chunks = [5] * 7 + [2]  # 10 tokens per chunk over 2 rows of 37
    assert sorted(calls) == ([37] if gradients == "forward" else sorted(chunks * 2))


@pytest.mark.parametrize("gradients", LOSS_GRADIENTS)
@pytest.mark.parametrize("rows, length, chunk_tokens", [(1, 40, 10), (2, 40, 10), (1, 40, 40), (4, 10, 40)])
def test_the_lm_head_reruns_in_the_backward_exactly_where_the_cost_model_counts_it(
    gradients, rows, length, chunk_tokens
):
    """HFU and `estimate` count the LM head's forward that the recomputing loss reruns: the head's forward calls
    counted in a forward and backward against `reruns_lm_head`, and the FLOPs those calls do against
    `lm_head_rerun_flops` (2 x vocab x hidden per token)."""
    from lctrain.costmodel import ModelShape, lm_head_rerun_flops

    head = torch.nn.Linear(8, 50, bias=False)
    tokens = []
    head.register_forward_hook(lambda module, args, out: tokens.append(args[0].shape[0] * args[0].shape[1]))
    hidden = torch.randn(rows, length, 8, requires_grad=True)
    labels = torch.randint(0, 50, (rows, length))
    chunked_loss_sum(head, hidden, labels, chunk_tokens=chunk_tokens, gradients=gradients).backward()
    forward_tokens = rows * length
    rerun_tokens = sum(tokens) - forward_tokens
    assert rerun_tokens in (0, forward_tokens)  # every chunk's head again, or none
    assert reruns_lm_head(rows, length, "none", gradients, chunk_tokens) is (rerun_tokens > 0)
    shape = ModelShape(1, 8, 1, 1, 8, 16, 50)
    assert lm_head_rerun_flops(shape, rerun_tokens) == 2 * 50 * 8 * rerun_tokens
    assert not reruns_lm_head(1, 1 << 20, "liger", "recompute")  # Liger's fused loss replaces the chunks


def test_a_head_that_is_not_linear_is_refused_in_one_line():
    class Model(torch.nn.Module):
        config = type("Config", (), {"model_type": "llama"})()

        def get_output_embeddings(self):
            return torch.nn.Sequential(torch.nn.Linear(4, 9))

    with pytest.raises(
        UserError, match="LM head, and this model's is a Sequential; set train.loss_gradients=recompute"
    ):
        CausalLMLossSum(Model(), gradients="forward")
    CausalLMLossSum(Model(), gradients="recompute")
    with pytest.raises(ValueError, match="loss gradients 'later': expected one of forward, recompute"):
        chunked_loss_sum(*case(False), gradients="later")


ZERO3_SCRIPT = """
import os, sys, deepspeed, torch
from lctrain.compat.deepspeed import disable_cpu_shm_comm_op
from lctrain.parallel.groups import end_process_groups
from lctrain.train.loss import chunked_loss_sum

disable_cpu_shm_comm_op()
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
gradients, tied, out = sys.argv[1], sys.argv[2] == "tied", sys.argv[3]


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 8)
        self.body = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 40, bias=not tied)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids, labels):
        return chunked_loss_sum(self.lm_head, self.body(self.embed(ids)), labels, chunk_tokens=6, gradients=gradients)


torch.manual_seed(0)
model = Tiny()
ids = torch.randint(0, 40, (2, 15))
labels = torch.randint(0, 40, (2, 15))
labels[1, 4:9] = -100
# every parameter partitioned, none prefetched or kept: each is gathered by its module's hooks alone
zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 0}
config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True, "zero_optimization": zero}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
for step in range(3):  # the first step traces the modules' order; later ones gather and release by it
    loss = engine(ids, labels)
    engine.backward(loss * 0.37)
    if step < 2:
        engine.step()
grads = {n: deepspeed.utils.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
if torch.distributed.get_rank() == 0:
    torch.save({"loss": loss.detach(), "grads": grads}, out)
end_process_groups()
# as an lctrain rank exits (parallel/rank.py): without the interpreter's teardown, where native threads aborted rank 1
# of a run whose work had succeeded ("terminate called without an active exception"; CI, once in many)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.slow  # two 2-process DeepSpeed launches per case (~25 s)
@pytest.mark.parametrize("tied", ["tied", "untied"])
def test_under_zero3_over_two_ranks_the_forward_loss_equals_the_recomputing_one(tmp_path, tied):
    from lctrain.parallel.groups import free_port

    script = tmp_path / "zero3.py"
    script.write_text(ZERO3_SCRIPT)
    results = {}
    for gradients in LOSS_GRADIENTS:
        out = tmp_path / f"{gradients}.pt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
        cmd += [str(free_port()), str(script), gradients, tied, str(out)]
        proc = subprocess.run(cmd, env=clean_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[gradients] = torch.load(out)
    forward, recompute = results["forward"], results["recompute"]
    torch.testing.assert_close(forward["loss"], recompute["loss"])
    assert forward["grads"].keys() == recompute["grads"].keys()
    for name, grad in recompute["grads"].items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(forward["grads"][name], grad, msg=name)


@pytest.mark.parametrize(
    "gradients, chunks", [("forward", 8), ("recompute", 8), ("forward", 1)], ids=["forward", "recompute", "one chunk"]
)
# fp32 on a CPU: ~2 s each, with the slow ones
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_the_plan_counts_what_the_loss_holds(gradients, chunks, dtype):
    """`memory.loss_items` against the tensor storage a loss's forward and backward hold at once (PeakBytes): a
    window of 2,048 tokens in 8 chunks or one, a vocabulary of 32,000 and a hidden size of 256, where the logits and
    lm_head's gradient, what the losses differ in, are each tens of MB (measured within 2.5% of the plan; smaller
    chunks show what the plan leaves out, a few MB each: its head-sized copies while autograd accumulates). One
    chunk's lm_head gradient is the parameter's own, which the plan counts among the gradients."""
    from memory_helpers import PeakBytes

    from lctrain.config import load_config
    from lctrain.costmodel import ModelShape
    from lctrain.memory import dtype_bytes, loss_items

    seq, vocab, hidden_size = 2048, 32000, 256
    cfg = load_config(None, ["train.micro_batch=1", f"model.dtype={dtype}", f"train.loss_gradients={gradients}"])
    shape = ModelShape(1, hidden_size, 4, 4, 64, 512, vocab)
    planned = sum(item.bytes for item in loss_items(shape, cfg, seq, chunk_tokens=seq // chunks))
    if chunks == 1:
        planned += vocab * hidden_size * dtype_bytes(dtype)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(torch_dtype)
    hidden = torch.randn(1, seq, hidden_size, generator=gen).to(torch_dtype).requires_grad_()
    labels = torch.randint(0, vocab, (1, seq), generator=gen)
    with PeakBytes() as measured:
        chunked_loss_sum(head, hidden, labels, chunk_tokens=seq // chunks, gradients=gradients).backward()
    assert abs(planned / measured.peak - 1) < 0.05, (planned / 1e6, measured.peak / 1e6)
