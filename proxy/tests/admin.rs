//! The proxy's admin surface: readiness, Prometheus metrics and the state view.

mod support;

use cellmesh_admin::http_get;
use support::*;

#[tokio::test]
async fn ready_metrics_and_state() {
    let gw = TestGateway::start(3).await;
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
