//! `--chaos`: every so often a random node is killed the way a crash kills a process, and a
//! fresh one started under its id; what the killed nodes counted stays counted, and the restores
//! of their entities are timed.

use std::time::{Duration, Instant};

use cellmesh_arena::ArenaStats;
use rand::{Rng, SeedableRng};

use super::cluster::Cluster;
use super::node::{crash, node_runtime, start_node, NodeEnv, NodeRun};
use super::node_totals::{totals_of, HandoffCosts, NodeTotals};
use super::{plot, unix_ms};

/// The node lease under `--chaos`: the world of a killed node is restored once it lapses.
pub(super) const CHAOS_NODE_LEASE_MS: u64 = 1_500;
/// No kill this close to the end of a run: the world settles before the census.
const CHAOS_QUIET_AT_END: Duration = Duration::from_secs(10);
/// A killed node's fresh process must be up within this long.
const CHAOS_RESTART_WITHIN_MS: u64 = 30_000;

/// The kills of a run, and what the killed nodes counted, held and restored.
pub(super) struct Chaos {
    every: Option<Duration>,
    end: Option<tokio::time::Instant>,
    rng: rand::rngs::StdRng,
    /// When the next kill is due; none without `--chaos`, or too close to the end.
    pub(super) kill_at: Option<tokio::time::Instant>,
    pub(super) departed: NodeTotals,
    pub(super) held_by_killed: u64,
    pub(super) departed_handoffs: HandoffCosts,
    pub(super) departed_arenas: Vec<ArenaStats>,
    pub(super) restored: Vec<cellmesh_sidecar::core::Restored>,
    /// Each kill: the node, and when (Unix ms).
    pub(super) kills: Vec<(u32, u64)>,
    pub(super) kill_marks: Vec<plot::KillMark>,
}

impl Chaos {
    /// A kill every `every` (none: never), none too close to the `end` of the run.
    pub(super) fn new(
        every: Option<Duration>,
        seed: u64,
        end: Option<tokio::time::Instant>,
    ) -> Self {
        let mut chaos = Self {
            every,
            end,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            kill_at: None,
            departed: NodeTotals::default(),
            held_by_killed: 0,
            departed_handoffs: HandoffCosts::default(),
            departed_arenas: Vec::new(),
            restored: Vec::new(),
            kills: Vec::new(),
            kill_marks: Vec::new(),
        };
        chaos.kill_at = chaos.next_kill(tokio::time::Instant::now());
        chaos
    }

    fn next_kill(&self, from: tokio::time::Instant) -> Option<tokio::time::Instant> {
        self.every
            .map(|every| from + every)
            // The world gets time to settle before the end.
            .filter(|at| self.end.is_none_or(|e| *at + CHAOS_QUIET_AT_END <= e))
    }

    /// Takes the restores of `nodes`' entities so far.
    pub(super) fn take_restored(&mut self, nodes: &[NodeRun]) {
        for n in nodes {
            self.restored.extend(n.sidecar.take_restored());
        }
    }

    /// Kills a random node of `cluster` the way a crash ends a process, keeps what it counted,
    /// and starts a fresh one under its id; the next kill is due `every` after this one was.
    pub(super) async fn kill_one(
        &mut self,
        cluster: &mut Cluster,
        started: Instant,
    ) -> anyhow::Result<()> {
        let victim = self.rng.random_range(0..cluster.nodes.len());
        let dead = self.kill(cluster, victim, started).await;
        tracing::warn!(node = dead.id, "chaos: node killed; starting a fresh one");
        let fresh = restart(&cluster.env, dead.id, dead.mesh_listen, dead.killed_at).await?;
        cluster.nodes.insert(victim, fresh);
        self.mark(cluster, dead.id, dead.killed_at_s, started);
        self.kill_at = self.next_kill(self.kill_at.expect("a kill was due"));
        Ok(())
    }

    /// Kills `cluster.nodes[victim]` the way a crash ends a process and keeps what it counted.
    pub(super) async fn kill(
        &mut self,
        cluster: &mut Cluster,
        victim: usize,
        started: Instant,
    ) -> Killed {
        let nodes = &mut cluster.nodes;
        self.take_restored(nodes);
        let id = nodes[victim].id;
        let mesh_listen = nodes[victim].sidecar.mesh_addr.to_string();
        let runtime = nodes[victim]
            .runtime
            .take()
            .expect("killed nodes own their runtime");
        crash(runtime).await;
        let killed_at = unix_ms();
        self.kills.push((id, killed_at));
        let killed_at_s = started.elapsed().as_secs_f64();
        cluster.env.games.release_holder(id);
        let dead = nodes.remove(victim);
        let last = totals_of(&[&dead.sidecar]);
        self.departed.add_counters(&last);
        self.held_by_killed += last.inputs_held;
        self.departed_handoffs.add(&dead.sidecar);
        self.restored.extend(dead.sidecar.take_restored());
        if let Ok(Ok(Ok(st))) = tokio::time::timeout(Duration::from_millis(100), dead.arena).await {
            self.departed_arenas.push(st);
        }
        Killed {
            id,
            mesh_listen,
            killed_at,
            killed_at_s,
        }
    }

    /// Marks node `id` on the plot as dead from `from_s` until now.
    pub(super) fn mark(&mut self, cluster: &Cluster, id: u32, from_s: f64, started: Instant) {
        let geos = &cluster.env.geos;
        self.kill_marks.push(plot::KillMark {
            node: id,
            geo: geos.several().then(|| geos.names[geos.geo_of(id)].clone()),
            from_s,
            to_s: started.elapsed().as_secs_f64(),
        });
    }
}

/// A node killed: its id, where its mesh listened, and when it died (Unix ms, and seconds into
/// the run).
pub(super) struct Killed {
    pub(super) id: u32,
    pub(super) mesh_listen: String,
    pub(super) killed_at: u64,
    pub(super) killed_at_s: f64,
}

/// Starts a fresh node `id` in place of the one killed at `killed_at` (Unix ms), retrying until
/// [`CHAOS_RESTART_WITHIN_MS`] after the kill.
pub(super) async fn restart(
    env: &NodeEnv,
    id: u32,
    mesh_listen: String,
    killed_at: u64,
) -> anyhow::Result<NodeRun> {
    // In place, the fresh process finds the dead one's lock gone with its runtime and takes its
    // lease over at once; otherwise it gets the id once the lease lapsed.
    let mut runtime = Some(node_runtime(id)?);
    loop {
        let (rt, started) = start_node(env, id, mesh_listen.clone(), 0, runtime.take()).await;
        match started {
            Ok(n) => return Ok(n),
            Err(e) => {
                runtime = rt;
                anyhow::ensure!(
                    unix_ms() < killed_at + CHAOS_RESTART_WITHIN_MS,
                    "chaos: node {id} did not start again: {e:#}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The restore figures of a `--chaos` run.
#[derive(Debug, Default, PartialEq)]
pub(super) struct ChaosFigures {
    pub(super) restored: u64,
    /// (p50, p99) from the kill to the entity simulated again.
    pub(super) restore_ms: (f64, f64),
    /// (p50, p99) of the kill less when the restored state was taken.
    pub(super) progress_lost_ms: (f64, f64),
}

/// Each restore of a killed node's entity, against the latest kill of that node before it.
pub(super) fn chaos_figures(
    kills: &[(u32, u64)],
    restored: &[cellmesh_sidecar::core::Restored],
) -> ChaosFigures {
    let mut restore = hdrhistogram::Histogram::<u64>::new(3).expect("valid histogram");
    let mut lost = hdrhistogram::Histogram::<u64>::new(3).expect("valid histogram");
    let mut n = 0;
    for r in restored {
        let Some(killed_at) = kills
            .iter()
            .filter(|(node, at)| *node == r.dead_node && *at <= r.restored_unix_ms)
            .map(|(_, at)| *at)
            .max()
        else {
            continue;
        };
        n += 1;
        let _ = restore.record(r.restored_unix_ms - killed_at);
        let _ = lost.record(killed_at.saturating_sub(r.state_unix_ms));
    }
    let q = |h: &hdrhistogram::Histogram<u64>| {
        if h.is_empty() {
            (0.0, 0.0)
        } else {
            (
                h.value_at_quantile(0.5) as f64,
                h.value_at_quantile(0.99) as f64,
            )
        }
    };
    ChaosFigures {
        restored: n,
        restore_ms: q(&restore),
        progress_lost_ms: q(&lost),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn restored(node: u32, state: u64, at: u64) -> cellmesh_sidecar::core::Restored {
        cellmesh_sidecar::core::Restored {
            entity_id: at,
            dead_node: node,
            dead_lease_epoch: 1,
            owner: 2,
            state_unix_ms: state,
            restored_unix_ms: at,
        }
    }

    #[test]
    fn restores_are_timed_from_the_latest_kill_of_their_node() {
        // Node 4 killed at 1,000 and 5,000; node 3 at 3,000.
        let kills = [(4, 1_000), (3, 3_000), (4, 5_000)];
        let f = chaos_figures(
            &kills,
            &[
                restored(4, 400, 3_000), // 2,000 after the first kill of 4, 600 of progress lost
                restored(3, 2_500, 5_000), // 2,000 after the kill of 3, 500 lost
                restored(4, 4_900, 7_000), // 2,000 after the second kill of 4, 100 lost
                restored(2, 0, 7_000),   // a node never killed: not counted
            ],
        );
        assert_eq!(f.restored, 3);
        assert_eq!(f.restore_ms, (2_000.0, 2_000.0));
        assert_eq!(f.progress_lost_ms.1, 600.0);
    }
}
