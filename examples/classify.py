"""Build the classification example job: 300 `/v1/chat/completions` lines, one short product review each,
answered as JSON under a strict ``json_schema`` (docs/api.md, "Structured outputs").

Each review is made from fixed lists (a product, the aspect it talks about, a verdict), so the file is the
same on every run and needs no network. The schema is `ReviewLabel`'s JSON Schema (pydantic, every field
required, no other field: what OpenAI's strict mode asks); each answer loads into `ReviewLabel`.

Usage: ``python examples/classify.py [--model NAME] [--output examples/classify.jsonl]``
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.config import BUILTIN_MODEL

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "classify.jsonl"
MAX_TOKENS = 64
NUM_LINES = 300

Sentiment = Literal["positive", "negative", "neutral"]
Aspect = Literal["battery", "screen", "price", "delivery", "build", "sound"]


class ReviewLabel(BaseModel):
    """What each answer holds: the review's sentiment, the aspect it is about, and a 1-5 star rating."""

    model_config = ConfigDict(extra="forbid")

    sentiment: Sentiment
    aspect: Aspect
    stars: Annotated[int, Field(ge=1, le=5)]


PRODUCTS = ["phone", "laptop", "headset", "tablet", "speaker", "camera", "e-reader", "smartwatch", "monitor", "router"]
ASPECT_WORDS: dict[str, list[str]] = {
    "battery": ["battery", "battery life"],
    "screen": ["screen", "display"],
    "price": ["price", "value for money"],
    "delivery": ["delivery", "shipping"],
    "build": ["build quality", "case"],
    "sound": ["sound", "speakers"],
}
VERDICTS: dict[str, list[str]] = {
    "positive": ["is excellent", "exceeded my expectations", "is the best I have had", "works perfectly"],
    "negative": ["is terrible", "broke within a week", "is a big disappointment", "stopped working after a day"],
    "neutral": ["is fine, nothing special", "is about what I expected", "is average", "is okay for daily use"],
}
SYSTEM = (
    "You label product reviews. Answer with JSON only: the review's sentiment (positive, negative or "
    "neutral), the aspect it talks about and a star rating from 1 to 5."
)


def response_format() -> dict[str, Any]:
    """The lines' ``response_format``: `ReviewLabel`'s schema, strict."""
    return {
        "type": "json_schema",
        "json_schema": {"name": "review_label", "strict": True, "schema": ReviewLabel.model_json_schema()},
    }


def reviews() -> list[str]:
    """`NUM_LINES` distinct reviews, a fixed interleaving of products, aspects and verdicts."""
    aspect_phrases = [(aspect, word) for aspect, words in ASPECT_WORDS.items() for word in words]
    verdicts = [verdict for sentiment in VERDICTS.values() for verdict in sentiment]
    combos = list(itertools.product(PRODUCTS, aspect_phrases, verdicts))
    # NOTE: a stride of 7 through the 1,440 combinations (coprime) mixes products, aspects and verdicts.
    picked = [combos[(index * 7) % len(combos)] for index in range(NUM_LINES)]
    return [f"The {word} of this {product} {verdict}." for product, (_, word), verdict in picked]


def build_lines(model: str = BUILTIN_MODEL) -> list[dict[str, Any]]:
    """One chat line per review; ``custom_id`` is ``review-N`` (1-based)."""
    return [
        {
            "custom_id": f"review-{index}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}],
                "response_format": response_format(),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
            },
        }
        for index, review in enumerate(reviews(), start=1)
    ]


def write_jsonl(lines: list[dict[str, Any]], output: Path) -> None:
    output.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default=BUILTIN_MODEL, help="served model name to put in each body")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    lines = build_lines(args.model)
    write_jsonl(lines, args.output)
    print(f"wrote {len(lines)} lines to {args.output}")


if __name__ == "__main__":
    main()
