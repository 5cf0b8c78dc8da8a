//! Accepts clients: one task each, tracked so shutdown can wait for their kicks to go out.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use crate::{client, Shared};

/// Pause after a failed accept (e.g. out of file descriptors) instead of spinning on it.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

pub(crate) async fn run(listener: TcpListener, shared: Arc<Shared>, tasks: TaskTracker) {
    loop {
        let accepted = tokio::select! {
            _ = shared.clients_stop.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                tasks.spawn(client::serve(shared.clone(), stream, peer));
            }
            Err(e) => {
                shared.metrics.error("accept");
                tracing::warn!(error = %e, "accepting a client failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
        }
    }
}
