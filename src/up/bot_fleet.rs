//! The bots of a run: each plays from a geo, every proxy of another geo a latency relay away.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use super::cluster::Cluster;
use super::crowd::{Bubble, Crowd, ARENA_SPREAD, MEETING_POINT};
use super::UpOptions;
use crate::bots::{self, BotConfig, BotStats};

/// The bots playing, and what they count.
pub(super) struct BotFleet {
    pub(super) stats: Arc<BotStats>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl BotFleet {
    /// Starts `opts.bots` bots playing on `cluster`; their click to screen is timed from
    /// `started`.
    pub(super) async fn start(
        opts: &UpOptions,
        cluster: &Cluster,
        started: Instant,
    ) -> anyhow::Result<Self> {
        let bot_cfgs = configs(opts, cluster).await?;
        let geos = &cluster.env.geos;
        let n = geos.names.len();
        let gathers = |i: usize| opts.bubbles && is_bubble_bot(i, n);
        // The gathering bots' saved avatars stand at the bubble's point: they log in there.
        let at_home = &bot_cfgs[(n - 1) * 2];
        let bubble_cfg = Arc::new(BotConfig {
            home: Bubble::POINT,
            roam: Bubble::ROAM_M,
            geo: at_home.geo.clone().map(|g| bots::BotGeo {
                location: Bubble::location(&g.location),
                ..g
            }),
            ..(**at_home).clone()
        });
        for i in (0..opts.bots).filter(|i| gathers(*i)) {
            gather_at_the_bubble(cluster, &format!("bot-{i}"), &geos.names[n - 1], i).await?;
        }
        let bot_cfg_of = |i: usize| {
            if gathers(i) {
                return bubble_cfg.clone();
            }
            let (location, far) = (i % n, i / n % 4 == 3 && n > 1);
            bot_cfgs[location * 2 + usize::from(far)].clone()
        };
        let bot_stats = Arc::new(BotStats {
            click_to_screen: bots::ClickToScreen::starting(started),
            ..BotStats::default()
        });
        if let Some(g) = bubble_cfg.geo.as_ref().filter(|_| opts.bubbles) {
            bot_stats.click_to_screen.track(&g.location);
        }
        let bot_stop = CancellationToken::new();
        let mut bot_tasks = Vec::with_capacity(opts.bots);
        for i in 0..opts.bots {
            let (cfg, stats, stop) = (bot_cfg_of(i), bot_stats.clone(), bot_stop.clone());
            bot_tasks.push(tokio::spawn(bots::run_bot(
                format!("bot-{i}"),
                cfg,
                stats,
                stop,
            )));
        }
        Ok(Self {
            stats: bot_stats,
            stop: bot_stop,
            tasks: bot_tasks,
        })
    }

    /// Tells every bot to leave.
    pub(super) fn stop(&self) {
        self.stop.cancel();
    }

    /// Waits for every bot to be gone (5 s at most each).
    pub(super) async fn wait(self) {
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }
}

/// Whether bot `i` of a run over `geos` geos gathers at the bubble's point: the last geo's bots
/// that log in at home.
pub(super) fn is_bubble_bot(i: usize, geos: usize) -> bool {
    geos > 1 && i % geos == geos - 1 && i / geos % 4 != 3
}

/// Saves `account`'s record with its avatar at the bubble's point (spread a few metres by `i`),
/// so that its first login spawns it there.
async fn gather_at_the_bubble(
    cluster: &Cluster,
    account: &str,
    geo: &str,
    i: usize,
) -> anyhow::Result<()> {
    let (x, y) = Bubble::POINT;
    let spread = (i % 10) as f64 * 8.0;
    let record = cellmesh_stores::PlayerRecord {
        account: account.to_string(),
        last_position: Some([x + spread, y - spread, 0.0]),
        home_geo: geo.to_string(),
        updated_unix_ms: super::unix_ms(),
        gateway_geo: geo.to_string(),
        session_epoch: 0,
        last_handover_unix_ms: None,
    };
    cluster.env.stores[0]
        .players
        .save(&record)
        .await
        .with_context(|| format!("saving {account}'s record at the bubble's point"))
}

/// The bots' configurations, two per geo: each bot plays from a geo (round robin); from there
/// every proxy is a relay away that adds the latency. A quarter log in far from home (to the
/// next geo's proxy), as travellers or misrouted players do: the handover policy is for them.
async fn configs(opts: &UpOptions, cluster: &Cluster) -> anyhow::Result<Vec<Arc<BotConfig>>> {
    let (geos, proxies) = (&cluster.env.geos, &cluster.proxies);
    let (home, roam) = if opts.bsp {
        (Crowd::gather_point(&cluster.env.world), Crowd::ROAM_M)
    } else {
        (MEETING_POINT, ARENA_SPREAD / 2.0)
    };
    let mut bot_cfgs: Vec<Arc<BotConfig>> = Vec::new();
    let bot_tls = cluster
        .env
        .mesh_ca
        .as_ref()
        .map(|ca| ca.client_tls())
        .transpose()?;
    for location in 0..geos.names.len() {
        let mut via = std::collections::HashMap::new();
        if geos.several() {
            for (g, p) in proxies.iter().enumerate() {
                let relay = cellmesh_proto::shaping::relay(
                    p.client_addr,
                    geos.to_proxy(location, g),
                    cluster.env.stop.child_token(),
                )
                .await
                .context("starting a latency relay")?;
                via.insert(p.client_addr.to_string(), relay.to_string());
            }
        }
        for start in [location, (location + 1) % geos.names.len()] {
            bot_cfgs.push(Arc::new(BotConfig {
                proxy: proxies[start].client_addr.to_string(),
                secret: cluster.secret.clone(),
                home,
                roam,
                seed: opts.seed,
                census: Some(cluster.env.games.clone()),
                geo: geos.several().then(|| bots::BotGeo {
                    location: geos.names[location].clone(),
                    via: via.clone(),
                }),
                tls: bot_tls.clone(),
                ..BotConfig::default()
            }));
        }
    }
    Ok(bot_cfgs)
}
