//! The GNU jobserver bridge with the real tools: Debian's make 4.3, PyPI's
//! make 4.4.1 and ninja 1.13, and the installed cargo, under one limit.

mod common;

use common::*;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

/// Runs `tool` in `dir` under `baton run`; returns its output.
fn build(
    broker: &RunningBroker,
    dir: &Path,
    run_args: &[&str],
    tool: &Path,
    tool_args: &[&str],
) -> Output {
    let mut args: Vec<&str> = run_args.to_vec();
    args.push("--");
    args.push(tool.to_str().unwrap());
    args.extend_from_slice(tool_args);
    broker
        .run(&args)
        .current_dir(dir)
        .env_remove("MAKEFLAGS")
        .output()
        .expect("run the build")
}

fn assert_built(out: &Output) {
    assert!(
        out.status.success(),
        "build failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("lost the broker"),
        "a normal build kept its connection: {err}"
    );
}

fn check_make(make: PathBuf, style: &str) {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("make");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 24, "0.1");
    let out = build(
        &broker,
        dir.path(),
        &["--jobserver-style", style],
        &make,
        &[],
    );
    assert_built(&out);
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 24);
    assert!(max <= 4, "{max} jobs at once under --jobs 4");
    assert!(
        max >= 3,
        "the build ran in parallel (at most {max} at once)"
    );
    assert_clean_end(&broker);
}

#[test]
fn make_4_3_builds_within_the_limit() {
    check_make(make43(), "auto");
}

#[test]
fn make_4_4_builds_within_the_limit() {
    check_make(make44(), "fifo");
}

#[test]
fn make_4_4_also_works_with_the_pipe_style() {
    check_make(make44(), "pipe");
}

#[test]
fn ninja_1_13_builds_within_the_limit() {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("ninja");
    let log = dir.path().join("jobs.log");
    flat_ninja(dir.path(), &log, 24, "0.1");
    let out = build(&broker, dir.path(), &[], &ninja(), &[]);
    assert_built(&out);
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 24);
    assert!((3..=4).contains(&max), "{max} jobs at once under --jobs 4");
    assert_clean_end(&broker);
}

#[test]
fn cargo_builds_within_the_limit() {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("cargo");
    let log = dir.path().join("jobs.log");
    cargo_workspace(dir.path(), &log, 10);
    let out = cargo_build(&broker, dir.path(), &["--jobserver-style", "fifo"]);
    assert_built(&out);
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 10, "every build script ran");
    assert!(max <= 4, "{max} build scripts at once under --jobs 4");
    // With only its own slot, a cargo that never read the jobserver would
    // run one at a time.
    assert!(
        max >= 2,
        "cargo took no token from the jobserver: at most {max} at once"
    );
    assert!(
        broker.status().totals.granted >= 2,
        "only baton run's own slot was granted"
    );
    assert_clean_end(&broker);
}

#[test]
fn three_builds_at_once_share_one_limit() {
    let broker = RunningBroker::start(6);
    let log = broker.dir.path().join("all-jobs.log");
    let dirs: Vec<TempDir> = (0..3)
        .map(|i| TempDir::new(&format!("shared{i}")))
        .collect();
    let logs: Vec<PathBuf> = dirs.iter().map(|d| d.path().join("mine.log")).collect();
    // Each job logs to the shared log (for the limit) and its build's own.
    for (d, own) in dirs[..2].iter().zip(&logs) {
        flat_makefile(
            d.path(),
            &log,
            30,
            &format!("0.1; echo S >> {}", own.display()),
        );
    }
    flat_ninja(
        dirs[2].path(),
        &log,
        30,
        &format!("0.1; echo S >> {}", logs[2].display()),
    );
    let spawn = |dir: &Path, tool: PathBuf| spawn_build(&broker, dir, &[], &tool);
    let builds = [
        spawn(dirs[0].path(), make43()),
        spawn(dirs[1].path(), make44()),
        spawn(dirs[2].path(), ninja()),
    ];
    // The three hold tokens of the one pool at the same time.
    wait_for(
        Duration::from_secs(60),
        "all three builds to hold tokens at once",
        || broker.status().holders.len() == 3,
    );
    for mut b in builds {
        assert!(b.wait().unwrap().success());
    }
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 90);
    assert!(
        max <= 6,
        "{max} jobs at once across three builds under --jobs 6"
    );
    let own: Vec<usize> = logs
        .iter()
        .map(|l| std::fs::read_to_string(l).unwrap().lines().count())
        .collect();
    assert_eq!(own, [30, 30, 30], "every build ran all its jobs");
    broker.assert_all_free();
}

/// A recursive make: top → `subs` sub-makes → `jobs` logged jobs each.
fn recursive_tree(dir: &Path, log: &Path, subs: usize, jobs: usize, secs: &str) {
    let sub_names: Vec<String> = (0..subs).map(|i| format!("s{i}")).collect();
    std::fs::write(
        dir.join("Makefile"),
        format!(
            "all: {all}\n{all}:\n\t+@$(MAKE) -s -f sub.mk\n.PHONY: all {all}\n",
            all = sub_names.join(" ")
        ),
    )
    .unwrap();
    let job_names: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
    std::fs::write(
        dir.join("sub.mk"),
        format!(
            "all: {all}\n{all}:\n\t@{job}\n.PHONY: all {all}\n",
            all = job_names.join(" "),
            job = logged_job(log, secs)
        ),
    )
    .unwrap();
}

/// The FIFO bridge's tree (the FUSE style has its own tests in fuse.rs):
/// a broker of 6 and a recursive tree of 4 sub-makes of 20 jobs under
/// `baton run -- MAKE`, running and holding every token; the build is in
/// a group of its own, so that the test can kill the whole tree.
fn running_tree(make: &Path) -> (RunningBroker, TempDir, Guarded) {
    let broker = RunningBroker::start(6);
    let dir = TempDir::new("tree");
    let log = dir.path().join("jobs.log");
    recursive_tree(dir.path(), &log, 4, 20, "0.2");
    let style = if make == make43() { "pipe" } else { "fifo" };
    let run = broker
        .run(&["--jobserver-style", style, "--", make.to_str().unwrap()])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn_guarded()
        .unwrap();
    wait_for(
        Duration::from_secs(20),
        "the tree to run and hold every token",
        || tree_running(&broker, &log, 6),
    );
    (broker, dir, run)
}

/// The build holds `tokens` and has started as many jobs: its tokens are
/// in its jobs' hands, not only in its FIFO (filled before it starts).
fn tree_running(broker: &RunningBroker, log: &std::path::Path, tokens: u32) -> bool {
    broker.status().held == tokens && max_overlap(log).1 >= tokens as usize
}

#[test]
fn kill_9_of_a_recursive_make_tree_returns_every_token() {
    for make in [make43(), make44()] {
        let (broker, _dir, mut run) = running_tree(&make);
        // The tree: everything in the group but baton run itself.
        let tree: Vec<u32> = group_members(run.id())
            .into_iter()
            .filter(|&p| p != run.id())
            .collect();
        for &pid in &tree {
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        wait_for(Duration::from_secs(20), "the tree to be gone", || {
            tree.iter().all(|&p| !pid_alive(p))
        });
        wait_for(Duration::from_secs(20), "every token to be free", || {
            broker.status().free == 6
        });
        kill_group(run.id());
        run.wait().unwrap();
    }
}

#[test]
fn kill_9_of_baton_run_returns_every_token_of_its_build() {
    let (broker, _dir, mut run) = running_tree(&make44());
    run.kill().unwrap();
    run.wait().unwrap();
    wait_for(Duration::from_secs(20), "every token to be free", || {
        broker.status().free == 6
    });
    assert!(
        broker.status().totals.reclaimed >= 1,
        "baton run's connection was reclaimed"
    );
    kill_group(run.id()); // orphaned sub-makes, no longer counted
    broker.assert_all_free();
}

/// The jobserver crate reopens an inherited FIFO read end through
/// /proc/self/fd, which blocks while nothing holds the FIFO open for
/// writing. A rustc that starts after `baton run` was killed (its handle
/// gone with it) must still open it, not wait for good: the pipe style's
/// read end is itself open for writing.
#[test]
fn the_pipe_styles_read_end_opens_after_baton_run_is_killed() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("orphan");
    let (pid_file, opened, gone) = (
        dir.path().join("orphan.pid"),
        dir.path().join("opened"),
        dir.path().join("baton-run-is-gone"),
    );
    // A grandchild (no parent-death signal reaches it) outlives baton run,
    // which its parent kills, and then, once the test has seen baton run
    // end, reopens R as the jobserver crate does. Orphaned by a failed
    // test, it still ends when the test's directory goes.
    let script = format!(
        "R=${{MAKEFLAGS##*--jobserver-auth=}}; R=${{R%%,*}}; \
         (echo $BASHPID > {pid}; \
          while [ ! -e {gone} ] && [ -d {dir} ]; do sleep 0.01; done; \
          exec 9</proc/self/fd/$R; echo yes > {opened}) & \
         kill -9 $PPID",
        pid = pid_file.display(),
        gone = gone.display(),
        dir = dir.path().display(),
        opened = opened.display()
    );
    let status = broker
        .run(&["--jobserver-style", "pipe", "--", "bash", "-c", &script])
        .env_remove("MAKEFLAGS")
        .status()
        .unwrap();
    assert!(!status.success(), "baton run was to be killed");
    // Reaped: its handle on the pipe is gone.
    std::fs::write(&gone, "").unwrap();
    wait_for(Duration::from_secs(10), "the orphan to start", || {
        std::fs::read_to_string(&pid_file).is_ok_and(|p| p.ends_with('\n'))
    });
    let orphan: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let reopened = (0..300).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        opened.exists()
    });
    unsafe { libc::kill(orphan, libc::SIGKILL) };
    assert!(
        reopened,
        "the orphan's open of the FIFO read end never returned"
    );
    broker.wait_all_free();
}

#[test]
fn extra_bytes_written_by_a_client_do_not_grow_the_pool() {
    for (style, writer) in [
        ("fifo", "printf 0123456789 > \"${MAKEFLAGS##*fifo:}\""),
        // dash cannot redirect to descriptors above 9: write with python.
        ("pipe", "python3 -c 'import os; os.write(int(os.environ[\"MAKEFLAGS\"].split(\",\")[-1]), b\"0123456789\")'"),
    ] {
        let broker = RunningBroker::start(4);
        let script = format!("{writer}; sleep 0.5; echo done");
        let out = broker.run(&["--jobserver-style", style, "--", "sh", "-c", &script]).env_remove("MAKEFLAGS").output().unwrap();
        assert!(out.status.success(), "{style}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("more than the pool lent it"), "{style}: the extra bytes were noticed");
        let s = broker.status();
        assert_eq!((s.limit, s.free, s.held), (4, 4, 0), "{style}: {s:#?}");
        assert_eq!(s.totals.granted, s.totals.released + s.totals.reclaimed);
    }
}

#[test]
fn an_idle_build_gives_its_spare_token_to_a_waiting_build() {
    // A runs one long job at a time: its spare token would sit unused.
    let broker = RunningBroker::start(2);
    let a = TempDir::new("idle");
    std::fs::write(a.path().join("Makefile"), "all:\n\tsleep 600\n").unwrap();
    let mut build_a = broker
        .run(&[
            "--jobserver-style",
            "fifo",
            "--",
            make44().to_str().unwrap(),
        ])
        .current_dir(a.path())
        .env_remove("MAKEFLAGS")
        .stdout(Stdio::null())
        .process_group(0)
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "A to hold both tokens", || {
        broker.status().held == 2
    });
    // B gets A's spare token while A's one job still runs.
    let mut build_b = broker.run(&["--", "true"]).spawn_guarded().unwrap();
    let b = wait_timeout(&mut build_b, Duration::from_secs(60)).expect("B got a token while A ran");
    assert!(b.success());
    assert!(
        build_a.try_wait().unwrap().is_none(),
        "A had ended, so this proves nothing"
    );
    // With B gone the pool is idle again, and A may have everything: the
    // token it gave back comes back to it.
    wait_for(
        Duration::from_secs(30),
        "A to take its spare token back",
        || broker.status().held == 2,
    );
    kill_group(build_a.id());
    build_a.wait().unwrap();
}

#[test]
fn max_caps_one_build() {
    let broker = RunningBroker::start(8);
    let dir = TempDir::new("max");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 12, "0.1");
    let out = build(&broker, dir.path(), &["--max", "2"], &make44(), &[]); // auto: the FIFO bridge
    assert_built(&out);
    let (max, started) = max_overlap(&log);
    assert_eq!((max, started), (2, 12));
}

#[test]
fn a_build_survives_its_broker_going_away() {
    let mut broker = RunningBroker::start(4);
    let dir = TempDir::new("orphan");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 12, "0.2");
    let run = broker
        .run(&[
            "--jobserver-style",
            "fifo",
            "--",
            make44().to_str().unwrap(),
        ])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the build to start", || {
        log.exists()
    });
    broker.stop_with(libc::SIGKILL);
    // Once the broker is gone, baton run waits for its build in poll(); a
    // loop that polled the dead socket would burn a CPU until the end.
    let before = cpu_ticks(run.id());
    std::thread::sleep(Duration::from_millis(1000));
    let used = cpu_ticks(run.id()) - before;
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    let out = run.wait_with_output().unwrap();
    assert!(out.status.success(), "the build finished");
    assert!(
        used * 4 < ticks_per_s,
        "baton run used {used} of {ticks_per_s} CPU ticks in the second after its broker died"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.matches("lost the broker").count(),
        1,
        "said once: {err}"
    );
    assert_eq!(max_overlap(&log).1, 12);
}

#[test]
fn auto_picks_pipe_when_the_make_on_path_is_older_than_4_4() {
    let broker = RunningBroker::start(2);
    for (make, expect_fifo) in [(make43(), false), (make44(), true)] {
        let bin = TempDir::new("path");
        std::os::unix::fs::symlink(&make, bin.path().join("make")).unwrap();
        let out = broker
            .run(&["--", "sh", "-c", "echo $MAKEFLAGS"])
            .env("PATH", format!("{}:/usr/bin:/bin", bin.path().display()))
            // No gcc older than 13 (whose lto-wrapper reads only R,W) as CC.
            .env("CC", "/bin/true")
            .env_remove("MAKEFLAGS")
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let auth = text
            .trim()
            .strip_prefix("-j2 --jobserver-auth=")
            .unwrap_or_else(|| panic!("{text}"));
        assert_eq!(auth.starts_with("fifo:"), expect_fifo, "{make:?}: {auth}");
        if !expect_fifo {
            assert!(
                auth.split(',').all(|fd| fd.parse::<u32>().is_ok()),
                "{auth}"
            );
        }
    }
}

#[test]
fn a_build_that_ends_while_its_next_token_is_queued_gives_back_cleanly() {
    let broker = RunningBroker::start(2);
    let mut other = broker.client("other");
    other.acquire(1).unwrap(); // the build's own slot takes the last token
    let dir = TempDir::new("queued");
    let queued = dir.path().join("queued");
    // Opening the FIFO makes baton queue for a token that cannot come; the
    // command ends once the broker shows it queued (or the test's
    // directory is gone).
    let script = format!(
        "exec 3<\"${{MAKEFLAGS##*fifo:}}\"; while [ ! -e {q} ] && [ -d {d} ]; do sleep 0.01; done",
        q = queued.display(),
        d = dir.path().display()
    );
    let run = broker
        .run(&["--jobserver-style", "fifo", "--", "sh", "-c", &script])
        .env_remove("MAKEFLAGS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    wait_for(
        Duration::from_secs(20),
        "the build to queue for a token",
        || broker.status().waiters.len() == 1,
    );
    std::fs::write(&queued, "").unwrap();
    let out = run.wait_with_output().unwrap();
    assert_built(&out);
    let s = broker.status();
    assert_eq!((s.free, s.held, s.totals.reclaimed), (1, 1, 0), "{s:#?}");
    assert_eq!(s.totals.waits, 1, "the build did queue for a token");
}

#[test]
fn a_command_that_never_opens_its_fifo_takes_no_extra_token() {
    let broker = RunningBroker::start(2);
    let out = broker
        .run(&["--jobserver-style", "fifo", "--", "sh", "-c", "sleep 0.3"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = broker.status();
    assert_eq!(s.totals.granted, 1, "only the command's own slot: {s:#?}");
}

#[test]
fn a_missing_command_exits_127_and_leaves_no_fifo() {
    let broker = RunningBroker::start(2);
    let out = broker.run(&["--", "no-such-build-tool"]).output().unwrap();
    assert_eq!(out.status.code(), Some(127));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no-such-build-tool: command not found"));
    let leftovers: Vec<_> = std::fs::read_dir(broker.socket.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".fifo"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    broker.assert_all_free();
}

/// The FIFOs in the broker's private directory.
fn fifos(broker: &RunningBroker) -> Vec<PathBuf> {
    std::fs::read_dir(broker.socket.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "fifo"))
        .collect()
}

#[test]
fn a_finished_build_leaves_no_fifo() {
    let broker = RunningBroker::start(2);
    let script = "f=${MAKEFLAGS##*fifo:}; test -p \"$f\" && echo \"$f\"";
    let out = broker
        .run(&["--jobserver-style", "fifo", "--", "sh", "-c", script])
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    assert_built(&out);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !said.contains("stray"),
        "no stray byte, no word of one: {said}"
    );
    let fifo = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert!(
        fifo.starts_with(broker.socket.parent().unwrap()),
        "the build saw its FIFO: {fifo:?}"
    );
    assert!(!fifo.exists(), "{fifo:?} is left behind");
    assert!(fifos(&broker).is_empty(), "{:?}", fifos(&broker));
    assert_clean_end(&broker);
}

#[test]
fn the_fifo_of_a_killed_baton_run_is_swept_by_the_next() {
    let broker = RunningBroker::start(2);
    let left = file_of_a_killed_build(&broker, "fifo", "its FIFO", || fifos(&broker));
    assert!(
        left.exists(),
        "kill -9 left nothing to sweep: the test proves nothing"
    );
    let out = broker
        .run(&["--jobserver-style", "fifo", "--", "true"])
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    assert_built(&out);
    assert!(!left.exists(), "{left:?} outlived the next baton run");
    assert!(fifos(&broker).is_empty(), "{:?}", fifos(&broker));
    broker.assert_all_free();
}

#[test]
fn max_below_the_tokens_a_build_needs_or_with_fuse_is_refused() {
    let broker = RunningBroker::start(4);
    let out = broker
        .run(&["--max", "1", "--tokens", "2", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--max 1 is below --tokens 2"), "{err}");
    let out = broker
        .run(&["--max", "2", "--jobserver-style", "fuse", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--max works with the pipe and fifo styles, not with fuse"),
        "{err}"
    );
    assert_eq!(
        broker.status().totals.granted,
        0,
        "refused before taking a token"
    );
    broker.assert_all_free();
}

/// The feeder's cap against the real broker, where its requests queue:
/// a build that gives each token back and at once takes it again, beside
/// a client that takes and gives back the pool's other token, so that the
/// feeder's CANCEL races with grants. Under a limit of 2 (the run's own
/// slot and the one `--max 2` lets it lend), one request past the cap
/// would be refused and end the run; the feeder's unit tests play a broker
/// that never queues.
#[test]
fn the_cap_holds_against_a_broker_that_queues() {
    let broker = RunningBroker::start(2);
    let socket = broker.socket.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let rival = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let mut c = baton_client::Client::connect(&socket, "rival").unwrap();
            let mut rounds = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                c.acquire(1).unwrap();
                std::thread::sleep(Duration::from_millis(1));
                c.release(1).unwrap();
                rounds += 1;
            }
            rounds
        }
    });
    let churn = "import os\n\
        fd = os.open(os.environ['MAKEFLAGS'].split('fifo:')[1], os.O_RDWR)\n\
        for _ in range(3000):\n\
        \x20   os.write(fd, os.read(fd, 1))\n\
        print('done')\n";
    let mut run = broker
        .run(&[
            "--max",
            "2",
            "--jobserver-style",
            "fifo",
            "--",
            "python3",
            "-c",
            churn,
        ])
        .env_remove("MAKEFLAGS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    let finished = wait_timeout(&mut run, Duration::from_secs(120));
    if finished.is_none() {
        let _ = run.kill();
    }
    let out = run.wait_with_output().unwrap();
    assert!(
        finished.is_some(),
        "the build hung: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = join_within(rival, Duration::from_secs(60), "the rival to stop");
    assert_built(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "done");
    assert!(rounds > 0, "the rival never got a token: nothing raced");
    let s = broker.status();
    assert!(s.totals.waits > 0, "no request ever queued: {s:#?}");
    assert_eq!(
        s.totals.reclaimed,
        0,
        "baton run said: {}\nthe broker said: {}",
        String::from_utf8_lossy(&out.stderr),
        broker.log()
    );
    assert_clean_end(&broker);
}

#[test]
fn a_recursive_make_stays_within_a_binding_limit() {
    for (make, style) in [(make43(), "pipe"), (make44(), "fifo")] {
        let broker = RunningBroker::start(3);
        let dir = TempDir::new("recursive");
        let log = dir.path().join("jobs.log");
        recursive_tree(dir.path(), &log, 4, 10, "0.05");
        let out = build(
            &broker,
            dir.path(),
            &["--jobserver-style", style],
            &make,
            &[],
        );
        assert_built(&out);
        let (max, started) = max_overlap(&log);
        assert_eq!(started, 40, "{style}: every job ran");
        assert!(
            max <= 3,
            "{style}: {max} jobs at once under --jobs 3 across sub-makes"
        );
        assert!(
            max >= 2,
            "{style}: the tree ran in parallel (at most {max} at once)"
        );
        assert_clean_end(&broker);
    }
}

/// A recipe of a build already under baton that runs `baton run` again
/// (a script that wraps its tools, a build that calls another): it already
/// holds its job slot, so it runs at once in the outer build instead of
/// waiting for a token its own build holds (forever under --jobs 1).
#[test]
fn baton_run_inside_a_recipe_of_a_build_under_baton_runs_in_its_job_slot() {
    for make in [make43(), make44()] {
        let broker = RunningBroker::start(1);
        let dir = TempDir::new("nested-run");
        let log = dir.path().join("jobs.log");
        let job = logged_job(&log, "0.1");
        let targets: Vec<String> = (0..4).map(|i| format!("j{i}")).collect();
        let text = format!(
            "all: {all}\n{all}:\n\t+@{baton} run -- sh -c '{job}'\n.PHONY: all {all}\n",
            all = targets.join(" "),
            baton = baton_bin()
        );
        std::fs::write(dir.path().join("Makefile"), text).unwrap();
        let mut build = broker
            .run(&["--", make.to_str().unwrap(), "-s"])
            .current_dir(dir.path())
            .env_remove("MAKEFLAGS")
            .spawn_guarded()
            .unwrap();
        let status = wait_timeout(&mut build, Duration::from_secs(60)).unwrap_or_else(|| {
            let _ = build.kill();
            panic!(
                "{}: the nested baton runs waited for a token their own build holds",
                make.display()
            )
        });
        assert!(status.success(), "{}", make.display());
        assert_eq!(
            max_overlap(&log),
            (1, 4),
            "{}: one job at a time under --jobs 1",
            make.display()
        );
        broker.assert_all_free();
    }
}

/// A recipe that runs `baton run --socket` of another broker (a build
/// that sends part of its work to another pool) is served by that broker:
/// only a `baton run` of the broker the build is under runs in the outer
/// build's job slot. The inner command says which broker it was given.
#[test]
fn baton_run_of_another_broker_inside_a_recipe_is_served_by_that_broker() {
    let outer = RunningBroker::start(1);
    let other = RunningBroker::start(1);
    let dir = TempDir::new("nested-other");
    let seen = dir.path().join("socket-seen");
    let text = format!(
        "all:\n\t+@{baton} run --socket {other} -- sh -c 'echo \"$$BATON_SOCKET\" > {seen}'\n",
        baton = baton_bin(),
        other = other.socket.display(),
        seen = seen.display()
    );
    std::fs::write(dir.path().join("Makefile"), text).unwrap();
    let out = outer
        .run(&["--", make44().to_str().unwrap(), "-s"])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    let given = std::fs::read_to_string(&seen).unwrap();
    assert_eq!(
        Path::new(given.trim_end()),
        std::path::absolute(&other.socket).unwrap(),
        "the inner command was given the outer build's broker"
    );
    assert_eq!(
        other.status().totals.granted,
        1,
        "the other broker served it"
    );
    outer.assert_all_free();
    other.assert_all_free();
}

/// Closing the FIFO's inotify watch waits for the kernel (an SRCU grace
/// period), so `baton run` hands that close to a grandchild it does not
/// wait for. The grandchild must be out of `baton run`'s process group
/// and hold none of its descriptors by the time `baton run` exits: a
/// caller that waits for the group, or for the end of its output, would
/// otherwise wait for it.
#[test]
fn baton_run_leaves_nothing_in_its_process_group_or_on_its_output() {
    let broker = RunningBroker::start(2);
    for style in ["fifo", "pipe"] {
        let mut run = broker.run(&["--jobserver-style", style, "--", "true"]);
        run.process_group(0)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = run.spawn().unwrap();
        let group = child.id() as i32;
        let mut out = child.stdout.take().unwrap();
        assert!(child.wait().unwrap().success());
        // The group's leader is reaped; nobody else may be left in it.
        let alive = unsafe { libc::kill(-group, 0) } == 0;
        assert!(!alive, "{style}: a process is left in baton run's group");
        // Nobody holds the write end: the read sees end of file, at once
        // (were it held, it would block until the holder exits).
        let mut fds = [libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&out),
            events: libc::POLLIN,
            revents: 0,
        }];
        assert_eq!(
            unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) },
            1,
            "{style}: baton run's output is still held open"
        );
        let mut rest = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut rest).unwrap();
        assert!(rest.is_empty());
    }
    broker.assert_all_free();
}
