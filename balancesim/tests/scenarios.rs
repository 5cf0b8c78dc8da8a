//! The load balancing simulator on every shipped scenario with its expected outcome, the chunks
//! each epoch moved checked chunk by chunk, and the errors of bad scenario files.

use cellmesh_balancesim::{self as balancesim, Report, Scenario, ScenarioFile, BALANCED_RATIO};
use cellmesh_world::balance::Decision;
use cellmesh_world::geometry::ChunkPos;
use cellmesh_world::partition::{Axis, Bsp, Layout, NodeId, Partition};

const SCENARIOS: [(&str, &str); 5] = [
    (
        "hotspot-quadrant",
        include_str!("../scenarios/hotspot-quadrant.toml"),
    ),
    (
        "hotspot-wrap-seam",
        include_str!("../scenarios/hotspot-wrap-seam.toml"),
    ),
    (
        "crowd-disperses",
        include_str!("../scenarios/crowd-disperses.toml"),
    ),
    (
        "flapping-load",
        include_str!("../scenarios/flapping-load.toml"),
    ),
    ("node-joins", include_str!("../scenarios/node-joins.toml")),
];

fn text(name: &str) -> &'static str {
    SCENARIOS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("a shipped scenario")
        .1
}

fn run(name: &str) -> (Scenario, Report) {
    let s = Scenario::from_toml(text(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let r = balancesim::run(&s).unwrap_or_else(|e| panic!("{name}: {e}"));
    (s, r)
}

/// The round at `t_s`.
fn round_at(r: &Report, t_s: f64) -> usize {
    r.series
        .t_s
        .iter()
        .position(|t| *t >= t_s)
        .expect("within the run")
}

fn line<'a>(r: &'a Report, path: &str, axis: Axis) -> &'a balancesim::LineSeries {
    r.series
        .lines
        .iter()
        .find(|l| l.path == path && l.axis == Some(axis))
        .unwrap_or_else(|| panic!("no {axis} line at {path:?}"))
}

fn node_series(r: &Report, node: NodeId) -> &balancesim::NodeSeries {
    r.series.nodes.iter().find(|n| n.node == node).unwrap()
}

#[test]
fn every_shipped_scenario_runs_the_same_twice_and_plots() {
    for (name, _) in SCENARIOS {
        let (s, a) = run(name);
        let b = balancesim::run(&s).unwrap();
        assert_eq!(a.summary, b.summary, "{name}");
        assert_eq!(a.timeline, b.timeline, "{name}");
        assert_eq!(a.series, b.series, "{name}");
        assert_eq!(a.summary.rounds as usize, a.series.t_s.len(), "{name}");
        let svg = balancesim::render_svg(&a).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{name}"
        );
        for l in &a.series.lines {
            assert!(
                svg.contains(&l.label()),
                "{name}: {} in the legend",
                l.label()
            );
        }
        for e in &a.cell_events {
            assert!(
                svg.contains(&e.label()),
                "{name}: {} is labelled",
                e.label()
            );
        }
        let text = a.render_text();
        assert!(
            text.contains("timeline") && text.contains("summary"),
            "{name}"
        );
    }
}

/// Each epoch's `chunks_moved` is what a chunk-by-chunk comparison of its layout with the one
/// before finds, and the summary's total is their sum.
#[test]
fn chunks_moved_per_epoch_is_what_changed_hands_chunk_by_chunk() {
    for (name, _) in SCENARIOS {
        let (s, r) = run(name);
        let partition = |tree| {
            let bsp = Bsp::new(&s.shape, tree).unwrap();
            Partition::new(s.shape, 1, Layout::Bsp(bsp)).unwrap()
        };
        assert_eq!(r.epochs[0].epoch, 1);
        assert_eq!(r.epochs[0].chunks_moved, 0);
        let mut before = partition(&r.epochs[0].layout);
        let mut total = 0;
        for e in &r.epochs[1..] {
            let after = partition(&e.layout);
            let mut changed = 0;
            for y in 0..s.chunks.1 {
                for x in 0..s.chunks.0 {
                    let c = ChunkPos { x, y };
                    changed += i64::from(before.owner_of_chunk(c) != after.owner_of_chunk(c));
                }
            }
            assert_eq!(e.chunks_moved, changed, "{name}: epoch {}", e.epoch);
            let listed: i64 = e.transfers.iter().map(|t| t.area.area()).sum();
            assert_eq!(listed, changed, "{name}: epoch {}", e.epoch);
            total += changed;
            before = after;
        }
        assert_eq!(r.summary.chunks_moved, total, "{name}");
        assert_eq!(r.summary.epochs as usize, r.epochs.len() - 1, "{name}");
        assert!(total > 0, "{name}: nothing moved");
    }
}

#[test]
fn a_hotspot_in_one_quadrant_is_balanced_within_a_minute() {
    let (_, r) = run("hotspot-quadrant");
    let s = &r.summary;
    assert!(
        s.max_over_avg_peak.unwrap() > 2.0,
        "a hotspot formed: peak {:?}",
        s.max_over_avg_peak
    );
    let rounds = s.rounds_to_balanced.expect("back under 1.3");
    assert!(
        rounds <= 60,
        "{rounds} rounds to max/avg <= {BALANCED_RATIO}"
    );
    let from = s.balanced_from_s.expect("stays balanced");
    assert!(from <= 90.0, "max/avg stays under 1.3 only from {from} s");
    assert!(s.max_over_avg_end.unwrap() <= BALANCED_RATIO);
    assert_eq!(
        (s.cells_added, s.cells_retired),
        (0, 0),
        "the lines do it alone"
    );
    // Once balanced, the lines rest: nothing moves in the last five minutes.
    let late = r
        .epochs
        .iter()
        .filter(|e| e.at_s >= s.duration_s - 300.0)
        .count();
    assert_eq!(late, 0, "lines still moving at the end");
}

#[test]
fn a_hotspot_walking_across_the_wrap_seam_is_followed_by_its_cells() {
    let (sc, r) = run("hotspot-wrap-seam");
    let crowd = &sc.crowds[0];
    // The crowd does cross the seam: east of x = 60, then west of x = 4.
    let xs: Vec<f64> = (0..=900)
        .step_by(10)
        .map(|t| crowd.centre_at(&sc.shape, t * 1000).x)
        .collect();
    let crossed = xs.windows(2).any(|w| w[0] > 60.0 && w[1] < 4.0);
    assert!(crossed, "the crowd crosses x = 64: {xs:?}");

    // Nodes 1 (west) and 2 (east) share the crowd: the x line between them, or the seam itself,
    // stays within a few chunks of the crowd's centre wherever it walks.
    let between = line(&r, "l", Axis::X);
    let w = sc.chunks.0 as f64;
    let torus = |a: f64, b: f64| {
        let d = (a - b).rem_euclid(w);
        d.min(w - d)
    };
    for t in (60..900).step_by(10) {
        let k = round_at(&r, t as f64);
        let at = between.at[k].expect("the line exists") as f64;
        let cx = crowd.centre_at(&sc.shape, t * 1000).x;
        let cut = torus(cx, at).min(torus(cx, 0.0));
        assert!(
            cut <= 6.0,
            "at {t} s the crowd at x = {cx:.1} is {cut:.1} chunks from line {at} and the seam"
        );
    }
    // ...and the load stays spread once the lines have caught up.
    let k = round_at(&r, 60.0);
    let worst = r.series.max_over_avg[k..]
        .iter()
        .flatten()
        .fold(0.0f64, |a, &b| a.max(b));
    assert!(
        worst <= 1.5,
        "max/avg reached {worst:.2} after the first minute"
    );
}

#[test]
fn a_dispersed_crowd_retires_cells_that_are_deleted_once_empty() {
    let (sc, r) = run("crowd-disperses");
    let s = &r.summary;
    assert!(s.cells_retired >= 1 && s.cells_deleted >= 1, "{s:?}");
    let end = sc.crowds[0].end_ms.unwrap() as f64 / 1000.0;
    for e in r.cell_events.iter().filter(|e| e.kind == "retiring") {
        assert!(e.at_s >= end, "retired before the crowd left: {e:?}");
        let deleted = r
            .cell_events
            .iter()
            .find(|d| d.kind == "deleted" && d.node == e.node)
            .unwrap_or_else(|| panic!("node {}'s cell retired and never deleted", e.node));
        assert!(deleted.at_s > e.at_s);
        // Deleted with no entity left: the node reported none in the round that deleted it.
        let k = round_at(&r, deleted.at_s);
        assert_eq!(node_series(&r, e.node).entities[k], Some(0), "{deleted:?}");
        // The layout that squeezed it out went out first: deleting it moved no chunk.
        let removal = r
            .epochs
            .iter()
            .find(|ep| ep.cause == "cell_deleted" && ep.at_s == deleted.at_s)
            .expect("the removal's epoch");
        assert_eq!(removal.chunks_moved, 0, "{removal:?}");
    }
    // The cells left carry the rest, the others hold nothing.
    let in_cells: Vec<_> = s.nodes.iter().filter(|n| n.state == "cell").collect();
    assert_eq!(in_cells.len(), 4 - s.cells_deleted as usize);
    assert!(in_cells.iter().all(|n| n.entities_end > 0), "{:?}", s.nodes);
    assert!(s
        .nodes
        .iter()
        .filter(|n| n.state == "spare")
        .all(|n| n.entities_end == 0 && n.chunks == 0));
}

#[test]
fn a_flapping_load_calms_the_line_it_crosses() {
    let (sc, r) = run("flapping-load");
    let s = &r.summary;
    let flaps = sc.duration_ms / sc.flaps[0].period_ms;
    // Reversals are counted and bounded: a few per flap at most, the line calming at each.
    assert!(s.reversals > 0, "the flap is seen");
    assert!(
        s.reversals <= 4 * flaps,
        "{} reversals over {flaps} flaps",
        s.reversals
    );
    // The line between the two places (x, between nodes 1 and 2) loses aggression down to
    // the floor: each flap reverses it before it has won the last halving back.
    let between = line(&r, "l", Axis::X);
    let lowest = between
        .aggression
        .iter()
        .flatten()
        .fold(1.0f64, |a, &b| a.min(b));
    assert!(lowest <= 0.125, "aggression stayed at {lowest}");
    // Every reversal is made with the aggression halved from the round before, and the line
    // keeps it.
    let floor = sc.balance.min_aggression;
    for e in &r.timeline {
        if let Decision::Line { path, line, .. } = &e.decision {
            if line.reversal && path == "l" {
                let k = round_at(&r, e.at_s);
                let (Some(before), Some(after)) =
                    (between.aggression[k - 1], between.aggression[k])
                else {
                    continue;
                };
                let halved = (before * 0.5).max(floor);
                assert!(
                    (line.aggression - halved).abs() < 1e-9,
                    "{e:?}: from {before}"
                );
                assert!((after - halved).abs() < 1e-9, "{e:?}: keeps {after}");
            }
        }
    }
    // No oscillation: the world handed back and forth shrinks minute by minute, to a
    // fraction of the first minute's by the last.
    let moved_in = |from_s: f64| -> i64 {
        r.epochs
            .iter()
            .filter(|e| e.at_s >= from_s && e.at_s < from_s + 60.0)
            .map(|e| e.chunks_moved)
            .sum()
    };
    let (first, last) = (
        moved_in(0.0),
        moved_in(sc.duration_ms as f64 / 1000.0 - 60.0),
    );
    assert!(
        last * 3 < first,
        "{last} chunks moved in the last minute against {first} in the first"
    );
    // The root line, with the raid under it on both places, does not flap.
    let root = line(&r, "", Axis::Y);
    let root_reversals = r
        .timeline
        .iter()
        .filter(|e| matches!(&e.decision, Decision::Line { path, line, .. } if path.is_empty() && line.reversal))
        .count();
    assert!(root_reversals <= 2, "{root_reversals}");
    assert!(
        root.at.iter().flatten().all(|at| *at <= 32),
        "the root line moves down only"
    );
}

#[test]
fn a_node_that_joins_gets_a_cell_and_carries_its_share() {
    let (sc, r) = run("node-joins");
    let (spare, join_ms) = sc.spares[0];
    let added = r
        .cell_events
        .iter()
        .find(|e| e.kind == "added")
        .expect("a cell is added");
    assert_eq!(added.node, spare);
    assert!(added.at_s * 1000.0 >= join_ms as f64, "{added:?}");
    assert!(
        added.at_s * 1000.0 <= (join_ms + 2 * sc.balance.meta_period_ms) as f64,
        "added late: {added:?}"
    );
    let s = &r.summary;
    let n = s.nodes.iter().find(|n| n.node == spare).unwrap();
    assert_eq!(n.state, "cell");
    assert!(
        n.load_end >= 0.8 * s.avg_load_end,
        "node {spare} carries {:.3} of an average {:.3}",
        n.load_end,
        s.avg_load_end
    );
    assert!(s.max_over_avg_end.unwrap() <= BALANCED_RATIO);
    // Before it joined, it reported nothing; the cell it got started with no area.
    let k = round_at(&r, join_ms as f64 / 1000.0);
    assert!(node_series(&r, spare).load[..k].iter().all(Option::is_none));
    let created = r
        .epochs
        .iter()
        .find(|e| e.cause == "cell_added")
        .expect("the epoch that adds it");
    assert_eq!(created.chunks_moved, 0, "a new cell starts empty");
}

#[test]
fn a_node_that_applies_late_holds_the_lines_beside_it() {
    // The hotspot with node 1 applying each layout 5 s late: its lines wait ("stale") and
    // still get there.
    let text = format!(
        "{}\n[[lag]]\nnode = 1\nms = 5000\n",
        text("hotspot-quadrant")
    );
    let s = Scenario::from_toml(&text).unwrap();
    assert_eq!(s.lag_ms[&1], 5000);
    let r = balancesim::run(&s).unwrap();
    let on_time = run("hotspot-quadrant").1;
    let stale = |r: &Report| r.summary.holds_by_reason.get("stale").copied().unwrap_or(0);
    assert!(stale(&r) > stale(&on_time));
    assert!(r.summary.rounds_to_balanced.unwrap() > on_time.summary.rounds_to_balanced.unwrap());
    assert!(r.summary.max_over_avg_end.unwrap() <= BALANCED_RATIO);
}

#[test]
fn bad_scenarios_are_refused_with_a_clear_error() {
    let good = text("hotspot-wrap-seam");
    let cases = [
        (good.replace("chunks_x = 64", "chunks_x = 0"), "world"),
        (good.replace("initial = 4", "initial = 0"), "nodes.initial"),
        (good.replace("duration_s = 900", "duration_s = 0"), "duration_s"),
        (good.replace("speed = 0.1", "speed = 0.0"), "speed"),
        (good.replace("radius = 8", "radius = 40"), "radius"),
        (
            good.replace("name = \"caravan\"", "name = \"caravan\"\nmood = 3"),
            "mood",
        ),
        (
            format!("{good}\n[balance]\nsafety_bound = -1.0\n"),
            "balance.safety_bound",
        ),
        (
            format!("{good}\n[balance]\nlower_bound = 0.6\n"),
            "balance.add_above",
        ),
        (
            format!("{good}\n[[lag]]\nnode = 9\nms = 10\n"),
            "no such node",
        ),
        (
            format!("{good}\n[[lag]]\nnode = 1\nms = 10\nrounds = 2\n"),
            "not both",
        ),
        (
            format!("{good}\n[[spares]]\njoin_s = 1000\n"),
            "joins after",
        ),
        (
            format!("{good}\n[load]\nsmoothing_bias = 0.0\n"),
            "smoothing_bias",
        ),
        (
            format!("{good}\n[[flaps]]\nname = \"x\"\nentities = 1\na = [0.0, 0.0]\nb = [1.0, 1.0]\nperiod_s = 1\n"),
            "two balance periods",
        ),
        (
            format!("{good}\n[[crowds]]\nname = \"caravan\"\nentities = 1\nat = [0.0, 0.0]\n"),
            "used twice",
        ),
        (
            good.replace("entities = 600", "entities = 300000"),
            "300400 entities",
        ),
        ("name = ".to_owned(), "TOML"),
    ];
    for (text, needle) in cases {
        let e = Scenario::from_toml(&text)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{needle:?} not in {e:?}");
    }
    // The file as written round-trips its defaults.
    let f = ScenarioFile::from_toml(good).unwrap();
    assert_eq!(f.nodes.ghost_chunks, 6);
    assert_eq!(f.load.cost_per_entity, 0.001);
}
