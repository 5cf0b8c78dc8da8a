//! One client connection's life, as an explicit [`Phase`]: the challenge and the `ClientHello`
//! with its token proof; on a network of several geos the handover hint (this geo's board, then
//! the client's cookie); `Attach` to a gateway and its `Attached`; `Welcome` and the relay both
//! ways; a move to another gateway when its link breaks (the client stays connected and gets a
//! new `Welcome`); or an RTT probe another geo's proxy asked the client for. Everything a client
//! can do wrong ends in a `Kick` to that client alone.

use ::core::net::SocketAddr;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use cellmesh_proto::codec::encode_body;
use cellmesh_proto::edge::{
    client_message, server_message, Challenge, ClientFrame, ClientHello, ClientMessage,
    CookieRequest, Kick, KickReason, Ping, Pong, ProbeRequest, ProtocolVersion, ServerFrame,
    Transfer, Welcome,
};
use cellmesh_proto::mesh::{
    mesh_message::Body, Attach, Attached, Detach, GeoRtt, HandoverHint, SessionInput, SessionRtt,
    SessionWhere,
};
use cellmesh_proto::ticket::ProbeTicket;
use cellmesh_stores::FarRtt;
use cellmesh_world::handover::RttFigure;

use super::gateways::{GatewayId, Gateways, NoGateway};
use super::{BoardReply, BoardRequest, ConnId, Cx, Event, LoginTrace, Output, TimerKey};
use crate::geo::{attach_hint, HintSource};
use crate::metrics::InputLoss;
use crate::ping::{PingTracker, RttSummary, RTT_WINDOW};
use crate::ratelimit::{FloodMeter, Verdict};
use crate::tcpinfo::KernelRtt;
use crate::HandoverCause;

/// Bytes of a connection's challenge nonce.
pub const NONCE_LEN: usize = 16;
/// Messages a client may send while its login waits (for its handover cookie, its gateway's
/// `Attached`, or a gateway to move to), kept to be relayed (through the rate limits) once it is
/// attached; more are dropped and counted.
pub const WAITING_MAX_MESSAGES: usize = 64;
/// Gateways one session may be moved to over its life before the client is kicked instead.
const MAX_MOVES: u32 = 16;
/// Shortest period of the idleness check (a quarter of the idle timeout otherwise).
const IDLE_CHECK_MIN_MS: u64 = 10;
/// Pings a probe connection gets, and how far apart.
const PROBE_PINGS: u32 = 5;
const PROBE_INTERVAL_MS: u64 = 200;
/// How long after its last ping a probe waits for the last pong.
const PROBE_LAST_WAIT_MS: u64 = 1_000;

/// What a frame of another protocol looks like: its messages use another field number, so it
/// decodes as a `ClientFrame` with none.
const EMPTY_FRAME: &str = "an empty ClientFrame (a frame of another protocol?)";
const UNKNOWN_MESSAGE: &str = "a ClientMessage of unknown type";

/// How a client's connection ends.
#[derive(Debug)]
pub(crate) enum End {
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
    pub(crate) fn kick(reason: KickReason, detail: impl Into<String>) -> Self {
        Self::Kick(Kick::new(reason, detail))
    }

    fn malformed(detail: impl Into<String>) -> Self {
        Self::kick(KickReason::Malformed, detail)
    }

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

/// A login's account and what travels with it from gateway to gateway.
#[derive(Debug)]
struct Login {
    account: Arc<str>,
    /// Messages that came before a session relays them.
    pending: Vec<ClientMessage>,
    /// The handover hint for the first `Attach`.
    hint: Option<HandoverHint>,
    /// The cookie the hello carried, if any.
    cookie: Vec<u8>,
    moves: u32,
    /// The session epoch last held: a move is only registered if no login came since.
    epoch: u64,
}

/// Where a login waiting for the boards is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HintStep {
    /// This geo's board is asked for a hint.
    TakingHint,
    /// The client was asked for its cookie (`CookieRequest`).
    AwaitingCookie,
    /// The cookie's nonce is used on this geo's board.
    OpeningCookie,
}

/// A session asked of a gateway, not attached yet.
#[derive(Debug)]
struct Attaching {
    gateway: GatewayId,
    session: u64,
    /// Frames the gateway sent before its `Attached`, for after `Welcome`.
    early: Vec<Bytes>,
}

/// One attached session, relayed both ways.
#[derive(Debug)]
struct Relay {
    info: SessionInfo,
    pings: PingTracker,
    flood: FloodMeter,
    last_heard_ms: u64,
    /// A handover was asked of the boards: the session ends with its `Transfer`.
    transferring: bool,
}

/// Where an RTT probe is.
#[derive(Debug)]
enum ProbeStep {
    Pinging,
    /// The kernel's figures were asked for.
    ReadingKernel,
    /// The figure is published on the origin geo's board.
    Publishing(f64),
}

#[derive(Debug)]
struct Probe {
    ticket: ProbeTicket,
    pings: PingTracker,
    sent: u32,
    step: ProbeStep,
}

/// A connection's phase.
#[derive(Debug)]
enum Phase {
    /// The challenge is out; the hello must come before the deadline.
    Hello,
    /// A login on a network of several geos, waiting for its handover hint.
    Hint(Login, HintStep),
    /// `Attach` is out; the gateway's `Attached` must come before the deadline.
    Attaching(Login, Attaching),
    Relaying(Login, Box<Relay>),
    /// The gateway's link broke: waiting, until the deadline, for a link that is up.
    Moving(Login, String),
    Probing(Box<Probe>),
    Ended,
}

/// One attached session as `/state` shows it and the handover policy reads it.
#[derive(Debug, Clone)]
pub(crate) struct SessionInfo {
    pub(crate) account: Arc<str>,
    pub(crate) session_id: u64,
    pub(crate) gateway: GatewayId,
    pub(crate) remote: SocketAddr,
    pub(crate) inputs_accepted: u64,
    pub(crate) inputs_dropped: u64,
    pub(crate) rtt: Option<RttSummary>,
    /// The kernel's lowest RTT of the connection (`TCP_INFO`), when it gives one.
    pub(crate) kernel_min_ms: Option<f64>,
    pub(crate) session_epoch: u64,
    pub(crate) gateway_node: u32,
    /// The world's width and height, as `Attached` said.
    pub(crate) world: (f64, f64),
    /// Where the gateway last said the avatar is simulated.
    pub(crate) whereabouts: Option<SessionWhere>,
    /// What other geos' proxies measured to the client, by geo: the board's latest answer,
    /// passed on to the gateway with this proxy's own figure.
    pub(crate) far_rtt: BTreeMap<String, RttFigure>,
}

impl SessionInfo {
    /// This proxy's figure for the session, for the handover policy: the kernel's minimum where
    /// there is one (a client cannot bend it), else the timed pings' minimum.
    pub(crate) fn rtt_figure(&self) -> Option<RttFigure> {
        let rtt = self.rtt?;
        Some(RttFigure {
            min_ms: self.kernel_min_ms.unwrap_or(rtt.min_ms),
            median_ms: rtt.p50_ms,
            samples: rtt.samples as u32,
        })
    }
}

/// One client connection.
#[derive(Debug)]
pub(crate) struct Connection {
    id: ConnId,
    peer: SocketAddr,
    /// This connection's challenge: the login proof must cover it.
    nonce: [u8; NONCE_LEN],
    phase: Phase,
    /// The login under way, from the `ClientHello` to the session attached at a gateway (or
    /// the connection's end): what its span will say. The driver times the span.
    trace: Option<LoginTrace>,
}

impl Connection {
    pub(crate) fn new(id: ConnId, peer: SocketAddr, nonce: [u8; NONCE_LEN]) -> Self {
        Self {
            id,
            peer,
            nonce,
            phase: Phase::Hello,
            trace: None,
        }
    }

    pub(crate) fn ended(&self) -> bool {
        matches!(self.phase, Phase::Ended)
    }

    /// Waiting for any gateway link to come up.
    pub(crate) fn waiting_for_a_gateway(&self) -> bool {
        matches!(self.phase, Phase::Moving(..))
    }

    /// The attached session, if the connection has one.
    pub(crate) fn session(&self) -> Option<&SessionInfo> {
        match &self.phase {
            Phase::Relaying(_, r) => Some(&r.info),
            _ => None,
        }
    }

    pub(crate) fn session_account(&self) -> Option<&str> {
        self.session().map(|s| &*s.account)
    }

    /// Sends the challenge and starts the hello's deadline; a connection opened while the proxy
    /// drains is asked to reconnect at once.
    pub(crate) fn open(&mut self, cx: &mut Cx<'_>) {
        self.send(
            cx,
            server_message::Body::Challenge(Challenge {
                nonce: self.nonce.to_vec().into(),
            }),
        );
        cx.timers.arm(
            TimerKey::Deadline(self.id),
            cx.now.ms() + cx.cfg.hello_timeout_ms,
        );
    }

    pub(crate) fn on_frame(
        &mut self,
        cx: &mut Cx<'_>,
        g: &mut Gateways,
        frame: ClientFrame,
        kernel_rtt: Option<KernelRtt>,
    ) {
        match &mut self.phase {
            Phase::Hello => self.on_hello(cx, g, frame),
            Phase::Hint(login, step) => {
                let waiting_for_cookie = *step == HintStep::AwaitingCookie;
                let mut messages = frame.messages.into_iter();
                while let Some(m) = messages.next() {
                    match m.body {
                        Some(client_message::Body::Cookie(c)) if waiting_for_cookie => {
                            for m in messages.by_ref() {
                                keep_waiting(cx, login, m);
                            }
                            let cookie = c.cookie.to_vec();
                            self.on_cookie(cx, g, cookie);
                            return;
                        }
                        Some(client_message::Body::Hello(_)) => {
                            return self.end(
                                cx,
                                g,
                                End::malformed("unexpected ClientHello: already logged in"),
                            )
                        }
                        _ => keep_waiting(cx, login, m),
                    }
                }
            }
            Phase::Attaching(login, _) | Phase::Moving(login, _) => {
                for m in frame.messages {
                    if matches!(m.body, Some(client_message::Body::Hello(_))) {
                        return self.end(
                            cx,
                            g,
                            End::malformed("unexpected ClientHello: already logged in"),
                        );
                    }
                    keep_waiting(cx, login, m);
                }
            }
            Phase::Relaying(_, relay) => {
                relay.last_heard_ms = cx.now.ms();
                if frame.messages.is_empty() {
                    let end = End::malformed(format!("expected ClientMessage, got {EMPTY_FRAME}"));
                    return self.end(cx, g, end);
                }
                cx.metrics
                    .inputs_received
                    .inc_by(inputs_in(&frame.messages));
                self.relay(cx, g, frame.messages, kernel_rtt);
            }
            Phase::Probing(probe) => {
                for m in frame.messages {
                    if let Some(client_message::Body::Pong(p)) = m.body {
                        probe.pings.pong(p.nonce, cx.now.mono);
                    }
                }
                let answered = probe
                    .pings
                    .summary()
                    .is_some_and(|s| s.samples as u32 == PROBE_PINGS);
                if probe.sent == PROBE_PINGS && answered {
                    self.measured(cx, g);
                }
            }
            Phase::Ended => {}
        }
    }

    /// The hello: a login admitted (or refused), or a probe.
    fn on_hello(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, frame: ClientFrame) {
        let mut messages = frame.messages.into_iter();
        let hello = match messages.next().map(|m| m.body) {
            Some(Some(client_message::Body::Hello(h))) => h,
            Some(Some(other)) => {
                let got = body_name(&other);
                let end = End::malformed(format!("expected ClientHello first, got {got}"));
                return self.end(cx, g, end);
            }
            Some(None) => {
                let end = End::malformed(format!("expected ClientHello, got {UNKNOWN_MESSAGE}"));
                return self.end(cx, g, end);
            }
            None => {
                let end = End::malformed(format!("expected ClientHello, got {EMPTY_FRAME}"));
                return self.end(cx, g, end);
            }
        };
        if !hello.probe_ticket.is_empty() {
            return self.start_probe(cx, g, &hello);
        }
        self.trace = Some(LoginTrace::default());
        cx.emit(Output::LoginStarted { conn: self.id });
        let now_s = cx.now.unix_ms / 1000;
        let account = match crate::auth::admit(&hello, &cx.rings.token, &self.nonce, now_s) {
            Ok(a) => a,
            Err(r) => {
                if let Some(kind) = r.token_kind {
                    cx.metrics.token_refused(kind);
                }
                return self.end(cx, g, End::Kick(r.kick));
            }
        };
        self.traced(|t| t.account = account.clone());
        cx.emit(Output::AdmitFrames {
            conn: self.id,
            max_frame_bytes: cx.cfg.client_max_frame_bytes,
        });
        let pending: Vec<ClientMessage> = messages.collect();
        cx.metrics.inputs_received.inc_by(inputs_in(&pending));
        let login = Login {
            account: account.into(),
            pending,
            hint: None,
            cookie: hello.cookie.to_vec(),
            moves: 0,
            epoch: 0,
        };
        cx.timers.disarm(TimerKey::Deadline(self.id));
        if cx.cfg.geos.single() {
            return self.open_session(cx, g, login);
        }
        // Taken even when a cookie came along, so that a hint is used once.
        cx.emit(Output::Board {
            conn: self.id,
            request: BoardRequest::TakeHint {
                account: login.account.to_string(),
                ip: self.peer.ip(),
            },
        });
        self.phase = Phase::Hint(login, HintStep::TakingHint);
    }

    /// The boards' answers.
    pub(crate) fn on_board(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, reply: BoardReply) {
        match (&mut self.phase, reply) {
            (Phase::Hint(login, step @ HintStep::TakingHint), BoardReply::Hint(hint)) => {
                if let Some(h) = hint {
                    cx.metrics.hint_hits.inc();
                    if let Some(t) = &mut self.trace {
                        t.handover = Some(HintSource::Hint.name());
                    }
                    login.hint = Some(attach_hint(&h, HintSource::Hint));
                    return self.open_waiting_session(cx, g);
                }
                if !login.cookie.is_empty() {
                    let cookie = std::mem::take(&mut login.cookie);
                    *step = HintStep::AwaitingCookie;
                    return self.on_cookie(cx, g, cookie);
                }
                cx.metrics.cookie_requests.inc();
                *step = HintStep::AwaitingCookie;
                self.send(cx, server_message::Body::CookieRequest(CookieRequest {}));
                cx.timers.arm(
                    TimerKey::Deadline(self.id),
                    cx.now.ms() + cx.cfg.geos.cookie_wait_ms,
                );
            }
            (Phase::Hint(login, HintStep::OpeningCookie), BoardReply::Cookie(opened)) => {
                match opened {
                    Ok(c) => {
                        cx.metrics.cookie_hits.inc();
                        if let Some(t) = &mut self.trace {
                            t.handover = Some(HintSource::Cookie.name());
                        }
                        login.hint = Some(attach_hint(&c, HintSource::Cookie));
                    }
                    Err(kind) => {
                        cx.metrics.hint_refused(kind);
                        cx.event(Event::CookieRefused {
                            account: login.account.clone(),
                            peer: self.peer,
                            kind,
                        });
                    }
                }
                self.open_waiting_session(cx, g);
            }
            (Phase::Relaying(login, _), BoardReply::ProbeTargets(targets)) => {
                let _ = login;
                cx.metrics.probes_asked.inc();
                self.send(cx, server_message::Body::Probe(ProbeRequest { targets }));
            }
            (Phase::Probing(probe), BoardReply::Published(result)) => {
                let ProbeStep::Publishing(min_ms) = probe.step else {
                    return;
                };
                match result {
                    Ok(()) => {
                        cx.metrics.probes_served.inc();
                    }
                    Err(e) => {
                        cx.metrics.error("far_rtt_store");
                        cx.event(Event::ProbePublishFailed {
                            origin: probe.ticket.origin_geo.clone(),
                            account: probe.ticket.account.as_str().into(),
                            error: e,
                        });
                    }
                }
                let end = End::kick(KickReason::ProbeDone, format!("measured {min_ms:.1} ms"));
                self.end(cx, g, end);
            }
            // An answer for a phase the connection has left: too late to matter.
            _ => {}
        }
    }

    /// The client's cookie (empty: none): opened on the boards, or the login goes on without.
    fn on_cookie(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, cookie: Vec<u8>) {
        let Phase::Hint(login, step) = &mut self.phase else {
            return;
        };
        cx.timers.disarm(TimerKey::Deadline(self.id));
        if cookie.is_empty() {
            return self.open_waiting_session(cx, g);
        }
        *step = HintStep::OpeningCookie;
        let request = BoardRequest::OpenCookie {
            cookie,
            account: login.account.to_string(),
            ip: self.peer.ip(),
        };
        cx.emit(Output::Board {
            conn: self.id,
            request,
        });
    }

    /// The login that waited for its hint goes on to a gateway.
    fn open_waiting_session(&mut self, cx: &mut Cx<'_>, g: &mut Gateways) {
        if let Phase::Hint(login, _) = std::mem::replace(&mut self.phase, Phase::Ended) {
            self.open_session(cx, g, login);
        }
    }

    /// Picks a gateway, routes a new session id to this connection and asks the gateway to
    /// attach it. A new login is refused `SERVER_FULL` when every gateway up admits no new
    /// session; a session that moves was admitted already and goes wherever a link is up. A
    /// fallback gateway is picked only while no primary is up (see [`Gateways::pick`]).
    fn open_session(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, mut login: Login) {
        let new_login = login.moves == 0;
        let gateway = match g.pick(new_login) {
            Ok(gateway) => gateway,
            Err(NoGateway::Down) => {
                self.phase = Phase::Ended;
                lose(cx, InputLoss::SessionEnded, &login.pending);
                return self.finish(
                    cx,
                    End::kick(KickReason::GatewayUnavailable, "no gateway link is up"),
                );
            }
            Err(NoGateway::Full {
                retry_after_ms,
                detail,
            }) => {
                cx.metrics.logins_refused_server_full.inc();
                cx.event(Event::LoginRefusedFull {
                    account: login.account.clone(),
                    peer: self.peer,
                    retry_after_ms,
                });
                lose(cx, InputLoss::SessionEnded, &login.pending);
                self.phase = Phase::Ended;
                return self.finish(cx, End::Kick(Kick::server_full(detail, retry_after_ms)));
            }
        };
        let Some(session) = g.open_session(gateway, self.id) else {
            unreachable!("a gateway picked is up");
        };
        if g.is_fallback(gateway) {
            cx.metrics.sessions_fallen_back.inc();
            if g.fell_back() {
                cx.event(Event::FallbackInUse {
                    primaries_down: g.primaries(),
                    gateway: g.addr(gateway).to_string(),
                });
            }
        }
        if new_login {
            let addr = g.addr(gateway).to_string();
            self.traced(|t| t.gateway = Some(addr));
        }
        let attach = Attach {
            session_id: session,
            account: login.account.to_string(),
            remote_addr: self.peer.to_string(),
            moved: !new_login,
            handover: login.hint.take(),
            moved_from_epoch: login.epoch,
            // Every attach, a login's, a move's or a handover's: the gateway attaches nobody
            // without it.
            attestation: cellmesh_proto::attest::sign(
                cx.rings.attest.signing(),
                &login.account,
                session,
                cx.now.unix_ms,
            ),
        };
        cx.send_to_link(gateway, Body::Attach(attach), false);
        cx.timers.arm(
            TimerKey::Deadline(self.id),
            cx.now.ms() + cx.cfg.hello_timeout_ms,
        );
        self.phase = Phase::Attaching(
            login,
            Attaching {
                gateway,
                session,
                early: Vec::new(),
            },
        );
    }

    /// The gateway attached the session: `Welcome`, then the relay.
    pub(crate) fn on_attached(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, attached: Attached) {
        let Phase::Attaching(login, attaching) = std::mem::replace(&mut self.phase, Phase::Ended)
        else {
            cx.metrics.error("unexpected_message");
            return;
        };
        let mut login = login;
        let welcome = Welcome {
            version: Some(ProtocolVersion::current()),
            account: login.account.to_string(),
            session_id: attaching.session,
            session_epoch: attached.session_epoch,
            gateway_node: attached.gateway_node,
            world_width: attached.world_width,
            world_height: attached.world_height,
            chunk_size: attached.chunk_size,
        };
        let mut frames = vec![encode_body(&ServerFrame::one(
            server_message::Body::Welcome(welcome),
        ))];
        frames.extend(attaching.early);
        cx.emit(Output::ToClient {
            conn: self.id,
            frames,
        });
        // Logged in: the login's span ends (a session moved later has none).
        if let Some(mut trace) = self.trace.take() {
            trace.node = Some(attached.gateway_node);
            trace.session_epoch = Some(attached.session_epoch);
            trace.outcome = "attached";
            cx.emit(Output::LoginEnded {
                conn: self.id,
                trace,
            });
        }
        login.epoch = attached.session_epoch;
        cx.metrics.session_opened();
        cx.event(Event::SessionAttached {
            account: login.account.clone(),
            session: attaching.session,
            gateway: g.addr(attaching.gateway).to_string(),
            peer: self.peer,
        });
        let now = cx.now.ms();
        cx.timers.disarm(TimerKey::Deadline(self.id));
        cx.timers
            .arm(TimerKey::Ping(self.id), now + cx.cfg.ping_interval_ms);
        cx.timers
            .arm(TimerKey::Idle(self.id), now + idle_check_every(cx));
        if !cx.cfg.geos.single() {
            self.ask_probe_targets(cx, &login.account);
            cx.timers
                .arm(TimerKey::Probe(self.id), now + cx.cfg.geos.probe_every_ms);
        }
        let relay = Relay {
            info: SessionInfo {
                account: login.account.clone(),
                session_id: attaching.session,
                gateway: attaching.gateway,
                remote: self.peer,
                inputs_accepted: 0,
                inputs_dropped: 0,
                rtt: None,
                kernel_min_ms: None,
                session_epoch: attached.session_epoch,
                gateway_node: attached.gateway_node,
                world: (attached.world_width, attached.world_height),
                whereabouts: None,
                far_rtt: BTreeMap::new(),
            },
            pings: PingTracker::new(RTT_WINDOW),
            flood: FloodMeter::new(cx.cfg.rate.flood_kick_drops),
            last_heard_ms: now,
            transferring: false,
        };
        let pending = std::mem::take(&mut login.pending);
        self.phase = Phase::Relaying(login, Box::new(relay));
        self.relay(cx, g, pending, None);
    }

    /// A frame from the gateway for the client.
    pub(crate) fn on_to_client(&mut self, cx: &mut Cx<'_>, frame: Bytes) {
        match &mut self.phase {
            Phase::Attaching(_, a) => a.early.push(frame),
            Phase::Relaying(..) => cx.emit(Output::ToClient {
                conn: self.id,
                frames: vec![frame],
            }),
            _ => {}
        }
    }

    /// Where the gateway says the avatar is simulated now.
    pub(crate) fn set_where(&mut self, w: SessionWhere) {
        if let Phase::Relaying(_, r) = &mut self.phase {
            r.info.whereabouts = Some(w);
        }
    }

    /// The board's latest far figures for the client. They replace the previous ones whole: the
    /// board forgets a geo's figure once it expires, and so does the session.
    pub(crate) fn set_far_rtt(&mut self, far: &HashMap<String, RttFigure>) {
        if let Phase::Relaying(_, r) = &mut self.phase {
            r.info.far_rtt = far.iter().map(|(geo, f)| (geo.clone(), *f)).collect();
        }
    }

    /// The gateway ended the session (displaced, full, ...); it is unrouted already.
    pub(crate) fn on_detached(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, kick: Kick) {
        match &self.phase {
            Phase::Attaching(..) => {
                if kick.reason == KickReason::ServerFull as i32 {
                    // The gateway closed before this proxy heard: refused all the same.
                    cx.metrics.logins_refused_server_full.inc();
                }
                self.end(cx, g, End::Kick(kick));
            }
            Phase::Relaying(..) => self.end(cx, g, End::Kick(kick)),
            _ => {}
        }
    }

    /// The session's link ended: `end` is a move (the link broke) or a kick (shutdown).
    pub(crate) fn on_route_dropped(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, end: End) {
        let why = match end {
            End::GatewayLost(why) => why,
            other => return self.end(cx, g, other),
        };
        let login = match std::mem::replace(&mut self.phase, Phase::Ended) {
            Phase::Attaching(login, _) => login,
            Phase::Relaying(login, _) => {
                cx.metrics.session_closed();
                login
            }
            other => {
                self.phase = other;
                return;
            }
        };
        self.move_session(cx, g, login, why);
    }

    /// Whether the session is relayed through a fallback gateway (another geo's).
    pub(crate) fn on_fallback(&self, g: &Gateways) -> bool {
        matches!(&self.phase, Phase::Relaying(_, r) if g.is_fallback(r.info.gateway) && !r.transferring)
    }

    /// A gateway of this geo is back: the session moves home to it, the client connected. The
    /// fallback hears that a newer session displaced this one, so the avatar's leave waits for
    /// the newer session's join instead of letting the avatar go.
    pub(crate) fn return_home(&mut self, cx: &mut Cx<'_>, g: &mut Gateways) {
        if !self.on_fallback(g) {
            return;
        }
        let Phase::Relaying(login, relay) = std::mem::replace(&mut self.phase, Phase::Ended) else {
            unreachable!("a session on a fallback is relaying");
        };
        let displaced = End::kick(KickReason::Displaced, String::new());
        detach(cx, g, relay.info.gateway, relay.info.session_id, &displaced);
        cx.metrics.session_closed();
        cx.metrics.sessions_returned_home.inc();
        self.move_session(cx, g, login, "back to a gateway of this geo".into());
    }

    /// Moves the session to another gateway, now if one is up, or once one is.
    fn move_session(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, mut login: Login, why: String) {
        for key in [TimerKey::Ping, TimerKey::Idle, TimerKey::Probe] {
            cx.timers.disarm(key(self.id));
        }
        if login.moves == MAX_MOVES {
            lose(cx, InputLoss::SessionEnded, &login.pending);
            let end = End::kick(
                KickReason::GatewayUnavailable,
                format!("{why} (the session moved {MAX_MOVES} times already)"),
            );
            return self.finish(cx, end);
        }
        login.moves += 1;
        if g.any_up() {
            self.phase = Phase::Moving(login, why);
            return self.on_gateway_available(cx, g);
        }
        cx.timers.arm(
            TimerKey::Deadline(self.id),
            cx.now.ms() + cx.cfg.hello_timeout_ms,
        );
        self.phase = Phase::Moving(login, why);
    }

    /// A gateway link is up: a session waiting to move goes there.
    pub(crate) fn on_gateway_available(&mut self, cx: &mut Cx<'_>, g: &mut Gateways) {
        let Phase::Moving(login, why) = std::mem::replace(&mut self.phase, Phase::Ended) else {
            return;
        };
        cx.metrics.sessions_moved.inc();
        cx.event(Event::SessionMoving {
            account: login.account.clone(),
            why,
        });
        self.open_session(cx, g, login);
    }

    /// The client's writer queue is full: it stopped reading.
    pub(crate) fn on_stalled(&mut self, cx: &mut Cx<'_>, g: &mut Gateways) {
        if self.ended() {
            return;
        }
        cx.metrics.error("client_outbox_full");
        let end = End::kick(
            KickReason::SlowConsumer,
            format!(
                "{} frames queued for the client",
                cx.cfg.client_outbox_frames
            ),
        );
        self.end(cx, g, end);
    }

    /// The client's stream ended.
    pub(crate) fn on_client_end(
        &mut self,
        cx: &mut Cx<'_>,
        g: &mut Gateways,
        end: super::ClientEnd,
    ) {
        let end = match end {
            super::ClientEnd::Disconnected => End::Left("disconnected".into()),
            super::ClientEnd::Io(e) => {
                cx.metrics.error("io");
                End::Left(format!("read failed: {e}"))
            }
            super::ClientEnd::Malformed { kind, detail } => {
                cx.metrics.error(kind);
                End::malformed(detail)
            }
        };
        self.end(cx, g, end);
    }

    pub(crate) fn on_timer(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, key: TimerKey) {
        let now = cx.now.ms();
        match (key, &mut self.phase) {
            (TimerKey::Deadline(_), Phase::Hello) => {
                let end = End::kick(
                    KickReason::HelloTimeout,
                    format!("no ClientHello within {} ms", cx.cfg.hello_timeout_ms),
                );
                self.end(cx, g, end);
            }
            (TimerKey::Deadline(_), Phase::Hint(_, HintStep::AwaitingCookie)) => {
                // A client that keeps no cookies need not answer at all.
                self.on_cookie(cx, g, Vec::new());
            }
            (TimerKey::Deadline(_), Phase::Attaching(_, a)) => {
                let end = End::kick(
                    KickReason::GatewayUnavailable,
                    format!(
                        "gateway {} did not answer Attach within {} ms",
                        g.addr(a.gateway),
                        cx.cfg.hello_timeout_ms
                    ),
                );
                self.end(cx, g, end);
            }
            (TimerKey::Deadline(_), Phase::Moving(_, why)) => {
                let end = End::kick(
                    KickReason::GatewayUnavailable,
                    format!("{why}; no other gateway link is up"),
                );
                self.end(cx, g, end);
            }
            (TimerKey::Deadline(_), Phase::Probing(_)) => self.measured(cx, g),
            (TimerKey::Ping(_), Phase::Relaying(_, relay)) => {
                let nonce = rand::Rng::random(cx.rng);
                relay.pings.sent(nonce, cx.now.mono);
                cx.timers
                    .arm(TimerKey::Ping(self.id), now + cx.cfg.ping_interval_ms);
                self.send(cx, server_message::Body::Ping(Ping { nonce }));
            }
            (TimerKey::Ping(_), Phase::Probing(probe)) => {
                let nonce = rand::Rng::random(cx.rng);
                probe.pings.sent(nonce, cx.now.mono);
                probe.sent += 1;
                if probe.sent < PROBE_PINGS {
                    cx.timers
                        .arm(TimerKey::Ping(self.id), now + PROBE_INTERVAL_MS);
                } else {
                    cx.timers
                        .arm(TimerKey::Deadline(self.id), now + PROBE_LAST_WAIT_MS);
                }
                self.send(cx, server_message::Body::Ping(Ping { nonce }));
            }
            (TimerKey::Idle(_), Phase::Relaying(_, relay)) => {
                if now.saturating_sub(relay.last_heard_ms) >= cx.cfg.idle_timeout_ms {
                    let end = End::kick(
                        KickReason::Idle,
                        format!("no message for {} ms", cx.cfg.idle_timeout_ms),
                    );
                    return self.end(cx, g, end);
                }
                cx.timers
                    .arm(TimerKey::Idle(self.id), now + idle_check_every(cx));
            }
            (TimerKey::Probe(_), Phase::Relaying(login, _)) => {
                let account = login.account.clone();
                self.ask_probe_targets(cx, &account);
                cx.timers
                    .arm(TimerKey::Probe(self.id), now + cx.cfg.geos.probe_every_ms);
            }
            _ => {}
        }
    }

    fn ask_probe_targets(&self, cx: &mut Cx<'_>, account: &str) {
        cx.emit(Output::Board {
            conn: self.id,
            request: BoardRequest::ProbeTargets {
                account: account.to_string(),
                ip: self.peer.ip(),
            },
        });
    }

    /// Handles a frame's messages in order; if the session ends part way, the inputs left unread
    /// are counted as lost with it.
    fn relay(
        &mut self,
        cx: &mut Cx<'_>,
        g: &mut Gateways,
        messages: Vec<ClientMessage>,
        kernel_rtt: Option<KernelRtt>,
    ) {
        let mut messages = messages.into_iter();
        while let Some(m) = messages.next() {
            if let Err(end) = self.on_message(cx, m, kernel_rtt) {
                lose(cx, InputLoss::SessionEnded, messages.as_slice());
                return self.end(cx, g, end);
            }
        }
    }

    fn on_message(
        &mut self,
        cx: &mut Cx<'_>,
        m: ClientMessage,
        kernel_rtt: Option<KernelRtt>,
    ) -> Result<(), End> {
        use client_message::Body as C;
        let Phase::Relaying(login, relay) = &mut self.phase else {
            return Ok(());
        };
        let info = &mut relay.info;
        match m.body {
            Some(C::Input(input)) => match cx.limits.check(&login.account, self.peer.ip()) {
                Verdict::Accept => {
                    let msg = SessionInput {
                        session_id: info.session_id,
                        seq: input.seq,
                        payload: input.payload,
                    };
                    cx.metrics.inputs_accepted.inc();
                    info.inputs_accepted += 1;
                    cx.send_to_link(info.gateway, Body::Input(msg), true);
                }
                verdict => {
                    cx.metrics.dropped(verdict == Verdict::OverAccountRate);
                    info.inputs_dropped += 1;
                    if relay.flood.record_drop(cx.now.mono) {
                        let r = &cx.cfg.rate;
                        return Err(End::kick(
                            KickReason::Flood,
                            format!(
                                "{} inputs over the rate limit within 1 s (limits: {}/s per account, {}/s per address)",
                                r.flood_kick_drops, r.account_inputs_per_sec, r.address_inputs_per_sec()
                            ),
                        ));
                    }
                }
            },
            Some(C::Ping(p)) => {
                let pong = encode_body(&ServerFrame::one(server_message::Body::Pong(Pong {
                    nonce: p.nonce,
                })));
                cx.emit(Output::ToClient {
                    conn: self.id,
                    frames: vec![pong],
                });
            }
            Some(C::Pong(p)) => {
                if let Some(rtt) = relay.pings.pong(p.nonce, cx.now.mono) {
                    cx.metrics.rtt(self.id, rtt);
                    if let Some(sum) = relay.pings.summary() {
                        info.rtt = Some(sum);
                        if let Some(k) = kernel_rtt {
                            info.kernel_min_ms = Some(k.min_ms);
                        }
                        let rtt = SessionRtt {
                            session_id: info.session_id,
                            rtt_ms_p50: sum.p50_ms as f32,
                            rtt_ms_min: sum.min_ms as f32,
                            // In geo order (the map's), so equal figures encode the same.
                            far: info
                                .far_rtt
                                .iter()
                                .map(|(geo, f)| GeoRtt {
                                    geo: geo.clone(),
                                    rtt_ms_p50: f.median_ms as f32,
                                    rtt_ms_min: f.min_ms as f32,
                                })
                                .collect(),
                        };
                        // Advisory: dropped first when the link is busy.
                        cx.send_to_link(info.gateway, Body::Rtt(rtt), true);
                    }
                }
            }
            Some(C::Bye(_)) => return Err(End::Left("bye".into())),
            // An answer that came after the login stopped waiting for it: too late to matter.
            Some(C::Cookie(_)) => {}
            Some(C::Hello(_)) => {
                return Err(End::malformed("unexpected ClientHello: already logged in"))
            }
            None => {
                return Err(End::malformed(format!(
                    "expected ClientMessage, got {UNKNOWN_MESSAGE}"
                )))
            }
        }
        Ok(())
    }

    /// A probe's hello: checked, then pinged.
    fn start_probe(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, hello: &ClientHello) {
        let done = |detail: String| End::kick(KickReason::ProbeDone, detail);
        if let Err(kick) = crate::auth::check_version(hello) {
            return self.end(cx, g, End::Kick(kick));
        }
        if cx.cfg.geos.single() {
            cx.metrics.probe_refused("single_geo");
            return self.end(cx, g, done("this network has one geo".into()));
        }
        let opened = cellmesh_proto::ticket::open_ring(
            &cx.rings.cookie,
            &hello.probe_ticket,
            self.peer.ip(),
            cx.now.unix_ms,
        )
        .map_err(|e| e.to_string())
        .and_then(|t| {
            if t.target_geo != cx.cfg.geo {
                Err(format!("ticket for geo `{}`", t.target_geo))
            } else if !cx.cfg.geos.peers.iter().any(|p| p.name == t.origin_geo) {
                Err(format!("ticket from unknown geo `{}`", t.origin_geo))
            } else {
                Ok(t)
            }
        });
        let ticket = match opened {
            Ok(t) => t,
            Err(why) => {
                cx.metrics.probe_refused("bad_ticket");
                cx.event(Event::ProbeRefused {
                    peer: self.peer,
                    why: why.to_string(),
                });
                return self.end(cx, g, done(format!("probe refused: {why}")));
            }
        };
        cx.timers.disarm(TimerKey::Deadline(self.id));
        cx.timers.arm(TimerKey::Ping(self.id), cx.now.ms());
        // Its pongs are read with the hello's frame limit: a probe sends nothing larger.
        cx.emit(Output::AdmitFrames {
            conn: self.id,
            max_frame_bytes: cx.cfg.hello_max_frame_bytes,
        });
        self.phase = Phase::Probing(Box::new(Probe {
            ticket,
            pings: PingTracker::new(PROBE_PINGS as usize),
            sent: 0,
            step: ProbeStep::Pinging,
        }));
    }

    /// The probe's pings are done (or the last wait is over): the kernel's figure, if the
    /// config asks for it, then the figure published.
    fn measured(&mut self, cx: &mut Cx<'_>, g: &mut Gateways) {
        let Phase::Probing(probe) = &mut self.phase else {
            return;
        };
        if !matches!(probe.step, ProbeStep::Pinging) {
            return;
        }
        cx.timers.disarm(TimerKey::Ping(self.id));
        cx.timers.disarm(TimerKey::Deadline(self.id));
        if cx.cfg.geos.kernel_rtt {
            probe.step = ProbeStep::ReadingKernel;
            cx.emit(Output::ReadKernelRtt { conn: self.id });
            return;
        }
        self.on_kernel_rtt(cx, None);
        let _ = g;
    }

    /// The kernel's figures of a probe connection (the client's kernel answers, not the game).
    pub(crate) fn on_kernel_rtt(&mut self, cx: &mut Cx<'_>, kernel: Option<KernelRtt>) {
        let Phase::Probing(probe) = &mut self.phase else {
            return;
        };
        if matches!(probe.step, ProbeStep::Publishing(_)) {
            return;
        }
        let summary = probe.pings.summary();
        let rtt = match (kernel, summary) {
            (Some(k), s) => FarRtt {
                min_ms: k.min_ms,
                median_ms: s.map_or(k.smoothed_ms, |s| s.p50_ms),
                // Every ping the kernel sent was ACKed by the client's kernel, answered or not.
                samples: probe.sent,
                kernel: true,
                measured_unix_ms: cx.now.unix_ms,
            },
            (None, Some(s)) => FarRtt {
                min_ms: s.min_ms,
                median_ms: s.p50_ms,
                samples: s.samples as u32,
                kernel: false,
                measured_unix_ms: cx.now.unix_ms,
            },
            (None, None) => {
                cx.metrics.probe_refused("unanswered");
                let end = End::kick(KickReason::ProbeDone, "no pong, and no kernel figure");
                self.phase = Phase::Ended;
                return self.finish(cx, end);
            }
        };
        probe.step = ProbeStep::Publishing(rtt.min_ms);
        let request = BoardRequest::PublishFarRtt {
            origin: probe.ticket.origin_geo.clone(),
            account: probe.ticket.account.clone(),
            rtt,
        };
        cx.emit(Output::Board {
            conn: self.id,
            request,
        });
    }

    /// Starts a handover of the session: the boards seal the hint and make the `Transfer`.
    /// Returns false when the connection has no session, or is ending or handed over already.
    pub(crate) fn start_transfer(
        &mut self,
        cx: &mut Cx<'_>,
        geo: &str,
        because: HandoverCause,
    ) -> bool {
        let Phase::Relaying(_, relay) = &mut self.phase else {
            return false;
        };
        if relay.transferring {
            return false;
        }
        relay.transferring = true;
        let info = &relay.info;
        let hint = cellmesh_proto::cookie::HintCookie {
            nonce: rand::Rng::random(cx.rng),
            issued_unix_ms: cx.now.unix_ms,
            target_geo: geo.to_string(),
            gateway_node: info.gateway_node,
            account: info.account.to_string(),
            session_epoch: info.session_epoch,
            last_position: info
                .whereabouts
                .as_ref()
                .and_then(|w| w.position.as_ref())
                .map(|p| [p.x, p.y, p.z]),
        };
        cx.emit(Output::Board {
            conn: self.id,
            request: BoardRequest::Transfer {
                geo: geo.to_string(),
                hint,
                ip: self.peer.ip(),
                because,
            },
        });
        true
    }

    /// The boards made the `Transfer` (or could not): the session ends with it, or stays.
    pub(crate) fn finish_transfer(
        &mut self,
        cx: &mut Cx<'_>,
        g: &mut Gateways,
        result: Result<Transfer, String>,
        because: HandoverCause,
    ) -> bool {
        let Phase::Relaying(login, relay) = &mut self.phase else {
            return false;
        };
        relay.transferring = false;
        match result {
            Ok(t) => {
                cx.event(Event::HandingOver {
                    account: login.account.clone(),
                    geo: t.geo.clone(),
                    because,
                });
                self.end(cx, g, End::Transfer(t, because));
                true
            }
            Err(e) => {
                cx.event(Event::HandoverFailed {
                    account: login.account.clone(),
                    error: e,
                });
                false
            }
        }
    }

    /// Ends the connection: the session (if any) is unrouted and its gateway told, the client
    /// told why.
    pub(crate) fn end(&mut self, cx: &mut Cx<'_>, g: &mut Gateways, end: End) {
        match std::mem::replace(&mut self.phase, Phase::Ended) {
            Phase::Ended => return,
            Phase::Hint(login, _) | Phase::Moving(login, _) => {
                lose(cx, InputLoss::SessionEnded, &login.pending);
            }
            Phase::Attaching(login, a) => {
                lose(cx, InputLoss::SessionEnded, &login.pending);
                detach(cx, g, a.gateway, a.session, &end);
            }
            Phase::Relaying(_, relay) => {
                detach(cx, g, relay.info.gateway, relay.info.session_id, &end);
                cx.metrics.session_closed();
            }
            Phase::Hello | Phase::Probing(_) => {}
        }
        self.finish(cx, end);
    }

    /// Tells a kicked client why (or where to go), and closes.
    fn finish(&mut self, cx: &mut Cx<'_>, end: End) {
        self.phase = Phase::Ended;
        for key in [
            TimerKey::Deadline,
            TimerKey::Ping,
            TimerKey::Idle,
            TimerKey::Probe,
        ] {
            cx.timers.disarm(key(self.id));
        }
        // A login that ends here never got its session.
        if let Some(mut trace) = self.trace.take() {
            trace.outcome = end.outcome();
            if let End::Kick(k) = &end {
                let reason = KickReason::try_from(k.reason).unwrap_or(KickReason::KickUnspecified);
                trace.reason = Some(reason.as_str_name());
            }
            cx.emit(Output::LoginEnded {
                conn: self.id,
                trace,
            });
        }
        let last = match end {
            End::Kick(kick) => Some(kick_message(cx, self.peer, kick)),
            End::GatewayLost(why) => Some(kick_message(
                cx,
                self.peer,
                Kick::new(KickReason::GatewayUnavailable, why),
            )),
            End::Transfer(t, because) => {
                cx.metrics.transferred(&t.geo, because);
                cx.event(Event::ClientTransferred {
                    peer: self.peer,
                    geo: t.geo.clone(),
                    host: t.host.clone(),
                    port: t.port,
                });
                Some(server_message::Body::Transfer(t))
            }
            End::Left(why) => {
                cx.event(Event::ClientLeft {
                    peer: self.peer,
                    why: why.to_string(),
                });
                None
            }
        };
        cx.emit(Output::CloseClient {
            conn: self.id,
            last: last.map(|b| encode_body(&ServerFrame::one(b))),
        });
    }

    /// Notes something of the login under way for its span.
    fn traced(&mut self, f: impl FnOnce(&mut LoginTrace)) {
        if let Some(t) = &mut self.trace {
            f(t);
        }
    }

    fn send(&self, cx: &mut Cx<'_>, body: server_message::Body) {
        cx.emit(Output::ToClient {
            conn: self.id,
            frames: vec![encode_body(&ServerFrame::one(body))],
        });
    }

    /// The session's `/state` entry: (account, session id, JSON).
    pub(crate) fn session_json(&self, g: &Gateways) -> Option<(&str, u64, serde_json::Value)> {
        let info = self.session()?;
        let json = serde_json::json!({
            "account": &*info.account,
            "session_id": info.session_id,
            "gateway": g.addr(info.gateway),
            "fallback": g.is_fallback(info.gateway),
            "remote_addr": info.remote.to_string(),
            "rtt_ms_p50": info.rtt.map(|r| r.p50_ms),
            "rtt_ms_min": info.rtt.map(|r| r.min_ms),
            "kernel_rtt_ms_min": info.kernel_min_ms,
            "inputs_accepted": info.inputs_accepted,
            "inputs_dropped": info.inputs_dropped,
            "session_epoch": info.session_epoch,
            "gateway_node": info.gateway_node,
            "simulated_in": info.whereabouts.as_ref().map(|w| w.geo.clone()),
        });
        Some((&*info.account, info.session_id, json))
    }
}

/// Keeps a message sent while the login waits, up to [`WAITING_MAX_MESSAGES`].
fn keep_waiting(cx: &mut Cx<'_>, login: &mut Login, m: ClientMessage) {
    let inputs = inputs_in(std::slice::from_ref(&m));
    cx.metrics.inputs_received.inc_by(inputs);
    if login.pending.len() < WAITING_MAX_MESSAGES {
        login.pending.push(m);
    } else {
        cx.metrics.dropped_waiting.inc_by(inputs);
    }
}

/// Unroutes a session and, unless the gateway ended it, tells the gateway it is gone.
fn detach(cx: &mut Cx<'_>, g: &mut Gateways, gateway: GatewayId, session: u64, end: &End) {
    if !g.release(gateway, session) {
        return;
    }
    let (kick_reason, detail) = match end {
        End::Kick(k) => (k.reason as u32, k.detail.clone()),
        End::Transfer(t, _) => (
            KickReason::Transferred as u32,
            format!("handed over to geo {}", t.geo),
        ),
        End::Left(why) | End::GatewayLost(why) => (KickReason::KickUnspecified as u32, why.clone()),
    };
    let detach = Detach {
        session_id: session,
        kick_reason,
        detail,
        retry_after_ms: 0,
    };
    cx.send_to_link(gateway, Body::Detach(detach), false);
}

/// Counts a kick and makes it the client's last message.
fn kick_message(cx: &mut Cx<'_>, peer: SocketAddr, kick: Kick) -> server_message::Body {
    let reason = KickReason::try_from(kick.reason).unwrap_or(KickReason::KickUnspecified);
    cx.metrics.kick(reason);
    cx.event(Event::ClientKicked {
        peer,
        reason: reason.as_str_name(),
        detail: kick.detail.clone(),
    });
    server_message::Body::Kick(kick)
}

/// Counts the inputs among `messages` as lost for `why`.
fn lose(cx: &mut Cx<'_>, why: InputLoss, messages: &[ClientMessage]) {
    cx.metrics.lost(why, inputs_in(messages));
}

fn idle_check_every(cx: &Cx<'_>) -> u64 {
    (cx.cfg.idle_timeout_ms / 4).max(IDLE_CHECK_MIN_MS)
}

/// How many of `messages` are inputs.
pub(crate) fn inputs_in(messages: &[ClientMessage]) -> u64 {
    messages
        .iter()
        .filter(|m| matches!(m.body, Some(client_message::Body::Input(_))))
        .count() as u64
}

fn body_name(b: &client_message::Body) -> &'static str {
    use client_message::Body as C;
    match b {
        C::Hello(_) => "ClientHello",
        C::Input(_) => "ClientInput",
        C::Ping(_) => "Ping",
        C::Pong(_) => "Pong",
        C::Bye(_) => "Bye",
        C::Cookie(_) => "CookieResponse",
    }
}

/// A mesh message's name, for what a proxy has no use for.
pub(crate) fn mesh_body_name(b: &Body) -> &'static str {
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
