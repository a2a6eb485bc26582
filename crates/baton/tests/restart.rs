//! A broker replaced in place (`baton serve --replace`) while builds of
//! every style run under it: real make 4.3 (pipe), make 4.4.1 (FUSE file
//! and FIFO) and ninja 1.13 (FIFO), a real FUSE mount, real processes.

mod common;

use baton_core::status::Status;
use common::*;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// One build of each style, each in its own directory with its own log of
/// job starts and ends. Every job waits for the gate file before it ends,
/// so that the test decides when tokens move: until then, each build holds
/// exactly its first job's token and waits for a second.
struct Builds {
    dirs: Vec<TempDir>,
    children: Vec<Guarded>,
    gate: PathBuf,
}

const JOBS: usize = 8;

impl Builds {
    /// Starts the four builds so that each gets exactly one token: the
    /// test holds the whole pool until all four `baton run`s wait for
    /// their first, then lets go, and the pool serves them in turn.
    fn start(broker: &RunningBroker) -> Self {
        let mut pool = broker.client("the test, holding the pool");
        pool.acquire(4).unwrap();
        let builds = Self::spawn(broker);
        wait_for_status(
            broker,
            "the four builds to wait for their first token",
            |s| s.waiters.len() == 4,
        );
        pool.release(4).unwrap();
        builds
    }

    fn spawn(broker: &RunningBroker) -> Self {
        let gate = broker.dir.path().join("gate");
        // Orphaned by a failed test, a job still ends when the test's
        // directory goes.
        let job = format!(
            "0.1; while [ ! -e {} ] && [ -d {} ]; do sleep 0.05; done",
            gate.display(),
            broker.dir.path().display()
        );
        let make44 = make44();
        let styles: [(&str, PathBuf, bool); 4] = [
            ("pipe", make43(), false),
            ("fuse", make44.clone(), false),
            ("fifo", make44, false),
            ("fifo", ninja(), true),
        ];
        let mut dirs = Vec::new();
        let mut children = Vec::new();
        for (style, tool, is_ninja) in styles {
            let dir = TempDir::new(&format!("restart-{style}"));
            let log = dir.path().join("jobs.log");
            if is_ninja {
                flat_ninja(dir.path(), &log, JOBS, &job);
            } else {
                flat_makefile(dir.path(), &log, JOBS, &job);
            }
            let child = broker
                .run(&["--jobserver-style", style, "--", tool.to_str().unwrap()])
                .current_dir(dir.path())
                .env_remove("MAKEFLAGS")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn_guarded()
                .expect("start a build");
            dirs.push(dir);
            children.push(child);
        }
        Builds {
            dirs,
            children,
            gate,
        }
    }

    /// Lets every job end, and the builds go on.
    fn open_gate(&self) {
        std::fs::write(&self.gate, "").unwrap();
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dirs[i].path().join("jobs.log")
    }

    fn every_build_has_started_a_job(&self) -> bool {
        (0..self.dirs.len()).all(|i| max_overlap(&self.log(i)).1 > 0)
    }

    /// Every build runs one job on its first token and waits for one more:
    /// every token is held, and four requests wait.
    fn wait_until_saturated(&self, broker: &RunningBroker) -> Status {
        wait_for_status(
            broker,
            "every build to run a job and wait for another",
            |s| self.every_build_has_started_a_job() && s.held == 4 && s.waiters.len() == 4,
        )
    }

    /// Waits for every build; each must succeed and have run every job.
    fn finish(&mut self) {
        let logs: Vec<PathBuf> = (0..self.dirs.len()).map(|i| self.log(i)).collect();
        for (i, child) in self.children.iter_mut().enumerate() {
            let status = wait_timeout(child, Duration::from_secs(120)).expect("the build ends");
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            assert!(status.success(), "build {i} failed ({status}): {err}");
            assert_eq!(
                max_overlap(&logs[i]).1,
                JOBS,
                "build {i} ran every job: {err}"
            );
        }
    }
}

/// Waits until the broker's status satisfies `cond`, and returns it;
/// fails after a minute, showing the last status and the broker's log.
fn wait_for_status(
    broker: &RunningBroker,
    what: &str,
    mut cond: impl FnMut(&Status) -> bool,
) -> Status {
    let started = std::time::Instant::now();
    loop {
        let s = broker.status();
        if cond(&s) {
            return s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}: {s:#?}\n{}",
            broker.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A test that failed half-way leaves no build behind: the gate opens and
/// every `baton run` we started is killed (its command follows it).
impl Drop for Builds {
    fn drop(&mut self) {
        self.open_gate();
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The successor: `baton serve --replace` with the same options.
fn replace(broker: &RunningBroker) -> Successor {
    replace_with(broker, 4)
}

fn replace_with(broker: &RunningBroker, jobs: u32) -> Successor {
    let log = std::fs::File::create(broker.dir.path().join("successor.log")).unwrap();
    Successor(
        broker
            .successor(jobs, &[])
            .stderr(log)
            .spawn_guarded()
            .expect("start the successor"),
    )
}

/// The successor broker; a test that fails half-way stops it too.
struct Successor(Guarded);

impl Successor {
    fn id(&self) -> u32 {
        self.0.id()
    }

    /// SIGTERM, and its exit status.
    fn stop(&mut self) -> std::process::ExitStatus {
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        wait_timeout(&mut self.0, Duration::from_secs(30)).expect("the successor stops")
    }
}

impl Drop for Successor {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            self.stop();
        }
    }
}

fn successor_log(broker: &RunningBroker) -> String {
    std::fs::read_to_string(broker.dir.path().join("successor.log")).unwrap_or_default()
}

fn is_mounted(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(1) == Some(path.to_str().unwrap()))
}

/// A broker of 4 tokens with its FUSE mount, and the four builds holding
/// all of them (and the status then); None, recorded as a skip, where FUSE
/// is not available.
fn four_builds_holding_the_pool() -> Option<(RunningBroker, PathBuf, Builds, Status)> {
    let broker = RunningBroker::start(4);
    let mount = broker.socket.with_file_name("fuse");
    if !is_mounted(&mount) {
        skip(
            Missing::Fuse,
            &format!("FUSE is not available here: {}", broker.log()),
        );
        return None;
    }
    let builds = Builds::start(&broker);
    let saturated = builds.wait_until_saturated(&broker);
    Some((broker, mount, builds, saturated))
}

#[test]
fn builds_of_every_style_go_on_through_a_replace() {
    let Some((mut broker, mount, mut builds, before)) = four_builds_holding_the_pool() else {
        return;
    };

    let mut successor = replace(&broker);
    let status = broker.wait_exit(Duration::from_secs(30));
    assert!(
        status.success(),
        "the predecessor hands over and exits 0: {}",
        broker.log()
    );
    assert!(
        broker.log().contains("handed over to a successor"),
        "{}",
        broker.log()
    );
    wait_for(
        Duration::from_secs(30),
        "the successor to take over",
        || successor_log(&broker).contains("took over"),
    );
    let after = broker.status();
    assert_eq!(
        after.broker_pid,
        successor.id(),
        "the successor answers on the same socket"
    );
    // Nothing moved: the same clients hold the same tokens, and the same
    // requests wait in the same order.
    assert_eq!(after.holders, before.holders, "{}", successor_log(&broker));
    assert_eq!(after.waiters, before.waiters, "{}", successor_log(&broker));
    assert_eq!((after.limit, after.free, after.held), (4, 0, 4));
    assert_eq!(after.totals, before.totals, "the pool came with its books");

    builds.open_gate();
    builds.finish();
    let s = broker.status();
    assert_eq!(
        (s.free, s.held),
        (s.limit, 0),
        "every token is back: {s:#?}\n{}",
        successor_log(&broker)
    );
    // A FUSE make may exit with a token reserved for its last poll (it is
    // reclaimed then, as without a replace); no connection may break.
    assert!(
        !successor_log(&broker).contains("its connection closed"),
        "no connection broke: {s:#?}\n{}",
        successor_log(&broker)
    );

    let status = successor.stop();
    assert!(status.success(), "{}", successor_log(&broker));
    assert!(
        !is_mounted(&mount),
        "the successor unmounts as it stops: {}",
        successor_log(&broker)
    );
    // The socket came with the state, and is the successor's to remove: a
    // file left behind would look like a broker that died.
    assert!(
        !broker.socket.exists(),
        "the successor removes its socket as it stops: {}",
        successor_log(&broker)
    );
}

#[test]
fn builds_of_every_style_survive_a_crash_and_re_attach_to_a_new_broker() {
    let Some((mut broker, mount, mut builds, _)) = four_builds_holding_the_pool() else {
        return;
    };

    let (status, log) = broker.stop_with(libc::SIGKILL);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{log}");
    // The scenario: a new broker two seconds later.
    std::thread::sleep(Duration::from_secs(2));
    let mut restarted = RunningBroker::start_at(&broker, 4, &[]);
    // Every `baton run` comes back and says what it holds; the pool may
    // drain meanwhile (a build re-attached early took a free token that
    // a later one turns out to hold already).
    wait_for_status(&restarted, "the four builds to re-attach", |s| {
        s.builds
            .iter()
            .filter(|b| b.name.starts_with("baton run") && b.held >= 1)
            .count()
            == 4
    });

    builds.open_gate();
    builds.finish();
    let s = restarted.status();
    assert_eq!(
        (s.free, s.held),
        (s.limit, 0),
        "every token is back: {s:#?}\n{}",
        restarted.log()
    );
    restarted.stop_with(libc::SIGTERM);
    assert!(!is_mounted(&mount), "no mount is left: {}", restarted.log());
}

/// A build's job that runs until the test opens its gate, stamping when
/// it ends, and a newcomer's that stamps when it starts: the newcomer
/// must not start before the job ends.
struct Stamps {
    dir: TempDir,
    gate: PathBuf,
    a_end: PathBuf,
    b_start: PathBuf,
}

impl Stamps {
    fn new(name: &str) -> Self {
        let dir = TempDir::new(name);
        let at = |f: &str| dir.path().join(f);
        let (gate, a_end, b_start) = (at("gate"), at("a_end"), at("b_start"));
        Stamps {
            dir,
            gate,
            a_end,
            b_start,
        }
    }

    /// The held job. Orphaned by a failed test, it still ends when the
    /// test's directory goes.
    fn holder(&self) -> String {
        format!(
            "while [ ! -e {} ] && [ -d {} ]; do sleep 0.05; done; date +%s%N > {}",
            self.gate.display(),
            self.dir.path().display(),
            self.a_end.display()
        )
    }

    /// A stamp's time, in nanoseconds.
    fn read(stamp: &Path) -> u128 {
        let text = std::fs::read_to_string(stamp).unwrap();
        text.trim().parse().unwrap()
    }
}

/// A broker replaced while the builds of a dead one re-attach: the
/// successor keeps what is left of the grace, so a newcomer still waits
/// for the tokens a build not yet re-attached runs its job on. (The soak
/// found a newcomer run beside such a build when a replacement came
/// 160 ms after a restart: the grace did not travel.)
#[test]
fn a_broker_replaced_during_its_reclaim_grace_keeps_it() {
    let mut broker = RunningBroker::start(1);
    let stamps = Stamps::new("regrace");
    let (gate, a_end, b_start) = (&stamps.gate, &stamps.a_end, &stamps.b_start);
    let holder = stamps.holder();
    let mut a = broker
        .run(&["--", "sh", "-c", &holder])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn_guarded()
        .unwrap();
    wait_for_status(&broker, "the build to hold the token", |s| s.held == 1);
    // Its `baton run` cannot re-attach until it is let go on; its job
    // runs on.
    unsafe { libc::kill(a.id() as i32, libc::SIGSTOP) };
    broker.stop_with(libc::SIGKILL);

    let restarted = RunningBroker::start_at(&broker, 1, &["--reclaim-grace", "8000"]);
    let successor = replace_with(&restarted, 1);
    wait_for_status(&restarted, "the successor to answer", |s| {
        s.broker_pid == successor.id()
    });
    let newcomer = format!("date +%s%N > {}", b_start.display());
    let mut b = restarted
        .run(&["--", "sh", "-c", &newcomer])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn_guarded()
        .unwrap();
    let s = wait_for_status(&restarted, "the newcomer to wait", |s| {
        assert!(
            !b_start.exists(),
            "the successor granted in the grace: {s:#?}"
        );
        s.waiters.len() == 1
    });
    assert!(
        s.gates.iter().any(|g| g.name == "reclaim" && !g.open),
        "the successor keeps the grace: {s:#?}\n{}",
        successor_log(&restarted)
    );
    unsafe { libc::kill(a.id() as i32, libc::SIGCONT) };
    wait_for_status(
        &restarted,
        "the build to re-attach while the newcomer waits",
        |s| {
            assert!(
                !b_start.exists(),
                "the newcomer ran beside the build's job: {s:#?}\n{}",
                successor_log(&restarted)
            );
            s.held == 1 && s.waiters.len() == 1
        },
    );
    std::fs::write(gate, "").unwrap();
    assert!(a.wait().unwrap().success());
    // The grace ends in the successor too: a successor that kept it for
    // good never granted the newcomer, and this test used to hang here.
    let granted = wait_timeout(&mut b, Duration::from_secs(60));
    assert!(
        granted.is_some_and(|s| s.success()),
        "the newcomer was not served once the grace was over: {:#?}\n{}",
        restarted.status(),
        successor_log(&restarted)
    );
    let read = Stamps::read;
    assert!(
        read(b_start) >= read(a_end),
        "the newcomer ran beside the build's job"
    );
    wait_for_status(&restarted, "every token back", |s| {
        (s.free, s.held) == (1, 0)
    });
}

/// A broker killed while a build holds every token leaves its socket
/// behind. The next one there grants nothing new until that build has
/// re-attached and said what it holds, so a newcomer waits for those
/// tokens instead of running beside them past the limit.
#[test]
fn a_broker_where_one_died_grants_nothing_new_before_its_builds_re_attach() {
    let mut broker = RunningBroker::start(2);
    let stamps = Stamps::new("reclaim");
    let (gate, a_end, b_start) = (&stamps.gate, &stamps.a_end, &stamps.b_start);
    let holder = stamps.holder();
    let mut a = broker
        .run(&["--tokens", "2", "--", "sh", "-c", &holder])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn_guarded()
        .unwrap();
    wait_for_status(&broker, "the build to hold both tokens", |s| s.held == 2);
    broker.stop_with(libc::SIGKILL);

    // Long enough for the build to re-attach on a loaded machine; the
    // newcomer then waits for the build's tokens, not for the grace.
    let restarted = RunningBroker::start_at(&broker, 2, &["--reclaim-grace", "5000"]);
    let newcomer = format!("date +%s%N > {}", b_start.display());
    let mut b = restarted
        .run(&["--", "sh", "-c", &newcomer])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn_guarded()
        .unwrap();
    let s = wait_for_status(
        &restarted,
        "the build to re-attach with both tokens while the newcomer waits",
        |s| {
            assert!(
                !b_start.exists(),
                "the newcomer ran while the build still held every token: {s:#?}\n{}",
                restarted.log()
            );
            s.held == 2 && s.waiters.len() == 1
        },
    );
    assert!(
        s.gates.iter().any(|g| g.name == "reclaim" && !g.open),
        "the grace shows in the status: {s:#?}"
    );
    assert!(
        restarted.log().contains("a broker died at"),
        "{}",
        restarted.log()
    );

    std::fs::write(gate, "").unwrap();
    assert!(a.wait().unwrap().success());
    assert!(b.wait().unwrap().success());
    let read = Stamps::read;
    assert!(
        read(b_start) >= read(a_end),
        "the newcomer ran while the build still held every token"
    );
    let s = restarted.status();
    assert_eq!((s.free, s.held), (2, 0), "every token is back: {s:#?}");
    assert!(
        s.gates.iter().all(|g| g.name != "reclaim"),
        "the grace ended: {s:#?}"
    );
    assert!(
        restarted.log().contains("re-attach time over: 2 token(s)"),
        "{}",
        restarted.log()
    );
}

#[test]
fn a_broker_whose_successor_goes_away_serves_on() {
    let broker = RunningBroker::start(2);
    let mount = broker.socket.with_file_name("fuse");
    if !is_mounted(&mount) {
        return skip(
            Missing::Fuse,
            &format!("FUSE is not available here: {}", broker.log()),
        );
    }
    let mut holder = broker.client("holds a token through it");
    holder.acquire(1).unwrap();
    // A successor that reads the state and leaves without confirming.
    let mut successor =
        std::os::unix::net::UnixStream::connect(broker.socket.with_file_name("socket.handover"))
            .unwrap();
    let mut header = [0u8; 16];
    std::io::Read::read_exact(&mut successor, &mut header).unwrap();
    drop(successor);
    wait_for(Duration::from_secs(30), "the broker to serve on", || {
        broker.log().contains("serving on")
    });

    // The same broker, with the same client and its token...
    let s = broker.status();
    assert_eq!((s.broker_pid, s.held), (broker.pid(), 1), "{s:#?}");
    holder.release(1).unwrap();
    // ...and its FUSE thread answering again: a read takes a token.
    let file = mount.join("after-a-failed-handover");
    let reader = std::thread::spawn(move || {
        let mut tokens = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&file)
            .unwrap();
        let mut byte = [0u8];
        std::io::Read::read_exact(&mut tokens, &mut byte).unwrap();
        tokens
    });
    let mut tokens = join_within(
        reader,
        Duration::from_secs(30),
        "a token read from the FUSE file",
    );
    assert_eq!(broker.status().held, 1);
    std::io::Write::write_all(&mut tokens, b"+").unwrap();
    drop(tokens);
    broker.assert_all_free();
}

/// A line read in part, a waiting ACQUIRE and a queue's order all cross a
/// replace: the clients are raw connections that know nothing of it.
#[test]
fn a_half_read_line_and_a_waiting_acquire_cross_a_replace() {
    use std::io::{BufRead, BufReader, Write};
    let mut broker = RunningBroker::start(1);
    let mut holder = broker.client("holds the only token");
    holder.acquire(1).unwrap();
    let connect = |label: &str| {
        let stream = hello_as(&broker.socket, label);
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let reader = BufReader::new(stream.try_clone().unwrap());
        (stream, reader)
    };
    let (first, mut first_replies) = connect("first");
    (&first).write_all(b"ACQUIRE 1\n").unwrap();
    wait_for_status(&broker, "the first to wait", |s| s.waiters.len() == 1);
    let (second, mut second_replies) = connect("second");
    (&second).write_all(b"ACQUIRE 1\n").unwrap();
    wait_for_status(&broker, "the second to wait", |s| s.waiters.len() == 2);
    let (mut partial, mut partial_replies) = connect("partial");
    partial.write_all(b"TR").unwrap();
    let before = broker.status();

    let mut successor = replace_with(&broker, 1);
    broker.wait_exit(Duration::from_secs(30));
    wait_for(
        Duration::from_secs(30),
        "the successor to take over",
        || successor_log(&broker).contains("took over"),
    );
    assert_eq!(
        broker.status().waiters,
        before.waiters,
        "the queue came in order"
    );

    partial.write_all(b"Y 1\n").unwrap();
    let mut line = String::new();
    partial_replies.read_line(&mut line).unwrap();
    assert_eq!(
        line, "BUSY 0\n",
        "the line begun before the replace is read whole"
    );
    holder.release(1).unwrap();
    line.clear();
    first_replies.read_line(&mut line).unwrap();
    assert_eq!(line, "GRANTED 1 1\n", "the oldest waiter is served first");
    (&first).write_all(b"RELEASE 1\n").unwrap();
    line.clear();
    second_replies.read_line(&mut line).unwrap();
    assert_eq!(line, "GRANTED 1 1\n", "then the next");
    drop((
        first,
        second,
        partial,
        first_replies,
        second_replies,
        partial_replies,
    ));
    drop(holder);
    wait_for_status(&broker, "every token back", |s| s.free == 1 && s.held == 0);
    successor.stop();
}
