//! View recomputation when an avatar crosses a chunk border (radius 5, release margin 1):
//!
//! - `move_anchor/*`: the view alone (121 chunks) on the default world: a step east or
//!   diagonally (11 or 21 chunks enter), and a teleport (all of them);
//! - `fold/*`: the whole tick of the walker's gateway with 1 000 entities on a 32 × 32-chunk world
//!   (about 120 in view): a step within a chunk (the baseline) against a step over a border,
//!   whose APPEARs and VANISHes are decided and encoded;
//! - `subscriptions/*`: the node-level subscription set brought up to date after that step,
//!   for a node of a 16 × 16 grid on the default world that keeps its whole border band
//!   subscribed (view radius 5, reach 3) and has one client looking into a neighbour's area:
//!   `whole_*` works out every pair again (the baseline), `by_chunk_*` only the 22 chunks that
//!   came into the view or left it, as the node does.
use cellmesh_benches::{account, avatar, npc, positions, square_world, CHUNK};
use cellmesh_sidecar::model::audience::Audience;
use cellmesh_sidecar::model::entities::{EntityTable, EntityUpdate, Position};
use cellmesh_sidecar::model::fold::Clients;
use cellmesh_sidecar::model::interest::{InterestShape, View};
use cellmesh_sidecar::model::node_set::NodeSet;
use cellmesh_sidecar::model::subs::{band, Subscriptions};
use cellmesh_world::geometry::{ChunkPos, Pos, WorldShape};
use cellmesh_world::partition::{Grid, Layout, NodeId, Partition};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::collections::{BTreeSet, HashMap};

const SHAPE: InterestShape = InterestShape {
    radius: 5,
    margin: 1,
};
const MAX_FRAME: usize = cellmesh_proto::codec::DEFAULT_MAX_FRAME;

fn move_anchor(c: &mut Criterion) {
    let world = WorldShape::default();
    let mut g = c.benchmark_group("view");
    g.throughput(Throughput::Elements(1));
    for (name, (dx, dy)) in [("step_east", (1, 0)), ("step_diagonal", (1, 1))] {
        let mut view = View::default();
        let mut at = ChunkPos { x: 100, y: 100 };
        view.move_anchor(&world, SHAPE, at);
        g.bench_function(format!("move_anchor/{name}"), |b| {
            b.iter(|| {
                at = world.normalise_chunk(ChunkPos {
                    x: at.x + dx,
                    y: at.y + dy,
                });
                view.move_anchor(&world, SHAPE, at)
            })
        });
    }
    let mut view = View::default();
    let far = [ChunkPos { x: 100, y: 100 }, ChunkPos { x: 2100, y: 2100 }];
    let mut k = 0;
    g.bench_function("move_anchor/teleport", |b| {
        b.iter(|| {
            k += 1;
            view.move_anchor(&world, SHAPE, far[k % 2])
        })
    });
    g.finish();
}

fn fold(c: &mut Criterion) {
    let world = square_world(32);
    let mut g = c.benchmark_group("view");
    g.throughput(Throughput::Elements(1));
    for (name, step) in [("step_within_chunk", 0.0), ("step_over_border", CHUNK)] {
        let mut table = EntityTable::new(world);
        for (i, p) in positions(&world, 1000, 3).into_iter().enumerate() {
            table.spawn(npc(i as u64 + 2, p)).unwrap();
        }
        let me = account(0);
        let start = Pos {
            x: CHUNK / 4.0,
            y: CHUNK / 2.0,
        };
        table
            .spawn(avatar(1, &me, start, Audience::OwnerOnly))
            .unwrap();
        let mut clients = Clients::new(world, SHAPE);
        clients.add(0, &me);
        let spawned = table.take_changes();
        clients.fold(1, &table, &spawned, &[], &[], MAX_FRAME);
        // Within a chunk the avatar paces a metre back and forth; over borders it walks east
        // around the world, a chunk per tick.
        let mut k = 0u64;
        g.bench_function(format!("fold/{name}"), |b| {
            b.iter(|| {
                k += 1;
                let x = if step == 0.0 {
                    start.x + (k % 2) as f64
                } else {
                    start.x + k as f64 * step
                };
                table
                    .update(EntityUpdate {
                        id: 1,
                        position: Some(Position::new(x, start.y, 0.0)),
                        ..Default::default()
                    })
                    .unwrap();
                let changes = table.take_changes();
                clients.fold(k + 1, &table, &changes, &[], &[], MAX_FRAME)
            })
        });
    }
    g.finish();
}

fn subscriptions(c: &mut Criterion) {
    let world = WorldShape::default();
    let nodes: Vec<NodeId> = (0..256).collect();
    let grid = Grid::even(&world, 16, 16, &nodes).unwrap();
    let partition = Partition::new(world, 1, Layout::Grid(grid)).unwrap();
    let me: NodeId = 17;
    let held = band(&partition, me, 5, 3);
    // A client of this gateway whose avatar stands 20 chunks into the eastern neighbour.
    let area = partition.area_of(me)[0];
    let anchor = ChunkPos {
        x: area.x1 + 20,
        y: (area.y0 + area.y1) / 2,
    };
    let view_at = |a: ChunkPos| -> Vec<(ChunkPos, NodeId)> {
        world
            .chunks_within(a, SHAPE.radius)
            .into_iter()
            .map(|c| (c, partition.owner_of_chunk(c)))
            .filter(|(_, n)| *n != me)
            .collect()
    };
    let views = [
        view_at(anchor),
        view_at(ChunkPos {
            x: anchor.x + 1,
            ..anchor
        }),
    ];
    let mut subs = Subscriptions::default();
    subs.update(held.iter().copied().chain(views[0].iter().copied()));
    let pairs = subs.len();
    let mut k = 0;
    let mut g = c.benchmark_group("view");
    g.throughput(Throughput::Elements(1));
    // The baseline: every pair worked out again.
    g.bench_function(
        format!("subscriptions/whole_after_step_{pairs}_pairs"),
        |b| {
            b.iter(|| {
                k += 1;
                let changes = subs.update(held.iter().copied().chain(views[k % 2].iter().copied()));
                assert_eq!(changes.subscribe.values().map(Vec::len).sum::<usize>(), 11);
                changes
            })
        },
    );
    // What the node does: only the chunks that came into the view or left it, each worked out
    // from the band and the view as they stand.
    let mut band_of: HashMap<ChunkPos, NodeSet> = HashMap::new();
    for (c, n) in held.iter().copied() {
        band_of.entry(c).or_default().insert(n);
    }
    let chunks =
        |v: &[(ChunkPos, NodeId)]| -> BTreeSet<ChunkPos> { v.iter().map(|p| p.0).collect() };
    let flipped: Vec<ChunkPos> = chunks(&views[0])
        .symmetric_difference(&chunks(&views[1]))
        .copied()
        .collect();
    let viewed: [HashMap<ChunkPos, NodeSet>; 2] = views.clone().map(|v| {
        let mut m: HashMap<ChunkPos, NodeSet> = HashMap::new();
        for (c, n) in v {
            m.entry(c).or_default().insert(n);
        }
        m
    });
    let mut subs = Subscriptions::default();
    subs.update(held.iter().copied().chain(views[0].iter().copied()));
    let mut k = 0;
    g.bench_function(
        format!("subscriptions/by_chunk_after_step_{pairs}_pairs"),
        |b| {
            b.iter(|| {
                k += 1;
                let view = &viewed[k % 2];
                let changes = subs.update_chunks(flipped.iter().map(|c| {
                    let mut nodes = band_of.get(c).cloned().unwrap_or_default();
                    nodes.extend(view.get(c).into_iter().flat_map(NodeSet::iter));
                    (*c, nodes)
                }));
                assert_eq!(changes.subscribe.values().map(Vec::len).sum::<usize>(), 11);
                changes
            })
        },
    );
    g.finish();
}

criterion_group!(benches, move_anchor, fold, subscriptions);
criterion_main!(benches);
