//! Membership and peer links: the edges that connect this node to the other sidecars.
//!
//! - [`join`] reads the committed partition from the topology store, takes the lease of this
//!   node's id (the fence on its area) and publishes where its mesh listener is.
//! - [`membership`] renews that lease every half second and tells the node which peers hold a
//!   live lease and where they listen.
//! - [`dial`] keeps one link to a peer with a higher node id (the lower id dials, so each pair has
//!   one link): hello, then the shared link loop of [`crate::mesh::pump`]; redialled with
//!   exponential back-off whenever it ends, until the node cancels it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cellmesh_geo_router::partition::{NodeId, Partition};
use cellmesh_geo_router::topology::{Acquire, Lease, NodeRecord, TopologyStore};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, PeerRole};
use cellmesh_proto::PROTOCOL_MAJOR;
use futures::{SinkExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

use crate::config::SidecarConfig;
use crate::game::HELLO_TIMEOUT;
use crate::mesh::{pump, without_heartbeats, MeshCtx};
use crate::metrics::{MeteredCodec, Peer};
use crate::node::{unix_ms, LinkHandle, NodeEvent};

const MEMBERSHIP_EVERY: Duration = Duration::from_millis(500);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Tries at the node lease before giving up on a store slower than the lease.
const LEASE_ATTEMPTS: usize = 5;
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// A peer sidecar with a live lease: where to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerInfo {
    pub node: NodeId,
    pub mesh_addr: String,
}

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

/// Keeps the lease, publishes the record, and reports the live peers until `shutdown`; then
/// gives the lease up.
pub(crate) async fn membership(
    topology: Arc<dyn TopologyStore>,
    mut lease: Lease,
    record: NodeRecord,
    ttl: Duration,
    partition_epoch: u64,
    node: mpsc::Sender<NodeEvent>,
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
                let _ = node.send(NodeEvent::LeaseLost).await;
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
                partition_epoch = p.epoch();
                if node.send(NodeEvent::Partition(Box::new(p))).await.is_err() {
                    break;
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
                if node.send(NodeEvent::PeerLeases(leases)).await.is_err() {
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
                if node.send(NodeEvent::Peers { peers }).await.is_err() {
                    break;
                }
            }
            Err(e) => tracing::warn!(node = me, error = %e, "listing the nodes failed"),
        }
    }
    let _ = topology.release_lease(&lease).await;
}

/// Keeps a link to `peer` at `addr` until `stop` (or the sidecar's shutdown) is cancelled.
pub(crate) async fn dial(peer: NodeId, addr: String, ctx: MeshCtx, stop: CancellationToken) {
    let mut backoff = BACKOFF_MIN;
    while !stop.is_cancelled() {
        let link = ctx.next_link.fetch_add(1, Ordering::Relaxed);
        match dial_once(peer, &addr, link, &ctx, &stop).await {
            Ok(reason) => {
                tracing::info!(peer, link, %reason, "peer link closed");
                backoff = BACKOFF_MIN;
            }
            Err(e) => tracing::debug!(peer, %addr, error = %e, "dialling the peer failed"),
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// One connection: `Ok(why it ended)` once it was established, `Err` if it never was.
async fn dial_once(
    peer: NodeId,
    addr: &str,
    link: u64,
    ctx: &MeshCtx,
    stop: &CancellationToken,
) -> Result<String, String> {
    let stream = tokio::select! {
        _ = stop.cancelled() => return Err("stopped".into()),
        r = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)) => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => return Err(format!("no connection within {} s", CONNECT_TIMEOUT.as_secs())),
        },
    };
    let _ = stream.set_nodelay(true);
    let (r, w) = stream.into_split();
    let mut reader = FramedRead::new(
        r,
        MeteredCodec::<MeshFrame>::new(ctx.max_frame, &ctx.metrics, Peer::Sidecar),
    );
    let mut writer = FramedWrite::new(
        w,
        MeteredCodec::<MeshFrame>::new(ctx.max_frame, &ctx.metrics, Peer::Sidecar),
    );
    let hello = MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
        version: Some(mesh::ProtocolVersion::current()),
        role: PeerRole::Sidecar as i32,
        id: ctx.node_id.to_string(),
        geo: ctx.geo.clone(),
        partition_epoch: ctx.partition_epoch,
        node_id: ctx.node_id,
    }));
    writer.send(hello).await.map_err(|e| e.to_string())?;
    let reply = tokio::select! {
        _ = stop.cancelled() => return Err("stopped".into()),
        r = tokio::time::timeout(HELLO_TIMEOUT, reader.next()) => match r {
            Ok(Some(Ok(f))) => f,
            Ok(Some(Err(e))) => return Err(e.to_string()),
            Ok(None) => return Err("closed before LinkHello".into()),
            Err(_) => return Err("no LinkHello in time".into()),
        },
    };
    let (their, rest) = check_reply(reply, peer)?;
    let (outbox, queue) = mpsc::channel(ctx.outbox_frames);
    let kill = stop.child_token();
    let handle = LinkHandle {
        outbox,
        kill: kill.clone(),
    };
    ctx.metrics.connected(Peer::Sidecar);
    let up = NodeEvent::LinkUp {
        link,
        hello: their,
        remote: addr.to_string(),
        handle,
        rest: without_heartbeats(rest),
    };
    if ctx.node.send(up).await.is_err() {
        ctx.metrics.disconnected(Peer::Sidecar);
        return Err("sidecar shutting down".into());
    }
    let (_, reason) = pump(&mut reader, &mut writer, link, queue, kill, ctx, "the peer").await;
    let _ = ctx
        .node
        .send(NodeEvent::LinkClosed {
            link,
            reason: reason.clone(),
        })
        .await;
    let _ = tokio::time::timeout(Duration::from_secs(1), writer.get_mut().shutdown()).await;
    ctx.metrics.disconnected(Peer::Sidecar);
    Ok(reason)
}

/// Checks the dialled peer's answer: a sidecar `LinkHello` from the node we meant to reach.
fn check_reply(
    frame: MeshFrame,
    peer: NodeId,
) -> Result<(mesh::LinkHello, Vec<mesh::MeshMessage>), String> {
    let mut messages = frame.messages.into_iter();
    match messages.next().and_then(|m| m.body) {
        Some(mesh_message::Body::Hello(h)) => {
            let major = h.version.map(|v| v.major);
            if major != Some(PROTOCOL_MAJOR) {
                return Err(format!(
                    "peer speaks protocol {major:?}, this sidecar {PROTOCOL_MAJOR}"
                ));
            }
            if h.role != PeerRole::Sidecar as i32 || h.node_id != peer {
                return Err(format!(
                    "expected sidecar node {peer}, reached {:?} node {}",
                    h.id, h.node_id
                ));
            }
            Ok((h, messages.collect()))
        }
        Some(mesh_message::Body::Refused(r)) => Err(format!("refused: {}", r.reason)),
        _ => Err("expected LinkHello".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(node_id: u32, role: PeerRole) -> MeshFrame {
        MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
            version: Some(mesh::ProtocolVersion::current()),
            role: role as i32,
            node_id,
            ..Default::default()
        }))
    }

    #[test]
    fn the_reply_must_come_from_the_node_dialled() {
        assert!(check_reply(hello(3, PeerRole::Sidecar), 3).is_ok());
        assert!(check_reply(hello(4, PeerRole::Sidecar), 3)
            .unwrap_err()
            .contains("expected sidecar node 3"));
        assert!(check_reply(hello(3, PeerRole::Proxy), 3).is_err());
        let refused = MeshFrame::one(mesh_message::Body::Refused(mesh::LinkRefused {
            reason: "no".into(),
        }));
        assert_eq!(check_reply(refused, 3).unwrap_err(), "refused: no");
    }
}
