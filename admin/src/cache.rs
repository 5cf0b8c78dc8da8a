//! A value computed at most once per period, by one caller at a time: the others wait for that
//! computation and share its result. For a route that is costly to answer (`/api/world` reads
//! the topology store and asks every node), so that a page polling it, or many, cost one
//! computation a period however many ask.

use std::future::Future;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

/// The last result of a computation and when it was made.
pub struct SingleFlight<T> {
    fresh_for: Duration,
    last: Mutex<Option<(Instant, T)>>,
}

impl<T: Clone> SingleFlight<T> {
    /// Results are reused for `fresh_for` after they were computed.
    pub fn new(fresh_for: Duration) -> Self {
        Self {
            fresh_for,
            last: Mutex::new(None),
        }
    }

    /// The last result if it was computed within the period before `now`, else `compute`'s
    /// (stored for the callers to come). A caller that arrives while a computation runs waits
    /// for it, then takes its result; its `now` should be read after it got in line, which is
    /// what [`SingleFlight::get`] does.
    pub async fn get_at<F, Fut>(&self, now: impl FnOnce() -> Instant, compute: F) -> T
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = T>,
    {
        // Held across the computation: this is what makes the others wait rather than compute.
        let mut last = self.last.lock().await;
        let now = now();
        if let Some((at, value)) = &*last {
            if now.saturating_duration_since(*at) < self.fresh_for {
                return value.clone();
            }
        }
        let value = compute().await;
        *last = Some((Instant::now(), value.clone()));
        value
    }

    /// [`SingleFlight::get_at`] with tokio's clock.
    pub async fn get<F, Fut>(&self, compute: F) -> T
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = T>,
    {
        self.get_at(Instant::now, compute).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn concurrent_callers_share_one_computation_and_a_second_later_it_runs_again() {
        let cache = Arc::new(SingleFlight::new(Duration::from_secs(1)));
        let runs = Arc::new(AtomicU32::new(0));
        let call = |cache: Arc<SingleFlight<u32>>, runs: Arc<AtomicU32>| async move {
            cache
                .get(|| async {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    runs.fetch_add(1, Ordering::SeqCst) + 1
                })
                .await
        };
        let all: Vec<_> = (0..16)
            .map(|_| tokio::spawn(call(cache.clone(), runs.clone())))
            .collect();
        for h in all {
            assert_eq!(h.await.unwrap(), 1);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Within the second: the same result, no computation.
        tokio::time::advance(Duration::from_millis(500)).await;
        assert_eq!(call(cache.clone(), runs.clone()).await, 1);
        // Past it: a new one.
        tokio::time::advance(Duration::from_millis(600)).await;
        assert_eq!(call(cache.clone(), runs.clone()).await, 2);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }
}
