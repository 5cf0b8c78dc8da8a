//! Handoffs from the game's side: a frozen entity is neither moved nor written, its snapshot is
//! complete, an evicted one is forgotten without a despawn, and an adopted one carries on from its
//! snapshot, attachments and input sequence numbers included.

use super::{Arena, Entity, Outbox, Player, Role, RELEASE_BACKOFF_TICKS};
use crate::combat::DamageTable;
use crate::schema::SampleSnapshot;
use crate::schema::SnapshotKind;
use cellmesh_proto::local::{
    game_message::Body, Adopt, Adopted, Checkpoint, CheckpointState, Evict, Freeze, Offload,
    Snapshot, Thaw,
};

impl Arena {
    /// The sidecar hands an entity away: frozen, and its snapshot answered.
    pub(super) fn on_freeze(&mut self, out: &mut impl Outbox, f: Freeze) {
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

    /// An avatar walked out of the area: its trade ends here (its claims released before the
    /// release, so the handoff carries none of them), then it is released with the last input
    /// applied to it. From here on it drops its player's inputs: the sidecar hands them on.
    pub(super) fn release_avatar(&mut self, out: &mut impl Outbox, id: u64) {
        self.call_off_trade(out, id);
        let Some(e) = self.entities.get_mut(&id) else {
            return;
        };
        let Role::Player(p) = &e.role else { return };
        let last_input = (p.last_seq, p.session_epoch);
        out.push(Body::Release(e.release(id, last_input)));
        self.stats.released += 1;
        self.stats.avatars_released += 1;
    }

    /// The sidecar asks for an entity's release at the end of the next tick: it is simulated in
    /// that tick, then released with the tick's state.
    pub(super) fn on_offload(&mut self, o: Offload) {
        match self.entities.get_mut(&o.entity_id) {
            // Frozen: its Release or Snapshot is on its way already.
            Some(e) if !e.frozen && e.epoch == o.entity_epoch => e.offload = true,
            Some(_) => {}
            None => tracing::warn!(
                entity = o.entity_id,
                "offload of an entity this arena does not hold"
            ),
        }
    }

    /// The sidecar asks for checkpoints of entities written here.
    pub(super) fn on_checkpoint(&mut self, out: &mut impl Outbox, c: Checkpoint) {
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

    /// A handoff was refused: the entity resumes here.
    pub(super) fn on_thaw(&mut self, out: &mut impl Outbox, t: Thaw) {
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

    /// A handoff completed: the entity lives elsewhere now.
    pub(super) fn on_evict(&mut self, v: Evict) {
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

    /// Takes over an entity and its attachments, all or nothing: a state this game cannot read
    /// creates nothing and is not answered, so the entity stays frozen where it was.
    pub(super) fn adopt(&mut self, out: &mut impl Outbox, root: Adopt) {
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

    pub(super) fn check_adoption(&self, a: Adopt, todo: &mut Vec<Adoption>) -> Result<(), String> {
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

    pub(super) fn take(&mut self, a: Adoption) {
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
                offload: false,
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
}

/// One entity of an `Adopt`, checked and decoded before anything is created.
pub(super) struct Adoption {
    id: u64,
    epoch: u64,
    pos: (f64, f64),
    z: f64,
    owner_account: String,
    state: SampleSnapshot,
}
