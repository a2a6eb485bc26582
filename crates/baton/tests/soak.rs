//! Chaos: for a bounded time, builds of every style (make 4.3 on a pipe,
//! make 4.4.1 on a FIFO and on the FUSE file, ninja 1.13 on a FIFO, cargo
//! as `auto` chooses) and native clients (`baton run` holding tokens for a
//! sleep: the Rust client) come and go under kill -9 of random clients and
//! their children, limit changes, stray bytes written into a build's FIFO
//! or pipe, builds stopped and continued (SIGSTOP
//! and SIGCONT of the whole group, as ^Z and `fg`) and broker restarts
//! (kill -9, then a new broker on the same socket, at once or after a
//! gap of up to 3 s with no broker at all: past the FUSE mount's grace of
//! 2 s, its builds are let go and fail rather than hang), while an observer samples
//! `baton status --json`. Never more held than the limit (but while a
//! lowered limit drains, and then nothing is granted), every token back at
//! the end, the broker alive.
//!
//! The limit is also checked where it matters, from the jobs themselves:
//! every job (make's, ninja's, a cargo build script's, a native client's
//! command) logs its start and end in one shared log, beside the soak's
//! own marks of each limit change and each kill, and no job may start
//! while the limit's worth of jobs already runs (see [`check_jobs`]).
//!
//! `BATON_SOAK_SECS` sets how long the chaos lasts (default 15 s, the test
//! suite's run); scripts/soak runs it for longer and prints the counts,
//! every `BATON_SOAK_REPORT_SECS` (default 30) and at the end.
//! Chaos actions are drawn from a seed printed at the start;
//! `BATON_SOAK_SEED` replays one.

mod common;

use common::{baton, group_members, set_limit, RunningBroker};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A small deterministic generator (xorshift64*): the run is replayed
/// from its seed, and no dependency is needed for it.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Make43Pipe,
    Make44Fifo,
    Make44Fuse,
    NinjaFifo,
    Cargo,
    Native,
}

const KINDS: [Kind; 6] = [
    Kind::Make43Pipe,
    Kind::Make44Fifo,
    Kind::Make44Fuse,
    Kind::NinjaFifo,
    Kind::Cargo,
    Kind::Native,
];

/// A running client: a `baton run` and what it runs.
struct Running {
    kind: Kind,
    child: Child,
    /// Broker restarts it lived through; a build that lived through none
    /// and was not killed must succeed.
    restarts_seen: u32,
    /// Upgrades in place it lived through (it may say so, once each).
    replacements_seen: u32,
    killed: bool,
    /// Its stderr: `baton run`'s own lines are counted at its end.
    log: PathBuf,
}

/// The broker's FUSE mount waits this long for a successor
/// (`--fuse-orphan-grace`); gaps longer than this are "no successor" for
/// its builds.
const FUSE_GRACE_SECS: u64 = 2;

/// `baton run`'s own lines (`baton: ...`) a client may print for each
/// broker event it lives through (lost, re-attached, a refusal) and once
/// besides (its end line, a warning): more is a reconnect storm (#32: one
/// line per attempt printed 15,000 lines in seconds).
const LINES_PER_EVENT: usize = 3;
const LINES_BESIDES: usize = 4;

/// A client still running when the test ends (a failing one: otherwise
/// the chaos waits for every client) is killed with its process group and
/// reaped, so that nothing it started outlives the test. One that ended
/// was reaped by `reap` and is left alone: its pid may be someone else's.
/// (Not a `Guarded`: that would kill what a client left in its group as
/// soon as `reap` drops it, and the jobs of a killed client run on.)
impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let pid = self.child.id() as i32;
            // SAFETY: kill(2) on our own unreaped child and its group.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
            }
            let _ = self.child.wait();
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    started: u32,
    succeeded: u32,
    /// Ended otherwise after a kill of theirs or a broker restart.
    disturbed: u32,
    clients_killed: u32,
    children_killed: u32,
    limit_changes: u32,
    /// Builds stopped (SIGSTOP of the whole group, as ^Z does) and let go on.
    stops: u32,
    broker_restarts: u32,
    /// Upgrades in place: no build may notice them.
    broker_replacements: u32,
    /// Bursts of stray bytes written into a running build's jobserver.
    stray_writes: u32,
    /// Restarts after a gap longer than the FUSE grace: no successor in
    /// time for the FUSE builds, which must end, not hang.
    gaps_past_grace: u32,
    /// `baton run`'s own stderr lines, all clients together.
    client_lines: usize,
}

/// What the observer saw.
#[derive(Debug, Default)]
struct Observed {
    samples: u32,
    /// Samples taken while no broker answered (during restarts).
    unanswered: u32,
    violations: Vec<String>,
}

fn seed() -> u64 {
    std::env::var("BATON_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            t.as_nanos() as u64 | 1
        })
}

fn soak_time() -> Duration {
    Duration::from_secs(
        std::env::var("BATON_SOAK_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(15),
    )
}

/// How often a running soak says how it goes: `BATON_SOAK_REPORT_SECS`,
/// default 30 s (the test suite's 15 s run says nothing until its end).
fn report_every() -> u64 {
    std::env::var("BATON_SOAK_REPORT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30)
        .max(1)
}

/// The projects the builds run, each in a directory of its own: every
/// start runs in a fresh copy, so that ninja and cargo have work to do.
struct Projects {
    root: PathBuf,
    next: AtomicU32,
    jobs: JobLog,
}

impl Projects {
    fn new(root: PathBuf) -> Self {
        std::fs::create_dir_all(&root).unwrap();
        let jobs = JobLog::new(&root);
        Projects {
            root,
            next: AtomicU32::new(0),
            jobs,
        }
    }

    fn dir(&self, kind: Kind) -> PathBuf {
        let dir = self.root.join(format!(
            "{kind:?}-{}",
            self.next.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let job = |secs: &str| self.jobs.command(secs);
        match kind {
            Kind::NinjaFifo => {
                let mut text = format!("rule job\n  command = {}; touch $out\n", job("0.05"));
                for i in 0..8 {
                    text.push_str(&format!("build out{i}: job\n"));
                }
                std::fs::write(dir.join("build.ninja"), text).unwrap();
            }
            Kind::Cargo => {
                common::cargo_workspace(&dir, &dir.join("build-scripts.log"), 2);
                // Each build script runs a logged job, and so does each
                // rustc (`JobLog::rustc_wrapper`): what cargo starts on a
                // token.
                for c in ["c0", "c1"] {
                    let script = format!(
                        "fn main() {{ std::process::Command::new(\"sh\").args([\"-c\", {:?}]).status().unwrap(); }}\n",
                        job("0.3")
                    );
                    std::fs::write(dir.join(c).join("build.rs"), script).unwrap();
                }
            }
            Kind::Native => {}
            _ => {
                let all: Vec<String> = (0..8).map(|i| format!("j{i}")).collect();
                let text = format!(
                    "all: {all}\n{all}:\n\t@{job}\n.PHONY: all {all}\n",
                    all = all.join(" "),
                    job = job("0.05")
                );
                std::fs::write(dir.join("Makefile"), text).unwrap();
            }
        }
        dir
    }
}

/// The soak's one log of what runs: jobs append `S <pid> <ns>` as they
/// start and `E <pid> <ns>` as they end (a script, so that make, ninja,
/// cargo and the shell need no quoting of `$$`), and the soak appends
/// `L <limit> <ns>`, `K <pid> <ns>` and `X <pid> <ns>` as it writes stray
/// bytes into a build's jobserver (and, for the post-mortem only, `B`/`R
/// <pid>` as it kills or replaces the broker, `N <pid>` once a new one
/// answers), and the observer appends `O 1 <ns>` when the pool's books
/// show more held than the limit (a lowered limit draining) and `O 0 <ns>`
/// when they no longer do. Appends of a line are atomic, so
/// the file's order is the order things happened in: a job's `E` is
/// written before it exits, so before its token can start another.
#[derive(Clone)]
struct JobLog {
    path: PathBuf,
    script: PathBuf,
}

impl JobLog {
    fn new(root: &Path) -> Self {
        let script = root.join("job.sh");
        std::fs::write(
            &script,
            "echo \"S $$ $(date +%s%N) $BATON_SOAK_KIND\" >> \"$1\"\nsleep \"$2\"\necho \"E $$ $(date +%s%N)\" >> \"$1\"\n",
        )
        .unwrap();
        JobLog {
            path: root.join("jobs.log"),
            script,
        }
    }

    /// A `RUSTC_WRAPPER` that logs each rustc as a job: cargo runs rustc
    /// on a token and then the build script on the same one, so a rustc
    /// left out of the log would hide a token in use across a lowered
    /// limit, and the build script after it would seem to start past it.
    fn rustc_wrapper(&self) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let wrapper = self.script.with_file_name("rustc-wrapper.sh");
        let log = self.path.display();
        let text = format!(
            "#!/bin/sh\necho \"S $$ $(date +%s%N) $BATON_SOAK_KIND\" >> \"{log}\"\n\"$@\"\nrc=$?\necho \"E $$ $(date +%s%N)\" >> \"{log}\"\nexit $rc\n"
        );
        std::fs::write(&wrapper, text).unwrap();
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        wrapper
    }

    /// The shell command of a job of `secs` seconds.
    fn command(&self, secs: &str) -> String {
        format!(
            "sh {} {} {secs}",
            self.script.display(),
            self.path.display()
        )
    }

    /// Appends one of the soak's own marks.
    fn mark(&self, what: char, value: u64) {
        let ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
            .unwrap();
        f.write_all(format!("{what} {value} {ns}\n").as_bytes())
            .unwrap();
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.path).unwrap_or_default()
    }
}

/// How long after a limit change a job may still start on a token granted
/// before it: the time from a build's read of the token to its job's
/// first line (a fork, an exec of sh, a `date`). Generous, because the
/// soak runs beside the whole suite on two cores.
const IN_FLIGHT_NS: u128 = 500_000_000;

/// How long after stray bytes were written into a build's jobserver a
/// start past the limit is put down to them: a byte a reader took before
/// the bridge could take it out runs as a token until the build's jobs
/// drain (docs/jobserver.md, "Stray bytes"), and a soak build runs 8 jobs
/// of 50 ms.
const STRAY_NS: u128 = 1_000_000_000;

/// What the jobs' log shows.
#[derive(Debug, Default, PartialEq)]
struct JobsSeen {
    started: usize,
    /// The most jobs running at once.
    most: usize,
    /// Starts past the limit within [`STRAY_NS`] of stray bytes.
    after_stray: usize,
    /// The longest of those after their stray bytes, in milliseconds: how
    /// long an excess the bytes made lasted.
    stray_ms_most: u128,
    /// Starts while the limit's worth of jobs already ran.
    violations: Vec<String>,
}

/// Replays the log ([`JobLog`]). A job may start only while fewer jobs
/// than the limit run, the limit being the highest in force at any moment
/// of the [`IN_FLIGHT_NS`] before it (its token may have been granted
/// then). A lowered limit drains: while a job started before the lowering
/// (or within `IN_FLIGHT_NS` after it) still runs, the jobs beside it are
/// not counted against the new limit, as the pool grants nothing then.
/// A broker killed while a lowering drains (`B` within `IN_FLIGHT_NS` of
/// it) stops the drain, which goes on from the next broker's start (`N`):
/// a `fifo` build gives back over a few of its jobs (docs/jobserver.md,
/// "When the limit is lowered"), and with no broker it cannot give back:
/// until then, up to the old limit's worth may run on what the builds held.
fn check_jobs(text: &str) -> JobsSeen {
    let mut seen = JobsSeen::default();
    let mut running = std::collections::HashMap::<u64, u128>::new();
    // (from, limit), in order; and when the limit last went down.
    let mut limits: Vec<(u128, u64)> = Vec::new();
    let mut lowered: Option<u128> = None;
    // The limit before the last lowering, and whether the books still
    // hold more than the limit since (the observer's `O`).
    let mut before_lowering = 0;
    let mut over_books = false;
    let mut stray: Option<u128> = None;
    let mut drain_cut = false;
    // The kind of build of each running job (the start line's fourth word).
    let mut kinds = std::collections::HashMap::<u64, String>::new();
    // A kill of a job's `date` leaves its line without a time: the line
    // before it tells the time closely enough.
    let mut ns = 0;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some(what), Some(Ok(value))) = (words.next(), words.next().map(str::parse::<u64>))
        else {
            continue;
        };
        if let Some(Ok(t)) = words.next().map(str::parse::<u128>) {
            ns = t;
        }
        match what {
            "L" => {
                if let Some(&(_, old)) = limits.last().filter(|&&(_, old)| value < old) {
                    lowered = Some(ns);
                    // Lowered again mid-drain: the first drain's tokens
                    // may still be out.
                    before_lowering = if over_books {
                        before_lowering.max(old)
                    } else {
                        old
                    };
                }
                limits.push((ns, value));
            }
            "O" => over_books = value == 1,
            "E" | "K" => {
                running.remove(&value);
                kinds.remove(&value);
            }
            "X" => stray = Some(ns),
            "B" => drain_cut = lowered.is_some_and(|low| ns < low + IN_FLIGHT_NS),
            "N" if drain_cut => {
                lowered = Some(ns);
                drain_cut = false;
            }
            "S" => {
                running.insert(value, ns);
                kinds.insert(value, words.next().unwrap_or("?").to_string());
                seen.started += 1;
                seen.most = seen.most.max(running.len());
                let since = ns.saturating_sub(IN_FLIGHT_NS);
                let in_force_before = limits.iter().rev().find(|&&(from, _)| from <= since);
                let mut allowed = limits
                    .iter()
                    .filter(|&&(from, _)| from > since && from <= ns)
                    .chain(in_force_before)
                    .map(|&(_, limit)| limit)
                    .max()
                    .unwrap_or(u64::MAX);
                // Tokens lent before a lowering and not yet back (the
                // books say so) may run until they come back: a `fifo`
                // build reads a token it wrote back before the feeder can
                // take it (docs/jobserver.md, "When the limit is
                // lowered"). So may what the builds held while no broker
                // has come since a lowering was cut short: nobody can take
                // it back (the drain goes on from the next broker's start).
                // Never more than the old limit's worth.
                if over_books || drain_cut {
                    allowed = allowed.max(before_lowering);
                }
                let draining = lowered.is_some_and(|low| {
                    running
                        .iter()
                        .any(|(&pid, &start)| pid != value && start < low + IN_FLIGHT_NS)
                });
                let past = running.len() as u64 > allowed && !draining;
                if let (true, Some(x)) = (past, stray.filter(|&x| ns < x + STRAY_NS)) {
                    seen.after_stray += 1;
                    seen.stray_ms_most = seen.stray_ms_most.max((ns - x) / 1_000_000);
                } else if past {
                    let mut beside: Vec<String> = running
                        .keys()
                        .map(|pid| format!("{pid} {}", kinds.get(pid).map_or("?", |k| k)))
                        .collect();
                    beside.sort();
                    seen.violations.push(format!(
                        "job {value} started with {} running under a limit of {allowed} (at {ns}): {}",
                        running.len(),
                        beside.join(", ")
                    ));
                }
            }
            _ => {}
        }
    }
    seen
}

fn start(broker_socket: &Path, projects: &Projects, kind: Kind, log: &Path) -> Child {
    let dir = projects.dir(kind);
    let mut run = baton();
    run.arg("run")
        .arg("--socket")
        .arg(broker_socket)
        .env("BATON_NO_AUTOSTART", "1")
        .current_dir(&dir);
    // A process group of its own: a kill of the client and its children
    // reaches every process of it, and none of the test's.
    std::os::unix::process::CommandExt::process_group(&mut run, 0);
    let (make43, make44, ninja) = (common::make43(), common::make44(), common::ninja());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // No -jN for make or ninja: given one on its own command line, each
    // runs a jobserver of its own past the pool (baton warns), and the
    // soak would not exercise baton's.
    match kind {
        Kind::Make43Pipe => run.args(["--jobserver-style", "pipe", "--"]).arg(make43),
        Kind::Make44Fifo => run.args(["--jobserver-style", "fifo", "--"]).arg(make44),
        Kind::Make44Fuse => run.args(["--jobserver-style", "fuse", "--"]).arg(make44),
        Kind::NinjaFifo => run.args(["--jobserver-style", "fifo", "--"]).arg(ninja),
        Kind::Cargo => run
            .args(["--", &cargo, "build", "--offline", "--quiet", "-j", "8"])
            .env("CARGO_TARGET_DIR", dir.join("target"))
            .env("RUSTC_WRAPPER", projects.jobs.rustc_wrapper())
            .env_remove("CARGO_MAKEFLAGS")
            .env_remove("CARGO_BUILD_JOBS"),
        Kind::Native => run.args(["--", "sh", "-c", &projects.jobs.command("0.3")]),
    };
    // Each job's start line names its build's kind, for the post-mortem.
    run.env_remove("MAKEFLAGS")
        .env("BATON_SOAK_KIND", format!("{kind:?}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("the client's log"))
        .spawn()
        .expect("start baton run")
}

fn kill9(pid: u32) {
    // SAFETY: kill takes any pid; ours are children or their descendants.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

/// Checks one `baton status --json` sample against the one before it from
/// the same broker: held ≤ limit and free + held = limit, or, while a
/// lowered limit drains, nothing free and nothing granted.
fn check_sample(doc: &serde_json::Value, before: Option<&serde_json::Value>) -> Option<String> {
    let field = |d: &serde_json::Value, k: &str| d[k].as_u64().unwrap_or(u64::MAX);
    let (limit, free, held) = (field(doc, "limit"), field(doc, "free"), field(doc, "held"));
    if held <= limit {
        return (free + held != limit)
            .then(|| format!("free {free} + held {held} != limit {limit}"));
    }
    if free != 0 {
        return Some(format!("held {held} > limit {limit} with {free} free"));
    }
    let same_broker =
        |b: &serde_json::Value| b["broker_pid"] == doc["broker_pid"] && field(b, "limit") == limit;
    // Builds re-attaching after a broker's crash say what they hold (HOLD):
    // the pool learns of tokens in use, it grants none.
    let held_again = |d: &serde_json::Value| d["totals"]["held_again"].as_u64().unwrap_or(0);
    // Between two samples grants may bring held up to the limit, and
    // HOLDs past it; nothing else raises it.
    let most =
        |b: &serde_json::Value| field(b, "held").max(limit) + held_again(doc) - held_again(b);
    match before.filter(|b| same_broker(b)) {
        Some(b) if held > most(b) => Some(format!(
            "held rose from {} to {held} above limit {limit}",
            field(b, "held")
        )),
        _ => None,
    }
}

fn observe(socket: PathBuf, stop: Arc<AtomicBool>, seen: Arc<Mutex<Observed>>, jobs: JobLog) {
    let mut before: Option<serde_json::Value> = None;
    let mut over = false;
    while !stop.load(Ordering::Relaxed) {
        let out = baton()
            .args(["status", "--json", "--socket"])
            .arg(&socket)
            .stderr(Stdio::null())
            .output()
            .expect("run baton status");
        let mut seen = seen.lock().unwrap();
        seen.samples += 1;
        match serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            Ok(doc) if out.status.success() => {
                if let Some(v) = check_sample(&doc, before.as_ref()) {
                    // Both samples, for the post-mortem.
                    let pair = format!("{v}\nbefore: {before:?}\nafter: {doc}");
                    seen.violations.push(pair);
                }
                if over != over_the_limit(&doc) {
                    over = !over;
                    jobs.mark('O', over.into());
                }
                before = Some(doc);
            }
            _ => seen.unanswered += 1,
        }
        drop(seen);
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a sample's books hold more than the limit: a lowered limit
/// still draining.
fn over_the_limit(doc: &serde_json::Value) -> bool {
    let field = |k: &str| doc[k].as_u64().unwrap_or(0);
    field("held") > field("limit")
}

/// Kills the broker with SIGKILL and starts a new one on its socket: its
/// log goes on in the same file.
fn restart_after_kill9(broker: &mut RunningBroker, limit: u32, gap: Duration) {
    kill9(broker.pid());
    broker.child.wait().expect("reap the killed broker");
    // A while with no broker at all: builds carry on with what they hold,
    // and a `baton run` waiting for its first token waits for the next.
    std::thread::sleep(gap);
    let log = std::fs::OpenOptions::new()
        .append(true)
        .open(broker.dir.path().join("broker.log"))
        .unwrap();
    broker.child = baton()
        .args(["serve", "--jobs", &limit.to_string(), "--socket"])
        .arg(&broker.socket)
        .args(["--fuse-orphan-grace", &FUSE_GRACE_SECS.to_string()])
        .stderr(log)
        .spawn()
        .expect("start baton serve again");
    common::wait_for(Duration::from_secs(30), "the new broker to listen", || {
        std::os::unix::net::UnixStream::connect(&broker.socket).is_ok()
    });
}

/// Replaces the broker in place (`baton serve --replace`, as an upgrade
/// would): the running one hands everything over and exits; builds must
/// not notice. Its log goes on in the same file.
fn replace(broker: &mut RunningBroker, limit: u32) {
    let log = std::fs::OpenOptions::new()
        .append(true)
        .open(broker.dir.path().join("broker.log"))
        .unwrap();
    let grace = FUSE_GRACE_SECS.to_string();
    let successor = broker
        .successor(limit, &["--fuse-orphan-grace", &grace])
        .stderr(log)
        .spawn()
        .expect("start the successor");
    let handed_over = common::wait_timeout(&mut broker.child, Duration::from_secs(60))
        .expect("the running broker hands over and exits");
    assert!(
        handed_over.success(),
        "the replaced broker exited with {handed_over}: {}",
        broker.log()
    );
    broker.child = successor;
}

/// What the clients still running do, for the post-mortem of a hang:
/// each process of their groups, its state (`S` asleep, `D` in the
/// kernel, `T` stopped) and its command line.
fn hung(running: &[Running]) -> String {
    let mut out = String::new();
    for r in running {
        out += &format!("{:?} (pid {}):\n", r.kind, r.child.id());
        for pid in group_members(r.child.id()) {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .next();
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            out += &format!("  {pid} {} {cmd}\n", state.unwrap_or("?"));
        }
        out += &std::fs::read_to_string(&r.log).unwrap_or_default();
    }
    out
}

/// Reaps the clients that ended, counting how.
fn reap(running: &mut Vec<Running>, counts: &mut Counts, failures: &mut Vec<String>) {
    running.retain_mut(|r| {
        let Some(status) = r.child.try_wait().unwrap() else {
            return true;
        };
        let text = std::fs::read_to_string(&r.log).unwrap_or_default();
        let ours = text.lines().filter(|l| l.starts_with("baton: ")).count();
        counts.client_lines += ours;
        let events = (r.restarts_seen + r.replacements_seen) as usize;
        if ours > LINES_BESIDES + LINES_PER_EVENT * events {
            failures.push(format!(
                "{:?} printed {ours} lines of its own through {events} broker events: a storm?\n{}",
                r.kind,
                text.lines().take(20).collect::<Vec<_>>().join("\n")
            ));
        }
        if status.success() {
            counts.succeeded += 1;
        } else if r.killed || r.restarts_seen > 0 {
            counts.disturbed += 1;
        } else {
            failures.push(format!(
                "{:?} exited with {status} though nothing disturbed it",
                r.kind
            ));
        }
        false
    });
}

#[test]
fn chaos_loses_no_token_and_never_breaks_the_limit() {
    let (secs, seed) = (soak_time(), seed());
    eprintln!(
        "soak: {} s, seed {seed} (BATON_SOAK_SEED={seed} replays the chaos)",
        secs.as_secs()
    );
    let mut dice = Dice(seed);
    let mut limit = 4;
    let grace = FUSE_GRACE_SECS.to_string();
    let mut broker = RunningBroker::start_with(limit, &["--fuse-orphan-grace", &grace]);
    let projects = Projects::new(broker.dir.path().join("projects"));
    projects.jobs.mark('L', limit.into());
    let fuse = broker.log().contains("FUSE token files at");
    if !fuse {
        common::skip(
            common::Missing::Fuse,
            "FUSE is not available here: the soak runs without its FUSE clients",
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let observed = Arc::new(Mutex::new(Observed::default()));
    let observer = {
        let (socket, stop, observed) = (broker.socket.clone(), stop.clone(), observed.clone());
        let jobs = projects.jobs.clone();
        std::thread::spawn(move || observe(socket, stop, observed, jobs))
    };

    let (mut counts, mut running, mut failures) =
        (Counts::default(), Vec::<Running>::new(), Vec::new());
    let started = Instant::now();
    let mut reported = 0;
    while started.elapsed() < secs {
        reap(&mut running, &mut counts, &mut failures);
        // A line per interval, so that a long soak shows it is alive and
        // how it goes (scripts/soak passes `soak:` lines on).
        let elapsed = started.elapsed().as_secs();
        if elapsed >= reported + report_every() {
            reported = elapsed;
            let seen = observed.lock().unwrap();
            eprintln!(
                "soak: {elapsed}/{} s: {counts:?}; {} samples, {} violations",
                secs.as_secs(),
                seen.samples,
                seen.violations.len()
            );
        }
        match dice.below(22) {
            0..=9 if running.len() < 6 => {
                let kind = KINDS[dice.below(KINDS.len())];
                let one_cargo =
                    kind == Kind::Cargo && running.iter().any(|r| r.kind == Kind::Cargo);
                if (kind != Kind::Make44Fuse || fuse) && !one_cargo {
                    let log = projects.root.join(format!("client-{}.log", counts.started));
                    running.push(Running {
                        kind,
                        child: start(&broker.socket, &projects, kind, &log),
                        restarts_seen: 0,
                        replacements_seen: 0,
                        killed: false,
                        log,
                    });
                    counts.started += 1;
                }
            }
            10..=12 if !running.is_empty() => {
                let victim = dice.below(running.len());
                let r = &mut running[victim];
                projects.jobs.mark('K', r.child.id().into());
                kill9(r.child.id());
                r.killed = true;
                counts.clients_killed += 1;
            }
            13..=15 if !running.is_empty() => {
                let victim = dice.below(running.len());
                let r = &mut running[victim];
                let children: Vec<u32> = group_members(r.child.id())
                    .into_iter()
                    .filter(|&p| p != r.child.id())
                    .collect();
                if !children.is_empty() {
                    let child = children[dice.below(children.len())];
                    // Before the kill: from then on the job, if it is one,
                    // runs no more as far as the check is concerned.
                    projects.jobs.mark('K', child.into());
                    kill9(child);
                    r.killed = true;
                    counts.children_killed += 1;
                }
            }
            16 | 17 => {
                let new = 1 + dice.below(6) as u32;
                // A higher limit counts from just before the request, a
                // lower one from its answer: the check is never stricter
                // than the broker could have been.
                if new > limit {
                    projects.jobs.mark('L', new.into());
                }
                if set_limit(&broker, new).status.success() {
                    if new < limit {
                        projects.jobs.mark('L', new.into());
                    }
                    limit = new;
                    counts.limit_changes += 1;
                } else if new > limit {
                    projects.jobs.mark('L', limit.into());
                }
            }
            18 if dice.below(4) == 0 => {
                let gap = Duration::from_millis(if dice.below(2) == 0 {
                    0
                } else {
                    500 * (1 + dice.below(6)) as u64
                });
                // Marks for the post-mortem: the check reads neither.
                projects.jobs.mark('B', broker.pid().into());
                restart_after_kill9(&mut broker, limit, gap);
                projects.jobs.mark('N', broker.pid().into());
                running.iter_mut().for_each(|r| r.restarts_seen += 1);
                counts.broker_restarts += 1;
                counts.gaps_past_grace += u32::from(gap > Duration::from_secs(FUSE_GRACE_SECS));
            }
            19 if dice.below(4) == 0 => {
                projects.jobs.mark('R', broker.pid().into());
                replace(&mut broker, limit);
                projects.jobs.mark('N', broker.pid().into());
                running.iter_mut().for_each(|r| r.replacements_seen += 1);
                counts.broker_replacements += 1;
            }
            // Stray bytes written into a build's FIFO or pipe, as a client
            // gone wrong might: taken out and counted, never a token.
            21 if !running.is_empty() => {
                let r = &running[dice.below(running.len())];
                let tool = matches!(
                    r.kind,
                    Kind::Make43Pipe | Kind::Make44Fifo | Kind::NinjaFifo
                );
                if let (true, Some(&cmd)) = (tool, common::children(r.child.id()).first()) {
                    projects.jobs.mark('X', cmd.into());
                    let bytes = vec![b'+'; 1 + dice.below(8)];
                    let wrote = common::try_jobserver_of(cmd).and_then(|path| {
                        std::fs::OpenOptions::new()
                            .write(true)
                            .custom_flags(libc::O_NONBLOCK)
                            .open(path)
                            .and_then(|mut f| f.write_all(&bytes))
                            .ok()
                    });
                    counts.stray_writes += u32::from(wrote.is_some());
                }
            }
            // A ^Z and `fg`: the build keeps its tokens meanwhile (#32).
            20 if !running.is_empty() => {
                let group = running[dice.below(running.len())].child.id() as i32;
                unsafe { libc::kill(-group, libc::SIGSTOP) };
                std::thread::sleep(Duration::from_millis(20 * (1 + dice.below(10)) as u64));
                unsafe { libc::kill(-group, libc::SIGCONT) };
                counts.stops += 1;
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    // Every client ends (a killed broker's builds go on without it), and
    // the broker gets every token back.
    let ending = Instant::now();
    while !running.is_empty() {
        reap(&mut running, &mut counts, &mut failures);
        if ending.elapsed() > Duration::from_secs(120) {
            panic!(
                "builds hung: still running 120 s after the chaos (seed {seed}):\n{}\n{}",
                hung(&running),
                broker.log()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    common::wait_for(Duration::from_secs(30), "every token to come back", || {
        let s = broker.status();
        (s.free, s.held) == (s.limit, 0)
    });
    stop.store(true, Ordering::Relaxed);
    observer.join().unwrap();
    let observed = observed.lock().unwrap();
    eprintln!(
        "soak: {counts:?}; observer: {} samples ({} while no broker answered), {} violations",
        observed.samples,
        observed.unanswered,
        observed.violations.len()
    );
    assert!(common::pid_alive(broker.pid()), "the broker died");
    broker.assert_all_free();
    assert!(
        observed.violations.is_empty(),
        "the observer saw the limit broken: {:?}",
        observed.violations
    );
    let jobs = check_jobs(&projects.jobs.text());
    eprintln!(
        "soak: jobs: {} started, at most {} at once, {} started past the limit \
         ({} more within {} s of stray bytes, the last {} ms after them)",
        jobs.started,
        jobs.most,
        jobs.violations.len(),
        jobs.after_stray,
        STRAY_NS / 1_000_000_000,
        jobs.stray_ms_most
    );
    if !jobs.violations.is_empty() {
        // Kept for the post-mortem: the temporary directory goes with the
        // broker.
        let kept = std::env::temp_dir().join(format!("baton-soak-jobs-{seed}.log"));
        std::fs::copy(&projects.jobs.path, &kept).unwrap();
        panic!(
            "jobs ran past the limit (seed {seed}; the log is kept at {}): {:?}\n{}",
            kept.display(),
            jobs.violations,
            broker.log()
        );
    }
    assert!(jobs.started > 0, "no job ran: {counts:?}");
    assert!(
        failures.is_empty(),
        "builds failed: {failures:?}\n{}",
        broker.log()
    );
    assert!(
        counts.started > 0 && observed.samples > observed.unanswered,
        "nothing ran: {counts:?}"
    );
}

/// The observer's rule on its own: what it must flag, and what a draining
/// pool may show.
#[test]
fn the_observer_flags_more_held_than_the_limit() {
    let doc = |pid: u32, limit: u32, free: u32, held: u32| serde_json::json!({ "broker_pid": pid, "limit": limit, "free": free, "held": held });
    assert_eq!(check_sample(&doc(1, 4, 1, 3), None), None);
    assert!(
        check_sample(&doc(1, 4, 2, 3), None).is_some(),
        "a token created"
    );
    assert!(
        check_sample(&doc(1, 4, 0, 3), None).is_some(),
        "a token lost"
    );
    assert_eq!(
        check_sample(&doc(1, 2, 0, 3), Some(&doc(1, 2, 0, 4))),
        None,
        "a lowered limit drains"
    );
    assert!(
        check_sample(&doc(1, 2, 1, 3), None).is_some(),
        "free tokens while draining"
    );
    assert!(
        check_sample(&doc(1, 2, 0, 4), Some(&doc(1, 2, 0, 3))).is_some(),
        "a grant while draining"
    );
    assert_eq!(
        check_sample(&doc(2, 2, 0, 4), Some(&doc(1, 2, 0, 3))),
        None,
        "another broker: nothing to compare"
    );
    let again = |d: serde_json::Value, held_again: u32| {
        let mut d = d;
        d["totals"] = serde_json::json!({ "held_again": held_again });
        d
    };
    // Seen in the soak: grants up to the limit (2 -> 6), then an orphaned
    // build counted with one token per running job (HOLD 5).
    assert_eq!(
        check_sample(
            &again(doc(1, 6, 0, 11), 8),
            Some(&again(doc(1, 6, 4, 2), 3))
        ),
        None,
        "grants up to the limit, and HOLDs past it"
    );
    assert!(
        check_sample(
            &again(doc(1, 6, 0, 12), 8),
            Some(&again(doc(1, 6, 4, 2), 3))
        )
        .is_some(),
        "one more than grants to the limit and the HOLDs"
    );
}

/// The jobs' rule on its own: what it must flag and what it lets pass.
#[test]
fn the_job_check_flags_a_start_past_the_limit_and_lets_a_drain_pass() {
    let s = 1_000_000_000u128; // one second, in the log's nanoseconds
    let log = |lines: &[(&str, u64, u128)]| {
        lines
            .iter()
            .map(|(w, v, t)| format!("{w} {v} {t}\n"))
            .collect::<String>()
    };
    let two_within_two = log(&[
        ("L", 2, 0),
        ("S", 1, s),
        ("S", 2, s),
        ("E", 1, 2 * s),
        ("S", 3, 2 * s),
    ]);
    assert_eq!(check_jobs(&two_within_two).violations.len(), 0);
    assert_eq!(check_jobs(&two_within_two).most, 2);
    let three = log(&[("L", 2, 0), ("S", 1, s), ("S", 2, s), ("S", 3, s)]);
    assert_eq!(
        check_jobs(&three).violations.len(),
        1,
        "a third job under 2"
    );
    let killed = log(&[
        ("L", 2, 0),
        ("S", 1, s),
        ("S", 2, s),
        ("K", 1, 2 * s),
        ("S", 3, 2 * s),
    ]);
    assert_eq!(
        check_jobs(&killed).violations.len(),
        0,
        "a killed job ran no more"
    );
    // 4 -> 1 while 3 run: the one that goes on beside an old job is the
    // drain; once the old ones are gone, a second job is past the limit.
    let drain = log(&[
        ("L", 4, 0),
        ("S", 1, s),
        ("S", 2, s),
        ("S", 3, s),
        ("L", 1, 2 * s),
        ("E", 1, 3 * s),
        ("S", 4, 3 * s),
        ("E", 2, 4 * s),
        ("E", 3, 4 * s),
        ("S", 5, 5 * s),
    ]);
    let seen = check_jobs(&drain);
    assert_eq!(seen.violations.len(), 1, "{seen:?}");
    assert!(seen.violations[0].starts_with("job 5 "), "{seen:?}");
    // A job started just after a lowering, on a token granted before it.
    let in_flight = log(&[
        ("L", 2, 0),
        ("S", 1, s),
        ("L", 1, 2 * s),
        ("S", 2, 2 * s + 1000),
    ]);
    assert_eq!(check_jobs(&in_flight).violations.len(), 0);
    // Stray bytes excuse a start past the limit for a while, not for ever.
    let stray = log(&[
        ("L", 1, 0),
        ("S", 1, s),
        ("X", 9, s),
        ("S", 2, s + 300_000_000),
        ("E", 2, 2 * s),
        ("S", 3, 3 * s),
    ]);
    let seen = check_jobs(&stray);
    assert_eq!(
        (seen.after_stray, seen.violations.len(), seen.stray_ms_most),
        (1, 1, 300),
        "{seen:?}"
    );
    // A broker killed while a lowering drains: the drain goes on from the
    // next broker's start; a broker killed later is no excuse.
    let cut = log(&[
        ("L", 2, 0),
        ("S", 1, s),
        ("S", 2, s),
        ("L", 1, 2 * s),
        ("B", 7, 2 * s + 1000),
        ("E", 1, 3 * s),
        ("E", 2, 3 * s),
        ("N", 8, 4 * s),
        ("S", 3, 4 * s + 1000),
        ("S", 4, 4 * s + 2000),
        ("E", 3, 5 * s),
        ("E", 4, 5 * s),
        ("S", 5, 6 * s),
        ("S", 6, 6 * s),
    ]);
    let seen = check_jobs(&cut);
    assert_eq!(seen.violations.len(), 1, "{seen:?}");
    assert!(seen.violations[0].starts_with("job 6 "), "{seen:?}");
    // With no broker yet, what the builds held runs on: new jobs on the
    // old tokens pass, one past the old limit does not.
    let gap = log(&[
        ("L", 2, 0),
        ("S", 1, s),
        ("S", 2, s),
        ("L", 1, 2 * s),
        ("B", 7, 2 * s + 1000),
        ("E", 1, 3 * s),
        ("S", 3, 3 * s + 1000),
        ("E", 2, 4 * s),
        ("S", 4, 4 * s + 1000),
        ("S", 5, 4 * s + 2000),
    ]);
    let seen = check_jobs(&gap);
    assert_eq!(seen.violations.len(), 1, "{seen:?}");
    assert!(seen.violations[0].starts_with("job 5 "), "{seen:?}");
    let late = log(&[
        ("L", 2, 0),
        ("L", 1, s),
        ("B", 7, 3 * s),
        ("N", 8, 4 * s),
        ("S", 3, 4 * s + 1000),
        ("S", 4, 4 * s + 2000),
    ]);
    assert_eq!(
        check_jobs(&late).violations.len(),
        1,
        "{:?}",
        check_jobs(&late)
    );
    // A raise counts at once.
    let raised = log(&[("L", 1, 0), ("S", 1, s), ("L", 2, 2 * s), ("S", 2, 2 * s)]);
    assert_eq!(check_jobs(&raised).violations.len(), 0);
    // 3 -> 1 with the books still over the limit once the jobs running at
    // the change have ended (a `fifo` build reusing a token it wrote
    // back): up to the old limit may run until the books say drained, and
    // not one more; after that, the new limit.
    let books = log(&[
        ("L", 3, 0),
        ("S", 1, s),
        ("S", 2, s),
        ("L", 1, 2 * s),
        ("O", 1, 2 * s + 1000),
        ("E", 1, 3 * s),
        ("E", 2, 3 * s),
        ("S", 3, 4 * s),
        ("S", 4, 4 * s),
        ("S", 5, 4 * s),
        ("S", 6, 4 * s),
        ("E", 3, 5 * s),
        ("E", 4, 5 * s),
        ("E", 5, 5 * s),
        ("E", 6, 5 * s),
        ("O", 0, 6 * s),
        ("S", 7, 7 * s),
        ("S", 8, 7 * s),
    ]);
    let seen = check_jobs(&books);
    assert_eq!(seen.violations.len(), 2, "{seen:?}");
    assert!(seen.violations[0].starts_with("job 6 "), "{seen:?}");
    assert!(seen.violations[1].starts_with("job 8 "), "{seen:?}");
}
