//! Groups: members linked by proximity on the torus, transitively (single linkage).
//!
//! Two members are linked when their torus distance is at most
//! [`Params::link_distance`]`(vᵢ, vⱼ)`, times [`Params::split_factor`] if they were in the same
//! bubble: joining takes the plain distance, leaving takes more, so a pair at the threshold does
//! not flicker between one group and two.

use rustc_hash::FxHashMap as HashMap;

use crate::geometry::{Pos, WorldShape};

use super::{Area, BubbleId, Member, Params};

/// The groups of `members`, as indices into it. `prior[i]` is member `i`'s bubble before this
/// evaluation. Each group lists its members by ascending id; groups come in the order of their
/// smallest member id.
pub fn cluster(
    world: &WorldShape,
    params: &Params,
    members: &[Member],
    prior: &[Option<BubbleId>],
) -> Vec<Vec<usize>> {
    assert_eq!(members.len(), prior.len(), "one prior bubble per member");
    let n = members.len();
    let mut uf = UnionFind::new(n);
    // Pairs already joined through others are not measured: in a crowd, most are.
    let try_link = |uf: &mut UnionFind, i: usize, j: usize| {
        let (ri, rj) = (uf.find(i), uf.find(j));
        if ri == rj {
            return;
        }
        let (a, b) = (&members[i], &members[j]);
        let mut reach = params.link_distance(a.speed_mps, b.speed_mps);
        if prior[i].is_some() && prior[i] == prior[j] {
            reach *= params.split_factor;
        }
        let (dx, dy) = world.delta(a.pos, b.pos);
        if dx * dx + dy * dy <= reach * reach {
            uf.union(ri, rj);
        }
    };

    // Cells small enough that any two members in one are linked (their diagonal is at most the
    // shortest link), so a crowd is joined in one pass; then only pairs of cells that are not
    // yet joined and could hold a link are measured, member by member.
    let cols = (world.width / (params.link_base_m / std::f64::consts::SQRT_2)).ceil();
    let rows = (world.height / (params.link_base_m / std::f64::consts::SQRT_2)).ceil();
    let (side_x, side_y) = (world.width / cols, world.height / rows);
    let (cols, rows) = (cols as i64, rows as i64);
    let mut cells: HashMap<(i64, i64), Cell> = HashMap::default();
    for (i, m) in members.iter().enumerate() {
        let p = world.normalise(m.pos);
        let key = (
            ((p.x / side_x) as i64).min(cols - 1),
            ((p.y / side_y) as i64).min(rows - 1),
        );
        cells
            .entry(key)
            .or_insert_with(|| Cell::new(p))
            .add(i, p, m, prior[i]);
    }
    let mut cells: Vec<((i64, i64), Cell)> = cells.into_iter().collect();
    cells.sort_unstable_by_key(|(k, _)| *k);
    for (_, cell) in &mut cells {
        cell.priors.sort_unstable();
        cell.priors.dedup();
        for &j in &cell.inside[1..] {
            uf.union(cell.inside[0], j);
        }
    }
    let vmax = members.iter().map(|m| m.speed_mps).fold(0.0, f64::max);
    let longest = params.link_distance(vmax, vmax) * params.split_factor;
    let gap = |a: i64, b: i64, n: i64, side: f64| {
        let d = (a - b).rem_euclid(n);
        (d.min(n - d) - 1).max(0) as f64 * side
    };
    for (a, (ka, ca)) in cells.iter().enumerate() {
        for (kb, cb) in &cells[a + 1..] {
            let (gx, gy) = (gap(ka.0, kb.0, cols, side_x), gap(ka.1, kb.1, rows, side_y));
            if gx * gx + gy * gy > longest * longest {
                continue;
            }
            let (ia, ib) = (&ca.inside, &cb.inside);
            if uf.find(ia[0]) == uf.find(ib[0]) || !ca.may_link(cb, world, params) {
                continue;
            }
            'pairs: for &i in ia {
                for &j in ib {
                    try_link(&mut uf, i, j);
                    if uf.find(ia[0]) == uf.find(ib[0]) {
                        break 'pairs;
                    }
                }
            }
        }
    }

    let mut by_root: HashMap<usize, Vec<usize>> = HashMap::default();
    for i in 0..n {
        by_root.entry(uf.find(i)).or_default().push(i);
    }
    let mut groups: Vec<Vec<usize>> = by_root.into_values().collect();
    for g in &mut groups {
        g.sort_unstable_by_key(|&i| members[i].id);
    }
    groups.sort_unstable_by_key(|g| members[g[0]].id);
    groups
}

/// A disc covering every member with half their link distance to spare. The centre is the mean
/// of the members' offsets from the first one, taken around the torus.
pub fn area<'a>(
    world: &WorldShape,
    params: &Params,
    members: impl IntoIterator<Item = &'a Member> + Clone,
) -> Area {
    let mut it = members.clone().into_iter();
    let Some(anchor) = it.next() else {
        return Area::default();
    };
    let (mut sx, mut sy, mut n) = (0.0, 0.0, 0.0);
    for m in members.clone() {
        let (dx, dy) = world.delta(anchor.pos, m.pos);
        sx += dx;
        sy += dy;
        n += 1.0;
    }
    let centre = world.normalise(Pos {
        x: anchor.pos.x + sx / n,
        y: anchor.pos.y + sy / n,
    });
    let radius_m = members
        .into_iter()
        .map(|m| {
            world.distance(centre, m.pos) + params.link_distance(m.speed_mps, m.speed_mps) / 2.0
        })
        .fold(0.0, f64::max);
    Area { centre, radius_m }
}

/// The members in one cell of the search, and what bounds their links to another cell's: the
/// box around their (normalised) positions, their top speed and their bubbles before.
struct Cell {
    inside: Vec<usize>,
    min: Pos,
    max: Pos,
    vmax: f64,
    priors: Vec<BubbleId>,
}

impl Cell {
    fn new(p: Pos) -> Self {
        Self {
            inside: Vec::new(),
            min: p,
            max: p,
            vmax: 0.0,
            priors: Vec::new(),
        }
    }

    fn add(&mut self, i: usize, p: Pos, m: &Member, prior: Option<BubbleId>) {
        self.inside.push(i);
        self.min = Pos {
            x: self.min.x.min(p.x),
            y: self.min.y.min(p.y),
        };
        self.max = Pos {
            x: self.max.x.max(p.x),
            y: self.max.y.max(p.y),
        };
        self.vmax = self.vmax.max(m.speed_mps);
        self.priors.extend(prior);
    }

    /// Whether any member here could link to one of `other`'s: the two boxes are no farther
    /// apart around the torus than the longest link their members could make (longer between
    /// members of one bubble). False skips measuring every pair of two groups that stand near
    /// but apart, evaluation after evaluation.
    fn may_link(&self, other: &Cell, world: &WorldShape, params: &Params) -> bool {
        // A cell lies within one lap of each axis (it never straddles the seam).
        let apart = |a0: f64, a1: f64, b0: f64, b1: f64, size: f64| {
            if a0 <= b1 && b0 <= a1 {
                return 0.0;
            }
            (b0 - a1).rem_euclid(size).min((a0 - b1).rem_euclid(size))
        };
        let gx = apart(
            self.min.x,
            self.max.x,
            other.min.x,
            other.max.x,
            world.width,
        );
        let gy = apart(
            self.min.y,
            self.max.y,
            other.min.y,
            other.max.y,
            world.height,
        );
        let mut reach = params.link_distance(self.vmax, other.vmax);
        if self.shares_a_bubble_with(other) {
            reach *= params.split_factor;
        }
        // A hair of slack: the pairs are measured with `WorldShape::delta`, not these boxes.
        gx * gx + gy * gy <= reach * reach * (1.0 + 1e-9) + 1e-6
    }

    fn shares_a_bubble_with(&self, other: &Cell) -> bool {
        // Both lists are sorted, and a cell holds a bubble or two.
        self.priors
            .iter()
            .any(|b| other.priors.binary_search(b).is_ok())
    }
}

struct UnionFind {
    parent: Vec<usize>,
}

impl UnionFind {
    fn new(n: usize) -> Self {
        Self {
            parent: (0..n).collect(),
        }
    }

    fn find(&mut self, mut i: usize) -> usize {
        while self.parent[i] != i {
            self.parent[i] = self.parent[self.parent[i]];
            i = self.parent[i];
        }
        i
    }

    fn union(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            self.parent[ra.max(rb)] = ra.min(rb);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bubbles::Role;
    use proptest::prelude::*;

    fn member(id: u64, x: f64, y: f64, speed: f64) -> Member {
        Member {
            id,
            pos: Pos { x, y },
            speed_mps: speed,
            role: Role::Player,
        }
    }

    fn ids(ms: &[Member], groups: &[Vec<usize>]) -> Vec<Vec<u64>> {
        groups
            .iter()
            .map(|g| g.iter().map(|&i| ms[i].id).collect())
            .collect()
    }

    #[test]
    fn walkers_link_at_two_km_across_the_seam() {
        let w = WorldShape::default();
        let p = Params::default();
        let ms = [
            member(1, 500.0, 100.0, 5.0),
            member(2, w.width - 1_400.0, 100.0, 5.0), // 1.9 km across the seam
            member(3, 500.0, 4_000.0, 5.0),
        ];
        let g = cluster(&w, &p, &ms, &[None; 3]);
        assert_eq!(ids(&ms, &g), vec![vec![1, 2], vec![3]]);
    }

    #[test]
    fn fast_ships_link_tens_of_km_apart() {
        let w = WorldShape::default();
        let p = Params::default();
        let ms = [member(1, 0.0, 0.0, 300.0), member(2, 30_000.0, 0.0, 300.0)];
        assert_eq!(cluster(&w, &p, &ms, &[None; 2]).len(), 1);
        let slow = [member(1, 0.0, 0.0, 5.0), member(2, 30_000.0, 0.0, 5.0)];
        assert_eq!(cluster(&w, &p, &slow, &[None; 2]).len(), 2);
    }

    #[test]
    fn one_bubble_holds_together_beyond_the_join_distance() {
        let w = WorldShape::default();
        let p = Params::default();
        let ms = [member(1, 0.0, 0.0, 0.0), member(2, 2_500.0, 0.0, 0.0)];
        assert_eq!(cluster(&w, &p, &ms, &[None, None]).len(), 2);
        let same = Some(BubbleId(7));
        assert_eq!(cluster(&w, &p, &ms, &[same, same]).len(), 1);
        let other = [Some(BubbleId(7)), Some(BubbleId(8))];
        assert_eq!(cluster(&w, &p, &ms, &other).len(), 2);
    }

    #[test]
    fn the_area_covers_a_group_across_the_seam() {
        let w = WorldShape::default();
        let p = Params::default();
        let ms = [
            member(1, w.width - 100.0, 0.0, 0.0),
            member(2, 100.0, 0.0, 0.0),
        ];
        let a = area(&w, &p, &ms);
        assert!(a.centre.x.abs() < 1e-6 || (a.centre.x - w.width).abs() < 1e-6);
        assert!((a.radius_m - 1_100.0).abs() < 1e-6, "{}", a.radius_m);
    }

    proptest! {
        /// The search by cells finds exactly the groups of comparing every pair.
        #[test]
        fn cells_agree_with_all_pairs(
            pts in proptest::collection::vec((0.0f64..131_072.0, 0.0f64..131_072.0, 0.0f64..400.0), 1..80),
            base in 500.0f64..20_000.0,
            crowd in proptest::bool::ANY,
            bubbles in proptest::bool::ANY,
        ) {
            let w = WorldShape::default();
            let p = Params { link_base_m: base, ..Params::default() };
            // Half the time, squeeze everyone into 30 km around the seam, slower.
            let pts: Vec<(f64, f64, f64)> = pts.iter().map(|&(x, y, v)| if crowd {
                (x / 4.0 - 15_000.0, y / 4.0 - 15_000.0, v / 20.0)
            } else {
                (x, y, v)
            }).collect();
            let ms: Vec<Member> = pts.iter().enumerate()
                .map(|(i, &(x, y, v))| member(i as u64, x, y, v)).collect();
            // Members in one bubble before stay linked farther (`split_factor`).
            let prior: Vec<Option<BubbleId>> = pts.iter().enumerate()
                .map(|(i, &(x, _, _))| (bubbles && i % 3 != 0).then_some(BubbleId((x as u64 / 7) % 3)))
                .collect();
            let got = ids(&ms, &cluster(&w, &p, &ms, &prior));
            // All pairs, by hand.
            let mut uf = UnionFind::new(ms.len());
            for i in 0..ms.len() {
                for j in i + 1..ms.len() {
                    let mut reach = p.link_distance(ms[i].speed_mps, ms[j].speed_mps);
                    if prior[i].is_some() && prior[i] == prior[j] {
                        reach *= p.split_factor;
                    }
                    if w.distance(ms[i].pos, ms[j].pos) <= reach {
                        uf.union(i, j);
                    }
                }
            }
            let mut want: Vec<Vec<u64>> = Vec::new();
            let mut roots: Vec<usize> = Vec::new();
            for i in 0..ms.len() {
                let r = uf.find(i);
                match roots.iter().position(|&x| x == r) {
                    Some(k) => want[k].push(i as u64),
                    None => { roots.push(r); want.push(vec![i as u64]); }
                }
            }
            prop_assert_eq!(got, want);
        }
    }
}
