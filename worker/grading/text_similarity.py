"""``text_similarity`` metrics, each computed by the library that defines it; a score in [0, 1].

- ``fuzzy_match``: rapidfuzz ``fuzz.WRatio(input, reference) / 100`` (OpenAI's graders guide names rapidfuzz).
- ``bleu``: sacrebleu ``sentence_bleu(input, [reference]).score / 100`` (13a tokenizer, exp smoothing).
- ``gleu``: nltk ``sentence_gleu([reference.split()], input.split())`` (Google BLEU, Wu et al. 2016).
- ``meteor``: nltk ``meteor_score([reference.split()], input.split(), wordnet=...)`` (Banerjee and Lavie
  2005: unigram matches exact, stemmed and WordNet synonyms); the WordNet 3.0 corpus is read from nltk's data
  path, where ``scripts/setup.sh`` installs it (``scripts/install_wordnet.py``).
- ``cosine``: the cosine of the two texts' embeddings by the deployment's first ``embed`` model
  (`jobs.config.Settings.models`; all-MiniLM-L6-v2 by default), each text cut to the model's
  ``max_seq_length`` as sentence-transformers ``encode`` does; in [-1, 1], near 0 for unrelated texts.
  The embedding engine is built in the grading process on first use (docs/api.md, "Graders").
- ``rouge_1`` ... ``rouge_5``, ``rouge_l``: rouge-score ``RougeScorer([rougeN | rougeL]).score(reference,
  input)`` F-measure (Google's re-implementation of Lin 2004; no stemming).

The libraries load on first use, so a worker that grades no text similarity does not import them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.pooling_engine import PoolingEngine

ROUGE_TYPES = {f"rouge_{n}": f"rouge{n}" for n in range(1, 6)} | {"rouge_l": "rougeL"}


def fuzzy_match(text: str, reference: str) -> float:
    from rapidfuzz import fuzz

    return float(fuzz.WRatio(text, reference)) / 100.0


def bleu(text: str, reference: str) -> float:
    import sacrebleu

    return float(sacrebleu.sentence_bleu(text, [reference]).score) / 100.0


def gleu(text: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    return float(sentence_gleu([reference.split()], text.split()))


class MetricUnavailable(RuntimeError):
    """A metric cannot be computed on this worker (its data or model is missing); the message says how to fix it."""


def meteor(text: str, reference: str) -> float:
    """nltk's METEOR of ``text`` against ``reference`` (whitespace tokens).

    Raises:
        MetricUnavailable: the WordNet corpus is not on nltk's data path.
    """
    from nltk.corpus import wordnet
    from nltk.translate.meteor_score import meteor_score

    try:
        wordnet.ensure_loaded()
    except LookupError:
        raise MetricUnavailable(
            "meteor needs the WordNet 3.0 corpus on nltk's data path; install it with "
            "`python scripts/install_wordnet.py` (scripts/setup.sh does)"
        ) from None
    return float(meteor_score([reference.split()], text.split(), wordnet=wordnet))


@cache
def _embedding_engine() -> PoolingEngine:
    """The deployment's first ``embed`` model, built once per process.

    Raises:
        MetricUnavailable: the model list holds no embedding model.
    """
    from jobs.config import get_settings
    from worker.engine.pooling_engine import build_embedding_engine
    from worker.model_prepare import prepare_model

    settings = get_settings()
    entry = next((entry for entry in settings.models if entry.kind == "embed"), None)
    if entry is None:
        raise MetricUnavailable("cosine needs an embedding model (kind embed) in BATCHINFER_MODELS, and none is listed")
    return build_embedding_engine(prepare_model(entry.source, settings.model_cache_dir), dtype=settings.dtype)


def cosine_scores(texts: Sequence[str], references: Sequence[str]) -> list[float]:
    """Cosine similarity of each ``texts[i]`` with ``references[i]`` by the deployment's embedding model, in one
    embedding pass over all the texts.

    Raises:
        MetricUnavailable: no embedding model is listed.
    """
    import torch

    engine = _embedding_engine()
    inputs = [engine.tokenize(text, truncate_prompt_tokens=-1) for text in (*texts, *references)]
    embeddings = engine.embed(inputs, normalize=True)
    num_texts = len(texts)
    cosines = torch.nn.functional.cosine_similarity(embeddings[:num_texts], embeddings[num_texts:], dim=-1)
    return [float(value) for value in cosines]


def cosine(text: str, reference: str) -> float:
    """`cosine_scores` of one pair."""
    (score,) = cosine_scores([text], [reference])
    return score


@cache
def _rouge_scorer(rouge_type: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type])


def rouge(metric: str) -> Callable[[str, str], float]:
    """The ROUGE F-measure named by ``metric`` (``rouge_1`` ... ``rouge_5``, ``rouge_l``)."""
    rouge_type = ROUGE_TYPES[metric]

    def score(text: str, reference: str) -> float:
        return float(_rouge_scorer(rouge_type).score(reference, text)[rouge_type].fmeasure)

    return score


METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": fuzzy_match,
    "bleu": bleu,
    "gleu": gleu,
    "meteor": meteor,
    "cosine": cosine,
    **{metric: rouge(metric) for metric in ROUGE_TYPES},
}


def similarity(metric: str, text: str, reference: str) -> float:
    """``metric``'s score of ``text`` against ``reference``: in [0, 1] (``cosine``: [-1, 1]).

    Raises:
        KeyError: ``metric`` is not one of `METRICS`.
        MetricUnavailable: the metric's data or model is missing on this worker.
    """
    return METRICS[metric](text, reference)
