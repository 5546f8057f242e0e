//! The TCP exchange of the NCCL unique id: pure Rust, runs everywhere.

use std::net::TcpListener;
use std::time::{Duration, Instant};
use zero_nccl::{Error, Rendezvous};

fn ephemeral() -> (TcpListener, u16) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    let port = listener.local_addr().expect("local address").port();
    (listener, port)
}

#[test]
fn payload_reaches_every_rank_intact() {
    let world = 4;
    let (listener, port) = ephemeral();
    let payload: Vec<u8> = (0..128u32).map(|i| (i * 37 % 251) as u8).collect();
    let clients: Vec<_> = (1..world)
        .map(|rank| {
            std::thread::spawn(move || {
                Rendezvous::new("127.0.0.1", port, rank, world)
                    .with_timeout(Duration::from_secs(20))
                    .fetch()
            })
        })
        .collect();
    Rendezvous::new("127.0.0.1", port, 0, world)
        .with_timeout(Duration::from_secs(20))
        .serve_on(listener, &payload)
        .expect("rank 0 serves every rank");
    for c in clients {
        assert_eq!(c.join().expect("client thread").expect("fetch"), payload);
    }
}

#[test]
fn clients_retry_until_the_server_is_up() {
    let (listener, port) = ephemeral();
    drop(listener); // nobody listens yet: clients must retry
    let client = std::thread::spawn(move || {
        Rendezvous::new("localhost", port, 1, 2)
            .with_timeout(Duration::from_secs(20))
            .exchange(None)
    });
    std::thread::sleep(Duration::from_millis(300));
    let served = Rendezvous::new("localhost", port, 0, 2)
        .with_timeout(Duration::from_secs(20))
        .exchange(Some(b"late id"))
        .expect("rank 0 serves");
    assert_eq!(served, b"late id");
    assert_eq!(client.join().expect("client").expect("fetch"), b"late id");
}

#[test]
fn missing_server_is_a_clear_error_after_the_deadline() {
    let (listener, port) = ephemeral();
    drop(listener);
    let start = Instant::now();
    let err = Rendezvous::new("127.0.0.1", port, 2, 3)
        .with_timeout(Duration::from_millis(500))
        .fetch()
        .expect_err("no server");
    assert!(start.elapsed() >= Duration::from_millis(500));
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(
        matches!(err, Error::RendezvousTimeout { rank: 2, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("timed out") && msg.contains("MASTER_ADDR"),
        "{msg}"
    );
    println!("{msg}");
}

#[test]
fn server_names_the_ranks_that_never_came() {
    let (listener, port) = ephemeral();
    let client = std::thread::spawn(move || {
        Rendezvous::new("127.0.0.1", port, 2, 3)
            .with_timeout(Duration::from_secs(10))
            .fetch()
    });
    let err = Rendezvous::new("127.0.0.1", port, 0, 3)
        .with_timeout(Duration::from_millis(800))
        .serve_on(listener, b"id")
        .expect_err("rank 1 never comes");
    assert!(err.to_string().contains("[1]"), "{err}");
    assert_eq!(
        client.join().expect("client").expect("rank 2 got it"),
        b"id"
    );
}

#[test]
fn world_size_mismatch_is_refused_on_both_sides() {
    let (listener, port) = ephemeral();
    let client = std::thread::spawn(move || {
        Rendezvous::new("127.0.0.1", port, 1, 3)
            .with_timeout(Duration::from_secs(10))
            .fetch()
    });
    let err = Rendezvous::new("127.0.0.1", port, 0, 2)
        .with_timeout(Duration::from_secs(10))
        .serve_on(listener, b"id")
        .expect_err("mismatch");
    assert!(err.to_string().contains("WORLD_SIZE"), "{err}");
    let err = client.join().expect("client").expect_err("refused");
    assert!(err.to_string().contains("world sizes differ"), "{err}");
}

#[test]
fn errors_convert_into_zero_core_errors() {
    let e: zero_core::Error = Error::BufferSize {
        op: "all_gather",
        what: "recv",
        got: 3,
        expected: 4,
    }
    .into();
    assert!(matches!(e, zero_core::Error::BufferSize { got: 3, .. }));
    let e: zero_core::Error = Error::NoLaunchEnv.into();
    assert!(matches!(e, zero_core::Error::Config(_)));
}
