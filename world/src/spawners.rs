//! Region-owned spawners: the static spawn points (dens, resources) a game declares once, each
//! under a stable key. A point is stocked by the node that owns its chunk, and by no other: a
//! point on a border lies in exactly one chunk, so belongs to exactly one node, and a re-plan
//! moves it with its chunk ([`Spawners::changes`] says which points a node gains and loses). What
//! a spawner stocks gets an id derived from its key and generation ([`spawn_id`]), so that two
//! nodes, or one node before and after a restart, can never stock it under two ids.
//!
//! Pure: positions and partitions in, keys and ids out.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::geometry::{ChunkPos, Pos, WorldShape};
use crate::partition::{NodeId, Partition};

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 128;

/// The bit every spawner's entity id has set. Minted ids (`topology::ids`) never have it: the
/// minter stops at 2^40 ms past its epoch (late 2058), so the two kinds of ids never meet.
pub const SPAWNED_ID_BIT: u64 = 1 << 62;

/// A spawn point as the game declares it.
#[derive(Debug, Clone, PartialEq)]
pub struct SpawnPoint {
    pub key: String,
    pub pos: Pos,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpawnerError {
    #[error("a spawn point has an empty key")]
    EmptyKey,
    #[error("spawn point key {key:?} is longer than {MAX_KEY_LEN} bytes")]
    KeyTooLong { key: String },
    #[error("spawn point {key:?} has no finite position ({x}, {y})")]
    BadPosition { key: String, x: f64, y: f64 },
    #[error("spawn point {key:?} is declared twice")]
    Duplicate { key: String },
}

/// The points a node gains and loses when the partition changes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Now this node's to stock (`SpawnerOwned`).
    pub owned: Vec<String>,
    /// No longer this node's (`SpawnerReleased`): another node stocks them from now on.
    pub released: Vec<String>,
}

/// A game's spawn points, each resolved to its chunk.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Spawners {
    chunks: BTreeMap<String, ChunkPos>,
}

impl Spawners {
    /// Validates `points` on the world `shape` (a position off the world wraps onto it).
    pub fn new(
        shape: &WorldShape,
        points: impl IntoIterator<Item = SpawnPoint>,
    ) -> Result<Self, SpawnerError> {
        let mut chunks = BTreeMap::new();
        for SpawnPoint { key, pos } in points {
            if key.is_empty() {
                return Err(SpawnerError::EmptyKey);
            }
            if key.len() > MAX_KEY_LEN {
                return Err(SpawnerError::KeyTooLong { key });
            }
            if !(pos.x.is_finite() && pos.y.is_finite()) {
                return Err(SpawnerError::BadPosition {
                    key,
                    x: pos.x,
                    y: pos.y,
                });
            }
            let chunk = shape.chunk_of(shape.normalise(pos));
            if chunks.insert(key.clone(), chunk).is_some() {
                return Err(SpawnerError::Duplicate { key });
            }
        }
        Ok(Self { chunks })
    }

    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The keys `node` stocks under `partition`, in key order.
    pub fn owned_by(&self, partition: &Partition, node: NodeId) -> Vec<String> {
        self.chunks
            .iter()
            .filter(|(_, c)| partition.owner_of_chunk(**c) == node)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// What `node` gains and loses going from `old` (none: the node starts) to `new`.
    pub fn changes(&self, old: Option<&Partition>, new: &Partition, node: NodeId) -> Changes {
        let mut out = Changes::default();
        for (key, chunk) in &self.chunks {
            let was = old.is_some_and(|p| p.owner_of_chunk(*chunk) == node);
            let is = new.owner_of_chunk(*chunk) == node;
            match (was, is) {
                (false, true) => out.owned.push(key.clone()),
                (true, false) => out.released.push(key.clone()),
                _ => {}
            }
        }
        out
    }
}

/// The id of what spawner `key` stocks in its `generation` (the game counts one up each time it
/// restocks): the same on every node and after every restart, so a den stocked once is known by
/// one id whoever holds it. Positive as an `i64`, with [`SPAWNED_ID_BIT`] set.
pub fn spawn_id(key: &str, generation: u64) -> u64 {
    let mut h = Sha256::new();
    h.update((key.len() as u64).to_be_bytes());
    h.update(key.as_bytes());
    h.update(generation.to_be_bytes());
    let digest = h.finalize();
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest[..8]);
    (u64::from_be_bytes(head) & (SPAWNED_ID_BIT - 1)) | SPAWNED_ID_BIT
}

/// Whether `id` is a spawner's (a minted id never is).
pub fn is_spawned_id(id: u64) -> bool {
    id & SPAWNED_ID_BIT != 0 && id >> 63 == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::{Bsp, Grid, Layout};
    use proptest::prelude::*;

    fn world() -> WorldShape {
        WorldShape {
            width: 1024.0,
            height: 1024.0,
            chunk_size: 32.0,
            region_size: 256.0,
        }
    }

    fn point(key: &str, x: f64, y: f64) -> SpawnPoint {
        SpawnPoint {
            key: key.into(),
            pos: Pos { x, y },
        }
    }

    #[test]
    fn a_den_on_a_border_is_stocked_by_one_node_and_follows_its_chunk_in_a_replan() {
        let shape = world();
        // Node 1 west of x = 512 m, node 2 east; the den sits on the line itself, the cave
        // across the seam at x = 0.
        let grid = Grid::even(&shape, 2, 1, &[1, 2]).unwrap();
        let p1 = Partition::new(shape, 1, Layout::Grid(grid)).unwrap();
        let s = Spawners::new(
            &shape,
            [
                point("den", 512.0, 100.0),
                point("cave", 1024.0, 5.0),
                point("ore", 100.0, 100.0),
            ],
        )
        .unwrap();
        assert_eq!(s.owned_by(&p1, 1), ["cave", "ore"]);
        assert_eq!(s.owned_by(&p1, 2), ["den"]);
        // A BSP line moved west over the ore: it changes hands, and only it.
        let tree = crate::partition::BspTree::split(
            crate::partition::Axis::X,
            2,
            crate::partition::BspTree::leaf(1),
            crate::partition::BspTree::leaf(2),
        );
        let p2 = p1
            .successor(Layout::Bsp(Bsp::new(&shape, &tree).unwrap()))
            .unwrap();
        assert_eq!(
            s.changes(Some(&p1), &p2, 1),
            Changes {
                owned: vec![],
                released: vec!["ore".into()]
            }
        );
        assert_eq!(
            s.changes(Some(&p1), &p2, 2),
            Changes {
                owned: vec!["ore".into()],
                released: vec![]
            }
        );
        // A node that starts gains everything it owns.
        assert_eq!(s.changes(None, &p2, 1).owned, ["cave"]);
    }

    #[test]
    fn bad_spawn_points_are_refused_by_key() {
        let shape = world();
        let one = |p| Spawners::new(&shape, [p]).unwrap_err();
        assert_eq!(one(point("", 1.0, 1.0)), SpawnerError::EmptyKey);
        assert!(matches!(
            one(point(&"k".repeat(MAX_KEY_LEN + 1), 1.0, 1.0)),
            SpawnerError::KeyTooLong { .. }
        ));
        assert!(matches!(
            one(point("nan", f64::NAN, 1.0)),
            SpawnerError::BadPosition { .. }
        ));
        assert_eq!(
            Spawners::new(&shape, [point("a", 1.0, 1.0), point("a", 9.0, 9.0)]).unwrap_err(),
            SpawnerError::Duplicate { key: "a".into() }
        );
    }

    #[test]
    fn a_spawners_id_is_the_same_everywhere_and_never_a_snowflakes() {
        let a = spawn_id("den", 0);
        assert_eq!(a, spawn_id("den", 0), "deterministic");
        assert_ne!(a, spawn_id("den", 1), "each generation its own");
        assert_ne!(a, spawn_id("den2", 0));
        // The key's length is hashed too: ("ab", …) and ("a", …) with a shifted tail differ.
        assert_ne!(spawn_id("a", 0x6200_0000_0000_0000), spawn_id("ab", 0));
        assert!(is_spawned_id(a) && (a as i64) > 0);
        // A snowflake minted today (41 bits of milliseconds, then node and sequence) has the
        // bit clear; the topology's minter tests its whole range against it.
        let now_ms: u64 = 3 * 365 * 24 * 3_600_000;
        assert!(!is_spawned_id(now_ms << 22 | 5 << 12 | 7));
    }

    proptest! {
        /// Whatever the layout, every point is stocked by exactly one node, and going from one
        /// layout to another, each point a node releases is one another node gains.
        #[test]
        fn every_point_has_one_stocker_through_any_replan(
            nodes in 1u32..7,
            others in proptest::collection::vec(1u32..7, 1..7),
            points in proptest::collection::vec((-2_000.0f64..2_000.0, -2_000.0f64..2_000.0), 1..40),
        ) {
            let shape = world();
            let ids: Vec<NodeId> = (1..=nodes).collect();
            let p1 = Partition::new(shape, 1, Layout::Bsp(Bsp::even(&shape, &ids).unwrap())).unwrap();
            let mut later: Vec<NodeId> = others.clone();
            later.sort_unstable();
            later.dedup();
            let p2 = p1.successor(Layout::Bsp(Bsp::even(&shape, &later).unwrap())).unwrap();
            let s = Spawners::new(
                &shape,
                points.iter().enumerate().map(|(i, (x, y))| point(&format!("p{i}"), *x, *y)),
            ).unwrap();
            let all: Vec<NodeId> = (1..7).collect();
            for p in [&p1, &p2] {
                let mut stocked: Vec<String> = all.iter().flat_map(|n| s.owned_by(p, *n)).collect();
                stocked.sort();
                let before = stocked.len();
                stocked.dedup();
                prop_assert_eq!(before, stocked.len(), "a point with two stockers");
                prop_assert_eq!(stocked.len(), s.len(), "a point with none");
            }
            let mut gained: Vec<String> = all.iter().flat_map(|n| s.changes(Some(&p1), &p2, *n).owned).collect();
            let mut lost: Vec<String> = all.iter().flat_map(|n| s.changes(Some(&p1), &p2, *n).released).collect();
            gained.sort();
            lost.sort();
            prop_assert_eq!(gained, lost);
        }
    }
}
