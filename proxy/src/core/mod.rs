//! The proxy's decisions, with no I/O: the sans-IO shape of the sidecar's core (and of
//! quinn-proto). The driver feeds it what happened with [`ProxyCore::handle`]`(now, input)` —
//! a client connected or sent a frame, a gateway link came up, spoke or broke, a board answered —
//! takes what to do from [`ProxyCore::poll_output`] — frames for clients and gateways, board
//! requests, readiness — and wakes it at [`ProxyCore::poll_timeout`]. There is no socket, clock,
//! task or lock in here: one seed and one sequence of inputs make one run, in the simulator as in
//! the tests.
//!
//! - [`connection`]: one client connection's life as an explicit [`connection::Phase`]: the
//!   challenge, the hello and its token, the handover hint or cookie, the attach to a gateway,
//!   the relay, a move to another gateway when its link breaks, an RTT probe, the end.
//! - [`gateways`]: the gateway links' state, their sessions' routes, and the pick of a gateway.
//! - [`timers`]: every deadline and period as data.
//! - [`drain`]: leaving gracefully, clients asked to reconnect one by one.
//! - [`handover`]: the geo handover policy over the sessions, once a second.

pub(crate) mod connection;
mod drain;
mod events;
pub mod gateways;
mod handover;
#[cfg(test)]
mod tests;
pub mod timers;

use std::collections::{HashMap, VecDeque};
// Addresses are values here (`core::net`): the core never opens a socket.
use ::core::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::cookie::HintCookie;
use cellmesh_proto::edge::{ClientFrame, ProbeTarget, Transfer};
use cellmesh_proto::mesh::{mesh_message::Body, MeshMessage};
use cellmesh_stores::FarRtt;
use cellmesh_world::handover::RttFigure;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::config::{ProxyConfig, Rings};
use crate::metrics::Metrics;
use crate::ratelimit::CoreLimits;
pub use crate::tcpinfo::KernelRtt;
use crate::{HandoverCause, HandoverRecord};

use connection::{Connection, End};
pub use events::Event;
pub use gateways::{GatewayId, Gateways};
use timers::Timers;

/// A client connection, numbered by the driver (never reused).
pub type ConnId = u64;

/// The time as the driver reads it: a monotonic offset from the core's start (every duration,
/// deadline and RTT), and the wall clock (tokens, cookies, attestations).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Now {
    pub mono: Duration,
    pub unix_ms: u64,
}

impl Now {
    /// The monotonic time in milliseconds, as the timers keep it.
    pub fn ms(&self) -> u64 {
        self.mono.as_millis() as u64
    }
}

/// How a client's stream ended, as its reader saw it.
#[derive(Debug, Clone)]
pub enum ClientEnd {
    /// The client closed its side.
    Disconnected,
    /// Reading failed.
    Io(String),
    /// A frame the codec refused (too large, undecodable): `kind` is its error kind.
    Malformed { kind: &'static str, detail: String },
}

/// What the world tells the proxy's core.
#[derive(Debug)]
pub enum Input {
    /// A client connection was accepted, and its TLS handshake (if any) is done.
    ClientOpened { conn: ConnId, peer: SocketAddr },
    /// A frame from a client; `kernel_rtt` is the kernel's figure for the connection, read
    /// when the frame carries a `Pong` and the config asks for it.
    ClientFrame {
        conn: ConnId,
        frame: ClientFrame,
        kernel_rtt: Option<KernelRtt>,
    },
    /// A client's stream ended.
    ClientEnded { conn: ConnId, end: ClientEnd },
    /// A client's writer queue is full: it stopped reading.
    ClientStalled { conn: ConnId },
    /// The kernel's RTT figures of a probe connection, as asked for.
    KernelRtt {
        conn: ConnId,
        rtt: Option<KernelRtt>,
    },
    /// A link to a gateway is up (its `LinkHello` checked).
    LinkUp { gateway: GatewayId, node_id: u32 },
    /// A message from a gateway.
    LinkMessage {
        gateway: GatewayId,
        message: MeshMessage,
    },
    /// A gateway link ended: `error` says why; `None` is the proxy's own shutdown.
    LinkDown {
        gateway: GatewayId,
        error: Option<String>,
    },
    /// A board's answer to a request of a connection.
    Board { conn: ConnId, reply: BoardReply },
    /// Shut down gracefully (a first signal).
    Drain,
    /// Shut down now: everyone left is kicked at once (a second signal).
    StopNow,
    /// An operator hands `account`'s session over to `geo`.
    HandOver { account: String, geo: String },
    /// A timer the core asked for is due.
    Timer,
}

/// A request to the geos' boards (Redis) or DNS: the driver runs it with a timeout and answers
/// with [`Input::Board`].
#[derive(Debug, Clone)]
pub enum BoardRequest {
    /// Take the hint this geo's board holds for the account, and use its nonce.
    TakeHint { account: String, ip: IpAddr },
    /// Open the cookie the client offered, and use its nonce on this geo's board.
    OpenCookie {
        cookie: Vec<u8>,
        account: String,
        ip: IpAddr,
    },
    /// The targets a client of this geo is asked to probe (their proxies found by DNS).
    ProbeTargets { account: String, ip: IpAddr },
    /// Seal the hint, pin it on the target geo's board, and make the `Transfer`.
    Transfer {
        geo: String,
        hint: HintCookie,
        ip: IpAddr,
        because: HandoverCause,
    },
    /// Publish a probe's figure onto the origin geo's board.
    PublishFarRtt {
        origin: String,
        account: String,
        rtt: FarRtt,
    },
    /// What other geos' proxies measured to the account.
    FarRtts { account: String },
}

/// A board's answer.
#[derive(Debug, Clone)]
pub enum BoardReply {
    Hint(Option<HintCookie>),
    /// The cookie, or why it was refused (a counted kind).
    Cookie(Result<HintCookie, &'static str>),
    ProbeTargets(Vec<ProbeTarget>),
    Transfer(Result<Transfer, String>),
    Published(Result<(), String>),
    FarRtts(HashMap<String, RttFigure>),
}

/// What the core asks the driver to do.
#[derive(Debug)]
pub enum Output {
    /// Encoded `ServerFrame`s for a client, in order.
    ToClient { conn: ConnId, frames: Vec<Bytes> },
    /// The client's login was admitted: its frames may now be this large.
    AdmitFrames {
        conn: ConnId,
        max_frame_bytes: usize,
    },
    /// Write `last` (if any), close without a reset, and forget the connection.
    CloseClient { conn: ConnId, last: Option<Bytes> },
    /// Read the kernel's RTT figures of a connection, and answer with [`Input::KernelRtt`].
    ReadKernelRtt { conn: ConnId },
    /// A message for a gateway. `data` (inputs, RTT reports) may be dropped when the link is
    /// busy; control (attach, detach) has room of its own, and a link without even that is cut.
    ToLink {
        gateway: GatewayId,
        message: MeshMessage,
        data: bool,
    },
    /// A request for the boards; its answer comes back as [`Input::Board`] for `conn`.
    Board { conn: ConnId, request: BoardRequest },
    /// Whether load balancers should send players here.
    Ready(bool),
    /// Stop accepting connections (a drain reached its end of grace).
    StopAccepting,
    /// Every client has left after a drain: stop the links and the process.
    Stopped,
    /// A login began (its hello admitted or refused next): the driver opens its span.
    LoginStarted { conn: ConnId },
    /// The login ended (attached, or not): what its span says; the driver closes it.
    LoginEnded { conn: ConnId, trace: LoginTrace },
    /// A handover of `account`'s session (the policy's or an operator's) was made, or could
    /// not be.
    HandedOver {
        account: String,
        result: Result<HandoverRecord, String>,
    },
    /// Something that happened, for the log.
    Event(Event),
}

/// What a login's span says once it ended (`login` under `cellmesh::spans`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoginTrace {
    pub account: String,
    /// Where the handover hint came from: `hint` or `cookie`.
    pub handover: Option<&'static str>,
    pub gateway: Option<String>,
    pub node: Option<u32>,
    pub session_epoch: Option<u64>,
    /// `attached`, `refused`, `left`, `gateway_lost` or `transferred`.
    pub outcome: &'static str,
    /// The kick's reason, for a login refused.
    pub reason: Option<&'static str>,
}

/// What every connection's decisions share: the time, the config, the keys, the counters, the
/// rate limits, the timers and the outbox.
pub(crate) struct Cx<'a> {
    pub now: Now,
    pub cfg: &'a ProxyConfig,
    pub rings: &'a Rings,
    pub metrics: &'a Metrics,
    pub limits: &'a CoreLimits,
    pub timers: &'a mut Timers<TimerKey>,
    pub out: &'a mut VecDeque<Output>,
    pub rng: &'a mut StdRng,
}

impl Cx<'_> {
    pub fn emit(&mut self, o: Output) {
        self.out.push_back(o);
    }

    pub fn event(&mut self, event: Event) {
        self.out.push_back(Output::Event(event));
    }

    pub fn send_to_link(&mut self, gateway: GatewayId, body: Body, data: bool) {
        self.out.push_back(Output::ToLink {
            gateway,
            message: body.into(),
            data,
        });
    }
}

/// Every timer of the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TimerKey {
    /// A connection's deadline of its phase: the hello, the cookie, the attach, a move, a probe.
    Deadline(ConnId),
    /// A connection's next ping (a session's, or a probe's).
    Ping(ConnId),
    /// A session's idleness check.
    Idle(ConnId),
    /// A session's next probe request to the other geos.
    Probe(ConnId),
    /// The drain's next step.
    Drain,
    /// The handover policy's next look at the sessions.
    Handover,
    /// Rate-limit buckets of departed clients are forgotten.
    Housekeeping,
    /// A gateway of this geo has been back long enough: the sessions on fallbacks move home.
    ReturnHome,
}

/// How often rate-limit buckets of departed clients are forgotten.
const HOUSEKEEPING_EVERY_MS: u64 = 10_000;

/// The proxy's state and decisions.
pub struct ProxyCore {
    cfg: Arc<ProxyConfig>,
    rings: Rings,
    /// The geos this proxy knows: empty on a single-geo network.
    peer_geos: Vec<String>,
    metrics: Arc<Metrics>,
    /// The rate limits, in the core's time.
    limits: CoreLimits,
    now: Now,
    conns: HashMap<ConnId, Connection>,
    gateways: Gateways,
    timers: Timers<TimerKey>,
    out: VecDeque<Output>,
    rng: StdRng,
    drain: drain::Drain,
    handover: handover::Policy,
    ready: Option<bool>,
}

impl ProxyCore {
    /// A core for `cfg` whose random choices (nonces, the drain's order) follow `seed`.
    pub(crate) fn new(
        cfg: Arc<ProxyConfig>,
        rings: Rings,
        metrics: Arc<Metrics>,
        seed: u64,
    ) -> Self {
        let limits = CoreLimits::new(&cfg.rate);
        let mut timers = Timers::default();
        timers.arm(TimerKey::Housekeeping, HOUSEKEEPING_EVERY_MS);
        let peer_geos = cfg.geos.peers.iter().map(|p| p.name.clone()).collect();
        if !cfg.geos.single() {
            timers.arm(TimerKey::Handover, handover::EVERY_MS);
        }
        let mut core = Self {
            gateways: Gateways::new(&cfg.gateways, &cfg.fallback_gateways),
            handover: handover::Policy::new(cfg.geos.handover.clone(), &cfg.geo),
            peer_geos,
            rings,
            metrics,
            limits,
            now: Now::default(),
            conns: HashMap::new(),
            timers,
            out: VecDeque::new(),
            rng: StdRng::seed_from_u64(seed),
            drain: drain::Drain::default(),
            ready: None,
            cfg,
        };
        core.refresh_ready();
        core
    }

    /// A core for `cfg` with its own counters, registered nowhere: what a driver in virtual
    /// time (the cluster simulator) runs, with the rings the config names.
    pub fn standalone(cfg: ProxyConfig, seed: u64) -> anyhow::Result<Self> {
        let rings = cfg.rings()?;
        let (metrics, _) = Metrics::new();
        Ok(Self::new(Arc::new(cfg), rings, Arc::new(metrics), seed))
    }

    #[cfg(test)]
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn single_geo(&self) -> bool {
        self.peer_geos.is_empty()
    }

    /// Draining: readiness is off and clients are (or will be) asked to leave.
    pub fn draining(&self) -> bool {
        self.drain.started()
    }

    /// Feeds the core one thing that happened at `now`.
    pub fn handle(&mut self, now: Now, input: Input) {
        self.advance(now);
        match input {
            Input::ClientOpened { conn, peer } => {
                let c = Connection::new(conn, peer, self.rng.random_nonce());
                self.conns.insert(conn, c);
                let kicking = self.drain.kicking();
                self.with_conn(conn, |c, cx, g| {
                    c.open(cx);
                    if kicking {
                        // Accepted just before the listener closed: asked to reconnect at once.
                        c.end(cx, g, drain::reconnect());
                    }
                });
            }
            Input::ClientFrame {
                conn,
                frame,
                kernel_rtt,
            } => self.with_conn(conn, |c, cx, g| c.on_frame(cx, g, frame, kernel_rtt)),
            Input::ClientEnded { conn, end } => {
                self.with_conn(conn, |c, cx, g| c.on_client_end(cx, g, end))
            }
            Input::ClientStalled { conn } => self.with_conn(conn, |c, cx, g| c.on_stalled(cx, g)),
            Input::KernelRtt { conn, rtt } => {
                self.with_conn(conn, |c, cx, _| c.on_kernel_rtt(cx, rtt))
            }
            Input::LinkUp { gateway, node_id } => self.on_link_up(gateway, node_id),
            Input::LinkMessage { gateway, message } => self.on_link_message(gateway, message),
            Input::LinkDown { gateway, error } => self.on_link_down(gateway, error),
            Input::Board { conn, reply } => self.on_board(conn, reply),
            Input::Drain => self.start_drain(),
            Input::StopNow => self.stop_now(),
            Input::HandOver { account, geo } => match self.session_of(&account) {
                Some(conn) => self.hand_over(conn, &geo, HandoverCause::Operator),
                None => self.out.push_back(Output::HandedOver {
                    result: Err(format!("no session of `{account}` on this proxy")),
                    account,
                }),
            },
            Input::Timer => self.on_timers(),
        }
        self.refresh_ready();
        self.metrics
            .sessions_on_fallback
            .set(self.gateways.sessions_on_fallback() as i64);
    }

    /// The next thing to do, if any.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// When the core wants [`Input::Timer`] (monotonic milliseconds), if at all.
    pub fn poll_timeout(&mut self) -> Option<u64> {
        self.timers.next_due()
    }

    /// Client connections open now.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    fn advance(&mut self, now: Now) {
        self.limits.advance_to(now.mono);
        self.now = Now {
            mono: now.mono.max(self.now.mono),
            unix_ms: now.unix_ms,
        };
    }

    /// Runs `f` on a live connection, and forgets it once it ended. The connection is borrowed
    /// in place, beside the context and the gateways: every message of a session passes here.
    fn with_conn(
        &mut self,
        conn: ConnId,
        f: impl FnOnce(&mut Connection, &mut Cx<'_>, &mut Gateways),
    ) {
        let Self {
            conns,
            gateways,
            now,
            cfg,
            rings,
            metrics,
            limits,
            timers,
            out,
            rng,
            drain,
            handover,
            ..
        } = self;
        let Some(c) = conns.get_mut(&conn) else {
            return;
        };
        let mut cx = Cx {
            now: *now,
            cfg,
            rings,
            metrics,
            limits,
            timers,
            out,
            rng,
        };
        f(c, &mut cx, gateways);
        if c.ended() {
            conns.remove(&conn);
            handover.forget(conn);
        }
        drain.check_done(conns, out);
    }

    fn on_link_up(&mut self, gateway: GatewayId, node_id: u32) {
        if gateway >= self.gateways.count() {
            return;
        }
        self.gateways.link_up(gateway, node_id);
        self.metrics
            .gateways_closed
            .set(self.gateways.closed() as i64);
        // A gateway of this geo is back: once it held, the sessions on fallbacks move home (a
        // link that drops and comes back starts the wait again).
        if !self.gateways.is_fallback(gateway)
            && self.cfg.fallback_return_ms > 0
            && self.gateways.sessions_on_fallback() > 0
        {
            self.timers.arm(
                TimerKey::ReturnHome,
                self.now.ms() + self.cfg.fallback_return_ms,
            );
        }
        // Sessions waiting for a gateway move there now.
        let waiting: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.waiting_for_a_gateway())
            .map(|(id, _)| *id)
            .collect();
        for conn in waiting {
            self.with_conn(conn, |c, cx, g| c.on_gateway_available(cx, g));
        }
    }

    fn on_link_down(&mut self, gateway: GatewayId, error: Option<String>) {
        let orphans = self.gateways.link_down(gateway);
        self.metrics
            .gateways_closed
            .set(self.gateways.closed() as i64);
        let addr = self.gateways.addr(gateway).to_string();
        if let Some(error) = &error {
            self.out.push_back(Output::Event(Event::LinkLost {
                gateway: addr.clone(),
                sessions: orphans.len(),
                error: error.clone(),
            }));
        }
        for (_, conn) in orphans {
            let end = match &error {
                // Each session moves to another gateway; the client stays connected.
                Some(_) => End::GatewayLost(format!("link to gateway {addr} lost")),
                None => End::kick(
                    cellmesh_proto::edge::KickReason::Shutdown,
                    format!("link to gateway {addr} closed: proxy shutting down"),
                ),
            };
            self.with_conn(conn, |c, cx, g| c.on_route_dropped(cx, g, end));
        }
    }

    fn on_link_message(&mut self, gateway: GatewayId, message: MeshMessage) {
        let Some(body) = message.body else {
            self.unexpected(gateway, "a MeshMessage of unknown type");
            return;
        };
        match body {
            Body::Heartbeat(_) => {}
            Body::Attached(a) => {
                let Some(conn) = self.gateways.route(gateway, a.session_id) else {
                    return;
                };
                self.with_conn(conn, |c, cx, g| c.on_attached(cx, g, a));
            }
            Body::ToClient(t) => {
                // A session that just ended: the gateway has not seen its `Detach` yet.
                let Some(conn) = self.gateways.route(gateway, t.session_id) else {
                    return;
                };
                self.with_conn(conn, |c, cx, _| c.on_to_client(cx, t.server_frame));
            }
            Body::Detach(d) => {
                // Unrouted first: the gateway already forgot the session, so no `Detach` goes
                // back.
                let Some(conn) = self.gateways.route(gateway, d.session_id) else {
                    return;
                };
                self.gateways.release(gateway, d.session_id);
                let kick = cellmesh_proto::edge::Kick {
                    reason: d.kick_reason as i32,
                    detail: d.detail,
                    retry_after_ms: d.retry_after_ms,
                };
                self.with_conn(conn, |c, cx, g| c.on_detached(cx, g, kick));
            }
            Body::Admission(a) => {
                let closed = (!a.open).then_some(gateways::Closed {
                    reason: a.reason,
                    retry_after_ms: a.retry_after_ms,
                });
                if self.gateways.set_admission(gateway, closed) {
                    let closed = self.gateways.admission(gateway).map(|c| c.reason.clone());
                    self.out.push_back(Output::Event(Event::GatewayAdmission {
                        gateway: self.gateways.addr(gateway).to_string(),
                        closed,
                    }));
                    self.metrics
                        .gateways_closed
                        .set(self.gateways.closed() as i64);
                }
            }
            Body::Where(w) => {
                if let Some(conn) = self.gateways.route(gateway, w.session_id) {
                    if let Some(c) = self.conns.get_mut(&conn) {
                        c.set_where(w);
                    }
                }
            }
            other => self.unexpected(gateway, connection::mesh_body_name(&other)),
        }
    }

    /// A well-framed message the proxy has no use for: counted and skipped, the link stays up.
    fn unexpected(&mut self, gateway: GatewayId, what: &'static str) {
        self.metrics.error("unexpected_message");
        self.out.push_back(Output::Event(Event::UnexpectedMessage {
            gateway: self.gateways.addr(gateway).to_string(),
            what,
        }));
    }

    fn on_board(&mut self, conn: ConnId, reply: BoardReply) {
        if let BoardReply::FarRtts(far) = reply {
            self.on_far_rtts(conn, far);
            return;
        }
        if let BoardReply::Transfer(result) = reply {
            self.on_transfer(conn, result);
            return;
        }
        self.with_conn(conn, |c, cx, g| c.on_board(cx, g, reply));
    }

    fn on_timers(&mut self) {
        for key in self.timers.expired(self.now.ms()) {
            match key {
                TimerKey::Deadline(conn)
                | TimerKey::Ping(conn)
                | TimerKey::Idle(conn)
                | TimerKey::Probe(conn) => {
                    self.with_conn(conn, |c, cx, g| c.on_timer(cx, g, key));
                }
                TimerKey::Drain => self.drain_step(),
                TimerKey::Handover => self.handover_tick(),
                TimerKey::ReturnHome => self.return_home(),
                TimerKey::Housekeeping => {
                    self.limits.forget_idle();
                    self.timers.arm(
                        TimerKey::Housekeeping,
                        self.now.ms() + HOUSEKEEPING_EVERY_MS,
                    );
                }
            }
        }
    }

    /// Moves every session on a fallback gateway to a gateway of this geo, if one is up.
    fn return_home(&mut self) {
        if self.gateways.primaries_up() == 0 {
            return;
        }
        let away: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.on_fallback(&self.gateways))
            .map(|(id, _)| *id)
            .collect();
        if away.is_empty() {
            return;
        }
        self.out.push_back(Output::Event(Event::ReturningHome {
            sessions: away.len(),
        }));
        for conn in away {
            self.with_conn(conn, |c, cx, g| c.return_home(cx, g));
        }
    }

    /// Ready while not draining and at least one gateway link is up, a fallback's included (its
    /// sessions are served all the same); said on each change.
    fn refresh_ready(&mut self) {
        let ready = !self.drain.started() && self.gateways.any_up();
        if self.ready != Some(ready) {
            self.ready = Some(ready);
            self.out.push_back(Output::Ready(ready));
        }
    }

    /// The connection serving `account`'s session, if any.
    fn session_of(&self, account: &str) -> Option<ConnId> {
        self.conns
            .iter()
            .filter(|(_, c)| c.session_account() == Some(account))
            .map(|(id, _)| *id)
            .min()
    }

    /// The `/state` view of the sessions, ordered by account.
    pub fn sessions_json(&self) -> Vec<serde_json::Value> {
        let mut v: Vec<(&str, u64, serde_json::Value)> = self
            .conns
            .values()
            .filter_map(|c| c.session_json(&self.gateways))
            .collect();
        v.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        v.into_iter().map(|(_, _, j)| j).collect()
    }

    /// The `/state` view of the links.
    pub fn links_json(&self) -> Vec<serde_json::Value> {
        (0..self.gateways.count())
            .map(|g| {
                let admission = self
                    .gateways
                    .is_up(g)
                    .then(|| match self.gateways.admission(g) {
                        None => serde_json::json!({ "open": true }),
                        Some(c) => serde_json::json!({
                            "open": false, "reason": c.reason, "retry_after_ms": c.retry_after_ms,
                        }),
                    });
                serde_json::json!({
                    "gateway": self.gateways.addr(g),
                    "fallback": self.gateways.is_fallback(g),
                    "up": self.gateways.is_up(g),
                    "node_id": self.gateways.node_id(g),
                    "sessions": self.gateways.sessions(g),
                    "admission": admission,
                })
            })
            .collect()
    }
}

/// Random values the core draws, from its seeded generator.
trait Draw {
    fn random_nonce(&mut self) -> [u8; connection::NONCE_LEN];
}

impl Draw for StdRng {
    fn random_nonce(&mut self) -> [u8; connection::NONCE_LEN] {
        use rand::Rng;
        self.random()
    }
}
