//! One balance round, and the one commit path.
//!
//! A round reads the committed partition, the nodes' load reports and the node entries; runs the
//! balancer over the layout (a grid is balanced as the BSP that cuts the world alike); and, if
//! the balancer moved something and the lease is still valid, asks the store to commit the new
//! layout as epoch N+1 over epoch N under the lease. The store decides in one atomic step:
//! committed, stale (someone committed first: the next round reads theirs, so no epoch is ever
//! made twice), or fenced (the lease is no longer this director's: it stands by).

use std::collections::BTreeMap;

use cellmesh_stores::topology::{Commit, DirectorLease, TopologyError};
use cellmesh_world::balance::{Decision, Round};
use cellmesh_world::partition::{Bsp, BspTree, Layout, NodeId, Partition};

use super::stats::{DecisionRecord, EpochRecord, RoundView};
use super::{Asked, DirectorCore, Event, Now, PendingCommit, Phase, StoreRequest, WorldRead};

/// Committed epochs kept for `/state`.
const EPOCHS_KEPT: usize = 64;

impl DirectorCore {
    /// A round over what the store holds: the balancer's decisions, and a commit if it moved
    /// something.
    pub(super) fn round(&mut self, now: Now, world: WorldRead) {
        let Phase::Active(active) = &self.phase else {
            return;
        };
        let lease = active.lease.clone();
        let valid_until = active.valid_until;
        let Some(current) = world.partition.clone() else {
            self.stats.idle_because = Some("no partition is committed".into());
            return;
        };
        if self.bubbles.is_some() {
            return self.placement_round(now, world, current, lease, valid_until);
        }
        let tree = match current.layout() {
            Layout::Bsp(b) => b.tree(),
            // The first layout that moves a line is committed as a BSP, and nothing changes
            // hands for the change of kind alone.
            Layout::Grid(g) => match Bsp::from_grid(g) {
                Ok(b) => b.tree(),
                Err(e) => {
                    self.stats.idle_because = Some(format!(
                        "the grid of epoch {} is not a BSP layout: {e}",
                        current.epoch()
                    ));
                    return;
                }
            },
        };
        // Cells with no area count: a cell just added, or one retiring, is no spare.
        let in_tree = current.members();
        // A spare is a live node with no cell whose game reports (it could take one now).
        let spares: Vec<NodeId> = world
            .nodes
            .iter()
            .filter(|n| n.live && n.record.is_some())
            .map(|n| n.lease.node)
            .filter(|n| !in_tree.contains(n) && world.loads.contains_key(n))
            .collect();
        let shape = *current.shape();
        let round = self.balancer.round(
            now.ms(),
            current.epoch(),
            &tree,
            (shape.chunks_x(), shape.chunks_y()),
            &world.loads,
            &spares,
        );
        self.event(Event::Round {
            epoch: current.epoch(),
            decisions: round.decisions.clone(),
        });
        self.observe(now, &current, &in_tree, &world.loads, spares, &round);

        let Some(layout) = round.layout else {
            return;
        };
        // The lease may have lapsed while the round read the store: a standby may hold it now.
        if now.ms() >= valid_until {
            self.stand_by(now.ms(), None, "lapsed");
            return;
        }
        let Some((next, chunks_moved)) = self.next_partition(&current, layout) else {
            return;
        };
        let pending = PendingCommit {
            epoch: next.epoch(),
            chunks_moved,
            decisions: round.decisions,
            regions: Vec::new(),
            at_unix_ms: now.unix_ms,
        };
        self.ask_commit(lease, current.epoch(), next, pending);
    }

    /// The one commit path, a balance round's and a placement's: `next` as the epoch after
    /// `expected_epoch`, under `lease`; the store's answer comes back to [`Self::committed`].
    pub(super) fn ask_commit(
        &mut self,
        lease: DirectorLease,
        expected_epoch: u64,
        next: Partition,
        pending: PendingCommit,
    ) {
        let request = StoreRequest::Commit {
            lease,
            expected_epoch,
            next: Box::new(next),
        };
        self.ask(Asked::Commit(pending), request);
    }

    /// The round's figures and decisions, in the stats and the metrics.
    fn observe(
        &mut self,
        now: Now,
        current: &Partition,
        in_tree: &[NodeId],
        reports: &BTreeMap<NodeId, cellmesh_world::balance::CellReport>,
        spares: Vec<NodeId>,
        round: &Round,
    ) {
        let loads: BTreeMap<NodeId, f64> = in_tree
            .iter()
            .map(|n| (*n, reports.get(n).map_or(0.0, |r| r.load)))
            .collect();
        let view = RoundView {
            at_unix_ms: now.unix_ms,
            epoch: current.epoch(),
            avg_load: round.avg_load,
            max_load: loads.values().copied().fold(0.0, f64::max),
            safety_bound: round.safety_bound,
            loads,
            spares,
        };
        let m = &self.metrics;
        m.rounds.inc();
        m.partition_epoch.set(current.epoch() as i64);
        m.avg_load.set(view.avg_load);
        m.max_load.set(view.max_load);
        m.safety_bound.set(view.safety_bound);
        for d in &round.decisions {
            m.decision(d);
        }
        let logged: Vec<Decision> = round
            .decisions
            .iter()
            .filter(|d| self.worth_logging(d))
            .cloned()
            .collect();
        let s = &mut self.stats;
        s.rounds += 1;
        s.idle_because = None;
        s.partition_epoch = current.epoch();
        s.last_round = Some(view);
        for d in &round.decisions {
            match d {
                Decision::RetireStarted { .. } => s.retires_started += 1,
                Decision::RetireCancelled { .. } => s.retires_cancelled += 1,
                _ => {}
            }
        }
        for decision in logged {
            s.decisions.push_back(DecisionRecord {
                at_unix_ms: now.unix_ms,
                epoch: current.epoch(),
                decision,
            });
        }
        while s.decisions.len() > self.cfg.decisions_kept {
            s.decisions.pop_front();
        }
    }

    /// The balancer's layout as the epoch after `current`, and the chunks it moves; `None` (an
    /// event and an error counted) when it is no valid layout of the world.
    fn next_partition(&mut self, current: &Partition, layout: BspTree) -> Option<(Partition, i64)> {
        let made = Bsp::new(current.shape(), &layout)
            .map_err(|e| format!("the balancer's layout: {e}"))
            .and_then(|bsp| {
                let next = current
                    .successor(Layout::Bsp(bsp))
                    .map_err(|e| e.to_string())?;
                let moved = current.diff(&next).map_err(|e| e.to_string())?;
                Ok((next, moved.iter().map(|t| t.area.area()).sum()))
            });
        match made {
            Ok(made) => Some(made),
            Err(error) => {
                self.metrics.error("round");
                self.event(Event::LayoutRefused {
                    epoch: current.epoch(),
                    layout,
                    error,
                });
                None
            }
        }
    }

    /// The store's answer to a commit.
    pub(super) fn committed(
        &mut self,
        t: u64,
        pending: PendingCommit,
        answer: Result<Commit, TopologyError>,
    ) {
        match answer {
            Ok(Commit::Committed) => self.record_commit(pending),
            Ok(Commit::Stale { current_epoch }) => {
                self.metrics.refused("stale");
                self.stats.commits_stale += 1;
                self.event(Event::CommitStale { current_epoch });
            }
            Ok(Commit::Fenced { director }) => {
                self.metrics.refused("fenced");
                self.stats.commits_fenced += 1;
                self.stand_by(t, director, "fenced");
            }
            Err(e) => self.failed("commit", "round", e),
        }
    }

    fn record_commit(&mut self, pending: PendingCommit) {
        let PendingCommit {
            epoch,
            chunks_moved,
            decisions,
            regions,
            at_unix_ms,
        } = pending;
        if !regions.is_empty() {
            return self.record_regions(epoch, chunks_moved, regions, at_unix_ms);
        }
        let m = &self.metrics;
        m.epochs_committed.inc();
        m.partition_epoch.set(epoch as i64);
        m.chunks_moved.inc_by(chunks_moved.max(0) as u64);
        // A line that did not move made nothing of the layout.
        let made: Vec<Decision> = decisions
            .iter()
            .filter(|d| !matches!(d, Decision::Line { line, .. } if line.by == 0))
            .cloned()
            .collect();
        let s = &mut self.stats;
        s.epochs_committed += 1;
        s.partition_epoch = epoch;
        s.chunks_moved += chunks_moved.max(0) as u64;
        for d in &made {
            match d {
                Decision::Line { .. } => s.balance_moves += 1,
                Decision::CellAdded { .. } => s.cells_added += 1,
                Decision::CellDeleted { .. } => s.cells_retired += 1,
                Decision::CellReassigned { .. } => s.cells_reassigned += 1,
                Decision::RetireStarted { .. } | Decision::RetireCancelled { .. } => {}
            }
        }
        s.epochs.push_back(EpochRecord {
            epoch,
            at_unix_ms,
            chunks_moved,
            decisions: made,
        });
        while s.epochs.len() > EPOCHS_KEPT {
            s.epochs.pop_front();
        }
        self.event(Event::Committed {
            epoch,
            chunks_moved,
            decisions,
        });
    }

    /// Moves and cell changes always; a held line only when its reason changed.
    fn worth_logging(&mut self, d: &Decision) -> bool {
        match d {
            Decision::Line { path, line, .. } => {
                let changed =
                    self.last_reason.insert(path.clone(), line.reason) != Some(line.reason);
                line.by > 0 || changed
            }
            _ => true,
        }
    }
}
