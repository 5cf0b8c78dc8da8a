//! Links to peers: this node keeps one link to each peer with a higher node id (the lower id
//! dials, so each pair has one link): hello, then the shared link loop of [`super::mesh::pump`];
//! redialled with exponential back-off whenever it ends, until the driver cancels it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, PeerRole};
use cellmesh_proto::PROTOCOL_MAJOR;
use cellmesh_world::partition::NodeId;
use futures::{SinkExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

use super::codec::MeteredCodec;
use super::mesh::{pump, shaped, without_heartbeats, MeshCtx};
use super::{Event, LinkHandle, HELLO_TIMEOUT};
use crate::core::Input;
use crate::metrics::Peer;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(2);

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
    let (stream, proven) = match &ctx.tls {
        None => (cellmesh_trust::MeshStream::Plain(stream), None),
        Some(tls) => {
            let name = cellmesh_trust::Role::Sidecar.server_name();
            let handshake = tls.connect(stream, &name);
            match tokio::time::timeout(HELLO_TIMEOUT, handshake).await {
                Ok(Ok((s, id))) => (s, Some(id)),
                Ok(Err(e)) => {
                    ctx.metrics.error("tls_refused");
                    return Err(format!("TLS handshake with {addr} failed: {e}"));
                }
                Err(_) => return Err("no TLS handshake in time".into()),
            }
        }
    };
    let (r, w) = tokio::io::split(stream);
    let mut reader = FramedRead::new(
        r,
        MeteredCodec::<MeshFrame>::new(ctx.max_frame, &ctx.metrics, Peer::Sidecar),
    );
    let mut writer = FramedWrite::new(
        w,
        MeteredCodec::<MeshFrame>::new(ctx.max_frame, &ctx.metrics, Peer::Sidecar),
    );
    let hello = ctx.hello();
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
    let (their, rest) = check_reply(reply, peer, (&ctx.geo, &ctx.world_geos))?;
    if let Some(proven) = &proven {
        if let Err(e) = super::mesh::check_proven(&their, proven) {
            ctx.metrics.error("link_refused");
            tracing::warn!(peer, %addr, reason = %e, "peer link refused: its certificate");
            return Err(e);
        }
    }
    let (outbox, queue) = mpsc::channel(ctx.outbox_frames);
    let queue = shaped(queue, ctx, &their.geo);
    let kill = stop.child_token();
    let handle = LinkHandle {
        outbox,
        kill: kill.clone(),
        backlog_reported_ms: None,
    };
    ctx.metrics.connected(Peer::Sidecar);
    let up = Event::LinkUp {
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
        .send(Event::Core(Input::LinkClosed {
            link,
            reason: reason.clone(),
        }))
        .await;
    let _ = tokio::time::timeout(Duration::from_secs(1), writer.get_mut().shutdown()).await;
    ctx.metrics.disconnected(Peer::Sidecar);
    Ok(reason)
}

/// Checks the dialled peer's answer: a sidecar `LinkHello` from the node we meant to reach.
fn check_reply(
    frame: MeshFrame,
    peer: NodeId,
    (geo, world_geos): (&str, &[String]),
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
            super::mesh::check_world_geos(&h, geo, world_geos)?;
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
        assert!(check_reply(hello(3, PeerRole::Sidecar), 3, ("eu", &[])).is_ok());
        assert!(check_reply(hello(4, PeerRole::Sidecar), 3, ("eu", &[]))
            .unwrap_err()
            .contains("expected sidecar node 3"));
        assert!(check_reply(hello(3, PeerRole::Proxy), 3, ("eu", &[])).is_err());
        let refused = MeshFrame::one(mesh_message::Body::Refused(mesh::LinkRefused {
            reason: "no".into(),
        }));
        assert_eq!(
            check_reply(refused, 3, ("eu", &[])).unwrap_err(),
            "refused: no"
        );
    }

    #[test]
    fn a_peer_listing_other_world_geos_is_refused() {
        let with = |geo: &str, geos: &[&str]| {
            MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
                version: Some(mesh::ProtocolVersion::current()),
                role: PeerRole::Sidecar as i32,
                node_id: 3,
                geo: geo.into(),
                world_geos: geos.iter().map(|g| g.to_string()).collect(),
                ..Default::default()
            }))
        };
        let ours = ["eu".to_string(), "us".to_string()];
        let ok = |hello, ours: (&str, &[String])| check_reply(hello, 3, ours).is_ok();
        assert!(ok(with("us", &["us", "eu"]), ("eu", &ours)));
        let e = check_reply(with("eu", &["eu", "ap"]), 3, ("eu", &ours)).unwrap_err();
        assert!(e.contains("two homes") && e.contains("\"ap\""), "{e}");
        // A node with no list is its geo's only home: refused by a world of two geos.
        assert!(!ok(with("us", &[]), ("eu", &ours)), "unset there");
        assert!(!ok(with("us", &["eu", "us"]), ("eu", &[])), "unset here");
        // A world of one geo agrees with a node of that geo that set nothing.
        assert!(ok(with("eu", &[]), ("eu", &["eu".to_string()])));
        // Neither set: not compared.
        assert!(ok(with("us", &[]), ("eu", &[])));
    }
}
