//! The arena's simulation: pure logic driven by the sidecar's messages and the tick, writing its
//! messages to an [`Outbox`]. No I/O here; `run` owns the socket.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;
use cellmesh_proto::local::{
    game_message::Body, sidecar_message, Adopt, Adopted, Audience, AudienceKind, CheckpointState,
    Claim, ClaimLost, ClaimOutcome, ClaimRelease, ClaimResult, Command, CommandError, CommandIn,
    CommandReply, CommandResult, Component, DeclareSpawners, Despawn, Event, Release, ReserveIds,
    Snapshot, Spawn, SpawnPoint, SpawnerOwned, Update, Vec3, Welcome,
};
use cellmesh_proto::sdk::{GameSender, OwnedArea};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::combat::{self, DamageTable};
use crate::schema::{self, SampleSnapshot, SnapshotKind, SNAPSHOT_VERSION};
use crate::trade::{self, Escrow, Trade};
use crate::{ArenaConfig, ArenaStats, Census};

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

/// The world is a torus `w` × `h` metres; a side of zero (no world in `Welcome`) does not wrap.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Torus {
    pub w: f64,
    pub h: f64,
}

/// The shortest signed difference `d` modulo `size`.
fn wrap(d: f64, size: f64) -> f64 {
    if size > 0.0 {
        d - (d / size).round() * size
    } else {
        d
    }
}

fn normalise(c: f64, size: f64) -> f64 {
    if size > 0.0 {
        // `rem_euclid` can round up to `size` itself for a tiny negative `c`.
        let r = c.rem_euclid(size);
        if r >= size {
            0.0
        } else {
            r
        }
    } else {
        c
    }
}

impl Torus {
    fn from_welcome(welcome: &Welcome) -> Self {
        welcome
            .world
            .map(|w| Self {
                w: w.width,
                h: w.height,
            })
            .unwrap_or_default()
    }

    /// From `from` to `to` the short way round.
    pub fn delta(&self, from: (f64, f64), to: (f64, f64)) -> (f64, f64) {
        (wrap(to.0 - from.0, self.w), wrap(to.1 - from.1, self.h))
    }

    pub fn normalise(&self, p: (f64, f64)) -> (f64, f64) {
        (normalise(p.0, self.w), normalise(p.1, self.h))
    }
}

struct Player {
    account: String,
    session_epoch: u64,
    last_seq: u64,
    applied: u64,
    inventory: String,
    ack_dirty: bool,
    /// A `PlayerLeave` (its session epoch) that came while the avatar was frozen: done on `Thaw`,
    /// moot on `Evict`.
    leave_pending: Option<u64>,
    /// Experience from kills (see `combat`).
    xp: u64,
}

enum Role {
    Npc {
        name: String,
        turn_in: u32,
        damage: DamageTable,
    },
    Player(Player),
}

struct Entity {
    pos: (f64, f64),
    /// Carried along untouched.
    z: f64,
    dir: (f64, f64),
    health: (u32, u32),
    /// Handed to the sidecar for a handoff: neither moved nor written until `Thaw` or `Evict`.
    frozen: bool,
    /// Released by this arena (not frozen by the sidecar's `Freeze`).
    released: bool,
    /// Not released again before this tick: a release the sidecar kept (no target ready) is
    /// left to its own `Freeze`, rather than repeated every tick.
    release_after: u64,
    /// The entity epoch it is written under (a checkpoint names it).
    epoch: u64,
    role: Role,
}

impl Entity {
    fn snapshot(&self) -> SampleSnapshot {
        let (kind, name, inventory, session_epoch, last_seq, applied, turn_in) = match &self.role {
            Role::Npc { name, turn_in, .. } => (
                SnapshotKind::Npc,
                name.clone(),
                String::new(),
                0,
                0,
                0,
                *turn_in,
            ),
            Role::Player(p) => (
                SnapshotKind::Player,
                p.account.clone(),
                p.inventory.clone(),
                p.session_epoch,
                p.last_seq,
                p.applied,
                0,
            ),
        };
        let (damage, xp) = match &self.role {
            Role::Npc { damage, .. } => (damage.shares(), 0),
            Role::Player(p) => (Vec::new(), p.xp),
        };
        SampleSnapshot {
            v: SNAPSHOT_VERSION,
            kind,
            name,
            pos: [self.pos.0, self.pos.1, self.z],
            dir: [self.dir.0, self.dir.1],
            health: [self.health.0, self.health.1],
            inventory,
            session_epoch,
            last_seq,
            applied,
            turn_in,
            damage,
            xp,
        }
    }

    fn position(&self) -> Vec3 {
        Vec3 {
            x: self.pos.0,
            y: self.pos.1,
            z: self.z,
        }
    }
}

/// One entity of an `Adopt`, checked and decoded before anything is created.
struct Adoption {
    id: u64,
    epoch: u64,
    pos: (f64, f64),
    z: f64,
    owner_account: String,
    state: SampleSnapshot,
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

    fn random_point(&mut self) -> (f64, f64) {
        let h = self.cfg.spread / 2.0;
        let (dx, dy) = if h > 0.0 {
            (self.rng.random_range(-h..h), self.rng.random_range(-h..h))
        } else {
            (0.0, 0.0)
        };
        self.torus
            .normalise((self.cfg.center.0 + dx, self.cfg.center.1 + dy))
    }

    fn random_dir(rng: &mut StdRng) -> (f64, f64) {
        let a: f64 = rng.random_range(0.0..std::f64::consts::TAU);
        (a.cos(), a.sin())
    }

    /// The first words to the sidecar: ids for what the arena spawns, and its dens.
    pub fn start(&mut self, out: &mut impl Outbox) {
        self.request_ids(out);
        if !self.cfg.dens.is_empty() {
            let points = self
                .cfg
                .dens
                .iter()
                .map(|(key, (x, y))| SpawnPoint {
                    key: key.clone(),
                    x: *x,
                    y: *y,
                })
                .collect();
            out.push(Body::DeclareSpawners(DeclareSpawners { points }));
        }
    }

    /// This node stocks a den now: its NPC appears at the den, under the id the mesh gave.
    fn stock_den(&mut self, out: &mut impl Outbox, o: SpawnerOwned) {
        if self.entities.contains_key(&o.entity_id) {
            return;
        }
        let at = o.position.map_or(self.cfg.center, |p| (p.x, p.y));
        let pos = self.torus.normalise(at);
        let name = format!("{DEN_PREFIX}{}#{}", o.key, o.generation);
        self.spawn_npc(out, o.entity_id, pos, name);
        self.stats.dens_stocked += 1;
        if let Some(c) = self.census() {
            c.spawned_stock(&o.key, o.entity_id, self.node);
        }
    }

    /// A den NPC is gone from the world (killed, or its den's claim lost: another node may
    /// stock the den now).
    fn despawn_den_npc(&mut self, out: &mut impl Outbox, id: u64) {
        if self.entities.remove(&id).is_none() {
            return;
        }
        out.push(Body::Despawn(Despawn { entity_id: id }));
        if let Some(c) = self.census() {
            c.despawned(id, self.node);
        }
    }

    pub fn request_ids(&mut self, out: &mut impl Outbox) {
        if !self.ids_requested && self.ids.len() < 64 {
            out.push(Body::ReserveIds(ReserveIds {
                request_id: self.next_request,
                count: 512,
            }));
            self.next_request += 1;
            self.ids_requested = true;
        }
    }

    /// Creates NPC `id` called `name` at `pos`, at full health, heading somewhere at random.
    fn spawn_npc(&mut self, out: &mut impl Outbox, id: u64, pos: (f64, f64), name: String) {
        let dir = Self::random_dir(&mut self.rng);
        let health = (50, 50);
        out.push(Body::Spawn(Spawn {
            entity_id: id,
            position: Some(Vec3::xy(pos.0, pos.1)),
            components: vec![
                component(schema::KIND, Bytes::from(format!("npc:{name}")), public()),
                component(schema::HEALTH, schema::health(health.0, health.1), public()),
            ],
            ..Default::default()
        }));
        let turn_in = self.rng.random_range(20..100);
        self.entities.insert(
            id,
            Entity {
                pos,
                z: 0.0,
                dir,
                health,
                frozen: false,
                released: false,
                release_after: 0,
                epoch: 1,
                role: Role::Npc {
                    name,
                    turn_in,
                    damage: DamageTable::default(),
                },
            },
        );
    }

    fn spawn_npcs(&mut self, out: &mut impl Outbox) {
        while self.npcs_spawned < self.cfg.npcs {
            let Some(id) = self.ids.pop() else { break };
            let pos = self.random_point();
            let name = format!("wanderer-{}", self.npcs_spawned);
            self.npcs_spawned += 1;
            self.spawn_npc(out, id, pos, name);
            if let Some(c) = self.census() {
                c.spawned(id, self.node);
            }
        }
    }

    fn spawn_player(
        &mut self,
        out: &mut impl Outbox,
        account: String,
        epoch: u64,
        at: Option<(f64, f64)>,
    ) {
        let Some(id) = self.ids.pop() else {
            self.waiting.push((account, epoch, at));
            return;
        };
        let pos = match at {
            Some(p) if p.0.is_finite() && p.1.is_finite() => self.torus.normalise(p),
            _ => self.random_point(),
        };
        let health = (100, 100);
        let inventory = "sword,bread,10 gold".to_string();
        out.push(Body::Spawn(Spawn {
            entity_id: id,
            position: Some(Vec3::xy(pos.0, pos.1)),
            components: vec![
                component(
                    schema::KIND,
                    Bytes::from(format!("player:{account}")),
                    public(),
                ),
                component(
                    schema::HEALTH,
                    schema::health(health.0, health.1),
                    owner_and_party(&[]),
                ),
                component(
                    schema::INVENTORY,
                    Bytes::from(inventory.clone()),
                    owner_only(),
                ),
                component(schema::INPUT_ACK, schema::input_ack(0, 0), owner_only()),
            ],
            owner_account: account.clone(),
            is_master: true,
            parent_id: 0,
        }));
        self.stats.players_joined += 1;
        self.players.insert(account.clone(), id);
        if let Some(c) = self.census() {
            c.spawned_avatar(id, self.node, &account);
        }
        self.entities.insert(
            id,
            Entity {
                pos,
                z: 0.0,
                dir: (0.0, 0.0),
                health,
                frozen: false,
                released: false,
                release_after: 0,
                epoch: 1,
                role: Role::Player(Player {
                    account,
                    session_epoch: epoch,
                    last_seq: 0,
                    applied: 0,
                    inventory,
                    ack_dirty: false,
                    leave_pending: None,
                    xp: 0,
                }),
            },
        );
    }

    fn player_mut(&mut self, account: &str) -> Option<(&mut Entity, u64)> {
        let id = *self.players.get(account)?;
        self.entities.get_mut(&id).map(|e| (e, id))
    }

    fn despawn_player(&mut self, out: &mut impl Outbox, id: u64) {
        self.call_off_trade(out, id);
        if let Some(Entity {
            role: Role::Player(p),
            ..
        }) = self.entities.remove(&id)
        {
            if self.players.get(&p.account) == Some(&id) {
                self.players.remove(&p.account);
            }
        }
        out.push(Body::Despawn(Despawn { entity_id: id }));
        if let Some(c) = self.census() {
            c.despawned(id, self.node);
        }
    }

    pub fn on_message(&mut self, out: &mut impl Outbox, msg: sidecar_message::Body) {
        use sidecar_message::Body as M;
        match msg {
            M::IdsReserved(r) => {
                self.ids.extend(r.ids);
                self.ids_requested = false;
                for (account, epoch, at) in std::mem::take(&mut self.waiting) {
                    self.spawn_player(out, account, epoch, at);
                }
                self.spawn_npcs(out);
            }
            M::PlayerJoin(j) => {
                if let Some((e, _)) = self.player_mut(&j.account) {
                    // A new login of a player already in the world keeps its avatar.
                    if let Role::Player(p) = &mut e.role {
                        p.session_epoch = p.session_epoch.max(j.session_epoch);
                        if p.leave_pending.is_some_and(|l| l < j.session_epoch) {
                            p.leave_pending = None;
                        }
                    }
                } else {
                    let at = j.last_position.map(|v| (v.x, v.y));
                    self.spawn_player(out, j.account, j.session_epoch, at);
                }
            }
            M::PlayerLeave(l) => {
                let Some((e, id)) = self.player_mut(&l.account) else {
                    return;
                };
                let Role::Player(p) = &mut e.role else { return };
                if p.session_epoch > l.session_epoch {
                    return;
                }
                if e.frozen {
                    // No Despawn of a frozen entity: the leave waits for the handoff's outcome.
                    p.leave_pending = Some(l.session_epoch);
                } else {
                    self.despawn_player(out, id);
                }
            }
            M::Input(i) => {
                let Some((e, _)) = self.player_mut(&i.account) else {
                    self.stats.inputs_no_player += 1;
                    return;
                };
                let Role::Player(p) = &mut e.role else { return };
                if i.session_epoch < p.session_epoch {
                    self.stats.inputs_stale_session += 1;
                    return;
                }
                if e.frozen {
                    self.stats.inputs_while_frozen += 1;
                    return;
                }
                if i.seq <= p.last_seq {
                    self.stats.inputs_duplicate += 1;
                    return;
                }
                if let Some((dx, dy)) = schema::parse_input(&i.payload) {
                    let len = (dx as f64).hypot(dy as f64);
                    e.dir = if len > 1e-6 {
                        (dx as f64 / len, dy as f64 / len)
                    } else {
                        (0.0, 0.0)
                    };
                }
                p.last_seq = i.seq;
                p.applied += 1;
                p.ack_dirty = true;
                self.stats.inputs_applied += 1;
            }
            M::Freeze(f) => {
                let Some(e) = self.entities.get_mut(&f.entity_id) else {
                    tracing::warn!(
                        entity = f.entity_id,
                        "freeze of an entity this arena does not hold"
                    );
                    return;
                };
                if !e.frozen {
                    e.frozen = true;
                    self.stats.frozen += 1;
                }
                let state = e.snapshot().encode();
                // Its trade ends here, its claims released before the snapshot completes the
                // freeze (so the handoff carries none of them).
                self.call_off_trade(out, f.entity_id);
                // A repeated Freeze is answered again: the sidecar may have lost the first answer.
                out.push(Body::Snapshot(Snapshot {
                    entity_id: f.entity_id,
                    entity_epoch: f.entity_epoch,
                    state,
                }));
                self.stats.snapshots += 1;
            }
            M::Checkpoint(c) => {
                // Answered at once, frozen or not: the state as it stands.
                for id in c.entity_ids {
                    let Some(e) = self.entities.get(&id) else {
                        continue;
                    };
                    out.push(Body::CheckpointState(CheckpointState {
                        entity_id: id,
                        entity_epoch: e.epoch,
                        state: e.snapshot().encode(),
                    }));
                    self.stats.checkpoints += 1;
                }
            }
            M::Thaw(t) => {
                let Some(e) = self.entities.get_mut(&t.entity_id) else {
                    tracing::warn!(
                        entity = t.entity_id,
                        "thaw of an entity this arena does not hold"
                    );
                    return;
                };
                if !e.frozen {
                    return;
                }
                e.frozen = false;
                if std::mem::take(&mut e.released) {
                    // Kept: no node could take it yet, or it is within the margin. The
                    // sidecar's own Freeze hands it over once one can.
                    e.release_after = self.ticks + RELEASE_BACKOFF_TICKS;
                    self.stats.releases_kept += 1;
                }
                self.stats.thawed += 1;
                tracing::debug!(entity = t.entity_id, reason = %t.reason, "handoff refused, resuming");
                if let Role::Player(Player {
                    leave_pending: Some(_),
                    ..
                }) = e.role
                {
                    self.despawn_player(out, t.entity_id);
                }
            }
            M::Evict(v) => {
                // Silently: the entity lives on another node and its clients must not see it go.
                let Some(e) = self.entities.remove(&v.entity_id) else {
                    tracing::warn!(
                        entity = v.entity_id,
                        "evict of an entity this arena does not hold"
                    );
                    return;
                };
                if !e.frozen {
                    tracing::warn!(
                        entity = v.entity_id,
                        "evict of an entity that was not frozen"
                    );
                }
                if let Role::Player(p) = &e.role {
                    if self.players.get(&p.account) == Some(&v.entity_id) {
                        self.players.remove(&p.account);
                    }
                }
                self.stats.evicted += 1;
                if let Some(c) = self.census() {
                    c.evicted(v.entity_id, self.node);
                }
            }
            M::Adopt(a) => self.adopt(out, a),
            M::GhostEnter(g) => {
                let kind = g.components.iter().find(|c| c.r#type == schema::KIND);
                let kind = kind.map(|c| String::from_utf8_lossy(&c.payload).into_owned());
                let (Some(kind), Some(p)) = (kind, g.position) else {
                    return;
                };
                if kind.starts_with("npc:") {
                    self.npc_ghosts.insert(g.entity_id, (p.x, p.y));
                } else if let Some(account) = kind.strip_prefix("player:") {
                    self.player_ghosts
                        .insert(g.entity_id, (account.to_string(), (p.x, p.y)));
                }
            }
            M::GhostUpdate(g) => {
                let Some(p) = g.position else { return };
                if let Some(at) = self.npc_ghosts.get_mut(&g.entity_id) {
                    *at = (p.x, p.y);
                } else if let Some((_, at)) = self.player_ghosts.get_mut(&g.entity_id) {
                    *at = (p.x, p.y);
                }
            }
            M::GhostLeave(g) => {
                self.npc_ghosts.remove(&g.entity_id);
                self.player_ghosts.remove(&g.entity_id);
            }
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

    /// Takes over an entity and its attachments, all or nothing: a state this game cannot read
    /// creates nothing and is not answered, so the entity stays frozen where it was.
    fn adopt(&mut self, out: &mut impl Outbox, root: Adopt) {
        let (id, epoch) = (root.entity_id, root.entity_epoch);
        let mut todo = Vec::new();
        if let Err(e) = self.check_adoption(root, &mut todo) {
            tracing::error!(entity = id, error = %e, "cannot adopt");
            return;
        }
        for a in todo {
            self.take(a);
        }
        out.push(Body::Adopted(Adopted {
            entity_id: id,
            entity_epoch: epoch,
        }));
    }

    fn check_adoption(&self, a: Adopt, todo: &mut Vec<Adoption>) -> Result<(), String> {
        if a.entity_id == 0 {
            return Err("entity id 0".into());
        }
        let state = SampleSnapshot::decode(&a.state).map_err(|e| e.to_string())?;
        let (pos, z) = match a.position {
            Some(v) if v.x.is_finite() && v.y.is_finite() => ((v.x, v.y), v.z),
            _ => ((state.pos[0], state.pos[1]), state.pos[2]),
        };
        let z = if z.is_finite() { z } else { 0.0 };
        todo.push(Adoption {
            id: a.entity_id,
            epoch: a.entity_epoch,
            pos: self.torus.normalise(pos),
            z,
            owner_account: a.owner_account,
            state,
        });
        for child in a.attachments {
            self.check_adoption(child, todo)?;
        }
        Ok(())
    }

    fn take(&mut self, a: Adoption) {
        // Seen as a ghost until now, written here from now on.
        self.npc_ghosts.remove(&a.id);
        self.player_ghosts.remove(&a.id);
        if let Some(e) = self.entities.get_mut(&a.id) {
            if e.frozen {
                // Ours, frozen for a handoff that failed, and handed back to this node (it took
                // over the target's area): resume it where the sidecar says.
                e.frozen = false;
                e.pos = a.pos;
                e.z = a.z;
                e.epoch = a.epoch;
                self.stats.adopted += 1;
                if let Some(c) = self.census() {
                    c.adopted(a.id, self.node);
                }
            }
            // Otherwise a replayed Adopt: the copy held is the one.
            return;
        }
        let s = a.state;
        let role = match s.kind {
            SnapshotKind::Npc => Role::Npc {
                name: s.name,
                turn_in: s.turn_in,
                damage: DamageTable::from_shares(&s.damage),
            },
            SnapshotKind::Player => {
                let account = if a.owner_account.is_empty() {
                    s.name
                } else {
                    a.owner_account
                };
                if let Some(old) = self.players.insert(account.clone(), a.id) {
                    tracing::warn!(%account, old, new = a.id, "adopted a second avatar of an account; inputs go to the adopted one");
                }
                Role::Player(Player {
                    account,
                    session_epoch: s.session_epoch,
                    last_seq: s.last_seq,
                    applied: s.applied,
                    inventory: s.inventory,
                    // The last acknowledgement may not have been written before the freeze.
                    ack_dirty: true,
                    leave_pending: None,
                    xp: s.xp,
                })
            }
        };
        self.entities.insert(
            a.id,
            Entity {
                pos: a.pos,
                z: a.z,
                dir: (s.dir[0], s.dir[1]),
                health: (s.health[0], s.health[1]),
                frozen: false,
                released: false,
                release_after: 0,
                epoch: a.epoch,
                role,
            },
        );
        self.stats.adopted += 1;
        if let Some(c) = self.census() {
            c.adopted(a.id, self.node);
        }
    }

    // ------------------------------------------------------------------ combat

    /// An id for a command's payload: from the census when there is one (unique in the run),
    /// else drawn at random.
    fn command_id(&mut self) -> u64 {
        match &self.cfg.census {
            Some(c) => c.next_command_id(),
            None => self.rng.random::<u64>(),
        }
    }

    /// Sends a command, remembering it until its one result; its request id.
    fn send_command(
        &mut self,
        out: &mut impl Outbox,
        target: u64,
        r#type: u32,
        payload: Bytes,
        from: u64,
    ) -> u64 {
        self.next_command += 1;
        let request_id = self.next_command;
        self.outstanding.insert(request_id, (r#type, from));
        out.push(Body::Command(Command {
            target_entity: target,
            r#type,
            payload,
            request_id,
            from_entity: from,
        }));
        request_id
    }

    /// Each player with no attack on its way hits the nearest NPC in reach: its own node's or
    /// a ghost of another's, alike.
    fn attack(&mut self, out: &mut impl Outbox) {
        let players: Vec<(u64, (f64, f64))> = self
            .entities
            .iter()
            .filter(|(id, e)| {
                matches!(e.role, Role::Player(_)) && !e.frozen && !self.attacking.contains(id)
            })
            .map(|(id, e)| (*id, e.pos))
            .collect();
        for (avatar, at) in players {
            let own = self
                .entities
                .iter()
                .filter(|(_, e)| matches!(e.role, Role::Npc { .. }) && !e.frozen)
                .map(|(id, e)| (*id, e.pos));
            let ghosts = self.npc_ghosts.iter().map(|(id, p)| (*id, *p));
            let nearest = own
                .chain(ghosts)
                .map(|(id, p)| {
                    let (dx, dy) = self.torus.delta(at, p);
                    (dx.hypot(dy), id)
                })
                .filter(|(d, _)| *d <= combat::REACH_M)
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let Some((_, npc)) = nearest else { continue };
            let attack_id = self.command_id();
            let remote = self.npc_ghosts.contains_key(&npc);
            self.send_command(
                out,
                npc,
                combat::CMD_ATTACK,
                combat::encode(combat::DAMAGE, attack_id),
                avatar,
            );
            self.attacking.insert(avatar);
            self.stats.attacks_sent += 1;
            if remote {
                self.stats.attacks_across_border += 1;
            }
        }
    }

    /// A command to an entity this arena writes.
    fn on_command(&mut self, out: &mut impl Outbox, c: CommandIn) {
        let verdict = match c.r#type {
            combat::CMD_ATTACK => self.attacked(out, &c),
            combat::CMD_XP => self.rewarded(&c),
            trade::CMD_TRADE => self.gifted(&c),
            other => Err(format!("unknown command type {other}")),
        };
        if c.request_id == 0 {
            return;
        }
        let (refused, detail) = match verdict {
            Ok(()) => (false, String::new()),
            Err(detail) => {
                self.stats.commands_refused += 1;
                (true, detail)
            }
        };
        out.push(Body::CommandReply(CommandReply {
            request_id: c.request_id,
            refused,
            payload: Bytes::new(),
            detail,
        }));
    }

    /// An attack on one of this arena's NPCs: its damage table grows; a kill shares out XP to
    /// every attacker's avatar, wherever it is, and the NPC rises again at full health.
    fn attacked(&mut self, out: &mut impl Outbox, c: &CommandIn) -> Result<(), String> {
        let (damage, attack_id) = combat::decode(&c.payload).ok_or("unreadable attack")?;
        let census = self.cfg.census.clone();
        let e = self
            .entities
            .get_mut(&c.target)
            .ok_or("no such entity here")?;
        if e.frozen {
            return Err("frozen".into());
        }
        let Role::Npc { damage: table, .. } = &mut e.role else {
            return Err("only NPCs are attacked".into());
        };
        if let Some(census) = &census {
            census.command_applied(attack_id);
        }
        self.stats.attacks_applied += 1;
        if c.from_node != self.node {
            self.stats.attacks_applied_from_other_nodes += 1;
        }
        table.hit(&c.from_account, c.from_entity, damage);
        e.health.0 = e.health.0.saturating_sub(damage);
        let mut rewards = Vec::new();
        let mut den_killed = false;
        if e.health.0 == 0 {
            rewards = table.share_out(combat::KILL_XP);
            e.health.0 = e.health.1;
            self.stats.kills += 1;
            den_killed = matches!(&e.role, Role::Npc { name, .. } if name.starts_with(DEN_PREFIX));
        }
        out.push(Body::Update(Update {
            entity_id: c.target,
            changed: vec![component(
                schema::HEALTH,
                schema::health(e.health.0, e.health.1),
                public(),
            )],
            ..Default::default()
        }));
        for (_, avatar, xp) in rewards {
            let reward_id = self.command_id();
            self.send_command(
                out,
                avatar,
                combat::CMD_XP,
                combat::encode(xp, reward_id),
                c.target,
            );
            self.stats.xp_sent += 1;
        }
        if den_killed {
            // A den's NPC does not rise again: the den is stocked anew, under a new id.
            self.stats.den_kills += 1;
            self.despawn_den_npc(out, c.target);
        }
        Ok(())
    }

    /// XP for a kill, to one of this arena's avatars.
    fn rewarded(&mut self, c: &CommandIn) -> Result<(), String> {
        let (xp, reward_id) = combat::decode(&c.payload).ok_or("unreadable reward")?;
        let e = self
            .entities
            .get_mut(&c.target)
            .ok_or("no such entity here")?;
        let Role::Player(p) = &mut e.role else {
            return Err("only players gain XP".into());
        };
        if let Some(census) = &self.cfg.census {
            census.command_applied(reward_id);
        }
        p.xp += xp as u64;
        self.stats.xp_applied += 1;
        self.stats.xp_gained += xp as u64;
        if c.from_node != self.node {
            self.stats.xp_from_other_nodes += 1;
        }
        Ok(())
    }

    /// The one result of a command this arena sent.
    fn on_command_result(&mut self, out: &mut impl Outbox, r: CommandResult) {
        let Some((r#type, from)) = self.outstanding.remove(&r.request_id) else {
            // A second result, or one for a command never sent: the mesh broke a promise.
            self.stats.results_unexpected += 1;
            return;
        };
        if r#type == trade::CMD_TRADE {
            let ok = r.error == CommandError::CommandOk as i32;
            self.gift_answered(out, from, r.request_id, ok);
        } else {
            self.attacking.remove(&from);
        }
        let s = &mut self.stats;
        match CommandError::try_from(r.error).unwrap_or(CommandError::NotDelivered) {
            CommandError::CommandOk => s.results_ok += 1,
            CommandError::Refused => s.results_refused += 1,
            CommandError::EntityGone => s.results_entity_gone += 1,
            CommandError::Timeout => s.results_timeout += 1,
            CommandError::NotDelivered => s.results_not_delivered += 1,
        }
    }

    // ------------------------------------------------------------------ trade

    fn claim(&mut self, out: &mut impl Outbox, key: String, avatar: u64) -> u64 {
        self.next_claim += 1;
        let request_id = self.next_claim;
        self.claims_asked.insert(request_id, avatar);
        out.push(Body::Claim(Claim {
            key,
            holder_entity: avatar,
            ttl_ms: trade::CLAIM_TTL_MS,
            request_id,
        }));
        request_id
    }

    /// Each player in no trade opens one with the nearest other player in reach: claims both
    /// escrows for its avatar. Not while a claim of its last trade awaits its answer: the store
    /// grants a holder its own key again, so a new trade's escrow would be the same claim as
    /// the old one's, and the old one's release (once granted) would free the new one's.
    fn open_trades(&mut self, out: &mut impl Outbox) {
        let players: Vec<(u64, String, (f64, f64))> = self
            .entities
            .iter()
            .filter(|(id, e)| !e.frozen && !self.trades.contains_key(id))
            .filter(|(id, _)| !self.release_on_answer.values().any(|a| a == *id))
            .filter_map(|(id, e)| match &e.role {
                Role::Player(p) => Some((*id, p.account.clone(), e.pos)),
                Role::Npc { .. } => None,
            })
            .collect();
        for (avatar, account, at) in players {
            let own = self.entities.iter().filter_map(|(id, e)| match &e.role {
                Role::Player(p) if *id != avatar && !e.frozen => Some((*id, &p.account, e.pos)),
                _ => None,
            });
            // A ghost that became this arena's own (adopted) is not a ghost any more.
            let ghosts = self
                .player_ghosts
                .iter()
                .filter(|(id, _)| !self.entities.contains_key(id))
                .map(|(id, (a, p))| (*id, a, *p));
            let nearest = own
                .chain(ghosts)
                .map(|(id, a, p)| {
                    let (dx, dy) = self.torus.delta(at, p);
                    (dx.hypot(dy), id, a.clone())
                })
                .filter(|(d, _, a)| *d <= trade::REACH_M && *a != account)
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let Some((_, partner, theirs)) = nearest else {
                continue;
            };
            let own_claim = self.claim(out, trade::escrow(&account), avatar);
            let their_claim = self.claim(out, trade::escrow(&theirs), avatar);
            self.trades.insert(
                avatar,
                Trade::new(partner, &account, &theirs, [own_claim, their_claim]),
            );
            self.stats.trades_started += 1;
            if self.player_ghosts.contains_key(&partner) {
                self.stats.trades_across_border += 1;
            }
        }
    }

    fn on_claim_result(&mut self, out: &mut impl Outbox, r: ClaimResult) {
        let granted = r.outcome == ClaimOutcome::ClaimGranted as i32;
        if granted {
            self.stats.claims_granted += 1;
        } else if r.outcome == ClaimOutcome::ClaimHeld as i32 {
            self.stats.claims_refused += 1;
        }
        if let Some(avatar) = self.release_on_answer.remove(&r.request_id) {
            // A despawned holder's claims were freed by its despawn.
            if granted && self.entities.contains_key(&avatar) {
                out.push(Body::ClaimRelease(ClaimRelease {
                    key: r.key,
                    holder_entity: avatar,
                }));
            }
            return;
        }
        let Some(avatar) = self.claims_asked.remove(&r.request_id) else {
            return;
        };
        let Some(t) = self.trades.get_mut(&avatar) else {
            return;
        };
        if !t.answered(r.request_id, granted) {
            return;
        }
        if t.refused() {
            if r.outcome == ClaimOutcome::ClaimHeld as i32 {
                self.stats.trades_refused += 1;
            } else {
                self.stats.trades_failed += 1;
            }
            return self.end_trade(out, avatar);
        }
        if !t.both_granted() {
            return;
        }
        t.gift_at = Some(self.ticks + trade::HAGGLE_TICKS);
        if let Some(c) = &self.cfg.census {
            c.trade_opened(t.accounts(), self.node);
        }
    }

    /// Trades done haggling send their gift.
    fn send_gifts(&mut self, out: &mut impl Outbox) {
        let now = self.ticks;
        let due: Vec<(u64, u64)> = self
            .trades
            .iter()
            .filter(|(_, t)| t.gift.is_none() && t.gift_at.is_some_and(|at| at <= now))
            .map(|(avatar, t)| (*avatar, t.partner))
            .collect();
        for (avatar, partner) in due {
            let trade_id = self.command_id();
            let request_id = self.send_command(
                out,
                partner,
                trade::CMD_TRADE,
                trade::encode(trade::GIFT_GOLD, trade_id),
                avatar,
            );
            if let Some(t) = self.trades.get_mut(&avatar) {
                t.gift = Some(request_id);
            }
        }
    }

    fn on_claim_lost(&mut self, out: &mut impl Outbox, l: ClaimLost) {
        self.stats.claims_lost += 1;
        tracing::debug!(key = %l.key, holder = l.holder_entity, reason = %l.reason, "claim lost");
        if self
            .trades
            .get_mut(&l.holder_entity)
            .is_some_and(|t| t.lost(&l.key))
        {
            self.stats.trades_lost += 1;
            self.end_trade(out, l.holder_entity);
        }
    }

    /// The gift's one result: the trade is over.
    fn gift_answered(&mut self, out: &mut impl Outbox, avatar: u64, request_id: u64, ok: bool) {
        if self
            .trades
            .get(&avatar)
            .is_none_or(|t| t.gift != Some(request_id))
        {
            // Its trade was called off meanwhile (counted then); the avatar may be in another.
            return;
        }
        if ok {
            self.stats.trades_done += 1;
        } else {
            self.stats.trades_failed += 1;
        }
        self.end_trade(out, avatar);
    }

    /// A trade's avatar is frozen for a handoff: the trade ends here.
    fn call_off_trade(&mut self, out: &mut impl Outbox, avatar: u64) {
        if self.trades.contains_key(&avatar) {
            self.stats.trades_called_off += 1;
            self.end_trade(out, avatar);
        }
    }

    /// Ends `avatar`'s trade: closed in the census first, then its claims released.
    fn end_trade(&mut self, out: &mut impl Outbox, avatar: u64) {
        let Some(t) = self.trades.remove(&avatar) else {
            return;
        };
        if let (Some(c), Some(_)) = (&self.cfg.census, t.gift_at) {
            c.trade_closed(t.accounts());
        }
        self.claims_asked.retain(|_, a| *a != avatar);
        for (account, escrow) in &t.parties {
            match escrow {
                Escrow::Granted => out.push(Body::ClaimRelease(ClaimRelease {
                    key: trade::escrow(account),
                    holder_entity: avatar,
                })),
                // Its answer may be on its way already: released once it comes, if granted.
                Escrow::Asked(request_id) => {
                    self.release_on_answer.insert(*request_id, avatar);
                }
                Escrow::Refused => {}
            }
        }
    }

    /// A trade's gift to one of this arena's avatars.
    fn gifted(&mut self, c: &CommandIn) -> Result<(), String> {
        let (_, trade_id) = trade::decode(&c.payload).ok_or("unreadable gift")?;
        let e = self.entities.get(&c.target).ok_or("no such entity here")?;
        if !matches!(e.role, Role::Player(_)) {
            return Err("only players receive gifts".into());
        }
        if let Some(census) = &self.cfg.census {
            census.command_applied(trade_id);
        }
        self.stats.gifts_applied += 1;
        Ok(())
    }

    /// Trades this arena has open.
    pub fn trades_open(&self) -> usize {
        self.trades.len()
    }

    /// Commands sent whose result has not come yet.
    pub fn commands_outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// A player's experience, if this arena holds its avatar.
    pub fn xp_of(&self, account: &str) -> Option<u64> {
        let id = self.players.get(account)?;
        match &self.entities.get(id)?.role {
            Role::Player(p) => Some(p.xp),
            Role::Npc { .. } => None,
        }
    }

    /// An NPC's damage table, if this arena writes it: (account, damage) per attacker.
    pub fn damage_table(&self, npc: u64) -> Option<Vec<(String, u32)>> {
        match &self.entities.get(&npc)?.role {
            Role::Npc { damage, .. } => Some(
                damage
                    .shares()
                    .into_iter()
                    .map(|(a, _, d)| (a, d))
                    .collect(),
            ),
            Role::Player(_) => None,
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
            // owner simulates it in its very next tick (no Freeze round trip). Not a player's
            // avatar: its inputs on their way here would be lost; the sidecar's Freeze holds
            // them back.
            let npc = matches!(e.role, Role::Npc { .. });
            if cfg.release && npc && now >= e.release_after && area.release_due(e.pos.0, e.pos.1) {
                e.frozen = true;
                e.released = true;
                out.push(Body::Release(Release {
                    entity_id: id,
                    entity_epoch: e.epoch,
                    state: e.snapshot().encode(),
                    attachments: vec![],
                }));
                stats.released += 1;
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_proto::local::{
        Evict, Freeze, GhostEnter, IdsReserved, Input, PlayerJoin, PlayerLeave, Thaw, WorldShape,
    };
    use sidecar_message::Body as M;

    const NODE: u32 = 3;
    const SIZE: f64 = 1000.0;

    fn welcome() -> Welcome {
        Welcome {
            node_id: NODE,
            world: Some(WorldShape {
                width: SIZE,
                height: SIZE,
                chunk_size: 32.0,
                region_size: 500.0,
            }),
            ..Default::default()
        }
    }

    fn arena(npcs: u32, census: &Arc<Census>) -> Arena {
        arena_welcomed(npcs, census, &welcome())
    }

    /// An arena of `npcs` around the origin, welcomed with `w`, with ids to spawn them.
    fn arena_welcomed(npcs: u32, census: &Arc<Census>, w: &Welcome) -> Arena {
        let cfg = ArenaConfig {
            npcs,
            center: (0.0, 0.0),
            spread: 40.0,
            census: Some(census.clone()),
            ..ArenaConfig::default()
        };
        let mut a = Arena::new(cfg, w);
        let mut out = Vec::new();
        a.request_ids(&mut out);
        a.on_message(
            &mut out,
            M::IdsReserved(IdsReserved {
                request_id: 1,
                ids: (1000..1100).collect(),
            }),
        );
        a
    }

    fn spawned(out: &[Body]) -> Vec<u64> {
        out.iter()
            .filter_map(|b| match b {
                Body::Spawn(s) => Some(s.entity_id),
                _ => None,
            })
            .collect()
    }

    /// Whether `out` writes `id` in any way.
    fn writes(out: &[Body], id: u64) -> bool {
        out.iter().any(|b| match b {
            Body::Update(u) => u.entity_id == id,
            Body::Event(e) => e.entity_id == id,
            Body::Despawn(d) => d.entity_id == id,
            Body::Spawn(s) => s.entity_id == id,
            _ => false,
        })
    }

    fn snapshot_of(out: &[Body], id: u64) -> SampleSnapshot {
        let state = out
            .iter()
            .find_map(|b| match b {
                Body::Snapshot(s) if s.entity_id == id => Some(s.state.clone()),
                _ => None,
            })
            .expect("a snapshot");
        SampleSnapshot::decode(&state).expect("decodable")
    }

    fn ack_of(out: &[Body], id: u64) -> Option<(u64, u64)> {
        out.iter().rev().find_map(|b| match b {
            Body::Update(u) if u.entity_id == id => u
                .changed
                .iter()
                .find(|c| c.r#type == schema::INPUT_ACK)
                .and_then(|c| schema::parse_input_ack(&c.payload)),
            _ => None,
        })
    }

    fn join(a: &mut Arena, account: &str, epoch: u64) -> u64 {
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::PlayerJoin(PlayerJoin {
                account: account.into(),
                session_epoch: epoch,
                last_position: None,
            }),
        );
        spawned(&out)[0]
    }

    fn input(account: &str, epoch: u64, seq: u64, dx: f32, dy: f32) -> sidecar_message::Body {
        M::Input(Input {
            account: account.into(),
            session_epoch: epoch,
            seq,
            payload: schema::input(dx, dy),
        })
    }

    fn freeze(a: &mut Arena, id: u64, epoch: u64) -> Vec<Body> {
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::Freeze(Freeze {
                entity_id: id,
                entity_epoch: epoch,
            }),
        );
        out
    }

    fn adopt_msg(id: u64, epoch: u64, s: &SampleSnapshot, owner: &str) -> Adopt {
        Adopt {
            entity_id: id,
            entity_epoch: epoch,
            position: Some(Vec3 {
                x: s.pos[0],
                y: s.pos[1],
                z: s.pos[2],
            }),
            state: s.encode(),
            owner_account: owner.into(),
            is_master: s.kind == SnapshotKind::Player,
            attachments: vec![],
        }
    }

    fn player_snapshot(account: &str, last_seq: u64, applied: u64) -> SampleSnapshot {
        SampleSnapshot {
            v: SNAPSHOT_VERSION,
            kind: SnapshotKind::Player,
            name: account.into(),
            pos: [999.0, 500.0, 0.0],
            dir: [0.0, 0.0],
            health: [80, 100],
            inventory: "sword".into(),
            session_epoch: 2,
            last_seq,
            applied,
            turn_in: 0,
            damage: vec![],
            xp: 0,
        }
    }

    fn attack_in(target: u64, account: &str, avatar: u64, from_node: u32, request_id: u64) -> M {
        M::CommandIn(CommandIn {
            target,
            from_entity: avatar,
            from_account: account.into(),
            r#type: combat::CMD_ATTACK,
            payload: combat::encode(combat::DAMAGE, request_id),
            request_id,
            from_node,
        })
    }

    #[test]
    fn an_npc_keeps_every_attacker_in_its_damage_table_and_its_kill_rewards_each_avatar() {
        let census = Arc::new(Census::default());
        let mut owner = arena(1, &census);
        let npc = owner.held().find(|h| !h.player).unwrap().id;
        let ann = join(&mut owner, "ann", 1);
        let mut out = Vec::new();
        // Ann here, Bob from node 9 (his avatar simulated there), until the NPC (50 health) dies.
        for k in 0..5 {
            let (account, avatar, node) = if k % 2 == 0 {
                ("ann", ann, NODE)
            } else {
                ("bob", 77, 9)
            };
            owner.on_message(&mut out, attack_in(npc, account, avatar, node, k + 1));
            if k == 3 {
                let table = owner.damage_table(npc).unwrap();
                assert_eq!(table, [("ann".into(), 20), ("bob".into(), 20)]);
                // The table travels with the NPC in its snapshot.
                let frozen = freeze(&mut owner, npc, 1);
                let snap = snapshot_of(&frozen, npc);
                assert_eq!(snap.damage.len(), 2);
                owner.on_message(
                    &mut out,
                    M::Thaw(Thaw {
                        entity_id: npc,
                        reason: "kept".into(),
                    }),
                );
            }
        }
        let refusals: Vec<&str> = out
            .iter()
            .filter_map(|b| match b {
                Body::CommandReply(r) if r.refused => Some(r.detail.as_str()),
                _ => None,
            })
            .collect();
        assert!(refusals.is_empty(), "{refusals:?}");
        assert_eq!(owner.stats.kills, 1);
        assert_eq!(owner.stats.attacks_applied_from_other_nodes, 2);
        let replies = out
            .iter()
            .filter(|b| matches!(b, Body::CommandReply(r) if !r.refused))
            .count();
        assert_eq!(replies, 5, "every attack answered");
        // The kill's XP goes by command to each attacker's avatar, wherever it is.
        let rewards: Vec<(u64, u32)> = out
            .iter()
            .filter_map(|b| match b {
                Body::Command(c) if c.r#type == combat::CMD_XP => {
                    Some((c.target_entity, combat::decode(&c.payload).unwrap().0))
                }
                _ => None,
            })
            .collect();
        assert_eq!(rewards, [(ann, 60), (77, 40)]);
        assert!(owner.damage_table(npc).unwrap().is_empty(), "a new life");
        // Bob's own node applies his share to his avatar.
        let mut remote = arena(0, &census);
        let bob = join(&mut remote, "bob", 1);
        let mut out = Vec::new();
        remote.on_message(
            &mut out,
            M::CommandIn(CommandIn {
                target: bob,
                from_entity: npc,
                r#type: combat::CMD_XP,
                payload: combat::encode(40, 99),
                request_id: 5,
                // The kill happened on the NPC's node, another than Bob's.
                from_node: NODE + 1,
                ..Default::default()
            }),
        );
        assert_eq!(remote.xp_of("bob"), Some(40));
        assert_eq!(remote.stats.xp_from_other_nodes, 1);
        assert_eq!(
            census.commands(),
            (6, 0),
            "five attacks and one reward, each once"
        );
    }

    #[test]
    fn a_result_comes_once_per_command_and_a_second_is_counted() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        let mut out = Vec::new();
        a.send_command(&mut out, 5, combat::CMD_ATTACK, combat::encode(10, 1), 1);
        assert_eq!(a.commands_outstanding(), 1);
        let result = CommandResult {
            request_id: 1,
            target: 5,
            ok: true,
            ..Default::default()
        };
        a.on_message(&mut out, M::CommandResult(result.clone()));
        a.on_message(&mut out, M::CommandResult(result));
        assert_eq!(a.commands_outstanding(), 0);
        assert_eq!((a.stats.results_ok, a.stats.results_unexpected), (1, 1));
    }

    #[test]
    fn torus_takes_the_short_way_round() {
        let t = Torus { w: SIZE, h: SIZE };
        assert_eq!(t.delta((990.0, 10.0), (10.0, 990.0)), (20.0, -20.0));
        assert_eq!(t.normalise((-1.0, 1001.0)), (999.0, 1.0));
        assert_eq!(t.normalise((-1e-18, 0.0)).0, 0.0);
        let flat = Torus::default();
        assert_eq!(flat.delta((990.0, 0.0), (10.0, 0.0)), (-980.0, 0.0));
    }

    /// An arena owning only the chunk east of the origin (no margin): its NPCs, wandering
    /// around the origin, keep walking out of it.
    fn arena_owning_one_chunk(census: &Arc<Census>) -> Arena {
        let mut w = welcome();
        w.owned_area = vec![cellmesh_proto::local::Rect {
            x: 0.0,
            y: 0.0,
            width: 32.0,
            height: 32.0,
        }];
        w.handoff_margin_chunks = 0;
        arena_welcomed(20, census, &w)
    }

    fn releases(out: &[Body]) -> Vec<&Release> {
        out.iter()
            .filter_map(|b| match b {
                Body::Release(r) => Some(r),
                _ => None,
            })
            .collect()
    }

    /// An NPC that walks out of the area is released in that tick, after its last move, with
    /// its whole state; from then on it is frozen (neither moved nor written).
    #[test]
    fn an_npc_that_walks_out_of_the_area_is_released_with_its_state_and_frozen() {
        let census = Arc::new(Census::default());
        let mut a = arena_owning_one_chunk(&census);
        let mut out = Vec::new();
        let mut ticks = 0;
        while releases(&out).is_empty() {
            out.clear();
            a.tick(&mut out, 0.05);
            ticks += 1;
            assert!(ticks < 200, "no NPC ever left the area");
        }
        let released: Vec<(u64, u64, SampleSnapshot)> = releases(&out)
            .iter()
            .map(|r| {
                let snap = SampleSnapshot::decode(&r.state).expect("a decodable snapshot");
                (r.entity_id, r.entity_epoch, snap)
            })
            .collect();
        for (id, epoch, snap) in &released {
            assert_eq!(*epoch, 1);
            assert_eq!(snap.kind, SnapshotKind::Npc);
            let e = &a.entities[id];
            assert!(e.frozen);
            let off = (snap.pos[0] - e.pos.0).hypot(snap.pos[1] - e.pos.1);
            assert!(
                off < 1e-6,
                "the tick's own state: {:?} vs {:?}",
                snap.pos,
                e.pos
            );
            assert!(
                a.area.release_due(e.pos.0, e.pos.1),
                "released outside the area"
            );
            // Its last move comes before the release in the tick's batch.
            let moved = out
                .iter()
                .position(|b| matches!(b, Body::Update(u) if u.entity_id == *id));
            let rel = out
                .iter()
                .position(|b| matches!(b, Body::Release(r) if r.entity_id == *id));
            assert!(moved < rel, "{out:?}");
        }
        assert_eq!(a.stats.released, released.len() as u64);
        let mut next = Vec::new();
        a.tick(&mut next, 0.05);
        for (id, _, _) in &released {
            assert!(!writes(&next, *id), "a released NPC was written: {next:?}");
            assert!(releases(&next).iter().all(|r| r.entity_id != *id));
        }
    }

    /// A release the sidecar kept (thawed) is not repeated at every tick: the entity moves on,
    /// and is released again only after a back-off (the sidecar's Freeze may come first).
    #[test]
    fn a_kept_release_is_not_repeated_before_the_back_off() {
        let census = Arc::new(Census::default());
        let mut a = arena_owning_one_chunk(&census);
        let id = loop {
            let mut out = Vec::new();
            a.tick(&mut out, 0.05);
            if let Some(r) = releases(&out).first() {
                break r.entity_id;
            }
        };
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::Thaw(Thaw {
                entity_id: id,
                reason: "released, but kept: no node could take it".into(),
            }),
        );
        assert_eq!(a.stats.releases_kept, 1);
        for _ in 0..RELEASE_BACKOFF_TICKS - 1 {
            let mut out = Vec::new();
            a.tick(&mut out, 0.05);
            assert!(writes(&out, id), "a thawed NPC moves again");
            assert!(releases(&out).iter().all(|r| r.entity_id != id));
        }
        // Once the back-off is over it goes as soon as it stands outside.
        let mut released_again = false;
        for _ in 0..400 {
            let mut out = Vec::new();
            a.tick(&mut out, 0.05);
            if releases(&out).iter().any(|r| r.entity_id == id) {
                released_again = true;
                break;
            }
        }
        assert!(released_again);
    }

    /// With `release` off the arena leaves every handoff to the sidecar's Freeze.
    #[test]
    fn an_arena_that_does_not_release_waits_for_the_freeze() {
        let census = Arc::new(Census::default());
        let mut a = arena_owning_one_chunk(&census);
        a.cfg.release = false;
        for _ in 0..200 {
            let mut out = Vec::new();
            a.tick(&mut out, 0.05);
            assert!(releases(&out).is_empty());
        }
    }

    #[test]
    fn npcs_around_the_origin_wander_across_the_seam_and_stay_in_their_square() {
        let census = Arc::new(Census::default());
        let mut a = arena(20, &census);
        for _ in 0..2000 {
            let mut out = Vec::new();
            a.tick(&mut out, 0.05);
            for b in &out {
                if let Body::Update(u) = b {
                    let p = u.position.unwrap();
                    assert!((0.0..SIZE).contains(&p.x) && (0.0..SIZE).contains(&p.y));
                }
            }
        }
        let t = Torus { w: SIZE, h: SIZE };
        let mut sides = (false, false);
        for e in a.entities.values() {
            let (dx, dy) = t.delta((0.0, 0.0), e.pos);
            // Half the square plus the steps taken before turning back.
            assert!(dx.abs() <= 21.0 && dy.abs() <= 21.0, "{dx},{dy} strayed");
            sides.0 |= dx < 0.0;
            sides.1 |= dx > 0.0;
        }
        assert!(sides.0 && sides.1, "NPCs on both sides of the seam");
    }

    #[test]
    fn a_frozen_npc_is_not_written_until_thawed() {
        let census = Arc::new(Census::default());
        let mut a = arena(3, &census);
        let id = *a.entities.keys().next().unwrap();
        let out = freeze(&mut a, id, 7);
        let Some(Body::Snapshot(s)) = out.first() else {
            panic!("the snapshot is written at once: {out:?}")
        };
        assert_eq!((s.entity_id, s.entity_epoch), (id, 7));
        let snap = snapshot_of(&out, id);
        assert_eq!(snap.kind, SnapshotKind::Npc);
        assert_eq!(
            snap.pos[..2],
            [a.entities[&id].pos.0, a.entities[&id].pos.1]
        );
        let before = a.entities[&id].pos;
        for _ in 0..500 {
            let mut out = Vec::new();
            a.tick(&mut out, 0.05);
            assert!(!writes(&out, id));
        }
        assert_eq!(a.entities[&id].pos, before, "not moved");
        // Frozen again (a lost answer): answered again, counted once.
        assert_eq!(snapshot_of(&freeze(&mut a, id, 7), id), snap);
        assert_eq!((a.stats.frozen, a.stats.snapshots), (1, 2));

        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::Thaw(Thaw {
                entity_id: id,
                reason: "target does not own the position".into(),
            }),
        );
        assert!(out.is_empty());
        a.tick(&mut out, 0.05);
        assert!(writes(&out, id), "moves again");
        assert_eq!(a.stats.thawed, 1);
    }

    #[test]
    fn a_freeze_of_an_unknown_id_is_not_answered() {
        let census = Arc::new(Census::default());
        let mut a = arena(1, &census);
        assert!(freeze(&mut a, 42, 1).is_empty());
        assert_eq!(a.stats.frozen, 0);
    }

    #[test]
    fn an_evicted_npc_is_forgotten_without_a_despawn_or_a_replacement() {
        let census = Arc::new(Census::default());
        let mut a = arena(3, &census);
        let id = *a.entities.keys().next().unwrap();
        freeze(&mut a, id, 1);
        let mut out = Vec::new();
        a.on_message(&mut out, M::Evict(Evict { entity_id: id }));
        a.on_message(
            &mut out,
            M::IdsReserved(IdsReserved {
                request_id: 2,
                ids: (2000..2010).collect(),
            }),
        );
        a.tick(&mut out, 0.05);
        assert!(!writes(&out, id));
        assert!(spawned(&out).is_empty(), "no NPC spawned to replace it");
        assert_eq!((a.entity_count(), a.stats.evicted), (2, 1));
        let r = census.report();
        assert_eq!(r.lost(), vec![id], "held by nobody until another adopts it");
        census.adopted(id, NODE + 1);
        assert!(census.report().lost().is_empty());
    }

    #[test]
    fn a_player_frozen_evicted_and_adopted_elsewhere_continues_its_inputs() {
        let census = Arc::new(Census::default());
        let mut src = arena(0, &census);
        let id = join(&mut src, "ann", 2);
        let mut out = Vec::new();
        for seq in 1..=3 {
            src.on_message(&mut out, input("ann", 2, seq, 1.0, 0.0));
        }
        src.tick(&mut out, 0.05);
        assert_eq!(ack_of(&out, id), Some((3, 3)));

        let out = freeze(&mut src, id, 4);
        let snap = snapshot_of(&out, id);
        assert_eq!(
            (snap.kind, snap.name.as_str(), snap.last_seq, snap.applied),
            (SnapshotKind::Player, "ann", 3, 3)
        );
        assert_eq!(snap.dir, [1.0, 0.0]);
        assert_eq!(snap.inventory, "sword,bread,10 gold");
        let mut out = Vec::new();
        src.on_message(&mut out, input("ann", 2, 4, 0.0, 1.0));
        src.tick(&mut out, 0.05);
        assert!(!writes(&out, id));
        assert_eq!(src.stats.inputs_while_frozen, 1);
        src.on_message(&mut out, M::Evict(Evict { entity_id: id }));
        // The account is simulated elsewhere now: its leave and inputs are not this arena's.
        src.on_message(
            &mut out,
            M::PlayerLeave(PlayerLeave {
                account: "ann".into(),
                session_epoch: 2,
                reason: String::new(),
            }),
        );
        src.on_message(&mut out, input("ann", 2, 5, 0.0, 1.0));
        src.tick(&mut out, 0.05);
        assert!(!writes(&out, id), "{out:?}");
        assert_eq!(src.stats.inputs_applied, 3);

        let mut dst = Arena::new(
            ArenaConfig {
                census: Some(census.clone()),
                ..ArenaConfig::default()
            },
            &Welcome {
                node_id: NODE + 1,
                ..welcome()
            },
        );
        let mut out = Vec::new();
        dst.on_message(&mut out, M::Adopt(adopt_msg(id, 5, &snap, "ann")));
        assert!(
            matches!(out.as_slice(), [Body::Adopted(Adopted { entity_id, entity_epoch: 5 })] if *entity_id == id),
            "{out:?}"
        );
        assert!(spawned(&out).is_empty(), "the sidecar already has it");
        dst.tick(&mut out, 0.05);
        assert_eq!(
            ack_of(&out, id),
            Some((3, 3)),
            "the acknowledgement is rewritten"
        );
        // Seq 4 reached only the frozen source: the client resends it here.
        let mut out = Vec::new();
        dst.on_message(&mut out, input("ann", 2, 3, 1.0, 1.0));
        dst.on_message(&mut out, input("ann", 2, 4, 0.0, 1.0));
        dst.on_message(&mut out, input("ann", 2, 4, 0.0, 1.0));
        dst.tick(&mut out, 0.05);
        assert_eq!(ack_of(&out, id), Some((4, 4)));
        assert_eq!(
            (dst.stats.inputs_applied, dst.stats.inputs_duplicate),
            (1, 2)
        );
        assert_eq!(dst.entities[&id].dir, (0.0, 1.0));
        let r = census.report();
        assert_eq!(r.holders.get(&id), Some(&vec![NODE + 1]));
        assert!(r.lost().is_empty() && r.duplicated().is_empty());
    }

    #[test]
    fn a_replayed_adopt_is_answered_without_a_second_copy() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        let s = player_snapshot("bob", 10, 8);
        let mut out = Vec::new();
        a.on_message(&mut out, M::Adopt(adopt_msg(77, 3, &s, "bob")));
        let mut out2 = Vec::new();
        a.on_message(&mut out2, input("bob", 2, 11, 1.0, 0.0));
        a.on_message(&mut out2, M::Adopt(adopt_msg(77, 3, &s, "bob")));
        assert!(matches!(
            out2.as_slice(),
            [Body::Adopted(Adopted {
                entity_id: 77,
                entity_epoch: 3
            })]
        ));
        assert_eq!((a.entity_count(), a.stats.adopted), (1, 1));
        let mut out = Vec::new();
        a.tick(&mut out, 0.05);
        assert_eq!(ack_of(&out, 77), Some((11, 9)), "the replay reset nothing");
    }

    #[test]
    fn adopt_takes_the_attachments_and_answers_for_the_root() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        let npc = SampleSnapshot {
            kind: SnapshotKind::Npc,
            name: "horse".into(),
            inventory: String::new(),
            session_epoch: 0,
            last_seq: 0,
            applied: 0,
            turn_in: 30,
            ..player_snapshot("x", 0, 0)
        };
        let mut root = adopt_msg(1, 2, &player_snapshot("cy", 1, 1), "cy");
        root.attachments.push(adopt_msg(2, 2, &npc, ""));
        // The sidecar's position wins and is normalised.
        root.position = Some(Vec3::xy(1000.5, -0.5));
        let mut out = Vec::new();
        a.on_message(&mut out, M::Adopt(root));
        assert_eq!(out.len(), 1);
        assert_eq!(a.entities[&1].pos, (0.5, 999.5));
        assert!(matches!(a.entities[&2].role, Role::Npc { turn_in: 30, .. }));
        a.tick(&mut out, 0.05);
        assert!(writes(&out, 1) && writes(&out, 2));
        assert_eq!(census.report().holders.len(), 2);
    }

    #[test]
    fn an_unreadable_adopt_creates_nothing_and_is_not_answered() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        let mut root = adopt_msg(1, 2, &player_snapshot("cy", 1, 1), "cy");
        let mut bad = root.clone();
        bad.entity_id = 2;
        bad.state = Bytes::from_static(b"{\"v\":1}");
        root.attachments.push(bad);
        let mut out = Vec::new();
        a.on_message(&mut out, M::Adopt(root));
        assert!(out.is_empty());
        assert_eq!(a.entity_count(), 0);
        assert!(census.report().holders.is_empty());
    }

    #[test]
    fn a_leave_while_frozen_waits_for_the_thaw() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        let id = join(&mut a, "dee", 1);
        freeze(&mut a, id, 1);
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::PlayerLeave(PlayerLeave {
                account: "dee".into(),
                session_epoch: 1,
                reason: "bye".into(),
            }),
        );
        assert!(out.is_empty(), "no despawn of a frozen entity");
        a.on_message(
            &mut out,
            M::Thaw(Thaw {
                entity_id: id,
                reason: "refused".into(),
            }),
        );
        assert!(
            matches!(out.as_slice(), [Body::Despawn(Despawn { entity_id })] if *entity_id == id)
        );
        assert_eq!(a.entity_count(), 0);
        assert!(census.report().alive.is_empty());
    }

    #[test]
    fn a_frozen_entity_adopted_back_resumes_as_one() {
        let census = Arc::new(Census::default());
        let mut a = arena(1, &census);
        let id = *a.entities.keys().next().unwrap();
        let snap = snapshot_of(&freeze(&mut a, id, 1), id);
        let mut out = Vec::new();
        a.on_message(&mut out, M::Adopt(adopt_msg(id, 2, &snap, "")));
        assert_eq!(out.len(), 1);
        a.tick(&mut out, 0.05);
        assert!(writes(&out, id));
        assert_eq!(a.entity_count(), 1);
        assert_eq!(census.report().holders.get(&id), Some(&vec![NODE]));
    }

    // ------------------------------------------------------------------ trade

    /// Bob's avatar, simulated by another node and seen here as a ghost.
    const BOB_GHOST: u64 = 555;
    /// Whoever else holds an escrow answered `CLAIM_HELD`.
    const OTHER_HOLDER: u64 = 4242;

    /// A player of this arena standing still at `at`.
    fn join_at(a: &mut Arena, account: &str, at: (f64, f64)) -> u64 {
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::PlayerJoin(PlayerJoin {
                account: account.into(),
                session_epoch: 1,
                last_position: Some(Vec3::xy(at.0, at.1)),
            }),
        );
        spawned(&out)[0]
    }

    /// A player of another node, as this arena sees its ghost.
    fn player_ghost(id: u64, account: &str, at: (f64, f64)) -> M {
        M::GhostEnter(GhostEnter {
            entity_id: id,
            position: Some(Vec3::xy(at.0, at.1)),
            components: vec![component(
                schema::KIND,
                Bytes::from(format!("player:{account}")),
                public(),
            )],
        })
    }

    fn tick_n(a: &mut Arena, n: u64) -> Vec<Body> {
        let mut out = Vec::new();
        for _ in 0..n {
            a.tick(&mut out, 0.05);
        }
        out
    }

    fn claims(out: &[Body]) -> Vec<Claim> {
        out.iter()
            .filter_map(|b| match b {
                Body::Claim(c) => Some(c.clone()),
                _ => None,
            })
            .collect()
    }

    /// (key, holder) of every `ClaimRelease`, in order.
    fn claim_releases(out: &[Body]) -> Vec<(String, u64)> {
        out.iter()
            .filter_map(|b| match b {
                Body::ClaimRelease(r) => Some((r.key.clone(), r.holder_entity)),
                _ => None,
            })
            .collect()
    }

    fn gifts(out: &[Body]) -> Vec<Command> {
        out.iter()
            .filter_map(|b| match b {
                Body::Command(c) if c.r#type == trade::CMD_TRADE => Some(c.clone()),
                _ => None,
            })
            .collect()
    }

    /// Ticks until a tick asks for claims, within one trade period: that tick's output.
    fn tick_to_trade(a: &mut Arena) -> Vec<Body> {
        for _ in 0..trade::TRADE_EVERY_TICKS {
            let out = tick_n(a, 1);
            if !claims(&out).is_empty() {
                return out;
            }
        }
        panic!("no claim asked in a whole trade period");
    }

    /// The store's answer to claim `c`.
    fn answer(a: &mut Arena, c: &Claim, outcome: ClaimOutcome) -> Vec<Body> {
        let held = outcome == ClaimOutcome::ClaimHeld;
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::ClaimResult(ClaimResult {
                request_id: c.request_id,
                key: c.key.clone(),
                outcome: outcome as i32,
                holder_entity: c.holder_entity,
                held_by: if held { OTHER_HOLDER } else { 0 },
                token: if held { 0 } else { 1 },
                detail: String::new(),
            }),
        );
        out
    }

    fn gift_result(a: &mut Arena, gift: &Command, error: CommandError) -> Vec<Body> {
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::CommandResult(CommandResult {
                request_id: gift.request_id,
                target: gift.target_entity,
                ok: error == CommandError::CommandOk,
                error: error as i32,
                ..Default::default()
            }),
        );
        out
    }

    fn lose(a: &mut Arena, account: &str, holder: u64) -> Vec<Body> {
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::ClaimLost(ClaimLost {
                key: trade::escrow(account),
                holder_entity: holder,
                reason: "lease lapsed".into(),
            }),
        );
        out
    }

    /// Whether the census has `account` in a trade: probed with an overlapping opening, which
    /// the census refuses (and counts) when it is one, and which is undone when it is not.
    fn in_trade(census: &Census, account: &str) -> bool {
        let probe = [account, "probe:nobody"];
        if census.trade_opened(probe, 0) {
            census.trade_closed(probe);
            false
        } else {
            true
        }
    }

    /// Every trade counter: (started, done, refused, failed, lost, called off, across border).
    fn trade_counters(s: &ArenaStats) -> [u64; 7] {
        [
            s.trades_started,
            s.trades_done,
            s.trades_refused,
            s.trades_failed,
            s.trades_lost,
            s.trades_called_off,
            s.trades_across_border,
        ]
    }

    /// Ann, a player of this arena, and Bob, a ghost of another node 10 m away across the
    /// world's seam, at the trade tick: the arena, Ann's avatar, and her two claims (her own
    /// escrow's, then Bob's).
    fn ann_trading_with_ghost_bob(census: &Arc<Census>) -> (Arena, u64, Claim, Claim) {
        let mut a = arena(0, census);
        let ann = join_at(&mut a, "ann", (0.0, 0.0));
        let mut out = Vec::new();
        a.on_message(&mut out, player_ghost(BOB_GHOST, "bob", (SIZE - 10.0, 0.0)));
        let asked = claims(&tick_to_trade(&mut a));
        assert_eq!(asked.len(), 2, "{asked:?}");
        let of = |account: &str| {
            asked
                .iter()
                .find(|c| c.key == trade::escrow(account))
                .cloned()
                .unwrap_or_else(|| panic!("no claim of {account}'s escrow: {asked:?}"))
        };
        (a, ann, of("ann"), of("bob"))
    }

    /// Both of Ann's escrows granted, then haggling until the gift goes: the gift.
    fn granted_until_the_gift(a: &mut Arena, own: &Claim, theirs: &Claim) -> Command {
        assert!(answer(a, own, ClaimOutcome::ClaimGranted).is_empty());
        assert!(answer(a, theirs, ClaimOutcome::ClaimGranted).is_empty());
        let out = tick_n(a, trade::HAGGLE_TICKS);
        let sent = gifts(&out);
        assert_eq!(sent.len(), 1, "{out:?}");
        sent[0].clone()
    }

    /// No key released twice, and none of `held` (answered `CLAIM_HELD`: never this arena's).
    fn assert_released_at_most_once(out: &[Body], held: &[&str]) {
        let released = claim_releases(out);
        let keys: HashSet<&str> = released.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys.len(),
            released.len(),
            "a key released twice: {released:?}"
        );
        for k in held {
            assert!(!keys.contains(k), "{k} was answered held: {released:?}");
        }
    }

    /// Two players of this arena in reach: each asks both escrows at the trade tick. The one the
    /// store grants both haggles, then gives once; the gift's result releases both claims.
    #[test]
    fn two_players_in_reach_claim_both_escrows_haggle_give_once_and_release_both() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        let ann = join_at(&mut a, "ann", (0.0, 0.0));
        let bob = join_at(&mut a, "bob", (trade::REACH_M - 1.0, 0.0));
        let asked = claims(&tick_to_trade(&mut a));
        assert_eq!(asked.len(), 4, "{asked:?}");
        for (avatar, own, theirs) in [(ann, "ann", "bob"), (bob, "bob", "ann")] {
            let mut keys: Vec<String> = asked
                .iter()
                .filter(|c| c.holder_entity == avatar)
                .map(|c| c.key.clone())
                .collect();
            keys.sort();
            let mut want = vec![trade::escrow(own), trade::escrow(theirs)];
            want.sort();
            assert_eq!(keys, want, "{asked:?}");
        }
        assert!(asked.iter().all(|c| c.ttl_ms == trade::CLAIM_TTL_MS));
        let ids: HashSet<u64> = asked.iter().map(|c| c.request_id).collect();
        assert_eq!(ids.len(), 4, "one request id per claim: {asked:?}");
        assert_eq!(
            (a.stats.trades_started, a.stats.trades_across_border),
            (2, 0)
        );

        // As a store would: Ann is granted both escrows, so Bob finds both held.
        let mut out = Vec::new();
        for c in &asked {
            let outcome = if c.holder_entity == ann {
                ClaimOutcome::ClaimGranted
            } else {
                ClaimOutcome::ClaimHeld
            };
            out.extend(answer(&mut a, c, outcome));
        }
        assert!(out.is_empty(), "nothing of Bob's to release: {out:?}");
        assert_eq!((a.stats.claims_granted, a.stats.claims_refused), (2, 2));
        assert_eq!(a.stats.trades_refused, 1);
        assert_eq!(a.trades_open(), 1);
        assert_eq!(census.trades(), (1, 0), "Ann's trade opened, once");
        // A second trade of either player would overlap.
        assert!(in_trade(&census, "ann") && in_trade(&census, "bob"));

        // Haggling: no gift before the haggle is over.
        let out = tick_n(&mut a, trade::HAGGLE_TICKS - 1);
        assert!(gifts(&out).is_empty(), "{out:?}");
        let out = tick_n(&mut a, 4);
        let sent = gifts(&out);
        assert_eq!(sent.len(), 1, "one gift: {out:?}");
        let g = &sent[0];
        assert_eq!(
            (g.target_entity, g.from_entity, g.r#type),
            (bob, ann, trade::CMD_TRADE)
        );
        assert_ne!(g.request_id, 0, "its result is wanted");
        assert_eq!(
            trade::decode(&g.payload).map(|(gold, _)| gold),
            Some(trade::GIFT_GOLD)
        );
        assert!(
            claim_releases(&out).is_empty(),
            "held until the result: {out:?}"
        );

        let out = gift_result(&mut a, g, CommandError::CommandOk);
        let mut released = claim_releases(&out);
        released.sort();
        assert_eq!(
            released,
            [(trade::escrow("ann"), ann), (trade::escrow("bob"), ann)]
        );
        assert_eq!((a.stats.trades_done, a.stats.results_ok), (1, 1));
        assert_eq!(a.trades_open(), 0);
        assert!(!in_trade(&census, "ann") && !in_trade(&census, "bob"));
        // A second result (a broken promise) releases nothing again.
        assert!(gift_result(&mut a, g, CommandError::CommandOk).is_empty());
        assert_eq!((a.stats.trades_done, a.stats.results_unexpected), (1, 1));
    }

    /// The trade tick is off the attacks' ticks, so that trades and attacks never share a tick.
    #[test]
    fn trades_open_in_ticks_without_attacks() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        join_at(&mut a, "ann", (0.0, 0.0));
        join_at(&mut a, "bob", (1.0, 0.0));
        tick_to_trade(&mut a);
        assert_eq!(a.ticks, trade::TRADE_EVERY_TICKS - trade::TICK_OFFSET);
        assert!(
            !a.ticks.is_multiple_of(combat::ATTACK_EVERY_TICKS),
            "tick {} opens trades and attacks alike",
            a.ticks
        );
    }

    #[test]
    fn a_partner_seen_as_a_ghost_of_another_node_gets_the_gift_across_the_border() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        assert_eq!((own.holder_entity, theirs.holder_entity), (ann, ann));
        assert_eq!(
            (a.stats.trades_started, a.stats.trades_across_border),
            (1, 1)
        );
        let g = granted_until_the_gift(&mut a, &own, &theirs);
        assert_eq!((g.target_entity, g.from_entity), (BOB_GHOST, ann));
        assert_eq!(census.trades(), (1, 0));
        let mut released = claim_releases(&gift_result(&mut a, &g, CommandError::CommandOk));
        released.sort();
        assert_eq!(
            released,
            [(trade::escrow("ann"), ann), (trade::escrow("bob"), ann)]
        );
        assert_eq!(a.stats.trades_done, 1);
    }

    /// Bob's escrow held elsewhere after Ann's was granted: refused, Ann's released at once.
    #[test]
    fn a_held_escrow_refuses_the_trade_and_releases_the_granted_one() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        let mut all = answer(&mut a, &own, ClaimOutcome::ClaimGranted);
        assert!(all.is_empty(), "{all:?}");
        let out = answer(&mut a, &theirs, ClaimOutcome::ClaimHeld);
        assert_eq!(claim_releases(&out), [(trade::escrow("ann"), ann)]);
        all.extend(out);
        assert_eq!(a.stats.trades_refused, 1);
        assert_eq!(a.trades_open(), 0);
        assert_eq!(census.trades(), (0, 0), "never opened");
        // Nothing more, up to and including the next trade tick where Ann asks afresh.
        all.extend(tick_n(&mut a, trade::HAGGLE_TICKS));
        let out = tick_to_trade(&mut a);
        let again = claims(&out);
        assert!(again
            .iter()
            .all(|c| c.request_id != own.request_id && c.request_id != theirs.request_id));
        all.extend(out);
        assert!(gifts(&all).is_empty(), "{all:?}");
        assert_released_at_most_once(&all, &[&theirs.key]);
    }

    /// Bob's escrow held elsewhere before Ann's was answered: nothing to release yet; Ann's is
    /// released when its grant comes, once.
    #[test]
    fn an_escrow_still_asked_when_the_trade_is_refused_is_released_once_granted() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        let mut all = answer(&mut a, &theirs, ClaimOutcome::ClaimHeld);
        assert!(claim_releases(&all).is_empty(), "{all:?}");
        assert_eq!(a.stats.trades_refused, 1);
        assert_eq!(a.trades_open(), 0);
        let out = answer(&mut a, &own, ClaimOutcome::ClaimGranted);
        assert_eq!(claim_releases(&out), [(trade::escrow("ann"), ann)]);
        all.extend(out);
        // A repeated answer releases nothing again.
        all.extend(answer(&mut a, &own, ClaimOutcome::ClaimGranted));
        all.extend(tick_n(&mut a, trade::HAGGLE_TICKS + 1));
        assert!(gifts(&all).is_empty(), "{all:?}");
        assert_released_at_most_once(&all, &[&theirs.key]);
        assert_eq!(a.stats.trades_refused, 1, "one trade, refused once");
    }

    /// A trade refused while its own escrow is still asked: no next trade for that avatar until
    /// the answer came (and was released), so the next trade's escrow is never the same grant
    /// as the one the release frees.
    #[test]
    fn no_next_trade_while_an_escrow_of_the_last_awaits_its_answer() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        answer(&mut a, &theirs, ClaimOutcome::ClaimHeld);
        assert_eq!(a.trades_open(), 0);
        let waiting = tick_n(&mut a, 2 * trade::TRADE_EVERY_TICKS);
        assert!(claims(&waiting).is_empty(), "{waiting:?}");
        let out = answer(&mut a, &own, ClaimOutcome::ClaimGranted);
        assert_eq!(claim_releases(&out), [(trade::escrow("ann"), ann)]);
        let again = claims(&tick_to_trade(&mut a));
        assert_eq!(again.len(), 2, "the next trade once answered: {again:?}");
    }

    #[test]
    fn an_escrow_still_asked_when_the_trade_is_refused_is_not_released_if_held() {
        let census = Arc::new(Census::default());
        let (mut a, _, own, theirs) = ann_trading_with_ghost_bob(&census);
        let mut all = answer(&mut a, &theirs, ClaimOutcome::ClaimHeld);
        all.extend(answer(&mut a, &own, ClaimOutcome::ClaimHeld));
        assert!(claim_releases(&all).is_empty(), "{all:?}");
        assert_eq!(a.stats.claims_refused, 2);
        assert_eq!(a.stats.trades_refused, 1, "one trade, refused once");
    }

    /// A Freeze calls the trade off: its claims are released before the snapshot completes the
    /// freeze, so the handoff carries none; the gift's late result moves no trade counter.
    #[test]
    fn a_freeze_mid_trade_releases_the_escrows_before_the_snapshot() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        let g = granted_until_the_gift(&mut a, &own, &theirs);
        let out = freeze(&mut a, ann, 2);
        let snapshot = out
            .iter()
            .position(|b| matches!(b, Body::Snapshot(s) if s.entity_id == ann))
            .expect("a snapshot");
        let releases_at: Vec<usize> = (0..out.len())
            .filter(|&i| matches!(out[i], Body::ClaimRelease(_)))
            .collect();
        assert_eq!(releases_at.len(), 2, "{out:?}");
        assert!(releases_at.iter().all(|&i| i < snapshot), "{out:?}");
        let mut released = claim_releases(&out);
        released.sort();
        assert_eq!(
            released,
            [(trade::escrow("ann"), ann), (trade::escrow("bob"), ann)]
        );
        assert_eq!(a.stats.trades_called_off, 1);
        assert_eq!(a.trades_open(), 0);
        assert!(!in_trade(&census, "ann"));
        // A repeated Freeze (its answer lost) is answered again, with nothing left to release.
        let out = freeze(&mut a, ann, 2);
        assert!(matches!(out.as_slice(), [Body::Snapshot(_)]), "{out:?}");
        assert_eq!(a.stats.trades_called_off, 1);

        let before = trade_counters(&a.stats);
        let out = gift_result(&mut a, &g, CommandError::CommandOk);
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(trade_counters(&a.stats), before);
        assert_eq!((a.stats.results_ok, a.stats.results_unexpected), (1, 0));
    }

    /// Frozen with one escrow still asked: the granted one goes before the snapshot, the other
    /// once its grant comes.
    #[test]
    fn a_freeze_with_an_escrow_still_asked_releases_it_when_granted() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        assert!(answer(&mut a, &own, ClaimOutcome::ClaimGranted).is_empty());
        let out = freeze(&mut a, ann, 2);
        assert!(
            matches!(out.as_slice(), [Body::ClaimRelease(r), Body::Snapshot(_)]
                if r.key == own.key && r.holder_entity == ann),
            "{out:?}"
        );
        assert_eq!(a.stats.trades_called_off, 1);
        let out = answer(&mut a, &theirs, ClaimOutcome::ClaimGranted);
        assert_eq!(claim_releases(&out), [(theirs.key.clone(), ann)]);
    }

    /// A player who leaves with an escrow still asked: the despawn frees what the holder had,
    /// so the grant that comes after it is not released again (the sidecar knows it no more).
    #[test]
    fn an_escrow_granted_after_its_avatar_despawned_is_not_released() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        assert!(answer(&mut a, &theirs, ClaimOutcome::ClaimGranted).is_empty());
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::PlayerLeave(PlayerLeave {
                account: "ann".into(),
                session_epoch: 1,
                reason: "logout".into(),
            }),
        );
        let despawn = out
            .iter()
            .position(|b| matches!(b, Body::Despawn(d) if d.entity_id == ann))
            .expect("ann despawned");
        assert_eq!(claim_releases(&out[..despawn]), [(theirs.key.clone(), ann)]);
        assert_eq!(a.trades_open(), 0);
        let out = answer(&mut a, &own, ClaimOutcome::ClaimGranted);
        assert!(claim_releases(&out).is_empty(), "{out:?}");
    }

    /// The result of a gift whose trade was called off belongs to that trade only: once the
    /// avatar is thawed and trading again, it must not end the new trade.
    #[test]
    fn a_late_gift_result_does_not_end_the_avatars_next_trade() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        let g = granted_until_the_gift(&mut a, &own, &theirs);
        freeze(&mut a, ann, 2);
        let mut out = Vec::new();
        a.on_message(
            &mut out,
            M::Thaw(Thaw {
                entity_id: ann,
                reason: "refused".into(),
            }),
        );
        let again = claims(&tick_to_trade(&mut a));
        assert_eq!(again.len(), 2, "{again:?}");
        for c in &again {
            assert!(answer(&mut a, c, ClaimOutcome::ClaimGranted).is_empty());
        }
        let before = trade_counters(&a.stats);
        let out = gift_result(&mut a, &g, CommandError::CommandOk);
        assert!(
            claim_releases(&out).is_empty(),
            "the new trade's claims released by the old gift's result: {out:?}"
        );
        assert_eq!(a.trades_open(), 1, "the new trade ended by the old result");
        assert_eq!(trade_counters(&a.stats), before);
    }

    /// A lost escrow ends the trade while haggling: only the other one is released, no gift.
    #[test]
    fn a_claim_lost_mid_haggle_ends_the_trade_without_a_gift() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        assert!(answer(&mut a, &own, ClaimOutcome::ClaimGranted).is_empty());
        assert!(answer(&mut a, &theirs, ClaimOutcome::ClaimGranted).is_empty());
        let out = tick_n(&mut a, trade::HAGGLE_TICKS / 2);
        assert!(gifts(&out).is_empty());
        let mut all = lose(&mut a, "bob", ann);
        assert_eq!(claim_releases(&all), [(trade::escrow("ann"), ann)]);
        assert_eq!((a.stats.trades_lost, a.stats.claims_lost), (1, 1));
        assert_eq!(a.trades_open(), 0);
        assert!(!in_trade(&census, "ann") && !in_trade(&census, "bob"));
        // Lost again: a loss, but no trade of it to end.
        all.extend(lose(&mut a, "bob", ann));
        assert_eq!((a.stats.trades_lost, a.stats.claims_lost), (1, 2));
        all.extend(tick_n(&mut a, trade::HAGGLE_TICKS));
        assert!(gifts(&all).is_empty(), "{all:?}");
        assert_eq!(a.commands_outstanding(), 0);
        assert_released_at_most_once(&all, &[&theirs.key]);
    }

    /// A loss of an earlier grant (sent as the trade's release was on its way) reaching the
    /// avatar's next trade, whose escrow of that key is only asked for: whatever becomes of that
    /// trade, no escrow granted to it stays held once it is over.
    #[test]
    fn a_stale_claim_lost_leaves_no_escrow_of_the_next_trade_held() {
        let census = Arc::new(Census::default());
        let (mut a, ann, own, theirs) = ann_trading_with_ghost_bob(&census);
        let g = granted_until_the_gift(&mut a, &own, &theirs);
        assert_eq!(
            claim_releases(&gift_result(&mut a, &g, CommandError::CommandOk)).len(),
            2
        );
        let again = claims(&tick_to_trade(&mut a));
        assert_eq!(again.len(), 2, "{again:?}");
        let mut all = lose(&mut a, "ann", ann);
        for c in &again {
            all.extend(answer(&mut a, c, ClaimOutcome::ClaimGranted));
        }
        if a.trades_open() == 0 {
            let mut released = claim_releases(&all);
            released.sort();
            assert_eq!(
                released,
                [(trade::escrow("ann"), ann), (trade::escrow("bob"), ann)],
                "the trade ended with a granted escrow left held"
            );
        } else {
            assert!(a.trades[&ann].both_granted());
        }
    }

    fn gift_in(target: u64, request_id: u64, trade_id: u64) -> M {
        M::CommandIn(CommandIn {
            target,
            from_entity: BOB_GHOST,
            from_account: "bob".into(),
            r#type: trade::CMD_TRADE,
            payload: trade::encode(trade::GIFT_GOLD, trade_id),
            request_id,
            from_node: NODE + 1,
        })
    }

    #[test]
    fn a_gift_to_a_player_here_is_applied_and_one_to_an_npc_refused() {
        let census = Arc::new(Census::default());
        let mut a = arena(1, &census);
        let npc = a.held().find(|h| !h.player).unwrap().id;
        let ann = join_at(&mut a, "ann", (0.0, 0.0));
        let mut out = Vec::new();
        a.on_message(&mut out, gift_in(ann, 7, 42));
        assert!(
            matches!(
                out.as_slice(),
                [Body::CommandReply(CommandReply {
                    request_id: 7,
                    refused: false,
                    ..
                })]
            ),
            "{out:?}"
        );
        assert_eq!((a.stats.gifts_applied, a.stats.commands_refused), (1, 0));
        assert_eq!(census.commands(), (1, 0));

        let mut out = Vec::new();
        a.on_message(&mut out, gift_in(npc, 8, 43));
        let [Body::CommandReply(r)] = out.as_slice() else {
            panic!("one reply: {out:?}")
        };
        assert!(
            r.refused && r.request_id == 8 && !r.detail.is_empty(),
            "{r:?}"
        );
        assert_eq!((a.stats.gifts_applied, a.stats.commands_refused), (1, 1));
        assert_eq!(census.commands(), (1, 0), "not applied");
    }

    /// A player adopted from another node was seen here as a ghost: it is this arena's own now,
    /// never its own trade partner, and not a partner across a border.
    #[test]
    fn an_adopted_player_is_no_longer_a_partner_by_its_ghost_entry() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        let mut out = Vec::new();
        a.on_message(&mut out, player_ghost(BOB_GHOST, "bob", (10.0, 0.0)));
        let mut snap = player_snapshot("bob", 0, 0);
        snap.pos = [10.0, 0.0, 0.0];
        a.on_message(&mut out, M::Adopt(adopt_msg(BOB_GHOST, 2, &snap, "bob")));
        assert!(matches!(out.as_slice(), [Body::Adopted(_)]), "{out:?}");
        let out = tick_n(&mut a, trade::TRADE_EVERY_TICKS);
        assert!(claims(&out).is_empty(), "Bob traded with himself: {out:?}");
        assert_eq!(a.stats.trades_started, 0);

        let ann = join_at(&mut a, "ann", (0.0, 0.0));
        assert_eq!(claims(&tick_to_trade(&mut a)).len(), 4);
        assert_eq!(a.trades[&ann].partner, BOB_GHOST);
        assert_eq!(a.trades[&BOB_GHOST].partner, ann);
        assert_eq!(a.trades[&BOB_GHOST].accounts(), ["bob", "ann"]);
        assert_eq!(a.stats.trades_across_border, 0, "Bob is simulated here");
    }

    /// Another avatar of the same account (a ghost of another node, or a second one adopted
    /// here) is never a partner, however near; a farther player still is.
    #[test]
    fn a_player_never_trades_with_another_avatar_of_its_own_account() {
        let census = Arc::new(Census::default());
        let mut a = arena(0, &census);
        let ann = join_at(&mut a, "ann", (0.0, 0.0));
        let mut out = Vec::new();
        a.on_message(&mut out, player_ghost(777, "ann", (5.0, 0.0)));
        let mut snap = player_snapshot("ann", 0, 0);
        snap.pos = [0.0, 5.0, 0.0];
        a.on_message(&mut out, M::Adopt(adopt_msg(778, 2, &snap, "ann")));
        let out = tick_n(&mut a, trade::TRADE_EVERY_TICKS);
        assert!(claims(&out).is_empty(), "{out:?}");

        let mut out = Vec::new();
        a.on_message(&mut out, player_ghost(BOB_GHOST, "bob", (20.0, 0.0)));
        let asked = claims(&tick_to_trade(&mut a));
        assert_eq!(a.trades.keys().copied().collect::<Vec<_>>(), [778, ann]);
        for t in a.trades.values() {
            assert_eq!(t.partner, BOB_GHOST);
            assert_eq!(t.accounts(), ["ann", "bob"]);
        }
        for avatar in [ann, 778] {
            let keys: HashSet<&str> = asked
                .iter()
                .filter(|c| c.holder_entity == avatar)
                .map(|c| c.key.as_str())
                .collect();
            assert_eq!(keys, HashSet::from(["trade:ann", "trade:bob"]), "{asked:?}");
        }
    }

    #[test]
    fn a_den_given_to_this_node_is_stocked_under_the_given_id_and_gone_when_killed_or_lost() {
        let census = Arc::new(Census::default());
        let cfg = ArenaConfig {
            npcs: 0,
            census: Some(census.clone()),
            dens: vec![("wolves".into(), (250.0, 10.0))],
            ..ArenaConfig::default()
        };
        let mut a = Arena::new(cfg, &welcome());
        let mut out = Vec::new();
        a.start(&mut out);
        let declared: Vec<_> = out
            .iter()
            .filter_map(|b| match b {
                Body::DeclareSpawners(d) => Some(d.points.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(declared.len(), 1);
        assert_eq!(declared[0][0].key, "wolves");
        let owned = |id: u64, generation: u64| {
            M::SpawnerOwned(SpawnerOwned {
                key: "wolves".into(),
                entity_id: id,
                generation,
                position: Some(Vec3::xy(250.0, 10.0)),
            })
        };
        let stock = 1 << 62 | 7;
        let mut out = Vec::new();
        a.on_message(&mut out, owned(stock, 1));
        // Said twice (a repeated word): stocked once.
        a.on_message(&mut out, owned(stock, 1));
        assert_eq!(spawned(&out), [stock]);
        assert_eq!(a.held().next().unwrap().pos, (250.0, 10.0));
        // Killed: gone for good, not risen.
        let mut out = Vec::new();
        for k in 0..5 {
            a.on_message(&mut out, attack_in(stock, "ann", 1, NODE, k + 1));
        }
        assert!(out
            .iter()
            .any(|b| matches!(b, Body::Despawn(d) if d.entity_id == stock)));
        assert_eq!(a.entity_count(), 0);
        assert_eq!(a.stats.den_kills, 1);
        // The next generation; then its den's claim is lost: gone too.
        let next = 1 << 62 | 8;
        let mut out = Vec::new();
        a.on_message(&mut out, owned(next, 2));
        a.on_message(
            &mut out,
            M::ClaimLost(ClaimLost {
                key: "spawner:wolves".into(),
                holder_entity: next,
                reason: "lapsed".into(),
            }),
        );
        assert!(out
            .iter()
            .any(|b| matches!(b, Body::Despawn(d) if d.entity_id == next)));
        assert_eq!(census.dens(), (2, 0));
    }

    #[test]
    fn the_census_counts_a_den_stocked_while_another_of_it_is_held() {
        let census = Census::default();
        census.spawned_stock("wolves", 1, 1);
        census.despawned(1, 1);
        census.spawned_stock("wolves", 2, 1);
        assert_eq!(census.dens(), (2, 0), "one after the other");
        // Node 1 died holding 2 (nobody holds it); node 2 stocks the den again: fine...
        census.release_holder(1);
        census.spawned_stock("wolves", 3, 2);
        assert_eq!(census.dens(), (3, 0));
        // ...but 2 restored on node 4 while 3 lives is a den stocked twice.
        census.adopted(2, 4);
        assert_eq!(census.dens(), (3, 1));
    }
}
