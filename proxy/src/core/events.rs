//! What the core saw or decided, for the log. The core only says it ([`Output::Event`]); the driver
//! writes the log line, with its own clock, and a simulator may keep or count it.
//!
//! [`Output::Event`]: super::Output::Event

use ::core::net::SocketAddr;
use std::sync::Arc;

use crate::HandoverCause;

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A handover cookie did not open; the gateway falls back to the player record.
    CookieRefused {
        account: Arc<str>,
        peer: SocketAddr,
        kind: &'static str,
    },
    /// A probe's RTT could not be published on the board for its origin geo.
    ProbePublishFailed {
        origin: String,
        account: Arc<str>,
        error: String,
    },
    /// A probe came with a ticket that did not open.
    ProbeRefused {
        peer: SocketAddr,
        why: String,
    },
    /// Every gateway was full: the login was refused with a retry-after.
    LoginRefusedFull {
        account: Arc<str>,
        peer: SocketAddr,
        retry_after_ms: u32,
    },
    SessionAttached {
        account: Arc<str>,
        session: u64,
        gateway: String,
        peer: SocketAddr,
    },
    /// A session whose gateway link was lost moves to another gateway; the client stays connected.
    SessionMoving {
        account: Arc<str>,
        why: String,
    },
    /// The handover was made: the client is told to reconnect to `geo`.
    HandingOver {
        account: Arc<str>,
        geo: String,
        because: HandoverCause,
    },
    HandoverFailed {
        account: Arc<str>,
        error: String,
    },
    /// The client got its transfer and was closed.
    ClientTransferred {
        peer: SocketAddr,
        geo: String,
        host: String,
        port: u32,
    },
    ClientLeft {
        peer: SocketAddr,
        why: String,
    },
    ClientKicked {
        peer: SocketAddr,
        reason: &'static str,
        detail: String,
    },
    DrainStarted {
        grace_ms: u64,
        spread_ms: u64,
    },
    /// A drain's grace ended: its clients are asked to reconnect, spread over the spread.
    DrainKicking {
        clients: usize,
    },
    /// A gateway link was lost with sessions on it (they move, see [`Event::SessionMoving`]).
    LinkLost {
        gateway: String,
        sessions: usize,
        error: String,
    },
    /// No gateway of this geo (`gateways`) is up, and a session went to a fallback gateway
    /// (another geo's): said for the first such session only, until a primary link is up again.
    FallbackInUse {
        /// Every primary is down: how many that is.
        primaries_down: usize,
        /// The fallback the first session went to.
        gateway: String,
    },
    /// A gateway of this geo has been back `fallback_return_ms`: the sessions on fallback
    /// gateways move home to it.
    ReturningHome {
        sessions: usize,
    },
    /// A gateway closed its admission (`Some(reason)`) or opened it again (`None`).
    GatewayAdmission {
        gateway: String,
        closed: Option<String>,
    },
    /// A well-framed message the proxy has no use for: counted and skipped.
    UnexpectedMessage {
        gateway: String,
        what: &'static str,
    },
}
