"""Self-distillation of draft heads: the target teaches heads on text it produced itself.

EAGLE (Li et al. 2024, section 4.3) and Medusa (Cai et al. 2024, Medusa-1 with self-distillation, section
2.3.2) both train on the target's own outputs so the heads learn the distribution they will be verified
against. Here the data is token sequences (prompt + the target's greedy completion, from
:func:`generate_sequences` or a database's completed lines); one forward of the target over each sequence gives
its final-norm features ``f`` and its next-token argmax ``t`` (the teacher), cached once.

Losses, per sequence of ``L`` tokens ``x``:

- EAGLE: the head reads ``(f[p], x[p + 1])`` for ``p < L - 1`` and predicts ``f[p + 1]``; loss = Smooth L1 of the
  features + ``ce_weight`` (``0.1``, EAGLE's weight) x cross-entropy of the target's LM head over the predicted
  feature against ``t[p + 1]``. With ``training_time_test`` (EAGLE-3's "training-time test", Li et al. 2025) a
  second pass feeds the head its own predicted features, as drafting does from depth 2 on
  (:func:`depth_two_visible`), and adds the same two losses for it.
- Medusa: head ``k`` reads ``f[p]`` and is scored by cross-entropy against ``t[p + 1 + k]``, head ``k``
  weighted ``0.8 ** k`` (Medusa's decay).

The cross-entropies, which each need the LM head (the bulk of the cost), are computed on ``ce_rows`` random rows
per sequence; the feature loss on all of them. AdamW, linear warm-up then cosine decay. The state (head,
optimizer, step, RNG) is saved every ``checkpoint_every`` steps in the output folder and training resumes from
it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from worker.engine.executor.layers.attention import scratch_prefill_metadata
from worker.engine.executor.models.llama import head_size_of, num_kv_heads_of
from worker.engine.spec_decode.heads.eagle import EagleHead, EagleHeadConfig
from worker.engine.spec_decode.heads.medusa import MedusaHeads
from worker.engine.spec_decode.heads.storage import save_draft_vocab, save_head

STATE_FILE = "train_state.pt"
MEDUSA_DECAY = 0.8


@dataclass(slots=True)
class TrainConfig:
    """Hyper-parameters (defaults: ``batchinfer heads train``'s, sized for SmolLM2-135M on 2 CPU cores).

    ``num_steps`` optimizer steps of ``batch_size`` sequences each; ``lr`` the peak AdamW learning rate after
    ``warmup_steps``; ``ce_rows`` rows per sequence scored through the LM head; ``num_medusa_heads`` and
    ``num_medusa_layers`` shape Medusa heads; ``checkpoint_every`` steps between saved states; ``draft_vocab_size``
    the most frequent tokens of the data saved as the head's draft vocabulary (0: none, draft over all tokens);
    ``ce_weight`` EAGLE's cross-entropy weight; ``training_time_test`` EAGLE's second pass over its own predictions;
    ``snapshot_steps`` steps after which the head is also kept in ``<out_dir>/step-<N>`` (a budget's checkpoint:
    the learning rate there follows the whole run's schedule, not a run of that length).
    """

    method: str = "eagle"
    num_steps: int = 400
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    ce_rows: int = 64
    num_medusa_heads: int = 3
    num_medusa_layers: int = 1
    checkpoint_every: int = 50
    seed: int = 0
    draft_vocab_size: int = 8192
    ce_weight: float = 0.1
    training_time_test: bool = False
    snapshot_steps: tuple[int, ...] = ()


@dataclass(slots=True)
class TrainingData:
    """Per sequence: ``token_ids`` (LongTensor ``[L]``), the target's final-norm ``features`` (float32 ``[L, hidden]``)
    and its argmax next tokens ``teacher_ids`` (LongTensor ``[L]``, ``teacher_ids[p]`` predicts ``token_ids[p + 1]``)."""

    token_ids: list[torch.Tensor]
    features: list[torch.Tensor]
    teacher_ids: list[torch.Tensor]


@dataclass(slots=True)
class TrainResult:
    """The losses of each step run in this call (``first_step`` is where it resumed) and the saved head's folder."""

    folder: Path
    first_step: int
    losses: list[float] = field(default_factory=list)


def target_features(model: Any, sequences: list[list[int]], *, max_batch_tokens: int = 4096) -> TrainingData:
    """Run ``model`` (our engine's, any dtype/device) over each whole sequence: its features and argmax teacher.

    Sequences go in ragged batches of up to ``max_batch_tokens`` tokens with a scratch paged KV cache.
    """
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    config = model.config
    block_size = 16
    num_kv_heads = num_kv_heads_of(config)
    data = TrainingData([], [], [])
    batch: list[list[int]] = []

    def flush() -> None:
        scratch = scratch_prefill_metadata(
            [len(s) for s in batch],
            block_size,
            num_queries_per_kv=int(config.num_attention_heads) // num_kv_heads,
            dtype=dtype,
            device=device,
        )
        shape = (2, scratch.num_blocks, block_size, num_kv_heads, head_size_of(config))
        kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(int(config.num_hidden_layers))]
        input_ids = torch.tensor([t for s in batch for t in s], dtype=torch.long, device=device)
        hidden = model(input_ids, scratch.metadata.positions, kv_caches, scratch.metadata)
        offset = 0
        for seq in batch:
            rows = hidden[offset : offset + len(seq)]
            offset += len(seq)
            data.token_ids.append(torch.tensor(seq, dtype=torch.long))
            data.features.append(rows.float().cpu())
            data.teacher_ids.append(model.compute_logits(rows).argmax(dim=-1).cpu())
        batch.clear()

    # NOTE: no_grad, not inference_mode: the cached tensors take part in autograd when the head trains.
    with torch.no_grad():
        for seq in sequences:
            if len(seq) < 3:
                continue
            if batch and sum(len(s) for s in batch) + len(seq) > max_batch_tokens:
                flush()
            batch.append(seq)
        if batch:
            flush()
    return data


def target_weights(model_dir: str | Path, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and LM head weights as plain ``[vocab_size, hidden_size]`` tensors (the loaded
    model's LM head may be packed for inference: an untied one is read from the checkpoint's safetensors).

    Raises:
        ValueError: an untied model whose checkpoint has no ``lm_head.weight``.
    """
    embed: torch.Tensor = model.model.embed_tokens.weight
    if bool(model.config.tie_word_embeddings):
        return embed, embed
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            if "lm_head.weight" in handle.keys():  # noqa: SIM118 (a safetensors handle has no __contains__)
                return embed, handle.get_tensor("lm_head.weight").float()
    raise ValueError(f"{model_dir} has no lm_head.weight")


def new_head(method: str, target_config: Any, train_config: TrainConfig) -> EagleHead | MedusaHeads:
    """A fresh head for ``target_config`` (EAGLE: one layer shaped like the target's; Medusa: zero-initialised blocks).

    Raises:
        ValueError: an unknown ``method``.
    """
    if method == "eagle":
        return EagleHead(EagleHeadConfig.for_target(target_config))
    if method == "medusa":
        return MedusaHeads(
            int(target_config.hidden_size), train_config.num_medusa_heads, train_config.num_medusa_layers
        )
    raise ValueError(f"method must be 'eagle' or 'medusa', got {method!r}")


def depth_two_visible(num: int) -> torch.Tensor:
    """The attention mask of EAGLE's second training pass (EAGLE-3's "training-time test", Li et al. 2025) over
    ``num`` first-pass entries: row ``q - 1`` (``q = 1 .. num - 1``) reads the head's own predicted feature of
    position ``q``, as a draft at depth 2 does, and sees the first pass's entries ``0 .. q - 1`` (the committed
    ones at test time) and itself: bool ``[num - 1, 2 * num - 1]`` (:meth:`EagleHead.forward`'s ``visible``)."""
    own = torch.arange(num - 1)
    return torch.cat((torch.arange(num)[None, :] <= own[:, None], torch.eye(num - 1, dtype=torch.bool)), dim=1)


def _eagle_loss(
    head: EagleHead,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    tokens: torch.Tensor,
    f: torch.Tensor,
    teacher: torch.Tensor,
    rows: torch.Tensor,
    config: TrainConfig,
) -> torch.Tensor:
    num = tokens.shape[0] - 1
    embeds = F.embedding(tokens[1:], embed)
    pred, kv = head(f[:num], embeds, torch.arange(num))
    loss = F.smooth_l1_loss(pred, f[1:]) + config.ce_weight * F.cross_entropy(pred[rows] @ lm_head.T, teacher[1:][rows])
    if config.training_time_test and num >= 2:
        pred2, _ = head(pred[:-1], embeds[1:], torch.arange(1, num), kv, depth_two_visible(num))
        rows2 = rows[rows < num - 1]
        loss = loss + F.smooth_l1_loss(pred2, f[2:])
        loss = loss + config.ce_weight * F.cross_entropy(pred2[rows2] @ lm_head.T, teacher[2:][rows2])
    return loss


def _medusa_loss(
    heads: MedusaHeads, lm_head: torch.Tensor, f: torch.Tensor, teacher: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    length = f.shape[0]
    out = heads(f[rows])  # [K, rows, hidden]
    total = f.new_zeros(())
    for k in range(heads.num_heads):
        valid = rows + 1 + k < length
        if bool(valid.any()):
            logits = out[k][valid] @ lm_head.T
            total = total + MEDUSA_DECAY**k * F.cross_entropy(logits, teacher[rows[valid] + 1 + k])
    return total


def train_heads(
    data: TrainingData,
    *,
    target_config: Any,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    out_dir: str | Path,
    config: TrainConfig,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train ``config.method``'s head on ``data`` (float32 on the CPU) and save it in ``out_dir``.

    Resumes from ``out_dir/train_state.pt`` when it exists (the same method), saving it every
    ``checkpoint_every`` steps and at the end, with the head (``config.json`` + ``model.safetensors``).

    Args:
        embed_weight, lm_head_weight: the target's frozen ``[vocab_size, hidden_size]`` embedding and LM head.
        on_step: called after each step with ``(step number from 1, loss)`` (a progress bar).

    Raises:
        ValueError: empty ``data``, or a saved state of another method.
    """
    if not data.token_ids:
        raise ValueError("no training sequences (each needs at least 3 tokens)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    head = new_head(config.method, target_config, config).float().train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    step = 0
    generator = torch.Generator().manual_seed(config.seed)
    state_path = out_dir / STATE_FILE
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        if state["method"] != config.method:
            raise ValueError(f"{state_path} holds a {state['method']} run, not {config.method}")
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        generator.set_state(state["generator"])
    result = TrainResult(out_dir, step)
    embed = embed_weight.detach().float()
    lm_head = lm_head_weight.detach().float()

    def lr_at(n: int) -> float:
        if n < config.warmup_steps:
            return config.lr * (n + 1) / config.warmup_steps
        progress = (n - config.warmup_steps) / max(1, config.num_steps - config.warmup_steps)
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    def save_head_only(folder: Path) -> None:
        save_head(head, folder)
        if config.draft_vocab_size > 0:
            save_draft_vocab(folder, data.token_ids, config.draft_vocab_size)

    def save() -> None:
        state = {
            "method": config.method,
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "generator": generator.get_state(),
        }
        torch.save(state, state_path)
        save_head_only(out_dir)

    while step < config.num_steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        picks = torch.randint(len(data.token_ids), (config.batch_size,), generator=generator).tolist()
        losses = []
        for i in picks:
            tokens, f, teacher = data.token_ids[i], data.features[i], data.teacher_ids[i]
            num_rows = tokens.shape[0] - 1
            rows = torch.randperm(num_rows, generator=generator)[: config.ce_rows]
            if isinstance(head, EagleHead):
                losses.append(_eagle_loss(head, embed, lm_head, tokens, f, teacher, rows, config))
            else:
                losses.append(_medusa_loss(head, lm_head, f, teacher, rows))
        loss = torch.stack(losses).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        step += 1
        result.losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, result.losses[-1])
        if step in config.snapshot_steps:
            save_head_only(out_dir / f"step-{step}")
        if step % config.checkpoint_every == 0 or step == config.num_steps:
            save()
    if not state_path.is_file():  # num_steps 0: the fresh head
        save()
    return result
