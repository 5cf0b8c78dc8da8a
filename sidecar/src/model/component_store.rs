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
use smallvec::SmallVec;

/// Components kept inside the entity before the store spills to the heap.
const INLINE: usize = 1;

#[derive(Debug, Clone, PartialEq)]
pub struct InlineStore<K, V>(SmallVec<[(K, V); INLINE]>);

impl<K, V> Default for InlineStore<K, V> {
    fn default() -> Self {
        Self(SmallVec::new())
    }
}

impl<K, V> InlineStore<K, V> {
    /// The store of `v`, which must be sorted by key without repeats.
    pub fn from_sorted(v: Vec<(K, V)>) -> Self {
        Self(SmallVec::from_vec(v))
    }
}

impl<K, V> Store<K, V> for InlineStore<K, V> {
    fn lm_len(&self) -> usize {
        self.0.len()
    }

    fn lm_get(&self, index: usize) -> Option<(&K, &V)> {
        self.0.get(index).map(|(k, v)| (k, v))
    }

    fn lm_binary_search_by<F>(&self, mut cmp: F) -> Result<usize, usize>
    where
        F: FnMut(&K) -> Ordering,
    {
        self.0.binary_search_by(|(k, _)| cmp(k))
    }
}

impl<K, V> StoreSlice<K, V> for InlineStore<K, V> {
    type Slice = [(K, V)];

    fn lm_get_range(&self, range: Range<usize>) -> Option<&Self::Slice> {
        self.0.get(range)
    }
}

impl<K, V> StoreMut<K, V> for InlineStore<K, V> {
    fn lm_with_capacity(capacity: usize) -> Self {
        Self(SmallVec::with_capacity(capacity))
    }

    fn lm_reserve(&mut self, additional: usize) {
        self.0.reserve(additional)
    }

    fn lm_get_mut(&mut self, index: usize) -> Option<(&K, &mut V)> {
        self.0.get_mut(index).map(|(k, v)| (&*k, v))
    }

    fn lm_push(&mut self, key: K, value: V) {
        self.0.push((key, value))
    }

    fn lm_insert(&mut self, index: usize, key: K, value: V) {
        self.0.insert(index, (key, value))
    }

    fn lm_remove(&mut self, index: usize) -> (K, V) {
        self.0.remove(index)
    }

    fn lm_clear(&mut self) {
        self.0.clear()
    }
}

impl<K: Ord, V> StoreBulkMut<K, V> for InlineStore<K, V> {
    fn lm_retain<F>(&mut self, mut predicate: F)
    where
        F: FnMut(&K, &V) -> bool,
    {
        self.0.retain(|(k, v)| predicate(k, v))
    }

    fn lm_extend<I>(&mut self, other: I)
    where
        I: IntoIterator<Item = (K, V)>,
    {
        // Inserting one by one keeps the order and lets a later value of a key win; an
        // entity's components are few.
        for (k, v) in other {
            match self.0.binary_search_by(|(x, _)| x.cmp(&k)) {
                Ok(i) => self.0[i].1 = v,
                Err(i) => self.0.insert(i, (k, v)),
            }
        }
    }
}

impl<'a, K: 'a, V: 'a> StoreIterable<'a, K, V> for InlineStore<K, V> {
    type KeyValueIter = std::iter::Map<std::slice::Iter<'a, (K, V)>, fn(&(K, V)) -> (&K, &V)>;

    fn lm_iter(&'a self) -> Self::KeyValueIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl<'a, K: 'a, V: 'a> StoreIterableMut<'a, K, V> for InlineStore<K, V> {
    type KeyValueIterMut =
        std::iter::Map<std::slice::IterMut<'a, (K, V)>, fn(&mut (K, V)) -> (&K, &mut V)>;

    fn lm_iter_mut(&'a mut self) -> Self::KeyValueIterMut {
        self.0.iter_mut().map(|(k, v)| (&*k, v))
    }
}

impl<K, V> StoreIntoIterator<K, V> for InlineStore<K, V> {
    type KeyValueIntoIter = smallvec::IntoIter<[(K, V); INLINE]>;

    fn lm_into_iter(self) -> Self::KeyValueIntoIter {
        self.0.into_iter()
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
        Self(iter.into_iter().collect())
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
    fn a_single_component_needs_no_allocation_of_its_own() {
        let m: Map = [(1, "a")].into_iter().collect();
        let inline = m.iter().next().map(|(k, _)| k as *const u32 as usize);
        let at = &m as *const Map as usize;
        let within = inline.is_some_and(|p| p >= at && p < at + std::mem::size_of::<Map>());
        assert!(within, "the one entry lives inside the map");
    }
}
