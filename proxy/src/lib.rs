//! The cellmesh geo-edge proxy (README.md#the-edge-clients-and-the-proxy): accepts player clients, checks their signed token,
//! rate-limits their input per account and per address, times its own pings, and attaches each
//! session to a gateway sidecar over one multiplexed mesh link per gateway.
//!
//! It has the sidecar's shape: [`core`] holds every decision with no I/O ([`core::ProxyCore`]:
//! `handle(now, input)`, `poll_output()`, `poll_timeout()`), and `io` is the only tokio code:
//! the listener, one task per client connection and per gateway link (their sockets and
//! codecs), the board tasks, and the driver that feeds the core and carries out its outputs.
//!
//! [`start`] binds the client listener and the admin server (`/live`, `/ready`, `/metrics`,
//! `/state`), dials the gateways, and runs until its shutdown token is cancelled. Then it drains:
//! readiness flips at once while everyone is still served for `drain_grace_ms`, so load balancers
//! stop sending players here; then the listener closes and each client is told
//! `Kick{RECONNECT}` at its own jittered moment within `drain_spread_ms`, so the other proxies
//! take them over gradually; then the links and the admin server stop.
//! [`ProxyHandle::stop_now`] cuts the drain short (everyone left gets `Kick{SHUTDOWN}` at once).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use cellmesh_admin::Admin;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod auth;
pub mod config;
mod connlimit;
pub mod core;
mod discovery;
mod geo;
mod io;
mod metrics;
mod ping;
mod ratelimit;
mod tcpinfo;

pub use config::{GeosConfig, PeerGeo, ProxyConfig, RateConfig};
pub use core::connection::WAITING_MAX_MESSAGES;
pub use geo::Boards;
pub use io::link::LINK_SILENCE;
pub use metrics::INPUT_LOSS_REASONS;

use crate::io::driver::{Driver, Event};
use crate::io::{Io, Shared};
use crate::metrics::Metrics;

/// A snapshot of the proxy's counters (for `cellmesh up` and tests).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyStats {
    pub sessions: u64,
    pub sessions_peak: u64,
    /// Sessions moved to another gateway after their gateway's link broke.
    pub sessions_moved: u64,
    /// Sessions routed over fallback gateways (another geo's) now.
    pub sessions_on_fallback: u64,
    /// Sessions attached or moved to a fallback gateway because no gateway of this geo was up.
    pub sessions_fallen_back: u64,
    /// Sessions moved from a fallback gateway back to a gateway of this geo.
    pub sessions_returned_home: u64,
    /// Connections refused by a connection limit.
    pub connections_refused: u64,
    /// RTT reports not sent because a gateway link's outbox was full.
    pub rtt_reports_dropped: u64,
    pub inputs_accepted: u64,
    /// Inputs dropped by a rate limit.
    pub inputs_dropped: u64,
    /// Inputs read from clients.
    pub inputs_received: u64,
    /// Inputs read and not relayed, by reason ([`INPUT_LOSS_REASONS`]); reasons with none left out.
    pub inputs_lost: std::collections::BTreeMap<&'static str, u64>,
    /// Inputs written to gateway links.
    pub inputs_written: u64,
    /// Inputs written to link connections that ended since (at most what they lost in flight).
    pub inputs_on_ended_links: u64,
    pub kicks: u64,
    pub rtt_ms_p50: f64,
    pub rtt_ms_p99: f64,
    pub rtt_samples: u64,
    /// Frames received from clients.
    pub frames_in: u64,
    /// Frames sent to clients.
    pub frames_out: u64,
    /// Logins refused `SERVER_FULL`: every gateway up admitted no new session.
    pub logins_refused: u64,
    /// Gateway links up whose node admits no new session now.
    pub gateways_closed: u64,
    /// Logins whose handover hint came from this geo's Redis, or from the client's cookie.
    pub hint_hits: u64,
    pub cookie_hits: u64,
    /// `CookieRequest`s sent (never on a single-geo network).
    pub cookie_requests: u64,
    /// Sessions handed over to another geo.
    pub handovers: u64,
    /// Sessions whose avatar is simulated in another geo now (bridged).
    pub bridged_sessions: u64,
    /// RTT probes of other geos' clients this proxy measured.
    pub probes_served: u64,
}

/// Why a session was handed over to another geo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HandoverCause {
    /// The policy: settled in the far geo, then crossed a region border there.
    SettledCrossing,
    /// The policy: bridged for `max_bridge_ms`.
    MaxBridge,
    /// [`ProxyHandle::hand_over`].
    Operator,
}

impl HandoverCause {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SettledCrossing => "settled_crossing",
            Self::MaxBridge => "max_bridge",
            Self::Operator => "operator",
        }
    }
}

impl From<cellmesh_world::handover::Because> for HandoverCause {
    fn from(b: cellmesh_world::handover::Because) -> Self {
        use cellmesh_world::handover::Because;
        match b {
            Because::SettledCrossing => Self::SettledCrossing,
            Because::MaxBridge => Self::MaxBridge,
        }
    }
}

/// One handover this proxy made: when (Unix ms), whose session, to which geo and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HandoverRecord {
    pub unix_ms: u64,
    pub account: String,
    pub to_geo: String,
    pub because: HandoverCause,
}

/// A running proxy.
pub struct ProxyHandle {
    pub client_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub admin: Arc<Admin>,
    metrics: Arc<Metrics>,
    shared: Arc<Shared>,
    events: mpsc::Sender<Event>,
    stop_now: CancellationToken,
    join: JoinHandle<()>,
}

/// Reads a proxy's RTT measurements while it runs, apart from its handle.
#[derive(Clone)]
pub struct RttReader(Arc<Metrics>);

impl RttReader {
    /// Every client RTT the proxy measured so far, in microseconds: subtract an earlier read
    /// for a window's.
    pub fn histogram(&self) -> hdrhistogram::Histogram<u64> {
        self.0.rtt_us()
    }
}

impl ProxyHandle {
    pub fn stats(&self) -> ProxyStats {
        self.metrics.stats()
    }

    pub fn rtt_reader(&self) -> RttReader {
        RttReader(self.metrics.clone())
    }

    /// Ends a drain at once: every client left is kicked now (a second signal does this).
    pub fn stop_now(&self) {
        self.stop_now.cancel();
    }

    /// A token whose cancellation is [`Self::stop_now`], for use after [`Self::wait`] took the
    /// handle.
    pub fn stopper(&self) -> CancellationToken {
        self.stop_now.clone()
    }

    /// Hands `account`'s session over to `geo`'s proxies: the client gets `Transfer` with a
    /// signed cookie, the same hint goes to that geo's Redis, and the session ends here (its
    /// avatar waits for the login there). The handover policy decides this by itself; this is
    /// for operators and tests.
    pub async fn hand_over(&self, account: &str, geo: &str) -> Result<(), String> {
        let (reply, answer) = oneshot::channel();
        let ask = Event::HandOver {
            account: account.to_string(),
            geo: geo.to_string(),
            reply,
        };
        self.events
            .send(ask)
            .await
            .map_err(|_| "the proxy has stopped".to_string())?;
        answer
            .await
            .map_err(|_| "the proxy has stopped".to_string())?
    }

    /// The handovers made since the last call, oldest first (at most the last 4,096).
    pub fn take_handovers(&self) -> Vec<HandoverRecord> {
        self.shared.take_handovers()
    }

    /// Waits until the proxy has shut down and all its tasks have ended.
    pub async fn wait(self) {
        if let Err(e) = self.join.await {
            tracing::error!(error = %e, "proxy supervisor failed");
        }
    }
}

/// Starts the proxy; it runs until `shutdown` is cancelled (then see [`ProxyHandle::wait`]).
pub async fn start(cfg: ProxyConfig, shutdown: CancellationToken) -> anyhow::Result<ProxyHandle> {
    start_with(cfg, shutdown, None).await
}

/// [`start`], with the geos' boards given rather than opened from the config (proxies of
/// several geos in one process sharing in-memory ones).
pub async fn start_with(
    cfg: ProxyConfig,
    shutdown: CancellationToken,
    boards: Option<Boards>,
) -> anyhow::Result<ProxyHandle> {
    cfg.validate()?;
    let rings = cfg.rings()?;
    let geos = Arc::new(geo::Geos::open(&cfg, boards.as_ref()).await?);
    let mesh_tls = if cfg.mesh_tls.enabled()? {
        let tls = cellmesh_trust::MeshTls::load(&cfg.mesh_tls)?;
        tls.own()
            .check_claim(cellmesh_trust::Role::Proxy, None, &cfg.geo)
            .map_err(|e| {
                anyhow::anyhow!(
                    "mesh_tls.cert {} is not this proxy's (geo {:?}): {e}",
                    cfg.mesh_tls.cert,
                    cfg.geo
                )
            })?;
        Some(tls)
    } else {
        None
    };
    let client_tls = if cfg.client_tls.enabled()? {
        Some(cellmesh_trust::EdgeTls::load(&cfg.client_tls)?)
    } else {
        None
    };
    if cfg.uses_default_secret() {
        // Allowed on loopback only (`validate` refuses it elsewhere), for trying things out.
        tracing::warn!(
            "token_secret is the built-in default: anyone here can sign a login; set token_secret (or CELLMESH_TOKEN_SECRET)"
        );
    }
    let listener = TcpListener::bind(&cfg.client_listen)
        .await
        .with_context(|| format!("binding client_listen {}", cfg.client_listen))?;
    let client_addr = listener.local_addr()?;

    let (metrics, registry) = Metrics::new();
    let metrics = Arc::new(metrics);
    let (events, events_rx) = mpsc::channel(io::EVENTS_QUEUED);
    let admin = Admin::new(registry, || serde_json::Value::Null);
    admin.set_token(&cfg.admin_token);
    {
        let events = events.clone();
        admin.set_state_async(move || {
            let events = events.clone();
            async move {
                let (reply, state) = oneshot::channel();
                if events.send(Event::State(reply)).await.is_err() {
                    return serde_json::Value::Null;
                }
                state.await.unwrap_or(serde_json::Value::Null)
            }
        });
    }
    let admin_stop = CancellationToken::new();
    let admin_addr = cellmesh_admin::spawn(&cfg.admin_listen, admin.clone(), admin_stop.clone())
        .await
        .with_context(|| format!("binding admin_listen {}", cfg.admin_listen))?;

    let core = core::ProxyCore::new(
        Arc::new(cfg.clone()),
        rings,
        metrics.clone(),
        rand::random(),
    );
    let io = Arc::new(Io::new(
        cfg,
        metrics.clone(),
        mesh_tls,
        client_tls,
        geos,
        events.clone(),
    ));
    let shared = Arc::new(Shared::new(admin.clone(), client_addr));

    let background = TaskTracker::new();
    let background_stop = CancellationToken::new();
    if let Some(tls) = &io.mesh_tls {
        background
            .spawn(tls.spawn_reloader(std::time::Duration::from_secs(5), background_stop.clone()));
    }
    if let Some(tls) = &io.client_tls {
        background
            .spawn(tls.spawn_reloader(std::time::Duration::from_secs(5), background_stop.clone()));
    }
    for (g, status) in io.link_status.iter().enumerate() {
        background.spawn(io::link::run(
            g,
            io.clone(),
            status.clone(),
            background_stop.clone(),
        ));
    }
    let clients = TaskTracker::new();
    let accepting = CancellationToken::new();
    clients.spawn(io::listener::run(
        listener,
        io.clone(),
        clients.clone(),
        accepting.clone(),
    ));
    tracing::info!(name = %io.cfg.name, %client_addr, %admin_addr, gateways = ?io.cfg.gateways, fallback_gateways = ?io.cfg.fallback_gateways, "proxy started");

    let stop_now = CancellationToken::new();
    let driver = Driver::new(core, io.clone(), shared.clone(), accepting.clone());
    let join = tokio::spawn({
        let stop_now = stop_now.clone();
        async move {
            driver.run(events_rx, shutdown, stop_now).await;
            accepting.cancel();
            clients.close();
            clients.wait().await;
            background_stop.cancel();
            background.close();
            background.wait().await;
            admin_stop.cancel();
            tracing::info!("proxy stopped");
        }
    });
    Ok(ProxyHandle {
        client_addr,
        admin_addr,
        admin,
        metrics,
        shared,
        events,
        stop_now,
        join,
    })
}
