"""The pooling engine (embeddings) against sentence-transformers and Hugging Face, and its input checks."""

import random

import pytest
import torch
import transformers
from torch.nn import functional as F

from jobs.config import BUILTIN_EMBEDDING_MODEL
from kernels import cpu_extension
from tests.helpers.tiny_models import save_tiny_bert, save_tiny_model
from worker.engine.errors import InvalidParameterError
from worker.engine.executor.models import bert
from worker.engine.pooling_engine import InputTooLongError, build_embedding_engine
from worker.model_prepare import prepare_model

_PROSE = (
    "the a of to and in is it that for on with as was by at from this be or an are not have but one all "
    "model batch token vector cosine encoder python def return class import self data file line query "
    "river mountain quickly gently although because sentence embedding search index 42 3.14 (x) {y} [z]"
)
WORDS = _PROSE.split()


def _texts(count: int, max_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(count)]


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.mark.parametrize("kernels", ["cpu-kernels", "cpu-kernels-mkl", "torch"])
def test_tiny_bert_matches_hugging_face_mean_pooling(tiny_bert_dir, kernels, monkeypatch):
    """On the C++ kernels with oneDNN's linears (padded batches), with MKL's, and on torch's ops."""
    if kernels == "torch":
        monkeypatch.setenv(cpu_extension.DISABLE_ENV, "0")
    if kernels == "cpu-kernels-mkl":
        monkeypatch.setattr(bert, "onednn_linear_available", lambda: False)
    engine = build_embedding_engine(tiny_bert_dir, max_num_batched_tokens=64)
    layer = engine.model.layers[0]
    assert layer.use_cpu_kernels == (kernels != "torch" and cpu_extension.cpu_kernels_available())
    assert (layer.onednn_weights is not None) == (layer.use_cpu_kernels and kernels == "cpu-kernels")
    prompts = [[(i * 7 + n) % 256 + 3 for i in range(n)] for n in (1, 5, 5, 5, 17, 40, 90, 128)]
    ours = engine.embed(prompts)
    hf = transformers.BertModel.from_pretrained(tiny_bert_dir).eval()
    with torch.no_grad():
        reference = [F.normalize(hf(torch.tensor([p])).last_hidden_state[0].mean(0), dim=0) for p in prompts]
    assert engine.last_stats.num_batches > 1  # the token budget cut the inputs into several packed batches
    assert engine.pooling.pooling_type == "mean" and engine.pooling.normalize
    torch.testing.assert_close(ours, torch.stack(reference), atol=1e-5, rtol=1e-5)


def test_batches_side_by_side_equal_one_stream_and_restore_threads(tiny_bert_dir):
    """With 2 torch threads, ``embed`` runs its packed batches on 2 streams of one thread each: every vector is
    bit-identical to the one-thread run's, and torch's thread count is 2 again afterwards, also after an error."""
    engine = build_embedding_engine(tiny_bert_dir, max_num_batched_tokens=64)
    prompts = [[(i * 5 + n) % 256 + 3 for i in range(n)] for n in (3, 64, 9, 33, 50, 2, 17, 64, 40, 1, 28, 61)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_stream = engine.embed(prompts)
        torch.set_num_threads(2)
        streams = engine.embed(prompts)
        assert engine.last_stats.num_batches > 2
        assert torch.get_num_threads() == 2
        assert torch.equal(streams, one_stream)
        with pytest.raises(IndexError):
            engine.embed(prompts[:6] + [[10**9]] + prompts[6:])  # an out-of-vocabulary id fails inside a stream
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _bf16_linears_available() -> bool:
    return (
        cpu_extension.cpu_kernels_available()
        and bert.onednn_linear_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@pytest.mark.skipif(not _bf16_linears_available(), reason="needs the C++ kernels and oneDNN with bfloat16")
def test_bfloat16_linears_stay_close_to_float32(tiny_bert_dir):
    """The opt-in ``matmul_dtype="bfloat16"``: bfloat16 packed weights, float32 results, close to float32."""
    prompts = [[(i * 7 + n) % 256 + 3 for i in range(n)] for n in (1, 5, 17, 40, 90, 128)]
    reference = build_embedding_engine(tiny_bert_dir, max_num_batched_tokens=64).embed(prompts)
    engine = build_embedding_engine(tiny_bert_dir, max_num_batched_tokens=64, matmul_dtype="bfloat16")
    layer = engine.model.layers[0]
    assert layer.onednn_dtype == torch.bfloat16 and layer.qkv_proj.weight.dtype == torch.float32
    ours = engine.embed(prompts)
    assert ours.dtype == torch.float32 and not torch.equal(ours, reference)
    assert F.cosine_similarity(ours, reference, dim=-1).min().item() >= 0.999


def test_bfloat16_linears_are_refused_off_the_encoder_kernels(tmp_path, tiny_bert_dir, monkeypatch):
    with pytest.raises(ValueError, match="matmul_dtype"):
        build_embedding_engine(save_tiny_model(tmp_path / "llama", "llama"), matmul_dtype="bfloat16")
    with pytest.raises(ValueError, match="matmul_dtype"):
        build_embedding_engine(tiny_bert_dir, matmul_dtype="float16")
    monkeypatch.setenv(cpu_extension.DISABLE_ENV, "0")
    with pytest.raises(ValueError, match="matmul_dtype"):
        build_embedding_engine(tiny_bert_dir, matmul_dtype="bfloat16")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_embedder_matches_hugging_face_last_token(tmp_path, family):
    path = save_tiny_model(tmp_path / family, family)
    engine = build_embedding_engine(path, max_num_batched_tokens=64)
    prompts = [[(i * 5 + n) % 256 + 3 for i in range(n)] for n in (1, 3, 3, 20, 64, 100)]
    ours = engine.embed(prompts)
    hf = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        reference = [F.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1], dim=0) for p in prompts]
    assert (engine.pooling.pooling_type, engine.pooling.normalize, engine.is_encoder) == ("last", True, False)
    torch.testing.assert_close(ours, torch.stack(reference), atol=1e-5, rtol=1e-5)


def test_input_checks(tiny_bert_dir):
    engine = build_embedding_engine(tiny_bert_dir)
    with pytest.raises(ValueError, match="empty"):
        engine.check_prompt([])
    with pytest.raises(InvalidParameterError, match=r"outside the vocabulary \[0, 259\): 259, 1000"):
        engine.check_prompt([5, 259, 1000])
    with pytest.raises(InputTooLongError, match="129 tokens but the model embeds at most 128"):
        engine.check_prompt([5] * 129)
    assert engine.check_prompt(list(range(3, 203)), truncate_prompt_tokens=-1) == list(range(75, 203))
    assert engine.check_prompt([3, 4, 5, 6], truncate_prompt_tokens=2) == [5, 6]
    assert len(engine.tokenize("x" * 300, truncate_prompt_tokens=-1)) == 128
    assert not engine.supports_dimensions(32) and engine.supports_dimensions(64)
    with pytest.raises(ValueError, match="dimensions=32"):
        engine.embed([[5]], dimensions=32)


def test_matryoshka_dimensions_shorten_then_normalise(tmp_path):
    path = save_tiny_model(tmp_path / "qwen3", "qwen3", is_matryoshka=True)
    engine = build_embedding_engine(path)
    full = engine.embed([[5, 6, 7]], normalize=False)
    short = engine.embed([[5, 6, 7]], dimensions=16)
    assert engine.supports_dimensions(16)
    torch.testing.assert_close(short, F.normalize(full[:, :16], dim=-1))


@pytest.mark.slow
def test_minilm_matches_sentence_transformers():
    """all-MiniLM-L6-v2 (the built-in embedding model): 1,000 texts of 1-60 words, fp32, cosine >= 0.99999."""
    from sentence_transformers import SentenceTransformer

    model_dir = prepare_model(BUILTIN_EMBEDDING_MODEL)
    texts = _texts(1000, 60)
    engine = build_embedding_engine(model_dir)
    ours = engine.embed([engine.tokenize(text) for text in texts])
    reference = SentenceTransformer(str(model_dir), device="cpu").encode(texts, batch_size=64, convert_to_tensor=True)
    cosine = F.cosine_similarity(ours, reference.float(), dim=-1)
    assert cosine.min().item() >= 0.99999
