//! Handoffs survive a sidecar process dying in the middle of them: two `cellmesh sidecar`
//! processes joined through the real MongoDB topology, an `arena` process beside each, and
//! SIGKILL for the source or the target while entities are in flight.
//!
//! Entities are counted through each sidecar's admin `/state` (`reals`: what the node writes),
//! so every scenario is laid out for counts to identify entities: the target's arena spawns
//! nothing (whatever it holds was handed to it), and the source's NPCs roam a square in the
//! target's area two chunks past the border (every one is handed over at its first step, and
//! never back). An id lives once in a node's table, so "the source holds none, the target holds
//! all" means each entity is held exactly once.
//!
//! To have entities in flight at the moment of the kill, the target's game is stopped (SIGSTOP)
//! first: the target accepts the offers and sends `Adopt`, which nobody answers, so the source
//! holds them in doubt.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use cellmesh_test_support::{
    admin_state, commit_plan, proxy_command, required, run_id, sidecar_command, unix_now,
    wait_ready, Process, ProxyProcess, SidecarProcess,
};
use support::CELLMESH;
use tokio::process::Command;
use tokio::time::Instant;

mod support;

/// The 2×1 grid of the default world (32 m chunks): node 1 owns x < 65 536 m, node 2 the rest.
/// A square of the target's chunk 2049, two chunks past node 1's area: the handoff margin is one.
const CROSSING: (f64, f64) = (65_588.0, 1000.0);
/// Well inside node 1's area: NPCs there stay home.
const HOME: (f64, f64) = (65_400.0, 1000.0);
const SPREAD: f64 = 20.0;
/// A node id's lease; a restarted node waits for its predecessor's to lapse.
const NODE_LEASE_MS: &str = "1500";
/// NPCs handed over before anything fails, and NPCs in flight when a sidecar dies.
const SETTLED: u64 = 4;
const IN_FLIGHT: u64 = 4;
const DEADLINE: Duration = Duration::from_secs(55);

/// One cluster at a time: sidecars starting together slow the MongoDB-compatible server down
/// enough for a lease this short to lapse before its first renewal.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The `arena` binary. Cargo builds only this package's binaries for its integration tests
/// (`CARGO_BIN_EXE_*`); the arena belongs to another package, so it is built into the same target
/// directory and profile (nothing to do after `cargo test --workspace`).
fn arena_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test's own path");
        // <target>/<profile>/deps/<test>
        let profile_dir = exe.parent().and_then(Path::parent).expect("a target dir");
        let target_dir = profile_dir.parent().expect("a target dir");
        let mut build =
            std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        build
            .args(["build", "--quiet", "-p", "cellmesh-arena", "--bin", "arena"])
            .arg("--target-dir")
            .arg(target_dir)
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        match profile_dir.file_name().and_then(|p| p.to_str()) {
            Some("debug") => {}
            Some("release") => {
                build.arg("--release");
            }
            Some(other) => {
                build.args(["--profile", other]);
            }
            None => panic!("no profile directory above {}", exe.display()),
        }
        let out = build.output().expect("running cargo to build the arena");
        assert!(
            out.status.success(),
            "building the arena failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        profile_dir.join(format!("arena{}", std::env::consts::EXE_SUFFIX))
    })
}

/// How a node's processes are started.
#[derive(Clone)]
struct Spec {
    node: u32,
    topology: String,
    /// The session directory and checkpoint store (`memory`: each process its own).
    directory: String,
    /// The node's state dir, kept across restarts as a host's disk is; `None`: each process one
    /// of its own, so a restart waits out the lease.
    state_dir: Option<PathBuf>,
    /// `None`: the default node lease.
    lease_ms: Option<&'static str>,
    /// `None`: the default geo.
    geo: Option<String>,
}

impl Spec {
    /// The short lease and a state dir per process, so a restart waits out the lease.
    fn waiting(node: u32, topology: &str, directory: &str) -> Self {
        Self {
            node,
            topology: topology.into(),
            directory: directory.into(),
            state_dir: None,
            lease_ms: Some(NODE_LEASE_MS),
            geo: None,
        }
    }

    fn command(&self) -> Command {
        let mut cmd = sidecar_command(CELLMESH);
        cmd.env("CELLMESH_NODE_ID", self.node.to_string())
            .env("CELLMESH_TOPOLOGY_URL", &self.topology)
            .env("CELLMESH_DIRECTORY_URL", &self.directory);
        if let Some(ms) = self.lease_ms {
            cmd.env("CELLMESH_NODE_LEASE_MS", ms);
        }
        if let Some(dir) = &self.state_dir {
            cmd.env("CELLMESH_STATE_DIR", dir);
        }
        if let Some(geo) = &self.geo {
            cmd.env("CELLMESH_GEO", geo);
        }
        cmd
    }
}

/// A `cellmesh sidecar` process and the addresses it bound.
struct Sidecar {
    spec: Spec,
    proc: SidecarProcess,
}

impl Sidecar {
    async fn start(node: u32, topology: &str, directory: &str, deadline: Instant) -> Self {
        Self::start_as(Spec::waiting(node, topology, directory), deadline).await
    }

    async fn start_as(spec: Spec, deadline: Instant) -> Self {
        Self {
            proc: Self::launch(&spec, deadline).await,
            spec,
        }
    }

    /// Starts the node again, once its predecessor's lease has lapsed unless it takes the lease
    /// over. What is under test is the node id coming back, not its ports: the new process binds
    /// new ones and peers learn them from the record it publishes.
    async fn restart(&mut self, deadline: Instant) {
        self.proc = Self::launch(&self.spec, deadline).await;
    }

    /// Runs the sidecar; one refused because the node id is still leased is started again.
    async fn launch(spec: &Spec, deadline: Instant) -> SidecarProcess {
        let node = spec.node;
        loop {
            let started =
                SidecarProcess::try_start(format!("sidecar {node}"), &mut spec.command()).await;
            match started {
                Ok(proc) => return proc,
                Err(exited) => assert!(exited.log.contains("is leased by"), "{exited}"),
            }
            assert!(
                Instant::now() < deadline,
                "the lease of node {node} never lapsed"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn local(&self) -> SocketAddr {
        self.proc.local
    }

    fn process(&self) -> &Process {
        &self.proc.process
    }

    /// SIGKILL, and waits until it is gone.
    async fn kill(&mut self) {
        self.proc.process.kill().await;
    }

    /// The node's state once it has started.
    async fn state(&self) -> Option<NodeState> {
        admin_state(self.proc.admin)
            .await
            .filter(|s| s["starting"] != true)
            .map(|s| NodeState::of(&s))
    }
}

/// Waits until both nodes are linked, each having found the other through the record it
/// publishes after renewing its lease.
///
/// The short lease used here can lapse when the MongoDB-compatible server stalls under load; the
/// node then freezes and exits, as it must. Such a node is started anew before anything is
/// killed, since what is under test is the handoff, not the node's start.
async fn until_leased<const N: usize>(mut nodes: [&mut Sidecar; N], deadline: Instant) {
    loop {
        let mut linked = 0;
        for node in nodes.iter_mut() {
            if matches!(node.proc.process.child.try_wait(), Ok(Some(_))) {
                eprintln!(
                    "node {} exited as it started (its lease lapsed); starting it again",
                    node.spec.node
                );
                node.restart(deadline).await;
                continue;
            }
            match node.state().await {
                Some(s) if s.lease_live && s.peers_up == N - 1 => linked += 1,
                Some(s) if !s.lease_live => {
                    eprintln!(
                        "node {} lost its lease as it started; starting it again",
                        node.spec.node
                    );
                    node.kill().await;
                    node.restart(deadline).await;
                }
                _ => {}
            }
        }
        if linked == nodes.len() {
            return;
        }
        if Instant::now() >= deadline {
            let logs: Vec<String> = nodes.iter().map(|n| n.process().tail()).collect();
            panic!("the nodes never linked:\n{}", logs.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a node's `/state` says about its entities and handoffs.
#[derive(Debug, Clone, PartialEq)]
struct NodeState {
    /// Entities the node writes (its game's), frozen ones included.
    reals: u64,
    in_flight: u64,
    in_doubt: Vec<u64>,
    adopting: u64,
    lease_live: bool,
    game_connected: bool,
    peers_up: usize,
}

impl NodeState {
    fn of(s: &serde_json::Value) -> Self {
        let n = |key: &str| {
            s[key]
                .as_u64()
                .unwrap_or_else(|| panic!("/state has no number {key}: {s}"))
        };
        Self {
            reals: n("reals"),
            in_flight: n("handoffs_in_flight"),
            in_doubt: s["handoffs_in_doubt"]
                .as_array()
                .unwrap_or_else(|| panic!("/state has no handoffs_in_doubt list: {s}"))
                .iter()
                .filter_map(|h| h["entity"].as_u64())
                .collect(),
            adopting: n("adopting"),
            lease_live: s["lease_live"] == true,
            game_connected: s["game_connected"] == true,
            peers_up: s["peers"]
                .as_array()
                .map_or(0, |p| p.iter().filter(|p| p["up"] == true).count()),
        }
    }

    /// Serving, linked to its peer, and done with every handoff.
    fn settled(&self) -> bool {
        self.settled_with(1)
    }

    /// Serving, linked to `peers` peers, and done with every handoff.
    fn settled_with(&self, peers: usize) -> bool {
        self.lease_live
            && self.game_connected
            && self.peers_up == peers
            && self.in_flight == 0
            && self.in_doubt.is_empty()
            && self.adopting == 0
    }
}

/// Waits until the nodes' states satisfy `expect`, twice in a row half a second apart (a node
/// publishes its state every 100 ms); panics at `deadline` with the last states and the logs.
async fn until_states<const N: usize>(
    deadline: Instant,
    what: &str,
    nodes: [&Sidecar; N],
    procs: &[&Process],
    expect: impl Fn(&[NodeState; N]) -> bool,
) -> [NodeState; N] {
    let mut seen: Option<[NodeState; N]> = None;
    loop {
        let mut states = Vec::with_capacity(N);
        for node in nodes {
            if let Some(s) = node.state().await {
                states.push(s);
            }
        }
        let complaint = match <[NodeState; N]>::try_from(states) {
            Err(states) => format!("a node does not answer /state; the others: {states:?}"),
            Ok(states) if !expect(&states) => format!("{states:?}"),
            Ok(states) if seen.as_ref() == Some(&states) => return states,
            Ok(states) => {
                seen = Some(states);
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        seen = None;
        if Instant::now() >= deadline {
            let mut logs: Vec<String> = nodes.iter().map(|n| n.process().tail()).collect();
            logs.extend(procs.iter().map(|p| p.tail()));
            panic!(
                "timed out waiting for {what}: {complaint}\n{}",
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn arena(node: &Sidecar, name: &str, npcs: u64, center: (f64, f64)) -> Process {
    Process::spawn(
        format!("arena {name}"),
        Command::new(arena_bin())
            .args(["--sidecar", &node.local().to_string()])
            .args(["--npcs", &npcs.to_string()])
            .args(["--center", &format!("{},{}", center.0, center.1)])
            .args(["--spread", &SPREAD.to_string()])
            .env("RUST_LOG", "info"),
    )
}

/// A counter from the stats an arena logs when it stops (`arena stopped stats=ArenaStats {..}`).
fn arena_stat(log: &str, field: &str) -> u64 {
    let line = log
        .lines()
        .rfind(|l| l.contains("arena stopped"))
        .unwrap_or_else(|| panic!("the arena logged no stats:\n{log}"));
    let key = format!(" {field}: ");
    let at = line
        .find(&key)
        .unwrap_or_else(|| panic!("no {field} in {line}"))
        + key.len();
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("{field} in {line}"))
}

/// A cluster with entities in flight from node 1 to node 2: `SETTLED` NPCs already handed over
/// (their first arena gone), then `IN_FLIGHT` more offered to node 2, whose game is stopped
/// before it answers their `Adopt`.
struct InFlight {
    source: Sidecar,
    target: Sidecar,
    /// Node 1's game holding the in-flight NPCs frozen.
    source_game: Process,
    /// Node 2's game, stopped (SIGSTOP).
    target_game: Process,
    deadline: Instant,
}

/// A topology database of this run's own in the test MongoDB, with a 2 × 1 grid committed
/// (node 1 west, node 2 east): its url, and the run's id.
fn west_east_topology(tag: &str) -> (String, String) {
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let run = run_id();
    let topology = format!("{}/cm_handoff_{tag}_{run}", mongo.trim_end_matches('/'));
    commit_plan(CELLMESH, &topology, "2x1", "1,2");
    (topology, run)
}

async fn in_flight(tag: &str, directory: &str) -> InFlight {
    arena_bin();
    let deadline = Instant::now() + DEADLINE;
    let (topology, _) = west_east_topology(tag);

    let mut source = Sidecar::start(1, &topology, directory, deadline).await;
    let mut target = Sidecar::start(2, &topology, directory, deadline).await;
    until_leased([&mut source, &mut target], deadline).await;
    let target_game = arena(&target, "2", 0, CROSSING);

    // Settled: NPCs born past the border walk into node 2's area and are adopted there.
    let first = arena(&source, "1", SETTLED, CROSSING);
    until_states(
        deadline,
        "the first NPCs to be handed over",
        [&source, &target],
        &[&first, &target_game],
        |[s, t]| s.settled() && t.settled() && s.reals == 0 && t.reals == SETTLED,
    )
    .await;
    let log = first.terminate().await;
    assert_eq!(arena_stat(&log, "evicted"), SETTLED, "{log}");

    // In flight: node 2 accepts the offers, but its stopped game never answers the Adopts.
    target_game.signal("STOP");
    let source_game = arena(&source, "1b", IN_FLIGHT, CROSSING);
    until_states(
        deadline,
        "the next NPCs to be in doubt",
        [&source, &target],
        &[&source_game, &target_game],
        |[s, t]| {
            s.in_doubt.len() as u64 == IN_FLIGHT
                && s.reals == IN_FLIGHT
                && t.adopting == IN_FLIGHT
                && t.reals == SETTLED
        },
    )
    .await;
    InFlight {
        source,
        target,
        source_game,
        target_game,
        deadline,
    }
}

/// The target dies with every in-flight entity's `Adopt` unanswered, and is restarted at once
/// (same node id, once the old lease lapsed). Two outcomes are right, and which one comes is a
/// race between the source seeing the old lease lapse and seeing the new process's lease:
/// - the restarted target restores its world: the in-flight entities from the source's
///   snapshots, and those handed over earlier from the snapshots the source kept of them (these
///   sidecars keep checkpoints in memory, so nothing newer survived); the source evicts the
///   in-flight ones and writes none of them again;
/// - the world moved on without it: the source, seeing the node gone, committed a partition that
///   gives it the dead node's area and restored that world itself (as when a node dies for good),
///   and the restarted target joins with no area.
///
/// Either way each entity ends on exactly one node and nothing stays in doubt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_target_mid_handoff_leaves_every_entity_held_once() {
    let _one = ONE_CLUSTER.lock().await;
    let InFlight {
        mut source,
        mut target,
        source_game,
        mut target_game,
        deadline,
    } = in_flight("target", "memory").await;

    target.kill().await;
    target_game.kill().await;
    target.restart(deadline).await;
    until_leased([&mut source, &mut target], deadline).await;
    let target_game = arena(&target, "2 (restarted)", 0, CROSSING);

    until_states(
        deadline,
        "the restarted target to restore its world, or the source to take it over",
        [&source, &target],
        &[&source_game, &target_game],
        |[s, t]| {
            let restored = s.reals == 0 && t.reals == SETTLED + IN_FLIGHT;
            let moved_on = s.reals == SETTLED + IN_FLIGHT && t.reals == 0;
            s.settled() && t.settled() && (restored || moved_on)
        },
    )
    .await;
    let moved_on = source.state().await.is_some_and(|s| s.reals > 0);

    let source_log = source_game.terminate().await;
    let target_log = target_game.terminate().await;
    if moved_on {
        // The in-flight entities thawed where they stand; the settled ones came back from the
        // snapshots the source kept of them.
        assert_eq!(arena_stat(&source_log, "evicted"), 0, "{source_log}");
        assert_eq!(arena_stat(&source_log, "adopted"), SETTLED, "{source_log}");
        assert_eq!(arena_stat(&target_log, "adopted"), 0, "{target_log}");
    } else {
        assert_eq!(
            arena_stat(&source_log, "evicted"),
            IN_FLIGHT,
            "{source_log}"
        );
        assert_eq!(
            arena_stat(&target_log, "adopted"),
            SETTLED + IN_FLIGHT,
            "{target_log}"
        );
    }
}

/// The source dies with every in-flight entity offered and accepted: the target keeps what was
/// handed over before (and completes the adoptions its game answers after the source is gone).
/// The restarted source either finds its area (its new process holds the node id before the
/// target saw the lease lapse) and writes what its new game spawns there, or finds the world
/// moved on without it (the partition gave its area to the target) and joins empty, its new
/// game's NPCs handed to the target. Either way every entity is held once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_source_mid_handoff_keeps_what_was_handed_over() {
    let _one = ONE_CLUSTER.lock().await;
    let InFlight {
        mut source,
        mut target,
        mut source_game,
        target_game,
        deadline,
    } = in_flight("source", "memory").await;

    source.kill().await;
    source_game.kill().await;
    target_game.signal("CONT");
    until_states(
        deadline,
        "the target to keep what it was handed",
        [&target],
        &[&target_game, source.process()],
        |[t]| t.lease_live && t.in_flight == 0 && t.adopting == 0 && t.reals == SETTLED + IN_FLIGHT,
    )
    .await;

    source.restart(deadline).await;
    until_leased([&mut source, &mut target], deadline).await;
    let home = 3;
    let source_game = arena(&source, "1 (restarted)", home, HOME);
    until_states(
        deadline,
        "the restarted source to rejoin",
        [&source, &target],
        &[&source_game, &target_game],
        |[s, t]| {
            let kept = s.reals == home && t.reals == SETTLED + IN_FLIGHT;
            let moved_on = s.reals == 0 && t.reals == SETTLED + IN_FLIGHT + home;
            s.settled() && t.settled() && (kept || moved_on)
        },
    )
    .await;
    let moved_on = source.state().await.is_some_and(|s| s.reals == 0);

    let handed = if moved_on { home } else { 0 };
    let log = target_game.terminate().await;
    assert_eq!(
        arena_stat(&log, "adopted"),
        SETTLED + IN_FLIGHT + handed,
        "{log}"
    );
    let log = source_game.terminate().await;
    assert_eq!(arena_stat(&log, "evicted"), handed, "{log}");
}

/// The target dies for good with entities in flight. Once its lease lapses, the source commits
/// a partition without it and restores its world: the NPCs it had adopted from the checkpoints
/// it left in the geo's Redis (adopted by the source's game), those in flight from the source's
/// own snapshots (thawed where they stand, now in the source's area). Every NPC ends on node 1
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_for_good_has_its_world_restored_from_its_redis_checkpoints() {
    let _one = ONE_CLUSTER.lock().await;
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let InFlight {
        source,
        mut target,
        source_game,
        mut target_game,
        deadline,
    } = in_flight("for_good", &redis).await;

    target.kill().await;
    target_game.kill().await;
    until_states(
        deadline,
        "the source to restore the dead node's world",
        [&source],
        &[&source_game, target.process()],
        // Alone now: no peer is up.
        |[s]| {
            s.lease_live
                && s.peers_up == 0
                && s.in_flight == 0
                && s.adopting == 0
                && s.reals == SETTLED + IN_FLIGHT
        },
    )
    .await;
    let state = admin_state(source.proc.admin)
        .await
        .expect("the source's state");
    assert!(
        state["partition_epoch"].as_u64() > Some(1),
        "no partition without the dead node: {state}"
    );

    // The dead node's checkpoints came from Redis (its process and memory are gone).
    let log = source.process().tail();
    assert!(
        log.contains(&format!("checkpoints={SETTLED}")),
        "the restore read no checkpoints of the dead node:\n{log}"
    );
    let log = source_game.terminate().await;
    assert_eq!(arena_stat(&log, "adopted"), SETTLED, "{log}");
    assert_eq!(arena_stat(&log, "evicted"), 0, "{log}");
}

/// Inside node 1's area and inside node 2's, far from every border: NPCs there stay home.
const WEST: (f64, f64) = (32_768.0, 1000.0);
const EAST: (f64, f64) = (98_304.0, 1000.0);
/// A new entity's checkpoint is asked of the game within a checkpoint interval (2 s) of its
/// birth and written to the store within a flush (250 ms) of the answer.
const CHECKPOINTED: Duration = Duration::from_secs(3);
/// How soon a node restarted in place must be whole again: well under its lease (10 s).
const IN_PLACE_WITHIN: Duration = Duration::from_secs(5);

/// Polls the nodes' states until `expect` holds, and says when it first did; panics at
/// `deadline` with the last states and the logs.
async fn first_time<const N: usize>(
    deadline: Instant,
    what: &str,
    nodes: [&Sidecar; N],
    procs: &[&Process],
    expect: impl Fn(&[NodeState; N]) -> bool,
) -> Instant {
    loop {
        let mut states = Vec::with_capacity(N);
        for node in nodes {
            if let Some(s) = node.state().await {
                states.push(s);
            }
        }
        let now = Instant::now();
        match <[NodeState; N]>::try_from(states) {
            Ok(states) if expect(&states) => return now,
            states if now >= deadline => {
                let mut logs: Vec<String> = nodes.iter().map(|n| n.process().tail()).collect();
                logs.extend(procs.iter().map(|p| p.tail()));
                panic!(
                    "timed out waiting for {what}: {states:?}\n{}",
                    logs.join("\n")
                );
            }
            _ => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
}

/// A sidecar `kill -9`ed with its game and restarted in place at once (the same state dir, the
/// default 10 s node lease) takes its node id over without waiting out the old lease: the peer
/// sees a new lease epoch for node 2, takes the old process for dead, and restores its world
/// to the new process (the partition still gives it the area) from the checkpoints in the geo's
/// Redis. Every entity ends where it was, once, within a fraction of the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_restarted_in_place_takes_its_node_id_over_at_once() {
    let _one = ONE_CLUSTER.lock().await;
    arena_bin();
    let deadline = Instant::now() + DEADLINE;
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let (topology, run) = west_east_topology("in_place");
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let spec = |node: u32| Spec {
        node,
        topology: topology.clone(),
        directory: redis.clone(),
        state_dir: Some(dirs[node as usize - 1].path().to_path_buf()),
        lease_ms: None,
        // Checkpoints in Redis are keyed by geo, node and lease epoch: a geo of this run's own.
        geo: Some(format!("in_place_{run}")),
    };
    let mut west = Sidecar::start_as(spec(1), deadline).await;
    let mut east = Sidecar::start_as(spec(2), deadline).await;
    until_leased([&mut west, &mut east], deadline).await;
    let (west_npcs, east_npcs) = (3, 6);
    let west_game = arena(&west, "1", west_npcs, WEST);
    let mut east_game = arena(&east, "2", east_npcs, EAST);
    let whole = |[w, e]: &[NodeState; 2]| {
        w.settled() && e.settled() && w.reals == west_npcs && e.reals == east_npcs
    };
    until_states(
        deadline,
        "both worlds to settle",
        [&west, &east],
        &[&west_game, &east_game],
        whole,
    )
    .await;
    tokio::time::sleep(CHECKPOINTED).await;

    east.kill().await;
    east_game.kill().await;
    let restarted = Instant::now();
    east.proc = SidecarProcess::try_start("sidecar 2 (restarted)", &mut east.spec.command())
        .await
        .unwrap_or_else(|refused| panic!("the restarted sidecar was refused: {refused}"));
    let east_game = arena(&east, "2 (restarted)", 0, EAST);
    let at = first_time(
        deadline,
        "the restarted node's world to be whole",
        [&west, &east],
        &[&west_game, &east_game],
        whole,
    )
    .await;
    let took = at - restarted;
    eprintln!("restart to world whole: {} ms", took.as_millis());
    assert!(
        took < IN_PLACE_WITHIN,
        "the world was whole only {took:?} after the restart\n{}\n{}",
        west.process().tail(),
        east.process().tail()
    );
    // And stays so.
    until_states(
        deadline,
        "the world to stay whole",
        [&west, &east],
        &[&west_game, &east_game],
        whole,
    )
    .await;

    let log = east.process().log.text();
    assert!(
        log.contains("took the node lease over"),
        "the restarted sidecar took no lease over:\n{log}"
    );
    let log = west.process().log.text();
    assert!(
        log.contains("a peer's process is dead"),
        "node 1 never took the old process for dead:\n{log}"
    );
    // Node 2's new game got each of its entities once, and node 1's nothing.
    let log = east_game.terminate().await;
    assert_eq!(arena_stat(&log, "adopted"), east_npcs, "{log}");
    let log = west_game.terminate().await;
    assert_eq!(
        (arena_stat(&log, "adopted"), arena_stat(&log, "evicted")),
        (0, 0),
        "{log}"
    );
}

/// A second sidecar started as a node that runs on this host with the same state dir exits at
/// once naming the lock, before it asks the store for anything; the first runs on, its lease
/// untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sidecar_as_a_running_node_of_this_host_is_refused() {
    let _one = ONE_CLUSTER.lock().await;
    let deadline = Instant::now() + DEADLINE;
    let (topology, _) = west_east_topology("locked");
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        state_dir: Some(dir.path().to_path_buf()),
        lease_ms: None,
        ..Spec::waiting(1, &topology, "memory")
    };
    let mut first = Sidecar::start_as(spec.clone(), deadline).await;
    first_time(deadline, "node 1's lease", [&first], &[], |[s]| {
        s.lease_live
    })
    .await;
    let recorded = std::fs::read_to_string(dir.path().join("node-1.lease")).unwrap();

    let refused = match SidecarProcess::try_start("sidecar 1 (second)", &mut spec.command()).await {
        Ok(second) => panic!("a second sidecar ran as node 1:\n{}", second.process.tail()),
        Err(refused) => refused,
    };
    assert!(!refused.status.success(), "{refused}");
    let lock = dir.path().join("node-1.lock");
    assert!(
        refused.log.contains(&format!(
            "another sidecar on this host runs as node 1: {} is locked",
            lock.display()
        )),
        "{refused}"
    );

    // A few renewals later the first still runs and holds its lease.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        first.proc.process.child.try_wait().unwrap().is_none(),
        "the first sidecar exited:\n{}",
        first.process().tail()
    );
    let state = first.state().await.expect("the first sidecar answers");
    assert!(state.lease_live, "{state:?}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("node-1.lease")).unwrap(),
        recorded,
        "the lease recorded changed"
    );
    first.proc.process.terminate().await;
}

/// The proxy's token secret in the relogin test.
const SECRET: &str = "relogin-test";

/// A client of the proxy: answers pings and sends an input every 100 ms until stopped or
/// kicked; says how it ended.
fn client(
    mut tx: cellmesh_proto::client::ClientSender,
    mut rx: cellmesh_proto::client::ClientReceiver,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<String> {
    use cellmesh_proto::edge::{client_message, server_message, Pong};
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(100));
        let mut seq = 0;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return "logged out".to_string(),
                _ = every.tick() => {
                    seq += 1;
                    if tx.input(seq, bytes::Bytes::from_static(b"{\"move\":[1,0]}")).await.is_err() {
                        return "closed".to_string();
                    }
                }
                msg = rx.next() => match msg {
                    Some(Ok(m)) => match m.body {
                        Some(server_message::Body::Ping(p)) => {
                            let _ = tx.send(client_message::Body::Pong(Pong { nonce: p.nonce })).await;
                        }
                        Some(server_message::Body::Kick(k)) => return format!("kicked: {}", k.reason),
                        _ => {}
                    },
                    _ => return "closed".to_string(),
                },
            }
        }
    })
}

/// The nodes writing `account`'s avatar, among those that answer.
async fn writers_of(account: &str, nodes: &[&Sidecar]) -> Vec<u32> {
    let mut writers = Vec::new();
    for n in nodes {
        if let Some(s) = admin_state(n.proc.admin).await {
            if s["masters"]
                .as_array()
                .is_some_and(|m| m.iter().any(|a| a == account))
            {
                writers.push(n.spec.node);
            }
        }
    }
    writers
}

/// Crash-and-relogin races with real processes: a player's gateway is `kill -9`ed with its game,
/// and the player logs in again at once on a new connection, while the proxy moves the old
/// session to the live node and the dead node's world is restored there. Never do two nodes
/// write the player's avatar; once things settle exactly one does and no input is held; after
/// the dead node is back and the player logs out, none does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_player_logging_in_again_through_its_gateways_crash_keeps_one_avatar() {
    let _one = ONE_CLUSTER.lock().await;
    arena_bin();
    let deadline = Instant::now() + DEADLINE;
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let (topology, run) = west_east_topology("relogin");
    let geo = format!("relogin_{run}");
    let spec = |node: u32| Spec {
        geo: Some(geo.clone()),
        ..Spec::waiting(node, &topology, &redis)
    };
    let mut west = Sidecar::start_as(spec(1), deadline).await;
    let mut east = Sidecar::start_as(spec(2), deadline).await;
    until_leased([&mut west, &mut east], deadline).await;
    let mut games = [arena(&west, "1", 2, WEST), arena(&east, "2", 2, EAST)];
    until_states(
        deadline,
        "both worlds to settle",
        [&west, &east],
        &[&games[0], &games[1]],
        |[w, e]| w.settled() && e.settled(),
    )
    .await;
    let mut proxy = ProxyProcess::start(
        "proxy",
        proxy_command(CELLMESH)
            .env("CELLMESH_GEO", &geo)
            .env(
                "CELLMESH_GATEWAYS",
                format!("[\"{}\", \"{}\"]", west.proc.mesh, east.proc.mesh),
            )
            .env("CELLMESH_TOKEN_SECRET", SECRET),
    )
    .await;
    wait_ready(proxy.admin, &mut proxy.process).await;
    let clients = proxy.clients.to_string();
    let login = || async {
        let token = cellmesh_proto::token::sign(SECRET.as_bytes(), "ada", unix_now() + 300);
        cellmesh_proto::client::login(&clients, &token)
            .await
            .expect("login")
    };

    let (tx, rx, welcome) = login().await;
    let stop_first = tokio_util::sync::CancellationToken::new();
    let mut first = client(tx, rx, stop_first.clone());
    while writers_of("ada", &[&west, &east]).await.len() != 1 {
        assert!(Instant::now() < deadline, "no node writes ada's avatar");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(CHECKPOINTED).await;

    // Her gateway dies with its game; she logs in again at once.
    let gateway = welcome.gateway_node;
    let before = writers_of("ada", &[&west, &east]).await;
    eprintln!("ada's gateway: node {gateway}; her avatar on node {before:?}");
    let (dead, live) = if gateway == 1 {
        (&mut west, &east)
    } else {
        (&mut east, &west)
    };
    let dead_game = (gateway - 1) as usize;
    dead.kill().await;
    games[dead_game].kill().await;
    let (tx, rx, _) = login().await;
    let stop_second = tokio_util::sync::CancellationToken::new();
    let mut second = client(tx, rx, stop_second.clone());
    // Never two writers while her world is restored; then exactly one, steadily.
    let mut steady = 0;
    while steady < 10 {
        assert!(Instant::now() < deadline, "ada's avatar never came back");
        let writers = writers_of("ada", &[live]).await;
        assert!(
            writers.len() <= 1,
            "two nodes write ada's avatar: {writers:?}"
        );
        steady = if writers.len() == 1 { steady + 1 } else { 0 };
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "ada's avatar back on node {:?}",
        writers_of("ada", &[live]).await
    );
    // The second login displaces the first session, whether the proxy moved that to the live
    // node before the second login registered or after (then the directory refuses the move:
    // a newer login came since).
    let ended = tokio::select! {
        ended = &mut first => ended.unwrap(),
        ended = &mut second => panic!("ada's newer login ended first: {}", ended.unwrap()),
        _ = tokio::time::sleep_until(deadline) => panic!("ada's first session never ended"),
    };
    eprintln!("ada's first session ended: {ended}");
    let displaced = cellmesh_proto::edge::KickReason::Displaced as i32;
    assert_eq!(ended, format!("kicked: {displaced}"));
    drop(stop_first);
    let (survivor, stop) = (second, stop_second);

    // The dead node comes back once its lease lapsed; still one avatar, nothing held.
    dead.restart(deadline).await;
    games[dead_game] = arena(dead, "again", 0, if gateway == 1 { WEST } else { EAST });
    until_states(
        deadline,
        "both nodes to settle again",
        [&west, &east],
        &[&games[0], &games[1]],
        |[w, e]| w.settled() && e.settled(),
    )
    .await;
    let writers = writers_of("ada", &[&west, &east]).await;
    assert_eq!(writers.len(), 1, "{writers:?}");
    for n in [&west, &east] {
        let s = admin_state(n.proc.admin).await.expect("a state");
        assert_eq!(s["inputs_held"], 0, "node {}: {s}", n.spec.node);
    }

    // She logs out: no avatar is left anywhere.
    stop.cancel();
    assert_eq!(survivor.await.unwrap(), "logged out");
    while !writers_of("ada", &[&west, &east]).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "ada's avatar outlived her logout"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The four nodes' arenas stand around the corner all regions of a 2 × 2 grid touch, so every
/// view there holds entities of every node.
const CORNER: (f64, f64) = (65_536.0, 65_536.0);

fn near_corner(node: u32) -> (f64, f64) {
    let dx = if node % 2 == 1 { -60.0 } else { 60.0 };
    let dy = if node <= 2 { -60.0 } else { 60.0 };
    (CORNER.0 + dx, CORNER.1 + dy)
}

/// Every account that has an avatar, with the nodes writing it, among the nodes that answer.
async fn avatars(nodes: &[&Sidecar]) -> std::collections::BTreeMap<String, Vec<u32>> {
    let mut all: std::collections::BTreeMap<String, Vec<u32>> = Default::default();
    for n in nodes {
        if let Some(s) = admin_state(n.proc.admin).await {
            for a in s["masters"].as_array().into_iter().flatten() {
                let account = a.as_str().expect("an account").to_string();
                all.entry(account).or_default().push(n.spec.node);
            }
        }
    }
    all
}

/// Waits until each of `bots` bots has its avatar written by exactly one of `live`, five reads
/// in a row; never two writers meanwhile.
async fn one_avatar_each(
    live: &[&Sidecar],
    bots: usize,
    deadline: Instant,
    stats: &cellmesh::bots::BotStats,
    what: &str,
) {
    let mut steady = 0;
    let mut last = Default::default();
    while steady < 5 {
        assert!(
            Instant::now() < deadline,
            "{what}: bots' avatars {last:?}, bots {:?}",
            stats.totals()
        );
        last = avatars(live).await;
        for (account, writers) in &last {
            assert!(
                writers.len() <= 1,
                "{what}: {account} written by {writers:?}"
            );
        }
        let one_each = last.len() == bots && last.values().all(|w| w.len() == 1);
        steady = if one_each { steady + 1 } else { 0 };
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The entities `live` write.
async fn reals(live: &[&Sidecar]) -> u64 {
    let mut sum = 0;
    for n in live {
        sum += n.state().await.map_or(0, |s| s.reals);
    }
    sum
}

/// Four `cellmesh sidecar` processes with their games on the real MongoDB and Redis, a proxy
/// and a dozen bots, as an operator runs them. One sidecar and its game are `kill -9`ed for
/// good: the other nodes restore its entities, and every bot stays connected and has its one
/// avatar again. Then one game alone is killed and restarted: its sidecar gives it back its
/// entities and players, and again every bot keeps its connection and its one avatar.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_lose_a_node_and_a_game_and_every_player_keeps_its_avatar() {
    use cellmesh::bots::{run_bot, BotConfig, BotStats};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    const BOTS: usize = 12;
    const NPCS: u64 = 3;
    let _one = ONE_CLUSTER.lock().await;
    arena_bin();
    let deadline = Instant::now() + Duration::from_secs(120);
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let run = run_id();
    let topology = format!("{}/cm_four_{run}", mongo.trim_end_matches('/'));
    commit_plan(CELLMESH, &topology, "2x2", "1,2,3,4");
    let geo = format!("four_{run}");
    let spec = |node: u32| Spec {
        geo: Some(geo.clone()),
        ..Spec::waiting(node, &topology, &redis)
    };
    let mut nodes = Vec::new();
    for node in 1..=4 {
        nodes.push(Sidecar::start_as(spec(node), deadline).await);
    }
    {
        let [a, b, c, d] = &mut nodes[..] else {
            unreachable!()
        };
        until_leased([a, b, c, d], deadline).await;
    }
    let mut games: Vec<Process> = nodes
        .iter()
        .map(|n| arena(n, &n.spec.node.to_string(), NPCS, near_corner(n.spec.node)))
        .collect();
    let mut proxy = ProxyProcess::start(
        "proxy",
        proxy_command(CELLMESH)
            .env("CELLMESH_GEO", &geo)
            .env(
                "CELLMESH_GATEWAYS",
                serde_json::to_string(
                    &nodes
                        .iter()
                        .map(|n| n.proc.mesh.to_string())
                        .collect::<Vec<_>>(),
                )
                .unwrap(),
            )
            .env("CELLMESH_TOKEN_SECRET", SECRET),
    )
    .await;
    wait_ready(proxy.admin, &mut proxy.process).await;
    let cfg = Arc::new(BotConfig {
        proxy: proxy.clients.to_string(),
        secret: SECRET.into(),
        home: CORNER,
        roam: 120.0,
        ..BotConfig::default()
    });
    let stats = Arc::new(BotStats::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let bots: Vec<_> = (0..BOTS)
        .map(|i| {
            tokio::spawn(run_bot(
                format!("bot-{i}"),
                cfg.clone(),
                stats.clone(),
                stop.clone(),
            ))
        })
        .collect();

    let all: Vec<&Sidecar> = nodes.iter().collect();
    one_avatar_each(&all, BOTS, deadline, &stats, "every bot to have its avatar").await;
    let total = 4 * NPCS + BOTS as u64;
    assert_eq!(reals(&all).await, total);
    tokio::time::sleep(CHECKPOINTED).await;

    // The node serving the most bots dies for good with its game (the proxy spreads logins
    // over the links it has up, so which one that is varies).
    let mut victim = 0;
    let mut most = 0;
    for (i, n) in nodes.iter().enumerate() {
        let sessions = admin_state(n.proc.admin)
            .await
            .and_then(|s| s["sessions"].as_array().map(Vec::len))
            .unwrap_or(0);
        if sessions > most {
            (victim, most) = (i, sessions);
        }
    }
    assert!(most > 0, "no node serves a bot");
    nodes[victim].kill().await;
    games[victim].kill().await;
    let (dead, mut survivors): (Vec<_>, Vec<_>) =
        nodes.iter().enumerate().partition(|(i, _)| *i == victim);
    let dead_node = dead[0].1.spec.node;
    let live: Vec<&Sidecar> = survivors.iter().map(|(_, n)| *n).collect();
    let what = "every avatar back after a node died";
    one_avatar_each(&live, BOTS, deadline, &stats, what).await;
    while reals(&live).await != total {
        assert!(
            Instant::now() < deadline,
            "node {dead_node}'s world was not restored: {} of {total} entities",
            reals(&live).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    eprintln!("node {dead_node} (serving {most} bots) restored: {total} entities on the others");

    // The sidecar gives the restarted game its entities again.
    // Another node's game alone crashes and comes back.
    let (g, restarted) = survivors.remove(0);
    let held = restarted.state().await.expect("the node answers").reals;
    games[g].kill().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    games[g] = arena(restarted, "again", 0, near_corner(restarted.spec.node));
    let what = "every avatar back after a game restarted";
    one_avatar_each(&live, BOTS, deadline, &stats, what).await;
    while reals(&live).await != total {
        assert!(
            Instant::now() < deadline,
            "the restarted game lost entities"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = games.swap_remove(g).terminate().await;
    let adopted = arena_stat(&log, "adopted");
    assert!(
        adopted >= held,
        "the new game got {adopted} of its {held} entities"
    );
    let t = stats.totals();
    eprintln!("the new game got back {adopted} entities (it held {held}); bots {t:?}");
    assert_eq!(
        (t.kicks, t.errors),
        (0, 0),
        "a bot lost its connection: {t:?}"
    );
    // Observers kept what was restored in view: nothing vanished well inside a view.
    assert_eq!(t.vanished_on_handoff, 0, "{t:?}");
    assert_eq!(t.online, BOTS as u64, "{t:?}");
    assert!(
        t.sessions_moved >= most as u64,
        "{most} sessions to move: {t:?}"
    );
    stop.cancel();
    for b in bots {
        b.await.unwrap();
    }
    assert_eq!(stats.online.load(Ordering::Relaxed), 0);
}

/// The lab's `kill-node` in the second geo, quick: each geo keeps its checkpoints in its own
/// Redis (here one server, each geo under its own key prefix), so a dead node's world must be
/// restored from its own geo's store. Node 1 (geo `eu`, a spare with no cell, the lowest id of
/// all) and nodes 2 and 3 (geo `us`, the two halves of the world); node 3 dies for good with
/// its NPCs checkpointed. Node 2, the lowest live node of `us`, reads `us`'s checkpoints and
/// restores every NPC, once; node 1 reads none (its store holds none of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_node_of_the_second_geo_is_restored_from_its_geos_checkpoints() {
    const NPCS: u64 = 6;
    let _one = ONE_CLUSTER.lock().await;
    arena_bin();
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let run = run_id();
    let topology = format!("{}/cm_second_geo_{run}", mongo.trim_end_matches('/'));
    commit_plan(CELLMESH, &topology, "2x1", "2,3");
    let deadline = Instant::now() + Duration::from_secs(90);
    let spec = |node: u32, geo: &str| Spec {
        geo: Some(format!("{geo}-{run}")),
        ..Spec::waiting(node, &topology, &redis)
    };
    let mut eu1 = Sidecar::start_as(spec(1, "eu"), deadline).await;
    let mut us2 = Sidecar::start_as(spec(2, "us"), deadline).await;
    let mut us3 = Sidecar::start_as(spec(3, "us"), deadline).await;
    until_leased([&mut eu1, &mut us2, &mut us3], deadline).await;
    // Every node has a game to adopt what it is given; only node 3's spawns anything.
    let game1 = arena(&eu1, "1", 0, WEST);
    let game2 = arena(&us2, "2", 0, WEST);
    let mut game3 = arena(&us3, "3", NPCS, EAST);
    until_states(
        deadline,
        "node 3's NPCs",
        [&eu1, &us2, &us3],
        &[&game1, &game2, &game3],
        |[a, b, c]| a.settled_with(2) && b.settled_with(2) && c.settled_with(2) && c.reals == NPCS,
    )
    .await;
    tokio::time::sleep(CHECKPOINTED).await;

    us3.kill().await;
    game3.kill().await;
    until_states(
        deadline,
        "node 3's NPCs restored on the live nodes",
        [&eu1, &us2],
        &[&game1, &game2, us3.process()],
        |[a, b]| {
            a.lease_live
                && b.lease_live
                && a.in_flight + b.in_flight + a.adopting + b.adopting == 0
                && a.reals + b.reals == NPCS
        },
    )
    .await;
    let decider = us2.process().tail();
    assert!(
        decider.contains(&format!("checkpoints={NPCS}")),
        "us's decider read no checkpoints of the dead node:\n{decider}"
    );
    // Held once: a second restore would show as more reals than NPCs.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(reals(&[&eu1, &us2]).await, NPCS);
}

/// A MongoDB-compatible server of the test's own, which the test may pause (SIGSTOP) as an
/// election or a stalled primary would stop answering: its URL and its process.
async fn own_mongo(dir: &Path) -> (String, Process) {
    let python = required("CELLMESH_TEST_PYTHON");
    let bin = Path::new(&python).with_file_name("secantusd-py");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .unwrap()
        .port();
    // An empty config file keeps the server from picking up one lying around.
    let config = dir.join("secantusd.toml");
    std::fs::write(&config, "").unwrap();
    let server = Process::spawn(
        "secantusd",
        Command::new(&bin)
            .arg("--config")
            .arg(&config)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--storage-path")
            .arg(dir.join("data"))
            .current_dir(dir),
    );
    let url = format!("mongodb://127.0.0.1:{port}");
    let ping = format!(
        "import pymongo; pymongo.MongoClient('{url}', serverSelectionTimeoutMS=500).admin.command('ping')"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = std::process::Command::new(&python)
            .args(["-c", &ping])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return (url, server);
        }
        assert!(
            Instant::now() < deadline,
            "the MongoDB-compatible server never answered:\n{}",
            server.tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The lab's `pause-mongo`, quick: the topology store stops answering for longer than a node
/// lease (a MongoDB election takes ten seconds and more; here the lease is 1.5 s and the pause
/// 4 s). Every node's lease lapses at once: each freezes what it owns (it writes nothing),
/// exits not, and takes its lease back under the same epoch when the store answers again, then
/// thaws. No decider takes a peer's lapse for a death: nothing is restored, nothing lost or
/// doubled, and the world is whole within seconds of the store's return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_topology_store_freezes_every_node_and_none_exits() {
    const NPCS: u64 = 4;
    let _one = ONE_CLUSTER.lock().await;
    arena_bin();
    let redis = required("CELLMESH_TEST_REDIS_URL");
    let dir = tempfile::tempdir().expect("a temp dir");
    let (mongo, store) = own_mongo(dir.path()).await;
    let topology = format!("{mongo}/cm_pause");
    commit_plan(CELLMESH, &topology, "2x1", "1,2");
    let deadline = Instant::now() + Duration::from_secs(90);
    let geo = format!("pause-{}", run_id());
    let spec = |node: u32| Spec {
        geo: Some(geo.clone()),
        ..Spec::waiting(node, &topology, &redis)
    };
    let mut west = Sidecar::start_as(spec(1), deadline).await;
    let mut east = Sidecar::start_as(spec(2), deadline).await;
    until_leased([&mut west, &mut east], deadline).await;
    let game1 = arena(&west, "1", NPCS, WEST);
    let game2 = arena(&east, "2", NPCS, EAST);
    until_states(
        deadline,
        "every NPC at home",
        [&west, &east],
        &[&game1, &game2],
        |[w, e]| w.settled() && e.settled() && w.reals == NPCS && e.reals == NPCS,
    )
    .await;
    tokio::time::sleep(CHECKPOINTED).await;

    store.signal("STOP");
    let paused = Instant::now();
    until_states(
        deadline,
        "both nodes frozen by their lapsed leases",
        [&west, &east],
        &[&game1, &game2],
        |[w, e]| !w.lease_live && !e.lease_live,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(4).saturating_sub(paused.elapsed())).await;
    store.signal("CONT");
    let resumed = Instant::now();
    let whole = first_time(
        deadline,
        "both nodes writing again",
        [&west, &east],
        &[&game1, &game2],
        |[w, e]| w.settled() && e.settled() && w.reals == NPCS && e.reals == NPCS,
    )
    .await;
    let took = whole.saturating_duration_since(resumed);
    assert!(
        took <= Duration::from_secs(5),
        "the world was whole {took:?} after the store came back"
    );
    for node in [&mut west, &mut east] {
        assert!(
            matches!(node.proc.process.child.try_wait(), Ok(None)),
            "a sidecar exited:\n{}",
            node.process().tail()
        );
        let (_, metrics) = cellmesh_admin::http_get(node.proc.admin, "/metrics")
            .await
            .expect("/metrics");
        assert!(
            metric(&metrics, "cellmesh_sidecar_leases_reclaimed_total") >= 1,
            "{metrics}"
        );
        assert_eq!(
            metric(&metrics, "cellmesh_sidecar_leases_fenced_total"),
            0,
            "{metrics}"
        );
    }
    // Held once, and still so a while later.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(reals(&[&west, &east]).await, 2 * NPCS);
    let log = game1.terminate().await;
    assert_eq!(arena_stat(&log, "evicted"), 0, "{log}");
}

/// A counter's value on a `/metrics` page (0 when absent).
fn metric(page: &str, name: &str) -> u64 {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}
