//! Handover hint cookies (README.md#geos-bridge-first-hand-over-later): a proxy that hands a client over to another geo gives it a
//! cookie naming where its session is; the target geo's proxy reads it when the client reconnects
//! there. It is only a hint (MongoDB stays the authority): HMAC-signed, bound to the account and to
//! the client's address, and ignored after [`MAX_AGE_MS`].
//!
//! Layout, all integers big-endian:
//!
//! ```text
//! version u8 | kid_len u8 | kid | nonce [16] | issued_unix_ms u64 | gateway_node u32 | session_epoch u64 |
//! has_position u8 (0 or 1) | [x f64 | y f64 | z f64 when 1] | geo_len u8 | target_geo |
//! account_len u16 | account | HMAC-SHA256 (32 bytes)
//! ```
//!
//! The MAC covers a domain label, everything before it and the client's address, under the key
//! `kid` names in the proxies' cookie ring (`crate::keys`). The address is not carried: a cookie
//! replayed from another address fails its signature. The nonce makes the cookie one-shot: the
//! target geo's proxy consumes it on its board before it uses the hint.

use std::net::IpAddr;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::keys::{self, Key, KeyRing};

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// The layout [`seal`] writes; [`open`] refuses any other by name.
pub const VERSION: u8 = 3;
/// Age after which a cookie is ignored.
pub const MAX_AGE_MS: u64 = 60_000;
/// How far ahead of the reader's clock a cookie may have been issued: geos' wall clocks differ a
/// little, and a fresh hint should not be lost to that.
pub const MAX_CLOCK_SKEW_MS: u64 = 5_000;
/// Longest target geo name, in bytes.
pub const MAX_GEO_LEN: usize = 64;
/// Longest account name, in bytes.
pub const MAX_ACCOUNT_LEN: usize = 256;
const MAC_LEN: usize = 32;
/// Bytes of the one-shot nonce.
pub const NONCE_LEN: usize = 16;
/// Fixed part: version, the kid's length, the nonce, issue time, gateway node, session epoch,
/// the position flag and the two length prefixes.
const FIXED_LEN: usize = 1 + 1 + NONCE_LEN + 8 + 4 + 8 + 1 + 1 + 2;
/// The position, when the flag says there is one.
const POSITION_LEN: usize = 3 * 8;
/// Largest cookie [`seal`] can produce; [`open`] refuses a longer one before reading it.
pub const MAX_COOKIE_LEN: usize =
    FIXED_LEN + keys::MAX_KID_LEN + POSITION_LEN + MAX_GEO_LEN + MAX_ACCOUNT_LEN + MAC_LEN;
/// Keeps a cookie's MAC from ever matching one computed for another use of the same secret (the
/// login tokens).
const DOMAIN: &[u8] = b"cellmesh hint cookie\0";

/// What a handover cookie tells the target geo's proxy.
#[derive(Debug, Clone, PartialEq)]
pub struct HintCookie {
    /// Random, drawn by the sealer: what the target geo's board remembers to honour it once.
    pub nonce: [u8; NONCE_LEN],
    /// When the handing-over proxy issued it (wall-clock ms since the Unix epoch).
    pub issued_unix_ms: u64,
    /// The geo the client is sent to (non-empty, at most [`MAX_GEO_LEN`] bytes).
    pub target_geo: String,
    /// The node that was the session's gateway, to attach to first (0: none known).
    pub gateway_node: u32,
    /// The account it was issued to (non-empty, at most [`MAX_ACCOUNT_LEN`] bytes).
    pub account: String,
    /// The epoch of the session handed over: the login it hints registers above it (each geo's
    /// directory counts epochs on its own).
    pub session_epoch: u64,
    /// Where the player's avatar was (finite coordinates), if known.
    pub last_position: Option<[f64; 3]>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CookieError {
    #[error("cookie of {len} bytes exceeds the maximum of {MAX_COOKIE_LEN} bytes")]
    TooLong { len: usize },
    #[error("malformed cookie: {0}")]
    Malformed(&'static str),
    #[error("unknown cookie version {0}")]
    UnknownVersion(u8),
    #[error("cookie {field} of {len} bytes exceeds the maximum of {max} bytes")]
    FieldTooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("cookie signed under key `{0}`, which this proxy does not accept")]
    UnknownKey(String),
    #[error("cookie signature does not match (forged, or presented from another address)")]
    BadSignature,
    #[error("cookie was issued to another account")]
    WrongAccount,
    /// Checked by the reader, which knows its geo: the cookie sends the client elsewhere.
    #[error("cookie is for geo `{0}`")]
    WrongGeo(String),
    #[error("cookie expired: issued {age_ms} ms ago")]
    Expired { age_ms: u64 },
    #[error("cookie issued {ahead_ms} ms ahead of this clock")]
    FromTheFuture { ahead_ms: u64 },
    /// Checked by the reader against its geo's board: a cookie is honoured once.
    #[error("cookie was used already")]
    Replayed,
}

impl CookieError {
    /// A short, stable name for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            CookieError::TooLong { .. } => "cookie_too_long",
            CookieError::Malformed(_) => "malformed_cookie",
            CookieError::UnknownVersion(_) => "unknown_cookie_version",
            CookieError::FieldTooLong { .. } => "cookie_field_too_long",
            CookieError::UnknownKey(_) => "unknown_cookie_kid",
            CookieError::BadSignature => "bad_cookie_signature",
            CookieError::WrongAccount => "cookie_wrong_account",
            CookieError::WrongGeo(_) => "cookie_wrong_geo",
            CookieError::Expired { .. } => "expired_cookie",
            CookieError::FromTheFuture { .. } => "cookie_from_the_future",
            CookieError::Replayed => "cookie_replayed",
        }
    }
}

/// The two text fields: name (for errors), what an empty one is called, longest length.
type Field = (&'static str, &'static str, usize);
const GEO: Field = ("target geo", "empty target geo", MAX_GEO_LEN);
const ACCOUNT: Field = ("account", "empty account", MAX_ACCOUNT_LEN);

fn check_field((field, empty, max): Field, len: usize) -> Result<(), CookieError> {
    if len == 0 {
        return Err(CookieError::Malformed(empty));
    }
    if len > max {
        return Err(CookieError::FieldTooLong { field, len, max });
    }
    Ok(())
}

fn mac(secret: &[u8], body: &[u8], client_addr: IpAddr) -> HmacSha256 {
    domain_mac(secret, DOMAIN, body, client_addr)
}

/// HMAC-SHA256 under `secret` of a domain label, `body` and the client's address: what binds a
/// cookie or a probe ticket to its use and to its client.
pub(crate) fn domain_mac(
    secret: &[u8],
    domain: &[u8],
    body: &[u8],
    client_addr: IpAddr,
) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(domain);
    mac.update(body);
    // Canonical, so a client seen as `::ffff:a.b.c.d` by a dual-stack socket matches `a.b.c.d`.
    match client_addr.to_canonical() {
        IpAddr::V4(a) => {
            mac.update(&[4]);
            mac.update(&a.octets());
        }
        IpAddr::V6(a) => {
            mac.update(&[6]);
            mac.update(&a.octets());
        }
    }
    mac
}

/// [`seal_with`] under the one-key ring of `secret`.
pub fn seal(
    secret: &[u8],
    cookie: &HintCookie,
    client_addr: IpAddr,
) -> Result<Vec<u8>, CookieError> {
    seal_with(KeyRing::single(secret).signing(), cookie, client_addr)
}

/// Signs `cookie` for a client at `client_addr` under `key`. Fails only if a field is empty or
/// too long.
pub fn seal_with(
    key: &Key,
    cookie: &HintCookie,
    client_addr: IpAddr,
) -> Result<Vec<u8>, CookieError> {
    check_field(GEO, cookie.target_geo.len())?;
    check_field(ACCOUNT, cookie.account.len())?;
    if cookie
        .last_position
        .is_some_and(|p| p.iter().any(|v| !v.is_finite()))
    {
        return Err(CookieError::Malformed("position is not finite"));
    }
    let mut out = Vec::with_capacity(MAX_COOKIE_LEN);
    out.push(VERSION);
    out.push(key.kid.len() as u8);
    out.extend_from_slice(key.kid.as_bytes());
    out.extend_from_slice(&cookie.nonce);
    out.extend_from_slice(&cookie.issued_unix_ms.to_be_bytes());
    out.extend_from_slice(&cookie.gateway_node.to_be_bytes());
    out.extend_from_slice(&cookie.session_epoch.to_be_bytes());
    match cookie.last_position {
        Some(p) => {
            out.push(1);
            for v in p {
                out.extend_from_slice(&v.to_be_bytes());
            }
        }
        None => out.push(0),
    }
    out.push(cookie.target_geo.len() as u8);
    out.extend_from_slice(cookie.target_geo.as_bytes());
    out.extend_from_slice(&(cookie.account.len() as u16).to_be_bytes());
    out.extend_from_slice(cookie.account.as_bytes());
    let tag = mac(&key.secret, &out, client_addr).finalize().into_bytes();
    out.extend_from_slice(&tag);
    Ok(out)
}

/// [`open_ring`] with the one-key ring of `secret`.
pub fn open(
    secret: &[u8],
    bytes: &[u8],
    account: &str,
    client_addr: IpAddr,
    now_unix_ms: u64,
) -> Result<HintCookie, CookieError> {
    open_ring(
        &KeyRing::single(secret),
        bytes,
        account,
        client_addr,
        now_unix_ms,
    )
}

/// Reads a cookie presented by `account` from `client_addr` at `now_unix_ms`: its layout, then
/// its key and signature (in constant time), then whose it is, then its age.
pub fn open_ring(
    ring: &KeyRing,
    bytes: &[u8],
    account: &str,
    client_addr: IpAddr,
    now_unix_ms: u64,
) -> Result<HintCookie, CookieError> {
    if bytes.len() > MAX_COOKIE_LEN {
        return Err(CookieError::TooLong { len: bytes.len() });
    }
    let Some(&version) = bytes.first() else {
        return Err(CookieError::Malformed("empty cookie"));
    };
    if version != VERSION {
        return Err(CookieError::UnknownVersion(version));
    }
    if bytes.len() < FIXED_LEN + MAC_LEN {
        return Err(CookieError::Malformed("truncated cookie"));
    }
    let (body, tag) = bytes.split_at(bytes.len() - MAC_LEN);
    let mut r = Reader(&body[1..]);
    let [kid_len] = r.array()?;
    let kid = std::str::from_utf8(r.take(kid_len.into())?)
        .ok()
        .filter(|k| keys::valid_kid(k))
        .ok_or(CookieError::Malformed("key id is not a key id"))?;
    let nonce = r.array()?;
    let issued_unix_ms = u64::from_be_bytes(r.array()?);
    let gateway_node = u32::from_be_bytes(r.array()?);
    let session_epoch = u64::from_be_bytes(r.array()?);
    let last_position = match r.array()? {
        [0] => None,
        [1] => {
            let mut p = [0.0; 3];
            for v in &mut p {
                *v = f64::from_be_bytes(r.array()?);
            }
            if p.iter().any(|v| !v.is_finite()) {
                return Err(CookieError::Malformed("position is not finite"));
            }
            Some(p)
        }
        _ => return Err(CookieError::Malformed("position flag is neither 0 nor 1")),
    };
    let [geo_len] = r.array()?;
    let target_geo = r.text(GEO, geo_len.into())?;
    let account_len = u16::from_be_bytes(r.array()?);
    let issued_to = r.text(ACCOUNT, account_len.into())?;
    if !r.0.is_empty() {
        return Err(CookieError::Malformed("trailing bytes"));
    }
    let key = ring
        .get(kid)
        .ok_or_else(|| CookieError::UnknownKey(kid.to_owned()))?;
    mac(&key.secret, body, client_addr)
        .verify_slice(tag)
        .map_err(|_| CookieError::BadSignature)?;
    if issued_to != account {
        return Err(CookieError::WrongAccount);
    }
    if issued_unix_ms > now_unix_ms {
        let ahead_ms = issued_unix_ms - now_unix_ms;
        if ahead_ms > MAX_CLOCK_SKEW_MS {
            return Err(CookieError::FromTheFuture { ahead_ms });
        }
    }
    let age_ms = now_unix_ms.saturating_sub(issued_unix_ms);
    if age_ms > MAX_AGE_MS {
        return Err(CookieError::Expired { age_ms });
    }
    Ok(HintCookie {
        nonce,
        issued_unix_ms,
        target_geo: target_geo.to_owned(),
        gateway_node,
        account: issued_to.to_owned(),
        session_epoch,
        last_position,
    })
}

/// Reads fields off the front of a cookie body; running out is a typed error.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CookieError> {
        if self.0.len() < n {
            return Err(CookieError::Malformed("truncated cookie"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], CookieError> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }

    fn text(&mut self, field: Field, len: usize) -> Result<&'a str, CookieError> {
        // Checked before taking, so an oversize prefix is named as such even with no bytes behind.
        check_field(field, len)?;
        std::str::from_utf8(self.take(len)?)
            .map_err(|_| CookieError::Malformed("field is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    const SECRET: &[u8] = b"s3cret";
    const NOW: u64 = 1_700_000_000_000;
    const ADDR: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7));

    /// The length of the kid a bare secret's ring signs under.
    const KID: usize = 9;

    fn hint() -> HintCookie {
        HintCookie {
            nonce: [0x5a; NONCE_LEN],
            issued_unix_ms: NOW,
            target_geo: "eu-west".into(),
            gateway_node: 7,
            account: "alice.smith".into(),
            session_epoch: 1_700_000_000_123_456,
            last_position: Some([70_000.5, 1_000.25, 0.0]),
        }
    }

    fn sealed() -> Vec<u8> {
        seal(SECRET, &hint(), ADDR).unwrap()
    }

    #[test]
    fn round_trip() {
        let c = sealed();
        assert_eq!(c.len(), FIXED_LEN + KID + POSITION_LEN + 7 + 11 + MAC_LEN);
        let nowhere = HintCookie {
            last_position: None,
            ..hint()
        };
        let c0 = seal(SECRET, &nowhere, ADDR).unwrap();
        assert_eq!(c0.len(), FIXED_LEN + KID + 7 + 11 + MAC_LEN);
        assert_eq!(open(SECRET, &c0, "alice.smith", ADDR, NOW), Ok(nowhere));
        assert_eq!(open(SECRET, &c, "alice.smith", ADDR, NOW + 1), Ok(hint()));
        let v6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1));
        let c6 = seal(SECRET, &hint(), v6).unwrap();
        assert_eq!(open(SECRET, &c6, "alice.smith", v6, NOW), Ok(hint()));
    }

    #[test]
    fn largest_cookie_is_the_maximum() {
        let big = HintCookie {
            target_geo: "g".repeat(MAX_GEO_LEN),
            account: "a".repeat(MAX_ACCOUNT_LEN),
            ..hint()
        };
        let ring = KeyRing::parse(&[format!("{}:s", "k".repeat(keys::MAX_KID_LEN))], "").unwrap();
        let c = seal_with(ring.signing(), &big, ADDR).unwrap();
        assert_eq!(c.len(), MAX_COOKIE_LEN);
        assert_eq!(open_ring(&ring, &c, &big.account, ADDR, NOW), Ok(big));
    }

    #[test]
    fn a_cookie_names_its_key_and_a_ring_accepts_any_of_its_keys() {
        let ring = |v: &[&str]| {
            let v: Vec<String> = v.iter().map(|e| e.to_string()).collect();
            KeyRing::parse(&v, "").unwrap()
        };
        let by_c1 = seal_with(ring(&["c1:one"]).signing(), &hint(), ADDR).unwrap();
        let both = ring(&["c2:two", "c1:one"]);
        assert_eq!(
            open_ring(&both, &by_c1, "alice.smith", ADDR, NOW),
            Ok(hint())
        );
        let retired = open_ring(&ring(&["c2:two"]), &by_c1, "alice.smith", ADDR, NOW);
        assert_eq!(retired, Err(CookieError::UnknownKey("c1".into())));
        assert_eq!(retired.unwrap_err().kind(), "unknown_cookie_kid");
        // The old layout, without a kid or a nonce, is refused by its version.
        let mut v2 = by_c1.clone();
        v2[0] = 2;
        assert_eq!(
            open_ring(&both, &v2, "alice.smith", ADDR, NOW),
            Err(CookieError::UnknownVersion(2))
        );
    }

    #[test]
    fn an_ipv4_mapped_address_is_the_same_client() {
        let mapped = IpAddr::V6(Ipv4Addr::new(203, 0, 113, 7).to_ipv6_mapped());
        assert_eq!(
            open(SECRET, &sealed(), "alice.smith", mapped, NOW),
            Ok(hint())
        );
    }

    #[test]
    fn bound_to_the_address() {
        let other = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 8));
        assert_eq!(
            open(SECRET, &sealed(), "alice.smith", other, NOW),
            Err(CookieError::BadSignature)
        );
    }

    #[test]
    fn bound_to_the_account() {
        assert_eq!(
            open(SECRET, &sealed(), "mallory", ADDR, NOW),
            Err(CookieError::WrongAccount)
        );
    }

    #[test]
    fn signed_by_the_secret() {
        // Another secret under the same kid: the signature, not the kid, tells them apart.
        let same_kid =
            KeyRing::parse(&[format!("{}:other", keys::derived_kid(SECRET))], "").unwrap();
        assert_eq!(
            open_ring(&same_kid, &sealed(), "alice.smith", ADDR, NOW),
            Err(CookieError::BadSignature)
        );
    }

    #[test]
    fn every_bit_flip_is_refused() {
        let c = sealed();
        for i in 0..c.len() * 8 {
            let mut bad = c.clone();
            bad[i / 8] ^= 1 << (i % 8);
            let err = open(SECRET, &bad, "alice.smith", ADDR, NOW).unwrap_err();
            assert!(
                matches!(
                    err,
                    CookieError::BadSignature
                        | CookieError::Malformed(_)
                        | CookieError::UnknownVersion(_)
                        | CookieError::UnknownKey(_)
                        | CookieError::FieldTooLong { .. }
                ),
                "bit {i}: {err}"
            );
        }
    }

    #[test]
    fn every_truncation_is_malformed() {
        let c = sealed();
        for n in 1..c.len() {
            let err = open(SECRET, &c[..n], "alice.smith", ADDR, NOW).unwrap_err();
            assert!(
                matches!(
                    err,
                    CookieError::Malformed(_) | CookieError::FieldTooLong { .. }
                ),
                "{n} bytes: {err}"
            );
        }
        assert_eq!(
            open(SECRET, &[], "alice.smith", ADDR, NOW),
            Err(CookieError::Malformed("empty cookie"))
        );
    }

    #[test]
    fn trailing_bytes_are_malformed() {
        let mut c = sealed();
        c.insert(c.len() - MAC_LEN, 0);
        assert_eq!(
            open(SECRET, &c, "alice.smith", ADDR, NOW),
            Err(CookieError::Malformed("trailing bytes"))
        );
    }

    #[test]
    fn too_long_is_refused_first() {
        let long = vec![VERSION; MAX_COOKIE_LEN + 1];
        assert_eq!(
            open(SECRET, &long, "alice.smith", ADDR, NOW),
            Err(CookieError::TooLong {
                len: MAX_COOKIE_LEN + 1
            })
        );
    }

    #[test]
    fn unknown_version() {
        let mut c = sealed();
        c[0] = 1;
        assert_eq!(
            open(SECRET, &c, "alice.smith", ADDR, NOW),
            Err(CookieError::UnknownVersion(1))
        );
    }

    #[test]
    fn oversize_fields() {
        let long_geo = HintCookie {
            target_geo: "g".repeat(MAX_GEO_LEN + 1),
            ..hint()
        };
        assert_eq!(
            seal(SECRET, &long_geo, ADDR),
            Err(CookieError::FieldTooLong {
                field: "target geo",
                len: MAX_GEO_LEN + 1,
                max: MAX_GEO_LEN
            })
        );
        let long_account = HintCookie {
            account: "a".repeat(MAX_ACCOUNT_LEN + 1),
            ..hint()
        };
        assert!(matches!(
            seal(SECRET, &long_account, ADDR),
            Err(CookieError::FieldTooLong {
                field: "account",
                ..
            })
        ));
        let mut c = sealed();
        c[FIXED_LEN + KID - 3 + POSITION_LEN] = MAX_GEO_LEN as u8 + 1;
        assert_eq!(
            open(SECRET, &c, "alice.smith", ADDR, NOW),
            Err(CookieError::FieldTooLong {
                field: "target geo",
                len: MAX_GEO_LEN + 1,
                max: MAX_GEO_LEN
            })
        );
    }

    #[test]
    fn empty_fields() {
        let no_account = HintCookie {
            account: String::new(),
            ..hint()
        };
        assert_eq!(
            seal(SECRET, &no_account, ADDR),
            Err(CookieError::Malformed("empty account"))
        );
        let no_geo = HintCookie {
            target_geo: String::new(),
            ..hint()
        };
        assert_eq!(
            seal(SECRET, &no_geo, ADDR),
            Err(CookieError::Malformed("empty target geo"))
        );
    }

    #[test]
    fn a_position_flag_other_than_0_or_1_and_non_finite_positions_are_refused() {
        // The flag sits after version, kid, nonce, issue time, gateway node and epoch. Checked
        // before the signature, like every layout error.
        let flag = 1 + 1 + KID + NONCE_LEN + 8 + 4 + 8;
        let mut c = sealed();
        c[flag] = 2;
        assert_eq!(
            open(SECRET, &c, "alice.smith", ADDR, NOW),
            Err(CookieError::Malformed("position flag is neither 0 nor 1"))
        );
        let mut c = sealed();
        c[flag + 1..flag + 9].copy_from_slice(&f64::NAN.to_be_bytes());
        assert_eq!(
            open(SECRET, &c, "alice.smith", ADDR, NOW),
            Err(CookieError::Malformed("position is not finite"))
        );
        let nan = HintCookie {
            last_position: Some([0.0, f64::INFINITY, 0.0]),
            ..hint()
        };
        assert_eq!(
            seal(SECRET, &nan, ADDR),
            Err(CookieError::Malformed("position is not finite"))
        );
    }

    #[test]
    fn non_utf8_is_malformed() {
        let mut c = sealed();
        c[FIXED_LEN + KID - 2 + POSITION_LEN] = 0xff;
        assert_eq!(
            open(SECRET, &c, "alice.smith", ADDR, NOW),
            Err(CookieError::Malformed("field is not UTF-8"))
        );
    }

    #[test]
    fn ignored_after_sixty_seconds() {
        let c = sealed();
        assert!(open(SECRET, &c, "alice.smith", ADDR, NOW + MAX_AGE_MS).is_ok());
        assert_eq!(
            open(SECRET, &c, "alice.smith", ADDR, NOW + MAX_AGE_MS + 1),
            Err(CookieError::Expired {
                age_ms: MAX_AGE_MS + 1
            })
        );
    }

    #[test]
    fn from_the_future_beyond_clock_skew() {
        let c = sealed();
        assert!(open(SECRET, &c, "alice.smith", ADDR, NOW - MAX_CLOCK_SKEW_MS).is_ok());
        assert_eq!(
            open(SECRET, &c, "alice.smith", ADDR, NOW - MAX_CLOCK_SKEW_MS - 1),
            Err(CookieError::FromTheFuture {
                ahead_ms: MAX_CLOCK_SKEW_MS + 1
            })
        );
    }

    #[test]
    fn kinds_are_distinct() {
        let errors = [
            CookieError::TooLong { len: 0 },
            CookieError::Malformed(""),
            CookieError::UnknownVersion(0),
            CookieError::FieldTooLong {
                field: "",
                len: 0,
                max: 0,
            },
            CookieError::BadSignature,
            CookieError::WrongAccount,
            CookieError::WrongGeo(String::new()),
            CookieError::Expired { age_ms: 0 },
            CookieError::FromTheFuture { ahead_ms: 0 },
        ];
        let kinds: std::collections::HashSet<_> = errors.iter().map(|e| e.kind()).collect();
        assert_eq!(kinds.len(), errors.len());
    }
}
