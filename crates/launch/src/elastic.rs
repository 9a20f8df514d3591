//! Owns an elastic job's membership decisions (`--nnodes MIN:MAX`): its bounds, the node ranks
//! of a round and each node's place in it, and what the workers hear of a change.
//! Keeps: ranks are a pure function of the members: nodes that named a rank (`--node-rank`)
//! first, in that order, then the others in the order they joined; so survivors keep their
//! order, and rank 0's node (its workers' store) is the first survivor.
use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `--nnodes MIN:MAX` and the rendezvous's waits (`--rdzv-conf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elastic {
    pub min: usize,
    pub max: usize,
    /// Once MIN nodes joined, how long the first rendezvous waits for more (torchrun's
    /// `last_call_timeout`); MAX nodes start it at once.
    pub last_call: Duration,
    /// How long a launcher waits to be admitted and started (torchrun's `join_timeout`).
    pub join_timeout: Duration,
    /// How long a member's launcher may send nothing, not even a beat, before it counts as
    /// gone (`heartbeat_timeout`): a host that hangs with its connections open.
    pub silence: Duration,
}

/// How often a member's launcher beats.
pub const BEAT: Duration = Duration::from_secs(1);

/// torchrun's defaults.
const LAST_CALL: Duration = Duration::from_secs(30);
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);
const SILENCE: Duration = Duration::from_secs(10);

impl Elastic {
    /// MIN and MAX with the waits `conf` (`--rdzv-conf KEY=VALUE,...`) gives; a key this
    /// launcher does not use is accepted (torchrun's others) and ignored.
    pub fn new(min: usize, max: usize, conf: &str) -> Result<Elastic, String> {
        let mut e = Elastic {
            min,
            max,
            last_call: LAST_CALL,
            join_timeout: JOIN_TIMEOUT,
            silence: SILENCE,
        };
        for item in conf.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}` is not KEY=VALUE"))?;
            let secs = || {
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| (0.0..=super::MAX_SECONDS).contains(s))
                    .map(Duration::from_secs_f64)
                    .ok_or_else(|| format!("{k}={v}: give a number of seconds, at most {}", super::MAX_SECONDS))
            };
            match k.trim() {
                "last_call_timeout" => e.last_call = secs()?,
                "join_timeout" => e.join_timeout = secs()?,
                "heartbeat_timeout" => e.silence = secs()?.max(BEAT * 2),
                _ => {}
            }
        }
        Ok(e)
    }
}

/// What the coordinator knows of a member node's launcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The node rank it named (`--node-rank`), a preference for its place; usize::MAX: none.
    pub named: usize,
    /// The address its connection came from: its workers' store's, should it be node 0.
    pub addr: String,
    /// A port it found free on its host, for that store.
    pub port: u16,
}

/// One node's place in an elastic round.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub node_rank: usize,
    pub nnodes: usize,
    /// Rank 0's node: its workers' store (MASTER_ADDR, MASTER_PORT).
    pub master_addr: String,
    pub master_port: u16,
    /// The membership change that began this round, if one did.
    pub change: Option<Change>,
}

/// A membership change, as the workers record it (`membership` in metrics.jsonl).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub old_nodes: usize,
    pub new_nodes: usize,
    pub cause: String,
    /// When the coordinator saw it (milliseconds since the Unix epoch).
    pub detected_unix_ms: u64,
}

impl Change {
    /// The workers' OOMGUARD_MEMBERSHIP: the change in ranks (`nproc` a node).
    pub fn for_workers(&self, nproc: usize) -> String {
        serde_json::json!({
            "old_world": self.old_nodes * nproc,
            "new_world": self.new_nodes * nproc,
            "cause": self.cause,
            "detected_unix_ms": self.detected_unix_ms,
        })
        .to_string()
    }
}

/// Read by the workers: the job is elastic (`MIN:MAX` nodes), so a worker that loses a peer
/// saves what it holds before it exits (`oomguard train`).
pub const ELASTIC_VAR: &str = "OOMGUARD_ELASTIC";
/// Read by the workers of a round that a membership change began: `Change::for_workers`.
pub const MEMBERSHIP_VAR: &str = "OOMGUARD_MEMBERSHIP";

/// Each member's node rank, by slot (see the module's first lines).
pub fn ranks(members: &BTreeMap<usize, Member>) -> BTreeMap<usize, usize> {
    let mut order: Vec<(usize, usize)> = members.iter().map(|(slot, m)| (m.named, *slot)).collect();
    order.sort_unstable();
    order
        .into_iter()
        .enumerate()
        .map(|(rank, (_, slot))| (slot, rank))
        .collect()
}

/// Each member's place in the round, by slot.
pub fn layouts(members: &BTreeMap<usize, Member>, change: Option<Change>) -> Vec<(usize, Layout)> {
    let ranks = ranks(members);
    let Some((first, _)) = ranks.iter().find(|(_, r)| **r == 0) else {
        return vec![];
    };
    let head = &members[first];
    ranks
        .iter()
        .map(|(slot, rank)| {
            (
                *slot,
                Layout {
                    node_rank: *rank,
                    nnodes: members.len(),
                    master_addr: head.addr.clone(),
                    master_port: head.port,
                    change: change.clone(),
                },
            )
        })
        .collect()
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::super::group::{Coordinator, Hello, To, ToCoordinator, ToNode};
    use super::super::outcome::Report;
    use super::*;
    use std::time::Instant;

    fn member(named: usize, port: u16) -> Member {
        Member {
            named,
            addr: format!("10.0.0.{port}"),
            port,
        }
    }

    #[test]
    fn named_ranks_first_then_the_order_of_joining() {
        let m: BTreeMap<usize, Member> = [
            (0, member(usize::MAX, 1)),
            (1, member(0, 2)),
            (2, member(usize::MAX, 3)),
        ]
        .into();
        assert_eq!(ranks(&m), [(1, 0), (0, 1), (2, 2)].into());
        let l = layouts(&m, None);
        assert!(l
            .iter()
            .all(|(_, l)| l.master_addr == "10.0.0.2" && l.master_port == 2 && l.nnodes == 3));
        // Node rank 0's node leaves: the first survivor is the new rank 0, and hosts the store.
        let m: BTreeMap<usize, Member> = [(0, member(usize::MAX, 1)), (2, member(usize::MAX, 3))].into();
        assert_eq!(ranks(&m), [(0, 0), (2, 1)].into());
        assert_eq!(layouts(&m, None)[0].1.master_port, 1);
    }

    #[test]
    fn conf_keys_and_refusals() {
        let e = Elastic::new(1, 3, "last_call_timeout=2, join_timeout=60,timeout=9").unwrap();
        assert_eq!(
            (e.last_call, e.join_timeout),
            (Duration::from_secs(2), Duration::from_secs(60))
        );
        assert!(Elastic::new(1, 3, "last_call_timeout=soon")
            .unwrap_err()
            .contains("last_call_timeout"));
        assert!(Elastic::new(1, 3, "oops").is_err());
        assert!(
            Elastic::new(1, 3, "join_timeout=1e300").is_err(),
            "no panic past Duration's range"
        );
        assert_eq!(Elastic::new(1, 3, "").unwrap().last_call, LAST_CALL);
    }

    fn hello(named: usize) -> ToCoordinator {
        ToCoordinator::Hello(Hello {
            id: "job".into(),
            node: named,
            micro: Some(8),
            port: 4000 + named as u16,
            nproc: 1,
            nonce: String::new(),
            proof: String::new(),
        })
    }

    fn goes(out: &[(To, ToNode)]) -> BTreeMap<usize, Layout> {
        out.iter()
            .filter_map(|(to, m)| match (to, m) {
                (To::Node(n), ToNode::Go { layout: Some(l), .. }) => Some((*n, l.clone())),
                _ => None,
            })
            .collect()
    }

    fn elastic(min: usize, max: usize) -> Coordinator {
        Coordinator::elastic(Elastic::new(min, max, "last_call_timeout=0").unwrap(), 0, "job")
    }

    fn join(c: &mut Coordinator, named: usize) -> (usize, Vec<(To, ToNode)>) {
        let slot = c.slot(named, "127.0.0.1");
        (slot, c.on(slot, hello(named)))
    }

    /// Three nodes, MIN 2: node rank 0's launcher is lost mid-run. The others stop and start
    /// the next round at two nodes, ranks reassigned, with the change recorded, and no
    /// restart counted (--max-restarts is 0 here); a second loss is below MIN and ends it.
    #[test]
    fn a_lost_node_shrinks_the_round_and_below_min_ends_it() {
        let mut c = elastic(2, 3);
        let (a, _) = join(&mut c, 2);
        let (b, _) = join(&mut c, 0);
        let (d, out) = join(&mut c, 1);
        let g = goes(&out);
        assert_eq!((g[&b].node_rank, g[&d].node_rank, g[&a].node_rank), (0, 1, 2));
        assert_eq!(g[&a].master_port, 4000, "node rank 0's store");
        let out = c.gone(b);
        assert!(
            matches!(&out[..], [(To::All, ToNode::Restart { round: 1, why })] if why.contains("node 0's launcher is gone")),
            "{out:?}"
        );
        // A survivor's workers fail in turn (their peer is gone): merged into the change.
        let failed = ToCoordinator::Failed {
            round: 0,
            report: Report {
                rank: 1,
                oom: false,
                micro: Some(8),
                code: 1,
                infeasible: false,
            },
        };
        assert_eq!(c.on(d, failed), vec![]);
        assert_eq!(c.on(a, ToCoordinator::Stopped { round: 1, port: 5000 }), vec![]);
        let out = c.on(d, ToCoordinator::Stopped { round: 1, port: 5001 });
        let g = goes(&out);
        assert_eq!((g.len(), g[&d].node_rank, g[&a].node_rank), (2, 0, 1));
        assert_eq!(g[&a].master_port, 5001, "the new node 0's fresh port");
        let change = g[&a].change.clone().unwrap();
        assert_eq!((change.old_nodes, change.new_nodes), (3, 2));
        assert!(change.cause.contains("gone"), "{}", change.cause);
        assert!(
            matches!(
                out[0].1,
                ToNode::Go {
                    round: 1,
                    size: Some(8),
                    ..
                }
            ),
            "{out:?}"
        );
        let out = c.gone(a);
        assert!(
            matches!(&out[..], [(To::All, ToNode::Stop { code: 1, why })] if why.contains("below --nnodes MIN 2")),
            "{out:?}"
        );
        assert!(c.settled());
    }

    /// MIN 1, MAX 2: one node starts after the last call; a second joins the running job,
    /// the first stops at a step boundary, and both start the next round.
    #[test]
    fn a_node_joins_a_running_job_and_the_world_grows() {
        let mut c = elastic(1, 2);
        let (a, out) = join(&mut c, usize::MAX);
        assert!(goes(&out).is_empty(), "waits for the last call");
        let g = goes(&c.tick(Instant::now()));
        assert_eq!((g[&a].node_rank, g[&a].nnodes), (0, 1));
        let (b, out) = join(&mut c, usize::MAX);
        assert!(
            matches!(&out[..], [(To::Node(n), ToNode::Welcome { .. }), (To::Node(m), ToNode::Restart { round: 1, .. })] if *n == b && *m == a),
            "{out:?}"
        );
        let g = goes(&c.on(a, ToCoordinator::Stopped { round: 1, port: 0 }));
        assert_eq!((g[&a].node_rank, g[&b].node_rank, g[&b].nnodes), (0, 1, 2));
        assert_eq!(g[&b].change.as_ref().map(|c| (c.old_nodes, c.new_nodes)), Some((1, 2)));
        let (_, out) = join(&mut c, usize::MAX);
        assert!(
            matches!(&out[..], [(_, ToNode::Refused { why })] if why.contains("MAX of 2")),
            "{out:?}"
        );
        c.on(a, ToCoordinator::Done);
        assert!(!c.settled());
        c.on(b, ToCoordinator::Done);
        assert!(c.settled());
    }

    /// A member whose launcher goes silent past the heartbeat's bound is listed (its socket is
    /// then shut, and it is gone as if it had closed); one that beats is not; one that
    /// finished may be quiet.
    #[test]
    fn a_silent_member_is_found_by_its_missing_beats() {
        let mut c = elastic(1, 2);
        let (a, _) = join(&mut c, usize::MAX);
        let (b, _) = join(&mut c, usize::MAX);
        let later = Instant::now() + SILENCE + Duration::from_secs(1);
        assert_eq!(c.silent(Instant::now()), Vec::<usize>::new());
        assert_eq!(c.silent(later), vec![a, b]);
        std::thread::sleep(Duration::from_millis(5));
        c.on(b, ToCoordinator::Beat);
        c.on(a, ToCoordinator::Done);
        let soon = Instant::now() + SILENCE - Duration::from_secs(1);
        assert_eq!(c.silent(soon), Vec::<usize>::new(), "b beat; a finished");
    }

    /// A node stopped by a signal (a preempted pod) leaves: the others go on in a new round;
    /// its connection closing afterwards changes nothing more.
    #[test]
    fn a_node_stopped_by_a_signal_leaves_and_the_rest_go_on() {
        let mut c = elastic(1, 2);
        let (a, _) = join(&mut c, usize::MAX);
        let (b, _) = join(&mut c, usize::MAX);
        let out = c.on(b, ToCoordinator::Abort { code: 143 });
        assert!(
            matches!(&out[..], [(To::All, ToNode::Restart { round: 1, why })] if why.contains("stopped by a signal (143)")),
            "{out:?}"
        );
        assert_eq!(c.gone(b), vec![]);
        let g = goes(&c.on(a, ToCoordinator::Stopped { round: 1, port: 0 }));
        assert_eq!((g[&a].node_rank, g[&a].nnodes), (0, 1));
        assert!(g[&a].change.as_ref().is_some_and(|c| c.cause.contains("signal")));
        // The last one stopped too: below MIN, the job ends with the signal's code.
        let out = c.on(a, ToCoordinator::Abort { code: 143 });
        assert!(
            matches!(&out[..], [(To::All, ToNode::Stop { code: 143, .. })]),
            "{out:?}"
        );
    }

    /// A failure that is not a membership change still counts against --max-restarts.
    #[test]
    fn other_failures_count_as_restarts() {
        let mut c = elastic(1, 1);
        let (a, _) = join(&mut c, usize::MAX);
        let report = Report {
            rank: 0,
            oom: false,
            micro: Some(8),
            code: 7,
            infeasible: false,
        };
        c.on(a, ToCoordinator::Failed { round: 0, report });
        let out = c.on(a, ToCoordinator::Stopped { round: 1, port: 0 });
        assert!(
            matches!(&out[..], [(To::All, ToNode::Stop { code: 7, why })] if why.contains("no restarts left")),
            "{out:?}"
        );
    }

    /// Elastic 1:3, two nodes: one finished (its launcher left), then the other is stopped
    /// by SIGTERM: the job ends with 143 (no worker failed), at once, naming the finish.
    #[test]
    fn a_member_leaving_after_another_finished_ends_the_job_with_its_code() {
        let mut c = elastic(1, 3);
        let (a, _) = join(&mut c, 0);
        let (b, _) = join(&mut c, 1);
        c.tick(std::time::Instant::now());
        c.on(b, ToCoordinator::Done);
        assert_eq!(c.gone(b), vec![]);
        let out = c.on(a, ToCoordinator::Abort { code: 143 });
        assert!(
            matches!(&out[..], [(To::All, ToNode::Stop { code: 143, why })] if why.contains("workers had finished")),
            "{out:?}"
        );
        assert!(c.settled());
    }
}
