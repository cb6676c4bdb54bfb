//! The start-up and life every worker node (prefill, decode, KV-store) shares: who it is (the
//! address it is bound to, the one others dial, its name), what it registers as with its
//! routers, and serving until it stops. A node brings only what is its own: its gRPC service,
//! its KV layout, its load report and its engine thread.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdmesh_proto::v1::{KvLayout, RegisterRequest, Role};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

use crate::blocks::BlockLog;
use crate::membership::{Joining, LoadFn};
use crate::serve::Exposure;

/// Who a node is in the mesh.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The address its listener is bound to.
    pub bound: SocketAddr,
    /// The address others dial (its advertised one, else `bound`).
    pub address: String,
    /// Its name in statuses, logs and stats.
    pub node_id: String,
}

impl Identity {
    /// `kind`'s node on `listener`: `advertise` or the bound address; `node_id` or
    /// `<kind>@<address>`.
    pub fn of(
        listener: &TcpListener,
        kind: &str,
        advertise: Option<&str>,
        node_id: Option<&str>,
    ) -> std::io::Result<Self> {
        let bound = listener.local_addr()?;
        let address = advertise.map_or_else(|| bound.to_string(), str::to_string);
        let node_id = node_id.map_or_else(|| format!("{kind}@{address}"), str::to_string);
        Ok(Self { bound, address, node_id })
    }
}

/// What one node kind brings to `serve`.
pub struct Worker {
    pub role: Role,
    /// Fully-qualified gRPC service names reported healthy.
    pub names: &'static [&'static str],
    pub routes: Routes,
    /// The KV layout it holds or reads, which routers pair nodes by.
    pub layout: KvLayout,
    /// Its load, as heartbeats report it.
    pub load: LoadFn,
    /// The blocks it holds for reuse (None: it keeps none, or does not report them).
    pub blocks: Option<Arc<BlockLog>>,
    /// The KV-store it reads from or is, by its advertised address ("" for none).
    pub kvstore: String,
    /// Fault injection for tests: the block event with this number is never sent (0: none).
    pub fault_skip_event: u64,
    /// Its engine thread (None: it has none): joined once serving ends, and while it runs,
    /// cancelling its token takes the node out of the mesh.
    pub engine: Option<(std::thread::JoinHandle<()>, CancellationToken)>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("role", &self.role).field("names", &self.names).finish()
    }
}

/// How long a node keeps serving in-flight calls once it stops, and whom it joins.
#[derive(Debug, Clone, Copy)]
pub struct Membership<'a> {
    /// Time in-flight calls get to finish at shutdown.
    pub drain: Duration,
    /// Routers to register with.
    pub routers: &'a [String],
}

/// Serves a worker node: keeps it registered with its routers while it serves, leaves the
/// mesh (stops heartbeating, so routers stop placing new requests on it) as soon as
/// `stopping` completes, then drains in-flight calls for at most `membership.drain`, and
/// joins its engine thread. A node whose engine dies deregisters at once and reports
/// NOT_SERVING, answering calls until it is stopped.
pub async fn serve(
    me: Identity,
    worker: Worker,
    listener: TcpListener,
    membership: Membership<'_>,
    stopping: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (thread, died) = match worker.engine {
        Some((thread, died)) => (Some(thread), died),
        // Nothing to lose: a token never cancelled.
        None => (None, CancellationToken::new()),
    };
    let joining = Joining {
        registration: RegisterRequest {
            node_id: me.node_id,
            role: worker.role as i32,
            address: me.address,
            layout: Some(worker.layout),
            load: None,
        },
        load: worker.load,
        blocks: worker.blocks,
        kvstore: worker.kvstore,
        fault_skip_event: worker.fault_skip_event,
        source: Joining::source_for(me.bound),
    };
    let stop = CancellationToken::new();
    let _membership =
        crate::membership::spawn(membership.routers, joining, stop.clone(), died.clone());
    let leave = {
        let stop = stop.clone();
        async move {
            stopping.await;
            stop.cancel();
        }
    };
    let served = crate::serve::serve_until(
        worker.routes,
        worker.names,
        listener,
        Exposure::Internal,
        leave,
        membership.drain,
        died,
    )
    .await;
    stop.cancel();
    // The service (and with it the engine's command sender) is gone; the thread ends once
    // in-flight requests are done or cancelled.
    if let Some(t) = thread {
        let _ = tokio::task::spawn_blocking(move || t.join()).await;
    }
    served
}
