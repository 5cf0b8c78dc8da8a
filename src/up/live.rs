//! The run's live part: a status line each second, the `--chaos` kills, the `--edge-outage`, and what the summary and
//! the plot need sampled as it goes, until the duration ends or the run is interrupted.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use cellmesh_proxy::{ProxyHandle, ProxyStats};
use cellmesh_stores::topology::TopologyStore;

use super::chaos::Chaos;
use super::cluster::Cluster;
use super::edge_outage::EdgeOutage;
use super::geo_layout::GeoLayout;
use super::node_totals::{totals, NodeTotals};
use super::proxies::proxy_stats;
use super::{plot, unix_ms, UpOptions};
use crate::bots::{BotStats, BotTotals};

/// What the live part samples each second.
pub(super) struct Live {
    /// The most entities the nodes wrote at once: what the checkpoint cost is per.
    pub(super) entities_peak: u64,
    pub(super) bridged_peak: u64,
    /// The busiest node's load over the average, each second it was known.
    pub(super) spreads: Vec<f64>,
    /// When the run started (Unix ms): the handover marks are timed from it.
    started_unix_ms: u64,
    /// What the plot shows, timed from the start.
    pub(super) bridged_over_time: Vec<(f64, u64)>,
    pub(super) handover_marks: Vec<plot::HandoverMark>,
}

impl Live {
    fn new(started: Instant) -> Self {
        Self {
            entities_peak: 0,
            bridged_peak: 0,
            spreads: Vec::new(),
            started_unix_ms: unix_ms().saturating_sub(started.elapsed().as_millis() as u64),
            bridged_over_time: Vec::new(),
            handover_marks: Vec::new(),
        }
    }

    /// Marks the handovers the proxies made since the last call.
    pub(super) fn take_handovers(&mut self, proxies: &[ProxyHandle], geos: &GeoLayout) {
        for (g, proxy) in proxies.iter().enumerate() {
            self.handover_marks
                .extend(
                    proxy
                        .take_handovers()
                        .into_iter()
                        .map(|r| plot::HandoverMark {
                            t_s: r.unix_ms.saturating_sub(self.started_unix_ms) as f64 / 1000.0,
                            account: r.account,
                            from: geos.names[g].clone(),
                            to: r.to_geo,
                            because: r.because,
                        }),
                );
        }
    }

    /// One second's samples; returns the proxies' counters and the load spread they were read
    /// with.
    async fn sample(
        &mut self,
        cluster: &Cluster,
        chaos: &mut Chaos,
        started: Instant,
    ) -> (ProxyStats, Option<f64>) {
        let nodes = &cluster.nodes;
        self.entities_peak = self
            .entities_peak
            .max(totals(nodes, &chaos.departed).entities);
        chaos.take_restored(nodes);
        let p = proxy_stats(&cluster.proxies);
        self.bridged_peak = self.bridged_peak.max(p.bridged_sessions);
        if cluster.env.geos.several() {
            self.bridged_over_time
                .push((started.elapsed().as_secs_f64(), p.bridged_sessions));
        }
        self.take_handovers(&cluster.proxies, &cluster.env.geos);
        let spread = load_spread(&*cluster.env.topology).await;
        self.spreads.extend(spread);
        (p, spread)
    }
}

/// Runs until the duration ends or `interrupt` completes: samples and prints the status line
/// each second, and kills a node whenever `--chaos` has one due.
pub(super) async fn until_the_end(
    opts: &UpOptions,
    cluster: &mut Cluster,
    bot_stats: &BotStats,
    started: Instant,
    interrupt: impl std::future::Future<Output = ()>,
) -> anyhow::Result<(Live, Chaos, EdgeOutage)> {
    let tty = std::io::stdout().is_terminal();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last = (Instant::now(), 0u64, 0u64);
    let end = opts.duration.map(|d| tokio::time::Instant::now() + d);
    // What killed nodes counted, held and restored, and when each was killed.
    let mut chaos = Chaos::new(opts.chaos, opts.seed, end);
    let mut outage = EdgeOutage::new(opts.edge_outage, cluster.env.geos.names.len());
    let mut live = Live::new(started);
    tokio::pin!(interrupt);
    loop {
        tokio::select! {
            _ = &mut interrupt => break,
            _ = until(end) => break,
            _ = until(chaos.kill_at) => chaos.kill_one(cluster, started).await?,
            _ = until(outage.dark_at) => outage.go_dark(&mut chaos, cluster, started).await,
            _ = until(outage.back_at) => outage.come_back(&mut chaos, cluster, started).await?,
            _ = tick.tick() => {
                let (p, spread) = live.sample(cluster, &mut chaos, started).await;
                if !opts.status { continue }
                let (s, b) = (totals(&cluster.nodes, &chaos.departed), bot_stats.totals());
                let dt = last.0.elapsed().as_secs_f64().max(1e-3);
                let line = status_line(&StatusFigures {
                    t_s: started.elapsed().as_secs_f64(),
                    nodes: opts.nodes,
                    killed: chaos.kills.len(),
                    proxies: &p,
                    sidecars: &s,
                    bots: &b,
                    inputs_per_s: (s.inputs_delivered - last.1) as f64 / dt,
                    updates_per_s: (b.updates_delivered - last.2) as f64 / dt,
                    several_geos: cluster.env.geos.several(),
                    director: cluster.director.as_ref().map(|d| d.stats()),
                    bsp: opts.bsp,
                    load_spread: spread,
                });
                last = (Instant::now(), s.inputs_delivered, b.updates_delivered);
                if tty { print!("\r{line}  "); use std::io::Write; let _ = std::io::stdout().flush(); } else { println!("{line}"); }
            }
        }
    }
    if tty && opts.status {
        println!();
    }
    Ok((live, chaos, outage))
}

/// Completes at `at`; never without one.
async fn until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What one status line shows.
struct StatusFigures<'a> {
    /// Since the run started.
    t_s: f64,
    nodes: usize,
    killed: usize,
    proxies: &'a ProxyStats,
    sidecars: &'a NodeTotals,
    bots: &'a BotTotals,
    /// Since the last line.
    inputs_per_s: f64,
    updates_per_s: f64,
    several_geos: bool,
    director: Option<cellmesh_director::DirectorStats>,
    bsp: bool,
    load_spread: Option<f64>,
}

fn status_line(f: &StatusFigures) -> String {
    let (p, s, b) = (f.proxies, f.sidecars, f.bots);
    let line = format!(
        "t={:>4.0}s nodes={} killed={} sessions={:>4} entities={:>5} ghosts={}/{} subs={} xnode={} routed={} handoffs={} in_doubt={} inputs/s={:>6.0} updates/s={:>7.0} rtt p50={:.2}ms p99={:.2}ms errors={}",
        f.t_s, f.nodes, f.killed, p.sessions, s.entities,
        s.ghosts_render, s.ghosts_sim, s.subscriptions, s.cross_node_updates, s.routed_messages,
        s.handoffs, s.in_doubt_now,
        f.inputs_per_s,
        f.updates_per_s,
        p.rtt_ms_p50, p.rtt_ms_p99, b.errors + s.errors,
    );
    let line = format!(
        "{line} commands_routed={} commands_forwarded_on_handoff={} claims_granted={} claims_refused={}",
        s.commands_routed, s.commands_forwarded_on_handoff, s.claims_granted, s.claims_refused,
    );
    let line = if f.several_geos {
        format!(
            "{line} bridged={} handovers={}",
            p.bridged_sessions, p.handovers
        )
    } else {
        line
    };
    let spread = f.load_spread;
    match &f.director {
        Some(st) => format!(
            "{line} epoch={} moves={} load max/avg={}",
            st.partition_epoch.max(1),
            st.balance_moves,
            spread.map_or("-".into(), |m| format!("{m:.2}")),
        ),
        None if f.bsp => format!(
            "{line} load max/avg={}",
            spread.map_or("-".into(), |m| format!("{m:.2}"))
        ),
        None => line,
    }
}

/// The busiest node's load over the average, from the nodes' latest reports; `None` until every
/// node holding a cell has reported.
async fn load_spread(topology: &dyn TopologyStore) -> Option<f64> {
    let partition = topology.partition().await.ok()??;
    let reports = topology.loads().await.ok()?;
    let loads: Vec<f64> = partition
        .nodes()
        .iter()
        .map(|n| reports.get(n).map(|r| r.load))
        .collect::<Option<_>>()?;
    let avg = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
    (avg > 0.0).then(|| loads.iter().copied().fold(0.0, f64::max) / avg)
}
