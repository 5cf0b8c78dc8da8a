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

use cellmesh_proto::local::{self, sidecar_message, CommandError};
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_world::partition::NodeId;

use super::context::Context;
use super::handoff::{Fenced, Handoffs};
use super::peers::Mesh;
use crate::model::commands::{CommandOrder, Ordered, Origin, Replies, Reply, StreamKey};
use crate::model::entities::EntityTable;
use crate::model::handoff::Admit;

/// Forwards of one command between nodes before it counts as looping.
const MAX_COMMAND_HOPS: u32 = 6;
/// How long a command waits for any peer to say where its target is.
const LOCATE_TIMEOUT_MS: u64 = 2_000;

/// Every command this node has a part in.
#[derive(Default)]
pub(crate) struct Commands {
    /// As the origin: numbering, and the requests waiting for their result.
    origin: Origin,
    /// As the writer: each stream's order.
    order: CommandOrder<mesh::EntityCommand>,
    /// As the writer: the replies this node's game owes.
    replies: Replies,
    /// Commands waiting to learn where their target is, by target.
    locating: HashMap<u64, Locating>,
    /// Commands for entities the game released in the tick under way: routed once the tick's
    /// offers are out.
    after_tick: Vec<mesh::EntityCommand>,
}

struct Locating {
    /// The peers asked that have not answered.
    waiting: HashSet<NodeId>,
    commands: Vec<mesh::EntityCommand>,
    since_ms: u64,
}

/// How a command's result reaches its origin: over the links to peers, or, for this process's
/// own requests, straight to its game.
pub(crate) struct ResultPath<'a> {
    pub mesh: &'a Mesh,
    /// This process's incarnation: a result for it is settled here.
    pub incarnation: u64,
}

/// Where a command goes next, once this part has looked at it.
pub(crate) enum Next {
    /// Nothing more: dropped (and answered), kept for the tick's end, or asked after.
    Done,
    /// Sent under an epoch of its target not seen here yet: for the epoch fence to hold.
    Hold(u64, mesh::EntityCommand),
    /// Through the handoff machine's route for entity `id`: to the game, or to `owner` (the
    /// writer of the ghost this node holds) under its epoch.
    Route {
        id: u64,
        owner: Option<(NodeId, u64)>,
        command: mesh::EntityCommand,
    },
}

/// A game's `Command` that cannot be sent: the detail of the error the game hears, and the
/// entity it names.
pub(crate) type Refused = (String, u64);

impl Commands {
    // ------------------------------------------------------------------ from the game

    /// The game's `Command`, numbered in its stream (and its request opened) as this process's
    /// (`incarnation`): the command to route.
    pub(crate) fn on_game_command(
        &mut self,
        cx: &mut Context,
        c: local::Command,
        from_account: String,
        incarnation: u64,
    ) -> Result<mesh::EntityCommand, Refused> {
        let now = cx.now.mono_ms;
        if c.target_entity == 0 {
            return Err(("Command with target_entity 0".into(), 0));
        }
        let mut token = 0;
        if c.request_id != 0 {
            let deadline = now + cx.config.command_timeout_ms;
            token = self
                .open(c.request_id, c.target_entity, deadline)
                .map_err(|e| (e, c.target_entity))?;
            cx.metrics
                .commands_waiting
                .set(self.origin.waiting() as i64);
        }
        let (seq, prev_seq) = self.origin.number(c.target_entity, now);
        cx.metrics.commands_sent.inc();
        Ok(mesh::EntityCommand {
            target: c.target_entity,
            entity_epoch: 0,
            origin_node: cx.config.node_id,
            origin_incarnation: incarnation,
            seq,
            prev_seq,
            request_id: token,
            from_entity: c.from_entity,
            from_account,
            r#type: c.r#type,
            payload: c.payload,
            hops: 0,
        })
    }

    /// Opens a request the game waits on: the token its result travels under.
    pub(super) fn open(
        &mut self,
        request_id: u64,
        target: u64,
        deadline_ms: u64,
    ) -> Result<u64, String> {
        self.origin
            .open(request_id, target, deadline_ms)
            .map_err(|e| e.to_string())
    }

    /// The game's answer to a `CommandIn`: to the command's origin, once.
    pub(crate) fn on_reply(&mut self, cx: &mut Context, path: &ResultPath, r: local::CommandReply) {
        let Some(reply) = self.replies.take(r.request_id) else {
            // Answered already, or past its origin's deadline (the origin said TIMEOUT).
            return cx.metrics.drop_msg("command_reply_unknown", 1);
        };
        let error = if r.refused {
            CommandError::Refused
        } else {
            CommandError::CommandOk
        };
        self.send_result(
            cx,
            path,
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

    /// Where a command for the writer of its target goes (from this node's game, from a peer,
    /// or let go by the fence or a thaw), as the table and the handoffs say; one dropped is
    /// answered, and one whose target nobody here knows is asked after.
    pub(crate) fn route(
        &mut self,
        cx: &mut Context,
        path: &ResultPath,
        table: &EntityTable,
        handoff: &Handoffs,
        mut c: mesh::EntityCommand,
    ) -> Next {
        let id = c.target;
        if c.entity_epoch != 0 && handoff.fence().is_burnt(id, c.entity_epoch) {
            // A copy behind an offer this node refused: its source applies the original.
            cx.metrics.drop_command("copy_refused");
            return Next::Done;
        }
        if c.hops > MAX_COMMAND_HOPS {
            tracing::warn!(
                target = id,
                origin = c.origin_node,
                "command forwarded in a loop"
            );
            self.drop_command(
                cx,
                path,
                &c,
                "forward_loop",
                "forwarded between nodes in a loop",
            );
            return Next::Done;
        }
        match table.get(id).map(|e| (e.origin(), e.epoch)) {
            Some((None, epoch)) => {
                if c.entity_epoch > epoch {
                    return Next::Hold(id, c);
                }
                if c.entity_epoch != 0 && c.entity_epoch < epoch {
                    cx.metrics.stale_epoch_drops.inc();
                    let detail = format!(
                        "sent under epoch {} of entity {id}, which is at {epoch} here",
                        c.entity_epoch
                    );
                    self.drop_command(cx, path, &c, "stale_epoch", &detail);
                    return Next::Done;
                }
                if handoff.is_released(id) {
                    // Released by the game in this tick: offered (or kept) at its end.
                    self.after_tick.push(c);
                    return Next::Done;
                }
                Next::Route {
                    id,
                    owner: None,
                    command: c,
                }
            }
            Some((Some(owner), epoch)) => {
                if c.entity_epoch > epoch {
                    // Sent under an epoch this node has not seen: due once it adopts the
                    // entity (or learns who did).
                    return Next::Hold(id, c);
                }
                Next::Route {
                    id,
                    owner: Some((owner, epoch)),
                    command: c,
                }
            }
            None => {
                if let Some(epoch) = handoff.adopting_epoch(id) {
                    if c.entity_epoch <= epoch {
                        c.entity_epoch = epoch;
                        return Next::Hold(id, c);
                    }
                }
                if handoff.outgoing().departed_to(id).is_some() {
                    return Next::Route {
                        id,
                        owner: None,
                        command: c,
                    };
                }
                self.locate(cx, path, c);
                Next::Done
            }
        }
    }

    /// Sends a command on to `to`, another node, which writes (or is adopting) its target. One
    /// that cannot be sent is answered, unless a copy of it stays here.
    pub(crate) fn send_on(
        &mut self,
        cx: &mut Context,
        path: &ResultPath,
        to: NodeId,
        c: mesh::EntityCommand,
        copy_kept: bool,
    ) {
        let kept = (!copy_kept).then(|| c.clone());
        if !path
            .mesh
            .try_send(cx, to, mesh_message::Body::EntityCommand(c))
        {
            if let Some(c) = kept {
                let detail = format!(
                    "node {to}, which writes entity {}, is unreachable",
                    c.target
                );
                self.drop_command(cx, path, &c, "peer_down", &detail);
            }
        }
    }

    /// What the epoch fence did with a command under epoch `epoch` of `id` (`burnt`: a copy
    /// behind an offer this node refused): one it did not hold is dropped.
    pub(crate) fn fenced(
        &mut self,
        cx: &mut Context,
        path: &ResultPath,
        id: u64,
        epoch: u64,
        admitted: Admit<Fenced>,
        burnt: bool,
    ) {
        match admitted {
            Admit::Held => {}
            Admit::Accept(Fenced::Command(c)) => {
                // The fence follows that epoch while the table does not: handing it on could
                // loop.
                self.drop_command(
                    cx,
                    path,
                    &c,
                    "epoch_conflict",
                    "the epoch fence and the table disagree",
                )
            }
            Admit::Dropped(Fenced::Command(_)) if burnt => {
                cx.metrics.drop_command("copy_refused");
            }
            Admit::Dropped(Fenced::Command(c)) => {
                cx.metrics.stale_epoch_drops.inc();
                let detail = format!("sent under a stale epoch ({epoch}) of entity {id}");
                self.drop_command(cx, path, &c, "stale_epoch", &detail);
            }
            _ => {}
        }
    }

    /// Commands for entities released in the tick that just ended, to route now that their
    /// unit is offered (or kept).
    pub(crate) fn take_after_tick(&mut self) -> Vec<mesh::EntityCommand> {
        std::mem::take(&mut self.after_tick)
    }

    // ------------------------------------------------------------------ the writer

    /// A command for an entity this node writes and that is not frozen: to the game, in its
    /// stream's order.
    pub(crate) fn for_game(
        &mut self,
        cx: &mut Context,
        path: &ResultPath,
        c: mesh::EntityCommand,
        game_connected: bool,
    ) {
        if !game_connected {
            return self.drop_command(
                cx,
                path,
                &c,
                "no_game",
                "the target's game is not connected",
            );
        }
        let key = StreamKey {
            target: c.target,
            origin: c.origin_node,
            incarnation: c.origin_incarnation,
        };
        let (seq, prev) = (c.seq, c.prev_seq);
        match self.order.offer(cx.now.mono_ms, key, seq, prev, c) {
            Ordered::Deliver(commands) => {
                for c in commands {
                    self.deliver(cx, c);
                }
            }
            Ordered::Held => {}
            Ordered::Late(c) => self.drop_command(
                cx,
                path,
                &c,
                "late",
                "a newer command from the same origin reached the target first",
            ),
        }
    }

    /// Commands whose predecessor did not come in time: delivered in order all the same (those
    /// of `frozen` entities wait: they follow the unit if it goes).
    pub(crate) fn deliver_due(&mut self, cx: &mut Context, frozen: impl Fn(u64) -> bool) {
        for c in self.order.due(cx.now.mono_ms, frozen) {
            self.deliver(cx, c);
        }
    }

    /// When the next command held for a gap in its order is due (those of `frozen` entities
    /// wait).
    pub(crate) fn next_due(&self, frozen: impl Fn(u64) -> bool) -> Option<u64> {
        self.order.next_due(frozen)
    }

    fn deliver(&mut self, cx: &mut Context, c: mesh::EntityCommand) {
        let request_id = if c.request_id == 0 {
            0
        } else {
            self.replies.open(Reply {
                origin: c.origin_node,
                incarnation: c.origin_incarnation,
                request_id: c.request_id,
                target: c.target,
                deadline_ms: cx.now.mono_ms + cx.config.command_timeout_ms,
            })
        };
        cx.metrics.commands_delivered.inc();
        cx.out.to_game.push(
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
    pub(crate) fn cursors(&self, id: u64) -> Vec<mesh::CommandCursor> {
        self.order
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
    pub(crate) fn resume_cursors(&mut self, cx: &Context, cursors: &[mesh::CommandCursor]) {
        let now = cx.now.mono_ms;
        for c in cursors {
            self.order.resume(
                c.target,
                &[(c.origin_node, c.origin_incarnation, c.last_seq)],
                now,
            );
        }
    }

    /// The commands held here for a gap in the order of `id`'s streams, taken to follow the
    /// entity (or to answer).
    pub(crate) fn forget(&mut self, id: u64) -> Vec<mesh::EntityCommand> {
        self.order.forget(id)
    }

    /// The game despawned `id`: commands held for it find no target.
    pub(crate) fn target_gone(&mut self, cx: &mut Context, path: &ResultPath, id: u64) {
        for c in self.order.forget(id) {
            self.answer(
                cx,
                path,
                &c,
                CommandError::EntityGone,
                format!("entity {id} was despawned"),
            );
        }
    }

    // ------------------------------------------------------------------ locating

    /// A command for an entity this node holds no trace of: every peer is asked where it is.
    fn locate(&mut self, cx: &mut Context, path: &ResultPath, c: mesh::EntityCommand) {
        let id = c.target;
        if let Some(l) = self.locating.get_mut(&id) {
            return l.commands.push(c);
        }
        let peers = path.mesh.up_peers();
        if peers.is_empty() {
            let detail = format!("no node holds entity {id}");
            return self.answer(cx, path, &c, CommandError::EntityGone, detail);
        }
        for &p in &peers {
            path.mesh.send(
                cx,
                p,
                mesh_message::Body::Locate(mesh::Locate { entity: id }),
            );
        }
        self.locating.insert(
            id,
            Locating {
                waiting: peers.into_iter().collect(),
                commands: vec![c],
                since_ms: cx.now.mono_ms,
            },
        );
    }

    /// A peer's `Located`: the commands waiting for it once it (or every peer asked) answered,
    /// to forward to the writer it names (`(owner, epoch, command)`); those nobody holds are
    /// answered.
    pub(crate) fn on_located(
        &mut self,
        cx: &mut Context,
        path: &ResultPath,
        from: NodeId,
        l: mesh::Located,
    ) -> Vec<(NodeId, u64, mesh::EntityCommand)> {
        let Some(loc) = self.locating.get_mut(&l.entity) else {
            return Vec::new();
        };
        if !l.found {
            loc.waiting.remove(&from);
            if !loc.waiting.is_empty() {
                return Vec::new();
            }
        }
        // Internal: the entry was found at the top and nothing since removed it, whatever the
        // peer said (an unknown or repeated `Located` returns there).
        let loc = self.locating.remove(&l.entity).expect("found above");
        let mut forward = Vec::new();
        for c in loc.commands {
            if !l.found || l.owner == cx.config.node_id {
                // Nobody holds it, or only stale ghosts name this node, which does not.
                let detail = format!("no node holds entity {}", l.entity);
                self.answer(cx, path, &c, CommandError::EntityGone, detail);
            } else {
                cx.metrics.command_forwarded("owner");
                forward.push((l.owner, l.entity_epoch, c));
            }
        }
        forward
    }

    // ------------------------------------------------------------------ results

    /// A result from the writer (or a node that dropped the command): to the game, once.
    pub(crate) fn on_result(
        &mut self,
        cx: &mut Context,
        incarnation: u64,
        r: mesh::EntityCommandResult,
    ) {
        if r.origin_incarnation != incarnation {
            // For a process of this node id that died: nobody here waits for it.
            return cx.metrics.drop_msg("command_result_stale", 1);
        }
        self.settle(cx, r);
    }

    /// Drops a command the mesh is sure no game saw, and says so to its origin.
    fn drop_command(
        &mut self,
        cx: &mut Context,
        path: &ResultPath,
        c: &mesh::EntityCommand,
        reason: &'static str,
        detail: &str,
    ) {
        cx.metrics.drop_command(reason);
        self.answer(
            cx,
            path,
            c,
            CommandError::NotDelivered,
            format!("{reason}: {detail}"),
        );
    }

    /// Answers `c` (if it wants an answer) with `error`, from this node.
    fn answer(
        &mut self,
        cx: &mut Context,
        path: &ResultPath,
        c: &mesh::EntityCommand,
        error: CommandError,
        detail: String,
    ) {
        if c.request_id == 0 {
            return;
        }
        self.send_result(
            cx,
            path,
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

    fn send_result(
        &mut self,
        cx: &mut Context,
        path: &ResultPath,
        origin: NodeId,
        incarnation: u64,
        r: mesh::EntityCommandResult,
    ) {
        if origin == cx.config.node_id && incarnation == path.incarnation {
            return self.settle(cx, r);
        }
        if !path
            .mesh
            .try_send(cx, origin, mesh_message::Body::EntityCommandResult(r))
        {
            // The origin times the request out.
            cx.metrics.drop_msg("command_result_peer_down", 1);
        }
    }

    /// The first result of a request goes to the game; any later one is dropped.
    fn settle(&mut self, cx: &mut Context, r: mesh::EntityCommandResult) {
        let Some(p) = self.origin.settle(r.request_id) else {
            return cx.metrics.drop_msg("command_result_late", 1);
        };
        let error = CommandError::try_from(r.error as i32).unwrap_or(CommandError::NotDelivered);
        self.give_result(cx, p.request_id, r.target, error, r.payload, r.detail);
    }

    fn give_result(
        &mut self,
        cx: &mut Context,
        request_id: u64,
        target: u64,
        error: CommandError,
        payload: Bytes,
        detail: String,
    ) {
        cx.metrics.command_result(result_label(error));
        cx.metrics
            .commands_waiting
            .set(self.origin.waiting() as i64);
        cx.out.to_game.push(
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
    pub(crate) fn step(&mut self, cx: &mut Context, path: &ResultPath) {
        let now = cx.now.mono_ms;
        for p in self.origin.expired(now) {
            let detail = format!("no result within {} ms", cx.config.command_timeout_ms);
            self.give_result(
                cx,
                p.request_id,
                p.target,
                CommandError::Timeout,
                Bytes::new(),
                detail,
            );
        }
        self.replies.expire(now);
        self.order.prune(now);
        let lost: Vec<u64> = self
            .locating
            .iter()
            .filter(|(_, l)| now.saturating_sub(l.since_ms) >= LOCATE_TIMEOUT_MS)
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            // Internal: a timer step over ids it just listed from the same map.
            let l = self.locating.remove(&id).expect("listed above");
            for c in l.commands {
                self.drop_command(
                    cx,
                    path,
                    &c,
                    "not_located",
                    "no peer said where the target is",
                );
            }
        }
    }

    /// The game went away: the results it waited for and the replies it owed go with it.
    pub(crate) fn game_gone(&mut self, cx: &mut Context) {
        self.origin.clear();
        self.replies.clear();
        cx.metrics.commands_waiting.set(0);
    }
}

/// Where this node knows `id` to be written, and under which epoch: what it answers a peer's
/// `Locate` with.
pub(crate) fn whereabouts(
    cx: &Context,
    table: &EntityTable,
    handoff: &Handoffs,
    id: u64,
) -> Option<(NodeId, u64)> {
    if let Some(e) = table.get(id) {
        return Some((e.origin().unwrap_or(cx.config.node_id), e.epoch));
    }
    if let Some(epoch) = handoff.adopting_epoch(id) {
        return Some((cx.config.node_id, epoch));
    }
    handoff.outgoing().departed_to(id)
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
