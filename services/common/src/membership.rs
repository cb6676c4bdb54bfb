//! The node side of membership: one session (`Attach`) with every router, carrying the node's
//! load at the router's pace and, for nodes that hold KV for reuse, every block change
//! (`blocks`). Each `--router` is a list entry or a DNS name standing for several routers (a Kubernetes
//! headless Service): names are resolved again every `RESOLVE_EVERY`, and the node keeps one
//! registration per address, so routers that come up are joined and ones that go away are
//! left. A router that restarted or dropped the node ends the session and the node attaches
//! again; an unreachable router is retried with backoff. A node that dies
//! deregisters at once, so no router waits for its heartbeats to lapse. Nothing here blocks
//! the node's work.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use pdmesh_proto::v1::membership_client::MembershipClient;
use pdmesh_proto::v1::node_report::Report;
use pdmesh_proto::v1::router_notice::Notice;
use pdmesh_proto::v1::{
    BlockEvents, BlockSnapshot, DeregisterRequest, NodeHello, NodeLoad, NodeReport,
    RegisterRequest, RouterNotice,
};
use tokio_util::sync::CancellationToken;

use crate::blocks::{BlockLog, Next};

/// Reads a node's current load.
pub type LoadFn = Arc<dyn Fn() -> NodeLoad + Send + Sync>;

/// What a node tells its routers about itself.
#[derive(Clone)]
pub struct Joining {
    pub registration: RegisterRequest,
    pub load: LoadFn,
    /// The blocks it holds for reuse (None: it keeps none, or does not report them).
    pub blocks: Option<Arc<BlockLog>>,
    /// The KV-store it reads from or is, by its advertised address ("" for none).
    pub kvstore: String,
    /// Fault injection for tests: the change with this number is never sent (0: none).
    pub fault_skip_event: u64,
    /// The address its calls to routers leave from (None: the system's choice).
    pub source: Option<IpAddr>,
}

impl Joining {
    /// The source address a node listening on `bound` calls routers from: its own, when that
    /// is a loopback address. Such a node serves only routers on this host (none elsewhere
    /// could call it back), and a host running many nodes on loopback addresses of their own
    /// (`--sim-nodes`) then shows routers many peers, each under the per-address connection
    /// limit, instead of one peer with a thousand sessions.
    pub fn source_for(bound: SocketAddr) -> Option<IpAddr> {
        bound.ip().is_loopback().then_some(bound.ip())
    }

    /// `source`, where a call to `router` ("ip:port") can leave from it: of the same family.
    fn source_to(&self, router: &str) -> Option<IpAddr> {
        let to = router.parse::<SocketAddr>().ok()?;
        self.source.filter(|s| s.is_ipv4() == to.is_ipv4())
    }
}

impl std::fmt::Debug for Joining {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Joining")
            .field("node_id", &self.registration.node_id)
            .field("blocks", &self.blocks.as_ref().map(|b| b.epoch()))
            .field("kvstore", &self.kvstore)
            .finish()
    }
}

/// How often router names are resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(10);

/// Starts one task per `--router` entry that keeps the node attached to every router the
/// entry stands for until `stop` is cancelled, or deregisters it as soon as `died` is.
pub fn spawn(
    routers: &[String],
    who: Joining,
    stop: CancellationToken,
    died: CancellationToken,
) -> Vec<tokio::task::JoinHandle<()>> {
    routers
        .iter()
        .map(|r| {
            let (r, who) = (r.clone(), who.clone());
            let (stop, died) = (stop.clone(), died.clone());
            tokio::spawn(async move { follow(&r, who, stop, died).await })
        })
        .collect()
}

/// Keeps a registration with each address `entry` resolves to, resolving it again every
/// `RESOLVE_EVERY`. An entry that is an address is its own one router.
async fn follow(entry: &str, who: Joining, stop: CancellationToken, died: CancellationToken) {
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
                    let (who, died) = (who.clone(), died.clone());
                    tokio::spawn(async move {
                        tokio::select! {
                            () = keep_registered(&a, &who) => {}
                            () = gone.cancelled() => {}
                            () = died.cancelled() => deregister(&a, &who).await,
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
async fn deregister(router: &str, who: &Joining) {
    let node = who.registration.node_id.as_str();
    let call = async {
        let ep = crate::tls::endpoint(router, crate::tls::MeshRole::Router)
            .map_err(|e| e.to_string())?
            .local_address(who.source_to(router))
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

async fn keep_registered(router: &str, who: &Joining) {
    let mut backoff = Duration::from_millis(100);
    let mut warned = false;
    loop {
        match session(router, who).await {
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

/// Parts of a snapshot hold at most this many blocks (1 MiB).
const SNAPSHOT_PART: usize = 1 << 16;
/// Changes in one `BlockEvents` at most.
const EVENTS_PART: usize = 4096;

/// One session with a router (`Attach`): the hello, a snapshot of the node's blocks, then its
/// load at the router's pace and its block changes as they happen. Returns Ok when the router
/// ended it (it restarted or dropped the node): the node attaches again at once.
async fn session(router: &str, who: &Joining) -> Result<(), String> {
    let ep = crate::tls::endpoint(router, crate::tls::MeshRole::Router)
        .map_err(|e| format!("bad router address {router}: {e}"))?
        .local_address(who.source_to(router))
        .connect_timeout(Duration::from_secs(2))
        // A router that vanishes without closing the connection is found by its pings.
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    let mut client = MembershipClient::new(ep.connect().await.map_err(|e| e.to_string())?);
    let (tx, rx) = tokio::sync::mpsc::channel::<NodeReport>(64);
    let mut node = who.registration.clone();
    node.load = Some((who.load)());
    let hello = NodeHello {
        node: Some(node),
        epoch: who.blocks.as_ref().map_or(0, |b| b.epoch()),
        block_events: who.blocks.is_some(),
        kvstore: who.kvstore.clone(),
    };
    let send = |r: Report| {
        let tx = tx.clone();
        async move { tx.send(NodeReport { report: Some(r) }).await.map_err(|_| "the call ended") }
    };
    send(Report::Hello(hello)).await?;
    let opened = async {
        let mut notices = client
            .attach(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|e| e.message().to_string())?
            .into_inner();
        match notices.message().await.map_err(|e| e.message().to_string())? {
            Some(RouterNotice { notice: Some(Notice::Pace(p)) }) => Ok((notices, p)),
            _ => Err("the router answered the hello with something else".to_string()),
        }
    };
    let (mut notices, pace) = tokio::time::timeout(Duration::from_secs(5), opened)
        .await
        .map_err(|_| "no answer to the hello in 5 s".to_string())??;
    tracing::info!(router, node = who.registration.node_id, "registered");
    let paced = |ms: u32| {
        let every = Duration::from_millis(u64::from(ms.max(10)));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick
    };
    let mut tick = paced(pace.load_every_ms);
    let mut changed = who.blocks.as_ref().map(|b| b.watch());
    // The next change to send; a snapshot first.
    let mut next = match &who.blocks {
        Some(log) => snapshot(log, &send).await?,
        None => 0,
    };
    loop {
        tokio::select! {
            _ = tick.tick() => send(Report::Load((who.load)())).await?,
            r = async { changed.as_mut().expect("guarded").changed().await }, if changed.is_some() => {
                r.map_err(|_| "the block log is gone")?;
                let log = who.blocks.as_ref().expect("a watch comes from a log");
                loop {
                    match log.since(next, EVENTS_PART) {
                        Next::Nothing => break,
                        // Fell behind the ring: what it holds now, and on from there.
                        Next::Behind => next = snapshot(log, &send).await?,
                        Next::Changes { first, changes } => {
                            next = first + changes.len() as u64;
                            // The skipped change splits the batch: the routers see a gap.
                            let skip = who.fault_skip_event.checked_sub(first);
                            let cut = skip.map_or(changes.len(), |s| (s as usize).min(changes.len()));
                            let parts = [(first, &changes[..cut]), (first + cut as u64 + 1, changes.get(cut + 1..).unwrap_or(&[]))];
                            for (from, part) in parts {
                                if part.is_empty() {
                                    continue;
                                }
                                send(Report::Events(BlockEvents {
                                    epoch: log.epoch(),
                                    first_seq: from,
                                    oldest_unix_us: part[0].at_us,
                                    changes: crate::blocks::encode(part).into(),
                                }))
                                .await?;
                            }
                        }
                    }
                }
            }
            n = notices.message() => match n {
                Ok(Some(RouterNotice { notice: Some(Notice::Pace(p)) })) => tick = paced(p.load_every_ms),
                Ok(Some(RouterNotice { notice: Some(Notice::Resync(why)) })) => {
                    tracing::info!(router, "router asked for a snapshot: {why}");
                    if let Some(log) = &who.blocks {
                        next = snapshot(log, &send).await?;
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => return Ok(()),
                Err(s) if s.code() == tonic::Code::NotFound => {
                    tracing::info!(router, node = who.registration.node_id, "router forgot this node; attaching again");
                    return Ok(());
                }
                Err(s) => return Err(s.message().to_string()),
            },
        }
    }
}

/// Sends every block `log` holds; returns the number of the first change after them.
async fn snapshot<F, Fut>(log: &BlockLog, send: &F) -> Result<u64, String>
where
    F: Fn(Report) -> Fut,
    Fut: Future<Output = Result<(), &'static str>>,
{
    let (seq, held) = log.snapshot();
    // An empty cache is one empty part: the router still learns where events start.
    let parts = held.len().div_ceil(SNAPSHOT_PART).max(1);
    for i in 0..parts {
        let part = held.get(i * SNAPSHOT_PART..).unwrap_or(&[]);
        let part = &part[..part.len().min(SNAPSHOT_PART)];
        let blocks: Vec<u8> = part.iter().flat_map(|b| b.to_le_bytes()).collect();
        let more = i + 1 < parts;
        let msg = BlockSnapshot { epoch: log.epoch(), seq, blocks: blocks.into(), more };
        send(Report::Snapshot(msg)).await?;
    }
    Ok(seq + 1)
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
