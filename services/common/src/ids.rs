//! Request ids: caller-chosen ones are checked, missing ones are made unique per process.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A fresh id: time-seeded per process so two routers hardly ever collide, then a counter.
pub fn new_request_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static BASE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(|| {
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        t ^ (u64::from(std::process::id()) << 40)
    });
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("req-{:012x}-{n}", base & 0xffff_ffff_ffff)
}

/// Checks a caller-chosen id: 1–128 bytes of printable ASCII, no spaces.
pub fn check_request_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 128 {
        return Err(format!("request_id must be 1 to 128 bytes, got {}", id.len()));
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("request_id must be printable ASCII without spaces".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_valid() {
        let a = new_request_id();
        let b = new_request_id();
        assert_ne!(a, b);
        assert!(check_request_id(&a).is_ok());
        assert!(check_request_id("").is_err());
        assert!(check_request_id("a b").is_err());
        assert!(check_request_id(&"x".repeat(129)).is_err());
    }
}
