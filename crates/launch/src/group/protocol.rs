//! Owns the launchers' wire protocol: the messages a node's launcher and the coordinator
//! exchange, one JSON object a line, and how a line is read (bounded: longer is garbage).
use std::io::{BufRead, Read};

use serde::{Deserialize, Serialize};

use super::super::elastic::Layout;
use super::super::outcome::Report;

/// The longest message line read: the protocol's are far shorter; longer is garbage.
pub(super) const MAX_LINE: u64 = 64 * 1024;

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

/// `msg` as one line of the protocol, its newline included.
pub(super) fn line<T: Serialize>(msg: &T) -> String {
    format!("{}\n", serde_json::to_string(msg).unwrap_or_default())
}

/// One line of at most MAX_LINE bytes, without its newline; None at the end of the stream.
/// A longer line, or one cut off by the end, is an error.
pub(super) fn read_line(r: &mut impl BufRead) -> std::io::Result<Option<String>> {
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

/// Whether `a` and `b` are equal, in a time that does not tell how much of them matches.
pub(super) fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}
