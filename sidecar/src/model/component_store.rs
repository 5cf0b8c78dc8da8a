//! Where an entity keeps its components: sorted by type, the first one inside the entity.
//!
//! Most entities, and nearly every render ghost, carry one component. Keeping it inline saves
//! the separate allocation a vector would make for it (its slot and the allocator's header,
//! some 80 bytes per entity); entities with more spill to the heap as a vector would.

use std::cmp::Ordering;
use std::ops::Range;

use litemap::store::{
    Store, StoreBulkMut, StoreFromIterable, StoreIntoIterator, StoreIterable, StoreIterableMut,
    StoreMut, StoreSlice,
};

/// The entries sorted by key without repeats: none, one inline, or more in a vector.
///
/// An enum rather than a small vector: the one inline entry's own spare values (its audience's
/// kind) tell the three apart, where a small vector keeps a word for its capacity beside it.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum InlineStore<K, V> {
    #[default]
    Empty,
    One((K, V)),
    /// Never fewer than two entries once a change settled.
    Many(Vec<(K, V)>),
}

impl<K, V> InlineStore<K, V> {
    /// The store of `v`, which must be sorted by key without repeats.
    pub fn from_sorted(mut v: Vec<(K, V)>) -> Self {
        match v.len() {
            0 => Self::Empty,
            1 => Self::One(v.pop().expect("one entry")),
            _ => Self::Many(v),
        }
    }

    fn as_slice(&self) -> &[(K, V)] {
        match self {
            Self::Empty => &[],
            Self::One(kv) => std::slice::from_ref(kv),
            Self::Many(v) => v,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [(K, V)] {
        match self {
            Self::Empty => &mut [],
            Self::One(kv) => std::slice::from_mut(kv),
            Self::Many(v) => v,
        }
    }

    /// The entries in a vector, to change their count.
    fn spill(&mut self) -> &mut Vec<(K, V)> {
        if !matches!(self, Self::Many(_)) {
            let v = match std::mem::take(self) {
                Self::One(kv) => vec![kv],
                _ => Vec::new(),
            };
            *self = Self::Many(v);
        }
        match self {
            Self::Many(v) => v,
            _ => unreachable!("spilled above"),
        }
    }

    /// Back inline once at most one entry is left, freeing the vector.
    fn settle(&mut self) {
        if let Self::Many(v) = self {
            if v.len() <= 1 {
                *self = Self::from_sorted(std::mem::take(v));
            }
        }
    }

    fn insert_at(&mut self, index: usize, key: K, value: V) {
        if matches!(self, Self::Empty) {
            *self = Self::One((key, value));
        } else {
            self.spill().insert(index, (key, value));
        }
    }
}

impl<K, V> Store<K, V> for InlineStore<K, V> {
    fn lm_len(&self) -> usize {
        self.as_slice().len()
    }

    fn lm_get(&self, index: usize) -> Option<(&K, &V)> {
        self.as_slice().get(index).map(|(k, v)| (k, v))
    }

    fn lm_binary_search_by<F>(&self, mut cmp: F) -> Result<usize, usize>
    where
        F: FnMut(&K) -> Ordering,
    {
        self.as_slice().binary_search_by(|(k, _)| cmp(k))
    }
}

impl<K, V> StoreSlice<K, V> for InlineStore<K, V> {
    type Slice = [(K, V)];

    fn lm_get_range(&self, range: Range<usize>) -> Option<&Self::Slice> {
        self.as_slice().get(range)
    }
}

impl<K, V> StoreMut<K, V> for InlineStore<K, V> {
    fn lm_with_capacity(capacity: usize) -> Self {
        if capacity <= 1 {
            Self::Empty
        } else {
            Self::Many(Vec::with_capacity(capacity))
        }
    }

    fn lm_reserve(&mut self, additional: usize) {
        if self.lm_len() + additional > 1 {
            self.spill().reserve(additional);
        }
    }

    fn lm_get_mut(&mut self, index: usize) -> Option<(&K, &mut V)> {
        self.as_mut_slice().get_mut(index).map(|(k, v)| (&*k, v))
    }

    fn lm_push(&mut self, key: K, value: V) {
        let at = self.lm_len();
        self.insert_at(at, key, value)
    }

    fn lm_insert(&mut self, index: usize, key: K, value: V) {
        self.insert_at(index, key, value)
    }

    fn lm_remove(&mut self, index: usize) -> (K, V) {
        let removed = match self {
            Self::One(_) if index == 0 => match std::mem::take(self) {
                Self::One(kv) => return kv,
                _ => unreachable!("matched above"),
            },
            Self::Many(v) => v.remove(index),
            _ => panic!("removal index (is {index}) should be < len"),
        };
        self.settle();
        removed
    }

    fn lm_clear(&mut self) {
        *self = Self::Empty;
    }
}

impl<K: Ord, V> StoreBulkMut<K, V> for InlineStore<K, V> {
    fn lm_retain<F>(&mut self, mut predicate: F)
    where
        F: FnMut(&K, &V) -> bool,
    {
        match self {
            Self::Empty => {}
            Self::One((k, v)) => {
                if !predicate(k, v) {
                    *self = Self::Empty;
                }
            }
            Self::Many(v) => {
                v.retain(|(k, v)| predicate(k, v));
                self.settle();
            }
        }
    }

    fn lm_extend<I>(&mut self, other: I)
    where
        I: IntoIterator<Item = (K, V)>,
    {
        // Inserting one by one keeps the order and lets a later value of a key win; an
        // entity's components are few.
        for (k, v) in other {
            match self.as_slice().binary_search_by(|(x, _)| x.cmp(&k)) {
                Ok(i) => self.as_mut_slice()[i].1 = v,
                Err(i) => self.insert_at(i, k, v),
            }
        }
    }
}

impl<'a, K: 'a, V: 'a> StoreIterable<'a, K, V> for InlineStore<K, V> {
    type KeyValueIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&(K, V)) -> (&K, &V)>;

    fn lm_iter(&'a self) -> Self::KeyValueIter {
        self.as_slice().iter().map(|(k, v)| (k, v))
    }
}

impl<'a, K: 'a, V: 'a> StoreIterableMut<'a, K, V> for InlineStore<K, V> {
    type KeyValueIterMut =
        std::iter::Map<std::slice::IterMut<'a, (K, V)>, fn(&mut (K, V)) -> (&K, &mut V)>;

    fn lm_iter_mut(&'a mut self) -> Self::KeyValueIterMut {
        self.as_mut_slice().iter_mut().map(|(k, v)| (&*k, v))
    }
}

impl<K, V> StoreIntoIterator<K, V> for InlineStore<K, V> {
    type KeyValueIntoIter =
        std::iter::Chain<std::option::IntoIter<(K, V)>, std::vec::IntoIter<(K, V)>>;

    fn lm_into_iter(self) -> Self::KeyValueIntoIter {
        let (one, many) = match self {
            Self::Empty => (None, Vec::new()),
            Self::One(kv) => (Some(kv), Vec::new()),
            Self::Many(v) => (None, v),
        };
        one.into_iter().chain(many)
    }
}

impl<K: Ord, V> StoreFromIterable<K, V> for InlineStore<K, V> {
    fn lm_sort_from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut store = Self::default();
        store.lm_extend(iter);
        store
    }
}

impl<K, V> FromIterator<(K, V)> for InlineStore<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        Self::from_sorted(iter.into_iter().collect())
    }
}

impl<K, V> litemap::store::StoreFromIterator<K, V> for InlineStore<K, V> {}

#[cfg(test)]
mod tests {
    use litemap::LiteMap;

    use super::*;

    type Map = LiteMap<u32, &'static str, InlineStore<u32, &'static str>>;

    #[test]
    fn one_entry_stays_inline_and_more_spill_in_order() {
        let mut m = Map::default();
        m.insert(5, "five");
        m.insert(2, "two");
        m.insert(9, "nine");
        m.insert(5, "FIVE");
        assert_eq!(
            m.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            [(2, "two"), (5, "FIVE"), (9, "nine")]
        );
        assert_eq!(m.remove(&2), Some("two"));
        m.retain(|k, _| *k != 9);
        assert_eq!(m.get(&5), Some(&"FIVE"));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn collecting_sorts_and_the_last_of_a_repeated_key_wins() {
        let m: Map = [(3, "a"), (1, "b"), (3, "c")].into_iter().collect();
        assert_eq!(
            m.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
            [(1, "b"), (3, "c")]
        );
    }

    #[test]
    fn removing_down_to_one_entry_frees_the_vector() {
        let mut s = InlineStore::from_sorted(vec![(1, "a"), (2, "b"), (3, "c")]);
        assert_eq!(s.lm_remove(0), (1, "a"));
        s.lm_retain(|k, _| *k != 3);
        assert_eq!(s, InlineStore::One((2, "b")));
        s.lm_insert(0, 1, "a");
        assert_eq!(s, InlineStore::Many(vec![(1, "a"), (2, "b")]));
    }

    #[test]
    fn a_single_component_needs_no_allocation_of_its_own() {
        let m: Map = [(1, "a")].into_iter().collect();
        let inline = m.iter().next().map(|(k, _)| k as *const u32 as usize);
        let at = &m as *const Map as usize;
        let within = inline.is_some_and(|p| p >= at && p < at + std::mem::size_of::<Map>());
        assert!(within, "the one entry lives inside the map");
    }
}
