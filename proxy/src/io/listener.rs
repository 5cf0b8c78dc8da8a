//! Accepts clients: one task each, tracked so shutdown can wait for their kicks to go out.
//!
//! A connection over a connection limit gets no task of its own: a few bounded refusal tasks tell
//! it `Kick{OVERLOADED}`; past them, it is closed at once.

use std::sync::Arc;
use std::time::Duration;

use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::edge::{server_message, ClientFrame, Kick, KickReason, ServerFrame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::codec::Encoder;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{client, Io};
use crate::connlimit::Refusal;

/// First pause after a failed accept (e.g. out of file descriptors), doubling while it fails.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(10);
const ACCEPT_ERROR_PAUSE_MAX: Duration = Duration::from_secs(1);
/// Refused connections being told why at once; more are closed without a word.
const REFUSALS_AT_ONCE: usize = 64;
/// How long a refused client gets to read its kick.
const REFUSAL_LINGER: Duration = Duration::from_millis(500);

/// Accepts until `stop` is cancelled (the drain stops accepting before it asks anyone to leave).
pub(crate) async fn run(
    listener: TcpListener,
    io: Arc<Io>,
    tasks: TaskTracker,
    stop: CancellationToken,
) {
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    let mut pause = ACCEPT_ERROR_PAUSE;
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                pause = ACCEPT_ERROR_PAUSE;
                match io.connections.admit(peer.ip()) {
                    Ok(permit) => {
                        tasks.spawn(client::serve(io.clone(), stream, peer, permit));
                    }
                    Err(refusal) => {
                        io.metrics.refused(refusal);
                        tracing::debug!(%peer, limit = refusal.label(), "connection refused");
                        if let Ok(slot) = refusals.clone().try_acquire_owned() {
                            tasks.spawn(async move {
                                refuse(stream, refusal).await;
                                drop(slot);
                            });
                        }
                    }
                }
            }
            Err(e) => {
                io.metrics.error("accept");
                if pause == ACCEPT_ERROR_PAUSE {
                    tracing::warn!(error = %e, "accepting a client failed; backing off");
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(ACCEPT_ERROR_PAUSE_MAX);
            }
        }
    }
}

/// Tells a refused client why, then closes without resetting the connection.
async fn refuse(mut stream: TcpStream, refusal: Refusal) {
    let kick = Kick::new(KickReason::Overloaded, refusal.detail());
    let mut frame = bytes::BytesMut::new();
    let encoded = FrameCodec::<ClientFrame>::default().encode(
        ServerFrame::one(server_message::Body::Kick(kick)),
        &mut frame,
    );
    if encoded.is_err() {
        return;
    }
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        stream.write_all(&frame).await?;
        stream.shutdown().await?;
        // Closing with the client's hello unread would reset the connection and could destroy the
        // kick in its receive buffer.
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}
