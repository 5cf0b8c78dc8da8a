//! Region-owned spawners between two cores wired back to back and one claim store, in virtual
//! time: a den on the border stocked once, through a re-plan that moves its chunk, a restock
//! after the stock despawns, and bad declarations.

use cellmesh_proto::local::{self, game_message, ClaimOutcome as Outcome, ErrorCode};
use cellmesh_world::partition::{Grid, Layout, Partition};
use cellmesh_world::spawners::spawn_id;

use super::pair_tests::{at, Pair};
use super::*;
use crate::model::spawners::{HELD_RETRY_MS, RELEASE_GRACE_MS};

const DEN: &str = "den:wolves";

/// Both games declare the den on the border line x = 256 m (node 2's chunk under the first
/// partition) and an ore deep in node 1's half.
fn declared() -> Pair {
    let mut p = Pair::new();
    p.steps(2);
    for id in [1, 2] {
        p.game_sends(
            id,
            game_message::Body::DeclareSpawners(local::DeclareSpawners {
                points: vec![
                    local::SpawnPoint {
                        key: DEN.into(),
                        x: 256.0,
                        y: 40.0,
                    },
                    local::SpawnPoint {
                        key: "ore".into(),
                        x: 60.0,
                        y: 40.0,
                    },
                ],
            }),
        );
    }
    p.steps(4);
    p
}

fn owned(p: &mut Pair, id: NodeId, key: &str) -> Vec<local::SpawnerOwned> {
    p.node(id)
        .spawner_owned
        .iter()
        .filter(|o| o.key == key)
        .cloned()
        .collect()
}

/// The stocks of `key` alive now, and the node writing each.
fn stocks(p: &mut Pair, key: &str) -> Vec<(u64, NodeId)> {
    let ids: Vec<u64> = [1, 2]
        .into_iter()
        .flat_map(|n| owned(p, n, key))
        .map(|o| o.entity_id)
        .collect();
    let mut alive = Vec::new();
    for id in ids {
        for n in [1, 2] {
            if p.node(n).entity(id).is_some_and(|(writes, _)| writes) {
                alive.push((id, n));
            }
        }
    }
    alive
}

/// Node 1 and node 2 swap halves: the den's chunk goes to node 1, the ore's to node 2.
fn swap_halves(p: &mut Pair) {
    let world = p.node(1).core.cfg.world;
    let grid = Grid::even(&world, 2, 1, &[2, 1]).unwrap();
    let swapped = Partition::new(world, 2, Layout::Grid(grid)).unwrap();
    let now = p.now;
    for id in [1, 2] {
        p.node(id)
            .core
            .handle(at(now), Input::Partition(Box::new(swapped.clone())));
    }
    p.carry();
}

#[test]
fn a_den_on_the_border_is_stocked_once_and_still_once_after_a_replan_moves_its_chunk() {
    let mut p = declared();
    // Only the owner of the den's chunk stocks it, under the id of its key and generation.
    assert!(owned(&mut p, 1, DEN).is_empty());
    let first = owned(&mut p, 2, DEN);
    assert_eq!(first.len(), 1, "{first:?}");
    let stock = first[0].entity_id;
    assert_eq!(stock, spawn_id(DEN, first[0].generation));
    assert_eq!(owned(&mut p, 1, "ore").len(), 1);
    assert_eq!(stocks(&mut p, DEN), [(stock, 2)]);
    assert_eq!(
        p.store_holder("spawner:den:wolves").map(|h| h.entity),
        Some(stock)
    );

    // The re-plan gives the den's chunk to node 1: node 2 lets the point go, the stock itself
    // is handed over with its claim, and node 1 does not stock the den again.
    swap_halves(&mut p);
    p.steps(20);
    let released: Vec<String> = p
        .node(2)
        .spawner_released
        .iter()
        .map(|r| r.key.clone())
        .collect();
    assert_eq!(released, [DEN]);
    assert_eq!(
        stocks(&mut p, DEN),
        [(stock, 1)],
        "handed over, not restocked"
    );
    p.steps((3 * HELD_RETRY_MS / 50) as usize);
    assert!(
        owned(&mut p, 1, DEN).is_empty(),
        "the stock lives: not restocked"
    );
    assert_eq!(stocks(&mut p, DEN), [(stock, 1)]);
    let claim = p.store_holder("spawner:den:wolves").unwrap();
    assert_eq!(claim.entity, stock);
    assert!(
        claim.entity_epoch > 0,
        "rebound under the stock's new epoch"
    );

    // The stock dies: the owner of the point now restocks it, under a new generation.
    p.game_sends(
        1,
        game_message::Body::Despawn(local::Despawn { entity_id: stock }),
    );
    p.steps((2 * HELD_RETRY_MS / 50) as usize);
    let next = owned(&mut p, 1, DEN);
    assert_eq!(next.len(), 1, "{next:?}");
    assert!(next[0].generation > first[0].generation);
    assert_ne!(next[0].entity_id, stock);
    assert_eq!(stocks(&mut p, DEN), [(next[0].entity_id, 1)]);
    assert_eq!(owned(&mut p, 2, DEN).len(), 1, "node 2 never again");
    for id in [1, 2] {
        assert!(p.node(id).errors.is_empty(), "{:?}", p.node(id).errors);
    }
}

#[test]
fn a_stock_never_spawned_is_given_up_when_its_point_moves_and_the_new_owner_stocks_it() {
    let mut p = Pair::new();
    p.node(2).stocks = false;
    p.steps(2);
    let mut p = {
        // Declared as in `declared`, with node 2's game holding its stock back.
        for id in [1, 2] {
            p.game_sends(
                id,
                game_message::Body::DeclareSpawners(local::DeclareSpawners {
                    points: vec![local::SpawnPoint {
                        key: DEN.into(),
                        x: 256.0,
                        y: 40.0,
                    }],
                }),
            );
        }
        p.steps(4);
        p
    };
    let given = owned(&mut p, 2, DEN);
    assert_eq!(given.len(), 1);
    // Not spawned for a while: the claim stays the stock's meanwhile.
    p.steps(100);
    assert_eq!(
        p.store_holder("spawner:den:wolves").map(|h| h.entity),
        Some(given[0].entity_id)
    );
    swap_halves(&mut p);
    p.steps((RELEASE_GRACE_MS / 50) as usize + 2);
    // Given up after the grace; node 1 is granted the den at its next try.
    p.steps((HELD_RETRY_MS / 50) as usize + 2);
    let taken = owned(&mut p, 1, DEN);
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert_ne!(taken[0].entity_id, given[0].entity_id);
    assert_eq!(stocks(&mut p, DEN), [(taken[0].entity_id, 1)]);
    // The old id may no longer be spawned by node 2.
    p.game_sends(
        2,
        game_message::Body::Spawn(local::Spawn {
            entity_id: given[0].entity_id,
            position: given[0].position,
            ..Default::default()
        }),
    );
    p.step();
    let e = p.node(2).errors.last().cloned().unwrap();
    assert_eq!(e.code, ErrorCode::NotOwner as i32, "{e:?}");
    assert!(p.node(2).entity(given[0].entity_id).is_none());
}

#[test]
fn bad_declarations_foreign_stock_ids_and_spawner_claims_are_refused() {
    let mut p = declared();
    let dup = local::SpawnPoint {
        key: "ore".into(),
        x: 1.0,
        y: 1.0,
    };
    p.game_sends(
        1,
        game_message::Body::DeclareSpawners(local::DeclareSpawners {
            points: vec![dup.clone(), dup],
        }),
    );
    p.step();
    let e = p.node(1).errors.last().cloned().unwrap();
    assert_eq!(e.code, ErrorCode::InvalidValue as i32);
    assert!(e.detail.contains("declared twice"), "{}", e.detail);
    assert!(
        p.node(1).spawner_released.is_empty(),
        "the points before stay"
    );

    // An id of the spawners' range that was not handed to this node.
    let foreign = spawn_id(DEN, 12345);
    p.spawn(1, foreign, 100.0);
    p.step();
    let e = p.node(1).errors.last().cloned().unwrap();
    assert_eq!(e.code, ErrorCode::NotOwner as i32);
    assert!(p.node(1).entity(foreign).is_none());

    // A game's claim may not name a spawn point's key.
    p.spawn(1, 0x61, 100.0);
    p.step();
    p.claim(1, "spawner:den:wolves", 0x61, 5_000, 9);
    p.step();
    let r = p.node(1).claim_result_of(9)[0].clone();
    assert_eq!(r.outcome, Outcome::ClaimFailed as i32);
    assert!(r.detail.contains("spawn points"), "{}", r.detail);
}
