//! The deterministic cluster simulator (FoundationDB's simulation testing, TigerBeetle's VOPR):
//! many sidecar [`Core`](cellmesh_sidecar::core::Core)s, each with a real game (the sample
//! arena), simulated clients and links with a per-pair latency and jitter, in virtual time.
//!
//! Nothing here sleeps, reads a clock or opens a socket. One seed draws every delay, fault and
//! choice of a run, so a failing seed reproduces the same run, and the report carries a trace of
//! its last steps. The invariants are checked after every step (see `check`).
//!
//! A scenario is data ([`Scenario`]); adding one is a few lines in [`scenario::catalogue`].

mod check;
mod client;
mod director;
mod leases;
pub mod scenario;
mod store;
mod world;

pub use director::{summarise, Balance, BubbleFigures, EpochRecord, Sample};
pub use scenario::{catalogue, named, Delay, Fault, FaultPlan, Gathering, LayoutKind, Scenario};
pub use world::{run, run_traced, CommandFigures, DenFigures, Report, Stats, TradeFigures};
