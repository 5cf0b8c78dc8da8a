//! The invariants, checked after every step and once the world is quiet:
//!
//! - never two unfrozen writers of one entity, and never two nodes owning one entity at one
//!   epoch; a ghost's frames come from the owner of its epoch;
//! - an entity frozen for a handoff is thawed only after a refusal, if its offer never left, or
//!   once its target died (the restore of the dead node's world gives it back);
//! - every input reaches a game at most once, but for those a game dropped because it had
//!   released the player's avatar after applying an earlier one (they are handed on), and at the
//!   end every input sent was delivered, counted under a named drop reason, or lost with a
//!   broken link;
//! - at quiescence every entity a game holds is the unfrozen real of exactly one node, nothing
//!   is lost or held twice, and no handoff is in flight.
//!
//! (Clients check their own views: see `client`.)

use std::collections::{BTreeMap, BTreeSet};

use cellmesh_arena::CensusReport;
use cellmesh_proto::local::{game_message, sidecar_message, GameMessage, SidecarFrame};
use cellmesh_proto::mesh::{mesh_message, MeshFrame};
use cellmesh_sidecar::core::Core;
use cellmesh_sidecar::Real;
use cellmesh_world::partition::NodeId;

use crate::world::Stats;

/// A freeze as the checker follows it: did its offer leave, did a refusal come back?
#[derive(Default, Clone, Copy)]
struct Freeze {
    offered: bool,
    refused: bool,
    /// The node the offer went to, and whether its process died since (the restore of its
    /// world may give the unit back to its source).
    to: Option<NodeId>,
    target_died: bool,
}

#[derive(Default)]
pub(crate) struct Checker {
    pub violations: Vec<String>,
    /// (entity, epoch) -> the node that held it as a real under that epoch.
    owners: BTreeMap<(u64, u64), NodeId>,
    /// (node, entity) -> the freeze in progress there.
    freezes: BTreeMap<(NodeId, u64), Freeze>,
    /// (account, seq) sent.
    sent: BTreeSet<(String, u64)>,
    /// (account, seq) -> times delivered to a game.
    delivered: BTreeMap<(String, u64), u32>,
    /// (account, seq) -> the node whose game it was delivered to last.
    delivered_to: BTreeMap<(String, u64), NodeId>,
    /// (node, entity) -> the account whose avatar it is, as that node's game holds it.
    avatars: BTreeMap<(NodeId, u64), String>,
    /// Inputs delivered to a game that released their avatar before applying them: handed on.
    pub handed_on: u64,
    /// (account, seq) of inputs in frames lost with a broken link.
    lost: BTreeSet<(String, u64)>,
    /// Forwarded inputs in frames lost with a broken link, each copy counted: what a driver
    /// reports, as opposed to `lost`, which knows which inputs another copy delivered.
    lost_forwards: u64,
    /// (account, seq) of inputs written to a game that crashed before it read them.
    lost_with_game: BTreeSet<(String, u64)>,
    /// (account, seq) of inputs a killed node held that no live node had a copy of; a copy
    /// its dead handoff target delivered before dying was delivered all the same.
    lost_with_nodes: BTreeSet<(String, u64)>,
    /// node -> the entities it holds as unfrozen reals (as of its last step).
    unfrozen: BTreeMap<NodeId, BTreeSet<u64>>,
    /// entity -> the nodes holding it as an unfrozen real.
    writers: BTreeMap<u64, BTreeSet<NodeId>>,
    /// node -> the claims it believes held: (key, holder entity, until, on the true clock).
    claims: BTreeMap<NodeId, Vec<(String, u64, u64)>>,
    /// Keys whose two holders were already reported (one report per key).
    claims_reported: BTreeSet<String>,
}

impl Checker {
    pub fn violation(&mut self, now: u64, what: String) {
        self.violations.push(format!("at {now} ms: {what}"));
    }

    pub fn delivered(&self) -> u64 {
        self.delivered.len() as u64
    }

    /// Frames lost with a broken link: the inputs they carried.
    pub fn lost_in_network(&mut self, messages: &[cellmesh_proto::mesh::MeshMessage]) {
        for m in messages {
            if let Some(mesh_message::Body::ForwardInput(i)) = &m.body {
                self.lost_forwards += 1;
                self.lost.insert((i.account.clone(), i.seq));
            }
        }
    }

    /// A client's input that reached its gateway's proxy link after the gateway died.
    pub fn client_input_lost(&mut self, account: &str, seq: u64) {
        self.lost_forwards += 1;
        self.lost.insert((account.to_string(), seq));
    }

    /// A frame the sidecar wrote to a game that crashed before reading it: its inputs never
    /// reached a game after all.
    pub fn frame_lost_with_game(&mut self, frame: &SidecarFrame) {
        for m in &frame.messages {
            if let Some(sidecar_message::Body::Input(i)) = &m.body {
                let key = (i.account.clone(), i.seq);
                if let Some(n) = self.delivered.get_mut(&key) {
                    *n -= 1;
                    if *n == 0 {
                        self.delivered.remove(&key);
                    }
                }
                self.lost_with_game.insert(key);
            }
        }
    }

    /// `node`'s game went away: what was delivered to it is never handed on (its successor
    /// starts from checkpoints), and the avatars it held are its successor's to adopt.
    pub fn game_gone(&mut self, node: NodeId) {
        self.delivered_to.retain(|_, to| *to != node);
        self.avatars.retain(|(n, _), _| *n != node);
    }

    /// Inputs a killed node held with no copy anywhere else.
    pub fn inputs_lost_with_node(&mut self, inputs: Vec<(String, u64)>) {
        self.lost_with_nodes.extend(inputs);
    }

    /// Inputs lost with a crashed game or a killed node, and never delivered by another way.
    /// A copy a killed node held whose other copy was lost with a link is counted there.
    pub fn lost_with_game(&self) -> u64 {
        let with_nodes = self.lost_with_nodes.iter().filter(|k| {
            !self.delivered.contains_key(*k)
                && !self.lost_with_game.contains(*k)
                && !self.lost.contains(*k)
        });
        (self.lost_with_game.len() + with_nodes.count()) as u64
    }

    /// Forwarded inputs lost with a link, each copy counted.
    pub fn lost_forwards(&self) -> u64 {
        self.lost_forwards
    }

    /// Inputs lost with a link and never delivered by another way.
    pub fn lost(&self) -> u64 {
        self.lost
            .iter()
            .filter(|k| !self.delivered.contains_key(*k))
            .count() as u64
    }

    pub fn input_sent(&mut self, account: &str, _session_epoch: u64, seq: u64) {
        self.sent.insert((account.to_string(), seq));
    }

    /// After `node`'s core handled an input: no two writers, no epoch owned twice, ghosts fenced.
    /// Only the core that stepped can have changed, so only it is read; the writers of every
    /// entity are kept across steps.
    pub fn after_step(&mut self, now: u64, node: NodeId, core: &Core) {
        let mut found = Vec::new();
        let mut unfrozen = BTreeSet::new();
        for Real { id, epoch, frozen } in core.reals() {
            match self.owners.get(&(id, epoch)) {
                Some(o) if *o != node => found.push(format!(
                    "entity {id} is a real of n{node} at epoch {epoch}, which n{o} owned"
                )),
                Some(_) => {}
                None => {
                    self.owners.insert((id, epoch), node);
                }
            }
            if !frozen {
                unfrozen.insert(id);
            }
        }
        for e in core.entities().iter() {
            let Some(origin) = e.origin() else { continue };
            if let Some(o) = self.owners.get(&(e.id, e.epoch)) {
                if *o != origin {
                    found.push(format!(
                        "n{node} keeps a ghost of {} at epoch {} written by n{origin}, but n{o} owns that epoch",
                        e.id, e.epoch
                    ));
                }
            }
        }
        let before = self.unfrozen.remove(&node).unwrap_or_default();
        for id in before.difference(&unfrozen) {
            if let Some(w) = self.writers.get_mut(id) {
                w.remove(&node);
                if w.is_empty() {
                    self.writers.remove(id);
                }
            }
        }
        for id in unfrozen.difference(&before) {
            let w = self.writers.entry(*id).or_default();
            w.insert(node);
            if w.len() > 1 {
                found.push(format!("entity {id} has two writers: {w:?}"));
            }
        }
        self.unfrozen.insert(node, unfrozen);
        for f in found {
            self.violation(now, f);
        }
    }

    /// What `node` believes it holds after its step at `now`: no key may be believed held by
    /// two entities at once, across every live node.
    pub fn claims_after_step(&mut self, now: u64, node: NodeId, believed: Vec<(String, u64, u64)>) {
        let keys: BTreeSet<String> = believed.iter().map(|c| c.0.clone()).collect();
        self.claims.insert(node, believed);
        for key in keys {
            let holders: BTreeSet<(u64, NodeId)> = self
                .claims
                .iter()
                .flat_map(|(n, cs)| cs.iter().map(move |c| (n, c)))
                .filter(|(_, c)| c.0 == key && c.2 > now)
                .map(|(n, c)| (c.1, *n))
                .collect();
            let entities: BTreeSet<u64> = holders.iter().map(|h| h.0).collect();
            if entities.len() > 1 && self.claims_reported.insert(key.clone()) {
                self.violation(
                    now,
                    format!("claim {key:?} has two holders at once (entity, node): {holders:?}"),
                );
            }
        }
    }

    /// `node`'s process died: it writes nothing any more.
    pub fn node_gone(&mut self, node: NodeId) {
        self.claims.remove(&node);
        for f in self.freezes.values_mut() {
            if f.to == Some(node) {
                f.target_died = true;
            }
        }
        for id in self.unfrozen.remove(&node).unwrap_or_default() {
            if let Some(w) = self.writers.get_mut(&id) {
                w.remove(&node);
                if w.is_empty() {
                    self.writers.remove(&id);
                }
            }
        }
    }

    /// A frame a core sends its game: inputs are counted, freezes and thaws followed.
    pub fn frame_to_game(&mut self, now: u64, node: NodeId, frame: &SidecarFrame) {
        for m in &frame.messages {
            match &m.body {
                Some(sidecar_message::Body::Input(i)) => {
                    self.delivered_to.insert((i.account.clone(), i.seq), node);
                    let n = {
                        let n = self
                            .delivered
                            .entry((i.account.clone(), i.seq))
                            .or_default();
                        *n += 1;
                        *n
                    };
                    if n > 1 {
                        self.violation(
                            now,
                            format!(
                                "input {} #{} reached a game {} times (now n{node})",
                                i.account, i.seq, n
                            ),
                        );
                    }
                }
                Some(sidecar_message::Body::Freeze(f)) => {
                    self.freezes.insert((node, f.entity_id), Freeze::default());
                }
                Some(sidecar_message::Body::Thaw(t)) => {
                    match self.freezes.remove(&(node, t.entity_id)) {
                        Some(f) if f.refused || !f.offered || f.target_died => {}
                        Some(_) => self.violation(
                            now,
                            format!(
                                "n{node} thawed entity {} whose offer was sent and never refused",
                                t.entity_id
                            ),
                        ),
                        None => self.violation(
                            now,
                            format!("n{node} thawed entity {} that was not frozen", t.entity_id),
                        ),
                    }
                }
                Some(sidecar_message::Body::Evict(e)) => {
                    self.freezes.remove(&(node, e.entity_id));
                    self.avatars.remove(&(node, e.entity_id));
                }
                Some(sidecar_message::Body::Adopt(a)) => {
                    for a in std::iter::once(a).chain(&a.attachments) {
                        if a.is_master && !a.owner_account.is_empty() {
                            self.avatars
                                .insert((node, a.entity_id), a.owner_account.clone());
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// A frame a game sends its sidecar: an entity it releases is frozen from then on, as after
    /// a Freeze (one that crossed a Freeze keeps the record of that Freeze).
    pub fn frame_from_game(&mut self, node: NodeId, messages: &[GameMessage]) {
        for m in messages {
            match &m.body {
                Some(game_message::Body::Release(r)) => {
                    self.freezes.entry((node, r.entity_id)).or_default();
                    self.avatar_released(node, r.entity_id, r.last_input_seq);
                }
                Some(game_message::Body::Spawn(s))
                    if s.is_master && !s.owner_account.is_empty() =>
                {
                    self.avatars
                        .insert((node, s.entity_id), s.owner_account.clone());
                }
                Some(game_message::Body::Despawn(d)) => {
                    self.avatars.remove(&(node, d.entity_id));
                }
                _ => {}
            }
        }
    }

    /// `node`'s game released avatar `id` having applied its player's inputs up to
    /// `last_input_seq`: the ones after it delivered there were dropped by the game, and are
    /// handed on (they may reach a game once more).
    fn avatar_released(&mut self, node: NodeId, id: u64, last_input_seq: u64) {
        let Some(account) = self.avatars.get(&(node, id)).cloned() else {
            return;
        };
        let after = (account.clone(), last_input_seq + 1)..=(account, u64::MAX);
        let dropped: Vec<(String, u64)> = self
            .delivered_to
            .range(after)
            .filter(|(_, to)| **to == node)
            .map(|(k, _)| k.clone())
            .collect();
        for key in dropped {
            self.delivered_to.remove(&key);
            if let Some(n) = self.delivered.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    self.delivered.remove(&key);
                }
                self.handed_on += 1;
            }
        }
    }

    /// A frame between two nodes: offers and refusals are noted for the thaw rule.
    pub fn frame_between(&mut self, from: NodeId, to: NodeId, frame: &MeshFrame) {
        for m in &frame.messages {
            match &m.body {
                Some(mesh_message::Body::HandoffOffer(o)) => {
                    if let Some(f) = self.freezes.get_mut(&(from, o.entity_id)) {
                        f.offered = true;
                        f.to = Some(to);
                    }
                }
                Some(mesh_message::Body::HandoffRefused(r)) => {
                    if let Some(f) = self.freezes.get_mut(&(to, r.entity_id)) {
                        f.refused = true;
                    }
                }
                _ => {}
            }
        }
    }

    /// The world is quiet: motion stopped long ago.
    pub fn at_quiescence(
        &mut self,
        now: u64,
        census: &CensusReport,
        cores: &[(NodeId, Vec<Real>)],
        handoffs_in_flight: u64,
        held_frames: u64,
        stats: &Stats,
    ) {
        if held_frames > 0 {
            self.violation(
                now,
                format!("{held_frames} frames still held by epoch fences after the world stopped"),
            );
        }
        if handoffs_in_flight > 0 {
            self.violation(
                now,
                format!("{handoffs_in_flight} handoffs still in flight after the world stopped"),
            );
        }
        let lost = census.lost();
        if !lost.is_empty() {
            self.violation(now, format!("entities lost: {lost:?}"));
        }
        let dup = census.duplicated();
        if !dup.is_empty() {
            self.violation(now, format!("entities held by two games: {dup:?}"));
        }
        let mut writers: BTreeMap<u64, Vec<(NodeId, bool)>> = BTreeMap::new();
        for (node, reals) in cores {
            for r in reals {
                writers.entry(r.id).or_default().push((*node, r.frozen));
            }
        }
        for id in &census.alive {
            match writers.get(id).map(Vec::as_slice) {
                Some([(_, false)]) => {}
                other => self.violation(
                    now,
                    format!("entity {id} is not the one unfrozen real of one node: {other:?}"),
                ),
            }
        }
        for (id, w) in &writers {
            if !census.alive.contains(id) {
                self.violation(
                    now,
                    format!("n{:?} holds a real of {id}, which no game holds", w),
                );
            }
        }
        // A released avatar's game drops what reaches it after its release: exactly the inputs
        // handed on, each delivered once more (or lost under a reason) after.
        let (frozen, repeat, no_player, old_session) = stats.inputs_ignored;
        let deliveries = stats.inputs_delivered + self.handed_on;
        if stats.inputs_applied + frozen + repeat + no_player + old_session != deliveries
            || frozen != self.handed_on
            || repeat + no_player + old_session > 0
        {
            self.violation(
                now,
                format!(
                    "inputs: {} delivered to games ({} of them again, handed on from a released avatar), {} applied; ignored: {frozen} for a frozen avatar, {repeat} repeats, {no_player} with no avatar there, {old_session} of an older session",
                    deliveries, self.handed_on, stats.inputs_applied
                ),
            );
        }
        let unaccounted = stats.counted.unaccounted(stats.inputs_sent);
        if unaccounted != 0 {
            self.violation(
                now,
                format!(
                    "the nodes' counters leave {unaccounted} of {} inputs unaccounted: {:?}",
                    stats.inputs_sent, stats.counted
                ),
            );
        }
        // Copies of applied inputs that never reached their target are counted where they
        // went (a link lost with the copies queued on it, whose target died): not inputs lost.
        let c = &stats.counted;
        let copies_unanswered = c.copies_applied as i64 - c.copies_refused as i64;
        let copies_lost_in_network = c.lost_forwards as i64 - stats.inputs_lost_in_network as i64;
        let copies_dropped = (copies_unanswered - copies_lost_in_network).max(0) as u64;
        let accounted = stats.inputs_delivered
            + stats.inputs_dropped.saturating_sub(copies_dropped)
            + stats.inputs_lost_in_network
            + stats.inputs_lost_with_game;
        if accounted != stats.inputs_sent {
            let missing: Vec<&(String, u64)> = self
                .sent
                .iter()
                .filter(|k| !self.delivered.contains_key(*k))
                .take(5)
                .collect();
            self.violation(
                now,
                format!(
                    "inputs: {} sent, {} delivered, {} dropped under a reason, {} lost with a link: {} unaccounted (undelivered e.g. {missing:?})",
                    stats.inputs_sent,
                    stats.inputs_delivered,
                    stats.inputs_dropped,
                    stats.inputs_lost_in_network,
                    stats.inputs_sent as i64 - accounted as i64
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Checker;

    #[test]
    fn a_key_believed_held_by_two_entities_at_once_is_reported_once() {
        let mut c = Checker::default();
        c.claims_after_step(100, 1, vec![("trade:ada".into(), 7, 1_000)]);
        // The same entity believed by its old and new owner (a handoff): one holder.
        c.claims_after_step(200, 2, vec![("trade:ada".into(), 7, 1_500)]);
        assert!(c.violations.is_empty(), "{:?}", c.violations);
        // Another entity while n1's belief lasts: two holders.
        c.claims_after_step(300, 3, vec![("trade:ada".into(), 9, 2_000)]);
        assert_eq!(c.violations.len(), 1, "{:?}", c.violations);
        assert!(c.violations[0].contains("has two holders"));
        c.claims_after_step(400, 3, vec![("trade:ada".into(), 9, 2_000)]);
        assert_eq!(c.violations.len(), 1, "reported once per key");
        // Beliefs that ended, or of a dead node, hold nothing.
        let mut c = Checker::default();
        c.claims_after_step(100, 1, vec![("k".into(), 7, 1_000)]);
        c.claims_after_step(1_000, 2, vec![("k".into(), 9, 2_000)]);
        c.claims_after_step(200, 3, vec![("j".into(), 7, 5_000)]);
        c.node_gone(3);
        c.claims_after_step(300, 2, vec![("j".into(), 9, 2_000)]);
        assert!(c.violations.is_empty(), "{:?}", c.violations);
    }
}
