//! Owns the launchers' wire protocol: the messages a node's launcher and the coordinator
//! exchange, one JSON object a line, how a line is read (bounded: longer is garbage), and
//! the admission's proofs.
//! Keeps: no message carries the run's secret (OOMGUARD_RUN_TOKEN). A connection opens with
//! the coordinator's challenge (a fresh random nonce); the node's hello answers with an
//! HMAC-SHA256, under the secret, of that challenge, a nonce of its own and the hello's fields;
//! the coordinator's welcome answers with another (its own label, the same inputs), so each
//! side learns that the other knows the secret and neither learns anything it could replay.
use std::io::{BufRead, Read};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use super::super::elastic::Layout;
use super::super::outcome::Report;

/// The longest message line read: the protocol's are far shorter; longer is garbage.
pub(super) const MAX_LINE: u64 = 64 * 1024;
/// The bytes of a nonce (a challenge or a hello's own): 256 random bits, sent in hex.
pub(super) const NONCE_BYTES: usize = 32;

/// A node's launcher asks to join: `id` its --rdzv-id (an identifier, not a secret), `node`
/// its node rank (elastic: the one it prefers, or usize::MAX), `micro` its first micro-batch;
/// `nonce` and `proof` prove that it knows the run's secret (`Side::Node`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub id: String,
    pub node: usize,
    pub micro: Option<usize>,
    /// A port free on this node's host, for its workers' store should it be node 0 of an
    /// elastic round.
    #[serde(default)]
    pub port: u16,
    /// Its workers (`--nproc-per-node`): every node's must be the same, as ranks are laid
    /// out in blocks of it (0: not said).
    #[serde(default)]
    pub nproc: usize,
    /// Random, this launcher's: the coordinator's welcome proves itself over it.
    #[serde(default)]
    pub nonce: String,
    /// `prove(secret, Side::Node, challenge, hello)`: empty in-process (one node).
    #[serde(default)]
    pub proof: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum ToCoordinator {
    /// A node's launcher joins: the first line it sends, in answer to the challenge.
    Hello(Hello),
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
    /// The first line on every connection to the coordinator: a fresh random nonce (hex), for
    /// the hello's proof.
    Challenge {
        nonce: String,
    },
    /// This node is admitted (to this node only): `proof` is `prove(secret, Side::Coordinator,
    /// challenge, hello)`, so the node knows that the coordinator knows the secret too (empty
    /// in-process). It carries no token: every node has the secret already.
    Welcome {
        #[serde(default)]
        proof: String,
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

/// Who proves: the two proofs of one admission differ by this label, so that neither can be
/// passed off as the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    /// The hello's proof.
    Node,
    /// The welcome's.
    Coordinator,
}

/// HMAC-SHA256 under `secret` of the side's label, the coordinator's `challenge` and the
/// hello's fields (its nonce among them, its proof not): what each side sends, in hex.
pub(super) fn prove(secret: &str, side: Side, challenge: &str, hello: &Hello) -> String {
    mac(secret, side, challenge, hello).map_or_else(String::new, |m| hex(&m.finalize().into_bytes()))
}

/// Whether `proof` is `prove(secret, side, challenge, hello)`, compared in constant time. An
/// empty challenge or nonce proves nothing.
pub(super) fn proves(secret: &str, side: Side, challenge: &str, hello: &Hello, proof: &str) -> bool {
    let (Some(m), Some(given)) = (mac(secret, side, challenge, hello), unhex(proof)) else {
        return false;
    };
    !challenge.is_empty() && !hello.nonce.is_empty() && m.verify_slice(&given).is_ok()
}

fn mac(secret: &str, side: Side, challenge: &str, hello: &Hello) -> Option<Hmac<Sha256>> {
    let label = match side {
        Side::Node => "oomguard launch: hello v1",
        Side::Coordinator => "oomguard launch: welcome v1",
    };
    // JSON keeps the fields apart whatever they hold (an id with a newline, say).
    let fields = serde_json::to_string(&(
        label,
        challenge,
        &hello.nonce,
        &hello.id,
        hello.node,
        hello.micro,
        hello.port,
        hello.nproc,
    ))
    .ok()?;
    let mut m = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).ok()?;
    m.update(fields.as_bytes());
    Some(m)
}

/// `bytes` in lower-case hex.
pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            id: "job".into(),
            node: 1,
            micro: Some(8),
            port: 4000,
            nproc: 1,
            nonce: "a1".repeat(NONCE_BYTES),
            proof: String::new(),
        }
    }

    /// A proof holds for its secret, side, challenge and fields only: any other of them (a
    /// wrong secret, the other side's label, another challenge, a changed field), or a proof
    /// cut short or not hex, fails. Neither proof shows the secret, and the two differ.
    #[test]
    fn a_proof_binds_the_secret_the_side_the_challenge_and_the_hello() {
        let (secret, challenge) = ("Our-Own-Secret-4f9c2a71d0", "c3".repeat(NONCE_BYTES));
        let h = hello();
        let p = prove(secret, Side::Node, &challenge, &h);
        assert_eq!(p.len(), 64, "{p}");
        assert!(proves(secret, Side::Node, &challenge, &h, &p));
        assert!(!p.contains(secret) && !p.contains(&hex(secret.as_bytes())));
        let welcome = prove(secret, Side::Coordinator, &challenge, &h);
        assert_ne!(welcome, p, "a hello's proof would pass as the welcome's");
        assert!(!proves(secret, Side::Coordinator, &challenge, &h, &p));
        assert!(!proves("Another-Secret-4f9c2a71d0", Side::Node, &challenge, &h, &p));
        assert!(!proves(secret, Side::Node, &"c4".repeat(NONCE_BYTES), &h, &p));
        let changed = [
            Hello {
                id: "jo".into(),
                ..h.clone()
            },
            Hello { node: 0, ..h.clone() },
            Hello {
                micro: None,
                ..h.clone()
            },
            Hello {
                port: 4001,
                ..h.clone()
            },
            Hello { nproc: 2, ..h.clone() },
            Hello {
                nonce: "a2".repeat(NONCE_BYTES),
                ..h.clone()
            },
        ];
        for c in &changed {
            assert!(!proves(secret, Side::Node, &challenge, c, &p), "{c:?}");
        }
        for bad in [&p[..62], "", "zz", &p.to_uppercase()[..63]] {
            assert!(!proves(secret, Side::Node, &challenge, &h, bad), "{bad:?}");
        }
        // Hex of either case is the same bytes; an empty challenge or nonce proves nothing.
        assert!(proves(secret, Side::Node, &challenge, &h, &p.to_uppercase()));
        let empty = Hello {
            nonce: String::new(),
            ..h.clone()
        };
        assert!(!proves(
            secret,
            Side::Node,
            &challenge,
            &empty,
            &prove(secret, Side::Node, &challenge, &empty)
        ));
        assert!(!proves(secret, Side::Node, "", &h, &prove(secret, Side::Node, "", &h)));
    }

    /// The hello travels as one line, its fields beside the tag; a stranger's hello of the old
    /// form (no nonce, no proof, a `token` field) still parses, with an empty proof, so that it
    /// can be refused with a reason.
    #[test]
    fn a_hello_is_one_line_and_an_old_one_parses_without_a_proof() {
        let l = line(&ToCoordinator::Hello(hello()));
        assert!(
            l.starts_with("{\"msg\":\"hello\",\"id\":\"job\"") && l.ends_with("}\n"),
            "{l}"
        );
        let back: ToCoordinator = serde_json::from_str(l.trim_end()).unwrap();
        assert_eq!(back, ToCoordinator::Hello(hello()));
        let old = r#"{"msg":"hello","id":"none","node":0,"micro":null,"token":"x"}"#;
        match serde_json::from_str::<ToCoordinator>(old).unwrap() {
            ToCoordinator::Hello(h) => {
                assert_eq!((h.id.as_str(), h.proof.as_str(), h.nonce.as_str()), ("none", "", ""))
            }
            other => panic!("{other:?}"),
        }
    }
}
