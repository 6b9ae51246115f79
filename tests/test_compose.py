"""Static checks of compose.yaml (no Docker engine runs here): services, healthchecks, GPU, ordering."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
APP_SERVICES = ("migrate", "api", "worker", "beat")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_present(compose):
    assert set(compose["services"]) == {"postgres", "redis", "migrate", "api", "worker", "beat"}


def test_long_running_services_have_healthchecks(compose):
    for name in ("postgres", "redis", "api", "worker", "beat"):
        check = compose["services"][name].get("healthcheck")
        assert check and check["test"], f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL")
    assert "pg_isready" in " ".join(compose["services"]["postgres"]["healthcheck"]["test"])
    assert "/health" in " ".join(compose["services"]["api"]["healthcheck"]["test"])


def test_worker_reserves_an_nvidia_gpu(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d.get("count", 0) >= 1 for d in devices)
    for name in ("api", "beat", "migrate"):
        assert "deploy" not in compose["services"][name], f"{name} should not hold a GPU"


def test_startup_order_waits_for_health_and_migrations(compose):
    services = compose["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    for name in ("api", "worker", "beat"):
        depends = services[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["redis"]["condition"] == "service_healthy"


def test_app_services_share_settings_image_and_volumes(compose):
    services = compose["services"]
    for name in APP_SERVICES:
        service = services[name]
        env = service["environment"]
        assert env["BATCHINFER_DATABASE_URL"].startswith("postgresql")
        assert "@postgres:5432/" in env["BATCHINFER_DATABASE_URL"]
        assert env["BATCHINFER_BROKER_URL"] == "redis://redis:6379/0"
        assert service["image"] == "batchinfer:latest"
        assert service["command"][0] == "batchinfer"
    assert "files:/data" in services["api"]["volumes"] and "files:/data" in services["worker"]["volumes"]
    assert any(v.startswith("model-cache:") for v in services["worker"]["volumes"])
    assert {"files", "model-cache", "pgdata"} <= set(compose["volumes"])


def test_commands_are_cli_subcommands(compose):
    from worker.cli import _parser

    parser = _parser()
    for name in APP_SERVICES:
        command = compose["services"][name]["command"][1:]
        args = parser.parse_args(command)
        assert callable(args.handler)
