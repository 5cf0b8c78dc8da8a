//! Checkpoints: the latest complete state of every entity this node writes, in the game's own
//! codec, so that a crash of the game (or later of the node) does not take the world with it.
//!
//! A new entity is asked for at once (until its first checkpoint nothing could restore it).
//! After that, each entity that changed since its last checkpoint is asked for again at its own
//! slot of every interval, a phase drawn from its id, so a node's requests spread over the
//! interval instead of arriving in one burst, and no checkpoint is more than an interval older
//! than the next (`Checkpoint` to the game, which answers `CheckpointState` in its next tick
//! without freezing anything). A request the game never answers is asked again an interval
//! later. A handoff's snapshot is a checkpoint too.
//!
//! Pure: the caller passes the time.

use bytes::Bytes;
use rustc_hash::FxHashMap as HashMap;

use super::handoff::EntityId;

/// One entity's latest checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// The entity epoch it was taken under: only that epoch's writer may restore it.
    pub epoch: u64,
    pub state: Bytes,
    /// When it was taken (monotonic ms).
    pub at_ms: u64,
}

#[derive(Debug)]
pub struct Checkpoints {
    interval_ms: u64,
    kept: HashMap<EntityId, Kept>,
    /// Entities changed since their last checkpoint: when each may be asked for.
    due: HashMap<EntityId, u64>,
    /// Asked for and not answered yet: since when.
    asked: HashMap<EntityId, u64>,
    /// Taken, or let go, since the store last heard: what the next flush writes.
    taken_since_flush: std::collections::BTreeSet<EntityId>,
    forgotten_since_flush: std::collections::BTreeSet<EntityId>,
    /// Entities whose checkpoint the store holds.
    stored: rustc_hash::FxHashSet<EntityId>,
    /// Something was taken that the store holds no checkpoint of yet: the next flush is due now.
    fresh: bool,
}

impl Checkpoints {
    /// `interval_ms` 0: no checkpoints are asked for (handoff snapshots are still kept).
    pub fn new(interval_ms: u64) -> Self {
        Self {
            interval_ms,
            kept: HashMap::default(),
            due: HashMap::default(),
            asked: HashMap::default(),
            taken_since_flush: Default::default(),
            forgotten_since_flush: Default::default(),
            stored: Default::default(),
            fresh: false,
        }
    }

    /// `id` changed (spawned, updated, adopted) at `now_ms`.
    pub fn touched(&mut self, id: EntityId, now_ms: u64) {
        if self.interval_ms == 0 || self.due.contains_key(&id) || self.asked.contains_key(&id) {
            return;
        }
        let at = match self.kept.get(&id) {
            Some(k) => {
                next_slot(k.at_ms, phase(id, self.interval_ms), self.interval_ms).max(now_ms)
            }
            None => now_ms,
        };
        self.due.insert(id, at);
    }

    /// Up to `max` entities to ask for at `now_ms`, oldest due first; they count as asked.
    pub fn take_due(&mut self, now_ms: u64, max: usize) -> Vec<EntityId> {
        // Asked an interval ago and never answered: ask again.
        let unanswered: Vec<EntityId> = self
            .asked
            .iter()
            .filter(|(_, since)| now_ms >= **since + self.interval_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in unanswered {
            self.asked.remove(&id);
            self.due.insert(id, now_ms);
        }
        let mut ready: Vec<(u64, EntityId)> = self
            .due
            .iter()
            .filter(|(_, at)| **at <= now_ms)
            .map(|(id, at)| (*at, *id))
            .collect();
        ready.sort_unstable();
        ready.truncate(max);
        ready
            .into_iter()
            .map(|(_, id)| {
                self.due.remove(&id);
                self.asked.insert(id, now_ms);
                id
            })
            .collect()
    }

    /// The state of `id` under `epoch`, from the game at `now_ms` (an answer, or a handoff's
    /// snapshot). The caller checked that `epoch` is the entity's current one.
    pub fn taken(&mut self, id: EntityId, epoch: u64, state: Bytes, now_ms: u64) {
        // Kept until the next one, for good if the entity stops changing.
        let state = crate::model::entities::detached(state);
        self.asked.remove(&id);
        self.taken_since_flush.insert(id);
        self.forgotten_since_flush.remove(&id);
        self.fresh |= !self.stored.contains(&id);
        self.kept.insert(
            id,
            Kept {
                epoch,
                state,
                at_ms: now_ms,
            },
        );
    }

    /// `id` is no longer written here (despawned, handed away, or its game is gone).
    pub fn forget(&mut self, id: EntityId) -> Option<Kept> {
        self.due.remove(&id);
        self.asked.remove(&id);
        self.taken_since_flush.remove(&id);
        let kept = self.kept.remove(&id);
        if kept.is_some() {
            self.forgotten_since_flush.insert(id);
        }
        kept
    }

    /// Whether an entity was taken that the store holds no checkpoint of yet (until it does,
    /// nothing could restore it).
    pub fn fresh(&self) -> bool {
        self.fresh
    }

    /// Whether the store holds a checkpoint of `id` (as far as writes that went out tell).
    pub fn is_stored(&self, id: EntityId) -> bool {
        self.stored.contains(&id)
    }

    /// What changed since the last call: (taken, let go), for the store.
    pub fn take_changes(&mut self) -> (Vec<EntityId>, Vec<EntityId>) {
        self.fresh = false;
        (
            std::mem::take(&mut self.taken_since_flush)
                .into_iter()
                .collect(),
            std::mem::take(&mut self.forgotten_since_flush)
                .into_iter()
                .collect(),
        )
    }

    /// A write with these checkpoints and removals went to the store.
    pub fn written(&mut self, put: &[EntityId], removed: &[EntityId]) {
        self.stored.extend(put.iter().copied());
        for id in removed {
            self.stored.remove(id);
        }
    }

    /// A write to the store failed: `id` goes in the next one again, as the checkpoint it has
    /// then, or as a removal if it is no longer kept.
    pub fn unflushed(&mut self, id: EntityId) {
        self.stored.remove(&id);
        if self.kept.contains_key(&id) {
            self.taken_since_flush.insert(id);
            self.fresh = true;
        } else {
            self.forgotten_since_flush.insert(id);
        }
    }

    pub fn latest(&self, id: EntityId) -> Option<&Kept> {
        self.kept.get(&id)
    }

    /// Whether `id`, written here under `epoch`, lacks a checkpoint it should have by `now_ms`:
    /// none kept under that epoch, and none asked for or due within `slack_ms` of now.
    pub fn missing(&self, id: EntityId, epoch: u64, now_ms: u64, slack_ms: u64) -> bool {
        if self.interval_ms == 0 || self.kept.get(&id).is_some_and(|k| k.epoch == epoch) {
            return false;
        }
        let pending = self
            .due
            .get(&id)
            .map(|at| *at + slack_ms)
            .or_else(|| self.asked.get(&id).map(|since| *since + slack_ms));
        pending.is_none_or(|until| now_ms > until)
    }

    /// Requests not answered yet, and not given up on (an interval old) at `now_ms`.
    pub fn outstanding(&self, now_ms: u64) -> usize {
        self.asked
            .values()
            .filter(|since| now_ms < **since + self.interval_ms)
            .count()
    }

    /// The game answered for `id`, but with nothing to keep (another epoch): asked again when
    /// it next changes.
    pub fn answered_in_vain(&mut self, id: EntityId) {
        self.asked.remove(&id);
    }

    /// The earliest time an entity is due (for the node's timer).
    pub fn next_due(&self) -> Option<u64> {
        self.due.values().min().copied()
    }

    pub fn kept(&self) -> usize {
        self.kept.len()
    }
}

/// The first time after `after_ms` that falls at `phase` within an interval.
fn next_slot(after_ms: u64, phase: u64, interval_ms: u64) -> u64 {
    let slot = after_ms - after_ms % interval_ms + phase;
    if slot > after_ms {
        slot
    } else {
        slot + interval_ms
    }
}

/// Where in the interval an entity's checkpoints fall: spread by its id.
fn phase(id: EntityId, interval_ms: u64) -> u64 {
    // Ids of one node share their high bits; a multiplicative hash spreads the low ones.
    (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % interval_ms.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const I: u64 = 2_000;

    #[test]
    fn new_entities_are_asked_at_once_and_then_spread_over_the_interval() {
        let mut c = Checkpoints::new(I);
        let ids: Vec<u64> = (0..1_000u64).map(|i| 402_371_326_771_204_600 + i).collect();
        for &id in &ids {
            c.touched(id, 0);
        }
        assert_eq!(
            c.take_due(0, usize::MAX).len(),
            1_000,
            "all at once, the first time"
        );
        for &id in &ids {
            c.taken(id, 1, Bytes::from_static(b"s"), 10);
            c.touched(id, 20);
        }
        // Every repeat falls within the next interval, and no tenth of it holds more than a
        // fifth of them.
        let mut per_tenth = [0usize; 10];
        for at in c.due.values() {
            assert!(*at > 10 && *at <= 10 + I, "{at}");
            per_tenth[(*at % I * 10 / I) as usize] += 1;
        }
        assert!(per_tenth.iter().all(|n| *n < 200), "{per_tenth:?}");
    }

    #[test]
    fn only_what_changed_is_asked_again_at_its_slot() {
        let mut c = Checkpoints::new(I);
        c.touched(1, 0);
        assert_eq!(c.take_due(0, 10), [1]);
        // Asked: changes meanwhile do not ask twice.
        c.touched(1, 10);
        assert!(c.take_due(10, 10).is_empty());
        c.taken(1, 1, Bytes::from_static(b"a"), 50);
        assert_eq!(c.latest(1).unwrap().at_ms, 50);
        // Unchanged: never asked again.
        assert!(c.take_due(10 * I, 10).is_empty());
        // Changed: asked at its slot, never more than an interval after the last checkpoint.
        c.touched(1, 100);
        let slot = c.next_due().unwrap();
        assert!(slot > 50 && slot <= 50 + I, "{slot}");
        assert_eq!(slot % I, phase(1, I));
        assert!(c.take_due(slot - 1, 10).is_empty());
        assert_eq!(c.take_due(slot, 10), [1]);
    }

    #[test]
    fn an_unanswered_request_is_asked_again() {
        let mut c = Checkpoints::new(I);
        c.touched(7, 0);
        let at = c.next_due().unwrap();
        assert_eq!(c.take_due(at, 10), [7]);
        assert_eq!(c.outstanding(at + I - 1), 1);
        assert!(c.take_due(at + I - 1, 10).is_empty());
        // Given up on after an interval: no longer holds back the next batch, and asked again.
        assert_eq!(c.outstanding(at + I), 0);
        assert_eq!(c.take_due(at + I, 10), [7]);
        c.answered_in_vain(7);
        assert_eq!(c.outstanding(at + I), 0);
    }

    #[test]
    fn forgotten_entities_are_never_asked_for() {
        let mut c = Checkpoints::new(I);
        c.touched(7, 0);
        c.taken(7, 1, Bytes::from_static(b"a"), 0);
        assert!(c.forget(7).is_some());
        assert!(c.take_due(10 * I, 10).is_empty());
        assert_eq!(c.kept(), 0);
        // Off: nothing asked, snapshots still kept.
        let mut off = Checkpoints::new(0);
        off.touched(1, 0);
        assert!(off.take_due(u64::MAX, 10).is_empty());
        off.taken(1, 2, Bytes::from_static(b"s"), 5);
        assert_eq!(off.latest(1).unwrap().epoch, 2);
    }
}
