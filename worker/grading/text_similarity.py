"""``text_similarity`` metrics, each computed by the library that defines it; a score in [0, 1].

- ``fuzzy_match``: rapidfuzz ``fuzz.WRatio(input, reference) / 100`` (OpenAI's graders guide names rapidfuzz).
- ``bleu``: sacrebleu ``sentence_bleu(input, [reference]).score / 100`` (13a tokenizer, exp smoothing).
- ``gleu``: nltk ``sentence_gleu([reference.split()], input.split())`` (Google BLEU, Wu et al. 2016).
- ``rouge_1`` ... ``rouge_5``, ``rouge_l``: rouge-score ``RougeScorer([rougeN | rougeL]).score(reference,
  input)`` F-measure (Google's re-implementation of Lin 2004; no stemming).

``meteor`` and ``cosine`` are refused at create (`jobs.evals.criteria.UNAVAILABLE_METRICS`).
The libraries load on first use, so a worker that grades no text similarity does not import them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

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
    **{metric: rouge(metric) for metric in ROUGE_TYPES},
}


def similarity(metric: str, text: str, reference: str) -> float:
    """``metric``'s score of ``text`` against ``reference``, in [0, 1].

    Raises:
        KeyError: ``metric`` is not computed here (``meteor``, ``cosine``; refused at create).
    """
    return METRICS[metric](text, reference)
