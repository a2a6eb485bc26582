//! The limit holds under the events of a busy machine (issue #32): a
//! lowered limit, a broker that dies while a build waits for its first
//! token, a stopped build. Jobs are counted from the jobs themselves (each
//! logs its start and end), never from the broker's own books.

mod common;

use common::*;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

/// A makefile of `jobs` independent jobs that log `S id` and `E id`.
fn logged_makefile(dir: &Path, log: &Path, jobs: usize, secs: &str) {
    let names: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
    // The same jobs for ninja, beside: whichever tool runs finds its file.
    let mut ninja =
        "rule job\n  command = sh -c 'echo S $name >> $log; sleep $secs; echo E $name >> $log'\n"
            .replace("$log", &log.display().to_string())
            .replace("$secs", secs)
            .replace("$name", "$out");
    for name in &names {
        ninja += &format!("build {name}: job\n");
    }
    std::fs::write(dir.join("build.ninja"), ninja).unwrap();
    let mut text = format!(".PHONY: all {0}\nall: {0}\n", names.join(" "));
    for name in &names {
        text += &format!(
            "{name}:\n\t@echo 'S {name}' >> {log}; sleep {secs}; echo 'E {name}' >> {log}\n",
            log = log.display()
        );
    }
    std::fs::write(dir.join("Makefile"), text).unwrap();
}

/// Appends a line to the jobs' log, in the order of their own lines.
fn mark(log: &Path, line: &str) {
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .unwrap();
    writeln!(file, "{line}").unwrap();
}

fn started(log: &Path) -> usize {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().filter(|l| l.starts_with("S ")).count()
}

fn running(log: &Path) -> usize {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let (s, e) = text.lines().fold((0, 0), |(s, e), l| {
        (
            s + usize::from(l.starts_with("S ")),
            e + usize::from(l.starts_with("E ")),
        )
    });
    s - e
}

/// The most jobs running at once after every job that was running at the
/// mark `L` had ended: from then on, every running job started after the
/// limit changed. Also returns how many jobs started in that stretch.
fn overlap_after_the_change(log: &Path) -> (usize, usize) {
    overlap_after(log, "L")
}

/// As [`overlap_after_the_change`], after the mark `mark`.
fn overlap_after(log: &Path, mark: &str) -> (usize, usize) {
    let text = std::fs::read_to_string(log).unwrap();
    let mut running = BTreeSet::new();
    let mut old: Option<BTreeSet<String>> = None;
    let (mut max, mut starts) = (0, 0);
    for line in text.lines() {
        match line.split_once(' ') {
            Some(("S", id)) => {
                running.insert(id.to_string());
                if old.as_ref().is_some_and(|o| o.is_empty()) {
                    starts += 1;
                }
            }
            Some(("E", id)) => {
                running.remove(id);
                if let Some(o) = old.as_mut() {
                    o.remove(id);
                }
            }
            _ if line == mark => old = Some(running.clone()),
            _ => {}
        }
        if old.as_ref().is_some_and(|o| o.is_empty()) {
            max = usize::max(max, running.len());
        }
    }
    assert!(old.is_some(), "the log has no mark of the change:\n{text}");
    (max, starts)
}

/// `baton run --jobserver-style STYLE -- MAKE` in `dir`, its output piped.
fn spawn_piped_build(broker: &RunningBroker, dir: &Path, style: &str, make: &Path) -> Guarded {
    broker
        .run(&["--jobserver-style", style, "--", make.to_str().unwrap()])
        .current_dir(dir)
        .env_remove("MAKEFLAGS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn_guarded()
        .expect("start baton run")
}

/// `baton limit` would do the same, through the same request.
fn set_limit_by_request(broker: &RunningBroker, limit: u32) {
    broker
        .client("limit")
        .set_limit(limit)
        .expect("the limit changes");
}

/// A build running 4 jobs at once under a limit of 4 keeps its connection
/// when the limit drops to 1, gives back what it holds beyond it, and the
/// jobs it starts from then on obey the new limit.
fn a_lowered_limit_holds(style: &str, make: &Path) {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("lowered");
    let log = dir.path().join("jobs.log");
    logged_makefile(dir.path(), &log, 12, "0.4");
    let child = spawn_piped_build(&broker, dir.path(), style, make);
    wait_for(Duration::from_secs(30), "4 jobs at once", || {
        running(&log) >= 4
    });
    set_limit_by_request(&broker, 1);
    mark(&log, "L");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the build failed: {err}");
    for storm in ["lost the broker", "refused us"] {
        assert!(
            !err.contains(storm),
            "a lowered limit is not a lost broker: {err}"
        );
    }
    assert_eq!(started(&log), 12, "every job ran");
    let (max, starts) = overlap_after_the_change(&log);
    assert!(
        starts > 0,
        "no job started after the change: nothing was shown"
    );
    assert_eq!(
        max,
        1,
        "jobs started after the limit dropped to 1 ran {max} at once:\n{}",
        std::fs::read_to_string(&log).unwrap()
    );
    broker.assert_all_free();
    assert_eq!(
        broker.status().totals.reclaimed,
        0,
        "released, not reclaimed"
    );
}

#[test]
fn a_lowered_limit_holds_for_make_4_3_through_the_pipe() {
    a_lowered_limit_holds("pipe", &make43());
}

#[test]
fn a_lowered_limit_holds_for_make_4_4_through_the_pipe() {
    a_lowered_limit_holds("pipe", &make44());
}

/// A `fifo:` build that uses every token it has writes each one back into
/// the FIFO it reads and reads it again at once: `baton run` takes them
/// back with a blocking read, which wins that race often but not always
/// (the scheduler decides). So the build gives back what it holds past a
/// lowered limit within a few of its jobs, while it is still busy, and
/// from then on runs one job at a time, counted from the jobs.
fn a_lowered_limit_drains_a_busy_fifo_build(make: &Path, style: &str) {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("lowered-fifo");
    let log = dir.path().join("jobs.log");
    logged_makefile(dir.path(), &log, 40, "0.2");
    let mut child = spawn_piped_build(&broker, dir.path(), style, make);
    wait_for(Duration::from_secs(30), "4 jobs at once", || {
        running(&log) >= 4
    });
    set_limit_by_request(&broker, 1);
    mark(&log, "L");
    wait_for(
        Duration::from_secs(60),
        "the build to give back what it held past the limit",
        || broker.status().held <= 1,
    );
    mark(&log, "D");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the build ended before it gave its tokens back: nothing was shown"
    );
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(started(&log), 40, "every job ran");
    let (max, starts) = overlap_after(&log, "D");
    assert!(starts > 0, "no job started after the drain");
    assert_eq!(
        max,
        1,
        "after the drain, jobs ran {max} at once under a limit of 1:\n{}",
        std::fs::read_to_string(&log).unwrap()
    );
    broker.assert_all_free();
}

#[test]
fn a_lowered_limit_drains_a_busy_make_4_4_fifo_build() {
    a_lowered_limit_drains_a_busy_fifo_build(&make44(), "fifo");
}

#[test]
fn a_lowered_limit_drains_a_busy_ninja_build() {
    a_lowered_limit_drains_a_busy_fifo_build(&ninja(), "fifo");
}

#[test]
fn a_lowered_limit_drains_a_busy_bmake_build() {
    a_lowered_limit_drains_a_busy_fifo_build(&bmake(), "auto");
}

/// A build that holds more than a new broker's limit (it re-attaches
/// after its broker died, and the new one was started smaller) is counted
/// whole, once, and the pool drains until it is back under the limit.
#[test]
fn a_build_re_attaching_past_a_smaller_limit_is_counted_once() {
    let mut old = RunningBroker::start(4);
    let dir = TempDir::new("smaller");
    let log = dir.path().join("jobs.log");
    logged_makefile(dir.path(), &log, 8, "1");
    let child = spawn_piped_build(&old, dir.path(), "pipe", &make43());
    wait_for(Duration::from_secs(30), "4 jobs at once", || {
        running(&log) >= 4
    });
    old.stop_with(libc::SIGKILL);
    let new = RunningBroker::start_at(&old, 2, &[]);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the build failed: {err}");
    assert!(
        err.contains("re-attached to the new broker"),
        "the build re-attached: {err}"
    );
    assert!(
        !err.contains("refused us"),
        "HOLD past the limit was refused: {err}"
    );
    assert_eq!(
        err.matches("lost the broker").count(),
        1,
        "said once: {err}"
    );
    new.assert_all_free();
}

/// Tokens a build writes back while no broker answers wait in its return
/// pipe. When a broker with a smaller limit comes, the build asks it
/// before they go back into its FIFO: from then on it runs at the new
/// limit, counted from its jobs (they used to go back first: 4 jobs at
/// once under a limit of 2). The `fuse` file is the broker's own and
/// obeys at once as well.
fn a_smaller_next_broker_is_obeyed_at_once(style: &str, tool: &Path) {
    let (log, _old, new, child) =
        a_build_outlives_its_broker_into_a_smaller_one(style, tool, 12, "1");
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_ran_within(&log, 12, "N", 2);
    new.assert_all_free();
}

/// Every one of `jobs` jobs ran, some started after the log's `mark`, and
/// from the moment the jobs running at the mark had ended, at most
/// `limit` ran at once, counted from the jobs' own lines.
fn assert_ran_within(log: &Path, jobs: usize, mark: &str, limit: usize) {
    assert_eq!(started(log), jobs, "every job ran");
    let (max, starts) = overlap_after(log, mark);
    assert!(starts > 0, "no job started after {mark}");
    assert!(
        max <= limit,
        "after {mark}, {max} jobs at once under a limit of {limit}:\n{}",
        std::fs::read_to_string(log).unwrap()
    );
}

/// A build of 4 jobs at once whose broker is killed, and whose jobs end
/// and go on with no broker; then a broker of 2 at the same socket (mark
/// `N` in the log).
fn a_build_outlives_its_broker_into_a_smaller_one(
    style: &str,
    tool: &Path,
    jobs: usize,
    secs: &str,
) -> (std::path::PathBuf, RunningBroker, RunningBroker, Guarded) {
    let mut old = RunningBroker::start(4);
    // The build's files go with the first broker's directory.
    let log = old.dir.path().join("jobs.log");
    let dir = old.dir.path().join("build");
    std::fs::create_dir(&dir).unwrap();
    logged_makefile(&dir, &log, jobs, secs);
    let child = spawn_piped_build(&old, &dir, style, tool);
    wait_for(Duration::from_secs(30), "4 jobs at once", || {
        running(&log) >= 4
    });
    old.stop_with(libc::SIGKILL);
    wait_for(
        Duration::from_secs(30),
        "the jobs running at the kill to end, with no broker",
        || started(&log) - running(&log) >= 4,
    );
    let new = RunningBroker::start_at(&old, 2, &[]);
    mark(&log, "N");
    (log, old, new, child)
}

#[test]
fn tokens_written_back_while_no_broker_answered_obey_the_next_ones_limit_in_the_pipe_style() {
    a_smaller_next_broker_is_obeyed_at_once("pipe", &make43());
}

#[test]
fn a_smaller_next_broker_is_obeyed_at_once_in_the_fuse_style() {
    a_smaller_next_broker_is_obeyed_at_once("fuse", &make44());
}

/// In the `fifo` form make writes a finished job's token back into the
/// FIFO it reads, and the next broker's smaller limit is a lowered limit
/// like any other: the build gives back what it holds past it over a few
/// of its jobs (docs/jobserver.md, "When the limit is lowered"), while
/// still busy, and from then on runs at the new limit, counted from the
/// jobs.
fn a_smaller_next_broker_drains_a_busy_fifo_build(tool: &Path) {
    let (log, _old, new, mut child) =
        a_build_outlives_its_broker_into_a_smaller_one("fifo", tool, 40, "0.2");
    // It re-attaches holding what its jobs hold (HOLD, in one request).
    wait_for(Duration::from_secs(30), "the build to re-attach", || {
        new.status().held > 0
    });
    wait_for(
        Duration::from_secs(60),
        "the build to give back what it held past the new limit",
        || new.status().held <= 2,
    );
    mark(&log, "D");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the build ended before it gave its tokens back: nothing was shown"
    );
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_ran_within(&log, 40, "D", 2);
    new.assert_all_free();
}

#[test]
fn a_smaller_next_broker_drains_a_busy_make_4_4_fifo_build() {
    a_smaller_next_broker_drains_a_busy_fifo_build(&make44());
}

#[test]
fn a_smaller_next_broker_drains_a_busy_ninja_build() {
    a_smaller_next_broker_drains_a_busy_fifo_build(&ninja());
}

/// `baton run` queued for its first token when the broker is killed waits
/// for the next broker and runs its command (it used to exit 1 with
/// "waiting for tokens: the broker closed the connection").
#[test]
fn a_build_waiting_for_its_first_token_outlives_its_broker() {
    let mut old = RunningBroker::start(1);
    let mut holder = old.client("holder");
    holder.acquire(1).unwrap();
    let dir = TempDir::new("first-token");
    let ran = dir.path().join("ran");
    let mut waiting = old
        .run(&["--", "touch", ran.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the run to queue", || {
        old.status().waiters.len() == 1
    });
    old.stop_with(libc::SIGKILL);
    drop(holder);
    let new = RunningBroker::start_at(&old, 1, &[]);
    let status = wait_timeout(&mut waiting, Duration::from_secs(60));
    let _ = waiting.kill(); // by pid, if it hung
    let mut err = String::new();
    std::io::Read::read_to_string(&mut waiting.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.map(|s| s.code()), Some(Some(0)), "{err}");
    assert!(ran.exists(), "the command ran: {err}");
    assert!(err.contains("waiting for the next one"), "{err}");
    new.assert_all_free();
}

fn status_text(broker: &RunningBroker) -> String {
    let out = baton()
        .args(["status", "--socket"])
        .arg(&broker.socket)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn holder_stopped(broker: &RunningBroker) -> bool {
    broker.status().holders.iter().any(|h| h.stopped)
}

/// A stopped build keeps its tokens while others wait: `status` (text and
/// JSON) says it is stopped, whether its command or `baton run` itself
/// (`^Z` stops both) was stopped, and stops saying so once it goes on.
#[test]
fn a_stopped_build_is_shown_as_stopped() {
    let broker = RunningBroker::start(2);
    let mut run = broker
        .run(&["--jobserver-style", "none", "--", "sleep", "60"])
        .spawn_guarded()
        .unwrap();
    wait_for(Duration::from_secs(10), "the build to hold", || {
        broker.status().held == 1
    });
    assert!(!holder_stopped(&broker), "a running build is not stopped");
    let children = format!("/proc/{0}/task/{0}/children", run.id());
    let first_child = || {
        let text = std::fs::read_to_string(&children).unwrap_or_default();
        text.split_whitespace()
            .next()
            .map(|pid| pid.parse::<i32>().unwrap())
    };
    wait_for(Duration::from_secs(10), "baton run to start sleep", || {
        first_child().is_some()
    });
    let child = first_child().unwrap();
    for (pid, what) in [(child, "its command"), (run.id() as i32, "baton run")] {
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        wait_for(Duration::from_secs(10), what, || holder_stopped(&broker));
        assert!(status_text(&broker).contains("[stopped] baton run -- sleep 60"));
        unsafe { libc::kill(pid, libc::SIGCONT) };
        wait_for(Duration::from_secs(10), "it to go on", || {
            !holder_stopped(&broker)
        });
    }
    run.kill().unwrap();
    run.wait().unwrap();
}

/// A build of two 3-second jobs under `baton run`, logging to `log`.
fn spawn_logged_build(
    broker: &RunningBroker,
    dir: &Path,
    log: &Path,
    make: &Path,
    style: &str,
) -> Guarded {
    flat_makefile(dir, log, 2, "3");
    flat_ninja(dir, log, 2, "3");
    spawn_piped_build(broker, dir, style, make)
}

/// `kill -9` of a build's `baton run` while its jobs run: the jobs run on
/// (make dies, its children do not), so the broker keeps their tokens
/// until they end. A second build started right after waits for them:
/// never more than the limit of jobs at once, counted from the jobs.
fn a_killed_baton_runs_jobs_keep_their_tokens(make: &Path, style: &str) {
    killed_builds_jobs_keep_their_tokens(make, style, Victim::BatonRun);
}

/// Which process of a build is killed while its jobs run.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Victim {
    BatonRun,
    /// The command `baton run` runs (make): as the OOM killer would.
    Command,
}

fn killed_builds_jobs_keep_their_tokens(make: &Path, style: &str, victim: Victim) {
    let broker = RunningBroker::start(2);
    let (a, b) = (TempDir::new("orphans-a"), TempDir::new("orphans-b"));
    let log = a.path().join("jobs.log");
    let mut first = spawn_logged_build(&broker, a.path(), &log, make, style);
    wait_for(Duration::from_secs(30), "both jobs to run", || {
        max_overlap(&log).0 == 2
    });
    match victim {
        Victim::BatonRun => first.kill().unwrap(), // SIGKILL
        Victim::Command => {
            let make = children(first.id());
            assert_eq!(make.len(), 1, "baton run runs one command: {make:?}");
            // SAFETY: kill takes any pid; this one is our grandchild.
            unsafe { libc::kill(make[0] as i32, libc::SIGKILL) };
        }
    }
    first.wait().unwrap();
    let second = spawn_logged_build(&broker, b.path(), &log, make, style);
    let out = second.wait_with_output().unwrap();
    assert!(out.status.success());
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 4, "every job ran");
    assert_eq!(
        most, 2,
        "{most} jobs ran at once under a limit of 2 after {victim:?} was killed ({style})"
    );
    broker.wait_all_free();
}

#[test]
fn a_killed_baton_runs_jobs_keep_their_tokens_in_the_pipe_style() {
    a_killed_baton_runs_jobs_keep_their_tokens(&make43(), "pipe");
}

#[test]
fn a_killed_baton_runs_jobs_keep_their_tokens_in_the_fifo_style() {
    a_killed_baton_runs_jobs_keep_their_tokens(&make44(), "fifo");
}

#[test]
fn a_killed_baton_runs_jobs_keep_their_tokens_in_the_fuse_style() {
    a_killed_baton_runs_jobs_keep_their_tokens(&make44(), "fuse");
}

/// `kill -9` of make itself, not of `baton run`: `baton run` ends with
/// make, and its jobs run on just the same.
#[test]
fn a_killed_commands_jobs_keep_their_tokens_in_the_fifo_style() {
    killed_builds_jobs_keep_their_tokens(&make44(), "fifo", Victim::Command);
}

#[test]
fn a_killed_commands_jobs_keep_their_tokens_in_the_pipe_style() {
    killed_builds_jobs_keep_their_tokens(&make43(), "pipe", Victim::Command);
}

#[test]
fn a_killed_baton_runs_jobs_keep_their_tokens_with_ninja() {
    a_killed_baton_runs_jobs_keep_their_tokens(&ninja(), "fifo");
}

#[test]
fn a_killed_baton_runs_jobs_keep_their_tokens_with_bmake() {
    a_killed_baton_runs_jobs_keep_their_tokens(&bmake(), "auto");
}

/// The jobs `status` counts for the build (`builds[].running`).
fn jobs_seen(broker: &RunningBroker) -> Option<u32> {
    broker.status().builds.iter().find_map(|b| b.running)
}

/// `status` counts what a build runs from its processes, beside the tokens
/// it holds: a sub-make with `-j4` on its own command line runs 4 jobs
/// under a limit of 2, past the jobserver, and the broker sees all 4 (and
/// the text status shows them in its JOBS column); a build within its
/// tokens shows as many jobs as it runs.
#[test]
fn status_counts_the_jobs_a_build_runs_past_its_tokens() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("jobs-seen");
    let log = dir.path().join("jobs.log");
    let jobs: Vec<String> = (0..4).map(|i| format!("s{i}")).collect();
    std::fs::write(
        dir.path().join("sub.mk"),
        format!(
            "all: {all}\n{all}:\n\t@{job}\n.PHONY: all {all}\n",
            all = jobs.join(" "),
            job = logged_job(&log, "4")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("Makefile"),
        "all:\n\t@$(MAKE) -s -j4 -f sub.mk\n",
    )
    .unwrap();
    let child = spawn_piped_build(&broker, dir.path(), "fifo", &make44());
    wait_for(Duration::from_secs(30), "4 jobs to run", || {
        max_overlap(&log).0 == 4
    });
    wait_for(
        Duration::from_secs(10),
        "the broker to count 4 jobs",
        || jobs_seen(&broker) == Some(4),
    );
    let status = broker.status();
    assert!(status.held <= 2, "{status:#?}");
    let text = status_text(&broker);
    let row = text
        .lines()
        .skip_while(|l| *l != "BUILDS")
        .find(|l| l.contains("baton run --"))
        .unwrap_or_else(|| panic!("no build row:\n{text}"));
    assert!(
        row.split_whitespace().nth(3) == Some("4"),
        "JOBS column: {text}"
    );
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    broker.assert_all_free();
}

/// Stray bytes written into a build's jobserver (77 at once, as a client
/// gone wrong might) are taken out, counted and reported: `baton status`
/// shows them beside the build while it runs, `baton run` says so at its
/// end, and no token is made: the pool has its limit back, all free.
fn stray_bytes_are_taken_out_and_reported(make: &Path, style: &str) {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("stray");
    let log = dir.path().join("jobs.log");
    logged_makefile(dir.path(), &log, 6, "1");
    let run = spawn_piped_build(&broker, dir.path(), style, make);
    wait_for(Duration::from_secs(30), "both jobs to run", || {
        running(&log) == 2
    });
    let make_pid = children(run.id())[0];
    let mut jobserver = std::fs::OpenOptions::new()
        .write(true)
        .open(jobserver_of(make_pid))
        .unwrap();
    jobserver.write_all(&[b'+'; 77]).unwrap();
    drop(jobserver);
    wait_for(Duration::from_secs(30), "the stray bytes in status", || {
        broker.status().builds.iter().any(|b| b.stray > 0)
    });
    assert!(
        status_text(&broker).contains("stray byte(s) taken out of its jobserver"),
        "{}",
        status_text(&broker)
    );
    let out = run.wait_with_output().unwrap();
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("stray byte(s) were taken out of the build's jobserver in all"),
        "{said}"
    );
    assert!(broker.log().contains("stray byte(s)"), "{}", broker.log());
    broker.wait_all_free();
}

#[test]
fn stray_bytes_are_taken_out_and_reported_in_the_fifo_style() {
    stray_bytes_are_taken_out_and_reported(&make44(), "fifo");
}

#[test]
fn stray_bytes_are_taken_out_and_reported_in_the_pipe_style() {
    stray_bytes_are_taken_out_and_reported(&make43(), "pipe");
}

/// A job that logs `S who` and `E who` around a sleep of `secs`.
fn job_of(who: &str, log: &Path, secs: &str) -> String {
    format!(
        "echo 'S {who}' >> {log}; sleep {secs}; echo 'E {who}' >> {log}",
        log = log.display()
    )
}

/// One sub-make under a top make: j0 (5 s) and j1 (1.5 s) at once, then
/// j2, j3 and j4 (1 s each) once j1 is done. GNU make and bmake both
/// read it. Its jobs log as `A`.
fn a_sub_make_with_work_after_a_short_job(dir: &Path, log: &Path) {
    let top = "all: s0\ns0:\n\t@${MAKE} -f sub.mk\n.PHONY: all s0\n";
    std::fs::write(dir.join("Makefile"), top).unwrap();
    let sub = format!(
        "all: j0 j2 j3 j4\nj0:\n\t@{long}\nj1:\n\t@{short}\nj2 j3 j4: j1\n\t@{next}\n\
         .PHONY: all j0 j1 j2 j3 j4\n",
        long = job_of("A", log, "5"),
        short = job_of("A", log, "1.5"),
        next = job_of("A", log, "1"),
    );
    std::fs::write(dir.join("sub.mk"), sub).unwrap();
}

/// From a log of `S who` and `E who` lines: the most jobs at once.
fn most_at_once(log: &Path) -> usize {
    let text = std::fs::read_to_string(log).unwrap();
    let (mut running, mut most) = (0usize, 0);
    for line in text.lines() {
        match line.split_once(' ') {
            Some(("S", _)) => running += 1,
            Some(("E", _)) => running -= 1,
            _ => {}
        }
        most = most.max(running);
    }
    most
}

/// `kill -9` of the top make (or of its `baton run`) while its sub-make
/// runs two jobs, with three more to start once the short one ends: the
/// sub-make runs on and reads the jobserver `baton run` left. Never more
/// than the limit of jobs at once, counted from the jobs, with a second
/// build started at once. When make is killed, `baton run` takes what
/// the sub-make had not read back to the pool as it ends: the orphaned
/// build keeps the 2 its jobs use. A killed `baton run` cannot: the
/// broker keeps all its build holds while a sub-make of it lives.
fn a_killed_builds_sub_make_stays_within_the_limit(make: &Path, style: &str, victim: Victim) {
    let broker = RunningBroker::start(4);
    let (a, b) = (TempDir::new("subs-a"), TempDir::new("subs-b"));
    let log = a.path().join("jobs.log");
    a_sub_make_with_work_after_a_short_job(a.path(), &log);
    let mut first = spawn_piped_build(&broker, a.path(), style, make);
    wait_for(Duration::from_secs(30), "two jobs to run", || {
        running(&log) == 2
    });
    let top = children(first.id());
    assert_eq!(top.len(), 1, "baton run runs one command: {top:?}");
    match victim {
        Victim::BatonRun => first.kill().unwrap(), // SIGKILL
        // SAFETY: kill takes any pid; this one is our grandchild.
        Victim::Command => unsafe {
            libc::kill(top[0] as i32, libc::SIGKILL);
        },
    }
    first.wait().unwrap();
    let mut orphaned = None;
    wait_for(Duration::from_secs(10), "the build to be orphaned", || {
        let holders = broker.status().holders;
        orphaned = holders
            .iter()
            .find(|h| h.command.starts_with("[orphaned] "))
            .map(|h| h.tokens);
        orphaned.is_some()
    });
    if victim == Victim::Command {
        assert!(
            orphaned <= Some(2),
            "the tokens the sub-make had not read stayed with the build: {orphaned:?} ({style})"
        );
    }
    let b_jobs = (0..4)
        .map(|i| format!("b{i}:\n\t@{}\n", job_of("B", &log, "2")))
        .collect::<String>();
    let b_makefile = format!("all: b0 b1 b2 b3\n{b_jobs}.PHONY: all b0 b1 b2 b3\n");
    std::fs::write(b.path().join("Makefile"), b_makefile).unwrap();
    let second = spawn_piped_build(&broker, b.path(), style, make);
    let out = second.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    broker.wait_all_free();
    let most = most_at_once(&log);
    assert!(
        most <= 4,
        "{most} jobs ran at once under a limit of 4 after {victim:?} was killed ({style}):\n{}",
        std::fs::read_to_string(&log).unwrap()
    );
}

#[test]
fn a_killed_top_makes_sub_make_stays_within_the_limit_in_the_pipe_style() {
    a_killed_builds_sub_make_stays_within_the_limit(&make43(), "pipe", Victim::Command);
}

#[test]
fn a_killed_baton_runs_sub_make_stays_within_the_limit_in_the_pipe_style() {
    a_killed_builds_sub_make_stays_within_the_limit(&make43(), "pipe", Victim::BatonRun);
}

#[test]
fn a_killed_top_makes_sub_make_stays_within_the_limit_in_the_fifo_style() {
    a_killed_builds_sub_make_stays_within_the_limit(&make44(), "fifo", Victim::Command);
}

#[test]
fn a_killed_baton_runs_sub_make_stays_within_the_limit_in_the_fifo_style() {
    a_killed_builds_sub_make_stays_within_the_limit(&make44(), "fifo", Victim::BatonRun);
}

#[test]
fn a_killed_top_makes_sub_make_stays_within_the_limit_with_bmake() {
    a_killed_builds_sub_make_stays_within_the_limit(&bmake(), "auto", Victim::Command);
}

#[test]
fn a_killed_baton_runs_sub_make_stays_within_the_limit_with_bmake() {
    a_killed_builds_sub_make_stays_within_the_limit(&bmake(), "auto", Victim::BatonRun);
}
