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
    game_message::Body, sidecar_message, GameFrame, GameMessage, Hello, ProtocolVersion,
    SidecarFrame, SidecarMessage, TickEnd, Welcome,
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
