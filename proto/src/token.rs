//! Edge login tokens: `<account>.<expiry unix seconds>.<kid>.<hex HMAC-SHA256>` where the MAC
//! covers `<account>.<expiry>.<kid>` under the key `kid` names in the ring shared by the login
//! service and the proxies (`crate::keys`). The client treats the token as opaque.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::keys::{self, Key, KeyRing};

type HmacSha256 = Hmac<Sha256>;

/// Longest token [`verify`] reads: longer ones are refused before any parsing, so a hostile
/// `ClientHello` costs a length check.
pub const MAX_TOKEN_LEN: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("malformed token: {0}")]
    Malformed(&'static str),
    #[error("token signed under key `{0}`, which this proxy does not accept (retired, or not yet rolled out)")]
    UnknownKey(String),
    #[error("token signature does not match")]
    BadSignature,
    #[error("token expired at {expiry} (now {now})")]
    Expired { expiry: u64, now: u64 },
}

impl TokenError {
    /// A short, stable name for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenError::Malformed(_) => "malformed_token",
            TokenError::UnknownKey(_) => "unknown_token_kid",
            TokenError::BadSignature => "bad_token_signature",
            TokenError::Expired { .. } => "expired_token",
        }
    }
}

fn mac(secret: &[u8], signed: &str) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(signed.as_bytes());
    mac
}

/// Signs a token for `account` valid until `expiry_unix` (seconds) under the one-key ring of
/// `secret` (see [`KeyRing::single`]).
pub fn sign(secret: &[u8], account: &str, expiry_unix: u64) -> String {
    sign_with(KeyRing::single(secret).signing(), account, expiry_unix)
}

/// Signs a token for `account` valid until `expiry_unix` (seconds) under `key`.
pub fn sign_with(key: &Key, account: &str, expiry_unix: u64) -> String {
    let signed = format!("{account}.{expiry_unix}.{}", key.kid);
    let tag = hex::encode(mac(&key.secret, &signed).finalize().into_bytes());
    format!("{signed}.{tag}")
}

/// [`verify_ring`] with the one-key ring of `secret`.
pub fn verify(secret: &[u8], token: &str, now_unix: u64) -> Result<String, TokenError> {
    verify_ring(&KeyRing::single(secret), token, now_unix)
}

/// Checks a token's key, signature and expiry at `now_unix`; returns the account it names.
pub fn verify_ring(ring: &KeyRing, token: &str, now_unix: u64) -> Result<String, TokenError> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(TokenError::Malformed("token too long"));
    }
    let mut parts = token.rsplitn(4, '.');
    let tag = parts.next().ok_or(TokenError::Malformed("no signature"))?;
    let kid = parts.next().ok_or(TokenError::Malformed("no key id"))?;
    let expiry = parts.next().ok_or(TokenError::Malformed("no expiry"))?;
    let account = parts.next().ok_or(TokenError::Malformed("no account"))?;
    if account.is_empty() {
        return Err(TokenError::Malformed("empty account"));
    }
    let expiry: u64 = expiry
        .parse()
        .map_err(|_| TokenError::Malformed("expiry is not a number"))?;
    if !keys::valid_kid(kid) {
        return Err(TokenError::Malformed("key id is not a key id"));
    }
    // Only the signer's own spelling of the tag: `hex` would also take upper case, so one token
    // could be written many ways.
    let mut raw_tag = [0u8; 32];
    if !tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        || hex::decode_to_slice(tag, &mut raw_tag).is_err()
    {
        return Err(TokenError::Malformed(
            "signature is not 64 lower-case hex digits",
        ));
    }
    let key = ring
        .get(kid)
        .ok_or_else(|| TokenError::UnknownKey(kid.to_string()))?;
    // The MAC covers the text as received, not as re-printed from the parsed expiry: a `+` or
    // zeros before it would otherwise pass as the same token.
    let signed = &token[..token.len() - tag.len() - 1];
    mac(&key.secret, signed)
        .verify_slice(&raw_tag)
        .map_err(|_| TokenError::BadSignature)?;
    if expiry <= now_unix {
        return Err(TokenError::Expired {
            expiry,
            now: now_unix,
        });
    }
    Ok(account.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_failures() {
        let t = sign(b"s3cret", "alice.smith", 1000);
        assert_eq!(verify(b"s3cret", &t, 999).unwrap(), "alice.smith");
        assert!(matches!(
            verify(b"other", &t, 999),
            Err(TokenError::UnknownKey(_))
        ));
        assert_eq!(
            verify(b"s3cret", &t, 1000),
            Err(TokenError::Expired {
                expiry: 1000,
                now: 1000
            })
        );
        let forged = t.replace("alice.smith", "mallory");
        assert_eq!(
            verify(b"s3cret", &forged, 999),
            Err(TokenError::BadSignature)
        );
        assert!(matches!(
            verify(b"s3cret", "garbage", 0),
            Err(TokenError::Malformed(_))
        ));
        assert!(matches!(
            verify(b"s3cret", "a.b.zz", 0),
            Err(TokenError::Malformed(_))
        ));
    }

    #[test]
    fn only_the_signers_spelling_is_accepted() {
        let t = sign(b"s3cret", "alice", 1000);
        let (signed, tag) = t.rsplit_once('.').unwrap();
        let kid = crate::keys::derived_kid(b"s3cret");
        let upper = format!("{signed}.{}", tag.to_uppercase());
        assert!(matches!(
            verify(b"s3cret", &upper, 999),
            Err(TokenError::Malformed(_))
        ));
        for expiry in ["+1000", "01000"] {
            let respelled = format!("alice.{expiry}.{kid}.{tag}");
            assert_eq!(
                verify(b"s3cret", &respelled, 999),
                Err(TokenError::BadSignature),
                "{respelled}"
            );
        }
    }

    #[test]
    fn too_long_is_refused_before_parsing() {
        let long = sign(b"s3cret", &"a".repeat(MAX_TOKEN_LEN), 1000);
        assert_eq!(
            verify(b"s3cret", &long, 999),
            Err(TokenError::Malformed("token too long"))
        );
        let longest = sign(b"s3cret", &"a".repeat(MAX_TOKEN_LEN - 80), 1000);
        assert_eq!(longest.len(), MAX_TOKEN_LEN);
        assert!(verify(b"s3cret", &longest, 999).is_ok());
    }

    fn ring(entries: &[&str], signing: &str) -> KeyRing {
        let entries: Vec<String> = entries.iter().map(|e| e.to_string()).collect();
        KeyRing::parse(&entries, signing).unwrap()
    }

    #[test]
    fn a_key_rotates_without_a_flag_day() {
        let old = ring(&["k1:one"], "");
        let both = ring(&["k1:one", "k2:two"], "k2");
        let new = ring(&["k2:two"], "");
        let by_k1 = sign_with(old.signing(), "alice", 1000);
        let by_k2 = sign_with(both.signing(), "alice", 1000);
        assert!(by_k2.starts_with("alice.1000.k2."), "{by_k2}");
        // During the rotation: both accepted, the new one signs.
        assert_eq!(verify_ring(&both, &by_k1, 999).unwrap(), "alice");
        assert_eq!(verify_ring(&both, &by_k2, 999).unwrap(), "alice");
        // Before the new key reached this proxy, and after the old one retired.
        assert_eq!(
            verify_ring(&old, &by_k2, 999),
            Err(TokenError::UnknownKey("k2".into()))
        );
        let retired = verify_ring(&new, &by_k1, 999).unwrap_err();
        assert_eq!(retired, TokenError::UnknownKey("k1".into()));
        assert_eq!(retired.kind(), "unknown_token_kid");
        // A kid names the key; claiming another key's id does not borrow its secret.
        let forged = by_k1.replacen(".k1.", ".k2.", 1);
        assert_eq!(
            verify_ring(&both, &forged, 999),
            Err(TokenError::BadSignature)
        );
        // The old, kid-less layout is refused by name.
        let kidless = format!("alice.1000.{}", by_k1.rsplit_once('.').unwrap().1);
        assert!(matches!(
            verify_ring(&both, &kidless, 999),
            Err(TokenError::Malformed(_))
        ));
    }
}
