//! Owns what this host gives this process, read as the kernel enforces it (memory, threads,
//! GPUs, allocator settings), child processes and signals, and telling an OOM death from others.
//! Keeps: no libtorch; every limit read is the tightest one that applies to this process.
//!
//! ```
//! use oomguard_host::oom::{classify_oom, OomSource};
//!
//! let oom = classify_oom("CUDA out of memory. Tried to allocate 2.00 GiB").expect("an OOM");
//! assert_eq!((oom.source, oom.requested_bytes), (OomSource::Cuda, Some(2 << 30)));
//! assert!(classify_oom("shape mismatch").is_none());
//! ```
pub mod allocator;
pub mod cgroup;
pub mod driver;
pub mod memory;
pub mod oom;
pub mod proc;
pub mod threads;

pub use memory::HostMemory;
pub use threads::Threads;

fn read_u64(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key value` from a memory.stat-style file.
fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// GPUs visible to this process, without loading CUDA: CUDA_VISIBLE_DEVICES, else the
/// NVIDIA driver's device list.
pub fn num_gpus() -> usize {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v
            .split(',')
            .filter(|d| !d.trim().is_empty() && !d.trim().starts_with('-'))
            .count();
    }
    std::fs::read_dir("/proc/driver/nvidia/gpus")
        .map(|d| d.count())
        .unwrap_or(0)
}
