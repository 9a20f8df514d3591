//! Owns the ranks' small exchanges: one element-wise MAX (or sum) over a fixed buffer, on its own
//! channel, a binary tree of TCP connections.
//! Keeps: each exchange's header names its sequence, topic and step, so ranks at different points
//! of the protocol see it instead of misaligning every later collective; a rank's bytes and
//! connections per exchange do not grow with the world.
use std::cell::{Cell, RefCell};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};

/// An exchange that failed: what happened, naming the ranks and the site.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangeError(pub String);

impl std::fmt::Display for ExchangeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ExchangeError {}

pub type Result<T, E = ExchangeError> = std::result::Result<T, E>;

/// Reads a test hook's variable, only in a build with the `test-hooks` feature.
macro_rules! test_hook {
    ($name:literal) => {{
        #[cfg(feature = "test-hooks")]
        let value = std::env::var($name).ok();
        #[cfg(not(feature = "test-hooks"))]
        let value: Option<String> = None;
        value
    }};
}

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
    StartPoint = 13,
    OptimizerState = 14,
    ShardClimb = 15,
    ShardBack = 16,
    /// `import oomguard`'s votes: after an attempt, and at each checkpoint before a
    /// collective inside one.
    GuardVote = 17,
    /// The units a step's loss averages over, counted by each rank's forward passes.
    LossUnits = 18,
    /// The same for an evaluation.
    EvalUnits = 19,
    /// Before an attempt's last micro-batch, when its backward starts the gradients'
    /// all-reduce (the overlapped reduction).
    Armed = 20,
    /// The gradient buckets' size: the least of the ranks' (each sized by its own budget).
    Buckets = 21,
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
        13 => "the agreement on where to start",
        14 => "the agreement on allocating the optimizer state",
        15 => "the agreement on climbing to sharding",
        16 => "the agreement on coming back from sharding",
        17 => "the Python guard's vote",
        18 => "the step's loss units",
        19 => "the evaluation's loss units",
        20 => "the agreement before an attempt's last micro-batch",
        21 => "the gradient buckets' size",
        _ => "an unknown exchange",
    }
}

const HEADER: usize = 6;
/// Payload values of every exchange, whatever the world: enough for the guard's inputs and
/// an agreement's detail.
pub const PAYLOAD: usize = 16;
/// Bytes of one message, one way, between two neighbours.
pub const MESSAGE_BYTES: u64 = 8 * (HEADER + PAYLOAD) as u64;

/// How an exchange combines the ranks' payloads (the header is always a MAX).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// The element-wise maximum; a NaN anywhere wins (a rank's diverged loss reaches all).
    Max,
    /// The sum, added in the tree's fixed order (a rank's own value, then each child's
    /// subtree in rank order): the same bits on every rank.
    Sum,
}

pub struct Exchange {
    channel: Channel,
    /// The message, header and payload: its size is fixed for the run, whatever the world.
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
        self.run_as(topic, payload, Reduce::Max)
    }

    pub fn run_as(&self, topic: Topic, payload: &mut [f64], how: Reduce) -> Result<()> {
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
        let filler = if how == Reduce::Sum { 0.0 } else { f64::NEG_INFINITY };
        msg.fill(filler);
        msg[..HEADER].copy_from_slice(&[seq as f64, -(seq as f64), k, -k, step, -step]);
        msg[HEADER..HEADER + payload.len()].copy_from_slice(payload);
        self.channel.reduce(&mut msg, how)?;
        let h = &msg[..HEADER];
        if h[0] != -h[1] || h[2] != -h[3] || h[4] != -h[5] {
            return Err(ExchangeError(format!(
                "collective mismatch: this rank is at exchange {seq} ({}, step {}); the ranks are at exchanges {}..{}, steps {}..{}, doing {} .. {}. \
                 Their collectives no longer line up, so the run stops here rather than mix buffers",
                topic_name(k), step, -h[1], h[0], -h[5], h[4], topic_name(-h[3]), topic_name(h[2])
            )));
        }
        payload.copy_from_slice(&msg[HEADER..HEADER + payload.len()]);
        Ok(())
    }

    /// How long each exchange waits for a neighbour from here on (`Channel::set_timeout`).
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        self.channel.set_timeout(timeout)
    }

    /// Bytes this rank has sent and received on the channel so far.
    pub fn bytes_moved(&self) -> u64 {
        self.channel.moved.get()
    }
}

/// The ranks as a binary tree rooted at rank 0: rank r's parent is (r - 1) / 2 and its
/// children 2r + 1 and 2r + 2. A reduction climbs it and the result comes back down, so a
/// rank talks to three others at most and the depth is log2(world).
pub fn parent(rank: usize) -> Option<usize> {
    (rank > 0).then(|| (rank - 1) / 2)
}

pub fn children(rank: usize, world: usize) -> Vec<usize> {
    [2 * rank + 1, 2 * rank + 2]
        .into_iter()
        .filter(|&c| c < world)
        .collect()
}

/// The neighbours of the exchange tree's busiest rank.
pub fn busiest_neighbours(world: usize) -> u64 {
    (0..world.min(4))
        .map(|r| (children(r, world).len() + usize::from(parent(r).is_some())) as u64)
        .max()
        .unwrap_or(0)
}

/// The exchanges' connections, one to the parent and one per child (a group of one holds
/// none). After an I/O failure every connection is shut, so the failure reaches the whole
/// tree at once instead of each rank's timeout.
pub struct Channel {
    rank: usize,
    parent: Option<(usize, TcpStream)>,
    children: Vec<(usize, TcpStream)>,
    bytes: RefCell<Vec<u8>>,
    theirs: RefCell<Vec<f64>>,
    moved: Cell<u64>,
    broken: Cell<bool>,
}

const HELLO: &[u8; 4] = b"OGX1";
/// A connection has this long to introduce itself (a stray one is dropped after it, or at
/// the rank's deadline, whichever comes first).
const HELLO_WAIT: Duration = Duration::from_secs(10);

fn io_error(what: String) -> impl Fn(std::io::Error) -> ExchangeError {
    move |e| {
        let why = match e.kind() {
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe => "the connection closed (that rank failed or exited)".to_string(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                "timed out (train.dist_timeout_s; under import oomguard, the process group's timeout)".to_string()
            }
            _ => e.to_string(),
        };
        ExchangeError(format!("{what}: {why}"))
    }
}

/// The store key under which rank `r` publishes its listener's address.
fn key(rank: usize) -> String {
    format!("oomguard/exchange/{rank}")
}

impl Channel {
    /// No connection (a placeholder until the group's channel opens).
    pub fn alone() -> Channel {
        Channel {
            rank: 0,
            parent: None,
            children: vec![],
            bytes: RefCell::new(vec![]),
            theirs: RefCell::new(vec![]),
            moved: 0.into(),
            broken: false.into(),
        }
    }

    /// Connects the tree: a rank with children listens at a free port on `addr`'s interface
    /// (rank 0) or on its own interface towards `addr` (the others), publishes it through
    /// the store (`share(key, Some(value))` sets, `share(key, None)` waits for a key), then
    /// connects to its parent with `token` and waits up to `timeout` for its children.
    pub fn open(
        rank: usize,
        world: usize,
        addr: &str,
        token: &str,
        timeout: Duration,
        share: impl Fn(&str, Option<&[u8]>) -> Result<Vec<u8>>,
    ) -> Result<Channel> {
        let timeout = timeout.max(Duration::from_millis(1));
        let mut ch = Channel::alone();
        ch.rank = rank;
        if world < 2 {
            return Ok(ch);
        }
        let kids = children(rank, world);
        let listener = if kids.is_empty() {
            None
        } else {
            let what = format!("rank {rank}'s exchange listener towards {addr}");
            let ip = if rank == 0 {
                None
            } else {
                Some(local_ip_towards(addr).map_err(io_error(what.clone()))?)
            };
            let l = match ip {
                None => TcpListener::bind((addr, 0)),
                Some(ip) => TcpListener::bind((ip, 0)),
            }
            .map_err(io_error(what.clone()))?;
            let at = l.local_addr().map_err(io_error(what))?;
            share(&key(rank), Some(at.to_string().as_bytes()))?;
            Some(l)
        };
        if let Some(p) = parent(rank) {
            let at = String::from_utf8_lossy(&share(&key(p), None)?)
                .parse::<SocketAddr>()
                .map_err(|_| ExchangeError(format!("the store's exchange address of rank {p} is not an address")))?;
            let what = format!("rank {rank} connecting to the exchange of rank {p} at {at}");
            let mut s = TcpStream::connect_timeout(&at, timeout).map_err(io_error(what.clone()))?;
            let mut hello = HELLO.to_vec();
            hello.extend((rank as u32).to_le_bytes());
            hello.extend((token.len() as u32).to_le_bytes());
            hello.extend(token.as_bytes());
            s.write_all(&hello).map_err(io_error(what))?;
            ch.parent = Some((p, s));
        }
        if let Some(l) = listener {
            ch.children = kids
                .iter()
                .copied()
                .zip(accept(&l, rank, &kids, token, timeout)?)
                .collect();
        }
        for s in ch.streams() {
            let setup = io_error("the exchange's connection".into());
            s.set_nodelay(true).map_err(&setup)?;
            s.set_read_timeout(Some(timeout)).map_err(&setup)?;
            s.set_write_timeout(Some(timeout)).map_err(&setup)?;
        }
        Ok(ch)
    }

    /// How long an exchange waits for a neighbour from here on (`open`'s `timeout` was the
    /// connecting's): at least a millisecond.
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        let timeout = timeout.max(Duration::from_millis(1));
        let setup = io_error("the exchange's connection".into());
        for s in self.streams() {
            s.set_read_timeout(Some(timeout)).map_err(&setup)?;
            s.set_write_timeout(Some(timeout)).map_err(&setup)?;
        }
        Ok(())
    }

    fn streams(&self) -> impl Iterator<Item = &TcpStream> {
        self.parent.iter().chain(&self.children).map(|(_, s)| s)
    }

    /// `values` becomes the reduction over the ranks: the children's subtrees are folded
    /// in (in rank order), the result goes to the parent, and the root's comes back down.
    fn reduce(&self, values: &mut [f64], how: Reduce) -> Result<()> {
        if self.broken.get() {
            return Err(ExchangeError(
                "the exchange is closed after an earlier failure on it".into(),
            ));
        }
        let got = self.climb(values, how);
        if got.is_err() {
            self.broken.set(true);
            for s in self.streams() {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        got
    }

    fn climb(&self, values: &mut [f64], how: Reduce) -> Result<()> {
        let mut bytes = self.bytes.borrow_mut();
        let mut theirs = self.theirs.borrow_mut();
        bytes.resize(values.len() * 8, 0);
        theirs.resize(values.len(), 0.0);
        let with = |r: usize| io_error(format!("the exchange with rank {r}"));
        for (r, s) in &self.children {
            self.recv(s, &mut bytes, &mut theirs).map_err(with(*r))?;
            for (i, (v, x)) in values.iter_mut().zip(theirs.iter()).enumerate() {
                if how == Reduce::Sum && i >= HEADER {
                    *v += x;
                } else if x.is_nan() || x > v {
                    *v = *x;
                }
            }
        }
        if let Some((r, s)) = &self.parent {
            encode(values, &mut bytes);
            self.send(s, &bytes).map_err(with(*r))?;
            self.recv(s, &mut bytes, values).map_err(with(*r))?;
        }
        encode(values, &mut bytes);
        for (r, s) in &self.children {
            self.send(s, &bytes).map_err(with(*r))?;
        }
        Ok(())
    }

    fn recv(&self, mut s: &TcpStream, bytes: &mut [u8], out: &mut [f64]) -> std::io::Result<()> {
        s.read_exact(bytes)?;
        self.moved.set(self.moved.get() + bytes.len() as u64);
        for (v, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
            *v = f64::from_le_bytes(b.try_into().expect("8 bytes"));
        }
        Ok(())
    }

    fn send(&self, mut s: &TcpStream, bytes: &[u8]) -> std::io::Result<()> {
        s.write_all(bytes)?;
        self.moved.set(self.moved.get() + bytes.len() as u64);
        Ok(())
    }
}

/// This host's address on the route to `addr` (a UDP socket's `connect` sends nothing): the
/// exchange's listener binds to it, and so do Gloo's sockets.
pub fn local_ip_towards(addr: &str) -> std::io::Result<IpAddr> {
    let target = (addr, 9)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "MASTER_ADDR resolves to no address"))?;
    let any: IpAddr = if target.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    let s = UdpSocket::bind((any, 0))?;
    s.connect(target)?;
    Ok(s.local_addr()?.ip())
}

/// The name of this host's interface that holds `ip` (getifaddrs), if any: what
/// `GLOO_SOCKET_IFNAME` wants for the address `local_ip_towards` found.
pub fn interface_of(ip: IpAddr) -> Option<String> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that freeifaddrs frees below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() && found.is_none() {
        // SAFETY: a node of the list getifaddrs returned, not yet freed; its address, when
        // not null, is a sockaddr of the family it names.
        let ifa = unsafe { &*cur };
        let addr = match (!ifa.ifa_addr.is_null()).then(|| unsafe { (*ifa.ifa_addr).sa_family } as i32) {
            Some(libc::AF_INET) => {
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))))
            }
            Some(libc::AF_INET6) => {
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
            }
            _ => None,
        };
        if addr == Some(ip) {
            // SAFETY: ifa_name is a NUL-terminated string of the same list.
            found = Some(
                unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}

fn encode(values: &[f64], bytes: &mut [u8]) {
    for (v, b) in values.iter().zip(bytes.chunks_exact_mut(8)) {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

/// Rank `me`: a connection from each rank of `expected` (its children), in that order. One that does not introduce
/// itself with the run's token (another run, a stray client, garbage) is dropped with a
/// warning, and so is one that says nothing within HELLO_WAIT. Hellos are read without
/// blocking, all at once: strangers, however many and however silent, delay no rank, and
/// the deadline holds whatever they do.
fn accept(
    listener: &TcpListener,
    me: usize,
    expected: &[usize],
    token: &str,
    timeout: Duration,
) -> Result<Vec<TcpStream>> {
    let failed = io_error(format!("rank {me} waiting for the ranks at the exchange"));
    listener.set_nonblocking(true).map_err(&failed)?;
    let deadline = Instant::now() + timeout;
    let mut peers: Vec<Option<TcpStream>> = expected.iter().map(|_| None).collect();
    let mut waiting: Vec<Hello> = vec![];
    let mut dropped = 0usize;
    while peers.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> = expected
                .iter()
                .zip(&peers)
                .filter(|(_, p)| p.is_none())
                .map(|(r, _)| r.to_string())
                .collect();
            return Err(ExchangeError(format!(
                "rank {me} waiting for the ranks at the exchange: timed out after {:.1} s (train.dist_timeout_s) with {} of {} other ranks connected \
                    (missing: {}); {} connection(s) that did not introduce themselves as ranks of this run were dropped",
                timeout.as_secs_f64(),
                expected.len() - missing.len(),
                expected.len(),
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
            let state = waiting[i].read(token, expected);
            busy |= !matches!(state, Ok(None));
            match state {
                Ok(None) if now.duration_since(waiting[i].since) < HELLO_WAIT => i += 1,
                Ok(Some(slot)) if peers[slot].is_none() => {
                    let s = waiting.swap_remove(i).stream;
                    s.set_nonblocking(false).map_err(&failed)?;
                    peers[slot] = Some(s);
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

    /// What has arrived so far: `Ok(None)` while incomplete, `Ok(Some(i))` once whole and
    /// from `expected[i]` with the run's token, an error for anything else (another run's,
    /// another rank's, garbage, closed).
    fn read(&mut self, token: &str, expected: &[usize]) -> std::io::Result<Option<usize>> {
        let stranger = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a rank of this run");
        loop {
            let want = if self.got.len() < 12 { 12 } else { 12 + token.len() };
            if self.got.len() == want {
                let rank = u32::from_le_bytes(self.got[4..8].try_into().expect("4 bytes")) as usize;
                let theirs = &self.got[12..];
                return match expected.iter().position(|&r| r == rank) {
                    Some(i) if theirs == token.as_bytes() => Ok(Some(i)),
                    _ => Err(stranger()),
                };
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

/// Keys and their values, and the condition a reader waits on.
type Keys = (
    std::sync::Mutex<std::collections::HashMap<String, Vec<u8>>>,
    std::sync::Condvar,
);

/// The store's part in `Channel::open` kept in memory, for ranks simulated as threads of
/// one process (tests, `cargo bench --bench scale`): `share(key, Some(v))` sets, and
/// `share(key, None)` waits for the key.
#[derive(Clone, Default)]
pub struct MemoryStore(std::sync::Arc<Keys>);

impl MemoryStore {
    pub fn share(&self, key: &str, value: Option<&[u8]>) -> Result<Vec<u8>> {
        let (m, c) = &*self.0;
        let poisoned = |_| ExchangeError("the in-memory store's lock is poisoned".into());
        let mut v = m.lock().map_err(poisoned)?;
        if let Some(value) = value {
            v.insert(key.to_string(), value.to_vec());
            c.notify_all();
        }
        let v = c.wait_while(v, |v| !v.contains_key(key)).map_err(poisoned)?;
        Ok(v.get(key).cloned().unwrap_or_default())
    }

    /// Rank `rank`'s exchange listener, once published.
    pub fn listener_of(&self, rank: usize) -> Result<SocketAddr> {
        String::from_utf8_lossy(&self.share(&key(rank), None)?)
            .parse()
            .map_err(|_| ExchangeError(format!("rank {rank}'s exchange address is not an address")))
    }
}

#[cfg(test)]
mod tests;
