//! Membership: how this node joins the cluster and keeps its place in it.
//!
//! - [`join`] reads the committed partition from the topology store, takes the lease of this
//!   node's id (the fence on its area) and publishes where its mesh listener is.
//! - [`membership`] renews that lease every half second and tells the node which peers hold a
//!   live lease and where they listen, their lease epochs, and any newer partition.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cellmesh_geo_router::partition::Partition;
use cellmesh_geo_router::topology::{Acquire, Lease, NodeRecord, TopologyStore};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{unix_ms, Event};
use crate::config::SidecarConfig;
use crate::core::{Input, PeerInfo};

const MEMBERSHIP_EVERY: Duration = Duration::from_millis(500);
/// Tries at the node lease before giving up on a store slower than the lease.
const LEASE_ATTEMPTS: usize = 5;

/// Reads the partition and takes this node's lease.
pub(crate) async fn join(
    topology: &dyn TopologyStore,
    cfg: &SidecarConfig,
) -> anyhow::Result<(Partition, Lease)> {
    let partition = topology
        .partition()
        .await
        .context("reading the partition")?
        .context(
            "no partition is committed in the topology store: commit one before starting nodes",
        )?;
    anyhow::ensure!(
        *partition.shape() == cfg.world,
        "the committed partition is for world {:?}, this node is configured for {:?}",
        partition.shape(),
        cfg.world
    );
    let holder = format!("sidecar-{}-{}", cfg.node_id, std::process::id());
    let ttl = Duration::from_millis(cfg.node_lease_ms);
    // A grant that lapsed before it came back (the store answered slower than the lease) is
    // taken again with a fresh clock; the node never starts on a dead lease.
    for _ in 0..LEASE_ATTEMPTS {
        match topology
            .acquire_lease(cfg.node_id, &holder, unix_ms(), ttl)
            .await
            .context("taking the node lease")?
        {
            Acquire::Granted(lease) if lease.is_live(unix_ms()) => return Ok((partition, lease)),
            Acquire::Granted(lease) => tracing::warn!(
                node = cfg.node_id,
                expires_unix_ms = lease.expires_unix_ms,
                "the node lease lapsed before the store answered; taking it again"
            ),
            Acquire::Held(other) => anyhow::bail!(
                "node id {} is leased by {:?} until {} ms: another sidecar runs as this node",
                cfg.node_id,
                other.holder,
                other.expires_unix_ms
            ),
        }
    }
    anyhow::bail!(
        "the topology store answers slower than node_lease_ms ({} ms): every grant lapsed before it arrived",
        cfg.node_lease_ms
    )
}

#[derive(Debug, PartialEq, Eq)]
enum Reported {
    Yes,
    /// The node's inbox stayed full: skipped this round.
    Busy,
    /// The node is gone.
    Gone,
}

/// Hands the node what membership read, waiting at most one round: an overloaded node must not
/// hold up the renewal of its own lease (a lease that lapses freezes everything it owns). What is
/// skipped is read again, fresher, next round.
async fn report(node: &mpsc::Sender<Event>, input: Input) -> Reported {
    match tokio::time::timeout(MEMBERSHIP_EVERY, node.send(Event::Core(input))).await {
        Ok(Ok(())) => Reported::Yes,
        Ok(Err(_)) => Reported::Gone,
        Err(_) => Reported::Busy,
    }
}

/// Keeps the lease, publishes the record, and reports the live peers until `shutdown`; then
/// gives the lease up.
pub(crate) async fn membership(
    topology: Arc<dyn TopologyStore>,
    mut lease: Lease,
    record: NodeRecord,
    ttl: Duration,
    partition_epoch: u64,
    node: mpsc::Sender<Event>,
    shutdown: CancellationToken,
) {
    let me = lease.node;
    let mut partition_epoch = partition_epoch;
    let mut every = tokio::time::interval(MEMBERSHIP_EVERY);
    let mut published = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = every.tick() => {}
        }
        let now = unix_ms();
        match topology.renew_lease(&lease, now, ttl).await {
            Ok(Some(l)) => lease = l,
            Ok(None) => {
                // Another holder has the id now: this node must stop writing (handoff's fence).
                tracing::error!(node = me, "the node lease was lost");
                let _ = node.send(Event::Core(Input::LeaseLost)).await;
                break;
            }
            Err(e) => tracing::warn!(node = me, error = %e, "renewing the node lease failed"),
        }
        if !published {
            match topology.publish_node(&lease, &record, now).await {
                Ok(true) => published = true,
                Ok(false) => tracing::warn!(node = me, "publishing the node record was refused"),
                Err(e) => {
                    tracing::warn!(node = me, error = %e, "publishing the node record failed")
                }
            }
        }
        match topology.partition().await {
            Ok(Some(p)) if p.epoch() > partition_epoch => {
                let epoch = p.epoch();
                match report(&node, Input::Partition(Box::new(p))).await {
                    Reported::Yes => partition_epoch = epoch,
                    // Read again next round.
                    Reported::Busy => {}
                    Reported::Gone => break,
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(node = me, error = %e, "reading the partition failed"),
        }
        match topology.nodes().await {
            Ok(entries) => {
                let leases = entries
                    .iter()
                    .filter(|e| e.lease.node != me && e.lease.is_live(now))
                    .map(|e| (e.lease.node, e.lease.epoch))
                    .collect();
                if report(&node, Input::PeerLeases(leases)).await == Reported::Gone {
                    break;
                }
                let peers = entries
                    .into_iter()
                    .filter(|e| e.lease.node != me && e.lease.is_live(now))
                    .filter_map(|e| {
                        e.record.map(|r| PeerInfo {
                            node: r.node,
                            mesh_addr: r.mesh_addr,
                        })
                    })
                    .collect();
                if report(&node, Input::Peers(peers)).await == Reported::Gone {
                    break;
                }
            }
            Err(e) => tracing::warn!(node = me, error = %e, "listing the nodes failed"),
        }
    }
    let _ = topology.release_lease(&lease).await;
}
