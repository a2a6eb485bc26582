//! A team of forked child processes that run one measurement together.
//!
//! Each child sets itself up (opens its mechanism, connects to the broker),
//! reports ready and waits at a gate; the gate opens for all at once and each
//! child measures itself (getrusage RUSAGE_SELF, every thread) from then until
//! its work is done, writing the figures into memory shared with the parent.
//! So set-up, fork and exit are not counted, and every process's own switches
//! are. The broker, when there is one, is measured by the parent around the
//! same window from /proc.
//!
//! Children are forked, not exec'ed: the mechanisms (pipes, semaphores in
//! shared memory, futex words) are inherited exactly as the published test
//! programs inherit theirs. fork is only sound from a single-threaded
//! process, which [`run`] checks.

use crate::measure::Usage;
use crate::sys::{self, SharedMemory};
use anyhow::{bail, Context, Result};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How long a team may run before it is killed as hung (a mechanism bug, or a
/// broker that stopped answering). Far above any default scale.
const TEAM_DEADLINE: Duration = Duration::from_secs(300);

/// What one child did in its measured window.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    /// Operations: acquisitions, transfers or wake-ups, per scenario.
    pub ops: u64,
    /// Times a waiter returned from waiting, where the scenario counts them.
    pub wakeups: u64,
}

/// What the whole team did.
#[derive(Debug)]
pub struct Outcome {
    /// Children plus broker.
    pub usage: Usage,
    /// The broker alone (zero when there is none).
    pub broker: Usage,
    pub per_child: Vec<Counts>,
    pub wall: Duration,
}

impl Outcome {
    pub fn ops(&self) -> u64 {
        self.per_child.iter().map(|c| c.ops).sum()
    }

    pub fn wakeups(&self) -> u64 {
        self.per_child.iter().map(|c| c.wakeups).sum()
    }
}

/// A child's way to say "set up; measure me from now on".
pub struct Start<'a> {
    ready: RawFd,
    gate: RawFd,
    slot: &'a Slot,
    finished: bool,
}

impl Start<'_> {
    /// Reports ready and waits until every child is.
    pub fn gate(&mut self) -> Result<()> {
        sys::write_all(self.ready, b"r").context("reporting ready")?;
        // The parent never writes: the gate opens when it closes its end.
        sys::read(self.gate, &mut [0]).context("waiting at the gate")?;
        Ok(())
    }

    /// Starts this child's measured window.
    pub fn measure(&mut self) {
        self.slot.record_start(Usage::of_self());
    }

    /// Ends this child's measured window before its body returns, so that
    /// stopping threads still blocked in a wait is not counted.
    pub fn finish(&mut self, counts: Counts) {
        self.slot.record_end(Usage::of_self(), counts);
        self.finished = true;
    }

    /// [`Start::gate`] then [`Start::measure`]: the usual case.
    pub fn now(&mut self) -> Result<()> {
        self.gate()?;
        self.measure();
        Ok(())
    }
}

/// Runs `body(index, start)` in each of `members` forked children and sums
/// what they spent; `broker`, if given, is measured over the same window.
pub fn run<F>(members: usize, broker: Option<libc::pid_t>, body: F) -> Result<Outcome>
where
    F: Fn(usize, &mut Start) -> Result<Counts>,
{
    ensure_single_threaded()?;
    let slots = SharedMemory::<Slot>::new(members)?;
    let (ready_r, ready_w) = sys::pipe()?;
    let (gate_r, gate_w) = sys::pipe()?;
    let mut children = Children::default();
    for index in 0..members {
        let pid = fork_child(|| {
            // The gate opens when every write end is closed: a child must not
            // keep its inherited copy.
            // SAFETY: closing this process's copy; the parent keeps its own.
            unsafe { libc::close(gate_w.as_raw_fd()) };
            let start = Start {
                ready: ready_w.as_raw_fd(),
                gate: gate_r.as_raw_fd(),
                slot: &slots[index],
                finished: false,
            };
            child_main(index, start, &body)
        })
        .inspect_err(|_| children.kill_all())?;
        children.pids.push(pid);
    }
    drop((ready_w, gate_r));
    let result = measure_window(&mut children, members, ready_r, gate_w, broker);
    if result.is_err() {
        children.kill_all();
    }
    let broker = result?;
    let children_usage: Usage = slots.iter().map(Slot::usage).sum();
    Ok(Outcome {
        usage: children_usage + broker,
        broker,
        per_child: slots.iter().map(Slot::counts).collect(),
        wall: measured_wall(&slots),
    })
}

/// Waits for every child to be ready, opens the gate, waits for every child
/// to finish; returns the broker's usage over that window.
fn measure_window(
    children: &mut Children,
    members: usize,
    ready: OwnedFd,
    gate: OwnedFd,
    broker: Option<libc::pid_t>,
) -> Result<Usage> {
    let deadline = Instant::now() + TEAM_DEADLINE;
    wait_ready(children, members, &ready, deadline)?;
    let broker_before = broker.map(Usage::of_process).transpose()?;
    drop(gate);
    children.wait_all(deadline)?;
    Ok(match (broker, broker_before) {
        (Some(pid), Some(before)) => Usage::of_process(pid)? - before,
        _ => Usage::default(),
    })
}

fn wait_ready(
    children: &mut Children,
    members: usize,
    ready: &OwnedFd,
    deadline: Instant,
) -> Result<()> {
    let mut seen = 0;
    while seen < members {
        if sys::poll_readable(ready.as_raw_fd(), 100)? {
            seen += sys::read(ready.as_raw_fd(), &mut [0; 64])?;
        } else {
            children.fail_on_early_exit()?;
            if Instant::now() > deadline {
                bail!(
                    "only {seen} of {members} benchmark processes got ready in {TEAM_DEADLINE:?}"
                );
            }
        }
    }
    Ok(())
}

/// The child's side: run the body, record the window, exit without running
/// the parent's destructors or flushing its buffers a second time.
fn child_main<F>(index: usize, mut start: Start, body: &F) -> !
where
    F: Fn(usize, &mut Start) -> Result<Counts>,
{
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(index, &mut start)));
    let code = match outcome {
        Ok(Ok(counts)) => {
            if !start.finished {
                start.finish(counts);
            }
            0
        }
        Ok(Err(e)) => {
            eprintln!("baton bench: benchmark process {index}: {e:#}");
            1
        }
        Err(_) => 101,
    };
    // SAFETY: _exit ends this process at once, which is all we want here.
    unsafe { libc::_exit(code) }
}

fn fork_child(child: impl FnOnce() -> Result<std::convert::Infallible>) -> Result<libc::pid_t> {
    use std::io::Write;
    // Buffered output would otherwise be written once by each child too.
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: the process is single-threaded (checked by run), so the child
    // inherits no lock held by another thread.
    let parent = std::process::id() as libc::pid_t;
    let pid = sys::check(unsafe { libc::fork() }).context("fork")?;
    if pid == 0 {
        // A child blocked on a token must not outlive an interrupted bench.
        // SAFETY: prctl and getppid only affect this process.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != parent {
                libc::_exit(1);
            }
        }
        let Err(e) = child();
        eprintln!("baton bench: benchmark process set-up: {e:#}");
        // SAFETY: as in child_main.
        unsafe { libc::_exit(1) }
    }
    Ok(pid)
}

fn ensure_single_threaded() -> Result<()> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .map(str::trim);
    if threads != Some("1") {
        bail!("baton bench forks its benchmark processes, which is only safe from a single-threaded process (this one has {} threads)", threads.unwrap_or("?"));
    }
    Ok(())
}

#[derive(Default)]
struct Children {
    pids: Vec<libc::pid_t>,
}

impl Children {
    /// Reaps every child; fails if one failed or the deadline passes.
    fn wait_all(&mut self, deadline: Instant) -> Result<()> {
        while !self.pids.is_empty() {
            if !self.reap_one(true)? {
                if Instant::now() > deadline {
                    bail!(
                        "{} benchmark processes still running after {TEAM_DEADLINE:?}: killed",
                        self.pids.len()
                    );
                }
                // Polling keeps the parent's own wake-ups rare and out of the
                // children's figures; blocking in waitpid would need a timer.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        Ok(())
    }

    /// Fails if any child has already exited (it could only have failed).
    fn fail_on_early_exit(&mut self) -> Result<()> {
        self.reap_one(false).map(drop)
    }

    /// Reaps one exited child if there is one; an error if it failed, or if
    /// `expected` is false (nobody should have exited yet).
    fn reap_one(&mut self, expected: bool) -> Result<bool> {
        let mut status = 0;
        // SAFETY: waitpid writes the status it is given.
        let pid = sys::retry(|| unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) })?;
        if pid == 0 {
            return Ok(false);
        }
        if !self.pids.contains(&pid) {
            bail!(
                "process {pid} (the broker) {} during the measurement",
                describe_exit(status)
            );
        }
        self.pids.retain(|&p| p != pid);
        let clean = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        if !clean || !expected {
            bail!("benchmark process {pid} {}", describe_exit(status));
        }
        Ok(true)
    }

    fn kill_all(&mut self) {
        for &pid in &self.pids {
            // SAFETY: these are our own children, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for pid in self.pids.drain(..) {
            // SAFETY: reaping our own child.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        }
    }
}

fn describe_exit(status: libc::c_int) -> String {
    if libc::WIFSIGNALED(status) {
        format!("was killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("exited with status {}", libc::WEXITSTATUS(status))
    }
}

/// One child's figures, written by the child, read by the parent after the
/// child has been reaped.
#[derive(Default)]
struct Slot {
    voluntary: AtomicU64,
    involuntary: AtomicU64,
    cpu_us: AtomicU64,
    ops: AtomicU64,
    wakeups: AtomicU64,
    start_ns: AtomicU64,
    end_ns: AtomicU64,
}

impl Slot {
    fn record_start(&self, at: Usage) {
        self.voluntary.store(at.voluntary_switches, Relaxed);
        self.involuntary.store(at.involuntary_switches, Relaxed);
        self.cpu_us.store(at.cpu_us, Relaxed);
        self.start_ns.store(monotonic_ns(), Relaxed);
    }

    fn record_end(&self, at: Usage, counts: Counts) {
        let spent = at - self.usage();
        self.voluntary.store(spent.voluntary_switches, Relaxed);
        self.involuntary.store(spent.involuntary_switches, Relaxed);
        self.cpu_us.store(spent.cpu_us, Relaxed);
        self.ops.store(counts.ops, Relaxed);
        self.wakeups.store(counts.wakeups, Relaxed);
        self.end_ns.store(monotonic_ns(), Relaxed);
    }

    fn usage(&self) -> Usage {
        Usage {
            voluntary_switches: self.voluntary.load(Relaxed),
            involuntary_switches: self.involuntary.load(Relaxed),
            cpu_us: self.cpu_us.load(Relaxed),
        }
    }

    fn counts(&self) -> Counts {
        Counts {
            ops: self.ops.load(Relaxed),
            wakeups: self.wakeups.load(Relaxed),
        }
    }
}

/// The measured window: first child start to last child end.
fn measured_wall(slots: &[Slot]) -> Duration {
    let start = slots
        .iter()
        .map(|s| s.start_ns.load(Relaxed))
        .min()
        .unwrap_or(0);
    let end = slots
        .iter()
        .map(|s| s.end_ns.load(Relaxed))
        .max()
        .unwrap_or(0);
    Duration::from_nanos(end.saturating_sub(start))
}

fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime writes the timespec it is given.
    let ts = unsafe {
        let mut ts = std::mem::zeroed::<libc::timespec>();
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
        ts
    };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
