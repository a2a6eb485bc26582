//! The jobs running under the broker's clients, found in /proc, for
//! `--on-memory-pressure pause`: which was started last, and its process
//! tree, to stop (SIGSTOP) and later let go on (SIGCONT).
//!
//! A job is a process whose parent is a build tool (make, ninja, ...)
//! somewhere under a client: for `baton run -- make` the recipe's shell,
//! for make on the FUSE file the same. Its whole tree is stopped, not its
//! process group: make runs its jobs in its own process group, and stopping
//! that group would stop make too, with every other job's completion.

use crate::sys::{self, Stat};
use std::collections::{HashMap, HashSet};

/// The tools whose children are jobs.
const TOOLS: [&str; 7] = [
    "make", "gmake", "gnumake", "bmake", "ninja", "samu", "cargo",
];

/// A job that runs, found in /proc.
#[derive(Debug)]
pub struct Job {
    pub root: u32,
    /// Start time in clock ticks since boot.
    pub start: u64,
    /// Bytes resident in its whole tree.
    pub resident: u64,
}

/// A job stopped by the broker: its root and every process of its tree.
#[derive(Debug)]
pub struct StoppedJob {
    pub root: u32,
    /// Start time in clock ticks since boot.
    pub start: u64,
    pids: Vec<u32>,
}

/// The processes of the machine, read once per decision.
pub struct Snapshot {
    procs: HashMap<u32, Stat>,
    children: HashMap<u32, Vec<u32>>,
    /// Whether two processes share one address space
    /// ([`sys::shares_memory_with`]; asked only of the jobs found, not of
    /// every process of the machine).
    shares_memory: fn(u32, u32) -> bool,
}

impl Snapshot {
    pub fn take() -> Self {
        let procs = read_procs();
        let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
        for (&pid, p) in &procs {
            children.entry(p.ppid).or_default().push(pid);
        }
        Snapshot {
            procs,
            children,
            shares_memory: sys::shares_memory_with,
        }
    }

    /// The jobs under `clients` that are not inside a job in `stopped`.
    pub fn running(&self, clients: &[u32], stopped: &[StoppedJob]) -> Vec<Job> {
        let frozen: HashSet<u32> = stopped
            .iter()
            .flat_map(|j| j.pids.iter().copied())
            .collect();
        let is_job = |pid: &u32| {
            self.procs
                .get(pid)
                .and_then(|p| self.procs.get(&p.ppid))
                .is_some_and(|parent| TOOLS.contains(&parent.comm.as_str()))
        };
        let under: HashSet<u32> = clients.iter().flat_map(|&c| self.tree(c)).collect();
        let mut jobs: Vec<Job> = under
            .iter()
            .copied()
            .filter(|pid| !frozen.contains(pid) && is_job(pid))
            // A job inside another job (a recipe's sub-make's own jobs) is
            // counted once, as the outer one.
            .filter(|&pid| {
                !self
                    .ancestors(pid)
                    .take_while(|p| under.contains(p))
                    .any(|p| is_job(&p))
            })
            // A job between vfork and exec (make 4.3 starts its jobs so)
            // runs in its make's memory, and its make waits in vfork until
            // it execs: stopped there, it would hold the whole build. It is
            // about to exec; it can be stopped after.
            .filter(|&pid| !(self.shares_memory)(pid, self.procs[&pid].ppid))
            .map(|root| Job {
                root,
                start: self.procs[&root].start,
                resident: self
                    .tree(root)
                    .into_iter()
                    .filter_map(sys::resident_bytes)
                    .sum(),
            })
            .collect();
        jobs.sort_by_key(|j| (j.start, j.root));
        jobs
    }

    fn ancestors(&self, pid: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(self.procs.get(&pid).map(|p| p.ppid), |p| {
            self.procs.get(p).map(|q| q.ppid)
        })
    }

    /// `root` and all its descendants, parents first.
    fn tree(&self, root: u32) -> Vec<u32> {
        let mut out = vec![root];
        let mut i = 0;
        while i < out.len() {
            out.extend(self.children.get(&out[i]).into_iter().flatten().copied());
            i += 1;
        }
        out
    }
}

/// Stops `job` with its whole tree: parents first, then again with whatever
/// they started meanwhile, until the tree stands still (a stopped process
/// starts nothing).
pub fn stop(job: &Job) -> StoppedJob {
    let mut stopped: Vec<u32> = Vec::new();
    loop {
        let tree = Snapshot::take().tree(job.root);
        let new: Vec<u32> = tree.into_iter().filter(|p| !stopped.contains(p)).collect();
        if new.is_empty() {
            break;
        }
        signal_all(&new, libc::SIGSTOP);
        stopped.extend(new);
    }
    StoppedJob {
        root: job.root,
        start: job.start,
        pids: stopped,
    }
}

/// Lets a stopped job go on.
pub fn resume(job: &StoppedJob) {
    signal_all(&job.pids, libc::SIGCONT);
}

fn signal_all(pids: &[u32], signal: i32) {
    for &pid in pids {
        sys::signal(pid, signal);
    }
}

fn read_procs() -> HashMap<u32, Stat> {
    sys::pids()
        .filter_map(|pid| Some((pid, sys::stat(pid)?)))
        .collect()
}

/// Whether `pid`, or a process it started, is stopped (state `T`, or `t`
/// under a tracer): a `^Z`ed `baton run` stops with its build, a
/// `kill -STOP` of make stops only the child. One or two reads of /proc
/// per holder, only when a status is asked for.
pub fn is_stopped(pid: u32) -> bool {
    let stopped = |pid: u32| sys::stat(pid).is_some_and(|s| s.is_stopped());
    stopped(pid) || sys::children(pid).into_iter().any(stopped)
}

pub use baton_core::protocol::RUN_PID_VAR;

/// The session a process belongs to (`getsid`), from /proc.
pub fn session_of(pid: u32) -> Option<u32> {
    Some(sys::stat(pid)?.session)
}

/// How many jobs the processes of a build whose `baton run` (pid `owner`,
/// in session `session`) is gone still run: its processes that have no
/// child of their own among them (a sub-make waiting for its jobs is not a
/// job; a shell running gcc is one job, gcc). Processes that left the
/// session (daemons the build started, which call setsid) are not the
/// build's any more: they would hold its tokens for ever.
///
/// A build tool with no child counts here, unlike in [`running_jobs`]: it
/// may be make's child between fork and exec, about to run a job on a
/// token make took (found by the soak: a kill at that moment let the token
/// go and the job start past the limit). Holding one token too many until
/// such a process ends costs nothing; one too few breaks the limit.
///
/// `owner` is the pid the processes carry ([`RUN_PID_VAR`]): in a
/// container, the `baton run`'s pid in its PID namespace
/// ([`pid_in_its_namespace`], recorded while it lived); `pid_ns` that
/// namespace ([`sys::pid_namespace_of`]), in which the processes are looked for.
pub fn orphan_jobs(owner: u32, session: u32, pid_ns: u64) -> u32 {
    orphans(owner, session, pid_ns).jobs
}

/// What the processes of a build whose `baton run` is gone do, from one
/// pass over /proc: see [`orphan_jobs`] and [`Orphans::tools`].
pub fn orphans(owner: u32, session: u32, pid_ns: u64) -> Orphans {
    let census = census(&HashMap::from([((owner, session, pid_ns), owner)]));
    let found = census.get(&owner).copied().unwrap_or_default();
    Orphans {
        jobs: found.jobs + found.idle_tools,
        tools: found.tools,
    }
}

/// An orphaned build's processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Orphans {
    /// Its leaves, build tools with no child included ([`orphan_jobs`]).
    pub jobs: u32,
    /// Its build tools alive (a sub-make, with or without jobs). Each may
    /// read the build's jobserver: the bytes left in it, and those its
    /// jobs write back as they end, start its next jobs. So while one
    /// lives, none of the build's tokens may go back, whatever the number
    /// of jobs at any one look.
    pub tools: u32,
}

/// The real uid of process `pid` (its `Uid:` line), as we see it.
pub fn uid_of(pid: u32) -> Option<u32> {
    sys::status_field(&sys::status(pid)?, "Uid:")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A process's pid in its own PID namespace (the last of its `NSpid:`
/// line), which is what `baton run` in a container puts in
/// [`RUN_PID_VAR`]: the same as `pid` on the host. None if it is gone.
pub fn pid_in_its_namespace(pid: u32) -> Option<u32> {
    sys::status_field(&sys::status(pid)?, "NSpid:")?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The jobs each build runs, in one pass over /proc: `owners` maps the
/// pid its processes carry in [`RUN_PID_VAR`] (its `baton run`'s pid in
/// its own PID namespace, which two containers may share), its session
/// (as we see it) and that PID namespace to the key the counts are
/// returned by. The environment is read only of processes in one of
/// those sessions. A build tool with no child (make parsing, or waiting
/// for a token) runs no job.
pub fn running_jobs(owners: &HashMap<(u32, u32, u64), u32>) -> HashMap<u32, u32> {
    census(owners)
        .into_iter()
        .filter(|(_, c)| c.jobs > 0)
        .map(|(owner, c)| (owner, c.jobs))
        .collect()
}

/// A build's processes, counted in one pass over /proc.
#[derive(Debug, Clone, Copy, Default)]
struct Census {
    /// Leaves that are no build tool: the jobs.
    jobs: u32,
    /// Build tools with no child.
    idle_tools: u32,
    /// Build tools, with or without children.
    tools: u32,
}

/// The processes of each build, by its key in `owners`, in one pass over
/// /proc.
fn census(owners: &HashMap<(u32, u32, u64), u32>) -> HashMap<u32, Census> {
    let sessions: std::collections::HashSet<u32> = owners.keys().map(|&(_, s, _)| s).collect();
    // pid -> (ppid, owner, is a build tool)
    let members: HashMap<u32, (u32, u32, bool)> = sys::pids()
        .filter_map(|pid| {
            let stat = sys::stat(pid)?;
            if !stat.is_live() || !sessions.contains(&stat.session) {
                return None;
            }
            let ns = sys::pid_namespace_of(&pid.to_string())?;
            let owner = *owners.get(&(run_pid_of(pid)?, stat.session, ns))?;
            Some((pid, (stat.ppid, owner, is_a_build_tool(&stat.comm))))
        })
        .collect();
    let parents: std::collections::HashSet<u32> = members.values().map(|m| m.0).collect();
    let mut counts: HashMap<u32, Census> = HashMap::new();
    for (pid, &(_, owner, tool)) in &members {
        let count = counts.entry(owner).or_default();
        let leaf = !parents.contains(pid);
        match (tool, leaf) {
            (true, true) => count.idle_tools += 1,
            (false, true) => count.jobs += 1,
            _ => {}
        }
        count.tools += u32::from(tool);
    }
    counts
}

/// Build tools that wait for tokens and start jobs, but are none: the
/// [`TOOLS`] whose children are jobs (one list, so that no name, such as
/// `gnumake`, is a tool for one count and a job for the other), and baton.
fn is_a_build_tool(comm: &str) -> bool {
    TOOLS.contains(&comm) || comm == "baton"
}

/// The `baton run` a process belongs to: [`RUN_PID_VAR`] in the
/// environment it was started with (readable for our own processes, or as
/// root).
fn run_pid_of(pid: u32) -> Option<u32> {
    sys::environ_var(pid, RUN_PID_VAR)?.parse().ok()
}

/// Spawns `cmd`, a tool a test copied into place a moment ago. The copy
/// may still be open for writing in a child another test thread forked
/// meanwhile, until that child execs: an exec of it fails with ETXTBSY for
/// that moment, so this tries again.
#[cfg(test)]
pub(crate) fn spawn_copied_tool(cmd: &mut std::process::Command) -> std::process::Child {
    let mut busy = 0;
    loop {
        match cmd.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && busy < 1000 => {
                busy += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            spawned => return spawned.unwrap(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_is_the_fourth_field_after_the_paren() {
        let me = std::process::id();
        // SAFETY: getsid(0) has no preconditions.
        let sid = unsafe { libc::getsid(0) } as u32;
        assert_eq!(session_of(me), Some(sid));
        // Outside any PID namespace of its own, a process's pid there is
        // its pid here.
        assert_eq!(pid_in_its_namespace(me), Some(me));
    }

    #[test]
    fn a_process_with_the_marker_and_no_child_is_a_job() {
        let owner = 4_000_000_000u32 - std::process::id();
        // SAFETY: getsid(0) has no preconditions.
        let sid = unsafe { libc::getsid(0) } as u32;
        let ns = sys::pid_namespace_of("self").unwrap();
        assert_eq!(orphan_jobs(owner, sid, ns), 0);
        let mut job = std::process::Command::new("sleep")
            .arg("30")
            .env(RUN_PID_VAR, owner.to_string())
            .spawn()
            .unwrap();
        // spawn can return while exec is still under way (std's error pipe
        // closes with the old program's descriptors, before the new one's
        // environment is laid out, as we read the kernel): for that moment
        // /proc/PID/environ reads empty and the job is nobody's (2 of 40
        // runs). In a build, its make covers that moment: a leaf counted
        // meanwhile (Count::ToolsToo).
        until(|| orphan_jobs(owner, sid, ns) == 1);
        assert_eq!(
            orphan_jobs(owner, sid + 1, ns),
            0,
            "another session's is not"
        );
        assert_eq!(
            orphan_jobs(owner, sid, ns + 1),
            0,
            "another PID namespace's is not"
        );
        job.kill().unwrap();
        job.wait().unwrap();
        assert_eq!(orphan_jobs(owner, sid, ns), 0);
    }

    fn snapshot(procs: &[(u32, u32, &str, u64)]) -> Snapshot {
        let procs: HashMap<u32, Stat> = procs
            .iter()
            .map(|&(pid, ppid, comm, start)| {
                (
                    pid,
                    Stat {
                        ppid,
                        comm: comm.into(),
                        start,
                        state: 'S',
                        session: 1,
                    },
                )
            })
            .collect();
        let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
        for (&pid, p) in &procs {
            children.entry(p.ppid).or_default().push(pid);
        }
        // Made-up pids may be real ones here (kernel threads share "no
        // memory" alike): none of these is between vfork and exec.
        Snapshot {
            procs,
            children,
            shares_memory: |_, _| false,
        }
    }

    #[test]
    fn jobs_are_the_build_tools_children_once_each() {
        // baton run (10) → make (11) → sh (12, 14) → python3 (13); sh 14
        // runs a sub-make (15) whose job (16) belongs to job 14.
        let s = snapshot(&[
            (10, 1, "baton", 0),
            (11, 10, "make", 1),
            (12, 11, "sh", 2),
            (13, 12, "python3", 2),
            (14, 11, "sh", 3),
            (15, 14, "make", 3),
            (16, 15, "sh", 4),
        ]);
        let roots: Vec<u32> = s.running(&[10], &[]).iter().map(|j| j.root).collect();
        assert_eq!(
            roots,
            [12, 14],
            "make itself is no job, nor the sub-make's own"
        );
        let stopped = [StoppedJob {
            root: 12,
            start: 2,
            pids: vec![12, 13],
        }];
        let roots: Vec<u32> = s.running(&[10], &stopped).iter().map(|j| j.root).collect();
        assert_eq!(roots, [14]);
    }

    /// Processes started for a test, killed and reaped when it ends.
    struct Procs(Vec<std::process::Child>);

    impl Procs {
        fn spawn(&mut self, cmd: &mut std::process::Command) -> u32 {
            let child = super::spawn_copied_tool(cmd);
            let pid = child.id();
            self.0.push(child);
            pid
        }
    }

    /// `pid` and every process under it, parents first.
    fn tree_of(pid: u32) -> Vec<u32> {
        let mut tree = vec![pid];
        let mut i = 0;
        while i < tree.len() {
            tree.extend(sys::children(tree[i]));
            i += 1;
        }
        tree
    }

    impl Drop for Procs {
        /// Each process with what it started: a shell's command killed
        /// with it, not left re-parented for its whole minute (holding
        /// the test binary's output open all that while).
        fn drop(&mut self) {
            for child in &mut self.0 {
                for pid in tree_of(child.id()) {
                    // SAFETY: kill(2) on a process this test started, or
                    // one of its descendants, listed just now.
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
                let _ = child.wait();
            }
        }
    }

    fn own_session() -> u32 {
        session_of(std::process::id()).unwrap()
    }

    /// Polls /proc until `done` holds: a process just spawned takes a
    /// moment to show its environment and children.
    fn until(mut done: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "never happened");
            std::thread::yield_now();
        }
    }

    /// A shell running a command is no job itself: its command is, once
    /// (running_jobs and orphan_jobs alike).
    #[test]
    fn a_build_running_a_shell_with_a_command_runs_one_job() {
        let owner = 4_000_000_000u32 - 7 - std::process::id();
        let session = own_session();
        let mut procs = Procs(Vec::new());
        let shell = procs.spawn(
            std::process::Command::new("sh")
                .args(["-c", "sleep 60; true"])
                .env(RUN_PID_VAR, owner.to_string()),
        );
        until(|| !sys::children(shell).is_empty());
        let ns = sys::pid_namespace_of("self").unwrap();
        until(|| orphan_jobs(owner, session, ns) == 1);
        assert_eq!(
            running_jobs(&HashMap::from([((owner, session, ns), owner)])),
            HashMap::from([(owner, 1)])
        );
        // The shell's command ends with the test, not a minute later.
        let command = sys::children(shell)[0];
        drop(procs);
        until(|| !sys::stat(command).is_some_and(|s| s.is_live()));
    }

    /// A build tool with no child (make waiting for a token) is no job
    /// for status, but an orphaned build keeps a token for it; a process
    /// that has exited (a zombie) is neither; nor is one of another build.
    #[test]
    fn a_childless_make_counts_only_for_an_orphaned_build_and_a_zombie_not_at_all() {
        let owner = 4_000_000_000u32 - 11 - std::process::id();
        let session = own_session();
        let ns = sys::pid_namespace_of("self").unwrap();
        let dir = std::env::temp_dir().join(format!("baton-jobs-make-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A program called make: its comm is what tells a build tool.
        let make = dir.join("make");
        std::fs::copy("/bin/sleep", &make).unwrap();
        let mut procs = Procs(Vec::new());
        let marked = |cmd: &mut std::process::Command| {
            cmd.env(RUN_PID_VAR, owner.to_string());
        };
        let mut waiting_make = std::process::Command::new(&make);
        waiting_make.arg("60");
        marked(&mut waiting_make);
        procs.spawn(&mut waiting_make);
        let mut job = std::process::Command::new("sleep");
        job.arg("60");
        marked(&mut job);
        procs.spawn(&mut job);
        // One that exits at once and is not reaped: a zombie with the marker.
        let mut done = std::process::Command::new("true");
        marked(&mut done);
        let mut zombie = done.spawn().unwrap();
        until(|| sys::stat(zombie.id()).is_some_and(|s| !s.is_live()));
        // Another build's job, and a process of this build's in another
        // session, count for nobody here.
        let mut other = std::process::Command::new("sleep");
        other.arg("60").env(RUN_PID_VAR, (owner + 1).to_string());
        procs.spawn(&mut other);
        let mut elsewhere = std::process::Command::new("setsid");
        elsewhere.args(["sleep", "60"]);
        marked(&mut elsewhere);
        procs.spawn(&mut elsewhere);
        // A make running a job: the job is a leaf, the make is not.
        let busy = dir.join("busy").join("make");
        std::fs::create_dir_all(busy.parent().unwrap()).unwrap();
        std::fs::copy("/bin/sh", &busy).unwrap();
        let mut busy_make = std::process::Command::new(&busy);
        busy_make.args(["-c", "sleep 60; true"]);
        marked(&mut busy_make);
        let busy_pid = procs.spawn(&mut busy_make);
        // Until the busy make has started its job, it is a childless make
        // too, and orphan_jobs counts 3 while running_jobs counts 1.
        let its_job_runs = || {
            sys::children(busy_pid)
                .iter()
                .any(|&c| sys::stat(c).is_some_and(|s| s.comm == "sleep"))
        };
        until(|| its_job_runs() && orphan_jobs(owner, session, ns) == 3);
        assert_eq!(
            orphans(owner, session, ns),
            Orphans { jobs: 3, tools: 2 },
            "both makes are tools, busy or not"
        );
        assert_eq!(
            running_jobs(&HashMap::from([((owner, session, ns), owner)])),
            HashMap::from([(owner, 2)]),
            "the sleeping jobs only"
        );
        zombie.wait().unwrap();
        drop(procs);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Every tool whose children are jobs ([`TOOLS`]: GNU make under each
    /// of its names, bmake, ninja, samu, cargo) is a build tool for an
    /// orphaned build: while one of them lives, the build keeps all it
    /// holds ([`Orphans::tools`]), since it may start jobs from the bytes
    /// in its jobserver. Counted as a job instead, its build would give
    /// back all but one token per process while it runs on.
    #[test]
    fn each_tool_that_starts_jobs_is_counted_as_a_build_tool() {
        let owner = 4_000_000_000u32 - 13 - std::process::id();
        let session = own_session();
        let ns = sys::pid_namespace_of("self").unwrap();
        let dir = std::env::temp_dir().join(format!("baton-jobs-tools-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut procs = Procs(Vec::new());
        for name in TOOLS {
            // A program of that name: its comm is what tells a build tool.
            let tool = dir.join(name);
            std::fs::copy("/bin/sleep", &tool).unwrap();
            procs.spawn(
                std::process::Command::new(&tool)
                    .arg("60")
                    .env(RUN_PID_VAR, owner.to_string()),
            );
        }
        let n = TOOLS.len() as u32;
        until(|| orphan_jobs(owner, session, ns) == n);
        assert_eq!(
            orphans(owner, session, ns),
            Orphans { jobs: n, tools: n },
            "each of {TOOLS:?}, childless, is a build tool"
        );
        drop(procs);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_process_whose_child_is_stopped_is_stopped() {
        let mut procs = Procs(Vec::new());
        let shell = procs.spawn(std::process::Command::new("sh").args(["-c", "sleep 60; true"]));
        let mut child = 0;
        until(|| {
            child = sys::children(shell).first().copied().unwrap_or(0);
            child != 0
        });
        assert!(!is_stopped(shell));
        // SAFETY: kill(2) on our own grandchild.
        unsafe { libc::kill(child as i32, libc::SIGSTOP) };
        until(|| sys::stat(child).is_some_and(|s| s.state == 'T'));
        assert!(is_stopped(child));
        assert!(is_stopped(shell), "its child is");
        // SAFETY: as above; the shell is killed and reaped by Procs.
        unsafe { libc::kill(child as i32, libc::SIGKILL) };
    }

    /// make 4.3 vforks its jobs: one caught before its exec holds its make
    /// in vfork, so the pause must not pick it; its exec'd sibling it may.
    #[test]
    fn a_job_between_vfork_and_exec_is_not_offered_to_the_pause() {
        let make = sys::VforkedJob::start();
        let (sleep, vforked) = make.children();
        let roots: Vec<u32> = Snapshot::take()
            .running(&[make.helper], &[])
            .iter()
            .map(|j| j.root)
            .collect();
        assert_eq!(roots, [sleep], "not the vforked {vforked}");
    }
}
