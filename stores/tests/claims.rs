//! The claim store's contract, against the in-memory store and the real Redis named by
//! `CELLMESH_TEST_REDIS_URL` (`./scripts/test.sh` starts it; without it the Redis tests fail,
//! they never pass by skipping). Each test works under its own geo name.

use std::sync::Arc;
use std::time::Duration;

use cellmesh_stores::claims::{ClaimGrant, ClaimHolder, ClaimOutcome, ClaimStore, MemoryClaims};
use cellmesh_stores::redis::RedisDirectory;
use cellmesh_test_support::{required, unique_name as unique};

async fn redis() -> Arc<dyn ClaimStore> {
    let url = required("CELLMESH_TEST_REDIS_URL");
    Arc::new(
        RedisDirectory::connect(&url, &unique("claims"))
            .await
            .unwrap(),
    )
}

fn memory() -> Arc<dyn ClaimStore> {
    Arc::new(MemoryClaims::default())
}

const LEASE: Duration = Duration::from_secs(30);

fn who(entity: u64, entity_epoch: u64) -> ClaimHolder {
    ClaimHolder {
        entity,
        entity_epoch,
    }
}

fn granted(o: ClaimOutcome) -> ClaimGrant {
    match o {
        ClaimOutcome::Granted(g) => g,
        held => panic!("not granted: {held:?}"),
    }
}

/// Entities on many nodes race for each key: exactly one wins it, and every loser is told who.
async fn one_of_many_racers_wins_each_key(store: Arc<dyn ClaimStore>) {
    for k in 0..20 {
        let key = format!("trade:{k}");
        let racers: Vec<_> = (1..=8u64)
            .map(|e| {
                let (store, key) = (store.clone(), key.clone());
                tokio::spawn(async move { store.claim(&key, who(e, 1), LEASE).await.unwrap() })
            })
            .collect();
        let mut winners = Vec::new();
        let mut told = Vec::new();
        for r in racers {
            match r.await.unwrap() {
                ClaimOutcome::Granted(g) => winners.push(g),
                ClaimOutcome::Held { by } => told.push(by),
            }
        }
        assert_eq!(winners.len(), 1, "{key}: {winners:?}");
        assert!(told.iter().all(|by| *by == winners[0].holder), "{told:?}");
    }
}

/// The holder claims again under a new token, which fences its earlier grant out (a late
/// release of that one frees nothing); another entity is refused; a release frees the key and
/// the next grant has a newer token.
async fn the_holder_keeps_a_claim_and_a_release_frees_it(store: Arc<dyn ClaimStore>) {
    let first = granted(store.claim("escrow:alice", who(7, 1), LEASE).await.unwrap());
    let g = granted(store.claim("escrow:alice", who(7, 1), LEASE).await.unwrap());
    assert!(g.token > first.token, "{g:?} after {first:?}");
    assert!(!store.release(&first).await.unwrap(), "a superseded grant");
    assert!(
        !store.renew(&first, LEASE).await.unwrap(),
        "a superseded grant"
    );
    assert_eq!(
        store.claim("escrow:alice", who(8, 5), LEASE).await.unwrap(),
        ClaimOutcome::Held { by: who(7, 1) }
    );
    assert!(store.renew(&g, LEASE).await.unwrap());
    assert!(store.release(&g).await.unwrap());
    assert!(!store.release(&g).await.unwrap(), "released once");
    let next = granted(store.claim("escrow:alice", who(8, 5), LEASE).await.unwrap());
    assert!(next.token > g.token, "{next:?} after {g:?}");
    assert!(
        !store.renew(&g, LEASE).await.unwrap(),
        "an old grant renews nothing"
    );
}

/// A handoff: the new owner rebinds under the entity's newer epoch; the old owner's renewal,
/// rebind and release are refused from then on, and no epoch goes back.
async fn a_rebind_after_a_handoff_fences_the_old_owner(store: Arc<dyn ClaimStore>) {
    let old = granted(store.claim("escrow:bob", who(9, 3), LEASE).await.unwrap());
    let new = store.rebind(&old, 4).await.unwrap().expect("rebound");
    assert_eq!(new.holder, who(9, 4));
    assert_eq!(new.token, old.token);
    assert!(!store.renew(&old, LEASE).await.unwrap());
    assert!(store.rebind(&old, 5).await.unwrap().is_none());
    assert!(!store.release(&old).await.unwrap());
    assert!(
        store.rebind(&new, 3).await.unwrap().is_none(),
        "no going back"
    );
    // The entity under its old epoch cannot claim it back either.
    assert_eq!(
        store.claim("escrow:bob", who(9, 3), LEASE).await.unwrap(),
        ClaimOutcome::Held { by: who(9, 4) }
    );
    assert!(store.renew(&new, LEASE).await.unwrap());
    assert!(store.release(&new).await.unwrap());
}

/// A claim whose lease lapses is free for anyone.
async fn a_lapsed_claim_is_free(store: Arc<dyn ClaimStore>) {
    let g = granted(
        store
            .claim("escrow:carol", who(1, 1), Duration::from_millis(60))
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!store.renew(&g, LEASE).await.unwrap());
    let next = granted(store.claim("escrow:carol", who(2, 1), LEASE).await.unwrap());
    assert!(next.token > g.token);
}

/// A renewal, rebind or release with the grant's token but another entity is refused.
async fn a_grant_holds_for_its_entity_only(store: Arc<dyn ClaimStore>) {
    let g = granted(store.claim("escrow:dave", who(11, 2), LEASE).await.unwrap());
    let other = ClaimGrant {
        holder: who(12, 2),
        ..g.clone()
    };
    assert!(!store.renew(&other, LEASE).await.unwrap());
    assert!(store.rebind(&other, 3).await.unwrap().is_none());
    assert!(!store.release(&other).await.unwrap());
    assert!(store.renew(&g, LEASE).await.unwrap(), "still the holder's");
    assert!(store.release(&g).await.unwrap());
}

async fn bad_keys_are_refused(store: Arc<dyn ClaimStore>) {
    for key in ["", "a\nb", &"k".repeat(201)] {
        assert!(store.claim(key, who(1, 1), LEASE).await.is_err(), "{key:?}");
    }
    assert!(store.claim("k", who(1, 1), Duration::ZERO).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_claims_keep_their_contract() {
    one_of_many_racers_wins_each_key(memory()).await;
    the_holder_keeps_a_claim_and_a_release_frees_it(memory()).await;
    a_rebind_after_a_handoff_fences_the_old_owner(memory()).await;
    a_lapsed_claim_is_free(memory()).await;
    a_grant_holds_for_its_entity_only(memory()).await;
    bad_keys_are_refused(memory()).await;
}

/// A store that lost its data (a process restarted, a Redis wiped) never grants an old token
/// again: a stale holder's renewal cannot pass for the new holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_never_repeat_after_a_store_loses_its_data() {
    let before = granted(
        memory()
            .claim("escrow:erin", who(1, 1), LEASE)
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(3)).await;
    let fresh = memory();
    let after = granted(fresh.claim("escrow:erin", who(2, 1), LEASE).await.unwrap());
    assert!(after.token > before.token, "{after:?} after {before:?}");

    let url = required("CELLMESH_TEST_REDIS_URL");
    let geo = unique("claims-wipe");
    let store = RedisDirectory::connect(&url, &geo).await.unwrap();
    let before = granted(store.claim("escrow:erin", who(1, 1), LEASE).await.unwrap());
    let mut raw = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let wiped: i64 = redis::cmd("DEL")
        .arg(format!("cellmesh:{geo}:{{claim:escrow:erin}}:holder"))
        .arg(format!("cellmesh:{geo}:{{claim:escrow:erin}}:token"))
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(wiped, 2, "the claim's keys as the store names them");
    tokio::time::sleep(Duration::from_millis(3)).await;
    let after = granted(store.claim("escrow:erin", who(2, 1), LEASE).await.unwrap());
    assert!(after.token > before.token, "{after:?} after {before:?}");
    assert!(!store.renew(&before, LEASE).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_claims_keep_their_contract() {
    one_of_many_racers_wins_each_key(redis().await).await;
    the_holder_keeps_a_claim_and_a_release_frees_it(redis().await).await;
    a_rebind_after_a_handoff_fences_the_old_owner(redis().await).await;
    a_lapsed_claim_is_free(redis().await).await;
    a_grant_holds_for_its_entity_only(redis().await).await;
    bad_keys_are_refused(redis().await).await;
}
