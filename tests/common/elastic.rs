//! Elastic jobs' nodes for the tests and the bench: each a real `oomguard launch --nnodes
//! MIN:MAX` on loopback, one rendezvous endpoint, killed as a node dies (kill -9 of its
//! launcher and its workers at once).
use super::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The bound on the survivors' next step after a node's death.
pub const WITHIN: Duration = Duration::from_secs(30);

/// The tiny GPT over `steps` steps at global batch 15 (uneven shards at 2 and 3 ranks).
pub fn config(dir: &Path, steps: u64) -> PathBuf {
    uneven_config(dir, steps, "memory: {budget: 64MiB}\n")
}

/// One node's launcher: `nnodes` MIN:MAX, at the rendezvous `port`, naming `rank` (its
/// preferred place) when given; its workers (one, or `env`'s PET_NPROC_PER_NODE) train `cfg`
/// into `run`. No --resume: a later round continues the run by itself. Returns once the
/// rendezvous listens at `port` (this node's, or an earlier one's), so that the node started
/// first is always the one that hosts it.
pub fn node(
    dir: &Path,
    cfg: &Path,
    run: &Path,
    nnodes: &str,
    port: u16,
    rank: Option<&str>,
    env: &[(&str, &str)],
) -> Child {
    let endpoint = format!("127.0.0.1:{port}");
    let mut c = Command::new(bin());
    isolated(dies_with_test(&mut c), dir)
        .arg("launch")
        .args(["--nnodes", nnodes, "--rdzv-backend", "c10d"])
        .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "elastic-test"])
        .args(["--monitor-interval", "0.05"])
        .args(rank.map(|r| vec!["--node-rank", r]).unwrap_or_default())
        .args(["--no-python", bin().to_str().unwrap(), "train", cfg.to_str().unwrap()])
        .args(["--run-dir", run.to_str().unwrap()])
        .env("PET_RDZV_CONF", "last_call_timeout=1")
        .env("PET_NPROC_PER_NODE", "1")
        // Several nodes need a secret of the user's, the same on each (docs/launcher.md).
        .env("OOMGUARD_RUN_TOKEN", "elastic-test-secret-3d9a61f0")
        .envs(env.iter().copied())
        .env("OMP_NUM_THREADS", "1")
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    let t = Instant::now();
    while !listening(port) {
        assert!(t.elapsed() < Duration::from_secs(30), "no rendezvous listens at {port}");
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

/// Whether a socket listens at this loopback port: read from /proc/net/tcp, without a
/// connection (which the rendezvous would log as a stranger's).
fn listening(port: u16) -> bool {
    let local = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3 && f[1].ends_with(&local) && f[3] == "0A"
            })
    })
}

/// A free loopback port for the rendezvous.
pub fn free_port() -> u16 {
    super::drawn_ports(1)
}

pub fn steps_of(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "step")
        .collect()
}

/// Waits until a step record at `world` ranks appears after step `after` (a minute at most).
pub fn wait_for_world(run: &Path, world: u64, after: u64) -> Instant {
    let t = Instant::now();
    loop {
        if steps_of(run)
            .iter()
            .any(|s| s["world_size"] == world && s["step"].as_u64().unwrap_or(0) > after)
        {
            return Instant::now();
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no step at world {world}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The last step recorded so far.
pub fn last_step(run: &Path) -> u64 {
    steps_of(run)
        .iter()
        .filter_map(|s| s["step"].as_u64())
        .max()
        .unwrap_or(0)
}

/// A node's death: SIGKILL to its launcher and every worker's process group at once.
pub fn kill(node: &mut Child) {
    let workers = children(node);
    signal_node(node.id(), &workers, libc::SIGKILL);
    let _ = node.wait();
}

/// The processes a launcher started (its workers, each the leader of its process group).
pub fn children(node: &Child) -> Vec<i32> {
    let tasks = std::fs::read_dir(format!("/proc/{}/task", node.id()))
        .into_iter()
        .flatten()
        .flatten();
    tasks
        .flat_map(|t| {
            std::fs::read_to_string(t.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Sends `sig` to a node: its launcher and every worker's process group.
pub fn signal_node(launcher: u32, workers: &[i32], sig: i32) {
    for w in workers {
        // SAFETY: plain syscalls.
        unsafe { libc::killpg(*w, sig) };
    }
    unsafe { libc::kill(launcher as i32, sig) };
}

/// `nodes` nodes of an elastic job (`--nnodes nodes-1:nodes`), one rank each, started by
/// their --node-rank; the rendezvous's host is never `victim` (the job's fixed point). Host
/// first, then the others, each with its node rank.
pub fn start_nodes(
    dir: &Path,
    cfg: &Path,
    run: &Path,
    nodes: usize,
    victim: usize,
    env: &[(&str, &str)],
) -> Vec<(usize, Child)> {
    let port = free_port();
    let nnodes = format!("{}:{nodes}", nodes - 1);
    let host = if victim == nodes - 1 { 0 } else { nodes - 1 };
    let order = std::iter::once(host).chain((0..nodes).filter(|&r| r != host));
    order
        .map(|r| (r, node(dir, cfg, run, &nnodes, port, Some(&r.to_string()), env)))
        .collect()
}
