//! `transport`: ghost frames from one sidecar to another over the direct mesh link, against the
//! same frames through Redis pub/sub (the per-geo Redis bus of seed 002), in the same run.
//!
//! This measures the transport, not the nodes around it. Both paths carry the same frames: a
//! `MeshFrame` of [`ENTITIES`] `EntityState` deltas (a moved position and a 32-byte public
//! component each, as an owner sends one tick's changes to a subscriber), the first component
//! stamped when the frame is built. The sending side queues frames in a bounded outbox as the
//! sidecar's node does for a link, and a writer task empties it:
//!
//! - **direct**: the mesh link's write loop (encode every queued frame with the mesh codec, a
//!   4-byte length and the protobuf body, then flush once) on a loopback TCP connection with
//!   `TCP_NODELAY`, as mesh links are; the far side decodes the stream with the same codec.
//! - **redis**: each queued frame, framed by the same codec, is PUBLISHed to the receiving node's
//!   channel; everything queued goes in one pipeline, and several pipelines may await their
//!   replies, so the publisher never waits a round trip per frame. A second connection
//!   SUBSCRIBEd to the channel decodes each message with the same codec.
//!
//! Both ends of both paths run in this process on the bench's runtime; Redis is a
//! `redis-server` of its own (or `--redis`). The sidecars' own link tasks are not driven: they
//! are private to the sidecar crate and live inside a whole node, whose routing would be
//! measured with them (`hop` does that); what is shared with them is the framing, the codec,
//! the frame types and the write pattern.
//!
//! Both paths stay open for the whole run and are measured in alternating rounds
//! ([`phases`]). Latency: frames at a fixed rate, from the stamp to the frame decoded.
//! Throughput: frames as fast as the path takes them, counted by the receiver, with at most
//! [`WINDOW`] in flight on either path (Redis disconnects a subscriber that falls too far
//! behind instead of slowing the publisher).

use std::future::Future;
use std::time::Duration;

use anyhow::{anyhow, Context};
use bytes::BytesMut;
use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::mesh::{
    mesh_message::Body, EntityState, MeshFrame, MeshMessage, MeshVec3, PublicComponent,
};
use futures::stream::FuturesUnordered;
use futures::{SinkExt, StreamExt};
use prost::Message;
use redis::aio::{MultiplexedConnection, PubSubSink, PubSubStream};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::codec::{Decoder, Encoder, FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;

use super::external::start_redis;
use super::game::{read_stamp, stamped, STAMPED};
use super::phases::{self, alternate, Flow, Round, Sender, Sent, Source, Tally};
use super::report::ratio;
use super::Options;

/// Entities in one frame: one tick's changes an owner sends one subscriber.
const ENTITIES: usize = 16;
/// Frames a second in the latency phase.
const RATE: u32 = 1000;
/// Frames at most in flight while sending as fast as possible.
const WINDOW: u64 = 2048;
/// Frames queued for the writer: the sidecar's default link outbox.
const OUTBOX: usize = 8192;
/// PUBLISHes in one pipeline at most.
const PIPELINE: usize = 256;
/// Pipelines awaiting their replies at most.
const PIPELINES_IN_FLIGHT: usize = 8;

pub async fn run(opts: &Options) -> anyhow::Result<Value> {
    let (rounds, warm_up) = if opts.quick {
        (2, Duration::from_millis(250))
    } else {
        (4, Duration::from_millis(500))
    };
    let round = Round::of(rounds, RATE, warm_up, opts.measure_for());
    // Started first: without Redis there is no comparison to make.
    let (url, _server) = match &opts.redis_url {
        Some(url) => (url.clone(), None),
        None => {
            let server = start_redis().await?;
            (server.url.clone(), Some(server))
        }
    };
    let frame_bytes = framed_len(&GhostFrames::new().frame(1));

    let mut direct = direct_link().await.context("opening the direct link")?;
    let mut redis = redis_pubsub(&url).await.context("connecting to Redis")?;
    alternate(rounds, &round, &mut direct.sender, &mut redis.sender).await?;
    let direct = direct.finish().await.context("the direct link")?;
    let redis = redis.finish().await.context("Redis pub/sub")?;

    let (d, r) = (direct.tally.latency(), redis.tally.latency());
    let (d_per_s, r_per_s) = (
        direct.tally.throughput_per_s(&direct.sent),
        redis.tally.throughput_per_s(&redis.sent),
    );
    Ok(json!({
        "offered_per_s": RATE,
        "entities_per_frame": ENTITIES,
        "frame_bytes": frame_bytes,
        "window_frames": WINDOW,
        "rounds": rounds,
        "redis_started_by_bench": opts.redis_url.is_none(),
        "cellmesh": { "direct_link": direct.figures(frame_bytes) },
        "baseline": { "redis_pubsub": redis.figures(frame_bytes) },
        "ratio": {
            "p50_direct_over_redis": ratio(d.p50_us, r.p50_us),
            "p99_direct_over_redis": ratio(d.p99_us, r.p99_us),
            "p999_direct_over_redis": ratio(d.p999_us, r.p999_us),
            "throughput_direct_over_redis": ratio(d_per_s, r_per_s),
        },
    }))
}

/// Ghost frames: the first entity's component stamped anew for each frame, the others' built
/// once (their bytes cost the same either way).
struct GhostFrames {
    others: Vec<MeshMessage>,
}

impl GhostFrames {
    fn new() -> Self {
        Self {
            others: (2..=ENTITIES as u64)
                .map(|id| entity_state(id, crate::payload(id)))
                .collect(),
        }
    }

    /// Frame `seq`, stamped now.
    fn frame(&self, seq: u64) -> MeshFrame {
        let mut messages = Vec::with_capacity(ENTITIES);
        messages.push(entity_state(1, stamped(crate::PAYLOAD, seq)));
        messages.extend(self.others.iter().cloned());
        MeshFrame { messages }
    }
}

fn entity_state(id: u64, payload: bytes::Bytes) -> MeshMessage {
    Body::EntityState(EntityState {
        entity_id: id,
        entity_epoch: 1,
        full: false,
        position: Some(MeshVec3 {
            x: 8000.0 + id as f64,
            y: 1000.0 + id as f64,
            z: 0.0,
        }),
        components: vec![PublicComponent {
            r#type: STAMPED,
            payload,
        }],
        ..Default::default()
    })
    .into()
}

/// The stamp of a ghost frame, `(sent_ns, seq)`: its first entity's component's.
fn stamp_of(frame: &MeshFrame) -> Option<(u64, u64)> {
    let Some(Body::EntityState(s)) = frame.messages.first()?.body.as_ref() else {
        return None;
    };
    read_stamp(&s.components.first()?.payload)
}

/// Bytes of `frame` on the wire: length prefix and body.
fn framed_len(frame: &MeshFrame) -> usize {
    4 + frame.encoded_len()
}

/// The sending node's side: frames go to the writer's outbox.
struct Outbox {
    frames: GhostFrames,
    tx: mpsc::Sender<MeshFrame>,
}

impl Source for Outbox {
    async fn send(&mut self, seq: u64) -> anyhow::Result<()> {
        self.tx
            .send(self.frames.frame(seq))
            .await
            .map_err(|_| anyhow!("the writer stopped"))
    }
}

/// One path, open: its sender, the task writing what it sends, and the task receiving it.
struct OpenPath {
    sender: Sender<Outbox>,
    writer: JoinHandle<anyhow::Result<()>>,
    receiver: JoinHandle<anyhow::Result<Tally>>,
    stop: CancellationToken,
}

struct PathRun {
    sent: Sent,
    tally: Tally,
}

impl PathRun {
    fn figures(&self, frame_bytes: usize) -> Value {
        phases::figures(&self.sent, &self.tally, frame_bytes)
    }
}

impl OpenPath {
    /// Opens a path whose writer empties the outbox it is given and whose receiver tallies
    /// frames until it is stopped.
    fn start<W, R>(
        name: &'static str,
        write: impl FnOnce(mpsc::Receiver<MeshFrame>) -> W,
        receive: impl FnOnce(Tally, CancellationToken) -> R,
    ) -> Self
    where
        W: Future<Output = anyhow::Result<()>> + Send + 'static,
        R: Future<Output = anyhow::Result<Tally>> + Send + 'static,
    {
        let flow = Flow::new(WINDOW);
        let (tx, rx) = mpsc::channel(OUTBOX);
        let stop = CancellationToken::new();
        let source = Outbox {
            frames: GhostFrames::new(),
            tx,
        };
        Self {
            sender: Sender::new(name, source, flow.clone()),
            writer: tokio::spawn(write(rx)),
            receiver: tokio::spawn(receive(Tally::new(flow), stop.clone())),
            stop,
        }
    }

    async fn finish(self) -> anyhow::Result<PathRun> {
        let sent = self.sender.sent();
        // The writer writes what is queued, then ends.
        drop(self.sender);
        let written = self.writer.await.context("the writer task");
        // What was written gets a moment to arrive.
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.stop.cancel();
        let tally = self.receiver.await.context("the receiver task")??;
        written??;
        anyhow::ensure!(
            tally.latency_frames() > 0,
            "no frame whose latency was measured arrived"
        );
        Ok(PathRun { sent, tally })
    }
}

async fn direct_link() -> anyhow::Result<OpenPath> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let (dialled, accepted) = tokio::join!(
        TcpStream::connect(listener.local_addr()?),
        listener.accept()
    );
    let (dialled, (accepted, _)) = (dialled?, accepted?);
    dialled.set_nodelay(true)?;
    accepted.set_nodelay(true)?;
    let writer = FramedWrite::new(dialled, FrameCodec::<MeshFrame>::default());
    let reader = FramedRead::new(accepted, FrameCodec::<MeshFrame>::default());
    Ok(OpenPath::start(
        "on the direct link",
        |outbox| write_link(writer, outbox),
        |tally, stop| read_link(reader, tally, stop),
    ))
}

/// The mesh link's write loop: everything queued, then one flush.
async fn write_link(
    mut writer: FramedWrite<TcpStream, FrameCodec<MeshFrame>>,
    mut outbox: mpsc::Receiver<MeshFrame>,
) -> anyhow::Result<()> {
    while let Some(frame) = outbox.recv().await {
        writer.feed(frame).await?;
        while let Ok(more) = outbox.try_recv() {
            writer.feed(more).await?;
        }
        SinkExt::<MeshFrame>::flush(&mut writer).await?;
    }
    Ok(())
}

async fn read_link(
    mut reader: FramedRead<TcpStream, FrameCodec<MeshFrame>>,
    mut tally: Tally,
    stop: CancellationToken,
) -> anyhow::Result<Tally> {
    loop {
        let frame = tokio::select! {
            _ = stop.cancelled() => break,
            f = reader.next() => f,
        };
        // The writer closes the link once it has written everything.
        let Some(frame) = frame else { break };
        if let Some(stamp) = stamp_of(&frame?) {
            tally.frame(stamp);
        }
    }
    Ok(tally)
}

async fn redis_pubsub(url: &str) -> anyhow::Result<OpenPath> {
    let client = redis::Client::open(url).context("the Redis URL")?;
    // Replies wait behind every PUBLISH queued before them: a generous bound, not the default.
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    let publisher = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .context("connecting the publisher")?;
    let (mut sink, messages) = client
        .get_async_pubsub()
        .await
        .context("connecting the subscriber")?
        .split();
    // The receiving node's channel, unique to this run in case the Redis is shared.
    let channel = format!("cellmesh-bench:{:016x}:node-2", rand::random::<u64>());
    sink.subscribe(&channel).await.context("SUBSCRIBE")?;
    Ok(OpenPath::start(
        "through Redis",
        |outbox| publish(publisher, channel, outbox),
        |tally, stop| read_channel(sink, messages, tally, stop),
    ))
}

/// PUBLISHes every queued frame, framed by the mesh codec, in pipelines of what is queued.
async fn publish(
    conn: MultiplexedConnection,
    channel: String,
    mut outbox: mpsc::Receiver<MeshFrame>,
) -> anyhow::Result<()> {
    let mut codec = FrameCodec::<MeshFrame>::default();
    let mut replies = FuturesUnordered::new();
    let mut open = true;
    while open || !replies.is_empty() {
        tokio::select! {
            // Replies first: a pipeline is only sent once its future is polled.
            biased;
            Some(r) = replies.next(), if !replies.is_empty() => {
                let r: redis::RedisResult<()> = r;
                r.context("PUBLISH")?;
            }
            frame = outbox.recv(), if open && replies.len() < PIPELINES_IN_FLIGHT => {
                let Some(frame) = frame else {
                    open = false;
                    continue;
                };
                let mut pipe = redis::pipe();
                add_publish(&mut pipe, &mut codec, &channel, frame)?;
                while pipe.len() < PIPELINE {
                    let Ok(more) = outbox.try_recv() else { break };
                    add_publish(&mut pipe, &mut codec, &channel, more)?;
                }
                let mut conn = conn.clone();
                replies.push(async move { pipe.exec_async(&mut conn).await });
            }
        }
    }
    Ok(())
}

fn add_publish(
    pipe: &mut redis::Pipeline,
    codec: &mut FrameCodec<MeshFrame>,
    channel: &str,
    frame: MeshFrame,
) -> anyhow::Result<()> {
    let mut framed = BytesMut::new();
    codec.encode(frame, &mut framed)?;
    pipe.cmd("PUBLISH").arg(channel).arg(&framed[..]).ignore();
    Ok(())
}

async fn read_channel(
    // Held so the subscription lasts as long as the reading.
    _sink: PubSubSink,
    mut messages: PubSubStream,
    mut tally: Tally,
    stop: CancellationToken,
) -> anyhow::Result<Tally> {
    let mut codec = FrameCodec::<MeshFrame>::default();
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => break,
            m = messages.next() => m,
        };
        let Some(msg) = msg else {
            anyhow::bail!(
                "Redis ended the subscription (a subscriber past its output buffer limit is cut off)"
            )
        };
        let mut framed = BytesMut::from(msg.get_payload_bytes());
        let frame = codec
            .decode(&mut framed)?
            .context("a message shorter than the frame it announces")?;
        if let Some(stamp) = stamp_of(&frame) {
            tally.frame(stamp);
        }
    }
    Ok(tally)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ghost_frame_carries_its_stamp_through_the_mesh_codec() {
        let frame = GhostFrames::new().frame(9);
        assert_eq!(frame.messages.len(), ENTITIES);
        let stamp = stamp_of(&frame).unwrap();
        let mut wire = BytesMut::new();
        FrameCodec::<MeshFrame>::default()
            .encode(frame.clone(), &mut wire)
            .unwrap();
        assert_eq!(wire.len(), framed_len(&frame));
        let back = FrameCodec::<MeshFrame>::default()
            .decode(&mut wire)
            .unwrap()
            .unwrap();
        assert_eq!(stamp_of(&back), Some(stamp));
        assert_eq!(back, frame);
    }
}
