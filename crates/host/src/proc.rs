//! Owns child processes and the signals that stop a parent.
//! Keeps: a child started here never outlives its parent, even one killed by SIGKILL.
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Starts `cmd` as the leader of its own process group, under a shim (see `shim`) that
/// kills the whole group if this process dies, even of SIGKILL.
pub fn spawn_shimmed(cmd: &mut Command) -> std::io::Result<Child> {
    let parent = std::process::id() as i32;
    cmd.process_group(0);
    // SAFETY: the closure runs in the forked child before exec and makes only syscalls
    // (no allocation, no lock): see `shim`.
    unsafe {
        cmd.pre_exec(move || shim(parent));
    }
    cmd.spawn()
}

/// The kernel's OOM kills so far, on this host (`/proc/vmstat`'s `oom_kill`: a cgroup's
/// limit or the machine's memory run out; Linux 4.13 and later). None where it cannot tell.
pub fn kernel_oom_kills() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/vmstat").ok()?;
    parse_oom_kills(&text)
}

fn parse_oom_kills(vmstat: &str) -> Option<u64> {
    vmstat
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
}

/// Sends `sig` to the process group `child` leads.
pub fn signal_group(child: &Child, sig: i32) {
    // SAFETY: a plain syscall.
    unsafe { libc::killpg(child.id() as i32, sig) };
}

/// The signals a parent (the launcher, the sweep) catches and passes on to its workers'
/// process groups: torchrun's `--signals-to-handle` default.
pub const FORWARDED: [i32; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// Signals to this process (the launcher, the sweep), of `FORWARDED`: the last one's number,
/// and how many arrived. A clone shares them.
#[derive(Clone)]
pub struct Signals {
    pub last: Arc<AtomicUsize>,
    pub count: Arc<AtomicUsize>,
}

impl Signals {
    pub fn install() -> std::io::Result<Signals> {
        let s = Signals {
            last: Arc::default(),
            count: Arc::default(),
        };
        for sig in FORWARDED {
            let (last, count) = (Arc::clone(&s.last), Arc::clone(&s.count));
            // SAFETY: the handler only stores to atomics, which is async-signal-safe.
            unsafe {
                signal_hook::low_level::register(sig, move || {
                    last.store(sig as usize, Ordering::SeqCst);
                    count.fetch_add(1, Ordering::SeqCst);
                })
            }?;
        }
        Ok(s)
    }
    pub fn received(&self) -> Option<i32> {
        (self.count.load(Ordering::SeqCst) > 0).then(|| self.last.load(Ordering::SeqCst) as i32)
    }
}

/// Between the parent (the launcher, the sweep) and each worker stands a shim: the process
/// the parent starts, leader of the worker's process group. It forks; the child goes on to
/// exec the worker (and dies with the shim, PR_SET_PDEATHSIG); the shim waits and exits as
/// the worker did (code or signal). If the parent dies, even of SIGKILL, the shim learns it
/// (PR_SET_PDEATHSIG SIGTERM, and its parent is no longer the same) and kills its whole
/// process group: the worker and every child the worker started. PR_SET_PDEATHSIG alone
/// reaches only the worker itself, not its children.
///
/// Runs after fork in a multi-threaded process: syscalls only, no allocation, no locks.
fn shim(parent: i32) -> std::io::Result<()> {
    // SAFETY: plain syscalls on local, initialised values.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
        if libc::getppid() != parent {
            libc::_exit(1); // the parent died before prctl took effect
        }
        let mut waited: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut waited);
        // The parent's signals to the group reach the worker; the shim waits them out.
        libc::sigaddset(&mut waited, libc::SIGCHLD);
        for sig in FORWARDED {
            libc::sigaddset(&mut waited, sig);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &waited, &mut old);
        let shim = libc::getpid();
        let worker = libc::fork();
        if worker < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if worker == 0 {
            libc::sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != shim {
                libc::_exit(1);
            }
            return Ok(()); // on to exec the worker
        }
        // The shim never execs: it must not hold std's exec-status pipe (spawn waits for it to
        // close) nor anything else of the parent's.
        if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) != 0 {
            for fd in 3..65536 {
                libc::close(fd);
            }
        }
        loop {
            let sig = libc::sigwaitinfo(&waited, std::ptr::null_mut());
            if sig == libc::SIGCHLD {
                let mut status = 0;
                if libc::waitpid(worker, &mut status, libc::WNOHANG) == worker {
                    if libc::WIFSIGNALED(status) {
                        // Die of the same signal, so the launcher reports it as torchrun does.
                        let s = libc::WTERMSIG(status);
                        libc::signal(s, libc::SIG_DFL);
                        let mut one: libc::sigset_t = std::mem::zeroed();
                        libc::sigemptyset(&mut one);
                        libc::sigaddset(&mut one, s);
                        libc::sigprocmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
                        libc::kill(shim, s);
                        libc::_exit(128 + s);
                    }
                    libc::_exit(libc::WEXITSTATUS(status));
                }
            } else if sig > 0 && libc::getppid() != parent {
                // The parent is gone: take the worker and all it started with us.
                libc::kill(0, libc::SIGKILL);
                libc::_exit(137);
            }
            // A signal from the parent to the whole group reached the worker too: wait on.
        }
    }
}

#[cfg(test)]
mod oom_kill_tests {
    use super::parse_oom_kills;

    #[test]
    fn the_kernels_oom_kills_are_read_from_vmstat() {
        assert_eq!(parse_oom_kills("pgfault 12\noom_kill 3\nnr_free_pages 9\n"), Some(3));
        assert_eq!(parse_oom_kills("oom_kill_disable 0\n"), None);
        assert_eq!(parse_oom_kills(""), None);
    }
}
