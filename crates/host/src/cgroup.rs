//! Owns finding the process's own cgroup directories, for cgroup v2 and v1.
//! Keeps: parsing is pure and tested on samples; only `Cgroup::of_self` reads /proc.
use std::path::{Path, PathBuf};

/// One line of /proc/self/cgroup: `ID:CONTROLLERS:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// Empty for the v2 line (`0::/path`) and for named v1 hierarchies (`name=systemd`).
    pub controllers: Vec<String>,
    pub path: String,
    pub v2: bool,
}

pub fn parse_proc_cgroup(text: &str) -> Vec<Membership> {
    text.lines()
        .filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (id, ctl, path) = (parts.next()?, parts.next()?, parts.next()?);
            let controllers = ctl
                .split(',')
                .filter(|c| !c.is_empty() && !c.starts_with("name="))
                .map(str::to_string)
                .collect();
            Some(Membership {
                controllers,
                path: path.to_string(),
                v2: id == "0" && ctl.is_empty(),
            })
        })
        .collect()
}

/// One cgroup mount from /proc/self/mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The cgroup path (in the hierarchy) that is mounted here: `/` on a host, the
    /// container's own path when it has no cgroup namespace.
    pub root: String,
    pub mount_point: PathBuf,
    pub v2: bool,
    /// v1: the controllers this hierarchy carries (from the super options).
    pub controllers: Vec<String>,
}

/// The cgroup mounts in a mountinfo text (other file systems are left out).
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let mut right = right.split(' ');
            let fstype = right.next()?;
            let _source = right.next()?;
            let options = right.next().unwrap_or("");
            let v2 = match fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            let controllers = if v2 {
                vec![]
            } else {
                options.split(',').map(str::to_string).collect()
            };
            Some(Mount {
                root: unescape(left.get(3)?),
                mount_point: PathBuf::from(unescape(left.get(4)?)),
                v2,
                controllers,
            })
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash as `\040`-style octal.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where one controller's files for this process live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    pub v2: bool,
    /// The process's cgroup path, as /proc/self/cgroup names it (for the log).
    pub path: String,
    /// The directories from the visible top of the hierarchy down to the process's own
    /// cgroup, each with its cgroup path: a limit on any of them applies.
    pub levels: Vec<(String, PathBuf)>,
}

impl Cgroup {
    /// The cgroup that holds `controller` (`memory`, `cpu`): the v1 hierarchy that carries
    /// it when there is one (that is where a hybrid host enforces it), else the v2 one.
    pub fn find(controller: &str, memberships: &[Membership], mounts: &[Mount]) -> Option<Cgroup> {
        let v1 = memberships
            .iter()
            .find(|m| !m.v2 && m.controllers.iter().any(|c| c == controller))
            .and_then(|m| {
                let mount = mounts
                    .iter()
                    .find(|x| !x.v2 && x.controllers.iter().any(|c| c == controller))?;
                Some((m, mount))
            });
        let (m, mount) = v1.or_else(|| {
            let m = memberships.iter().find(|m| m.v2)?;
            Some((m, mounts.iter().find(|x| x.v2)?))
        })?;
        Some(Cgroup {
            v2: mount.v2,
            path: m.path.clone(),
            levels: levels(&m.path, mount),
        })
    }

    /// This process's cgroup for `controller`, from /proc; None where there is none to read.
    pub fn of_self(controller: &str) -> Option<Cgroup> {
        let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let mi = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        Cgroup::find(controller, &parse_proc_cgroup(&cg), &parse_mountinfo(&mi))
    }

    /// The process's own cgroup directory.
    pub fn dir(&self) -> &Path {
        &self.levels.last().expect("levels holds at least the mount point").1
    }
}

/// The mount point and each directory below it down to `path`. A path outside the mount's
/// root (a namespace that hides it) is the mount point alone.
fn levels(path: &str, mount: &Mount) -> Vec<(String, PathBuf)> {
    let root = mount.root.trim_end_matches('/');
    let below = match path.strip_prefix(root) {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
        _ => "",
    };
    let mut out = vec![(
        if root.is_empty() {
            "/".to_string()
        } else {
            root.to_string()
        },
        mount.mount_point.clone(),
    )];
    let mut dir = mount.mount_point.clone();
    let mut name = root.to_string();
    for part in below.split('/').filter(|p| !p.is_empty() && *p != "." && *p != "..") {
        dir.push(part);
        name = format!("{name}/{part}");
        out.push((name.clone(), dir.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1_CGROUP: &str = "9:name=systemd:/\n8:pids:/\n4:memory:/slurm/uid_1000/job_42/step_0\n2:cpu,cpuacct:/slurm/uid_1000/job_42/step_0\n0::/\n";
    const V1_MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /cgroups/mem\\040ory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
22 1 8:1 / / rw - ext4 /dev/vda rw
";

    #[test]
    fn v1_slurm_step_with_a_memory_hierarchy_mounted_elsewhere() {
        let m = parse_proc_cgroup(V1_CGROUP);
        let mounts = parse_mountinfo(V1_MOUNTS);
        assert_eq!(mounts.len(), 3, "tmpfs and ext4 are not cgroups");
        let cg = Cgroup::find("memory", &m, &mounts).unwrap();
        assert!(!cg.v2);
        assert_eq!(cg.path, "/slurm/uid_1000/job_42/step_0");
        assert_eq!(cg.dir(), Path::new("/cgroups/mem ory/slurm/uid_1000/job_42/step_0"));
        let names: Vec<&str> = cg.levels.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "/",
                "/slurm",
                "/slurm/uid_1000",
                "/slurm/uid_1000/job_42",
                "/slurm/uid_1000/job_42/step_0"
            ]
        );
        let cpu = Cgroup::find("cpu", &m, &mounts).unwrap();
        assert_eq!(
            cpu.dir(),
            Path::new("/sys/fs/cgroup/cpu,cpuacct/slurm/uid_1000/job_42/step_0")
        );
    }

    #[test]
    fn v2_systemd_scope_and_kubernetes_pod() {
        let mounts = parse_mountinfo("30 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n");
        let scope = parse_proc_cgroup("0::/user.slice/user-1000.slice/run-r1234.scope\n");
        let cg = Cgroup::find("memory", &scope, &mounts).unwrap();
        assert!(cg.v2);
        assert_eq!(
            cg.dir(),
            Path::new("/sys/fs/cgroup/user.slice/user-1000.slice/run-r1234.scope")
        );
        assert_eq!(cg.levels.len(), 4);
        let pod = parse_proc_cgroup(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-ab.scope\n",
        );
        assert_eq!(Cgroup::find("cpu", &pod, &mounts).unwrap().levels.len(), 5);
    }

    #[test]
    fn a_container_with_its_own_namespace_or_a_mounted_root_sees_only_its_own_cgroup() {
        let ns = Cgroup::find(
            "memory",
            &parse_proc_cgroup("0::/\n"),
            &parse_mountinfo("1 0 0:1 / /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n"),
        )
        .unwrap();
        assert_eq!(ns.levels, [("/".to_string(), PathBuf::from("/sys/fs/cgroup"))]);
        // v1 without a cgroup namespace: the container's path is the mount's root.
        let docker = Cgroup::find(
            "memory",
            &parse_proc_cgroup("4:memory:/docker/abc\n"),
            &parse_mountinfo("35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"),
        )
        .unwrap();
        assert_eq!(
            docker.levels,
            [("/docker/abc".to_string(), PathBuf::from("/sys/fs/cgroup/memory"))]
        );
    }

    #[test]
    fn nothing_to_find() {
        assert_eq!(Cgroup::find("memory", &parse_proc_cgroup(""), &[]), None);
        assert_eq!(
            Cgroup::find(
                "memory",
                &parse_proc_cgroup("0::/a\n"),
                &parse_mountinfo("22 1 8:1 / / rw - ext4 /dev/vda rw\n")
            ),
            None
        );
        assert_eq!(parse_proc_cgroup("garbage\n"), []);
    }

    #[test]
    fn this_process_has_a_readable_memory_cgroup_here() {
        // Linux with /proc: every process is in some cgroup.
        let cg = Cgroup::of_self("memory").expect("a cgroup");
        assert!(cg.dir().is_dir(), "{cg:?}");
    }
}
