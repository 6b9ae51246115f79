"""One measured embedding run for bench/embed.py, in a fresh process: ``batchinfer`` or ``st`` (sentence-transformers).

Usage: python bench/embed_peer.py {batchinfer,st} TEXTS_JSON MODEL_DIR OUT_NPY [--threads 2]
       [--matmul-dtype float32]
``--matmul-dtype bfloat16``: our engine's opt-in bfloat16 linears (`EmbeddingEngineConfig.matmul_dtype`).
Embeds the texts (tokenization included in the time), writes the float32 embeddings to OUT_NPY and prints one
JSON line: ``texts_per_s``, ``elapsed_s`` and, for batchinfer, the machine's measured float32 peak
(``peak_gflops``, bench/arithmetic.py) taken right after the run, in the same process and threads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402

ST_BATCH_SIZE = 32  # sentence-transformers' default


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=["batchinfer", "st"])
    parser.add_argument("texts", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--matmul-dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    texts: list[str] = json.loads(args.texts.read_text())
    result: dict[str, float] = {}
    if args.system == "batchinfer":
        from arithmetic import calibrate_peak

        from worker.engine.pooling_engine import build_embedding_engine

        engine = build_embedding_engine(args.model_dir, matmul_dtype=args.matmul_dtype)
        engine.embed([engine.tokenize(text) for text in texts[:64]])  # warm-up: first-touch, thread pools
        start = time.perf_counter()
        token_ids = engine.tokenizer(texts, truncation=True, max_length=engine.max_model_len)["input_ids"]
        embeddings = engine.embed(token_ids).numpy()
        elapsed = time.perf_counter() - start
        result["peak_gflops"] = calibrate_peak(1024, 5)["peak_gflops"]
    else:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(args.model_dir), device="cpu")
        model.encode(texts[:64], batch_size=ST_BATCH_SIZE)
        start = time.perf_counter()
        embeddings = model.encode(texts, batch_size=ST_BATCH_SIZE, convert_to_numpy=True)
        elapsed = time.perf_counter() - start
    np.save(args.out, embeddings.astype(np.float32))
    print(json.dumps({"texts_per_s": len(texts) / elapsed, "elapsed_s": elapsed, **result}))


if __name__ == "__main__":
    main()
