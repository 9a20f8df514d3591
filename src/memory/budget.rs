//! Owns how much memory a run may use: on the CPU what the host leaves, on CUDA a card's share.
//! Keeps: `auto` is live tensors plus a share of what is still available; a CUDA share is a
//! fraction in (0, 1].
pub use oomguard_host::HostMemory;

use super::config::Budget;

/// What this process may use of the host's memory now (cgroups from its own up, and a
/// launcher's or sweep's share: oomguard_host), with a notice when a cgroup could
/// not be read.
pub fn host_memory() -> Option<HostMemory> {
    let m = HostMemory::of_self();
    if let Some(why) = m.as_ref().and_then(|m| m.notice.as_deref()) {
        tracing::warn!("{why}: the memory budget is MemAvailable's figure");
    }
    m
}

/// The budget and where it came from, for the log and the planner: `560 MiB (memory.budget:
/// auto: 80% of 700 MiB free under the cgroup limit 700 MiB at /job_42)`.
pub fn resolve_described(budget: Budget, text: &str, live: u64, host: Option<&HostMemory>) -> Option<(u64, String)> {
    let bytes = resolve(budget, live, host.map(|h| h.available))?;
    let why = match (budget, host) {
        (Budget::Auto { fraction }, Some(h)) => {
            format!("memory.budget: {text}: {:.0}% of {}", fraction * 100.0, h.describe())
        }
        _ => format!("memory.budget: {text}"),
    };
    Some((bytes, why))
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
        let host = HostMemory {
            available: 100 << 20,
            source: oomguard_host::memory::Source::MemAvailable,
            notice: None,
        };
        let (b, why) = resolve_described(Budget::Auto { fraction: 0.8 }, "auto", 0, Some(&host)).unwrap();
        assert_eq!(
            (b, why.as_str()),
            (
                80 << 20,
                "memory.budget: auto: 80% of 100.0 MiB available (MemAvailable)"
            )
        );
        assert_eq!(
            resolve_described(Budget::Bytes(7), "7", 0, Some(&host)).unwrap().1,
            "memory.budget: 7"
        );
    }

    #[test]
    fn a_cuda_budget_is_a_share_of_the_card_and_never_loosens_a_set_fraction() {
        assert_eq!(cuda_fraction(20 << 30, 80 << 30, None), 0.25);
        assert_eq!(cuda_fraction(20 << 30, 80 << 30, Some(0.1)), 0.1);
        assert_eq!(cuda_fraction(20 << 30, 80 << 30, Some(0.5)), 0.25);
        assert_eq!(
            cuda_fraction(100 << 30, 80 << 30, None),
            1.0,
            "more than the card: the card"
        );
        assert!(
            cuda_fraction(1, 80 << 30, None) > 0.0,
            "libtorch wants a fraction above 0"
        );
    }
}
