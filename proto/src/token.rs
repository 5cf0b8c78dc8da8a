//! Edge login tokens: `<account>.<expiry unix seconds>.<kid>.<hex HMAC-SHA256>` where the MAC
//! covers `<account>.<expiry>.<kid>` under the key `kid` names in the ring shared by the login
//! service and the proxies (`crate::keys`).
//!
//! A client never sends its token whole: it sends the claim (`<account>.<expiry>.<kid>`) and a
//! proof, an HMAC keyed by the token's signature over the proxy's per-connection challenge
//! ([`prove`], [`verify_proof`]). The signature is the client's secret; a proof seen on the wire
//! is worth nothing on another connection, so a sniffed login cannot be replayed.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::keys::{self, Key, KeyRing};

type HmacSha256 = Hmac<Sha256>;

/// Longest token [`verify`] reads: longer ones are refused before any parsing, so a hostile
/// `ClientHello` costs a length check.
pub const MAX_TOKEN_LEN: usize = 1024;

/// What a proof is computed over, before the challenge's nonce.
const PROOF_LABEL: &[u8] = b"cellmesh-login-proof\0";

/// Bytes of a proof (HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("malformed token: {0}")]
    Malformed(&'static str),
    #[error("the login token was sent whole: clients send its claim and a proof against the proxy's challenge (edge protocol 1.7)")]
    Bearer,
    #[error(
        "the login proof does not match this connection's challenge (a replayed or forged login)"
    )]
    BadProof,
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
            TokenError::Bearer => "bearer_token",
            TokenError::BadProof => "bad_token_proof",
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

/// A claim's parts: the account, the expiry and the key id, as written.
struct Claim<'a> {
    account: &'a str,
    expiry: u64,
    kid: &'a str,
}

fn parse_claim(claim: &str) -> Result<Claim<'_>, TokenError> {
    let mut parts = claim.rsplitn(3, '.');
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
    Ok(Claim {
        account,
        expiry,
        kid,
    })
}

/// Splits a whole token into its claim and its raw signature.
fn split_token(token: &str) -> Result<(&str, [u8; 32]), TokenError> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(TokenError::Malformed("token too long"));
    }
    let (claim, tag) = token
        .rsplit_once('.')
        .ok_or(TokenError::Malformed("no signature"))?;
    Ok((claim, parse_tag(tag)?))
}

/// Only the signer's own spelling of the tag: `hex` would also take upper case, so one token
/// could be written many ways.
fn parse_tag(tag: &str) -> Result<[u8; 32], TokenError> {
    let mut raw_tag = [0u8; 32];
    if !tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        || hex::decode_to_slice(tag, &mut raw_tag).is_err()
    {
        return Err(TokenError::Malformed(
            "signature is not 64 lower-case hex digits",
        ));
    }
    Ok(raw_tag)
}

/// The signature the ring gives `claim`, and the claim's parts. The MAC covers the text as
/// received, not as re-printed from the parsed expiry: a `+` or zeros before it would otherwise
/// pass as the same token.
fn signature_of<'a>(ring: &KeyRing, claim: &'a str) -> Result<(Claim<'a>, HmacSha256), TokenError> {
    let parsed = parse_claim(claim)?;
    let key = ring
        .get(parsed.kid)
        .ok_or_else(|| TokenError::UnknownKey(parsed.kid.to_string()))?;
    Ok((parsed, mac(&key.secret, claim)))
}

fn not_expired(claim: &Claim<'_>, now_unix: u64) -> Result<String, TokenError> {
    if claim.expiry <= now_unix {
        return Err(TokenError::Expired {
            expiry: claim.expiry,
            now: now_unix,
        });
    }
    Ok(claim.account.to_string())
}

/// Checks a whole token's key, signature and expiry at `now_unix`; returns the account it
/// names. For tools (`cellmesh token`); the proxy takes only [`verify_proof`].
pub fn verify_ring(ring: &KeyRing, token: &str, now_unix: u64) -> Result<String, TokenError> {
    let (claim, raw_tag) = split_token(token)?;
    let (parsed, expected) = signature_of(ring, claim)?;
    expected
        .verify_slice(&raw_tag)
        .map_err(|_| TokenError::BadSignature)?;
    not_expired(&parsed, now_unix)
}

fn proof_mac(signature: &[u8], nonce: &[u8]) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(signature).expect("HMAC takes a key of any length");
    m.update(PROOF_LABEL);
    m.update(nonce);
    m
}

/// The client's side: the claim to send and the proof of holding `token`'s signature, for the
/// proxy's challenge `nonce`.
pub fn prove(token: &str, nonce: &[u8]) -> Result<(String, [u8; PROOF_LEN]), TokenError> {
    let (claim, raw_tag) = split_token(token)?;
    let proof = proof_mac(&raw_tag, nonce).finalize().into_bytes().into();
    Ok((claim.to_string(), proof))
}

/// The proxy's side: checks that `proof` was made with the signature the ring gives `claim`,
/// over this connection's `nonce`, and that the claim has not expired at `now_unix`; returns the
/// account. A claim that is a whole token is refused as [`TokenError::Bearer`].
pub fn verify_proof(
    ring: &KeyRing,
    claim: &str,
    proof: &[u8],
    nonce: &[u8],
    now_unix: u64,
) -> Result<String, TokenError> {
    if claim.len() > MAX_TOKEN_LEN {
        return Err(TokenError::Malformed("token too long"));
    }
    if claim
        .rsplit_once('.')
        .is_some_and(|(_, last)| parse_tag(last).is_ok())
    {
        return Err(TokenError::Bearer);
    }
    let (parsed, expected) = signature_of(ring, claim)?;
    let signature = expected.finalize().into_bytes();
    // Compared in constant time by the MAC's own check.
    proof_mac(&signature, nonce)
        .verify_slice(proof)
        .map_err(|_| TokenError::BadProof)?;
    not_expired(&parsed, now_unix)
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

    #[test]
    fn a_proof_holds_for_its_challenge_only() {
        let ring = KeyRing::single(b"s3cret");
        let t = sign(b"s3cret", "alice", 1000);
        let (claim, proof) = prove(&t, b"nonce-1").unwrap();
        assert!(!claim.contains(t.rsplit_once('.').unwrap().1));
        assert_eq!(
            verify_proof(&ring, &claim, &proof, b"nonce-1", 999).unwrap(),
            "alice"
        );
        // The same hello on another connection: refused.
        assert_eq!(
            verify_proof(&ring, &claim, &proof, b"nonce-2", 999),
            Err(TokenError::BadProof)
        );
        // A claim for another account with this token's proof: refused.
        let other = claim.replacen("alice", "bob", 1);
        assert_eq!(
            verify_proof(&ring, &other, &proof, b"nonce-1", 999),
            Err(TokenError::BadProof)
        );
        // The whole token where the claim goes: refused by name, whatever the proof.
        let bearer = verify_proof(&ring, &t, &proof, b"nonce-1", 999).unwrap_err();
        assert_eq!(bearer, TokenError::Bearer);
        assert_eq!(bearer.kind(), "bearer_token");
        // Expiry and keys as for a whole token.
        assert!(matches!(
            verify_proof(&ring, &claim, &proof, b"nonce-1", 1000),
            Err(TokenError::Expired { .. })
        ));
        assert!(matches!(
            verify_proof(&KeyRing::single(b"other"), &claim, &proof, b"nonce-1", 999),
            Err(TokenError::UnknownKey(_))
        ));
        assert!(matches!(
            verify_proof(&ring, "", &proof, b"nonce-1", 0),
            Err(TokenError::Malformed(_))
        ));
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
