//! Owns the group's decisions, purely: node 0's record of who joined, the round, and what
//! failed; `Coordinator::on` turns one node's message into the messages to send. No sockets.
//! Keeps: a failure on any node ends the round on every node, and every node starts the next
//! attempt with the same micro-batch; a hello that is refused changes nothing.
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::super::elastic::{self, Change, Elastic, Layout, Member};
use super::super::outcome::{after_failure, Ended, Next, Report};
use super::super::Micro;
use super::protocol::{Hello, ToCoordinator, ToNode};

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
    /// The run's --rdzv-id: a node's hello must name it. (The coordinator holds no secret: a
    /// hello reaches it only once the transport found its proof good.)
    id: String,
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
    /// The workers a node runs, as the first node to say it said (every node's the same).
    nproc: Option<usize>,
}

/// Who a reply goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum To {
    All,
    Node(usize),
}

impl Coordinator {
    pub fn new(nnodes: usize, max_restarts: u32, id: &str) -> Coordinator {
        Coordinator {
            nnodes,
            max_restarts,
            id: id.into(),
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
            nproc: None,
        }
    }

    /// An elastic job's coordinator: between `e.min` and `e.max` nodes.
    pub fn elastic(e: Elastic, max_restarts: u32, id: &str) -> Coordinator {
        Coordinator {
            elastic: Some(e),
            ..Coordinator::new(e.max, max_restarts, id)
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
            ToCoordinator::Hello(h) => {
                let out = self.hello(node, &h);
                if matches!(out.first(), Some((_, ToNode::Refused { .. }))) {
                    self.addrs.remove(&node); // a refused slot's address is never needed
                }
                out
            }
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
        // A finished node never starts another round: a member leaving then ends the job,
        // with the leave's code.
        if let (Some(n), false) = (self.finished_member(), matches!(self.phase, Phase::Joining)) {
            let why = format!("{cause} after node {}'s workers had finished", self.rank_of(n));
            return self.end(code, why);
        }
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

    /// A member whose workers all finished (its launcher has left): no round starts again.
    fn finished_member(&self) -> Option<usize> {
        self.joined.iter().find(|n| self.done.contains(n)).copied()
    }

    fn end(&mut self, code: i32, why: String) -> Vec<(To, ToNode)> {
        if matches!(self.phase, Phase::Ended) {
            return vec![];
        }
        self.phase = Phase::Ended;
        vec![(To::All, ToNode::Stop { code, why })]
    }

    /// Admits a node's launcher whose hello proved it knows the run's secret (the transport
    /// checked it; in-process there is nothing to check): the run's id, and a node rank not yet
    /// taken (elastic: room below MAX). The welcome's proof is the transport's to add.
    fn hello(&mut self, node: usize, h: &Hello) -> Vec<(To, ToNode)> {
        let (id, named, micro, port) = (&h.id, h.node, h.micro, h.port);
        let refuse = |why: String| vec![(To::Node(node), ToNode::Refused { why })];
        if *id != self.id {
            return refuse(format!(
                "this is run {:?}, not {id:?}: give every node's launcher the same --rdzv-id",
                self.id
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
        match (self.nproc, h.nproc) {
            (_, 0) => {}
            (Some(n), m) if n != m => {
                return refuse(format!(
                    "this node runs {m} workers a node (--nproc-per-node) and the job's others {n}: ranks go in blocks \
                     of one size, so give every node's launcher the same --nproc-per-node"
                ))
            }
            _ => self.nproc = Some(h.nproc),
        }
        self.joined.insert(node);
        if matches!(self.phase, Phase::Joining) {
            self.micro.size = match (self.micro.size, micro) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        let welcome = (To::Node(node), ToNode::Welcome { proof: String::new() });
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
        // A node whose workers finished never stops again (its launcher has exited): the
        // others are all that is waited for, and no round can start without it.
        if !(self.joined.iter()).all(|n| stopped.contains(n) || self.done.contains(n)) {
            return vec![];
        }
        let finished = self.finished_member().map(|n| self.rank_of(n));
        let (report, failed_node, change) = (report.clone(), *failed_node, change.clone());
        let ended = report.as_ref().map_or(Ended::Other, Report::ended);
        let micro = report.as_ref().and_then(|r| r.micro);
        let done = if change.is_some() { 0 } else { self.restarts };
        let max = if change.is_some() { u32::MAX } else { self.max_restarts };
        let next = match finished {
            Some(_) => Next::GiveUp,
            None => after_failure(done, max, ended, micro),
        };
        match next {
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
                    infeasible: false,
                });
                if report.infeasible {
                    return self.end(
                        3,
                        format!("worker rank {} on node {failed_node} exited 3: it does not fit in memory even at micro-batch 1, so no \
                            restart can help", report.rank),
                    );
                }
                let why = match finished {
                    Some(n) => format!(
                        "worker rank {} on node {failed_node} failed (exit code {}) after node {n}'s workers had finished: \
                         no restart can bring those back",
                        report.rank, report.code
                    ),
                    None => gave_up(&report, failed_node, self.max_restarts),
                };
                self.end(report.code, why)
            }
        }
    }
}

/// Why the group gave up after `report`'s failure with no restarts left; after an OOM, that a
/// relaunch at half the micro-batch was possible and how to allow one.
fn gave_up(report: &Report, node: usize, max_restarts: u32) -> String {
    let head = format!(
        "worker rank {} on node {node} failed (exit code {}); no restarts left (--max-restarts {max_restarts})",
        report.rank, report.code
    );
    if !report.oom {
        return head;
    }
    let half = match report.micro {
        Some(m) if m > 1 => format!(" at micro-batch {} (half of {m})", m / 2),
        _ => String::new(),
    };
    format!(
        "{head}. It ran out of memory: a relaunch{half} was possible; allow one with --max-restarts {} (or more), \
         and the launcher halves {} at each",
        max_restarts + 1,
        crate::MICRO_BATCH_VAR
    )
}

/// The connections that have not yet proven that they know the run's secret, at most `cap` at
/// once (the transport gives each a thread while it waits). When one more comes and every
/// place is taken, the oldest connection of the address that holds the most places makes
/// room: a flood from one address crowds out its own connections first, and a node's launcher
/// that connects (from that address too) gets a place at once, long enough to prove itself.
#[derive(Debug)]
pub struct Lobby {
    cap: usize,
    next: u64,
    /// By arrival: each place's ticket and address.
    waiting: VecDeque<(u64, IpAddr)>,
}

impl Lobby {
    pub fn new(cap: usize) -> Lobby {
        Lobby {
            cap: cap.max(1),
            next: 0,
            waiting: VecDeque::new(),
        }
    }

    /// A connection from `ip` comes in: its ticket, and the ticket and address of the one it
    /// crowds out when every place was taken.
    pub fn enter(&mut self, ip: IpAddr) -> (u64, Option<(u64, IpAddr)>) {
        let crowded = if self.waiting.len() >= self.cap {
            let mut held: BTreeMap<IpAddr, usize> = BTreeMap::new();
            for (_, a) in &self.waiting {
                *held.entry(*a).or_default() += 1;
            }
            let most = held.values().copied().max().unwrap_or(0);
            let out = self.waiting.iter().copied().find(|(_, a)| held.get(a) == Some(&most));
            if let Some((t, _)) = out {
                self.leave(t);
            }
            out
        } else {
            None
        };
        let ticket = self.next;
        self.next += 1;
        self.waiting.push_back((ticket, ip));
        (ticket, crowded)
    }

    /// `ticket` leaves (proven, refused, gone): whether it still held its place (it was not
    /// crowded out).
    pub fn leave(&mut self, ticket: u64) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|(t, _)| *t != ticket);
        self.waiting.len() < before
    }
}

/// How many warnings about strangers are written: at most `most` every `per`; the others are
/// counted, and the count is written before the next one shown, or once their window is over
/// (`overdue`), so that a flood of connections cannot flood the log.
#[derive(Debug)]
pub struct Throttle {
    most: usize,
    per: Duration,
    since: Option<Instant>,
    shown: usize,
    hidden: usize,
}

impl Throttle {
    pub fn new(most: usize, per: Duration) -> Throttle {
        Throttle {
            most,
            per,
            since: None,
            shown: 0,
            hidden: 0,
        }
    }

    /// A warning at `now`: Some(n) when it is to be written, after a line that counts the `n`
    /// held back before it; None when it is held back.
    pub fn note(&mut self, now: Instant) -> Option<usize> {
        let fresh = match self.since {
            Some(s) => now.saturating_duration_since(s) >= self.per,
            None => true,
        };
        if fresh {
            self.since = Some(now);
            self.shown = 0;
        }
        if self.shown < self.most {
            self.shown += 1;
            Some(std::mem::take(&mut self.hidden))
        } else {
            self.hidden += 1;
            None
        }
    }

    /// The warnings held back in a window that is over at `now`, to be counted in a line of
    /// their own (then none are); with `now` None, whatever the window (the job is over).
    pub fn overdue(&mut self, now: Option<Instant>) -> usize {
        match (self.since, now) {
            (Some(s), Some(now)) if now.saturating_duration_since(s) < self.per => 0,
            _ => std::mem::take(&mut self.hidden),
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The default --max-restarts 0 and a worker dead of an OOM: the message says that a
    /// relaunch at half was possible and how to allow one; any other failure says no more.
    #[test]
    fn giving_up_after_an_oom_says_a_relaunch_at_half_was_possible() {
        let r = |oom, micro| Report {
            rank: 1,
            oom,
            micro,
            code: 1,
            infeasible: false,
        };
        assert_eq!(
            gave_up(&r(true, Some(16)), 0, 0),
            "worker rank 1 on node 0 failed (exit code 1); no restarts left (--max-restarts 0). It ran out of memory: \
             a relaunch at micro-batch 8 (half of 16) was possible; allow one with --max-restarts 1 (or more), and the \
             launcher halves OOMGUARD_MICRO_BATCH_SIZE at each"
        );
        assert!(gave_up(&r(true, None), 0, 2).contains("a relaunch was possible; allow one with --max-restarts 3"));
        assert_eq!(
            gave_up(&r(false, Some(16)), 1, 0),
            "worker rank 1 on node 1 failed (exit code 1); no restarts left (--max-restarts 0)"
        );
    }

    pub(in super::super) fn hello_of(node: usize, micro: Option<usize>) -> Hello {
        Hello {
            id: "job".into(),
            node,
            micro,
            port: 0,
            nproc: 1,
            nonce: String::new(),
            proof: String::new(),
        }
    }
    pub(in super::super) fn hello(node: usize, micro: Option<usize>) -> ToCoordinator {
        ToCoordinator::Hello(hello_of(node, micro))
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
        (To::Node(node), ToNode::Welcome { proof: String::new() })
    }
    pub(in super::super) fn report(rank: usize, oom: bool, micro: Option<usize>) -> Report {
        Report {
            rank,
            oom,
            micro,
            code: 1,
            infeasible: false,
        }
    }

    #[test]
    fn every_node_joins_before_the_first_go_at_the_smallest_micro_batch() {
        let mut c = Coordinator::new(2, 3, "job");
        assert_eq!(c.on(0, hello(0, Some(8))), vec![welcome(0)]);
        let other = ToCoordinator::Hello(Hello {
            id: "other".into(),
            ..hello_of(1, None)
        });
        assert!(
            matches!(&c.on(1, other)[..], [(To::Node(1), ToNode::Refused { why })] if why.contains("\"job\", not \"other\"")),
            "another run"
        );
        assert!(
            matches!(c.on(0, hello(0, None))[0].1, ToNode::Refused { .. }),
            "a node rank joins once"
        );
        let wider = ToCoordinator::Hello(Hello {
            nproc: 2,
            ..hello_of(1, Some(4))
        });
        assert!(
            matches!(&c.on(1, wider)[..], [(To::Node(1), ToNode::Refused { why })] if why.contains("runs 2 workers a node (--nproc-per-node) and the job's others 1")),
            "another --nproc-per-node"
        );
        assert_eq!(c.on(1, hello(1, Some(4))), vec![welcome(1), go(0, Some(4), None)]);
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
        c.on(0, ToCoordinator::Stopped { round: 1, port: 0 });
        assert_eq!(
            c.on(1, ToCoordinator::Stopped { round: 1, port: 0 }),
            vec![go(1, Some(4), Some(8))]
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
                    infeasible: false,
                },
            },
        );
        c.on(0, ToCoordinator::Stopped { round: 1, port: 0 });
        let out = c.on(1, ToCoordinator::Stopped { round: 1, port: 0 });
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

    /// One node's workers finished and its launcher left; then a worker on another node fails
    /// (its last checkpoint's write, say): the job ends at once with that worker's code, with
    /// restarts left or not, and waits for no stop from the finished node.
    #[test]
    fn a_failure_after_another_node_finished_ends_the_job_with_its_code() {
        for max_restarts in [0, 3] {
            let mut c = Coordinator::new(2, max_restarts, "job");
            c.on(0, hello(0, None));
            c.on(1, hello(1, None));
            c.on(1, ToCoordinator::Done);
            assert_eq!(c.gone(1), vec![]);
            let failure = Report {
                code: 7,
                ..report(0, false, None)
            };
            let out = c.on(
                0,
                ToCoordinator::Failed {
                    round: 0,
                    report: failure,
                },
            );
            assert!(matches!(&out[..], [(To::All, ToNode::Restart { round: 1, .. })]));
            let out = c.on(0, ToCoordinator::Stopped { round: 1, port: 0 });
            assert!(
                matches!(&out[..], [(To::All, ToNode::Stop { code: 7, why })] if why.contains("after node 1's workers had finished")),
                "{out:?}"
            );
            assert!(c.settled());
        }
    }

    /// At most `cap` places; one more crowds out the oldest of the address holding the most, so
    /// a node arriving from elsewhere keeps its place while a flood from one address goes on,
    /// and a node arriving from the flood's own address still gets one (the flood's oldest
    /// leaves). A ticket leaves once; a crowded-out one has already left.
    #[test]
    fn the_lobby_holds_cap_places_and_a_flood_crowds_out_its_own() {
        let (flood, node, other) = (
            IpAddr::from([10, 0, 0, 9]),
            IpAddr::from([10, 0, 0, 1]),
            IpAddr::from([10, 0, 0, 2]),
        );
        let mut l = Lobby::new(3);
        let (a, none) = l.enter(flood);
        assert_eq!(none, None);
        let (n, _) = l.enter(node);
        let (b, _) = l.enter(flood);
        assert_eq!(l.waiting.len(), 3);
        // Full: the flood's next crowds out the flood's oldest (a), not the node's older place.
        let (c, out) = l.enter(flood);
        assert_eq!(out, Some((a, flood)));
        let (d, out) = l.enter(flood);
        assert_eq!(out, Some((b, flood)), "the node keeps its place");
        // One from elsewhere also takes the busiest address's oldest.
        let (o, out) = l.enter(other);
        assert_eq!(out, Some((c, flood)));
        assert_eq!(l.waiting.len(), 3);
        assert!(l.leave(n) && !l.leave(n), "a ticket leaves once");
        assert!(!l.leave(a), "a crowded-out ticket has left");
        // Ties (one place each: the flood's d, the other's o, the node's x): the oldest goes.
        let (x, none) = l.enter(node);
        assert_eq!(none, None, "a place was free");
        let (_, out) = l.enter(node);
        assert_eq!(out, Some((d, flood)), "{l:?}");
        let (_, out) = l.enter(flood);
        assert_eq!(out, Some((x, node)), "now the node's address holds two: {l:?}");
        assert!(l.leave(o));
        // A flood of one address alone: each arrival crowds out the oldest, the size holds.
        let mut l = Lobby::new(16);
        let tickets: Vec<u64> = (0..100).map(|_| l.enter(flood).0).collect();
        assert_eq!(l.waiting.len(), 16);
        assert_eq!(
            l.waiting.iter().map(|(t, _)| *t).collect::<Vec<_>>(),
            tickets[84..].to_vec()
        );
    }

    /// At most `most` warnings a window; the rest are counted, and the count comes with the
    /// first warning of a later window, or on its own once the window is over.
    #[test]
    fn warnings_about_strangers_are_throttled_and_counted() {
        let t0 = Instant::now();
        let s = |secs: f64| t0 + Duration::from_secs_f64(secs);
        let mut w = Throttle::new(3, Duration::from_secs(10));
        let shown: Vec<Option<usize>> = (0..5).map(|i| w.note(s(f64::from(i)))).collect();
        assert_eq!(shown, [Some(0), Some(0), Some(0), None, None]);
        assert_eq!(w.overdue(Some(s(9.9))), 0, "the window is not over");
        assert_eq!(
            w.note(s(10.0)),
            Some(2),
            "the next window's first counts those held back"
        );
        assert_eq!(
            (w.note(s(11.0)), w.note(s(12.0)), w.note(s(13.0))),
            (Some(0), Some(0), None)
        );
        assert_eq!(w.overdue(Some(s(19.0))), 0);
        assert_eq!(w.overdue(Some(s(20.0))), 1);
        assert_eq!(w.overdue(Some(s(21.0))), 0, "counted once");
        // The job over: what is held back is counted whatever the window.
        assert_eq!(
            (w.note(s(30.0)), w.note(s(30.0)), w.note(s(30.0)), w.note(s(30.0))),
            (Some(0), Some(0), Some(0), None)
        );
        assert_eq!((w.overdue(Some(s(31.0))), w.overdue(None), w.overdue(None)), (0, 1, 0));
    }

    /// Elastic, a hello refused (another run's id, the job full) leaves nothing behind: the
    /// address its slot was given is dropped, so refused connections cannot pile up.
    #[test]
    fn a_refused_elastic_hello_keeps_no_address() {
        let mut c = Coordinator::elastic(Elastic::new(1, 1, "last_call_timeout=0").unwrap(), 0, "job");
        let a = c.slot(usize::MAX, "10.0.0.1");
        assert!(matches!(
            &c.on(a, hello(usize::MAX, None))[..],
            [(_, ToNode::Welcome { .. }), ..]
        ));
        for id in ["job", "other"] {
            let b = c.slot(usize::MAX, "10.0.0.2");
            let out = c.on(
                b,
                ToCoordinator::Hello(Hello {
                    id: id.into(),
                    ..hello_of(usize::MAX, None)
                }),
            );
            assert!(
                matches!(&out[..], [(To::Node(n), ToNode::Refused { .. })] if *n == b),
                "{out:?}"
            );
        }
        assert!(c.addrs.is_empty(), "{:?}", c.addrs);
        assert_eq!(c.joined, BTreeSet::from([a]));
    }

    #[test]
    fn one_node_restarts_alone_in_process() {
        let mut c = Coordinator::new(1, 1, "job");
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
