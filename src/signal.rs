//! Process signals: Ctrl-C and SIGTERM both mean "shut down gracefully".

use std::future::Future;

/// Listens for SIGINT and SIGTERM from this call on (not from the first poll: a signal that
/// arrives before the future is awaited must not take the process down by its default action);
/// the future completes on the first one.
pub fn shutdown() -> impl Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                (term, int) => {
                    let e = term.err().or(int.err());
                    tracing::warn!(error = ?e, "cannot listen for SIGTERM or SIGINT; Ctrl-C only");
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
