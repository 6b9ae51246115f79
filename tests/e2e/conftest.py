"""End-to-end fixtures."""

import pytest

from jobs.config import BUILTIN_MODEL
from worker.model_prepare import prepare_model


@pytest.fixture(scope="session")
def served_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_model(BUILTIN_MODEL))
