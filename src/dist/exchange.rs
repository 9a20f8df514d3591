//! Owns the ranks' small exchanges: one element-wise MAX over a fixed buffer, on its own channel.
//! Keeps: each exchange's header names its sequence, topic and step, so ranks at different points
//! of the protocol see it instead of misaligning every later collective.
use std::cell::{Cell, RefCell};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// What an exchange is for (its topic in the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topic {
    Agreement = 1,
    GuardInputs = 2,
    Losses = 3,
    Start = 4,
    Stop = 5,
    EvalLosses = 6,
    Shard = 7,
    /// Each agreement site its own (`ProcessGroup::agree`): ranks that diverge fail at the
    /// header check, naming both sites, instead of waiting on different channels.
    UpdateReady = 8,
    EvalAttempt = 9,
    BufferSnapshot = 10,
    CheckpointWrite = 11,
    StateGather = 12,
    StartPoint = 13,
    OptimizerState = 14,
    ShardClimb = 15,
    ShardBack = 16,
}

fn topic_name(k: f64) -> &'static str {
    match k as i64 {
        1 => "the agreement on a step's attempt",
        2 => "the guard's inputs",
        3 => "the losses",
        4 => "the start",
        5 => "a stop signal",
        6 => "the evaluation's losses",
        7 => "the sharding's way back",
        8 => "the agreement on the update's allocations",
        9 => "the agreement on an evaluation batch",
        10 => "the agreement on the buffers' snapshot",
        11 => "the agreement on a checkpoint's write",
        12 => "the agreement on gathering the optimizer state",
        13 => "the agreement on where to start",
        14 => "the agreement on allocating the optimizer state",
        15 => "the agreement on climbing to sharding",
        16 => "the agreement on coming back from sharding",
        _ => "an unknown exchange",
    }
}

const HEADER: usize = 6;

pub(super) struct Exchange {
    channel: Channel,
    /// The message, header and payload: its size is fixed for the run.
    msg: RefCell<Vec<f64>>,
    /// Exchanges so far, and the step the run is at (`ProcessGroup::at_step`).
    seq: Cell<u64>,
    pub step: Cell<i64>,
    /// Test-only: `OOMGUARD_TEST_MISALIGN=RANK:SEQ` makes that rank claim the next
    /// exchange number at exchange SEQ, as a rank that skipped one would.
    misalign: Option<(usize, u64)>,
}

impl Exchange {
    /// `payload`: the values an exchange carries at most.
    pub fn new(channel: Channel, payload: usize) -> Exchange {
        let misalign = test_hook!("OOMGUARD_TEST_MISALIGN").and_then(|v| {
            let (r, s) = v.split_once(':')?;
            Some((r.parse().ok()?, s.parse().ok()?))
        });
        Exchange {
            channel,
            msg: RefCell::new(vec![0.0; HEADER + payload]),
            seq: 0.into(),
            step: 0.into(),
            misalign,
        }
    }

    /// One exchange of `payload`, reduced with MAX in place, after which every rank knows
    /// that all ranks were at the same exchange of the same step, or fails naming both
    /// views.
    pub fn run(&self, topic: Topic, payload: &mut [f64]) -> Result<()> {
        let mut msg = self.msg.borrow_mut();
        let cap = msg.len() - HEADER;
        assert!(
            payload.len() <= cap,
            "an exchange of {} values in a buffer of {cap}",
            payload.len()
        );
        let mut seq = self.seq.get() + 1;
        self.seq.set(seq);
        if self.misalign == Some((self.channel.rank, seq)) {
            seq += 1;
        }
        let (k, step) = (topic as i64 as f64, self.step.get() as f64);
        msg.fill(f64::NEG_INFINITY);
        msg[..HEADER].copy_from_slice(&[seq as f64, -(seq as f64), k, -k, step, -step]);
        msg[HEADER..HEADER + payload.len()].copy_from_slice(payload);
        self.channel.max(&mut msg)?;
        let h = &msg[..HEADER];
        if h[0] != -h[1] || h[2] != -h[3] || h[4] != -h[5] {
            return Err(Error::Dist(format!(
                "collective mismatch: this rank is at exchange {seq} ({}, step {}); the ranks are at exchanges {}..{}, steps {}..{}, doing {} .. {}. \
                 Their collectives no longer line up, so the run stops here rather than mix buffers",
                topic_name(k), step, -h[1], h[0], -h[5], h[4], topic_name(-h[3]), topic_name(h[2])
            )));
        }
        payload.copy_from_slice(&msg[HEADER..HEADER + payload.len()]);
        Ok(())
    }
}

/// The exchanges' connections: rank 0 holds one per other rank, in rank order; every other
/// rank holds one, to rank 0. A group of one holds none.
pub(super) struct Channel {
    rank: usize,
    streams: Vec<TcpStream>,
    bytes: RefCell<Vec<u8>>,
}

const HELLO: &[u8; 4] = b"OGX1";
/// A connection has this long to introduce itself (a stray one is dropped after it, or at
/// rank 0's deadline, whichever comes first).
const HELLO_WAIT: Duration = Duration::from_secs(10);

fn io_error(what: String) -> impl Fn(std::io::Error) -> Error {
    move |e| {
        let why = match e.kind() {
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe => "the connection closed (that rank failed or exited)".to_string(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                "timed out (train.dist_timeout_s)".to_string()
            }
            _ => e.to_string(),
        };
        Error::Dist(format!("{what}: {why}"))
    }
}

impl Channel {
    /// No connection (a placeholder until the group's channel opens).
    pub fn alone() -> Channel {
        Channel {
            rank: 0,
            streams: vec![],
            bytes: RefCell::new(vec![]),
        }
    }

    /// Connects the ranks: rank 0 listens on `addr`'s interface at a free port, which it
    /// publishes through the store (`share`: rank 0 sets a key, every rank reads it), and
    /// waits up to `timeout` for every other rank to connect with `token`.
    pub fn open(
        rank: usize,
        world: usize,
        addr: &str,
        token: &str,
        timeout: Duration,
        share: impl Fn(&str, Option<&[u8]>) -> Result<Vec<u8>>,
    ) -> Result<Channel> {
        let key = "oomguard/exchange-port";
        let timeout = timeout.max(Duration::from_millis(1));
        let streams = if world < 2 {
            vec![]
        } else if rank == 0 {
            let listener =
                TcpListener::bind((addr, 0)).map_err(io_error(format!("the exchange's listener on {addr}")))?;
            let port = listener
                .local_addr()
                .map_err(io_error("the exchange's listener".into()))?
                .port();
            share(key, Some(port.to_string().as_bytes()))?;
            accept(&listener, world, token, timeout)?
        } else {
            let port = String::from_utf8_lossy(&share(key, None)?)
                .parse::<u16>()
                .map_err(|_| Error::Dist("the store's exchange port is not a port".into()))?;
            let what = format!("rank {rank} connecting to the exchange at {addr}:{port}");
            let mut s = connect(addr, port, timeout).map_err(io_error(what.clone()))?;
            let mut hello = HELLO.to_vec();
            hello.extend((rank as u32).to_le_bytes());
            hello.extend((token.len() as u32).to_le_bytes());
            hello.extend(token.as_bytes());
            s.write_all(&hello).map_err(io_error(what))?;
            vec![s]
        };
        for s in &streams {
            let setup = io_error("the exchange's connection".into());
            s.set_nodelay(true).map_err(&setup)?;
            s.set_read_timeout(Some(timeout)).map_err(&setup)?;
            s.set_write_timeout(Some(timeout)).map_err(&setup)?;
        }
        Ok(Channel {
            rank,
            streams,
            bytes: RefCell::new(vec![]),
        })
    }

    /// `values` becomes the element-wise maximum over the ranks (a NaN anywhere wins: a
    /// rank's diverged loss reaches every rank).
    fn max(&self, values: &mut [f64]) -> Result<()> {
        let mut bytes = self.bytes.borrow_mut();
        bytes.resize(values.len() * 8, 0);
        if self.rank == 0 {
            for (i, s) in self.streams.iter().enumerate() {
                (&*s)
                    .read_exact(&mut bytes)
                    .map_err(io_error(format!("the exchange with rank {}", i + 1)))?;
                for (v, b) in values.iter_mut().zip(bytes.chunks_exact(8)) {
                    let x = f64::from_le_bytes(b.try_into().expect("8 bytes"));
                    if x.is_nan() || x > *v {
                        *v = x;
                    }
                }
            }
            encode(values, &mut bytes);
            for (i, s) in self.streams.iter().enumerate() {
                (&*s)
                    .write_all(&bytes)
                    .map_err(io_error(format!("the exchange with rank {}", i + 1)))?;
            }
        } else if let Some(s) = self.streams.first() {
            encode(values, &mut bytes);
            (&*s)
                .write_all(&bytes)
                .map_err(io_error("the exchange with rank 0".into()))?;
            (&*s)
                .read_exact(&mut bytes)
                .map_err(io_error("the exchange with rank 0".into()))?;
            for (v, b) in values.iter_mut().zip(bytes.chunks_exact(8)) {
                *v = f64::from_le_bytes(b.try_into().expect("8 bytes"));
            }
        }
        Ok(())
    }
}

fn encode(values: &[f64], bytes: &mut [u8]) {
    for (v, b) in values.iter().zip(bytes.chunks_exact_mut(8)) {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

fn connect(addr: &str, port: u16, timeout: Duration) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "MASTER_ADDR resolves to no address");
    for a in (addr, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Rank 0: a connection from every other rank, in rank order. One that does not introduce
/// itself with the run's token (another run, a stray client, garbage) is dropped with a
/// warning, and so is one that says nothing within HELLO_WAIT. Hellos are read without
/// blocking, all at once: strangers, however many and however silent, delay no rank, and
/// the deadline holds whatever they do.
fn accept(listener: &TcpListener, world: usize, token: &str, timeout: Duration) -> Result<Vec<TcpStream>> {
    let failed = io_error("rank 0 waiting for the ranks at the exchange".into());
    listener.set_nonblocking(true).map_err(&failed)?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
    let mut waiting: Vec<Hello> = vec![];
    let mut dropped = 0usize;
    while peers.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> = (1..world)
                .filter(|r| peers[r - 1].is_none())
                .map(|r| r.to_string())
                .collect();
            return Err(Error::Dist(format!(
                "rank 0 waiting for the ranks at the exchange: timed out after {:.1} s (train.dist_timeout_s) with {} of {} other ranks connected \
                    (missing: {}); {} connection(s) that did not introduce themselves as ranks of this run were dropped",
                timeout.as_secs_f64(),
                world - 1 - missing.len(),
                world - 1,
                missing.join(", "),
                dropped + waiting.len(),
            )));
        }
        let mut busy = false;
        for _ in 0..64 {
            match listener.accept() {
                Ok((s, _)) => {
                    busy = true;
                    match s.set_nonblocking(true) {
                        Ok(()) => waiting.push(Hello::new(s, now)),
                        Err(_) => dropped += 1,
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // The client gave up, or too many descriptors are open (strangers waiting for
                // HELLO_WAIT hold them): try again, until the deadline.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::Interrupted
                    ) || matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) =>
                {
                    break
                }
                Err(e) => return Err(failed(e)),
            }
        }
        let mut i = 0;
        while i < waiting.len() {
            let state = waiting[i].read(token, world);
            busy |= !matches!(state, Ok(None));
            match state {
                Ok(None) if now.duration_since(waiting[i].since) < HELLO_WAIT => i += 1,
                Ok(Some(r)) if peers[r - 1].is_none() => {
                    let s = waiting.swap_remove(i).stream;
                    s.set_nonblocking(false).map_err(&failed)?;
                    peers[r - 1] = Some(s);
                }
                _ => {
                    let h = waiting.swap_remove(i);
                    dropped += 1;
                    tracing::warn!(
                        "the exchange dropped a connection from {} that is not a rank of this run",
                        h.stream.peer_addr().map_or("?".into(), |a| a.to_string())
                    );
                }
            }
        }
        if !busy {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(peers.into_iter().flatten().collect())
}

/// A connection whose hello is being read, without blocking: `HELLO`, the rank and the
/// token's length (12 bytes), then the token; never a byte past it (the rank's first
/// exchange may follow at once).
struct Hello {
    stream: TcpStream,
    since: Instant,
    got: Vec<u8>,
}

impl Hello {
    fn new(stream: TcpStream, since: Instant) -> Hello {
        Hello {
            stream,
            since,
            got: Vec::with_capacity(12),
        }
    }

    /// What has arrived so far: `Ok(None)` while incomplete, `Ok(Some(rank))` once whole
    /// and the run's own, an error for anything else (another run's, garbage, closed).
    fn read(&mut self, token: &str, world: usize) -> std::io::Result<Option<usize>> {
        let stranger = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a rank of this run");
        loop {
            let want = if self.got.len() < 12 { 12 } else { 12 + token.len() };
            if self.got.len() == want {
                let rank = u32::from_le_bytes(self.got[4..8].try_into().expect("4 bytes")) as usize;
                let theirs = &self.got[12..];
                if theirs == token.as_bytes() && (1..world).contains(&rank) {
                    return Ok(Some(rank));
                }
                return Err(stranger());
            }
            let have = self.got.len();
            self.got.resize(want, 0);
            match self.stream.read(&mut self.got[have..]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.got.truncate(have + n),
                Err(e) => {
                    self.got.truncate(have);
                    return match e.kind() {
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(None),
                        _ => Err(e),
                    };
                }
            }
            // Garbage is dropped as soon as it shows, not after HELLO_WAIT.
            let n = self.got.len().min(4);
            if self.got[..n] != HELLO[..n] {
                return Err(stranger());
            }
            if self.got.len() == 12
                && u32::from_le_bytes(self.got[8..12].try_into().expect("4 bytes")) as usize != token.len()
            {
                return Err(stranger());
            }
        }
    }
}

#[cfg(test)]
#[path = "exchange_tests.rs"]
mod tests;
