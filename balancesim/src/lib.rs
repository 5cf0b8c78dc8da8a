//! The load balancing simulator: runs the BSP balancer
//! ([`balance::Balancer`](cellmesh_world::balance::Balancer)) over a scenario in virtual
//! time, for engineers tuning its parameters.
//!
//! A scenario ([`Scenario`], from TOML) gives a world of chunks (a torus), the nodes that hold its
//! cells and the spares that join later, each node's lag in applying a new layout, crowds that
//! gather, walk along waypoints and disperse, loads that flap between two places, and overrides of
//! the balancer's parameters. [`run`] steps one balance period at a time (an hour takes
//! milliseconds), commits each new layout as the next epoch and returns a [`Report`]: every node's
//! load and every split line over time, the decisions with their reasons, the cells added and
//! retired, the chunks each epoch moved, and a summary. [`render_svg`] draws it. Nothing here
//! reads files or clocks.
//!
//! A crate of its own, like `cellmesh-geosim` (both draw with `cellmesh-plot`), so that the data
//! plane does not link the plotting; `world/tests/dependencies.rs` holds that (the sidecar and
//! the proxy link no plotters, no simulator).

pub mod plot;
mod run;
mod scenario;

pub use plot::render_svg;
pub use run::{
    run, CellEvent, CrowdSeries, EpochEntry, LineSeries, NodeSeries, NodeSummary, Report, Series,
    SimError, Summary, TimelineEntry, BALANCED_RATIO,
};
pub use scenario::{
    BackgroundSpec, Crowd, CrowdSpec, Disperse, Flap, FlapSpec, LagSpec, LoadSpec, NodesSpec,
    Retired, Scenario, ScenarioError, ScenarioFile, SpareSpec, WaypointSpec, WorldSpec, MAX_CHUNKS,
    MAX_DURATION_S, MAX_ENTITIES, MAX_NODES, MAX_SAMPLES,
};
