//! Owns OOM snapshots: the allocator's bounded history, copied at a failed allocation.
//! Keeps: the copy is taken before unwinding frees anything, and the history stays bounded by
//! `memory.snapshot.max_events`.
mod config;
#[cfg(oomguard_cuda_snapshot)]
mod cuda;
mod dump;
mod pickle;
mod summary;

pub use config::{SnapshotConfig, SnapshotMode};
pub use dump::{begin, Dumped, Dumper, OomAt};
pub use summary::{Breakdown, Category, Roles};

use std::ffi::{c_char, CStr, CString};

use tch::TchError;

use crate::error::Phase;
use crate::memory::check;

/// One event, or one live allocation, as csrc/snapshot.h lays it out.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rec {
    pub addr: u64,
    pub size: i64,
    pub seq: u64,
    pub time_us: i64,
    pub step: i64,
    pub action: i32,
    pub op: i32,
    pub top_op: i32,
    pub module: i32,
    pub phase: i32,
    pub micro_batch: i32,
}

pub const ALLOC: i32 = 0;
pub const FREE: i32 = 1;
pub const OOM: i32 = 2;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Info {
    pub request: i64,
    pub live: i64,
    pub budget: i64,
    pub seq: u64,
    pub op_seq: u64,
    pub attempt_seq: u64,
    pub events_written: u64,
    pub attempt_event: u64,
    pub failing: Rec,
}

mod ffi {
    use super::{Info, Rec};
    use std::ffi::c_char;
    extern "C" {
        pub fn og_snap_start(max_events: i64) -> *mut c_char;
        pub fn og_snap_stop();
        pub fn og_snap_set_context(step: i64, phase: i32, micro_batch: i32);
        pub fn og_snap_set_phase(phase: i32, micro_batch: i32);
        pub fn og_snap_intern(name: *const c_char) -> i32;
        pub fn og_snap_set_module(id: i32) -> i32;
        pub fn og_snap_name(id: i32) -> *const c_char;
        pub fn og_snap_mark_attempt();
        pub fn og_snap_read(
            last_oom: i32,
            got: *mut i32,
            info: *mut Info,
            live: *mut *mut Rec,
            n_live: *mut i64,
            events: *mut *mut Rec,
            n_events: *mut i64,
        ) -> *mut c_char;
        pub fn og_snap_oom_python() -> *mut c_char;
        pub fn og_free(p: *mut c_char);
    }
}

/// What the allocator held at one moment: the live allocations and the ring's events.
#[derive(Debug, Clone, Default)]
pub struct Capture {
    pub info: Info,
    pub live: Vec<Rec>,
    pub events: Vec<Rec>,
    /// A Python model's frames at the failure, innermost first (`file:line in name`).
    pub python: Vec<String>,
}

fn phase_code(p: Option<Phase>) -> i32 {
    p.and_then(|p| Phase::ALL.iter().position(|&q| q == p))
        .map_or(0, |i| i as i32 + 1)
}

/// The phase a record was made in (code 0: outside any).
pub fn phase_of(code: i32) -> Option<Phase> {
    usize::try_from(code - 1).ok().and_then(|i| Phase::ALL.get(i).copied())
}

/// Starts recording (the CPU's history) with a ring of `max_events`; an error (a ring too
/// large to allocate) leaves the history as it was.
pub fn start(max_events: usize) -> Result<(), TchError> {
    check(unsafe { ffi::og_snap_start(max_events.min(i64::MAX as usize) as i64) })
}

pub fn stop() {
    unsafe { ffi::og_snap_stop() }
}

/// A guarded attempt begins at `step`: what it allocates is the failing attempt's.
pub fn mark_attempt(step: u64) {
    unsafe {
        ffi::og_snap_set_context(step as i64, 0, -1);
        ffi::og_snap_mark_attempt();
    }
}

/// What the runtime is doing now (and, with `Some`, in which micro-batch).
pub fn set_phase(phase: Phase, micro_batch: Option<usize>) {
    if crate::memory::inject::targeted::wanted() {
        crate::memory::inject::targeted::phase_begins(
            &serde_json::to_value(phase)
                .ok()
                .and_then(|v| v.as_str().map(String::from))
                .unwrap_or_default(),
        );
    }
    unsafe { ffi::og_snap_set_phase(phase_code(Some(phase)), micro_batch.map_or(-2, |m| m as i32)) }
}

/// Allocations made while this lives are the module's (e.g. `block.3`; `logits` and `loss`
/// count as the loss/logits category). Scopes nest: dropping restores the outer one.
pub struct Scope(i32);

pub fn scope(name: &str) -> Scope {
    let c = CString::new(name).unwrap_or_default();
    Scope(unsafe { ffi::og_snap_set_module(ffi::og_snap_intern(c.as_ptr())) })
}

impl Drop for Scope {
    fn drop(&mut self) {
        unsafe { ffi::og_snap_set_module(self.0) };
    }
}

/// An interned op or module name.
pub fn name(id: i32) -> String {
    if id <= 0 {
        return String::new();
    }
    // SAFETY: og_snap_name returns a NUL-terminated string that lives as long as the process.
    unsafe { CStr::from_ptr(ffi::og_snap_name(id)) }
        .to_string_lossy()
        .into_owned()
}

fn read(last_oom: bool) -> Result<Option<Capture>, TchError> {
    let mut got = 0i32;
    let mut info = Info::default();
    let (mut live, mut events): (*mut Rec, *mut Rec) = (std::ptr::null_mut(), std::ptr::null_mut());
    let (mut n_live, mut n_events) = (0i64, 0i64);
    check(unsafe {
        ffi::og_snap_read(
            last_oom as i32,
            &mut got,
            &mut info,
            &mut live,
            &mut n_live,
            &mut events,
            &mut n_events,
        )
    })?;
    if got == 0 {
        return Ok(None);
    }
    let copy = |p: *mut Rec, n: i64| -> Vec<Rec> {
        if p.is_null() {
            return Vec::new();
        }
        // SAFETY: og_snap_read malloc'd n records at p, ours to free.
        let v = unsafe { std::slice::from_raw_parts(p, n.max(0) as usize) }.to_vec();
        unsafe { ffi::og_free(p as *mut c_char) };
        v
    };
    let python = if last_oom {
        // SAFETY: a malloc'd NUL-terminated string, ours to free.
        let p = unsafe { ffi::og_snap_oom_python() };
        if p.is_null() {
            Vec::new() // strdup could not allocate: the frames are left out, not the OOM
        } else {
            let text = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
            unsafe { ffi::og_free(p) };
            text.lines().map(str::to_string).collect()
        }
    } else {
        Vec::new()
    };
    Ok(Some(Capture {
        info,
        live: copy(live, n_live),
        events: copy(events, n_events),
        python,
    }))
}

/// The copy taken at the last failed CPU allocation of the current attempt, if any; an error
/// when the copies for Rust could not be allocated.
pub fn take_oom() -> Result<Option<Capture>, TchError> {
    read(true)
}

/// The history as it is now.
pub fn now() -> Result<Capture, TchError> {
    read(false).map(Option::unwrap_or_default)
}
