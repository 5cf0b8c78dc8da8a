//! The core's timers as data: each is a key with one due time, re-armed or disarmed by the
//! decision that owns it; [`Timers::expired`] says which are due. No clock: the due times are the
//! core's milliseconds.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;

/// Armed timers by key. Re-arming a key replaces its due time; the heap keeps stale entries
/// until they surface, and skips them then.
#[derive(Debug)]
pub struct Timers<K: Ord + Hash + Copy> {
    heap: BinaryHeap<Reverse<(u64, K)>>,
    armed: HashMap<K, u64>,
}

impl<K: Ord + Hash + Copy> Default for Timers<K> {
    fn default() -> Self {
        Self {
            heap: BinaryHeap::new(),
            armed: HashMap::new(),
        }
    }
}

impl<K: Ord + Hash + Copy> Timers<K> {
    /// Arms `key` for `due_ms`, replacing any earlier due time.
    pub fn arm(&mut self, key: K, due_ms: u64) {
        if self.armed.insert(key, due_ms) != Some(due_ms) {
            self.heap.push(Reverse((due_ms, key)));
        }
    }

    pub fn disarm(&mut self, key: K) {
        self.armed.remove(&key);
    }

    /// When `key` is due, if it is armed.
    pub fn due(&self, key: K) -> Option<u64> {
        self.armed.get(&key).copied()
    }

    /// The earliest due time of any armed timer.
    pub fn next_due(&mut self) -> Option<u64> {
        while let Some(Reverse((due, key))) = self.heap.peek().copied() {
            if self.armed.get(&key) == Some(&due) {
                return Some(due);
            }
            self.heap.pop();
        }
        None
    }

    /// The timers due at `now_ms`, earliest first; each is disarmed.
    pub fn expired(&mut self, now_ms: u64) -> Vec<K> {
        let mut due = Vec::new();
        while let Some(Reverse((at, key))) = self.heap.peek().copied() {
            if at > now_ms {
                break;
            }
            self.heap.pop();
            if self.armed.get(&key) == Some(&at) {
                self.armed.remove(&key);
                due.push(key);
            }
        }
        due
    }

    /// How many timers are armed.
    pub fn armed(&self) -> usize {
        self.armed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rearmed_or_disarmed_timer_fires_at_its_last_due_time_or_never() {
        let mut t = Timers::default();
        t.arm('a', 100);
        t.arm('b', 50);
        t.arm('a', 30);
        t.arm('c', 70);
        t.disarm('c');
        assert_eq!(t.next_due(), Some(30));
        assert_eq!(t.expired(29), Vec::<char>::new());
        assert_eq!(t.expired(60), vec!['a', 'b']);
        assert_eq!(
            t.next_due(),
            None,
            "the stale 100 of `a` and the disarmed `c` are gone"
        );
        assert_eq!(t.expired(1_000), Vec::<char>::new());
        t.arm('a', 5);
        t.arm('a', 5);
        assert_eq!(t.armed(), 1);
        assert_eq!(t.expired(5), vec!['a']);
    }
}
