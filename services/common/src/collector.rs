//! A small OTLP/gRPC trace receiver: what `pdmesh collect` runs to see a mesh's spans without
//! Jaeger, and what the tracing tests point the mesh at. It keeps every span it receives, as
//! flat records, and optionally hands each batch to a callback.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use tokio::net::TcpListener;

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    Str(String),
    Int(i64),
    F64(f64),
    Bool(bool),
    /// Arrays, maps and bytes, printed.
    Other(String),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Str(s) | Attr::Other(s) => f.write_str(s),
            Attr::Int(i) => write!(f, "{i}"),
            Attr::F64(x) => write!(f, "{x}"),
            Attr::Bool(b) => write!(f, "{b}"),
        }
    }
}

fn attr(v: Option<&AnyValue>) -> Attr {
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => Attr::Str(s.clone()),
        Some(any_value::Value::IntValue(i)) => Attr::Int(*i),
        Some(any_value::Value::DoubleValue(x)) => Attr::F64(*x),
        Some(any_value::Value::BoolValue(b)) => Attr::Bool(*b),
        other => Attr::Other(format!("{other:?}")),
    }
}

fn attrs(kvs: &[KeyValue]) -> BTreeMap<String, Attr> {
    kvs.iter().map(|kv| (kv.key.clone(), attr(kv.value.as_ref()))).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One received span.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    /// `service.name` of the process that sent it.
    pub service: String,
    /// Every attribute of the sender's resource (`service.name` included).
    pub resource: BTreeMap<String, Attr>,
    pub name: String,
    /// Hex, as Jaeger shows them; `parent_id` is empty for a root span.
    pub trace_id: String,
    pub span_id: String,
    pub parent_id: String,
    /// OTLP span kind: 1 internal, 2 server, 3 client.
    pub kind: i32,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    pub attributes: BTreeMap<String, Attr>,
    /// Whether the span's status is Error, and its message.
    pub error: bool,
    pub status_message: String,
    /// Names of the span's events (log lines emitted inside it).
    pub events: Vec<String>,
}

impl SpanRecord {
    pub fn attr(&self, key: &str) -> Option<&Attr> {
        self.attributes.get(key)
    }

    pub fn int(&self, key: &str) -> Option<i64> {
        match self.attr(key) {
            Some(Attr::Int(i)) => Some(*i),
            _ => None,
        }
    }

    pub fn str(&self, key: &str) -> Option<&str> {
        match self.attr(key) {
            Some(Attr::Str(s)) => Some(s),
            _ => None,
        }
    }

    pub fn duration_ms(&self) -> f64 {
        self.end_unix_nanos.saturating_sub(self.start_unix_nanos) as f64 / 1e6
    }
}

impl fmt::Display for SpanRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} trace={} span={} parent={} {:.3}ms",
            self.service,
            self.name,
            self.trace_id,
            self.span_id,
            if self.parent_id.is_empty() { "-" } else { &self.parent_id },
            self.duration_ms()
        )?;
        if self.error {
            write!(f, " ERROR({})", self.status_message)?;
        }
        for (k, v) in &self.attributes {
            write!(f, " {k}={v}")?;
        }
        Ok(())
    }
}

/// Flattens an export request into one record per span.
pub fn records(req: &ExportTraceServiceRequest) -> Vec<SpanRecord> {
    let mut out = Vec::new();
    for rs in &req.resource_spans {
        let resource = rs.resource.as_ref().map(|r| attrs(&r.attributes)).unwrap_or_default();
        let service = resource.get("service.name").map(Attr::to_string).unwrap_or_default();
        for s in rs.scope_spans.iter().flat_map(|ss| &ss.spans) {
            let status = s.status.as_ref();
            out.push(SpanRecord {
                service: service.clone(),
                resource: resource.clone(),
                name: s.name.clone(),
                trace_id: hex(&s.trace_id),
                span_id: hex(&s.span_id),
                parent_id: hex(&s.parent_span_id),
                kind: s.kind,
                start_unix_nanos: s.start_time_unix_nano,
                end_unix_nanos: s.end_time_unix_nano,
                attributes: attrs(&s.attributes),
                // OTLP status code 2 is Error.
                error: status.is_some_and(|st| st.code == 2),
                status_message: status.map(|st| st.message.clone()).unwrap_or_default(),
                events: s.events.iter().map(|e| e.name.clone()).collect(),
            });
        }
    }
    out
}

type OnBatch = Arc<dyn Fn(&[SpanRecord]) + Send + Sync>;

/// Receives spans over OTLP/gRPC and keeps them, or hands them on.
#[derive(Clone, Default)]
pub struct Collector {
    spans: Arc<Mutex<Vec<SpanRecord>>>,
    received: Arc<AtomicU64>,
    on_batch: Option<OnBatch>,
}

impl fmt::Debug for Collector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Collector").field("spans", &self.len()).finish()
    }
}

impl Collector {
    /// Calls `f` with each batch as it arrives instead of keeping the spans (a collector that
    /// runs for long holds nothing).
    pub fn on_batch(f: impl Fn(&[SpanRecord]) + Send + Sync + 'static) -> Self {
        Self { on_batch: Some(Arc::new(f)), ..Self::default() }
    }

    /// Spans received so far, kept or not.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Every span kept so far.
    pub fn spans(&self) -> Vec<SpanRecord> {
        self.spans.lock().expect("never poisoned").clone()
    }

    pub fn len(&self) -> usize {
        self.spans.lock().expect("never poisoned").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Serves OTLP/gRPC trace export on `listener` until the task is dropped.
    pub async fn serve(self, listener: TcpListener) -> Result<(), tonic::transport::Error> {
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(self))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let batch = records(req.get_ref());
        self.received.fetch_add(batch.len() as u64, Ordering::Relaxed);
        match &self.on_batch {
            Some(f) => f(&batch),
            None => self.spans.lock().expect("never poisoned").extend(batch),
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}
