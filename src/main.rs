//! `cellmesh`: the one command line of the mesh.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use cellmesh::{bots, signal, up};
use clap::{Parser, Subcommand};
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
    Up {
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
        #[arg(long)]
        duration: Option<f64>,
        /// Write a JSON summary here on exit.
        #[arg(long)]
        summary_json: Option<PathBuf>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Every SECS seconds kill a random node (its sidecar and game, all state lost) and
        /// start a fresh one under its id; the summary gains the restore figures.
        #[arg(long, value_name = "SECS")]
        chaos: Option<f64>,
        /// With --chaos: restart each killed node in place, keeping its state dir, so that it
        /// takes its node id over at once instead of waiting out the lease.
        #[arg(long, requires = "chaos")]
        chaos_in_place: bool,
    },
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
    /// Print a login token signed with the proxies' shared secret (for tests and tools).
    Token {
        #[arg(long)]
        account: String,
        #[arg(
            long,
            env = "CELLMESH_TOKEN_SECRET",
            default_value = "dev-secret-change-me"
        )]
        secret: String,
        /// Validity in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
    },
    /// Show, plan and commit the partition of the world.
    Partition(cellmesh::partition_cli::PartitionArgs),
    /// Geo routing tools: simulate bubble placement over a scenario.
    Geo(cellmesh::geo_cli::GeoArgs),
    /// The deterministic cluster simulator: sidecar cores, games, clients and links in virtual
    /// time, with faults; every invariant checked after every step.
    Sim(cellmesh::sim_cli::SimArgs),
    /// Run bots against a running proxy.
    Bots {
        #[arg(long, default_value = "127.0.0.1:7300")]
        proxy: String,
        #[arg(long, default_value_t = 10)]
        count: usize,
        #[arg(
            long,
            env = "CELLMESH_TOKEN_SECRET",
            default_value = "dev-secret-change-me"
        )]
        secret: String,
        #[arg(long)]
        duration: Option<f64>,
    },
}

fn init_tracing(default: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    // A closed stderr must not take the process down with a panic on the next log line.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false)
        .init();
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
    let cli = Cli::parse();
    match cli.command {
        Command::Up {
            bots,
            npcs,
            nodes,
            duration,
            summary_json,
            seed,
            chaos,
            chaos_in_place,
        } => {
            init_tracing("warn");
            if let Some(c) = chaos {
                anyhow::ensure!(c >= 1.0, "--chaos must be at least 1 second");
            }
            let opts = up::UpOptions {
                bots,
                npcs,
                nodes,
                duration: duration.map(Duration::from_secs_f64),
                summary_json,
                seed,
                status: true,
                chaos: chaos.map(Duration::from_secs_f64),
                chaos_in_place,
            };
            let s = up::run(opts, signal::shutdown()).await?;
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
            if !s.inputs_undelivered.is_empty() {
                println!("undelivered inputs by reason: {:?}", s.inputs_undelivered);
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
            let problems = s.problems();
            anyhow::ensure!(
                problems.is_empty(),
                "the run broke a guarantee: {}",
                problems.join("; ")
            );
        }
        Command::Sidecar {
            config,
            print_config,
        } => {
            init_tracing("info");
            let cfg: cellmesh_sidecar::SidecarConfig =
                cellmesh_admin::config::load(config.as_deref())?;
            if print_config {
                print!("{}", toml::to_string_pretty(&cfg)?);
                return Ok(());
            }
            let stores = cellmesh_geo_router::store::Stores::open(
                &cfg.directory_url,
                &cfg.players_url,
                &cfg.geo,
            )
            .await
            .context("opening the stores")?;
            let stop = CancellationToken::new();
            let handle = if cfg.topology_url.is_empty() {
                cellmesh_sidecar::start(cfg, stores, stop.clone()).await?
            } else {
                let topology = cellmesh_geo_router::topology::open(&cfg.topology_url)
                    .await
                    .context("opening the topology store")?;
                cellmesh_sidecar::start_in(cfg, stores, topology, stop.clone()).await?
            };
            tracing::info!(local = %handle.local_addr, mesh = %handle.mesh_addr, admin = %handle.admin_addr, "sidecar running");
            report_listening(format_args!(
                "cellmesh sidecar listening local={} mesh={} admin={}",
                handle.local_addr, handle.mesh_addr, handle.admin_addr
            ));
            tokio::select! {
                _ = signal::shutdown() => {}
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
        }
        Command::Proxy {
            config,
            print_config,
        } => {
            init_tracing("info");
            let cfg: cellmesh_proxy::ProxyConfig = cellmesh_admin::config::load(config.as_deref())?;
            if print_config {
                print!("{}", toml::to_string_pretty(&cfg)?);
                return Ok(());
            }
            let stop = CancellationToken::new();
            let handle = cellmesh_proxy::start(cfg, stop.clone()).await?;
            tracing::info!(clients = %handle.client_addr, admin = %handle.admin_addr, "proxy running");
            report_listening(format_args!(
                "cellmesh proxy listening clients={} admin={}",
                handle.client_addr, handle.admin_addr
            ));
            signal::shutdown().await;
            tracing::info!("shutting down");
            stop.cancel();
            handle.wait().await;
        }
        Command::Partition(args) => cellmesh::partition_cli::run(args).await?,
        Command::Geo(args) => cellmesh::geo_cli::run(args)?,
        Command::Sim(args) => cellmesh::sim_cli::run(args)?,
        Command::Token {
            account,
            secret,
            ttl,
        } => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs();
            println!(
                "{}",
                cellmesh_proto::token::sign(secret.as_bytes(), &account, now + ttl)
            );
        }
        Command::Bots {
            proxy,
            count,
            secret,
            duration,
        } => {
            init_tracing("warn");
            let cfg = Arc::new(bots::BotConfig {
                proxy,
                secret,
                ..bots::BotConfig::default()
            });
            let stats = Arc::new(bots::BotStats::default());
            let stop = CancellationToken::new();
            let tasks: Vec<_> = (0..count)
                .map(|i| {
                    tokio::spawn(bots::run_bot(
                        format!("bot-{i}"),
                        cfg.clone(),
                        stats.clone(),
                        stop.clone(),
                    ))
                })
                .collect();
            match duration {
                Some(d) => {
                    tokio::select! { _ = signal::shutdown() => {}, _ = tokio::time::sleep(Duration::from_secs_f64(d)) => {} }
                }
                None => signal::shutdown().await,
            }
            stop.cancel();
            for t in tasks {
                let _ = t.await;
            }
            println!("{}", serde_json::to_string_pretty(&stats.totals())?);
        }
    }
    Ok(())
}
