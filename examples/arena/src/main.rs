//! The arena sample as its own process: `arena --sidecar 127.0.0.1:7100 --npcs 100`.
use cellmesh_arena::{run, ArenaConfig};
use cellmesh_proto::sdk::SidecarAddr;
use clap::Parser;

#[derive(Parser)]
#[command(about = "A toy game server that speaks only the cellmesh local protocol")]
struct Args {
    /// Sidecar address: HOST:PORT, or unix:/path/to.sock
    #[arg(long, env = "ARENA_SIDECAR", default_value = "127.0.0.1:7100")]
    sidecar: String,
    #[arg(long, default_value_t = 100)]
    npcs: u32,
    /// Centre of the arena square, "X,Y" in metres
    #[arg(long, default_value = "1000,1000")]
    center: String,
    /// Side of the arena square in metres
    #[arg(long, default_value_t = 400.0)]
    spread: f64,
    #[arg(long, default_value_t = 20)]
    tick_hz: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Metres per second a player walks
    #[arg(long, default_value_t = cellmesh_arena::schema::PLAYER_SPEED)]
    player_speed: f64,
    /// Leave every handoff to the sidecar's Freeze instead of releasing entities that walk out
    /// of the node's area
    #[arg(long)]
    no_release: bool,
    /// Milliseconds of tick each entity is reported to cost, on top of the tick as measured: a
    /// heavier game's load, for trying the director's balancing with a light sample
    #[arg(long, default_value_t = 0.0)]
    entity_cost_ms: f32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let a = Args::parse();
    let (x, y) = a
        .center
        .split_once(',')
        .and_then(|(x, y)| Some((x.trim().parse().ok()?, y.trim().parse().ok()?)))
        .ok_or_else(|| anyhow::anyhow!("--center must be X,Y in metres, got {:?}", a.center))?;
    let sidecar = match a.sidecar.strip_prefix("unix:") {
        Some(p) => SidecarAddr::Unix(p.into()),
        None => SidecarAddr::Tcp(a.sidecar),
    };
    let cfg = ArenaConfig {
        sidecar,
        npcs: a.npcs,
        center: (x, y),
        spread: a.spread,
        tick_hz: a.tick_hz,
        seed: a.seed,
        player_speed: a.player_speed,
        census: None,
        release: !a.no_release,
        entity_cost_ms: a.entity_cost_ms,
        ..ArenaConfig::default()
    };
    let stats = run(cfg, shutdown_signal()).await?;
    tracing::info!(?stats, "arena stopped");
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
