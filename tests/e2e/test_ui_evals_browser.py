"""The evals page in a real headless Chromium (Playwright): a scheduled eval fired twice shows its trend
with two points; its run page lists the failing item. Screenshots land in the test's tmp_path.

No engine: the runs grade samples given with the items (a ``jsonl`` data source), graded in this process
as a worker would (tests/api/test_ui_evals.py). Chromium comes from the system; without it the test skips.
"""

from __future__ import annotations

from typing import Any

import pytest

from jobs.config import Settings
from tests.api.test_ui_evals import scheduled_eval_fired_twice
from tests.e2e.test_ui_browser import browser  # noqa: F401  (fixture)
from tests.helpers.service import api_client, serve_http, service_settings  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("service_settings", ["sqlite"], indirect=True)
def test_a_scheduled_eval_fired_twice_shows_a_two_point_trend(
    browser: Any,
    service_settings: Settings,
    tmp_path: Any,
) -> None:
    with api_client(service_settings) as client:
        eval_id, run_ids = scheduled_eval_fired_twice(client, service_settings)
    with serve_http(service_settings) as base_url:
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        console_errors: list[str] = []

        def on_console(message: Any) -> None:
            if message.type == "error":
                console_errors.append(message.text)

        page.on("console", on_console)
        page.goto(f"{base_url}/ui/evals")
        trend = page.locator(f"#eval-{eval_id} svg.trend")
        trend.wait_for()
        assert trend.locator("circle.point").count() == 2
        assert trend.locator("circle.point").first.is_visible()
        page.screenshot(path=str(tmp_path / "evals.png"), full_page=True)

        page.click(f"a[href$='/runs/{run_ids[1]}']")
        page.locator("#failing").wait_for()
        assert "Paris" in page.locator("#failing").inner_text()
        page.screenshot(path=str(tmp_path / "eval_run.png"), full_page=True)
        assert console_errors == []
