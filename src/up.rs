//! `cellmesh up`: a whole local cluster in one process, over real loopback sockets, with the
//! embedded in-memory stores: one sidecar with the arena game, one proxy, and bots playing through
//! it. Prints a live status line and, on exit, a summary (optionally as JSON).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use cellmesh_arena::{ArenaConfig, ArenaStats};
use cellmesh_geo_router::store::Stores;
use cellmesh_proto::sdk::SidecarAddr;
use cellmesh_proxy::ProxyConfig;
use cellmesh_sidecar::SidecarConfig;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::bots::{self, BotConfig, BotStats};

#[derive(Debug, Clone)]
pub struct UpOptions {
    pub bots: usize,
    pub npcs: u32,
    /// Stop after this long; `None` runs until Ctrl-C / SIGTERM.
    pub duration: Option<Duration>,
    pub summary_json: Option<PathBuf>,
    pub seed: u64,
    /// Print the live status line.
    pub status: bool,
}

impl Default for UpOptions {
    fn default() -> Self {
        Self {
            bots: 50,
            npcs: 100,
            duration: None,
            summary_json: None,
            seed: 1,
            status: true,
        }
    }
}

/// What a run did; written as `--summary-json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub duration_s: f64,
    pub bots: usize,
    pub sessions_peak: u64,
    pub inputs_sent: u64,
    pub inputs_delivered: u64,
    pub inputs_applied: u64,
    pub updates_delivered: u64,
    pub batches_delivered: u64,
    pub entities: u64,
    pub errors: u64,
    pub kicks: u64,
    pub rtt_ms_p50: f64,
    pub rtt_ms_p99: f64,
    pub rtt_samples: u64,
    pub inputs_dropped_by_proxy: u64,
}

/// Runs the cluster until the duration ends or `interrupt` completes.
pub async fn run(
    opts: UpOptions,
    interrupt: impl std::future::Future<Output = ()>,
) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let stop = CancellationToken::new();
    let stores = Stores::in_memory();

    let sidecar_cfg = SidecarConfig {
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        ..SidecarConfig::default()
    };
    let sidecar = cellmesh_sidecar::start(sidecar_cfg, stores, stop.child_token())
        .await
        .context("starting the sidecar")?;

    let arena_cfg = ArenaConfig {
        sidecar: SidecarAddr::Tcp(sidecar.local_addr.clone()),
        npcs: opts.npcs,
        seed: opts.seed,
        ..ArenaConfig::default()
    };
    let (home, roam) = (arena_cfg.center, arena_cfg.spread / 2.0);
    let arena_stop = stop.child_token();
    let arena = tokio::spawn(async move {
        cellmesh_arena::run(arena_cfg, async move { arena_stop.cancelled().await }).await
    });

    let mut proxy_cfg = ProxyConfig {
        client_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        gateways: vec![sidecar.mesh_addr.to_string()],
        // A secret of this run only: nobody outside it can sign a login.
        token_secret: format!("{:032x}", rand::random::<u128>()),
        ..ProxyConfig::default()
    };
    // Every bot connects from 127.0.0.1: the per-address limit must admit all of them.
    let per_address = (opts.bots as u32).saturating_mul(proxy_cfg.rate.account_inputs_per_sec);
    proxy_cfg.rate.address_inputs_per_sec = proxy_cfg.rate.address_inputs_per_sec.max(per_address);
    proxy_cfg.rate.address_burst = proxy_cfg
        .rate
        .address_burst
        .max(per_address.saturating_mul(2));
    let secret = proxy_cfg.token_secret.clone();
    let proxy = cellmesh_proxy::start(proxy_cfg, stop.child_token())
        .await
        .context("starting the proxy")?;

    let deadline = Instant::now() + Duration::from_secs(15);
    while !(sidecar.stats().game_connected && proxy.admin.is_ready()) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the cluster did not become ready within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "cellmesh up: sidecar admin http://{} · proxy clients {} admin http://{} · {} bots",
        sidecar.admin_addr, proxy.client_addr, proxy.admin_addr, opts.bots
    );

    let bot_cfg = Arc::new(BotConfig {
        proxy: proxy.client_addr.to_string(),
        secret,
        home,
        roam,
        seed: opts.seed,
        ..BotConfig::default()
    });
    let bot_stats = Arc::new(BotStats::default());
    let bot_stop = CancellationToken::new();
    let mut bot_tasks = Vec::with_capacity(opts.bots);
    for i in 0..opts.bots {
        let (cfg, stats, stop) = (bot_cfg.clone(), bot_stats.clone(), bot_stop.clone());
        bot_tasks.push(tokio::spawn(bots::run_bot(
            format!("bot-{i}"),
            cfg,
            stats,
            stop,
        )));
    }

    // Live status until the end.
    let tty = std::io::stdout().is_terminal();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last = (Instant::now(), 0u64, 0u64);
    let end = opts.duration.map(|d| tokio::time::Instant::now() + d);
    tokio::pin!(interrupt);
    loop {
        tokio::select! {
            _ = &mut interrupt => break,
            _ = async { match end { Some(e) => tokio::time::sleep_until(e).await, None => std::future::pending().await } } => break,
            _ = tick.tick() => {
                if !opts.status { continue }
                let (s, p, b) = (sidecar.stats(), proxy.stats(), bot_stats.totals());
                let dt = last.0.elapsed().as_secs_f64().max(1e-3);
                let line = format!(
                    "t={:>4.0}s sessions={:>4} entities={:>5} inputs/s={:>6.0} updates/s={:>7.0} rtt p50={:.2}ms p99={:.2}ms errors={}",
                    started.elapsed().as_secs_f64(), p.sessions, s.entities,
                    (s.inputs_delivered - last.1) as f64 / dt,
                    (b.updates_delivered - last.2) as f64 / dt,
                    p.rtt_ms_p50, p.rtt_ms_p99, b.errors + s.errors,
                );
                last = (Instant::now(), s.inputs_delivered, b.updates_delivered);
                if tty { print!("\r{line}  "); use std::io::Write; let _ = std::io::stdout().flush(); } else { println!("{line}"); }
            }
        }
    }
    if tty && opts.status {
        println!();
    }

    // Bots first, then let in-flight inputs land before reading the counters.
    bot_stop.cancel();
    for t in bot_tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (s, p, b) = (sidecar.stats(), proxy.stats(), bot_stats.totals());

    stop.cancel();
    let arena_stats: ArenaStats = match tokio::time::timeout(Duration::from_secs(5), arena).await {
        Ok(Ok(Ok(st))) => st,
        Ok(Ok(Err(e))) => {
            tracing::warn!(error = %e, "arena ended with an error");
            ArenaStats::default()
        }
        _ => ArenaStats::default(),
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), proxy.wait()).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), sidecar.wait()).await;

    let summary = Summary {
        duration_s: started.elapsed().as_secs_f64(),
        bots: opts.bots,
        sessions_peak: p.sessions_peak,
        inputs_sent: b.inputs_sent,
        inputs_delivered: s.inputs_delivered,
        inputs_applied: arena_stats.inputs_applied,
        updates_delivered: b.updates_delivered,
        batches_delivered: b.batches,
        entities: s.entities,
        errors: b.errors + s.errors + arena_stats.errors_from_sidecar,
        kicks: b.kicks,
        rtt_ms_p50: p.rtt_ms_p50,
        rtt_ms_p99: p.rtt_ms_p99,
        rtt_samples: p.rtt_samples,
        inputs_dropped_by_proxy: p.inputs_dropped,
    };
    if let Some(path) = &opts.summary_json {
        std::fs::write(path, serde_json::to_string_pretty(&summary)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(summary)
}
