//! `cellmesh up` end to end: the whole one-node cluster over real loopback sockets.

use std::time::Duration;

use cellmesh::up::{run, UpOptions};

mod support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_delivers_inputs_and_updates_without_errors() {
    let opts = UpOptions {
        bots: 12,
        npcs: 30,
        nodes: 1,
        duration: Some(Duration::from_secs(5)),
        summary_json: None,
        seed: 3,
        status: false,
    };
    let s = run(opts, std::future::pending()).await.expect("up runs");
    assert_eq!(s.errors, 0, "{s:?}");
    assert_eq!(s.sessions_peak, 12, "{s:?}");
    assert!(s.inputs_sent > 12 * 20, "bots sent too few inputs: {s:?}");
    assert!(
        s.inputs_delivered as f64 >= 0.95 * s.inputs_sent as f64,
        "inputs lost between bots and game: {s:?}"
    );
    assert!(
        s.inputs_delivered <= s.inputs_sent,
        "inputs duplicated: {s:?}"
    );
    assert!(s.inputs_applied > 0, "{s:?}");
    assert!(s.updates_delivered > 1000, "{s:?}");
    assert!(
        s.rtt_samples > 0 && s.rtt_ms_p50 > 0.0 && s.rtt_ms_p99 >= s.rtt_ms_p50,
        "{s:?}"
    );
    // Every input is delivered or dropped under a reason; the census reads a world at rest.
    assert!(s.census_at_rest, "{s:?}");
    assert_eq!(s.inputs_unaccounted, 0, "{s:?}");
    assert!(s.problems().is_empty(), "{:?}: {s:?}", s.problems());
}

/// The binary itself, as a user runs it: exits 0 and writes the summary.
#[test]
fn up_binary_writes_summary_json() {
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
