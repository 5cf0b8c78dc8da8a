//! The bubble placement simulator: runs
//! [`bubbles::Placement`](cellmesh_world::bubbles::Placement) over a scenario in virtual
//! time, for network engineers tuning its parameters.
//!
//! A scenario ([`Scenario`], from TOML) gives the sites, an RTT model per (player location,
//! site) with jitter from a seeded generator, players with roles and waypoints, edge outages and
//! a duration. [`run`] steps through it a second at a time (an hour takes milliseconds) and
//! returns a [`Report`]: a timeline of decisions with their reasons, and a summary judged against
//! two yardsticks, everyone on the core and an oracle that knows the true RTTs and has no
//! hysteresis. [`render_svg`] draws it. Nothing here reads files or clocks.
//!
//! A crate of its own, apart from `cellmesh-world`, so that the data plane (the sidecar and the
//! proxy) does not link the plotting; `world/tests/dependencies.rs` holds that.

pub mod plot;
mod run;
mod scenario;

pub use cellmesh_plot::PlotError;
pub use plot::render_svg;
pub use run::{
    run, MoveMark, PlayerSummary, Report, Series, SimError, Summary, TimelineEntry, Yardstick,
};
pub use scenario::{
    Outage, OutageSpec, PlayerPlan, PlayerSpec, Probe, RttChange, RttChangeSpec, RttModel, RttSpec,
    Scenario, ScenarioError, ScenarioFile, SiteSpec, WaypointSpec, LOGIN_PROBES, MAX_DURATION_S,
    MAX_PLAYERS, MAX_SAMPLES,
};
