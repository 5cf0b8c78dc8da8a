//! Latency shaping for demos and tests over loopback, where the kernel's `netem` is not at hand:
//! an in-process delay line that holds each item for a one-way delay (plus a uniform jitter) and
//! hands items on in the order they came. Off (a zero delay), it is not there at all: the
//! receiver is returned as it is, and nothing runs.
//!
//! The kernel does not see this delay: a connection's `TCP_INFO` round trip stays that of
//! loopback, and only timed pings include it.

use std::collections::VecDeque;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A one-way delay: a base and a uniform jitter on top, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OneWay {
    pub base_ms: u64,
    pub jitter_ms: u64,
}

impl OneWay {
    pub const fn ms(base_ms: u64, jitter_ms: u64) -> Self {
        Self { base_ms, jitter_ms }
    }

    pub fn is_zero(&self) -> bool {
        self.base_ms == 0 && self.jitter_ms == 0
    }

    /// One draw of the delay.
    pub fn sample(&self, rng: &mut impl Rng) -> Duration {
        let jitter = if self.jitter_ms > 0 {
            rng.random_range(0..=self.jitter_ms)
        } else {
            0
        };
        Duration::from_millis(self.base_ms + jitter)
    }
}

/// Puts `rx` behind a delay line of `delay`: what is sent into `rx` comes out of the returned
/// receiver `delay` later, in order (jitter never reorders). `lost` is called with each item still
/// in the line when the line's reader goes away, so a caller can count what a closing link lost.
pub fn delay_line<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
    delay: OneWay,
    capacity: usize,
    lost: impl Fn(T) + Send + 'static,
) -> mpsc::Receiver<T> {
    if delay.is_zero() {
        return rx;
    }
    let (tx, out) = mpsc::channel(capacity.max(1));
    tokio::spawn(async move {
        let mut rng = StdRng::from_os_rng();
        let mut line: VecDeque<(Instant, T)> = VecDeque::new();
        let mut last = Instant::now();
        let mut open = true;
        while open || !line.is_empty() {
            let due = line.front().map(|(at, _)| *at);
            tokio::select! {
                item = rx.recv(), if open => match item {
                    Some(item) => {
                        let at = (Instant::now() + delay.sample(&mut rng)).max(last);
                        last = at;
                        line.push_back((at, item));
                    }
                    None => open = false,
                },
                _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                    let (_, item) = line.pop_front().expect("a due item");
                    if let Err(e) = tx.send(item).await {
                        lost(e.0);
                        return give_up(line, rx, &lost);
                    }
                }
                _ = tx.closed() => return give_up(line, rx, &lost),
            }
        }
    });
    out
}

/// The line's reader went away: everything still in the line or on its way in is lost.
fn give_up<T>(mut line: VecDeque<(Instant, T)>, mut rx: mpsc::Receiver<T>, lost: &impl Fn(T)) {
    for (_, item) in line.drain(..) {
        lost(item);
    }
    rx.close();
    while let Ok(item) = rx.try_recv() {
        lost(item);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn items_come_out_late_by_the_delay_and_in_order() {
        let (tx, rx) = mpsc::channel(64);
        let mut out = delay_line(rx, OneWay::ms(45, 10), 64, |_: u32| {});
        let start = Instant::now();
        for i in 0..20u32 {
            tx.send(i).await.unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        for i in 0..20u32 {
            assert_eq!(out.recv().await, Some(i), "in order");
            let late = start.elapsed();
            // Sent at i ms, out no sooner than 45 ms later.
            assert!(
                late >= Duration::from_millis(45 + u64::from(i)),
                "{i}: {late:?}"
            );
        }
        let taken = start.elapsed();
        assert!(
            taken < Duration::from_millis(20 + 45 + 10 + 5),
            "pipelined: {taken:?}"
        );
        drop(tx);
        assert_eq!(out.recv().await, None, "closes when its input does");
    }

    #[tokio::test]
    async fn a_zero_delay_is_no_line_at_all() {
        let (tx, rx) = mpsc::channel(4);
        let mut out = delay_line(rx, OneWay::default(), 4, |_: u8| {});
        tx.send(7).await.unwrap();
        assert_eq!(
            out.try_recv(),
            Ok(7),
            "straight through, no task in between"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn what_is_in_the_line_when_its_reader_goes_is_handed_to_lost() {
        let (tx, rx) = mpsc::channel(64);
        let lost = Arc::new(AtomicUsize::new(0));
        let counted = lost.clone();
        let out = delay_line(rx, OneWay::ms(100, 0), 64, move |_: u32| {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        for i in 0..5 {
            tx.send(i).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(out);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(lost.load(Ordering::SeqCst), 5);
    }
}
