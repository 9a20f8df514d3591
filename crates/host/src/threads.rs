//! Owns how many CPU threads this process may use: the smallest of the affinity mask, the
//! cgroup quota, Slurm's CPUs per task and the CPUs online.
//! Keeps: OMP_NUM_THREADS, when the user set it, always wins; `decide` is pure.
use super::cgroup::Cgroup;
use super::read_u64;

/// What the process can see about its CPU share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuFacts {
    pub omp_num_threads: Option<String>,
    pub slurm_cpus_per_task: Option<String>,
    /// CPUs in the affinity mask.
    pub affinity: Option<usize>,
    /// CPUs' worth of quota (quota / period), and the cgroup that sets it.
    pub quota: Option<(f64, String)>,
    pub online: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Threads {
    pub n: usize,
    /// Which limit decided, for the log: `cpu quota 2.0 of cgroup /kubepods/...`.
    pub why: String,
}

impl std::fmt::Display for Threads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} thread{} ({})",
            self.n,
            if self.n == 1 { "" } else { "s" },
            self.why
        )
    }
}

/// The most threads a process is given: libtorch takes an i32, and past a few thousand
/// OpenMP fails creating them.
pub const MAX_THREADS: usize = 4096;

/// `4` or OpenMP's nested list `4,2` (the first level counts); 0, more than `MAX_THREADS`
/// or text is not a count.
fn count(v: &str) -> Option<usize> {
    v.split(',')
        .next()?
        .trim()
        .parse()
        .ok()
        .filter(|&n| (1..=MAX_THREADS).contains(&n))
}

pub fn decide(f: &CpuFacts) -> Threads {
    if let Some(n) = f.omp_num_threads.as_deref().and_then(count) {
        return Threads {
            n,
            why: format!("OMP_NUM_THREADS={n}"),
        };
    }
    let online = f.online.max(1);
    // In order of preference on a tie: the most specific source names the limit.
    let candidates = [
        f.slurm_cpus_per_task
            .as_deref()
            .and_then(count)
            .map(|n| (n, format!("SLURM_CPUS_PER_TASK={n}"))),
        f.quota.as_ref().map(|(q, cg)| {
            (
                ((*q).floor() as usize).max(1),
                format!("cpu quota {q:.1} of cgroup {cg}"),
            )
        }),
        f.affinity.map(|n| {
            (
                n.max(1),
                format!("affinity mask of {n} CPU{}", if n == 1 { "" } else { "s" }),
            )
        }),
        Some((
            online,
            format!("{online} CPU{} online", if online == 1 { "" } else { "s" }),
        )),
    ];
    let (n, why) = candidates
        .into_iter()
        .flatten()
        .min_by_key(|(n, _)| *n)
        .expect("online is always there");
    Threads { n, why }
}

impl Threads {
    pub fn of_self() -> Threads {
        decide(&CpuFacts {
            omp_num_threads: std::env::var("OMP_NUM_THREADS").ok().filter(|v| !v.trim().is_empty()),
            slurm_cpus_per_task: std::env::var("SLURM_CPUS_PER_TASK").ok(),
            affinity: affinity(),
            quota: Cgroup::of_self("cpu").and_then(|cg| quota(&cg)),
            online: online(),
        })
    }

    /// Each of `n` processes' share: at least 1.
    pub fn share(&self, n: usize) -> usize {
        (self.n / n.max(1)).max(1)
    }
}

/// CPUs in this process's affinity mask. Not `std::thread::available_parallelism`: that is
/// the smaller of the mask and the cgroup quota in one number, and the log names which
/// limit decided (`decide`); the quota is read separately (`quota`).
fn affinity() -> Option<usize> {
    // SAFETY: a zeroed cpu_set_t is valid, and sched_getaffinity writes at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0)
            .then(|| libc::CPU_COUNT(&set) as usize)
    }
}

/// CPUs online (not in the mask: the upper bound every other limit is compared with).
fn online() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        1
    }
}

/// The tightest CPU quota from the process's cgroup up: v2 `cpu.max` (`QUOTA PERIOD` or
/// `max PERIOD`), v1 `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us`.
pub fn quota(cg: &Cgroup) -> Option<(f64, String)> {
    cg.levels
        .iter()
        .filter_map(|(path, dir)| {
            let q = if cg.v2 {
                let text = std::fs::read_to_string(dir.join("cpu.max")).ok()?;
                parse_cpu_max(&text)?
            } else {
                let quota = std::fs::read_to_string(dir.join("cpu.cfs_quota_us"))
                    .ok()?
                    .trim()
                    .parse::<i64>()
                    .ok()
                    .filter(|&q| q > 0)?;
                let period = read_u64(&dir.join("cpu.cfs_period_us")).filter(|&p| p > 0)?;
                quota as f64 / period as f64
            };
            Some((q, path.clone()))
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
}

fn parse_cpu_max(text: &str) -> Option<f64> {
    let mut it = text.split_whitespace();
    let quota: f64 = it.next()?.parse().ok()?; // `max` does not parse: no quota
    let period: f64 = it.next().and_then(|p| p.parse().ok()).filter(|&p: &f64| p > 0.0)?;
    Some(quota / period)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> CpuFacts {
        CpuFacts {
            online: 16,
            ..Default::default()
        }
    }

    #[test]
    fn each_source_decides_when_it_is_the_smallest() {
        assert_eq!(decide(&facts()).to_string(), "16 threads (16 CPUs online)");
        let f = CpuFacts {
            affinity: Some(1),
            ..facts()
        };
        assert_eq!(decide(&f).to_string(), "1 thread (affinity mask of 1 CPU)");
        let f = CpuFacts {
            affinity: Some(8),
            quota: Some((2.0, "/kubepods/pod1".into())),
            ..facts()
        };
        assert_eq!(
            decide(&f).to_string(),
            "2 threads (cpu quota 2.0 of cgroup /kubepods/pod1)"
        );
        let f = CpuFacts {
            quota: Some((1.5, "/k".into())),
            ..facts()
        };
        assert_eq!(decide(&f).n, 1, "a fraction of a CPU rounds down");
        let f = CpuFacts {
            quota: Some((0.2, "/k".into())),
            ..facts()
        };
        assert_eq!(decide(&f).n, 1, "never 0");
        let f = CpuFacts {
            slurm_cpus_per_task: Some("4".into()),
            affinity: Some(4),
            ..facts()
        };
        assert_eq!(decide(&f).to_string(), "4 threads (SLURM_CPUS_PER_TASK=4)");
        let f = CpuFacts {
            slurm_cpus_per_task: Some("4".into()),
            affinity: Some(2),
            ..facts()
        };
        assert_eq!(decide(&f).why, "affinity mask of 2 CPUs");
    }

    #[test]
    fn omp_num_threads_always_wins_when_it_is_a_count() {
        let f = CpuFacts {
            omp_num_threads: Some("6".into()),
            affinity: Some(1),
            slurm_cpus_per_task: Some("1".into()),
            ..facts()
        };
        assert_eq!(decide(&f).to_string(), "6 threads (OMP_NUM_THREADS=6)");
        assert_eq!(
            decide(&CpuFacts {
                omp_num_threads: Some("3,2".into()),
                ..facts()
            })
            .n,
            3
        );
        for bad in ["0", "lots", "", "4294967296", "4097"] {
            assert_eq!(
                decide(&CpuFacts {
                    omp_num_threads: Some(bad.into()),
                    ..facts()
                })
                .n,
                16,
                "{bad}"
            );
        }
        assert_eq!(
            decide(&CpuFacts {
                slurm_cpus_per_task: Some("x".into()),
                ..facts()
            })
            .n,
            16
        );
    }

    #[test]
    fn shares_and_quota_files() {
        assert_eq!(
            Threads {
                n: 8,
                why: String::new()
            }
            .share(3),
            2
        );
        assert_eq!(
            Threads {
                n: 2,
                why: String::new()
            }
            .share(4),
            1
        );
        assert_eq!(parse_cpu_max("200000 100000\n"), Some(2.0));
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        let dir = std::env::temp_dir().join(format!("oomguard-cpu-quota-{}", std::process::id()));
        let (top, own) = (dir.clone(), dir.join("own"));
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(top.join("cpu.cfs_quota_us"), "150000\n").unwrap();
        std::fs::write(top.join("cpu.cfs_period_us"), "100000\n").unwrap();
        std::fs::write(own.join("cpu.cfs_quota_us"), "-1\n").unwrap();
        std::fs::write(own.join("cpu.cfs_period_us"), "100000\n").unwrap();
        let cg = Cgroup {
            v2: false,
            path: "/a/own".into(),
            levels: vec![("/a".into(), top), ("/a/own".into(), own)],
        };
        assert_eq!(quota(&cg), Some((1.5, "/a".into())));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn this_process() {
        let t = Threads::of_self();
        assert!(t.n >= 1, "{t}");
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            assert!(t.n <= online(), "{t}");
        }
        assert!(affinity().unwrap() >= 1);
    }
}
