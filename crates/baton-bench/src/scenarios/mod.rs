//! The five experiments, one module each, and what they share: the scale,
//! the list of mechanisms, the progress display.

mod blocking_vs_polling;
mod broadcast;
mod builds;
mod bulk_wake;
mod cluster;
mod job_runners;
mod make_tree;
mod mass_poll;
mod memory;
mod token_ring;
mod universe;

use crate::mechanisms::{Env, Mechanism};
use crate::progress::Progress;
use crate::report::{Machine, Report, Row};
use crate::BenchArgs;
use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{Map, Value};
use std::path::PathBuf;

/// The experiments, named after what they reproduce.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// P processes pass one token around T times (Linux's pipe commit).
    TokenRing,
    /// Job runners waiting in blocking reads or in poll() (GNU make).
    BlockingVsPolling,
    /// A waker releases W tokens per round to N waiters (sembench).
    BulkWake,
    /// N ∈ {16, 64, 256, 1024} pollers on one token pipe (make universe).
    MassPoll,
    /// N threads on a condition, broadcast vs directed hand-off (futex requeue).
    Broadcast,
    /// Real make 4.3, make 4.4.1 and ninja 1.13 (and bmake, cargo): each alone
    /// against its own -jN, and three at once (fair shares, weights) against
    /// one shared FIFO.
    Builds,
    /// Seed 003 on real bmake: a `make universe`-shaped tree and a flat one,
    /// bmake's own -jN against baton run, at -j96 and 4 × CPUs.
    Universe,
    /// 1, 10 and 100 brokers on one cluster pool in a real etcd: the queue
    /// beside every broker watching every token (grants/s, latency, watch
    /// events per grant).
    Cluster,
    /// The memory gate against the OOM killer in a 1 GiB memory cgroup
    /// (root, cgroup v1 or v2): plain make -jN, the largest -j that fits, and
    /// baton with --min-mem-available, in one run.
    Memory,
    /// Real make 4.4.1: a 16 × 16 × 20 recursive tree, make's own -jN
    /// against baton's FUSE token file, at -j16 and -j512.
    MakeTree,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::TokenRing => "token-ring",
            Scenario::BlockingVsPolling => "blocking-vs-polling",
            Scenario::BulkWake => "bulk-wake",
            Scenario::MassPoll => "mass-poll",
            Scenario::Broadcast => "broadcast",
            Scenario::Builds => "builds",
            Scenario::Universe => "universe",
            Scenario::Cluster => "cluster",
            Scenario::Memory => "memory",
            Scenario::MakeTree => "make-tree",
        }
    }

    fn defaults(self) -> Defaults {
        match self {
            Scenario::TokenRing => token_ring::DEFAULTS,
            Scenario::BlockingVsPolling => blocking_vs_polling::DEFAULTS,
            Scenario::BulkWake => bulk_wake::DEFAULTS,
            Scenario::MassPoll => mass_poll::DEFAULTS,
            Scenario::Broadcast => broadcast::DEFAULTS,
            Scenario::Builds => builds::DEFAULTS,
            Scenario::Universe => universe::DEFAULTS,
            Scenario::Cluster => cluster::DEFAULTS,
            Scenario::Memory => memory::DEFAULTS,
            Scenario::MakeTree => make_tree::DEFAULTS,
        }
    }
}

/// How big a run is. Each scenario reads the fields it uses and documents
/// its defaults.
#[derive(Debug, Clone, Serialize)]
pub struct Scale {
    pub waiters: Vec<usize>,
    pub ops: u64,
    pub tokens: u32,
    pub job_us: u64,
    pub wake: u32,
    /// Alternating rounds (`--rounds`), where the scenario takes them.
    pub rounds: u32,
}

impl Scale {
    fn from_args(args: &BenchArgs, defaults: Defaults) -> Scale {
        Scale {
            waiters: if args.waiters.is_empty() {
                defaults.waiters.to_vec()
            } else {
                args.waiters.clone()
            },
            ops: args.ops.unwrap_or(defaults.ops),
            tokens: args.tokens.unwrap_or(defaults.tokens),
            job_us: args.job_us.unwrap_or(defaults.job_us),
            wake: args.wake.unwrap_or(defaults.wake),
            rounds: args.rounds.unwrap_or(1),
        }
    }
}

/// A scenario's default [`Scale`], small enough for a 2-core machine.
pub struct Defaults {
    pub waiters: &'static [usize],
    pub ops: u64,
    pub tokens: u32,
    pub job_us: u64,
    pub wake: u32,
}

/// What a scenario hands back besides its rows.
#[derive(Default)]
pub struct Findings {
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

/// What every scenario needs while it runs.
pub struct Bench {
    pub env: Env,
    with_baton: bool,
    progress: Progress,
}

impl Bench {
    /// The given mechanisms, less baton's when the run is without it, and
    /// less those this machine cannot run (said once on stderr).
    pub fn mechanisms(&self, all: &[Mechanism]) -> Vec<Mechanism> {
        let wanted = all
            .iter()
            .copied()
            .filter(|m| self.with_baton || !m.is_baton());
        wanted
            .filter(|m| {
                if !m.available() {
                    eprintln!(
                        "note: skipped \"{}\": FUSE is not available here (no /dev/fuse)",
                        m.name()
                    );
                }
                m.available()
            })
            .collect()
    }

    pub fn with_baton(&self) -> bool {
        self.with_baton
    }

    /// Measures each case in turn, showing progress.
    pub fn each<C>(
        &self,
        cases: &[C],
        label: impl Fn(&C) -> String,
        mut measure: impl FnMut(&C) -> Result<Row>,
    ) -> Result<Vec<Row>> {
        let mut rows = Vec::new();
        for (i, case) in cases.iter().enumerate() {
            let label = label(case);
            self.progress.step(i, cases.len(), &label);
            let row = measure(case).with_context(|| format!("measuring {label}"));
            if row.is_err() {
                // The error is printed on a line of its own.
                self.progress.done();
            }
            rows.push(row?);
        }
        self.progress.done();
        Ok(rows)
    }
}

/// Every combination of waiter count and mechanism, counts outermost, so a
/// table reads as "at this N, each mechanism".
/// Every mechanism at every number of waiters it can serve (the fast
/// path seats 1024 clients per build: no row of it above that).
pub fn cases(waiters: &[usize], mechanisms: &[Mechanism]) -> Vec<(usize, Mechanism)> {
    waiters
        .iter()
        .flat_map(|&n| mechanisms.iter().map(move |&m| (n, m)))
        .filter(|&(n, m)| m.max_waiters().is_none_or(|most| n <= most))
        .collect()
}

pub fn run(args: &BenchArgs, baton_bin: PathBuf) -> Result<Report> {
    let scenario = args.scenario;
    let scale = Scale::from_args(args, scenario.defaults());
    anyhow::ensure!(
        scale.waiters.iter().all(|&n| n >= 1),
        "--waiters must be at least 1"
    );
    let tmp = TempDir::new()?;
    let bench = Bench {
        env: Env {
            baton_bin,
            tmp: tmp.0.clone(),
        },
        with_baton: !args.without_baton,
        progress: Progress::new(&tmp.0),
    };
    let findings = match scenario {
        Scenario::TokenRing => token_ring::run(&bench, &scale)?,
        Scenario::BlockingVsPolling => blocking_vs_polling::run(&bench, &scale)?,
        Scenario::BulkWake => bulk_wake::run(&bench, &scale)?,
        Scenario::MassPoll => mass_poll::run(&bench, &scale)?,
        Scenario::Broadcast => broadcast::run(&bench, &scale)?,
        Scenario::Builds => builds::run(&bench, &scale)?,
        Scenario::Universe => universe::run(&bench, &scale)?,
        Scenario::Cluster => cluster::run(&bench, &scale)?,
        Scenario::Memory => memory::run(&bench, &scale)?,
        Scenario::MakeTree => make_tree::run(&bench, &scale)?,
    };
    let mut findings = findings;
    if findings
        .rows
        .iter()
        .any(|r| r.mechanism.starts_with("baton"))
    {
        findings.notes.push(BROKER_HOP.to_string());
    }
    let parameters = match serde_json::to_value(&scale)? {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    Ok(Report {
        scenario: scenario.name().to_string(),
        machine: Machine::this(),
        parameters,
        results: findings.rows,
        notes: findings.notes,
    })
}

/// Under every table with baton's rows: why they cost more than the
/// kernel's own hand-offs, and what for.
const BROKER_HOP: &str = "baton's rows pay for the broker hop: a token goes from its holder to the broker (RELEASE) and from the broker to the next waiter (GRANTED), two messages and a wake-up of the broker (broker csw/op), where a pipe or a semaphore hands it over inside the kernel; that hop is what gives one limit across every build and process, fair shares between builds, and tokens taken back from a holder that dies";

/// A private directory for broker sockets, removed at the end (and, if
/// the bench is interrupted, by the progress watcher).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        let path = std::env::temp_dir().join(format!("baton-bench-{}", std::process::id()));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The median of some measurements (the upper middle of an even count; 0
/// for none).
pub(super) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}
