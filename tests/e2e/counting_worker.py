"""``batchinfer worker`` whose engine writes down every line it finishes: the tests count engine runs per line.

Run as ``python -m tests.e2e.counting_worker``. Environment (besides the usual ``BATCHINFER_*``):

- ``BATCHINFER_TEST_RUN_LOG``: a folder; this process appends ``<unix time> <request id>`` to
  ``<pid>.log`` there for each line the engine finishes (aborted lines are not finished).
- ``BATCHINFER_TEST_ENGINE``: ``real`` (default: the served model, as ``batchinfer worker``) or
  ``stand_in`` (`tests.helpers.stand_in_engine.StandInEngine`, each step sleeping
  ``BATCHINFER_TEST_STEP_S`` seconds with at most ``BATCHINFER_TEST_MAX_NUM_SEQS`` lines running:
  steps of a known length, so a test can stop the worker mid-shard).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _stand_in_engine() -> Any:
    from transformers import AutoTokenizer

    from jobs.config import BUILTIN_MODEL
    from tests.helpers.stand_in_engine import StandInEngine
    from worker.model_prepare import prepare_model

    step_s = float(os.environ.get("BATCHINFER_TEST_STEP_S", "0.05"))
    engine = StandInEngine(
        AutoTokenizer.from_pretrained(prepare_model(BUILTIN_MODEL)),
        max_model_len=256,
        max_num_seqs=int(os.environ.get("BATCHINFER_TEST_MAX_NUM_SEQS", "4")),
        on_step=lambda _step: time.sleep(step_s),
    )
    engine.config = SimpleNamespace(device="cpu")
    return engine


def main() -> int:
    from worker import bootstrap, cli

    engine = _stand_in_engine() if os.environ.get("BATCHINFER_TEST_ENGINE") == "stand_in" else bootstrap.get_engine()
    log_path = Path(os.environ["BATCHINFER_TEST_RUN_LOG"]) / f"{os.getpid()}.log"
    step = engine.step

    def counted_step() -> Any:
        outputs = step()
        finished = [o.request_id for o in outputs if o.finished and o.outputs[0].finish_reason != "abort"]
        if finished:
            with log_path.open("a") as log:
                log.write("".join(f"{time.time():.3f} {request_id}\n" for request_id in finished))
        return outputs

    engine.step = counted_step
    bootstrap.get_engine = lambda: engine
    return cli.main(["worker", "--loglevel", "INFO"])


if __name__ == "__main__":
    sys.exit(main())
