//! The live map in a real browser: `cellmesh up` with four nodes serves `/map`, headless Chromium
//! loads it, and the DOM it rendered holds one drawn cell per partition cell of `/api/world`
//! and the entities the world map sampled.

use std::net::SocketAddr;
use std::process::Command as StdCommand;
use std::time::Duration;

use cellmesh_admin::{http_get, http_get_token};
use cellmesh_test_support::Process;
use tokio::process::Command;
use tokio::time::Instant;

use support::CELLMESH;

mod support;

/// Chromium from the distribution; `CELLMESH_TEST_CHROMIUM` names another.
fn chromium() -> String {
    let bin = std::env::var("CELLMESH_TEST_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let found = StdCommand::new(&bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "`{bin} --version` failed: this test needs headless Chromium. Install it with \
         `apt-get install chromium` (./scripts/test.sh does), or set CELLMESH_TEST_CHROMIUM"
    );
    bin
}

async fn world(admin: SocketAddr, token: &str) -> serde_json::Value {
    let (status, body) = http_get_token(admin, "/api/world", token)
        .await
        .expect("GET /api/world");
    assert_eq!(status, 200, "/api/world: {body}");
    serde_json::from_str(&body).expect("/api/world is JSON")
}

/// What headless Chromium rendered of `url` once the page had run for a while.
fn rendered_dom(chromium: &str, url: &str) -> String {
    let profile = tempfile::tempdir().expect("a profile directory");
    let out = StdCommand::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            // The page's fetches and timers run in virtual time: a few refreshes' worth.
            "--virtual-time-budget=5000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(url)
        .output()
        .expect("running chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Elements `<tag class="class"…>` (the class first, as the page writes it), optionally with a
/// given class prefix: `entity` counts `entity avatar`, `entity npc`, ….
fn count(dom: &str, tag: &str, class: &str) -> usize {
    dom.matches(&format!("<{tag} class=\"{class}")).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headless_chromium_draws_every_cell_and_the_entities_of_a_four_node_up() {
    let chromium = chromium();
    let (mut up, rest) = Process::spawn_reporting(
        "cellmesh up",
        Command::new(CELLMESH).args([
            "up",
            "--nodes",
            "4",
            "--bots",
            "20",
            "--npcs",
            "40",
            "--duration",
            "120",
            "--admin",
            "127.0.0.1:0",
        ]),
        "cellmesh up: live map http://",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let admin: SocketAddr = rest
        .strip_suffix("/map")
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no map address in {rest:?}"));
    // The banner names the file of the run's admin token, printed before the map's line.
    let banner = up.log.text();
    let token_file = banner
        .lines()
        .find_map(|l| l.strip_prefix("cellmesh up: admin token in "))
        .and_then(|rest| rest.split_once(": send"))
        .map(|(file, _)| file.to_string())
        .unwrap_or_else(|| panic!("no admin token file in {banner}"));
    let token = std::fs::read_to_string(&token_file).expect("the admin token file");
    assert!(!banner.contains(&token), "the banner shows the token");
    // Without it, the world is refused.
    assert_eq!(http_get(admin, "/api/world").await.unwrap().0, 401);

    // The bots log in over the first seconds; wait for every node to be sampled with entities.
    let since = Instant::now();
    let w = loop {
        let w = world(admin, &token).await;
        let sampled = w["nodes"]
            .as_array()
            .is_some_and(|n| n.len() == 4 && n.iter().all(|n| n["sampled"] == true));
        if sampled && w["entities_total"].as_u64() >= Some(40) {
            break w;
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "the world map never showed four sampled nodes with entities: {w:#}\n{}",
            up.tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let cells = w["cells"].as_array().expect("cells").len();
    assert!(cells >= 4, "{w:#}");
    let owners: std::collections::BTreeSet<u64> = w["cells"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["node"].as_u64().expect("a cell's node"))
        .collect();
    assert_eq!(owners.len(), 4, "every node owns cells: {owners:?}");

    let (status, page) = http_get(admin, "/map").await.expect("GET /map");
    assert_eq!(status, 200);
    assert!(page.contains("api/world"), "{page}");

    let dom = rendered_dom(&chromium, &format!("http://{admin}/map#token={token}"));
    let drawn_cells = count(&dom, "rect", "cell\"");
    let drawn_entities = count(&dom, "circle", "entity ");
    let epoch = w["partition_epoch"].as_u64().expect("the epoch");
    assert_eq!(
        drawn_cells,
        cells,
        "one drawn cell per partition cell; the page showed:\n{}",
        &dom[..dom.len().min(4000)]
    );
    assert!(drawn_entities > 0, "no entity drawn:\n{dom}");
    assert!(
        dom.contains(&format!("id=\"epoch\">{epoch}<")),
        "the header names epoch {epoch}"
    );
    assert!(
        dom.contains("id=\"error\"></span>"),
        "the page reported an error"
    );
    // Every node is listed beside the map.
    assert_eq!(dom.matches("<tr class=\"node\">").count(), 4);

    up.kill().await;
}
