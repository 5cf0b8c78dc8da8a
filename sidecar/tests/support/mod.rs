//! Test harness: a sidecar on ephemeral ports with in-memory stores, a game speaking the local
//! protocol through the SDK, and the proxy's side of a mesh link speaking the mesh protocol over
//! real TCP.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::edge::{self, server_message, DeltaKind, EntityDelta, ServerFrame};
use cellmesh_proto::local::{
    self, game_message, sidecar_message, Audience, AudienceKind, Component, SidecarFrame, Vec3,
};
use cellmesh_proto::mesh::{self, mesh_message, MeshFrame, PeerRole};
use cellmesh_proto::sdk::{self, GameReceiver, GameSender, SdkConfig};
use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use cellmesh_stores::Stores;
pub use cellmesh_test_support::within;
use futures::{SinkExt, StreamExt};
use prost::Message;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
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

    pub async fn link(&self, name: &str) -> MeshLink {
        MeshLink::dial(self.mesh(), name).await
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

// ---------------------------------------------------------------------------- mesh link

/// The proxy's end of a mesh link: handshake, heartbeats every second, and a typed inbox.
pub struct MeshLink {
    out: mpsc::Sender<MeshFrame>,
    inbox: mpsc::UnboundedReceiver<mesh_message::Body>,
    backlog: VecDeque<mesh_message::Body>,
    pub sidecar_hello: mesh::LinkHello,
    stop: CancellationToken,
}

impl Drop for MeshLink {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// What a proxy holding the built-in attest key (a sidecar's default) signs for `account`'s
/// session `session_id` now.
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
    }))
}

impl MeshLink {
    pub async fn dial(addr: SocketAddr, name: &str) -> Self {
        Self::dial_with(addr, link_hello(name, 1)).await
    }

    /// Dials with `hello` as the first frame (e.g. [`sidecar_hello`] to play a peer sidecar).
    pub async fn dial_with(addr: SocketAddr, hello: MeshFrame) -> Self {
        let stream = TcpStream::connect(addr).await.expect("mesh dial");
        stream.set_nodelay(true).unwrap();
        let (r, w) = stream.into_split();
        let mut reader = FramedRead::new(r, FrameCodec::<MeshFrame>::default());
        let mut writer = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
        writer.send(hello).await.unwrap();
        let first = within("LinkHello back", reader.next())
            .await
            .expect("an answer")
            .expect("a frame");
        let sidecar_hello = match first.messages.into_iter().next().and_then(|m| m.body) {
            Some(mesh_message::Body::Hello(h)) => h,
            other => panic!("expected LinkHello, got {other:?}"),
        };
        let (out, mut queue) = mpsc::channel::<MeshFrame>(1024);
        let (deliver, inbox) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let halt = stop.clone();
        tokio::spawn(async move {
            let mut beat = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = halt.cancelled() => break,
                    f = queue.recv() => match f {
                        Some(f) => if writer.send(f).await.is_err() { break },
                        None => break,
                    },
                    _ = beat.tick() => {
                        let hb = MeshFrame::one(mesh_message::Body::Heartbeat(mesh::Heartbeat { sent_unix_ms: 0 }));
                        if writer.send(hb).await.is_err() { break }
                    }
                    f = reader.next() => match f {
                        Some(Ok(frame)) => {
                            for m in frame.messages {
                                match m.body {
                                    Some(mesh_message::Body::Heartbeat(_)) | None => {}
                                    Some(b) => { let _ = deliver.send(b); }
                                }
                            }
                        }
                        _ => break,
                    },
                }
            }
            let _ = writer.get_mut().shutdown().await;
        });
        Self {
            out,
            inbox,
            backlog: VecDeque::new(),
            sidecar_hello,
            stop,
        }
    }

    pub async fn send(&self, body: mesh_message::Body) {
        self.out
            .send(MeshFrame::one(body))
            .await
            .expect("link task alive");
    }

    /// Closes the link from the proxy side.
    pub fn close(&self) {
        self.stop.cancel();
    }

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
                let m = self
                    .inbox
                    .recv()
                    .await
                    .unwrap_or_else(|| panic!("link closed while waiting for {what}"));
                if let Some(t) = f(&m) {
                    return t;
                }
                self.backlog.push_back(m);
            }
        })
        .await
    }

    pub async fn attach(&mut self, session_id: u64, account: &str) -> mesh::Attached {
        self.send(mesh_message::Body::Attach(mesh::Attach {
            session_id,
            account: account.into(),
            remote_addr: "127.0.0.1:1".into(),
            moved: false,
            moved_from_epoch: 0,
            handover: None,
            attestation: attestation(account, session_id),
        }))
        .await;
        self.expect(&format!("Attached for session {session_id}"), |m| match m {
            mesh_message::Body::Attached(a) if a.session_id == session_id => Some(*a),
            mesh_message::Body::Detach(d) if d.session_id == session_id => {
                panic!("attach refused: {d:?}")
            }
            _ => None,
        })
        .await
    }

    pub async fn input(&self, session_id: u64, seq: u64, payload: &'static [u8]) {
        self.send(mesh_message::Body::Input(mesh::SessionInput {
            session_id,
            seq,
            payload: Bytes::from_static(payload),
        }))
        .await;
    }

    pub async fn detach(&self, session_id: u64) {
        self.send(mesh_message::Body::Detach(mesh::Detach {
            session_id,
            kick_reason: edge::KickReason::KickUnspecified as u32,
            detail: "bye".into(),
            retry_after_ms: 0,
        }))
        .await;
    }

    pub async fn expect_detach(&mut self, session_id: u64) -> mesh::Detach {
        self.expect(&format!("Detach of session {session_id}"), |m| match m {
            mesh_message::Body::Detach(d) if d.session_id == session_id => Some(d.clone()),
            _ => None,
        })
        .await
    }

    /// The next tick batch for `session_id`.
    pub async fn batch(&mut self, session_id: u64) -> edge::Batch {
        let bytes = self
            .expect(&format!("a batch for session {session_id}"), |m| match m {
                mesh_message::Body::ToClient(t) if t.session_id == session_id => {
                    Some(t.server_frame.clone())
                }
                _ => None,
            })
            .await;
        decode_batch(bytes)
    }

    /// Forgets every batch received so far or within `d`, for any session.
    pub async fn settle(&mut self, d: Duration) {
        let _ = tokio::time::timeout(d, async {
            while let Some(m) = self.inbox.recv().await {
                self.backlog.push_back(m);
            }
        })
        .await;
        self.backlog
            .retain(|m| !matches!(m, mesh_message::Body::ToClient(_)));
    }

    /// Every batch for `session_id` arriving within `d` (for "exactly one" and "none" checks).
    pub async fn batches_within(&mut self, session_id: u64, d: Duration) -> Vec<edge::Batch> {
        let _ = tokio::time::timeout(d, async {
            while let Some(m) = self.inbox.recv().await {
                self.backlog.push_back(m);
            }
        })
        .await;
        let mut out = Vec::new();
        self.backlog.retain(|m| match m {
            mesh_message::Body::ToClient(t) if t.session_id == session_id => {
                out.push(decode_batch(t.server_frame.clone()));
                false
            }
            _ => true,
        });
        out
    }
}

pub fn decode_batch(bytes: Bytes) -> edge::Batch {
    let frame = ServerFrame::decode(bytes).expect("a ServerFrame");
    assert_eq!(frame.messages.len(), 1, "one message per ToClient");
    match frame.messages.into_iter().next().unwrap().body {
        Some(server_message::Body::Batch(b)) => b,
        other => panic!("expected a Batch, got {other:?}"),
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

/// A sidecar with a game connected and one proxy link: the usual starting point.
pub struct Scene {
    pub sc: TestSidecar,
    pub game: TestGame,
    pub link: MeshLink,
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
        let link = sc.link("edge-test").await;
        Self {
            sc,
            game,
            link,
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

    /// Attaches `account` as `session_id` and spawns its avatar at `at`; returns the avatar id.
    /// The session's first batch (the avatar and whatever is around it) is returned too.
    pub async fn join(
        &mut self,
        session_id: u64,
        account: &str,
        at: Vec3,
        components: Vec<Component>,
    ) -> (u64, edge::Batch) {
        let attached = self.link.attach(session_id, account).await;
        let join = self.game.expect_join(account).await;
        assert_eq!(join.session_epoch, attached.session_epoch);
        let id = self.id();
        self.game.push(avatar(id, account, at, components));
        self.tick().await;
        let b = self.link.batch(session_id).await;
        assert_eq!(b.tick, self.tick);
        (id, b)
    }
}

/// Message type of [`Scene::nothing_for`]'s marker.
pub const MARKER: u32 = 9999;

impl Scene {
    /// Asserts that `session_id` (of `account`) got no batch since the last one it received:
    /// sends the account a marker message in a new tick and checks that the session's next
    /// batch is that tick's, holding the marker alone. Link order makes this exact, not timed.
    pub async fn nothing_for(&mut self, session_id: u64, account: &str) {
        self.game.push(game_message::Body::Send(local::Send {
            accounts: vec![account.into()],
            r#type: MARKER,
            payload: Bytes::from_static(b"marker"),
        }));
        let t = self.tick().await;
        let b = self.link.batch(session_id).await;
        assert_eq!(
            b.tick, t,
            "session {session_id} got a batch before the marker: {b:?}"
        );
        assert!(b.deltas.is_empty() && b.events.is_empty(), "{b:?}");
        assert_eq!(
            b.messages.iter().map(|m| m.r#type).collect::<Vec<_>>(),
            [MARKER]
        );
    }
}
