//! Round-trip time as the proxy measures it: it sends `Ping{nonce}` and times the matching
//! `Pong`. Nonces are random, so a client cannot answer a ping before it has seen it and report a
//! lower figure than its real one.

use std::collections::VecDeque;
use std::time::Duration;

/// Samples kept per session for its p50 and minimum.
pub(crate) const RTT_WINDOW: usize = 32;
/// Pings awaiting their pong; older ones count as lost.
const MAX_OUTSTANDING: usize = 8;

/// The RTT summary of one session's recent samples, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RttSummary {
    pub p50_ms: f64,
    pub min_ms: f64,
    pub samples: usize,
}

/// One session's pings in flight and its last RTT samples.
#[derive(Debug)]
pub(crate) struct PingTracker {
    /// Nonces and when they were sent (time since the core's start).
    outstanding: VecDeque<(u64, Duration)>,
    samples: VecDeque<f64>,
    window: usize,
}

impl PingTracker {
    pub(crate) fn new(window: usize) -> Self {
        Self {
            outstanding: VecDeque::with_capacity(MAX_OUTSTANDING),
            samples: VecDeque::with_capacity(window),
            window: window.max(1),
        }
    }

    /// Notes a ping sent at `now`.
    pub(crate) fn sent(&mut self, nonce: u64, now: Duration) {
        if self.outstanding.len() == MAX_OUTSTANDING {
            self.outstanding.pop_front();
        }
        self.outstanding.push_back((nonce, now));
    }

    /// Matches a pong received at `now`; returns the RTT it completes. A nonce never sent (or
    /// already answered) is ignored. Pings are answered in order on one stream, so older pings
    /// still waiting are lost and forgotten.
    pub(crate) fn pong(&mut self, nonce: u64, now: Duration) -> Option<Duration> {
        let at = self.outstanding.iter().position(|(n, _)| *n == nonce)?;
        let (_, sent) = self.outstanding.drain(..=at).next_back()?;
        let rtt = now.saturating_sub(sent);
        if self.samples.len() == self.window {
            self.samples.pop_front();
        }
        self.samples.push_back(rtt.as_secs_f64() * 1000.0);
        Some(rtt)
    }

    /// p50 and minimum over the last samples; `None` before the first pong.
    pub(crate) fn summary(&self) -> Option<RttSummary> {
        let mut sorted: Vec<f64> = self.samples.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let min_ms = *sorted.first()?;
        // Nearest rank: the lower middle of an even count, so one slow outlier does not move it.
        let p50_ms = sorted[(sorted.len() - 1) / 2];
        Some(RttSummary {
            p50_ms,
            min_ms,
            samples: sorted.len(),
        })
    }

    #[cfg(test)]
    fn samples(&self) -> usize {
        self.samples.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn pong_completes_its_own_ping() {
        let t0 = Duration::ZERO;
        let mut p = PingTracker::new(RTT_WINDOW);
        assert_eq!(p.summary(), None);
        p.sent(7, t0);
        p.sent(9, t0 + ms(1000));
        assert_eq!(p.pong(9, t0 + ms(1040)), Some(ms(40)));
        // The older ping was overtaken: it is lost, and its late pong counts for nothing.
        assert_eq!(p.pong(7, t0 + ms(1050)), None);
        assert_eq!(p.pong(9, t0 + ms(1060)), None, "a nonce is answered once");
        assert_eq!(p.samples(), 1);
    }

    #[test]
    fn unknown_nonce_is_ignored() {
        let t0 = Duration::ZERO;
        let mut p = PingTracker::new(RTT_WINDOW);
        p.sent(1, t0);
        assert_eq!(p.pong(2, t0 + ms(5)), None);
        assert_eq!(p.pong(1, t0 + ms(6)), Some(ms(6)));
    }

    #[test]
    fn p50_and_min_over_the_last_window() {
        let t0 = Duration::ZERO;
        let mut p = PingTracker::new(4);
        for (i, rtt) in [100, 10, 30, 20, 40, 50].into_iter().enumerate() {
            let sent = t0 + ms(i as u64 * 1000);
            p.sent(i as u64, sent);
            p.pong(i as u64, sent + ms(rtt));
        }
        // Window holds 30, 20, 40, 50: the 100 and the 10 fell out.
        let s = p.summary().unwrap();
        assert_eq!(s.min_ms, 20.0);
        assert_eq!(s.p50_ms, 30.0);
        assert_eq!(p.samples(), 4);
    }

    #[test]
    fn outstanding_pings_are_bounded() {
        let t0 = Duration::ZERO;
        let mut p = PingTracker::new(RTT_WINDOW);
        for n in 0..(MAX_OUTSTANDING as u64 + 3) {
            p.sent(n, t0 + ms(n));
        }
        assert_eq!(
            p.pong(0, t0 + ms(100)),
            None,
            "the oldest pings were given up"
        );
        assert_eq!(p.pong(5, t0 + ms(105)), Some(ms(100)));
    }
}
