//! The OpenAI-compatible HTTP API: a second frontend over the router's library API
//! (`pdmesh_router::Router`), beside the gRPC `Generation` service and never a copy of its
//! request path. `POST /v1/chat/completions` and `POST /v1/completions` (whole or streamed as
//! server-sent events), `GET /v1/models`, `GET /health`. Callers authenticate with the same API
//! keys (`Authorization: Bearer KEY`, as the SDK sends them), a W3C `traceparent` continues the
//! caller's trace, and the listener speaks HTTPS with the router's certificate whenever the
//! mesh runs TLS.

pub mod error;
pub mod handlers;
pub mod prepare;
pub mod schema;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use pdmesh_common::apikey::KeyRing;
use pdmesh_router::Router;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::StreamExt;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

pub use error::ApiError;
pub use handlers::AppState;

/// The API's routes over `state`.
pub fn app(state: AppState) -> axum::Router {
    axum::Router::new()
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models))
        .route("/v1/models/{id}", get(handlers::model))
        .route("/health", get(handlers::health))
        .fallback(handlers::not_found)
        .with_state(state)
}

/// The frontend the router serves beside gRPC (`pdmesh_router::run_with`): this API on
/// `listener`, with the router's API keys, until the router stops; then in-flight requests get
/// `drain` to finish.
pub fn frontend(listener: TcpListener, drain: Duration) -> pdmesh_router::Frontend {
    Box::new(move |router: Router, keys: Option<Arc<KeyRing>>, stop: CancellationToken| {
        Box::pin(async move {
            let state = AppState::new(router, keys);
            serve(app(state), listener, stop.cancelled_owned(), drain).await;
            Ok(())
        })
    })
}

/// Time a client gets to send a request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How a plaintext HTTP client on the HTTPS port is told what to do.
const NEEDS_TLS: &str = "{\"error\":{\"message\":\"this server speaks HTTPS (with the mesh's CA): use https://\",\"type\":\"invalid_request_error\",\"param\":null,\"code\":null}}";

/// Serves `app` on `listener` (HTTP/1.1 and HTTP/2; HTTPS when the process has TLS) until
/// `shutdown`, then waits at most `drain` for open requests.
pub async fn serve(
    app: axum::Router,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) {
    let idle = Some(pdmesh_common::serve::PUBLIC_IDLE);
    let mut conns = match pdmesh_common::tls::current() {
        Some(tls) => pdmesh_common::serve::incoming(listener, idle, move |tcp: TcpStream| {
            let config = tls.https_server();
            Box::pin(async move {
                let mut first = [0u8; 1];
                // A TLS handshake opens with 0x16; anything else is plaintext HTTP.
                if tcp.peek(&mut first).await? == 1 && first[0] != 0x16 {
                    refuse_plaintext(tcp).await;
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "a plaintext client (told to use https)",
                    ));
                }
                let tls = tokio_rustls::TlsAcceptor::from(config).accept(tcp).await?;
                Ok(Either::Left(tls))
            })
        }),
        None => pdmesh_common::serve::incoming(listener, idle, |tcp| {
            Box::pin(std::future::ready(Ok(Either::Right(tcp))))
        }),
    };
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The bounds the gRPC listeners keep: streams per connection, header bytes, and a client
    // that never finishes its headers is let go.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(pdmesh_common::serve::MAX_HEADER_BYTES as usize + (64 << 10));
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .max_concurrent_streams(pdmesh_common::serve::MAX_PUBLIC_STREAMS_PER_CONNECTION)
        .initial_stream_window_size(pdmesh_common::serve::PUBLIC_STREAM_WINDOW)
        .initial_connection_window_size(pdmesh_common::serve::PUBLIC_CONNECTION_WINDOW)
        .max_header_list_size(pdmesh_common::serve::MAX_HEADER_BYTES);
    tokio::pin!(shutdown);
    loop {
        let io = tokio::select! {
            () = &mut shutdown => break,
            c = conns.next() => match c {
                Some(Ok(io)) => io,
                Some(Err(_)) => continue,
                None => break,
            },
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection(TokioIo::new(io), svc).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("HTTP connection ended: {e}");
            }
        });
    }
    drop(conns);
    if tokio::time::timeout(drain, graceful.shutdown()).await.is_err() {
        tracing::warn!("HTTP requests still open after {drain:?}; closed");
    }
}

async fn refuse_plaintext(mut tcp: TcpStream) {
    let reply = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{NEEDS_TLS}",
        NEEDS_TLS.len()
    );
    let _ = tcp.write_all(reply.as_bytes()).await;
    let _ = tcp.shutdown().await;
}

#[cfg(test)]
mod tests;
