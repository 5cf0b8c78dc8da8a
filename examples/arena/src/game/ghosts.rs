//! Neighbours' entities as the arena sees their ghosts: the NPCs players attack and the players
//! they trade with across a border.

use super::Arena;
use crate::schema;
use cellmesh_proto::local::{GhostEnter, GhostLeave, GhostUpdate};

impl Arena {
    /// A neighbour's entity came into view: NPCs and players are kept apart by their kind.
    pub(super) fn on_ghost_enter(&mut self, g: GhostEnter) {
        let kind = g.components.iter().find(|c| c.r#type == schema::KIND);
        let kind = kind.map(|c| String::from_utf8_lossy(&c.payload).into_owned());
        let (Some(kind), Some(p)) = (kind, g.position) else {
            return;
        };
        if kind.starts_with("npc:") {
            self.npc_ghosts.insert(g.entity_id, (p.x, p.y));
        } else if let Some(account) = kind.strip_prefix("player:") {
            self.player_ghosts
                .insert(g.entity_id, (account.to_string(), (p.x, p.y)));
        }
    }

    pub(super) fn on_ghost_update(&mut self, g: GhostUpdate) {
        let Some(p) = g.position else { return };
        if let Some(at) = self.npc_ghosts.get_mut(&g.entity_id) {
            *at = (p.x, p.y);
        } else if let Some((_, at)) = self.player_ghosts.get_mut(&g.entity_id) {
            *at = (p.x, p.y);
        }
    }

    pub(super) fn on_ghost_leave(&mut self, g: GhostLeave) {
        self.npc_ghosts.remove(&g.entity_id);
        self.player_ghosts.remove(&g.entity_id);
    }
}
