//! The handover hint and its signed cookie.
//!
//! A handed-over player reconnects to another geo's proxy. What that proxy's gateway would read
//! from MongoDB at login (where the avatar was, the session epoch to go above) travels two ways,
//! because either can be lost: as a [`Hint`] put on the target geo's Redis, and as a cookie the
//! client carries in its next `ClientHello`. The cookie is the hint's JSON followed by an
//! HMAC-SHA256 tag over it, under the secret the proxies share. It is bound to the account, the
//! target geo and the client's IP address, and ignored [`MAX_AGE_MS`] after it was issued: a
//! stale, forged, replayed or borrowed cookie is refused and the login reads MongoDB, which stays
//! the authority.

use std::net::IpAddr;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// A hint or cookie older than this is ignored.
pub const MAX_AGE_MS: u64 = 60_000;
/// How far in the future an issue time may be (clocks of two geos' proxies disagree a little).
pub const MAX_FUTURE_MS: u64 = 5_000;
/// The longest cookie read; longer ones are refused before any parsing.
pub const MAX_COOKIE_BYTES: usize = 1024;
const TAG_BYTES: usize = 32;

/// What a handed-over login needs in place of the MongoDB read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hint {
    pub account: String,
    /// The geo that handed the player over, and the one they are sent to.
    pub from_geo: String,
    pub to_geo: String,
    /// The client's address as the handing-over proxy saw it (ports change on reconnect).
    pub client_ip: IpAddr,
    pub issued_unix_ms: u64,
    /// The session epoch of the session handed over: the next one registers above it.
    pub session_epoch: u64,
    /// Where the player's avatar was when they were handed over.
    pub last_position: Option<[f64; 3]>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CookieError {
    #[error("malformed cookie: {0}")]
    Malformed(String),
    #[error("cookie signature does not match")]
    Forged,
    #[error("cookie issued {age_ms} ms ago (ignored after {MAX_AGE_MS} ms)")]
    Expired { age_ms: u64 },
    #[error("cookie issued {ahead_ms} ms in the future")]
    FromTheFuture { ahead_ms: u64 },
    #[error("cookie is for another account")]
    WrongAccount,
    #[error("cookie is for geo `{0}`")]
    WrongGeo(String),
    #[error("cookie was issued to another address")]
    WrongAddress,
}

impl CookieError {
    /// A short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Malformed(_) => "malformed",
            Self::Forged => "forged",
            Self::Expired { .. } => "expired",
            Self::FromTheFuture { .. } => "future",
            Self::WrongAccount => "wrong_account",
            Self::WrongGeo(_) => "wrong_geo",
            Self::WrongAddress => "wrong_address",
        }
    }
}

fn mac(secret: &[u8], body: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(b"cellmesh handover cookie v1\n");
    mac.update(body);
    mac
}

/// The cookie for `hint`.
pub fn sign(secret: &[u8], hint: &Hint) -> Vec<u8> {
    let mut out = serde_json::to_vec(hint).expect("a hint serialises");
    let tag = mac(secret, &out).finalize().into_bytes();
    out.extend_from_slice(&tag);
    out
}

/// What a login on `geo` from `client_ip` as `account` expects of a cookie.
#[derive(Debug, Clone, Copy)]
pub struct Expect<'a> {
    pub account: &'a str,
    pub geo: &'a str,
    pub client_ip: IpAddr,
    pub now_unix_ms: u64,
}

/// Checks a cookie's signature, then that it is this login's, then its age.
pub fn verify(secret: &[u8], cookie: &[u8], expect: Expect<'_>) -> Result<Hint, CookieError> {
    if cookie.len() > MAX_COOKIE_BYTES {
        return Err(CookieError::Malformed(format!(
            "{} bytes, at most {MAX_COOKIE_BYTES}",
            cookie.len()
        )));
    }
    let Some(split) = cookie.len().checked_sub(TAG_BYTES) else {
        return Err(CookieError::Malformed("shorter than its signature".into()));
    };
    let (body, tag) = cookie.split_at(split);
    mac(secret, body)
        .verify_slice(tag)
        .map_err(|_| CookieError::Forged)?;
    let hint: Hint =
        serde_json::from_slice(body).map_err(|e| CookieError::Malformed(e.to_string()))?;
    check(&hint, expect)?;
    Ok(hint)
}

/// Checks that a hint (from a cookie or from the geo's store) belongs to this login and is fresh.
pub fn check(hint: &Hint, expect: Expect<'_>) -> Result<(), CookieError> {
    if hint.account != expect.account {
        return Err(CookieError::WrongAccount);
    }
    if hint.to_geo != expect.geo {
        return Err(CookieError::WrongGeo(hint.to_geo.clone()));
    }
    if same_client(hint.client_ip) != same_client(expect.client_ip) {
        return Err(CookieError::WrongAddress);
    }
    if hint.issued_unix_ms > expect.now_unix_ms + MAX_FUTURE_MS {
        return Err(CookieError::FromTheFuture {
            ahead_ms: hint.issued_unix_ms - expect.now_unix_ms,
        });
    }
    let age_ms = expect.now_unix_ms.saturating_sub(hint.issued_unix_ms);
    if age_ms > MAX_AGE_MS {
        return Err(CookieError::Expired { age_ms });
    }
    Ok(())
}

/// An address as a client is recognised by: IPv4 whole (mapped into IPv6 or not), IPv6 by its
/// /64 (privacy extensions rotate the rest between connections).
fn same_client(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"proxies' shared secret";
    const T0: u64 = 1_800_000_000_000;

    fn hint() -> Hint {
        Hint {
            account: "alice".into(),
            from_geo: "paris".into(),
            to_geo: "montreal".into(),
            client_ip: "203.0.113.7".parse().unwrap(),
            issued_unix_ms: T0,
            session_epoch: 41,
            last_position: Some([70_000.0, 1_000.0, 0.0]),
        }
    }

    fn expect(now_unix_ms: u64) -> Expect<'static> {
        Expect {
            account: "alice",
            geo: "montreal",
            client_ip: "203.0.113.7".parse().unwrap(),
            now_unix_ms,
        }
    }

    #[test]
    fn a_fresh_cookie_gives_back_its_hint() {
        let c = sign(SECRET, &hint());
        assert_eq!(verify(SECRET, &c, expect(T0 + 59_000)), Ok(hint()));
    }

    #[test]
    fn a_forged_cookie_is_refused() {
        let mut c = sign(SECRET, &hint());
        // Another epoch written into the body, the tag left as it was.
        let text = String::from_utf8_lossy(&c[..c.len() - TAG_BYTES]).replace("41", "99");
        let tag = c.split_off(c.len() - TAG_BYTES);
        let mut forged = text.into_bytes();
        forged.extend_from_slice(&tag);
        assert_eq!(
            verify(SECRET, &forged, expect(T0)),
            Err(CookieError::Forged)
        );
        // Signed with another key.
        let other = sign(b"guess", &hint());
        assert_eq!(verify(SECRET, &other, expect(T0)), Err(CookieError::Forged));
        // Garbage and truncation.
        assert!(matches!(
            verify(SECRET, b"short", expect(T0)),
            Err(CookieError::Malformed(_))
        ));
        assert_eq!(
            verify(SECRET, &c[..c.len() - 1], expect(T0)),
            Err(CookieError::Forged)
        );
        assert!(matches!(
            verify(SECRET, &vec![b'x'; MAX_COOKIE_BYTES + 1], expect(T0)),
            Err(CookieError::Malformed(_))
        ));
    }

    #[test]
    fn an_expired_cookie_is_refused() {
        let c = sign(SECRET, &hint());
        assert_eq!(
            verify(SECRET, &c, expect(T0 + 61_000)),
            Err(CookieError::Expired { age_ms: 61_000 })
        );
        assert_eq!(
            verify(SECRET, &c, expect(T0 - 6_000)),
            Err(CookieError::FromTheFuture { ahead_ms: 6_000 })
        );
    }

    #[test]
    fn a_cookie_replayed_from_another_address_is_refused() {
        let c = sign(SECRET, &hint());
        let elsewhere = Expect {
            client_ip: "198.51.100.1".parse().unwrap(),
            ..expect(T0)
        };
        assert_eq!(
            verify(SECRET, &c, elsewhere),
            Err(CookieError::WrongAddress)
        );
        // The same IPv4 address seen through a dual-stack socket is the same client.
        let mapped = Expect {
            client_ip: "::ffff:203.0.113.7".parse().unwrap(),
            ..expect(T0)
        };
        assert!(verify(SECRET, &c, mapped).is_ok());
    }

    #[test]
    fn a_cookie_for_another_account_or_geo_is_refused() {
        let c = sign(SECRET, &hint());
        let bob = Expect {
            account: "bob",
            ..expect(T0)
        };
        assert_eq!(verify(SECRET, &c, bob), Err(CookieError::WrongAccount));
        let paris = Expect {
            geo: "paris",
            ..expect(T0)
        };
        assert_eq!(
            verify(SECRET, &c, paris),
            Err(CookieError::WrongGeo("montreal".into()))
        );
    }

    #[test]
    fn ipv6_clients_are_recognised_by_their_64() {
        let h = Hint {
            client_ip: "2001:db8:1:2:aaaa::1".parse().unwrap(),
            ..hint()
        };
        let c = sign(SECRET, &h);
        let rotated = Expect {
            client_ip: "2001:db8:1:2:bbbb::9".parse().unwrap(),
            ..expect(T0)
        };
        assert!(verify(SECRET, &c, rotated).is_ok());
        let other = Expect {
            client_ip: "2001:db8:1:3::1".parse().unwrap(),
            ..expect(T0)
        };
        assert_eq!(verify(SECRET, &c, other), Err(CookieError::WrongAddress));
    }
}
