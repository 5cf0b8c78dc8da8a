//! How the `transport` and `edge` scenarios measure their two paths: in rounds that alternate
//! which path goes first (A B, B A, A B, …), so that both see the same share of whatever else
//! the machine is doing. In each round a path gets stamped frames at a fixed rate (their
//! latency), then frames as fast as it takes them (how many a second its receiver gets), each
//! phase after a warm-up.
//!
//! A frame's stamp says what it is measured for (a flag in its sequence number), so a receiver
//! needs no clock of the rounds. While sending as fast as it can, a sender keeps at most a window
//! of frames in flight (sent, not yet received): a path that only queues (a Redis subscriber's
//! output buffer, the proxy's per-client queue) would otherwise cut its receiver off once it fell
//! far enough behind, instead of slowing the sender. Both paths of a scenario run under the same
//! window.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::game::now_ns;
use super::report::{nanos_histogram, Latency};

/// Sequence number flag: the frame's latency is measured.
const LATENCY: u64 = 1 << 63;
/// Sequence number flag: the frame counts towards the throughput.
const THROUGHPUT: u64 = 1 << 62;

/// Whether a stamp's sequence number says its latency is measured.
pub fn latency_measured(seq: u64) -> bool {
    seq & LATENCY != 0
}

/// `seq` flagged as measured for latency when `measured`.
pub fn flag_latency(seq: u64, measured: bool) -> u64 {
    if measured {
        seq | LATENCY
    } else {
        seq
    }
}

/// One path's share of one round.
#[derive(Debug, Clone, Copy)]
pub struct Round {
    /// Frames a second in the latency phase.
    pub rate: u32,
    /// Before each phase: not measured.
    pub warm_up: Duration,
    /// Each phase's measured span.
    pub measure: Duration,
}

impl Round {
    /// The round of `rounds` that together measure each phase of each path for `measure`.
    pub fn of(rounds: u32, rate: u32, warm_up: Duration, measure: Duration) -> Self {
        Self {
            rate,
            warm_up,
            measure: measure / rounds.max(1),
        }
    }
}

/// What one path's sender and receiver share: the frames in flight, bounded by a window, and
/// whether the path's latency is being measured now.
#[derive(Debug)]
pub struct Flow {
    window: u64,
    sent: AtomicU64,
    received: AtomicU64,
    room: Notify,
    measuring_latency: AtomicBool,
}

impl Flow {
    pub fn new(window: u64) -> Arc<Self> {
        Arc::new(Self {
            window,
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            room: Notify::new(),
            measuring_latency: AtomicBool::new(false),
        })
    }

    /// Whether the path's latency is being measured now (for traffic the other way).
    pub fn measuring_latency(&self) -> bool {
        self.measuring_latency.load(Relaxed)
    }

    /// Waits until fewer than `window` frames are in flight.
    async fn room(&self) {
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            // Registered before the check, so a frame received in between still wakes us.
            notified.as_mut().enable();
            if self.sent.load(Relaxed) - self.received.load(Relaxed) < self.window {
                return;
            }
            notified.await;
        }
    }

    fn sent(&self) {
        self.sent.fetch_add(1, Relaxed);
    }

    fn received(&self) {
        self.received.fetch_add(1, Relaxed);
        self.room.notify_one();
    }
}

/// Where a path's sender puts one stamped frame.
pub trait Source {
    /// Builds frame `seq` (flags included) stamped now, and hands it to the path.
    fn send(&mut self, seq: u64) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// What a sender sent, over every round.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sent {
    pub latency_frames: u64,
    pub throughput_frames: u64,
    /// The measured spans of the throughput phases, together.
    pub throughput_time: Duration,
}

/// One path's sending side.
pub struct Sender<S> {
    name: &'static str,
    flow: Arc<Flow>,
    source: S,
    sent: Sent,
    seq: u64,
}

impl<S: Source> Sender<S> {
    pub fn new(name: &'static str, source: S, flow: Arc<Flow>) -> Self {
        Self {
            name,
            flow,
            source,
            sent: Sent::default(),
            seq: 0,
        }
    }

    pub fn sent(&self) -> Sent {
        self.sent
    }

    /// Runs both phases of `round`: paced at `round.rate`, then as fast as the window allows.
    pub async fn round(&mut self, round: &Round) -> anyhow::Result<()> {
        let sent = async {
            self.paced(round).await?;
            self.flood(round).await
        }
        .await;
        sent.with_context(|| format!("sending {}", self.name))
    }

    async fn paced(&mut self, round: &Round) -> anyhow::Result<()> {
        let start = Instant::now();
        let (measure_from, until) = (start + round.warm_up, start + round.warm_up + round.measure);
        let mut pace = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(round.rate)));
        pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let sent = loop {
            let now = pace.tick().await;
            if now >= until {
                break Ok(());
            }
            let measured = now >= measure_from;
            self.flow.measuring_latency.store(measured, Relaxed);
            self.seq += 1;
            self.flow.sent();
            if let Err(e) = self.source.send(flag_latency(self.seq, measured)).await {
                break Err(e);
            }
            self.sent.latency_frames += u64::from(measured);
        };
        self.flow.measuring_latency.store(false, Relaxed);
        sent
    }

    async fn flood(&mut self, round: &Round) -> anyhow::Result<()> {
        let start = Instant::now();
        let (measure_from, until) = (start + round.warm_up, start + round.warm_up + round.measure);
        loop {
            // A path that stopped delivering leaves the window full until the end.
            if tokio::time::timeout_at(until, self.flow.room())
                .await
                .is_err()
            {
                break;
            }
            let now = Instant::now();
            if now >= until {
                break;
            }
            let measured = now >= measure_from;
            self.seq += 1;
            self.flow.sent();
            let seq = if measured {
                self.seq | THROUGHPUT
            } else {
                self.seq
            };
            self.source.send(seq).await?;
            self.sent.throughput_frames += u64::from(measured);
        }
        self.sent.throughput_time += round.measure;
        Ok(())
    }
}

/// Runs `rounds` rounds over two paths, alternating which goes first.
pub async fn alternate<A: Source, B: Source>(
    rounds: u32,
    round: &Round,
    a: &mut Sender<A>,
    b: &mut Sender<B>,
) -> anyhow::Result<()> {
    for r in 0..rounds {
        if r % 2 == 0 {
            a.round(round).await?;
            b.round(round).await?;
        } else {
            b.round(round).await?;
            a.round(round).await?;
        }
    }
    Ok(())
}

/// What a path's receiver saw.
#[derive(Debug)]
pub struct Tally {
    flow: Arc<Flow>,
    latency: Histogram<u64>,
    throughput_frames: u64,
}

impl Tally {
    pub fn new(flow: Arc<Flow>) -> Self {
        Self {
            flow,
            latency: nanos_histogram(),
            throughput_frames: 0,
        }
    }

    /// A frame stamped `(sent_ns, seq)` arrived now.
    pub fn frame(&mut self, (sent_ns, seq): (u64, u64)) {
        let now = now_ns();
        self.flow.received();
        if latency_measured(seq) {
            let _ = self.latency.record(now.saturating_sub(sent_ns).max(1));
        }
        if seq & THROUGHPUT != 0 {
            self.throughput_frames += 1;
        }
    }

    pub fn latency(&self) -> Latency {
        Latency::from_nanos(&self.latency)
    }

    /// Frames received whose latency was measured.
    pub fn latency_frames(&self) -> u64 {
        self.latency.len()
    }

    /// Frames a second received of those sent in the throughput phases' measured spans.
    pub fn throughput_per_s(&self, sent: &Sent) -> f64 {
        if sent.throughput_time.is_zero() {
            return 0.0;
        }
        (self.throughput_frames as f64 / sent.throughput_time.as_secs_f64()).round()
    }
}

/// One path's figures: its latency and the frames it was measured on, the frames a second it
/// carried, and what that is in megabytes a second for frames of `frame_bytes`.
pub fn figures(sent: &Sent, tally: &Tally, frame_bytes: usize) -> Value {
    let per_s = tally.throughput_per_s(sent);
    json!({
        "latency": tally.latency(),
        "latency_frames_sent": sent.latency_frames,
        "latency_frames_received": tally.latency_frames(),
        "throughput_frames_per_s": per_s,
        "throughput_mb_per_s": (per_s * frame_bytes as f64 / 1e5).round() / 10.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::game::{read_stamp, stamped};

    /// A path whose frames arrive at once.
    struct Loopback(Tally);

    impl Source for Loopback {
        async fn send(&mut self, seq: u64) -> anyhow::Result<()> {
            self.0.frame(read_stamp(&stamped(16, seq)).unwrap());
            Ok(())
        }
    }

    #[tokio::test]
    async fn alternating_rounds_measure_both_paths_in_both_phases() {
        let round = Round::of(
            2,
            1000,
            Duration::from_millis(20),
            Duration::from_millis(200),
        );
        let paths = [Flow::new(4), Flow::new(4)];
        let mut a = Sender::new(
            "a",
            Loopback(Tally::new(paths[0].clone())),
            paths[0].clone(),
        );
        let mut b = Sender::new(
            "b",
            Loopback(Tally::new(paths[1].clone())),
            paths[1].clone(),
        );
        alternate(2, &round, &mut a, &mut b).await.unwrap();
        for s in [&a.sent(), &b.sent()] {
            // 1000/s for 2 × 0.1 s, on a timer of millisecond resolution.
            assert!(
                (150..=250).contains(&s.latency_frames),
                "{}",
                s.latency_frames
            );
            assert_eq!(s.throughput_time, Duration::from_millis(200));
        }
        let (sent, tally) = (a.sent(), &a.source.0);
        assert_eq!(sent.latency_frames, tally.latency_frames());
        assert_eq!(sent.throughput_frames, tally.throughput_frames);
        assert!(tally.throughput_per_s(&sent) > 1000.0);
        assert!(!paths[0].measuring_latency());
    }

    #[test]
    fn flags_say_what_a_frame_is_measured_for() {
        assert!(latency_measured(flag_latency(7, true)));
        assert!(!latency_measured(flag_latency(7, false)));
        assert_eq!(flag_latency(7, false), 7);
    }

    #[tokio::test]
    async fn a_full_window_holds_the_sender_until_a_frame_arrives() {
        let flow = Flow::new(2);
        flow.sent();
        flow.sent();
        let waiting = tokio::time::timeout(Duration::from_millis(50), flow.room()).await;
        assert!(waiting.is_err(), "room with two of two in flight");
        let room = tokio::spawn({
            let flow = flow.clone();
            async move { flow.room().await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        flow.received();
        tokio::time::timeout(Duration::from_secs(5), room)
            .await
            .expect("a received frame makes room")
            .unwrap();
    }
}
