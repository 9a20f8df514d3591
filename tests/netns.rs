//! Two "nodes" on one machine, each in a network namespace of its own, joined by a veth pair
//! that `tc tbf` holds to 100 Mbit/s: `oomguard launch --nnodes 2` over a real interface (not
//! loopback), with plain data parallel and with ZeRO-2, ends where one process does. Before,
//! Gloo bound to the hostname's address, loopback here, and rank 1 could not connect.
//! Needs root and iproute2, as CI has; elsewhere it says why and checks nothing.
mod common;
use common::*;
use std::path::Path;
use std::process::{Command, Output};

/// Two namespaces and their link; deleted on drop (the veth pair goes with them), also when
/// an assertion fails.
struct Nodes {
    ns: [String; 2],
}

const ADDR: [&str; 2] = ["10.77.0.1", "10.77.0.2"];

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().expect("runs ip")
}

fn ok(o: Output, what: &str) {
    assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
}

impl Nodes {
    fn new() -> Nodes {
        let id = std::process::id();
        let nodes = Nodes {
            ns: [format!("og{id}n0"), format!("og{id}n1")],
        };
        let veth = [format!("ogv{id}a"), format!("ogv{id}b")];
        for n in &nodes.ns {
            ok(ip(&["netns", "add", n]), "ip netns add");
        }
        ok(ip(&["link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1]]), "ip link add");
        for i in 0..2 {
            let (n, v) = (nodes.ns[i].as_str(), veth[i].as_str());
            ok(ip(&["link", "set", v, "netns", n]), "ip link set netns");
            ok(ip(&["-n", n, "addr", "add", &format!("{}/24", ADDR[i]), "dev", v]), "ip addr add");
            ok(ip(&["-n", n, "link", "set", "lo", "up"]), "lo up");
            ok(ip(&["-n", n, "link", "set", v, "up"]), "veth up");
            let tc = Command::new("tc")
                .args(["-n", n, "qdisc", "add", "dev", v, "root", "tbf", "rate", "100mbit"])
                .args(["burst", "256kb", "latency", "50ms"])
                .output()
                .expect("runs tc");
            ok(tc, "tc qdisc add tbf");
        }
        nodes
    }

    /// Both nodes' launchers, each `--nproc-per-node 1`, training `cfg` into `run`.
    fn train(&self, dir: &Path, cfg: &Path, run: &Path, extra: &[&str]) -> [Output; 2] {
        let token = format!("{:032x}", std::process::id() as u128 * 0x9E37_79B9_7F4A_7C15);
        let bin = bin();
        let children: Vec<_> = (0..2)
            .map(|r| {
                let mut c = Command::new("ip");
                dies_with_test(&mut c)
                    .args(["netns", "exec", &self.ns[r]])
                    .arg(&bin)
                    .args(["launch", "--nnodes", "2", "--node-rank", &r.to_string(), "--nproc-per-node", "1"])
                    .args(["--master-addr", ADDR[0], "--master-port", "29517", "--no-python"])
                    .arg(&bin)
                    .args(["train", cfg.to_str().unwrap(), "--run-dir", run.to_str().unwrap()])
                    .args(extra)
                    .env("OOMGUARD_RUN_TOKEN", &token)
                    .current_dir(dir)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut outs = children.into_iter().map(|c| c.wait_with_output().unwrap());
        [outs.next().unwrap(), outs.next().unwrap()]
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for n in &self.ns {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

fn can_make_namespaces() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("ip").arg("-V").output().is_ok_and(|o| o.status.success())
}

#[test]
fn two_nodes_over_a_slow_link_equal_one_process() {
    if !can_make_namespaces() {
        println!("skipped: network namespaces need root and iproute2 (ip, tc)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let single = train_ok(dir.path(), &cfg, &[]);
    let nodes = Nodes::new();
    for (name, extra) in [("plain", vec![]), ("zero2", vec!["--set", "train.shard=gradients"])] {
        let run = dir.path().join(name);
        let outs = nodes.train(dir.path(), &cfg, &run, &extra);
        for (r, o) in outs.iter().enumerate() {
            assert!(o.status.success(), "{name}: node {r}: {}", stderr(o));
        }
        let joined = stderr(&outs[1]);
        assert!(
            joined.contains(&format!("rank 1 of 2 (gloo) joined the group at {}", ADDR[0])),
            "{name}: {joined}"
        );
        let d = max_abs_diff(&weights(&single), &weights(&run));
        assert!(d < 1e-5, "{name}: two nodes differ from one process by {d}");
    }
}
