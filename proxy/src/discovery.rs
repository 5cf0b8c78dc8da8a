//! Finding other geos' proxies by DNS (README.md#geos-bridge-first-hand-over-later): a peer geo is configured by name, and
//! resolved with `hickory-resolver`, either as `host:port` (A and AAAA records) or as an SRV name
//! (`_cellmesh._tcp.montreal.example`: each target's host and port). Answers are kept for their
//! TTL (at least [`MIN_TTL`]); a failed lookup forgets what was kept, so the next use asks again
//! rather than go on with an address that may be gone. A literal `ip:port` needs no DNS.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::Resolver;

/// Answers are kept at least this long, so a zero TTL does not turn every use into a lookup.
pub(crate) const MIN_TTL: Duration = Duration::from_secs(1);
/// Bound on one resolution.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);

pub(crate) struct Discovery {
    resolver: Resolver<TokioRuntimeProvider>,
    cache: Mutex<HashMap<String, (Vec<SocketAddr>, Instant)>>,
}

impl Discovery {
    /// A resolver asking `servers` (`ip:port`), or the system's (`/etc/resolv.conf`) when empty.
    pub(crate) fn new(servers: &[String]) -> anyhow::Result<Self> {
        let mut builder = if servers.is_empty() {
            Resolver::builder_tokio()?
        } else {
            let mut name_servers = Vec::new();
            for s in servers {
                let addr: SocketAddr = s
                    .parse()
                    .map_err(|e| anyhow::anyhow!("config: geos.dns_servers: `{s}`: {e}"))?;
                let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
                for c in &mut ns.connections {
                    c.port = addr.port();
                }
                name_servers.push(ns);
            }
            Resolver::builder_with_config(
                ResolverConfig::from_parts(None, Vec::new(), name_servers),
                TokioRuntimeProvider::default(),
            )
        };
        // Ours is the one cache, so that its TTLs are the ones that hold.
        let opts = builder.options_mut();
        opts.cache_size = 0;
        opts.timeout = LOOKUP_TIMEOUT;
        opts.attempts = 1;
        Ok(Self {
            resolver: builder.build()?,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// The addresses `target` names now, in preference order.
    pub(crate) async fn resolve(&self, target: &str) -> Result<Vec<SocketAddr>, String> {
        if let Ok(addr) = target.parse::<SocketAddr>() {
            return Ok(vec![addr]);
        }
        let now = Instant::now();
        if let Some((addrs, until)) = self.cached(target) {
            if now < until {
                return Ok(addrs);
            }
        }
        let looked_up = tokio::time::timeout(LOOKUP_TIMEOUT * 2, self.look_up(target))
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {:?}", LOOKUP_TIMEOUT * 2)));
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        match looked_up {
            Ok((addrs, until)) if !addrs.is_empty() => {
                cache.insert(
                    target.to_string(),
                    (addrs.clone(), until.max(now + MIN_TTL)),
                );
                Ok(addrs)
            }
            Ok(_) => {
                cache.remove(target);
                Err(format!("`{target}` names no address"))
            }
            Err(e) => {
                cache.remove(target);
                Err(format!("resolving `{target}`: {e}"))
            }
        }
    }

    /// The first address `target` names, as (host, port) for a client.
    pub(crate) async fn first(&self, target: &str) -> Result<(String, u16), String> {
        let addr = self.resolve(target).await?[0];
        Ok((addr.ip().to_string(), addr.port()))
    }

    fn cached(&self, target: &str) -> Option<(Vec<SocketAddr>, Instant)> {
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(target)
            .cloned()
    }

    /// Resolves without the cache: the addresses, and until when they hold.
    async fn look_up(&self, target: &str) -> Result<(Vec<SocketAddr>, Instant), String> {
        if target.starts_with('_') && !target.contains(':') {
            let srv = self
                .resolver
                .srv_lookup(target)
                .await
                .map_err(|e| e.to_string())?;
            let mut until = srv.valid_until();
            let mut records: Vec<_> = srv
                .answers()
                .iter()
                .filter_map(|r| match &r.data {
                    RData::SRV(s) => Some(s.clone()),
                    _ => None,
                })
                .collect();
            // Lowest priority first, then the heaviest weight.
            records.sort_by_key(|s| (s.priority, std::cmp::Reverse(s.weight)));
            let mut out = Vec::new();
            for s in records {
                let ips = self
                    .resolver
                    .lookup_ip(s.target.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                until = until.min(ips.valid_until());
                out.extend(ips.iter().map(|ip| SocketAddr::new(ip, s.port)));
            }
            return Ok((out, until));
        }
        let (host, port) = target
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("`{target}` is neither host:port nor an SRV name"))?;
        let ips = self
            .resolver
            .lookup_ip(host)
            .await
            .map_err(|e| e.to_string())?;
        Ok((
            ips.iter().map(|ip| SocketAddr::new(ip, port)).collect(),
            ips.valid_until(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use hickory_resolver::proto::op::{Message, MessageType, ResponseCode};
    use hickory_resolver::proto::rr::rdata::{A, SRV};
    use hickory_resolver::proto::rr::{Name, Record, RecordType};

    /// A real DNS server on loopback (UDP), answering from a table and counting the queries it
    /// gets; `fail` makes it answer SERVFAIL.
    struct TestDns {
        addr: SocketAddr,
        queries: Arc<AtomicUsize>,
        fail: Arc<std::sync::atomic::AtomicBool>,
    }

    impl TestDns {
        async fn start(ttl: u32) -> Self {
            let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let addr = socket.local_addr().unwrap();
            let queries = Arc::new(AtomicUsize::new(0));
            let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (q, f) = (queries.clone(), fail.clone());
            tokio::spawn(async move {
                let mut buf = [0u8; 1500];
                loop {
                    let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                        return;
                    };
                    let Ok(req) = Message::from_vec(&buf[..n]) else {
                        continue;
                    };
                    q.fetch_add(1, Ordering::SeqCst);
                    let mut resp =
                        Message::new(req.metadata.id, MessageType::Response, req.metadata.op_code);
                    resp.metadata.authoritative = true;
                    resp.metadata.recursion_desired = req.metadata.recursion_desired;
                    resp.metadata.recursion_available = true;
                    for query in &req.queries {
                        resp.add_query(query.clone());
                        if f.load(Ordering::SeqCst) {
                            resp.metadata.response_code = ResponseCode::ServFail;
                            continue;
                        }
                        let name = query.name().to_string();
                        match (query.query_type(), name.trim_end_matches('.')) {
                            (RecordType::A, "edge.montreal.test") => {
                                for last in [7, 8] {
                                    resp.add_answer(Record::from_rdata(
                                        query.name().clone(),
                                        ttl,
                                        RData::A(A(Ipv4Addr::new(127, 0, 0, last))),
                                    ));
                                }
                            }
                            (RecordType::SRV, "_cellmesh._tcp.montreal.test") => {
                                let target = Name::from_ascii("edge.montreal.test.").unwrap();
                                resp.add_answer(Record::from_rdata(
                                    query.name().clone(),
                                    ttl,
                                    RData::SRV(SRV::new(20, 0, 7400, target.clone())),
                                ));
                                resp.add_answer(Record::from_rdata(
                                    query.name().clone(),
                                    ttl,
                                    RData::SRV(SRV::new(10, 0, 7300, target)),
                                ));
                            }
                            _ => resp.metadata.response_code = ResponseCode::NXDomain,
                        }
                    }
                    let _ = socket.send_to(&resp.to_vec().unwrap(), from).await;
                }
            });
            Self {
                addr,
                queries,
                fail,
            }
        }

        fn queries(&self) -> usize {
            self.queries.load(Ordering::SeqCst)
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
    }

    #[tokio::test]
    async fn a_and_srv_names_resolve_and_are_kept_for_their_ttl() {
        let dns = TestDns::start(2).await;
        let d = Discovery::new(&[dns.addr.to_string()]).unwrap();
        let a = d.resolve("edge.montreal.test:7300").await.unwrap();
        assert_eq!(
            a,
            vec![SocketAddr::new(ip(7), 7300), SocketAddr::new(ip(8), 7300)]
        );
        let asked = dns.queries();
        assert!(asked >= 1);
        // Within the TTL: no query.
        assert_eq!(d.resolve("edge.montreal.test:7300").await.unwrap(), a);
        assert_eq!(dns.queries(), asked);
        // SRV: the lowest priority first, each target's addresses at its port.
        let srv = d.resolve("_cellmesh._tcp.montreal.test").await.unwrap();
        assert_eq!(
            srv,
            vec![
                SocketAddr::new(ip(7), 7300),
                SocketAddr::new(ip(8), 7300),
                SocketAddr::new(ip(7), 7400),
                SocketAddr::new(ip(8), 7400),
            ]
        );
        assert_eq!(
            d.first("_cellmesh._tcp.montreal.test").await.unwrap(),
            ("127.0.0.7".into(), 7300)
        );
        // Past the TTL the name is asked again.
        let before = dns.queries();
        tokio::time::sleep(Duration::from_millis(2_200)).await;
        d.resolve("edge.montreal.test:7300").await.unwrap();
        assert!(dns.queries() > before, "re-resolved after the TTL");
        // A literal address needs no DNS at all.
        let before = dns.queries();
        assert_eq!(
            d.resolve("10.0.0.1:7300").await.unwrap(),
            vec!["10.0.0.1:7300".parse().unwrap()]
        );
        assert_eq!(dns.queries(), before);
    }

    #[tokio::test]
    async fn a_failed_lookup_forgets_the_answer_and_the_next_use_asks_again() {
        let dns = TestDns::start(0).await;
        let d = Discovery::new(&[dns.addr.to_string()]).unwrap();
        d.resolve("edge.montreal.test:7300").await.unwrap();
        tokio::time::sleep(MIN_TTL + Duration::from_millis(100)).await;
        dns.fail.store(true, Ordering::SeqCst);
        let e = d.resolve("edge.montreal.test:7300").await.unwrap_err();
        assert!(e.contains("edge.montreal.test"), "{e}");
        dns.fail.store(false, Ordering::SeqCst);
        let before = dns.queries();
        assert_eq!(d.resolve("edge.montreal.test:7300").await.unwrap().len(), 2);
        assert!(dns.queries() > before);
        // Unknown names and bad forms are errors that name them.
        let e = d.resolve("nowhere.test:1").await.unwrap_err();
        assert!(e.contains("nowhere.test"), "{e}");
        let e = d.resolve("no-port.test").await.unwrap_err();
        assert!(e.contains("neither host:port nor an SRV name"), "{e}");
    }
}

/// The name a client checks the TLS certificate of `target`'s proxies against: the host of
/// `host:port` when it is a name, the domain of an SRV name (`_edge._tcp.us.example` ->
/// `us.example`); empty for a literal address (the certificate must carry it).
pub(crate) fn server_name_of(target: &str) -> String {
    if target.parse::<SocketAddr>().is_ok() {
        return String::new();
    }
    if target.starts_with('_') && !target.contains(':') {
        return target
            .split('.')
            .skip_while(|label| label.starts_with('_'))
            .collect::<Vec<_>>()
            .join(".");
    }
    target
        .rsplit_once(':')
        .map_or(target, |(host, _)| host)
        .to_string()
}

#[cfg(test)]
mod server_name_tests {
    use super::server_name_of;

    #[test]
    fn the_name_a_certificate_must_carry() {
        assert_eq!(server_name_of("us-proxy:7300"), "us-proxy");
        assert_eq!(server_name_of("_edge._tcp.us.example"), "us.example");
        assert_eq!(server_name_of("10.0.0.3:7300"), "");
        assert_eq!(server_name_of("[::1]:7300"), "");
    }
}
