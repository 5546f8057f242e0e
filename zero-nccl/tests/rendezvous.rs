//! The TCP exchange of the NCCL unique id: pure Rust, runs everywhere.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use zero_nccl::{Error, Rendezvous};

const TOKEN: &str = "the job's secret";

/// A rank of the test's job.
fn rank(port: u16, rank: usize, world: usize) -> Rendezvous {
    Rendezvous::new("127.0.0.1", port, rank, world)
        .with_token(TOKEN)
        .with_timeout(Duration::from_secs(20))
}

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
                    .with_token(TOKEN)
                    .with_timeout(Duration::from_secs(20))
                    .fetch()
            })
        })
        .collect();
    Rendezvous::new("127.0.0.1", port, 0, world)
        .with_token(TOKEN)
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
            .with_token(TOKEN)
            .with_timeout(Duration::from_secs(20))
            .exchange(None)
    });
    std::thread::sleep(Duration::from_millis(300));
    let served = Rendezvous::new("localhost", port, 0, 2)
        .with_token(TOKEN)
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
        .with_token(TOKEN)
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
            .with_token(TOKEN)
            .with_timeout(Duration::from_secs(10))
            .fetch()
    });
    let err = Rendezvous::new("127.0.0.1", port, 0, 3)
        .with_token(TOKEN)
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
            .with_token(TOKEN)
            .with_timeout(Duration::from_secs(10))
            .fetch()
    });
    let err = Rendezvous::new("127.0.0.1", port, 0, 2)
        .with_token(TOKEN)
        .with_timeout(Duration::from_secs(10))
        .serve_on(listener, b"id")
        .expect_err("mismatch");
    assert!(err.to_string().contains("WORLD_SIZE"), "{err}");
    let err = client.join().expect("client").expect_err("refused");
    assert!(err.to_string().contains("world sizes differ"), "{err}");
}

#[test]
fn errors_convert_into_zero_core_errors() {
    // zero-core's kinds are zero-core's errors, whole.
    let e: zero_core::Error = Error::from(zero_core::Error::BufferSize {
        op: "all_gather",
        what: "recv",
        got: 3,
        expected: 4,
    })
    .into();
    assert!(matches!(e, zero_core::Error::BufferSize { got: 3, .. }));
    let e: zero_core::Error = Error::NoLaunchEnv.into();
    assert!(matches!(e, zero_core::Error::Config(_)));
}

/// A raw client speaking the wire format up to the server's challenge:
/// what a stranger who knows the protocol but not the token can do.
fn stranger(port: u16, rank: u32, world: u32) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut hello = b"ZERORDV2".to_vec();
    hello.extend_from_slice(&rank.to_le_bytes());
    hello.extend_from_slice(&world.to_le_bytes());
    hello.extend_from_slice(&[7u8; 16]);
    stream.write_all(&hello).expect("hello");
    let mut challenge = [0u8; 8 + 16 + 32];
    stream.read_exact(&mut challenge).expect("challenge");
    stream
}

/// Reads the server's last message: (status, payload).
fn outcome(stream: &mut TcpStream) -> (u32, Vec<u8>) {
    let mut head = [0u8; 8];
    stream.read_exact(&mut head).expect("status");
    let status = u32::from_le_bytes(head[..4].try_into().unwrap());
    let len = u32::from_le_bytes(head[4..].try_into().unwrap()) as usize;
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).expect("payload");
    (status, payload)
}

#[test]
fn a_client_without_the_token_gets_nothing_and_the_ranks_are_served() {
    let (listener, port) = ephemeral();
    let server =
        std::thread::spawn(move || rank(port, 0, 3).serve_on(listener, b"the NCCL unique id"));
    // Knows the magic bytes and claims rank 1, but guesses the proof.
    let mut guess = stranger(port, 1, 3);
    guess.write_all(&[0u8; 32]).expect("answer");
    let (status, payload) = outcome(&mut guess);
    assert_ne!(status, 0, "a stranger is refused");
    assert!(payload.is_empty(), "and gets no id");
    // A client of another job (another token) learns the server is not its own.
    let err = Rendezvous::new("127.0.0.1", port, 2, 3)
        .with_token("another job's secret")
        .with_timeout(Duration::from_secs(20))
        .fetch()
        .expect_err("wrong token");
    assert!(err.to_string().contains("token"), "{err}");
    // The job's own ranks, rank 1 included, are still served.
    for r in [1, 2] {
        assert_eq!(
            rank(port, r, 3).fetch().expect("served"),
            b"the NCCL unique id"
        );
    }
    server.join().expect("server").expect("every rank served");
}

#[test]
fn a_duplicate_or_out_of_range_rank_is_refused_and_the_real_one_served() {
    let (listener, port) = ephemeral();
    let server = std::thread::spawn(move || rank(port, 0, 3).serve_on(listener, b"id"));
    assert_eq!(rank(port, 1, 3).fetch().expect("rank 1"), b"id");
    let err = rank(port, 1, 3).fetch().expect_err("rank 1 again");
    assert!(err.to_string().contains("already served rank 1"), "{err}");
    let err = rank(port, 7, 3).fetch().expect_err("rank 7 of 3");
    assert!(err.to_string().contains("refused rank 7"), "{err}");
    // Neither took rank 2's place.
    assert_eq!(rank(port, 2, 3).fetch().expect("rank 2"), b"id");
    server.join().expect("server").expect("every rank served");
}

#[test]
fn a_stalled_client_holds_up_no_one() {
    let (listener, port) = ephemeral();
    let start = Instant::now();
    let server = std::thread::spawn(move || rank(port, 0, 3).serve_on(listener, b"id"));
    // Connects and sends nothing, then one that stops after the hello.
    let _silent = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let _stopped = stranger(port, 1, 3);
    for r in [1, 2] {
        assert_eq!(rank(port, r, 3).fetch().expect("served"), b"id");
    }
    server.join().expect("server").expect("every rank served");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "served in {:?}, not after the stalled handshakes' 10 s",
        start.elapsed()
    );
}

#[test]
fn without_a_token_neither_side_starts() {
    let (listener, port) = ephemeral();
    let err = Rendezvous::new("127.0.0.1", port, 0, 2)
        .serve_on(listener, b"id")
        .expect_err("no token");
    assert!(err.to_string().contains("ZERO_RENDEZVOUS_TOKEN"), "{err}");
    let err = Rendezvous::new("127.0.0.1", port, 1, 2)
        .fetch()
        .expect_err("no token");
    assert!(err.to_string().contains("ZERO_RENDEZVOUS_TOKEN"), "{err}");
    // One rank needs no exchange, and no token.
    let one = Rendezvous::new("127.0.0.1", port, 0, 1).exchange(Some(b"id"));
    assert_eq!(one.expect("world of one"), b"id");
}
