//! The proxy's Prometheus metrics and the cheap counters behind [`crate::ProxyStats`].
//!
//! Hot-path counters are resolved from their families once, at start, so counting a frame is one
//! atomic add and never a label lookup.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use cellmesh_proto::edge::KickReason;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::connlimit::Refusal;
use crate::ProxyStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TrafficLabels {
    peer: &'static str,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GatewayLabels {
    gateway: String,
}

/// Frames and bytes one way over one kind of peer.
#[derive(Clone, Default)]
pub(crate) struct Flow {
    frames: Counter,
    bytes: Counter,
}

impl Flow {
    /// Counts one frame whose body is `body_len` bytes (plus its length prefix).
    pub(crate) fn frame(&self, body_len: usize) {
        self.frames.inc();
        self.bytes.inc_by(body_len as u64 + 4);
    }
}

pub(crate) struct Metrics {
    pub connections: Gauge,
    pub connections_accepted: Counter,
    refused_total: Counter,
    refused_address: Counter,
    /// RTT reports not sent because the gateway link's outbox was full (they are advisory).
    pub rtt_reports_dropped: Counter,
    /// Sessions moved to another gateway after their gateway's link broke.
    pub sessions_moved: Counter,
    /// Sessions routed over fallback gateways' links now.
    pub sessions_on_fallback: Gauge,
    /// Sessions sent to a fallback gateway (a login's attach or a move) while no primary was up.
    pub sessions_fallen_back: Counter,
    /// Sessions moved from a fallback gateway back to a gateway of this geo.
    pub sessions_returned_home: Counter,
    pub client_in: Flow,
    pub client_out: Flow,
    pub link_in: Flow,
    pub link_out: Flow,
    errors: Family<KindLabels, Counter>,
    sessions: Gauge,
    sessions_peak: AtomicU64,
    pub inputs_accepted: Counter,
    /// Client inputs read from clients (each ends accepted, rate-limited or lost).
    pub inputs_received: Counter,
    lost: [Counter; INPUT_LOSS_REASONS.len()],
    /// Client inputs written to gateway links.
    pub inputs_written: Counter,
    /// Inputs written to link connections that have ended since: an upper bound on what those
    /// connections lost in flight.
    pub inputs_on_ended_links: Counter,
    dropped_account: Counter,
    dropped_address: Counter,
    /// Inputs past the cap on what a client may send while its login waits for its cookie.
    pub(crate) dropped_waiting: Counter,
    kicks: Family<ReasonLabels, Counter>,
    kicks_total: AtomicU64,
    rtt_seconds: Histogram,
    /// Exact RTT quantiles for [`ProxyStats`], sharded by connection so that pongs of different
    /// clients do not queue on one lock; merged when read.
    rtt: [Mutex<hdrhistogram::Histogram<u64>>; RTT_SHARDS],
    link_up: Family<GatewayLabels, Gauge>,
    /// Logins refused because no gateway admits a new session.
    pub logins_refused_server_full: Counter,
    /// Gateway links up whose node admits no new session.
    pub gateways_closed: Gauge,
    /// Logins that skipped the gateway's MongoDB read thanks to a handover hint, by source.
    pub hint_hits: Counter,
    pub cookie_hits: Counter,
    /// Hints and cookies refused (forged, expired, another address or account...), by reason.
    hints_refused: Family<KindLabels, Counter>,
    tokens_refused: Family<KindLabels, Counter>,
    /// `CookieRequest`s sent (multi-geo networks only).
    pub cookie_requests: Counter,
    /// `ProbeRequest`s sent to this proxy's clients, probes of other geos' clients measured
    /// here, and probes refused, by reason.
    pub probes_asked: Counter,
    pub probes_served: Counter,
    probes_refused: Family<ReasonLabels, Counter>,
    /// Sessions whose avatar is simulated in another geo now.
    pub bridged_sessions: Gauge,
    /// Sessions handed over to another geo, by target geo.
    transfers: Family<HandoverLabels, Counter>,
    transfers_total: AtomicU64,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandoverLabels {
    geo: String,
    because: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: &'static str,
}

/// Every reason the proxy loses a client input it read and did not rate-limit
/// (`inputs_lost_total{reason}`).
pub const INPUT_LOSS_REASONS: [&str; 3] = [
    // The gateway link's outbox was full: the input was dropped, the link and session kept.
    "link_full",
    // The gateway link had closed, or closed with the input still in its outbox.
    "link_closed",
    // The session ended while the rest of the client's frame was unread.
    "session_ended",
];

/// Why the proxy lost an input (see [`INPUT_LOSS_REASONS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InputLoss {
    LinkFull = 0,
    LinkClosed = 1,
    SessionEnded = 2,
}

/// Highest RTT the summary histogram tracks, in microseconds (one minute).
const RTT_MAX_US: u64 = 60_000_000;
const RTT_SHARDS: usize = 16;

fn rtt_histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, RTT_MAX_US, 3)
        .expect("static histogram bounds are valid")
}

impl Metrics {
    /// The metrics and the registry that exposes them.
    pub(crate) fn new() -> (Self, Registry) {
        let mut reg = Registry::with_prefix("cellmesh_proxy");
        let connections = Gauge::default();
        reg.register(
            "connections",
            "Client connections open",
            connections.clone(),
        );
        let connections_accepted = Counter::default();
        reg.register(
            "connections_accepted",
            "Client connections accepted",
            connections_accepted.clone(),
        );

        let refused = Family::<LimitLabels, Counter>::default();
        reg.register(
            "connections_refused",
            "Client connections refused by a connection limit (total or per address)",
            refused.clone(),
        );
        let rtt_reports_dropped = Counter::default();
        reg.register(
            "rtt_reports_dropped",
            "RTT reports not sent to the gateway because its link's outbox was full",
            rtt_reports_dropped.clone(),
        );

        let sessions_moved = Counter::default();
        reg.register(
            "sessions_moved",
            "Sessions moved to another gateway after their gateway's link broke (the client stays connected)",
            sessions_moved.clone(),
        );
        let sessions_on_fallback = Gauge::default();
        reg.register(
            "sessions_on_fallback",
            "Sessions routed over fallback gateways' links (another geo's gateways, used while none of this geo's is up)",
            sessions_on_fallback.clone(),
        );
        let sessions_fallen_back = Counter::default();
        reg.register(
            "sessions_fallen_back",
            "Sessions attached or moved to a fallback gateway because none of this geo's gateways was up",
            sessions_fallen_back.clone(),
        );
        let sessions_returned_home = Counter::default();
        reg.register(
            "sessions_returned_home",
            "Sessions moved from a fallback gateway back to a gateway of this geo once one had been back fallback_return_ms",
            sessions_returned_home.clone(),
        );

        let frames = Family::<TrafficLabels, Counter>::default();
        let bytes = Family::<TrafficLabels, Counter>::default();
        reg.register(
            "frames",
            "Frames by peer kind (client, gateway) and direction",
            frames.clone(),
        );
        reg.register(
            "bytes",
            "Bytes by peer kind (client, gateway) and direction",
            bytes.clone(),
        );
        let flow = |peer, direction| {
            let l = TrafficLabels { peer, direction };
            Flow {
                frames: frames.get_or_create_owned(&l),
                bytes: bytes.get_or_create_owned(&l),
            }
        };

        let errors = Family::<KindLabels, Counter>::default();
        reg.register("errors", "Errors by kind", errors.clone());
        let sessions = Gauge::default();
        reg.register(
            "sessions",
            "Client sessions attached to a gateway",
            sessions.clone(),
        );
        let inputs_accepted = Counter::default();
        reg.register(
            "inputs_accepted",
            "Client inputs relayed to the gateway",
            inputs_accepted.clone(),
        );
        let dropped = Family::<LimitLabels, Counter>::default();
        reg.register(
            "inputs_dropped",
            "Client inputs dropped by a rate limit",
            dropped.clone(),
        );
        let inputs_received = Counter::default();
        reg.register(
            "inputs_received",
            "Client inputs read from clients",
            inputs_received.clone(),
        );
        let inputs_lost = Family::<ReasonLabels, Counter>::default();
        reg.register(
            "inputs_lost",
            "Client inputs read and not relayed to the gateway, by reason (rate limits apart)",
            inputs_lost.clone(),
        );
        let inputs_written = Counter::default();
        reg.register(
            "inputs_written",
            "Client inputs written to gateway links",
            inputs_written.clone(),
        );
        let inputs_on_ended_links = Counter::default();
        reg.register(
            "inputs_on_ended_links",
            "Client inputs written to gateway link connections that have ended since (at most what they lost in flight)",
            inputs_on_ended_links.clone(),
        );
        let kicks = Family::<ReasonLabels, Counter>::default();
        reg.register("kicks", "Clients kicked, by reason", kicks.clone());
        let rtt_seconds = Histogram::new([
            0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
        ]);
        reg.register(
            "rtt_seconds",
            "Round-trip time measured by the proxy's pings, in seconds",
            rtt_seconds.clone(),
        );
        let link_up = Family::<GatewayLabels, Gauge>::default();
        reg.register(
            "link_up",
            "1 while the mesh link to the gateway is up",
            link_up.clone(),
        );

        let logins_refused = Family::<ReasonLabels, Counter>::default();
        reg.register(
            "logins_refused",
            "Authenticated logins refused, by reason (server_full: every gateway that is up admits no new session)",
            logins_refused.clone(),
        );
        let gateways_closed = Gauge::default();
        reg.register(
            "gateways_closed",
            "Gateway links up whose node says it admits no new session (tick overrun, outbox pressure)",
            gateways_closed.clone(),
        );

        let login_hints = Family::<SourceLabels, Counter>::default();
        reg.register(
            "login_hints",
            "Logins that found a handover hint and so skipped the gateway's MongoDB read, by source (hint: this geo's Redis; cookie: the client's)",
            login_hints.clone(),
        );
        let hints_refused = Family::<KindLabels, Counter>::default();
        reg.register(
            "login_hints_refused",
            "Handover hints and cookies refused at login, by reason (the login reads MongoDB instead)",
            hints_refused.clone(),
        );
        let cookie_requests = Counter::default();
        reg.register(
            "cookie_requests",
            "CookieRequests sent to clients at login (never on a single-geo network)",
            cookie_requests.clone(),
        );
        let transfers = Family::<HandoverLabels, Counter>::default();
        reg.register(
            "handovers",
            "Sessions handed over to another geo's proxies (Transfer sent), by target geo and cause (settled_crossing, max_bridge, operator)",
            transfers.clone(),
        );

        let probes_asked = Counter::default();
        reg.register(
            "probes_asked",
            "ProbeRequests sent to this proxy's clients (at login and every probe_every_ms)",
            probes_asked.clone(),
        );
        let probes_served = Counter::default();
        reg.register(
            "probes_served",
            "RTT probes of other geos' clients measured here and published to their geo",
            probes_served.clone(),
        );
        let probes_refused = Family::<ReasonLabels, Counter>::default();
        reg.register(
            "probes_refused",
            "RTT probes refused or unmeasured, by reason",
            probes_refused.clone(),
        );
        let bridged_sessions = Gauge::default();
        reg.register(
            "bridged_sessions",
            "Sessions whose avatar is simulated in another geo (input and view cross the geo link)",
            bridged_sessions.clone(),
        );
        let tokens_refused = Family::<KindLabels, Counter>::default();
        reg.register(
            "tokens_refused",
            "Login tokens refused, by kind (unknown_token_kid: signed under a key this proxy does not accept)",
            tokens_refused.clone(),
        );
        let metrics = Self {
            probes_asked,
            probes_served,
            probes_refused,
            bridged_sessions,
            hint_hits: login_hints.get_or_create_owned(&SourceLabels { source: "hint" }),
            cookie_hits: login_hints.get_or_create_owned(&SourceLabels { source: "cookie" }),
            hints_refused,
            tokens_refused,
            cookie_requests,
            transfers,
            transfers_total: AtomicU64::new(0),
            connections,
            connections_accepted,
            refused_total: refused.get_or_create_owned(&LimitLabels { limit: "total" }),
            refused_address: refused.get_or_create_owned(&LimitLabels { limit: "address" }),
            rtt_reports_dropped,
            sessions_moved,
            sessions_on_fallback,
            sessions_fallen_back,
            sessions_returned_home,
            client_in: flow("client", "in"),
            client_out: flow("client", "out"),
            link_in: flow("gateway", "in"),
            link_out: flow("gateway", "out"),
            errors,
            sessions,
            sessions_peak: AtomicU64::new(0),
            inputs_accepted,
            inputs_received,
            lost: INPUT_LOSS_REASONS
                .map(|reason| inputs_lost.get_or_create_owned(&ReasonLabels { reason })),
            inputs_written,
            inputs_on_ended_links,
            dropped_account: dropped.get_or_create_owned(&LimitLabels { limit: "account" }),
            dropped_address: dropped.get_or_create_owned(&LimitLabels { limit: "address" }),
            dropped_waiting: dropped.get_or_create_owned(&LimitLabels { limit: "waiting" }),
            kicks,
            kicks_total: AtomicU64::new(0),
            rtt_seconds,
            rtt: std::array::from_fn(|_| Mutex::new(rtt_histogram())),
            link_up,
            logins_refused_server_full: logins_refused.get_or_create_owned(&ReasonLabels {
                reason: "server_full",
            }),
            gateways_closed,
        };
        (metrics, reg)
    }

    pub(crate) fn probe_refused(&self, reason: &'static str) {
        self.probes_refused
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub(crate) fn token_refused(&self, kind: &'static str) {
        self.tokens_refused
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    pub(crate) fn hint_refused(&self, kind: &'static str) {
        self.hints_refused.get_or_create(&KindLabels { kind }).inc();
    }

    pub(crate) fn transferred(&self, geo: &str, because: crate::HandoverCause) {
        self.transfers
            .get_or_create(&HandoverLabels {
                geo: geo.to_string(),
                because: because.as_str(),
            })
            .inc();
        self.transfers_total.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabels { kind }).inc();
    }

    pub(crate) fn kick(&self, reason: KickReason) {
        let reason = reason.as_str_name();
        self.kicks.get_or_create(&ReasonLabels { reason }).inc();
        self.kicks_total.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn refused(&self, refusal: Refusal) {
        match refusal {
            Refusal::Total(_) => self.refused_total.inc(),
            Refusal::Address(_) => self.refused_address.inc(),
        };
    }

    pub(crate) fn dropped(&self, by_account: bool) {
        if by_account {
            self.dropped_account.inc();
        } else {
            self.dropped_address.inc();
        }
    }

    pub(crate) fn lost(&self, why: InputLoss, inputs: u64) {
        if inputs > 0 {
            self.lost[why as usize].inc_by(inputs);
        }
    }

    pub(crate) fn session_opened(&self) {
        let now = self.sessions.inc() + 1;
        self.sessions_peak
            .fetch_max(now.max(0) as u64, Ordering::Relaxed);
    }

    pub(crate) fn session_closed(&self) {
        self.sessions.dec();
    }

    /// Records one RTT measured on connection `connection`.
    pub(crate) fn rtt(&self, connection: u64, rtt: Duration) {
        self.rtt_seconds.observe(rtt.as_secs_f64());
        let us = (rtt.as_micros() as u64).clamp(1, RTT_MAX_US);
        self.rtt[connection as usize % RTT_SHARDS]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .saturating_record(us);
    }

    pub(crate) fn link_up(&self, gateway: &str, up: bool) {
        self.link_up
            .get_or_create(&GatewayLabels {
                gateway: gateway.to_string(),
            })
            .set(up as i64);
    }

    /// Every RTT measured so far, in microseconds.
    pub(crate) fn rtt_us(&self) -> hdrhistogram::Histogram<u64> {
        let mut h = rtt_histogram();
        for shard in &self.rtt {
            let shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            h.add(&*shard).expect("shards share their bounds");
        }
        h
    }

    pub(crate) fn stats(&self) -> ProxyStats {
        let (rtt_ms_p50, rtt_ms_p99, rtt_samples) = {
            let h = self.rtt_us();
            let ms = |q| h.value_at_quantile(q) as f64 / 1000.0;
            if h.is_empty() {
                (0.0, 0.0, 0)
            } else {
                (ms(0.5), ms(0.99), h.len())
            }
        };
        ProxyStats {
            sessions: self.sessions.get().max(0) as u64,
            sessions_peak: self.sessions_peak.load(Ordering::Relaxed),
            sessions_moved: self.sessions_moved.get(),
            sessions_on_fallback: self.sessions_on_fallback.get().max(0) as u64,
            sessions_fallen_back: self.sessions_fallen_back.get(),
            sessions_returned_home: self.sessions_returned_home.get(),
            connections_refused: self.refused_total.get() + self.refused_address.get(),
            rtt_reports_dropped: self.rtt_reports_dropped.get(),
            inputs_accepted: self.inputs_accepted.get(),
            inputs_dropped: self.dropped_account.get() + self.dropped_address.get(),
            inputs_received: self.inputs_received.get(),
            inputs_lost: INPUT_LOSS_REASONS
                .iter()
                .zip(&self.lost)
                .map(|(r, c)| (*r, c.get()))
                .filter(|(_, n)| *n > 0)
                .collect(),
            inputs_written: self.inputs_written.get(),
            inputs_on_ended_links: self.inputs_on_ended_links.get(),
            kicks: self.kicks_total.load(Ordering::Relaxed),
            rtt_ms_p50,
            rtt_ms_p99,
            rtt_samples,
            frames_in: self.client_in.frames.get(),
            frames_out: self.client_out.frames.get(),
            logins_refused: self.logins_refused_server_full.get(),
            gateways_closed: self.gateways_closed.get().max(0) as u64,
            hint_hits: self.hint_hits.get(),
            cookie_hits: self.cookie_hits.get(),
            cookie_requests: self.cookie_requests.get(),
            handovers: self.transfers_total.load(Ordering::Relaxed),
            bridged_sessions: self.bridged_sessions.get().max(0) as u64,
            probes_served: self.probes_served.get(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_follow_the_metrics() {
        let (m, reg) = Metrics::new();
        m.session_opened();
        m.session_opened();
        m.session_closed();
        m.dropped(true);
        m.dropped(false);
        m.kick(KickReason::Flood);
        for (connection, ms) in [10, 20, 30, 40, 1000].into_iter().enumerate() {
            m.rtt(connection as u64, Duration::from_millis(ms));
        }
        m.client_in.frame(10);
        m.lost(InputLoss::LinkClosed, 3);
        m.lost(InputLoss::SessionEnded, 0);
        let s = m.stats();
        assert_eq!(s.inputs_lost, [("link_closed", 3)].into_iter().collect());
        assert_eq!((s.sessions, s.sessions_peak), (1, 2));
        assert_eq!(
            (s.inputs_dropped, s.kicks, s.rtt_samples, s.frames_in),
            (2, 1, 5, 1)
        );
        assert!((s.rtt_ms_p50 - 30.0).abs() < 0.1, "{}", s.rtt_ms_p50);
        assert!((s.rtt_ms_p99 - 1000.0).abs() < 1.0, "{}", s.rtt_ms_p99);

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        for needle in [
            "cellmesh_proxy_kicks_total{reason=\"FLOOD\"} 1",
            "cellmesh_proxy_inputs_dropped_total{limit=\"address\"} 1",
            "cellmesh_proxy_bytes_total{peer=\"client\",direction=\"in\"} 14",
            "cellmesh_proxy_rtt_seconds_count 5",
            "cellmesh_proxy_rtt_seconds_bucket{le=\"0.035\"} 3",
            "cellmesh_proxy_inputs_lost_total{reason=\"link_closed\"} 3",
            "cellmesh_proxy_inputs_lost_total{reason=\"link_full\"} 0",
            "cellmesh_proxy_connections_refused_total{limit=\"address\"} 0",
            "cellmesh_proxy_logins_refused_total{reason=\"server_full\"} 0",
            "cellmesh_proxy_gateways_closed 0",
            "cellmesh_proxy_sessions_on_fallback 0",
            "cellmesh_proxy_sessions_fallen_back_total 0",
            "cellmesh_proxy_sessions_returned_home_total 0",
        ] {
            assert!(text.contains(needle), "missing {needle} in\n{text}");
        }
    }
}
