//! `baton run -- bmake` with the real bmake (Debian's `bmake`): its own
//! jobserver form, one limit with GNU make and ninja, abort tokens, and
//! kill -9.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// A recursive bmake tree: the top runs `subs` sub-makes (s0, s1, ...),
/// each `jobs` logged jobs (j0, j1, ...); the job named `fail` (say
/// "s1j1") logs its run and then fails.
fn bmake_tree(dir: &Path, log: &Path, subs: usize, jobs: usize, fail: &str) {
    let names = |prefix: &str, n: usize| {
        (0..n)
            .map(|i| format!("{prefix}{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let top = format!("SUBS = {}\nall: ${{SUBS}}\n${{SUBS}}:\n\t@${{MAKE}} -f ${{.CURDIR}}/sub.mk NAME=$@\n.PHONY: all ${{SUBS}}\n", names("s", subs));
    std::fs::write(dir.join("Makefile"), top).unwrap();
    let job = logged_job(log, "0.2");
    let sub = format!("JOBS = {}\nall: ${{JOBS}}\n${{JOBS}}:\n\t@{job}; test ${{NAME}}$@ != {fail} || exit 3\n.PHONY: all ${{JOBS}}\n", names("j", jobs));
    std::fs::write(dir.join("sub.mk"), sub).unwrap();
}

fn run_bmake(broker: &RunningBroker, dir: &Path, run_args: &[&str], bmake_args: &[&str]) -> Output {
    let bmake = bmake();
    let mut args = run_args.to_vec();
    args.extend(["--", bmake.to_str().unwrap()]);
    args.extend_from_slice(bmake_args);
    let mut child = broker
        .run(&args)
        .current_dir(dir)
        .env_remove("MAKEFLAGS")
        .env_remove("MAKELEVEL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    // Read as it comes, so a chatty build (-dj) never blocks on a full pipe.
    let out = read_all(child.stdout.take().unwrap());
    let err = read_all(child.stderr.take().unwrap());
    let finished = wait_timeout(&mut child, Duration::from_secs(120));
    if finished.is_none() {
        let _ = child.kill();
    }
    let output = Output {
        status: child.wait().unwrap(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    };
    assert!(
        finished.is_some(),
        "bmake hung (killed after 120 s): {}",
        output_text(&output)
    );
    output
}

fn read_all(mut from: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = from.read_to_end(&mut bytes);
        bytes
    })
}

/// The styles baton offers bmake: `fifo` (auto: both ends on the build's
/// FIFO, bmake's own shape), `pipe` (tokens come back through a pipe only
/// baton reads) and `fuse` (both ends on the build's FUSE token file: a
/// freed token wakes one sub-make), where the broker has its mount.
fn styles(broker: &RunningBroker) -> Vec<&'static str> {
    let mount = broker.socket.with_file_name("fuse");
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    if mounts
        .lines()
        .any(|l| l.split(' ').nth(1) == mount.to_str())
    {
        return vec!["fifo", "pipe", "fuse"];
    }
    skip(
        Missing::Fuse,
        &format!(
            "bmake on the FUSE file: the broker has no mount: {}",
            broker.log()
        ),
    );
    vec!["fifo", "pipe"]
}

#[test]
fn a_recursive_bmake_tree_holds_the_limit_and_reaches_it() {
    for style in styles(&RunningBroker::start(1)) {
        let broker = RunningBroker::start(4);
        let dir = TempDir::new("bmake-tree");
        let log = dir.path().join("jobs.log");
        bmake_tree(dir.path(), &log, 4, 8, "none");
        let out = run_bmake(&broker, dir.path(), &["--jobserver-style", style], &[]);
        assert!(
            out.status.success(),
            "bmake failed under baton run ({style}):\n{}",
            output_text(&out)
        );
        let (max, started) = max_overlap(&log);
        assert_eq!(started, 32);
        assert_eq!(max, 4, "most jobs at once under --jobs 4 ({style})");
        broker.assert_all_free();
        assert_eq!(broker.status().totals.reclaimed, 0);
    }
}

#[test]
fn bmake_is_found_by_what_it_is_and_gets_its_own_form() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("bmake-style");
    // Found by what it is, under another name: FreeBSD's make is bmake.
    let link = dir.path().join("make");
    std::os::unix::fs::symlink(bmake(), &link).unwrap();
    std::fs::write(
        dir.path().join("Makefile"),
        "all:\n\t@echo \"$$MAKEFLAGS\"\n",
    )
    .unwrap();
    let out = broker
        .run(&["--explain", "--", link.to_str().unwrap()])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    let flags = String::from_utf8_lossy(&out.stdout);
    assert!(
        flags.contains(" -J ") && flags.contains("-j 2"),
        "bmake's form: {flags}"
    );
    // --explain names what bmake got and why; GNU make's and gcc's
    // versions, which decide a GNU build's form, are no reason here.
    let explained = String::from_utf8_lossy(&out.stderr);
    let first = explained.lines().next().unwrap_or("");
    assert!(
        first.contains("jobserver: fifo (bmake's -J R,W") && first.ends_with("(auto)"),
        "{explained}"
    );
    let version = Command::new(bmake())
        .args(["-r", "-f", "/dev/null", "-V", "MAKE_VERSION"])
        .output()
        .unwrap();
    let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
    assert!(
        explained.contains(&format!("because bmake {version} ({})", link.display())),
        "{explained}"
    );
    assert!(
        !explained.contains("gcc") && !explained.contains("reads only R,W"),
        "{explained}"
    );
    broker.assert_all_free();
}

#[test]
fn bmake_beside_gnu_make_and_ninja_shares_one_limit() {
    let broker = RunningBroker::start(6);
    let log = broker.dir.path().join("all-jobs.log");
    let dirs: Vec<TempDir> = (0..4)
        .map(|i| TempDir::new(&format!("bmake-mix{i}")))
        .collect();
    bmake_tree(dirs[0].path(), &log, 4, 6, "none");
    flat_makefile(dirs[1].path(), &log, 20, "0.2");
    flat_makefile(dirs[2].path(), &log, 20, "0.2");
    flat_ninja(dirs[3].path(), &log, 20, "0.2");
    let spawn = |dir: &Path, tool: PathBuf| spawn_build(&broker, dir, &[], &tool);
    let builds = [
        spawn(dirs[0].path(), bmake()),
        spawn(dirs[1].path(), make43()),
        spawn(dirs[2].path(), make44()),
        spawn(dirs[3].path(), ninja()),
    ];
    for mut b in builds {
        assert!(b.wait().unwrap().success());
    }
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 24 + 60);
    assert!(
        max <= 6,
        "{max} jobs at once across four builds under --jobs 6"
    );
    broker.assert_all_free();
}

/// Regression: in the pipe style the abort token a failing bmake job
/// writes went to baton only, through the return pipe, and the other
/// sub-makes never saw it.
#[test]
fn a_failing_bmake_job_stops_its_build_but_no_other_and_every_token_comes_back() {
    for style in styles(&RunningBroker::start(1)) {
        a_failing_bmake_job_stops_its_build(style);
    }
}

fn a_failing_bmake_job_stops_its_build(style: &str) {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("bmake-fail");
    let log = dir.path().join("jobs.log");
    // Fewer sub-makes than tokens: all run before s1's first job fails,
    // with much work left in the others (at least 1.2 s under 4 tokens),
    // so that a bmake slow to see its job end on a loaded machine still
    // fails while they run.
    bmake_tree(dir.path(), &log, 3, 12, "s1j0");
    // Another build at the same time must not see the abort token.
    let other = TempDir::new("bmake-fail-other");
    let other_log = other.path().join("jobs.log");
    flat_makefile(other.path(), &other_log, 30, "0.1");
    let mut neighbour = broker
        .run(&["--", make44().to_str().unwrap()])
        .current_dir(other.path())
        .env_remove("MAKEFLAGS")
        .stdout(Stdio::null())
        .spawn_guarded()
        .unwrap();
    // -dj: each bmake says when it reads an abort token (and none dies
    // quietly).
    let out = run_bmake(&broker, dir.path(), &["--jobserver-style", style], &["-dj"]);
    let said = format!("({style}) {}", output_text(&out));
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("*** [j0] Error code 3"),
        "bmake's own report of the failure: {said}"
    );
    assert!(
        said.contains("aborted by token E"),
        "no other bmake saw the abort: {said}"
    );
    assert!(
        said.contains("A failure has been detected in another branch of the parallel make"),
        "{said}"
    );
    // Had the abort stayed in s1, every job of the two others would run.
    let (_, started) = max_overlap(&log);
    assert!(
        started < 2 * 12 + 1,
        "{started} jobs ran ({style}): the abort stopped no other sub-make"
    );
    assert!(
        neighbour.wait().unwrap().success(),
        "the abort reached another build"
    );
    assert_eq!(max_overlap(&other_log).1, 30);
    broker.assert_all_free();
}

#[test]
fn with_dash_k_bmake_goes_on_past_a_failing_job() {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("bmake-k");
    let log = dir.path().join("jobs.log");
    bmake_tree(dir.path(), &log, 4, 6, "s1j1");
    let out = run_bmake(&broker, dir.path(), &[], &["-k", ".MAKE.DIE_QUIETLY=no"]);
    let said = output_text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("*** [j1] Error code 3"), "{said}");
    assert!(
        !said.contains("another branch"),
        "-k wrote an abort token: {said}"
    );
    assert_eq!(max_overlap(&log).1, 24, "-k ran every job: {said}");
    broker.assert_all_free();
}

/// `kill -9` of the top bmake while its sub-makes run jobs: `baton run`
/// ends with it, the sub-makes run on (nobody kills them), and the
/// broker keeps the build's tokens while they live; once they are gone,
/// every token is back.
#[test]
fn kill_9_of_the_top_bmake_gives_every_token_back() {
    use std::os::unix::process::CommandExt;
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("bmake-kill");
    let log = dir.path().join("jobs.log");
    bmake_tree(dir.path(), &log, 4, 20, "none");
    let bmake = bmake();
    let mut run = broker
        .run(&["--", bmake.to_str().unwrap()])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0) // so the test can end the orphaned sub-makes
        .spawn_guarded()
        .unwrap();
    wait_for(
        Duration::from_secs(20),
        "the sub-makes' jobs to start",
        || max_overlap(&log).1 > 0,
    );
    let top = children(run.id());
    assert_eq!(top.len(), 1, "baton run has one child, the top bmake");
    unsafe { libc::kill(top[0] as i32, libc::SIGKILL) };
    let status =
        wait_timeout(&mut run, Duration::from_secs(10)).expect("baton run ends with its command");
    assert_eq!(status.code(), Some(128 + 9));
    wait_for(
        Duration::from_secs(10),
        "the build to stay as orphaned while its sub-makes run on",
        || {
            let s = broker.status();
            s.holders
                .iter()
                .any(|h| h.command.starts_with("[orphaned] "))
                && s.held <= s.limit
        },
    );
    unsafe { libc::kill(-(run.id() as i32), libc::SIGKILL) };
    broker.wait_all_free();
    let (most, _) = max_overlap(&log);
    assert!(most <= 4, "{most} jobs at once under a limit of 4");
}

/// bmake does not wait on its pipe, so baton keeps every token the build
/// may use waiting in it; tokens left unread must still reach a build that
/// waits at the pool, while the bmake build runs on.
#[test]
fn tokens_an_idle_bmake_build_leaves_unread_go_to_a_waiting_build() {
    use std::os::unix::process::CommandExt;
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("bmake-idle");
    let started = dir.path().join("started");
    // One long job: bmake holds its own slot and reads nothing more. It
    // writes its pid: bmake runs it in a process group of its own, so the
    // group's kill below leaves it running, and the broker keeps its token
    // until it ends (#32).
    let job_pid = dir.path().join("job.pid");
    std::fs::write(
        dir.path().join("Makefile"),
        format!(
            "all:\n\t@touch {}; echo $$$$ > {}; exec sleep 30\n",
            started.display(),
            job_pid.display()
        ),
    )
    .unwrap();
    let bmake = bmake();
    let mut idle = broker
        .run(&["--", bmake.to_str().unwrap()])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .stdout(Stdio::null())
        .process_group(0)
        .spawn_guarded()
        .unwrap();
    wait_for(
        Duration::from_secs(20),
        "the bmake build to fill its pipe",
        || started.exists() && broker.status().held == 4,
    );
    let other = TempDir::new("bmake-idle-other");
    let log = other.path().join("jobs.log");
    flat_makefile(other.path(), &log, 12, "0.1");
    let out = broker
        .run(&["--", make44().to_str().unwrap()])
        .current_dir(other.path())
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    let (max, started_jobs) = max_overlap(&log);
    assert_eq!(started_jobs, 12);
    assert!(
        max >= 2,
        "the waiting build got no token beyond its own slot"
    );
    assert!(
        idle.try_wait().unwrap().is_none(),
        "the bmake build ended first: the test proves nothing"
    );
    unsafe { libc::kill(-(idle.id() as i32), libc::SIGKILL) };
    idle.wait().unwrap();
    let job: i32 = std::fs::read_to_string(&job_pid)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    unsafe { libc::kill(job, libc::SIGKILL) };
    wait_for(Duration::from_secs(10), "every token to be free", || {
        broker.status().free == 4
    });
}
