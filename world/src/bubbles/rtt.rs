//! Server-measured RTT, reduced to what placement may use.
//!
//! Proxies time their own pings, so a client can make its RTT look higher, never lower. Per
//! session and site we keep the median of the last `window` samples (a jitter spike moves it
//! little) and the session's **baseline**: the lowest such median seen since login. Placement
//! uses `min(median, baseline + tolerance)`: a fall counts at once, a rise counts up to the
//! tolerance and no further. Inflating one's ping, or switching VPN mid-session, therefore
//! shifts a player's figure by at most the tolerance, and the fairness cap bounds what any one
//! player can add to a group's mean. A new login starts a new baseline.

use rustc_hash::FxHashMap as HashMap;

use serde::{Deserialize, Serialize};

use super::{BubbleError, MemberId, SiteId};

/// Largest window accepted: a minute of pings.
const MAX_WINDOW: usize = 60;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RttParams {
    /// Samples whose median is the current estimate (one per ping, every second). The baseline is
    /// taken once the window is half full.
    pub window: usize,
    /// How far above the session's baseline an RTT may rise and still count for placement.
    pub tolerance_ms: f64,
}

impl Default for RttParams {
    fn default() -> Self {
        Self {
            window: 10,
            tolerance_ms: 15.0,
        }
    }
}

impl RttParams {
    pub fn validate(&self) -> Result<(), BubbleError> {
        if !(1..=MAX_WINDOW).contains(&self.window) {
            return Err(BubbleError::Param {
                name: "rtt.window",
                detail: format!("{} must be within 1..={MAX_WINDOW}", self.window),
            });
        }
        // Infinity is allowed: it turns the protection off (for comparisons).
        if self.tolerance_ms.is_nan() || self.tolerance_ms < 0.0 {
            return Err(BubbleError::Param {
                name: "rtt.tolerance_ms",
                detail: format!("{} must be >= 0", self.tolerance_ms),
            });
        }
        Ok(())
    }
}

/// Where the placement reads RTTs from.
pub trait RttSource {
    /// The RTT (ms) placement may use for this member and site; `None` if there is no
    /// measurement.
    fn placement_rtt(&self, member: MemberId, site: SiteId) -> Option<f64>;
}

/// A plain table, taken as is: for tests and for yardsticks that know the true RTT.
impl RttSource for std::collections::BTreeMap<(MemberId, SiteId), f64> {
    fn placement_rtt(&self, member: MemberId, site: SiteId) -> Option<f64> {
        self.get(&(member, site)).copied()
    }
}

#[derive(Debug, Clone)]
struct SiteRtt {
    /// The last samples in arrival order (`ring`), then the same sorted (`sorted`): `window`
    /// slots each, `len` of them valid. The next sample goes at `next` in the ring.
    buf: Box<[f64]>,
    len: usize,
    next: usize,
    baseline: Option<f64>,
}

impl SiteRtt {
    fn new(window: usize) -> Self {
        Self {
            buf: vec![0.0; 2 * window].into_boxed_slice(),
            len: 0,
            next: 0,
            baseline: None,
        }
    }

    fn window(&self) -> usize {
        self.buf.len() / 2
    }

    fn record(&mut self, rtt_ms: f64) {
        let window = self.window();
        let (ring, sorted) = self.buf.split_at_mut(window);
        // The window is a handful of samples: counting those below (no branch to mispredict on
        // jittery samples) and shifting by hand beat a binary search and a memmove.
        let below = |sorted: &[f64], x: f64| {
            sorted
                .iter()
                .map(|v| usize::from(v.total_cmp(&x).is_lt()))
                .sum::<usize>()
        };
        if self.len == window {
            let at = below(&sorted[..self.len], ring[self.next]);
            for k in at..self.len - 1 {
                sorted[k] = sorted[k + 1];
            }
            self.len -= 1;
        }
        ring[self.next] = rtt_ms;
        self.next = (self.next + 1) % window;
        let at = below(&sorted[..self.len], rtt_ms);
        for k in (at..self.len).rev() {
            sorted[k + 1] = sorted[k];
        }
        sorted[at] = rtt_ms;
        self.len += 1;
        if 2 * self.len >= window {
            let m = self.median();
            self.baseline = Some(self.baseline.map_or(m, |b| b.min(m)));
        }
    }

    fn median(&self) -> f64 {
        let (s, mid) = (&self.buf[self.window()..][..self.len], self.len / 2);
        if self.len % 2 == 1 {
            s[mid]
        } else {
            (s[mid - 1] + s[mid]) / 2.0
        }
    }

    fn placement(&self, p: &RttParams) -> Option<f64> {
        (self.len > 0).then(|| match self.baseline {
            Some(b) => self.median().min(b + p.tolerance_ms),
            None => self.median(),
        })
    }
}

fn fresh(window: usize, sites: usize) -> Vec<SiteRtt> {
    vec![SiteRtt::new(window); sites]
}

/// Per-session RTT estimates toward every site.
#[derive(Debug, Clone)]
pub struct RttBook {
    params: RttParams,
    sites: usize,
    sessions: HashMap<MemberId, Vec<SiteRtt>>,
}

impl RttBook {
    pub fn new(params: RttParams, sites: usize) -> Result<Self, BubbleError> {
        params.validate()?;
        Ok(Self {
            params,
            sites,
            sessions: HashMap::default(),
        })
    }

    /// A new login: forget the member's previous samples and baselines.
    pub fn start_session(&mut self, member: MemberId) {
        self.sessions
            .insert(member, fresh(self.params.window, self.sites));
    }

    pub fn end_session(&mut self, member: MemberId) {
        self.sessions.remove(&member);
    }

    /// One server-measured sample. A member with no session gets one. A bad sample is refused
    /// and changes nothing.
    pub fn record(
        &mut self,
        member: MemberId,
        site: SiteId,
        rtt_ms: f64,
    ) -> Result<(), BubbleError> {
        if usize::from(site.0) >= self.sites {
            return Err(BubbleError::UnknownSite(site.0));
        }
        if !(rtt_ms.is_finite() && rtt_ms >= 0.0) {
            return Err(BubbleError::Rtt {
                id: member,
                site: site.0,
                rtt_ms,
            });
        }
        let (window, sites) = (self.params.window, self.sites);
        self.sessions
            .entry(member)
            .or_insert_with(|| fresh(window, sites))[usize::from(site.0)]
        .record(rtt_ms);
        Ok(())
    }

    /// The session's baseline toward a site, once established.
    pub fn baseline(&self, member: MemberId, site: SiteId) -> Option<f64> {
        self.sessions
            .get(&member)?
            .get(usize::from(site.0))?
            .baseline
    }
}

impl RttSource for RttBook {
    fn placement_rtt(&self, member: MemberId, site: SiteId) -> Option<f64> {
        self.sessions
            .get(&member)?
            .get(usize::from(site.0))?
            .placement(&self.params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book() -> RttBook {
        RttBook::new(RttParams::default(), 2).unwrap()
    }

    #[test]
    fn a_spike_barely_moves_the_estimate() {
        let mut b = book();
        for v in [50.0, 51.0, 49.0, 400.0, 50.0] {
            b.record(1, SiteId(0), v).unwrap();
        }
        assert_eq!(b.placement_rtt(1, SiteId(0)), Some(50.0));
        assert_eq!(b.placement_rtt(1, SiteId(1)), None);
    }

    #[test]
    fn rises_count_up_to_the_tolerance_falls_at_once() {
        let mut b = book();
        for _ in 0..10 {
            b.record(1, SiteId(0), 90.0).unwrap();
        }
        for _ in 0..10 {
            b.record(1, SiteId(0), 300.0).unwrap();
        }
        assert_eq!(b.placement_rtt(1, SiteId(0)), Some(105.0));
        for _ in 0..10 {
            b.record(1, SiteId(0), 60.0).unwrap();
        }
        assert_eq!(b.placement_rtt(1, SiteId(0)), Some(60.0));
        assert_eq!(b.baseline(1, SiteId(0)), Some(60.0));
    }

    #[test]
    fn a_new_session_starts_a_new_baseline() {
        let mut b = book();
        for _ in 0..10 {
            b.record(1, SiteId(0), 20.0).unwrap();
        }
        b.start_session(1);
        for _ in 0..10 {
            b.record(1, SiteId(0), 120.0).unwrap();
        }
        assert_eq!(b.placement_rtt(1, SiteId(0)), Some(120.0));
    }

    proptest::proptest! {
        /// The rolling median equals the median of the last `window` samples, sorted afresh.
        #[test]
        fn the_rolling_median_is_the_median_of_the_window(
            window in 1usize..16,
            samples in proptest::collection::vec(0.0f64..500.0, 1..80),
        ) {
            let mut s = SiteRtt::new(window);
            for (i, &v) in samples.iter().enumerate() {
                s.record(v);
                let mut last: Vec<f64> = samples[(i + 1).saturating_sub(window)..=i].to_vec();
                last.sort_by(f64::total_cmp);
                let n = last.len();
                let want = if n % 2 == 1 { last[n / 2] } else { (last[n / 2 - 1] + last[n / 2]) / 2.0 };
                proptest::prop_assert_eq!(s.median(), want);
            }
        }
    }

    #[test]
    fn bad_samples_are_refused_and_change_nothing() {
        let mut b = book();
        b.record(1, SiteId(0), 40.0).unwrap();
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            let e = b.record(1, SiteId(0), bad).unwrap_err();
            assert!(matches!(e, BubbleError::Rtt { .. }), "{e}");
        }
        assert_eq!(
            b.record(1, SiteId(2), 1.0),
            Err(BubbleError::UnknownSite(2))
        );
        assert_eq!(b.placement_rtt(1, SiteId(0)), Some(40.0));
    }
}
