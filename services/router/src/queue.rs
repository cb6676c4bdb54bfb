//! Requests waiting for room on a decode node, first come first served. A burst larger than
//! the mesh's KV waits here instead of being refused: a request that finds no decode node
//! with room for it takes a ticket, and only the request at the head of the queue tries to
//! place itself, each time the mesh's capacity may have changed (a decode node heartbeat with
//! its free blocks, a request ending); arrivals queue behind those already waiting. The
//! queue is bounded (past it, RESOURCE_EXHAUSTED as before), and a request leaves it when it
//! is placed, its deadline passes, it is cancelled or its client goes away.

use std::collections::VecDeque;
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
    order: VecDeque<u64>,
}

/// A place in the queue; dropping it leaves the queue (and lets the next one try).
#[derive(Debug)]
pub struct Ticket<'a> {
    queue: &'a RoomQueue,
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
        self.lock().order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A place at the back; None when the queue is full.
    pub fn join(&self) -> Option<Ticket<'_>> {
        let mut w = self.lock();
        if w.order.len() >= self.limit {
            return None;
        }
        let id = w.next;
        w.next += 1;
        w.order.push_back(id);
        Some(Ticket { queue: self, id })
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
        self.queue.lock().order.front() == Some(&self.id)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.queue.lock().order.retain(|&i| i != self.id);
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
        let a = q.join().expect("room");
        let b = q.join().expect("room");
        let c = q.join().expect("room");
        assert!(q.join().is_none(), "a full queue refuses");
        assert!(a.is_first() && !b.is_first() && !c.is_first());
        // Leaving from the middle (a deadline, a cancel) keeps the order of the rest.
        drop(b);
        assert!(!c.is_first());
        drop(a);
        assert!(c.is_first());
        let d = q.join().expect("room again");
        assert_eq!(q.len(), 2);
        assert!(!d.is_first());
        drop(c);
        assert!(d.is_first());
        let none = RoomQueue::new(0);
        assert!(none.join().is_none());
    }

    #[tokio::test]
    async fn leaving_wakes_the_waiters() {
        let q = RoomQueue::new(2);
        let a = q.join().expect("room");
        let b = q.join().expect("room");
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
