//! Which host a UCX peer is on, as UCX will judge it. UCX takes two processes for one host
//! when their kernel boot ids match, and lets them share memory when their IPC namespaces
//! match; it never looks at the network namespace. Processes in different network namespaces
//! of one kernel that share IPC (`ip netns exec`, containers run with the host's IPC) are
//! then given a shared-memory lane whose wake-ups go through abstract Unix sockets — and
//! those belong to a network namespace, so every wake-up is lost (UCX ignores the
//! ECONNREFUSED) and a transfer crawls on the progress thread's idle tick until it times out.
//! A worker address therefore carries its host's identity, and an endpoint to such a peer is
//! refused up front, so the transfer takes another transport at once.

use std::os::unix::fs::MetadataExt;

use super::UcxError;

/// A process's kernel and namespaces, as far as UCX's transport choice depends on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostId {
    /// xxh3 of the kernel's boot id (what UCX's system id is made of).
    pub boot: u64,
    /// Inode numbers of the IPC and network namespaces.
    pub ipc: u64,
    pub net: u64,
}

const LEN: usize = 24;

impl HostId {
    /// This process's.
    pub fn here() -> HostId {
        static HERE: std::sync::OnceLock<HostId> = std::sync::OnceLock::new();
        *HERE.get_or_init(|| {
            let boot = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
            let ns =
                |n: &str| std::fs::metadata(format!("/proc/self/ns/{n}")).map_or(0, |m| m.ino());
            HostId { boot: xxhash_rust::xxh3::xxh3_64(&boot), ipc: ns("ipc"), net: ns("net") }
        })
    }

    pub fn to_bytes(self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..8].copy_from_slice(&self.boot.to_le_bytes());
        b[8..16].copy_from_slice(&self.ipc.to_le_bytes());
        b[16..].copy_from_slice(&self.net.to_le_bytes());
        b
    }

    /// The identity a worker address starts with, and the UCX address after it.
    pub fn split(raw: &bytes::Bytes) -> Option<(HostId, bytes::Bytes)> {
        let head = raw.get(..LEN)?;
        let word = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8 bytes"));
        Some((HostId { boot: word(0), ipc: word(8), net: word(16) }, raw.slice(LEN..)))
    }

    /// Whether UCX can connect this process to `peer` and make progress: not when UCX
    /// would share memory with it (same kernel, same IPC namespace) across network
    /// namespaces.
    pub fn check(&self, peer: &HostId) -> Result<(), UcxError> {
        if self.boot == peer.boot && self.ipc == peer.ipc && self.net != peer.net {
            return Err(UcxError::Usage(
                "the peer shares this host's memory (IPC namespace) but not its network \
                 namespace: UCX would move KV through shared memory whose wake-ups cannot \
                 cross network namespaces (give each its own IPC namespace, or share the \
                 network namespace)"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_sharing_memory_but_not_the_network_is_refused() {
        let here = HostId { boot: 1, ipc: 2, net: 3 };
        assert!(here.check(&here).is_ok(), "a process on this host, same namespaces");
        assert!(here.check(&HostId { net: 4, ..here }).is_err(), "shared IPC, own network");
        assert!(here.check(&HostId { ipc: 5, net: 4, ..here }).is_ok(), "a container");
        assert!(here.check(&HostId { boot: 9, ..here }).is_ok(), "another machine");
        let raw = bytes::Bytes::from([here.to_bytes().as_slice(), b"ucx"].concat());
        assert_eq!(HostId::split(&raw), Some((here, bytes::Bytes::from_static(b"ucx"))));
        assert_eq!(HostId::split(&bytes::Bytes::from_static(b"short")), None);
    }

    #[test]
    fn this_process_knows_its_kernel_and_namespaces() {
        let h = HostId::here();
        assert_ne!(h.ipc, 0);
        assert_ne!(h.net, 0);
        assert_ne!(h.boot, xxhash_rust::xxh3::xxh3_64(b""));
    }
}
