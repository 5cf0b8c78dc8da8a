//! `fanout`: NPCs on node 1 updated at 20 Hz, watched by K clients whose sessions sit on the
//! other nodes (the gateways), so every update crosses the mesh once per subscribed gateway and
//! fans out to that gateway's clients there.
//!
//! Layout: the world in vertical strips, node 1 westmost. Node 1's game spawns the NPCs in the
//! three chunk columns from 160 m to 64 m west of the border with node 2 (inside every client's
//! view, outside the interaction band, so they are render ghosts only). Every client's avatar
//! stands 16 m east of the border, on node 2 (a gateway other than node 2 hands it to node 2, and
//! follows it from there). The gateways' games end a tick 200 times a second: a gateway sends its
//! clients what it holds at each tick's end, so that wait stays under 5 ms of the one-tick budget.
//!
//! A measurement window is a span of stamp times: the game counts the updates it stamped within
//! it, the clients the ones they received (the latency of each is receipt time minus stamp).
//! "Delivered" is updates received by clients, one per viewer; an update still missing a grace
//! period after the window closed counts as not delivered.
//!
//! Two parts, on one cluster:
//!
//! - `per_viewers`: at a fixed load, clients are added (K = 1, 10, 30 quick; 1, 10, 100 full) and
//!   for each K the bytes node 1 wrote on its mesh links (its `bytes{direction="out",
//!   peer="sidecar"}` counter: every mesh frame with its length prefix, heartbeats and other
//!   control messages included) divided by updates sent and by subscribed gateways (those holding
//!   a ghost of every NPC). Beside it, the gateways' bytes toward the proxy per delivered update
//!   (their `peer="proxy"` counter, which also holds the little they send back on the links the
//!   lower-numbered sidecars dialled, since an accepted link is counted as a proxy link).
//! - `sweep`: at the largest K, the NPCs updated per tick double from a small number while the
//!   clients' p99 latency stays within one tick (50 ms) and at least 99 % of the updates arrive,
//!   then the gap between the last load that held and the first that did not is halved twice.
//!   The knee is the last load that held; after a load that did not, the updates stop until the
//!   clients received the backlog, so it does not burden the next. `peak_delivered_updates_per_s`
//!   is the most any load delivered, held or not: where throughput rather than latency ends.
//!   CPU is each component's threads' time on a CPU over the window, from
//!   `/proc/self/task/*/schedstat`, in cores (`on_cpu_cores`), beside the time they were
//!   runnable but waited for a CPU (`waiting_for_cpu_cores`): `mesh_cpu_s...` sums the
//!   `sidecar-N` and `proxy` threads; `bench` is everything else in the process (the games, the
//!   clients, this driver). The games and clients share the machine with the mesh, and so does
//!   whatever else runs there (`load_average_1m`), so on a small or busy machine the knee is
//!   where the machine runs out of cores as much as where the mesh does. `limited_by` names the
//!   busiest component past the knee, its work per tick (it comes in one burst a tick, so a
//!   client's latency grows with it) and how long it waited for a CPU.
//!
//! Neither p99 nor delivery is a pass mark: they only decide where the sweep stops.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cluster::{border_x, Cluster, ClusterSpec};
use super::game::{self, now_ns, with_cause, GameConfig, GameControl, GameStats, Watched, Window};
use super::probe::{self, CpuSample, CpuTime};
use super::report::{nanos_histogram, ratio, Latency};
use super::Options;

const TICK_HZ: u32 = 20;
/// One tick, the latency budget.
const TICK: Duration = Duration::from_millis(1000 / TICK_HZ as u64);
const GATEWAY_TICK_HZ: u32 = 200;
/// Bytes of the updated component: a stamp and a little state.
const PAYLOAD: usize = 32;
/// The share of updates that must arrive for a load to hold.
const DELIVERY_HELD: f64 = 0.99;
/// How long an update of a window may still arrive after the window closed.
const GRACE: Duration = Duration::from_millis(300);
/// How far ahead a window opens: every game tick that may stamp within it starts after it
/// opened, so the game and the clients count the same updates.
const LEAD: Duration = Duration::from_millis(60);
/// The target: public updates delivered per CPU-second of the mesh.
const TARGET_UPDATES_PER_CPU_S: f64 = 1_000_000.0;
/// NPCs updated per tick while the bytes per viewer count are measured.
const PER_VIEWERS_NPCS: usize = 100;
/// Where the avatars stand, and the middle of the NPCs' rows.
const Y: f64 = 1008.0;

struct Plan {
    nodes: u32,
    viewers: Vec<usize>,
    npcs: usize,
    sweep_from: usize,
    sweep_steps: usize,
    settle: Duration,
    measure: Duration,
}

impl Plan {
    fn new(opts: &Options) -> Self {
        if opts.quick {
            Self {
                nodes: 2,
                viewers: vec![1, 10, 30],
                npcs: 3200,
                sweep_from: 100,
                sweep_steps: 8,
                settle: Duration::from_millis(300),
                measure: Duration::from_millis(800),
            }
        } else {
            Self {
                nodes: 3,
                viewers: vec![1, 10, 100],
                npcs: 6400,
                sweep_from: 50,
                sweep_steps: 11,
                settle: Duration::from_millis(500),
                measure: Duration::from_secs(3),
            }
        }
    }
}

pub async fn run(opts: &Options) -> anyhow::Result<Value> {
    let plan = Plan::new(opts);
    let load_before = probe::load_average()?;
    let most = *plan.viewers.iter().max().expect("some viewer counts");
    let cluster = Cluster::start(ClusterSpec {
        nodes: plan.nodes,
        gateways: (2..=plan.nodes).collect(),
        clients: most,
        tls: false,
    })
    .await?;
    let mut rig = Rig::start(&cluster, &plan, opts.seed).await?;
    let result = measure_all(&cluster, &mut rig, &plan).await;
    let stopped = rig.stop().await;
    let (per_viewers, steps, knee) = with_cause(result, stopped)?;
    let load_after = probe::load_average()?;

    let first = &per_viewers[0];
    let last = &per_viewers[per_viewers.len() - 1];
    let knee_cpu_rate = knee.delivered as f64 / knee.mesh_cpu_s();
    Ok(json!({
        "nodes": plan.nodes,
        "gateways": plan.nodes - 1,
        "tick_hz": TICK_HZ,
        "gateway_tick_hz": GATEWAY_TICK_HZ,
        "payload_bytes": PAYLOAD,
        "npcs_spawned": plan.npcs,
        // The machine's, not this process's: other work there takes CPUs from the mesh.
        "load_average_1m": { "before": load_before, "after": load_after },
        "per_viewers": per_viewers.iter().map(Measured::per_viewers_json).collect::<Vec<_>>(),
        "sweep": {
            "viewers": most,
            "steps": steps.iter().map(|s| s.step_json(plan.nodes)).collect::<Vec<_>>(),
        },
        // The most any load delivered, held or not: where throughput, not latency, ends.
        "peak_delivered_updates_per_s": steps
            .iter()
            .map(|s| (s.delivered as f64 / s.seconds).round())
            .fold(0.0, f64::max),
        "knee": {
            "held": knee.held(),
            "npcs_updated": knee.npcs_updated,
            "offered_updates_per_s": knee.npcs_updated as u64 * u64::from(TICK_HZ),
            "delivered_updates_per_s": (knee.delivered as f64 / knee.seconds).round(),
            "p99_us": knee.latency().p99_us,
            "mesh_cpu_s_per_million_delivered": round3(knee.mesh_cpu_s() / knee.delivered.max(1) as f64 * 1e6),
            "delivered_updates_per_mesh_cpu_s": knee_cpu_rate.round(),
            "mesh_bytes_per_update_per_node": round3(knee.mesh_bytes_per_update_per_node()),
            "limited_by": limit_of(&steps, &knee, plan.nodes),
        },
        "baseline": {
            "mesh_bytes_per_update_per_node_one_viewer": round3(first.mesh_bytes_per_update_per_node()),
            "target_updates_per_cpu_s": TARGET_UPDATES_PER_CPU_S,
        },
        "ratio": {
            "mesh_bytes_per_update_most_vs_one_viewer": ratio(
                last.mesh_bytes_per_update_per_node(),
                first.mesh_bytes_per_update_per_node(),
            ),
            "updates_per_cpu_s_vs_target": ratio(knee_cpu_rate, TARGET_UPDATES_PER_CPU_S),
        },
    }))
}

/// The per-viewer-count windows, every sweep step, and the knee (a copy of one of the steps).
async fn measure_all(
    cluster: &Cluster,
    rig: &mut Rig,
    plan: &Plan,
) -> anyhow::Result<(Vec<Measured>, Vec<Measured>, Measured)> {
    let mut per_viewers = Vec::new();
    for &k in &plan.viewers {
        rig.add_clients(cluster, k, plan.npcs).await?;
        rig.control.set_update_limit(PER_VIEWERS_NPCS);
        tokio::time::sleep(plan.settle).await;
        let m = rig.measure(cluster, PER_VIEWERS_NPCS, plan).await?;
        anyhow::ensure!(
            m.subscribed_nodes > 0,
            "no gateway holds a ghost of every NPC with {k} clients watching"
        );
        anyhow::ensure!(
            m.clients_lost == 0,
            "{} of {k} clients lost their session at {PER_VIEWERS_NPCS} NPCs updated",
            m.clients_lost
        );
        per_viewers.push(m);
    }

    let mut sweep = Sweep::new(plan.npcs, 2, plan.sweep_steps);
    let mut steps: Vec<Measured> = Vec::new();
    let mut next = Some(plan.sweep_from.min(plan.npcs));
    while let Some(n) = next {
        rig.control.set_update_limit(n);
        tokio::time::sleep(plan.settle).await;
        let m = rig.measure(cluster, n, plan).await?;
        let (held, lost) = (m.held(), m.clients_lost > 0);
        steps.push(m);
        // Clients cut off for falling behind cannot be measured again.
        next = if lost { None } else { sweep.next(n, held) };
        if !held && next.is_some() {
            rig.drain().await?;
        }
    }
    let knee = steps
        .iter()
        .filter(|s| s.held())
        .max_by_key(|s| s.npcs_updated)
        .or_else(|| steps.iter().min_by_key(|s| s.npcs_updated))
        .expect("at least one step")
        .clone();
    Ok((per_viewers, steps, knee))
}

/// What ran out at the first load past the knee (or at the knee when every load held): the
/// component with the most time on a CPU, and how long it waited for one.
fn limit_of(steps: &[Measured], knee: &Measured, nodes: u32) -> String {
    let past = steps
        .iter()
        .filter(|s| !s.held() && s.npcs_updated > knee.npcs_updated)
        .min_by_key(|s| s.npcs_updated)
        .unwrap_or(knee);
    let busiest = past
        .utilisation(nodes)
        .into_iter()
        .max_by(|a, b| a.1.on_cpu_s.total_cmp(&b.1.on_cpu_s));
    let Some((name, t)) = busiest else {
        return "unknown".into();
    };
    // Its work comes in one burst a tick, so latency grows with its time per tick.
    let what = format!(
        "{name}: {:.2} of a core on a CPU ({:.0} ms a tick), {:.2} waiting for one, at {} NPCs",
        t.on_cpu_s,
        t.on_cpu_s * TICK.as_secs_f64() * 1000.0,
        t.waiting_s,
        past.npcs_updated
    );
    if past.held() {
        format!("nothing: every load held (busiest {what})")
    } else {
        what
    }
}

/// A client's task, and what it saw.
struct Client {
    task: JoinHandle<anyhow::Result<()>>,
    seen: Arc<Mutex<Watched>>,
}

/// The games and clients of the scenario.
struct Rig {
    window: Arc<Window>,
    control: Arc<GameControl>,
    stop: CancellationToken,
    games: Vec<JoinHandle<anyhow::Result<()>>>,
    clients: Vec<Client>,
    /// Node ids of the gateways.
    gateways: Vec<u32>,
}

impl Rig {
    async fn start(cluster: &Cluster, plan: &Plan, seed: u64) -> anyhow::Result<Self> {
        let x = border_x(&cluster.world, plan.nodes, 1);
        let window = Arc::new(Window::default());
        let control = Arc::new(GameControl::new(window.clone()));
        control.set_update_limit(0);
        let stop = CancellationToken::new();
        let mut rng = StdRng::seed_from_u64(seed);
        // Chunk columns 5 to 3 west of the border, the five chunk rows either side of the
        // avatars' row: all in view, none in the interaction band.
        let chunk = cluster.world.chunk_size;
        let row = (Y / chunk).floor() * chunk;
        let npcs = (0..plan.npcs)
            .map(|_| {
                (
                    rng.random_range(x - 5.0 * chunk + 1.0..x - 2.0 * chunk - 1.0),
                    rng.random_range(row - 5.0 * chunk + 1.0..row + 6.0 * chunk - 1.0),
                )
            })
            .collect();
        let mut games = vec![tokio::spawn(game::run(
            GameConfig {
                sidecar: cluster.local_addr(1),
                tick_hz: TICK_HZ,
                npcs,
                payload_bytes: PAYLOAD,
                spawn_per_tick: 2000,
                control: Some(control.clone()),
                ..GameConfig::default()
            },
            Arc::new(GameStats::default()),
            stop.clone(),
        ))];
        let gateways: Vec<u32> = (2..=plan.nodes).collect();
        for &g in &gateways {
            games.push(tokio::spawn(game::run(
                GameConfig {
                    sidecar: cluster.local_addr(g),
                    tick_hz: GATEWAY_TICK_HZ,
                    avatar_at: (x + 16.0, Y),
                    payload_bytes: PAYLOAD,
                    update_npcs: false,
                    ..GameConfig::default()
                },
                Arc::new(GameStats::default()),
                stop.clone(),
            )));
        }
        let rig = Self {
            window,
            control,
            stop,
            games,
            clients: Vec::new(),
            gateways,
        };
        rig.wait("every game connected and node 1's NPCs spawned", || {
            cluster.sidecars.iter().all(|s| s.stats().game_connected)
                && cluster.sidecars[0].stats().entities >= plan.npcs as u64
        })
        .await?;
        Ok(rig)
    }

    /// Polls `ready` for up to 20 s, failing early when a game or client task ended.
    async fn wait(&self, what: &str, ready: impl Fn() -> bool) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !ready() {
            let ended = self
                .games
                .iter()
                .chain(self.clients.iter().map(|c| &c.task));
            anyhow::ensure!(
                !ended.into_iter().any(JoinHandle::is_finished),
                "{what}: a game or client stopped"
            );
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Logs clients in until there are `k`, and waits until each was shown every NPC.
    async fn add_clients(
        &mut self,
        cluster: &Cluster,
        k: usize,
        npcs: usize,
    ) -> anyhow::Result<()> {
        for i in self.clients.len()..k {
            let seen = Arc::new(Mutex::new(Watched::new()));
            let task = tokio::spawn(game::watch_window(
                cluster.proxy_addr(),
                cluster.token(&format!("fanout-{i}")),
                self.window.clone(),
                seen.clone(),
                0,
                self.stop.clone(),
            ));
            self.clients.push(Client { task, seen });
        }
        let clients = &self.clients;
        self.wait(&format!("{k} clients shown all {npcs} NPCs"), || {
            clients.iter().all(|Client { seen, .. }| {
                seen.lock().expect("client tally lock poisoned").appeared >= npcs as u64
            })
        })
        .await
    }

    /// One window of `plan.measure` at `npcs` NPCs updated per tick.
    async fn measure(
        &self,
        cluster: &Cluster,
        npcs: usize,
        plan: &Plan,
    ) -> anyhow::Result<Measured> {
        let from = now_ns() + LEAD.as_nanos() as u64;
        self.window
            .open(from, from + plan.measure.as_nanos() as u64);
        // Before the window starts: nothing within it was counted yet.
        self.control.take_stamped_in_window();
        for Client { seen, .. } in &self.clients {
            let mut seen = seen.lock().expect("client tally lock poisoned");
            seen.latency.reset();
            seen.updates = 0;
        }
        tokio::time::sleep(LEAD).await;
        let cpu_before = CpuSample::now()?;
        let bytes_before = Written::read(cluster, &self.gateways);
        tokio::time::sleep(plan.measure).await;
        let cpu = CpuSample::now()?.since(&cpu_before);
        let bytes = Written::read(cluster, &self.gateways).minus(&bytes_before);
        tokio::time::sleep(GRACE).await;

        let mut latency = nanos_histogram();
        let mut delivered = 0;
        for Client { seen, .. } in &self.clients {
            let seen = seen.lock().expect("client tally lock poisoned");
            latency
                .add(&seen.latency)
                .context("merging latency histograms")?;
            delivered += seen.updates;
        }
        let subscribed_nodes = self
            .gateways
            .iter()
            .filter(|&&g| {
                cluster.sidecars[g as usize - 1].stats().ghosts_render >= plan.npcs as u64
            })
            .count();
        Ok(Measured {
            npcs_updated: npcs,
            viewers: self.clients.len(),
            subscribed_nodes,
            sent: self.control.take_stamped_in_window(),
            delivered,
            latency,
            seconds: plan.measure.as_secs_f64(),
            cpu,
            bytes,
            clients_lost: self.clients.iter().filter(|c| c.task.is_finished()).count(),
        })
    }

    /// Stops the updates and waits (up to 10 s) until the clients stop receiving what was
    /// queued for them, so that a load that fell behind leaves no backlog to the next.
    async fn drain(&self) -> anyhow::Result<()> {
        self.control.set_update_limit(0);
        self.window.open(0, now_ns());
        let received = || -> u64 {
            self.clients
                .iter()
                .map(|c| c.seen.lock().expect("client tally lock poisoned").updates)
                .sum()
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut last = received();
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let now = received();
            if now == last {
                return Ok(());
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the clients still received a backlog 10 s after the updates stopped"
            );
            last = now;
        }
    }

    /// Stops the games and clients; why the first of them that failed did.
    async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        let mut first = Ok(());
        for t in self
            .games
            .into_iter()
            .chain(self.clients.into_iter().map(|c| c.task))
        {
            let r = t.await.context("a game or client task").and_then(|r| r);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// Bytes node 1 wrote to its peer sidecars, and the gateways to the proxy.
#[derive(Debug, Clone, Copy, Default)]
struct Written {
    mesh: u64,
    to_proxy: u64,
}

impl Written {
    fn read(cluster: &Cluster, gateways: &[u32]) -> Self {
        const NAME: &str = "cellmesh_sidecar_bytes_total";
        let written = |node: u32, peer: &str| {
            let text = cluster.sidecars[node as usize - 1].admin.metrics_text();
            probe::counter(&text, NAME, &[("direction", "out"), ("peer", peer)])
        };
        Self {
            mesh: written(1, "sidecar"),
            to_proxy: gateways.iter().map(|&g| written(g, "proxy")).sum(),
        }
    }

    fn minus(self, before: &Self) -> Self {
        Self {
            mesh: self.mesh.saturating_sub(before.mesh),
            to_proxy: self.to_proxy.saturating_sub(before.to_proxy),
        }
    }
}

/// One measurement window.
#[derive(Debug, Clone)]
struct Measured {
    npcs_updated: usize,
    viewers: usize,
    subscribed_nodes: usize,
    /// Updates the game stamped within the window.
    sent: u64,
    /// Of those, received by clients (one per viewer) within the grace period.
    delivered: u64,
    latency: hdrhistogram::Histogram<u64>,
    seconds: f64,
    /// CPU time by thread name.
    cpu: BTreeMap<String, CpuTime>,
    bytes: Written,
    clients_lost: usize,
}

impl Measured {
    fn latency(&self) -> Latency {
        Latency::from_nanos(&self.latency)
    }

    /// The share of the updates owed to clients that arrived.
    fn delivery(&self) -> f64 {
        let owed = self.sent * self.viewers as u64;
        if owed == 0 {
            return 0.0;
        }
        self.delivered as f64 / owed as f64
    }

    fn held(&self) -> bool {
        self.clients_lost == 0
            && self.delivery() >= DELIVERY_HELD
            && self.latency().p99_us <= TICK.as_micros() as f64
    }

    fn mesh_cpu_s(&self) -> f64 {
        self.cpu
            .iter()
            .filter(|(name, _)| is_mesh_thread(name))
            .map(|(_, t)| t.on_cpu_s)
            .sum()
    }

    /// Each component's time over the window, in cores (seconds a second): the sidecars and
    /// the proxy by name, the rest of the process as `bench`.
    fn utilisation(&self, nodes: u32) -> BTreeMap<String, CpuTime> {
        let mut out: BTreeMap<String, CpuTime> = (1..=nodes)
            .map(|n| format!("sidecar-{n}"))
            .chain(["proxy".to_string(), "bench".to_string()])
            .map(|name| (name, CpuTime::default()))
            .collect();
        for (name, t) in &self.cpu {
            let key = if is_mesh_thread(name) {
                name.as_str()
            } else {
                "bench"
            };
            let u = out.entry(key.to_string()).or_default();
            u.on_cpu_s += t.on_cpu_s / self.seconds;
            u.waiting_s += t.waiting_s / self.seconds;
        }
        out
    }

    fn mesh_bytes_per_update_per_node(&self) -> f64 {
        let crossings = self.sent * self.subscribed_nodes as u64;
        if crossings == 0 {
            return f64::INFINITY;
        }
        self.bytes.mesh as f64 / crossings as f64
    }

    fn per_viewers_json(&self) -> Value {
        json!({
            "viewers": self.viewers,
            "subscribed_nodes": self.subscribed_nodes,
            "updates_sent": self.sent,
            "delivered": self.delivered,
            "delivery": round3(self.delivery()),
            "mesh_bytes_per_update_per_node": round3(self.mesh_bytes_per_update_per_node()),
            "gateway_to_proxy_bytes_per_delivered": round3(self.bytes.to_proxy as f64 / self.delivered.max(1) as f64),
            "latency": self.latency(),
        })
    }

    fn step_json(&self, nodes: u32) -> Value {
        let l = self.latency();
        json!({
            "npcs_updated": self.npcs_updated,
            "offered_updates_per_s": self.npcs_updated as u64 * u64::from(TICK_HZ),
            "delivered_updates_per_s": (self.delivered as f64 / self.seconds).round(),
            "delivery": round3(self.delivery()),
            "p50_us": l.p50_us,
            "p99_us": l.p99_us,
            "held": self.held(),
            "mesh_cpu_s_per_million_delivered": round3(self.mesh_cpu_s() / self.delivered.max(1) as f64 * 1e6),
            "on_cpu_cores": self.utilisation(nodes).into_iter().map(|(k, t)| (k, round3(t.on_cpu_s))).collect::<BTreeMap<_, _>>(),
            "waiting_for_cpu_cores": self.utilisation(nodes).into_iter().map(|(k, t)| (k, round3(t.waiting_s))).collect::<BTreeMap<_, _>>(),
        })
    }
}

fn is_mesh_thread(name: &str) -> bool {
    name.starts_with("sidecar-") || name == "proxy"
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The loads of a sweep: doubling while each holds (up to `max`), halving while none has held
/// yet, then narrowing the gap between the last load that held and the first that did not
/// `refine` times; at most `steps` loads in all.
#[derive(Debug)]
struct Sweep {
    max: usize,
    refine: usize,
    steps_left: usize,
    held: Option<usize>,
    failed: Option<usize>,
}

impl Sweep {
    fn new(max: usize, refine: usize, steps: usize) -> Self {
        Self {
            max,
            refine,
            steps_left: steps,
            held: None,
            failed: None,
        }
    }

    /// The load after `n`, which held or not; `None` when the sweep is over.
    fn next(&mut self, n: usize, held: bool) -> Option<usize> {
        self.steps_left = self.steps_left.saturating_sub(1);
        if held {
            self.held = self.held.max(Some(n));
        } else {
            self.failed = Some(self.failed.map_or(n, |f| f.min(n)));
        }
        if self.steps_left == 0 {
            return None;
        }
        match (self.held, self.failed) {
            (Some(h), None) => (h < self.max).then(|| (h * 2).min(self.max)),
            (None, Some(f)) => (f > 1).then_some(f / 2),
            (Some(h), Some(f)) => {
                // Geometric middle; not worth a step once within an eighth.
                let mid = ((h as f64) * (f as f64)).sqrt().round() as usize;
                if self.refine == 0 || f <= h + h / 8 || mid <= h || mid >= f {
                    return None;
                }
                self.refine -= 1;
                Some(mid)
            }
            (None, None) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_sweep(first: usize, mut sweep: Sweep, holds: impl Fn(usize) -> bool) -> Vec<usize> {
        let mut loads = Vec::new();
        let mut next = Some(first);
        while let Some(n) = next {
            loads.push(n);
            next = sweep.next(n, holds(n));
        }
        loads
    }

    #[test]
    fn a_sweep_doubles_until_a_load_fails_then_narrows_the_gap() {
        let loads = run_sweep(100, Sweep::new(3200, 2, 20), |n| n <= 500);
        assert_eq!(loads, vec![100, 200, 400, 800, 566, 476]);
    }

    #[test]
    fn a_sweep_stops_at_its_top_load_and_after_its_last_step() {
        assert_eq!(
            run_sweep(100, Sweep::new(500, 2, 20), |_| true),
            vec![100, 200, 400, 500]
        );
        assert_eq!(
            run_sweep(100, Sweep::new(3200, 2, 3), |_| true),
            vec![100, 200, 400]
        );
    }

    #[test]
    fn a_sweep_whose_first_load_fails_goes_down_until_one_holds() {
        let loads = run_sweep(100, Sweep::new(3200, 0, 20), |n| n <= 30);
        assert_eq!(loads, vec![100, 50, 25]);
        assert_eq!(run_sweep(2, Sweep::new(3200, 2, 20), |_| false), vec![2, 1]);
    }
}
