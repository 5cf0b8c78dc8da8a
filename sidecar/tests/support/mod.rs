//! Test harness: a sidecar on ephemeral ports with in-memory stores, a game speaking the local
//! protocol through the SDK, a real proxy in front with clients logged in through it, and raw
//! mesh peers for the tests whose subject is the bytes on the wire.
#![allow(dead_code)]

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::client::{self, ClientReceiver, ClientSender};
use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::edge::{self, client_message, server_message, DeltaKind, EntityDelta};
use cellmesh_proto::local::{
    self, game_message, sidecar_message, Audience, AudienceKind, Component, SidecarFrame, Vec3,
};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, PeerRole};
use cellmesh_proto::sdk::{self, GameReceiver, GameSender, SdkConfig};
use cellmesh_proxy::{ProxyConfig, ProxyHandle};
use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use cellmesh_stores::Stores;
pub use cellmesh_test_support::within;
use futures::{SinkExt, StreamExt};
use prost::Message;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

pub const CHUNK: f64 = 32.0;

// ---------------------------------------------------------------------------- sidecar

pub struct TestSidecar {
    pub handle: Option<SidecarHandle>,
    pub stop: CancellationToken,
    pub stores: Stores,
    pub cfg: SidecarConfig,
}

pub fn test_config() -> SidecarConfig {
    SidecarConfig {
        node_id: 7,
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        attest_keys: vec![attest_key()],
        ..SidecarConfig::default()
    }
}

impl TestSidecar {
    pub async fn start() -> Self {
        Self::start_with(test_config()).await
    }

    pub async fn start_with(cfg: SidecarConfig) -> Self {
        let stores = Stores::in_memory();
        let stop = CancellationToken::new();
        let handle = cellmesh_sidecar::start(cfg.clone(), stores.clone(), stop.clone())
            .await
            .expect("sidecar starts");
        Self {
            handle: Some(handle),
            stop,
            stores,
            cfg,
        }
    }

    pub fn h(&self) -> &SidecarHandle {
        self.handle.as_ref().expect("running")
    }

    pub fn local(&self) -> String {
        self.h().local_addr.clone()
    }

    pub fn mesh(&self) -> SocketAddr {
        self.h().mesh_addr
    }

    pub async fn game(&self) -> TestGame {
        TestGame::connect(&self.local()).await
    }

    /// A real proxy with this sidecar its one gateway.
    pub async fn edge(&self, name: &str) -> Edge {
        Edge::start(name, &[self.mesh()]).await
    }

    pub async fn state(&self) -> serde_json::Value {
        let (status, body) = cellmesh_admin::http_get(self.h().admin_addr, "/state")
            .await
            .unwrap();
        assert_eq!(status, 200);
        serde_json::from_str(&body).unwrap()
    }

    pub async fn metrics(&self) -> String {
        cellmesh_admin::http_get(self.h().admin_addr, "/metrics")
            .await
            .unwrap()
            .1
    }

    /// Waits until `f` holds for the published state (refreshed every 100 ms).
    pub async fn state_until(
        &self,
        what: &str,
        f: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        within(what, async {
            loop {
                let s = self.state().await;
                if f(&s) {
                    return s;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
    }

    pub async fn shutdown(mut self) {
        self.stop.cancel();
        within("sidecar shutdown", self.handle.take().unwrap().wait()).await;
    }
}

impl Drop for TestSidecar {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

// ---------------------------------------------------------------------------- game

pub struct TestGame {
    pub tx: GameSender,
    pub rx: GameReceiver,
    pub welcome: local::Welcome,
    backlog: VecDeque<sidecar_message::Body>,
}

impl TestGame {
    pub async fn connect(addr: &str) -> Self {
        let cfg = match addr.strip_prefix("unix:") {
            Some(path) => SdkConfig {
                addr: sdk::SidecarAddr::Unix(path.into()),
                ..SdkConfig::tcp("", "test-game")
            },
            None => SdkConfig::tcp(addr, "test-game"),
        };
        let (tx, rx, welcome) = within("game handshake", sdk::connect(cfg))
            .await
            .expect("game connects");
        Self {
            tx,
            rx,
            welcome,
            backlog: VecDeque::new(),
        }
    }

    pub fn push(&mut self, body: game_message::Body) {
        self.tx.push(body);
    }

    pub async fn tick(&mut self, tick: u64) {
        self.tx.end_tick(tick).await.expect("tick sent");
    }

    pub async fn flush(&mut self) {
        self.tx.flush().await.expect("flush");
    }

    async fn recv(&mut self) -> Option<sidecar_message::Body> {
        match self.rx.next().await {
            Some(Ok(m)) => m.body,
            Some(Err(e)) => panic!("game connection failed: {e}"),
            None => None,
        }
    }

    /// The first message `f` accepts (others are kept for later calls).
    pub async fn expect<T>(
        &mut self,
        what: &str,
        mut f: impl FnMut(&sidecar_message::Body) -> Option<T>,
    ) -> T {
        if let Some(i) = self.backlog.iter().position(|m| f(m).is_some()) {
            let m = self.backlog.remove(i).unwrap();
            return f(&m).unwrap();
        }
        within(what, async {
            loop {
                let m = self
                    .recv()
                    .await
                    .unwrap_or_else(|| panic!("sidecar closed the game while waiting for {what}"));
                if let Some(t) = f(&m) {
                    return t;
                }
                self.backlog.push_back(m);
            }
        })
        .await
    }

    /// Like [`expect`](Self::expect), but gives up after `d` with `None` (what came meanwhile is
    /// kept for later calls): for polling while other games tick.
    pub async fn expect_within<T>(
        &mut self,
        d: Duration,
        mut f: impl FnMut(&sidecar_message::Body) -> Option<T>,
    ) -> Option<T> {
        if let Some(i) = self.backlog.iter().position(|m| f(m).is_some()) {
            let m = self.backlog.remove(i).unwrap();
            return f(&m);
        }
        tokio::time::timeout(d, async {
            loop {
                let m = self.recv().await?;
                if let Some(t) = f(&m) {
                    return Some(t);
                }
                self.backlog.push_back(m);
            }
        })
        .await
        .ok()
        .flatten()
    }

    pub async fn expect_error(&mut self) -> local::Error {
        self.expect("an Error", |m| match m {
            sidecar_message::Body::Error(e) => Some(e.clone()),
            _ => None,
        })
        .await
    }

    pub async fn expect_join(&mut self, account: &str) -> local::PlayerJoin {
        self.expect(&format!("PlayerJoin of {account}"), |m| match m {
            sidecar_message::Body::PlayerJoin(j) if j.account == account => Some(j.clone()),
            _ => None,
        })
        .await
    }

    /// The next `Input` the game is handed.
    pub async fn expect_input(&mut self) -> local::Input {
        self.expect("Input", |m| match m {
            sidecar_message::Body::Input(i) => Some(i.clone()),
            _ => None,
        })
        .await
    }

    pub async fn reserve(&mut self, count: u32) -> Vec<u64> {
        let request_id = rand_id();
        self.push(game_message::Body::ReserveIds(local::ReserveIds {
            request_id,
            count,
        }));
        self.flush().await;
        self.expect("IdsReserved", |m| match m {
            sidecar_message::Body::IdsReserved(r) if r.request_id == request_id => {
                Some(r.ids.clone())
            }
            _ => None,
        })
        .await
    }

    /// Everything received so far and within `d`, without waiting for anything in particular.
    pub async fn drain(&mut self, d: Duration) -> Vec<sidecar_message::Body> {
        let mut out: Vec<_> = self.backlog.drain(..).collect();
        let _ = tokio::time::timeout(d, async {
            while let Some(m) = self.recv().await {
                out.push(m);
            }
        })
        .await;
        out
    }

    /// Waits for the sidecar to close the connection, returning what came before.
    pub async fn closed(&mut self) -> Vec<sidecar_message::Body> {
        let mut out: Vec<_> = self.backlog.drain(..).collect();
        within("the sidecar to close the game connection", async {
            loop {
                match self.rx.next().await {
                    Some(Ok(m)) => out.extend(m.body),
                    Some(Err(_)) | None => return,
                }
            }
        })
        .await;
        out
    }
}

fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

// ---------------------------------------------------------------------------- entities

pub fn aud(kind: AudienceKind, accounts: &[&str]) -> Option<Audience> {
    Some(Audience {
        kind: kind as i32,
        accounts: accounts.iter().map(|s| s.to_string()).collect(),
    })
}

pub fn comp(t: u32, payload: &str, audience: Option<Audience>) -> Component {
    Component {
        r#type: t,
        payload: Bytes::from(payload.to_string()),
        audience,
    }
}

/// The centre of chunk (cx, cy).
pub fn chunk(cx: i64, cy: i64) -> Vec3 {
    Vec3::xy(
        cx as f64 * CHUNK + CHUNK / 2.0,
        cy as f64 * CHUNK + CHUNK / 2.0,
    )
}

pub fn avatar(
    id: u64,
    account: &str,
    at: Vec3,
    mut components: Vec<Component>,
) -> game_message::Body {
    components.insert(0, comp(1, account, aud(AudienceKind::PublicInRange, &[])));
    game_message::Body::Spawn(local::Spawn {
        entity_id: id,
        position: Some(at),
        components,
        owner_account: account.into(),
        is_master: true,
        parent_id: 0,
    })
}

pub fn npc(id: u64, at: Vec3) -> game_message::Body {
    game_message::Body::Spawn(local::Spawn {
        entity_id: id,
        position: Some(at),
        components: vec![comp(1, "npc", aud(AudienceKind::PublicInRange, &[]))],
        ..Default::default()
    })
}

pub fn move_to(id: u64, at: Vec3) -> game_message::Body {
    game_message::Body::Update(local::Update {
        entity_id: id,
        position: Some(at),
        ..Default::default()
    })
}

pub fn change(id: u64, c: Component) -> game_message::Body {
    game_message::Body::Update(local::Update {
        entity_id: id,
        changed: vec![c],
        ..Default::default()
    })
}

pub fn despawn(id: u64) -> game_message::Body {
    game_message::Body::Despawn(local::Despawn { entity_id: id })
}

pub fn kinds(b: &edge::Batch) -> Vec<(u64, DeltaKind)> {
    b.deltas.iter().map(|d| (d.entity_id, d.kind())).collect()
}

pub fn types(d: &EntityDelta) -> Vec<u32> {
    d.components.iter().map(|c| c.r#type).collect()
}

pub fn delta(b: &edge::Batch, id: u64) -> &EntityDelta {
    b.deltas
        .iter()
        .find(|d| d.entity_id == id)
        .unwrap_or_else(|| panic!("no delta for {id} in {b:?}"))
}

// ---------------------------------------------------------------------------- proxies and players

/// The attach key the sidecars under test and their proxies share, made for this process.
pub fn attest_key() -> String {
    static KEY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    KEY.get_or_init(|| format!("test:{}", cellmesh_test_support::run_id()))
        .clone()
}

/// The token secret of the proxies under test.
const TOKEN_SECRET: &str = "test-secret";

/// A real proxy in front of gateway sidecars, and the players logged in through it, each known
/// by the number the test gives it.
pub struct Edge {
    pub handle: ProxyHandle,
    stop: CancellationToken,
    players: BTreeMap<u64, Player>,
}

impl Edge {
    /// Starts proxy `name` with `gateways` and waits until it is ready (a gateway link up).
    pub async fn start(name: &str, gateways: &[SocketAddr]) -> Self {
        let cfg = ProxyConfig {
            name: name.into(),
            client_listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            gateways: gateways.iter().map(|g| g.to_string()).collect(),
            token_secret: TOKEN_SECRET.into(),
            attest_keys: vec![attest_key()],
            drain_grace_ms: 0,
            drain_spread_ms: 0,
            ..ProxyConfig::default()
        };
        let stop = CancellationToken::new();
        let handle = cellmesh_proxy::start(cfg, stop.clone())
            .await
            .expect("the proxy starts");
        within("the proxy to be ready", async {
            while !handle.admin.is_ready() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        Self {
            handle,
            stop,
            players: BTreeMap::new(),
        }
    }

    /// Logs `account` in as player `player`; its `Welcome` (the session's gateway and epoch).
    pub async fn login(&mut self, player: u64, account: &str) -> edge::Welcome {
        let token = cellmesh_proto::token::sign(
            TOKEN_SECRET.as_bytes(),
            account,
            cellmesh_test_support::unix_now() + 3600,
        );
        let addr = self.handle.client_addr.to_string();
        let (tx, rx, welcome) = within(&format!("{account}'s login"), client::login(&addr, &token))
            .await
            .unwrap_or_else(|e| panic!("{account}'s login failed: {e}"));
        self.players.insert(
            player,
            Player {
                tx,
                rx,
                backlog: VecDeque::new(),
            },
        );
        welcome.clone()
    }

    pub fn player(&mut self, player: u64) -> &mut Player {
        self.players
            .get_mut(&player)
            .unwrap_or_else(|| panic!("no player {player}"))
    }

    /// The next batch player `player` gets.
    pub async fn batch(&mut self, player: u64) -> edge::Batch {
        self.player(player).batch().await
    }

    /// Every batch player `player` gets within `d` (for "exactly one" and "none" checks).
    pub async fn batches_within(&mut self, player: u64, d: Duration) -> Vec<edge::Batch> {
        self.player(player).batches_within(d).await
    }

    pub async fn input(&mut self, player: u64, seq: u64, payload: &'static [u8]) {
        self.player(player).input(seq, payload).await
    }

    /// Forgets every batch the players got so far or within `d`.
    pub async fn settle(&mut self, d: Duration) {
        tokio::time::sleep(d).await;
        for p in self.players.values_mut() {
            p.batches_within(Duration::from_millis(5)).await;
        }
    }

    /// Player `player` says goodbye and closes its connection.
    pub async fn leave(&mut self, player: u64) {
        let p = self
            .players
            .remove(&player)
            .unwrap_or_else(|| panic!("no player {player}"));
        p.tx.close().await.expect("the goodbye is sent");
    }

    /// The `Kick` player `player` gets, after which the proxy closes its connection.
    pub async fn kicked(&mut self, player: u64) -> edge::Kick {
        self.player(player).kicked().await
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A logged-in client of a proxy, answering its pings whenever it reads.
pub struct Player {
    tx: ClientSender,
    rx: ClientReceiver,
    /// What came while the test waited for something else.
    backlog: VecDeque<server_message::Body>,
}

impl Player {
    pub async fn input(&mut self, seq: u64, payload: &'static [u8]) {
        self.tx
            .input(seq, Bytes::from_static(payload))
            .await
            .expect("the input is sent");
    }

    /// The next message kept or read.
    async fn next(&mut self) -> Option<server_message::Body> {
        match self.backlog.pop_front() {
            Some(m) => Some(m),
            None => self.read().await,
        }
    }

    /// The next message read that is not a ping (pings are answered); `None` once closed.
    async fn read(&mut self) -> Option<server_message::Body> {
        loop {
            let m = self.rx.next().await?.ok()?;
            match m.body {
                Some(server_message::Body::Ping(p)) => {
                    let pong = client_message::Body::Pong(edge::Pong { nonce: p.nonce });
                    let _ = self.tx.send(pong).await;
                }
                Some(body) => return Some(body),
                None => {}
            }
        }
    }

    /// The next batch; anything else before it is kept for later.
    pub async fn batch(&mut self) -> edge::Batch {
        if let Some(i) = self
            .backlog
            .iter()
            .position(|m| matches!(m, server_message::Body::Batch(_)))
        {
            let Some(server_message::Body::Batch(b)) = self.backlog.remove(i) else {
                unreachable!()
            };
            return b;
        }
        let mut kept = Vec::new();
        let b = within("a batch", async {
            loop {
                match self.read().await {
                    Some(server_message::Body::Batch(b)) => return b,
                    Some(other) => kept.push(other),
                    None => panic!("the proxy closed the player while it waited for a batch"),
                }
            }
        })
        .await;
        self.backlog.extend(kept);
        b
    }

    /// Every batch within `d`; anything else is kept for later.
    pub async fn batches_within(&mut self, d: Duration) -> Vec<edge::Batch> {
        let mut out = Vec::new();
        let mut kept = Vec::new();
        self.backlog.retain(|m| match m {
            server_message::Body::Batch(b) => {
                out.push(b.clone());
                false
            }
            _ => true,
        });
        let _ = tokio::time::timeout(d, async {
            while let Some(m) = self.read().await {
                match m {
                    server_message::Body::Batch(b) => out.push(b),
                    other => kept.push(other),
                }
            }
        })
        .await;
        self.backlog.extend(kept);
        out
    }

    /// Reads past anything else to the `Kick`, then expects the connection to close.
    pub async fn kicked(&mut self) -> edge::Kick {
        within("a kick", async {
            loop {
                match self.next().await {
                    Some(server_message::Body::Kick(k)) => {
                        assert!(
                            self.read().await.is_none(),
                            "the proxy must close after a kick"
                        );
                        return k;
                    }
                    Some(_) => {}
                    None => panic!("the connection closed without a Kick"),
                }
            }
        })
        .await
    }

    /// Reads and answers pings for `d` (batches and all are kept for later).
    pub async fn pump(&mut self, d: Duration) {
        let mut kept = Vec::new();
        let _ = tokio::time::timeout(d, async {
            while let Some(m) = self.read().await {
                kept.push(m);
            }
        })
        .await;
        self.backlog.extend(kept);
    }
}

// ---------------------------------------------------------------------------- raw peers

/// A signed attestation under the shared attest key for `account`'s session `session_id` now,
/// for a raw peer's `Attach`.
pub fn attestation(account: &str, session_id: u64) -> String {
    let ring = test_config().attest_ring().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    cellmesh_proto::attest::sign(ring.signing(), account, session_id, now)
}

pub fn link_hello(name: &str, major: u32) -> MeshFrame {
    MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
        version: Some(mesh::ProtocolVersion { major, minor: 0 }),
        role: PeerRole::Proxy as i32,
        id: name.into(),
        geo: "local".into(),
        partition_epoch: 0,
        node_id: 0,
        lease_epoch: 0,
        world_geos: Vec::new(),
    }))
}

/// The `LinkHello` of a sidecar `node_id` dialling a peer: a test playing another node.
pub fn sidecar_hello(node_id: u32, partition_epoch: u64) -> MeshFrame {
    MeshFrame::one(mesh_message::Body::Hello(mesh::LinkHello {
        version: Some(mesh::ProtocolVersion::current()),
        role: PeerRole::Sidecar as i32,
        id: node_id.to_string(),
        geo: "local".into(),
        partition_epoch,
        node_id,
        lease_epoch: 1,
        world_geos: Vec::new(),
    }))
}

/// A mesh connection that sends the frames the test writes and reads what comes back, for tests
/// whose subject is what crosses the wire: it keeps no heartbeat of its own.
pub struct RawPeer {
    reader: FramedRead<OwnedReadHalf, FrameCodec<MeshFrame>>,
    writer: FramedWrite<OwnedWriteHalf, FrameCodec<MeshFrame>>,
    /// What came while the test waited for something else.
    backlog: VecDeque<mesh_message::Body>,
    /// The sidecar's `LinkHello`.
    pub hello: mesh::LinkHello,
}

impl RawPeer {
    /// Dials `addr` as proxy `name`.
    pub async fn proxy(addr: SocketAddr, name: &str) -> Self {
        Self::dial(addr, link_hello(name, 1)).await
    }

    /// Dials with `hello` as the first frame and waits for the sidecar's `LinkHello`.
    pub async fn dial(addr: SocketAddr, hello: MeshFrame) -> Self {
        let stream = TcpStream::connect(addr).await.expect("mesh dial");
        stream.set_nodelay(true).unwrap();
        let (r, w) = stream.into_split();
        let mut peer = Self {
            reader: FramedRead::new(r, FrameCodec::default()),
            writer: FramedWrite::new(w, FrameCodec::default()),
            backlog: VecDeque::new(),
            hello: mesh::LinkHello::default(),
        };
        peer.writer.send(hello).await.expect("the hello is sent");
        let first = within("LinkHello back", peer.reader.next())
            .await
            .expect("an answer")
            .expect("a frame");
        peer.hello = match first.messages.into_iter().next().and_then(|m| m.body) {
            Some(mesh_message::Body::Hello(h)) => h,
            other => panic!("expected LinkHello, got {other:?}"),
        };
        peer
    }

    pub async fn send(&mut self, body: mesh_message::Body) {
        self.writer
            .send(MeshFrame::one(body))
            .await
            .expect("the frame is sent");
    }

    /// The first message `f` accepts (heartbeats skipped, others kept for later calls).
    pub async fn expect<T>(
        &mut self,
        what: &str,
        mut f: impl FnMut(&mesh_message::Body) -> Option<T>,
    ) -> T {
        if let Some(i) = self.backlog.iter().position(|m| f(m).is_some()) {
            let m = self.backlog.remove(i).unwrap();
            return f(&m).unwrap();
        }
        within(what, async {
            loop {
                let frame = self
                    .reader
                    .next()
                    .await
                    .unwrap_or_else(|| panic!("link closed while waiting for {what}"))
                    .expect("a frame");
                let mut found = None;
                for m in frame.messages.into_iter().filter_map(|m| m.body) {
                    if matches!(m, mesh_message::Body::Heartbeat(_)) {
                        continue;
                    }
                    match f(&m) {
                        Some(t) if found.is_none() => found = Some(t),
                        _ => self.backlog.push_back(m),
                    }
                }
                if let Some(t) = found {
                    return t;
                }
            }
        })
        .await
    }

    pub async fn expect_detach(&mut self, session_id: u64) -> mesh::Detach {
        self.expect(&format!("Detach of session {session_id}"), |m| match m {
            mesh_message::Body::Detach(d) if d.session_id == session_id => Some(d.clone()),
            _ => None,
        })
        .await
    }
}

// ---------------------------------------------------------------------------- raw game connections

/// A connection to the local-protocol port that sends whatever the test wants.
pub struct RawConn {
    pub stream: TcpStream,
}

impl RawConn {
    pub async fn open(addr: &str) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        Self { stream }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    pub async fn send_frame(&mut self, msg: &impl Message) {
        let body = msg.encode_to_vec();
        let mut bytes = (body.len() as u32).to_be_bytes().to_vec();
        bytes.extend_from_slice(&body);
        self.send(&bytes).await;
    }

    /// Reads until the sidecar closes: every message it sent, in order.
    pub async fn until_closed(self) -> Vec<sidecar_message::Body> {
        let mut reader = FramedRead::new(self.stream, FrameCodec::<SidecarFrame>::default());
        let mut out = Vec::new();
        within("the sidecar to close the connection", async {
            while let Some(Ok(frame)) = reader.next().await {
                out.extend(frame.messages.into_iter().filter_map(|m| m.body));
            }
        })
        .await;
        out
    }

    /// The one fatal error the sidecar sent before closing.
    pub async fn fatal_error(self) -> local::Error {
        let got = self.until_closed().await;
        match got.as_slice() {
            [sidecar_message::Body::Error(e)] => {
                assert!(e.fatal, "{e:?} should be fatal");
                e.clone()
            }
            other => panic!("expected exactly one Error before the close, got {other:?}"),
        }
    }
}

pub fn hello(major: u32, minor: u32) -> local::GameFrame {
    local::GameFrame {
        messages: vec![game_message::Body::Hello(local::Hello {
            version: Some(local::ProtocolVersion { major, minor }),
            tick_rate_hz: 20,
            game: "raw".into(),
        })
        .into()],
    }
}

// ---------------------------------------------------------------------------- a scene

/// A sidecar with a game connected and a real proxy in front of it: the usual starting point.
pub struct Scene {
    pub sc: TestSidecar,
    pub game: TestGame,
    pub edge: Edge,
    ids: Vec<u64>,
    pub tick: u64,
}

impl Scene {
    pub async fn new() -> Self {
        Self::with(TestSidecar::start().await).await
    }

    pub async fn with(sc: TestSidecar) -> Self {
        let mut game = sc.game().await;
        let ids = game.reserve(256).await;
        let edge = sc.edge("edge-test").await;
        Self {
            sc,
            game,
            edge,
            ids,
            tick: 0,
        }
    }

    pub fn id(&mut self) -> u64 {
        self.ids.pop().expect("enough ids reserved")
    }

    /// Ends the tick; returns its number.
    pub async fn tick(&mut self) -> u64 {
        self.tick += 1;
        self.game.tick(self.tick).await;
        self.tick
    }

    /// Logs `account` in as player `player` and spawns its avatar at `at`; returns the avatar
    /// id. The player's first batch (the avatar and whatever is around it) is returned too.
    pub async fn join(
        &mut self,
        player: u64,
        account: &str,
        at: Vec3,
        components: Vec<Component>,
    ) -> (u64, edge::Batch) {
        let welcome = self.edge.login(player, account).await;
        let join = self.game.expect_join(account).await;
        assert_eq!(join.session_epoch, welcome.session_epoch);
        let id = self.id();
        self.game.push(avatar(id, account, at, components));
        self.tick().await;
        let b = self.edge.batch(player).await;
        assert_eq!(b.tick, self.tick);
        (id, b)
    }
}

/// Message type of [`Scene::nothing_for`]'s marker.
pub const MARKER: u32 = 9999;

impl Scene {
    /// Asserts that player `player` (of `account`) got no batch since the last one it received:
    /// sends the account a marker message in a new tick and checks that the player's next batch
    /// is that tick's, holding the marker alone. Link order makes this exact, not timed.
    pub async fn nothing_for(&mut self, player: u64, account: &str) {
        self.game.push(game_message::Body::Send(local::Send {
            accounts: vec![account.into()],
            r#type: MARKER,
            payload: Bytes::from_static(b"marker"),
        }));
        let t = self.tick().await;
        let b = self.edge.batch(player).await;
        assert_eq!(
            b.tick, t,
            "player {player} got a batch before the marker: {b:?}"
        );
        assert!(b.deltas.is_empty() && b.events.is_empty(), "{b:?}");
        assert_eq!(
            b.messages.iter().map(|m| m.r#type).collect::<Vec<_>>(),
            [MARKER]
        );
    }
}
