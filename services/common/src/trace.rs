//! One request, one trace: W3C `traceparent` in, spans, `traceparent` out.
//!
//! - [`TraceLayer`] goes on every gRPC server: it continues the caller's trace (or starts one)
//!   with a server span named `<service>.<method>` (`router.generate`, `decode.kv_session`)
//!   that lasts until the response stream ends, and records the call's gRPC code on it.
//! - [`channel`] wraps every client channel: each call carries the current span's context.
//! - [`traceparent`] / [`parent`] carry it where gRPC metadata does not reach (the KV
//!   transfer's control messages).
//!
//! Everything here is a pass-through when this process exports no spans.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskCx, Poll};

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::telemetry::exporting;

/// The W3C header, also the name of the field in KV-transfer control messages.
const TRACEPARENT: &str = "traceparent";

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) =
            (MetadataKey::from_bytes(key.as_bytes()), MetadataValue::try_from(value.as_str()))
        {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

fn propagate<T>(mut f: impl FnMut(&dyn opentelemetry::propagation::TextMapPropagator) -> T) -> T {
    opentelemetry::global::get_text_map_propagator(|p| f(p))
}

/// The current span's `traceparent`, when this process exports spans and one is current.
pub fn traceparent() -> Option<String> {
    if !exporting() {
        return None;
    }
    let cx = Span::current().context();
    let mut carrier = HashMap::new();
    propagate(|p| p.inject_context(&cx, &mut carrier));
    carrier.remove(TRACEPARENT)
}

/// The remote parent a `traceparent` names (an empty context when it is empty or invalid).
pub fn parent(traceparent: &str) -> Context {
    let carrier = HashMap::from([(TRACEPARENT.to_string(), traceparent.to_string())]);
    propagate(|p| p.extract(&carrier))
}

/// Makes `span` a child of the remote span `traceparent` names, if it names one. Call before
/// the span is first entered.
pub fn continue_from(span: &Span, traceparent: &str) {
    if exporting() && !traceparent.is_empty() {
        let _ = span.set_parent(parent(traceparent));
    }
}

/// The trace id of the current span, as Jaeger shows it; `None` when nothing is exported.
pub fn trace_id() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    if !exporting() {
        return None;
    }
    let cx = Span::current().context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// Sets an attribute on `span`'s exported span (no-op when nothing is exported). For
/// attributes only known after the span was created, on spans that did not declare them.
pub fn attr(span: &Span, key: &'static str, value: impl Into<opentelemetry::Value>) {
    if exporting() {
        span.set_attribute(key, value);
    }
}

/// Adds the event `name` with string attributes to `span`'s exported span (no-op when
/// nothing is exported): what happened at a moment of a span, such as a transfer's fallback.
pub fn event(span: &Span, name: &'static str, attrs: &[(&'static str, String)]) {
    if exporting() {
        let kv = attrs.iter().map(|(k, v)| opentelemetry::KeyValue::new(*k, v.clone())).collect();
        span.add_event(name, kv);
    }
}

/// Marks `span` failed with the gRPC status `code` (the span must declare
/// `otel.status_code`, `otel.status_description` and `rpc.grpc.status_code`, see [`span!`]).
pub fn record_status(span: &Span, code: tonic::Code, message: &str) {
    span.record("rpc.grpc.status_code", code as i64);
    if code != tonic::Code::Ok {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_description", format!("{code:?}: {message}"));
    }
}

/// Marks `span` failed with `status` (see [`record_status`]).
pub fn fail(span: &Span, status: &tonic::Status) {
    record_status(span, status.code(), status.message());
}

/// Runs `fut` in `span` and marks the span failed if it returns an error status.
pub async fn in_span<T>(
    span: &Span,
    fut: impl Future<Output = Result<T, tonic::Status>>,
) -> Result<T, tonic::Status> {
    let r = fut.instrument(span.clone()).await;
    if let Err(s) = &r {
        fail(span, s);
    }
    r
}

/// An `info` span named `name` that can carry a gRPC status (for [`fail`]), plus `fields`;
/// `span!(parent: &p, "name", ...)` gives it an explicit parent.
#[macro_export]
macro_rules! span {
    (parent: $parent:expr, $name:literal $(, $($fields:tt)*)?) => {
        tracing::info_span!(
            parent: $parent,
            $name,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            $($($fields)*)?
        )
    };
    ($name:literal $(, $($fields:tt)*)?) => {
        tracing::info_span!(
            $name,
            rpc.grpc.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
            otel.status_description = tracing::field::Empty,
            $($($fields)*)?
        )
    };
}

/// Injects the current span's context into every call made through the channel.
#[derive(Debug, Clone, Copy, Default)]
pub struct Propagate;

impl tonic::service::Interceptor for Propagate {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if exporting() {
            let cx = Span::current().context();
            propagate(|p| p.inject_context(&cx, &mut MetadataInjector(req.metadata_mut())));
        }
        Ok(req)
    }
}

/// A client channel whose calls carry the caller's trace.
pub type Channel = tonic::codegen::InterceptedService<tonic::transport::Channel, Propagate>;

/// Wraps a channel so its calls carry the caller's trace: every client in the mesh is built
/// on one of these.
pub fn channel(inner: tonic::transport::Channel) -> Channel {
    tonic::codegen::InterceptedService::new(inner, Propagate)
}

/// The services this mesh traces, by proto service: which process serves it. Membership,
/// stats, health and reflection calls are periodic plumbing, not requests, and are not traced.
fn span_name(path: &str) -> Option<String> {
    let (service, method) = path.trim_start_matches('/').split_once('/')?;
    let process = match service {
        "pdmesh.v1.Generation" => "router",
        "pdmesh.v1.Prefill" => "prefill",
        "pdmesh.v1.Decode" => "decode",
        "pdmesh.v1.KvStore" => "kvstore",
        _ => return None,
    };
    if method == "Stats" {
        return None;
    }
    let mut name = format!("{process}.");
    for (i, c) in method.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_lowercase());
    }
    Some(name)
}

/// `Server::builder().layer(TraceLayer)`: see the module docs.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceLayer;

impl<S> tower::Layer<S> for TraceLayer {
    type Service = TraceService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        TraceService { inner }
    }
}

#[derive(Debug, Clone)]
pub struct TraceService<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for TraceService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut TaskCx<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // The ready service goes to this call; its clone waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let name = if exporting() { span_name(req.uri().path()) } else { None };
        let Some(name) = name else {
            return Box::pin(inner.call(req));
        };
        let parent = propagate(|p| p.extract(&HeaderExtractor(req.headers())));
        let (service, method) =
            req.uri().path().trim_start_matches('/').split_once('/').unwrap_or_default();
        let span = span!(
            "grpc",
            otel.name = %name,
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = %service,
            rpc.method = %method,
        );
        let _ = span.set_parent(parent);
        let fut = span.in_scope(|| inner.call(req));
        Box::pin(
            async move {
                let resp = fut.await?;
                let span = Span::current();
                // An error answered before any message is all headers ("trailers only").
                if let Some(s) = tonic::Status::from_header_map(resp.headers()) {
                    record_status(&span, s.code(), s.message());
                    return Ok(resp);
                }
                Ok(resp.map(|body| tonic::body::Body::new(TracedBody { inner: body, span })))
            }
            .instrument(span),
        )
    }
}

pin_project_lite::pin_project! {
    /// A response body that holds its call's span open until the stream ends, and records
    /// the status from its trailers (or that the caller went away first).
    struct TracedBody<B> {
        #[pin]
        inner: B,
        span: Span,
    }

    impl<B> PinnedDrop for TracedBody<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if !this.span.is_disabled() {
                end(this.span, tonic::Code::Cancelled, "the caller went away");
            }
        }
    }
}

/// Ends a call's span now with its status. An exported span ends when it was last exited, so
/// it is entered once more: the stream's end, not the handler's return, is the call's end.
fn end(span: &mut Span, code: tonic::Code, message: &str) {
    span.in_scope(|| record_status(span, code, message));
    *span = Span::none();
}

impl<B> http_body::Body for TracedBody<B>
where
    B: http_body::Body<Data = bytes::Bytes>,
    B::Error: std::fmt::Display,
{
    type Data = bytes::Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskCx<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(s) = frame.trailers_ref().and_then(tonic::Status::from_header_map) {
                    end(this.span, s.code(), s.message());
                }
            }
            Poll::Ready(Some(Err(e))) => end(this.span, tonic::Code::Internal, &e.to_string()),
            // Ended without trailers: nothing went wrong that this layer can see.
            Poll::Ready(None) => end(this.span, tonic::Code::Ok, ""),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_names_follow_the_serving_process_and_skip_plumbing() {
        assert_eq!(span_name("/pdmesh.v1.Generation/Generate").as_deref(), Some("router.generate"));
        assert_eq!(span_name("/pdmesh.v1.Decode/KvSession").as_deref(), Some("decode.kv_session"));
        assert_eq!(
            span_name("/pdmesh.v1.KvStore/ReleaseMatch").as_deref(),
            Some("kvstore.release_match")
        );
        assert_eq!(span_name("/pdmesh.v1.Prefill/Stats"), None);
        assert_eq!(span_name("/pdmesh.v1.Membership/Heartbeat"), None);
        assert_eq!(span_name("/grpc.health.v1.Health/Check"), None);
        assert_eq!(span_name("garbage"), None);
    }

    #[test]
    fn a_traceparent_round_trips_and_garbage_is_no_parent() {
        use opentelemetry::trace::TraceContextExt;
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = parent(tp);
        let sc = cx.span().span_context().clone();
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        for bad in [
            "",
            "00-zz-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        ] {
            assert!(!parent(bad).span().span_context().is_valid(), "{bad}");
        }
    }
}
