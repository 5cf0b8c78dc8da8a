//! Where things live and the rules that move them.
//!
//! - [`geometry`]: the torus world, its chunks and regions (pure, no I/O).
//! - [`partition`]: who owns every point of the world, grid or BSP, and what changes hands
//!   between two epochs (pure, no I/O).
//! - [`topology`]: the committed partition, node leases (the fencing tokens) and node records,
//!   in MongoDB or in memory.
//! - [`bubbles`]: which datacenter simulates each group of players (pure, virtual time). The
//!   scenario simulator that tunes it is the `cellmesh-geosim` crate, kept apart so that what
//!   links this crate does not link its plotting.
//! - [`handover`]: when a bridged player is worth a reconnect to another geo's proxies (pure,
//!   virtual time).
//! - [`store`]: the stores behind traits: the session directory (Redis per geo, or in memory) and
//!   player records (MongoDB, or in memory).

pub mod balance;
pub mod bubbles;
pub mod geometry;
pub mod handover;
pub mod partition;
pub mod store;
pub mod topology;
