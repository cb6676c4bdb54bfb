//! Which connections a listener takes: at most so many open at once, in all and from one
//! address, and of those at most so many still in their TLS handshake, in all and from one
//! address. A client that opens sockets and never speaks holds its own address's share and no
//! more, so everyone else still connects; past a limit a connection is closed at once rather
//! than queued behind the ones that hold it. An admitted connection carries its place
//! ([`Held`]) and gives it back when it closes. [`Quota`] is the count in all and per key
//! that both bounds are made of.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A listener's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once (handshaking or not).
    pub connections: usize,
    /// Connections open at once from one IP address.
    pub connections_per_peer: usize,
    /// Connections still in their TLS handshake.
    pub handshakes: usize,
    /// Connections still in their TLS handshake from one IP address.
    pub handshakes_per_peer: usize,
}

impl Limits {
    /// What every listener of the mesh keeps: far above what a router's channels, a
    /// node's peers or a client's pool open from one address, and under the 8–16 Ki
    /// descriptors a service is usually allowed.
    pub const DEFAULT: Limits = Limits {
        connections: 4096,
        connections_per_peer: 512,
        handshakes: 1024,
        handshakes_per_peer: 64,
    };
}

/// Why a connection was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Full {
    #[error("{0} connections open on this listener")]
    Connections(usize),
    #[error("{0} connections open from this address")]
    PeerConnections(usize),
    #[error("{0} handshakes under way on this listener")]
    Handshakes(usize),
    #[error("{0} handshakes under way from this address")]
    PeerHandshakes(usize),
}

#[derive(Debug)]
struct Counts<K> {
    total: usize,
    by_key: HashMap<K, usize>,
}

/// Holders of something bounded, counted in all and per key (a client address, a tenant),
/// and what a caller is told when there is no room: `E` over all, `E` over its key.
#[derive(Debug, Clone)]
pub struct Quota<K, E> {
    counts: Arc<Mutex<Counts<K>>>,
    most: usize,
    most_per_key: usize,
    full: E,
    key_full: E,
}

impl<K: Hash + Eq + Clone, E: Clone> Quota<K, E> {
    /// At most `most` holders, `most_per_key` of one key; past them, `full` or `key_full`.
    pub fn new(most: usize, most_per_key: usize, full: E, key_full: E) -> Self {
        let counts = Counts { total: 0, by_key: HashMap::new() };
        Self { counts: Arc::new(Mutex::new(counts)), most, most_per_key, full, key_full }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts<K>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for `key`, held until the slot is dropped; refused at once when there is none.
    pub fn take(&self, key: K) -> Result<Slot<K, E>, E> {
        let mut c = self.counts();
        if c.total >= self.most {
            return Err(self.full.clone());
        }
        let n = c.by_key.entry(key.clone()).or_insert(0);
        if *n >= self.most_per_key {
            return Err(self.key_full.clone());
        }
        *n += 1;
        c.total += 1;
        Ok(Slot { quota: self.clone(), key })
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.counts().total
    }
}

/// A place taken; dropping it gives it back.
#[derive(Debug)]
pub struct Slot<K: Hash + Eq, E> {
    quota: Quota<K, E>,
    key: K,
}

impl<K: Hash + Eq, E> Drop for Slot<K, E> {
    fn drop(&mut self) {
        let mut c = self.quota.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total = c.total.saturating_sub(1);
        if let Some(n) = c.by_key.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                c.by_key.remove(&self.key);
            }
        }
    }
}

/// A connection's place on its listener.
pub type PeerSlot = Slot<IpAddr, Full>;

/// One listener's places.
#[derive(Debug, Clone)]
pub struct Gate {
    connections: Quota<IpAddr, Full>,
    handshakes: Quota<IpAddr, Full>,
}

impl Gate {
    pub fn new(l: Limits) -> Self {
        let (c, cp) = (l.connections, l.connections_per_peer);
        let (h, hp) = (l.handshakes, l.handshakes_per_peer);
        Self {
            connections: Quota::new(c, cp, Full::Connections(c), Full::PeerConnections(cp)),
            handshakes: Quota::new(h, hp, Full::Handshakes(h), Full::PeerHandshakes(hp)),
        }
    }

    /// A place for a new connection from `peer`, kept for its whole life.
    pub fn connect(&self, peer: IpAddr) -> Result<PeerSlot, Full> {
        self.connections.take(peer)
    }

    /// A place for `peer`'s handshake, kept until it completes or times out.
    pub fn handshake(&self, peer: IpAddr) -> Result<PeerSlot, Full> {
        self.handshakes.take(peer)
    }
}

/// A connection with its place on the listener: the place is given back when the connection
/// is dropped, however it ends. With an idle bound, a connection over which no byte has moved
/// either way for that long fails its next read, and the server lets it go.
#[derive(Debug)]
pub struct Held<IO> {
    io: IO,
    _slot: PeerSlot,
    idle: Option<Idle>,
}

#[derive(Debug)]
struct Idle {
    after: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl<IO> Held<IO> {
    /// `io` holding `slot`; closed once `idle` passes with no byte read or written, if given.
    pub fn new(io: IO, slot: PeerSlot, idle: Option<Duration>) -> Self {
        let idle = idle.map(|after| Idle { after, deadline: Box::pin(tokio::time::sleep(after)) });
        Self { io, _slot: slot, idle }
    }

    fn moved(&mut self, n: usize) {
        if n > 0
            && let Some(i) = &mut self.idle
        {
            i.deadline.as_mut().reset(tokio::time::Instant::now() + i.after);
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Held<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                let n = buf.filled().len() - before;
                self.moved(n);
                Poll::Ready(r)
            }
            // The server always has a read pending, so this is where the bound is kept.
            Poll::Pending => {
                let lapsed =
                    self.idle.as_mut().is_some_and(|i| i.deadline.as_mut().poll(cx).is_ready());
                if lapsed {
                    let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "idle: closed");
                    Poll::Ready(Err(e))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Held<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.moved(n);
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            self.moved(n);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The caller's address and certificate, as the connection underneath tells them.
impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Held<IO> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits =
        Limits { connections: 5, connections_per_peer: 3, handshakes: 4, handshakes_per_peer: 2 };

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    /// One address fills its own share and no more: the others still connect, until the
    /// listener as a whole is full; every place comes back when its holder closes.
    #[test]
    fn one_address_holds_its_share_and_places_come_back() {
        let g = Gate::new(LIMITS);
        let mine: Vec<PeerSlot> = (0..3).map(|_| g.connect(ip(2)).unwrap()).collect();
        assert_eq!(g.connect(ip(2)).unwrap_err(), Full::PeerConnections(3));
        let a = g.connect(ip(1)).unwrap();
        let b = g.connect(ip(3)).unwrap();
        assert_eq!(g.connect(ip(4)).unwrap_err(), Full::Connections(5));
        assert_eq!(g.connections.held(), 5);
        drop(mine);
        assert_eq!(g.connections.held(), 2);
        let again: Vec<PeerSlot> = (0..3).map(|_| g.connect(ip(2)).unwrap()).collect();
        drop((a, b, again));
        assert_eq!(g.connections.held(), 0);
        assert!(g.connections.counts().by_key.is_empty(), "no address is remembered");
    }

    /// A client that completed its handshake and then said nothing kept its connection, and
    /// its place, for as long as it liked. Bytes either way keep a connection; silence for
    /// the bound (`PUBLIC_IDLE` on public ports; here 300 ms) ends it, and its place comes
    /// back.
    #[tokio::test]
    async fn a_connection_with_nothing_moving_is_let_go() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let bound = Duration::from_millis(300);
        let g = Gate::new(LIMITS);
        let (mut client, server) = tokio::io::duplex(4096);
        let mut held = Held::new(server, g.connect(ip(1)).unwrap(), Some(bound));
        for _ in 0..4 {
            tokio::time::sleep(bound / 3).await;
            client.write_all(b"x").await.unwrap();
            held.read_exact(&mut [0u8; 1]).await.unwrap();
        }
        for _ in 0..4 {
            tokio::time::sleep(bound / 3).await;
            held.write_all(b"y").await.unwrap();
        }
        let quiet = tokio::time::Instant::now();
        let read = tokio::time::timeout(10 * bound, held.read(&mut [0u8; 1])).await;
        let e = read.expect("an idle connection is let go").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(quiet.elapsed() >= bound * 9 / 10, "cut while bytes moved: {:?}", quiet.elapsed());
        drop(held);
        assert_eq!(g.connections.held(), 0);
    }

    #[test]
    fn handshakes_are_bounded_apart_from_connections() {
        let g = Gate::new(LIMITS);
        let h: Vec<PeerSlot> = (0..2).map(|_| g.handshake(ip(2)).unwrap()).collect();
        assert_eq!(g.handshake(ip(2)).unwrap_err(), Full::PeerHandshakes(2));
        let _c = g.connect(ip(2)).unwrap();
        let _o: Vec<PeerSlot> = (0..2).map(|_| g.handshake(ip(1)).unwrap()).collect();
        assert_eq!(g.handshake(ip(3)).unwrap_err(), Full::Handshakes(4));
        drop(h);
        assert!(g.handshake(ip(3)).is_ok());
    }
}
