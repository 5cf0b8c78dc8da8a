//! The pure pieces of a node: each takes time and inputs as arguments and does no I/O.
//!
//! - [`entities`]: the entity table (reals and render ghosts), with each tick's changes;
//! - [`fold`]: one batch per client per tick; [`interest`]: views with hysteresis;
//! - [`audience`]: who may see what; [`route`]: routing by account;
//! - [`subs`]: node-level chunk subscriptions; [`ghosts`]: simulation ghosts;
//! - [`handoff`]: the handoff state machines and the epoch fence; [`ids`]: snowflake ids;
//! - [`inputs`]: the order of a player's inputs at the node writing its master;
//! - [`commands`]: entity commands: the origin's pending results, the writer's order;
//! - [`checkpoints`]: the latest state of every entity the node writes, asked of the game;
//! - [`claims`]: the claims this node's entities hold; [`spawners`]: the spawn points it stocks;
//! - [`admission`]: whether the node admits new sessions (tick overrun, outbox pressure);
//! - [`agones`]: what the sidecar calls on the Agones SDK on its game's behalf, and when;
//! - [`recent_handoffs`]: the handoffs of the last second, for the live map.

pub mod admission;
pub mod agones;
pub mod audience;
pub mod checkpoints;
pub mod claims;
pub mod commands;
pub mod component_store;
pub mod entities;
pub mod fold;
pub mod ghosts;
pub mod handoff;
pub mod ids;
pub mod inputs;
pub mod interest;
pub mod load;
pub mod node_set;
pub mod recent_handoffs;
pub mod restore;
pub mod route;
pub mod spawners;
pub mod subs;
