//! The driver: one task that owns the [`ProxyCore`], feeds it what the connection, link and
//! board tasks report with the time, wakes it when it asks, and carries out its outputs. Sends
//! never wait: a client whose queue is full is reported to the core (which kicks it); data for a
//! busy link is dropped and counted, and a link with no room even for session control is cut.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cellmesh_proto::mesh::{mesh_message::Body, MeshMessage};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::client::{ClientHandle, ClientOut};
use super::link::{LinkUp, CONTROL_RESERVE};
use super::{board, Io, Shared};
use crate::core::{ConnId, GatewayId, Input, LoginTrace, Now, Output, ProxyCore};
use crate::metrics::InputLoss;

/// What the tasks around the core report.
pub(crate) enum Event {
    /// A client connection, registered before any of its frames.
    ClientOpened {
        conn: ConnId,
        peer: std::net::SocketAddr,
        handle: ClientHandle,
    },
    /// A link is up: its outbox and its cut.
    LinkUp {
        g: GatewayId,
        node_id: u32,
        up: LinkUp,
    },
    Core(Input),
    /// An operator hands `account` over to `geo`; the answer once the transfer is made.
    HandOver {
        account: String,
        geo: String,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// `/state`, composed now.
    State(oneshot::Sender<serde_json::Value>),
}

/// How often the driver looks for links whose outbox stays full.
const STALL_CHECK_EVERY: Duration = Duration::from_millis(100);

/// A link that is up, as the driver sends to it.
struct Link {
    up: LinkUp,
    /// When data first found the outbox full, in the current streak.
    full_since: Option<Instant>,
}

pub(crate) struct Driver {
    core: ProxyCore,
    io: Arc<Io>,
    shared: Arc<Shared>,
    started: Instant,
    clients: HashMap<ConnId, ClientHandle>,
    links: Vec<Option<Link>>,
    /// Operator handovers waiting for their transfer, by account.
    handovers: HashMap<String, Vec<oneshot::Sender<Result<(), String>>>>,
    /// The span of each login under way (the core says what it records; the driver times it).
    logins: HashMap<ConnId, tracing::Span>,
    /// Inputs the outputs caused (a stalled client), fed back before the next event.
    again: VecDeque<Input>,
    accepting: CancellationToken,
}

impl Driver {
    pub(crate) fn new(
        core: ProxyCore,
        io: Arc<Io>,
        shared: Arc<Shared>,
        accepting: CancellationToken,
    ) -> Self {
        let links = io.cfg.all_gateways().map(|_| None).collect();
        Self {
            core,
            io,
            shared,
            started: Instant::now(),
            clients: HashMap::new(),
            links,
            handovers: HashMap::new(),
            logins: HashMap::new(),
            again: VecDeque::new(),
            accepting,
        }
    }

    fn now(&self) -> Now {
        Now {
            mono: self.started.elapsed(),
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }
    }

    /// Runs until the core says every client has gone after a drain. `shutdown` starts the
    /// drain; `stop_now` ends it at once.
    pub(crate) async fn run(
        mut self,
        mut events: mpsc::Receiver<Event>,
        shutdown: CancellationToken,
        stop_now: CancellationToken,
    ) {
        let mut stall_check = tokio::time::interval(STALL_CHECK_EVERY);
        stall_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let (mut draining, mut stopping) = (false, false);
        self.flush();
        loop {
            let wake = self
                .core
                .poll_timeout()
                .map(|ms| tokio::time::Instant::from_std(self.started + Duration::from_millis(ms)));
            tokio::select! {
                e = events.recv() => match e {
                    Some(e) => self.on_event(e),
                    None => return,
                },
                _ = async { match wake { Some(at) => tokio::time::sleep_until(at).await, None => std::future::pending().await } } => {
                    self.feed(Input::Timer);
                }
                _ = stall_check.tick() => self.check_stalls(),
                _ = shutdown.cancelled(), if !draining => {
                    draining = true;
                    self.feed(Input::Drain);
                }
                _ = stop_now.cancelled(), if !stopping => {
                    stopping = true;
                    self.feed(Input::Drain);
                    self.feed(Input::StopNow);
                }
            }
            if self.flush() {
                return;
            }
        }
    }

    fn feed(&mut self, input: Input) {
        let now = self.now();
        self.core.handle(now, input);
    }

    fn on_event(&mut self, e: Event) {
        match e {
            Event::ClientOpened { conn, peer, handle } => {
                self.clients.insert(conn, handle);
                self.feed(Input::ClientOpened { conn, peer });
            }
            Event::LinkUp { g, node_id, up } => {
                self.links[g] = Some(Link {
                    up,
                    full_since: None,
                });
                self.feed(Input::LinkUp {
                    gateway: g,
                    node_id,
                });
            }
            Event::Core(input) => {
                if let Input::LinkDown { gateway, .. } = &input {
                    self.links[*gateway] = None;
                }
                self.feed(input);
            }
            Event::HandOver {
                account,
                geo,
                reply,
            } => {
                self.handovers
                    .entry(account.clone())
                    .or_default()
                    .push(reply);
                self.feed(Input::HandOver { account, geo });
            }
            Event::State(reply) => {
                let _ = reply.send(self.state_json());
            }
        }
    }

    /// Carries out the core's outputs (and feeds back what they caused); true once the core
    /// says the proxy has stopped.
    fn flush(&mut self) -> bool {
        let mut stopped = false;
        loop {
            while let Some(o) = self.core.poll_output() {
                stopped |= self.carry_out(o);
            }
            match self.again.pop_front() {
                Some(input) => self.feed(input),
                None => return stopped,
            }
        }
    }

    fn carry_out(&mut self, o: Output) -> bool {
        match o {
            Output::ToClient { conn, frames } => {
                self.queue_for_client(conn, ClientOut::Frames(frames))
            }
            Output::ReadKernelRtt { conn } => self.queue_for_client(conn, ClientOut::ReadKernelRtt),
            Output::AdmitFrames {
                conn,
                max_frame_bytes,
            } => {
                if let Some(admit) = self.clients.get_mut(&conn).and_then(|c| c.admit.take()) {
                    let _ = admit.send(max_frame_bytes);
                }
            }
            Output::CloseClient { conn, last } => {
                self.logins.remove(&conn);
                if let Some(close) = self.clients.remove(&conn).and_then(|mut c| c.close.take()) {
                    let _ = close.send(last);
                }
            }
            Output::ToLink {
                gateway,
                message,
                data,
            } => self.queue_for_link(gateway, message, data),
            Output::Board { conn, request } => {
                let (geos, events) = (self.io.geos.clone(), self.io.events.clone());
                let metrics = self.io.metrics.clone();
                tokio::spawn(async move {
                    let reply = board::execute(&geos, request, &metrics).await;
                    let _ = events.send(Event::Core(Input::Board { conn, reply })).await;
                });
            }
            Output::LoginStarted { conn } => {
                let span = login_span(&self.io.cfg.name, &self.io.cfg.geo);
                self.logins.insert(conn, span);
            }
            Output::LoginEnded { conn, trace } => {
                if let Some(span) = self.logins.remove(&conn) {
                    record_login(&span, &trace);
                }
            }
            Output::Ready(ready) => self.shared.admin.set_ready(ready),
            Output::StopAccepting => self.accepting.cancel(),
            Output::Stopped => return true,
            Output::HandedOver { account, result } => {
                if let Ok(record) = &result {
                    self.shared.log_handover(record.clone());
                }
                let replies = self.handovers.remove(&account).unwrap_or_default();
                for reply in replies {
                    let _ = reply.send(result.as_ref().map(|_| ()).map_err(Clone::clone));
                }
            }
            Output::Event(event) => super::log::log(&event),
        }
        false
    }

    /// Queues for a client without waiting: a full queue means it stopped reading.
    fn queue_for_client(&mut self, conn: ConnId, out: ClientOut) {
        let Some(client) = self.clients.get(&conn) else {
            return;
        };
        match client.out.try_send(out) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(ClientOut::ReadKernelRtt)) => {
                self.again.push_back(Input::KernelRtt { conn, rtt: None });
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.again.push_back(Input::ClientStalled { conn });
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Queues for a gateway: data only while more than the control reserve is free; control
    /// in the reserve, and with no room even there the link is cut.
    fn queue_for_link(&mut self, g: GatewayId, message: MeshMessage, data: bool) {
        let is_input = matches!(message.body, Some(Body::Input(_)));
        let metrics = &self.io.metrics;
        let Some(link) = self.links.get_mut(g).and_then(Option::as_mut) else {
            if is_input {
                metrics.lost(InputLoss::LinkClosed, 1);
            }
            return;
        };
        if data {
            if link.up.outbox.capacity() <= CONTROL_RESERVE {
                link.full_since.get_or_insert_with(Instant::now);
                // A burst the link cannot take now costs this input, not the session: a
                // sustained stall cuts the link (and moves its sessions) by itself.
                if is_input {
                    metrics.lost(InputLoss::LinkFull, 1);
                } else {
                    metrics.rtt_reports_dropped.inc();
                }
                return;
            }
            link.full_since = None;
        }
        match link.up.outbox.try_send(message) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(m)) => {
                if matches!(m.body, Some(Body::Input(_))) {
                    metrics.lost(InputLoss::LinkClosed, 1);
                }
                metrics.error("link_outbox_full");
                let why = format!(
                    "outbox full ({} messages), even for session control: the gateway stopped reading",
                    self.io.cfg.link_outbox_frames + CONTROL_RESERVE
                );
                if let Some(cut) = link.up.cut.take() {
                    let _ = cut.send(why);
                }
            }
            Err(mpsc::error::TrySendError::Closed(m)) => {
                if matches!(m.body, Some(Body::Input(_))) {
                    metrics.lost(InputLoss::LinkClosed, 1);
                }
            }
        }
    }

    /// Cuts the links whose outbox has stayed full for `link_stall_ms`.
    fn check_stalls(&mut self) {
        let limit = self.io.cfg.link_stall();
        for link in self.links.iter_mut().flatten() {
            if link.up.outbox.capacity() > CONTROL_RESERVE {
                link.full_since = None;
                continue;
            }
            let Some(since) = link.full_since else {
                continue;
            };
            if since.elapsed() >= limit {
                if let Some(cut) = link.up.cut.take() {
                    self.io.metrics.error("link_outbox_full");
                    let why = format!(
                        "outbox full for {} ms: the gateway stopped reading",
                        since.elapsed().as_millis()
                    );
                    let _ = cut.send(why);
                }
            }
        }
    }

    fn state_json(&mut self) -> serde_json::Value {
        let cfg = &self.io.cfg;
        let links: Vec<serde_json::Value> = self
            .core
            .links_json()
            .into_iter()
            .zip(&self.io.link_status)
            .map(|(mut core, status)| {
                let status = status.lock().unwrap_or_else(|p| p.into_inner()).to_json();
                if let (Some(c), serde_json::Value::Object(s)) = (core.as_object_mut(), status) {
                    for (k, v) in s {
                        c.insert(k, v);
                    }
                }
                core
            })
            .collect();
        let (open_connections, open_addresses) = self.io.connections.open();
        serde_json::json!({
            "proxy": {
                "name": cfg.name,
                "geo": cfg.geo,
                "client_addr": self.shared.client_addr.to_string(),
                "gateways": cfg.gateways,
                "fallback_gateways": cfg.fallback_gateways,
                "hello_timeout_ms": cfg.hello_timeout_ms,
                "idle_timeout_ms": cfg.idle_timeout_ms,
                "ping_interval_ms": cfg.ping_interval_ms,
                "hello_max_frame_bytes": cfg.hello_max_frame_bytes,
                "client_max_frame_bytes": cfg.client_max_frame_bytes,
                "max_frame_bytes": cfg.max_frame_bytes,
                "max_connections": cfg.max_connections,
                "max_connections_per_address": cfg.max_connections_per_address,
                "client_outbox_frames": cfg.client_outbox_frames,
                "link_outbox_frames": cfg.link_outbox_frames,
                "link_stall_ms": cfg.link_stall_ms,
                "drain_grace_ms": cfg.drain_grace_ms,
                "drain_spread_ms": cfg.drain_spread_ms,
                "rate": cfg.rate,
                "default_token_secret": cfg.uses_default_secret(),
                "admin_token": cellmesh_admin::guard::shown_token(&cfg.admin_token),
                "geos": {
                    "single": cfg.geos.single(),
                    "peers": cfg.geos.peers.iter().map(|p| serde_json::json!({"name": p.name, "proxies": p.proxies})).collect::<Vec<_>>(),
                    "handover": cfg.geos.handover,
                },
            },
            "ready": self.shared.admin.is_ready(),
            "draining": self.core.draining(),
            "connections": {
                "open": open_connections,
                "addresses": open_addresses,
            },
            "links": links,
            "sessions": self.core.sessions_json(),
            "stats": self.io.metrics.stats(),
        })
    }
}

/// A login's span (`cellmesh::spans`, exported over OTLP when an endpoint is set): opened as the
/// hello arrives, its fields filled as the login ends.
fn login_span(proxy: &str, geo: &str) -> tracing::Span {
    use tracing::field::Empty;
    tracing::info_span!(
        target: cellmesh_admin::SPANS_TARGET,
        "login",
        proxy,
        geo,
        account = Empty,
        handover = Empty,
        gateway = Empty,
        node = Empty,
        session_epoch = Empty,
        outcome = Empty,
        reason = Empty,
    )
}

fn record_login(span: &tracing::Span, t: &LoginTrace) {
    if !t.account.is_empty() {
        span.record("account", t.account.as_str());
    }
    if let Some(h) = t.handover {
        span.record("handover", h);
    }
    if let Some(g) = &t.gateway {
        span.record("gateway", g.as_str());
    }
    if let Some(n) = t.node {
        span.record("node", i64::from(n));
    }
    if let Some(e) = t.session_epoch {
        span.record("session_epoch", i64::try_from(e).unwrap_or(i64::MAX));
    }
    span.record("outcome", t.outcome);
    if let Some(r) = t.reason {
        span.record("reason", r);
    }
}
