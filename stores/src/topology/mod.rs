//! The topology store (docs/partition.md#the-topology-store-and-leases): the committed partition with its epoch, one lease per
//! node, and the node records. MongoDB in a cluster ([`mongo::MongoTopology`]), memory for
//! `cellmesh up` and tests ([`memory::MemoryTopology`]); both behave alike.
//!
//! - **Partition**: one current document. A new epoch is written by compare-and-set on the epoch
//!   it replaces, so two planners racing from the same epoch cannot both win.
//! - **Leases**: a node may own its area, mint entity ids and write only while it holds the lease
//!   of its node id. Every grant bumps the lease's epoch, which is the fencing token: once a
//!   lapsed lease is taken over, the old holder's renewals and fenced writes fail. Lapse is
//!   judged by the store's own clock, never a caller's: a contender whose clock runs ahead
//!   cannot take a live lease. A holder cannot read the store's clock, so it stops writing at a
//!   deadline of its own monotonic clock (`ttl` after it *sent* the request that was granted),
//!   which passes no later than the store's expiry whatever the two wall clocks say.
//!   A holder names one process: callers add a random nonce, so two processes (two containers
//!   with pid 1) never share a name. A process that can prove its predecessor is dead (a sidecar
//!   restarted in place: the predecessor's lock on the state dir is gone) takes the lease over at
//!   once instead of waiting it out, naming the exact grant it replaces.
//! - **Node records**: where a node's mesh and admin endpoints are, published under its lease.

pub mod ids;
pub mod memory;
#[cfg(feature = "mongodb")]
pub mod mongo;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::{redact_url, StoreError};
use cellmesh_world::partition::{NodeId, Partition};

pub use ids::{LeasedIds, MAX_NODE_ID};

/// Longest lease accepted: a lapsed holder's area stays frozen for at most this long.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(3600);
/// How far a holder's monotonic clock may run slow against the store's, in parts per million:
/// a holder writes for its lease's length less this share, so that even such a clock stops it
/// before the store's expiry. (Quartz drifts by tens of ppm; 1% covers a badly slewed one.)
pub const MAX_CLOCK_DRIFT_PPM: u64 = 10_000;

/// How long after *sending* a request the store granted its holder may write, for a lease of
/// `ttl_ms`: the ttl less [`MAX_CLOCK_DRIFT_PPM`] of it.
pub fn writable_ms(ttl_ms: u64) -> u64 {
    ttl_ms - ttl_ms * MAX_CLOCK_DRIFT_PPM / 1_000_000
}

/// How often a holder renews a lease of `ttl_ms`: every half second, and at least four times a
/// lease, so that a store stalled for most of a lease costs nobody theirs.
pub fn renew_every_ms(ttl_ms: u64) -> u64 {
    (ttl_ms / 4).clamp(1, 500)
}

/// Longest holder name accepted.
pub const MAX_HOLDER_LEN: usize = 128;

#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("unsupported topology store url `{0}` (expected `memory` or `mongodb://…`)")]
    BadUrl(String),
    #[error("node id {0} does not fit the 10-bit node part of entity ids (0..={MAX_NODE_ID})")]
    NodeId(u32),
    #[error("lease holder must be 1..={MAX_HOLDER_LEN} printable characters, got {0:?}")]
    Holder(String),
    #[error("lease ttl must be between 1 ms and {MAX_LEASE_TTL:?}, got {0:?}")]
    Ttl(Duration),
    #[error("time {0} ms since 1970 is out of range")]
    Time(u64),
    #[error("partition epoch {next} cannot replace epoch {expected}: a commit advances the epoch by exactly one")]
    EpochGap { expected: u64, next: u64 },
    #[error("no partition is committed: a director balances a committed layout (commit one with `cellmesh partition plan --commit`)")]
    NoPartition,
    #[error("the record of node {record} cannot be published under the lease of node {lease}")]
    RecordMismatch { record: NodeId, lease: NodeId },
    #[error(
        "the lease of node {node} lapsed at {expires_unix_ms} ms: no more ids until it is renewed"
    )]
    LeaseLapsed { node: NodeId, expires_unix_ms: u64 },
}

/// A node's lease: `holder` (one process) owns node id `node` until `expires_unix_ms` of the
/// store's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub node: NodeId,
    pub holder: String,
    /// The fencing token: bumped on every grant, never reused for this node.
    pub epoch: u64,
    /// By the store's clock; 0 once released.
    pub expires_unix_ms: u64,
    /// The latest expiry any earlier grant of this node had (store clock): no earlier holder
    /// minted an id at or past it, so this grant's ids start there.
    #[serde(default)]
    pub ids_floor_unix_ms: u64,
}

/// The answer to a lease request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquire {
    /// The caller holds the lease now, under a new epoch.
    Granted(Lease),
    /// Someone else holds a live lease (as last read; it may lapse at any moment).
    Held(Lease),
}

/// Where a node can be reached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node: NodeId,
    pub geo: String,
    pub mesh_addr: String,
    pub admin_addr: String,
}

impl NodeRecord {
    /// A record may only be published under the lease of its own node.
    pub fn check_lease(&self, lease: &Lease) -> Result<(), TopologyError> {
        if self.node != lease.node {
            return Err(TopologyError::RecordMismatch {
                record: self.node,
                lease: lease.node,
            });
        }
        Ok(())
    }
}

/// One player attached to a gateway, as the gateway sees it: what the geo-aware director's
/// bubble placement needs of a player. Published by every gateway under its lease, every few
/// seconds, replacing its previous list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlayerSample {
    pub account: String,
    /// The session: a new login starts a new RTT baseline.
    pub session_id: u64,
    /// Where the avatar is (m, on the world's torus).
    pub pos: cellmesh_world::geometry::Pos,
    /// Speed over ground (m/s), between the last two positions the gateway saw.
    pub speed_mps: f64,
    /// Server-measured round trips (ms, median) by geo: the player's own proxy, and what other
    /// geos' proxies measured to the player. A geo nobody measured is absent.
    pub rtt_ms: std::collections::BTreeMap<String, f32>,
}

/// Most players one gateway publishes at once: the rest are left out of the placement, so one
/// node cannot make the store's document unbounded.
pub const MAX_PLAYER_SAMPLES: usize = 4_096;

/// A node as stored: its latest lease (live or not) and the record its holder published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeEntry {
    pub lease: Lease,
    /// Whether the lease was live by the store's clock when it was read.
    pub live: bool,
    /// Cleared whenever the lease changes hands: a record always belongs to the current holder.
    pub record: Option<NodeRecord>,
}

/// The answer to a compare-and-set commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Commit {
    Committed,
    /// Someone committed in between: the stored epoch is not the one the caller started from.
    Stale {
        current_epoch: u64,
    },
    /// A director's commit whose lease is no longer the live, current one; `director` is the
    /// lease the store holds now (another director's, or this one lapsed or released).
    Fenced {
        director: Option<DirectorLease>,
    },
}

/// The director's lease (one active director per world), kept with the partition: a director
/// commits only under its live lease, and a deposed one's commit is refused by the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectorLease {
    pub holder: String,
    /// The fencing token: bumped on every grant.
    pub epoch: u64,
    /// By the store's clock; 0 once released.
    pub expires_unix_ms: u64,
}

/// The answer to a director's lease request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirectorAcquire {
    Granted(DirectorLease),
    /// Another director's live lease (as last read).
    Held(DirectorLease),
}

#[async_trait]
pub trait TopologyStore: Send + Sync {
    /// The committed partition, if any.
    async fn partition(&self) -> Result<Option<Partition>, TopologyError>;

    /// Stores `next` if the stored epoch is still `expected_epoch` (0: nothing committed yet);
    /// `next.epoch()` must be `expected_epoch + 1`.
    async fn commit_partition(
        &self,
        expected_epoch: u64,
        next: &Partition,
    ) -> Result<Commit, TopologyError>;

    /// Grants `holder` the lease of `node` for `ttl` if it is free, lapsed, or already
    /// `holder`'s; every grant gets a new epoch. Lapse is judged by the store's clock.
    async fn acquire_lease(
        &self,
        node: NodeId,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError>;

    /// Grants `holder` the lease of `previous.node` under a new epoch if `previous` is still its
    /// current grant (same holder and epoch), live or lapsed: the caller has proved that
    /// `previous`'s holder is dead, so its lease need not be waited out. Otherwise it is
    /// [`acquire_lease`](Self::acquire_lease). As with every grant, the new one's ids start at
    /// or past the replaced grant's expiry, and the node record (the old holder's) is cleared.
    async fn take_over_lease(
        &self,
        previous: &Lease,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError>;

    /// Extends `lease` to the store's now + `ttl` if it is still live and still the current
    /// grant (same holder and epoch); `None` once lapsed or taken over: the holder must stop
    /// writing.
    async fn renew_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError>;

    /// [`renew_lease`](Self::renew_lease), lapsed or not: extends `lease` to the store's now +
    /// `ttl` under the same epoch if it is still the current grant and was not released. A
    /// holder that stopped writing at its deadline (the store did not answer in time: a
    /// MongoDB election, a pause) takes its lease back with it once the store answers: nobody
    /// else was granted the id meanwhile, or the epoch would have moved. `None` once another
    /// grant exists (a new process, or a restore's fence: see `fence_lease`): the holder must
    /// never write again.
    async fn reclaim_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError>;

    /// Gives the lease up at once, if it is still the current grant; false otherwise.
    async fn release_lease(&self, lease: &Lease) -> Result<bool, TopologyError>;

    /// Publishes `record` under `lease`, if the lease is live and current; false otherwise.
    async fn publish_node(&self, lease: &Lease, record: &NodeRecord)
        -> Result<bool, TopologyError>;

    /// Every node that ever held a lease, by id, with its liveness by the store's clock.
    async fn nodes(&self) -> Result<Vec<NodeEntry>, TopologyError>;

    /// Publishes the node's load report (for the director) under `lease`, if the lease is live
    /// and current; false otherwise. A new grant clears it.
    async fn publish_load(
        &self,
        lease: &Lease,
        report: &cellmesh_world::balance::CellReport,
    ) -> Result<bool, TopologyError>;

    /// The latest load report of every node whose lease is live.
    async fn loads(
        &self,
    ) -> Result<
        std::collections::BTreeMap<NodeId, cellmesh_world::balance::CellReport>,
        TopologyError,
    >;

    /// Publishes the players attached to the node's gateway (for the geo-aware director) under
    /// `lease`, replacing the previous list, if the lease is live and current; false otherwise.
    /// A new grant clears it. At most [`MAX_PLAYER_SAMPLES`] are kept.
    async fn publish_players(
        &self,
        lease: &Lease,
        players: &[PlayerSample],
    ) -> Result<bool, TopologyError>;

    /// The latest players of every node whose lease is live, by node.
    async fn players(
        &self,
    ) -> Result<std::collections::BTreeMap<NodeId, Vec<PlayerSample>>, TopologyError>;

    /// Grants `holder` the director's lease for `ttl` if it is free, lapsed or already
    /// `holder`'s, under a new epoch. A director balances a committed layout: with no partition
    /// committed this is [`TopologyError::NoPartition`].
    async fn acquire_director(
        &self,
        holder: &str,
        ttl: Duration,
    ) -> Result<DirectorAcquire, TopologyError>;

    /// Extends the director's lease to the store's now + `ttl` if it is still live and current;
    /// `None` once lapsed or taken: the director must stop committing.
    async fn renew_director(
        &self,
        lease: &DirectorLease,
        ttl: Duration,
    ) -> Result<Option<DirectorLease>, TopologyError>;

    /// Gives the director's lease up at once, if it is still live and current; false otherwise.
    async fn release_director(&self, lease: &DirectorLease) -> Result<bool, TopologyError>;

    /// [`commit_partition`](Self::commit_partition) under the director's lease, checked in the
    /// same atomic step: [`Commit::Fenced`] unless `director` is the live, current lease.
    async fn commit_partition_as(
        &self,
        director: &DirectorLease,
        expected_epoch: u64,
        next: &Partition,
    ) -> Result<Commit, TopologyError>;

    /// Marks the world of the dead process `(node, lease_epoch)` restored, for good (the
    /// topology is the one store every geo shares). A decider that later finds that process's
    /// checkpoints (its geo's own store, once the core restored it from the copy) drops them
    /// instead of restoring what may have been killed or spent since.
    async fn mark_restored(&self, node: NodeId, lease_epoch: u64) -> Result<(), TopologyError>;

    /// Which of `processes` are marked restored.
    async fn restored_among(
        &self,
        processes: &[(NodeId, u64)],
    ) -> Result<Vec<(NodeId, u64)>, TopologyError>;

    /// Closes connections and waits for background work; the store is unusable afterwards. A
    /// short-lived process calls it before its runtime goes away.
    async fn close(&self) {}
}

/// The holder name a restore's fence takes a lapsed lease of `node` under (see [`fence_lease`]).
pub fn fence_holder(node: NodeId) -> String {
    format!("restore-fence-{node}")
}

/// What [`fence_lease`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// The lapsed grant `epoch` is replaced: its holder can never take it back.
    Fenced,
    /// The grant `epoch` is live again: its holder took it back.
    Live,
    /// Another grant replaced `epoch` already (a new process, or another fence).
    Moved,
}

/// Fences grant `epoch` of `node`, lapsed, before its world is restored elsewhere: a new grant
/// under a holder no process has, lapsed at once, so that the old holder's
/// [`TopologyStore::reclaim_lease`] fails and only a new process can have the id afterwards.
/// A grant live again (its holder took it back) is left alone.
pub async fn fence_lease(
    topology: &dyn TopologyStore,
    node: NodeId,
    epoch: u64,
) -> Result<Fence, TopologyError> {
    let entries = topology.nodes().await?;
    match entries.iter().find(|e| e.lease.node == node) {
        None => return Ok(Fence::Moved),
        Some(e) if e.lease.epoch != epoch => return Ok(Fence::Moved),
        Some(e) if e.live => return Ok(Fence::Live),
        Some(_) => {}
    }
    // Granted only if lapsed; the shortest lease the store takes, so the fence is lapsed at once.
    match topology
        .acquire_lease(node, &fence_holder(node), Duration::from_millis(1))
        .await?
    {
        Acquire::Granted(l) if l.epoch == epoch + 1 => Ok(Fence::Fenced),
        Acquire::Granted(_) => Ok(Fence::Moved),
        Acquire::Held(l) if l.epoch == epoch => Ok(Fence::Live),
        Acquire::Held(_) => Ok(Fence::Moved),
    }
}

/// Opens the topology store named by `url`: `memory` (or empty) for one in this process,
/// `mongodb://host:port[/database]` for the cluster's.
pub async fn open(url: &str) -> Result<Arc<dyn TopologyStore>, TopologyError> {
    match url {
        "memory" | "" => Ok(Arc::new(memory::MemoryTopology::default())),
        #[cfg(feature = "mongodb")]
        u if crate::is_mongodb_url(u) => Ok(Arc::new(mongo::MongoTopology::connect(u).await?)),
        #[cfg(not(feature = "mongodb"))]
        u if crate::is_mongodb_url(u) => Err(crate::not_built_in(u, "MongoDB", "mongodb").into()),
        other => Err(TopologyError::BadUrl(redact_url(other))),
    }
}

/// Checks what a lease request carries before it reaches a store; the ttl in milliseconds.
fn check_request(node: NodeId, holder: &str, ttl: Duration) -> Result<u64, TopologyError> {
    if node > MAX_NODE_ID {
        return Err(TopologyError::NodeId(node));
    }
    check_holder(holder, ttl)
}

fn check_holder(holder: &str, ttl: Duration) -> Result<u64, TopologyError> {
    if holder.is_empty() || holder.len() > MAX_HOLDER_LEN || holder.chars().any(char::is_control) {
        return Err(TopologyError::Holder(holder.to_string()));
    }
    if ttl.is_zero() || ttl > MAX_LEASE_TTL {
        return Err(TopologyError::Ttl(ttl));
    }
    Ok(ttl.as_millis() as u64)
}

/// A holder name unique to this process: `{prefix}-{pid}-{random}`. The pid alone repeats (every
/// container's first process is pid 1), and a store grants a live lease again to the same name.
pub fn process_holder(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    )
}

fn check_commit(expected_epoch: u64, next: &Partition) -> Result<(), TopologyError> {
    if expected_epoch.checked_add(1) != Some(next.epoch()) || next.epoch() > i64::MAX as u64 {
        return Err(TopologyError::EpochGap {
            expected: expected_epoch,
            next: next.epoch(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_published_only_under_its_own_nodes_lease() {
        let lease = Lease {
            node: 2,
            holder: "h".into(),
            epoch: 1,
            expires_unix_ms: 10,
            ids_floor_unix_ms: 0,
        };
        let mut record = NodeRecord {
            node: 2,
            geo: "eu".into(),
            mesh_addr: "127.0.0.1:1".into(),
            admin_addr: "127.0.0.1:2".into(),
        };
        assert!(record.check_lease(&lease).is_ok());
        record.node = 3;
        assert!(matches!(
            record.check_lease(&lease),
            Err(TopologyError::RecordMismatch {
                record: 3,
                lease: 2
            })
        ));
    }
}
