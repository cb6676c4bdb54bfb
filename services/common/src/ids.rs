//! Ids that cross the wire. Those that grant something (a reservation, a lease) are
//! capabilities: 128 bits from the OS, so holding one proves it was handed to you, and none
//! can be guessed from another. Caller-chosen request ids are checked.

use std::fmt;

/// 128 bits from the operating system's generator.
fn random_u128() -> u128 {
    let mut b = [0u8; 16];
    // The OS generator failing means no id can be trusted: nothing sensible goes on.
    getrandom::fill(&mut b).expect("the OS random number generator failed");
    u128::from_le_bytes(b)
}

/// A fresh request id: `req-` and 32 random hex digits, so ids from any number of routers
/// never collide and say nothing about other requests.
pub fn new_request_id() -> String {
    format!("req-{:032x}", random_u128())
}

/// An unguessable handle to something a service holds for a caller (a KV reservation, a
/// prefix-cache lease): 128 random bits, 32 lowercase hex digits on the wire. The first 64
/// bits key the holder's table (so lookups stay cheap), the last 64 are compared on every use;
/// both are random, so the whole id is.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capability {
    key: u64,
    secret: u64,
}

impl Capability {
    /// A fresh capability whose key `taken` does not already use.
    pub fn fresh(taken: impl Fn(u64) -> bool) -> Self {
        loop {
            let v = random_u128();
            let c = Self { key: (v >> 64) as u64, secret: v as u64 };
            // Key 0 is left free so a zeroed id never names anything.
            if c.key != 0 && !taken(c.key) {
                return c;
            }
        }
    }

    /// The holder's table key.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// Whether `presented` is this capability: same key and, compared without an early exit
    /// so timing tells nothing about how much of it was right, the same secret.
    pub fn admits(&self, presented: &Capability) -> bool {
        let diff = (self.key ^ presented.key) | (self.secret ^ presented.secret);
        std::hint::black_box(diff) == 0
    }

    /// Parses the wire form: exactly 32 hex digits.
    pub fn parse(s: &str) -> Option<Self> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let v = u128::from_str_radix(s, 16).ok()?;
        Some(Self { key: (v >> 64) as u64, secret: v as u64 })
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}{:016x}", self.key, self.secret)
    }
}

/// What logs and traces may say of a capability in its wire form: the key, which names it
/// for a reader and grants nothing; the secret never leaves the two parties (spans are
/// exported to whoever runs the trace store).
pub fn redacted(wire: &str) -> String {
    match Capability::parse(wire) {
        Some(c) => format!("{:016x}…", c.key),
        None => "(not a capability)".to_string(),
    }
}

/// Logs and debug output show only the key: the secret is the part that grants.
impl fmt::Debug for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Capability({:016x}…)", self.key)
    }
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
    fn capabilities_round_trip_and_refuse_near_misses() {
        let c = Capability::fresh(|_| false);
        let wire = c.to_string();
        assert_eq!(wire.len(), 32);
        let back = Capability::parse(&wire).unwrap();
        assert!(c.admits(&back));
        // The same key with any other secret is refused.
        let mut forged = wire.clone().into_bytes();
        forged[31] = if forged[31] == b'0' { b'1' } else { b'0' };
        let forged = Capability::parse(std::str::from_utf8(&forged).unwrap()).unwrap();
        assert_eq!(forged.key(), c.key());
        assert!(!c.admits(&forged));
        for bad in ["", "1", "2", &wire[1..], &format!("{wire}0"), &format!("+{}", &wire[1..])] {
            assert!(Capability::parse(bad).is_none(), "{bad:?}");
        }
        assert!(!format!("{c:?}").contains(&wire[16..]), "debug output leaks the secret");
        // Keys are drawn until one is free.
        let first = Capability::fresh(|_| false).key();
        let other = Capability::fresh(|k| k == first);
        assert_ne!(other.key(), first);
    }

    #[test]
    fn ids_are_unique_and_valid() {
        let a = new_request_id();
        let b = new_request_id();
        assert_ne!(a, b);
        assert_eq!(a.len(), 4 + 32);
        assert!(check_request_id(&a).is_ok());
        assert!(check_request_id("").is_err());
        assert!(check_request_id("a b").is_err());
        assert!(check_request_id(&"x".repeat(129)).is_err());
    }
}
