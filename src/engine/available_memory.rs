//! How much host memory this process can still take: what the kernel
//! says it can hand out without swapping (`MemAvailable`), and, where the
//! process runs in a memory cgroup with a limit (a container started with
//! `--memory`, a Slurm job's allocation, a systemd unit's `MemoryMax`),
//! what that limit leaves, whichever is less. A machine's free memory says
//! nothing of a job's share of it: past the limit the kernel kills the
//! process however much the machine has.

use std::fmt;
use std::path::{Path, PathBuf};

const GIB: f64 = (1u64 << 30) as f64;

/// Where the cgroup file systems are mounted on Linux.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Host memory this process can take, and what bounds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AvailableMemory {
    pub bytes: u64,
    pub bound: MemoryBound,
}

/// What bounds the host memory a process can take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryBound {
    /// The machine's `MemAvailable`.
    Machine,
    /// A memory cgroup's limit: `limit` bytes, of which `in_use` are held
    /// (page cache that can be dropped not counted), by the cgroup at
    /// `path` within the cgroup file system.
    Cgroup {
        path: String,
        limit: u64,
        in_use: u64,
    },
}

impl fmt::Display for AvailableMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = |b: u64| match b as f64 / GIB {
            g if g >= 1.0 || b == 0 => format!("{g:.2} GiB"),
            _ => format!("{:.1} MiB", b as f64 / (1 << 20) as f64),
        };
        match &self.bound {
            MemoryBound::Machine => {
                write!(f, "this machine has {} available", gib(self.bytes))
            }
            MemoryBound::Cgroup {
                path,
                limit,
                in_use,
            } => write!(
                f,
                "this process's memory cgroup ({path}) is limited to {}, {} of it in use: {} \
                 available",
                gib(*limit),
                gib(*in_use),
                gib(self.bytes)
            ),
        }
    }
}

/// Memory the kernel says can be had without swapping (`MemAvailable` in
/// /proc/meminfo), or less where this process's memory cgroup allows
/// less; `None` where neither is known.
pub fn available_host_memory() -> Option<u64> {
    host_memory_available().map(|a| a.bytes)
}

/// [`available_host_memory`] with what bounds it, for messages.
pub fn host_memory_available() -> Option<AvailableMemory> {
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| parse_mem_available(&m))
        .map(|bytes| AvailableMemory {
            bytes,
            bound: MemoryBound::Machine,
        });
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_available(Path::new(CGROUP_ROOT), &c));
    least(machine, cgroup)
}

/// The lesser of two bounds where both are known.
fn least(a: Option<AvailableMemory>, b: Option<AvailableMemory>) -> Option<AvailableMemory> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.bytes < a.bytes { b } else { a }),
        (a, b) => a.or(b),
    }
}

pub(super) fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => Some(value * 1024),
        _ => None,
    }
}

/// The tightest limit on this process's memory among its memory cgroup
/// and that cgroup's ancestors (a parent's limit holds for its children),
/// as `/proc/self/cgroup` (`self_cgroup`) places it under `root`: cgroup
/// v2's `memory.max` and `memory.current`, or v1's `memory.limit_in_bytes`
/// and `memory.usage_in_bytes` under `root/memory`. What is in use leaves
/// out the inactive page cache (`memory.stat`), which the kernel drops
/// before it kills. `None` where no cgroup sets a limit.
fn cgroup_available(root: &Path, self_cgroup: &str) -> Option<AvailableMemory> {
    let mut best: Option<AvailableMemory> = None;
    for line in self_cgroup.lines() {
        // "hierarchy-id:controllers:path"; v2's has no controllers.
        let mut fields = line.splitn(3, ':').skip(1);
        let (Some(controllers), Some(path)) = (fields.next(), fields.next()) else {
            continue;
        };
        let v1 = controllers.split(',').any(|c| c == "memory");
        let files = match (controllers.is_empty(), v1) {
            (true, _) => V2,
            (false, true) => V1,
            (false, false) => continue,
        };
        let mount = match v1 {
            true => root.join("memory"),
            false => root.to_path_buf(),
        };
        best = least(best, tightest_on_path(&mount, path, files));
    }
    best
}

/// The names of a cgroup version's memory files, and the `memory.stat`
/// key of its inactive page cache.
struct Files {
    limit: &'static str,
    usage: &'static str,
    inactive_file: &'static str,
}

const V2: Files = Files {
    limit: "memory.max",
    usage: "memory.current",
    inactive_file: "inactive_file",
};

const V1: Files = Files {
    limit: "memory.limit_in_bytes",
    usage: "memory.usage_in_bytes",
    inactive_file: "total_inactive_file",
};

/// v1 reports "no limit" as the largest page-aligned i64.
const V1_UNLIMITED: u64 = 1 << 62;

/// The tightest limit from `path`'s cgroup up to the mount's root. Within
/// a container the mount's root is the container's own cgroup, while
/// `/proc/self/cgroup` may name its path on the host: where that path is
/// not under `mount`, the root alone is read.
fn tightest_on_path(mount: &Path, path: &str, files: Files) -> Option<AvailableMemory> {
    let joined = mount.join(path.trim_start_matches('/'));
    let start = match joined.is_dir() {
        true => joined,
        false => mount.to_path_buf(),
    };
    let mut best = None;
    let mut at: Option<PathBuf> = Some(start);
    while let Some(dir) = at {
        best = least(best, limit_in(&dir, mount, &files));
        at = dir
            .parent()
            .filter(|p| p.starts_with(mount))
            .map(Path::to_path_buf);
    }
    best
}

/// The headroom one cgroup directory's limit leaves, where it sets one.
fn limit_in(dir: &Path, mount: &Path, files: &Files) -> Option<AvailableMemory> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let limit: u64 = read(files.limit)?.trim().parse().ok()?; // "max": none
    if limit >= V1_UNLIMITED {
        return None;
    }
    let usage: u64 = read(files.usage)?.trim().parse().ok()?;
    let inactive = read("memory.stat")
        .and_then(|s| stat_value(&s, files.inactive_file))
        .unwrap_or(0);
    let in_use = usage.saturating_sub(inactive);
    let path = dir.strip_prefix(mount).unwrap_or(dir).display().to_string();
    Some(AvailableMemory {
        bytes: limit.saturating_sub(in_use),
        bound: MemoryBound::Cgroup {
            path: format!("/{path}"),
            limit,
            in_use,
        },
    })
}

/// The value of `key` in a `memory.stat` file.
fn stat_value(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   16000000 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(16_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        if cfg!(target_os = "linux") {
            assert!(available_host_memory().is_some_and(|b| b > 0));
        }
    }

    /// A cgroup file system under a temporary directory.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("strata-cgroup-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Tree(dir)
        }

        fn write(&self, at: &str, files: &[(&str, &str)]) {
            let dir = self.0.join(at);
            std::fs::create_dir_all(&dir).unwrap();
            for (name, text) in files {
                std::fs::write(dir.join(name), text).unwrap();
            }
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const GB: u64 = 1 << 30;

    #[test]
    fn a_v2_cgroup_s_tightest_limit_up_its_path_bounds_the_memory() {
        let tree = Tree::new("v2");
        let stat = format!("anon 5\ninactive_file {}\nactive_file 7\n", GB);
        // The job's slice limits to 8 GiB; the step inside it sets none.
        tree.write(
            "job.slice",
            &[
                ("memory.max", &format!("{}\n", 8 * GB)),
                ("memory.current", &format!("{}\n", 3 * GB)),
                ("memory.stat", &stat),
            ],
        );
        tree.write(
            "job.slice/step",
            &[
                ("memory.max", "max\n"),
                ("memory.current", &format!("{}\n", 2 * GB)),
            ],
        );
        let got = cgroup_available(&tree.0, "0::/job.slice/step\n").unwrap();
        // 3 GiB in use, 1 GiB of it page cache the kernel can drop.
        assert_eq!(got.bytes, 6 * GB);
        assert_eq!(
            got.bound,
            MemoryBound::Cgroup {
                path: "/job.slice".into(),
                limit: 8 * GB,
                in_use: 2 * GB
            }
        );
        let said = got.to_string();
        assert!(
            said.contains("(/job.slice) is limited to 8.00 GiB, 2.00 GiB of it in use: 6.00 GiB"),
            "{said}"
        );
        // A tighter limit below wins.
        tree.write(
            "job.slice/step",
            &[("memory.max", &format!("{}\n", 4 * GB))],
        );
        let got = cgroup_available(&tree.0, "0::/job.slice/step\n").unwrap();
        assert_eq!(got.bytes, 2 * GB);
        // No limit anywhere: nothing to say.
        tree.write("job.slice", &[("memory.max", "max\n")]);
        tree.write("job.slice/step", &[("memory.max", "max\n")]);
        assert_eq!(cgroup_available(&tree.0, "0::/job.slice/step\n"), None);
    }

    #[test]
    fn a_v1_memory_cgroup_is_read_and_a_host_path_falls_back_to_the_mount() {
        let tree = Tree::new("v1");
        // A line that is not "id:controllers:path" is passed over.
        let self_cgroup = "garbage\n4:memory:/docker/abc\n3:cpuset:/\n0::/\n";
        // Inside a container the mount's root is the container's cgroup.
        tree.write(
            "memory",
            &[
                ("memory.limit_in_bytes", &format!("{}\n", 4 * GB)),
                ("memory.usage_in_bytes", &format!("{}\n", GB)),
                ("memory.stat", "cache 9\ntotal_inactive_file 0\n"),
            ],
        );
        let got = cgroup_available(&tree.0, self_cgroup).unwrap();
        assert_eq!(got.bytes, 3 * GB);
        assert_eq!(
            got.bound,
            MemoryBound::Cgroup {
                path: "/".into(),
                limit: 4 * GB,
                in_use: GB
            }
        );
        // Unlimited, as v1 writes it.
        tree.write(
            "memory",
            &[("memory.limit_in_bytes", "9223372036854771712\n")],
        );
        assert_eq!(cgroup_available(&tree.0, self_cgroup), None);
    }

    #[test]
    fn the_lesser_bound_is_the_one_given() {
        let machine = AvailableMemory {
            bytes: 20 * GB,
            bound: MemoryBound::Machine,
        };
        let cgroup = AvailableMemory {
            bytes: 6 * GB,
            bound: MemoryBound::Cgroup {
                path: "/a".into(),
                limit: 8 * GB,
                in_use: 2 * GB,
            },
        };
        let pick = |a: &AvailableMemory, b: &AvailableMemory| {
            least(Some(a.clone()), Some(b.clone())).unwrap()
        };
        assert_eq!(pick(&machine, &cgroup), cgroup);
        assert_eq!(pick(&cgroup, &machine), cgroup);
        assert_eq!(least(Some(machine.clone()), None), Some(machine.clone()));
        assert_eq!(least(None, Some(machine.clone())), Some(machine.clone()));
        assert_eq!(machine.to_string(), "this machine has 20.00 GiB available");
    }
}
