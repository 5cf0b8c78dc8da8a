//! Entity commands: a game's `Command` to any entity, routed to the node that writes the target
//! now and handed to its game as `CommandIn`; the result comes back to the caller once.
//!
//! The route is the one inputs take to a player's master, under the same epoch fence: a command
//! for an entity this node writes goes to the game (in its stream's order, see
//! [`crate::model::commands`]); for a frozen one it waits with the unit and follows it behind
//! the offer (applied here if the offer is refused, by the target if it is adopted, never by
//! both); for a ghost it goes to the ghost's writer; for one handed away, after it. For an
//! entity this node holds no trace of, it asks every peer where it is first (`Locate`).
//!
//! Delivery is at most once: nothing is sent twice, and a copy behind an offer is applied on
//! one side only. Every command with a request id gets exactly one result: the first to reach
//! its origin (the game's reply, a drop the mesh is sure of, or the origin's timeout) settles it.

use bytes::Bytes;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use cellmesh_proto::local::{self, sidecar_message, CommandError, ErrorCode};
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::partition::NodeId;

use super::handoff::{Fenced, Routed};
use super::*;
use crate::model::commands::{CommandOrder, Ordered, Origin, Replies, Reply, StreamKey};
use crate::model::handoff::{Admit, InputRoute};

/// Forwards of one command between nodes before it counts as looping.
const MAX_COMMAND_HOPS: u32 = 6;
/// How long a command waits for any peer to say where its target is.
const LOCATE_TIMEOUT_MS: u64 = 2_000;

/// Every command this node has a part in.
#[derive(Default)]
pub(crate) struct Commands {
    /// As the origin: numbering, and the requests waiting for their result.
    pub origin: Origin,
    /// As the writer: each stream's order.
    pub order: CommandOrder<mesh::EntityCommand>,
    /// As the writer: the replies this node's game owes.
    pub replies: Replies,
    /// Commands waiting to learn where their target is, by target.
    pub locating: HashMap<u64, Locating>,
    /// Commands for entities the game released in the tick under way: routed once the tick's
    /// offers are out.
    pub after_tick: Vec<mesh::EntityCommand>,
}

pub(crate) struct Locating {
    /// The peers asked that have not answered.
    waiting: HashSet<NodeId>,
    commands: Vec<mesh::EntityCommand>,
    since_ms: u64,
}

impl Core {
    // ------------------------------------------------------------------ from the game

    /// The game's `Command`.
    pub(crate) fn on_command(&mut self, c: local::Command) {
        let now = self.cx.now.mono_ms;
        if c.target_entity == 0 {
            return self.game_error(
                ErrorCode::InvalidValue,
                "Command with target_entity 0".into(),
                0,
            );
        }
        let mut token = 0;
        if c.request_id != 0 {
            let deadline = now + self.cx.config.command_timeout_ms;
            match self
                .commands
                .origin
                .open(c.request_id, c.target_entity, deadline)
            {
                Ok(t) => token = t,
                Err(e) => {
                    return self.game_error(ErrorCode::InvalidValue, e.to_string(), c.target_entity)
                }
            }
            self.cx
                .metrics
                .commands_waiting
                .set(self.commands.origin.waiting() as i64);
        }
        let from_account = self
            .table
            .get_local(c.from_entity)
            .map(|e| e.owner_account.clone())
            .unwrap_or_default();
        let (seq, prev_seq) = self.commands.origin.number(c.target_entity, now);
        self.cx.metrics.commands_sent.inc();
        self.route_command(mesh::EntityCommand {
            target: c.target_entity,
            entity_epoch: 0,
            origin_node: self.cx.config.node_id,
            origin_incarnation: self.restore.incarnation,
            seq,
            prev_seq,
            request_id: token,
            from_entity: c.from_entity,
            from_account,
            r#type: c.r#type,
            payload: c.payload,
            hops: 0,
        });
    }

    /// The game's answer to a `CommandIn`: to the command's origin, once.
    pub(crate) fn on_command_reply(&mut self, r: local::CommandReply) {
        let Some(reply) = self.commands.replies.take(r.request_id) else {
            // Answered already, or past its origin's deadline (the origin said TIMEOUT).
            return self.cx.metrics.drop_msg("command_reply_unknown", 1);
        };
        let error = if r.refused {
            CommandError::Refused
        } else {
            CommandError::CommandOk
        };
        self.send_result(
            reply.origin,
            reply.incarnation,
            mesh::EntityCommandResult {
                origin_incarnation: reply.incarnation,
                request_id: reply.request_id,
                target: reply.target,
                error: error as u32,
                payload: r.payload,
                detail: r.detail,
            },
        );
    }

    // ------------------------------------------------------------------ routing

    /// Routes a command to the writer of its target: from this node's game, from a peer, or
    /// let go by the fence or a thaw.
    pub(crate) fn route_command(&mut self, mut c: mesh::EntityCommand) {
        let id = c.target;
        if c.entity_epoch != 0 && self.handoff.fence.is_burnt(id, c.entity_epoch) {
            // A copy behind an offer this node refused: its source applies the original.
            return self.cx.metrics.drop_command("copy_refused");
        }
        if c.hops > MAX_COMMAND_HOPS {
            tracing::warn!(
                target = id,
                origin = c.origin_node,
                "command forwarded in a loop"
            );
            return self.drop_command(&c, "forward_loop", "forwarded between nodes in a loop");
        }
        match self.table.get(id).map(|e| (e.origin, e.epoch)) {
            Some((None, epoch)) => {
                if c.entity_epoch > epoch {
                    return self.hold_command(id, c);
                }
                if c.entity_epoch != 0 && c.entity_epoch < epoch {
                    self.cx.metrics.stale_epoch_drops.inc();
                    let detail = format!(
                        "sent under epoch {} of entity {id}, which is at {epoch} here",
                        c.entity_epoch
                    );
                    return self.drop_command(&c, "stale_epoch", &detail);
                }
                if self.handoff.released_by.contains_key(&id) {
                    // Released by the game in this tick: offered (or kept) at its end.
                    return self.commands.after_tick.push(c);
                }
                let route = self
                    .handoff
                    .outgoing
                    .route_input(id, Routed::Command(Box::new(c)));
                self.follow_route(id, route, 0, None);
            }
            Some((Some(owner), epoch)) => {
                if c.entity_epoch > epoch {
                    // Sent under an epoch this node has not seen: due once it adopts the
                    // entity (or learns who did).
                    return self.hold_command(id, c);
                }
                let route = self
                    .handoff
                    .outgoing
                    .route_input(id, Routed::Command(Box::new(c)));
                self.follow_route(id, route, 0, Some((owner, epoch)));
            }
            None => {
                if let Some(epoch) = self.adopting_epoch(id) {
                    if c.entity_epoch <= epoch {
                        c.entity_epoch = epoch;
                        return self.hold_command(id, c);
                    }
                }
                if self.handoff.outgoing.departed_to(id).is_some() {
                    let route = self
                        .handoff
                        .outgoing
                        .route_input(id, Routed::Command(Box::new(c)));
                    return self.follow_route(id, route, 0, None);
                }
                self.locate(c);
            }
        }
    }

    /// Carries out the handoff machine's route for an input or command of entity `id`. One not
    /// in a handoff goes to the game, or to `owner` (the writer of the ghost this node holds)
    /// under its epoch.
    pub(crate) fn follow_route(
        &mut self,
        id: u64,
        route: InputRoute<Routed>,
        hops: u32,
        owner: Option<(NodeId, u64)>,
    ) {
        match route {
            InputRoute::Held => {}
            InputRoute::Local(Routed::Input(input)) => match owner {
                Some((owner, epoch)) => self.forward_input(owner, id, epoch, input, hops),
                None => self.input_to_game(input),
            },
            InputRoute::Forward {
                to,
                epoch,
                input: Routed::Input(input),
            } => self.forward_routed(id, to, epoch, input, hops),
            InputRoute::Local(Routed::Command(c)) => match owner {
                Some((owner, epoch)) => {
                    self.cx.metrics.command_forwarded("owner");
                    self.forward_command(owner, epoch, *c, false);
                }
                None => self.command_to_game(*c),
            },
            InputRoute::Forward {
                to,
                epoch,
                input: Routed::Command(c),
            } => {
                // Behind an offer in flight a copy stays with the unit; after it, none does.
                let copy_kept = self.handoff.outgoing.is_frozen(id);
                self.cx.metrics.command_forwarded("handoff");
                self.forward_command(to, epoch, *c, copy_kept);
            }
        }
    }

    /// Sends a command on to `to`, which writes (or is adopting) its target under `epoch`.
    /// One that cannot be sent is answered, unless a copy of it stays here.
    pub(crate) fn forward_command(
        &mut self,
        to: NodeId,
        epoch: u64,
        mut c: mesh::EntityCommand,
        copy_kept: bool,
    ) {
        c.entity_epoch = epoch;
        c.hops += 1;
        if to == self.cx.config.node_id {
            return self.route_command(c);
        }
        let kept = (!copy_kept).then(|| c.clone());
        if !self.try_send_peer(to, mesh_message::Body::EntityCommand(c)) {
            if let Some(c) = kept {
                let detail = format!(
                    "node {to}, which writes entity {}, is unreachable",
                    c.target
                );
                self.drop_command(&c, "peer_down", &detail);
            }
        }
    }

    /// A command under an epoch of its target not seen here yet: held by the fence until the
    /// epoch change is.
    fn hold_command(&mut self, id: u64, c: mesh::EntityCommand) {
        let epoch = c.entity_epoch;
        match self
            .handoff
            .fence
            .admit(id, epoch, None, Fenced::Command(Box::new(c)))
        {
            Admit::Held => {}
            Admit::Accept(Fenced::Command(c)) => {
                // The fence follows that epoch while the table does not: handing it on could
                // loop.
                self.drop_command(
                    &c,
                    "epoch_conflict",
                    "the epoch fence and the table disagree",
                )
            }
            Admit::Dropped(Fenced::Command(_)) if self.handoff.fence.is_burnt(id, epoch) => {
                self.cx.metrics.drop_command("copy_refused");
            }
            Admit::Dropped(Fenced::Command(c)) => {
                self.cx.metrics.stale_epoch_drops.inc();
                let detail = format!("sent under a stale epoch ({epoch}) of entity {id}");
                self.drop_command(&c, "stale_epoch", &detail);
            }
            _ => {}
        }
    }

    /// The epoch this node is adopting `id` under (as the root or a member of an offer).
    fn adopting_epoch(&self, id: u64) -> Option<u64> {
        self.handoff
            .adopting
            .values()
            .find(|o| o.entity_id == id || o.attachments.iter().any(|a| a.entity_id == id))
            .map(|o| o.entity_epoch)
    }

    /// Commands for entities released in the tick that just ended: their unit is offered (or
    /// kept) now.
    pub(crate) fn route_after_tick(&mut self) {
        for c in std::mem::take(&mut self.commands.after_tick) {
            self.route_command(c);
        }
    }

    // ------------------------------------------------------------------ the writer

    /// A command for an entity this node writes and that is not frozen: to the game, in its
    /// stream's order.
    fn command_to_game(&mut self, c: mesh::EntityCommand) {
        if self.game.slot.is_none() {
            return self.drop_command(&c, "no_game", "the target's game is not connected");
        }
        let key = StreamKey {
            target: c.target,
            origin: c.origin_node,
            incarnation: c.origin_incarnation,
        };
        let (seq, prev) = (c.seq, c.prev_seq);
        match self
            .commands
            .order
            .offer(self.cx.now.mono_ms, key, seq, prev, c)
        {
            Ordered::Deliver(commands) => {
                for c in commands {
                    self.deliver_command(c);
                }
            }
            Ordered::Held => {}
            Ordered::Late(c) => self.drop_command(
                &c,
                "late",
                "a newer command from the same origin reached the target first",
            ),
        }
    }

    /// Commands whose predecessor did not come in time: delivered in order all the same (those
    /// of frozen entities wait: they follow the unit if it goes).
    pub(crate) fn deliver_due_commands(&mut self) {
        let due = self
            .commands
            .order
            .due(self.cx.now.mono_ms, |id| self.handoff.frozen(id));
        for c in due {
            self.deliver_command(c);
        }
    }

    fn deliver_command(&mut self, c: mesh::EntityCommand) {
        let request_id = if c.request_id == 0 {
            0
        } else {
            self.commands.replies.open(Reply {
                origin: c.origin_node,
                incarnation: c.origin_incarnation,
                request_id: c.request_id,
                target: c.target,
                deadline_ms: self.cx.now.mono_ms + self.cx.config.command_timeout_ms,
            })
        };
        self.cx.metrics.commands_delivered.inc();
        self.cx.out.to_game.push(
            sidecar_message::Body::CommandIn(local::CommandIn {
                target: c.target,
                from_entity: c.from_entity,
                from_account: c.from_account,
                r#type: c.r#type,
                payload: c.payload,
                request_id,
                from_node: c.origin_node,
            })
            .into(),
        );
    }

    /// The order each stream to `id` got to, for the offer that hands it on.
    pub(crate) fn command_cursors(&self, id: u64) -> Vec<mesh::CommandCursor> {
        self.commands
            .order
            .cursors(id)
            .into_iter()
            .map(|(origin, incarnation, last)| mesh::CommandCursor {
                target: id,
                origin_node: origin,
                origin_incarnation: incarnation,
                last_seq: last,
            })
            .collect()
    }

    /// An adopted unit's cursors: its commands go on in order here.
    pub(crate) fn resume_command_cursors(&mut self, cursors: &[mesh::CommandCursor]) {
        let now = self.cx.now.mono_ms;
        for c in cursors {
            self.commands.order.resume(
                c.target,
                &[(c.origin_node, c.origin_incarnation, c.last_seq)],
                now,
            );
        }
    }

    /// The game despawned `id`: commands held for it find no target.
    pub(crate) fn command_target_gone(&mut self, id: u64) {
        for c in self.commands.order.forget(id) {
            self.answer_command(
                &c,
                CommandError::EntityGone,
                format!("entity {id} was despawned"),
            );
        }
    }

    // ------------------------------------------------------------------ locating

    /// A command for an entity this node holds no trace of: every peer is asked where it is.
    fn locate(&mut self, c: mesh::EntityCommand) {
        let id = c.target;
        if let Some(l) = self.commands.locating.get_mut(&id) {
            return l.commands.push(c);
        }
        let peers = self.up_peers();
        if peers.is_empty() {
            let detail = format!("no node holds entity {id}");
            return self.answer_command(&c, CommandError::EntityGone, detail);
        }
        for &p in &peers {
            self.send_peer(p, mesh_message::Body::Locate(mesh::Locate { entity: id }));
        }
        self.commands.locating.insert(
            id,
            Locating {
                waiting: peers.into_iter().collect(),
                commands: vec![c],
                since_ms: self.cx.now.mono_ms,
            },
        );
    }

    /// Where this node knows `id` to be written, and under which epoch.
    fn whereabouts(&self, id: u64) -> Option<(NodeId, u64)> {
        if let Some(e) = self.table.get(id) {
            return Some((e.origin.unwrap_or(self.cx.config.node_id), e.epoch));
        }
        if let Some(epoch) = self.adopting_epoch(id) {
            return Some((self.cx.config.node_id, epoch));
        }
        self.handoff.outgoing.departed_to(id)
    }

    pub(crate) fn on_locate(&mut self, from: NodeId, l: mesh::Locate) {
        let found = self.whereabouts(l.entity);
        self.send_peer(
            from,
            mesh_message::Body::Located(mesh::Located {
                entity: l.entity,
                found: found.is_some(),
                owner: found.map_or(0, |f| f.0),
                entity_epoch: found.map_or(0, |f| f.1),
            }),
        );
    }

    pub(crate) fn on_located(&mut self, from: NodeId, l: mesh::Located) {
        let Some(loc) = self.commands.locating.get_mut(&l.entity) else {
            return;
        };
        if !l.found {
            loc.waiting.remove(&from);
            if !loc.waiting.is_empty() {
                return;
            }
        }
        // Internal: the entry was found at the top and nothing since removed it, whatever the
        // peer said (an unknown or repeated `Located` returns there).
        let loc = self
            .commands
            .locating
            .remove(&l.entity)
            .expect("found above");
        for c in loc.commands {
            if !l.found || l.owner == self.cx.config.node_id {
                // Nobody holds it, or only stale ghosts name this node, which does not.
                let detail = format!("no node holds entity {}", l.entity);
                self.answer_command(&c, CommandError::EntityGone, detail);
            } else {
                self.cx.metrics.command_forwarded("owner");
                self.forward_command(l.owner, l.entity_epoch, c, false);
            }
        }
    }

    // ------------------------------------------------------------------ results

    /// A result from the writer (or a node that dropped the command): to the game, once.
    pub(crate) fn on_command_result(&mut self, r: mesh::EntityCommandResult) {
        if r.origin_incarnation != self.restore.incarnation {
            // For a process of this node id that died: nobody here waits for it.
            return self.cx.metrics.drop_msg("command_result_stale", 1);
        }
        self.settle_command(r);
    }

    /// Drops a command the mesh is sure no game saw, and says so to its origin.
    fn drop_command(&mut self, c: &mesh::EntityCommand, reason: &'static str, detail: &str) {
        self.cx.metrics.drop_command(reason);
        self.answer_command(c, CommandError::NotDelivered, format!("{reason}: {detail}"));
    }

    /// Answers `c` (if it wants an answer) with `error`, from this node.
    fn answer_command(&mut self, c: &mesh::EntityCommand, error: CommandError, detail: String) {
        if c.request_id == 0 {
            return;
        }
        self.send_result(
            c.origin_node,
            c.origin_incarnation,
            mesh::EntityCommandResult {
                origin_incarnation: c.origin_incarnation,
                request_id: c.request_id,
                target: c.target,
                error: error as u32,
                payload: Bytes::new(),
                detail,
            },
        );
    }

    fn send_result(&mut self, origin: NodeId, incarnation: u64, r: mesh::EntityCommandResult) {
        if origin == self.cx.config.node_id && incarnation == self.restore.incarnation {
            return self.settle_command(r);
        }
        if !self.try_send_peer(origin, mesh_message::Body::EntityCommandResult(r)) {
            // The origin times the request out.
            self.cx.metrics.drop_msg("command_result_peer_down", 1);
        }
    }

    /// The first result of a request goes to the game; any later one is dropped.
    fn settle_command(&mut self, r: mesh::EntityCommandResult) {
        let Some(p) = self.commands.origin.settle(r.request_id) else {
            return self.cx.metrics.drop_msg("command_result_late", 1);
        };
        let error = CommandError::try_from(r.error as i32).unwrap_or(CommandError::NotDelivered);
        self.give_result(p.request_id, r.target, error, r.payload, r.detail);
    }

    fn give_result(
        &mut self,
        request_id: u64,
        target: u64,
        error: CommandError,
        payload: Bytes,
        detail: String,
    ) {
        self.cx.metrics.command_result(result_label(error));
        self.cx
            .metrics
            .commands_waiting
            .set(self.commands.origin.waiting() as i64);
        self.cx.out.to_game.push(
            sidecar_message::Body::CommandResult(local::CommandResult {
                request_id,
                target,
                ok: error == CommandError::CommandOk,
                error: error as i32,
                payload,
                detail,
            })
            .into(),
        );
    }

    // ------------------------------------------------------------------ time

    /// Requests past their deadline are answered `TIMEOUT`; what waits too long is let go.
    pub(crate) fn commands_step(&mut self) {
        let now = self.cx.now.mono_ms;
        for p in self.commands.origin.expired(now) {
            let detail = format!("no result within {} ms", self.cx.config.command_timeout_ms);
            self.give_result(
                p.request_id,
                p.target,
                CommandError::Timeout,
                Bytes::new(),
                detail,
            );
        }
        self.commands.replies.expire(now);
        self.commands.order.prune(now);
        let lost: Vec<u64> = self
            .commands
            .locating
            .iter()
            .filter(|(_, l)| now.saturating_sub(l.since_ms) >= LOCATE_TIMEOUT_MS)
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            // Internal: a timer step over ids it just listed from the same map.
            let l = self.commands.locating.remove(&id).expect("listed above");
            for c in l.commands {
                self.drop_command(&c, "not_located", "no peer said where the target is");
            }
        }
    }

    /// The game went away: the results it waited for and the replies it owed go with it.
    pub(crate) fn commands_game_gone(&mut self) {
        self.commands.origin.clear();
        self.commands.replies.clear();
        self.cx.metrics.commands_waiting.set(0);
    }
}

/// The label of a result in `command_results`.
pub(crate) fn result_label(e: CommandError) -> &'static str {
    match e {
        CommandError::CommandOk => "ok",
        CommandError::EntityGone => "entity_gone",
        CommandError::Timeout => "timeout",
        CommandError::Refused => "refused",
        CommandError::NotDelivered => "not_delivered",
    }
}
