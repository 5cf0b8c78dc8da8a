//! Dens given to this node: stocked, killed, lost.

use super::*;

#[test]
fn a_den_given_to_this_node_is_stocked_under_the_given_id_and_gone_when_killed_or_lost() {
    let census = Arc::new(Census::default());
    let cfg = ArenaConfig {
        npcs: 0,
        census: Some(census.clone()),
        dens: vec![("wolves".into(), (250.0, 10.0))],
        ..ArenaConfig::default()
    };
    let mut a = Arena::new(cfg, &welcome());
    let mut out = Vec::new();
    a.start(&mut out);
    let declared: Vec<_> = out
        .iter()
        .filter_map(|b| match b {
            Body::DeclareSpawners(d) => Some(d.points.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(declared.len(), 1);
    assert_eq!(declared[0][0].key, "wolves");
    let owned = |id: u64, generation: u64| {
        M::SpawnerOwned(SpawnerOwned {
            key: "wolves".into(),
            entity_id: id,
            generation,
            position: Some(Vec3::xy(250.0, 10.0)),
        })
    };
    let stock = 1 << 62 | 7;
    let mut out = Vec::new();
    a.on_message(&mut out, owned(stock, 1));
    // Said twice (a repeated word): stocked once.
    a.on_message(&mut out, owned(stock, 1));
    assert_eq!(spawned(&out), [stock]);
    assert_eq!(a.held().next().unwrap().pos, (250.0, 10.0));
    // Killed: gone for good, not risen.
    let mut out = Vec::new();
    for k in 0..5 {
        a.on_message(&mut out, attack_in(stock, "ann", 1, NODE, k + 1));
    }
    assert!(out
        .iter()
        .any(|b| matches!(b, Body::Despawn(d) if d.entity_id == stock)));
    assert_eq!(a.entity_count(), 0);
    assert_eq!(a.stats.den_kills, 1);
    // The next generation; then its den's claim is lost: gone too.
    let next = 1 << 62 | 8;
    let mut out = Vec::new();
    a.on_message(&mut out, owned(next, 2));
    a.on_message(
        &mut out,
        M::ClaimLost(ClaimLost {
            key: "spawner:wolves".into(),
            holder_entity: next,
            reason: "lapsed".into(),
        }),
    );
    assert!(out
        .iter()
        .any(|b| matches!(b, Body::Despawn(d) if d.entity_id == next)));
    assert_eq!(census.dens(), (2, 0));
}

#[test]
fn the_census_counts_a_den_stocked_while_another_of_it_is_held() {
    let census = Census::default();
    census.spawned_stock("wolves", 1, 1);
    census.despawned(1, 1);
    census.spawned_stock("wolves", 2, 1);
    assert_eq!(census.dens(), (2, 0), "one after the other");
    // Node 1 died holding 2 (nobody holds it); node 2 stocks the den again: fine...
    census.release_holder(1);
    census.spawned_stock("wolves", 3, 2);
    assert_eq!(census.dens(), (3, 0));
    // ...but 2 restored on node 4 while 3 lives is a den stocked twice.
    census.adopted(2, 4);
    assert_eq!(census.dens(), (3, 1));
}
