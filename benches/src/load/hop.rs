//! `hop`: one entity update from a game through its sidecar, the peer sidecar that is the
//! client's gateway, and the proxy, to the client; beside the same number of minimal framed
//! forwarders in this process (the loopback's limit) and as processes (the limit of a layout of
//! one process per component). The mesh runs as deployed, with mutual TLS on both mesh links, and
//! once more in plaintext: `tls_over_plaintext` is what TLS costs.
//!
//! The mesh runs in this process, as the forwarders of the first baseline do: `*_vs_in_process`
//! is the like-for-like ratio. The forwarders as processes also pay a wake-up of another
//! process at every hop, which the mesh here does not, so `*_vs_processes` reads low; its fair
//! counterpart would be the mesh as processes too.
//!
//! The client may receive a little fewer updates than the game sent: two updates of the entity
//! that reach the gateway in one peer frame are folded into one (the client gets the latest
//! state), as they are for any client.

use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::cluster::{border_x, Cluster, ClusterSpec};
use super::game::{self, now_ns, GameConfig, GameStats};
use super::report::{ratio, Latency};
use super::{forwarder, Options};

/// Components between the game and the client: two sidecars and the proxy.
const HOPS: usize = 3;
/// Bytes of the updated component: a stamp and a little state.
const PAYLOAD: usize = 32;
/// Bytes of a baseline frame: about what the mesh frames carrying one such update weigh.
const FRAME: usize = 64;
/// How often the gateway's game ends a tick: the gateway sends its clients what it holds at
/// each tick's end, so this bounds the wait there.
const GATEWAY_TICK_HZ: u32 = 1000;

pub async fn run(opts: &Options) -> anyhow::Result<Value> {
    let rate: u32 = if opts.quick { 500 } else { 1000 };
    let warm_up = Duration::from_secs(1);
    let measure = opts.measure_for();

    let sink = TcpListener::bind("127.0.0.1:0").await?;
    let (head, tasks) = forwarder::chain_in_process(HOPS, sink.local_addr()?).await?;
    let in_process = forwarder::measure_chain(head, sink, rate, FRAME, warm_up, measure).await?;
    tasks.iter().for_each(|t| t.abort());

    let sink = TcpListener::bind("127.0.0.1:0").await?;
    let (head, children) =
        forwarder::chain_as_processes(&opts.exe, HOPS, sink.local_addr()?).await?;
    let processes = forwarder::measure_chain(head, sink, rate, FRAME, warm_up, measure).await?;
    drop(children);

    // As deployed (mutual TLS on both mesh links), and the same cluster in plaintext: the cost
    // of TLS as a ratio of two runs of this one.
    let (plain, _, _) = through_the_mesh(rate, warm_up, measure, false).await?;
    let (mesh, sent, received) = through_the_mesh(rate, warm_up, measure, true).await?;

    let (mesh, plain, in_process, processes) = (
        Latency::from_nanos(&mesh),
        Latency::from_nanos(&plain),
        Latency::from_nanos(&in_process),
        Latency::from_nanos(&processes),
    );
    Ok(json!({
        "offered_per_s": rate,
        "hops": HOPS,
        "gateway_tick_hz": GATEWAY_TICK_HZ,
        "updates_sent": sent,
        "updates_received": received,
        "cellmesh": mesh,
        "cellmesh_plaintext": plain,
        "baseline": { "forwarders_in_process": in_process, "forwarders_as_processes": processes },
        "ratio": {
            "p50_vs_processes": ratio(mesh.p50_us, processes.p50_us),
            "p99_vs_processes": ratio(mesh.p99_us, processes.p99_us),
            "p999_vs_processes": ratio(mesh.p999_us, processes.p999_us),
            "p50_vs_in_process": ratio(mesh.p50_us, in_process.p50_us),
            "p99_vs_in_process": ratio(mesh.p99_us, in_process.p99_us),
            "p999_vs_in_process": ratio(mesh.p999_us, in_process.p999_us),
            "p50_tls_over_plaintext": ratio(mesh.p50_us, plain.p50_us),
            "p99_tls_over_plaintext": ratio(mesh.p99_us, plain.p99_us),
            "p999_tls_over_plaintext": ratio(mesh.p999_us, plain.p999_us),
        },
    }))
}

/// Node 1's game updates one NPC `rate` times a second, 40 m west of the border; the client's
/// avatar stands 40 m east of it on node 2, its gateway. The latency histogram, the updates the
/// game sent while measuring and those the client received.
async fn through_the_mesh(
    rate: u32,
    warm_up: Duration,
    measure: Duration,
    tls: bool,
) -> anyhow::Result<(hdrhistogram::Histogram<u64>, u64, u64)> {
    let cluster = Cluster::start(ClusterSpec {
        nodes: 2,
        gateways: vec![2],
        clients: 1,
        tls,
    })
    .await?;
    let x = border_x(&cluster.world, 2, 1);
    let y = 1000.0;
    let stop = CancellationToken::new();
    // The source stops first, so that what the client counts is what was sent in the window.
    let stop_source = stop.child_token();
    let source = Arc::new(GameStats::default());
    let games = [
        (
            GameConfig {
                sidecar: cluster.local_addr(1),
                tick_hz: rate,
                npcs: vec![(x - 40.0, y)],
                payload_bytes: PAYLOAD,
                ..GameConfig::default()
            },
            source.clone(),
        ),
        (
            GameConfig {
                sidecar: cluster.local_addr(2),
                tick_hz: GATEWAY_TICK_HZ,
                avatar_at: (x + 40.0, y),
                payload_bytes: PAYLOAD,
                ..GameConfig::default()
            },
            Arc::new(GameStats::default()),
        ),
    ];
    let games: Vec<_> = games
        .into_iter()
        .zip([stop_source.clone(), stop.clone()])
        .map(|((cfg, stats), stop)| tokio::spawn(game::run(cfg, stats, stop)))
        .collect();
    cluster
        .wait_until("both games connected", |c| {
            c.sidecars.iter().all(|s| s.stats().game_connected)
        })
        .await?;

    let from = now_ns() + warm_up.as_nanos() as u64;
    let client = tokio::spawn(game::watch(
        cluster.proxy_addr(),
        cluster.token("hop-0"),
        from,
        stop.clone(),
    ));
    tokio::time::sleep(warm_up).await;
    let before = source.updates.load(Relaxed);
    tokio::time::sleep(measure).await;
    stop_source.cancel();
    let sent = source.updates.load(Relaxed) - before;
    // What was sent in the window gets a moment to arrive.
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.cancel();
    let seen = client.await.context("the client task")??;
    for g in games {
        g.await.context("a game task")??;
    }
    anyhow::ensure!(
        seen.updates > 0,
        "the client saw no update of the NPC (it saw {} entities appear)",
        seen.appeared
    );
    Ok((seen.latency, sent, seen.updates))
}
