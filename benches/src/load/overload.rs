//! `overload`: sessions log in until the cluster is past its knee, then twice as many are offered.
//! The nodes shed the excess at the door (the proxy refuses new logins `SERVER_FULL` while every
//! gateway says it is full), so the sessions already admitted keep their latency.
//!
//! Layout: two nodes in vertical strips; node 2 is the one gateway (the proxy attaches every
//! session there) and node 1 writes NPCs its sessions see as render ghosts. One gateway, because on
//! two cores two gateways are not two hosts: one's overload is the other's too, and the other
//! cannot see it in its own game until it has taken the surplus. Each node's game runs on a runtime
//! of its own (one thread, as a game server process would have), ticks at 20 Hz, updates its NPCs
//! near the border every tick and spends CPU on each tick as a real game does ([`TICK_WORK`]: per
//! NPC and per player), reports `Load` every second (its second longest tick of the second, each
//! tick timed from when it was due, so a game starved of CPU reports an overrun), and answers every
//! input of its players at its tick's end with an owner-only echo. Every avatar stands near the
//! border on node 2's side, so every session sees every NPC of both nodes: the gateway folds its
//! own game's updates at the tick's end and node 1's as they arrive.
//!
//! Each client sends an input every 100 ms carrying a stamp. Its **RTT** is the echo's arrival less
//! the stamp: client, proxy, gateway, game and back, the wait for the game's tick included, as a
//! player sees it. The **mesh RTT** is that less the time the game held the input until its tick
//! ended (up to a tick). A window counts the inputs stamped within it; an echo later than a grace
//! (1 s; half that with `--quick`) after the window closed is not counted (`echo_delivery` says how
//! many came). Figures are over the sessions admitted.
//!
//! The nodes run with `close_at_load` 0.6 and `open_below_load` 0.4 ([`CLOSE_AT_LOAD`]): here a
//! game shares two cores with the mesh and every client, so a game at 60 % of its tick budget
//! already means the machine has no room left (a game with a host of its own keeps the defaults,
//! 0.9 and 0.7).
//!
//! The **knee** is found by offering more sessions each step; logins are paced by the nodes (a
//! share of their sessions per load report), and those refused come back after the proxy's hint, as
//! players would, until all are in or a node closes for overload. It is the first step at which a
//! node closes admission for overload, or the admitted sessions' mesh RTT p99 exceeds a tick
//! (`steps[].closings` says which reasons closed nodes: `login_burst` and `at_capacity` are
//! pauses, not overload).
//! Then twice the knee's sessions are offered and the admitted sessions measured again: `ratio`
//! holds their RTT p99 at twice the knee over their p99 at the knee (the target is at most 1.5),
//! and over the last step before the knee (`below_knee`), for scale.
//!
//! Everything shares the machine: the clients decode every update they receive in this process, so
//! on a small machine the knee is where the machine runs out of cores as much as where the mesh
//! does (`on_cpu_cores` per component, `load_average_1m`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use cellmesh_proto::client::{self, ClientError, ClientReceiver, ClientSender};
use cellmesh_proto::edge::{client_message, server_message, KickReason, Pong};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cluster::{border_x, component_runtime, Cluster, ClusterSpec};
use super::game::{
    self, now_ns, read_echo, stamped, with_cause, GameConfig, GameStats, TickWork, Window, ECHO,
};
use super::probe;
use super::report::{nanos_histogram, ratio};
use super::Options;

const TICK_HZ: u32 = 20;
/// One tick, the latency budget of the knee.
const TICK: Duration = Duration::from_millis(1000 / TICK_HZ as u64);
const NODES: u32 = 2;
/// The one gateway: the proxy attaches every session to it.
const GATEWAY: u32 = 2;
/// Each client's inputs.
const INPUT_EVERY: Duration = Duration::from_millis(100);
/// Bytes of each NPC's stamped component.
const PAYLOAD: usize = 32;
/// How far ahead a window opens, so every input stamped within it is sent after it opened.
const LEAD: Duration = Duration::from_millis(20);
/// The target: the admitted sessions' RTT p99 at twice the knee over their p99 at the knee.
const TARGET_RATIO: f64 = 1.5;
/// Where the avatars stand, and the middle of the NPCs' rows.
const Y: f64 = 1008.0;
/// How long a step waits for its sessions to log in (they are paced), at most.
const LOGINS_WITHIN: Duration = Duration::from_secs(15);
/// Wait before a login after a failure other than `SERVER_FULL`.
const RELOGIN: Duration = Duration::from_secs(1);
/// The nodes' admission marks. Here a game shares two cores with the mesh and every client, so
/// a game at 60 % of its budget already means the machine has no room left; a game with a host
/// of its own keeps the defaults (0.9 and 0.7).
const CLOSE_AT_LOAD: f64 = 0.6;
const OPEN_BELOW_LOAD: f64 = 0.4;
/// What a tick costs each game: its NPCs and its players are simulated, not only sent.
const TICK_WORK: TickWork = TickWork {
    per_npc: Duration::from_micros(10),
    per_player: Duration::from_micros(100),
};

struct Plan {
    npcs_per_node: usize,
    first: usize,
    growth: f64,
    steps: usize,
    /// How each step of the search is measured, and the one at twice the knee.
    step: Phase,
    twice: Phase,
}

/// How one load is let in and measured.
#[derive(Debug, Clone, Copy)]
struct Phase {
    /// Wait until every session offered is in (or a node closes for overload) before settling.
    wait_for_all: bool,
    settle: Duration,
    measure: Duration,
    /// How long an echo of an input stamped in the window may still come after it closed.
    grace: Duration,
}

impl Plan {
    fn new(opts: &Options) -> Self {
        if opts.quick {
            Self {
                npcs_per_node: 100,
                first: 60,
                growth: 1.4,
                steps: 5,
                step: Phase {
                    wait_for_all: true,
                    settle: Duration::from_millis(800),
                    measure: Duration::from_millis(1200),
                    grace: Duration::from_millis(500),
                },
                twice: Phase {
                    wait_for_all: false,
                    settle: Duration::from_secs(2),
                    measure: Duration::from_millis(1500),
                    grace: Duration::from_millis(500),
                },
            }
        } else {
            Self {
                npcs_per_node: 100,
                first: 40,
                growth: 1.2,
                steps: 16,
                step: Phase {
                    wait_for_all: true,
                    settle: Duration::from_secs(2),
                    measure: Duration::from_secs(3),
                    grace: Duration::from_secs(1),
                },
                twice: Phase {
                    wait_for_all: false,
                    settle: Duration::from_secs(4),
                    measure: Duration::from_secs(6),
                    grace: Duration::from_secs(1),
                },
            }
        }
    }

    /// The most sessions the plan may offer: twice its largest step.
    fn most(&self) -> usize {
        let last = self.first as f64 * self.growth.powi(self.steps as i32 - 1);
        2 * last.ceil() as usize + 1
    }
}

pub async fn run(opts: &Options) -> anyhow::Result<Value> {
    let plan = Plan::new(opts);
    let load_before = probe::load_average()?;
    let cluster = Cluster::start_with(
        ClusterSpec {
            nodes: NODES,
            gateways: vec![GATEWAY],
            clients: plan.most(),
            tls: false,
        },
        |cfg| {
            cfg.admission.close_at_load = CLOSE_AT_LOAD;
            cfg.admission.open_below_load = OPEN_BELOW_LOAD;
        },
    )
    .await?;
    let mut rig = Rig::start(&cluster, &plan).await?;
    let result = find_knee_and_double(&cluster, &mut rig, &plan, opts.seed).await;
    let stopped = rig.stop().await;
    let (steps, knee, twice) = with_cause(result, stopped)?;
    let load_after = probe::load_average()?;

    let rtt_ratio = ratio(twice.rtt.p99_ms, knee.rtt.p99_ms);
    let mesh_ratio = ratio(twice.mesh_rtt.p99_ms, knee.mesh_rtt.p99_ms);
    // The last load that held, for scale: the knee is the first step past it, so its p99 may
    // already be high.
    let below = steps
        .iter()
        .rev()
        .find(|s| s.knee_by() == "none")
        .unwrap_or(&knee);
    Ok(json!({
        "nodes": NODES,
        "gateway": GATEWAY,
        "tick_hz": TICK_HZ,
        "npcs_per_node": plan.npcs_per_node,
        "input_hz": 1000 / INPUT_EVERY.as_millis() as u64,
        "admission": { "close_at_load": CLOSE_AT_LOAD, "open_below_load": OPEN_BELOW_LOAD },
        "load_average_1m": { "before": load_before, "after": load_after },
        "steps": steps.iter().map(Step::json).collect::<Vec<_>>(),
        "knee": {
            // What ended the search: a node closed admission, the p99 passed a tick, or
            // neither within the plan's steps (then the last step stands for the knee).
            "by": knee.knee_by(),
            "offered_sessions": knee.offered,
            "admitted_sessions": knee.admitted,
            "delivered_updates_per_s": knee.delivered_per_s(),
            "rtt_p99_ms": knee.rtt.p99_ms,
            "mesh_rtt_p99_ms": knee.mesh_rtt.p99_ms,
            "admission_closed": knee.closed(),
            "mesh_rtt_p99_over_a_tick": knee.over_a_tick(),
        },
        // The last step before the knee (the knee itself when the first step was past it).
        "below_knee": {
            "offered_sessions": below.offered,
            "rtt_p99_ms": below.rtt.p99_ms,
            "mesh_rtt_p99_ms": below.mesh_rtt.p99_ms,
        },
        "twice": twice.json(),
        "baseline": {
            "knee_rtt_p99_ms": knee.rtt.p99_ms,
            "knee_mesh_rtt_p99_ms": knee.mesh_rtt.p99_ms,
            "target_ratio": TARGET_RATIO,
        },
        "ratio": {
            "rtt_p99_twice_vs_knee": rtt_ratio,
            "mesh_rtt_p99_twice_vs_knee": mesh_ratio,
            "admitted_twice_vs_knee": ratio(twice.admitted as f64, knee.admitted as f64),
            "rtt_p99_twice_vs_below_knee": ratio(twice.rtt.p99_ms, below.rtt.p99_ms),
        },
    }))
}

/// Every step of the search, the knee (a copy of one of them) and the measure at twice it.
async fn find_knee_and_double(
    cluster: &Cluster,
    rig: &mut Rig,
    plan: &Plan,
    seed: u64,
) -> anyhow::Result<(Vec<Step>, Step, Step)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut steps: Vec<Step> = Vec::new();
    let mut offered = plan.first as f64;
    for _ in 0..plan.steps {
        let n = offered.round() as usize;
        let step = rig.step(cluster, n, plan.step, &mut rng).await?;
        let past = step.knee_by() != "none";
        steps.push(step);
        if past {
            break;
        }
        offered *= plan.growth;
    }
    let knee = steps.last().expect("at least one step").clone();
    let twice = rig
        .step(cluster, 2 * knee.offered, plan.twice, &mut rng)
        .await?;
    Ok((steps, knee, twice))
}

/// Percentiles of one window, in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
struct Rtt {
    samples: u64,
    p50_ms: f64,
    p99_ms: f64,
}

impl Rtt {
    fn of(h: &hdrhistogram::Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let ms = |q: f64| (h.value_at_quantile(q) as f64 / 1e6 * 100.0).round() / 100.0;
        Self {
            samples: h.len(),
            p50_ms: ms(0.5),
            p99_ms: ms(0.99),
        }
    }

    fn json(&self) -> Value {
        json!({ "samples": self.samples, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms })
    }
}

/// One load offered and measured.
#[derive(Debug, Clone)]
struct Step {
    offered: usize,
    /// Sessions the proxy held at the end of the window.
    admitted: u64,
    /// Logins refused `SERVER_FULL` during the step (the refused retry, so one client may
    /// count several times).
    refused: u64,
    /// Node admission closings during the step, by reason: tick overrun, outbox pressure
    /// (overload), login burst, at capacity (pauses, not overload).
    closings: [u64; 4],
    /// Admitted sessions the proxy ended (slow consumers, gateways lost) during the step.
    sessions_lost: u64,
    rtt: Rtt,
    mesh_rtt: Rtt,
    /// Echoes that came back within the grace, of the inputs sent in the window.
    echo_delivery: f64,
    /// Entity deltas the clients received over the window.
    deltas: u64,
    seconds: f64,
    /// The highest tick time each game reported over the step, as a share of its budget.
    load_share_max: Vec<f64>,
    /// Each component's time on a CPU over the window, in cores: `sidecar-N`, `proxy`,
    /// `game-N`, and `bench` (the clients and this driver).
    on_cpu_cores: BTreeMap<String, f64>,
}

impl Step {
    /// Whether a node closed for overload (a login burst only paces).
    fn closed(&self) -> bool {
        self.closings[0] + self.closings[1] > 0
    }

    fn over_a_tick(&self) -> bool {
        self.mesh_rtt.p99_ms > TICK.as_secs_f64() * 1000.0
    }

    fn knee_by(&self) -> &'static str {
        if self.closed() {
            "admission_closed"
        } else if self.over_a_tick() {
            "mesh_rtt_p99_over_a_tick"
        } else {
            "none"
        }
    }

    fn delivered_per_s(&self) -> f64 {
        (self.deltas as f64 / self.seconds).round()
    }

    fn json(&self) -> Value {
        json!({
            "offered_sessions": self.offered,
            "admitted_sessions": self.admitted,
            "refused_server_full": self.refused,
            "closings": {
                "tick_overrun": self.closings[0],
                "outbox_pressure": self.closings[1],
                "login_burst": self.closings[2],
                "at_capacity": self.closings[3],
            },
            "sessions_lost": self.sessions_lost,
            "rtt": self.rtt.json(),
            "mesh_rtt": self.mesh_rtt.json(),
            "echo_delivery": (self.echo_delivery * 1000.0).round() / 1000.0,
            "delivered_updates_per_s": self.delivered_per_s(),
            "game_load_share_max": self.load_share_max,
            "on_cpu_cores": self.on_cpu_cores,
        })
    }
}

/// What the clients saw, shared by all of them.
struct Seen {
    window: Window,
    /// RTT and mesh RTT (ns) of the echoes of inputs stamped within the window.
    rtt: Mutex<(hdrhistogram::Histogram<u64>, hdrhistogram::Histogram<u64>)>,
    inputs_in_window: AtomicU64,
    deltas: AtomicU64,
    /// Whether deltas count now (while the window is open).
    counting: std::sync::atomic::AtomicBool,
    refused: AtomicU64,
    lost: AtomicU64,
}

impl Seen {
    fn new() -> Self {
        Self {
            window: Window::default(),
            rtt: Mutex::new((nanos_histogram(), nanos_histogram())),
            inputs_in_window: AtomicU64::new(0),
            deltas: AtomicU64::new(0),
            counting: Default::default(),
            refused: AtomicU64::new(0),
            lost: AtomicU64::new(0),
        }
    }
}

/// The games and clients of the scenario.
struct Rig {
    seen: Arc<Seen>,
    game_stats: Vec<Arc<GameStats>>,
    stop: CancellationToken,
    games: Vec<JoinHandle<anyhow::Result<()>>>,
    /// Held for their drop: each game's own thread.
    _game_runtimes: GameRuntimes,
    clients: Vec<JoinHandle<()>>,
}

impl Rig {
    async fn start(cluster: &Cluster, plan: &Plan) -> anyhow::Result<Self> {
        let x = border_x(&cluster.world, NODES, 1);
        let chunk = cluster.world.chunk_size;
        let row = (Y / chunk).floor() * chunk;
        let stop = CancellationToken::new();
        let mut rng = StdRng::seed_from_u64(7);
        let (mut games, mut game_runtimes, mut game_stats) = (Vec::new(), Vec::new(), Vec::new());
        for node in 1..=NODES {
            // Node 1's NPCs four and three chunk columns west of the border, node 2's two and
            // three east; the avatars (node 2's) a chunk and a half east of it: every NPC within
            // every view, no avatar in node 1's interaction band.
            let npc_x = if node == 1 {
                x - 4.0 * chunk + 1.0..x - 2.0 * chunk - 1.0
            } else {
                x + 2.0 * chunk + 1.0..x + 4.0 * chunk - 1.0
            };
            let avatar_x = x + 48.0;
            let npcs = (0..plan.npcs_per_node)
                .map(|_| {
                    (
                        rng.random_range(npc_x.clone()),
                        rng.random_range(row - 4.0 * chunk + 1.0..row + 5.0 * chunk - 1.0),
                    )
                })
                .collect();
            let rt = component_runtime(&format!("game-{node}"))?;
            let stats = Arc::new(GameStats::default());
            game_stats.push(stats.clone());
            games.push(rt.spawn(game::run(
                GameConfig {
                    sidecar: cluster.local_addr(node),
                    tick_hz: TICK_HZ,
                    npcs,
                    payload_bytes: PAYLOAD,
                    avatar_at: (avatar_x, Y),
                    echo_inputs: true,
                    report_load: true,
                    tick_work: Some(TICK_WORK),
                    ..GameConfig::default()
                },
                stats,
                stop.clone(),
            )));
            game_runtimes.push(rt);
        }
        let rig = Self {
            seen: Arc::new(Seen::new()),
            game_stats,
            stop,
            games,
            _game_runtimes: GameRuntimes(game_runtimes),
            clients: Vec::new(),
        };
        let want = (plan.npcs_per_node * NODES as usize) as u64;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !(cluster.sidecars.iter().all(|s| s.stats().game_connected)
            && cluster
                .sidecars
                .iter()
                .map(|s| s.stats().entities)
                .sum::<u64>()
                >= want)
        {
            anyhow::ensure!(
                !rig.games.iter().any(JoinHandle::is_finished),
                "a game stopped before its NPCs were spawned"
            );
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the games' NPCs were not spawned within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(rig)
    }

    /// Offers `offered` sessions (starting the clients missing), lets them settle, and measures
    /// one window.
    async fn step(
        &mut self,
        cluster: &Cluster,
        offered: usize,
        phase: Phase,
        rng: &mut StdRng,
    ) -> anyhow::Result<Step> {
        let Phase {
            wait_for_all,
            settle,
            measure,
            grace,
        } = phase;
        let before = Counters::read(cluster, &self.seen);
        for g in &self.game_stats {
            g.load_us_max.store(0, Relaxed);
        }
        for i in self.clients.len()..offered {
            // Logins arrive over a short while, as a crowd does, not in one instant.
            let delay = Duration::from_millis(rng.random_range(0..500));
            self.clients.push(tokio::spawn(player(
                cluster.proxy_addr(),
                cluster.token(&format!("overload-{i}")),
                delay,
                self.seen.clone(),
                self.stop.clone(),
                rng.random(),
            )));
        }
        // Logins are paced (a share of the sessions a node holds per report): wait until
        // everyone offered is in, or a node closed for overload, or the time is up.
        let deadline = tokio::time::Instant::now() + LOGINS_WITHIN;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = Counters::read(cluster, &self.seen);
            let overloaded = (0..2).any(|i| now.closings[i] > before.closings[i]);
            let all_in = cluster.proxy.stats().sessions >= offered as u64;
            if all_in || overloaded || !wait_for_all || tokio::time::Instant::now() >= deadline {
                break;
            }
        }
        tokio::time::sleep(settle).await;
        anyhow::ensure!(
            !self.games.iter().any(JoinHandle::is_finished),
            "a game stopped"
        );

        let seen = &self.seen;
        {
            let mut rtt = seen.rtt.lock().expect("rtt lock poisoned");
            rtt.0.reset();
            rtt.1.reset();
        }
        seen.inputs_in_window.store(0, Relaxed);
        seen.deltas.store(0, Relaxed);
        let from = now_ns() + LEAD.as_nanos() as u64;
        seen.window.open(from, from + measure.as_nanos() as u64);
        tokio::time::sleep(LEAD).await;
        seen.counting.store(true, Relaxed);
        let cpu_before = probe::CpuSample::now()?;
        tokio::time::sleep(measure).await;
        let cpu = probe::CpuSample::now()?.since(&cpu_before);
        seen.counting.store(false, Relaxed);
        let deltas = seen.deltas.load(Relaxed);
        let admitted = cluster.proxy.stats().sessions;
        tokio::time::sleep(grace).await;
        let (rtt, mesh_rtt) = {
            let h = seen.rtt.lock().expect("rtt lock poisoned");
            (Rtt::of(&h.0), Rtt::of(&h.1))
        };
        let after = Counters::read(cluster, seen);
        let sent = seen.inputs_in_window.load(Relaxed);
        Ok(Step {
            offered,
            admitted,
            refused: after.refused - before.refused,
            closings: std::array::from_fn(|i| after.closings[i] - before.closings[i]),
            sessions_lost: after.lost - before.lost,
            rtt,
            mesh_rtt,
            echo_delivery: if sent == 0 {
                0.0
            } else {
                rtt.samples as f64 / sent as f64
            },
            deltas,
            seconds: measure.as_secs_f64(),
            load_share_max: self
                .game_stats
                .iter()
                .map(|g| {
                    let us = g.load_us_max.load(Relaxed) as f64;
                    (us / TICK.as_micros() as f64 * 1000.0).round() / 1000.0
                })
                .collect(),
            on_cpu_cores: cores_by_component(&cpu, measure),
        })
    }

    /// Stops the games and clients; why the first game that failed did.
    async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        for c in self.clients {
            let _ = c.await;
        }
        let mut first = Ok(());
        for g in self.games {
            let r = g.await.context("a game task").and_then(|r| r);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// The games' runtimes, shut down in the background when dropped (a runtime dropped the
/// ordinary way inside an async context panics).
struct GameRuntimes(Vec<tokio::runtime::Runtime>);

impl Drop for GameRuntimes {
    fn drop(&mut self) {
        for rt in self.0.drain(..) {
            rt.shutdown_background();
        }
    }
}

/// Time on a CPU by component, in cores: threads named after a component count for it, the
/// rest of the process for `bench`.
fn cores_by_component(
    cpu: &BTreeMap<String, probe::CpuTime>,
    over: Duration,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (name, t) in cpu {
        let component = if ["sidecar-", "game-", "proxy"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            name.as_str()
        } else {
            "bench"
        };
        *out.entry(component.to_string()).or_insert(0.0) += t.on_cpu_s / over.as_secs_f64();
    }
    out.values_mut()
        .for_each(|c| *c = (*c * 1000.0).round() / 1000.0);
    out
}

/// Cumulative counters a step is the difference of.
struct Counters {
    refused: u64,
    /// By reason: tick overrun, outbox pressure, login burst, at capacity.
    closings: [u64; 4],
    lost: u64,
}

impl Counters {
    fn read(cluster: &Cluster, seen: &Seen) -> Self {
        const NAME: &str = "cellmesh_sidecar_admission_closings_total";
        // The gateway's: node 1 takes no sessions, so its admission decides nothing.
        let text = cluster.sidecars[GATEWAY as usize - 1].admin.metrics_text();
        let closings = |reason: &str| probe::counter(&text, NAME, &[("reason", reason)]);
        Self {
            refused: cluster.proxy.stats().logins_refused,
            closings: [
                closings("tick_overrun"),
                closings("outbox_pressure"),
                closings("login_burst"),
                closings("at_capacity"),
            ],
            lost: seen.lost.load(Relaxed),
        }
    }
}

/// One player: logs in (after `delay`), and again after the proxy's hint while it is refused
/// `SERVER_FULL`, or after a second when its session is lost; sends an input every 100 ms and
/// times each one's echo.
async fn player(
    proxy: String,
    token: String,
    delay: Duration,
    seen: Arc<Seen>,
    stop: CancellationToken,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut wait = delay;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let login = tokio::select! {
            _ = stop.cancelled() => return,
            r = client::login(&proxy, &token) => r,
        };
        wait = match login {
            Ok((tx, rx, _welcome)) => match play(tx, rx, &seen, &stop).await {
                Ok(()) => return,
                Err(e) => {
                    seen.lost.fetch_add(1, Relaxed);
                    tracing::debug!(error = %e, "bench player lost its session");
                    RELOGIN
                }
            },
            Err(ClientError::Kicked(k)) if k.reason == KickReason::ServerFull as i32 => {
                seen.refused.fetch_add(1, Relaxed);
                let hint = Duration::from_millis(u64::from(k.retry_after_ms));
                // Jittered, so the refused do not all come back in the same instant.
                hint.max(RELOGIN).mul_f64(1.0 + rng.random_range(0.0..0.5))
            }
            Err(e) => {
                tracing::debug!(error = %e, "bench player could not log in");
                RELOGIN
            }
        };
    }
}

async fn play(
    mut tx: ClientSender,
    mut rx: ClientReceiver,
    seen: &Seen,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let mut inputs = tokio::time::interval(INPUT_EVERY);
    inputs.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                let _ = tx.close().await;
                return Ok(());
            }
            msg = rx.next() => {
                let Some(msg) = msg else {
                    anyhow::bail!("the proxy closed the connection");
                };
                match msg.map_err(|e| anyhow::anyhow!("{e}"))?.body {
                    Some(server_message::Body::Batch(b)) => {
                        let now = now_ns();
                        if seen.counting.load(Relaxed) {
                            seen.deltas.fetch_add(b.deltas.len() as u64, Relaxed);
                        }
                        let window = seen.window.get();
                        for e in b.events.iter().filter(|e| e.r#type == ECHO) {
                            let Some((sent, _, held)) = read_echo(&e.payload) else {
                                continue;
                            };
                            if (window.0..window.1).contains(&sent) {
                                let rtt = now.saturating_sub(sent).max(1);
                                let mesh = rtt.saturating_sub(held).max(1);
                                let mut h = seen.rtt.lock().expect("rtt lock poisoned");
                                let _ = h.0.record(rtt);
                                let _ = h.1.record(mesh);
                            }
                        }
                    }
                    Some(server_message::Body::Ping(p)) => {
                        tx.send(client_message::Body::Pong(Pong { nonce: p.nonce })).await?;
                    }
                    Some(server_message::Body::Kick(k)) => anyhow::bail!("kicked: {k:?}"),
                    _ => {}
                }
            }
            _ = inputs.tick() => {
                seq += 1;
                let payload = stamped(game::STAMP_LEN, seq);
                if let Some((sent, _)) = game::read_stamp(&payload) {
                    let window = seen.window.get();
                    if (window.0..window.1).contains(&sent) {
                        seen.inputs_in_window.fetch_add(1, Relaxed);
                    }
                }
                tx.input(seq, payload).await?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(closings: [u64; 4], mesh_p99_ms: f64) -> Step {
        Step {
            offered: 100,
            admitted: 100,
            refused: 0,
            closings,
            sessions_lost: 0,
            rtt: Rtt::default(),
            mesh_rtt: Rtt {
                samples: 10,
                p50_ms: 1.0,
                p99_ms: mesh_p99_ms,
            },
            echo_delivery: 1.0,
            deltas: 0,
            seconds: 1.0,
            load_share_max: vec![],
            on_cpu_cores: BTreeMap::new(),
        }
    }

    #[test]
    fn the_knee_is_an_overload_closing_or_a_p99_past_a_tick_and_pacing_is_neither() {
        assert_eq!(step([0, 0, 0, 0], 20.0).knee_by(), "none");
        assert_eq!(step([0, 0, 5, 0], 20.0).knee_by(), "none", "pacing only");
        assert_eq!(step([1, 0, 0, 0], 20.0).knee_by(), "admission_closed");
        assert_eq!(step([0, 1, 0, 0], 80.0).knee_by(), "admission_closed");
        assert_eq!(
            step([0, 0, 1, 0], 50.1).knee_by(),
            "mesh_rtt_p99_over_a_tick"
        );
        assert_eq!(
            step([0, 0, 0, 0], 50.0).knee_by(),
            "none",
            "a tick is still within"
        );
    }

    #[test]
    fn cpu_time_is_summed_by_component_in_cores() {
        let t = |s: f64| probe::CpuTime {
            on_cpu_s: s,
            waiting_s: 0.0,
        };
        let cpu: BTreeMap<String, probe::CpuTime> = [
            ("sidecar-1".to_string(), t(1.0)),
            ("game-2".to_string(), t(0.5)),
            ("proxy".to_string(), t(0.25)),
            ("tokio-runtime-w".to_string(), t(0.5)),
            ("cellmesh".to_string(), t(0.5)),
        ]
        .into();
        let cores = cores_by_component(&cpu, Duration::from_secs(2));
        assert_eq!(
            cores.into_iter().collect::<Vec<_>>(),
            [
                ("bench".to_string(), 0.5),
                ("game-2".to_string(), 0.25),
                ("proxy".to_string(), 0.125),
                ("sidecar-1".to_string(), 0.5),
            ]
        );
    }

    #[test]
    fn the_proxy_is_sized_for_twice_the_largest_step() {
        for quick in [true, false] {
            let plan = Plan::new(&Options {
                quick,
                seed: 1,
                exe: "cellmesh".into(),
                redis_url: None,
            });
            let mut offered = plan.first as f64;
            for _ in 1..plan.steps {
                offered *= plan.growth;
            }
            assert!(plan.most() >= 2 * offered.round() as usize, "quick {quick}");
        }
    }
}
