//! Hosts on one machine, for mesh tests and benchmarks: each a network namespace of its own
//! (`ip netns`), joined to the caller's namespace by a veth pair on a bridge, with an address
//! of its own; its processes also get an IPC namespace of their own (`command_prefix`), so
//! nothing but the network is shared, as between machines. A host can be cut off the network
//! (its link down) and back, and its link shaped to a bandwidth (`tc tbf`). Needs root and
//! iproute2; everything made is removed on drop.
//!
//! `tc netem` would also delay and lose packets, but the kernels this runs on may lack its
//! module (`sch_netem`, and the classifiers and actions a port filter needs): slowness is made
//! by pausing processes instead, and a fault that cuts one kind of traffic by a second network
//! (`with_fabric`) that only that traffic uses.

use std::collections::HashMap;
use std::process::Command;

/// A bridge and one namespace per named host.
#[derive(Debug)]
pub struct Netns {
    /// Short and unique, so that names fit the kernel's 15 bytes and runs do not collide.
    tag: String,
    bridge: String,
    /// The bridge of the second network (`with_fabric`).
    fabric: Option<String>,
    hosts: HashMap<String, Host>,
}

/// The second network's interface in every host (`with_fabric`): `UCX_NET_DEVICES=fabric0`
/// keeps UCX on it.
pub const FABRIC_DEVICE: &str = "fabric0";

#[derive(Debug, Clone)]
struct Host {
    ns: String,
    /// The veth end on the bridge (in the test's namespace): down cuts the host off.
    link: String,
    ip: String,
    /// The veth end inside the namespace.
    peer: String,
    /// The fabric veth end on its bridge.
    fabric: Option<String>,
}

/// Runs `tool` (iproute2's `ip` or `tc`) with `args`; its stderr says why it failed.
fn run(tool: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(tool).args(args).output().map_err(|e| format!("{tool}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        let why = String::from_utf8_lossy(&out.stderr);
        Err(format!("{tool} {}: {}", args.join(" "), why.trim()))
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

impl Netns {
    /// A host for each of `names`, all on one new bridge with 10.N.0.0/24 addresses.
    pub fn new(names: &[&str]) -> Result<Netns, String> {
        Self::build(names, false)
    }

    /// `new`, with a second network between the hosts (10.N.1.0/24, `FABRIC_DEVICE` in
    /// each), as an RDMA fabric beside the front-end network: cutting it (`connect_fabric`)
    /// cuts what runs over it and nothing else.
    pub fn with_fabric(names: &[&str]) -> Result<Netns, String> {
        Self::build(names, true)
    }

    fn build(names: &[&str], fabric: bool) -> Result<Netns, String> {
        // Several sets of hosts may live in one test process at once.
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let tag = format!("pd{:x}{:x}", pid % 0xffff, made % 16);
        let subnet = 100 + (pid + 13 * made) % 150;
        let bridge = format!("{tag}br");
        let fabric_bridge = fabric.then(|| format!("{tag}fb"));
        let mut n = Netns {
            tag: tag.clone(),
            bridge: bridge.clone(),
            fabric: fabric_bridge.clone(),
            hosts: HashMap::new(),
        };
        for (br, net) in std::iter::once((&bridge, 0)).chain(fabric_bridge.iter().map(|b| (b, 1))) {
            ip(&["link", "add", br, "type", "bridge"])?;
            ip(&["addr", "add", &format!("10.{subnet}.{net}.1/24"), "dev", br])?;
            ip(&["link", "set", br, "up"])?;
        }
        for (i, name) in names.iter().enumerate() {
            let host = Host {
                ns: format!("{tag}-{name}"),
                link: format!("{tag}h{i}"),
                ip: format!("10.{subnet}.0.{}", 10 + i),
                peer: format!("{tag}n{i}"),
                fabric: fabric.then(|| format!("{tag}f{i}")),
            };
            let peer = host.peer.clone();
            ip(&["netns", "add", &host.ns])?;
            n.hosts.insert(name.to_string(), host.clone());
            ip(&["link", "add", &host.link, "type", "veth", "peer", "name", &peer])?;
            ip(&["link", "set", &peer, "netns", &host.ns])?;
            ip(&["link", "set", &host.link, "master", &bridge])?;
            ip(&["link", "set", &host.link, "up"])?;
            let inside = |args: &[&str]| {
                let mut a = vec!["netns", "exec", &host.ns, "ip"];
                a.extend(args);
                ip(&a)
            };
            inside(&["link", "set", "lo", "up"])?;
            inside(&["addr", "add", &format!("{}/24", host.ip), "dev", &peer])?;
            inside(&["link", "set", &peer, "up"])?;
            if let (Some(link), Some(br)) = (&host.fabric, &fabric_bridge) {
                let tmp = format!("{tag}g{i}");
                ip(&["link", "add", link, "type", "veth", "peer", "name", &tmp])?;
                ip(&["link", "set", &tmp, "netns", &host.ns])?;
                ip(&["link", "set", link, "master", br])?;
                ip(&["link", "set", link, "up"])?;
                inside(&["link", "set", &tmp, "name", FABRIC_DEVICE])?;
                let addr = format!("10.{subnet}.1.{}/24", 10 + i);
                inside(&["addr", "add", &addr, "dev", FABRIC_DEVICE])?;
                inside(&["link", "set", FABRIC_DEVICE, "up"])?;
            }
        }
        Ok(n)
    }

    /// What runs a command on host `name`: `ip netns exec NS`, then `unshare --ipc` unless
    /// `shared_ipc` (the host shares this machine's IPC namespace), then the command.
    pub fn command_prefix(&self, name: &str, shared_ipc: bool) -> Option<Vec<String>> {
        let h = self.hosts.get(name)?;
        let mut prefix = ["ip", "netns", "exec", &h.ns].map(String::from).to_vec();
        if !shared_ipc {
            prefix.extend(["unshare", "--ipc"].map(String::from));
        }
        Some(prefix)
    }

    /// Shapes host `name`'s link to `mbit` Mbit/s each way (`tc tbf` on both ends of its
    /// veth), or takes the shaping off (`None`).
    pub fn shape(&self, name: &str, mbit: Option<u64>) -> Result<(), String> {
        let h = &self.hosts[name];
        for (netns, dev) in [(None, &h.link), (Some(&h.ns), &h.peer)] {
            let tc = |args: &[&str]| match netns {
                Some(ns) => run("tc", &[&["-netns", ns.as_str()], args].concat()),
                None => run("tc", args),
            };
            let _ = tc(&["qdisc", "del", "dev", dev, "root"]);
            if let Some(mbit) = mbit {
                // The bucket holds 4 ms of the rate (at least 256 KiB: a whole GSO
                // segment and then some), small beside the transfers it shapes.
                let burst = (mbit * 1_000_000 / 8 / 250).max(256 << 10);
                let (rate, burst) = (format!("{mbit}mbit"), burst.to_string());
                tc(&[
                    "qdisc", "add", "dev", dev, "root", "tbf", "rate", &rate, "burst", &burst,
                    "latency", "50ms",
                ])?;
            }
        }
        Ok(())
    }

    /// The namespace and address of host `name`.
    pub fn host(&self, name: &str) -> Option<(&str, &str)> {
        self.hosts.get(name).map(|h| (h.ns.as_str(), h.ip.as_str()))
    }

    /// Cuts host `name` off the fabric (`false`) or joins it again (`true`); its front-end
    /// network stays up.
    pub fn connect_fabric(&self, name: &str, up: bool) {
        let link = self.hosts[name].fabric.as_ref().expect("hosts made with_fabric");
        ip(&["link", "set", link, if up { "up" } else { "down" }])
            .unwrap_or_else(|e| panic!("cutting {name}'s fabric: {e}"));
    }

    /// Cuts host `name` off the network (`false`) or joins it again (`true`).
    pub fn connect(&self, name: &str, up: bool) {
        let h = &self.hosts[name];
        ip(&["link", "set", &h.link, if up { "up" } else { "down" }])
            .unwrap_or_else(|e| panic!("partitioning {name}: {e}"));
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for h in self.hosts.values() {
            let _ = ip(&["netns", "del", &h.ns]);
            let _ = ip(&["link", "del", &h.link]);
            if let Some(f) = &h.fabric {
                let _ = ip(&["link", "del", f]);
            }
        }
        let _ = ip(&["link", "del", &self.bridge]);
        if let Some(f) = &self.fabric {
            let _ = ip(&["link", "del", f]);
        }
        let _ = &self.tag;
    }
}
