//! The TCP exchange that hands rank 0's NCCL unique id to the other ranks.
//!
//! Rank 0 listens on `MASTER_PORT` and serves a byte string to each of the
//! `world_size - 1` other ranks; they connect to `MASTER_ADDR:MASTER_PORT`
//! (retrying until rank 0 is up) and read it. Plain `std::net`, no MPI: the
//! same code serves mpirun and torchrun-style launches. Both sides give up
//! with a clear error at a deadline.
//!
//! The wire format: the client sends `MAGIC`, its rank and the world size
//! (u32 little endian); the server answers `MAGIC`, a status (0: ok, 1: world
//! size mismatch), the payload length (u32) and the payload.

use crate::launch::LaunchEnv;
use crate::{Error, Result};
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"ZERORDV1";
const STATUS_OK: u32 = 0;
const STATUS_WORLD_MISMATCH: u32 = 1;
/// Payloads are unique ids and small metadata; anything larger is a stray peer.
const MAX_PAYLOAD: usize = 1 << 20;
/// The longest a single handshake may block, so one stuck client cannot hold
/// the server past its deadline for long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One exchange of a byte string from rank 0 to every other rank.
#[derive(Clone, Debug)]
pub struct Rendezvous {
    host: String,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
}

impl Rendezvous {
    /// An exchange through rank 0's server at `host:port`, with the default
    /// deadline of [`zero_core::comm::DEFAULT_TIMEOUT`].
    pub fn new(host: impl Into<String>, port: u16, rank: usize, world_size: usize) -> Self {
        Self {
            host: host.into(),
            port,
            rank,
            world_size,
            timeout: zero_core::comm::DEFAULT_TIMEOUT,
        }
    }

    /// The exchange a launcher's environment describes.
    pub fn from_launch(env: &LaunchEnv) -> Self {
        Self::new(
            env.master_addr.clone(),
            env.master_port,
            env.rank,
            env.world_size,
        )
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

    /// Serves `payload` on `listener` until every other rank has read it
    /// (rank 0's side of [`Rendezvous::exchange`]; tests pass a listener on
    /// an ephemeral port).
    pub fn serve_on(&self, listener: TcpListener, payload: &[u8]) -> Result<()> {
        if payload.len() > MAX_PAYLOAD {
            return Err(self.error(format!(
                "payload of {} bytes exceeds {MAX_PAYLOAD}",
                payload.len()
            )));
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| self.error(format!("cannot poll the listener: {e}")))?;
        let start = Instant::now();
        let mut served = vec![false; self.world_size];
        served[0] = true;
        while served.iter().any(|s| !s) {
            let elapsed = start.elapsed();
            if elapsed >= self.timeout {
                let missing: Vec<usize> = (0..self.world_size).filter(|&r| !served[r]).collect();
                return Err(Error::RendezvousTimeout {
                    addr: self.address(),
                    rank: self.rank,
                    waited_s: elapsed.as_secs_f64(),
                    detail: format!("rank(s) {missing:?} never fetched the NCCL unique id"),
                });
            }
            match listener.accept() {
                Ok((stream, peer)) => match self.serve_one(stream, payload) {
                    Ok(rank) => served[rank] = true,
                    Err(ServeError::Fatal(e)) => return Err(e),
                    // A client that hung up or a stray connection: the real
                    // client retries, so log and keep serving.
                    Err(ServeError::Retry(msg)) => {
                        tracing::warn!("rendezvous: ignoring connection from {peer}: {msg}")
                    }
                },
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(self.error(format!("accept failed: {e}"))),
            }
        }
        Ok(())
    }

    fn serve_one(&self, mut stream: TcpStream, payload: &[u8]) -> Result<usize, ServeError> {
        let retry = |e: std::io::Error| ServeError::Retry(e.to_string());
        stream.set_nonblocking(false).map_err(retry)?;
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(retry)?;
        stream
            .set_write_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(retry)?;
        let mut hello = [0u8; 16];
        stream.read_exact(&mut hello).map_err(retry)?;
        if &hello[..8] != MAGIC {
            return Err(ServeError::Retry("not a zero-rs rendezvous client".into()));
        }
        let rank = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
        let world = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
        let mut reply = Vec::with_capacity(16 + payload.len());
        reply.extend_from_slice(MAGIC);
        if world != self.world_size || rank == 0 || rank >= self.world_size {
            reply.extend_from_slice(&STATUS_WORLD_MISMATCH.to_le_bytes());
            reply.extend_from_slice(&0u32.to_le_bytes());
            // Best effort: the client learns why before we give up.
            let _ = stream.write_all(&reply);
            return Err(ServeError::Fatal(self.error(format!(
                "a client claims rank {rank} of {world}, but rank 0 runs a world of {}; \
                 is WORLD_SIZE the same on every rank?",
                self.world_size
            ))));
        }
        reply.extend_from_slice(&STATUS_OK.to_le_bytes());
        reply.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        reply.extend_from_slice(payload);
        stream.write_all(&reply).map_err(retry)?;
        stream.flush().map_err(retry)?;
        Ok(rank)
    }

    /// Connects to rank 0 (retrying until the deadline) and reads the payload.
    pub fn fetch(&self) -> Result<Vec<u8>> {
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
            match self.try_fetch(remaining) {
                Ok(payload) => return Ok(payload),
                Err(FetchError::Fatal(e)) => return Err(e),
                Err(FetchError::Retry(msg)) => last_error = msg,
            }
            std::thread::sleep(backoff.min(remaining));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    fn try_fetch(&self, remaining: Duration) -> Result<Vec<u8>, FetchError> {
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
                Ok(stream) => return self.handshake(stream, step),
                Err(e) => last = format!("connect to {addr}: {e}"),
            }
        }
        Err(FetchError::Retry(last))
    }

    fn handshake(&self, mut stream: TcpStream, timeout: Duration) -> Result<Vec<u8>, FetchError> {
        let retry = |e: std::io::Error| FetchError::Retry(format!("handshake: {e}"));
        stream.set_read_timeout(Some(timeout)).map_err(retry)?;
        stream.set_write_timeout(Some(timeout)).map_err(retry)?;
        let mut hello = Vec::with_capacity(16);
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(self.rank as u32).to_le_bytes());
        hello.extend_from_slice(&(self.world_size as u32).to_le_bytes());
        stream.write_all(&hello).map_err(retry)?;
        let mut head = [0u8; 16];
        stream.read_exact(&mut head).map_err(retry)?;
        if &head[..8] != MAGIC {
            return Err(FetchError::Fatal(self.error(
                "the server at MASTER_ADDR:MASTER_PORT is not a zero-rs rendezvous; pick another MASTER_PORT".into(),
            )));
        }
        let status = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        let len = u32::from_le_bytes([head[12], head[13], head[14], head[15]]) as usize;
        if status == STATUS_WORLD_MISMATCH {
            return Err(FetchError::Fatal(self.error(format!(
                "rank 0 refused rank {} of a world of {}: the world sizes differ",
                self.rank, self.world_size
            ))));
        }
        if status != STATUS_OK || len > MAX_PAYLOAD {
            return Err(FetchError::Fatal(
                self.error(format!("bad reply (status {status}, length {len})")),
            ));
        }
        let mut payload = vec![0u8; len];
        stream.read_exact(&mut payload).map_err(retry)?;
        Ok(payload)
    }

    fn error(&self, detail: String) -> Error {
        Error::Rendezvous {
            addr: self.address(),
            rank: self.rank,
            detail,
        }
    }
}

enum ServeError {
    Retry(String),
    Fatal(Error),
}

enum FetchError {
    Retry(String),
    Fatal(Error),
}
