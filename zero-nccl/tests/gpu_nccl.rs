//! NcclComm at world size 1 against host references (NCCL refuses two ranks
//! on one GPU; the multi-rank logic is tested on the thread backend). Needs a
//! GPU and libnccl: `#[ignore]`d, run with `-- --ignored` on a GPU machine,
//! where a missing GPU or libnccl fails the test saying which.
#![cfg(feature = "nccl")]

mod common;

use zero_core::engine::UnitBucket;
use zero_core::{Communicator, ReduceOp};
use zero_nccl::{DeviceComm, NcclComm};

fn comm() -> NcclComm {
    common::nccl_comm()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn collectives_at_world_size_one() {
    let comm = comm();
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let stream = comm.compute_stream().clone();
    let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();

    for op in [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
    ] {
        let mut buf = stream.clone_htod(&host).expect("upload");
        comm.all_reduce(&mut buf, op).expect("all_reduce");
        assert_eq!(stream.clone_dtoh(&buf).expect("download"), host, "{op:?}");
    }

    let send = stream.clone_htod(&host).expect("upload");
    let mut recv = stream.alloc_zeros::<f32>(1000).expect("alloc");
    comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
        .expect("reduce_scatter");
    assert_eq!(stream.clone_dtoh(&recv).expect("download"), host);

    let mut gathered = stream.alloc_zeros::<f32>(1000).expect("alloc");
    comm.all_gather(&send, &mut gathered).expect("all_gather");
    assert_eq!(stream.clone_dtoh(&gathered).expect("download"), host);

    let mut bad = stream.alloc_zeros::<f32>(999).expect("alloc");
    assert!(
        comm.all_gather(&send, &mut bad).is_err(),
        "size mismatch must be an error"
    );

    // A layer's buckets in one NCCL group, from the shard and in place,
    // around a gap the gathers leave alone.
    let bucket = |shard: std::ops::Range<usize>, at| UnitBucket { shard, at };
    let buckets = [
        bucket(0..300, 0..300),
        bucket(300..300, 300..300),
        bucket(300..1000, 310..1010),
    ];
    let mut want = vec![-1.0f32; 1010];
    want[..300].copy_from_slice(&host[..300]);
    want[310..].copy_from_slice(&host[300..]);
    let mut gathered = stream.clone_htod(&vec![-1.0f32; 1010]).expect("upload");
    let done = comm
        .all_gather_buckets_event(&send, &mut gathered, &buckets)
        .expect("all_gather_buckets");
    stream.wait(&done).expect("wait");
    assert_eq!(stream.clone_dtoh(&gathered).expect("download"), want);
    let mut in_place = stream.clone_htod(&want).expect("upload");
    let done = comm
        .all_gather_buckets_in_place_event(&mut in_place, &buckets)
        .expect("all_gather_buckets in place");
    stream.wait(&done).expect("wait");
    assert_eq!(stream.clone_dtoh(&in_place).expect("download"), want);
    let past = [bucket(0..1001, 0..1001)];
    assert!(
        comm.all_gather_buckets_event(&send, &mut gathered, &past)
            .is_err(),
        "a bucket past the shard must be an error"
    );

    let mut b = stream.clone_htod(&host).expect("upload");
    comm.broadcast(&mut b, 0).expect("broadcast");
    comm.reduce(&mut b, ReduceOp::Sum, 0).expect("reduce");
    assert_eq!(stream.clone_dtoh(&b).expect("download"), host);
    assert!(
        comm.broadcast(&mut b, 1).is_err(),
        "root 1 is outside a group of 1"
    );

    let mut all = stream.alloc_zeros::<f32>(1000).expect("alloc");
    comm.all_gather_varlen(&send, &[1000], &mut all)
        .expect("all_gather_varlen");
    assert_eq!(stream.clone_dtoh(&all).expect("download"), host);
    let mut root = stream.alloc_zeros::<f32>(1000).expect("alloc");
    comm.gather_varlen(&send, &[1000], Some(&mut root), 0)
        .expect("gather_varlen");
    assert_eq!(stream.clone_dtoh(&root).expect("download"), host);

    assert_eq!(
        comm.all_gather_bytes(b"fingerprint").expect("bytes"),
        vec![b"fingerprint".to_vec()]
    );
    comm.barrier().expect("barrier");
    assert_eq!(comm.bytes_sent(), 0, "a group of one sends nothing");

    let sub = comm.split(&[0]).expect("split").expect("member");
    assert_eq!((sub.rank(), sub.world_size()), (0, 1));
    let mut x = stream.clone_htod(&host).expect("upload");
    sub.all_reduce(&mut x, ReduceOp::Sum)
        .expect("sub all_reduce");
    assert_eq!(stream.clone_dtoh(&x).expect("download"), host);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn async_work_orders_the_compute_stream() {
    let comm = comm();
    let stream = comm.compute_stream().clone();
    let host: Vec<half::bf16> = (0..4096).map(|i| half::bf16::from_f32(i as f32)).collect();
    let mut buf = stream.clone_htod(&host).expect("upload");
    let mut work = comm
        .all_reduce_async(&mut buf, ReduceOp::Sum)
        .expect("start");
    let _ = work.test().expect("test");
    work.wait().expect("wait");
    assert_eq!(stream.clone_dtoh(&buf).expect("download"), host);
}

#[test]
fn missing_driver_is_an_error_not_a_panic() {
    if zero_nccl::cuda_device_count().is_ok() {
        println!("skipping: a CUDA driver is present");
        return;
    }
    let err = NcclComm::single(0).expect_err("no driver");
    assert!(
        matches!(err, zero_nccl::Error::LibraryNotFound { .. }),
        "{err}"
    );
    let core: zero_core::Error = err.into();
    assert!(core.to_string().contains("libcuda.so not found"), "{core}");
}
