//! Owns restarts that are group-wide across nodes: node 0's launcher keeps the group's round.
//! Keeps: a failure on any node ends the round on every node, and every node starts the next
//! attempt with the same micro-batch; `Coordinator::on` decides, purely. On several nodes a
//! node is admitted only once it has proven that it knows the run's secret (protocol.rs), and
//! the coordinator has proven it back; a connection that has not (garbage, silence, no proof
//! or a wrong one) or that names another run is refused, logged with its address, and changes
//! nothing. No message carries the secret.
//!
//! protocol.rs: the messages and their encoding; coordinator.rs: the decisions (pure);
//! transport.rs: the sockets and threads; this file: one launcher's end of the group.
mod coordinator;
mod protocol;
mod transport;

use std::collections::VecDeque;
use std::io::Write;
use std::net::TcpStream;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use coordinator::Coordinator;
#[cfg(test)]
pub(crate) use coordinator::To;
pub use protocol::{Hello, ToCoordinator, ToNode};
pub(crate) use transport::free_port;

use super::elastic::Layout;
use super::outcome::Report;
use super::{LaunchError as Error, LaunchSpec, Micro};
use oomguard_host::proc::Signals;
use transport::{beat, connect, interrupted, offer_port};

/// How long a launcher waits for every node's launcher to join, and node 0's launcher, its
/// own workers done, for the other nodes' to finish (torchrun's join timeout and exit barrier).
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// How often a wait for the group looks for a signal to the launcher.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);
const EXIT_BARRIER: Duration = Duration::from_secs(300);
/// How long node 0's launcher, stopping the job, waits for the coordinator to end it.
const ABORT_FLUSH: Duration = Duration::from_secs(2);

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

/// What a wait on the coordinator's connection brought.
enum Heard {
    Msg(ToNode),
    /// The connection closed (or carried garbage).
    Closed,
    /// Nothing in time, or a signal to the launcher ended the wait.
    Nothing,
}

/// The next message from the coordinator's connection (its reader thread's `inbox`), waiting
/// at most `wait` (None: not at all), in slices, so that a signal to the launcher ends the
/// wait at once.
fn next(inbox: &Receiver<Option<ToNode>>, wait: Option<Duration>, signals: &Signals) -> Heard {
    let Some(w) = wait else {
        return match inbox.try_recv() {
            Ok(Some(m)) => Heard::Msg(m),
            Ok(None) | Err(TryRecvError::Disconnected) => Heard::Closed,
            Err(TryRecvError::Empty) => Heard::Nothing,
        };
    };
    let until = Instant::now() + w;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match inbox.recv_timeout(left.min(SIGNAL_CHECK)) {
            Ok(Some(m)) => return Heard::Msg(m),
            Ok(None) | Err(RecvTimeoutError::Disconnected) => return Heard::Closed,
            Err(RecvTimeoutError::Timeout) => {
                if left <= SIGNAL_CHECK || signals.received().is_some() {
                    return Heard::Nothing;
                }
            }
        }
    }
}

impl Group {
    /// Joins the group and waits for the first attempt's go. On several nodes, this launcher
    /// and the coordinator first prove to each other that they know the run's secret
    /// (`transport::connect`); the secret itself is never sent.
    pub fn join(spec: &LaunchSpec, signals: &Signals) -> Result<(Group, Start), Error> {
        let hello = Hello {
            id: spec.run_id.clone(),
            node: match spec.elastic {
                Some(_) => spec.named_rank.unwrap_or(usize::MAX),
                None => spec.node_rank,
            },
            micro: spec.micro_batch_size,
            port: offer_port(spec),
            nproc: spec.nproc_per_node,
            nonce: String::new(),
            proof: String::new(),
        };
        let join_timeout = spec.elastic.map_or(JOIN_TIMEOUT, |e| e.join_timeout);
        let mut group = if spec.nnodes == 1 && spec.elastic.is_none() {
            let link = Link::Local {
                coordinator: Box::new(Coordinator::new(1, spec.max_restarts, &spec.run_id)),
                inbox: VecDeque::new(),
            };
            let mut group = Group {
                node: 0,
                link,
                join_timeout,
                signals: signals.clone(),
            };
            group.send(ToCoordinator::Hello(hello));
            group
        } else {
            connect(spec, hello, signals)?
        };
        if let (Some(_), Link::Remote { stream, .. }) = (spec.elastic, &group.link) {
            beat(Arc::clone(stream));
        }
        loop {
            match group.recv(Some(join_timeout)) {
                Some(ToNode::Go {
                    round,
                    size,
                    failed,
                    layout,
                }) => {
                    if let Some(l) = &layout {
                        group.node = l.node_rank;
                    }
                    let micro = Micro { size, failed };
                    return Ok((group, Start { round, micro, layout }));
                }
                // The welcome (in-process: over the wire, `connect` took it), or an elastic job
                // changing while this node joins: it waits for the next go.
                Some(ToNode::Welcome { .. } | ToNode::Challenge { .. } | ToNode::Restart { .. }) => continue,
                Some(ToNode::Refused { why }) => {
                    return Err(Error::Start(format!("node 0's launcher refused this node: {why}")))
                }
                Some(ToNode::Stop { code, why }) => return Err(Error::Stopped { code, why }),
                _ if matches!(group.link, Link::Remote { gone: true, .. }) => {
                    interrupted(signals)?;
                    return Err(Error::Start(
                        "node 0's launcher closed the connection before the group started".into(),
                    ));
                }
                _ => {
                    if let Err(e) = interrupted(signals) {
                        // The others stop with this node's code rather than wait for it.
                        if let Error::Signaled(sig) = e {
                            group.abort(128 + sig);
                        }
                        return Err(e);
                    }
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
                let line = protocol::line(&msg);
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
            Link::Remote { inbox, gone, .. } => match next(inbox, wait, &self.signals) {
                Heard::Msg(m) => Some(m),
                Heard::Closed => {
                    *gone = true;
                    tracing::warn!("node 0's launcher is gone: this node can no longer restart with the group");
                    None
                }
                Heard::Nothing => None,
            },
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

    /// Stops the job with `code` (a signal's, a start that failed). Node 0's launcher hosts
    /// the coordinator: it stays until the coordinator has ended the job and its writers had
    /// a moment to send the others their stop (at most ABORT_FLUSH), or they would find it
    /// gone and leave their workers to fail on lost peers instead of stopping with `code`.
    pub fn abort(&mut self, code: i32) {
        self.send(ToCoordinator::Abort { code });
        if let Link::Remote { server: Some(c), .. } = &self.link {
            let t = Instant::now();
            while t.elapsed() < ABORT_FLUSH && !c.lock().is_ok_and(|c| c.settled()) {
                std::thread::sleep(Duration::from_millis(10));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
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
