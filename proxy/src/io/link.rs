//! One multiplexed mesh link from this proxy to one gateway sidecar: its socket and codec.
//!
//! The task dials with back-off, exchanges `LinkHello`, then tells the driver the link is up
//! (with its outbox) and runs a reader and a writer over the one stream: the reader hands every
//! message to the driver, the writer drains the outbox in batches and beats every second. A link
//! silent for five seconds is dead; so is one the driver cuts (its outbox full for too long, or
//! full even for session control). Then the driver hears the link is down, its sessions move to
//! another gateway in the core, and the link is dialled again.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context};
use bytes::{Bytes, BytesMut};
use cellmesh_proto::codec::{FrameCodec, RawFrame};
use cellmesh_proto::mesh::{
    mesh_message::Body, Heartbeat, LinkHello, MeshFrame, MeshMessage, PeerRole, ProtocolVersion,
};
use cellmesh_proto::PROTOCOL_MAJOR;
use cellmesh_trust::{MeshStream, Role};
use futures::{SinkExt, StreamExt};
use prost::Message;
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

use super::driver::Event;
use super::Io;
use crate::core::{GatewayId, Input};
use crate::metrics::InputLoss;

/// Both ends beat this often.
pub(crate) const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// A link that received nothing for this long is dead.
pub const LINK_SILENCE: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Messages written before one flush, so a burst costs one syscall, not one each.
const WRITE_BATCH: usize = 256;
/// Room in a link's outbox kept for session control when inputs have filled the rest.
pub(crate) const CONTROL_RESERVE: usize = 1024;
/// How often a link checks whether the gateway has gone silent.
const SILENCE_CHECK_EVERY: Duration = Duration::from_millis(250);

/// Delay before redial `attempt` (0-based): doubling from 100 ms, capped at 5 s.
pub(crate) fn backoff(attempt: u32) -> Duration {
    BACKOFF_FIRST
        .saturating_mul(1u32 << attempt.min(16))
        .min(BACKOFF_MAX)
}

/// What the gateway said about itself in its `LinkHello`.
#[derive(Debug, Clone)]
pub(crate) struct PeerInfo {
    pub id: String,
    pub node_id: u32,
    pub geo: String,
    pub partition_epoch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkState {
    Connecting,
    Up,
    Down,
}

/// A link's history, for `/state`.
#[derive(Debug)]
pub(crate) struct LinkStatus {
    pub state: LinkState,
    pub since: Instant,
    pub peer: Option<PeerInfo>,
    pub last_error: Option<String>,
    pub connects: u64,
}

impl LinkStatus {
    pub(crate) fn new() -> Self {
        Self {
            state: LinkState::Connecting,
            since: Instant::now(),
            peer: None,
            last_error: None,
            connects: 0,
        }
    }

    fn set(&mut self, state: LinkState, peer: Option<PeerInfo>, error: Option<String>) {
        if self.state != state {
            self.since = Instant::now();
        }
        self.state = state;
        if state == LinkState::Up {
            self.connects += 1;
            self.peer = peer;
        }
        if error.is_some() {
            self.last_error = error;
        }
    }

    pub(crate) fn to_json(&self) -> serde_json::Value {
        let state = match self.state {
            LinkState::Connecting => "connecting",
            LinkState::Up => "up",
            LinkState::Down => "down",
        };
        serde_json::json!({
            "state": state,
            "for_ms": self.since.elapsed().as_millis() as u64,
            "connects": self.connects,
            "peer": self.peer.as_ref().map(|p| serde_json::json!({
                "id": p.id, "node_id": p.node_id, "geo": p.geo, "partition_epoch": p.partition_epoch,
            })),
            "last_error": self.last_error,
        })
    }
}

/// What the driver holds of a link that is up.
#[derive(Debug)]
pub(crate) struct LinkUp {
    /// Bounded at `link_outbox_frames` + [`CONTROL_RESERVE`].
    pub outbox: mpsc::Sender<MeshMessage>,
    /// Cuts the link, saying why.
    pub cut: Option<oneshot::Sender<String>>,
}

type LinkReader = FramedRead<ReadHalf<MeshStream>, FrameCodec<MeshFrame>>;
type LinkWriter = FramedWrite<WriteHalf<MeshStream>, FrameCodec<MeshFrame>>;

/// Keeps the link to gateway `g` connected until `stop` is cancelled.
pub(crate) async fn run(
    g: GatewayId,
    io: Arc<Io>,
    status: Arc<Mutex<LinkStatus>>,
    stop: CancellationToken,
) {
    let addr = io.cfg.gateway_addr(g).to_string();
    let set = |state, peer, error| {
        status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .set(state, peer, error)
    };
    let mut attempt = 0u32;
    loop {
        set(LinkState::Connecting, None, None);
        let dialled = tokio::select! {
            _ = stop.cancelled() => return,
            r = dial(&addr, &io) => r,
        };
        match dialled {
            Ok((reader, writer, peer)) => {
                attempt = 0;
                tracing::info!(gateway = %addr, node = peer.node_id, peer = %peer.id, "mesh link up");
                let (tx, mut rx) = mpsc::channel(io.cfg.link_outbox_frames + CONTROL_RESERVE);
                let (cut_tx, cut_rx) = oneshot::channel();
                let node_id = peer.node_id;
                set(LinkState::Up, Some(peer), None);
                io.metrics.link_up(&addr, true);
                let up = LinkUp {
                    outbox: tx,
                    cut: Some(cut_tx),
                };
                if io
                    .events
                    .send(Event::LinkUp { g, node_id, up })
                    .await
                    .is_err()
                {
                    return;
                }
                let mut written = 0;
                let ended =
                    serve(reader, writer, &mut rx, &mut written, g, &io, cut_rx, &stop).await;
                // What this connection carried may have died with it; what it never wrote did.
                io.metrics.inputs_on_ended_links.inc_by(written);
                rx.close();
                let mut unsent = 0;
                while let Ok(m) = rx.try_recv() {
                    unsent += u64::from(matches!(m.body, Some(Body::Input(_))));
                }
                io.metrics.lost(InputLoss::LinkClosed, unsent);
                io.metrics.link_up(&addr, false);
                let error = ended.err().map(|e| format!("{e:#}"));
                if error.is_some() {
                    io.metrics.error("link_lost");
                }
                set(LinkState::Down, None, error.clone());
                let down = Input::LinkDown { gateway: g, error };
                if io.events.send(Event::Core(down)).await.is_err() {
                    return;
                }
            }
            Err(e) => {
                io.metrics.error("link_dial");
                let error = format!("{e:#}");
                // Loud once per outage, quiet while retrying.
                if attempt == 0 {
                    tracing::warn!(gateway = %addr, %error, "mesh link dial failed; retrying");
                } else {
                    tracing::debug!(gateway = %addr, attempt, %error, "mesh link dial failed");
                }
                set(LinkState::Down, None, Some(error));
            }
        }
        if stop.is_cancelled() {
            return;
        }
        // Jitter spreads the redials of many proxies after a gateway restarts.
        let delay = backoff(attempt).mul_f64(1.0 + rand::random::<f64>() * 0.25);
        attempt = attempt.saturating_add(1);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// Connects and exchanges `LinkHello`.
async fn dial(gateway: &str, io: &Io) -> anyhow::Result<(LinkReader, LinkWriter, PeerInfo)> {
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(gateway))
        .await
        .map_err(|_| anyhow!("connect timed out"))?
        .context("connect")?;
    stream.set_nodelay(true)?;
    let (stream, proven) = match &io.mesh_tls {
        None => (MeshStream::Plain(stream), None),
        Some(tls) => {
            let name = Role::Sidecar.server_name();
            let (s, id) = tokio::time::timeout(LINK_SILENCE, tls.connect(stream, &name))
                .await
                .map_err(|_| anyhow!("no TLS handshake within {} s", LINK_SILENCE.as_secs()))?
                .map_err(|e| {
                    io.metrics.error("tls_refused");
                    anyhow!("TLS handshake with the gateway failed: {e}")
                })?;
            (s, Some(id))
        }
    };
    let (r, w) = tokio::io::split(stream);
    let max = io.cfg.max_frame_bytes;
    let mut reader = FramedRead::new(r, FrameCodec::<MeshFrame>::with_max(max));
    let mut writer = FramedWrite::new(w, FrameCodec::<MeshFrame>::with_max(max));
    let hello = MeshFrame::one(Body::Hello(LinkHello {
        version: Some(ProtocolVersion::current()),
        role: PeerRole::Proxy as i32,
        id: io.cfg.name.clone(),
        geo: io.cfg.geo.clone(),
        partition_epoch: 0,
        node_id: 0,
        lease_epoch: 0,
        // A proxy grants no claim: it has no list of homes.
        world_geos: Vec::new(),
    }));
    io.metrics.link_out.frame(hello.encoded_len());
    writer.send(hello).await.context("sending LinkHello")?;
    let reply = tokio::time::timeout(LINK_SILENCE, reader.next())
        .await
        .map_err(|_| anyhow!("no LinkHello within {} s", LINK_SILENCE.as_secs()))?
        .ok_or_else(|| anyhow!("gateway closed the link during the handshake"))?
        .context("reading the gateway's LinkHello")?;
    io.metrics.link_in.frame(reply.encoded_len());
    let peer = match reply.messages.into_iter().next().and_then(|m| m.body) {
        Some(Body::Hello(h)) => {
            if let Some(proven) = &proven {
                // The gateway's certificate is a sidecar's; its hello must name the same node.
                proven
                    .check_claim(Role::Sidecar, Some(h.node_id), &h.geo)
                    .map_err(|e| anyhow!("gateway refused: {e}"))?;
            }
            check_hello(h)?
        }
        Some(Body::Refused(r)) => bail!("gateway refused the link: {}", r.reason),
        Some(other) => bail!(
            "expected LinkHello from the gateway, got {}",
            crate::core::connection::mesh_body_name(&other)
        ),
        None => bail!("expected LinkHello from the gateway, got an empty frame"),
    };
    Ok((reader, writer, peer))
}

fn check_hello(h: LinkHello) -> anyhow::Result<PeerInfo> {
    let (major, minor) = h.version.map_or((0, 0), |v| (v.major, v.minor));
    if major != PROTOCOL_MAJOR {
        bail!(
            "gateway speaks mesh protocol {major}.{minor}, proxy speaks {PROTOCOL_MAJOR}.{}",
            cellmesh_proto::PROTOCOL_MINOR
        );
    }
    if h.role != PeerRole::Sidecar as i32 {
        bail!("expected a SIDECAR peer, got role {}", h.role);
    }
    Ok(PeerInfo {
        id: h.id,
        node_id: h.node_id,
        geo: h.geo,
        partition_epoch: h.partition_epoch,
    })
}

/// Runs one connection until it fails or is cut (`Err`) or the proxy stops (`Ok`).
#[allow(clippy::too_many_arguments)]
async fn serve(
    reader: LinkReader,
    writer: LinkWriter,
    outbox: &mut mpsc::Receiver<MeshMessage>,
    written: &mut u64,
    g: GatewayId,
    io: &Io,
    cut: oneshot::Receiver<String>,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    // A cut without a reason is the driver gone (the proxy stopping): the writer still
    // flushes what is queued, the last `Detach`es among it.
    let cut = async {
        match cut.await {
            Ok(why) => why,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        r = write_loop(writer, outbox, written, io, stop) => r,
        r = read_loop(reader, g, io) => r,
        why = cut => Err(anyhow!("{why}")),
    }
}

/// Writes the outbox to the gateway. `written` counts the inputs handed to the socket (a batch
/// that fails part way counts whole: some of it may have gone out).
async fn write_loop(
    mut writer: LinkWriter,
    outbox: &mut mpsc::Receiver<MeshMessage>,
    written: &mut u64,
    io: &Io,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let mut beat = tokio::time::interval(HEARTBEAT_EVERY);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut batch = FrameBatch::new(io.cfg.max_frame_bytes);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => {
                // Client connections have ended by now; their last `Detach`es are still queued.
                while let Ok(m) = outbox.try_recv() {
                    batch.push(m)?;
                }
                write(&mut writer, &mut batch, written, io).await?;
                let _ = tokio::time::timeout(HEARTBEAT_EVERY, SinkExt::<MeshFrame>::close(&mut writer)).await;
                return Ok(());
            }
            m = outbox.recv() => {
                let Some(m) = m else { return Ok(()) };
                batch.push(m)?;
                for _ in 1..WRITE_BATCH {
                    match outbox.try_recv() {
                        Ok(m) => batch.push(m)?,
                        Err(_) => break,
                    }
                }
                write(&mut writer, &mut batch, written, io).await?;
            }
            _ = beat.tick() => {
                batch.push(Body::Heartbeat(Heartbeat { sent_unix_ms: unix_ms() }).into())?;
                write(&mut writer, &mut batch, written, io).await?;
            }
        }
    }
}

/// Messages bound for the gateway, encoded once, straight into `MeshFrame` bodies: as many per
/// frame as fit under the maximum, so a burst costs a few frames, not one each.
pub(crate) struct FrameBatch {
    max: usize,
    open: BytesMut,
    full: Vec<Bytes>,
    inputs: u64,
}

impl FrameBatch {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            open: BytesMut::new(),
            full: Vec::new(),
            inputs: 0,
        }
    }

    /// Appends `m` to the open frame; starts a new frame when it would not fit.
    pub(crate) fn push(&mut self, m: MeshMessage) -> anyhow::Result<()> {
        self.inputs += u64::from(matches!(m.body, Some(Body::Input(_))));
        let mark = self.open.len();
        // A `MeshFrame` body is its messages, each under field `messages`: encoding them one
        // after another is encoding the frame.
        prost::encoding::message::encode(MESH_FRAME_MESSAGES, &m, &mut self.open);
        if self.open.len() > self.max {
            if mark == 0 {
                let len = self.open.len();
                self.open.clear();
                bail!(
                    "a message of {len} bytes exceeds max_frame_bytes {}",
                    self.max
                );
            }
            let last = self.open.split_off(mark);
            self.full
                .push(std::mem::replace(&mut self.open, last).freeze());
        }
        Ok(())
    }

    /// The frames to write, the open one closed, and how many inputs they carry.
    pub(crate) fn take(&mut self) -> (Vec<Bytes>, u64) {
        if !self.open.is_empty() {
            let open = self.open.split().freeze();
            self.full.push(open);
        }
        (
            std::mem::take(&mut self.full),
            std::mem::take(&mut self.inputs),
        )
    }
}

/// `MeshFrame.messages`' field number.
const MESH_FRAME_MESSAGES: u32 = 5;

/// Writes the batch's frames and flushes, under one stall deadline: a write the gateway does not
/// take within `link_stall_ms` ends the link (its socket buffers are full, so it stopped reading).
async fn write(
    writer: &mut LinkWriter,
    batch: &mut FrameBatch,
    written: &mut u64,
    io: &Io,
) -> anyhow::Result<()> {
    let (frames, inputs) = batch.take();
    *written += inputs;
    io.metrics.inputs_written.inc_by(inputs);
    let send = async {
        for f in frames {
            io.metrics.link_out.frame(f.len());
            writer.feed(RawFrame(f)).await?;
        }
        SinkExt::<RawFrame>::flush(writer).await
    };
    let stall = io.cfg.link_stall();
    match tokio::time::timeout(stall, send).await {
        Ok(r) => r.context("writing to the gateway"),
        Err(_) => {
            io.metrics.error("link_write_stalled");
            bail!(
                "a write blocked for {} ms: the gateway stopped reading",
                stall.as_millis()
            )
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

async fn read_loop(mut reader: LinkReader, g: GatewayId, io: &Io) -> anyhow::Result<()> {
    // Silence is a timestamp checked on a tick, not a timer re-armed for every frame.
    let mut silence_check = tokio::time::interval(SILENCE_CHECK_EVERY);
    silence_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut last_heard = Instant::now();
    loop {
        let read = tokio::select! {
            r = reader.next() => r,
            _ = silence_check.tick() => {
                if last_heard.elapsed() >= LINK_SILENCE {
                    bail!("gateway silent for {} s", LINK_SILENCE.as_secs());
                }
                continue;
            }
        };
        last_heard = Instant::now();
        let frame = match read {
            None => bail!("gateway closed the link"),
            Some(Err(e)) => {
                io.metrics.error(e.kind());
                return Err(e).context("reading from the gateway");
            }
            Some(Ok(frame)) => frame,
        };
        io.metrics.link_in.frame(reader.decoder().last_frame_len());
        if frame.messages.is_empty() {
            io.metrics.error("unexpected_message");
            tracing::warn!(gateway = %io.cfg.gateway_addr(g), "unexpected message on mesh link: an empty MeshFrame (a frame of another protocol?)");
        }
        for message in frame.messages {
            match &message.body {
                Some(Body::Heartbeat(_)) => continue,
                Some(Body::Refused(r)) => bail!("gateway refused the link: {}", r.reason),
                _ => {}
            }
            let input = Input::LinkMessage {
                gateway: g,
                message,
            };
            if io.events.send(Event::Core(input)).await.is_err() {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_then_caps() {
        assert_eq!(backoff(0), Duration::from_millis(100));
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(5), Duration::from_millis(3200));
        assert_eq!(backoff(6), BACKOFF_MAX);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }

    #[test]
    fn a_batch_packs_messages_into_frames_under_the_maximum_in_order() {
        use tokio_util::codec::Decoder;
        let mut batch = FrameBatch::new(100);
        for seq in 0..10 {
            let body = Body::Input(cellmesh_proto::mesh::SessionInput {
                session_id: 1,
                seq,
                payload: vec![seq as u8; 20].into(),
            });
            batch.push(body.into()).unwrap();
        }
        batch
            .push(Body::Heartbeat(Heartbeat { sent_unix_ms: 5 }).into())
            .unwrap();
        let (frames, inputs) = batch.take();
        assert_eq!(inputs, 10);
        assert!(
            frames.len() > 1 && frames.len() < 11,
            "{} frames",
            frames.len()
        );
        let mut seqs = Vec::new();
        for f in &frames {
            assert!(f.len() <= 100, "{}", f.len());
            let mut buf = BytesMut::new();
            buf.extend_from_slice(&(f.len() as u32).to_be_bytes());
            buf.extend_from_slice(f);
            let frame = FrameCodec::<MeshFrame>::with_max(100)
                .decode(&mut buf)
                .unwrap()
                .unwrap();
            for m in frame.messages {
                match m.body {
                    Some(Body::Input(i)) => seqs.push(i.seq),
                    Some(Body::Heartbeat(h)) => assert_eq!(h.sent_unix_ms, 5),
                    other => panic!("{other:?}"),
                }
            }
        }
        assert_eq!(seqs, (0..10).collect::<Vec<_>>());
        assert_eq!(batch.take(), (vec![], 0), "taking empties the batch");

        let mut small = FrameBatch::new(10);
        let big = Body::Input(cellmesh_proto::mesh::SessionInput {
            payload: vec![0; 50].into(),
            ..Default::default()
        });
        assert!(small.push(big.into()).is_err());
    }

    #[test]
    fn hello_from_another_major_names_both_versions() {
        let h = LinkHello {
            version: Some(ProtocolVersion {
                major: PROTOCOL_MAJOR + 1,
                minor: 2,
            }),
            role: PeerRole::Sidecar as i32,
            ..Default::default()
        };
        let err = check_hello(h).unwrap_err().to_string();
        assert!(err.contains(&format!("{}.2", PROTOCOL_MAJOR + 1)), "{err}");
        assert!(
            err.contains(&format!("proxy speaks {PROTOCOL_MAJOR}.")),
            "{err}"
        );
        let proxy = LinkHello {
            version: Some(ProtocolVersion::current()),
            role: PeerRole::Proxy as i32,
            ..Default::default()
        };
        assert!(check_hello(proxy).is_err());
    }
}
