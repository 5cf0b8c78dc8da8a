//! The proxy's admin surface: readiness, Prometheus metrics and the state view.

mod support;

use cellmesh_admin::http_get;
use cellmesh_proxy::ProxyConfig;
use support::*;

#[tokio::test]
async fn ready_metrics_and_state() {
    let gw = Gateway::start(3).await;
    let proxy = TestProxy::start(config(&[&gw])).await;
    let admin = proxy.handle.admin_addr;
    assert_eq!(http_get(admin, "/live").await.unwrap().0, 200);
    assert_eq!(http_get(admin, "/ready").await.unwrap().0, 200);

    let mut alice = proxy.login("alice").await;
    alice.echo(1).await;
    let mut bad = RawClient::connect(&proxy.addr()).await;
    bad.write(&[0xff, 0xff, 0xff, 0xff]).await;
    bad.kick().await;

    let (status, metrics) = http_get(admin, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    let link = format!("cellmesh_proxy_link_up{{gateway=\"{}\"}} 1", gw.addr);
    for needle in [
        "# TYPE cellmesh_proxy_connections gauge",
        "cellmesh_proxy_connections_accepted_total",
        "cellmesh_proxy_frames_total{peer=\"client\",direction=\"in\"}",
        "cellmesh_proxy_frames_total{peer=\"client\",direction=\"out\"}",
        "cellmesh_proxy_bytes_total{peer=\"gateway\",direction=\"out\"}",
        "cellmesh_proxy_errors_total{kind=\"frame_too_large\"} 1",
        "cellmesh_proxy_sessions 1",
        "cellmesh_proxy_inputs_accepted_total 1",
        "cellmesh_proxy_inputs_dropped_total{limit=\"account\"} 0",
        "cellmesh_proxy_kicks_total{reason=\"MALFORMED\"} 1",
        "cellmesh_proxy_rtt_seconds_bucket{le=\"0.001\"}",
        "# TYPE cellmesh_proxy_rtt_seconds histogram",
        "# TYPE cellmesh_proxy_connections_accepted_total counter",
        &link,
    ] {
        assert!(metrics.contains(needle), "missing {needle:?} in\n{metrics}");
    }

    let (status, body) = http_get(admin, "/state").await.unwrap();
    assert_eq!(status, 200);
    assert!(
        !body.contains(SECRET),
        "the token secret must never be shown"
    );
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(state["proxy"]["name"], "proxy-test");
    assert_eq!(state["proxy"]["client_addr"], proxy.addr());
    assert_eq!(state["ready"], true);
    let link = &state["links"][0];
    assert_eq!(link["gateway"], gw.addr.to_string());
    assert_eq!(link["state"], "up");
    assert_eq!(link["peer"]["node_id"], 3);
    assert_eq!(link["sessions"], 1);
    let session = &state["sessions"][0];
    assert_eq!(session["account"], "alice");
    assert_eq!(session["session_id"], alice.welcome.session_id);
    assert_eq!(session["gateway"], gw.addr.to_string());
    assert_eq!(session["inputs_accepted"], 1);
    assert_eq!(state["stats"]["sessions"], 1);
}

#[tokio::test]
async fn with_an_admin_token_the_state_needs_it_and_shows_it_masked() {
    let gw = Gateway::start(3).await;
    let proxy = TestProxy::start(ProxyConfig {
        admin_token: "ops-token".into(),
        ..config(&[&gw])
    })
    .await;
    let admin = proxy.handle.admin_addr;
    let _alice = proxy.login("alice").await;
    // The probes and the scraper need no token.
    assert_eq!(http_get(admin, "/live").await.unwrap().0, 200);
    assert_eq!(http_get(admin, "/ready").await.unwrap().0, 200);
    assert_eq!(http_get(admin, "/metrics").await.unwrap().0, 200);
    // The state, which lists every account with its address, does.
    let r = cellmesh_admin::http_get_with(admin, "/state", &[])
        .await
        .unwrap();
    assert_eq!(r.status, 401, "{}", r.body);
    assert!(r.header("www-authenticate").is_some(), "{:?}", r.headers);
    assert!(!r.body.contains("alice"));
    let (status, body) = cellmesh_admin::http_get_token(admin, "/state", "wrong")
        .await
        .unwrap();
    assert_eq!(status, 401);
    assert!(!body.contains("alice"));
    let (status, body) = cellmesh_admin::http_get_token(admin, "/state", "ops-token")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("alice"));
    assert!(
        !body.contains("ops-token"),
        "the admin token is shown: {body}"
    );
    let state: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(state["proxy"]["admin_token"], "***");
    let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
    for reason in ["missing_token", "wrong_token"] {
        let line = format!("cellmesh_admin_requests_refused_total{{reason=\"{reason}\"}} 1");
        assert!(metrics.contains(&line), "missing {line} in\n{metrics}");
    }
}
