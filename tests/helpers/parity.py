"""Greedy parity against a reference, with the near-tie rule (docs/engine.md, "Correctness testing"; vLLM's
``check_logprobs_close`` idea).

fp32 matmuls over different batch shapes may sum in different orders, so two correct engines can part
ways at a near-tie. The rule: the token ids must be equal, or the FIRST divergence must sit where the
reference's top two logprobs are within ``tol`` (1e-4) of each other and the tested token is one of those
two; everything after that divergence is ignored. Anything else is a failure.

Typical use in an engine parity test::

    ref = hf_greedy_reference(hf_model, prompt_ids, max_new_tokens=32)
    out = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert_greedy_close(ref.token_ids, ref.top2, out[0].outputs[0].token_ids)

Any reference that produces raw logits per generated position (e.g. a plain no-cache, batch-of-one
run of our own model) can build its ``top2`` with :func:`top_two_from_logits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

NEAR_TIE_TOL = 1e-4


class TopTwo(NamedTuple):
    """The reference's two most likely tokens at one generated position (log-softmax of raw fp32 logits)."""

    logprob_1: float
    logprob_2: float
    token_id_1: int
    token_id_2: int


@dataclass(slots=True)
class GreedyReference:
    """Reference greedy continuation: ``token_ids[i]`` was chosen at step ``i``, with ``top2[i]`` its top two."""

    token_ids: list[int]
    top2: list[TopTwo]


def top_two_from_logits(logits: torch.Tensor) -> list[TopTwo]:
    """``logits: [num_positions, vocab_size]`` (raw, any float dtype) -> one :class:`TopTwo` per row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(2, dim=-1)
    return [TopTwo(float(v[0]), float(v[1]), int(i[0]), int(i[1])) for v, i in zip(values.tolist(), ids.tolist())]


def assert_greedy_close(
    ref_ids: Sequence[int],
    ref_top2: Sequence[TopTwo | tuple[float, float, int, int]],
    test_ids: Sequence[int],
    tol: float = NEAR_TIE_TOL,
    label: str = "",
) -> None:
    """Assert greedy ids match the reference under the near-tie rule (see the module docstring).

    Args:
        ref_ids: the reference's generated ids (prompt excluded).
        ref_top2: per generated position, ``(logprob_1, logprob_2, token_id_1, token_id_2)`` of the
            reference (a :class:`TopTwo` or a plain tuple in that order); at least as long as ``ref_ids``.
        test_ids: the tested engine's generated ids (prompt excluded).
        tol: the largest ``logprob_1 - logprob_2`` that counts as a near-tie.
        label: prefix for the failure message (e.g. the prompt index).

    Raises:
        AssertionError: on a divergence that is not at a near-tie, on a divergence to a token outside
            the reference's top two, or (without any divergence) on different lengths.
    """
    prefix = f"{label}: " if label else ""
    if len(ref_top2) < len(ref_ids):
        raise ValueError(f"{prefix}ref_top2 has {len(ref_top2)} entries for {len(ref_ids)} reference ids")
    for pos, (ref_id, test_id) in enumerate(zip(ref_ids, test_ids)):
        if ref_id == test_id:
            continue
        lp1, lp2, id1, id2 = ref_top2[pos]
        context = (
            f"{prefix}first divergence at generated position {pos}: reference {ref_id}, tested {test_id}; "
            f"reference top two {id1} ({lp1:.6f}) and {id2} ({lp2:.6f}); "
            f"ids before: {list(ref_ids[:pos])}"
        )
        assert lp1 - lp2 <= tol, f"{context}: not a near-tie (gap {lp1 - lp2:.3g} > {tol})"
        assert test_id in (id1, id2), f"{context}: tested token is not one of the reference's top two"
        return
    assert len(ref_ids) == len(test_ids), (
        f"{prefix}same ids up to position {min(len(ref_ids), len(test_ids))}, but reference generated "
        f"{len(ref_ids)} tokens and the tested engine {len(test_ids)}"
    )


@torch.inference_mode()
def hf_greedy_reference(
    hf_model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, *, stop_at_eos: bool = False
) -> GreedyReference:
    """Greedy continuation of one prompt (batch of one) by Hugging Face ``generate``, with per-step top two.

    Run the model in float32 on the CPU for a trustworthy reference. The generation config is explicit
    (greedy, no logits processors), so the checkpoint's ``generation_config.json`` cannot change it.

    Args:
        hf_model: a ``transformers`` causal LM (e.g. ``LlamaForCausalLM.from_pretrained(path)``).
        prompt_ids: the prompt's token ids.
        max_new_tokens: how many tokens to generate.
        stop_at_eos: stop at the model's ``eos_token_id`` (default: never stop early, like ``ignore_eos``).

    Returns:
        :class:`GreedyReference` with the generated ids (prompt excluded) and their top-two logprobs.
    """
    from transformers import GenerationConfig

    # NOTE: None would fall back to the checkpoint's eos; an empty list really disables stopping.
    eos_token_id = hf_model.config.eos_token_id if stop_at_eos else []
    generation_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=hf_model.config.pad_token_id if hf_model.config.pad_token_id is not None else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=hf_model.device)
    out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config)
    token_ids = out.sequences[0, input_ids.shape[1] :].tolist()
    top2 = top_two_from_logits(torch.cat(out.logits, dim=0))[: len(token_ids)]
    for pos, (token_id, top) in enumerate(zip(token_ids, top2)):
        # Greedy over unprocessed logits must pick the raw argmax; anything else means a processor ran.
        assert token_id == top.token_id_1 or top.logprob_1 == top.logprob_2, (
            f"generate picked {token_id} at step {pos}, raw argmax is {top.token_id_1}"
        )
    return GreedyReference(token_ids=token_ids, top2=top2)


def chat_prompt_ids(tokenizer: Any, questions: Sequence[str]) -> list[list[int]]:
    """Each question as one user turn through the tokenizer's chat template, as token ids."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        )
        for q in questions
    ]
