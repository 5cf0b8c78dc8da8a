//! The partition without dead nodes: every cell they owned goes to a live node, so their world
//! has an owner again (the restore of their entities follows the new owners). Live neighbours
//! first, to keep borders and ghost bands where they were; among them, the one owning least.

use std::collections::BTreeMap;

use super::{BspEntryKind, Layout, NodeId, Partition, PartitionError};

impl Partition {
    /// The next epoch with the cells of `dead` nodes handed to `live` ones; `None` when the
    /// dead own nothing (no change is needed) or no live node is left to take their cells.
    pub fn without(
        &self,
        dead: &[NodeId],
        live: &[NodeId],
    ) -> Result<Option<Self>, PartitionError> {
        let live: Vec<NodeId> = live.iter().copied().filter(|n| !dead.contains(n)).collect();
        if live.is_empty() || dead.iter().all(|d| self.chunks_of(*d) == 0) {
            return Ok(None);
        }
        let mut owned: BTreeMap<NodeId, i64> =
            live.iter().map(|n| (*n, self.chunks_of(*n))).collect();
        let layout = match self.layout() {
            Layout::Grid(g) => {
                let (cols, rows) = (g.cols(), g.rows());
                let mut table = g.table().to_vec();
                let (rw, rh) = g.region_chunks();
                for i in 0..table.len() {
                    if !dead.contains(&table[i]) {
                        continue;
                    }
                    let (x, y) = (i as u32 % cols, i as u32 / cols);
                    // The four neighbours, across the seams (the world is a torus).
                    let near = [
                        ((x + cols - 1) % cols, y),
                        ((x + 1) % cols, y),
                        (x, (y + rows - 1) % rows),
                        (x, (y + 1) % rows),
                    ]
                    .map(|(nx, ny)| table[(ny * cols + nx) as usize]);
                    let to = pick(&owned, |n| near.contains(&n)).expect("live is not empty");
                    table[i] = to;
                    *owned.entry(to).or_default() += rw * rh;
                }
                Layout::Grid(super::Grid::new(self.shape(), cols, rows, table)?)
            }
            Layout::Bsp(b) => {
                let mut b = b.clone();
                let leaves: Vec<(usize, i64)> = b
                    .entries()
                    .filter(
                        |e| matches!(e.kind, BspEntryKind::Leaf { node } if dead.contains(&node)),
                    )
                    .map(|e| (e.index, e.rect.area()))
                    .collect();
                for (index, area) in leaves {
                    let to = pick(&owned, |_| true).expect("live is not empty");
                    b.assign(index, to)?;
                    *owned.entry(to).or_default() += area;
                }
                Layout::Bsp(b)
            }
        };
        self.successor(layout).map(Some)
    }
}

/// The live node owning least among those `preferred` (any live node if none is).
fn pick(owned: &BTreeMap<NodeId, i64>, preferred: impl Fn(NodeId) -> bool) -> Option<NodeId> {
    let least = |it: &mut dyn Iterator<Item = (&NodeId, &i64)>| {
        it.min_by_key(|(n, c)| (**c, **n)).map(|(n, _)| *n)
    };
    least(&mut owned.iter().filter(|(n, _)| preferred(**n))).or_else(|| least(&mut owned.iter()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::WorldShape;
    use crate::partition::{Bsp, Grid};

    fn shape() -> WorldShape {
        WorldShape {
            width: 512.0,
            height: 512.0,
            chunk_size: 32.0,
            region_size: 128.0,
        }
    }

    #[test]
    fn a_dead_nodes_grid_regions_go_to_live_neighbours_owning_least() {
        let g = Grid::new(&shape(), 2, 2, vec![1, 2, 3, 4]).unwrap();
        let p = Partition::new(shape(), 7, Layout::Grid(g)).unwrap();
        let next = p
            .without(&[4], &[1, 2, 3])
            .unwrap()
            .expect("4 owned a region");
        assert_eq!(next.epoch(), 8);
        assert_eq!(next.chunks_of(4), 0);
        let table = next.grid().unwrap().table().to_vec();
        assert_eq!(&table[..3], &[1, 2, 3]);
        // Region 3's neighbours are 2 and 3 (left/right) and 2 (up/down across the seam).
        assert!(matches!(table[3], 2 | 3), "{table:?}");
        assert_eq!(
            next.chunks_of(1) + next.chunks_of(2) + next.chunks_of(3),
            16 * 16
        );
    }

    #[test]
    fn nothing_changes_for_a_node_that_owns_nothing_or_with_no_one_left() {
        let g = Grid::new(&shape(), 2, 2, vec![1, 2, 1, 2]).unwrap();
        let p = Partition::new(shape(), 3, Layout::Grid(g)).unwrap();
        assert_eq!(p.without(&[4], &[1, 2]).unwrap(), None);
        assert_eq!(p.without(&[1], &[1]).unwrap(), None);
    }

    #[test]
    fn bsp_leaves_of_a_dead_node_are_spread_over_the_live_ones() {
        let b = Bsp::even(&shape(), &[1, 2, 3, 4]).unwrap();
        let p = Partition::new(shape(), 1, Layout::Bsp(b)).unwrap();
        let next = p.without(&[2], &[1, 3, 4]).unwrap().unwrap();
        assert_eq!(next.chunks_of(2), 0);
        let total: i64 = [1, 3, 4].iter().map(|n| next.chunks_of(*n)).sum();
        assert_eq!(total, 16 * 16);
    }

    #[test]
    fn two_dead_nodes_go_in_one_epoch_and_never_to_each_other() {
        let g = Grid::new(&shape(), 2, 2, vec![1, 2, 3, 4]).unwrap();
        let p = Partition::new(shape(), 1, Layout::Grid(g)).unwrap();
        let next = p.without(&[3, 4], &[1, 2, 3, 4]).unwrap().unwrap();
        assert_eq!(next.epoch(), 2);
        assert_eq!((next.chunks_of(3), next.chunks_of(4)), (0, 0));
        assert_eq!(next.chunks_of(1), next.chunks_of(2));
    }
}
