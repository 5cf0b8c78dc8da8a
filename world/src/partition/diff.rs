//! What changes hands between two epochs: the work list of the mass handoff that applies a new
//! partition (docs/partition.md).

use serde::{Deserialize, Serialize};

use crate::geometry::ChunkRect;

use super::{NodeId, Partition, PartitionError};

/// Chunks that move from one owner to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Transfer {
    pub from: NodeId,
    pub to: NodeId,
    pub area: ChunkRect,
}

/// Both partitions' cells tile the world, so the pairwise intersections of an old cell and a new
/// one tile it too; those whose owners differ are exactly the chunks that changed hands.
pub(super) fn diff(old: &Partition, new: &Partition) -> Result<Vec<Transfer>, PartitionError> {
    if old.shape() != new.shape() {
        return Err(PartitionError::WorldsDiffer {
            old: *old.shape(),
            new: *new.shape(),
        });
    }
    let new_cells: Vec<(ChunkRect, NodeId)> = new.cells().collect();
    let mut out = Vec::new();
    for (old_rect, from) in old.cells() {
        for &(new_rect, to) in &new_cells {
            if from == to {
                continue;
            }
            if let Some(area) = old_rect.intersection(&new_rect) {
                out.push(Transfer { from, to, area });
            }
        }
    }
    merge(&mut out);
    Ok(out)
}

/// Joins rectangles of the same hand-over that share a whole edge, so a line move lists one
/// strip per pair of nodes instead of one piece per cell it crossed.
fn merge(transfers: &mut Vec<Transfer>) {
    loop {
        let before = transfers.len();
        // Stacked pieces first (same columns, touching rows), then side by side.
        for vertical in [true, false] {
            let key = |t: &Transfer| {
                let a = t.area;
                if vertical {
                    (t.from, t.to, a.x0, a.x1, a.y0)
                } else {
                    (t.from, t.to, a.y0, a.y1, a.x0)
                }
            };
            transfers.sort_unstable_by_key(key);
            let mut merged: Vec<Transfer> = Vec::with_capacity(transfers.len());
            for t in transfers.drain(..) {
                if let Some(last) = merged.last_mut() {
                    let (a, b) = (&mut last.area, t.area);
                    let same = (last.from, last.to) == (t.from, t.to);
                    if same && vertical && (a.x0, a.x1) == (b.x0, b.x1) && a.y1 == b.y0 {
                        a.y1 = b.y1;
                        continue;
                    }
                    if same && !vertical && (a.y0, a.y1) == (b.y0, b.y1) && a.x1 == b.x0 {
                        a.x1 = b.x1;
                        continue;
                    }
                }
                merged.push(t);
            }
            *transfers = merged;
        }
        if transfers.len() == before {
            transfers.sort_unstable();
            return;
        }
    }
}
