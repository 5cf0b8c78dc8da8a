#!/usr/bin/env bash
# The container lab: runs the project's own compose clusters (docker/one-geo.yaml,
# docker/two-geo.yaml) for real with podman on this machine, each geo on a network of its own,
# traffic between geos routed through the host and delayed there (tc netem, or a netfilter queue
# where the kernel has no netem), bots playing in one geo or both, and a JSON summary of what
# happened. Everything it starts is taken
# down at the end, whatever the end (success, failure, Ctrl-C, TERM), unless --keep.
#
#   scripts/lab.sh                                   # two geos, 60 s, 45 ms one way, 20 bots in eu
#   scripts/lab.sh --geos 1 --duration 30 --bots 50
#   scripts/lab.sh --geos 2 --delay-ms 80 --bots-geo both --summary-json lab.json
#   scripts/lab.sh --prepare                         # install and build what is missing, then stop
#   scripts/lab.sh --geos 2 --faults kill-node,kill-gateway,pause-mongo,restart-redis,partition-geo,kill-proxy \
#       --duration 240 --summary-json faults.json    # faults one after another
#
# Needs root and a Debian 12 host. No image registry is needed: the base images are made from the
# Debian archive (mmdebstrap), the project image from docker/Dockerfile with those as its bases,
# Redis from Debian's redis-server, and the MongoDB-wire server is secantusdb from PyPI
# (docker/lab/*.Containerfile). What is missing on the host (podman and its helpers, mmdebstrap,
# iproute2, iptables, libnetfilter-queue1) is installed with apt; podman-compose (pinned) goes
# into .venv-lab. docker/lab/README.md tells the rest.
# Images are built only when missing or when their recipe changed (a stamp label on each).
#
# The summary (--summary-json) holds: the census keys of `cellmesh up`'s summary (inputs sent and
# delivered, entities lost and duplicated, avatars, sessions dropped, restore p99, errors), read
# from the processes' admin endpoints and the bots' totals by docker/lab/census.py; containers,
# geos, image_bytes, the inter-geo RTT, the proxies' handovers and bridged sessions, the
# containers that exited or restarted unasked (processes_exited_unplanned), and faults (each a
# function fault_<name>: what it did, when the world was whole again, what it cost). The run
# exits 1 if a fault did not recover or broke what must hold.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)

# ------------------------------------------------------------------------------------------------
# Options

geos=2
duration_s=60
delay_ms=45
bots=20
bots_geo=eu
travellers=5
bubbles=0
summary_json=""
keep=0
prepare_only=0
reuse_image=0

usage() {
    cat <<'USAGE'
usage: scripts/lab.sh [--geos 1|2] [--duration SECS] [--delay-ms MS] [--bots N]
                      [--bots-geo eu|us|both] [--travellers N] [--summary-json FILE] [--keep]
                      [--reuse-image] [--prepare]

  --geos N           1: docker/one-geo.yaml; 2: docker/two-geo.yaml (default 2)
  --duration SECS    how long the bots play once the cluster is ready (default 60)
  --delay-ms MS      one-way latency between the geos, added by the kernel (default 45)
  --bots N           bots per chosen geo (default 20; 0: none)
  --bots-geo G       the geo the bots play in: eu, us or both (default eu; one geo: its only one).
                     Each geo's bots have accounts of their own (eu-bot-0..., us-bot-0...)
  --travellers N     two geos: bots in us that log in at eu's proxy, for the handover policy
                     (default 5; 0: none). Accounts traveller-0...
  --bubbles          two geos: geo-aware directors, and us's bots gathering in eu's regions
                     (docker/lab/bubbles.yaml; give --bots-geo us): the summary's `bubbles`
                     has the moves and the bots' click to screen before and after the first
  --summary-json F   write the run's summary there
  --keep             leave the cluster running at the end (take it down with a later run's
                     teardown: scripts/lab.sh --down)
  --down             take down whatever a kept lab left, and exit
  --reuse-image      use the project image cellmesh:dev as it is, even if the sources changed
  --prepare          install and build what is missing, then exit
  --faults A,B,...   faults spread over --duration one after another, each given time to
                     recover before the next: kill-node, kill-gateway, pause-mongo, restart-redis,
                     partition-geo, kill-geo, kill-proxy; an argument after a colon (kill-node:eu,
                     pause-mongo:20, partition-geo:30); the run lasts until the last recovered
  --fault NAME[:ARG]@SECS
                     the fault NAME SECS seconds after the bots start (repeatable)
  --recovery-bound S how long a fault may take to recover before it counts as never (default 60)

Faults (docker/lab/README.md tells what each does and what must hold):
  kill-node[:GEO]    podman kill a node that is no gateway (sidecar and game; default geo: the
                     second), wait for its world restored from the geo's checkpoints, restart it
  kill-gateway[:GEO] the same for the gateway of the most bot sessions
  pause-mongo[:SECS] podman pause MongoDB for SECS (default 15, at least 15), then unpause
  restart-redis[:GEO] podman restart a geo's Redis (default: the bots' geo)
  partition-geo[:SECS] drop everything between the geos' subnets for SECS (default 20), then heal
  kill-geo[:SECS]    two geos: podman kill every node of us at once (its datacenter gone dark),
                     wait for the core (eu) to restore its world, start them again after SECS
                     (default 40)
  kill-proxy[:GEO]   podman kill the bots' geo's proxy, start it again
USAGE
}

down_only=0
faults=()        # NAME[:ARG]@SECS, as asked by --fault
faults_spread="" # A,B,..., as asked by --faults
recovery_bound_s=60
while (($#)); do
    case $1 in
    --geos) geos=${2:?}; shift 2 ;;
    --duration) duration_s=${2:?}; shift 2 ;;
    --delay-ms) delay_ms=${2:?}; shift 2 ;;
    --bots) bots=${2:?}; shift 2 ;;
    --bots-geo) bots_geo=${2:?}; shift 2 ;;
    --travellers) travellers=${2:?}; shift 2 ;;
    --bubbles) bubbles=1; shift ;;
    --summary-json) summary_json=${2:?}; shift 2 ;;
    --keep) keep=1; shift ;;
    --down) down_only=1; shift ;;
    --reuse-image) reuse_image=1; shift ;;
    --prepare) prepare_only=1; shift ;;
    --fault) faults+=("${2:?}"); shift 2 ;;
    --faults) faults_spread=${2:?}; shift 2 ;;
    --recovery-bound) recovery_bound_s=${2:?}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
    esac
done

die() {
    printf 'lab: error: %s\n' "$*" >&2
    exit 2
}
log() { printf '[lab %4ds] %s\n' "$SECONDS" "$*" >&2; }

[[ $geos == 1 || $geos == 2 ]] || die "--geos is 1 or 2"
[[ $duration_s =~ ^[0-9]+$ ]] || die "--duration is a number of seconds"
[[ $delay_ms =~ ^[0-9]+$ ]] || die "--delay-ms is a number of milliseconds"
[[ $bots =~ ^[0-9]+$ ]] || die "--bots is a number"
[[ $travellers =~ ^[0-9]+$ ]] || die "--travellers is a number"
[[ $recovery_bound_s =~ ^[0-9]+$ ]] || die "--recovery-bound is a number of seconds"
case $bots_geo in eu | us | both) ;; *) die "--bots-geo is eu, us or both" ;; esac
((geos == 2)) || bots_geo=eu
((geos == 2 || bubbles == 0)) || die "--bubbles moves regions between two geos: it needs --geos 2"
((geos == 2 && bots > 0)) || travellers=0
[[ $(id -u) == 0 ]] || die "the lab needs root (podman networks, tc, iptables)"

# ------------------------------------------------------------------------------------------------
# The host: packages, podman's configuration, podman-compose

# Debian 12's podman 4.3 with runc (crun fails on a cgroup v1 hybrid host), netavark and
# aardvark-dns (user-defined networks with DNS by service name), buildah for the builds,
# mmdebstrap for the base image, tc (iproute2) and iptables for the routing between geos,
# libnetfilter-queue1 for docker/lab/delay.py (the delay where the kernel has no netem).
host_packages=(podman buildah runc netavark aardvark-dns mmdebstrap iptables iproute2 python3-venv
    libnetfilter-queue1)
podman_compose_version=1.6.0
lab_venv=$repo/.venv-lab

ensure_host_packages() {
    local missing=() pkg
    for pkg in "${host_packages[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' ||
            missing+=("$pkg")
    done
    ((${#missing[@]} == 0)) && return 0
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# runc rather than crun (cgroup v1 hybrid); cgroupfs and a file event log (no systemd as PID 1);
# default ulimits a process without CAP_SYS_RESOURCE may set (podman's defaults raise nofile
# above what such a host allows, and every container start fails).
containers_conf='[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"'

ensure_containers_conf() {
    local conf=/etc/containers/containers.conf
    if [[ ! -f $conf || $(<"$conf") != "$containers_conf" ]]; then
        log "writing $conf"
        mkdir -p /etc/containers
        [[ ! -f $conf ]] || cp "$conf" "$conf.before-lab"
        printf '%s\n' "$containers_conf" >"$conf"
    fi
}

ensure_lab_venv() {
    if [[ ! -x $lab_venv/bin/podman-compose ]] ||
        [[ $("$lab_venv/bin/pip" show podman-compose 2>/dev/null | sed -n 's/^Version: //p') != "$podman_compose_version" ]]; then
        log "installing podman-compose $podman_compose_version into .venv-lab"
        /usr/bin/python3 -m venv "$lab_venv"
        "$lab_venv/bin/pip" install -q "podman-compose==$podman_compose_version"
    fi
}

# ------------------------------------------------------------------------------------------------
# Images, each built only when missing or when its recipe changed: the recipe's hash is kept in
# the image's label cellmesh.lab.recipe.

rootfs_image=cellmesh-lab/debian-rootfs:bookworm
base_image=cellmesh-lab/debian:bookworm
builder_image=cellmesh-lab/builder:latest
redis_image=cellmesh-lab/redis:latest
mongo_image=cellmesh-lab/mongo:latest
project_image=cellmesh:dev
stamp_label=cellmesh.lab.recipe
build_dir=$repo/target/lab     # rootfs tarball, build logs (target/ is ignored by git and builds)

image_stamp() {
    podman image inspect --format "{{index .Labels \"$stamp_label\"}}" "$1" 2>/dev/null || true
}

# Docker's image format, not OCI's: only the former keeps a Containerfile's HEALTHCHECK (podman
# drops it from an OCI image). Part of every image's stamp, so a change rebuilds.
build_flags=(--pull=never --format docker)

# Debian 12 minbase from the archive (mmdebstrap adds the updates and security suites of a
# stable release), imported as an image.
ensure_rootfs_image() {
    local stamp
    stamp=$(printf 'mmdebstrap --variant=minbase bookworm\n' | sha256sum | cut -c1-16)
    [[ $(image_stamp "$rootfs_image") == "$stamp" ]] && return 0
    log "making $rootfs_image from the Debian archive (mmdebstrap, about 1.5 min)"
    mkdir -p "$build_dir"
    mmdebstrap --quiet --variant=minbase bookworm "$build_dir/rootfs.tar" </dev/null
    podman import --quiet --change "LABEL $stamp_label=$stamp" --change 'CMD ["bash"]' \
        "$build_dir/rootfs.tar" "$rootfs_image" >/dev/null
    rm -f "$build_dir/rootfs.tar"
}

# The base of every lab image: the rootfs with the certificate authorities this host adds to its
# trust store (/usr/local/share/ca-certificates). A host whose HTTPS goes through an inspecting
# proxy trusts that proxy's authority there; the builds inside the images (cargo fetching crates,
# pip fetching the MongoDB-wire server) must trust it too. The files take effect in an image that
# installs ca-certificates; elsewhere they are inert.
ensure_base_image() {
    local stamp context
    ensure_rootfs_image
    stamp=$( (image_stamp "$rootfs_image"; echo "${build_flags[*]}"; cat /usr/local/share/ca-certificates/*.crt 2>/dev/null) |
        sha256sum | cut -c1-16)
    [[ $(image_stamp "$base_image") == "$stamp" ]] && return 0
    log "making $base_image"
    context=$(mktemp -d)
    mkdir "$context/ca"
    cp /usr/local/share/ca-certificates/*.crt "$context/ca/" 2>/dev/null || true
    printf 'FROM %s\nCOPY ca/ /usr/local/share/ca-certificates/\n' "$rootfs_image" >"$context/Containerfile"
    podman build --quiet "${build_flags[@]}" --label "$stamp_label=$stamp" -t "$base_image" "$context" >/dev/null
    rm -rf "$context"
}

# ensure_lab_image IMAGE CONTAINERFILE: a docker/lab image on the base image; its stamp covers
# the Containerfile and the base.
ensure_lab_image() {
    local image=$1 file=$2 stamp
    stamp=$( (cat "$file"; echo "${build_flags[*]}"; image_stamp "$base_image") | sha256sum | cut -c1-16)
    [[ $(image_stamp "$image") == "$stamp" ]] && return 0
    log "building $image ($file)"
    mkdir -p "$build_dir"
    podman build "${build_flags[@]}" --label "$stamp_label=$stamp" --build-arg "BASE_IMAGE=$base_image" \
        -f "$file" -t "$image" docker/lab >"$build_dir/$(basename "$file" .Containerfile).log" 2>&1 ||
        die "building $image failed: see $build_dir/$(basename "$file" .Containerfile).log"
}

# The sources the project image is built from: the commit, the changes to tracked files and the
# untracked files, without what the build does not read.
project_sources_stamp() {
    local not_built=(':(exclude)docs' ':(exclude)deploy' ':(exclude)scripts' ':(exclude)*.md'
        ':(exclude)docker/*.yaml' ':(exclude)docker/lab' ':(exclude)docker/grafana'
        ':(exclude)docker/prometheus')
    {
        git ls-files -s -- . "${not_built[@]}"
        git diff HEAD -- . "${not_built[@]}"
        git ls-files -z --others --exclude-standard -- . "${not_built[@]}" | xargs -0r sha256sum
        image_stamp "$builder_image"
        image_stamp "$base_image"
        echo "${build_flags[*]}"
    } | sha256sum | cut -c1-16
}

# cellmesh:dev from docker/Dockerfile with the lab's bases. The cargo registry and the target
# directory are cache mounts (docker/Dockerfile): a rebuild after a source change compiles only
# the workspace's crates.
ensure_project_image() {
    local stamp started
    if ((reuse_image)) && podman image exists "$project_image"; then
        return 0
    fi
    stamp=$(project_sources_stamp)
    [[ $(image_stamp "$project_image") == "$stamp" ]] && return 0
    log "building $project_image from docker/Dockerfile (the first build compiles for a long while)"
    mkdir -p "$build_dir"
    started=$SECONDS
    # The context is a copy whose files are all dated now. Cargo takes a crate in the cached target
    # directory for fresh when its sources are no newer than its last build, and that build may
    # have been made from another tree (another checkout, or these files before an edit that kept
    # an older date): the image would get an old build of a crate, or not compile.
    # .dockerignore (copied too) still decides what the build sees.
    local context
    context=$(mktemp -d)
    tar -C "$repo" --exclude=./.git --exclude=./target --exclude=./.venv --exclude=./.venv-lab \
        --exclude=./.test-services -cf - . | tar -C "$context" --touch -xf -
    podman build "${build_flags[@]}" --label "$stamp_label=$stamp" \
        --build-arg "BUILDER_IMAGE=$builder_image" --build-arg "RUNTIME_IMAGE=$base_image" \
        -f docker/Dockerfile -t "$project_image" "$context" >"$build_dir/project.log" 2>&1 || {
        rm -rf "$context"
        die "building $project_image failed: see $build_dir/project.log"
    }
    rm -rf "$context"
    log "built $project_image in $((SECONDS - started)) s, $(podman image inspect --format '{{.Size}}' "$project_image") bytes"
}

ensure_images() {
    ensure_base_image
    ensure_lab_image "$builder_image" docker/lab/builder.Containerfile
    ensure_project_image
    ensure_lab_image "$redis_image" docker/lab/redis.Containerfile
    ensure_lab_image "$mongo_image" docker/lab/mongo.Containerfile
}

# ------------------------------------------------------------------------------------------------
# The cluster: the project's compose file with the lab's override (docker/lab/<cluster>.yaml)

cluster=$([[ $geos == 1 ]] && echo one-geo || echo two-geo)
project=cellmesh-lab
lab_networks=(cellmesh-lab-eu cellmesh-lab-us)   # named in docker/lab/*.yaml
run_dir=$build_dir/run-$(date +%Y%m%d-%H%M%S)
rule_comment=cellmesh-lab   # marks the lab's iptables rules, so teardown finds exactly those
cut_chain=cellmesh-lab-cut  # partition-geo's chain
# The bots' fixed addresses (docker/lab/two-geo.yaml): players, whose paths a cut between the
# datacenters leaves alone.
lab_clients=(10.231.1.50 10.231.2.50 10.231.2.51)

lab_compose() {
    # shellcheck disable=SC2046 # the files are words
    "$lab_venv/bin/podman-compose" --project-name "$project" $(compose_files) "$@"
}

# The compose files of the run, as podman-compose's -f arguments: the cluster's, the lab's
# changes to it, and with --bubbles docker/lab/bubbles.yaml.
compose_files() {
    printf -- '-f docker/%s.yaml -f docker/lab/%s.yaml' "$cluster" "$cluster"
    ((bubbles == 0)) || printf -- ' -f docker/lab/bubbles.yaml'
}

# podman-compose names a service's container <project>_<service>_1.
container_of() { printf '%s_%s_1' "$project" "$1"; }

# The services of the cluster with an admin endpoint, one line each: service, role (sidecar,
# proxy, director), admin port. Read from the compose file (once, into the run directory), so a
# node added there is waited for.
list_admin_services() {
    lab_compose config 2>/dev/null | "$lab_venv/bin/python" -c '
import sys, yaml
for name, svc in sorted((yaml.safe_load(sys.stdin).get("services") or {}).items()):
    env, cmd = svc.get("environment") or {}, svc.get("command") or []
    admin = env.get("CELLMESH_ADMIN_LISTEN")
    if admin and len(cmd) >= 2 and cmd[0] == "cellmesh":
        print(name, cmd[1], admin.rsplit(":", 1)[1])'
}
admin_services() { cat "$run_dir/admin-services.txt"; }

# Every service as docker/lab/census.py and the faults need it, as JSON: its role (sidecar, proxy,
# director, bots, game, redis, mongo), geo, node id, admin port, container, and a sidecar's game
# (the service in its network namespace). A store's geo is that of the sidecars whose
# directory_url names it.
list_services_json() {
    lab_compose --profile bots config 2>/dev/null | "$lab_venv/bin/python" -c '
import json, sys, yaml
from urllib.parse import urlparse
services = yaml.safe_load(sys.stdin).get("services") or {}
project = sys.argv[1]
env_of = lambda svc: svc.get("environment") or {}
games = {}
store_geo = {}
for name, svc in services.items():
    mode = svc.get("network_mode") or ""
    if mode.startswith("service:"):
        games[mode.split(":", 1)[1]] = name
    env = env_of(svc)
    if env.get("CELLMESH_DIRECTORY_URL"):
        store_geo[urlparse(env["CELLMESH_DIRECTORY_URL"]).hostname] = env.get("CELLMESH_GEO", "local")
    for key in ("CELLMESH_TOPOLOGY_URL", "CELLMESH_PLAYERS_URL"):
        if env.get(key, "").startswith("mongodb://"):
            store_geo.setdefault(urlparse(env[key]).hostname, None)
out = {}
for name, svc in sorted(services.items()):
    env, cmd = env_of(svc), svc.get("command") or []
    role = None
    if isinstance(cmd, list) and len(cmd) >= 2 and cmd[0] == "cellmesh":
        role = cmd[1]
    if (svc.get("network_mode") or "").startswith("service:"):
        role = "game"
    if name in store_geo:
        role = "mongo" if store_geo[name] is None and "redis" not in name else "redis"
    if role is None:
        continue
    admin = env.get("CELLMESH_ADMIN_LISTEN")
    host = (svc.get("network_mode") or "").split(":", 1)[-1]
    out[name] = {
        "role": role,
        "geo": store_geo.get(name) or env.get("CELLMESH_GEO") or env_of(services.get(host, {})).get("CELLMESH_GEO"),
        "node": int(env["CELLMESH_NODE_ID"]) if env.get("CELLMESH_NODE_ID") else None,
        "port": int(admin.rsplit(":", 1)[1]) if admin else None,
        "container": f"{project}_{name}_1",
        "game_container": f"{project}_{games[name]}_1" if name in games else None,
    }
json.dump(out, sys.stdout, indent=1)' "$project"
}

# service_of ROLE [GEO]: the first service of that role (in that geo), from services.json.
service_of() {
    /usr/bin/python3 -c '
import json, sys
s = json.load(open(sys.argv[1]))
for name, v in sorted(s.items()):
    if v["role"] == sys.argv[2] and (len(sys.argv) < 4 or v["geo"] == sys.argv[3]):
        print(name)
        break' "$run_dir/services.json" "$@"
}

# census SUBCOMMAND ARGS...: docker/lab/census.py on this run (see there).
census() { /usr/bin/python3 docker/lab/census.py "$1" --run "$run_dir" "${@:2}"; }

# http_get SERVICE PORT PATH: the body of GET PATH on the service's port, asked from inside its
# container (the image has bash and no curl) with the run's admin token. Fails unless the answer
# is 200.
http_get() {
    podman exec "$(container_of "$1")" bash -c '
exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
printf "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\nConnection: close\r\n\r\n" "$2" "$3" >&3
IFS= read -r -t 5 status <&3 || exit 1
[[ $status == HTTP/1.[01]" 200"* ]] || exit 1
while IFS= read -r -t 5 line <&3 && [[ $line != $'"'"'\r'"'"' ]]; do :; done
cat <&3' _ "$2" "$3" "$CELLMESH_ADMIN_TOKEN"
}

# wait_until TIMEOUT_S WHAT COMMAND...: retries the command every second.
wait_until() {
    local timeout_s=$1 what=$2 deadline=$((SECONDS + $1))
    shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "$what: not within ${timeout_s} s"
        sleep 1
    done
}

# Podman 4.3 runs health checks from systemd timers, which a host without systemd lacks, and
# podman-compose ignores `service_healthy` with a podman older than 4.6: the lab runs the checks
# itself, and starts the cluster in the order the compose file's conditions ask for.
healthy() { podman healthcheck run "$(container_of "$1")"; }

stores() { [[ $geos == 1 ]] && echo "mongo redis" || echo "mongo eu-redis us-redis"; }

# The services `up` starts (no profile-only service: bots, monitoring), in the compose file's
# dependency order.
default_services() { lab_compose config --services 2>/dev/null; }

# in_background COMMAND...: runs it as a child the shell waits for with `wait`, which a signal
# interrupts: INT and TERM then reach the traps (and the teardown) at once, not when a stuck
# child ends.
in_background() {
    "$@" &
    wait "$!"
}

# compose_up LOG SERVICE...: `up -d` of exactly these services. --no-deps: the lab orders the
# start itself (see healthy); it also keeps podman-compose from linking containers with
# --requires, which podman 4.3 cannot start across two levels (a sidecar requiring the partition
# job requiring MongoDB: "depends on container ... not found in input list").
compose_up() {
    local log_file=$1
    shift
    # shellcheck disable=SC2046 # the files are words
    in_background timeout 600 "$lab_venv/bin/podman-compose" --project-name "$project" \
        $(compose_files) "${profile_args[@]}" up -d --no-deps "$@" >>"$log_file" 2>&1
}
profile_args=()

bring_up() {
    local svc ctr code rest=()
    # shellcheck disable=SC2046 # the store names are words
    compose_up "$run_dir/compose-up.log" $(stores) ||
        die "starting the stores failed: see $run_dir/compose-up.log"
    for svc in $(stores); do
        wait_until 120 "$svc healthy" healthy "$svc"
    done
    log "stores healthy"
    # The networks exist from here: the latency between geos applies to all that follows.
    ((geos == 1)) || shape_inter_geo_traffic
    compose_up "$run_dir/compose-up.log" partition ||
        die "starting the partition job failed: see $run_dir/compose-up.log"
    ctr=$(container_of partition)
    code=$(in_background podman wait "$ctr")
    [[ $code == 0 ]] || {
        podman logs "$ctr" >&2
        die "the partition job exited with $code"
    }
    for svc in $(default_services); do
        [[ " $(stores) partition " == *" $svc "* ]] || rest+=("$svc")
    done
    compose_up "$run_dir/compose-up.log" "${rest[@]}" ||
        die "starting the cluster failed: see $run_dir/compose-up.log"
}

ready() { http_get "$1" "$2" /ready; }

wait_all_ready() {
    local svc role port
    while read -r svc role port; do
        [[ $role == sidecar || $role == proxy ]] || continue
        wait_until 180 "$svc /ready" ready "$svc" "$port"
    done < <(admin_services)
}

# ------------------------------------------------------------------------------------------------
# Latency between geos. The geos' networks are two bridges on the host; what goes from one to the
# other is routed by the host, and delayed there by --delay-ms on its way into the other geo, so
# an eu->us round trip is delayed once each way: 2 x --delay-ms. Within a geo, traffic is switched
# by its bridge and never delayed. Two ways, the first the kernel allows:
#
#   netem    each bridge's root qdisc is a prio whose third band is a netem, chosen by a u32
#            filter on the other geo's source subnet: only what is routed in from the other geo
#            waits (not the gateway's own packets, DNS answers among them);
#   nfqueue  a kernel without netem (CONFIG_NET_SCH_NETEM unset): the FORWARD rules send what
#            crosses between the two subnets to a netfilter queue, and docker/lab/delay.py (on the
#            host) gives each packet its verdict --delay-ms later. --queue-bypass lets packets
#            through undelayed whenever no delayer listens.
#
# The host masquerades what leaves a podman network; between the two lab subnets it must not:
# the netem filter matches the source subnet, and the processes should see their peers of the
# other geo as themselves, not as the gateway.

nfqueue_num=4711
delay_method=""
delayer_pid=""
sampler_pid=""   # docker/lab/census.py sample, from the cluster's readiness to the end

network_bridge() { podman network inspect --format '{{.NetworkInterface}}' "$1"; }
network_subnet() { podman network inspect --format '{{range .Subnets}}{{.Subnet}}{{end}}' "$1"; }

shape_inter_geo_traffic() {
    local eu_bridge us_bridge eu_subnet us_subnet
    eu_bridge=$(network_bridge cellmesh-lab-eu) us_bridge=$(network_bridge cellmesh-lab-us)
    eu_subnet=$(network_subnet cellmesh-lab-eu) us_subnet=$(network_subnet cellmesh-lab-us)
    iptables -t nat -I POSTROUTING -s "$eu_subnet" -d "$us_subnet" -m comment --comment "$rule_comment" -j ACCEPT
    iptables -t nat -I POSTROUTING -s "$us_subnet" -d "$eu_subnet" -m comment --comment "$rule_comment" -j ACCEPT
    if delay_bridge "$eu_bridge" "$us_subnet" 2>/dev/null && delay_bridge "$us_bridge" "$eu_subnet" 2>/dev/null; then
        delay_method=netem
    else
        tc qdisc del dev "$eu_bridge" root 2>/dev/null || true
        tc qdisc del dev "$us_bridge" root 2>/dev/null || true
        /usr/bin/python3 docker/lab/delay.py --queue "$nfqueue_num" --delay-ms "$delay_ms" \
            >"$run_dir/delay.log" 2>&1 &
        delayer_pid=$!
        sleep 0.5
        kill -0 "$delayer_pid" 2>/dev/null || die "the delayer did not start: see $run_dir/delay.log"
        iptables -I FORWARD -s "$eu_subnet" -d "$us_subnet" -m comment --comment "$rule_comment" \
            -j NFQUEUE --queue-num "$nfqueue_num" --queue-bypass
        iptables -I FORWARD -s "$us_subnet" -d "$eu_subnet" -m comment --comment "$rule_comment" \
            -j NFQUEUE --queue-num "$nfqueue_num" --queue-bypass
        delay_method=nfqueue
    fi
    log "inter-geo latency: ${delay_ms} ms one way between $eu_subnet and $us_subnet ($delay_method)"
}

# delay_bridge BRIDGE FROM_SUBNET
delay_bridge() {
    tc qdisc replace dev "$1" root handle 1: prio bands 3 priomap 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 &&
        tc qdisc add dev "$1" parent 1:3 handle 30: netem delay "${delay_ms}ms" limit 100000 &&
        tc filter add dev "$1" parent 1: protocol ip prio 1 u32 match ip src "$2" flowid 1:3
}

# rtt_samples FROM_SERVICE HOST PORT COUNT: TCP connect times (one round trip each) in ms, one a
# line, from inside the service's container.
rtt_samples() {
    podman exec "$(container_of "$1")" bash -c '
for ((i = 0; i < $3; i++)); do
    t0=$EPOCHREALTIME
    exec 3<>"/dev/tcp/$1/$2" || continue
    t1=$EPOCHREALTIME
    exec 3<&-
    echo $(( (${t1/./} - ${t0/./}) ))
    sleep 0.1
done' _ "$2" "$3" "$4" | awk '{ printf "%.3f\n", $1 / 1000 }'
}

p50() { sort -n | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "null" }'; }

measure_rtts() {
    if ((geos == 1)); then
        rtt_samples proxy node1-sidecar 7200 20 >"$run_dir/rtt-intra.txt"
        return 0
    fi
    rtt_samples eu-proxy us-proxy 7300 20 >"$run_dir/rtt-eu-us.txt"
    rtt_samples us-proxy eu-proxy 7300 20 >"$run_dir/rtt-us-eu.txt"
    rtt_samples eu-proxy eu-node1-sidecar 7200 20 >"$run_dir/rtt-intra.txt"
    log "TCP connect RTT p50: eu->us $(p50 <"$run_dir/rtt-eu-us.txt") ms, us->eu $(p50 <"$run_dir/rtt-us-eu.txt") ms, within eu $(p50 <"$run_dir/rtt-intra.txt") ms"
}

# ------------------------------------------------------------------------------------------------
# Bots: the compose file's bots service of each chosen geo, run with the lab's count.

bots_services() {
    if ((geos == 1)); then
        echo bots
    elif [[ $bots_geo == both ]]; then
        echo eu-bots us-bots
    else
        echo "$bots_geo-bots"
    fi
    ((travellers == 0)) || echo travellers
}

start_bots() {
    ((bots > 0)) || return 0
    profile_args=(--profile bots)
    # shellcheck disable=SC2046 # the service names are words
    compose_up "$run_dir/compose-up.log" $(bots_services) ||
        die "starting the bots failed: see $run_dir/compose-up.log"
    profile_args=()
    log "bots: $bots in each of: $(bots_services | grep -vx travellers | xargs); travellers: $travellers"
}

# stop_bots: each bots container that still runs gets SIGTERM (the bots stop as after
# --duration, printing their totals as JSON on stdout), then its log is kept.
stop_bots() {
    local svc ctr
    ((bots > 0)) || return 0
    for svc in $(bots_services); do
        ctr=$(container_of "$svc")
        [[ $(podman inspect --format '{{.State.Status}}' "$ctr" 2>/dev/null) != running ]] ||
            podman stop -t 30 "$ctr" >/dev/null 2>&1 || true
        podman logs "$ctr" >"$run_dir/bots-$svc.log" 2>&1 || true
    done
}

# ------------------------------------------------------------------------------------------------
# Faults. Each is a function fault_<name> [ARG] (dashes of the name become underscores): it does
# its harm, waits for the world to be whole again (docker/lab/census.py wait), and records itself
# with fault_end: {name, arg, began_s, recovered_s, recovery_s, cost, violations} in the summary's
# `faults`, times in seconds since the bots started. "Whole": every sidecar and proxy ready, every
# sidecar's lease live, linked to every other sidecar, no handoff in flight or in doubt (and for
# a kill, every NPC held before held again). A fault not recovered within --recovery-bound
# seconds is recorded with recovered_s null, and the run exits 1; so does one whose own
# conditions failed (its `violations`).

fault_records=()   # one JSON object each, in the order the faults ran
fault_seq=0
fault_dir=""       # the running fault's files: $run_dir/fault-N-NAME
bots_t0=""         # when the bots started (epoch seconds)
settle_s=10        # between a fault's recovery and the next fault

now() { printf '%s' "$EPOCHREALTIME"; }
elapsed() { echo $((${EPOCHREALTIME%.*} - ${bots_t0%.*})); }

# svc_field SERVICE FIELD: a field of services.json.
svc_field() {
    /usr/bin/python3 -c 'import json, sys; v = json.load(open(sys.argv[1]))[sys.argv[2]][sys.argv[3]]; print("" if v is None else v)' \
        "$run_dir/services.json" "$1" "$2"
}

# The geo the bots play in (the first, with both), and the default of most faults.
bots_geo_name() {
    if ((geos == 1)); then echo local; elif [[ $bots_geo == us ]]; then echo us; else echo eu; fi
}

# Every container of the lab: name, restarts (by the engine), state, exit code.
restart_table() {
    local ctrs
    ctrs=$(podman ps -aq --filter "label=io.podman.compose.project=$project")
    # shellcheck disable=SC2086 # ids are words
    [[ -z $ctrs ]] || podman inspect --format '{{.Name}} {{.RestartCount}} {{.State.Status}} {{.State.ExitCode}}' $ctrs
}

# fault_begin NAME: the fault's directory, a snapshot of the world and of the containers.
fault_begin() {
    fault_seq=$((fault_seq + 1))
    fault_dir=$run_dir/fault-$fault_seq-$1
    mkdir -p "$fault_dir"
    census snap --out "$fault_dir/before.json" --label "before $1"
    restart_table >"$fault_dir/containers-before.txt"
    log "fault $1 (${2:-}) at $(elapsed) s"
}

# fault_wait WHAT CENSUS-WAIT-ARGS...: census.py wait, its result in $fault_dir/wait-WHAT.json.
fault_wait() {
    local what=$1
    shift
    census wait --out "$fault_dir/wait-$what.json" --bound "$recovery_bound_s" --record --supervise "$@" \
        2>>"$fault_dir/wait.log"
}

# wait_field WHAT FIELD: a field of a wait's result ("" if null or absent).
wait_field() {
    /usr/bin/python3 -c 'import json, sys
try:
    v = json.load(open(sys.argv[1])).get(sys.argv[2])
except (OSError, ValueError):
    v = None
print("" if v is None else v)' "$fault_dir/wait-$1.json" "$2"
}

# wait_stopped CONTAINER...: until none of them runs (10 s at most).
wait_stopped() {
    local c t running
    for ((t = 0; t < 50; t++)); do
        running=0
        for c in "$@"; do
            [[ $(podman inspect --format '{{.State.Status}}' "$c" 2>/dev/null) != running ]] || running=1
        done
        ((running)) || return 0
        sleep 0.2
    done
}

# sleep_until EPOCH
sleep_until() {
    local left
    left=$(awk -v t="$1" -v n="$EPOCHREALTIME" 'BEGIN { d = t - n; printf "%.2f", (d > 0 ? d : 0) }')
    in_background sleep "$left"
}

# fault_end NAME ARG BEGAN RECOVERED EXTRA_COST_JSON CHECKS [VIOLATION...]: three snapshots a second
# apart once recovered, the cost (census.py cost, with EXTRA_COST_JSON merged in), the checks
# (comma list: no_exits, no_kicks, avatars_kept) and the violations given, recorded.
fault_end() {
    local name=$1 arg=$2 began=$3 recovered=$4 extra=$5 checks=$6 i cost record
    shift 6
    for i in 1 2 3; do
        census snap --out "$fault_dir/after-$i.json" --label "after $name"
        ((i == 3)) || in_background sleep 1
    done
    restart_table >"$fault_dir/containers-after.txt"
    local waits=()
    for i in "$fault_dir"/wait-*.json; do [[ -e $i ]] && waits+=(--wait "$i"); done
    cost=$(census cost --before "$fault_dir/before.json" --after "$fault_dir/after-1.json" \
        --after "$fault_dir/after-2.json" --after "$fault_dir/after-3.json" "${waits[@]}") || cost='{}'
    record=$(/usr/bin/python3 - "$name" "$arg" "$began" "$recovered" "$bots_t0" "$cost" "$extra" "$checks" \
        "$fault_dir" "$recovery_bound_s" "$@" <<'PY'
import json, sys
name, arg, began, recovered, t0, cost, extra, checks, fdir, bound, *violations = sys.argv[1:]
cost = {**json.loads(cost or "{}"), **json.loads(extra or "{}")}
def table(path):
    out = {}
    try:
        for line in open(path):
            n, restarts, status, code = line.split()
            out[n] = (int(restarts), status, int(code))
    except FileNotFoundError:
        pass
    return out
b, a = table(fdir + "/containers-before.txt"), table(fdir + "/containers-after.txt")
exits = [{"container": n, "restarts": r - b.get(n, (0,))[0], "status": st, "exit_code": c}
         for n, (r, st, c) in sorted(a.items())
         if r > b.get(n, (0,))[0] or (st != "running" and b.get(n, (0, ""))[1] == "running")]
cost["containers_exited"] = exits
checks = [c for c in checks.split(",") if c]
violations = [v for v in violations if v]
if not recovered:
    violations.append(f"the world was not whole again within {bound} s")
if "no_exits" in checks and exits:
    violations.append("containers exited or restarted: " + ", ".join(e["container"] for e in exits))
# PROBE_DONE ends a probe of another geo's proxy, not a session.
kicked = {k: v for k, v in (cost.get("kicks") or {}).items() if k != "PROBE_DONE"}
if "no_kicks" in checks and kicked:
    violations.append(f"sessions kicked: {kicked}")
# A bridged player whose avatar was written in the other geo gets a new one (the new gateway's
# directory has no record of it): recorded in the cost as avatars_replaced_across_geos, not a
# violation, until avatars follow their players across geos.
replaced_here = (cost.get("avatars_replaced") or 0) - (cost.get("avatars_replaced_across_geos") or 0)
if "avatars_kept" in checks and (replaced_here or cost.get("avatars_not_found")):
    violations.append(f"{replaced_here} avatars replaced, {cost.get('avatars_not_found', 0)} not found")
if cost.get("entities_lost"):
    violations.append(f"{cost['entities_lost']} entities lost")
if cost.get("entities_written_twice_after"):
    violations.append(f"{cost['entities_written_twice_after']} entities written by two nodes after the recovery")
if cost.get("accounts_with_two_avatars_after"):
    violations.append(f"{cost['accounts_with_two_avatars_after']} accounts with two avatars after the recovery")
rel = lambda t: round(float(t) - float(t0), 1)
print(json.dumps({
    "name": name,
    "arg": arg or None,
    "began_s": rel(began),
    "recovered_s": rel(recovered) if recovered else None,
    "recovery_s": round(float(recovered) - float(began), 1) if recovered else None,
    "cost": cost,
    "violations": violations,
}))
PY
) || record=$(printf '{"name": "%s", "began_s": null, "recovered_s": null, "recovery_s": null, "cost": {}, "violations": ["recording the fault failed"]}' "$name")
    fault_records+=("$record")
    printf '%s\n' "$record" >>"$run_dir/faults.jsonl"
    log "fault $name: $(/usr/bin/python3 -c 'import json, sys
r = json.loads(sys.argv[1])
print("recovered in %s s" % r["recovery_s"] if r["recovered_s"] is not None else "NOT recovered", *r["violations"], sep="; ")' "$record")"
}

# kill_node NAME ARG SERVICE: kills the sidecar SERVICE and its game as a crash would, waits for
# the node's world restored on the live nodes from its geo's checkpoints (its lease lapses first),
# starts both containers again (the game after its sidecar, as a supervisor would) and waits for
# the world whole, every NPC held before held again.
kill_node() {
    local name=$1 arg=$2 svc=$3 node ctr game began restarted recovered viol=() extra restored_s
    node=$(svc_field "$svc" node) ctr=$(svc_field "$svc" container) game=$(svc_field "$svc" game_container)
    census ids --snap "$fault_dir/before.json" --node "$node" >"$fault_dir/victim-npcs.json"
    census ids --snap "$fault_dir/before.json" >"$fault_dir/npcs.json"
    began=$(now)
    # The game first: killing the sidecar, whose network namespace the game shares, stops the
    # game too, and a kill of a stopped container fails.
    podman kill "$game" >/dev/null 2>&1 || true
    podman kill "$ctr" >/dev/null || viol+=("podman kill $svc failed")
    wait_stopped "$ctr" "$game"
    log "fault $name: killed $svc (node $node) and its game"
    fault_wait restored --until restored --need "$fault_dir/victim-npcs.json" --victim "$node" --since "$began" ||
        viol+=("the killed node's NPCs were not all restored on live nodes within ${recovery_bound_s} s")
    restored_s=$(wait_field restored after_s)
    log "fault $name: ${restored_s:-not all} s to the node's NPCs held again; restarting $svc"
    podman start "$ctr" >/dev/null && podman start "$game" >/dev/null || viol+=("starting $svc again failed")
    restarted=$(now)
    census targets
    fault_wait whole --until whole --need "$fault_dir/npcs.json" --since "$began" || true
    recovered=$(wait_field whole at)
    /usr/bin/python3 -c 'import json, sys; print("\n".join(str(v) for v in json.load(open(sys.argv[1])).get("first_seen_ms", [])))' \
        "$fault_dir/wait-restored.json" >>"$run_dir/restore-ms.txt" 2>/dev/null || true
    extra=$(/usr/bin/python3 - "$fault_dir" "$svc" "$node" "$began" "$restarted" <<'PY'
import json, sys
fdir, svc, node, began, restarted = sys.argv[1:]
w = json.load(open(fdir + "/wait-restored.json"))
ms = sorted(w.get("first_seen_ms", []))
pick = lambda q: ms[min(len(ms) - 1, int(round((len(ms) - 1) * q)))] if ms else None
print(json.dumps({
    "node": svc, "node_id": int(node),
    "npcs_of_node": w.get("needed"), "npcs_restored": len(ms), "npcs_never_restored": len(w.get("never_seen", [])),
    "restored_s": w.get("after_s"), "restore_ms_p50": pick(0.5), "restore_ms_p99": pick(0.99),
    "restarted_after_s": round(float(restarted) - float(began), 1),
}))
PY
)
    fault_end "$name" "$arg" "$began" "$recovered" "$extra" "" "${viol[@]}"
}

fault_kill_node() {
    local geo=${1:-} svc
    [[ -n $geo ]] || { ((geos == 2)) && geo=us || geo=local; }
    fault_begin kill-node "$geo"
    read -r svc _ < <(census pick --snap "$fault_dir/before.json" --kind node --geo "$geo") || true
    if [[ -z ${svc:-} ]]; then
        fault_end kill-node "$geo" "$(now)" "" '{}' "" "no sidecar of geo $geo answered"
        return 0
    fi
    kill_node kill-node "$geo" "$svc"
}

fault_kill_gateway() {
    local geo=${1:-} svc sessions
    fault_begin kill-gateway "$geo"
    read -r svc _ sessions < <(census pick --snap "$fault_dir/before.json" --kind gateway ${geo:+--geo "$geo"}) || true
    if [[ -z ${svc:-} ]]; then
        fault_end kill-gateway "$geo" "$(now)" "" '{}' "" "no gateway holds a session (no bots playing?)"
        return 0
    fi
    log "fault kill-gateway: $svc is the gateway of $sessions sessions"
    kill_node kill-gateway "$geo" "$svc"
}

# pause-mongo [SECS]: longer than a lease (10 s) and than a MongoDB election: at least 15 s.
fault_pause_mongo() {
    local secs=${1:-15} svc ctr began unpaused recovered viol=() extra after
    ((secs >= 15)) || secs=15
    svc=$(service_of mongo) ctr=$(svc_field "$svc" container)
    fault_begin pause-mongo "$secs"
    began=$(now)
    podman pause "$ctr" >/dev/null || viol+=("podman pause $svc failed")
    fault_wait frozen --until frozen --since "$began" --bound "$secs" ||
        viol+=("not every sidecar froze (lease_live false) while MongoDB was paused")
    sleep_until "$(awk -v b="$began" -v s="$secs" 'BEGIN { printf "%.6f", b + s }')"
    podman unpause "$ctr" >/dev/null || viol+=("podman unpause $svc failed")
    unpaused=$(now)
    log "fault pause-mongo: unpaused after $secs s"
    fault_wait whole --until whole --since "$unpaused" || true
    recovered=$(wait_field whole at)
    after=$(wait_field whole after_s)
    if [[ -n $after ]] && awk -v a="$after" 'BEGIN { exit !(a > 5) }'; then
        viol+=("the world was whole $after s after the unpause, not within 5 s")
    fi
    extra=$(printf '{"paused_s": %s, "frozen_after_s": %s, "whole_after_unpause_s": %s}' "$secs" \
        "$(wait_field frozen after_s | sed 's/^$/null/')" "${after:-null}")
    fault_end pause-mongo "$secs" "$began" "$recovered" "$extra" no_exits "${viol[@]}"
}

# The checkpoints a Redis holds: entries of every cellmesh:*:checkpoints hash.
checkpoint_count() {
    podman exec "$1" redis-cli --raw EVAL "
local n = 0
for _, k in ipairs(redis.call('KEYS', '*:checkpoints')) do n = n + redis.call('HLEN', k) end
return n" 0 2>/dev/null || echo null
}

fault_restart_redis() {
    local geo=${1:-$(bots_geo_name)} svc ctr began recovered viol=() before_n after_n up_s t
    svc=$(service_of redis "$geo")
    [[ -n $svc ]] || die "no Redis of geo $geo"
    ctr=$(svc_field "$svc" container)
    fault_begin restart-redis "$geo"
    before_n=$(checkpoint_count "$ctr")
    began=$(now)
    podman restart -t 10 "$ctr" >/dev/null || viol+=("podman restart $svc failed")
    for ((t = 0; t < 60; t++)); do
        [[ $(podman exec "$ctr" redis-cli ping 2>/dev/null) == PONG ]] && break
        in_background sleep 0.5
    done
    up_s=$(awk -v b="$began" -v n="$EPOCHREALTIME" 'BEGIN { printf "%.1f", n - b }')
    after_n=$(checkpoint_count "$ctr")
    log "fault restart-redis: $svc answers again after $up_s s; checkpoints $before_n before, $after_n after"
    if [[ $before_n =~ ^[0-9]+$ && $after_n =~ ^[0-9]+$ ]] && ((before_n > 0 && after_n * 2 < before_n)); then
        viol+=("checkpoints lost with the restart: $before_n before, $after_n after")
    fi
    fault_wait whole --until whole --since "$began" || true
    recovered=$(wait_field whole at)
    fault_end restart-redis "$geo" "$began" "$recovered" \
        "$(printf '{"redis": "%s", "answering_after_s": %s, "checkpoints_before": %s, "checkpoints_after_restart": %s}' "$svc" "$up_s" "$before_n" "$after_n")" \
        no_exits,no_kicks "${viol[@]}"
}

# partition-geo [SECS]: the host drops what is routed between the geos' subnets, both ways; the
# rules carry the lab's marker (teardown removes them whatever happens).
fault_partition_geo() {
    local secs=${1:-20} eu us began healed recovered viol=() rule client
    eu=$(network_subnet cellmesh-lab-eu) us=$(network_subnet cellmesh-lab-us)
    rule=(-m comment --comment "$rule_comment-partition" -j "$cut_chain")
    fault_begin partition-geo "$secs"
    began=$(now)
    # The link between the datacenters is cut, not the players' paths to them: a bot dialling
    # the other geo's proxy (a traveller, or a probe) keeps its route, delayed as before. What
    # crosses between the geos goes through the chain, which lets the bots' addresses go on
    # (RETURN: on to the delay's rules) and drops the rest.
    make_cut_chain && iptables -I FORWARD 1 -s "$eu" -d "$us" "${rule[@]}" &&
        iptables -I FORWARD 1 -s "$us" -d "$eu" "${rule[@]}" ||
        viol+=("cutting the path between the geos failed")
    fault_wait cut --until never --since "$began" --bound "$secs" || true
    iptables -D FORWARD -s "$eu" -d "$us" "${rule[@]}" 2>/dev/null || viol+=("healing failed")
    iptables -D FORWARD -s "$us" -d "$eu" "${rule[@]}" 2>/dev/null || viol+=("healing failed")
    remove_cut_chain
    healed=$(now)
    log "fault partition-geo: healed after $secs s"
    fault_wait whole --until whole --since "$healed" || true
    recovered=$(wait_field whole at)
    fault_end partition-geo "$secs" "$began" "$recovered" \
        "$(printf '{"cut_s": %s, "whole_after_heal_s": %s}' "$secs" "$(wait_field whole after_s | sed 's/^$/null/')")" \
        "" "${viol[@]}"
}

# kill-geo [SECS]: every node of us (sidecars and games) killed at once, as a datacenter gone
# dark, and kept dead SECS (default 40). The core (eu) fences their leases and restores their
# world from the copy of us's checkpoints in eu's Redis, within 30 s of the kill; us's proxy
# moves its sessions to eu's gateways (its fallback gateways), the clients connected. Then every
# node starts again (each game after its sidecar) and the world must be whole, every NPC held
# before held again.
fault_kill_geo() {
    local secs=${1:-40} geo=us began restarted recovered viol=() extra svc node restored_s
    local svcs=() nodes=() victims=() ctrs=() games=()
    fault_begin kill-geo "$secs"
    if ((geos != 2)); then
        fault_end kill-geo "$secs" "$(now)" "" '{}' "" "kill-geo needs two geos (a core to fall back to)"
        return 0
    fi
    mapfile -t svcs < <(/usr/bin/python3 -c 'import json, sys
for name, v in sorted(json.load(open(sys.argv[1])).items()):
    if v["role"] == "sidecar" and v["geo"] == sys.argv[2]:
        print(name)' "$run_dir/services.json" "$geo")
    for svc in "${svcs[@]}"; do
        node=$(svc_field "$svc" node)
        nodes+=("$node") victims+=(--victim "$node")
        ctrs+=("$(svc_field "$svc" container)") games+=("$(svc_field "$svc" game_container)")
    done
    local node_args=()
    for node in "${nodes[@]}"; do node_args+=(--node "$node"); done
    census ids --snap "$fault_dir/before.json" "${node_args[@]}" >"$fault_dir/victim-npcs.json"
    census ids --snap "$fault_dir/before.json" >"$fault_dir/npcs.json"
    began=$(now)
    # The games first: each shares its sidecar's network namespace (see kill_node).
    podman kill "${games[@]}" >/dev/null 2>&1 || true
    podman kill "${ctrs[@]}" >/dev/null || viol+=("podman kill of the $geo sidecars failed")
    wait_stopped "${ctrs[@]}" "${games[@]}"
    log "fault kill-geo: killed every node of $geo (${svcs[*]}) and their games"
    fault_wait restored --until restored --need "$fault_dir/victim-npcs.json" "${victims[@]}" --since "$began" ||
        viol+=("the $geo nodes' NPCs were not all restored by the core within ${recovery_bound_s} s")
    restored_s=$(wait_field restored after_s)
    if [[ -n $restored_s ]] && awk -v s="$restored_s" 'BEGIN { exit !(s > 30) }'; then
        viol+=("the $geo nodes' NPCs were restored by the core $restored_s s after the kill, more than 30 s")
    fi
    census snap --out "$fault_dir/dark.json" --label "kill-geo: $geo dark, its world restored"
    log "fault kill-geo: ${restored_s:-not all} s to the geo's NPCs held by the core; dark until ${secs} s"
    sleep_until "$(awk -v b="$began" -v s="$secs" 'BEGIN { printf "%.6f", b + s }')"
    podman start "${ctrs[@]}" >/dev/null && podman start "${games[@]}" >/dev/null ||
        viol+=("starting the $geo nodes again failed")
    restarted=$(now)
    census targets
    fault_wait whole --until whole --need "$fault_dir/npcs.json" --since "$restarted" || true
    recovered=$(wait_field whole at)
    extra=$(/usr/bin/python3 - "$fault_dir" "$geo" "$began" "$restarted" <<'PY'
import json, sys
fdir, geo, began, restarted = sys.argv[1:]
w = json.load(open(fdir + "/wait-restored.json"))
ms = sorted(w.get("first_seen_ms", []))
pick = lambda q: ms[min(len(ms) - 1, int(round((len(ms) - 1) * q)))] if ms else None
dark = json.load(open(fdir + "/dark.json"))
on_fallback = sum(
    1 for p in dark["proxies"].values() if p.get("state")
    for s in p["state"].get("sessions", []) if s.get("fallback"))
print(json.dumps({
    "geo": geo,
    "npcs_of_geo": w.get("needed"), "npcs_restored": len(ms), "npcs_never_restored": len(w.get("never_seen", [])),
    "fallback_s": w.get("after_s"), "fallback_ms_p50": pick(0.5), "fallback_ms_p99": pick(0.99),
    "sessions_on_fallback_while_dark": on_fallback,
    "dark_s": round(float(restarted) - float(began), 1),
}))
PY
)
    fault_end kill-geo "$secs" "$began" "$recovered" "$extra" "" "${viol[@]}"
}

make_cut_chain() {
    local client
    iptables -N "$cut_chain" || return 1
    for client in "${lab_clients[@]}"; do
        iptables -A "$cut_chain" -s "$client" -j RETURN || return 1
        iptables -A "$cut_chain" -d "$client" -j RETURN || return 1
    done
    iptables -A "$cut_chain" -j DROP
}

# The partition's chain, once no rule jumps to it.
remove_cut_chain() {
    iptables -F "$cut_chain" 2>/dev/null || true
    iptables -X "$cut_chain" 2>/dev/null || true
}

# kill-proxy [GEO]: the proxy of the bots' geo killed and started again at once; its clients
# reconnect (the bots retry every second) and must find their avatar (the same entity).
fault_kill_proxy() {
    local geo=${1:-$(bots_geo_name)} svc ctr began recovered viol=() sessions avatars
    svc=$(service_of proxy "$geo") ctr=$(svc_field "$svc" container)
    fault_begin kill-proxy "$geo"
    sessions=$(/usr/bin/python3 -c 'import json, sys
s = json.load(open(sys.argv[1]))
print(sum(len(p["state"]["sessions"]) for p in s["proxies"].values() if p["state"]))' "$fault_dir/before.json")
    began=$(now)
    podman kill "$ctr" >/dev/null || viol+=("podman kill $svc failed")
    wait_stopped "$ctr"
    podman start "$ctr" >/dev/null || viol+=("starting $svc again failed")
    census targets
    fault_wait whole --until whole --min-sessions "$sessions" --since "$began" || true
    recovered=$(wait_field whole at)
    census snap --out "$fault_dir/reconnected.json" --label "after kill-proxy"
    avatars=$(census avatars --before "$fault_dir/before.json" --after "$fault_dir/reconnected.json") || avatars='{}'
    fault_end kill-proxy "$geo" "$began" "$recovered" \
        "$(/usr/bin/python3 -c 'import json, sys; print(json.dumps({"proxy": sys.argv[1], "sessions_to_find": int(sys.argv[2]), **json.loads(sys.argv[3])}))' "$svc" "$sessions" "$avatars")" \
        no_exits,avatars_kept "${viol[@]}"
}

# The faults to run, one line each: SECS NAME ARG, in order. --fault gives SECS; --faults spreads
# its list over --duration (at duration x i / (n + 1)); a fault starts no sooner than settle_s
# after the one before recovered.
plan_faults() {
    local f spec name arg at i n list=()
    for f in "${faults[@]}"; do
        spec=${f%@*} at=${f##*@}
        printf '%s %s %s\n' "$at" "${spec%%:*}" "$([[ $spec == *:* ]] && echo "${spec#*:}")"
    done
    if [[ -n $faults_spread ]]; then
        IFS=, read -ra list <<<"$faults_spread"
        n=${#list[@]}
        for ((i = 0; i < n; i++)); do
            spec=${list[i]}
            printf '%s %s %s\n' "$((duration_s * (i + 1) / (n + 1)))" "${spec%%:*}" "$([[ $spec == *:* ]] && echo "${spec#*:}")"
        done
    fi
}

check_faults() {
    local at name arg
    while read -r at name arg; do
        [[ $at =~ ^[0-9]+$ ]] || die "--fault is NAME[:ARG]@SECS"
        declare -F "fault_${name//-/_}" >/dev/null || die "no fault named $name"
        [[ $name != partition-geo ]] || ((geos == 2)) || die "partition-geo needs two geos"
        [[ -z $arg || $arg =~ ^[a-z0-9]+$ ]] || die "fault $name: bad argument $arg"
    done < <(plan_faults)
}

# ------------------------------------------------------------------------------------------------
# What the run leaves: samples of the proxies' figures, the summary.

proxies() { admin_services | awk '$2 == "proxy" { print $1, $3 }'; }

# sample_proxies LABEL: each proxy's /metrics and /state, kept in the run directory.
sample_proxies() {
    local svc port
    while read -r svc port; do
        http_get "$svc" "$port" /metrics >"$run_dir/$1-$svc.metrics" 2>/dev/null || true
        http_get "$svc" "$port" /state >"$run_dir/$1-$svc.state.json" 2>/dev/null || true
    done < <(proxies)
}

# The far-geo RTTs the proxies recorded: a client of one geo probes the other geo's proxy, which
# measures the round trip and writes it to the handover board (the client's home Redis) as
# cellmesh:<geo>:{<account>}:far_rtt, a hash of far geo -> {min_ms, median_ms, samples, kernel}.
# The proxies publish no such figure on /metrics or /state; the boards are where it is.
collect_far_rtts() {
    local svc
    ((geos == 2)) || return 0
    for svc in eu-redis us-redis; do
        podman exec "$(container_of "$svc")" redis-cli --raw EVAL "
local out = {}
for _, k in ipairs(redis.call('KEYS', '*:far_rtt')) do
    local h = redis.call('HGETALL', k)
    for i = 1, #h, 2 do out[#out + 1] = k .. ' ' .. h[i] .. ' ' .. h[i + 1] end
end
return out" 0 2>/dev/null || true
    done >"$run_dir/far-rtt.txt"
}

# With --bubbles: what the directors moved and the bots' click to screen either side of the first
# move to us (docker/lab/census.py bubbles), cut at the first kill-geo if one came, into
# bubbles.json. Before the teardown: the directors are asked.
write_bubbles() {
    local args=() f until
    ((bubbles)) || return 0
    for f in "$run_dir"/bots-*.log; do [[ -e $f ]] && args+=(--bots-log "$f"); done
    until=$(/usr/bin/python3 -c 'import json, sys
began = [json.loads(l)["began_s"] for l in open(sys.argv[1]) if json.loads(l)["name"] == "kill-geo"]
print(float(sys.argv[2]) + began[0] if began and began[0] is not None else "")' "$run_dir/faults.jsonl" "$bots_t0" 2>/dev/null || true)
    [[ -z $until ]] || args+=(--until "$until")
    census bubbles "${args[@]}" >"$run_dir/bubbles.json" || echo '{}' >"$run_dir/bubbles.json"
    log "bubbles: $(cat "$run_dir/bubbles.json")"
}

# The census (docker/lab/census.py final) into census.json: the keys of `cellmesh up`'s summary
# (null where the processes do not expose what they need), from every sample of the run, the
# snapshots before and after the bots left, the bots' totals and the faults' restores.
write_census() {
    local args=() f
    for f in "$run_dir"/end-before-logout-*.json; do [[ -e $f ]] && args+=(--before-logout "$f"); done
    [[ -e $run_dir/end.json ]] && args+=(--end "$run_dir/end.json")
    for f in "$run_dir"/bots-*.log; do [[ -e $f ]] && args+=(--bots-log "$f"); done
    [[ -e $run_dir/restore-ms.txt ]] && args+=(--restore-ms "$run_dir/restore-ms.txt")
    census final "${args[@]}" >"$run_dir/census.json" || echo '{}' >"$run_dir/census.json"
}

write_summary() {
    local containers
    containers=$(podman ps -a --filter "label=io.podman.compose.project=$project" --format '{{.Names}}')
    # Restart counts and states: a container that restarted, or stopped other than the
    # partition and trust jobs' planned exits, did so unasked (no fault touches it yet).
    local ctr
    for ctr in $containers; do
        podman inspect --format '{{.Name}} {{.RestartCount}} {{.State.Status}} {{.State.ExitCode}}' "$ctr"
    done >"$run_dir/containers.txt"
    LAB_BUBBLES=$bubbles LAB_GEOS=$geos LAB_DELAY_MS=$delay_ms LAB_DURATION_S=$duration_s LAB_BOTS=$bots LAB_TRAVELLERS=$travellers LAB_DELAY_METHOD=$delay_method \
        LAB_BOTS_SERVICES="$( ((bots > 0)) && bots_services)" LAB_BRING_UP_S=${bring_up_s:-} \
        LAB_IMAGE_BYTES=$(podman image inspect --format '{{.Size}}' "$project_image") \
        LAB_FAULTS="[$(IFS=,; printf '%s' "${fault_records[*]:-}")]" LAB_PLAYED_S=${played_s:-} \
        python3 - "$run_dir" "$summary_json" <<'PY'
import glob, json, os, re, sys
run, out = sys.argv[1], sys.argv[2]
env = os.environ

def metric_sum(text, name):
    """The sum of a metric's series on one /metrics page (None if the page has none)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        m = re.match(r"^" + re.escape(name) + r"(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m and m.group(2) != "NaN":
            total += float(m.group(2))
            seen = True
    return total if seen else None

def proxies_sum(sample, metric):
    """The sum over the proxies of a metric at one sample (s000, s005, ..., end)."""
    vals = [metric_sum(open(p).read(), metric) for p in glob.glob(os.path.join(run, sample + "-*.metrics"))]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None

def state_stat(sample, key):
    """The sum over the proxies of a figure of their /state's `stats` at one sample."""
    vals = []
    for p in glob.glob(os.path.join(run, sample + "-*.state.json")):
        try:
            v = json.load(open(p)).get("stats", {}).get(key)
        except ValueError:
            continue
        if isinstance(v, (int, float)):
            vals.append(v)
    return sum(vals) if vals else None

def p50_of(name):
    try:
        v = sorted(float(x) for x in open(os.path.join(run, name)) if x.strip())
    except FileNotFoundError:
        return None
    return v[(len(v) - 1) // 2] if v else None

samples = sorted({os.path.basename(p).split("-")[0] for p in glob.glob(os.path.join(run, "s[0-9]*-*.metrics"))})
# The proxies' /state `stats` first; their /metrics where /state lacks the figure (a labelled
# counter has no series on /metrics until it is first counted).
def figure(sample, stat, metric):
    v = state_stat(sample, stat)
    return v if v is not None else proxies_sum(sample, metric)

bridged = [b for b in (figure(s, "bridged_sessions", "cellmesh_proxy_bridged_sessions") for s in samples) if b is not None]

def over_processes(stat):
    """A proxy's /state counter over the whole run, summed over the proxies: a figure lower than
    the sample before it is a new process (kill-proxy), counted from 0 (what a killed process
    counted after its last sample is lost with it)."""
    total = 0
    proxies = {os.path.basename(p)[len("end-"):-len(".state.json")] for p in glob.glob(os.path.join(run, "end-*.state.json"))}
    for proxy in proxies:
        last = 0
        for sample in samples + ["end"]:
            try:
                v = json.load(open(os.path.join(run, f"{sample}-{proxy}.state.json"))).get("stats", {}).get(stat)
            except (OSError, ValueError):
                continue
            if isinstance(v, (int, float)):
                if v < last:
                    total += last
                last = v
        total += last
    return total

# A container that restarted, or that is not running other than by the partition and trust jobs' or
# the bots' planned exit, did so unasked (the containers a fault kills it starts again, and the engine
# does not count those starts). One that did so during a fault names it. A sidecar cut off with its
# geo by partition-geo is fenced by the core geo's decider, which restores its world: when the cut
# heals it finds its lease gone, exits 0 and is started afresh. That exit is the fallback working,
# listed as fenced_and_restarted, not unplanned.
faults = json.loads(env["LAB_FAULTS"])
unplanned = []
fenced_and_restarted = []
containers = [line.split() for line in open(os.path.join(run, "containers.txt")) if line.strip()]
for name, restarts, status, code in containers:
    planned_exit = (name.endswith(("_partition_1", "_trust_1", "bots_1", "_travellers_1"))) and status == "exited" and code == "0"
    if int(restarts) > 0 or (status != "running" and not planned_exit):
        during = sorted({f["name"] for f in faults for e in f.get("cost", {}).get("containers_exited", []) if e["container"] == name})
        entry = {"container": name, "restarts": int(restarts), "status": status, "exit_code": int(code),
                 "during_faults": during}
        if name.endswith("-sidecar_1") and code == "0" and status == "running" and during == ["partition-geo"]:
            fenced_and_restarted.append(entry)
        else:
            unplanned.append(entry)

try:
    census = json.load(open(os.path.join(run, "census.json")))
except (OSError, ValueError):
    census = {}

kicks = {}
for p in glob.glob(os.path.join(run, "end-*.metrics")):
    for m in re.finditer(r'^cellmesh_proxy_kicks_total\{reason="([A-Z_]+)"\} ([0-9.]+)$', open(p).read(), re.M):
        kicks[m.group(1)] = kicks.get(m.group(1), 0) + int(float(m.group(2)))

eu_us, us_eu = p50_of("rtt-eu-us.txt"), p50_of("rtt-us-eu.txt")
lab_rtt = None if eu_us is None else round((eu_us + us_eu) / 2, 3)

# The proxies' own figures, from the handover boards: one median per account and far geo, for
# the far geos across the ocean from where the account plays (a traveller plays from us: its
# probes of us-proxy measure the LAN).
plays_from = {"eu-bot-": "eu", "us-bot-": "us", "traveller-": "us"}
far = []
try:
    for line in open(os.path.join(run, "far-rtt.txt")):
        parts = line.split(" ", 2)
        if len(parts) != 3:
            continue
        account = parts[0][parts[0].find("{") + 1:parts[0].rfind("}")]
        home = next((g for p, g in plays_from.items() if account.startswith(p)), None)
        if home is not None and home == parts[1]:
            continue
        try:
            far.append(json.loads(parts[2])["median_ms"])
        except (ValueError, KeyError):
            pass
except FileNotFoundError:
    pass
far.sort()
proxies_rtt = round(far[(len(far) - 1) // 2], 3) if far else None
census_keys = ["inputs_sent", "inputs_delivered", "entities_lost", "entities_duplicated",
               "accounts_with_two_avatars", "sessions_without_avatar", "avatars_after_logout",
               "sessions_dropped", "restore_ms_p99", "errors", "errors_by_kind"]
summary = {k: census.get(k) for k in census_keys}
summary.update({
    "geos": int(env["LAB_GEOS"]),
    "containers": len(containers),
    "image_bytes": int(env["LAB_IMAGE_BYTES"]),
    "delay_ms_one_way": int(env["LAB_DELAY_MS"]) if env["LAB_GEOS"] == "2" else None,
    "duration_s": int(env["LAB_DURATION_S"]),
    "bots": {"per_service": int(env["LAB_BOTS"]), "travellers": int(env["LAB_TRAVELLERS"]), "services": env["LAB_BOTS_SERVICES"].split()},
    "bring_up_s": int(env["LAB_BRING_UP_S"]) if env.get("LAB_BRING_UP_S") else None,
    # As the proxies measured it when clients probed them from the other geo (the handover
    # boards' far_rtt, median of the accounts' medians); the lab's own TCP connect timing when
    # no client probed.
    "inter_geo_rtt_ms_p50": proxies_rtt if proxies_rtt is not None else lab_rtt,
    "inter_geo_rtt_source": (
        f"proxies: far_rtt on the handover boards, {len(far)} account(s)" if proxies_rtt is not None
        else None if lab_rtt is None else "lab: TCP connect eu-proxy<->us-proxy:7300, 20 each way"),
    "inter_geo_rtt_ms_p50_lab": lab_rtt,
    "inter_geo_delay_method": env.get("LAB_DELAY_METHOD") or None,
    "inter_geo_rtt_ms_p50_by_direction": None if eu_us is None else {"eu_to_us": eu_us, "us_to_eu": us_eu},
    "intra_geo_rtt_ms_p50": p50_of("rtt-intra.txt"),
    "handovers": over_processes("handovers"),
    "bridged_sessions": max(bridged) if bridged else None,
    "bridged_sessions_end": figure("end", "bridged_sessions", "cellmesh_proxy_bridged_sessions"),
    "sessions_end": figure("end", "sessions", "cellmesh_proxy_sessions"),
    "sessions_peak": state_stat("end", "sessions_peak"),
    "kicks_by_reason": kicks,
    "processes_exited_unplanned": len(unplanned),
    "processes_exited_unplanned_list": unplanned,
    "sidecars_fenced_and_restarted": fenced_and_restarted,
    "played_s": int(env["LAB_PLAYED_S"]) if env.get("LAB_PLAYED_S") else None,
    "faults": faults,
    "faults_failed": [f["name"] for f in faults if f.get("recovered_s") is None or f.get("violations")],
    "checks_failed": [],
    # How the census keys above were read, and what else it saw (docker/lab/README.md).
    "census": {k: v for k, v in census.items() if k not in census_keys},
})
# What a run must show, whatever its faults: nothing lost, doubled or dropped, no process gone
# unasked; with two geos, the RTT the proxies measured is the delay's (within 20%), and the
# travellers were handed over. A figure the lab could not read (null) fails too.
checks = summary["checks_failed"]
for k in ("entities_lost", "entities_duplicated", "accounts_with_two_avatars", "sessions_without_avatar",
          "sessions_dropped", "processes_exited_unplanned"):
    if summary.get(k) != 0:
        checks.append(f"{k} is {summary.get(k)}, not 0")
if env["LAB_BUBBLES"] == "1":
    try:
        b = json.load(open(os.path.join(run, "bubbles.json")))
    except (OSError, ValueError):
        b = {}
    summary["bubbles"] = b
    before, after = b.get("click_to_screen_ms_p50_before"), b.get("click_to_screen_ms_p50_after")
    if not b.get("bubble_moves"):
        checks.append(f"bubble_moves is {b.get('bubble_moves')}: the gathering's regions never moved")
    elif before is None or after is None or 2 * after > before:
        checks.append(f"click to screen p50 after the move {after} ms is not at most half of before ({before} ms)")
if summary["geos"] == 2:
    want, rtt = 2 * summary["delay_ms_one_way"], summary.get("inter_geo_rtt_ms_p50")
    if rtt is None or abs(rtt - want) > 0.2 * want:
        checks.append(f"inter_geo_rtt_ms_p50 is {rtt}, not within 20% of {want}")
    if summary["bots"]["travellers"] > 0 and not summary.get("handovers"):
        checks.append(f"handovers is {summary.get('handovers')} with {summary['bots']['travellers']} travellers")
text = json.dumps(summary, indent=2)
for path in filter(None, (out, os.path.join(run, "summary.json"))):
    with open(path, "w") as f:
        f.write(text + "\n")
print(text)
PY
}

# ------------------------------------------------------------------------------------------------
# Teardown: containers, volumes, networks, qdiscs, iptables rules; idempotent, and run on every
# way out (EXIT after success or failure, INT, TERM).

teardown() {
    local ctr ctrs vols net rule table_chain leftover=0
    log "tearing down"
    # Every container's log, kept with the run's other results.
    if [[ -d ${run_dir:-} ]]; then
        mkdir -p "$run_dir/logs"
        for ctr in $(podman ps -a --filter "label=io.podman.compose.project=$project" --format '{{.Names}}'); do
            podman logs "$ctr" >"$run_dir/logs/$ctr.log" 2>&1 || true
        done
    fi
    if [[ -n ${sampler_pid:-} ]]; then
        kill "$sampler_pid" 2>/dev/null || true
        wait "$sampler_pid" 2>/dev/null || true
        sampler_pid=""
    fi
    # A fault may have left MongoDB paused: a paused container neither stops nor goes.
    for ctr in $(podman ps -q --filter "label=io.podman.compose.project=$project" --filter status=paused); do
        podman unpause "$ctr" >/dev/null 2>&1 || true
    done
    lab_compose --profile bots --profile monitoring down -v -t 5 >"$build_dir/teardown.log" 2>&1 || true
    # What podman-compose left (a container of an interrupted `up`, a volume in use at the time).
    ctrs=$(podman ps -aq --filter "label=io.podman.compose.project=$project")
    [[ -z $ctrs ]] || podman rm -f -t 2 $ctrs >/dev/null 2>&1 || true
    vols=$(podman volume ls -q --filter "label=io.podman.compose.project=$project")
    [[ -z $vols ]] || podman volume rm -f $vols >/dev/null 2>&1 || true
    for net in "${lab_networks[@]}"; do
        if podman network exists "$net"; then
            tc qdisc del dev "$(network_bridge "$net")" root 2>/dev/null || true
            podman network rm -f "$net" >/dev/null 2>&1 || true
        fi
    done
    local table chain
    for table_chain in nat:POSTROUTING filter:FORWARD; do
        table=${table_chain%:*} chain=${table_chain#*:}
        while rule=$(iptables -t "$table" -S "$chain" | grep -m1 -- "--comment $rule_comment"); do
            # shellcheck disable=SC2086 # the rule's words are iptables arguments
            iptables -t "$table" ${rule/-A $chain/-D $chain}
        done
    done
    remove_cut_chain
    # The delayer this run started, by its pid; with --queue-bypass gone first, nothing waits.
    if [[ -n $delayer_pid ]]; then
        kill "$delayer_pid" 2>/dev/null || true
        wait "$delayer_pid" 2>/dev/null || true
        delayer_pid=""
    fi
    # What is left, if anything, is said.
    [[ -z $(podman ps -aq --filter "label=io.podman.compose.project=$project") ]] || leftover=1
    [[ -z $(podman volume ls -q --filter "label=io.podman.compose.project=$project") ]] || leftover=1
    for net in "${lab_networks[@]}"; do ! podman network exists "$net" || leftover=1; done
    if ((leftover)); then log "teardown left something: podman ps -a / volume ls / network ls"; else log "teardown complete"; fi
}

on_exit() {
    local code=$?
    trap - EXIT INT TERM
    if ((keep && code == 0)); then
        log "kept running (--keep): scripts/lab.sh --geos $geos --down to take it down"
    else
        teardown
    fi
    exit "$code"
}

# ------------------------------------------------------------------------------------------------
# Main

ensure_host_packages
ensure_containers_conf
ensure_lab_venv
export CELLMESH_REDIS_IMAGE=$redis_image CELLMESH_MONGO_IMAGE=$mongo_image BOTS=$bots TRAVELLERS=$travellers
if ((down_only)); then
    teardown
    exit 0
fi
check_faults
ensure_images
((prepare_only)) && exit 0

# Secrets of this run for the proxies' tokens and the bots, and for the admin ports the census
# reads: nothing secret is written down.
CELLMESH_TOKEN_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
CELLMESH_ADMIN_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
export CELLMESH_TOKEN_SECRET CELLMESH_ADMIN_TOKEN

mkdir -p "$run_dir"
list_admin_services >"$run_dir/admin-services.txt"
[[ -s $run_dir/admin-services.txt ]] || die "no admin endpoint found in docker/$cluster.yaml (podman-compose config)"
list_services_json >"$run_dir/services.json" || die "reading the services of docker/$cluster.yaml failed"
teardown   # a lab an earlier run kept, or one it could not finish taking down
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "bringing up $cluster (run directory ${run_dir#"$repo"/})"
started=$SECONDS
bring_up
wait_all_ready
bring_up_s=$((SECONDS - started))
log "every sidecar and proxy ready in ${bring_up_s} s ($(podman ps -q --filter "label=io.podman.compose.project=$project" | wc -l) containers running)"

census targets
# Run directly (not through the census function), so that $! is the sampler itself.
/usr/bin/python3 docker/lab/census.py sample --run "$run_dir" --every 1 >"$run_dir/sampler.log" 2>&1 &
sampler_pid=$!

measure_rtts
# With faults the bots play until the lab stops them (SIGTERM, which ends them as --duration
# would); their --duration is then only a backstop, should the lab die and leave them running.
n_faults=$(plan_faults | wc -l)
export LAB_BOTS_DURATION_S=$((duration_s + n_faults * (2 * recovery_bound_s + 90)))
((n_faults > 0)) || LAB_BOTS_DURATION_S=$duration_s
start_bots
bots_t0=$(now)
# One second at a time; the proxies are sampled every 5 s (and census.py samples every process
# every second meanwhile). Each fault starts at its second, or settle_s after the one before
# recovered, whichever is later; the run lasts --duration, or until the last fault is over.
next_sample=0
tick() {
    if (($(elapsed) >= next_sample)); then
        sample_proxies "s$(printf '%03d' "$next_sample")"
        next_sample=$((next_sample + 5))
    fi
    in_background sleep 1
}
ready_at=0
mapfile -t plan < <(plan_faults | sort -n -s -k1,1)
for line in "${plan[@]}"; do
    read -r at name arg <<<"$line"
    while (($(elapsed) < at || $(elapsed) < ready_at)); do tick; done
    # shellcheck disable=SC2086 # no argument when there is none
    "fault_${name//-/_}" $arg </dev/null
    ready_at=$(($(elapsed) + settle_s))
done
while (($(elapsed) < duration_s)); do tick; done
played_s=$(elapsed)
log "the bots played ${played_s} s; the census before they leave"
for i in 1 2 3; do
    census snap --out "$run_dir/end-before-logout-$i.json" --label "before logout"
    ((i == 3)) || in_background sleep 1
done
sample_proxies end
collect_far_rtts
stop_bots
write_bubbles
census wait --until loggedout --bound 20 --out "$run_dir/wait-loggedout.json" 2>>"$run_dir/sampler.log" || true
census snap --out "$run_dir/end.json" --label end
kill "$sampler_pid" 2>/dev/null || true
wait "$sampler_pid" 2>/dev/null || true
sampler_pid=""
write_census
write_summary
failed=$(/usr/bin/python3 -c 'import json, sys
print(" ".join(json.loads(l)["name"] for l in open(sys.argv[1]) if json.loads(l).get("recovered_s") is None or json.loads(l).get("violations")))' \
    "$run_dir/faults.jsonl" 2>/dev/null || true)
checks_failed=$(/usr/bin/python3 -c 'import json, sys
print("; ".join(json.load(open(sys.argv[1])).get("checks_failed", ["no summary"])))' "$run_dir/summary.json" 2>/dev/null ||
    echo "no summary")
if [[ -n $failed ]]; then
    log "faults that did not recover or broke what must hold: $failed"
fi
if [[ -n $checks_failed ]]; then
    log "the run broke what must hold: $checks_failed"
fi
[[ -z $failed && -z $checks_failed ]] || exit 1
