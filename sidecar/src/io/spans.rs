//! The spans of a node's handoffs and of the entity commands it sends to other nodes, told from
//! what the driver carries: a `handoff` opens when an offer leaves for a peer and closes when its
//! ack or refusal comes back; an `entity_command` opens when a command of this node's game
//! leaves for a peer and closes when its result comes back. The core stays as it is: these are
//! only the frames it already sends and receives.
//!
//! Under [`cellmesh_admin::SPANS_TARGET`], exported when the process exports spans (see the
//! `telemetry` module of the `cellmesh` command); otherwise [`Spans`] is off and looks at
//! nothing.

use std::collections::HashMap;

use cellmesh_admin::SPANS_TARGET;
use cellmesh_proto::local::CommandError;
use cellmesh_proto::mesh::{mesh_message::Body, LinkHello, MeshMessage, PeerRole};
use cellmesh_world::partition::NodeId;
use tracing::field::Empty;
use tracing::Span;

use crate::core::commands::result_label;
use crate::core::LinkId;

/// A handoff unanswered this long is closed as `unanswered` (its target died with it in doubt,
/// or the answer went to a successor this node never heard from).
const HANDOFF_SPAN_MAX_MS: u64 = 30_000;
/// Spans kept open at once, of each kind; past that new ones are not recorded.
const MAX_OPEN: usize = 10_000;
/// How often open spans are checked for their deadline.
const SWEEP_EVERY_MS: u64 = 500;

struct Open {
    span: Span,
    deadline_ms: u64,
    /// Offers of the same handoff sent (a repeat to the same target, or to a successor).
    sent: u32,
}

/// The open spans of one node's driver.
pub(crate) struct Spans {
    /// Spans are exported: without it nothing is looked at.
    on: bool,
    node: NodeId,
    command_timeout_ms: u64,
    /// The peer node at the other end of each link (proxies are not there).
    peers: HashMap<LinkId, NodeId>,
    /// By (entity, epoch offered).
    handoffs: HashMap<(u64, u64), Open>,
    /// By (origin incarnation, request token).
    commands: HashMap<(u64, u64), Open>,
    next_sweep_ms: u64,
}

impl Spans {
    pub fn new(node: NodeId, command_timeout_ms: u64) -> Self {
        Self {
            on: tracing::enabled!(target: SPANS_TARGET, tracing::Level::INFO),
            node,
            command_timeout_ms,
            peers: HashMap::new(),
            handoffs: HashMap::new(),
            commands: HashMap::new(),
            next_sweep_ms: 0,
        }
    }

    /// Whether spans are exported (else every call here returns at once).
    pub fn on(&self) -> bool {
        self.on
    }

    pub fn link_up(&mut self, link: LinkId, hello: &LinkHello) {
        if self.on && hello.role == PeerRole::Sidecar as i32 {
            self.peers.insert(link, hello.node_id);
        }
    }

    pub fn link_closed(&mut self, link: LinkId) {
        if self.on {
            self.peers.remove(&link);
        }
    }

    /// A frame leaving on `link`.
    pub fn sent(&mut self, link: LinkId, messages: &[MeshMessage], now_ms: u64) {
        if !self.on {
            return;
        }
        for m in messages {
            match &m.body {
                Some(Body::HandoffOffer(o)) => self.offered(link, o, now_ms),
                Some(Body::EntityCommand(c)) if c.origin_node == self.node => {
                    self.command_sent(link, c, now_ms)
                }
                _ => {}
            }
        }
    }

    /// A frame that came in on a link.
    pub fn received(&mut self, messages: &[MeshMessage]) {
        if !self.on {
            return;
        }
        for m in messages {
            match &m.body {
                Some(Body::HandoffAck(a)) => {
                    if let Some(open) = self.handoffs.remove(&(a.entity_id, a.entity_epoch)) {
                        let span = close_handoff(open, "adopted");
                        if let Some(t) = &a.adopt_timing {
                            span.record("game_ms", int(t.game_ms));
                        }
                    }
                }
                Some(Body::HandoffRefused(r)) => {
                    if let Some(open) = self.handoffs.remove(&(r.entity_id, r.entity_epoch)) {
                        close_handoff(open, "refused").record("reason", r.reason.as_str());
                    }
                }
                Some(Body::EntityCommandResult(r)) => {
                    let key = (r.origin_incarnation, r.request_id);
                    if let Some(open) = self.commands.remove(&key) {
                        let error = CommandError::try_from(r.error as i32)
                            .unwrap_or(CommandError::NotDelivered);
                        open.span.record("result", result_label(error));
                        if error != CommandError::CommandOk && !r.detail.is_empty() {
                            open.span.record("detail", r.detail.as_str());
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// Closes the spans past their deadline.
    pub fn sweep(&mut self, now_ms: u64) {
        if !self.on || now_ms < self.next_sweep_ms {
            return;
        }
        self.next_sweep_ms = now_ms + SWEEP_EVERY_MS;
        self.handoffs.retain(|_, open| {
            let due = now_ms >= open.deadline_ms;
            if due {
                open.span.record("outcome", "unanswered");
                open.span.record("offers", i64::from(open.sent));
            }
            !due
        });
        self.commands.retain(|_, open| {
            let due = now_ms >= open.deadline_ms;
            if due {
                open.span.record("result", "timeout");
            }
            !due
        });
    }

    /// The node stops: what is open is closed as such.
    pub fn close_all(&mut self) {
        for (_, open) in self.handoffs.drain() {
            open.span.record("outcome", "shutdown");
        }
        for (_, open) in self.commands.drain() {
            open.span.record("result", "shutdown");
        }
    }

    fn offered(&mut self, link: LinkId, o: &cellmesh_proto::mesh::HandoffOffer, now_ms: u64) {
        if let Some(open) = self.handoffs.get_mut(&(o.entity_id, o.entity_epoch)) {
            open.sent += 1;
            return;
        }
        if self.handoffs.len() >= MAX_OPEN {
            return;
        }
        let span = tracing::info_span!(
            target: SPANS_TARGET,
            "handoff",
            node = i64::from(self.node),
            to_node = i64::from(self.peers.get(&link).copied().unwrap_or(0)),
            entity = o.entity_id,
            epoch = int(o.entity_epoch),
            partition_epoch = int(o.partition_epoch),
            account = o.owner_account.as_str(),
            master = o.is_master,
            attachments = o.attachments.len() as i64,
            successor = o.successor,
            outcome = Empty,
            reason = Empty,
            game_ms = Empty,
            offers = Empty,
        );
        self.handoffs.insert(
            (o.entity_id, o.entity_epoch),
            Open {
                span,
                deadline_ms: now_ms + HANDOFF_SPAN_MAX_MS,
                sent: 1,
            },
        );
    }

    fn command_sent(&mut self, link: LinkId, c: &cellmesh_proto::mesh::EntityCommand, now_ms: u64) {
        let key = (c.origin_incarnation, c.request_id);
        if c.request_id != 0
            && (self.commands.contains_key(&key) || self.commands.len() >= MAX_OPEN)
        {
            // Sent on once more (its target moved back here and on), or too many open.
            return;
        }
        let span = tracing::info_span!(
            target: SPANS_TARGET,
            "entity_command",
            node = i64::from(self.node),
            to_node = i64::from(self.peers.get(&link).copied().unwrap_or(0)),
            entity = c.target,
            epoch = int(c.entity_epoch),
            r#type = i64::from(c.r#type),
            from_entity = c.from_entity,
            from_account = c.from_account.as_str(),
            result = Empty,
            detail = Empty,
        );
        if c.request_id == 0 {
            // No result wanted: the span is the send.
            span.record("result", "sent");
            return;
        }
        self.commands.insert(
            key,
            Open {
                span,
                deadline_ms: now_ms + self.command_timeout_ms,
                sent: 1,
            },
        );
    }
}

/// Records the outcome of a handoff and how many offers it took; the span closes when the
/// returned handle goes.
fn close_handoff(open: Open, outcome: &str) -> Span {
    open.span.record("outcome", outcome);
    if open.sent > 1 {
        open.span.record("offers", i64::from(open.sent));
    }
    open.span
}

/// A count or epoch as a span's integer (entity ids stay `u64`: exported as text, whole).
fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_proto::mesh::{
        EntityCommand, EntityCommandResult, HandoffAck, HandoffOffer, HandoffRefused,
    };
    use recorder::Recorder;
    use std::sync::Arc;

    fn msg(body: Body) -> MeshMessage {
        MeshMessage { body: Some(body) }
    }

    fn hello(node: u32) -> LinkHello {
        LinkHello {
            role: PeerRole::Sidecar as i32,
            node_id: node,
            ..Default::default()
        }
    }

    fn offer(entity: u64, epoch: u64) -> MeshMessage {
        msg(Body::HandoffOffer(HandoffOffer {
            entity_id: entity,
            entity_epoch: epoch,
            owner_account: "ada".into(),
            is_master: true,
            ..Default::default()
        }))
    }

    fn command(request_id: u64) -> MeshMessage {
        msg(Body::EntityCommand(EntityCommand {
            target: 42,
            entity_epoch: 3,
            origin_node: 1,
            origin_incarnation: 9,
            request_id,
            r#type: 1,
            hops: 1,
            ..Default::default()
        }))
    }

    /// Runs `f` under a subscriber that records the spans closed, with their fields.
    fn recorded(f: impl FnOnce()) -> Vec<(String, Vec<(String, String)>)> {
        let recorder = Recorder::default();
        let closed = Arc::clone(&recorder.closed);
        tracing::subscriber::with_default(recorder, f);
        let closed = closed.lock().unwrap().clone();
        closed
    }

    fn field<'a>(span: &'a (String, Vec<(String, String)>), name: &str) -> Option<&'a str> {
        span.1
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_handoff_span_runs_from_the_offer_to_its_answer() {
        let closed = recorded(|| {
            let mut spans = Spans::new(1, 5_000);
            assert!(spans.on);
            spans.link_up(7, &hello(2));
            spans.sent(7, &[offer(100, 4), offer(200, 4)], 0);
            // A repeat of the same offer is the same handoff.
            spans.sent(7, &[offer(100, 4)], 10);
            spans.received(&[msg(Body::HandoffAck(HandoffAck {
                entity_id: 100,
                entity_epoch: 4,
                adopt_timing: None,
            }))]);
            spans.received(&[msg(Body::HandoffRefused(HandoffRefused {
                entity_id: 200,
                entity_epoch: 4,
                reason: "draining".into(),
            }))]);
            // An answer to an offer of another epoch is not this one's.
            spans.received(&[msg(Body::HandoffAck(HandoffAck {
                entity_id: 100,
                entity_epoch: 5,
                adopt_timing: None,
            }))]);
            assert!(spans.handoffs.is_empty());
        });
        assert_eq!(closed.len(), 2, "{closed:?}");
        let adopted = &closed[0];
        assert_eq!(adopted.0, "handoff");
        assert_eq!(field(adopted, "entity"), Some("100"));
        assert_eq!(field(adopted, "to_node"), Some("2"));
        assert_eq!(field(adopted, "account"), Some("ada"));
        assert_eq!(field(adopted, "outcome"), Some("adopted"));
        assert_eq!(field(adopted, "offers"), Some("2"));
        let refused = &closed[1];
        assert_eq!(field(refused, "outcome"), Some("refused"));
        assert_eq!(field(refused, "reason"), Some("draining"));
    }

    #[test]
    fn a_command_span_runs_from_the_send_to_its_result_or_deadline() {
        let closed = recorded(|| {
            let mut spans = Spans::new(1, 5_000);
            spans.link_up(7, &hello(2));
            spans.sent(7, &[command(1), command(2), command(0)], 0);
            // Forwarded by this node for another origin: not this node's command.
            spans.sent(
                7,
                &[msg(Body::EntityCommand(EntityCommand {
                    origin_node: 3,
                    request_id: 5,
                    ..Default::default()
                }))],
                0,
            );
            spans.received(&[msg(Body::EntityCommandResult(EntityCommandResult {
                origin_incarnation: 9,
                request_id: 1,
                target: 42,
                error: CommandError::CommandOk as u32,
                ..Default::default()
            }))]);
            spans.sweep(4_999);
            assert_eq!(spans.commands.len(), 1);
            spans.sweep(4_999 + SWEEP_EVERY_MS);
            assert!(spans.commands.is_empty());
        });
        let results: Vec<_> = closed
            .iter()
            .map(|s| {
                assert_eq!(s.0, "entity_command");
                field(s, "result").unwrap_or("-")
            })
            .collect();
        assert_eq!(results, ["sent", "ok", "timeout"]);
        assert_eq!(field(&closed[1], "to_node"), Some("2"));
        assert_eq!(field(&closed[1], "entity"), Some("42"));
    }

    #[test]
    fn off_without_a_subscriber_taking_the_spans() {
        let mut spans = Spans::new(1, 5_000);
        assert!(!spans.on);
        spans.sent(7, &[offer(100, 4), command(1)], 0);
        assert!(spans.handoffs.is_empty() && spans.commands.is_empty());
    }

    /// A subscriber that keeps each span's name and fields until it closes.
    mod recorder {
        use std::collections::HashMap;
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::{Arc, Mutex};

        use tracing::field::{Field, Visit};
        use tracing::span::{Attributes, Id, Record};
        use tracing::{Event, Metadata};

        type Fields = Vec<(String, String)>;

        #[derive(Default)]
        pub struct Recorder {
            next: AtomicU64,
            open: Mutex<HashMap<u64, (String, Fields)>>,
            pub closed: Arc<Mutex<Vec<(String, Fields)>>>,
        }

        struct Collect<'a>(&'a mut Fields);

        impl Visit for Collect<'_> {
            fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
                self.0
                    .push((field.name().to_string(), format!("{value:?}")));
            }
            fn record_str(&mut self, field: &Field, value: &str) {
                self.0.push((field.name().to_string(), value.to_string()));
            }
        }

        impl tracing::Subscriber for Recorder {
            fn enabled(&self, _: &Metadata<'_>) -> bool {
                true
            }
            fn new_span(&self, span: &Attributes<'_>) -> Id {
                let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
                let mut fields = Vec::new();
                span.record(&mut Collect(&mut fields));
                let name = span.metadata().name().to_string();
                self.open.lock().unwrap().insert(id, (name, fields));
                Id::from_u64(id)
            }
            fn record(&self, span: &Id, values: &Record<'_>) {
                if let Some((_, fields)) = self.open.lock().unwrap().get_mut(&span.into_u64()) {
                    values.record(&mut Collect(fields));
                }
            }
            fn record_follows_from(&self, _: &Id, _: &Id) {}
            fn event(&self, _: &Event<'_>) {}
            fn enter(&self, _: &Id) {}
            fn exit(&self, _: &Id) {}
            fn try_close(&self, id: Id) -> bool {
                if let Some(span) = self.open.lock().unwrap().remove(&id.into_u64()) {
                    self.closed.lock().unwrap().push(span);
                }
                true
            }
        }
    }
}
