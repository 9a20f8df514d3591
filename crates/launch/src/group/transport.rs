//! Owns the group's sockets and threads: node 0's listener, a thread per connection (at most
//! MAX_PENDING at once for connections that have not proven themselves, each for HELLO_WAIT
//! at most), each admitted node's outbox (a writer thread), the clock's thread, and a node's
//! connection to the coordinator (its reader and, elastic, its heartbeat).
//! Keeps: a connection whose hello does not prove that it knows the run's secret, or that is
//! not admitted (garbage, silence, another run's id), is refused, logged with its address,
//! and changes nothing: it never takes the coordinator's lock before its proof holds; a node
//! starts nothing for a coordinator that does not prove it back; no node's socket ever holds
//! the coordinator's locks.
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::super::elastic::{self, Elastic};
use super::super::{random_hex, LaunchError as Error, LaunchSpec, Token, TOKEN_VAR};
use super::coordinator::{Coordinator, Lobby, Throttle, To};
use super::protocol::{line, prove, proves, read_line, Hello, Side, ToCoordinator, ToNode, NONCE_BYTES};
use super::{next, Group, Heard, Link, JOIN_TIMEOUT};
use oomguard_host::proc::Signals;

/// How long node 0's launcher waits for a node's launcher to take a message: one that stops
/// reading (its socket's buffers full) counts as lost, and cannot freeze the coordinator.
const WRITE_WAIT: Duration = Duration::from_secs(5);
/// Messages a node's launcher may be behind before it counts as lost (a few a round are sent).
const OUTBOX: usize = 256;
/// How long a new connection has, in all, to prove that it knows the run's secret: a
/// launcher does at once (its hello answers the challenge).
const HELLO_WAIT: Duration = Duration::from_secs(10);
/// The most connections at once that have not proven themselves (each with a thread while it
/// waits): one more crowds out the oldest of the address holding the most (`Lobby`). A place
/// is held for a round trip by a node's launcher, so 64 lets that many nodes start at the same
/// instant with none crowded out, and costs a flood 64 small threads.
pub(super) const MAX_PENDING: usize = 64;
/// Warnings about strangers: at most STRANGER_LOGS every STRANGER_LOG_WINDOW, then a count.
const STRANGER_LOGS: usize = 10;
const STRANGER_LOG_WINDOW: Duration = Duration::from_secs(10);

fn io(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

/// A port free on this host now, offered for its workers' store (elastic), else 0.
pub(super) fn offer_port(spec: &LaunchSpec) -> u16 {
    spec.elastic.and_then(|_| free_port("0.0.0.0").ok()).unwrap_or(0)
}

/// A port free on `host` now (0.0.0.0: on every interface, for a store another node reaches),
/// drawn at random outside the kernel's ephemeral range where it can (from 20000 up to it, and
/// above it): a port the kernel hands out (bind to port 0) is the next outgoing connection's,
/// so that between this check and the store's listen, any process's connect could take it
/// (a flake seen with parallel launches).
pub(crate) fn free_port(host: &str) -> std::io::Result<u16> {
    use std::hash::BuildHasher;
    let (low, high) = ephemeral_range();
    let spans = outside(low, high);
    let total: u32 = spans.iter().map(|(a, b)| u32::from(b - a)).sum();
    if total >= 1000 {
        let random = std::collections::hash_map::RandomState::new();
        for draw in 0..64u32 {
            let mut at = (random.hash_one((draw, std::process::id())) % u64::from(total)) as u32;
            let port = spans.iter().find_map(|&(a, b)| {
                let len = u32::from(b - a);
                let here = (at < len).then(|| a + at as u16);
                at = at.saturating_sub(len);
                here
            });
            if let Some(p) = port.filter(|p| TcpListener::bind((host, *p)).is_ok()) {
                return Ok(p);
            }
        }
    } else {
        tracing::warn!(
            "the kernel's ephemeral ports ({low}-{high}) leave fewer than 1000 outside them from {FIRST_DRAWN}: \
            the store's port is the kernel's pick, which another process's connection could take"
        );
    }
    TcpListener::bind((host, 0))?.local_addr().map(|a| a.port())
}

/// The kernel's ephemeral ports, `low..=high` (Linux's default where it cannot be read).
fn ephemeral_range() -> (u16, u16) {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    match range
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect::<Vec<u16>>()[..]
    {
        [low, high] => (low, high),
        _ => (32768, 60999),
    }
}

/// The lowest port `free_port` draws: above the well-known services' usual ports.
const FIRST_DRAWN: u16 = 20000;

/// The ports from FIRST_DRAWN outside the ephemeral range `low..=high`, as half-open spans.
fn outside(low: u16, high: u16) -> Vec<(u16, u16)> {
    let mut spans = vec![];
    if low > FIRST_DRAWN {
        spans.push((FIRST_DRAWN, low));
    }
    let above = high.max(FIRST_DRAWN - 1).saturating_add(1);
    if above < u16::MAX {
        spans.push((above, u16::MAX));
    }
    spans
}

/// Node 0 starts the coordinator; every node (node 0 too) connects to it and is admitted
/// (`introduce`). Elastic, the coordinator is at the rendezvous endpoint (--rdzv-endpoint),
/// hosted by the launcher that can listen there first, as torchrun's c10d rendezvous hosts
/// its store. A connection closed or silent before the welcome (crowded out by strangers, say)
/// is made again, until the join timeout.
pub(super) fn connect(spec: &LaunchSpec, hello: Hello, signals: &Signals) -> Result<Group, Error> {
    let (port, server) = match spec.elastic {
        Some(e) => (spec.master_port, host_elastic(spec, e)),
        None => {
            let port = spec.master_port.checked_add(1).ok_or_else(|| {
                Error::Start(
                    "--master-port 65535 leaves no port for the launchers' coordinator (it uses --master-port + 1)"
                        .into(),
                )
            })?;
            (
                port,
                if spec.node_rank == 0 {
                    Some(serve(spec, port)?)
                } else {
                    None
                },
            )
        }
    };
    let addr = (spec.master_addr.as_str(), port);
    let at = format!("{}:{port}", spec.master_addr);
    let join_timeout = spec.elastic.map_or(JOIN_TIMEOUT, |e| e.join_timeout);
    let t = Instant::now();
    let (stream, inbox) = loop {
        let reached = (addr.to_socket_addrs().ok())
            .and_then(|mut a| a.find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok()));
        let again = match reached {
            Some(stream) => {
                let inbox = listen(&stream)?;
                match introduce(&stream, &inbox, spec.token.reveal(), hello.clone(), signals, &at) {
                    Ok(()) => break (stream, inbox),
                    Err(Intro::Fail(e)) => return Err(e),
                    Err(Intro::Again(why)) => {
                        let _ = stream.shutdown(Shutdown::Both);
                        Some(why)
                    }
                }
            }
            None => None,
        };
        interrupted(signals)?;
        if t.elapsed() > join_timeout {
            return Err(Error::Start(match again {
                Some(why) => format!(
                    "the launchers' coordinator at {at} did not admit this node within {} s: {why}",
                    join_timeout.as_secs()
                ),
                None => format!(
                    "cannot reach node 0's launcher at {at} within {} s",
                    join_timeout.as_secs()
                ),
            }));
        }
        if let Some(why) = again {
            tracing::info!("the launchers' coordinator at {at} {why}: trying again");
        }
        std::thread::sleep(retry_pause());
    };
    match spec.elastic {
        Some(e) => tracing::info!(
            "joined the elastic rendezvous ({}:{} nodes) at {at}{}",
            e.min,
            e.max,
            if server.is_some() {
                ", which this launcher hosts"
            } else {
                ""
            }
        ),
        None => tracing::info!(
            "node {} of {}: joined the launchers' coordinator at {at}",
            spec.node_rank,
            spec.nnodes,
        ),
    }
    Ok(Group {
        node: spec.node_rank,
        link: Link::Remote {
            stream: Arc::new(Mutex::new(stream)),
            inbox,
            server,
            gone: false,
        },
        join_timeout,
        signals: signals.clone(),
    })
}

/// 100 to 300 ms, at random: nodes crowded out together do not come back together.
fn retry_pause() -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let r = std::collections::hash_map::RandomState::new().build_hasher().finish();
    Duration::from_millis(100 + r % 200)
}

/// A thread that reads the coordinator's messages from `stream` into the returned channel, then
/// None once the connection closes (or carries garbage).
fn listen(stream: &TcpStream) -> Result<Receiver<Option<ToNode>>, Error> {
    stream.set_nodelay(true).ok();
    let (tx, rx) = mpsc::channel();
    let reader = stream
        .try_clone()
        .map_err(io("cloning the coordinator's connection".into()))?;
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            let Ok(m) = serde_json::from_str::<ToNode>(&line) else {
                break;
            };
            if tx.send(Some(m)).is_err() {
                return;
            }
        }
        let _ = tx.send(None);
    });
    Ok(rx)
}

/// Why a node was not admitted: for good (refused; a coordinator that does not prove it knows
/// the secret, or does not speak this protocol; a signal), or for now (`Again`: the connection
/// closed, or went quiet, before the welcome).
enum Intro {
    Fail(Error),
    Again(String),
}

/// This node's admission on a new connection to the coordinator: its challenge, this node's
/// hello with the proof that it knows the run's `secret`, and its welcome with the proof that
/// the coordinator does. Neither side sends the secret; a coordinator that cannot prove it
/// gets nothing more from this node (no worker starts, so no worker shows it the token).
fn introduce(
    stream: &TcpStream,
    inbox: &Receiver<Option<ToNode>>,
    secret: &str,
    mut hello: Hello,
    signals: &Signals,
    at: &str,
) -> Result<(), Intro> {
    let fail = |why: String| Intro::Fail(Error::Start(why));
    let refused = |why: String| fail(format!("node 0's launcher refused this node: {why}"));
    let quiet = |what: &str| match interrupted(signals) {
        Err(e) => Intro::Fail(e),
        Ok(()) => Intro::Again(format!("sent no {what} within {} s", HELLO_WAIT.as_secs())),
    };
    let challenge = match next(inbox, Some(HELLO_WAIT), signals) {
        Heard::Msg(ToNode::Challenge { nonce }) => nonce,
        Heard::Msg(ToNode::Refused { why }) => return Err(refused(why)),
        Heard::Msg(_) => {
            return Err(fail(format!(
                "the launchers' coordinator at {at} did not open with a challenge: it is not an oomguard launcher of \
                this version"
            )))
        }
        Heard::Closed => return Err(Intro::Again("closed the connection before its challenge".into())),
        Heard::Nothing => return Err(quiet("challenge")),
    };
    hello.nonce = random_hex(NONCE_BYTES).map_err(Intro::Fail)?;
    hello.proof = prove(secret, Side::Node, &challenge, &hello);
    if let Err(e) = (&*stream).write_all(line(&ToCoordinator::Hello(hello.clone())).as_bytes()) {
        return Err(Intro::Again(format!("took no hello ({e})")));
    }
    match next(inbox, Some(HELLO_WAIT), signals) {
        Heard::Msg(ToNode::Welcome { proof }) if proves(secret, Side::Coordinator, &challenge, &hello, &proof) => {
            Ok(())
        }
        Heard::Msg(ToNode::Refused { why }) => Err(refused(why)),
        Heard::Msg(_) => Err(fail(format!(
            "the launchers' coordinator at {at} did not prove that it knows the run's secret ({TOKEN_VAR}): it runs \
            with another one, or it is not this job's; give every node's launcher the same {TOKEN_VAR} (no worker \
            started)"
        ))),
        Heard::Closed => Err(Intro::Again("closed the connection before admitting this node".into())),
        Heard::Nothing => Err(quiet("welcome")),
    }
}

/// A signal to the launcher ends its wait for the group.
pub(super) fn interrupted(signals: &Signals) -> Result<(), Error> {
    signals.received().map_or(Ok(()), |sig| Err(Error::Signaled(sig)))
}

/// Elastic: a beat every BEAT until the coordinator's connection fails, so that a node whose
/// host hangs (its connections open, nothing moving) is seen as gone (`Elastic::silence`).
pub(super) fn beat(stream: Arc<Mutex<TcpStream>>) {
    let beat = line(&ToCoordinator::Beat);
    std::thread::spawn(move || loop {
        std::thread::sleep(elastic::BEAT);
        let sent = stream.lock().map(|mut s| s.write_all(beat.as_bytes()));
        if !matches!(sent, Ok(Ok(()))) {
            return;
        }
    });
}

/// Elastic: hosts the coordinator at the rendezvous endpoint if this launcher can listen
/// there (its address is this host's and no launcher listens yet); else another hosts it.
fn host_elastic(spec: &LaunchSpec, e: Elastic) -> Option<Arc<Mutex<Coordinator>>> {
    let addrs: Vec<SocketAddr> = (spec.master_addr.as_str(), spec.master_port)
        .to_socket_addrs()
        .ok()?
        .collect();
    let listener = addrs.iter().find_map(|a| TcpListener::bind(a).ok())?;
    let c = Coordinator::elastic(e, spec.max_restarts, &spec.run_id);
    Some(coordinate(listener, c, spec.token.clone(), HELLO_WAIT))
}

/// The coordinator's listener: on --master-addr's own address (so on that interface only, a
/// loopback address staying on this host), served by `coordinate`. An address that is not
/// this host's is refused: node 0 is the host --master-addr names.
fn serve(spec: &LaunchSpec, port: u16) -> Result<Arc<Mutex<Coordinator>>, Error> {
    let addr = &spec.master_addr;
    let addrs: Vec<SocketAddr> = (addr.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| Error::Start(format!("--master-addr {addr} does not resolve: {e}")))?
        .collect();
    let mut failed = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => {
                let c = Coordinator::new(spec.nnodes, spec.max_restarts, &spec.run_id);
                return Ok(coordinate(l, c, spec.token.clone(), HELLO_WAIT));
            }
            Err(e) => failed = Some(e),
        }
    }
    Err(match failed {
        Some(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => Error::Start(format!(
            "cannot listen on {addr}:{port} for the other nodes' launchers ({e}): --master-addr must be an address of node 0's \
            own host, the interface the launchers' coordinator listens on (at --master-port + 1)"
        )),
        Some(e) => io(format!(
            "listening on {addr}:{port} for the other nodes' launchers (it is --master-port + 1)"
        ))(e),
        None => Error::Start(format!("--master-addr {addr} resolves to no address")),
    })
}

/// Node 0's coordinator and what serves it, shared by the listener's thread, each
/// connection's and the clock's.
struct Served {
    coordinator: Arc<Mutex<Coordinator>>,
    writers: Mutex<BTreeMap<usize, Outbox>>,
    /// The run's token: what a hello must prove it knows.
    secret: Token,
    /// How long a connection has to prove it, in all (HELLO_WAIT).
    hello_wait: Duration,
    door: Door,
    warnings: Mutex<Throttle>,
}

impl Served {
    /// A warning about a stranger, unless too many came lately (then it is counted, and the
    /// count written later: `Throttle`).
    fn stranger(&self, what: &str) {
        let shown = lock(&self.warnings).note(Instant::now());
        if let Some(held) = shown {
            held_back(held);
            tracing::warn!("{what}");
        }
    }
}

/// The line that counts `held` warnings about strangers not written one by one.
fn held_back(held: usize) {
    if held > 0 {
        tracing::warn!(
            "{held} more connections to the launchers' coordinator were dropped or refused (not named one by one: at \
            most {STRANGER_LOGS} every {} s)",
            STRANGER_LOG_WINDOW.as_secs()
        );
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The places of the connections that have not proven themselves yet (`Lobby`), the sockets
/// that crowd one out by being shut, and how many threads still serve such connections (a
/// crowded-out one's ends as soon as its socket is shut).
struct Door {
    state: Mutex<Waiting>,
    freed: Condvar,
}

struct Waiting {
    lobby: Lobby,
    /// Each place's socket and address.
    sockets: BTreeMap<u64, (TcpStream, String)>,
    threads: usize,
}

impl Door {
    fn new() -> Door {
        Door {
            state: Mutex::new(Waiting {
                lobby: Lobby::new(MAX_PENDING),
                sockets: BTreeMap::new(),
                threads: 0,
            }),
            freed: Condvar::new(),
        }
    }

    /// A place for `stream` (from `peer`), crowding out another if every place is taken, and
    /// a thread's share: its ticket, or None when there is no room (the threads of
    /// crowded-out connections not yet ended, for a second).
    fn enter(&self, stream: &TcpStream, peer: &str, served: &Served) -> Option<u64> {
        let ip = stream.peer_addr().map_or(IpAddr::from([0, 0, 0, 0]), |a| a.ip());
        let socket = stream.try_clone().ok()?;
        let mut w = lock(&self.state);
        let (ticket, out) = w.lobby.enter(ip);
        if let Some((t, _)) = out {
            if let Some((s, at)) = w.sockets.remove(&t) {
                let _ = s.shutdown(Shutdown::Both);
                served.stranger(&format!(
                    "dropped a connection from {at} to the launchers' coordinator: it had not proven that it knows the \
                    run's secret, and {MAX_PENDING} such connections are the most it holds (the oldest of the address \
                    holding the most makes room)"
                ));
            }
        }
        let until = Instant::now() + Duration::from_secs(1);
        while w.threads >= MAX_PENDING {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                w.lobby.leave(ticket);
                drop(w);
                served.stranger(&format!(
                    "refused a connection from {peer} to the launchers' coordinator: {MAX_PENDING} connections that \
                    have not proven themselves are being served"
                ));
                return None;
            }
            w = self
                .freed
                .wait_timeout(w, left)
                .map_or_else(|p| p.into_inner().0, |(g, _)| g);
        }
        w.threads += 1;
        w.sockets.insert(ticket, (socket, peer.to_string()));
        Some(ticket)
    }

    /// `ticket`'s connection leaves its place (proven, or dropped): whether it still held it
    /// (it was not crowded out).
    fn leave(&self, ticket: u64) -> bool {
        let mut w = lock(&self.state);
        w.sockets.remove(&ticket);
        w.lobby.leave(ticket)
    }

    /// A thread's share back: its connection has proven itself, or the thread is ending.
    fn release(&self) {
        let mut w = lock(&self.state);
        w.threads = w.threads.saturating_sub(1);
        self.freed.notify_all();
    }
}

/// A connection's place in the door and its thread's share, each given back once: the place
/// when it proves itself or is dropped, the share when it proves itself or its thread ends
/// (the place dropped last, so that the share outlives the socket and the reads).
struct Place<'a> {
    door: &'a Door,
    ticket: Option<u64>,
    share: bool,
}

impl Place<'_> {
    /// Leaves the place: whether it was still held (not crowded out); false the second time.
    fn leave(&mut self) -> bool {
        self.ticket.take().is_some_and(|t| self.door.leave(t))
    }

    /// Proven: the place and the share are free for others; the thread serves a node now.
    fn proven(&mut self) {
        self.leave();
        if std::mem::take(&mut self.share) {
            self.door.release();
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.proven();
    }
}

/// Reads `stream` with every read bounded by what is left until `until` (None: unbounded),
/// so that a stranger who trickles a byte at a time cannot hold its place past its deadline
/// (`wait` after it came).
struct Deadline {
    stream: TcpStream,
    until: Option<Instant>,
    wait: Duration,
}

impl Read for Deadline {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(until) = self.until {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("nothing proven within {} s", self.wait.as_secs_f64()),
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        self.stream.read(buf)
    }
}

/// Runs `coordinator` for the connections `listener` accepts; a connection's hello must prove
/// that it knows `secret` (the run's token). At most MAX_PENDING connections (each with its
/// thread) wait to prove it, each for `hello_wait` (HELLO_WAIT) at most in all; an admitted node's
/// connection has a reader thread and a writer's (its outbox). The listener's and the clock's
/// threads complete the count.
fn coordinate(
    listener: TcpListener,
    coordinator: Coordinator,
    secret: Token,
    hello_wait: Duration,
) -> Arc<Mutex<Coordinator>> {
    let coordinator = Arc::new(Mutex::new(coordinator));
    let served = Arc::new(Served {
        coordinator: Arc::clone(&coordinator),
        writers: Mutex::default(),
        secret,
        hello_wait,
        door: Door::new(),
        warnings: Mutex::new(Throttle::new(STRANGER_LOGS, STRANGER_LOG_WINDOW)),
    });
    let s = Arc::clone(&served);
    std::thread::spawn(move || loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: not a reason to spin.
                s.stranger(&format!(
                    "the launchers' coordinator could not accept a connection ({e})"
                ));
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
        let Some(ticket) = s.door.enter(&stream, &peer, &s) else {
            continue;
        };
        let served = Arc::clone(&s);
        let spawned = std::thread::Builder::new().spawn(move || {
            let place = Place {
                door: &served.door,
                ticket: Some(ticket),
                share: true,
            };
            serve_node(stream, peer, place, &served);
        });
        if let Err(e) = spawned {
            s.door.leave(ticket);
            s.door.release();
            s.stranger(&format!(
                "the launchers' coordinator could not serve a connection ({e})"
            ));
        }
    });
    // The clock's decisions (an elastic rendezvous's last call), a tick at a time.
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = Instant::now();
        held_back(lock(&served.warnings).overdue(Some(now)));
        let mut c = lock(&served.coordinator);
        if c.settled() {
            return held_back(lock(&served.warnings).overdue(None));
        }
        let out = c.tick(now);
        let mut w = lock(&served.writers);
        // A node silent past its heartbeat's bound: its connection is shut, and its reader
        // reports it gone as if it had closed.
        for n in c.silent(now) {
            if let Some(o) = w.remove(&n) {
                tracing::warn!(
                    "node {n}'s launcher sent nothing for {} s: it counts as gone",
                    c.silence().as_secs()
                );
                let _ = o.socket.shutdown(Shutdown::Both);
            }
        }
        deliver(&mut c, &mut w, out);
    });
    coordinator
}

/// Messages on their way to one node, written by a thread of its own: the coordinator only
/// queues them, so no node's socket ever holds its locks.
struct Outbox {
    queue: SyncSender<String>,
    socket: TcpStream,
}

impl Outbox {
    /// A write that makes no progress for WRITE_WAIT (set on the socket) fails; then the socket
    /// is shut, and the node's reader sees its connection close: the node is gone.
    fn new(socket: TcpStream) -> std::io::Result<Outbox> {
        socket.set_write_timeout(Some(WRITE_WAIT))?;
        let (queue, lines) = mpsc::sync_channel::<String>(OUTBOX);
        let mut writer = socket.try_clone()?;
        std::thread::spawn(move || {
            for line in lines {
                if let Err(e) = writer.write_all(line.as_bytes()) {
                    tracing::warn!(
                        "a node's launcher does not take the coordinator's messages ({e}; the wait is {} s): it counts as gone",
                        WRITE_WAIT.as_secs()
                    );
                    let _ = writer.shutdown(Shutdown::Both);
                    return;
                }
            }
        });
        Ok(Outbox { queue, socket })
    }
}

/// Serves one connection from `peer`, which holds `place` until it proves itself. It opens
/// with a challenge; until its hello proves that it knows the run's secret (within hello_wait
/// of its arrival, in all), it is given nothing and takes no lock of the coordinator's; a
/// stranger (silent, garbage, no proof or a wrong one, crowded out) is dropped with a warning
/// naming its address (a few a window: `Served::stranger`), and the run goes on. Proven, the
/// coordinator decides (another run's id is refused).
fn serve_node(stream: TcpStream, peer: String, mut place: Place<'_>, served: &Served) {
    stream.set_nodelay(true).ok();
    // The challenge and a refusal are written here, once, into an empty socket: they cannot
    // block for longer.
    if stream.set_write_timeout(Some(WRITE_WAIT)).is_err() {
        return;
    }
    let Ok(mut reply) = stream.try_clone() else { return };
    // A connection crowded out had its socket shut by the listener, which said so.
    let mut stranger = |why: String| {
        if place.leave() {
            served.stranger(&why);
        }
    };
    let challenge = match random_hex(NONCE_BYTES) {
        Ok(c) => c,
        Err(e) => {
            return stranger(format!(
                "dropped a connection from {peer} to the launchers' coordinator: no challenge for it ({e})"
            ))
        }
    };
    if let Err(e) = reply.write_all(
        line(&ToNode::Challenge {
            nonce: challenge.clone(),
        })
        .as_bytes(),
    ) {
        return stranger(format!(
            "dropped a connection from {peer} to the launchers' coordinator: it took no challenge ({e})"
        ));
    }
    let mut lines = BufReader::new(Deadline {
        stream,
        until: Some(Instant::now() + served.hello_wait),
        wait: served.hello_wait,
    });
    let dropped = |why: String| format!("dropped a connection from {peer} to the launchers' coordinator: {why}");
    let hello = match read_line(&mut lines) {
        Ok(Some(l)) => match serde_json::from_str::<ToCoordinator>(&l) {
            Ok(ToCoordinator::Hello(h)) => h,
            _ => return stranger(dropped("it did not open with a launcher's hello".into())),
        },
        Ok(None) => {
            return stranger(format!(
                "a connection from {peer} to the launchers' coordinator closed without a launcher's hello"
            ))
        }
        Err(e) => return stranger(dropped(format!("no launcher's hello ({e})"))),
    };
    let refusal = |mut reply: TcpStream, why: String| {
        let _ = reply.write_all(line(&ToNode::Refused { why }).as_bytes());
    };
    if !proves(served.secret.reveal(), Side::Node, &challenge, &hello, &hello.proof) {
        let why = format!(
            "its hello does not prove that it knows the run's secret ({TOKEN_VAR}, node 0's launcher's): give every node's \
            launcher the same one"
        );
        stranger(format!(
            "refused a connection from {peer} to the launchers' coordinator: {why}"
        ));
        return refusal(reply, why);
    }
    // A launcher of this job: its place and share are free for another, and the coordinator
    // decides.
    place.proven();
    let welcome = prove(served.secret.reveal(), Side::Coordinator, &challenge, &hello);
    let ip = lines
        .get_ref()
        .stream
        .peer_addr()
        .map_or_else(|_| "127.0.0.1".into(), |a| a.ip().to_string());
    let from = {
        let mut c = lock(&served.coordinator);
        let from = c.slot(hello.node, &ip);
        let mut w = lock(&served.writers);
        let mut out = c.on(from, ToCoordinator::Hello(hello));
        if let Some(why) = out.iter().find_map(|(_, m)| match m {
            ToNode::Refused { why } => Some(why.clone()),
            _ => None,
        }) {
            tracing::warn!("refused a connection from {peer} to the launchers' coordinator: {why}");
            return refusal(reply, why);
        }
        for (to, m) in &mut out {
            if let (To::Node(n), ToNode::Welcome { proof }) = (*to, m) {
                if n == from {
                    proof.clone_from(&welcome);
                }
            }
        }
        // Admitted: from now on it may be quiet for as long as the run lasts.
        lines.get_mut().until = None;
        if lines.get_ref().stream.set_read_timeout(None).is_err() {
            tracing::warn!("node {from}'s launcher at {peer}: cannot wait on its connection");
        }
        if let Ok(o) = reply.try_clone().and_then(Outbox::new) {
            w.insert(from, o);
        }
        deliver(&mut c, &mut w, out);
        from
    };
    // An admitted node's messages, until its connection closes (or carries garbage: it is gone).
    while let Ok(Some(l)) = read_line(&mut lines) {
        let Ok(msg) = serde_json::from_str::<ToCoordinator>(&l) else {
            break;
        };
        let mut c = lock(&served.coordinator);
        let mut w = lock(&served.writers);
        let out = c.on(from, msg);
        deliver(&mut c, &mut w, out);
    }
    let mut c = lock(&served.coordinator);
    let mut w = lock(&served.writers);
    w.remove(&from);
    let out = c.gone(from);
    deliver(&mut c, &mut w, out);
}

/// Queues each message for the nodes it is for. A node whose queue is full (OUTBOX messages
/// behind: it stopped reading) is lost, as if its connection had closed: its socket is shut,
/// the coordinator told, and what that brings queued for the others in turn.
fn deliver(c: &mut Coordinator, writers: &mut BTreeMap<usize, Outbox>, out: Vec<(To, ToNode)>) {
    let mut out = VecDeque::from(out);
    while let Some((to, msg)) = out.pop_front() {
        let text = line(&msg);
        let mut lost = vec![];
        for (n, w) in writers.iter() {
            if (to == To::All || to == To::Node(*n)) && w.queue.try_send(text.clone()).is_err() {
                lost.push(*n);
            }
        }
        for n in lost {
            if let Some(w) = writers.remove(&n) {
                let _ = w.socket.shutdown(Shutdown::Both);
            }
            tracing::warn!("node {n}'s launcher is {OUTBOX} messages behind the coordinator: it counts as gone");
            out.extend(c.gone(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::protocol::MAX_LINE;
    use super::*;
    use std::io::Read;

    /// Drawn below the ephemeral range (32768 here), where no outgoing connection takes it,
    /// free, and not the same each time.
    #[test]
    fn a_free_port_is_drawn_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..8).map(|_| free_port("127.0.0.1").unwrap()).collect();
        let (low, high) = ephemeral_range();
        assert!(
            ports.iter().all(|p| !(low..=high).contains(p) && *p >= FIRST_DRAWN),
            "{ports:?}"
        );
        assert_eq!(outside(32768, 60999), [(20000, 32768), (61000, 65535)]);
        assert_eq!(outside(1024, 65535), [], "nothing outside: the kernel's pick");
        assert_eq!(outside(10000, 50000), [(50001, 65535)]);
        assert!(ports.iter().any(|p| *p != ports[0]), "{ports:?}");
        assert!(TcpListener::bind(("127.0.0.1", ports[0])).is_ok());
    }

    const SECRET: &str = "the-secret-0123456789";
    /// A connection's deadline in the tests that wait for it (HELLO_WAIT's part, shorter).
    const WAIT: Duration = Duration::from_secs(4);

    // The hellos and reports the coordinator's tests make.
    use super::super::coordinator::tests::{hello, hello_of, report};

    /// A node's side of an admission, as `introduce` does it: reads the challenge on `s`, and
    /// sends `h` with a nonce and its proof under `secret`. Returns the reader (past the
    /// challenge), the challenge and the hello as sent.
    fn say_hello(s: &TcpStream, secret: &str, mut h: Hello) -> (BufReader<TcpStream>, String, Hello) {
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut first = String::new();
        r.read_line(&mut first).unwrap();
        let ToNode::Challenge { nonce: challenge } = serde_json::from_str(first.trim_end()).unwrap() else {
            panic!("no challenge first: {first}")
        };
        assert_eq!(challenge.len(), 2 * NONCE_BYTES, "{challenge}");
        h.nonce = random_hex(NONCE_BYTES).unwrap();
        h.proof = prove(secret, Side::Node, &challenge, &h);
        (&*s)
            .write_all(line(&ToCoordinator::Hello(h.clone())).as_bytes())
            .unwrap();
        (r, challenge, h)
    }

    fn next_msg(r: &mut BufReader<TcpStream>) -> ToNode {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        serde_json::from_str(l.trim_end()).unwrap_or_else(|e| panic!("{e}: {l:?}"))
    }

    /// A node that says hello and then stops reading, while it makes the coordinator answer it
    /// again and again: the answers back up (the old coordinator blocked writing them, holding
    /// its locks, and froze). It counts as lost, and the other node hears that the group
    /// stopped, naming it, within WRITE_WAIT and a margin.
    #[test]
    fn a_node_that_stops_reading_is_lost_and_the_others_hear_it() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let c = coordinate(
            listener,
            Coordinator::new(2, 3, "job"),
            Token::new(SECRET.into()),
            HELLO_WAIT,
        );
        let good = TcpStream::connect(("127.0.0.1", port)).unwrap();
        good.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        let (mut replies, challenge, sent) = say_hello(&good, SECRET, hello_of(0, None));
        let stuck = TcpStream::connect(("127.0.0.1", port)).unwrap();
        say_hello(&stuck, SECRET, hello_of(1, None));
        let welcome = next_msg(&mut replies);
        assert!(
            matches!(&welcome, ToNode::Welcome { proof } if proves(SECRET, Side::Coordinator, &challenge, &sent, proof)),
            "{welcome:?}"
        );
        let first = next_msg(&mut replies);
        assert!(matches!(first, ToNode::Go { round: 0, .. }), "{first:?}");
        let mut replies = replies.lines();
        // Node 1 says hello again and again (each answered with a refusal) and reads nothing,
        // until its own writes block: the coordinator has stopped reading it, stuck writing.
        let (wedged, wedge) = mpsc::channel();
        let again = line(&hello(1, None)).repeat(100);
        let mut stuck = stuck;
        std::thread::spawn(move || {
            stuck.set_write_timeout(Some(Duration::from_millis(300))).unwrap();
            let mut sent = 0usize;
            while stuck.write_all(again.as_bytes()).is_ok() && sent < 1 << 30 {
                sent += again.len();
            }
            let _ = wedged.send(sent);
            std::thread::sleep(Duration::from_secs(60)); // keeps the socket open, unread
        });
        let sent = wedge.recv_timeout(Duration::from_secs(60)).unwrap();
        assert!(sent < 1 << 30, "node 1's hellos never backed up ({sent} bytes)");
        let t = Instant::now();
        (&good)
            .write_all(
                line(&ToCoordinator::Failed {
                    round: 0,
                    report: report(0, false, None),
                })
                .as_bytes(),
            )
            .unwrap();
        let bound = WRITE_WAIT + Duration::from_secs(5);
        let stop = loop {
            assert!(t.elapsed() < bound, "node 0 heard nothing within {bound:?}");
            match replies.next() {
                Some(Ok(l)) => match serde_json::from_str::<ToNode>(&l).unwrap() {
                    ToNode::Stop { code, why } => break (code, why),
                    _ => continue,
                },
                Some(Err(e)) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                other => panic!("node 0's connection: {other:?}"),
            }
        };
        assert_eq!(stop.0, 1, "{}", stop.1);
        assert!(stop.1.contains("node 1"), "{}", stop.1);
        // The coordinator is free again (node 0's failure report, queued behind the stuck
        // write, is taken) and the job has ended.
        while !c.try_lock().is_ok_and(|c| c.settled()) {
            assert!(
                t.elapsed() < bound,
                "the coordinator is still held, or the job did not end"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Strangers at the coordinator's port while a run joins: one sends garbage, one stays
    /// silent, one sends a line longer than MAX_LINE, one says hello without a proof (as the
    /// launchers' hello was before there was one), one with the run's id and a made-up proof,
    /// one replays a real node's hello (its proof was for another challenge), and one knows
    /// the secret but names another run. Each hears the challenge and at most a refusal (why,
    /// never the run's id unless it proved the secret), and the coordinator records none of
    /// them; the two real nodes still join, each checks the welcome's proof, gets the go, and
    /// finishes.
    #[test]
    fn strangers_are_refused_and_the_run_goes_on() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let c = coordinate(
            listener,
            Coordinator::new(2, 0, "job"),
            Token::new(SECRET.into()),
            HELLO_WAIT,
        );
        let connect = || {
            let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            s
        };
        let all = |mut s: &TcpStream| {
            let mut heard = String::new();
            s.read_to_string(&mut heard).unwrap();
            heard
        };
        let garbage = connect();
        (&garbage).write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let _silent = connect();
        let long = connect();
        (&long).write_all(&vec![b'x'; MAX_LINE as usize + 10]).unwrap();
        let unproven = connect();
        (&unproven)
            .write_all(b"{\"msg\":\"hello\",\"id\":\"job\",\"node\":1,\"micro\":null}\n")
            .unwrap();
        let made_up = connect();
        let (mut r, _, _) = say_hello(&made_up, "not-the-secret-at-all", hello_of(1, None));
        let refused = next_msg(&mut r);
        let other_run = connect();
        say_hello(
            &other_run,
            SECRET,
            Hello {
                id: "other".into(),
                ..hello_of(1, None)
            },
        );
        let heard = all(&other_run);
        assert!(heard.contains("refused") && heard.contains("--rdzv-id"), "{heard}");
        // The garbage heard the challenge and nothing else.
        let g = all(&garbage);
        assert!(
            g.lines().count() == 1 && matches!(serde_json::from_str(g.trim_end()), Ok(ToNode::Challenge { .. })),
            "garbage got an answer: {g}"
        );
        for (what, heard) in [("unproven", all(&unproven)), ("made-up", format!("{refused:?}"))] {
            assert!(
                heard.contains(TOKEN_VAR) && heard.contains("does not prove"),
                "{what}: {heard}"
            );
            assert!(
                !heard.contains("job") && !heard.contains(SECRET),
                "{what} heard: {heard}"
            );
            assert!(
                !heard.contains("welcome") && !heard.contains("Welcome"),
                "{what} heard: {heard}"
            );
        }
        let nodes = [0, 1].map(|n| {
            let s = connect();
            let (r, challenge, sent) = say_hello(&s, SECRET, hello_of(n, None));
            (s, r, challenge, sent)
        });
        // A replay of node 1's hello, proof and all, on a new connection: another challenge.
        let replay = connect();
        let mut first = String::new();
        BufReader::new(replay.try_clone().unwrap())
            .read_line(&mut first)
            .unwrap();
        (&replay)
            .write_all(line(&ToCoordinator::Hello(nodes[1].3.clone())).as_bytes())
            .unwrap();
        let heard = all(&replay);
        assert!(heard.contains("refused") && heard.contains("does not prove"), "{heard}");
        let mut nodes = nodes;
        for (_, r, challenge, sent) in &mut nodes {
            let got = [next_msg(r), next_msg(r)];
            assert!(
                matches!(&got[..], [ToNode::Welcome { proof }, ToNode::Go { round: 0, .. }]
                    if proves(SECRET, Side::Coordinator, challenge, sent, proof)),
                "{got:?}"
            );
        }
        for (s, ..) in &nodes {
            (&*s).write_all(line(&ToCoordinator::Done).as_bytes()).unwrap();
        }
        let t = Instant::now();
        while !c.lock().is_ok_and(|c| c.settled()) {
            assert!(t.elapsed() < Duration::from_secs(20), "the run did not finish");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(made_up);
    }

    /// A flood of idle connections (no hello, held open) while a node joins: the coordinator
    /// keeps at most MAX_PENDING of them, crowding out the oldest (their sockets shut at once,
    /// not after their deadline, WAIT here), so the node's connection gets a place, proves itself and is
    /// admitted at once; the ones left are shut at their deadline.
    #[test]
    fn a_flood_of_idle_connections_is_held_to_the_bound_and_a_node_still_joins() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let _c = coordinate(listener, Coordinator::new(1, 0, "job"), Token::new(SECRET.into()), WAIT);
        let flood: Vec<TcpStream> = (0..200)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        let t = Instant::now();
        let node = TcpStream::connect(("127.0.0.1", port)).unwrap();
        node.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let (mut r, challenge, sent) = say_hello(&node, SECRET, hello_of(0, None));
        let got = [next_msg(&mut r), next_msg(&mut r)];
        let joined = t.elapsed();
        assert!(
            matches!(&got[..], [ToNode::Welcome { proof }, ToNode::Go { round: 0, .. }]
                if proves(SECRET, Side::Coordinator, &challenge, &sent, proof)),
            "{got:?}"
        );
        assert!(joined < Duration::from_secs(2), "the node joined in {joined:?}");
        // Which of the flood the coordinator shut (its end seen without waiting): all but the
        // newest MAX_PENDING - 1 (the node took a place too), each at most after its challenge.
        std::thread::sleep(Duration::from_millis(500));
        let shut: Vec<bool> = flood
            .iter()
            .map(|s| {
                s.set_nonblocking(true).unwrap();
                let mut heard = Vec::new();
                let r = (&*s).read_to_end(&mut heard);
                let heard = String::from_utf8_lossy(&heard);
                assert!(
                    heard.is_empty() || heard.starts_with("{\"msg\":\"challenge\""),
                    "{heard}"
                );
                s.set_nonblocking(false).unwrap();
                match r {
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
                }
            })
            .collect();
        let kept = MAX_PENDING - 1;
        assert_eq!(
            shut,
            [vec![true; flood.len() - kept], vec![false; kept]].concat(),
            "after {:?}",
            t.elapsed()
        );
        // The rest are shut at their deadline, WAIT after they came.
        for s in &flood[flood.len() - kept..] {
            s.set_read_timeout(Some(WAIT + Duration::from_secs(5))).unwrap();
            let mut rest = Vec::new();
            let r = (&*s).read_to_end(&mut rest);
            assert!(
                r.is_ok()
                    || r.as_ref()
                        .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
                "not shut at its deadline: {r:?}"
            );
        }
        let waited = t.elapsed();
        assert!(
            waited >= WAIT - Duration::from_millis(500) && waited < WAIT + Duration::from_secs(3),
            "the flood's last were shut after {waited:?}"
        );
    }

    /// A stranger that sends a byte of a hello every 200 ms, never a whole line, is shut at
    /// its deadline (WAIT here) after it came, in all (a read's timeout alone would let it stay as long as
    /// it trickles).
    #[test]
    fn a_stranger_that_trickles_is_shut_at_its_deadline() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let _c = coordinate(listener, Coordinator::new(1, 0, "job"), Token::new(SECRET.into()), WAIT);
        let t = Instant::now();
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let reader = s.try_clone().unwrap();
        let closed = std::thread::spawn(move || {
            let mut all = Vec::new();
            let _ = (&reader).read_to_end(&mut all);
            (t.elapsed(), String::from_utf8_lossy(&all).into_owned())
        });
        let hello = br#"{"msg":"hello","id":"job","node":0"#;
        for b in hello.iter().cycle() {
            if closed.is_finished() || (&s).write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let (after, heard) = closed.join().unwrap();
        assert!(
            after >= WAIT - Duration::from_millis(500) && after < WAIT + Duration::from_secs(3),
            "shut after {after:?}"
        );
        assert!(
            heard.starts_with("{\"msg\":\"challenge\"") && heard.lines().count() == 1,
            "{heard}"
        );
    }
}
