//! The edge client: what a player's client (or a bot, or a test) speaks to a geo-edge proxy.

use std::collections::VecDeque;

use futures::{SinkExt, StreamExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio_util::codec::{FramedRead, FramedWrite};

use crate::codec::{FrameCodec, FrameError};
use crate::edge::{
    client_message, server_message, ClientFrame, ClientHello, ClientInput, CookieResponse, Kick,
    Pong, ProtocolVersion, ServerFrame, ServerMessage, Welcome,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("frame: {0}")]
    Frame(#[from] FrameError),
    #[error("kicked: {0:?}")]
    Kicked(Kick),
    #[error("proxy closed the connection")]
    Closed,
    #[error("unexpected first message from the proxy")]
    Unexpected,
}

pub struct ClientSender {
    sink: FramedWrite<OwnedWriteHalf, FrameCodec<ServerFrame>>,
}

pub struct ClientReceiver {
    stream: FramedRead<OwnedReadHalf, FrameCodec<ServerFrame>>,
    pending: VecDeque<ServerMessage>,
}

/// Opens a connection without logging in (for tests of what a proxy does with bad clients).
pub async fn open(addr: &str) -> Result<(ClientSender, ClientReceiver), ClientError> {
    let s = TcpStream::connect(addr)
        .await
        .map_err(ClientError::Connect)?;
    s.set_nodelay(true).map_err(ClientError::Connect)?;
    let (r, w) = s.into_split();
    Ok((
        ClientSender {
            sink: FramedWrite::new(w, FrameCodec::default()),
        },
        ClientReceiver {
            stream: FramedRead::new(r, FrameCodec::default()),
            pending: VecDeque::new(),
        },
    ))
}

/// Connects, logs in with `token`, and waits for `Welcome` (or the `Kick` that refused it).
pub async fn login(
    addr: &str,
    token: &str,
) -> Result<(ClientSender, ClientReceiver, Welcome), ClientError> {
    login_with(addr, &Login::token(token)).await
}

/// How a client logs in: its token, and the handover cookie of its last `Transfer`, if any.
#[derive(Debug, Clone, Default)]
pub struct Login {
    pub token: String,
    /// The cookie of the last `Transfer` (empty: none).
    pub cookie: Vec<u8>,
    /// Offer the cookie in the `ClientHello` rather than wait to be asked for it.
    pub offer_cookie: bool,
}

impl Login {
    pub fn token(token: &str) -> Self {
        Self {
            token: token.to_string(),
            ..Self::default()
        }
    }
}

/// [`login`] with a cookie: offered in the hello, or given when the proxy asks.
pub async fn login_with(
    addr: &str,
    login: &Login,
) -> Result<(ClientSender, ClientReceiver, Welcome), ClientError> {
    let (mut tx, mut rx) = open(addr).await?;
    tx.send(client_message::Body::Hello(Box::new(ClientHello {
        version: Some(ProtocolVersion::current()),
        token: login.token.clone(),
        cookie: if login.offer_cookie {
            login.cookie.clone().into()
        } else {
            Default::default()
        },
        probe_ticket: Default::default(),
    })))
    .await?;
    loop {
        match rx.next().await {
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::Welcome(w)),
            })) => return Ok((tx, rx, w)),
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::CookieRequest(_)),
            })) => {
                tx.send(client_message::Body::Cookie(CookieResponse {
                    cookie: login.cookie.clone().into(),
                }))
                .await?;
            }
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::Kick(k)),
            })) => return Err(ClientError::Kicked(k)),
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::Ping(p)),
            })) => {
                tx.send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                    .await?;
            }
            Some(Ok(_)) => return Err(ClientError::Unexpected),
            Some(Err(e)) => return Err(e),
            None => return Err(ClientError::Closed),
        }
    }
}

/// Answers an RTT probe another geo's proxy was asked for (`ProbeRequest`): connects to the
/// target, presents its ticket, and answers its pings, each after `pong_delay` (zero for an
/// honest client; tests delay to play a cheat), until the proxy closes. Returns the proxy's last
/// word (`Kick{PROBE_DONE}` with what it measured).
pub async fn answer_probe(
    target: &crate::edge::ProbeTarget,
    pong_delay: std::time::Duration,
) -> Result<Kick, ClientError> {
    let (mut tx, mut rx) = open(&format!("{}:{}", target.host, target.port)).await?;
    tx.send(client_message::Body::Hello(Box::new(ClientHello {
        version: Some(ProtocolVersion::current()),
        token: String::new(),
        cookie: Default::default(),
        probe_ticket: target.ticket.clone(),
    })))
    .await?;
    loop {
        match rx.next().await {
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::Ping(p)),
            })) => {
                if !pong_delay.is_zero() {
                    tokio::time::sleep(pong_delay).await;
                }
                tx.send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                    .await?;
            }
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::Kick(k)),
            })) => return Ok(k),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e),
            None => return Err(ClientError::Closed),
        }
    }
}

impl ClientSender {
    pub async fn send(&mut self, body: client_message::Body) -> Result<(), ClientError> {
        self.sink.send(ClientFrame::one(body)).await?;
        Ok(())
    }

    pub async fn send_frame(&mut self, frame: ClientFrame) -> Result<(), ClientError> {
        self.sink.send(frame).await?;
        Ok(())
    }

    pub async fn input(&mut self, seq: u64, payload: bytes::Bytes) -> Result<(), ClientError> {
        self.send(client_message::Body::Input(ClientInput { seq, payload }))
            .await
    }

    /// Raw bytes, for tests that send what no well-behaved client would.
    pub async fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt;
        let w = self.sink.get_mut();
        w.write_all(bytes).await?;
        w.flush().await
    }

    pub async fn close(mut self) -> Result<(), ClientError> {
        let _ = self
            .send(client_message::Body::Bye(Default::default()))
            .await;
        SinkExt::<ClientFrame>::close(&mut self.sink).await?;
        Ok(())
    }
}

impl ClientReceiver {
    /// The next message from the proxy; `None` once the proxy closed the connection.
    pub async fn next(&mut self) -> Option<Result<ServerMessage, ClientError>> {
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
