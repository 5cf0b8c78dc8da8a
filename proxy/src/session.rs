//! What a client task shares with the rest of the proxy: the ordered queue its link fills, an
//! out-of-band stop with a reason, and the figures `/state` shows.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cellmesh_proto::edge::{Kick, KickReason, Transfer};
use cellmesh_proto::mesh::{Attached, SessionWhere};
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use cellmesh_world::handover::RttFigure;

use crate::ping::RttSummary;
use crate::tcpinfo::KernelRtt;
use crate::HandoverCause;

/// What a gateway link delivers to one client task, in the order the gateway sent it.
#[derive(Debug)]
pub(crate) enum ToSession {
    Attached(Attached),
    /// An encoded edge `ServerFrame`, written to the client as it is.
    Frame(Bytes),
    /// The gateway ends the session (displaced, slow consumer, ...): kick the client.
    Detach(Kick),
    /// Where the session's avatar is simulated now.
    Where(SessionWhere),
}

/// Why a client task was stopped from outside.
#[derive(Debug, Clone)]
pub(crate) enum Stop {
    Kick(Kick),
    /// Handed over to another geo: the client gets the `Transfer`.
    Transfer(Transfer, HandoverCause),
}

/// Stops one client task from outside (slow consumer, link lost, shutdown, handover). The first
/// reason given wins; a stop without a reason is the proxy shutting down.
#[derive(Debug)]
pub(crate) struct SessionControl {
    stop: CancellationToken,
    why: Mutex<Option<Stop>>,
}

impl SessionControl {
    /// A control that also stops when `parent` is cancelled.
    pub(crate) fn new(parent: &CancellationToken) -> Arc<Self> {
        Arc::new(Self {
            stop: parent.child_token(),
            why: Mutex::new(None),
        })
    }

    pub(crate) fn kick(&self, kick: Kick) {
        self.why
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(Stop::Kick(kick));
        self.stop.cancel();
    }

    /// Ends the session with a `Transfer`, unless it is ending already; true if it will.
    pub(crate) fn transfer(&self, t: Transfer, because: HandoverCause) -> bool {
        let mut why = self.why.lock().unwrap_or_else(|p| p.into_inner());
        if why.is_some() || self.stop.is_cancelled() {
            return false;
        }
        *why = Some(Stop::Transfer(t, because));
        self.stop.cancel();
        true
    }

    /// Whether the task was told to stop, for any reason.
    pub(crate) fn stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Why the task was stopped (a bare stop is the proxy shutting down).
    pub(crate) fn stop_reason(&self) -> Stop {
        self.why
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| Stop::Kick(Kick::new(KickReason::Shutdown, "proxy shutting down")))
    }

    pub(crate) fn stopped(&self) -> WaitForCancellationFuture<'_> {
        self.stop.cancelled()
    }

    /// The kick given, if the task was kicked.
    pub(crate) fn kicked(&self) -> Option<Kick> {
        match &*self.why.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(Stop::Kick(k)) => Some(k.clone()),
            _ => None,
        }
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
    rtt_samples: AtomicU64,
    /// The kernel's lowest RTT of the connection (`TCP_INFO`), when it gives one.
    kernel_min_bits: AtomicU64,
    /// The gateway's session epoch and node, as `Attached` said.
    pub session_epoch: u64,
    pub gateway_node: u32,
    /// The world's width and height, as `Attached` said.
    pub world: (f64, f64),
    /// Where the gateway last said the avatar is simulated.
    pub whereabouts: Mutex<Option<SessionWhere>>,
    /// Stops the client task (a handover goes through it).
    pub control: Arc<SessionControl>,
}

impl SessionInfo {
    pub(crate) fn new(
        account: Arc<str>,
        session_id: u64,
        gateway: Arc<str>,
        remote: SocketAddr,
        attached: &Attached,
        control: Arc<SessionControl>,
    ) -> Self {
        Self {
            account,
            session_id,
            gateway,
            remote,
            session_epoch: attached.session_epoch,
            gateway_node: attached.gateway_node,
            world: (attached.world_width, attached.world_height),
            whereabouts: Mutex::new(None),
            control,
            inputs_accepted: AtomicU64::new(0),
            inputs_dropped: AtomicU64::new(0),
            rtt_p50_bits: AtomicU64::new(f64::NAN.to_bits()),
            rtt_min_bits: AtomicU64::new(f64::NAN.to_bits()),
            rtt_samples: AtomicU64::new(0),
            kernel_min_bits: AtomicU64::new(f64::NAN.to_bits()),
        }
    }

    pub(crate) fn set_rtt(&self, s: RttSummary, kernel: Option<KernelRtt>) {
        self.rtt_p50_bits
            .store(s.p50_ms.to_bits(), Ordering::Relaxed);
        self.rtt_min_bits
            .store(s.min_ms.to_bits(), Ordering::Relaxed);
        self.rtt_samples.store(s.samples as u64, Ordering::Relaxed);
        if let Some(k) = kernel {
            self.kernel_min_bits
                .store(k.min_ms.to_bits(), Ordering::Relaxed);
        }
    }

    /// This proxy's figure for the session, for the handover policy: the kernel's minimum where
    /// there is one (a client cannot bend it), else the timed pings' minimum.
    pub(crate) fn rtt_figure(&self) -> Option<RttFigure> {
        let get = |a: &AtomicU64| {
            let v = f64::from_bits(a.load(Ordering::Relaxed));
            (!v.is_nan()).then_some(v)
        };
        let median_ms = get(&self.rtt_p50_bits)?;
        let min_ms = get(&self.kernel_min_bits).or(get(&self.rtt_min_bits))?;
        Some(RttFigure {
            min_ms,
            median_ms,
            samples: self.rtt_samples.load(Ordering::Relaxed) as u32,
        })
    }

    pub(crate) fn set_where(&self, w: SessionWhere) {
        *self.whereabouts.lock().unwrap_or_else(|p| p.into_inner()) = Some(w);
    }

    pub(crate) fn whereabouts(&self) -> Option<SessionWhere> {
        self.whereabouts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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
            "kernel_rtt_ms_min": ms(&self.kernel_min_bits),
            "inputs_accepted": self.inputs_accepted.load(Ordering::Relaxed),
            "inputs_dropped": self.inputs_dropped.load(Ordering::Relaxed),
            "session_epoch": self.session_epoch,
            "gateway_node": self.gateway_node,
            "simulated_in": self.whereabouts().map(|w| w.geo),
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
        assert!(
            !a.transfer(Transfer::default(), HandoverCause::Operator),
            "already kicked"
        );
        assert_eq!(a.kicked().unwrap().reason, KickReason::SlowConsumer as i32);
        let b = SessionControl::new(&parent);
        assert!(b.transfer(Transfer::default(), HandoverCause::Operator));
        b.kick(Kick::new(KickReason::Idle, "late"));
        assert!(matches!(b.stop_reason(), Stop::Transfer(..)));
        assert!(b.kicked().is_none());
        let c = SessionControl::new(&parent);
        parent.cancel();
        assert!(c.stop.is_cancelled());
        let Stop::Kick(k) = c.stop_reason() else {
            panic!("a bare stop is a shutdown")
        };
        assert_eq!(k.reason, KickReason::Shutdown as i32);
    }
}
