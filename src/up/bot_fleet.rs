//! The bots of a run: each plays from a geo, every proxy of another geo a latency relay away.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use super::cluster::Cluster;
use super::crowd::{Bubble, Crowd, ARENA_SPREAD, MEETING_POINT};
use super::UpOptions;
use crate::bots::{self, BotConfig, BotStats};

/// With more bots than this, a run starts with this many, measures their RTT (the knee's), and
/// only then lets the rest come: the crowd's admitted sessions are held to that figure.
pub(super) const KNEE_BOTS: usize = 200;
/// From the first bots' start to the knee's window: their logins and first views.
const KNEE_SETTLE: Duration = Duration::from_secs(4);
const KNEE_WINDOW: Duration = Duration::from_secs(8);
/// From the rest's start to the crowd's window, which lasts until the bots stop.
const CROWD_SETTLE: Duration = Duration::from_secs(4);

type Rtt = hdrhistogram::Histogram<u64>;

/// What the proxies measured by the knee's window's end, and by the crowd's window's start.
#[derive(Default)]
struct RttMarks {
    knee: Option<Rtt>,
    crowd_from: Option<Rtt>,
}

/// The bots playing, and what they count.
pub(super) struct BotFleet {
    pub(super) stats: Arc<BotStats>,
    stop: CancellationToken,
    tasks: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    rtt: Arc<std::sync::Mutex<RttMarks>>,
    readers: Vec<cellmesh_proxy::RttReader>,
}

/// Every client RTT the proxies measured so far, in microseconds.
fn rtt_now(readers: &[cellmesh_proxy::RttReader]) -> Rtt {
    let mut h = Rtt::new(3).expect("3 significant figures");
    for r in readers {
        // Every proxy's histogram has the same bounds: adding never fails.
        let _ = h.add(r.histogram());
    }
    h
}

/// Sleeps for `d`; false if the run stopped first.
async fn sleep_unless_stopped(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

/// p99 of `h` less what `before` already held, in ms (0 with no sample).
fn p99_ms_since(h: &Rtt, before: Option<&Rtt>) -> f64 {
    let mut h = h.clone();
    if let Some(b) = before {
        if h.subtract(b).is_err() {
            return 0.0;
        }
    }
    if h.is_empty() {
        return 0.0;
    }
    h.value_at_quantile(0.99) as f64 / 1000.0
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
        let spawn = {
            let (stats, stop) = (bot_stats.clone(), bot_stop.clone());
            move |i: usize, cfg: Arc<BotConfig>| {
                tokio::spawn(bots::run_bot(
                    format!("bot-{i}"),
                    cfg,
                    stats.clone(),
                    stop.clone(),
                ))
            }
        };
        let first = if opts.bots > KNEE_BOTS {
            KNEE_BOTS
        } else {
            opts.bots
        };
        let tasks: Vec<_> = (0..first).map(|i| spawn(i, bot_cfg_of(i))).collect();
        let tasks = Arc::new(std::sync::Mutex::new(tasks));
        let readers: Vec<_> = cluster.proxies.iter().map(|p| p.rtt_reader()).collect();
        let rtt = Arc::new(std::sync::Mutex::new(RttMarks::default()));
        if first < opts.bots {
            let rest: Vec<_> = (first..opts.bots).map(|i| (i, bot_cfg_of(i))).collect();
            let (tasks, readers, rtt, stop) = (
                tasks.clone(),
                readers.clone(),
                rtt.clone(),
                bot_stop.clone(),
            );
            tokio::spawn(async move {
                if !sleep_unless_stopped(&stop, KNEE_SETTLE).await {
                    return;
                }
                let from = rtt_now(&readers);
                if !sleep_unless_stopped(&stop, KNEE_WINDOW).await {
                    return;
                }
                let mut knee = rtt_now(&readers);
                rtt.lock().expect("rtt marks lock").knee =
                    knee.subtract(&from).is_ok().then_some(knee);
                let more: Vec<_> = rest.into_iter().map(|(i, cfg)| spawn(i, cfg)).collect();
                tasks.lock().expect("bot tasks lock").extend(more);
                if sleep_unless_stopped(&stop, CROWD_SETTLE).await {
                    rtt.lock().expect("rtt marks lock").crowd_from = Some(rtt_now(&readers));
                }
            });
        }
        Ok(Self {
            stats: bot_stats,
            stop: bot_stop,
            tasks,
            rtt,
            readers,
        })
    }

    /// The RTT p99 of the first [`KNEE_BOTS`] bots' sessions before the rest came, and of
    /// every admitted session once the rest did (ms; 0 for a run of no more bots than that, or
    /// one that ended before the window).
    pub(super) fn rtt_p99s(&self) -> (f64, f64) {
        let marks = self.rtt.lock().expect("rtt marks lock");
        let knee = marks.knee.as_ref().map_or(0.0, |k| p99_ms_since(k, None));
        let crowd = marks.crowd_from.as_ref().map_or(0.0, |from| {
            p99_ms_since(&rtt_now(&self.readers), Some(from))
        });
        (knee, crowd)
    }

    /// Tells every bot to leave.
    pub(super) fn stop(&self) {
        self.stop.cancel();
    }

    /// Waits for every bot to be gone (5 s at most each).
    pub(super) async fn wait(self) {
        let tasks = std::mem::take(&mut *self.tasks.lock().expect("bot tasks lock"));
        for t in tasks {
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
