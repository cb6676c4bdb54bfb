//! Transfers by transport on one node, for its Stats (and its metrics).

use std::collections::BTreeMap;
use std::sync::Mutex;

use pdmesh_common::metrics::{Family, Kind};
use pdmesh_proto::v1::TransportStats;

#[derive(Debug, Default)]
pub struct TransferStats {
    by_transport: Mutex<BTreeMap<&'static str, TransportStats>>,
}

impl TransferStats {
    pub fn new() -> Self {
        Self::default()
    }

    fn with(&self, transport: &'static str, f: impl FnOnce(&mut TransportStats)) {
        let mut m = self.by_transport.lock().expect("stats lock is never poisoned");
        let e = m.entry(transport).or_insert_with(|| TransportStats {
            transport: transport.into(),
            ..Default::default()
        });
        f(e);
    }

    /// A finished transfer: `Some(bytes)` when it succeeded.
    pub fn record(&self, transport: &'static str, bytes: Option<u64>, seconds: f64) {
        self.with(transport, |e| match bytes {
            Some(b) => {
                e.transfers += 1;
                e.bytes += b;
                e.seconds += seconds;
            }
            None => e.failures += 1,
        });
    }

    /// A transfer by `transport` that succeeded by copying into the receiver's pool mapped
    /// on this host (counted in `record` too).
    pub fn mapped(&self, transport: &'static str) {
        self.with(transport, |e| e.mapped += 1);
    }

    /// A transfer by `transport` whose writer put into staging blocks, copied into the pool
    /// in `seconds` (counted in `record` too).
    pub fn staged(&self, transport: &'static str, seconds: f64) {
        self.with(transport, |e| {
            e.staged += 1;
            e.staged_seconds += seconds;
        });
    }

    /// A transfer that wanted `wanted` and used another transport, and why.
    pub fn fallback(&self, wanted: &'static str, why: crate::auto::Fallen) {
        self.with(wanted, |e| {
            e.fallbacks += 1;
            if why == crate::auto::Fallen::Stalled {
                e.stalls += 1;
            }
        });
    }

    pub fn snapshot(&self) -> Vec<TransportStats> {
        self.by_transport.lock().expect("stats lock is never poisoned").values().cloned().collect()
    }

    /// The stats as Prometheus families `pdmesh_<service>_transfer_*`, labelled by transport.
    pub fn metric_families(&self, service: &str) -> Vec<Family> {
        let snap = self.snapshot();
        let fam = |what: &str, help, v: &dyn Fn(&TransportStats) -> f64| {
            let vals: Vec<(&str, f64)> =
                snap.iter().map(|t| (t.transport.as_str(), v(t))).collect();
            Family::labelled(
                format!("pdmesh_{service}_{what}"),
                help,
                Kind::Counter,
                "transport",
                &vals,
            )
        };
        vec![
            fam("transfers", "KV transfers completed.", &|t| t.transfers as f64),
            fam("transfer_bytes", "KV bytes transferred.", &|t| t.bytes as f64),
            fam("transfer_seconds", "Time from the first block to the acknowledgement.", &|t| {
                t.seconds
            }),
            fam("transfer_failures", "KV transfers that failed.", &|t| t.failures as f64),
            fam(
                "transfer_fallbacks",
                "Transfers that wanted a one-sided transport (UCX) and used gRPC.",
                &|t| t.fallbacks as f64,
            ),
            fam(
                "transfer_stalls",
                "Transfers whose session made no progress within its bound, given up and sent again over gRPC.",
                &|t| t.stalls as f64,
            ),
            fam(
                "transfers_mapped",
                "Transfers copied into a decode node's KV pool mapped from shared memory.",
                &|t| t.mapped as f64,
            ),
            fam(
                "transfers_staged",
                "Transfers put into host staging blocks and copied into the KV pool.",
                &|t| t.staged as f64,
            ),
            fam("transfer_unstage_seconds", "Time copying staged KV blocks into the pool.", &|t| {
                t.staged_seconds
            }),
        ]
    }
}
