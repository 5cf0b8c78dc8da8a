//! The Rust SDK for game servers: connect to the sidecar (retrying, because the game often starts
//! first), send typed batches, receive typed messages, close cleanly.
//!
//! ```no_run
//! # async fn demo() -> Result<(), cellmesh_proto::sdk::SdkError> {
//! use cellmesh_proto::sdk::{connect, SdkConfig};
//! let (mut tx, mut rx, welcome) = connect(SdkConfig::tcp("127.0.0.1:7100", "my-game")).await?;
//! println!("node {}", welcome.node_id);
//! tx.end_tick(1).await?;
//! while let Some(msg) = rx.next().await {
//!     let _msg = msg?;
//! }
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::codec::{FrameCodec, FrameError};
use crate::local::{
    game_message::Body, sidecar_message, GameFrame, GameMessage, Hello, ProtocolVersion, Rect,
    SidecarFrame, SidecarMessage, TickEnd, TickPhase, Welcome, WorldShape,
};

/// Where the sidecar listens.
#[derive(Debug, Clone)]
pub enum SidecarAddr {
    Tcp(String),
    Unix(PathBuf),
}

#[derive(Debug, Clone)]
pub struct SdkConfig {
    pub addr: SidecarAddr,
    pub game: String,
    pub tick_rate_hz: u32,
    /// Give up connecting after this long (None: retry forever).
    pub connect_deadline: Option<Duration>,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub max_frame: usize,
}

impl SdkConfig {
    pub fn tcp(addr: impl Into<String>, game: impl Into<String>) -> Self {
        Self {
            addr: SidecarAddr::Tcp(addr.into()),
            game: game.into(),
            tick_rate_hz: 20,
            connect_deadline: Some(Duration::from_secs(60)),
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            max_frame: crate::codec::DEFAULT_MAX_FRAME,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SdkError {
    #[error("could not reach the sidecar at {addr} after {attempts} attempts: {last}")]
    Unreachable {
        addr: String,
        attempts: u32,
        last: std::io::Error,
    },
    #[error("frame: {0}")]
    Frame(#[from] FrameError),
    #[error("sidecar refused the game: {0}")]
    Refused(String),
    #[error("sidecar closed the connection")]
    Closed,
    #[error("sidecar answered the hello with something other than Welcome")]
    NoWelcome,
}

type BoxRead = Pin<Box<dyn AsyncRead + Send>>;
type BoxWrite = Pin<Box<dyn AsyncWrite + Send>>;

/// The sending half: collects messages into a batch, sent as one frame per flush.
pub struct GameSender {
    sink: FramedWrite<BoxWrite, FrameCodec<GameFrame>>,
    batch: Vec<GameMessage>,
}

/// The receiving half: one typed message at a time, in order.
pub struct GameReceiver {
    stream: FramedRead<BoxRead, FrameCodec<SidecarFrame>>,
    pending: VecDeque<SidecarMessage>,
}

async fn dial(addr: &SidecarAddr) -> std::io::Result<(BoxRead, BoxWrite)> {
    match addr {
        SidecarAddr::Tcp(a) => {
            let s = tokio::net::TcpStream::connect(a).await?;
            s.set_nodelay(true)?;
            let (r, w) = s.into_split();
            Ok((Box::pin(r), Box::pin(w)))
        }
        #[cfg(unix)]
        SidecarAddr::Unix(p) => {
            let s = tokio::net::UnixStream::connect(p).await?;
            let (r, w) = s.into_split();
            Ok((Box::pin(r), Box::pin(w)))
        }
        #[cfg(not(unix))]
        SidecarAddr::Unix(_) => Err(std::io::Error::other("unix sockets are not supported here")),
    }
}

/// Connects with exponential back-off, says `Hello`, and waits for `Welcome`.
pub async fn connect(cfg: SdkConfig) -> Result<(GameSender, GameReceiver, Welcome), SdkError> {
    let started = tokio::time::Instant::now();
    let mut backoff = cfg.initial_backoff;
    let mut attempts = 0u32;
    let (r, w) = loop {
        attempts += 1;
        match dial(&cfg.addr).await {
            Ok(rw) => break rw,
            Err(e) => {
                let out_of_time = cfg
                    .connect_deadline
                    .is_some_and(|d| started.elapsed() + backoff > d);
                if out_of_time {
                    return Err(SdkError::Unreachable {
                        addr: format!("{:?}", cfg.addr),
                        attempts,
                        last: e,
                    });
                }
                tracing::debug!(attempts, error = %e, "sidecar not reachable yet, retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(cfg.max_backoff);
            }
        }
    };
    let mut tx = GameSender {
        sink: FramedWrite::new(w, FrameCodec::with_max(cfg.max_frame)),
        batch: Vec::new(),
    };
    let mut rx = GameReceiver {
        stream: FramedRead::new(r, FrameCodec::with_max(cfg.max_frame)),
        pending: VecDeque::new(),
    };
    tx.push(Body::Hello(Hello {
        version: Some(ProtocolVersion::current()),
        tick_rate_hz: cfg.tick_rate_hz,
        game: cfg.game.clone(),
    }));
    tx.flush().await?;
    match rx.next().await {
        Some(Ok(SidecarMessage {
            body: Some(sidecar_message::Body::Welcome(w)),
        })) => Ok((tx, rx, w)),
        Some(Ok(SidecarMessage {
            body: Some(sidecar_message::Body::Error(e)),
        })) => Err(SdkError::Refused(e.detail)),
        Some(Ok(_)) => Err(SdkError::NoWelcome),
        Some(Err(e)) => Err(e),
        None => Err(SdkError::Closed),
    }
}

impl GameSender {
    /// Adds a message to the current batch.
    pub fn push(&mut self, body: Body) {
        self.batch.push(GameMessage { body: Some(body) });
    }

    /// Messages waiting for the next flush.
    pub fn pending(&self) -> usize {
        self.batch.len()
    }

    /// Sends the current batch as one frame (one syscall), if it holds anything.
    pub async fn flush(&mut self) -> Result<(), SdkError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let frame = GameFrame {
            messages: std::mem::take(&mut self.batch),
        };
        self.sink.send(frame).await?;
        Ok(())
    }

    /// Ends the tick: appends `TickEnd` and flushes the batch.
    pub async fn end_tick(&mut self, tick: u64) -> Result<(), SdkError> {
        self.push(Body::TickEnd(TickEnd { tick }));
        self.flush().await
    }

    /// Flushes what is pending and shuts the connection down for writing.
    pub async fn close(mut self) -> Result<(), SdkError> {
        self.flush().await?;
        SinkExt::<GameFrame>::close(&mut self.sink).await?;
        Ok(())
    }
}

impl GameReceiver {
    /// The next message from the sidecar; `None` when the sidecar closed the connection.
    pub async fn next(&mut self) -> Option<Result<SidecarMessage, SdkError>> {
        loop {
            if let Some(m) = self.pending.pop_front() {
                return Some(Ok(m));
            }
            match self.stream.next().await? {
                Ok(frame) => self.pending.extend(frame.messages),
                Err(e) => return Some(Err(e.into())),
            }
        }
    }
}

/// The game's owned area as its sidecar last described it (`Welcome`, then `PartitionChanged`),
/// and the rule the sidecar hands entities over by: an entity is due for a `Release` once it
/// stands more than `margin_chunks` whole chunks past the area's edge (the world wraps around).
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedArea {
    world: WorldShape,
    rects: Vec<Rect>,
    margin_chunks: i64,
}

impl OwnedArea {
    pub fn from_welcome(welcome: &Welcome) -> Self {
        Self {
            world: welcome.world.unwrap_or_default(),
            rects: welcome.owned_area.clone(),
            margin_chunks: i64::from(welcome.handoff_margin_chunks),
        }
    }

    /// The area after a `PartitionChanged`.
    pub fn set_rects(&mut self, rects: Vec<Rect>) {
        self.rects = rects;
    }

    /// Whether an entity at `(x, y)` has left the area far enough to be released. With no world
    /// shape (an older sidecar) or no area at all (everything given away) nothing is: the
    /// sidecar's `Freeze` does it all.
    pub fn release_due(&self, x: f64, y: f64) -> bool {
        self.chunks_outside(x, y)
            .is_some_and(|d| d > self.margin_chunks)
    }

    /// Whole chunks from the chunk holding `(x, y)` to the nearest chunk of the area (0 inside,
    /// 1 in the first chunk past the edge); `None` without a world shape or an area.
    pub fn chunks_outside(&self, x: f64, y: f64) -> Option<i64> {
        let c = self.world.chunk_size;
        if c <= 0.0 || self.world.width <= 0.0 || self.world.height <= 0.0 {
            return None;
        }
        let (nx, ny) = (
            (self.world.width / c).round() as i64,
            (self.world.height / c).round() as i64,
        );
        let cx = ((x / c).floor() as i64).rem_euclid(nx.max(1));
        let cy = ((y / c).floor() as i64).rem_euclid(ny.max(1));
        // The nearest copy of the chunk across the world's seams, axis by axis.
        let axis = |a0: i64, a1: i64, b: i64, n: i64| {
            let k = (a0 - b).div_euclid(n.max(1));
            (k - 1..=k + 2)
                .map(|k| {
                    let b = b + k * n;
                    0.max(b - a1 + 1).max(a0 - b)
                })
                .min()
                .unwrap_or(0)
        };
        self.rects
            .iter()
            .map(|r| {
                let (x0, y0) = ((r.x / c).round() as i64, (r.y / c).round() as i64);
                let (x1, y1) = (
                    ((r.x + r.width) / c).round() as i64,
                    ((r.y + r.height) / c).round() as i64,
                );
                axis(x0, x1, cx, nx).max(axis(y0, y1, cy, ny))
            })
            .min()
    }
}

/// The world's common tick clock (`Welcome.tick_phase`): tick `k` starts at
/// `origin + k / rate` on the wall clock, the same instant on every node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickClock {
    origin_unix_ms: u64,
    rate_hz: u32,
}

impl TickClock {
    /// The sidecar's phase; an older sidecar sends none, and the game's own rate from the Unix
    /// epoch is the best guess (what this SDK's sidecars send by default).
    pub fn from_welcome(welcome: &Welcome, own_rate_hz: u32) -> Self {
        let TickPhase {
            origin_unix_ms,
            tick_rate_hz,
        } = welcome.tick_phase.unwrap_or(TickPhase {
            origin_unix_ms: 0,
            tick_rate_hz: own_rate_hz,
        });
        Self {
            origin_unix_ms,
            rate_hz: if tick_rate_hz > 0 {
                tick_rate_hz
            } else {
                own_rate_hz.max(1)
            },
        }
    }

    pub fn rate_hz(&self) -> u32 {
        self.rate_hz
    }

    /// When tick `k` starts, in microseconds since the Unix epoch.
    pub fn start_us(&self, k: u64) -> u64 {
        self.origin_unix_ms * 1_000 + k * 1_000_000 / u64::from(self.rate_hz)
    }

    /// The first tick that starts at or after `now_us` (microseconds since the Unix epoch), and
    /// how long until it does.
    pub fn next_tick(&self, now_us: u64) -> (u64, Duration) {
        let since = now_us.saturating_sub(self.origin_unix_ms * 1_000);
        let mut k = since * u64::from(self.rate_hz) / 1_000_000;
        while self.start_us(k) < now_us {
            k += 1;
        }
        (k, Duration::from_micros(self.start_us(k) - now_us))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn welcome(rects: Vec<Rect>, margin: u32) -> Welcome {
        Welcome {
            world: Some(WorldShape {
                width: 1024.0,
                height: 1024.0,
                chunk_size: 32.0,
                region_size: 128.0,
            }),
            owned_area: rects,
            handoff_margin_chunks: margin,
            ..Default::default()
        }
    }

    fn west_half() -> Rect {
        Rect {
            x: 0.0,
            y: 0.0,
            width: 512.0,
            height: 1024.0,
        }
    }

    #[test]
    fn an_entity_is_due_for_release_past_the_margin_only() {
        let area = OwnedArea::from_welcome(&welcome(vec![west_half()], 1));
        assert_eq!(area.chunks_outside(100.0, 100.0), Some(0));
        // The first chunk past the edge is 1 away: a centimetre over the line.
        assert_eq!(area.chunks_outside(512.01, 100.0), Some(1));
        assert!(!area.release_due(512.01, 100.0));
        assert!(!area.release_due(543.9, 100.0));
        assert!(area.release_due(544.0, 100.0));
        // Across the seam on the other side: x = 1000 is 1 chunk from x = 0.
        assert_eq!(area.chunks_outside(1000.0, 100.0), Some(1));
        assert!(area.release_due(950.0, 100.0));
    }

    #[test]
    fn a_partition_change_moves_the_line_and_no_world_releases_nothing() {
        let mut area = OwnedArea::from_welcome(&welcome(vec![west_half()], 0));
        assert!(area.release_due(600.0, 10.0));
        area.set_rects(vec![Rect {
            x: 0.0,
            y: 0.0,
            width: 1024.0,
            height: 1024.0,
        }]);
        assert!(!area.release_due(600.0, 10.0));
        area.set_rects(vec![]);
        assert!(
            !area.release_due(600.0, 10.0),
            "no area: left to the sidecar"
        );
        assert!(!OwnedArea::from_welcome(&Welcome::default()).release_due(600.0, 10.0));
    }

    #[test]
    fn ticks_start_at_the_same_instants_for_every_game() {
        let w = Welcome {
            tick_phase: Some(TickPhase {
                origin_unix_ms: 1_000,
                tick_rate_hz: 30,
            }),
            ..Default::default()
        };
        let clock = TickClock::from_welcome(&w, 20);
        assert_eq!(clock.rate_hz(), 30);
        assert_eq!(clock.start_us(0), 1_000_000);
        assert_eq!(clock.start_us(3), 1_100_000);
        // Between ticks 1 and 2: tick 2, at 1_066_666 us.
        let (k, wait) = clock.next_tick(1_050_000);
        assert_eq!((k, wait), (2, Duration::from_micros(16_666)));
        // On a tick's start: that tick, now.
        assert_eq!(clock.next_tick(1_100_000), (3, Duration::ZERO));
        // No phase from an older sidecar: the game's rate from the Unix epoch.
        let old = TickClock::from_welcome(&Welcome::default(), 20);
        assert_eq!(
            old.next_tick(1_234_567),
            (25, Duration::from_micros(15_433))
        );
    }
}
