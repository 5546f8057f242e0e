//! The TCP exchange that hands rank 0's NCCL unique id to the other ranks.
//!
//! Rank 0 listens on `MASTER_PORT` and serves a byte string to each of the
//! `world_size - 1` other ranks; they connect to `MASTER_ADDR:MASTER_PORT`
//! (retrying until rank 0 is up) and read it. Plain `std::net`, no MPI: the
//! same code serves mpirun and torchrun-style launches. Both sides give up
//! with a clear error at a deadline.
//!
//! **Only the job's ranks get the id.** Every rank holds a per-job secret
//! (the *token*: `ZERO_RENDEZVOUS_TOKEN`, or under Open MPI's `mpirun` the
//! random key it exports to the job's processes; see
//! [`LaunchEnv::token`](crate::launch::LaunchEnv::token)). Client and
//! server prove to each other that they know it, without sending it: each
//! sends a fresh random nonce and answers the other's with an HMAC-SHA-256
//! keyed by the token over both nonces, its role, the rank and the world
//! size. A client that cannot prove it gets nothing; a rank the world does
//! not have, or one already served, is refused with a status that says so
//! while the real ranks are still served; each connection is served on a
//! thread of its own, so a client that stalls holds up no one.
//!
//! The wire format (integers u32 little endian):
//! 1. client: `MAGIC`, rank, world size, client nonce (16 bytes);
//! 2. server: `MAGIC`, server nonce (16), server proof (32);
//! 3. client: client proof (32);
//! 4. server: status, payload length, payload (empty unless the status is
//!    `STATUS_OK`).

use crate::launch::LaunchEnv;
use crate::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"ZERORDV2";
const STATUS_OK: u32 = 0;
const STATUS_WORLD_MISMATCH: u32 = 1;
const STATUS_DUPLICATE: u32 = 2;
const STATUS_UNAUTHORIZED: u32 = 3;
const STATUS_NO_SUCH_RANK: u32 = 4;
const NONCE: usize = 16;
const PROOF: usize = 32;
/// Payloads are unique ids and small metadata; anything larger is a stray peer.
const MAX_PAYLOAD: usize = 1 << 20;
/// The longest a single handshake may block its connection's thread.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections handled at once; more are closed unanswered (a flood of
/// strangers must not exhaust the server's threads).
const MAX_HANDLERS: usize = 64;

type HmacSha256 = Hmac<Sha256>;

/// One exchange of a byte string from rank 0 to every other rank.
#[derive(Clone)]
pub struct Rendezvous {
    host: String,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    token: Option<Arc<[u8]>>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("Rendezvous")
            .field("addr", &self.address())
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl Rendezvous {
    /// An exchange through rank 0's server at `host:port`, with the default
    /// deadline of [`zero_core::comm::DEFAULT_TIMEOUT`] and no token yet:
    /// with more than one rank, set one with [`Rendezvous::with_token`].
    pub fn new(host: impl Into<String>, port: u16, rank: usize, world_size: usize) -> Self {
        Self {
            host: host.into(),
            port,
            rank,
            world_size,
            timeout: zero_core::comm::DEFAULT_TIMEOUT,
            token: None,
        }
    }

    /// The exchange a launcher's environment describes, with its token.
    pub fn from_launch(env: &LaunchEnv) -> Self {
        let rendezvous = Self::new(
            env.master_addr.clone(),
            env.master_port,
            env.rank,
            env.world_size,
        );
        match &env.token {
            Some(token) => rendezvous.with_token(token.as_bytes()),
            None => rendezvous,
        }
    }

    /// Sets the per-job secret every rank of the job shares (an empty one
    /// counts as none).
    pub fn with_token(mut self, token: impl AsRef<[u8]>) -> Self {
        let token = token.as_ref();
        self.token = (!token.is_empty()).then(|| Arc::from(token));
        self
    }

    /// Sets the deadline of the whole exchange.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// `host:port`, for messages.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// Rank 0 passes `Some(payload)`, serves it to every other rank and
    /// returns it; the others pass `None` and return what rank 0 served.
    pub fn exchange(&self, payload: Option<&[u8]>) -> Result<Vec<u8>> {
        match (self.rank, payload) {
            (0, Some(payload)) => {
                if self.world_size > 1 {
                    self.token()?;
                    // Bind every interface: MASTER_ADDR may name this host by
                    // an address other than the one it resolves to here.
                    let listener =
                        TcpListener::bind((Ipv4Addr::UNSPECIFIED, self.port)).map_err(|e| {
                            self.error(format!(
                                "cannot listen on port {}: {e}; is another job using MASTER_PORT?",
                                self.port
                            ))
                        })?;
                    self.serve_on(listener, payload)?;
                }
                Ok(payload.to_vec())
            }
            (0, None) => Err(self.error("rank 0 must provide the payload".into())),
            (_, _) => self.fetch(),
        }
    }

    /// The token, or an error that says how to set one.
    fn token(&self) -> Result<Arc<[u8]>> {
        self.token.clone().ok_or_else(|| {
            self.error(
                "no per-job secret to authenticate the ranks with: export the same \
                 ZERO_RENDEZVOUS_TOKEN to every rank (for example \
                 `export ZERO_RENDEZVOUS_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')`, \
                 and `mpirun -x ZERO_RENDEZVOUS_TOKEN` or your launcher's equivalent); \
                 Open MPI's mpirun provides one itself"
                    .into(),
            )
        })
    }

    /// Serves `payload` on `listener` until every other rank has read it
    /// (rank 0's side of [`Rendezvous::exchange`]; tests pass a listener on
    /// an ephemeral port). Each connection is handled on a thread of its
    /// own; a stranger, a rank the world does not have or one already
    /// served is refused and the others are still served.
    pub fn serve_on(&self, listener: TcpListener, payload: &[u8]) -> Result<()> {
        if payload.len() > MAX_PAYLOAD {
            return Err(self.error(format!(
                "payload of {} bytes exceeds {MAX_PAYLOAD}",
                payload.len()
            )));
        }
        let token = self.token()?;
        listener
            .set_nonblocking(true)
            .map_err(|e| self.error(format!("cannot poll the listener: {e}")))?;
        let shared = Arc::new(Served {
            payload: Arc::from(payload),
            token,
            world_size: self.world_size,
            claims: Mutex::new(vec![Claim::Free; self.world_size]),
            handlers: AtomicUsize::new(0),
        });
        let (done_tx, done) = mpsc::channel::<(SocketAddr, Result<usize, ServeError>)>();
        let start = Instant::now();
        loop {
            while let Ok((peer, outcome)) = done.try_recv() {
                match outcome {
                    Ok(rank) => tracing::debug!("rendezvous: served rank {rank} at {peer}"),
                    Err(ServeError::Fatal(detail)) => return Err(self.error(detail)),
                    // A client that hung up, a stranger, a stray connection:
                    // the real clients retry, so log and keep serving.
                    Err(ServeError::Refused(msg)) => {
                        tracing::warn!("rendezvous: refused a connection from {peer}: {msg}")
                    }
                }
            }
            let missing = shared.missing();
            if missing.is_empty() {
                return Ok(());
            }
            let elapsed = start.elapsed();
            if elapsed >= self.timeout {
                return Err(Error::RendezvousTimeout {
                    addr: self.address(),
                    rank: self.rank,
                    waited_s: elapsed.as_secs_f64(),
                    detail: format!("rank(s) {missing:?} never fetched the NCCL unique id"),
                });
            }
            match listener.accept() {
                Ok((stream, peer)) => self.handle(stream, peer, &shared, &done_tx),
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(self.error(format!("accept failed: {e}"))),
            }
        }
    }

    /// Starts a thread for one connection (unless too many are open).
    fn handle(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        shared: &Arc<Served>,
        done: &mpsc::Sender<(SocketAddr, Result<usize, ServeError>)>,
    ) {
        if shared.handlers.fetch_add(1, Ordering::AcqRel) >= MAX_HANDLERS {
            shared.handlers.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("rendezvous: {MAX_HANDLERS} connections open; closing {peer}");
            return;
        }
        let (shared, done) = (Arc::clone(shared), done.clone());
        let spawned = std::thread::Builder::new()
            .name("zero-rendezvous".into())
            .spawn(move || {
                let outcome = shared.serve_one(stream);
                shared.handlers.fetch_sub(1, Ordering::AcqRel);
                // The server may have finished with every rank meanwhile.
                let _ = done.send((peer, outcome));
            });
        if let Err(e) = spawned {
            tracing::warn!("rendezvous: no thread for {peer} ({e}); it will retry");
        }
    }

    /// Connects to rank 0 (retrying until the deadline) and reads the payload.
    pub fn fetch(&self) -> Result<Vec<u8>> {
        let token = self.token()?;
        let start = Instant::now();
        let mut backoff = Duration::from_millis(20);
        let mut last_error = String::from("no attempt made");
        loop {
            let elapsed = start.elapsed();
            if elapsed >= self.timeout {
                return Err(Error::RendezvousTimeout {
                    addr: self.address(),
                    rank: self.rank,
                    waited_s: elapsed.as_secs_f64(),
                    detail: format!("last error: {last_error}"),
                });
            }
            let remaining = self.timeout - elapsed;
            match self.try_fetch(&token, remaining) {
                Ok(payload) => return Ok(payload),
                Err(FetchError::Fatal(e)) => return Err(e),
                Err(FetchError::Retry(msg)) => last_error = msg,
            }
            std::thread::sleep(backoff.min(remaining));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    fn try_fetch(&self, token: &[u8], remaining: Duration) -> Result<Vec<u8>, FetchError> {
        let addrs: Vec<SocketAddr> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| FetchError::Retry(format!("cannot resolve {}: {e}", self.address())))?
            .collect();
        let step = remaining
            .min(HANDSHAKE_TIMEOUT)
            .max(Duration::from_millis(1));
        let mut last = format!("{} resolved to no address", self.host);
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, step) {
                // A connection to a port nobody listens on, from a local
                // port the kernel happened to pick equal to it, connects to
                // itself (TCP simultaneous open) and would keep the port
                // from rank 0: drop it and retry.
                Ok(stream) if stream.local_addr().ok() == Some(addr) => {
                    last = format!("connect to {addr}: connected to itself (no server yet)");
                }
                Ok(stream) => return self.handshake(stream, token, step),
                Err(e) => last = format!("connect to {addr}: {e}"),
            }
        }
        Err(FetchError::Retry(last))
    }

    fn handshake(
        &self,
        mut stream: TcpStream,
        token: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, FetchError> {
        let retry = |e: std::io::Error| FetchError::Retry(format!("handshake: {e}"));
        stream.set_read_timeout(Some(timeout)).map_err(retry)?;
        stream.set_write_timeout(Some(timeout)).map_err(retry)?;
        let (rank, world) = (self.rank as u32, self.world_size as u32);
        let client_nonce: [u8; NONCE] = rand::random();
        let mut hello = Vec::with_capacity(16 + NONCE);
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&rank.to_le_bytes());
        hello.extend_from_slice(&world.to_le_bytes());
        hello.extend_from_slice(&client_nonce);
        stream.write_all(&hello).map_err(retry)?;
        let mut challenge = [0u8; 8 + NONCE + PROOF];
        stream.read_exact(&mut challenge).map_err(retry)?;
        if &challenge[..8] != MAGIC {
            return Err(FetchError::Fatal(self.error(
                "the server at MASTER_ADDR:MASTER_PORT is not a zero-rs rendezvous; pick another \
                 MASTER_PORT"
                    .into(),
            )));
        }
        let server_nonce = &challenge[8..8 + NONCE];
        let server_proof = &challenge[8 + NONCE..];
        if proof(token, b"server", &client_nonce, server_nonce, rank, world)
            .verify_slice(server_proof)
            .is_err()
        {
            return Err(FetchError::Fatal(
                self.error(
                    "the server at MASTER_ADDR:MASTER_PORT does not know this job's token: \
                 ZERO_RENDEZVOUS_TOKEN differs between the ranks, or another job uses \
                 MASTER_PORT"
                        .into(),
                ),
            ));
        }
        let answer = proof(token, b"client", server_nonce, &client_nonce, rank, world);
        stream
            .write_all(&answer.finalize().into_bytes())
            .map_err(retry)?;
        let mut head = [0u8; 8];
        stream.read_exact(&mut head).map_err(retry)?;
        let status = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
        let refused = |detail: String| Err(FetchError::Fatal(self.error(detail)));
        match status {
            STATUS_OK if len <= MAX_PAYLOAD => {
                let mut payload = vec![0u8; len];
                stream.read_exact(&mut payload).map_err(retry)?;
                Ok(payload)
            }
            STATUS_WORLD_MISMATCH => refused(format!(
                "rank 0 refused rank {} of a world of {}: the world sizes differ",
                self.rank, self.world_size
            )),
            STATUS_NO_SUCH_RANK => refused(format!(
                "rank 0 refused rank {}: its world of {} has ranks 1..{} to serve",
                self.rank,
                self.world_size,
                self.world_size.saturating_sub(1)
            )),
            STATUS_DUPLICATE => refused(format!(
                "rank 0 already served rank {}: two processes claim that rank (is RANK set \
                 the same on two of them?)",
                self.rank
            )),
            STATUS_UNAUTHORIZED => refused(
                "rank 0 refused this rank's token: ZERO_RENDEZVOUS_TOKEN differs between the \
                 ranks"
                    .into(),
            ),
            _ => refused(format!("bad reply (status {status}, length {len})")),
        }
    }

    fn error(&self, detail: String) -> Error {
        Error::Rendezvous {
            addr: self.address(),
            rank: self.rank,
            detail,
        }
    }
}

/// The HMAC of one side's proof: keyed by the token, over the role, the
/// nonce it answers and its own, the rank and the world size.
fn proof(
    token: &[u8],
    role: &[u8],
    theirs: &[u8],
    ours: &[u8],
    rank: u32,
    world: u32,
) -> HmacSha256 {
    // HMAC takes a key of any length.
    let mut mac = HmacSha256::new_from_slice(token).expect("HMAC accepts any key length");
    mac.update(MAGIC);
    mac.update(role);
    mac.update(theirs);
    mac.update(ours);
    mac.update(&rank.to_le_bytes());
    mac.update(&world.to_le_bytes());
    mac
}

#[derive(Clone, Copy, PartialEq)]
enum Claim {
    Free,
    /// A connection is writing the payload to this rank.
    Serving,
    Served,
}

/// What the connections' threads share with the server.
struct Served {
    payload: Arc<[u8]>,
    token: Arc<[u8]>,
    world_size: usize,
    claims: Mutex<Vec<Claim>>,
    handlers: AtomicUsize,
}

impl Served {
    fn claims(&self) -> std::sync::MutexGuard<'_, Vec<Claim>> {
        // Plain flags: a panic elsewhere leaves them consistent.
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The ranks not served yet (rank 0 serves).
    fn missing(&self) -> Vec<usize> {
        let claims = self.claims();
        (1..self.world_size)
            .filter(|&r| claims[r] != Claim::Served)
            .collect()
    }

    /// One connection: authenticates the client, checks its rank and sends
    /// the payload. `Ok(rank)` once served.
    fn serve_one(&self, mut stream: TcpStream) -> Result<usize, ServeError> {
        let refused = |e: std::io::Error| ServeError::Refused(e.to_string());
        stream.set_nonblocking(false).map_err(refused)?;
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(refused)?;
        stream
            .set_write_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(refused)?;
        let mut hello = [0u8; 16 + NONCE];
        stream.read_exact(&mut hello).map_err(refused)?;
        if &hello[..8] != MAGIC {
            return Err(ServeError::Refused(
                "not a zero-rs rendezvous client".into(),
            ));
        }
        let rank = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]);
        let world = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]);
        let client_nonce = &hello[16..];
        let server_nonce: [u8; NONCE] = rand::random();
        let mut challenge = Vec::with_capacity(8 + NONCE + PROOF);
        challenge.extend_from_slice(MAGIC);
        challenge.extend_from_slice(&server_nonce);
        let ours = proof(
            &self.token,
            b"server",
            client_nonce,
            &server_nonce,
            rank,
            world,
        );
        challenge.extend_from_slice(&ours.finalize().into_bytes());
        stream.write_all(&challenge).map_err(refused)?;
        let mut answer = [0u8; PROOF];
        stream.read_exact(&mut answer).map_err(refused)?;
        let theirs = proof(
            &self.token,
            b"client",
            &server_nonce,
            client_nonce,
            rank,
            world,
        );
        if theirs.verify_slice(&answer).is_err() {
            // Best effort: the client learns why before the connection closes.
            let _ = reply(&mut stream, STATUS_UNAUTHORIZED, &[]);
            return Err(ServeError::Refused(format!(
                "a client claiming rank {rank} does not know the job's token"
            )));
        }
        let (rank, world) = (rank as usize, world as usize);
        if world != self.world_size {
            // Best effort: the client learns why before the connection closes.
            let _ = reply(&mut stream, STATUS_WORLD_MISMATCH, &[]);
            return Err(ServeError::Fatal(format!(
                "a rank of this job claims rank {rank} of {world}, but rank 0 runs a world of {}; \
                 is WORLD_SIZE the same on every rank?",
                self.world_size
            )));
        }
        if rank == 0 || rank >= world {
            // Best effort: the client learns why before the connection closes.
            let _ = reply(&mut stream, STATUS_NO_SUCH_RANK, &[]);
            return Err(ServeError::Refused(format!(
                "a client claims rank {rank}, which a world of {world} does not have to serve"
            )));
        }
        {
            let mut claims = self.claims();
            if claims[rank] != Claim::Free {
                drop(claims);
                // Best effort: the client learns why before the connection closes.
                let _ = reply(&mut stream, STATUS_DUPLICATE, &[]);
                return Err(ServeError::Refused(format!(
                    "rank {rank} is served already"
                )));
            }
            claims[rank] = Claim::Serving;
        }
        let sent = reply(&mut stream, STATUS_OK, &self.payload);
        self.claims()[rank] = if sent.is_ok() {
            Claim::Served
        } else {
            // The real rank retries.
            Claim::Free
        };
        sent.map(|()| rank).map_err(refused)
    }
}

/// Sends a status and its payload (empty unless `STATUS_OK`).
fn reply(stream: &mut TcpStream, status: u32, payload: &[u8]) -> std::io::Result<()> {
    let mut message = Vec::with_capacity(8 + payload.len());
    message.extend_from_slice(&status.to_le_bytes());
    message.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    message.extend_from_slice(payload);
    stream.write_all(&message)?;
    stream.flush()
}

enum ServeError {
    Refused(String),
    Fatal(String),
}

enum FetchError {
    Retry(String),
    Fatal(Error),
}
