//! The handoffs this node completed lately, for the live map's arrows (pure).

use std::collections::VecDeque;

use cellmesh_world::partition::NodeId;
use cellmesh_world::world_map::{MapHandoff, HANDOFF_SHOWN_MS};

/// Handoffs kept at most: a mass handoff of a whole region is thousands at one instant, and the
/// map only needs to show that many arrows, not each one.
pub const RECENT_MAX: usize = 512;

/// Completed handoffs of the last [`HANDOFF_SHOWN_MS`], newest last.
#[derive(Debug, Default)]
pub struct RecentHandoffs {
    entries: VecDeque<(u64, MapHandoff)>,
}

impl RecentHandoffs {
    /// Notes that `to` took `entity`, standing at (x, y), at `now_ms` (monotonic).
    pub fn push(&mut self, now_ms: u64, entity: u64, (x, y): (f64, f64), from: NodeId, to: NodeId) {
        self.prune(now_ms);
        if self.entries.len() == RECENT_MAX {
            self.entries.pop_front();
        }
        let h = MapHandoff {
            entity,
            x,
            y,
            from,
            to,
            age_ms: 0,
        };
        self.entries.push_back((now_ms, h));
    }

    /// The handoffs still shown at `now_ms`, each with its age.
    pub fn shown(&mut self, now_ms: u64) -> Vec<MapHandoff> {
        self.prune(now_ms);
        self.entries
            .iter()
            .map(|(at, h)| MapHandoff {
                age_ms: now_ms.saturating_sub(*at),
                ..h.clone()
            })
            .collect()
    }

    fn prune(&mut self, now_ms: u64) {
        while let Some((at, _)) = self.entries.front() {
            if now_ms.saturating_sub(*at) <= HANDOFF_SHOWN_MS {
                break;
            }
            self.entries.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoffs_are_shown_for_a_second_with_their_age() {
        let mut r = RecentHandoffs::default();
        r.push(100, 1, (1.0, 2.0), 1, 2);
        r.push(600, 2, (3.0, 4.0), 1, 3);
        let shown = r.shown(1000);
        assert_eq!(shown.len(), 2);
        assert_eq!((shown[0].entity, shown[0].age_ms, shown[0].to), (1, 900, 2));
        assert_eq!((shown[1].x, shown[1].y, shown[1].from), (3.0, 4.0, 1));
        let shown = r.shown(1101 + 1);
        assert_eq!(shown.iter().map(|h| h.entity).collect::<Vec<_>>(), vec![2]);
        assert!(r.shown(5000).is_empty());
    }

    #[test]
    fn a_mass_handoff_keeps_only_the_newest() {
        let mut r = RecentHandoffs::default();
        for id in 0..(RECENT_MAX as u64 + 10) {
            r.push(7, id, (0.0, 0.0), 1, 2);
        }
        let shown = r.shown(7);
        assert_eq!(shown.len(), RECENT_MAX);
        assert_eq!(shown[0].entity, 10);
    }
}
