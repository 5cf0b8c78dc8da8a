//! The bubble placement simulator on every shipped scenario with its expected outcome, the
//! cheater's outcome against the honest one, and the errors of bad scenario files.

use std::collections::{BTreeMap, HashMap};

use cellmesh_geosim::{self as geosim, Report, Scenario, ScenarioFile};
use cellmesh_world::bubbles::{BubbleId, Decision, MemberId, Reason, SiteId};

const SCENARIOS: [(&str, &str); 9] = [
    (
        "majority-montreal",
        include_str!("../scenarios/majority-montreal.toml"),
    ),
    ("two-vs-two", include_str!("../scenarios/two-vs-two.toml")),
    (
        "three-continents",
        include_str!("../scenarios/three-continents.toml"),
    ),
    (
        "fairness-cap",
        include_str!("../scenarios/fairness-cap.toml"),
    ),
    ("big-event", include_str!("../scenarios/big-event.toml")),
    (
        "approach-merge",
        include_str!("../scenarios/approach-merge.toml"),
    ),
    (
        "flapping-rtt",
        include_str!("../scenarios/flapping-rtt.toml"),
    ),
    ("edge-outage", include_str!("../scenarios/edge-outage.toml")),
    ("cheater-vpn", include_str!("../scenarios/cheater-vpn.toml")),
];

fn file(name: &str) -> ScenarioFile {
    let (_, text) = SCENARIOS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("a shipped scenario");
    ScenarioFile::from_toml(text).unwrap()
}

fn run_file(f: ScenarioFile) -> (Scenario, Report) {
    let s = Scenario::new(f).unwrap();
    let r = geosim::run(&s).unwrap();
    (s, r)
}

fn run(name: &str) -> (Scenario, Report) {
    run_file(file(name))
}

fn player(r: &Report, name: &str) -> MemberId {
    r.players.iter().position(|p| p == name).unwrap() as MemberId
}

fn site(s: &Scenario, name: &str) -> SiteId {
    s.sites.id(name).unwrap()
}

/// Placement decisions (one per live bubble per evaluation).
fn placements(r: &Report) -> impl Iterator<Item = &Decision> {
    r.decisions.iter().filter(|d| {
        !matches!(
            d.reason,
            Reason::Merged { .. } | Reason::Crossed { .. } | Reason::Dissolved
        )
    })
}

/// Bubble moves as (seconds, from, to, reason kind).
fn moves(s: &Scenario, r: &Report) -> Vec<(u64, String, String, &'static str)> {
    placements(r)
        .filter(|d| d.is_move())
        .map(|d| {
            (
                d.at_ms / 1000,
                s.sites.name(d.from_site.unwrap()).to_owned(),
                s.sites.name(d.to_site).to_owned(),
                d.reason.kind(),
            )
        })
        .collect()
}

/// The site simulating a member at each evaluation, from the decisions.
fn site_over_time(r: &Report, member: MemberId) -> Vec<(u64, SiteId)> {
    placements(r)
        .filter(|d| d.members.contains(&member))
        .map(|d| (d.at_ms, d.to_site))
        .collect()
}

fn distance(s: &Scenario, a: &[MemberId], b: &[MemberId], t_ms: u64) -> f64 {
    let mut best = f64::INFINITY;
    for &i in a {
        for &j in b {
            let (pi, _) = s.players[i as usize].state_at(&s.world, t_ms);
            let (pj, _) = s.players[j as usize].state_at(&s.world, t_ms);
            best = best.min(s.world.distance(pi, pj));
        }
    }
    best
}

fn names(r: &Report, prefix: &str) -> Vec<MemberId> {
    r.players
        .iter()
        .enumerate()
        .filter(|(_, n)| n.starts_with(prefix))
        .map(|(i, _)| i as MemberId)
        .collect()
}

#[test]
fn every_shipped_scenario_runs_the_same_twice() {
    for (name, text) in SCENARIOS {
        let s = Scenario::from_toml(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let a = geosim::run(&s).unwrap();
        let b = geosim::run(&s).unwrap();
        assert_eq!(a.decisions, b.decisions, "{name}");
        assert_eq!(a.summary, b.summary, "{name}");
        assert!(!a.render_text().is_empty());
        let svg = geosim::render_svg(&a).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains(&a.summary.scenario),
            "{name}"
        );
    }
}

#[test]
fn three_montreal_one_paris_moves_to_montreal() {
    let (s, r) = run("majority-montreal");
    // The Montrealers join at 60 s; the gain holds from then; the move comes 30 s later.
    assert_eq!(
        moves(&s, &r),
        vec![(90, "paris".into(), "montreal".into(), "moved")]
    );
    let amelie = player(&r, "amelie") as usize;
    let last = r.series.player_rtt_ms[amelie].last().unwrap().unwrap();
    assert!(
        (85.0..=95.0).contains(&last),
        "the Parisian pays ~90 ms: {last}"
    );
    assert!(r.summary.policy.weighted_mean_rtt_ms < r.summary.always_core.weighted_mean_rtt_ms);
}

#[test]
fn two_vs_two_moves_nothing() {
    let (s, r) = run("two-vs-two");
    assert!(moves(&s, &r).is_empty());
    let par = site(&s, "paris");
    assert!(placements(&r).all(|d| d.to_site == par));
    assert!(r.summary.stays_by_reason.contains_key("tie"));
}

#[test]
fn three_continents_the_middle_site_usually_wins() {
    let (s, r) = run("three-continents");
    assert!(moves(&s, &r).is_empty());
    let (par, hkg) = (site(&s, "paris"), site(&s, "hongkong"));
    for who in ["pierre", "maude", "wing", "ka-ho"] {
        let sites = site_over_time(&r, player(&r, who));
        assert!(sites.iter().all(|&(_, x)| x == par), "{who}");
    }
    // Not always: a Hong Kong majority with one Parisian plays in Hong Kong.
    for who in ["hk-1", "paul"] {
        let sites = site_over_time(&r, player(&r, who));
        assert!(sites.iter().all(|&(_, x)| x == hkg), "{who}");
    }
    // With a second Hong Kong player, Hong Kong had the lowest mean: the cap kept Paris.
    let ka_ho = player(&r, "ka-ho");
    assert!(placements(&r).any(|d| d.members.contains(&ka_ho)
        && matches!(d.reason, Reason::FairnessCap { site, .. } if site == hkg)));
}

#[test]
fn the_fairness_cap_keeps_everyone_under_180_ms() {
    let (s, r) = run("fairness-cap");
    assert_eq!(
        moves(&s, &r),
        vec![
            (120, "montreal".into(), "paris".into(), "cap_forced"),
            (630, "paris".into(), "montreal".into(), "moved"),
        ]
    );
    assert_eq!(r.summary.policy.above_cap_player_s, 0.0);

    // Without the cap, the majority keeps Montreal and mei plays at 220 ms.
    let mut f = file("fairness-cap");
    f.policy.fairness_cap_ms = 1_000.0;
    let (s, r) = run_file(f);
    assert!(moves(&s, &r).is_empty());
    let mei = r.summary.players.iter().find(|p| p.name == "mei").unwrap();
    assert!(mei.mean_rtt_ms > 200.0, "{}", mei.mean_rtt_ms);
}

#[test]
fn a_big_event_is_gathered_on_the_best_site_for_the_crowd_before_it_meets() {
    let (s, r) = run("big-event");
    let last = r.decisions.last().unwrap().at_ms;
    let end: Vec<&Decision> = placements(&r).filter(|d| d.at_ms == last).collect();
    assert_eq!(end.len(), 1, "one bubble");
    assert_eq!(end[0].members.len(), 100);
    assert!(end[0].spread_over_nodes);

    // The best for the whole crowd, computed here from the RTT table: the lowest weighted mean
    // among sites keeping everyone under the cap.
    let best = s
        .sites
        .ids()
        .filter_map(|site| {
            let rtts: Vec<f64> = (0..s.players.len())
                .map(|i| s.true_rtt(i, site, last))
                .collect();
            let worst = rtts.iter().cloned().fold(0.0, f64::max);
            let mean = rtts.iter().map(|r| r.min(180.0)).sum::<f64>() / rtts.len() as f64;
            (worst <= 180.0).then_some((mean, site))
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap()
        .1;
    assert_eq!(end[0].to_site, best);

    // Gathered before the crowds met: at the merge they were still a kilometre apart or more.
    let merge = placements(&r)
        .find(|d| matches!(d.reason, Reason::Merge { .. }))
        .unwrap();
    let (par, mtl, hk) = (names(&r, "par-"), names(&r, "mtl-"), names(&r, "hk-"));
    for (a, b) in [(&par, &mtl), (&par, &hk), (&mtl, &hk)] {
        let d = distance(&s, a, b, merge.at_ms);
        assert!(d >= 1_000.0, "{d} m at the merge");
    }
}

#[test]
fn approaching_groups_are_merged_before_contact_on_foot_and_in_ships() {
    let (s, r) = run("approach-merge");
    let par = site(&s, "paris");
    let merges: Vec<&Decision> = placements(&r)
        .filter(|d| matches!(d.reason, Reason::Merge { .. }))
        .collect();
    assert_eq!(merges.len(), 2);

    let (ships_mtl, ships_par) = (names(&r, "mtl-pilot"), names(&r, "par-pilot"));
    let ship = merges
        .iter()
        .find(|d| d.members.contains(&ships_mtl[0]))
        .unwrap();
    // Closing at 500 m/s, grouped a minute ahead: 30 km apart.
    let gap = distance(&s, &ships_mtl, &ships_par, ship.at_ms);
    assert!(gap >= 25_000.0, "ships merged {gap} m apart");
    assert_eq!(
        ship.to_site, par,
        "the pilot counting double, Paris is best"
    );

    let (walkers, guards) = (names(&r, "mtl-walker"), names(&r, "par-guard"));
    let walk = merges
        .iter()
        .find(|d| d.members.contains(&walkers[0]))
        .unwrap();
    let gap = distance(&s, &walkers, &guards, walk.at_ms);
    assert!(
        (1_500.0..=2_000.0).contains(&gap),
        "walkers merged {gap} m apart"
    );
    // A tie: the walkers cross to the side they approached.
    assert_eq!(walk.to_site, par);

    // From the merge on, never split across sites again (they stand together to the end).
    for (a, b, from) in [
        (&walkers, &guards, walk.at_ms),
        (&ships_mtl, &ships_par, ship.at_ms),
    ] {
        let sa = site_over_time(&r, a[0]);
        let sb: HashMap<u64, SiteId> = site_over_time(&r, b[0]).into_iter().collect();
        for (t, x) in sa.into_iter().filter(|(t, _)| *t >= from) {
            assert_eq!(Some(&x), sb.get(&t), "at {t} ms");
        }
    }
}

/// Moves of each bubble, in order.
fn moves_by_bubble(r: &Report) -> BTreeMap<BubbleId, Vec<(u64, Reason)>> {
    let mut out: BTreeMap<BubbleId, Vec<(u64, Reason)>> = BTreeMap::new();
    for d in r.decisions.iter().filter(|d| d.is_move()) {
        out.entry(d.group_id)
            .or_default()
            .push((d.at_ms, d.reason.clone()));
    }
    out
}

#[test]
fn a_flapping_rtt_never_ping_pongs() {
    let (s, r) = run("flapping-rtt");
    assert!(moves(&s, &r).len() <= 1, "{:?}", moves(&s, &r));
    assert!(
        r.summary.oracle.moves >= 50,
        "the oracle follows the flaps: {}",
        r.summary.oracle.moves
    );
    let dwell = s.params.dwell_ms;
    for (b, ms) in moves_by_bubble(&r) {
        for w in ms.windows(2) {
            assert!(
                w[1].0 - w[0].0 >= dwell,
                "bubble {b} moved twice within the dwell"
            );
        }
    }
    for kind in ["not_sustained", "gain_too_small"] {
        assert!(r.summary.stays_by_reason.contains_key(kind), "{kind}");
    }
}

#[test]
fn an_edge_outage_falls_back_to_the_core() {
    let (s, r) = run("edge-outage");
    assert_eq!(
        moves(&s, &r),
        vec![
            (300, "montreal".into(), "paris".into(), "fallback"),
            (630, "paris".into(), "montreal".into(), "moved"),
        ]
    );
    let mtl = site(&s, "montreal");
    for d in &r.decisions {
        if (300_000..600_000).contains(&d.at_ms) {
            assert_ne!(d.to_site, mtl, "placed on a site that is down: {d:?}");
        }
    }
}

/// What a decision does, without the figures behind it: when, which bubble, who, from where,
/// to where, and the kind of reason.
type Outcome = (
    u64,
    BubbleId,
    Vec<MemberId>,
    Option<SiteId>,
    SiteId,
    &'static str,
);

fn outcome(r: &Report) -> Vec<Outcome> {
    r.decisions
        .iter()
        .map(|d| {
            (
                d.at_ms,
                d.group_id,
                d.members.clone(),
                d.from_site,
                d.to_site,
                d.reason.kind(),
            )
        })
        .collect()
}

#[test]
fn a_cheater_gets_the_honest_outcome() {
    let (s, cheat) = run("cheater-vpn");
    assert!(moves(&s, &cheat).is_empty());
    let mut honest = file("cheater-vpn");
    for p in &mut honest.players {
        p.rtt_changes.clear();
    }
    let (_, honest) = run_file(honest);
    assert_eq!(outcome(&cheat), outcome(&honest));

    // The protection is what holds: measured as is, the inflated ping would have forced the
    // bubble to Paris through the fairness cap.
    let mut naive = file("cheater-vpn");
    naive.policy.rtt.tolerance_ms = f64::INFINITY;
    let (s, naive) = run_file(naive);
    let forced = moves(&s, &naive);
    assert!(
        forced
            .iter()
            .any(|(t, from, to, kind)| (300..=315).contains(t)
                && (from.as_str(), to.as_str(), *kind) == ("montreal", "paris", "cap_forced")),
        "{forced:?}"
    );
}

/// Mallory's answers delayed from their very first ping: every answer by 90 ms, or only those
/// to the Montreal site.
fn inflated_from_login(probe: geosim::Probe, sites: &[&str]) -> (Scenario, Report) {
    let mut f = file("cheater-vpn");
    f.rtt.probe = probe;
    let mallory = f.players.iter_mut().find(|p| p.name == "mallory").unwrap();
    mallory.rtt_changes = sites
        .iter()
        .map(|site| geosim::RttChangeSpec {
            site: site.to_string(),
            add_ms: 90.0,
            measured_only: true,
            from_s: 0.0,
            to_s: None,
            period_s: None,
        })
        .collect();
    run_file(f)
}

#[test]
fn a_client_inflating_from_login_gets_the_honest_outcome_with_a_tcp_probe() {
    let mut honest = file("cheater-vpn");
    for p in &mut honest.players {
        p.rtt_changes.clear();
    }
    let (_, honest) = run_file(honest);
    for sites in [&["paris", "montreal", "hongkong"][..], &["montreal"]] {
        let (s, cheat) = inflated_from_login(geosim::Probe::Tcp, sites);
        assert!(moves(&s, &cheat).is_empty(), "{sites:?}");
        assert_eq!(outcome(&cheat), outcome(&honest), "{sites:?}");
        // Timed pings alone learn the session's baseline from the inflated answers: 92 + 90 ms to
        // Montreal is above the cap, and mallory vetoes the others' site from the first
        // evaluation. This is why the kernel's figure is the one placement uses.
        let (s, pinged) = inflated_from_login(geosim::Probe::Ping, sites);
        assert_ne!(outcome(&pinged), outcome(&honest), "{sites:?}");
        let first = placements(&pinged).next().unwrap();
        assert_eq!(first.to_site, site(&s, "paris"), "{sites:?}");
    }
}

#[test]
fn a_minority_inflating_their_ping_does_not_stop_the_majority_move() {
    let (_, honest) = run("majority-montreal");
    let mut f = file("majority-montreal");
    let amelie = f.players.iter_mut().find(|p| p.name == "amelie").unwrap();
    amelie.rtt_changes.push(geosim::RttChangeSpec {
        site: "montreal".into(),
        add_ms: 300.0,
        measured_only: true,
        from_s: 30.0,
        to_s: None,
        period_s: None,
    });
    let (_, cheat) = run_file(f);
    assert_eq!(outcome(&cheat), outcome(&honest));
}

#[test]
fn bad_scenarios_are_refused_with_a_clear_error() {
    let good = SCENARIOS[0].1;
    let cases = [
        (good.replace("core = true", ""), "exactly one"),
        (
            good.replace("montreal = 10", ""),
            "no RTT to site \"montreal\"",
        ),
        (
            good.replace("location = \"paris\"", "location = \"lyon\""),
            "lyon",
        ),
        (good.replace("speed = 1.5", "speed = 0.0"), "speed"),
        (
            good.replace("duration_s = 600", "duration_s = 0"),
            "duration_s",
        ),
        (good.replace("join_s = 60", "join_s = 6000"), "joins after"),
        (
            good.replace("name = \"amelie\"", "name = \"amelie\"\nteam = 3"),
            "team",
        ),
        (
            format!("{good}\n[[outages]]\nsite = \"paris\"\nfrom_s = 1\nto_s = 2\n"),
            "core",
        ),
        (
            format!("{good}\n[[outages]]\nsite = \"lyon\"\nfrom_s = 1\nto_s = 2\n"),
            "lyon",
        ),
        (format!("{good}\n[policy]\ngain_ms = -1.0\n"), "gain_ms"),
        ("name = ".to_owned(), "TOML"),
        (good.replace("count = 3", "count = 19000"), "samples"),
        (good.replace("count = 3", "count = 30000"), "players"),
    ];
    for (text, needle) in cases {
        let e = Scenario::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains(needle), "{needle:?} not in {e:?}");
    }
}

#[test]
fn the_plot_shades_outages_and_labels_each_move_with_its_group_and_kind() {
    let (_, r) = run("edge-outage");
    let svg = geosim::render_svg(&r).unwrap();
    assert!(svg.contains("montreal down"), "the outage is named");
    let fallback = r
        .series
        .moves
        .iter()
        .find(|m| m.kind == "fallback")
        .expect("a fallback");
    assert_eq!(fallback.to, "paris");
    // The fallback lies within the outage it answers.
    let (_, from, to) = &r.series.outages[0];
    assert!((*from..=*to).contains(&fallback.t_s), "{fallback:?}");
    for m in &r.series.moves {
        assert!(svg.contains(&m.label()), "{} is labelled", m.label());
    }
}

#[test]
fn a_thousand_players_hour_stays_legible() {
    // Fifty groups of twenty Montreal players, far apart, and an outage of Montreal: every group
    // falls back to Paris and returns afterwards, a hundred moves and more.
    let mut toml = String::from(
        r#"name = "crowds"
duration_s = 3600
seed = 11

[[sites]]
name = "paris"
core = true

[[sites]]
name = "montreal"

[rtt.from.paris]
paris = 8
montreal = 92

[rtt.from.montreal]
paris = 92
montreal = 10

[[outages]]
site = "montreal"
from_s = 600
to_s = 900
"#,
    );
    for g in 0..50 {
        toml.push_str(&format!(
            "\n[[players]]\nname = \"g{g}\"\ncount = 20\nlocation = \"montreal\"\nstart = [{}.0, 60000.0]\n",
            2_000 + 2_500 * g
        ));
    }
    let (s, r) = run_file(ScenarioFile::from_toml(&toml).unwrap());
    assert_eq!(s.players.len(), 1000);
    assert!(r.series.moves.len() > 90, "{} moves", r.series.moves.len());
    let svg = geosim::render_svg(&r).unwrap();
    assert!(svg.contains("one lane per group"));
    assert!(svg.contains("montreal down"));
    // One lane label per group at most, not a label per move.
    let texts = svg.matches("<text").count();
    assert!(texts < 120, "{texts} texts");
}
