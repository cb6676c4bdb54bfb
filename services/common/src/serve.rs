//! Serving: every service gets `grpc.health.v1` and server reflection next to its own services,
//! takes a pre-bound listener (tests bind port 0), and on shutdown flips health to NOT_SERVING,
//! stops accepting, and gives in-flight calls a bounded time to finish.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::Routes;
use tonic_health::ServingStatus;

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
    let server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        // KV blocks are hundreds of KB each: HTTP/2's default 64 KB window would throttle a
        // transfer to a round trip per 64 KB.
        .initial_stream_window_size(Some(32 << 20))
        .initial_connection_window_size(Some(64 << 20))
        // Fewer, larger frames for the same reason (HTTP/2's default is 16 KB).
        .max_frame_size(Some(1 << 20))
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .layer(crate::trace::TraceLayer)
        .add_routes(routes)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
            let _ = stop_rx.await;
        });
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => return r,
        () = shutdown => {}
    }
    for n in names {
        reporter.set_service_status(*n, ServingStatus::NotServing).await;
    }
    reporter.set_service_status("", ServingStatus::NotServing).await;
    let _ = stop_tx.send(());
    match tokio::time::timeout(drain, &mut server).await {
        Ok(r) => r,
        Err(_) => {
            tracing::warn!("in-flight calls did not finish within {drain:?}; closing them");
            Ok(())
        }
    }
}

/// Serves a worker node: keeps it registered with `routers` while it serves, leaves the mesh
/// (stops heartbeating, so routers stop placing new requests on it) as soon as `shutdown`
/// completes, then drains in-flight calls for at most `drain`.
#[allow(clippy::too_many_arguments)]
pub async fn serve_node(
    routes: Routes,
    names: &[&str],
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
    routers: &[String],
    registration: pdmesh_proto::v1::RegisterRequest,
    load: crate::membership::LoadFn,
) -> Result<(), tonic::transport::Error> {
    let stop = tokio_util::sync::CancellationToken::new();
    let _membership = crate::membership::spawn(routers, registration, load, stop.clone());
    let leave = {
        let stop = stop.clone();
        async move {
            shutdown.await;
            stop.cancel();
        }
    };
    let served = serve(routes, names, listener, leave, drain).await;
    stop.cancel();
    served
}
