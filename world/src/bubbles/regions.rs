//! From bubbles to the partition: every grid region a bubble's area touches is simulated by a
//! node of the bubble's site.
//!
//! [`place_regions`] reconciles a grid with the bubbles as they stand after an evaluation. Each
//! region touched by bubbles belongs to the site whose bubbles touching it have the most members
//! (a tie keeps the site that simulates it now); a region nobody is near keeps its owner, and so
//! does a region whose owner is live but of a geo not known yet. A region that must
//! change site goes to a node of that site: a bubble keeps all its moved regions on one node
//! (the node of the site already holding most of them, then the one with the fewest regions,
//! then the lowest id), and a big event spreads them over the site's nodes, fewest regions first.
//! The same inputs give the same grid: a director that took over reconciles to the same layout.
//! The entities of a moved region cross to their new node by the ordinary handoff of a new
//! partition epoch.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::geometry::WorldShape;
use crate::partition::{Grid, NodeId, PartitionError};

use super::{Area, BubbleId, BubbleSnapshot, SiteId};

/// One region given to another site.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RegionMove {
    /// The region's column and row in the grid.
    pub region: (u32, u32),
    pub from: NodeId,
    pub to: NodeId,
    /// The bubble that claimed it.
    pub bubble: BubbleId,
    pub to_site: SiteId,
}

/// The grid after placing the bubbles, and the regions that changed hands.
#[derive(Debug, Clone, PartialEq)]
pub struct RegionPlan {
    pub grid: Grid,
    pub moves: Vec<RegionMove>,
    /// Regions whose site has no live node: left where they are (the placement falls such a
    /// site's bubbles back to the core at its next evaluation).
    pub stranded: usize,
}

/// Whether the disc `area` touches the rectangle `[x0, x1) × [y0, y1)` (m) on the torus.
fn touches(shape: &WorldShape, area: &Area, x0: f64, x1: f64, y0: f64, y1: f64) -> bool {
    // Distance from a coordinate to an interval, the shorter way round.
    let gap = |c: f64, lo: f64, hi: f64, size: f64| {
        let c = c.rem_euclid(size);
        if (lo..hi).contains(&c) {
            return 0.0;
        }
        let to_lo = (lo - c).rem_euclid(size);
        let from_hi = (c - hi).rem_euclid(size);
        to_lo.min(from_hi)
    };
    let dx = gap(area.centre.x, x0, x1, shape.width);
    let dy = gap(area.centre.y, y0, y1, shape.height);
    dx.hypot(dy) <= area.radius_m
}

/// The regions of `grid` (column, row) that `area` touches.
pub fn regions_touched(grid: &Grid, shape: &WorldShape, area: &Area) -> Vec<(u32, u32)> {
    let (w, h) = grid.region_chunks();
    let (rw, rh) = (w as f64 * shape.chunk_size, h as f64 * shape.chunk_size);
    let mut out = Vec::new();
    for y in 0..grid.rows() {
        for x in 0..grid.cols() {
            let (x0, y0) = (f64::from(x) * rw, f64::from(y) * rh);
            if touches(shape, area, x0, x0 + rw, y0, y0 + rh) {
                out.push((x, y));
            }
        }
    }
    out
}

/// `grid` with every region the `bubbles` touch simulated by a node of the bubble's site.
/// `site_of` gives the site of each live node; a node it does not name takes no region. The
/// regions of the nodes in `keep` (live, of a geo not known yet) stay where they are.
pub fn place_regions(
    grid: &Grid,
    shape: &WorldShape,
    bubbles: &[BubbleSnapshot],
    site_of: &BTreeMap<NodeId, SiteId>,
    keep: &BTreeSet<NodeId>,
) -> Result<RegionPlan, PartitionError> {
    let cols = grid.cols();
    let index = |(x, y): (u32, u32)| y as usize * cols as usize + x as usize;
    // Region -> site -> (members touching, the bubble with most of them: (members, id)).
    type Claim = (usize, (usize, std::cmp::Reverse<BubbleId>));
    let mut claims: BTreeMap<(u32, u32), BTreeMap<SiteId, Claim>> = BTreeMap::new();
    for b in bubbles {
        let n = b.members.len();
        for r in regions_touched(grid, shape, &b.area) {
            let e = claims.entry(r).or_default().entry(b.site).or_default();
            e.0 += n;
            // Most members, then the lowest id.
            e.1 = e.1.max((n, std::cmp::Reverse(b.id)));
        }
    }
    let mut nodes_of: BTreeMap<SiteId, Vec<NodeId>> = BTreeMap::new();
    for (&node, &site) in site_of {
        nodes_of.entry(site).or_default().push(node);
    }
    let mut owned: BTreeMap<NodeId, usize> = BTreeMap::new();
    for &n in grid.table() {
        *owned.entry(n).or_default() += 1;
    }
    let mut table = grid.table().to_vec();
    let mut stranded = 0;
    // The regions each bubble takes to its site.
    let mut taken: BTreeMap<BubbleId, (SiteId, Vec<(u32, u32)>)> = BTreeMap::new();
    for (&region, by_site) in &claims {
        let now = table[index(region)];
        if keep.contains(&now) {
            continue;
        }
        let now_site = site_of.get(&now).copied();
        let (&site, &(_, (_, std::cmp::Reverse(bubble)))) = by_site
            .iter()
            .max_by(|(sa, (na, _)), (sb, (nb, _))| {
                na.cmp(nb)
                    .then((Some(**sa) == now_site).cmp(&(Some(**sb) == now_site)))
                    .then(sb.cmp(sa))
            })
            .expect("a claimed region has a claim");
        if now_site == Some(site) {
            continue;
        }
        if !nodes_of.contains_key(&site) {
            stranded += 1;
            continue;
        }
        taken
            .entry(bubble)
            .or_insert((site, Vec::new()))
            .1
            .push(region);
    }
    let mut moves = Vec::new();
    for (bubble, (site, regions)) in taken {
        let spread = bubbles
            .iter()
            .find(|b| b.id == bubble)
            .is_some_and(|b| b.spread_over_nodes);
        let candidates = &nodes_of[&site];
        // The site's node holding most of this bubble's regions already.
        let mine = |n: NodeId| {
            regions_touched_by(grid, shape, bubbles, bubble)
                .iter()
                .filter(|&&r| table[index(r)] == n)
                .count()
        };
        let home = candidates
            .iter()
            .copied()
            .max_by(|&a, &b| {
                mine(a)
                    .cmp(&mine(b))
                    .then(
                        owned
                            .get(&b)
                            .copied()
                            .unwrap_or(0)
                            .cmp(&owned.get(&a).copied().unwrap_or(0)),
                    )
                    .then(b.cmp(&a))
            })
            .expect("a site listed has a node");
        for region in regions {
            let to = if spread {
                candidates
                    .iter()
                    .copied()
                    .min_by_key(|n| (owned.get(n).copied().unwrap_or(0), *n))
                    .expect("a site listed has a node")
            } else {
                home
            };
            let i = index(region);
            let from = table[i];
            table[i] = to;
            *owned.entry(to).or_default() += 1;
            if let Some(c) = owned.get_mut(&from) {
                *c -= 1;
            }
            moves.push(RegionMove {
                region,
                from,
                to,
                bubble,
                to_site: site,
            });
        }
    }
    moves.sort_by_key(|m| (m.region.1, m.region.0));
    let grid = Grid::new(shape, grid.cols(), grid.rows(), table)?;
    Ok(RegionPlan {
        grid,
        moves,
        stranded,
    })
}

fn regions_touched_by(
    grid: &Grid,
    shape: &WorldShape,
    bubbles: &[BubbleSnapshot],
    bubble: BubbleId,
) -> BTreeSet<(u32, u32)> {
    bubbles
        .iter()
        .filter(|b| b.id == bubble)
        .flat_map(|b| regions_touched(grid, shape, &b.area))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Pos;

    const PAR: SiteId = SiteId(0);
    const HKG: SiteId = SiteId(1);

    fn world() -> WorldShape {
        WorldShape::default()
    }

    /// The default world's 16 × 16 regions: nodes 1 and 2 (Paris) own the left and right
    /// halves but the last column, which is node 3's (Hong Kong); node 4 is Hong Kong's too.
    fn grid() -> Grid {
        let w = world();
        let (cols, rows) = (w.regions_x() as u32, w.regions_y() as u32);
        let table = (0..rows)
            .flat_map(|_| {
                (0..cols).map(move |x| match x {
                    x if x + 1 == cols => 3,
                    x if x < cols / 2 => 1,
                    _ => 2,
                })
            })
            .collect();
        Grid::new(&w, cols, rows, table).unwrap()
    }

    fn sites() -> BTreeMap<NodeId, SiteId> {
        [(1, PAR), (2, PAR), (3, HKG), (4, HKG)]
            .into_iter()
            .collect()
    }

    fn none() -> BTreeSet<NodeId> {
        BTreeSet::new()
    }

    fn bubble(id: u64, site: SiteId, x: f64, y: f64, r: f64, members: usize) -> BubbleSnapshot {
        BubbleSnapshot {
            id: BubbleId(id),
            site,
            members: (0..members as u64).map(|m| id * 1_000 + m).collect(),
            area: Area {
                centre: Pos { x, y },
                radius_m: r,
            },
            spread_over_nodes: false,
            last_move_ms: None,
        }
    }

    fn place(g: &Grid, bubbles: &[BubbleSnapshot]) -> RegionPlan {
        place_regions(g, &world(), bubbles, &sites(), &none()).unwrap()
    }

    #[test]
    fn a_disc_touches_the_regions_it_overlaps_around_the_seam() {
        let (g, w) = (grid(), world());
        // Inside one region.
        let inner = Area {
            centre: Pos {
                x: 4_096.0,
                y: 4_096.0,
            },
            radius_m: 1_000.0,
        };
        assert_eq!(regions_touched(&g, &w, &inner), vec![(0, 0)]);
        // On the corner where the seam wraps: the four corner regions.
        let corner = Area {
            centre: Pos { x: 10.0, y: 10.0 },
            radius_m: 100.0,
        };
        let last = (g.cols() - 1, g.rows() - 1);
        assert_eq!(
            regions_touched(&g, &w, &corner),
            vec![(0, 0), (last.0, 0), (0, last.1), (last.0, last.1)]
        );
    }

    #[test]
    fn a_bubble_on_another_site_takes_the_regions_it_touches_to_one_node_of_it() {
        let g = grid();
        // Straddles the line between regions (0, 0) and (1, 0), both Paris's node 1.
        let b = bubble(7, HKG, 8_192.0, 4_096.0, 500.0, 5);
        let plan = place(&g, std::slice::from_ref(&b));
        let moved: Vec<((u32, u32), NodeId, NodeId)> = plan
            .moves
            .iter()
            .map(|m| (m.region, m.from, m.to))
            .collect();
        // Both to node 4: Hong Kong's node with the fewest regions (none).
        assert_eq!(moved, vec![((0, 0), 1, 4), ((1, 0), 1, 4)]);
        assert_eq!(plan.grid.owner_of_region(0, 0), 4);
        // Every other region kept its owner.
        let changed = g
            .table()
            .iter()
            .zip(plan.grid.table())
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(changed, 2);
        // Placing it again moves nothing: the grid is reconciled.
        let again = place(&plan.grid, &[b]);
        assert!(again.moves.is_empty());
        assert_eq!(again.grid, plan.grid);
    }

    #[test]
    fn a_shared_region_goes_to_the_site_with_more_members_and_a_tie_stays() {
        let g = grid();
        // Region (0, 0), Paris's: three members on Hong Kong's bubble, five on Paris's.
        let hk = bubble(1, HKG, 4_000.0, 4_000.0, 300.0, 3);
        let par = |n| bubble(2, PAR, 4_500.0, 4_500.0, 300.0, n);
        assert!(place(&g, &[hk.clone(), par(5)]).moves.is_empty());
        let plan = place(&g, &[hk.clone(), par(2)]);
        assert_eq!(plan.moves.len(), 1);
        assert_eq!(plan.moves[0].to_site, HKG);
        // A tie keeps the site simulating the region, whichever it is.
        assert!(place(&g, &[hk.clone(), par(3)]).moves.is_empty());
        let x = 15.0 * 8_192.0 + 4_000.0;
        let hk_owned = [
            bubble(1, HKG, x, 4_000.0, 300.0, 3),
            bubble(2, PAR, x + 500.0, 4_500.0, 300.0, 3),
        ];
        assert!(place(&g, &hk_owned).moves.is_empty(), "Hong Kong keeps it");
    }

    #[test]
    fn a_site_with_no_live_node_strands_its_regions_and_an_unknown_geo_keeps_its_own() {
        let (g, w) = (grid(), world());
        let alive: BTreeMap<NodeId, SiteId> = [(1, PAR), (2, PAR)].into_iter().collect();
        let hk = [bubble(1, HKG, 4_096.0, 4_096.0, 100.0, 2)];
        let plan = place_regions(&g, &w, &hk, &alive, &none()).unwrap();
        assert!(plan.moves.is_empty());
        assert_eq!(plan.stranded, 1);
        // Node 1 is live but its record (its geo) is not read yet: its region stays.
        let keep: BTreeSet<NodeId> = [1].into_iter().collect();
        let plan = place_regions(&g, &w, &hk, &sites(), &keep).unwrap();
        assert!(plan.moves.is_empty());
    }

    #[test]
    fn a_big_event_spreads_over_the_sites_nodes_and_a_return_goes_back_to_the_core() {
        let g = grid();
        let mut big = bubble(1, HKG, 8_192.0, 8_192.0, 2_000.0, 150);
        big.spread_over_nodes = true;
        let plan = place(&g, &[big.clone()]);
        assert_eq!(plan.moves.len(), 4);
        // Fewest regions first: node 4 (none) takes them while it has fewer than node 3 (16).
        let to: BTreeSet<NodeId> = plan.moves.iter().map(|m| m.to).collect();
        assert_eq!(to, [4].into_iter().collect());
        // With the two level, the regions are shared out evenly.
        let halves: Vec<NodeId> = (0..16u32)
            .flat_map(|_| (0..16u32).map(|x| if x < 8 { 1 } else { 2 }))
            .collect();
        let g2 = Grid::new(&world(), 16, 16, halves).unwrap();
        let moves = place(&g2, &[big.clone()]).moves;
        let on = |n| moves.iter().filter(|m| m.to == n).count();
        assert_eq!((on(3), on(4)), (2, 2));
        // Back to Paris (a fallback): the regions go to Paris nodes.
        big.site = PAR;
        let back = place(&plan.grid, &[big]);
        assert_eq!(back.moves.len(), 4);
        assert!(back.moves.iter().all(|m| [1, 2].contains(&m.to)));
    }
}
