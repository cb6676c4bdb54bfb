//! The receiving half of a one-sided transport's session (`KvSession`), the same for every
//! such transport: the decode node accepts the session before any byte moves (telling a
//! writer on its host how to reach the pool directly, when it offers that), the writer puts
//! into the reservation's granted blocks, then commits — or abandons, when it stalled and will
//! stream the KV instead. The end of the stream (however it ends) tells the node the writer
//! can put no more; an end before the commit fails the reservation.

use std::sync::Arc;
use std::time::Duration;

use pdmesh_proto::v1::{
    KvAbandoned, KvAccepted, KvCommitted, KvSessionEvent, KvSessionRequest, kv_session_event,
    kv_session_request,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::inbox::{self, ClosedOnDrop, KvInbox};

/// How long a decode node keeps the blocks of a session whose stream broke, for what the
/// network may still hold. A dead writer's bytes are gone in milliseconds; a partition that
/// outlasts this with puts still queued in the writer's kernel is the case it does not
/// cover (UCX, for one, offers no way to close one peer's TCP connection from this side).
const LATE_PUTS: Duration = Duration::from_secs(10);

/// The events a decode node's side of a session sends.
pub type SessionEvents = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = Result<KvSessionEvent, tonic::Status>> + Send>,
>;

/// The receiving half: a `KvSession` into `inbox`'s reservation. The session is accepted
/// before any byte moves; the prefill node then puts into the reservation's blocks and
/// commits; the end of the stream (however it ends) tells the node the writer can put no
/// more, and an end before the commit fails the reservation.
pub async fn accept_session(
    inbox: Arc<dyn KvInbox>,
    req: tonic::Request<Streaming<KvSessionRequest>>,
) -> Result<tonic::Response<SessionEvents>, tonic::Status> {
    use tonic::Status;
    use tracing::Instrument;
    let Some(pool) = inbox.pool() else {
        return Err(Status::failed_precondition(format!(
            "node {}: this decode node offers no one-sided transport (kv_transport = grpc)",
            inbox.node_id()
        )));
    };
    let transport = pool.transport();
    // The direct way in goes only where the addresses say one host; what keeps it from
    // anyone else is the transport's own proof (a sealed key only the host's user opens).
    let direct =
        if same_host(req.local_addr(), req.remote_addr()) { pool.same_host() } else { None };
    let mut inbound = req.into_inner();
    let header = match inbound.message().await? {
        Some(KvSessionRequest { msg: Some(kv_session_request::Msg::Open(h)) }) => Some(h),
        _ => None,
    };
    let span = inbox::receive_span(&*inbox, header.as_ref(), transport);
    let started = std::time::Instant::now();
    let (id, from) =
        pdmesh_common::trace::in_span(&span, inbox::open(&*inbox, header, true)).await?;
    let closed = ClosedOnDrop { inbox: Arc::clone(&inbox), id };
    let (events, rx) = mpsc::channel(2);
    let accepted =
        KvSessionEvent { event: Some(kv_session_event::Event::Accepted(KvAccepted { direct })) };
    let _ = events.try_send(Ok(accepted));
    let session = async move {
        // Whether the stream broke rather than being ended by the writer: then nothing says
        // its puts are over.
        let mut broke = false;
        // Until the commit (or the end of the stream) the prefill node may be putting.
        let outcome = match inbound.message().await {
            Ok(Some(KvSessionRequest { msg: Some(kv_session_request::Msg::Commit(e)) })) => {
                let blocks = e.blocks as usize;
                // The writer's count where it gives one (thin blocks are smaller); at most
                // every block whole, so a writer cannot inflate the statistics.
                let whole = blocks as u64 * inbox.layout().bytes_per_block() as u64;
                let bytes = if e.bytes > 0 { e.bytes.min(whole) } else { whole };
                let r = inbox.end(id, blocks, e.checksums).await;
                let secs = started.elapsed().as_secs_f64();
                inbox.stats().record(transport, r.as_ref().ok().map(|_| bytes), secs);
                if let Ok(Some(d)) = r {
                    inbox.stats().staged(transport, d.as_secs_f64());
                }
                let unstaged = r.as_ref().ok().copied().flatten();
                inbox::received(&tracing::Span::current(), blocks, bytes, secs, unstaged);
                r.map_or_else(Ended::Failed, |_| Ended::Committed(bytes))
            }
            Ok(Some(KvSessionRequest { msg: Some(kv_session_request::Msg::Abandon(a)) })) => {
                tracing::info!(reservation = id, from, "{transport} writer gave up: {}", a.reason);
                pdmesh_common::trace::event(
                    &tracing::Span::current(),
                    "kv.abandoned",
                    &[("reason", a.reason.clone())],
                );
                inbox.writer_abandoned(id).await.map_or_else(Ended::Failed, |()| Ended::Abandoned)
            }
            Ok(Some(_)) => {
                broke = true;
                Ended::Failed(Status::invalid_argument(
                    "a session takes one commit or abandon after its open",
                ))
            }
            Ok(None) => Ended::Failed(Status::cancelled("the session ended before its commit")),
            Err(s) => {
                broke = true;
                Ended::Failed(s)
            }
        };
        match outcome {
            Ended::Committed(bytes) => {
                let ev = KvSessionEvent {
                    event: Some(kv_session_event::Event::Committed(KvCommitted { bytes })),
                };
                let _ = events.send(Ok(ev)).await;
            }
            // Given up, the reservation now awaits a stream: the session stays open until
            // the writer has quiesced (its end frees the old blocks).
            Ended::Abandoned => {
                let ev = KvSessionEvent {
                    event: Some(kv_session_event::Event::Abandoned(KvAbandoned {})),
                };
                let _ = events.send(Ok(ev)).await;
                broke = loop {
                    match inbound.message().await {
                        Ok(Some(_)) => {}
                        Ok(None) => break false,
                        Err(_) => break true,
                    }
                };
            }
            Ended::Failed(st) => {
                tracing::info!(
                    reservation = id,
                    from,
                    "{transport} session failed: {}",
                    st.message()
                );
                pdmesh_common::trace::fail(&tracing::Span::current(), &st);
                inbox.abort(id, &from, st.message().to_string()).await;
                let _ = events.send(Err(st)).await;
            }
        }
        // Dropping `closed` reports the writer closed: the prefill node flushed before its
        // commit, or ended the stream once its puts were over. A stream that broke (a
        // partition) says nothing of puts still buffered on the way, which TCP delivers when
        // the link comes back: the blocks stay out of use until the writer has given up on
        // them (the sender's quiesce) and the network has had time to drain.
        if broke {
            tracing::info!(
                reservation = id,
                "{transport} session broke; its blocks wait {LATE_PUTS:?}"
            );
            tokio::time::sleep(LATE_PUTS).await;
        }
        drop(closed);
    };
    tokio::spawn(session.instrument(span));
    Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
}

/// How the writer's side of a session ended, as the decode node sees it.
enum Ended {
    /// Committed: its KV is in place, this many bytes.
    Committed(u64),
    /// Given up (it stalled): the reservation now awaits the KV from a stream.
    Abandoned,
    Failed(tonic::Status),
}

/// Whether a connection's two ends look like one host: both loopback, or one address. A proxy
/// or SNAT makes them lie, so this only spares remote writers an offer they cannot open.
fn same_host(local: Option<std::net::SocketAddr>, remote: Option<std::net::SocketAddr>) -> bool {
    let (Some(l), Some(r)) = (local, remote) else { return false };
    let (l, r) = (l.ip().to_canonical(), r.ip().to_canonical());
    (l.is_loopback() && r.is_loopback()) || (l == r && !l.is_unspecified())
}

#[cfg(test)]
mod tests {
    use super::same_host;

    #[test]
    fn only_connections_within_one_host_are_same_host() {
        let a = |s: &str| Some(s.parse().unwrap());
        assert!(same_host(a("127.0.0.1:5000"), a("127.0.0.1:40000")));
        assert!(same_host(a("127.0.0.1:5000"), a("127.0.0.2:40000")));
        assert!(same_host(a("[::1]:5000"), a("[::ffff:127.0.0.1]:40000")));
        assert!(same_host(a("10.0.0.5:5000"), a("10.0.0.5:40000")));
        assert!(!same_host(a("10.0.0.5:5000"), a("10.0.0.6:40000")));
        assert!(!same_host(a("127.0.0.1:5000"), a("10.0.0.6:40000")));
        assert!(!same_host(a("0.0.0.0:5000"), a("0.0.0.0:40000")));
        assert!(!same_host(None, a("127.0.0.1:40000")));
    }
}
