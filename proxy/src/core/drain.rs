//! Leaving gracefully: readiness flips at once while everyone is still served for
//! `drain_grace_ms`, so load balancers stop sending players here; then the listener closes and
//! each client is told `Kick{RECONNECT}` at its own jittered moment within `drain_spread_ms`, so
//! the other proxies take them over gradually; once every client has left, the core says
//! [`Output::Stopped`]. A stop now (a second signal) kicks everyone left at once.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use cellmesh_proto::edge::{Kick, KickReason};
use rand::seq::SliceRandom;
use rand::Rng;

use super::connection::{Connection, End};
use super::{ConnId, Event, Output, ProxyCore, TimerKey};

/// Where a drain is.
#[derive(Debug, Default)]
pub(super) enum Drain {
    /// Serving.
    #[default]
    Off,
    /// Draining: everyone is served until the grace ends.
    Grace,
    /// Kicking clients one by one; the rest when their turn comes, at these times.
    Kicking(VecDeque<(u64, ConnId)>),
    /// Every client was asked to leave (or was kicked at once): waiting for them to go.
    Leaving,
    /// Every client has gone and [`Output::Stopped`] was said.
    Stopped,
}

impl Drain {
    pub(super) fn started(&self) -> bool {
        !matches!(self, Self::Off)
    }

    /// Past the grace: clients are being asked to leave.
    pub(super) fn kicking(&self) -> bool {
        matches!(self, Self::Kicking(_) | Self::Leaving | Self::Stopped)
    }

    /// Once every client asked to leave has gone, says so once.
    pub(super) fn check_done(
        &mut self,
        conns: &HashMap<ConnId, Connection>,
        out: &mut VecDeque<Output>,
    ) {
        if matches!(self, Self::Leaving) && conns.is_empty() {
            *self = Self::Stopped;
            out.push_back(Output::Stopped);
        }
    }
}

pub(super) fn reconnect() -> End {
    End::Kick(Kick::new(
        KickReason::Reconnect,
        "this proxy is draining: reconnect now, to the same address",
    ))
}

impl ProxyCore {
    pub(super) fn start_drain(&mut self) {
        if self.drain.started() {
            return;
        }
        self.out.push_back(Output::Event(Event::DrainStarted {
            grace_ms: self.cfg.drain_grace_ms,
            spread_ms: self.cfg.drain_spread_ms,
        }));
        self.drain = Drain::Grace;
        self.timers
            .arm(TimerKey::Drain, self.now.ms() + self.cfg.drain_grace_ms);
    }

    /// The drain's next step: the end of grace, or the next client's turn.
    pub(super) fn drain_step(&mut self) {
        let now = self.now.ms();
        match &mut self.drain {
            Drain::Grace => {
                self.out.push_back(Output::StopAccepting);
                // The map's order is arbitrary but not random: shuffled, each in its own slot.
                let mut conns: Vec<ConnId> = self.conns.keys().copied().collect();
                conns.sort_unstable();
                conns.shuffle(&mut self.rng);
                let spread = Duration::from_millis(self.cfg.drain_spread_ms);
                let rng = &mut self.rng;
                let at = drain_schedule(conns.len(), spread, || rng.random());
                self.out.push_back(Output::Event(Event::DrainKicking {
                    clients: conns.len(),
                }));
                let queue = at
                    .into_iter()
                    .zip(conns)
                    .map(|(offset, conn)| (now + offset.as_millis() as u64, conn))
                    .collect();
                self.drain = Drain::Kicking(queue);
                self.drain_step();
            }
            Drain::Kicking(queue) => {
                let mut due = Vec::new();
                while let Some(&(at, conn)) = queue.front() {
                    if at > now {
                        self.timers.arm(TimerKey::Drain, at);
                        break;
                    }
                    queue.pop_front();
                    due.push(conn);
                }
                let done = queue.is_empty();
                for conn in due {
                    self.with_conn(conn, |c, cx, g| c.end(cx, g, reconnect()));
                }
                if done {
                    // A connection accepted just before the listener closed: asked too.
                    let left: Vec<ConnId> = self.conns.keys().copied().collect();
                    for conn in left {
                        self.with_conn(conn, |c, cx, g| c.end(cx, g, reconnect()));
                    }
                    self.drain = Drain::Leaving;
                    self.drain.check_done(&self.conns, &mut self.out);
                }
            }
            Drain::Off | Drain::Leaving | Drain::Stopped => {}
        }
    }

    /// Ends a drain at once: every client left is kicked now.
    pub(super) fn stop_now(&mut self) {
        if matches!(self.drain, Drain::Stopped) {
            return;
        }
        if !matches!(self.drain, Drain::Leaving) {
            self.out.push_back(Output::StopAccepting);
        }
        self.timers.disarm(TimerKey::Drain);
        self.drain = Drain::Leaving;
        let left: Vec<ConnId> = self.conns.keys().copied().collect();
        for conn in left {
            self.with_conn(conn, |c, cx, g| {
                c.end(
                    cx,
                    g,
                    End::Kick(Kick::new(KickReason::Shutdown, "proxy shutting down")),
                )
            });
        }
        self.drain.check_done(&self.conns, &mut self.out);
    }
}

/// When each of `n` clients is asked to leave: one per slot of `spread / n`, at a random point
/// within its slot (`unit` draws from [0, 1)), so the rate stays even and no two proxies
/// draining together line their kicks up.
pub(crate) fn drain_schedule(
    n: usize,
    spread: Duration,
    mut unit: impl FnMut() -> f64,
) -> Vec<Duration> {
    if n == 0 {
        return Vec::new();
    }
    let slot = spread.as_secs_f64() / n as f64;
    (0..n)
        .map(|i| Duration::from_secs_f64(slot * (i as f64 + unit().clamp(0.0, 1.0))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_schedule_spreads_evenly_with_jitter_inside_each_slot() {
        let spread = Duration::from_secs(10);
        let mut draws = [0.0, 0.5, 0.999, 0.25].into_iter().cycle();
        let at = drain_schedule(4, spread, || draws.next().unwrap());
        let ms: Vec<u128> = at.iter().map(|d| d.as_millis()).collect();
        assert_eq!(ms, [0, 3750, 7497, 8125]);
        assert!(at.windows(2).all(|w| w[0] <= w[1]), "in order: {ms:?}");
        assert!(at.iter().all(|d| *d < spread));
        assert!(drain_schedule(0, spread, || 0.5).is_empty());
        let zero = drain_schedule(3, Duration::ZERO, || 0.7);
        assert!(zero.iter().all(|d| d.is_zero()), "no spread: all at once");
    }
}
