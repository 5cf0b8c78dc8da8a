//! Routing by account (docs/mesh.md#routing-by-account): what the owner of an entity sends to the gateways of the
//! accounts its non-public components, events and messages name.
//!
//! - `OWNER_ONLY` goes to the owner account's gateway; `ACCOUNTS` and `OWNER_AND_PARTY` are
//!   grouped by gateway node: one `Routed` message per node and tick, however many of its
//!   accounts are named. `PUBLIC_IN_RANGE` never comes here: it follows chunk subscriptions.
//! - Each piece is encoded once; every gateway's copy shares the same bytes.
//! - Accounts with a session on this node are left to the local fold; accounts with no known
//!   route are handed back to be looked up (and dropped, counted, if the directory has none).
//!
//! Pure: the caller passes the route of each account.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use cellmesh_proto::local::AudienceKind;
use cellmesh_proto::mesh::{PieceKind, Recipient, Routed, RoutedPiece};
use cellmesh_world::partition::NodeId;

use crate::model::audience::Audience;
use crate::model::entities::{Entity, EntityChange};

/// Where an account's session is, as far as this node knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A session on this node: the local fold delivers.
    Local,
    Remote {
        gateway: NodeId,
        session_epoch: u64,
    },
    /// Not known yet: look it up.
    Unknown,
}

/// A piece of a client batch addressed to accounts, encoded once.
#[derive(Debug, Clone, PartialEq)]
pub struct Addressed {
    pub kind: PieceKind,
    pub audience: AudienceKind,
    pub encoded: Bytes,
    pub accounts: Vec<String>,
}

#[derive(Debug, Default)]
pub struct Resolved {
    /// One message per gateway node.
    pub per_gateway: BTreeMap<NodeId, Routed>,
    /// Accounts with no known route, with the index of the piece that names them.
    pub unknown: Vec<(String, usize)>,
}

/// Groups `pieces` by the gateway of each named account.
pub fn resolve(pieces: &[Addressed], route: impl Fn(&str) -> Target) -> Resolved {
    let mut out = Resolved::default();
    for (index, p) in pieces.iter().enumerate() {
        let accounts: BTreeSet<&str> = p.accounts.iter().map(String::as_str).collect();
        let mut by_gateway: BTreeMap<NodeId, Vec<Recipient>> = BTreeMap::new();
        for account in accounts {
            match route(account) {
                Target::Local => {}
                Target::Remote {
                    gateway,
                    session_epoch,
                } => by_gateway.entry(gateway).or_default().push(Recipient {
                    account: account.to_string(),
                    session_epoch,
                }),
                Target::Unknown => out.unknown.push((account.to_string(), index)),
            }
        }
        for (gateway, recipients) in by_gateway {
            out.per_gateway
                .entry(gateway)
                .or_default()
                .pieces
                .push(piece(p, recipients));
        }
    }
    out
}

/// The wire form of `p` for `recipients` (the bytes are shared, not copied).
pub fn piece(p: &Addressed, recipients: Vec<Recipient>) -> RoutedPiece {
    RoutedPiece {
        kind: p.kind as i32,
        encoded: p.encoded.clone(),
        recipients,
        audience: p.audience as u32,
    }
}

/// The audience kind of a component, for metrics and the wire.
pub fn kind_of(a: &Audience) -> AudienceKind {
    match a {
        Audience::PublicInRange => AudienceKind::PublicInRange,
        Audience::OwnerOnly => AudienceKind::OwnerOnly,
        Audience::Accounts(_) => AudienceKind::Accounts,
        Audience::OwnerAndParty(_) => AudienceKind::OwnerAndParty,
    }
}

/// What each named account may see of this tick's non-public changes of `e`: component types
/// to send and types to remove, with the narrowest audience kind involved. Accounts with
/// nothing to see are absent.
pub fn account_views(
    e: &Entity,
    ch: &EntityChange,
) -> BTreeMap<String, (Vec<u32>, Vec<u32>, AudienceKind)> {
    let owner = &*e.owner_account;
    let mut named: BTreeSet<&str> = BTreeSet::new();
    let mut kind = AudienceKind::PublicInRange;
    let note = |a: &Audience, kind: &mut AudienceKind| {
        if !a.is_public() {
            let k = kind_of(a);
            if *kind == AudienceKind::PublicInRange || (k as i32) < (*kind as i32) {
                *kind = k;
            }
        }
    };
    let types: Vec<u32> = if ch.spawned {
        e.components.keys().copied().collect()
    } else {
        ch.components.keys().copied().collect()
    };
    for t in &types {
        if let Some(c) = e.components.get(t) {
            named.extend(c.audience.named_accounts(owner));
            note(&c.audience, &mut kind);
        }
        if !ch.spawned {
            if let Some(Some(before)) = ch.components.get(t) {
                named.extend(before.named_accounts(owner));
                note(before, &mut kind);
            }
        }
    }
    let mut out = BTreeMap::new();
    for account in named {
        let mut send = Vec::new();
        let mut removed = Vec::new();
        for t in &types {
            let now = e
                .components
                .get(t)
                .filter(|c| !c.audience.is_public() && c.audience.admits(account, owner, false));
            if now.is_some() {
                send.push(*t);
            } else if !ch.spawned {
                let before = ch.components.get(t).cloned().flatten();
                let public_now = e.components.get(t).is_some_and(|c| c.audience.is_public());
                if !public_now
                    && before.is_some_and(|a| !a.is_public() && a.admits(account, owner, false))
                {
                    removed.push(*t);
                }
            }
        }
        if !send.is_empty() || !removed.is_empty() {
            out.insert(account.to_string(), (send, removed, kind));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::entities::{Component, Position, Role};
    use cellmesh_world::geometry::ChunkPos;
    use std::sync::Arc;

    fn addressed(accounts: &[&str]) -> Addressed {
        Addressed {
            kind: PieceKind::PieceDelta,
            audience: AudienceKind::OwnerAndParty,
            encoded: Bytes::from_static(b"delta"),
            accounts: accounts.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn routes(account: &str) -> Target {
        match account {
            "alice" => Target::Remote {
                gateway: 1,
                session_epoch: 4,
            },
            "bob" | "dave" => Target::Remote {
                gateway: 2,
                session_epoch: 1,
            },
            "carol" => Target::Remote {
                gateway: 3,
                session_epoch: 9,
            },
            "me" => Target::Local,
            _ => Target::Unknown,
        }
    }

    #[test]
    fn a_party_over_three_gateways_is_three_messages_sharing_one_encoding() {
        let p = [addressed(&["alice", "bob", "carol", "dave", "bob", "me"])];
        let r = resolve(&p, routes);
        assert_eq!(r.per_gateway.len(), 3);
        let to2 = &r.per_gateway[&2].pieces;
        assert_eq!(to2.len(), 1);
        let names: Vec<&str> = to2[0]
            .recipients
            .iter()
            .map(|r| r.account.as_str())
            .collect();
        assert_eq!(
            names,
            ["bob", "dave"],
            "one message per node, repeats folded"
        );
        // Every copy points at the same bytes.
        let ptrs: BTreeSet<*const u8> = r
            .per_gateway
            .values()
            .map(|m| m.pieces[0].encoded.as_ptr())
            .collect();
        assert_eq!(ptrs.len(), 1);
        assert!(r.unknown.is_empty());
    }

    #[test]
    fn unknown_accounts_come_back_with_their_piece() {
        let p = [addressed(&["alice"]), addressed(&["zed", "carol"])];
        let r = resolve(&p, routes);
        assert_eq!(r.unknown, [("zed".to_string(), 1)]);
        assert_eq!(r.per_gateway.len(), 2);
    }

    fn comp(a: Audience) -> Component {
        Component {
            audience: a,
            payload: Bytes::from_static(b"x"),
        }
    }

    #[test]
    fn views_per_account_never_include_public_components() {
        let party: Arc<[String]> = vec!["bob".to_string()].into();
        let e = Entity {
            id: 1,
            position: Position::default(),
            chunk: ChunkPos { x: 0, y: 0 },
            owner_account: "alice".into(),
            is_master: true,
            parent_id: 0,
            components: litemap::LiteMap::from_iter([
                (1, comp(Audience::PublicInRange)),
                (2, comp(Audience::OwnerAndParty(party))),
                (3, comp(Audience::OwnerOnly)),
            ]),
            role: Role::of(None),
            epoch: 1,
        };
        let spawned = EntityChange {
            spawned: true,
            ..Default::default()
        };
        let v = account_views(&e, &spawned);
        assert_eq!(v["alice"].0, [2, 3]);
        assert_eq!(v["bob"].0, [2]);
        assert_eq!(v.len(), 2);
        // Inventory removed this tick: only the owner hears of it.
        let mut e2 = e.clone();
        e2.components.remove(&3);
        let removed = EntityChange {
            components: litemap::LiteMap::from_iter([(3, Some(Audience::OwnerOnly))]),
            ..Default::default()
        };
        let v = account_views(&e2, &removed);
        assert_eq!(v.len(), 1);
        assert_eq!((v["alice"].0.len(), v["alice"].1.clone()), (0, vec![3]));
        // A public change alone concerns no account.
        let public = EntityChange {
            components: litemap::LiteMap::from_iter([(1, Some(Audience::PublicInRange))]),
            moved: true,
            ..Default::default()
        };
        assert!(account_views(&e, &public).is_empty());
    }
}
