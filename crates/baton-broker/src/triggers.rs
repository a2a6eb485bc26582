//! Kernel notifications that wake the gates' thread the moment a figure
//! crosses a line, instead of at its next timer tick:
//!
//! - a PSI trigger on the memory pressure file (`/proc/pressure/memory` or
//!   the cgroup's `memory.pressure`): the kernel says when tasks stalled on
//!   memory for more than `--max-mem-pressure` percent of a window
//!   (docs: kernel.org, Documentation/accounting/psi.rst, "Monitoring for
//!   pressure thresholds"). A window of 1 s needs CAP_SYS_RESOURCE; without
//!   it the kernel takes only multiples of 2 s, checked every 2 s;
//! - cgroup v1 memory thresholds (`cgroup.event_control` with an eventfd on
//!   `memory.usage_in_bytes`): the kernel says when a memory-limited cgroup's
//!   usage crosses a level, within a few pages of the crossing (docs:
//!   kernel.org, Documentation/admin-guide/cgroup-v1/memory.rst, "Memory
//!   thresholds"). Levels: where the memory gate closes, and where
//!   `--on-memory-pressure pause` stops a job.
//!
//! cgroup v2 has no usage thresholds; there, and where none of this is
//! offered, the timer alone measures.

use crate::log;
use baton_core::gates::GateConfig;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The notifications armed for one gate configuration, and a way to wake
/// the thread that waits on them.
pub struct Triggers {
    stop: Arc<EventFd>,
    psi: Option<File>,
    thresholds: Vec<Threshold>,
    armed_for: Option<GateConfig>,
}

/// Wakes the thread waiting on its [`Triggers`].
#[derive(Clone)]
pub struct Waker(Arc<EventFd>);

impl Waker {
    pub fn wake(&self) {
        let _ = self.0.write(1);
    }
}

/// One registered usage level: the kernel signals `event` on a crossing
/// while `_usage` stays open.
struct Threshold {
    event: EventFd,
    _usage: File,
}

/// Where the machine offers notifications.
pub struct Sources {
    /// The PSI file for memory, if any.
    pub pressure: Option<PathBuf>,
    /// Memory-limited cgroup v1 directories, with their limits.
    pub v1_limits: Vec<(PathBuf, u64)>,
}

impl Triggers {
    pub fn new() -> std::io::Result<Self> {
        let stop = Arc::new(EventFd::from_value_and_flags(
            0,
            EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK,
        )?);
        Ok(Triggers {
            stop,
            psi: None,
            thresholds: Vec::new(),
            armed_for: None,
        })
    }

    /// What wakes [`Triggers::wait`] at once from another thread.
    pub fn waker(&self) -> Waker {
        Waker(self.stop.clone())
    }

    /// Arms what `config` needs, unless armed for it already.
    pub fn arm(&mut self, config: &GateConfig, sources: &Sources) {
        if self.armed_for.as_ref() == Some(config) {
            return;
        }
        self.armed_for = Some(*config);
        self.psi = match (config.max_mem_pressure, &sources.pressure) {
            (Some(pct), Some(file)) => psi_trigger(file, pct),
            _ => None,
        };
        self.thresholds = match config.min_mem_available {
            Some(min) => sources
                .v1_limits
                .iter()
                .flat_map(|(dir, limit)| {
                    levels(min, config.pause)
                        .into_iter()
                        .filter_map(move |room| register_threshold(dir, limit.checked_sub(room)?))
                })
                .collect(),
            None => Vec::new(),
        };
        log::debug(format_args!(
            "gates: {} PSI trigger, {} memory thresholds armed",
            u8::from(self.psi.is_some()),
            self.thresholds.len()
        ));
    }

    /// Waits up to `timeout` for a notification, or to be woken.
    pub fn wait(&self, timeout: Duration) {
        let mut fds = vec![PollFd::new(self.stop.as_fd(), PollFlags::POLLIN)];
        fds.extend(
            self.psi
                .iter()
                .map(|f| PollFd::new(f.as_fd(), PollFlags::POLLPRI)),
        );
        fds.extend(
            self.thresholds
                .iter()
                .map(|t| PollFd::new(t.event.as_fd(), PollFlags::POLLIN)),
        );
        let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        if !matches!(poll(&mut fds, timeout), Ok(n) if n > 0) {
            return;
        }
        let fired = |i: usize| fds[i].revents().is_some_and(|r| !r.is_empty());
        if self.psi.is_some() && fired(1) {
            log::debug(format_args!("gates: woken by the memory pressure trigger"));
        }
        let first_threshold = 1 + usize::from(self.psi.is_some());
        if (first_threshold..fds.len()).any(fired) {
            log::debug(format_args!("gates: woken by a memory threshold"));
        }
        drop(fds);
        // Drained so that the next wait sleeps until the next crossing.
        let _ = self.stop.read();
        for t in &self.thresholds {
            let _ = t.event.read();
        }
    }
}

/// Free memory at which to be woken, for a memory gate of `min`: where it
/// closes (and jobs that grow are stopped) and, when pausing, each further
/// eighth of `min` below (see `Gates::pause_action`).
fn levels(min: u64, pause: bool) -> Vec<u64> {
    let below = if pause { 1..8 } else { 0..0 };
    std::iter::once(min)
        .chain(below.rev().map(|eighths| min / 8 * eighths))
        .collect()
}

fn register_threshold(dir: &Path, usage_bytes: u64) -> Option<Threshold> {
    let event =
        EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK).ok()?;
    let usage = File::open(dir.join("memory.usage_in_bytes")).ok()?;
    let line = format!("{} {} {usage_bytes}", event.as_raw_fd(), usage.as_raw_fd());
    match std::fs::write(dir.join("cgroup.event_control"), line) {
        Ok(()) => Some(Threshold {
            event,
            _usage: usage,
        }),
        Err(e) => {
            log::debug(format_args!(
                "gates: no memory threshold on {}: {e}",
                dir.display()
            ));
            None
        }
    }
}

/// A PSI trigger for `pct` percent of stall: in a 1 s window where the
/// kernel allows it, else 2 s; None (said once) where it has none.
fn psi_trigger(file: &Path, pct: f64) -> Option<File> {
    let attempt = |window_us: u64| -> std::io::Result<File> {
        let stall_us = ((pct / 100.0 * window_us as f64) as u64).clamp(1, window_us);
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(file)?;
        // The kernel reads the trigger as a C string.
        f.write_all(format!("some {stall_us} {window_us}\0").as_bytes())?;
        Ok(f)
    };
    match attempt(1_000_000).or_else(|_| attempt(2_000_000)) {
        Ok(f) => Some(f),
        Err(e) => {
            log::info(format_args!(
                "no PSI trigger on {} ({e}): memory pressure is measured every 100 ms",
                file.display()
            ));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_for_the_gate_and_the_pause() {
        assert_eq!(levels(800, false), [800]);
        assert_eq!(levels(800, true), [800, 700, 600, 500, 400, 300, 200, 100]);
    }

    /// A directory of this test's own, removed when the test ends.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(what: &str) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("baton-triggers-test-{what}-{}", std::process::id()));
            std::fs::create_dir(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_wake_is_seen_by_wait_and_drained_by_it() {
        let triggers = Triggers::new().unwrap();
        triggers.waker().wake();
        assert_eq!(triggers.stop.read().unwrap(), 1);
        triggers.waker().wake();
        triggers.wait(Duration::ZERO);
        assert!(triggers.stop.read().is_err(), "drained by the wait");
    }

    #[test]
    fn a_pressure_gate_arms_a_psi_trigger_in_a_one_second_window() {
        let tmp = TempDir::new("psi");
        let file = tmp.0.join("memory.pressure");
        std::fs::write(&file, "").unwrap();
        let sources = Sources {
            pressure: Some(file.clone()),
            v1_limits: Vec::new(),
        };
        let mut triggers = Triggers::new().unwrap();
        triggers.arm(&GateConfig::default(), &sources);
        assert!(triggers.psi.is_none(), "no pressure gate");
        let config = GateConfig {
            max_mem_pressure: Some(10.0),
            ..GateConfig::default()
        };
        triggers.arm(&config, &sources);
        assert!(triggers.psi.is_some());
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "some 100000 1000000\0",
            "10% of 1 s"
        );
    }

    #[test]
    fn a_memory_threshold_is_registered_with_a_non_blocking_eventfd() {
        use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
        let tmp = TempDir::new("v1");
        std::fs::write(tmp.0.join("memory.usage_in_bytes"), "0\n").unwrap();
        std::fs::write(tmp.0.join("cgroup.event_control"), "").unwrap();
        let t = register_threshold(&tmp.0, 12345).unwrap();
        let line = std::fs::read_to_string(tmp.0.join("cgroup.event_control")).unwrap();
        assert_eq!(
            line,
            format!("{} {} 12345", t.event.as_raw_fd(), t._usage.as_raw_fd())
        );
        let fl = OFlag::from_bits_truncate(fcntl(&t.event, FcntlArg::F_GETFL).unwrap());
        assert!(fl.contains(OFlag::O_NONBLOCK));
        let fd = FdFlag::from_bits_truncate(fcntl(&t.event, FcntlArg::F_GETFD).unwrap());
        assert!(fd.contains(FdFlag::FD_CLOEXEC));
    }
}
