//! Serving: every service gets `grpc.health.v1` and server reflection next to its own services,
//! takes a pre-bound listener (tests bind port 0), and on shutdown flips health to NOT_SERVING,
//! stops accepting, and gives in-flight calls a bounded time to finish.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic_health::ServingStatus;

/// HTTP/2 streams one connection may have open on a server at once.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 2048;
/// Header bytes one request may send (gRPC metadata is small; tonic's default is 16 MB).
pub const MAX_HEADER_BYTES: u32 = 64 << 10;

/// Binds `addr` ("host:port"; port 0 picks one) and returns the listener and its real address.
pub async fn bind(addr: &str) -> std::io::Result<(TcpListener, SocketAddr)> {
    let l = TcpListener::bind(addr).await?;
    let a = l.local_addr()?;
    Ok((l, a))
}

/// Serves `routes` plus health and reflection on `listener` until `shutdown` completes, then
/// drains for at most `drain`. `names` are the fully-qualified service names reported healthy.
pub async fn serve(
    routes: Routes,
    names: &[&str],
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) -> Result<(), tonic::transport::Error> {
    serve_until(routes, names, listener, shutdown, drain, CancellationToken::new()).await
}

/// `serve`; once `unhealthy` is cancelled, health reports NOT_SERVING while calls are still
/// answered (with whatever status the node can give).
async fn serve_until(
    routes: Routes,
    names: &[&str],
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
    unhealthy: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    for n in names {
        reporter.set_service_status(*n, ServingStatus::Serving).await;
    }
    reporter.set_service_status("", ServingStatus::Serving).await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pdmesh_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the embedded descriptor sets are valid");
    let routes = routes.add_service(health).add_service(reflection);

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = crate::tls::current() {
        // Every caller must present a certificate from the mesh CA.
        builder = builder.tls_config(tls.server())?;
    }
    let server = builder
        .tcp_nodelay(true)
        // KV blocks are hundreds of KB each: HTTP/2's default 64 KB window would throttle a
        // transfer to a round trip per 64 KB.
        .initial_stream_window_size(Some(32 << 20))
        .initial_connection_window_size(Some(64 << 20))
        // Fewer, larger frames for the same reason (HTTP/2's default is 16 KB).
        .max_frame_size(Some(1 << 20))
        // Bounds a single connection can make a server hold: streams at once (the router keeps
        // every request to a node on one connection, far below this) and header bytes.
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .http2_max_header_list_size(Some(MAX_HEADER_BYTES))
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .layer(crate::trace::TraceLayer)
        .add_routes(routes)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
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

/// How a worker node serves and takes part in the mesh.
#[derive(Clone)]
pub struct Node<'a> {
    /// Fully-qualified service names reported healthy.
    pub names: &'a [&'a str],
    /// Time in-flight calls get to finish at shutdown.
    pub drain: Duration,
    /// Routers to register with.
    pub routers: &'a [String],
    pub registration: pdmesh_proto::v1::RegisterRequest,
    pub load: crate::membership::LoadFn,
    /// Cancelled when the node can no longer do its work (its engine thread died).
    pub died: CancellationToken,
}

impl std::fmt::Debug for Node<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("names", &self.names).field("routers", &self.routers).finish()
    }
}

/// Serves a worker node: keeps it registered with its routers while it serves, leaves the
/// mesh (stops heartbeating, so routers stop placing new requests on it) as soon as
/// `shutdown` completes, then drains in-flight calls for at most `node.drain`. A node that
/// dies deregisters at once and reports NOT_SERVING, answering calls until it is stopped.
pub async fn serve_node(
    routes: Routes,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    node: Node<'_>,
) -> Result<(), tonic::transport::Error> {
    let stop = CancellationToken::new();
    let _membership = crate::membership::spawn(
        node.routers,
        node.registration,
        node.load,
        stop.clone(),
        node.died.clone(),
    );
    let leave = {
        let stop = stop.clone();
        async move {
            shutdown.await;
            stop.cancel();
        }
    };
    let served = serve_until(routes, node.names, listener, leave, node.drain, node.died).await;
    stop.cancel();
    served
}
