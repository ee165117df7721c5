"""Pure parts of training: schedules, the data order, sequence sharding, the DeepSpeed config, the chunked loss."""

import pytest
import torch

from lctrain.attention import make_batch
from lctrain.config import CheckpointConfig, TrainConfig, load_config
from lctrain.errors import UserError
from lctrain.parallel.layout import ParallelLayout, kv_replication, layout_of
from lctrain.train.data import BatchPlan, micro_batch_rows, stream_rows
from lctrain.train.deepspeed_config import deepspeed_config, uses_torch_adam
from lctrain.train.runplan import RunPlan
from lctrain.train.schedule import hf_checkpoint_steps, lr_factor, resume_checkpoint_due


def test_hf_checkpoints_follow_the_paper_protocol():
    ck = CheckpointConfig()
    assert list(hf_checkpoint_steps(2000, ck)) == [1960, 1970, 1980, 1990, 2000]
    assert list(hf_checkpoint_steps(60, ck)) == [20, 30, 40, 50, 60]
    assert list(hf_checkpoint_steps(25, ck)) == [5, 15, 25]  # a run shorter than the window: never step 0
    assert list(hf_checkpoint_steps(6, CheckpointConfig(hf_every=2, hf_last=4))) == [4, 6]
    assert list(hf_checkpoint_steps(100, CheckpointConfig(hf_last=0))) == []


@pytest.mark.parametrize(
    "total, every, last", [(60, 10, 50), (25, 10, 50), (7, 3, 7), (1, 1, 1), (97, 7, 40), (10, 4, 100)]
)
def test_hf_checkpoints_match_a_loop_over_every_step(total, every, last):
    """The step rule spelled out: within the last `last` steps, every `every` counting back from the final one."""
    ck = CheckpointConfig(hf_every=every, hf_last=last)
    loop = [s for s in range(1, total + 1) if total - s < last and (total - s) % every == 0]
    assert list(hf_checkpoint_steps(total, ck)) == loop


def test_hf_checkpoints_of_a_billion_steps_cost_nothing():
    steps = hf_checkpoint_steps(10**9, CheckpointConfig(hf_every=1, hf_last=10**9))
    assert len(steps) == 10**9 and 1 in steps and 10**9 in steps and 0 not in steps


def test_resume_checkpoints_every_n_steps_and_at_the_end():
    ck = CheckpointConfig(every_steps=20)
    due = [s for s in range(1, 51) if resume_checkpoint_due(s, 50, ck)]
    assert due == [20, 40, 50]
    no_final = CheckpointConfig(every_steps=20, save_final=False)
    assert [s for s in range(1, 51) if resume_checkpoint_due(s, 50, no_final)] == [20, 40]


def test_lr_warmup_then_schedule():
    t = TrainConfig(steps=10, lr=1.0, warmup_steps=4, lr_schedule="constant")
    assert [lr_factor(i, t) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    lin = TrainConfig(steps=10, warmup_steps=0, lr_schedule="linear")
    assert lr_factor(0, lin) == 1.0 and lr_factor(5, lin) == pytest.approx(0.5)
    cos = TrainConfig(steps=10, warmup_steps=0, lr_schedule="cosine")
    assert lr_factor(5, cos) == pytest.approx(0.5) and lr_factor(10, cos) == pytest.approx(0.0)


def test_each_step_reads_its_global_batch_once_split_over_ranks_and_micro_batches():
    n, G, mb, dp = 10, 4, 1, 2
    gas = G // (mb * dp)
    for step in range(7):
        got = sorted(
            r
            for m in range(gas)
            for rank in range(dp)
            for r in micro_batch_rows(step, m, rank, dp=dp, micro_batch=mb, global_batch=G, seed=3, n=n)
        )
        assert got == sorted(stream_rows(3, n, step * G, G))
    # every epoch is a permutation of all windows, and epochs differ
    e0, e1 = stream_rows(3, n, 0, n), stream_rows(3, n, n, n)
    assert sorted(e0) == sorted(e1) == list(range(n)) and e0 != e1
    # the layout reads the same rows on every rank of a sequence-parallel group: world 4 = SP 2 x DP 2
    layout = ParallelLayout(world=4, sp=2)
    plan = BatchPlan(global_batch=G, micro_batch=mb, dp=layout.dp)
    assert plan.grad_accum == gas
    for rank in range(4):
        assert plan.rows(3, 1, layout.dp_rank(rank), seed=3, n=n) == micro_batch_rows(
            3, 1, rank // 2, dp=dp, micro_batch=mb, global_batch=G, seed=3, n=n
        )
    # the same global batch whatever the layout: 1 rank x 4 micro-batches == 2 ranks x 2 micro-batches
    one = [r for m in range(4) for r in micro_batch_rows(5, m, 0, dp=1, micro_batch=1, global_batch=4, seed=3, n=n)]
    assert sorted(one) == sorted(stream_rows(3, n, 20, 4))


def test_shards_are_contiguous_and_metadata_is_shared():
    ids = torch.arange(2 * 12).view(2, 12)
    batch = make_batch(ids, [[5, 7], [12]], "anchor")
    layout = ParallelLayout(world=3, sp=3)
    shards = [batch.shard(layout.sp, layout.sp_rank(r)) for r in range(3)]
    for field in ("input_ids", "position_ids", "labels"):
        assert torch.equal(torch.cat([getattr(s, field) for s in shards], 1), getattr(batch, field))
    assert torch.equal(shards[1].input_ids, ids[:, 4:8])
    assert all(s.segments is batch.segments for s in shards)
    # labels were shifted before sharding: a shard's last label is the next shard's first token
    assert torch.equal(shards[0].labels[:, -1], ids[:, 4])
    assert sum(s.valid_labels() for s in shards) == batch.valid_labels()
    assert batch.shard(1, 0) is batch
    with pytest.raises(ValueError, match="cannot cut 12 tokens into 5"):
        batch.shard(5, 0)


def test_kv_head_replication_for_ulysses():
    assert kv_replication(32, 8, 8) == 1
    assert kv_replication(32, 8, 4) == 1
    assert kv_replication(4, 2, 4) == 2  # 2 KV heads over 4 ranks: each KV head twice
    assert kv_replication(32, 1, 8) == 8
    assert kv_replication(24, 4, 8) == 2
    with pytest.raises(UserError, match="not divisible by parallel.sequence_parallel"):
        kv_replication(12, 4, 8)


def _tiny(**over):
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


def test_layout_errors_name_the_keys():
    with pytest.raises(UserError, match="train.global_batch = 6 is not divisible"):
        cfg = _tiny(**{"train.global_batch": 6, "train.micro_batch": 4})
        BatchPlan.of(cfg, layout_of(cfg))
    with pytest.raises(UserError, match="data.seq_len = 1000 is not divisible by parallel.sequence_parallel = 16"):
        layout_of(
            _tiny(
                **{
                    "data.seq_len": 1000,
                    "parallel.nproc_per_node": 16,
                    "parallel.sequence_parallel": 16,
                    "train.global_batch": 2,
                    "train.micro_batch": 2,
                }
            )
        )
    with pytest.raises(UserError, match="world size 3"):
        layout_of(_tiny(**{"parallel.nproc_per_node": 3, "parallel.sequence_parallel": 2}))


def test_a_batch_refusal_names_the_settings_that_make_the_data_parallel_size_only():
    cfg = _tiny(**{"parallel.zero_stage": 2, "parallel.nproc_per_node": 2, "train.global_batch": 3})
    with pytest.raises(UserError) as refused:
        BatchPlan.of(cfg, layout_of(cfg))
    assert str(refused.value).startswith(
        "--set parallel.nproc_per_node=2, --set train.global_batch=3: train.global_batch = 3 is not divisible"
    )


def test_deepspeed_config_follows_the_yaml():
    cfg = _tiny(
        **{
            "parallel.nproc_per_node": 8,
            "parallel.sequence_parallel": 4,
            "parallel.zero_stage": 3,
            "parallel.offload_optimizer": True,
            "model.dtype": "bfloat16",
            "train.global_batch": 8,
            "train.micro_batch": 1,
        }
    )
    layout = layout_of(cfg)
    ds = deepspeed_config(cfg, RunPlan.of(cfg, layout), gpu=True)
    assert layout.world == 8 and layout.dp == 2 and BatchPlan.of(cfg, layout).grad_accum == 4
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 4
    assert ds["train_micro_batch_size_per_gpu"] == 1
    # DeepSpeed's own consistency rule, with data-parallel size 8 / 4
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["bf16"] == {"enabled": True}
    assert ds["communication_data_type"] == ds["seq_parallel_communication_data_type"] == "fp32"  # reduce_dtype
    assert ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert ds["optimizer"]["params"]["weight_decay"] == 0.1
    assert ds["gradient_clipping"] == 1.0
    fp32 = deepspeed_config(_tiny(), RunPlan.of(_tiny(), layout_of(_tiny())), gpu=False)
    assert "bf16" not in fp32 and "communication_data_type" not in fp32 and fp32["optimizer"]["params"]["torch_adam"]


def test_deepspeeds_cpu_adam_only_for_an_offloaded_optimizer_on_a_gpu_unless_torch_adam():
    offloaded = _tiny(**{"parallel.zero_stage": 3, "parallel.offload_optimizer": True})
    assert not uses_torch_adam(offloaded, gpu=True)
    assert uses_torch_adam(offloaded, gpu=False)  # the CPU run has nothing to offload from
    assert uses_torch_adam(_tiny(**{"parallel.zero_stage": 3}), gpu=True)  # the optimizer on the GPU: torch's AdamW
    assert uses_torch_adam(
        _tiny(**{"parallel.zero_stage": 3, "parallel.offload_optimizer": True, "train.torch_adam": True}), gpu=True
    )


def test_the_loss_wrappers_state_dict_unwraps_to_the_models_own():
    """ZeRO-3 gathers the state dict of the module DeepSpeed holds (the loss wrapper); the export needs the model's
    own keys and tensors, which `lm_state_dict` recovers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lctrain.train.loss import CausalLMLossSum

    hf = AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=10
    )
    lm = AutoModelForCausalLM.from_config(hf)
    unwrapped = CausalLMLossSum.lm_state_dict(CausalLMLossSum(lm).state_dict())
    own = lm.state_dict()
    assert unwrapped.keys() == own.keys()
    assert all(unwrapped[k] is own[k] or torch.equal(unwrapped[k], own[k]) for k in own)
