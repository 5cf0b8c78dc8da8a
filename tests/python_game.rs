//! The local protocol is engine-independent: the Python sample game (examples/python-game), built on
//! protobuf code generated from the same local.proto, joins a real sidecar, and a client logged in
//! through a real proxy sees its NPCs and walks its own avatar. Its snapshots are the Rust arena's
//! too: the two games hand a player's avatar to each other across a border, and its entity commands
//! are the arena's combat: the two games fight each other's NPCs across that border.
//!
//! Needs `CELLMESH_TEST_PYTHON`: a Python with `protobuf` and `grpcio-tools`, which
//! `./scripts/test.sh` creates and exports.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use cellmesh_arena::{combat, schema, ArenaConfig, Census};
use cellmesh_proto::client::{self, ClientReceiver, ClientSender};
use cellmesh_proto::edge::{client_message, server_message, Batch, DeltaKind, Pong};
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_proxy::ProxyConfig;
use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use cellmesh_stores::topology::memory::MemoryTopology;
use cellmesh_stores::topology::TopologyStore;
use cellmesh_stores::Stores;
use cellmesh_test_support::{required, unix_now, Log};
use cellmesh_world::geometry::WorldShape;
use cellmesh_world::partition::{Grid, Layout, Partition};
use tokio::process::{Child, Command};
use tokio::time::{timeout_at, Instant};
use tokio_util::sync::CancellationToken;

const KIND: u32 = 1;
const HEALTH: u32 = 2;
const INVENTORY: u32 = 3;
const INPUT_ACK: u32 = 4;
const NPCS: usize = 5;
const CENTER: (f64, f64) = (640.0, 320.0);
/// A bound on a hang, not a speed claim: the handoff test's whole walk takes about 20 s on an
/// idle machine, and overran 30 s once beside the rest of the suite on two cores.
const DEADLINE: Duration = Duration::from_secs(90);

fn python() -> String {
    required("CELLMESH_TEST_PYTHON")
}

fn game_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/python-game")
}

/// Collects `child`'s stderr as it runs.
fn stderr_log(child: &mut Child) -> Log {
    let log = Log::default();
    log.collect(child.stderr.take().expect("stderr is piped"));
    log
}

/// Logs `alice` in through `proxy` with a token signed by `secret`.
async fn login_alice(
    proxy: &cellmesh_proxy::ProxyHandle,
    secret: &str,
    deadline: Instant,
) -> (ClientSender, ClientReceiver, cellmesh_proto::edge::Welcome) {
    let token = cellmesh_proto::token::sign(secret.as_bytes(), "alice", unix_now() + 3600);
    timeout_at(
        deadline,
        client::login(&proxy.client_addr.to_string(), &token),
    )
    .await
    .expect("login timed out")
    .expect("login through the proxy")
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

    /// Whether an NPC in view shows less than its full Health.
    fn npc_hurt(&self) -> bool {
        self.npcs_appeared
            .iter()
            .filter_map(|id| self.entities.get(id)?.components.get(&HEALTH))
            .any(|h| schema::parse_health(h).is_some_and(|(current, max)| current < max))
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
    let game_log = stderr_log(&mut game);
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

    let (mut tx, mut rx, welcome) = login_alice(&proxy, &secret, deadline).await;
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
    // The avatar stands among the NPCs and attacks them with entity commands, which the sidecar
    // routes back to the same game; the hit shows in an NPC's public Health.
    play_until(
        &mut tx,
        &mut rx,
        &mut view,
        deadline,
        &game_log,
        "an NPC hurt by the avatar's attacks",
        View::npc_hurt,
    )
    .await;

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

// ------------------------------------------------------------------------------------------------
// Handoff between the Python game and the Rust arena

/// The 2×1 grid of the default world (32 m chunks): node 1 owns x < 65 536 m, node 2 the rest.
const BORDER_X: f64 = 65_536.0;
const CHUNK_M: f64 = 32.0;
/// Where the arena spawns the avatar and its one NPC: in node 1's last chunk, half a chunk from
/// the border, so node 2 sees the NPC as a ghost.
const ARENA_SPAWN: (f64, f64) = (BORDER_X - CHUNK_M / 2.0, 1000.0);
/// The Python game's NPC roams within `PYTHON_ROAM_M` of this point, inside node 2's area, so only
/// the avatar crosses; it comes within a chunk of the border, where node 1 sees it as a ghost.
const PYTHON_CENTER: (f64, f64) = (BORDER_X + 28.0, 1000.0);
const PYTHON_ROAM_M: f64 = 25.0;
const PYTHON_NPCS: u64 = 1;
/// Where the avatar stops to fight across the border, within the handoff margin either side so it
/// is not handed over: east of the line while the arena holds it (the Python game's NPC mostly in
/// reach, the arena's not), west of it while the Python game holds it (the arena's NPC nearest).
const FIGHT_EAST_X: f64 = BORDER_X + 16.0;
const FIGHT_WEST_X: f64 = BORDER_X - 8.0;
// Out of reach of the arena's NPC on the east; on the west, nearer it than the Python game's.
const _: () = assert!(FIGHT_EAST_X - ARENA_SPAWN.0 > combat::REACH_M);
const _: () =
    assert!(PYTHON_CENTER.0 - PYTHON_ROAM_M - FIGHT_WEST_X > FIGHT_WEST_X - ARENA_SPAWN.0);
/// The arena walks players faster than the samples' 5 m/s to keep the walk short; the Python game
/// walks at 5 m/s whatever the arena does.
const ARENA_PLAYER_SPEED: f64 = 20.0;
/// One input every this long, so some reach the sidecars while the avatar is frozen.
const INPUT_EVERY: Duration = Duration::from_millis(50);

/// What one client sees of its own avatar.
#[derive(Default)]
struct Avatar {
    account: String,
    id: Option<u64>,
    x: f64,
    components: HashMap<u32, Vec<u8>>,
    /// Every distinct InputAck seen, in order.
    acks: Vec<(u64, u64)>,
}

impl Avatar {
    /// Folds one batch; panics if the avatar vanishes or its acknowledgements go wrong.
    fn apply(&mut self, batch: Batch) {
        for d in batch.deltas {
            let kind = DeltaKind::try_from(d.kind).expect("a known delta kind");
            let mine = match self.id {
                Some(id) => d.entity_id == id,
                None => kind == DeltaKind::Appear && d.owner_account == self.account,
            };
            if !mine {
                continue;
            }
            assert_ne!(
                kind,
                DeltaKind::Vanish,
                "the client saw its own avatar {} vanish at x = {:.1} (acks so far {:?})",
                d.entity_id,
                self.x,
                self.acks
            );
            if kind == DeltaKind::Appear {
                assert!(
                    self.id.is_none(),
                    "the avatar {} appeared a second time at x = {:.1}",
                    d.entity_id,
                    self.x
                );
                self.id = Some(d.entity_id);
            }
            if let Some(p) = &d.position {
                self.x = p.x;
            }
            for c in d.components {
                if c.r#type == INPUT_ACK {
                    self.ack(&c.payload);
                }
                self.components.insert(c.r#type, c.payload.to_vec());
            }
            for t in &d.removed_types {
                self.components.remove(t);
            }
        }
    }

    fn ack(&mut self, payload: &[u8]) {
        let ack = schema::parse_input_ack(payload).expect("a 16-byte InputAck");
        // Every input is sent once, in sequence: each one applied exactly once keeps the count
        // equal to the last sequence number; a lost or doubled one breaks it for good.
        assert_eq!(
            ack.0, ack.1,
            "InputAck (last_seq, applied) = {ack:?}: an input was lost or applied twice \
             (acks so far {:?})",
            self.acks
        );
        if let Some(&last) = self.acks.last() {
            assert!(ack >= last, "InputAck went back from {last:?} to {ack:?}");
        }
        if self.acks.last() != Some(&ack) {
            self.acks.push(ack);
        }
    }

    fn input_ack(&self) -> Option<(u64, u64)> {
        self.acks.last().copied()
    }
}

/// A client playing through the proxy, and what it sees of its avatar.
struct Player {
    tx: ClientSender,
    rx: ClientReceiver,
    avatar: Avatar,
    /// The last input sequence number sent.
    seq: u64,
}

impl Player {
    async fn input(&mut self, dx: f32, dy: f32) {
        self.seq += 1;
        self.tx
            .input(self.seq, schema::input(dx, dy))
            .await
            .expect("sending input");
    }

    /// Steers the avatar: sends `dir` as a new input every [`INPUT_EVERY`] (nothing if `dir` is
    /// `None`) and folds what arrives, until `done` holds; panics at `deadline`.
    async fn steer_until(
        &mut self,
        dir: Option<(f32, f32)>,
        deadline: Instant,
        what: &str,
        game_log: &Log,
        mut done: impl FnMut(&Avatar) -> bool,
    ) {
        let mut every = tokio::time::interval(INPUT_EVERY);
        loop {
            tokio::select! {
                msg = timeout_at(deadline, self.rx.next()) => match msg {
                    Ok(Some(Ok(msg))) => match msg.body {
                        Some(server_message::Body::Batch(batch)) => self.avatar.apply(batch),
                        Some(server_message::Body::Ping(p)) => self
                            .tx
                            .send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                            .await
                            .expect("pong"),
                        Some(server_message::Body::Kick(k)) => {
                            panic!("kicked while waiting for {what}: {k:?}")
                        }
                        _ => {}
                    },
                    Ok(other) => {
                        panic!("connection to the proxy ended while waiting for {what}: {other:?}")
                    }
                    Err(_) => panic!(
                        "timed out waiting for {what}: avatar {:?} at x = {:.1}, input ack {:?}; \
                         Python game log:\n{}",
                        self.avatar.id,
                        self.avatar.x,
                        self.avatar.input_ack(),
                        game_log.text()
                    ),
                },
                _ = every.tick() => {
                    if done(&self.avatar) {
                        return;
                    }
                    if let Some((dx, dy)) = dir {
                        self.input(dx, dy).await;
                    }
                }
            }
        }
    }
}

/// Whether `node` holds `id` as a real it writes (not frozen in a handoff).
fn writes(node: &SidecarHandle, id: u64) -> bool {
    node.reals().iter().any(|r| r.id == id && !r.frozen)
}

/// Whether `node` holds `id` as a real, frozen or not.
fn holds(node: &SidecarHandle, id: u64) -> bool {
    node.reals().iter().any(|r| r.id == id)
}

/// Stops the Python game with SIGTERM; returns everything it wrote once it exited cleanly.
async fn terminate(mut game: Child, log: &Log, deadline: Instant) -> String {
    let pid = game.id().expect("the Python game runs").to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("running kill");
    assert!(kill.success(), "kill -TERM {pid} failed");
    let status = timeout_at(deadline, game.wait())
        .await
        .unwrap_or_else(|_| panic!("the Python game did not exit on SIGTERM:\n{}", log.text()))
        .expect("waiting for the Python game");
    assert!(
        status.success(),
        "the Python game exited with {status}:\n{}",
        log.text()
    );
    // Its stderr is read on a task of its own: wait for the last line.
    while !log.text().contains("python-game INFO stopped") {
        assert!(
            Instant::now() < deadline,
            "no last words from the Python game:\n{}",
            log.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    log.text()
}

/// The Python game's command figures (`name=count` words) from its last `commands:` line.
fn python_figures(log: &str) -> HashMap<String, u64> {
    let line = log
        .lines()
        .filter_map(|l| l.split_once("commands: "))
        .next_back()
        .unwrap_or_else(|| panic!("the Python game logged no command figures:\n{log}"))
        .1;
    line.split_whitespace()
        .map(|word| {
            let (name, count) = word.split_once('=').expect("name=count");
            (name.to_string(), count.parse().expect("a count"))
        })
        .collect()
}

/// The avatar walks from the arena's node into the Python game's and back; on the way it stops on
/// each side of the border to fight the other game's NPC with entity commands, until a kill's XP
/// comes back across the border.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_game_and_rust_arena_hand_an_avatar_back_and_forth() {
    let deadline = Instant::now() + Duration::from_secs(90);
    let stop = CancellationToken::new();
    let _stop_on_exit = stop.clone().drop_guard();

    let world = WorldShape::default();
    assert_eq!(world.chunk_size, CHUNK_M);
    let grid = Grid::even(&world, 2, 1, &[1, 2]).unwrap();
    let partition = Partition::new(world, 1, Layout::Grid(grid)).unwrap();
    let topology: Arc<dyn TopologyStore> = Arc::new(MemoryTopology::default());
    topology.commit_partition(0, &partition).await.unwrap();
    let stores = Stores::in_memory();
    let mut nodes = Vec::new();
    for node_id in [1, 2] {
        let cfg = SidecarConfig {
            node_id,
            world,
            local_listen: "127.0.0.1:0".into(),
            mesh_listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            // In-process nodes with an in-memory topology: nothing to take over on a restart.
            state_dir: String::new(),
            ..SidecarConfig::default()
        };
        nodes.push(
            cellmesh_sidecar::start_in(cfg, stores.clone(), topology.clone(), stop.child_token())
                .await
                .expect("starting a sidecar"),
        );
    }
    let (west, east) = (&nodes[0], &nodes[1]);

    // Node 1: the Rust arena, which spawns the avatar (node 1 is the client's gateway) and an NPC
    // beside it.
    let census = Arc::new(Census::default());
    let arena_cfg = ArenaConfig {
        sidecar: SidecarAddr::Tcp(west.local_addr.clone()),
        npcs: 1,
        center: ARENA_SPAWN,
        spread: 0.0,
        player_speed: ARENA_PLAYER_SPEED,
        census: Some(census.clone()),
        ..ArenaConfig::default()
    };
    let arena_stop = stop.child_token();
    let arena = tokio::spawn(cellmesh_arena::run(arena_cfg, async move {
        arena_stop.cancelled().await
    }));

    // Node 2: the Python game.
    let mut game = Command::new(python())
        .arg(game_dir().join("game.py"))
        .args(["--sidecar", &east.local_addr])
        .args(["--npcs", &PYTHON_NPCS.to_string()])
        .args([
            "--center",
            &format!("{},{}", PYTHON_CENTER.0, PYTHON_CENTER.1),
        ])
        .env("PYTHONUNBUFFERED", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting the Python game");
    let log = stderr_log(&mut game);

    let proxy_cfg = ProxyConfig {
        client_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        gateways: vec![west.mesh_addr.to_string()],
        token_secret: "python-handoff-test-secret".into(),
        ..ProxyConfig::default()
    };
    let secret = proxy_cfg.token_secret.clone();
    let proxy = cellmesh_proxy::start(proxy_cfg, stop.child_token())
        .await
        .expect("starting the proxy");

    let linked = |s: &SidecarHandle| {
        let st = s.stats();
        st.game_connected && st.peers_up == 1
    };
    while !(linked(west) && linked(east) && east.stats().entities >= PYTHON_NPCS) {
        if let Ok(Some(status)) = game.try_wait() {
            panic!("the Python game exited with {status}:\n{}", log.text());
        }
        assert!(
            Instant::now() < deadline,
            "the two nodes did not link with their games: {:?} / {:?}\n{}",
            west.stats(),
            east.stats(),
            log.text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let (tx, rx, welcome) = login_alice(&proxy, &secret, deadline).await;
    assert_eq!(welcome.gateway_node, 1);
    let mut player = Player {
        tx,
        rx,
        avatar: Avatar {
            account: "alice".into(),
            ..Avatar::default()
        },
        seq: 0,
    };

    player
        .steer_until(None, deadline, "the arena's avatar", &log, |a| {
            a.input_ack().is_some()
        })
        .await;
    let id = player.avatar.id.unwrap();
    assert_eq!(player.avatar.input_ack(), Some((0, 0)));
    assert!(
        player.avatar.x < BORDER_X,
        "spawned at x = {} in node 2's area",
        player.avatar.x
    );
    let inventory = player.avatar.components[&INVENTORY].clone();
    assert_eq!(utf8(&inventory), "sword,bread,10 gold");
    // The nodes publish their reals every 100 ms.
    player
        .steer_until(
            None,
            deadline,
            "the arena's node to list the avatar",
            &log,
            |_| writes(west, id) && !holds(east, id),
        )
        .await;

    // East of the line, still the arena's: it attacks the Python game's NPC (a ghost on node 1)
    // until the Python game kills it and sends the avatar its XP, which the arena answers. That
    // result is the first the Python game gets: it has no avatar of its own yet.
    player
        .steer_until(
            Some((1.0, 0.0)),
            deadline,
            "the avatar to reach the Python game's NPC",
            &log,
            |a| a.x >= FIGHT_EAST_X,
        )
        .await;
    player.input(0.0, 0.0).await;
    player
        .steer_until(
            None,
            deadline,
            "the result of the Python game's XP for its NPC's kill",
            &log,
            |_| {
                let st = east.stats();
                st.command_results_ok + st.command_results_failed >= 1
            },
        )
        .await;
    assert_eq!(east.stats().command_results_failed, 0, "{:?}", east.stats());
    assert!(
        writes(west, id),
        "the arena let the avatar go at x = {:.1}",
        player.avatar.x
    );
    assert!(
        log.text().contains("killed; XP to alice 100"),
        "the Python game's NPC was not killed by alice alone:\n{}",
        log.text()
    );

    // East, until the Python game simulates the avatar and the arena let it go.
    let adopted_by_python = format!("adopted player:alice (entity {id}, epoch 2)");
    player
        .steer_until(
            Some((1.0, 0.0)),
            deadline,
            "the Python game to adopt the avatar",
            &log,
            |_| log.text().contains(&adopted_by_python) && writes(east, id) && !holds(west, id),
        )
        .await;
    assert!(
        player.avatar.x >= BORDER_X + CHUNK_M,
        "handed over at x = {}, less than the margin past the border",
        player.avatar.x
    );

    // West of the line, still the Python game's (it walks at 5 m/s there): it attacks the arena's
    // NPC (a ghost on node 2) until the arena kills it and sends the avatar its XP.
    player
        .steer_until(
            Some((-1.0, 0.0)),
            deadline,
            "the avatar to reach the arena's NPC",
            &log,
            |a| a.x <= FIGHT_WEST_X,
        )
        .await;
    player.input(0.0, 0.0).await;
    player
        .steer_until(
            None,
            deadline,
            "the arena's XP for its NPC's kill",
            &log,
            |_| {
                log.text()
                    .contains("player:alice gained 100 XP for a kill on node 1")
            },
        )
        .await;
    assert!(
        writes(east, id),
        "the Python game let the avatar go at x = {:.1}",
        player.avatar.x
    );

    // West, until the arena simulates it again.
    player
        .steer_until(
            Some((-1.0, 0.0)),
            deadline,
            "the arena to adopt the avatar back",
            &log,
            |_| writes(west, id) && !holds(east, id),
        )
        .await;
    player.input(0.0, 0.0).await;
    let last = player.seq;
    player
        .steer_until(None, deadline, "every input acknowledged", &log, |a| {
            a.input_ack() == Some((last, last))
        })
        .await;

    assert!(
        log.text().contains(&format!(
            "handed player:alice (entity {id}) to another node"
        )),
        "the Python game did not let the avatar go:\n{}",
        log.text()
    );
    assert_eq!(
        player.avatar.components.get(&INVENTORY),
        Some(&inventory),
        "the owner-only Inventory changed on the way"
    );
    for (name, node) in [("west", west), ("east", east)] {
        let st = node.stats();
        assert!(st.handoffs >= 1, "{name} node handed nothing over: {st:?}");
        assert_eq!(st.in_doubt_now, 0, "{name} node: {st:?}");
        assert_eq!(st.handoffs_refused, 0, "{name} node: {st:?}");
        // Neither game wrote the avatar while it was frozen or after it left, nor reused the
        // request id of a command still waiting; every result either game got was ok.
        assert_eq!(st.errors, 0, "{name} node refused a write: {st:?}");
        assert_eq!(st.command_results_failed, 0, "{name} node: {st:?}");
    }
    assert!(writes(west, id) && !holds(east, id));
    let report = census.report();
    assert_eq!(report.holders.get(&id), Some(&vec![1]));

    assert!(
        game.try_wait().unwrap().is_none(),
        "the Python game exited:\n{}",
        log.text()
    );
    let py = python_figures(&terminate(game, &log, deadline).await);
    player.tx.close().await.expect("closing the client");
    stop.cancel();
    let stats = arena.await.expect("the arena task").expect("the arena ran");
    assert_eq!(
        (stats.adopted, stats.evicted, stats.thawed),
        (1, 1, 0),
        "{stats:?}"
    );
    assert_eq!(stats.inputs_duplicate, 0, "{stats:?}");

    // Commands crossed the border both ways and were applied: the arena's ten attacks or more to
    // kill the Python game's NPC and the XP for the arena's kill; the Python game's attacks and
    // the XP for its kill.
    assert!(py["applied_from_other_nodes"] > 10, "{py:?}");
    assert!(
        py["attacks_across_border"] >= 1 && py["xp_from_other_nodes"] >= 1,
        "{py:?}"
    );
    assert!(stats.attacks_across_border >= 10, "{stats:?}");
    assert!(stats.attacks_applied_from_other_nodes >= 1, "{stats:?}");
    assert!(stats.xp_from_other_nodes >= 1, "{stats:?}");
    // Every result came back ok, once.
    for figure in [
        "results_refused",
        "results_entity_gone",
        "results_timeout",
        "results_not_delivered",
        "results_unexpected",
        "refused",
    ] {
        assert_eq!(py[figure], 0, "Python game's {figure}: {py:?}");
    }
    assert_eq!(py["sent"], py["results_ok"] + py["waiting"], "{py:?}");
    assert_eq!(
        (
            stats.commands_refused,
            stats.results_refused,
            stats.results_entity_gone,
            stats.results_timeout,
            stats.results_not_delivered,
            stats.results_unexpected,
        ),
        (0, 0, 0, 0, 0, 0),
        "{stats:?}"
    );
    // At most once: no command applied twice (each carries an id of its own), nor more often
    // across the border than the other game sent it.
    assert_eq!(census.commands().1, 0, "the arena applied a command twice");
    assert_eq!(
        py["twice"], 0,
        "the Python game applied a command twice: {py:?}"
    );
    assert!(
        py["applied_from_other_nodes"] <= stats.attacks_across_border + stats.xp_sent,
        "{py:?} {stats:?}"
    );
    assert!(
        stats.attacks_applied_from_other_nodes + stats.xp_from_other_nodes
            <= py["attacks_across_border"] + py["xp_sent"],
        "{py:?} {stats:?}"
    );
}
