//! `cellmesh up`: a whole local cluster in one process, over real loopback sockets, with the
//! embedded in-memory stores: `nodes` sidecars, each with an arena game, sharing the world on a
//! grid partition; one proxy spreading sessions over them; and bots playing through it. The
//! arenas and the bots meet around the corner where every cell touches the others across the
//! wrap seam, so updates, ghosts and routed messages cross nodes all the time. Prints a live
//! status line and, on exit, a summary (optionally as JSON).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use std::collections::{BTreeMap, BTreeSet};

use cellmesh_arena::{ArenaConfig, ArenaStats, Census};
use cellmesh_geo_router::geometry::WorldShape;
use cellmesh_geo_router::partition::{Grid, Layout, Partition};
use cellmesh_geo_router::store::Stores;
use cellmesh_geo_router::topology::memory::MemoryTopology;
use cellmesh_geo_router::topology::TopologyStore;
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_proxy::ProxyConfig;
use cellmesh_sidecar::SidecarConfig;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::bots::{self, BotConfig, BotStats};

#[derive(Debug, Clone)]
pub struct UpOptions {
    pub bots: usize,
    /// NPCs over all arenas.
    pub npcs: u32,
    /// Nodes sharing the world (a grid as square as the number allows).
    pub nodes: usize,
    /// Stop after this long; `None` runs until Ctrl-C / SIGTERM.
    pub duration: Option<Duration>,
    pub summary_json: Option<PathBuf>,
    pub seed: u64,
    /// Print the live status line.
    pub status: bool,
}

impl Default for UpOptions {
    fn default() -> Self {
        Self {
            bots: 50,
            npcs: 100,
            nodes: 4,
            duration: None,
            summary_json: None,
            seed: 1,
            status: true,
        }
    }
}

/// What a run did; written as `--summary-json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub duration_s: f64,
    pub nodes: usize,
    pub bots: usize,
    pub sessions_peak: u64,
    pub inputs_sent: u64,
    pub inputs_delivered: u64,
    pub inputs_applied: u64,
    pub updates_delivered: u64,
    pub batches_delivered: u64,
    pub entities: u64,
    pub errors: u64,
    pub kicks: u64,
    pub rtt_ms_p50: f64,
    pub rtt_ms_p99: f64,
    pub rtt_samples: u64,
    pub inputs_dropped_by_proxy: u64,
    /// Inputs the sidecars dropped, each under a named reason (`inputs_dropped_total{reason}`).
    pub inputs_dropped_by_sidecars: u64,
    /// Sent, less delivered and dropped under a reason: 0 when every input is accounted for.
    pub inputs_unaccounted: i64,
    pub ghosts_render: u64,
    pub ghosts_sim: u64,
    pub subscriptions: u64,
    pub routed_messages: u64,
    pub cross_node_updates: u64,
    pub dropped_unknown_account: u64,
    /// Handoffs completed (entities that moved to another node).
    pub handoffs: u64,
    pub handoffs_refused: u64,
    pub handoff_freeze_ms_p50: f64,
    pub handoff_freeze_ms_p99: f64,
    /// Offers unanswered at the end (entities frozen, in doubt).
    pub in_doubt_now: u64,
    pub stale_epoch_drops: u64,
    /// Clients that saw an entity vanish from well inside their view when no game despawned it.
    pub vanished_on_handoff: u64,
    /// From a census of the world at rest (everything halted, no handoff in flight): every real
    /// of every node against what the games spawned and despawned.
    pub entities_alive: u64,
    pub entities_lost: u64,
    pub entities_duplicated: u64,
    /// Whether the world came to rest before the census (false: the figures above read a world
    /// still handing entities over).
    pub census_at_rest: bool,
}

impl Summary {
    /// What the run broke: an entity lost or held twice, or an input neither delivered nor
    /// dropped under a reason.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.entities_lost > 0 {
            p.push(format!("{} entities lost", self.entities_lost));
        }
        if self.entities_duplicated > 0 {
            p.push(format!("{} entities held twice", self.entities_duplicated));
        }
        if self.inputs_unaccounted != 0 {
            p.push(format!(
                "{} inputs unaccounted for ({} sent, {} delivered, {} dropped by the proxy, {} by the sidecars)",
                self.inputs_unaccounted,
                self.inputs_sent,
                self.inputs_delivered,
                self.inputs_dropped_by_proxy,
                self.inputs_dropped_by_sidecars
            ));
        }
        if !self.census_at_rest {
            p.push("the world did not come to rest for the census".to_string());
        }
        p
    }
}

/// Where everything meets: the corner every cell of a grid touches, across the wrap seam.
const MEETING_POINT: (f64, f64) = (0.0, 0.0);
/// Side of the square every arena's NPCs roam, around the meeting point, metres: they cross
/// every border all the time, and so are handed between the nodes.
const ARENA_SPREAD: f64 = 300.0;

/// `cols × rows` for `n` nodes: the most square factorisation.
pub fn grid_shape(n: usize) -> (u32, u32) {
    let rows = (1..=n)
        .filter(|r| n.is_multiple_of(*r) && r * r <= n)
        .max()
        .unwrap_or(1);
    ((n / rows) as u32, rows as u32)
}

#[derive(Default)]
struct NodeTotals {
    entities: u64,
    inputs_delivered: u64,
    inputs_dropped: u64,
    errors: u64,
    ghosts_render: u64,
    ghosts_sim: u64,
    subscriptions: u64,
    routed_messages: u64,
    cross_node_updates: u64,
    dropped_unknown_account: u64,
    handoffs: u64,
    handoffs_refused: u64,
    in_doubt_now: u64,
    stale_epoch_drops: u64,
}

fn totals(sidecars: &[cellmesh_sidecar::SidecarHandle]) -> NodeTotals {
    let mut t = NodeTotals::default();
    for s in sidecars.iter().map(|h| h.stats()) {
        t.entities += s.entities;
        t.inputs_delivered += s.inputs_delivered;
        t.inputs_dropped += s.inputs_dropped;
        t.errors += s.errors;
        t.ghosts_render += s.ghosts_render;
        t.ghosts_sim += s.ghosts_sim;
        t.subscriptions += s.subscriptions;
        t.routed_messages += s.routed_messages;
        t.cross_node_updates += s.cross_node_updates;
        t.dropped_unknown_account += s.dropped_unknown_account;
        t.handoffs += s.handoffs;
        t.handoffs_refused += s.handoffs_refused;
        t.in_doubt_now += s.in_doubt_now;
        t.stale_epoch_drops += s.stale_epoch_drops;
    }
    t
}

/// One census: the reals every node writes, against what the games spawned and despawned.
#[derive(Debug, PartialEq, Eq)]
struct CensusRead {
    lost: BTreeSet<u64>,
    duplicated: BTreeSet<u64>,
    alive: usize,
    /// Reals frozen for a handoff (in flight).
    frozen: usize,
}

fn census(sidecars: &[cellmesh_sidecar::SidecarHandle], games: &Census) -> CensusRead {
    let report = games.report();
    let mut held: BTreeMap<u64, Vec<cellmesh_sidecar::Real>> = BTreeMap::new();
    for s in sidecars {
        for r in s.reals() {
            held.entry(r.id).or_default().push(r);
        }
    }
    // Lost: alive in the games, and no node writes it (unfrozen).
    let lost = report
        .alive
        .iter()
        .filter(|id| held.get(id).is_none_or(|rs| rs.iter().all(|r| r.frozen)))
        .chain(report.lost().iter())
        .copied()
        .collect();
    let frozen = held.values().flatten().filter(|r| r.frozen).count();
    // Two writers: two nodes writing it unfrozen, or two games holding it.
    let duplicated = held
        .iter()
        .filter(|(_, rs)| rs.iter().filter(|r| !r.frozen).count() > 1)
        .map(|(id, _)| *id)
        .chain(report.duplicated())
        .collect();
    CensusRead {
        lost,
        duplicated,
        alive: report.alive.len(),
        frozen,
    }
}

/// Runs the cluster until the duration ends or `interrupt` completes.
pub async fn run(
    opts: UpOptions,
    interrupt: impl std::future::Future<Output = ()>,
) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let stop = CancellationToken::new();
    let stores = Stores::in_memory();

    anyhow::ensure!(opts.nodes >= 1, "--nodes must be at least 1");
    anyhow::ensure!(
        opts.nodes as u32 <= cellmesh_geo_router::topology::MAX_NODE_ID,
        "--nodes {} is more than node ids allow",
        opts.nodes
    );
    let world = WorldShape::default();
    let (cols, rows) = grid_shape(opts.nodes);
    let ids: Vec<u32> = (1..=opts.nodes as u32).collect();
    let (rx, ry) = (world.regions_x() as u32, world.regions_y() as u32);
    // The fixed grid of regions, shared out in compact blocks (2 × 2 quadrants for 4 nodes).
    let grid = Grid::even(&world, rx, ry, &ids).context("laying out the grid")?;
    let partition = Partition::new(world, 1, Layout::Grid(grid)).context("the partition")?;
    let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
    topology
        .commit_partition(0, &partition)
        .await
        .context("committing the partition")?;

    let games = Arc::new(Census::default());
    let halt = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut sidecars = Vec::with_capacity(opts.nodes);
    let mut arenas = Vec::with_capacity(opts.nodes);
    let per_arena = opts.npcs.div_ceil(opts.nodes as u32);
    for (i, &node_id) in ids.iter().enumerate() {
        let cfg = SidecarConfig {
            node_id,
            world,
            local_listen: "127.0.0.1:0".into(),
            mesh_listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..SidecarConfig::default()
        };
        let sidecar =
            cellmesh_sidecar::start_in(cfg, stores.clone(), topology.clone(), stop.child_token())
                .await
                .with_context(|| format!("starting the sidecar of node {node_id}"))?;
        let arena_cfg = ArenaConfig {
            sidecar: SidecarAddr::Tcp(sidecar.local_addr.clone()),
            npcs: per_arena.min(opts.npcs.saturating_sub(per_arena * i as u32)),
            seed: opts.seed.wrapping_add(i as u64),
            center: MEETING_POINT,
            spread: ARENA_SPREAD,
            census: Some(games.clone()),
            halt: Some(halt.clone()),
            ..ArenaConfig::default()
        };
        let arena_stop = stop.child_token();
        arenas.push(tokio::spawn(async move {
            cellmesh_arena::run(arena_cfg, async move { arena_stop.cancelled().await }).await
        }));
        sidecars.push(sidecar);
    }
    let (home, roam) = (MEETING_POINT, ARENA_SPREAD / 2.0);

    let mut proxy_cfg = ProxyConfig {
        client_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        gateways: sidecars.iter().map(|s| s.mesh_addr.to_string()).collect(),
        // A secret of this run only: nobody outside it can sign a login.
        token_secret: format!("{:032x}", rand::random::<u128>()),
        ..ProxyConfig::default()
    };
    // Every bot connects from 127.0.0.1: the per-address limit must admit all of them.
    let per_address = (opts.bots as u32).saturating_mul(proxy_cfg.rate.account_inputs_per_sec);
    proxy_cfg.rate.address_inputs_per_sec = proxy_cfg.rate.address_inputs_per_sec.max(per_address);
    proxy_cfg.rate.address_burst = proxy_cfg
        .rate
        .address_burst
        .max(per_address.saturating_mul(2));
    let secret = proxy_cfg.token_secret.clone();
    let proxy = cellmesh_proxy::start(proxy_cfg, stop.child_token())
        .await
        .context("starting the proxy")?;

    let deadline = Instant::now() + Duration::from_secs(15);
    let linked = |s: &cellmesh_sidecar::SidecarHandle| {
        let st = s.stats();
        st.game_connected && st.peers_up as usize == opts.nodes - 1
    };
    while !(sidecars.iter().all(linked) && proxy.admin.is_ready()) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the cluster did not become ready within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let admins: Vec<String> = sidecars
        .iter()
        .map(|s| format!("http://{}", s.admin_addr))
        .collect();
    println!(
        "cellmesh up: {} nodes ({cols}×{rows}), sidecar admin {} · proxy clients {} admin http://{} · {} bots",
        opts.nodes,
        admins.join(" "),
        proxy.client_addr,
        proxy.admin_addr,
        opts.bots
    );

    let bot_cfg = Arc::new(BotConfig {
        proxy: proxy.client_addr.to_string(),
        secret,
        home,
        roam,
        seed: opts.seed,
        census: Some(games.clone()),
        ..BotConfig::default()
    });
    let bot_stats = Arc::new(BotStats::default());
    let bot_stop = CancellationToken::new();
    let mut bot_tasks = Vec::with_capacity(opts.bots);
    for i in 0..opts.bots {
        let (cfg, stats, stop) = (bot_cfg.clone(), bot_stats.clone(), bot_stop.clone());
        bot_tasks.push(tokio::spawn(bots::run_bot(
            format!("bot-{i}"),
            cfg,
            stats,
            stop,
        )));
    }

    // Live status until the end.
    let tty = std::io::stdout().is_terminal();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last = (Instant::now(), 0u64, 0u64);
    let end = opts.duration.map(|d| tokio::time::Instant::now() + d);
    tokio::pin!(interrupt);
    loop {
        tokio::select! {
            _ = &mut interrupt => break,
            _ = async { match end { Some(e) => tokio::time::sleep_until(e).await, None => std::future::pending().await } } => break,
            _ = tick.tick() => {
                if !opts.status { continue }
                let (s, p, b) = (totals(&sidecars), proxy.stats(), bot_stats.totals());
                let dt = last.0.elapsed().as_secs_f64().max(1e-3);
                let line = format!(
                    "t={:>4.0}s nodes={} sessions={:>4} entities={:>5} ghosts={}/{} subs={} xnode={} routed={} handoffs={} in_doubt={} inputs/s={:>6.0} updates/s={:>7.0} rtt p50={:.2}ms p99={:.2}ms errors={}",
                    started.elapsed().as_secs_f64(), opts.nodes, p.sessions, s.entities,
                    s.ghosts_render, s.ghosts_sim, s.subscriptions, s.cross_node_updates, s.routed_messages,
                    s.handoffs, s.in_doubt_now,
                    (s.inputs_delivered - last.1) as f64 / dt,
                    (b.updates_delivered - last.2) as f64 / dt,
                    p.rtt_ms_p50, p.rtt_ms_p99, b.errors + s.errors,
                );
                last = (Instant::now(), s.inputs_delivered, b.updates_delivered);
                if tty { print!("\r{line}  "); use std::io::Write; let _ = std::io::stdout().flush(); } else { println!("{line}"); }
            }
        }
    }
    if tty && opts.status {
        println!();
    }

    // Bots first, then let in-flight inputs land before reading the counters.
    bot_stop.cancel();
    for t in bot_tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    // Inputs still in flight land within a few ticks; a busy machine takes longer, so wait until
    // the delivered count holds still (at most 5 s).
    let settle = Instant::now() + Duration::from_secs(5);
    let mut delivered = totals(&sidecars).inputs_delivered;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = totals(&sidecars).inputs_delivered;
        if now == delivered || Instant::now() >= settle {
            break;
        }
        delivered = now;
    }
    let (s, p, b) = (totals(&sidecars), proxy.stats(), bot_stats.totals());
    // The census reads a world at rest: every game halts, and it waits until no node has a real
    // frozen for a handoff and two reads 300 ms apart agree (at most 10 s).
    halt.store(true, std::sync::atomic::Ordering::Relaxed);
    let rest_deadline = Instant::now() + Duration::from_secs(10);
    let mut previous = census(&sidecars, &games);
    let census_at_rest = loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = census(&sidecars, &games);
        if now.frozen == 0 && now == previous {
            previous = now;
            break true;
        }
        previous = now;
        if Instant::now() >= rest_deadline {
            break false;
        }
    };
    let (lost, duplicated): (Vec<u64>, Vec<u64>) = (
        previous.lost.iter().copied().collect(),
        previous.duplicated.iter().copied().collect(),
    );
    let second = previous;
    if !lost.is_empty() || !duplicated.is_empty() {
        tracing::error!(
            ?lost,
            ?duplicated,
            "the census found entities lost or doubled"
        );
    }
    let mut freeze = hdrhistogram::Histogram::<u64>::new(3).expect("valid histogram");
    for sidecar in &sidecars {
        let _ = freeze.add(sidecar.freeze_ms());
    }
    let in_doubt_now = totals(&sidecars).in_doubt_now;

    stop.cancel();
    let mut arena_stats = ArenaStats::default();
    for arena in arenas {
        match tokio::time::timeout(Duration::from_secs(5), arena).await {
            Ok(Ok(Ok(st))) => {
                arena_stats.inputs_applied += st.inputs_applied;
                arena_stats.errors_from_sidecar += st.errors_from_sidecar;
            }
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "arena ended with an error"),
            _ => {}
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), proxy.wait()).await;
    for sidecar in sidecars {
        let _ = tokio::time::timeout(Duration::from_secs(5), sidecar.wait()).await;
    }

    let summary = Summary {
        duration_s: started.elapsed().as_secs_f64(),
        nodes: opts.nodes,
        bots: opts.bots,
        sessions_peak: p.sessions_peak,
        inputs_sent: b.inputs_sent,
        inputs_delivered: s.inputs_delivered,
        inputs_applied: arena_stats.inputs_applied,
        updates_delivered: b.updates_delivered,
        batches_delivered: b.batches,
        entities: s.entities,
        errors: b.errors + s.errors + arena_stats.errors_from_sidecar,
        kicks: b.kicks,
        rtt_ms_p50: p.rtt_ms_p50,
        rtt_ms_p99: p.rtt_ms_p99,
        rtt_samples: p.rtt_samples,
        inputs_dropped_by_proxy: p.inputs_dropped,
        inputs_dropped_by_sidecars: s.inputs_dropped,
        inputs_unaccounted: b.inputs_sent as i64
            - s.inputs_delivered as i64
            - p.inputs_dropped as i64
            - s.inputs_dropped as i64,
        ghosts_render: s.ghosts_render,
        ghosts_sim: s.ghosts_sim,
        subscriptions: s.subscriptions,
        routed_messages: s.routed_messages,
        cross_node_updates: s.cross_node_updates,
        dropped_unknown_account: s.dropped_unknown_account,
        handoffs: s.handoffs,
        handoffs_refused: s.handoffs_refused,
        handoff_freeze_ms_p50: freeze.value_at_quantile(0.5) as f64,
        handoff_freeze_ms_p99: freeze.value_at_quantile(0.99) as f64,
        in_doubt_now,
        stale_epoch_drops: s.stale_epoch_drops,
        vanished_on_handoff: b.vanished_on_handoff,
        entities_alive: second.alive as u64,
        entities_lost: lost.len() as u64,
        entities_duplicated: duplicated.len() as u64,
        census_at_rest,
    };
    if let Some(path) = &opts.summary_json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_are_as_square_as_the_count_allows() {
        assert_eq!(grid_shape(1), (1, 1));
        assert_eq!(grid_shape(2), (2, 1));
        assert_eq!(grid_shape(4), (2, 2));
        assert_eq!(grid_shape(6), (3, 2));
        assert_eq!(grid_shape(7), (7, 1));
    }
}
