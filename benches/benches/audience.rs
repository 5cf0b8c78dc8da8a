//! Audience resolution for every audience kind, on both sides of the mesh.
//!
//! - `audience_fold`: the gateway's fold delivering one tick's events, or component updates, to
//!   the sessions each audience admits (views for the public kind, account lookups for the
//!   others), encoding and batching included. 200 sessions, each avatar's view 5 chunks around
//!   it, 1 000 entities on a 32 × 32-chunk world (about 120 in each view); 100 avatars touched per
//!   tick. A public piece reaches about 26 sessions, a named one 1 or 8. `idle_tick` is the fixed
//!   cost every tick pays to check 200 anchors.
//! - `audience_route`: the owner's side for the same 100 updates: what each named account may
//!   see (`account_views`, run for every changed entity, public ones included), then grouping
//!   the pieces by the gateway of each account (`resolve`; the public kind never gets there, it
//!   follows chunk subscriptions).
use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;

use bytes::Bytes;
use cellmesh_benches::{account, avatar, component, npc, positions, square_world};
use cellmesh_proto::mesh::PieceKind;
use cellmesh_sidecar::model::audience::Audience;
use cellmesh_sidecar::model::entities::{EntityTable, EntityUpdate, TickChanges};
use cellmesh_sidecar::model::fold::{Clients, TickEvent};
use cellmesh_sidecar::model::interest::InterestShape;
use cellmesh_sidecar::model::route::{self, Addressed, Target};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const SESSIONS: usize = 200;
const NPCS: usize = 800;
/// Avatars carrying an event or a changed component in one tick.
const TOUCHED: usize = 100;
/// Accounts an audience names (for `OWNER_AND_PARTY`, the owner and seven listed).
const NAMED: usize = 8;
const MAX_FRAME: usize = cellmesh_proto::codec::DEFAULT_MAX_FRAME;
/// Remote gateways the named accounts are spread over.
const GATEWAYS: usize = 4;

/// The accounts after `owner`'s, wrapping around the sessions.
fn others(owner: usize, n: usize) -> Arc<[String]> {
    (1..=n).map(|k| account((owner + k) % SESSIONS)).collect()
}

type AudienceOf = fn(usize) -> Audience;

/// Every kind, as the audience of avatar `i`'s type 2 component and events.
const KINDS: [(&str, AudienceOf); 4] = [
    ("public_in_range", |_| Audience::PublicInRange),
    ("owner_only", |_| Audience::OwnerOnly),
    ("accounts_8", |i| Audience::Accounts(others(i, NAMED))),
    ("owner_and_party_8", |i| {
        Audience::OwnerAndParty(others(i, NAMED - 1))
    }),
];

/// One gateway node after the tick that spawned everything: every session shown its view.
struct Gateway {
    table: EntityTable,
    clients: Clients,
}

fn gateway(audience_of: AudienceOf) -> Gateway {
    let world = square_world(32);
    let mut table = EntityTable::new(world);
    let mut clients = Clients::new(world, InterestShape::new(5, 1));
    let at = positions(&world, SESSIONS + NPCS, 7);
    for (i, &p) in at.iter().enumerate() {
        let id = i as u64 + 1;
        if i < SESSIONS {
            table
                .spawn(avatar(id, &account(i), p, audience_of(i)))
                .unwrap();
            clients.add(i as u64, &account(i));
        } else {
            table.spawn(npc(id, p)).unwrap();
        }
    }
    let spawned = table.take_changes();
    clients.fold(1, &table, &spawned, &[], &[], MAX_FRAME);
    Gateway { table, clients }
}

fn fold(c: &mut Criterion) {
    let mut g = c.benchmark_group("audience_fold");
    {
        let Gateway { table, mut clients } = gateway(KINDS[0].1);
        let none = TickChanges::new();
        g.bench_function("idle_tick", |b| {
            b.iter(|| clients.fold(2, &table, &none, &[], &[], MAX_FRAME))
        });
    }
    g.throughput(Throughput::Elements(TOUCHED as u64));
    for (name, audience_of) in KINDS {
        let Gateway { table, mut clients } = gateway(audience_of);
        let events: Vec<TickEvent> = (0..TOUCHED)
            .map(|i| {
                let e = table.get(i as u64 + 1).unwrap();
                TickEvent {
                    entity_id: e.id,
                    chunk: e.chunk,
                    owner_account: e.owner_account.to_string(),
                    audience: audience_of(i),
                    r#type: 9,
                    payload: cellmesh_benches::payload(i as u64),
                }
            })
            .collect();
        let none = TickChanges::new();
        let out = clients.fold(2, &table, &none, &events, &[], MAX_FRAME);
        assert!(out.events >= TOUCHED as u64, "{name}: {}", out.events);
        g.bench_function(format!("event/{name}"), |b| {
            b.iter(|| clients.fold(2, &table, &none, &events, &[], MAX_FRAME))
        });
    }
    for (name, audience_of) in KINDS {
        let Gateway {
            mut table,
            mut clients,
        } = gateway(audience_of);
        for i in 0..TOUCHED {
            table
                .update(EntityUpdate {
                    id: i as u64 + 1,
                    changed: vec![(2, component(audience_of(i), 1_000 + i as u64))],
                    ..Default::default()
                })
                .unwrap();
        }
        let changes = table.take_changes();
        // The first fold shows accounts out of range what names them; the steady state follows.
        clients.fold(2, &table, &changes, &[], &[], MAX_FRAME);
        let out = clients.fold(3, &table, &changes, &[], &[], MAX_FRAME);
        assert!(out.deltas >= TOUCHED as u64, "{name}: {}", out.deltas);
        g.bench_function(format!("update/{name}"), |b| {
            b.iter(|| clients.fold(3, &table, &changes, &[], &[], MAX_FRAME))
        });
    }
    g.finish();
}

fn routing(c: &mut Criterion) {
    let mut g = c.benchmark_group("audience_route");
    g.throughput(Throughput::Elements(TOUCHED as u64));
    // Every named session lives on another node.
    let routes: HashMap<String, Target> = (0..SESSIONS)
        .map(|i| {
            let target = Target::Remote {
                gateway: 2 + (i % GATEWAYS) as u32,
                session_epoch: i as u64 + 1,
            };
            (account(i), target)
        })
        .collect();
    for (name, audience_of) in KINDS {
        let Gateway { mut table, .. } = gateway(audience_of);
        for i in 0..TOUCHED {
            table
                .update(EntityUpdate {
                    id: i as u64 + 1,
                    changed: vec![(2, component(audience_of(i), 1_000 + i as u64))],
                    ..Default::default()
                })
                .unwrap();
        }
        let changes = table.take_changes();
        let changed: Vec<_> = changes
            .iter()
            .map(|(id, ch)| (table.get(*id).unwrap(), ch))
            .collect();
        g.bench_function(format!("account_views/{name}"), |b| {
            b.iter(|| {
                changed
                    .iter()
                    .map(|(e, ch)| route::account_views(e, ch).len())
                    .sum::<usize>()
            })
        });
        let audience = audience_of(0);
        if audience.is_public() {
            continue;
        }
        let pieces: Vec<Addressed> = changed
            .iter()
            .map(|(e, _)| Addressed {
                kind: PieceKind::PieceDelta,
                audience: route::kind_of(&audience),
                encoded: Bytes::from(vec![0u8; 48]),
                accounts: route::account_views(e, &changes[&e.id])
                    .into_keys()
                    .collect(),
            })
            .collect();
        assert!(pieces.iter().all(|p| !p.accounts.is_empty()), "{name}");
        let target = |a: &str| routes.get(a).copied().unwrap_or(Target::Unknown);
        g.bench_function(format!("resolve/{name}"), |b| {
            b.iter(|| route::resolve(black_box(&pieces), target))
        });
    }
    g.finish();
}

criterion_group!(benches, fold, routing);
criterion_main!(benches);
