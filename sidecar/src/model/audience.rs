//! The one audience resolver of the node: who may see a component or an event (docs/mesh.md#routing-by-account).
//!
//! A session of account A sees a component of an entity owned by `owner` when:
//!
//! | audience | rule |
//! |---|---|
//! | `PUBLIC_IN_RANGE` | the entity is in the session's view |
//! | `OWNER_ONLY` | A is the owner |
//! | `ACCOUNTS(list)` | A is listed |
//! | `OWNER_AND_PARTY(list)` | A is the owner or listed |
//!
//! Every kind but the public one reaches its accounts wherever the entity is.

use std::sync::Arc;

use cellmesh_proto::local;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Audience {
    #[default]
    PublicInRange,
    OwnerOnly,
    Accounts(Arc<[String]>),
    OwnerAndParty(Arc<[String]>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown audience kind {0}")]
pub struct UnknownAudienceKind(pub i32);

impl Audience {
    /// From the wire form; an absent audience is public (the proto3 default kind).
    pub fn from_proto(a: Option<&local::Audience>) -> Result<Self, UnknownAudienceKind> {
        let Some(a) = a else {
            return Ok(Audience::PublicInRange);
        };
        let kind =
            local::AudienceKind::try_from(a.kind).map_err(|_| UnknownAudienceKind(a.kind))?;
        Ok(match kind {
            local::AudienceKind::PublicInRange => Audience::PublicInRange,
            local::AudienceKind::OwnerOnly => Audience::OwnerOnly,
            local::AudienceKind::Accounts => Audience::Accounts(a.accounts.clone().into()),
            local::AudienceKind::OwnerAndParty => {
                Audience::OwnerAndParty(a.accounts.clone().into())
            }
        })
    }

    /// The kind and accounts, as the mesh carries them in a handoff.
    pub fn to_wire(&self) -> (local::AudienceKind, Vec<String>) {
        match self {
            Audience::PublicInRange => (local::AudienceKind::PublicInRange, vec![]),
            Audience::OwnerOnly => (local::AudienceKind::OwnerOnly, vec![]),
            Audience::Accounts(l) => (local::AudienceKind::Accounts, l.to_vec()),
            Audience::OwnerAndParty(l) => (local::AudienceKind::OwnerAndParty, l.to_vec()),
        }
    }

    pub fn from_wire(kind: i32, accounts: &[String]) -> Result<Self, UnknownAudienceKind> {
        Self::from_proto(Some(&local::Audience {
            kind,
            accounts: accounts.to_vec(),
        }))
    }

    pub fn is_public(&self) -> bool {
        matches!(self, Audience::PublicInRange)
    }

    /// Whether a session of `account` may see this, for an entity owned by `owner` (empty for
    /// none) that is (`in_range`) or is not in that session's view.
    pub fn admits(&self, account: &str, owner: &str, in_range: bool) -> bool {
        let is_owner = !owner.is_empty() && account == owner;
        match self {
            Audience::PublicInRange => in_range,
            Audience::OwnerOnly => is_owner,
            Audience::Accounts(list) => list.iter().any(|a| a == account),
            Audience::OwnerAndParty(list) => is_owner || list.iter().any(|a| a == account),
        }
    }

    /// The accounts this audience reaches regardless of range (what routing by account
    /// delivers); empty for the public kind. May repeat an account.
    pub fn named_accounts<'a>(&'a self, owner: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        let owner_part = match self {
            Audience::OwnerOnly | Audience::OwnerAndParty(_) if !owner.is_empty() => Some(owner),
            _ => None,
        };
        let listed: &[String] = match self {
            Audience::Accounts(list) | Audience::OwnerAndParty(list) => list,
            _ => &[],
        };
        owner_part
            .into_iter()
            .chain(listed.iter().map(String::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(a: &[&str]) -> Arc<[String]> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn public_in_range_only_in_range() {
        let a = Audience::PublicInRange;
        assert!(a.admits("bob", "alice", true));
        assert!(
            !a.admits("alice", "alice", false),
            "not even the owner out of range"
        );
        assert_eq!(a.named_accounts("alice").count(), 0);
    }

    #[test]
    fn owner_only_wherever_it_is() {
        let a = Audience::OwnerOnly;
        assert!(a.admits("alice", "alice", false));
        assert!(!a.admits("bob", "alice", true));
        assert!(!a.admits("", "", true), "an NPC has no owner to see it");
        assert_eq!(a.named_accounts("alice").collect::<Vec<_>>(), ["alice"]);
        assert_eq!(a.named_accounts("").count(), 0);
    }

    #[test]
    fn accounts_exactly_the_list() {
        let a = Audience::Accounts(list(&["bob", "carol"]));
        assert!(a.admits("bob", "alice", false));
        assert!(
            !a.admits("alice", "alice", true),
            "the owner is not implied"
        );
        assert!(!a.admits("dave", "alice", true));
        assert_eq!(
            a.named_accounts("alice").collect::<Vec<_>>(),
            ["bob", "carol"]
        );
    }

    #[test]
    fn owner_and_party() {
        let a = Audience::OwnerAndParty(list(&["bob"]));
        assert!(a.admits("alice", "alice", false));
        assert!(a.admits("bob", "alice", false));
        assert!(!a.admits("carol", "alice", true));
        assert_eq!(
            a.named_accounts("alice").collect::<Vec<_>>(),
            ["alice", "bob"]
        );
    }

    #[test]
    fn wire_conversion() {
        assert_eq!(Audience::from_proto(None), Ok(Audience::PublicInRange));
        let wire = local::Audience {
            kind: local::AudienceKind::Accounts as i32,
            accounts: vec!["x".into()],
        };
        assert_eq!(
            Audience::from_proto(Some(&wire)),
            Ok(Audience::Accounts(list(&["x"])))
        );
        let bad = local::Audience {
            kind: 42,
            accounts: vec![],
        };
        assert_eq!(
            Audience::from_proto(Some(&bad)),
            Err(UnknownAudienceKind(42))
        );
    }
}
