//! Handover between two geos, over real sockets: a Paris proxy and gateway, a Montreal proxy and
//! gateway, each geo with its own directory and Redis-like board, and one global MongoDB for the
//! player records (the server `CELLMESH_TEST_MONGO_URL` names; `./scripts/test.sh` starts it).
//!
//! What is checked is what the issue asks of the mechanics: the client gets `Transfer` with a
//! signed cookie and the hint reaches the target geo; a login there uses the hint or the cookie
//! and the gateway skips its MongoDB read (counted); forged, expired, replayed, borrowed and
//! misdirected cookies are refused by reason and the login reads MongoDB; a lost hint, a lost
//! cookie, or both, still end in a login; and a single-geo network never asks for a cookie.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use cellmesh_proto::client::{self, ClientReceiver, ClientSender, Login};
use cellmesh_proto::codec::FrameCodec;
use cellmesh_proto::cookie::{self, HintCookie};
use cellmesh_proto::edge::{client_message, server_message, Pong, ServerFrame, Transfer, Welcome};
use cellmesh_proxy::{Boards, PeerGeo, ProxyConfig, ProxyHandle};
use cellmesh_sidecar::config::SidecarConfig;
use cellmesh_sidecar::SidecarHandle;
use cellmesh_stores::memory::{MemoryBoard, MemoryCheckpoints, MemoryDirectory};
use cellmesh_stores::mongo::MongoPlayers;
use cellmesh_stores::{EdgeBoard, PlayerRecords, Stores};
use cellmesh_test_support::{required, unique_name, unix_ms, unix_now, within, PATIENCE};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

const SECRET: &str = "geo-test-secret";

fn token(account: &str) -> String {
    cellmesh_proto::token::sign(SECRET.as_bytes(), account, unix_now() + 3600)
}

struct Geo {
    sidecar: SidecarHandle,
    proxy: ProxyHandle,
    board: Arc<dyn EdgeBoard>,
}

struct TwoGeos {
    paris: Geo,
    montreal: Geo,
    stop: CancellationToken,
}

impl Drop for TwoGeos {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn sidecar(
    node_id: u32,
    geo: &str,
    players: Arc<MongoPlayers>,
    stop: &CancellationToken,
) -> SidecarHandle {
    let cfg = SidecarConfig {
        node_id,
        geo: geo.into(),
        local_listen: "127.0.0.1:0".into(),
        mesh_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        ..SidecarConfig::default()
    };
    // Each geo its own directory; the player records are global.
    let stores = Stores {
        directory: Arc::new(MemoryDirectory::default()),
        players,
        checkpoints: Arc::new(MemoryCheckpoints::default()),
        claims: Arc::new(cellmesh_stores::claims::MemoryClaims::default()),
        core_copy: None,
        copies: Default::default(),
    };
    cellmesh_sidecar::start(cfg, stores, stop.clone())
        .await
        .expect("sidecar starts")
}

async fn proxy(
    geo: &str,
    gateway: &SidecarHandle,
    peers: Vec<PeerGeo>,
    boards: &Boards,
    stop: &CancellationToken,
) -> ProxyHandle {
    let mut cfg = ProxyConfig {
        name: format!("proxy-{geo}"),
        geo: geo.into(),
        client_listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        gateways: vec![gateway.mesh_addr.to_string()],
        token_secret: SECRET.into(),
        drain_grace_ms: 0,
        drain_spread_ms: 0,
        ..ProxyConfig::default()
    };
    cfg.geos.peers = peers;
    let handle = cellmesh_proxy::start_with(cfg, stop.clone(), Some(boards.clone()))
        .await
        .unwrap();
    within("the proxy is ready", async {
        while !handle.admin.is_ready() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    handle
}

fn peer(name: &str, proxies: String) -> PeerGeo {
    PeerGeo {
        name: name.into(),
        proxies,
        board: "memory".into(),
    }
}

async fn mongo_players(test: &str) -> Arc<MongoPlayers> {
    let base = required("CELLMESH_TEST_MONGO_URL");
    let db: String = unique_name(test).chars().take(60).collect();
    Arc::new(
        MongoPlayers::connect(&format!("{}/{db}", base.trim_end_matches('/')))
            .await
            .unwrap(),
    )
}

async fn two_geos(test: &str) -> TwoGeos {
    two_geos_with(mongo_players(test).await).await
}

async fn two_geos_with(players: Arc<MongoPlayers>) -> TwoGeos {
    let stop = CancellationToken::new();
    let boards = Boards {
        by_geo: HashMap::from([
            (
                "paris".to_string(),
                Arc::new(MemoryBoard::default()) as Arc<dyn EdgeBoard>,
            ),
            (
                "montreal".to_string(),
                Arc::new(MemoryBoard::default()) as Arc<dyn EdgeBoard>,
            ),
        ]),
    };
    let (sp, sm) = (
        sidecar(1, "paris", players.clone(), &stop).await,
        sidecar(2, "montreal", players, &stop).await,
    );
    // Montreal first, so that Paris can name it; Paris is never handed to in these tests.
    let pm = proxy(
        "montreal",
        &sm,
        vec![peer("paris", "127.0.0.1:1".into())],
        &boards,
        &stop,
    )
    .await;
    let pp = proxy(
        "paris",
        &sp,
        vec![peer("montreal", pm.client_addr.to_string())],
        &boards,
        &stop,
    )
    .await;
    TwoGeos {
        paris: Geo {
            sidecar: sp,
            proxy: pp,
            board: boards.by_geo["paris"].clone(),
        },
        montreal: Geo {
            sidecar: sm,
            proxy: pm,
            board: boards.by_geo["montreal"].clone(),
        },
        stop,
    }
}

struct Client {
    tx: ClientSender,
    rx: ClientReceiver,
    welcome: Welcome,
}

impl Client {
    async fn login(proxy: &ProxyHandle, login: &Login) -> Self {
        let (tx, rx, welcome) = within(
            "login",
            client::login_with(&proxy.client_addr.to_string(), login),
        )
        .await
        .unwrap();
        Self { tx, rx, welcome }
    }

    /// Reads (answering pings) until the `Transfer`; the proxy closes after it.
    async fn transfer(&mut self) -> Transfer {
        within("a Transfer", async {
            loop {
                let m = self.rx.next().await.expect("closed before a Transfer");
                match m.unwrap().body {
                    Some(server_message::Body::Transfer(t)) => return t,
                    Some(server_message::Body::Ping(p)) => {
                        let _ = self
                            .tx
                            .send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                            .await;
                    }
                    Some(server_message::Body::Kick(k)) => panic!("kicked: {k:?}"),
                    _ => {}
                }
            }
        })
        .await
    }
}

/// A sample of an admin's metrics page (0 when the series has no sample yet).
async fn metric(admin: std::net::SocketAddr, sample: &str) -> f64 {
    let page = cellmesh_admin::http_get(admin, "/metrics").await.unwrap().1;
    page.lines()
        .find_map(|l| l.strip_prefix(&format!("{sample} ")))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

async fn proxy_metric(p: &ProxyHandle, sample: &str) -> f64 {
    metric(p.admin_addr, &format!("cellmesh_proxy_{sample}")).await
}

async fn reads(g: &Geo) -> f64 {
    metric(
        g.sidecar.admin_addr,
        "cellmesh_sidecar_login_record_reads_total",
    )
    .await
}

/// The hint pinned for alice in Montreal is lost (Redis flushed, a failover...).
async fn lose_the_hint(geos: &TwoGeos) {
    let taken = geos.montreal.board.take_hint("alice").await.unwrap();
    assert!(taken.is_some(), "a hint was pinned");
}

/// Alice plays in Paris (a few sessions there first, so that her Paris epoch is well above
/// anything Montreal's own directory would hand out) and is handed over to Montreal: the
/// Transfer she gets and her Paris session's epoch.
async fn hand_alice_over(geos: &TwoGeos) -> (Transfer, u64) {
    for _ in 0..3 {
        drop(Client::login(&geos.paris.proxy, &Login::token(&token("alice"))).await);
    }
    let mut alice = Client::login(&geos.paris.proxy, &Login::token(&token("alice"))).await;
    let epoch = alice.welcome.session_epoch;
    geos.paris
        .proxy
        .hand_over("alice", "montreal")
        .await
        .unwrap();
    let t = alice.transfer().await;
    (t, epoch)
}

#[tokio::test]
async fn a_handed_over_login_uses_the_hint_and_skips_the_mongodb_read() {
    let geos = two_geos("hint").await;
    let (t, paris_epoch) = hand_alice_over(&geos).await;
    assert_eq!(t.geo, "montreal");
    assert_eq!(
        format!("{}:{}", t.host, t.port),
        geos.montreal.proxy.client_addr.to_string()
    );
    assert!(!t.cookie.is_empty());
    assert_eq!(geos.paris.proxy.stats().handovers, 1);
    // Counted and recorded with its cause: asked for by hand.
    assert_eq!(
        proxy_metric(
            &geos.paris.proxy,
            "handovers_total{geo=\"montreal\",because=\"operator\"}"
        )
        .await,
        1.0
    );
    let log = geos.paris.proxy.take_handovers();
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(
        (
            log[0].account.as_str(),
            log[0].to_geo.as_str(),
            log[0].because
        ),
        ("alice", "montreal", cellmesh_proxy::HandoverCause::Operator)
    );
    assert!(geos.paris.proxy.take_handovers().is_empty(), "taken once");
    // The cookie is what it says: for alice, to Montreal, above her Paris session.
    let c = cookie::open(
        SECRET.as_bytes(),
        &t.cookie,
        "alice",
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        unix_ms(),
    )
    .unwrap();
    assert_eq!(
        (c.target_geo.as_str(), c.session_epoch),
        ("montreal", paris_epoch)
    );

    // She reconnects there without offering the cookie: the geo's Redis has the hint.
    let before = reads(&geos.montreal).await;
    let alice = Client::login(&geos.montreal.proxy, &Login::token(&token("alice"))).await;
    assert!(alice.welcome.session_epoch > paris_epoch);
    assert_eq!(reads(&geos.montreal).await, before, "no MongoDB read");
    let stats = geos.montreal.proxy.stats();
    assert_eq!((stats.hint_hits, stats.cookie_hits), (1, 0));
    assert_eq!(
        stats.cookie_requests, 0,
        "the hint saved the round trip too"
    );
    // The hint is used once: another login reads MongoDB.
    drop(alice);
    let _again = Client::login(&geos.montreal.proxy, &Login::token(&token("alice"))).await;
    assert_eq!(reads(&geos.montreal).await, before + 1.0);
}

#[tokio::test]
async fn with_the_hint_lost_the_cookie_does_the_same_offered_or_asked_for() {
    let geos = two_geos("cookie").await;
    for offer_cookie in [true, false] {
        let (t, paris_epoch) = hand_alice_over(&geos).await;
        lose_the_hint(&geos).await;
        let before = reads(&geos.montreal).await;
        let requests = geos.montreal.proxy.stats().cookie_requests;
        let login = Login {
            token: token("alice"),
            tls: None,
            server_name: String::new(),
            cookie: t.cookie.to_vec(),
            offer_cookie,
        };
        let alice = Client::login(&geos.montreal.proxy, &login).await;
        assert!(alice.welcome.session_epoch > paris_epoch);
        assert_eq!(reads(&geos.montreal).await, before, "no MongoDB read");
        assert_eq!(
            geos.montreal.proxy.stats().cookie_requests - requests,
            u64::from(!offer_cookie),
            "asked for the cookie only when it was not offered"
        );
        drop(alice);
        // Back to Paris for the next round.
        let _ = Client::login(&geos.paris.proxy, &Login::token(&token("alice"))).await;
    }
    assert_eq!(geos.montreal.proxy.stats().cookie_hits, 2);
}

#[tokio::test]
async fn with_hint_and_cookie_lost_the_login_reads_mongodb_and_goes_above_the_old_epoch() {
    let players = mongo_players("both").await;
    let geos = two_geos_with(players.clone()).await;
    let (_, paris_epoch) = hand_alice_over(&geos).await;
    lose_the_hint(&geos).await;
    // The record Paris saves as the session ends carries its epoch and the handover.
    let record = within("Paris saves the record", async {
        loop {
            if let Some(r) = players.load("alice").await.unwrap() {
                if r.last_handover_unix_ms.is_some() {
                    return r;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(
        (record.session_epoch, record.gateway_geo.as_str()),
        (paris_epoch, "paris")
    );
    let before = reads(&geos.montreal).await;
    let alice = Client::login(&geos.montreal.proxy, &Login::token(&token("alice"))).await;
    assert_eq!(reads(&geos.montreal).await, before + 1.0);
    // Montreal's directory never saw alice: only the record puts the new epoch above Paris's.
    assert!(alice.welcome.session_epoch > paris_epoch);
    let stats = geos.montreal.proxy.stats();
    assert_eq!((stats.hint_hits, stats.cookie_hits), (0, 0));
    assert!(stats.cookie_requests >= 1);
}

#[tokio::test]
async fn bad_cookies_are_refused_by_reason_and_the_login_reads_mongodb() {
    let geos = two_geos("bad").await;
    let good = HintCookie {
        nonce: [1; 16],
        issued_unix_ms: unix_ms(),
        target_geo: "montreal".into(),
        gateway_node: 1,
        account: "alice".into(),
        session_epoch: 42,
        last_position: Some([10.0, 20.0, 0.0]),
    };
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let seal =
        |secret: &str, c: &HintCookie, ip: IpAddr| cookie::seal(secret.as_bytes(), c, ip).unwrap();
    let cases = [
        // Sealed under a key the proxies do not hold: named by its kid.
        ("unknown_cookie_kid", seal("guessed", &good, loopback)),
        (
            "expired_cookie",
            seal(
                SECRET,
                &HintCookie {
                    issued_unix_ms: unix_ms() - 61_000,
                    ..good.clone()
                },
                loopback,
            ),
        ),
        // Replayed from another address: the MAC covers the address it was issued to.
        (
            "bad_cookie_signature",
            seal(SECRET, &good, "203.0.113.7".parse().unwrap()),
        ),
        (
            "cookie_wrong_account",
            seal(
                SECRET,
                &HintCookie {
                    account: "bob".into(),
                    ..good.clone()
                },
                loopback,
            ),
        ),
        (
            "cookie_wrong_geo",
            seal(
                SECRET,
                &HintCookie {
                    target_geo: "paris".into(),
                    ..good.clone()
                },
                loopback,
            ),
        ),
        ("malformed_cookie", b"\x03not a cookie".to_vec()),
    ];
    for (i, (kind, bad)) in cases.into_iter().enumerate() {
        let before = reads(&geos.montreal).await;
        let refused = proxy_metric(
            &geos.montreal.proxy,
            &format!("login_hints_refused_total{{kind=\"{kind}\"}}"),
        )
        .await;
        let login = Login {
            token: token("alice"),
            tls: None,
            server_name: String::new(),
            cookie: bad,
            offer_cookie: i % 2 == 0,
        };
        let alice = Client::login(&geos.montreal.proxy, &login).await;
        assert_eq!(alice.welcome.account, "alice");
        assert_eq!(
            reads(&geos.montreal).await,
            before + 1.0,
            "{kind}: read MongoDB"
        );
        assert_eq!(
            proxy_metric(
                &geos.montreal.proxy,
                &format!("login_hints_refused_total{{kind=\"{kind}\"}}"),
            )
            .await,
            refused + 1.0,
            "{kind}"
        );
    }
    // And the good one saves the read.
    let before = reads(&geos.montreal).await;
    let login = Login {
        token: token("alice"),
        tls: None,
        server_name: String::new(),
        cookie: seal(SECRET, &good, loopback),
        offer_cookie: true,
    };
    let alice = Client::login(&geos.montreal.proxy, &login).await;
    assert!(alice.welcome.session_epoch > 42);
    assert_eq!(reads(&geos.montreal).await, before);
}

/// A cookie is honoured once in its geo: the hint pinned with it shares its nonce, so once the
/// hint served a login, the cookie shown again (by the client, or by whoever copied it within
/// its minute) is refused and the login reads MongoDB. Before, it passed for 60 s, and each use
/// replaced the player record with the position it carried.
#[tokio::test]
async fn a_cookie_used_twice_is_refused_the_second_time() {
    let geos = two_geos("twice").await;
    let (t, _) = hand_alice_over(&geos).await;
    let first = Client::login(&geos.montreal.proxy, &Login::token(&token("alice"))).await;
    assert_eq!(geos.montreal.proxy.stats().hint_hits, 1);
    drop(first);
    let replayed = "login_hints_refused_total{kind=\"cookie_replayed\"}";
    assert_eq!(proxy_metric(&geos.montreal.proxy, replayed).await, 0.0);
    let before = reads(&geos.montreal).await;
    let again = Login {
        token: token("alice"),
        tls: None,
        server_name: String::new(),
        cookie: t.cookie.to_vec(),
        offer_cookie: true,
    };
    let _alice = Client::login(&geos.montreal.proxy, &again).await;
    assert_eq!(reads(&geos.montreal).await, before + 1.0, "read MongoDB");
    assert_eq!(geos.montreal.proxy.stats().cookie_hits, 0);
    assert_eq!(proxy_metric(&geos.montreal.proxy, replayed).await, 1.0);
}

/// Relays one connection, keeping every byte the proxy sent.
async fn recording_relay(
    to: std::net::SocketAddr,
) -> (String, tokio::sync::oneshot::Receiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (done, recorded) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = TcpStream::connect(to).await.unwrap();
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let up = tokio::spawn(async move {
            let _ = tokio::io::copy(&mut cr, &mut sw).await;
            let _ = sw.shutdown().await;
        });
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        up.abort();
        let _ = done.send(seen);
    });
    (addr, recorded)
}

/// The kinds of every message the proxy at `addr` sends a client that logs in as `login` and
/// says bye, read off the wire.
async fn captured(addr: std::net::SocketAddr, login: &Login) -> Vec<&'static str> {
    let (relay, recorded) = recording_relay(addr).await;
    let (mut tx, rx, _) = within("login", client::login_with(&relay, login))
        .await
        .unwrap();
    tx.send(client_message::Body::Bye(Default::default()))
        .await
        .unwrap();
    drop((tx, rx));
    let bytes = within("the relay ends", recorded).await.unwrap();
    let mut frames = FramedRead::new(&bytes[..], FrameCodec::<ServerFrame>::default());
    let mut kinds = Vec::new();
    while let Some(f) = frames.next().await {
        for m in f.unwrap().messages {
            kinds.push(match m.body.unwrap() {
                server_message::Body::Welcome(_) => "welcome",
                server_message::Body::CookieRequest(_) => "cookie_request",
                server_message::Body::Probe(_) => "probe",
                _ => "other",
            });
        }
    }
    kinds
}

#[tokio::test]
async fn a_single_geo_network_never_asks_for_a_cookie() {
    let stop = CancellationToken::new();
    let players = mongo_players("single").await;
    let s = sidecar(1, "paris", players, &stop).await;
    let boards = Boards {
        by_geo: HashMap::new(),
    };
    let p = proxy("paris", &s, Vec::new(), &boards, &stop).await;
    // Even a client that holds a cookie gets no request, and its cookie is not used.
    let login = Login {
        token: token("alice"),
        tls: None,
        server_name: String::new(),
        cookie: b"anything".to_vec(),
        offer_cookie: false,
    };
    let kinds = captured(p.client_addr, &login).await;
    assert!(kinds.contains(&"welcome"), "{kinds:?}");
    assert!(!kinds.contains(&"cookie_request"), "{kinds:?}");
    assert!(
        !kinds.contains(&"probe"),
        "no other geo to probe: {kinds:?}"
    );
    assert_eq!(p.stats().cookie_requests, 0);
    // The capture does see one where a login does ask: a geo among two, with no hint.
    let geos = two_geos("single_contrast").await;
    let kinds = captured(geos.montreal.proxy.client_addr, &login).await;
    assert!(kinds.contains(&"cookie_request"), "{kinds:?}");
    stop.cancel();
    let _ = tokio::time::timeout(PATIENCE, p.wait()).await;
}

/// The `ProbeRequest` a client of `proxy` gets after its `Welcome`.
async fn probe_request(c: &mut Client) -> cellmesh_proto::edge::ProbeRequest {
    within("a ProbeRequest", async {
        loop {
            match c.rx.next().await.expect("closed").unwrap().body {
                Some(server_message::Body::Probe(p)) => return p,
                Some(server_message::Body::Ping(p)) => {
                    let _ =
                        c.tx.send(client_message::Body::Pong(Pong { nonce: p.nonce }))
                            .await;
                }
                _ => {}
            }
        }
    })
    .await
}

#[tokio::test]
async fn the_far_proxy_measures_the_probe_itself_and_a_delayed_pong_does_not_move_its_figure() {
    let geos = two_geos("probe").await;
    for (account, delay_ms) in [("honest", 0u64), ("cheat", 90)] {
        let mut c = Client::login(&geos.paris.proxy, &Login::token(&token(account))).await;
        let req = probe_request(&mut c).await;
        assert_eq!(req.targets.len(), 1);
        let target = &req.targets[0];
        assert_eq!(target.geo, "montreal");
        assert_eq!(
            format!("{}:{}", target.host, target.port),
            geos.montreal.proxy.client_addr.to_string()
        );
        // The client answers the Montreal proxy's pings; a cheat delays every pong by 90 ms,
        // from the very first one, hoping to look far from Montreal.
        let last = within(
            "the probe",
            client::answer_probe(target, Duration::from_millis(delay_ms), None),
        )
        .await
        .unwrap();
        assert_eq!(
            last.reason,
            cellmesh_proto::edge::KickReason::ProbeDone as i32,
            "{last:?}"
        );
        // Montreal published onto Paris's board what it measured: the kernel's figure, which
        // the client's game cannot delay (loopback: well under a millisecond), while the pings
        // it timed show the delay.
        let far = geos.paris.board.far_rtts(account).await.unwrap();
        assert_eq!(far.len(), 1, "{far:?}");
        let (geo, rtt) = &far[0];
        assert_eq!(geo, "montreal");
        assert!(rtt.kernel, "{rtt:?}");
        assert_eq!(rtt.samples, 5);
        assert!(rtt.min_ms < 20.0, "{account}: {rtt:?}");
        if delay_ms > 0 {
            assert!(rtt.median_ms >= 90.0, "the pings saw the delay: {rtt:?}");
        }
    }
    assert_eq!(geos.montreal.proxy.stats().probes_served, 2);
}

#[tokio::test]
async fn a_probe_ticket_is_refused_from_another_address_or_forged() {
    let geos = two_geos("ticket").await;
    let mut c = Client::login(&geos.paris.proxy, &Login::token(&token("alice"))).await;
    let mut target = probe_request(&mut c).await.targets.remove(0);
    // Sealed for this client's address: presented from another (a relay of the ticket to a
    // host nearer Montreal), the MAC does not match. Forge one bit to play that out.
    let last = target.ticket.len() - 1;
    let mut forged = target.ticket.to_vec();
    forged[last] ^= 1;
    target.ticket = forged.into();
    let k = within(
        "the refused probe",
        client::answer_probe(&target, Duration::ZERO, None),
    )
    .await
    .unwrap();
    assert_eq!(k.reason, cellmesh_proto::edge::KickReason::ProbeDone as i32);
    assert!(k.detail.contains("refused"), "{k:?}");
    assert!(geos.paris.board.far_rtts("alice").await.unwrap().is_empty());
    assert_eq!(
        proxy_metric(
            &geos.montreal.proxy,
            "probes_refused_total{reason=\"bad_ticket\"}"
        )
        .await,
        1.0
    );
}

/// What a client sends while its login waits for its cookie is kept to be relayed, up to a cap:
/// a client that floods the wait is held to it, the excess dropped and counted, and its login
/// carries on.
#[tokio::test]
async fn a_client_flooding_the_cookie_wait_is_held_to_a_cap() {
    let geos = two_geos("cookie_wait_cap").await;
    let addr = geos.montreal.proxy.client_addr.to_string();
    let (mut tx, mut rx) = client::open(&addr).await.unwrap();
    let nonce = client::challenge(&mut tx, &mut rx).await.unwrap();
    let hello = client::login_hello(&token("flooder"), &nonce).unwrap();
    tx.send(client_message::Body::Hello(Box::new(hello)))
        .await
        .unwrap();
    within("the cookie request", async {
        loop {
            match rx.next().await.expect("closed").unwrap().body {
                Some(server_message::Body::CookieRequest(_)) => return,
                Some(server_message::Body::Kick(k)) => panic!("kicked: {k:?}"),
                _ => {}
            }
        }
    })
    .await;
    let sent = 200u64;
    for seq in 1..=sent {
        tx.input(seq, bytes::Bytes::from_static(b"flood"))
            .await
            .unwrap();
    }
    tx.send(client_message::Body::Cookie(Default::default()))
        .await
        .unwrap();
    within("the welcome", async {
        loop {
            match rx.next().await.expect("closed").unwrap().body {
                Some(server_message::Body::Welcome(w)) => return assert_eq!(w.account, "flooder"),
                Some(server_message::Body::Kick(k)) => panic!("kicked: {k:?}"),
                _ => {}
            }
        }
    })
    .await;
    let kept = cellmesh_proxy::WAITING_MAX_MESSAGES as u64;
    assert_eq!(
        proxy_metric(
            &geos.montreal.proxy,
            "inputs_dropped_total{limit=\"waiting\"}"
        )
        .await,
        (sent - kept) as f64
    );
}
