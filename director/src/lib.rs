//! `cellmesh director`: the one process per world that balances it (docs/balance.md). It holds the
//! director's lease in the topology store (a standby asks for it until it lapses), and every
//! balance period reads the committed partition, the nodes' load reports and the spare nodes,
//! runs the balancer ([`cellmesh_world::balance`]) and commits the layout it proposes as the next
//! epoch. The store checks the lease in the same step as the epoch, so a director that lost its
//! lease (lapsed while it stalled, or taken by a standby) can never commit: its commit comes
//! back fenced and it stands by.
//!
//! The crate has the sidecar's and the proxy's shape:
//!
//! - [`core`]: [`DirectorCore`], every decision and no I/O. The lease (acquire, renew, lost,
//!   standby), the balance round, the one commit path, and the stats it keeps. Time comes in as
//!   an argument and the store's answers as inputs, so the cluster simulator drives the same core
//!   in virtual time.
//! - [`io`]: the tokio driver that runs the core's store calls on a
//!   [`TopologyStore`](cellmesh_stores::topology::TopologyStore), and the admin surface (`/live`,
//!   `/ready`, `/metrics`, `/state` with the decisions and their reasons, and the live map: `/map`,
//!   `/api/world`).

pub mod config;
pub mod core;
pub mod io;
pub mod metrics;

pub use crate::core::stats::{DecisionRecord, DirectorStats, EpochRecord, Role, RoundView};
pub use crate::core::{
    DirectorCore, Event, Input, Now, Output, StoreReply, StoreRequest, WorldRead,
};
pub use config::DirectorConfig;
pub use io::{live_map, start, start_with, DirectorHandle};
pub use metrics::Metrics;
