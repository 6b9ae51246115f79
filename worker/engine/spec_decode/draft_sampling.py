"""How every model-based proposer turns draft logits into draft tokens (one place for the rule).

Greedy lines draft the argmax of the processed distribution (the line's logits processors applied); sampled
lines draw from the processed, temperature-scaled and truncated distribution ``q`` (``Sampler.probs``), which
the rejection sampler needs to keep the target distribution (Leviathan et al. 2023). A sampled line's draws
come from its own stream (``DRAFT_STREAM``, apart from the target's), keyed by the output position drafted.
"""

from __future__ import annotations

import torch

from worker.engine.core.request import Sequence
from worker.engine.sample.metadata import SamplingMetadata
from worker.engine.sample.sampler import DRAFT_STREAM, Sampler, counter_generator, make_sampling_key
from worker.engine.spec_decode.proposer import DraftProposal


def chain_proposal(seq: Sequence, drafts: list[int], probs: list[torch.Tensor]) -> DraftProposal:
    """A drawn chain as a proposal: a greedy line's drafts are one-hot (no ``probs``), a sampled line's carry the
    distributions ``q`` (float32 ``[vocab_size]`` each) :meth:`DraftDrawer.draw` drew them from."""
    return DraftProposal(drafts, None if seq.params.is_greedy else torch.stack(probs))


class DraftDrawer:
    """Draws one draft token per row of draft logits, keeping each sampled line's key until :meth:`free`."""

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self.sampler = Sampler()
        self._keys: dict[int, int] = {}

    def draw(
        self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]]
    ) -> tuple[list[int], torch.Tensor]:
        """One draft per row: row ``r`` of float32 ``logits: [R, vocab_size]`` continues ``seqs[r]``'s output
        followed by its ``drafts[r]`` so far.

        Returns:
            the drafted token ids ``[R]`` and the distributions ``q`` they were drawn from, float32 ``[R, vocab_size]``
            (a greedy row's ``q`` is unused: its drafts are one-hot for the rejection sampler).
        """
        metadata = SamplingMetadata(
            params=[seq.params for seq in seqs],
            sampling_keys=[0] * len(seqs),
            prompt_token_ids=[seq.prompt_token_ids for seq in seqs],
            output_token_ids=[seq.output_token_ids + drafted for seq, drafted in zip(seqs, drafts, strict=True)],
            eos_token_id=self.eos_token_id,
        )
        q = self.sampler.probs(logits, metadata)
        tokens: list[int] = q.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if seq.params.is_greedy:
                continue
            key = self._keys.get(seq.seq_id)
            if key is None:
                key = self._keys[seq.seq_id] = make_sampling_key(
                    seq.params.seed, seq.sample_index, seq.prompt_token_ids
                )
            position = len(seq.output_token_ids) + len(drafts[row])
            generator = counter_generator(key, position, DRAFT_STREAM, q.device)
            tokens[row] = int(torch.multinomial(q[row], 1, generator=generator).item())
        return tokens, q

    def free(self, seq_id: int) -> None:
        self._keys.pop(seq_id, None)
