//! `baton bench`: five published wake-up problems (docs/benchmarks.md,
//! "Sources"), with baton measured beside the mechanisms it replaces, in
//! the same run.
//!
//! Every scenario runs each mechanism in forked child processes (threads
//! where the pattern is about threads) and counts the context switches and
//! CPU time of every process involved, broker included, from the kernel:
//! getrusage in each benchmark process over its measured window, the
//! broker's /proc entries and CPU clock over the same window. See
//! docs/benchmarks.md for figures and the commands that produced them.
#![deny(missing_docs)]

/// A real etcd for the cluster benchmark and tests.
pub mod cgroup;
pub mod etcd;
mod measure;
mod mechanisms;
mod progress;
mod pthread;
mod report;
mod scenarios;
mod stress_ng;
mod sys;
mod team;

pub use scenarios::Scenario;

use anyhow::{Context, Result};
use std::io::Write;
use std::path::PathBuf;

/// `baton bench SCENARIO [--json] [--plot FILE.svg] [scale options]`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The experiment: token-ring (a pipe passed around, as in Linux's
    /// exclusive pipe waits), blocking-vs-polling (make's pselect()),
    /// bulk-wake (sembench's semaphores), mass-poll (FreeBSD's make
    /// universe), broadcast (the futex requeue), builds (real make and
    /// ninja under one limit), universe (FreeBSD's make universe on real
    /// bmake), cluster (brokers sharing a pool in a real etcd), memory (the
    /// memory gate against the OOM killer; root) or make-tree (a recursive
    /// make 4.4.1 build on the FUSE token file).
    #[arg(value_enum)]
    pub scenario: Scenario,

    /// Print one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Also draw context switches and CPU per operation against the number
    /// of waiters into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Waiting processes (threads in broadcast); a comma-separated list
    /// measures each. Default: 64; mass-poll 16,64,256,1024 (universe,
    /// make-tree: the -jNs).
    #[arg(
        long,
        alias = "processes",
        value_delimiter = ',',
        value_name = "N[,N...]"
    )]
    pub waiters: Vec<usize>,

    /// Operations per measurement: acquisitions, transfers or wake-ups
    /// (builds: jobs per build; universe, make-tree: rounds).
    #[arg(long, value_name = "N")]
    pub ops: Option<u64>,

    /// Tokens shared by the waiters (blocking-vs-polling, mass-poll; builds:
    /// the limit).
    #[arg(long, value_name = "N")]
    pub tokens: Option<u32>,

    /// Microseconds each acquired token is held for, sleeping, as a job
    /// would (blocking-vs-polling, mass-poll; builds: each job's sleep).
    #[arg(long, value_name = "US")]
    pub job_us: Option<u64>,

    /// Tokens released per round (bulk-wake) or added per round by raising
    /// the limit / posting work items (broadcast).
    #[arg(long, value_name = "K")]
    pub wake: Option<u32>,

    /// Alternating rounds of each pair of measurements, reported as
    /// medians (builds: each tool alone, its own -jN and baton run in
    /// turn; default 1). universe and make-tree count rounds in --ops.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: Option<u32>,

    /// The baton binary started as the broker (`baton serve`).
    #[arg(long, hide = true, value_name = "PATH")]
    pub baton_bin: Option<PathBuf>,

    /// Measure the kernel mechanisms only, without starting a broker.
    #[arg(long, hide = true)]
    pub without_baton: bool,
}

/// Runs the scenario and prints its table (or JSON) to stdout; draws the
/// plot if asked.
pub fn run(args: BenchArgs) -> Result<()> {
    let report = measure_report(&args)?;
    if let Some(path) = &args.plot {
        report
            .plot(path)
            .with_context(|| format!("drawing {}", path.display()))?;
    }
    let text = if args.json {
        serde_json::to_string_pretty(&report.to_json())? + "\n"
    } else {
        report.table()
    };
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        // Piped into head: the reader has what it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing the results"),
    }
}

/// Runs the scenario and returns what `--json` prints, without printing.
pub fn measure(args: &BenchArgs) -> Result<serde_json::Value> {
    Ok(measure_report(args)?.to_json())
}

fn measure_report(args: &BenchArgs) -> Result<report::Report> {
    let baton_bin = match &args.baton_bin {
        Some(path) => path.clone(),
        None => std::env::current_exe().context("locating the baton binary")?,
    };
    scenarios::run(args, baton_bin)
}
