//! Edge login tokens: `<account>.<expiry unix seconds>.<hex HMAC-SHA256>` where the MAC covers
//! `<account>.<expiry>` under a secret shared by the login service and the proxies.

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

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
    let tag = hex::decode(tag).map_err(|_| TokenError::Malformed("signature is not hex"))?;
    mac(secret, &format!("{account}.{expiry}"))
        .verify_slice(&tag)
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
}
