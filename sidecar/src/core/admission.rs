//! Whether this node takes new sessions (the policy is [`crate::model::admission`]): fed the
//! game's `Load` reports and the driver's word on proxy link outboxes, re-evaluated on the timer,
//! and told to every proxy link on each change (and to a proxy link that comes up while closed:
//! a proxy that never heard assumes open). The game's smoothed load, which the balancer reads
//! too, is measured here.

use cellmesh_proto::local;
use cellmesh_proto::mesh::{self, mesh_message};
use serde_json::json;

use super::context::Context;
use super::LinkId;
use crate::metrics::ReasonLabel;
pub(crate) use crate::model::admission::Change;
use crate::model::admission::{self as policy};
use crate::model::load::LoadMeter;

/// The admission part: the policy and the load it is fed.
pub(crate) struct Admission {
    policy: policy::Admission,
    /// The game's smoothed load, for the balancer and the policy.
    load: LoadMeter,
}

impl Admission {
    /// Open, as a node starts.
    pub(crate) fn new(cx: &Context) -> Self {
        cx.metrics.admission_open.set(1);
        Self {
            policy: policy::Admission::new(cx.config.admission.clone()),
            load: LoadMeter::new(cx.config.load.clone()),
        }
    }

    /// The game's `Load` report; `reals` the node holds, `attached` sessions.
    pub(crate) fn on_game_load(
        &mut self,
        cx: &mut Context,
        l: &local::Load,
        reals: usize,
        attached: usize,
    ) -> Option<Change> {
        let now = cx.now.mono_ms;
        self.load.on_report(now, l.tick_ms, l.budget_ms);
        self.refresh_load(cx, reals);
        let change = self.policy.on_load(now, l.tick_ms, l.budget_ms, attached);
        if matches!(change, Some(Change::Closed(_))) {
            tracing::warn!(
                tick_ms = l.tick_ms,
                budget_ms = l.budget_ms,
                "the game overruns its tick: new sessions are refused"
            );
        }
        change
    }

    /// The game's smoothed load now (estimated from the `reals` it holds when it reports none),
    /// and its gauge.
    pub(crate) fn refresh_load(&mut self, cx: &mut Context, reals: usize) -> f64 {
        let load = self.load.load(cx.now.mono_ms, reals);
        cx.metrics.load.set(load);
        load
    }

    /// A proxy link's outbox holds `frames` frames (the driver says so when it reaches the
    /// mark): it carries this node's client batches.
    pub(crate) fn on_proxy_backlog(
        &mut self,
        cx: &mut Context,
        link: LinkId,
        frames: usize,
        attached: usize,
    ) -> Option<Change> {
        let change = self.policy.on_outbox(cx.now.mono_ms, frames, attached);
        if matches!(change, Some(Change::Closed(_))) {
            tracing::warn!(
                link,
                frames,
                "client batches queue up on a proxy link: new sessions are refused"
            );
        }
        change
    }

    /// Whether a new session may attach, with `sessions` held or attaching; counted against
    /// the allowance since the last report.
    pub(crate) fn admit_login(
        &mut self,
        cx: &mut Context,
        sessions: usize,
    ) -> (bool, Option<Change>) {
        let (admitted, change) = self.policy.on_login(cx.now.mono_ms, sessions);
        if !admitted {
            cx.metrics.drop_msg("attach_refused_server_full", 1);
        }
        (admitted, change)
    }

    /// The answer to an attach refused for admission: the proxy kicks the client `SERVER_FULL`
    /// with the hint. It catches what the proxies sent before they heard the node closed.
    pub(crate) fn refusal(&self, cx: &Context, session_id: u64) -> mesh_message::Body {
        let reason = self.policy.closed().map_or("", |(r, _)| r.as_str());
        mesh_message::Body::Detach(mesh::Detach {
            session_id,
            kick_reason: cellmesh_proto::edge::KickReason::ServerFull as u32,
            detail: format!(
                "the server is full: node {} admits no new session ({reason})",
                cx.config.node_id
            ),
            retry_after_ms: self.policy.retry_after_ms(),
        })
    }

    /// Reopens once calm long enough (on the timer).
    pub(crate) fn evaluate(&mut self, cx: &Context) -> Option<Change> {
        let change = self.policy.evaluate(cx.now.mono_ms);
        if change == Some(Change::Opened) {
            tracing::info!("calm again: new sessions are admitted");
        }
        change
    }

    /// Counts a change and tells it to every proxy link.
    pub(crate) fn announce(
        &self,
        cx: &mut Context,
        change: Option<Change>,
        proxies: impl IntoIterator<Item = LinkId>,
    ) {
        let Some(change) = change else {
            return;
        };
        cx.dirty = true;
        if let Change::Closed(reason) = change {
            cx.metrics
                .admission_closings
                .get_or_create(&ReasonLabel {
                    reason: reason.as_str(),
                })
                .inc();
        }
        cx.metrics
            .admission_open
            .set(i64::from(self.policy.is_open()));
        for link in proxies {
            cx.queue_for_link(link, self.message());
        }
    }

    /// A proxy link came up: it hears the node is closed, if it is.
    pub(crate) fn tell(&self, cx: &mut Context, link: LinkId) {
        if !self.policy.is_open() {
            cx.queue_for_link(link, self.message());
        }
    }

    fn message(&self) -> mesh_message::Body {
        let closed = self.policy.closed();
        mesh_message::Body::Admission(mesh::Admission {
            open: closed.is_none(),
            reason: closed.map_or(String::new(), |(r, _)| r.as_str().to_string()),
            retry_after_ms: closed.map_or(0, |_| self.policy.retry_after_ms()),
        })
    }

    /// Why, and since when, new sessions are refused, if they are.
    #[cfg(test)]
    pub(crate) fn closed(&self) -> Option<(policy::Reason, u64)> {
        self.policy.closed()
    }

    /// The decision as `/state` shows it.
    pub(crate) fn state(&self, cx: &Context) -> serde_json::Value {
        let now = cx.now.mono_ms;
        let closed = self.policy.closed();
        json!({
            "open": closed.is_none(),
            "reason": closed.map(|(r, _)| r.as_str()),
            "closed_for_ms": closed.map(|(_, since)| now.saturating_sub(since)),
            "load_share": self.policy.load_share(now),
            "ceiling": self.policy.ceiling(),
            "retry_after_ms": self.policy.retry_after_ms(),
        })
    }

    /// The smoothed load as `/state` shows it.
    pub(crate) fn load_state(&self) -> serde_json::Value {
        json!({"smoothed": self.load.last(), "source": self.load.source()})
    }
}
