//! What a client task shares with the rest of the proxy: the ordered queue its link fills, an
//! out-of-band stop with a reason, and the figures `/state` shows.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cellmesh_proto::edge::{Kick, KickReason};
use cellmesh_proto::mesh::Attached;
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::ping::RttSummary;

/// What a gateway link delivers to one client task, in the order the gateway sent it.
#[derive(Debug)]
pub(crate) enum ToSession {
    Attached(Attached),
    /// An encoded edge `ServerFrame`, written to the client as it is.
    Frame(Bytes),
    /// The gateway ends the session (displaced, slow consumer, ...): kick the client.
    Detach(Kick),
}

/// Stops one client task from outside (slow consumer, link lost, shutdown). The first reason
/// given wins; a stop without a reason is the proxy shutting down.
#[derive(Debug)]
pub(crate) struct SessionControl {
    stop: CancellationToken,
    kick: Mutex<Option<Kick>>,
}

impl SessionControl {
    /// A control that also stops when `parent` is cancelled.
    pub(crate) fn new(parent: &CancellationToken) -> Arc<Self> {
        Arc::new(Self {
            stop: parent.child_token(),
            kick: Mutex::new(None),
        })
    }

    pub(crate) fn kick(&self, kick: Kick) {
        self.kick
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(kick);
        self.stop.cancel();
    }

    pub(crate) fn stopped(&self) -> WaitForCancellationFuture<'_> {
        self.stop.cancelled()
    }

    /// The reason the task was stopped.
    pub(crate) fn reason(&self) -> Kick {
        self.kicked()
            .unwrap_or_else(|| Kick::new(KickReason::Shutdown, "proxy shutting down"))
    }

    /// The reason given, if any.
    pub(crate) fn kicked(&self) -> Option<Kick> {
        self.kick.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// How a link reaches one session.
#[derive(Debug, Clone)]
pub(crate) struct SessionRoute {
    pub outbox: mpsc::Sender<ToSession>,
    pub control: Arc<SessionControl>,
}

/// One attached session as `/state` shows it.
#[derive(Debug)]
pub(crate) struct SessionInfo {
    pub account: Arc<str>,
    pub session_id: u64,
    pub gateway: Arc<str>,
    pub remote: SocketAddr,
    pub inputs_accepted: AtomicU64,
    pub inputs_dropped: AtomicU64,
    rtt_p50_bits: AtomicU64,
    rtt_min_bits: AtomicU64,
}

impl SessionInfo {
    pub(crate) fn new(
        account: Arc<str>,
        session_id: u64,
        gateway: Arc<str>,
        remote: SocketAddr,
    ) -> Self {
        Self {
            account,
            session_id,
            gateway,
            remote,
            inputs_accepted: AtomicU64::new(0),
            inputs_dropped: AtomicU64::new(0),
            rtt_p50_bits: AtomicU64::new(f64::NAN.to_bits()),
            rtt_min_bits: AtomicU64::new(f64::NAN.to_bits()),
        }
    }

    pub(crate) fn set_rtt(&self, s: RttSummary) {
        self.rtt_p50_bits
            .store(s.p50_ms.to_bits(), Ordering::Relaxed);
        self.rtt_min_bits
            .store(s.min_ms.to_bits(), Ordering::Relaxed);
    }

    pub(crate) fn to_json(&self) -> serde_json::Value {
        let ms = |bits: &AtomicU64| {
            let v = f64::from_bits(bits.load(Ordering::Relaxed));
            (!v.is_nan()).then_some(v)
        };
        serde_json::json!({
            "account": &*self.account,
            "session_id": self.session_id,
            "gateway": &*self.gateway,
            "remote_addr": self.remote.to_string(),
            "rtt_ms_p50": ms(&self.rtt_p50_bits),
            "rtt_ms_min": ms(&self.rtt_min_bits),
            "inputs_accepted": self.inputs_accepted.load(Ordering::Relaxed),
            "inputs_dropped": self.inputs_dropped.load(Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins_and_bare_stop_means_shutdown() {
        let parent = CancellationToken::new();
        let a = SessionControl::new(&parent);
        a.kick(Kick::new(KickReason::SlowConsumer, "queue full"));
        a.kick(Kick::new(KickReason::GatewayUnavailable, "link lost"));
        assert_eq!(a.reason().reason, KickReason::SlowConsumer as i32);
        let b = SessionControl::new(&parent);
        parent.cancel();
        assert!(b.stop.is_cancelled());
        assert_eq!(b.reason().reason, KickReason::Shutdown as i32);
    }
}
