//! A node's persistent load, for the balancer (BigWorld's `CellApp::updateLoad` and
//! `informOfLoad`, seed `004`): the fraction of its tick budget the game uses, smoothed over time.
//! A game that reports `Load{tick_ms, budget_ms}` is taken at its word; one that never does (or
//! stopped) is estimated from its entity count at a documented cost per entity. The smoothing is
//! by time, not by report: a report after a long silence moves the figure more than one after a
//! short one, so games reporting at different rates weigh alike.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadConfig {
    /// The share of the distance to a new sample the smoothed load covers per second (0..1]:
    /// 0.2 follows a step to 90% in about 10 s.
    pub smoothing_bias: f64,
    /// The tick cost of one entity when the game reports no `Load` (ms).
    pub entity_cost_ms: f64,
    /// The tick budget assumed for that estimate (ms; 50 is a 20 Hz tick).
    pub budget_ms: f64,
    /// A game silent this long is estimated instead (ms).
    pub silent_after_ms: u64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            smoothing_bias: 0.2,
            entity_cost_ms: 0.05,
            budget_ms: 50.0,
            silent_after_ms: 3_000,
        }
    }
}

impl LoadConfig {
    pub fn check(&self) -> Result<(), String> {
        if !(self.smoothing_bias > 0.0 && self.smoothing_bias <= 1.0) {
            return Err(format!(
                "load.smoothing_bias must be within (0, 1], got {}",
                self.smoothing_bias
            ));
        }
        if !(self.entity_cost_ms.is_finite() && self.entity_cost_ms >= 0.0) {
            return Err(format!(
                "load.entity_cost_ms must be a finite number >= 0, got {}",
                self.entity_cost_ms
            ));
        }
        if !(self.budget_ms.is_finite() && self.budget_ms > 0.0) {
            return Err(format!(
                "load.budget_ms must be a finite number > 0, got {}",
                self.budget_ms
            ));
        }
        Ok(())
    }
}

/// Where the load figure comes from now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadSource {
    /// No sample yet.
    None,
    /// The game's `Load` reports.
    Game,
    /// The entity count (the game reports none, or went silent).
    Estimate,
}

#[derive(Debug, Clone)]
pub struct LoadMeter {
    cfg: LoadConfig,
    smoothed: Option<f64>,
    updated_ms: u64,
    last_report_ms: Option<u64>,
    source: LoadSource,
}

impl LoadMeter {
    pub fn new(cfg: LoadConfig) -> Self {
        Self {
            cfg,
            smoothed: None,
            updated_ms: 0,
            last_report_ms: None,
            source: LoadSource::None,
        }
    }

    /// The game's report at `now_ms`. A report without a budget says nothing and is ignored.
    pub fn on_report(&mut self, now_ms: u64, tick_ms: f32, budget_ms: f32) {
        if !(budget_ms > 0.0 && tick_ms.is_finite() && tick_ms >= 0.0) {
            return;
        }
        self.last_report_ms = Some(now_ms);
        self.source = LoadSource::Game;
        self.sample(now_ms, f64::from(tick_ms) / f64::from(budget_ms));
    }

    /// The load at `now_ms`, the game holding `entities`: a silent game's is estimated from them.
    pub fn load(&mut self, now_ms: u64, entities: usize) -> f64 {
        let silent = self
            .last_report_ms
            .is_none_or(|t| now_ms.saturating_sub(t) >= self.cfg.silent_after_ms);
        if silent {
            self.source = LoadSource::Estimate;
            let estimate = entities as f64 * self.cfg.entity_cost_ms / self.cfg.budget_ms;
            self.sample(now_ms, estimate);
        }
        self.smoothed.unwrap_or(0.0)
    }

    /// The figure as last computed (0 before any).
    pub fn last(&self) -> f64 {
        self.smoothed.unwrap_or(0.0)
    }

    pub fn source(&self) -> LoadSource {
        self.source
    }

    fn sample(&mut self, now_ms: u64, value: f64) {
        let next = match self.smoothed {
            None => value,
            Some(s) => {
                let dt_s = now_ms.saturating_sub(self.updated_ms) as f64 / 1000.0;
                let keep = (1.0 - self.cfg.smoothing_bias).powf(dt_s);
                s + (1.0 - keep) * (value - s)
            }
        };
        self.smoothed = Some(next);
        self.updated_ms = now_ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_smoothed_by_time_and_a_silent_game_is_estimated_from_its_entities() {
        let mut m = LoadMeter::new(LoadConfig::default());
        assert_eq!(m.source(), LoadSource::None);
        m.on_report(0, 10.0, 50.0);
        assert_eq!((m.load(0, 0), m.source()), (0.2, LoadSource::Game));
        // A step to 90%: a report each second covers 20% of the way each time.
        for s in 1..=10 {
            m.on_report(s * 1000, 45.0, 50.0);
        }
        let after_10s = m.load(10_000, 0);
        let expected = 0.9 - 0.7 * 0.8f64.powi(10);
        assert!(
            (after_10s - expected).abs() < 1e-9,
            "{after_10s} vs {expected}"
        );
        // Reports twice as often weigh the same per second.
        let mut fast = LoadMeter::new(LoadConfig::default());
        fast.on_report(0, 10.0, 50.0);
        for s in 1..=20 {
            fast.on_report(s * 500, 45.0, 50.0);
        }
        assert!((fast.load(10_000, 0) - after_10s).abs() < 1e-9);
        // Silent for 3 s: 400 entities at 0.05 ms of a 50 ms budget is 0.4.
        let est = m.load(13_000, 400);
        assert_eq!(m.source(), LoadSource::Estimate);
        assert!(est < after_10s && est > 0.4, "{est}");
        // A report without a budget is ignored.
        m.on_report(14_000, 5.0, 0.0);
        assert_eq!(m.source(), LoadSource::Estimate);
    }

    #[test]
    fn a_game_that_never_reports_is_estimated_from_the_first_read() {
        let mut m = LoadMeter::new(LoadConfig::default());
        assert_eq!(m.load(5_000, 1000), 1.0);
        assert_eq!(m.source(), LoadSource::Estimate);
        assert!(LoadConfig {
            smoothing_bias: 0.0,
            ..LoadConfig::default()
        }
        .check()
        .is_err());
    }
}
