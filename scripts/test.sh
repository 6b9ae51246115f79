#!/usr/bin/env bash
# Run the whole test suite (slow end-to-end tests included, GPU tests excluded).
# Needs PostgreSQL and Redis: by default on 127.0.0.1:5432 (trust auth) and 127.0.0.1:6379.
# Point the tests elsewhere with BATCHINFER_TEST_POSTGRES_URL / BATCHINFER_TEST_REDIS_URL.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
# shellcheck disable=SC1091
. .venv/bin/activate

default_url() {
    case $1 in
        postgres) echo "postgresql+psycopg://root@127.0.0.1:5432/postgres" ;;
        redis) echo "redis://127.0.0.1:6379/0" ;;
    esac
}
export BATCHINFER_TEST_POSTGRES_URL=${BATCHINFER_TEST_POSTGRES_URL:-$(default_url postgres)}
export BATCHINFER_TEST_REDIS_URL=${BATCHINFER_TEST_REDIS_URL:-$(default_url redis)}

# reachable URL -> exit 0 (TCP connect to the URL's host and port)
reachable() {
    python - "$1" "$2" <<'PY'
import socket, sys
from urllib.parse import urlsplit
url, default_port = urlsplit(sys.argv[1]), int(sys.argv[2])
try:
    socket.create_connection((url.hostname or "127.0.0.1", url.port or default_port), timeout=2).close()
except OSError:
    sys.exit(1)
PY
}

ensure() {  # name url default_port start-command...
    local name=$1 url=$2 port=$3
    shift 3
    reachable "$url" "$port" && return 0
    # Only the local default servers are ours to start.
    if [ "$url" = "$(default_url "$name")" ] && command -v "$1" >/dev/null 2>&1; then
        echo "test: $name is not reachable at $url; starting it: $*"
        "$@" >/dev/null 2>&1 || true
        for _ in $(seq 1 20); do
            reachable "$url" "$port" && return 0
            sleep 0.5
        done
    fi
    echo "test: $name is not reachable at $url." >&2
    echo "      Start one there, or point the tests at yours with BATCHINFER_TEST_${name^^}_URL=..." >&2
    echo "      (or skip the service tests: ./scripts/test.sh -m 'not postgres and not redis')." >&2
    return 1
}

need_services=1
for arg in "$@"; do
    case $arg in *"not postgres and not redis"*) need_services=0 ;; esac
done
if [ "$need_services" = 1 ]; then
    ensure postgres "$BATCHINFER_TEST_POSTGRES_URL" 5432 \
        pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql 2>/dev/null | head -n1)" main start
    ensure redis "$BATCHINFER_TEST_REDIS_URL" 6379 \
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi

# The jobs page's browser test (tests/e2e/test_ui_browser.py) drives the system Chromium through
# Playwright (whose own browser download is not used); without it that test is skipped.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test: installing chromium (apt-get) for the browser test"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null; then
            echo "test: chromium did not install; the browser test will be skipped" >&2
        fi
    else
        echo "test: chromium is missing (install it as root: apt-get install chromium); the browser test will be skipped" >&2
    fi
fi

exec python -m pytest -q -m "not gpu" "$@"
