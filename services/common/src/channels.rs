//! Client channels to mesh peers, one per address, shared by every call to that peer. The
//! cache is bounded (addresses come from registrations and targets, so the set must not grow
//! without end: the least recently used goes first) and follows certificate reloads: a channel
//! dialled before the process's certificates were renewed would reconnect with the old ones,
//! so it is dialled anew.

use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;

/// Channels (of type `C`) by address.
#[derive(Debug)]
pub struct ChannelCache<C> {
    map: Mutex<LruCache<String, (u64, C)>>,
}

impl<C: Clone> ChannelCache<C> {
    /// A cache of at most `cap` channels (at least one).
    pub fn new(cap: usize) -> Self {
        let cap = NonZeroUsize::new(cap.max(1)).expect("at least one");
        Self { map: Mutex::new(LruCache::new(cap)) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<String, (u64, C)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The channel to `address`, made by `dial` if there is none dialled under the current
    /// certificates.
    pub fn get<E>(&self, address: &str, dial: impl FnOnce() -> Result<C, E>) -> Result<C, E> {
        let mut map = self.lock();
        let generation = crate::tls::generation();
        if let Some((g, c)) = map.get(address)
            && *g == generation
        {
            return Ok(c.clone());
        }
        let c = dial()?;
        map.put(address.to_string(), (generation, c.clone()));
        Ok(c)
    }

    /// Forgets the channel to `address` (its peer went away; another may take the address).
    pub fn forget(&self, address: &str) {
        self.lock().pop(address);
    }

    /// Channels held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a channel to `address` is held (without counting as a use).
    pub fn holds(&self, address: &str) -> bool {
        self.lock().contains(address)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past its capacity the least recently used channel goes, and one in use stays.
    #[test]
    fn the_cache_is_bounded_and_keeps_what_is_used() {
        let c = ChannelCache::new(3);
        let dial = |n: u32| move || Ok::<_, ()>(n);
        assert_eq!(c.get("a", dial(1)), Ok(1));
        assert_eq!(c.get("a", dial(9)), Ok(1), "a held channel is not dialled again");
        for (i, addr) in ["b", "c", "d"].iter().enumerate() {
            c.get(addr, dial(i as u32)).unwrap();
            c.get("a", dial(9)).unwrap();
        }
        assert_eq!(c.len(), 3);
        assert!(c.holds("a") && !c.holds("b"));
        c.forget("a");
        assert_eq!(c.get("a", dial(7)), Ok(7));
        assert_eq!(c.get("e", || Err::<u32, _>("unreachable")), Err("unreachable"));
    }
}
