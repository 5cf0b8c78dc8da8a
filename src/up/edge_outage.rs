//! `--edge-outage SECS`: SECS into the run every node of one geo dies at once, as a datacenter
//! gone dark, and stays dead for [`EDGE_DARK_FOR`]; then a fresh process starts under each id.
//! The geo is the last one (with `--bubbles`, where the gathering bots' bubble went).
//!
//! Meanwhile the core geo restores the dark geo's world from the copies of its checkpoints, the
//! geo-aware director falls its bubbles back to the core, and the dark geo's proxy attaches its
//! sessions to the core's gateways (its fallback gateways): the players stay connected. How long
//! after the outage each of the geo's entities was simulated again is the fallback time.

use std::time::{Duration, Instant};

use super::chaos::{chaos_figures, restart, Chaos, Killed};
use super::cluster::Cluster;
use super::unix_ms;

/// How long the geo stays dark.
pub(super) const EDGE_DARK_FOR: Duration = Duration::from_secs(40);
/// The world gets this long after the geo returns, before the run ends.
pub(super) const EDGE_QUIET_AT_END: Duration = Duration::from_secs(20);

/// One geo's outage: when it is due, and while it lasts, the nodes it killed.
pub(super) struct EdgeOutage {
    /// The geo (index into the run's geos).
    geo: usize,
    /// When the geo goes dark; none once it did (or without `--edge-outage`).
    pub(super) dark_at: Option<tokio::time::Instant>,
    /// When it comes back; none while it is up.
    pub(super) back_at: Option<tokio::time::Instant>,
    dark: Vec<Killed>,
    /// Each outage: its nodes and when they were killed (Unix ms).
    pub(super) kills: Vec<(u32, u64)>,
    /// When the outage began, in seconds into the run (a run has at most one).
    pub(super) went_dark_at_s: Option<f64>,
}

impl EdgeOutage {
    /// An outage of the last of `geos` geos `after` the run started; none without one.
    pub(super) fn new(after: Option<Duration>, geos: usize) -> Self {
        Self {
            geo: geos.saturating_sub(1),
            dark_at: after.map(|a| tokio::time::Instant::now() + a),
            back_at: None,
            dark: Vec::new(),
            kills: Vec::new(),
            went_dark_at_s: None,
        }
    }

    /// Kills every node of the geo; they come back [`EDGE_DARK_FOR`] later.
    pub(super) async fn go_dark(
        &mut self,
        chaos: &mut Chaos,
        cluster: &mut Cluster,
        started: Instant,
    ) {
        self.dark_at = None;
        self.went_dark_at_s = Some(started.elapsed().as_secs_f64());
        let geos = cluster.env.geos.clone();
        while let Some(victim) = cluster
            .nodes
            .iter()
            .position(|n| geos.geo_of(n.id) == self.geo)
        {
            let dead = chaos.kill(cluster, victim, started).await;
            self.kills.push((dead.id, dead.killed_at));
            self.dark.push(dead);
        }
        tracing::warn!(
            geo = %geos.names[self.geo],
            nodes = self.dark.len(),
            "edge outage: every node of the geo killed"
        );
        self.back_at = Some(tokio::time::Instant::now() + EDGE_DARK_FOR);
    }

    /// Starts a fresh process under each id the outage killed, at its old mesh address (the
    /// geo's proxy dials it there).
    pub(super) async fn come_back(
        &mut self,
        chaos: &mut Chaos,
        cluster: &mut Cluster,
        started: Instant,
    ) -> anyhow::Result<()> {
        self.back_at = None;
        for dead in std::mem::take(&mut self.dark) {
            let fresh = restart(&cluster.env, dead.id, dead.mesh_listen, unix_ms()).await?;
            let at = cluster.nodes.partition_point(|n| n.id < dead.id);
            cluster.nodes.insert(at, fresh);
            chaos.mark(cluster, dead.id, dead.killed_at_s, started);
        }
        tracing::warn!(geo = %cluster.env.geos.names[self.geo], "edge outage: the geo is back");
        Ok(())
    }

    /// Outages that came: none or one.
    pub(super) fn outages(&self) -> u64 {
        u64::from(self.went_dark_at_s.is_some())
    }

    /// How long after the outage each of the geo's entities was simulated again (ms): p50, p99,
    /// and how many.
    pub(super) fn fallback_ms(
        &self,
        restored: &[cellmesh_sidecar::core::Restored],
    ) -> (f64, f64, u64) {
        let f = chaos_figures(&self.kills, restored);
        (f.restore_ms.0, f.restore_ms.1, f.restored)
    }
}
