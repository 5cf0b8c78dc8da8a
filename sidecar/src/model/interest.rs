//! A session's view: the chunks around its anchor (the player's own entity), with hysteresis.
//!
//! A chunk enters the view when it comes within `radius` chunks (Chebyshev, around the torus) of
//! the anchor's chunk, and leaves only when it is more than `radius + margin` away, so a player
//! pacing on a chunk edge does not make the world flicker. The same rule holds per entity: an
//! entity appears when its chunk is in the view, and once seen it stays while its chunk is within
//! `radius + margin` of the anchor.

use rustc_hash::FxHashSet as HashSet;

use cellmesh_world::geometry::{ChunkPos, WorldShape};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InterestShape {
    pub radius: i64,
    pub margin: i64,
}

impl InterestShape {
    pub fn new(radius: u32, margin: u32) -> Self {
        Self {
            radius: radius as i64,
            margin: margin as i64,
        }
    }

    pub fn release(&self) -> i64 {
        self.radius + self.margin
    }
}

#[derive(Debug, Clone, Default)]
pub struct View {
    anchor: Option<ChunkPos>,
    chunks: HashSet<ChunkPos>,
}

/// What one anchor move changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ViewChange {
    pub entered: Vec<ChunkPos>,
    pub left: Vec<ChunkPos>,
}

impl View {
    pub fn anchor(&self) -> Option<ChunkPos> {
        self.anchor
    }

    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    pub fn chunks(&self) -> impl Iterator<Item = ChunkPos> + '_ {
        self.chunks.iter().copied()
    }

    /// An entity in `chunk` appears to this session.
    pub fn holds(&self, chunk: ChunkPos) -> bool {
        self.chunks.contains(&chunk)
    }

    /// An entity already shown in `chunk` stays shown.
    pub fn keeps(&self, world: &WorldShape, shape: InterestShape, chunk: ChunkPos) -> bool {
        self.holds(chunk)
            || self
                .anchor
                .is_some_and(|a| world.chunk_distance(a, chunk) <= shape.release())
    }

    /// Moves the anchor to `anchor` (a normalised chunk); a no-op when it did not change chunk.
    pub fn move_anchor(
        &mut self,
        world: &WorldShape,
        shape: InterestShape,
        anchor: ChunkPos,
    ) -> ViewChange {
        if self.anchor == Some(anchor) {
            return ViewChange::default();
        }
        self.anchor = Some(anchor);
        let release = shape.release();
        let mut left: Vec<ChunkPos> = self
            .chunks
            .iter()
            .copied()
            .filter(|c| world.chunk_distance(anchor, *c) > release)
            .collect();
        for c in &left {
            self.chunks.remove(c);
        }
        let mut entered = Vec::new();
        for c in world.chunks_within(anchor, shape.radius) {
            if self.chunks.insert(c) {
                entered.push(c);
            }
        }
        left.sort_unstable();
        entered.sort_unstable();
        ViewChange { entered, left }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SHAPE: InterestShape = InterestShape {
        radius: 5,
        margin: 1,
    };

    fn world() -> WorldShape {
        // 64 x 32 chunks: small enough that the seam is close to everything.
        WorldShape {
            width: 2048.0,
            height: 1024.0,
            chunk_size: 32.0,
            region_size: 1024.0,
        }
    }

    fn c(x: i64, y: i64) -> ChunkPos {
        ChunkPos { x, y }
    }

    #[test]
    fn first_anchor_enters_the_whole_radius() {
        let mut v = View::default();
        let ch = v.move_anchor(&world(), SHAPE, c(10, 10));
        assert_eq!(ch.entered.len(), 121);
        assert!(ch.left.is_empty());
        assert!(v.holds(c(15, 5)) && !v.holds(c(16, 10)));
    }

    #[test]
    fn a_chunk_leaves_only_past_the_margin() {
        let w = world();
        let mut v = View::default();
        v.move_anchor(&w, SHAPE, c(10, 10));
        // One step east: column 5 is now 6 away, inside the margin: it stays.
        let ch = v.move_anchor(&w, SHAPE, c(11, 10));
        assert!(ch.left.is_empty());
        assert_eq!(ch.entered.len(), 11);
        assert!(v.holds(c(5, 10)));
        // Another step: column 5 is 7 away and leaves; stepping back re-enters it only at 5.
        let ch = v.move_anchor(&w, SHAPE, c(12, 10));
        assert_eq!(ch.left.len(), 11);
        assert!(ch.left.iter().all(|p| p.x == 5));
        let ch = v.move_anchor(&w, SHAPE, c(11, 10));
        assert!(ch.entered.is_empty() && ch.left.is_empty(), "{ch:?}");
        assert!(!v.holds(c(5, 10)));
        // Pacing between two chunks changes nothing after the first step.
        for _ in 0..3 {
            assert_eq!(v.move_anchor(&w, SHAPE, c(12, 10)), ViewChange::default());
            assert_eq!(v.move_anchor(&w, SHAPE, c(11, 10)), ViewChange::default());
        }
    }

    #[test]
    fn per_entity_hysteresis() {
        let w = world();
        let mut v = View::default();
        v.move_anchor(&w, SHAPE, c(10, 10));
        assert!(v.holds(c(15, 10)) && v.keeps(&w, SHAPE, c(15, 10)));
        assert!(!v.holds(c(16, 10)), "6 away: does not appear");
        assert!(v.keeps(&w, SHAPE, c(16, 10)), "6 away: stays once seen");
        assert!(!v.keeps(&w, SHAPE, c(17, 10)), "7 away: vanishes");
    }

    #[test]
    fn the_torus_seam_is_not_a_border() {
        let w = world();
        let mut v = View::default();
        let ch = v.move_anchor(&w, SHAPE, c(0, 0));
        assert_eq!(ch.entered.len(), 121);
        assert!(v.holds(c(63, 31)) && v.holds(c(59, 27)) && !v.holds(c(58, 0)));
        // Crossing the seam westwards: nothing leaves yet (column 5 is 6 away from column 63).
        let ch = v.move_anchor(&w, SHAPE, c(63, 0));
        assert!(ch.left.is_empty());
        assert!(ch.entered.iter().all(|p| p.x == 58), "{ch:?}");
        let ch = v.move_anchor(&w, SHAPE, c(62, 0));
        assert!(
            ch.left.iter().all(|p| p.x == 5) && ch.left.len() == 11,
            "{ch:?}"
        );
        assert!(v.keeps(&w, SHAPE, c(4, 0)) && !v.keeps(&w, SHAPE, c(5, 0)));
    }

    #[test]
    fn a_world_smaller_than_the_view_is_all_in_view_once() {
        let w = WorldShape {
            width: 256.0,
            height: 128.0,
            chunk_size: 32.0,
            region_size: 128.0,
        };
        let mut v = View::default();
        let ch = v.move_anchor(&w, SHAPE, c(1, 1));
        assert_eq!(ch.entered.len(), 8 * 4);
        let ch = v.move_anchor(&w, SHAPE, c(7, 3));
        assert_eq!(ch, ViewChange::default());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// After any walk: every chunk within the radius is in the view, none beyond the release
        /// distance is, and the reported changes are exactly the set difference.
        #[test]
        fn view_invariants(steps in proptest::collection::vec((-3i64..=3, -3i64..=3), 1..60)) {
            // Small enough to check every chunk, big enough that the view does not cover it.
            let w = WorldShape { width: 768.0, height: 512.0, chunk_size: 32.0, region_size: 256.0 };
            let mut v = View::default();
            let mut at = c(3, 3);
            for (dx, dy) in steps {
                at = w.normalise_chunk(c(at.x + dx, at.y + dy));
                let before: HashSet<ChunkPos> = v.chunks().collect();
                let ch = v.move_anchor(&w, SHAPE, at);
                let after: HashSet<ChunkPos> = v.chunks().collect();
                let entered: HashSet<ChunkPos> = after.difference(&before).copied().collect();
                let left: HashSet<ChunkPos> = before.difference(&after).copied().collect();
                prop_assert_eq!(entered, ch.entered.iter().copied().collect::<HashSet<_>>());
                prop_assert_eq!(left, ch.left.iter().copied().collect::<HashSet<_>>());
                for x in 0..w.chunks_x() {
                    for y in 0..w.chunks_y() {
                        let d = w.chunk_distance(at, c(x, y));
                        if d <= SHAPE.radius { prop_assert!(v.holds(c(x, y))); }
                        if d > SHAPE.release() { prop_assert!(!v.holds(c(x, y))); }
                    }
                }
            }
        }
    }
}
