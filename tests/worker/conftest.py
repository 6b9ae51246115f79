"""Fixtures for worker-side tests: the real served model's folder and tokenizer."""

import pytest

from jobs.config import BUILTIN_MODEL
from worker.model_prepare import prepare_model


@pytest.fixture(scope="session")
def served_model_dir():
    """The built-in SmolLM2 folder (converted once into the default model cache)."""
    return prepare_model(BUILTIN_MODEL)


@pytest.fixture(scope="session")
def served_tokenizer(served_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served_model_dir)
