"""Training: the DeepSpeed loop (`trainer.train`, `trainer.resume`), schedules, checkpoints, data order, metrics."""
