//! `capacity`: how many clients and entities one sidecar carries at 20 Hz, per core of its own
//! CPU, beside the physical baseline: a forwarder moving the same frames and bytes and doing
//! nothing else.
//!
//! One node owns the world and is every client's gateway; its sidecar and the proxy each run on
//! a thread of their own (`sidecar-1`, `proxy`), with mutual TLS on the proxy's link as a
//! deployment runs. The game and the clients run on the bench's threads, so the sidecar's CPU,
//! read per thread from `/proc/self/task/*/schedstat`, is measured alone.
//!
//! The load grows in steps of clients, every step with ten NPCs per client. The clients' avatars
//! stand on one line, three chunks apart; the NPCs are spread evenly over the band the line's
//! views cover (eleven chunk rows), so every client sees the same crowd whatever the step (about
//! 37 NPCs and two other avatars, `npcs_in_view_per_client`) and the work grows with the clients
//! alone. Every NPC gets a freshly stamped 32-byte component every tick (20 Hz); every client
//! sends ten inputs a second and answers the proxy's pings.
//!
//! A step holds when no client lost its session, at least 99 % of the updates owed to the
//! clients arrived (owed: each client's NPCs in view, worked out from the layout with the
//! sidecar's view rule, times the updates each NPC got within the window), and the clients' p99
//! latency from stamp to receipt stays within one tick. The sweep stops after the first step
//! that did not hold.
//!
//! `capacity` is the largest step that held (the smallest, if none did), scaled to one core of
//! the sidecar: clients over the cores its thread used. On a small machine the game, the
//! clients and the proxy share the cores with the sidecar, so the steps end before the sidecar
//! fills a core, and the figure is a linear extrapolation from the share it used
//! (`sidecar_cores`); the steps show how close to linear its cost grew.
//!
//! `baseline.physical_*`: a forwarder (read a length-prefixed frame, write it on) on a thread of
//! its own reads and writes, at the capacity step's rate, as many frames and bytes as the
//! sidecar read and wrote, to and from its game and the proxy, in that step (each frame of the
//! mean size, TLS left out). Its CPU is the floor any process moving that traffic through
//! loopback TCP pays.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use cellmesh_sidecar::SidecarConfig;
use cellmesh_world::geometry::{Pos, WorldShape};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cluster::{component_runtime, Cluster, ClusterSpec};
use super::forwarder;
use super::game::{
    self, now_ns, with_cause, GameConfig, GameControl, GameStats, Watched, Window, STAMP_LEN,
};
use super::probe::{self, CpuSample, CpuTime};
use super::report::{nanos_histogram, ratio, Latency};
use super::Options;

const TICK_HZ: u32 = 20;
/// One tick, the latency budget.
const TICK: Duration = Duration::from_millis(1000 / TICK_HZ as u64);
/// Bytes of every NPC's stamped component.
const PAYLOAD: usize = 32;
/// Inputs every client sends a second.
const INPUTS_HZ: u32 = 10;
/// NPCs spawned for each client.
const NPCS_PER_CLIENT: usize = 10;
/// Chunks between two avatars on their line.
const SPACING_CHUNKS: f64 = 3.0;
/// The chunk column of the first avatar, and the chunk row of every avatar.
const FIRST_CHUNK: f64 = 31.0;
/// The share of the owed updates that must arrive for a step to hold.
const DELIVERY_HELD: f64 = 0.99;
/// How long an update of a window may still arrive after the window closed.
const GRACE: Duration = Duration::from_millis(300);
/// How far ahead a window opens, so the game and the clients count the same ticks.
const LEAD: Duration = Duration::from_millis(60);
/// The goal, per core of the sidecar.
const GOAL_CLIENTS_PER_CORE: f64 = 2_000.0;
const GOAL_ENTITIES_PER_CORE: f64 = 20_000.0;

struct Plan {
    steps: Vec<usize>,
    settle: Duration,
    measure: Duration,
}

impl Plan {
    fn new(opts: &Options) -> Self {
        if opts.quick {
            Self {
                steps: vec![25, 50, 100],
                settle: Duration::from_millis(300),
                measure: Duration::from_secs(1),
            }
        } else {
            Self {
                steps: vec![50, 100, 200, 400, 800, 1600],
                settle: Duration::from_millis(500),
                measure: Duration::from_secs(3),
            }
        }
    }
}

/// Where the avatars and the NPCs stand, and which NPCs each avatar's view holds.
#[derive(Debug, Clone, Copy)]
struct Layout {
    world: WorldShape,
    /// The sidecars' view radius, chunks.
    radius: i64,
}

impl Layout {
    fn spacing(&self) -> f64 {
        SPACING_CHUNKS * self.world.chunk_size
    }

    /// Where the `k`-th avatar stands: in the middle of its chunk.
    fn avatar(&self, k: usize) -> (f64, f64) {
        let middle = (FIRST_CHUNK + 0.5) * self.world.chunk_size;
        (middle + k as f64 * self.spacing(), middle)
    }

    /// NPCs for avatars `from..to`: evenly over their stretch of the line, across the rows of
    /// their views.
    fn npcs(&self, rng: &mut StdRng, from: usize, to: usize) -> Vec<(f64, f64)> {
        let half = self.spacing() / 2.0;
        let (x0, x1) = (self.avatar(from).0 - half, self.avatar(to).0 - half);
        let chunk = self.world.chunk_size;
        let y0 = (FIRST_CHUNK - self.radius as f64) * chunk;
        let y1 = (FIRST_CHUNK + self.radius as f64 + 1.0) * chunk;
        (0..NPCS_PER_CLIENT * (to - from))
            .map(|_| (rng.random_range(x0..x1), rng.random_range(y0..y1)))
            .collect()
    }

    /// How many of `npcs` the view of the `k`-th avatar holds.
    fn in_view(&self, k: usize, npcs: &[(f64, f64)]) -> usize {
        let chunk_of = |(x, y): (f64, f64)| self.world.chunk_of(Pos { x, y });
        let anchor = chunk_of(self.avatar(k));
        npcs.iter()
            .filter(|&&p| self.world.chunk_distance(anchor, chunk_of(p)) <= self.radius)
            .count()
    }
}

pub async fn run(opts: &Options) -> anyhow::Result<Value> {
    let plan = Plan::new(opts);
    let most = *plan.steps.iter().max().expect("some steps");
    let radius = i64::from(SidecarConfig::default().view_radius_chunks);
    let cluster = Cluster::start(ClusterSpec {
        nodes: 1,
        gateways: vec![1],
        clients: most,
        tls: true,
    })
    .await?;
    let layout = Layout {
        world: cluster.world,
        radius,
    };
    let mut rig = Rig::start(&cluster, layout, opts.seed).await?;
    let result = sweep(&cluster, &mut rig, &plan).await;
    let stopped = rig.stop().await;
    let steps = with_cause(result, stopped)?;
    let at = steps
        .iter()
        .filter(|s| s.held())
        .max_by_key(|s| s.clients)
        .or_else(|| steps.iter().min_by_key(|s| s.clients))
        .expect("at least one step")
        .clone();
    let physical = physical(&at, plan.measure).await?;
    drop(cluster);

    let cores = at.cores("sidecar-1");
    let clients_per_core = at.clients as f64 / cores;
    let entities_per_core = at.npcs as f64 / cores;
    let physical_cores = physical.on_cpu_s / plan.measure.as_secs_f64();
    Ok(json!({
        "tick_hz": TICK_HZ,
        "payload_bytes": PAYLOAD,
        "inputs_hz": INPUTS_HZ,
        "npcs_per_client": NPCS_PER_CLIENT,
        "view_radius_chunks": radius,
        "tls": true,
        "steps": steps.iter().map(Measured::json).collect::<Vec<_>>(),
        "capacity": {
            "held": at.held(),
            "clients": at.clients,
            "npcs": at.npcs,
            "sidecar_cores": round3(cores),
            "clients_per_core": clients_per_core.round(),
            "entities_per_core": entities_per_core.round(),
        },
        "baseline": {
            "physical_cores": round3(physical_cores),
            "physical_clients_per_core": (at.clients as f64 / physical_cores).round(),
            "physical_frames_per_s": at.frames_per_s().round(),
            "physical_frame_bytes": at.frame_bytes(),
            "goal_clients_per_core": GOAL_CLIENTS_PER_CORE,
            "goal_entities_per_core": GOAL_ENTITIES_PER_CORE,
        },
        "ratio": {
            "clients_per_core_vs_goal": ratio(clients_per_core, GOAL_CLIENTS_PER_CORE),
            "entities_per_core_vs_goal": ratio(entities_per_core, GOAL_ENTITIES_PER_CORE),
            "sidecar_cpu_vs_physical": ratio(cores, physical_cores),
        },
    }))
}

/// Every step of the sweep, up to and including the first that did not hold.
async fn sweep(cluster: &Cluster, rig: &mut Rig, plan: &Plan) -> anyhow::Result<Vec<Measured>> {
    let mut steps = Vec::new();
    for &clients in &plan.steps {
        rig.grow(cluster, clients).await?;
        tokio::time::sleep(plan.settle).await;
        let m = rig.measure(cluster, plan.measure).await?;
        let held = m.held();
        steps.push(m);
        if !held {
            break;
        }
    }
    Ok(steps)
}

/// The forwarder's CPU time moving `at`'s frames and bytes for `measure`.
async fn physical(at: &Measured, measure: Duration) -> anyhow::Result<CpuTime> {
    let rt = component_runtime("physical")?;
    let result = async {
        let sink_listener = TcpListener::bind("127.0.0.1:0").await?;
        let sink_addr = sink_listener.local_addr()?;
        let head = rt
            .spawn(async move {
                let l = TcpListener::bind("127.0.0.1:0").await?;
                let addr = l.local_addr()?;
                tokio::spawn(forwarder::serve(l, sink_addr));
                std::io::Result::Ok(addr)
            })
            .await
            .context("the forwarder task")?
            .context("binding the forwarder")?;
        let stop = CancellationToken::new();
        let sink = tokio::spawn(forwarder::sink(sink_listener, u64::MAX, stop.clone()));
        let rate = at.frames_per_s().round().max(1.0) as u32;
        let source = tokio::spawn(forwarder::paced_source(
            head,
            rate,
            at.frame_bytes(),
            stop.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = CpuSample::now()?;
        tokio::time::sleep(measure).await;
        let cpu = CpuSample::now()?.since(&before);
        stop.cancel();
        source.await.context("the source task")??;
        sink.await.context("the sink task")??;
        anyhow::Ok(cpu.get("physical").copied().unwrap_or_default())
    }
    .await;
    rt.shutdown_background();
    result
}

struct Client {
    task: JoinHandle<anyhow::Result<()>>,
    seen: Arc<Mutex<Watched>>,
}

/// The game and the clients, and where everything stands.
struct Rig {
    layout: Layout,
    rng: StdRng,
    window: Arc<Window>,
    control: Arc<GameControl>,
    stop: CancellationToken,
    game: JoinHandle<anyhow::Result<()>>,
    clients: Vec<Client>,
    npcs: Vec<(f64, f64)>,
    /// NPCs in view, summed over the avatars.
    npcs_in_views: usize,
}

impl Rig {
    async fn start(cluster: &Cluster, layout: Layout, seed: u64) -> anyhow::Result<Self> {
        let window = Arc::new(Window::default());
        let control = Arc::new(GameControl::new(window.clone()));
        let stop = CancellationToken::new();
        let game = tokio::spawn(game::run(
            GameConfig {
                sidecar: cluster.local_addr(1),
                tick_hz: TICK_HZ,
                payload_bytes: PAYLOAD,
                avatar_at: layout.avatar(0),
                avatar_step: (layout.spacing(), 0.0),
                spawn_per_tick: 2000,
                control: Some(control.clone()),
                ..GameConfig::default()
            },
            Arc::new(GameStats::default()),
            stop.clone(),
        ));
        let rig = Self {
            layout,
            rng: StdRng::seed_from_u64(seed),
            window,
            control,
            stop,
            game,
            clients: Vec::new(),
            npcs: Vec::new(),
            npcs_in_views: 0,
        };
        rig.wait("the game connected", || {
            cluster.sidecars[0].stats().game_connected
        })
        .await?;
        Ok(rig)
    }

    /// Polls `ready` for up to 30 s, failing early when the game or a client stopped.
    async fn wait(&self, what: &str, ready: impl Fn() -> bool) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !ready() {
            anyhow::ensure!(
                !self.game.is_finished() && !self.clients.iter().any(|c| c.task.is_finished()),
                "{what}: the game or a client stopped"
            );
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Grows to `clients` clients with their NPCs, and waits until the sidecar holds every
    /// entity and the clients were shown every NPC in their views.
    async fn grow(&mut self, cluster: &Cluster, clients: usize) -> anyhow::Result<()> {
        let from = self.clients.len();
        let added = self.layout.npcs(&mut self.rng, from, clients);
        self.control.spawn(added.iter().copied());
        self.npcs.extend(added);
        for i in from..clients {
            let seen = Arc::new(Mutex::new(Watched::new()));
            let task = tokio::spawn(game::watch_window(
                cluster.proxy_addr(),
                cluster.token(&format!("capacity-{i}")),
                self.window.clone(),
                seen.clone(),
                INPUTS_HZ,
                self.stop.clone(),
            ));
            self.clients.push(Client { task, seen });
        }
        self.npcs_in_views = (0..clients)
            .map(|k| self.layout.in_view(k, &self.npcs))
            .sum();
        let entities = (self.npcs.len() + clients) as u64;
        let (clients_ref, owed) = (&self.clients, self.npcs_in_views as u64);
        self.wait(
            &format!("{clients} clients shown the {owed} NPCs in their views"),
            || {
                let shown: u64 = clients_ref
                    .iter()
                    .map(|c| c.seen.lock().expect("client tally lock poisoned").appeared)
                    .sum();
                cluster.sidecars[0].stats().entities >= entities && shown >= owed
            },
        )
        .await
    }

    /// One window of `measure` at the load as it stands.
    async fn measure(&self, cluster: &Cluster, measure: Duration) -> anyhow::Result<Measured> {
        let from = now_ns() + LEAD.as_nanos() as u64;
        self.window.open(from, from + measure.as_nanos() as u64);
        self.control.take_stamped_in_window();
        for c in &self.clients {
            let mut seen = c.seen.lock().expect("client tally lock poisoned");
            seen.latency.reset();
            seen.updates = 0;
        }
        tokio::time::sleep(LEAD).await;
        let cpu_before = CpuSample::now()?;
        let traffic_before = Traffic::read(cluster);
        tokio::time::sleep(measure).await;
        let cpu = CpuSample::now()?.since(&cpu_before);
        let traffic = Traffic::read(cluster).minus(&traffic_before);
        tokio::time::sleep(GRACE).await;

        let mut latency = nanos_histogram();
        let mut delivered = 0;
        for c in &self.clients {
            let seen = c.seen.lock().expect("client tally lock poisoned");
            latency
                .add(&seen.latency)
                .context("merging latency histograms")?;
            delivered += seen.updates;
        }
        let sent = self.control.take_stamped_in_window();
        Ok(Measured {
            clients: self.clients.len(),
            npcs: self.npcs.len(),
            npcs_in_views: self.npcs_in_views,
            owed: sent as f64 / self.npcs.len().max(1) as f64 * self.npcs_in_views as f64,
            delivered,
            latency,
            seconds: measure.as_secs_f64(),
            cpu,
            traffic,
            clients_lost: self.clients.iter().filter(|c| c.task.is_finished()).count(),
        })
    }

    /// Stops the game and the clients; why the first of them that failed did.
    async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        let mut first = Ok(());
        let tasks = std::iter::once(self.game).chain(self.clients.into_iter().map(|c| c.task));
        for t in tasks {
            let r = t.await.context("a game or client task").and_then(|r| r);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// Frames and bytes (length prefixes included) the sidecar moved to and from its game and the
/// proxy.
#[derive(Debug, Clone, Copy, Default)]
struct Traffic {
    frames: u64,
    bytes: u64,
}

impl Traffic {
    fn read(cluster: &Cluster) -> Self {
        let text = cluster.sidecars[0].admin.metrics_text();
        let count = |name: &str, direction: &str, peer: &str| {
            probe::counter(&text, name, &[("direction", direction), ("peer", peer)])
        };
        let both = |name: &str| {
            [
                ("in", "game"),
                ("out", "game"),
                ("in", "proxy"),
                ("out", "proxy"),
            ]
            .iter()
            .map(|(d, p)| count(name, d, p))
            .sum()
        };
        Self {
            frames: both("cellmesh_sidecar_frames_total"),
            bytes: both("cellmesh_sidecar_bytes_total"),
        }
    }

    fn minus(self, before: &Self) -> Self {
        Self {
            frames: self.frames.saturating_sub(before.frames),
            bytes: self.bytes.saturating_sub(before.bytes),
        }
    }
}

/// One step's window.
#[derive(Debug, Clone)]
struct Measured {
    clients: usize,
    npcs: usize,
    npcs_in_views: usize,
    /// Updates owed to the clients: the updates each NPC got within the window, times the
    /// views holding it.
    owed: f64,
    delivered: u64,
    latency: hdrhistogram::Histogram<u64>,
    seconds: f64,
    cpu: std::collections::BTreeMap<String, CpuTime>,
    traffic: Traffic,
    clients_lost: usize,
}

impl Measured {
    fn delivery(&self) -> f64 {
        if self.owed <= 0.0 {
            return 0.0;
        }
        self.delivered as f64 / self.owed
    }

    fn held(&self) -> bool {
        self.clients_lost == 0
            && self.delivery() >= DELIVERY_HELD
            && Latency::from_nanos(&self.latency).p99_us <= TICK.as_micros() as f64
    }

    /// Cores the threads named `name` used (at least a trace, so a ratio stays finite).
    fn cores(&self, name: &str) -> f64 {
        let t = self.cpu.get(name).copied().unwrap_or_default();
        (t.on_cpu_s / self.seconds).max(1e-6)
    }

    /// The forwarder's pace: half the frames the sidecar moved (it reads each and writes it).
    fn frames_per_s(&self) -> f64 {
        self.traffic.frames as f64 / 2.0 / self.seconds
    }

    /// The mean frame the sidecar moved, without its 4-byte length prefix.
    fn frame_bytes(&self) -> usize {
        let mean = self.traffic.bytes / self.traffic.frames.max(1);
        (mean.saturating_sub(4) as usize).max(STAMP_LEN)
    }

    fn json(&self) -> Value {
        let other: f64 = self
            .cpu
            .iter()
            .filter(|(n, _)| !matches!(n.as_str(), "sidecar-1" | "proxy"))
            .map(|(_, t)| t.on_cpu_s)
            .sum();
        let waiting: f64 = self.cpu.values().map(|t| t.waiting_s).sum();
        let latency = Latency::from_nanos(&self.latency);
        json!({
            "clients": self.clients,
            "npcs": self.npcs,
            "npcs_in_view_per_client": round3(self.npcs_in_views as f64 / self.clients.max(1) as f64),
            "held": self.held(),
            "delivery": round3(self.delivery()),
            "p50_us": latency.p50_us.round(),
            "p99_us": latency.p99_us.round(),
            "clients_lost": self.clients_lost,
            "sidecar_cores": round3(self.cores("sidecar-1")),
            "proxy_cores": round3(self.cores("proxy")),
            "bench_cores": round3(other / self.seconds),
            "waiting_for_cpu_cores": round3(waiting / self.seconds),
            "sidecar_frames_per_s": (self.traffic.frames as f64 / self.seconds).round(),
            "sidecar_bytes_per_s": (self.traffic.bytes as f64 / self.seconds).round(),
        })
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            world: WorldShape::default(),
            radius: 5,
        }
    }

    #[test]
    fn every_view_holds_about_the_same_crowd_whatever_the_step() {
        let l = layout();
        let mut rng = StdRng::seed_from_u64(7);
        let mut npcs = l.npcs(&mut rng, 0, 50);
        npcs.extend(l.npcs(&mut rng, 50, 200));
        assert_eq!(npcs.len(), 200 * NPCS_PER_CLIENT);
        // Eleven chunk columns of views over three per avatar: about 37 NPCs each, away from
        // the line's ends.
        let inner: Vec<usize> = (10..190).map(|k| l.in_view(k, &npcs)).collect();
        let mean = inner.iter().sum::<usize>() as f64 / inner.len() as f64;
        assert!((33.0..=41.0).contains(&mean), "mean {mean}");
        assert!(inner.iter().all(|&n| (15..=60).contains(&n)), "{inner:?}");
        // The line's first avatar sees only the NPCs east of it and its own stretch.
        assert!(l.in_view(0, &npcs) < inner[0]);
    }

    #[test]
    fn every_npc_stands_in_the_rows_of_the_views() {
        let l = layout();
        let chunk = l.world.chunk_size;
        let mut rng = StdRng::seed_from_u64(1);
        let npcs = l.npcs(&mut rng, 3, 9);
        let (x0, x1) = (l.avatar(3).0 - 48.0, l.avatar(9).0 - 48.0);
        assert!(npcs.iter().all(|&(x, y)| {
            (x0..x1).contains(&x)
                && ((FIRST_CHUNK - 5.0) * chunk..(FIRST_CHUNK + 6.0) * chunk).contains(&y)
        }));
        assert_eq!(l.avatar(1).0 - l.avatar(0).0, 96.0);
    }
}
