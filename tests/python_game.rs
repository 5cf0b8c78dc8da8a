//! The local protocol is engine-independent: the Python sample game (examples/python-game), built on
//! protobuf code generated from the same local.proto, joins a real sidecar, and a client logged in
//! through a real proxy sees its NPCs and walks its own avatar.
//!
//! Needs `CELLMESH_TEST_PYTHON`: a Python with `protobuf` and `grpcio-tools`, which
//! `./scripts/test.sh` creates and exports.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cellmesh_geo_router::store::Stores;
use cellmesh_proto::client::{self, ClientReceiver, ClientSender};
use cellmesh_proto::edge::{client_message, server_message, Batch, DeltaKind, Pong};
use cellmesh_proxy::ProxyConfig;
use cellmesh_sidecar::SidecarConfig;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};
use tokio::time::{timeout_at, Instant};
use tokio_util::sync::CancellationToken;

const KIND: u32 = 1;
const HEALTH: u32 = 2;
const INVENTORY: u32 = 3;
const INPUT_ACK: u32 = 4;
const NPCS: usize = 5;
const CENTER: (f64, f64) = (640.0, 320.0);
const DEADLINE: Duration = Duration::from_secs(30);

fn python() -> String {
    std::env::var("CELLMESH_TEST_PYTHON").unwrap_or_else(|_| {
        panic!(
            "CELLMESH_TEST_PYTHON is not set: run ./scripts/test.sh, which creates a Python venv with \
             protobuf and grpcio-tools and exports its interpreter as CELLMESH_TEST_PYTHON"
        )
    })
}

fn game_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/python-game")
}

/// Everything a process wrote to stderr so far, collected while it runs (a full pipe would stall it).
#[derive(Clone, Default)]
struct Log(Arc<Mutex<String>>);

impl Log {
    fn collect(child: &mut Child) -> Self {
        let log = Log::default();
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let sink = log.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stderr.read(&mut buf).await {
                sink.0
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        log
    }

    fn text(&self) -> String {
        self.0.lock().unwrap().clone()
    }
}

fn spawn_game(sidecar: &str) -> Child {
    Command::new(python())
        .arg(game_dir().join("game.py"))
        .args(["--sidecar", sidecar, "--npcs", &NPCS.to_string()])
        .args(["--center", &format!("{},{}", CENTER.0, CENTER.1)])
        .env("PYTHONUNBUFFERED", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting the Python game")
}

fn utf8(payload: &[u8]) -> &str {
    std::str::from_utf8(payload).unwrap_or("<not UTF-8>")
}

/// What the client knows of one entity in its view.
#[derive(Debug, Default)]
struct Seen {
    owner: String,
    x: f64,
    components: HashMap<u32, Vec<u8>>,
}

/// The client's picture of the world, folded from its batches.
#[derive(Default)]
struct View {
    account: String,
    entities: HashMap<u64, Seen>,
    /// NPCs whose APPEAR carried their Kind and an 8-byte Health.
    npcs_appeared: HashSet<u64>,
    /// The avatar, once an APPEAR showed it with its owner-only components.
    avatar: Option<u64>,
}

impl View {
    fn apply(&mut self, batch: Batch) {
        for d in batch.deltas {
            let kind = DeltaKind::try_from(d.kind).expect("a known delta kind");
            if kind == DeltaKind::Vanish {
                self.entities.remove(&d.entity_id);
                continue;
            }
            let seen = self.entities.entry(d.entity_id).or_default();
            if kind == DeltaKind::Appear {
                assert!(
                    d.position.is_some(),
                    "APPEAR of {} without a position",
                    d.entity_id
                );
                *seen = Seen {
                    owner: d.owner_account.clone(),
                    ..Seen::default()
                };
            }
            if let Some(p) = &d.position {
                seen.x = p.x;
                let (dx, dy) = (p.x - CENTER.0, p.y - CENTER.1);
                assert!(
                    dx.hypot(dy) < 200.0,
                    "entity {} far from the game's center: {p:?}",
                    d.entity_id
                );
            }
            for c in &d.components {
                seen.components.insert(c.r#type, c.payload.to_vec());
            }
            for t in &d.removed_types {
                seen.components.remove(t);
            }
            if kind != DeltaKind::Appear {
                continue;
            }
            let kind_text = seen
                .components
                .get(&KIND)
                .map(|k| utf8(k).to_string())
                .unwrap_or_default();
            if kind_text.starts_with("npc:")
                && seen.components.get(&HEALTH).is_some_and(|h| h.len() == 8)
            {
                self.npcs_appeared.insert(d.entity_id);
            }
            if seen.owner == self.account {
                assert_eq!(kind_text, format!("player:{}", self.account));
                assert!(
                    seen.components.contains_key(&HEALTH),
                    "the owner sees its avatar's Health"
                );
                assert_eq!(
                    utf8(&seen.components[&INVENTORY]),
                    "wooden-sword,bread",
                    "owner-only Inventory"
                );
                self.avatar = Some(d.entity_id);
            } else {
                for t in [INVENTORY, INPUT_ACK] {
                    assert!(
                        !seen.components.contains_key(&t),
                        "{kind_text} shows component {t} to a stranger"
                    );
                }
            }
        }
    }

    fn avatar(&self) -> Option<&Seen> {
        self.avatar.and_then(|id| self.entities.get(&id))
    }

    /// (last applied input seq, inputs applied) of the avatar's InputAck.
    fn input_ack(&self) -> Option<(u64, u64)> {
        let ack = self.avatar()?.components.get(&INPUT_ACK)?;
        let ack: [u8; 16] = ack.as_slice().try_into().expect("InputAck is 16 bytes");
        Some((
            u64::from_be_bytes(ack[..8].try_into().unwrap()),
            u64::from_be_bytes(ack[8..].try_into().unwrap()),
        ))
    }
}

/// Receives until `done(view)` holds, answering the proxy's pings; panics at `deadline`.
async fn play_until(
    tx: &mut ClientSender,
    rx: &mut ClientReceiver,
    view: &mut View,
    deadline: Instant,
    game_log: &Log,
    what: &str,
    done: impl Fn(&View) -> bool,
) {
    while !done(view) {
        let msg = match timeout_at(deadline, rx.next()).await {
            Ok(Some(Ok(msg))) => msg,
            Ok(other) => panic!("connection to the proxy ended while waiting for {what}: {other:?}"),
            Err(_) => panic!(
                "timed out waiting for {what}; NPCs seen {}, avatar {:?}, input ack {:?}; game log:\n{}",
                view.npcs_appeared.len(),
                view.avatar,
                view.input_ack(),
                game_log.text()
            ),
        };
        match msg.body {
            Some(server_message::Body::Batch(batch)) => view.apply(batch),
            Some(server_message::Body::Ping(p)) => {
                tx.send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                    .await
                    .expect("pong");
            }
            Some(server_message::Body::Kick(k)) => panic!("kicked while waiting for {what}: {k:?}"),
            _ => {}
        }
    }
}

/// Waits for `child` to exit on its own, returning its status and what it wrote to stderr.
async fn wait_exit(child: Child, deadline: Instant) -> (std::process::ExitStatus, String) {
    let out = timeout_at(deadline, child.wait_with_output())
        .await
        .expect("the process did not exit in time")
        .expect("waiting for the process");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_game_npcs_reach_a_client_through_the_proxy() {
    let deadline = Instant::now() + DEADLINE;
    let stop = CancellationToken::new();
    let _stop_on_exit = stop.clone().drop_guard();

    let sidecar_cfg = SidecarConfig {
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        ..SidecarConfig::default()
    };
    let sidecar = cellmesh_sidecar::start(sidecar_cfg, Stores::in_memory(), stop.child_token())
        .await
        .expect("starting the sidecar");
    let proxy_cfg = ProxyConfig {
        client_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        gateways: vec![sidecar.mesh_addr.to_string()],
        token_secret: "python-game-test-secret".into(),
        ..ProxyConfig::default()
    };
    let secret = proxy_cfg.token_secret.clone();
    let proxy = cellmesh_proxy::start(proxy_cfg, stop.child_token())
        .await
        .expect("starting the proxy");

    let mut game = spawn_game(&sidecar.local_addr);
    let game_log = Log::collect(&mut game);
    while sidecar.stats().entities < NPCS as u64 {
        if let Ok(Some(status)) = game.try_wait() {
            panic!(
                "the Python game exited with {status} before spawning its NPCs:\n{}",
                game_log.text()
            );
        }
        assert!(
            Instant::now() < deadline,
            "the Python game spawned no NPCs in time: {:?}\n{}",
            sidecar.stats(),
            game_log.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let expiry = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let token = cellmesh_proto::token::sign(secret.as_bytes(), "alice", expiry);
    let (mut tx, mut rx, welcome) = timeout_at(
        deadline,
        client::login(&proxy.client_addr.to_string(), &token),
    )
    .await
    .expect("login timed out")
    .expect("login through the proxy");
    assert_eq!(welcome.account, "alice");

    let mut view = View {
        account: "alice".into(),
        ..View::default()
    };
    play_until(
        &mut tx,
        &mut rx,
        &mut view,
        deadline,
        &game_log,
        "the NPCs and the avatar",
        |v| v.npcs_appeared.len() == NPCS && v.input_ack().is_some(),
    )
    .await;
    assert_eq!(view.input_ack(), Some((0, 0)));

    // Walk east: three inputs, which the game acknowledges in the avatar's owner-only InputAck.
    let start_x = view.avatar().unwrap().x;
    for seq in 1..=3u64 {
        let mut payload = 1.0f32.to_be_bytes().to_vec();
        payload.extend(0.0f32.to_be_bytes());
        tx.input(seq, payload.into()).await.expect("sending input");
    }
    play_until(
        &mut tx,
        &mut rx,
        &mut view,
        deadline,
        &game_log,
        "the input acknowledgement",
        |v| v.input_ack() == Some((3, 3)),
    )
    .await;
    play_until(
        &mut tx,
        &mut rx,
        &mut view,
        deadline,
        &game_log,
        "the avatar walking east",
        |v| v.avatar().unwrap().x > start_x + 1.0,
    )
    .await;

    assert_eq!(
        sidecar.stats().errors,
        0,
        "the sidecar refused something the Python game sent:\n{}",
        game_log.text()
    );

    // A second game is refused by name and exits non-zero; the attached game keeps serving.
    let (status, stderr) = wait_exit(spawn_game(&sidecar.local_addr), deadline).await;
    assert!(
        !status.success(),
        "a second game was not refused:\n{stderr}"
    );
    assert!(
        stderr.contains("ALREADY_CONNECTED"),
        "the refusal does not name the error:\n{stderr}"
    );
    let x = view.avatar().unwrap().x;
    play_until(
        &mut tx,
        &mut rx,
        &mut view,
        deadline,
        &game_log,
        "the first game to keep serving",
        |v| v.avatar().unwrap().x > x + 1.0,
    )
    .await;
    assert!(
        game.try_wait().unwrap().is_none(),
        "the Python game exited:\n{}",
        game_log.text()
    );
    tx.close().await.expect("closing the client");
}

/// The Python sample's own tests: its game logic, and game.py against a scripted sidecar socket.
#[test]
fn python_game_unit_tests() {
    let out = std::process::Command::new(python())
        .args(["-m", "unittest", "test_game"])
        .current_dir(game_dir())
        .output()
        .expect("running the Python tests");
    assert!(
        out.status.success(),
        "Python tests failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
