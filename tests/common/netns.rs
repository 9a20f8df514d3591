//! Two "nodes" on one machine: network namespaces of their own joined by a veth pair,
//! optionally held to a rate by `tc tbf`, each running a launcher over the real interface
//! (10.77.0.1 and .2), never loopback. No traffic leaves the machine. Needs root and
//! iproute2 (`available` says whether this machine has them).
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

pub const ADDR: [&str; 2] = ["10.77.0.1", "10.77.0.2"];

/// The namespaces and their link; deleted on drop (the veth pair goes with them), also when
/// an assertion fails or a bench panics.
pub struct Nodes {
    ns: [String; 2],
    veth: [String; 2],
}

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().expect("runs ip")
}

fn ok(o: Output, what: &str) {
    assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
}

/// Whether this machine can make namespaces: root, with iproute2.
pub fn available() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("ip").arg("-V").output().is_ok_and(|o| o.status.success())
}

/// True, saying why, where `available` is not (a test then checks nothing).
pub fn skipped() -> bool {
    let skip = !available();
    if skip {
        println!("skipped: network namespaces need root and iproute2 (ip, tc)");
    }
    skip
}

impl Nodes {
    /// Two nodes whose link carries `rate` (tc's spelling: `100mbit`, `1gbit`) each way, or
    /// the veth's own speed with None. `tag` keeps two sets apart (names are per process).
    pub fn new(tag: &str, rate: Option<&str>) -> Nodes {
        let id = std::process::id();
        let nodes = Nodes {
            ns: [format!("og{id}{tag}0"), format!("og{id}{tag}1")],
            veth: [format!("ogv{id}{tag}a"), format!("ogv{id}{tag}b")],
        };
        let veth = &nodes.veth;
        for n in &nodes.ns {
            ok(ip(&["netns", "add", n]), "ip netns add");
        }
        ok(
            ip(&["link", "add", &veth[0], "type", "veth", "peer", "name", &veth[1]]),
            "ip link add",
        );
        for i in 0..2 {
            let (n, v) = (nodes.ns[i].as_str(), veth[i].as_str());
            ok(ip(&["link", "set", v, "netns", n]), "ip link set netns");
            ok(
                ip(&["-n", n, "addr", "add", &format!("{}/24", ADDR[i]), "dev", v]),
                "ip addr add",
            );
            ok(ip(&["-n", n, "link", "set", "lo", "up"]), "lo up");
            ok(ip(&["-n", n, "link", "set", v, "up"]), "veth up");
            if let Some(rate) = rate {
                let tc = Command::new("tc")
                    .args(["-n", n, "qdisc", "add", "dev", v, "root", "tbf", "rate", rate])
                    .args(["burst", "256kb", "latency", "50ms"])
                    .output()
                    .expect("runs tc");
                ok(tc, "tc qdisc add tbf");
            }
        }
        nodes
    }

    /// The bytes node `i` has sent on its link so far (the kernel's count).
    pub fn tx_bytes(&self, i: usize) -> u64 {
        let o = ip(&["-n", &self.ns[i], "-s", "-j", "link", "show", "dev", &self.veth[i]]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("ip -j prints JSON");
        v[0]["stats64"]["tx"]["bytes"].as_u64().expect("a tx byte count")
    }

    /// Node `i`'s launcher in its namespace: `bin launch LAUNCH --node-rank i
    /// --nproc-per-node 1 WORKER` (WORKER: a script and its arguments, or `--no-python` and a
    /// program), with `env` and the run's token, its output piped.
    pub fn launcher(
        &self,
        i: usize,
        bin: &Path,
        dir: &Path,
        launch: &[&str],
        worker: &[&str],
        env: &[(&str, &str)],
    ) -> Child {
        let token = format!("{:032x}", std::process::id() as u128 * 0x9E37_79B9_7F4A_7C15);
        let mut c = Command::new("ip");
        super::dies_with_test(&mut c)
            .args(["netns", "exec", &self.ns[i]])
            .arg(bin)
            .arg("launch")
            .args(launch)
            .args(["--node-rank", &i.to_string(), "--nproc-per-node", "1"])
            .args(worker)
            .env("OOMGUARD_RUN_TOKEN", &token)
            .envs(env.iter().copied())
            .current_dir(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Both nodes' launchers (`--nnodes 2`, one rank each), each training `cfg` into `run`
    /// with `extra`, to their end.
    pub fn train(&self, bin: &Path, dir: &Path, cfg: &Path, run: &Path, extra: &[&str]) -> [Output; 2] {
        let launch = ["--nnodes", "2", "--master-addr", ADDR[0], "--master-port", "29517"];
        let (bin_s, cfg_s, run_s) = (bin.to_str().unwrap(), cfg.to_str().unwrap(), run.to_str().unwrap());
        let train = [&["--no-python", bin_s, "train", cfg_s, "--run-dir", run_s], extra].concat();
        let children: Vec<Child> = (0..2)
            .map(|i| self.launcher(i, bin, dir, &launch, &train, &[]))
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
