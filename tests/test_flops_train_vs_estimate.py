"""One count of a step's FLOPs: `train`'s mfu and hfu (Trainer.metrics) and `estimate`'s prediction agree with each
other and with the FLOPs written out by hand here, with and without model.tiled_mlp, activation checkpointing and the
loss's chunks (whose LM head reruns in the backward)."""

import pytest

from lctrain.config import load_config
from lctrain.parallel.groups import init_topology, release_single_process
from lctrain.reports.estimate import predict
from lctrain.train.trainer import StepResult, Trainer

L, D, LAYERS, HEADS, HEAD_DIM, KV, FFN, VOCAB, BATCH = 256, 64, 2, 4, 16, 2, 128, 32064, 2
ARCH = [
    f"model.arch.hidden_size={D}",
    f"model.arch.intermediate_size={FFN}",
    f"model.arch.num_hidden_layers={LAYERS}",
    f"model.arch.num_attention_heads={HEADS}",
    f"model.arch.num_key_value_heads={KV}",
    f"model.arch.vocab_size={VOCAB}",  # the default tokenizer's 32000, padded to a multiple of 64
]


def hand_flops(tiled: bool, checkpointing: str, chunked: bool) -> tuple[float, float]:
    """(model FLOPs, FLOPs the device runs) of one window of full attention: 2 FLOPs per weight of a linear layer
    (q, k, v, o, gate, up, down, the LM head; no norm, no embedding lookup) and token, 4 x heads x head dim per causal
    pair and layer, training = 3 forward passes. The device also runs TiledMLP's second MLP forward, and what
    checkpointing reruns: `full` each layer's forward but its down projection, attention included; and the LM head's
    forward again where the loss recomputes its chunks in the backward (`chunked`)."""
    q_o, k_v, mlp = 2 * D * HEADS * HEAD_DIM, 2 * D * KV * HEAD_DIM, 3 * D * FFN
    linear = LAYERS * (q_o + k_v + mlp) + D * VOCAB
    pairs = L * (L + 1) / 2
    attention_forward = 4 * HEADS * HEAD_DIM * LAYERS * pairs
    model = 3 * (2 * linear * L + attention_forward)
    device = model + (2 * LAYERS * mlp * L if tiled else 0)
    if checkpointing == "full":
        device += 2 * LAYERS * (q_o + k_v + 2 * D * FFN) * L + attention_forward
    if chunked:
        device += 2 * D * VOCAB * L
    return model, device


@pytest.mark.parametrize(
    "tiled, checkpointing, batch, gradients",
    [
        (False, "none", BATCH, "forward"),
        (True, "none", BATCH, "forward"),
        (True, "full", BATCH, "forward"),
        (False, "full", BATCH, "recompute"),
        (False, "none", 64, "forward"),
        (False, "none", 64, "recompute"),
    ],
)
def test_train_and_estimate_count_the_flops_written_out(tmp_path, one_thread, tiled, checkpointing, batch, gradients):
    """64 windows of 256 tokens in a micro-batch pass the loss's 8,192 logit rows at once: it runs in chunks, and
    with train.loss_gradients=recompute reruns the LM head in the backward."""
    cfg = load_config(
        None,
        [
            *ARCH,
            f"data.seq_len={L}",
            f"data.output_dir={tmp_path / 'none'}",  # no prepared dataset: full attention's pairs are the causal half
            "model.dtype=float32",
            "parallel.zero_stage=0",
            f"train.global_batch={batch}",
            f"train.micro_batch={batch}",
            f"model.checkpointing={checkpointing}",
            f"model.tiled_mlp={4 if tiled else 0}",
            f"train.loss_gradients={gradients}",
        ],
    )
    model, device = hand_flops(tiled, checkpointing, chunked=batch * L > 8192 and gradients == "recompute")
    predicted = predict(cfg, {"*": 1.0}, 1, modes=("full",))[0]["full"]
    assert predicted["flops_per_window"] == pytest.approx(device, rel=1e-12)
    trainer = Trainer(cfg, init_topology(cfg), vocab_size=VOCAB)
    try:
        pairs = batch * L * (L + 1) // 2
        # one second at a peak of 1 FLOP/s on one rank: the utilisations are the step's FLOPs
        record = trainer.metrics(
            0, StepResult(1.0, 1, None, pairs), seconds=1.0, peak=1.0, peak_mem=0, mem_scope="step"
        )
    finally:
        release_single_process()
    assert record["mfu"] == pytest.approx(batch * model, rel=1e-12)
    assert record["hfu"] == pytest.approx(batch * device, rel=1e-12)
