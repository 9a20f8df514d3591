//! Owns restarts that are group-wide across nodes: node 0's launcher keeps the group's round.
//! Keeps: a failure on any node ends the round on every node, and every node starts the next
//! attempt with the same micro-batch; `Coordinator::on` decides, purely.
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::outcome::{after_failure, Next, Report};
use super::{LaunchError as Error, LaunchSpec, Micro};

/// How long a launcher waits for every node's launcher to join, and node 0's launcher, its
/// own workers done, for the other nodes' to finish (torchrun's join timeout and exit barrier).
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);
const EXIT_BARRIER: Duration = Duration::from_secs(300);
/// How long node 0's launcher waits for a node's launcher to take a message: one that stops
/// reading (its socket's buffers full) counts as lost, and cannot freeze the coordinator.
const WRITE_WAIT: Duration = Duration::from_secs(5);
/// Messages a node's launcher may be behind before it counts as lost (a few a round are sent).
const OUTBOX: usize = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ToCoordinator {
    Hello {
        token: String,
        node: usize,
        micro: Option<usize>,
    },
    Failed {
        round: u32,
        report: Report,
    },
    Stopped {
        round: u32,
    },
    Done,
    Abort {
        code: i32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ToNode {
    /// Start attempt `round` with this micro-batch.
    Go {
        round: u32,
        size: Option<usize>,
        failed: Option<usize>,
    },
    /// Round `round` has begun: stop the workers, then say `Stopped`.
    Restart {
        round: u32,
        why: String,
    },
    /// The job is over: stop the workers and exit with `code`.
    Stop {
        code: i32,
        why: String,
    },
    Refused {
        why: String,
    },
}

#[derive(Debug)]
enum Phase {
    Joining,
    Running,
    /// Waiting for every node to stop its workers before `round` starts.
    Stopping {
        round: u32,
        stopped: BTreeSet<usize>,
        report: Report,
        node: usize,
    },
    Ended,
}

/// Node 0's record of the group: who joined, the round, and what failed.
#[derive(Debug)]
pub struct Coordinator {
    nnodes: usize,
    max_restarts: u32,
    token: String,
    round: u32,
    micro: Micro,
    joined: BTreeSet<usize>,
    done: BTreeSet<usize>,
    phase: Phase,
}

/// Who a reply goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum To {
    All,
    Node(usize),
}

impl Coordinator {
    pub fn new(nnodes: usize, max_restarts: u32, token: &str) -> Coordinator {
        Coordinator {
            nnodes,
            max_restarts,
            token: token.into(),
            round: 0,
            micro: Micro::default(),
            joined: BTreeSet::new(),
            done: BTreeSet::new(),
            phase: Phase::Joining,
        }
    }

    /// Whether node 0's launcher may exit: the job ended, or every node finished or left.
    pub fn settled(&self) -> bool {
        matches!(self.phase, Phase::Ended) || self.done.len() == self.nnodes
    }

    pub fn on(&mut self, node: usize, msg: ToCoordinator) -> Vec<(To, ToNode)> {
        match msg {
            ToCoordinator::Hello { token, node, micro } => self.hello(&token, node, micro),
            ToCoordinator::Failed { round, report } => self.failed(node, round, report),
            ToCoordinator::Stopped { round } => self.stopped(node, round),
            ToCoordinator::Done => {
                self.done.insert(node);
                vec![]
            }
            ToCoordinator::Abort { code } => self.end(code, format!("node {node}'s launcher was stopped by a signal")),
        }
    }

    /// A node's connection closed: unless it had finished, the group cannot go on.
    pub fn gone(&mut self, node: usize) -> Vec<(To, ToNode)> {
        if self.done.contains(&node) || matches!(self.phase, Phase::Ended) {
            return vec![];
        }
        self.end(1, format!("node {node}'s launcher is gone"))
    }

    fn end(&mut self, code: i32, why: String) -> Vec<(To, ToNode)> {
        if matches!(self.phase, Phase::Ended) {
            return vec![];
        }
        self.phase = Phase::Ended;
        vec![(To::All, ToNode::Stop { code, why })]
    }

    fn hello(&mut self, token: &str, node: usize, micro: Option<usize>) -> Vec<(To, ToNode)> {
        let refuse = |why: String| vec![(To::Node(node), ToNode::Refused { why })];
        if token != self.token {
            return refuse(format!(
                "this is run `{}`, not `{token}`: give every node's launcher the same --rdzv-id",
                self.token
            ));
        }
        if node >= self.nnodes || self.joined.contains(&node) || !matches!(self.phase, Phase::Joining) {
            return refuse(format!(
                "node rank {node} has already joined, or is not below --nnodes {}",
                self.nnodes
            ));
        }
        self.joined.insert(node);
        self.micro.size = match (self.micro.size, micro) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if self.joined.len() < self.nnodes {
            return vec![];
        }
        self.phase = Phase::Running;
        vec![(To::All, self.go())]
    }

    fn go(&self) -> ToNode {
        ToNode::Go {
            round: self.round,
            size: self.micro.size,
            failed: self.micro.failed,
        }
    }

    fn failed(&mut self, node: usize, round: u32, report: Report) -> Vec<(To, ToNode)> {
        if round != self.round {
            return vec![]; // a failure of an attempt already replaced
        }
        match &mut self.phase {
            Phase::Running => {
                let why = format!(
                    "worker rank {} on node {node} failed (exit code {}){}",
                    report.rank,
                    report.code,
                    if report.oom { " out of memory" } else { "" }
                );
                self.phase = Phase::Stopping {
                    round: round + 1,
                    stopped: BTreeSet::new(),
                    report,
                    node,
                };
                vec![(To::All, ToNode::Restart { round: round + 1, why })]
            }
            // Other nodes' workers fail in turn when their peers go: an OOM anywhere counts.
            Phase::Stopping { report: first, .. } => {
                first.oom |= report.oom;
                first.micro = match (first.micro, report.micro) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                vec![]
            }
            _ => vec![],
        }
    }

    fn stopped(&mut self, node: usize, round: u32) -> Vec<(To, ToNode)> {
        let Phase::Stopping {
            round: next,
            stopped,
            report,
            node: failed_node,
        } = &mut self.phase
        else {
            return vec![];
        };
        if round != *next {
            return vec![];
        }
        stopped.insert(node);
        if stopped.len() < self.nnodes {
            return vec![];
        }
        let (report, failed_node) = (report.clone(), *failed_node);
        match after_failure(self.round, self.max_restarts, report.ended(), report.micro) {
            Next::Restart { micro_batch_size } => {
                self.micro = Micro { size: micro_batch_size, failed: if report.oom { report.micro } else { self.micro.failed } };
                self.round += 1;
                self.phase = Phase::Running;
                vec![(To::All, self.go())]
            }
            Next::GiveUp if report.code == 3 => self.end(
                3,
                format!("worker rank {} on node {failed_node} exited 3: it does not fit in memory even at micro-batch 1, so no restart can help", report.rank),
            ),
            Next::GiveUp => self.end(
                report.code,
                format!("worker rank {} on node {failed_node} failed (exit code {}); no restarts left (--max-restarts \
                    {})", report.rank, report.code, self.max_restarts),
            ),
        }
    }
}

/// One launcher's end of the group: node 0's coordinator in-process on a single node, or a
/// connection to it.
pub struct Group {
    node: usize,
    link: Link,
}

enum Link {
    Local {
        coordinator: Coordinator,
        inbox: VecDeque<ToNode>,
    },
    Remote {
        stream: TcpStream,
        inbox: Receiver<Option<ToNode>>,
        server: Option<Arc<Mutex<Coordinator>>>,
        gone: bool,
    },
}

impl Group {
    /// Joins the group and waits for the first attempt's go.
    pub fn join(spec: &LaunchSpec) -> Result<(Group, Micro), Error> {
        let hello = ToCoordinator::Hello {
            token: spec.token.clone(),
            node: spec.node_rank,
            micro: spec.micro_batch_size,
        };
        let mut group = if spec.nnodes == 1 {
            let link = Link::Local {
                coordinator: Coordinator::new(1, spec.max_restarts, &spec.token),
                inbox: VecDeque::new(),
            };
            Group { node: 0, link }
        } else {
            connect(spec)?
        };
        group.send(hello);
        match group.recv(Some(JOIN_TIMEOUT)) {
            Some(ToNode::Go { round: 0, size, failed }) => Ok((group, Micro { size, failed })),
            Some(ToNode::Refused { why }) => Err(Error::Start(format!("node 0's launcher refused this node: {why}"))),
            Some(ToNode::Stop { why, .. }) => Err(Error::Start(format!("the group stopped before it started: {why}"))),
            _ => Err(Error::Start(format!(
                "not every node's launcher joined within {} s (--nnodes {})",
                JOIN_TIMEOUT.as_secs(),
                spec.nnodes
            ))),
        }
    }

    fn send(&mut self, msg: ToCoordinator) {
        match &mut self.link {
            Link::Local { coordinator, inbox } => inbox.extend(coordinator.on(0, msg).into_iter().map(|(_, m)| m)),
            Link::Remote { stream, .. } => {
                // A coordinator that is gone shows up on the next receive.
                let _ = writeln!(stream, "{}", serde_json::to_string(&msg).unwrap_or_default());
            }
        }
    }

    /// The next message, waiting at most `wait` (None: not at all). After node 0's launcher
    /// is gone, nothing comes: the workers' own fate decides the outcome.
    fn recv(&mut self, wait: Option<Duration>) -> Option<ToNode> {
        match &mut self.link {
            Link::Local { inbox, .. } => inbox.pop_front(),
            Link::Remote { gone: true, .. } => None,
            Link::Remote { inbox, gone, .. } => {
                let got = match wait {
                    None => inbox.try_recv().ok(),
                    Some(w) => match inbox.recv_timeout(w) {
                        Ok(m) => Some(m),
                        Err(RecvTimeoutError::Timeout) => return None,
                        Err(RecvTimeoutError::Disconnected) => Some(None),
                    },
                };
                match got {
                    Some(Some(m)) => Some(m),
                    Some(None) => {
                        *gone = true;
                        tracing::warn!("node 0's launcher is gone: this node can no longer restart with the group");
                        None
                    }
                    None => None,
                }
            }
        }
    }

    /// A restart or stop that arrived while the workers run.
    pub fn poll(&mut self) -> Option<ToNode> {
        self.recv(None)
    }

    /// After this node's workers failed and were stopped: the next attempt's micro-batch, or
    /// the code to exit with and why.
    pub fn failed(&mut self, round: u32, report: Report) -> Result<Micro, (i32, String)> {
        let code = report.code;
        self.send(ToCoordinator::Failed { round, report });
        loop {
            match self.recv(Some(JOIN_TIMEOUT)) {
                Some(ToNode::Restart { round: next, .. }) if next > round => return self.stopped(next),
                Some(ToNode::Stop { code, why }) => return Err((code, why)),
                Some(_) => continue,
                None => return Err((code, "node 0's launcher did not answer".into())),
            }
        }
    }

    /// This node's workers are stopped for round `round`: wait until every node's are.
    pub fn stopped(&mut self, round: u32) -> Result<Micro, (i32, String)> {
        self.send(ToCoordinator::Stopped { round });
        loop {
            match self.recv(Some(JOIN_TIMEOUT)) {
                Some(ToNode::Go { round: r, size, failed }) if r == round => return Ok(Micro { size, failed }),
                Some(ToNode::Stop { code, why }) => return Err((code, why)),
                Some(_) => continue,
                None => return Err((1, format!("the group did not start round {round}"))),
            }
        }
    }

    pub fn abort(&mut self, code: i32) {
        self.send(ToCoordinator::Abort { code });
    }

    /// This node's workers all succeeded. Node 0's launcher hosts the coordinator, so it stays
    /// until every node has finished (or the job ended), at most EXIT_BARRIER.
    pub fn done(&mut self) {
        self.send(ToCoordinator::Done);
        if let Link::Remote { server: Some(c), .. } = &self.link {
            let t = Instant::now();
            while t.elapsed() < EXIT_BARRIER && !c.lock().is_ok_and(|c| c.settled()) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    pub fn node(&self) -> usize {
        self.node
    }
}

fn io(context: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { context, source }
}

/// Node 0 starts the coordinator; every node (node 0 too) connects to it.
fn connect(spec: &LaunchSpec) -> Result<Group, Error> {
    let port = spec.master_port.checked_add(1).ok_or_else(|| {
        Error::Start(
            "--master-port 65535 leaves no port for the launchers' coordinator (it uses --master-port + 1)".into(),
        )
    })?;
    let addr = (spec.master_addr.as_str(), port);
    let server = if spec.node_rank == 0 {
        Some(serve(spec, addr)?)
    } else {
        None
    };
    let t = Instant::now();
    let stream = loop {
        match addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok()))
        {
            Some(s) => break s,
            None if t.elapsed() > JOIN_TIMEOUT => {
                return Err(Error::Start(format!(
                    "cannot reach node 0's launcher at {}:{port} within {} s",
                    spec.master_addr,
                    JOIN_TIMEOUT.as_secs()
                )))
            }
            None => std::thread::sleep(Duration::from_millis(200)),
        }
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
    tracing::info!(
        "node {} of {}: joined the launchers' coordinator at {}:{port}",
        spec.node_rank,
        spec.nnodes,
        spec.master_addr
    );
    Ok(Group {
        node: spec.node_rank,
        link: Link::Remote {
            stream,
            inbox: rx,
            server,
            gone: false,
        },
    })
}

/// The coordinator's listener: on the interface of --master-addr (every interface when that
/// address is not this host's), one thread per node's connection.
fn serve(spec: &LaunchSpec, addr: (&str, u16)) -> Result<Arc<Mutex<Coordinator>>, Error> {
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
            tracing::warn!(
                "{} is not an address of this host: the launchers' coordinator listens on every interface, port {}",
                addr.0,
                addr.1
            );
            TcpListener::bind(("0.0.0.0", addr.1)).map_err(io(format!(
                "listening on port {} for the other nodes' launchers",
                addr.1
            )))?
        }
        Err(e) => {
            return Err(io(format!(
                "listening on {}:{} for the other nodes' launchers (it is --master-port + 1)",
                addr.0, addr.1
            ))(e))
        }
    };
    Ok(coordinate(
        listener,
        Coordinator::new(spec.nnodes, spec.max_restarts, &spec.token),
    ))
}

/// Runs `coordinator` for the connections `listener` accepts, each on its own thread.
fn coordinate(listener: TcpListener, coordinator: Coordinator) -> Arc<Mutex<Coordinator>> {
    let coordinator = Arc::new(Mutex::new(coordinator));
    let writers: Arc<Mutex<BTreeMap<usize, Outbox>>> = Arc::default();
    let c = Arc::clone(&coordinator);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let (c, writers) = (Arc::clone(&c), Arc::clone(&writers));
            std::thread::spawn(move || serve_node(stream, &c, &writers));
        }
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

fn serve_node(stream: TcpStream, coordinator: &Mutex<Coordinator>, writers: &Mutex<BTreeMap<usize, Outbox>>) {
    stream.set_nodelay(true).ok();
    // A refusal is written here, once, into an empty socket: it cannot block for longer.
    if stream.set_write_timeout(Some(WRITE_WAIT)).is_err() {
        return;
    }
    let Ok(mut reply) = stream.try_clone() else { return };
    let mut node = None;
    for line in BufReader::new(stream).lines() {
        let Ok(msg) = line
            .map_err(drop)
            .and_then(|l| serde_json::from_str::<ToCoordinator>(&l).map_err(drop))
        else {
            break;
        };
        let mut c = coordinator.lock().unwrap_or_else(|p| p.into_inner());
        let mut w = writers.lock().unwrap_or_else(|p| p.into_inner());
        let from = match (&msg, node) {
            (_, Some(n)) => n,
            (ToCoordinator::Hello { node: n, .. }, None) => *n,
            (_, None) => break, // a connection must say hello first
        };
        let out = c.on(from, msg);
        if node.is_none() {
            if out.iter().any(|(_, m)| matches!(m, ToNode::Refused { .. })) {
                let _ = out
                    .iter()
                    .try_for_each(|(_, m)| writeln!(reply, "{}", serde_json::to_string(m).unwrap_or_default()));
                return;
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
        let line = format!("{}\n", serde_json::to_string(&msg).unwrap_or_default());
        let mut lost = vec![];
        for (n, w) in writers.iter() {
            if (to == To::All || to == To::Node(*n)) && w.queue.try_send(line.clone()).is_err() {
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
    use super::*;

    fn hello(node: usize, micro: Option<usize>) -> ToCoordinator {
        ToCoordinator::Hello {
            token: "job".into(),
            node,
            micro,
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

    #[test]
    fn every_node_joins_before_the_first_go_at_the_smallest_micro_batch() {
        let mut c = Coordinator::new(2, 3, "job");
        assert_eq!(c.on(0, hello(0, Some(8))), vec![]);
        assert!(
            matches!(
                c.on(
                    1,
                    ToCoordinator::Hello {
                        token: "other".into(),
                        node: 1,
                        micro: None
                    }
                )[0],
                (To::Node(1), ToNode::Refused { .. })
            ),
            "another run"
        );
        assert!(
            matches!(c.on(0, hello(0, None))[0].1, ToNode::Refused { .. }),
            "a node rank joins once"
        );
        assert_eq!(
            c.on(1, hello(1, Some(4))),
            vec![(
                To::All,
                ToNode::Go {
                    round: 0,
                    size: Some(4),
                    failed: None
                }
            )]
        );
    }

    #[test]
    fn a_failure_on_one_node_restarts_every_node_once_they_all_stopped() {
        let mut c = Coordinator::new(2, 3, "job");
        c.on(0, hello(0, Some(8)));
        c.on(1, hello(1, Some(8)));
        let out = c.on(
            1,
            ToCoordinator::Failed {
                round: 0,
                report: report(3, true, Some(8)),
            },
        );
        assert!(
            matches!(&out[..], [(To::All, ToNode::Restart { round: 1, why })] if why.contains("rank 3 on node 1") && why.contains("out of memory"))
        );
        // Node 0's workers fail in turn (their peer is gone): the same round, merged.
        assert_eq!(
            c.on(
                0,
                ToCoordinator::Failed {
                    round: 0,
                    report: report(0, false, Some(8))
                }
            ),
            vec![]
        );
        assert_eq!(c.on(0, ToCoordinator::Stopped { round: 1 }), vec![]);
        assert_eq!(
            c.on(0, ToCoordinator::Stopped { round: 1 }),
            vec![],
            "a node counts once"
        );
        assert_eq!(
            c.on(1, ToCoordinator::Stopped { round: 1 }),
            vec![(
                To::All,
                ToNode::Go {
                    round: 1,
                    size: Some(4),
                    failed: Some(8)
                }
            )]
        );
        // A late report of the replaced attempt changes nothing.
        assert_eq!(
            c.on(
                0,
                ToCoordinator::Failed {
                    round: 0,
                    report: report(0, true, Some(2))
                }
            ),
            vec![]
        );
    }

    #[test]
    fn an_oom_reported_second_still_halves_the_micro_batch() {
        let mut c = Coordinator::new(2, 3, "job");
        c.on(0, hello(0, Some(8)));
        c.on(1, hello(1, None));
        c.on(
            0,
            ToCoordinator::Failed {
                round: 0,
                report: report(0, false, None),
            },
        );
        c.on(
            1,
            ToCoordinator::Failed {
                round: 0,
                report: report(1, true, Some(8)),
            },
        );
        c.on(0, ToCoordinator::Stopped { round: 1 });
        assert_eq!(
            c.on(1, ToCoordinator::Stopped { round: 1 }),
            vec![(
                To::All,
                ToNode::Go {
                    round: 1,
                    size: Some(4),
                    failed: Some(8)
                }
            )]
        );
    }

    #[test]
    fn no_restarts_left_a_signal_or_a_lost_node_stops_every_node() {
        let mut c = Coordinator::new(2, 0, "job");
        c.on(0, hello(0, None));
        c.on(1, hello(1, None));
        c.on(
            1,
            ToCoordinator::Failed {
                round: 0,
                report: Report {
                    rank: 1,
                    oom: false,
                    micro: None,
                    code: 7,
                },
            },
        );
        c.on(0, ToCoordinator::Stopped { round: 1 });
        let out = c.on(1, ToCoordinator::Stopped { round: 1 });
        assert!(matches!(&out[..], [(To::All, ToNode::Stop { code: 7, why })] if why.contains("no restarts left")));
        assert!(c.settled());

        let mut c = Coordinator::new(2, 5, "job");
        c.on(0, hello(0, None));
        c.on(1, hello(1, None));
        assert!(matches!(
            &c.on(1, ToCoordinator::Abort { code: 130 })[..],
            [(To::All, ToNode::Stop { code: 130, .. })]
        ));
        assert_eq!(c.gone(1), vec![], "already ended");

        let mut c = Coordinator::new(2, 5, "job");
        c.on(0, hello(0, None));
        c.on(1, hello(1, None));
        c.on(1, ToCoordinator::Done);
        assert_eq!(c.gone(1), vec![], "a node that finished may leave");
        assert!(!c.settled());
        assert!(matches!(&c.gone(0)[..], [(To::All, ToNode::Stop { code: 1, why })] if why.contains("node 0")));
    }

    /// A node that says hello and then stops reading, while it makes the coordinator answer it
    /// again and again: the answers back up (the old coordinator blocked writing them, holding
    /// its locks, and froze). It counts as lost, and the other node hears that the group
    /// stopped, naming it, within WRITE_WAIT and a margin.
    #[test]
    fn a_node_that_stops_reading_is_lost_and_the_others_hear_it() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let c = coordinate(listener, Coordinator::new(2, 3, "job"));
        let line = |m: &ToCoordinator| format!("{}\n", serde_json::to_string(m).unwrap());
        let mut good = TcpStream::connect(("127.0.0.1", port)).unwrap();
        good.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        good.write_all(line(&hello(0, None)).as_bytes()).unwrap();
        let mut stuck = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stuck.write_all(line(&hello(1, None)).as_bytes()).unwrap();
        let mut replies = BufReader::new(good.try_clone().unwrap()).lines();
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

    #[test]
    fn one_node_restarts_alone_in_process() {
        let mut c = Coordinator::new(1, 1, "job");
        assert_eq!(
            c.on(0, hello(0, Some(6))),
            vec![(
                To::All,
                ToNode::Go {
                    round: 0,
                    size: Some(6),
                    failed: None
                }
            )]
        );
        c.on(
            0,
            ToCoordinator::Failed {
                round: 0,
                report: report(0, true, Some(6)),
            },
        );
        assert_eq!(
            c.on(0, ToCoordinator::Stopped { round: 1 }),
            vec![(
                To::All,
                ToNode::Go {
                    round: 1,
                    size: Some(3),
                    failed: Some(6)
                }
            )]
        );
        c.on(
            0,
            ToCoordinator::Failed {
                round: 1,
                report: report(0, false, Some(3)),
            },
        );
        assert!(matches!(
            &c.on(0, ToCoordinator::Stopped { round: 2 })[..],
            [(To::All, ToNode::Stop { code: 1, .. })]
        ));
    }
}
