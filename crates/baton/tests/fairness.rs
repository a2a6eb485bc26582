//! Full speed and fair shares with the real tools: each client alone runs
//! as many jobs at once as the limit allows, builds started together stay
//! within the limit and all finish, and the broker knows which clients make
//! up one build.

mod common;

use common::*;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

fn finish(mut build: Guarded) {
    let status = wait_timeout(&mut build, Duration::from_secs(120)).expect("the build ends");
    assert!(status.success(), "the build failed: {status}");
}

/// One build alone on a pool of 4, with as many jobs as tokens, all ready
/// at once: all 4 run together, never more. (ninja fed one token at a time
/// ran 3 here: it starts its jobs in one burst of reads.)
fn reaches_the_limit(tool: PathBuf, style: &str, ninja_file: bool) {
    let broker = RunningBroker::start(4);
    let dir = TempDir::new("alone");
    let log = dir.path().join("jobs.log");
    if ninja_file {
        flat_ninja(dir.path(), &log, 4, "0.5");
    } else {
        flat_makefile(dir.path(), &log, 4, "0.5");
    }
    finish(spawn_build(
        &broker,
        dir.path(),
        &["--jobserver-style", style],
        &tool,
    ));
    assert_eq!(
        max_overlap(&log),
        (4, 4),
        "(most jobs at once, jobs started) under --jobs 4"
    );
    assert_clean_end(&broker);
}

#[test]
fn make_4_3_pipe_alone_reaches_the_limit() {
    reaches_the_limit(make43(), "pipe", false);
}

#[test]
fn make_4_4_fifo_alone_reaches_the_limit() {
    reaches_the_limit(make44(), "fifo", false);
}

#[test]
fn make_4_4_fuse_alone_reaches_the_limit() {
    reaches_the_limit(make44(), "fuse", false);
}

/// ninja 1.13 reads a token only as it starts a job and stops reading at
/// the first empty read: it reaches the limit only if the tokens are in its
/// FIFO before it asks.
#[test]
fn ninja_1_13_alone_reaches_the_limit() {
    reaches_the_limit(ninja(), "fifo", true);
}

#[test]
fn three_weighted_builds_stay_within_the_limit_all_finish_and_show_in_status() {
    let broker = RunningBroker::start(4);
    let log = broker.dir.path().join("all-jobs.log");
    let dirs: Vec<TempDir> = (0..3)
        .map(|i| TempDir::new(&format!("weighted{i}")))
        .collect();
    flat_makefile(dirs[0].path(), &log, 20, "0.2");
    flat_makefile(dirs[1].path(), &log, 20, "0.2");
    flat_ninja(dirs[2].path(), &log, 20, "0.2");
    let builds = [
        spawn_build(
            &broker,
            dirs[0].path(),
            &["--name", "m43", "--jobserver-style", "pipe"],
            &make43(),
        ),
        spawn_build(
            &broker,
            dirs[1].path(),
            &["--name", "m44", "--jobserver-style", "fifo"],
            &make44(),
        ),
        spawn_build(
            &broker,
            dirs[2].path(),
            &["--name", "ninja", "--weight", "2"],
            &ninja(),
        ),
    ];
    wait_for(
        Duration::from_secs(30),
        "three named builds in status",
        || {
            let s = broker.status();
            ["m43", "m44", "ninja"]
                .iter()
                .all(|n| s.builds.iter().any(|b| b.name == *n))
        },
    );
    let s = broker.status();
    let weight = |name: &str| s.builds.iter().find(|b| b.name == name).map(|b| b.weight);
    assert_eq!(
        (weight("m43"), weight("m44"), weight("ninja")),
        (Some(1), Some(1), Some(2)),
        "{s:#?}"
    );
    for b in builds {
        finish(b);
    }
    let (max, started) = max_overlap(&log);
    assert_eq!(started, 60);
    assert!(
        max <= 4,
        "{max} jobs at once across three builds under --jobs 4"
    );
    assert_clean_end(&broker);
    let s = broker.status();
    assert!(
        s.builds
            .iter()
            .all(|b| !["m43", "m44", "ninja"].contains(&b.name.as_str())),
        "finished builds are forgotten: {s:#?}"
    );
}

/// A `baton run` inside another (as a make recipe would run it) belongs to
/// the outer build: one build holds both tokens, under the outer name.
#[test]
fn a_client_under_baton_run_joins_its_build() {
    let broker = RunningBroker::start(4);
    let socket = broker.socket.to_str().unwrap().to_string();
    let inner = format!(
        "exec {} run --socket {socket} --name inner --weight 5 --jobserver-style none -- sleep 30",
        baton_bin()
    );
    let mut outer = broker
        .run(&[
            "--name",
            "outer",
            "--weight",
            "3",
            "--jobserver-style",
            "none",
            "--",
            "sh",
            "-c",
            &inner,
        ])
        .spawn_guarded()
        .unwrap();
    wait_for(
        Duration::from_secs(10),
        "both baton runs to hold their token",
        || broker.status().held == 2,
    );
    let s = broker.status();
    let named: Vec<_> = s.builds.iter().filter(|b| b.held > 0).collect();
    assert_eq!(named.len(), 1, "one build: {s:#?}");
    assert_eq!(
        (
            named[0].name.as_str(),
            named[0].weight,
            named[0].held,
            named[0].pid
        ),
        ("outer", 3, 2, outer.id())
    );
    unsafe { libc::kill(outer.id() as i32, libc::SIGTERM) };
    outer.wait().unwrap();
    wait_for(Duration::from_secs(10), "the tokens to come back", || {
        broker.status().held == 0
    });
    broker.assert_all_free();
}

#[test]
fn make_4_3_is_refused_the_fifo_style_with_what_to_use() {
    let broker = RunningBroker::start(2);
    let dir = TempDir::new("refuse");
    flat_makefile(dir.path(), &dir.path().join("jobs.log"), 2, "0");
    let out = broker
        .run(&[
            "--jobserver-style",
            "fifo",
            "--",
            make43().to_str().unwrap(),
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("baton: ") && err.contains("pipe or auto"),
        "{err}"
    );
    assert!(!dir.path().join("jobs.log").exists(), "make did not run");
    broker.assert_all_free();
}

#[test]
fn a_weight_out_of_range_is_refused_by_the_cli() {
    let broker = RunningBroker::start(2);
    for bad in ["0", "1001", "x"] {
        let out = broker
            .run(&["--weight", bad, "--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "--weight {bad}");
    }
}

/// A client in a process of its own that says each line it is given to
/// the broker and prints the reply: a build apart from the test's process.
struct WireClient {
    child: Guarded,
    reader: std::io::BufReader<std::process::ChildStdout>,
}

impl WireClient {
    const RELAY: &'static str = "import socket,sys\n\
s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f=s.makefile('rw')\n\
for line in sys.stdin:\n    f.write(line); f.flush(); print(f.readline().rstrip(), flush=True)\n";

    fn start(broker: &RunningBroker) -> Self {
        let mut child = std::process::Command::new("python3")
            .args(["-c", Self::RELAY, broker.socket.to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn_guarded()
            .expect("python3");
        let reader = std::io::BufReader::new(child.stdout.take().unwrap());
        WireClient { child, reader }
    }

    fn say(&mut self, line: &str) -> String {
        use std::io::{BufRead, Write};
        writeln!(self.child.stdin.as_mut().unwrap(), "{line}").unwrap();
        let mut reply = String::new();
        self.reader.read_line(&mut reply).unwrap();
        reply.trim_end().to_string()
    }
}

impl Drop for WireClient {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// BUILD and WANTED on the wire, as docs/protocol.md shows them. WANTED
/// counts only other builds' waits: a client in the same process as the
/// build's start is in the build.
#[test]
fn build_and_wanted_on_the_wire() {
    use std::io::Write;
    let broker = RunningBroker::start(1);
    let mut a = WireClient::start(&broker);
    assert!(a.say("HELLO 1 a").starts_with("OK 1 "));
    let reply = a.say("BUILD 2 nightly");
    let words: Vec<&str> = reply.split(' ').collect();
    assert_eq!(
        (words[0], words[2], words.len()),
        ("BUILD", "2", 3),
        "{reply}"
    );
    assert_eq!(
        a.say("BUILD 0"),
        "ERR range a weight must be from 1 to 1000, not 0"
    );
    assert_eq!(a.say("ACQUIRE 1"), "GRANTED 1 1");
    assert_eq!(a.say("WANTED"), "WANTED 0 0");
    // The test's own client is under no build: it is another build.
    let b = std::os::unix::net::UnixStream::connect(&broker.socket).unwrap();
    (&b).write_all(b"HELLO 1 b\nACQUIRE 1\n").unwrap();
    wait_for(Duration::from_secs(10), "b to wait", || {
        broker.status().waiters.len() == 1
    });
    assert_eq!(a.say("WANTED"), "WANTED 1 0");
    let s = broker.status();
    let nightly = s
        .builds
        .iter()
        .find(|b| b.name == "nightly")
        .expect("the build shows");
    assert_eq!(
        (nightly.weight, nightly.held, nightly.grants, nightly.pid),
        (2, 1, 1, a.child.id())
    );
    assert_eq!(a.say("RELEASE 1"), "RELEASED 1 0");
    drop(a);
    drop(b);
    wait_for(Duration::from_secs(10), "b's token to come back", || {
        broker.status().held == 0
    });
    broker.assert_all_free();
}

/// `baton bench builds` at a small scale, with the real tools: every case
/// and tool has its row, the alone rows their ratios, and the shares of
/// each three-at-once case add up to the whole.
#[test]
fn bench_builds_measures_every_case_with_the_real_tools() {
    let dir = TempDir::new("bench-builds");
    let plot = dir.path().join("builds.svg");
    let doc = bench_builds(&[
        "--ops",
        "20",
        "--tokens",
        "4",
        "--job-us",
        "50000",
        "--rounds",
        "2",
        "--json",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    let rows = doc["results"].as_array().unwrap();
    // Two rounds of each tool alone still give one row per tool and way: medians.
    assert_eq!(doc["parameters"]["rounds"], 2, "{doc:#}");
    // The containers case (two rows: each its own -jN, then one pool) runs
    // where containers can be made: as root, with unshare.
    let contained: Vec<&serde_json::Value> =
        rows.iter().filter(|r| r["case"] == "containers").collect();
    let notes = doc["notes"].to_string();
    if notes.contains("containers: not measured") {
        assert!(contained.is_empty(), "{doc:#}");
    } else {
        let ways: Vec<&str> = contained
            .iter()
            .map(|r| r["mechanism"].as_str().unwrap())
            .collect();
        assert_eq!(ways.len(), 2, "{doc:#}");
        assert_eq!(ways[1], "baton run", "{doc:#}");
        let cpus = doc["machine"]["cpus"].as_u64().unwrap();
        let peak = |r: &serde_json::Value| r["peak"].as_u64().unwrap();
        assert!(
            peak(contained[1]) <= cpus,
            "one pool of {cpus} tokens across the containers: {doc:#}"
        );
    }
    assert_eq!(rows.len() - contained.len(), 2 * 5 + 3 * 3, "{doc:#}");
    let alone: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|r| r["case"] == "alone" && r["mechanism"] == "baton run")
        .collect();
    let tools: Vec<&str> = alone.iter().map(|r| r["tool"].as_str().unwrap()).collect();
    assert_eq!(
        tools,
        ["make 4.3", "make 4.4.1", "ninja 1.13", "bmake", "cargo"]
    );
    for row in alone {
        assert_eq!(
            row["rounds"], 2,
            "each tool alone was measured in two rounds: {row}"
        );
        // Every job ran, logged by the job itself (a rustc wrapper for
        // cargo; bash, which bmake's .SHELL names, for bmake).
        assert!(
            row["running_ratio"].as_f64().is_some_and(|x| x > 0.0)
                && row["wall_ratio"].as_f64().is_some_and(|x| x > 0.0),
            "{row}"
        );
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    for label in [
        "each alone",
        "cargo",
        "three at once, one shared FIFO",
        "weights 1:1:2, baton",
        "fair share",
    ] {
        assert!(svg.contains(label), "the plot has no {label:?}");
    }
    for case in [
        "three at once, baton",
        "three at once, one shared FIFO",
        "weights 1:1:2, baton",
    ] {
        let shares: Vec<f64> = rows
            .iter()
            .filter(|r| r["case"] == case)
            .map(|r| r["share"].as_f64().unwrap())
            .collect();
        assert_eq!(shares.len(), 3, "{case}");
        // The shares are each build's part of the three's job-seconds, so
        // they add up to 1 by construction once anything ran; what shows
        // the case was measured is that each of the three builds ran jobs
        // while all three ran.
        assert!(
            shares.iter().all(|&s| s > 0.0),
            "{case}: a build ran no job while all three ran: {shares:?}"
        );
    }
    let weights: Vec<f64> = rows
        .iter()
        .filter(|r| r["case"] == "weights 1:1:2, baton")
        .map(|r| r["fair_share"].as_f64().unwrap())
        .collect();
    assert_eq!(weights, vec![0.25, 0.25, 0.5]);
}

/// `baton bench builds ARGS` with the suite's make, ninja and bmake; its
/// JSON document.
fn bench_builds(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(baton_bin())
        .args(["bench", "builds"])
        .args(args)
        .env("BATON_BENCH_MAKE43", make43())
        .env("BATON_BENCH_MAKE44", make44())
        .env("BATON_BENCH_NINJA", ninja())
        .env("BATON_BENCH_BMAKE", bmake())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// With one round, each alone ratio is baton run's figure over the
/// tool's own, of the two rows beside it: baton / own, not own / baton
/// (a build slower under baton reads above 1).
#[test]
fn bench_builds_ratios_are_baton_over_own() {
    let doc = bench_builds(&[
        "--ops", "8", "--tokens", "4", "--job-us", "20000", "--rounds", "1", "--json",
    ]);
    let rows = doc["results"].as_array().unwrap();
    let alone = |tool: &serde_json::Value, way: &str| {
        rows.iter()
            .find(|r| r["case"] == "alone" && r["tool"] == *tool && r["mechanism"] == way)
            .unwrap_or_else(|| panic!("no alone row of {tool} for {way}: {doc:#}"))
    };
    let batons: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|r| r["case"] == "alone" && r["mechanism"] == "baton run")
        .collect();
    assert_eq!(batons.len(), 5, "{doc:#}");
    for baton in batons {
        let own = alone(&baton["tool"], "own -j4");
        let wall = |r: &serde_json::Value| r["wall_s"].as_f64().unwrap();
        let expected = wall(baton) / wall(own);
        let ratio = baton["wall_ratio"].as_f64().unwrap();
        // wall_ratio is rounded to three decimals.
        assert!(
            (ratio - expected).abs() <= 0.0006,
            "wall_ratio {ratio} is not baton's wall over own's ({expected}): {baton} {own}"
        );
    }
}
