//! Requests waiting for room on a decode node: first come first served within a tenant, and
//! fair across tenants. A burst larger than the mesh's KV waits here instead of being refused:
//! a request that finds no decode node with room for it takes a ticket, and only the request
//! at the head of the queue tries to place itself, each time the mesh's capacity may have
//! changed (a decode node heartbeat with its free blocks, a request ending); arrivals queue
//! behind those already waiting. The head is the oldest request of the tenant whose turn it
//! is: the one whose request last left the head longest ago (a tenant with nothing waiting
//! before has had no turn), so one tenant's flood never holds another tenant's requests
//! behind all of it. The queue is bounded (past it, RESOURCE_EXHAUSTED as before), and a
//! request leaves it when it is placed, its deadline passes, it is cancelled or its client
//! goes away.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use tokio::sync::Notify;
use tokio::sync::futures::Notified;

#[derive(Debug)]
pub struct RoomQueue {
    waiting: Mutex<Waiting>,
    changed: Notify,
    limit: usize,
}

#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    len: usize,
    /// Each tenant with requests waiting: their tickets in arrival order, and the turn at
    /// which one of them last left the head (0: none has yet).
    tenants: HashMap<String, (VecDeque<u64>, u64)>,
    turn: u64,
}

impl Waiting {
    /// The ticket at the head: the oldest of the tenant served longest ago (ties: the older
    /// request).
    fn head(&self) -> Option<u64> {
        self.tenants
            .values()
            .filter_map(|(q, served)| q.front().map(|&id| (*served, id)))
            .min()
            .map(|(_, id)| id)
    }
}

/// A place in the queue; dropping it leaves the queue (and lets the next one try).
#[derive(Debug)]
pub struct Ticket<'a> {
    queue: &'a RoomQueue,
    tenant: String,
    id: u64,
}

impl RoomQueue {
    /// A queue of at most `limit` requests (0: none wait; each is refused at once).
    pub fn new(limit: usize) -> Self {
        Self { waiting: Mutex::default(), changed: Notify::new(), limit }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.lock().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A place at the back of `tenant`'s line; None when the queue is full.
    pub fn join(&self, tenant: &str) -> Option<Ticket<'_>> {
        let mut w = self.lock();
        if w.len >= self.limit {
            return None;
        }
        let id = w.next;
        w.next += 1;
        w.len += 1;
        w.tenants.entry(tenant.to_string()).or_default().0.push_back(id);
        Some(Ticket { queue: self, tenant: tenant.to_string(), id })
    }

    /// Room may have appeared: the head of the queue tries again.
    pub fn wake(&self) {
        self.changed.notify_waiters();
    }

    /// Resolves at the next `wake`. Create it before looking at the mesh, so a wake between
    /// the look and the wait is not missed.
    pub fn changed(&self) -> Notified<'_> {
        self.changed.notified()
    }
}

impl Ticket<'_> {
    /// Whether this request is the next to be placed.
    pub fn is_first(&self) -> bool {
        self.queue.lock().head() == Some(self.id)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut w = self.queue.lock();
        let was_head = w.head() == Some(self.id);
        w.turn += 1;
        let turn = w.turn;
        if let Some((q, served)) = w.tenants.get_mut(&self.tenant) {
            q.retain(|&i| i != self.id);
            if was_head {
                *served = turn;
            }
            // A tenant with nothing waiting is forgotten: its next request has had no turn.
            if q.is_empty() {
                w.tenants.remove(&self.tenant);
            }
        }
        w.len -= 1;
        drop(w);
        // The next in line may fit where this one did not, or take the room this one left.
        self.queue.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_come_first_served_and_bounded() {
        let q = RoomQueue::new(3);
        assert!(q.is_empty());
        let a = q.join("t").expect("room");
        let b = q.join("t").expect("room");
        let c = q.join("t").expect("room");
        assert!(q.join("t").is_none(), "a full queue refuses");
        assert!(q.join("other").is_none(), "whoever asks");
        assert!(a.is_first() && !b.is_first() && !c.is_first());
        // Leaving from the middle (a deadline, a cancel) keeps the order of the rest.
        drop(b);
        assert!(!c.is_first());
        drop(a);
        assert!(c.is_first());
        let d = q.join("t").expect("room again");
        assert_eq!(q.len(), 2);
        assert!(!d.is_first());
        drop(c);
        assert!(d.is_first());
        let none = RoomQueue::new(0);
        assert!(none.join("t").is_none());
    }

    /// Tenant A floods the queue before B's two requests arrive: they alternate from then on,
    /// rather than B waiting behind all of A's.
    #[test]
    fn tenants_take_turns() {
        let q = RoomQueue::new(100);
        let mut a: VecDeque<_> = (0..10).map(|_| q.join("a").expect("room")).collect();
        let mut b: VecDeque<_> = (0..2).map(|_| q.join("b").expect("room")).collect();
        let mut order = String::new();
        while !q.is_empty() {
            let next = if a.front().is_some_and(Ticket::is_first) { &mut a } else { &mut b };
            let t = next.pop_front().expect("someone is first");
            assert!(t.is_first());
            order.push_str(&t.tenant);
            drop(t);
        }
        assert_eq!(order, "ababaaaaaaaa");
    }

    #[tokio::test]
    async fn leaving_wakes_the_waiters() {
        let q = RoomQueue::new(2);
        let a = q.join("t").expect("room");
        let b = q.join("t").expect("room");
        let changed = q.changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        drop(a);
        tokio::time::timeout(std::time::Duration::from_secs(1), changed)
            .await
            .expect("the head leaving wakes the rest");
        assert!(b.is_first());
    }
}
