//! Statuses that cross node boundaries keep their code and say which node sent them, so a
//! client can tell overload on one node from a bug on another.

use std::time::Duration;

use tonic::{Code, Status};

/// Metadata key carrying a retry hint on RESOURCE_EXHAUSTED, in milliseconds.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// Metadata key naming the peer a node lost on the caller's behalf (a prefill node whose
/// decode node went away mid-transfer): the caller then knows which node to avoid.
pub const LOST_PEER: &str = "pdmesh-lost-peer";

/// `status` as returned by `node`: same code, message prefixed with the node. Transport
/// failures (connection refused or reset) come back as UNAVAILABLE.
pub fn from_peer(node: &str, status: &Status) -> Status {
    let code = match status.code() {
        // A connection that broke mid-call surfaces as UNKNOWN or CANCELLED from hyper: the node
        // is gone as far as the caller can tell.
        Code::Unknown if is_transport_failure(status) => Code::Unavailable,
        Code::Cancelled if is_transport_failure(status) => Code::Unavailable,
        c => c,
    };
    Status::new(code, naming(node, status.message()))
}

/// `message` prefixed with `node`, unless the node already named itself in it.
pub fn naming(node: &str, message: &str) -> String {
    let prefix = format!("node {node}: ");
    if message.starts_with(&prefix) { message.to_string() } else { format!("{prefix}{message}") }
}

/// Whether the call failed in the transport (the connection broke, the stream was reset)
/// rather than with a status the node chose: found by walking the status's `source()` chain
/// for the transport's own error types, as tonic does, never by reading its message.
pub fn is_transport_failure(status: &Status) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(e) = cause {
        if e.is::<tonic::transport::Error>()
            || e.is::<hyper::Error>()
            || e.is::<h2::Error>()
            || e.is::<std::io::Error>()
        {
            return true;
        }
        cause = e.source();
    }
    false
}

/// RESOURCE_EXHAUSTED with a retry hint in metadata and in the message.
pub fn exhausted(msg: impl Into<String>, retry_after: Duration) -> Status {
    let ms = retry_after.as_millis();
    let mut s = Status::resource_exhausted(format!("{}; retry after {ms} ms", msg.into()));
    if let Ok(v) = ms.to_string().parse() {
        s.metadata_mut().insert(RETRY_AFTER_MS, v);
    }
    s
}

/// The retry hint `exhausted` put on a status, if it carries one.
pub fn retry_after(s: &Status) -> Option<Duration> {
    let v = s.metadata().get(RETRY_AFTER_MS)?.to_str().ok()?;
    v.parse().ok().map(Duration::from_millis)
}

/// UNAVAILABLE because `peer` could not be reached, saying so in the message and, for the
/// caller to act on, in metadata (`lost_peer`).
pub fn unreachable(peer: &str, why: impl std::fmt::Display) -> Status {
    let mut s = Status::unavailable(format!("node {peer}: {why}"));
    if let Ok(v) = peer.parse() {
        s.metadata_mut().insert(LOST_PEER, v);
    }
    s
}

/// The peer an UNAVAILABLE status says was lost (`unreachable`), if it says.
pub fn lost_peer(status: &Status) -> Option<&str> {
    if status.code() != Code::Unavailable {
        return None;
    }
    status.metadata().get(LOST_PEER)?.to_str().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_peer_is_named_in_metadata_and_only_on_unavailable() {
        let s = unreachable("decode-0", "KV transfer failed: reset");
        assert_eq!(s.message(), "node decode-0: KV transfer failed: reset");
        assert_eq!(lost_peer(&s), Some("decode-0"));
        let mut other = Status::internal("x");
        other.metadata_mut().insert(LOST_PEER, "decode-0".parse().unwrap());
        assert_eq!(lost_peer(&other), None);
        assert_eq!(lost_peer(&Status::unavailable("node decode-0: gone")), None);
    }

    #[test]
    fn peer_status_keeps_code_and_names_node() {
        let s = from_peer("decode-1", &Status::resource_exhausted("no blocks"));
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.message(), "node decode-1: no blocks");
        // A broken connection is told by the error the status carries, not by its words.
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let s = from_peer("prefill-0", &Status::from_error(Box::new(reset)));
        assert_eq!(s.code(), Code::Unavailable);
        let s = from_peer("prefill-0", &Status::unknown("transport error: connection reset"));
        assert_eq!(s.code(), Code::Unknown, "a node's own message that mentions a transport");
        let s = from_peer("prefill-0", &Status::unknown("engine bug"));
        assert_eq!(s.code(), Code::Unknown);
        // A status relayed twice from the same node names it once.
        let inner = from_peer("decode-0", &Status::not_found("reservation 3 is unknown"));
        let s = from_peer("prefill-0", &from_peer("decode-0", &inner));
        assert_eq!(s.message(), "node prefill-0: node decode-0: reservation 3 is unknown");
    }

    #[test]
    fn exhausted_carries_retry_hint() {
        let s = exhausted("router full", Duration::from_millis(250));
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(s.metadata().get(RETRY_AFTER_MS).and_then(|v| v.to_str().ok()), Some("250"));
    }
}
