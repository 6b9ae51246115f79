"""Beam search over copy-on-write forks: one request's beams, candidates in, kept/forked/dropped beams out.

Follows Hugging Face transformers' ``GenerationMixin._beam_search`` (v5, ``do_sample=False``) step by step,
so the same model gives the same beams:

1. Every live beam offers its top ``2 * width`` next tokens by ``log_softmax`` of the raw logits; the
   ``2 * width`` best of all ``beam cumulative logprob + token logprob`` are the step's candidates (a
   single prefilled beam expands first: HF starts with one live beam).
2. A candidate *stops* on EOS (unless ``ignore_eos``), a stop token id, ``max_tokens`` or the context
   limit. The first ``width`` non-stopping candidates become the next live beams (best first).
3. Stopping candidates among the first ``width`` become finished hypotheses with score
   ``cumulative logprob / generated_length ** length_penalty`` (the stop token counted), unless all
   ``width`` slots are full and ``early_stopping`` is set, or the search can no longer improve; the
   best ``width`` hypotheses are kept.
4. "Can no longer improve" (HF's heuristic, sticky): once all slots are full and the best live beam's
   ``cumulative logprob / generated_length ** length_penalty`` is not above the worst kept score.
5. The search ends when it cannot improve, when all slots are full with ``early_stopping``, or when
   every candidate stopped.

The engine applies the result (:class:`BeamStep`): the first candidate of a parent continues in the
parent's sequence, further ones fork it (sharing its KV blocks, copy-on-write), parents with no kept
candidate are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.core.request import Sequence
from worker.engine.outputs import FinishReason

# Candidate = (token_id, logprob) from the top of one live beam's log-softmax.
Candidate = tuple[int, float]


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: generated ``token_ids`` (stop token included), their summed logprob and its score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason
    stop_reason: int | None


@dataclass(slots=True)
class BeamStep:
    """What one step decided: ``kept[i] = (parent, token_id, logprob)`` is live beam ``i`` of the next
    step, best first (a parent may appear several times); ``dropped`` parents have no continuation;
    ``done`` means the search is over (``kept`` is then empty and every live beam is dropped)."""

    kept: list[tuple[Sequence, int, float]]
    dropped: list[Sequence]
    done: bool


@dataclass(slots=True)
class BeamSearchState:
    """One request's beam search: ``width`` beams, HF's ``length_penalty`` and boolean ``early_stopping``.

    ``live`` are the live beams (best first); ``candidates`` the candidates each reported this step (by
    ``seq_id``); ``finished`` the kept hypotheses (at most ``width``, best first).
    """

    width: int
    length_penalty: float
    early_stopping: bool
    live: list[Sequence]
    candidates: dict[int, list[Candidate]] = field(default_factory=dict)
    finished: list[BeamHypothesis] = field(default_factory=list)
    can_improve: bool = True

    def report(self, seq: Sequence, candidates: list[Candidate]) -> bool:
        """Record a live beam's candidates; True once every live beam has reported for this step."""
        self.candidates[seq.seq_id] = candidates
        return all(beam.seq_id in self.candidates for beam in self.live)

    def step(self, stops: dict[tuple[int, int], tuple[FinishReason, int | None]]) -> BeamStep:
        """Expand, select and finish beams (module docstring, 1 to 5); mutates ``live``, ``finished``.

        Args:
            stops: ``(seq_id, token_id) -> (finish_reason, stop_reason)`` for every reported candidate
                that would end its beam (EOS, stop token id, ``max_tokens``, context limit).

        Returns:
            the next live beams as ``(parent, token_id, logprob)``, the dropped parents, and whether done.
        """
        width = self.width
        expanded = [
            (beam.cumulative_logprob + logprob, beam_idx, token_id, logprob)
            for beam_idx, beam in enumerate(self.live)
            for token_id, logprob in self.candidates[beam.seq_id]
        ]
        # NOTE: ties go to the lower flat index (beam_idx * vocab + token_id), as torch.topk usually does.
        expanded.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = expanded[: 2 * width]
        new_len = len(self.live[0].output_token_ids) + 1
        penalty = new_len**self.length_penalty

        slots_full = len(self.finished) == width
        new_hyps = []
        if self.can_improve and not (slots_full and self.early_stopping):
            for total, beam_idx, token_id, _ in top[:width]:
                stop = stops.get((self.live[beam_idx].seq_id, token_id))
                if stop is not None:
                    beam = self.live[beam_idx]
                    new_hyps.append(
                        BeamHypothesis([*beam.output_token_ids, token_id], total, total / penalty, stop[0], stop[1])
                    )
        if new_hyps:
            merged = self.finished + new_hyps
            merged.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
            self.finished = merged[:width]

        running = [c for c in top if (self.live[c[1]].seq_id, c[2]) not in stops][:width]
        all_stopped = not running
        if self.can_improve and running and len(self.finished) == width:
            best_running = running[0][0] / penalty
            if best_running <= min(h.score for h in self.finished):
                self.can_improve = False
        done = all_stopped or not self.can_improve or (len(self.finished) == width and self.early_stopping)
        self.candidates = {}
        if done:
            dropped, self.live = self.live, []
            return BeamStep([], dropped, True)
        kept = [(self.live[beam_idx], token_id, logprob) for _, beam_idx, token_id, logprob in running]
        kept_ids = {id(parent) for parent, _, _ in kept}
        dropped = [beam for beam in self.live if id(beam) not in kept_ids]
        return BeamStep(kept, dropped, False)

    def best(self, n: int) -> list[BeamHypothesis]:
        """The ``n`` best finished hypotheses, best first."""
        return self.finished[:n]
