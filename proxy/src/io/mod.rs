//! The only tokio code of the proxy: it binds the sockets, runs the client, link and board
//! tasks, and drives the [`ProxyCore`](crate::core::ProxyCore) with what they report and the
//! clock.
//!
//! ```text
//! client ──TLS──▶ listener ─▶ client task (socket, codec) ──Event──▶ driver (ProxyCore) ──▶ link task ─▶ gateway
//!                                  ▲ bounded queue ◀── Output ◀────────┘   ▲ board tasks (Redis, DNS)
//! ```

pub(crate) mod board;
pub(crate) mod client;
pub(crate) mod driver;
pub(crate) mod link;
pub(crate) mod listener;
mod log;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cellmesh_admin::Admin;
use tokio::sync::mpsc;

use crate::config::ProxyConfig;
use crate::connlimit::ConnectionLimits;
use crate::geo::Geos;
use crate::metrics::Metrics;
use crate::HandoverRecord;

use driver::Event;
use link::LinkStatus;

/// Events the driver may have queued before the tasks that report them wait.
pub(crate) const EVENTS_QUEUED: usize = 4096;
/// Handover records kept for `take_handovers`; the oldest go past this.
const HANDOVER_LOG: usize = 4096;

/// What the tasks around the core share: the config, the counters, the limits and TLS of the
/// sockets they own, the geos' boards, and the way to the driver.
pub(crate) struct Io {
    pub cfg: ProxyConfig,
    pub metrics: Arc<Metrics>,
    pub connections: ConnectionLimits,
    /// Mutual TLS on the gateway links; none: plaintext.
    pub mesh_tls: Option<Arc<cellmesh_trust::MeshTls>>,
    /// TLS for clients (`client_tls`), when set.
    pub client_tls: Option<Arc<cellmesh_trust::EdgeTls>>,
    pub geos: Arc<Geos>,
    pub events: mpsc::Sender<Event>,
    pub link_status: Vec<Arc<Mutex<LinkStatus>>>,
    next_connection: AtomicU64,
}

impl Io {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        cfg: ProxyConfig,
        metrics: Arc<Metrics>,
        mesh_tls: Option<Arc<cellmesh_trust::MeshTls>>,
        client_tls: Option<Arc<cellmesh_trust::EdgeTls>>,
        geos: Arc<Geos>,
        events: mpsc::Sender<Event>,
    ) -> Self {
        Self {
            connections: ConnectionLimits::new(
                cfg.max_connections,
                cfg.max_connections_per_address,
            ),
            link_status: cfg
                .all_gateways()
                .map(|_| Arc::new(Mutex::new(LinkStatus::new())))
                .collect(),
            cfg,
            metrics,
            mesh_tls,
            client_tls,
            geos,
            events,
            next_connection: AtomicU64::new(1),
        }
    }

    pub(crate) fn next_connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }
}

/// What the proxy's handle reads while the driver runs.
pub(crate) struct Shared {
    pub admin: Arc<Admin>,
    pub client_addr: SocketAddr,
    handover_log: Mutex<VecDeque<HandoverRecord>>,
}

impl Shared {
    pub(crate) fn new(admin: Arc<Admin>, client_addr: SocketAddr) -> Self {
        Self {
            admin,
            client_addr,
            handover_log: Mutex::default(),
        }
    }

    pub(crate) fn log_handover(&self, record: HandoverRecord) {
        let mut log = self.handover_log.lock().unwrap_or_else(|p| p.into_inner());
        if log.len() == HANDOVER_LOG {
            log.pop_front();
        }
        log.push_back(record);
    }

    pub(crate) fn take_handovers(&self) -> Vec<HandoverRecord> {
        self.handover_log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect()
    }
}
