//! `owner_of` on the default world (131 072 m, 32 m chunks): the 16 × 16 grid (O(1)) against a
//! 256-leaf BSP of the same regions (O(depth), depth 8). Both allocate nothing per lookup.
use std::hint::black_box;

use cellmesh_benches::positions;
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Bsp, Grid, Layout, NodeId, Partition};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn owner_of(c: &mut Criterion) {
    let shape = WorldShape::default();
    let nodes: Vec<NodeId> = (0..256).collect();
    let grid = Grid::even(&shape, 16, 16, &nodes).unwrap();
    let bsp = Bsp::from_grid(&grid).unwrap();
    assert_eq!(bsp.leaf_count(), 256);
    let grid = Partition::new(shape, 1, Layout::Grid(grid)).unwrap();
    let bsp = Partition::new(shape, 1, Layout::Bsp(bsp)).unwrap();
    // Spread over the world, as the sidecar keeps them (one outside it costs a float remainder
    // per axis more).
    let points = positions(&shape, 1024, 0x9e37_79b9_7f4a_7c15);

    let mut g = c.benchmark_group("owner_of");
    g.throughput(Throughput::Elements(points.len() as u64));
    for (name, p) in [("grid_16x16", &grid), ("bsp_256_leaves", &bsp)] {
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut sum = 0u64;
                for &pos in &points {
                    sum += u64::from(p.owner_of(black_box(pos)).unwrap());
                }
                sum
            })
        });
    }
    g.finish();
}

criterion_group!(benches, owner_of);
criterion_main!(benches);
