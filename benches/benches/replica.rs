//! The gateway's replica store (render ghosts in the entity table) applying its owners' frames:
//! one tick of 1 000 ghosts each moving half a metre, alone or with one public component changed
//! (as a delta `EntityState` is applied), and the same ghosts set from full states (a
//! subscription's snapshot burst, or a resync). Each includes `take_changes`, which ends the tick.
use cellmesh_benches::{component, npc, positions, square_world, CHUNK};
use cellmesh_sidecar::model::audience::Audience;
use cellmesh_sidecar::model::entities::{EntityTable, EntityUpdate, NewEntity, Position};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

const GHOSTS: usize = 1000;
/// The node that owns every ghost.
const OWNER: u32 = 2;

fn replica(c: &mut Criterion) {
    let world = square_world(64);
    let at = positions(&world, GHOSTS, 11);
    let mut table = EntityTable::new(world);
    let ghosts: Vec<NewEntity> = at
        .iter()
        .enumerate()
        .map(|(i, &p)| NewEntity {
            origin: Some(OWNER),
            ..npc(i as u64 + 1, p)
        })
        .collect();
    for g in &ghosts {
        table.set_ghost(g.clone()).unwrap();
    }
    table.take_changes();
    // Two poses a step apart, alternated so every update is a move; a step of half a metre
    // takes about one ghost in 32 over a chunk border each tick.
    let step = CHUNK / 64.0;
    let updates = |k: u64, with_component: bool| -> Vec<EntityUpdate> {
        let dx = if k.is_multiple_of(2) { step } else { 0.0 };
        at.iter()
            .enumerate()
            .map(|(i, p)| EntityUpdate {
                id: i as u64 + 1,
                position: Some(Position::new(p.x + dx, p.y, 0.0)),
                changed: if with_component {
                    vec![(2, component(Audience::PublicInRange, k + i as u64))]
                } else {
                    vec![]
                },
                removed: vec![],
            })
            .collect()
    };

    let mut g = c.benchmark_group("replica");
    g.throughput(Throughput::Elements(GHOSTS as u64));
    for (name, with_component) in [
        ("update_move_only", false),
        ("update_move_and_component", true),
    ] {
        let mut k = 0u64;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    k += 1;
                    updates(k, with_component)
                },
                |batch| {
                    for u in batch {
                        table.update(u).unwrap();
                    }
                    table.take_changes()
                },
                BatchSize::SmallInput,
            )
        });
    }
    let mut k = 0u64;
    g.bench_function("set_ghost_full_state", |b| {
        b.iter_batched(
            || {
                k += 1;
                let dx = if k.is_multiple_of(2) { step } else { 0.0 };
                ghosts
                    .iter()
                    .map(|e| NewEntity {
                        position: Position::new(e.position.x + dx, e.position.y, 0.0),
                        ..e.clone()
                    })
                    .collect::<Vec<_>>()
            },
            |batch| {
                for e in batch {
                    table.set_ghost(e).unwrap();
                }
                table.take_changes()
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, replica);
criterion_main!(benches);
