//! Snowflake entity ids, minted by the node that owns the world where they are spawned.
//!
//! The 64-bit layout (41 bits of milliseconds since [`EPOCH_UNIX_MS`], 10 bits of node id, 12 bits
//! of sequence) is the one of `cellmesh_geo_router::topology::ids`, shared with the lease-bound
//! minter, so ids from either decode the same way.
//!
//! Ids from one minter are strictly increasing. When the clock steps back, or more than 4096 ids
//! are asked for within one millisecond, the minter keeps counting on its own last millisecond
//! (borrowing from the future) instead of waiting or repeating itself.

use cellmesh_geo_router::topology::ids::{self as layout, MAX_SEQ, MAX_TIME};

/// Unix time of the id epoch, in milliseconds.
pub const EPOCH_UNIX_MS: u64 = layout::ID_EPOCH_UNIX_MS;
pub use layout::MAX_NODE_ID;

#[derive(Debug, Clone)]
pub struct IdMinter {
    node: u32,
    /// Millisecond (since the id epoch) and sequence of the last id minted.
    last_ms: u64,
    last_seq: u64,
}

/// The fields of an id, for tests and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdParts {
    pub ms_since_epoch: u64,
    pub node: u32,
    pub seq: u32,
}

impl IdMinter {
    /// `node` must be at most [`MAX_NODE_ID`] (checked by the config).
    pub fn new(node: u32) -> Self {
        assert!(node <= MAX_NODE_ID, "node id {node} exceeds {MAX_NODE_ID}");
        // Starting at millisecond 1 keeps every id nonzero, even for node 0 at the epoch itself.
        Self {
            node,
            last_ms: 1,
            last_seq: MAX_SEQ,
        }
    }

    /// Mints the next id at wall-clock `now_unix_ms`.
    pub fn mint(&mut self, now_unix_ms: u64) -> u64 {
        let now = now_unix_ms.saturating_sub(EPOCH_UNIX_MS).min(MAX_TIME);
        (self.last_ms, self.last_seq) = layout::next_stamp((self.last_ms, self.last_seq), now);
        layout::compose(self.last_ms, self.node, self.last_seq)
    }

    /// Mints `count` consecutive ids.
    pub fn mint_many(&mut self, now_unix_ms: u64, count: usize) -> Vec<u64> {
        (0..count).map(|_| self.mint(now_unix_ms)).collect()
    }
}

pub fn split(id: u64) -> IdParts {
    IdParts {
        ms_since_epoch: layout::ms_of(id),
        node: layout::node_of(id),
        seq: layout::seq_of(id) as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: u64 = EPOCH_UNIX_MS + 1_000_000;

    #[test]
    fn layout_round_trips() {
        let mut m = IdMinter::new(513);
        let id = m.mint(T0 + 5);
        assert_eq!(
            split(id),
            IdParts {
                ms_since_epoch: 1_000_005,
                node: 513,
                seq: 0
            }
        );
        assert_eq!(split(m.mint(T0 + 5)).seq, 1);
        assert!(id < i64::MAX as u64);
    }

    #[test]
    fn clock_stepping_back_stays_monotonic() {
        let mut m = IdMinter::new(1);
        let a = m.mint(T0);
        let b = m.mint(T0 - 60_000);
        let c = m.mint(T0 - 120_000);
        assert!(a < b && b < c);
        assert_eq!(split(c).ms_since_epoch, split(a).ms_since_epoch);
    }

    #[test]
    fn sequence_overflow_borrows_the_next_millisecond() {
        let mut m = IdMinter::new(2);
        let ids = m.mint_many(T0, 5000);
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(split(ids[4095]).ms_since_epoch, 1_000_000);
        assert_eq!(
            split(ids[4096]),
            IdParts {
                ms_since_epoch: 1_000_001,
                node: 2,
                seq: 0
            }
        );
        // The real clock catching up with the borrowed millisecond does not repeat it.
        let next = m.mint(T0 + 1);
        assert!(next > ids[4999]);
    }

    #[test]
    fn never_zero_even_before_the_epoch() {
        let mut m = IdMinter::new(0);
        assert_ne!(m.mint(0), 0);
        assert_ne!(m.mint(EPOCH_UNIX_MS), 0);
    }

    proptest! {
        /// Any clock sequence, any two nodes: ids increase per node, carry their node, and no
        /// id is minted twice.
        #[test]
        fn monotonic_and_unique_across_nodes(
            steps in proptest::collection::vec((0u64..3, -50i64..50, 1usize..300), 1..40),
            node_a in 0u32..=MAX_NODE_ID, node_b in 0u32..=MAX_NODE_ID,
        ) {
            prop_assume!(node_a != node_b);
            let mut minters = [IdMinter::new(node_a), IdMinter::new(node_b)];
            let mut last = [0u64; 2];
            let mut seen = std::collections::HashSet::new();
            let mut clock = T0 as i64;
            for (which, jump, count) in steps {
                clock += jump;
                let i = (which % 2) as usize;
                for id in minters[i].mint_many(clock as u64, count) {
                    prop_assert!(id > last[i]);
                    last[i] = id;
                    prop_assert_eq!(split(id).node, [node_a, node_b][i]);
                    prop_assert!(seen.insert(id));
                }
            }
        }
    }
}
