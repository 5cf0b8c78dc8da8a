//! The director in the cluster simulator: a hotspot holding about 60% of the entities in one
//! cell of four, balanced by the real balancer in virtual time, each layout it yields committed
//! as the next epoch and applied by the sidecars' own mass handoffs; every invariant of the
//! simulator is checked after every step, and the census once the world is quiet.
//!
//! A balance run is some sixty times the work of a catalogue walk, so these run a handful of
//! seeds (`CELLMESH_SIM_BALANCE_SEEDS`, default 4) rather than the suite's hundreds.

use cellmesh_sim::{named, run, run_traced, Balance, Report, Scenario};
use cellmesh_world::balance::LoadConfig;

fn seeds() -> u64 {
    std::env::var("CELLMESH_SIM_BALANCE_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4)
}

/// The run's balance figures, once it held every invariant.
fn balanced(r: &Report) -> &Balance {
    assert!(r.ok(), "{r}");
    let b = r.balance.as_ref().expect("the director ran");
    assert!(b.refused.is_empty(), "{r}: layouts refused {:?}", b.refused);
    b
}

/// Convergence, as issue 15 asks it of the cluster simulator: from a hotspot, max/avg of the
/// nodes' reals falls to 1.3 within a bounded number of rounds and stays about there.
fn converges(name: &str) {
    let s = named(name).expect("a scenario of the catalogue");
    let mut ends = Vec::new();
    for seed in 1..=seeds() {
        let r = run(&s, seed);
        let b = balanced(&r);
        let first = &b.samples[0];
        let total: usize = first.entities.iter().map(|(_, n)| n).sum();
        let hot = first.entities.iter().map(|(_, n)| *n).max().unwrap_or(0);
        let share = hot as f64 / total as f64;
        assert!(
            (0.5..=0.7).contains(&share),
            "{r}: the hotspot holds {share:.2} of the entities at first"
        );
        assert!(b.start_max_over_avg() >= 2.0, "{r}");
        assert!(
            b.epochs_committed() >= 3 && b.chunks_moved() > 0 && r.stats.handoffs > 0,
            "{r}: the director moved lines and the nodes handed entities off"
        );
        // Within 55 rounds (of the 59 the motion lasts), five rounds in a row at or under 1.3.
        // The round is chaotic in the seed: anything that changes which frames the nodes send
        // (here the clients' update budget) sends a seed down another path. Over seeds 1–30 of
        // `balance_cuts` it came at round 24 on average either way, at 10–41 without the budget
        // and 10–53 with it.
        let from = b.rounds_to(1.3, 5);
        assert!(
            from.is_some_and(|f| f <= 55),
            "{r}: reached 1.3 from {from:?}"
        );
        let from = from.unwrap_or(0);
        // Then it stays there on average, and never swings back near the hotspot's figure (the
        // smoothed loads lag the real ones, so a line overshoots now and then).
        let after: Vec<f64> = b.samples[from - 1..]
            .iter()
            .map(|s| s.max_over_avg)
            .collect();
        let mean = after.iter().sum::<f64>() / after.len() as f64;
        assert!(
            mean <= 1.3,
            "{r}: max/avg {mean:.2} on average from round {from}"
        );
        assert!(
            b.worst_from(from) <= 1.75,
            "{r}: max/avg back to {:.2} after round {from}",
            b.worst_from(from)
        );
        assert!(b.end_max_over_avg <= 1.4, "{r}");
        ends.push(b.end_max_over_avg);
    }
    let mean_end = ends.iter().sum::<f64>() / ends.len() as f64;
    assert!(mean_end <= 1.3, "max/avg at the end {ends:?}");
}

#[test]
fn a_hotspot_in_one_cell_of_four_is_balanced_to_1_3_by_real_handoffs() {
    converges("balance");
}

#[test]
fn links_cut_while_the_lines_move_delay_the_handoffs_but_not_the_balance() {
    converges("balance_cuts");
}

#[test]
fn a_node_that_dies_while_the_lines_move_is_restored_and_the_director_commits_on() {
    let s = named("balance_kill").expect("a scenario of the catalogue");
    for seed in 1..=seeds() {
        let r = run(&s, seed);
        let b = balanced(&r);
        assert!(b.epochs_committed() >= 1, "{r}");
        // The dead node's cell went to a live one: three nodes hold the world.
        let last = b.samples.last().expect("rounds ran");
        assert_eq!(last.entities.len(), 3, "{r}");
    }
}

#[test]
fn a_node_back_as_a_spare_takes_the_cell_its_failover_gave_away() {
    let s = named("balance_restart").expect("a scenario of the catalogue");
    for seed in 1..=seeds() {
        let r = run(&s, seed);
        let b = balanced(&r);
        assert!(
            b.reasons.get("cell_reassigned").copied().unwrap_or(0) >= 1,
            "{r}: the spare got a cell back"
        );
        // One cell a node again: four nodes hold the world.
        let last = b.samples.last().expect("rounds ran");
        assert_eq!(last.entities.len(), 4, "{r}");
    }
}

#[test]
fn without_moves_the_hotspot_stays() {
    // The same run with a director whose lines never move (every excess is under the dead
    // band): the NPCs' wandering alone does not spread the hotspot, so the balance above is
    // the director's.
    let s = Scenario {
        director: Some(LoadConfig {
            min_offload: f64::MAX,
            ..LoadConfig::default()
        }),
        ..named("balance").expect("a scenario of the catalogue")
    };
    let r = run(&s, 1);
    let b = balanced(&r);
    assert_eq!(b.epochs_committed(), 0, "{r}");
    assert!(b.end_max_over_avg >= 2.0, "{r}");
}

#[test]
fn a_balance_seed_reproduces_its_run() {
    // Fifteen seconds of motion: the director has committed several epochs by then.
    let s = Scenario {
        motion_ms: 15_000,
        ..named("balance").expect("a scenario of the catalogue")
    };
    let a = run_traced(&s, 5, Some(200));
    let b = run_traced(&s, 5, Some(200));
    assert!(a.ok(), "{a}");
    assert!(
        a.balance
            .as_ref()
            .is_some_and(|b| b.epochs_committed() >= 3),
        "{a}"
    );
    assert_eq!((&a.stats, &a.balance), (&b.stats, &b.balance));
    assert_eq!(a.trace, b.trace);
}
