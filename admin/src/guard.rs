//! What stands between the network and an admin port: a bearer token on every path but the
//! probes', bounds on how long a connection may dawdle, and a cap on how many may be open.
//!
//! `/state` lists every account with its address and `/api/world` every avatar's position (and
//! costs reads of the topology store), so they are for operators only; `/live`, `/ready` and
//! `/metrics` stay open for the orchestrator's probes and the scraper.

use std::time::Duration;

/// How long a client has to send a request's head (request line and headers), counted from
/// when the server starts waiting for it: a client that stalls halfway is closed.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection that moves no byte either way for this long is closed (a keep-alive left open,
/// a client that stopped reading its answer).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections open at once; one more is closed as soon as it is accepted.
pub const MAX_CONNECTIONS: usize = 64;

/// The paths served without a token: the orchestrator's probes and the metrics scraper.
pub const OPEN_PATHS: [&str; 5] = ["/live", "/healthz", "/ready", "/readyz", "/metrics"];

/// The admin listener's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_read_timeout: HEADER_READ_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// Why a request was refused; its `reason` label and the body's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer …` header.
    MissingToken,
    /// A bearer token that is not the admin token (or an `Authorization` of another scheme).
    WrongToken,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::MissingToken => "missing_token",
            Refusal::WrongToken => "wrong_token",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Refusal::MissingToken => {
                "missing header: Authorization: Bearer <admin_token> (this path needs the admin token)\n"
            }
            Refusal::WrongToken => "the Authorization header does not carry the admin token\n",
        }
    }
}

/// Whether a request with the `Authorization` header `authorization` may be served by an admin
/// port whose token is `token` (empty: every request may); an `open` path (the probes', the
/// metrics, a page without data) always may.
pub fn check(token: &str, open: bool, authorization: Option<&[u8]>) -> Result<(), Refusal> {
    if token.is_empty() || open {
        return Ok(());
    }
    let Some(value) = authorization else {
        return Err(Refusal::MissingToken);
    };
    // The scheme is case-insensitive (RFC 9110 §11.1); the token is not.
    let presented = match value.split_at_checked(7) {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case(b"bearer ") => rest.trim_ascii(),
        _ => return Err(Refusal::WrongToken),
    };
    if constant_time_eq(presented, token.as_bytes()) {
        Ok(())
    } else {
        Err(Refusal::WrongToken)
    }
}

/// `a == b` in a time that depends on their lengths only, not on where they first differ: a
/// client timing its refusals learns nothing of the token's bytes.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let longest = a.len().max(b.len());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..longest {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    // Keeps the compiler from turning the loop into an early exit.
    std::hint::black_box(diff) == 0
}

/// Refuses an empty `admin_token` when `admin_listen` is reachable from other hosts, where
/// anyone could read `/state`.
pub fn require_token_off_loopback(admin_listen: &str, admin_token: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !admin_token.is_empty() || listens_on_loopback(admin_listen),
        "config: admin_token is empty and admin_listen {admin_listen} is reachable from other \
         hosts, where anyone could read every account's address: set admin_token (or \
         CELLMESH_ADMIN_TOKEN), or bind admin_listen to 127.0.0.1"
    );
    Ok(())
}

/// Whether `listen` (`host:port`) only accepts connections from this host. A name other than
/// `localhost` may resolve anywhere, so it counts as reachable.
pub fn listens_on_loopback(listen: &str) -> bool {
    if let Ok(addr) = listen.parse::<std::net::SocketAddr>() {
        return addr.ip().is_loopback();
    }
    listen
        .rsplit_once(':')
        .is_some_and(|(host, _)| host.eq_ignore_ascii_case("localhost"))
}

/// The admin token as a configuration is shown (`--print-config`, `/state`): `***` when set.
pub fn shown_token(token: &str) -> String {
    if token.is_empty() {
        String::new()
    } else {
        "***".into()
    }
}

/// The header a client sends to an admin port with token `token`; none for an open port.
pub fn bearer(token: &str) -> Option<(&'static str, String)> {
    (!token.is_empty()).then(|| ("authorization", format!("Bearer {token}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_right_bearer_token_opens_a_guarded_path() {
        let t = "s3cret-token";
        assert_eq!(check(t, false, None), Err(Refusal::MissingToken));
        assert_eq!(
            check(t, false, Some(b"Bearer s3cret-tokem")),
            Err(Refusal::WrongToken)
        );
        assert_eq!(
            check(t, false, Some(b"Bearer s3cret-token-and-more")),
            Err(Refusal::WrongToken)
        );
        assert_eq!(
            check(t, false, Some(b"Basic s3cret-token")),
            Err(Refusal::WrongToken)
        );
        assert_eq!(check(t, false, Some(b"Bearer")), Err(Refusal::WrongToken));
        assert_eq!(check(t, false, Some(b"Bearer ")), Err(Refusal::WrongToken));
        assert_eq!(check(t, false, Some(b"Bearer s3cret-token")), Ok(()));
        assert_eq!(check(t, false, Some(b"bearer s3cret-token ")), Ok(()));
        assert_eq!(check(t, true, None), Ok(()));
        // No token configured: everything is open.
        assert_eq!(check("", false, None), Ok(()));
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab\0", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
    }

    #[test]
    fn an_empty_token_is_refused_off_loopback_with_the_key_and_variable_named() {
        for listen in ["127.0.0.1:9100", "[::1]:9100", "localhost:9100"] {
            require_token_off_loopback(listen, "").unwrap();
        }
        for listen in ["0.0.0.0:9100", "[::]:9100", "10.0.0.7:9100", "node1:9100"] {
            let e = require_token_off_loopback(listen, "")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("admin_token")
                    && e.contains("CELLMESH_ADMIN_TOKEN")
                    && e.contains(listen),
                "{e}"
            );
            require_token_off_loopback(listen, "t").unwrap();
        }
    }

    #[test]
    fn a_token_is_shown_masked() {
        assert_eq!(shown_token(""), "");
        assert_eq!(shown_token("abc"), "***");
        assert_eq!(bearer(""), None);
        assert_eq!(
            bearer("abc"),
            Some(("authorization", "Bearer abc".to_string()))
        );
    }
}
