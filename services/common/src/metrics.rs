//! Prometheus metrics for every service, served as text at `GET /metrics` on their own port
//! (`metrics_listen`). Counters a service already keeps (node counts, transfer stats, cache and
//! store stats) are read at scrape time through a `Snapshot` collector, so nothing on a hot path
//! changes for them; only what exists nowhere else (the router's latency histograms, requests by
//! outcome) is recorded as it happens. Names follow `pdmesh_<service>_<what>_<unit>`; counters
//! get the `_total` suffix from the encoder.

use std::convert::Infallible;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// A service's metrics registry, shared by the service (which registers) and the HTTP server
/// (which encodes at each scrape).
#[derive(Debug, Clone, Default)]
pub struct Metrics(Arc<RwLock<Registry>>);

impl Metrics {
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.0.write().expect("metrics lock is never poisoned").register(name, help, metric);
    }

    /// Families read from the service's own counters at every scrape.
    pub fn register_snapshot(&self, read: impl Fn() -> Vec<Family> + Send + Sync + 'static) {
        self.0
            .write()
            .expect("metrics lock is never poisoned")
            .register_collector(Box::new(Snapshot(Box::new(read))));
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let r = self.0.read().expect("metrics lock is never poisoned");
        prometheus_client::encoding::text::encode(&mut out, &r)
            .expect("encoding into a String cannot fail");
        out
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One metric family as read at scrape time: a value per label set.
#[derive(Debug, Clone)]
pub struct Family {
    pub name: String,
    pub help: &'static str,
    pub kind: Kind,
    pub samples: Vec<(Vec<(&'static str, String)>, f64)>,
}

impl Family {
    /// A family with one unlabelled value.
    pub fn one(name: impl Into<String>, help: &'static str, kind: Kind, value: f64) -> Self {
        Self { name: name.into(), help, kind, samples: vec![(Vec::new(), value)] }
    }

    /// A family with one value per value of a single `label`.
    pub fn labelled(
        name: impl Into<String>,
        help: &'static str,
        kind: Kind,
        label: &'static str,
        values: &[(&str, f64)],
    ) -> Self {
        let samples = values.iter().map(|(l, v)| (vec![(label, (*l).to_string())], *v)).collect();
        Self { name: name.into(), help, kind, samples }
    }
}

struct Snapshot(Box<dyn Fn() -> Vec<Family> + Send + Sync>);

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Snapshot")
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for fam in (self.0)() {
            let ty = match fam.kind {
                Kind::Counter => ConstCounter::new(0.0).metric_type(),
                Kind::Gauge => ConstGauge::new(0.0).metric_type(),
            };
            let mut m = encoder.encode_descriptor(&fam.name, fam.help, None, ty)?;
            for (labels, v) in &fam.samples {
                let e = m.encode_family(labels)?;
                match fam.kind {
                    Kind::Counter => ConstCounter::new(*v).encode(e)?,
                    Kind::Gauge => ConstGauge::new(*v).encode(e)?,
                }
            }
        }
        Ok(())
    }
}

/// What one metrics port lets its clients hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections served at once; more wait in the listen backlog until one ends.
    pub connections: usize,
    /// Time a connection gets to send a request's headers (a slow sender is cut off).
    pub header_timeout: Duration,
    /// The longest a connection stays open, whatever it does.
    pub connection_lifetime: Duration,
    /// The pause after a failed accept (say, out of file descriptors), instead of retrying at
    /// once in a loop that takes a core and the service's other ports with it.
    pub accept_backoff: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            connections: 32,
            header_timeout: Duration::from_secs(5),
            connection_lifetime: Duration::from_secs(60),
            accept_backoff: Duration::from_millis(100),
        }
    }
}

/// Serves `GET /metrics` on `listener` (HTTP/1.1) until the task is dropped; other paths 404.
pub async fn serve(listener: TcpListener, metrics: Metrics) {
    serve_with(listener, metrics, Limits::default()).await
}

/// `serve` under `limits`.
pub async fn serve_with(listener: TcpListener, metrics: Metrics, limits: Limits) {
    let slots = Arc::new(Semaphore::new(limits.connections));
    loop {
        // Held by the connection's task: at the cap, nothing more is accepted until one ends.
        let slot = slots.clone().acquire_owned().await.expect("the semaphore is never closed");
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!("metrics port: accept failed: {e}; pausing");
                tokio::time::sleep(limits.accept_backoff).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let metrics = metrics.clone();
                async move { Ok::<_, Infallible>(respond(&req, &metrics)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(stream), svc);
            match tokio::time::timeout(limits.connection_lifetime, conn).await {
                Ok(Err(e)) => tracing::debug!("metrics connection: {e}"),
                Err(_) => tracing::debug!("metrics connection: open too long, closed"),
                Ok(Ok(())) => {}
            }
        });
    }
}

fn respond(req: &Request<hyper::body::Incoming>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let mut r = if req.method() == hyper::Method::GET && req.uri().path() == "/metrics" {
        let mut r = Response::new(Full::new(Bytes::from(metrics.encode())));
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            ),
        );
        r
    } else {
        Response::new(Full::new(Bytes::from_static(b"metrics are at GET /metrics\n")))
    };
    if req.uri().path() != "/metrics" || req.method() != hyper::Method::GET {
        *r.status_mut() = StatusCode::NOT_FOUND;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;

    /// Slowloris: connections that send half a request line and stall fill every slot; they
    /// are cut off after the header timeout, and a scrape waiting behind them is answered.
    #[tokio::test]
    async fn stalled_connections_are_cut_off_and_a_scrape_still_gets_through() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::net::TcpStream;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let limits = Limits {
            connections: 4,
            header_timeout: Duration::from_millis(300),
            connection_lifetime: Duration::from_secs(20),
            accept_backoff: Duration::from_millis(10),
        };
        tokio::spawn(serve_with(l, Metrics::default(), limits));
        let mut stalled = Vec::new();
        for _ in 0..8 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"GET /met").await.unwrap();
            stalled.push(s);
        }
        let scrape = async {
            let mut s = TcpStream::connect(addr).await?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await?;
            let mut out = Vec::new();
            s.read_to_end(&mut out).await?;
            Ok::<_, std::io::Error>(out)
        };
        let body = tokio::time::timeout(Duration::from_secs(10), scrape)
            .await
            .expect("the scrape waited forever behind stalled connections")
            .unwrap();
        assert!(body.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&body));
        for mut s in stalled {
            let mut rest = Vec::new();
            let end = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
            assert!(end.is_ok(), "a stalled connection was left open");
        }
    }

    #[test]
    fn snapshots_and_registered_metrics_encode_with_labels() {
        let m = Metrics::default();
        let c = Counter::<u64>::default();
        m.register("pdmesh_test_requests", "Requests.", c.clone());
        m.register_snapshot(|| {
            vec![
                Family::one("pdmesh_test_queue_depth", "Waiting.", Kind::Gauge, 3.0),
                Family::labelled(
                    "pdmesh_test_transfer_bytes",
                    "Bytes moved.",
                    Kind::Counter,
                    "transport",
                    &[("ucx", 1024.0)],
                ),
            ]
        });
        c.inc();
        let text = m.encode();
        assert!(text.contains("pdmesh_test_requests_total 1"), "{text}");
        assert!(text.contains("pdmesh_test_queue_depth 3"), "{text}");
        assert!(
            text.contains("pdmesh_test_transfer_bytes_total{transport=\"ucx\"} 1024"),
            "{text}"
        );
    }
}
