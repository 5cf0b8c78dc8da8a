//! Admission of a client's `ClientHello`: protocol version, then the login token's claim and the
//! proof, over this connection's challenge, that the client holds the token.

use cellmesh_proto::edge::{ClientHello, Kick, KickReason};
use cellmesh_proto::keys::KeyRing;
use cellmesh_proto::token::{self, TokenError};
use cellmesh_proto::{PROTOCOL_MAJOR, PROTOCOL_MINOR};

/// Why a hello was refused: the kick the client gets, and for a token, the kind counted.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub kick: Kick,
    pub token_kind: Option<&'static str>,
}

/// Returns the account the hello proves on the connection whose challenge was `nonce`, or why it
/// is refused. `now_unix` in seconds.
pub(crate) fn admit(
    hello: &ClientHello,
    ring: &KeyRing,
    nonce: &[u8],
    now_unix: u64,
) -> Result<String, Refusal> {
    check_version(hello).map_err(|kick| Refusal {
        kick,
        token_kind: None,
    })?;
    let checked = if hello.token.is_empty() {
        token::verify_proof(ring, &hello.claim, &hello.proof, nonce, now_unix)
    } else {
        // A whole token on the wire is a bearer token anyone who saw it could replay.
        Err(TokenError::Bearer)
    };
    checked.map_err(|e| {
        let reason = match e {
            TokenError::Expired { .. } => KickReason::ExpiredToken,
            TokenError::Malformed(_)
            | TokenError::BadSignature
            | TokenError::UnknownKey(_)
            | TokenError::Bearer
            | TokenError::BadProof => KickReason::BadToken,
        };
        Refusal {
            kick: Kick::new(reason, e.to_string()),
            token_kind: Some(e.kind()),
        }
    })
}

/// Refuses a hello of another major version, by name.
pub(crate) fn check_version(hello: &ClientHello) -> Result<(), Kick> {
    let (major, minor) = hello
        .version
        .as_ref()
        .map_or((0, 0), |v| (v.major, v.minor));
    if major != PROTOCOL_MAJOR {
        return Err(Kick::new(
            KickReason::VersionMismatch,
            format!(
                "client protocol {major}.{minor}, proxy speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cellmesh_proto::edge::ProtocolVersion;

    const NONCE: &[u8] = b"this connection";

    fn hello(token: String, major: u32) -> ClientHello {
        let (claim, proof) = token::prove(&token, NONCE).unwrap_or_default();
        ClientHello {
            version: Some(ProtocolVersion { major, minor: 3 }),
            claim,
            proof: proof.to_vec().into(),
            ..Default::default()
        }
    }

    fn reason(k: &Kick) -> KickReason {
        KickReason::try_from(k.reason).unwrap()
    }

    #[test]
    fn good_token_names_the_account() {
        let t = token::sign(b"k", "alice", 100);
        assert_eq!(
            admit(&hello(t, PROTOCOL_MAJOR), &KeyRing::single(b"k"), NONCE, 99).unwrap(),
            "alice"
        );
    }

    #[test]
    fn refusals_carry_the_right_reason() {
        let t = token::sign(b"k", "alice", 100);
        let k = admit(
            &hello(t.clone(), PROTOCOL_MAJOR),
            &KeyRing::single(b"other"),
            NONCE,
            99,
        )
        .unwrap_err();
        assert_eq!(reason(&k.kick), KickReason::BadToken);
        assert_eq!(k.token_kind, Some("unknown_token_kid"));
        assert!(
            k.kick.detail.contains("does not accept"),
            "{}",
            k.kick.detail
        );
        let k = admit(
            &hello(t.clone(), PROTOCOL_MAJOR),
            &KeyRing::single(b"k"),
            NONCE,
            100,
        )
        .unwrap_err();
        assert_eq!(reason(&k.kick), KickReason::ExpiredToken);
        assert!(k.kick.detail.contains("expired"), "{}", k.kick.detail);
        let k = admit(
            &hello("nonsense".into(), PROTOCOL_MAJOR),
            &KeyRing::single(b"k"),
            NONCE,
            0,
        )
        .unwrap_err();
        assert_eq!(reason(&k.kick), KickReason::BadToken);
        // The same hello on another connection, and a whole token: refused, named.
        let k = admit(
            &hello(t.clone(), PROTOCOL_MAJOR),
            &KeyRing::single(b"k"),
            b"another connection",
            99,
        )
        .unwrap_err();
        assert_eq!(reason(&k.kick), KickReason::BadToken);
        assert_eq!(k.token_kind, Some("bad_token_proof"));
        let bearer = ClientHello {
            token: t,
            ..hello(String::new(), PROTOCOL_MAJOR)
        };
        let k = admit(&bearer, &KeyRing::single(b"k"), NONCE, 99).unwrap_err();
        assert_eq!(reason(&k.kick), KickReason::BadToken);
        assert_eq!(k.token_kind, Some("bearer_token"));
    }

    #[test]
    fn version_is_checked_before_the_token() {
        let t = token::sign(b"k", "alice", 100);
        let k = admit(
            &hello(t, PROTOCOL_MAJOR + 1),
            &KeyRing::single(b"k"),
            NONCE,
            0,
        )
        .unwrap_err();
        assert_eq!(reason(&k.kick), KickReason::VersionMismatch);
        let want = format!(
            "client protocol {}.3, proxy speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}",
            PROTOCOL_MAJOR + 1
        );
        assert_eq!(k.kick.detail, want);
        let none = ClientHello {
            version: None,
            ..Default::default()
        };
        assert_eq!(
            reason(
                &admit(&none, &KeyRing::single(b"k"), NONCE, 0)
                    .unwrap_err()
                    .kick
            ),
            KickReason::VersionMismatch
        );
    }
}
