//! The ranks' exchanges: every small collective of a run (each agreement, the guard's
//! inputs, the losses, a stop signal, the start) is one element-wise MAX over the ranks of a
//! buffer allocated once when the group forms, always of the same size, headed by
//! `[seq, -seq, topic, -topic, step, -step]`: two ranks at different points of the
//! protocol meet in the same exchange and see it in the header, instead of misaligning
//! every later collective.
//!
//! They travel on their own channel, not through Gloo or NCCL: one TCP connection from each
//! rank to rank 0, which reduces and answers, on the calling thread. An exchange is one
//! round trip (0.1 ms on 2 ranks here, docs/benchmarks.md), where a Gloo all-reduce of the
//! same few values hands each message between its worker and loop threads (1.8 ms), and an
//! NCCL one would copy the buffer to the GPU and back, a sync each. The channel listens on
//! MASTER_ADDR's own interface, as the store does, and a connection that does not bring
//! the run's token is dropped.
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
        let misalign = std::env::var("OOMGUARD_TEST_MISALIGN").ok().and_then(|v| {
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
/// A connection has this long to introduce itself (a stray one is dropped after it).
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
/// itself with the run's token (another run, a stray client) is dropped with a warning.
fn accept(listener: &TcpListener, world: usize, token: &str, timeout: Duration) -> Result<Vec<TcpStream>> {
    let failed = io_error("rank 0 waiting for the ranks at the exchange".into());
    listener.set_nonblocking(true).map_err(&failed)?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
    while peers.iter().any(Option::is_none) {
        let mut s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(failed(e)),
        };
        let hello = (|| -> std::io::Result<Option<usize>> {
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(HELLO_WAIT))?;
            let mut head = [0u8; 12];
            s.read_exact(&mut head)?;
            let len = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
            if &head[..4] != HELLO || len != token.len() {
                return Ok(None);
            }
            let mut theirs = vec![0u8; len];
            s.read_exact(&mut theirs)?;
            let rank = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
            Ok((theirs == token.as_bytes() && (1..world).contains(&rank)).then_some(rank))
        })();
        match hello {
            Ok(Some(r)) if peers[r - 1].is_none() => peers[r - 1] = Some(s),
            _ => tracing::warn!(
                "the exchange dropped a connection from {} that is not a rank of this run",
                s.peer_addr().map_or("?".into(), |a| a.to_string())
            ),
        }
    }
    Ok(peers.into_iter().flatten().collect())
}

#[cfg(test)]
#[path = "exchange_tests.rs"]
mod tests;
