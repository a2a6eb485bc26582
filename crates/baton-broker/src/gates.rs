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
//!
//! The thread also wakes when the kernel says a line was crossed
//! (`crate::triggers`), measures every [`URGENT_SAMPLE`] while memory is
//! short with `--on-memory-pressure pause`, and carries out the pause: it
//! stops and resumes the jobs `crate::jobs` finds, as `baton_core::gates`
//! decides.

use crate::broker::Broker;
use crate::jobs::{self, Job, Snapshot, StoppedJob};
use crate::log;
use crate::mailbox::Mailbox;
use crate::triggers::{Sources, Triggers, Waker};
use baton_core::gates::{JobMemory, PauseAction, Reading};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the machine is measured while a gate is configured.
pub const SAMPLE: Duration = Duration::from_millis(100);

/// How long the thread sleeps with no gate set and no job stopped: until
/// the broker wakes it (a timeout of this length is as good as none).
const UNTIL_WOKEN: Duration = Duration::from_secs(24 * 3600);

/// How often while memory is short with `--on-memory-pressure pause`: a
/// job can take a hundred megabytes in a tenth of a second.
const URGENT_SAMPLE: Duration = Duration::from_millis(10);

/// The span over which memory pressure is also measured from PSI's running
/// total, next to `avg10` (which the kernel updates every 2 s).
const PRESSURE_SPAN: Duration = Duration::from_secs(1);

/// Samples of the run queue averaged (one second's worth).
const RUN_QUEUE_SAMPLES: usize = 10;

/// Where this machine keeps each figure, found once at start.
#[derive(Debug, Default)]
pub struct Probe {
    /// Memory cgroups from the broker's own up to the root, v1 or v2.
    cgroups: Vec<MemoryCgroup>,
    /// The PSI file for memory, if any.
    pressure: Option<PathBuf>,
    /// PSI's running total of stall (µs) at past readings, oldest first.
    stall_totals: VecDeque<(Instant, u64)>,
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
        let pressure = pressure_file(&cgroups, Path::new("/proc/pressure/memory"));
        if need_pressure && pressure.is_none() {
            log::warn(format_args!(
                "no memory pressure figures here (/proc/pressure/memory: PSI needs Linux 4.20 with CONFIG_PSI): \
                 --max-mem-pressure is off, the other gates keep working"
            ));
        }
        Probe {
            cgroups,
            pressure,
            stall_totals: VecDeque::new(),
            run_queue: VecDeque::new(),
        }
    }

    /// One reading of everything the gates look at.
    pub fn read(&mut self) -> Reading {
        Reading {
            mem_available: self.mem_available(),
            mem_pressure: self.mem_pressure(),
            runnable: self.runnable(),
        }
    }

    /// Where the kernel can notify the gates' thread (`crate::triggers`).
    pub fn sources(&self) -> Sources {
        let v1_limits = self.cgroups.iter().filter_map(|c| match c {
            MemoryCgroup::V1(dir) => Some((
                dir.clone(),
                read_number(&dir.join("memory.limit_in_bytes")).filter(|&l| l < NO_LIMIT)?,
            )),
            MemoryCgroup::V2(_) => None,
        });
        Sources {
            pressure: self.pressure.clone(),
            v1_limits: v1_limits.collect(),
        }
    }

    /// PSI `some avg10`, or the share of the last second stalled if that is
    /// higher: `avg10` moves every 2 s and slowly, and a trigger that wakes
    /// us must find the pressure it saw.
    fn mem_pressure(&mut self) -> Option<f64> {
        let text = std::fs::read_to_string(self.pressure.as_deref()?).ok()?;
        let avg10 = psi_some(&text, "avg10=")?;
        let now = Instant::now();
        let recent = psi_some(&text, "total=").and_then(|total| {
            self.stall_totals.push_back((now, total as u64));
            while self.stall_totals.len() > 2
                && now.duration_since(self.stall_totals[1].0) >= PRESSURE_SPAN
            {
                self.stall_totals.pop_front();
            }
            let &(then, before) = self.stall_totals.front()?;
            let span = now.duration_since(then).as_micros() as f64;
            (span > 0.0).then(|| (total as u64).saturating_sub(before) as f64 * 100.0 / span)
        });
        Some(recent.map_or(avg10, |r| r.max(avg10)))
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
            MemoryCgroup::V1(dir) => (
                dir.join("memory.limit_in_bytes"),
                dir.join("memory.usage_in_bytes"),
                dir.join("memory.stat"),
                "total_inactive_file",
            ),
            MemoryCgroup::V2(dir) => (
                dir.join("memory.max"),
                dir.join("memory.current"),
                dir.join("memory.stat"),
                "inactive_file",
            ),
        };
        let limit = read_number(&limit)?;
        if limit >= NO_LIMIT {
            return None;
        }
        let used = read_number(&usage)?.saturating_sub(read_stat(&stat, cache_key).unwrap_or(0));
        Some(limit.saturating_sub(used))
    }
}

/// v1 says "no limit" with a huge number near i64::MAX.
const NO_LIMIT: u64 = 1 << 60;

/// The sampler thread: measures, and hands the broker each reading so it
/// can open or close its gates. Stopped and joined on drop.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    waker: Waker,
    thread: Option<JoinHandle<()>>,
}

impl Sampler {
    /// Starts the thread for `broker`, which it reaches by `mailbox` once
    /// the loop runs; called before the loop takes the broker.
    pub fn spawn(
        broker: &mut Broker,
        mailbox: Mailbox<Broker>,
        mut probe: Probe,
    ) -> std::io::Result<Self> {
        // The first reading before any client is served: gates never
        // decide on no figures.
        let first = probe.read();
        broker.observe(first);
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let mut armed = Triggers::new()?;
        let waker = armed.waker();
        let sources = probe.sources();
        let on_set = waker.clone();
        broker.on_gates_set(move || on_set.wake());
        let thread = std::thread::Builder::new()
            .name("baton-gates".into())
            .spawn(move || {
                run_before_the_jobs();
                let mut pausing = Pausing::default();
                let broker = Loop {
                    mailbox,
                    stop: &stopping,
                };
                while let Some(config) = broker.ask(|b| b.gate_config()) {
                    // Gates can be set while the broker runs (`baton limit`), so
                    // the thread stays, and measures only while one is set:
                    // else it sleeps until one is (the broker wakes it).
                    let mut interval = UNTIL_WOKEN;
                    armed.arm(&config, &sources);
                    if config.any() || !pausing.stopped.is_empty() {
                        let reading = probe.read();
                        let Some(urgent) = broker.ask(move |b| {
                            b.observe(reading);
                            b.gates_urgent()
                        }) else {
                            break;
                        };
                        interval = if urgent { URGENT_SAMPLE } else { SAMPLE };
                        pausing.act(&broker);
                    }
                    armed.wait(interval);
                }
                pausing.resume_all();
            })?;
        Ok(Sampler {
            stop,
            waker,
            thread: Some(thread),
        })
    }
}

/// The gates' thread's way to the broker: errands to the event loop
/// (crate::mailbox), given up when the thread is told to stop.
struct Loop<'a> {
    mailbox: Mailbox<Broker>,
    stop: &'a AtomicBool,
}

impl Loop<'_> {
    fn ask<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Broker) -> T + Send + 'static,
    ) -> Option<T> {
        self.mailbox.ask_unless(self.stop, f)
    }
}

/// Asks the kernel to run this thread before the build's jobs: it sleeps
/// nearly always, and when memory runs out it must act within milliseconds
/// on a machine the jobs keep busy. Allowed with CAP_SYS_NICE (or an
/// RLIMIT_NICE that permits it); elsewhere the thread keeps its priority.
fn run_before_the_jobs() {
    if let Err(e) = crate::sys::set_thread_priority(-10) {
        log::debug(format_args!(
            "gates: the gates' thread keeps its priority ({e})"
        ));
    }
}

/// How far back a job's resident memory is compared to tell whether it
/// still grows: on a busy machine a growing job may not run between two
/// looks 10 ms apart.
const GROWTH_SPAN: Duration = Duration::from_millis(100);

/// What the pause mechanism keeps between readings: the jobs it stopped,
/// and each running job's resident memory at recent looks, oldest first (to
/// see which still grow).
#[derive(Default)]
struct Pausing {
    stopped: Vec<StoppedJob>,
    resident: HashMap<u32, VecDeque<(Instant, u64)>>,
}

impl Pausing {
    /// Carries out the pause policy's word after a reading: stop the jobs
    /// it picks, or let the first started of the stopped jobs go on.
    fn act(&mut self, broker: &Loop) {
        // Urgent covers every stopped job: only the pause stops one, and
        // `--on-memory-pressure` is not changed while the broker runs.
        let Some((pause_on, urgent)) = broker.ask(|b| (b.gate_config().pause, b.gates_urgent()))
        else {
            return;
        };
        if !(pause_on && urgent) {
            // Memory is plentiful: nothing to compare growth with later.
            self.resident.clear();
            return;
        }
        let Some(clients) = broker.ask(|b| b.client_pids()) else {
            return;
        };
        let running = Snapshot::take().running(&clients, &self.stopped);
        let seen: Vec<JobMemory> = running
            .iter()
            .map(|j| JobMemory {
                started: j.start,
                resident: j.resident,
                resident_before: self
                    .resident
                    .get(&j.root)
                    .and_then(|h| h.front())
                    .map(|&(_, r)| r),
            })
            .collect();
        let asked = seen.clone();
        let Some(action) = broker.ask(move |b| b.pause_action(&asked)) else {
            return;
        };
        log::debug(format_args!(
            "gates: jobs running {:?} MiB, {} stopped: {action:?}",
            seen.iter().map(|j| j.resident >> 20).collect::<Vec<_>>(),
            self.stopped.len()
        ));
        self.remember(&running);
        match action {
            PauseAction::Pause(picks) => {
                for i in &picks {
                    self.pause(&running[*i], seen[*i].growing());
                }
                let (paused, shown) = (picks.len() as u32, running.len() as u32);
                broker.ask(move |b| b.did_pause(paused, shown));
            }
            PauseAction::Resume => {
                let Some(job) = self.take_first_started() else {
                    return;
                };
                jobs::resume(&job);
                log::info(format_args!(
                    "memory is back: resumed job pid {} (SIGCONT)",
                    job.root
                ));
                let shown = running.len() as u32;
                broker.ask(move |b| b.did_resume(shown));
            }
            PauseAction::Nothing => {}
        }
    }

    /// The stopped job to go on next: the first started, the furthest
    /// along (the newest are stopped first, and go on last).
    fn take_first_started(&mut self) -> Option<StoppedJob> {
        let first = (0..self.stopped.len()).min_by_key(|&i| self.stopped[i].start)?;
        Some(self.stopped.remove(first))
    }

    /// Keeps each running job's resident memory for [`GROWTH_SPAN`].
    fn remember(&mut self, running: &[Job]) {
        let now = Instant::now();
        let mut history = std::mem::take(&mut self.resident);
        for job in running {
            let mut h = history.remove(&job.root).unwrap_or_default();
            while h.len() > 1 && now.duration_since(h[1].0) >= GROWTH_SPAN {
                h.pop_front();
            }
            h.push_back((now, job.resident));
            self.resident.insert(job.root, h);
        }
    }

    fn pause(&mut self, job: &Job, growing: bool) {
        self.stopped.push(jobs::stop(job));
        let why = if growing { "growing" } else { "the newest" };
        log::info(format_args!("memory nearly gone: paused job pid {} ({} MiB, {why}) with SIGSTOP until another finishes", job.root, job.resident >> 20));
    }

    /// Lets every stopped job go on: nobody would after we are gone.
    fn resume_all(&mut self) {
        self.stopped.drain(..).for_each(|job| jobs::resume(&job));
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.waker.wake();
        if let Some(thread) = self.thread.take() {
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
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            found.extend(
                ancestors(
                    Path::new("/sys/fs/cgroup/memory"),
                    relative,
                    "memory.limit_in_bytes",
                )
                .map(MemoryCgroup::V1),
            );
        } else if controllers.is_empty() {
            for mount in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                found.extend(
                    ancestors(Path::new(mount), relative, "memory.max").map(MemoryCgroup::V2),
                );
            }
        }
    }
    found
}

/// `mount/relative` and each of its parents up to `mount`, where `marker`
/// exists (the controller is there).
fn ancestors<'a>(
    mount: &'a Path,
    relative: &str,
    marker: &'a str,
) -> impl Iterator<Item = PathBuf> + 'a {
    let start = mount.join(relative);
    start
        .ancestors()
        .take_while(move |d| d.starts_with(mount))
        .filter(move |d| d.join(marker).exists())
        .map(Path::to_path_buf)
        .collect::<Vec<_>>()
        .into_iter()
}

/// Where memory pressure is read: the innermost v2 cgroup's
/// `memory.pressure`, else the machine's; neither where it cannot be read
/// (a kernel without PSI has the files but refuses to read them).
fn pressure_file(cgroups: &[MemoryCgroup], machine: &Path) -> Option<PathBuf> {
    cgroups
        .iter()
        .find_map(|c| match c {
            MemoryCgroup::V2(dir) => Some(dir.join("memory.pressure")),
            MemoryCgroup::V1(_) => None,
        })
        .filter(|p| readable(p))
        .or_else(|| Some(machine.to_path_buf()).filter(|p| readable(p)))
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
    let kib = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

fn read_procs_running() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    field(&text, "procs_running", ' ')
}

/// A figure of the `some` line of a PSI file: `avg10=` or `total=`.
fn psi_some(text: &str, key: &str) -> Option<f64> {
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|w| w.strip_prefix(key))?
        .parse()
        .ok()
}

/// The number after `key` and `sep` on the line that starts with `key`.
fn field(text: &str, key: &str, sep: char) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(sep)?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_lines() {
        let text = "some avg10=12.50 avg60=3.00 avg300=0.10 total=123\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=9\n";
        assert_eq!(psi_some(text, "avg10="), Some(12.5));
        assert_eq!(psi_some(text, "total="), Some(123.0));
        assert_eq!(psi_some("full avg10=1.00\n", "avg10="), None);
    }

    #[test]
    fn stat_fields() {
        let text = "cache 5\ntotal_inactive_file 4096\ninactive_file 10\n";
        assert_eq!(field(text, "total_inactive_file", ' '), Some(4096));
        assert_eq!(field(text, "inactive_file", ' '), Some(10));
        assert_eq!(
            field("procs_running 3\nprocs_blocked 0\n", "procs_running", ' '),
            Some(3)
        );
    }

    #[test]
    fn stopped_jobs_go_on_first_started_first() {
        // Three real jobs stopped, in the order the pause policy stops
        // them (newest first): the one started first goes on first.
        use baton_testkit::SpawnGuarded;
        let sleepers: Vec<_> = (0..3)
            .map(|_| {
                std::process::Command::new("sleep")
                    .arg("60")
                    .spawn_guarded()
                    .unwrap()
            })
            .collect();
        let mut pausing = Pausing::default();
        for (sleeper, start) in sleepers.iter().zip([300, 200, 100]) {
            let job = Job {
                root: sleeper.id(),
                start,
                resident: 0,
            };
            pausing.stopped.push(jobs::stop(&job));
        }
        let resumed: Vec<u64> = std::iter::from_fn(|| pausing.take_first_started())
            .map(|job| {
                jobs::resume(&job);
                job.start
            })
            .collect();
        assert_eq!(resumed, [100, 200, 300]);
    }

    #[test]
    fn this_machine_offers_available_memory() {
        // MemAvailable exists on every Linux since 3.14.
        assert!(Probe::new(false)
            .read()
            .mem_available
            .is_some_and(|m| m > 0));
    }

    /// A directory of this test's own, removed with everything in it when
    /// the test ends.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            use std::sync::atomic::AtomicU32;
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "baton-gates-test-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir(&dir).unwrap();
            TempDir(dir)
        }

        fn write(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_v2_cgroup_has_its_limit_less_what_it_uses_but_inactive_file_cache() {
        let tmp = TempDir::new();
        tmp.write("memory.max", "1073741824\n");
        tmp.write("memory.current", "536870912\n");
        tmp.write("memory.stat", "anon 5\ninactive_file 4096\nactive_file 7\n");
        let cgroup = MemoryCgroup::V2(tmp.0.clone());
        assert_eq!(cgroup.available(), Some((1 << 30) - (1 << 29) + 4096));
        tmp.write("memory.max", "max\n");
        assert_eq!(cgroup.available(), None, "no limit");
    }

    #[test]
    fn a_v1_cgroup_without_a_limit_offers_no_figure() {
        let tmp = TempDir::new();
        tmp.write("memory.limit_in_bytes", "9223372036854771712\n");
        tmp.write("memory.usage_in_bytes", "1000\n");
        tmp.write("memory.stat", "total_inactive_file 100\n");
        let cgroup = MemoryCgroup::V1(tmp.0.clone());
        assert_eq!(cgroup.available(), None);
        tmp.write("memory.limit_in_bytes", "5000\n");
        assert_eq!(cgroup.available(), Some(5000 - 900));
        let probe = Probe {
            cgroups: vec![MemoryCgroup::V1(tmp.0.clone())],
            ..Probe::default()
        };
        assert_eq!(probe.sources().v1_limits, [(tmp.0.clone(), 5000)]);
        tmp.write("memory.limit_in_bytes", "9223372036854771712\n");
        assert!(
            probe.sources().v1_limits.is_empty(),
            "no limit, no threshold"
        );
        // The bound itself is "no limit" to both: no figure, no threshold.
        tmp.write("memory.limit_in_bytes", &format!("{NO_LIMIT}\n"));
        assert_eq!(cgroup.available(), None);
        assert!(probe.sources().v1_limits.is_empty(), "{NO_LIMIT}");
    }

    #[test]
    fn pressure_is_read_from_the_first_readable_of_the_cgroup_and_the_machine() {
        let tmp = TempDir::new();
        let (v1, v2) = (tmp.0.join("v1"), tmp.0.join("v2"));
        let machine = tmp.write("machine.pressure", "some avg10=0.00\n");
        let cgroups = [MemoryCgroup::V1(v1.clone()), MemoryCgroup::V2(v2.clone())];
        assert_eq!(
            pressure_file(&cgroups, &machine),
            Some(machine.clone()),
            "the cgroup's file is missing"
        );
        let own = tmp.write("v2/memory.pressure", "some avg10=0.00\n");
        assert_eq!(pressure_file(&cgroups, &machine), Some(own));
        assert_eq!(
            pressure_file(&cgroups[..1], &tmp.0.join("none")),
            None,
            "v1 has none, nor has the machine"
        );
    }

    #[test]
    fn cgroup_ancestors_are_the_dirs_up_to_the_mount_that_have_the_marker() {
        let tmp = TempDir::new();
        tmp.write("a/b/memory.max", "max");
        tmp.write("memory.max", "max");
        std::fs::create_dir_all(tmp.0.join("a/b/c")).unwrap();
        let found: Vec<PathBuf> = ancestors(&tmp.0, "a/b/c", "memory.max").collect();
        assert_eq!(found, [tmp.0.join("a/b"), tmp.0.clone()]);
    }

    #[test]
    fn memory_pressure_is_the_share_of_the_last_second_stalled_if_above_avg10() {
        let tmp = TempDir::new();
        let file = tmp.write(
            "memory.pressure",
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=3000000\n",
        );
        let now = Instant::now();
        let ago = |s| now.checked_sub(Duration::from_secs(s)).unwrap();
        let mut probe = Probe {
            pressure: Some(file),
            ..Probe::default()
        };
        // 1 s stalled over the last 2 s: the reading 3 s ago is too old.
        probe
            .stall_totals
            .extend([(ago(3), 0), (ago(2), 2_000_000)]);
        let pct = probe.mem_pressure().unwrap();
        assert!(pct > 40.0 && pct <= 50.0, "{pct}");
        assert_eq!(probe.stall_totals.len(), 2);

        tmp.write(
            "memory.pressure",
            "some avg10=12.50 avg60=0.00 avg300=0.00 total=3000000\n",
        );
        assert!(probe.mem_pressure().unwrap() >= 12.5);
    }

    #[test]
    fn the_run_queue_is_averaged_over_the_last_samples() {
        let mut probe = Probe::default();
        probe.run_queue.extend([4.0; RUN_QUEUE_SAMPLES]);
        let avg = probe.runnable().unwrap();
        assert_eq!(probe.run_queue.len(), RUN_QUEUE_SAMPLES);
        let now = probe.run_queue.back().copied().unwrap();
        assert_eq!(
            avg,
            (4.0 * (RUN_QUEUE_SAMPLES - 1) as f64 + now) / RUN_QUEUE_SAMPLES as f64
        );
    }

    #[test]
    fn available_memory_is_read_in_bytes() {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
        let total_kib: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .unwrap()
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .unwrap();
        let available = read_meminfo_available().unwrap();
        assert_eq!(available % 1024, 0);
        assert!(available <= total_kib * 1024);
        assert!(available > total_kib, "bytes, not KiB");
    }

    #[test]
    fn the_gates_thread_is_never_made_nicer_than_it_was() {
        std::thread::spawn(|| {
            let prio = crate::sys::thread_priority;
            let before = prio();
            run_before_the_jobs();
            assert!(prio() <= before, "{} > {before}", prio());
        })
        .join()
        .unwrap();
    }

    /// Where it may (root here), the gates' thread runs at nice -10,
    /// before the jobs it must stop when memory runs out.
    #[test]
    fn the_gates_thread_runs_at_nice_minus_10_where_it_may() {
        if !nix::unistd::getuid().is_root() {
            return baton_testkit::skip(
                baton_testkit::Missing::Root,
                "a nice value below 0 needs CAP_SYS_NICE",
            );
        }
        std::thread::spawn(|| {
            run_before_the_jobs();
            assert_eq!(crate::sys::thread_priority(), -10);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_jobs_resident_memory_is_kept_for_the_growth_span() {
        let job = |resident| Job {
            root: 7,
            start: 1,
            resident,
        };
        let mut pausing = Pausing::default();
        pausing.remember(&[job(100)]);
        pausing.remember(&[job(200)]);
        let seen = |p: &Pausing| p.resident[&7].iter().map(|&(_, r)| r).collect::<Vec<_>>();
        assert_eq!(seen(&pausing), [100, 200]);
        let old = Instant::now().checked_sub(GROWTH_SPAN * 3).unwrap();
        let older = Instant::now().checked_sub(GROWTH_SPAN * 2).unwrap();
        pausing
            .resident
            .insert(7, VecDeque::from([(old, 1), (older, 2)]));
        pausing.remember(&[job(3)]);
        assert_eq!(seen(&pausing), [2, 3]);
        pausing.remember(&[]);
        assert!(pausing.resident.is_empty(), "a job gone is forgotten");
    }
}
