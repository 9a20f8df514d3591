//! Owns restarts that are group-wide across nodes: node 0's launcher keeps the group's round.
//! Keeps: a failure on any node ends the round on every node, and every node starts the next
//! attempt with the same micro-batch; `Coordinator::on` decides, purely. A connection that is
//! not an admitted node's launcher (garbage, another run's id, a missing or wrong user-given
//! token) is refused, logged with its address, and changes nothing; the run's token reaches
//! an admitted node only, and no message names it.
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::elastic::{self, Change, Elastic, Layout, Member};
use super::outcome::{after_failure, Next, Report};
use super::{LaunchError as Error, LaunchSpec, Micro};
use oomguard_host::proc::Signals;

/// How long a launcher waits for every node's launcher to join, and node 0's launcher, its
/// own workers done, for the other nodes' to finish (torchrun's join timeout and exit barrier).
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// How often a wait for the group looks for a signal to the launcher.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);
const EXIT_BARRIER: Duration = Duration::from_secs(300);
/// How long node 0's launcher waits for a node's launcher to take a message: one that stops
/// reading (its socket's buffers full) counts as lost, and cannot freeze the coordinator.
const WRITE_WAIT: Duration = Duration::from_secs(5);
/// Messages a node's launcher may be behind before it counts as lost (a few a round are sent).
const OUTBOX: usize = 256;
/// How long a new connection has to say hello: a launcher says it at once.
const HELLO_WAIT: Duration = Duration::from_secs(30);
/// The longest message line read: the protocol's are far shorter; longer is garbage.
const MAX_LINE: u64 = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ToCoordinator {
    /// A node's launcher joins: `id` its --rdzv-id (an identifier, not a secret); `token` the
    /// user-given token (OOMGUARD_RUN_TOKEN), if it has one.
    Hello {
        id: String,
        node: usize,
        micro: Option<usize>,
        #[serde(default)]
        token: Option<String>,
        /// A port free on this node's host, for its workers' store should it be node 0 of an
        /// elastic round.
        #[serde(default)]
        port: u16,
    },
    Failed {
        round: u32,
        report: Report,
    },
    Stopped {
        round: u32,
        /// As in the hello: a port free now, for an elastic round's store.
        #[serde(default)]
        port: u16,
    },
    Done,
    Abort {
        code: i32,
    },
    /// Elastic: this node's launcher is alive (every BEAT, from a thread of its own).
    Beat,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ToNode {
    /// This node is admitted: the run's token, for its workers (to this node only).
    Welcome {
        token: String,
    },
    /// Start attempt `round` with this micro-batch.
    Go {
        round: u32,
        size: Option<usize>,
        failed: Option<usize>,
        /// Elastic: this node's place in the round (static: the flags').
        #[serde(default)]
        layout: Option<Layout>,
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
        /// The failure that began it, if one did (a node lost or joined begins one too).
        report: Option<Report>,
        node: usize,
        /// Elastic: the membership changed during it (the cause and when it was seen).
        change: Option<(String, u64)>,
    },
    Ended,
}

/// Node 0's record of the group: who joined, the round, and what failed. Elastic
/// (`--nnodes MIN:MAX`), a node is a slot given at its hello, and node ranks are assigned
/// afresh at each round among the members (`elastic::ranks`).
#[derive(Debug)]
pub struct Coordinator {
    nnodes: usize,
    max_restarts: u32,
    /// The run's --rdzv-id: a node's hello must name it.
    id: String,
    /// The run's token, handed to each admitted node; also required of each when `given`.
    token: super::Token,
    given: bool,
    round: u32,
    /// Rounds begun by a failure (not by a membership change): what --max-restarts counts.
    restarts: u32,
    micro: Micro,
    joined: BTreeSet<usize>,
    done: BTreeSet<usize>,
    phase: Phase,
    elastic: Option<Elastic>,
    /// Elastic: each member's rank hint, address and offered port, by slot.
    members: BTreeMap<usize, Member>,
    /// Elastic: the addresses connections came from, by slot, until their hello.
    addrs: BTreeMap<usize, String>,
    next_slot: usize,
    /// When each node's launcher was last heard from (elastic: its beats).
    last_seen: BTreeMap<usize, Instant>,
    /// Elastic: when the first rendezvous stops waiting for more than MIN nodes.
    last_call_at: Option<Instant>,
    /// Nodes in the round now running (elastic: for the next change's record).
    nodes_in_round: usize,
}

/// Who a reply goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum To {
    All,
    Node(usize),
}

impl Coordinator {
    /// `given`: the token is the user's, so a node must present it to be admitted.
    pub fn new(nnodes: usize, max_restarts: u32, id: &str, token: &str, given: bool) -> Coordinator {
        Coordinator {
            nnodes,
            max_restarts,
            id: id.into(),
            token: super::Token::new(token.into()),
            given,
            round: 0,
            restarts: 0,
            micro: Micro::default(),
            joined: BTreeSet::new(),
            done: BTreeSet::new(),
            phase: Phase::Joining,
            elastic: None,
            members: BTreeMap::new(),
            addrs: BTreeMap::new(),
            next_slot: 0,
            last_seen: BTreeMap::new(),
            last_call_at: None,
            nodes_in_round: nnodes,
        }
    }

    /// An elastic job's coordinator: between `e.min` and `e.max` nodes.
    pub fn elastic(e: Elastic, max_restarts: u32, id: &str, token: &str, given: bool) -> Coordinator {
        Coordinator {
            elastic: Some(e),
            ..Coordinator::new(e.max, max_restarts, id, token, given)
        }
    }

    /// Whether node 0's launcher may exit: the job ended, or every node finished or left.
    pub fn settled(&self) -> bool {
        matches!(self.phase, Phase::Ended)
            || (!matches!(self.phase, Phase::Joining) && !self.joined.is_empty() && self.joined.is_subset(&self.done))
    }

    /// The slot a new connection's hello speaks for: static, the node rank it names; elastic,
    /// a new one (its node rank comes at each round). `addr`: where it connected from.
    pub fn slot(&mut self, named: usize, addr: &str) -> usize {
        if self.elastic.is_none() {
            return named;
        }
        self.next_slot += 1;
        self.addrs.insert(self.next_slot - 1, addr.to_string());
        self.next_slot - 1
    }

    pub fn on(&mut self, node: usize, msg: ToCoordinator) -> Vec<(To, ToNode)> {
        self.last_seen.insert(node, Instant::now());
        match msg {
            ToCoordinator::Beat => vec![],
            ToCoordinator::Hello {
                id,
                node: named,
                micro,
                token,
                port,
            } => self.hello(&id, token.as_deref(), node, named, micro, port),
            ToCoordinator::Failed { round, report } => self.failed(node, round, report),
            ToCoordinator::Stopped { round, port } => self.stopped(node, round, port),
            ToCoordinator::Done => {
                self.done.insert(node);
                vec![]
            }
            // Elastic, a node stopped by a signal (a preempted pod, a Ctrl-C there) leaves the
            // job, and the others go on as after any loss (below MIN they stop with its
            // code: a time limit's SIGTERM on every node ends the job 143); static, it stops
            // every node.
            ToCoordinator::Abort { code } if self.elastic.is_some() => {
                let why = format!(
                    "node {}'s launcher was stopped by a signal ({code})",
                    self.rank_of(node)
                );
                self.leave(node, why, code)
            }
            ToCoordinator::Abort { code } => self.end(code, format!("node {node}'s launcher was stopped by a signal")),
        }
    }

    /// Elastic: the members whose launchers sent nothing (not even a beat) for longer than
    /// the heartbeat's bound at `now`.
    pub fn silent(&self, now: Instant) -> Vec<usize> {
        let Some(e) = self.elastic else { return vec![] };
        (self.joined.iter())
            .filter(|n| !self.done.contains(n))
            .filter(|n| {
                self.last_seen
                    .get(n)
                    .is_some_and(|t| now.saturating_duration_since(*t) > e.silence)
            })
            .copied()
            .collect()
    }

    /// How long a member may be silent (elastic).
    pub fn silence(&self) -> Duration {
        self.elastic.map_or(Duration::MAX, |e| e.silence)
    }

    /// Elastic: the first rendezvous starts once MIN nodes joined and the last call for more
    /// is over (`now` past it).
    pub fn tick(&mut self, now: Instant) -> Vec<(To, ToNode)> {
        match (&self.phase, self.last_call_at) {
            (Phase::Joining, Some(at)) if now >= at => self.start(),
            _ => vec![],
        }
    }

    /// A node's connection closed: unless it had finished, the group cannot go on; elastic,
    /// it goes on without it while MIN nodes remain.
    pub fn gone(&mut self, node: usize) -> Vec<(To, ToNode)> {
        if self.done.contains(&node) || matches!(self.phase, Phase::Ended) {
            return vec![];
        }
        if self.elastic.is_none() {
            return self.end(1, format!("node {node}'s launcher is gone"));
        }
        let cause = format!("node {}'s launcher is gone", self.rank_of(node));
        self.leave(node, cause, 1)
    }

    /// Elastic: `node` is no longer a member, for `cause`: the job goes on without it while
    /// MIN nodes remain (a new round), and ends below, with `code`.
    fn leave(&mut self, node: usize, cause: String, code: i32) -> Vec<(To, ToNode)> {
        let Some(e) = self.elastic else { return vec![] };
        if !self.joined.contains(&node) || matches!(self.phase, Phase::Ended) {
            return vec![];
        }
        self.joined.remove(&node);
        self.members.remove(&node);
        let now = elastic::unix_ms();
        match &mut self.phase {
            Phase::Joining => {
                if self.joined.len() < e.min {
                    self.last_call_at = None;
                }
                vec![]
            }
            _ if self.joined.len() < e.min => self.end(
                code,
                format!(
                    "{cause}: {} node{} left, below --nnodes MIN {}",
                    self.joined.len(),
                    if self.joined.len() == 1 { "" } else { "s" },
                    e.min
                ),
            ),
            Phase::Running => {
                let round = self.round + 1;
                self.phase = Phase::Stopping {
                    round,
                    stopped: BTreeSet::new(),
                    report: None,
                    node,
                    change: Some((cause.clone(), now)),
                };
                vec![(To::All, ToNode::Restart { round, why: cause })]
            }
            Phase::Stopping { stopped, change, .. } => {
                stopped.remove(&node);
                change.get_or_insert((cause, now));
                self.next_round()
            }
            Phase::Ended => vec![],
        }
    }

    fn end(&mut self, code: i32, why: String) -> Vec<(To, ToNode)> {
        if matches!(self.phase, Phase::Ended) {
            return vec![];
        }
        self.phase = Phase::Ended;
        vec![(To::All, ToNode::Stop { code, why })]
    }

    /// Admits a node's launcher: the run's id, the user's token when there is one (never named
    /// in a refusal), a node rank not yet taken (elastic: room below MAX). The admitted node
    /// gets the run's token.
    fn hello(
        &mut self,
        id: &str,
        token: Option<&str>,
        node: usize,
        named: usize,
        micro: Option<usize>,
        port: u16,
    ) -> Vec<(To, ToNode)> {
        let refuse = |why: String| vec![(To::Node(node), ToNode::Refused { why })];
        if id != self.id {
            return refuse(format!(
                "this is run {:?}, not {id:?}: give every node's launcher the same --rdzv-id",
                self.id
            ));
        }
        if self.given && !token.is_some_and(|t| same_secret(t, self.token.reveal())) {
            return refuse(format!(
                "{} is set for node 0's launcher, and this node's launcher {}: give every node's launcher the same one",
                super::TOKEN_VAR,
                if token.is_some() { "has another" } else { "has none" }
            ));
        }
        if !self.given && token.is_some() {
            return refuse(format!(
                "{} is set for this node's launcher but not for node 0's: give every node's launcher the same one",
                super::TOKEN_VAR
            ));
        }
        if let Some(e) = self.elastic {
            if self.joined.len() >= e.max || matches!(self.phase, Phase::Ended) || self.joined.contains(&node) {
                return refuse(format!("the job has its --nnodes MAX of {} nodes", e.max));
            }
        } else if node >= self.nnodes || self.joined.contains(&node) || !matches!(self.phase, Phase::Joining) {
            return refuse(format!(
                "node rank {node} has already joined, or is not below --nnodes {}",
                self.nnodes
            ));
        }
        self.joined.insert(node);
        if matches!(self.phase, Phase::Joining) {
            self.micro.size = match (self.micro.size, micro) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        let welcome = (
            To::Node(node),
            ToNode::Welcome {
                token: self.token.reveal().to_string(),
            },
        );
        let Some(e) = self.elastic else {
            if self.joined.len() < self.nnodes {
                return vec![welcome];
            }
            self.phase = Phase::Running;
            return vec![welcome, (To::All, self.go(None))];
        };
        let addr = self.addrs.remove(&node).unwrap_or_else(|| "127.0.0.1".into());
        self.members.insert(node, Member { named, addr, port });
        let mut out = vec![welcome];
        let (why, at) = (
            format!("a node joined ({} of at most {})", self.joined.len(), e.max),
            elastic::unix_ms(),
        );
        if matches!(self.phase, Phase::Joining) {
            if self.joined.len() == e.max {
                out.extend(self.start());
            } else if self.joined.len() >= e.min && self.last_call_at.is_none() {
                self.last_call_at = Some(Instant::now() + e.last_call);
            }
        } else if matches!(self.phase, Phase::Running) {
            // A node joins a running job at the next step boundary: the others stop (their
            // workers checkpoint on SIGTERM) and every node starts the next round.
            let round = self.round + 1;
            let others: Vec<usize> = self.joined.iter().copied().filter(|&n| n != node).collect();
            self.phase = Phase::Stopping {
                round,
                stopped: BTreeSet::from([node]),
                report: None,
                node,
                change: Some((why.clone(), at)),
            };
            out.extend(others.into_iter().map(|n| {
                (
                    To::Node(n),
                    ToNode::Restart {
                        round,
                        why: why.clone(),
                    },
                )
            }));
        } else if let Phase::Stopping { stopped, change, .. } = &mut self.phase {
            stopped.insert(node);
            change.get_or_insert((why, at));
            out.extend(self.next_round());
        }
        out
    }

    /// Elastic: the first round starts with the nodes that joined.
    fn start(&mut self) -> Vec<(To, ToNode)> {
        self.phase = Phase::Running;
        self.last_call_at = None;
        self.nodes_in_round = self.joined.len();
        self.go_all(None)
    }

    /// The go of this round: one to all (static), or one to each node with its place.
    fn go_all(&self, change: Option<Change>) -> Vec<(To, ToNode)> {
        if self.elastic.is_none() {
            return vec![(To::All, self.go(None))];
        }
        elastic::layouts(&self.members, change)
            .into_iter()
            .map(|(n, l)| (To::Node(n), self.go(Some(l))))
            .collect()
    }

    fn go(&self, layout: Option<Layout>) -> ToNode {
        ToNode::Go {
            round: self.round,
            size: self.micro.size,
            failed: self.micro.failed,
            layout,
        }
    }

    /// A slot's node rank in the round now running (elastic), else the slot itself.
    fn rank_of(&self, node: usize) -> usize {
        match self.elastic {
            Some(_) => elastic::ranks(&self.members).get(&node).copied().unwrap_or(node),
            None => node,
        }
    }

    fn failed(&mut self, node: usize, round: u32, report: Report) -> Vec<(To, ToNode)> {
        if round != self.round {
            return vec![]; // a failure of an attempt already replaced
        }
        let shown = self.rank_of(node);
        match &mut self.phase {
            Phase::Running => {
                let why = format!(
                    "worker rank {} on node {shown} failed (exit code {}){}",
                    report.rank,
                    report.code,
                    if report.oom { " out of memory" } else { "" }
                );
                self.phase = Phase::Stopping {
                    round: round + 1,
                    stopped: BTreeSet::new(),
                    report: Some(report),
                    node: shown,
                    change: None,
                };
                vec![(To::All, ToNode::Restart { round: round + 1, why })]
            }
            // Other nodes' workers fail in turn when their peers go: an OOM anywhere counts.
            Phase::Stopping { report: first, .. } => {
                let Some(first) = first else {
                    *first = Some(report);
                    return vec![];
                };
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

    fn stopped(&mut self, node: usize, round: u32, port: u16) -> Vec<(To, ToNode)> {
        if let Some(m) = self.members.get_mut(&node) {
            if port != 0 {
                m.port = port;
            }
        }
        match &mut self.phase {
            Phase::Stopping {
                round: next, stopped, ..
            } if round == *next => {
                stopped.insert(node);
                self.next_round()
            }
            _ => vec![],
        }
    }

    /// Once every member has stopped: the next round, or the end. A round that saw the
    /// membership change is not a restart (--max-restarts does not count it), and its
    /// micro-batch is halved only after an OOM.
    fn next_round(&mut self) -> Vec<(To, ToNode)> {
        let Phase::Stopping {
            stopped,
            report,
            node: failed_node,
            change,
            ..
        } = &self.phase
        else {
            return vec![];
        };
        if !self.joined.is_subset(stopped) {
            return vec![];
        }
        let (report, failed_node, change) = (report.clone(), *failed_node, change.clone());
        let ended = report.as_ref().map_or(super::outcome::Ended::Other, Report::ended);
        let micro = report.as_ref().and_then(|r| r.micro);
        let done = if change.is_some() { 0 } else { self.restarts };
        let max = if change.is_some() { u32::MAX } else { self.max_restarts };
        match after_failure(done, max, ended, micro) {
            Next::Restart { micro_batch_size } => {
                let oom = report.as_ref().is_some_and(|r| r.oom);
                if report.is_some() || micro_batch_size.is_some() {
                    self.micro = Micro {
                        size: micro_batch_size.or(self.micro.size),
                        failed: if oom { micro } else { self.micro.failed },
                    };
                }
                self.round += 1;
                self.restarts += u32::from(change.is_none());
                self.phase = Phase::Running;
                let change = change.map(|(cause, detected_unix_ms)| Change {
                    old_nodes: self.nodes_in_round,
                    new_nodes: self.joined.len(),
                    cause,
                    detected_unix_ms,
                });
                self.nodes_in_round = self.joined.len();
                self.go_all(change)
            }
            Next::GiveUp => {
                let report = report.unwrap_or(Report {
                    rank: 0,
                    oom: false,
                    micro: None,
                    code: 1,
                });
                if report.code == 3 {
                    return self.end(
                        3,
                        format!("worker rank {} on node {failed_node} exited 3: it does not fit in memory even at micro-batch 1, so no \
                            restart can help", report.rank),
                    );
                }
                self.end(
                    report.code,
                    format!(
                        "worker rank {} on node {failed_node} failed (exit code {}); no restarts left (--max-restarts \
                    {})",
                        report.rank, report.code, self.max_restarts
                    ),
                )
            }
        }
    }
}

/// Whether `a` and `b` are equal, in a time that does not tell how much of them matches.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// One launcher's end of the group: node 0's coordinator in-process on a single node, or a
/// connection to it.
pub struct Group {
    node: usize,
    link: Link,
    /// How long to wait to be admitted and for a round to start.
    join_timeout: Duration,
    /// This launcher's signals: every wait for the group ends when one arrives.
    signals: Signals,
}

/// What an attempt starts with: its round, micro-batch and (elastic) this node's place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub round: u32,
    pub micro: Micro,
    pub layout: Option<Layout>,
}

enum Link {
    Local {
        coordinator: Box<Coordinator>,
        inbox: VecDeque<ToNode>,
    },
    Remote {
        /// Shared with the heartbeat's thread: one line at a time.
        stream: Arc<Mutex<TcpStream>>,
        inbox: Receiver<Option<ToNode>>,
        server: Option<Arc<Mutex<Coordinator>>>,
        gone: bool,
    },
}

impl Group {
    /// Joins the group and waits for the first attempt's go; returns the run's token too (node
    /// 0's, handed over when it admitted this node).
    pub fn join(spec: &LaunchSpec, signals: &Signals) -> Result<(Group, Start, String), Error> {
        let hello = ToCoordinator::Hello {
            id: spec.run_id.clone(),
            node: match spec.elastic {
                Some(_) => spec.named_rank.unwrap_or(usize::MAX),
                None => spec.node_rank,
            },
            micro: spec.micro_batch_size,
            token: spec.token_given.then(|| spec.token.reveal().to_string()),
            port: offer_port(spec),
        };
        let join_timeout = spec.elastic.map_or(JOIN_TIMEOUT, |e| e.join_timeout);
        let mut group = if spec.nnodes == 1 && spec.elastic.is_none() {
            let link = Link::Local {
                coordinator: Box::new(Coordinator::new(
                    1,
                    spec.max_restarts,
                    &spec.run_id,
                    spec.token.reveal(),
                    spec.token_given,
                )),
                inbox: VecDeque::new(),
            };
            Group {
                node: 0,
                link,
                join_timeout,
                signals: signals.clone(),
            }
        } else {
            connect(spec, signals)?
        };
        group.send(hello);
        if let (Some(_), Link::Remote { stream, .. }) = (spec.elastic, &group.link) {
            beat(Arc::clone(stream));
        }
        let mut token = None;
        loop {
            match group.recv(Some(join_timeout)) {
                Some(ToNode::Welcome { token: t }) => {
                    if spec.token_given && !same_secret(&t, spec.token.reveal()) {
                        return Err(Error::Start(format!(
                            "{} is set for this node's launcher, but node 0's launcher runs with another token: give every \
                            node's launcher the same one",
                            super::TOKEN_VAR
                        )));
                    }
                    token = Some(t);
                }
                Some(ToNode::Go {
                    round,
                    size,
                    failed,
                    layout,
                }) => {
                    let Some(token) = token else {
                        return Err(Error::Start(
                            "node 0's launcher started the group without admitting this node".into(),
                        ));
                    };
                    if let Some(l) = &layout {
                        group.node = l.node_rank;
                    }
                    let micro = Micro { size, failed };
                    return Ok((group, Start { round, micro, layout }, token));
                }
                // An elastic job changing while this node joins: it waits for the next go.
                Some(ToNode::Restart { .. }) => continue,
                Some(ToNode::Refused { why }) => {
                    return Err(Error::Start(format!("node 0's launcher refused this node: {why}")))
                }
                Some(ToNode::Stop { why, .. }) => {
                    return Err(Error::Start(format!("the group stopped before it started: {why}")))
                }
                _ if matches!(group.link, Link::Remote { gone: true, .. }) => {
                    interrupted(signals)?;
                    return Err(Error::Start(
                        "node 0's launcher closed the connection before the group started".into(),
                    ));
                }
                _ => {
                    interrupted(signals)?;
                    return Err(Error::Start(format!(
                        "not every node's launcher joined within {} s (--nnodes {})",
                        join_timeout.as_secs(),
                        spec.elastic
                            .map_or(spec.nnodes.to_string(), |e| format!("{}:{}", e.min, e.max))
                    )));
                }
            }
        }
    }

    fn send(&mut self, msg: ToCoordinator) {
        match &mut self.link {
            Link::Local { coordinator, inbox } => inbox.extend(coordinator.on(0, msg).into_iter().map(|(_, m)| m)),
            Link::Remote { stream, .. } => {
                // A coordinator that is gone shows up on the next receive.
                let line = format!("{}\n", serde_json::to_string(&msg).unwrap_or_default());
                let _ = stream.lock().map(|mut s| s.write_all(line.as_bytes()));
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
                    // In slices, so that a signal to the launcher ends the wait at once.
                    Some(w) => {
                        let until = Instant::now() + w;
                        loop {
                            let left = until.saturating_duration_since(Instant::now());
                            match inbox.recv_timeout(left.min(SIGNAL_CHECK)) {
                                Ok(m) => break Some(m),
                                Err(RecvTimeoutError::Disconnected) => break Some(None),
                                Err(RecvTimeoutError::Timeout) => {
                                    if left <= SIGNAL_CHECK || self.signals.received().is_some() {
                                        return None;
                                    }
                                }
                            }
                        }
                    }
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
    pub fn failed(&mut self, round: u32, report: Report) -> Result<Start, (i32, String)> {
        let code = report.code;
        self.send(ToCoordinator::Failed { round, report });
        loop {
            match self.recv(Some(self.join_timeout)) {
                Some(ToNode::Restart { round: next, .. }) if next > round => return self.stopped(next),
                Some(ToNode::Stop { code, why }) => return Err((code, why)),
                Some(_) => continue,
                None => return Err((self.signaled().unwrap_or(code), self.silent("did not answer"))),
            }
        }
    }

    /// This node's workers are stopped for round `round`: wait until every node's are.
    pub fn stopped(&mut self, round: u32) -> Result<Start, (i32, String)> {
        let port = free_port("0.0.0.0").unwrap_or(0);
        self.send(ToCoordinator::Stopped { round, port });
        loop {
            match self.recv(Some(self.join_timeout)) {
                Some(ToNode::Go {
                    round: r,
                    size,
                    failed,
                    layout,
                }) if r == round => {
                    if let Some(l) = &layout {
                        self.node = l.node_rank;
                    }
                    let micro = Micro { size, failed };
                    return Ok(Start { round, micro, layout });
                }
                Some(ToNode::Stop { code, why }) => return Err((code, why)),
                Some(_) => continue,
                None => {
                    return Err((
                        self.signaled().unwrap_or(1),
                        self.silent(&format!("did not start round {round}")),
                    ))
                }
            }
        }
    }

    /// The exit code of a signal that ended a wait for the group (128 + its number), having
    /// told the group, as a signal while the workers run does.
    fn signaled(&mut self) -> Option<i32> {
        let code = 128 + self.signals.received()?;
        self.abort(code);
        Some(code)
    }

    /// Why no answer came from the coordinator: it `did` nothing in time, or it is gone (its
    /// launcher died), which no node can recover from: the run directory keeps the state.
    fn silent(&self, did: &str) -> String {
        if let Some(sig) = self.signals.received() {
            format!("received signal {sig} while waiting for the group")
        } else if matches!(self.link, Link::Remote { gone: true, .. }) {
            "the group's coordinator (node 0's launcher; in an elastic job, the one at --rdzv-endpoint) is gone, \
             and without it no node can restart: start the job again, with --resume, from the run directory's \
             newest checkpoint"
                .into()
        } else {
            format!("the group's coordinator {did} within {} s", self.join_timeout.as_secs())
        }
    }

    pub fn abort(&mut self, code: i32) {
        self.send(ToCoordinator::Abort { code });
    }

    /// This node's workers all succeeded. Node 0's launcher hosts the coordinator, so it stays
    /// until every node has finished (or the job ended), at most EXIT_BARRIER, or until a
    /// signal.
    pub fn done(&mut self) {
        self.send(ToCoordinator::Done);
        if let Link::Remote { server: Some(c), .. } = &self.link {
            let t = Instant::now();
            let waiting = || !c.lock().is_ok_and(|c| c.settled()) && self.signals.received().is_none();
            while t.elapsed() < EXIT_BARRIER && waiting() {
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

/// A port free on this host now, offered for its workers' store (elastic), else 0.
fn offer_port(spec: &LaunchSpec) -> u16 {
    spec.elastic.and_then(|_| free_port("0.0.0.0").ok()).unwrap_or(0)
}

/// A port free on `host` now (0.0.0.0: on every interface, for a store another node reaches).
pub(crate) fn free_port(host: &str) -> std::io::Result<u16> {
    TcpListener::bind((host, 0))?.local_addr().map(|a| a.port())
}

/// Node 0 starts the coordinator; every node (node 0 too) connects to it. Elastic, the
/// coordinator is at the rendezvous endpoint (--rdzv-endpoint), hosted by the launcher that
/// can listen there first, as torchrun's c10d rendezvous hosts its store.
fn connect(spec: &LaunchSpec, signals: &Signals) -> Result<Group, Error> {
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
fn interrupted(signals: &Signals) -> Result<(), Error> {
    signals.received().map_or(Ok(()), |sig| Err(Error::Signaled(sig)))
}

/// Elastic: a beat every BEAT until the coordinator's connection fails, so that a node whose
/// host hangs (its connections open, nothing moving) is seen as gone (`Elastic::silence`).
fn beat(stream: Arc<Mutex<TcpStream>>) {
    let line = format!("{}\n", serde_json::to_string(&ToCoordinator::Beat).unwrap_or_default());
    std::thread::spawn(move || loop {
        std::thread::sleep(elastic::BEAT);
        let sent = stream.lock().map(|mut s| s.write_all(line.as_bytes()));
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

/// One line of at most MAX_LINE bytes, without its newline; None at the end of the stream.
/// A longer line, or one cut off by the end, is an error.
fn read_line(r: &mut impl BufRead) -> std::io::Result<Option<String>> {
    let mut buf = Vec::new();
    match r.take(MAX_LINE).read_until(b'\n', &mut buf)? {
        0 => Ok(None),
        _ if buf.last() != Some(&b'\n') => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a line too long, or cut off",
        )),
        _ => String::from_utf8(buf)
            .map(|l| Some(l.trim_end().to_string()))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8")),
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
                let _ = out
                    .iter()
                    .try_for_each(|(_, m)| writeln!(reply, "{}", serde_json::to_string(m).unwrap_or_default()));
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
            id: "job".into(),
            node,
            micro,
            token: None,
            port: 0,
        }
    }
    /// A static round's go, to every node.
    fn go(round: u32, size: Option<usize>, failed: Option<usize>) -> (To, ToNode) {
        let layout = None;
        (
            To::All,
            ToNode::Go {
                round,
                size,
                failed,
                layout,
            },
        )
    }
    fn welcome(node: usize) -> (To, ToNode) {
        (To::Node(node), ToNode::Welcome { token: "tok".into() })
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
        let mut c = Coordinator::new(2, 3, "job", "tok", false);
        assert_eq!(c.on(0, hello(0, Some(8))), vec![welcome(0)]);
        let other = ToCoordinator::Hello {
            id: "other".into(),
            node: 1,
            micro: None,
            token: None,
            port: 0,
        };
        assert!(
            matches!(&c.on(1, other)[..], [(To::Node(1), ToNode::Refused { why })] if why.contains("\"job\", not \"other\"")),
            "another run"
        );
        assert!(
            matches!(c.on(0, hello(0, None))[0].1, ToNode::Refused { .. }),
            "a node rank joins once"
        );
        assert_eq!(c.on(1, hello(1, Some(4))), vec![welcome(1), go(0, Some(4), None)]);
    }

    #[test]
    fn a_failure_on_one_node_restarts_every_node_once_they_all_stopped() {
        let mut c = Coordinator::new(2, 3, "job", "tok", false);
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
        assert_eq!(c.on(0, ToCoordinator::Stopped { round: 1, port: 0 }), vec![]);
        assert_eq!(
            c.on(0, ToCoordinator::Stopped { round: 1, port: 0 }),
            vec![],
            "a node counts once"
        );
        assert_eq!(
            c.on(1, ToCoordinator::Stopped { round: 1, port: 0 }),
            vec![go(1, Some(4), Some(8))]
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
        let mut c = Coordinator::new(2, 3, "job", "tok", false);
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
        c.on(0, ToCoordinator::Stopped { round: 1, port: 0 });
        assert_eq!(
            c.on(1, ToCoordinator::Stopped { round: 1, port: 0 }),
            vec![go(1, Some(4), Some(8))]
        );
    }

    #[test]
    fn no_restarts_left_a_signal_or_a_lost_node_stops_every_node() {
        let mut c = Coordinator::new(2, 0, "job", "tok", false);
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
        c.on(0, ToCoordinator::Stopped { round: 1, port: 0 });
        let out = c.on(1, ToCoordinator::Stopped { round: 1, port: 0 });
        assert!(matches!(&out[..], [(To::All, ToNode::Stop { code: 7, why })] if why.contains("no restarts left")));
        assert!(c.settled());

        let mut c = Coordinator::new(2, 5, "job", "tok", false);
        c.on(0, hello(0, None));
        c.on(1, hello(1, None));
        assert!(matches!(
            &c.on(1, ToCoordinator::Abort { code: 130 })[..],
            [(To::All, ToNode::Stop { code: 130, .. })]
        ));
        assert_eq!(c.gone(1), vec![], "already ended");

        let mut c = Coordinator::new(2, 5, "job", "tok", false);
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
        let c = coordinate(listener, Coordinator::new(2, 3, "job", "tok", false));
        let line = |m: &ToCoordinator| format!("{}\n", serde_json::to_string(m).unwrap());
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

    /// The user's token (OOMGUARD_RUN_TOKEN): a node without it, or with another, is refused
    /// by a message that names the variable and neither token; one with it is admitted.
    #[test]
    fn a_user_given_token_is_required_and_never_named() {
        let secret = "s3cret-Token-0123456789";
        let mut c = Coordinator::new(2, 3, "job", secret, true);
        let hello = |node: usize, token: Option<&str>| ToCoordinator::Hello {
            id: "job".into(),
            node,
            micro: None,
            token: token.map(str::to_string),
            port: 0,
        };
        for (token, says) in [(None, "has none"), (Some("wrong-token-0123456789"), "has another")] {
            match &c.on(1, hello(1, token))[..] {
                [(To::Node(1), ToNode::Refused { why })] => {
                    assert!(why.contains("OOMGUARD_RUN_TOKEN") && why.contains(says), "{why}");
                    assert!(
                        !why.contains(secret) && !token.is_some_and(|t| why.contains(t)),
                        "{why}"
                    );
                }
                other => panic!("admitted without the token: {other:?}"),
            }
        }
        assert_eq!(
            c.on(0, hello(0, Some(secret))),
            vec![(To::Node(0), ToNode::Welcome { token: secret.into() })]
        );
        let both = c.on(1, hello(1, Some(secret)));
        assert!(
            matches!(&both[..], [(To::Node(1), ToNode::Welcome { token }), (To::All, ToNode::Go { round: 0, .. })] if token == secret),
            "{both:?}"
        );
        // Without a token of the user's, the id admits, and the run's token is handed out; a
        // node that brings a token of its own is refused (its workers would not match).
        let mut c = Coordinator::new(1, 0, "job", "random", false);
        assert!(
            matches!(&c.on(0, hello(0, Some(secret)))[..], [(To::Node(0), ToNode::Refused { why })]
                if why.contains("not for node 0's") && !why.contains(secret))
        );
        assert!(
            matches!(&c.on(0, hello(0, None))[..], [(To::Node(0), ToNode::Welcome { token }), _] if token == "random")
        );
        assert!(same_secret("abc", "abc") && !same_secret("abc", "abd") && !same_secret("abc", "abcd"));
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
        let line = |m: &ToCoordinator| format!("{}\n", serde_json::to_string(m).unwrap());
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

    #[test]
    fn one_node_restarts_alone_in_process() {
        let mut c = Coordinator::new(1, 1, "job", "tok", false);
        assert_eq!(c.on(0, hello(0, Some(6))), vec![welcome(0), go(0, Some(6), None)]);
        c.on(
            0,
            ToCoordinator::Failed {
                round: 0,
                report: report(0, true, Some(6)),
            },
        );
        assert_eq!(
            c.on(0, ToCoordinator::Stopped { round: 1, port: 0 }),
            vec![go(1, Some(3), Some(6))]
        );
        c.on(
            0,
            ToCoordinator::Failed {
                round: 1,
                report: report(0, false, Some(3)),
            },
        );
        assert!(matches!(
            &c.on(0, ToCoordinator::Stopped { round: 2, port: 0 })[..],
            [(To::All, ToNode::Stop { code: 1, .. })]
        ));
    }
}
