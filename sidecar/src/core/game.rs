//! The local game: its connection, what it sends each tick, and the end of a tick (README.md#how-a-game-server-adopts-the-local-protocol).

use cellmesh_proto::local::{
    self, game_message, sidecar_message, ErrorCode, GameMessage, SidecarMessage,
};

use super::wire::*;
use super::*;
use crate::config::SidecarConfig;
use crate::model::audience::Audience;
use std::collections::BTreeSet;

use crate::model::checkpoints::Checkpoints;
use crate::model::entities::{merge_changes, EntityError, EntityUpdate, NewEntity};
use crate::model::fold::{TickEvent, TickSend};
use crate::model::ids::IdMinter;
use cellmesh_stores::topology::Lease;

/// The game connected to this node, as the node knows it.
pub(crate) struct GameSlot {
    pub conn: ConnId,
    pub hello: local::Hello,
    pub health: Option<local::Health>,
    pub load: Option<local::Load>,
}

/// The local game and what it sent during the current tick.
pub(crate) struct LocalGame {
    pub slot: Option<GameSlot>,
    pub tick_events: Vec<TickEvent>,
    pub tick_sends: Vec<TickSend>,
    pub last_tick: u64,
    /// When the game's last `TickEnd` came (monotonic ms): where a handoff's snapshot finds the
    /// end of its entity's last simulated tick.
    pub last_tick_end_ms: Option<u64>,
    pub ids: IdMinter,
    /// The latest state of every entity written here, asked of the game.
    pub checkpoints: Checkpoints,
    /// Since when the game has been gone with its entities kept for its return (monotonic ms).
    pub gone_since: Option<u64>,
    /// Entities handed back to a returning game with `Adopt`, not yet `Adopted`.
    pub restoring: BTreeSet<u64>,
    /// Entities despawned because their game went away before any checkpoint of them came.
    pub unrestorable: Vec<u64>,
}

impl LocalGame {
    /// Ids are minted under `lease` (none: a lone node, whose ids nobody else mints).
    pub fn new(cfg: &SidecarConfig, lease: Option<&Lease>) -> Self {
        let ids = match lease {
            Some(l) => IdMinter::new(l),
            None => IdMinter::unbounded(cfg.node_id),
        };
        Self {
            slot: None,
            tick_events: Vec::new(),
            tick_sends: Vec::new(),
            last_tick: 0,
            last_tick_end_ms: None,
            // The config checked the node id against the id layout.
            ids: ids.expect("a node id that fits the id layout"),
            checkpoints: Checkpoints::new(super::restore::checkpoint_ask_every_ms(
                cfg.checkpoint_interval_ms,
            )),
            gone_since: None,
            restoring: BTreeSet::new(),
            unrestorable: Vec::new(),
        }
    }

    /// A checkpoint the game answered: kept if it is of an entity written here, under its
    /// current epoch, while the lease is live (an answer that crossed a handoff is of no use).
    pub(crate) fn on_checkpoint_state(
        &mut self,
        cx: &Context,
        table: &EntityTable,
        lease_live: bool,
        c: local::CheckpointState,
    ) {
        let current = table
            .get_local(c.entity_id)
            .map(|e| e.epoch)
            .filter(|_| lease_live);
        if current != Some(c.entity_epoch) {
            self.checkpoints.answered_in_vain(c.entity_id);
            return cx.metrics.drop_msg("checkpoint_stale", 1);
        }
        cx.metrics.checkpoint(c.state.len());
        self.checkpoints
            .taken(c.entity_id, c.entity_epoch, c.state, cx.now.mono_ms);
    }

    /// Asks the game for the checkpoints now due (games of protocol 1.1 and later), while the
    /// lease is live.
    pub(crate) fn ask_for_checkpoints(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        lease_live: bool,
    ) {
        let speaks = self
            .slot
            .as_ref()
            .and_then(|g| g.hello.version.as_ref())
            .is_some_and(|v| v.minor >= 1);
        // One batch at a time: a game that is slow to answer is not asked for more (its
        // connection must stay free for what it cannot do without).
        if !speaks || !lease_live || self.checkpoints.outstanding(cx.now.mono_ms) > 0 {
            return;
        }
        let due = self
            .checkpoints
            .take_due(cx.now.mono_ms, MAX_CHECKPOINTS_ASKED);
        let entity_ids: Vec<u64> = due
            .into_iter()
            .filter(|id| table.get_local(*id).is_some())
            .collect();
        if !entity_ids.is_empty() {
            cx.out
                .to_game
                .push(sidecar_message::Body::Checkpoint(local::Checkpoint { entity_ids }).into());
        }
    }

    /// The game's `ReserveIds`: the ids minted, or why none are (the error the game hears).
    pub(crate) fn reserve_ids(
        &mut self,
        cx: &mut Context,
        r: local::ReserveIds,
    ) -> Result<(), (ErrorCode, String)> {
        // Each id costs at most 9 bytes on the wire; the answer must fit one frame.
        let max = MAX_RESERVE.min(cx.config.max_frame_bytes.saturating_sub(TO_CLIENT_OVERHEAD) / 9);
        let count = r.count as usize;
        if count > max {
            let detail = format!(
                "ReserveIds {} asks for {count} ids; at most {max} per request",
                r.request_id
            );
            return Err((ErrorCode::InvalidValue, detail));
        }
        let ids = match self.ids.mint_many(cx.now.unix_ms, count) {
            Ok(ids) => ids,
            Err(e) => {
                let detail = format!("ReserveIds {}: {e}", r.request_id);
                return Err((ErrorCode::NotOwner, detail));
            }
        };
        cx.out.to_game.push(
            sidecar_message::Body::IdsReserved(local::IdsReserved {
                request_id: r.request_id,
                ids,
            })
            .into(),
        );
        Ok(())
    }
}

/// The epoch every entity starts with; each handoff adds one.
pub(crate) const FIRST_EPOCH: u64 = 1;
/// Most entities one `Checkpoint` asks for; the next batch waits for its answers.
const MAX_CHECKPOINTS_ASKED: usize = 256;
/// Most ids one `ReserveIds` may ask for.
const MAX_RESERVE: usize = 65_536;

/// Where the world's common tick clock starts (`Welcome.tick_phase`): the Unix epoch, which
/// every host agrees on without a word, so games of one tick rate tick in phase everywhere.
const TICK_ORIGIN_UNIX_MS: u64 = 0;
/// The tick rate the phase is given in for a game that named none.
const DEFAULT_TICK_HZ: u32 = 20;

impl Core {
    /// Whether a game is connected now (it said `Hello`).
    pub fn game_connected(&self) -> bool {
        self.game.slot.is_some()
    }

    pub(crate) fn on_game_hello(
        &mut self,
        conn: ConnId,
        hello: local::Hello,
        rest: Vec<GameMessage>,
    ) {
        if let Some(current) = &self.game.slot {
            let detail = format!(
                "a game ({:?}) is already connected to this sidecar; it serves one game at a time",
                current.hello.game
            );
            let err = local::Error {
                code: ErrorCode::AlreadyConnected as i32,
                detail,
                fatal: true,
                entity_id: 0,
            };
            self.cx.emit(Output::GameFatal { conn, error: err });
            return;
        }
        if self.shutting_down {
            self.cx.emit(Output::ReleaseGame { conn });
            return;
        }
        tracing::info!(conn, game = %hello.game, "game connected");
        let hello_rate = hello.tick_rate_hz;
        self.game.slot = Some(GameSlot {
            conn,
            hello,
            health: None,
            load: None,
        });
        self.cx.metrics.game_connected.set(1);
        let w = &self.cx.config.world;
        self.cx.out.to_game.push(
            sidecar_message::Body::Welcome(local::Welcome {
                version: Some(local::ProtocolVersion::current()),
                node_id: self.cx.config.node_id,
                world: Some(local::WorldShape {
                    width: w.width,
                    height: w.height,
                    chunk_size: w.chunk_size,
                    region_size: w.region_size,
                }),
                owned_area: self.owned_rects(),
                partition_epoch: self.authority.partition().epoch(),
                tick_phase: Some(local::TickPhase {
                    origin_unix_ms: TICK_ORIGIN_UNIX_MS,
                    tick_rate_hz: if hello_rate > 0 {
                        hello_rate
                    } else {
                        DEFAULT_TICK_HZ
                    },
                }),
                handoff_margin_chunks: self.cx.config.handoff_margin_chunks,
            })
            .into(),
        );
        self.restore_to_game();
        // Sessions outlive a game restart: the new game hears about every attached player whose
        // avatar this node simulates (one simulated elsewhere stays there: a join here would
        // spawn a second avatar).
        let joins = self.gateway.joins_for_game(self.cx.config.node_id);
        self.cx.out.to_game.extend(joins);
        let remote: Vec<SidecarMessage> = self
            .routing
            .remote_players()
            .map(|(account, r)| {
                sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                    account: account.clone(),
                    session_epoch: r.session_epoch,
                    last_position: None,
                })
                .into()
            })
            .collect();
        self.cx.out.to_game.extend(remote);
        self.routing.forget_anchors();
        // Adopts the previous game never answered: the new game gets them again.
        let pending = self.handoff.pending_adopts();
        for adopt in pending {
            self.cx
                .out
                .to_game
                .push(sidecar_message::Body::Adopt(adopt).into());
        }
        self.cx
            .set_ready(self.authority.lease_live() && !self.authority.draining());
        for m in rest {
            if let Some(body) = m.body {
                self.on_game_message(body);
            }
        }
    }

    /// The node's area in metres, as the game is told it.
    pub(crate) fn owned_rects(&self) -> Vec<local::Rect> {
        let w = &self.cx.config.world;
        self.authority
            .area()
            .iter()
            .map(|r| {
                let (x, y, width, height) = w.rect_metres(r);
                local::Rect {
                    x,
                    y,
                    width,
                    height,
                }
            })
            .collect()
    }

    pub(crate) fn on_game_message(&mut self, body: game_message::Body) {
        use game_message::Body as B;
        match body {
            B::Hello(_) => self.game_error(
                ErrorCode::UnexpectedMessage,
                "Hello was already received on this connection".into(),
                0,
            ),
            B::Spawn(s) => self.on_spawn(s),
            B::Update(u) => {
                if self.may_write(u.entity_id) {
                    self.on_update(u)
                }
            }
            B::Despawn(d) => {
                if self.table.get_local(d.entity_id).is_none() {
                    return self.entity_error(EntityError::Unknown(d.entity_id));
                }
                if !self.may_write(d.entity_id) {
                    return;
                }
                match self.table.despawn(d.entity_id) {
                    Ok(gone) => {
                        self.game.checkpoints.forget(gone.id);
                        self.command_target_gone(gone.id);
                        self.claims_holder_gone(gone.id);
                        self.despawned_while_frozen(&[gone]);
                    }
                    Err(e) => self.entity_error(e),
                }
            }
            B::Event(e) => self.on_event(e),
            B::Send(s) => self.game.tick_sends.push(TickSend {
                accounts: s.accounts,
                r#type: s.r#type,
                payload: s.payload,
            }),
            B::ReserveIds(r) => {
                if let Err((code, detail)) = self.game.reserve_ids(&mut self.cx, r) {
                    self.game_error(code, detail, 0);
                }
            }
            B::TickEnd(t) => {
                self.game.last_tick_end_ms = Some(self.cx.now.mono_ms);
                self.end_tick(t.tick)
            }
            B::Load(l) => {
                self.on_game_load(&l);
                if let Some(g) = self.game.slot.as_mut() {
                    g.load = Some(l);
                }
            }
            B::Health(h) => {
                if let Some(g) = self.game.slot.as_mut() {
                    g.health = Some(h);
                }
            }
            // Chunk events travel to peers and the journal, which a single node does not have yet.
            B::ChunkEvent(_) => self.cx.metrics.drop_msg("chunk_event_unsupported", 1),
            B::Snapshot(s) => self.on_snapshot(s),
            B::Adopted(a) => self.on_adopted(a),
            B::CheckpointState(c) => {
                let lease_live = self.authority.lease_live();
                self.game
                    .on_checkpoint_state(&self.cx, &self.table, lease_live, c)
            }
            B::Release(r) => self.on_release(r),
            B::Command(c) => self.on_command(c),
            B::CommandReply(r) => self.on_command_reply(r),
            B::Claim(c) => self.on_claim(c),
            B::ClaimRelease(r) => self.on_claim_release(r),
            B::DeclareSpawners(d) => self.on_declare_spawners(d),
        }
    }

    pub(crate) fn on_spawn(&mut self, s: local::Spawn) {
        let components = match local_components(s.entity_id, s.components) {
            Ok(c) => c,
            Err(detail) => return self.game_error(ErrorCode::InvalidValue, detail, s.entity_id),
        };
        if let Err(detail) = self.spawners.check_spawned_id(s.entity_id) {
            return self.game_error(ErrorCode::NotOwner, detail, s.entity_id);
        }
        let spawn = NewEntity {
            id: s.entity_id,
            position: s.position.map(local_position).unwrap_or_default(),
            owner_account: s.owner_account,
            is_master: s.is_master,
            parent_id: s.parent_id,
            components,
            origin: None,
            epoch: FIRST_EPOCH,
        };
        match self.table.spawn(spawn) {
            Ok(()) => {
                self.game
                    .checkpoints
                    .touched(s.entity_id, self.cx.now.mono_ms);
                self.spawners.spawned(s.entity_id);
                if !self.authority.lease_live() && !self.authority.lost() {
                    // Born while the lease is lapsed: frozen with the rest until it is back.
                    self.authority.freeze_newborn(s.entity_id);
                    self.freeze_in_game(s.entity_id);
                }
            }
            Err(e) => self.entity_error(e),
        }
    }

    pub(crate) fn on_update(&mut self, u: local::Update) {
        if self.table.get_local(u.entity_id).is_none() {
            // Ghosts are read-only to the game.
            return self.entity_error(EntityError::Unknown(u.entity_id));
        }
        let changed = match local_components(u.entity_id, u.changed) {
            Ok(c) => c,
            Err(detail) => return self.game_error(ErrorCode::InvalidValue, detail, u.entity_id),
        };
        let update = EntityUpdate {
            id: u.entity_id,
            position: u.position.map(local_position),
            changed,
            removed: u.removed_types,
        };
        match self.table.update(update) {
            Ok(_) => self
                .game
                .checkpoints
                .touched(u.entity_id, self.cx.now.mono_ms),
            Err(e) => self.entity_error(e),
        }
    }

    pub(crate) fn on_event(&mut self, e: local::Event) {
        let audience = match Audience::from_proto(e.audience.as_ref()) {
            Ok(a) => a,
            Err(err) => {
                return self.game_error(
                    ErrorCode::InvalidValue,
                    format!("event on entity {}: {err}", e.entity_id),
                    e.entity_id,
                )
            }
        };
        if self.table.get_local(e.entity_id).is_none() {
            return self.entity_error(EntityError::Unknown(e.entity_id));
        }
        if !self.may_write(e.entity_id) {
            return;
        }
        // Internal: checked above; `may_write` only queues an error, it changes no entity.
        let entity = self.table.get_local(e.entity_id).expect("checked above");
        self.game.tick_events.push(TickEvent {
            entity_id: e.entity_id,
            chunk: entity.chunk,
            owner_account: entity.owner_account.clone(),
            audience,
            r#type: e.r#type,
            payload: e.payload,
        });
    }

    pub(crate) fn entity_error(&mut self, e: EntityError) {
        let code = match e {
            EntityError::Unknown(_) => ErrorCode::UnknownEntity,
            EntityError::Duplicate(_) => ErrorCode::DuplicateEntity,
            EntityError::ZeroId | EntityError::NonFinite { .. } => ErrorCode::InvalidValue,
        };
        self.game_error(code, e.to_string(), e.entity_id());
    }

    /// A non-fatal error about something the game sent: reported, and nothing else changes.
    pub(crate) fn game_error(&mut self, code: ErrorCode, detail: String, entity_id: u64) {
        self.cx.metrics.error(error_kind(code));
        tracing::debug!(?code, %detail, "game error");
        self.cx.out.to_game.push(
            sidecar_message::Body::Error(local::Error {
                code: code as i32,
                detail,
                fatal: false,
                entity_id,
            })
            .into(),
        );
    }

    /// Folds the tick into one batch per client and queues them on their links.
    pub(crate) fn end_tick(&mut self, tick: u64) {
        self.game.last_tick = tick;
        // New entities are asked for in the tick they appear: until a checkpoint of them comes
        // back, a crash of the game would lose them.
        self.game
            .ask_for_checkpoints(&mut self.cx, &self.table, self.authority.lease_live());
        // Clients already got the ghosts' changes sent on arrival; the rest of the tick's work
        // sees the whole tick.
        let fresh = self.table.take_changes();
        let sent = self.gateway.take_ghost_changes_sent();
        let changes = if sent.is_empty() {
            None
        } else {
            let mut all = sent;
            merge_changes(&mut all, &fresh);
            Some(all)
        };
        let changes = changes.as_ref().unwrap_or(&fresh);
        let events = std::mem::take(&mut self.game.tick_events);
        let sends = std::mem::take(&mut self.game.tick_sends);
        self.offer_releases();
        self.route_after_tick();
        // Other nodes first: public changes to subscribers, the rest to gateways by account.
        self.replicate(changes);
        self.replicate_events(&events);
        let sends = self.route_tick(changes, &events, sends);
        self.send_anchors(changes);
        let budget = self.cx.config.max_frame_bytes - TO_CLIENT_OVERHEAD;
        let out = self
            .gateway
            .fold_tick(tick, &self.table, &fresh, &events, &sends, budget);
        self.settle_partition();
        self.update_subscriptions();
        self.step_sim_ghosts(changes, self.cx.now.mono_ms);
        self.check_handoffs(changes);
        self.cx.metrics.ticks.inc();
        self.cx.metrics.deltas_sent.inc_by(out.deltas);
        self.cx.metrics.deltas_encoded.inc_by(out.deltas_encoded);
        self.cx
            .metrics
            .drop_msg("unknown_account", out.unknown_accounts);
        self.set_table_gauges();
        self.maybe_report_load();
        self.gateway
            .send_to_clients(&mut self.cx, out.frames, budget);
    }

    /// The gauges of what the node holds: at every tick, and after every peer frame (which
    /// subscribes, unsubscribes and writes ghosts between ticks).
    pub(crate) fn set_table_gauges(&self) {
        self.cx
            .metrics
            .subscribers
            .set(self.replication.subscriber_count() as i64);
        let ghosts = self.table.ghost_count();
        self.cx
            .metrics
            .entities
            .set(self.table.len().saturating_sub(ghosts) as i64);
        self.cx.metrics.ghosts_render.set(ghosts as i64);
    }

    pub(crate) fn on_game_frame(&mut self, conn: ConnId, messages: Vec<GameMessage>) {
        if self.game.slot.as_ref().is_some_and(|g| g.conn == conn) {
            for m in messages {
                if let Some(body) = m.body {
                    self.on_game_message(body);
                }
            }
        }
    }

    /// The game stopped reading: it is disconnected (the driver already cut the connection).
    pub(crate) fn on_game_stalled(&mut self, conn: ConnId) {
        if self.game.slot.as_ref().is_none_or(|g| g.conn != conn) {
            return;
        }
        self.cx.metrics.error("game_outbox_full");
        tracing::warn!(conn, "game outbox full: disconnecting the game");
        self.on_game_closed(conn, "outbox full: the game is not reading");
    }

    pub(crate) fn on_game_closed(&mut self, conn: ConnId, reason: &str) {
        if self.game.slot.as_ref().is_none_or(|g| g.conn != conn) {
            return;
        }
        tracing::info!(conn, %reason, "game disconnected");
        self.game.slot = None;
        self.cx.metrics.game_connected.set(0);
        self.cx.set_ready(false);
        // Remember where the avatars were, for the PlayerJoin of the next game.
        self.gateway.remember_avatar_positions(&self.table);
        self.replication.clear_sim_ghosts();
        self.game.restoring.clear();
        self.commands_game_gone();
        self.claims_game_gone();
        if self.cx.config.game_grace_ms > 0 && self.authority.lease_live() {
            // Kept for the game's return: clients see them stand still. A handoff still waiting
            // for a snapshot will not get one: those units are abandoned (thawed, kept here).
            self.game.gone_since = Some(self.cx.now.mono_ms);
            self.abandon_freezing("the game went away before its snapshot");
            self.cx.out.to_game.clear();
            self.end_tick(self.game.last_tick + 1);
            return;
        }
        self.cx.out.to_game.clear();
        self.drop_game_entities();
    }

    /// The game's entities go with it; clients see them vanish. Ghosts stay: their owners still
    /// send them.
    pub(crate) fn drop_game_entities(&mut self) {
        self.game.gone_since = None;
        self.game.restoring.clear();
        let gone = self.table.clear_local();
        for e in &gone {
            self.game.checkpoints.forget(e.id);
        }
        self.despawned_while_frozen(&gone);
        self.end_tick(self.game.last_tick + 1);
    }

    /// A game that did not come back within its grace: its entities are despawned.
    pub(crate) fn expire_game_grace(&mut self) {
        if self.game.slot.is_none()
            && self
                .game
                .gone_since
                .is_some_and(|t| self.cx.now.mono_ms >= t + self.cx.config.game_grace_ms)
        {
            tracing::warn!(
                "the game did not come back within game_grace_ms: its entities are despawned"
            );
            self.drop_game_entities();
        }
    }

    /// A game back within its grace gets every entity it wrote from the latest checkpoint, as
    /// an `Adopt` under the entity's epoch (before any `PlayerJoin`, so a player finds its
    /// avatar). One with no checkpoint cannot be restored and is despawned.
    fn restore_to_game(&mut self) {
        if self.game.gone_since.take().is_none() {
            return;
        }
        let kept: Vec<_> = self
            .table
            .iter()
            .filter(|e| e.origin.is_none())
            .map(|e| {
                (
                    e.id,
                    e.epoch,
                    e.position,
                    e.owner_account.clone(),
                    e.is_master,
                )
            })
            .collect();
        for (id, epoch, p, owner_account, is_master) in kept {
            let Some(state) = self.game.checkpoints.latest(id).map(|k| k.state.clone()) else {
                tracing::warn!(
                    entity = id,
                    "no checkpoint to give back to the game: despawned"
                );
                if let Ok(gone) = self.table.despawn(id) {
                    self.game.checkpoints.forget(gone.id);
                    self.game.unrestorable.push(gone.id);
                }
                self.cx.metrics.drop_msg("restore_without_checkpoint", 1);
                continue;
            };
            self.game.restoring.insert(id);
            self.cx.out.to_game.push(
                sidecar_message::Body::Adopt(local::Adopt {
                    entity_id: id,
                    entity_epoch: epoch,
                    position: Some(local::Vec3 {
                        x: p.x,
                        y: p.y,
                        z: p.z,
                    }),
                    state,
                    owner_account,
                    is_master,
                    attachments: vec![],
                })
                .into(),
            );
        }
    }
}
