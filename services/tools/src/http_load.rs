//! The load generator's HTTP client: the same requests `pdmesh bench` sends over gRPC, sent to
//! the router's OpenAI API instead (`POST /v1/completions` with the prompt's token ids,
//! streamed), so both frontends are measured alike. HTTP/2 over a few connections (HTTPS
//! under the mesh's CA when the mesh runs TLS), each request a stream, as gRPC does.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::mesh_bench::{Sample, ms};

/// One HTTP/2 connection to the API, with what every request carries.
#[derive(Debug, Clone)]
pub struct HttpClient {
    send: SendRequest<Full<Bytes>>,
    authority: String,
    https: bool,
    key: Option<Arc<str>>,
    model: Arc<str>,
}

/// Opens one connection to `addr` (HTTPS when this process has the mesh's TLS).
async fn open(addr: &str) -> anyhow::Result<(SendRequest<Full<Bytes>>, bool)> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    tcp.set_nodelay(true)?;
    match pdmesh_common::tls::current() {
        Some(tls) => {
            let config = tls.https_client()?;
            let name = rustls::pki_types::ServerName::try_from(pdmesh_common::tls::MESH_NAME)?;
            let io = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
            Ok((handshake(io).await?, true))
        }
        None => Ok((handshake(tcp).await?, false)),
    }
}

/// HTTP/2 over `io`, its connection driven by a task of its own.
async fn handshake<IO>(io: IO) -> anyhow::Result<SendRequest<Full<Bytes>>>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io)).await?;
    tokio::spawn(conn);
    Ok(send)
}

impl HttpClient {
    fn request(
        &self,
        method: http::Method,
        path: &str,
        body: Bytes,
    ) -> anyhow::Result<http::Request<Full<Bytes>>> {
        let scheme = if self.https { "https" } else { "http" };
        let mut r = http::Request::builder()
            .method(method)
            .uri(format!("{scheme}://{}{path}", self.authority))
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(k) = &self.key {
            r = r.header(http::header::AUTHORIZATION, format!("Bearer {k}"));
        }
        Ok(r.body(Full::new(body))?)
    }
}

/// `n` connections to the API at `addr`, sending `key`; the model id is the one it serves.
pub async fn connect_many(
    addr: &str,
    key: Option<&str>,
    n: usize,
) -> anyhow::Result<Vec<HttpClient>> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        let (send, https) = open(addr).await?;
        clients.push(HttpClient {
            send,
            authority: addr.to_string(),
            https,
            key: key.map(Arc::from),
            model: Arc::from(""),
        });
    }
    // The model id, from the API itself.
    let mut c = clients[0].clone();
    let r = c.send.send_request(c.request(http::Method::GET, "/v1/models", Bytes::new())?).await?;
    let status = r.status();
    let body = r.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("GET /v1/models: {status}: {}", String::from_utf8_lossy(&body));
    }
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    let model: Arc<str> =
        v["data"][0]["id"].as_str().context("GET /v1/models named no model")?.into();
    for c in &mut clients {
        c.model = Arc::clone(&model);
    }
    Ok(clients)
}

/// One streamed completion of `ids` (`max_tokens` exactly: end-of-turn ignored, unless
/// `eos`), timed as the gRPC client times one: first token, then the gap before each next one.
pub async fn one(mut c: HttpClient, ids: Vec<u32>, max_tokens: u32, eos: bool) -> Sample {
    let body = serde_json::json!({
        "model": &*c.model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": !eos,
        "stream": true,
        "stream_options": {"include_usage": true},
        "return_token_ids": true,
    });
    let mut s = Sample::default();
    let t0 = Instant::now();
    let req = match c.request(http::Method::POST, "/v1/completions", Bytes::from(body.to_string()))
    {
        Ok(r) => r,
        Err(e) => return s.failed(e.to_string()),
    };
    let resp = match c.send.send_request(req).await {
        Ok(r) => r,
        Err(e) => return s.failed(format!("sending: {e}")),
    };
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        return s.failed(format!("{status}: {}", String::from_utf8_lossy(&text)));
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut last: Option<Instant> = None;
    loop {
        let frame = match body.frame().await {
            Some(Ok(f)) => f,
            Some(Err(e)) => return s.failed(format!("reading: {e}")),
            None => return s.failed("the stream ended without [DONE]".into()),
        };
        let Ok(data) = frame.into_data() else { continue };
        let now = Instant::now();
        buf.extend_from_slice(&data);
        // Server-sent events end with a blank line.
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let Some(payload) =
                std::str::from_utf8(&event).ok().and_then(|e| e.trim().strip_prefix("data:"))
            else {
                continue;
            };
            let payload = payload.trim();
            if payload == "[DONE]" {
                s.e2e_ms = ms(t0.elapsed());
                s.ok = s.error.is_none();
                return s;
            }
            let v: serde_json::Value = match serde_json::from_str(payload) {
                Ok(v) => v,
                Err(e) => return s.failed(format!("a chunk that is not JSON: {e}")),
            };
            if let Some(err) = v.get("error") {
                return s.failed(err["message"].as_str().unwrap_or("error").to_string());
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                s.cached_tokens =
                    u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as u32;
            }
            let n = v["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
            if n > 0 {
                s.token_arrived(t0, &mut last, now, n);
            }
        }
    }
}
