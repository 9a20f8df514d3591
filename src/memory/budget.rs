//! How much memory a run may use: on the CPU, what the machine and its cgroup leave
//! available; on CUDA, a share of the card.
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

/// A CUDA budget of `bytes` as the caching allocator's `per_process_memory_fraction` of a
/// card of `total` bytes: the smaller of it and a fraction already `set`, in (0, 1].
pub fn cuda_fraction(bytes: u64, total: u64, set: Option<f64>) -> f64 {
    let asked = if total == 0 { 1.0 } else { bytes as f64 / total as f64 };
    asked.min(set.unwrap_or(1.0)).clamp(1e-9, 1.0)
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

    #[test]
    fn a_cuda_budget_is_a_share_of_the_card_and_never_loosens_a_set_fraction() {
        assert_eq!(cuda_fraction(20 << 30, 80 << 30, None), 0.25);
        assert_eq!(cuda_fraction(20 << 30, 80 << 30, Some(0.1)), 0.1);
        assert_eq!(cuda_fraction(20 << 30, 80 << 30, Some(0.5)), 0.25);
        assert_eq!(cuda_fraction(100 << 30, 80 << 30, None), 1.0, "more than the card: the card");
        assert!(cuda_fraction(1, 80 << 30, None) > 0.0, "libtorch wants a fraction above 0");
    }
}
