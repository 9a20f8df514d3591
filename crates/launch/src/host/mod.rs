//! What this host gives this process, read as the kernel enforces it: memory (memory.rs)
//! and CPU threads (threads.rs), from the process's own cgroup (cgroup.rs), its affinity
//! mask and the scheduler's variables. Launchers and sweeps divide both among the
//! processes they start on one host.
pub mod cgroup;
pub mod memory;
pub mod threads;

pub use memory::HostMemory;
pub use threads::Threads;

fn read_u64(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key value` from a memory.stat-style file.
fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}
