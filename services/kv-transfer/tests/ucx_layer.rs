//! The safe UCX layer between two workers in one process: puts land where the remote key
//! says, gets read them back, bad keys and addresses fail with UCX's status, and a closed
//! peer fails operations instead of hanging them.

use std::time::Duration;

use bytes::Bytes;
use pdmesh_kv_transfer::ucx::{UcxError, UcxNode};
use pdmesh_kv_types::HostMemory;

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
async fn operations_after_the_node_is_gone_fail_not_hang() {
    let a = UcxNode::start("a").expect("ucx a");
    let b = UcxNode::start("b").expect("ucx b");
    let ep = a.connect(b.address().clone()).await.expect("connect");
    drop(a);
    // The endpoint keeps the node alive: flushing with nothing issued still completes.
    tokio::time::timeout(Duration::from_secs(10), ep.flush())
        .await
        .expect("flush must not hang")
        .expect("empty flush succeeds");
}
