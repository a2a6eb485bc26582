//! A memory cgroup of our own with a limit, for the memory gate's benchmark
//! and its tests (which use it from here): removed on drop, after its
//! processes are killed and gone.
//!
//! cgroup v1 or v2, by what is mounted with the memory controller: v1's
//! memory hierarchy (`memory.limit_in_bytes`, `memory.oom_control`) where
//! one is mounted, else a cgroup2 mount whose root offers `memory`, with a
//! child under it (`memory` enabled in the root's `cgroup.subtree_control`,
//! `memory.max`, `memory.swap.max`, `memory.events`). A host with both
//! (v1 for memory, a v2 hierarchy beside it without) uses v1, as the
//! kernel gives the controller to one hierarchy only.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Which cgroup version a [`MemCgroup`] is made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// The memory controller's own hierarchy.
    V1,
    /// The unified hierarchy.
    V2,
}

/// Why no memory cgroup can be made here: what a test skips for, as
/// opposed to a cgroup that was made and then misbehaved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unusable {
    /// Making cgroups needs root.
    NotRoot,
    /// No hierarchy with the memory controller, or one that will not take
    /// a child with it; the reason.
    NoMemoryCgroup(String),
}

impl std::fmt::Display for Unusable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unusable::NotRoot => write!(f, "a memory cgroup of our own needs root"),
            Unusable::NoMemoryCgroup(why) => write!(f, "no usable memory cgroup: {why}"),
        }
    }
}

impl std::error::Error for Unusable {}

/// Where memory cgroups are made: v1's memory hierarchy, or the cgroup v2
/// mount whose children can have the memory controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    /// Its cgroup version.
    pub version: Version,
    /// The cgroup the new one is made in (the mount's root).
    pub parent: PathBuf,
}

impl Hierarchy {
    /// The hierarchy on this machine, by `/proc/self/mounts`; checks root
    /// first.
    ///
    /// # Errors
    /// Not root, or no memory controller to use.
    pub fn find() -> Result<Hierarchy, Unusable> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(Unusable::NotRoot);
        }
        let mounts = std::fs::read_to_string("/proc/self/mounts")
            .map_err(|e| Unusable::NoMemoryCgroup(format!("reading /proc/self/mounts: {e}")))?;
        Self::find_in(Path::new("/"), &mounts)
    }

    /// [`Hierarchy::find`] from the text of a mounts table, each mount
    /// point read below `root` (`/` here; a fake tree in tests). A v1
    /// mount with `memory` in its options wins; else a cgroup2 mount whose
    /// `cgroup.controllers` lists `memory`.
    ///
    /// # Errors
    /// Neither is there.
    pub fn find_in(root: &Path, mounts: &str) -> Result<Hierarchy, Unusable> {
        let mut v2 = None;
        let mut seen = Vec::new();
        for line in mounts.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [_, point, fstype, options, ..] = fields[..] else {
                continue;
            };
            let dir = root.join(unescape(point).trim_start_matches('/'));
            match fstype {
                "cgroup" if options.split(',').any(|o| o == "memory") => {
                    if dir.join("memory.limit_in_bytes").exists() {
                        return Ok(Hierarchy {
                            version: Version::V1,
                            parent: dir,
                        });
                    }
                    seen.push(format!(
                        "cgroup v1 memory at {point} has no memory.limit_in_bytes"
                    ));
                }
                "cgroup2" if v2.is_none() => {
                    let controllers =
                        std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
                    if controllers.split_whitespace().any(|c| c == "memory") {
                        v2 = Some(Hierarchy {
                            version: Version::V2,
                            parent: dir,
                        });
                    } else {
                        seen.push(format!(
                            "cgroup2 at {point} offers no memory controller ({})",
                            controllers.trim()
                        ));
                    }
                }
                _ => {}
            }
        }
        v2.ok_or_else(|| {
            if seen.is_empty() {
                seen.push("neither cgroup v1 nor cgroup2 is mounted".into());
            }
            Unusable::NoMemoryCgroup(seen.join("; "))
        })
    }

    /// On v2, `memory` in the parent's `cgroup.subtree_control`, so that
    /// its children get the controller's files; enabled here if missing.
    ///
    /// # Errors
    /// The kernel refuses (a parent with processes of its own, not the
    /// root, say).
    fn enable_memory(&self) -> Result<(), Unusable> {
        if self.version == Version::V1 {
            return Ok(());
        }
        let control = self.parent.join("cgroup.subtree_control");
        let enabled = std::fs::read_to_string(&control).unwrap_or_default();
        if enabled.split_whitespace().any(|c| c == "memory") {
            return Ok(());
        }
        std::fs::write(&control, "+memory").map_err(|e| {
            Unusable::NoMemoryCgroup(format!(
                "cannot enable memory in {}: {e}",
                control.display()
            ))
        })
    }
}

/// A mount point as /proc/self/mounts writes it, with its octal escapes
/// (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let mut out = String::new();
    let mut rest = field;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest
            .get(i + 1..i + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(byte) => {
                out.push(char::from(byte));
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The count on the line `oom_kill N` of v1's `memory.oom_control` or
/// v2's `memory.events`.
fn oom_kill_count(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

/// The cgroup; see [`MemCgroup::new`].
pub struct MemCgroup {
    path: PathBuf,
    version: Version,
}

impl MemCgroup {
    /// `baton-NAME-PID` in the memory [`Hierarchy`], limited to `limit`
    /// bytes without swap (a job over the limit is killed, not slowed).
    ///
    /// # Errors
    /// An [`Unusable`] (downcast it) where no memory cgroup can be made
    /// here; otherwise the cgroup would not take its limit.
    pub fn new(name: &str, limit: u64) -> Result<Self> {
        let hierarchy = Hierarchy::find()?;
        hierarchy.enable_memory()?;
        let path = hierarchy
            .parent
            .join(format!("baton-{name}-{}", std::process::id()));
        std::fs::create_dir(&path)
            .map_err(|e| Unusable::NoMemoryCgroup(format!("creating {}: {e}", path.display())))?;
        let cgroup = MemCgroup {
            path,
            version: hierarchy.version,
        };
        match cgroup.version {
            Version::V1 => {
                std::fs::write(cgroup.path.join("memory.limit_in_bytes"), limit.to_string())
                    .context("setting the cgroup's memory limit")?;
                let _ = std::fs::write(cgroup.path.join("memory.swappiness"), "0");
            }
            Version::V2 => {
                std::fs::write(cgroup.path.join("memory.max"), limit.to_string())
                    .context("setting the cgroup's memory.max")?;
                // Absent where the kernel does not account swap: nothing
                // to swap to then.
                let swap = cgroup.path.join("memory.swap.max");
                if swap.exists() {
                    std::fs::write(swap, "0").context("setting the cgroup's memory.swap.max")?;
                }
            }
        }
        Ok(cgroup)
    }

    /// The cgroup version it was made in.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Processes the OOM killer has killed in this cgroup.
    ///
    /// # Errors
    /// The kernel does not count them (v1 before Linux 4.13).
    pub fn oom_kills(&self) -> Result<u64> {
        let file = match self.version {
            Version::V1 => "memory.oom_control",
            Version::V2 => "memory.events",
        };
        let text = std::fs::read_to_string(self.path.join(file))
            .with_context(|| format!("reading {file}"))?;
        oom_kill_count(&text)
            .with_context(|| format!("no oom_kill in {file} (Linux 4.13 or later)"))
    }

    /// A shell prefix that moves itself into the cgroup, then runs its
    /// arguments.
    pub fn enter(&self) -> Vec<String> {
        let procs = self.path.join("cgroup.procs");
        vec![
            "sh".into(),
            "-c".into(),
            format!("echo $$ > {} && exec \"$@\"", procs.display()),
            "enter-cgroup".into(),
        ]
    }

    /// [`MemCgroup::enter`] as a command to add arguments to.
    pub fn command(&self) -> Command {
        let enter = self.enter();
        let mut c = Command::new(&enter[0]);
        c.args(&enter[1..]);
        c
    }

    fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect()
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        for pid in self.pids() {
            // SAFETY: kill(2) on a process of our own cgroup.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for _ in 0..500 {
            if self.pids().is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = std::fs::remove_dir(&self.path);
    }
}

#[cfg(test)]
mod tests {
    //! The parts that read files, on fake trees: this machine has cgroup v1
    //! for memory, so v2 cannot be made here for real.
    use super::*;
    use baton_testkit::TempDir;

    /// Writes `text` to `path` below `root`, making its directories.
    fn put(root: &Path, path: &str, text: &str) {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// The mounts of a host with v1 for memory and a v2 hierarchy beside
    /// it without controllers (this machine's).
    const HYBRID: &str = "\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";

    /// The mounts of a host with cgroup v2 alone.
    const UNIFIED: &str = "\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0
";

    #[test]
    fn v1_is_chosen_where_it_has_the_memory_controller() {
        let tree = TempDir::new("cgroup-hybrid");
        put(
            tree.path(),
            "sys/fs/cgroup/memory/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        put(
            tree.path(),
            "sys/fs/cgroup/unified/cgroup.controllers",
            "\n",
        );
        assert_eq!(
            Hierarchy::find_in(tree.path(), HYBRID),
            Ok(Hierarchy {
                version: Version::V1,
                parent: tree.path().join("sys/fs/cgroup/memory"),
            })
        );
        // A v2 mount that does offer memory loses to v1 all the same.
        put(
            tree.path(),
            "sys/fs/cgroup/unified/cgroup.controllers",
            "memory pids\n",
        );
        assert_eq!(
            Hierarchy::find_in(tree.path(), HYBRID).unwrap().version,
            Version::V1
        );
    }

    #[test]
    fn v2_is_chosen_where_it_alone_has_the_memory_controller() {
        let tree = TempDir::new("cgroup-unified");
        put(
            tree.path(),
            "sys/fs/cgroup/cgroup.controllers",
            "cpuset cpu io memory hugetlb pids rdma misc\n",
        );
        assert_eq!(
            Hierarchy::find_in(tree.path(), UNIFIED),
            Ok(Hierarchy {
                version: Version::V2,
                parent: tree.path().join("sys/fs/cgroup"),
            })
        );
        // v1 mounted without its files (or for other controllers) is no
        // reason to pass over v2.
        let tree = TempDir::new("cgroup-v1-empty");
        put(
            tree.path(),
            "sys/fs/cgroup/unified/cgroup.controllers",
            "memory\n",
        );
        assert_eq!(
            Hierarchy::find_in(tree.path(), HYBRID).unwrap().version,
            Version::V2
        );
    }

    #[test]
    fn no_memory_controller_anywhere_is_unusable_and_says_why() {
        let tree = TempDir::new("cgroup-none");
        put(
            tree.path(),
            "sys/fs/cgroup/cgroup.controllers",
            "cpu io pids\n",
        );
        let Err(Unusable::NoMemoryCgroup(why)) = Hierarchy::find_in(tree.path(), UNIFIED) else {
            panic!("a v2 mount without memory was taken");
        };
        assert!(
            why.contains("cgroup2 at /sys/fs/cgroup offers no memory controller (cpu io pids)"),
            "{why}"
        );
        let Err(Unusable::NoMemoryCgroup(why)) = Hierarchy::find_in(tree.path(), "") else {
            panic!("no mounts, yet a hierarchy");
        };
        assert!(
            why.contains("neither cgroup v1 nor cgroup2 is mounted"),
            "{why}"
        );
    }

    #[test]
    fn a_mount_point_with_a_space_is_read_unescaped() {
        let tree = TempDir::new("cgroup-space");
        put(tree.path(), "cg roup/cgroup.controllers", "memory\n");
        assert_eq!(
            Hierarchy::find_in(tree.path(), "none /cg\\040roup cgroup2 rw 0 0\n")
                .unwrap()
                .parent,
            tree.path().join("cg roup")
        );
        assert_eq!(unescape("a\\134b\\x"), "a\\b\\x");
    }

    #[test]
    fn v2_enables_memory_in_the_parents_subtree_control_only_where_missing() {
        let tree = TempDir::new("cgroup-enable");
        let v2 = Hierarchy {
            version: Version::V2,
            parent: tree.path().to_owned(),
        };
        let control = tree.path().join("cgroup.subtree_control");
        put(tree.path(), "cgroup.subtree_control", "cpu memory\n");
        v2.enable_memory().unwrap();
        assert_eq!(std::fs::read_to_string(&control).unwrap(), "cpu memory\n");
        put(tree.path(), "cgroup.subtree_control", "cpu\n");
        v2.enable_memory().unwrap();
        assert_eq!(std::fs::read_to_string(&control).unwrap(), "+memory");
        // A parent the kernel will not change (here: not there at all).
        let gone = Hierarchy {
            version: Version::V2,
            parent: tree.path().join("gone"),
        };
        assert!(matches!(
            gone.enable_memory(),
            Err(Unusable::NoMemoryCgroup(why)) if why.contains("cannot enable memory")
        ));
    }

    #[test]
    fn oom_kills_are_read_from_each_versions_file() {
        let tree = TempDir::new("cgroup-oom");
        put(
            tree.path(),
            "v1/memory.oom_control",
            "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        );
        put(
            tree.path(),
            "v2/memory.events",
            "low 0\nhigh 0\nmax 41\noom 5\noom_kill 4\noom_group_kill 0\n",
        );
        put(
            tree.path(),
            "old/memory.oom_control",
            "oom_kill_disable 0\nunder_oom 0\n",
        );
        let at = |dir: &str, version| MemCgroup {
            path: tree.path().join(dir),
            version,
        };
        assert_eq!(at("v1", Version::V1).oom_kills().unwrap(), 3);
        assert_eq!(at("v2", Version::V2).oom_kills().unwrap(), 4);
        // Each version reads its own file only.
        assert!(at("v1", Version::V2).oom_kills().is_err());
        assert!(at("old", Version::V1).oom_kills().is_err());
    }
}
