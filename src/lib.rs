//! The `cellmesh` command: one CLI for every process of the mesh, and `cellmesh up`, a whole local
//! cluster in one process over real loopback sockets.

pub mod balance_cli;
pub mod bench_cli;
pub mod bots;
pub mod certs_cli;
pub mod director;
pub mod geo_cli;
pub mod live_map;
pub mod partition_cli;
mod scenario_cli;
pub mod signal;
pub mod sim_cli;
pub mod telemetry;
pub mod up;
