//! The topology in this process's memory: the embedded default, with the same rules as MongoDB.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use super::{
    check_commit, check_request, Acquire, Commit, Lease, NodeEntry, NodeRecord, TopologyError,
    TopologyStore,
};
use crate::partition::{NodeId, Partition};

#[derive(Default)]
pub struct MemoryTopology {
    inner: Mutex<State>,
}

#[derive(Default)]
struct State {
    partition: Option<Partition>,
    nodes: BTreeMap<NodeId, NodeEntry>,
}

impl State {
    /// The entry of `lease.node` if `lease` is still its current grant.
    fn current(&mut self, lease: &Lease) -> Option<&mut NodeEntry> {
        self.nodes
            .get_mut(&lease.node)
            .filter(|e| e.lease.holder == lease.holder && e.lease.epoch == lease.epoch)
    }
}

impl MemoryTopology {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.lock().expect("topology lock poisoned")
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

    async fn acquire_lease(
        &self,
        node: NodeId,
        holder: &str,
        now_unix_ms: u64,
        ttl: Duration,
    ) -> Result<Acquire, TopologyError> {
        let expires_unix_ms = check_request(node, holder, now_unix_ms, ttl)?;
        let mut state = self.state();
        let previous = state.nodes.get(&node);
        if let Some(e) =
            previous.filter(|e| e.lease.is_live(now_unix_ms) && e.lease.holder != holder)
        {
            return Ok(Acquire::Held(e.lease.clone()));
        }
        let lease = Lease {
            node,
            holder: holder.to_string(),
            epoch: previous.map_or(0, |e| e.lease.epoch) + 1,
            expires_unix_ms,
        };
        state.nodes.insert(
            node,
            NodeEntry {
                lease: lease.clone(),
                record: None,
            },
        );
        Ok(Acquire::Granted(lease))
    }

    async fn renew_lease(
        &self,
        lease: &Lease,
        now_unix_ms: u64,
        ttl: Duration,
    ) -> Result<Option<Lease>, TopologyError> {
        let expires_unix_ms = check_request(lease.node, &lease.holder, now_unix_ms, ttl)?;
        let mut state = self.state();
        Ok(state
            .current(lease)
            .filter(|e| e.lease.is_live(now_unix_ms))
            .map(|e| {
                e.lease.expires_unix_ms = expires_unix_ms;
                e.lease.clone()
            }))
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, TopologyError> {
        let mut state = self.state();
        Ok(state
            .current(lease)
            .map(|e| e.lease.expires_unix_ms = 0)
            .is_some())
    }

    async fn publish_node(
        &self,
        lease: &Lease,
        record: &NodeRecord,
        now_unix_ms: u64,
    ) -> Result<bool, TopologyError> {
        record.check_lease(lease)?;
        let mut state = self.state();
        Ok(state
            .current(lease)
            .filter(|e| e.lease.is_live(now_unix_ms))
            .map(|e| e.record = Some(record.clone()))
            .is_some())
    }

    async fn nodes(&self) -> Result<Vec<NodeEntry>, TopologyError> {
        Ok(self.state().nodes.values().cloned().collect())
    }
}
