"""API test fixtures: a TestClient over the app on SQLite and on PostgreSQL (see tests/helpers/service.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from jobs.config import Settings
from tests.helpers.service import api_client, postgres_url, service_settings  # noqa: F401


@pytest.fixture
def client(service_settings: Settings) -> Iterator[Any]:
    """`TestClient` for ``create_app(service_settings)``; background validation runs before responses return."""
    with api_client(service_settings) as test_client:
        yield test_client
