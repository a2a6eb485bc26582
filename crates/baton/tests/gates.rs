//! The memory and load gates against the real binary, a real memory cgroup
//! and real make: a build that the OOM killer ends under plain `make -j8`
//! finishes under baton's memory gate in the same cgroup.
//!
//! Needs root and a writable memory cgroup (v1 here; v2 where mounted with
//! the memory controller). Without them the tests say they were skipped.

mod common;

use baton_bench::cgroup::{MemCgroup, Unusable};
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

/// A Makefile of `jobs` jobs, each touching `mib` MiB for `secs` seconds
/// and logging its start and end.
fn memory_makefile(dir: &Path, log: &Path, jobs: usize, mib: u64, secs: f64) {
    let targets: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
    let job = format!(
        "echo S >> {log}; python3 -c 'import time; x = b\"1\" * ({mib} << 20); time.sleep({secs})' && echo E >> {log}",
        log = log.display()
    );
    let text = format!(
        "all: {all}\n{all}:\n\t@{job}\n.PHONY: all {all}\n",
        all = targets.join(" ")
    );
    std::fs::write(dir.join("Makefile"), text).unwrap();
}

const MIB: u64 = 1 << 20;

/// A memory cgroup of `limit` bytes for this test; None, with the skip
/// recorded under its cause, where none can be made here.
fn memory_cgroup(name: &str, limit: u64) -> Option<MemCgroup> {
    match MemCgroup::new(name, limit) {
        Ok(cgroup) => Some(cgroup),
        Err(why) => {
            let missing = match why.downcast_ref::<Unusable>() {
                Some(Unusable::NotRoot) => Missing::Root,
                Some(Unusable::NoMemoryCgroup(_)) => Missing::Cgroup,
                None => panic!("making the memory cgroup: {why:#}"),
            };
            skip(missing, &format!("{why:#}"));
            None
        }
    }
}

/// Runs `command` inside `cgroup`, in `dir`, without the caller's
/// MAKEFLAGS; its output and the OOM kills the cgroup counted meanwhile.
fn run_in(cgroup: &MemCgroup, dir: &Path, command: &[&str]) -> (Output, u64) {
    let before = cgroup.oom_kills().unwrap();
    let out = cgroup
        .command()
        .args(command)
        .current_dir(dir)
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    (out, cgroup.oom_kills().unwrap() - before)
}

/// `baton run --socket S -- MAKE -s` for `broker`.
fn gated_make<'a>(broker: &'a RunningBroker, make: &'a Path) -> [&'a str; 7] {
    [
        baton_bin(),
        "run",
        "--socket",
        broker.socket.to_str().unwrap(),
        "--",
        make.to_str().unwrap(),
        "-s",
    ]
}

#[test]
fn a_build_the_oom_killer_ends_under_make_j8_finishes_under_the_memory_gate() {
    let Some(cgroup) = memory_cgroup("test-oom", 1024 * MIB) else {
        return;
    };
    let enter = cgroup.enter();
    let enter: Vec<&str> = enter.iter().map(String::as_str).collect();
    let make = make43();

    // The control: plain make -j8 in the same cgroup gets jobs killed.
    let control = TempDir::new("oom-control");
    let control_log = control.path().join("jobs.log");
    memory_makefile(control.path(), &control_log, 12, 250, 1.0);
    let (out, control_kills) = run_in(
        &cgroup,
        control.path(),
        &[make.to_str().unwrap(), "-j8", "-k", "-s"],
    );
    assert!(
        control_kills > 0 && !out.status.success(),
        "the scenario must bite: make -j8 in 1 GiB had {control_kills} OOM kills, exit {:?}",
        out.status
    );

    // The same build under baton's memory gate, broker and build inside
    // the cgroup.
    // With the pause as well: on a loaded machine a job may not touch its
    // memory within the settle time, and the gate alone then admits too
    // many (docs/adaptive.md); the pause stops the late growers.
    let broker = RunningBroker::start_under(
        &enter,
        8,
        &[
            "--min-mem-available",
            "200M",
            "--mem-settle",
            "2000",
            "--on-memory-pressure",
            "pause",
        ],
    );
    let dir = TempDir::new("oom-gated");
    let log = dir.path().join("jobs.log");
    memory_makefile(dir.path(), &log, 12, 250, 1.0);
    let (out, kills) = run_in(&cgroup, dir.path(), &gated_make(&broker, &make));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the gated build failed: {err}");
    assert_eq!(kills, 0, "no OOM kill under the gate");
    let (most, started) = max_overlap(&log);
    assert_eq!(started, 12);
    assert!(
        most >= 2,
        "the gate must not run the build one job at a time: at most {most} at once"
    );
    broker.assert_all_free();
}

/// A Makefile of `jobs` jobs that start at 50 MiB and, 0.5 s later, grow
/// to 300 MiB, hold it for a second, and log their start and end.
///
/// In a 1 GiB cgroup four grown jobs (about 1.25 GiB with Python's own)
/// do not fit, so `make -j4` is killed; under the pause, two grown and two
/// stopped at 64 MiB leave about 250 MiB, the room the gates' thread has
/// to see a job that grows. Jobs of 400 MiB left it 60 MiB: 6 of Python's
/// allocations, and on a busy CI machine a look came too late.
///
/// With `together`, a grown job holds its memory until that many jobs
/// have grown (or 20 s pass): on a loaded machine the first of four could
/// otherwise end before the last has started, and the control that must
/// be killed would not be.
fn growing_makefile(dir: &Path, log: &Path, jobs: usize, together: usize) {
    let grow = format!(
        "import glob, os, time\nx = [b'1' * (50 << 20)]\ntime.sleep(0.5)\n\
         for _ in range(25):\n    x.append(b'1' * (10 << 20))\n\
         open('grown.%d' % os.getpid(), 'w').close()\n\
         deadline = time.monotonic() + 20\n\
         while len(glob.glob('grown.*')) < {together} and time.monotonic() < deadline:\n    time.sleep(0.05)\n\
         time.sleep(1)\n"
    );
    std::fs::write(dir.join("grow.py"), grow).unwrap();
    let targets: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
    let job = format!(
        "echo S >> {log}; python3 grow.py && echo E >> {log}",
        log = log.display()
    );
    let text = format!(
        "all: {all}\n{all}:\n\t@{job}\n.PHONY: all {all}\n",
        all = targets.join(" ")
    );
    std::fs::write(dir.join("Makefile"), text).unwrap();
}

#[test]
fn jobs_that_grow_after_their_grant_are_paused_not_killed() {
    let Some(cgroup) = memory_cgroup("test-pause", 1024 * MIB) else {
        return;
    };
    let enter = cgroup.enter();
    let enter: Vec<&str> = enter.iter().map(String::as_str).collect();
    let make = make43();

    // The control: plain make -j4 in the same cgroup gets jobs killed.
    let control = TempDir::new("pause-control");
    growing_makefile(control.path(), &control.path().join("jobs.log"), 8, 4);
    let (out, control_kills) = run_in(
        &cgroup,
        control.path(),
        &[make.to_str().unwrap(), "-j4", "-k", "-s"],
    );
    assert!(
        control_kills > 0 && !out.status.success(),
        "the scenario must bite: make -j4 in 1 GiB had {control_kills} OOM kills, exit {:?}",
        out.status
    );

    // A settle time shorter than the jobs take to grow: the gate sees only
    // the 50 MiB each starts with, and admits all 4 (1.2 GB once grown).
    let broker = RunningBroker::start_under(
        &enter,
        4,
        &[
            "--min-mem-available",
            "400M",
            "--mem-settle",
            "200",
            "--on-memory-pressure",
            "pause",
            "-v",
        ],
    );
    let dir = TempDir::new("pause");
    let log = dir.path().join("jobs.log");
    growing_makefile(dir.path(), &log, 8, 0);
    let (out, kills) = run_in(&cgroup, dir.path(), &gated_make(&broker, &make));
    let broker_log = broker.log();
    assert!(
        out.status.success(),
        "the build failed: {}\n{broker_log}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(kills, 0, "no OOM kill with pausing: {broker_log}");
    assert_eq!(max_overlap(&log).1, 8);
    let (paused, resumed) = (
        broker_log.matches("paused job pid").count(),
        broker_log.matches("resumed job pid").count(),
    );
    assert!(paused > 0, "at least one job paused: {broker_log}");
    assert_eq!(paused, resumed, "every paused job resumed: {broker_log}");
    broker.assert_all_free();
}

#[test]
fn a_psi_trigger_wakes_the_pressure_gate() {
    // Real memory pressure: a file twice a 32 MiB cgroup's limit, written
    // and read from inside it, so that every read reclaims and stalls.
    let Some(cgroup) = memory_cgroup("test-psi", 32 * MIB) else {
        return;
    };
    let broker = RunningBroker::start_with(2, &["--max-mem-pressure", "1", "-v"]);
    wait_for(
        Duration::from_secs(30),
        "the gates' thread to arm its triggers",
        || broker.log().contains("PSI trigger"),
    );
    let log = broker.log();
    if !log.contains("1 PSI trigger") {
        return skip(
            Missing::PsiTrigger,
            &format!("the kernel offers no PSI trigger here: {log}"),
        );
    }
    let dir = TempDir::new("psi");
    let file = dir.path().join("big");
    let enter = cgroup.enter();
    let thrash = format!(
        "head -c 64M /dev/zero > {f}; while :; do cat {f} > /dev/null; done",
        f = file.display()
    );
    let mut pressure = Command::new(&enter[0])
        .args(&enter[1..])
        .args(["sh", "-c", &thrash])
        .spawn_guarded()
        .unwrap();
    wait_for(
        Duration::from_secs(60),
        "the memory pressure trigger to fire",
        || {
            broker
                .log()
                .contains("woken by the memory pressure trigger")
        },
    );
    wait_for(
        Duration::from_secs(30),
        "the pressure gate to close",
        || {
            broker
                .status()
                .gates
                .iter()
                .any(|g| g.name == "mem-pressure" && !g.open)
        },
    );
    unsafe { libc::kill(pressure.id() as i32, libc::SIGKILL) };
    pressure.wait().unwrap();
    broker.assert_all_free();
}

#[test]
fn gates_are_shown_by_status_and_set_live() {
    let broker =
        RunningBroker::start_with(4, &["--min-mem-available", "1.5G", "--max-load", "1000"]);
    let s = broker.status();
    let names: Vec<&str> = s.gates.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["mem-available", "load"]);
    assert_eq!(s.gates[0].threshold, 1.5 * 1024.0 * 1024.0 * 1024.0);
    assert!(s.gates.iter().all(|g| g.value.is_some()), "{:?}", s.gates);
    let out = baton()
        .args(["limit", "--socket"])
        .arg(&broker.socket)
        .args(["--max-load", "off", "--max-mem-pressure", "50"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let names: Vec<String> = broker.status().gates.into_iter().map(|g| g.name).collect();
    assert_eq!(names, ["mem-available", "mem-pressure"]);
    // A closed gate holds new tokens back, but never below one job.
    baton()
        .args(["limit", "--socket"])
        .arg(&broker.socket)
        .args(["--min-mem-available", "1000T"])
        .status()
        .unwrap();
    let mut a = broker.client("a");
    a.acquire(1).expect("one job always runs");
    let mut b = broker.client("b");
    assert!(!b.try_acquire(1).unwrap(), "the memory gate is closed");
    let s = broker.status();
    assert!(
        !s.gates[0].open && s.gates[0].closed_since.is_some(),
        "{:?}",
        s.gates
    );
    let text = String::from_utf8(
        baton()
            .args(["status", "--socket"])
            .arg(&broker.socket)
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(text.contains("gate mem-available CLOSED"), "{text}");
    // Opening it lets the waiter through.
    let waiter = std::thread::spawn(move || b.acquire(1).map(|_| b));
    wait_for(Duration::from_secs(10), "the waiter to queue", || {
        broker.status().waiters.len() == 1
    });
    baton()
        .args(["limit", "--socket"])
        .arg(&broker.socket)
        .args(["--min-mem-available", "off"])
        .status()
        .unwrap();
    let mut b = waiter
        .join()
        .unwrap()
        .expect("granted once the gate opened");
    b.release(1).unwrap();
    a.release(1).unwrap();
    broker.assert_all_free();
}

/// A memory threshold below a GiB reads in MiB, as it was given, in
/// `baton limit` and `baton status`; one above in GiB.
#[test]
fn memory_thresholds_read_as_they_were_given() {
    let broker =
        RunningBroker::start_with(2, &["--min-mem-available", "512M", "--max-load", "1000"]);
    let shown = |args: &[&str]| broker.cli(args);
    let limit = shown(&["limit"]);
    assert!(
        limit.contains("gate mem-available min 512M\n")
            && limit.contains("gate load          max 1000\n"),
        "{limit}"
    );
    let status = shown(&["status"]);
    assert!(status.contains("min 512M\n"), "{status}");
    let set = shown(&["limit", "--min-mem-available", "1.5G"]);
    assert!(set.contains("gate mem-available 1.5G"), "{set}");
    let limit = shown(&["limit"]);
    assert!(limit.contains("gate mem-available min 1.5G\n"), "{limit}");
    broker.assert_all_free();
}

/// With no gate set the gates' thread sleeps; setting one wakes it, and
/// from then on it measures: the load gate closes under stress-ng and
/// opens again once it ends, neither of which the reading the broker took
/// at its start could show.
#[test]
fn a_gate_set_on_a_broker_started_without_gates_is_measured() {
    let broker = RunningBroker::start(4);
    assert!(broker.status().gates.is_empty());
    let max_load = |load: &str| {
        let out = baton()
            .args(["limit", "--socket"])
            .arg(&broker.socket)
            .args(["--max-load", load])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let load_gate = || {
        let status = broker.status();
        let gate = status.gates.into_iter().find(|g| g.name == "load");
        gate.expect("the load gate is set")
    };
    // The machine's own load first: a CI host runs other tests beside
    // this one (and scripts/suite-under-load a stress-ng of its own).
    // stress-ng's six workers must close the gate above it, and it must
    // open again near it.
    max_load("1000");
    wait_for(
        Duration::from_secs(30),
        "a first reading of the load",
        || load_gate().value.is_some(),
    );
    let threshold = load_gate().value.unwrap().ceil() + 3.0;
    let stress_ng = which("stress-ng").expect("stress-ng (scripts/test installs it)");
    let mut stress = Command::new(stress_ng)
        .args(["--cpu", "6", "--timeout", "120", "--quiet"])
        .spawn_guarded()
        .unwrap();
    max_load(&threshold.to_string());
    let load_gate_is_open = || load_gate().open;
    wait_for(
        Duration::from_secs(30),
        "the load gate to close under stress-ng --cpu 6",
        || !load_gate_is_open(),
    );
    unsafe { libc::kill(stress.id() as i32, libc::SIGTERM) };
    stress.wait().unwrap();
    wait_for(
        Duration::from_secs(30),
        "the load gate to open once stress-ng ends",
        load_gate_is_open,
    );
    broker.assert_all_free();
}

/// The memory gate's slow start lets one job start while nothing has
/// settled: a request for three tokens at once, with nothing held, is
/// granted whole, not held back for ever.
#[test]
fn a_request_for_several_tokens_passes_the_memory_gate_whole() {
    let broker = RunningBroker::start_with(4, &["--min-mem-available", "1M"]);
    let mut a = broker.client("a");
    let (done, granted) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let result = a.acquire(3);
        done.send((result.is_ok(), a)).unwrap();
    });
    let (ok, mut a) = granted
        .recv_timeout(Duration::from_secs(30))
        .expect("three tokens granted within 30 s, with 1 MiB to keep free");
    assert!(ok);
    a.release(3).unwrap();
    broker.assert_all_free();
}

#[test]
fn bad_gate_values_are_refused_with_a_clear_message() {
    for (flag, value, says) in [
        ("--min-mem-available", "-1", "above zero"),
        (
            "--min-mem-available",
            "abc",
            "expected a positive number of bytes",
        ),
        ("--min-mem-available", "0", "above zero"),
        ("--max-mem-pressure", "101", "percentage"),
        ("--max-load", "0", "above 0"),
    ] {
        let out = baton()
            .args([
                "serve",
                "--jobs",
                "2",
                "--socket",
                "/nonexistent/s",
                flag,
                value,
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
    // The pause acts below the memory gate's threshold: it needs one.
    let out = baton()
        .args([
            "serve",
            "--jobs",
            "2",
            "--socket",
            "/nonexistent/s",
            "--on-memory-pressure",
            "pause",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--min-mem-available"),
        "{err}"
    );
    for good in ["2G", "512M", "1.5G"] {
        // Accepted: the broker gets as far as the socket's directory.
        let out = baton()
            .args([
                "serve",
                "--jobs",
                "2",
                "--socket",
                "/proc/nope/s",
                "--min-mem-available",
                good,
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("/proc/nope"), "{good}: {err}");
    }
}

#[test]
fn the_load_gate_holds_a_build_to_one_job_while_the_cpus_are_busy() {
    let stress_ng = which("stress-ng").expect("stress-ng (scripts/test installs it)");
    let mut stress = Command::new(stress_ng)
        .args(["--cpu", "4", "--timeout", "120", "--quiet"])
        .spawn_guarded()
        .unwrap();
    let broker = RunningBroker::start_with(4, &["--max-load", "3"]);
    wait_for(
        Duration::from_secs(30),
        "the load gate to close under stress-ng --cpu 6",
        || {
            broker
                .status()
                .gates
                .iter()
                .any(|g| g.name == "load" && !g.open)
        },
    );
    let dir = TempDir::new("load-gate");
    let log = dir.path().join("jobs.log");
    flat_makefile(dir.path(), &log, 6, "0.2");
    let out = broker
        .run(&["--", make43().to_str().unwrap(), "-s"])
        .current_dir(dir.path())
        .env_remove("MAKEFLAGS")
        .output()
        .unwrap();
    let load_gate_stayed_closed = broker
        .status()
        .gates
        .iter()
        .any(|g| g.name == "load" && !g.open);
    unsafe { libc::kill(stress.id() as i32, libc::SIGTERM) };
    stress.wait().unwrap();
    assert!(
        out.status.success(),
        "the build finishes under a closed gate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        load_gate_stayed_closed,
        "stress-ng kept the gate closed for the whole build"
    );
    assert_eq!(
        max_overlap(&log),
        (1, 6),
        "a closed gate lets only the build's own slot run jobs"
    );
    broker.assert_all_free();
}

fn which(program: &str) -> Result<PathBuf, ()> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(program))
        .find(|p| p.exists())
        .ok_or(())
}

#[test]
fn while_a_gate_is_set_builds_are_asked_to_give_back_what_their_jobs_return() {
    // A build keeps the tokens its jobs write back only while nobody wants
    // them (WANTED 0); with a gate set, the gates must see every new job.
    let plain = RunningBroker::start(4);
    assert_eq!(plain.client("build").wanted().unwrap(), (0, 4));
    let gated = RunningBroker::start_with(4, &["--max-load", "100000"]);
    assert_eq!(gated.client("build").wanted().unwrap(), (1, 4));
}
