//! Simulation ghosts (docs/mesh.md#ghosts): foreign entities pushed into the game so its AI can perceive
//! across a border.
//!
//! Hysteresis as in BigWorld: a ghost is created when its entity comes within `band` chunks of
//! the node's own area, kept until it is more than `band + keep_margin` away, and lives at least
//! `min_lifespan_ms`, so an entity pacing on a border does not flap. Pure: the caller passes the
//! time and each entity's distance from the area.

use rustc_hash::FxHashMap as HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GhostRules {
    /// Created within this many chunks of the own area...
    pub band: i64,
    /// ...kept until this many chunks further out...
    pub keep_margin: i64,
    /// ...and never removed sooner than this after it was created (unless the entity is gone).
    pub min_lifespan_ms: u64,
}

impl Default for GhostRules {
    fn default() -> Self {
        Self {
            band: 1,
            keep_margin: 1,
            min_lifespan_ms: 2_000,
        }
    }
}

/// What the game is told about one entity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GhostStep {
    Enter,
    Update,
    Leave,
    Nothing,
}

#[derive(Debug, Clone, Default)]
pub struct SimGhosts {
    rules: GhostRules,
    /// entity -> when it became a ghost.
    live: HashMap<u64, u64>,
}

impl SimGhosts {
    pub fn new(rules: GhostRules) -> Self {
        Self {
            rules,
            live: HashMap::default(),
        }
    }

    /// One observation of entity `id` at `now_ms`: `distance` is its chunk distance from the own
    /// area (`None`: the entity is gone), `changed` whether its state changed since the last one.
    pub fn observe(
        &mut self,
        now_ms: u64,
        id: u64,
        distance: Option<i64>,
        changed: bool,
    ) -> GhostStep {
        let r = self.rules;
        match (self.live.get(&id).copied(), distance) {
            (None, Some(d)) if d <= r.band => {
                self.live.insert(id, now_ms);
                GhostStep::Enter
            }
            (None, _) => GhostStep::Nothing,
            (Some(_), None) => {
                self.live.remove(&id);
                GhostStep::Leave
            }
            (Some(since), Some(d)) => {
                let aged = now_ms.saturating_sub(since) >= r.min_lifespan_ms;
                if d > r.band + r.keep_margin && aged {
                    self.live.remove(&id);
                    GhostStep::Leave
                } else if changed {
                    GhostStep::Update
                } else {
                    GhostStep::Nothing
                }
            }
        }
    }

    /// Stops tracking `id` (it became this node's own); true if the game held it as a ghost.
    pub fn forget(&mut self, id: u64) -> bool {
        self.live.remove(&id).is_some()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.live.contains_key(&id)
    }

    /// Ghosts whose keep decision may have changed with time alone.
    pub fn ids(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.live.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Forgets every ghost (the game went away); returns how many there were.
    pub fn clear(&mut self) -> usize {
        let n = self.live.len();
        self.live.clear();
        n
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: GhostRules = GhostRules {
        band: 1,
        keep_margin: 1,
        min_lifespan_ms: 1000,
    };

    #[test]
    fn created_in_the_band_kept_past_it_left_beyond_the_margin() {
        let mut g = SimGhosts::new(RULES);
        assert_eq!(g.observe(0, 7, Some(3), true), GhostStep::Nothing);
        assert_eq!(
            g.observe(10, 7, Some(2), true),
            GhostStep::Nothing,
            "not yet in the band"
        );
        assert_eq!(g.observe(20, 7, Some(1), true), GhostStep::Enter);
        assert_eq!(
            g.observe(30, 7, Some(2), true),
            GhostStep::Update,
            "kept in the margin"
        );
        assert_eq!(g.observe(40, 7, Some(2), false), GhostStep::Nothing);
        assert_eq!(
            g.observe(50, 7, Some(5), true),
            GhostStep::Update,
            "too young to go"
        );
        assert_eq!(g.observe(1020, 7, Some(5), false), GhostStep::Leave);
        assert!(g.is_empty());
    }

    #[test]
    fn pacing_on_the_line_does_not_flap() {
        let mut g = SimGhosts::new(RULES);
        let mut steps = Vec::new();
        for t in 0..200u64 {
            // A walker stepping between 0 and 2 chunks away, every tick for ten seconds.
            let d = [0, 1, 2, 1][(t % 4) as usize];
            steps.push(g.observe(t * 50, 1, Some(d), true));
        }
        assert_eq!(steps.iter().filter(|s| **s == GhostStep::Enter).count(), 1);
        assert_eq!(steps.iter().filter(|s| **s == GhostStep::Leave).count(), 0);
    }

    #[test]
    fn a_ghost_whose_entity_is_gone_leaves_at_once() {
        let mut g = SimGhosts::new(RULES);
        g.observe(0, 1, Some(0), true);
        assert_eq!(g.observe(1, 1, None, true), GhostStep::Leave);
        assert_eq!(g.observe(2, 1, None, true), GhostStep::Nothing);
        g.observe(3, 2, Some(1), true);
        assert_eq!((g.clear(), g.len()), (1, 0));
    }
}
