"""A fake-model engine step for scheduler tests (pure Python, no torch)."""


def run_step(scheduler):
    """One engine step with a fake model: sampled token = position % 5; finish at max_tokens.

    Calls ``check_invariants()`` on the KV cache manager after the step and returns the SchedulerOutput.
    """
    out = scheduler.schedule()
    scheduler.update_from_output(out)
    finished = []
    for seq in out.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(seq.num_tokens % 5)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                finished.append(seq)
    scheduler.finish_seqs(finished)
    scheduler.kv_cache_manager.check_invariants()
    return out


def scheduled(out):
    """``[(seq_id, num_scheduled_tokens)]`` of a SchedulerOutput, in batch order."""
    return [(seq.seq_id, num) for seq, num in zip(out.seqs, out.num_scheduled_tokens)]
