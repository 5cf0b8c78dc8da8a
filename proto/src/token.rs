//! Edge login tokens: `<account>.<expiry unix seconds>.<hex HMAC-SHA256>` where the MAC covers
//! `<account>.<expiry>` under a secret shared by the login service and the proxies.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Longest token [`verify`] reads: longer ones are refused before any parsing, so a hostile
/// `ClientHello` costs a length check.
pub const MAX_TOKEN_LEN: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("malformed token: {0}")]
    Malformed(&'static str),
    #[error("token signature does not match")]
    BadSignature,
    #[error("token expired at {expiry} (now {now})")]
    Expired { expiry: u64, now: u64 },
}

fn mac(secret: &[u8], signed: &str) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(signed.as_bytes());
    mac
}

/// Signs a token for `account` valid until `expiry_unix` (seconds).
pub fn sign(secret: &[u8], account: &str, expiry_unix: u64) -> String {
    let signed = format!("{account}.{expiry_unix}");
    let tag = hex::encode(mac(secret, &signed).finalize().into_bytes());
    format!("{signed}.{tag}")
}

/// Checks a token's signature and expiry at `now_unix`; returns the account it names.
pub fn verify(secret: &[u8], token: &str, now_unix: u64) -> Result<String, TokenError> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(TokenError::Malformed("token too long"));
    }
    let mut parts = token.rsplitn(3, '.');
    let tag = parts.next().ok_or(TokenError::Malformed("no signature"))?;
    let expiry = parts.next().ok_or(TokenError::Malformed("no expiry"))?;
    let account = parts.next().ok_or(TokenError::Malformed("no account"))?;
    if account.is_empty() {
        return Err(TokenError::Malformed("empty account"));
    }
    let expiry: u64 = expiry
        .parse()
        .map_err(|_| TokenError::Malformed("expiry is not a number"))?;
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
    // The MAC covers the text as received, not as re-printed from the parsed expiry: a `+` or
    // zeros before it would otherwise pass as the same token.
    let signed = &token[..token.len() - tag.len() - 1];
    mac(secret, signed)
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
        assert_eq!(verify(b"other", &t, 999), Err(TokenError::BadSignature));
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
        let upper = format!("{signed}.{}", tag.to_uppercase());
        assert!(matches!(
            verify(b"s3cret", &upper, 999),
            Err(TokenError::Malformed(_))
        ));
        for expiry in ["+1000", "01000"] {
            let respelled = format!("alice.{expiry}.{tag}");
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
        let longest = sign(b"s3cret", &"a".repeat(MAX_TOKEN_LEN - 70), 1000);
        assert_eq!(longest.len(), MAX_TOKEN_LEN);
        assert!(verify(b"s3cret", &longest, 999).is_ok());
    }
}
