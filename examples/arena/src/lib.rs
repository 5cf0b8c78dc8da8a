//! `arena`: a toy game server that uses nothing but the cellmesh local-protocol SDK.
//!
//! Players walk where their input points; NPCs wander. It shows the audiences: `Kind` is public,
//! `Health` is public for NPCs and owner-and-party for players, `Inventory` and `InputAck` are
//! owner-only. It is the reference for how a game adopts the local protocol (see the README).

pub mod schema;

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use cellmesh_proto::local::{
    game_message::Body, sidecar_message, Audience, AudienceKind, Component, Despawn, Event, Load,
    ReserveIds, Spawn, Update, Vec3,
};
use cellmesh_proto::sdk::{self, GameSender, SdkConfig, SidecarAddr};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct ArenaConfig {
    pub sidecar: SidecarAddr,
    pub npcs: u32,
    /// Where NPCs and new players appear, and the square they roam in (`spread` metres a side).
    pub center: (f64, f64),
    pub spread: f64,
    pub tick_hz: u32,
    pub seed: u64,
}

impl Default for ArenaConfig {
    fn default() -> Self {
        Self {
            sidecar: SidecarAddr::Tcp("127.0.0.1:7100".into()),
            npcs: 100,
            center: (1000.0, 1000.0),
            spread: 400.0,
            tick_hz: 20,
            seed: 1,
        }
    }
}

/// What the arena did, for logs and tests.
#[derive(Debug, Clone, Default)]
pub struct ArenaStats {
    pub ticks: u64,
    pub inputs_applied: u64,
    pub inputs_duplicate: u64,
    pub players_joined: u64,
    pub errors_from_sidecar: u64,
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

struct Npc {
    pos: (f64, f64),
    dir: (f64, f64),
    turn_in: u32,
}

struct Player {
    id: u64,
    session_epoch: u64,
    pos: (f64, f64),
    dir: (f64, f64),
    last_seq: u64,
    applied: u64,
    ack_dirty: bool,
}

/// A `PlayerJoin` that arrived while no id was free: account, session epoch, last position.
type PendingJoin = (String, u64, Option<(f64, f64)>);

struct Arena {
    cfg: ArenaConfig,
    rng: StdRng,
    ids: Vec<u64>,
    next_request: u64,
    ids_requested: bool,
    npcs: HashMap<u64, Npc>,
    players: HashMap<String, Player>,
    /// Joins waiting for ids: account, session epoch, where to appear.
    waiting: Vec<PendingJoin>,
    /// The part of the world this node owns (`x0, y0, x1, y1`), when it is not all of it: until
    /// entities can be handed to the next node, the arena keeps its own inside.
    bounds: Option<(f64, f64, f64, f64)>,
    stats: ArenaStats,
}

impl Arena {
    fn new(cfg: ArenaConfig) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        Self {
            cfg,
            rng,
            ids: Vec::new(),
            next_request: 1,
            ids_requested: false,
            npcs: HashMap::new(),
            players: HashMap::new(),
            waiting: Vec::new(),
            bounds: None,
            stats: ArenaStats::default(),
        }
    }

    /// Learns the owned area from the sidecar's `Welcome` (the first rectangle, if it is not the
    /// whole world).
    fn set_area(&mut self, welcome: &cellmesh_proto::local::Welcome) {
        let world = welcome.world.map(|w| (w.width, w.height));
        if let (Some(r), Some((w, h))) = (welcome.owned_area.first(), world) {
            if r.width < w || r.height < h {
                self.bounds = Some((r.x, r.y, r.x + r.width, r.y + r.height));
            }
        }
    }

    /// `p` moved inside the owned area (a metre from its edge); which axes were clamped.
    fn keep_inside(&self, p: (f64, f64)) -> ((f64, f64), bool, bool) {
        let Some((x0, y0, x1, y1)) = self.bounds else {
            return (p, false, false);
        };
        let x = p.0.clamp(x0 + 1.0, x1 - 1.0);
        let y = p.1.clamp(y0 + 1.0, y1 - 1.0);
        ((x, y), x != p.0, y != p.1)
    }

    fn random_point(&mut self) -> (f64, f64) {
        let h = self.cfg.spread / 2.0;
        let p = (
            self.cfg.center.0 + self.rng.random_range(-h..h),
            self.cfg.center.1 + self.rng.random_range(-h..h),
        );
        self.keep_inside(p).0
    }

    fn random_dir(&mut self) -> (f64, f64) {
        let a: f64 = self.rng.random_range(0.0..std::f64::consts::TAU);
        (a.cos(), a.sin())
    }

    fn request_ids(&mut self, tx: &mut GameSender) {
        if !self.ids_requested && self.ids.len() < 64 {
            tx.push(Body::ReserveIds(ReserveIds {
                request_id: self.next_request,
                count: 512,
            }));
            self.next_request += 1;
            self.ids_requested = true;
        }
    }

    fn spawn_npcs(&mut self, tx: &mut GameSender) {
        while (self.npcs.len() as u32) < self.cfg.npcs {
            let Some(id) = self.ids.pop() else { break };
            let pos = self.random_point();
            let dir = self.random_dir();
            let n = self.npcs.len();
            tx.push(Body::Spawn(Spawn {
                entity_id: id,
                position: Some(Vec3::xy(pos.0, pos.1)),
                components: vec![
                    component(
                        schema::KIND,
                        Bytes::from(format!("npc:wanderer-{n}")),
                        public(),
                    ),
                    component(schema::HEALTH, schema::health(50, 50), public()),
                ],
                ..Default::default()
            }));
            let turn_in = self.rng.random_range(20..100);
            self.npcs.insert(id, Npc { pos, dir, turn_in });
        }
    }

    fn spawn_player(
        &mut self,
        tx: &mut GameSender,
        account: String,
        epoch: u64,
        at: Option<(f64, f64)>,
    ) {
        let Some(id) = self.ids.pop() else {
            self.waiting.push((account, epoch, at));
            return;
        };
        let pos = match at {
            Some(p) => self.keep_inside(p).0,
            None => self.random_point(),
        };
        tx.push(Body::Spawn(Spawn {
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
                    schema::health(100, 100),
                    owner_and_party(&[]),
                ),
                component(
                    schema::INVENTORY,
                    Bytes::from_static(b"sword,bread,10 gold"),
                    owner_only(),
                ),
                component(schema::INPUT_ACK, schema::input_ack(0, 0), owner_only()),
            ],
            owner_account: account.clone(),
            is_master: true,
            parent_id: 0,
        }));
        self.stats.players_joined += 1;
        self.players.insert(
            account,
            Player {
                id,
                session_epoch: epoch,
                pos,
                dir: (0.0, 0.0),
                last_seq: 0,
                applied: 0,
                ack_dirty: false,
            },
        );
    }

    fn on_message(&mut self, tx: &mut GameSender, msg: sidecar_message::Body) {
        use sidecar_message::Body as M;
        match msg {
            M::IdsReserved(r) => {
                self.ids.extend(r.ids);
                self.ids_requested = false;
                for (account, epoch, at) in std::mem::take(&mut self.waiting) {
                    self.spawn_player(tx, account, epoch, at);
                }
                self.spawn_npcs(tx);
            }
            M::PlayerJoin(j) => {
                if let Some(p) = self.players.get_mut(&j.account) {
                    // A new login of a player already in the world keeps its avatar.
                    p.session_epoch = p.session_epoch.max(j.session_epoch);
                } else {
                    let at = j.last_position.map(|v| (v.x, v.y));
                    self.spawn_player(tx, j.account, j.session_epoch, at);
                }
            }
            M::PlayerLeave(l) => {
                let current = self.players.get(&l.account).map(|p| p.session_epoch);
                if current.is_some_and(|e| e <= l.session_epoch) {
                    let p = self.players.remove(&l.account).expect("checked above");
                    tx.push(Body::Despawn(Despawn { entity_id: p.id }));
                }
            }
            M::Input(i) => {
                let Some(p) = self.players.get_mut(&i.account) else {
                    return;
                };
                if i.session_epoch < p.session_epoch {
                    return;
                }
                if i.seq <= p.last_seq {
                    self.stats.inputs_duplicate += 1;
                    return;
                }
                if let Some((dx, dy)) = schema::parse_input(&i.payload) {
                    let len = (dx as f64).hypot(dy as f64);
                    p.dir = if len > 1e-6 {
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
            M::Error(e) => {
                self.stats.errors_from_sidecar += 1;
                tracing::warn!(code = e.code, detail = %e.detail, "sidecar reported an error");
            }
            other => tracing::debug!(?other, "arena ignores this message"),
        }
    }

    fn tick(&mut self, tx: &mut GameSender, dt: f64) {
        let bounds = self.bounds;
        let inside = |b: Option<(f64, f64, f64, f64)>, p: (f64, f64)| match b {
            Some((x0, y0, x1, y1)) => {
                let q = (p.0.clamp(x0 + 1.0, x1 - 1.0), p.1.clamp(y0 + 1.0, y1 - 1.0));
                (q, q.0 != p.0, q.1 != p.1)
            }
            None => (p, false, false),
        };
        let ids: Vec<u64> = self.npcs.keys().copied().collect();
        for id in ids {
            let new_dir = self.random_dir();
            let emote = self.rng.random_ratio(1, 400);
            let (cx, cy, h) = (self.cfg.center.0, self.cfg.center.1, self.cfg.spread / 2.0);
            let npc = self.npcs.get_mut(&id).expect("id from keys");
            npc.turn_in = npc.turn_in.saturating_sub(1);
            if npc.turn_in == 0 {
                npc.dir = new_dir;
                npc.turn_in = 40;
            }
            // Wander inside the arena square: turn back at its edge.
            if (npc.pos.0 - cx).abs() > h {
                npc.dir.0 = -(npc.pos.0 - cx).signum() * npc.dir.0.abs();
            }
            if (npc.pos.1 - cy).abs() > h {
                npc.dir.1 = -(npc.pos.1 - cy).signum() * npc.dir.1.abs();
            }
            npc.pos.0 += npc.dir.0 * schema::NPC_SPEED * dt;
            npc.pos.1 += npc.dir.1 * schema::NPC_SPEED * dt;
            let (kept, hit_x, hit_y) = inside(bounds, npc.pos);
            npc.pos = kept;
            if hit_x {
                npc.dir.0 = -npc.dir.0;
            }
            if hit_y {
                npc.dir.1 = -npc.dir.1;
            }
            tx.push(Body::Update(Update {
                entity_id: id,
                position: Some(Vec3::xy(npc.pos.0, npc.pos.1)),
                ..Default::default()
            }));
            if emote {
                tx.push(Body::Event(Event {
                    entity_id: id,
                    r#type: schema::EVENT_EMOTE,
                    payload: Bytes::from_static(b"waves"),
                    audience: public(),
                }));
            }
        }
        for p in self.players.values_mut() {
            let moving = p.dir != (0.0, 0.0);
            if moving {
                p.pos.0 += p.dir.0 * schema::PLAYER_SPEED * dt;
                p.pos.1 += p.dir.1 * schema::PLAYER_SPEED * dt;
                p.pos = inside(bounds, p.pos).0;
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
                tx.push(Body::Update(Update {
                    entity_id: p.id,
                    position: moving.then(|| Vec3::xy(p.pos.0, p.pos.1)),
                    changed,
                    removed_types: vec![],
                }));
            }
        }
    }
}

/// Runs the arena until `shutdown` completes or the sidecar goes away.
pub async fn run(
    cfg: ArenaConfig,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<ArenaStats> {
    let mut sdk_cfg = SdkConfig::tcp("", "arena");
    sdk_cfg.addr = cfg.sidecar.clone();
    sdk_cfg.tick_rate_hz = cfg.tick_hz;
    let (mut tx, mut rx, welcome) = sdk::connect(sdk_cfg)
        .await
        .context("connecting to the sidecar")?;
    tracing::info!(node = welcome.node_id, "arena joined its sidecar");
    let tick_len = Duration::from_secs_f64(1.0 / cfg.tick_hz.max(1) as f64);
    let mut arena = Arena::new(cfg);
    arena.set_area(&welcome);
    arena.request_ids(&mut tx);
    tx.flush().await?;
    let mut ticker = tokio::time::interval(tick_len);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick: u64 = 0;
    let mut last_load = tokio::time::Instant::now();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            msg = rx.next() => match msg {
                Some(Ok(m)) => if let Some(body) = m.body { arena.on_message(&mut tx, body) },
                Some(Err(e)) => return Err(e).context("reading from the sidecar"),
                None => { tracing::info!("sidecar closed the connection"); break }
            },
            _ = ticker.tick() => {
                let started = tokio::time::Instant::now();
                tick += 1;
                arena.tick(&mut tx, tick_len.as_secs_f64());
                arena.request_ids(&mut tx);
                if last_load.elapsed() >= Duration::from_secs(1) {
                    last_load = tokio::time::Instant::now();
                    tx.push(Body::Load(Load {
                        tick_ms: started.elapsed().as_secs_f32() * 1000.0,
                        budget_ms: tick_len.as_secs_f32() * 1000.0,
                        entity_count: (arena.npcs.len() + arena.players.len()) as u32,
                    }));
                }
                arena.stats.ticks = tick;
                tx.end_tick(tick).await.context("sending the tick")?;
            }
        }
    }
    let _ = tx.close().await;
    Ok(arena.stats)
}
