//! The run's proxies: one per geo, each knowing the others, and their counters together.

use std::sync::Arc;

use anyhow::Context;
use cellmesh_proxy::{ProxyConfig, ProxyHandle};

use super::node::{NodeEnv, NodeRun};

/// Starts one proxy per geo in front of its nodes, admitting `bots` players from loopback and
/// their logins signed with `secret`.
pub(super) async fn start_proxies(
    env: &NodeEnv,
    nodes: &[NodeRun],
    bots: usize,
    secret: &str,
) -> anyhow::Result<Vec<ProxyHandle>> {
    let geos = &env.geos;
    // Every bot connects from 127.0.0.1: the per-address limits must admit all of them (twice
    // over, for a bot reconnecting while its old connection closes).
    let bot_conns = u32::try_from(bots).unwrap_or(u32::MAX).saturating_mul(2);
    // One proxy per geo; with several, each knows the others' (picked ahead, so that each can
    // name the rest) and their boards (shared in memory, as each geo's Redis would be).
    let proxy_addrs: Vec<String> = (0..geos.names.len())
        .map(|_| free_loopback_addr())
        .collect::<anyhow::Result<_>>()?;
    let boards = cellmesh_proxy::Boards {
        by_geo: geos
            .names
            .iter()
            .map(|g| {
                (
                    g.clone(),
                    Arc::new(cellmesh_stores::memory::MemoryBoard::default())
                        as Arc<dyn cellmesh_stores::EdgeBoard>,
                )
            })
            .collect(),
    };
    let mut proxies = Vec::with_capacity(geos.names.len());
    for (g, name) in geos.names.iter().enumerate() {
        let mut cfg = ProxyConfig {
            name: format!("proxy-{name}"),
            geo: name.clone(),
            client_listen: if geos.several() {
                proxy_addrs[g].clone()
            } else {
                "127.0.0.1:0".into()
            },
            admin_listen: "127.0.0.1:0".into(),
            gateways: nodes
                .iter()
                .filter(|n| geos.geo_of(n.id) == g)
                .map(|n| n.sidecar.mesh_addr.to_string())
                .collect(),
            // Outside the core, the core's gateways serve while none of the geo's is up.
            fallback_gateways: nodes
                .iter()
                .filter(|n| g != 0 && geos.geo_of(n.id) == 0)
                .map(|n| n.sidecar.mesh_addr.to_string())
                .collect(),
            token_secret: secret.to_string(),
            attest_keys: vec![env.attest_key.clone()],
            admin_token: env.admin_token.to_string(),
            ..ProxyConfig::default()
        };
        if let Some(ca) = &env.mesh_ca {
            let who = cellmesh_trust::Identity::new(cellmesh_trust::Role::Proxy, None, Some(name))
                .map_err(anyhow::Error::msg)?;
            cfg.mesh_tls = ca.issue(&format!("proxy-{name}"), &who)?;
            cfg.client_tls = ca.issue_edge(&format!("proxy-{name}-edge"))?;
        }
        cfg.rate.address_accounts = cfg.rate.address_accounts.max(bot_conns);
        cfg.max_connections_per_address = cfg.max_connections_per_address.max(bot_conns as usize);
        cfg.max_connections = cfg.max_connections.max(bot_conns as usize);
        // One process stops as a whole: nothing to drain towards.
        cfg.drain_grace_ms = 0;
        cfg.drain_spread_ms = 0;
        if geos.several() {
            cfg.geos.peers = geos
                .names
                .iter()
                .enumerate()
                .filter(|(o, _)| *o != g)
                .map(|(o, other)| cellmesh_proxy::PeerGeo {
                    name: other.clone(),
                    proxies: proxy_addrs[o].clone(),
                    board: "memory".into(),
                })
                .collect();
            // The shaping is in-process: the kernel sees loopback, the pings see the latency.
            cfg.geos.kernel_rtt = false;
            cfg.geos.probe_every_ms = 10_000;
            // A demo of a minute: settle and bridge briefly.
            cfg.geos.handover.settle_ms = 5_000;
            cfg.geos.handover.settle_depth_m = 20.0;
            cfg.geos.handover.max_bridge_ms = 20_000;
            cfg.geos.handover.min_samples = 3;
        }
        let proxy = cellmesh_proxy::start_with(cfg, env.stop.child_token(), Some(boards.clone()))
            .await
            .with_context(|| format!("starting the proxy of geo {name}"))?;
        proxies.push(proxy);
    }
    Ok(proxies)
}

/// A loopback address nothing listens on now (bound and released), for a listener that others
/// must be able to name before it starts.
fn free_loopback_addr() -> anyhow::Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.to_string())
}

/// The proxies' counters together (their RTT percentiles: the worst proxy's).
pub(super) fn proxy_stats(proxies: &[ProxyHandle]) -> cellmesh_proxy::ProxyStats {
    let mut t = cellmesh_proxy::ProxyStats::default();
    for p in proxies {
        let s = p.stats();
        t.sessions += s.sessions;
        t.sessions_peak += s.sessions_peak;
        t.sessions_moved += s.sessions_moved;
        t.connections_refused += s.connections_refused;
        t.rtt_reports_dropped += s.rtt_reports_dropped;
        t.inputs_accepted += s.inputs_accepted;
        t.inputs_dropped += s.inputs_dropped;
        t.inputs_received += s.inputs_received;
        for (why, n) in s.inputs_lost {
            *t.inputs_lost.entry(why).or_insert(0) += n;
        }
        t.inputs_written += s.inputs_written;
        t.inputs_on_ended_links += s.inputs_on_ended_links;
        t.kicks += s.kicks;
        t.rtt_ms_p50 = t.rtt_ms_p50.max(s.rtt_ms_p50);
        t.rtt_ms_p99 = t.rtt_ms_p99.max(s.rtt_ms_p99);
        t.rtt_samples += s.rtt_samples;
        t.frames_in += s.frames_in;
        t.frames_out += s.frames_out;
        t.logins_refused += s.logins_refused;
        t.gateways_closed += s.gateways_closed;
        t.hint_hits += s.hint_hits;
        t.cookie_hits += s.cookie_hits;
        t.cookie_requests += s.cookie_requests;
        t.handovers += s.handovers;
        t.bridged_sessions += s.bridged_sessions;
        t.probes_served += s.probes_served;
        t.sessions_on_fallback += s.sessions_on_fallback;
        t.sessions_fallen_back += s.sessions_fallen_back;
        t.sessions_returned_home += s.sessions_returned_home;
    }
    t
}
