"""Training: `train` and `resume` (the edge), the `Trainer` every worker runs (`trainer.py`, started by `worker.py`
under a launcher), the loss, schedules, checkpoints, data order, metrics."""
