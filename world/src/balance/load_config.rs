//! The balancer's parameters (BigWorld's `CellAppLoadConfig` and `BalanceConfig`), each with its
//! default. Loads are fractions of a node's tick budget: 0.5 is a game using half its tick.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadConfig {
    /// How often the lines are balanced (ms).
    pub balance_period_ms: u64,
    /// How often cells are added or retired (ms).
    pub meta_period_ms: u64,
    /// A line never grows a side whose most loaded cell is at or over
    /// `max(safety_bound, average × safety_ratio)`.
    pub safety_bound: f64,
    pub safety_ratio: f64,
    /// The most load one line move sheds in one round: the bound levels pick the deepest move
    /// whose entities carry at most this much (times the line's aggression).
    pub max_offload: f64,
    /// A line holds when the load it would shed (excess times aggression) is under this.
    pub min_offload: f64,
    /// A line's aggression halves when it reverses, and grows back to the full move in
    /// `aggression_recovery_ms`, within `[min_aggression, 1]`.
    pub aggression_decrease: f64,
    pub aggression_recovery_ms: u64,
    pub min_aggression: f64,
    /// A cell is added (from a spare node) when the cells' average load is over the average of
    /// every node, spares included, by more than this...
    pub add_tolerance: f64,
    /// ...and at least this: spares join a busy world, not an idle one.
    pub add_above: f64,
    /// A cell is retired when the others would still average under this without it.
    pub lower_bound: f64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        Self {
            balance_period_ms: 1_000,
            meta_period_ms: 3_000,
            safety_bound: 0.85,
            safety_ratio: 1.1,
            max_offload: 0.05,
            min_offload: 0.002,
            aggression_decrease: 0.5,
            aggression_recovery_ms: 10_000,
            min_aggression: 1.0 / 16.0,
            add_tolerance: 0.05,
            add_above: 0.5,
            lower_bound: 0.2,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("balance.{name}: {detail}")]
pub struct LoadConfigError {
    pub name: &'static str,
    pub detail: String,
}

impl LoadConfig {
    pub fn validate(&self) -> Result<(), LoadConfigError> {
        let bad = |name, detail: String| Err(LoadConfigError { name, detail });
        for (name, v) in [
            ("safety_bound", self.safety_bound),
            ("safety_ratio", self.safety_ratio),
            ("max_offload", self.max_offload),
            ("min_offload", self.min_offload),
            ("add_tolerance", self.add_tolerance),
            ("add_above", self.add_above),
            ("lower_bound", self.lower_bound),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(name, format!("{v} must be a finite number >= 0"));
            }
        }
        if !(self.aggression_decrease > 0.0 && self.aggression_decrease < 1.0) {
            return bad(
                "aggression_decrease",
                format!("{} must be within (0, 1)", self.aggression_decrease),
            );
        }
        if !(self.min_aggression > 0.0 && self.min_aggression <= 1.0) {
            return bad(
                "min_aggression",
                format!("{} must be within (0, 1]", self.min_aggression),
            );
        }
        for (name, v) in [
            ("balance_period_ms", self.balance_period_ms),
            ("meta_period_ms", self.meta_period_ms),
            ("aggression_recovery_ms", self.aggression_recovery_ms),
        ] {
            if v == 0 {
                return bad(name, "must be at least 1".into());
            }
        }
        if self.lower_bound >= self.safety_bound {
            return bad(
                "lower_bound",
                format!(
                    "{} must be under safety_bound ({}): a retired cell's load would push the rest \
                     over it",
                    self.lower_bound, self.safety_bound
                ),
            );
        }
        if self.add_above <= self.lower_bound {
            return bad(
                "add_above",
                format!(
                    "{} must be over lower_bound ({}): a cell added would be retired at once",
                    self.add_above, self.lower_bound
                ),
            );
        }
        Ok(())
    }

    /// `max(safety_bound, average × safety_ratio)`.
    pub fn safety_bound_for(&self, average_load: f64) -> f64 {
        self.safety_bound.max(average_load * self.safety_ratio)
    }

    /// The factor aggression grows by each round without a reversal: one decrease is made up in
    /// `aggression_recovery_ms`.
    pub fn aggression_increase(&self) -> f64 {
        let rounds = (self.aggression_recovery_ms as f64 / self.balance_period_ms as f64).max(1.0);
        (1.0 / self.aggression_decrease).powf(1.0 / rounds)
    }
}
