//! What reaches a client session, over real sockets: a game on the local protocol, and clients
//! logged in through a real proxy.

mod support;

use std::time::Duration;

use cellmesh_proto::edge::DeltaKind;
use cellmesh_proto::local::{game_message::Body, AudienceKind, Event, Send};
use cellmesh_proto::mesh::{self, mesh_message};
use support::*;

const QUIET: Duration = Duration::from_millis(300);

#[tokio::test]
async fn spawn_update_despawn_arrive_as_one_batch_per_tick_on_tick_end() {
    let mut s = Scene::new().await;
    let (me, first) = s.join(1, "alice", chunk(100, 100), vec![]).await;
    assert_eq!(kinds(&first), [(me, DeltaKind::Appear)]);
    let a = s.id();
    let b = s.id();
    s.game.push(npc(a, chunk(101, 100)));
    s.game.push(npc(b, chunk(102, 101)));
    s.game.flush().await;
    // Give a sidecar that flushed early the time to do it: the next batch must still be the tick's.
    tokio::time::sleep(QUIET).await;
    let t = s.tick().await;
    let got = s.edge.batch(1).await;
    assert_eq!(got.tick, t, "nothing before TickEnd");
    let mut appeared = kinds(&got);
    appeared.sort();
    let mut want = vec![(a, DeltaKind::Appear), (b, DeltaKind::Appear)];
    want.sort();
    assert_eq!(appeared, want, "both in the tick's one batch");
    let d = delta(&got, a);
    assert_eq!(types(d), [1]);
    assert_eq!(
        d.position.as_ref().map(|p| (p.x, p.y)),
        Some((101.0 * CHUNK + 16.0, 100.0 * CHUNK + 16.0))
    );

    // A tick with nothing for this client sends nothing (and the tick above sent one batch).
    s.tick().await;
    s.nothing_for(1, "alice").await;

    // Update: position and a changed component, in one delta; despawn: vanish. Same batch.
    s.game.push(move_to(a, chunk(101, 99)));
    s.game.push(change(
        a,
        comp(2, "angry", aud(AudienceKind::PublicInRange, &[])),
    ));
    s.game.push(despawn(b));
    let t = s.tick().await;
    let got = s.edge.batch(1).await;
    assert_eq!(got.tick, t);
    let d = delta(&got, a);
    assert_eq!(d.kind(), DeltaKind::Update);
    assert!(d.position.is_some());
    assert_eq!(types(d), [2]);
    assert_eq!(delta(&got, b).kind(), DeltaKind::Vanish);
    assert_eq!(got.deltas.len(), 2);
    s.nothing_for(1, "alice").await;

    let stats = s.sc.h().stats();
    assert!(
        stats.batches_sent >= 3 && stats.deltas_sent >= 5,
        "{stats:?}"
    );
    assert_eq!(stats.entities, 2);
}

#[tokio::test]
async fn public_in_range_within_five_chunks_with_hysteresis() {
    let mut s = Scene::new().await;
    let (_, _) = s.join(1, "alice", chunk(100, 100), vec![]).await;
    let near = s.id();
    let far = s.id();
    s.game.push(npc(near, chunk(105, 100))); // 5 away: seen
    s.game.push(npc(far, chunk(100, 107))); // 7 away: not seen
    s.tick().await;
    let b = s.edge.batch(1).await;
    assert_eq!(kinds(&b), [(near, DeltaKind::Appear)]);

    // 5 -> 6: stays (an update, not a vanish).
    s.game.push(move_to(near, chunk(106, 100)));
    s.tick().await;
    let b = s.edge.batch(1).await;
    assert_eq!(kinds(&b), [(near, DeltaKind::Update)]);

    // A stranger at 6 that was never seen does not appear; the far one moving to 6 neither.
    s.game.push(move_to(far, chunk(100, 106)));
    s.tick().await;
    s.nothing_for(1, "alice").await;

    // 6 -> 7: vanishes. The far one at 5: appears.
    s.game.push(move_to(near, chunk(107, 100)));
    s.game.push(move_to(far, chunk(100, 105)));
    s.tick().await;
    let b = s.edge.batch(1).await;
    let mut got = kinds(&b);
    got.sort();
    let mut want = vec![(near, DeltaKind::Vanish), (far, DeltaKind::Appear)];
    want.sort();
    assert_eq!(got, want);
}

#[tokio::test]
async fn the_view_wraps_around_the_world() {
    let mut s = Scene::new().await;
    let edge = s.sc.cfg.world.width / CHUNK;
    let last = edge as i64 - 1;
    let (_, _) = s.join(1, "alice", chunk(0, 0), vec![]).await;
    let across = s.id();
    s.game.push(npc(across, chunk(last - 3, last))); // 4 west, 1 north across both seams
    s.tick().await;
    let b = s.edge.batch(1).await;
    assert_eq!(kinds(&b), [(across, DeltaKind::Appear)]);
}

#[tokio::test]
async fn owner_only_reaches_only_the_owner() {
    let mut s = Scene::new().await;
    let inventory = comp(7, "sword", aud(AudienceKind::OwnerOnly, &[]));
    let (alice, b) = s.join(1, "alice", chunk(100, 100), vec![inventory]).await;
    assert_eq!(
        types(delta(&b, alice)),
        [1, 7],
        "the owner sees its inventory"
    );
    let (bob, b) = s.join(2, "bob", chunk(101, 100), vec![]).await;
    assert_eq!(types(delta(&b, alice)), [1], "a stranger does not");
    assert_eq!(delta(&b, alice).owner_account, "alice");
    assert_eq!(kinds(&s.edge.batch(1).await), [(bob, DeltaKind::Appear)]);

    s.game.push(change(
        alice,
        comp(7, "sword,shield", aud(AudienceKind::OwnerOnly, &[])),
    ));
    s.tick().await;
    let b = s.edge.batch(1).await;
    assert_eq!(types(delta(&b, alice)), [7]);
    assert_eq!(
        delta(&b, alice).components[0].payload.as_ref(),
        b"sword,shield"
    );
    // Bob gets nothing.
    s.nothing_for(2, "bob").await;
}

#[tokio::test]
async fn owner_and_party_and_listed_accounts() {
    let mut s = Scene::new().await;
    let (alice, _) = s.join(1, "alice", chunk(100, 100), vec![]).await;
    let (_, _) = s.join(2, "bob", chunk(300, 300), vec![]).await; // party member, far away
    let (_, _) = s.join(3, "carol", chunk(500, 500), vec![]).await; // a pen pal, far away
    let (_, _) = s.join(4, "dave", chunk(101, 101), vec![]).await; // a stranger next to alice
    s.edge.settle(QUIET).await;

    s.game.push(change(
        alice,
        comp(3, "hp 90", aud(AudienceKind::OwnerAndParty, &["bob"])),
    ));
    s.game.push(change(
        alice,
        comp(4, "letter", aud(AudienceKind::Accounts, &["carol"])),
    ));
    s.tick().await;
    let a = s.edge.batch(1).await;
    assert_eq!(
        types(delta(&a, alice)),
        [3],
        "owner: the party component, not the letter"
    );
    let b = s.edge.batch(2).await;
    let d = delta(&b, alice);
    assert_eq!(
        (d.kind(), types(d)),
        (DeltaKind::Update, vec![3]),
        "party member, out of view"
    );
    assert!(d.position.is_none(), "out of view: no position");
    let c = s.edge.batch(3).await;
    assert_eq!(types(delta(&c, alice)), [4]);
    // Dave sees neither.
    s.nothing_for(4, "dave").await;

    // Events follow the same rules.
    s.game.push(Body::Event(Event {
        entity_id: alice,
        r#type: 9,
        payload: "wave".into(),
        audience: aud(AudienceKind::PublicInRange, &[]),
    }));
    s.game.push(Body::Event(Event {
        entity_id: alice,
        r#type: 10,
        payload: "whisper".into(),
        audience: aud(AudienceKind::OwnerAndParty, &["bob"]),
    }));
    s.tick().await;
    let ev =
        |b: &cellmesh_proto::edge::Batch| b.events.iter().map(|e| e.r#type).collect::<Vec<_>>();
    assert_eq!(ev(&s.edge.batch(1).await), [9, 10]);
    assert_eq!(ev(&s.edge.batch(2).await), [10]);
    assert_eq!(ev(&s.edge.batch(4).await), [9]);
    s.nothing_for(3, "carol").await;
}

#[tokio::test]
async fn send_reaches_the_account_wherever_it_is() {
    let mut s = Scene::new().await;
    let (_, _) = s.join(1, "alice", chunk(100, 100), vec![]).await;
    let (_, _) = s.join(2, "bob", chunk(900, 900), vec![]).await;
    s.edge.settle(QUIET).await;
    s.game.push(Body::Send(Send {
        accounts: vec!["bob".into(), "nobody".into()],
        r#type: 5,
        payload: "hi bob".into(),
    }));
    s.tick().await;
    let b = s.edge.batch(2).await;
    assert_eq!(b.messages.len(), 1);
    assert_eq!(
        (b.messages[0].r#type, b.messages[0].payload.as_ref()),
        (5, &b"hi bob"[..])
    );
    assert!(b.deltas.is_empty());
    s.nothing_for(1, "alice").await;
    let metrics = s.sc.metrics().await;
    assert!(
        metrics.contains("cellmesh_sidecar_dropped_total{reason=\"unknown_account\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn input_reaches_the_game_with_the_session_epoch() {
    let mut s = Scene::new().await;
    let welcome = s.edge.login(1, "alice").await;
    s.game.expect_join("alice").await;
    s.edge.input(1, 1, b"north").await;
    s.edge.input(1, 2, b"east").await;
    for (seq, payload) in [(1u64, &b"north"[..]), (2, &b"east"[..])] {
        let i = s.game.expect_input().await;
        assert_eq!(
            (
                i.account.as_str(),
                i.session_epoch,
                i.seq,
                i.payload.as_ref()
            ),
            ("alice", welcome.session_epoch, seq, payload)
        );
    }
    assert_eq!(s.sc.h().stats().inputs_delivered, 2);
    // Input for a session the sidecar never attached (no proxy sends one: a raw link does) is
    // dropped and counted.
    let mut raw = RawPeer::proxy(s.sc.mesh(), "edge-raw").await;
    raw.send(mesh_message::Body::Input(mesh::SessionInput {
        session_id: 99,
        seq: 1,
        payload: "ghost".into(),
    }))
    .await;
    within("the unknown session's input counted", async {
        while !s
            .sc
            .metrics()
            .await
            .contains("cellmesh_sidecar_dropped_total{reason=\"unknown_session\"} 1")
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // It never reached the game: the next input the game gets is alice's.
    s.edge.input(1, 3, b"after").await;
    let i = s.game.expect_input().await;
    assert_eq!(i.seq, 3);
}

#[tokio::test]
async fn many_clients_share_one_encoding_of_a_public_update() {
    let mut s = Scene::new().await;
    for sid in 1..=10u64 {
        s.join(sid, &format!("p{sid}"), chunk(100, 100), vec![])
            .await;
    }
    s.edge.settle(QUIET).await;
    let n = s.id();
    s.game.push(npc(n, chunk(102, 102)));
    s.tick().await;
    for sid in 1..=10u64 {
        assert_eq!(kinds(&s.edge.batch(sid).await), [(n, DeltaKind::Appear)]);
    }
    let before = s.sc.metrics().await;
    let encoded = |text: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix("cellmesh_sidecar_deltas_encoded_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    };
    s.game.push(move_to(n, chunk(103, 102)));
    s.tick().await;
    for sid in 1..=10u64 {
        assert_eq!(kinds(&s.edge.batch(sid).await), [(n, DeltaKind::Update)]);
    }
    let after = s.sc.metrics().await;
    assert_eq!(
        encoded(&after) - encoded(&before),
        1,
        "ten clients, one encoding"
    );
}
