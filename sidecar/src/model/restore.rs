//! Restoring the world of a dead process: which state of each of its entities comes back,
//! under which epoch, and on which node.
//!
//! The candidates are the dead process's checkpoints and the offers live nodes made to it (in
//! doubt, or acked so lately that its checkpoint may predate them). An entity that a live node
//! writes or is adopting stays where it is. Otherwise the newest state wins (by epoch; on a tie
//! the checkpoint, which the dead node took after adopting that epoch), and it is offered to
//! the node owning its position, under an epoch [`EPOCH_GAP`] above every candidate's: anything
//! the dead process still sends is fenced out, and no two candidates can both be adopted.
//!
//! Pure: the caller gathers the reports and checkpoints and sends the offers.

use std::collections::{BTreeMap, BTreeSet};

use cellmesh_proto::mesh::HandoffOffer;
use cellmesh_world::partition::NodeId;

use super::handoff::{EntityId, Epoch};

/// How far above the newest known epoch a restored entity starts. The dead process (or others
/// that died with it) may have handed the entity on since the state a restore knows of, each
/// handoff one epoch up; no entity is handed this many times between a checkpoint flush and a
/// death, so a restored owner never writes an epoch someone wrote before.
pub const EPOCH_GAP: Epoch = 1_000;

/// One entity to bring back.
#[derive(Debug, Clone, PartialEq)]
pub struct Restoration {
    /// The node to adopt it: the owner of its position.
    pub target: NodeId,
    /// The state to adopt, under its new epoch (`entity_epoch`), as a successor offer.
    pub offer: HandoffOffer,
    /// Nodes whose offer of it to the dead node is settled by this restoration.
    pub reporters: Vec<NodeId>,
}

/// What a round decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Decision {
    pub restore: Vec<Restoration>,
    /// Offers to the dead node whose unit a live node writes already: (reporter, entity,
    /// epoch, owner).
    pub settled: Vec<(NodeId, EntityId, Epoch, NodeId)>,
    /// Entities no live node owns the position of yet (target 0): offered once one does.
    pub homeless: Vec<Restoration>,
    /// Units whose position the node that offered them to the dead node owns now: (reporter,
    /// entity). It keeps writing them under the epoch it had (its offer counts as refused).
    pub returned: Vec<(NodeId, EntityId)>,
}

/// Decides a round. `held`: every entity a live node writes or is adopting, with that node and
/// the epoch; `offered`: (reporter, offer, still in doubt) of every offer made to the dead
/// node; `owner_of`: the live owner of an offer's position under the partition the restores are
/// made under.
pub fn decide(
    checkpoints: &[HandoffOffer],
    held: &BTreeMap<EntityId, (NodeId, Epoch)>,
    offered: &[(NodeId, HandoffOffer, bool)],
    owner_of: impl Fn(&HandoffOffer) -> Option<NodeId>,
) -> Decision {
    // Every candidate state of each entity: (the offer, from a checkpoint?, its reporter and
    // whether its unit is still frozen there).
    type Candidate<'a> = (&'a HandoffOffer, bool, Option<(NodeId, bool)>);
    let mut by_id: BTreeMap<EntityId, Vec<Candidate>> = BTreeMap::new();
    for c in checkpoints {
        by_id.entry(c.entity_id).or_default().push((c, true, None));
    }
    for (n, o, in_doubt) in offered {
        by_id
            .entry(o.entity_id)
            .or_default()
            .push((o, false, Some((*n, *in_doubt))));
    }
    // Roots of offers first: a unit's attachments then follow their root.
    let offered_roots: BTreeSet<EntityId> = offered.iter().map(|(_, o, _)| o.entity_id).collect();
    let order = offered_roots.iter().copied().chain(
        by_id
            .keys()
            .copied()
            .filter(|id| !offered_roots.contains(id)),
    );
    let mut d = Decision::default();
    // Entities covered by a unit that wins (its attachments come with it).
    let mut covered: BTreeSet<EntityId> = BTreeSet::new();
    for id in order {
        if !covered.insert(id) {
            continue;
        }
        let candidates = &by_id[&id];
        let reporters: Vec<NodeId> = candidates.iter().filter_map(|c| Some(c.2?.0)).collect();
        let top = candidates
            .iter()
            .map(|c| c.0.entity_epoch)
            .max()
            .unwrap_or(0);
        // A live holder under an epoch below the dead node's was outrun: it handed the entity on
        // (to the dead node, by the newer epoch) since.
        if let Some(&(owner, epoch)) = held.get(&id).filter(|(_, e)| *e >= top) {
            for r in reporters {
                d.settled.push((r, id, epoch, owner));
            }
            continue;
        }
        // The newest state; a checkpoint wins a tie (taken after adopting that epoch).
        let Some(&(best, _, _)) = candidates.iter().max_by_key(|c| (c.0.entity_epoch, c.1)) else {
            continue;
        };
        let target = owner_of(best);
        let frozen_there = |t: NodeId| candidates.iter().any(|c| c.2 == Some((t, true)));
        if let Some(target) = target.filter(|t| frozen_there(*t)) {
            // Still frozen there: thawing it is the restore.
            d.returned.push((target, id));
            for r in reporters.iter().filter(|r| **r != target) {
                d.settled.push((*r, id, 0, target));
            }
            continue;
        }
        let mut offer = best.clone();
        offer.entity_epoch = top + EPOCH_GAP;
        offer.successor = true;
        covered.extend(offer.attachments.iter().map(|a| a.entity_id));
        let r = Restoration {
            target: target.unwrap_or(0),
            offer,
            reporters,
        };
        match target {
            Some(_) => d.restore.push(r),
            None => d.homeless.push(r),
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_proto::mesh::{HandoffPart, MeshVec3};

    fn offer(id: EntityId, epoch: Epoch, x: f64, state: &str) -> HandoffOffer {
        HandoffOffer {
            entity_id: id,
            entity_epoch: epoch,
            position: Some(MeshVec3 { x, y: 0.0, z: 0.0 }),
            state: state.as_bytes().to_vec().into(),
            ..Default::default()
        }
    }

    fn by_x(o: &HandoffOffer) -> Option<NodeId> {
        let x = o.position.as_ref()?.x;
        Some(if x < 100.0 { 1 } else { 2 })
    }

    #[test]
    fn a_checkpoint_comes_back_above_its_epoch_on_the_owner_of_its_position() {
        let d = decide(
            &[offer(10, 3, 50.0, "a"), offer(11, 1, 150.0, "b")],
            &BTreeMap::new(),
            &[],
            by_x,
        );
        assert_eq!(d.restore.len(), 2);
        assert_eq!(d.restore[0].target, 1);
        assert_eq!(d.restore[0].offer.entity_epoch, 3 + EPOCH_GAP);
        assert!(d.restore[0].offer.successor);
        assert_eq!(d.restore[1].target, 2);
        assert_eq!(d.restore[1].offer.entity_epoch, 1 + EPOCH_GAP);
    }

    #[test]
    fn what_a_live_node_writes_stays_and_settles_the_offers_made_of_it() {
        let held = BTreeMap::from([(10, (2, 5))]);
        let d = decide(
            &[offer(10, 3, 50.0, "a")],
            &held,
            &[(3, offer(10, 5, 50.0, "s"), true)],
            by_x,
        );
        assert!(d.restore.is_empty());
        assert_eq!(d.settled, vec![(3, 10, 5, 2)]);
    }

    #[test]
    fn a_holder_the_dead_node_outran_holds_nothing_any_more() {
        // Node 2 was reported holding it under epoch 2 (by a source that handed it there),
        // then handed it to the dead node under epoch 3.
        let held = BTreeMap::from([(10, (2, 2))]);
        let d = decide(&[], &held, &[(2, offer(10, 3, 150.0, "s"), false)], by_x);
        assert_eq!(d.restore.len(), 1);
        assert_eq!(d.restore[0].offer.entity_epoch, 3 + EPOCH_GAP);
    }

    #[test]
    fn an_offer_newer_than_the_checkpoint_wins_and_a_tie_goes_to_the_checkpoint() {
        // The dead node never checkpointed epoch 4: the reporter's snapshot is newer.
        let d = decide(
            &[offer(10, 3, 50.0, "old")],
            &BTreeMap::new(),
            &[(3, offer(10, 4, 150.0, "new"), true)],
            by_x,
        );
        assert_eq!(d.restore.len(), 1);
        let r = &d.restore[0];
        assert_eq!(
            (r.target, r.offer.entity_epoch, r.reporters.clone()),
            (2, 4 + EPOCH_GAP, vec![3])
        );
        assert_eq!(&r.offer.state[..], b"new");
        // It adopted epoch 4 and checkpointed after: the checkpoint is newer.
        let d = decide(
            &[offer(10, 4, 50.0, "ckpt")],
            &BTreeMap::new(),
            &[(3, offer(10, 4, 150.0, "snap"), false)],
            by_x,
        );
        assert_eq!(&d.restore[0].offer.state[..], b"ckpt");
        assert_eq!(d.restore[0].offer.entity_epoch, 4 + EPOCH_GAP);
    }

    #[test]
    fn a_unit_brings_its_attachments_and_their_own_checkpoints_are_not_restored_twice() {
        let mut unit = offer(10, 4, 50.0, "root");
        unit.attachments.push(HandoffPart {
            entity_id: 12,
            ..Default::default()
        });
        let d = decide(
            &[offer(12, 2, 50.0, "att")],
            &BTreeMap::new(),
            &[(3, unit, true)],
            by_x,
        );
        assert_eq!(d.restore.len(), 1);
        assert_eq!(d.restore[0].offer.entity_id, 10);
    }

    #[test]
    fn a_unit_whose_source_owns_its_position_now_goes_back_to_it() {
        let d = decide(
            &[],
            &BTreeMap::new(),
            &[(1, offer(10, 4, 50.0, "snap"), true)],
            by_x,
        );
        assert!(d.restore.is_empty());
        assert_eq!(d.returned, vec![(1, 10)]);
        // Acked long ago, the source holds nothing: it adopts like any owner.
        let d = decide(
            &[],
            &BTreeMap::new(),
            &[(1, offer(10, 4, 50.0, "snap"), false)],
            by_x,
        );
        assert_eq!(d.restore.len(), 1);
        assert_eq!(d.restore[0].target, 1);
    }

    #[test]
    fn nothing_is_offered_where_no_live_node_owns_the_position() {
        let d = decide(&[offer(10, 3, 50.0, "a")], &BTreeMap::new(), &[], |_| None);
        assert!(d.restore.is_empty());
        assert_eq!(d.homeless.len(), 1);
        assert_eq!(d.homeless[0].offer.entity_epoch, 3 + EPOCH_GAP);
    }
}
