//! The cellmesh geo-edge proxy (README.md#the-edge-clients-and-the-proxy): accepts player clients, checks their signed token,
//! rate-limits their input per account and per address, times its own pings, and attaches each
//! session to a gateway sidecar over one multiplexed mesh link per gateway.
//!
//! ```text
//! client ──edge──▶ listener ─▶ client task (one per connection) ──▶ link outbox ─▶ gateway
//!                                   ▲ bounded session outbox ◀── link reader ◀────┘
//! ```
//!
//! [`start`] binds the client listener and the admin server (`/live`, `/ready`, `/metrics`,
//! `/state`), dials the gateways, and runs until its shutdown token is cancelled. Then it drains:
//! readiness flips at once while everyone is still served for `drain_grace_ms`, so load balancers
//! stop sending players here; then the listener closes and each client is told
//! `Kick{RECONNECT}` at its own jittered moment within `drain_spread_ms`, so the other proxies
//! take them over gradually; then the links and the admin server stop.
//! [`ProxyHandle::stop_now`] cuts the drain short (everyone left gets `Kick{SHUTDOWN}` at once).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use anyhow::Context;
use cellmesh_admin::Admin;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

mod auth;
mod client;
pub use client::WAITING_MAX_MESSAGES;
pub mod config;
mod connlimit;
mod discovery;
mod gateway;
mod geo;
mod link;
mod listener;
mod metrics;
mod ping;
mod ratelimit;
mod session;
mod tcpinfo;

pub use config::{GeosConfig, PeerGeo, ProxyConfig, RateConfig};
pub use geo::Boards;
pub use link::LINK_SILENCE;
pub use metrics::INPUT_LOSS_REASONS;

use crate::connlimit::ConnectionLimits;
use crate::gateway::Gateways;
use crate::metrics::Metrics;
use crate::ratelimit::InputLimits;
use crate::session::{SessionControl, SessionInfo};

/// How often rate-limit buckets of departed clients are forgotten.
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(10);

/// A snapshot of the proxy's counters (for `cellmesh up` and tests).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyStats {
    pub sessions: u64,
    pub sessions_peak: u64,
    /// Sessions moved to another gateway after their gateway's link broke.
    pub sessions_moved: u64,
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

/// Handover records kept for [`ProxyHandle::take_handovers`]; the oldest go past this.
const HANDOVER_LOG: usize = 4096;

/// A running proxy.
pub struct ProxyHandle {
    pub client_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub admin: Arc<Admin>,
    shared: Arc<Shared>,
    join: JoinHandle<()>,
}

impl ProxyHandle {
    pub fn stats(&self) -> ProxyStats {
        self.shared.metrics.stats()
    }

    /// Ends a drain at once: every client left is kicked now (a second signal does this).
    pub fn stop_now(&self) {
        self.shared.clients_stop.cancel();
    }

    /// A token whose cancellation is [`Self::stop_now`], for use after [`Self::wait`] took the
    /// handle.
    pub fn stopper(&self) -> CancellationToken {
        self.shared.clients_stop.clone()
    }

    /// Hands `account`'s session over to `geo`'s proxies: the client gets `Transfer` with a
    /// signed cookie, the same hint goes to that geo's Redis, and the session ends here (its
    /// avatar waits for the login there). The handover policy decides this by itself; this is
    /// for operators and tests.
    pub async fn hand_over(&self, account: &str, geo: &str) -> Result<(), String> {
        self.shared.hand_over(account, geo).await
    }

    /// The handovers made since the last call, oldest first (at most the last 4,096).
    pub fn take_handovers(&self) -> Vec<HandoverRecord> {
        self.shared
            .handover_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect()
    }

    /// Waits until the proxy has shut down and all its tasks have ended.
    pub async fn wait(self) {
        if let Err(e) = self.join.await {
            tracing::error!(error = %e, "proxy supervisor failed");
        }
    }
}

/// State shared by the listener, the client tasks and the link tasks.
pub(crate) struct Shared {
    pub(crate) cfg: ProxyConfig,
    /// The login tokens' and attach attestations' key rings (the cookies' is the geos').
    pub(crate) rings: config::Rings,
    pub(crate) geos: geo::Geos,
    pub(crate) metrics: Metrics,
    pub(crate) limits: InputLimits,
    pub(crate) gateways: Gateways,
    pub(crate) connections: ConnectionLimits,
    /// Mutual TLS on the gateway links; none: plaintext.
    pub(crate) mesh_tls: Option<Arc<cellmesh_trust::MeshTls>>,
    /// TLS for clients (`client_tls`), when set.
    pub(crate) client_tls: Option<Arc<cellmesh_trust::EdgeTls>>,
    /// Stops every client task at once (each through its own child token).
    pub(crate) clients_stop: CancellationToken,
    /// Every client connection's control, so the drain can ask each to leave in its turn.
    clients: Mutex<HashMap<u64, Arc<SessionControl>>>,
    client_addr: SocketAddr,
    admin: Arc<Admin>,
    sessions: Mutex<HashMap<u64, Arc<SessionInfo>>>,
    next_connection: AtomicU64,
    draining: AtomicBool,
    /// Serialises readiness updates, so a link coming up cannot undo the drain's not-ready.
    readiness: Mutex<()>,
    handover_log: Mutex<std::collections::VecDeque<HandoverRecord>>,
}

impl Shared {
    pub(crate) fn next_connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn register_client(&self, connection: u64, control: Arc<SessionControl>) {
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(connection, control);
    }

    pub(crate) fn unregister_client(&self, connection: u64) {
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&connection);
    }

    /// The controls of every client connection open now.
    fn client_controls(&self) -> Vec<Arc<SessionControl>> {
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub(crate) fn register_session(&self, connection: u64, info: Arc<SessionInfo>) {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(connection, info);
        self.metrics.session_opened();
    }

    pub(crate) fn unregister_session(&self, connection: u64) {
        let removed = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&connection);
        if removed.is_some() {
            self.metrics.session_closed();
        }
    }

    /// Ready while not draining and at least one gateway link is up.
    pub(crate) fn refresh_ready(&self) {
        let _serial = self.readiness.lock().unwrap_or_else(|p| p.into_inner());
        let ready = !self.draining.load(Ordering::SeqCst) && self.gateways.any_up();
        self.admin.set_ready(ready);
    }

    /// See [`ProxyHandle::hand_over`].
    pub(crate) async fn hand_over(&self, account: &str, geo: &str) -> Result<(), String> {
        let info = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .find(|s| &*s.account == account)
            .cloned()
            .ok_or_else(|| format!("no session of `{account}` on this proxy"))?;
        self.hand_over_session(&info, geo, HandoverCause::Operator)
            .await
    }

    pub(crate) async fn hand_over_session(
        &self,
        info: &SessionInfo,
        geo: &str,
        because: HandoverCause,
    ) -> Result<(), String> {
        let account = &*info.account;
        if geo == self.geos.home() {
            return Err(format!("`{geo}` is this proxy's own geo"));
        }
        let hint = cellmesh_proto::cookie::HintCookie {
            nonce: rand::random(),
            issued_unix_ms: geo::now_unix_ms(),
            target_geo: geo.to_string(),
            gateway_node: info.gateway_node,
            account: account.to_string(),
            session_epoch: info.session_epoch,
            last_position: info
                .whereabouts()
                .and_then(|w| w.position)
                .map(|p| [p.x, p.y, p.z]),
        };
        let transfer = self
            .geos
            .transfer(geo, hint, info.remote.ip(), &self.metrics)
            .await?;
        if !info.control.transfer(transfer, because) {
            return Err(format!("the session of `{account}` is ending already"));
        }
        let mut log = self.handover_log.lock().unwrap_or_else(|p| p.into_inner());
        if log.len() == HANDOVER_LOG {
            log.pop_front();
        }
        log.push_back(HandoverRecord {
            unix_ms: geo::now_unix_ms(),
            account: account.to_string(),
            to_geo: geo.to_string(),
            because,
        });
        Ok(())
    }

    /// The gauge of gateways that admit no new session.
    pub(crate) fn refresh_admission(&self) {
        self.metrics
            .gateways_closed
            .set(self.gateways.closed() as i64);
    }

    fn state_json(&self) -> serde_json::Value {
        let cfg = &self.cfg;
        let mut sessions: Vec<Arc<SessionInfo>> = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        sessions.sort_by(|a, b| (&a.account, a.session_id).cmp(&(&b.account, b.session_id)));
        let (open_connections, open_addresses) = self.connections.open();
        serde_json::json!({
            "proxy": {
                "name": cfg.name,
                "geo": cfg.geo,
                "client_addr": self.client_addr.to_string(),
                "gateways": cfg.gateways,
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
            "ready": self.admin.is_ready(),
            "draining": self.draining.load(Ordering::SeqCst),
            "connections": {
                "open": open_connections,
                "addresses": open_addresses,
            },
            "links": self.gateways.links().iter().map(|l| l.to_json()).collect::<Vec<_>>(),
            "sessions": sessions.iter().map(|s| s.to_json()).collect::<Vec<_>>(),
            "stats": self.metrics.stats(),
        })
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
    let geos = geo::Geos::open(&cfg, boards.as_ref()).await?;
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
    let shared = Arc::new_cyclic(|me: &Weak<Shared>| {
        // The admin's state view holds the proxy weakly: the proxy owns the admin, not back.
        let me = me.clone();
        let admin = Admin::new(registry, move || {
            me.upgrade()
                .map_or(serde_json::Value::Null, |s| s.state_json())
        });
        admin.set_token(&cfg.admin_token);
        Shared {
            rings,
            geos,
            limits: InputLimits::new(&cfg.rate),
            gateways: Gateways::new(&cfg.gateways),
            connections: ConnectionLimits::new(
                cfg.max_connections,
                cfg.max_connections_per_address,
            ),
            mesh_tls,
            client_tls,
            clients_stop: CancellationToken::new(),
            clients: Mutex::default(),
            client_addr,
            admin,
            sessions: Mutex::default(),
            next_connection: AtomicU64::new(1),
            draining: AtomicBool::new(false),
            readiness: Mutex::new(()),
            handover_log: Mutex::default(),
            metrics,
            cfg,
        }
    });
    let admin_stop = CancellationToken::new();
    let admin_addr = cellmesh_admin::spawn(
        &shared.cfg.admin_listen,
        shared.admin.clone(),
        admin_stop.clone(),
    )
    .await
    .with_context(|| format!("binding admin_listen {}", shared.cfg.admin_listen))?;

    let background = TaskTracker::new();
    let background_stop = CancellationToken::new();
    if let Some(tls) = &shared.mesh_tls {
        background
            .spawn(tls.spawn_reloader(std::time::Duration::from_secs(5), background_stop.clone()));
    }
    if let Some(tls) = &shared.client_tls {
        background
            .spawn(tls.spawn_reloader(std::time::Duration::from_secs(5), background_stop.clone()));
    }
    for link in shared.gateways.links() {
        background.spawn(link::run(
            link.clone(),
            shared.clone(),
            background_stop.clone(),
        ));
    }
    background.spawn(housekeeping(shared.clone(), background_stop.clone()));
    if !shared.geos.single() {
        background.spawn(handover_loop(shared.clone(), background_stop.clone()));
    }
    let clients = TaskTracker::new();
    let accepting = CancellationToken::new();
    clients.spawn(listener::run(
        listener,
        shared.clone(),
        clients.clone(),
        accepting.clone(),
    ));
    tracing::info!(name = %shared.cfg.name, %client_addr, %admin_addr, gateways = ?shared.cfg.gateways, "proxy started");

    let join = tokio::spawn({
        let shared = shared.clone();
        async move {
            shutdown.cancelled().await;
            let (grace, spread) = (shared.cfg.drain_grace(), shared.cfg.drain_spread());
            tracing::info!(
                grace_ms = grace.as_millis() as u64,
                spread_ms = spread.as_millis() as u64,
                "proxy draining; a second signal stops at once"
            );
            shared.draining.store(true, Ordering::SeqCst);
            shared.refresh_ready();
            let now = shared.clients_stop.clone();
            tokio::select! {
                _ = now.cancelled() => {}
                _ = drain(&shared, &accepting, grace, spread) => {}
            }
            accepting.cancel();
            shared.clients_stop.cancel();
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
        admin: shared.admin.clone(),
        shared,
        join,
    })
}

/// Serves everyone for `grace`, stops accepting, then asks each client to reconnect at its own
/// jittered moment within `spread`, and waits for them to leave.
async fn drain(shared: &Shared, accepting: &CancellationToken, grace: Duration, spread: Duration) {
    tokio::time::sleep(grace).await;
    accepting.cancel();
    let mut clients = shared.client_controls();
    let start = tokio::time::Instant::now();
    let at = drain_schedule(clients.len(), spread, rand::random);
    // The map's order is arbitrary but not random: shuffle by sorting on a random key.
    let mut keyed: Vec<(u64, Arc<SessionControl>)> =
        clients.drain(..).map(|c| (rand::random(), c)).collect();
    keyed.sort_unstable_by_key(|(k, _)| *k);
    tracing::info!(
        clients = keyed.len(),
        "asking clients to reconnect elsewhere"
    );
    let reconnect = || {
        cellmesh_proto::edge::Kick::new(
            cellmesh_proto::edge::KickReason::Reconnect,
            "this proxy is draining: reconnect now, to the same address",
        )
    };
    for ((_, control), offset) in keyed.into_iter().zip(at) {
        tokio::time::sleep_until(start + offset).await;
        control.kick(reconnect());
    }
    // A connection accepted just before the listener closed may have registered since.
    loop {
        let left = shared.client_controls();
        if left.is_empty() {
            return;
        }
        for control in left.iter().filter(|c| !c.stopping()) {
            control.kick(reconnect());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// When each of `n` clients is asked to leave: one per slot of `spread / n`, at a random point
/// within its slot (`unit` draws from [0, 1)), so the rate stays even and no two proxies
/// draining together line their kicks up.
fn drain_schedule(n: usize, spread: Duration, mut unit: impl FnMut() -> f64) -> Vec<Duration> {
    if n == 0 {
        return Vec::new();
    }
    let slot = spread.as_secs_f64() / n as f64;
    (0..n)
        .map(|i| Duration::from_secs_f64(slot * (i as f64 + unit().clamp(0.0, 1.0))))
        .collect()
}

/// How often the handover policy looks at every session.
const HANDOVER_EVERY: Duration = Duration::from_secs(1);

/// The handover policy at work (README.md#geos-bridge-first-hand-over-later): every second, each session's whereabouts (from its
/// gateway) and RTT figures (this proxy's own, and what other geos' proxies measured and
/// published here) go through [`Handover::observe`]; a session it says is worth a reconnect is
/// handed over.
async fn handover_loop(shared: Arc<Shared>, stop: CancellationToken) {
    use cellmesh_world::geometry::{Pos, WorldShape};
    use cellmesh_world::handover::{GeoRtt, Handover, Verdict, Whereabouts};
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(HANDOVER_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut policy: Option<Handover<u64>> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let sessions: Vec<(u64, Arc<SessionInfo>)> = shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        let Some((_, first)) = sessions.first() else {
            continue;
        };
        let policy = policy.get_or_insert_with(|| {
            let world = WorldShape {
                width: first.world.0,
                height: first.world.1,
                ..WorldShape::default()
            };
            Handover::new(shared.cfg.geos.handover.clone(), world, shared.geos.home())
        });
        let now_ms = started.elapsed().as_millis() as u64;
        let home = shared.geos.home().to_string();
        for (conn, info) in &sessions {
            let Some(w) = info.whereabouts() else {
                continue;
            };
            let p = w.position.unwrap_or_default();
            let at = Whereabouts {
                geo: w.geo,
                region: w.region,
                pos: Pos { x: p.x, y: p.y },
            };
            let rtt = if at.geo == home {
                GeoRtt::default()
            } else {
                GeoRtt {
                    current: info.rtt_figure(),
                    far: shared.geos.far_rtts(&info.account).await,
                }
            };
            if let Verdict::HandOver { to_geo, because } = policy.observe(now_ms, conn, &at, &rtt) {
                match shared
                    .hand_over_session(info, &to_geo, because.into())
                    .await
                {
                    Ok(()) => {
                        tracing::info!(account = %info.account, geo = %to_geo, ?because, "handing the session over");
                        policy.forget(conn);
                    }
                    Err(e) => {
                        tracing::warn!(account = %info.account, geo = %to_geo, error = %e, "handover failed")
                    }
                }
            }
        }
        let live: std::collections::HashSet<u64> = sessions.iter().map(|(c, _)| *c).collect();
        policy.retain(|k| live.contains(k));
        shared.metrics.bridged_sessions.set(policy.bridged() as i64);
    }
}

async fn housekeeping(shared: Arc<Shared>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(HOUSEKEEPING_EVERY);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => shared.limits.forget_idle(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_schedule_spreads_evenly_with_jitter_inside_each_slot() {
        let spread = Duration::from_secs(10);
        let mut draws = [0.0, 0.5, 0.999, 0.25].into_iter().cycle();
        let at = drain_schedule(4, spread, || draws.next().unwrap());
        let ms: Vec<u128> = at.iter().map(|d| d.as_millis()).collect();
        assert_eq!(ms, [0, 3750, 7497, 8125]);
        assert!(at.windows(2).all(|w| w[0] <= w[1]), "in order: {ms:?}");
        assert!(at.iter().all(|d| *d < spread));
        assert!(drain_schedule(0, spread, || 0.5).is_empty());
        let zero = drain_schedule(3, Duration::ZERO, || 0.7);
        assert!(zero.iter().all(|d| d.is_zero()), "no spread: all at once");
    }
}
