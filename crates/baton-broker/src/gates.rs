//! Measuring the machine for the gates (`baton_core::gates` decides).
//!
//! A thread reads, every [`SAMPLE`], what the configured gates need:
//!
//! - available memory: the lower of `MemAvailable` and, for each memory
//!   cgroup the broker sits in that has a limit (v1 `memory.limit_in_bytes`,
//!   v2 `memory.max`), that limit less what the cgroup uses, not counting
//!   file cache it could drop (the OOM killer does not count it either);
//! - memory pressure: PSI `some avg10`, the cgroup's own `memory.pressure`
//!   where cgroup v2 offers it, else `/proc/pressure/memory`;
//! - the run queue: runnable tasks (`procs_running` in `/proc/stat`, less
//!   this thread), averaged over the last second so that one busy moment
//!   does not close the gate.
//!
//! A figure the machine does not offer (no PSI before Linux 4.20) leaves its
//! gate open, said once in the log.

use crate::broker::Broker;
use crate::log;
use baton_core::gates::Reading;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the machine is measured while a gate is configured.
pub const SAMPLE: Duration = Duration::from_millis(100);

/// Samples of the run queue averaged (one second's worth).
const RUN_QUEUE_SAMPLES: usize = 10;

/// Where this machine keeps each figure, found once at start.
#[derive(Debug, Default)]
pub struct Probe {
    /// Memory cgroups from the broker's own up to the root, v1 or v2.
    cgroups: Vec<MemoryCgroup>,
    /// The PSI file for memory, if any.
    pressure: Option<PathBuf>,
    run_queue: VecDeque<f64>,
}

#[derive(Debug)]
enum MemoryCgroup {
    V1(PathBuf),
    V2(PathBuf),
}

impl Probe {
    /// Finds the files to read; says once what is missing for a gate that
    /// needs it.
    pub fn new(need_pressure: bool) -> Self {
        let cgroups = own_memory_cgroups();
        let pressure = cgroups
            .iter()
            .find_map(|c| match c {
                MemoryCgroup::V2(dir) => Some(dir.join("memory.pressure")),
                MemoryCgroup::V1(_) => None,
            })
            .filter(|p| readable(p))
            .or_else(|| Some(PathBuf::from("/proc/pressure/memory")).filter(|p| readable(p)));
        if need_pressure && pressure.is_none() {
            log::warn(format_args!(
                "no memory pressure figures here (/proc/pressure/memory: PSI needs Linux 4.20 with CONFIG_PSI): \
                 --max-mem-pressure is off, the other gates keep working"
            ));
        }
        Probe { cgroups, pressure, run_queue: VecDeque::new() }
    }

    /// One reading of everything the gates look at.
    pub fn read(&mut self) -> Reading {
        Reading { mem_available: self.mem_available(), mem_pressure: self.pressure.as_deref().and_then(read_psi_some_avg10), runnable: self.runnable() }
    }

    fn mem_available(&self) -> Option<u64> {
        let machine = read_meminfo_available();
        let cgroups = self.cgroups.iter().filter_map(MemoryCgroup::available);
        machine.into_iter().chain(cgroups).min()
    }

    fn runnable(&mut self) -> Option<f64> {
        let now = read_procs_running()?.saturating_sub(1) as f64;
        if self.run_queue.len() == RUN_QUEUE_SAMPLES {
            self.run_queue.pop_front();
        }
        self.run_queue.push_back(now);
        Some(self.run_queue.iter().sum::<f64>() / self.run_queue.len() as f64)
    }
}

impl MemoryCgroup {
    /// The cgroup's limit less what it uses, or None if it has no limit.
    fn available(&self) -> Option<u64> {
        let (limit, usage, stat, cache_key) = match self {
            MemoryCgroup::V1(dir) => (dir.join("memory.limit_in_bytes"), dir.join("memory.usage_in_bytes"), dir.join("memory.stat"), "total_inactive_file"),
            MemoryCgroup::V2(dir) => (dir.join("memory.max"), dir.join("memory.current"), dir.join("memory.stat"), "inactive_file"),
        };
        let limit = read_number(&limit)?;
        // v1 says "no limit" with a huge number near i64::MAX.
        if limit >= 1 << 60 {
            return None;
        }
        let used = read_number(&usage)?.saturating_sub(read_stat(&stat, cache_key).unwrap_or(0));
        Some(limit.saturating_sub(used))
    }
}

/// The sampler thread: measures, and hands the broker each reading so it
/// can open or close its gates. Stopped and joined on drop.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Sampler {
    pub fn spawn(broker: Arc<Mutex<Broker>>, mut probe: Probe) -> std::io::Result<Self> {
        // The first reading before any client is served: gates never
        // decide on no figures.
        let first = probe.read();
        broker.lock().expect("broker lock").observe(first);
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new().name("baton-gates".into()).spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                // Gates can be set while the broker runs (`baton limit`), so
                // the thread stays, and measures only while one is set.
                if broker.lock().expect("broker lock").gate_config().any() {
                    let reading = probe.read();
                    broker.lock().expect("broker lock").observe(reading);
                }
                std::thread::park_timeout(SAMPLE);
            }
        })?;
        Ok(Sampler { stop, thread: Some(thread) })
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

/// The memory cgroups this process is in, innermost first, with every
/// ancestor (a limit may be set on any of them).
fn own_memory_cgroups() -> Vec<MemoryCgroup> {
    let text = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut found = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let relative = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            found.extend(ancestors(Path::new("/sys/fs/cgroup/memory"), relative, "memory.limit_in_bytes").map(MemoryCgroup::V1));
        } else if controllers.is_empty() {
            for mount in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                found.extend(ancestors(Path::new(mount), relative, "memory.max").map(MemoryCgroup::V2));
            }
        }
    }
    found
}

/// `mount/relative` and each of its parents up to `mount`, where `marker`
/// exists (the controller is there).
fn ancestors<'a>(mount: &'a Path, relative: &str, marker: &'a str) -> impl Iterator<Item = PathBuf> + 'a {
    let start = mount.join(relative);
    start.ancestors().take_while(move |d| d.starts_with(mount)).filter(move |d| d.join(marker).exists()).map(Path::to_path_buf).collect::<Vec<_>>().into_iter()
}

fn readable(path: &Path) -> bool {
    std::fs::read_to_string(path).is_ok()
}

fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn read_stat(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    field(&text, key, ' ')
}

fn read_meminfo_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = text.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().trim_end_matches("kB").trim().parse::<u64>().ok()?;
    Some(kib * 1024)
}

fn read_procs_running() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    field(&text, "procs_running", ' ')
}

/// `some avg10=` from a PSI file.
fn read_psi_some_avg10(path: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    psi_some_avg10(&text)
}

fn psi_some_avg10(text: &str) -> Option<f64> {
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace().find_map(|w| w.strip_prefix("avg10="))?.parse().ok()
}

/// The number after `key` and `sep` on the line that starts with `key`.
fn field(text: &str, key: &str, sep: char) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(sep)?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_lines() {
        let text = "some avg10=12.50 avg60=3.00 avg300=0.10 total=123\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=9\n";
        assert_eq!(psi_some_avg10(text), Some(12.5));
        assert_eq!(psi_some_avg10("full avg10=1.00\n"), None);
    }

    #[test]
    fn stat_fields() {
        let text = "cache 5\ntotal_inactive_file 4096\ninactive_file 10\n";
        assert_eq!(field(text, "total_inactive_file", ' '), Some(4096));
        assert_eq!(field(text, "inactive_file", ' '), Some(10));
        assert_eq!(field("procs_running 3\nprocs_blocked 0\n", "procs_running", ' '), Some(3));
    }

    #[test]
    fn this_machine_offers_available_memory() {
        // MemAvailable exists on every Linux since 3.14.
        assert!(Probe::new(false).read().mem_available.is_some_and(|m| m > 0));
    }
}
