//! A cgroup v1 memory cgroup of our own with a limit, for the memory
//! gate's benchmark and its tests (which use it from here): removed on
//! drop, after its processes are killed and gone.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The cgroup; see [`MemCgroup::new`].
pub struct MemCgroup {
    path: PathBuf,
}

impl MemCgroup {
    /// `baton-NAME-PID` under the memory controller, limited to `limit`
    /// bytes without swap (a job over the limit is killed, not slowed).
    ///
    /// # Errors
    /// No cgroup v1 memory controller here, or not root.
    pub fn new(name: &str, limit: u64) -> Result<Self> {
        let root = Path::new("/sys/fs/cgroup/memory");
        if !root.join("memory.limit_in_bytes").exists() {
            bail!("no cgroup v1 memory controller at {}", root.display());
        }
        let path = root.join(format!("baton-{name}-{}", std::process::id()));
        std::fs::create_dir(&path)
            .with_context(|| format!("creating {} (run as root)", path.display()))?;
        let cgroup = MemCgroup { path };
        std::fs::write(cgroup.path.join("memory.limit_in_bytes"), limit.to_string())
            .context("setting the cgroup's memory limit")?;
        let _ = std::fs::write(cgroup.path.join("memory.swappiness"), "0");
        Ok(cgroup)
    }

    /// Processes the OOM killer has killed in this cgroup.
    ///
    /// # Errors
    /// The kernel does not count them (before Linux 4.13).
    pub fn oom_kills(&self) -> Result<u64> {
        let text = std::fs::read_to_string(self.path.join("memory.oom_control"))?;
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .context("no oom_kill in memory.oom_control (Linux 4.13 or later)")
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
