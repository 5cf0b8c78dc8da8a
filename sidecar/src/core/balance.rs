//! What this node tells the director's balancer, once a second on the game's tick: its smoothed
//! load, its reals and where they lie against its cell (the entity bound levels), how far past
//! its cell it holds ghosts, and the partition epoch it applied. The driver hands the latest
//! report to the membership task, which publishes it under the node's lease.

use std::collections::BTreeMap;

use cellmesh_world::balance::{CellReport, EntityBoundLevels};
use cellmesh_world::geometry::{ChunkPos, ChunkRect};
use cellmesh_world::partition::Partition;

use super::context::Context;
use crate::model::entities::EntityTable;

/// How often a report is made.
pub(crate) const LOAD_REPORT_EVERY_MS: u64 = 1_000;

/// When the next report is due.
pub(crate) struct LoadReports {
    next_ms: u64,
}

impl LoadReports {
    /// The first report is due at once.
    pub(crate) fn new(cx: &Context) -> Self {
        Self {
            next_ms: cx.now.mono_ms,
        }
    }

    /// Whether a report is due now; if so, the next one is a period later.
    pub(crate) fn due(&mut self, cx: &Context) -> bool {
        if cx.now.mono_ms < self.next_ms {
            return false;
        }
        self.next_ms = cx.now.mono_ms + LOAD_REPORT_EVERY_MS;
        true
    }
}

/// The report of a node with `load` holding `table` under `partition`. Levels are measured
/// against the node's cell when it has exactly one (a BSP leaf); a node holding several areas (a
/// grid's regions) reports none.
pub(crate) fn cell_report(
    cx: &Context,
    load: f64,
    table: &EntityTable,
    partition: &Partition,
) -> CellReport {
    let areas = partition.area_of(cx.config.node_id);
    let rect = match areas.as_slice() {
        [one] => *one,
        _ => ChunkRect::default(),
    };
    let mut chunks: BTreeMap<ChunkPos, u32> = Default::default();
    for e in table.iter().filter(|e| e.origin().is_none()) {
        *chunks.entry(e.chunk).or_default() += 1;
    }
    let entities: u32 = chunks.values().sum();
    let per_entity = if entities == 0 {
        0.0
    } else {
        load / f64::from(entities)
    };
    CellReport {
        load,
        entities,
        rect,
        levels: EntityBoundLevels::measure(rect, chunks, per_entity),
        ghost_chunks: i64::from(cx.config.view_radius_chunks + cx.config.release_margin_chunks),
        partition_epoch: partition.epoch(),
    }
}
