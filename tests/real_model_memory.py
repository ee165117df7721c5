"""One SmolLM2 training process, measured: `python tests/real_model_memory.py MODEL_DIR SEQ_LEN CHECKPOINTING` prints
one JSON line. Its own process, so that its peak resident set is the training's alone: the process's peak over the
engine's construction and two steps (the second is the steady state: the Adam moments exist from the first step's
end), then the exact peak of CPU tensor storage in a third step (the profiler's allocator totals,
`lctrain.measure.cpu_peak_bytes`, plus the parameters and optimizer states alive when it starts)."""

import json
import sys

import numpy as np
import torch

from lctrain.config import load_config
from lctrain.data.layouts import slimpajama_like_layouts, window_ids
from lctrain.measure import cpu_peak_bytes, host_peak_bytes
from lctrain.parallel.groups import init_topology, release_single_process
from lctrain.train.trainer import Trainer

VOCAB = 49152  # SmolLM2's


def config(model_dir: str, seq_len: int, checkpointing: str):
    return load_config(
        None,
        [
            "model.arch=null",
            f"model.name_or_path={model_dir}",
            "model.rope_theta=null",
            "model.dtype=float32",
            f"model.checkpointing={checkpointing}",
            f"data.tokenizer={model_dir}",
            f"data.seq_len={seq_len}",
            "attention.mode=anchor",
            "attention.engine=sdpa",
            "train.global_batch=1",
            "train.micro_batch=1",
            "parallel.zero_stage=0",
        ],
    )


def storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def measure(model_dir: str, seq_len: int, checkpointing: str) -> dict:
    cfg = config(model_dir, seq_len, checkpointing)
    torch.set_num_threads(2)
    seg = slimpajama_like_layouts(seq_len, 1, 0)
    batch = [
        {
            "input_ids": window_ids(seg, vocab=VOCAB, anchor=0, seed=0),
            "seg_lens": [np.array(s) for s in seg],
            "seg_doc": [np.arange(len(s)) for s in seg],
            "tag_lens": [np.zeros(len(s), dtype=np.int64) for s in seg],
        }
    ]
    trainer = Trainer(cfg, init_topology(cfg), vocab_size=None)
    for _ in range(2):
        trainer.train_step(batch)
    rss = host_peak_bytes()
    params = list(trainer.engine.module.parameters())
    moments = [v for s in trainer.engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    alive = storage_bytes(params) + storage_bytes(moments) + storage_bytes(p.grad for p in params if p.grad is not None)
    growth, _ = cpu_peak_bytes(lambda: trainer, lambda t: t.train_step(batch))
    release_single_process()
    return {"peak_rss_bytes": rss, "peak_tensor_bytes": alive + growth}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
