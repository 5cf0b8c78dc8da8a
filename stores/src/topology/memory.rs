//! The topology in this process's memory: the embedded default, with the same rules as MongoDB.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::{
    check_commit, check_holder, check_request, Acquire, Commit, DirectorAcquire, DirectorLease,
    Lease, NodeEntry, NodeRecord, PlayerSample, TopologyError, TopologyStore, MAX_PLAYER_SAMPLES,
};
use cellmesh_world::balance::CellReport;
use cellmesh_world::partition::{NodeId, Partition};

/// The store's clock: unix milliseconds.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

pub struct MemoryTopology {
    inner: Mutex<State>,
    clock: Clock,
}

impl Default for MemoryTopology {
    fn default() -> Self {
        Self::with_clock(Arc::new(system_unix_ms))
    }
}

/// This process's wall clock, unix milliseconds.
fn system_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Default)]
struct State {
    partition: Option<Partition>,
    director: Option<DirectorLease>,
    nodes: BTreeMap<NodeId, Stored>,
    /// Dead processes whose world was restored.
    restored: std::collections::BTreeSet<(NodeId, u64)>,
}

struct Stored {
    entry: NodeEntry,
    load: Option<CellReport>,
    players: Option<Vec<PlayerSample>>,
    /// The latest expiry any grant of this node had: where the next holder's ids start.
    ids_below_unix_ms: u64,
}

impl State {
    /// The director's lease if `lease` is it, current and live at `now`.
    fn director_live(&mut self, lease: &DirectorLease, now: u64) -> Option<&mut DirectorLease> {
        self.director.as_mut().filter(|d| {
            d.holder == lease.holder && d.epoch == lease.epoch && now < d.expires_unix_ms
        })
    }

    /// The entry of `lease.node` if `lease` is still its current grant.
    fn current(&mut self, lease: &Lease) -> Option<&mut Stored> {
        self.nodes
            .get_mut(&lease.node)
            .filter(|s| s.entry.lease.holder == lease.holder && s.entry.lease.epoch == lease.epoch)
    }

    /// Grants `holder` the lease of `node` unless another holder's is live.
    fn acquire(&mut self, node: NodeId, holder: &str, now: u64, ttl_ms: u64) -> Acquire {
        match self.nodes.get(&node) {
            Some(s) if now < s.entry.lease.expires_unix_ms && s.entry.lease.holder != holder => {
                Acquire::Held(s.entry.lease.clone())
            }
            _ => Acquire::Granted(self.grant(node, holder, now, ttl_ms)),
        }
    }

    /// Replaces whatever grant `node` has with a new one for `holder`, under the next epoch,
    /// with no record, load or players; its ids start past every earlier grant's expiry.
    fn grant(&mut self, node: NodeId, holder: &str, now: u64, ttl_ms: u64) -> Lease {
        let previous = self.nodes.get(&node);
        let floor = previous.map_or(0, |s| s.ids_below_unix_ms);
        let lease = Lease {
            node,
            holder: holder.to_string(),
            epoch: previous.map_or(0, |s| s.entry.lease.epoch) + 1,
            expires_unix_ms: now + ttl_ms,
            ids_floor_unix_ms: floor,
        };
        self.nodes.insert(
            node,
            Stored {
                entry: NodeEntry {
                    lease: lease.clone(),
                    live: true,
                    record: None,
                },
                load: None,
                players: None,
                ids_below_unix_ms: floor.max(lease.expires_unix_ms),
            },
        );
        lease
    }
}

impl MemoryTopology {
    /// Extends `lease` to now + `ttl` if it is still the current grant and its expiry passes
    /// `condition`; the lease as extended, or `None`.
    fn extend_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
        condition: impl Fn(u64) -> bool,
    ) -> Result<Option<Lease>, TopologyError> {
        let ttl_ms = check_request(lease.node, &lease.holder, ttl)?;
        let now = (self.clock)();
        let mut state = self.state();
        Ok(state
            .current(lease)
            .filter(|s| condition(s.entry.lease.expires_unix_ms))
            .map(|s| {
                s.entry.lease.expires_unix_ms = now + ttl_ms;
                s.ids_below_unix_ms = s.ids_below_unix_ms.max(now + ttl_ms);
                s.entry.lease.clone()
            }))
    }

    /// A store that reads time from `clock` (virtual time in tests).
    pub fn with_clock(clock: Clock) -> Self {
        Self {
            inner: Mutex::new(State::default()),
            clock,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.lock().expect("topology lock poisoned")
    }
}

impl MemoryTopology {
    /// Sets something of `lease`'s node with `set`, if the lease is its current live one.
    fn publish(&self, lease: &Lease, set: impl FnOnce(&mut Stored)) -> bool {
        let now = (self.clock)();
        let mut state = self.state();
        state
            .current(lease)
            .filter(|s| now < s.entry.lease.expires_unix_ms)
            .map(set)
            .is_some()
    }

    /// What `get` finds of every node whose lease is live.
    fn of_live<T>(&self, get: impl Fn(&Stored) -> Option<T>) -> BTreeMap<NodeId, T> {
        let now = (self.clock)();
        self.state()
            .nodes
            .iter()
            .filter(|(_, s)| now < s.entry.lease.expires_unix_ms)
            .filter_map(|(n, s)| Some((*n, get(s)?)))
            .collect()
    }
}

#[async_trait]
impl TopologyStore for MemoryTopology {
    async fn partition(&self) -> Result<Option<Partition>, TopologyError> {
        Ok(self.state().partition.clone())
    }

    async fn commit_partition(
        &self,
        expected_epoch: u64,
        next: &Partition,
    ) -> Result<Commit, TopologyError> {
        check_commit(expected_epoch, next)?;
        let mut state = self.state();
        let current_epoch = state.partition.as_ref().map_or(0, Partition::epoch);
        if current_epoch != expected_epoch {
            return Ok(Commit::Stale { current_epoch });
        }
        state.partition = Some(next.clone());
        Ok(Commit::Committed)
    }

    async fn acquire_director(
        &self,
        holder: &str,
        ttl: Duration,
    ) -> Result<DirectorAcquire, TopologyError> {
        let ttl_ms = check_holder(holder, ttl)?;
        let now = (self.clock)();
        let mut state = self.state();
        if state.partition.is_none() {
            return Err(TopologyError::NoPartition);
        }
        if let Some(d) = state
            .director
            .as_ref()
            .filter(|d| now < d.expires_unix_ms && d.holder != holder)
        {
            return Ok(DirectorAcquire::Held(d.clone()));
        }
        let lease = DirectorLease {
            holder: holder.to_string(),
            epoch: state.director.as_ref().map_or(0, |d| d.epoch) + 1,
            expires_unix_ms: now + ttl_ms,
        };
        state.director = Some(lease.clone());
        Ok(DirectorAcquire::Granted(lease))
    }

    async fn renew_director(
        &self,
        lease: &DirectorLease,
        ttl: Duration,
    ) -> Result<Option<DirectorLease>, TopologyError> {
        let ttl_ms = check_holder(&lease.holder, ttl)?;
        let now = (self.clock)();
        Ok(self.state().director_live(lease, now).map(|d| {
            d.expires_unix_ms = now + ttl_ms;
            d.clone()
        }))
    }

    async fn release_director(&self, lease: &DirectorLease) -> Result<bool, TopologyError> {
        let now = (self.clock)();
        let mut state = self.state();
        Ok(state
            .director_live(lease, now)
            .map(|d| d.expires_unix_ms = 0)
            .is_some())
    }

    async fn commit_partition_as(
        &self,
        director: &DirectorLease,
        expected_epoch: u64,
        next: &Partition,
    ) -> Result<Commit, TopologyError> {
        check_commit(expected_epoch, next)?;
        let now = (self.clock)();
        let mut state = self.state();
        let current_epoch = state.partition.as_ref().map_or(0, Partition::epoch);
        if current_epoch != expected_epoch {
            return Ok(Commit::Stale { current_epoch });
        }
        if state.director_live(director, now).is_none() {
            let director = state.director.clone();
            return Ok(Commit::Fenced { director });
        }
        state.partition = Some(next.clone());
        Ok(Commit::Committed)
    }

    async fn acquire_lease(
        &self,
        node: NodeId,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError> {
        let ttl_ms = check_request(node, holder, ttl)?;
        let now = (self.clock)();
        Ok(self.state().acquire(node, holder, now, ttl_ms))
    }

    async fn take_over_lease(
        &self,
        previous: &Lease,
        holder: &str,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError> {
        let ttl_ms = check_request(previous.node, holder, ttl)?;
        let now = (self.clock)();
        let mut state = self.state();
        if state.current(previous).is_some() {
            return Ok(Acquire::Granted(state.grant(
                previous.node,
                holder,
                now,
                ttl_ms,
            )));
        }
        Ok(state.acquire(previous.node, holder, now, ttl_ms))
    }

    async fn renew_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError> {
        let now = (self.clock)();
        self.extend_lease(lease, ttl, |expires| now < expires)
    }

    async fn reclaim_lease(
        &self,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError> {
        // Lapsed or live, but not given up.
        self.extend_lease(lease, ttl, |expires| expires > 0)
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, TopologyError> {
        let mut state = self.state();
        Ok(state
            .current(lease)
            .map(|s| s.entry.lease.expires_unix_ms = 0)
            .is_some())
    }

    async fn publish_node(
        &self,
        lease: &Lease,
        record: &NodeRecord,
    ) -> Result<bool, TopologyError> {
        record.check_lease(lease)?;
        Ok(self.publish(lease, |s| s.entry.record = Some(record.clone())))
    }

    async fn publish_load(
        &self,
        lease: &Lease,
        report: &CellReport,
    ) -> Result<bool, TopologyError> {
        Ok(self.publish(lease, |s| s.load = Some(report.clone())))
    }

    async fn loads(&self) -> Result<BTreeMap<NodeId, CellReport>, TopologyError> {
        Ok(self.of_live(|s| s.load.clone()))
    }

    async fn publish_players(
        &self,
        lease: &Lease,
        players: &[PlayerSample],
    ) -> Result<bool, TopologyError> {
        let kept = &players[..players.len().min(MAX_PLAYER_SAMPLES)];
        Ok(self.publish(lease, |s| s.players = Some(kept.to_vec())))
    }

    async fn players(&self) -> Result<BTreeMap<NodeId, Vec<PlayerSample>>, TopologyError> {
        Ok(self.of_live(|s| s.players.clone()))
    }

    async fn mark_restored(&self, node: NodeId, lease_epoch: u64) -> Result<(), TopologyError> {
        self.state().restored.insert((node, lease_epoch));
        Ok(())
    }

    async fn restored_among(
        &self,
        processes: &[(NodeId, u64)],
    ) -> Result<Vec<(NodeId, u64)>, TopologyError> {
        let state = self.state();
        Ok(processes
            .iter()
            .copied()
            .filter(|p| state.restored.contains(p))
            .collect())
    }

    async fn nodes(&self) -> Result<Vec<NodeEntry>, TopologyError> {
        let now = (self.clock)();
        Ok(self
            .state()
            .nodes
            .values()
            .map(|s| NodeEntry {
                live: now < s.entry.lease.expires_unix_ms,
                ..s.entry.clone()
            })
            .collect())
    }
}
