//! One copy of each conversion between the node's model and the wire messages (mesh and local).

use bytes::Bytes;
use cellmesh_proto::local::{self, AudienceKind, ErrorCode};
use cellmesh_proto::mesh::{self, PieceKind};
use cellmesh_world::geometry::ChunkPos;

use crate::model::audience::Audience;
use crate::model::entities::{detached, Component, Entity, EntityChange, NewEntity, Position};
use crate::model::fold::Part;

/// How many forwarded client inputs are among `messages` (what a lost frame costs in inputs).
pub(crate) fn forwarded_inputs(messages: &[mesh::MeshMessage]) -> u64 {
    messages
        .iter()
        .filter(|m| matches!(m.body, Some(mesh::mesh_message::Body::ForwardInput(_))))
        .count() as u64
}

pub(crate) fn local_vec3(v: &mesh::MeshVec3) -> local::Vec3 {
    local::Vec3 {
        x: v.x,
        y: v.y,
        z: v.z,
    }
}

/// Every component of `e` with its audience, for the new owner.
pub(crate) fn owned_components(e: &Entity) -> Vec<mesh::OwnedComponent> {
    e.components
        .iter()
        .map(|(t, c)| {
            let (kind, accounts) = c.audience.to_wire();
            mesh::OwnedComponent {
                r#type: *t,
                payload: c.payload.clone(),
                audience: kind as u32,
                accounts,
            }
        })
        .collect()
}

pub(crate) fn components_of(wire: &[mesh::OwnedComponent]) -> Vec<(u32, Component)> {
    wire.iter()
        .filter_map(|c| {
            let audience = Audience::from_wire(c.audience as i32, &c.accounts).ok()?;
            Some((
                c.r#type,
                Component {
                    audience,
                    payload: c.payload.clone(),
                },
            ))
        })
        .collect()
}

/// The members of an offer (its root, then its attachments) as the target installs them: its
/// own entities under the offered epoch.
pub(crate) fn members_of(o: &mesh::HandoffOffer) -> Vec<NewEntity> {
    let pos = |v: &Option<mesh::MeshVec3>| v.as_ref().map(position).unwrap_or_default();
    let member = |id, at, owner: &str, master, parent_id, c: &[mesh::OwnedComponent]| NewEntity {
        id,
        position: pos(at),
        owner_account: owner.to_string(),
        is_master: master,
        parent_id,
        components: components_of(c),
        origin: None,
        epoch: o.entity_epoch,
    };
    std::iter::once(member(
        o.entity_id,
        &o.position,
        &o.owner_account,
        o.is_master,
        0,
        &o.components,
    ))
    .chain(o.attachments.iter().map(|a| {
        member(
            a.entity_id,
            &a.position,
            &a.owner_account,
            a.is_master,
            a.parent_id,
            &a.components,
        )
    }))
    .collect()
}

pub(crate) fn vec3(p: Position) -> mesh::MeshVec3 {
    mesh::MeshVec3 {
        x: p.x,
        y: p.y,
        z: p.z,
    }
}

pub(crate) fn position(v: &mesh::MeshVec3) -> Position {
    Position::new(v.x, v.y, v.z)
}

pub(crate) fn chunk_refs(chunks: &[ChunkPos]) -> Vec<mesh::ChunkRef> {
    chunks
        .iter()
        .map(|c| mesh::ChunkRef { x: c.x, y: c.y })
        .collect()
}

/// The full public state of `e`, as a subscriber's snapshot.
pub(crate) fn full_state(e: &Entity) -> mesh::EntityState {
    mesh::EntityState {
        entity_id: e.id,
        entity_epoch: e.epoch,
        full: true,
        position: Some(vec3(e.position)),
        components: e
            .components
            .iter()
            .filter(|(_, c)| c.audience.is_public())
            .map(|(t, c)| mesh::PublicComponent {
                r#type: *t,
                payload: c.payload.clone(),
            })
            .collect(),
        removed_types: vec![],
        owner_account: e.owner_account.to_string(),
        is_master: e.is_master,
        parent_id: e.parent_id,
    }
}

/// This tick's public changes of `e`; `None` when a subscriber has nothing to learn.
pub(crate) fn public_delta(e: &Entity, ch: &EntityChange) -> Option<mesh::EntityState> {
    let mut d = mesh::EntityState {
        entity_id: e.id,
        entity_epoch: e.epoch,
        position: ch.moved.then(|| vec3(e.position)),
        ..Default::default()
    };
    for (t, before) in &ch.components {
        match e.components.get(t) {
            Some(c) if c.audience.is_public() => d.components.push(mesh::PublicComponent {
                r#type: *t,
                payload: c.payload.clone(),
            }),
            _ => {
                if before.as_ref().is_some_and(Audience::is_public) {
                    d.removed_types.push(*t);
                }
            }
        }
    }
    (d.position.is_some() || !d.components.is_empty() || !d.removed_types.is_empty()).then_some(d)
}

pub(crate) fn public_components(list: Vec<mesh::PublicComponent>) -> Vec<(u32, Component)> {
    list.into_iter()
        .map(|c| {
            (
                c.r#type,
                Component {
                    audience: Audience::PublicInRange,
                    payload: detached(c.payload),
                },
            )
        })
        .collect()
}

pub(crate) fn part_of(kind: i32) -> Part {
    match PieceKind::try_from(kind) {
        Ok(PieceKind::PieceEvent) => Part::Event,
        Ok(PieceKind::PieceMessage) => Part::Message,
        _ => Part::Delta,
    }
}

pub(crate) fn audience_label(kind: u32) -> &'static str {
    match AudienceKind::try_from(kind as i32) {
        Ok(AudienceKind::OwnerOnly) => "owner_only",
        Ok(AudienceKind::Accounts) => "accounts",
        Ok(AudienceKind::OwnerAndParty) => "owner_and_party",
        _ => "send",
    }
}

pub(crate) fn local_component(t: u32, payload: &Bytes) -> local::Component {
    local::Component {
        r#type: t,
        payload: payload.clone(),
        audience: None,
    }
}

/// A position the game sent.
pub(crate) fn local_position(v: local::Vec3) -> Position {
    Position::new(v.x, v.y, v.z)
}

/// A position as the game is told it.
pub(crate) fn to_local_vec3(p: Position) -> local::Vec3 {
    local::Vec3 {
        x: p.x,
        y: p.y,
        z: p.z,
    }
}

/// The components the game sent, with their audiences checked.
pub(crate) fn local_components(
    entity: u64,
    wire: Vec<local::Component>,
) -> Result<Vec<(u32, Component)>, String> {
    wire.into_iter()
        .map(|c| {
            let audience = Audience::from_proto(c.audience.as_ref())
                .map_err(|e| format!("entity {entity}, component type {}: {e}", c.r#type))?;
            Ok((
                c.r#type,
                Component {
                    audience,
                    payload: detached(c.payload),
                },
            ))
        })
        .collect()
}

/// The metric label of a local-protocol error code.
pub(crate) fn error_kind(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::ErrorUnspecified => "unspecified",
        ErrorCode::MalformedFrame => "malformed_frame",
        ErrorCode::FrameTooLarge => "frame_too_large",
        ErrorCode::VersionMismatch => "version_mismatch",
        ErrorCode::UnexpectedMessage => "unexpected_message",
        ErrorCode::UnknownEntity => "unknown_entity",
        ErrorCode::DuplicateEntity => "duplicate_entity",
        ErrorCode::NotOwner => "not_owner",
        ErrorCode::InvalidValue => "invalid_value",
        ErrorCode::AlreadyConnected => "already_connected",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::entities::Role;

    fn entity() -> Entity {
        Entity {
            id: 5,
            position: Position::new(1.0, 2.0, 0.0),
            chunk: ChunkPos { x: 0, y: 0 },
            owner_account: "alice".into(),
            is_master: true,
            parent_id: 0,
            components: litemap::LiteMap::from_iter([
                (
                    1,
                    Component {
                        audience: Audience::PublicInRange,
                        payload: Bytes::from_static(b"kind"),
                    },
                ),
                (
                    3,
                    Component {
                        audience: Audience::OwnerOnly,
                        payload: Bytes::from_static(b"inventory"),
                    },
                ),
            ]),
            role: Role::of(None),
            epoch: 1,
        }
    }

    #[test]
    fn owner_only_components_never_replicate() {
        let e = entity();
        let full = full_state(&e);
        assert_eq!(full.components.len(), 1);
        assert_eq!(full.components[0].r#type, 1);
        let ch = EntityChange {
            components: litemap::LiteMap::from_iter([(3, Some(Audience::OwnerOnly))]),
            ..Default::default()
        };
        assert!(
            public_delta(&e, &ch).is_none(),
            "an owner-only change is no public news"
        );
        // Public -> owner-only is a removal for subscribers.
        let ch = EntityChange {
            moved: true,
            components: litemap::LiteMap::from_iter([(3, Some(Audience::PublicInRange))]),
            ..Default::default()
        };
        let d = public_delta(&e, &ch).unwrap();
        assert_eq!((d.removed_types.clone(), d.components.len()), (vec![3], 0));
        assert!(d.position.is_some() && !d.full);
    }
}
