//! The handoff state machines' own cost, in memory (no links, no game):
//!
//! - `round_trip/*`: one complete handoff per iteration, source and target side: freeze, an input
//!   held, the game's snapshot of every member, the offer, an input forwarded behind it and held
//!   by the target's fence, the target's checks and adopt, the fence advanced on both sides, the
//!   ack. The unit goes back and forth between two nodes, so the state stays bounded;
//! - `fence_admit`: the fence every replicated frame passes, 1 000 entities at their epoch;
//! - `trigger`: the per-tick check of whether an owned entity must be handed over, for 1 000
//!   entities of one node of a 16 × 16 grid on the default world.
use bytes::Bytes;
use cellmesh_benches::Rng;
use cellmesh_sidecar::model::handoff::{
    trigger, Admit, EntityId, Epoch, Fence, FenceRecords, HandoffSource, HandoffTarget, InputRoute,
    OfferChecks, OfferDecision, DEFAULT_MARGIN_CHUNKS,
};
use cellmesh_world::geometry::{ChunkPos, WorldShape};
use cellmesh_world::partition::{Grid, Layout, NodeId, Partition};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::collections::HashMap;

const CHECKS: OfferChecks = OfferChecks::PASSING;

/// The fence's records of each entity's epoch and writer (the sidecar keeps them in its entity
/// table).
#[derive(Default)]
struct Records(HashMap<EntityId, (Epoch, NodeId)>);

impl FenceRecords for Records {
    fn fenced(&self, id: EntityId) -> Option<(Epoch, NodeId)> {
        self.0.get(&id).copied()
    }
    fn set_fenced(&mut self, id: EntityId, epoch: Epoch, owner: NodeId) {
        self.0.insert(id, (epoch, owner));
    }
    fn forget_fenced(&mut self, id: EntityId) {
        self.0.remove(&id);
    }
}

/// The handoff state of one node.
struct Node {
    id: NodeId,
    out: HandoffSource<Bytes>,
    inbound: HandoffTarget,
    fence: Fence<Bytes>,
    records: Records,
}

impl Node {
    fn new(id: NodeId, members: &[EntityId], owner: NodeId) -> Self {
        let mut fence = Fence::default();
        let mut records = Records::default();
        for &m in members {
            fence.advance(&mut records, m, 1, owner);
        }
        Self {
            id,
            out: HandoffSource::default(),
            inbound: HandoffTarget::default(),
            fence,
            records,
        }
    }
}

/// Hands the unit `members` (the root first), owned by `src` under `epoch`, to `dst`; returns
/// the new epoch.
fn hand_over(
    src: &mut Node,
    dst: &mut Node,
    members: &[EntityId],
    epoch: Epoch,
    snapshot: &Bytes,
    input: &Bytes,
) -> Epoch {
    let root = members[0];
    let freeze = src
        .out
        .begin(root, epoch, &members[1..], dst.id, 1_000)
        .unwrap();
    assert_eq!(src.out.route_input(root, input.clone()), InputRoute::Held);
    let mut offer = None;
    for &m in &freeze.members {
        offer = src.out.snapshot(m, snapshot.clone()).unwrap();
    }
    let offer = offer.expect("every member has its snapshot");
    let InputRoute::Forward {
        epoch: at, input, ..
    } = src.out.route_input(root, input.clone())
    else {
        panic!("an input behind the offer follows it");
    };
    assert_eq!(
        dst.fence.admit(&mut dst.records, root, at, None, input),
        Admit::Held
    );
    let known = dst.fence.current(&dst.records, root).map(|(e, _)| e);
    let decision = dst.inbound.offer(src.id, root, offer.epoch, known, CHECKS);
    assert_eq!(decision, OfferDecision::Adopt);
    for &m in members {
        dst.out.forget(m);
    }
    let source = dst.inbound.adopted(root, offer.epoch).unwrap();
    let mut due = 0;
    for &m in members {
        due += dst
            .fence
            .advance(&mut dst.records, m, offer.epoch, dst.id)
            .len();
    }
    assert_eq!(due, 1, "the forwarded input is due once adopted");
    let done = src.out.acked(root, offer.epoch, dst.id, 1_040).unwrap();
    assert_eq!(source, src.id);
    for &m in &done.members {
        src.fence.advance(&mut src.records, m, done.epoch, dst.id);
    }
    done.epoch
}

fn round_trip(c: &mut Criterion) {
    let mut g = c.benchmark_group("handoff");
    g.throughput(Throughput::Elements(1));
    let snapshot = Bytes::from(vec![5u8; 256]);
    let input = Bytes::from(vec![1u8; 24]);
    for (name, members) in [
        ("round_trip/avatar", vec![10]),
        ("round_trip/avatar_and_3_attachments", vec![10, 11, 12, 13]),
    ] {
        let mut nodes = [Node::new(1, &members, 1), Node::new(2, &members, 1)];
        let mut epoch = 1;
        g.bench_function(name, |b| {
            b.iter(|| {
                let [one, two] = &mut nodes;
                // Odd epochs are written by node 1, even ones by node 2.
                let (src, dst) = if epoch % 2 == 1 {
                    (one, two)
                } else {
                    (two, one)
                };
                epoch = hand_over(src, dst, &members, epoch, &snapshot, &input);
                epoch
            })
        });
    }
    g.finish();
}

fn fence(c: &mut Criterion) {
    const N: u64 = 1000;
    let mut fence = Fence::<u64>::default();
    let mut records = Records::default();
    for id in 1..=N {
        fence.advance(&mut records, id, 3, 2);
    }
    let mut g = c.benchmark_group("handoff");
    g.throughput(Throughput::Elements(N));
    g.bench_function("fence_admit", |b| {
        b.iter(|| {
            let mut accepted = 0;
            for id in 1..=N {
                if let Admit::Accept(_) = fence.admit(&mut records, id, 3, Some(2), id) {
                    accepted += 1;
                }
            }
            accepted
        })
    });
    g.finish();
}

fn triggers(c: &mut Criterion) {
    const N: usize = 1000;
    let world = WorldShape::default();
    let nodes: Vec<NodeId> = (0..256).collect();
    let grid = Grid::even(&world, 16, 16, &nodes).unwrap();
    let partition = Partition::new(world, 1, Layout::Grid(grid)).unwrap();
    let me: NodeId = 17;
    let area = partition.area_of(me);
    // Owned entities stand in the area or up to the reach past it: one in ten past the line.
    let r = area[0];
    let mut rng = Rng::new(5);
    let chunks: Vec<ChunkPos> = (0..N)
        .map(|i| {
            let x = r.x0 + rng.below((r.x1 - r.x0) as u64) as i64;
            let y = r.y0 + rng.below((r.y1 - r.y0) as u64) as i64;
            if i % 10 == 0 {
                ChunkPos {
                    x: r.x1 + rng.below(3) as i64,
                    y,
                }
            } else {
                ChunkPos { x, y }
            }
        })
        .collect();
    let mut g = c.benchmark_group("handoff");
    g.throughput(Throughput::Elements(N as u64));
    g.bench_function("trigger", |b| {
        b.iter(|| {
            chunks
                .iter()
                .filter(|&&c| trigger(&partition, me, &area, c, DEFAULT_MARGIN_CHUNKS).is_some())
                .count()
        })
    });
    g.finish();
}

criterion_group!(benches, round_trip, fence, triggers);
criterion_main!(benches);
