//! Entity commands (pure): what the origin of a command keeps until its one result, and the
//! order a writer hands each stream of commands to its game in.
//!
//! A stream is one origin process's commands to one target. The origin numbers its commands and
//! sends each with the number of its previous command to the same target (`prev`). The node
//! that writes the target hands a command to its game once its predecessor went (or was never
//! known), so a command that overtook an older one on a shorter path (the old owner forwards,
//! the origin sends the newer one straight to the new owner) waits for it, for a window at most.
//! The writer's progress in each stream (its cursor) travels with the entity in a handoff.
//!
//! Pure: the caller passes the time.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;

use cellmesh_world::partition::NodeId;

use crate::model::handoff::EntityId;

/// How long a writer holds a command whose predecessor has not arrived.
pub const REORDER_WINDOW_MS: u64 = 500;
/// The origin forgets its last command to a target after this long without one, and sends the
/// next with no predecessor.
pub const ORIGIN_STREAM_IDLE_MS: u64 = 60_000;
/// The writer forgets a stream after this long without a command: longer than the origin's,
/// so a command naming a predecessor always finds its stream.
pub const WRITER_STREAM_IDLE_MS: u64 = 2 * ORIGIN_STREAM_IDLE_MS;

/// One origin process's commands to one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamKey {
    pub target: EntityId,
    pub origin: NodeId,
    pub incarnation: u64,
}

/// A command waiting at its origin for its one result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    /// The game's own id for it.
    pub request_id: u64,
    pub target: EntityId,
    pub deadline_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("request id {0} is waiting for its result already")]
    InUse(u64),
}

/// The origin's side: numbering, and the requests waiting for a result.
///
/// A request travels under a token of the origin's own, not the game's id: a result that comes
/// back after the game reconnected (and numbers its requests afresh) finds nothing to settle.
#[derive(Debug, Default)]
pub struct Origin {
    next_seq: u64,
    /// target -> (the last command's number, when it was sent).
    last_to: HashMap<EntityId, (u64, u64)>,
    next_token: u64,
    /// token -> the request.
    pending: HashMap<u64, Pending>,
    /// The game's request id -> its token.
    tokens: HashMap<u64, u64>,
}

impl Origin {
    /// Numbers a new command to `target`: (its number, its predecessor's or 0).
    pub fn number(&mut self, target: EntityId, now_ms: u64) -> (u64, u64) {
        self.next_seq += 1;
        let seq = self.next_seq;
        let prev = self
            .last_to
            .insert(target, (seq, now_ms))
            .filter(|(_, at)| now_ms.saturating_sub(*at) < ORIGIN_STREAM_IDLE_MS)
            .map_or(0, |(s, _)| s);
        (seq, prev)
    }

    /// A request the game waits on, and the token it travels under; refused while the same
    /// id still waits.
    pub fn open(
        &mut self,
        request_id: u64,
        target: EntityId,
        deadline_ms: u64,
    ) -> Result<u64, RequestError> {
        if self.tokens.contains_key(&request_id) {
            return Err(RequestError::InUse(request_id));
        }
        self.next_token += 1;
        let token = self.next_token;
        self.tokens.insert(request_id, token);
        self.pending.insert(
            token,
            Pending {
                request_id,
                target,
                deadline_ms,
            },
        );
        Ok(token)
    }

    /// The first result under `token` settles its request; any later one finds nothing.
    pub fn settle(&mut self, token: u64) -> Option<Pending> {
        let p = self.pending.remove(&token)?;
        self.tokens.remove(&p.request_id);
        Some(p)
    }

    /// Requests past their deadline, settled now (answered `TIMEOUT`), oldest first.
    pub fn expired(&mut self, now_ms: u64) -> Vec<Pending> {
        let mut due: Vec<(u64, Pending)> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline_ms <= now_ms)
            .map(|(token, p)| (*token, *p))
            .collect();
        due.sort_by_key(|(token, p)| (p.deadline_ms, *token));
        for (token, p) in &due {
            self.pending.remove(token);
            self.tokens.remove(&p.request_id);
        }
        self.last_to
            .retain(|_, (_, at)| now_ms.saturating_sub(*at) < ORIGIN_STREAM_IDLE_MS);
        due.into_iter().map(|(_, p)| p).collect()
    }

    /// Every request still waiting (the game went away: nobody is left to answer).
    pub fn clear(&mut self) -> usize {
        let n = self.pending.len();
        self.pending.clear();
        self.tokens.clear();
        n
    }

    pub fn waiting(&self) -> usize {
        self.pending.len()
    }

    pub fn next_deadline(&self) -> Option<u64> {
        self.pending.values().map(|p| p.deadline_ms).min()
    }
}

/// What to do with a command that reached the target's writer.
#[derive(Debug, PartialEq, Eq)]
pub enum Ordered<C> {
    /// Hand these to the game now, in this order.
    Deliver(Vec<C>),
    /// Held until its predecessor arrives or the window ends.
    Held,
    /// Numbered at or below one already delivered: not delivered (the caller answers it).
    Late(C),
}

#[derive(Debug)]
struct Stream<C> {
    last: u64,
    /// seq -> (prev, command, arrived at).
    pending: BTreeMap<u64, (u64, C, u64)>,
    touched_ms: u64,
}

impl<C> Stream<C> {
    fn new(now_ms: u64) -> Self {
        Self {
            last: 0,
            pending: BTreeMap::new(),
            touched_ms: now_ms,
        }
    }

    /// Held commands whose predecessor came: each in seq order, once the one before it went.
    fn drain(&mut self, out: &mut Vec<C>) {
        loop {
            let next = self
                .pending
                .iter()
                .find(|(_, (prev, _, _))| *prev <= self.last)
                .map(|(seq, _)| *seq);
            let Some(seq) = next else { break };
            // Internal: `seq` was found in the same map one line up.
            let (_, c, _) = self.pending.remove(&seq).expect("found above");
            self.last = self.last.max(seq);
            out.push(c);
        }
    }
}

/// The writer's side: every stream of commands to the entities it writes, by target.
///
/// Asked on every timer of the node ([`Self::next_due`]), so it keeps the number of commands
/// it holds and answers at once when that is 0, as it nearly always is.
#[derive(Debug)]
pub struct CommandOrder<C> {
    /// target -> (origin, incarnation) -> the stream.
    streams: HashMap<EntityId, BTreeMap<(NodeId, u64), Stream<C>>>,
    held: usize,
}

impl<C> Default for CommandOrder<C> {
    fn default() -> Self {
        Self {
            streams: HashMap::default(),
            held: 0,
        }
    }
}

impl<C> CommandOrder<C> {
    fn stream(&mut self, key: StreamKey, now_ms: u64) -> &mut Stream<C> {
        self.streams
            .entry(key.target)
            .or_default()
            .entry((key.origin, key.incarnation))
            .or_insert_with(|| Stream::new(now_ms))
    }

    /// Command `seq` of stream `key`, whose predecessor is `prev` (0: none), at `now_ms`.
    pub fn offer(&mut self, now_ms: u64, key: StreamKey, seq: u64, prev: u64, c: C) -> Ordered<C> {
        let s = self.stream(key, now_ms);
        s.touched_ms = now_ms;
        if seq <= s.last || s.pending.contains_key(&seq) {
            return Ordered::Late(c);
        }
        if prev != 0 && prev > s.last {
            s.pending.insert(seq, (prev, c, now_ms));
            self.held += 1;
            return Ordered::Held;
        }
        s.last = seq;
        let mut out = vec![c];
        let before = s.pending.len();
        s.drain(&mut out);
        let drained = before - s.pending.len();
        self.held -= drained;
        Ordered::Deliver(out)
    }

    /// Commands whose window ended without their predecessor: delivered in order all the
    /// same (the predecessor, if it comes, is late). Those of targets `frozen` names wait (they
    /// follow their target if it is handed on).
    pub fn due(&mut self, now_ms: u64, frozen: impl Fn(EntityId) -> bool) -> Vec<C> {
        let mut out = Vec::new();
        if self.held == 0 {
            return out;
        }
        let mut targets: Vec<EntityId> = self
            .streams
            .iter()
            .filter(|(target, streams)| {
                !frozen(**target)
                    && streams.values().any(|s| {
                        s.pending
                            .values()
                            .any(|(_, _, at)| at + REORDER_WINDOW_MS <= now_ms)
                    })
            })
            .map(|(target, _)| *target)
            .collect();
        targets.sort_unstable();
        for target in targets {
            // Internal: a timer step over targets it just listed from the same map.
            let streams = self.streams.get_mut(&target).expect("listed above");
            for s in streams.values_mut() {
                let overdue = s
                    .pending
                    .values()
                    .any(|(_, _, at)| at + REORDER_WINDOW_MS <= now_ms);
                // The oldest waiting command gives up on its predecessor; those after it follow.
                if let (true, Some((&seq, _))) = (overdue, s.pending.iter().next()) {
                    let before = s.pending.len();
                    let (_, c, _) = s.pending.remove(&seq).expect("listed above");
                    s.last = s.last.max(seq);
                    out.push(c);
                    s.drain(&mut out);
                    self.held -= before - s.pending.len();
                }
            }
        }
        out
    }

    /// The next time a held command's window ends, among targets `frozen` does not name (as
    /// [`CommandOrder::due`] leaves those alone, a window that ended under a frozen target would
    /// be due again at once, for as long as the freeze lasts).
    pub fn next_due(&self, frozen: impl Fn(EntityId) -> bool) -> Option<u64> {
        if self.held == 0 {
            return None;
        }
        self.streams
            .iter()
            .filter(|(target, _)| !frozen(**target))
            .flat_map(|(_, streams)| streams.values())
            .flat_map(|s| s.pending.values().map(|(_, _, at)| at + REORDER_WINDOW_MS))
            .min()
    }

    /// How far each stream to `target` got: (origin, incarnation, last delivered).
    pub fn cursors(&self, target: EntityId) -> Vec<(NodeId, u64, u64)> {
        self.streams
            .get(&target)
            .into_iter()
            .flatten()
            .filter(|(_, s)| s.last != 0)
            .map(|(&(origin, incarnation), s)| (origin, incarnation, s.last))
            .collect()
    }

    /// `target` was adopted from a node whose streams had got this far.
    pub fn resume(&mut self, target: EntityId, cursors: &[(NodeId, u64, u64)], now_ms: u64) {
        for &(origin, incarnation, last) in cursors {
            let key = StreamKey {
                target,
                origin,
                incarnation,
            };
            let s = self.stream(key, now_ms);
            s.last = s.last.max(last);
            s.touched_ms = now_ms;
        }
    }

    /// This node no longer writes `target`: its streams are dropped, and the commands they held
    /// are given back (in stream and seq order) to follow the entity.
    pub fn forget(&mut self, target: EntityId) -> Vec<C> {
        let out: Vec<C> = self
            .streams
            .remove(&target)
            .into_iter()
            .flat_map(BTreeMap::into_values)
            .flat_map(|s| s.pending.into_values().map(|(_, c, _)| c))
            .collect();
        self.held -= out.len();
        out
    }

    /// Streams with nothing held and no command for [`WRITER_STREAM_IDLE_MS`] are dropped.
    pub fn prune(&mut self, now_ms: u64) {
        self.streams.retain(|_, streams| {
            streams.retain(|_, s| {
                !s.pending.is_empty() || now_ms.saturating_sub(s.touched_ms) < WRITER_STREAM_IDLE_MS
            });
            !streams.is_empty()
        });
    }

    pub fn held(&self) -> usize {
        self.held
    }

    pub fn streams(&self) -> usize {
        self.streams.values().map(BTreeMap::len).sum()
    }
}

/// A command handed to this node's game with a request id: where its answer goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub origin: NodeId,
    pub incarnation: u64,
    pub request_id: u64,
    pub target: EntityId,
    pub deadline_ms: u64,
}

/// The answers this node's game owes, under ids of the sidecar's own (two origins may use the
/// same request id).
#[derive(Debug, Default)]
pub struct Replies {
    next: u64,
    open: HashMap<u64, Reply>,
}

impl Replies {
    /// A fresh id for the game to answer with.
    pub fn open(&mut self, reply: Reply) -> u64 {
        self.next += 1;
        self.open.insert(self.next, reply);
        self.next
    }

    /// The game answered `id`: where the answer goes, the first time only.
    pub fn take(&mut self, id: u64) -> Option<Reply> {
        self.open.remove(&id)
    }

    /// Answers owed past their origin's deadline: the origin answered `TIMEOUT` already.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let before = self.open.len();
        self.open.retain(|_, r| r.deadline_ms > now_ms);
        before - self.open.len()
    }

    /// The game went away: it will answer none of them.
    pub fn clear(&mut self) -> Vec<Reply> {
        let mut v: Vec<(u64, Reply)> = self.open.drain().collect();
        v.sort_unstable_by_key(|(id, _)| *id);
        v.into_iter().map(|(_, r)| r).collect()
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: StreamKey = StreamKey {
        target: 7,
        origin: 2,
        incarnation: 1,
    };

    fn delivered(o: Ordered<u64>) -> Vec<u64> {
        match o {
            Ordered::Deliver(v) => v,
            other => panic!("expected a delivery, got {other:?}"),
        }
    }

    #[test]
    fn the_origin_links_each_command_to_its_predecessor_per_target() {
        let mut o = Origin::default();
        assert_eq!(o.number(7, 0), (1, 0));
        assert_eq!(o.number(8, 0), (2, 0));
        assert_eq!(o.number(7, 10), (3, 1));
        // After a long silence the predecessor is forgotten: nothing will wait for it.
        assert_eq!(o.number(7, 10 + ORIGIN_STREAM_IDLE_MS), (4, 0));
    }

    #[test]
    fn a_request_is_settled_once_and_expires_at_its_deadline() {
        let mut o = Origin::default();
        let five = o.open(5, 7, 100).unwrap();
        assert_eq!(o.open(5, 7, 100), Err(RequestError::InUse(5)));
        let six = o.open(6, 7, 200).unwrap();
        let settled = o.settle(five).map(|p| (p.request_id, p.target));
        assert_eq!(settled, Some((5, 7)));
        assert_eq!(o.settle(five), None, "a second result finds nothing");
        assert!(o.expired(199).is_empty());
        let expired: Vec<u64> = o.expired(200).iter().map(|p| p.request_id).collect();
        assert_eq!(expired, [6]);
        assert_eq!(
            o.settle(six),
            None,
            "a result after its timeout finds nothing"
        );
        assert_eq!(o.waiting(), 0);
    }

    #[test]
    fn a_result_from_before_the_game_reconnected_settles_nothing_of_the_new_game() {
        let mut o = Origin::default();
        let old = o.open(1, 7, 100).unwrap();
        o.clear();
        // The new game numbers from 1 again.
        let new = o.open(1, 8, 100).unwrap();
        assert_ne!(old, new);
        assert_eq!(o.settle(old), None);
        assert_eq!(o.settle(new).map(|p| p.target), Some(8));
    }

    #[test]
    fn a_command_that_overtook_its_predecessor_waits_for_it() {
        let mut w = CommandOrder::default();
        assert_eq!(delivered(w.offer(0, KEY, 1, 0, 1)), [1]);
        // 3 names 2 as its predecessor, which is still on the longer path.
        assert_eq!(w.offer(1, KEY, 3, 2, 3), Ordered::Held);
        assert_eq!(w.held(), 1);
        assert_eq!(delivered(w.offer(2, KEY, 2, 1, 2)), [2, 3]);
        assert_eq!(w.offer(3, KEY, 2, 1, 2), Ordered::Late(2), "a copy is late");
    }

    #[test]
    fn numbers_used_by_other_targets_leave_no_gap() {
        let mut w = CommandOrder::default();
        // The origin sent 4..9 elsewhere: 10 follows 3 directly.
        assert_eq!(delivered(w.offer(0, KEY, 3, 0, 3)), [3]);
        assert_eq!(delivered(w.offer(1, KEY, 10, 3, 10)), [10]);
    }

    #[test]
    fn a_lost_predecessor_holds_its_successors_for_the_window_only() {
        let mut w = CommandOrder::default();
        assert_eq!(delivered(w.offer(0, KEY, 1, 0, 1)), [1]);
        assert_eq!(w.offer(10, KEY, 3, 2, 3), Ordered::Held);
        assert_eq!(w.offer(20, KEY, 4, 3, 4), Ordered::Held);
        assert_eq!(w.next_due(|_| false), Some(10 + REORDER_WINDOW_MS));
        assert!(w.due(10 + REORDER_WINDOW_MS - 1, |_| false).is_empty());
        assert!(
            w.due(10 + REORDER_WINDOW_MS, |_| true).is_empty(),
            "a frozen target waits"
        );
        assert_eq!(
            w.next_due(|_| true),
            None,
            "and is not due meanwhile: nothing to wake for until it thaws or moves on"
        );
        assert_eq!(w.due(10 + REORDER_WINDOW_MS, |_| false), [3, 4]);
        assert_eq!(w.offer(600, KEY, 2, 1, 2), Ordered::Late(2));
    }

    #[test]
    fn cursors_carry_the_order_to_the_next_writer() {
        let mut a = CommandOrder::default();
        assert_eq!(delivered(a.offer(0, KEY, 1, 0, 1)), [1]);
        assert_eq!(delivered(a.offer(0, KEY, 2, 1, 2)), [2]);
        let cursors = a.cursors(KEY.target);
        assert_eq!(cursors, [(KEY.origin, KEY.incarnation, 2)]);
        assert!(a.forget(KEY.target).is_empty());
        let mut b = CommandOrder::default();
        b.resume(KEY.target, &cursors, 5);
        // 4 overtook 3, which the old writer forwards: 4 waits, then both go in order.
        assert_eq!(b.offer(6, KEY, 4, 3, 4), Ordered::Held);
        assert_eq!(delivered(b.offer(7, KEY, 3, 2, 3)), [3, 4]);
        assert_eq!(
            b.offer(8, KEY, 2, 1, 2),
            Ordered::Late(2),
            "never delivered twice"
        );
    }

    #[test]
    fn forgetting_a_target_gives_back_what_it_held() {
        let mut w = CommandOrder::default();
        w.offer(0, KEY, 1, 0, 1);
        w.offer(0, KEY, 3, 2, 3);
        let other = StreamKey { origin: 3, ..KEY };
        w.offer(0, other, 9, 8, 9);
        assert_eq!(w.held(), 2);
        assert_eq!(w.forget(KEY.target), [3, 9]);
        assert_eq!((w.streams(), w.held()), (0, 0));
        assert_eq!(w.next_due(|_| false), None);
    }

    #[test]
    fn idle_streams_are_pruned_after_the_origin_forgot_them() {
        let mut w = CommandOrder::<u64>::default();
        w.offer(0, KEY, 1, 0, 1);
        w.prune(WRITER_STREAM_IDLE_MS - 1);
        assert_eq!(w.streams(), 1);
        w.prune(WRITER_STREAM_IDLE_MS);
        assert_eq!(w.streams(), 0);
    }

    #[test]
    fn replies_are_owed_once() {
        let mut r = Replies::default();
        let reply = Reply {
            origin: 2,
            incarnation: 1,
            request_id: 9,
            target: 7,
            deadline_ms: 100,
        };
        let a = r.open(reply.clone());
        let b = r.open(reply.clone());
        assert_ne!(a, b, "two origins' equal request ids get distinct handles");
        assert_eq!(r.take(a), Some(reply));
        assert_eq!(r.take(a), None);
        assert_eq!(r.expire(100), 1);
        assert!(r.is_empty());
    }
}
