//! The local game: its connection, what it sends each tick, and the end of a tick (README.md#how-a-game-server-adopts-the-local-protocol).
//!
//! This part keeps the game's connection, what it sent during the current tick, the ids it
//! mints, the checkpoints asked of it and the entities kept for its return. Its handlers check
//! what the game sends against the table and answer the game's mistakes themselves; what a
//! spawn, a despawn, the end of a tick or the game's leaving comes to for the other parts, the
//! core carries out.

use std::collections::BTreeSet;

use cellmesh_proto::local::{self, sidecar_message, ErrorCode};
use cellmesh_stores::topology::Lease;
use serde_json::json;

use super::authority::Authority;
use super::context::Context;
use super::wire::{error_kind, local_components, local_position};
use super::{ConnId, Output, TO_CLIENT_OVERHEAD};
use crate::config::SidecarConfig;
use crate::model::audience::Audience;
use crate::model::checkpoints::Checkpoints;
use crate::model::entities::{Entity, EntityError, EntityTable, EntityUpdate, NewEntity};
use crate::model::fold::{TickEvent, TickSend};
use crate::model::ids::IdMinter;

/// The game connected to this node, as the node knows it.
struct GameSlot {
    conn: ConnId,
    hello: local::Hello,
    health: Option<local::Health>,
    load: Option<local::Load>,
}

/// The local game and what it sent during the current tick.
pub(crate) struct LocalGame {
    slot: Option<GameSlot>,
    tick_events: Vec<TickEvent>,
    tick_sends: Vec<TickSend>,
    last_tick: u64,
    /// When the game's last `TickEnd` came (monotonic ms): where a handoff's snapshot finds the
    /// end of its entity's last simulated tick.
    last_tick_end_ms: Option<u64>,
    ids: IdMinter,
    /// The latest state of every entity written here, asked of the game.
    checkpoints: Checkpoints,
    /// Since when the game has been gone with its entities kept for its return (monotonic ms).
    gone_since: Option<u64>,
    /// Entities handed back to a returning game with `Adopt`, not yet `Adopted`.
    restoring: BTreeSet<u64>,
    /// Entities despawned because their game went away before any checkpoint of them came.
    unrestorable: Vec<u64>,
}

/// What a game's `Hello` came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hello {
    /// Turned away (another game is connected, or the node is shutting down): nothing changed.
    Refused,
    /// The game is connected and welcomed, with its kept entities handed back to it.
    Connected,
}

/// What the end of a tick takes from the game part: the tick's events and sends, for the
/// other parts to route and fold.
pub(crate) struct TickWork {
    pub events: Vec<TickEvent>,
    pub sends: Vec<TickSend>,
}

/// What the game's leaving leaves behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gone {
    /// Not the game connected: nothing changed.
    NotConnected,
    /// Its entities are kept for its return within its grace.
    Kept,
    /// Its entities go with it.
    Dropped,
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

    /// Whether a game is connected now (it said `Hello`).
    pub(crate) fn connected(&self) -> bool {
        self.slot.is_some()
    }

    /// The game's connection, if one is connected.
    pub(crate) fn conn(&self) -> Option<ConnId> {
        self.slot.as_ref().map(|g| g.conn)
    }

    /// Whether `conn` is the connected game's.
    pub(crate) fn is_conn(&self, conn: ConnId) -> bool {
        self.conn() == Some(conn)
    }

    /// The game's tick in milliseconds, from the rate it named in its `Hello`.
    pub(crate) fn tick_ms(&self) -> Option<f64> {
        self.slot
            .as_ref()
            .map(|g| g.hello.tick_rate_hz)
            .filter(|hz| *hz > 0)
            .map(|hz| 1000.0 / f64::from(hz))
    }

    /// The last tick the game ended (or the node ended for it, once it went away).
    pub(crate) fn last_tick(&self) -> u64 {
        self.last_tick
    }

    /// When the game's last `TickEnd` came (monotonic ms).
    pub(crate) fn last_tick_end_ms(&self) -> Option<u64> {
        self.last_tick_end_ms
    }

    /// The checkpoints of the entities written here.
    pub(crate) fn checkpoints(&self) -> &Checkpoints {
        &self.checkpoints
    }

    /// The checkpoints, for the parts that take (a handoff's snapshot, an adoption), forget
    /// (a handoff completed) and write them to the store.
    pub(crate) fn checkpoints_mut(&mut self) -> &mut Checkpoints {
        &mut self.checkpoints
    }

    /// Ids are minted until the renewed lease's expiry (a lease of another node id is refused:
    /// minting then stays bounded by the old one).
    pub(crate) fn lease_renewed(&mut self, lease: &Lease) {
        let _ = self.ids.renewed(lease);
    }

    /// An event the game hears at the end of the tick (a render ghost's, from its writer).
    pub(crate) fn hear_event(&mut self, event: TickEvent) {
        self.tick_events.push(event);
    }

    /// Entities despawned since the last call because their game went away before any
    /// checkpoint of them came back.
    pub(crate) fn take_unrestorable(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.unrestorable)
    }

    /// The game as `/state` shows it.
    pub(crate) fn state(&self) -> Option<serde_json::Value> {
        self.slot.as_ref().map(|g| {
            let v = g.hello.version.unwrap_or_default();
            json!({
                "conn": g.conn,
                "game": g.hello.game,
                "version": format!("{}.{}", v.major, v.minor),
                "tick_rate_hz": g.hello.tick_rate_hz,
                "health": g.health.as_ref().map(|h| json!({"ok": h.ok, "detail": h.detail})),
                "load": g.load.as_ref().map(|l| json!({"tick_ms": l.tick_ms, "budget_ms": l.budget_ms, "entity_count": l.entity_count})),
            })
        })
    }

    /// A game's `Hello`: a second game is refused (fatally, on its own connection), and so is
    /// any while the node shuts down; one taken is welcomed and given back what it wrote before
    /// it went away.
    pub(crate) fn on_hello(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        authority: &Authority,
        shutting_down: bool,
        conn: ConnId,
        hello: local::Hello,
    ) -> Hello {
        if let Some(current) = &self.slot {
            let detail = format!(
                "a game ({:?}) is already connected to this sidecar; it serves one game at a time",
                current.hello.game
            );
            let error = local::Error {
                code: ErrorCode::AlreadyConnected as i32,
                detail,
                fatal: true,
                entity_id: 0,
            };
            cx.emit(Output::GameFatal { conn, error });
            return Hello::Refused;
        }
        if shutting_down {
            cx.emit(Output::ReleaseGame { conn });
            return Hello::Refused;
        }
        tracing::info!(conn, game = %hello.game, "game connected");
        let hello_rate = hello.tick_rate_hz;
        self.slot = Some(GameSlot {
            conn,
            hello,
            health: None,
            load: None,
        });
        cx.metrics.game_connected.set(1);
        let w = &cx.config.world;
        let welcome = local::Welcome {
            version: Some(local::ProtocolVersion::current()),
            node_id: cx.config.node_id,
            world: Some(local::WorldShape {
                width: w.width,
                height: w.height,
                chunk_size: w.chunk_size,
                region_size: w.region_size,
            }),
            owned_area: owned_area(cx, authority),
            partition_epoch: authority.partition().epoch(),
            tick_phase: Some(local::TickPhase {
                origin_unix_ms: TICK_ORIGIN_UNIX_MS,
                tick_rate_hz: if hello_rate > 0 {
                    hello_rate
                } else {
                    DEFAULT_TICK_HZ
                },
            }),
            handoff_margin_chunks: cx.config.handoff_margin_chunks,
        };
        cx.out
            .to_game
            .push(sidecar_message::Body::Welcome(welcome).into());
        self.restore_to_game(cx, table);
        Hello::Connected
    }

    /// A game back within its grace gets every entity it wrote from the latest checkpoint, as
    /// an `Adopt` under the entity's epoch (before any `PlayerJoin`, so a player finds its
    /// avatar). One with no checkpoint cannot be restored and is despawned.
    fn restore_to_game(&mut self, cx: &mut Context, table: &mut EntityTable) {
        if self.gone_since.take().is_none() {
            return;
        }
        let kept: Vec<_> = table
            .iter()
            .filter(|e| e.origin().is_none())
            .map(|e| {
                (
                    e.id,
                    e.epoch,
                    e.position,
                    e.owner_account.to_string(),
                    e.is_master,
                )
            })
            .collect();
        for (id, epoch, p, owner_account, is_master) in kept {
            let Some(state) = self.checkpoints.latest(id).map(|k| k.state.clone()) else {
                tracing::warn!(
                    entity = id,
                    "no checkpoint to give back to the game: despawned"
                );
                if let Ok(gone) = table.despawn(id) {
                    self.checkpoints.forget(gone.id);
                    self.unrestorable.push(gone.id);
                }
                cx.metrics.drop_msg("restore_without_checkpoint", 1);
                continue;
            };
            self.restoring.insert(id);
            cx.out.to_game.push(
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

    /// The game's `Adopted` of an entity it was handed back on its return: it writes it again
    /// from here on. False when the `Adopted` answers something else (an offer).
    pub(crate) fn took_back(
        &mut self,
        cx: &Context,
        table: &EntityTable,
        a: &local::Adopted,
    ) -> bool {
        let restored = table
            .get_local(a.entity_id)
            .is_some_and(|e| e.epoch == a.entity_epoch);
        if !restored || !self.restoring.remove(&a.entity_id) {
            return false;
        }
        cx.metrics.restored.inc();
        self.checkpoints.touched(a.entity_id, cx.now.mono_ms);
        true
    }

    /// The game's `Spawn`: the entity written here from now on. Returns its id, or `None` when
    /// the game was told what is wrong with it. `check_id` is whether a spawn point's id is one
    /// this node was given to stock.
    pub(crate) fn on_spawn(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        check_id: impl FnOnce(u64) -> Result<(), String>,
        s: local::Spawn,
    ) -> Option<u64> {
        let id = s.entity_id;
        let components = match local_components(id, s.components) {
            Ok(c) => c,
            Err(detail) => return refuse(cx, ErrorCode::InvalidValue, detail, id),
        };
        if let Err(detail) = check_id(id) {
            return refuse(cx, ErrorCode::NotOwner, detail, id);
        }
        let spawn = NewEntity {
            id,
            position: s.position.map(local_position).unwrap_or_default(),
            owner_account: s.owner_account,
            is_master: s.is_master,
            parent_id: s.parent_id,
            components,
            origin: None,
            epoch: FIRST_EPOCH,
        };
        match table.spawn(spawn) {
            Ok(()) => {
                self.checkpoints.touched(id, cx.now.mono_ms);
                Some(id)
            }
            Err(e) => {
                entity_error(cx, e);
                None
            }
        }
    }

    /// The game's `Update`, unless `refused` says why the game may not write the entity now.
    pub(crate) fn on_update(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        refused: Option<String>,
        u: local::Update,
    ) {
        let id = u.entity_id;
        if let Some(detail) = refused {
            return error(cx, ErrorCode::NotOwner, detail, id);
        }
        if table.get_local(id).is_none() {
            // Ghosts are read-only to the game.
            return entity_error(cx, EntityError::Unknown(id));
        }
        let changed = match local_components(id, u.changed) {
            Ok(c) => c,
            Err(detail) => return error(cx, ErrorCode::InvalidValue, detail, id),
        };
        let update = EntityUpdate {
            id,
            position: u.position.map(local_position),
            changed,
            removed: u.removed_types,
        };
        match table.update(update) {
            Ok(_) => self.checkpoints.touched(id, cx.now.mono_ms),
            Err(e) => entity_error(cx, e),
        }
    }

    /// The game's `Despawn`, unless `refused` says why the game may not write the entity now.
    /// Returns the entity gone.
    pub(crate) fn on_despawn(
        &mut self,
        cx: &mut Context,
        table: &mut EntityTable,
        refused: Option<String>,
        d: local::Despawn,
    ) -> Option<Entity> {
        let id = d.entity_id;
        if table.get_local(id).is_none() {
            entity_error(cx, EntityError::Unknown(id));
            return None;
        }
        if let Some(detail) = refused {
            return refuse(cx, ErrorCode::NotOwner, detail, id);
        }
        match table.despawn(id) {
            Ok(gone) => {
                self.checkpoints.forget(gone.id);
                Some(gone)
            }
            Err(e) => {
                entity_error(cx, e);
                None
            }
        }
    }

    /// The game's `Event`, heard by clients at the end of the tick, unless `refused` says why
    /// the game may not write the entity now.
    pub(crate) fn on_event(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        refused: Option<String>,
        e: local::Event,
    ) {
        let id = e.entity_id;
        let audience = match Audience::from_proto(e.audience.as_ref()) {
            Ok(a) => a,
            Err(err) => {
                let detail = format!("event on entity {id}: {err}");
                return error(cx, ErrorCode::InvalidValue, detail, id);
            }
        };
        let Some(entity) = table.get_local(id) else {
            return entity_error(cx, EntityError::Unknown(id));
        };
        if let Some(detail) = refused {
            return error(cx, ErrorCode::NotOwner, detail, id);
        }
        self.tick_events.push(TickEvent {
            entity_id: id,
            chunk: entity.chunk,
            owner_account: entity.owner_account.to_string(),
            audience,
            r#type: e.r#type,
            payload: e.payload,
        });
    }

    /// The game's `Send`: folded for its accounts at the end of the tick.
    pub(crate) fn on_send(&mut self, s: local::Send) {
        self.tick_sends.push(TickSend {
            accounts: s.accounts,
            r#type: s.r#type,
            payload: s.payload,
        });
    }

    /// The game's `Load` report, as `/state` shows it.
    pub(crate) fn on_load(&mut self, l: local::Load) {
        if let Some(g) = self.slot.as_mut() {
            g.load = Some(l);
        }
    }

    /// The game's `Health` report, as `/state` shows it.
    pub(crate) fn on_health(&mut self, h: local::Health) {
        if let Some(g) = self.slot.as_mut() {
            g.health = Some(h);
        }
    }

    /// The game's `TickEnd` came now.
    pub(crate) fn on_tick_end(&mut self, cx: &Context) {
        self.last_tick_end_ms = Some(cx.now.mono_ms);
    }

    /// The end of `tick`: the checkpoints due are asked for, and the tick's events and sends
    /// are handed on.
    pub(crate) fn end_tick(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        lease_live: bool,
        tick: u64,
    ) -> TickWork {
        self.last_tick = tick;
        // New entities are asked for in the tick they appear: until a checkpoint of them comes
        // back, a crash of the game would lose them.
        self.ask_for_checkpoints(cx, table, lease_live);
        TickWork {
            events: std::mem::take(&mut self.tick_events),
            sends: std::mem::take(&mut self.tick_sends),
        }
    }

    /// The game stopped reading: whether it is the game connected on `conn` (the driver already
    /// cut the connection).
    pub(crate) fn stalled(&self, cx: &Context, conn: ConnId) -> bool {
        if !self.is_conn(conn) {
            return false;
        }
        cx.metrics.error("game_outbox_full");
        tracing::warn!(conn, "game outbox full: disconnecting the game");
        true
    }

    /// The game on `conn` went away: the node is not ready without it, and what was queued for
    /// it goes. Its entities are kept for its return when it has a grace and the lease is live
    /// (clients see them stand still), else they go with it.
    pub(crate) fn on_closed(
        &mut self,
        cx: &mut Context,
        lease_live: bool,
        conn: ConnId,
        reason: &str,
    ) -> Gone {
        if !self.is_conn(conn) {
            return Gone::NotConnected;
        }
        tracing::info!(conn, %reason, "game disconnected");
        self.slot = None;
        cx.metrics.game_connected.set(0);
        cx.set_ready(false);
        self.restoring.clear();
        if cx.config.game_grace_ms > 0 && lease_live {
            self.gone_since = Some(cx.now.mono_ms);
            return Gone::Kept;
        }
        Gone::Dropped
    }

    /// The game's entities go with it: returns them (ghosts stay: their owners still send
    /// them).
    pub(crate) fn drop_entities(&mut self, table: &mut EntityTable) -> Vec<Entity> {
        self.gone_since = None;
        self.restoring.clear();
        let gone = table.clear_local();
        for e in &gone {
            self.checkpoints.forget(e.id);
        }
        gone
    }

    /// Whether the game stayed away past its grace (its entities are to go).
    pub(crate) fn grace_expired(&self, cx: &Context) -> bool {
        let expired = self.slot.is_none()
            && self
                .gone_since
                .is_some_and(|t| cx.now.mono_ms >= t + cx.config.game_grace_ms);
        if expired {
            tracing::warn!(
                "the game did not come back within game_grace_ms: its entities are despawned"
            );
        }
        expired
    }

    /// The node is shutting down: the game's connection, if one is connected, is let go.
    pub(crate) fn release(&mut self, cx: &mut Context) {
        if let Some(g) = self.slot.take() {
            cx.emit(Output::ReleaseGame { conn: g.conn });
        }
        cx.metrics.game_connected.set(0);
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

    /// Whether the game hands everything over by `Release` (protocol 1.8 and later): it takes
    /// `Offload`, and releases a player's avatar naming the last input it applied (those it got
    /// after are handed on).
    pub(crate) fn hands_over_by_release(&self) -> bool {
        self.slot
            .as_ref()
            .and_then(|g| g.hello.version.as_ref())
            .is_some_and(|v| v.minor >= 8)
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

    /// The game's `ReserveIds`: the ids minted, or the game hears why none are.
    pub(crate) fn reserve_ids(&mut self, cx: &mut Context, r: local::ReserveIds) {
        // Each id costs at most 9 bytes on the wire; the answer must fit one frame.
        let max = MAX_RESERVE.min(cx.config.max_frame_bytes.saturating_sub(TO_CLIENT_OVERHEAD) / 9);
        let count = r.count as usize;
        if count > max {
            let detail = format!(
                "ReserveIds {} asks for {count} ids; at most {max} per request",
                r.request_id
            );
            return error(cx, ErrorCode::InvalidValue, detail, 0);
        }
        let ids = match self.ids.mint_many(cx.now.unix_ms, count) {
            Ok(ids) => ids,
            Err(e) => {
                let detail = format!("ReserveIds {}: {e}", r.request_id);
                return error(cx, ErrorCode::NotOwner, detail, 0);
            }
        };
        cx.out.to_game.push(
            sidecar_message::Body::IdsReserved(local::IdsReserved {
                request_id: r.request_id,
                ids,
            })
            .into(),
        );
    }
}

/// The node's area in metres, as the game is told it.
pub(crate) fn owned_area(cx: &Context, authority: &Authority) -> Vec<local::Rect> {
    let w = &cx.config.world;
    authority
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

/// A non-fatal error about something the game sent: reported, and nothing else changes.
pub(crate) fn error(cx: &mut Context, code: ErrorCode, detail: String, entity_id: u64) {
    cx.metrics.error(error_kind(code));
    tracing::debug!(?code, %detail, "game error");
    cx.out.to_game.push(
        sidecar_message::Body::Error(local::Error {
            code: code as i32,
            detail,
            fatal: false,
            entity_id,
        })
        .into(),
    );
}

/// A table's refusal of what the game sent, reported as [`error`].
pub(crate) fn entity_error(cx: &mut Context, e: EntityError) {
    let code = match e {
        EntityError::Unknown(_) => ErrorCode::UnknownEntity,
        EntityError::Duplicate(_) => ErrorCode::DuplicateEntity,
        EntityError::ZeroId | EntityError::NonFinite { .. } => ErrorCode::InvalidValue,
    };
    error(cx, code, e.to_string(), e.entity_id());
}

/// Reports [`error`] where a handler answers with nothing.
fn refuse<T>(cx: &mut Context, code: ErrorCode, detail: String, entity_id: u64) -> Option<T> {
    error(cx, code, detail, entity_id);
    None
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;
    use cellmesh_world::geometry::WorldShape;
    use cellmesh_world::partition::{Grid, Layout, Partition};

    use super::*;
    use crate::core::Now;
    use crate::metrics::Metrics;

    const NPC: u64 = 30;

    /// A lone node's game part, its context, table and authority, the game connected.
    fn connected() -> (LocalGame, Context, EntityTable, Authority) {
        let world = WorldShape {
            width: 512.0,
            height: 512.0,
            chunk_size: 32.0,
            region_size: 256.0,
        };
        let grid = Grid::even(&world, 1, 1, &[1]).unwrap();
        let partition = Arc::new(Partition::new(world, 1, Layout::Grid(grid)).unwrap());
        let cfg = SidecarConfig {
            node_id: 1,
            world,
            ..SidecarConfig::default()
        };
        let authority = Authority::new(&cfg, partition, None);
        let mut cx = Context::new(Arc::new(cfg.clone()), Metrics::default(), Now::default());
        let mut table = EntityTable::new(world);
        let mut game = LocalGame::new(&cfg, None);
        let hello = hello(&mut game, &mut cx, &mut table, &authority);
        assert_eq!(hello, Hello::Connected);
        (game, cx, table, authority)
    }

    fn hello(
        game: &mut LocalGame,
        cx: &mut Context,
        table: &mut EntityTable,
        authority: &Authority,
    ) -> Hello {
        let hello = local::Hello {
            version: Some(local::ProtocolVersion::current()),
            tick_rate_hz: 20,
            game: "test".into(),
        };
        game.on_hello(cx, table, authority, false, 1, hello)
    }

    /// What was queued for the game since the last call.
    fn heard(cx: &mut Context) -> Vec<sidecar_message::Body> {
        std::mem::take(&mut cx.out.to_game)
            .into_iter()
            .filter_map(|m| m.body)
            .collect()
    }

    fn error_codes(cx: &mut Context) -> Vec<i32> {
        heard(cx)
            .into_iter()
            .filter_map(|b| match b {
                sidecar_message::Body::Error(e) => Some(e.code),
                _ => None,
            })
            .collect()
    }

    fn spawn(game: &mut LocalGame, cx: &mut Context, table: &mut EntityTable, id: u64) {
        let s = local::Spawn {
            entity_id: id,
            position: Some(local::Vec3 {
                x: 10.0,
                y: 10.0,
                z: 0.0,
            }),
            ..Default::default()
        };
        assert_eq!(game.on_spawn(cx, table, |_| Ok(()), s), Some(id));
    }

    /// The game hears why it may not write before whether the entity exists (as the sidecar
    /// has always answered an `Update`), but a `Despawn` of an entity it never had is unknown
    /// whatever the node's state.
    #[test]
    fn a_refused_write_is_answered_in_the_order_of_its_checks() {
        let (mut game, mut cx, mut table, _) = connected();
        heard(&mut cx);
        let refused = || Some("frozen".to_string());
        let update = local::Update {
            entity_id: NPC,
            ..Default::default()
        };
        game.on_update(&mut cx, &mut table, refused(), update);
        assert_eq!(error_codes(&mut cx), [ErrorCode::NotOwner as i32]);
        let despawn = local::Despawn { entity_id: NPC };
        assert!(game
            .on_despawn(&mut cx, &mut table, refused(), despawn)
            .is_none());
        assert_eq!(error_codes(&mut cx), [ErrorCode::UnknownEntity as i32]);

        spawn(&mut game, &mut cx, &mut table, NPC);
        let despawn = local::Despawn { entity_id: NPC };
        assert!(game
            .on_despawn(&mut cx, &mut table, refused(), despawn)
            .is_none());
        assert_eq!(error_codes(&mut cx), [ErrorCode::NotOwner as i32]);
        assert!(
            table.get_local(NPC).is_some(),
            "a refused despawn changes nothing"
        );
        let despawn = local::Despawn { entity_id: NPC };
        let gone = game.on_despawn(&mut cx, &mut table, None, despawn);
        assert_eq!(gone.map(|e| e.id), Some(NPC));
        assert!(table.get_local(NPC).is_none());
    }

    /// A game back within its grace is welcomed, then given back what it wrote from its
    /// checkpoints; an entity with none is despawned and counted as lost.
    #[test]
    fn a_returning_game_gets_back_what_it_wrote_after_its_welcome() {
        let (mut game, mut cx, mut table, authority) = connected();
        let kept = NPC + 1;
        spawn(&mut game, &mut cx, &mut table, NPC);
        spawn(&mut game, &mut cx, &mut table, kept);
        let checkpoint = local::CheckpointState {
            entity_id: kept,
            entity_epoch: FIRST_EPOCH,
            state: Bytes::from_static(b"kept"),
        };
        game.on_checkpoint_state(&cx, &table, true, checkpoint);
        assert_eq!(game.on_closed(&mut cx, true, 1, "gone"), Gone::Kept);
        assert!(!game.connected());
        heard(&mut cx);

        assert_eq!(
            hello(&mut game, &mut cx, &mut table, &authority),
            Hello::Connected
        );
        let heard = heard(&mut cx);
        assert!(matches!(heard[0], sidecar_message::Body::Welcome(_)));
        let adopts: Vec<(u64, Bytes)> = heard[1..]
            .iter()
            .filter_map(|b| match b {
                sidecar_message::Body::Adopt(a) => Some((a.entity_id, a.state.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(adopts, [(kept, Bytes::from_static(b"kept"))]);
        assert!(table.get_local(NPC).is_none());
        assert_eq!(game.take_unrestorable(), [NPC]);

        let adopted = local::Adopted {
            entity_id: kept,
            entity_epoch: FIRST_EPOCH,
        };
        assert!(game.took_back(&cx, &table, &adopted));
        assert!(!game.took_back(&cx, &table, &adopted), "taken back once");
    }

    /// A second game is turned away on its own connection; the first stays.
    #[test]
    fn a_second_game_is_refused_fatally() {
        let (mut game, mut cx, mut table, authority) = connected();
        cx.out.pending.clear();
        let second = local::Hello {
            game: "other".into(),
            ..Default::default()
        };
        let hello = game.on_hello(&mut cx, &mut table, &authority, false, 2, second);
        assert_eq!(hello, Hello::Refused);
        assert!(matches!(
            cx.out.pending.pop_front(),
            Some(Output::GameFatal { conn: 2, error }) if error.fatal
        ));
        assert_eq!(game.conn(), Some(1));
    }
}
