//! Owns the group's sockets and threads: node 0's listener and one thread per connection,
//! each admitted node's outbox (a writer thread), the clock's thread, and a node's connection
//! to the coordinator (its reader and, elastic, its heartbeat).
//! Keeps: a connection that is not an admitted node's launcher (garbage, another run's id, a
//! missing or wrong user-given token) is refused, logged with its address, and changes
//! nothing; no node's socket ever holds the coordinator's locks.
use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::elastic::{self, Elastic};
use super::super::{LaunchError as Error, LaunchSpec};
use super::coordinator::{Coordinator, To};
use super::protocol::{line, read_line, ToCoordinator, ToNode};
use super::{Group, Link, JOIN_TIMEOUT};
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

/// Node 0 starts the coordinator; every node (node 0 too) connects to it. Elastic, the
/// coordinator is at the rendezvous endpoint (--rdzv-endpoint), hosted by the launcher that
/// can listen there first, as torchrun's c10d rendezvous hosts its store.
pub(super) fn connect(spec: &LaunchSpec, signals: &Signals) -> Result<Group, Error> {
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
    let join_timeout = spec.elastic.map_or(JOIN_TIMEOUT, |e| e.join_timeout);
    let t = Instant::now();
    let stream = loop {
        let reached = (addr.to_socket_addrs().ok())
            .and_then(|mut a| a.find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok()));
        if let Some(s) = reached {
            break s;
        }
        interrupted(signals)?;
        if t.elapsed() > join_timeout {
            return Err(Error::Start(format!(
                "cannot reach node 0's launcher at {}:{port} within {} s",
                spec.master_addr,
                join_timeout.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
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
    match spec.elastic {
        Some(e) => tracing::info!(
            "joined the elastic rendezvous ({}:{} nodes) at {}:{port}{}",
            e.min,
            e.max,
            spec.master_addr,
            if server.is_some() {
                ", which this launcher hosts"
            } else {
                ""
            }
        ),
        None => tracing::info!(
            "node {} of {}: joined the launchers' coordinator at {}:{port}",
            spec.node_rank,
            spec.nnodes,
            spec.master_addr
        ),
    }
    Ok(Group {
        node: spec.node_rank,
        link: Link::Remote {
            stream: Arc::new(Mutex::new(stream)),
            inbox: rx,
            server,
            gone: false,
        },
        join_timeout,
        signals: signals.clone(),
    })
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
    let c = Coordinator::elastic(
        e,
        spec.max_restarts,
        &spec.run_id,
        spec.token.reveal(),
        spec.token_given,
    );
    Some(coordinate(listener, c))
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
                let c = Coordinator::new(
                    spec.nnodes,
                    spec.max_restarts,
                    &spec.run_id,
                    spec.token.reveal(),
                    spec.token_given,
                );
                return Ok(coordinate(l, c));
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

/// Runs `coordinator` for the connections `listener` accepts, each on its own thread.
fn coordinate(listener: TcpListener, coordinator: Coordinator) -> Arc<Mutex<Coordinator>> {
    let coordinator = Arc::new(Mutex::new(coordinator));
    let writers: Arc<Mutex<BTreeMap<usize, Outbox>>> = Arc::default();
    let c = Arc::clone(&coordinator);
    let w = Arc::clone(&writers);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let (c, writers) = (Arc::clone(&c), Arc::clone(&w));
            std::thread::spawn(move || serve_node(stream, &c, &writers));
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

/// Serves one connection. Until it is an admitted node's launcher it changes nothing: a
/// stranger (silent for HELLO_WAIT, garbage, refused) is dropped with a warning naming its
/// address, and the run goes on.
fn serve_node(stream: TcpStream, coordinator: &Mutex<Coordinator>, writers: &Mutex<BTreeMap<usize, Outbox>>) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    stream.set_nodelay(true).ok();
    // A refusal is written here, once, into an empty socket: it cannot block for longer.
    if stream.set_write_timeout(Some(WRITE_WAIT)).is_err() || stream.set_read_timeout(Some(HELLO_WAIT)).is_err() {
        return;
    }
    let Ok(mut reply) = stream.try_clone() else { return };
    let Ok(reads) = stream.try_clone() else { return };
    let mut node = None;
    let mut lines = BufReader::new(stream);
    loop {
        let msg = match read_line(&mut lines) {
            Ok(Some(l)) => serde_json::from_str::<ToCoordinator>(&l).ok(),
            Ok(None) => {
                if node.is_none() {
                    tracing::warn!(
                        "a connection from {peer} to the launchers' coordinator closed without a launcher's hello"
                    );
                }
                break;
            }
            Err(e) => {
                if node.is_none() {
                    tracing::warn!(
                        "dropped a connection from {peer} to the launchers' coordinator: no launcher's hello ({e})"
                    );
                }
                break;
            }
        };
        let from = match (&msg, node) {
            (Some(_), Some(n)) => n,
            (Some(ToCoordinator::Hello { node: n, .. }), None) => {
                let ip = reads
                    .peer_addr()
                    .map_or_else(|_| "127.0.0.1".into(), |a| a.ip().to_string());
                coordinator.lock().unwrap_or_else(|p| p.into_inner()).slot(*n, &ip)
            }
            (_, None) => {
                tracing::warn!(
                    "dropped a connection from {peer} to the launchers' coordinator: it did not open with a launcher's hello"
                );
                return;
            }
            (None, Some(_)) => break, // garbage from an admitted node: it is gone
        };
        let Some(msg) = msg else { break };
        let mut c = coordinator.lock().unwrap_or_else(|p| p.into_inner());
        let mut w = writers.lock().unwrap_or_else(|p| p.into_inner());
        let out = c.on(from, msg);
        if node.is_none() {
            if let Some(why) = out.iter().find_map(|(_, m)| match m {
                ToNode::Refused { why } => Some(why),
                _ => None,
            }) {
                tracing::warn!("refused a connection from {peer} to the launchers' coordinator: {why}");
                let _ = out.iter().try_for_each(|(_, m)| reply.write_all(line(m).as_bytes()));
                return;
            }
            // Admitted: from now on it may be quiet for as long as the run lasts.
            if reads.set_read_timeout(None).is_err() {
                tracing::warn!("node {from}'s launcher at {peer}: cannot wait on its connection");
            }
            node = Some(from);
            if let Ok(o) = reply.try_clone().and_then(Outbox::new) {
                w.insert(from, o);
            }
        }
        deliver(&mut c, &mut w, out);
    }
    if let Some(n) = node {
        let mut c = coordinator.lock().unwrap_or_else(|p| p.into_inner());
        let mut w = writers.lock().unwrap_or_else(|p| p.into_inner());
        w.remove(&n);
        let out = c.gone(n);
        deliver(&mut c, &mut w, out);
    }
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

    fn hello(node: usize, micro: Option<usize>) -> ToCoordinator {
        ToCoordinator::Hello {
            id: "job".into(),
            node,
            micro,
            token: None,
            port: 0,
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

    /// A node that says hello and then stops reading, while it makes the coordinator answer it
    /// again and again: the answers back up (the old coordinator blocked writing them, holding
    /// its locks, and froze). It counts as lost, and the other node hears that the group
    /// stopped, naming it, within WRITE_WAIT and a margin.
    #[test]
    fn a_node_that_stops_reading_is_lost_and_the_others_hear_it() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let c = coordinate(listener, Coordinator::new(2, 3, "job", "tok", false));
        let mut good = TcpStream::connect(("127.0.0.1", port)).unwrap();
        good.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        good.write_all(line(&hello(0, None)).as_bytes()).unwrap();
        let mut stuck = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stuck.write_all(line(&hello(1, None)).as_bytes()).unwrap();
        let mut replies = BufReader::new(good.try_clone().unwrap()).lines();
        let welcome = replies.next().unwrap().unwrap();
        assert!(
            matches!(serde_json::from_str(&welcome).unwrap(), ToNode::Welcome { ref token } if token == "tok"),
            "{welcome}"
        );
        let first = replies.next().unwrap().unwrap();
        assert!(
            matches!(serde_json::from_str(&first).unwrap(), ToNode::Go { round: 0, .. }),
            "{first}"
        );
        // Node 1 says hello again and again (each answered with a refusal) and reads nothing,
        // until its own writes block: the coordinator has stopped reading it, stuck writing.
        let (wedged, wedge) = mpsc::channel();
        let again = line(&hello(1, None)).repeat(100);
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
        good.write_all(
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
    /// silent, one says hello with another run's id, one with a line longer than MAX_LINE.
    /// Each is dropped or refused (the refused one hears why, and not the token); the two real
    /// nodes still join, get the token and the go, and finish.
    #[test]
    fn strangers_are_refused_and_the_run_goes_on() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let c = coordinate(listener, Coordinator::new(2, 0, "job", "the-token-0123456789", false));
        let connect = || {
            let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            s
        };
        let mut garbage = connect();
        garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let _silent = connect();
        let mut long = connect();
        long.write_all(&vec![b'x'; MAX_LINE as usize + 10]).unwrap();
        let mut other = connect();
        let stranger = ToCoordinator::Hello {
            id: "other".into(),
            node: 1,
            micro: None,
            token: None,
            port: 0,
        };
        other.write_all(line(&stranger).as_bytes()).unwrap();
        let mut heard = String::new();
        other.read_to_string(&mut heard).unwrap();
        assert!(heard.contains("refused") && heard.contains("--rdzv-id"), "{heard}");
        assert!(!heard.contains("the-token"), "a stranger heard the token: {heard}");
        let mut rest = String::new();
        assert_eq!(
            garbage.read_to_string(&mut rest).unwrap(),
            0,
            "garbage got an answer: {rest}"
        );
        let nodes = [0, 1].map(|n| {
            let mut s = connect();
            s.write_all(line(&hello(n, None)).as_bytes()).unwrap();
            s
        });
        for s in &nodes {
            let mut replies = BufReader::new(s.try_clone().unwrap()).lines();
            let got: Vec<ToNode> = (0..2)
                .map(|_| serde_json::from_str(&replies.next().unwrap().unwrap()).unwrap())
                .collect();
            assert!(
                matches!(&got[..], [ToNode::Welcome { token }, ToNode::Go { round: 0, .. }] if token == "the-token-0123456789"),
                "{got:?}"
            );
        }
        for mut s in nodes {
            s.write_all(line(&ToCoordinator::Done).as_bytes()).unwrap();
        }
        let t = Instant::now();
        while !c.lock().is_ok_and(|c| c.settled()) {
            assert!(t.elapsed() < Duration::from_secs(20), "the run did not finish");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
