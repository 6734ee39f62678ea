//! Where ranks started apart find each other: the torchrun-style
//! environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`) and a small TCP rendezvous at the master's address,
//! through which rank 0 hands every other rank a few bytes (NCCL's unique
//! id) before the communicator starts.
//!
//! Rank 0 listens; every other rank connects (retrying while rank 0 is not
//! up yet), says which rank it is and of what world size, and is answered
//! with the bytes, or with why it was refused (a world size that differs
//! from rank 0's, a rank another process already claimed). Nothing waits
//! without a bound: past the timeout, rank 0 names the ranks that never
//! came and a rank that could not reach rank 0 names the address it tried.
//!
//! ```no_run
//! use std::time::Duration;
//! use strata::comm::{rendezvous, World};
//!
//! let port = 29_517;
//! let world = move |rank| World {
//!     rank,
//!     size: 2,
//!     local_rank: rank,
//!     master_addr: "127.0.0.1".into(),
//!     master_port: port,
//! };
//! let peer = std::thread::spawn(move || {
//!     rendezvous(&world(1), Vec::new, Duration::from_secs(30)).unwrap()
//! });
//! let mine = rendezvous(&world(0), || b"unique id".to_vec(), Duration::from_secs(30)).unwrap();
//! assert_eq!(peer.join().unwrap(), mine);
//! ```

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::CommError;

/// Says what this is, and in which version, before anything else.
const MAGIC: &[u8; 8] = b"strata1\0";
/// The most bytes rank 0 hands out (NCCL's id is 128).
const MAX_OFFER: usize = 1 << 16;
/// How often a rank retries a refused connection, and rank 0 polls for one.
const POLL: Duration = Duration::from_millis(20);

/// One rank's place in a job whose ranks were started apart (by `strata
/// launch`, torchrun, a batch system), as the environment says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    pub rank: usize,
    pub size: usize,
    /// This rank's index among the ranks of its machine (its GPU).
    pub local_rank: usize,
    /// Where rank 0 listens for the rendezvous.
    pub master_addr: String,
    pub master_port: u16,
}

impl World {
    /// The world from this process's environment, or `None` where `RANK`
    /// and `WORLD_SIZE` are both unset (a process started alone).
    pub fn from_env() -> Result<Option<World>, CommError> {
        World::from_vars(|name| std::env::var(name).ok())
    }

    /// The world from the variables `var` gives (the environment's, or a
    /// test's). `LOCAL_RANK` defaults to `RANK` (one machine);
    /// `MASTER_ADDR` and `MASTER_PORT` must be set when the world has more
    /// than one rank.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<World>, CommError> {
        let (rank, size) = match (var("RANK"), var("WORLD_SIZE")) {
            (None, None) => return Ok(None),
            (Some(r), Some(s)) => (number("RANK", &r)?, number("WORLD_SIZE", &s)?),
            (r, _) => {
                let missing = if r.is_none() { "RANK" } else { "WORLD_SIZE" };
                return Err(init(format!(
                    "{missing} is not set, but {} is: a rank started apart needs both \
                     (set by strata launch, torchrun or the batch script)",
                    if r.is_none() { "WORLD_SIZE" } else { "RANK" }
                )));
            }
        };
        if size == 0 || rank >= size {
            return Err(init(format!(
                "RANK={rank} with WORLD_SIZE={size}: RANK must be below WORLD_SIZE"
            )));
        }
        let local_rank = match var("LOCAL_RANK") {
            Some(l) => number("LOCAL_RANK", &l)?,
            None => rank,
        };
        let master = |name: &str| {
            var(name).ok_or_else(|| {
                init(format!(
                    "{name} is not set: with WORLD_SIZE={size}, every rank needs \
                     MASTER_ADDR and MASTER_PORT, where rank 0 listens"
                ))
            })
        };
        let (master_addr, master_port) = match size {
            1 => (
                var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                var("MASTER_PORT").map_or(Ok(0), |p| port(&p))?,
            ),
            _ => (master("MASTER_ADDR")?, port(&master("MASTER_PORT")?)?),
        };
        Ok(Some(World {
            rank,
            size,
            local_rank,
            master_addr,
            master_port,
        }))
    }
}

fn init(why: String) -> CommError {
    CommError::Init { why }
}

fn number(name: &str, value: &str) -> Result<usize, CommError> {
    value
        .trim()
        .parse()
        .map_err(|_| init(format!("{name}={value:?} is not a whole number")))
}

fn port(value: &str) -> Result<u16, CommError> {
    value
        .trim()
        .parse()
        .map_err(|_| init(format!("MASTER_PORT={value:?} is not a port (0–65535)")))
}

/// Every rank of `world` meets at rank 0's address; rank 0's `offer()` is
/// returned on every rank. Fails, naming why, past `timeout` or when a
/// rank is refused (every rank then fails, the refused one told why).
pub fn rendezvous(
    world: &World,
    offer: impl FnOnce() -> Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>, CommError> {
    let deadline = Instant::now() + timeout;
    let addr = master_address(world)?;
    if world.rank == 0 {
        if world.size == 1 {
            return Ok(offer());
        }
        let listener = TcpListener::bind(addr).map_err(|e| {
            init(format!(
                "rank 0 could not listen at {addr} (MASTER_ADDR:MASTER_PORT): {e}; \
                 choose a free MASTER_PORT"
            ))
        })?;
        serve(listener, world.size, offer(), deadline)
    } else {
        join(addr, world, deadline)
    }
}

fn master_address(world: &World) -> Result<SocketAddr, CommError> {
    let name = format!("{}:{}", world.master_addr, world.master_port);
    name.to_socket_addrs()
        .map_err(|e| {
            init(format!(
                "MASTER_ADDR:MASTER_PORT {name} does not resolve: {e}"
            ))
        })?
        .next()
        .ok_or_else(|| {
            init(format!(
                "MASTER_ADDR:MASTER_PORT {name} resolves to no address"
            ))
        })
}

/// Rank 0's side: takes one connection from each other rank, checks what
/// each says it is, then hands every one of them `offer`.
fn serve(
    listener: TcpListener,
    size: usize,
    offer: Vec<u8>,
    deadline: Instant,
) -> Result<Vec<u8>, CommError> {
    if offer.len() > MAX_OFFER {
        return Err(init(format!(
            "the rendezvous carries at most {MAX_OFFER} bytes"
        )));
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| init(format!("rendezvous listener: {e}")))?;
    let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    while peers[1..].iter().any(Option::is_none) {
        let mut stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..size)
                        .filter(|&r| peers[r].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    return Err(refuse_all(
                        &mut peers,
                        format!(
                            "rank 0 waited for the rendezvous until its timeout; rank(s) {} \
                             never came (started? the same MASTER_ADDR:MASTER_PORT?)",
                            missing.join(", ")
                        ),
                    ));
                }
                std::thread::sleep(POLL);
                continue;
            }
            Err(e) => return Err(init(format!("rendezvous accept: {e}"))),
        };
        let (rank, their_size) = match read_hello(&mut stream, deadline) {
            Ok(hello) => hello,
            Err(CommError::Init { why }) => return Err(refuse_all(&mut peers, why)),
            Err(e) => return Err(e),
        };
        let refusal = if their_size != size {
            Some(format!(
                "rank {rank} says WORLD_SIZE={their_size}, rank 0 has {size}: every rank \
                 must be started with the same WORLD_SIZE"
            ))
        } else if rank == 0 || rank >= size {
            Some(format!("a rank says RANK={rank}, outside 1..{size}"))
        } else if peers[rank].is_some() {
            Some(format!(
                "two processes say RANK={rank}: each rank must be started once"
            ))
        } else {
            None
        };
        if let Some(why) = refusal {
            let _ = answer(&mut stream, 1, why.as_bytes());
            return Err(refuse_all(&mut peers, why));
        }
        peers[rank] = Some(stream);
    }
    for (rank, stream) in peers.iter_mut().enumerate().skip(1) {
        let stream = stream.as_mut().expect("every peer came");
        answer(stream, 0, &offer)
            .map_err(|e| init(format!("rank 0 could not answer rank {rank}: {e}")))?;
    }
    Ok(offer)
}

/// Tells every rank that came why the rendezvous ended, so that none
/// waits for an answer; returns the error rank 0 ends with.
fn refuse_all(peers: &mut [Option<TcpStream>], why: String) -> CommError {
    for stream in peers.iter_mut().flatten() {
        let _ = answer(stream, 1, why.as_bytes());
    }
    init(why)
}

fn read_hello(stream: &mut TcpStream, deadline: Instant) -> Result<(usize, usize), CommError> {
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(left(deadline))))
        .map_err(|e| init(format!("rendezvous connection: {e}")))?;
    let mut hello = [0u8; 16];
    stream.read_exact(&mut hello).map_err(|e| {
        init(format!(
            "a process that connected to the rendezvous said nothing of use: {e}"
        ))
    })?;
    if &hello[..8] != MAGIC {
        return Err(init(
            "something other than a strata rank connected to the rendezvous's \
             MASTER_PORT; choose a port of its own"
                .into(),
        ));
    }
    let word = |at: usize| u32::from_le_bytes(hello[at..at + 4].try_into().unwrap()) as usize;
    Ok((word(8), word(12)))
}

/// A status byte (0: welcome, 1: refused), a length and the bytes.
fn answer(stream: &mut TcpStream, status: u8, bytes: &[u8]) -> std::io::Result<()> {
    stream.write_all(&[status])?;
    stream.write_all(&(bytes.len() as u32).to_le_bytes())?;
    stream.write_all(bytes)
}

/// A rank other than 0: connects (rank 0 may not listen yet), says who it
/// is, and reads rank 0's answer.
fn join(addr: SocketAddr, world: &World, deadline: Instant) -> Result<Vec<u8>, CommError> {
    let mut stream = loop {
        match TcpStream::connect_timeout(&addr, left(deadline)) {
            Ok(stream) => break stream,
            Err(e) if Instant::now() + POLL < deadline => {
                if !matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused | ErrorKind::TimedOut | ErrorKind::WouldBlock
                ) {
                    return Err(init(format!(
                        "rank {} could not reach {addr}: {e}",
                        world.rank
                    )));
                }
                std::thread::sleep(POLL);
            }
            Err(e) => {
                return Err(init(format!(
                    "rank {} found no rank 0 at {addr} (MASTER_ADDR:MASTER_PORT) before \
                     its timeout: {e}",
                    world.rank
                )))
            }
        }
    };
    let io = |e: std::io::Error| {
        init(format!(
            "rank {}: the rendezvous with rank 0 at {addr} broke off: {e}",
            world.rank
        ))
    };
    stream.set_read_timeout(Some(left(deadline))).map_err(io)?;
    let mut hello = MAGIC.to_vec();
    hello.extend((world.rank as u32).to_le_bytes());
    hello.extend((world.size as u32).to_le_bytes());
    stream.write_all(&hello).map_err(io)?;
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).map_err(io)?;
    let len = u32::from_le_bytes(head[1..].try_into().unwrap()) as usize;
    if len > MAX_OFFER {
        return Err(init(format!(
            "rank {}: rank 0's answer is {len} bytes, past the rendezvous's {MAX_OFFER}",
            world.rank
        )));
    }
    let mut bytes = vec![0u8; len];
    stream.read_exact(&mut bytes).map_err(io)?;
    match head[0] {
        0 => Ok(bytes),
        _ => Err(init(format!(
            "rank 0 refused rank {}: {}",
            world.rank,
            String::from_utf8_lossy(&bytes)
        ))),
    }
}

/// The time left before `deadline`, at least a millisecond (a zero
/// timeout means none to the socket calls).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests;
