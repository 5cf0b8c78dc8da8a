//! The local-protocol server: the game server's connection to its sidecar (README.md#how-a-game-server-adopts-the-local-protocol).
//!
//! One task per connection owns the socket. It checks the handshake and frame-level rules itself
//! (undecodable, oversize, unexpected first message, other major version: an `Error` frame, then
//! close), so bad input never reaches the node; everything else goes to the node in order. One
//! game is served at a time: the node refuses a second `Hello` with `ALREADY_CONNECTED`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cellmesh_proto::codec::FrameError;
use cellmesh_proto::local::{self, game_message, ErrorCode, GameFrame, GameMessage, SidecarFrame};
use cellmesh_proto::{PROTOCOL_MAJOR, PROTOCOL_MINOR};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::codec::MeteredCodec;
use super::{Event, GameHandle, GameOut, HELLO_TIMEOUT};
use crate::core::wire::error_kind;
use crate::core::Input;
use crate::metrics::{Metrics, Peer};

/// Longest a parting `Error` frame may take to write.
const PARTING_WRITE: Duration = Duration::from_secs(1);

pub(crate) enum GameListener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

#[derive(Clone)]
pub(crate) struct GameCtx {
    pub node: mpsc::Sender<Event>,
    pub metrics: Metrics,
    pub max_frame: usize,
    pub outbox_frames: usize,
    pub shutdown: CancellationToken,
    pub tasks: TaskTracker,
}

/// Accepts game connections until shutdown.
pub(crate) async fn accept_loop(listener: GameListener, ctx: GameCtx) {
    let next_conn = Arc::new(AtomicU64::new(1));
    loop {
        let conn = next_conn.fetch_add(1, Ordering::Relaxed);
        match &listener {
            GameListener::Tcp(l) => {
                let accepted = tokio::select! {
                    _ = ctx.shutdown.cancelled() => break,
                    r = l.accept() => r,
                };
                match accepted {
                    Ok((stream, peer)) => {
                        let _ = stream.set_nodelay(true);
                        tracing::debug!(conn, %peer, "game connection");
                        ctx.tasks.spawn(serve(stream, conn, ctx.clone()));
                    }
                    Err(e) => accept_failed(&e).await,
                }
            }
            GameListener::Unix(l, _) => {
                let accepted = tokio::select! {
                    _ = ctx.shutdown.cancelled() => break,
                    r = l.accept() => r,
                };
                match accepted {
                    Ok((stream, _)) => {
                        tracing::debug!(conn, "game connection (unix)");
                        ctx.tasks.spawn(serve(stream, conn, ctx.clone()));
                    }
                    Err(e) => accept_failed(&e).await,
                }
            }
        }
    }
    if let GameListener::Unix(_, path) = &listener {
        let _ = std::fs::remove_file(path);
    }
}

/// Out of file descriptors and the like: back off instead of spinning.
async fn accept_failed(e: &std::io::Error) {
    tracing::warn!(error = %e, "accepting a game connection failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

fn error(code: ErrorCode, detail: impl Into<String>) -> local::Error {
    local::Error {
        code: code as i32,
        detail: detail.into(),
        fatal: true,
        entity_id: 0,
    }
}

/// The fatal error for a frame the codec refused; `None` when the connection itself failed.
pub(crate) fn frame_error(e: &FrameError) -> Option<local::Error> {
    match e {
        FrameError::TooLarge { .. } => Some(error(ErrorCode::FrameTooLarge, e.to_string())),
        FrameError::Truncated { .. } | FrameError::Undecodable { .. } => {
            Some(error(ErrorCode::MalformedFrame, e.to_string()))
        }
        FrameError::Io(_) => None,
    }
}

fn message_name(body: &game_message::Body) -> &'static str {
    use game_message::Body as B;
    match body {
        B::Hello(_) => "Hello",
        B::Spawn(_) => "Spawn",
        B::Update(_) => "Update",
        B::Despawn(_) => "Despawn",
        B::Event(_) => "Event",
        B::Send(_) => "Send",
        B::ChunkEvent(_) => "ChunkEvent",
        B::Snapshot(_) => "Snapshot",
        B::Adopted(_) => "Adopted",
        B::Load(_) => "Load",
        B::TickEnd(_) => "TickEnd",
        B::Health(_) => "Health",
        B::ReserveIds(_) => "ReserveIds",
        B::CheckpointState(_) => "CheckpointState",
        B::Release(_) => "Release",
        B::Command(_) => "Command",
        B::CommandReply(_) => "CommandReply",
        B::Claim(_) => "Claim",
        B::ClaimRelease(_) => "ClaimRelease",
        B::DeclareSpawners(_) => "DeclareSpawners",
    }
}

/// Checks that a frame holds game messages at all: a frame of another protocol decodes as an
/// empty `GameFrame`, and a message type this sidecar does not know has no body.
pub(crate) fn check_frame(
    frame: GameFrame,
    expected: &str,
) -> Result<Vec<GameMessage>, local::Error> {
    if frame.messages.is_empty() {
        return Err(error(
            ErrorCode::UnexpectedMessage,
            format!("expected {expected}, got an empty frame (is this the local protocol?)"),
        ));
    }
    if let Some(i) = frame.messages.iter().position(|m| m.body.is_none()) {
        return Err(error(
            ErrorCode::UnexpectedMessage,
            format!("expected {expected}, got message {i} of a type this sidecar does not know"),
        ));
    }
    Ok(frame.messages)
}

/// Checks the first frame: `Hello` first, with this sidecar's major version.
pub(crate) fn check_hello(
    frame: GameFrame,
) -> Result<(local::Hello, Vec<GameMessage>), local::Error> {
    let mut messages = check_frame(frame, "Hello")?.into_iter();
    let first = messages
        .next()
        .and_then(|m| m.body)
        // Internal: `check_frame` refused an empty frame and bodiless messages with an error.
        .expect("check_frame: non-empty, bodies present");
    let hello = match first {
        game_message::Body::Hello(h) => h,
        other => {
            return Err(error(
                ErrorCode::UnexpectedMessage,
                format!(
                    "expected Hello as the first message, got {}",
                    message_name(&other)
                ),
            ))
        }
    };
    let ours = format!("sidecar speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}");
    match hello.version {
        None => Err(error(
            ErrorCode::VersionMismatch,
            format!("game sent no protocol version, {ours}"),
        )),
        Some(v) if v.major != PROTOCOL_MAJOR => Err(error(
            ErrorCode::VersionMismatch,
            format!("game speaks {}.{}, {ours}", v.major, v.minor),
        )),
        Some(_) => Ok((hello, messages.collect())),
    }
}

enum Ending {
    /// The peer closed or the node let go: nothing more to say.
    Quiet(String),
    /// Tell the game why, then close.
    Fatal(local::Error),
    /// The node closed the connection (and counted why); tell the game, then close.
    Killed(local::Error),
}

async fn serve<S>(stream: S, conn: u64, ctx: GameCtx)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    ctx.metrics.connected(Peer::Game);
    let (r, w) = tokio::io::split(stream);
    let mut reader = FramedRead::new(
        r,
        MeteredCodec::<GameFrame>::new(ctx.max_frame, &ctx.metrics, Peer::Game),
    );
    let mut writer = FramedWrite::new(
        w,
        MeteredCodec::<GameFrame>::new(ctx.max_frame, &ctx.metrics, Peer::Game),
    );
    let ending = session(&mut reader, &mut writer, conn, &ctx).await;
    let killed = matches!(ending, Ending::Killed(_));
    let reason = match ending {
        Ending::Quiet(reason) => reason,
        Ending::Fatal(err) | Ending::Killed(err) => {
            if !killed {
                ctx.metrics.error(error_kind(
                    ErrorCode::try_from(err.code).unwrap_or(ErrorCode::ErrorUnspecified),
                ));
            }
            tracing::info!(conn, detail = %err.detail, "closing the game connection");
            let reason = err.detail.clone();
            let frame = SidecarFrame {
                messages: vec![local::sidecar_message::Body::Error(err).into()],
            };
            let _ = tokio::time::timeout(PARTING_WRITE, writer.send(frame)).await;
            reason
        }
    };
    let _ = ctx
        .node
        .send(Event::Core(Input::GameClosed { conn, reason }))
        .await;
    let _ = tokio::time::timeout(PARTING_WRITE, writer.get_mut().shutdown()).await;
    ctx.metrics.disconnected(Peer::Game);
}

type Reader<R> = FramedRead<R, MeteredCodec<GameFrame>>;
type Writer<W> = FramedWrite<W, MeteredCodec<GameFrame>>;

async fn session<R, W>(
    reader: &mut Reader<R>,
    writer: &mut Writer<W>,
    conn: u64,
    ctx: &GameCtx,
) -> Ending
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let first = tokio::select! {
        _ = ctx.shutdown.cancelled() => return Ending::Quiet("sidecar shutting down".into()),
        _ = tokio::time::sleep(HELLO_TIMEOUT) => {
            return Ending::Fatal(error(ErrorCode::UnexpectedMessage, format!("expected Hello within {} s", HELLO_TIMEOUT.as_secs())));
        }
        f = reader.next() => f,
    };
    let (hello, rest) = match first {
        None => return Ending::Quiet("closed before Hello".into()),
        Some(Err(e)) => return ending_for(&e),
        Some(Ok(frame)) => match check_hello(frame) {
            Ok(x) => x,
            Err(e) => return Ending::Fatal(e),
        },
    };
    let (outbox, mut queue) = mpsc::channel(ctx.outbox_frames);
    let kill = CancellationToken::new();
    let handle = GameHandle {
        outbox,
        kill: kill.clone(),
    };
    if ctx
        .node
        .send(Event::GameHello {
            conn,
            hello,
            rest,
            handle,
        })
        .await
        .is_err()
    {
        return Ending::Quiet("sidecar shutting down".into());
    }
    loop {
        tokio::select! {
            biased;
            _ = kill.cancelled() => {
                return Ending::Killed(local::Error {
                    code: ErrorCode::ErrorUnspecified as i32,
                    detail: format!("the game did not read its messages ({} frames queued); disconnecting", ctx.outbox_frames),
                    fatal: true,
                    entity_id: 0,
                });
            }
            out = queue.recv() => match out {
                Some(GameOut::Frame(frame)) => {
                    let written = async {
                        writer.feed(frame).await?;
                        // Whatever else is queued goes out in the same write.
                        let mut fatal = None;
                        while let Ok(more) = queue.try_recv() {
                            match more {
                                GameOut::Frame(f) => writer.feed(f).await?,
                                GameOut::Fatal(e) => {
                                    fatal = Some(e);
                                    break;
                                }
                            }
                        }
                        SinkExt::<SidecarFrame>::flush(writer).await.map(|()| fatal)
                    };
                    let r = tokio::select! {
                        r = written => r,
                        _ = kill.cancelled() => continue,
                    };
                    match r {
                        Ok(None) => {}
                        Ok(Some(err)) => return Ending::Fatal(err),
                        Err(e) => return Ending::Quiet(format!("writing to the game failed: {e}")),
                    }
                }
                Some(GameOut::Fatal(err)) => return Ending::Fatal(err),
                None => return Ending::Quiet("sidecar let go of the game".into()),
            },
            f = reader.next() => match f {
                None => return Ending::Quiet("game closed the connection".into()),
                Some(Err(e)) => return ending_for(&e),
                Some(Ok(frame)) => match check_frame(frame, "game messages") {
                    Ok(messages) => {
                        if ctx.node.send(Event::Core(Input::GameFrame { conn, messages })).await.is_err() {
                            return Ending::Quiet("sidecar shutting down".into());
                        }
                    }
                    Err(e) => return Ending::Fatal(e),
                },
            },
        }
    }
}

fn ending_for(e: &FrameError) -> Ending {
    match frame_error(e) {
        Some(err) => Ending::Fatal(err),
        None => Ending::Quiet(format!("connection failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_proto::local::{game_message::Body, Hello, ProtocolVersion, TickEnd};

    fn frame(bodies: Vec<Body>) -> GameFrame {
        GameFrame {
            messages: bodies.into_iter().map(Into::into).collect(),
        }
    }

    fn hello(major: u32, minor: u32) -> Body {
        Body::Hello(Hello {
            version: Some(ProtocolVersion { major, minor }),
            tick_rate_hz: 20,
            game: "g".into(),
        })
    }

    #[test]
    fn hello_first_with_the_same_major() {
        let (h, rest) =
            check_hello(frame(vec![hello(1, 7), Body::TickEnd(TickEnd { tick: 1 })])).unwrap();
        assert_eq!(h.game, "g");
        assert_eq!(rest.len(), 1, "what follows Hello in its frame is kept");
    }

    #[test]
    fn other_major_names_both_versions() {
        let e = check_hello(frame(vec![hello(2, 0)])).unwrap_err();
        assert_eq!((e.code, e.fatal), (ErrorCode::VersionMismatch as i32, true));
        assert_eq!(
            e.detail,
            format!("game speaks 2.0, sidecar speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}")
        );
    }

    #[test]
    fn anything_else_first_is_named() {
        let e = check_hello(frame(vec![Body::TickEnd(TickEnd { tick: 1 })])).unwrap_err();
        assert_eq!(e.code, ErrorCode::UnexpectedMessage as i32);
        assert!(
            e.detail.contains("expected Hello") && e.detail.contains("TickEnd"),
            "{}",
            e.detail
        );
        let e = check_hello(GameFrame::default()).unwrap_err();
        assert!(e.detail.contains("empty frame"), "{}", e.detail);
        let e = check_hello(GameFrame {
            messages: vec![GameMessage { body: None }],
        })
        .unwrap_err();
        assert!(e.detail.contains("does not know"), "{}", e.detail);
    }

    #[test]
    fn frame_errors_map_to_codes() {
        let too_large = FrameError::TooLarge {
            len: 1 << 32,
            max: 1 << 20,
        };
        assert_eq!(
            frame_error(&too_large).unwrap().code,
            ErrorCode::FrameTooLarge as i32
        );
        let truncated = FrameError::Truncated { have: 3, need: 10 };
        assert_eq!(
            frame_error(&truncated).unwrap().code,
            ErrorCode::MalformedFrame as i32
        );
        assert!(frame_error(&FrameError::Io(std::io::ErrorKind::BrokenPipe.into())).is_none());
    }
}
