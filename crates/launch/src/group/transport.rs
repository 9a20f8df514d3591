//! Owns the group's sockets and threads: node 0's listener and one thread per connection,
//! each admitted node's outbox (a writer thread), the clock's thread, and a node's connection
//! to the coordinator (its reader and, elastic, its heartbeat).
//! Keeps: a connection whose hello does not prove that it knows the run's secret, or that is
//! not admitted (garbage, silence, another run's id), is refused, logged with its address,
//! and changes nothing: it never takes the coordinator's lock before its proof holds; a node
//! starts nothing for a coordinator that does not prove it back; no node's socket ever holds
//! the coordinator's locks.
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::elastic::{self, Elastic};
use super::super::{random_hex, LaunchError as Error, LaunchSpec, Token, TOKEN_VAR};
use super::coordinator::{Coordinator, To};
use super::protocol::{line, prove, proves, read_line, Hello, Side, ToCoordinator, ToNode, NONCE_BYTES};
use super::{next, Group, Heard, Link, JOIN_TIMEOUT};
use oomguard_host::proc::Signals;

/// How long node 0's launcher waits for a node's launcher to take a message: one that stops
/// reading (its socket's buffers full) counts as lost, and cannot freeze the coordinator.
const WRITE_WAIT: Duration = Duration::from_secs(5);
/// Messages a node's launcher may be behind before it counts as lost (a few a round are sent).
const OUTBOX: usize = 256;
/// How long a new connection has to say hello: a launcher says it at once.
const HELLO_WAIT: Duration = Duration::from_secs(30);

fn io(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

/// A port free on this host now, offered for its workers' store (elastic), else 0.
pub(super) fn offer_port(spec: &LaunchSpec) -> u16 {
    spec.elastic.and_then(|_| free_port("0.0.0.0").ok()).unwrap_or(0)
}

/// A port free on `host` now (0.0.0.0: on every interface, for a store another node reaches).
pub(crate) fn free_port(host: &str) -> std::io::Result<u16> {
    TcpListener::bind((host, 0))?.local_addr().map(|a| a.port())
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
        std::thread::sleep(Duration::from_millis(200));
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
    Some(coordinate(listener, c, spec.token.clone()))
}

/// The coordinator's listener: on --master-addr's own address (so on that interface only, a
/// loopback address staying on this host), one thread per connection. An address that is not
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
                return Ok(coordinate(l, c, spec.token.clone()));
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

/// Runs `coordinator` for the connections `listener` accepts, each on its own thread; a
/// connection's hello must prove that it knows `secret` (the run's token).
fn coordinate(listener: TcpListener, coordinator: Coordinator, secret: Token) -> Arc<Mutex<Coordinator>> {
    let coordinator = Arc::new(Mutex::new(coordinator));
    let writers: Arc<Mutex<BTreeMap<usize, Outbox>>> = Arc::default();
    let c = Arc::clone(&coordinator);
    let w = Arc::clone(&writers);
    let secret = Arc::new(secret);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let (c, writers, secret) = (Arc::clone(&c), Arc::clone(&w), Arc::clone(&secret));
            std::thread::spawn(move || serve_node(stream, &c, &writers, &secret));
        }
    });
    // The clock's decisions (an elastic rendezvous's last call), a tick at a time.
    let c = Arc::clone(&coordinator);
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_millis(100));
        let mut c = c.lock().unwrap_or_else(|p| p.into_inner());
        if c.settled() {
            return;
        }
        let now = Instant::now();
        let out = c.tick(now);
        let mut w = writers.lock().unwrap_or_else(|p| p.into_inner());
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

/// Serves one connection. It opens with a challenge; until its hello proves that it knows
/// the run's secret, and the coordinator admits it, it changes nothing and is given nothing: a
/// stranger (silent for HELLO_WAIT, garbage, no proof or a wrong one, refused) is dropped
/// with a warning naming its address, and the run goes on.
fn serve_node(
    stream: TcpStream,
    coordinator: &Mutex<Coordinator>,
    writers: &Mutex<BTreeMap<usize, Outbox>>,
    secret: &Token,
) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    stream.set_nodelay(true).ok();
    // The challenge and a refusal are written here, once, into an empty socket: they cannot
    // block for longer.
    if stream.set_write_timeout(Some(WRITE_WAIT)).is_err() || stream.set_read_timeout(Some(HELLO_WAIT)).is_err() {
        return;
    }
    let Ok(mut reply) = stream.try_clone() else { return };
    let Ok(reads) = stream.try_clone() else { return };
    let drop_it = |why: String| tracing::warn!("dropped a connection from {peer} to the launchers' coordinator: {why}");
    let challenge = match random_hex(NONCE_BYTES) {
        Ok(c) => c,
        Err(e) => return drop_it(format!("no challenge for it ({e})")),
    };
    if let Err(e) = reply.write_all(
        line(&ToNode::Challenge {
            nonce: challenge.clone(),
        })
        .as_bytes(),
    ) {
        return drop_it(format!("it took no challenge ({e})"));
    }
    let mut lines = BufReader::new(stream);
    let hello = match read_line(&mut lines) {
        Ok(Some(l)) => match serde_json::from_str::<ToCoordinator>(&l) {
            Ok(ToCoordinator::Hello(h)) => h,
            _ => return drop_it("it did not open with a launcher's hello".into()),
        },
        Ok(None) => {
            return tracing::warn!(
                "a connection from {peer} to the launchers' coordinator closed without a launcher's hello"
            )
        }
        Err(e) => return drop_it(format!("no launcher's hello ({e})")),
    };
    let refuse = |mut reply: TcpStream, why: String| {
        tracing::warn!("refused a connection from {peer} to the launchers' coordinator: {why}");
        let _ = reply.write_all(line(&ToNode::Refused { why }).as_bytes());
    };
    if !proves(secret.reveal(), Side::Node, &challenge, &hello, &hello.proof) {
        return refuse(
            reply,
            format!(
                "its hello does not prove that it knows the run's secret ({TOKEN_VAR}, node 0's launcher's): give every \
                node's launcher the same one"
            ),
        );
    }
    // A launcher of this job: the coordinator decides.
    let welcome = prove(secret.reveal(), Side::Coordinator, &challenge, &hello);
    let ip = reads
        .peer_addr()
        .map_or_else(|_| "127.0.0.1".into(), |a| a.ip().to_string());
    let from = {
        let mut c = coordinator.lock().unwrap_or_else(|p| p.into_inner());
        let from = c.slot(hello.node, &ip);
        let mut w = writers.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = c.on(from, ToCoordinator::Hello(hello));
        if let Some(why) = out.iter().find_map(|(_, m)| match m {
            ToNode::Refused { why } => Some(why.clone()),
            _ => None,
        }) {
            return refuse(reply, why);
        }
        for (to, m) in &mut out {
            if let (To::Node(n), ToNode::Welcome { proof }) = (*to, m) {
                if n == from {
                    proof.clone_from(&welcome);
                }
            }
        }
        // Admitted: from now on it may be quiet for as long as the run lasts.
        if reads.set_read_timeout(None).is_err() {
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
        let mut c = coordinator.lock().unwrap_or_else(|p| p.into_inner());
        let mut w = writers.lock().unwrap_or_else(|p| p.into_inner());
        let out = c.on(from, msg);
        deliver(&mut c, &mut w, out);
    }
    let mut c = coordinator.lock().unwrap_or_else(|p| p.into_inner());
    let mut w = writers.lock().unwrap_or_else(|p| p.into_inner());
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
    use super::super::super::outcome::Report;
    use super::super::protocol::MAX_LINE;
    use super::*;
    use std::io::Read;

    const SECRET: &str = "the-secret-0123456789";

    fn hello(node: usize, micro: Option<usize>) -> ToCoordinator {
        ToCoordinator::Hello(hello_of(node, micro))
    }
    fn hello_of(node: usize, micro: Option<usize>) -> Hello {
        Hello {
            id: "job".into(),
            node,
            micro,
            port: 0,
            nonce: String::new(),
            proof: String::new(),
        }
    }
    fn report(rank: usize, oom: bool, micro: Option<usize>) -> Report {
        Report {
            rank,
            oom,
            micro,
            code: 1,
        }
    }

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
        let c = coordinate(listener, Coordinator::new(2, 3, "job"), Token::new(SECRET.into()));
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
        let c = coordinate(listener, Coordinator::new(2, 0, "job"), Token::new(SECRET.into()));
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
}
