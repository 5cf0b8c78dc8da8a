//! One multiplexed mesh link from this proxy to one gateway sidecar.
//!
//! The link task dials with back-off, exchanges `LinkHello`, then runs a reader and a writer over
//! the one TCP stream: the writer drains the link's bounded outbox and beats every second; the
//! reader dispatches each inbound message by `session_id` to that session's bounded outbox. A link
//! silent for five seconds is dead; its sessions move to another gateway (their client tasks see
//! their route dropped and attach again elsewhere) and the link is dialled again.
//!
//! Nothing here waits on a client: a full session outbox kicks that session. A link outbox that
//! is full drops inputs and RTT reports (counted), never blocking a client task, while session
//! control (attach, detach) keeps room of its own; only an outbox full for `link_stall_ms`, or a
//! link silent for five seconds, closes the link. A burst of a few ms must not kick a gateway's
//! every session.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context};
use bytes::{Bytes, BytesMut};
use cellmesh_proto::codec::{FrameCodec, RawFrame};
use cellmesh_proto::edge::{Kick, KickReason};
use cellmesh_proto::mesh::{
    mesh_message::Body, Admission, Heartbeat, LinkHello, MeshFrame, MeshMessage, PeerRole,
    ProtocolVersion,
};
use cellmesh_proto::PROTOCOL_MAJOR;
use cellmesh_trust::{MeshStream, Role};
use futures::{SinkExt, StreamExt};
use prost::Message;
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

use crate::metrics::InputLoss;
use crate::session::{SessionRoute, ToSession};
use crate::Shared;

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
/// How often a link checks whether its outbox has been full for too long.
const STALL_CHECK_EVERY: Duration = Duration::from_millis(100);
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

#[derive(Debug)]
struct LinkStatus {
    state: LinkState,
    since: Instant,
    peer: Option<PeerInfo>,
    last_error: Option<String>,
    connects: u64,
}

/// The link to one gateway, across reconnects.
#[derive(Debug)]
pub(crate) struct Link {
    pub gateway: Arc<str>,
    /// Session ids of this link: monotonic and never reused, even across reconnects, so a late
    /// message for an old session can never reach a new one.
    next_session: AtomicU64,
    current: Mutex<Option<Arc<LinkConn>>>,
    status: Mutex<LinkStatus>,
}

/// Sessions routed over one connection of a link; closed (and drained) when it ends.
#[derive(Debug, Default)]
struct Routes {
    closed: bool,
    map: HashMap<u64, SessionRoute>,
}

/// Why a message could not be queued on a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum LinkGone {
    /// Inputs and RTT reports fill the outbox: this one is dropped, the link stays.
    #[error("the link's outbox is full")]
    Full,
    /// Even session control found no room: the link is closed.
    #[error("the link's outbox is full, even for session control")]
    Stalled,
    #[error("the link is closed")]
    Closed,
}

/// Why a gateway takes no new sessions, as it said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Closed {
    pub reason: String,
    pub retry_after_ms: u32,
}

/// One live connection of a link.
#[derive(Debug)]
pub(crate) struct LinkConn {
    pub gateway: Arc<str>,
    /// The gateway's node id, from its `LinkHello`.
    pub node_id: u32,
    /// Set while the gateway says it admits no new session (each connection starts open: a
    /// gateway that is closed says so as the link comes up).
    closed: Mutex<Option<Closed>>,
    /// Bounded at `link_outbox_frames` + [`CONTROL_RESERVE`].
    outbox: mpsc::Sender<MeshMessage>,
    routes: Mutex<Routes>,
    stalled: CancellationToken,
    opened: Instant,
    /// Milliseconds after `opened` (plus one, so zero means "not full") when data first found the
    /// outbox full, in the current streak.
    full_since: AtomicU64,
}

impl LinkConn {
    fn new(gateway: Arc<str>, node_id: u32, outbox: mpsc::Sender<MeshMessage>) -> Self {
        Self {
            gateway,
            node_id,
            closed: Mutex::new(None),
            outbox,
            routes: Mutex::default(),
            stalled: CancellationToken::new(),
            opened: Instant::now(),
            full_since: AtomicU64::new(0),
        }
    }

    /// Queues an input or an RTT report unless only the control reserve is left.
    pub(crate) fn send_data(&self, body: Body) -> Result<(), LinkGone> {
        if self.outbox.is_closed() {
            return Err(LinkGone::Closed);
        }
        if self.outbox.capacity() <= CONTROL_RESERVE {
            let now = self.opened.elapsed().as_millis() as u64 + 1;
            let _ = self
                .full_since
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
            return Err(LinkGone::Full);
        }
        if self.full_since.load(Ordering::Relaxed) != 0 {
            self.full_since.store(0, Ordering::Relaxed);
        }
        self.send(body)
    }

    /// How long data has found the outbox full without a break, if it does now.
    fn full_for(&self) -> Option<Duration> {
        if self.outbox.capacity() > CONTROL_RESERVE {
            self.full_since.store(0, Ordering::Relaxed);
            return None;
        }
        match self.full_since.load(Ordering::Relaxed) {
            0 => None,
            since => Some(
                self.opened
                    .elapsed()
                    .saturating_sub(Duration::from_millis(since - 1)),
            ),
        }
    }

    /// Why the gateway admits no new session, while it says so.
    pub(crate) fn closed(&self) -> Option<Closed> {
        self.closed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The gateway's latest word on new sessions; whether it changed anything.
    fn set_admission(&self, a: Admission) -> bool {
        let now = (!a.open).then_some(Closed {
            reason: a.reason,
            retry_after_ms: a.retry_after_ms,
        });
        let mut closed = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        let changed = closed.is_some() != now.is_some();
        *closed = now;
        changed
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Routes `session_id` to `route`; false if this connection already ended.
    pub(crate) fn attach(&self, session_id: u64, route: SessionRoute) -> bool {
        let mut routes = self.routes();
        if routes.closed {
            return false;
        }
        routes.map.insert(session_id, route);
        true
    }

    /// Unroutes `session_id`; true if it was still routed, i.e. the gateway has not ended it.
    pub(crate) fn release(&self, session_id: u64) -> bool {
        self.routes().map.remove(&session_id).is_some()
    }

    /// Queues one session-control message for the gateway without waiting; it may use the
    /// reserve. With no room even there, the link is closed.
    pub(crate) fn send(&self, body: Body) -> Result<(), LinkGone> {
        self.outbox.try_send(body.into()).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                self.stalled.cancel();
                LinkGone::Stalled
            }
            mpsc::error::TrySendError::Closed(_) => LinkGone::Closed,
        })
    }

    /// Ends routing; returns the sessions that were still attached.
    fn close(&self) -> Vec<SessionRoute> {
        let mut routes = self.routes();
        routes.closed = true;
        routes.map.drain().map(|(_, r)| r).collect()
    }

    fn sessions(&self) -> usize {
        self.routes().map.len()
    }
}

impl Link {
    pub(crate) fn new(gateway: &str) -> Self {
        Self {
            gateway: gateway.into(),
            next_session: AtomicU64::new(1),
            current: Mutex::new(None),
            status: Mutex::new(LinkStatus {
                state: LinkState::Connecting,
                since: Instant::now(),
                peer: None,
                last_error: None,
                connects: 0,
            }),
        }
    }

    pub(crate) fn next_session_id(&self) -> u64 {
        self.next_session.fetch_add(1, Ordering::Relaxed)
    }

    /// The live connection, if the link is up.
    pub(crate) fn conn(&self) -> Option<Arc<LinkConn>> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_status(&self, state: LinkState, peer: Option<PeerInfo>, error: Option<String>) {
        let mut s = self.status.lock().unwrap_or_else(|p| p.into_inner());
        if s.state != state {
            s.since = Instant::now();
        }
        s.state = state;
        if state == LinkState::Up {
            s.connects += 1;
            s.peer = peer;
        }
        if error.is_some() {
            s.last_error = error;
        }
    }

    pub(crate) fn to_json(&self) -> serde_json::Value {
        let conn = self.conn();
        let sessions = conn.as_ref().map_or(0, |c| c.sessions());
        let admission = conn.map(|c| match c.closed() {
            None => serde_json::json!({ "open": true }),
            Some(c) => serde_json::json!({
                "open": false, "reason": c.reason, "retry_after_ms": c.retry_after_ms,
            }),
        });
        let s = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let state = match s.state {
            LinkState::Connecting => "connecting",
            LinkState::Up => "up",
            LinkState::Down => "down",
        };
        serde_json::json!({
            "gateway": &*self.gateway,
            "state": state,
            "for_ms": s.since.elapsed().as_millis() as u64,
            "connects": s.connects,
            "sessions": sessions,
            "peer": s.peer.as_ref().map(|p| serde_json::json!({
                "id": p.id, "node_id": p.node_id, "geo": p.geo, "partition_epoch": p.partition_epoch,
            })),
            "last_error": s.last_error,
            "admission": admission,
        })
    }
}

#[cfg(test)]
impl Link {
    /// A link that is up, its gateway open or `closed`; the receiver is its outbox.
    pub(crate) fn up_for_test(
        gateway: &str,
        node_id: u32,
        closed: Option<Closed>,
    ) -> (Self, mpsc::Receiver<MeshMessage>) {
        let link = Self::new(gateway);
        let (tx, rx) = mpsc::channel(16);
        let conn = LinkConn::new(gateway.into(), node_id, tx);
        *conn.closed.lock().unwrap() = closed;
        *link.current.lock().unwrap() = Some(Arc::new(conn));
        (link, rx)
    }
}

type LinkReader = FramedRead<ReadHalf<MeshStream>, FrameCodec<MeshFrame>>;
type LinkWriter = FramedWrite<WriteHalf<MeshStream>, FrameCodec<MeshFrame>>;

/// Keeps `link` connected until `stop` is cancelled.
pub(crate) async fn run(link: Arc<Link>, shared: Arc<Shared>, stop: CancellationToken) {
    let mut attempt = 0u32;
    loop {
        link.set_status(LinkState::Connecting, None, None);
        let dialled = tokio::select! {
            _ = stop.cancelled() => return,
            r = dial(&link.gateway, &shared) => r,
        };
        match dialled {
            Ok((reader, writer, peer)) => {
                attempt = 0;
                tracing::info!(gateway = %link.gateway, node = peer.node_id, peer = %peer.id, "mesh link up");
                let (tx, mut rx) = mpsc::channel(shared.cfg.link_outbox_frames + CONTROL_RESERVE);
                let conn = Arc::new(LinkConn::new(link.gateway.clone(), peer.node_id, tx));
                *link.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn.clone());
                link.set_status(LinkState::Up, Some(peer), None);
                shared.metrics.link_up(&link.gateway, true);
                shared.refresh_ready();

                let mut written = 0;
                let ended =
                    serve(reader, writer, &mut rx, &mut written, &conn, &shared, &stop).await;
                // What this connection carried may have died with it; what it never wrote did.
                shared.metrics.inputs_on_ended_links.inc_by(written);
                rx.close();
                let mut unsent = 0;
                while let Ok(m) = rx.try_recv() {
                    unsent += u64::from(matches!(m.body, Some(Body::Input(_))));
                }
                shared.metrics.lost(InputLoss::LinkClosed, unsent);

                *link.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
                shared.metrics.link_up(&link.gateway, false);
                shared.refresh_ready();
                shared.refresh_admission();
                let error = ended.err().map(|e| format!("{e:#}"));
                let orphans = conn.close();
                if let Some(error) = &error {
                    shared.metrics.error("link_lost");
                    tracing::warn!(gateway = %link.gateway, sessions = orphans.len(), %error, "mesh link lost");
                }
                if error.is_none() {
                    let kick = format!(
                        "link to gateway {} closed: proxy shutting down",
                        link.gateway
                    );
                    for route in orphans {
                        route
                            .control
                            .kick(Kick::new(KickReason::Shutdown, kick.clone()));
                    }
                } else {
                    // Dropping the routes ends each session's queue once drained: its client
                    // task attaches the session to another gateway, the client stays connected.
                    drop(orphans);
                }
                link.set_status(LinkState::Down, None, error);
            }
            Err(e) => {
                shared.metrics.error("link_dial");
                let error = format!("{e:#}");
                // Loud once per outage, quiet while retrying.
                if attempt == 0 {
                    tracing::warn!(gateway = %link.gateway, %error, "mesh link dial failed; retrying");
                } else {
                    tracing::debug!(gateway = %link.gateway, attempt, %error, "mesh link dial failed");
                }
                link.set_status(LinkState::Down, None, Some(error));
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
async fn dial(
    gateway: &str,
    shared: &Shared,
) -> anyhow::Result<(LinkReader, LinkWriter, PeerInfo)> {
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(gateway))
        .await
        .map_err(|_| anyhow!("connect timed out"))?
        .context("connect")?;
    stream.set_nodelay(true)?;
    let (stream, proven) = match &shared.mesh_tls {
        None => (MeshStream::Plain(stream), None),
        Some(tls) => {
            let name = Role::Sidecar.server_name();
            let (s, id) = tokio::time::timeout(LINK_SILENCE, tls.connect(stream, &name))
                .await
                .map_err(|_| anyhow!("no TLS handshake within {} s", LINK_SILENCE.as_secs()))?
                .map_err(|e| {
                    shared.metrics.error("tls_refused");
                    anyhow!("TLS handshake with the gateway failed: {e}")
                })?;
            (s, Some(id))
        }
    };
    let (r, w) = tokio::io::split(stream);
    let max = shared.cfg.max_frame_bytes;
    let mut reader = FramedRead::new(r, FrameCodec::<MeshFrame>::with_max(max));
    let mut writer = FramedWrite::new(w, FrameCodec::<MeshFrame>::with_max(max));
    let hello = MeshFrame::one(Body::Hello(LinkHello {
        version: Some(ProtocolVersion::current()),
        role: PeerRole::Proxy as i32,
        id: shared.cfg.name.clone(),
        geo: shared.cfg.geo.clone(),
        partition_epoch: 0,
        node_id: 0,
    }));
    shared.metrics.link_out.frame(hello.encoded_len());
    writer.send(hello).await.context("sending LinkHello")?;
    let reply = tokio::time::timeout(LINK_SILENCE, reader.next())
        .await
        .map_err(|_| anyhow!("no LinkHello within {} s", LINK_SILENCE.as_secs()))?
        .ok_or_else(|| anyhow!("gateway closed the link during the handshake"))?
        .context("reading the gateway's LinkHello")?;
    shared.metrics.link_in.frame(reply.encoded_len());
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
            body_name(&other)
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

/// Runs one connection until it fails (`Err`) or the proxy stops (`Ok`).
async fn serve(
    reader: LinkReader,
    writer: LinkWriter,
    outbox: &mut mpsc::Receiver<MeshMessage>,
    written: &mut u64,
    conn: &LinkConn,
    shared: &Shared,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    tokio::select! {
        r = write_loop(writer, outbox, written, shared, stop) => r,
        r = read_loop(reader, conn, shared) => r,
        _ = conn.stalled.cancelled() => {
            shared.metrics.error("link_outbox_full");
            Err(anyhow!("outbox full ({} messages), even for session control: the gateway stopped reading", shared.cfg.link_outbox_frames + CONTROL_RESERVE))
        }
        stalled = stall_watch(conn, shared.cfg.link_stall()) => {
            shared.metrics.error("link_outbox_full");
            Err(anyhow!("outbox full for {} ms: the gateway stopped reading", stalled.as_millis()))
        }
    }
}

/// Completes once the outbox has stayed full for `limit`.
async fn stall_watch(conn: &LinkConn, limit: Duration) -> Duration {
    let mut tick = tokio::time::interval(STALL_CHECK_EVERY);
    loop {
        tick.tick().await;
        if let Some(full) = conn.full_for().filter(|f| *f >= limit) {
            return full;
        }
    }
}

/// Writes the outbox to the gateway. `written` counts the inputs handed to the socket (a batch
/// that fails part way counts whole: some of it may have gone out).
async fn write_loop(
    mut writer: LinkWriter,
    outbox: &mut mpsc::Receiver<MeshMessage>,
    written: &mut u64,
    shared: &Shared,
    stop: &CancellationToken,
) -> anyhow::Result<()> {
    let mut beat = tokio::time::interval(HEARTBEAT_EVERY);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut batch = FrameBatch::new(shared.cfg.max_frame_bytes);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => {
                // Client tasks have ended by now; their last `Detach`es are still queued.
                while let Ok(m) = outbox.try_recv() {
                    batch.push(m)?;
                }
                write(&mut writer, &mut batch, written, shared).await?;
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
                write(&mut writer, &mut batch, written, shared).await?;
            }
            _ = beat.tick() => {
                batch.push(Body::Heartbeat(Heartbeat { sent_unix_ms: unix_ms() }).into())?;
                write(&mut writer, &mut batch, written, shared).await?;
            }
        }
    }
}

/// Messages bound for the gateway, encoded once, straight into `MeshFrame` bodies: as many per
/// frame as fit under the maximum, so a burst costs a few frames, not one each.
struct FrameBatch {
    max: usize,
    open: BytesMut,
    full: Vec<Bytes>,
    inputs: u64,
}

impl FrameBatch {
    fn new(max: usize) -> Self {
        Self {
            max,
            open: BytesMut::new(),
            full: Vec::new(),
            inputs: 0,
        }
    }

    /// Appends `m` to the open frame; starts a new frame when it would not fit.
    fn push(&mut self, m: MeshMessage) -> anyhow::Result<()> {
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
    fn take(&mut self) -> (Vec<Bytes>, u64) {
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
/// `written` counts the inputs handed to the socket (a batch that fails part way counts whole:
/// some of it may have gone out).
async fn write(
    writer: &mut LinkWriter,
    batch: &mut FrameBatch,
    written: &mut u64,
    shared: &Shared,
) -> anyhow::Result<()> {
    let (frames, inputs) = batch.take();
    *written += inputs;
    shared.metrics.inputs_written.inc_by(inputs);
    let io = async {
        for f in frames {
            shared.metrics.link_out.frame(f.len());
            writer.feed(RawFrame(f)).await?;
        }
        SinkExt::<RawFrame>::flush(writer).await
    };
    let stall = shared.cfg.link_stall();
    match tokio::time::timeout(stall, io).await {
        Ok(r) => r.context("writing to the gateway"),
        Err(_) => {
            shared.metrics.error("link_write_stalled");
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

async fn read_loop(mut reader: LinkReader, conn: &LinkConn, shared: &Shared) -> anyhow::Result<()> {
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
                shared.metrics.error(e.kind());
                return Err(e).context("reading from the gateway");
            }
            Some(Ok(frame)) => frame,
        };
        shared
            .metrics
            .link_in
            .frame(reader.decoder().last_frame_len());
        if frame.messages.is_empty() {
            unexpected(
                shared,
                &conn.gateway,
                "an empty MeshFrame (a frame of another protocol?)",
            );
        }
        for m in frame.messages {
            dispatch(m, conn, shared)?;
        }
    }
}

/// A well-framed message the proxy has no use for: counted and skipped, the link stays up.
fn unexpected(shared: &Shared, gateway: &str, what: &str) {
    shared.metrics.error("unexpected_message");
    tracing::warn!(%gateway, "unexpected message on mesh link: {what}");
}

fn dispatch(m: MeshMessage, conn: &LinkConn, shared: &Shared) -> anyhow::Result<()> {
    let Some(body) = m.body else {
        unexpected(shared, &conn.gateway, "a MeshMessage of unknown type");
        return Ok(());
    };
    match body {
        Body::Heartbeat(_) => {}
        Body::Attached(a) => {
            let id = a.session_id;
            deliver(conn, shared, id, ToSession::Attached(a));
        }
        Body::ToClient(t) => deliver(conn, shared, t.session_id, ToSession::Frame(t.server_frame)),
        Body::Detach(d) => {
            // Unrouted first: the gateway already forgot the session, so no `Detach` goes back.
            let route = conn.routes().map.remove(&d.session_id);
            if let Some(route) = route {
                let kick = Kick {
                    reason: d.kick_reason as i32,
                    detail: d.detail,
                    retry_after_ms: d.retry_after_ms,
                };
                if let Err(e) = route.outbox.try_send(ToSession::Detach(kick)) {
                    let ToSession::Detach(kick) = e.into_inner() else {
                        unreachable!()
                    };
                    route.control.kick(kick);
                }
            }
        }
        Body::Admission(a) => {
            let open = a.open;
            if conn.set_admission(a) {
                match conn.closed() {
                    Some(c) => {
                        tracing::warn!(gateway = %conn.gateway, node = conn.node_id, reason = %c.reason, "gateway admits no new session")
                    }
                    None => {
                        tracing::info!(gateway = %conn.gateway, node = conn.node_id, open, "gateway admits new sessions again")
                    }
                }
                shared.refresh_admission();
            }
        }
        Body::Where(w) => {
            // Advisory, and repeated: dropped rather than kick a client whose queue is full.
            let routes = conn.routes();
            if let Some(route) = routes.map.get(&w.session_id) {
                let _ = route.outbox.try_send(ToSession::Where(w));
            }
        }
        Body::Refused(r) => bail!("gateway refused the link: {}", r.reason),
        other => unexpected(shared, &conn.gateway, body_name(&other)),
    }
    Ok(())
}

/// Hands `msg` to the session's outbox; a full outbox kicks that session alone.
fn deliver(conn: &LinkConn, shared: &Shared, session_id: u64, msg: ToSession) {
    let routes = conn.routes();
    let Some(route) = routes.map.get(&session_id) else {
        // A session that just ended: the gateway has not seen its `Detach` yet.
        return;
    };
    if let Err(mpsc::error::TrySendError::Full(_)) = route.outbox.try_send(msg) {
        shared.metrics.error("client_outbox_full");
        route.control.kick(Kick::new(
            KickReason::SlowConsumer,
            format!(
                "{} frames queued for the client",
                shared.cfg.client_outbox_frames
            ),
        ));
    }
}

fn body_name(b: &Body) -> &'static str {
    match b {
        Body::Hello(_) => "LinkHello",
        Body::Heartbeat(_) => "Heartbeat",
        Body::Attach(_) => "Attach",
        Body::Attached(_) => "Attached",
        Body::Detach(_) => "Detach",
        Body::Input(_) => "SessionInput",
        Body::ToClient(_) => "ToClient",
        Body::Rtt(_) => "SessionRtt",
        Body::Refused(_) => "LinkRefused",
        Body::Admission(_) => "Admission",
        Body::Where(_) => "SessionWhere",
        // Sidecar <-> sidecar traffic never belongs on a proxy link.
        _ => "a sidecar-to-sidecar message",
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
    fn closed_connection_refuses_new_routes_and_hands_back_old_ones() {
        let (tx, _rx) = mpsc::channel(1);
        let conn = LinkConn::new("g".into(), 1, tx);
        let stop = CancellationToken::new();
        let route = || {
            let (tx, _rx) = mpsc::channel(1);
            SessionRoute {
                outbox: tx,
                control: crate::session::SessionControl::new(&stop),
            }
        };
        assert!(conn.attach(1, route()));
        assert!(conn.attach(2, route()));
        assert!(conn.release(2));
        assert!(!conn.release(2), "released once");
        assert_eq!(conn.close().len(), 1);
        assert!(!conn.attach(3, route()));
        assert!(!conn.release(1), "a closed connection forgot its sessions");
    }

    fn input(seq: u64) -> Body {
        Body::Input(cellmesh_proto::mesh::SessionInput {
            session_id: 1,
            seq,
            payload: Default::default(),
        })
    }

    #[test]
    fn a_full_outbox_drops_data_keeps_room_for_control_and_the_link() {
        let (tx, mut rx) = mpsc::channel(4 + CONTROL_RESERVE);
        let conn = LinkConn::new("g".into(), 1, tx);
        for seq in 0..4 {
            assert_eq!(conn.send_data(input(seq)), Ok(()));
        }
        assert_eq!(conn.send_data(input(4)), Err(LinkGone::Full));
        assert!(
            !conn.stalled.is_cancelled(),
            "a burst does not close the link"
        );
        assert!(conn.full_for().is_some());
        let attach = || {
            Body::Attach(cellmesh_proto::mesh::Attach {
                session_id: 9,
                ..Default::default()
            })
        };
        for _ in 0..CONTROL_RESERVE {
            assert_eq!(conn.send(attach()), Ok(()));
        }
        // Control has used its reserve too: the gateway stopped reading, the link closes.
        assert_eq!(conn.send(attach()), Err(LinkGone::Stalled));
        assert!(conn.stalled.is_cancelled());
        // Once the writer drained the queue, data flows again and the streak ends.
        while rx.try_recv().is_ok() {}
        assert_eq!(conn.full_for(), None);
        assert_eq!(conn.send_data(input(5)), Ok(()));
        drop(rx);
        assert_eq!(conn.send_data(input(6)), Err(LinkGone::Closed));
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
