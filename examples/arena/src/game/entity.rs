//! What the arena holds of one entity: its motion, its health, its handoff state and its role
//! (an NPC or a player's avatar), and the snapshot that carries it to another node.

use crate::combat::DamageTable;
use crate::schema::SampleSnapshot;
use crate::schema::SnapshotKind;
use crate::schema::SNAPSHOT_VERSION;
use cellmesh_proto::local::Vec3;

pub(super) struct Player {
    pub(super) account: String,
    pub(super) session_epoch: u64,
    pub(super) last_seq: u64,
    pub(super) applied: u64,
    pub(super) inventory: String,
    pub(super) ack_dirty: bool,
    /// A `PlayerLeave` (its session epoch) that came while the avatar was frozen: done on `Thaw`,
    /// moot on `Evict`.
    pub(super) leave_pending: Option<u64>,
    /// Experience from kills (see `combat`).
    pub(super) xp: u64,
}

pub(super) enum Role {
    Npc {
        name: String,
        turn_in: u32,
        damage: DamageTable,
    },
    Player(Player),
}

pub(super) struct Entity {
    pub(super) pos: (f64, f64),
    /// Carried along untouched.
    pub(super) z: f64,
    pub(super) dir: (f64, f64),
    pub(super) health: (u32, u32),
    /// Handed to the sidecar for a handoff: neither moved nor written until `Thaw` or `Evict`.
    pub(super) frozen: bool,
    /// Released by this arena (not frozen by the sidecar's `Freeze`).
    pub(super) released: bool,
    /// Not released again before this tick: a release the sidecar kept (no target ready) is
    /// left to its own `Freeze`, rather than repeated every tick.
    pub(super) release_after: u64,
    /// The sidecar asked for its release (`Offload`): released at the end of the next tick,
    /// wherever it stands.
    pub(super) offload: bool,
    /// The entity epoch it is written under (a checkpoint names it).
    pub(super) epoch: u64,
    pub(super) role: Role,
}

impl Entity {
    /// Frozen, and its `Release` with this tick's state; for an avatar, naming the last input
    /// applied to it (`(seq, session epoch)`).
    pub(super) fn release(
        &mut self,
        id: u64,
        last_input: (u64, u64),
    ) -> cellmesh_proto::local::Release {
        self.frozen = true;
        self.released = true;
        cellmesh_proto::local::Release {
            entity_id: id,
            entity_epoch: self.epoch,
            state: self.snapshot().encode(),
            attachments: vec![],
            last_input_seq: last_input.0,
            input_session_epoch: last_input.1,
        }
    }

    pub(super) fn snapshot(&self) -> SampleSnapshot {
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

    pub(super) fn position(&self) -> Vec3 {
        Vec3 {
            x: self.pos.0,
            y: self.pos.1,
            z: self.z,
        }
    }
}
