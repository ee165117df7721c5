"""Every GPU-side check and benchmark of lctrain on one CUDA GPU, in stages, into one report (`cli`: the command line,
python scripts/gpu_check.py --help). One module per job: `result` (what a stage reports), `runner` (a stage's
commands under its time limit), `stages` (the stages themselves), `junit` (pytest's results), `report` (the merged
report), `wheels` (building the wheelhouse of an offline machine)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
