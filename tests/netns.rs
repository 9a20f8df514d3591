//! Two "nodes" on one machine, each in a network namespace of its own, joined by a veth pair
//! that `tc tbf` holds to 100 Mbit/s: `oomguard launch --nnodes 2` over a real interface (not
//! loopback), with plain data parallel and with ZeRO-2, ends where one process does. Before,
//! Gloo bound to the hostname's address, loopback here, and rank 1 could not connect.
//! Needs root and iproute2, as CI has; elsewhere it says why and checks nothing.
mod common;
use common::netns::{self, Nodes, ADDR};
use common::*;

#[test]
fn two_nodes_over_a_slow_link_equal_one_process() {
    if !netns::available() {
        println!("skipped: network namespaces need root and iproute2 (ip, tc)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "tiny.yaml", TINY);
    let single = train_ok(dir.path(), &cfg, &[]);
    let nodes = Nodes::new("t", Some("100mbit"));
    for (name, extra) in [("plain", vec![]), ("zero2", vec!["--set", "train.shard=gradients"])] {
        let run = dir.path().join(name);
        let outs = nodes.train(&bin(), dir.path(), &cfg, &run, &extra);
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
