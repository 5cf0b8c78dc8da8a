//! `cellmesh up --nodes 4`: four sidecars with four arenas share the world on a 2×2 grid, with
//! bots walking across the borders and the wrap seam, over real loopback sockets.

use std::time::Duration;

use cellmesh::up::{run, UpOptions};

mod support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_nodes_serve_one_world_without_errors() {
    let opts = UpOptions {
        bots: 12,
        npcs: 40,
        nodes: 4,
        duration: Some(Duration::from_secs(6)),
        summary_json: None,
        seed: 5,
        status: false,
        chaos: None,
        chaos_in_place: false,
        ..UpOptions::default()
    };
    let s = run(opts, std::future::pending()).await.expect("up runs");
    assert_eq!(s.nodes, 4);
    assert_eq!(s.errors, 0, "{s:?}");
    assert_eq!(s.sessions_peak, 12, "{s:?}");
    assert!(
        s.inputs_delivered as f64 >= 0.95 * s.inputs_sent as f64,
        "inputs lost between bots and games: {s:?}"
    );
    assert!(
        s.inputs_delivered <= s.inputs_sent,
        "inputs duplicated: {s:?}"
    );
    assert!(s.cross_node_updates > 100, "no cross-node updates: {s:?}");
    assert!(s.ghosts_render > 0 && s.subscriptions > 0, "{s:?}");
    assert!(s.updates_delivered > 1000, "{s:?}");
    assert_eq!(s.inputs_unaccounted, 0, "inputs unaccounted for: {s:?}");
    assert!(s.problems().is_empty(), "{:?}: {s:?}", s.problems());
}

/// The binary with its default of four nodes writes the multi-node summary keys.
#[test]
fn up_nodes_binary_writes_the_mesh_summary_keys() {
    let (v, _) = support::run_up_binary(
        &["--bots", "6", "--npcs", "20", "--duration", "4"],
        &[
            "nodes",
            "ghosts_render",
            "ghosts_sim",
            "subscriptions",
            "routed_messages",
            "cross_node_updates",
            "dropped_unknown_account",
        ],
    );
    assert_eq!(v["nodes"], 4, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
}
