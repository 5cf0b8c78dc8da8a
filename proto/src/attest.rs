//! Attach attestations: the proxy that admitted a login signs, per `Attach`, that this account
//! may be attached as this session until shortly; the gateway sidecar checks it before it
//! attaches anyone. Without one, any holder of a mesh connection could name any account.
//!
//! Text layout: `<kid>.<expiry unix ms>.<hex HMAC-SHA256>`, the MAC covering a domain label, the
//! kid, the account, the session id and the expiry, under the key `kid` names in the `attest_keys`
//! ring the proxies and sidecars share.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::keys::{self, Key, KeyRing};

type HmacSha256 = Hmac<Sha256>;

/// How long an attestation the proxy signs is good for: it is checked when the `Attach` arrives,
/// a moment after it was signed.
pub const LIFETIME_MS: u64 = 60_000;
/// How far the proxy's clock may run ahead of the gateway's.
pub const MAX_CLOCK_SKEW_MS: u64 = 5_000;
/// Longest attestation read; longer ones are refused unread.
pub const MAX_LEN: usize = keys::MAX_KID_LEN + 1 + 20 + 1 + 64;
const DOMAIN: &[u8] = b"cellmesh attach attestation\0";
/// The public key proxies and sidecars use when no `attest_keys` are set: it lets a process on
/// its own attach with nothing configured, and is refused for a mesh listener off loopback.
pub const DEFAULT_KEY: &str = "dev:dev-attest-change-me";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttestError {
    #[error("attach carries no attestation")]
    Missing,
    #[error("malformed attestation: {0}")]
    Malformed(&'static str),
    #[error("attestation signed under key `{0}`, which this gateway does not accept")]
    UnknownKey(String),
    #[error("attestation does not match (forged, or made for another account or session)")]
    BadSignature,
    #[error("attestation expired {ago_ms} ms ago")]
    Expired { ago_ms: u64 },
    #[error("attestation runs {ahead_ms} ms past the longest lifetime a proxy gives")]
    TooLongLived { ahead_ms: u64 },
}

impl AttestError {
    /// A short, stable name for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Malformed(_) => "malformed",
            Self::UnknownKey(_) => "unknown_kid",
            Self::BadSignature => "bad_signature",
            Self::Expired { .. } => "expired",
            Self::TooLongLived { .. } => "too_long_lived",
        }
    }
}

fn mac(key: &Key, account: &str, session_id: u64, expiry_unix_ms: u64) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(&key.secret).expect("HMAC takes a key of any length");
    m.update(DOMAIN);
    m.update(key.kid.as_bytes());
    m.update(&[0]);
    // Length-prefixed, so no account can be spelled to collide with another's fields.
    m.update(&(account.len() as u64).to_be_bytes());
    m.update(account.as_bytes());
    m.update(&session_id.to_be_bytes());
    m.update(&expiry_unix_ms.to_be_bytes());
    m
}

/// Attests that `account` may attach as `session_id` until `now_unix_ms` + [`LIFETIME_MS`].
pub fn sign(key: &Key, account: &str, session_id: u64, now_unix_ms: u64) -> String {
    let expiry = now_unix_ms.saturating_add(LIFETIME_MS);
    let tag = hex::encode(
        mac(key, account, session_id, expiry)
            .finalize()
            .into_bytes(),
    );
    format!("{}.{expiry}.{tag}", key.kid)
}

/// Checks that `attestation` lets `account` attach as `session_id` at `now_unix_ms`.
pub fn verify(
    ring: &KeyRing,
    attestation: &str,
    account: &str,
    session_id: u64,
    now_unix_ms: u64,
) -> Result<(), AttestError> {
    if attestation.is_empty() {
        return Err(AttestError::Missing);
    }
    if attestation.len() > MAX_LEN {
        return Err(AttestError::Malformed("too long"));
    }
    let mut parts = attestation.splitn(3, '.');
    let (Some(kid), Some(expiry), Some(tag)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(AttestError::Malformed("not kid.expiry.signature"));
    };
    if !keys::valid_kid(kid) {
        return Err(AttestError::Malformed("key id is not a key id"));
    }
    if !expiry.bytes().all(|b| b.is_ascii_digit()) {
        return Err(AttestError::Malformed("expiry is not a number"));
    }
    let expiry: u64 = expiry
        .parse()
        .map_err(|_| AttestError::Malformed("expiry is not a number"))?;
    let mut raw = [0u8; 32];
    if !tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        || hex::decode_to_slice(tag, &mut raw).is_err()
    {
        return Err(AttestError::Malformed(
            "signature is not 64 lower-case hex digits",
        ));
    }
    let key = ring
        .get(kid)
        .ok_or_else(|| AttestError::UnknownKey(kid.to_string()))?;
    mac(key, account, session_id, expiry)
        .verify_slice(&raw)
        .map_err(|_| AttestError::BadSignature)?;
    if expiry <= now_unix_ms {
        return Err(AttestError::Expired {
            ago_ms: now_unix_ms - expiry,
        });
    }
    let latest = now_unix_ms + LIFETIME_MS + MAX_CLOCK_SKEW_MS;
    if expiry > latest {
        return Err(AttestError::TooLongLived {
            ahead_ms: expiry - latest,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000_000;

    fn ring(entries: &[&str]) -> KeyRing {
        let entries: Vec<String> = entries.iter().map(|e| e.to_string()).collect();
        KeyRing::parse(&entries, "").unwrap()
    }

    #[test]
    fn an_attestation_admits_its_account_and_session_only() {
        let r = ring(&["a1:shared"]);
        let a = sign(r.signing(), "alice.smith", 7, NOW);
        assert!(a.len() <= MAX_LEN);
        assert_eq!(verify(&r, &a, "alice.smith", 7, NOW + 1), Ok(()));
        assert_eq!(
            verify(&r, &a, "mallory", 7, NOW),
            Err(AttestError::BadSignature)
        );
        assert_eq!(
            verify(&r, &a, "alice.smith", 8, NOW),
            Err(AttestError::BadSignature)
        );
        assert_eq!(
            verify(&r, "", "alice.smith", 7, NOW),
            Err(AttestError::Missing)
        );
        assert_eq!(
            verify(&ring(&["a1:other"]), &a, "alice.smith", 7, NOW),
            Err(AttestError::BadSignature)
        );
        assert_eq!(
            verify(&ring(&["a2:shared"]), &a, "alice.smith", 7, NOW),
            Err(AttestError::UnknownKey("a1".into()))
        );
    }

    #[test]
    fn an_attestation_lives_a_minute() {
        let r = ring(&["a1:shared"]);
        let a = sign(r.signing(), "alice", 7, NOW);
        assert_eq!(
            verify(&r, &a, "alice", 7, NOW + LIFETIME_MS),
            Err(AttestError::Expired { ago_ms: 0 })
        );
        // Signed by a proxy whose clock runs far ahead: refused rather than honoured for long.
        let ahead = sign(r.signing(), "alice", 7, NOW + MAX_CLOCK_SKEW_MS + 1);
        assert_eq!(
            verify(&r, &ahead, "alice", 7, NOW),
            Err(AttestError::TooLongLived { ahead_ms: 1 })
        );
        for bad in [
            "a1",
            "a1.x.00",
            "a1.+5.00",
            "1a.5.00",
            a.to_uppercase().as_str(),
        ] {
            assert!(
                matches!(
                    verify(&r, bad, "alice", 7, NOW),
                    Err(AttestError::Malformed(_))
                ),
                "{bad}"
            );
        }
    }
}
