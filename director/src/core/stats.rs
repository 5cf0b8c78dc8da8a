//! What the director keeps of what it did: for `/state`, `cellmesh up` and tests.

use std::collections::{BTreeMap, VecDeque};

use cellmesh_stores::topology::DirectorLease;
use cellmesh_world::balance::Decision;
use cellmesh_world::bubbles::{BubbleSnapshot, Decision as BubbleDecision, RegionMove};
use cellmesh_world::partition::NodeId;
use serde::Serialize;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Not holding the lease (another director does, or no partition is committed yet).
    #[default]
    Standby,
    Active,
}

/// One balance round as the director saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundView {
    pub at_unix_ms: u64,
    /// The epoch the round balanced.
    pub epoch: u64,
    pub avg_load: f64,
    pub max_load: f64,
    pub safety_bound: f64,
    /// Each cell's node and its smoothed load (0 for a node that has not reported).
    pub loads: BTreeMap<NodeId, f64>,
    pub spares: Vec<NodeId>,
}

impl RoundView {
    /// The busiest cell's load over the average: 1 is a balanced world.
    pub fn max_over_avg(&self) -> f64 {
        if self.avg_load > 0.0 {
            self.max_load / self.avg_load
        } else {
            1.0
        }
    }
}

/// An epoch this director committed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochRecord {
    pub epoch: u64,
    pub at_unix_ms: u64,
    /// Chunks that changed hands from the epoch before: each a mass handoff.
    pub chunks_moved: i64,
    /// What made the layout: the lines that moved and the cells added or deleted.
    pub decisions: Vec<Decision>,
}

/// A decision worth reading later: a move, a cell's change, or a line whose reason to hold
/// changed (a line holding for the same reason every round is logged once).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionRecord {
    pub at_unix_ms: u64,
    /// The epoch the round balanced.
    pub epoch: u64,
    #[serde(flatten)]
    pub decision: Decision,
}

/// An epoch this director committed for the bubbles: the regions that changed geo.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegionRecord {
    pub epoch: u64,
    pub at_unix_ms: u64,
    pub moves: Vec<RegionMove>,
}

/// The first epoch this director committed that moved a region for a bubble.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FirstMove {
    pub region: (u32, u32),
    pub epoch: u64,
    pub at_unix_ms: u64,
}

/// What the director did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DirectorStats {
    pub holder: String,
    pub role: Role,
    pub lease: Option<DirectorLease>,
    /// Another director's lease, as last read while standing by.
    pub other: Option<DirectorLease>,
    /// Why an active director does not balance (no partition yet, a layout it cannot read).
    pub idle_because: Option<String>,
    pub partition_epoch: u64,
    pub rounds: u64,
    pub epochs_committed: u64,
    /// Line moves in committed epochs.
    pub balance_moves: u64,
    pub cells_added: u64,
    pub retires_started: u64,
    pub retires_cancelled: u64,
    /// Retired cells deleted from the layout (empty, and every node had the layout without them).
    pub cells_retired: u64,
    /// Second cells (a failover's) given to a spare node.
    pub cells_reassigned: u64,
    pub chunks_moved: u64,
    pub commits_stale: u64,
    pub commits_fenced: u64,
    pub leases_granted: u64,
    pub leases_lost: u64,
    pub last_round: Option<RoundView>,
    /// Bubbles whose regions changed geo in committed epochs (one per bubble and epoch).
    pub bubble_moves: u64,
    /// Grid regions committed to another geo's node.
    pub regions_moved: u64,
    /// Regions the last placement wanted on a geo with no live node (left where they are).
    pub regions_stranded: usize,
    /// Players in the last placement.
    pub players_placed: usize,
    /// Players left out of the last placement: not yet measured toward every available geo.
    pub players_unmeasured: usize,
    /// The bubbles as the last placement left them.
    pub bubbles: Vec<BubbleSnapshot>,
    /// Placement decisions that moved a bubble or changed who is in it, latest last.
    pub placements: VecDeque<BubbleDecision>,
    /// Committed epochs that moved regions, latest last (the last few hundred).
    pub region_moves: VecDeque<RegionRecord>,
    /// The first commit that moved each region, ever (one per region of the grid at most).
    pub first_moves: Vec<FirstMove>,
    pub epochs: VecDeque<EpochRecord>,
    pub decisions: VecDeque<DecisionRecord>,
}
