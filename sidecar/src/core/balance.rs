//! What this node tells the director's balancer, once a second on the game's tick: its smoothed
//! load, its reals and where they lie against its cell (the entity bound levels), how far past
//! its cell it holds ghosts, and the partition epoch it applied. The driver hands the latest
//! report to the membership task, which publishes it under the node's lease.

use cellmesh_world::balance::{CellReport, EntityBoundLevels};
use cellmesh_world::geometry::{ChunkPos, ChunkRect};

use super::*;

/// How often a report is made.
pub(crate) const LOAD_REPORT_EVERY_MS: u64 = 1_000;

impl Core {
    /// Queues a report when one is due.
    pub(crate) fn maybe_report_load(&mut self) {
        if self.cx.now.mono_ms < self.next_load_report_ms {
            return;
        }
        self.next_load_report_ms = self.cx.now.mono_ms + LOAD_REPORT_EVERY_MS;
        let report = self.cell_report();
        self.cx.emit(Output::LoadReport(Box::new(report)));
    }

    /// The report now. Levels are measured against the node's cell when it has exactly one (a
    /// BSP leaf); a node holding several areas (a grid's regions) reports none.
    pub fn cell_report(&mut self) -> CellReport {
        let load = self.refresh_load();
        let node = self.cx.config.node_id;
        let areas = self.authority.partition.area_of(node);
        let rect = match areas.as_slice() {
            [one] => *one,
            _ => ChunkRect::default(),
        };
        let mut chunks: std::collections::BTreeMap<ChunkPos, u32> = Default::default();
        for e in self.table.iter().filter(|e| e.origin.is_none()) {
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
            ghost_chunks: i64::from(
                self.cx.config.view_radius_chunks + self.cx.config.release_margin_chunks,
            ),
            partition_epoch: self.authority.partition.epoch(),
        }
    }
}
