//! Owns a torchrun-compatible launcher, with no libtorch: validated options, the workers'
//! environment, and supervision with restarts that halve the micro-batch after an OOM death.
//! Keeps: options are validated before any worker starts; the workers' environment is pure.
//!
//! ```
//! use clap::Parser;
//! use oomguard_launch::{LaunchArgs, LaunchSpec};
//!
//! #[derive(Parser)]
//! struct Launch {
//!     #[command(flatten)]
//!     args: LaunchArgs,
//! }
//! // torchrun's spellings, with underscores or hyphens.
//! let l = Launch::parse_from(["launch", "--nproc_per_node=2", "--master-port", "29400", "train.py"]);
//! let spec = LaunchSpec::from_args(&l.args)?;
//! assert_eq!((spec.nproc_per_node, spec.master_port, spec.nnodes), (2, 29400, 1));
//! # Ok::<(), oomguard_launch::LaunchError>(())
//! ```
mod args;
mod elastic;
mod group;
mod outcome;
mod output;
mod supervise;

pub use args::LaunchArgs;
pub use elastic::{Elastic, ELASTIC_VAR, MEMBERSHIP_VAR};
pub use supervise::run;

use std::collections::BTreeMap;
use std::path::PathBuf;

use oomguard_console::ConfigError;
use oomguard_host::allocator::{self, AllocatorSettings};
use oomguard_host::{num_gpus, HostMemory, Threads};

/// Why a launch could not run (a failed worker is an exit code, not an error).
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A worker could not be started.
    #[error("{0}")]
    Start(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    /// A signal (its number) while this node waited for the group: the launcher exits 128+it.
    #[error("received signal {0} while waiting for the group")]
    Signaled(i32),
    /// The group ended before its first round (another node's launcher was stopped by a
    /// signal, or is gone): this launcher exits with the group's code.
    #[error("the group stopped before it started: {why}")]
    Stopped { code: i32, why: String },
}

type Error = LaunchError;

/// Which streams go to files (and whether also to the console), per local rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streams {
    pub stdout: bool,
    pub stderr: bool,
}

/// The validated launch.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub nnodes: usize,
    pub nproc_per_node: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// 0: pick a free port.
    pub master_port: u16,
    pub run_id: String,
    pub role: String,
    pub max_restarts: u32,
    pub monitor_interval: std::time::Duration,
    /// SIGTERM to SIGKILL: how long workers get to exit (torchrun's --shutdown-timeout).
    pub shutdown_timeout: std::time::Duration,
    pub log_dir: Option<PathBuf>,
    /// `--run-dir`: the workers' OOMGUARD_RUN_DIR (absolute).
    pub run_dir: Option<PathBuf>,
    pub redirects: BTreeMap<usize, Streams>,
    pub tee: BTreeMap<usize, Streams>,
    pub console_ranks: Option<Vec<usize>>,
    /// The worker's program and arguments (python3 added unless --no-python).
    pub program: Vec<String>,
    /// Whether `program[0]` is the Python interpreter (not --no-python).
    pub python: bool,
    pub allocator: AllocatorSettings,
    /// OMP_NUM_THREADS for each worker: this host's threads divided among the local workers
    /// (when it is unset and there is more than one), and the host's figure for the log.
    pub worker_threads: Option<(usize, Threads)>,
    /// Each local worker's share of this host's memory (more than one worker per node).
    pub worker_memory: Option<HostMemory>,
    /// The micro-batch the first attempt runs with, when known.
    pub micro_batch_size: Option<usize>,
    /// The run's secret, the workers' OOMGUARD_RUN_TOKEN: what ranks check in the store and
    /// present to each other's exchange, so that nobody outside the run can join it. On one
    /// node, 256 random bits from the OS unless the user gave it (`token_given`); on several,
    /// always the user's, the same on every node: node 0's coordinator admits a node's launcher
    /// only once it proves that it knows it (group/protocol.rs), and the launchers never send
    /// it. Never printed: its Debug form hides it.
    pub token: Token,
    /// Whether the token is the user's, OOMGUARD_RUN_TOKEN in the launcher's environment
    /// (required with more than one node).
    pub token_given: bool,
    /// `--nnodes MIN:MAX`: node ranks, the node count and rank 0's address come from each
    /// round's rendezvous (elastic.rs) and replace `node_rank`, `nnodes` and `master_*` there.
    pub elastic: Option<Elastic>,
    /// Elastic: the `--node-rank` given, a preference for this node's place.
    pub named_rank: Option<usize>,
    /// Elastic: the membership change that began this round, for the workers (JSON).
    pub membership: Option<String>,
    /// The workers' GLOO_SOCKET_IFNAME (`gloo_interface`), on several nodes.
    pub gloo_ifname: Option<String>,
}

/// Gloo's interface for the workers (GLOO_SOCKET_IFNAME), when the job spans nodes and the
/// user named none: the one on this host's route to MASTER_ADDR. Gloo's default, the
/// hostname's address, is loopback wherever /etc/hosts maps the hostname there, and a
/// user's own `init_process_group("gloo")` then cannot connect across nodes.
fn gloo_interface(nnodes: usize, master_addr: &str) -> Option<String> {
    if nnodes < 2 || std::env::var_os("GLOO_SOCKET_IFNAME").is_some() {
        return None;
    }
    let ip = oomguard_exchange::local_ip_towards(master_addr).ok()?;
    (!ip.is_loopback())
        .then(|| oomguard_exchange::interface_of(ip))
        .flatten()
}

fn bad(flag: &str, message: String) -> Error {
    LaunchError::Config(ConfigError {
        origin: flag.into(),
        line_col: None,
        key: String::new(),
        message,
    })
}

impl LaunchSpec {
    /// The launch `a` asks for, OOMGUARD_RUN_TOKEN read from this process's environment.
    pub fn from_args(a: &LaunchArgs) -> Result<LaunchSpec, Error> {
        LaunchSpec::with_token(a, std::env::var_os(TOKEN_VAR))
    }

    /// `from_args` with `token`, the user's OOMGUARD_RUN_TOKEN if any.
    fn with_token(a: &LaunchArgs, token: Option<std::ffi::OsString>) -> Result<LaunchSpec, Error> {
        if let Some(flag) = a.command.first().filter(|c| c.starts_with('-')) {
            return Err(bad(
                flag,
                "is not an option of oomguard launch (torchrun's options, spelled with - or _: see --help), and not a \
                script: put the options before the script"
                    .into(),
            ));
        }
        for what in a.ignored.given() {
            tracing::warn!("ignored, as it has no effect here: {what}");
        }
        let (min, nnodes) = parse_nnodes(if a.standalone { "1" } else { &a.nnodes })?;
        // torchrun's c10d rendezvous over N nodes with no --node-rank (its usual multi-node
        // form): the rendezvous assigns the node ranks, as an elastic N:N job here.
        let assigned = !a.standalone
            && nnodes > 1
            && a.rdzv_backend == "c10d"
            && a.node_rank.is_none()
            && !a.rdzv_endpoint.is_empty();
        let elastic = (min < nnodes || assigned)
            .then(|| Elastic::new(min, nnodes, &a.rdzv_conf).map_err(|e| bad("--rdzv-conf", e)))
            .transpose()?;
        if elastic.is_some() && (a.rdzv_backend != "c10d" || a.rdzv_endpoint.is_empty()) {
            return Err(bad(
                "--nnodes",
                format!(
                    "elastic {} (MIN:MAX) needs --rdzv-backend c10d and --rdzv-endpoint HOST:PORT, the same on every node \
                    (its host's launcher hosts the rendezvous)",
                    a.nnodes
                ),
            ));
        }
        let nproc_per_node = parse_nproc(&a.nproc_per_node)?;
        let node_rank = a.node_rank.unwrap_or(0);
        if node_rank >= nnodes && elastic.is_none() {
            return Err(bad(
                "--node-rank",
                format!("{node_rank} is not below --nnodes {nnodes}"),
            ));
        }
        // torchrun 2.13 (`run.py`): one node and no port asked for rendezvous at a free port.
        let one_node = nnodes == 1 && elastic.is_none();
        let default_port = if one_node { 0 } else { DEFAULT_MASTER_PORT };
        let (mut master_addr, mut master_port) = (a.master_addr.clone(), a.master_port.unwrap_or(default_port));
        if a.standalone {
            (master_addr, master_port) = ("127.0.0.1".into(), 0);
        } else if !a.rdzv_endpoint.is_empty() {
            (master_addr, master_port) = endpoint(&a.rdzv_endpoint).map_err(|why| bad("--rdzv-endpoint", why))?;
        }
        match a.rdzv_backend.as_str() {
            "static" => {}
            "c10d" if nnodes == 1 || a.node_rank.is_some() || elastic.is_some() => {}
            "c10d" => {
                return Err(bad(
                    "--rdzv-backend",
                    "c10d over several nodes needs --rdzv-endpoint HOST:PORT (the rendezvous then ranks the nodes), or \
                     --node-rank on each node"
                        .into(),
                ));
            }
            other => {
                return Err(bad(
                    "--rdzv-backend",
                    format!("`{other}` is not supported; use static or c10d"),
                ))
            }
        }
        if !(a.monitor_interval > 0.0 && a.monitor_interval <= MAX_SECONDS) {
            return Err(bad(
                "--monitor-interval",
                format!(
                    "{} must be a positive number of seconds, at most {MAX_SECONDS}",
                    a.monitor_interval
                ),
            ));
        }
        if !(a.shutdown_timeout >= 0.0 && a.shutdown_timeout <= MAX_SECONDS) {
            return Err(bad(
                "--shutdown-timeout",
                format!(
                    "{} must be 0 or more seconds, at most {MAX_SECONDS}",
                    a.shutdown_timeout
                ),
            ));
        }
        let (token, token_given) = run_token(token)?;
        if nnodes > 1 && !token_given {
            return Err(bad(TOKEN_VAR, several_nodes_need_a_secret(&a.nnodes)));
        }
        let from_env = allocator::effective(&default_allocator(), |v| std::env::var(v).ok())?;
        let gloo_ifname = gloo_interface(nnodes, &master_addr);
        Ok(LaunchSpec {
            nnodes,
            nproc_per_node,
            node_rank,
            master_addr,
            master_port,
            run_id: a.rdzv_id.clone(),
            role: a.role.clone(),
            max_restarts: a.max_restarts,
            monitor_interval: std::time::Duration::from_secs_f64(a.monitor_interval),
            shutdown_timeout: std::time::Duration::from_secs_f64(a.shutdown_timeout),
            log_dir: a.log_dir.clone(),
            run_dir: a
                .run_dir
                .as_ref()
                .map(|d| std::path::absolute(d).unwrap_or_else(|_| d.clone())),
            redirects: parse_streams("--redirects", &a.redirects, nproc_per_node)?,
            tee: parse_streams("--tee", &a.tee, nproc_per_node)?,
            console_ranks: parse_filter(&a.local_ranks_filter)?,
            program: worker_program(
                a,
                &[PYTHON_VAR, "PYTHON_EXEC"]
                    .iter()
                    .find_map(|v| std::env::var(v).ok().filter(|p| !p.is_empty()))
                    .unwrap_or("python3".into()),
            ),
            python: !a.no_python,
            allocator: from_env,
            worker_threads: (nproc_per_node > 1 && std::env::var_os("OMP_NUM_THREADS").is_none()).then(|| {
                let t = Threads::of_self();
                (t.share(nproc_per_node), t)
            }),
            worker_memory: (nproc_per_node > 1).then(HostMemory::of_self).flatten(),
            micro_batch_size: std::env::var(MICRO_BATCH_VAR).ok().and_then(|v| v.parse().ok()),
            token: Token(token),
            token_given,
            elastic,
            named_rank: a.node_rank,
            membership: None,
            gloo_ifname,
        })
    }

    /// This launch as one elastic round places it (`layout`).
    pub(crate) fn in_round(&self, layout: &elastic::Layout) -> LaunchSpec {
        LaunchSpec {
            nnodes: layout.nnodes,
            node_rank: layout.node_rank,
            master_addr: layout.master_addr.clone(),
            master_port: layout.master_port,
            membership: layout.change.as_ref().map(|c| c.for_workers(self.nproc_per_node)),
            gloo_ifname: gloo_interface(layout.nnodes, &layout.master_addr),
            ..self.clone()
        }
    }
}

/// The longest wait a flag may give, in seconds (about 31 years): a Duration and an Instant
/// plus it stay representable.
pub(crate) const MAX_SECONDS: f64 = 1e9;

/// The rank-0 node's port across nodes when none is given (torchrun's).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Read by `oomguard train`; set by the launcher after an out-of-memory death.
pub const MICRO_BATCH_VAR: &str = "OOMGUARD_MICRO_BATCH_SIZE";
/// The size the worker died at, so the relaunched run lets it cool down before growing back.
pub const FAILED_MICRO_BATCH_VAR: &str = "OOMGUARD_FAILED_MICRO_BATCH_SIZE";

/// A run's token. `{:?}` shows its length, never its value, so no debug print of a spec or of
/// the coordinator can leak it; `reveal` is for the workers' environment and the rendezvous.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    pub fn new(token: String) -> Token {
        Token(token)
    }
    pub fn reveal(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(hidden, {} bytes)", self.0.len())
    }
}

/// The run's token, as the workers read it; in the launcher's own environment, the user's.
pub const TOKEN_VAR: &str = "OOMGUARD_RUN_TOKEN";
/// The launcher's pid, in every worker's environment.
pub const LAUNCHER_PID_VAR: &str = "OOMGUARD_LAUNCHER_PID";
/// Bounds on a token the user gives: long enough to be a secret, short enough for a hello.
const TOKEN_LEN: std::ops::RangeInclusive<usize> = 16..=1024;

/// Why a job over several nodes (`--nnodes` N > 1, or MIN:MAX with MAX > 1) cannot start
/// without OOMGUARD_RUN_TOKEN, and the fix.
fn several_nodes_need_a_secret(nnodes: &str) -> String {
    format!(
        "is unset, and a job over several nodes (--nnodes {nnodes}) needs it: node 0's launcher admits a node's launcher \
        only once it has proven that it knows this secret, which the launchers never send. Set the same value in every \
        node's launcher's environment, for example `export {TOKEN_VAR}=$(openssl rand -hex 32)` where the job is submitted \
        (docs/data-parallel.md#security-of-a-multi-node-run)"
    )
}

/// The run's token and whether it is the user's: `given` (OOMGUARD_RUN_TOKEN in the
/// launcher's environment) when set, checked; else 32 random bytes from the OS, in hex.
/// No message names the token's value.
pub fn run_token(given: Option<std::ffi::OsString>) -> Result<(String, bool), Error> {
    let Some(given) = given else {
        return random_hex(32).map(|t| (t, false));
    };
    let refuse = |why: String| Err(bad(TOKEN_VAR, why));
    let Some(t) = given.to_str() else {
        return refuse("is not UTF-8 text".into());
    };
    if t.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return refuse(
            "holds whitespace or a control character (a NUL, a newline); give a token of printable characters".into(),
        );
    }
    if !TOKEN_LEN.contains(&t.len()) {
        return refuse(format!(
            "is {} bytes long: a run's token takes {} to {} (unset it and the launcher makes a random one)",
            t.len(),
            TOKEN_LEN.start(),
            TOKEN_LEN.end()
        ));
    }
    Ok((t.to_string(), true))
}

/// `bytes` bytes from the kernel's random source (/dev/urandom), in lower-case hex.
pub(crate) fn random_hex(bytes: usize) -> Result<String, Error> {
    use std::io::Read;
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|source| Error::Io {
            context: "reading /dev/urandom for a random token or nonce".into(),
            source,
        })?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn default_allocator() -> AllocatorSettings {
    AllocatorSettings::parse("expandable_segments:True", "").unwrap_or_default()
}

/// `N` or `N:N`: (N, N); elastic `MIN:MAX`: (MIN, MAX).
fn parse_nnodes(s: &str) -> Result<(usize, usize), Error> {
    let (min, max) = s.split_once(':').unwrap_or((s, s));
    match (min.parse::<usize>(), max.parse::<usize>()) {
        (Ok(a), Ok(b)) if a >= 1 && b >= a => Ok((a, b)),
        (Ok(a), Ok(b)) if a >= 1 && b >= 1 => Err(bad(
            "--nnodes",
            format!("`{s}`: MIN is above MAX; give MIN:MAX with MIN <= MAX"),
        )),
        _ => Err(bad("--nnodes", format!("`{s}` is not a number of nodes, nor MIN:MAX"))),
    }
}

fn parse_nproc(s: &str) -> Result<usize, Error> {
    let cpus = || std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    match s {
        "cpu" => Ok(cpus()),
        "gpu" => match num_gpus() {
            0 => Err(bad("--nproc-per-node", "gpu: no GPU is visible".into())),
            n => Ok(n),
        },
        "auto" => Ok(match num_gpus() {
            0 => cpus(),
            n => n,
        }),
        n => match n.parse::<usize>() {
            Ok(k) if (1..=MAX_NPROC).contains(&k) => Ok(k),
            Ok(k) => Err(bad(
                "--nproc-per-node",
                format!("is {k}; give 1 to {MAX_NPROC} workers on this node (or auto, cpu, gpu)"),
            )),
            Err(_) => Err(bad(
                "--nproc-per-node",
                format!("`{n}` is not a number, auto, cpu or gpu"),
            )),
        },
    }
}

/// The most workers one launcher starts: far above any node's devices or cores.
pub const MAX_NPROC: usize = 4096;

/// `3`, or per local rank `0:1,1:2` (1 stdout, 2 stderr, 3 both).
fn parse_streams(flag: &str, s: &str, nproc: usize) -> Result<BTreeMap<usize, Streams>, Error> {
    let code = |c: &str| -> Result<Streams, Error> {
        match c.trim() {
            "0" => Ok(Streams::default()),
            "1" => Ok(Streams {
                stdout: true,
                stderr: false,
            }),
            "2" => Ok(Streams {
                stdout: false,
                stderr: true,
            }),
            "3" => Ok(Streams {
                stdout: true,
                stderr: true,
            }),
            other => Err(bad(flag, format!("`{other}` is not 0, 1, 2 or 3"))),
        }
    };
    if !s.contains(':') {
        let all = code(s)?;
        return Ok((0..nproc).map(|r| (r, all)).collect());
    }
    s.split(',')
        .map(|item| {
            let (r, c) = item
                .split_once(':')
                .ok_or_else(|| bad(flag, format!("`{item}` is not RANK:CODE")))?;
            Ok((
                r.trim()
                    .parse()
                    .map_err(|_| bad(flag, format!("`{r}` is not a local rank")))?,
                code(c)?,
            ))
        })
        .collect()
}

fn parse_filter(s: &str) -> Result<Option<Vec<usize>>, Error> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    s.split(',')
        .map(|r| {
            r.trim()
                .parse()
                .map_err(|_| bad("--local-ranks-filter", format!("`{r}` is not a local rank")))
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

/// The interpreter a Python worker runs under: $OOMGUARD_PYTHON (which the wheel's `oomguard`
/// sets to the Python it was installed with), else torchrun's $PYTHON_EXEC, else `python3`
/// from PATH, as torchrun's workers.
pub const PYTHON_VAR: &str = "OOMGUARD_PYTHON";

/// The command each worker runs: under `python` (as torchrun does) unless --no-python.
fn worker_program(a: &LaunchArgs, python: &str) -> Vec<String> {
    let (script, rest) = (&a.command[0], &a.command[1..]);
    let py = |more: &[&str]| {
        let mut v = vec![python.to_string(), "-u".into()];
        v.extend(more.iter().map(|m| m.to_string()));
        v.push(script.clone());
        v
    };
    let mut p: Vec<String> = if a.no_python {
        vec![script.clone()]
    } else if a.module {
        py(&["-m"])
    } else if a.run_path {
        py(&[
            "-c",
            "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
        ])
    } else {
        py(&[])
    };
    p.extend(rest.iter().cloned());
    p
}

/// How a worker's error says that even micro-batch 1 does not fit (exit 3): the Python
/// guard's last line, `oomguard train`'s error file.
pub const INFEASIBLE: &str = "oomguard.Infeasible: ";

const NCCL_ERRORS: &str = "TORCH_NCCL_ASYNC_ERROR_HANDLING";

/// Everything the launcher sets in one worker's environment, as torchrun does.
pub fn worker_env(
    spec: &LaunchSpec,
    local_rank: usize,
    master_port: u16,
    restart_count: u32,
    error_file: &std::path::Path,
    micro: Micro,
) -> Vec<(String, String)> {
    let world = spec.nnodes * spec.nproc_per_node;
    let rank = spec.node_rank * spec.nproc_per_node + local_rank;
    let mut env: Vec<(String, String)> = [
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("GROUP_RANK", spec.node_rank.to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("ROLE_NAME", spec.role.clone()),
        ("LOCAL_WORLD_SIZE", spec.nproc_per_node.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("GROUP_WORLD_SIZE", spec.nnodes.to_string()),
        ("ROLE_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", spec.master_addr.clone()),
        ("MASTER_PORT", master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", restart_count.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", spec.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", spec.run_id.clone()),
        ("TORCHELASTIC_ERROR_FILE", error_file.display().to_string()),
        (TOKEN_VAR, spec.token.reveal().to_string()),
        // A worker tells this launcher's forward of a signal from a new one (`oomguard train`).
        (LAUNCHER_PID_VAR, std::process::id().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // torchrun's default; a value of the user's own reaches the workers as it is.
    if std::env::var_os(NCCL_ERRORS).is_none() {
        env.push((NCCL_ERRORS.into(), "1".into()));
    }
    if let Some((n, _)) = &spec.worker_threads {
        env.push(("OMP_NUM_THREADS".into(), n.to_string()));
    }
    if let Some(d) = &spec.run_dir {
        env.push(("OOMGUARD_RUN_DIR".into(), d.display().to_string()));
    }
    if let Some(m) = &spec.worker_memory {
        env.extend(m.share_env(spec.nproc_per_node));
    }
    if !spec.allocator.is_empty() {
        for var in allocator::ENV_VARS {
            env.push((var.into(), spec.allocator.render()));
        }
    }
    if let Some(mb) = micro.size {
        env.push((MICRO_BATCH_VAR.into(), mb.to_string()));
    }
    if let Some(f) = micro.failed {
        env.push((FAILED_MICRO_BATCH_VAR.into(), f.to_string()));
    }
    if let Some(e) = &spec.elastic {
        env.push((ELASTIC_VAR.into(), format!("{}:{}", e.min, e.max)));
    }
    if let Some(m) = &spec.membership {
        env.push((MEMBERSHIP_VAR.into(), m.clone()));
    }
    if let Some(i) = &spec.gloo_ifname {
        env.push(("GLOO_SOCKET_IFNAME".into(), i.clone()));
    }
    env
}

/// The micro-batch an attempt runs with, and the size an earlier attempt died of an OOM at.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Micro {
    pub size: Option<usize>,
    pub failed: Option<usize>,
}

/// `--rdzv-endpoint` as torchrun reads it: HOST[:PORT] (29400 when none), an IPv6 address
/// in brackets (`[::1]:29400`, `[fe80::1]`), the brackets dropped.
fn endpoint(s: &str) -> Result<(String, u16), String> {
    let bad = || format!("`{s}` is not HOST:PORT (an IPv6 address in brackets: [::1]:29400)");
    let (host, port) = match s.strip_prefix('[').and_then(|r| r.split_once(']')) {
        Some((h, "")) => (h, None),
        Some((h, rest)) => (h, Some(rest.strip_prefix(':').ok_or_else(bad)?)),
        None => match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        },
    };
    let port = port.map_or(Ok(29400), |p| p.parse::<u16>().map_err(|_| bad()))?;
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// The spec of `oomguard launch ARGS`, with a token of the user's (several nodes need one).
    fn spec(args: &[&str]) -> Result<LaunchSpec, Error> {
        spec_with(args, Some("Our-Own-Secret-4f9c2a71d0"))
    }

    fn spec_with(args: &[&str], token: Option<&str>) -> Result<LaunchSpec, Error> {
        #[derive(Parser)]
        struct Launch {
            #[command(flatten)]
            args: LaunchArgs,
        }
        let cli =
            Launch::try_parse_from([&["oomguard launch"], args].concat()).map_err(|e| bad("cli", e.to_string()))?;
        LaunchSpec::with_token(&cli.args, token.map(Into::into))
    }

    /// torchrun's endpoints: a port or 29400, an IPv6 address in brackets with or without a
    /// port; no host, or a port that is not one, refused.
    #[test]
    fn rendezvous_endpoints_read_as_torchrun_reads_them() {
        let ok = |s: &str, h: &str, p: u16| assert_eq!(endpoint(s), Ok((h.to_string(), p)), "{s}");
        ok("node0:1234", "node0", 1234);
        ok("node0", "node0", 29400);
        ok("[::1]:29500", "::1", 29500);
        ok("[fe80::1]", "fe80::1", 29400);
        ok("10.0.0.1:0", "10.0.0.1", 0);
        for s in [":29400", "[]:5", "[::1]x", "h:port", "h:70000", "[::1]:"] {
            assert!(endpoint(s).is_err(), "{s}");
        }
        let e = spec(&[
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "[::1]:29500",
            "--nnodes",
            "1:2",
            "x",
        ])
        .unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("::1", 29500));
    }

    /// More than one node, static or elastic (its MAX), needs OOMGUARD_RUN_TOKEN: without it the
    /// launch is refused, naming the variable and how to make one; one node (`--nnodes 1`,
    /// `1:1`, `--standalone`) makes its own random token as before.
    #[test]
    fn several_nodes_need_a_token_of_the_users_and_one_node_does_not() {
        let elastic = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5"];
        for args in [
            &["--nnodes", "2", "--node-rank", "0"][..],
            &["--nnodes", "2", "--node-rank", "1"],
            &[&["--nnodes", "1:2"][..], &elastic].concat(),
            &[&["--nnodes", "2:4"][..], &elastic].concat(),
        ] {
            let e = spec_with(&[args, &["x.py"]].concat(), None).unwrap_err().to_string();
            assert!(
                e.starts_with("OOMGUARD_RUN_TOKEN: is unset, and a job over several nodes")
                    && e.contains("export OOMGUARD_RUN_TOKEN=$(openssl rand -hex 32)"),
                "{args:?}: {e}"
            );
            let s = spec_with(&[args, &["x.py"]].concat(), Some("Our-Own-Secret-4f9c2a71d0")).unwrap();
            assert_eq!((s.token.reveal(), s.token_given), ("Our-Own-Secret-4f9c2a71d0", true));
        }
        for args in [
            &["--nnodes", "1"][..],
            &["--nnodes", "1:1"],
            &["--standalone", "--nnodes", "4"],
        ] {
            let s = spec_with(&[args, &["x.py"]].concat(), None).unwrap();
            assert_eq!(
                (s.nnodes, s.token_given, s.token.reveal().len()),
                (1, false, 64),
                "{args:?}"
            );
        }
    }

    /// A torchrun command line runs as it is: its options without an effect here parse (and
    /// are named); an option neither knows is refused, naming it, not run as the worker's
    /// program.
    #[test]
    fn torchruns_command_lines_parse_and_an_unknown_option_is_refused() {
        let torchrun = [
            "--start_method=fork",
            "--local-addr",
            "10.0.0.2",
            "--numa_binding",
            "node",
            "--signals-to-handle",
            "SIGTERM,SIGUSR1",
            "--duplicate-stdout-filters",
            "loss",
            "--virtual-local-rank",
            "--logs_specs",
            "x",
            "--event-log-handler",
            "null",
            "x.py",
            "--lr",
            "3",
        ];
        let s = spec(&torchrun).unwrap();
        assert_eq!(s.program[s.program.len() - 3..], ["x.py", "--lr", "3"]);
        let e = spec(&["--nproc-per-nodes", "2", "x.py"]).unwrap_err().to_string();
        assert!(
            e.starts_with("--nproc-per-nodes: is not an option of oomguard launch"),
            "{e}"
        );
    }

    /// torchrun 2.13: one node without a port rendezvous at a free one (a second job on the
    /// host does not fail with EADDRINUSE); across nodes 29500; a port asked for is kept.
    #[test]
    fn the_master_port_defaults_as_torchruns() {
        assert_eq!(spec(&["x.py"]).unwrap().master_port, 0, "a free port, per attempt");
        assert_eq!(
            spec(&["--nnodes", "2", "--node-rank", "0", "x.py"])
                .unwrap()
                .master_port,
            29500
        );
        assert_eq!(spec(&["--master-port", "29500", "x.py"]).unwrap().master_port, 29500);
        assert_eq!(spec(&["--master_port=1234", "x.py"]).unwrap().master_port, 1234);
    }

    #[test]
    fn torchrun_spellings_and_env() {
        let s = spec(&[
            "--nproc_per_node=2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master_addr",
            "10.0.0.1",
            "--max_restarts",
            "3",
            "train.py",
            "--lr",
            "3",
        ])
        .unwrap();
        assert_eq!((s.nproc_per_node, s.nnodes, s.node_rank, s.max_restarts), (2, 2, 1, 3));
        assert_eq!(
            s.shutdown_timeout,
            std::time::Duration::from_secs(30),
            "torchrun's default"
        );
        assert_eq!(
            spec(&["--shutdown-timeout", "600", "x.py"]).unwrap().shutdown_timeout,
            std::time::Duration::from_secs(600)
        );
        assert!(spec(&["--shutdown-timeout", "-1", "x.py"]).is_err());
        assert!(
            spec(&["--shutdown-timeout", "1e300", "x.py"]).is_err(),
            "no panic past Duration's range"
        );
        assert!(spec(&["--monitor-interval", "1e30", "x.py"]).is_err());
        assert_eq!(s.program, ["python3", "-u", "train.py", "--lr", "3"]);
        let env: BTreeMap<String, String> = worker_env(
            &s,
            1,
            29500,
            2,
            std::path::Path::new("/e.json"),
            Micro {
                size: Some(4),
                failed: Some(8),
            },
        )
        .into_iter()
        .collect();
        for (k, v) in [
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("GROUP_RANK", "1"),
            ("ROLE_RANK", "3"),
            ("ROLE_NAME", "default"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("WORLD_SIZE", "4"),
            ("GROUP_WORLD_SIZE", "2"),
            ("ROLE_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_RUN_ID", "none"),
            ("TORCHELASTIC_ERROR_FILE", "/e.json"),
            ("OOMGUARD_MICRO_BATCH_SIZE", "4"),
            ("OOMGUARD_FAILED_MICRO_BATCH_SIZE", "8"),
        ] {
            assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}");
        }
    }

    /// No token given: 64 hex digits from the OS, another each time. A given one is taken as
    /// it is, or refused naming the variable and never the value.
    #[test]
    fn run_tokens_are_random_or_the_users_checked() {
        let (a, b) = (run_token(None).unwrap(), run_token(None).unwrap());
        assert!(
            !a.1 && a.0.len() == 64 && a.0.chars().all(|c| c.is_ascii_hexdigit()),
            "{a:?}"
        );
        assert_ne!(a.0, b.0);
        let given = "my-own-secret-0123456789";
        assert_eq!(run_token(Some(given.into())).unwrap(), (given.to_string(), true));
        let s = spec(&["x.py"]).unwrap();
        let shown = format!("{s:?}");
        assert!(
            shown.contains("Token(hidden, ") && !shown.contains(s.token.reveal()),
            "{shown}"
        );
        for bad in [
            "",
            "short-one",
            "has a space in it!!",
            "nul\0inside-0123456789",
            &"x".repeat(1025),
        ] {
            let e = run_token(Some(bad.into())).unwrap_err().to_string();
            assert!(e.contains("OOMGUARD_RUN_TOKEN"), "{e}");
            assert!(bad.is_empty() || !e.contains(bad), "the message names the token: {e}");
        }
    }

    #[test]
    fn programs_and_refusals() {
        assert_eq!(
            spec(&["--no-python", "oomguard", "train", "c.yaml"]).unwrap().program,
            ["oomguard", "train", "c.yaml"]
        );
        assert_eq!(
            spec(&["-m", "pkg.train", "-x"]).unwrap().program,
            ["python3", "-u", "-m", "pkg.train", "-x"]
        );
        assert!(spec(&["--nnodes", "1:4", "x.py"])
            .unwrap_err()
            .to_string()
            .contains("elastic 1:4 (MIN:MAX) needs --rdzv-backend c10d and --rdzv-endpoint"));
        let e = spec(&[
            "--nnodes",
            "1:4",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "h:5",
            "--rdzv-conf",
            "last_call_timeout=1",
            "x.py",
        ])
        .unwrap();
        assert_eq!(
            e.elastic.map(|e| (e.min, e.max, e.last_call.as_secs())),
            Some((1, 4, 1))
        );
        assert!(spec(&["--nnodes", "3:2", "x.py"])
            .unwrap_err()
            .to_string()
            .contains("MIN is above MAX"));
        assert_eq!(
            spec(&["--nnodes", "2:2", "--node_rank", "1", "x.py"]).unwrap().nnodes,
            2
        );
        assert!(spec(&["--nnodes", "2", "--rdzv-backend", "c10d", "x.py"]).is_err());
        // torchrun's usual multi-node form, no --node-rank: the rendezvous ranks the nodes.
        let c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5", "x.py"];
        let fixed = spec(&[&["--nnodes", "2"][..], &c10d].concat()).unwrap();
        assert_eq!(fixed.elastic.map(|e| (e.min, e.max)), Some((2, 2)));
        let ranked = spec(&[&["--nnodes", "2", "--node-rank", "1"][..], &c10d].concat()).unwrap();
        assert_eq!((ranked.elastic, ranked.node_rank), (None, 1));
        assert!(spec(&["--rdzv-backend", "etcd", "x.py"]).is_err());
        let s = spec(&[
            "--standalone",
            "--redirects",
            "0:3,1:2",
            "--local-ranks-filter",
            "0",
            "--nproc-per-node",
            "2",
            "x.py",
        ])
        .unwrap();
        assert_eq!(s.master_port, 0);
        assert_eq!(
            s.redirects[&1],
            Streams {
                stdout: false,
                stderr: true
            }
        );
        assert_eq!(s.console_ranks, Some(vec![0]));
        let s = spec(&["--rdzv-endpoint", "host:1234", "--rdzv_backend", "c10d", "x.py"]).unwrap();
        assert_eq!((s.master_addr.as_str(), s.master_port), ("host", 1234));
    }
}
