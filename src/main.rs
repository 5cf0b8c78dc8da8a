//! `cellmesh`: the one command line of the mesh.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
#[cfg(feature = "up")]
use cellmesh::up;
use cellmesh::{bots, signal, telemetry};
use cellmesh_proxy::config::DEFAULT_TOKEN_SECRET;
use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "cellmesh",
    version,
    about = "A sidecar mesh that runs one seamless game world on many game servers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a local cluster in this process: sidecar + arena game, proxy and bots, with live status.
    #[cfg(feature = "up")]
    Up(UpArgs),
    /// Run a sidecar beside a game server.
    Sidecar {
        /// TOML config file; every key can be overridden by CELLMESH_* variables.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print the effective configuration as TOML and exit.
        #[arg(long)]
        print_config: bool,
    },
    /// Run a geo-edge proxy.
    Proxy {
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        print_config: bool,
    },
    /// Run the director: balances the world's partition while it holds the director's lease
    /// (a second one stands by and takes over when the lease lapses).
    Director {
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        print_config: bool,
    },
    /// Print a login token signed with the proxies' shared secret (for tests and tools).
    Token {
        #[arg(long)]
        account: String,
        #[command(flatten)]
        secret: SecretArg,
        /// Sign under this key of the proxies' `token_keys` (`kid:secret`) instead of `--secret`.
        #[arg(
            long,
            value_name = "KID:SECRET",
            env = "CELLMESH_TOKEN_KEY",
            hide_env_values = true
        )]
        key: Option<String>,
        /// Validity in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
    },
    /// Make the cluster CA and issue the mesh TLS certificates of sidecars, proxies and the
    /// director.
    Certs(cellmesh::certs_cli::CertsArgs),
    /// Show, plan and commit the partition of the world.
    Partition(cellmesh::partition_cli::PartitionArgs),
    /// Geo routing tools: simulate bubble placement over a scenario.
    #[cfg(feature = "tools")]
    Geo(cellmesh::geo_cli::GeoArgs),
    /// Load balancing tools: simulate the balancer over a scenario.
    #[cfg(feature = "tools")]
    Balance(cellmesh::balance_cli::BalanceArgs),
    /// The deterministic cluster simulator: sidecar cores, games, clients and links in virtual
    /// time, with faults; every invariant checked after every step.
    #[cfg(feature = "tools")]
    Sim(cellmesh::sim_cli::SimArgs),
    /// Run bots against a running proxy.
    Bots(BotsArgs),
    /// Measure the mesh beside its baselines (hop, fanout, transport, edge, handoff, memory,
    /// overload).
    #[cfg(feature = "tools")]
    Bench(cellmesh::bench_cli::BenchArgs),
    /// A minimal framed TCP forwarder: the baseline `bench` starts as processes.
    #[cfg(feature = "tools")]
    #[command(hide = true)]
    Forwarder {
        #[arg(long)]
        to: std::net::SocketAddr,
    },
    /// A command this build was made without (see [`not_built`]).
    #[cfg(not(all(feature = "up", feature = "tools")))]
    #[command(external_subcommand)]
    NotBuilt(Vec<String>),
}

/// The commands a feature adds, and that feature.
const FEATURE_COMMANDS: &[(&str, &str)] = &[
    ("up", "up"),
    ("sim", "tools"),
    ("geo", "tools"),
    ("balance", "tools"),
    ("bench", "tools"),
    ("forwarder", "tools"),
];

/// The feature that adds `name`, if a fuller build has it as a command.
#[cfg_attr(all(feature = "up", feature = "tools"), allow(dead_code))]
fn feature_of(name: &str) -> Option<&'static str> {
    FEATURE_COMMANDS
        .iter()
        .find(|(command, _)| *command == name)
        .map(|(_, feature)| *feature)
}

/// The error for a command this build was made without: the feature that adds it and how to
/// build with it.
#[cfg_attr(all(feature = "up", feature = "tools"), allow(dead_code))]
fn not_built(command: &str, feature: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "`cellmesh {command}` is not in this build: it comes with the `{feature}` feature \
         (`cargo run --release --features {feature} -- {command} ...`)"
    )
}

/// A name that no build has as a command: clap's own usage error (exit status 2), as a build
/// with every command gives for it.
#[cfg_attr(all(feature = "up", feature = "tools"), allow(dead_code))]
fn unknown_command(name: &str) -> clap::Error {
    use clap::CommandFactory;
    Cli::command().error(
        clap::error::ErrorKind::InvalidSubcommand,
        format!("unrecognized subcommand '{name}'"),
    )
}

/// `--secret`: the proxies' token secret, never shown by `--help` when it comes from the
/// environment.
#[derive(Args, Debug)]
struct SecretArg {
    #[arg(
        long,
        env = "CELLMESH_TOKEN_SECRET",
        default_value = DEFAULT_TOKEN_SECRET,
        hide_env_values = true
    )]
    secret: String,
}

#[cfg(feature = "up")]
#[derive(Args, Debug)]
struct UpArgs {
    /// Number of bots playing through the proxy.
    #[arg(long, default_value_t = 50)]
    bots: usize,
    /// NPCs the arena spawns.
    #[arg(long, default_value_t = 100)]
    npcs: u32,
    /// Nodes (sidecar + arena each) sharing the world on a grid; 4 makes a 2×2 grid.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long, value_name = "SECS", value_parser = seconds, allow_negative_numbers = true)]
    duration: Option<Duration>,
    /// Write a JSON summary here on exit.
    #[arg(long)]
    summary_json: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Every SECS seconds (at least 1) kill a random node (its sidecar and game, all state lost)
    /// and start a fresh one under its id; the summary gains the restore figures.
    #[arg(long, value_name = "SECS", value_parser = chaos_seconds, allow_negative_numbers = true)]
    chaos: Option<Duration>,
    /// With --chaos: restart each killed node in place, keeping its state dir, so that it
    /// takes its node id over at once instead of waiting out the lease.
    #[arg(long, requires = "chaos")]
    chaos_in_place: bool,
    /// Mesh links and players' connections in plaintext, not TLS (by default a CA of this run
    /// certifies every sidecar and proxy, and the bots trust it): to compare what TLS costs.
    #[arg(long)]
    mesh_plaintext: bool,
    /// Datacenters the nodes are spread over (each with its own proxy and session directory;
    /// player records shared), with the latency between them and to the bots shaped in-process.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=4))]
    geos: u8,
    /// The geos' names, in order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "paris,montreal,hongkong,sydney"
    )]
    geo_names: Vec<String>,
    /// One-way delays between geos, and between a bot and a geo it is not in (ms): one value
    /// for every pair, or the upper triangle of the matrix (for 3 geos: 1–2,1–3,2–3). Default:
    /// the cities' figures for the default names (Paris–Montreal 45, Paris–Hong Kong 110, …), 45
    /// for other names.
    #[arg(long, value_delimiter = ',')]
    geo_delay_ms: Vec<u64>,
    /// Draw the run as an SVG: click to screen by bot location over time, bridged sessions,
    /// handovers labelled with player and cause, killed nodes shaded.
    #[arg(long, value_name = "PATH")]
    svg: Option<PathBuf>,
    /// How the world is cut between the nodes: a grid of regions, or a BSP whose lines the
    /// director moves (the bots then gather in one cell, and the arenas report a load per
    /// entity). Default: grid, or bsp with --balance.
    #[arg(long, value_enum)]
    partition: Option<PartitionKind>,
    /// Balance the world with a director in this process (implies --partition bsp; on by
    /// default with a BSP).
    #[arg(long, conflicts_with = "no_balance")]
    balance: bool,
    /// With --partition bsp: no director, the lines stay where they start (the baseline a
    /// balanced run is compared with).
    #[arg(long)]
    no_balance: bool,
    /// Move the world's simulation to the players (needs --geos 2 or more, on the grid): a
    /// geo-aware director in this process moves the regions around each group of players to the
    /// geo nearest them, as the proxies measure it. The last geo's own bots gather in a region of
    /// the first (core) geo, so their bubble moves; the summary adds the moves and the click to
    /// screen of those bots before and after.
    #[arg(long, conflicts_with = "balance")]
    bubbles: bool,
    /// Hand players' avatars, and the handoffs the sidecars decide, over by `Release` too
    /// (protocol 1.8): the arenas release avatars naming the last input they applied, and the
    /// sidecars ask for a release (`Offload`) instead of freezing, so no handoff misses a tick
    #[arg(long)]
    zero_tick_handoffs: bool,
    /// SECS into the run, kill every node of the last geo at once (a datacenter gone dark), and
    /// start them again 40 s later (needs --geos 2 or more): its world falls back to the core
    /// geo, its players to the core's gateways; the summary adds `edge_outages` and how long the
    /// fallback took (`fallback_s_p99`, at most 30 s).
    #[arg(long, value_name = "SECS", value_parser = seconds, conflicts_with = "chaos")]
    edge_outage: Option<Duration>,
    /// Where `up` serves its admin HTTP: the live map at /map (drawn from /api/world), /live,
    /// /ready. Port 0 takes a free one (printed).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9000")]
    admin: String,
}

#[cfg(feature = "up")]
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum PartitionKind {
    Grid,
    Bsp,
}

#[cfg(feature = "up")]
impl UpArgs {
    fn options(self) -> up::UpOptions {
        up::UpOptions {
            bots: self.bots,
            npcs: self.npcs,
            nodes: self.nodes,
            duration: self.duration,
            summary_json: self.summary_json,
            seed: self.seed,
            status: true,
            chaos: self.chaos,
            chaos_in_place: self.chaos_in_place,
            mesh_plaintext: self.mesh_plaintext,
            geos: self
                .geo_names
                .into_iter()
                .take(usize::from(self.geos))
                .collect(),
            geo_delay_ms: self.geo_delay_ms,
            svg: self.svg,
            bsp: self.partition == Some(PartitionKind::Bsp)
                || (self.partition.is_none() && self.balance),
            balance: self.balance
                || (self.partition == Some(PartitionKind::Bsp) && !self.no_balance),
            bubbles: self.bubbles,
            zero_tick_handoffs: self.zero_tick_handoffs,
            edge_outage: self.edge_outage,
            admin_listen: self.admin,
        }
    }
}

#[derive(Args, Debug)]
struct BotsArgs {
    #[arg(long, default_value = "127.0.0.1:7300")]
    proxy: String,
    #[arg(long, default_value_t = 10)]
    count: usize,
    #[command(flatten)]
    secret: SecretArg,
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long, value_name = "SECS", value_parser = seconds, allow_negative_numbers = true)]
    duration: Option<Duration>,
    /// The bots' accounts are PREFIX0, PREFIX1...: bots of two runs (two geos' bots, say) with
    /// different prefixes are different players instead of displacing each other.
    #[arg(long, value_name = "PREFIX", default_value = "bot-")]
    account_prefix: String,
    /// Where the bots wander, in metres (`X,Y`; the world wraps, so `--home=1000,-1000` is
    /// 1 km below the top edge): beyond `--roam` metres from it they head back.
    #[arg(long, value_name = "X,Y", value_parser = point, allow_hyphen_values = true)]
    home: Option<(f64, f64)>,
    #[arg(long, value_name = "METRES")]
    roam: Option<f64>,
    /// Speak TLS to the proxies, trusting the CA certificates in FILE (their `client_tls`
    /// certificates chain to one); without it, plaintext (a proxy on loopback).
    #[arg(long, value_name = "FILE", env = "CELLMESH_BOTS_TLS_CA")]
    tls_ca: Option<std::path::PathBuf>,
}

impl BotsArgs {
    fn config(&self) -> anyhow::Result<bots::BotConfig> {
        let default = bots::BotConfig::default();
        let tls = self
            .tls_ca
            .as_deref()
            .map(cellmesh_proto::client::ClientTls::from_ca_file)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--tls-ca: {e}"))?;
        Ok(bots::BotConfig {
            proxy: self.proxy.clone(),
            secret: self.secret.secret.clone(),
            home: self.home.unwrap_or(default.home),
            roam: self.roam.unwrap_or(default.roam),
            tls,
            ..default
        })
    }
}

/// `X,Y` in metres.
fn point(s: &str) -> Result<(f64, f64), String> {
    let parse = |v: &str| {
        v.trim()
            .parse::<f64>()
            .ok()
            .filter(|f| f.is_finite())
            .ok_or_else(|| format!("`{v}` is not a number of metres"))
    };
    match s.split_once(',') {
        Some((x, y)) => Ok((parse(x)?, parse(y)?)),
        None => Err(format!("`{s}` is not X,Y")),
    }
}

/// The longest a seconds flag may ask for: a year. More is a typo, and far more than the clocks
/// can add.
const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

/// A seconds flag: a number of seconds from 0 to [`MAX_SECONDS`], fractions allowed (clap names
/// the flag in the error).
fn seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a number of seconds such as 30 or 0.5, got `{s}`"))?;
    if !(0.0..=MAX_SECONDS).contains(&secs) {
        return Err(format!(
            "expected seconds from 0 to {MAX_SECONDS} (a year), got `{s}`"
        ));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())
}

#[cfg(feature = "up")]
/// `--chaos`: [`seconds`], at least one (nodes need time to come up between kills).
fn chaos_seconds(s: &str) -> Result<Duration, String> {
    let every = seconds(s)?;
    if every < Duration::from_secs(1) {
        return Err(format!("expected at least 1 second, got `{s}`"));
    }
    Ok(every)
}

/// When a token signed at `now` (Unix seconds) for `ttl` seconds expires.
fn token_expiry(now: u64, ttl: u64) -> anyhow::Result<u64> {
    now.checked_add(ttl)
        .with_context(|| format!("--ttl {ttl} runs past the end of time"))
}

/// The proxy's configuration as `--print-config` shows it: the token secret hidden, unless it is
/// the public default, left for whoever kept it to see; the admin token hidden.
fn proxy_config_shown(cfg: &cellmesh_proxy::ProxyConfig) -> cellmesh_proxy::ProxyConfig {
    cfg.masked()
}

/// Prints the one line on stdout that names the addresses a process bound, so whoever started it
/// with port 0 learns the ports (the format is documented in the README). Nobody reading stdout is
/// no reason to stop serving: write errors are ignored.
fn report_listening(line: std::fmt::Arguments) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        #[cfg(feature = "up")]
        Command::Up(args) => run_up(args).await,
        Command::Sidecar {
            config,
            print_config,
        } => run_sidecar(config, print_config).await,
        Command::Proxy {
            config,
            print_config,
        } => run_proxy(config, print_config).await,
        Command::Director {
            config,
            print_config,
        } => run_director(config, print_config).await,
        Command::Partition(args) => cellmesh::partition_cli::run(args).await,
        #[cfg(feature = "tools")]
        Command::Geo(args) => cellmesh::geo_cli::run(args),
        Command::Certs(args) => cellmesh::certs_cli::run(args),
        #[cfg(feature = "tools")]
        Command::Balance(args) => cellmesh::balance_cli::run(args),
        #[cfg(feature = "tools")]
        Command::Sim(args) => {
            // Quiet unless asked (`RUST_LOG`): a thousand seeds' warnings would bury the verdict.
            let _telemetry = telemetry::init("off", "cellmesh-sim");
            cellmesh::sim_cli::run(args)
        }
        #[cfg(feature = "tools")]
        Command::Bench(args) => {
            let _telemetry = telemetry::init("warn", "cellmesh-bench");
            cellmesh::bench_cli::run(args).await
        }
        #[cfg(feature = "tools")]
        Command::Forwarder { to } => cellmesh_benches::load::forwarder::run_process(to).await,
        #[cfg(not(all(feature = "up", feature = "tools")))]
        Command::NotBuilt(args) => {
            let name = args.first().map(String::as_str).unwrap_or_default();
            match feature_of(name) {
                Some(feature) => Err(not_built(name, feature)),
                // A typo is a usage error, as it is in a build with every command.
                None => unknown_command(name).exit(),
            }
        }
        Command::Token {
            account,
            secret,
            key,
            ttl,
        } => run_token(&account, &secret, key, ttl),
        Command::Bots(args) => run_bots(args).await,
    }
}

/// `cellmesh up`: the local cluster, its summary, and an error if it broke a guarantee.
#[cfg(feature = "up")]
async fn run_up(args: UpArgs) -> anyhow::Result<()> {
    let _telemetry = telemetry::init("warn", "cellmesh-up");
    let bubbles = args.bubbles;
    let s = up::run(args.options(), signal::shutdown()).await?;
    println!(
        "summary: {:.1}s, sessions peak {}, inputs {}/{} delivered ({:.1}%), {} updates delivered, rtt p50 {:.2} ms p99 {:.2} ms, errors {}",
        s.duration_s,
        s.sessions_peak,
        s.inputs_delivered,
        s.inputs_sent,
        100.0 * s.inputs_delivered as f64 / s.inputs_sent.max(1) as f64,
        s.updates_delivered,
        s.rtt_ms_p50,
        s.rtt_ms_p99,
        s.errors
    );
    println!(
        "handoffs: {} completed, {} refused, freeze p50 {:.0} ms p99 {:.0} ms, ticks missed p50 {:.0} p99 {:.0}, sidecars' share of the freeze p50 {:.0} ms p99 {:.0} ms",
        s.handoffs,
        s.handoffs_refused,
        s.handoff_freeze_ms_p50,
        s.handoff_freeze_ms_p99,
        s.handoff_ticks_missed_p50,
        s.handoff_ticks_missed_p99,
        s.handoff_freeze_sidecars_ms_p50,
        s.handoff_freeze_sidecars_ms_p99
    );
    if !s.inputs_undelivered.is_empty() {
        println!("undelivered inputs by reason: {:?}", s.inputs_undelivered);
    }
    if s.knee_rtt_ms_p99 > 0.0 || s.admitted_rtt_ms_p99 > 0.0 {
        println!(
            "crowd: rtt p99 {:.1} ms with the first 200 bots, {:.1} ms for the admitted once all came ({:.2}×), {} logins refused SERVER_FULL",
            s.knee_rtt_ms_p99,
            s.admitted_rtt_ms_p99,
            s.admitted_rtt_ms_p99 / s.knee_rtt_ms_p99.max(f64::MIN_POSITIVE),
            s.logins_refused
        );
    }
    if s.nodes_killed > 0 {
        println!(
            "chaos: {} nodes killed, {} entities restored (restore p50 {:.0} ms p99 {:.0} ms from the kill, progress lost p99 {:.0} ms), sessions kept {} dropped {}, accounts with two avatars {}, sessions without avatar {}",
            s.nodes_killed,
            s.entities_restored,
            s.restore_ms_p50,
            s.restore_ms_p99,
            s.progress_lost_ms_p99,
            s.sessions_kept,
            s.sessions_dropped,
            s.accounts_with_two_avatars,
            s.sessions_without_avatar
        );
    }
    if bubbles {
        println!(
            "bubbles: {} moves, {} regions moved; the gathering bots' bubble moved at {:.1} s; their click to screen p50 {:.1} ms before ({} samples), {:.1} ms after ({} samples); moved entities unsimulated p99 {:.0} ms (from their last tick at the source to their first at the target)",
            s.bubble_moves,
            s.regions_moved,
            s.bubble_moved_at_s,
            s.click_to_screen_ms_p50_before,
            s.click_to_screen_samples_before,
            s.click_to_screen_ms_p50_after,
            s.click_to_screen_samples_after,
            s.bubble_switch_freeze_ms_p99
        );
    }
    if s.edge_outages > 0 {
        println!(
            "edge outage: {} entities of the dark geo simulated again by the core {:.1} s (p50) and {:.1} s (p99) after it went dark; {} sessions moved to the core's gateways and {} back home after, sessions dropped {}, accounts with two avatars {}, sessions without avatar {}",
            s.entities_fallen_back,
            s.fallback_s_p50,
            s.fallback_s_p99,
            s.sessions_fallen_back,
            s.sessions_returned_home,
            s.sessions_dropped,
            s.accounts_with_two_avatars,
            s.sessions_without_avatar
        );
    }
    let problems = s.problems();
    anyhow::ensure!(
        problems.is_empty(),
        "the run broke a guarantee: {}",
        problems.join("; ")
    );
    Ok(())
}

/// `cellmesh sidecar`: runs until a signal or a failure, then drains (a second signal stops at
/// once).
async fn run_sidecar(config: Option<PathBuf>, print_config: bool) -> anyhow::Result<()> {
    // Dropped on every way out: the spans still batched are sent.
    let _telemetry = telemetry::init("info", "cellmesh-sidecar");
    let cfg: cellmesh_sidecar::SidecarConfig = cellmesh_admin::config::load(config.as_deref())?;
    // Under Agones, its SDK server's port (unless the configuration names one).
    let cfg = cfg.under_agones(std::env::var("AGONES_SDK_HTTP_PORT").ok().as_deref())?;
    if print_config {
        print!("{}", toml::to_string_pretty(&cfg.redacted())?);
        return Ok(());
    }
    let stores = cellmesh_stores::Stores::open(&cfg.directory_url, &cfg.players_url, &cfg.geo)
        .await
        .context("opening the stores")?
        .with_core_geo(
            &cfg.geo,
            &cfg.world_geos(),
            &cfg.core_geo,
            &cfg.directory_url,
            &cfg.core_directory_url,
        )
        .await
        .context(
            "opening the core geo's stores (the directory of accounts, the checkpoints' copy)",
        )?;
    if !cfg.core_geo.is_empty() && cfg.geo != cfg.core_geo && stores.core_copy.is_none() {
        tracing::warn!(
            core_geo = %cfg.core_geo,
            "no core_directory_url (redis://…): this geo's accounts are not in the core's \
             directory, and its checkpoints are not copied to the core geo, which cannot restore \
             its world if every node of this geo dies"
        );
    }
    let stop = CancellationToken::new();
    let handle = if cfg.topology_url.is_empty() {
        cellmesh_sidecar::start(cfg, stores, stop.clone()).await?
    } else {
        let topology = cellmesh_stores::topology::open(&cfg.topology_url)
            .await
            .context("opening the topology store")?;
        cellmesh_sidecar::start_in(cfg, stores, topology, stop.clone()).await?
    };
    tracing::info!(node = handle.node_id, local = %handle.local_addr, mesh = %handle.mesh_addr, admin = %handle.admin_addr, "sidecar running");
    // Listening for signals before saying so: whoever read the line may signal at once.
    let interrupted = signal::shutdown();
    report_listening(format_args!(
        "cellmesh sidecar listening local={} mesh={} admin={} node={}",
        handle.local_addr, handle.mesh_addr, handle.admin_addr, handle.node_id
    ));
    tokio::select! {
        _ = interrupted => {}
        _ = stop.cancelled() => {}
    }
    if let Some(why) = handle.failure() {
        // Nothing to drain: everything is frozen and restored elsewhere.
        handle.wait().await;
        anyhow::bail!("{why}");
    }
    // Drain: not ready, no handoffs accepted, what others own now handed to them.
    tracing::info!("draining; a second signal stops at once");
    handle.drain();
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = signal::shutdown() => tracing::warn!("stopping before the drain finished"),
    }
    tracing::info!("shutting down");
    stop.cancel();
    handle.wait().await;
    Ok(())
}

/// `cellmesh proxy`: serves until a signal, then drains its sessions (a second signal stops at
/// once).
async fn run_proxy(config: Option<PathBuf>, print_config: bool) -> anyhow::Result<()> {
    let _telemetry = telemetry::init("info", "cellmesh-proxy");
    let cfg: cellmesh_proxy::ProxyConfig = cellmesh_admin::config::load(config.as_deref())?;
    if print_config {
        print!("{}", toml::to_string_pretty(&proxy_config_shown(&cfg))?);
        return Ok(());
    }
    let stop = CancellationToken::new();
    let handle = cellmesh_proxy::start(cfg, stop.clone()).await?;
    tracing::info!(clients = %handle.client_addr, admin = %handle.admin_addr, "proxy running");
    // Listening for signals before saying so: whoever read the line may signal at once.
    let interrupted = signal::shutdown();
    report_listening(format_args!(
        "cellmesh proxy listening clients={} admin={}",
        handle.client_addr, handle.admin_addr
    ));
    interrupted.await;
    tracing::info!("draining; a second signal stops at once");
    stop.cancel();
    let now = handle.stopper();
    let drained = handle.wait();
    tokio::pin!(drained);
    tokio::select! {
        _ = &mut drained => {}
        _ = signal::shutdown() => {
            tracing::warn!("stopping before the drain finished");
            now.cancel();
            drained.await;
        }
    }
    Ok(())
}

/// `cellmesh director`: balances while it holds the lease, and gives the lease back on a signal.
async fn run_director(config: Option<PathBuf>, print_config: bool) -> anyhow::Result<()> {
    let _telemetry = telemetry::init("info", "cellmesh-director");
    let cfg: cellmesh_director::DirectorConfig = cellmesh_admin::config::load(config.as_deref())?;
    if print_config {
        print!("{}", toml::to_string_pretty(&cfg.shown())?);
        return Ok(());
    }
    let stop = CancellationToken::new();
    let handle = cellmesh_director::start(cfg, stop.clone()).await?;
    tracing::info!(admin = %handle.admin_addr, holder = %handle.holder, "director running");
    let interrupted = signal::shutdown();
    report_listening(format_args!(
        "cellmesh director listening admin={} holder={}",
        handle.admin_addr, handle.holder
    ));
    interrupted.await;
    tracing::info!("stopping: the director's lease goes back to the store");
    stop.cancel();
    handle.wait().await;
    Ok(())
}

/// `cellmesh token`: one login token on stdout.
fn run_token(
    account: &str,
    secret: &SecretArg,
    key: Option<String>,
    ttl: u64,
) -> anyhow::Result<()> {
    use cellmesh_proto::keys::KeyRing;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let ring = match key {
        Some(k) => KeyRing::parse(&[k], "").map_err(|e| anyhow::anyhow!("--key: {e}"))?,
        None => KeyRing::single(secret.secret.as_bytes()),
    };
    println!(
        "{}",
        cellmesh_proto::token::sign_with(ring.signing(), account, token_expiry(now, ttl)?)
    );
    Ok(())
}

/// `cellmesh bots`: plays until the duration or a signal, then prints the totals as JSON.
async fn run_bots(args: BotsArgs) -> anyhow::Result<()> {
    let _telemetry = telemetry::init("warn", "cellmesh-bots");
    let cfg = Arc::new(args.config()?);
    let stats = Arc::new(bots::BotStats::default());
    let stop = CancellationToken::new();
    let tasks: Vec<_> = (0..args.count)
        .map(|i| {
            tokio::spawn(bots::run_bot(
                format!("{}{i}", args.account_prefix),
                cfg.clone(),
                stats.clone(),
                stop.clone(),
            ))
        })
        .collect();
    match args.duration {
        Some(d) => {
            tokio::select! { _ = signal::shutdown() => {}, _ = tokio::time::sleep(d) => {} }
        }
        None => signal::shutdown().await,
    }
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    println!("{}", serde_json::to_string_pretty(&bots_report(&stats))?);
    Ok(())
}

/// The bots' totals, and their click to screen second by second: the median and the samples of
/// each second, from `origin_unix_ms` (so that a run can be cut at an instant, as the lab cuts it
/// at a bubble's move).
fn bots_report(stats: &bots::BotStats) -> serde_json::Value {
    let mut report = serde_json::to_value(stats.totals()).expect("totals serialise");
    let c = &stats.click_to_screen;
    let now_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let origin_unix_ms = now_unix_ms.saturating_sub(c.origin().elapsed().as_millis() as u64);
    let seconds: Vec<(f64, f64, usize)> = c
        .series()
        .into_values()
        .flatten()
        .map(|b| (b.t_s, b.p50_ms, b.samples))
        .collect();
    report["click_to_screen"] = serde_json::json!({
        "origin_unix_ms": origin_unix_ms,
        "seconds": seconds,
    });
    report
}

#[cfg(all(test, feature = "tools"))]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The bots' report keeps their totals and adds each second's click to screen, timed from
    /// an origin in Unix ms: a run can be cut at an instant after the fact.
    #[test]
    fn the_bots_report_has_each_second_of_click_to_screen() {
        let stats = bots::BotStats::default();
        let origin = stats.click_to_screen.origin();
        for (ms, v) in [(100, 80.0), (300, 120.0), (1_200, 9.0)] {
            stats
                .click_to_screen
                .record("", origin + Duration::from_millis(ms), v);
        }
        let report = bots_report(&stats);
        assert_eq!(report["inputs_sent"], 0);
        let c = &report["click_to_screen"];
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let at = c["origin_unix_ms"].as_u64().unwrap();
        assert!(at <= now && now - at < 60_000, "{c}");
        assert_eq!(
            c["seconds"],
            serde_json::json!([[0.0, 120.0, 2], [1.0, 9.0, 1]])
        );
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_command_left_out_of_the_build_names_its_feature() {
        let said = |name: &str| not_built(name, feature_of(name).expect("a feature's")).to_string();
        let sim = said("sim");
        assert!(
            sim.contains("`tools` feature") && sim.contains("--features tools -- sim"),
            "{sim}"
        );
        let up = said("up");
        assert!(up.contains("`up` feature"), "{up}");
        assert_eq!(feature_of("simm"), None);
        let typo = unknown_command("simm");
        assert_eq!(typo.kind(), clap::error::ErrorKind::InvalidSubcommand);
        assert!(typo.to_string().contains("'simm'"), "{typo}");
    }

    #[test]
    fn seconds_are_finite_not_negative_and_at_most_a_year() {
        assert_eq!(seconds("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(seconds("0"), Ok(Duration::ZERO));
        assert_eq!(seconds("31536000"), Ok(Duration::from_secs(31_536_000)));
        for bad in [
            "-1",
            "-0.001",
            "NaN",
            "nan",
            "inf",
            "-inf",
            "1e300",
            "31536000.5",
            "",
            "1s",
            "ü",
        ] {
            assert!(seconds(bad).is_err(), "{bad:?} was taken");
        }
        assert_eq!(chaos_seconds("1"), Ok(Duration::from_secs(1)));
        assert!(chaos_seconds("0.5").is_err());
    }

    #[test]
    fn a_negative_duration_is_a_usage_error_naming_the_flag() {
        for argv in [
            ["cellmesh", "up", "--duration", "-1"],
            ["cellmesh", "up", "--chaos", "-1"],
            ["cellmesh", "bots", "--duration", "-1"],
        ] {
            let err = Cli::try_parse_from(argv).err().expect("refused");
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
            assert!(err.to_string().contains(argv[2]), "{err}");
        }
    }

    #[test]
    fn bots_take_a_home_that_may_be_negative() {
        let cli = Cli::try_parse_from(["cellmesh", "bots", "--home=1000,-1000", "--roam", "80"])
            .expect("parses");
        let Command::Bots(args) = cli.command else {
            panic!("not bots");
        };
        let cfg = args.config().unwrap();
        assert_eq!((cfg.home, cfg.roam), ((1000.0, -1000.0), 80.0));
        assert!(Cli::try_parse_from(["cellmesh", "bots", "--home", "5"]).is_err());
        assert!(Cli::try_parse_from(["cellmesh", "bots", "--home", "x,1"]).is_err());
    }

    #[test]
    fn bots_take_an_account_prefix() {
        let parsed = |argv: &[&str]| match Cli::try_parse_from(argv).expect("parses").command {
            Command::Bots(args) => args.account_prefix,
            _ => panic!("not the bots command"),
        };
        assert_eq!(parsed(&["cellmesh", "bots"]), "bot-");
        assert_eq!(
            parsed(&["cellmesh", "bots", "--account-prefix", "us-bot-"]),
            "us-bot-"
        );
    }

    #[test]
    fn a_token_expiry_past_the_end_of_time_is_an_error() {
        assert_eq!(token_expiry(10, 5).unwrap(), 15);
        assert!(token_expiry(10, u64::MAX).is_err());
    }

    #[test]
    fn the_proxy_secret_is_hidden_unless_it_is_the_public_default() {
        let cfg = cellmesh_proxy::ProxyConfig::default();
        assert_eq!(proxy_config_shown(&cfg).token_secret, DEFAULT_TOKEN_SECRET);
        let cfg = cellmesh_proxy::ProxyConfig {
            token_secret: "s3cret".into(),
            ..cfg
        };
        assert_eq!(proxy_config_shown(&cfg).token_secret, "***");
        let cfg = cellmesh_proxy::ProxyConfig {
            token_keys: vec!["t1:login-secret".into()],
            cookie_keys: vec!["c1:cookie-secret".into()],
            attest_keys: vec!["a1:attest-secret".into()],
            ..cfg
        };
        let shown = toml::to_string_pretty(&proxy_config_shown(&cfg)).unwrap();
        for secret in ["login-secret", "cookie-secret", "attest-secret"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("\"t1:***\""), "{shown}");
        assert_eq!(proxy_config_shown(&cfg).admin_token, "");
        let cfg = cellmesh_proxy::ProxyConfig {
            admin_token: "ops".into(),
            ..cfg
        };
        assert_eq!(proxy_config_shown(&cfg).admin_token, "***");
    }

    /// A subcommand path (`partition plan` is two words), the flags it takes and those it needs.
    struct Cmd {
        path: Vec<String>,
        flags: Vec<String>,
        required: Vec<String>,
    }

    fn commands() -> Vec<Cmd> {
        fn walk(cmd: &clap::Command, path: &mut Vec<String>, out: &mut Vec<Cmd>) {
            let long = |a: &clap::Arg| a.get_long().map(|l| format!("--{l}"));
            out.push(Cmd {
                path: path.clone(),
                flags: cmd.get_arguments().filter_map(long).collect(),
                required: cmd
                    .get_arguments()
                    .filter(|a| a.is_required_set())
                    .filter_map(long)
                    .collect(),
            });
            for sub in cmd.get_subcommands() {
                path.push(sub.get_name().to_string());
                walk(sub, path, out);
                path.pop();
            }
        }
        let mut out = Vec::new();
        walk(&Cli::command(), &mut Vec::new(), &mut out);
        out
    }

    const VALUES: &[&str] = &[
        "",
        " ",
        "0",
        "1",
        "-1",
        "-0",
        "0.5",
        "1.5",
        "-0.5",
        "NaN",
        "nan",
        "-nan",
        "inf",
        "-inf",
        "infinity",
        "1e308",
        "1e309",
        "-1e309",
        "1e-320",
        "31536000",
        "31536001",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775808",
        "4294967295",
        "4294967296",
        "1x1",
        "0x0",
        "16x16",
        "4294967295x4294967295",
        "1,2,3",
        "1,,2",
        ",",
        "1×1",
        "grid",
        "bsp",
        "memory",
        "mongodb://u:p@h/db",
        "a.toml",
        "--",
        "-",
        "--help",
        "-h",
        "--version",
        "ü",
        "🦀",
        "\u{202e}",
        "٣",
        "1_000",
        "0x10",
        "+5",
    ];

    fn random_value(rng: &mut StdRng) -> String {
        match rng.random_range(0..7) {
            0 => rng.random::<f64>().to_string(),
            1 => f64::from_bits(rng.random()).to_string(),
            2 => rng.random::<i64>().to_string(),
            3 => rng.random::<u64>().to_string(),
            4 => (0..rng.random_range(0..8))
                .map(|_| char::from_u32(rng.random_range(0..0x11_0000)).unwrap_or('x'))
                .collect(),
            _ => VALUES[rng.random_range(0..VALUES.len())].to_string(),
        }
    }

    fn random_argv(rng: &mut StdRng, commands: &[Cmd]) -> Vec<String> {
        let mut argv = vec!["cellmesh".to_string()];
        let cmd = &commands[rng.random_range(0..commands.len())];
        argv.extend(cmd.path.iter().cloned());
        // Mostly with what the command needs, to get past the first refusal.
        if rng.random_bool(0.7) {
            for flag in &cmd.required {
                argv.push(flag.clone());
                argv.push(random_value(rng));
            }
        }
        let all_flags: Vec<&String> = commands.iter().flat_map(|c| &c.flags).collect();
        for _ in 0..rng.random_range(0..6) {
            match rng.random_range(0..10) {
                // A flag of this command, mostly with a value, sometimes joined by `=`.
                0..=5 if !cmd.flags.is_empty() => {
                    let flag = &cmd.flags[rng.random_range(0..cmd.flags.len())];
                    match rng.random_range(0..5) {
                        0 => argv.push(flag.clone()),
                        1 => argv.push(format!("{flag}={}", random_value(rng))),
                        _ => argv.extend([flag.clone(), random_value(rng)]),
                    }
                }
                6 => argv.push(all_flags[rng.random_range(0..all_flags.len())].clone()),
                _ => argv.push(random_value(rng)),
            }
        }
        argv
    }

    /// What `main` does with a parsed command before it runs anything.
    fn convert(command: Command) {
        match command {
            Command::Up(args) => {
                let _ = args.options();
            }
            Command::Bots(args) => {
                let _ = (args.config(), args.duration);
            }
            Command::Token { ttl, .. } => {
                let _ = token_expiry(u64::MAX / 2, ttl);
            }
            _ => {}
        }
    }

    /// Arbitrary argument vectors are parsed, and the commands converted, without a panic.
    /// `CELLMESH_FUZZ_SECONDS=S` runs for S seconds instead of a fixed number of cases;
    /// `CELLMESH_FUZZ_SEED=N` replays a seed.
    #[test]
    fn arbitrary_command_lines_never_panic() {
        let commands = commands();
        let seed = std::env::var("CELLMESH_FUZZ_SEED")
            .ok()
            .map(|s| s.parse().expect("CELLMESH_FUZZ_SEED is a u64"))
            .unwrap_or_else(rand::random::<u64>);
        let deadline = std::env::var("CELLMESH_FUZZ_SECONDS").ok().map(|s| {
            let secs: f64 = s.parse().expect("CELLMESH_FUZZ_SECONDS is seconds");
            std::time::Instant::now() + Duration::try_from_secs_f64(secs).expect("seconds")
        });
        eprintln!("command line fuzz: CELLMESH_FUZZ_SEED={seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        let mut cases = 0u64;
        while deadline.map_or(cases < 5_000, |d| std::time::Instant::now() < d) {
            let argv = random_argv(&mut rng, &commands);
            let shown = argv.clone();
            let run = std::panic::catch_unwind(move || match Cli::try_parse_from(argv) {
                Ok(cli) => convert(cli.command),
                Err(e) => {
                    let _ = e.render().to_string();
                }
            });
            assert!(
                run.is_ok(),
                "CELLMESH_FUZZ_SEED={seed}, case {cases}: {shown:?} panicked"
            );
            cases += 1;
        }
        eprintln!("command line fuzz: {cases} cases");
    }
}
