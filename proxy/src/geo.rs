//! The proxy's part in a network of several geos (README.md#geos-bridge-first-hand-over-later): handover hints at login, and the
//! handover itself.
//!
//! A player handed over to another geo gets `Transfer{host, port, cookie}`; the same hint goes
//! to the target geo's Redis. At login there, the proxy takes the hint from its geo's Redis, or
//! checks the cookie the client offers in its hello, or asks for it (`CookieRequest`) when it
//! offered none: whichever is valid saves the gateway its MongoDB read. Both are the one sealed
//! cookie of `cellmesh_proto::cookie`: bound to the account and the client's address, and
//! ignored after 60 s. Anything refused is counted by reason, and the login reads MongoDB, which
//! stays the authority. On a single-geo network none of this runs.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cellmesh_proto::cookie::{self, CookieError, HintCookie};
use cellmesh_proto::edge::{ProbeTarget, Transfer};
use cellmesh_proto::mesh::{HandoverHint, MeshVec3};
use cellmesh_proto::ticket::{self, ProbeTicket};
use cellmesh_stores::{EdgeBoard, FarRtt};
use cellmesh_world::handover::RttFigure;

use crate::config::ProxyConfig;
use crate::discovery::Discovery;
use crate::metrics::Metrics;

/// How long a hint waits on the target geo's Redis: as long as a cookie is honoured.
pub(crate) const HINT_TTL: Duration = Duration::from_millis(cookie::MAX_AGE_MS);
/// Bound on one call to a geo's Redis at login or handover: a slow store costs the hint, not
/// the login.
const BOARD_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a far proxy's measurement counts: a few probe periods.
const FAR_RTT_TTL: Duration = Duration::from_secs(300);

/// The boards (Redis) of every geo, for proxies that share in-memory ones (one process).
#[derive(Clone)]
pub struct Boards {
    pub by_geo: HashMap<String, Arc<dyn EdgeBoard>>,
}

/// Where a login's hint came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HintSource {
    Hint,
    Cookie,
}

impl HintSource {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Hint => "hint",
            Self::Cookie => "cookie",
        }
    }
}

struct Peer {
    proxies: String,
    board: Arc<dyn EdgeBoard>,
}

/// The geos this proxy knows, with their boards.
pub(crate) struct Geos {
    home: String,
    board: Arc<dyn EdgeBoard>,
    peers: HashMap<String, Peer>,
    /// Seals and opens the handover cookies and probe tickets.
    ring: cellmesh_proto::keys::KeyRing,
    /// `None` on a single-geo network: nothing to find.
    discovery: Option<Discovery>,
}

pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Geos {
    /// Opens the boards the config names, or takes them from `boards` where it has them.
    pub(crate) async fn open(cfg: &ProxyConfig, boards: Option<&Boards>) -> anyhow::Result<Self> {
        let g = &cfg.geos;
        let open = |geo: &str, url: &str| {
            let shared = boards.and_then(|b| b.by_geo.get(geo).cloned());
            let (geo, url) = (geo.to_string(), url.to_string());
            async move {
                match shared {
                    Some(b) => Ok(b),
                    None => cellmesh_stores::open_board(&url, &geo)
                        .await
                        .map_err(|e| anyhow::anyhow!("geo `{geo}` board: {e}")),
                }
            }
        };
        let board = open(&cfg.geo, &g.board).await?;
        let mut peers = HashMap::new();
        for p in &g.peers {
            // Another geo's board connects at its first use: this proxy serves its own geo
            // while the other is out of reach (a cut between the datacenters).
            let board: Arc<dyn EdgeBoard> = match boards.and_then(|b| b.by_geo.get(&p.name)) {
                Some(b) => b.clone(),
                None => Arc::new(
                    cellmesh_stores::lazy_board::LazyBoard::new(&p.board, &p.name)
                        .map_err(|e| anyhow::anyhow!("geo `{}` board: {e}", p.name))?,
                ),
            };
            peers.insert(
                p.name.clone(),
                Peer {
                    proxies: p.proxies.clone(),
                    board,
                },
            );
        }
        Ok(Self {
            home: cfg.geo.clone(),
            board,
            peers,
            ring: cfg.rings()?.cookie,
            discovery: if g.peers.is_empty() {
                None
            } else {
                Some(Discovery::new(&g.dns_servers)?)
            },
        })
    }

    /// Opens a cookie (or a hint, which is the same sealed cookie) for a login here.
    pub(crate) fn open_cookie(
        &self,
        sealed: &[u8],
        account: &str,
        ip: IpAddr,
        now_unix_ms: u64,
    ) -> Result<HintCookie, CookieError> {
        let c = cookie::open_ring(&self.ring, sealed, account, ip, now_unix_ms)?;
        if c.target_geo != self.home {
            return Err(CookieError::WrongGeo(c.target_geo));
        }
        Ok(c)
    }

    /// Opens a cookie or hint for a login here and uses its nonce on this geo's board, so that
    /// it is honoured once, whichever proxy of the geo sees it and however often it is shown.
    /// A board that cannot say refuses it: the login reads MongoDB, the authority.
    pub(crate) async fn open_once(
        &self,
        sealed: &[u8],
        account: &str,
        ip: IpAddr,
        now_unix_ms: u64,
        metrics: &Metrics,
    ) -> Result<HintCookie, &'static str> {
        let c = self
            .open_cookie(sealed, account, ip, now_unix_ms)
            .map_err(|e| e.kind())?;
        // Remembered as long as the cookie could still pass its age check on any proxy here.
        let ttl = Duration::from_millis(
            (c.issued_unix_ms + cookie::MAX_AGE_MS + cookie::MAX_CLOCK_SKEW_MS)
                .saturating_sub(now_unix_ms)
                .max(1),
        );
        match tokio::time::timeout(BOARD_TIMEOUT, self.board.use_nonce(account, &c.nonce, ttl))
            .await
        {
            Ok(Ok(true)) => Ok(c),
            Ok(Ok(false)) => Err(CookieError::Replayed.kind()),
            Ok(Err(e)) => {
                metrics.error("hint_store");
                tracing::warn!(%account, error = %e, "using the handover cookie's nonce failed");
                Err("nonce_store")
            }
            Err(_) => {
                metrics.error("hint_store");
                tracing::warn!(%account, "using the handover cookie's nonce timed out");
                Err("nonce_store")
            }
        }
    }

    /// Takes and checks the hint this geo's Redis holds for `account`.
    pub(crate) async fn take_hint(
        &self,
        account: &str,
        ip: IpAddr,
        metrics: &Metrics,
    ) -> Option<HintCookie> {
        let sealed = match tokio::time::timeout(BOARD_TIMEOUT, self.board.take_hint(account)).await
        {
            Ok(Ok(sealed)) => sealed?,
            Ok(Err(e)) => {
                metrics.error("hint_store");
                tracing::warn!(%account, error = %e, "reading the handover hint failed");
                return None;
            }
            Err(_) => {
                metrics.error("hint_store");
                tracing::warn!(%account, "reading the handover hint timed out");
                return None;
            }
        };
        match self
            .open_once(&sealed, account, ip, now_unix_ms(), metrics)
            .await
        {
            Ok(c) => Some(c),
            Err(kind) => {
                metrics.hint_refused(kind);
                tracing::debug!(%account, %kind, "handover hint refused");
                None
            }
        }
    }

    /// Seals the hint for handing `account`'s session over to `geo`, pins it on that geo's
    /// Redis, and returns the `Transfer` the client gets. A store that fails costs the pinned
    /// copy only: the cookie travels with the client all the same.
    pub(crate) async fn transfer(
        &self,
        geo: &str,
        hint: HintCookie,
        ip: IpAddr,
        metrics: &Metrics,
    ) -> Result<Transfer, String> {
        let peer = self
            .peers
            .get(geo)
            .ok_or_else(|| format!("geo `{geo}` is not among this proxy's peers"))?;
        let (host, port) = self.find(&peer.proxies, metrics).await?;
        let sealed =
            cookie::seal_with(self.ring.signing(), &hint, ip).map_err(|e| e.to_string())?;
        match tokio::time::timeout(
            BOARD_TIMEOUT,
            peer.board.put_hint(&hint.account, &sealed, HINT_TTL),
        )
        .await
        {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                metrics.error("hint_store");
                tracing::warn!(account = %hint.account, %geo, error = %e, "pinning the handover hint failed; the cookie remains");
            }
            Err(_) => {
                metrics.error("hint_store");
                tracing::warn!(account = %hint.account, %geo, "pinning the handover hint timed out; the cookie remains");
            }
        }
        Ok(Transfer {
            host: host.to_string(),
            port: port.into(),
            cookie: sealed.into(),
            geo: geo.to_string(),
            server_name: crate::discovery::server_name_of(&peer.proxies),
        })
    }

    /// Where a peer's proxies are now, by DNS (a literal address needs none).
    async fn find(&self, proxies: &str, metrics: &Metrics) -> Result<(String, u16), String> {
        let Some(d) = &self.discovery else {
            return Err("a single-geo network has no peer".into());
        };
        d.first(proxies).await.inspect_err(|e| {
            metrics.error("dns");
            tracing::warn!(%proxies, error = %e, "finding a peer geo's proxies failed");
        })
    }

    /// What a client of this geo is asked to probe: every other geo's proxies, each with a
    /// ticket that names the client's account, this geo and that one. A geo whose proxies
    /// cannot be found now is left out (and counted).
    pub(crate) async fn probe_targets(
        &self,
        account: &str,
        ip: IpAddr,
        metrics: &Metrics,
    ) -> Vec<ProbeTarget> {
        let now = now_unix_ms();
        let mut targets = Vec::new();
        for (geo, peer) in &self.peers {
            let Ok((host, port)) = self.find(&peer.proxies, metrics).await else {
                continue;
            };
            let t = ProbeTicket {
                issued_unix_ms: now,
                origin_geo: self.home.clone(),
                target_geo: geo.clone(),
                account: account.to_string(),
            };
            let Ok(ticket) = ticket::seal_with(self.ring.signing(), &t, ip) else {
                continue;
            };
            targets.push(ProbeTarget {
                geo: geo.clone(),
                host,
                port: port.into(),
                ticket: ticket.into(),
                server_name: crate::discovery::server_name_of(&peer.proxies),
            });
        }
        targets.sort_by(|a, b| a.geo.cmp(&b.geo));
        targets
    }

    /// Publishes what this proxy measured to a client of `origin` onto that geo's Redis.
    pub(crate) async fn publish_far_rtt(
        &self,
        origin: &str,
        account: &str,
        rtt: FarRtt,
    ) -> Result<(), String> {
        let peer = self
            .peers
            .get(origin)
            .ok_or_else(|| format!("unknown geo `{origin}`"))?;
        tokio::time::timeout(
            BOARD_TIMEOUT,
            peer.board
                .put_far_rtt(account, &self.home, rtt, FAR_RTT_TTL),
        )
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| e.to_string())
    }

    /// What other geos' proxies measured to `account`, as the handover policy reads it.
    pub(crate) async fn far_rtts(&self, account: &str) -> HashMap<String, RttFigure> {
        match tokio::time::timeout(BOARD_TIMEOUT, self.board.far_rtts(account)).await {
            Ok(Ok(all)) => all
                .into_iter()
                .map(|(geo, r)| {
                    (
                        geo,
                        RttFigure {
                            min_ms: r.min_ms,
                            median_ms: r.median_ms,
                            samples: r.samples,
                        },
                    )
                })
                .collect(),
            _ => HashMap::new(),
        }
    }
}

/// What the gateway gets in place of its MongoDB read.
pub(crate) fn attach_hint(c: &HintCookie, source: HintSource) -> HandoverHint {
    HandoverHint {
        session_epoch: c.session_epoch,
        last_position: c.last_position.map(|[x, y, z]| MeshVec3 { x, y, z }),
        issued_unix_ms: c.issued_unix_ms,
        source: source.name().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PeerGeo;

    /// A proxy restarted while the other geo is cut off still starts: the other geo's board is
    /// connected at its first use, and only that use fails.
    #[tokio::test]
    async fn a_proxy_opens_its_geos_while_another_geos_board_is_out_of_reach() {
        let mut cfg = ProxyConfig {
            geo: "eu".into(),
            ..ProxyConfig::default()
        };
        cfg.geos.board = "memory".into();
        cfg.geos.peers = vec![PeerGeo {
            name: "us".into(),
            proxies: "127.0.0.1:7300".into(),
            // Nothing listens on port 1.
            board: "redis://127.0.0.1:1".into(),
        }];
        let geos = Geos::open(&cfg, None)
            .await
            .expect("opened without the us board");
        let us = &geos.peers["us"].board;
        assert!(us.take_hint("alice").await.is_err());
        cfg.geos.peers[0].board = "mongodb://127.0.0.1:1".into();
        assert!(
            Geos::open(&cfg, None).await.is_err(),
            "a bad URL still fails at start"
        );
    }
}
