//! The claims this node's entities hold, as the node sees them: when each lease surely lasts
//! until, when to renew it, and which store calls are under way. Pure: time comes in as an
//! argument, and the store's answers as calls.
//!
//! The node counts a lease from the moment it *sent* the call that set it, less a margin, so
//! its own view of a claim always ends before the store's: a claim the node believes held is
//! held in the store, and another holder can only be granted it after this node let it go.

use std::collections::{BTreeMap, VecDeque};

use cellmesh_stores::claims::{ClaimGrant, ClaimHolder};

/// How often a lease is renewed: three times per lease.
const RENEWALS_PER_LEASE: u64 = 3;
/// The part of a lease the node gives up for safety (one eighth).
const MARGIN_DIVISOR: u64 = 8;
/// After a store call failed, the next try waits this long.
pub const RETRY_MS: u64 = 500;
/// How long after a `ClaimLost` the game's release of that claim is taken quietly: the release
/// may have crossed the news.
pub const LOST_RELEASE_GRACE_MS: u64 = 5_000;
/// Lost claims remembered for that, at most.
const LOST_REMEMBERED: usize = 4_096;

/// A claim held by one of this node's entities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub grant: ClaimGrant,
    pub ttl_ms: u64,
    /// The node's own end of the lease: before the store's.
    pub lease_until: u64,
    /// When the next renewal goes out.
    pub renew_at: u64,
    /// A renewal sent at this time is under way.
    pub renewing: Option<u64>,
    /// Carried here by a handoff: the store holds it under the previous owner's epoch until a
    /// rebind sent at this time answers (`Some(0)`: not sent yet).
    pub rebinding: Option<u64>,
    /// The store refused a renewal while the holder was frozen in a handoff: the claim went to
    /// the new owner, unless the handoff comes back (then it is lost).
    pub fenced: bool,
}

/// A `Claim` sent to the store, not answered yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub key: String,
    pub holder: ClaimHolder,
    pub ttl_ms: u64,
    pub request_id: u64,
    /// The game connection that asked: a grant for a connection gone is released.
    pub conn: u64,
    pub sent_at: u64,
    /// The game released it before the answer: a grant is released at once.
    pub released: bool,
    /// Asked by the node for a spawn point's next stock, not by the game.
    pub spawner: bool,
}

/// What a renewal's answer means for the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renewed {
    /// Extended; or an answer about a grant no longer held here (ignored).
    Kept,
    /// The store holds it for someone else: the claim is gone.
    Lost,
    /// The holder is frozen in a handoff: the claim stays with the unit.
    Fenced,
}

/// Every claim of this node: held, and asked for.
#[derive(Debug, Default)]
pub struct Claims {
    held: BTreeMap<String, Held>,
    pending: BTreeMap<u64, Pending>,
    next_token: u64,
    /// Claims the game was told are lost: (key, holder entity, until when a release is quiet).
    lost: VecDeque<(String, u64, u64)>,
}

/// The node's end of a lease set by a call sent at `sent_at`.
pub fn lease_end(sent_at: u64, ttl_ms: u64) -> u64 {
    sent_at + ttl_ms - ttl_ms / MARGIN_DIVISOR
}

fn renew_time(sent_at: u64, ttl_ms: u64) -> u64 {
    sent_at + ttl_ms / RENEWALS_PER_LEASE
}

impl Claims {
    pub fn held(&self) -> impl Iterator<Item = &Held> {
        self.held.values()
    }

    pub fn get(&self, key: &str) -> Option<&Held> {
        self.held.get(key)
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty() && self.pending.is_empty()
    }

    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Records a `Claim` going to the store; its token names the answer.
    pub fn ask(&mut self, p: Pending) -> u64 {
        self.next_token += 1;
        self.pending.insert(self.next_token, p);
        self.next_token
    }

    /// The store's answer to `token`'s claim: what was asked.
    pub fn answered(&mut self, token: u64) -> Option<Pending> {
        self.pending.remove(&token)
    }

    /// The game released `key` for `holder` (`None`: whichever entity): the held claim, to
    /// free in the store. A claim still asked for is marked, and freed when granted.
    pub fn release(&mut self, key: &str, holder: Option<u64>) -> Option<Held> {
        let by = |entity: u64| holder.is_none_or(|h| h == entity);
        for p in self.pending.values_mut() {
            if p.key == key && by(p.holder.entity) {
                p.released = true;
            }
        }
        if self
            .held
            .get(key)
            .is_some_and(|h| by(h.grant.holder.entity))
        {
            return self.held.remove(key);
        }
        None
    }

    /// The game is told at `now` that `holder` lost `key`: a release it sent meanwhile is not
    /// its mistake.
    pub fn told_lost(&mut self, key: &str, holder: u64, now: u64) {
        while self
            .lost
            .front()
            .is_some_and(|l| l.2 <= now || self.lost.len() >= LOST_REMEMBERED)
        {
            self.lost.pop_front();
        }
        self.lost
            .push_back((key.to_string(), holder, now + LOST_RELEASE_GRACE_MS));
    }

    /// Whether the game was told lately (before `now`, within [`LOST_RELEASE_GRACE_MS`]) that
    /// `key` was lost (by `holder`, if named).
    pub fn lost_lately(&self, key: &str, holder: Option<u64>, now: u64) -> bool {
        self.lost
            .iter()
            .any(|(k, h, until)| k == key && holder.is_none_or(|x| x == *h) && now < *until)
    }

    /// Whether `key` is held or asked for here (by `holder`, if named).
    pub fn knows(&self, key: &str, holder: Option<u64>) -> bool {
        let by = |entity: u64| holder.is_none_or(|h| h == entity);
        self.held
            .get(key)
            .is_some_and(|h| by(h.grant.holder.entity))
            || self
                .pending
                .values()
                .any(|p| p.key == key && !p.released && by(p.holder.entity))
    }

    /// A grant of a claim asked at `sent_at`.
    pub fn granted(&mut self, grant: ClaimGrant, ttl_ms: u64, sent_at: u64) {
        let held = Held {
            ttl_ms,
            lease_until: lease_end(sent_at, ttl_ms),
            renew_at: renew_time(sent_at, ttl_ms),
            renewing: None,
            rebinding: None,
            fenced: false,
            grant,
        };
        self.held.insert(held.grant.key.clone(), held);
    }

    /// Claims carried in by a handoff, held under the previous owner's epoch until rebound.
    /// When the previous owner last renewed is not known here: the store outlasts that owner's
    /// view (live when it offered) by the margin only, so the claim is believed for that long
    /// from `now`, unless the rebind (renewing it) answers first.
    pub fn carried_in(&mut self, grant: ClaimGrant, ttl_ms: u64, now: u64) {
        let held = Held {
            ttl_ms,
            lease_until: now + ttl_ms / MARGIN_DIVISOR,
            renew_at: u64::MAX,
            renewing: None,
            rebinding: Some(0),
            fenced: false,
            grant,
        };
        self.held.insert(held.grant.key.clone(), held);
    }

    /// The keys `entity` holds.
    pub fn of(&self, entity: u64) -> Vec<String> {
        self.held
            .values()
            .filter(|h| h.grant.holder.entity == entity)
            .map(|h| h.grant.key.clone())
            .collect()
    }

    /// Forgets every claim of `entity` (handed away with it, or to be released): what it held.
    pub fn drop_holder(&mut self, entity: u64) -> Vec<Held> {
        let keys = self.of(entity);
        keys.iter().filter_map(|k| self.held.remove(k)).collect()
    }

    /// Forgets the game's claims (it went away) and keeps the node's own (a spawn point's stock
    /// keeps its claim while it lives): the game's held ones, to free in the store.
    pub fn forget_games(&mut self, is_nodes: impl Fn(&str) -> bool) -> Vec<Held> {
        for p in self.pending.values_mut() {
            if !p.spawner {
                p.released = true;
            }
        }
        let keys: Vec<String> = self.held.keys().filter(|k| !is_nodes(k)).cloned().collect();
        keys.iter().filter_map(|k| self.held.remove(k)).collect()
    }

    /// Marks every claim still asked for by `entity` released (it despawned).
    pub fn abandon_asked(&mut self, entity: u64) {
        for p in self.pending.values_mut() {
            if p.holder.entity == entity {
                p.released = true;
            }
        }
    }

    /// The renewals and rebinds due at `now` (each marked under way), and the claims whose
    /// lease ran out (removed).
    pub fn due(&mut self, now: u64) -> Due {
        let mut due = Due::default();
        let lapsed: Vec<String> = self
            .held
            .values()
            .filter(|h| now >= h.lease_until)
            .map(|h| h.grant.key.clone())
            .collect();
        for k in lapsed {
            due.lapsed.extend(self.held.remove(&k));
        }
        for h in self.held.values_mut() {
            if h.rebinding == Some(0) {
                h.rebinding = Some(now);
                due.rebind.push((h.grant.clone(), h.ttl_ms));
            } else if h.rebinding.is_none() && h.renewing.is_none() && now >= h.renew_at {
                h.renewing = Some(now);
                due.renew.push((h.grant.clone(), h.ttl_ms));
            }
        }
        due
    }

    /// The answer to a renewal of `grant`: `Ok(current)`, or the store failed.
    pub fn renewed(
        &mut self,
        grant: &ClaimGrant,
        result: Result<bool, ()>,
        frozen: bool,
    ) -> Renewed {
        let Some(h) = self.held.get_mut(&grant.key).filter(|h| h.grant == *grant) else {
            return Renewed::Kept;
        };
        let Some(sent) = h.renewing.take() else {
            return Renewed::Kept;
        };
        match result {
            Ok(true) => {
                h.lease_until = h.lease_until.max(lease_end(sent, h.ttl_ms));
                h.renew_at = renew_time(sent, h.ttl_ms);
                Renewed::Kept
            }
            Ok(false) if frozen => {
                h.fenced = true;
                h.renew_at = u64::MAX;
                Renewed::Fenced
            }
            Ok(false) => {
                self.held.remove(&grant.key);
                Renewed::Lost
            }
            Err(()) => {
                h.renew_at = sent + RETRY_MS;
                Renewed::Kept
            }
        }
    }

    /// The answer to a rebind of `old` carried in by a handoff: the grant under the new epoch
    /// (its lease renewed from the rebind's sending), `None` when the store no longer holds it
    /// for `old`'s token, or the store failed. True when the claim is lost.
    pub fn rebound(&mut self, old: &ClaimGrant, result: Result<Option<ClaimGrant>, ()>) -> bool {
        let Some(h) = self.held.get_mut(&old.key).filter(|h| h.grant == *old) else {
            return false;
        };
        let Some(sent) = h.rebinding else {
            return false;
        };
        match result {
            Ok(Some(g)) => {
                h.grant = g;
                h.rebinding = None;
                h.lease_until = lease_end(sent, h.ttl_ms);
                h.renew_at = renew_time(sent, h.ttl_ms);
                false
            }
            Ok(None) => {
                self.held.remove(&old.key);
                true
            }
            Err(()) => {
                // Sent again at the next step, while the lease lasts.
                h.rebinding = Some(0);
                false
            }
        }
    }

    /// A handoff of `entity` came back: claims fenced meanwhile are lost (removed).
    pub fn thawed(&mut self, entity: u64) -> Vec<Held> {
        let keys: Vec<String> = self
            .held
            .values()
            .filter(|h| h.grant.holder.entity == entity && h.fenced)
            .map(|h| h.grant.key.clone())
            .collect();
        let lost = keys.iter().filter_map(|k| self.held.remove(k)).collect();
        for h in self.held.values_mut() {
            if h.grant.holder.entity == entity && h.renew_at == u64::MAX && h.rebinding.is_none() {
                h.renew_at = 0;
            }
        }
        lost
    }
}

/// Store calls due, and claims lapsed.
#[derive(Debug, Default)]
pub struct Due {
    pub renew: Vec<(ClaimGrant, u64)>,
    pub rebind: Vec<(ClaimGrant, u64)>,
    pub lapsed: Vec<Held>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(key: &str, entity: u64, epoch: u64, token: u64) -> ClaimGrant {
        ClaimGrant {
            key: key.into(),
            holder: ClaimHolder {
                entity,
                entity_epoch: epoch,
            },
            token,
        }
    }

    #[test]
    fn a_lost_claim_is_remembered_for_the_grace_only() {
        let mut c = Claims::default();
        c.told_lost("k", 7, 1_000);
        assert!(c.lost_lately("k", Some(7), 1_000));
        assert!(c.lost_lately("k", None, 5_999));
        assert!(!c.lost_lately("k", Some(8), 2_000), "another holder's");
        assert!(!c.lost_lately("j", Some(7), 2_000), "another key");
        assert!(!c.lost_lately("k", Some(7), 1_000 + LOST_RELEASE_GRACE_MS));
        // Bounded: the oldest go first.
        for i in 0..LOST_REMEMBERED as u64 {
            c.told_lost(&format!("x{i}"), 1, 2_000);
        }
        assert!(!c.lost_lately("k", Some(7), 2_000));
        assert!(c.lost_lately("x1", Some(1), 2_000));
        assert!(c.lost.len() <= LOST_REMEMBERED);
        // Past the grace, one new entry clears every lapsed one.
        c.told_lost("y", 1, 10_000);
        assert_eq!(c.lost.len(), 1);
    }

    #[test]
    fn the_nodes_lease_ends_before_the_stores_and_renews_keep_it() {
        let mut c = Claims::default();
        let g = grant("k", 7, 1, 1);
        c.granted(g.clone(), 8_000, 1_000);
        // Store's end 9_000; the node's 8_000 (an eighth given up).
        assert_eq!(c.get("k").unwrap().lease_until, 8_000);
        assert!(c.due(3_000).renew.is_empty(), "renewal at a third");
        let due = c.due(3_666);
        assert_eq!(due.renew, vec![(g.clone(), 8_000)]);
        assert!(c.due(3_700).renew.is_empty(), "one renewal under way");
        assert_eq!(c.renewed(&g, Ok(true), false), Renewed::Kept);
        assert_eq!(c.get("k").unwrap().lease_until, 3_666 + 7_000);
        // A failed renewal is retried; nothing renewed by the node's end: lapsed.
        let due = c.due(6_333);
        assert_eq!(due.renew.len(), 1);
        assert_eq!(c.renewed(&g, Err(()), false), Renewed::Kept);
        assert!(c.due(6_800).renew.is_empty());
        assert_eq!(c.due(6_833).renew.len(), 1);
        let due = c.due(10_666);
        assert_eq!(due.lapsed.len(), 1);
        assert!(c.get("k").is_none());
    }

    #[test]
    fn a_refused_renewal_loses_the_claim_unless_the_holder_is_frozen() {
        let mut c = Claims::default();
        let g = grant("k", 7, 1, 1);
        c.granted(g.clone(), 3_000, 0);
        c.due(1_000);
        assert_eq!(c.renewed(&g, Ok(false), false), Renewed::Lost);
        assert!(c.get("k").is_none());

        c.granted(g.clone(), 3_000, 0);
        c.due(1_000);
        assert_eq!(c.renewed(&g, Ok(false), true), Renewed::Fenced);
        assert!(
            c.due(2_000).renew.is_empty(),
            "no renewal of a fenced claim"
        );
        // The handoff completed: the claim went with it, nothing lost here.
        assert_eq!(c.drop_holder(7).len(), 1);

        // The handoff came back instead: a fenced claim is lost, the others renew again.
        c.granted(g.clone(), 3_000, 0);
        c.granted(grant("j", 7, 1, 4), 3_000, 0);
        c.due(1_000);
        c.renewed(&g, Ok(false), true);
        c.renewed(&grant("j", 7, 1, 4), Ok(true), true);
        let lost = c.thawed(7);
        assert_eq!(lost.len(), 1);
        assert_eq!(lost[0].grant.key, "k");
        assert!(c.get("j").is_some());
    }

    #[test]
    fn a_carried_claim_is_rebound_once_and_renewed_from_the_rebind() {
        let mut c = Claims::default();
        let old = grant("k", 7, 1, 3);
        c.carried_in(old.clone(), 6_000, 10_000);
        let due = c.due(10_000);
        assert_eq!(due.rebind, vec![(old.clone(), 6_000)]);
        assert!(due.renew.is_empty());
        assert!(c.due(10_100).rebind.is_empty(), "one rebind under way");
        // A failed rebind is sent again.
        assert!(!c.rebound(&old, Err(())));
        assert_eq!(c.due(10_200).rebind.len(), 1);
        let new = grant("k", 7, 2, 3);
        assert!(!c.rebound(&old, Ok(Some(new.clone()))));
        let h = c.get("k").unwrap();
        assert_eq!(h.grant, new);
        assert_eq!(h.lease_until, 10_200 + 5_250);
        assert_eq!(h.renew_at, 12_200);
        // A claim the store no longer holds for the token is lost.
        c.carried_in(grant("j", 7, 1, 1), 6_000, 10_000);
        c.due(10_000);
        assert!(c.rebound(&grant("j", 7, 1, 1), Ok(None)));
        assert!(c.get("j").is_none());
    }

    #[test]
    fn a_release_before_the_grant_marks_the_request() {
        let mut c = Claims::default();
        let t = c.ask(Pending {
            key: "k".into(),
            holder: ClaimHolder {
                entity: 7,
                entity_epoch: 1,
            },
            ttl_ms: 3_000,
            request_id: 1,
            conn: 1,
            sent_at: 0,
            released: false,
            spawner: false,
        });
        assert!(c.knows("k", None));
        assert!(c.knows("k", Some(7)));
        assert!(!c.knows("k", Some(8)));
        assert!(c.release("k", Some(8)).is_none());
        assert!(c.release("k", Some(7)).is_none());
        assert!(
            !c.knows("k", None),
            "released, waiting for its grant to free it"
        );
        assert!(c.answered(t).unwrap().released);
        assert!(c.is_empty());
    }
}
