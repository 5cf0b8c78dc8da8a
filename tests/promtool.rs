//! Prometheus tooling accepts every `/metrics` page: `promtool check metrics` (from Debian's
//! `prometheus` package) reads the classic text pages of a `cellmesh sidecar`, `cellmesh proxy`
//! and `cellmesh director`, each after some work (a game connected, a player logged in and
//! answering pings, balance rounds over a committed partition), and reports no lint problem.
//! Asked for OpenMetrics, each page is still OpenMetrics.

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use cellmesh_admin::{http_get_with, HttpResponse};
use cellmesh_arena::ArenaConfig;
use cellmesh_proto::edge::{client_message, server_message, Pong};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_test_support::{
    commit_plan, director_command, proxy_command, required, run_id, sidecar_command, unix_now,
    wait_ready, DirectorProcess, ProxyProcess, SidecarProcess, PATIENCE,
};
use support::CELLMESH;

mod support;

const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `promtool`'s path; fails the test, saying how to get it, when it is not installed.
fn promtool() -> String {
    let promtool = std::env::var("CELLMESH_PROMTOOL").unwrap_or_else(|_| "promtool".into());
    match Command::new(&promtool).arg("--version").output() {
        Ok(out) if out.status.success() => promtool,
        other => panic!(
            "`{promtool} --version` failed ({other:?}): install promtool, which Debian's \
             `prometheus` package provides (`apt-get install --no-install-recommends prometheus`; \
             ./scripts/test.sh installs it), or name it in CELLMESH_PROMTOOL"
        ),
    }
}

/// What `promtool check metrics` says of `page`; fails the test if it finds any problem.
fn check_metrics(promtool: &str, what: &str, page: &str) -> String {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(page.as_bytes())
        .expect("promtool reads the page");
    let out = child.wait_with_output().expect("promtool ends");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics on the {what}'s page ({}):\n{said}\n--- page ---\n{page}",
        out.status
    );
    said
}

async fn scrape(admin: SocketAddr, accept: &str) -> HttpResponse {
    let r = http_get_with(admin, "/metrics", &[("Accept", accept)])
        .await
        .expect("the admin server answers");
    assert_eq!(r.status, 200, "{}", r.body);
    r
}

/// The classic page of `admin`, checked by promtool, and its OpenMetrics page checked for what
/// marks it as such. Returns the classic page.
async fn check(promtool: &str, what: &str, admin: SocketAddr, expected: &[&str]) -> String {
    let classic = scrape(admin, "text/plain").await;
    assert_eq!(classic.header("content-type"), Some(CLASSIC), "{what}");
    assert!(
        !classic.body.contains("# EOF") && !classic.body.contains("# UNIT"),
        "{what}:\n{}",
        classic.body
    );
    for needle in expected {
        assert!(
            classic.body.contains(needle),
            "{what}'s page lacks {needle:?}:\n{}",
            classic.body
        );
    }
    check_metrics(promtool, what, &classic.body);

    // What Prometheus asks for by default.
    let openmetrics = scrape(
        admin,
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;\
         q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    )
    .await;
    assert_eq!(
        openmetrics.header("content-type"),
        Some(OPENMETRICS),
        "{what}"
    );
    assert!(
        openmetrics.body.ends_with("# EOF\n"),
        "{what}:\n{}",
        openmetrics.body
    );
    classic.body
}

/// Waits until the sample that `admin`'s classic page starts with `sample` is at least `least`.
async fn until_at_least(admin: SocketAddr, sample: &str, least: f64) {
    let since = tokio::time::Instant::now();
    loop {
        let page = scrape(admin, "text/plain").await.body;
        let value = page
            .lines()
            .filter_map(|l| l.strip_prefix(sample))
            .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, f64::max);
        if value >= least {
            return;
        }
        assert!(
            since.elapsed() < PATIENCE,
            "{sample}… not {least} within {PATIENCE:?}:\n{page}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_every_metrics_page() {
    let promtool = promtool();
    let mongo = required("CELLMESH_TEST_MONGO_URL");
    let topology = format!("{}/cm_promtool_{}", mongo.trim_end_matches('/'), run_id());

    // A director balancing a committed 2×2 partition (its rounds decide on each line).
    commit_plan(CELLMESH, &topology, "2x2", "1,2,3,4");
    let mut director = DirectorProcess::start(
        "director",
        director_command(CELLMESH)
            .env("CELLMESH_TOPOLOGY_URL", &topology)
            .env("CELLMESH_NAME", "promtool")
            .env("CELLMESH_BALANCE__BALANCE_PERIOD_MS", "100"),
    )
    .await;

    // A sidecar with the arena game, and a proxy in front of it.
    let mut sidecar = SidecarProcess::start(
        "sidecar",
        sidecar_command(CELLMESH).env("CELLMESH_NODE_ID", "7"),
    )
    .await;
    let mut proxy = ProxyProcess::start(
        "proxy",
        proxy_command(CELLMESH)
            .env("CELLMESH_GATEWAYS", sidecar.mesh.to_string())
            .env("CELLMESH_TOKEN_SECRET", "promtool")
            .env("CELLMESH_PING_INTERVAL_MS", "50"),
    )
    .await;
    let arena = tokio::spawn(cellmesh_arena::run(
        ArenaConfig {
            sidecar: SidecarAddr::Tcp(sidecar.local.to_string()),
            npcs: 3,
            ..ArenaConfig::default()
        },
        tokio::time::sleep(Duration::from_secs(60)),
    ));
    wait_ready(sidecar.admin, &mut sidecar.process).await;
    wait_ready(proxy.admin, &mut proxy.process).await;
    wait_ready(director.admin, &mut director.process).await;

    // A player logs in, moves, and answers pings until the proxy has measured a few round trips.
    let token = cellmesh_proto::token::sign(b"promtool", "ada", unix_now() + 60);
    let (mut tx, mut rx, _) = cellmesh_proto::client::login(&proxy.clients.to_string(), &token)
        .await
        .expect("login");
    let player = tokio::spawn(async move {
        let mut seq = 0;
        while let Some(Ok(msg)) = rx.next().await {
            let sent = match msg.body {
                Some(server_message::Body::Ping(p)) => {
                    seq += 1;
                    tx.input(seq, bytes::Bytes::from_static(b"{\"move\":[1,0]}"))
                        .await
                        .and(
                            tx.send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                                .await,
                        )
                }
                _ => Ok(()),
            };
            if sent.is_err() {
                break;
            }
        }
    });
    until_at_least(proxy.admin, "cellmesh_proxy_rtt_seconds_count ", 3.0).await;
    until_at_least(
        sidecar.admin,
        "cellmesh_sidecar_inputs_delivered_total ",
        1.0,
    )
    .await;
    until_at_least(
        director.admin,
        "cellmesh_director_line_decisions_total{",
        1.0,
    )
    .await;

    let mut said = Vec::new();
    for (what, admin, expected) in [
        (
            "sidecar",
            sidecar.admin,
            &[
                "# TYPE cellmesh_sidecar_frames_total counter",
                "cellmesh_sidecar_connections{peer=\"game\"} 1",
                "cellmesh_sidecar_sessions 1",
                "# TYPE cellmesh_sidecar_handoff_freeze_seconds histogram",
                "# TYPE cellmesh_sidecar_handoff_freeze_sidecars_seconds histogram",
            ][..],
        ),
        (
            "proxy",
            proxy.admin,
            &[
                "# TYPE cellmesh_proxy_connections_accepted_total counter",
                "cellmesh_proxy_sessions 1",
                "cellmesh_proxy_link_up{gateway=",
                "# TYPE cellmesh_proxy_rtt_seconds histogram",
                "cellmesh_proxy_rtt_seconds_bucket{le=\"+Inf\"}",
            ][..],
        ),
        (
            "director",
            director.admin,
            &[
                "cellmesh_director_active 1",
                "# TYPE cellmesh_director_rounds_total counter",
            ][..],
        ),
    ] {
        let page = check(&promtool, what, admin, expected).await;
        said.push(format!("{what}: {} families", families(&page).len()));
    }
    println!(
        "promtool check metrics found no problem: {}",
        said.join(", ")
    );

    player.abort();
    arena.abort();
    drop(proxy);
    sidecar.process.terminate().await;
    director.process.terminate().await;
}

/// The families a classic page declares, by name.
fn families(page: &str) -> Vec<&str> {
    page.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect()
}
