//! Serving: every service gets `grpc.health.v1` and server reflection next to its own services,
//! takes a pre-bound listener (tests bind port 0), and on shutdown flips health to NOT_SERVING,
//! stops accepting, and gives in-flight calls a bounded time to finish.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use std::pin::Pin;

use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic_health::ServingStatus;

use crate::gate::{Gate, Held, Limits};

/// HTTP/2 streams one connection may have open on an internal server at once: the router
/// keeps every request to a node on one connection.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 2048;
/// HTTP/2 streams one connection may have open on a public server at once: a client's
/// requests in flight on one connection (the router's own limit is 256 by default).
pub const MAX_PUBLIC_STREAMS_PER_CONNECTION: u32 = 256;
/// The receive windows of a public server: a request is a prompt, not KV, so a client may
/// send no more than this ahead of what the server has read (per stream, per connection).
pub const PUBLIC_STREAM_WINDOW: u32 = 1 << 20;
pub const PUBLIC_CONNECTION_WINDOW: u32 = 4 << 20;
/// How long a connection may live: past it the server sends GOAWAY and the client redials,
/// so no connection outlives a certificate renewal or a CA rotation by more than this.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(3600);
/// What a connection past its age gets to finish the calls it has open (a request's own
/// bound is `request_timeout_ms`, 10 minutes by default).
pub const MAX_CONNECTION_AGE_GRACE: Duration = Duration::from_secs(900);
/// Header bytes one request may send (gRPC metadata is small; tonic's default is 16 MB).
pub const MAX_HEADER_BYTES: u32 = 64 << 10;

/// Binds `addr` ("host:port"; port 0 picks one) and returns the listener and its real address.
pub async fn bind(addr: &str) -> std::io::Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind(addr).await?;
    let a = l.local_addr()?;
    Ok((l, a))
}

/// Who a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exposure {
    /// Mesh processes only: a client certificate from the mesh CA is required, and each
    /// call is checked against the caller's role (`authz`).
    Internal,
    /// Anyone: the public API, which authenticates its callers itself (API keys).
    Public,
}

impl Exposure {
    /// How long a connection may sit with nothing moving (`PUBLIC_IDLE`; internal: no bound).
    fn idle(self) -> Option<Duration> {
        match self {
            Exposure::Internal => None,
            Exposure::Public => Some(PUBLIC_IDLE),
        }
    }
}

/// Time a client gets to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// At most one warning this often about connections refused for want of places (a flood
/// would otherwise write one line per socket).
const REFUSED_WARN_EVERY: Duration = Duration::from_secs(10);
/// The pause after a failed accept (out of file descriptors, say), so that a full fd table
/// is not retried in a loop that takes a core.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// How long a public connection may stay with no byte moving either way before it is let
/// go: past the router's default bound on a request (10 minutes), so a request in flight,
/// however quiet, is never cut by it. Internal callers hold mesh certificates and keep their
/// channels open between calls.
pub const PUBLIC_IDLE: Duration = Duration::from_secs(15 * 60);

/// How often a process looks for renewed certificates on disk.
pub const RELOAD_EVERY: Duration = Duration::from_secs(5);

/// Serves `routes` plus health and reflection on `listener` until `shutdown` completes, then
/// drains for at most `drain`. `names` are the fully-qualified service names reported healthy.
pub async fn serve(
    routes: Routes,
    names: &[&str],
    listener: TcpListener,
    exposure: Exposure,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) -> Result<(), tonic::transport::Error> {
    serve_until(routes, names, listener, exposure, shutdown, drain, CancellationToken::new()).await
}

/// Raises this process's soft limit on open descriptors to its hard limit, once. The soft
/// limit is often 1,024, below the connections a listener takes: accepts would fail for
/// everyone before the gate refused anyone, the very lockout the gate is there to prevent.
fn raise_fd_limit(want: usize) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let limit = raise_soft_fd_limit();
        if limit.is_none_or(|l| l < want as libc::rlim_t) {
            tracing::warn!(
                limit,
                "few open files allowed: a listener's {want} connections may fail to be \
                 accepted before any bound refuses them (raise `ulimit -n`)"
            );
        }
    });
}

/// The soft descriptor limit raised to the hard one: the limit now, if it could be read.
fn raise_soft_fd_limit() -> Option<libc::rlim_t> {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: both calls only read or write the one `rlimit` passed by pointer.
    #[allow(unsafe_code)]
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            return None;
        }
        let mut raised = l;
        raised.rlim_cur = l.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
            l = raised;
        }
    }
    Some(l.rlim_cur)
}

/// Accepts connections on `listener` and hands them on, plaintext or after a TLS handshake
/// with the process's current certificates (a renewed certificate serves the next
/// connection), until the receiver goes away. Connections and handshakes are bounded in
/// number, in all and per client address (`gate::Limits::DEFAULT`), and handshakes in time.
pub fn incoming<IO: Send + 'static>(
    listener: TcpListener,
    idle: Option<Duration>,
    upgrade: impl Fn(TcpStream) -> Pin<Box<dyn Future<Output = std::io::Result<IO>> + Send>>
    + Send
    + 'static,
) -> ReceiverStream<std::io::Result<Held<IO>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    raise_fd_limit(Limits::DEFAULT.connections);
    tokio::spawn(async move {
        let gate = Gate::new(Limits::DEFAULT);
        let mut warned: Option<tokio::time::Instant> = None;
        let mut refused = 0u64;
        loop {
            let accepted = tokio::select! {
                () = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (tcp, from) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("accept failed: {e}; pausing");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let places = gate.connect(from.ip()).and_then(|c| Ok((c, gate.handshake(from.ip())?)));
            let (connection, handshaking) = match places {
                Ok(p) => p,
                Err(full) => {
                    // Closed at once: whoever holds the places, the others still get in.
                    refused += 1;
                    let now = tokio::time::Instant::now();
                    if warned.is_none_or(|w| now.duration_since(w) >= REFUSED_WARN_EVERY) {
                        tracing::warn!(%from, refused, "connection closed: {full}");
                        (warned, refused) = (Some(now), 0);
                    }
                    continue;
                }
            };
            // Tokens are small writes: never hold one back waiting for an ACK.
            let _ = tcp.set_nodelay(true);
            let (tx, handshake) = (tx.clone(), upgrade(tcp));
            tokio::spawn(async move {
                let r = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await;
                drop(handshaking);
                match r {
                    Ok(Ok(io)) => {
                        let _ = tx.send(Ok(Held::new(io, connection, idle))).await;
                    }
                    Ok(Err(e)) => tracing::info!(%from, "TLS handshake failed: {e}"),
                    Err(_) => tracing::info!(%from, "TLS handshake not done in time; closed"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Whether a client on a TLS port speaks plaintext HTTP/2: a TLS handshake starts with a
/// record byte of 0x16, HTTP/2 with "PRI".
async fn speaks_plaintext(tcp: &TcpStream) -> std::io::Result<bool> {
    let mut first = [0u8; 1];
    Ok(tcp.peek(&mut first).await? == 1 && first[0] == b'P')
}

/// A gRPC client speaking plaintext to a TLS port would otherwise see the connection drop
/// with a transport error that names nothing; it gets UNAUTHENTICATED for each call, saying
/// why, until it hangs up (the caller bounds the time).
async fn refuse_plaintext(tcp: TcpStream, exposure: Exposure) {
    let needs = match exposure {
        Exposure::Internal => "TLS with a certificate of the mesh's CA",
        Exposure::Public => "TLS (trusting the mesh's CA) and an API key",
    };
    let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let status = tonic::Status::unauthenticated(format!(
            "{} needs {needs}; this call came in plaintext",
            req.uri().path()
        ));
        std::future::ready(Ok::<_, std::convert::Infallible>(
            status.into_http::<tonic::body::Body>(),
        ))
    });
    let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc);
    let _ = conn.await;
}

/// `serve`; once `unhealthy` is cancelled, health reports NOT_SERVING while calls are still
/// answered (with whatever status the node can give).
pub(crate) async fn serve_until(
    routes: Routes,
    names: &[&str],
    listener: TcpListener,
    exposure: Exposure,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
    unhealthy: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    match crate::tls::current() {
        Some(tls) => {
            crate::tls::watch(RELOAD_EVERY);
            let connections = incoming(listener, exposure.idle(), move |tcp| {
                let config = match exposure {
                    Exposure::Internal => tls.internal_server(),
                    Exposure::Public => tls.public_server(),
                };
                Box::pin(async move {
                    if speaks_plaintext(&tcp).await? {
                        // Within the handshake's slot and time, like any other client.
                        refuse_plaintext(tcp, exposure).await;
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            "a plaintext client (refused with UNAUTHENTICATED)",
                        ));
                    }
                    tokio_rustls::TlsAcceptor::from(config).accept(tcp).await
                })
            });
            serve_on(routes, names, connections, exposure, true, shutdown, drain, unhealthy).await
        }
        None => {
            let connections =
                incoming(listener, exposure.idle(), |tcp| Box::pin(std::future::ready(Ok(tcp))));
            serve_on(routes, names, connections, exposure, false, shutdown, drain, unhealthy).await
        }
    }
}

#[allow(clippy::too_many_arguments)] // serve_until's, passed on
async fn serve_on<IO>(
    routes: Routes,
    names: &[&str],
    connections: ReceiverStream<std::io::Result<IO>>,
    exposure: Exposure,
    enforce: bool,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
    unhealthy: CancellationToken,
) -> Result<(), tonic::transport::Error>
where
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
{
    let (reporter, health) = tonic_health::server::health_reporter();
    for n in names {
        reporter.set_service_status(*n, ServingStatus::Serving).await;
    }
    reporter.set_service_status("", ServingStatus::Serving).await;
    let described = match exposure {
        Exposure::Internal => pdmesh_proto::FILE_DESCRIPTOR_SET,
        Exposure::Public => pdmesh_proto::PUBLIC_FILE_DESCRIPTOR_SET,
    };
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(described)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the embedded descriptor sets are valid");
    let routes = routes.add_service(health).add_service(reflection);

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (stream_window, connection_window, streams) = match exposure {
        // KV blocks are hundreds of KB each: HTTP/2's default 64 KB window would throttle a
        // transfer to a round trip per 64 KB. Every caller here has a mesh certificate.
        Exposure::Internal => (32 << 20, 64 << 20, MAX_STREAMS_PER_CONNECTION),
        // Anyone reaches a public port, before a key is checked: what one connection can
        // make the server hold is what a request needs.
        Exposure::Public => {
            (PUBLIC_STREAM_WINDOW, PUBLIC_CONNECTION_WINDOW, MAX_PUBLIC_STREAMS_PER_CONNECTION)
        }
    };
    let server = tonic::transport::Server::builder()
        .initial_stream_window_size(Some(stream_window))
        .initial_connection_window_size(Some(connection_window))
        // Fewer, larger frames for the same reason (HTTP/2's default is 16 KB).
        .max_frame_size(Some(1 << 20))
        // Bounds a single connection can make a server hold: streams at once and header bytes.
        .max_concurrent_streams(Some(streams))
        .http2_max_header_list_size(Some(MAX_HEADER_BYTES))
        .max_connection_age(MAX_CONNECTION_AGE)
        .max_connection_age_grace(MAX_CONNECTION_AGE_GRACE)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        // Who may call what is decided before a call is traced or handled.
        .layer(crate::authz::AuthzLayer { enforce })
        .layer(crate::trace::TraceLayer)
        .add_routes(routes)
        .serve_with_incoming_shutdown(connections, async {
            let _ = stop_rx.await;
        });
    tokio::pin!(server);
    tokio::pin!(shutdown);
    let set_all = |status| {
        let reporter = reporter.clone();
        async move {
            for n in names {
                reporter.set_service_status(*n, status).await;
            }
            reporter.set_service_status("", status).await;
        }
    };
    let mut healthy = true;
    loop {
        tokio::select! {
            r = &mut server => return r,
            () = &mut shutdown => break,
            () = unhealthy.cancelled(), if healthy => {
                healthy = false;
                set_all(ServingStatus::NotServing).await;
            }
        }
    }
    set_all(ServingStatus::NotServing).await;
    let _ = stop_tx.send(());
    match tokio::time::timeout(drain, &mut server).await {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!("in-flight calls did not finish within {drain:?}; closing them");
            Ok(())
        }
    }
}

/// A stopping node's drain: waits until `busy` (the work it still holds) reaches 0, or until
/// `grace` has passed; says which, naming `what` it waits for.
pub async fn drain_until_idle(what: &str, grace: Duration, busy: impl Fn() -> u32) {
    let until = tokio::time::Instant::now() + grace;
    tracing::info!(
        held = busy(),
        ?grace,
        "draining: waiting for the {what} held to move or finish"
    );
    while busy() > 0 {
        if tokio::time::Instant::now() >= until {
            tracing::warn!(held = busy(), "drain grace period over; stopping with these {what}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::info!("drained");
}

#[cfg(test)]
mod tests {
    /// Started under a soft limit of 256 descriptors (a shell's 1,024 is as far below the
    /// 4,096 connections a listener takes), a service failed accepts for every client once an
    /// attacker held that many sockets, before any bound of the gate refused the attacker.
    #[test]
    fn a_service_lifts_its_descriptor_limit_to_the_hard_one() {
        let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as in `raise_soft_fd_limit`.
        #[allow(unsafe_code)]
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
            let low = libc::rlimit { rlim_cur: l.rlim_max.min(256), rlim_max: l.rlim_max };
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &low), 0);
        }
        assert_eq!(super::raise_soft_fd_limit(), Some(l.rlim_max));
    }
}
