//! What the balancer knows of each cell (BigWorld's `CellData`): its node's report (smoothed
//! load, entities and their bound levels, the ghost band it holds, the partition epoch it
//! applied), and the director's own state of the cell: since which epoch it exists (it is
//! *created* once its node acknowledged that epoch) and whether it is retiring.

use serde::{Deserialize, Serialize};

use super::EntityBoundLevels;
use crate::geometry::ChunkRect;

/// A node's load report, as its sidecar publishes it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CellReport {
    /// Smoothed fraction of the tick budget the game uses.
    pub load: f64,
    /// Real entities the node holds.
    pub entities: u32,
    /// The node's cell in the epoch it applied, and where its entities are in it.
    pub rect: ChunkRect,
    pub levels: EntityBoundLevels,
    /// How far past its area, in chunks, the node holds ghosts: a line moving its way by no
    /// more than this hands it entities it already sees.
    pub ghost_chunks: i64,
    /// The partition epoch the node applied (its acknowledgement).
    pub partition_epoch: u64,
}

/// The director's state of one cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellState {
    /// The epoch that gave the node this cell: the cell is created once the node applied it.
    pub since_epoch: u64,
    /// Being squeezed out: its line shrinks it to no area, then it is deleted.
    pub retiring: bool,
}

impl CellState {
    pub fn created(&self, report: Option<&CellReport>) -> bool {
        report.is_some_and(|r| r.partition_epoch >= self.since_epoch)
    }
}
