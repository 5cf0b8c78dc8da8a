//! Mesh links: proxies dial this node's `mesh_listen`, one link per proxy, multiplexed by
//! session id.
//!
//! One task per link owns the socket: it checks the `LinkHello` handshake, answers with this
//! node's own, keeps the link alive with heartbeats (sent every second; a link silent for five
//! seconds is dead) and hands everything else to the node in order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, MeshMessage, PeerRole};
use cellmesh_proto::{PROTOCOL_MAJOR, PROTOCOL_MINOR};
use cellmesh_trust::{Identity, MeshStream, MeshTls, Role};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::codec::MeteredCodec;
use super::{unix_ms, Event, LinkHandle, HELLO_TIMEOUT};
use crate::core::wire::forwarded_inputs;
use crate::core::Input;
use crate::metrics::{Metrics, Peer};

pub(crate) const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
pub(crate) const DEAD_AFTER: Duration = Duration::from_secs(5);
const PARTING_WRITE: Duration = Duration::from_secs(1);
/// The largest frame a mesh connection may send before its `LinkHello` is accepted: a hello is
/// tens of bytes, and a stranger must not make the listener buffer a megabyte per connection.
pub(crate) const PRE_HELLO_MAX_FRAME: usize = 4 * 1024;
/// Mesh connections still in their handshake at once; one more is closed as it comes. A peer's
/// handshake takes a round trip, so even a whole cluster dialling at start stays far below; a
/// flood of idle connections holds at most this many (and `PRE_HELLO_MAX_FRAME` each) until the
/// hello timeout.
pub(crate) const MAX_HANDSHAKES: usize = 256;
/// Of those, from one address: one host cannot take every place. Loopback is exempt: a cluster
/// on one host (`cellmesh up`, the tests) has every peer there, and nothing remote is.
pub(crate) const MAX_HANDSHAKES_PER_ADDRESS: usize = 32;

/// The connections in their handshake, in all and by address.
pub(crate) struct Handshakes {
    total: Arc<tokio::sync::Semaphore>,
    by_address: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
}

/// A place in the handshake, given back when dropped.
pub(crate) struct HandshakePermit {
    _total: tokio::sync::OwnedSemaphorePermit,
    address: Option<(std::net::IpAddr, Arc<Handshakes>)>,
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        if let Some((ip, of)) = self.address.take() {
            let mut by = of.by_address.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = by.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    by.remove(&ip);
                }
            }
        }
    }
}

impl Handshakes {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            total: Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES)),
            by_address: Default::default(),
        })
    }

    /// A place for a connection from `ip`, or the error kind it is refused under.
    pub(crate) fn admit(
        self: &Arc<Self>,
        ip: std::net::IpAddr,
    ) -> Result<HandshakePermit, &'static str> {
        let total = self
            .total
            .clone()
            .try_acquire_owned()
            .map_err(|_| "handshakes_full")?;
        let address = if ip.is_loopback() {
            None
        } else {
            let mut by = self.by_address.lock().unwrap_or_else(|e| e.into_inner());
            let n = by.entry(ip).or_default();
            if *n >= MAX_HANDSHAKES_PER_ADDRESS {
                return Err("handshakes_per_address_full");
            }
            *n += 1;
            Some((ip, self.clone()))
        };
        Ok(HandshakePermit {
            _total: total,
            address,
        })
    }
}

#[cfg(test)]
mod handshake_tests {
    use super::*;

    #[test]
    fn one_address_cannot_take_every_place_and_loopback_is_exempt() {
        let h = Handshakes::new();
        let far: std::net::IpAddr = "10.0.0.7".parse().unwrap();
        let mut held: Vec<_> = (0..MAX_HANDSHAKES_PER_ADDRESS)
            .map(|_| h.admit(far).unwrap())
            .collect();
        assert_eq!(h.admit(far).err(), Some("handshakes_per_address_full"));
        // Another address, and loopback, still get in.
        let other = h.admit("10.0.0.8".parse().unwrap()).unwrap();
        let local: Vec<_> = (0..MAX_HANDSHAKES_PER_ADDRESS + 1)
            .map(|_| h.admit("127.0.0.1".parse().unwrap()).unwrap())
            .collect();
        // A handshake done gives its address's place back.
        held.pop();
        let again = h.admit(far).unwrap();
        // The total holds whatever the addresses.
        drop((other, again));
        let rest: Vec<_> = (0..MAX_HANDSHAKES - (MAX_HANDSHAKES_PER_ADDRESS - 1) - local.len())
            .map(|i| {
                h.admit(std::net::IpAddr::from([
                    10,
                    1,
                    (i / 200) as u8,
                    (i % 200) as u8,
                ]))
            })
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            h.admit("10.9.9.9".parse().unwrap()).err(),
            Some("handshakes_full")
        );
        drop(rest);
        assert!(h.admit("10.9.9.9".parse().unwrap()).is_ok());
    }
}

#[derive(Clone)]
pub(crate) struct MeshCtx {
    pub node: mpsc::Sender<Event>,
    pub metrics: Metrics,
    pub max_frame: usize,
    pub outbox_frames: usize,
    pub node_id: u32,
    pub geo: String,
    /// The world's geos as this node's `geos` lists them (empty: not set), told in its hello
    /// and compared with every peer sidecar's.
    pub world_geos: Vec<String>,
    pub partition_epoch: u64,
    /// This process's lease epoch (0: no lease), told to every peer so that a link to a node
    /// restarted in place is not taken for a link to its predecessor.
    pub lease_epoch: u64,
    /// Link ids, shared by accepted and dialled links.
    pub next_link: Arc<AtomicU64>,
    pub shutdown: CancellationToken,
    pub tasks: TaskTracker,
    pub shaping: crate::config::MeshShaping,
    /// Places for connections in their handshake ([`MAX_HANDSHAKES`],
    /// [`MAX_HANDSHAKES_PER_ADDRESS`]).
    pub handshakes: Arc<Handshakes>,
    /// Mutual TLS on every link, accepted and dialled; none: plaintext on loopback.
    pub tls: Option<Arc<MeshTls>>,
}

/// A link's queue behind the demo's in-process delay towards a peer of `geo` (see
/// `SidecarConfig::shaping`), or as it is when there is none. What the line still holds when the
/// link ends is counted like the rest of a closing link's queue.
pub(crate) fn shaped(
    queue: mpsc::Receiver<MeshFrame>,
    ctx: &MeshCtx,
    geo: &str,
) -> mpsc::Receiver<MeshFrame> {
    delayed(queue, ctx, ctx.shaping.towards(&ctx.geo, geo))
}

/// [`shaped`] with the delay of the way there and back.
fn shaped_round_trip(
    queue: mpsc::Receiver<MeshFrame>,
    ctx: &MeshCtx,
    geo: &str,
) -> mpsc::Receiver<MeshFrame> {
    let one_way = ctx.shaping.towards(&ctx.geo, geo);
    let there_and_back =
        cellmesh_proto::shaping::OneWay::ms(2 * one_way.base_ms, 2 * one_way.jitter_ms);
    delayed(queue, ctx, there_and_back)
}

fn delayed(
    queue: mpsc::Receiver<MeshFrame>,
    ctx: &MeshCtx,
    delay: cellmesh_proto::shaping::OneWay,
) -> mpsc::Receiver<MeshFrame> {
    let metrics = ctx.metrics.clone();
    cellmesh_proto::shaping::delay_line(queue, delay, ctx.outbox_frames, move |f: MeshFrame| {
        metrics
            .inputs_lost_in_links
            .inc_by(forwarded_inputs(&f.messages));
    })
}

impl MeshCtx {
    /// This node's `LinkHello`, as it dials or answers.
    pub(crate) fn hello(&self) -> MeshFrame {
        MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
            version: Some(mesh::ProtocolVersion::current()),
            role: PeerRole::Sidecar as i32,
            id: self.node_id.to_string(),
            geo: self.geo.clone(),
            partition_epoch: self.partition_epoch,
            node_id: self.node_id,
            lease_epoch: self.lease_epoch,
            world_geos: self.world_geos.clone(),
        }))
    }
}

/// Refuses a peer sidecar whose list of the world's geos differs from this node's: a claim key
/// would have a home in each list.
/// A node with no list is its own geo's only home: once either side lists geos, the other's
/// unset list counts as its geo alone. Two nodes with no list are not compared (one geo, or a
/// world that has not set `geos` yet).
pub(crate) fn check_world_geos(
    hello: &mesh::LinkHello,
    our_geo: &str,
    ours: &[String],
) -> Result<(), String> {
    if hello.role != PeerRole::Sidecar as i32 || (hello.world_geos.is_empty() && ours.is_empty()) {
        return Ok(());
    }
    let or_alone = |list: &[String], geo: &str| {
        if list.is_empty() {
            vec![geo.to_string()]
        } else {
            list.to_vec()
        }
    };
    let (theirs, ours) = (
        or_alone(&hello.world_geos, &hello.geo),
        or_alone(ours, our_geo),
    );
    if cellmesh_world::homes::same_homes(&theirs, &ours) {
        return Ok(());
    }
    Err(format!(
        "sidecar node {} lists the world's geos as {theirs:?}, this node as {ours:?}: a claim key \
         would have two homes (set the same `geos` on every node)",
        hello.node_id
    ))
}

pub(crate) async fn accept_loop(listener: TcpListener, ctx: MeshCtx) {
    loop {
        let accepted = tokio::select! {
            _ = ctx.shutdown.cancelled() => break,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                let permit = match ctx.handshakes.admit(peer.ip()) {
                    Ok(p) => p,
                    Err(kind) => {
                        // Closed at once: nothing is read from it, no task is spent on it.
                        ctx.metrics.error(kind);
                        tracing::debug!(%peer, kind, "mesh connection closed: too many handshakes in progress");
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let link = ctx.next_link.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(link, %peer, "mesh connection");
                ctx.tasks
                    .spawn(serve(stream, link, peer.to_string(), ctx.clone(), permit));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting a mesh connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The role a hello claims, as a certificate would name it.
pub(crate) fn claimed_role(role: i32) -> Option<Role> {
    match PeerRole::try_from(role) {
        Ok(PeerRole::Sidecar) => Some(Role::Sidecar),
        Ok(PeerRole::Proxy) => Some(Role::Proxy),
        _ => None,
    }
}

/// Checks that a hello says what the peer's certificate proves (with mesh TLS on).
pub(crate) fn check_proven(hello: &mesh::LinkHello, proven: &Identity) -> Result<(), String> {
    let role = claimed_role(hello.role)
        .ok_or_else(|| format!("{} claims no role a certificate names", peer_name(hello)))?;
    let node = (role == Role::Sidecar).then_some(hello.node_id);
    proven.check_claim(role, node, &hello.geo)
}

/// Checks the dialling side's `LinkHello` (against what its certificate proves, with mesh TLS);
/// the error is the `LinkRefused` reason.
pub(crate) fn check_link_hello(
    frame: MeshFrame,
    node_id: u32,
    (geo, world_geos): (&str, &[String]),
    proven: Option<&Identity>,
) -> Result<(mesh::LinkHello, Vec<MeshMessage>), String> {
    let mut messages = frame.messages.into_iter();
    let hello = match messages.next().map(|m| m.body) {
        None => {
            return Err(
                "expected LinkHello, got an empty frame (is this the mesh protocol?)".into(),
            )
        }
        Some(Some(mesh_message::Body::Hello(h))) => h,
        Some(_) => return Err("expected LinkHello as the first message".into()),
    };
    let ours = format!("sidecar speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}");
    match hello.version {
        None => return Err(format!("LinkHello without a protocol version; {ours}")),
        Some(v) if v.major != PROTOCOL_MAJOR => {
            return Err(format!(
                "{} speaks protocol {}.{}, {ours}",
                peer_name(&hello),
                v.major,
                v.minor
            ))
        }
        Some(_) => {}
    }
    if hello.role == PeerRole::Sidecar as i32 {
        // One link per pair: the lower node id dials, so a link from above is a misconfiguration.
        if hello.node_id >= node_id {
            return Err(format!(
                "sidecar node {} dialled node {node_id}: of two sidecars only the lower node id dials",
                hello.node_id
            ));
        }
    } else if hello.role != PeerRole::Proxy as i32 {
        return Err(format!(
            "{} dialled as role {}; this sidecar accepts proxy and sidecar links only",
            peer_name(&hello),
            hello.role
        ));
    }
    if let Some(proven) = proven {
        check_proven(&hello, proven)?;
    }
    check_world_geos(&hello, geo, world_geos)?;
    Ok((hello, messages.collect()))
}

fn peer_name(h: &mesh::LinkHello) -> String {
    if h.id.is_empty() {
        "peer".into()
    } else {
        format!("peer {:?}", h.id)
    }
}

pub(crate) type Reader = FramedRead<ReadHalf<MeshStream>, MeteredCodec<MeshFrame>>;
pub(crate) type Writer = FramedWrite<WriteHalf<MeshStream>, MeteredCodec<MeshFrame>>;

/// The TLS handshake of an accepted connection (within the hello's time), or the plain stream.
async fn secure(tcp: TcpStream, ctx: &MeshCtx) -> Result<(MeshStream, Option<Identity>), String> {
    let Some(tls) = &ctx.tls else {
        return Ok((MeshStream::Plain(tcp), None));
    };
    tokio::select! {
        _ = ctx.shutdown.cancelled() => Err("sidecar shutting down".into()),
        r = tokio::time::timeout(HELLO_TIMEOUT, tls.accept(tcp)) => match r {
            Ok(Ok((stream, id))) => Ok((stream, Some(id))),
            Ok(Err(e)) => Err(format!("TLS handshake failed: {e}")),
            Err(_) => Err(format!("no TLS handshake within {} s", HELLO_TIMEOUT.as_secs())),
        },
    }
}

async fn serve(
    stream: TcpStream,
    link: u64,
    remote: String,
    ctx: MeshCtx,
    handshake: HandshakePermit,
) {
    let (stream, proven) = match secure(stream, &ctx).await {
        Ok(s) => s,
        Err(reason) => {
            // Nothing of the mesh protocol was spoken: no `LinkRefused` to send.
            ctx.metrics.error("tls_refused");
            tracing::info!(link, %remote, %reason, "mesh connection refused");
            return;
        }
    };
    ctx.metrics.connected(Peer::Proxy);
    let (r, w) = tokio::io::split(stream);
    let mut reader = FramedRead::new(
        r,
        MeteredCodec::<MeshFrame>::new(
            PRE_HELLO_MAX_FRAME.min(ctx.max_frame),
            &ctx.metrics,
            Peer::Proxy,
        ),
    );
    let mut writer = FramedWrite::new(
        w,
        MeteredCodec::<MeshFrame>::new(ctx.max_frame, &ctx.metrics, Peer::Proxy),
    );
    let (up, reason) = run(
        &mut reader,
        &mut writer,
        link,
        remote,
        proven,
        &ctx,
        handshake,
    )
    .await;
    if up {
        let _ = ctx
            .node
            .send(Event::Core(Input::LinkClosed { link, reason }))
            .await;
    } else {
        tracing::info!(link, %reason, "mesh link refused");
    }
    let _ = tokio::time::timeout(PARTING_WRITE, writer.get_mut().shutdown()).await;
    ctx.metrics.disconnected(Peer::Proxy);
}

/// Runs one link; returns whether it got past the handshake, and why it ended.
async fn run(
    reader: &mut Reader,
    writer: &mut Writer,
    link: u64,
    remote: String,
    proven: Option<Identity>,
    ctx: &MeshCtx,
    handshake: HandshakePermit,
) -> (bool, String) {
    let first = tokio::select! {
        _ = ctx.shutdown.cancelled() => return (false, "sidecar shutting down".into()),
        _ = tokio::time::sleep(HELLO_TIMEOUT) => Err(format!("expected LinkHello within {} s", HELLO_TIMEOUT.as_secs())),
        f = reader.next() => match f {
            None => return (false, "closed before LinkHello".into()),
            Some(Err(e)) => {
                ctx.metrics.error(e.kind());
                Err(e.to_string())
            }
            Some(Ok(frame)) => check_link_hello(frame, ctx.node_id, (&ctx.geo, &ctx.world_geos), proven.as_ref()),
        },
    };
    drop(handshake);
    let (hello, rest) = match first {
        Ok(x) => {
            reader.decoder_mut().set_max_frame(ctx.max_frame);
            x
        }
        Err(reason) => {
            ctx.metrics.error("link_refused");
            let refused = MeshFrame::one(mesh_message::Body::Refused(mesh::LinkRefused {
                reason: reason.clone(),
            }));
            let _ = tokio::time::timeout(PARTING_WRITE, writer.send(refused)).await;
            return (false, reason);
        }
    };
    let ours = ctx.hello();
    if let Err(e) = writer.send(ours).await {
        return (false, format!("writing LinkHello failed: {e}"));
    }
    let (outbox, queue) = mpsc::channel(ctx.outbox_frames);
    let queue = if hello.role == PeerRole::Sidecar as i32 {
        shaped(queue, ctx, &hello.geo)
    } else {
        // A proxy of another geo (one whose own geo went dark): a proxy shapes nothing, so its
        // players' round trip is put on the way back to it.
        shaped_round_trip(queue, ctx, &hello.geo)
    };
    let kill = CancellationToken::new();
    let handle = LinkHandle {
        outbox,
        kill: kill.clone(),
        backlog_reported_ms: None,
    };
    let rest = without_heartbeats(rest);
    if ctx
        .node
        .send(Event::LinkUp {
            link,
            hello,
            remote,
            handle,
            rest,
        })
        .await
        .is_err()
    {
        return (false, "sidecar shutting down".into());
    }
    pump(reader, writer, link, queue, kill, ctx, "the proxy").await
}

/// Runs an established link: writes what the node queues and a heartbeat every second, hands
/// every received frame to the node, and ends when either side closes, the peer is silent for
/// five seconds, or the node kills the link. Returns `(true, why it ended)`.
pub(crate) async fn pump(
    reader: &mut Reader,
    writer: &mut Writer,
    link: u64,
    mut queue: mpsc::Receiver<MeshFrame>,
    kill: CancellationToken,
    ctx: &MeshCtx,
    who: &str,
) -> (bool, String) {
    let mut written = 0;
    let ended = pump_until_closed(
        reader,
        writer,
        link,
        &mut queue,
        &mut written,
        kill,
        ctx,
        who,
    )
    .await;
    // Inputs this link carried may have died with it; those it never wrote did.
    ctx.metrics.inputs_on_ended_links.inc_by(written);
    queue.close();
    while let Ok(frame) = queue.try_recv() {
        ctx.metrics
            .inputs_lost_in_links
            .inc_by(forwarded_inputs(&frame.messages));
    }
    ended
}

#[allow(clippy::too_many_arguments)]
async fn pump_until_closed(
    reader: &mut Reader,
    writer: &mut Writer,
    link: u64,
    queue: &mut mpsc::Receiver<MeshFrame>,
    written: &mut u64,
    kill: CancellationToken,
    ctx: &MeshCtx,
    who: &str,
) -> (bool, String) {
    let mut heartbeat = tokio::time::interval_at(Instant::now() + HEARTBEAT_EVERY, HEARTBEAT_EVERY);
    let dead = tokio::time::sleep(DEAD_AFTER);
    tokio::pin!(dead);
    loop {
        tokio::select! {
            biased;
            _ = kill.cancelled() => return (true, "closed by the node".into()),
            out = queue.recv() => {
                let Some(frame) = out else { return (true, "sidecar let go of the link".into()) };
                let write = async {
                    *written += forwarded_inputs(&frame.messages);
                    writer.feed(frame).await?;
                    while let Ok(more) = queue.try_recv() {
                        *written += forwarded_inputs(&more.messages);
                        writer.feed(more).await?;
                    }
                    SinkExt::<MeshFrame>::flush(writer).await
                };
                let r = tokio::select! {
                    r = write => r,
                    _ = kill.cancelled() => continue,
                };
                if let Err(e) = r {
                    return (true, format!("writing to {who} failed: {e}"));
                }
            }
            _ = heartbeat.tick() => {
                let beat = MeshFrame::one(mesh_message::Body::Heartbeat(mesh::Heartbeat { sent_unix_ms: unix_ms() }));
                let r = tokio::select! {
                    r = writer.send(beat) => r,
                    _ = kill.cancelled() => continue,
                };
                if let Err(e) = r {
                    return (true, format!("writing to {who} failed: {e}"));
                }
            }
            _ = &mut dead => {
                ctx.metrics.error("link_timeout");
                return (true, format!("no frame from {who} for {} s", DEAD_AFTER.as_secs()));
            }
            f = reader.next() => match f {
                None => return (true, format!("{who} closed the link")),
                Some(Err(e)) => {
                    ctx.metrics.error(e.kind());
                    return (true, format!("bad frame from {who}: {e}"));
                }
                Some(Ok(frame)) => {
                    dead.as_mut().reset(Instant::now() + DEAD_AFTER);
                    if frame.messages.is_empty() || frame.messages.iter().any(|m| m.body.is_none()) {
                        ctx.metrics.error("unexpected_message");
                        return (true, "expected mesh messages, got an empty frame or an unknown message type".into());
                    }
                    let messages = without_heartbeats(frame.messages);
                    if !messages.is_empty() && ctx.node.send(Event::Core(Input::LinkFrame { link, messages })).await.is_err() {
                        return (true, "sidecar shutting down".into());
                    }
                }
            },
        }
    }
}

pub(crate) fn without_heartbeats(mut messages: Vec<MeshMessage>) -> Vec<MeshMessage> {
    messages.retain(|m| !matches!(m.body, Some(mesh_message::Body::Heartbeat(_))));
    messages
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(major: u32, role: PeerRole) -> MeshFrame {
        MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
            version: Some(mesh::ProtocolVersion { major, minor: 3 }),
            role: role as i32,
            id: "edge-1".into(),
            ..Default::default()
        }))
    }

    #[test]
    fn link_hello_rules() {
        assert!(check_link_hello(hello(1, PeerRole::Proxy), 5, ("eu", &[]), None).is_ok());
        let e = check_link_hello(hello(2, PeerRole::Proxy), 5, ("eu", &[]), None).unwrap_err();
        assert_eq!(
            e,
            format!("peer \"edge-1\" speaks protocol 2.3, sidecar speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}")
        );
        assert!(
            check_link_hello(hello(1, PeerRole::RoleUnspecified), 5, ("eu", &[]), None)
                .unwrap_err()
                .contains("proxy and sidecar links only")
        );
        let sidecar = |node_id| {
            MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
                version: Some(mesh::ProtocolVersion::current()),
                role: PeerRole::Sidecar as i32,
                node_id,
                ..Default::default()
            }))
        };
        assert!(check_link_hello(sidecar(2), 5, ("eu", &[]), None).is_ok());
        assert!(check_link_hello(sidecar(5), 5, ("eu", &[]), None)
            .unwrap_err()
            .contains("only the lower node id dials"));
        assert!(check_link_hello(MeshFrame::default(), 5, ("eu", &[]), None)
            .unwrap_err()
            .contains("empty frame"));
        let beat = MeshFrame::one(mesh_message::Body::Heartbeat(mesh::Heartbeat {
            sent_unix_ms: 1,
        }));
        assert!(check_link_hello(beat, 5, ("eu", &[]), None)
            .unwrap_err()
            .contains("expected LinkHello"));
    }

    #[test]
    fn a_sidecar_listing_other_world_geos_is_refused() {
        let with = |role: PeerRole, geos: &[&str]| {
            MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
                version: Some(mesh::ProtocolVersion::current()),
                role: role as i32,
                node_id: 2,
                geo: "us".into(),
                world_geos: geos.iter().map(|g| g.to_string()).collect(),
                ..Default::default()
            }))
        };
        let ours = ["eu".to_string(), "us".to_string()];
        assert!(check_link_hello(
            with(PeerRole::Sidecar, &["us", "eu"]),
            5,
            ("eu", &ours),
            None
        )
        .is_ok());
        assert!(
            check_link_hello(with(PeerRole::Sidecar, &[]), 5, ("eu", &ours), None).is_err(),
            "a node of another geo with no list is its geo's only home"
        );
        assert!(check_link_hello(with(PeerRole::Sidecar, &[]), 5, ("eu", &[]), None).is_ok());
        let e =
            check_link_hello(with(PeerRole::Sidecar, &["eu"]), 5, ("eu", &ours), None).unwrap_err();
        assert!(e.contains("two homes") && e.contains("node 2"), "{e}");
        assert!(
            check_link_hello(with(PeerRole::Proxy, &["eu"]), 5, ("eu", &ours), None).is_ok(),
            "a proxy grants no claim"
        );
    }

    #[test]
    fn a_hello_must_agree_with_the_certificate() {
        let with = |role: PeerRole, node_id, geo: &str| {
            MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
                version: Some(mesh::ProtocolVersion::current()),
                role: role as i32,
                node_id,
                geo: geo.into(),
                ..Default::default()
            }))
        };
        let node3 = Identity::new(Role::Sidecar, Some(3), Some("eu")).unwrap();
        let proxy = Identity::new(Role::Proxy, None, Some("eu")).unwrap();
        assert!(check_link_hello(
            with(PeerRole::Sidecar, 3, "eu"),
            5,
            ("eu", &[]),
            Some(&node3)
        )
        .is_ok());
        let e = check_link_hello(
            with(PeerRole::Sidecar, 2, "eu"),
            5,
            ("eu", &[]),
            Some(&node3),
        )
        .unwrap_err();
        assert!(e.contains("node 2") && e.contains("node 3"), "{e}");
        let e = check_link_hello(
            with(PeerRole::Sidecar, 2, "eu"),
            5,
            ("eu", &[]),
            Some(&proxy),
        )
        .unwrap_err();
        assert!(e.contains("proves proxy"), "{e}");
        assert!(
            check_link_hello(with(PeerRole::Proxy, 0, "eu"), 5, ("eu", &[]), Some(&proxy)).is_ok()
        );
        assert!(
            check_link_hello(with(PeerRole::Proxy, 0, "eu"), 5, ("eu", &[]), Some(&node3)).is_err()
        );
        assert!(
            check_link_hello(with(PeerRole::Proxy, 0, "us"), 5, ("eu", &[]), Some(&proxy)).is_err()
        );
    }
}
