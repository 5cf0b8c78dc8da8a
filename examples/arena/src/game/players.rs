//! Players' avatars: spawned on a session's join, kept across a new login, gone on leave, and
//! moved by the client's inputs, applied once and in order.

use super::{component, owner_and_party, owner_only, public, Arena, Entity, Outbox, Player, Role};
use crate::schema;
use bytes::Bytes;
use cellmesh_proto::local::{
    game_message::Body, Despawn, Input, PlayerJoin, PlayerLeave, Spawn, Vec3,
};

impl Arena {
    /// A session joined: its avatar spawns, or a player already here keeps the one it has.
    pub(super) fn on_join(&mut self, out: &mut impl Outbox, j: PlayerJoin) {
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

    /// A session left: its avatar goes, unless a newer session holds it or a handoff has it frozen.
    pub(super) fn on_leave(&mut self, out: &mut impl Outbox, l: PlayerLeave) {
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

    /// A client input: applied once, in order, to the avatar of a current session.
    pub(super) fn on_input(&mut self, i: Input) {
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
        // A newer session's input: the avatar is that session's now (a release names the
        // session of the last input applied).
        p.session_epoch = p.session_epoch.max(i.session_epoch);
        p.last_seq = i.seq;
        p.applied += 1;
        p.ack_dirty = true;
        self.stats.inputs_applied += 1;
    }

    pub(super) fn spawn_player(
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
                offload: false,
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

    pub(super) fn player_mut(&mut self, account: &str) -> Option<(&mut Entity, u64)> {
        let id = *self.players.get(account)?;
        self.entities.get_mut(&id).map(|e| (e, id))
    }

    pub(super) fn despawn_player(&mut self, out: &mut impl Outbox, id: u64) {
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

    /// A player's experience, if this arena holds its avatar.
    pub fn xp_of(&self, account: &str) -> Option<u64> {
        let id = self.players.get(account)?;
        match &self.entities.get(id)?.role {
            Role::Player(p) => Some(p.xp),
            Role::Npc { .. } => None,
        }
    }
}
