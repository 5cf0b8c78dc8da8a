//! Snowflake entity ids whose node part comes from a lease (DESIGN §5): two processes never mint
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
//! The minter never stamps an id at or past its lease's expiry. A successor can only be granted
//! the node once that instant has passed, so it mints from later milliseconds than any id of the
//! old holder, even one that borrowed milliseconds ahead of its clock.

use super::{Lease, TopologyError};

/// Unix time of the id epoch, in milliseconds.
pub const ID_EPOCH_UNIX_MS: u64 = 1_704_067_200_000;
pub const MAX_NODE_ID: u32 = (1 << NODE_BITS) - 1;

const NODE_BITS: u32 = 10;
const SEQ_BITS: u32 = 12;
const TIME_BITS: u32 = 41;
/// Largest sequence number within one millisecond.
pub const MAX_SEQ: u64 = (1 << SEQ_BITS) - 1;
/// Largest millisecond (since [`ID_EPOCH_UNIX_MS`]) an id can carry.
pub const MAX_TIME: u64 = (1 << TIME_BITS) - 1;

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
        // Starting at millisecond 1 keeps every id nonzero, even for node 0 at the epoch itself.
        Ok(Self {
            node: lease.node,
            expires_unix_ms: lease.expires_unix_ms,
            last_ms: 1,
            last_seq: MAX_SEQ,
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
        self.expires_unix_ms = lease.expires_unix_ms;
        Ok(())
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

    const T: u64 = ID_EPOCH_UNIX_MS + 1_000_000;

    fn lease(node: u32, expires_unix_ms: u64) -> Lease {
        Lease {
            node,
            holder: "h".into(),
            epoch: 1,
            expires_unix_ms,
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
}
