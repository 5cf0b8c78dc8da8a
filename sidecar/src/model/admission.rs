//! Whether the node admits new sessions: overload is shed at the door, where it is cheapest, so
//! the sessions already admitted keep their latency.
//!
//! Two signals close it for overload:
//!
//! - **tick overrun**: the game's `Load` report says its tick took at least `close_at_load` of its
//!   budget. The game is the one that knows; a game that cannot keep its tick rate makes every
//!   player on the node late, whatever the mesh does.
//! - **outbox pressure**: a proxy link's outbox holds `outbox_high_frames` or more frames. That
//!   queue is what stands between a client batch the node built and the client: every frame in
//!   it waits behind the others, so a deep queue is latency for every session on the link, and
//!   past `link_outbox_frames` the link is cut and all its sessions move. The other things the node
//!   sees are worse signals: a link already cut for a full outbox is too late (its sessions are
//!   gone), a slow consumer is one client's problem and is dropped at the proxy, and the frames
//!   packed per tick measure offered work, not whether it gets out.
//!
//! It reopens only once nothing hot was seen for `reopen_after_ms`: no report at or above
//! `open_below_load` and no pressure (hysteresis, so it does not flap). A report older than
//! `load_stale_ms` no longer counts, so a game that stops reporting does not keep the node
//! closed forever.
//!
//! A report comes about once a second, and a crowd logs in faster than that: everyone who comes
//! between two reports would be admitted on the strength of the last one. So logins are paced:
//! between two reports at most `login_burst_share` of the sessions the last one was made with
//! are admitted (at least `login_burst_min`), and fewer as the report nears the high mark; past
//! that the node is closed (`login_burst`) until the next report, which reopens it unless it
//! shows an overrun. Without a fresh report nothing
//! is paced (there is nothing to pace by).
//!
//! Near the knee a few more sessions are the difference between calm and collapse, so after an
//! overload the node remembers how many sessions it held when it overran, its **ceiling**: open
//! again, it admits new sessions only below it (reaching it pauses it, `at_capacity`, until the
//! next report), and each calm report raises it by 1 % (at least one session), so capacity is
//! probed again slowly instead of refilled at once. Without a fresh report it is forgotten.
//!
//! Pure: every call takes the time (monotonic ms) as an argument.

use serde::{Deserialize, Serialize};

/// The policy's thresholds: the sidecar configuration's `[admission]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Closes when a `Load` report's `tick_ms / budget_ms` reaches this.
    pub close_at_load: f64,
    /// Counts a report as calm only below this...
    pub open_below_load: f64,
    /// ...and reopens once nothing hot (a report at or above `open_below_load`, or outbox
    /// pressure) was seen for this long.
    pub reopen_after_ms: u64,
    /// A `Load` report older than this no longer counts (the game sends one about every second).
    pub load_stale_ms: u64,
    /// A proxy link whose outbox holds this many frames or more is under pressure.
    pub outbox_high_frames: usize,
    /// How long a client refused for overload is told to wait before it tries again.
    pub retry_after_ms: u32,
    /// Between two `Load` reports, at most this share of the sessions held at the last one are
    /// admitted...
    pub login_burst_share: f64,
    /// ...and at least this many.
    pub login_burst_min: u32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            close_at_load: 0.9,
            open_below_load: 0.7,
            reopen_after_ms: 5_000,
            load_stale_ms: 3_000,
            outbox_high_frames: 128,
            retry_after_ms: 5_000,
            login_burst_share: 0.1,
            login_burst_min: 20,
        }
    }
}

impl AdmissionConfig {
    /// What is wrong with the thresholds, naming the key.
    pub fn check(&self) -> Result<(), String> {
        let (close, open) = (self.close_at_load, self.open_below_load);
        if !(close.is_finite() && close > 0.0) {
            return Err(format!(
                "admission.close_at_load must be above 0, got {close}"
            ));
        }
        if !(open.is_finite() && open > 0.0 && open <= close) {
            return Err(format!(
                "admission.open_below_load must be above 0 and at most admission.close_at_load ({close}), got {open}"
            ));
        }
        if self.load_stale_ms == 0 {
            return Err("admission.load_stale_ms must be at least 1, got 0".into());
        }
        if self.outbox_high_frames == 0 {
            return Err("admission.outbox_high_frames must be at least 1, got 0".into());
        }
        let burst = self.login_burst_share;
        if !(burst.is_finite() && burst >= 0.0) {
            return Err(format!(
                "admission.login_burst_share must be 0 or more, got {burst}"
            ));
        }
        if self.login_burst_min == 0 {
            return Err("admission.login_burst_min must be at least 1, got 0".into());
        }
        Ok(())
    }
}

/// How long a client refused for a login burst is told to wait: about until the next report.
pub const LOGIN_BURST_RETRY_MS: u32 = 1_000;

/// Why the node closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    TickOverrun,
    OutboxPressure,
    /// A pause: as many logins came since the last report as it may vouch for.
    LoginBurst,
    /// A pause: the node holds as many sessions as it held when it last overran.
    AtCapacity,
}

impl Reason {
    pub const ALL: [Reason; 4] = [
        Reason::TickOverrun,
        Reason::OutboxPressure,
        Reason::LoginBurst,
        Reason::AtCapacity,
    ];

    /// Its name in metrics, on the wire and in `/state`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TickOverrun => "tick_overrun",
            Reason::OutboxPressure => "outbox_pressure",
            Reason::LoginBurst => "login_burst",
            Reason::AtCapacity => "at_capacity",
        }
    }

    /// A pause lasts until the next report; an overload, until a calm held long enough.
    pub fn is_pause(self) -> bool {
        matches!(self, Reason::LoginBurst | Reason::AtCapacity)
    }
}

/// A change of the decision, to be told to the proxies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Closed(Reason),
    Opened,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct LoadSample {
    at_ms: u64,
    /// `tick_ms / budget_ms`.
    share: f64,
    /// Sessions the node held when it came.
    sessions: usize,
}

/// The decision and what it was made from.
#[derive(Debug, Clone)]
pub struct Admission {
    cfg: AdmissionConfig,
    /// Why it is closed, and since when; `None` while open.
    closed: Option<(Reason, u64)>,
    load: Option<LoadSample>,
    /// The last time something hot was seen: the reopen clock starts over from it.
    last_hot_ms: Option<u64>,
    /// Sessions admitted since the last report.
    admitted_since_report: usize,
    /// Sessions it held when it last overran, raised by calm reports: new ones only below it.
    ceiling: Option<usize>,
}

impl Admission {
    /// Open, with nothing seen yet.
    pub fn new(cfg: AdmissionConfig) -> Self {
        Self {
            cfg,
            closed: None,
            load: None,
            last_hot_ms: None,
            admitted_since_report: 0,
            ceiling: None,
        }
    }

    pub fn is_open(&self) -> bool {
        self.closed.is_none()
    }

    /// Why it is closed, and since when (monotonic ms).
    pub fn closed(&self) -> Option<(Reason, u64)> {
        self.closed
    }

    /// How long a refused client should wait: until about the next report after a burst,
    /// longer after an overload.
    pub fn retry_after_ms(&self) -> u32 {
        match self.closed {
            Some((Reason::LoginBurst, _)) => LOGIN_BURST_RETRY_MS,
            _ => self.cfg.retry_after_ms,
        }
    }

    /// The sessions below which new ones are admitted, after an overload.
    pub fn ceiling(&self) -> Option<usize> {
        self.ceiling
    }

    /// The game's latest `tick_ms / budget_ms`, while it counts.
    pub fn load_share(&self, now_ms: u64) -> Option<f64> {
        self.fresh_load(now_ms).map(|l| l.share)
    }

    /// A `Load` report from the game, with the sessions the node holds now. One without a
    /// usable budget tells nothing and is ignored.
    pub fn on_load(
        &mut self,
        now_ms: u64,
        tick_ms: f32,
        budget_ms: f32,
        sessions: usize,
    ) -> Option<Change> {
        let (tick, budget) = (f64::from(tick_ms), f64::from(budget_ms));
        if !(tick.is_finite() && budget.is_finite() && tick >= 0.0 && budget > 0.0) {
            return None;
        }
        let share = tick / budget;
        self.load = Some(LoadSample {
            at_ms: now_ms,
            share,
            sessions,
        });
        self.admitted_since_report = 0;
        if share >= self.cfg.open_below_load {
            self.hot(now_ms);
        } else if let Some(c) = self.ceiling {
            self.ceiling = Some(c + (c / 100).max(1));
        }
        if share >= self.cfg.close_at_load {
            self.overran_with(sessions);
            return self.close(now_ms, Reason::TickOverrun);
        }
        if self.closed.is_some_and(|(r, _)| r.is_pause())
            && self.ceiling.is_none_or(|c| sessions < c)
        {
            // A fresh report, no overrun in it, and room below the ceiling: a fresh allowance.
            self.closed = None;
            return Some(Change::Opened);
        }
        self.evaluate(now_ms)
    }

    /// A new session wants in while the node holds `sessions`: whether it is admitted, and
    /// what changed if it used up the allowance since the last report (it is admitted; the next
    /// is not) or found the node at its ceiling (it is not).
    pub fn on_login(&mut self, now_ms: u64, sessions: usize) -> (bool, Option<Change>) {
        if self.closed.is_some() {
            return (false, None);
        }
        let Some(load) = self.fresh_load(now_ms) else {
            self.ceiling = None;
            return (true, None);
        };
        if self.ceiling.is_some_and(|c| sessions >= c) {
            return (false, self.close(now_ms, Reason::AtCapacity));
        }
        self.admitted_since_report += 1;
        if self.admitted_since_report >= self.allowance(load) {
            return (true, self.close(now_ms, Reason::LoginBurst));
        }
        (true, None)
    }

    /// New sessions admitted on the strength of `load`: while calm, `login_burst_share` of the
    /// sessions it was made with (at least `login_burst_min`); between the marks, half the
    /// headroom a straight line from the report to `close_at_load` leaves (at least one), so
    /// the node nears its mark in ever smaller steps.
    fn allowance(&self, load: LoadSample) -> usize {
        let held = load.sessions as f64;
        let burst = (held * self.cfg.login_burst_share).ceil();
        if load.share < self.cfg.open_below_load {
            return (burst as usize).max(self.cfg.login_burst_min as usize);
        }
        let headroom = held * (self.cfg.close_at_load / load.share - 1.0) / 2.0;
        // The epsilon keeps a whole number that floating point made a hair short of one.
        ((headroom.min(burst) + 1e-9).floor() as usize).max(1)
    }

    /// A proxy link's outbox held `frames` frames while the node held `sessions`; pressure
    /// from `outbox_high_frames` on.
    pub fn on_outbox(&mut self, now_ms: u64, frames: usize, sessions: usize) -> Option<Change> {
        if frames < self.cfg.outbox_high_frames {
            return self.evaluate(now_ms);
        }
        self.hot(now_ms);
        self.overran_with(sessions);
        self.close(now_ms, Reason::OutboxPressure)
    }

    /// Reopens once calm long enough; called on the node's timer as well as on each input.
    pub fn evaluate(&mut self, now_ms: u64) -> Option<Change> {
        if self.fresh_load(now_ms).is_none() {
            // Nothing to judge a ceiling by any more.
            self.ceiling = None;
        }
        let (reason, _) = self.closed?;
        if reason.is_pause() {
            // Paced by reports: none coming any more, nothing to pace by.
            if self.fresh_load(now_ms).is_none() {
                self.closed = None;
                return Some(Change::Opened);
            }
            return None;
        }
        let calm_for = now_ms.saturating_sub(self.last_hot_ms.unwrap_or(0));
        let load_calm = self
            .fresh_load(now_ms)
            .is_none_or(|l| l.share < self.cfg.open_below_load);
        if calm_for >= self.cfg.reopen_after_ms && load_calm {
            self.closed = None;
            return Some(Change::Opened);
        }
        None
    }

    fn hot(&mut self, now_ms: u64) {
        self.last_hot_ms = Some(self.last_hot_ms.map_or(now_ms, |t| t.max(now_ms)));
    }

    /// The node overran holding `sessions`: no more than that come back in at once.
    fn overran_with(&mut self, sessions: usize) {
        self.ceiling = Some(self.ceiling.map_or(sessions, |c| c.min(sessions)));
    }

    /// Closes for `reason`; an overload takes over from a pause (the proxies hear the new
    /// reason and hint).
    fn close(&mut self, now_ms: u64, reason: Reason) -> Option<Change> {
        match self.closed {
            Some((paused, since)) if paused.is_pause() && !reason.is_pause() => {
                self.closed = Some((reason, since));
                Some(Change::Closed(reason))
            }
            Some(_) => None,
            None => {
                self.closed = Some((reason, now_ms));
                Some(Change::Closed(reason))
            }
        }
    }

    fn fresh_load(&self, now_ms: u64) -> Option<LoadSample> {
        self.load
            .filter(|l| now_ms.saturating_sub(l.at_ms) < self.cfg.load_stale_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUDGET: f32 = 50.0;

    fn policy() -> Admission {
        Admission::new(AdmissionConfig::default())
    }

    /// Reports `tick_ms` every second from `from_ms` to `until_ms` (exclusive), evaluating every
    /// 100 ms between; the changes seen, with when.
    fn reports(a: &mut Admission, from_ms: u64, until_ms: u64, tick_ms: f32) -> Vec<(u64, Change)> {
        let mut seen = Vec::new();
        for t in (from_ms..until_ms).step_by(100) {
            let c = if (t - from_ms).is_multiple_of(1000) {
                a.on_load(t, tick_ms, BUDGET, 0)
            } else {
                a.evaluate(t)
            };
            seen.extend(c.map(|c| (t, c)));
        }
        seen
    }

    #[test]
    fn an_overrun_closes_and_only_a_calm_held_long_enough_reopens() {
        let mut a = policy();
        assert!(a.is_open());
        assert_eq!(reports(&mut a, 0, 3000, 20.0), vec![]);
        assert_eq!(
            a.on_load(3000, 45.0, BUDGET, 0),
            Some(Change::Closed(Reason::TickOverrun)),
            "0.9 of the budget closes"
        );
        assert_eq!(a.closed(), Some((Reason::TickOverrun, 3000)));
        // Between the marks it stays closed, however long.
        assert_eq!(reports(&mut a, 4000, 20_000, 40.0), vec![]);
        assert!(!a.is_open());
        // Below the low mark: open once the last hot report (19 000) is 5 s old.
        assert_eq!(
            reports(&mut a, 20_000, 30_000, 30.0),
            vec![(24_000, Change::Opened)]
        );
        assert_eq!(a.closed(), None);
    }

    #[test]
    fn open_between_the_marks_stays_open_so_it_does_not_flap() {
        let mut a = policy();
        assert_eq!(reports(&mut a, 0, 10_000, 44.0), vec![], "0.88: not closed");
        assert_eq!(
            a.on_load(10_000, 46.0, BUDGET, 0),
            Some(Change::Closed(Reason::TickOverrun))
        );
        // One calm report among hot ones starts nothing: the clock runs from the last hot one.
        assert_eq!(a.on_load(11_000, 10.0, BUDGET, 0), None);
        assert_eq!(a.on_load(12_000, 40.0, BUDGET, 0), None);
        assert_eq!(reports(&mut a, 13_000, 16_900, 10.0), vec![]);
        assert_eq!(a.evaluate(17_000), Some(Change::Opened));
        assert_eq!(a.evaluate(17_100), None, "told once");
    }

    #[test]
    fn a_stale_report_does_not_keep_it_closed() {
        let mut a = policy();
        assert_eq!(
            a.on_load(1000, 60.0, BUDGET, 0),
            Some(Change::Closed(Reason::TickOverrun))
        );
        // The game says nothing more (it went away, or stopped reporting).
        for t in (1100..6000).step_by(100) {
            assert_eq!(a.evaluate(t), None, "at {t}");
        }
        assert_eq!(a.load_share(3900), Some(1.2));
        assert_eq!(a.load_share(4000), None, "stale after 3 s");
        assert_eq!(a.evaluate(6000), Some(Change::Opened));
    }

    #[test]
    fn a_fresh_hot_report_holds_it_closed_even_past_the_reopen_time() {
        let cfg = AdmissionConfig {
            reopen_after_ms: 1000,
            load_stale_ms: 10_000,
            ..AdmissionConfig::default()
        };
        let mut a = Admission::new(cfg);
        a.on_load(0, 50.0, BUDGET, 0);
        assert_eq!(a.evaluate(5000), None, "the last word is still 1.0");
        // A report speaks for the time before it: the calm began long ago.
        assert_eq!(a.on_load(6000, 5.0, BUDGET, 0), Some(Change::Opened));
    }

    #[test]
    fn outbox_pressure_closes_and_holds_while_it_lasts() {
        let mut a = policy();
        assert_eq!(a.on_outbox(100, 127, 10), None, "below the mark");
        assert_eq!(
            a.on_outbox(200, 128, 10),
            Some(Change::Closed(Reason::OutboxPressure))
        );
        assert_eq!(a.on_outbox(300, 500, 10), None, "already closed");
        // The game is fine, but the pressure goes on for two seconds.
        a.on_load(1000, 10.0, BUDGET, 0);
        for t in (400..2500).step_by(100) {
            assert_eq!(a.on_outbox(t, 300, 10), None);
        }
        assert_eq!(a.evaluate(7399), None);
        assert_eq!(a.evaluate(7400), Some(Change::Opened), "5 s after the last");
        // An overrun while open closes with its own reason.
        assert_eq!(
            a.on_load(8000, 47.0, BUDGET, 0),
            Some(Change::Closed(Reason::TickOverrun))
        );
    }

    #[test]
    fn logins_between_two_reports_are_paced_and_the_next_calm_report_reopens() {
        let mut a = policy();
        // No report yet: nothing to pace by.
        for _ in 0..100 {
            assert_eq!(a.on_login(0, 0), (true, None));
        }
        // 300 sessions at a calm report: 30 more before the next one (10 %).
        assert_eq!(a.on_load(1000, 20.0, BUDGET, 300), None);
        for i in 0..29 {
            assert_eq!(a.on_login(1100, 0), (true, None), "login {i}");
        }
        assert_eq!(
            a.on_login(1100, 0),
            (true, Some(Change::Closed(Reason::LoginBurst))),
            "the 30th is in; it closes behind it"
        );
        assert_eq!(a.on_login(1200, 0), (false, None));
        assert_eq!(a.retry_after_ms(), LOGIN_BURST_RETRY_MS);
        assert_eq!(a.evaluate(1900), None, "until the next report");
        // The next report is calm: open again, with a fresh allowance (at least the minimum).
        assert_eq!(a.on_load(2000, 20.0, BUDGET, 100), Some(Change::Opened));
        for _ in 0..19 {
            assert_eq!(a.on_login(2100, 0), (true, None));
        }
        assert_eq!(
            a.on_login(2100, 0),
            (true, Some(Change::Closed(Reason::LoginBurst)))
        );
        // A report of an overrun turns the pause into an overload closing, with its hint.
        assert_eq!(
            a.on_load(3000, 48.0, BUDGET, 120),
            Some(Change::Closed(Reason::TickOverrun))
        );
        assert_eq!(a.retry_after_ms(), 5000);
        assert_eq!(a.closed(), Some((Reason::TickOverrun, 2100)));
        assert_eq!(a.on_load(4000, 10.0, BUDGET, 120), None, "hysteresis now");
        assert_eq!(a.evaluate(7999), None);
        assert_eq!(a.evaluate(8000), Some(Change::Opened));
    }

    #[test]
    fn after_an_overrun_no_more_sessions_than_overran_come_back_and_calm_raises_the_ceiling() {
        let mut a = policy();
        assert_eq!(a.on_load(0, 20.0, BUDGET, 180), None);
        assert_eq!(a.ceiling(), None, "no overload yet: no ceiling");
        assert_eq!(
            a.on_load(1000, 46.0, BUDGET, 200),
            Some(Change::Closed(Reason::TickOverrun))
        );
        assert_eq!(a.ceiling(), Some(200));
        // Calm from now on (sessions left meanwhile): open again after the hysteresis...
        let mut t = 2000;
        while !a.is_open() {
            a.on_load(t, 10.0, BUDGET, 190);
            t += 1000;
        }
        assert_eq!(t, 7000, "reopened by the report at 6 s");
        // ...each calm report having raised the ceiling by 1 % (two sessions of 200).
        assert_eq!(a.ceiling(), Some(210));
        // New sessions up to it, not past it: reaching it pauses admission.
        for held in 195..210 {
            assert_eq!(a.on_login(6100, held), (true, None), "with {held} held");
        }
        assert_eq!(
            a.on_login(6100, 210),
            (false, Some(Change::Closed(Reason::AtCapacity)))
        );
        assert_eq!(a.retry_after_ms(), 5000);
        assert_eq!(
            a.on_login(6200, 209),
            (false, None),
            "paused until the next report"
        );
        // A calm report raises it (to 212), and the node takes new sessions again.
        assert_eq!(a.on_load(7000, 10.0, BUDGET, 210), Some(Change::Opened));
        assert_eq!(a.ceiling(), Some(212));
        assert_eq!(a.on_login(7100, 211), (true, None));
        assert_eq!(
            a.on_login(7100, 212),
            (false, Some(Change::Closed(Reason::AtCapacity)))
        );
        // A report between the marks raises nothing and reopens nothing.
        assert_eq!(a.on_load(8000, 40.0, BUDGET, 212), None);
        assert_eq!(a.ceiling(), Some(212));
        // An overrun with fewer sessions lowers it.
        a.on_load(9000, 48.0, BUDGET, 150);
        assert_eq!(a.ceiling(), Some(150));
        // Reports stop: the ceiling is forgotten with them.
        a.evaluate(12_000);
        assert_eq!(a.ceiling(), None);
    }

    #[test]
    fn between_the_marks_logins_are_paced_by_the_headroom_left() {
        let allowed = |share_of_budget: f32, held: usize| {
            let mut a = policy();
            a.on_load(0, share_of_budget * BUDGET, BUDGET, held);
            let mut n = 0;
            while a.on_login(10, held + n).1.is_none() {
                n += 1;
            }
            n + 1
        };
        assert_eq!(allowed(0.5, 300), 30, "calm: a tenth of 300");
        assert_eq!(allowed(0.5, 50), 20, "calm: at least the minimum");
        // 0.75 of the budget with 300: a line reaches 0.9 at 360; half of the 60 between.
        assert_eq!(allowed(0.75, 300), 30);
        assert_eq!(allowed(0.8, 300), 18, "(0.9 / 0.8 - 1) * 300 / 2");
        assert_eq!(allowed(0.88, 300), 3);
        assert_eq!(allowed(0.895, 10), 1, "always one");
    }

    #[test]
    fn a_burst_pause_ends_when_reports_stop() {
        let mut a = policy();
        a.on_load(0, 10.0, BUDGET, 0);
        for _ in 0..19 {
            a.on_login(10, 0);
        }
        assert_eq!(
            a.on_login(10, 0),
            (true, Some(Change::Closed(Reason::LoginBurst)))
        );
        assert_eq!(a.evaluate(2999), None);
        assert_eq!(
            a.evaluate(3000),
            Some(Change::Opened),
            "the report went stale"
        );
        assert_eq!(a.on_login(3000, 0), (true, None), "unpaced without reports");
    }

    #[test]
    fn a_report_without_a_budget_is_ignored() {
        let mut a = policy();
        assert_eq!(a.on_load(0, 100.0, 0.0, 0), None);
        assert_eq!(a.on_load(0, f32::NAN, BUDGET, 0), None);
        assert_eq!(a.on_load(0, -1.0, BUDGET, 0), None);
        assert!(a.is_open());
        assert_eq!(a.load_share(0), None);
    }

    #[test]
    fn thresholds_are_checked_by_name() {
        assert!(AdmissionConfig::default().check().is_ok());
        let bad = |cfg: AdmissionConfig, key: &str| {
            let e = cfg.check().unwrap_err();
            assert!(e.contains(key), "{e:?} should name {key}");
        };
        bad(
            AdmissionConfig {
                open_below_load: 0.95,
                ..Default::default()
            },
            "admission.open_below_load",
        );
        bad(
            AdmissionConfig {
                close_at_load: 0.0,
                ..Default::default()
            },
            "admission.close_at_load",
        );
        bad(
            AdmissionConfig {
                outbox_high_frames: 0,
                ..Default::default()
            },
            "admission.outbox_high_frames",
        );
        bad(
            AdmissionConfig {
                load_stale_ms: 0,
                ..Default::default()
            },
            "admission.load_stale_ms",
        );
        bad(
            AdmissionConfig {
                login_burst_share: -0.1,
                ..Default::default()
            },
            "admission.login_burst_share",
        );
        bad(
            AdmissionConfig {
                login_burst_min: 0,
                ..Default::default()
            },
            "admission.login_burst_min",
        );
    }
}
