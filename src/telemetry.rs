//! The process's log and, when an endpoint is configured, its spans exported over OTLP.
//!
//! Logs go to stderr as before, filtered by `RUST_LOG`. Spans (the `login` of a client in the
//! proxy, the `handoff` of an entity and the cross-node `entity_command` in the sidecar, all under
//! the target [`SPANS_TARGET`]) are exported only when one of the standard variables names an
//! OTLP/HTTP endpoint; without one no exporter is built and these spans are disabled, at the cost
//! of a disabled span:
//!
//! - `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: the URL the spans are posted to, as it is; or
//!   `OTEL_EXPORTER_OTLP_ENDPOINT`: the collector's base URL, to which `/v1/traces` is added.
//!   Protobuf over plain `http://` (a collector beside the process); `https://` is refused.
//! - `OTEL_SERVICE_NAME`: the service the spans are from (default `cellmesh-<command>`:
//!   `cellmesh-sidecar`, `cellmesh-proxy`, `cellmesh-director`, …).
//! - `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`: nothing exported all the same.
//! - What the OpenTelemetry SDK reads besides: `OTEL_BSP_SCHEDULE_DELAY` and the other batching
//!   variables, `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS` and `..._TIMEOUT`, `OTEL_TRACES_SAMPLER`,
//!   `OTEL_RESOURCE_ATTRIBUTES`.
//!
//! The spans are batched and posted from a thread of their own; [`Telemetry`]'s drop (the end
//! of a command, a graceful exit on SIGTERM among them) sends what is still batched.

use std::time::Duration;

use cellmesh_admin::SPANS_TARGET;
use cellmesh_stores::redact_url;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::{EnvFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The longest the exit waits for the last spans to be sent.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one export may take when `OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT` does not say.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest answer read from a collector (it says at most which spans it rejected).
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// What [`init`] set up; dropping it sends the spans still batched and stops the exporter.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Blocks until the batch thread has posted what it holds (through the runtime's
            // workers: the caller is the main thread, never one of them).
            if let Err(e) = provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
                tracing::warn!(error = %e, "the last spans may not have been exported");
            }
        }
    }
}

/// Installs the process's subscriber: the log on stderr (`RUST_LOG`, else `default_filter`), and
/// the OTLP exporter when an endpoint is configured, with spans of service
/// `OTEL_SERVICE_NAME` (else `default_service`). Call once, inside the Tokio runtime.
pub fn init(default_filter: &str, default_service: &str) -> Telemetry {
    let env = |key: &str| std::env::var(key).ok().filter(|v| !v.trim().is_empty());
    let log_filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into())
        .add_directive(
            format!("{SPANS_TARGET}=off")
                .parse()
                .expect("a valid directive"),
        );
    // A closed stderr must not take the process down with a panic on the next log line.
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .log_internal_errors(false)
        .with_filter(log_filter);
    let service = env("OTEL_SERVICE_NAME").unwrap_or_else(|| default_service.to_string());
    let exporter = endpoint(env).and_then(|endpoint| match endpoint {
        Some(endpoint) => {
            let provider = provider(&endpoint, &service, export_timeout(env))?;
            Ok(Some((provider, endpoint)))
        }
        None => Ok(None),
    });
    let provider = exporter
        .as_ref()
        .ok()
        .and_then(|e| e.as_ref())
        .map(|e| &e.0);
    let spans = provider.map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("cellmesh"))
            // The spans' own fields say what they are: no thread, source line or target (one
            // for all of them), and no busy/idle times (they are never entered).
            .with_tracked_inactivity(false)
            .with_threads(false)
            .with_location(false)
            .with_target(false)
            .with_filter(Targets::new().with_target(SPANS_TARGET, tracing::Level::INFO))
    });
    tracing_subscriber::registry().with(log).with(spans).init();
    match exporter {
        Ok(Some((provider, endpoint))) => {
            let endpoint = redact_url(&endpoint);
            tracing::info!(%endpoint, %service, "exporting spans over OTLP");
            Telemetry {
                provider: Some(provider),
            }
        }
        Ok(None) => Telemetry { provider: None },
        Err(why) => {
            tracing::warn!("not exporting spans: {why}");
            Telemetry { provider: None }
        }
    }
}

/// The URL spans are posted to, from the standard variables (`env` reads one, `None` when unset
/// or blank); `None` when tracing is off.
fn endpoint(env: impl Fn(&str) -> Option<String>) -> Result<Option<String>, String> {
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    if let Some(exporter) = env("OTEL_TRACES_EXPORTER") {
        match exporter.trim() {
            "none" => return Ok(None),
            "otlp" => {}
            other => {
                return Err(format!(
                    "OTEL_TRACES_EXPORTER={other}: only otlp is built in"
                ))
            }
        }
    }
    let url = match (
        env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        env("OTEL_EXPORTER_OTLP_ENDPOINT"),
    ) {
        (Some(url), _) => url.trim().to_string(),
        (None, Some(base)) => format!("{}/v1/traces", base.trim().trim_end_matches('/')),
        (None, None) => return Ok(None),
    };
    let shown = redact_url(&url);
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| format!("the OTLP endpoint {shown} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") if uri.host().is_some() => Ok(Some(url)),
        Some("https") => Err(format!(
            "the OTLP endpoint {shown} is https: spans are posted over plain http, to a \
             collector on this host or network"
        )),
        _ => Err(format!("the OTLP endpoint {shown} is not an http:// URL")),
    }
}

/// `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` or `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds).
fn export_timeout(env: impl Fn(&str) -> Option<String>) -> Duration {
    env("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
        .or_else(|| env("OTEL_EXPORTER_OTLP_TIMEOUT"))
        .and_then(|ms| ms.trim().parse().ok())
        .map_or(EXPORT_TIMEOUT, Duration::from_millis)
}

/// A tracer provider batching spans to `endpoint` (OTLP/HTTP, protobuf).
fn provider(endpoint: &str, service: &str, timeout: Duration) -> Result<SdkTracerProvider, String> {
    let runtime = tokio::runtime::Handle::try_current()
        .map_err(|_| "no Tokio runtime to post spans from".to_string())?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(RuntimeClient {
            client: Client::builder(TokioExecutor::new()).build_http(),
            runtime,
            timeout,
        })
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(endpoint)
        .with_timeout(timeout)
        .build()
        .map_err(|e| e.to_string())?;
    let resource = Resource::builder()
        .with_service_name(service.to_string())
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(BatchSpanProcessor::builder(exporter).build())
        .with_resource(resource)
        .build())
}

/// The HTTP client of the exporter: hyper's, HTTP/1.1 without TLS. The SDK's batch thread has no
/// Tokio runtime of its own, so each request runs on the process's runtime and the thread awaits
/// its end.
#[derive(Debug)]
struct RuntimeClient {
    client: Client<HttpConnector, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

#[async_trait::async_trait]
impl HttpClient for RuntimeClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (client, timeout) = (self.client.clone(), self.timeout);
        let exchange = async move {
            let (parts, body) = request.into_parts();
            let response = client
                .request(Request::from_parts(parts, Full::new(body)))
                .await?;
            let (parts, body) = response.into_parts();
            let body = Limited::new(body, MAX_RESPONSE_BYTES)
                .collect()
                .await?
                .to_bytes();
            Ok::<_, HttpError>(Response::from_parts(parts, body))
        };
        self.runtime
            .spawn(async move { tokio::time::timeout(timeout, exchange).await? })
            .await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |key| {
            vars.iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn no_endpoint_no_exporter() {
        assert_eq!(endpoint(env(&[])), Ok(None));
        assert_eq!(
            endpoint(env(&[
                ("OTEL_SERVICE_NAME", "x"),
                ("OTEL_BSP_SCHEDULE_DELAY", "1")
            ])),
            Ok(None)
        );
    }

    #[test]
    fn the_traces_endpoint_is_taken_as_it_is_and_the_base_gets_the_traces_path() {
        assert_eq!(
            endpoint(env(&[(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "http://127.0.0.1:4318/"
            )])),
            Ok(Some("http://127.0.0.1:4318/v1/traces".into()))
        );
        assert_eq!(
            endpoint(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://other:9000/spans"
                ),
            ])),
            Ok(Some("http://other:9000/spans".into()))
        );
    }

    #[test]
    fn disabled_or_another_exporter_or_https_exports_nothing() {
        let base = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");
        assert_eq!(
            endpoint(env(&[base, ("OTEL_SDK_DISABLED", "true")])),
            Ok(None)
        );
        assert_eq!(
            endpoint(env(&[base, ("OTEL_TRACES_EXPORTER", "none")])),
            Ok(None)
        );
        assert!(endpoint(env(&[base, ("OTEL_TRACES_EXPORTER", "zipkin")])).is_err());
        assert!(endpoint(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318")])).is_err());
        assert!(endpoint(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")])).is_err());
        assert!(endpoint(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url")])).is_err());
    }

    #[test]
    fn the_export_timeout_is_read_in_milliseconds() {
        assert_eq!(export_timeout(env(&[])), EXPORT_TIMEOUT);
        assert_eq!(
            export_timeout(env(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")])),
            Duration::from_millis(2500)
        );
        assert_eq!(
            export_timeout(env(&[
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
                ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "700")
            ])),
            Duration::from_millis(700)
        );
    }
}
