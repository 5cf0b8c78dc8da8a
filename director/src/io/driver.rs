//! The one event loop: it owns the [`DirectorCore`], wakes it when it asks, runs its store calls
//! one at a time, tells the admin port what it should show, and logs what happened. Nothing in
//! here decides.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cellmesh_admin::Admin;
use cellmesh_stores::topology::TopologyStore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::core::stats::DirectorStats;
use crate::core::{DirectorCore, Event, Input, Now, Output, StoreReply};

use super::store;

/// What the admin port and the handle read of a running director.
pub(super) struct Shared {
    pub stats: Mutex<DirectorStats>,
    pub admin: Arc<Admin>,
}

type Call = Pin<Box<dyn Future<Output = StoreReply> + Send>>;

pub(super) struct Driver {
    pub core: DirectorCore,
    pub store: Arc<dyn TopologyStore>,
    pub shared: Arc<Shared>,
    /// The core's monotonic clock starts here.
    pub started: Instant,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Driver {
    fn now(&self) -> Now {
        Now {
            mono: self.started.elapsed(),
            unix_ms: unix_ms(),
        }
    }

    pub async fn run(mut self, stop: CancellationToken) {
        let mut call: Option<Call> = None;
        let mut stopping = false;
        self.core.handle(self.now(), Input::Timer);
        loop {
            self.act(&mut call);
            if self.core.is_stopped() {
                break;
            }
            let wake = self
                .core
                .poll_timeout()
                .map(|ms| self.started + Duration::from_millis(ms));
            let input = tokio::select! {
                _ = stop.cancelled(), if !stopping => {
                    stopping = true;
                    Input::Stop
                }
                reply = async { call.as_mut().expect("a call in flight").await }, if call.is_some() => {
                    call = None;
                    Input::Store(reply)
                }
                _ = sleep_until(wake) => Input::Timer,
            };
            self.core.handle(self.now(), input);
        }
        self.publish();
    }

    /// Carries out what the core asked for, and shows its stats.
    fn act(&mut self, call: &mut Option<Call>) {
        while let Some(output) = self.core.poll_output() {
            match output {
                Output::Store(request) => {
                    let store = self.store.clone();
                    *call = Some(Box::pin(async move { store::call(&*store, request).await }));
                }
                Output::Ready(ready) => self.shared.admin.set_ready(ready),
                Output::Event(event) => log(&event),
                Output::Stopped => {}
            }
        }
        self.publish();
    }

    fn publish(&self) {
        let stats = self.core.stats().clone();
        *self.shared.stats.lock().expect("director stats poisoned") = stats;
    }
}

/// Sleeps until `at`; forever when there is nothing to wake for.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn log(event: &Event) {
    match event {
        Event::LeaseGranted { epoch } => {
            tracing::info!(epoch, "director's lease granted: balancing")
        }
        Event::LeaseLost { why } => tracing::warn!(why, "director's lease lost: standing by"),
        Event::LeaseReleased { released: true } => tracing::info!("director's lease released"),
        Event::LeaseReleased { released: false } => {}
        Event::StopUnanswered => tracing::warn!("the store did not answer the lease's release"),
        Event::StoreFailed { call, error } => {
            tracing::warn!(call, error = %error, "topology store call failed")
        }
        Event::Round { .. } => {}
        Event::Placed {
            epoch,
            players,
            decisions,
        } => {
            for d in decisions {
                tracing::info!(
                    epoch,
                    players,
                    bubble = %d.group_id,
                    members = d.members.len(),
                    from = ?d.from_site,
                    to = ?d.to_site,
                    reason = d.reason.kind(),
                    "bubble placement"
                );
            }
        }
        Event::PlacementFailed { error } => tracing::warn!(%error, "bubble placement failed"),
        Event::RegionsCommitted {
            epoch,
            chunks_moved,
            moves,
        } => tracing::info!(
            epoch,
            chunks_moved,
            regions = moves.len(),
            "committed regions to the geos of their bubbles"
        ),
        Event::LayoutRefused { epoch, error, .. } => {
            tracing::warn!(epoch, error = %error, "balance round: layout refused")
        }
        Event::Committed {
            epoch,
            chunks_moved,
            ..
        } => tracing::info!(epoch, chunks_moved, "committed a balanced layout"),
        Event::CommitStale { current_epoch } => {
            tracing::info!(current_epoch, "a newer partition was committed meanwhile")
        }
    }
}
