//! NPCs: the ids reserved for them, the wanderers spawned at start, and the dens (the mesh's
//! spawn points) this node is given.

use super::{component, public, Arena, Entity, Outbox, Role, DEN_PREFIX};
use crate::combat::DamageTable;
use crate::schema;
use bytes::Bytes;
use cellmesh_proto::local::{
    game_message::Body, DeclareSpawners, Despawn, IdsReserved, ReserveIds, Spawn, SpawnPoint,
    SpawnerOwned, Vec3,
};
use rand::rngs::StdRng;
use rand::Rng;

impl Arena {
    /// Reserved ids came: waiting players spawn first, then NPCs.
    pub(super) fn on_ids_reserved(&mut self, out: &mut impl Outbox, r: IdsReserved) {
        self.ids.extend(r.ids);
        self.ids_requested = false;
        for (account, epoch, at) in std::mem::take(&mut self.waiting) {
            self.spawn_player(out, account, epoch, at);
        }
        self.spawn_npcs(out);
    }

    pub(super) fn random_point(&mut self) -> (f64, f64) {
        let h = self.cfg.spread / 2.0;
        let (dx, dy) = if h > 0.0 {
            (self.rng.random_range(-h..h), self.rng.random_range(-h..h))
        } else {
            (0.0, 0.0)
        };
        self.torus
            .normalise((self.cfg.center.0 + dx, self.cfg.center.1 + dy))
    }

    pub(super) fn random_dir(rng: &mut StdRng) -> (f64, f64) {
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
    pub(super) fn stock_den(&mut self, out: &mut impl Outbox, o: SpawnerOwned) {
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
    pub(super) fn despawn_den_npc(&mut self, out: &mut impl Outbox, id: u64) {
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
    pub(super) fn spawn_npc(
        &mut self,
        out: &mut impl Outbox,
        id: u64,
        pos: (f64, f64),
        name: String,
    ) {
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
                offload: false,
                epoch: 1,
                role: Role::Npc {
                    name,
                    turn_in,
                    damage: DamageTable::default(),
                },
            },
        );
    }

    pub(super) fn spawn_npcs(&mut self, out: &mut impl Outbox) {
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
}
