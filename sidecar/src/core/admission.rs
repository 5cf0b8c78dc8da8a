//! Whether this node takes new sessions (the policy is [`crate::model::admission`]): fed the
//! game's `Load` reports and the driver's word on proxy link outboxes, re-evaluated on the timer,
//! and told to every proxy link on each change (and to a proxy link that comes up while closed:
//! a proxy that never heard assumes open).

use cellmesh_proto::local;
use cellmesh_proto::mesh::{self, mesh_message};
use serde_json::json;

use super::*;
use crate::metrics::ReasonLabel;
use crate::model::admission::Change;

impl Core {
    /// The game's `Load` report.
    pub(crate) fn on_game_load(&mut self, l: &local::Load) {
        self.load
            .on_report(self.cx.now.mono_ms, l.tick_ms, l.budget_ms);
        self.refresh_load();
        let sessions = self.gateway.sessions.attached();
        let change = self
            .admission
            .on_load(self.cx.now.mono_ms, l.tick_ms, l.budget_ms, sessions);
        if matches!(change, Some(Change::Closed(_))) {
            tracing::warn!(
                tick_ms = l.tick_ms,
                budget_ms = l.budget_ms,
                "the game overruns its tick: new sessions are refused"
            );
        }
        self.admission_changed(change);
    }

    /// The game's smoothed load now (estimated from the reals it holds when it reports none),
    /// and its gauge.
    pub(crate) fn refresh_load(&mut self) -> f64 {
        let reals = self.table.len() - self.table.ghost_count();
        let load = self.load.load(self.cx.now.mono_ms, reals);
        self.cx.metrics.load.set(load);
        load
    }

    /// A link's outbox holds `frames` frames (the driver says so when it reaches the mark).
    /// Only proxy links count: they carry this node's client batches.
    pub(crate) fn on_link_backlog(&mut self, link: LinkId, frames: usize) {
        if self.mesh.links.get(&link).is_none_or(|l| l.peer.is_some()) {
            return;
        }
        let sessions = self.gateway.sessions.attached();
        let change = self
            .admission
            .on_outbox(self.cx.now.mono_ms, frames, sessions);
        if matches!(change, Some(Change::Closed(_))) {
            tracing::warn!(
                link,
                frames,
                "client batches queue up on a proxy link: new sessions are refused"
            );
        }
        self.admission_changed(change);
    }

    /// Whether a new session may attach; counted against the allowance since the last report.
    pub(crate) fn admit_login(&mut self) -> bool {
        // Those still attaching count: they are about to be held.
        let sessions = self.gateway.sessions.len();
        let (admitted, change) = self.admission.on_login(self.cx.now.mono_ms, sessions);
        self.admission_changed(change);
        if !admitted {
            self.cx.metrics.drop_msg("attach_refused_server_full", 1);
        }
        admitted
    }

    /// The answer to an attach refused for admission: the proxy kicks the client `SERVER_FULL`
    /// with the hint. It catches what the proxies sent before they heard the node closed.
    pub(crate) fn refusal(&self, session_id: u64) -> mesh_message::Body {
        let reason = self.admission.closed().map_or("", |(r, _)| r.as_str());
        mesh_message::Body::Detach(mesh::Detach {
            session_id,
            kick_reason: cellmesh_proto::edge::KickReason::ServerFull as u32,
            detail: format!(
                "the server is full: node {} admits no new session ({reason})",
                self.cx.config.node_id
            ),
            retry_after_ms: self.admission.retry_after_ms(),
        })
    }

    /// Reopens once calm long enough (on the timer).
    pub(crate) fn evaluate_admission(&mut self) {
        let change = self.admission.evaluate(self.cx.now.mono_ms);
        if change == Some(Change::Opened) {
            tracing::info!("calm again: new sessions are admitted");
        }
        self.admission_changed(change);
    }

    fn admission_changed(&mut self, change: Option<Change>) {
        let Some(change) = change else {
            return;
        };
        self.cx.dirty = true;
        if let Change::Closed(reason) = change {
            self.cx
                .metrics
                .admission_closings
                .get_or_create(&ReasonLabel {
                    reason: reason.as_str(),
                })
                .inc();
        }
        self.cx
            .metrics
            .admission_open
            .set(i64::from(self.admission.is_open()));
        let proxies: Vec<LinkId> = self
            .mesh
            .links
            .iter()
            .filter(|(_, l)| l.peer.is_none())
            .map(|(id, _)| *id)
            .collect();
        for link in proxies {
            self.cx.queue_for_link(link, self.admission_message());
        }
    }

    /// A proxy link came up: it hears the node is closed, if it is.
    pub(crate) fn tell_admission(&mut self, link: LinkId) {
        if !self.admission.is_open() {
            self.cx.queue_for_link(link, self.admission_message());
        }
    }

    fn admission_message(&self) -> mesh_message::Body {
        let closed = self.admission.closed();
        mesh_message::Body::Admission(mesh::Admission {
            open: closed.is_none(),
            reason: closed.map_or(String::new(), |(r, _)| r.as_str().to_string()),
            retry_after_ms: closed.map_or(0, |_| self.admission.retry_after_ms()),
        })
    }

    /// The decision as `/state` shows it.
    pub(crate) fn admission_state(&self) -> serde_json::Value {
        let now = self.cx.now.mono_ms;
        let closed = self.admission.closed();
        json!({
            "open": closed.is_none(),
            "reason": closed.map(|(r, _)| r.as_str()),
            "closed_for_ms": closed.map(|(_, since)| now.saturating_sub(since)),
            "load_share": self.admission.load_share(now),
            "ceiling": self.admission.ceiling(),
            "retry_after_ms": self.admission.retry_after_ms(),
        })
    }
}
