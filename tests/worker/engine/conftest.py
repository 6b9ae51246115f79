"""Fixtures of the engine tests: a tiny random-weight Llama folder and its Hugging Face twin (one per module)."""

import pytest
import torch
import transformers

from tests.helpers.tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
