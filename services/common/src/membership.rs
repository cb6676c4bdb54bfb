//! The node side of membership: register with every router, then heartbeat the node's load.
//! Each `--router` is a list entry or a DNS name standing for several routers (a Kubernetes
//! headless Service): names are resolved again every `RESOLVE_EVERY`, and the node keeps one
//! registration per address, so routers that come up are joined and ones that go away are
//! left. A router that restarted or dropped the node answers `known = false` and the node
//! registers again; an unreachable router is retried with backoff. A node that dies
//! deregisters at once, so no router waits for its heartbeats to lapse. Nothing here blocks
//! the node's work.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::{DeregisterRequest, HeartbeatRequest, NodeLoad, RegisterRequest};
use tokio_util::sync::CancellationToken;

/// Reads a node's current load.
pub type LoadFn = Arc<dyn Fn() -> NodeLoad + Send + Sync>;

/// How often router names are resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(10);

/// Starts one task per `--router` entry that keeps `registration` registered and heartbeating
/// with every router the entry stands for until `stop` is cancelled, or deregisters it as soon
/// as `died` is.
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
            tokio::spawn(async move { follow(&r, reg, load, stop, died).await })
        })
        .collect()
}

/// Keeps a registration with each address `entry` resolves to, resolving it again every
/// `RESOLVE_EVERY`. An entry that is an address is its own one router.
async fn follow(
    entry: &str,
    reg: RegisterRequest,
    load: LoadFn,
    stop: CancellationToken,
    died: CancellationToken,
) {
    let mut sessions: HashMap<String, CancellationToken> = HashMap::new();
    let mut warned = false;
    loop {
        match resolve(entry, crate::tls::current().is_none()).await {
            Ok(addrs) => {
                warned = false;
                let (join, leave) = changes(&sessions.keys().cloned().collect(), &addrs);
                for a in leave {
                    tracing::info!(router = a, entry, "router gone from {entry}; leaving it");
                    if let Some(t) = sessions.remove(&a) {
                        t.cancel();
                    }
                }
                for a in join {
                    let gone = stop.child_token();
                    sessions.insert(a.clone(), gone.clone());
                    let (reg, load, died) = (reg.clone(), load.clone(), died.clone());
                    tokio::spawn(async move {
                        tokio::select! {
                            () = keep_registered(&a, reg.clone(), load) => {}
                            () = gone.cancelled() => {}
                            () = died.cancelled() => deregister(&a, &reg.node_id).await,
                        }
                    });
                }
            }
            // Routers already joined are kept: a name server that is down says nothing.
            Err(e) if !warned => {
                tracing::warn!(entry, "cannot resolve the router address: {e}; retrying");
                warned = true;
            }
            Err(_) => {}
        }
        tokio::select! {
            () = tokio::time::sleep(RESOLVE_EVERY) => {}
            () = stop.cancelled() => return,
            () = died.cancelled() => {
                // Each session deregisters; give them the time to.
                tokio::time::sleep(Duration::from_secs(3)).await;
                return;
            }
        }
    }
}

/// The addresses behind `entry` ("host:port"), as "ip:port" strings. A `plaintext` node
/// (`--insecure`) keeps only loopback ones, every time: a name checked at start can resolve
/// elsewhere later, and the node would then register, unencrypted, with whoever is there.
async fn resolve(entry: &str, plaintext: bool) -> std::io::Result<BTreeSet<String>> {
    let all: Vec<SocketAddr> = match entry.parse::<SocketAddr>() {
        Ok(a) => vec![a],
        Err(_) => tokio::net::lookup_host(entry).await?.collect(),
    };
    let (kept, far): (Vec<SocketAddr>, Vec<SocketAddr>) =
        all.into_iter().partition(|a| !plaintext || a.ip().is_loopback());
    if !far.is_empty() {
        tracing::warn!(entry, ?far, "--insecure: not joining routers off this machine");
    }
    Ok(kept.into_iter().map(|a| a.to_string()).collect())
}

/// Which addresses to join and which to leave, going from `current` to `resolved`.
fn changes(current: &BTreeSet<String>, resolved: &BTreeSet<String>) -> (Vec<String>, Vec<String>) {
    let join = resolved.difference(current).cloned().collect();
    let leave = current.difference(resolved).cloned().collect();
    (join, leave)
}

/// Tells `router` that `node` is gone (best effort: a router that cannot be reached drops the
/// node when its heartbeats lapse).
async fn deregister(router: &str, node: &str) {
    let call = async {
        let ep = crate::tls::endpoint(router, crate::tls::MeshRole::Router)
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
    let ep = crate::tls::endpoint(router, crate::tls::MeshRole::Router)
        .map_err(|e| format!("bad router address {router}: {e}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5));
    let mut client = MembershipClient::new(ep.connect().await.map_err(|e| e.to_string())?);
    let mut req = reg.clone();
    req.load = Some(load());
    let resp = client.register(req).await.map_err(|e| e.message().to_string())?.into_inner();
    tracing::info!(router, node = reg.node_id, "registered");
    let paced = |ms: u32| {
        let every = Duration::from_millis(u64::from(ms.max(10)));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        (ms, tick)
    };
    let (mut every, mut tick) = paced(resp.heartbeat_interval_ms);
    loop {
        tick.tick().await;
        let hb = HeartbeatRequest { node_id: reg.node_id.clone(), load: Some(load()) };
        let r = client.heartbeat(hb).await.map_err(|e| e.message().to_string())?.into_inner();
        // The router spaces heartbeats out as its mesh grows (0: an older router).
        if r.heartbeat_interval_ms != 0 && r.heartbeat_interval_ms != every {
            (every, tick) = paced(r.heartbeat_interval_ms);
        }
        if !r.known {
            tracing::info!(
                router,
                node = reg.node_id,
                "router forgot this node; registering again"
            );
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name an `--insecure` node checked at start later resolves off the machine (DNS
    /// changed, or someone changed it): each resolution keeps loopback addresses alone.
    #[tokio::test]
    async fn a_plaintext_node_joins_only_routers_on_this_machine() {
        assert!(resolve("192.0.2.1:50052", true).await.unwrap().is_empty());
        assert_eq!(resolve("192.0.2.1:50052", false).await.unwrap(), set(&["192.0.2.1:50052"]));
        assert_eq!(resolve("127.0.0.1:50052", true).await.unwrap(), set(&["127.0.0.1:50052"]));
        let local = resolve("localhost:50052", true).await.unwrap();
        assert!(local.iter().all(|a| a.parse::<SocketAddr>().unwrap().ip().is_loopback()));
    }

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn routers_that_appear_are_joined_and_ones_that_vanish_are_left() {
        let (join, leave) = changes(&set(&[]), &set(&["10.0.0.1:50052", "10.0.0.2:50052"]));
        assert_eq!((join.len(), leave.len()), (2, 0));
        let (join, leave) = changes(
            &set(&["10.0.0.1:50052", "10.0.0.2:50052"]),
            &set(&["10.0.0.2:50052", "10.0.0.3:50052"]),
        );
        assert_eq!(join, ["10.0.0.3:50052"]);
        assert_eq!(leave, ["10.0.0.1:50052"]);
        let same = set(&["10.0.0.2:50052"]);
        assert_eq!(changes(&same, &same), (vec![], vec![]));
    }

    #[tokio::test]
    async fn an_address_is_its_own_router_and_a_name_stands_for_each_of_its_addresses() {
        assert_eq!(resolve("127.0.0.1:50052", false).await.unwrap(), set(&["127.0.0.1:50052"]));
        let local = resolve("localhost:50052", false).await.unwrap();
        assert!(!local.is_empty() && local.iter().all(|a| a.ends_with(":50052")), "{local:?}");
        assert!(resolve("no-such-host.invalid:50052", false).await.is_err());
    }
}
