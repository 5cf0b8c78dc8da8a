//! Exclusive claims between two cores wired back to back and one claim store, in virtual time:
//! races, handoffs, releases, an unreachable store and bad requests.

use std::time::Duration;

use cellmesh_proto::local::{self, game_message, ClaimOutcome as Outcome};

use super::pair_tests::{at, Pair};
use super::*;

const KEY: &str = "trade:ada";
/// A lease short enough to lapse within a test, long enough for a handoff.
const TTL: u32 = 3_000;
/// Steps of 50 ms in one lease.
const STEPS_PER_LEASE: usize = TTL as usize / 50;

/// Written by node 1, far from the border.
const HOLDER: u64 = 0x61;
/// Written by node 2, far from the border.
const RIVAL: u64 = 0x62;
/// Written by node 1, near the border: walks over to node 2.
const WALKER: u64 = 0x63;
/// Another of node 1's entities.
const OTHER: u64 = 0x64;

fn outcome(r: &local::ClaimResult) -> Outcome {
    Outcome::try_from(r.outcome).unwrap()
}

/// The one answer to `request_id` on node `id`.
fn answer(p: &mut Pair, id: NodeId, request_id: u64) -> local::ClaimResult {
    let rs = p.node(id).claim_result_of(request_id);
    assert_eq!(rs.len(), 1, "one answer to claim {request_id}: {rs:?}");
    rs[0].clone()
}

/// Claims `key` for `holder` on node `id` and expects it granted.
fn granted(p: &mut Pair, id: NodeId, key: &str, holder: u64, request_id: u64) -> u64 {
    p.claim(id, key, holder, TTL, request_id);
    p.step();
    let r = answer(p, id, request_id);
    assert_eq!(outcome(&r), Outcome::ClaimGranted, "{r:?}");
    assert_ne!(r.token, 0);
    r.token
}

/// Node 1 writes HOLDER and OTHER, node 2 writes RIVAL.
fn pair_with_entities() -> Pair {
    let mut p = Pair::new();
    p.steps(2);
    p.spawn(1, HOLDER, 100.0);
    p.spawn(1, OTHER, 120.0);
    p.spawn(2, RIVAL, 400.0);
    p.steps(2);
    p
}

fn holder(entity: u64, entity_epoch: u64) -> Option<ClaimHolder> {
    Some(ClaimHolder {
        entity,
        entity_epoch,
    })
}

fn despawn(p: &mut Pair, id: NodeId, entity: u64) {
    p.game_sends(
        id,
        game_message::Body::Despawn(local::Despawn { entity_id: entity }),
    );
}

#[test]
fn two_nodes_racing_for_a_key_get_one_grant_and_one_refusal_naming_the_winner() {
    let mut p = pair_with_entities();
    p.claim(1, KEY, HOLDER, TTL, 1);
    p.claim(2, KEY, RIVAL, TTL, 2);
    p.step();
    let (a, b) = (answer(&mut p, 1, 1), answer(&mut p, 2, 2));
    let grants = [&a, &b]
        .iter()
        .filter(|r| outcome(r) == Outcome::ClaimGranted)
        .count();
    assert_eq!(grants, 1, "exactly one grant: {a:?} {b:?}");
    let (won, lost) = if outcome(&a) == Outcome::ClaimGranted {
        ((1, a), (2, b))
    } else {
        ((2, b), (1, a))
    };
    assert_eq!(outcome(&lost.1), Outcome::ClaimHeld, "{:?}", lost.1);
    assert_eq!(
        lost.1.held_by, won.1.holder_entity,
        "the refusal names the winner"
    );
    assert_eq!(lost.1.token, 0);
    assert_eq!(
        p.store_holder(KEY).map(|h| h.entity),
        Some(won.1.holder_entity)
    );
    let m = &p.node(won.0).core.cx.metrics;
    assert_eq!((m.claims_for("granted"), m.claims_for("held")), (1, 0));
    assert_eq!(m.claims_held.get(), 1);
    let m = &p.node(lost.0).core.cx.metrics;
    assert_eq!((m.claims_for("granted"), m.claims_for("held")), (0, 1));
    assert_eq!(m.claims_held.get(), 0);
    assert!(p.node(lost.0).core.claims.is_empty());

    // Renewals keep the winner's claim past several leases: the loser is still refused.
    p.steps(3 * STEPS_PER_LEASE);
    let (loser, loser_entity) = (lost.0, lost.1.holder_entity);
    p.claim(loser, KEY, loser_entity, TTL, 3);
    p.step();
    let again = answer(&mut p, loser, 3);
    assert_eq!(outcome(&again), Outcome::ClaimHeld, "{again:?}");
    assert_eq!(again.held_by, won.1.holder_entity);
    assert!(p.node(won.0).claims_lost.is_empty());
}

#[test]
fn a_claim_follows_its_holder_through_a_handoff_and_fences_the_old_owner_out() {
    let mut p = pair_with_entities();
    p.spawn(1, WALKER, 200.0);
    p.steps(4);
    let token = granted(&mut p, 1, KEY, WALKER, 1);
    let old = p.node(1).core.claims.get(KEY).unwrap().grant.clone();
    assert_eq!(Some(old.holder), holder(WALKER, 1));

    p.move_to(1, WALKER, 330.0);
    p.steps(6);
    assert_eq!(
        p.node(2).entity(WALKER),
        Some((true, 2)),
        "node 2 writes it"
    );
    assert_eq!(
        p.store_holder(KEY),
        holder(WALKER, 2),
        "rebound under the new epoch"
    );
    let carried = p.node(2).core.claims.get(KEY).cloned().unwrap();
    assert_eq!((carried.grant.token, carried.rebinding), (token, None));
    assert_eq!(carried.grant.holder, holder(WALKER, 2).unwrap());
    assert_eq!(p.node(2).core.cx.metrics.claims_rebound.get(), 1);
    assert!(p.node(1).core.claims.get(KEY).is_none(), "node 1 let it go");
    assert!(p.node(1).claims_lost.is_empty() && p.node(2).claims_lost.is_empty());

    // What node 1 might still send under the old epoch is refused, and changes nothing.
    let now = p.now;
    let ttl = Duration::from_millis(u64::from(TTL));
    assert!(matches!(p.store.renew(now, &old, ttl), Ok(false)));
    assert!(matches!(p.store.release(now, &old), Ok(false)));
    assert_eq!(p.store_holder(KEY), holder(WALKER, 2));

    // A third racer is refused; node 2 keeps the claim alive past several leases.
    p.claim(1, KEY, OTHER, TTL, 2);
    p.step();
    let r = answer(&mut p, 1, 2);
    assert_eq!((outcome(&r), r.held_by), (Outcome::ClaimHeld, WALKER));
    p.steps(3 * STEPS_PER_LEASE);
    assert_eq!(p.store_holder(KEY), holder(WALKER, 2));
    assert!(p.node(2).claims_lost.is_empty());
}

/// A grant that comes once the holder's Freeze went out (its snapshot not back yet) is failed
/// and freed: the game hears of it only after the Freeze and has called off what it asked for,
/// so a claim carried by the handoff would be released by the old owner's game behind it.
#[test]
fn a_grant_that_comes_after_its_holders_freeze_is_failed_and_freed() {
    let mut p = pair_with_entities();
    p.spawn(1, WALKER, 200.0);
    p.steps(4);
    p.slow_store();
    p.claim(1, KEY, WALKER, TTL, 1);
    p.move_to(1, WALKER, 330.0);
    p.step();
    assert!(p.node(1).core.handoff.outgoing().is_frozen(WALKER));
    assert!(p.node(1).claim_result_of(1).is_empty(), "not answered yet");
    p.answer_store();
    let r = answer(&mut p, 1, 1);
    assert_eq!(outcome(&r), Outcome::ClaimFailed, "{r:?}");
    assert!(r.detail.contains("moved on"), "{}", r.detail);
    assert_eq!(p.store_holder(KEY), None, "the grant was freed");
    assert!(p.node(1).core.claims.is_empty());

    p.steps(6);
    assert_eq!(p.node(2).entity(WALKER), Some((true, 2)));
    assert!(
        p.node(2).core.claims.is_empty(),
        "the handoff carried no claim"
    );
    assert!(p.node(1).claims_lost.is_empty() && p.node(2).claims_lost.is_empty());
    assert!(p.node(1).errors.is_empty() && p.node(2).errors.is_empty());
    // The new owner's game asks again.
    granted(&mut p, 2, KEY, WALKER, 2);
    assert_eq!(p.store_holder(KEY), holder(WALKER, 2));
}

/// Past its snapshot the holder is the handoff's: a release from the old owner's game is refused
/// (it would free the claim under the next owner), and the claim arrives with the holder.
#[test]
fn a_release_after_the_holders_snapshot_is_refused_and_the_claim_goes_with_it() {
    let mut p = pair_with_entities();
    p.spawn(1, WALKER, 200.0);
    p.steps(4);
    granted(&mut p, 1, KEY, WALKER, 1);
    p.node(2).adopts = false;
    p.move_to(1, WALKER, 330.0);
    p.steps(3);
    assert!(p.node(1).core.handoff.outgoing().is_frozen(WALKER));
    assert!(
        !p.node(1).core.handoff.outgoing().writable(WALKER),
        "snapshot taken"
    );
    p.release_claim(1, KEY);
    p.step();
    let errors = &p.node(1).errors;
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(
        errors[0].code,
        local::ErrorCode::NotOwner as i32,
        "{errors:?}"
    );
    assert_eq!(p.store_holder(KEY).map(|h| h.entity), Some(WALKER));

    p.node(2).adopts = true;
    let epoch = p.node(2).core.handoff.adopting_epoch(WALKER).unwrap();
    p.game_sends(
        2,
        game_message::Body::Adopted(local::Adopted {
            entity_id: WALKER,
            entity_epoch: epoch,
        }),
    );
    p.steps(4);
    assert_eq!(p.node(2).entity(WALKER), Some((true, 2)));
    assert_eq!(p.store_holder(KEY), holder(WALKER, 2));
    assert!(p.node(2).core.claims.get(KEY).is_some());
    assert!(p.node(2).claims_lost.is_empty());
}

#[test]
fn despawning_the_holder_frees_the_key_for_another_entity() {
    let mut p = pair_with_entities();
    granted(&mut p, 1, KEY, HOLDER, 1);
    despawn(&mut p, 1, HOLDER);
    p.step();
    assert_eq!(p.store_holder(KEY), None);
    assert!(p.node(1).core.claims.is_empty());
    assert_eq!(p.node(1).core.cx.metrics.claims_released.get(), 1);
    granted(&mut p, 2, KEY, RIVAL, 2);

    // A holder that despawns while its claim is on its way: the grant is freed when it comes.
    p.claim(1, "quest:giver", OTHER, TTL, 3);
    despawn(&mut p, 1, OTHER);
    p.step();
    assert_eq!(outcome(&answer(&mut p, 1, 3)), Outcome::ClaimFailed);
    assert_eq!(p.store_holder("quest:giver"), None);
    assert!(p.node(1).core.claims.is_empty());
}

#[test]
fn a_release_frees_the_key_even_one_sent_before_the_grant() {
    let mut p = pair_with_entities();
    granted(&mut p, 1, KEY, HOLDER, 1);
    // A release naming another entity leaves the holder's claim alone.
    p.game_sends(
        1,
        game_message::Body::ClaimRelease(local::ClaimRelease {
            key: KEY.into(),
            holder_entity: OTHER,
        }),
    );
    p.step();
    assert_eq!(p.node(1).errors.len(), 1, "{:?}", p.node(1).errors);
    assert_eq!(p.store_holder(KEY), holder(HOLDER, 1));

    p.release_claim(1, KEY);
    p.step();
    assert_eq!(p.store_holder(KEY), None);
    assert!(p.node(1).core.claims.is_empty());
    assert_eq!(p.node(1).core.cx.metrics.claims_held.get(), 0);
    granted(&mut p, 2, KEY, RIVAL, 2);
    p.release_claim(2, KEY);
    p.step();
    assert_eq!(p.store_holder(KEY), None);

    // Released in the tick that asked for it: the grant that comes is freed, and said so.
    p.claim(1, KEY, OTHER, TTL, 3);
    p.release_claim(1, KEY);
    p.step();
    let r = answer(&mut p, 1, 3);
    assert_eq!(outcome(&r), Outcome::ClaimFailed, "{r:?}");
    assert!(r.detail.contains("released"), "{}", r.detail);
    assert_eq!(p.store_holder(KEY), None, "no claim left in the store");
    assert!(p.node(1).core.claims.is_empty());
    assert_eq!(
        p.node(1).errors.len(),
        1,
        "the release was of a known claim"
    );
}

#[test]
fn with_the_store_unreachable_the_game_is_told_the_claim_is_lost_before_the_store_frees_it() {
    let mut p = pair_with_entities();
    granted(&mut p, 1, KEY, HOLDER, 1);
    p.steps(STEPS_PER_LEASE / 2);

    // An outage shorter than the lease's slack costs nothing: renewals resume.
    p.store_down = true;
    p.steps(10);
    p.store_down = false;
    p.steps(2 * STEPS_PER_LEASE);
    assert!(p.node(1).claims_lost.is_empty());
    assert_eq!(p.store_holder(KEY), holder(HOLDER, 1));

    p.store_down = true;
    let (down_at, asked_before) = (p.now, p.node(1).store_asked.len());
    for _ in 0..2 * STEPS_PER_LEASE {
        if !p.node(1).claims_lost.is_empty() {
            break;
        }
        p.step();
    }
    let (lost_at, lost) = p.node(1).claims_lost.first().cloned().expect("ClaimLost");
    assert_eq!((lost.key.as_str(), lost.holder_entity), (KEY, HOLDER));
    assert!(!lost.reason.is_empty());
    let renewals = p.node(1).store_asked[asked_before..]
        .iter()
        .filter(|r| matches!(r, StoreRequest::RenewClaims { .. }))
        .count();
    assert!(renewals >= 2, "failed renewals are retried: {renewals}");
    assert_eq!(
        p.store_holder_at(lost_at, KEY),
        holder(HOLDER, 1),
        "the store still held it when the game was told (lost at {lost_at}, down at {down_at})"
    );
    assert_eq!(
        p.store_holder_at(down_at + u64::from(TTL), KEY),
        None,
        "the store's lease ends a lease after the last renewal"
    );
    let now = p.now;
    assert!(p.node(1).core.claims_believed(now).is_empty());
    let lapsed = p
        .node(1)
        .core
        .cx
        .metrics
        .claims_lost
        .get_or_create(&crate::metrics::ReasonLabel { reason: "lapsed" })
        .get();
    assert_eq!(lapsed, 1);
    // The game's release may have crossed the news: taken quietly, freeing nothing.
    let release = |holder_entity| {
        game_message::Body::ClaimRelease(local::ClaimRelease {
            key: KEY.into(),
            holder_entity,
        })
    };
    p.game_sends(1, release(HOLDER));
    p.step();
    assert!(p.node(1).errors.is_empty(), "{:?}", p.node(1).errors);
    // Not another entity's, nor past the grace.
    p.game_sends(1, release(OTHER));
    p.step();
    assert_eq!(p.node(1).errors.len(), 1, "{:?}", p.node(1).errors);
    p.steps((crate::model::claims::LOST_RELEASE_GRACE_MS / 50) as usize);
    p.game_sends(1, release(HOLDER));
    p.step();
    assert_eq!(p.node(1).errors.len(), 2, "{:?}", p.node(1).errors);

    // Once the store is back and its lease over, the key is anyone's.
    p.store_down = false;
    while p.store_holder(KEY).is_some() {
        p.step();
    }
    granted(&mut p, 2, KEY, RIVAL, 2);
    assert_eq!(p.node(1).claims_lost.len(), 1);
}

#[test]
fn a_claim_carried_in_while_the_store_is_unreachable_is_lost_before_the_store_frees_it() {
    let mut p = pair_with_entities();
    p.spawn(1, WALKER, 200.0);
    p.steps(4);
    granted(&mut p, 1, KEY, WALKER, 1);
    p.store_down = true;
    p.steps(10);
    p.move_to(1, WALKER, 330.0);
    p.steps(6);
    assert_eq!(
        p.node(2).entity(WALKER),
        Some((true, 2)),
        "node 2 writes it"
    );
    assert!(p.node(2).core.claims.get(KEY).is_some(), "carried in");
    // Node 2 can never rebind it: it must give it up while the store still holds it.
    for _ in 0..2 * STEPS_PER_LEASE {
        if !p.node(2).claims_lost.is_empty() {
            break;
        }
        p.step();
        let now = p.now;
        if p.store_holder(KEY).is_none() {
            assert!(
                p.node(2).core.claims_believed(now).is_empty(),
                "believed held at {now} after the store's lease ended"
            );
        }
    }
    let (lost_at, lost) = p.node(2).claims_lost.first().cloned().expect("ClaimLost");
    assert_eq!((lost.key.as_str(), lost.holder_entity), (KEY, WALKER));
    assert!(
        p.store_holder_at(lost_at, KEY).is_some(),
        "the store still held it when node 2's game was told (lost at {lost_at})"
    );
    assert!(p.node(1).claims_lost.is_empty(), "node 1 handed it away");
}

#[test]
fn bad_claims_fail_with_a_reason_and_ask_nothing_of_the_store() {
    const GHOST: u64 = 0x70;
    let mut p = pair_with_entities();
    p.spawn(1, WALKER, 200.0);
    p.spawn(2, GHOST, 280.0);
    p.steps(4);
    assert_eq!(
        p.node(1).entity(GHOST),
        Some((false, 1)),
        "a ghost on node 1"
    );
    // Node 2's game hangs on the Adopt: WALKER stays frozen on node 1.
    p.node(2).adopts = false;
    p.move_to(1, WALKER, 330.0);
    p.steps(3);
    assert!(p.node(1).core.handoff.outgoing().is_frozen(WALKER));

    // 101 two-byte characters: 202 bytes.
    let long = "é".repeat(101);
    let cases: [(&str, u64, u32, &str); 7] = [
        ("", HOLDER, TTL, "claim key"),
        (&long, HOLDER, TTL, "claim key"),
        (KEY, HOLDER, 10, "ttl_ms 10"),
        (KEY, HOLDER, 600_001, "ttl_ms 600001"),
        (KEY, GHOST, TTL, "not written here"),
        (KEY, 0xdead, TTL, "not written here"),
        (KEY, WALKER, TTL, "frozen"),
    ];
    let asked_before = p.node(1).store_asked.len();
    for (i, (key, entity, ttl, _)) in cases.iter().enumerate() {
        p.claim(1, key, *entity, *ttl, i as u64 + 1);
    }
    p.step();
    for (i, (key, entity, _, why)) in cases.iter().enumerate() {
        let r = answer(&mut p, 1, i as u64 + 1);
        assert_eq!(outcome(&r), Outcome::ClaimFailed, "{r:?}");
        assert_eq!((r.key.as_str(), r.holder_entity), (*key, *entity));
        assert!(r.detail.contains(why), "{why:?} in {:?}", r.detail);
    }
    assert_eq!(
        p.node(1).store_asked[asked_before..]
            .iter()
            .filter(|r| matches!(
                r,
                StoreRequest::Claim { .. }
                    | StoreRequest::RenewClaims { .. }
                    | StoreRequest::RebindClaim { .. }
                    | StoreRequest::ReleaseClaim { .. }
            ))
            .count(),
        0,
        "nothing asked of the store: {:?}",
        &p.node(1).store_asked[asked_before..]
    );
    assert_eq!(
        p.node(1).core.cx.metrics.claims_for("failed"),
        cases.len() as u64
    );

    // A key of exactly 200 bytes, and the default lease (0), are fine.
    p.claim(1, &"é".repeat(100), HOLDER, 0, 10);
    p.step();
    assert_eq!(outcome(&answer(&mut p, 1, 10)), Outcome::ClaimGranted);

    // Releasing a key nobody here holds is an error, not the end of the connection.
    p.release_claim(1, "nobody:holds");
    p.step();
    let errors = &p.node(1).errors;
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].detail.contains("nobody:holds") && !errors[0].fatal);
    assert!(!p.node(1).game_cut && p.node(1).core.game.connected());
    granted(&mut p, 1, KEY, HOLDER, 11);
}

#[test]
fn a_game_that_disconnects_frees_its_claims_in_the_store() {
    let mut p = pair_with_entities();
    granted(&mut p, 1, KEY, HOLDER, 1);
    // One more asked for in the game's last tick, its grant still on its way as the game goes.
    p.claim(1, "quest:giver", OTHER, TTL, 2);
    p.now += 50;
    p.tick_game(1);
    let now = p.now;
    p.node(1).core.handle(
        at(now),
        Input::GameClosed {
            conn: 1,
            reason: "gone".into(),
        },
    );
    p.carry();
    assert_eq!(p.store_holder(KEY), None);
    assert_eq!(
        p.store_holder("quest:giver"),
        None,
        "freed when its grant came"
    );
    assert!(p.node(1).core.claims.is_empty());
    assert_eq!(p.node(1).core.cx.metrics.claims_held.get(), 0);
    granted(&mut p, 2, KEY, RIVAL, 3);
    granted(&mut p, 2, "quest:giver", RIVAL, 4);
}
