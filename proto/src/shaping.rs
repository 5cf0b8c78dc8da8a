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

/// A loopback TCP relay to `target` that delays both directions by `delay` one way: what a client
/// in one place sees of a server in another. Returns the address to connect to instead of
/// `target`; runs until `stop`.
pub async fn relay(
    target: std::net::SocketAddr,
    delay: OneWay,
    stop: tokio_util::sync::CancellationToken,
) -> std::io::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let (client, _) = tokio::select! {
                _ = stop.cancelled() => return,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(_) => continue,
                },
            };
            let stop = stop.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = async { tokio::join!(pipe(cr, sw, delay), pipe(sr, cw, delay)) } => {}
                }
            });
        }
    });
    Ok(addr)
}

/// Copies `from` to `to`, each chunk `delay` late, in order; ends (shutting `to` down) when
/// `from` does.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: OneWay,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, rx) = mpsc::channel::<Vec<u8>>(1024);
    let mut rx = delay_line(rx, delay, 1024, |_| {});
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some(chunk) = rx.recv().await {
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
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
    async fn a_relay_delays_each_way() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = server.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = server.accept().await.unwrap();
            let mut b = [0u8; 4];
            while s.read_exact(&mut b).await.is_ok() {
                s.write_all(&b).await.unwrap();
            }
        });
        let stop = tokio_util::sync::CancellationToken::new();
        let via = relay(target, OneWay::ms(30, 0), stop.clone())
            .await
            .unwrap();
        let mut c = tokio::net::TcpStream::connect(via).await.unwrap();
        let mut b = [0u8; 4];
        for _ in 0..3 {
            let t = std::time::Instant::now();
            c.write_all(b"ping").await.unwrap();
            c.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"ping");
            let rtt = t.elapsed();
            assert!(rtt >= Duration::from_millis(60), "{rtt:?}");
        }
        stop.cancel();
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
