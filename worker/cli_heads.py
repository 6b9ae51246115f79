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
import sys
import time
from itertools import zip_longest
from pathlib import Path
from typing import Any

from jobs.config import Settings

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
DEFAULT_PROMPT_FILES = (EXAMPLES_DIR / "humaneval.jsonl", EXAMPLES_DIR / "chat.jsonl")
DATA_FILE = "train_data.pt"


def add_heads_commands(commands: Any, settings: Settings) -> None:
    """Add ``heads train`` to the ``batchinfer`` sub-command parsers ``commands``."""
    from worker.cli import _positive_int

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
    train.add_argument("--skip-prompts", type=int, default=0, help="skip the first N lines of each prompt file")
    train.add_argument("--max-tokens", type=_positive_int, default=128, help="tokens generated per prompt")
    train.add_argument("--steps", type=int, help="optimizer steps (default 400)")
    train.add_argument("--batch-size", type=_positive_int, help="sequences per step (default 4)")
    train.add_argument("--lr", type=float, help="peak AdamW learning rate (default 1e-3)")
    train.add_argument("--medusa-heads", type=_positive_int, help="Medusa heads (default 3)")
    train.add_argument("--ce-weight", type=float, help="EAGLE: weight of the token cross-entropy (default 0.1)")
    train.add_argument(
        "--training-time-test",
        action="store_true",
        default=None,
        help="EAGLE: a second pass over the head's own predicted features, as drafts at depth 2 see them",
    )
    train.add_argument("--out", type=Path, help="the heads' folder (default <model>/heads/<method>)")
    train.set_defaults(handler=_train)


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
    """Prompt + the model's greedy completion (our engine, stopping at EOS), per prompt."""
    from worker.engine import EngineConfig, LLMEngine, SamplingParams

    max_model_len = max(len(prompt) for prompt in prompts) + max_tokens
    # NOTE: 1 GiB holds ~22k SmolLM2 tokens (~80 lines of 128 + 150 at once); 256 MiB held ~20 and preempted the rest
    # over and over. Pages are touched only as blocks fill.
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_bytes=1 << 30, max_model_len=max_model_len))
    requests: list[str | list[int]] = list(prompts)
    outputs = engine.generate(requests, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [prompt + list(out.outputs[0].token_ids) for prompt, out in zip(prompts, outputs, strict=True)]


def database_sequences(model: str, tokenizer: Any, limit: int) -> list[list[int]]:
    """Prompt + completion ids of up to ``limit`` completed lines for ``model`` in the service's database."""
    from jobs.db import session_scope
    from jobs.repository import completed_lines

    sequences = []
    with session_scope() as session:
        for body, completion in completed_lines(session, model=model, limit=limit):
            prompt = body_prompt_ids(body, tokenizer)
            if prompt is not None and completion:
                sequences.append(prompt + tokenizer(completion, add_special_tokens=False)["input_ids"])
    return sequences


class _Progress:
    """A tqdm bar when tqdm is installed, else one line rewritten in place."""

    def __init__(self, total: int, initial: int, label: str) -> None:
        self.total, self.label, self.start = total, label, time.perf_counter()
        try:
            from tqdm import tqdm  # type: ignore[import-untyped]
        except ImportError:
            self.bar: Any = None
        else:
            self.bar = tqdm(total=total, initial=initial, desc=label, unit="step")

    def __call__(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")
        else:
            print(f"\r{self.label}: step {step}/{self.total} loss {loss:.4f}", end="", file=sys.stderr, flush=True)

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
    from worker.model_prepare import prepare_model

    model_dir = prepare_model(args.model)
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
            sequences = generate_sequences(model_dir, prompts, args.max_tokens)
        if not sequences:
            raise SystemExit("batchinfer heads train: no training text (no prompts, or no completed lines)")
        torch.save(sequences, data_path)
    model = load_model(model_dir, torch.float32, "cpu")
    data = target_features(model, sequences)
    embed, lm_head = target_weights(model_dir, model)
    given = {
        "num_steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "num_medusa_heads": args.medusa_heads,
        "ce_weight": args.ce_weight,
        "training_time_test": args.training_time_test,
    }
    config = TrainConfig(method=args.method, **{name: value for name, value in given.items() if value is not None})
    progress = _Progress(config.num_steps, 0, f"{args.method} heads")
    result = train_heads(
        data,
        target_config=model.config,
        embed_weight=embed,
        lm_head_weight=lm_head,
        out_dir=out_dir,
        config=config,
        on_step=progress,
    )
    progress.close()
    if result.losses:
        print(f"batchinfer heads train: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}", file=sys.stderr)
    print(result.folder)
    return 0
