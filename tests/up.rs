//! `cellmesh up` end to end: the whole cluster over real loopback sockets.

use std::time::Duration;

use cellmesh::up::{run, UpOptions};

mod support;

/// One cluster at a time: each test runs a whole world (up to four nodes and 80 bots), as `up`
/// runs on a machine; two at once on a small machine starve each other, and the figures and
/// error counts asserted would measure the machine rather than the mesh.
static ONE_UP: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Four nodes, bots and NPCs crossing borders: every input delivered, no entity lost, doubled or
/// seen to vanish by a handoff, and the world at rest for the census.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_four_nodes_delivers_every_input_and_hands_off_without_loss() {
    let _one = ONE_UP.lock().await;
    let opts = UpOptions {
        bots: 20,
        npcs: 40,
        nodes: 4,
        duration: Some(Duration::from_secs(8)),
        summary_json: None,
        seed: 11,
        status: false,
        chaos: None,
        chaos_in_place: false,
        ..UpOptions::default()
    };
    let s = run(opts, std::future::pending()).await.expect("up runs");
    eprintln!("{s:?}");
    assert_eq!(s.sessions_peak, 20, "{s:?}");
    assert!(s.inputs_sent > 20 * 20, "bots sent too few inputs: {s:?}");
    assert!(s.inputs_applied > 0, "{s:?}");
    assert!(s.updates_delivered > 1000, "{s:?}");
    assert!(
        s.rtt_samples > 0 && s.rtt_ms_p50 > 0.0 && s.rtt_ms_p99 >= s.rtt_ms_p50,
        "{s:?}"
    );
    assert!(s.handoffs > 0, "no handoffs: {s:?}");
    // The arenas' players fight NPCs with entity commands, each answered.
    assert!(s.commands_routed > 0, "{s:?}");
    assert!(s.command_results_ok > 0, "{s:?}");
    // They trade under exclusive claims: some granted, no player in two trades at once.
    assert!(s.claims_granted > 0 && s.trades_done > 0, "{s:?}");
    assert_eq!(s.trades_overlapping, 0, "{s:?}");
    assert_eq!(
        (
            s.errors,
            s.vanished_on_handoff,
            s.entities_lost,
            s.entities_duplicated,
            s.in_doubt_now
        ),
        (0, 0, 0, 0, 0),
        "(errors, vanished on handoff, lost, duplicated, in doubt): {s:?}"
    );
    // Every input is delivered (none is dropped on a clean run); the census reads a world at rest.
    assert_eq!(s.inputs_delivered, s.inputs_sent, "{s:?}");
    assert!(s.census_at_rest, "{s:?}");
    assert_eq!(s.inputs_unaccounted, 0, "{s:?}");
    assert!(s.problems().is_empty(), "{:?}: {s:?}", s.problems());
}

/// Nodes killed as a crash kills a process (every task and socket at once) and started again:
/// every killed world is restored on the live nodes, every session moves to a live gateway with
/// its client connected and finds its one avatar, and nothing is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_chaos_restores_every_killed_world_and_keeps_every_session() {
    let _one = ONE_UP.lock().await;
    chaos_keeps_everything(false).await;
}

/// The same with every killed node restarted in place: it takes its node id over at once (its
/// state dir proves its predecessor dead) and gets its own world back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_chaos_in_place_restores_every_killed_world_and_keeps_every_session() {
    let _one = ONE_UP.lock().await;
    chaos_keeps_everything(true).await;
}

async fn chaos_keeps_everything(in_place: bool) {
    let opts = UpOptions {
        bots: 40,
        npcs: 40,
        nodes: 4,
        duration: Some(Duration::from_secs(32)),
        summary_json: None,
        seed: 3,
        status: false,
        chaos: Some(Duration::from_secs(7)),
        chaos_in_place: in_place,
        ..UpOptions::default()
    };
    let s = run(opts, std::future::pending()).await.expect("up runs");
    eprintln!("{s:?}");
    // Kills at 7, 14 and 21 s; none in the last 10 s.
    assert_eq!(s.nodes_killed, 3, "{s:?}");
    assert!(s.entities_restored > 0, "{s:?}");
    assert!(
        s.restore_ms_p50 > 0.0 && s.restore_ms_p99 >= s.restore_ms_p50,
        "{s:?}"
    );
    assert!(s.sessions_kept > 0, "no session moved: {s:?}");
    assert_eq!(
        (
            s.sessions_dropped,
            s.accounts_with_two_avatars,
            s.sessions_without_avatar,
            s.avatars_after_logout,
            s.entities_lost,
            s.entities_duplicated,
        ),
        (0, 0, 0, 0, 0, 0),
        "(sessions dropped, two avatars, no avatar, avatars after logout, lost, duplicated): {s:?}"
    );
    assert_eq!(s.inputs_unaccounted, 0, "{s:?}");
    assert!(s.problems().is_empty(), "{:?}: {s:?}", s.problems());
}

/// The binary itself, as a user runs it: exits 0 and writes the summary.
#[test]
fn up_binary_writes_summary_json() {
    let _one = ONE_UP.blocking_lock();
    let (v, stdout) = support::run_up_binary(
        &[
            "--nodes",
            "1",
            "--bots",
            "5",
            "--npcs",
            "10",
            "--duration",
            "3",
        ],
        &[
            "inputs_sent",
            "inputs_delivered",
            "updates_delivered",
            "sessions_peak",
            "errors",
            "rtt_ms_p50",
            "rtt_ms_p99",
            "inputs_unaccounted",
            "census_at_rest",
        ],
    );
    assert_eq!(v["inputs_unaccounted"], 0, "{v}");
    assert_eq!(v["census_at_rest"], true, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["sessions_peak"], 5, "{v}");
    assert!(stdout.contains("sessions="), "no status line in: {stdout}");
}

/// `cellmesh up --geos 2 --duration 60`, as a user runs it, for three seeds: every claim key is
/// granted by its home geo's store alone, so no key is held twice world-wide (the arenas' trades
/// cross the geo border), and no account has two avatars. Each geo keeps its own claim store.
#[test]
fn two_geos_hold_every_claim_once_world_wide() {
    let _one = ONE_UP.blocking_lock();
    for seed in ["1", "2", "3"] {
        let (v, _) = support::run_up_binary(
            &["--geos", "2", "--duration", "60", "--seed", seed],
            &[
                "trades_overlapping",
                "claims_overlapping",
                "accounts_with_two_avatars",
            ],
        );
        let n = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
        assert_eq!(
            (
                n("trades_overlapping"),
                n("claims_overlapping"),
                n("accounts_with_two_avatars")
            ),
            (0, 0, 0),
            "seed {seed}: {v}"
        );
        // Trades did cross: claims granted, some refused because the other geo's entity held
        // the key.
        assert!(
            n("claims_granted") > 100 && n("trades_done") > 50,
            "seed {seed}: {v}"
        );
        assert!(n("claims_refused") > 0, "seed {seed}: {v}");
        assert_eq!(v["geos"], serde_json::json!(["paris", "montreal"]), "{v}");
    }
}

/// Two geos 45 ms apart, latency shaped in-process: bots bridged into the other geo's regions
/// keep playing through their proxy; those who logged in far from home are handed over to the
/// nearer proxy, log in there on the hint (no record read), keep their avatar, and see their
/// inputs acknowledged sooner than before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_geos_bridge_then_hand_over_without_loss() {
    let _one = ONE_UP.lock().await;
    let bots = 24;
    let plot = tempfile::NamedTempFile::new().expect("a temporary file");
    let opts = UpOptions {
        bots,
        npcs: 40,
        nodes: 4,
        // Handovers wait for a player to settle, then for a crossing or the end of the longest
        // bridge (20 s): 35 s left some runs with none, 50 s leaves room for several.
        duration: Some(Duration::from_secs(50)),
        seed: 7,
        status: false,
        geos: vec!["paris".into(), "montreal".into()],
        geo_delay_ms: vec![45],
        svg: Some(plot.path().to_path_buf()),
        ..UpOptions::default()
    };
    let s = run(opts, std::future::pending()).await.expect("up runs");
    eprintln!("{s:?}");
    assert_eq!(s.geos, ["paris", "montreal"]);
    assert_eq!(s.errors, 0, "{s:?}");
    assert!(s.bridged_sessions > 0, "{s:?}");
    assert!(s.handovers > 0, "{s:?}");
    assert_eq!(
        s.hint_hits + s.cookie_hits,
        s.handovers,
        "every handed-over login skipped the record read: {s:?}"
    );
    assert_eq!(
        s.mongo_reads_at_login, bots as u64,
        "only the first logins read the player record: {s:?}"
    );
    assert!(s.probes_served > 0, "{s:?}");
    assert_eq!((s.entities_lost, s.entities_duplicated), (0, 0), "{s:?}");
    assert_eq!(s.accounts_with_two_avatars, 0, "{s:?}");
    assert_eq!(s.sessions_without_avatar, 0, "{s:?}");
    assert_eq!(s.inputs_unaccounted, 0, "{s:?}");
    assert_eq!(
        (s.trades_overlapping, s.claims_overlapping),
        (0, 0),
        "{s:?}"
    );
    assert!(s.handed_over_bots > 0, "{s:?}");
    assert!(s.handover_avatar_kept > 0, "{s:?}");
    assert_eq!(
        s.handover_avatar_replaced, 0,
        "a handover keeps the avatar and its inventory: {s:?}"
    );
    assert!(
        s.handed_over_input_to_update_ms_after < s.handed_over_input_to_update_ms_before,
        "a handover is worth its reconnect: {s:?}"
    );
    assert_eq!(s.input_to_update_ms.len(), 2, "{s:?}");
    // The plot names both locations' lines, and labels the handovers with their route.
    let svg = std::fs::read_to_string(plot.path()).expect("the plot was written");
    assert!(svg.starts_with("<svg"), "an SVG document");
    for text in [
        "from paris: median of each second",
        "from montreal: median of each second",
        "sessions bridged to another geo",
        "geos paris, montreal · 45 ms one way",
    ] {
        assert!(svg.contains(text), "no `{text}` in the plot");
    }
    let labelled = svg.matches("paris→montreal").count() + svg.matches("montreal→paris").count();
    assert!(
        labelled > 0 && labelled as u64 <= s.handovers,
        "{labelled} handover labels for {} handovers",
        s.handovers
    );
}

/// Three geos, Hong Kong's own bots gathered in a region of Paris (110 ms away): the geo-aware
/// director moves their bubble's region to Hong Kong once the gain held, every entity of it
/// crosses by the handoff, nothing is lost or doubled, and the bots' click to screen after the
/// move is less than half what it was before (the bridge is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_geos_move_the_gathering_bubble_to_its_players() {
    let _one = ONE_UP.lock().await;
    let opts = UpOptions {
        bots: 30,
        npcs: 40,
        nodes: 4,
        // The move comes once the far proxies measured the bots (a probe every 10 s) and the
        // gain held 20 s: about 25 s in.
        duration: Some(Duration::from_secs(55)),
        seed: 3,
        status: false,
        geos: vec!["paris".into(), "montreal".into(), "hongkong".into()],
        bubbles: true,
        ..UpOptions::default()
    };
    let s = run(opts, std::future::pending()).await.expect("up runs");
    eprintln!("{s:?}");
    assert!(s.problems().is_empty(), "{:?}", s.problems());
    assert!(s.bubble_moves >= 1 && s.regions_moved >= 1, "{s:?}");
    assert!(
        s.bubble_moved_at_s > 0.0,
        "the gathering bots' bubble moved: {s:?}"
    );
    assert!(
        s.click_to_screen_samples_before > 100 && s.click_to_screen_samples_after > 100,
        "{s:?}"
    );
    assert!(
        s.click_to_screen_ms_p50_after * 2.0 <= s.click_to_screen_ms_p50_before,
        "{s:?}"
    );
    // The move's handoffs were timed.
    assert!(s.bubble_switch_freeze_ms_p99 > 0.0, "{s:?}");
    assert_eq!((s.entities_lost, s.entities_duplicated), (0, 0), "{s:?}");
    assert_eq!(s.accounts_with_two_avatars, 0, "{s:?}");
    assert_eq!(s.claims_overlapping, 0, "{s:?}");
}

/// Two geos, and every node of the second (Hong Kong) killed 10 s in and kept dead 40 s: the
/// core (Paris) restores its entities from the copies of its checkpoints within the bound, Hong
/// Kong's proxy attaches its sessions to Paris's gateways with the players connected, and moves
/// them home once its own gateways have been back a while; nothing is lost, doubled or left
/// without an avatar, before or after the geo returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_outage_falls_back_to_the_core_and_loses_nothing() {
    let _one = ONE_UP.lock().await;
    let opts = UpOptions {
        bots: 30,
        npcs: 40,
        nodes: 4,
        // Dark from 10 s to 50 s; its sessions move home 10 s after; then 10 s to settle.
        duration: Some(Duration::from_secs(70)),
        seed: 4,
        status: false,
        geos: vec!["paris".into(), "hongkong".into()],
        edge_outage: Some(Duration::from_secs(10)),
        ..UpOptions::default()
    };
    let s = run(opts, std::future::pending()).await.expect("up runs");
    eprintln!("{s:?}");
    assert!(s.problems().is_empty(), "{:?}", s.problems());
    assert_eq!((s.edge_outages, s.nodes_killed), (1, 2), "{s:?}");
    assert!(s.entities_fallen_back > 0, "{s:?}");
    assert!(s.fallback_s_p99 > 0.0 && s.fallback_s_p99 <= 30.0, "{s:?}");
    assert!(s.sessions_fallen_back > 0, "{s:?}");
    // Home again once their geo's gateways held (some may have been handed over meanwhile).
    assert!(
        s.sessions_returned_home > 0 && s.sessions_returned_home <= s.sessions_fallen_back,
        "{s:?}"
    );
    assert_eq!(s.sessions_dropped, 0, "{s:?}");
    assert_eq!((s.entities_lost, s.entities_duplicated), (0, 0), "{s:?}");
    assert_eq!(
        (s.accounts_with_two_avatars, s.sessions_without_avatar),
        (0, 0),
        "{s:?}"
    );
    assert_eq!(s.claims_overlapping, 0, "{s:?}");
}

/// A crowd gathering in one cell of a BSP, side by side with and without the director: the
/// balanced run ends with the busiest node far closer to the average than the unbalanced one,
/// and both keep the census clean through the director's mass handoffs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_the_director_spreads_a_gathering_crowd_over_the_nodes() {
    let _one = ONE_UP.lock().await;
    let run_with = |balance: bool| UpOptions {
        bots: 80,
        npcs: 40,
        nodes: 4,
        // The crowd takes some 25 s to gather (longer on a loaded machine), and the lines
        // follow it: a shorter run ends before they could.
        duration: Some(Duration::from_secs(45)),
        seed: 5,
        status: false,
        bsp: true,
        balance,
        ..UpOptions::default()
    };
    let off = run(run_with(false), std::future::pending())
        .await
        .expect("up runs");
    let on = run(run_with(true), std::future::pending())
        .await
        .expect("up runs");
    let spread = |s: &cellmesh::up::Summary| s.load_max_over_avg.clone();
    eprintln!("off: {:?}\non: {:?}", spread(&off), spread(&on));
    for s in [&off, &on] {
        assert_eq!(s.partition, "bsp");
        assert_eq!(
            (
                s.errors,
                s.vanished_on_handoff,
                s.entities_lost,
                s.entities_duplicated,
                s.in_doubt_now
            ),
            (0, 0, 0, 0, 0),
            "(errors, vanished on handoff, lost, duplicated, in doubt): {s:?}"
        );
        assert!(s.census_at_rest, "{s:?}");
        assert!(s.load_max_over_avg.samples > 20, "{s:?}");
    }
    assert_eq!((off.partition_epochs, off.balance_moves), (0, 0));
    assert!(
        off.load_max_over_avg.end > 2.0,
        "the crowd gathered: {off:?}"
    );
    assert!(on.partition_epochs > 0 && on.balance_moves > 0, "{on:?}");
    assert!(on.chunks_moved > 0, "{on:?}");
    assert!(
        on.load_max_over_avg.end < 0.8 * off.load_max_over_avg.end,
        "balanced {:?} against {:?}",
        on.load_max_over_avg,
        off.load_max_over_avg
    );
    // The median over so short a run mostly reads the crowd still walking in: it is the
    // figure for runs of a minute and more, not for this one.
}
