//! The cluster load generator behind `cellmesh bench`: scenarios over real loopback sockets with
//! the real sidecar and proxy code, each measured beside a baseline in the same run.
//!
//! A scenario returns one JSON object holding every figure it measured, its `baseline` and its
//! `ratio` against that baseline. Nothing here passes or fails on speed: [`report::missing`] only
//! checks that every figure was filled.

pub mod capacity;
pub mod cluster;
pub mod edge;
pub mod external;
pub mod fanout;
pub mod forwarder;
pub mod game;
pub mod handoff;
pub mod hop;
pub mod memory;
pub mod overload;
pub mod phases;
pub mod probe;
pub mod report;
#[cfg(feature = "redis")]
pub mod transport;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;

/// One scenario of `cellmesh bench`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scenario {
    Hop,
    Fanout,
    Transport,
    Edge,
    Handoff,
    Memory,
    Overload,
    Capacity,
}

impl Scenario {
    pub const ALL: [Scenario; 8] = [
        Scenario::Hop,
        Scenario::Fanout,
        Scenario::Transport,
        Scenario::Edge,
        Scenario::Handoff,
        Scenario::Memory,
        Scenario::Overload,
        Scenario::Capacity,
    ];

    /// Its key in the report.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Hop => "hop",
            Scenario::Fanout => "fanout",
            Scenario::Transport => "transport",
            Scenario::Edge => "edge",
            Scenario::Handoff => "handoff",
            Scenario::Memory => "memory",
            Scenario::Overload => "overload",
            Scenario::Capacity => "capacity",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == s)
    }
}

/// What every scenario runs with.
#[derive(Debug, Clone)]
pub struct Options {
    /// Small enough for CI: every scenario together well under two minutes.
    pub quick: bool,
    pub seed: u64,
    /// The `cellmesh` executable, started again for the baselines that run as processes.
    pub exe: PathBuf,
    /// A Redis to measure pub/sub against; without one the bench starts `redis-server`.
    pub redis_url: Option<String>,
}

impl Options {
    /// How long one measurement runs.
    pub fn measure_for(&self) -> Duration {
        if self.quick {
            Duration::from_secs(2)
        } else {
            Duration::from_secs(10)
        }
    }
}

/// Runs `scenario`; its figures, with the seconds it took under `elapsed_s`.
pub async fn run(scenario: Scenario, opts: &Options) -> anyhow::Result<Value> {
    let started = Instant::now();
    let mut section = match scenario {
        Scenario::Hop => hop::run(opts).await,
        Scenario::Fanout => fanout::run(opts).await,
        #[cfg(feature = "redis")]
        Scenario::Transport => transport::run(opts).await,
        #[cfg(not(feature = "redis"))]
        Scenario::Transport => Err(anyhow::anyhow!(
            "the transport bench measures against Redis pub/sub: build cellmesh with \
             `--features redis`"
        )),
        Scenario::Edge => edge::run(opts).await,
        Scenario::Handoff => handoff::run(opts).await,
        Scenario::Memory => memory::run(opts).await,
        Scenario::Overload => overload::run(opts).await,
        Scenario::Capacity => capacity::run(opts).await,
    }
    .map_err(|e| e.context(format!("bench {}", scenario.name())))?;
    if let Value::Object(m) = &mut section {
        m.insert(
            "elapsed_s".into(),
            serde_json::json!((started.elapsed().as_secs_f64() * 10.0).round() / 10.0),
        );
    }
    Ok(section)
}
