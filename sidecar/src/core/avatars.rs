//! One avatar per account: a login anywhere in the geo finds the avatar wherever it lives.
//!
//! The node writing a player's master records where it is in the directory's master record
//! (`account → node, lease epoch, entity, entity epoch`) as soon as an avatar is spawned,
//! adopted or despawned here.
//! A gateway registering a session reads the record with the registration and sends the
//! player's join to that node instead of spawning. When the record names a process that died,
//! the avatar is being restored: the gateway waits for the restored owner's anchor (the restored
//! owner joins the newest session it knows of) for at most [`avatar_wait_ms`], then spawns.
//! A node writing an avatar joins any newer session of its account a gateway announces
//! (`SessionMoved`), and lets its avatar go at once when that gateway spawns a new one: of two
//! avatars the older always goes. The leave of a displaced or cut-off session waits
//! [`LEAVE_GRACE_MS`] for the newer join, counted while its gateway can be heard. An owner
//! whose player's gateway link is down asks the directory where the session is: gone for good
//! releases the avatar, a newer session on another gateway is joined. A returning game told to
//! spawn an avatar again (it had no checkpoint) gets no input of its player until it has.
//!
//! This part keeps the records as last written, the deferred leaves, the orphans' look-ups and
//! the sessions waiting for an avatar; the joins, leaves and spawns those come to, which touch
//! the routes, the sessions and the game, the core carries out.

use std::collections::hash_map::Entry;
use std::collections::BTreeSet;

use rustc_hash::FxHashMap as HashMap;

use cellmesh_stores::MasterEntry;
use cellmesh_world::partition::NodeId;

use super::context::Context;
use super::StoreRequest;
use crate::model::entities::EntityTable;

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
    awaiting: HashMap<String, (u64, Option<(NodeId, u64)>)>,
    /// Owner side: when each player whose gateway link is down was last looked up.
    orphan_checked: HashMap<String, u64>,
    /// Owner side: leaves of displaced or cut-off sessions: the newer session's join usually
    /// follows at once from its gateway, and keeps the avatar.
    displaced: HashMap<String, DeferredLeave>,
    /// Players a returning game was told to spawn an avatar for again (theirs had no
    /// checkpoint): their inputs have nothing to apply to until it spawns one.
    respawning: BTreeSet<String>,
}

/// The leave of a session, kept for a newer session's join.
struct DeferredLeave {
    epoch: u64,
    /// When it goes to the game (monotonic ms).
    due: u64,
    reason: String,
    /// The peer gateway whose session it ends (`None`: this node's own).
    gateway: Option<NodeId>,
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

/// Whether a leave for `reason` waits for a newer session (see [`LEAVE_GRACE_MS`]).
pub(crate) fn leave_waits(reason: &str) -> bool {
    reason == "displaced" || reason.starts_with(PROXY_LINK_LOST) || reason.starts_with(TRANSFERRED)
}

/// How long a session waits for a restored avatar before one is spawned: the owner's lease
/// must lapse and the restore run.
pub(crate) fn avatar_wait_ms(cx: &Context) -> u64 {
    2 * cx.config.node_lease_ms + 5_000
}

impl Avatars {
    // ------------------------------------------------------------------ owner side

    /// Writes the master records of avatars this node now writes (as process `incarnation`),
    /// and clears those of avatars it despawned; nothing while it may not write (`writable`).
    /// One handed away is left to its new owner (a clear racing the new owner's write would
    /// leave a moment with no record, when a login would spawn a second avatar).
    pub(crate) fn sync_master_records(
        &mut self,
        cx: &mut Context,
        table: &EntityTable,
        incarnation: u64,
        writable: bool,
    ) {
        let version = table.masters_version();
        if self.synced_version == Some(version) || !writable {
            return;
        }
        self.synced_version = Some(version);
        let (me, lease_epoch) = (cx.config.node_id, incarnation);
        let current: HashMap<String, MasterEntry> = table
            .masters()
            .filter_map(|(account, id)| {
                let e = table.get_local(id)?;
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
            .filter(|(a, m)| self.written.get(*a) != Some(m))
            .map(|(a, m)| (a.clone(), *m))
            .collect();
        let clear: Vec<(String, u64, u64)> = self
            .written
            .iter()
            .filter(|(a, m)| !current.contains_key(*a) && table.get(m.entity_id).is_none())
            .map(|(a, m)| (a.clone(), m.entity_id, m.entity_epoch))
            .collect();
        self.written = current;
        if !set.is_empty() || !clear.is_empty() {
            cx.store(StoreRequest::WriteMasters { set, clear });
        }
    }

    /// The store refused a write: these records are written again at the next sync.
    pub(crate) fn on_masters_not_written(&mut self, accounts: Vec<String>) {
        for a in accounts {
            self.written.remove(&a);
        }
        self.synced_version = None;
    }

    /// The leave of a session a newer login displaced, or whose proxy link broke: kept for
    /// [`LEAVE_GRACE_MS`], so the avatar serves the newer session instead of leaving and
    /// spawning again (the new gateway found it through the master record; its join and this
    /// leave race on different links).
    pub(crate) fn defer_leave(
        &mut self,
        cx: &Context,
        account: &str,
        epoch: u64,
        reason: &str,
        gateway: Option<NodeId>,
    ) {
        let now = cx.now.mono_ms;
        let grace = if reason.starts_with(TRANSFERRED) {
            TRANSFER_GRACE_MS
        } else {
            LEAVE_GRACE_MS
        };
        let leave = DeferredLeave {
            epoch,
            due: now + grace,
            reason: reason.to_string(),
            gateway,
        };
        // The newest session's leave decides how long the avatar waits: a handover's (long
        // grace) does not inherit the deadline of an older session's leave still pending.
        match self.displaced.entry(account.to_string()) {
            Entry::Occupied(mut pending) if pending.get().epoch < epoch => {
                *pending.get_mut() = leave
            }
            Entry::Occupied(_) => {}
            Entry::Vacant(slot) => {
                slot.insert(leave);
            }
        }
    }

    /// A returning game was told to join `accounts`, which have no avatar here: it spawns them
    /// once it has ids.
    pub(crate) fn await_respawns(&mut self, accounts: impl IntoIterator<Item = String>) {
        self.respawning = accounts.into_iter().collect();
    }

    /// Whether an input of `account` has no avatar to go to yet: the game is to spawn it again
    /// and has not (`spawned`: whether the table has one now, which ends the wait; asked only
    /// of an account that waits, so the input path pays one set look-up).
    pub(crate) fn awaits_respawn(&mut self, account: &str, spawned: impl FnOnce() -> bool) -> bool {
        if !self.respawning.contains(account) {
            return false;
        }
        if spawned() {
            self.respawning.remove(account);
            return false;
        }
        true
    }

    /// The peer gateways of the sessions whose leaves are deferred.
    pub(crate) fn leave_gateways(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.displaced.values().filter_map(|l| l.gateway)
    }

    /// The deferred leaves of sessions whose gateway `cut_off` says cannot be heard wait on:
    /// the newer session's join would come from there (its link's return brings the gateway's
    /// sessions), so the grace runs out only [`LEAVE_GRACE_MS`] after the gateway is heard again.
    pub(crate) fn hold_leaves(&mut self, cx: &Context, cut_off: impl Fn(NodeId) -> bool) {
        let until = cx.now.mono_ms + LEAVE_GRACE_MS;
        for leave in self.displaced.values_mut() {
            if leave.gateway.is_some_and(&cut_off) {
                leave.due = leave.due.max(until);
            }
        }
    }

    /// The accounts whose deferred leave is due.
    pub(crate) fn leaves_due(&self, cx: &Context) -> Vec<String> {
        let now = cx.now.mono_ms;
        self.displaced
            .iter()
            .filter(|(_, l)| now >= l.due)
            .map(|(a, _)| a.clone())
            .collect()
    }

    /// Takes `account`'s deferred leave, if one is still kept: (session epoch, reason).
    pub(crate) fn take_leave(&mut self, account: &str) -> Option<(u64, String)> {
        self.displaced.remove(account).map(|l| (l.epoch, l.reason))
    }

    /// Of `orphans` (players whose avatar this node writes and whose gateway link is down, in
    /// order), those due a look-up of where their session is; `is_player` says who still is a
    /// player served for another gateway.
    pub(crate) fn orphans_due(
        &mut self,
        cx: &Context,
        orphans: Vec<String>,
        is_player: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let now = cx.now.mono_ms;
        let due: Vec<String> = orphans
            .into_iter()
            .filter(|account| {
                self.orphan_checked
                    .get(account)
                    .is_none_or(|t| now >= t + ORPHAN_CHECK_EVERY_MS)
            })
            .collect();
        self.orphan_checked.retain(|a, _| is_player(a));
        for account in &due {
            self.orphan_checked.insert(account.clone(), now);
        }
        due
    }

    /// A player served for another gateway is no more: its look-ups stop.
    pub(crate) fn forget_orphan(&mut self, account: &str) {
        self.orphan_checked.remove(account);
    }

    // ------------------------------------------------------------------ gateway side

    /// A session whose avatar is being restored (written by the dead process `dead`, whose
    /// world is `restored` already or not) waits for the restored owner's anchor.
    pub(crate) fn await_avatar(
        &mut self,
        cx: &Context,
        account: &str,
        dead: Option<(NodeId, u64)>,
        restored: bool,
    ) {
        // A world restored already (its RestoreDone came before this login) brings nothing
        // more: the avatar is back by now, or never will be.
        let wait = if restored {
            RESTORED_GRACE_MS
        } else {
            avatar_wait_ms(cx)
        };
        let until = cx.now.mono_ms + wait;
        self.awaiting.insert(account.to_string(), (until, dead));
    }

    /// A session handed over from another geo waits [`HANDED_OVER_WAIT_MS`] for its avatar's
    /// owner to anchor it (the owner joins the newer session it is told of), then spawns one.
    pub(crate) fn await_handed_over_avatar(&mut self, cx: &Context, account: &str) {
        let until = cx.now.mono_ms + HANDED_OVER_WAIT_MS;
        self.awaiting.insert(account.to_string(), (until, None));
    }

    /// Whether a session of `account` waits for its avatar's anchor.
    pub(crate) fn is_waiting(&self, account: &str) -> bool {
        self.awaiting.contains_key(account)
    }

    /// The session of `account` waits for its avatar no more.
    pub(crate) fn stop_waiting(&mut self, account: &str) {
        self.awaiting.remove(account);
    }

    /// Every restore under way is over: a session still waiting for an avatar written by a
    /// process whose world `is_restored` waits only a little longer (the restore had no
    /// checkpoint of it).
    pub(crate) fn restored(&mut self, cx: &Context, is_restored: impl Fn((NodeId, u64)) -> bool) {
        let soon = cx.now.mono_ms + RESTORED_GRACE_MS;
        for (until, dead) in self.awaiting.values_mut() {
            if dead.is_some_and(&is_restored) {
                *until = (*until).min(soon);
            }
        }
    }

    /// The waiting sessions whose avatar's writer `is_live` says is alive, with that writer:
    /// the link to it was down when they registered, and no restore of it will come.
    pub(crate) fn waiting_on_live(
        &self,
        is_live: impl Fn((NodeId, u64)) -> bool,
    ) -> Vec<(String, NodeId)> {
        let mut found: Vec<(String, NodeId)> = self
            .awaiting
            .iter()
            .filter_map(|(account, (_, writer))| {
                writer
                    .filter(|w| is_live(*w))
                    .map(|(node, _)| (account.clone(), node))
            })
            .collect();
        // Sorted: the joins go out in one order for one sequence of inputs.
        found.sort();
        found
    }

    /// The accounts whose wait for a restored avatar is over.
    pub(crate) fn waits_due(&self, cx: &Context) -> Vec<String> {
        let now = cx.now.mono_ms;
        self.awaiting
            .iter()
            .filter(|(_, (until, _))| now >= *until)
            .map(|(a, _)| a.clone())
            .collect()
    }
}
