//! Node-level chunk subscriptions (docs/mesh.md#interest-node-level-chunk-subscriptions): how a node learns about entities it does not own.
//!
//! The observer side ([`Subscriptions`]) keeps the foreign chunks it needs (those in some
//! client's view, and the interaction band around its own area) and turns every change of that
//! set into one subscribe and one unsubscribe batch per owner. The owner side ([`Subscribers`])
//! records `chunk → subscribing nodes`, so each public update goes once per node, not once per
//! account. Pure: no I/O, no clock.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cellmesh_world::geometry::{ChunkPos, ChunkRect, WorldShape};
use cellmesh_world::partition::{NodeId, Partition};

use crate::model::node_set::NodeSet;

/// What one update of the wanted set asks of the owners, batched per owner.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubscriptionChanges {
    pub subscribe: BTreeMap<NodeId, Vec<ChunkPos>>,
    pub unsubscribe: BTreeMap<NodeId, Vec<ChunkPos>>,
}

impl SubscriptionChanges {
    pub fn is_empty(&self) -> bool {
        self.subscribe.is_empty() && self.unsubscribe.is_empty()
    }

    /// Each owner's chunks in order, so what is sent does not depend on hashing.
    fn sorted(mut self) -> Self {
        for list in self
            .subscribe
            .values_mut()
            .chain(self.unsubscribe.values_mut())
        {
            list.sort_unstable();
        }
        self
    }
}

/// The (chunk, node) pairs this node subscribes to. A chunk may be served by more than its
/// partition owner: a neighbour's entity may stand up to the reach past that neighbour's border
/// before it is handed over, and only its owner writes it.
#[derive(Debug, Clone, Default)]
pub struct Subscriptions {
    /// chunk -> the nodes it is subscribed at (never empty).
    held: HashMap<ChunkPos, NodeSet>,
    /// (chunk, node) pairs held.
    count: usize,
}

impl Subscriptions {
    /// Brings the held set to `wanted`, every pair of it; returns what to send.
    pub fn update(
        &mut self,
        wanted: impl IntoIterator<Item = (ChunkPos, NodeId)>,
    ) -> SubscriptionChanges {
        let mut by_chunk: HashMap<ChunkPos, NodeSet> = HashMap::default();
        for (c, n) in wanted {
            by_chunk.entry(c).or_default().insert(n);
        }
        let mut out = SubscriptionChanges::default();
        let gone: Vec<ChunkPos> = self
            .held
            .keys()
            .filter(|c| !by_chunk.contains_key(c))
            .copied()
            .collect();
        for c in gone {
            self.set(&mut out, c, NodeSet::new());
        }
        for (c, nodes) in by_chunk {
            self.set(&mut out, c, nodes);
        }
        out.sorted()
    }

    /// Brings the pairs of the given chunks alone to what each wants (every node it is wanted
    /// at); the other chunks stay as they are. What a few chunks coming into or leaving views
    /// change costs those chunks, not every pair held.
    pub fn update_chunks(
        &mut self,
        wanted: impl IntoIterator<Item = (ChunkPos, NodeSet)>,
    ) -> SubscriptionChanges {
        let mut out = SubscriptionChanges::default();
        for (c, nodes) in wanted {
            self.set(&mut out, c, nodes);
        }
        out.sorted()
    }

    /// Holds `chunk` at exactly `nodes`, noting the difference in `out`.
    fn set(&mut self, out: &mut SubscriptionChanges, chunk: ChunkPos, nodes: NodeSet) {
        let empty = NodeSet::new();
        let before = self.held.get(&chunk).unwrap_or(&empty);
        if *before == nodes {
            return;
        }
        for n in before.iter().filter(|n| !nodes.contains(n)) {
            out.unsubscribe.entry(n).or_default().push(chunk);
            self.count -= 1;
        }
        for n in nodes.iter().filter(|n| !before.contains(n)) {
            out.subscribe.entry(n).or_default().push(chunk);
            self.count += 1;
        }
        if nodes.is_empty() {
            self.held.remove(&chunk);
        } else {
            self.held.insert(chunk, nodes);
        }
    }

    /// Whether this node subscribed to `chunk` at `node`.
    pub fn has(&self, chunk: ChunkPos, node: NodeId) -> bool {
        self.held.get(&chunk).is_some_and(|n| n.contains(&node))
    }

    /// Every chunk held from `owner`, sorted: sent again when the link to it comes back.
    pub fn of_owner(&self, owner: NodeId) -> Vec<ChunkPos> {
        let mut v: Vec<ChunkPos> = self
            .held
            .iter()
            .filter(|(_, nodes)| nodes.contains(&owner))
            .map(|(c, _)| *c)
            .collect();
        v.sort_unstable();
        v
    }

    /// Every (chunk, node) pair held, in no order.
    pub fn pairs(&self) -> impl Iterator<Item = (ChunkPos, NodeId)> + '_ {
        self.held
            .iter()
            .flat_map(|(c, nodes)| nodes.iter().map(move |n| (*c, n)))
    }

    /// (chunk, node) pairs held.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// The nodes whose area lies within `reach` chunks of `chunk` (its partition owner included):
/// the only nodes that may own an entity standing there.
pub fn owners_near(partition: &Partition, chunk: ChunkPos, reach: i64) -> BTreeSet<NodeId> {
    let mut out = BTreeSet::new();
    for dy in -reach..=reach {
        for dx in -reach..=reach {
            let c = partition.shape().normalise_chunk(ChunkPos {
                x: chunk.x + dx,
                y: chunk.y + dy,
            });
            out.insert(partition.owner_of_chunk(c));
        }
    }
    out
}

/// The owner's side: which nodes subscribe to each of its chunks.
#[derive(Debug, Clone, Default)]
pub struct Subscribers {
    by_chunk: HashMap<ChunkPos, BTreeSet<NodeId>>,
    count: usize,
}

impl Subscribers {
    /// Records `node` on `chunk`; true if it was not subscribed yet (it needs a snapshot).
    pub fn add(&mut self, node: NodeId, chunk: ChunkPos) -> bool {
        let fresh = self.by_chunk.entry(chunk).or_default().insert(node);
        self.count += usize::from(fresh);
        fresh
    }

    /// Forgets `node` on `chunk`; true if it was subscribed.
    pub fn remove(&mut self, node: NodeId, chunk: ChunkPos) -> bool {
        let Some(set) = self.by_chunk.get_mut(&chunk) else {
            return false;
        };
        let gone = set.remove(&node);
        if set.is_empty() {
            self.by_chunk.remove(&chunk);
        }
        self.count -= usize::from(gone);
        gone
    }

    /// Forgets every subscription of `node` (its link is gone).
    pub fn remove_node(&mut self, node: NodeId) {
        let mut removed = 0;
        self.by_chunk.retain(|_, set| {
            removed += usize::from(set.remove(&node));
            !set.is_empty()
        });
        self.count -= removed;
    }

    /// The nodes subscribed to `chunk`.
    pub fn of(&self, chunk: ChunkPos) -> impl Iterator<Item = NodeId> + '_ {
        self.by_chunk.get(&chunk).into_iter().flatten().copied()
    }

    /// (chunk, node) pairs.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// `area` with vertically adjacent rectangles of the same columns merged (a grid gives one per
/// row of regions), so a game is told a few large rectangles.
pub fn merge_rects(mut area: Vec<ChunkRect>) -> Vec<ChunkRect> {
    area.sort_unstable_by_key(|r| (r.x0, r.x1, r.y0));
    let mut out: Vec<ChunkRect> = Vec::with_capacity(area.len());
    for r in area {
        match out.last_mut() {
            Some(last) if last.x0 == r.x0 && last.x1 == r.x1 && last.y1 == r.y0 => last.y1 = r.y1,
            _ => out.push(r),
        }
    }
    out
}

/// What a node keeps subscribed whatever its clients see, so its game perceives across its
/// borders and it holds a ghost of every entity that may be handed to it: the foreign chunks
/// within `radius` outside its area and the chunks within `reach` inside it, each at every other
/// node that may own an entity there.
pub fn band(
    partition: &Partition,
    node: NodeId,
    radius: i64,
    reach: i64,
) -> HashSet<(ChunkPos, NodeId)> {
    let world = *partition.shape();
    let mut out = HashSet::default();
    let mut seen = HashSet::default();
    for rect in partition.area_of(node) {
        let inner = inner_ring(&rect, reach);
        for c in ring(&rect, radius.max(0)).chain(inner) {
            let c = world.normalise_chunk(c);
            if !seen.insert(c) {
                continue;
            }
            for n in owners_near(partition, c, reach) {
                if n != node {
                    out.insert((c, n));
                }
            }
        }
    }
    out
}

/// The chunks of `rect` within `depth` of its edge.
fn inner_ring(rect: &ChunkRect, depth: i64) -> impl Iterator<Item = ChunkPos> + '_ {
    (rect.y0..rect.y1).flat_map(move |y| {
        (rect.x0..rect.x1)
            .filter(move |&x| {
                depth > 0
                    && (x - rect.x0 < depth
                        || rect.x1 - 1 - x < depth
                        || y - rect.y0 < depth
                        || rect.y1 - 1 - y < depth)
            })
            .map(move |x| ChunkPos { x, y })
    })
}

/// The chunks around `rect` up to `radius` out (not normalised; may repeat in a small world).
fn ring(rect: &ChunkRect, radius: i64) -> impl Iterator<Item = ChunkPos> + '_ {
    let (x0, y0, x1, y1) = (
        rect.x0 - radius,
        rect.y0 - radius,
        rect.x1 + radius,
        rect.y1 + radius,
    );
    let rows = (y0..rect.y0)
        .chain(rect.y1..y1)
        .flat_map(move |y| (x0..x1).map(move |x| ChunkPos { x, y }));
    let sides = (rect.y0..rect.y1).flat_map(move |y| {
        (x0..rect.x0)
            .chain(rect.x1..x1)
            .map(move |x| ChunkPos { x, y })
    });
    rows.chain(sides)
}

/// Chebyshev distance in chunks from `chunk` to the nearest chunk of `area` (0 inside it).
pub fn distance_to_area(world: &WorldShape, area: &[ChunkRect], chunk: ChunkPos) -> i64 {
    let c = world.normalise_chunk(chunk);
    let one = ChunkRect::new(c.x, c.y, c.x + 1, c.y + 1);
    area.iter()
        .map(|r| world.rect_distance(r, &one))
        .min()
        .unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_world::partition::{Grid, Layout};

    fn c(x: i64, y: i64) -> ChunkPos {
        ChunkPos { x, y }
    }

    fn grid(cols: u32, rows: u32, nodes: &[NodeId]) -> Partition {
        // 16 x 16 chunks.
        let shape = WorldShape {
            width: 512.0,
            height: 512.0,
            chunk_size: 32.0,
            region_size: 128.0,
        };
        let g = Grid::even(&shape, cols, rows, nodes).unwrap();
        Partition::new(shape, 1, Layout::Grid(g)).unwrap()
    }

    #[test]
    fn changes_are_batched_per_owner_and_only_once() {
        let mut s = Subscriptions::default();
        let ch = s.update([(c(1, 1), 2), (c(2, 1), 2), (c(9, 9), 3)]);
        assert_eq!(ch.subscribe[&2], [c(1, 1), c(2, 1)]);
        assert_eq!(ch.subscribe[&3], [c(9, 9)]);
        assert!(ch.unsubscribe.is_empty());
        assert!(s
            .update([(c(1, 1), 2), (c(2, 1), 2), (c(9, 9), 3)])
            .is_empty());
        let ch = s.update([(c(2, 1), 2), (c(3, 1), 2)]);
        assert_eq!(ch.subscribe[&2], [c(3, 1)]);
        assert_eq!(ch.unsubscribe[&2], [c(1, 1)]);
        assert_eq!(ch.unsubscribe[&3], [c(9, 9)]);
        assert_eq!(s.of_owner(2), [c(2, 1), c(3, 1)]);
        assert_eq!((s.len(), s.has(c(9, 9), 3)), (2, false));
        assert!(s.has(c(3, 1), 2));
        // A chunk that changed hands moves from one owner to the other.
        let ch = s.update([(c(2, 1), 4), (c(3, 1), 2)]);
        assert_eq!(
            (ch.unsubscribe[&2].clone(), ch.subscribe[&4].clone()),
            (vec![c(2, 1)], vec![c(2, 1)])
        );
    }

    proptest::proptest! {
        /// Bringing only the chunks whose wanted nodes changed up to date, step after step,
        /// holds and sends what bringing every pair up to date does.
        #[test]
        fn chunk_by_chunk_agrees_with_the_whole(
            steps in proptest::collection::vec(
                proptest::collection::vec((0i64..6, 0u32..5, proptest::bool::ANY), 0..12),
                1..12,
            )
        ) {
            let (mut whole, mut by_chunk) = (Subscriptions::default(), Subscriptions::default());
            let mut wanted: BTreeSet<(ChunkPos, NodeId)> = BTreeSet::new();
            for step in steps {
                let mut touched: BTreeSet<ChunkPos> = BTreeSet::new();
                for (x, n, on) in step {
                    if on { wanted.insert((c(x, 0), n)) } else { wanted.remove(&(c(x, 0), n)) };
                    touched.insert(c(x, 0));
                }
                let a = whole.update(wanted.iter().copied());
                let b = by_chunk.update_chunks(touched.iter().map(|t| {
                    (*t, wanted.iter().filter(|(k, _)| k == t).map(|(_, n)| *n).collect())
                }));
                proptest::prop_assert_eq!(a, b);
                let held: BTreeSet<_> = by_chunk.pairs().collect();
                proptest::prop_assert_eq!(&held, &wanted);
                proptest::prop_assert_eq!(by_chunk.len(), wanted.len());
            }
        }
    }

    #[test]
    fn subscribers_count_pairs() {
        let mut s = Subscribers::default();
        assert!(s.add(2, c(0, 0)));
        assert!(!s.add(2, c(0, 0)), "a repeat needs no second snapshot");
        assert!(s.add(3, c(0, 0)) && s.add(3, c(1, 0)));
        assert_eq!(s.of(c(0, 0)).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(s.len(), 3);
        assert!(s.remove(2, c(0, 0)) && !s.remove(2, c(0, 0)));
        s.remove_node(3);
        assert!(s.is_empty() && s.of(c(1, 0)).next().is_none());
    }

    #[test]
    fn the_band_wraps_and_reaches_inside_the_own_area() {
        // 2 x 1: node 1 owns x in [0, 8), node 2 [8, 16); both borders of node 1 face node 2.
        let p = grid(2, 1, &[1, 2]);
        let b = band(&p, 1, 1, 0);
        // Columns 8 (east) and 15 (west, across the seam), every row, all at node 2.
        assert_eq!(b.len(), 2 * 16);
        assert!(b.contains(&(c(8, 3), 2)) && b.contains(&(c(15, 3), 2)));
        assert_eq!(band(&p, 1, 2, 0).len(), 4 * 16);
        // A reach of 1 adds the own edge columns (0 and 7), where node 2's entities may stand.
        let b = band(&p, 1, 1, 1);
        assert_eq!(b.len(), 4 * 16);
        assert!(b.contains(&(c(0, 3), 2)) && b.contains(&(c(7, 3), 2)));
        assert!(b.iter().all(|(_, n)| *n == 2));
        // One node owning everything has no band.
        assert!(band(&grid(1, 1, &[1]), 1, 2, 3).is_empty());
    }

    #[test]
    fn owners_near_a_chunk_include_neighbours_within_reach() {
        let p = grid(2, 2, &[1, 2, 3, 4]);
        // Chunk (1, 1) sits near the seam corner: every quadrant is within 2 chunks.
        assert_eq!(owners_near(&p, c(1, 1), 2).len(), 4);
        assert_eq!(owners_near(&p, c(4, 4), 2), BTreeSet::from([1]));
        assert_eq!(owners_near(&p, c(6, 4), 2), BTreeSet::from([1, 2]));
    }

    #[test]
    fn rows_of_regions_merge_into_one_rectangle() {
        let rows = vec![
            ChunkRect::new(0, 4, 8, 8),
            ChunkRect::new(0, 0, 8, 4),
            ChunkRect::new(8, 0, 16, 4),
        ];
        assert_eq!(
            merge_rects(rows),
            [ChunkRect::new(0, 0, 8, 8), ChunkRect::new(8, 0, 16, 4)]
        );
    }

    #[test]
    fn distance_to_an_area_is_wrap_aware() {
        let p = grid(2, 1, &[1, 2]);
        let area = p.area_of(1);
        let w = *p.shape();
        assert_eq!(distance_to_area(&w, &area, c(3, 3)), 0);
        assert_eq!(distance_to_area(&w, &area, c(8, 3)), 1);
        assert_eq!(distance_to_area(&w, &area, c(15, 3)), 1, "across the seam");
        assert_eq!(distance_to_area(&w, &area, c(10, 3)), 3);
    }
}
