//! The torus and the partition: every point has exactly one owner, neighbours come with the
//! offsets that wrap them next to us, and the diff between two epochs names exactly the chunks
//! that changed hands.

use std::collections::{BTreeMap, BTreeSet};

use cellmesh_world::geometry::{ChunkOffset, ChunkPos, ChunkRect, Pos, RegionPos, WorldShape};
use cellmesh_world::partition::{
    Axis, Bsp, BspEntryKind, BspTree, Grid, Layout, Neighbour, NodeId, Partition, PartitionError,
    Transfer,
};
use proptest::prelude::*;

/// A world of `cx × cy` chunks of 32 m whose region grid is `rx × ry`.
fn world(cx: i64, cy: i64) -> WorldShape {
    WorldShape {
        width: cx as f64 * 32.0,
        height: cy as f64 * 32.0,
        chunk_size: 32.0,
        region_size: 32.0,
    }
}

fn grid(shape: WorldShape, cols: u32, rows: u32, table: Vec<NodeId>) -> Partition {
    let g = Grid::new(&shape, cols, rows, table).unwrap();
    Partition::new(shape, 1, Layout::Grid(g)).unwrap()
}

fn bsp(shape: WorldShape, tree: BspTree) -> Partition {
    let b = Bsp::new(&shape, &tree).unwrap();
    Partition::new(shape, 1, Layout::Bsp(b)).unwrap()
}

fn n(node: NodeId, x: i64, y: i64) -> Neighbour {
    Neighbour {
        node,
        offset: ChunkOffset { x, y },
    }
}

fn sorted(mut v: Vec<Neighbour>) -> Vec<Neighbour> {
    v.sort();
    v
}

/// Checks that the cells tile the world exactly and agree with every lookup.
fn assert_one_owner_everywhere(p: &Partition) {
    let shape = p.shape();
    let (cx, cy) = (shape.chunks_x(), shape.chunks_y());
    let mut owner = vec![None; (cx * cy) as usize];
    for (rect, node) in p.cells() {
        assert!(!rect.is_empty(), "empty cell {rect}");
        for c in rect.chunks() {
            assert!(
                shape.world_rect().contains(c),
                "cell {rect} leaves the world"
            );
            let slot = &mut owner[(c.y * cx + c.x) as usize];
            assert_eq!(*slot, None, "chunk {c:?} is in two cells");
            *slot = Some(node);
        }
    }
    let areas: BTreeMap<NodeId, Vec<ChunkRect>> =
        p.nodes().into_iter().map(|n| (n, p.area_of(n))).collect();
    for y in 0..cy {
        for x in 0..cx {
            let c = ChunkPos { x, y };
            let node = owner[(y * cx + x) as usize].unwrap_or_else(|| panic!("{c:?} has no cell"));
            assert_eq!(p.owner_of_chunk(c), node, "owner_of_chunk({c:?})");
            // The same chunk seen through any number of wraps.
            let far = ChunkPos {
                x: x - 7 * cx,
                y: y + 3 * cy,
            };
            assert_eq!(p.owner_of_chunk(far), node);
            let centre = Pos {
                x: (x as f64 + 0.5) * shape.chunk_size,
                y: (y as f64 + 0.5) * shape.chunk_size,
            };
            assert_eq!(p.owner_of(centre).unwrap(), node);
            for (n, area) in &areas {
                let inside = area.iter().filter(|r| r.contains(c)).count();
                assert_eq!(inside, usize::from(*n == node), "area_of({n}) at {c:?}");
            }
        }
    }
}

/// Chunk → (old owner, new owner) for every chunk whose owner differs, by brute force.
fn changed_by_lookup(old: &Partition, new: &Partition) -> BTreeMap<ChunkPos, (NodeId, NodeId)> {
    old.shape()
        .world_rect()
        .chunks()
        .filter_map(|c| {
            let (a, b) = (old.owner_of_chunk(c), new.owner_of_chunk(c));
            (a != b).then_some((c, (a, b)))
        })
        .collect()
}

fn changed_by_diff(transfers: &[Transfer]) -> BTreeMap<ChunkPos, (NodeId, NodeId)> {
    let mut out = BTreeMap::new();
    for t in transfers {
        for c in t.area.chunks() {
            assert!(out.insert(c, (t.from, t.to)).is_none(), "{c:?} named twice");
        }
    }
    out
}

fn assert_diff_exact(old: &Partition, new: &Partition) -> Vec<Transfer> {
    let d = old.diff(new).unwrap();
    assert_eq!(changed_by_diff(&d), changed_by_lookup(old, new));
    d
}

// ---------------------------------------------------------------------------------------------
// Geometry

fn pos() -> impl Strategy<Value = f64> {
    prop_oneof![-1e12f64..1e12, -1e6f64..1e6, -2000.0f64..2000.0]
}

proptest! {
    #[test]
    fn delta_and_distance_are_a_metric_on_the_torus(
        cx in 1i64..64, cy in 1i64..64,
        ax in pos(), ay in pos(), bx in pos(), by in pos(), qx in pos(), qy in pos(),
    ) {
        let w = world(cx, cy);
        let (a, b, q) = (Pos { x: ax, y: ay }, Pos { x: bx, y: by }, Pos { x: qx, y: qy });
        // Raw coordinates up to 1e12 carry ~1e-4 m of rounding into every difference.
        let eps = 1e-3;
        let (dx, dy) = w.delta(a, b);
        let (ex, ey) = w.delta(b, a);
        prop_assert!(dx.abs() <= w.width / 2.0 && dy.abs() <= w.height / 2.0);
        // Antisymmetric, except at the half-world tie where both sides pick -size/2.
        prop_assert!((dx + ex).abs() < eps || (dx.abs() - w.width / 2.0).abs() < eps, "{dx} {ex}");
        prop_assert!((dy + ey).abs() < eps || (dy.abs() - w.height / 2.0).abs() < eps, "{dy} {ey}");
        let d = |p, q| w.distance(p, q);
        prop_assert!((d(a, b) - d(b, a)).abs() < eps);
        prop_assert!(d(a, q) <= d(a, b) + d(b, q) + eps);
        prop_assert!(d(a, b) <= w.width.hypot(w.height) / 2.0 + eps);
        let na = w.normalise(a);
        prop_assert!((0.0..w.width).contains(&na.x) && (0.0..w.height).contains(&na.y));
        prop_assert_eq!(w.normalise(na), na);
        prop_assert!(d(a, na) < eps);
    }

    #[test]
    fn chunk_and_region_coordinates_normalise(
        rx in 1i64..6, ry in 1i64..6, side in 1i64..5,
        x in -1_000_000i64..1_000_000, y in -1_000_000i64..1_000_000,
    ) {
        let w = WorldShape {
            width: (rx * side * 32) as f64,
            height: (ry * side * 32) as f64,
            chunk_size: 32.0,
            region_size: (side * 32) as f64,
        };
        w.validate().unwrap();
        let c = w.normalise_chunk(ChunkPos { x, y });
        prop_assert_eq!(w.normalise_chunk(c), c);
        prop_assert!(w.world_rect().contains(c));
        let r = w.region_of_chunk(ChunkPos { x, y });
        prop_assert_eq!(w.normalise_region(r), r);
        prop_assert!(w.region_rect(r).contains(c));
        prop_assert_eq!(w.region_rect(RegionPos { x: r.x + rx, y: r.y - 3 * ry }), w.region_rect(r));
    }

    #[test]
    fn rect_distance_is_the_nearest_chunk_pair_on_the_torus(
        cx in 1i64..12, cy in 1i64..12,
        a in (0i64..12, 0i64..12, 1i64..12, 1i64..12),
        b in (0i64..12, 0i64..12, 1i64..12, 1i64..12),
        radius in 0i64..12,
    ) {
        let w = world(cx, cy);
        let rect = |(x, y, wd, ht): (i64, i64, i64, i64)| {
            let (x, y) = (x % cx, y % cy);
            ChunkRect::new(x, y, (x + wd).min(cx), (y + ht).min(cy))
        };
        let (a, b) = (rect(a), rect(b));
        let brute = a
            .chunks()
            .flat_map(|p| b.chunks().map(move |q| (p, q)))
            .map(|(p, q)| w.chunk_distance(p, q))
            .min()
            .unwrap();
        prop_assert_eq!(w.rect_distance(&a, &b), brute);
        prop_assert_eq!(w.rect_distance(&b, &a), brute);
        let radius = radius.min(cx.max(cy));
        let offsets = w.rect_offsets_within(&a, &b, radius).unwrap();
        // Every copy of `b` near `a` is listed once, and only those.
        for kx in -3..=3 {
            for ky in -3..=3 {
                let o = ChunkOffset { x: kx * cx, y: ky * cy };
                let near = a.distance(&b.translated(o)) <= radius;
                prop_assert_eq!(offsets.iter().filter(|&&x| x == o).count(), usize::from(near));
            }
        }
    }
}

#[test]
fn chunk_rects_measure_the_plane() {
    let a = ChunkRect::new(0, 0, 4, 4);
    assert_eq!(a.area(), 16);
    assert_eq!(a.distance(&ChunkRect::new(4, 0, 8, 4)), 1); // touching
    assert_eq!(a.distance(&ChunkRect::new(2, 2, 8, 8)), 0); // overlapping
    assert_eq!(a.distance(&ChunkRect::new(9, 6, 10, 7)), 6);
    assert_eq!(
        a.intersection(&ChunkRect::new(2, 3, 9, 9)),
        Some(ChunkRect::new(2, 3, 4, 4))
    );
    assert_eq!(a.intersection(&ChunkRect::new(4, 0, 8, 4)), None);
    let w = world(10, 10);
    assert_eq!(
        w.rect_metres(&ChunkRect::new(1, 2, 4, 3)),
        (32.0, 64.0, 96.0, 32.0)
    );
    // Across the seam: [8, 10) and [0, 1) touch through x = 10 ≡ 0.
    assert_eq!(
        w.rect_distance(&ChunkRect::new(8, 0, 10, 1), &ChunkRect::new(0, 0, 1, 1)),
        1
    );
    let e = w.rect_offsets_within(&a, &a, 11).unwrap_err().to_string();
    assert!(e.contains("11") && e.contains("10×10"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Every point has exactly one owner

/// A grid over a random small world: `cols × rows` regions of `rw × rh` chunks.
fn any_grid() -> impl Strategy<Value = Partition> {
    (1u32..7, 1u32..7, 1i64..6, 1i64..6).prop_flat_map(|(cols, rows, rw, rh)| {
        prop::collection::vec(1u32..6, (cols * rows) as usize).prop_map(move |table| {
            grid(
                world(i64::from(cols) * rw, i64::from(rows) * rh),
                cols,
                rows,
                table,
            )
        })
    })
}

#[derive(Debug, Clone)]
enum Op {
    Split {
        pick: usize,
        axis: Axis,
        frac: f64,
        low: NodeId,
        high: NodeId,
    },
    Move {
        pick: usize,
        frac: f64,
    },
    Retire {
        pick: usize,
    },
    Assign {
        pick: usize,
        node: NodeId,
    },
}

fn any_op() -> impl Strategy<Value = Op> {
    let axis = prop_oneof![Just(Axis::X), Just(Axis::Y)];
    prop_oneof![
        3 => (any::<usize>(), axis, 0.0f64..=1.0, 1u32..6, 1u32..6)
            .prop_map(|(pick, axis, frac, low, high)| Op::Split { pick, axis, frac, low, high }),
        3 => (any::<usize>(), 0.0f64..=1.0).prop_map(|(pick, frac)| Op::Move { pick, frac }),
        1 => any::<usize>().prop_map(|pick| Op::Retire { pick }),
        1 => (any::<usize>(), 1u32..6).prop_map(|(pick, node)| Op::Assign { pick, node }),
    ]
}

fn within(lo: i64, hi: i64, frac: f64) -> i64 {
    lo + ((hi - lo) as f64 * frac).round() as i64
}

/// Applies `op` to a random entry of the right kind; only refusals that protect the tree are
/// expected (a move across an inner line, retiring the last cell).
fn apply(b: &mut Bsp, op: &Op) {
    let entries: Vec<_> = b.entries().collect();
    let leaves: Vec<_> = entries
        .iter()
        .filter(|e| matches!(e.kind, BspEntryKind::Leaf { .. }))
        .collect();
    let splits: Vec<_> = entries
        .iter()
        .filter(|e| matches!(e.kind, BspEntryKind::Split { .. }))
        .collect();
    let result = match *op {
        Op::Split {
            pick,
            axis,
            frac,
            low,
            high,
        } => {
            let e = leaves[pick % leaves.len()];
            let (lo, hi) = match axis {
                Axis::X => (e.rect.x0, e.rect.x1),
                Axis::Y => (e.rect.y0, e.rect.y1),
            };
            b.split(e.index, axis, within(lo, hi, frac), low, high)
        }
        Op::Move { pick, frac } if !splits.is_empty() => {
            let e = splits[pick % splits.len()];
            let BspEntryKind::Split { axis, .. } = e.kind else {
                unreachable!()
            };
            let (lo, hi) = match axis {
                Axis::X => (e.rect.x0, e.rect.x1),
                Axis::Y => (e.rect.y0, e.rect.y1),
            };
            b.move_line(e.index, within(lo, hi, frac))
        }
        Op::Move { .. } => Ok(()),
        Op::Retire { pick } => b.retire(leaves[pick % leaves.len()].index),
        Op::Assign { pick, node } => b.assign(leaves[pick % leaves.len()].index, node),
    };
    match result {
        Ok(()) | Err(PartitionError::WouldCross { .. }) | Err(PartitionError::LastCell) => {}
        Err(e) => panic!("{op:?} refused: {e}"),
    }
}

fn any_bsp() -> impl Strategy<Value = (Partition, Vec<Op>)> {
    (1i64..24, 1i64..24, prop::collection::vec(any_op(), 0..40)).prop_map(|(cx, cy, ops)| {
        let shape = world(cx, cy);
        let mut b = Bsp::new(&shape, &BspTree::leaf(1)).unwrap();
        for op in &ops {
            apply(&mut b, op);
        }
        (Partition::new(shape, 1, Layout::Bsp(b)).unwrap(), ops)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn every_point_of_a_grid_has_one_owner(p in any_grid(), x in pos(), y in pos()) {
        assert_one_owner_everywhere(&p);
        let far = Pos { x, y };
        let c = p.shape().chunk_of(far);
        prop_assert_eq!(p.owner_of(far).unwrap(), p.owner_of_chunk(c));
    }

    #[test]
    fn every_point_of_a_bsp_has_one_owner((p, _) in any_bsp(), x in pos(), y in pos()) {
        assert_one_owner_everywhere(&p);
        let far = Pos { x, y };
        prop_assert_eq!(p.owner_of(far).unwrap(), p.owner_of_chunk(p.shape().chunk_of(far)));
        // The stored form comes back as the same partition.
        let json = serde_json::to_string(&p).unwrap();
        prop_assert_eq!(serde_json::from_str::<Partition>(&json).unwrap(), p);
    }

    #[test]
    fn diff_names_exactly_the_chunks_that_change_hands(
        (p, _) in any_bsp(),
        ops in prop::collection::vec(any_op(), 1..6),
    ) {
        let mut next = p.bsp().unwrap().clone();
        for op in &ops {
            apply(&mut next, op);
        }
        let next = p.successor(Layout::Bsp(next)).unwrap();
        assert_diff_exact(&p, &next);
        assert_diff_exact(&next, &p);
        prop_assert!(p.diff(&p).unwrap().is_empty());
    }

    #[test]
    fn diff_between_grids_and_trees(a in any_grid(), nodes in prop::collection::vec(1u32..6, 1..6)) {
        let shape = *a.shape();
        let g = a.grid().unwrap();
        // The same grid as a tree hands nothing over.
        let same = a.successor(Layout::Bsp(Bsp::from_grid(g).unwrap())).unwrap();
        assert_one_owner_everywhere(&same);
        prop_assert!(a.diff(&same).unwrap().is_empty());
        let other = a.successor(Layout::Bsp(Bsp::even(&shape, &nodes).unwrap())).unwrap();
        assert_one_owner_everywhere(&other);
        assert_diff_exact(&a, &other);
    }
}

#[test]
fn cells_rebuild_the_tree_they_came_from() {
    let shape = world(16, 8);
    let p = bsp(
        shape,
        BspTree::split(
            Axis::X,
            5,
            BspTree::split(Axis::Y, 3, BspTree::leaf(1), BspTree::leaf(2)),
            BspTree::split(
                Axis::Y,
                6,
                BspTree::split(Axis::X, 12, BspTree::leaf(3), BspTree::leaf(4)),
                BspTree::leaf(5),
            ),
        ),
    );
    let cells: Vec<_> = p.cells().collect();
    let rebuilt = Bsp::from_cells(&shape, &cells).unwrap();
    let q = p.successor(Layout::Bsp(rebuilt)).unwrap();
    assert_one_owner_everywhere(&q);
    assert!(p.diff(&q).unwrap().is_empty());
}

// ---------------------------------------------------------------------------------------------
// Neighbours on the torus

/// 64 × 64 chunks: 2 048 m square.
const N: i64 = 64;

#[test]
fn one_by_one_grid_is_its_own_neighbour_all_around() {
    let p = grid(world(N, N), 1, 1, vec![7]);
    let mut expected = vec![];
    for (x, y) in [
        (-1, -1),
        (0, -1),
        (1, -1),
        (-1, 0),
        (1, 0),
        (-1, 1),
        (0, 1),
        (1, 1),
    ] {
        expected.push(n(7, x * N, y * N));
    }
    assert_eq!(p.neighbours(7, 1).unwrap(), sorted(expected.clone()));
    assert_eq!(p.neighbours(7, 7).unwrap(), sorted(expected));
    // Radius 0 only finds overlaps, and a node's own area at offset zero is not foreign.
    assert!(p.neighbours(7, 0).unwrap().is_empty());
    // A node that owns nothing has no neighbours.
    assert!(p.neighbours(8, 3).unwrap().is_empty());
}

#[test]
fn two_by_one_grid_meets_the_same_peer_on_both_sides() {
    let p = grid(world(N, N), 2, 1, vec![1, 2]);
    // Node 2 lies right of node 1 (offset 0) and, wrapped, left of it (offset -N); the column
    // spans the whole height, so both also meet themselves and each other across the y seam.
    let expected = vec![
        n(1, 0, -N),
        n(1, 0, N),
        n(2, -N, -N),
        n(2, -N, 0),
        n(2, -N, N),
        n(2, 0, -N),
        n(2, 0, 0),
        n(2, 0, N),
    ];
    assert_eq!(p.neighbours(1, 1).unwrap(), sorted(expected));
    let of_2 = p.neighbours(2, 1).unwrap();
    assert!(of_2.contains(&n(1, 0, 0)) && of_2.contains(&n(1, N, 0)));
    assert!(of_2.contains(&n(2, 0, N)) && !of_2.contains(&n(2, 0, 0)));
}

#[test]
fn one_by_two_grid_is_the_transpose() {
    let p = grid(world(N, N), 1, 2, vec![1, 2]);
    let expected = vec![
        n(1, -N, 0),
        n(1, N, 0),
        n(2, -N, -N),
        n(2, 0, -N),
        n(2, N, -N),
        n(2, -N, 0),
        n(2, 0, 0),
        n(2, N, 0),
    ];
    assert_eq!(p.neighbours(1, 1).unwrap(), sorted(expected));
}

#[test]
fn two_by_two_grid_meets_every_peer_through_each_seam() {
    // 1 2
    // 3 4   (row y = 0 first)
    let p = grid(world(N, N), 2, 2, vec![1, 2, 3, 4]);
    let expected = vec![
        n(2, 0, 0),
        n(2, -N, 0),
        n(3, 0, 0),
        n(3, 0, -N),
        n(4, 0, 0),
        n(4, -N, 0),
        n(4, 0, -N),
        n(4, -N, -N),
    ];
    assert_eq!(p.neighbours(1, 1).unwrap(), sorted(expected));
    let of_4 = p.neighbours(4, 1).unwrap();
    assert_eq!(of_4.len(), 8);
    assert!(of_4.contains(&n(1, N, N)) && of_4.contains(&n(1, 0, 0)));
}

#[test]
fn sixteen_by_sixteen_grid() {
    // One node per region of 4 × 4 chunks: node 100 + 16 y + x.
    let node = |x: i64, y: i64| 100 + (y.rem_euclid(16) * 16 + x.rem_euclid(16)) as NodeId;
    let table = (0..16)
        .flat_map(|y| (0..16).map(move |x| node(x, y)))
        .collect();
    let p = grid(world(N, N), 16, 16, table);
    // The corner region's eight neighbours, those across a seam shifted by a whole world.
    let mut expected = vec![];
    for dy in -1..=1 {
        for dx in -1..=1 {
            if (dx, dy) != (0, 0) {
                let shift = |d: i64| if d < 0 { -N } else { 0 };
                expected.push(n(node(dx, dy), shift(dx), shift(dy)));
            }
        }
    }
    assert_eq!(p.neighbours(node(0, 0), 1).unwrap(), sorted(expected));
    // An inner region: all at offset zero.
    let inner = p.neighbours(node(5, 9), 1).unwrap();
    assert_eq!(inner.len(), 8);
    assert!(inner.iter().all(|nb| nb.offset == ChunkOffset::default()));
    // Radius 5 reaches two regions out: 5 × 5 - 1 distinct nodes, one offset each.
    let wide = p.neighbours(node(0, 0), 5).unwrap();
    let distinct: BTreeSet<NodeId> = wide.iter().map(|nb| nb.node).collect();
    assert_eq!((wide.len(), distinct.len()), (24, 24));

    // Four nodes in bands of four rows: a band spans the world's width, so it meets itself
    // across the x seam; the band above it is reached across the y seam.
    let p = grid(world(N, N), 16, 16, (0..256).map(|i| 1 + i / 64).collect());
    let expected = vec![
        n(1, -N, 0),
        n(1, N, 0),
        n(2, -N, 0),
        n(2, 0, 0),
        n(2, N, 0),
        n(4, -N, -N),
        n(4, 0, -N),
        n(4, N, -N),
    ];
    assert_eq!(p.neighbours(1, 1).unwrap(), sorted(expected));
}

#[test]
fn an_entity_on_the_wrap_seam() {
    let shape = world(N, N);
    let p = grid(shape, 2, 2, vec![1, 2, 3, 4]);
    let (w, h) = (shape.width, shape.height);
    // Just below both seams: the top-right region, whose neighbours wrap to it.
    let on_seam = Pos { x: -0.25, y: -0.25 };
    assert_eq!(p.owner_of(on_seam).unwrap(), 4);
    let chunk = shape.chunk_of(on_seam);
    assert_eq!(chunk, ChunkPos { x: N - 1, y: N - 1 });
    assert_eq!(
        p.near(chunk, 1).unwrap(),
        vec![n(1, N, N), n(2, 0, N), n(3, N, 0)]
    );
    // On the seam itself, and whole worlds away, positions land where they wrap to.
    assert_eq!(p.owner_of(Pos { x: w, y: h }).unwrap(), 1);
    assert_eq!(p.owner_of(Pos { x: 0.0, y: -0.0 }).unwrap(), 1);
    assert_eq!(
        p.owner_of(Pos { x: -1e12, y: 1e12 }).unwrap(),
        p.owner_of(shape.normalise(Pos { x: -1e12, y: 1e12 }))
            .unwrap()
    );
    assert_eq!(
        p.owner_of(Pos {
            x: w * 1e6 - 0.25,
            y: 1.0
        })
        .unwrap(),
        2
    );
    // Shifting the entity by the offset puts it next to the peer's own coordinates.
    let (ox, oy) = shape.offset_metres(ChunkOffset { x: N, y: N });
    let seen_from_1 = Pos {
        x: shape.normalise(on_seam).x - ox,
        y: shape.normalise(on_seam).y - oy,
    };
    assert!(seen_from_1.x < 0.0 && seen_from_1.x > -32.0 && seen_from_1.y < 0.0);
}

// ---------------------------------------------------------------------------------------------
// BSP changes and their diffs

/// 64 × 32 chunks split at x = 32: node 1 left, node 2 right.
fn two_cells() -> Partition {
    let shape = world(64, 32);
    let p = Partition::new(shape, 1, Layout::Bsp(Bsp::even(&shape, &[1, 2]).unwrap())).unwrap();
    assert_eq!(
        p.bsp().unwrap().tree(),
        BspTree::split(Axis::X, 32, BspTree::leaf(1), BspTree::leaf(2))
    );
    p
}

fn step(p: &Partition, change: impl FnOnce(&mut Bsp)) -> Partition {
    let mut b = p.bsp().unwrap().clone();
    change(&mut b);
    p.successor(Layout::Bsp(b)).unwrap()
}

#[test]
fn diff_of_a_split_a_move_and_a_retire() {
    let p1 = two_cells();
    // Split node 2's cell (#2) at y = 16: its upper half goes to the new node 3.
    let p2 = step(&p1, |b| b.split(2, Axis::Y, 16, 2, 3).unwrap());
    assert_eq!(p2.epoch(), 2);
    assert_eq!(
        assert_diff_exact(&p1, &p2),
        vec![Transfer {
            from: 2,
            to: 3,
            area: ChunkRect::new(32, 16, 64, 32)
        }]
    );
    // Move the root line from x = 32 to 40: node 1 grows into both cells on the right.
    let p3 = step(&p2, |b| b.move_line(0, 40).unwrap());
    assert_eq!(
        assert_diff_exact(&p2, &p3),
        vec![
            Transfer {
                from: 2,
                to: 1,
                area: ChunkRect::new(32, 0, 40, 16)
            },
            Transfer {
                from: 3,
                to: 1,
                area: ChunkRect::new(32, 16, 40, 32)
            },
        ]
    );
    // Retire node 3's cell (#4): node 2, across the line, takes it.
    let p4 = step(&p3, |b| b.retire(4).unwrap());
    assert_eq!(
        assert_diff_exact(&p3, &p4),
        vec![Transfer {
            from: 3,
            to: 2,
            area: ChunkRect::new(40, 16, 64, 32)
        }]
    );
    assert_eq!(
        p4.bsp().unwrap().tree(),
        BspTree::split(Axis::X, 40, BspTree::leaf(1), BspTree::leaf(2))
    );
    // Retiring the left cell hands the whole world to the right one.
    let p5 = step(&p4, |b| b.retire(1).unwrap());
    assert_eq!(p5.nodes(), vec![2]);
    assert_eq!(
        assert_diff_exact(&p4, &p5),
        vec![Transfer {
            from: 1,
            to: 2,
            area: ChunkRect::new(0, 0, 40, 32)
        }]
    );
}

#[test]
fn a_new_cell_starts_empty_and_grows_by_moving_its_line() {
    let p1 = two_cells();
    // BigWorld's way: the new cell starts with zero width at its parent's far edge.
    let p2 = step(&p1, |b| b.split(1, Axis::X, 32, 1, 9).unwrap());
    assert!(p1.diff(&p2).unwrap().is_empty());
    assert!(p2.area_of(9).is_empty() && !p2.nodes().contains(&9));
    assert_eq!(p2.bsp().unwrap().leaf_count(), 3);
    let p3 = step(&p2, |b| b.move_line(1, 24).unwrap());
    assert_eq!(
        assert_diff_exact(&p2, &p3),
        vec![Transfer {
            from: 1,
            to: 9,
            area: ChunkRect::new(24, 0, 32, 32)
        }]
    );
}

#[test]
fn bsp_changes_that_would_break_the_cover_are_refused() {
    let p = step(&two_cells(), |b| b.split(1, Axis::X, 16, 1, 3).unwrap());
    let mut b = p.bsp().unwrap().clone();
    let before = b.clone();
    // The root line cannot jump over the inner line at x = 16.
    let e = b.move_line(0, 10).unwrap_err();
    assert!(
        matches!(
            e,
            PartitionError::WouldCross {
                index: 0,
                at: 10,
                inner: 1,
                inner_at: 16
            }
        ),
        "{e}"
    );
    // A line stays within the cell it divides.
    let e = b.move_line(1, 40).unwrap_err().to_string();
    assert!(e.contains("40") && e.contains("[0, 32]"), "{e}");
    let e = b.split(4, Axis::Y, 33, 2, 2).unwrap_err().to_string();
    assert!(e.contains("33") && e.contains("[0, 32]"), "{e}");
    // Entries of the wrong kind, or none.
    assert!(b
        .move_line(2, 3)
        .unwrap_err()
        .to_string()
        .contains("#2 is a cell"));
    assert!(b
        .retire(0)
        .unwrap_err()
        .to_string()
        .contains("#0 is a split"));
    assert!(b
        .split(99, Axis::X, 1, 1, 1)
        .unwrap_err()
        .to_string()
        .contains("#99 does not exist"));
    let mut one = Bsp::new(&world(4, 4), &BspTree::leaf(1)).unwrap();
    assert_eq!(one.retire(0), Err(PartitionError::LastCell));
    // Nothing refused changed the tree.
    assert_eq!(b, before);
}

// ---------------------------------------------------------------------------------------------
// Bad input

#[test]
fn bad_worlds_and_grids_name_the_bad_value() {
    let e = Grid::new(&world(64, 64), 3, 2, vec![1; 6])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("grid 3×2") && e.contains("width") && e.contains("64/3"),
        "{e}"
    );
    let e = Grid::new(&world(64, 64), 2, 2, vec![1; 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 nodes") && e.contains("got 3"), "{e}");
    let e = Grid::new(&world(64, 64), 0, 2, vec![])
        .unwrap_err()
        .to_string();
    assert!(e.contains("grid 0×2"), "{e}");
    let bad_world = WorldShape {
        width: 1000.0,
        ..world(64, 64)
    };
    let e = Grid::new(&bad_world, 1, 1, vec![1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("world width") && e.contains("1000"), "{e}");
    let e = Partition::single(
        WorldShape {
            region_size: 48.0,
            ..world(64, 64)
        },
        1,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("region size") && e.contains("48"), "{e}");
    // A layout built for another world.
    let g = Grid::new(&world(32, 32), 1, 1, vec![1]).unwrap();
    let e = Partition::new(world(64, 64), 1, Layout::Grid(g))
        .unwrap_err()
        .to_string();
    assert!(e.contains("32×32") && e.contains("64×64"), "{e}");
}

#[test]
fn a_table_naming_an_unknown_node_is_refused() {
    let p = grid(world(64, 64), 2, 2, vec![1, 9, 2, 1]);
    assert!(p.check_nodes(&[1, 2, 9]).is_ok());
    let e = p.check_nodes(&[1, 2]).unwrap_err().to_string();
    assert!(
        e.contains("region (1, 0) names node 9") && e.contains("[1, 2]"),
        "{e}"
    );
    let t = bsp(
        world(64, 64),
        BspTree::split(Axis::Y, 10, BspTree::leaf(1), BspTree::leaf(5)),
    );
    let e = t.check_nodes(&[1]).unwrap_err().to_string();
    assert!(e.contains("cell #2") && e.contains("node 5"), "{e}");
}

#[test]
fn a_bsp_with_overlapping_or_missing_cover_is_refused() {
    let shape = world(16, 8);
    let overlap = [
        (ChunkRect::new(0, 0, 8, 8), 1),
        (ChunkRect::new(6, 0, 16, 8), 2),
    ];
    let e = Bsp::from_cells(&shape, &overlap).unwrap_err().to_string();
    assert!(
        e.contains("cells 0 [0, 8)×[0, 8) and 1 [6, 16)×[0, 8) overlap") && e.contains("(6, 0)"),
        "{e}"
    );
    let gap = [
        (ChunkRect::new(0, 0, 8, 8), 1),
        (ChunkRect::new(8, 0, 16, 5), 2),
    ];
    let e = Bsp::from_cells(&shape, &gap).unwrap_err().to_string();
    assert!(e.contains("chunk (8, 5) is covered by no cell"), "{e}");
    let outside = [(ChunkRect::new(0, 0, 17, 8), 1)];
    let e = Bsp::from_cells(&shape, &outside).unwrap_err().to_string();
    assert!(
        e.contains("cell 0 [0, 17)×[0, 8)") && e.contains("16×8"),
        "{e}"
    );
    // A pinwheel tiles the world but no straight line separates its cells.
    let pinwheel = [
        (ChunkRect::new(0, 0, 10, 3), 1),
        (ChunkRect::new(10, 0, 16, 6), 2),
        (ChunkRect::new(6, 6, 16, 8), 3),
        (ChunkRect::new(0, 3, 6, 8), 4),
        (ChunkRect::new(6, 3, 10, 6), 5),
    ];
    let e = Bsp::from_cells(&shape, &pinwheel).unwrap_err().to_string();
    assert!(e.contains("cannot be separated"), "{e}");
    // In the tree form, a line outside its cell would make children overlap.
    let tree = BspTree::split(
        Axis::X,
        8,
        BspTree::split(Axis::X, 12, BspTree::leaf(1), BspTree::leaf(2)),
        BspTree::leaf(3),
    );
    let e = Bsp::new(&shape, &tree).unwrap_err().to_string();
    assert!(
        e.contains("split #1 on x at chunk 12") && e.contains("[0, 8)"),
        "{e}"
    );
    // The same tree in a stored document.
    let json = r#"{"epoch": 4, "world": {"width": 512.0, "height": 256.0, "chunk_size": 32.0, "region_size": 256.0},
        "layout": {"bsp": {"root": {"split": {"axis": "y", "at": 9, "low": {"leaf": {"node": 1}}, "high": {"leaf": {"node": 2}}}}}}}"#;
    let e = serde_json::from_str::<Partition>(json)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("split #0 on y at chunk 9") && e.contains("[0, 8)"),
        "{e}"
    );
    let deep = (0..70).fold(BspTree::leaf(1), |t, _| {
        BspTree::split(Axis::X, 0, BspTree::leaf(2), t)
    });
    assert_eq!(Bsp::new(&shape, &deep), Err(PartitionError::TooDeep));
}

#[test]
fn nan_and_infinite_positions_are_refused() {
    let p = grid(world(64, 64), 2, 2, vec![1, 2, 3, 4]);
    for (x, y) in [
        (f64::NAN, 1.0),
        (1.0, f64::INFINITY),
        (f64::NEG_INFINITY, f64::NAN),
    ] {
        let e = p.owner_of(Pos { x, y }).unwrap_err().to_string();
        assert!(
            e.contains("not finite") && e.contains(&format!("{x}")),
            "{e}"
        );
    }
    let e = p
        .shape()
        .checked_chunk_of(Pos {
            x: f64::NAN,
            y: 0.0,
        })
        .unwrap_err();
    assert!(e.to_string().contains("NaN"));
}

#[test]
fn partitions_round_trip_through_their_stored_form() {
    let g = grid(world(64, 64), 2, 2, vec![1, 2, 3, 4]);
    let json = serde_json::to_value(&g).unwrap();
    assert_eq!(
        json["layout"]["grid"]["table"],
        serde_json::json!([1, 2, 3, 4])
    );
    assert_eq!(serde_json::from_value::<Partition>(json).unwrap(), g);
    let t = two_cells();
    let json = serde_json::to_string(&t).unwrap();
    assert!(json.contains(r#""split":{"axis":"x","at":32"#), "{json}");
    assert_eq!(serde_json::from_str::<Partition>(&json).unwrap(), t);
    // A grid table of the wrong length in a document.
    let bad = r#"{"epoch": 1, "world": {"width": 2048.0, "height": 2048.0, "chunk_size": 32.0, "region_size": 1024.0},
        "layout": {"grid": {"cols": 2, "rows": 2, "table": [1, 2, 3]}}}"#;
    let e = serde_json::from_str::<Partition>(bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("4 nodes") && e.contains("got 3"), "{e}");
}

#[test]
fn default_world_partitions() {
    let shape = WorldShape::default();
    let single = Partition::single(shape, 1).unwrap();
    assert_eq!(
        (single.grid().unwrap().cols(), single.grid().unwrap().rows()),
        (16, 16)
    );
    assert_eq!(single.chunks_of(1), 4096 * 4096);
    // A 256-leaf tree with the grid's ownership hands nothing over.
    let nodes: Vec<NodeId> = (0..256).collect();
    let g = Grid::even(&shape, 16, 16, &nodes).unwrap();
    let tree = Bsp::from_grid(&g).unwrap();
    assert_eq!((tree.leaf_count(), tree.depth()), (256, 8));
    let a = Partition::new(shape, 1, Layout::Grid(g)).unwrap();
    let b = a.successor(Layout::Bsp(tree)).unwrap();
    assert!(a.diff(&b).unwrap().is_empty());
    for node in [0, 17, 255] {
        assert_eq!(
            a.neighbours(node, 7).unwrap(),
            b.neighbours(node, 7).unwrap()
        );
    }
    let e = a
        .diff(&Partition::single(world(64, 64), 1).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("different worlds"));
}

#[test]
fn even_grids_give_each_node_one_compact_block() {
    let g = Grid::even(&world(64, 64), 4, 4, &[1, 2, 3, 4]).unwrap();
    #[rustfmt::skip]
    assert_eq!(g.table(), [
        1, 1, 2, 2,
        1, 1, 2, 2,
        3, 3, 4, 4,
        3, 3, 4, 4,
    ]);
    let p = Partition::new(world(64, 64), 1, Layout::Grid(g)).unwrap();
    // Regions of one row merge into one rectangle.
    assert_eq!(
        p.area_of(4),
        vec![
            ChunkRect::new(32, 32, 64, 48),
            ChunkRect::new(32, 48, 64, 64)
        ]
    );
    // Three nodes on 16 × 16: a top band, then the bottom split in two; shares within a row.
    let g = Grid::even(&world(64, 64), 16, 16, &[1, 2, 3]).unwrap();
    let count = |n| g.table().iter().filter(|&&t| t == n).count();
    assert_eq!((count(1), count(2), count(3)), (80, 88, 88));
    // More nodes than regions: every region has an owner, some nodes none.
    let g = Grid::even(&world(64, 64), 1, 2, &[1, 2, 3, 4]).unwrap();
    assert_eq!(g.table(), [1, 3]);
    assert_eq!(
        Grid::even(&world(64, 64), 1, 1, &[]),
        Err(PartitionError::NoNodes)
    );
}
