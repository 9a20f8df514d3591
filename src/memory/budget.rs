//! How much memory a CPU run may use: what the machine and its cgroup leave available.
use std::path::Path;

use super::config::Budget;

/// Bytes available to this process now: MemAvailable, capped by the cgroup's limit minus
/// its usage (v2, or v1) when one is set.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let mem_available = meminfo_kib(&meminfo, "MemAvailable:")? * 1024;
    let read = |p: &str| std::fs::read_to_string(Path::new(p)).ok().and_then(|s| s.trim().parse::<u64>().ok());
    let cgroup = match (read("/sys/fs/cgroup/memory.max"), read("/sys/fs/cgroup/memory.current")) {
        (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
        _ => match (read("/sys/fs/cgroup/memory/memory.limit_in_bytes"), read("/sys/fs/cgroup/memory/memory.usage_in_bytes")) {
            (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
            _ => None,
        },
    };
    Some(cgroup.map_or(mem_available, |c| c.min(mem_available)))
}

fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()
}

/// The budget in bytes: `live` (already allocated tensors) plus the configured share of
/// what is still available.
pub fn resolve(budget: Budget, live: u64, available: Option<u64>) -> Option<u64> {
    match budget {
        Budget::None => None,
        Budget::Bytes(b) => Some(b),
        Budget::Auto { fraction } => available.map(|a| live + (a as f64 * fraction) as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets() {
        assert_eq!(resolve(Budget::None, 5, Some(100)), None);
        assert_eq!(resolve(Budget::Bytes(64), 5, Some(100)), Some(64));
        assert_eq!(resolve(Budget::Auto { fraction: 0.5 }, 10, Some(100)), Some(60));
        assert_eq!(meminfo_kib("MemTotal: 10 kB\nMemAvailable:   2048 kB\n", "MemAvailable:"), Some(2048));
        assert!(available_bytes().unwrap() > 0);
    }
}
