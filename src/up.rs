//! `cellmesh up`: a whole local cluster in one process, over real loopback sockets, with the
//! embedded in-memory stores: `nodes` sidecars, each with an arena game, sharing the world on a
//! grid partition; one proxy spreading sessions over them; and bots playing through it. The
//! arenas and the bots meet around the corner where every cell touches the others across the
//! wrap seam, so updates, ghosts and routed messages cross nodes all the time. Prints a live
//! status line and, on exit, a summary (optionally as JSON).
//!
//! With `--chaos SECS`, every node runs on a runtime of its own, and every SECS seconds one is
//! killed the way a crash kills a process (its runtime is dropped: every task and socket at
//! once, nothing flushed, its lease left to lapse) and a fresh one is started under its id.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

mod bot_fleet;
mod census;
mod chaos;
mod cluster;
mod crowd;
mod edge_outage;
mod geo_layout;
mod input_ledger;
mod live;
mod node;
mod node_totals;
pub mod plot;
mod proxies;
mod run_dir;
mod summary;
mod svg;
mod wind_down;

pub use cluster::grid_shape;
pub use geo_layout::known_one_way_ms;
pub use input_ledger::InputLedger;
pub use summary::{LoadSpread, Percentiles, Summary};

use bot_fleet::BotFleet;
use cluster::Cluster;

#[derive(Debug, Clone)]
pub struct UpOptions {
    pub bots: usize,
    /// NPCs over all arenas.
    pub npcs: u32,
    /// Nodes sharing the world (a grid as square as the number allows).
    pub nodes: usize,
    /// Stop after this long; `None` runs until Ctrl-C / SIGTERM.
    pub duration: Option<Duration>,
    pub summary_json: Option<PathBuf>,
    pub seed: u64,
    /// Print the live status line.
    pub status: bool,
    /// Kill a random node this often (and start a fresh one).
    pub chaos: Option<Duration>,
    /// The fresh process starts in place of the killed one, keeping its state dir: it takes the
    /// node id over at once. Otherwise the killed node's machine is gone with it, and the fresh
    /// process waits for the lease to lapse.
    pub chaos_in_place: bool,
    /// Mesh links in plaintext instead of mutual TLS (a CA of this run issues every process's
    /// certificate): for measuring what TLS costs.
    pub mesh_plaintext: bool,
    /// The geos' names; more than one spreads the nodes over them (see
    /// [`GeoLayout`](geo_layout::GeoLayout)).
    pub geos: Vec<String>,
    /// One-way delays between geos, and from a bot to a geo it is not in (ms): one value for
    /// every pair, or the upper triangle of the matrix in order (1–2, 1–3, …, 2–3, …); none takes
    /// [`known_one_way_ms`] for the geos it knows and 45 ms for the rest.
    pub geo_delay_ms: Vec<u64>,
    /// Draw the run as an SVG here on exit (see [`plot`]).
    pub svg: Option<PathBuf>,
    /// Lay the world out as a BSP (`Bsp::even`) instead of a grid of regions; the bots gather
    /// in one cell near where the lines meet, and each arena reports a load per entity (see
    /// [`Crowd`](crowd::Crowd)).
    pub bsp: bool,
    /// Run a director in this process that balances the BSP (needs `bsp`).
    pub balance: bool,
    /// Run a geo-aware director in this process that moves the regions around each group of
    /// players to the geo nearest them (needs several geos and the grid); the last geo's own
    /// bots gather in a region of the first (core) geo (see [`Bubble`](crowd::Bubble)).
    pub bubbles: bool,
    /// Hand players and the sidecars' own handoffs over by `Release` too (protocol 1.8): the
    /// arenas release avatars naming the last input applied, and the sidecars ask for a
    /// release (`Offload`) instead of freezing, so no handoff misses a tick.
    pub zero_tick_handoffs: bool,
    /// Kill every node of the last geo this long into the run, and start them again
    /// [`EDGE_DARK_FOR`](edge_outage::EDGE_DARK_FOR) later (needs several geos).
    pub edge_outage: Option<Duration>,
    /// Where `up` serves its own admin HTTP: `/live`, `/ready`, the live map (`/map`,
    /// `/api/world`) and `/state` (the options and the status line's figures).
    pub admin_listen: String,
}

impl Default for UpOptions {
    fn default() -> Self {
        Self {
            bots: 50,
            npcs: 100,
            nodes: 4,
            duration: None,
            summary_json: None,
            seed: 1,
            status: true,
            chaos: None,
            chaos_in_place: false,
            mesh_plaintext: false,
            geos: Vec::new(),
            geo_delay_ms: Vec::new(),
            svg: None,
            bsp: false,
            balance: false,
            bubbles: false,
            zero_tick_handoffs: false,
            edge_outage: None,
            admin_listen: "127.0.0.1:0".into(),
        }
    }
}

/// Runs the cluster until the duration ends or `interrupt` completes.
pub async fn run(
    opts: UpOptions,
    interrupt: impl std::future::Future<Output = ()>,
) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let mut cluster = Cluster::start(&opts).await?;
    let bots = BotFleet::start(&opts, &cluster, started).await?;
    let (live, chaos, outage) =
        live::until_the_end(&opts, &mut cluster, &bots.stats, started, interrupt).await?;
    let figures =
        wind_down::wind_down(&opts, &mut cluster, bots, live, (chaos, outage), started).await;
    let summary = Summary::of(&figures);
    if let Some(path) = &opts.summary_json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &opts.svg {
        svg::write(path, &opts, summary.duration_s, figures)?;
    }
    Ok(summary)
}

/// Now, in milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
