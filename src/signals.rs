//! Owns SIGINT and SIGTERM: the first stops at the next safe point, a second exits at once;
//! the same one delivered twice is one request (Slurm signals every process of a job step,
//! workers too, and the launcher forwards what it got to them as well).
//! Keeps: checkpoints are atomic, so exiting at any instant corrupts nothing.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use signal_hook::consts::{SIGINT, SIGTERM};

/// A signal this soon after the first is the first delivered again, not a second request.
const SAME_REQUEST_MS: u64 = 500;

/// When the first signal came (ms on the monotonic clock; 0: none yet).
static FIRST_MS: AtomicU64 = AtomicU64::new(0);

/// The monotonic clock in ms (clock_gettime is async-signal-safe).
fn monotonic_ms() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64) * 1000 + (t.tv_nsec as u64) / 1_000_000
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Int,
    Term,
}

impl Signal {
    /// The conventional exit code: 128 + the signal number.
    pub fn exit_code(self) -> i32 {
        match self {
            Signal::Int => 130,
            Signal::Term => 143,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Signal::Int => "SIGINT",
            Signal::Term => "SIGTERM",
        }
    }
}

struct Flags {
    any: Arc<AtomicBool>,
    /// Until the first step: a signal exits at once.
    starting: Arc<AtomicBool>,
    int: Arc<AtomicBool>,
    term: Arc<AtomicBool>,
}

static FLAGS: OnceLock<Flags> = OnceLock::new();

/// Installs the handlers (once). Without them `requested` is always `None`.
pub fn install() -> std::io::Result<()> {
    if FLAGS.get().is_some() {
        return Ok(());
    }
    let flags = Flags {
        any: Arc::default(),
        starting: Arc::new(AtomicBool::new(true)),
        int: Arc::default(),
        term: Arc::default(),
    };
    // Under a launcher its signals only ever forward one request (a user's second goes to the
    // launcher, which then kills the workers itself): `oomguard launch`'s pid is in the
    // environment (past its shim), torchrun is the parent.
    let launcher = match std::env::var_os("TORCHELASTIC_RUN_ID") {
        Some(_) => [
            std::os::unix::process::parent_id() as i32,
            std::env::var(oomguard_launch::LAUNCHER_PID_VAR)
                .ok()
                .and_then(|p| p.trim().parse().ok())
                .unwrap_or(-1),
        ],
        None => [-1, -1],
    };
    for (sig, which, code) in [(SIGINT, &flags.int, 130), (SIGTERM, &flags.term, 143)] {
        let (starting, any, which) = (Arc::clone(&flags.starting), Arc::clone(&flags.any), Arc::clone(which));
        let handler = move |info: &libc::siginfo_t| {
            if starting.load(Ordering::SeqCst) {
                signal_hook::low_level::exit(code);
            }
            let now = monotonic_ms().max(1);
            which.store(true, Ordering::SeqCst);
            let Err(first) = FIRST_MS.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst) else {
                any.store(true, Ordering::SeqCst);
                return;
            };
            // SAFETY: si_pid reads the siginfo the kernel filled in.
            let forwarded = launcher.contains(&unsafe { info.si_pid() });
            if !forwarded && now.saturating_sub(first) >= SAME_REQUEST_MS {
                signal_hook::low_level::exit(code);
            }
        };
        // SAFETY: the handler only touches atomics and async-signal-safe calls.
        unsafe { signal_hook_registry::register_sigaction(sig, handler) }?;
    }
    let _ = FLAGS.set(flags);
    Ok(())
}

/// The first step is about to run: from now on a first signal stops at a safe point.
pub fn training_started() {
    if let Some(f) = FLAGS.get() {
        f.starting.store(false, Ordering::SeqCst);
    }
}

/// The first signal received, if any.
pub fn requested() -> Option<Signal> {
    let f = FLAGS.get()?;
    if f.term.load(Ordering::SeqCst) {
        Some(Signal::Term)
    } else if f.int.load(Ordering::SeqCst) {
        Some(Signal::Int)
    } else {
        None
    }
}
