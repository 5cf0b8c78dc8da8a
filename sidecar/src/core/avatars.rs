//! One avatar per account: a login anywhere in the geo finds the avatar wherever it lives.
//!
//! The node writing a player's master records where it is in the directory's master record
//! (`account → node, lease epoch, entity, entity epoch`) as soon as an avatar is spawned,
//! adopted or despawned here.
//! A gateway registering a session reads the record with the registration and sends the
//! player's join to that node instead of spawning. When the record names a process that died,
//! the avatar is being restored: the gateway waits for the restored owner's anchor (the restored
//! owner joins the newest session it knows of) for at most [`Core::avatar_wait_ms`], then spawns.
//! A node writing an avatar joins any newer session of its account a gateway announces
//! (`SessionMoved`), and lets its avatar go at once when that gateway spawns a new one: of two
//! avatars the older always goes. The leave of a displaced or cut-off session waits
//! [`LEAVE_GRACE_MS`] for the newer join. An owner whose player's gateway link is down asks the
//! directory where the session is: gone for good releases the avatar, a newer session on
//! another gateway is joined.

use std::collections::hash_map::Entry;

use rustc_hash::FxHashMap as HashMap;

use cellmesh_proto::local::{self, sidecar_message};
use cellmesh_proto::mesh::{self, mesh_message};
use cellmesh_stores::{MasterEntry, SessionEntry};
use cellmesh_world::geometry::Pos;
use cellmesh_world::partition::NodeId;

use super::*;

/// How often the session of a player whose gateway link is down is looked up.
pub(crate) const ORPHAN_CHECK_EVERY_MS: u64 = 1_000;
/// The start of the reason a gateway gives for the sessions of a proxy link that broke.
pub(crate) const PROXY_LINK_LOST: &str = "link to the proxy lost";
/// How long a session still waits for its avatar's anchor once the restore of the process that
/// wrote it is over (the restored owner's anchor and the decider's word travel different links,
/// and a restored owner that has just started may not be linked to the gateway yet).
pub(crate) const RESTORED_GRACE_MS: u64 = 2_000;
/// How long the avatar of a session that was displaced, or whose proxy link broke, waits for
/// a newer session's join before it leaves (the proxy moves a session whose gateway link broke
/// to another gateway).
pub(crate) const LEAVE_GRACE_MS: u64 = 3_000;
/// The start of the reason a gateway gives for a session its proxy handed over to another geo.
pub(crate) const TRANSFERRED: &str = "transferred";
/// How long the avatar of a session handed over to another geo waits for the login there: as
/// long as the handover's hint and cookie are honoured.
pub(crate) const TRANSFER_GRACE_MS: u64 = cellmesh_proto::cookie::MAX_AGE_MS;
/// How long a session handed over from another geo waits for its avatar's owner to anchor it:
/// a round trip across the world and back, with room to spare.
pub(crate) const HANDED_OVER_WAIT_MS: u64 = 3_000;

#[derive(Default)]
pub(crate) struct Avatars {
    /// The master records as this node last wrote them.
    written: HashMap<String, MasterEntry>,
    /// The entity table's masters version they were written at (`None`: write again).
    synced_version: Option<u64>,
    /// Gateway side: sessions waiting for a restored avatar's anchor: until (monotonic ms),
    /// and the dead process that wrote it.
    pub awaiting: HashMap<String, (u64, Option<(NodeId, u64)>)>,
    /// Owner side: when each player whose gateway link is down was last looked up.
    orphan_checked: HashMap<String, u64>,
    /// Owner side: leaves of displaced or cut-off sessions, (session epoch, due, reason): the
    /// newer session's join usually follows at once from its gateway, and keeps the avatar.
    displaced: HashMap<String, (u64, u64, String)>,
}

/// Where a login finds the account's avatar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AvatarAt {
    /// Nowhere: it is spawned.
    Nowhere,
    /// This node writes it.
    Here,
    /// A live peer writes it.
    Peer(NodeId),
    /// Its owner's process died: its restore will anchor the session.
    Restoring,
}

impl Core {
    pub(crate) fn avatars_step(&mut self) {
        self.apply_deferred_leaves();
        self.expire_avatar_waits();
        self.check_orphans();
    }

    /// How long a session waits for a restored avatar before one is spawned: the owner's lease
    /// must lapse and the restore run.
    pub(crate) fn avatar_wait_ms(&self) -> u64 {
        2 * self.cx.config.node_lease_ms + 5_000
    }

    // ------------------------------------------------------------------ owner side

    /// Writes the master records of avatars this node now writes, and clears those of avatars
    /// it despawned. One handed away is left to its new owner (a clear racing the new owner's
    /// write would leave a moment with no record, when a login would spawn a second avatar).
    pub(crate) fn sync_master_records(&mut self) {
        let version = self.table.masters_version();
        if self.avatars.synced_version == Some(version)
            || self.restore.incarnation == 0
            || !self.authority.lease_live
            || !self.mesh.clustered()
        {
            return;
        }
        self.avatars.synced_version = Some(version);
        let (me, lease_epoch) = (self.cx.config.node_id, self.restore.incarnation);
        let current: HashMap<String, MasterEntry> = self
            .table
            .masters()
            .filter_map(|(account, id)| {
                let e = self.table.get_local(id)?;
                let entry = MasterEntry {
                    node: me,
                    lease_epoch,
                    entity_id: id,
                    entity_epoch: e.epoch,
                };
                Some((account.to_string(), entry))
            })
            .collect();
        let set: Vec<(String, MasterEntry)> = current
            .iter()
            .filter(|(a, m)| self.avatars.written.get(*a) != Some(m))
            .map(|(a, m)| (a.clone(), *m))
            .collect();
        let clear: Vec<(String, u64, u64)> = self
            .avatars
            .written
            .iter()
            .filter(|(a, m)| !current.contains_key(*a) && self.table.get(m.entity_id).is_none())
            .map(|(a, m)| (a.clone(), m.entity_id, m.entity_epoch))
            .collect();
        self.avatars.written = current;
        if !set.is_empty() || !clear.is_empty() {
            self.cx.store(StoreRequest::WriteMasters { set, clear });
        }
    }

    /// Whether a leave for `reason` waits for a newer session (see [`LEAVE_GRACE_MS`]).
    pub(crate) fn leave_waits(reason: &str) -> bool {
        reason == "displaced"
            || reason.starts_with(PROXY_LINK_LOST)
            || reason.starts_with(TRANSFERRED)
    }

    /// The leave of a session a newer login displaced, or whose proxy link broke: kept for
    /// [`LEAVE_GRACE_MS`], so the avatar serves the newer session instead of leaving and
    /// spawning again (the new gateway found it through the master record; its join and this
    /// leave race on different links).
    pub(crate) fn defer_leave(&mut self, account: &str, epoch: u64, reason: &str) {
        let now = self.cx.now.mono_ms;
        let grace = if reason.starts_with(TRANSFERRED) {
            TRANSFER_GRACE_MS
        } else {
            LEAVE_GRACE_MS
        };
        let leave = (epoch, now + grace, reason.to_string());
        // The newest session's leave decides how long the avatar waits: a handover's (long
        // grace) does not inherit the deadline of an older session's leave still pending.
        match self.avatars.displaced.entry(account.to_string()) {
            Entry::Occupied(mut pending) if pending.get().0 < epoch => *pending.get_mut() = leave,
            Entry::Occupied(_) => {}
            Entry::Vacant(slot) => {
                slot.insert(leave);
            }
        }
    }

    /// Another gateway announced a session of `account` (`m`): if this node writes the
    /// account's avatar and serves an older session with it, the avatar serves the new one (its
    /// gateway may be waiting for it, or have sent its join elsewhere), or, when that gateway
    /// spawns a new avatar, this one leaves at once: never two.
    pub(crate) fn avatar_meets_session(&mut self, m: &mesh::SessionMoved) {
        if m.gateway_node == self.cx.config.node_id || !self.writes_master(&m.account) {
            return;
        }
        let served = self
            .routing
            .remote_players
            .get(&m.account)
            .map(|r| r.session_epoch)
            .or_else(|| self.session_epoch(&m.account).map(|(_, e)| e))
            .unwrap_or(0);
        if m.session_epoch <= served {
            return;
        }
        if !m.new_avatar {
            let entry = SessionEntry {
                gateway_node: m.gateway_node,
                session_epoch: m.session_epoch,
            };
            return self.join_session(&m.account, entry);
        }
        tracing::debug!(account = %m.account, "a newer session spawns a new avatar: this one leaves");
        self.avatars.displaced.remove(&m.account);
        self.routing.remote_players.remove(&m.account);
        self.routing.anchor_sent.remove(&m.account);
        // Every session before the new one is over.
        self.leave_game(&m.account, m.session_epoch - 1, "new_avatar_elsewhere");
    }

    /// The game hears session `epoch` of `account` leave (after the handoff of a frozen avatar,
    /// if one is in flight).
    pub(crate) fn leave_game(&mut self, account: &str, epoch: u64, reason: &str) {
        self.leave_follows_handoff(account, epoch, reason);
        if self.game.slot.is_some() {
            self.cx.out.to_game.push(
                sidecar_message::Body::PlayerLeave(local::PlayerLeave {
                    account: account.to_string(),
                    session_epoch: epoch,
                    reason: reason.to_string(),
                })
                .into(),
            );
        }
    }

    fn apply_deferred_leaves(&mut self) {
        let now = self.cx.now.mono_ms;
        let due: Vec<String> = self
            .avatars
            .displaced
            .iter()
            .filter(|(_, (_, due, _))| now >= *due)
            .map(|(a, _)| a.clone())
            .collect();
        for account in due {
            let Some((epoch, _, reason)) = self.avatars.displaced.remove(&account) else {
                continue;
            };
            if self.serves_newer_session(&account, epoch) {
                continue;
            }
            if !self.writes_master(&account) {
                // Handed on meanwhile: the leave follows it (no second wait there).
                let owner = self.departed_owner(&account);
                if let Some(owner) = owner.filter(|o| *o != self.cx.config.node_id) {
                    self.send_leave_on(
                        owner,
                        mesh::PeerPlayerLeave {
                            account: account.clone(),
                            session_epoch: epoch,
                            reason: "session_over".into(),
                        },
                    );
                    continue;
                }
            }
            if self
                .routing
                .remote_players
                .get(&account)
                .is_some_and(|r| r.session_epoch <= epoch)
            {
                self.routing.remote_players.remove(&account);
                self.routing.anchor_sent.remove(&account);
            }
            self.leave_game(&account, epoch, &reason);
        }
    }

    /// The store refused a write: these records are written again at the next sync.
    pub(crate) fn on_masters_not_written(&mut self, accounts: Vec<String>) {
        for a in accounts {
            self.avatars.written.remove(&a);
        }
        self.avatars.synced_version = None;
    }

    /// Players whose avatar this node writes and whose gateway link is down: their session may
    /// have moved (a gateway that died) or ended for good.
    fn check_orphans(&mut self) {
        let now = self.cx.now.mono_ms;
        let due: Vec<String> = self
            .routing
            .remote_players
            .iter()
            .filter(|(account, r)| {
                !self.peer_link_up(r.gateway_node)
                    && self.writes_master(account)
                    && self
                        .avatars
                        .orphan_checked
                        .get(*account)
                        .is_none_or(|t| now >= t + ORPHAN_CHECK_EVERY_MS)
            })
            .map(|(a, _)| a.clone())
            .collect();
        self.avatars
            .orphan_checked
            .retain(|a, _| self.routing.remote_players.contains_key(a));
        for account in due {
            self.avatars.orphan_checked.insert(account.clone(), now);
            if self.routing.looking_up.insert(account.clone()) {
                self.cx.store(StoreRequest::Lookup { account });
            }
        }
    }

    /// The node this node handed `account`'s avatar to, while it remembers.
    pub(crate) fn departed_owner(&self, account: &str) -> Option<NodeId> {
        let id = self.handoff.departed_masters.get(account)?;
        Some(self.handoff.outgoing.departed_to(*id)?.0)
    }

    /// Whether this node writes `account`'s avatar.
    pub(crate) fn writes_master(&self, account: &str) -> bool {
        self.table
            .master_of(account)
            .is_some_and(|e| e.origin.is_none())
    }

    fn peer_link_up(&self, node: NodeId) -> bool {
        node == self.cx.config.node_id || self.mesh.is_up(node)
    }

    /// The directory's word on the session of a player whose gateway link is down.
    pub(crate) fn on_orphan_looked_up(&mut self, account: &str, entry: Option<SessionEntry>) {
        let Some(r) = self.routing.remote_players.get(account).copied() else {
            return;
        };
        if self.peer_link_up(r.gateway_node) || !self.writes_master(account) {
            return;
        }
        match entry {
            None if self.gateway_elsewhere_lives(r.gateway_node) => {
                // That gateway registers its sessions in its own geo's directory, not in the
                // one this node reads: a miss here says nothing. While its lease holds (or has
                // only lapsed: a cut between the geos), the session may well go on; its link's
                // return brings the gateway's sessions (`SessionMoved`), and its death moves them
                // to another gateway of its geo, which announces them.
            }
            None => {
                // The session is gone for good: so is its avatar.
                tracing::debug!(%account, gateway = r.gateway_node, "the player's session ended with its gateway: avatar released");
                self.release_remote_player(account, "gateway_gone");
            }
            Some(e)
                if e.session_epoch > r.session_epoch
                    && e.gateway_node != self.cx.config.node_id =>
            {
                self.join_session(account, e);
            }
            _ => {}
        }
    }

    /// Whether `gateway` is a node of another geo (whose sessions this node's directory does not
    /// hold) that has not died: its lease is live or lapsed, as this node last heard.
    fn gateway_elsewhere_lives(&self, gateway: NodeId) -> bool {
        let elsewhere = self
            .restore
            .geo_of
            .get(&gateway)
            .is_some_and(|g| *g != self.cx.config.geo);
        elsewhere
            && (self.restore.live.contains_key(&gateway)
                || self.restore.lapsed.contains_key(&gateway))
    }

    /// The session of a player whose avatar this node simulates for another gateway ended.
    pub(crate) fn release_remote_player(&mut self, account: &str, reason: &str) {
        let Some(r) = self.routing.remote_players.remove(account) else {
            return;
        };
        self.routing.anchor_sent.remove(account);
        self.avatars.orphan_checked.remove(account);
        if !self.writes_master(account) {
            return;
        }
        self.leave_game(account, r.session_epoch, reason);
    }

    /// The avatar this node writes serves the newer session `entry` of another gateway.
    pub(crate) fn join_session(&mut self, account: &str, entry: SessionEntry) {
        self.routing.routes.insert(account.to_string(), entry);
        self.routing
            .remote_players
            .insert(account.to_string(), entry);
        self.routing.anchor_sent.remove(account);
        if self.game.slot.is_some() {
            self.cx.out.to_game.push(
                sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                    account: account.to_string(),
                    session_epoch: entry.session_epoch,
                    last_position: None,
                })
                .into(),
            );
        }
        self.send_anchor(entry.gateway_node, account, entry.session_epoch);
    }

    // ------------------------------------------------------------------ gateway side

    /// Where a login of `account` finds its avatar, from the directory's record.
    pub(crate) fn avatar_at(&self, account: &str, master: Option<MasterEntry>) -> AvatarAt {
        let Some(m) = master else {
            return AvatarAt::Nowhere;
        };
        let me = self.cx.config.node_id;
        if m.node == me && m.lease_epoch == self.restore.incarnation {
            if self.writes_master(account) {
                return AvatarAt::Here;
            }
            return match self.departed_owner(account) {
                Some(owner) if owner != me => AvatarAt::Peer(owner),
                // Despawned since (the record is cleared soon).
                _ => AvatarAt::Nowhere,
            };
        }
        if self.restore.fenced.contains(&(m.node, m.lease_epoch)) {
            return AvatarAt::Restoring;
        }
        match self.restore.live.get(&m.node) {
            Some(l) if *l == m.lease_epoch => AvatarAt::Peer(m.node),
            // A newer process holds the id, or the lease lapsed: the writer is dead.
            Some(_) => AvatarAt::Restoring,
            None if self.restore.live.is_empty() => AvatarAt::Peer(m.node),
            None => AvatarAt::Restoring,
        }
    }

    /// A session whose avatar is being restored waits for the restored owner's anchor.
    pub(crate) fn await_avatar(&mut self, account: &str, master: Option<MasterEntry>) {
        let dead = master.map(|m| (m.node, m.lease_epoch));
        // A world restored already (its RestoreDone came before this login) brings nothing
        // more: the avatar is back by now, or never will be.
        let restored = dead.is_some_and(|inc| {
            self.restore.fenced.contains(&inc) && !self.restore.dead.contains_key(&inc)
        });
        let wait = if restored {
            RESTORED_GRACE_MS
        } else {
            self.avatar_wait_ms()
        };
        let until = self.cx.now.mono_ms + wait;
        self.avatars
            .awaiting
            .insert(account.to_string(), (until, dead));
        self.gateway.master_owner.remove(account);
    }

    /// A session handed over from another geo waits [`HANDED_OVER_WAIT_MS`] for its avatar's
    /// owner to anchor it (the owner joins the newer session it is told of), then spawns one.
    pub(crate) fn await_handed_over_avatar(&mut self, account: &str) {
        let until = self.cx.now.mono_ms + HANDED_OVER_WAIT_MS;
        self.avatars
            .awaiting
            .insert(account.to_string(), (until, None));
        self.gateway.master_owner.remove(account);
    }

    /// The world of `inc` is restored: a session still waiting for an avatar it wrote waits
    /// only a little longer (the restore had no checkpoint of it).
    pub(crate) fn avatars_restored(&mut self, inc: (NodeId, u64)) {
        let soon = self.cx.now.mono_ms + RESTORED_GRACE_MS;
        for (until, dead) in self.avatars.awaiting.values_mut() {
            if *dead == Some(inc) {
                *until = (*until).min(soon);
            }
        }
    }

    /// Sessions that waited too long for a restored avatar get a new one (the restore found no
    /// checkpoint of it).
    fn expire_avatar_waits(&mut self) {
        let now = self.cx.now.mono_ms;
        let due: Vec<String> = self
            .avatars
            .awaiting
            .iter()
            .filter(|(_, (until, _))| now >= *until)
            .map(|(a, _)| a.clone())
            .collect();
        for account in due {
            self.avatars.awaiting.remove(&account);
            let Some((key, epoch)) = self.session_epoch(&account) else {
                continue;
            };
            if self.gateway.master_owner.contains_key(&account) {
                continue;
            }
            tracing::warn!(%account, "no restored avatar anchored the session in time: spawning one");
            self.cx.metrics.error("avatar_not_restored");
            let last = self.gateway.sessions.get(key).and_then(|s| s.last_position);
            self.announce_session(&account, epoch, true);
            self.spawn_avatar(&account, epoch, last);
        }
    }

    /// The avatar is spawned by the game of the node owning where it stands (the player's last
    /// position); a player with none starts in this node's world.
    pub(crate) fn spawn_avatar(&mut self, account: &str, epoch: u64, last: Option<[f64; 3]>) {
        // Remembered: an older avatar that anchors this session later is told to go.
        if let Some(s) = self
            .gateway
            .clients
            .key_of(account)
            .and_then(|k| self.gateway.sessions.get_mut(k))
            .filter(|s| s.epoch == Some(epoch))
        {
            s.new_avatar = true;
        }
        let me = self.cx.config.node_id;
        let owner = last
            .and_then(|[x, y, _]| self.authority.partition.owner_of(Pos { x, y }).ok())
            .unwrap_or(me);
        if owner != me && self.send_join(owner, account, epoch, last) {
            self.gateway.master_owner.insert(account.to_string(), owner);
            return;
        }
        self.join_here(account, epoch, last);
    }

    /// The game here simulates (or spawns) the avatar of the local session `epoch`.
    pub(crate) fn join_here(&mut self, account: &str, epoch: u64, last: Option<[f64; 3]>) {
        let me = self.cx.config.node_id;
        self.gateway.master_owner.insert(account.to_string(), me);
        self.avatars.awaiting.remove(account);
        // An avatar simulated here for another gateway serves this session now.
        self.routing.remote_players.remove(account);
        self.routing.anchor_sent.remove(account);
        if let Some(e) = self.table.master_of(account).filter(|e| e.origin.is_none()) {
            let epoch = e.epoch;
            self.gateway.master_epoch.insert(account.to_string(), epoch);
            self.gateway.clients.set_remote_anchor(account, None);
            self.gateway.anchor_pos.remove(account);
        }
        if self.game.slot.is_some() {
            self.cx.out.to_game.push(
                sidecar_message::Body::PlayerJoin(local::PlayerJoin {
                    account: account.to_string(),
                    session_epoch: epoch,
                    last_position: last.map(|[x, y, z]| local::Vec3 { x, y, z }),
                })
                .into(),
            );
        }
    }

    /// Asks `owner`'s game to simulate the avatar of this gateway's session `epoch`.
    pub(crate) fn send_join(
        &mut self,
        owner: NodeId,
        account: &str,
        epoch: u64,
        last: Option<[f64; 3]>,
    ) -> bool {
        self.send_peer(
            owner,
            mesh_message::Body::PlayerJoin(mesh::PeerPlayerJoin {
                account: account.to_string(),
                session_epoch: epoch,
                last_position: last.map(|[x, y, z]| mesh::MeshVec3 { x, y, z }),
                gateway_node: 0,
            }),
        )
    }
}
