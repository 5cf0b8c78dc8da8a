//! One task per client connection: the socket and its codec, nothing else. It reads frames and
//! hands them to the driver, writes what the core says (a bounded queue: a client that stops
//! reading fills it, and the core kicks it), and closes as the core says: the last frame (a
//! `Kick` or a `Transfer`) written, then the connection read until the client closes too, so
//! that no reset destroys the last message in its receive buffer.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cellmesh_proto::codec::{FrameCodec, FrameError, RawFrame};
use cellmesh_proto::edge::{client_message, ClientFrame};
use cellmesh_trust::MeshStream;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{FramedRead, FramedWrite};

use super::driver::Event;
use super::Io;
use crate::connlimit::ConnectionPermit;
use crate::core::{ClientEnd, ConnId, Input};

/// How long a kicked client gets to receive its `Kick` before the socket is closed.
const KICK_LINGER: Duration = Duration::from_secs(1);
/// Frames written to a client before one flush.
const WRITE_BATCH: usize = 64;

/// What the driver sends a connection's task.
#[derive(Debug)]
pub(crate) enum ClientOut {
    Frames(Vec<Bytes>),
    /// Read the kernel's RTT figures and answer with [`Input::KernelRtt`].
    ReadKernelRtt,
}

/// How the driver reaches one connection's task.
#[derive(Debug)]
pub(crate) struct ClientHandle {
    /// Bounded at `client_outbox_frames`.
    pub out: mpsc::Sender<ClientOut>,
    /// The frame limit once the hello is admitted.
    pub admit: Option<oneshot::Sender<usize>>,
    /// The last frame, if any, and the close.
    pub close: Option<oneshot::Sender<Option<Bytes>>>,
}

/// A socket's descriptor, borrowed for as long as the connection that owns it lives.
#[derive(Clone, Copy)]
struct SocketFd(std::os::fd::RawFd);

impl std::os::fd::AsRawFd for SocketFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0
    }
}

type Reader = FramedRead<ReadHalf<MeshStream>, FrameCodec<ClientFrame>>;
type Writer = FramedWrite<WriteHalf<MeshStream>, FrameCodec<ClientFrame>>;

/// Serves one client connection to its end; `permit` holds its place under the connection limits.
pub(crate) async fn serve(
    io: Arc<Io>,
    stream: TcpStream,
    peer: SocketAddr,
    permit: ConnectionPermit,
) {
    let metrics = &io.metrics;
    metrics.connections.inc();
    metrics.connections_accepted.inc();
    let _ = stream.set_nodelay(true);
    let socket = SocketFd(std::os::fd::AsRawFd::as_raw_fd(&stream));
    let cfg = &io.cfg;
    let stream = match &io.client_tls {
        // The handshake is under the hello's deadline: a client that stalls it holds nothing
        // longer than one that stalls its hello.
        Some(tls) => match tokio::time::timeout(cfg.hello_timeout(), tls.accept(stream)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                metrics.error("client_tls_refused");
                tracing::debug!(%peer, error = %e, "client TLS handshake failed");
                metrics.connections.dec();
                return;
            }
            Err(_) => {
                metrics.error("client_tls_timeout");
                metrics.connections.dec();
                return;
            }
        },
        None => MeshStream::Plain(stream),
    };
    let conn = io.next_connection_id();
    let (out_tx, out_rx) = mpsc::channel(cfg.client_outbox_frames.max(1));
    let (admit_tx, admit_rx) = oneshot::channel();
    let (close_tx, close_rx) = oneshot::channel();
    let handle = ClientHandle {
        out: out_tx,
        admit: Some(admit_tx),
        close: Some(close_tx),
    };
    // Opened with the driver before anything is read, so its frames come after its opening.
    if io
        .events
        .send(Event::ClientOpened { conn, peer, handle })
        .await
        .is_ok()
    {
        let (r, w) = tokio::io::split(stream);
        let task = Connection {
            io: io.clone(),
            conn,
            socket,
            // Until the login is admitted a stranger may send only a small frame.
            reader: FramedRead::new(r, FrameCodec::with_max(cfg.hello_max_frame_bytes)),
            writer: FramedWrite::new(w, FrameCodec::with_max(cfg.max_frame_bytes)),
        };
        task.run(out_rx, admit_rx, close_rx).await;
    }
    io.metrics.connections.dec();
    drop(permit);
}

struct Connection {
    io: Arc<Io>,
    conn: ConnId,
    socket: SocketFd,
    reader: Reader,
    writer: Writer,
}

impl Connection {
    async fn run(
        mut self,
        mut out: mpsc::Receiver<ClientOut>,
        mut admit: oneshot::Receiver<usize>,
        mut close: oneshot::Receiver<Option<Bytes>>,
    ) {
        // The first frame is the hello: nothing more is read until the core says how large the
        // next ones may be (or closes the connection).
        let mut reading = true;
        let mut awaiting_admission = true;
        let mut first = true;
        loop {
            tokio::select! {
                // The close first: the driver drops the queue's sender as it closes.
                biased;
                last = &mut close => {
                    let last = last.unwrap_or(None);
                    return self.finish(&mut out, last).await;
                }
                max = &mut admit, if awaiting_admission && !first => {
                    awaiting_admission = false;
                    if let Ok(max) = max {
                        self.reader.decoder_mut().set_max_frame(max);
                        reading = true;
                    }
                }
                m = out.recv() => match m {
                    Some(ClientOut::Frames(frames)) => {
                        let mut batch = frames;
                        while batch.len() < WRITE_BATCH {
                            match out.try_recv() {
                                Ok(ClientOut::Frames(f)) => batch.extend(f),
                                Ok(ClientOut::ReadKernelRtt) => self.report_kernel_rtt(),
                                Err(_) => break,
                            }
                        }
                        tokio::select! {
                            written = self.write(batch) => {
                                if let Err(e) = written {
                                    // The reader sees the same broken stream; the core hears it once.
                                    tracing::debug!(conn = self.conn, error = %e, "write to client failed");
                                }
                            }
                            last = &mut close => {
                                // A client that stopped reading blocks only this write.
                                let last = last.unwrap_or(None);
                                return self.finish(&mut out, last).await;
                            }
                        }
                    }
                    Some(ClientOut::ReadKernelRtt) => self.report_kernel_rtt(),
                    // The driver forgot the connection: its close says how it ends (none: the
                    // proxy stopped).
                    None => {
                        let last = (&mut close).await.unwrap_or(None);
                        return self.finish(&mut out, last).await;
                    }
                },
                r = self.reader.next(), if reading => {
                    let ended = self.received(r).await;
                    if ended {
                        reading = false;
                    } else if first {
                        first = false;
                        reading = false;
                    }
                }
            }
        }
    }

    /// Hands a read to the driver; true if the stream ended.
    async fn received(&mut self, read: Option<Result<ClientFrame, FrameError>>) -> bool {
        let metrics = &self.io.metrics;
        let input = match read {
            Some(Ok(frame)) => {
                metrics
                    .client_in
                    .frame(self.reader.decoder().last_frame_len());
                let has_pong = frame
                    .messages
                    .iter()
                    .any(|m| matches!(m.body, Some(client_message::Body::Pong(_))));
                let kernel_rtt = if has_pong { self.kernel_rtt() } else { None };
                let input = Input::ClientFrame {
                    conn: self.conn,
                    frame,
                    kernel_rtt,
                };
                return self.io.events.send(Event::Core(input)).await.is_err();
            }
            Some(Err(FrameError::Io(e))) => ClientEnd::Io(e.to_string()),
            Some(Err(e)) => ClientEnd::Malformed {
                kind: e.kind(),
                detail: e.to_string(),
            },
            None => ClientEnd::Disconnected,
        };
        let _ = self
            .io
            .events
            .send(Event::Core(Input::ClientEnded {
                conn: self.conn,
                end: input,
            }))
            .await;
        true
    }

    /// The kernel's RTT figures of this connection, unless the config turns them off.
    fn kernel_rtt(&self) -> Option<crate::tcpinfo::KernelRtt> {
        self.io
            .cfg
            .geos
            .kernel_rtt
            .then(|| crate::tcpinfo::kernel_rtt(&self.socket))
            .flatten()
    }

    fn report_kernel_rtt(&self) {
        let input = Input::KernelRtt {
            conn: self.conn,
            rtt: self.kernel_rtt(),
        };
        // Never waits: the driver's queue has room for what its own request caused, and a
        // full one costs the probe its kernel figure only (the core answers on its deadline).
        let _ = self.io.events.try_send(Event::Core(input));
    }

    /// Writes encoded `ServerFrame`s and flushes once.
    async fn write(&mut self, frames: Vec<Bytes>) -> Result<(), FrameError> {
        let metrics = &self.io.metrics;
        let max = self.io.cfg.max_frame_bytes;
        for f in frames {
            if f.len() > max {
                metrics.error("frame_too_large_out");
                continue;
            }
            metrics.client_out.frame(f.len());
            self.writer.feed(RawFrame(f)).await?;
        }
        SinkExt::<RawFrame>::flush(&mut self.writer).await
    }

    /// What was queued, then the last frame; then the connection read until the client closes
    /// too, all within [`KICK_LINGER`]. Without a last frame (the client left), it just closes.
    async fn finish(self, out: &mut mpsc::Receiver<ClientOut>, last: Option<Bytes>) {
        let Some(last) = last else {
            return;
        };
        let Self {
            io,
            reader,
            mut writer,
            ..
        } = self;
        let mut queued = Vec::new();
        while let Ok(m) = out.try_recv() {
            if let ClientOut::Frames(f) = m {
                queued.extend(f);
            }
        }
        let mut reader = reader.into_inner();
        let _ = tokio::time::timeout(KICK_LINGER, async {
            for f in queued.into_iter().chain([last]) {
                io.metrics.client_out.frame(f.len());
                writer.feed(RawFrame(f)).await?;
            }
            SinkExt::<RawFrame>::close(&mut writer).await?;
            // Closing with unread input would send a reset, which can destroy the last message
            // in the client's receive buffer: read until the client closes too.
            let mut sink = [0u8; 4096];
            while reader.read(&mut sink).await? > 0 {}
            Ok::<_, FrameError>(())
        })
        .await;
    }
}
