//! Owns host memory this process may use: MemAvailable capped by every cgroup limit above it
//! and by the share a launcher or sweep gave it.
//! Keeps: the result never exceeds any of those limits; `decide` is pure.
use super::cgroup::Cgroup;
use super::{read_u64, stat_field};
use oomguard_console::units::human_bytes;

/// Set by `oomguard launch` and `oomguard sweep` for each local worker or parallel trial:
/// the bytes it may use in all (its share of what the parent could use), and where that
/// came from. The child counts its own use against it, as a cgroup would.
pub const SHARE_VAR: &str = "OOMGUARD_HOST_MEMORY";
pub const SHARE_FROM_VAR: &str = "OOMGUARD_HOST_MEMORY_FROM";

/// Parses a size such as `2GiB`, `512 MiB`, `1.5G` or `1048576`.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let value: f64 = t[..split].parse().ok()?;
    let bytes = value * crate::oom::unit_multiplier(t[split..].trim())? as f64;
    (bytes.is_finite() && bytes >= 0.0).then_some(bytes.round() as u64)
}

/// `--device-memory` (plan) and a sweep's `device_memory`: a size, or a card by name.
pub fn device_memory(text: &str) -> Option<u64> {
    const GIB: u64 = 1 << 30;
    let card = match text.to_ascii_uppercase().replace(['-', '_', ' '], "").as_str() {
        "T4" => Some(16),
        "L4" => Some(24),
        "A10" | "A10G" => Some(24),
        "A10040GB" | "A10040G" => Some(40),
        "A100" | "A10080GB" | "A10080G" => Some(80),
        "H100" | "H10080GB" => Some(80),
        // CUDA reports 143,771 MiB on an H200 (2026-11-28).
        "H200" | "H200141GB" => Some(140),
        _ => None,
    };
    card.map(|g| g * GIB).or_else(|| parse_size(text))
}

/// Whether the card `text` names runs bf16 natively (Ampere or newer: not a T4); None for a
/// bare size, which names no card.
pub fn card_has_native_bf16(text: &str) -> Option<bool> {
    let name = text.to_ascii_uppercase().replace(['-', '_', ' '], "");
    match name.as_str() {
        "T4" => Some(false),
        _ if parse_size(text).is_none() && device_memory(text).is_some() => Some(true),
        _ => None,
    }
}

/// One cgroup between the process and the top: its limit (if any) and what it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Level {
    pub path: String,
    pub limit: Option<u64>,
    pub used: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    MemAvailable,
    /// The tightest cgroup: its path and limit.
    Cgroup {
        path: String,
        limit: u64,
    },
    /// A parent's share (`limit` bytes in all), described by the parent.
    Share {
        limit: u64,
        from: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMemory {
    /// Bytes this process may still allocate.
    pub available: u64,
    /// What decided `available`.
    pub source: Source,
    /// Why a cgroup could not be read, when it could not (the figure is then MemAvailable's).
    pub notice: Option<String>,
}

/// The smallest of MemAvailable, each cgroup level's limit less its use, and a parent's
/// share less this process's own use. An ancestor counts with its own use, which includes
/// its other children's.
pub fn decide(mem_available: Option<u64>, levels: &[Level], share: Option<Share>) -> Option<HostMemory> {
    let mut best: Option<(u64, Source)> = mem_available.map(|m| (m, Source::MemAvailable));
    let mut consider = |bytes: u64, source: Source| {
        if best.as_ref().is_none_or(|(b, _)| bytes < *b) {
            best = Some((bytes, source));
        }
    };
    for l in levels {
        if let Some(limit) = l.limit {
            consider(
                limit.saturating_sub(l.used),
                Source::Cgroup {
                    path: l.path.clone(),
                    limit,
                },
            );
        }
    }
    if let Some(s) = share {
        consider(
            s.limit.saturating_sub(s.own_use),
            Source::Share {
                limit: s.limit,
                from: s.from,
            },
        );
    }
    best.map(|(available, source)| HostMemory {
        available,
        source,
        notice: None,
    })
}

impl HostMemory {
    /// Reads this process's figure. Unreadable cgroup files fall back to MemAvailable,
    /// with a notice; None only when not even /proc/meminfo can be read.
    pub fn of_self() -> Option<HostMemory> {
        let mem_available = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| meminfo_kib(&t, "MemAvailable:"))
            .map(|k| k * 1024);
        let share = std::env::var(SHARE_VAR)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map(|limit| Share {
                limit,
                from: std::env::var(SHARE_FROM_VAR).unwrap_or_else(|_| format!("{SHARE_VAR}={limit}")),
                own_use: own_anonymous_bytes().unwrap_or(0),
            });
        let (levels, notice) = match Cgroup::of_self("memory") {
            Some(cg) => read_levels(&cg),
            None => (
                vec![],
                Some("no memory cgroup found in /proc/self/cgroup and /proc/self/mountinfo".to_string()),
            ),
        };
        let mut m = decide(mem_available, &levels, share)?;
        m.notice = notice;
        Some(m)
    }

    /// `650 MiB free under the cgroup limit 700 MiB at /job_42`, for the log.
    pub fn describe(&self) -> String {
        let a = human_bytes(self.available);
        match &self.source {
            Source::MemAvailable => format!("{a} available (MemAvailable)"),
            Source::Cgroup { path, limit } => {
                format!("{a} free under the cgroup limit {} at {path}", human_bytes(*limit))
            }
            Source::Share { limit, from } => {
                format!("{a} free of this process's share {} ({from})", human_bytes(*limit))
            }
        }
    }

    /// What each of `n` children sharing this process's memory gets: (bytes, description),
    /// for SHARE_VAR and SHARE_FROM_VAR.
    pub fn share(&self, n: usize) -> (u64, String) {
        let n = n.max(1);
        (self.available / n as u64, format!("1/{n} of {}", self.describe()))
    }

    /// The environment that gives a child its share of `n`.
    pub fn share_env(&self, n: usize) -> [(String, String); 2] {
        let (bytes, from) = self.share(n);
        [(SHARE_VAR.into(), bytes.to_string()), (SHARE_FROM_VAR.into(), from)]
    }
}

/// A launcher's or sweep's share: `limit` bytes in all, of which the process uses `own_use`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub limit: u64,
    pub from: String,
    pub own_use: u64,
}

/// Returns the heap's free memory to the system (glibc's `malloc_trim(0)`: the top of each
/// arena and the free pages inside them). After an OOM the failed attempt's buffers are
/// free but still resident in glibc's arenas, whose dynamic mmap threshold has risen to the
/// size of the first large buffers freed: a memory cgroup's kernel counts them, and kills a
/// run whose live tensors fit its budget. What the CPU's "empty the cache" means. Returns
/// whether memory was released (false elsewhere than glibc).
pub fn return_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks glibc's own arenas; it is safe to call at any time.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    false
}

/// The mmap threshold under a memory cgroup: buffers of this size and more are mapped on
/// their own and unmapped on free (a demo step 0.94x as fast as with glibc's default;
/// benches/scripts/malloc.sh).
pub const CGROUP_MMAP_THRESHOLD: usize = 4 << 20;

/// Under a memory cgroup's limit: fixes glibc's mmap threshold at `CGROUP_MMAP_THRESHOLD`.
/// glibc's default is dynamic: a freed large buffer raises it (up to 32 MiB), and later
/// buffers below it come from arenas that keep their pages, so the cgroup's kernel counts
/// far more than the live tensors and kills a run that fits its budget. Left alone when the
/// user set `MALLOC_MMAP_THRESHOLD_` (glibc reads it itself). Returns the threshold set.
pub fn bound_heap() -> Option<usize> {
    bound_heap_at(CGROUP_MMAP_THRESHOLD)
}

/// Fixes glibc's mmap threshold at `threshold` bytes (clamped to glibc's range), unless
/// the user set `MALLOC_MMAP_THRESHOLD_`. Returns the threshold set. The Python guard uses a
/// lower one than `bound_heap` under an address-space limit, where a buffer left in an
/// arena keeps its addresses however much is trimmed.
pub fn bound_heap_at(threshold: usize) -> Option<usize> {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return None;
    }
    // glibc refuses a threshold above HEAP_MAX/2 (32 MiB on 64-bit).
    let threshold = threshold.clamp(4096, 32 << 20);
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets glibc's allocator parameters; safe at any time.
        let ok = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, threshold as libc::c_int) } == 1;
        ok.then_some(threshold)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = threshold;
        None
    }
}

/// This process's anonymous resident memory (RssAnon: its heap, stacks and CPU tensors, not
/// the libraries it maps; those pages are charged to whoever read them first): what a
/// host-side leak grows. None where /proc cannot be read.
pub fn own_anonymous_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    meminfo_kib(&status, "RssAnon:").map(|k| k * 1024)
}

/// Starts measuring this process's peak resident memory from here: resets the kernel's
/// high-water mark (VmHWM) to the current resident size (writing 5 to /proc/self/clear_refs,
/// Linux 4.0 and later). Returns that size; None where it cannot be reset or read.
pub fn reset_peak_resident() -> Option<u64> {
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    meminfo_kib(&status, "VmRSS:").map(|k| k * 1024)
}

/// The peak resident memory (VmHWM) since `reset_peak_resident`; None where /proc cannot
/// be read.
pub fn peak_resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    meminfo_kib(&status, "VmHWM:").map(|k| k * 1024)
}

/// Each level's limit and use. The process's own level unreadable: a notice.
fn read_levels(cg: &Cgroup) -> (Vec<Level>, Option<String>) {
    let mut notice = None;
    let levels = cg
        .levels
        .iter()
        .map(|(path, dir)| {
            let (limit, used) = if cg.v2 {
                // memory.high counts: the kernel throttles hard there.
                let limit = match (
                    read_limit(&dir.join("memory.max")),
                    read_limit(&dir.join("memory.high")),
                ) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                (limit, working_set(dir, "memory.current", "inactive_file"))
            } else {
                (
                    read_limit(&dir.join("memory.limit_in_bytes")),
                    working_set(dir, "memory.usage_in_bytes", "total_inactive_file"),
                )
            };
            if dir == cg.dir() && used.is_none() {
                notice = Some(format!(
                    "the memory cgroup {} at {} is not readable",
                    cg.path,
                    dir.display()
                ));
            }
            Level {
                path: path.clone(),
                limit,
                used: used.unwrap_or(0),
            }
        })
        .collect();
    (levels, notice)
}

/// A limit file's value; `max` and v1's near-2^63 "unlimited" are none.
fn read_limit(path: &std::path::Path) -> Option<u64> {
    read_u64(path).filter(|&v| v < 1 << 60)
}

/// Use less the inactive page cache, which the kernel reclaims before it kills (the
/// working set, as the kubelet counts it).
fn working_set(dir: &std::path::Path, usage: &str, inactive: &str) -> Option<u64> {
    let used = read_u64(&dir.join(usage))?;
    let inactive = std::fs::read_to_string(dir.join("memory.stat"))
        .ok()
        .and_then(|s| stat_field(&s, inactive))
        .unwrap_or(0);
    Some(used.saturating_sub(inactive))
}

fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(key))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64 MiB touched and freed after a reset show in the peak; the next reset forgets them.
    #[test]
    fn the_peak_resident_size_counts_what_was_touched_since_its_reset() {
        let Some(start) = reset_peak_resident() else {
            return; // no /proc/self/clear_refs here: nothing to measure
        };
        let mut v = vec![0u8; 64 << 20];
        v.iter_mut().step_by(4096).for_each(|b| *b = 1);
        assert_eq!(v.iter().step_by(4096).map(|&b| b as usize).sum::<usize>(), 16384);
        drop(v);
        // Within 2 MiB: the kernel's RSS counters are batched per thread (64 pages each).
        let rise = peak_resident().unwrap() - start;
        assert!(rise >= 62 << 20, "the peak rose {rise} bytes");
        let again = reset_peak_resident().unwrap();
        assert!(
            peak_resident().unwrap() - again < 64 << 20,
            "the reset brought the peak down"
        );
    }

    fn level(path: &str, limit: Option<u64>, used: u64) -> Level {
        Level {
            path: path.into(),
            limit,
            used,
        }
    }
    const MIB: u64 = 1 << 20;

    #[test]
    fn the_tightest_level_decides_and_an_ancestor_counts_its_other_children() {
        let levels = [
            level("/", None, 20_000 * MIB),
            level("/slurm/uid_1000/job_42", Some(1000 * MIB), 600 * MIB), // a sibling step uses 500
            level("/slurm/uid_1000/job_42/step_0", Some(700 * MIB), 100 * MIB),
        ];
        let m = decide(Some(18_000 * MIB), &levels, None).unwrap();
        assert_eq!(m.available, 400 * MIB);
        assert_eq!(
            m.source,
            Source::Cgroup {
                path: "/slurm/uid_1000/job_42".into(),
                limit: 1000 * MIB
            }
        );
        assert_eq!(
            m.describe(),
            "400.0 MiB free under the cgroup limit 1000.0 MiB at /slurm/uid_1000/job_42"
        );
        // Only the step's own limit: its own free bytes.
        let m = decide(Some(18_000 * MIB), &levels[2..], None).unwrap();
        assert_eq!(
            (m.available, m.describe()),
            (
                600 * MIB,
                "600.0 MiB free under the cgroup limit 700.0 MiB at /slurm/uid_1000/job_42/step_0".into()
            )
        );
    }

    #[test]
    fn no_limit_is_mem_available_and_a_share_caps_both() {
        let m = decide(Some(8 << 30), &[level("/", None, 0)], None).unwrap();
        assert_eq!((m.available, &m.source), (8 << 30, &Source::MemAvailable));
        assert_eq!(decide(None, &[], None), None);
        let parent = decide(Some(8 << 30), &[level("/job", Some(1 << 30), 0)], None).unwrap();
        let (limit, from) = parent.share(2);
        assert_eq!(limit, 512 * MIB);
        assert_eq!(from, "1/2 of 1.0 GiB free under the cgroup limit 1.0 GiB at /job");
        // The child's own use counts against its share (as against a cgroup of its own).
        let share = Share {
            limit,
            from: from.clone(),
            own_use: 100 * MIB,
        };
        let child = decide(
            Some(8 << 30),
            &[level("/job", Some(1 << 30), 200 * MIB)],
            Some(share.clone()),
        )
        .unwrap();
        assert_eq!(
            (child.available, &child.source),
            (412 * MIB, &Source::Share { limit, from })
        );
        assert_eq!(child.describe(), "412.0 MiB free of this process's share 512.0 MiB (1/2 of 1.0 GiB free under the cgroup limit 1.0 GiB at /job)");
        // A child whose cgroup view is tighter than its share keeps the tighter figure.
        let child = decide(Some(8 << 30), &[level("/job", Some(1 << 30), 700 * MIB)], Some(share)).unwrap();
        assert_eq!(child.available, 324 * MIB);
    }

    #[test]
    fn limits_from_files() {
        let dir = std::env::temp_dir().join(format!("oomguard-cgroup-files-{}", std::process::id()));
        let (top, own) = (dir.join("top"), dir.join("top/own"));
        std::fs::create_dir_all(&own).unwrap();
        // v2: max at the top, memory.high below it tighter than its memory.max.
        std::fs::write(top.join("memory.max"), "max\n").unwrap();
        std::fs::write(top.join("memory.current"), "1000\n").unwrap();
        std::fs::write(own.join("memory.max"), format!("{}\n", 900 * MIB)).unwrap();
        std::fs::write(own.join("memory.high"), format!("{}\n", 700 * MIB)).unwrap();
        std::fs::write(own.join("memory.current"), format!("{}\n", 300 * MIB)).unwrap();
        std::fs::write(
            own.join("memory.stat"),
            format!("anon 1\ninactive_file {}\n", 200 * MIB),
        )
        .unwrap();
        let cg = Cgroup {
            v2: true,
            path: "/top/own".into(),
            levels: vec![("/top".into(), top.clone()), ("/top/own".into(), own.clone())],
        };
        let (levels, notice) = read_levels(&cg);
        assert_eq!(notice, None);
        assert_eq!(
            levels,
            [level("/top", None, 1000), level("/top/own", Some(700 * MIB), 100 * MIB)]
        );
        // v1: the near-2^63 "unlimited", and an own level that cannot be read.
        std::fs::write(top.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        std::fs::write(top.join("memory.usage_in_bytes"), "5\n").unwrap();
        let cg = Cgroup { v2: false, ..cg };
        let (levels, notice) = read_levels(&cg);
        assert_eq!(levels[0], level("/top", None, 5));
        assert!(notice.unwrap().contains("not readable"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn this_process_has_a_figure() {
        let m = HostMemory::of_self().unwrap();
        assert!(m.available > 0 && !m.describe().is_empty(), "{m:?}");
        assert_eq!(
            meminfo_kib("MemTotal: 10 kB\nMemAvailable:   2048 kB\n", "MemAvailable:"),
            Some(2048)
        );
        assert!(own_anonymous_bytes().unwrap() > 0);
    }
}
