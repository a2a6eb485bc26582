//! What a process spent, from the kernel's own books: context switches
//! (voluntary: it blocked; involuntary: it was preempted) and CPU time.
//! Nothing here is estimated; every figure in a report is a sum of these.

use anyhow::{bail, Context, Result};
use std::ops::{Add, Sub};

/// Context switches and CPU time of one process (all its threads) or of a
/// sum of processes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub voluntary_switches: u64,
    pub involuntary_switches: u64,
    pub cpu_us: u64,
}

impl Usage {
    pub fn context_switches(&self) -> u64 {
        self.voluntary_switches + self.involuntary_switches
    }

    /// The calling process, all threads included (getrusage RUSAGE_SELF).
    pub fn of_self() -> Usage {
        // SAFETY: getrusage fills the struct it is given and nothing else.
        let ru = unsafe {
            let mut ru = std::mem::zeroed::<libc::rusage>();
            libc::getrusage(libc::RUSAGE_SELF, &mut ru);
            ru
        };
        Usage::from_rusage(&ru)
    }

    pub fn from_rusage(ru: &libc::rusage) -> Usage {
        let us = |tv: libc::timeval| tv.tv_sec as u64 * 1_000_000 + tv.tv_usec as u64;
        Usage {
            voluntary_switches: ru.ru_nvcsw as u64,
            involuntary_switches: ru.ru_nivcsw as u64,
            cpu_us: us(ru.ru_utime) + us(ru.ru_stime),
        }
    }

    /// Another running process (the broker). CPU comes from its CPU-time
    /// clock, which has nanosecond resolution where /proc/PID/stat counts
    /// 10 ms ticks; switches are summed over /proc/PID/task/*/status because
    /// /proc/PID/status counts the main thread only.
    pub fn of_process(pid: libc::pid_t) -> Result<Usage> {
        let (voluntary_switches, involuntary_switches) = thread_switches(pid)?;
        Ok(Usage {
            voluntary_switches,
            involuntary_switches,
            cpu_us: process_cpu_us(pid)?,
        })
    }
}

fn process_cpu_us(pid: libc::pid_t) -> Result<u64> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: both calls only write the out-parameter they are given.
    let ts = unsafe {
        let err = libc::clock_getcpuclockid(pid, &mut clock);
        if err != 0 {
            bail!(
                "no CPU clock for process {pid}: {}",
                std::io::Error::from_raw_os_error(err)
            );
        }
        let mut ts = std::mem::zeroed::<libc::timespec>();
        if libc::clock_gettime(clock, &mut ts) != 0 {
            bail!(
                "reading the CPU clock of process {pid}: {}",
                std::io::Error::last_os_error()
            );
        }
        ts
    };
    Ok(ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000)
}

fn thread_switches(pid: libc::pid_t) -> Result<(u64, u64)> {
    let dir = format!("/proc/{pid}/task");
    let mut sums = (0, 0);
    for task in std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))? {
        let status_path = task?.path().join("status");
        // A thread may end between listing and reading: it no longer counts.
        let Ok(status) = std::fs::read_to_string(&status_path) else {
            continue;
        };
        sums.0 += status_field(&status, "voluntary_ctxt_switches:")?;
        sums.1 += status_field(&status, "nonvoluntary_ctxt_switches:")?;
    }
    Ok(sums)
}

fn status_field(status: &str, key: &str) -> Result<u64> {
    let line = status
        .lines()
        .find(|l| l.starts_with(key))
        .with_context(|| format!("no {key} in /proc status"))?;
    line[key.len()..]
        .trim()
        .parse()
        .with_context(|| format!("bad {key} line {line:?}"))
}

impl Add for Usage {
    type Output = Usage;
    fn add(self, o: Usage) -> Usage {
        Usage {
            voluntary_switches: self.voluntary_switches + o.voluntary_switches,
            involuntary_switches: self.involuntary_switches + o.involuntary_switches,
            cpu_us: self.cpu_us + o.cpu_us,
        }
    }
}

impl Sub for Usage {
    type Output = Usage;
    /// What was spent between two snapshots of the same process(es).
    fn sub(self, earlier: Usage) -> Usage {
        Usage {
            voluntary_switches: self
                .voluntary_switches
                .saturating_sub(earlier.voluntary_switches),
            involuntary_switches: self
                .involuntary_switches
                .saturating_sub(earlier.involuntary_switches),
            cpu_us: self.cpu_us.saturating_sub(earlier.cpu_us),
        }
    }
}

impl std::iter::Sum for Usage {
    fn sum<I: Iterator<Item = Usage>>(iter: I) -> Usage {
        iter.fold(Usage::default(), Add::add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU a process is read to have spent through its CPU clock
    /// (how the broker's and the other processes' CPU µs/op are found) is
    /// the time getrusage gives for the same process, in the same unit:
    /// read between two getrusage calls, it lies between them. (A clock
    /// whose nanoseconds were turned into milliseconds, not microseconds,
    /// lost all but the whole seconds: the broker's CPU µs/op came out
    /// far too low, and every ratio to it with them.)
    #[test]
    fn a_process_s_cpu_clock_reads_in_microseconds_as_getrusage_does() {
        // Spend CPU until the sub-second part is at least 10 ms, so that a
        // clock read in the wrong unit cannot match by chance.
        let mut spin = 0u64;
        while Usage::of_self().cpu_us % 1_000_000 < 10_000 {
            for i in 0..10_000u64 {
                spin = std::hint::black_box(spin.wrapping_mul(31).wrapping_add(i));
            }
        }
        let pid = std::process::id() as libc::pid_t;
        let before = Usage::of_self().cpu_us;
        let clock = process_cpu_us(pid).unwrap();
        let after = Usage::of_self().cpu_us;
        // getrusage truncates user and system time to microseconds each.
        assert!(
            before <= clock + 2 && clock <= after + 2,
            "the CPU clock read {clock} µs, getrusage {before} µs before and {after} µs after"
        );
    }
}
