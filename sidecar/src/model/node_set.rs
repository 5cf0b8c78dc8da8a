//! A small sorted set of node ids, inline up to three. An owner keeps one for every entity it
//! replicates (the nodes holding its render ghost), and most are held by one or two nodes: a
//! tree set would cost each a node allocation of 64 bytes and a table slot three times this.

use cellmesh_world::partition::NodeId;

/// Ids inline before the set moves to the heap.
const INLINE: usize = 3;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSet(Repr);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Repr {
    /// The first `len` ids, sorted.
    Inline { len: u8, ids: [NodeId; INLINE] },
    /// More than fit inline, sorted. Boxed: a thin pointer keeps the set at 16 bytes, and
    /// sets this large are rare.
    #[allow(clippy::box_collection)]
    Spilled(Box<Vec<NodeId>>),
}

impl Default for NodeSet {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl NodeSet {
    pub const EMPTY: NodeSet = NodeSet(Repr::Inline {
        len: 0,
        ids: [0; INLINE],
    });

    pub fn new() -> Self {
        Self::EMPTY
    }

    fn as_slice(&self) -> &[NodeId] {
        match &self.0 {
            Repr::Inline { len, ids } => &ids[..usize::from(*len)],
            Repr::Spilled(v) => v,
        }
    }

    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    pub fn contains(&self, node: &NodeId) -> bool {
        self.as_slice().binary_search(node).is_ok()
    }

    /// The ids in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.as_slice().iter().copied()
    }

    /// Adds `node`; false if it was there already.
    pub fn insert(&mut self, node: NodeId) -> bool {
        let Err(at) = self.as_slice().binary_search(&node) else {
            return false;
        };
        match &mut self.0 {
            Repr::Inline { len, ids } if usize::from(*len) < INLINE => {
                let n = usize::from(*len);
                ids.copy_within(at..n, at + 1);
                ids[at] = node;
                *len += 1;
            }
            Repr::Inline { ids, .. } => {
                let mut v = Vec::with_capacity(INLINE * 2);
                v.extend_from_slice(ids);
                v.insert(at, node);
                self.0 = Repr::Spilled(Box::new(v));
            }
            Repr::Spilled(v) => v.insert(at, node),
        }
        true
    }

    /// Removes `node`; false if it was not there.
    pub fn remove(&mut self, node: &NodeId) -> bool {
        let Ok(at) = self.as_slice().binary_search(node) else {
            return false;
        };
        match &mut self.0 {
            Repr::Inline { len, ids } => {
                let n = usize::from(*len);
                ids.copy_within(at + 1..n, at);
                *len -= 1;
                ids[usize::from(*len)] = 0;
            }
            Repr::Spilled(v) => {
                v.remove(at);
                if v.len() <= INLINE {
                    let mut ids = [0; INLINE];
                    ids[..v.len()].copy_from_slice(v);
                    self.0 = Repr::Inline {
                        len: v.len() as u8,
                        ids,
                    };
                }
            }
        }
        true
    }
}

impl Extend<NodeId> for NodeSet {
    fn extend<I: IntoIterator<Item = NodeId>>(&mut self, iter: I) {
        for n in iter {
            self.insert(n);
        }
    }
}

impl FromIterator<NodeId> for NodeSet {
    fn from_iter<I: IntoIterator<Item = NodeId>>(iter: I) -> Self {
        let mut s = Self::new();
        s.extend(iter);
        s
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn sixteen_bytes() {
        assert_eq!(std::mem::size_of::<NodeSet>(), 16);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(NodeId),
        Remove(NodeId),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u32..8).prop_map(Op::Insert),
            (0u32..8).prop_map(Op::Remove)
        ]
    }

    proptest! {
        /// Every step answers and holds what a tree set does, through spills and back.
        #[test]
        fn behaves_as_a_tree_set(ops in prop::collection::vec(op(), 0..64)) {
            let (mut s, mut model) = (NodeSet::new(), BTreeSet::new());
            for op in ops {
                match op {
                    Op::Insert(n) => prop_assert_eq!(s.insert(n), model.insert(n)),
                    Op::Remove(n) => prop_assert_eq!(s.remove(&n), model.remove(&n)),
                }
                prop_assert_eq!(s.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
                prop_assert_eq!(s.len(), model.len());
                for n in 0..8 {
                    prop_assert_eq!(s.contains(&n), model.contains(&n));
                }
                // Equal sets compare equal however they were built.
                prop_assert_eq!(&s, &model.iter().copied().collect::<NodeSet>());
            }
        }
    }
}
