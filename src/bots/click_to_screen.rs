//! Click to screen, as the bots measure it: from sending an input to seeing their avatar
//! acknowledge it. Kept per bot location, whole-run (a histogram) and over time (the median and
//! 99th percentile of each second), so that a run of hours costs kilobytes, not a sample each.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

/// The width of one time bin.
pub const BIN: Duration = Duration::from_secs(1);

/// One second of one location's samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bin {
    /// Where the bin starts, from [`ClickToScreen::origin`] (s).
    pub t_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub samples: usize,
}

/// The run's figures for one location.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Figures {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub samples: u64,
}

#[derive(Debug)]
struct Location {
    /// The whole run, in µs.
    all: Histogram<u64>,
    /// The bin open now, and its samples (ms).
    open: u64,
    samples: Vec<f64>,
    bins: Vec<Bin>,
    /// Every sample, (s from the origin, ms), for a location tracked to the sample: its figures
    /// can then be cut at any instant (before and after a bubble move). `None` once full.
    kept: Option<Vec<(f32, f32)>>,
}

impl Location {
    fn new() -> Self {
        Self {
            // 1 µs to an hour, three significant figures.
            all: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds"),
            open: 0,
            samples: Vec::new(),
            bins: Vec::new(),
            kept: None,
        }
    }

    fn close(&mut self) {
        if let Some(bin) = bin_of(self.open, &mut self.samples) {
            self.bins.push(bin);
        }
        self.samples.clear();
    }
}

/// The figures of one bin's samples (sorted here), or none for no sample.
fn bin_of(index: u64, samples: &mut [f64]) -> Option<Bin> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Some(Bin {
        t_s: index as f64 * BIN.as_secs_f64(),
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        samples: samples.len(),
    })
}

/// Most samples kept for one tracked location (8 MB): hours of a few dozen bots.
const KEPT_MAX: usize = 1_000_000;

/// The click-to-screen samples of every bot of a run.
#[derive(Debug)]
pub struct ClickToScreen {
    origin: Instant,
    by_location: Mutex<BTreeMap<String, Location>>,
}

impl Default for ClickToScreen {
    fn default() -> Self {
        Self::starting(Instant::now())
    }
}

impl ClickToScreen {
    /// Bins are counted from `origin`.
    pub fn starting(origin: Instant) -> Self {
        Self {
            origin,
            by_location: Mutex::default(),
        }
    }

    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// A sample of `ms` taken `at`, by a bot playing from `location`.
    pub fn record(&self, location: &str, at: Instant, ms: f64) {
        let index =
            (at.saturating_duration_since(self.origin).as_secs_f64() / BIN.as_secs_f64()) as u64;
        let mut all = self
            .by_location
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let loc = match all.get_mut(location) {
            Some(l) => l,
            None => all
                .entry(location.to_string())
                .or_insert_with(Location::new),
        };
        // Bots report from many tasks: a sample a little late for its bin joins the open one.
        if index > loc.open {
            loc.close();
            loc.open = index;
        }
        loc.samples.push(ms);
        if let Some(kept) = &mut loc.kept {
            if kept.len() < KEPT_MAX {
                let t = at.saturating_duration_since(self.origin).as_secs_f32();
                kept.push((t, ms as f32));
            } else {
                loc.kept = None;
            }
        }
        loc.all
            .saturating_record((ms * 1000.0).round().max(1.0) as u64);
    }

    /// Keeps every sample of `location` from now on (up to a million), for
    /// [`Self::median_between`].
    pub fn track(&self, location: &str) {
        let mut all = self
            .by_location
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        all.entry(location.to_string())
            .or_insert_with(Location::new)
            .kept = Some(Vec::new());
    }

    /// The median and the count of `location`'s samples taken between `from_s` and `to_s` after
    /// the origin; `None` if the location is not tracked (or overflowed) or has none there.
    pub fn median_between(&self, location: &str, from_s: f64, to_s: f64) -> Option<(f64, usize)> {
        let all = self
            .by_location
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut ms: Vec<f32> = all
            .get(location)?
            .kept
            .as_ref()?
            .iter()
            .filter(|(t, _)| (from_s..to_s).contains(&f64::from(*t)))
            .map(|(_, ms)| *ms)
            .collect();
        if ms.is_empty() {
            return None;
        }
        ms.sort_by(f32::total_cmp);
        Some((f64::from(ms[(ms.len() - 1) / 2]), ms.len()))
    }

    /// The whole run's median and 99th percentile by location.
    pub fn figures(&self) -> BTreeMap<String, Figures> {
        self.by_location
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(name, l)| {
                let q = |q: f64| l.all.value_at_quantile(q) as f64 / 1000.0;
                let figures = Figures {
                    p50_ms: q(0.5),
                    p99_ms: q(0.99),
                    samples: l.all.len(),
                };
                (name.clone(), figures)
            })
            .collect()
    }

    /// Each location's bins, the open one included, in time order.
    pub fn series(&self) -> BTreeMap<String, Vec<Bin>> {
        self.by_location
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(name, l)| {
                let mut bins = l.bins.clone();
                bins.extend(bin_of(l.open, &mut l.samples.clone()));
                (name.clone(), bins)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_fall_into_their_second_and_the_run_figures_keep_them_all() {
        let t0 = Instant::now();
        let c = ClickToScreen::starting(t0);
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        for (ms, v) in [
            (100, 10.0),
            (200, 30.0),
            (900, 20.0),
            (1500, 90.0),
            (3200, 95.0),
        ] {
            c.record("paris", at(ms), v);
        }
        // Late for its bin: joins the open one.
        c.record("paris", at(2900), 100.0);
        c.record("montreal", at(50), 5.0);
        let s = c.series();
        let p: Vec<(f64, f64, f64, usize)> = s["paris"]
            .iter()
            .map(|b| (b.t_s, b.p50_ms, b.p99_ms, b.samples))
            .collect();
        assert_eq!(
            p,
            [
                (0.0, 20.0, 30.0, 3),
                (1.0, 90.0, 90.0, 1),
                (3.0, 100.0, 100.0, 2)
            ]
        );
        assert_eq!(s["montreal"].len(), 1);
        let f = c.figures();
        assert_eq!(f["paris"].samples, 6);
        assert!((f["paris"].p50_ms - 30.0).abs() < 0.1, "{:?}", f["paris"]);
        assert!((f["paris"].p99_ms - 100.0).abs() < 0.1, "{:?}", f["paris"]);
        assert!((f["montreal"].p50_ms - 5.0).abs() < 0.01);
        // Not tracked: no cut.
        assert_eq!(c.median_between("paris", 0.0, 10.0), None);
    }

    #[test]
    fn a_tracked_location_is_cut_at_any_instant() {
        let t0 = Instant::now();
        let c = ClickToScreen::starting(t0);
        c.track("far");
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        for (ms, v) in [
            (100, 200.0),
            (900, 220.0),
            (1_100, 210.0),
            (5_000, 8.0),
            (6_000, 6.0),
        ] {
            c.record("far", at(ms), v);
        }
        assert_eq!(c.median_between("far", 0.0, 2.0), Some((210.0, 3)));
        assert_eq!(c.median_between("far", 4.0, 60.0), Some((6.0, 2)));
        assert_eq!(c.median_between("far", 2.0, 4.0), None);
    }
}
