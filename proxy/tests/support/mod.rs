//! Test support: a small gateway that speaks the mesh protocol for real over TCP, and clients
//! (well-behaved and raw) for the proxy under test.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use cellmesh_proto::client::{self, ClientError, ClientReceiver, ClientSender};
use cellmesh_proto::codec::{encode_body, FrameCodec};
use cellmesh_proto::edge::{
    client_message, server_message, AccountMessage, Batch, Kick, KickReason, Pong, ServerFrame,
    ServerMessage, Welcome,
};
use cellmesh_proto::mesh::{
    mesh_message::Body, Admission, Attached, Detach, Heartbeat, LinkHello, MeshFrame, MeshMessage,
    PeerRole, ProtocolVersion, SessionRtt, ToClient,
};
use cellmesh_proxy::{ProxyConfig, ProxyHandle};
pub use cellmesh_test_support::{unix_now, PATIENCE};
use futures::{SinkExt, StreamExt};
use prost::Message;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

pub const SECRET: &str = "test-secret";
pub fn token(account: &str) -> String {
    cellmesh_proto::token::sign(SECRET.as_bytes(), account, unix_now() + 3600)
}

// ------------------------------------------------------------------------------------ gateway

/// A gateway sidecar reduced to the mesh contract: answers `LinkHello`, `Attach` with
/// `Attached` (displacing an older session of the account with `Detach{DISPLACED}`), echoes each
/// `SessionInput` back as a one-message `Batch` (tick = seq), beats every second, and records
/// everything the proxy sent.
pub struct TestGateway {
    pub addr: SocketAddr,
    pub node_id: u32,
    inner: Arc<GatewayInner>,
    stop: CancellationToken,
}

struct GatewayInner {
    node_id: u32,
    /// account -> (link number, session id)
    sessions: Mutex<HashMap<String, (u64, u64)>>,
    links: Mutex<HashMap<u64, mpsc::UnboundedSender<MeshMessage>>>,
    received: Mutex<Vec<Body>>,
    epoch: AtomicU64,
    next_link: AtomicU64,
    drop_links: Mutex<CancellationToken>,
    /// False while the gateway stops reading its links (a stalled sidecar).
    reading: tokio::sync::watch::Sender<bool>,
    /// What it says of new sessions while closed (told to every link, and to each new one).
    closed: Mutex<Option<Admission>>,
    /// Set while it refuses new sessions' attaches `SERVER_FULL` (detail, retry hint).
    refusing: Mutex<Option<(String, u32)>>,
}

impl TestGateway {
    pub async fn start(node_id: u32) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let inner = Arc::new(GatewayInner {
            node_id,
            sessions: Mutex::default(),
            links: Mutex::default(),
            received: Mutex::default(),
            epoch: AtomicU64::new(0),
            next_link: AtomicU64::new(1),
            drop_links: Mutex::new(CancellationToken::new()),
            reading: tokio::sync::watch::Sender::new(true),
            closed: Mutex::new(None),
            refusing: Mutex::new(None),
        });
        let stop = CancellationToken::new();
        tokio::spawn({
            let (inner, stop) = (inner.clone(), stop.clone());
            async move {
                loop {
                    let (stream, _) = tokio::select! {
                        _ = stop.cancelled() => return,
                        r = listener.accept() => r.unwrap(),
                    };
                    let drop = inner.drop_links.lock().unwrap().clone();
                    tokio::spawn(serve_link(inner.clone(), stream, drop, stop.clone()));
                }
            }
        });
        Self {
            addr,
            node_id,
            inner,
            stop,
        }
    }

    /// Everything the proxy sent after its `LinkHello`s, in order.
    pub fn received(&self) -> Vec<Body> {
        self.inner.received.lock().unwrap().clone()
    }

    pub fn detaches(&self) -> Vec<Detach> {
        self.received()
            .into_iter()
            .filter_map(|b| {
                if let Body::Detach(d) = b {
                    Some(d)
                } else {
                    None
                }
            })
            .collect()
    }

    pub fn rtts(&self) -> Vec<SessionRtt> {
        self.received()
            .into_iter()
            .filter_map(|b| if let Body::Rtt(r) = b { Some(r) } else { None })
            .collect()
    }

    pub fn hellos(&self) -> Vec<LinkHello> {
        self.received()
            .into_iter()
            .filter_map(|b| {
                if let Body::Hello(h) = b {
                    Some(h)
                } else {
                    None
                }
            })
            .collect()
    }

    /// Polls until `pred` holds on what the proxy sent.
    pub async fn wait_for(&self, what: &str, pred: impl Fn(&[Body]) -> bool) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while !pred(&self.received()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "gateway never saw {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops reading every link (writing and beating go on) until [`Self::resume_reading`].
    pub fn pause_reading(&self) {
        self.inner.reading.send_replace(false);
    }

    pub fn resume_reading(&self) {
        self.inner.reading.send_replace(true);
    }

    /// Says on every link (and on each that comes up later) that the node admits no new
    /// session, for `reason`, with the retry hint `retry_after_ms`.
    pub fn close_admission(&self, reason: &str, retry_after_ms: u32) {
        let a = Admission {
            open: false,
            reason: reason.into(),
            retry_after_ms,
        };
        *self.inner.closed.lock().unwrap() = Some(a.clone());
        self.tell_links(a);
    }

    /// Refuses the attach of every new session `SERVER_FULL` (a moved one is attached), as a
    /// node that closed before the proxy heard does.
    pub fn refuse_attaches(&self, detail: &str, retry_after_ms: u32) {
        *self.inner.refusing.lock().unwrap() = Some((detail.into(), retry_after_ms));
    }

    /// Says on every link that the node admits new sessions again.
    pub fn open_admission(&self) {
        *self.inner.closed.lock().unwrap() = None;
        self.tell_links(Admission {
            open: true,
            ..Default::default()
        });
    }

    fn tell_links(&self, a: Admission) {
        for tx in self.inner.links.lock().unwrap().values() {
            let _ = tx.send(Body::Admission(a.clone()).into());
        }
    }

    /// Closes every open link (the proxy is expected to redial).
    pub fn drop_links(&self) {
        let mut token = self.inner.drop_links.lock().unwrap();
        token.cancel();
        *token = CancellationToken::new();
    }

    /// Sends `count` batches of `size` payload bytes to `account`'s session, as fast as the link
    /// takes them.
    pub fn push(&self, account: &str, count: usize, size: usize) {
        let (link, session_id) = self.inner.sessions.lock().unwrap()[account];
        let tx = self.inner.links.lock().unwrap()[&link].clone();
        let payload = Bytes::from(vec![7u8; size]);
        for tick in 0..count as u64 {
            let frame = batch_frame(tick, payload.clone());
            let _ = tx.send(
                Body::ToClient(ToClient {
                    session_id,
                    server_frame: frame,
                })
                .into(),
            );
        }
    }

    pub fn stop(&self) {
        self.stop.cancel();
        self.drop_links();
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        self.stop();
    }
}

fn batch_frame(tick: u64, payload: Bytes) -> Bytes {
    let batch = Batch {
        tick,
        messages: vec![AccountMessage { r#type: 1, payload }],
        ..Default::default()
    };
    encode_body(&ServerFrame::one(server_message::Body::Batch(batch)))
}

async fn serve_link(
    inner: Arc<GatewayInner>,
    stream: TcpStream,
    drop: CancellationToken,
    stop: CancellationToken,
) {
    let link = inner.next_link.fetch_add(1, Ordering::Relaxed);
    let (r, w) = stream.into_split();
    let mut reader = FramedRead::new(r, FrameCodec::<MeshFrame>::default());
    let mut writer = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
    let Some(Ok(first)) = reader.next().await else {
        return;
    };
    let Some(Body::Hello(hello)) = first.messages.into_iter().next().and_then(|m| m.body) else {
        panic!("the proxy's first mesh frame must be LinkHello");
    };
    inner.received.lock().unwrap().push(Body::Hello(hello));
    let reply = LinkHello {
        version: Some(ProtocolVersion::current()),
        role: PeerRole::Sidecar as i32,
        id: inner.node_id.to_string(),
        geo: "local".into(),
        partition_epoch: 1,
        node_id: inner.node_id,
    };
    if writer
        .send(MeshFrame::one(Body::Hello(reply)))
        .await
        .is_err()
    {
        return;
    }
    let (tx, mut rx) = mpsc::unbounded_channel::<MeshMessage>();
    if let Some(a) = inner.closed.lock().unwrap().clone() {
        let _ = tx.send(Body::Admission(a).into());
    }
    inner.links.lock().unwrap().insert(link, tx.clone());
    let writer_task = tokio::spawn({
        let (drop, stop) = (drop.clone(), stop.clone());
        async move {
            let mut beat = tokio::time::interval(Duration::from_secs(1));
            loop {
                let msg = tokio::select! {
                    _ = drop.cancelled() => break,
                    _ = stop.cancelled() => break,
                    m = rx.recv() => match m { Some(m) => m, None => break },
                    _ = beat.tick() => Body::Heartbeat(Heartbeat { sent_unix_ms: 0 }).into(),
                };
                if writer
                    .send(MeshFrame {
                        messages: vec![msg],
                    })
                    .await
                    .is_err()
                {
                    break;
                }
            }
        }
    });
    let mut reading = inner.reading.subscribe();
    loop {
        let paused = tokio::select! {
            _ = drop.cancelled() => break,
            _ = stop.cancelled() => break,
            _ = reading.wait_for(|r| !*r) => true,
            f = reader.next() => match f {
                Some(Ok(frame)) => {
                    for body in frame.messages.into_iter().filter_map(|m| m.body) {
                        handle(&inner, link, &tx, body);
                    }
                    false
                }
                _ => break,
            },
        };
        if paused {
            tokio::select! {
                _ = drop.cancelled() => break,
                _ = stop.cancelled() => break,
                _ = reading.wait_for(|r| *r) => {}
            }
        }
    }
    inner.links.lock().unwrap().remove(&link);
    inner
        .sessions
        .lock()
        .unwrap()
        .retain(|_, (l, _)| *l != link);
    writer_task.abort();
}

fn handle(inner: &GatewayInner, link: u64, tx: &mpsc::UnboundedSender<MeshMessage>, body: Body) {
    match &body {
        Body::Attach(a) if !a.moved && inner.refusing.lock().unwrap().is_some() => {
            let (detail, retry_after_ms) = inner.refusing.lock().unwrap().clone().unwrap();
            let refusal = Detach {
                session_id: a.session_id,
                kick_reason: KickReason::ServerFull as u32,
                detail,
                retry_after_ms,
            };
            let _ = tx.send(Body::Detach(refusal).into());
        }
        Body::Attach(a) => {
            let old = inner
                .sessions
                .lock()
                .unwrap()
                .insert(a.account.clone(), (link, a.session_id));
            if let Some((old_link, old_session)) = old {
                let detach = Detach {
                    session_id: old_session,
                    kick_reason: KickReason::Displaced as u32,
                    detail: "account logged in elsewhere".into(),
                    retry_after_ms: 0,
                };
                if let Some(old_tx) = inner.links.lock().unwrap().get(&old_link) {
                    let _ = old_tx.send(Body::Detach(detach).into());
                }
            }
            let attached = Attached {
                session_id: a.session_id,
                session_epoch: inner.epoch.fetch_add(1, Ordering::Relaxed) + 1,
                gateway_node: inner.node_id,
                world_width: 131_072.0,
                world_height: 131_072.0,
                chunk_size: 32.0,
            };
            let _ = tx.send(Body::Attached(attached).into());
        }
        Body::Input(i) => {
            let frame = batch_frame(i.seq, i.payload.clone());
            let _ = tx.send(
                Body::ToClient(ToClient {
                    session_id: i.session_id,
                    server_frame: frame,
                })
                .into(),
            );
        }
        Body::Detach(d) => {
            inner
                .sessions
                .lock()
                .unwrap()
                .retain(|_, s| *s != (link, d.session_id));
        }
        _ => {}
    }
    if !matches!(body, Body::Heartbeat(_)) {
        inner.received.lock().unwrap().push(body);
    }
}

// ------------------------------------------------------------------------------------ proxy

pub fn config(gateways: &[&TestGateway]) -> ProxyConfig {
    ProxyConfig {
        name: "proxy-test".into(),
        client_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        gateways: gateways.iter().map(|g| g.addr.to_string()).collect(),
        token_secret: SECRET.into(),
        // Tests that drain say so; the rest stop at once.
        drain_grace_ms: 0,
        drain_spread_ms: 0,
        ..ProxyConfig::default()
    }
}

pub struct TestProxy {
    pub handle: ProxyHandle,
    pub stop: CancellationToken,
}

impl TestProxy {
    /// Starts the proxy and waits until it is ready (listening, a gateway link up).
    pub async fn start(cfg: ProxyConfig) -> Self {
        let stop = CancellationToken::new();
        let handle = cellmesh_proxy::start(cfg, stop.clone()).await.unwrap();
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while !handle.admin.is_ready() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "proxy never became ready"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Self { handle, stop }
    }

    pub fn addr(&self) -> String {
        self.handle.client_addr.to_string()
    }

    pub async fn login(&self, account: &str) -> TestClient {
        TestClient::login(&self.addr(), &token(account))
            .await
            .unwrap()
    }

    /// Polls until the proxy counts `n` attached sessions.
    pub async fn wait_sessions(&self, n: u64) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self.handle.stats().sessions != n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "sessions stayed at {}",
                self.handle.stats().sessions
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The healthy-neighbour check: `neighbour` still gets its inputs back, and a newcomer still
    /// gets `Welcome` and its inputs back.
    pub async fn assert_healthy(&self, neighbour: &mut TestClient, seq: u64) {
        neighbour.echo(seq).await;
        let mut fresh = self.login(&format!("newcomer-{seq}")).await;
        fresh.echo(1).await;
        fresh.tx.close().await.unwrap();
    }
}

// ------------------------------------------------------------------------------------ clients

/// A logged-in client that answers the proxy's pings while it waits.
pub struct TestClient {
    pub tx: ClientSender,
    pub rx: ClientReceiver,
    pub welcome: Welcome,
}

impl TestClient {
    pub async fn login(addr: &str, token: &str) -> Result<Self, ClientError> {
        let (tx, rx, welcome) = client::login(addr, token).await?;
        Ok(Self { tx, rx, welcome })
    }

    /// The next message that is not a ping (pings are answered).
    pub async fn next(&mut self) -> Option<ServerMessage> {
        loop {
            let m = tokio::time::timeout(PATIENCE, self.rx.next())
                .await
                .expect("proxy went silent")?;
            let m = m.ok()?;
            if let Some(server_message::Body::Ping(p)) = &m.body {
                let _ = self
                    .tx
                    .send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                    .await;
                continue;
            }
            return Some(m);
        }
    }

    /// Sends input `seq` and waits for the gateway's echo of it.
    pub async fn echo(&mut self, seq: u64) {
        let payload = Bytes::from(format!("input {seq}"));
        self.tx.input(seq, payload.clone()).await.unwrap();
        loop {
            match self.next().await.map(|m| m.body) {
                Some(Some(server_message::Body::Batch(b))) if b.tick == seq => {
                    assert_eq!(b.messages[0].payload, payload);
                    return;
                }
                Some(Some(server_message::Body::Kick(k))) => {
                    panic!("kicked while echoing {seq}: {k:?}")
                }
                Some(_) => {}
                None => panic!("connection closed while echoing {seq}"),
            }
        }
    }

    /// Answers pings for `time`.
    pub async fn pump(&mut self, time: Duration) {
        let _ = tokio::time::timeout(time, async { while self.next().await.is_some() {} }).await;
    }

    /// Reads past anything else until the `Kick`, then expects the connection to close.
    pub async fn kick(&mut self) -> Kick {
        loop {
            match self.next().await.map(|m| m.body) {
                Some(Some(server_message::Body::Kick(k))) => {
                    assert!(
                        self.next().await.is_none(),
                        "the proxy must close after a kick"
                    );
                    return k;
                }
                Some(_) => {}
                None => panic!("connection closed without a Kick"),
            }
        }
    }
}

/// A client that writes whatever bytes a test wants.
pub struct RawClient {
    reader: FramedRead<OwnedReadHalf, FrameCodec<ServerFrame>>,
    writer: OwnedWriteHalf,
}

impl RawClient {
    pub async fn connect(addr: &str) -> Self {
        let (r, w) = TcpStream::connect(addr).await.unwrap().into_split();
        Self {
            reader: FramedRead::new(r, FrameCodec::default()),
            writer: w,
        }
    }

    pub async fn write(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).await.unwrap();
    }

    /// Writes `msg` framed (length prefix + body), whatever protocol it belongs to.
    pub async fn write_frame(&mut self, msg: &impl Message) {
        let mut buf = BytesMut::new();
        buf.put_u32(msg.encoded_len() as u32);
        msg.encode(&mut buf).unwrap();
        self.write(&buf).await;
    }

    pub async fn shutdown_write(&mut self) {
        self.writer.shutdown().await.unwrap();
    }

    /// The nonce of the proxy's `Challenge`, its first message.
    pub async fn challenge(&mut self) -> Vec<u8> {
        let frame = tokio::time::timeout(PATIENCE, self.reader.next())
            .await
            .expect("no challenge in time")
            .expect("connection closed without a Challenge")
            .expect("undecodable frame from the proxy");
        match frame.messages.into_iter().next().and_then(|m| m.body) {
            Some(server_message::Body::Challenge(c)) => c.nonce.to_vec(),
            other => panic!("expected a Challenge first, got {other:?}"),
        }
    }

    /// The next message that is not a ping or a challenge.
    pub async fn next_message(&mut self) -> Option<server_message::Body> {
        loop {
            let frame = tokio::time::timeout(PATIENCE, self.reader.next())
                .await
                .expect("proxy went silent")?
                .expect("undecodable frame from the proxy");
            for m in frame.messages {
                match m.body {
                    Some(server_message::Body::Ping(_) | server_message::Body::Challenge(_)) => {}
                    other => return other,
                }
            }
        }
    }

    /// The `Kick` the proxy sends, after which it must close.
    pub async fn kick(&mut self) -> Kick {
        loop {
            let frame = tokio::time::timeout(PATIENCE, self.reader.next())
                .await
                .expect("no kick in time")
                .expect("connection closed without a Kick")
                .expect("undecodable frame from the proxy");
            for m in frame.messages {
                if let Some(server_message::Body::Kick(k)) = m.body {
                    let after = tokio::time::timeout(PATIENCE, self.reader.next())
                        .await
                        .expect("not closed");
                    assert!(
                        after.is_none(),
                        "the proxy must close after a kick, got {after:?}"
                    );
                    return k;
                }
            }
        }
    }
}

pub fn reason(k: &Kick) -> KickReason {
    KickReason::try_from(k.reason).unwrap()
}

/// A CA in `dir/ca` and an edge certificate naming `hosts` in `dir/edge`: the proxy's
/// `client_tls`, and the CA file clients trust.
pub fn edge_certs(
    dir: &std::path::Path,
    hosts: &[&str],
) -> (cellmesh_trust::ClientTlsConfig, std::path::PathBuf) {
    use cellmesh_trust::certs;
    certs::init(&dir.join("ca"), "test").unwrap();
    let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    let issued = certs::issue_edge(&dir.join("ca"), &hosts, &dir.join("edge"), 1).unwrap();
    let cfg = cellmesh_trust::ClientTlsConfig {
        cert: issued.cert.display().to_string(),
        key: issued.key.display().to_string(),
    };
    (cfg, issued.ca)
}
