//! Snowflake entity ids, minted by the node that owns the world where they are spawned.
//!
//! The 64-bit layout (41 bits of milliseconds since [`EPOCH_UNIX_MS`], 10 bits of node id, 12 bits
//! of sequence) is the one of `cellmesh_stores::topology::ids`, shared with the lease-bound
//! minter, so ids from either decode the same way.
//!
//! Ids from one minter are strictly increasing. When the clock steps back, or more than 4096 ids
//! are asked for within one millisecond, the minter keeps counting on its own last millisecond
//! (borrowing from the future, never past its lease) instead of waiting or repeating itself.

use cellmesh_stores::topology::ids as layout;

/// Unix time of the id epoch, in milliseconds.
pub const EPOCH_UNIX_MS: u64 = layout::ID_EPOCH_UNIX_MS;
pub use layout::MAX_NODE_ID;

/// Mints the ids a game reserves: under this node's lease (a successor's ids start past every
/// id of the holder before it, and none is stamped at or past the lease's expiry), or unbounded
/// for a lone node with no lease.
pub use cellmesh_stores::topology::LeasedIds as IdMinter;

/// The fields of an id, for tests and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdParts {
    pub ms_since_epoch: u64,
    pub node: u32,
    pub seq: u32,
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

    const T0: u64 = EPOCH_UNIX_MS + 1_000_000;

    #[test]
    fn layout_round_trips() {
        let mut m = IdMinter::unbounded(513).unwrap();
        let id = m.mint(T0 + 5).unwrap();
        assert_eq!(
            split(id),
            IdParts {
                ms_since_epoch: 1_000_005,
                node: 513,
                seq: 0
            }
        );
        assert_eq!(split(m.mint(T0 + 5).unwrap()).seq, 1);
        assert!(id < i64::MAX as u64);
    }

    #[test]
    fn sequence_overflow_borrows_the_next_millisecond() {
        let mut m = IdMinter::unbounded(2).unwrap();
        let ids = m.mint_many(T0, 5000).unwrap();
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
        let next = m.mint(T0 + 1).unwrap();
        assert!(next > ids[4999]);
    }
}
