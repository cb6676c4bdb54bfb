//! Logging and tracing setup shared by every service. Log lines go to stderr, filtered by
//! `PDMESH_LOG` (or `RUST_LOG`), `info` by default. Spans go to an OTLP/gRPC collector (Jaeger
//! ingests OTLP natively) only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is
//! set; otherwise no layer wants a span, so every span in the code is disabled at its call
//! site and costs a branch.
//!
//! The standard `OTEL_*` variables apply: `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
//! `OTEL_TRACES_SAMPLER(_ARG)`, `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT/_TIMEOUT/_HEADERS/
//! _COMPRESSION/_INSECURE` and `OTEL_BSP_*`. Propagation is always W3C trace context.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{EnvFilter, FilterExt, LevelFilter, Targets, filter_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

/// Whether spans are exported by this process; read on hot paths to skip propagation work.
static EXPORTING: AtomicBool = AtomicBool::new(false);

pub(crate) fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("OTLP trace exporter: {0}")]
    Exporter(String),
    #[error(
        "{var}={value:?} means HTTPS, and this build speaks plain gRPC to the collector only: \
         use http://{host} (for a schemeless endpoint, OTEL_EXPORTER_OTLP_INSECURE=true also works)"
    )]
    Https { var: &'static str, value: String, host: String },
}

/// Refuses an endpoint the exporter would dial with TLS, which is not built in, with the fix in
/// the message (the exporter's own error names cargo features). `insecure` is
/// OTEL_EXPORTER_OTLP_INSECURE; a schemeless endpoint means HTTPS unless it is true.
fn check_endpoint(var: &'static str, value: &str, insecure: bool) -> Result<(), TelemetryError> {
    let v = value.trim();
    let host = match v.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("https") => rest,
        Some(_) => return Ok(()),
        None if insecure => return Ok(()),
        None => v,
    };
    Err(TelemetryError::Https { var, value: value.to_string(), host: host.to_string() })
}

/// The process's tracing state; `shutdown` flushes spans still buffered for export.
#[derive(Debug)]
#[must_use = "spans buffered for export are lost unless shutdown() is called"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are being exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes and stops the exporter. Blocks until the collector answered or timed out: call
    /// it from a blocking context (`spawn_blocking`) while the runtime still runs, because the
    /// export's connection lives on that runtime.
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            EXPORTING.store(false, Ordering::Relaxed);
            if let Err(e) = p.shutdown() {
                eprintln!("flushing traces: {e}");
            }
        }
    }
}

fn log_filter() -> EnvFilter {
    let directives = std::env::var("PDMESH_LOG")
        .ok()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| "info".into());
    EnvFilter::new(directives)
}

fn fmt_layer<S>() -> impl Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use std::io::IsTerminal;
    // Log lines are events only: spans exist for the trace, and printing their fields on
    // every line would bury the message. The answer depends on the call site alone, so it is
    // cached there: without the exporter, creating a span costs one atomic load.
    tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_filter(log_filter().and(filter_fn(|m| m.is_event())))
}

/// Installs logging, and span export when an OTLP endpoint is configured in the environment.
/// `service` names the process in traces unless `OTEL_SERVICE_NAME` or a `service.name` in
/// `OTEL_RESOURCE_ATTRIBUTES` does. Must run inside a Tokio runtime (the exporter's channel
/// spawns on it). A second call in one process keeps the first subscriber.
pub fn init(service: &'static str) -> Result<Telemetry, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    // The exporter reads the traces-specific variable first, then the general one.
    let endpoint = ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .into_iter()
        .find_map(|v| std::env::var(v).ok().filter(|e| !e.trim().is_empty()).map(|e| (v, e)));
    let provider = match endpoint {
        Some((var, value)) => Some(provider(service, var, &value)?),
        None => None,
    };
    // The exporter's own HTTP/2 client is traced too; exporting those spans would feed itself.
    let quiet = Targets::new()
        .with_default(LevelFilter::INFO)
        .with_target("h2", LevelFilter::OFF)
        .with_target("hyper", LevelFilter::OFF)
        .with_target("tonic", LevelFilter::OFF)
        .with_target("tower", LevelFilter::OFF)
        .with_target("opentelemetry", LevelFilter::OFF);
    // Without an exporter the subscriber has the log layer alone. An absent layer (`None`)
    // would still declare interest in every callsite, and every span (h2's and tonic's too)
    // would be built in the registry only to be dropped: most of a router's span cost.
    match &provider {
        Some(p) => {
            let otel = tracing_opentelemetry::layer()
                .with_tracer(p.tracer("pdmesh"))
                .with_tracked_inactivity(false)
                .with_location(false)
                .with_threads(false)
                .with_target(false)
                .with_filter(quiet);
            if Registry::default().with(fmt_layer()).with(otel).try_init().is_ok() {
                EXPORTING.store(true, Ordering::Relaxed);
            }
        }
        None => {
            let _ = Registry::default().with(fmt_layer()).try_init();
        }
    }
    Ok(Telemetry { provider })
}

fn provider(
    service: &'static str,
    var: &'static str,
    endpoint: &str,
) -> Result<SdkTracerProvider, TelemetryError> {
    let insecure =
        std::env::var("OTEL_EXPORTER_OTLP_INSECURE").is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    check_endpoint(var, endpoint, insecure)?;
    // The builder reads the endpoint (and the other OTEL_EXPORTER_OTLP_* variables) itself.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    // The SDK lets a service.name in OTEL_RESOURCE_ATTRIBUTES beat OTEL_SERVICE_NAME, and a
    // name set in code beat both; the spec orders them OTEL_SERVICE_NAME, then the attribute,
    // then the default.
    let resource = Resource::builder();
    let named_in_attributes = std::env::var("OTEL_RESOURCE_ATTRIBUTES")
        .is_ok_and(|v| v.split(',').any(|kv| kv.trim_start().starts_with("service.name=")));
    let resource = match std::env::var("OTEL_SERVICE_NAME").ok().filter(|v| !v.is_empty()) {
        Some(name) => resource.with_service_name(name),
        None if named_in_attributes => resource,
        None => resource.with_service_name(service),
    };
    // The sampler comes from OTEL_TRACES_SAMPLER(_ARG) (default: parent-based, always on).
    Ok(SdkTracerProvider::builder()
        .with_resource(resource.build())
        .with_batch_exporter(exporter)
        .build())
}

#[cfg(test)]
mod tests {
    use super::check_endpoint;

    #[test]
    fn tls_endpoints_are_refused_with_the_fix() {
        let e = "OTEL_EXPORTER_OTLP_ENDPOINT";
        assert!(check_endpoint(e, "http://jaeger:4317", false).is_ok());
        assert!(check_endpoint(e, "jaeger:4317", true).is_ok());
        for bad in ["jaeger:4317", "https://jaeger:4317", "HTTPS://jaeger:4317"] {
            let msg = check_endpoint(e, bad, false).expect_err(bad).to_string();
            assert!(msg.contains("use http://jaeger:4317"), "{msg}");
        }
    }
}
