//! The `Membership` service nodes call: `Attach`, each node's one session carrying its load
//! and its block events into the registry and the KV index; the unary `Register` and
//! `Heartbeat` of nodes that send no events (estimated in the index); `Deregister`; and
//! `ListNodes` with what the index holds for each node. With TLS, a node speaks only for
//! itself: the name and role in its certificate.

use std::pin::Pin;
use std::time::{Duration, Instant};

use pdmesh_common::blocks;
use pdmesh_common::tls::{MeshRole, Peer};
use pdmesh_proto::v1::membership_server::Membership;
use pdmesh_proto::v1::node_report::Report;
use pdmesh_proto::v1::router_notice::Notice;
use pdmesh_proto::v1::{
    DeregisterRequest, DeregisterResponse, HeartbeatRequest, HeartbeatResponse, ListNodesRequest,
    ListNodesResponse, NodeReport, NodeStatus, Pace, RegisterRequest, RegisterResponse, Role,
    RouterNotice,
};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::index::{Attaching, Refused};
use crate::mesh::Mesh;
use crate::registry::Node;
use crate::service::RouterService;

/// Longest a node may take to say hello once its call is open.
const HELLO_WITHIN: Duration = Duration::from_secs(5);

/// With TLS, a node registers and reports only as itself: the node id must be the name in
/// its certificate, and the role its certificate's (`authz` has already checked that the
/// caller is a node at all).
fn speaks_as(peer: Option<&Peer>, node_id: &str, role: Option<Role>) -> Result<(), Status> {
    let Some(peer) = peer else { return Ok(()) };
    if peer.name != node_id {
        return Err(Status::permission_denied(format!(
            "{} may not speak for node {node_id:?}: a node registers and reports only as the \
             name in its certificate",
            peer.name
        )));
    }
    let certified = match peer.role {
        MeshRole::Prefill => Role::Prefill,
        MeshRole::Decode => Role::Decode,
        MeshRole::KvStore => Role::Kvstore,
        _ => Role::Unspecified,
    };
    match role {
        Some(r) if r != certified => Err(Status::permission_denied(format!(
            "{} registers as {} but its certificate is for a {}",
            peer.name,
            r.as_str_name(),
            peer.role
        ))),
        _ => Ok(()),
    }
}

fn speaks_for<T>(req: &Request<T>, node_id: &str, role: Option<Role>) -> Result<(), Status> {
    speaks_as(pdmesh_common::authz::caller(req), node_id, role)
}

impl RouterService {
    /// The role `node_id` registered in: a departure must come from a certificate of that
    /// role, not only of that name.
    fn registered_role(&self, node_id: &str) -> Option<Role> {
        self.mesh().registry().get(node_id).map(|n| n.role)
    }

    /// Checks a node's registration and puts it in the registry, its index entry emptied
    /// first (`index`: how it reports blocks) so no placement sees a new epoch's node with
    /// the old one's blocks; returns its index session, how often it should report its load
    /// and how long its silence is borne.
    fn join(
        &self,
        peer: Option<&Peer>,
        r: &RegisterRequest,
        index: impl FnOnce(Role) -> Attaching,
    ) -> Result<(u64, Duration, Duration), Status> {
        let role = Role::try_from(r.role).unwrap_or(Role::Unspecified);
        if role == Role::Unspecified {
            return Err(Status::invalid_argument("role: must be prefill, decode or kvstore"));
        }
        speaks_as(peer, &r.node_id, Some(role))?;
        if r.node_id.is_empty() || r.address.is_empty() {
            return Err(Status::invalid_argument("node_id and address are required"));
        }
        let layout =
            r.layout.as_ref().ok_or_else(|| Status::invalid_argument("layout is required"))?;
        let layout = pdmesh_proto::layout_from_wire(layout)
            .map_err(|e| Status::invalid_argument(format!("layout: {e}")))?;
        let Some(pool) = self.mesh().pool_of(layout.model_fingerprint).cloned() else {
            // Its tokens would be no served model's: joining would serve wrong answers.
            let ours: Vec<String> =
                self.mesh().pools().iter().map(|p| format!("{:016x}", p.fingerprint())).collect();
            let ours = ours.join(", ");
            tracing::warn!(
                node = r.node_id,
                "refused: node serves model {:016x}, this router serves {ours}",
                layout.model_fingerprint
            );
            self.mesh().metrics.refused("model");
            return Err(Status::failed_precondition(format!(
                "node {} serves model {:016x}; this router serves {ours}",
                r.node_id, layout.model_fingerprint
            )));
        };
        let now = Instant::now();
        let session;
        let (every, ttl) = {
            let mut reg = self.mesh().registry();
            // KV moves only between nodes of one layout: a node whose blocks differ from its
            // pool's (another dtype or block size) could serve no request with the others.
            let same_model = |n: &&Node| n.layout.model_fingerprint == layout.model_fingerprint;
            if let Some(other) = reg
                .iter()
                .filter(same_model)
                .find(|n| n.id != r.node_id && n.layout != layout)
                .cloned()
            {
                let g = |l: &pdmesh_kv_types::KvLayout| {
                    format!("{} in blocks of {}", l.geometry.dtype.name(), l.geometry.block_size)
                };
                tracing::warn!(
                    node = r.node_id,
                    mesh_node = other.id,
                    "refused: KV layout differs"
                );
                self.mesh().metrics.refused("layout");
                return Err(Status::failed_precondition(format!(
                    "node {} keeps KV as {}; the mesh's nodes ({}) keep it as {}: KV could not \
                     move between them",
                    r.node_id,
                    g(&layout),
                    other.id,
                    g(&other.layout)
                )));
            }
            // A new node at an address that a departed node used: its old channel is stale.
            if reg.get(&r.node_id).is_none() {
                self.mesh().drop_channel(&r.address);
            }
            let load = r.load.unwrap_or_default();
            session = self.mesh().index.attach(&r.node_id, &index(role));
            reg.register(&r.node_id, role, &r.address, layout, load, now);
            // Told under the same lock it registered under: the node is there.
            let every = reg.get(&r.node_id).map_or_else(|| reg.beat_every(), |n| n.every);
            let ttl = reg.get(&r.node_id).map(|n| reg.ttl_of(n));
            (every, ttl.unwrap_or(Duration::from_millis(u64::from(self.mesh().config.node_ttl_ms))))
        };
        pool.set_layout(layout);
        if matches!(role, Role::Prefill | Role::Decode) {
            self.mesh().warm_channel(&r.node_id, &r.address, role);
        }
        pool.queue.wake();
        tracing::info!(
            node = r.node_id,
            role = role.as_str_name(),
            address = r.address,
            "node joined"
        );
        Ok((session, every, ttl))
    }
}

fn pace(every: Duration, ttl: Duration) -> RouterNotice {
    let ms = |d: Duration| d.as_millis().min(u128::from(u32::MAX)) as u32;
    RouterNotice {
        notice: Some(Notice::Pace(Pace { load_every_ms: ms(every), node_ttl_ms: ms(ttl) })),
    }
}

type Notices = Pin<Box<dyn Stream<Item = Result<RouterNotice, Status>> + Send>>;

#[tonic::async_trait]
impl Membership for RouterService {
    type AttachStream = Notices;

    async fn attach(
        &self,
        req: Request<Streaming<NodeReport>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let peer = pdmesh_common::authz::caller(&req).cloned();
        let mut reports = req.into_inner();
        let first = tokio::time::timeout(HELLO_WITHIN, reports.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no hello within 5 s of attaching"))??;
        let Some(NodeReport { report: Some(Report::Hello(hello)) }) = first else {
            return Err(Status::invalid_argument("the first report of a session must be a hello"));
        };
        let node = hello.node.ok_or_else(|| Status::invalid_argument("hello.node is required"))?;
        let has_cache = node.load.is_some_and(|l| l.cache_blocks > 0);
        let (session, every, ttl) = self.join(peer.as_ref(), &node, |role| Attaching {
            epoch: hello.epoch,
            events: hello.block_events,
            has_cache,
            kvstore: hello.kvstore.clone(),
            is_store: role == Role::Kvstore,
        })?;
        let (tx, rx) = mpsc::channel(8);
        tx.try_send(Ok(pace(every, ttl))).expect("a fresh channel has room");
        let mesh = std::sync::Arc::clone(self.mesh());
        tokio::spawn(async move {
            follow(&mesh, &node.node_id, session, (every, ttl), reports, &tx).await;
            mesh.index.detach(&node.node_id, session);
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn register(
        &self,
        req: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let peer = pdmesh_common::authz::caller(&req).cloned();
        let r = req.into_inner();
        // Registered without a session: no events, so estimated (and empty, as a node that
        // registers first or again after a restart is).
        let has_cache = r.load.is_some_and(|l| l.cache_blocks > 0);
        let (_, every, ttl) = self.join(peer.as_ref(), &r, |role| Attaching {
            has_cache,
            is_store: role == Role::Kvstore,
            ..Attaching::default()
        })?;
        Ok(Response::new(RegisterResponse {
            heartbeat_interval_ms: every.as_millis() as u32,
            node_ttl_ms: ttl.as_millis() as u32,
        }))
    }

    async fn heartbeat(
        &self,
        req: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let every = {
            // One lock for the check and the beat: heartbeats are the router's steadiest load.
            let mut reg = self.mesh().registry();
            let r = req.get_ref();
            speaks_for(&req, &r.node_id, reg.get(&r.node_id).map(|n| n.role))?;
            reg.heartbeat(&r.node_id, r.load.unwrap_or_default(), Instant::now())
        };
        // The node's free blocks are news to requests waiting for room.
        self.mesh().wake();
        Ok(Response::new(HeartbeatResponse {
            known: every.is_some(),
            heartbeat_interval_ms: every.map_or(0, |d| d.as_millis() as u32),
        }))
    }

    async fn deregister(
        &self,
        req: Request<DeregisterRequest>,
    ) -> Result<Response<DeregisterResponse>, Status> {
        speaks_for(&req, &req.get_ref().node_id, self.registered_role(&req.get_ref().node_id))?;
        let r = req.into_inner();
        let known = self.mesh().registry().remove(&r.node_id);
        if known {
            self.mesh().index.forget(&r.node_id);
            tracing::warn!(node = r.node_id, reason = r.reason, "node left the mesh");
        }
        Ok(Response::new(DeregisterResponse { known }))
    }

    async fn list_nodes(
        &self,
        _: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let now = Instant::now();
        let nodes = self.mesh().registry().all();
        let nodes = nodes
            .into_iter()
            .map(|n| {
                let (state, blocks, digest, epoch) = self.mesh().index.status(&n.id);
                NodeStatus {
                    node_id: n.id,
                    role: n.role as i32,
                    address: n.address,
                    layout: Some(n.layout.into()),
                    load: Some(n.load),
                    since_heartbeat_ms: now.duration_since(n.last_seen).as_millis() as u64,
                    index: state.name().into(),
                    index_blocks: blocks as u64,
                    index_digest: digest,
                    epoch,
                }
            })
            .collect();
        Ok(Response::new(ListNodesResponse { nodes }))
    }
}

/// Applies a node's reports until its session ends: load into the registry (its pace told
/// again when the mesh's size changes it), snapshots and events into the index. A gap asks
/// the node for a snapshot; a malformed report ends the session with INVALID_ARGUMENT; a node
/// the registry dropped is told NOT_FOUND, and attaches again.
async fn follow(
    mesh: &Mesh,
    id: &str,
    session: u64,
    (mut every, ttl): (Duration, Duration),
    mut reports: Streaming<NodeReport>,
    tx: &mpsc::Sender<Result<RouterNotice, Status>>,
) {
    let end = |s: Status| async move {
        let _ = tx.send(Err(s)).await;
    };
    loop {
        let next = tokio::select! {
            m = reports.message() => m,
            () = tx.closed() => return,
        };
        let report = match next {
            Ok(Some(NodeReport { report: Some(r) })) => r,
            Ok(Some(NodeReport { report: None })) => continue,
            Ok(None) => return,
            Err(s) => {
                tracing::debug!(node = id, "session ended: {}", s.message());
                return;
            }
        };
        let applied = match report {
            Report::Hello(_) => {
                return end(Status::invalid_argument("a session says hello once")).await;
            }
            Report::Load(load) => {
                let beat = {
                    let mut reg = mesh.registry();
                    let every = reg.heartbeat(id, load, Instant::now());
                    every.map(|e| (e, reg.get(id).map_or(ttl, |n| reg.ttl_of(n))))
                };
                let Some((now_every, now_ttl)) = beat else {
                    let why = "this router dropped the node (it was silent too long): attach again";
                    return end(Status::not_found(why)).await;
                };
                mesh.wake();
                if now_every != every {
                    every = now_every;
                    if tx.send(Ok(pace(every, now_ttl))).await.is_err() {
                        return;
                    }
                }
                Ok(())
            }
            Report::Snapshot(s) => {
                let Some(b) = blocks::decode_blocks(&s.blocks) else {
                    let why = format!(
                        "snapshot.blocks: {} bytes are not whole 16-byte hashes",
                        s.blocks.len()
                    );
                    return end(Status::invalid_argument(why)).await;
                };
                mesh.index.snapshot(id, session, s.epoch, s.seq, &b, s.more)
            }
            Report::Events(e) => {
                let Some(changes) = blocks::decode(&e.changes) else {
                    let why = "events.changes: not whole 17-byte records of kind 0 or 1";
                    return end(Status::invalid_argument(why)).await;
                };
                let r = mesh.index.events(id, session, e.epoch, e.first_seq, &changes);
                if r.is_ok() && !changes.is_empty() {
                    let age = blocks::now_us().saturating_sub(e.oldest_unix_us);
                    mesh.metrics.index_applied(changes.len(), age as f64 / 1e6);
                }
                r
            }
        };
        match applied {
            Ok(()) => {}
            Err(Refused::Resync(why)) => {
                tracing::info!(node = id, "asking for a snapshot: {why}");
                mesh.metrics.index_resync();
                let n = RouterNotice { notice: Some(Notice::Resync(why)) };
                if tx.send(Ok(n)).await.is_err() {
                    return;
                }
            }
            Err(Refused::Stale) => return,
            Err(e @ Refused::TooMany) => tracing::warn!(node = id, "{e}"),
        }
    }
}
