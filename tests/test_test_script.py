"""``scripts/test.sh`` on a machine without PostgreSQL or Redis where the tests look for them: it starts
both from pip packages in a temporary folder, runs the service tests against them, then stops them
(docs/testing.md, "Running the tests")."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.processes import free_port

ROOT = Path(__file__).resolve().parents[1]


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_test_script_starts_and_stops_its_own_servers(tmp_path: Path) -> None:
    pg_port, redis_port = free_port(), free_port()
    service_dirs = (
        "/tmp/batchinfer-test-services.*" if os.getuid() == 0 else str(tmp_path / "batchinfer-test-services.*")
    )
    before = set(glob.glob(service_dirs))
    assert not _answers(pg_port) and not _answers(redis_port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHINFER_")}
    env.update(
        BATCHINFER_TEST_POSTGRES_URL=f"postgresql+psycopg://root@127.0.0.1:{pg_port}/postgres",
        BATCHINFER_TEST_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        BATCHINFER_TEST_SETUP="0",
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        PYTHONPATH=str(ROOT),
        TMPDIR=str(tmp_path),
    )
    result = subprocess.run(
        [
            "./scripts/test.sh",
            "tests/jobs/test_storage.py",
            "tests/jobs/test_queue.py",
            "-k",
            "postgres or redis",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"starting one on port {pg_port}" in output and f"starting one on port {redis_port}" in output
    assert " passed" in output and "skipped" not in output, output
    assert not _answers(pg_port) and not _answers(redis_port)
    assert set(glob.glob(service_dirs)) <= before
