//! Releases, freezes, evictions and adoptions as the game sees them.

use super::*;

/// An arena owning only the chunk east of the origin (no margin): its NPCs, wandering
/// around the origin, keep walking out of it.
fn arena_owning_one_chunk(census: &Arc<Census>) -> Arena {
    arena_of_one_chunk_with(20, census)
}

/// The same, with `npcs` NPCs.
fn arena_of_one_chunk_with(npcs: u32, census: &Arc<Census>) -> Arena {
    let mut w = welcome();
    w.owned_area = vec![cellmesh_proto::local::Rect {
        x: 0.0,
        y: 0.0,
        width: 32.0,
        height: 32.0,
    }];
    w.handoff_margin_chunks = 0;
    arena_welcomed(npcs, census, &w)
}

fn releases(out: &[Body]) -> Vec<&cellmesh_proto::local::Release> {
    out.iter()
        .filter_map(|b| match b {
            Body::Release(r) => Some(r),
            _ => None,
        })
        .collect()
}

/// An NPC that walks out of the area is released in that tick, after its last move, with
/// its whole state; from then on it is frozen (neither moved nor written).
#[test]
fn an_npc_that_walks_out_of_the_area_is_released_with_its_state_and_frozen() {
    let census = Arc::new(Census::default());
    let mut a = arena_owning_one_chunk(&census);
    let mut out = Vec::new();
    let mut ticks = 0;
    while releases(&out).is_empty() {
        out.clear();
        a.tick(&mut out, 0.05);
        ticks += 1;
        assert!(ticks < 200, "no NPC ever left the area");
    }
    let released: Vec<(u64, u64, SampleSnapshot)> = releases(&out)
        .iter()
        .map(|r| {
            let snap = SampleSnapshot::decode(&r.state).expect("a decodable snapshot");
            (r.entity_id, r.entity_epoch, snap)
        })
        .collect();
    for (id, epoch, snap) in &released {
        assert_eq!(*epoch, 1);
        assert_eq!(snap.kind, SnapshotKind::Npc);
        let e = &a.entities[id];
        assert!(e.frozen);
        let off = (snap.pos[0] - e.pos.0).hypot(snap.pos[1] - e.pos.1);
        assert!(
            off < 1e-6,
            "the tick's own state: {:?} vs {:?}",
            snap.pos,
            e.pos
        );
        assert!(
            a.area.release_due(e.pos.0, e.pos.1),
            "released outside the area"
        );
        // Its last move comes before the release in the tick's batch.
        let moved = out
            .iter()
            .position(|b| matches!(b, Body::Update(u) if u.entity_id == *id));
        let rel = out
            .iter()
            .position(|b| matches!(b, Body::Release(r) if r.entity_id == *id));
        assert!(moved < rel, "{out:?}");
    }
    assert_eq!(a.stats.released, released.len() as u64);
    let mut next = Vec::new();
    a.tick(&mut next, 0.05);
    for (id, _, _) in &released {
        assert!(!writes(&next, *id), "a released NPC was written: {next:?}");
        assert!(releases(&next).iter().all(|r| r.entity_id != *id));
    }
}

/// A release the sidecar kept (thawed) is not repeated at every tick: the entity moves on,
/// and is released again only after a back-off (the sidecar's Freeze may come first).
#[test]
fn a_kept_release_is_not_repeated_before_the_back_off() {
    let census = Arc::new(Census::default());
    let mut a = arena_owning_one_chunk(&census);
    let id = loop {
        let mut out = Vec::new();
        a.tick(&mut out, 0.05);
        if let Some(r) = releases(&out).first() {
            break r.entity_id;
        }
    };
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::Thaw(Thaw {
            entity_id: id,
            reason: "released, but kept: no node could take it".into(),
        }),
    );
    assert_eq!(a.stats.releases_kept, 1);
    for _ in 0..RELEASE_BACKOFF_TICKS - 1 {
        let mut out = Vec::new();
        a.tick(&mut out, 0.05);
        assert!(writes(&out, id), "a thawed NPC moves again");
        assert!(releases(&out).iter().all(|r| r.entity_id != id));
    }
    // Once the back-off is over it goes as soon as it stands outside.
    let mut released_again = false;
    for _ in 0..400 {
        let mut out = Vec::new();
        a.tick(&mut out, 0.05);
        if releases(&out).iter().any(|r| r.entity_id == id) {
            released_again = true;
            break;
        }
    }
    assert!(released_again);
}

/// With `release` off the arena leaves every handoff to the sidecar's Freeze.
#[test]
fn an_arena_that_does_not_release_waits_for_the_freeze() {
    let census = Arc::new(Census::default());
    let mut a = arena_owning_one_chunk(&census);
    a.cfg.release = false;
    for _ in 0..200 {
        let mut out = Vec::new();
        a.tick(&mut out, 0.05);
        assert!(releases(&out).is_empty());
    }
}

#[test]
fn npcs_around_the_origin_wander_across_the_seam_and_stay_in_their_square() {
    let census = Arc::new(Census::default());
    let mut a = arena(20, &census);
    for _ in 0..2000 {
        let mut out = Vec::new();
        a.tick(&mut out, 0.05);
        for b in &out {
            if let Body::Update(u) = b {
                let p = u.position.unwrap();
                assert!((0.0..SIZE).contains(&p.x) && (0.0..SIZE).contains(&p.y));
            }
        }
    }
    let t = Torus { w: SIZE, h: SIZE };
    let mut sides = (false, false);
    for e in a.entities.values() {
        let (dx, dy) = t.delta((0.0, 0.0), e.pos);
        // Half the square plus the steps taken before turning back.
        assert!(dx.abs() <= 21.0 && dy.abs() <= 21.0, "{dx},{dy} strayed");
        sides.0 |= dx < 0.0;
        sides.1 |= dx > 0.0;
    }
    assert!(sides.0 && sides.1, "NPCs on both sides of the seam");
}

#[test]
fn a_frozen_npc_is_not_written_until_thawed() {
    let census = Arc::new(Census::default());
    let mut a = arena(3, &census);
    let id = *a.entities.keys().next().unwrap();
    let out = freeze(&mut a, id, 7);
    let Some(Body::Snapshot(s)) = out.first() else {
        panic!("the snapshot is written at once: {out:?}")
    };
    assert_eq!((s.entity_id, s.entity_epoch), (id, 7));
    let snap = snapshot_of(&out, id);
    assert_eq!(snap.kind, SnapshotKind::Npc);
    assert_eq!(
        snap.pos[..2],
        [a.entities[&id].pos.0, a.entities[&id].pos.1]
    );
    let before = a.entities[&id].pos;
    for _ in 0..500 {
        let mut out = Vec::new();
        a.tick(&mut out, 0.05);
        assert!(!writes(&out, id));
    }
    assert_eq!(a.entities[&id].pos, before, "not moved");
    // Frozen again (a lost answer): answered again, counted once.
    assert_eq!(snapshot_of(&freeze(&mut a, id, 7), id), snap);
    assert_eq!((a.stats.frozen, a.stats.snapshots), (1, 2));

    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::Thaw(Thaw {
            entity_id: id,
            reason: "target does not own the position".into(),
        }),
    );
    assert!(out.is_empty());
    a.tick(&mut out, 0.05);
    assert!(writes(&out, id), "moves again");
    assert_eq!(a.stats.thawed, 1);
}

#[test]
fn a_freeze_of_an_unknown_id_is_not_answered() {
    let census = Arc::new(Census::default());
    let mut a = arena(1, &census);
    assert!(freeze(&mut a, 42, 1).is_empty());
    assert_eq!(a.stats.frozen, 0);
}

#[test]
fn an_evicted_npc_is_forgotten_without_a_despawn_or_a_replacement() {
    let census = Arc::new(Census::default());
    let mut a = arena(3, &census);
    let id = *a.entities.keys().next().unwrap();
    freeze(&mut a, id, 1);
    let mut out = Vec::new();
    a.on_message(&mut out, M::Evict(Evict { entity_id: id }));
    a.on_message(
        &mut out,
        M::IdsReserved(IdsReserved {
            request_id: 2,
            ids: (2000..2010).collect(),
        }),
    );
    a.tick(&mut out, 0.05);
    assert!(!writes(&out, id));
    assert!(spawned(&out).is_empty(), "no NPC spawned to replace it");
    assert_eq!((a.entity_count(), a.stats.evicted), (2, 1));
    let r = census.report();
    assert_eq!(r.lost(), vec![id], "held by nobody until another adopts it");
    census.adopted(id, NODE + 1);
    assert!(census.report().lost().is_empty());
}

#[test]
fn a_player_frozen_evicted_and_adopted_elsewhere_continues_its_inputs() {
    let census = Arc::new(Census::default());
    let mut src = arena(0, &census);
    let id = join(&mut src, "ann", 2);
    let mut out = Vec::new();
    for seq in 1..=3 {
        src.on_message(&mut out, input("ann", 2, seq, 1.0, 0.0));
    }
    src.tick(&mut out, 0.05);
    assert_eq!(ack_of(&out, id), Some((3, 3)));

    let out = freeze(&mut src, id, 4);
    let snap = snapshot_of(&out, id);
    assert_eq!(
        (snap.kind, snap.name.as_str(), snap.last_seq, snap.applied),
        (SnapshotKind::Player, "ann", 3, 3)
    );
    assert_eq!(snap.dir, [1.0, 0.0]);
    assert_eq!(snap.inventory, "sword,bread,10 gold");
    let mut out = Vec::new();
    src.on_message(&mut out, input("ann", 2, 4, 0.0, 1.0));
    src.tick(&mut out, 0.05);
    assert!(!writes(&out, id));
    assert_eq!(src.stats.inputs_while_frozen, 1);
    src.on_message(&mut out, M::Evict(Evict { entity_id: id }));
    // The account is simulated elsewhere now: its leave and inputs are not this arena's.
    src.on_message(
        &mut out,
        M::PlayerLeave(PlayerLeave {
            account: "ann".into(),
            session_epoch: 2,
            reason: String::new(),
        }),
    );
    src.on_message(&mut out, input("ann", 2, 5, 0.0, 1.0));
    src.tick(&mut out, 0.05);
    assert!(!writes(&out, id), "{out:?}");
    assert_eq!(src.stats.inputs_applied, 3);

    let mut dst = Arena::new(
        ArenaConfig {
            census: Some(census.clone()),
            ..ArenaConfig::default()
        },
        &Welcome {
            node_id: NODE + 1,
            ..welcome()
        },
    );
    let mut out = Vec::new();
    dst.on_message(&mut out, M::Adopt(adopt_msg(id, 5, &snap, "ann")));
    assert!(
        matches!(out.as_slice(), [Body::Adopted(Adopted { entity_id, entity_epoch: 5 })] if *entity_id == id),
        "{out:?}"
    );
    assert!(spawned(&out).is_empty(), "the sidecar already has it");
    dst.tick(&mut out, 0.05);
    assert_eq!(
        ack_of(&out, id),
        Some((3, 3)),
        "the acknowledgement is rewritten"
    );
    // Seq 4 reached only the frozen source: the client resends it here.
    let mut out = Vec::new();
    dst.on_message(&mut out, input("ann", 2, 3, 1.0, 1.0));
    dst.on_message(&mut out, input("ann", 2, 4, 0.0, 1.0));
    dst.on_message(&mut out, input("ann", 2, 4, 0.0, 1.0));
    dst.tick(&mut out, 0.05);
    assert_eq!(ack_of(&out, id), Some((4, 4)));
    assert_eq!(
        (dst.stats.inputs_applied, dst.stats.inputs_duplicate),
        (1, 2)
    );
    assert_eq!(dst.entities[&id].dir, (0.0, 1.0));
    let r = census.report();
    assert_eq!(r.holders.get(&id), Some(&vec![NODE + 1]));
    assert!(r.lost().is_empty() && r.duplicated().is_empty());
}

#[test]
fn a_replayed_adopt_is_answered_without_a_second_copy() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    let s = player_snapshot("bob", 10, 8);
    let mut out = Vec::new();
    a.on_message(&mut out, M::Adopt(adopt_msg(77, 3, &s, "bob")));
    let mut out2 = Vec::new();
    a.on_message(&mut out2, input("bob", 2, 11, 1.0, 0.0));
    a.on_message(&mut out2, M::Adopt(adopt_msg(77, 3, &s, "bob")));
    assert!(matches!(
        out2.as_slice(),
        [Body::Adopted(Adopted {
            entity_id: 77,
            entity_epoch: 3
        })]
    ));
    assert_eq!((a.entity_count(), a.stats.adopted), (1, 1));
    let mut out = Vec::new();
    a.tick(&mut out, 0.05);
    assert_eq!(ack_of(&out, 77), Some((11, 9)), "the replay reset nothing");
}

#[test]
fn adopt_takes_the_attachments_and_answers_for_the_root() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    let npc = SampleSnapshot {
        kind: SnapshotKind::Npc,
        name: "horse".into(),
        inventory: String::new(),
        session_epoch: 0,
        last_seq: 0,
        applied: 0,
        turn_in: 30,
        ..player_snapshot("x", 0, 0)
    };
    let mut root = adopt_msg(1, 2, &player_snapshot("cy", 1, 1), "cy");
    root.attachments.push(adopt_msg(2, 2, &npc, ""));
    // The sidecar's position wins and is normalised.
    root.position = Some(Vec3::xy(1000.5, -0.5));
    let mut out = Vec::new();
    a.on_message(&mut out, M::Adopt(root));
    assert_eq!(out.len(), 1);
    assert_eq!(a.entities[&1].pos, (0.5, 999.5));
    assert!(matches!(a.entities[&2].role, Role::Npc { turn_in: 30, .. }));
    a.tick(&mut out, 0.05);
    assert!(writes(&out, 1) && writes(&out, 2));
    assert_eq!(census.report().holders.len(), 2);
}

#[test]
fn an_unreadable_adopt_creates_nothing_and_is_not_answered() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    let mut root = adopt_msg(1, 2, &player_snapshot("cy", 1, 1), "cy");
    let mut bad = root.clone();
    bad.entity_id = 2;
    bad.state = Bytes::from_static(b"{\"v\":1}");
    root.attachments.push(bad);
    let mut out = Vec::new();
    a.on_message(&mut out, M::Adopt(root));
    assert!(out.is_empty());
    assert_eq!(a.entity_count(), 0);
    assert!(census.report().holders.is_empty());
}

#[test]
fn a_leave_while_frozen_waits_for_the_thaw() {
    let census = Arc::new(Census::default());
    let mut a = arena(0, &census);
    let id = join(&mut a, "dee", 1);
    freeze(&mut a, id, 1);
    let mut out = Vec::new();
    a.on_message(
        &mut out,
        M::PlayerLeave(PlayerLeave {
            account: "dee".into(),
            session_epoch: 1,
            reason: "bye".into(),
        }),
    );
    assert!(out.is_empty(), "no despawn of a frozen entity");
    a.on_message(
        &mut out,
        M::Thaw(Thaw {
            entity_id: id,
            reason: "refused".into(),
        }),
    );
    assert!(matches!(out.as_slice(), [Body::Despawn(Despawn { entity_id })] if *entity_id == id));
    assert_eq!(a.entity_count(), 0);
    assert!(census.report().alive.is_empty());
}

#[test]
fn a_frozen_entity_adopted_back_resumes_as_one() {
    let census = Arc::new(Census::default());
    let mut a = arena(1, &census);
    let id = *a.entities.keys().next().unwrap();
    let snap = snapshot_of(&freeze(&mut a, id, 1), id);
    let mut out = Vec::new();
    a.on_message(&mut out, M::Adopt(adopt_msg(id, 2, &snap, "")));
    assert_eq!(out.len(), 1);
    a.tick(&mut out, 0.05);
    assert!(writes(&out, id));
    assert_eq!(a.entity_count(), 1);
    assert_eq!(census.report().holders.get(&id), Some(&vec![NODE]));
}

// ------------------------------------------------------------------ trade

/// A player's avatar that walks out of the area is released like an NPC, naming the last input
/// applied to it (and that input's session); from then on it drops its player's inputs, which
/// the sidecar hands on.
#[test]
fn an_avatar_that_walks_out_of_the_area_is_released_with_its_last_input() {
    let census = Arc::new(Census::default());
    let mut a = arena_of_one_chunk_with(0, &census);
    a.cfg.release_avatars = true;
    let id = join_at(&mut a, "ann", (30.0, 16.0));
    let mut out = Vec::new();
    a.on_message(&mut out, input("ann", 1, 1, 0.0, 1.0));
    a.on_message(&mut out, input("ann", 1, 2, 1.0, 0.0));
    let mut ticks = 0;
    let release = loop {
        let mut out = Vec::new();
        a.tick(&mut out, 0.05);
        if let Some(r) = releases(&out).first() {
            break (*r).clone();
        }
        assert!(writes(&out, id), "it walks east: {out:?}");
        ticks += 1;
        assert!(ticks < 400, "the avatar never left the area");
    };
    assert_eq!(release.entity_id, id);
    assert_eq!(
        (release.last_input_seq, release.input_session_epoch),
        (2, 1)
    );
    let snap = SampleSnapshot::decode(&release.state).expect("a decodable snapshot");
    assert_eq!((snap.kind, snap.last_seq), (SnapshotKind::Player, 2));
    assert_eq!(a.stats.avatars_released, 1);
    // Frozen: an input now is dropped (the sidecar hands it on), and it is not written.
    let mut out = Vec::new();
    a.on_message(&mut out, input("ann", 1, 3, 0.0, 1.0));
    a.tick(&mut out, 0.05);
    assert!(!writes(&out, id), "{out:?}");
    assert_eq!(
        (a.stats.inputs_applied, a.stats.inputs_while_frozen),
        (2, 1)
    );
}
