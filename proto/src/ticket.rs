//! Probe tickets (README.md#geos-bridge-first-hand-over-later): a proxy asks its client to probe another geo's proxies, and the
//! ticket tells the far proxy whose RTT it is measuring and which geo to publish it to. Like the
//! handover cookie it is HMAC-signed under the proxies' cookie ring (naming its key by kid),
//! bound to the client's address,
//! and refused after [`MAX_AGE_MS`]: a client cannot have another host measured in its name.
//!
//! Layout, all integers big-endian:
//!
//! ```text
//! version u8 | kid_len u8 | kid | issued_unix_ms u64 | origin_len u8 | origin geo | target_len u8 | target geo |
//! account_len u16 | account | HMAC-SHA256 (32 bytes)
//! ```

use std::net::IpAddr;

use hmac::Mac;

use crate::cookie::HmacSha256;
use crate::keys::{self, Key, KeyRing};

pub const VERSION: u8 = 2;
/// A ticket is honoured this long after it was issued.
pub const MAX_AGE_MS: u64 = 60_000;
/// How far ahead of the reader's clock a ticket may have been issued.
pub const MAX_CLOCK_SKEW_MS: u64 = 5_000;
const MAX_GEO_LEN: usize = 64;
const MAX_ACCOUNT_LEN: usize = 256;
const MAC_LEN: usize = 32;
/// The longest ticket [`seal`] writes; [`open`] refuses a longer one unread.
pub const MAX_TICKET_LEN: usize = 1
    + 1
    + keys::MAX_KID_LEN
    + 8
    + 1
    + MAX_GEO_LEN
    + 1
    + MAX_GEO_LEN
    + 2
    + MAX_ACCOUNT_LEN
    + MAC_LEN;
/// Keeps a ticket's MAC from matching one made for another use of the same secret.
const DOMAIN: &[u8] = b"cellmesh probe ticket\0";

/// What a probe ticket tells the far proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTicket {
    pub issued_unix_ms: u64,
    /// The geo of the proxy the client is on: the measurement is published there.
    pub origin_geo: String,
    /// The geo whose proxy the client probes.
    pub target_geo: String,
    pub account: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TicketError {
    #[error("malformed probe ticket: {0}")]
    Malformed(&'static str),
    #[error("probe ticket signed under key `{0}`, which this proxy does not accept")]
    UnknownKey(String),
    #[error("probe ticket signature does not match (forged, or presented from another address)")]
    BadSignature,
    #[error("probe ticket expired: issued {age_ms} ms ago")]
    Expired { age_ms: u64 },
    #[error("probe ticket issued {ahead_ms} ms ahead of this clock")]
    FromTheFuture { ahead_ms: u64 },
}

impl TicketError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Malformed(_) => "malformed",
            Self::UnknownKey(_) => "unknown_kid",
            Self::BadSignature => "bad_signature",
            Self::Expired { .. } => "expired",
            Self::FromTheFuture { .. } => "from_the_future",
        }
    }
}

fn mac(secret: &[u8], body: &[u8], client: IpAddr) -> HmacSha256 {
    crate::cookie::domain_mac(secret, DOMAIN, body, client)
}

/// [`seal_with`] under the one-key ring of `secret`.
pub fn seal(secret: &[u8], t: &ProbeTicket, client: IpAddr) -> Result<Vec<u8>, TicketError> {
    seal_with(KeyRing::single(secret).signing(), t, client)
}

/// Signs `t` for the client at `client` under `key`.
pub fn seal_with(key: &Key, t: &ProbeTicket, client: IpAddr) -> Result<Vec<u8>, TicketError> {
    for (len, max, why) in [
        (
            t.origin_geo.len(),
            MAX_GEO_LEN,
            "origin geo empty or too long",
        ),
        (
            t.target_geo.len(),
            MAX_GEO_LEN,
            "target geo empty or too long",
        ),
        (
            t.account.len(),
            MAX_ACCOUNT_LEN,
            "account empty or too long",
        ),
    ] {
        if len == 0 || len > max {
            return Err(TicketError::Malformed(why));
        }
    }
    let mut out = Vec::with_capacity(MAX_TICKET_LEN);
    out.push(VERSION);
    out.push(key.kid.len() as u8);
    out.extend_from_slice(key.kid.as_bytes());
    out.extend_from_slice(&t.issued_unix_ms.to_be_bytes());
    out.push(t.origin_geo.len() as u8);
    out.extend_from_slice(t.origin_geo.as_bytes());
    out.push(t.target_geo.len() as u8);
    out.extend_from_slice(t.target_geo.as_bytes());
    out.extend_from_slice(&(t.account.len() as u16).to_be_bytes());
    out.extend_from_slice(t.account.as_bytes());
    let tag = mac(&key.secret, &out, client).finalize().into_bytes();
    out.extend_from_slice(&tag);
    Ok(out)
}

/// [`open_ring`] with the one-key ring of `secret`.
pub fn open(
    secret: &[u8],
    bytes: &[u8],
    client: IpAddr,
    now_unix_ms: u64,
) -> Result<ProbeTicket, TicketError> {
    open_ring(&KeyRing::single(secret), bytes, client, now_unix_ms)
}

/// Reads a ticket presented from `client` at `now_unix_ms`: layout, key, signature, age.
pub fn open_ring(
    ring: &KeyRing,
    bytes: &[u8],
    client: IpAddr,
    now_unix_ms: u64,
) -> Result<ProbeTicket, TicketError> {
    if bytes.len() > MAX_TICKET_LEN {
        return Err(TicketError::Malformed("too long"));
    }
    if bytes.first() != Some(&VERSION) {
        return Err(TicketError::Malformed("unknown version"));
    }
    if bytes.len() < 1 + 1 + 8 + 1 + 1 + 2 + MAC_LEN {
        return Err(TicketError::Malformed("truncated"));
    }
    let (body, tag) = bytes.split_at(bytes.len() - MAC_LEN);
    let mut rest = &body[1..];
    let mut take = |n: usize| -> Result<&[u8], TicketError> {
        if rest.len() < n {
            return Err(TicketError::Malformed("truncated"));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let n = usize::from(take(1)?[0]);
    let kid = std::str::from_utf8(take(n)?)
        .ok()
        .filter(|k| keys::valid_kid(k))
        .ok_or(TicketError::Malformed("key id is not a key id"))?
        .to_owned();
    let issued_unix_ms = u64::from_be_bytes(take(8)?.try_into().expect("8 bytes"));
    let text = |b: &[u8]| {
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| TicketError::Malformed("field is not UTF-8"))
    };
    let n = usize::from(take(1)?[0]);
    let origin_geo = text(take(n)?)?;
    let n = usize::from(take(1)?[0]);
    let target_geo = text(take(n)?)?;
    let n = usize::from(u16::from_be_bytes(take(2)?.try_into().expect("2 bytes")));
    let account = text(take(n)?)?;
    if !rest.is_empty() {
        return Err(TicketError::Malformed("trailing bytes"));
    }
    let key = ring.get(&kid).ok_or(TicketError::UnknownKey(kid))?;
    mac(&key.secret, body, client)
        .verify_slice(tag)
        .map_err(|_| TicketError::BadSignature)?;
    if issued_unix_ms > now_unix_ms + MAX_CLOCK_SKEW_MS {
        return Err(TicketError::FromTheFuture {
            ahead_ms: issued_unix_ms - now_unix_ms,
        });
    }
    let age_ms = now_unix_ms.saturating_sub(issued_unix_ms);
    if age_ms > MAX_AGE_MS {
        return Err(TicketError::Expired { age_ms });
    }
    Ok(ProbeTicket {
        issued_unix_ms,
        origin_geo,
        target_geo,
        account,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const NOW: u64 = 1_800_000_000_000;
    const ADDR: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 4));

    fn ticket() -> ProbeTicket {
        ProbeTicket {
            issued_unix_ms: NOW,
            origin_geo: "paris".into(),
            target_geo: "montreal".into(),
            account: "alice.b".into(),
        }
    }

    #[test]
    fn round_trip_and_binding() {
        let t = seal(b"k", &ticket(), ADDR).unwrap();
        assert_eq!(open(b"k", &t, ADDR, NOW + 10), Ok(ticket()));
        let mapped = IpAddr::V6(Ipv4Addr::new(198, 51, 100, 4).to_ipv6_mapped());
        assert_eq!(open(b"k", &t, mapped, NOW), Ok(ticket()));
        let other: IpAddr = "198.51.100.5".parse().unwrap();
        assert_eq!(open(b"k", &t, other, NOW), Err(TicketError::BadSignature));
        assert!(matches!(
            open(b"x", &t, ADDR, NOW),
            Err(TicketError::UnknownKey(_))
        ));
    }

    #[test]
    fn a_ticket_names_its_key() {
        let ring = |v: &[&str]| {
            let v: Vec<String> = v.iter().map(|e| e.to_string()).collect();
            KeyRing::parse(&v, "").unwrap()
        };
        let t = seal_with(ring(&["c1:one"]).signing(), &ticket(), ADDR).unwrap();
        assert_eq!(
            open_ring(&ring(&["c2:two", "c1:one"]), &t, ADDR, NOW),
            Ok(ticket())
        );
        assert_eq!(
            open_ring(&ring(&["c2:two"]), &t, ADDR, NOW),
            Err(TicketError::UnknownKey("c1".into()))
        );
        assert_eq!(
            open_ring(&ring(&["c1:forged"]), &t, ADDR, NOW),
            Err(TicketError::BadSignature)
        );
    }

    #[test]
    fn age_and_layout_are_checked() {
        let t = seal(b"k", &ticket(), ADDR).unwrap();
        assert_eq!(
            open(b"k", &t, ADDR, NOW + 60_001),
            Err(TicketError::Expired { age_ms: 60_001 })
        );
        assert_eq!(
            open(b"k", &t, ADDR, NOW - 6_000),
            Err(TicketError::FromTheFuture { ahead_ms: 6_000 })
        );
        for n in 0..t.len() {
            assert!(open(b"k", &t[..n], ADDR, NOW).is_err(), "cut at {n}");
        }
        for i in 0..t.len() {
            for bit in 0..8 {
                let mut bad = t.clone();
                bad[i] ^= 1 << bit;
                assert!(open(b"k", &bad, ADDR, NOW).is_err(), "flip {i}.{bit}");
            }
        }
        assert!(seal(
            b"k",
            &ProbeTicket {
                account: String::new(),
                ..ticket()
            },
            ADDR
        )
        .is_err());
    }
}
