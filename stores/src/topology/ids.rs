//! Snowflake entity ids whose node part comes from a lease (docs/partition.md#the-topology-store-and-leases): two processes never mint
//! with the same node part at the same time, because only one holds that node's lease.
//!
//! Layout of the 64 bits, most significant first (the sidecar's id layout):
//!
//! | bits | field |
//! |---|---|
//! | 1 | zero (ids stay positive as `i64`) |
//! | 41 | milliseconds since [`ID_EPOCH_UNIX_MS`] (2024-01-01T00:00:00Z) |
//! | 10 | node id (`0..=1023`) |
//! | 12 | sequence within the millisecond |
//!
//! The minter never stamps an id at or past its lease's expiry, and starts at the lease's
//! `ids_floor_unix_ms`: the latest expiry any earlier grant of the node had. So a successor mints
//! from later milliseconds than any id of an old holder, whatever either one's clock says.

use super::{Lease, TopologyError};

/// Unix time of the id epoch, in milliseconds.
pub const ID_EPOCH_UNIX_MS: u64 = 1_704_067_200_000;
pub const MAX_NODE_ID: u32 = (1 << NODE_BITS) - 1;

const NODE_BITS: u32 = 10;
const SEQ_BITS: u32 = 12;
const TIME_BITS: u32 = 41;
/// Largest sequence number within one millisecond.
pub const MAX_SEQ: u64 = (1 << SEQ_BITS) - 1;
/// Largest millisecond (since [`ID_EPOCH_UNIX_MS`]) an id is minted with: the top half of the
/// time range (from late 2058) is the spawners' (`spawners::SPAWNED_ID_BIT`), whose ids are
/// derived, not minted, so the two kinds never meet.
pub const MAX_TIME: u64 = (1 << (TIME_BITS - 1)) - 1;

/// The id of sequence `seq` of millisecond `ms` (since [`ID_EPOCH_UNIX_MS`]) on `node`.
pub fn compose(ms: u64, node: u32, seq: u64) -> u64 {
    (ms << (NODE_BITS + SEQ_BITS)) | (u64::from(node) << SEQ_BITS) | seq
}

/// The (millisecond, sequence) that follows `last` when the clock reads `now` (both in
/// milliseconds since [`ID_EPOCH_UNIX_MS`]): ids of one minter strictly increase, so when the clock
/// steps back or a millisecond's sequence is used up it counts on from its own last millisecond.
pub fn next_stamp(last: (u64, u64), now: u64) -> (u64, u64) {
    let (last_ms, last_seq) = last;
    if now > last_ms {
        (now, 0)
    } else if last_seq < MAX_SEQ {
        (last_ms, last_seq + 1)
    } else {
        (last_ms + 1, 0)
    }
}

/// The sequence part of an id.
pub fn seq_of(id: u64) -> u64 {
    id & MAX_SEQ
}

/// The millisecond part of an id, since [`ID_EPOCH_UNIX_MS`].
pub fn ms_of(id: u64) -> u64 {
    id >> (NODE_BITS + SEQ_BITS)
}

/// Mints ids for the holder of one node's lease; refuses once the lease has lapsed.
#[derive(Debug, Clone)]
pub struct LeasedIds {
    node: u32,
    expires_unix_ms: u64,
    /// Millisecond (since the id epoch) and sequence of the last id minted.
    last_ms: u64,
    last_seq: u64,
}

impl LeasedIds {
    pub fn new(lease: &Lease) -> Result<Self, TopologyError> {
        if lease.node > MAX_NODE_ID {
            return Err(TopologyError::NodeId(lease.node));
        }
        // Counting on from the millisecond before the floor, with its sequence used up, makes
        // the first id the floor's or later; millisecond 1 at least keeps every id nonzero.
        let floor = lease.ids_floor_unix_ms.saturating_sub(ID_EPOCH_UNIX_MS);
        Ok(Self {
            node: lease.node,
            expires_unix_ms: lease.expires_unix_ms,
            last_ms: floor.saturating_sub(1).max(1),
            last_seq: MAX_SEQ,
        })
    }

    /// A minter with no lease to answer to: a lone node that shares its ids with nobody.
    pub fn unbounded(node: u32) -> Result<Self, TopologyError> {
        Self::new(&Lease {
            node,
            holder: String::new(),
            epoch: 0,
            expires_unix_ms: u64::MAX,
            ids_floor_unix_ms: 0,
        })
    }

    /// Follows a renewal (or a new grant) of the same node's lease.
    pub fn renewed(&mut self, lease: &Lease) -> Result<(), TopologyError> {
        if lease.node != self.node {
            return Err(TopologyError::RecordMismatch {
                record: self.node,
                lease: lease.node,
            });
        }
        self.extend(lease.expires_unix_ms);
        Ok(())
    }

    /// The lease now runs until `expires_unix_ms` (never shortened: a late answer to an older
    /// renewal changes nothing).
    pub fn extend(&mut self, expires_unix_ms: u64) {
        self.expires_unix_ms = self.expires_unix_ms.max(expires_unix_ms);
    }

    /// `count` consecutive ids, or none if the lease cannot cover them all.
    pub fn mint_many(&mut self, now_unix_ms: u64, count: usize) -> Result<Vec<u64>, TopologyError> {
        let before = (self.last_ms, self.last_seq);
        let ids: Result<Vec<u64>, TopologyError> =
            (0..count).map(|_| self.mint(now_unix_ms)).collect();
        if ids.is_err() {
            (self.last_ms, self.last_seq) = before;
        }
        ids
    }

    pub fn node(&self) -> u32 {
        self.node
    }

    /// The next id at wall-clock `now_unix_ms`. Ids from one minter strictly increase: when the
    /// clock steps back or a millisecond's 4096 ids are used up, it counts on from its own last
    /// millisecond, but never into the lease's expiry.
    pub fn mint(&mut self, now_unix_ms: u64) -> Result<u64, TopologyError> {
        let lapsed = TopologyError::LeaseLapsed {
            node: self.node,
            expires_unix_ms: self.expires_unix_ms,
        };
        if now_unix_ms >= self.expires_unix_ms {
            return Err(lapsed);
        }
        let now = now_unix_ms.saturating_sub(ID_EPOCH_UNIX_MS).min(MAX_TIME);
        let (ms, seq) = next_stamp((self.last_ms, self.last_seq), now);
        if ms + ID_EPOCH_UNIX_MS >= self.expires_unix_ms || ms > MAX_TIME {
            return Err(lapsed);
        }
        (self.last_ms, self.last_seq) = (ms, seq);
        Ok(compose(ms, self.node, seq))
    }
}

/// The node part of an id.
pub fn node_of(id: u64) -> u32 {
    ((id >> SEQ_BITS) & u64::from(MAX_NODE_ID)) as u32
}

/// Unix milliseconds an id was stamped with.
pub fn unix_ms_of(id: u64) -> u64 {
    ms_of(id) + ID_EPOCH_UNIX_MS
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T: u64 = ID_EPOCH_UNIX_MS + 1_000_000;

    fn lease(node: u32, expires_unix_ms: u64) -> Lease {
        Lease {
            node,
            holder: "h".into(),
            epoch: 1,
            expires_unix_ms,
            ids_floor_unix_ms: 0,
        }
    }

    #[test]
    fn ids_carry_the_lease_node_and_increase() {
        let mut ids = LeasedIds::new(&lease(1023, T + 10)).unwrap();
        let a = ids.mint(T).unwrap();
        let b = ids.mint(T).unwrap();
        let c = ids.mint(T - 500).unwrap(); // clock stepped back
        assert!(a < b && b < c);
        assert_eq!((node_of(a), unix_ms_of(a)), (1023, T));
        assert!(matches!(
            LeasedIds::new(&lease(1024, T)),
            Err(TopologyError::NodeId(1024))
        ));
    }

    #[test]
    fn no_id_is_stamped_at_or_past_the_lease_expiry() {
        let mut ids = LeasedIds::new(&lease(3, T + 2)).unwrap();
        // 4096 ids per millisecond: T and T+1 hold 8192, then borrowing would reach the expiry.
        let minted: Vec<u64> = (0..8192).map(|_| ids.mint(T).unwrap()).collect();
        assert_eq!(unix_ms_of(*minted.last().unwrap()), T + 1);
        assert!(matches!(
            ids.mint(T),
            Err(TopologyError::LeaseLapsed { node: 3, .. })
        ));
        assert!(matches!(
            ids.mint(T + 2),
            Err(TopologyError::LeaseLapsed { .. })
        ));
        // A renewal lets it go on where it stopped.
        ids.renewed(&lease(3, T + 100)).unwrap();
        assert_eq!(unix_ms_of(ids.mint(T).unwrap()), T + 2);
        assert!(ids.renewed(&lease(4, T + 100)).is_err());
    }

    #[test]
    fn no_minted_id_reaches_the_spawners_range() {
        let last = ID_EPOCH_UNIX_MS + MAX_TIME;
        let mut ids = LeasedIds::new(&lease(7, last + 1_000)).unwrap();
        let id = ids.mint(last).unwrap();
        assert!(!cellmesh_world::spawners::is_spawned_id(id), "{id:#x}");
        // Past it (or a clock that reads past it) the minter stops rather than wrap into them.
        let mut ids = LeasedIds::new(&lease(7, last + 10_000)).unwrap();
        for _ in 0..=MAX_SEQ {
            ids.mint(last + 5_000).unwrap();
        }
        assert!(ids.mint(last + 5_000).is_err());
    }

    #[test]
    fn never_zero_even_before_the_epoch() {
        let mut m = LeasedIds::unbounded(0).unwrap();
        assert_ne!(m.mint(0).unwrap(), 0);
        assert_ne!(m.mint(ID_EPOCH_UNIX_MS).unwrap(), 0);
    }

    #[test]
    fn a_batch_the_lease_cannot_cover_mints_nothing() {
        let mut ids = LeasedIds::new(&lease(3, T + 1)).unwrap();
        assert!(ids.mint_many(T, 5000).is_err());
        // Nothing was used up: the whole millisecond is still there.
        assert_eq!(ids.mint_many(T, 4096).unwrap().len(), 4096);
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
            let mut minters = [
                LeasedIds::unbounded(node_a).unwrap(),
                LeasedIds::unbounded(node_b).unwrap(),
            ];
            let mut last = [0u64; 2];
            let mut seen = std::collections::HashSet::new();
            let mut clock = T as i64;
            for (which, jump, count) in steps {
                clock += jump;
                let i = (which % 2) as usize;
                for id in minters[i].mint_many(clock as u64, count).unwrap() {
                    prop_assert!(id > last[i]);
                    last[i] = id;
                    prop_assert_eq!(node_of(id), [node_a, node_b][i]);
                    prop_assert!(seen.insert(id));
                }
            }
        }
    }

    #[test]
    fn a_successor_mints_past_every_id_of_the_holders_before_it() {
        // The old holder's clock ran 5 s ahead: it minted up to just before its expiry...
        let mut old = LeasedIds::new(&lease(7, T + 1_000)).unwrap();
        let last_old = old.mint(T + 999).unwrap();
        // ...and the successor's clock runs 5 s behind: it still starts at that expiry.
        let next = Lease {
            ids_floor_unix_ms: T + 1_000,
            ..lease(7, T + 20_000)
        };
        let mut new = LeasedIds::new(&next).unwrap();
        let first_new = new.mint(T - 4_000).unwrap();
        assert!(first_new > last_old);
        assert_eq!(unix_ms_of(first_new), T + 1_000);
    }
}
