//! One task per client connection: `ClientHello` and the token, `Attach` to a gateway,
//! `Welcome`, then relay both ways until the client leaves or is kicked. When the gateway's
//! link breaks, the session is attached to another gateway and the client gets a new `Welcome`
//! (its view starts over) on the same connection.
//!
//! Everything a client can do wrong ends in a `Kick` to that client alone: its task owns its
//! socket, its queue is bounded, and no lock is held across an await.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use cellmesh_proto::codec::{encode_body, FrameCodec, FrameError, RawFrame};
use cellmesh_proto::edge::{
    client_message, server_message, Challenge, ClientFrame, ClientHello, ClientMessage,
    CookieRequest, Kick, KickReason, Ping, Pong, ProbeRequest, ProtocolVersion, ServerFrame,
    Transfer, Welcome,
};
use cellmesh_proto::mesh::{
    mesh_message, Attach, Attached, Detach, HandoverHint, SessionInput, SessionRtt,
};
use cellmesh_stores::FarRtt;
use cellmesh_trust::MeshStream;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::codec::{FramedRead, FramedWrite};
use tracing::field::Empty;
use tracing::Span;

use crate::connlimit::ConnectionPermit;
use crate::gateway::NoGateway;
use crate::geo::{attach_hint, now_unix_ms, HintSource};
use crate::link::{LinkConn, LinkGone};
use crate::metrics::InputLoss;
use crate::ping::{PingTracker, RTT_WINDOW};
use crate::ratelimit::{FloodMeter, Verdict};
use crate::session::{SessionControl, SessionInfo, SessionRoute, Stop, ToSession};
use crate::HandoverCause;
use crate::{auth, Shared};

/// How long a kicked client gets to receive its `Kick` before the socket is closed.
const KICK_LINGER: Duration = Duration::from_secs(1);
/// Frames relayed to a client before one flush.
const WRITE_BATCH: usize = 64;
/// Gateways one session may be moved to over its life before the client is kicked instead.
const MAX_MOVES: u32 = 16;
/// How often a session whose gateway link broke looks for another link that is up.
const MOVE_POLL: Duration = Duration::from_millis(100);
/// Shortest period of the idleness check (a quarter of the idle timeout otherwise).
const IDLE_CHECK_MIN: Duration = Duration::from_millis(10);

/// What a frame of another protocol looks like: its messages use another field number, so it
/// decodes as a `ClientFrame` with none.
const EMPTY_FRAME: &str = "an empty ClientFrame (a frame of another protocol?)";
const UNKNOWN_MESSAGE: &str = "a ClientMessage of unknown type";

/// How a client's connection ends.
#[derive(Debug)]
enum End {
    /// The proxy or the gateway ends it; the client is told why.
    Kick(Kick),
    /// The client left: `Bye`, a disconnect, or a broken stream.
    Left(String),
    /// The gateway's link broke: the session moves to another gateway.
    GatewayLost(String),
    /// Handed over to another geo: the client gets the `Transfer` and reconnects there.
    Transfer(Transfer, HandoverCause),
}

impl End {
    /// The outcome of a login that ended this way, as its span says it.
    fn outcome(&self) -> &'static str {
        match self {
            Self::Kick(_) => "refused",
            Self::Left(_) => "left",
            Self::GatewayLost(_) => "gateway_lost",
            Self::Transfer(..) => "transferred",
        }
    }
}

fn kick(reason: KickReason, detail: impl Into<String>) -> End {
    End::Kick(Kick::new(reason, detail))
}

fn malformed(detail: impl Into<String>) -> End {
    kick(KickReason::Malformed, detail)
}

/// Pings a probe connection gets, and how far apart.
const PROBE_PINGS: u32 = 5;
const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// How long after its last ping a probe waits for the last pong.
const PROBE_LAST_WAIT: Duration = Duration::from_secs(1);

/// What a connection's hello asks for.
enum Hello {
    /// A login: the account, the hello, and what came in the same frame after it.
    Login(Arc<str>, ClientHello, Vec<ClientMessage>),
    /// An RTT probe another geo's proxy asked the client for, with its ticket.
    Probe(Bytes),
}

/// A session attached (or being attached) to a gateway.
struct Session {
    id: u64,
    account: Arc<str>,
    conn: Arc<LinkConn>,
    outbox: mpsc::Receiver<ToSession>,
    /// Set once the client got its `Welcome`.
    info: Option<Arc<SessionInfo>>,
    /// The session epoch its gateway gave it; 0 until `Attached`.
    epoch: u64,
}

struct Client {
    /// Proxy-wide connection number: session ids are only unique per link.
    id: u64,
    shared: Arc<Shared>,
    peer: SocketAddr,
    control: Arc<SessionControl>,
    reader: FramedRead<ReadHalf<MeshStream>, FrameCodec<ClientFrame>>,
    writer: FramedWrite<WriteHalf<MeshStream>, FrameCodec<ClientFrame>>,
    /// The TCP socket under the connection (TLS or not), for the kernel's RTT figures.
    socket: SocketFd,
    /// This connection's challenge: the login proof must cover it.
    nonce: [u8; NONCE_LEN],
    /// The login under way: from the `ClientHello` to the session attached at a gateway (or
    /// the connection's end); disabled before and after, and when spans are not exported.
    login: Span,
}

/// Bytes of a connection's challenge nonce.
const NONCE_LEN: usize = 16;

/// Messages a client may send while its login waits for its handover cookie, kept to be relayed
/// (through the rate limits) once it is attached; more are dropped and counted. The wait is short
/// (`geos.cookie_wait_ms`) and an honest client sends a few inputs in it, if any.
pub const WAITING_MAX_MESSAGES: usize = 64;

/// A socket's descriptor, borrowed for as long as the connection that owns it lives.
#[derive(Clone, Copy)]
struct SocketFd(std::os::fd::RawFd);

impl std::os::fd::AsRawFd for SocketFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0
    }
}

/// Serves one client connection to its end; `permit` holds its place under the connection limits.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    permit: ConnectionPermit,
) {
    shared.metrics.connections.inc();
    shared.metrics.connections_accepted.inc();
    let _ = stream.set_nodelay(true);
    let socket = SocketFd(std::os::fd::AsRawFd::as_raw_fd(&stream));
    let stream = match &shared.client_tls {
        // The handshake is under the hello's deadline: a client that stalls it holds nothing
        // longer than one that stalls its hello.
        Some(tls) => {
            match tokio::time::timeout(shared.cfg.hello_timeout(), tls.accept(stream)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    shared.metrics.error("client_tls_refused");
                    tracing::debug!(%peer, error = %e, "client TLS handshake failed");
                    shared.metrics.connections.dec();
                    return;
                }
                Err(_) => {
                    shared.metrics.error("client_tls_timeout");
                    shared.metrics.connections.dec();
                    return;
                }
            }
        }
        None => MeshStream::Plain(stream),
    };
    let (r, w) = tokio::io::split(stream);
    let cfg = &shared.cfg;
    let id = shared.next_connection_id();
    let control = SessionControl::new(&shared.clients_stop);
    shared.register_client(id, control.clone());
    let client = Client {
        id,
        control,
        shared: shared.clone(),
        peer,
        // Until the login is admitted a stranger may send only a small frame.
        reader: FramedRead::new(r, FrameCodec::with_max(cfg.hello_max_frame_bytes)),
        writer: FramedWrite::new(w, FrameCodec::with_max(cfg.max_frame_bytes)),
        socket,
        nonce: rand::random(),
        login: Span::none(),
    };
    client.run().await;
    shared.unregister_client(id);
    shared.metrics.connections.dec();
    drop(permit);
}

impl Client {
    async fn run(mut self) {
        let end = match self.hello().await {
            Ok(Hello::Login(account, hello, mut pending)) => {
                match self.login_hint(&account, &hello, &mut pending).await {
                    Ok(hint) => self.serve_account(account, pending, hint).await,
                    Err(end) => end,
                }
            }
            Ok(Hello::Probe(ticket)) => self.serve_probe(&ticket).await,
            Err(end) => end,
        };
        self.finish(end).await;
    }

    /// Measures the RTT to a client of another geo that its proxy asked to probe this one, and
    /// publishes it onto that geo's Redis: the kernel's figure where it has one (the client's
    /// kernel answers, not the game), and the timed pings besides. No session is attached.
    async fn serve_probe(&mut self, ticket: &[u8]) -> End {
        let shared = self.shared.clone();
        let done = |detail: String| kick(KickReason::ProbeDone, detail);
        if shared.geos.single() {
            shared.metrics.probe_refused("single_geo");
            return done("this network has one geo".into());
        }
        let t = match shared.geos.open_ticket(ticket, self.peer.ip()) {
            Ok(t) => t,
            Err(why) => {
                shared.metrics.probe_refused("bad_ticket");
                tracing::debug!(peer = %self.peer, %why, "probe ticket refused");
                return done(format!("probe refused: {why}"));
            }
        };
        let mut pings = PingTracker::new(PROBE_PINGS as usize);
        let mut timer = tokio::time::interval(PROBE_INTERVAL);
        let (mut sent, mut last_ping) = (0, Instant::now());
        loop {
            let deadline = last_ping + PROBE_LAST_WAIT;
            tokio::select! {
                _ = self.control.stopped() => return self.stopped_end(),
                _ = timer.tick(), if sent < PROBE_PINGS => {
                    let nonce = rand::random();
                    pings.sent(nonce, std::time::Instant::now());
                    sent += 1;
                    last_ping = Instant::now();
                    if let Err(end) = self.send(server_message::Body::Ping(Ping { nonce })).await {
                        return end;
                    }
                }
                r = self.reader.next() => {
                    let frame = match self.received(r) {
                        Ok(f) => f,
                        Err(end) => return end,
                    };
                    for m in frame.messages {
                        if let Some(client_message::Body::Pong(p)) = m.body {
                            pings.pong(p.nonce, std::time::Instant::now());
                        }
                    }
                }
                _ = tokio::time::sleep_until(deadline), if sent == PROBE_PINGS => break,
            }
            if sent == PROBE_PINGS
                && pings
                    .summary()
                    .is_some_and(|s| s.samples as u32 == PROBE_PINGS)
            {
                break;
            }
        }
        let kernel = self.kernel_rtt();
        let summary = pings.summary();
        let rtt = match (kernel, summary) {
            (Some(k), s) => FarRtt {
                min_ms: k.min_ms,
                median_ms: s.map_or(k.smoothed_ms, |s| s.p50_ms),
                // Every ping the kernel sent was ACKed by the client's kernel, answered or not.
                samples: sent,
                kernel: true,
                measured_unix_ms: now_unix_ms(),
            },
            (None, Some(s)) => FarRtt {
                min_ms: s.min_ms,
                median_ms: s.p50_ms,
                samples: s.samples as u32,
                kernel: false,
                measured_unix_ms: now_unix_ms(),
            },
            (None, None) => {
                shared.metrics.probe_refused("unanswered");
                return done("no pong, and no kernel figure".into());
            }
        };
        match shared
            .geos
            .publish_far_rtt(&t.origin_geo, &t.account, rtt)
            .await
        {
            Ok(()) => {
                shared.metrics.probes_served.inc();
            }
            Err(e) => {
                shared.metrics.error("far_rtt_store");
                tracing::warn!(origin = %t.origin_geo, account = %t.account, error = %e, "publishing a probe's RTT failed");
            }
        };
        done(format!("measured {:.1} ms", rtt.min_ms))
    }

    /// The kernel's RTT figures of this connection, unless the config turns them off.
    fn kernel_rtt(&self) -> Option<crate::tcpinfo::KernelRtt> {
        self.shared
            .cfg
            .geos
            .kernel_rtt
            .then(|| crate::tcpinfo::kernel_rtt(&self.socket))
            .flatten()
    }

    /// How the task ends when it was stopped from outside.
    fn stopped_end(&self) -> End {
        match self.control.stop_reason() {
            Stop::Kick(k) => End::Kick(k),
            Stop::Transfer(t, because) => End::Transfer(t, because),
        }
    }

    /// On a network of several geos, the handover hint of a login: this geo's Redis first, then
    /// the cookie the client offered, or, if it offered none, the one it holds when asked. A
    /// hint or cookie that fails its checks is counted and the gateway reads MongoDB instead.
    async fn login_hint(
        &mut self,
        account: &str,
        hello: &ClientHello,
        pending: &mut Vec<ClientMessage>,
    ) -> Result<Option<HandoverHint>, End> {
        let shared = self.shared.clone();
        let geos = &shared.geos;
        if geos.single() {
            return Ok(None);
        }
        let ip = self.peer.ip();
        // Taken even when a cookie came along, so that a hint is used once.
        if let Some(h) = geos.take_hint(account, ip, &shared.metrics).await {
            shared.metrics.hint_hits.inc();
            self.login.record("handover", HintSource::Hint.name());
            return Ok(Some(attach_hint(&h, HintSource::Hint)));
        }
        let cookie = if !hello.cookie.is_empty() {
            hello.cookie.to_vec()
        } else {
            shared.metrics.cookie_requests.inc();
            self.send(server_message::Body::CookieRequest(CookieRequest {}))
                .await?;
            self.await_cookie(pending).await?
        };
        if cookie.is_empty() {
            return Ok(None);
        }
        match geos
            .open_once(&cookie, account, ip, now_unix_ms(), &shared.metrics)
            .await
        {
            Ok(c) => {
                shared.metrics.cookie_hits.inc();
                self.login.record("handover", HintSource::Cookie.name());
                Ok(Some(attach_hint(&c, HintSource::Cookie)))
            }
            Err(kind) => {
                shared.metrics.hint_refused(kind);
                tracing::debug!(%account, peer = %self.peer, %kind, "handover cookie refused; the gateway reads the player record");
                Ok(None)
            }
        }
    }

    /// The client's `CookieResponse` (empty: none), within the configured wait; what it sends
    /// meanwhile is kept for after the login.
    async fn await_cookie(&mut self, pending: &mut Vec<ClientMessage>) -> Result<Vec<u8>, End> {
        let deadline = Instant::now() + self.shared.geos.cookie_wait;
        loop {
            let read = tokio::select! {
                _ = self.control.stopped() => return Err(self.stopped_end()),
                r = tokio::time::timeout_at(deadline, self.reader.next()) => r,
            };
            let Ok(read) = read else {
                // A client that keeps no cookies need not answer at all.
                return Ok(Vec::new());
            };
            let frame = self.received(read)?;
            let mut messages = frame.messages.into_iter();
            while let Some(m) = messages.next() {
                match m.body {
                    Some(client_message::Body::Cookie(c)) => {
                        for m in messages {
                            self.keep_waiting(pending, m);
                        }
                        return Ok(c.cookie.to_vec());
                    }
                    Some(client_message::Body::Hello(_)) => {
                        return Err(malformed("unexpected ClientHello: already logged in"))
                    }
                    _ => self.keep_waiting(pending, m),
                }
            }
        }
    }

    /// Keeps a message sent while the login waits, up to [`WAITING_MAX_MESSAGES`].
    fn keep_waiting(&self, pending: &mut Vec<ClientMessage>, m: ClientMessage) {
        let inputs = inputs_in(std::slice::from_ref(&m));
        let metrics = &self.shared.metrics;
        metrics.inputs_received.inc_by(inputs);
        if pending.len() < WAITING_MAX_MESSAGES {
            pending.push(m);
        } else {
            metrics.dropped_waiting.inc_by(inputs);
        }
    }

    /// Serves the account's session on a gateway, and on another each time its gateway's link
    /// breaks (the sidecars find the player's avatar wherever it lives).
    async fn serve_account(
        &mut self,
        account: Arc<str>,
        mut pending: Vec<ClientMessage>,
        mut hint: Option<HandoverHint>,
    ) -> End {
        let mut moves = 0;
        // The epoch the session last held: a move is only registered if no login came since.
        let mut epoch = 0;
        loop {
            let opened = self.open_session(account.clone(), moves == 0, hint.take(), epoch);
            let mut session = match opened {
                Ok(s) => s,
                Err(end) => {
                    self.lose(InputLoss::SessionEnded, &pending);
                    return end;
                }
            };
            let end = self
                .serve_session(&mut session, std::mem::take(&mut pending))
                .await;
            let from = session.conn.gateway.clone();
            if session.epoch != 0 {
                epoch = session.epoch;
            }
            self.close_session(session, &end);
            let End::GatewayLost(why) = end else {
                return end;
            };
            if moves == MAX_MOVES {
                return kick(
                    KickReason::GatewayUnavailable,
                    format!("{why} (the session moved {MAX_MOVES} times already)"),
                );
            }
            moves += 1;
            if let Err(end) = self.await_a_gateway(&why).await {
                return end;
            }
            self.shared.metrics.sessions_moved.inc();
            tracing::info!(%account, %from, %why, "gateway link lost: moving the session to another gateway");
        }
    }

    /// Waits (up to the hello timeout) for a gateway link that is up.
    async fn await_a_gateway(&self, why: &str) -> Result<(), End> {
        let deadline = Instant::now() + self.shared.cfg.hello_timeout();
        while !self.shared.gateways.any_up() {
            if Instant::now() >= deadline {
                return Err(kick(
                    KickReason::GatewayUnavailable,
                    format!("{why}; no other gateway link is up"),
                ));
            }
            tokio::select! {
                _ = self.control.stopped() => return Err(self.stopped_end()),
                _ = tokio::time::sleep(MOVE_POLL) => {}
            }
        }
        Ok(())
    }

    /// Waits for the `ClientHello` and admits it; returns the account, the hello and any
    /// messages that came in the same frame after it.
    async fn hello(&mut self) -> Result<Hello, End> {
        // The login proof covers this connection's challenge: a hello seen on the wire is
        // worth nothing on another connection.
        self.send(server_message::Body::Challenge(Challenge {
            nonce: self.nonce.to_vec().into(),
        }))
        .await?;
        let cfg = &self.shared.cfg;
        let read = tokio::select! {
            _ = self.control.stopped() => return Err(self.stopped_end()),
            r = tokio::time::timeout(cfg.hello_timeout(), self.reader.next()) => r,
        };
        let Ok(read) = read else {
            return Err(kick(
                KickReason::HelloTimeout,
                format!("no ClientHello within {} ms", cfg.hello_timeout_ms),
            ));
        };
        let frame = self.received(read)?;
        let mut messages = frame.messages.into_iter();
        let hello = match messages.next().map(|m| m.body) {
            Some(Some(client_message::Body::Hello(h))) => h,
            Some(Some(other)) => {
                let got = body_name(&other);
                return Err(malformed(format!("expected ClientHello first, got {got}")));
            }
            Some(None) => {
                return Err(malformed(format!(
                    "expected ClientHello, got {UNKNOWN_MESSAGE}"
                )))
            }
            None => {
                return Err(malformed(format!(
                    "expected ClientHello, got {EMPTY_FRAME}"
                )))
            }
        };
        if !hello.probe_ticket.is_empty() {
            auth::check_version(&hello).map_err(End::Kick)?;
            return Ok(Hello::Probe(hello.probe_ticket));
        }
        self.login = tracing::info_span!(
            target: cellmesh_admin::SPANS_TARGET,
            "login",
            proxy = cfg.name.as_str(),
            geo = cfg.geo.as_str(),
            account = Empty,
            handover = Empty,
            gateway = Empty,
            node = Empty,
            session_epoch = Empty,
            outcome = Empty,
            reason = Empty,
        );
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let account =
            auth::admit(&hello, &self.shared.rings.token, &self.nonce, now).map_err(|r| {
                if let Some(kind) = r.token_kind {
                    self.shared.metrics.token_refused(kind);
                }
                End::Kick(r.kick)
            })?;
        self.login.record("account", account.as_str());
        self.reader
            .decoder_mut()
            .set_max_frame(cfg.client_max_frame_bytes);
        let pending: Vec<ClientMessage> = messages.collect();
        self.shared
            .metrics
            .inputs_received
            .inc_by(inputs_in(&pending));
        Ok(Hello::Login(account.into(), *hello, pending))
    }

    /// Picks a gateway, routes a new session id to this task and asks the gateway to attach it.
    /// A new login is refused `SERVER_FULL` when every gateway up admits no new session; a
    /// session that moves was admitted already and goes wherever a link is up.
    fn open_session(
        &self,
        account: Arc<str>,
        new_login: bool,
        handover: Option<HandoverHint>,
        moved_from_epoch: u64,
    ) -> Result<Session, End> {
        let (link, conn) = match self.shared.gateways.pick(new_login) {
            Ok(picked) => picked,
            Err(NoGateway::Down) => {
                return Err(kick(
                    KickReason::GatewayUnavailable,
                    "no gateway link is up",
                ))
            }
            Err(NoGateway::Full {
                retry_after_ms,
                detail,
            }) => {
                self.shared.metrics.logins_refused_server_full.inc();
                tracing::debug!(%account, peer = %self.peer, retry_after_ms, "login refused: every gateway is full");
                return Err(End::Kick(Kick::server_full(detail, retry_after_ms)));
            }
        };
        if new_login {
            self.login.record("gateway", &*conn.gateway);
        }
        let id = link.next_session_id();
        let (tx, outbox) = mpsc::channel(self.shared.cfg.client_outbox_frames);
        if !conn.attach(
            id,
            SessionRoute {
                outbox: tx,
                control: self.control.clone(),
            },
        ) {
            return Err(kick(
                KickReason::GatewayUnavailable,
                format!("link to gateway {} closed", conn.gateway),
            ));
        }
        let session = Session {
            id,
            account,
            conn,
            outbox,
            info: None,
            epoch: 0,
        };
        let attach = Attach {
            session_id: id,
            account: session.account.to_string(),
            remote_addr: self.peer.to_string(),
            moved: !new_login,
            handover,
            moved_from_epoch,
            // Every attach, a login's, a move's or a handover's: the gateway attaches nobody
            // without it.
            attestation: cellmesh_proto::attest::sign(
                self.shared.rings.attest.signing(),
                &session.account,
                id,
                now_unix_ms(),
            ),
        };
        if let Err(e) = session.conn.send(mesh_message::Body::Attach(attach)) {
            session.conn.release(id);
            return Err(kick(
                KickReason::GatewayUnavailable,
                format!("gateway {}: {e}", session.conn.gateway),
            ));
        }
        Ok(session)
    }

    async fn serve_session(&mut self, s: &mut Session, pending: Vec<ClientMessage>) -> End {
        let (attached, early) = match self.await_attached(s).await {
            Ok(a) => a,
            Err(end) => {
                self.lose(InputLoss::SessionEnded, &pending);
                return end;
            }
        };
        let welcome = Welcome {
            version: Some(ProtocolVersion::current()),
            account: s.account.to_string(),
            session_id: s.id,
            session_epoch: attached.session_epoch,
            gateway_node: attached.gateway_node,
            world_width: attached.world_width,
            world_height: attached.world_height,
            chunk_size: attached.chunk_size,
        };
        let mut frames = vec![encode_body(&ServerFrame::one(
            server_message::Body::Welcome(welcome),
        ))];
        frames.extend(early);
        if let Some(probe) = self.probe_request(&s.account).await {
            frames.push(probe);
        }
        if let Err(end) = self.write(frames).await {
            self.lose(InputLoss::SessionEnded, &pending);
            return end;
        }
        // Logged in: the login's span ends (a session moved later has none).
        let login = std::mem::replace(&mut self.login, Span::none());
        login.record("node", i64::from(attached.gateway_node));
        login.record(
            "session_epoch",
            i64::try_from(attached.session_epoch).unwrap_or(i64::MAX),
        );
        login.record("outcome", "attached");
        drop(login);
        let info = Arc::new(SessionInfo::new(
            s.account.clone(),
            s.id,
            s.conn.gateway.clone(),
            self.peer,
            &attached,
            self.control.clone(),
        ));
        self.shared.register_session(self.id, info.clone());
        s.info = Some(info.clone());
        s.epoch = attached.session_epoch;
        tracing::debug!(account = %s.account, session = s.id, gateway = %s.conn.gateway, peer = %self.peer, "session attached");
        let Err(end) = self.relay(s, &info, pending).await;
        end
    }

    /// Waits for the gateway's `Attached`; frames it sent before are kept for after `Welcome`.
    async fn await_attached(&mut self, s: &mut Session) -> Result<(Attached, Vec<Bytes>), End> {
        let cfg = &self.shared.cfg;
        let deadline = Instant::now() + cfg.hello_timeout();
        let mut early = Vec::new();
        loop {
            let next = tokio::select! {
                _ = self.control.stopped() => return Err(self.stopped_end()),
                r = tokio::time::timeout_at(deadline, s.outbox.recv()) => r,
            };
            match next {
                Ok(Some(ToSession::Attached(a))) => return Ok((a, early)),
                Ok(Some(ToSession::Frame(f))) => early.push(f),
                // Comes again within seconds; nothing to keep before the session is up.
                Ok(Some(ToSession::Where(_))) => {}
                Ok(Some(ToSession::Detach(k))) => {
                    if k.reason == KickReason::ServerFull as i32 {
                        // The gateway closed before this proxy heard: refused all the same.
                        self.shared.metrics.logins_refused_server_full.inc();
                    }
                    return Err(End::Kick(k));
                }
                Ok(None) => return Err(self.route_dropped(s)),
                Err(_) => {
                    return Err(kick(
                        KickReason::GatewayUnavailable,
                        format!(
                            "gateway {} did not answer Attach within {} ms",
                            s.conn.gateway, cfg.hello_timeout_ms
                        ),
                    ))
                }
            }
        }
    }

    /// Relays until the session ends; the `Err` says how.
    async fn relay(
        &mut self,
        s: &mut Session,
        info: &SessionInfo,
        pending: Vec<ClientMessage>,
    ) -> Result<Infallible, End> {
        let shared = self.shared.clone();
        let cfg = &shared.cfg;
        let mut pings = PingTracker::new(RTT_WINDOW);
        let mut flood = FloodMeter::new(cfg.rate.flood_kick_drops);
        self.relay_messages(pending, s, info, &mut pings, &mut flood)
            .await?;
        let mut ping_timer =
            tokio::time::interval_at(Instant::now() + cfg.ping_interval(), cfg.ping_interval());
        ping_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // Idleness is a timestamp checked on a tick: re-arming a timer on every frame read would
        // cost a timer-wheel update per input.
        let idle_check_every = (cfg.idle_timeout() / 4).max(IDLE_CHECK_MIN);
        let mut idle_check =
            tokio::time::interval_at(Instant::now() + idle_check_every, idle_check_every);
        idle_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last_heard = Instant::now();
        let probe_every = shared.geos.probe_every;
        let mut probe_timer = tokio::time::interval_at(Instant::now() + probe_every, probe_every);
        probe_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // Unbiased: a gateway that always has output must not starve the client's input.
        loop {
            tokio::select! {
                _ = probe_timer.tick(), if !shared.geos.single() => {
                    if let Some(probe) = self.probe_request(&s.account).await {
                        self.write(vec![probe]).await?;
                    }
                }
                _ = self.control.stopped() => return Err(self.stopped_end()),
                m = s.outbox.recv() => match m {
                    Some(ToSession::Frame(f)) => {
                        let mut batch = vec![f];
                        let mut then = None;
                        while batch.len() < WRITE_BATCH {
                            match s.outbox.try_recv() {
                                Ok(ToSession::Frame(f)) => batch.push(f),
                                Ok(ToSession::Where(w)) => info.set_where(w),
                                Ok(other) => { then = Some(other); break; }
                                Err(_) => break,
                            }
                        }
                        self.write(batch).await?;
                        match then {
                            Some(ToSession::Detach(k)) => return Err(End::Kick(k)),
                            Some(ToSession::Attached(_)) => shared.metrics.error("unexpected_message"),
                            _ => {}
                        }
                    }
                    Some(ToSession::Detach(k)) => return Err(End::Kick(k)),
                    Some(ToSession::Attached(_)) => shared.metrics.error("unexpected_message"),
                    Some(ToSession::Where(w)) => info.set_where(w),
                    None => return Err(self.route_dropped(s)),
                },
                r = self.reader.next() => {
                    last_heard = Instant::now();
                    let frame = self.received(r)?;
                    if frame.messages.is_empty() {
                        return Err(malformed(format!("expected ClientMessage, got {EMPTY_FRAME}")));
                    }
                    shared.metrics.inputs_received.inc_by(inputs_in(&frame.messages));
                    self.relay_messages(frame.messages, s, info, &mut pings, &mut flood).await?;
                }
                _ = ping_timer.tick() => {
                    let nonce = rand::random();
                    pings.sent(nonce, std::time::Instant::now());
                    self.send(server_message::Body::Ping(Ping { nonce })).await?;
                }
                _ = idle_check.tick() => {
                    if last_heard.elapsed() >= cfg.idle_timeout() {
                        return Err(kick(KickReason::Idle, format!("no message for {} ms", cfg.idle_timeout_ms)));
                    }
                }
            }
        }
    }

    /// Handles a frame's messages in order; if the session ends part way, the inputs left unread
    /// are counted as lost with it.
    async fn relay_messages(
        &mut self,
        messages: Vec<ClientMessage>,
        s: &Session,
        info: &SessionInfo,
        pings: &mut PingTracker,
        flood: &mut FloodMeter,
    ) -> Result<(), End> {
        let mut messages = messages.into_iter();
        while let Some(m) = messages.next() {
            if let Err(end) = self.on_message(m, s, info, pings, flood).await {
                self.lose(InputLoss::SessionEnded, messages.as_slice());
                return Err(end);
            }
        }
        Ok(())
    }

    /// Counts the inputs among `messages` as lost for `why`.
    fn lose(&self, why: InputLoss, messages: &[ClientMessage]) {
        self.shared.metrics.lost(why, inputs_in(messages));
    }

    async fn on_message(
        &mut self,
        m: ClientMessage,
        s: &Session,
        info: &SessionInfo,
        pings: &mut PingTracker,
        flood: &mut FloodMeter,
    ) -> Result<(), End> {
        use client_message::Body;
        let shared = &self.shared;
        match m.body {
            Some(Body::Input(input)) => match shared.limits.check(&s.account, self.peer.ip()) {
                Verdict::Accept => {
                    let msg = SessionInput {
                        session_id: s.id,
                        seq: input.seq,
                        payload: input.payload,
                    };
                    match s.conn.send_data(mesh_message::Body::Input(msg)) {
                        Ok(()) => {
                            shared.metrics.inputs_accepted.inc();
                            info.inputs_accepted
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        // A burst the link cannot take now costs this input, not the session:
                        // a sustained stall closes the link (and moves its sessions) by itself.
                        Err(LinkGone::Full) => shared.metrics.lost(InputLoss::LinkFull, 1),
                        Err(e @ (LinkGone::Stalled | LinkGone::Closed)) => {
                            shared.metrics.lost(InputLoss::LinkClosed, 1);
                            return Err(End::GatewayLost(format!(
                                "gateway {}: {e}",
                                s.conn.gateway
                            )));
                        }
                    }
                }
                verdict => {
                    shared.metrics.dropped(verdict == Verdict::OverAccountRate);
                    info.inputs_dropped
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if flood.record_drop(std::time::Instant::now()) {
                        let r = &shared.cfg.rate;
                        return Err(kick(
                            KickReason::Flood,
                            format!(
                                "{} inputs over the rate limit within 1 s (limits: {}/s per account, {}/s per address)",
                                r.flood_kick_drops, r.account_inputs_per_sec, r.address_inputs_per_sec()
                            ),
                        ));
                    }
                }
            },
            Some(Body::Ping(p)) => {
                self.send(server_message::Body::Pong(Pong { nonce: p.nonce }))
                    .await?
            }
            Some(Body::Pong(p)) => {
                if let Some(rtt) = pings.pong(p.nonce, std::time::Instant::now()) {
                    shared.metrics.rtt(self.id, rtt);
                    if let Some(sum) = pings.summary() {
                        info.set_rtt(sum, self.kernel_rtt());
                        let rtt = SessionRtt {
                            session_id: s.id,
                            rtt_ms_p50: sum.p50_ms as f32,
                            rtt_ms_min: sum.min_ms as f32,
                        };
                        // Advisory: dropped first when the link is busy.
                        if let Err(LinkGone::Full) = s.conn.send_data(mesh_message::Body::Rtt(rtt))
                        {
                            shared.metrics.rtt_reports_dropped.inc();
                        }
                    }
                }
            }
            Some(Body::Bye(_)) => return Err(End::Left("bye".into())),
            // An answer that came after the login stopped waiting for it: too late to matter.
            Some(Body::Cookie(_)) => {}
            Some(Body::Hello(_)) => {
                return Err(malformed("unexpected ClientHello: already logged in"))
            }
            None => {
                return Err(malformed(format!(
                    "expected ClientMessage, got {UNKNOWN_MESSAGE}"
                )))
            }
        }
        Ok(())
    }

    /// On a network of several geos, the `ProbeRequest` asking the client to probe the others.
    async fn probe_request(&self, account: &str) -> Option<Bytes> {
        let geos = &self.shared.geos;
        if geos.single() {
            return None;
        }
        let targets = geos
            .probe_targets(account, self.peer.ip(), &self.shared.metrics)
            .await;
        self.shared.metrics.probes_asked.inc();
        Some(encode_body(&ServerFrame::one(server_message::Body::Probe(
            ProbeRequest { targets },
        ))))
    }

    /// The link dropped this session's route: a link that ends a session kicks it first, so
    /// the reason is known (the queue and the stop can be seen in either order); with no kick,
    /// the link broke and the session moves.
    fn route_dropped(&self, s: &Session) -> End {
        match self.control.kicked() {
            Some(k) => End::Kick(k),
            None => End::GatewayLost(format!("link to gateway {} lost", s.conn.gateway)),
        }
    }

    /// Counts a received frame, or turns a failed read into the end of the connection.
    fn received(&self, read: Option<Result<ClientFrame, FrameError>>) -> Result<ClientFrame, End> {
        let metrics = &self.shared.metrics;
        match read {
            Some(Ok(frame)) => {
                metrics
                    .client_in
                    .frame(self.reader.decoder().last_frame_len());
                Ok(frame)
            }
            Some(Err(FrameError::Io(e))) => {
                metrics.error("io");
                Err(End::Left(format!("read failed: {e}")))
            }
            Some(Err(e)) => {
                metrics.error(e.kind());
                Err(malformed(e.to_string()))
            }
            None => Err(End::Left("disconnected".into())),
        }
    }

    async fn send(&mut self, body: server_message::Body) -> Result<(), End> {
        self.write(vec![encode_body(&ServerFrame::one(body))]).await
    }

    /// Writes encoded `ServerFrame`s and flushes once. A client that stops reading blocks only
    /// this write, which gives way as soon as the session is stopped from outside.
    async fn write(&mut self, frames: Vec<Bytes>) -> Result<(), End> {
        let metrics = &self.shared.metrics;
        let max = self.shared.cfg.max_frame_bytes;
        let writer = &mut self.writer;
        let io = async {
            for f in frames {
                if f.len() > max {
                    metrics.error("frame_too_large_out");
                    continue;
                }
                metrics.client_out.frame(f.len());
                writer.feed(RawFrame(f)).await?;
            }
            SinkExt::<RawFrame>::flush(writer).await
        };
        tokio::select! {
            r = io => r.map_err(|e| {
                metrics.error(e.kind());
                End::Left(format!("write failed: {e}"))
            }),
            _ = self.control.stopped() => Err(self.stopped_end()),
        }
    }

    /// Unroutes the session and, unless the gateway ended it, tells the gateway it is gone.
    fn close_session(&self, s: Session, end: &End) {
        if s.conn.release(s.id) {
            let (kick_reason, detail) = match end {
                End::Kick(k) => (k.reason as u32, k.detail.clone()),
                End::Transfer(t, _) => (
                    KickReason::Transferred as u32,
                    format!("handed over to geo {}", t.geo),
                ),
                End::Left(why) | End::GatewayLost(why) => {
                    (KickReason::KickUnspecified as u32, why.clone())
                }
            };
            let _ = s.conn.send(mesh_message::Body::Detach(Detach {
                session_id: s.id,
                kick_reason,
                detail,
                retry_after_ms: 0,
            }));
        }
        if s.info.is_some() {
            self.shared.unregister_session(self.id);
        }
    }

    /// Tells a kicked client why (or where to go), then closes without resetting the connection.
    async fn finish(self, end: End) {
        let Self {
            shared,
            peer,
            reader,
            mut writer,
            login,
            ..
        } = self;
        // A login that ends here never got its session.
        login.record("outcome", end.outcome());
        if let End::Kick(k) = &end {
            let reason = KickReason::try_from(k.reason).unwrap_or(KickReason::KickUnspecified);
            login.record("reason", reason.as_str_name());
        }
        drop(login);
        let last = match end {
            End::Kick(kick) => kick_message(&shared, peer, kick),
            End::GatewayLost(why) => kick_message(
                &shared,
                peer,
                Kick::new(KickReason::GatewayUnavailable, why),
            ),
            End::Transfer(t, because) => {
                shared.metrics.transferred(&t.geo, because);
                tracing::debug!(%peer, geo = %t.geo, host = %t.host, port = t.port, "client handed over");
                server_message::Body::Transfer(t)
            }
            End::Left(why) => {
                tracing::debug!(%peer, "client left: {why}");
                return;
            }
        };
        let frame = encode_body(&ServerFrame::one(last));
        shared.metrics.client_out.frame(frame.len());
        let mut reader = reader.into_inner();
        let _ = tokio::time::timeout(KICK_LINGER, async {
            writer.send(RawFrame(frame)).await?;
            SinkExt::<RawFrame>::close(&mut writer).await?;
            // Closing with unread input would send a reset, which can destroy the last message
            // in the client's receive buffer: read until the client closes too.
            let mut sink = [0u8; 4096];
            while reader.read(&mut sink).await? > 0 {}
            Ok::<_, FrameError>(())
        })
        .await;
    }
}

/// Counts a kick and makes it the client's last message.
fn kick_message(shared: &Shared, peer: SocketAddr, kick: Kick) -> server_message::Body {
    let reason = KickReason::try_from(kick.reason).unwrap_or(KickReason::KickUnspecified);
    shared.metrics.kick(reason);
    tracing::debug!(%peer, reason = reason.as_str_name(), detail = %kick.detail, "client kicked");
    server_message::Body::Kick(kick)
}

/// How many of `messages` are inputs.
fn inputs_in(messages: &[ClientMessage]) -> u64 {
    messages
        .iter()
        .filter(|m| matches!(m.body, Some(client_message::Body::Input(_))))
        .count() as u64
}

fn body_name(b: &client_message::Body) -> &'static str {
    use client_message::Body;
    match b {
        Body::Hello(_) => "ClientHello",
        Body::Input(_) => "ClientInput",
        Body::Ping(_) => "Ping",
        Body::Pong(_) => "Pong",
        Body::Bye(_) => "Bye",
        Body::Cookie(_) => "CookieResponse",
    }
}
