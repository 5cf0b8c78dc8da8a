//! The arena's simulation: pure logic driven by the sidecar's messages and the tick, writing its
//! messages to an [`Outbox`]. No I/O here; `run` owns the socket. One file per concept:
//! [`players`], [`npcs`] (dens included), [`handoff`], [`attacks`], [`trading`], [`ghosts`], the
//! [`entity`] and the [`torus`] it walks.

mod attacks;
mod entity;
mod ghosts;
mod handoff;
mod npcs;
mod players;
#[cfg(test)]
mod tests;
mod torus;
mod trading;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use cellmesh_proto::local::{
    game_message::Body, sidecar_message, Audience, AudienceKind, Component, Event, Update, Welcome,
};
use cellmesh_proto::sdk::{GameSender, OwnedArea};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::combat;
use crate::schema;
use crate::trade::{self, Trade};
use crate::{ArenaConfig, ArenaStats, Census};
use entity::{Entity, Player, Role};
pub(crate) use torus::Torus;

/// The name of every den NPC starts so (its kind is `npc:den:<key>#<generation>`).
const DEN_PREFIX: &str = "den:";

/// Ticks an entity whose release was kept waits before it is released again.
const RELEASE_BACKOFF_TICKS: u64 = 20;

/// Where the arena writes: the SDK's batch in a run, a plain list in tests and simulations.
pub trait Outbox {
    fn push(&mut self, body: Body);
}

impl Outbox for GameSender {
    fn push(&mut self, body: Body) {
        GameSender::push(self, body)
    }
}

impl Outbox for Vec<Body> {
    fn push(&mut self, body: Body) {
        Vec::push(self, body)
    }
}

fn public() -> Option<Audience> {
    Some(Audience {
        kind: AudienceKind::PublicInRange as i32,
        accounts: vec![],
    })
}

fn owner_only() -> Option<Audience> {
    Some(Audience {
        kind: AudienceKind::OwnerOnly as i32,
        accounts: vec![],
    })
}

fn owner_and_party(party: &[String]) -> Option<Audience> {
    Some(Audience {
        kind: AudienceKind::OwnerAndParty as i32,
        accounts: party.to_vec(),
    })
}

fn component(r#type: u32, payload: Bytes, audience: Option<Audience>) -> Component {
    Component {
        r#type,
        payload,
        audience,
    }
}
/// A `PlayerJoin` that arrived while no id was free: account, session epoch, last position.
type PendingJoin = (String, u64, Option<(f64, f64)>);

/// The arena's world: its entities, players and NPCs, driven by the sidecar's messages and the
/// tick. Pure: a run or a simulator owns the connection and the clock.
pub struct Arena {
    cfg: ArenaConfig,
    /// This arena's label in the census: its node id.
    node: u32,
    torus: Torus,
    /// The area this arena's node owns, by which it releases what walks out of it.
    area: OwnedArea,
    rng: StdRng,
    ids: Vec<u64>,
    next_request: u64,
    ids_requested: bool,
    /// NPCs this arena created; adopted and evicted ones do not change it, so a handoff never
    /// makes an arena spawn a replacement.
    npcs_spawned: u32,
    entities: BTreeMap<u64, Entity>,
    /// Account -> its avatar's id.
    players: HashMap<String, u64>,
    waiting: Vec<PendingJoin>,
    /// Nothing moves any more (a simulator's quiet end).
    halted: bool,
    /// Ticks simulated.
    ticks: u64,
    /// NPCs other nodes simulate, as this arena sees their ghosts: id -> position.
    npc_ghosts: BTreeMap<u64, (f64, f64)>,
    /// Commands sent and waiting for their result: request id -> (type, acting entity).
    outstanding: HashMap<u64, (u32, u64)>,
    next_command: u64,
    /// Avatars with an attack on its way (one at a time each).
    attacking: HashSet<u64>,
    /// Players other nodes simulate, as this arena sees their ghosts: id -> (account, position).
    player_ghosts: BTreeMap<u64, (String, (f64, f64))>,
    /// Trades this arena opened, by the opener's avatar (see `trade`).
    trades: BTreeMap<u64, Trade>,
    /// Claims asked for and not answered: request id -> the opener's avatar.
    claims_asked: HashMap<u64, u64>,
    /// Claims of trades that ended before their answer: request id -> avatar, released if
    /// granted.
    release_on_answer: HashMap<u64, u64>,
    next_claim: u64,
    pub stats: ArenaStats,
}

/// One entity the arena holds, as a simulator sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Held {
    pub id: u64,
    pub pos: (f64, f64),
    pub frozen: bool,
    pub player: bool,
}

impl Arena {
    pub fn new(cfg: ArenaConfig, welcome: &Welcome) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        Self {
            cfg,
            node: welcome.node_id,
            torus: Torus::from_welcome(welcome),
            area: OwnedArea::from_welcome(welcome),
            rng,
            ids: Vec::new(),
            next_request: 1,
            ids_requested: false,
            npcs_spawned: 0,
            entities: BTreeMap::new(),
            players: HashMap::new(),
            waiting: Vec::new(),
            halted: false,
            ticks: 0,
            npc_ghosts: BTreeMap::new(),
            outstanding: HashMap::new(),
            next_command: 0,
            attacking: HashSet::new(),
            player_ghosts: BTreeMap::new(),
            trades: BTreeMap::new(),
            claims_asked: HashMap::new(),
            release_on_answer: HashMap::new(),
            next_claim: 0,
            stats: ArenaStats::default(),
        }
    }

    pub fn entity_count(&self) -> usize {
        self.entities.len()
    }

    /// Every entity this arena holds (its own, frozen or not), in id order.
    pub fn held(&self) -> impl Iterator<Item = Held> + '_ {
        self.entities.iter().map(|(&id, e)| Held {
            id,
            pos: e.pos,
            frozen: e.frozen,
            player: matches!(e.role, Role::Player(_)),
        })
    }

    /// The avatar of `account`, if this arena holds it.
    pub fn avatar_of(&self, account: &str) -> Option<u64> {
        self.players.get(account).copied()
    }

    /// Stops every movement from now on (NPCs stop wandering, players stop walking).
    pub fn halt(&mut self) {
        self.halted = true;
    }

    fn census(&self) -> Option<&Arc<Census>> {
        self.cfg.census.as_ref()
    }

    pub fn on_message(&mut self, out: &mut impl Outbox, msg: sidecar_message::Body) {
        use sidecar_message::Body as M;
        match msg {
            M::IdsReserved(r) => self.on_ids_reserved(out, r),
            M::PlayerJoin(j) => self.on_join(out, j),
            M::PlayerLeave(l) => self.on_leave(out, l),
            M::Input(i) => self.on_input(i),
            M::Freeze(f) => self.on_freeze(out, f),
            M::Offload(o) => self.on_offload(o),
            M::Checkpoint(c) => self.on_checkpoint(out, c),
            M::Thaw(t) => self.on_thaw(out, t),
            M::Evict(v) => self.on_evict(v),
            M::Adopt(a) => self.adopt(out, a),
            M::GhostEnter(g) => self.on_ghost_enter(g),
            M::GhostUpdate(g) => self.on_ghost_update(g),
            M::GhostLeave(g) => self.on_ghost_leave(g),
            M::CommandIn(c) => self.on_command(out, c),
            M::CommandResult(r) => self.on_command_result(out, r),
            M::ClaimResult(r) => self.on_claim_result(out, r),
            M::ClaimLost(l) if l.key.starts_with("spawner:") => {
                self.despawn_den_npc(out, l.holder_entity)
            }
            M::ClaimLost(l) => self.on_claim_lost(out, l),
            M::SpawnerOwned(o) => self.stock_den(out, o),
            M::SpawnerReleased(r) => {
                self.stats.dens_released += 1;
                tracing::debug!(key = %r.key, reason = %r.reason, "den given up");
            }
            M::PartitionChanged(p) => {
                self.area.set_rects(p.owned_area.clone());
                tracing::info!(
                    epoch = p.partition_epoch,
                    rects = p.owned_area.len(),
                    "owned area changed"
                );
            }
            M::Error(e) => {
                self.stats.errors_from_sidecar += 1;
                tracing::warn!(code = e.code, detail = %e.detail, entity = e.entity_id, "sidecar reported an error");
            }
            other => tracing::debug!(?other, "arena ignores this message"),
        }
    }

    pub fn tick(&mut self, out: &mut impl Outbox, dt: f64) {
        let halted = self.halted;
        self.ticks += 1;
        let now = self.ticks;
        let Self {
            cfg,
            torus,
            area,
            rng,
            entities,
            stats,
            ..
        } = self;
        let half = cfg.spread / 2.0;
        // Avatars that walked out of the area this tick, released after the loop.
        let mut avatars_out = Vec::new();
        for (&id, e) in entities.iter_mut() {
            if e.frozen || halted {
                continue;
            }
            match &mut e.role {
                Role::Npc { turn_in, .. } => {
                    *turn_in = turn_in.saturating_sub(1);
                    if *turn_in == 0 {
                        e.dir = Self::random_dir(rng);
                        *turn_in = 40;
                    }
                    // Wander inside the arena square: turn back at its edge, the short way round.
                    let (dx, dy) = torus.delta(cfg.center, e.pos);
                    if dx.abs() > half {
                        e.dir.0 = -dx.signum() * e.dir.0.abs();
                    }
                    if dy.abs() > half {
                        e.dir.1 = -dy.signum() * e.dir.1.abs();
                    }
                    let step = cfg.npc_speed * dt;
                    e.pos = torus.normalise((e.pos.0 + e.dir.0 * step, e.pos.1 + e.dir.1 * step));
                    out.push(Body::Update(Update {
                        entity_id: id,
                        position: Some(e.position()),
                        ..Default::default()
                    }));
                    if rng.random_ratio(1, 400) {
                        out.push(Body::Event(Event {
                            entity_id: id,
                            r#type: schema::EVENT_EMOTE,
                            payload: Bytes::from_static(b"waves"),
                            audience: public(),
                        }));
                    }
                }
                Role::Player(p) => {
                    let moving = e.dir != (0.0, 0.0);
                    if moving {
                        let step = cfg.player_speed * dt;
                        e.pos =
                            torus.normalise((e.pos.0 + e.dir.0 * step, e.pos.1 + e.dir.1 * step));
                    }
                    let mut changed = Vec::new();
                    if p.ack_dirty {
                        changed.push(component(
                            schema::INPUT_ACK,
                            schema::input_ack(p.last_seq, p.applied),
                            owner_only(),
                        ));
                        p.ack_dirty = false;
                    }
                    if moving || !changed.is_empty() {
                        out.push(Body::Update(Update {
                            entity_id: id,
                            position: moving.then(|| e.position()),
                            changed,
                            removed_types: vec![],
                        }));
                    }
                }
            }
            // Walked out of the area this tick: handed over with this tick's state, so the next
            // owner simulates it in its very next tick (no Freeze round trip).
            let due = cfg.release && now >= e.release_after && area.release_due(e.pos.0, e.pos.1);
            let offload = std::mem::take(&mut e.offload);
            if offload || due {
                match e.role {
                    Role::Npc { .. } => {
                        out.push(Body::Release(e.release(id, (0, 0))));
                        stats.released += 1;
                    }
                    Role::Player(_) if offload || cfg.release_avatars => avatars_out.push(id),
                    Role::Player(_) => {}
                }
            }
        }
        for id in avatars_out {
            self.release_avatar(out, id);
        }
        if self.cfg.combat && !halted && now.is_multiple_of(combat::ATTACK_EVERY_TICKS) {
            self.attack(out);
        }
        // Off the attacks' ticks (multiples of ten), so the two do not share a tick.
        if self.cfg.trade
            && !halted
            && (now + trade::TICK_OFFSET).is_multiple_of(trade::TRADE_EVERY_TICKS)
        {
            self.open_trades(out);
        }
        if !self.trades.is_empty() {
            self.send_gifts(out);
        }
    }
}
