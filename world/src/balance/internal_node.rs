//! One split line and its decision each round (BigWorld's `InternalNode::doBalance`): which side
//! shrinks, whether it may, and by how much; and the line's aggression, which halves when it
//! reverses and grows back while it holds its course.

use serde::{Deserialize, Serialize};

use super::{Edge, EntityBoundLevels, LoadConfig};
use crate::partition::Axis;

/// Which side of a line shrinks (the line moves into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shrink {
    #[default]
    None,
    Low,
    High,
}

/// Why a line moved, or why it held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Moved toward the busier side.
    Gain,
    /// Moved to squeeze a retiring cell.
    Retiring,
    /// Both sides carry the same average load.
    Balanced,
    /// A cell on either side is not created yet (its node has not applied its epoch).
    NotCreated,
    /// The side that would grow has a cell at or over the safety bound.
    SafetyBound,
    /// The first chunk past the line carries more load than the move may shed.
    EntityBound,
    /// The side that would grow holds no ghosts past the line.
    GhostBound,
    /// A parallel line inside the shrinking side sits on this one.
    InnerLine,
    /// A node on either side has not applied the current epoch yet.
    Stale,
    /// The side that would shrink has a node holding several cells (a failover gave it a dead
    /// node's): its one report cannot say where in them its entities are.
    SeveralCells,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Gain => "gain",
            Reason::Retiring => "retiring",
            Reason::Balanced => "balanced",
            Reason::NotCreated => "not_created",
            Reason::SafetyBound => "safety_bound",
            Reason::EntityBound => "entity_bound",
            Reason::GhostBound => "ghost_bound",
            Reason::InnerLine => "inner_line",
            Reason::Stale => "stale",
            Reason::SeveralCells => "several_cells",
        }
    }
}

/// A line's memory between rounds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LineState {
    pub aggression: f64,
    /// The direction of the line's last move (`None` until it first moves): rounds it holds in
    /// between do not hide a reversal.
    pub last: Shrink,
}

impl Default for LineState {
    fn default() -> Self {
        Self {
            aggression: 1.0,
            last: Shrink::None,
        }
    }
}

impl LineState {
    /// Records this round's move (`None`: the line held): a move against the line's last move,
    /// however many rounds it held in between, is a reversal and halves the aggression;
    /// anything else lets it grow back. True on a reversal.
    pub fn adjust(&mut self, now: Shrink, cfg: &LoadConfig) -> bool {
        let reversal = matches!(
            (self.last, now),
            (Shrink::Low, Shrink::High) | (Shrink::High, Shrink::Low)
        );
        let factor = if reversal {
            cfg.aggression_decrease
        } else {
            cfg.aggression_increase()
        };
        self.aggression = (self.aggression * factor).clamp(cfg.min_aggression, 1.0);
        if now != Shrink::None {
            self.last = now;
        }
        reversal
    }
}

/// One side of a line, as the line sees it.
#[derive(Debug, Clone, Copy)]
pub struct Side<'a> {
    /// Total smoothed load over the cells that are not retiring.
    pub avg_load: f64,
    /// The most loaded cell's smoothed load.
    pub max_load: f64,
    /// Every cell of the side is created.
    pub created: bool,
    /// Every cell's node applied the current epoch: the levels describe the cells as they are.
    pub current: bool,
    /// Every cell's node holds that cell alone, so its levels say where its entities are.
    pub mapped: bool,
    /// Every cell of the side is retiring (BigWorld: a retiring leaf).
    pub all_retiring: bool,
    pub levels: &'a EntityBoundLevels,
    /// The least ghost band of the side's cells, in chunks.
    pub ghost_chunks: i64,
    /// How far the line may move into the side before it meets a parallel line inside it.
    pub room: i64,
}

/// What a line does this round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LineDecision {
    pub shrink: Shrink,
    /// Chunks moved (0 when held).
    pub by: i64,
    pub reason: Reason,
    /// The aggression the move was made with.
    pub aggression: f64,
    pub reversal: bool,
}

/// Decides one line: `node_avg` is the average load of the cells under it, `safety_bound` the
/// round's bound. The line's state is updated.
pub fn do_balance(
    axis: Axis,
    low: &Side,
    high: &Side,
    node_avg: f64,
    safety_bound: f64,
    state: &mut LineState,
    cfg: &LoadConfig,
) -> LineDecision {
    let aggression = state.aggression;
    let hold = |reason, state: &mut LineState| {
        let reversal = state.adjust(Shrink::None, cfg);
        LineDecision {
            shrink: Shrink::None,
            by: 0,
            reason,
            aggression,
            reversal,
        }
    };
    // The direction: a side of retiring cells shrinks; otherwise the busier side.
    let (shrink, excess) = if low.all_retiring {
        (Shrink::Low, f64::INFINITY)
    } else if high.all_retiring {
        (Shrink::High, f64::INFINITY)
    } else if low.avg_load > high.avg_load {
        (Shrink::Low, (low.avg_load - node_avg).abs())
    } else if high.avg_load > low.avg_load {
        (Shrink::High, (high.avg_load - node_avg).abs())
    } else {
        return hold(Reason::Balanced, state);
    };
    if excess * aggression < cfg.min_offload {
        // Less than a move is worth: the dead band that keeps a balanced line still.
        return hold(Reason::Balanced, state);
    }
    if !(low.created && high.created) {
        return hold(Reason::NotCreated, state);
    }
    if !(low.current && high.current) {
        return hold(Reason::Stale, state);
    }
    let (shrinking, growing) = match shrink {
        Shrink::Low => (low, high),
        _ => (high, low),
    };
    if growing.max_load >= safety_bound {
        return hold(Reason::SafetyBound, state);
    }
    if !shrinking.mapped {
        return hold(Reason::SeveralCells, state);
    }
    // A move against the last one is made with the aggression already halved.
    let aggression = if matches!(
        (state.last, shrink),
        (Shrink::Low, Shrink::High) | (Shrink::High, Shrink::Low)
    ) {
        (aggression * cfg.aggression_decrease).max(cfg.min_aggression)
    } else {
        aggression
    };
    // The load to shed: the excess over the average, tempered by the aggression, preferably no
    // more than `max_offload`; a retiring cell sheds `max_offload` a round.
    let offload = (excess * aggression).min(cfg.max_offload);
    let edge = Edge::facing_line(axis, shrink == Shrink::Low);
    let mut entity_depth = shrinking.levels.depth_for_load(edge, offload);
    let first = shrinking.levels.edge(edge).load.first().copied();
    if entity_depth == 0
        && (first.is_some_and(|l| l < 2.0 * excess * aggression) || excess.is_infinite())
    {
        // One chunk carries more than `max_offload`, but moving it still narrows the gap
        // between the sides (which is twice the excess when they hold a cell each, and more
        // otherwise); a retiring cell always gives its next chunk.
        entity_depth = 1;
    }
    // Over sparse chunks the bound levels let a line go as far as the ghost band; the
    // aggression shortens that too, or a line that keeps reversing would still swing wide.
    let ghost_reach = (growing.ghost_chunks.max(0) as f64 * aggression).ceil() as i64;
    let by = entity_depth
        .min(if excess.is_infinite() {
            growing.ghost_chunks.max(0)
        } else {
            ghost_reach
        })
        .min(shrinking.room.max(0));
    // Only a move counts as the line's direction: a line held by a bound has not reversed.
    let reversal = state.adjust(if by > 0 { shrink } else { Shrink::None }, cfg);
    let reason = if by > 0 {
        if excess.is_infinite() {
            Reason::Retiring
        } else {
            Reason::Gain
        }
    } else if shrinking.room <= 0 {
        Reason::InnerLine
    } else if growing.ghost_chunks <= 0 {
        Reason::GhostBound
    } else {
        Reason::EntityBound
    };
    LineDecision {
        shrink: if by > 0 { shrink } else { Shrink::None },
        by,
        reason,
        aggression,
        reversal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggression_halves_on_a_reversal_and_grows_back_in_the_recovery_time() {
        let cfg = LoadConfig::default();
        let mut s = LineState::default();
        assert!(!s.adjust(Shrink::Low, &cfg));
        assert_eq!(s.aggression, 1.0, "capped at 1");
        assert!(s.adjust(Shrink::High, &cfg));
        assert_eq!(s.aggression, 0.5);
        assert!(s.adjust(Shrink::Low, &cfg));
        assert_eq!(s.aggression, 0.25);
        // Ten rounds of one second hold the course: one halving made up.
        for _ in 0..10 {
            assert!(!s.adjust(Shrink::Low, &cfg));
        }
        assert!((s.aggression - 0.5).abs() < 1e-9, "{}", s.aggression);
        // Rounds the line holds in between do not hide a reversal (they do let it recover).
        s.adjust(Shrink::None, &cfg);
        s.adjust(Shrink::None, &cfg);
        assert!(s.adjust(Shrink::High, &cfg));
        assert!(!s.adjust(Shrink::High, &cfg));
        for _ in 0..20 {
            s.adjust(Shrink::Low, &cfg);
            s.adjust(Shrink::High, &cfg);
        }
        assert_eq!(s.aggression, cfg.min_aggression, "floored");
    }
}
