//! What a transport's receiving half delivers into: the decode node's reservations, behind an
//! async interface (`KvInbox`) the node implements over its engine thread. Each transport's
//! receiving half (`grpc::receive_push`, `session::accept_session`) lives next to its
//! sending half; what they share — the header check, the span, the end-of-session notice —
//! is here.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pdmesh_common::ids::Capability;
use pdmesh_common::trace;
use pdmesh_kv_types::KvLayout;
use pdmesh_proto::v1::KvHeader;
use tonic::Status;
use tracing::Span;
use tracing::field::Empty;

use crate::stats::TransferStats;

/// The decode node as the receiving halves see it. Errors are statuses that already name the
/// node.
#[async_trait::async_trait]
pub trait KvInbox: Send + Sync + 'static {
    fn node_id(&self) -> &str;
    fn layout(&self) -> &KvLayout;
    fn stats(&self) -> &TransferStats;
    /// A transfer into the reservation `cap` names begins, from `from`; a `remote` sender
    /// puts the blocks itself, into the memory whose grant has this digest (it must be the
    /// reservation's own). Returns the reservation's key for the calls that follow.
    async fn begin(&self, cap: Capability, from: &str, remote: Option<u64>) -> Result<u64, Status>;
    /// Whole blocks of a streamed transfer.
    async fn write(&self, reservation: u64, first_block: usize, data: Bytes) -> Result<(), Status>;
    /// The sender says the KV is complete. Returns how long copying it from staging blocks
    /// into the pool took, when it was put into staging blocks.
    async fn end(
        &self,
        reservation: u64,
        blocks: usize,
        checksums: Vec<u64>,
    ) -> Result<Option<Duration>, Status>;
    /// The remote writer of `reservation` gave up its session and will stream the KV
    /// instead: the reservation moves onto blocks the writer cannot reach.
    async fn writer_abandoned(&self, reservation: u64) -> Result<(), Status>;
    /// The transfer broke; `why` says how.
    async fn abort(&self, reservation: u64, from: &str, why: String);
    /// A remote writer's session ended, however it ended: it can put no more, so the
    /// blocks it was granted may be reused. Streams do not report their end: they write
    /// nothing once it comes.
    fn closed(&self, reservation: u64);
    /// The KV pool as a one-sided transport offers it to writers; `None` when the KV arrives
    /// over streams only.
    fn pool(&self) -> Option<&Arc<dyn crate::PoolOffer>> {
        None
    }
}

/// Reports a transfer's stream closed when dropped, however the handler exits.
pub(crate) struct ClosedOnDrop {
    pub inbox: Arc<dyn KvInbox>,
    pub id: u64,
}

impl Drop for ClosedOnDrop {
    fn drop(&mut self) {
        self.inbox.closed(self.id);
    }
}

/// Who sent a header, for statuses.
pub(crate) fn sender(header: &KvHeader) -> String {
    if header.prefill_node.is_empty() {
        "a prefill node".into()
    } else {
        header.prefill_node.clone()
    }
}

/// Checks a transfer's header (its layout against ours, its reservation id) and begins the
/// transfer. Returns the reservation and the sender.
pub(crate) async fn open(
    inbox: &dyn KvInbox,
    header: Option<KvHeader>,
    remote: bool,
) -> Result<(u64, String), Status> {
    let header =
        header.ok_or_else(|| Status::invalid_argument("a KV stream starts with a header"))?;
    let from = sender(&header);
    let node = inbox.node_id();
    crate::check_layout(inbox.layout(), header.layout.as_ref(), &from)
        .map_err(|s| Status::new(s.code(), format!("node {node}: {}", s.message())))?;
    let cap = parse_reservation(node, &header.reservation_id)?;
    let id = inbox.begin(cap, &from, remote.then_some(header.grant)).await?;
    Ok((id, from))
}

/// A reservation id from the wire: the capability `Reserve` handed out (it is checked against
/// the reservation by the decode node; here only its form).
pub fn parse_reservation(node: &str, s: &str) -> Result<Capability, Status> {
    Capability::parse(s).ok_or_else(|| {
        // Echo at most a short prefix of what was sent: it may be anything.
        let shown: String = s.chars().take(40).collect();
        Status::invalid_argument(format!(
            "node {node}: reservation_id {shown:?} is not a reservation id (32 hex digits)"
        ))
    })
}

/// The span of one incoming transfer, a child of the sender's transfer span (named in the
/// header: the control messages carry the trace, whatever carries them).
pub(crate) fn receive_span(
    inbox: &dyn KvInbox,
    header: Option<&KvHeader>,
    transport: &'static str,
) -> Span {
    // A stream's blocks are written into the pool as they arrive, whatever its memory.
    let kv_path = match inbox.pool() {
        Some(p) if transport == p.transport() => p.path().name(),
        _ => "stream",
    };
    let span = pdmesh_common::span!(
        "decode.kv_receive",
        transport,
        kv_path,
        unstage_ms = Empty,
        reservation = Empty,
        prefill_node = Empty,
        blocks = Empty,
        layers = inbox.layout().geometry.layers as i64,
        bytes = Empty,
        bandwidth_mb_s = Empty,
    );
    if let Some(h) = header {
        trace::continue_from(&span, &h.traceparent);
        span.record("reservation", pdmesh_common::ids::redacted(&h.reservation_id));
        span.record("prefill_node", h.prefill_node.as_str());
    }
    span
}

/// Records a completed transfer's size and speed on its span, and the copy out of staging
/// blocks when there was one.
pub(crate) fn received(
    span: &Span,
    blocks: usize,
    bytes: u64,
    secs: f64,
    unstaged: Option<Duration>,
) {
    if let Some(d) = unstaged {
        span.record("unstage_ms", d.as_secs_f64() * 1e3);
    }
    span.record("blocks", blocks as i64);
    span.record("bytes", bytes as i64);
    if secs > 0.0 {
        span.record("bandwidth_mb_s", bytes as f64 / secs / 1e6);
    }
}
