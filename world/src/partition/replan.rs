//! The layout for another set of nodes that moves as little of the world as it can: every moved
//! chunk is a mass handoff. Nodes that go hand their cells on as [`Partition::without`] does; each
//! node that comes takes its share from the nodes owning most, and nothing else changes hands.

use std::collections::BTreeMap;

use super::{Bsp, BspEntryKind, Grid, Layout, NodeId, Partition, PartitionError};
use crate::geometry::ChunkRect;
use crate::partition::Axis;

impl Partition {
    /// The next epoch for `nodes`. Gone nodes' cells go to their neighbours owning least; a new
    /// node takes, on a grid, whole regions from the nodes owning most (each next to what it
    /// already took where it can) up to an even share, and on a BSP a whole cell from a node
    /// owning several, else the high half of the largest cell.
    pub fn replanned(&self, nodes: &[NodeId]) -> Result<Self, PartitionError> {
        if nodes.is_empty() {
            return Err(PartitionError::NoNodes);
        }
        let had = self.nodes();
        let gone: Vec<NodeId> = had.iter().copied().filter(|n| !nodes.contains(n)).collect();
        let new: Vec<NodeId> = nodes.iter().copied().filter(|n| !had.contains(n)).collect();
        let kept: Vec<NodeId> = nodes.iter().copied().filter(|n| had.contains(n)).collect();
        let mut layout = self.layout().clone();
        if !gone.is_empty() {
            if kept.is_empty() {
                // Nobody stays: the new nodes start from an even layout of their own.
                return self.successor(match self.layout() {
                    Layout::Grid(g) => {
                        Layout::Grid(Grid::even(self.shape(), g.cols(), g.rows(), nodes)?)
                    }
                    Layout::Bsp(_) => Layout::Bsp(Bsp::even(self.shape(), nodes)?),
                });
            }
            if let Some(p) = self.without(&gone, &kept)? {
                layout = p.layout().clone();
            }
        }
        for node in new {
            layout = match layout {
                Layout::Grid(g) => Layout::Grid(grid_with(&g, node, nodes.len(), self)?),
                Layout::Bsp(mut b) => {
                    bsp_with(&mut b, node)?;
                    Layout::Bsp(b)
                }
            };
        }
        self.successor(layout)
    }
}

/// `b` with a cell for `node`: the largest cell of the node owning most when it owns several (a
/// node that took a gone one's cell gives it on whole), else the high half of the largest cell.
fn bsp_with(b: &mut Bsp, node: NodeId) -> Result<(), PartitionError> {
    let leaves: Vec<(usize, NodeId, ChunkRect)> = b
        .entries()
        .filter_map(|e| match e.kind {
            BspEntryKind::Leaf { node } => Some((e.index, node, e.rect)),
            BspEntryKind::Split { .. } => None,
        })
        .collect();
    let mut owned: BTreeMap<NodeId, (i64, usize)> = BTreeMap::new();
    for (_, n, r) in &leaves {
        let o = owned.entry(*n).or_default();
        o.0 += r.area();
        o.1 += 1;
    }
    let largest_of = |owner: Option<NodeId>| {
        leaves
            .iter()
            .filter(|(_, n, _)| owner.is_none_or(|o| o == *n))
            .max_by_key(|(i, _, r)| (r.area(), std::cmp::Reverse(*i)))
            .copied()
    };
    let richest = owned
        .iter()
        .max_by_key(|(n, (area, _))| (*area, std::cmp::Reverse(**n)))
        .map(|(n, (_, cells))| (*n, *cells));
    if let Some((rich, _)) = richest.filter(|(_, cells)| *cells > 1) {
        let (index, _, _) = largest_of(Some(rich)).expect("it owns cells");
        return b.assign(index, node);
    }
    let (index, owner, r) = largest_of(None).expect("a BSP has a leaf");
    let (axis, at) = if r.width() >= r.height() {
        (Axis::X, r.x0 + r.width() / 2)
    } else {
        (Axis::Y, r.y0 + r.height() / 2)
    };
    b.split(index, axis, at, owner, node)
}

/// `g` with `node` given an even share of `of` nodes: a region at a time from the node owning
/// most, next to a region `node` has where there is one.
fn grid_with(g: &Grid, node: NodeId, of: usize, p: &Partition) -> Result<Grid, PartitionError> {
    let (cols, rows) = (g.cols(), g.rows());
    let mut table = g.table().to_vec();
    let share = (table.len() / of.max(1)).max(1);
    let at = |x: u32, y: u32| (y * cols + x) as usize;
    let near = |i: usize| {
        let (x, y) = (i as u32 % cols, i as u32 / cols);
        [
            at((x + cols - 1) % cols, y),
            at((x + 1) % cols, y),
            at(x, (y + rows - 1) % rows),
            at(x, (y + 1) % rows),
        ]
    };
    for _ in 0..share {
        let mut owned: BTreeMap<NodeId, usize> = BTreeMap::new();
        for n in &table {
            *owned.entry(*n).or_default() += 1;
        }
        let Some((&richest, &count)) = owned
            .iter()
            .filter(|(n, _)| **n != node)
            .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n)))
        else {
            break;
        };
        if count <= 1 {
            break;
        }
        let mut theirs = (0..table.len()).rev().filter(|&i| table[i] == richest);
        let next_to_mine = theirs
            .clone()
            .find(|&i| near(i).iter().any(|&j| table[j] == node));
        let Some(i) = next_to_mine.or_else(|| theirs.next()) else {
            break;
        };
        table[i] = node;
    }
    Grid::new(p.shape(), cols, rows, table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::WorldShape;
    use crate::partition::Bsp;

    fn moved(a: &Partition, b: &Partition) -> i64 {
        a.diff(b).unwrap().iter().map(|t| t.area.area()).sum()
    }

    fn world() -> (WorldShape, i64) {
        let s = WorldShape::default();
        (s, s.chunks_x() * s.chunks_y())
    }

    #[test]
    fn a_node_gone_from_a_2x2_grid_moves_its_quarter_only() {
        let (s, all) = world();
        let g = Grid::even(&s, 16, 16, &[1, 2, 3, 4]).unwrap();
        let p = Partition::new(s, 1, Layout::Grid(g)).unwrap();
        let q = p.replanned(&[1, 2, 3]).unwrap();
        assert_eq!(q.epoch(), 2);
        assert_eq!(moved(&p, &q), all / 4, "node 4's quarter and nothing else");
        assert!(q.chunks_of(4) == 0);
        // And one joining takes an even share, from those owning most.
        let r = q.replanned(&[1, 2, 3, 5]).unwrap();
        assert_eq!(moved(&q, &r), r.chunks_of(5));
        assert_eq!(r.chunks_of(5), all / 4, "256 regions / 4");
    }

    #[test]
    fn on_a_bsp_a_node_gone_moves_its_cell_and_a_node_come_takes_half_the_largest() {
        let (s, all) = world();
        let p = Partition::new(s, 1, Layout::Bsp(Bsp::even(&s, &[1, 2, 3, 4]).unwrap())).unwrap();
        let q = p.replanned(&[1, 2, 4]).unwrap();
        assert_eq!(moved(&p, &q), all / 4);
        let r = q.replanned(&[1, 2, 4, 7]).unwrap();
        assert_eq!(
            moved(&q, &r),
            all / 4,
            "half of the largest cell (a half of the world)"
        );
        assert_eq!(r.chunks_of(7), all / 4);
        // The same nodes: nothing moves; one more halves the largest cell.
        assert_eq!(moved(&r, &r.replanned(&[7, 4, 2, 1]).unwrap()), 0);
        let t = r.replanned(&[1, 2, 4, 7, 8]).unwrap();
        assert_eq!((moved(&r, &t), t.chunks_of(8)), (all / 8, all / 8));
    }

    #[test]
    fn everyone_replaced_starts_from_an_even_layout() {
        let (s, all) = world();
        let g = Grid::even(&s, 16, 16, &[1, 2]).unwrap();
        let p = Partition::new(s, 1, Layout::Grid(g)).unwrap();
        let q = p.replanned(&[5, 6]).unwrap();
        assert_eq!(q.chunks_of(5) + q.chunks_of(6), all);
        assert!(p.replanned(&[]).is_err());
    }
}
