//! The edge client: what a player's client (or a bot, or a test) speaks to a geo-edge proxy.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;

use futures::{SinkExt, StreamExt};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};
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
    #[error("TLS to the proxy: {0}")]
    Tls(std::io::Error),
    #[error("frame: {0}")]
    Frame(#[from] FrameError),
    #[error("kicked: {0:?}")]
    Kicked(Kick),
    #[error("proxy closed the connection")]
    Closed,
    #[error("unexpected first message from the proxy")]
    Unexpected,
    #[error("the login token cannot be used: {0}")]
    Token(#[from] crate::token::TokenError),
}

/// A connection to a proxy: TLS or plain TCP.
pub trait ClientIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> ClientIo for T {}
type Io = Box<dyn ClientIo>;

/// TLS to the proxies: the CA certificates their `client_tls` certificates chain to. The name
/// checked is the host of the address dialled (a DNS name or an IP address).
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientTls")
    }
}

impl ClientTls {
    /// Trusts the PEM certificates in `ca` (a file of one or more).
    pub fn from_ca_file(ca: &Path) -> Result<Self, String> {
        let certs = CertificateDer::pem_file_iter(ca)
            .and_then(|i| i.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("reading CA certificates {}: {e}", ca.display()))?;
        if certs.is_empty() {
            return Err(format!("{} holds no certificate", ca.display()));
        }
        let mut roots = rustls::RootCertStore::empty();
        for c in certs {
            roots
                .add(c)
                .map_err(|e| format!("CA certificate in {}: {e}", ca.display()))?;
        }
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// The handshake with the proxy at `addr`, checking its certificate against `server_name`
    /// (empty: the host of `addr`).
    async fn connect(
        &self,
        addr: &str,
        server_name: &str,
        tcp: TcpStream,
    ) -> Result<Io, ClientError> {
        let host = if server_name.is_empty() {
            host_of(addr)
        } else {
            server_name
        };
        let name = ServerName::try_from(host.to_owned()).map_err(|e| {
            ClientError::Tls(std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
        })?;
        let tls = tokio_rustls::TlsConnector::from(self.config.clone())
            .connect(name, tcp)
            .await
            .map_err(ClientError::Tls)?;
        Ok(Box::new(tls))
    }
}

/// The host of `host:port` (an IPv6 address without its brackets).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

pub struct ClientSender {
    sink: FramedWrite<WriteHalf<Io>, FrameCodec<ServerFrame>>,
}

pub struct ClientReceiver {
    stream: FramedRead<ReadHalf<Io>, FrameCodec<ServerFrame>>,
    pending: VecDeque<ServerMessage>,
}

/// Opens a plaintext connection without logging in (for tests of what a proxy does with bad
/// clients).
pub async fn open(addr: &str) -> Result<(ClientSender, ClientReceiver), ClientError> {
    open_with(addr, None).await
}

/// Opens a connection, over TLS with `tls`, without logging in.
pub async fn open_with(
    addr: &str,
    tls: Option<&ClientTls>,
) -> Result<(ClientSender, ClientReceiver), ClientError> {
    open_named(addr, tls, "").await
}

/// [`open_with`], checking the proxy's certificate against `server_name` (empty: the host of
/// `addr`), as a `Transfer` or a `ProbeTarget` names it.
pub async fn open_named(
    addr: &str,
    tls: Option<&ClientTls>,
    server_name: &str,
) -> Result<(ClientSender, ClientReceiver), ClientError> {
    let s = TcpStream::connect(addr)
        .await
        .map_err(ClientError::Connect)?;
    s.set_nodelay(true).map_err(ClientError::Connect)?;
    let io: Io = match tls {
        Some(tls) => tls.connect(addr, server_name, s).await?,
        None => Box::new(s),
    };
    let (r, w) = tokio::io::split(io);
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

/// Waits for the proxy's `Challenge` (answering pings meanwhile) and returns its nonce.
pub async fn challenge(
    tx: &mut ClientSender,
    rx: &mut ClientReceiver,
) -> Result<Vec<u8>, ClientError> {
    loop {
        match rx.next().await {
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::Challenge(c)),
            })) => return Ok(c.nonce.to_vec()),
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::Ping(p)),
            })) => {
                tx.send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                    .await?;
            }
            Some(Ok(ServerMessage {
                body: Some(server_message::Body::Kick(k)),
            })) => return Err(ClientError::Kicked(k)),
            Some(Ok(_)) => return Err(ClientError::Unexpected),
            Some(Err(e)) => return Err(e),
            None => return Err(ClientError::Closed),
        }
    }
}

/// The `ClientHello` of a login with `token` on a connection whose challenge was `nonce`.
pub fn login_hello(token: &str, nonce: &[u8]) -> Result<ClientHello, ClientError> {
    let (claim, proof) = crate::token::prove(token, nonce)?;
    Ok(ClientHello {
        version: Some(ProtocolVersion::current()),
        claim,
        proof: proof.to_vec().into(),
        ..Default::default()
    })
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
    /// TLS to the proxy (`None`: plaintext, for a proxy on loopback).
    pub tls: Option<ClientTls>,
    /// The name the proxy's certificate must carry (a `Transfer`'s `server_name`); empty: the
    /// host dialled.
    pub server_name: String,
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
    let (mut tx, mut rx) = open_named(addr, login.tls.as_ref(), &login.server_name).await?;
    let nonce = challenge(&mut tx, &mut rx).await?;
    let mut hello = login_hello(&login.token, &nonce)?;
    if login.offer_cookie {
        hello.cookie = login.cookie.clone().into();
    }
    tx.send(client_message::Body::Hello(Box::new(hello)))
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
    tls: Option<&ClientTls>,
) -> Result<Kick, ClientError> {
    let addr = format!("{}:{}", target.host, target.port);
    let (mut tx, mut rx) = open_named(&addr, tls, &target.server_name).await?;
    tx.send(client_message::Body::Hello(Box::new(ClientHello {
        version: Some(ProtocolVersion::current()),
        probe_ticket: target.ticket.clone(),
        ..Default::default()
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
