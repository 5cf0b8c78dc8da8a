//! Input rate limits: one GCRA bucket per account and one per client address (`governor`), and a
//! per-session flood meter that turns sustained excess into a kick.
//!
//! The address limit is a multiple of the account limit (`rate.address_accounts`): it bounds what
//! one host can push through many accounts, while the players behind one carrier-grade NAT each
//! keep their own account's rate. An IPv6 address counts by its /64, which one host owns whole.
//!
//! An input over either limit is dropped and counted, never queued: a queue would only delay the
//! moment the client is told to slow down and let it buy latency for everyone behind it.

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock, FakeRelativeClock};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DashMapStateStore;
use governor::{Quota, RateLimiter};

use crate::config::RateConfig;
use crate::connlimit::address_key;

type Keyed<K, C> = RateLimiter<K, DashMapStateStore<K>, C, NoOpMiddleware<<C as Clock>::Instant>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Accept,
    OverAccountRate,
    OverAddressRate,
}

/// The limits shared by every client task of one proxy.
pub(crate) struct InputLimits<C: Clock = DefaultClock> {
    account: Keyed<Arc<str>, C>,
    address: Keyed<IpAddr, C>,
}

fn quota(per_sec: u32, burst: u32) -> Quota {
    let nz = |v: u32| NonZeroU32::new(v).unwrap_or(NonZeroU32::MIN);
    Quota::per_second(nz(per_sec)).allow_burst(nz(burst))
}

impl<C: Clock + Clone> InputLimits<C> {
    pub(crate) fn with_clock(cfg: &RateConfig, clock: C) -> Self {
        Self {
            account: RateLimiter::dashmap_with_clock(
                quota(cfg.account_inputs_per_sec, cfg.account_burst),
                clock.clone(),
            ),
            address: RateLimiter::dashmap_with_clock(
                quota(cfg.address_inputs_per_sec(), cfg.address_burst()),
                clock,
            ),
        }
    }

    /// Decides one input. The account is checked first: a player over its own rate should not
    /// also eat into the budget of the others behind the same address.
    pub(crate) fn check(&self, account: &Arc<str>, addr: IpAddr) -> Verdict {
        if self.account.check_key(account).is_err() {
            return Verdict::OverAccountRate;
        }
        if self.address.check_key(&address_key(addr)).is_err() {
            return Verdict::OverAddressRate;
        }
        Verdict::Accept
    }

    /// Forgets keys whose buckets are full again, so departed clients cost no memory.
    pub(crate) fn forget_idle(&self) {
        self.account.retain_recent();
        self.address.retain_recent();
        self.account.shrink_to_fit();
        self.address.shrink_to_fit();
    }

    #[cfg(test)]
    fn keys(&self) -> (usize, usize) {
        (self.account.len(), self.address.len())
    }
}

/// The input limits in the proxy core's time: the caller moves their clock to each input's `now`
/// ([`Self::advance_to`]), so no clock is read and a run in virtual time limits alike.
pub(crate) struct CoreLimits {
    limits: InputLimits<FakeRelativeClock>,
    clock: FakeRelativeClock,
    at: Duration,
}

impl CoreLimits {
    pub(crate) fn new(cfg: &RateConfig) -> Self {
        let clock = FakeRelativeClock::default();
        Self {
            limits: InputLimits::with_clock(cfg, clock.clone()),
            clock,
            at: Duration::ZERO,
        }
    }

    /// Moves the limits' time on to `now` (time since the core's start); never back.
    pub(crate) fn advance_to(&mut self, now: Duration) {
        if now > self.at {
            self.clock.advance(now - self.at);
            self.at = now;
        }
    }

    pub(crate) fn check(&self, account: &Arc<str>, addr: IpAddr) -> Verdict {
        self.limits.check(account, addr)
    }

    pub(crate) fn forget_idle(&self) {
        self.limits.forget_idle();
    }
}

/// Counts one session's dropped inputs in one-second windows.
#[derive(Debug)]
pub(crate) struct FloodMeter {
    threshold: u32,
    window_start: Option<Duration>,
    drops: u32,
}

const FLOOD_WINDOW: Duration = Duration::from_secs(1);

impl FloodMeter {
    pub(crate) fn new(threshold: u32) -> Self {
        Self {
            threshold,
            window_start: None,
            drops: 0,
        }
    }

    /// Records one dropped input at `now`; true once `threshold` drops fell in one window.
    pub(crate) fn record_drop(&mut self, now: Duration) -> bool {
        match self.window_start {
            Some(start) if now.saturating_sub(start) < FLOOD_WINDOW => self.drops += 1,
            _ => {
                self.window_start = Some(now);
                self.drops = 1;
            }
        }
        self.drops >= self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use governor::clock::FakeRelativeClock;

    fn cfg() -> RateConfig {
        RateConfig {
            account_inputs_per_sec: 10,
            account_burst: 20,
            address_accounts: 2,
            flood_kick_drops: 5,
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn account_burst_then_refill_at_the_configured_rate() {
        let clock = FakeRelativeClock::default();
        let limits = InputLimits::with_clock(&cfg(), clock.clone());
        let alice: Arc<str> = "alice".into();
        for i in 0..20 {
            assert_eq!(limits.check(&alice, ip(1)), Verdict::Accept, "input {i}");
        }
        assert_eq!(limits.check(&alice, ip(1)), Verdict::OverAccountRate);
        clock.advance(Duration::from_millis(100));
        assert_eq!(limits.check(&alice, ip(1)), Verdict::Accept);
        assert_eq!(limits.check(&alice, ip(1)), Verdict::OverAccountRate);
        // The same account from another address shares its bucket.
        assert_eq!(limits.check(&alice, ip(2)), Verdict::OverAccountRate);
        // Another account is not affected.
        assert_eq!(limits.check(&"bob".into(), ip(2)), Verdict::Accept);
    }

    #[test]
    fn address_limit_spans_accounts() {
        let limits = InputLimits::with_clock(&cfg(), FakeRelativeClock::default());
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        // Two accounts' worth per address: both use their whole burst, a third finds none left.
        for _ in 0..20 {
            assert_eq!(limits.check(&a, ip(1)), Verdict::Accept);
            assert_eq!(limits.check(&b, ip(1)), Verdict::Accept);
        }
        assert_eq!(limits.check(&"c".into(), ip(1)), Verdict::OverAddressRate);
        assert_eq!(limits.check(&"c".into(), ip(2)), Verdict::Accept);
    }

    #[test]
    fn an_ipv6_host_is_limited_by_its_slash_64() {
        let limits = InputLimits::with_clock(&cfg(), FakeRelativeClock::default());
        let v6 = |last: u16| IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, last]);
        // Forty accounts' bursts from forty addresses of one /64 share one address bucket.
        let accepted = (0..40u16)
            .filter(|i| limits.check(&format!("acct-{i}").into(), v6(*i)) == Verdict::Accept)
            .count();
        assert_eq!(accepted, 40, "one input each fits the /64's burst of 40");
        assert_eq!(
            limits.check(&"one-more".into(), v6(999)),
            Verdict::OverAddressRate
        );
        let other_net = IpAddr::from([0x2001, 0xdb8, 0, 2, 0, 0, 0, 1]);
        assert_eq!(limits.check(&"one-more".into(), other_net), Verdict::Accept);
    }

    #[test]
    fn idle_keys_are_forgotten() {
        let clock = FakeRelativeClock::default();
        let limits = InputLimits::with_clock(&cfg(), clock.clone());
        limits.check(&"a".into(), ip(1));
        limits.forget_idle();
        assert_eq!(limits.keys(), (1, 1), "a drained bucket is remembered");
        clock.advance(Duration::from_secs(10));
        limits.forget_idle();
        assert_eq!(limits.keys(), (0, 0));
    }

    #[test]
    fn flood_needs_threshold_drops_within_one_second() {
        let ms = Duration::from_millis;
        let mut m = FloodMeter::new(5);
        for i in 0..4 {
            assert!(!m.record_drop(ms(i * 200)), "drop {i}");
        }
        // The fifth drop lands 1 s after the first: a new window, no flood.
        assert!(!m.record_drop(ms(1000)));
        for i in 1..4 {
            assert!(!m.record_drop(ms(1000 + i)));
        }
        assert!(m.record_drop(ms(1999)));
    }
}
