//! The safe UCX layer between two workers in one process: puts land where the remote key
//! says, gets read them back, bad keys and addresses fail with UCX's status, and a closed
//! peer fails operations instead of hanging them.

use std::time::Duration;

use bytes::Bytes;
use pdmesh_kv_types::HostMemory;
use pdmesh_kv_ucx::ucx::{UcxError, UcxNode};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[tokio::test]
async fn put_flush_get_round_trip() {
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    let target = HostMemory::zeroed(1 << 20).expect("1 MiB");
    let region = b.register(&target.region()).expect("map");
    let ep = a.connect(b.address().clone()).await.expect("connect");
    let rkey = ep.remote_key(region.rkey().clone()).await.expect("rkey");

    let one = Bytes::from(pattern(300_000, 1));
    let two = Bytes::from(pattern(4096, 2));
    let p1 = ep.put(one.clone(), region.base() + 1000, &rkey);
    let p2 = ep.put(two.clone(), region.base() + 500_000, &rkey);
    p1.await.expect("put 1");
    p2.await.expect("put 2");
    ep.flush().await.expect("flush");
    let target = target.bytes();
    assert_eq!(&target[1000..301_000], &one[..]);
    assert_eq!(&target[500_000..504_096], &two[..]);
    assert!(target[..1000].iter().all(|&x| x == 0), "bytes before the put are untouched");

    let back = ep.get(4096, region.base() + 500_000, &rkey).await.expect("get");
    assert_eq!(back, two.to_vec());
    drop(rkey);
    drop(ep);
    drop(region);
}

#[tokio::test]
async fn garbage_is_refused_with_ucx_status() {
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    let err = a.connect(Bytes::from_static(b"not a worker address")).await.expect_err("garbage");
    assert!(err.to_string().contains("malformed UCX worker address"), "{err}");
    // A truncated or altered address is caught by its seal before UCX parses it.
    let good = b.address().clone();
    let err = a.connect(good.slice(..good.len() - 1)).await.expect_err("truncated");
    assert!(err.to_string().contains("does not match"), "{err}");
    let mut flipped = good.to_vec();
    *flipped.last_mut().expect("non-empty") ^= 1;
    assert!(a.connect(flipped.into()).await.is_err());
    let ep = a.connect(good).await.expect("connect");
    let err = ep.remote_key(Bytes::from_static(&[0xff; 40])).await.expect_err("garbage rkey");
    assert!(err.to_string().contains("malformed UCX remote key"), "{err}");
}

#[tokio::test]
async fn a_key_from_another_endpoint_is_refused() {
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    let target = HostMemory::zeroed(4096).expect("4 KiB");
    let region = b.register(&target.region()).expect("map");
    let ep1 = a.connect(b.address().clone()).await.expect("connect");
    let ep2 = a.connect(b.address().clone()).await.expect("connect");
    let k1 = ep1.remote_key(region.rkey().clone()).await.expect("rkey");
    let err = ep2.put(Bytes::from_static(b"x"), region.base(), &k1).await.expect_err("wrong ep");
    assert!(matches!(err, UcxError::Usage(_)), "{err}");
    drop(k1);
    drop(region);
}

#[tokio::test]
async fn a_registration_keeps_its_memory_after_the_owner_lets_go() {
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    let target = HostMemory::zeroed(4096).expect("4 KiB");
    let region = b.register(&target.region()).expect("map");
    // The pool's owner goes away first (an engine shutting down): a late put must still land
    // in memory the registration holds, never in freed memory.
    drop(target);
    let ep = a.connect(b.address().clone()).await.expect("connect");
    let rkey = ep.remote_key(region.rkey().clone()).await.expect("rkey");
    ep.put(Bytes::from_static(b"late"), region.base() + 8, &rkey).await.expect("put");
    ep.flush().await.expect("flush");
    let back = ep.get(4, region.base() + 8, &rkey).await.expect("get");
    assert_eq!(back, b"late");
    assert!(b.register(&HostMemory::zeroed(0).expect("empty").region()).is_err());
}

#[tokio::test]
async fn an_endpoint_keeps_its_own_node_alive() {
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    let ep = a.connect(b.address().clone()).await.expect("connect");
    drop(a);
    tokio::time::timeout(Duration::from_secs(10), ep.flush())
        .await
        .expect("flush must not hang")
        .expect("the endpoint's node still runs");
}

/// What `a_dead_peer_process_fails_operations_not_hangs` runs in a child process (this test
/// binary again, with `PEER_ENV` set): a worker with 4 KiB registered, whose worker address,
/// remote key and base it prints on one line, and then waits to be killed. Without `PEER_ENV`
/// it returns at once.
#[tokio::test]
#[ignore = "the peer process of a_dead_peer_process_fails_operations_not_hangs"]
async fn ucx_peer_process() {
    if std::env::var_os(PEER_ENV).is_none() {
        return;
    }
    let b = UcxNode::start("peer").expect("ucx peer");
    let target = HostMemory::zeroed(4096).expect("4 KiB");
    let region = b.register(&target.region()).expect("map");
    println!("PEER {} {} {}", hex(b.address()), hex(region.rkey()), region.base());
    // An orphan, should its parent die first, does not outlive it by much.
    tokio::time::sleep(Duration::from_secs(120)).await;
}

const PEER_ENV: &str = "PDMESH_TEST_UCX_PEER";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Bytes {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex")).collect()
}

/// The peer's process dies (killed, as a crashed node is): what the endpoint issues next ends
/// with UCX's error within a bound, never hangs and never reports success. UCX notices on its
/// next keepalive round (`UCX_KEEPALIVE_INTERVAL`, 20 s by default); until then the flush
/// waits, and it used to end in success: UCX completes it once it purges the endpoint.
#[tokio::test]
async fn a_dead_peer_process_fails_operations_not_hangs() {
    use std::io::BufRead;
    let mut peer = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "ucx_peer_process", "--ignored", "--nocapture"])
        .env(PEER_ENV, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("peer process starts");
    let out = std::io::BufReader::new(peer.stdout.take().expect("piped"));
    let line = out
        .lines()
        .map(|l| l.expect("peer's stdout"))
        .find(|l| l.starts_with("PEER "))
        .expect("the peer printed its address");
    let f: Vec<&str> = line.split(' ').collect();
    let (address, packed, base) = (unhex(f[1]), unhex(f[2]), f[3].parse::<u64>().expect("base"));

    let a = UcxNode::start("a").expect("ucx a");
    let ep = a.connect(address).await.expect("connect");
    let rkey = ep.remote_key(packed).await.expect("rkey");
    ep.put(Bytes::from_static(b"live"), base, &rkey).await.expect("put while the peer lives");
    ep.flush().await.expect("flush while the peer lives");
    assert_eq!(ep.get(4, base, &rkey).await.expect("get while the peer lives"), b"live");

    peer.kill().expect("kill the peer");
    peer.wait().expect("the peer is reaped");
    let after = tokio::time::timeout(Duration::from_secs(60), async {
        ep.put(Bytes::from_static(b"gone"), base, &rkey).await?;
        ep.flush().await
    })
    .await
    .expect("an operation on a dead peer must not hang");
    assert!(after.is_err(), "a put to a dead peer was reported done");
    let get = tokio::time::timeout(Duration::from_secs(60), ep.get(4, base, &rkey))
        .await
        .expect("a get from a dead peer must not hang");
    assert!(get.is_err(), "a get from a dead peer returned {get:?}");
}

/// Memory UCX allocates is shared memory a peer on this host maps into itself: what it writes
/// through the mapping is what the owner reads, and registered private memory does not map.
#[tokio::test]
#[allow(unsafe_code)]
async fn allocated_memory_is_mapped_by_a_peer_on_this_host() {
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    let alloc = b.allocate(1 << 20).expect("UCX allocates shared memory");
    assert!(alloc.len >= 1 << 20);
    // SAFETY: UCX allocated `alloc.len` fresh bytes that `keep` owns; only `owned` reads them
    // in b, and a writes only through its mapping below, before b reads.
    let owned = unsafe { HostMemory::adopt(alloc.addr, 1 << 20, alloc.keep.clone()) }
        .expect("page-aligned");
    assert!(owned.bytes().iter().all(|&x| x == 0), "fresh memory is zero");
    let ep = a.connect(b.address().clone()).await.expect("connect");
    let key = ep.remote_key(alloc.rkey.clone()).await.expect("rkey");
    let base = alloc.addr as u64;
    let local = ep.local_ptr(&key, base + 4096).await.expect("mapped");
    assert_ne!(local, alloc.addr + 4096, "a's mapping is its own");
    let data = pattern(100_000, 7);
    // SAFETY: `local` maps b's bytes 4096..104_096 of the allocation while `key` and `ep` live.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), local as *mut u8, data.len()) };
    assert_eq!(&owned.bytes()[4096..104_096], &data[..]);
    assert!(owned.bytes()[..4096].iter().all(|&x| x == 0));

    // Private memory registered for puts is no shared memory: no mapping, puts only.
    let private = HostMemory::zeroed(4096).expect("4 KiB");
    let region = b.register(&private.region()).expect("map");
    let k2 = ep.remote_key(region.rkey().clone()).await.expect("rkey");
    assert!(ep.local_ptr(&k2, region.base()).await.is_err());
    drop((k2, key, ep, region, owned, alloc));
}

/// A peer's mapping is made once and let go once idle; a transfer still holding it keeps it.
#[tokio::test]
#[allow(unsafe_code)]
async fn an_idle_mapping_is_let_go_but_not_under_a_transfer() {
    use pdmesh_kv_ucx::ucx::Peers;
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    let alloc = b.allocate(8192).expect("shared memory");
    // SAFETY: as in the test above; a writes only through its mapping, before b reads.
    let owned = unsafe { HostMemory::adopt(alloc.addr, 8192, alloc.keep.clone()) }.expect("ok");
    let peers = Peers::new(a.clone());
    let peer = peers.get(b.address()).await.expect("peer");
    let base = alloc.addr as u64;
    let plain = |k: &Bytes| Ok(k.clone());
    assert!(peer.shared(&alloc.rkey, base, 0, plain).await.is_err(), "an empty pool is refused");
    let m = peer.shared(&alloc.rkey, base, 8192, plain).await.expect("mapped");
    let opened = std::cell::Cell::new(false);
    let again = peer
        .shared(&alloc.rkey, base, 8192, |k| {
            opened.set(true);
            Ok(k.clone())
        })
        .await
        .expect("mapped");
    assert!(!opened.get(), "an offer already mapped is not opened again");
    assert!(std::sync::Arc::ptr_eq(&m, &again), "mapped once");
    assert!(peer.holds_mapping());
    peers.unmap_idle(Duration::from_secs(3600));
    assert!(peer.holds_mapping(), "recently used");
    peers.unmap_idle(Duration::ZERO);
    assert!(!peer.holds_mapping(), "idle: let go");
    // The transfer that still holds it writes on.
    // SAFETY: `m` (with `peer`) keeps the mapping of b's 8192 bytes alive.
    unsafe { *(m.local as *mut u8).add(100) = 42 };
    assert_eq!(owned.bytes()[100], 42);
    drop((m, again, peer, peers, owned, alloc));
}

/// A pool UCX cannot reach is offered through host staging blocks: each target names as many
/// staging blocks as the prompt has, in prompt order, a peer's puts land there, and the
/// blocks go back when the reservation lets go of them. Device memory is refused by a UCX
/// without a CUDA transport (this build's) rather than registered as if it were host memory.
#[tokio::test]
async fn a_staged_pool_hands_out_staging_blocks_in_prompt_order() {
    use pdmesh_kv_transfer::{GrantError, KvPath, PoolOffer, StagingArea};
    use pdmesh_kv_types::{KvDtype, KvGeometry, MemoryKind};
    use pdmesh_kv_ucx::pool::stage_kv_pool;
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    assert!(b.reaches(MemoryKind::Host));
    assert!(!b.reaches(MemoryKind::Cuda { device: 0 }), "this UCX is built without CUDA");

    let geometry =
        KvGeometry { layers: 2, kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 };
    let bpb = geometry.bytes_per_block();
    let pool = HostMemory::zeroed(16 * bpb).expect("pool");
    let area = StagingArea::new(HostMemory::zeroed(3 * bpb).expect("staging"), bpb).expect("3");
    let staged_pool = stage_kv_pool(&b, area.clone(), &pool.region(), &geometry).expect("staged");
    assert_eq!(staged_pool.path(), KvPath::Staged(MemoryKind::Host));
    assert_eq!(staged_pool.path().name(), "staged-host");

    // Pool blocks 9 and 4 (any: the puts do not go there) get two staging blocks.
    let g = staged_pool.grant(&[9, 4]).expect("granted");
    let staged = g.staged.as_ref().expect("staged blocks");
    let target: pdmesh_kv_ucx::descriptor::UcxTarget =
        pdmesh_kv_ucx::descriptor::open(&g.descriptor).expect("a UCX descriptor");
    assert_eq!(target.block_addrs.len(), 2);
    for i in 0..2 {
        assert_eq!(target.block_addrs[i], staged.addr(i) as u64, "prompt order");
    }
    assert_eq!(g.grant.digest(), pdmesh_kv_ucx::scope::digest(&target.ranges));
    assert_eq!(area.free_blocks(), 1);
    assert!(matches!(
        staged_pool.grant(&[1, 2]),
        Err(GrantError::StagingFull(f)) if f.want == 2 && f.free == 1
    ));
    // Staged, only how many blocks the prompt has counts (a grouped pool names indices).
    drop(staged_pool.grant(&[16]).expect("any ids"));
    assert_eq!(area.free_blocks(), 1);

    let ep = a.connect(target.worker_address.clone()).await.expect("connect");
    // Each run of neighbouring staging blocks has a key of its own.
    let mut keys = Vec::new();
    for r in &target.ranges {
        keys.push((r.base, r.len, ep.remote_key(r.rkey.clone()).await.expect("rkey")));
    }
    let blocks: Vec<Vec<u8>> = (0..2).map(|i| pattern(bpb, 7 + i as u8)).collect();
    for (i, data) in blocks.iter().enumerate() {
        let addr = target.block_addrs[i];
        let (_, _, key) = keys.iter().find(|k| k.0 <= addr && addr < k.0 + k.1).expect("a range");
        ep.put(Bytes::from(data.clone()), addr, key).await.expect("put");
    }
    ep.flush().await.expect("flush");
    for (i, data) in blocks.iter().enumerate() {
        assert_eq!(staged.block(i), &data[..], "block {i} landed in its staging block");
    }
    assert!(pool.bytes().iter().all(|&x| x == 0), "nothing was put into the pool itself");
    drop(keys);
    drop(g);
    assert_eq!(area.free_blocks(), 3, "back once the reservation lets go");
    // Put straight into the pool, its blocks' ids are addresses: checked against the pool.
    let direct = pdmesh_kv_ucx::pool::register_kv_pool(&b, &pool.region(), &geometry).unwrap();
    assert!(direct.grant(&[16]).is_err(), "past the pool");
    drop(direct.grant(&[15]).expect("the pool's last block"));
}
