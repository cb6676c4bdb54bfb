//! Units shared by every service's timings.

/// A duration in milliseconds, as timings and spans report it.
pub fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
