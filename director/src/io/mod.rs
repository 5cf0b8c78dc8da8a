//! The director's only tokio code: the driver that runs the core ([`driver`]), its store calls
//! ([`store`]), and the admin surface: `/live`, `/ready`, `/metrics`, `/state` (the core's stats)
//! and the live map ([`live_map`]).

mod driver;
pub mod live_map;
pub mod store;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use cellmesh_admin::Admin;
use cellmesh_stores::topology::{self, TopologyStore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::DirectorConfig;
use crate::core::stats::DirectorStats;
use crate::core::DirectorCore;
use crate::metrics::Metrics;
use driver::{Driver, Shared};

/// A running director.
pub struct DirectorHandle {
    pub admin_addr: SocketAddr,
    /// This director's name in the lease.
    pub holder: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl DirectorHandle {
    pub fn stats(&self) -> DirectorStats {
        self.shared
            .stats
            .lock()
            .expect("director stats poisoned")
            .clone()
    }

    /// Waits for the director to stop (after its stop token is cancelled, it gives its lease up).
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Starts a director on the store `cfg.topology_url` names.
pub async fn start(cfg: DirectorConfig, stop: CancellationToken) -> anyhow::Result<DirectorHandle> {
    cfg.validate()?;
    let store = topology::open(&cfg.topology_url)
        .await
        .with_context(|| format!("opening the topology store {}", cfg.shown().topology_url))?;
    start_with(cfg, store, stop).await
}

/// Starts a director on `store` (one shared in-process, as `cellmesh up` does).
pub async fn start_with(
    cfg: DirectorConfig,
    store: Arc<dyn TopologyStore>,
    stop: CancellationToken,
) -> anyhow::Result<DirectorHandle> {
    cfg.validate()?;
    let holder = topology::process_holder(&cfg.name);
    let (metrics, registry) = Metrics::new();
    let shared = Arc::new_cyclic(|me: &std::sync::Weak<Shared>| {
        let me = me.clone();
        let admin = Admin::new(registry, move || {
            me.upgrade().map_or(serde_json::Value::Null, |s| {
                let stats = s.stats.lock().expect("director stats poisoned");
                serde_json::to_value(&*stats).unwrap_or_default()
            })
        });
        Shared {
            stats: Mutex::new(DirectorStats {
                holder: holder.clone(),
                ..DirectorStats::default()
            }),
            admin,
        }
    });
    shared.admin.set_token(&cfg.admin_token);
    // Every director draws the map, the standby too: it reads the same store. It asks the nodes
    // with its own token: a cluster shares one.
    live_map::serve(&shared.admin, store.clone(), &cfg.admin_token);
    let admin_addr = cellmesh_admin::spawn(&cfg.admin_listen, shared.admin.clone(), stop.clone())
        .await
        .with_context(|| format!("binding admin_listen {}", cfg.admin_listen))?;
    let driver = Driver {
        core: DirectorCore::new(cfg, holder.clone(), metrics),
        store,
        shared: shared.clone(),
        started: Instant::now(),
    };
    let task = tokio::spawn(driver.run(stop));
    Ok(DirectorHandle {
        admin_addr,
        holder,
        shared,
        task,
    })
}
