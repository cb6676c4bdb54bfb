//! Why an attempt ends without finishing its request (`Failure`), where it stood (`Phase`),
//! and what each failure means for a retry and for the client.

use std::time::Duration;

use pdmesh_common::status::from_peer;
use tonic::{Code, Status};

use crate::error::RequestError;
use crate::placement::PlaceError;

/// Where a request stands, for deadline messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Queued,
    Prefilling,
    Transferring,
    Decoding,
}

impl Phase {
    pub(super) fn name(self) -> &'static str {
        match self {
            Phase::Queued => "queued",
            Phase::Prefilling => "prefilling",
            Phase::Transferring => "transferring",
            Phase::Decoding => "decoding",
        }
    }
}

/// Why an attempt ended without finishing the request.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Placement found no node that can take it.
    Place(PlaceError),
    /// A node answered with a status of its own (kept, naming the node).
    Refused { node: String, status: Status },
    /// A node could not be reached, broke or stalled its stream, or left the mesh.
    Lost { node: String, why: String },
    /// The deadline passed in `phase`, on `node`.
    Deadline { phase: Phase, node: Option<String> },
    /// It found no room and the queue for room was full (`waiting` requests in it).
    QueueFull { waiting: usize },
    /// `Cancel` was called for it.
    Cancelled,
    /// Its client went away.
    Abandoned,
}

impl Failure {
    /// A status from `node`: lost when the node is unreachable (the call broke in the
    /// transport, or the node said UNAVAILABLE), refused otherwise.
    pub(super) fn from_node(node: &str, status: &Status) -> Self {
        let s = from_peer(node, status);
        if s.code() == Code::Unavailable {
            Failure::Lost { node: node.to_string(), why: s.message().to_string() }
        } else {
            Failure::Refused { node: node.to_string(), status: s }
        }
    }

    pub(super) fn lost(node: &str, why: impl Into<String>) -> Self {
        Failure::Lost { node: node.to_string(), why: why.into() }
    }

    /// The node that failed, if one did.
    pub fn node(&self) -> Option<&str> {
        match self {
            Failure::Refused { node, .. } | Failure::Lost { node, .. } => Some(node),
            _ => None,
        }
    }

    /// Whether trying again on other nodes makes sense: for a node that is gone or full.
    /// Before the client saw a token that is a retry; after, the stream moves (`Resume`).
    pub fn retryable(&self) -> bool {
        match self {
            Failure::Lost { .. } => true,
            Failure::Refused { status, .. } => status.code() == Code::ResourceExhausted,
            _ => false,
        }
    }

    /// Its decode node preempted it: out of blocks to promise its growing reservation.
    pub fn preempted(&self) -> bool {
        matches!(self, Failure::Refused { status, .. } if status.code() == Code::Aborted)
    }

    /// What the client is told.
    pub fn into_error(self, retry_after: Duration) -> RequestError {
        match self {
            Failure::Place(e @ PlaceError::NoDecodeNode) => {
                RequestError::Unavailable(e.to_string())
            }
            Failure::Place(e @ (PlaceError::NoCapacity { .. } | PlaceError::TooLarge { .. })) => {
                RequestError::Overloaded { message: e.to_string(), retry_after }
            }
            Failure::QueueFull { waiting } => RequestError::Overloaded {
                message: format!(
                    "no decode node has room, and {waiting} requests already wait for it (the \
                     router's max_queued)"
                ),
                retry_after,
            },
            Failure::Refused { status, .. } => RequestError::Node(status),
            Failure::Lost { node, why } => {
                RequestError::Unavailable(pdmesh_common::status::naming(&node, &why))
            }
            Failure::Deadline { phase, node } => {
                let at = node.map(|n| format!(" on node {n}")).unwrap_or_default();
                RequestError::Deadline(format!("deadline passed while {}{at}", phase.name()))
            }
            Failure::Cancelled => RequestError::Unavailable("cancelled".into()),
            Failure::Abandoned => RequestError::Unavailable("the client went away".into()),
        }
    }
}

/// What a failure says, for logs.
pub(crate) fn failure_text(f: &Failure) -> String {
    match f {
        Failure::Refused { status, .. } => status.message().to_string(),
        Failure::Lost { node, why } => pdmesh_common::status::naming(node, why),
        other => format!("{other:?}"),
    }
}
