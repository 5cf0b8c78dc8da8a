//! The balancer (docs/balance.md, seed `004`): BigWorld's CellAppMgr over a BSP layout, pure and in
//! virtual time. Every balance period each split line moves toward its busier side by what the
//! entity bound levels say sheds the excess, tempered by an aggression that halves when the line
//! reverses; a line never grows a side at or over the safety bound, nor moves while a cell on
//! either side is not created. Every meta period a cell is added from a spare node where the
//! world is overloaded, or the least loaded one retired where it idles: squeezed to no area,
//! then deleted once empty and once every node has the layout without it.
//!
//! One file per concept, as in BigWorld's `cellappmgr/`: [`load_config`] (the thresholds),
//! [`cell_data`] (a cell's report and state), [`entity_bound_levels`], [`internal_node`] (one
//! line's decision) and [`space`] (the round).

pub mod cell_data;
pub mod entity_bound_levels;
pub mod internal_node;
pub mod load_config;
pub mod space;

#[cfg(test)]
mod tests;

pub use cell_data::{CellReport, CellState};
pub use entity_bound_levels::{Edge, EntityBoundLevels, Levels, MAX_DEPTH};
pub use internal_node::{LineDecision, LineState, Reason, Shrink};
pub use load_config::{LoadConfig, LoadConfigError};
pub use space::{Balancer, Decision, Round};
