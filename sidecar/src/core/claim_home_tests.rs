//! Claims across geos, between two cores of two geos wired back to back, each geo with its own
//! claim store, in virtual time: a key is granted by its home geo's store only, a node of the
//! other geo asks the home over the mesh, and with the home cut off the answer is a refusal,
//! never a second grant.

use cellmesh_proto::local::ClaimOutcome as Outcome;

use super::pair_tests::{Pair, GEOS, LINK};
use super::*;

const TTL: u32 = 3_000;
const STEPS_PER_LEASE: usize = TTL as usize / 50;
/// Written by node 1 (geo `GEOS[0]`).
const HOLDER: u64 = 0x61;
/// Written by node 2 (geo `GEOS[1]`).
const RIVAL: u64 = 0x62;

/// A key whose home is `geo`.
fn key_homed_in(geo: &str) -> String {
    key_homed_in_from(geo, 0)
}

/// The first key from `trade:p{from}` on whose home is `geo`.
fn key_homed_in_from(geo: &str, from: usize) -> String {
    (from..)
        .map(|i| format!("trade:p{i}"))
        .find(|k| cellmesh_world::homes::home_geo(k, &GEOS) == Some(geo))
        .unwrap()
}

fn two_geos_with_entities() -> Pair {
    let mut p = Pair::in_two_geos();
    p.steps(2);
    p.spawn(1, HOLDER, 100.0);
    p.spawn(2, RIVAL, 400.0);
    p.steps(2);
    p
}

fn answer(p: &mut Pair, id: NodeId, request_id: u64) -> local::ClaimResult {
    let rs = p.node(id).claim_result_of(request_id);
    assert_eq!(rs.len(), 1, "one answer to claim {request_id}: {rs:?}");
    rs[0].clone()
}

fn outcome(r: &local::ClaimResult) -> Outcome {
    Outcome::try_from(r.outcome).unwrap()
}

/// Who holds `key` in node 2's geo's store now.
fn second_holder(p: &Pair, key: &str) -> Option<ClaimHolder> {
    p.second_store.clone().unwrap().holder(p.now, key)
}

#[test]
fn a_key_is_granted_by_its_home_geos_store_only_whichever_geo_asks() {
    let mut p = two_geos_with_entities();
    let far = key_homed_in(GEOS[1]);
    p.claim(1, &far, HOLDER, TTL, 1);
    p.step();
    let r = answer(&mut p, 1, 1);
    assert_eq!(outcome(&r), Outcome::ClaimGranted, "{r:?}");
    assert_eq!(second_holder(&p, &far).map(|h| h.entity), Some(HOLDER));
    assert_eq!(
        p.store_holder(&far),
        None,
        "the asking geo's store grants nothing"
    );
    assert_eq!(p.node(1).core.cx.metrics.claim_home_calls_for("asked"), 1);
    assert_eq!(p.node(2).core.cx.metrics.claim_home_calls_for("served"), 1);

    // The home geo's own entity is refused and told who holds it.
    p.claim(2, &far, RIVAL, TTL, 2);
    p.step();
    let r = answer(&mut p, 2, 2);
    assert_eq!((outcome(&r), r.held_by), (Outcome::ClaimHeld, HOLDER));

    // Renewals cross the mesh: the claim outlives several leases, and the rival is still refused.
    p.steps(3 * STEPS_PER_LEASE);
    assert!(
        p.node(1).claims_lost.is_empty(),
        "{:?}",
        p.node(1).claims_lost
    );
    assert!(p.node(1).core.claim_homes.asked() <= 1, "answers come back");
    p.claim(2, &far, RIVAL, TTL, 3);
    p.step();
    assert_eq!(answer(&mut p, 2, 3).held_by, HOLDER);

    // A key homed in node 1's geo is granted there, for node 2 as well.
    let near = key_homed_in(GEOS[0]);
    p.claim(2, &near, RIVAL, TTL, 4);
    p.step();
    assert_eq!(outcome(&answer(&mut p, 2, 4)), Outcome::ClaimGranted);
    assert_eq!(p.store_holder(&near).map(|h| h.entity), Some(RIVAL));
    assert_eq!(second_holder(&p, &near), None);

    // A release crosses too: the key is free for the home's entity.
    p.release_claim(1, &far);
    p.step();
    assert_eq!(second_holder(&p, &far), None);
    p.claim(2, &far, RIVAL, TTL, 5);
    p.step();
    assert_eq!(outcome(&answer(&mut p, 2, 5)), Outcome::ClaimGranted);
}

#[test]
fn with_the_home_geo_cut_off_a_claim_is_refused_and_a_held_one_lapses_before_another_grant() {
    let mut p = two_geos_with_entities();
    let far = key_homed_in(GEOS[1]);
    p.claim(1, &far, HOLDER, TTL, 1);
    p.step();
    assert_eq!(outcome(&answer(&mut p, 1, 1)), Outcome::ClaimGranted);

    p.cut();
    let other = (1..)
        .map(|from| key_homed_in_from(GEOS[1], from))
        .find(|k| *k != far)
        .unwrap();
    p.claim(1, &other, HOLDER, TTL, 2);
    p.step();
    let r = answer(&mut p, 1, 2);
    assert_eq!(outcome(&r), Outcome::ClaimFailed, "{r:?}");
    assert!(r.detail.contains("home geo montreal unreachable"), "{r:?}");
    assert!(
        p.node(1)
            .core
            .cx
            .metrics
            .claim_home_calls_for("home_unreachable")
            >= 1
    );
    assert_eq!(
        p.store_holder(&other),
        None,
        "never granted by another geo's store"
    );

    // Node 1 cannot renew: its claim is lost at its own end of the lease, before the home's
    // store lets anyone else have it. At no step do both believe they hold it.
    let mut lost_at = None;
    let mut granted_at = None;
    for step in 0..2 * STEPS_PER_LEASE {
        p.claim(2, &far, RIVAL, TTL, 100 + step as u64);
        p.step();
        if lost_at.is_none() && !p.node(1).claims_lost.is_empty() {
            lost_at = Some(p.now);
        }
        let rs = p.node(2).claim_result_of(100 + step as u64);
        if granted_at.is_none() && rs.iter().any(|r| outcome(r) == Outcome::ClaimGranted) {
            granted_at = Some(p.now);
        }
        let node1_holds = p.node(1).core.claims.get(&far).is_some();
        assert!(
            !(node1_holds && granted_at.is_some()),
            "two holders at {} ms",
            p.now
        );
        if granted_at.is_some() {
            break;
        }
    }
    let (lost, granted) = (
        lost_at.expect("node 1 lost it"),
        granted_at.expect("then granted"),
    );
    assert!(
        lost < granted,
        "lost at {lost} ms, granted again at {granted} ms"
    );
}

#[test]
fn a_call_under_way_when_the_link_drops_fails_and_the_late_answer_is_not_sent() {
    let mut p = two_geos_with_entities();
    let far = key_homed_in(GEOS[1]);
    p.slow_store();
    p.claim(1, &far, HOLDER, TTL, 1);
    p.step();
    assert!(
        p.node(1).claim_result_of(1).is_empty(),
        "waits for the home"
    );
    p.cut();
    p.carry();
    let r = answer(&mut p, 1, 1);
    assert_eq!(outcome(&r), Outcome::ClaimFailed, "{r:?}");
    assert!(r.detail.contains("home unreachable"), "{r:?}");
    // The home's store runs the call late: its answer has no link to go on.
    p.answer_store();
    let answered = p
        .node(2)
        .core
        .cx
        .out
        .to_links
        .get(&LINK)
        .is_some_and(|q| !q.is_empty());
    assert!(!answered);
    assert_eq!(p.node(1).claim_result_of(1).len(), 1, "one answer only");
    // The grant nobody heard of lapses in the home's store.
    assert_eq!(second_holder(&p, &far).map(|h| h.entity), Some(HOLDER));
    p.steps(STEPS_PER_LEASE + 1);
    assert_eq!(second_holder(&p, &far), None);
}

#[test]
fn a_node_refuses_a_call_for_a_key_whose_home_is_not_its_geo() {
    let mut p = two_geos_with_entities();
    let near = key_homed_in(GEOS[0]);
    // Node 1 sent node 2 a call for a key homed in node 1's own geo (a node with another list of
    // geos would): node 2 refuses it and asks its store nothing.
    let asked_before = p.node(2).store_asked.len();
    let now = pair_tests::at(p.now);
    p.node(2).core.handle(
        now,
        Input::LinkFrame {
            link: LINK,
            messages: vec![mesh_message::Body::ClaimCall(mesh::ClaimCall {
                call: 7,
                op: Some(mesh::claim_call::Op::Claim(mesh::ClaimAsk {
                    key: near.clone(),
                    holder_entity: HOLDER,
                    entity_epoch: 1,
                    ttl_ms: TTL,
                })),
            })
            .into()],
        },
    );
    let mut answers = Vec::new();
    while let Some(out) = p.node(2).core.poll_output() {
        if let Output::ToLink { frame, .. } = out {
            answers.extend(frame.messages.into_iter().filter_map(|m| match m.body {
                Some(mesh_message::Body::ClaimAnswer(a)) => Some(a),
                _ => None,
            }));
        }
    }
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].call, 7);
    assert!(
        answers[0].results[0].error.contains("not the home"),
        "{answers:?}"
    );
    assert_eq!(p.node(2).store_asked.len(), asked_before);
    assert_eq!(
        p.node(2).core.cx.metrics.claim_home_calls_for("not_home"),
        1
    );
    assert_eq!(second_holder(&p, &near), None);
}
