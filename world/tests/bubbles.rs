//! Bubble placement: property tests of the policy's guarantees, on the policy alone with RTT
//! tables drawn at random. The shipped scenarios are run by the simulator's own tests, in
//! `geosim/tests/scenarios.rs`.

use std::collections::{BTreeMap, HashMap};

use cellmesh_world::bubbles::{
    BubbleId, Member, MemberId, Params, Placement, Reason, Role, SiteId, Sites,
};
use cellmesh_world::geometry::{Pos, WorldShape};
use proptest::prelude::*;

const SITES: [SiteId; 3] = [SiteId(0), SiteId(1), SiteId(2)];

fn placement() -> Placement {
    let sites = Sites::new("core", ["edge-a", "edge-b"]).unwrap();
    Placement::new(WorldShape::default(), sites, Params::default()).unwrap()
}

type Table = BTreeMap<(MemberId, SiteId), f64>;

fn table(rows: &[[f64; 3]]) -> Table {
    let mut t = Table::new();
    for (i, row) in rows.iter().enumerate() {
        for (s, v) in SITES.iter().zip(row) {
            t.insert((i as MemberId, *s), *v);
        }
    }
    t
}

fn role(k: u8) -> Role {
    [
        Role::Player,
        Role::Player,
        Role::Pilot,
        Role::Afk,
        Role::Npc,
    ][usize::from(k) % 5]
}

/// Worst RTT of the weighted members of `members` at `site`.
fn worst(p: &Params, ms: &[Member], ids: &[MemberId], t: &Table, site: SiteId) -> f64 {
    ids.iter()
        .map(|id| ms.iter().find(|m| m.id == *id).unwrap())
        .filter(|m| p.weights.of(m.role) > 0.0)
        .map(|m| t[&(m.id, site)])
        .fold(0.0, f64::max)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Whatever the RTTs, outages and movements, no placement decision leaves a bubble above
    /// the cap when an available site keeps all its players under it.
    #[test]
    fn no_decision_violates_the_cap_when_a_compliant_site_exists(
        start in proptest::collection::vec((0.0f64..6_000.0, 0.0f64..6_000.0, 0u8..5), 2..12),
        steps in proptest::collection::vec(
            (proptest::collection::vec([5.0f64..300.0, 5.0f64..300.0, 5.0f64..300.0], 12), 0u8..4, -300.0f64..300.0),
            1..40,
        ),
    ) {
        let mut p = placement();
        let params = p.params().clone();
        let mut ms: Vec<Member> = start.iter().enumerate().map(|(i, &(x, y, r))| Member {
            id: i as MemberId, pos: Pos { x, y }, speed_mps: 5.0, role: role(r),
        }).collect();
        let mut last_move: HashMap<BubbleId, u64> = HashMap::new();
        for (k, (rows, outage, drift)) in steps.iter().enumerate() {
            let t = table(&rows[..ms.len()]);
            let down: Vec<SiteId> = match outage { 1 => vec![SITES[1]], 2 => vec![SITES[2]], 3 => vec![SITES[1], SITES[2]], _ => vec![] };
            for (i, m) in ms.iter_mut().enumerate() {
                m.pos.x += drift * ((i % 3) as f64 - 1.0);
            }
            let now = k as u64 * 5_000;
            let e = p.evaluate(now, &ms, &t, &down).unwrap();
            // Only the cap, a fallback or a merge may move a bubble within its dwell.
            for d in e.moves() {
                if let Some(prev) = last_move.insert(d.group_id, now) {
                    if matches!(d.reason, Reason::Moved { .. }) {
                        prop_assert!(now - prev >= params.dwell_ms);
                    }
                }
            }
            for d in e.decisions.iter().filter(|d| !matches!(d.reason, Reason::Merged { .. } | Reason::Crossed { .. } | Reason::Dissolved)) {
                prop_assert!(!down.contains(&d.to_site), "placed on a site that is down");
                let compliant = SITES.iter()
                    .filter(|s| !down.contains(s))
                    .any(|&s| worst(&params, &ms, &d.members, &t, s) <= params.fairness_cap_ms);
                if compliant {
                    let w = worst(&params, &ms, &d.members, &t, d.to_site);
                    prop_assert!(w <= params.fairness_cap_ms, "{:?} puts a player at {} ms", d, w);
                }
            }
        }
    }

    /// No group moves twice within the dwell. Groups stand still and the RTTs keep everyone
    /// under the cap, so every move is one the hysteresis chose.
    #[test]
    fn no_group_moves_twice_within_the_dwell(
        groups in 1usize..4,
        per_group in 1usize..5,
        rows in proptest::collection::vec(
            (1usize..12, proptest::collection::vec([5.0f64..160.0, 5.0f64..160.0, 5.0f64..160.0], 16)),
            1..30,
        ),
    ) {
        let mut p = placement();
        let dwell = p.params().dwell_ms;
        let ms: Vec<Member> = (0..groups * per_group).map(|i| Member {
            id: i as MemberId,
            pos: Pos { x: (i / per_group) as f64 * 20_000.0 + (i % per_group) as f64 * 10.0, y: 0.0 },
            speed_mps: 0.0,
            role: Role::Player,
        }).collect();
        let mut last_move: HashMap<BubbleId, u64> = HashMap::new();
        let mut now = 0;
        for (hold, row) in &rows {
            let t = table(&row[..ms.len()]);
            for _ in 0..*hold {
                let e = p.evaluate(now, &ms, &t, &[]).unwrap();
                for d in e.moves() {
                    if let Some(prev) = last_move.insert(d.group_id, now) {
                        prop_assert!(now - prev >= dwell, "bubble {} moved at {} and {}", d.group_id, prev, now);
                    }
                }
                now += 5_000;
            }
        }
    }

    /// After every evaluation, any two members within the merge distance of each other are on
    /// one site, however fast and from wherever they come.
    #[test]
    fn merging_leaves_no_close_groups_on_different_sites(
        start in proptest::collection::vec(
            (0.0f64..40_000.0, 0.0f64..40_000.0, -300.0f64..300.0, -300.0f64..300.0, [5.0f64..300.0, 5.0f64..300.0, 5.0f64..300.0]),
            2..14,
        ),
        evaluations in 1usize..30,
    ) {
        let mut p = placement();
        let world = *p.world();
        let params = p.params().clone();
        let rows: Vec<[f64; 3]> = start.iter().map(|s| s.4).collect();
        let t = table(&rows);
        for k in 0..evaluations {
            let secs = k as f64 * 5.0;
            let ms: Vec<Member> = start.iter().enumerate().map(|(i, &(x, y, vx, vy, _))| Member {
                id: i as MemberId,
                pos: world.normalise(Pos { x: x + vx * secs, y: y + vy * secs }),
                speed_mps: vx.hypot(vy),
                role: Role::Player,
            }).collect();
            p.evaluate(k as u64 * 5_000, &ms, &t, &[]).unwrap();
            for a in &ms {
                for b in &ms {
                    if a.id < b.id && world.distance(a.pos, b.pos) <= params.link_distance(a.speed_mps, b.speed_mps) {
                        prop_assert_eq!(p.site_of(a.id), p.site_of(b.id), "{} and {} at {} s", a.id, b.id, secs);
                    }
                }
            }
        }
    }
}
