//! Where things live and the rules that move them.
//!
//! - [`geometry`]: the torus world, its chunks and regions (pure, no I/O).
//! - [`partition`]: who owns every point of the world, grid or BSP, and what changes hands
//!   between two epochs (pure, no I/O).
//! - [`balance`]: BigWorld's balancer over a BSP: lines moved toward the busier side, cells
//!   added and retired (pure, virtual time); `cellmesh director` drives it.
//! - [`spawners`]: which node stocks each of a game's static spawn points under a partition, and
//!   the one id of what a spawner stocks (pure).
//! - [`topology`]: the committed partition, node leases (the fencing tokens) and node records,
//!   in MongoDB or in memory.
//! - [`bubbles`]: which datacenter simulates each group of players (pure, virtual time). The
//!   scenario simulator that tunes it is the `cellmesh-geosim` crate, kept apart so that what
//!   links this crate does not link its plotting.
//! - [`handover`]: when a bridged player is worth a reconnect to another geo's proxies (pure,
//!   virtual time).
//! - [`store`]: the stores behind traits: the session directory (Redis per geo, or in memory),
//!   player records (MongoDB, or in memory), checkpoints, the edge board, and exclusive claims
//!   with fencing tokens (Redis per geo, or in memory).
//! - [`world_map`]: the live map of the world, put together from the partition, the load
//!   reports and the nodes' samples (pure).

pub mod balance;
pub mod bubbles;
pub mod geometry;
pub mod handover;
pub mod partition;
pub mod spawners;
pub mod store;
pub mod topology;
pub mod world_map;
