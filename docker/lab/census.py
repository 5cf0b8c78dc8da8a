#!/usr/bin/env python3
"""The lab's eyes: what the real processes of a lab run expose, read from the host.

scripts/lab.sh runs it; nothing here changes the cluster but `wait` restarting a game whose
sidecar the engine restarted (as compose's `restart: true` would). The host reaches every
container at its address on the lab's networks; each process is asked on its admin port:

  sidecars  /ready, /state (lease, peers, handoffs, masters, sessions), /api/node-map (every real
            entity with its kind, up to 2,000 a node), /metrics (cellmesh_sidecar_*)
  proxies   /ready, /state (sessions with their gateway node, stats), /metrics (cellmesh_proxy_*)

Subcommands (all take --run DIR, the run directory, which holds targets.json):

  targets   write targets.json from services.json and the containers' addresses
  sample    every --every seconds, append a snapshot to samples.jsonl (metrics every 5th) until
            killed
  snap      one snapshot with metrics, to --out and appended to samples.jsonl
  wait      poll until a condition holds (whole, restored, frozen) or --bound seconds passed;
            write what it saw to --out; exit 0 if it held, 1 if not
  cost      what a fault cost: --before and --after snapshots (and the wait results)
  final     the run's census from samples.jsonl, the final snapshots and the bots' logs

Standard library only: it runs with the host's python3.
"""

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

HTTP_TIMEOUT_S = 2.0
# Straight to the containers: never through a proxy the host's environment may name.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# The admin ports' bearer token of the run (scripts/lab.sh makes one and gives it to every process).
ADMIN_TOKEN = os.environ.get("CELLMESH_ADMIN_TOKEN", "")


# ------------------------------------------------------------------------------------------------
# Reading the processes


def http(ip, port, path, timeout=HTTP_TIMEOUT_S):
    """(status, body) of GET path; (None, None) when nothing answered."""
    try:
        req = urllib.request.Request(f"http://{ip}:{port}{path}")
        if ADMIN_TOKEN:
            req.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
        with OPENER.open(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return None, None


def parse_metrics(text, prefix):
    """{series: value} of one /metrics page, without histogram buckets."""
    out = {}
    for line in text.splitlines():
        if not line.startswith(prefix) or "_bucket{" in line:
            continue
        series, _, value = line.rpartition(" ")
        try:
            out[series] = float(value)
        except ValueError:
            pass
    return out


def load_targets(run):
    with open(os.path.join(run, "targets.json")) as f:
        return json.load(f)


def read_sidecar(t, metrics):
    out = {"node": t["node"], "geo": t["geo"], "ready": None, "state": None, "map": None}
    # A process that does not answer /ready within a second (killed, its address gone) is not
    # asked the rest: a snapshot stays short while a node is down.
    code, _ = http(t["ip"], t["port"], "/ready", timeout=1.0)
    out["ready"] = None if code is None else code == 200
    if code is None:
        return out
    code, body = http(t["ip"], t["port"], "/state")
    if code == 200:
        try:
            s = json.loads(body)
            out["state"] = {
                "node_id": s.get("node_id"),
                "ready": s.get("ready"),
                "lease_live": s.get("lease_live"),
                "lease_lost": s.get("lease_lost"),
                "game_connected": s.get("game_connected"),
                "draining": s.get("draining"),
                "partition_epoch": s.get("partition_epoch"),
                "reals": s.get("reals"),
                "peers": [{"node": p.get("node"), "up": p.get("up")} for p in s.get("peers") or []],
                "handoffs_in_flight": s.get("handoffs_in_flight"),
                "in_doubt": [d.get("entity") for d in s.get("handoffs_in_doubt") or []],
                "masters": s.get("masters") or [],
                "sessions": [x.get("account") for x in s.get("sessions") or []],
                # The gateway's sessions: account -> the id of its avatar (None: none known here).
                "session_masters": {x.get("account"): x.get("master_id") for x in s.get("sessions") or []},
                "inputs_held": s.get("inputs_held"),
            }
        except ValueError:
            pass
    code, body = http(t["ip"], t["port"], "/api/node-map")
    if code == 200:
        try:
            m = json.loads(body)
            kinds = {}
            for e in m.get("entities") or []:
                kinds.setdefault(e.get("kind"), []).append(e.get("id"))
            out["map"] = {"total": m.get("entities_total"), "complete": len(m.get("entities") or []) == m.get("entities_total"), "ids": kinds}
        except ValueError:
            pass
    if metrics:
        code, body = http(t["ip"], t["port"], "/metrics")
        out["metrics"] = parse_metrics(body.decode(errors="replace"), "cellmesh_sidecar_") if code == 200 else None
    return out


def read_proxy(t, metrics):
    out = {"geo": t["geo"], "ready": None, "state": None}
    code, _ = http(t["ip"], t["port"], "/ready", timeout=1.0)
    out["ready"] = None if code is None else code == 200
    if code is None:
        return out
    code, body = http(t["ip"], t["port"], "/state")
    if code == 200:
        try:
            s = json.loads(body)
            out["state"] = {
                "sessions": [{"account": x.get("account"), "gateway_node": x.get("gateway_node"), "simulated_in": x.get("simulated_in"), "fallback": x.get("fallback")} for x in s.get("sessions") or []],
                "links": [{"gateway": l.get("gateway"), "state": l.get("state"), "sessions": l.get("sessions")} for l in s.get("links") or []],
                "stats": s.get("stats") or {},
            }
        except ValueError:
            pass
    if metrics:
        code, body = http(t["ip"], t["port"], "/metrics")
        out["metrics"] = parse_metrics(body.decode(errors="replace"), "cellmesh_proxy_") if code == 200 else None
    return out


POOL = concurrent.futures.ThreadPoolExecutor(max_workers=16)
# Errors of a sidecar's stores (its Redis, MongoDB): a world still counting them is not whole.
STORE_ERRORS = ("store", "checkpoint_write")


def snapshot(run, metrics=False, label=None):
    targets = load_targets(run)
    t0 = time.time()
    futs = {}
    for t in targets:
        if t["role"] == "sidecar":
            futs[t["svc"]] = ("sidecars", POOL.submit(read_sidecar, t, metrics))
        elif t["role"] == "proxy":
            futs[t["svc"]] = ("proxies", POOL.submit(read_proxy, t, metrics))
    snap = {"t": round((t0 + time.time()) / 2, 3), "sidecars": {}, "proxies": {}}
    if label:
        snap["label"] = label
    for svc, (kind, fut) in futs.items():
        snap[kind][svc] = fut.result()
    return snap


def append_sample(run, snap):
    line = (json.dumps(snap, separators=(",", ":")) + "\n").encode()
    fd = os.open(os.path.join(run, "samples.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_samples(run):
    out = []
    try:
        with open(os.path.join(run, "samples.jsonl")) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    out.sort(key=lambda s: s["t"])
    return out


# ------------------------------------------------------------------------------------------------
# What a snapshot says


def complete(snap):
    """Every sidecar answered /state and /api/node-map."""
    return all(s["state"] is not None and s["map"] is not None for s in snap["sidecars"].values())


def reals(snap):
    """{entity id: [(node, kind)]} of every real on a node that answered."""
    out = {}
    for s in snap["sidecars"].values():
        if s["map"] is None:
            continue
        for kind, ids in s["map"]["ids"].items():
            for i in ids:
                out.setdefault(i, []).append((s["node"], kind))
    return out


def npc_ids(snap):
    return {i for i, held in reals(snap).items() if any(k == "npc" for _, k in held)}


def node_ids(snap, node):
    for s in snap["sidecars"].values():
        if s["node"] == node and s["map"] is not None:
            return {i for ids in s["map"]["ids"].values() for i in ids}
    return set()


def written_twice(snap):
    """Ids real on two nodes whose leases are live, not in doubt at any node."""
    doubt = set()
    for s in snap["sidecars"].values():
        if s["state"]:
            doubt.update(s["state"]["in_doubt"])
    holders = {}
    for s in snap["sidecars"].values():
        if s["map"] is None or not (s["state"] and s["state"]["lease_live"]):
            continue
        for ids in s["map"]["ids"].values():
            for i in ids:
                holders.setdefault(i, set()).add(s["node"])
    return {i for i, nodes in holders.items() if len(nodes) > 1 and i not in doubt}


def masters_twice(snap):
    """Accounts whose avatar two nodes write."""
    seen = {}
    for s in snap["sidecars"].values():
        if s["state"]:
            for a in s["state"]["masters"]:
                seen.setdefault(a, set()).add(s["node"])
    return {a for a, n in seen.items() if len(n) > 1}


def sessions_of(snap):
    return {x["account"] for p in snap["proxies"].values() if p["state"] for x in p["state"]["sessions"]}


def masters(snap):
    return {a for s in snap["sidecars"].values() if s["state"] for a in s["state"]["masters"]}


def avatar_count(snap):
    return sum(len(s["map"]["ids"].get("avatar", [])) for s in snap["sidecars"].values() if s["map"])


def proxy_stat(snap, key):
    vals = [p["state"]["stats"].get(key) for p in snap["proxies"].values() if p["state"]]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return sum(vals) if vals else None


def gateway_sessions(snap):
    """{node id: sessions} the proxies have on each gateway node."""
    out = {}
    for p in snap["proxies"].values():
        if p["state"]:
            for x in p["state"]["sessions"]:
                if x.get("gateway_node") is not None:
                    out[x["gateway_node"]] = out.get(x["gateway_node"], 0) + 1
    return out


def not_whole(snap):
    """Why the world is not whole in this snapshot (empty: it is whole)."""
    why = []
    nodes = {s["node"] for s in snap["sidecars"].values()}
    for svc, s in sorted(snap["sidecars"].items()):
        st = s["state"]
        if s["ready"] is not True:
            why.append(f"{svc} not ready")
        if st is None:
            why.append(f"{svc} /state unanswered")
            continue
        if s["map"] is None:
            why.append(f"{svc} /api/node-map unanswered")
        if st["lease_live"] is not True:
            why.append(f"{svc} lease not live")
        up = {p["node"] for p in st["peers"] if p["up"]}
        missing = nodes - {s["node"]} - up
        if missing:
            why.append(f"{svc} not linked to node(s) {sorted(missing)}")
        if st["handoffs_in_flight"]:
            why.append(f"{svc} {st['handoffs_in_flight']} handoff(s) in flight")
        if st["in_doubt"]:
            why.append(f"{svc} {len(st['in_doubt'])} handoff(s) in doubt")
    for svc, p in sorted(snap["proxies"].items()):
        if p["ready"] is not True:
            why.append(f"{svc} not ready")
    return why


# ------------------------------------------------------------------------------------------------
# Containers


def podman(*args):
    r = subprocess.run(["podman", *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def started_at(container):
    return podman("inspect", "--format", "{{.State.StartedAt}}", container)


def write_targets(run):
    with open(os.path.join(run, "services.json")) as f:
        services = json.load(f)
    targets = []
    for svc, s in sorted(services.items()):
        if s.get("role") not in ("sidecar", "proxy"):
            continue
        ip = podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", s["container"])
        ip = (ip or "").split()
        targets.append({
            "svc": svc, "role": s["role"], "geo": s.get("geo"), "node": s.get("node"),
            "ip": ip[0] if ip else None, "port": s["port"], "container": s["container"],
            "game_container": s.get("game_container"),
        })
    tmp = os.path.join(run, "targets.json.tmp")
    with open(tmp, "w") as f:
        json.dump(targets, f, indent=1)
    os.replace(tmp, os.path.join(run, "targets.json"))
    # When each sidecar's container started: a later start the lab did not ask for is the
    # engine's restart, and its game must follow (wait --supervise).
    save_starts(run, {t["container"]: started_at(t["container"]) for t in targets if t["role"] == "sidecar"})


def load_starts(run):
    try:
        with open(os.path.join(run, "sidecar-starts.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save_starts(run, starts):
    tmp = os.path.join(run, "sidecar-starts.json.tmp")
    with open(tmp, "w") as f:
        json.dump(starts, f)
    os.replace(tmp, os.path.join(run, "sidecar-starts.json"))


# ------------------------------------------------------------------------------------------------
# Waiting for a condition


def cmd_wait(a):
    """Polls every half second. Conditions:

    whole     the world is whole (not_whole is empty, and no sidecar counted a store error in the
              last 2 s: cellmesh_sidecar_errors_total kind store or checkpoint_write), and stays
              so (but handoffs in flight or in doubt, which come and go) for --stable seconds
              (6): the recovery is when it began to; with --need FILE (a JSON list of
              entity ids), every one of those ids is real on some node; ids still missing once
              the rest held for --grace seconds are reported lost and the wait ends there
    restored  every id of --need is real on a node other than the --victim ones (the killed nodes;
              repeat it for several)
    frozen    every sidecar's lease is not live (the store stopped answering)
    loggedout no avatar in the world (every sidecar answered)
    never     nothing: samples (with --record) for --bound seconds

    What it saw goes to --out: whether it held and when, the first sighting of each needed id
    (restored), the seconds some process was not ready, the fewest proxy sessions.
    """
    deadline = time.time() + a.bound
    need = set(json.load(open(a.need))) if a.need else set()
    since = a.since or time.time()
    seen_at = {}
    structural_since = None
    whole_at = None
    unready_s, last_t, fewest_sessions = 0.0, None, None
    games_restarted = []
    next_supervise = 0.0
    why = ["no sample"]
    held_at = None
    lost = []
    samples = 0
    store_errors = {}
    while True:
        # A whole world writes to its stores: the sidecars' store errors are read every time.
        snap = snapshot(a.run, metrics=(a.until == "whole"))
        samples += 1
        t = snap["t"]
        if a.record:
            append_sample(a.run, snap)
        nw = not_whole(snap)
        if last_t is not None and any("not ready" in w for w in nw):
            unready_s += t - last_t
        last_t = t
        s = proxy_stat(snap, "sessions")
        if s is not None:
            fewest_sessions = s if fewest_sessions is None else min(fewest_sessions, s)
        r = reals(snap)
        for i in need:
            if i in seen_at:
                continue
            holders = [n for n, _ in r.get(i, [])]
            if holders and any(n not in (a.victim or []) for n in holders):
                seen_at[i] = t
        missing = need - set(seen_at)
        if a.until == "whole":
            for svc, x in snap["sidecars"].items():
                m = x.get("metrics")
                if not m:
                    continue
                n = sum(v for k, v in m.items() if k.startswith("cellmesh_sidecar_errors_total{") and any(f'kind="{kind}"' in k for kind in STORE_ERRORS))
                # (count, when it last went up); a count that went down is a new process.
                prev = store_errors.get(svc)
                store_errors[svc] = (n, t if prev is not None and n > prev[0] else (prev[1] if prev else None))
                if store_errors[svc][1] is not None and t - store_errors[svc][1] < 2:
                    nw.append(f"{svc} store errors in the last 2 s")
            short = a.min_sessions is not None and (s or 0) < a.min_sessions
            nw = nw + ([f"{s} proxy sessions, fewer than {a.min_sessions}"] if short else [])
            why = nw + ([f"{len(missing)} needed entities held nowhere"] if missing else [])
            # Handoffs in flight or in doubt come and go with play: they must be none in one
            # sample; the rest must hold from then on for --stable seconds (a store's client
            # may count its errors only at its timeout, seconds after the store went away).
            steady = [w for w in nw if "handoff(s) in" not in w]
            if steady:
                structural_since = whole_at = None
            else:
                structural_since = structural_since or t
                if not why and whole_at is None:
                    whole_at = t
            if whole_at is not None and t - whole_at >= a.stable:
                held_at = whole_at
            elif whole_at is None and not steady and missing and t - structural_since >= a.grace:
                held_at, lost = structural_since, sorted(missing)
        elif a.until == "restored":
            why = [f"{len(missing)} of the victim's entities held by no live node"] if missing else []
            if not missing:
                held_at = t
        elif a.until == "loggedout":
            n = avatar_count(snap)
            why = ["not every sidecar answered"] if not complete(snap) else ([f"{n} avatars in the world"] if n else [])
            if not why:
                held_at = t
        elif a.until == "never":
            why = ["observing"]
        elif a.until == "frozen":
            live = [svc for svc, x in snap["sidecars"].items() if not (x["state"] and x["state"]["lease_live"] is False)]
            why = [f"{svc} lease still live" for svc in live]
            if not live:
                held_at = t
        # The supervisor's part: a game whose sidecar the engine restarted is restarted too.
        if a.supervise and time.time() >= next_supervise:
            next_supervise = time.time() + 2
            starts = load_starts(a.run)
            for tg in load_targets(a.run):
                if tg["role"] != "sidecar" or not tg.get("game_container"):
                    continue
                sc = started_at(tg["container"])
                if sc is None:
                    continue
                before = starts.setdefault(tg["container"], sc)
                if sc != before:
                    starts[tg["container"]] = sc
                    podman("restart", "-t", "2", tg["game_container"])
                    games_restarted.append({"game": tg["game_container"], "at": round(time.time(), 3)})
            save_starts(a.run, starts)
        if held_at is not None or (time.time() >= deadline and whole_at is None):
            break
        time.sleep(max(0.0, 0.5 - (time.time() - t)))
    result = {
        "until": a.until,
        "held": held_at is not None,
        "at": held_at,
        "since": since,
        "after_s": None if held_at is None else round(held_at - since, 3),
        "why_not": [] if held_at is not None else why[:12],
        "unready_s": round(unready_s, 1),
        "fewest_sessions": fewest_sessions,
        "samples": samples,
        "games_restarted": games_restarted,
    }
    if need:
        result["needed"] = len(need)
        result["first_seen_ms"] = sorted(round((v - since) * 1000) for v in seen_at.values())
        result["never_seen"] = sorted(need - set(seen_at))
    if lost:
        result["lost"] = lost
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f)
    print(json.dumps({k: result[k] for k in ("until", "held", "after_s", "why_not")}), file=sys.stderr)
    return 0 if held_at is not None else 1


# ------------------------------------------------------------------------------------------------
# Choosing a victim


def cmd_pick(a):
    """The sidecar a fault kills, from a snapshot: `node`, the one of --geo that is no gateway of
    any session and holds the most entities (failing that, the one with the fewest sessions);
    `gateway`, the gateway of the most sessions (in --geo if given)."""
    snap = json.load(open(a.snap))
    gw = gateway_sessions(snap)
    cands = [(svc, s) for svc, s in snap["sidecars"].items() if a.geo in (None, "", s["geo"]) and s["state"]]
    if not cands:
        return 1
    if a.kind == "node":
        best = max(cands, key=lambda c: (gw.get(c[1]["node"], 0) == 0, -gw.get(c[1]["node"], 0), c[1]["state"]["reals"] or 0, c[0]))
    else:
        best = max(cands, key=lambda c: (gw.get(c[1]["node"], 0), c[0]))
        if gw.get(best[1]["node"], 0) == 0:
            return 1
    print(best[0], best[1]["node"], gw.get(best[1]["node"], 0))
    return 0


def cmd_ids(a):
    """Entity ids of a snapshot, as a JSON list: the NPCs of the --node ones (repeat it for
    several), or of every node."""
    snap = json.load(open(a.snap))
    if a.node:
        ids = [i for s in snap["sidecars"].values() if s["node"] in a.node and s["map"] for i in s["map"]["ids"].get("npc", [])]
    else:
        ids = sorted(npc_ids(snap))
    print(json.dumps(sorted(ids)))
    return 0


def cmd_avatars(a):
    """Did the bots find their avatar: each account with a session before, against after (the
    avatar's id as its gateway knows it)."""
    def ids(snap):
        out = {}
        for s in snap["sidecars"].values():
            if s["state"]:
                for acct, mid in (s["state"].get("session_masters") or {}).items():
                    if mid is not None:
                        out[acct] = mid
        return out
    def geos(snap, key):
        # account -> the geo of the node listing it under `key` (session_masters: its gateway;
        # masters: the node writing its avatar).
        out = {}
        for s in snap["sidecars"].values():
            for acct in (s["state"] or {}).get(key) or []:
                out[acct] = s.get("geo")
        return out
    before = json.load(open(a.before))
    b, after = ids(before), ids(json.load(open(a.after)))
    gateway_geo, owner_geo = geos(before, "session_masters"), geos(before, "masters")
    kept = sum(1 for k, v in b.items() if after.get(k) == v)
    replaced = sorted(k for k, v in b.items() if k in after and after[k] != v)
    # A bridged player's avatar written in another geo than its gateway's: that geo's directory
    # holds its master record, the new gateway's does not (the cross-geo avatar rule is not
    # built yet), so the new gateway spawns another.
    across = [k for k in replaced if owner_geo.get(k) and gateway_geo.get(k) and owner_geo[k] != gateway_geo[k]]
    print(json.dumps({"avatars_kept": kept, "avatars_replaced": len(replaced),
                      "avatars_replaced_across_geos": len(across), "avatars_replaced_ids": replaced,
                      "avatars_not_found": len(b) - kept - len(replaced)}))
    return 0


# ------------------------------------------------------------------------------------------------
# Counters over a run: processes restart, and their counters with them


def counter_totals(samples, kind, prefix):
    """{series: total} over the run for each counter series (name ending _total) of every process
    of `kind` (sidecars or proxies): increments summed, a process whose counters went down
    restarted and its new values count from zero."""
    last = {}
    total = {}
    for snap in samples:
        for svc, x in snap[kind].items():
            m = x.get("metrics")
            if not m:
                continue
            prev = last.get(svc)
            # A restart starts every counter again from zero: one that fell to under half of what
            # it was (from 10 or more). Two readings taken by different samplers can also arrive
            # a few counts out of order; that is no restart, and the higher reading stays the base.
            restarted = prev is not None and any(
                k in m and v >= 10 and m[k] < v / 2 for k, v in prev.items() if k.endswith("_total")
            )
            for k, v in m.items():
                if not k.startswith(prefix) or "_total" not in k:
                    continue
                base = 0.0 if (prev is None or restarted) else prev.get(k, 0.0)
                total[k] = total.get(k, 0.0) + max(0.0, v - base)
            if prev is None or restarted:
                last[svc] = m
            else:
                last[svc] = {k: max(v, prev.get(k, v)) if isinstance(v, (int, float)) else v for k, v in m.items()}
    return total


def by_label(totals, name, label):
    out = {}
    for k, v in totals.items():
        if k == name or k.startswith(name + "{"):
            m = re.search(label + r'="([^"]*)"', k)
            key = m.group(1) if m else ""
            out[key] = out.get(key, 0) + v
    return out


def metric_delta(before, after, kind, name, label=None):
    """Sum over processes of after - before of a counter (a process restarted between: its after
    value); by label value when `label` is given."""
    out = {}
    for svc, a in after[kind].items():
        am = a.get("metrics") or {}
        bm = (before[kind].get(svc) or {}).get("metrics") or {}
        for k, v in am.items():
            if not (k == name or k.startswith(name + "{")):
                continue
            b = bm.get(k, 0.0)
            d = v - b if v >= b else v
            key = ""
            if label:
                m = re.search(label + r'="([^"]*)"', k)
                key = m.group(1) if m else ""
            out[key] = out.get(key, 0) + d
    if label:
        return {k: int(v) for k, v in out.items() if v}
    return int(out.get("", 0))


# ------------------------------------------------------------------------------------------------
# A fault's cost


def cmd_cost(a):
    before = json.load(open(a.before))
    settled = [json.load(open(p)) for p in a.after]
    after = settled[-1]
    waits = [json.load(open(w)) for w in a.wait or [] if os.path.exists(w)]
    fewest = [w["fewest_sessions"] for w in waits if w.get("fewest_sessions") is not None]
    # Held in every snapshot taken after the recovery (a second apart): not a handoff's instant.
    def every(fn):
        return set.intersection(*(set(fn(s)) for s in settled))
    npcs_b, npcs_a = npc_ids(before), npc_ids(after)
    # Real on no node in any snapshot after the recovery. One snapshot alone is not evidence: its
    # nodes answer a few milliseconds apart, and an NPC handed from a node not yet asked to one
    # already asked is real on none of them there.
    whole = [s for s in settled if complete(s)]
    lost = sorted(npcs_b - set().union(*(npc_ids(s) for s in whole))) if whole else None
    cost = {
        "sessions_before": proxy_stat(before, "sessions"),
        "sessions_fewest": min(fewest) if fewest else None,
        "sessions_after": proxy_stat(after, "sessions"),
        "npcs_before": len(npcs_b),
        "npcs_after": len(npcs_a),
        "avatars_before": avatar_count(before),
        "avatars_after": avatar_count(after),
        "entities_lost": None if lost is None else len(lost),
        "entities_written_twice_after": len(every(written_twice)),
        "accounts_with_two_avatars_after": len(every(masters_twice)),
        "sessions_without_avatar_after": len(every(lambda s: sessions_of(s) - masters(s))),
        "not_ready_s": round(sum(w.get("unready_s", 0) for w in waits), 1),
        "kicks": metric_delta(before, after, "proxies", "cellmesh_proxy_kicks_total", "reason"),
        "sessions_moved": metric_delta(before, after, "proxies", "cellmesh_proxy_sessions_moved_total"),
        "sessions_reregistered": metric_delta(before, after, "sidecars", "cellmesh_sidecar_sessions_reregistered_total"),
        "leases_reclaimed": metric_delta(before, after, "sidecars", "cellmesh_sidecar_leases_reclaimed_total"),
        "leases_fenced": metric_delta(before, after, "sidecars", "cellmesh_sidecar_leases_fenced_total"),
        "handoffs_restored": metric_delta(before, after, "sidecars", "cellmesh_sidecar_handoffs_total", "outcome").get("restored", 0),
        "sidecar_errors": metric_delta(before, after, "sidecars", "cellmesh_sidecar_errors_total", "kind"),
        "games_restarted_by_lab": [g["game"] for w in waits for g in w.get("games_restarted", [])],
    }
    if lost:
        cost["entities_lost_ids"] = lost[:50]
    print(json.dumps(cost))
    return 0


# ------------------------------------------------------------------------------------------------
# Bubbles


def director_states(run):
    """Each director's /state (its DirectorStats), by service; None for one that did not answer."""
    with open(os.path.join(run, "services.json")) as f:
        services = json.load(f)
    out = {}
    for svc, s in sorted(services.items()):
        if s.get("role") != "director":
            continue
        ip = (podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", s["container"]) or "").split()
        code, body = http(ip[0], s["port"], "/state") if ip and s.get("port") else (None, None)
        try:
            out[svc] = json.loads(body) if code == 200 else None
        except ValueError:
            out[svc] = None
    return out


def bots_click_to_screen(paths):
    """Every bot process's seconds of click to screen as (Unix s, p50 ms, samples), from the
    `click_to_screen` of its final JSON."""
    out = []
    for found in bots_final_json(paths):
        c = found.get("click_to_screen")
        if c:
            origin = c["origin_unix_ms"] / 1000.0
            out += [(origin + t, p50, n) for t, p50, n in c["seconds"]]
    return out


def weighted_median(seconds):
    """The median of the seconds' medians, each weighted by its samples: (ms, samples)."""
    seconds = sorted(seconds, key=lambda s: s[1])
    total = sum(n for _, _, n in seconds)
    if not total:
        return None, 0
    acc = 0
    for _, p50, n in seconds:
        acc += n
        if 2 * acc >= total:
            return p50, total
    return seconds[-1][1], total


def cmd_bubbles(a):
    """What the geo-aware director moved, and the bots' click to screen on either side of the
    first move of a region to the second geo (us): before it, and from --settle seconds after
    it until --until (an outage's start)."""
    states = director_states(a.run)
    live = [s for s in states.values() if s]
    moves = sorted(
        ((r["at_unix_ms"] / 1000.0, r["epoch"], m)
         for s in live for r in s.get("region_moves") or [] for m in r.get("moves") or []),
        key=lambda x: (x[0], x[1], tuple(x[2].get("region") or ())))
    to_second = [t for t, _, m in moves if m.get("to_site") == 1]
    moved_at = to_second[0] if to_second else None
    seconds = bots_click_to_screen(a.bots_log or [])
    until = a.until if a.until is not None else float("inf")
    before = weighted_median([s for s in seconds if moved_at is None or s[0] < moved_at])
    after = weighted_median([s for s in seconds if moved_at is not None and moved_at + a.settle <= s[0] < until])
    print(json.dumps({
        "bubble_moves": max((s.get("bubble_moves", 0) for s in live), default=None),
        "regions_moved": max((s.get("regions_moved", 0) for s in live), default=None),
        "region_moves": [{"at_unix_s": t, "epoch": e, **m} for t, e, m in moves],
        "bubble_moved_at_unix_s": moved_at,
        "click_to_screen_ms_p50_before": before[0],
        "click_to_screen_samples_before": before[1],
        "click_to_screen_ms_p50_after": after[0],
        "click_to_screen_samples_after": after[1],
        "directors_answered": len(live),
    }))
    return 0


# ------------------------------------------------------------------------------------------------
# The run's census


def pct(values, q):
    v = sorted(values)
    if not v:
        return None
    return v[min(len(v) - 1, int(round((len(v) - 1) * q)))]


def persistent(samples, fn, runs=3):
    """Values fn(sample) returns in `runs` consecutive samples (thinned to about one a second; at
    least 2 s from the first to the last). Positive evidence only: a process that did not answer
    adds nothing."""
    out = set()
    window = []
    last_t = None
    for s in samples:
        if last_t is not None and s["t"] - last_t < 0.9:
            continue
        last_t = s["t"]
        window.append((s["t"], fn(s)))
        window = window[-runs:]
        if len(window) == runs and window[-1][0] - window[0][0] >= min(2, runs - 1):
            common = set.intersection(*(set(w[1]) for w in window))
            out |= common
    return out


def bots_final_json(paths):
    """Each bots log's final JSON (the last pretty-printed JSON object in it)."""
    for p in paths:
        try:
            text = open(p, errors="replace").read()
        except FileNotFoundError:
            continue
        found = None
        for m in re.finditer(r"^\{\n(?:.*\n)*?\}$", text, re.M):
            try:
                found = json.loads(m.group(0))
            except ValueError:
                pass
        if found is not None:
            yield found


def bots_totals(paths):
    """The bots' final JSON (the last JSON object in each log), summed; None without any."""
    total, n = {}, 0
    for found in bots_final_json(paths):
        n += 1
        for k, v in found.items():
            if isinstance(v, (int, float)):
                total[k] = total.get(k, 0) + v
    return total if n else None, n


def cmd_final(a):
    samples = read_samples(a.run)
    before_logout = [json.load(open(p)) for p in a.before_logout or [] if os.path.exists(p)]
    end = [json.load(open(p)) for p in a.end or [] if os.path.exists(p)]
    bots, bots_n = bots_totals(a.bots_log or [])
    sidecar_totals = counter_totals(samples, "sidecars", "cellmesh_sidecar_")
    errors_by_kind = {f"sidecar_{k}": int(v) for k, v in by_label(sidecar_totals, "cellmesh_sidecar_errors_total", "kind").items() if v}
    if bots is not None and bots.get("errors"):
        errors_by_kind["bots_lost_session"] = int(bots["errors"])
    delivered = sum(v for k, v in sidecar_totals.items() if k.startswith("cellmesh_sidecar_inputs_delivered_total"))
    have_metrics = any(x.get("metrics") for s in samples for x in s["sidecars"].values())

    # Entities: every NPC seen in two consecutive complete samples, against the last three
    # complete snapshots (wanderers are never despawned by the arena): lost is real in none of
    # them, as a handoff between two nodes asked a few milliseconds apart can hide an NPC from one.
    seen_npcs = persistent(samples, npc_ids, runs=2) if samples else set()
    whole = [s for s in before_logout + end if complete(s)][-3:]
    lost = sorted(seen_npcs - set().union(*(npc_ids(s) for s in whole))) if whole else None
    last = whole[-1] if whole else None
    twice = persistent(samples, written_twice)
    restore_ms = []
    if a.restore_ms and os.path.exists(a.restore_ms):
        restore_ms = [float(x) for x in open(a.restore_ms) if x.strip()]
    bl_complete = [s for s in before_logout if complete(s)]
    census = {
        "inputs_sent": None if bots is None else int(bots.get("inputs_sent", 0)),
        "inputs_delivered": int(delivered) if have_metrics else None,
        "entities_lost": None if lost is None else len(lost),
        "entities_duplicated": len(twice) if samples else None,
        "accounts_with_two_avatars": len(set.intersection(*(masters_twice(s) for s in bl_complete))) if len(bl_complete) >= 2 else None,
        "sessions_without_avatar": len(set.intersection(*(sessions_of(s) - masters(s) for s in bl_complete))) if len(bl_complete) >= 2 else None,
        "avatars_after_logout": avatar_count(end[-1]) if end and complete(end[-1]) and bots_n else None,
        # A session whose connection broke is dropped only if the bot's next session did not
        # find the avatar it had (a killed proxy breaks connections, not sessions).
        "sessions_dropped": None if bots is None else int(bots.get("sessions_dropped", bots.get("errors", 0))),
        "restore_ms_p99": pct(restore_ms, 0.99),
        "errors": (int(sum(v for k, v in errors_by_kind.items() if k != "bots_lost_session")) + int(bots.get("errors", 0))) if (have_metrics and bots is not None) else None,
        "errors_by_kind": errors_by_kind if have_metrics else None,
        # Beside the keys of `cellmesh up`'s summary: how they were read.
        "restore_ms_p50": pct(restore_ms, 0.5),
        "entities_restored": len(restore_ms) if a.restore_ms and os.path.exists(a.restore_ms) else None,
        "entities_alive_end": None if last is None else len(reals(last)),
        "npcs_seen": len(seen_npcs),
        "entities_lost_ids": (lost or [])[:50],
        "entities_duplicated_ids": sorted(twice)[:50],
        "bots_totals": bots,
        "census_samples": len(samples),
    }
    print(json.dumps(census))
    return 0


# ------------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("targets", "sample", "snap", "wait", "cost", "final", "pick", "ids", "avatars", "bubbles"):
        s = sub.add_parser(name)
        s.add_argument("--run", required=True)
        if name == "pick":
            s.add_argument("--snap", required=True)
            s.add_argument("--kind", choices=["node", "gateway"], required=True)
            s.add_argument("--geo")
        if name == "ids":
            s.add_argument("--snap", required=True)
            s.add_argument("--node", type=int, action="append")
        if name == "avatars":
            s.add_argument("--before", required=True)
            s.add_argument("--after", required=True)
        if name == "sample":
            s.add_argument("--every", type=float, default=1.0)
        if name == "snap":
            s.add_argument("--out", required=True)
            s.add_argument("--label")
        if name == "wait":
            s.add_argument("--until", choices=["whole", "restored", "frozen", "loggedout", "never"], required=True)
            s.add_argument("--min-sessions", type=int, help="whole: also at least this many proxy sessions")
            s.add_argument("--bound", type=float, default=60)
            s.add_argument("--need")
            s.add_argument("--victim", type=int, action="append")
            s.add_argument("--since", type=float)
            s.add_argument("--grace", type=float, default=10)
            s.add_argument("--stable", type=float, default=6, help="whole: how long it must hold")
            s.add_argument("--out")
            s.add_argument("--record", action="store_true", help="append each sample to samples.jsonl")
            s.add_argument("--supervise", action="store_true", help="restart a game whose sidecar was restarted")
        if name == "cost":
            s.add_argument("--before", required=True)
            s.add_argument("--after", action="append", required=True)
            s.add_argument("--wait", action="append")
        if name == "bubbles":
            s.add_argument("--bots-log", action="append")
            s.add_argument("--until", type=float, help="cut the samples after the move here (Unix s)")
            s.add_argument("--settle", type=float, default=5.0)
        if name == "final":
            s.add_argument("--restore-ms")
            s.add_argument("--before-logout", action="append")
            s.add_argument("--end", action="append")
            s.add_argument("--bots-log", action="append")
    a = p.parse_args()
    if a.cmd == "targets":
        write_targets(a.run)
        return 0
    if a.cmd == "sample":
        n = 0
        while True:
            t = time.time()
            try:
                append_sample(a.run, snapshot(a.run, metrics=(n % 5 == 0)))
            except (OSError, ValueError) as e:
                print(f"census: sample failed: {e}", file=sys.stderr)
            n += 1
            time.sleep(max(0.0, a.every - (time.time() - t)))
    if a.cmd == "snap":
        snap = snapshot(a.run, metrics=True, label=a.label)
        with open(a.out, "w") as f:
            json.dump(snap, f)
        append_sample(a.run, snap)
        return 0
    if a.cmd == "wait":
        return cmd_wait(a)
    if a.cmd == "cost":
        return cmd_cost(a)
    if a.cmd == "final":
        return cmd_final(a)
    if a.cmd == "pick":
        return cmd_pick(a)
    if a.cmd == "ids":
        return cmd_ids(a)
    if a.cmd == "avatars":
        return cmd_avatars(a)
    if a.cmd == "bubbles":
        return cmd_bubbles(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
