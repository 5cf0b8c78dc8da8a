//! Test support: real gateways (a sidecar with a small real game), the proxy under test, and
//! clients, well-behaved and raw.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use cellmesh_proto::client::{self, ClientError, ClientReceiver, ClientSender};
use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::edge::{
    client_message, server_message, Kick, KickReason, Pong, ServerFrame, ServerMessage, Welcome,
};
use cellmesh_proxy::{ProxyConfig, ProxyHandle};
use cellmesh_sidecar::{SidecarConfig, SidecarHandle};
use cellmesh_stores::Stores;
pub use cellmesh_test_support::{unix_now, within, EchoGame, PATIENCE};
use futures::StreamExt;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

pub const SECRET: &str = "test-secret";
pub fn token(account: &str) -> String {
    cellmesh_proto::token::sign(SECRET.as_bytes(), account, unix_now() + 3600)
}

// ------------------------------------------------------------------------------------ gateway

/// A real gateway: a sidecar with in-memory stores and a small real game connected over the
/// local protocol, which sends each input's payload back to its account.
pub struct Gateway {
    /// Where the proxy dials it: the sidecar's mesh port, or the pipe in front of it.
    pub addr: SocketAddr,
    pub node_id: u32,
    pub sidecar: SidecarHandle,
    pub game: EchoGame,
    pipe: Option<Pipe>,
    stop: CancellationToken,
}

impl Gateway {
    pub async fn start(node_id: u32) -> Self {
        Self::start_with(node_id, false).await
    }

    /// A gateway behind a pipe that can stop reading the proxy's bytes, as a stalled gateway's
    /// full socket buffers do (see [`Self::pause_reading`]).
    pub async fn stallable(node_id: u32) -> Self {
        Self::start_with(node_id, true).await
    }

    async fn start_with(node_id: u32, piped: bool) -> Self {
        let cfg = SidecarConfig {
            node_id,
            local_listen: "127.0.0.1:0".into(),
            mesh_listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..SidecarConfig::default()
        };
        let stop = CancellationToken::new();
        let sidecar = cellmesh_sidecar::start(cfg, Stores::in_memory(), stop.clone())
            .await
            .expect("the sidecar starts");
        let game = EchoGame::connect(&sidecar.local_addr).await;
        let pipe = match piped {
            true => Some(Pipe::start(sidecar.mesh_addr).await),
            false => None,
        };
        Self {
            addr: pipe.as_ref().map_or(sidecar.mesh_addr, |p| p.addr),
            node_id,
            sidecar,
            game,
            pipe,
            stop,
        }
    }

    /// The sidecar's `/state` once `f` holds of it (it is published every 100 ms).
    pub async fn state_until(
        &self,
        what: &str,
        f: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        within(what, async {
            loop {
                let (_, body) = cellmesh_admin::http_get(self.sidecar.admin_addr, "/state")
                    .await
                    .unwrap();
                let state: serde_json::Value = serde_json::from_str(&body).unwrap();
                if f(&state) {
                    return state;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
    }

    /// Stops reading what the proxy sends (its writes go on) until [`Self::resume_reading`].
    pub fn pause_reading(&self) {
        self.pipe.as_ref().expect("a stallable gateway").pause(true);
    }

    pub fn resume_reading(&self) {
        self.pipe
            .as_ref()
            .expect("a stallable gateway")
            .pause(false);
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A TCP pipe to a gateway: bytes pass both ways, and the proxy's side can stop being read.
struct Pipe {
    addr: SocketAddr,
    reading: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Pipe {
    async fn start(to: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let reading = tokio::sync::watch::Sender::new(true);
        let task = tokio::spawn({
            let reading = reading.clone();
            async move {
                while let Ok((from, _)) = listener.accept().await {
                    let Ok(gateway) = TcpStream::connect(to).await else {
                        continue;
                    };
                    let (mut gateway_r, mut gateway_w) = gateway.into_split();
                    let (mut from_r, mut from_w) = from.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut gateway_r, &mut from_w).await;
                    });
                    let mut reading = reading.subscribe();
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            if reading.wait_for(|r| *r).await.is_err() {
                                return;
                            }
                            let n = tokio::select! {
                                n = from_r.read(&mut buf) => n,
                                _ = reading.wait_for(|r| !*r) => continue,
                            };
                            let n = match n {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if gateway_w.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Self {
            addr,
            reading,
            task,
        }
    }

    fn pause(&self, paused: bool) {
        self.reading.send_replace(!paused);
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ------------------------------------------------------------------------------------ proxy

pub fn config(gateways: &[&Gateway]) -> ProxyConfig {
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

    /// Sends input `seq` and waits for the game's echo of it.
    pub async fn echo(&mut self, seq: u64) {
        let payload = Bytes::from(format!("input {seq}"));
        self.echo_payload(seq, payload).await
    }

    /// Sends input `seq` carrying `payload` and waits for the game's echo of it.
    pub async fn echo_payload(&mut self, seq: u64, payload: Bytes) {
        self.tx.input(seq, payload.clone()).await.unwrap();
        within(&format!("the echo of input {seq}"), async {
            loop {
                match self.next().await.map(|m| m.body) {
                    Some(Some(server_message::Body::Batch(b)))
                        if b.messages.iter().any(|m| m.payload == payload) =>
                    {
                        return;
                    }
                    Some(Some(server_message::Body::Kick(k))) => {
                        panic!("kicked while echoing {seq}: {k:?}")
                    }
                    Some(_) => {}
                    None => panic!("connection closed while echoing {seq}"),
                }
            }
        })
        .await
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
