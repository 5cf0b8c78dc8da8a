//! `edge`: a player's traffic through the cellmesh proxy, against HAProxy (TCP mode) carrying
//! the same frames between the same client and backend, in the same run.
//!
//! The backend plays the gateway sidecar, the client plays a player, and both run the same code
//! on either path; only what sits between them changes:
//!
//! - **cellmesh proxy** (`cellmesh_proxy::start`, on a runtime of one thread): the client logs in
//!   with a signed token; the backend speaks the gateway's side of the mesh protocol
//!   (`LinkHello`, `Attach` answered by `Attached`, heartbeats) and sends each frame for the
//!   client as a `ToClient` on its mesh link. The proxy checks the login, relays each frame as
//!   it is, rate-limits the client's inputs into `SessionInput`s, and pings the client.
//! - **HAProxy** (`mode tcp`, `nbthread 1`): the backend writes the same `ServerFrame` bodies
//!   with the same length prefix straight onto its TCP connection, and the client's inputs reach
//!   it as the client wrote them. There is no login (HAProxy has none to check), no mesh
//!   framing and nothing inspected.
//!
//! The client decodes the same bytes either way. Both paths stay open for the whole run and are
//! measured in alternating rounds ([`phases`]). Server → client, the hot direction: a gateway's
//! per-tick batch of [`ENTITIES`] entity deltas (the first one's component stamped), at a fixed
//! rate for latency, then as fast as the path takes them for throughput with at most [`WINDOW`]
//! batches in flight: the proxy kicks a client whose queue reaches `client_outbox_frames` (256)
//! rather than slowing the gateway, so the window stays under it, on both paths. Client →
//! server: stamped inputs at [`INPUT_HZ`], a player's rate, measured (while the batches'
//! latency is) when the backend decodes them.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use bytes::Bytes;
use cellmesh_proto::batch::{encode_delta, BatchWriter, Encoded};
use cellmesh_proto::client::{self, ClientReceiver, ClientSender};
use cellmesh_proto::codec::{FrameCodec, RawFrame};
use cellmesh_proto::edge::{
    client_message, server_message, Batch, ClientFrame, ComponentData, DeltaKind, EntityDelta,
    Pong, Vec3,
};
use cellmesh_proto::mesh::{
    mesh_message::Body, Attached, Heartbeat, LinkHello, MeshFrame, MeshMessage, PeerRole,
    ProtocolVersion, ToClient,
};
use cellmesh_proxy::{ProxyConfig, ProxyHandle};
use cellmesh_world::geometry::WorldShape;
use futures::{SinkExt, StreamExt};
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

use super::cluster::component_runtime;
use super::external::start_haproxy;
use super::game::{read_stamp, stamped, STAMPED, STAMP_LEN};
use super::phases::{
    self, alternate, flag_latency, latency_measured, Flow, Round, Sender, Sent, Source, Tally,
};
use super::report::{nanos_histogram, ratio, Latency};
use super::Options;

/// Entity deltas in one batch for the client.
const ENTITIES: usize = 16;
/// Batches a second in the latency phase.
const RATE: u32 = 1000;
/// Batches at most in flight while sending as fast as possible: under the proxy's default
/// `client_outbox_frames` (256).
const WINDOW: u64 = 128;
/// Inputs a second from the client: a player's rate, under the proxy's default per-account limit.
const INPUT_HZ: u32 = 50;
/// Frames queued for a backend connection's writer.
const OUTBOX: usize = 8192;
/// The backend's node id on the mesh.
const NODE: u32 = 1;
const ACCOUNT: &str = "edge-0";

pub async fn run(opts: &Options) -> anyhow::Result<Value> {
    let (rounds, warm_up) = if opts.quick {
        (2, Duration::from_millis(250))
    } else {
        (4, Duration::from_millis(500))
    };
    let round = Round::of(rounds, RATE, warm_up, opts.measure_for());
    // HAProxy first: without it there is no comparison to make.
    let mut plain = Backend::start(Framing::Plain).await?;
    let haproxy = start_haproxy(plain.addr).await?;
    let mut mesh = Backend::start(Framing::Mesh).await?;
    let proxy = EdgeProxy::start(mesh.addr).await?;
    let frame_bytes = 4 + ClientBatches::new().frame(1).len();

    let (tx, rx, _welcome) = client::login(&proxy.client_addr(), &proxy.token(ACCOUNT))
        .await
        .map_err(|e| anyhow!("logging in through the proxy: {e}"))?;
    let mut through_proxy = OpenPath::start("through the cellmesh proxy", (tx, rx), &mut mesh)
        .await
        .context("opening a session through the cellmesh proxy")?;
    let client = client::open(&haproxy.addr.to_string())
        .await
        .map_err(|e| anyhow!("connecting through HAProxy: {e}"))?;
    let mut through_haproxy = OpenPath::start("through HAProxy", client, &mut plain)
        .await
        .context("opening a connection through HAProxy")?;

    alternate(
        rounds,
        &round,
        &mut through_proxy.sender,
        &mut through_haproxy.sender,
    )
    .await?;
    let through_proxy = through_proxy
        .finish(&mesh)
        .await
        .context("through the cellmesh proxy")?;
    let through_haproxy = through_haproxy
        .finish(&plain)
        .await
        .context("through HAProxy")?;
    drop(proxy);

    let (tls_run, plain_run) = tls_against_plaintext(rounds, &round).await?;
    let (t, q) = (tls_run.tally.latency(), plain_run.tally.latency());

    let (p, h) = (
        through_proxy.tally.latency(),
        through_haproxy.tally.latency(),
    );
    Ok(json!({
        "offered_per_s": RATE,
        "entities_per_frame": ENTITIES,
        "frame_bytes": frame_bytes,
        "window_frames": WINDOW,
        "inputs_per_s": INPUT_HZ,
        "rounds": rounds,
        "cellmesh": {
            "proxy": through_proxy.figures(frame_bytes),
            "proxy_mesh_tls": tls_run.figures(frame_bytes),
            "proxy_mesh_plaintext": plain_run.figures(frame_bytes),
        },
        "baseline": { "haproxy": through_haproxy.figures(frame_bytes) },
        "ratio": {
            "p50_proxy_over_haproxy": ratio(p.p50_us, h.p50_us),
            "p99_proxy_over_haproxy": ratio(p.p99_us, h.p99_us),
            "p999_proxy_over_haproxy": ratio(p.p999_us, h.p999_us),
            "throughput_proxy_over_haproxy": ratio(
                through_proxy.throughput_per_s(),
                through_haproxy.throughput_per_s()
            ),
            "input_p99_proxy_over_haproxy": ratio(
                through_proxy.inputs.p99_us,
                through_haproxy.inputs.p99_us
            ),
            "p50_mesh_tls_over_plaintext": ratio(t.p50_us, q.p50_us),
            "p99_mesh_tls_over_plaintext": ratio(t.p99_us, q.p99_us),
            "throughput_mesh_tls_over_plaintext": ratio(
                tls_run.throughput_per_s(),
                plain_run.throughput_per_s()
            ),
            "input_p99_mesh_tls_over_plaintext": ratio(
                tls_run.inputs.p99_us,
                plain_run.inputs.p99_us
            ),
        },
    }))
}

/// The proxy's link to its gateway with mutual TLS, as deployed, against the same in plaintext,
/// their rounds alternated like the comparison with HAProxy: what TLS on the mesh link costs.
async fn tls_against_plaintext(rounds: u32, round: &Round) -> anyhow::Result<(PathRun, PathRun)> {
    let dir = tempfile::tempdir().context("a directory for the certificates")?;
    let ca = dir.path().join("ca");
    cellmesh_trust::certs::init(&ca, "bench")?;
    let geo = ProxyConfig::default().geo;
    let issue = |label: &str, role, node| -> anyhow::Result<cellmesh_trust::MeshTlsConfig> {
        let who =
            cellmesh_trust::Identity::new(role, node, Some(&geo)).map_err(anyhow::Error::msg)?;
        let out = dir.path().join(label);
        cellmesh_trust::certs::issue(&ca, &who, &out, 1)?;
        Ok(cellmesh_trust::MeshTlsConfig::in_dir(&out))
    };
    let gateway_tls = cellmesh_trust::MeshTls::load(&issue(
        "gateway",
        cellmesh_trust::Role::Sidecar,
        Some(NODE),
    )?)?;
    let proxy_tls = issue("proxy", cellmesh_trust::Role::Proxy, None)?;

    let mut tls_backend = Backend::start_tls(Framing::Mesh, Some(gateway_tls)).await?;
    let tls_proxy = EdgeProxy::start_tls(tls_backend.addr, proxy_tls).await?;
    let mut plain_backend = Backend::start(Framing::Mesh).await?;
    let plain_proxy = EdgeProxy::start(plain_backend.addr).await?;
    let mut paths = Vec::new();
    for (name, proxy, backend) in [
        ("through the proxy, mesh TLS", &tls_proxy, &mut tls_backend),
        (
            "through the proxy, mesh plaintext",
            &plain_proxy,
            &mut plain_backend,
        ),
    ] {
        let (tx, rx, _welcome) = client::login(&proxy.client_addr(), &proxy.token(ACCOUNT))
            .await
            .map_err(|e| anyhow!("logging in {name}: {e}"))?;
        paths.push(
            OpenPath::start(name, (tx, rx), backend)
                .await
                .with_context(|| format!("opening a session {name}"))?,
        );
    }
    let (mut plain_path, mut tls_path) = (paths.pop().expect("two"), paths.pop().expect("two"));
    alternate(rounds, round, &mut tls_path.sender, &mut plain_path.sender).await?;
    let tls_run = tls_path.finish(&tls_backend).await.context("mesh TLS")?;
    let plain_run = plain_path
        .finish(&plain_backend)
        .await
        .context("mesh plaintext")?;
    Ok((tls_run, plain_run))
}

struct PathRun {
    sent: Sent,
    tally: Tally,
    inputs: Latency,
}

impl PathRun {
    fn throughput_per_s(&self) -> f64 {
        self.tally.throughput_per_s(&self.sent)
    }

    fn figures(&self, frame_bytes: usize) -> Value {
        let mut v = phases::figures(&self.sent, &self.tally, frame_bytes);
        v["inputs"] = json!(self.inputs);
        v
    }
}

/// A player connected to a backend: the backend's sender, and the player's task.
struct OpenPath {
    sender: Sender<ToPlayer>,
    player: JoinHandle<anyhow::Result<Tally>>,
    stop: CancellationToken,
}

impl OpenPath {
    /// Starts the session of the client connected by `client` with its first input, and the
    /// player on it.
    async fn start(
        name: &'static str,
        (mut tx, rx): (ClientSender, ClientReceiver),
        backend: &mut Backend,
    ) -> anyhow::Result<Self> {
        tx.input(0, Bytes::new())
            .await
            .map_err(|e| anyhow!("sending the first input: {e}"))?;
        let out = tokio::time::timeout(Duration::from_secs(10), backend.sessions.recv())
            .await
            .context("the client's first input did not reach the backend within 10 s")?
            .context("the backend stopped")?;
        let flow = Flow::new(WINDOW);
        let stop = CancellationToken::new();
        let player = tokio::spawn(play(
            tx,
            rx,
            Tally::new(flow.clone()),
            flow.clone(),
            stop.clone(),
        ));
        let source = ToPlayer {
            batches: ClientBatches::new(),
            out,
        };
        Ok(Self {
            sender: Sender::new(name, source, flow),
            player,
            stop,
        })
    }

    async fn finish(self, backend: &Backend) -> anyhow::Result<PathRun> {
        // What was sent gets a moment to arrive.
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.stop.cancel();
        let tally = self.player.await.context("the client task")??;
        let inputs = Latency::from_nanos(&backend.inputs.lock().expect("inputs lock"));
        anyhow::ensure!(
            tally.latency_frames() > 0,
            "no batch whose latency was measured arrived"
        );
        anyhow::ensure!(
            inputs.count > 0,
            "no input whose latency was measured reached the backend"
        );
        Ok(PathRun {
            sent: self.sender.sent(),
            tally,
            inputs,
        })
    }
}

/// The player: tallies the batches, answers pings and sends stamped inputs, until `stop`.
async fn play(
    mut tx: ClientSender,
    mut rx: ClientReceiver,
    mut tally: Tally,
    flow: Arc<Flow>,
    stop: CancellationToken,
) -> anyhow::Result<Tally> {
    let mut inputs = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(INPUT_HZ)));
    let mut seq = 0;
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => break,
            _ = inputs.tick() => {
                seq += 1;
                // Measured while the batches' latency is, so both directions share conditions.
                let stamp = stamped(STAMP_LEN, flag_latency(seq, flow.measuring_latency()));
                tx.input(seq, stamp)
                    .await
                    .map_err(|e| anyhow!("sending an input: {e}"))?;
                continue;
            }
            m = rx.next() => m,
        };
        let msg = msg
            .context("the connection closed")?
            .map_err(|e| anyhow!("reading: {e}"))?;
        match msg.body {
            Some(server_message::Body::Batch(b)) => {
                if let Some(stamp) = batch_stamp(&b) {
                    tally.frame(stamp);
                }
            }
            Some(server_message::Body::Ping(p)) => tx
                .send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                .await
                .map_err(|e| anyhow!("answering a ping: {e}"))?,
            Some(server_message::Body::Kick(k)) => anyhow::bail!("kicked: {k:?}"),
            _ => {}
        }
    }
    Ok(tally)
}

/// A gateway's batches for one client: the first delta's component stamped anew for each
/// batch, the others encoded once and shared, as the gateway shares them between clients.
struct ClientBatches {
    others: Vec<Encoded>,
}

impl ClientBatches {
    fn new() -> Self {
        Self {
            others: (2..=ENTITIES as u64)
                .map(|id| encode_delta(&delta(id, crate::payload(id))))
                .collect(),
        }
    }

    /// The encoded `ServerFrame` of batch `seq`, stamped now.
    fn frame(&self, seq: u64) -> Bytes {
        let mut w = BatchWriter::new(seq);
        w.delta(encode_delta(&delta(1, stamped(crate::PAYLOAD, seq))));
        for d in &self.others {
            w.delta(d.clone());
        }
        w.finish()
    }
}

fn delta(id: u64, payload: Bytes) -> EntityDelta {
    EntityDelta {
        entity_id: id,
        kind: DeltaKind::Update as i32,
        position: Some(Vec3 {
            x: 8000.0 + id as f64,
            y: 1000.0 + id as f64,
            z: 0.0,
        }),
        components: vec![ComponentData {
            r#type: STAMPED,
            payload,
        }],
        ..Default::default()
    }
}

/// A batch's stamp, `(sent_ns, seq)`: its first delta's component's.
fn batch_stamp(b: &Batch) -> Option<(u64, u64)> {
    read_stamp(&b.deltas.first()?.components.first()?.payload)
}

/// The backend's sender towards the player.
struct ToPlayer {
    batches: ClientBatches,
    out: SessionOut,
}

impl Source for ToPlayer {
    async fn send(&mut self, seq: u64) -> anyhow::Result<()> {
        self.out.send(self.batches.frame(seq)).await
    }
}

// ------------------------------------------------------------------------------------ backend

#[derive(Debug, Clone, Copy)]
enum Framing {
    /// The gateway's side of a mesh link: frames for the client go in `ToClient`s.
    Mesh,
    /// Frames for the client straight on the connection, as a client reads them.
    Plain,
}

/// Where the backend writes one client's frames.
enum SessionOut {
    Plain(mpsc::Sender<Bytes>),
    Mesh {
        session_id: u64,
        link: mpsc::Sender<MeshMessage>,
    },
}

impl SessionOut {
    async fn send(&self, server_frame: Bytes) -> anyhow::Result<()> {
        let sent = match self {
            SessionOut::Plain(tx) => tx.send(server_frame).await.is_ok(),
            SessionOut::Mesh { session_id, link } => link
                .send(
                    Body::ToClient(ToClient {
                        session_id: *session_id,
                        server_frame,
                    })
                    .into(),
                )
                .await
                .is_ok(),
        };
        anyhow::ensure!(sent, "the backend's connection closed");
        Ok(())
    }
}

/// Records the latency of an input whose stamp says it is measured.
fn record_input(latency: &Mutex<Histogram<u64>>, payload: &[u8]) {
    let Some((sent, seq)) = read_stamp(payload) else {
        return;
    };
    if latency_measured(seq) {
        let now = super::game::now_ns();
        let _ = latency
            .lock()
            .expect("inputs lock")
            .record(now.saturating_sub(sent).max(1));
    }
}

/// The latency of the measured inputs a backend decoded.
type SharedInputs = Arc<Mutex<Histogram<u64>>>;

/// The gateway's part, reduced to what a client's traffic needs: a session starts with the
/// client's first input, after which its frames go out through [`Backend::sessions`].
struct Backend {
    addr: SocketAddr,
    sessions: mpsc::Receiver<SessionOut>,
    inputs: SharedInputs,
    accept: JoinHandle<()>,
}

impl Backend {
    async fn start(framing: Framing) -> anyhow::Result<Self> {
        Self::start_tls(framing, None).await
    }

    /// With `tls`, the gateway's side of the link takes mutual TLS first, as a sidecar does.
    async fn start_tls(
        framing: Framing,
        tls: Option<Arc<cellmesh_trust::MeshTls>>,
    ) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (sessions_tx, sessions) = mpsc::channel(16);
        let inputs = Arc::new(Mutex::new(nanos_histogram()));
        let accept = tokio::spawn({
            let inputs = inputs.clone();
            async move {
                while let Ok((stream, _)) = listener.accept().await {
                    let (sessions, inputs) = (sessions_tx.clone(), inputs.clone());
                    let tls = tls.clone();
                    tokio::spawn(async move {
                        let served = match framing {
                            Framing::Mesh => serve_mesh(stream, tls, sessions, inputs).await,
                            Framing::Plain => serve_plain(stream, sessions, inputs).await,
                        };
                        if let Err(e) = served {
                            tracing::debug!(error = %e, "bench backend connection ended");
                        }
                    });
                }
            }
        });
        Ok(Self {
            addr,
            sessions,
            inputs,
            accept,
        })
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn serve_plain(
    stream: TcpStream,
    sessions: mpsc::Sender<SessionOut>,
    inputs: SharedInputs,
) -> anyhow::Result<()> {
    stream.set_nodelay(true)?;
    let (r, w) = stream.into_split();
    let mut reader = FramedRead::new(r, FrameCodec::<ClientFrame>::default());
    let (tx, rx) = mpsc::channel(OUTBOX);
    let writer = tokio::spawn(write_plain(FramedWrite::new(w, FrameCodec::default()), rx));
    let mut start = Some(tx);
    while let Some(frame) = reader.next().await {
        for m in frame?.messages {
            let Some(client_message::Body::Input(i)) = m.body else {
                continue;
            };
            match start.take() {
                Some(tx) => sessions.send(SessionOut::Plain(tx)).await?,
                None => record_input(&inputs, &i.payload),
            }
        }
    }
    writer.abort();
    Ok(())
}

/// Writes everything queued, then flushes once (as the proxy writes to its clients).
async fn write_plain(
    mut writer: FramedWrite<OwnedWriteHalf, FrameCodec<ClientFrame>>,
    mut rx: mpsc::Receiver<Bytes>,
) -> anyhow::Result<()> {
    while let Some(frame) = rx.recv().await {
        writer.feed(RawFrame(frame)).await?;
        while let Ok(more) = rx.try_recv() {
            writer.feed(RawFrame(more)).await?;
        }
        SinkExt::<RawFrame>::flush(&mut writer).await?;
    }
    Ok(())
}

async fn serve_mesh(
    stream: TcpStream,
    tls: Option<Arc<cellmesh_trust::MeshTls>>,
    sessions: mpsc::Sender<SessionOut>,
    inputs: SharedInputs,
) -> anyhow::Result<()> {
    stream.set_nodelay(true)?;
    let stream = match tls {
        Some(tls) => tls.accept(stream).await.context("mesh TLS")?.0,
        None => cellmesh_trust::MeshStream::Plain(stream),
    };
    let (r, w) = tokio::io::split(stream);
    let mut reader = FramedRead::new(r, FrameCodec::<MeshFrame>::default());
    let mut writer = FramedWrite::new(w, FrameCodec::<MeshFrame>::default());
    let first = reader.next().await.context("closed before LinkHello")??;
    anyhow::ensure!(
        matches!(
            first.messages.first().and_then(|m| m.body.as_ref()),
            Some(Body::Hello(_))
        ),
        "expected LinkHello first"
    );
    writer
        .send(MeshFrame::one(Body::Hello(LinkHello {
            version: Some(ProtocolVersion::current()),
            role: PeerRole::Sidecar as i32,
            id: NODE.to_string(),
            geo: ProxyConfig::default().geo,
            partition_epoch: 1,
            node_id: NODE,
            lease_epoch: 1,
            world_geos: Vec::new(),
        })))
        .await?;
    let (link, rx) = mpsc::channel(OUTBOX);
    let writer = tokio::spawn(write_mesh(writer, rx));
    let world = WorldShape::default();
    let mut started = HashSet::new();
    let mut session_epoch = 0;
    while let Some(frame) = reader.next().await {
        for body in frame?.messages.into_iter().filter_map(|m| m.body) {
            match body {
                Body::Attach(a) => {
                    session_epoch += 1;
                    let attached = Attached {
                        session_id: a.session_id,
                        session_epoch,
                        gateway_node: NODE,
                        world_width: world.width,
                        world_height: world.height,
                        chunk_size: world.chunk_size,
                    };
                    link.send(Body::Attached(attached).into()).await?;
                }
                Body::Input(i) if started.insert(i.session_id) => {
                    let out = SessionOut::Mesh {
                        session_id: i.session_id,
                        link: link.clone(),
                    };
                    sessions.send(out).await?;
                }
                Body::Input(i) => record_input(&inputs, &i.payload),
                // Heartbeats, RTT reports, detaches.
                _ => {}
            }
        }
    }
    writer.abort();
    Ok(())
}

/// The mesh link's write loop: everything queued, then one flush; a heartbeat every second.
async fn write_mesh(
    mut writer: FramedWrite<
        tokio::io::WriteHalf<cellmesh_trust::MeshStream>,
        FrameCodec<MeshFrame>,
    >,
    mut rx: mpsc::Receiver<MeshMessage>,
) -> anyhow::Result<()> {
    let every = Duration::from_secs(1);
    let mut beat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            m = rx.recv() => {
                let Some(m) = m else { return Ok(()) };
                writer.feed(MeshFrame { messages: vec![m] }).await?;
                while let Ok(more) = rx.try_recv() {
                    writer.feed(MeshFrame { messages: vec![more] }).await?;
                }
                SinkExt::<MeshFrame>::flush(&mut writer).await?;
            }
            _ = beat.tick() => {
                writer
                    .send(MeshFrame::one(Body::Heartbeat(Heartbeat { sent_unix_ms: 0 })))
                    .await?;
            }
        }
    }
}

// ------------------------------------------------------------------------------------ proxy

/// A cellmesh proxy on a runtime of its own (one thread), attaching sessions to one gateway.
struct EdgeProxy {
    handle: ProxyHandle,
    secret: String,
    stop: CancellationToken,
    runtime: Option<Runtime>,
}

impl EdgeProxy {
    async fn start(gateway: SocketAddr) -> anyhow::Result<Self> {
        Self::start_tls(gateway, Default::default()).await
    }

    async fn start_tls(
        gateway: SocketAddr,
        mesh_tls: cellmesh_trust::MeshTlsConfig,
    ) -> anyhow::Result<Self> {
        let secret = format!("{:032x}", rand::random::<u128>());
        let cfg = ProxyConfig {
            mesh_tls,
            client_listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            gateways: vec![gateway.to_string()],
            token_secret: secret.clone(),
            drain_grace_ms: 0,
            drain_spread_ms: 0,
            ..ProxyConfig::default()
        };
        let stop = CancellationToken::new();
        let runtime = component_runtime("proxy")?;
        let handle = runtime
            .spawn(cellmesh_proxy::start(cfg, stop.child_token()))
            .await
            .context("the proxy task")?
            .context("starting the proxy")?;
        let proxy = Self {
            handle,
            secret,
            stop,
            runtime: Some(runtime),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !proxy.handle.admin.is_ready() {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the proxy's link to the backend did not come up within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(proxy)
    }

    fn client_addr(&self) -> String {
        self.handle.client_addr.to_string()
    }

    /// A login for `account`, valid for an hour.
    fn token(&self, account: &str) -> String {
        super::cluster::hour_token(&self.secret, account)
    }
}

impl Drop for EdgeProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_proto::edge::ServerFrame;
    use prost::Message;

    #[test]
    fn a_batch_decodes_as_a_server_frame_with_its_stamp_first() {
        let before = crate::load::game::now_ns();
        let frame = ServerFrame::decode(ClientBatches::new().frame(5)).unwrap();
        let Some(server_message::Body::Batch(b)) = frame.messages[0].body.as_ref() else {
            panic!("not a batch: {frame:?}");
        };
        assert_eq!((b.tick, b.deltas.len()), (5, ENTITIES));
        let (sent, seq) = batch_stamp(b).unwrap();
        assert!(sent >= before);
        assert_eq!(seq, 5);
        assert_eq!(batch_stamp(&Batch::default()), None);
    }
}
