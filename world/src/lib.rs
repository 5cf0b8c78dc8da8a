//! The world and the rules that move things in it: pure logic, no I/O, no async runtime.
//!
//! - [`geometry`]: the torus world, its chunks and regions.
//! - [`partition`]: who owns every point of the world, grid or BSP, and what changes hands
//!   between two epochs.
//! - [`balance`]: BigWorld's balancer over a BSP: lines moved toward the busier side, cells
//!   added and retired (virtual time); `cellmesh director` drives it.
//! - [`spawners`]: which node stocks each of a game's static spawn points under a partition, and
//!   the one id of what a spawner stocks.
//! - [`bubbles`]: which datacenter simulates each group of players (virtual time). The scenario
//!   simulator that tunes it is the `cellmesh-geosim` crate, kept apart so that what links this
//!   crate does not link its plotting.
//! - [`homes`]: the one geo whose store grants a key that must be unique world-wide.
//! - [`handover`]: when a bridged player is worth a reconnect to another geo's proxies (virtual
//!   time).
//! - [`world_map`]: the live map of the world, put together from the partition, the load
//!   reports and the nodes' samples.
//!
//! The stores that hold the partition, the leases and the players are the `cellmesh-stores`
//! crate.

pub mod balance;
pub mod bubbles;
pub mod geometry;
pub mod handover;
pub mod homes;
pub mod partition;
pub mod spawners;
pub mod world_map;
