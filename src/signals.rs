//! Owns SIGINT and SIGTERM: the first stops at the next safe point, a second exits at once.
//! Keeps: checkpoints are atomic, so exiting at any instant corrupts nothing.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use signal_hook::consts::{SIGINT, SIGTERM};

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
    for (sig, which, code) in [(SIGINT, &flags.int, 130), (SIGTERM, &flags.term, 143)] {
        signal_hook::flag::register_conditional_shutdown(sig, code, Arc::clone(&flags.starting))?;
        // Registered first, so it sees `any` as it was before this signal set it.
        signal_hook::flag::register_conditional_shutdown(sig, code, Arc::clone(&flags.any))?;
        signal_hook::flag::register(sig, Arc::clone(&flags.any))?;
        signal_hook::flag::register(sig, Arc::clone(which))?;
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
