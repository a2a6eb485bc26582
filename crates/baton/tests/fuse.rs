//! The FUSE token file (docs/fuse.md) against the real binary, real FUSE, GNU
//! make 4.4.1 and cargo.
//!
//! Where FUSE cannot be mounted every test here records a skip
//! (`common::skip`): scripts/test counts it, and fails on CI, which has FUSE.

mod common;

use common::{
    file_of_a_killed_build, kill_group, logged_job, make44, max_overlap, pid_alive, wait_for,
    RunningBroker, SpawnGuarded, TempDir,
};
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A broker with its FUSE mount, or None (after recording a skip) where
/// FUSE is not available.
pub fn fuse_broker(jobs: u32, extra: &[&str]) -> Option<RunningBroker> {
    let broker = RunningBroker::start_with(jobs, extra);
    if is_fuse(&mount_point(&broker)) {
        return Some(broker);
    }
    // A broker that could mount and did not is a failure, not a skip.
    assert!(
        !common::fuse_should_mount(),
        "the broker did not mount its token files: {}",
        broker.log()
    );
    common::skip(
        common::Missing::Fuse,
        &format!("FUSE is not available here: {}", broker.log()),
    );
    None
}

pub fn mount_point(broker: &RunningBroker) -> PathBuf {
    broker.socket.parent().unwrap().join("fuse")
}

fn is_fuse(path: &Path) -> bool {
    const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(cpath.as_ptr(), &mut fs) == 0 && fs.f_type as i64 == FUSE_SUPER_MAGIC }
}

/// A token file in the broker's mount, as `baton run` makes one per build.
pub fn token_file(broker: &RunningBroker, name: &str) -> PathBuf {
    let path = mount_point(broker).join(name);
    File::create(&path).expect("create a token file");
    path
}

/// `baton run --jobserver-style fuse -- make` (4.4.1) in `dir`, in its own
/// process group so a test can kill the whole tree.
pub fn make_via_fuse(broker: &RunningBroker, dir: &Path, makefile: &str) -> Command {
    let make = make44();
    let mut cmd = broker.run(&[
        "--jobserver-style",
        "fuse",
        "--",
        make.to_str().unwrap(),
        "-s",
        "--no-print-directory",
        "-f",
        makefile,
    ]);
    cmd.current_dir(dir)
        .env_remove("MAKEFLAGS")
        .process_group(0);
    cmd
}

/// The tree of the issue: top → `fanout` sub-makes → `fanout` each →
/// `jobs` logged jobs each, in `dir/top.mk`.
pub fn make_tree(dir: &Path, log: &Path, fanout: usize, jobs: usize, secs: &str) {
    let level = |name: &str, sub: &str, n: usize| {
        let targets: Vec<String> = (0..n).map(|i| format!("t{i}")).collect();
        let text = format!(
            "all: {all}\n{all}:\n\t@$(MAKE) -f {sub}\n.PHONY: all {all}\n",
            all = targets.join(" ")
        );
        std::fs::write(dir.join(name), text).unwrap();
    };
    level("top.mk", "mid.mk", fanout);
    level("mid.mk", "leaf.mk", fanout);
    let targets: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
    let leaf = format!(
        "all: {all}\n{all}:\n\t@{job}\n.PHONY: all {all}\n",
        all = targets.join(" "),
        job = logged_job(log, secs)
    );
    std::fs::write(dir.join("leaf.mk"), leaf).unwrap();
}

fn read_token(f: &mut File) -> std::io::Result<()> {
    let mut byte = [0u8];
    match f.read(&mut byte)? {
        1 => Ok(()),
        n => panic!("read {n} bytes, expected 1"),
    }
}

fn open_nonblocking(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .unwrap()
}

#[test]
fn read_takes_a_token_write_gives_it_back_and_status_shows_the_process() {
    let Some(broker) = fuse_broker(2, &[]) else {
        return;
    };
    let path = token_file(&broker, "basic");
    let mut file = open_nonblocking(&path);
    read_token(&mut file).unwrap();
    read_token(&mut file).unwrap();
    let err = read_token(&mut file).unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::WouldBlock,
        "no token left: EAGAIN, got {err}"
    );

    let s = broker.status();
    assert_eq!((s.free, s.held), (0, 2));
    let me = std::process::id();
    assert!(
        s.holders
            .iter()
            .any(|h| h.pid == me && h.tokens == 2 && h.transport == "fuse"),
        "{s:#?}"
    );

    // Another handle of the same process gives back what this one took.
    let mut writer = OpenOptions::new().write(true).open(&path).unwrap();
    writer.write_all(b"++").unwrap();
    let err = writer.write(b"+").unwrap_err();
    assert_eq!(
        err.raw_os_error(),
        Some(libc::ENOSPC),
        "gave back more than taken: {err}"
    );
    broker.assert_all_free();
}

/// A token file whose polls the broker holds (docs/fuse.md, "Held polls"),
/// as `baton run` marks a GNU make build's.
fn held_token_file(broker: &RunningBroker, name: &str) -> PathBuf {
    let path = token_file(broker, name);
    baton_client::hold_polls(&path).expect("mark the token file hold");
    path
}

#[test]
fn a_freed_token_wakes_exactly_one_poller() {
    // Room for all four to wait: a process waits for at most the limit.
    let Some(broker) = fuse_broker(4, &[]) else {
        return;
    };
    one_poller_per_freed_token(&broker, &token_file(&broker, "pollers"));
}

/// Held for ten minutes: each poll is answered only when a token is
/// reserved for it.
#[test]
fn a_freed_token_answers_exactly_one_held_poll() {
    let Some(broker) = fuse_broker(4, &["--fuse-hold-ms", "600000"]) else {
        return;
    };
    one_poller_per_freed_token(&broker, &held_token_file(&broker, "held"));
}

/// Held for 1 ms: each poll is answered "not ready" long before its token
/// comes, and its poller must still be woken, once.
#[test]
fn a_poll_held_past_its_time_is_still_woken_by_its_token() {
    let Some(broker) = fuse_broker(4, &["--fuse-hold-ms", "1"]) else {
        return;
    };
    one_poller_per_freed_token(&broker, &held_token_file(&broker, "expired"));
}

fn one_poller_per_freed_token(broker: &RunningBroker, path: &Path) {
    let mut holder = broker.client("holder");
    holder.acquire(4).unwrap();

    // Each poller reports whether poll() woke it and whether its read then
    // got a token, and keeps that token until told to give it back.
    let (report_tx, reports) = std::sync::mpsc::channel();
    let (give_back, give_back_rx) = std::sync::mpsc::channel::<()>();
    let give_back_rx = std::sync::Arc::new(std::sync::Mutex::new(give_back_rx));
    let pollers: Vec<_> = (0..4)
        .map(|_| {
            let (path, report_tx, give_back_rx) =
                (path.to_path_buf(), report_tx.clone(), give_back_rx.clone());
            std::thread::spawn(move || {
                let mut file = open_nonblocking(&path);
                let mut fd = libc::pollfd {
                    fd: file.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // A long timeout: only a hang guard.
                let woken = unsafe { libc::poll(&mut fd, 1, 60_000) } == 1;
                let got = woken && read_token(&mut file).is_ok();
                report_tx.send((woken, got)).unwrap();
                if got {
                    give_back_rx.lock().unwrap().recv().unwrap();
                    file.write_all(b"+").unwrap();
                }
            })
        })
        .collect();
    wait_for(Duration::from_secs(10), "4 pollers waiting", || {
        broker.status().waiters.len() == 4
    });
    // One token at a time: each wakes one poller, which takes it; the
    // others still sleep in poll(), still counted as waiting.
    for freed in 1..=4 {
        holder.release(1).unwrap();
        let report = reports
            .recv_timeout(Duration::from_secs(60))
            .expect("a poller woken");
        assert_eq!(
            report,
            (true, true),
            "token {freed}: a poller was woken without a token"
        );
        wait_for(
            Duration::from_secs(10),
            "the woken poller to stop waiting",
            || broker.status().waiters.len() == 4 - freed,
        );
        assert!(
            reports.try_recv().is_err(),
            "token {freed} woke a second poller"
        );
    }
    (0..4).for_each(|_| give_back.send(()).unwrap());
    pollers.into_iter().for_each(|t| t.join().unwrap());
    assert!(
        reports.try_recv().is_err(),
        "a poller was woken for nothing"
    );
    broker.assert_all_free();
}

/// A held poll sees nothing else until it is answered: a signal must end
/// it at once, as it ends a poll of a pipe (make's SIGCHLD does, every
/// job). Held for ten minutes, only the kernel's interrupt can end it
/// within the test.
#[test]
fn a_held_poll_ends_at_once_on_a_signal_and_keeps_its_place() {
    let Some(broker) = fuse_broker(1, &["--fuse-hold-ms", "600000"]) else {
        return;
    };
    let path = held_token_file(&broker, "signalled");
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    // PEP 475 retries a poll a signal interrupts, unless the handler raises.
    let script = "import os, select, signal, sys\n\
        class Interrupted(Exception): pass\n\
        def stop(*_): raise Interrupted\n\
        signal.signal(signal.SIGUSR1, stop)\n\
        fd = os.open(sys.argv[1], os.O_RDWR | os.O_NONBLOCK)\n\
        p = select.poll()\n\
        p.register(fd, select.POLLIN)\n\
        try:\n    p.poll()\n    print('woken')\n\
        except Interrupted:\n    print('interrupted')\n\
        sys.stdout.flush()\n\
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)\n\
        print('polls again:', p.poll()[0][1] & select.POLLIN != 0, flush=True)\n\
        os.read(fd, 1)\n\
        os.write(fd, b'+')\n";
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&path)
        .stdout(std::process::Stdio::piped())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the poll to wait", || {
        broker.status().waiters.len() == 1
    });
    unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    let lines = lines_of(child.stdout.take().unwrap());
    // A hang guard only: without the interrupt the poll waits ten minutes.
    let first = lines.recv_timeout(Duration::from_secs(60));
    if first.is_err() {
        let _ = child.kill();
    }
    assert_eq!(
        first.as_deref().map(str::trim),
        Ok("interrupted"),
        "the held poll did not end on SIGUSR1"
    );
    // It polls again, still first in the queue: the token it gets is the
    // one the holder frees.
    wait_for(Duration::from_secs(10), "the second poll to wait", || {
        broker.status().waiters.len() == 1
    });
    holder.release(1).unwrap();
    let second = lines.recv_timeout(Duration::from_secs(60));
    let status = common::wait_timeout(&mut child, Duration::from_secs(60));
    if status.is_none() {
        let _ = child.kill();
    }
    assert_eq!(
        second.as_deref().map(str::trim),
        Ok("polls again: True"),
        "the second poll was never answered"
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "the poller failed after its poll: {status:?}"
    );
    broker.assert_all_free();
}

/// The lines a child writes, as they come.
fn lines_of(out: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(out)).map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// `baton run` marks the file of a build that polls it alone (GNU make,
/// cargo) `hold`, and leaves any other command's at `notify`.
#[test]
fn baton_run_marks_a_make_builds_file_hold_and_another_commands_notify() {
    let Some(broker) = fuse_broker(2, &[]) else {
        return;
    };
    let dir = TempDir::new("fuse-marks");
    let show = r#"python3 -c 'import os, re; p = re.search(r"fifo:(\S+)", os.environ["MAKEFLAGS"]).group(1); print(os.getxattr(p, "user.baton.polls").decode())'"#;
    std::fs::write(
        dir.path().join("Makefile"),
        format!(
            "all:
	@{show}
"
        ),
    )
    .unwrap();
    let make = make44();
    let runs = [
        broker
            .run(&[
                "--jobserver-style",
                "fuse",
                "--",
                make.to_str().unwrap(),
                "-s",
            ])
            .current_dir(dir.path())
            .env_remove("MAKEFLAGS")
            .output()
            .unwrap(),
        broker
            .run(&["--jobserver-style", "fuse", "--", "sh", "-c", show])
            .env_remove("MAKEFLAGS")
            .output()
            .unwrap(),
    ];
    let said: Vec<String> = runs
        .iter()
        .map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout).trim(),
                String::from_utf8_lossy(&o.stderr).trim()
            )
        })
        .collect();
    assert_eq!(said, ["hold", "notify"]);
    broker.assert_all_free();
}

/// `auto` gives make ≥ 4.4 the file only from 32 tokens: below, a FIFO's
/// herd costs less than the file's round trips (docs/jobserver.md); with
/// `--max`, or from a broker without the mount, the FIFO as well. Its
/// `--explain` says which of the three kept the file away.
#[test]
fn auto_gives_make_4_4_the_file_from_32_tokens_and_the_fifo_below() {
    let (fifo, fuse) = (
        "fifo (fifo:PATH)",
        "fuse (fifo:PATH on the broker's FUSE mount)",
    );
    let (max, no_mount) = (["--max", "2"], ["--no-fuse"]);
    for (jobs, serve, run, form, not_fuse) in [
        (16, &[][..], &[][..], fifo, Some("16 tokens: below 32")),
        (32, &[], &[], fuse, None),
        (32, &[], &max, fifo, Some("--max needs the bridge")),
        (
            32,
            &no_mount,
            &[],
            fifo,
            Some("the broker has no FUSE mount"),
        ),
    ] {
        let broker = if serve.is_empty() {
            let Some(broker) = fuse_broker(jobs, &[]) else {
                return;
            };
            broker
        } else {
            RunningBroker::start_with(jobs, serve)
        };
        let dir = TempDir::new("auto-size");
        std::fs::write(dir.path().join("Makefile"), "all:\n\t@true\n").unwrap();
        let make = make44();
        let mut args = vec!["--explain"];
        args.extend(run);
        args.extend(["--", make.to_str().unwrap(), "-s"]);
        // No reader of R,W only in sight: make 4.4.1 is $MAKE, and no cc.
        let out = broker
            .run(&args)
            .current_dir(dir.path())
            .env_remove("MAKEFLAGS")
            .env("MAKE", &make)
            .env("CC", "/nonexistent/cc")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains(&format!("jobserver: {form} (auto)")),
            "{jobs} tokens: {err}"
        );
        match not_fuse {
            Some(why) => assert!(err.contains(&format!("  not fuse: {why}")), "{err}"),
            None => assert!(!err.contains("not fuse"), "{err}"),
        }
        broker.assert_all_free();
    }
}

#[test]
fn a_poller_that_closes_its_file_stops_waiting() {
    let Some(broker) = fuse_broker(1, &[]) else {
        return;
    };
    let path = token_file(&broker, "quitter");
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    let file = open_nonblocking(&path);
    let mut fd = libc::pollfd {
        fd: file.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // A short poll: it returns with nothing, and leaves the wait queued.
    assert_eq!(unsafe { libc::poll(&mut fd, 1, 10) }, 0);
    assert_eq!(
        broker.status().waiters.len(),
        1,
        "the poll queued for a token"
    );
    drop(file);
    wait_for(
        Duration::from_secs(20),
        "the closed poller's wait to go",
        || broker.status().waiters.is_empty(),
    );
    holder.release(1).unwrap();
    broker.assert_all_free();
}

#[test]
fn a_blocked_reader_gets_the_token_a_socket_client_frees() {
    let Some(broker) = fuse_broker(1, &[]) else {
        return;
    };
    let path = token_file(&broker, "blocking");
    let path_back = path.clone();
    let mut holder = broker.client("holder");
    holder.acquire(1).unwrap();
    let reader = std::thread::spawn(move || {
        let mut file = File::open(&path).unwrap();
        read_token(&mut file).unwrap();
        file
    });
    wait_for(Duration::from_secs(10), "the reader to wait", || {
        broker.status().waiters.len() == 1
    });
    assert!(
        !reader.is_finished(),
        "the read returned with no token free"
    );
    holder.release(1).unwrap();
    drop(reader.join().unwrap());
    let s = broker.status();
    assert!(
        s.holders
            .iter()
            .any(|h| h.transport == "fuse" && h.tokens == 1),
        "the reader holds the token: {s:#?}"
    );
    OpenOptions::new()
        .write(true)
        .open(&path_back)
        .unwrap()
        .write_all(b"+")
        .unwrap();
    broker.assert_all_free();
}

#[test]
fn the_issue_tree_runs_all_5120_jobs_within_a_binding_limit_and_returns_every_token() {
    // A limit two cores reach: 512 would never bind here.
    let Some(broker) = fuse_broker(16, &[]) else {
        return;
    };
    let dir = TempDir::new("fuse-tree");
    let log = dir.path().join("jobs.log");
    make_tree(dir.path(), &log, 16, 20, "0.02");
    let status = make_via_fuse(&broker, dir.path(), "top.mk")
        .status()
        .unwrap();
    assert!(status.success(), "make failed: {status}");
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 16 * 16 * 20);
    assert!(max <= 16, "{max} jobs at once under a limit of 16");
    assert!(
        max >= 2,
        "the build ran in parallel (at most {max} at once)"
    );
    broker.assert_all_free();
    assert!(
        broker.status().totals.granted > 16,
        "the build did not take its tokens from the FUSE file"
    );
}

/// Pids of FUSE holders whose command contains `what`.
fn fuse_holders(broker: &RunningBroker, what: &str) -> Vec<u32> {
    broker
        .status()
        .holders
        .iter()
        .filter(|h| h.transport == "fuse" && h.command.contains(what))
        .map(|h| h.pid)
        .collect()
}

#[test]
fn killing_a_sub_make_or_the_whole_tree_returns_its_tokens() {
    let Some(broker) = fuse_broker(64, &[]) else {
        return;
    };
    let dir = TempDir::new("fuse-kill");
    let log = dir.path().join("jobs.log");
    make_tree(dir.path(), &log, 4, 8, "30");
    let mut make = make_via_fuse(&broker, dir.path(), "top.mk")
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(20), "leaf makes holding tokens", || {
        broker.status().free == 0
    });

    let victim = fuse_holders(&broker, "leaf.mk")[0];
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    wait_for(
        Duration::from_secs(20),
        "the killed sub-make's tokens",
        || !fuse_holders(&broker, "leaf.mk").contains(&victim),
    );
    assert!(!pid_alive(victim));
    assert!(
        broker.status().totals.reclaimed >= 1,
        "the sub-make's tokens were reclaimed"
    );

    kill_group(make.id());
    let _ = make.wait();
    // baton run is in the group too: the build's own slot comes back with it.
    wait_for(Duration::from_secs(20), "every token of the tree", || {
        broker.status().free == 64
    });
    broker.assert_all_free();
}

/// Files in the mount, but for ones the test made itself.
fn build_files(broker: &RunningBroker) -> Vec<PathBuf> {
    std::fs::read_dir(mount_point(broker))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect()
}

#[test]
fn the_token_file_of_a_killed_baton_run_is_swept_by_the_next() {
    let Some(broker) = fuse_broker(2, &[]) else {
        return;
    };
    let left = file_of_a_killed_build(&broker, "fuse", "its token file", || build_files(&broker));
    assert!(
        left.exists(),
        "kill -9 left nothing to sweep: the test proves nothing"
    );
    let other = token_file(&broker, "not-a-build");
    let out = broker
        .run(&["--jobserver-style", "fuse", "--", "true"])
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!left.exists(), "{left:?} outlived the next baton run");
    assert_eq!(
        build_files(&broker),
        vec![other],
        "only the file no baton run made is left"
    );
    broker.assert_all_free();
}

#[test]
fn a_cargo_build_through_the_fuse_file_completes_and_returns_every_token() {
    let Some(broker) = fuse_broker(4, &[]) else {
        return;
    };
    let dir = TempDir::new("fuse-cargo");
    let log = dir.path().join("jobs.log");
    common::cargo_workspace(dir.path(), &log, 4);
    let out = common::cargo_build(&broker, dir.path(), &["--jobserver-style", "fuse"]);
    assert!(
        out.status.success(),
        "cargo build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(max_overlap(&log).1, 4, "every build script ran");
    // cargo's process may be gone a moment before its last handle closes.
    wait_for(Duration::from_secs(20), "every token back", || {
        broker.status().free == 4
    });
    let s = broker.status();
    assert!(
        s.totals.granted > 1,
        "cargo took no token from the FUSE file: {s:#?}"
    );
    assert!(
        max_overlap(&log).0 >= 2,
        "cargo ran one build script at a time: it read no token"
    );
}

#[test]
fn a_killed_broker_leaves_a_stale_mount_that_the_next_one_clears() {
    let Some(mut broker) = fuse_broker(1, &[]) else {
        return;
    };
    let mount = mount_point(&broker);
    let socket = broker.socket.clone();
    // Its keeper killed too (it would keep the mount alive for the next
    // broker to serve: tests/restart.rs), the mount is dead.
    let children =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", broker.pid())).unwrap();
    let keeper: i32 = children
        .split_whitespace()
        .next()
        .expect("the broker has a keeper")
        .parse()
        .unwrap();
    broker.stop_with(libc::SIGKILL);
    unsafe { libc::kill(keeper, libc::SIGKILL) };
    let log = broker.dir.path().join("broker2.log");
    let mut second = common::baton()
        .args(["serve", "--jobs", "1", "--socket"])
        .arg(&socket)
        .stderr(File::create(&log).unwrap())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the second broker's mount", || {
        is_fuse(&mount) && std::fs::read_dir(&mount).is_ok()
    });
    unsafe { libc::kill(second.id() as i32, libc::SIGTERM) };
    second.wait().unwrap();
    assert!(!is_fuse(&mount), "still mounted after SIGTERM");
}

/// A process exiting while a helper thread waits in a read (the jobserver
/// crate's pattern) must not hang: the wait is answered, the process goes
/// and its token comes back.
#[test]
fn a_process_exiting_with_a_thread_blocked_in_a_read_exits_at_once() {
    let Some(broker) = fuse_broker(2, &[]) else {
        return;
    };
    let path = token_file(&broker, "helper");
    read_token(&mut File::open(&path).unwrap()).unwrap();
    // It exits when told to (a line on stdin), once the test has seen the
    // helper thread's read wait at the broker; the end of its stdin (the
    // child dropped by a failing test) ends it too.
    let script = "import os, sys, threading\n\
        p = sys.argv[1]\n\
        os.read(os.open(p, os.O_RDWR), 1)\n\
        threading.Thread(target=lambda: os.read(os.open(p, os.O_RDWR), 1), daemon=True).start()\n\
        sys.stdin.readline()\n\
        os._exit(0)\n";
    let mut child = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&path)
        .stdin(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(20), "the helper thread to wait", || {
        broker.status().waiters.len() == 1
    });
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"exit\n").unwrap();
    drop(stdin);
    let status = common::wait_timeout(&mut child, Duration::from_secs(30)).unwrap_or_else(|| {
        let _ = child.kill();
        panic!("the process hung on exit")
    });
    assert!(status.success());
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all(b"+")
        .unwrap();
    wait_for(Duration::from_secs(20), "every token back", || {
        broker.status().free == 2
    });
}

/// Where the broker cannot mount, `auto` must fall back to the FIFO bridge
/// and an explicit `fuse` must say what to do instead.
#[test]
fn without_a_mount_auto_falls_back_to_the_fifo_and_fuse_is_refused() {
    let broker = RunningBroker::start_with(4, &["--no-fuse"]);
    let dir = TempDir::new("no-fuse");
    let log = dir.path().join("jobs.log");
    common::flat_makefile(dir.path(), &log, 12, "0.05");
    let make = make44();
    // No reader of R,W only in view (gcc 12's lto-wrapper, the make 4.3
    // first on PATH would make auto pick the pipe): make 4.4.1 alone would
    // get the FUSE file.
    let out = broker
        .run(&["--", make.to_str().unwrap()])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .env("CC", "/bin/true")
        .env("MAKE", &make)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 12);
    assert!(
        (2..=4).contains(&max),
        "the FIFO bridge fed the build: {max} at once"
    );
    broker.assert_all_free();
    // The build was told about a FIFO: it did not merely run on its own.
    std::fs::write(
        dir.path().join("flags.mk"),
        "all:\n\t@echo \"$$MAKEFLAGS\"\n",
    )
    .unwrap();
    let out = broker
        .run(&["--", make.to_str().unwrap(), "-f", "flags.mk"])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .env("CC", "/bin/true")
        .env("MAKE", &make)
        .output()
        .unwrap();
    let flags = String::from_utf8_lossy(&out.stdout);
    assert!(
        flags.contains("--jobserver-auth=fifo:") && !flags.contains("/fuse/"),
        "auto gave {flags:?}"
    );

    let out = broker
        .run(&["--jobserver-style", "fuse", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("has no FUSE mount") && err.contains("--jobserver-style fifo"),
        "{err}"
    );
}

/// A broker that may not mount (here: run as `nobody`, who cannot open
/// /dev/fuse) says why, once, and serves everyone through the socket.
#[test]
fn a_broker_that_cannot_mount_says_why_once_and_serves_on() {
    if !common::can_act_as_another_user() {
        return;
    }
    let dir = TempDir::new("unprivileged");
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    let nobody = 65534;
    std::os::unix::fs::chown(&run_dir, Some(nobody), Some(nobody)).unwrap();
    let socket = run_dir.join("socket");
    let log = dir.path().join("broker.log");
    let mut serve = Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            common::baton_bin(),
            "serve",
            "--jobs",
            "2",
            "--socket",
        ])
        .arg(&socket)
        .stderr(File::create(&log).unwrap())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the broker to listen", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    // Its own user's build: root's would refuse a broker of uid 65534.
    let out = Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            common::baton_bin(),
            "run",
            "--socket",
        ])
        .arg(&socket)
        .args(["--", "true"])
        .env("HOME", &run_dir)
        .output()
        .unwrap();
    unsafe { libc::kill(serve.id() as i32, libc::SIGTERM) };
    assert!(serve.wait().unwrap().success());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches("no FUSE token files").count(), 1, "{text}");
    assert!(text.contains("builds will use the FIFO bridge"), "{text}");
}

/// The mount sits in the broker's private directory (0700), and the
/// mount itself is not shared with other users: either refuses them.
#[test]
fn a_second_user_is_refused_at_the_token_file() {
    let Some(broker) = fuse_broker(1, &[]) else {
        return;
    };
    if !common::can_act_as_another_user() {
        return;
    }
    let path = token_file(&broker, "private");
    let out = Command::new("setpriv")
        .args([
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            "head",
            "-c",
            "1",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success(), "nobody read a token");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Permission denied"), "{err}");
    let s = broker.status();
    assert!(s.holders.is_empty() && s.waiters.is_empty(), "{s:#?}");
    broker.assert_all_free();
}

/// A FUSE build whose broker is killed and never replaced ends once the
/// keeper's grace (`--fuse-orphan-grace`, 1 s here) runs out: its token
/// reads fail, and make stops, instead of waiting in the kernel for good
/// (it hung in D state before, #32).
#[test]
fn a_fuse_build_whose_broker_never_comes_back_ends_after_the_grace() {
    let Some(mut broker) = fuse_broker(2, &["--fuse-orphan-grace", "1"]) else {
        return;
    };
    let dir = TempDir::new("fuse-orphan");
    let log = dir.path().join("jobs.log");
    common::flat_makefile(dir.path(), &log, 40, "0.2");
    let mut child = make_via_fuse(&broker, dir.path(), "Makefile")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(30), "the build to run", || {
        max_overlap(&log).1 >= 2
    });
    broker.stop_with(libc::SIGKILL);
    let ended = common::wait_timeout(&mut child, Duration::from_secs(120));
    if ended.is_none() {
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        child.wait().unwrap();
    }
    assert!(ended.is_some(), "the build hung after its broker died");
    assert!(
        max_overlap(&log).1 < 40,
        "the build finished before it needed the dead broker: it proves nothing"
    );
}
