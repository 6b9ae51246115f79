"""The jobs page in a real headless Chromium (Playwright), against the real API and worker on SmolLM2.

Submit a job through the API, open ``/ui``: the batch appears, its progress bar moves and reaches
completed (the page refreshes itself); open its page (plot, counts), follow the output file link.
A screenshot of each page lands in the test's tmp_path; no page logs a console error.
Chromium comes from the system (``apt-get install chromium``, scripts/setup.sh); without it the test skips.
"""

from __future__ import annotations

import shutil
import time

import pytest

from jobs.config import BUILTIN_MODEL
from tests.e2e.processes import child_env, cli, free_port, running, wait_for_health
from tests.e2e.served.test_service_e2e import _jsonl
from tests.helpers.service import postgres_url  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NUM_LINES = 16


@pytest.fixture
def browser():
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium; scripts/setup.sh does it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def test_jobs_page_follows_a_job_to_its_output(browser, tmp_path, postgres_url, redis_url):
    from openai import OpenAI

    port = free_port()
    env = child_env(
        data_dir=str(tmp_path / "data"),
        database_url=postgres_url,
        broker_url=redis_url,
        worker_heartbeat_s="1",
        max_num_seqs="4",
    )
    api_log, worker_log = tmp_path / "api.log", tmp_path / "worker.log"
    with (
        running(cli("api", "--host", "127.0.0.1", "--port", str(port)), env, api_log) as api,
        running(cli("worker"), env, worker_log),
    ):
        base_url = f"http://127.0.0.1:{port}"
        wait_for_health(base_url, api, api_log)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        console_errors: list[str] = []
        page.on("console", lambda message: message.type == "error" and console_errors.append(message.text))
        page.on("pageerror", lambda error: console_errors.append(str(error)))

        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        lines = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": BUILTIN_MODEL,
                    "messages": [{"role": "user", "content": f"Write a haiku about the number {i}."}],
                    "max_tokens": 24,
                    "temperature": 0,
                },
            }
            for i in range(NUM_LINES)
        ]
        lines.append(
            {
                "custom_id": "bad",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": BUILTIN_MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "logit_bias": {"999999": 1},
                },
            }
        )
        input_file = client.files.create(file=("haiku.jsonl", _jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=input_file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        page.goto(f"{base_url}/ui")
        row = page.locator(f'tr[data-batch-id="{batch.id}"]')
        row.wait_for(timeout=30_000)
        done_seen: list[int] = []
        deadline = time.monotonic() + 600
        while True:  # no reloads here: the page's own refresh must move the bar
            assert time.monotonic() < deadline, (api_log.read_text()[-3000:], worker_log.read_text()[-3000:])
            row = page.locator(f'tr[data-batch-id="{batch.id}"]')
            done = int(row.locator(".bar").get_attribute("aria-valuenow"))
            if not done_seen or done != done_seen[-1]:
                done_seen.append(done)
                if 0 < done < NUM_LINES and not (tmp_path / "ui-index-running.png").exists():
                    page.screenshot(path=tmp_path / "ui-index-running.png", full_page=True)
            if row.get_attribute("data-status") == "completed":
                break
            time.sleep(0.3)
        assert done_seen[-1] == NUM_LINES + 1
        assert len(done_seen) >= 3, f"the bar did not move while the batch ran: {done_seen}"
        assert row.locator(".counts").inner_text() == f"{NUM_LINES}/1/{NUM_LINES + 1}"
        page.screenshot(path=tmp_path / "ui-index-completed.png", full_page=True)

        row.locator(f'a:text("{batch.id}")').click()
        page.wait_for_url(f"**/ui/batches/{batch.id}")
        assert page.locator("#status").inner_text() == "completed"
        assert page.locator("#counts").inner_text() == f"total {NUM_LINES + 1}, completed {NUM_LINES}, failed 1"
        assert page.locator("svg polyline.lines").count() == 1
        assert "logit_bias" in page.locator("#errors").inner_text()
        page.screenshot(path=tmp_path / "ui-batch.png", full_page=True)

        page.locator("#output-file").click()
        page.wait_for_url("**/ui/files/*")
        content = page.locator("#content").inner_text()
        assert content.count('"custom_id"') == NUM_LINES and '"line-0"' in content
        page.screenshot(path=tmp_path / "ui-output-file.png", full_page=True)
        raw = page.request.get(base_url + page.locator("#raw").get_attribute("href"))
        assert raw.ok and raw.text().count("\n") == NUM_LINES

        page.goto(f"{base_url}/ui")  # the worker table shows this worker
        assert page.locator("#workers").count() == 1
        page.screenshot(path=tmp_path / "ui-index-workers.png", full_page=True)

    assert console_errors == []
    for name in ("ui-index-running", "ui-index-completed", "ui-batch", "ui-output-file", "ui-index-workers"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
