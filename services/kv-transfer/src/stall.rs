//! How long a transfer may make no progress before it is given up. A session is making
//! progress while its operations complete; waiting on one is bounded by `after` plus the time
//! its own bytes take at `floor` (so a large put on a slow link is not mistaken for a stall),
//! and a session that overruns it is abandoned and falls back (see `auto::Fallback`), long
//! before a request's deadline — instead of hanging until the router's transfer timeout.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The bound (`kv_stall_ms`, `kv_stall_floor_mbit` in the prefill config).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StallBound {
    /// No progress for this long gives a session up.
    pub after: Duration,
    /// Plus the bytes being waited for at this rate, in bytes per second.
    pub floor_bytes_per_s: f64,
}

impl Default for StallBound {
    fn default() -> Self {
        // 1 s, plus what 1 Gbit/s takes: at the slowest link a mesh is run on, a stalled
        // session is told from a slow one.
        Self { after: Duration::from_secs(1), floor_bytes_per_s: 125e6 }
    }
}

impl StallBound {
    /// From `kv_stall_ms` and `kv_stall_floor_mbit`; both must be positive.
    pub fn new(after_ms: u64, floor_mbit: u64) -> Result<Self, String> {
        if after_ms == 0 || floor_mbit == 0 {
            return Err(format!(
                "kv_stall_ms ({after_ms}) and kv_stall_floor_mbit ({floor_mbit}) must be positive"
            ));
        }
        Ok(Self {
            after: Duration::from_millis(after_ms),
            floor_bytes_per_s: floor_mbit as f64 * 1e6 / 8.0,
        })
    }

    /// How long to wait for an operation moving `bytes`.
    pub fn limit(&self, bytes: u64) -> Duration {
        self.after + Duration::from_secs_f64(bytes as f64 / self.floor_bytes_per_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_grows_with_the_bytes_waited_for() {
        let b = StallBound::new(500, 1000).unwrap();
        assert_eq!(b.limit(0), Duration::from_millis(500));
        // 125 MB at 1 Gbit/s is one more second.
        assert_eq!(b.limit(125_000_000), Duration::from_millis(1500));
        assert!(StallBound::new(0, 1000).is_err());
        assert!(StallBound::new(500, 0).is_err());
        assert_eq!(StallBound::default().limit(0), Duration::from_secs(1));
    }
}
