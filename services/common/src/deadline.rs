//! Deadlines: the client's `grpc-timeout` header becomes an `Instant` the router enforces and
//! passes on to every node it calls.

use std::time::{Duration, Instant};

use tonic::metadata::MetadataMap;

/// Parses a `grpc-timeout` value: up to 8 digits and a unit (H, M, S, m, u, n).
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The request's deadline: its `grpc-timeout`, capped at `max`, or `max` when it has none.
pub fn deadline_of(metadata: &MetadataMap, now: Instant, max: Duration) -> Instant {
    let t = metadata
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_grpc_timeout)
        .map_or(max, |t| t.min(max));
    now + t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit_and_rejects_garbage() {
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("150m"), Some(Duration::from_millis(150)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("9n"), Some(Duration::from_nanos(9)));
        for bad in ["", "S", "5", "5x", "-5S", "123456789S", "1.5S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
    }

    #[test]
    fn deadline_is_capped() {
        let now = Instant::now();
        let mut md = MetadataMap::new();
        assert_eq!(deadline_of(&md, now, Duration::from_secs(9)), now + Duration::from_secs(9));
        md.insert("grpc-timeout", "2S".parse().expect("ascii"));
        assert_eq!(deadline_of(&md, now, Duration::from_secs(9)), now + Duration::from_secs(2));
        md.insert("grpc-timeout", "20S".parse().expect("ascii"));
        assert_eq!(deadline_of(&md, now, Duration::from_secs(9)), now + Duration::from_secs(9));
    }
}
