"""The command line of `devtools.gpu_check` (every GPU-side check in stages, one report; devtools/gpu_check/cli.py):
python scripts/gpu_check.py --help. devtools is not part of the installed package, and the install stage runs before
lctrain is installed, so the repository root goes on the import path first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools.gpu_check.cli import main  # noqa: E402 (importable only once the root is on the path)

if __name__ == "__main__":
    sys.exit(main())
