//! Owns `oomguard launch`'s flags: torchrun's, with the same names and environment variables.
//! Keeps: every torchrun spelling (underscores or hyphens) parses to the same option.
use clap::{ArgAction, Args};

/// `oomguard launch`: torchrun's options, spelled with hyphens or underscores, or set through
/// their PET_* environment variables.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Nodes: N, or MIN:MAX for an elastic job (with --rdzv-backend c10d and --rdzv-endpoint).
    /// More than one needs OOMGUARD_RUN_TOKEN, the same secret on every node.
    #[arg(long, env = "PET_NNODES", default_value = "1")]
    pub nnodes: String,
    /// Workers per node: N, auto, cpu or gpu.
    #[arg(
        long = "nproc-per-node",
        alias = "nproc_per_node",
        env = "PET_NPROC_PER_NODE",
        default_value = "1"
    )]
    pub nproc_per_node: String,
    /// This node's rank among the nodes [default: 0; over several nodes with --rdzv-backend c10d
    /// and --rdzv-endpoint, the rendezvous's]; elastic: a preference for its place.
    #[arg(long = "node-rank", alias = "node_rank", env = "PET_NODE_RANK")]
    pub node_rank: Option<usize>,
    /// Address of the rank-0 node (static rendezvous).
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        env = "PET_MASTER_ADDR",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,
    /// Port on the rank-0 node (static rendezvous). Default, as torchrun's: a free port when
    /// the job is one node (so that two jobs on a host do not collide), 29500 across nodes.
    #[arg(long = "master-port", alias = "master_port", env = "PET_MASTER_PORT")]
    pub master_port: Option<u16>,
    /// Rendezvous backend: static or c10d.
    #[arg(
        long = "rdzv-backend",
        alias = "rdzv_backend",
        env = "PET_RDZV_BACKEND",
        default_value = "static"
    )]
    pub rdzv_backend: String,
    // `help =`, not a doc comment: rustdoc would read `[:PORT]` as a link.
    #[arg(
        help = "Rendezvous endpoint HOST[:PORT], an IPv6 address in brackets ([::1]:29400) (c10d; overrides --master-addr/--master-port)",
        long = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        default_value = ""
    )]
    pub rdzv_endpoint: String,
    /// The job's id, shared by its nodes: an identifier, not a secret (OOMGUARD_RUN_TOKEN is).
    #[arg(long = "rdzv-id", alias = "rdzv_id", env = "PET_RDZV_ID", default_value = "none")]
    pub rdzv_id: String,
    /// Extra rendezvous settings: last_call_timeout, join_timeout and heartbeat_timeout
    /// (seconds, elastic); others are accepted and ignored.
    #[arg(long = "rdzv-conf", alias = "rdzv_conf", env = "PET_RDZV_CONF", default_value = "")]
    pub rdzv_conf: String,
    /// Single node on a free local port (c10d on localhost:0).
    #[arg(long, env = "PET_STANDALONE", action = ArgAction::SetTrue, value_parser = boolish())]
    pub standalone: bool,
    /// Restarts of the worker group before giving up.
    #[arg(
        long = "max-restarts",
        alias = "max_restarts",
        env = "PET_MAX_RESTARTS",
        default_value_t = 0
    )]
    pub max_restarts: u32,
    /// Seconds the workers get to exit after SIGTERM (a checkpoint being written, say) before
    /// SIGKILL, as torchrun's --shutdown-timeout.
    #[arg(
        long = "shutdown-timeout",
        alias = "shutdown_timeout",
        env = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
        default_value_t = 30.0,
        value_name = "SECONDS"
    )]
    pub shutdown_timeout: f64,
    /// Seconds between checks of the workers.
    #[arg(
        long = "monitor-interval",
        alias = "monitor_interval",
        env = "PET_MONITOR_INTERVAL",
        default_value_t = 0.1
    )]
    pub monitor_interval: f64,
    /// Folder for the workers' log and error files.
    #[arg(long = "log-dir", alias = "log_dir", env = "PET_LOG_DIR")]
    pub log_dir: Option<std::path::PathBuf>,
    /// oomguard's: the run directory a worker's `import oomguard` Guard writes to (its
    /// metrics.jsonl, oom/NNN/ snapshots; `oomguard report DIR` draws it), given to every
    /// worker as OOMGUARD_RUN_DIR. `oomguard train` workers take their own --run-dir.
    #[arg(long = "run-dir", env = "OOMGUARD_RUN_DIR")]
    pub run_dir: Option<std::path::PathBuf>,
    /// Streams to files only: 0 none, 1 stdout, 2 stderr, 3 both; or per rank, e.g. 0:1,1:2.
    #[arg(short = 'r', long, env = "PET_REDIRECTS", default_value = "0")]
    pub redirects: String,
    /// Streams to files and the console, same values as --redirects.
    #[arg(short = 't', long, env = "PET_TEE", default_value = "0")]
    pub tee: String,
    /// Show only these local ranks' output on the console, e.g. 0 or 0,2.
    #[arg(
        long = "local-ranks-filter",
        alias = "local_ranks_filter",
        env = "PET_LOCAL_RANKS_FILTER",
        default_value = ""
    )]
    pub local_ranks_filter: String,
    /// The workers' role name.
    #[arg(long, env = "PET_ROLE", default_value = "default")]
    pub role: String,
    /// Run the script as a program, not under python3.
    #[arg(long = "no-python", alias = "no_python", env = "PET_NO_PYTHON", action = ArgAction::SetTrue, value_parser = boolish(), conflicts_with = "module")]
    pub no_python: bool,
    /// Run the script as a Python module (python3 -m).
    #[arg(short = 'm', long = "module", env = "PET_MODULE", action = ArgAction::SetTrue, value_parser = boolish())]
    pub module: bool,
    /// Run the script with runpy.run_path.
    #[arg(long = "run-path", alias = "run_path", env = "PET_RUN_PATH", action = ArgAction::SetTrue, value_parser = boolish())]
    pub run_path: bool,
    /// torchrun's, accepted: the workers are always fresh processes (as spawn).
    #[arg(long = "start-method", alias = "start_method", env = "PET_START_METHOD", value_parser = ["spawn", "fork", "forkserver"], hide = true)]
    pub start_method: Option<String>,
    /// Check the options and the command (the script's file included), print what each
    /// worker would run, and start nothing (what `oomguard sweep` asks before its trials).
    #[arg(long)]
    pub check: bool,
    /// torchrun's options that do nothing here; each one given is named in a warning.
    #[command(flatten)]
    pub ignored: Ignored,
    /// The training script (or program, or module) and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "SCRIPT_OR_CMD [ARGS]..."
    )]
    pub command: Vec<String>,
}

/// `PET_*` switches as torchrun reads them (`1`/`0`), or `true`/`false`, `yes`/`no`.
fn boolish() -> clap::builder::BoolishValueParser {
    clap::builder::BoolishValueParser::new()
}

/// torchrun's options without an effect here (hidden from --help): a torchrun command line
/// runs as it is, and each one given is named in a warning (`Ignored::given`).
#[derive(Debug, Args, Default)]
pub struct Ignored {
    #[arg(
        long = "event-log-handler",
        alias = "event_log_handler",
        env = "PET_EVENT_LOG_HANDLER",
        hide = true
    )]
    event_log_handler: Option<String>,
    #[arg(long = "local-addr", alias = "local_addr", env = "PET_LOCAL_ADDR", hide = true)]
    local_addr: Option<String>,
    #[arg(long = "logs-specs", alias = "logs_specs", hide = true)]
    logs_specs: Option<String>,
    #[arg(long = "numa-binding", alias = "numa_binding", hide = true)]
    numa_binding: Option<String>,
    #[arg(
        long = "signals-to-handle",
        alias = "signals_to_handle",
        env = "PET_SIGNALS_TO_HANDLE",
        hide = true
    )]
    signals_to_handle: Option<String>,
    #[arg(
        long = "duplicate-stdout-filters",
        alias = "duplicate_stdout_filters",
        env = "PET_DUPLICATE_STDOUT_FILTERS",
        hide = true
    )]
    duplicate_stdout_filters: Option<String>,
    #[arg(
        long = "duplicate-stderr-filters",
        alias = "duplicate_stderr_filters",
        env = "PET_DUPLICATE_STDERR_FILTERS",
        hide = true
    )]
    duplicate_stderr_filters: Option<String>,
    #[arg(long = "virtual-local-rank", alias = "virtual_local_rank", env = "PET_VIRTUAL_LOCAL_RANK", action = ArgAction::SetTrue, value_parser = boolish(), hide = true)]
    virtual_local_rank: bool,
}

impl Ignored {
    /// The flags given, each with what happens instead.
    pub fn given(&self) -> Vec<String> {
        let some =
            |v: &Option<String>, flag: &str, instead: &str| v.as_ref().map(|v| format!("--{flag} {v}: {instead}"));
        [
            some(
                &self.event_log_handler,
                "event-log-handler",
                "oomguard's events go to metrics.jsonl",
            ),
            some(
                &self.local_addr,
                "local-addr",
                "the node's address is the one it reaches the rendezvous from",
            ),
            some(
                &self.logs_specs,
                "logs-specs",
                "logs go where --log-dir, --redirects and --tee say",
            ),
            some(
                &self.numa_binding,
                "numa-binding",
                "workers are bound to cores by OOMGUARD_CPU_BIND",
            ),
            some(
                &self.signals_to_handle,
                "signals-to-handle",
                "SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded",
            ),
            some(
                &self.duplicate_stdout_filters,
                "duplicate-stdout-filters",
                "no line is duplicated",
            ),
            some(
                &self.duplicate_stderr_filters,
                "duplicate-stderr-filters",
                "no line is duplicated",
            ),
            self.virtual_local_rank
                .then(|| "--virtual-local-rank: LOCAL_RANK is each worker's own, every GPU visible".to_string()),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}
