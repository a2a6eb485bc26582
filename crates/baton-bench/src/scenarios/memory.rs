//! The memory gate against the OOM killer, in a real memory cgroup: jobs
//! that each touch 250 MiB for a while, in a cgroup of 1 GiB, built by plain
//! `make -jN`, by `make -jS` (S the largest -j whose jobs fit: 3) and by
//! `baton run -- make` under `baton serve --jobs N --min-mem-available
//! 200M --mem-settle 2000`, without and with `--on-memory-pressure pause`,
//! broker and build inside the cgroup, in alternating rounds. Each build's
//! OOM kills are the cgroup's own count (v1's `memory.oom_control`, v2's
//! `memory.events`).
//!
//! Needs root and a memory cgroup: cgroup v1's memory controller, or a
//! cgroup2 mount that offers `memory` (crate::cgroup; the cgroup is created
//! for the run and removed after it).

use super::{median, Bench, Defaults, Findings, Scale};
use crate::cgroup::MemCgroup;
use crate::measure::Usage;
use crate::mechanisms::baton::{BrokerProcess, Wait};
use crate::report::Row;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// waiters: plain make's -jN and the broker's --jobs (8); ops: rounds;
/// tokens: jobs per build (12); job_us: how long each job holds its memory.
pub const DEFAULTS: Defaults = Defaults {
    waiters: &[8],
    ops: 3,
    tokens: 12,
    job_us: 1_000_000,
    wake: 0,
};

const LIMIT_MIB: u64 = 1024;
const JOB_MIB: u64 = 250;
/// The largest -j whose jobs fit in the cgroup with room for make and the
/// shells: 3 × 250 MiB in 1 GiB.
const SAFE_J: usize = 3;
/// What the memory gate keeps free.
const GATE: &str = "200M";
/// How long a job counts as young: on a loaded machine a job takes more
/// than the default second to show its memory.
const SETTLE_MS: &str = "2000";

/// How one build is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Make(usize),
    /// `--jobs N`, and whether with `--on-memory-pressure pause`.
    Baton(usize, bool),
}

impl Way {
    fn name(self) -> String {
        match self {
            Way::Make(j) => format!("make -j{j}"),
            Way::Baton(j, false) => format!("baton --jobs {j}, gate {GATE}"),
            Way::Baton(j, true) => format!("baton --jobs {j}, gate {GATE}, pause"),
        }
    }
}

/// What one build did.
#[derive(Debug, Clone, Copy)]
struct Sample {
    ok: bool,
    oom_kills: u64,
    wall_s: f64,
    most_at_once: usize,
}

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    let n = *scale
        .waiters
        .first()
        .context("--waiters: plain make's -jN")?;
    let cgroup = MemCgroup::new("bench-memory", LIMIT_MIB << 20)?;
    let dir = bench.env.tmp.join("memory");
    std::fs::create_dir_all(&dir)?;
    let log = dir.join("jobs.log");
    write_makefile(&dir, &log, scale.tokens as usize, scale.job_us)?;
    let mut ways = vec![Way::Make(n), Way::Make(SAFE_J)];
    if bench.with_baton() {
        ways.extend([Way::Baton(n, false), Way::Baton(n, true)]);
    }
    let brokers: Vec<(Way, BrokerProcess)> = ways
        .iter()
        .filter(|w| matches!(w, Way::Baton(..)))
        .map(|&w| Ok((w, broker_in(&cgroup, bench, w)?)))
        .collect::<Result<_>>()?;
    let load_before = load_average();
    let rounds = scale.ops.max(1) as usize;
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); ways.len()];
    for round in 0..rounds {
        for i in (0..ways.len()).map(|i| (i + round) % ways.len()) {
            let broker = brokers.iter().find(|(w, _)| *w == ways[i]).map(|(_, b)| b);
            let sample = build(bench, &cgroup, broker, &dir, &log, ways[i])
                .with_context(|| format!("round {}: {}", round + 1, ways[i].name()))?;
            samples[i].push(sample);
        }
    }
    let safe = ways
        .iter()
        .position(|&w| w == Way::Make(SAFE_J))
        .expect("the safe -j is always measured");
    let rows = ways
        .iter()
        .enumerate()
        .map(|(i, &way)| row(way, &samples[i], &samples[safe], scale.tokens))
        .collect();
    let notes = vec![
        format!("{} jobs of {JOB_MIB} MiB held {:.1} s each, in a memory cgroup of {LIMIT_MIB} MiB with broker and build inside", scale.tokens, scale.job_us as f64 / 1e6),
        format!("{rounds} alternating rounds; wall s is the median; wall_x: the median of each round's ratio to make -j{SAFE_J} (same run)"),
        format!("load average before: {load_before}; after: {}", load_average()),
    ];
    Ok(Findings { rows, notes })
}

fn row(way: Way, samples: &[Sample], safe: &[Sample], jobs: u32) -> Row {
    let ratios: Vec<f64> = samples
        .iter()
        .zip(safe)
        .map(|(s, b)| s.wall_s / b.wall_s.max(1e-9))
        .collect();
    let wall = Duration::from_secs_f64(median(samples.iter().map(|s| s.wall_s).collect()));
    let n = match way {
        Way::Make(j) | Way::Baton(j, _) => j,
    };
    Row::new(
        &way.name(),
        n,
        u64::from(jobs),
        Usage::default(),
        None,
        wall,
    )
    .with("builds_ok", samples.iter().filter(|s| s.ok).count())
    .with(
        "oom_kills",
        samples.iter().map(|s| s.oom_kills).sum::<u64>(),
    )
    .with(
        "most_at_once",
        samples.iter().map(|s| s.most_at_once).max().unwrap_or(0),
    )
    .with("wall_x", (median(ratios) * 100.0).round() / 100.0)
}

fn build(
    bench: &Bench,
    cgroup: &MemCgroup,
    broker: Option<&BrokerProcess>,
    dir: &Path,
    log: &Path,
    way: Way,
) -> Result<Sample> {
    let _ = std::fs::remove_file(log);
    let make = make();
    let mut command = cgroup.command();
    match (way, broker) {
        (Way::Make(j), _) => command.arg(&make).arg(format!("-j{j}")).arg("-k"),
        (Way::Baton(..), Some(broker)) => command
            .arg(&bench.env.baton_bin)
            .arg("run")
            .arg("--socket")
            .arg(broker.socket())
            .arg("--")
            .arg(&make),
        (Way::Baton(..), None) => bail!("no broker"),
    };
    command
        .arg("-s")
        .current_dir(dir)
        .env_remove("MAKEFLAGS")
        .env_remove("MAKELEVEL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let before = cgroup.oom_kills()?;
    let start = Instant::now();
    let status = command
        .status()
        .with_context(|| format!("running {}", way.name()))?;
    let wall_s = start.elapsed().as_secs_f64();
    Ok(Sample {
        ok: status.success(),
        oom_kills: cgroup.oom_kills()? - before,
        wall_s,
        most_at_once: most_at_once(log),
    })
}

/// The most jobs that ran at once, from their start and end lines.
fn most_at_once(log: &Path) -> usize {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let (mut now, mut most) = (0usize, 0usize);
    for line in text.lines() {
        match line {
            "S" => {
                now += 1;
                most = most.max(now);
            }
            "E" => now = now.saturating_sub(1),
            _ => {}
        }
    }
    most
}

fn make() -> PathBuf {
    std::env::var_os("BATON_BENCH_MAKE")
        .map_or_else(|| PathBuf::from("/usr/bin/make"), PathBuf::from)
}

/// `jobs` targets, each a python3 that touches JOB_MIB and holds it.
fn write_makefile(dir: &Path, log: &Path, jobs: usize, job_us: u64) -> Result<()> {
    let targets: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
    let job = format!(
        "echo S >> {log}; python3 -c 'import time; x = b\"1\" * ({JOB_MIB} << 20); time.sleep({secs})' && echo E >> {log}",
        log = log.display(),
        secs = job_us as f64 / 1e6
    );
    let text = format!(
        "all: {all}\n{all}:\n\t@{job}\n.PHONY: all {all}\n",
        all = targets.join(" ")
    );
    std::fs::write(dir.join("Makefile"), text).context("writing the Makefile")
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// A broker for `way` inside the cgroup.
fn broker_in(cgroup: &MemCgroup, bench: &Bench, way: Way) -> Result<BrokerProcess> {
    let Way::Baton(jobs, pause) = way else {
        bail!("{} needs no broker", way.name())
    };
    let mut flags = vec![
        "--no-fuse",
        "--min-mem-available",
        GATE,
        "--mem-settle",
        SETTLE_MS,
    ];
    if pause {
        flags.extend(["--on-memory-pressure", "pause"]);
    }
    let enter = cgroup.enter();
    let enter: Vec<&str> = enter.iter().map(String::as_str).collect();
    BrokerProcess::start_under(jobs as u32, &bench.env, Wait::Blocking, &flags, &enter)
}
