//! Key rings: every signed credential (login token, hint cookie, probe ticket, attach
//! attestation) names the key it was signed under by a short key id (`kid`), and a reader
//! accepts any key of its ring. A key rotates without a flag day: add the new key to every
//! reader, then make it the signing key, then drop the old one once what it signed expired.
//!
//! A ring is configured as `["kid:secret", ...]` with a signing kid (empty: the first), or as a
//! single secret with no kid, whose kid is derived from the secret ([`derived_kid`]): two
//! processes given the same secret agree on it, and a credential signed under another secret is
//! refused as an unknown key rather than a bad signature.

use sha2::{Digest, Sha256};

/// Longest key id, in bytes.
pub const MAX_KID_LEN: usize = 32;

/// One key of a ring.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    pub kid: String,
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: rings end up in logged configs and panics.
        f.debug_struct("Key").field("kid", &self.kid).finish()
    }
}

/// The keys a reader accepts and the one a writer signs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRing {
    keys: Vec<Key>,
    signing: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyRingError {
    #[error("a key ring needs at least one key")]
    Empty,
    #[error("key `{0}` is not written `kid:secret`")]
    NoKid(String),
    #[error("key id `{0}` is not 1 to {MAX_KID_LEN} of a-z, A-Z, 0-9, `_` and `-`, starting with a letter")]
    BadKid(String),
    #[error("key `{0}` has an empty secret")]
    EmptySecret(String),
    #[error("key id `{0}` appears twice")]
    Duplicate(String),
    #[error("signing key `{0}` is not among the keys")]
    NoSigningKey(String),
}

/// Whether `kid` is a valid key id: it travels inside tokens separated by dots, so none there.
pub fn valid_kid(kid: &str) -> bool {
    !kid.is_empty()
        && kid.len() <= MAX_KID_LEN
        && kid.as_bytes()[0].is_ascii_alphabetic()
        && kid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The kid of a ring made of one bare secret: `s` and 8 hex digits of a labelled SHA-256 of it
/// (32 bits of a hash say nothing useful about a secret worth keeping).
pub fn derived_kid(secret: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(b"cellmesh key id\0");
    h.update(secret);
    format!("s{}", &hex::encode(h.finalize())[..8])
}

impl KeyRing {
    /// A ring of one bare secret, under its [`derived_kid`].
    pub fn single(secret: &[u8]) -> Self {
        Self {
            keys: vec![Key {
                kid: derived_kid(secret),
                secret: secret.to_vec(),
            }],
            signing: 0,
        }
    }

    /// A ring of `key` alone.
    pub fn of(key: Key) -> Self {
        Self {
            keys: vec![key],
            signing: 0,
        }
    }

    /// Parses `["kid:secret", ...]`; `signing` names the signing key (empty: the first).
    pub fn parse(entries: &[String], signing: &str) -> Result<Self, KeyRingError> {
        let mut keys: Vec<Key> = Vec::with_capacity(entries.len());
        for e in entries {
            let Some((kid, secret)) = e.split_once(':') else {
                // Never echo what may be a bare secret.
                return Err(KeyRingError::NoKid(format!("#{}", keys.len() + 1)));
            };
            if !valid_kid(kid) {
                return Err(KeyRingError::BadKid(kid.to_string()));
            }
            if secret.is_empty() {
                return Err(KeyRingError::EmptySecret(kid.to_string()));
            }
            if keys.iter().any(|k| k.kid == kid) {
                return Err(KeyRingError::Duplicate(kid.to_string()));
            }
            keys.push(Key {
                kid: kid.to_string(),
                secret: secret.as_bytes().to_vec(),
            });
        }
        if keys.is_empty() {
            return Err(KeyRingError::Empty);
        }
        let signing = if signing.is_empty() {
            0
        } else {
            keys.iter()
                .position(|k| k.kid == signing)
                .ok_or_else(|| KeyRingError::NoSigningKey(signing.to_string()))?
        };
        Ok(Self { keys, signing })
    }

    /// `entries` when there are any, else the one-key ring of `fallback`.
    pub fn parse_or_single(
        entries: &[String],
        signing: &str,
        fallback: &str,
    ) -> Result<Self, KeyRingError> {
        if entries.is_empty() {
            if !signing.is_empty() {
                return Err(KeyRingError::NoSigningKey(signing.to_string()));
            }
            Ok(Self::single(fallback.as_bytes()))
        } else {
            Self::parse(entries, signing)
        }
    }

    /// The key new credentials are signed with.
    pub fn signing(&self) -> &Key {
        &self.keys[self.signing]
    }

    /// The key of id `kid`, if this ring accepts it.
    pub fn get(&self, kid: &str) -> Option<&Key> {
        self.keys.iter().find(|k| k.kid == kid)
    }

    pub fn keys(&self) -> &[Key] {
        &self.keys
    }

    /// Whether any key's secret is `secret` (a public default must not be used off loopback).
    pub fn contains_secret(&self, secret: &[u8]) -> bool {
        self.keys.iter().any(|k| k.secret == secret)
    }
}

/// `entries` with each secret replaced by `***`, for printing a configuration.
pub fn masked(entries: &[String]) -> Vec<String> {
    entries
        .iter()
        .map(|e| match e.split_once(':') {
            Some((kid, _)) => format!("{kid}:***"),
            None => "***".to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn parses_and_picks_the_signing_key() {
        let r = KeyRing::parse(&s(&["k1:one", "k2:two:with-colon"]), "k2").unwrap();
        assert_eq!(r.signing().kid, "k2");
        assert_eq!(r.signing().secret, b"two:with-colon");
        assert_eq!(r.get("k1").unwrap().secret, b"one");
        assert!(r.get("k3").is_none());
        let first = KeyRing::parse(&s(&["k1:one", "k2:two"]), "").unwrap();
        assert_eq!(first.signing().kid, "k1");
    }

    #[test]
    fn bad_rings_are_named_without_their_secrets() {
        let e = |v: &[&str], signing: &str| KeyRing::parse(&s(v), signing).unwrap_err();
        assert_eq!(e(&[], ""), KeyRingError::Empty);
        let bare = e(&["just-a-secret"], "").to_string();
        assert!(!bare.contains("just-a-secret"), "{bare}");
        assert_eq!(e(&["1k:x"], ""), KeyRingError::BadKid("1k".into()));
        assert_eq!(e(&["a.b:x"], ""), KeyRingError::BadKid("a.b".into()));
        assert_eq!(e(&["k:"], ""), KeyRingError::EmptySecret("k".into()));
        assert_eq!(e(&["k:x", "k:y"], ""), KeyRingError::Duplicate("k".into()));
        assert_eq!(e(&["k:x"], "j"), KeyRingError::NoSigningKey("j".into()));
    }

    #[test]
    fn a_bare_secret_is_a_ring_of_one_under_a_derived_kid() {
        let r = KeyRing::parse_or_single(&[], "", "s3cret").unwrap();
        assert_eq!(r.signing().kid, derived_kid(b"s3cret"));
        assert!(valid_kid(&r.signing().kid));
        assert_ne!(derived_kid(b"s3cret"), derived_kid(b"other"));
        assert_eq!(
            masked(&s(&["k1:one", "bare"])),
            s(&["k1:***", "***"]),
            "secrets masked"
        );
    }
}
