"""``batchinfer heads train``: train EAGLE or Medusa draft heads for a served model by self-distillation.

    batchinfer heads train [--method eagle|medusa] [--model NAME_OR_DIR] [--prompts FILE ...] [--from-db]
                           [--num-prompts N] [--skip-prompts N] [--max-tokens N] [--steps N] [--lr LR] [--out DIR]

The data is text the model produced itself: with ``--from-db``, completed lines of finished batches in the
service's database (prompt + the returned completion); otherwise the model's greedy completions, generated
here with our engine, of the prompts of batch-input JSONL files (``/v1/completions`` prompts and
``/v1/chat/completions`` messages, default ``examples/humaneval.jsonl`` and ``examples/chat.jsonl``). The
sequences are cached in the output folder (``train_data.pt``), the training state every 50 steps
(``train_state.pt``): running the same command again resumes. The head is written to ``<model>/heads/<method>``
(``config.json`` + ``model.safetensors``) where workers with ``BATCHINFER_SPECULATIVE_METHOD=eagle|medusa`` find
it. Training itself: :mod:`worker.engine.spec_decode.heads.train` (losses, defaults, sources).

Wired into ``worker.cli`` by ``add_heads_commands``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from itertools import zip_longest
from pathlib import Path
from typing import Any

from jobs.config import Settings

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
DEFAULT_PROMPT_FILES = (EXAMPLES_DIR / "humaneval.jsonl", EXAMPLES_DIR / "chat.jsonl")
DATA_FILE = "train_data.pt"


def add_heads_commands(commands: Any, settings: Settings) -> None:
    """Add ``heads train`` to the ``batchinfer`` sub-command parsers ``commands``."""
    from worker.cli import _non_negative_int, _positive_int

    # NOTE: TrainConfig's defaults apply when an option is left out (None): importing it here would load torch
    # for every `batchinfer` command.
    actions = commands.add_parser("heads", help="draft heads for speculative decoding (docs/engine.md)").add_subparsers(
        required=True, metavar="ACTION"
    )
    train = actions.add_parser("train", help="train EAGLE or Medusa heads on the model's own outputs (resumable)")
    train.add_argument("--method", choices=("eagle", "medusa"), default="eagle")
    train.add_argument("--model", default=settings.model, help="the served model's name or folder")
    train.add_argument("--prompts", type=Path, action="append", help="batch-input JSONL file(s) of prompts")
    train.add_argument("--from-db", action="store_true", help="use completed batch lines in the database instead")
    train.add_argument("--num-prompts", type=_positive_int, default=96, help="prompts (or database lines) used")
    train.add_argument(
        "--skip-prompts", type=_non_negative_int, default=0, help="skip the first N lines of each prompt file"
    )
    train.add_argument("--max-tokens", type=_positive_int, default=128, help="tokens generated per prompt")
    train.add_argument("--steps", type=_non_negative_int, help="optimizer steps (default 400)")
    train.add_argument("--batch-size", type=_positive_int, help="sequences per step (default 4)")
    train.add_argument("--lr", type=positive_float, help="peak AdamW learning rate (default 1e-3)")
    train.add_argument("--medusa-heads", type=_positive_int, help="Medusa heads (default 3)")
    train.add_argument(
        "--ce-weight", type=non_negative_float, help="EAGLE: weight of the token cross-entropy (default 0.1)"
    )
    train.add_argument(
        "--training-time-test",
        action="store_true",
        default=None,
        help="EAGLE: a second pass over the head's own predicted features, as drafts at depth 2 see them",
    )
    train.add_argument(
        "--draft-vocab-size", type=_non_negative_int, help="tokens of the draft vocabulary (default 8192; 0: all)"
    )
    train.add_argument(
        "--snapshot-at",
        type=_positive_int,
        action="append",
        help="also keep the head as it is after this step in <out>/step-<N> (repeatable)",
    )
    train.add_argument("--out", type=Path, help="the heads' folder (default <model>/heads/<method>)")
    train.set_defaults(handler=_train)


def _number(text: str) -> float:
    """``text`` as a finite float (argparse's error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """``text`` as a finite float above 0 (argparse's error otherwise)."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """``text`` as a finite float of 0 or more (argparse's error otherwise)."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def prompt_texts(files: list[Path], tokenizer: Any, *, skip: int, limit: int) -> list[list[int]]:
    """Prompt token ids from batch-input lines, round-robin over ``files`` (each after its first ``skip`` lines),
    at most ``limit``: a ``/v1/completions`` line's ``prompt``, a chat line's ``messages`` under the chat template.

    Raises:
        SystemExit: a file that cannot be read, or a line that is neither kind.
    """
    per_file: list[list[list[int]]] = []
    for path in files:
        try:
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            raise SystemExit(f"batchinfer heads train: cannot read {path}: {exc}") from None
        prompts = []
        for number, line in enumerate(lines[skip:], start=skip + 1):
            prompt = body_prompt_ids(line.get("body") or {}, tokenizer)
            if prompt is None:
                raise SystemExit(f"batchinfer heads train: {path} line {number}: no prompt or messages")
            prompts.append(prompt)
        per_file.append(prompts)
    merged = [p for group in zip_longest(*per_file) for p in group if p is not None]
    return merged[:limit]


def body_prompt_ids(body: dict[str, Any], tokenizer: Any) -> list[int] | None:
    """The prompt ids of a completions or chat request body, or None when it has neither."""
    if isinstance(body.get("prompt"), str):
        ids: list[int] = tokenizer(body["prompt"])["input_ids"]
        return ids
    if isinstance(body.get("messages"), list):
        text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        chat_ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return chat_ids
    return None


def generate_sequences(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Prompt + the model's greedy completion (our engine, stopping at EOS), per prompt.

    All prompts run as one batch: the KV cache is sized (:func:`kv_budget_bytes`) so every line fits at once and
    none is preempted. On 2 CPU cores one batch of 248 lines made 49.6 tokens per CPU-second, 16 lines 9.4
    (docs/engine.md, "What 30 minutes allow").
    """
    from worker.engine import EngineConfig, LLMEngine, SamplingParams

    lengths = [len(prompt) + max_tokens for prompt in prompts]
    block_size = EngineConfig(model=str(model_dir)).block_size
    config = EngineConfig(
        model=str(model_dir),
        kv_cache_memory_bytes=kv_budget_bytes(model_dir, lengths, block_size),
        max_model_len=max(lengths),
        max_num_seqs=max(len(prompts), 1),
    )
    engine = LLMEngine(config)
    requests: list[str | list[int]] = list(prompts)
    outputs = engine.generate(requests, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [prompt + list(out.outputs[0].token_ids) for prompt, out in zip(prompts, outputs, strict=True)]


def kv_budget_bytes(model_dir: Path, lengths: list[int], block_size: int) -> int:
    """Bytes of float32 KV cache that hold sequences of ``lengths`` tokens all at once (whole ``block_size``
    blocks each, plus one block per sequence of slack), for the model in ``model_dir``."""
    import torch
    from transformers import AutoConfig

    from worker.engine.executor.model_runner import kv_cache_bytes_per_block
    from worker.engine.executor.models.llama import head_size_of, num_kv_heads_of

    config = AutoConfig.from_pretrained(model_dir)
    per_block = kv_cache_bytes_per_block(
        int(config.num_hidden_layers), block_size, num_kv_heads_of(config), head_size_of(config), torch.float32
    )
    return per_block * sum(-(-length // block_size) + 1 for length in lengths)


def database_sequences(model: str, tokenizer: Any, limit: int) -> list[list[int]]:
    """Prompt + completion ids of up to ``limit`` completed lines for ``model`` in the service's database.

    Raises:
        SystemExit: a database that cannot be read (unreachable, or without the service's tables).
    """
    from sqlalchemy.exc import SQLAlchemyError

    from jobs.db import session_scope
    from jobs.repository import completed_lines

    sequences = []
    try:
        with session_scope() as session:
            for body, completion in completed_lines(session, model=model, limit=limit):
                prompt = body_prompt_ids(body, tokenizer)
                if prompt is not None and completion:
                    sequences.append(prompt + tokenizer(completion, add_special_tokens=False)["input_ids"])
    except SQLAlchemyError as exc:  # no such database, or one never upgraded (no tables)
        raise SystemExit(
            f"batchinfer heads train: --from-db cannot read the database ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}); is BATCHINFER_DATABASE_URL right, and was `batchinfer db upgrade` run?"
        ) from None
    return sequences


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its finished children, in seconds: what a phase costs on a
    shared machine, where wall time depends on the other jobs."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _report(phase: str, start: float, detail: str) -> None:
    print(f"batchinfer heads train: {phase}: {detail} in {cpu_seconds() - start:.1f} CPU-s", file=sys.stderr)


class _Progress:
    """A tqdm bar when tqdm is installed, else one line rewritten in place; both show the CPU-seconds spent."""

    def __init__(self, total: int, initial: int, label: str) -> None:
        self.total, self.label, self.start = total, label, cpu_seconds()
        try:
            from tqdm import tqdm  # type: ignore[import-untyped]
        except ImportError:
            self.bar: Any = None
        else:
            self.bar = tqdm(total=total, initial=initial, desc=label, unit="step")

    def __call__(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)  # a resumed run's first step is its checkpoint's + 1
            self.bar.set_postfix(loss=f"{loss:.4f}", cpu_s=f"{cpu_seconds() - self.start:.0f}")
        else:
            print(
                f"\r{self.label}: step {step}/{self.total} loss {loss:.4f} {cpu_seconds() - self.start:.0f} CPU-s",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr)


def _train(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from worker.engine.executor.model_loader import load_model
    from worker.engine.spec_decode.heads.storage import default_heads_dir
    from worker.engine.spec_decode.heads.train import TrainConfig, target_features, target_weights, train_heads
    from worker.model_prepare import ModelNotFoundError, prepare_model

    try:
        model_dir = prepare_model(args.model)
    except ModelNotFoundError as exc:
        raise SystemExit(f"batchinfer heads train: {exc}") from None
    out_dir = args.out or default_heads_dir(model_dir, args.method)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data_path = out_dir / DATA_FILE
    if data_path.is_file():
        sequences = torch.load(data_path)
        print(f"batchinfer heads train: {len(sequences)} cached sequences from {data_path}", file=sys.stderr)
    else:
        if args.from_db:
            sequences = database_sequences(args.model, tokenizer, args.num_prompts)
        else:
            files = args.prompts or list(DEFAULT_PROMPT_FILES)
            prompts = prompt_texts(files, tokenizer, skip=args.skip_prompts, limit=args.num_prompts)
            print(f"batchinfer heads train: generating {len(prompts)} completions", file=sys.stderr)
            start = cpu_seconds()
            sequences = generate_sequences(model_dir, prompts, args.max_tokens)
            generated = sum(len(seq) - len(prompt) for seq, prompt in zip(sequences, prompts, strict=True))
            _report("generation", start, f"{generated} tokens of {len(prompts)} completions")
        if not sequences:
            raise SystemExit("batchinfer heads train: no training text (no prompts, or no completed lines)")
        torch.save(sequences, data_path)
    start = cpu_seconds()
    model = load_model(model_dir, torch.float32, "cpu")
    data = target_features(model, sequences)
    _report("feature pass", start, f"{sum(len(seq) for seq in sequences)} tokens of {len(sequences)} sequences")
    embed, lm_head = target_weights(model_dir, model)
    given = {
        "num_steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "num_medusa_heads": args.medusa_heads,
        "ce_weight": args.ce_weight,
        "training_time_test": args.training_time_test,
        "draft_vocab_size": args.draft_vocab_size,
        "snapshot_steps": tuple(args.snapshot_at) if args.snapshot_at else None,
    }
    config = TrainConfig(method=args.method, **{name: value for name, value in given.items() if value is not None})
    progress = _Progress(config.num_steps, 0, f"{args.method} heads")
    try:
        result = train_heads(
            data,
            target_config=model.config,
            embed_weight=embed,
            lm_head_weight=lm_head,
            out_dir=out_dir,
            config=config,
            on_step=progress,
        )
    except ValueError as exc:  # a saved state of the other method in --out
        raise SystemExit(f"batchinfer heads train: {exc}") from None
    progress.close()
    if result.losses:
        _report(
            "training",
            progress.start,
            f"steps {result.first_step + 1}-{result.first_step + len(result.losses)}, "
            f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f},",
        )
    print(result.folder)
    return 0
