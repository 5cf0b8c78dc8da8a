//! The order of a player's inputs at the node that writes its master.
//!
//! Right after a handoff a player's inputs reach the new owner by two ways: the late ones the
//! old owner forwards, and the new ones the gateway sends directly once it hears of the new
//! owner. Over links of different lengths (two datacenters) a newer input can overtake an
//! older one. For a short window after an adoption the owner therefore holds an input that
//! leaves a gap in the sequence until the gap fills or the window ends, and hands the game each
//! session's inputs in sequence order. An input older than one already delivered is late: the
//! caller counts it instead of delivering it out of order.
//!
//! Pure: the caller passes the time.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;

/// One account's inputs as this node delivered them.
#[derive(Debug)]
struct Account<I> {
    session_epoch: u64,
    /// The last sequence number delivered (0: none yet).
    last: u64,
    /// Gaps are waited for until this time (monotonic ms).
    window_until: u64,
    pending: BTreeMap<u64, I>,
}

impl<I> Account<I> {
    fn new(session_epoch: u64, window_until: u64) -> Self {
        Self {
            session_epoch,
            last: 0,
            window_until,
            pending: BTreeMap::new(),
        }
    }
}

/// What to do with an input.
#[derive(Debug, PartialEq, Eq)]
pub enum Ordered<I> {
    /// Hand these to the game now, in this order.
    Deliver(Vec<I>),
    /// Held until the gap before it fills or the window ends.
    Held,
    /// Older than one already delivered: not delivered (the caller counts it).
    Late(I),
}

#[derive(Debug)]
pub struct InputOrder<I> {
    accounts: HashMap<String, Account<I>>,
    /// Inputs still held for an older session when a newer one began: not delivered, and
    /// handed back by [`Self::take_superseded`] so the caller counts them.
    superseded: Vec<I>,
}

impl<I> Default for InputOrder<I> {
    fn default() -> Self {
        Self {
            accounts: HashMap::default(),
            superseded: Vec::new(),
        }
    }
}

impl<I> InputOrder<I> {
    /// The master of `account` was just adopted here: inputs may arrive out of order until
    /// `until_ms`.
    pub fn expect_reorder(&mut self, account: &str, until_ms: u64) {
        if let Some(a) = self.accounts.get_mut(account) {
            a.window_until = a.window_until.max(until_ms);
        } else {
            self.accounts
                .insert(account.to_string(), Account::new(0, until_ms));
        }
    }

    /// The last input delivered for `account`: (session epoch, sequence number).
    pub fn last_of(&self, account: &str) -> Option<(u64, u64)> {
        self.accounts
            .get(account)
            .filter(|a| a.last != 0)
            .map(|a| (a.session_epoch, a.last))
    }

    /// The master of `account` was adopted here from a node that had delivered up to `last` of
    /// `session_epoch`: inputs may arrive out of order until `until_ms`.
    pub fn resume(&mut self, account: &str, session_epoch: u64, last: u64, until_ms: u64) {
        let a = self
            .accounts
            .entry(account.to_string())
            .or_insert_with(|| Account::new(session_epoch, 0));
        if session_epoch >= a.session_epoch {
            if session_epoch > a.session_epoch {
                a.pending.clear();
                a.last = 0;
            }
            a.session_epoch = session_epoch;
            a.last = a.last.max(last);
        }
        a.window_until = a.window_until.max(until_ms);
    }

    /// The game applied `account`'s inputs of `session_epoch` up to `last` only (it released the
    /// avatar, and drops what reaches it after): the ones after it are in order again.
    pub fn rewind(&mut self, account: &str, session_epoch: u64, last: u64) {
        if let Some(a) = self.accounts.get_mut(account) {
            if a.session_epoch == session_epoch && last < a.last {
                a.last = last;
            }
        }
    }

    /// Input `seq` of `account`'s session `session_epoch`, at `now_ms`.
    pub fn offer(
        &mut self,
        now_ms: u64,
        account: &str,
        session_epoch: u64,
        seq: u64,
        input: I,
    ) -> Ordered<I> {
        let a = self
            .accounts
            .entry(account.to_string())
            .or_insert_with(|| Account::new(session_epoch, 0));
        if session_epoch > a.session_epoch {
            // A new session numbers its inputs afresh; what the old one still held is counted.
            a.session_epoch = session_epoch;
            a.last = 0;
            self.superseded
                .extend(std::mem::take(&mut a.pending).into_values());
        }
        if session_epoch < a.session_epoch || (a.last != 0 && seq <= a.last) {
            return Ordered::Late(input);
        }
        let waiting = now_ms < a.window_until;
        if a.last != 0 && seq > a.last + 1 && waiting {
            a.pending.insert(seq, input);
            return Ordered::Held;
        }
        if !waiting && !a.pending.is_empty() {
            // The window ended before the timer let the held ones go: they still go first.
            a.pending.insert(seq, input);
            let pending = std::mem::take(&mut a.pending);
            a.last = pending.last_key_value().map_or(seq, |(s, _)| *s);
            return Ordered::Deliver(pending.into_values().collect());
        }
        a.last = seq;
        let mut out = vec![input];
        while let Some(next) = a.pending.remove(&(a.last + 1)) {
            a.last += 1;
            out.push(next);
        }
        Ordered::Deliver(out)
    }

    /// Inputs whose window ended, in order, per account.
    pub fn due(&mut self, now_ms: u64) -> Vec<I> {
        let mut out = Vec::new();
        for a in self.accounts.values_mut() {
            if now_ms >= a.window_until && !a.pending.is_empty() {
                let pending = std::mem::take(&mut a.pending);
                if let Some((&last, _)) = pending.last_key_value() {
                    a.last = last;
                }
                out.extend(pending.into_values());
            }
        }
        out
    }

    /// The next time a window ends with inputs held.
    pub fn next_due(&self) -> Option<u64> {
        self.accounts
            .values()
            .filter(|a| !a.pending.is_empty())
            .map(|a| a.window_until)
            .min()
    }

    /// The account's session ended here: nothing of it is kept.
    pub fn forget(&mut self, account: &str) -> Vec<I> {
        self.accounts
            .remove(account)
            .map(|a| a.pending.into_values().collect())
            .unwrap_or_default()
    }

    /// Inputs a newer session's first input superseded while they were held (see `offer`).
    pub fn take_superseded(&mut self) -> Vec<I> {
        std::mem::take(&mut self.superseded)
    }

    pub fn held(&self) -> usize {
        self.accounts.values().map(|a| a.pending.len()).sum()
    }

    /// The inputs held, account by account.
    pub fn pending(&self) -> impl Iterator<Item = &I> {
        self.accounts.values().flat_map(|a| a.pending.values())
    }
}

/// Inputs kept per account after they were handed to the game, at most this many.
pub const RECENT_INPUTS: usize = 64;

/// The inputs lately handed to the game, account by account. A game that releases a player's
/// avatar names the last input it applied and drops what reaches the avatar after: the inputs
/// after the one named are taken from here and handed on. Only the newest [`RECENT_INPUTS`] of
/// an account are kept; a release naming an older one finds some gone and says how many.
#[derive(Debug)]
pub struct RecentInputs<I> {
    accounts: HashMap<String, Recent<I>>,
}

#[derive(Debug)]
struct Recent<I> {
    session_epoch: u64,
    /// (sequence number, input), oldest first.
    inputs: std::collections::VecDeque<(u64, I)>,
    /// The newest sequence number of `session_epoch` no longer kept (0: none).
    dropped_up_to: u64,
}

/// The inputs a release hands on.
#[derive(Debug, PartialEq, Eq)]
pub struct HandedOn<I> {
    /// Kept inputs after the one the game named, in the order they were handed to it.
    pub inputs: Vec<I>,
    /// Inputs after the one named that are no longer kept (an upper bound: the session's
    /// sequence numbers may have gaps).
    pub missing: u64,
}

impl<I> Default for RecentInputs<I> {
    fn default() -> Self {
        Self {
            accounts: HashMap::default(),
        }
    }
}

impl<I> RecentInputs<I> {
    /// Input `seq` of `account`'s session `session_epoch` was handed to the game.
    pub fn delivered(&mut self, account: &str, session_epoch: u64, seq: u64, input: I) {
        let r = match self.accounts.get_mut(account) {
            Some(r) => r,
            None => self
                .accounts
                .entry(account.to_string())
                .or_insert_with(|| Recent {
                    session_epoch,
                    inputs: Default::default(),
                    dropped_up_to: 0,
                }),
        };
        if session_epoch != r.session_epoch {
            if session_epoch < r.session_epoch {
                return;
            }
            r.session_epoch = session_epoch;
            r.inputs.clear();
            r.dropped_up_to = 0;
        }
        if r.inputs.len() == RECENT_INPUTS {
            if let Some((old, _)) = r.inputs.pop_front() {
                r.dropped_up_to = r.dropped_up_to.max(old);
            }
        }
        r.inputs.push_back((seq, input));
    }

    /// The game released `account`'s avatar having applied its inputs of `session_epoch` up to
    /// `last`: the ones handed to it after, which it drops. Nothing of the account is kept
    /// after (what is handed on is handed to the game again if the avatar stays).
    pub fn hand_on(&mut self, account: &str, session_epoch: u64, last: u64) -> HandedOn<I> {
        let Some(r) = self.accounts.remove(account) else {
            return HandedOn {
                inputs: Vec::new(),
                missing: 0,
            };
        };
        // Inputs of a newer session than the one the game named: none of them was applied.
        let last = if session_epoch == r.session_epoch {
            last
        } else if session_epoch < r.session_epoch {
            0
        } else {
            // The game names a session newer than any input handed to it: nothing is owed.
            u64::MAX
        };
        HandedOn {
            missing: r.dropped_up_to.saturating_sub(last),
            inputs: r
                .inputs
                .into_iter()
                .filter(|(seq, _)| *seq > last)
                .map(|(_, i)| i)
                .collect(),
        }
    }

    /// The account's session ended here, or its avatar left: nothing of it is kept.
    pub fn forget(&mut self, account: &str) {
        self.accounts.remove(account);
    }

    /// Inputs kept, over all accounts.
    pub fn len(&self) -> usize {
        self.accounts.values().map(|r| r.inputs.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.accounts.values().all(|r| r.inputs.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_hands_on_the_inputs_after_the_last_one_applied() {
        let mut r = RecentInputs::default();
        for seq in 1..=5 {
            r.delivered("a", 2, seq, seq);
        }
        r.delivered("b", 1, 9, 9);
        let h = r.hand_on("a", 2, 3);
        assert_eq!((h.inputs, h.missing), (vec![4, 5], 0));
        // Taken: a second release (after a thaw) finds only what was delivered since.
        assert_eq!(r.hand_on("a", 2, 3).inputs, Vec::<u64>::new());
        assert_eq!(r.len(), 1, "another account's input stays");
    }

    #[test]
    fn a_release_naming_an_older_session_hands_on_all_of_the_current_one() {
        let mut r = RecentInputs::default();
        r.delivered("a", 1, 40, 40);
        r.delivered("a", 2, 1, 1);
        r.delivered("a", 2, 2, 2);
        // An input of the old session handed late is not kept.
        r.delivered("a", 1, 41, 41);
        let h = r.hand_on("a", 1, 40);
        assert_eq!((h.inputs, h.missing), (vec![1, 2], 0));
    }

    #[test]
    fn inputs_no_longer_kept_are_counted_as_missing() {
        let mut r = RecentInputs::default();
        let n = RECENT_INPUTS as u64 + 10;
        for seq in 1..=n {
            r.delivered("a", 1, seq, seq);
        }
        assert_eq!(r.len(), RECENT_INPUTS);
        // The game applied up to 5: 6..=10 were dropped from the ring, the rest are kept.
        let h = r.hand_on("a", 1, 5);
        assert_eq!(h.missing, 5);
        assert_eq!(h.inputs, (11..=n).collect::<Vec<_>>());
        // A game that applied past what was dropped misses nothing.
        for seq in 1..=n {
            r.delivered("a", 1, seq, seq);
        }
        let h = r.hand_on("a", 1, n - 1);
        assert_eq!((h.inputs, h.missing), (vec![n], 0));
    }

    #[test]
    fn a_rewind_lets_the_inputs_after_the_applied_one_through_again() {
        let mut o = InputOrder::default();
        for seq in 1..=5 {
            assert_eq!(delivered(o.offer(0, "a", 1, seq, seq)), [seq]);
        }
        o.rewind("a", 1, 3);
        assert_eq!(o.last_of("a"), Some((1, 3)));
        assert_eq!(delivered(o.offer(0, "a", 1, 4, 4)), [4]);
        // Another session's rewind changes nothing; neither does one forward.
        o.rewind("a", 2, 1);
        o.rewind("a", 1, 9);
        assert_eq!(o.last_of("a"), Some((1, 4)));
    }

    fn delivered(o: Ordered<u64>) -> Vec<u64> {
        match o {
            Ordered::Deliver(v) => v,
            other => panic!("expected a delivery, got {other:?}"),
        }
    }

    #[test]
    fn in_order_inputs_go_straight_through() {
        let mut o = InputOrder::default();
        assert_eq!(delivered(o.offer(0, "a", 1, 1, 1)), [1]);
        assert_eq!(delivered(o.offer(0, "a", 1, 2, 2)), [2]);
        // Outside a window a gap (an input dropped at the edge) costs nothing.
        assert_eq!(delivered(o.offer(0, "a", 1, 5, 5)), [5]);
        assert_eq!(o.offer(0, "a", 1, 4, 4), Ordered::Late(4));
    }

    #[test]
    fn an_input_after_the_window_follows_the_ones_held_for_it() {
        let mut o = InputOrder::default();
        o.resume("a", 1, 9, 500);
        // 10..=12 were lost with a link: 13 and 14 wait for them.
        assert_eq!(o.offer(100, "a", 1, 13, 13), Ordered::Held);
        assert_eq!(o.offer(200, "a", 1, 14, 14), Ordered::Held);
        // The window ended and 15 arrives before the timer fires: it does not overtake them.
        assert_eq!(delivered(o.offer(501, "a", 1, 15, 15)), [13, 14, 15]);
        assert!(o.due(600).is_empty());
        assert_eq!(o.offer(601, "a", 1, 14, 14), Ordered::Late(14));
    }

    #[test]
    fn after_an_adoption_a_gap_is_waited_for() {
        let mut o = InputOrder::default();
        assert_eq!(delivered(o.offer(0, "a", 1, 10, 10)), [10]);
        o.expect_reorder("a", 500);
        // 12 overtook 11 (a direct path shorter than the forwarded one).
        assert_eq!(o.offer(100, "a", 1, 12, 12), Ordered::Held);
        assert_eq!(o.offer(100, "a", 1, 13, 13), Ordered::Held);
        assert_eq!(o.next_due(), Some(500));
        assert_eq!(delivered(o.offer(120, "a", 1, 11, 11)), [11, 12, 13]);
        assert_eq!(o.held(), 0);
    }

    #[test]
    fn a_gap_that_never_fills_is_skipped_when_the_window_ends() {
        let mut o = InputOrder::default();
        assert_eq!(delivered(o.offer(0, "a", 1, 1, 1)), [1]);
        o.expect_reorder("a", 300);
        assert_eq!(o.offer(10, "a", 1, 3, 3), Ordered::Held);
        assert_eq!(o.offer(10, "a", 1, 4, 4), Ordered::Held);
        assert!(o.due(299).is_empty());
        assert_eq!(o.due(300), [3, 4]);
        assert_eq!(o.offer(310, "a", 1, 2, 2), Ordered::Late(2));
        assert_eq!(delivered(o.offer(310, "a", 1, 5, 5)), [5]);
    }

    #[test]
    fn a_new_session_starts_its_own_sequence() {
        let mut o = InputOrder::default();
        assert_eq!(delivered(o.offer(0, "a", 1, 40, 40)), [40]);
        assert_eq!(delivered(o.offer(0, "a", 2, 1, 1)), [1]);
        assert_eq!(o.offer(0, "a", 1, 41, 41), Ordered::Late(41));
        assert!(o.take_superseded().is_empty());
    }

    #[test]
    fn inputs_an_older_session_still_held_are_handed_back_when_a_newer_one_begins() {
        let mut o = InputOrder::default();
        assert_eq!(delivered(o.offer(0, "a", 1, 24, 24)), [24]);
        o.expect_reorder("a", 500);
        // 26 overtook 25, then the session was handed over: the new one's first input comes.
        assert_eq!(o.offer(10, "a", 1, 26, 26), Ordered::Held);
        assert_eq!(delivered(o.offer(20, "a", 2, 27, 27)), [27]);
        assert_eq!(o.take_superseded(), [26], "counted by the caller, not lost");
        assert_eq!(o.held(), 0);
        assert!(o.take_superseded().is_empty());
    }

    #[test]
    fn an_adoption_resumes_from_the_last_input_the_source_delivered() {
        let mut o = InputOrder::default();
        o.resume("a", 3, 20, 400);
        // 22 overtook 21, which the old owner forwards.
        assert_eq!(o.offer(10, "a", 3, 22, 22), Ordered::Held);
        assert_eq!(delivered(o.offer(50, "a", 3, 21, 21)), [21, 22]);
        assert_eq!(o.last_of("a"), Some((3, 22)));
        assert_eq!(o.offer(60, "a", 3, 20, 20), Ordered::Late(20));
    }

    #[test]
    fn the_first_input_after_an_adoption_is_delivered() {
        let mut o = InputOrder::default();
        o.expect_reorder("a", 500);
        assert_eq!(delivered(o.offer(0, "a", 1, 7, 7)), [7]);
        assert_eq!(o.offer(0, "a", 1, 9, 9), Ordered::Held);
        assert_eq!(o.forget("a"), [9]);
    }
}
