//! The `cellmesh` command: one CLI for every process of the mesh, and `cellmesh up`, a whole local
//! cluster in one process over real loopback sockets.
//!
//! Two features add what developers and CI run and a production process never does: `up` (on by
//! default) the local cluster and its plot; `tools` the simulators (`sim`, `geo simulate`,
//! `balance simulate`), their plotting and the load generator (`bench`), which the tests turn on.
//! The container image is built with neither, so the processes players depend on link none of
//! that code.

#[cfg(feature = "tools")]
pub mod balance_cli;
#[cfg(feature = "tools")]
pub mod bench_cli;
pub mod bots;
pub mod certs_cli;
#[cfg(feature = "tools")]
pub mod geo_cli;
pub mod partition_cli;
#[cfg(feature = "tools")]
mod scenario_cli;
pub mod signal;
#[cfg(feature = "tools")]
pub mod sim_cli;
pub mod telemetry;
#[cfg(feature = "up")]
pub mod up;
