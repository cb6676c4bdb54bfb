//! The configured transport: `grpc`, `ucx`, or `auto` (UCX when an endpoint to the decode node
//! can be made, else the gRPC stream). Counts what each transfer used.

use std::sync::Arc;

use pdmesh_proto::v1::KvTarget;
use serde::{Deserialize, Serialize};

use crate::grpc::GrpcTransport;
use crate::stats::TransferStats;
use crate::ucx::{UcxError, UcxNode};
use crate::ucx_transport::UcxTransport;
use crate::{KvSink, KvTransport, TransferError};

/// `kv_transport` in the prefill and decode configs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// One-sided UCX puts into the decode node's KV pool; a transfer that cannot get a UCX
    /// endpoint fails (FAILED_PRECONDITION).
    Ucx,
    /// The gRPC stream only (no UCX context at all).
    Grpc,
    /// UCX when possible, the gRPC stream otherwise.
    #[default]
    Auto,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Ucx => "ucx",
            TransportKind::Grpc => "grpc",
            TransportKind::Auto => "auto",
        }
    }

    /// Starts the UCX node this kind needs: none for `grpc`; for `auto`, none when UCX cannot
    /// start (logged); for `ucx`, an error.
    pub fn start_ucx(self, name: &str) -> Result<Option<UcxNode>, UcxError> {
        match self {
            TransportKind::Grpc => Ok(None),
            TransportKind::Ucx => UcxNode::start(name).map(Some),
            TransportKind::Auto => match UcxNode::start(name) {
                Ok(n) => Ok(Some(n)),
                Err(e) => {
                    tracing::warn!("UCX unavailable, KV moves over gRPC: {e}");
                    Ok(None)
                }
            },
        }
    }
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "ucx" => Ok(TransportKind::Ucx),
            "grpc" => Ok(TransportKind::Grpc),
            "auto" => Ok(TransportKind::Auto),
            other => Err(format!("unknown kv_transport {other:?} (expected ucx, grpc or auto)")),
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The prefill node's transport for its configured kind.
#[derive(Debug)]
pub struct AutoTransport {
    kind: TransportKind,
    ucx: Option<UcxTransport>,
    grpc: Arc<GrpcTransport>,
    stats: Arc<TransferStats>,
}

impl AutoTransport {
    /// `ucx` is the node from `kind.start_ucx` (None for grpc, or auto without UCX).
    pub fn new(kind: TransportKind, ucx: Option<UcxNode>, stats: Arc<TransferStats>) -> Self {
        let grpc = Arc::new(GrpcTransport::new());
        let ucx = ucx.map(|n| UcxTransport::new(n, Arc::clone(&grpc)));
        Self { kind, ucx, grpc, stats }
    }
}

#[async_trait::async_trait]
impl KvTransport for AutoTransport {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    async fn open(
        &self,
        target: &KvTarget,
        prefill_node: &str,
    ) -> Result<Box<dyn KvSink>, TransferError> {
        match (self.kind, &self.ucx) {
            (TransportKind::Grpc, _) => self.grpc.open(target, prefill_node).await,
            (TransportKind::Ucx, Some(u)) => u.open(target, prefill_node).await,
            (TransportKind::Ucx, None) => Err(TransferError::NoEndpoint {
                node: target.decode_node.clone(),
                reason: "UCX is not running on this node".into(),
            }),
            (TransportKind::Auto, ucx) => {
                let why = match ucx {
                    Some(u) => match u.open(target, prefill_node).await {
                        Err(TransferError::NoEndpoint { reason, .. }) => reason,
                        r => return r,
                    },
                    None => "UCX is not running on this node".into(),
                };
                tracing::debug!(node = target.decode_node, "KV over gRPC: {why}");
                self.stats.fallback("ucx");
                self.grpc.open(target, prefill_node).await
            }
        }
    }
}
