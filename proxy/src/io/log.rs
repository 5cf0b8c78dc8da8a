//! The log lines of the core's events.

use crate::core::Event;

/// The log line of `event`, at the level each event has always had.
pub(crate) fn log(event: &Event) {
    match event {
        Event::CookieRefused {
            account,
            peer,
            kind,
        } => {
            tracing::debug!(%account, %peer, %kind, "handover cookie refused; the gateway reads the player record")
        }
        Event::ProbePublishFailed {
            origin,
            account,
            error,
        } => tracing::warn!(%origin, %account, %error, "publishing a probe's RTT failed"),
        Event::ProbeRefused { peer, why } => {
            tracing::debug!(%peer, %why, "probe ticket refused")
        }
        Event::LoginRefusedFull {
            account,
            peer,
            retry_after_ms,
        } => {
            tracing::debug!(%account, %peer, retry_after_ms, "login refused: every gateway is full")
        }
        Event::SessionAttached {
            account,
            session,
            gateway,
            peer,
        } => tracing::debug!(%account, session, %gateway, %peer, "session attached"),
        Event::SessionMoving { account, why } => tracing::info!(
            %account,
            %why,
            "gateway link lost: moving the session to another gateway"
        ),
        Event::HandingOver {
            account,
            geo,
            because,
        } => tracing::info!(%account, %geo, ?because, "handing the session over"),
        Event::HandoverFailed { account, error } => {
            tracing::warn!(%account, %error, "handover failed")
        }
        Event::ClientTransferred {
            peer,
            geo,
            host,
            port,
        } => tracing::debug!(%peer, %geo, %host, port, "client handed over"),
        Event::ClientLeft { peer, why } => tracing::debug!(%peer, "client left: {why}"),
        Event::ClientKicked {
            peer,
            reason,
            detail,
        } => tracing::debug!(%peer, %reason, %detail, "client kicked"),
        Event::DrainStarted {
            grace_ms,
            spread_ms,
        } => tracing::info!(
            grace_ms,
            spread_ms,
            "proxy draining; a second signal stops at once"
        ),
        Event::DrainKicking { clients } => {
            tracing::info!(clients, "asking clients to reconnect elsewhere")
        }
        Event::LinkLost {
            gateway,
            sessions,
            error,
        } => tracing::warn!(%gateway, sessions, %error, "mesh link lost"),
        Event::FallbackInUse {
            primaries_down,
            gateway,
        } => tracing::warn!(
            primaries_down,
            %gateway,
            "no gateway of this geo is up: sessions go to the fallback gateways"
        ),
        Event::ReturningHome { sessions } => tracing::info!(
            sessions,
            "a gateway of this geo is back: the sessions on fallback gateways move home"
        ),
        Event::GatewayAdmission {
            gateway,
            closed: Some(reason),
        } => tracing::warn!(%gateway, %reason, "gateway admits no new session"),
        Event::GatewayAdmission {
            gateway,
            closed: None,
        } => tracing::info!(%gateway, "gateway admits new sessions again"),
        Event::UnexpectedMessage { gateway, what } => {
            tracing::warn!(%gateway, "unexpected message on mesh link: {what}")
        }
    }
}
