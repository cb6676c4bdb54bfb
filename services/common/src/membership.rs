//! The node side of membership: register with every router, then heartbeat the node's load.
//! A router that restarted or dropped the node answers `known = false` and the node registers
//! again; an unreachable router is retried with backoff. A node that dies deregisters at once,
//! so no router waits for its heartbeats to lapse. Nothing here blocks the node's work.

use std::sync::Arc;
use std::time::Duration;

use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::{DeregisterRequest, HeartbeatRequest, NodeLoad, RegisterRequest};
use tokio_util::sync::CancellationToken;

/// Reads a node's current load.
pub type LoadFn = Arc<dyn Fn() -> NodeLoad + Send + Sync>;

/// Starts one task per router that keeps `registration` registered and heartbeating until
/// `stop` is cancelled, or deregisters it as soon as `died` is.
pub fn spawn(
    routers: &[String],
    registration: RegisterRequest,
    load: LoadFn,
    stop: CancellationToken,
    died: CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    routers
        .iter()
        .map(|r| {
            let (r, reg, load) = (r.clone(), registration.clone(), load.clone());
            let (stop, died) = (stop.clone(), died.clone());
            tokio::spawn(async move {
                tokio::select! {
                    () = keep_registered(&r, reg.clone(), load) => {}
                    () = stop.cancelled() => {}
                    () = died.cancelled() => deregister(&r, &reg.node_id).await,
                }
            })
        })
        .collect()
}

/// Tells `router` that `node` is gone (best effort: a router that cannot be reached drops the
/// node when its heartbeats lapse).
async fn deregister(router: &str, node: &str) {
    let call = async {
        let ep = crate::tls::endpoint(router)
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(2));
        let mut client = MembershipClient::new(ep.connect().await.map_err(|e| e.to_string())?);
        let req = DeregisterRequest {
            node_id: node.to_string(),
            reason: "its engine thread died".into(),
        };
        client.deregister(req).await.map_err(|e| e.message().to_string())
    };
    match call.await {
        Ok(_) => tracing::warn!(router, node, "deregistered: the node can no longer serve"),
        Err(e) => tracing::warn!(router, node, "could not deregister ({e}); heartbeats stop"),
    }
}

async fn keep_registered(router: &str, reg: RegisterRequest, load: LoadFn) {
    let mut backoff = Duration::from_millis(100);
    let mut warned = false;
    loop {
        match session(router, &reg, &load).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                if !warned {
                    tracing::warn!(router, "membership: {e}; retrying");
                    warned = true;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// One registration and its heartbeats; returns Ok when the router forgot the node.
async fn session(router: &str, reg: &RegisterRequest, load: &LoadFn) -> Result<(), String> {
    let ep = crate::tls::endpoint(router)
        .map_err(|e| format!("bad router address {router}: {e}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    let mut client = MembershipClient::new(ep.connect().await.map_err(|e| e.to_string())?);
    let mut req = reg.clone();
    req.load = Some(load());
    let resp = client.register(req).await.map_err(|e| e.message().to_string())?.into_inner();
    tracing::info!(router, node = reg.node_id, "registered");
    let every = Duration::from_millis(u64::from(resp.heartbeat_interval_ms.max(10)));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let hb = HeartbeatRequest { node_id: reg.node_id.clone(), load: Some(load()) };
        let known = client.heartbeat(hb).await.map_err(|e| e.message().to_string())?;
        if !known.into_inner().known {
            tracing::info!(
                router,
                node = reg.node_id,
                "router forgot this node; registering again"
            );
            return Ok(());
        }
    }
}
