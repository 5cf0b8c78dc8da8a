//! The board executor: runs the core's requests to the geos' boards (Redis) and DNS, each
//! bounded by the geos' own timeouts, and turns the results into the core's answers.

use crate::core::{BoardReply, BoardRequest};
use crate::geo::{now_unix_ms, Geos};
use crate::metrics::Metrics;

pub(crate) async fn execute(geos: &Geos, request: BoardRequest, metrics: &Metrics) -> BoardReply {
    match request {
        BoardRequest::TakeHint { account, ip } => {
            BoardReply::Hint(geos.take_hint(&account, ip, metrics).await)
        }
        BoardRequest::OpenCookie {
            cookie,
            account,
            ip,
        } => BoardReply::Cookie(
            geos.open_once(&cookie, &account, ip, now_unix_ms(), metrics)
                .await,
        ),
        BoardRequest::ProbeTargets { account, ip } => {
            BoardReply::ProbeTargets(geos.probe_targets(&account, ip, metrics).await)
        }
        BoardRequest::Transfer { geo, hint, ip, .. } => {
            BoardReply::Transfer(geos.transfer(&geo, hint, ip, metrics).await)
        }
        BoardRequest::PublishFarRtt {
            origin,
            account,
            rtt,
        } => BoardReply::Published(geos.publish_far_rtt(&origin, &account, rtt).await),
        BoardRequest::FarRtts { account } => BoardReply::FarRtts(geos.far_rtts(&account).await),
    }
}
