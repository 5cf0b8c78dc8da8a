//! Admission: a gateway that says it admits no new session gets none; when every gateway up says
//! so, a login is refused `SERVER_FULL` with the retry hint, and the sessions already attached go
//! on as before.

mod support;

use std::time::Duration;

use cellmesh_admin::http_get;
use cellmesh_proto::client::ClientError;
use cellmesh_proto::edge::KickReason;
use support::*;

async fn metrics(proxy: &TestProxy) -> String {
    let (status, body) = http_get(proxy.handle.admin_addr, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    body
}

/// Polls until the proxy counts `n` gateways closed.
async fn wait_closed(proxy: &TestProxy, n: u64) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while proxy.handle.stats().gateways_closed != n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gateways closed stayed at {}",
            proxy.handle.stats().gateways_closed
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn with_every_gateway_closed_a_login_is_refused_server_full_and_attached_sessions_go_on() {
    let gw = TestGateway::start(3).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut admitted = proxy.login("alice").await;
    admitted.echo(1).await;

    gw.close_admission("tick_overrun", 4000);
    wait_closed(&proxy, 1).await;
    let refused = TestClient::login(&proxy.addr(), &token("bob")).await;
    let Err(ClientError::Kicked(k)) = refused else {
        panic!("a login while every gateway is full must be kicked");
    };
    assert_eq!(reason(&k), KickReason::ServerFull);
    assert_eq!(k.retry_after_ms, 4000);
    assert!(
        k.detail.contains("node 3: tick_overrun"),
        "the detail says who is full and why: {}",
        k.detail
    );
    // The gateway never heard of the refused login; the admitted session is untouched.
    assert!(gw.received().iter().all(|b| !matches!(
        b,
        cellmesh_proto::mesh::mesh_message::Body::Attach(a) if a.account == "bob"
    )));
    for seq in 2..=4 {
        admitted.echo(seq).await;
    }
    let stats = proxy.handle.stats();
    assert_eq!((stats.logins_refused, stats.sessions), (1, 1), "{stats:?}");
    let text = metrics(&proxy).await;
    for needle in [
        "cellmesh_proxy_logins_refused_total{reason=\"server_full\"} 1",
        "cellmesh_proxy_gateways_closed 1",
        "cellmesh_proxy_kicks_total{reason=\"SERVER_FULL\"} 1",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    let (_, state) = http_get(proxy.handle.admin_addr, "/state").await.unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(
        state["links"][0]["admission"],
        serde_json::json!({"open": false, "reason": "tick_overrun", "retry_after_ms": 4000})
    );

    // Open again: the next login gets in.
    gw.open_admission();
    wait_closed(&proxy, 0).await;
    let mut later = proxy.login("bob").await;
    later.echo(1).await;
    admitted.echo(5).await;
}

#[tokio::test]
async fn with_one_of_two_gateways_closed_logins_go_to_the_open_one() {
    let (a, b) = (TestGateway::start(1).await, TestGateway::start(2).await);
    let proxy = TestProxy::start(config(&[&a, &b])).await;
    // Both links up before anyone logs in, so round-robin could pick either.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while a.hellos().is_empty() || b.hellos().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "links not up");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.close_admission("outbox_pressure", 5000);
    wait_closed(&proxy, 1).await;
    for i in 0..6 {
        let mut c = proxy.login(&format!("player-{i}")).await;
        assert_eq!(
            c.welcome.gateway_node, 2,
            "login {i} went to the closed one"
        );
        c.echo(1).await;
    }
    assert_eq!(proxy.handle.stats().logins_refused, 0);

    // Closed too, until a link reconnects: a fresh connection hears the gateway is closed as the
    // link comes up, and stays closed.
    b.close_admission("tick_overrun", 3000);
    wait_closed(&proxy, 2).await;
    b.drop_links();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while b.hellos().len() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "link not redialled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_closed(&proxy, 2).await;
    let Err(ClientError::Kicked(k)) = TestClient::login(&proxy.addr(), &token("late")).await else {
        panic!("every gateway is full: the login must be refused");
    };
    assert_eq!(reason(&k), KickReason::ServerFull);
    assert_eq!(k.retry_after_ms, 3000, "the soonest hint of the two");
    assert!(
        k.detail.contains("node 1: outbox_pressure") && k.detail.contains("node 2: tick_overrun"),
        "{}",
        k.detail
    );
}

#[tokio::test]
async fn an_attach_the_gateway_refuses_is_a_server_full_kick_with_its_hint() {
    let gw = TestGateway::start(4).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let mut admitted = proxy.login("alice").await;
    // The gateway closed, and the proxy has not heard: its attach answer says so.
    gw.refuse_attaches(
        "the server is full: node 4 admits no new session (login_burst)",
        1000,
    );
    let Err(ClientError::Kicked(k)) = TestClient::login(&proxy.addr(), &token("bob")).await else {
        panic!("a refused attach must end the login");
    };
    assert_eq!(reason(&k), KickReason::ServerFull);
    assert_eq!(k.retry_after_ms, 1000);
    assert!(k.detail.contains("login_burst"), "{}", k.detail);
    assert_eq!(proxy.handle.stats().logins_refused, 1);
    admitted.echo(1).await;
}
