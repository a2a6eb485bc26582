//! A real recursive build on GNU make 4.4.1: a top make, 16 sub-makes, 16
//! sub-sub-makes each, 20 jobs of `sleep` each (5,120 jobs), built with
//! make's own `-jN` FIFO jobserver and under `baton run --jobserver-style
//! fuse` against a broker of N tokens (the FUSE token file, docs/fuse.md),
//! the same with the broker waking every poller (`--fuse-notify-all`, the
//! herd a pipe has, as a control), and `--jobserver-style fifo` (the FIFO
//! bridge, what `auto` gives where there is no mount), in alternating
//! rounds. At a large N
//! tokens are plentiful and many makes poll; at a small one they are scarce,
//! as under a machine-wide limit. Counted as in `universe`: the build's
//! getrusage(RUSAGE_CHILDREN) around it plus the broker's over the same
//! window.

use super::builds::check_version;
use super::universe::{measure_and_check, median_sample, round2, Sample};
use super::{Bench, Defaults, Findings, Scale};
use crate::mechanisms::baton::Brokers;
use crate::mechanisms::Mechanism;
use crate::report::Row;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// waiters: the `-jN`s; ops: rounds; job_us: each job's sleep.
pub const DEFAULTS: Defaults = Defaults {
    waiters: &[16, 512],
    ops: 3,
    tokens: 0,
    job_us: 20_000,
    wake: 0,
};

/// Sub-makes per make, and jobs per leaf make.
const FANOUT: usize = 16;
const JOBS: usize = 20;

/// How the build gets its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    Own,
    Fuse,
    FuseNotifyAll,
    Fifo,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::Own => "make 4.4.1 -jN (own FIFO)",
            Way::Fuse => "baton run (fuse)",
            Way::FuseNotifyAll => "baton run (fuse, notify-all)",
            Way::Fifo => "baton run (fifo)",
        }
    }

    fn needs_fuse(self) -> bool {
        matches!(self, Way::Fuse | Way::FuseNotifyAll)
    }
}

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    let make =
        std::env::var_os("BATON_BENCH_MAKE44").map_or_else(|| PathBuf::from("make"), PathBuf::from);
    check_version("make 4.4.1", &make, "GNU Make 4.4")?;
    let mut notes = Vec::new();
    let fuse = Mechanism::BatonFuse.available();
    if bench.with_baton() && !fuse {
        notes.push("skipped the FUSE rows: FUSE is not available here (no /dev/fuse)".to_string());
    }
    let ways: Vec<Way> = [Way::Own, Way::Fuse, Way::FuseNotifyAll, Way::Fifo]
        .into_iter()
        .filter(|&w| w == Way::Own || (bench.with_baton() && (fuse || !w.needs_fuse())))
        .collect();
    let tree = write_tree(&bench.env.tmp, scale.job_us)?;
    let cases: Vec<(usize, Way)> = scale
        .waiters
        .iter()
        .flat_map(|&n| ways.iter().map(move |&w| (n, w)))
        .collect();
    let rounds = scale.ops.max(1) as usize;
    let mut brokers = Brokers::new(&bench.env);
    let mut samples: Vec<Vec<(Sample, f64)>> = vec![Vec::new(); cases.len()];
    for round in 0..rounds {
        // Alternating: each round starts with a different case.
        for i in (0..cases.len()).map(|i| (i + round) % cases.len()) {
            let (n, way) = cases[i];
            let load = load_average();
            let sample = build(&mut brokers, &make, &tree, n, way)
                .with_context(|| format!("round {}: {} at -j{n}", round + 1, way.name()))?;
            samples[i].push((sample, load));
        }
    }
    let medians: Vec<Sample> = samples
        .iter()
        .map(|s| median_sample(&s.iter().map(|(s, _)| *s).collect::<Vec<_>>()))
        .collect();
    let mut rows = Vec::new();
    for (i, &(n, way)) in cases.iter().enumerate() {
        let m = medians[i];
        let mut loads: Vec<f64> = samples[i].iter().map(|(_, load)| *load).collect();
        loads.sort_by(f64::total_cmp);
        let mut row = Row::new(
            way.name(),
            n,
            (FANOUT * FANOUT * JOBS) as u64,
            m.usage,
            m.broker,
            Duration::from_secs_f64(m.wall_s),
        )
        .with("csw", m.usage.context_switches())
        .with("load_min", round2(loads[0]))
        .with("load_max", round2(loads[loads.len() - 1]));
        if let Some(own) = cases
            .iter()
            .position(|&c| c == (n, Way::Own))
            .map(|j| medians[j])
        {
            row = row
                .with(
                    "csw_x",
                    round2(
                        m.usage.context_switches() as f64
                            / own.usage.context_switches().max(1) as f64,
                    ),
                )
                .with(
                    "cpu_x",
                    round2(m.usage.cpu_us as f64 / own.usage.cpu_us.max(1) as f64),
                )
                .with("wall_x", round2(m.wall_s / own.wall_s));
        }
        rows.push(row);
    }
    notes.push(format!(
        "medians of {rounds} alternating rounds; _x columns: ratio of medians to make's own -jN at the same N, same run; load_min/max: the 1-minute load average as each of the row's builds started"
    ));
    notes.push("ops are the jobs run; csw and CPU include every process of the build and, for baton, the broker".to_string());
    notes.push("one broker per N and style, kept running across rounds as a machine-wide one would be; every token back after each build".to_string());
    Ok(Findings { rows, notes })
}

/// top.mk → FANOUT × mid.mk → FANOUT × leaf.mk → JOBS jobs, in `tmp/make-tree`.
fn write_tree(tmp: &Path, job_us: u64) -> Result<PathBuf> {
    let dir = tmp.join("make-tree");
    std::fs::create_dir_all(&dir)?;
    let names = |prefix: &str, n: usize| {
        (0..n)
            .map(|i| format!("{prefix}{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let level = |sub: &str| {
        format!(
            "all: {t}\n{t}:\n\t@$(MAKE) -f {sub}\n.PHONY: all {t}\n",
            t = names("t", FANOUT)
        )
    };
    std::fs::write(dir.join("top.mk"), level("mid.mk"))?;
    std::fs::write(dir.join("mid.mk"), level("leaf.mk"))?;
    let sleep = format!("{}.{:06}", job_us / 1_000_000, job_us % 1_000_000);
    std::fs::write(
        dir.join("leaf.mk"),
        format!(
            "all: {t}\n{t}:\n\t@sleep {sleep}\n.PHONY: all {t}\n",
            t = names("j", JOBS)
        ),
    )?;
    Ok(dir)
}

fn build(brokers: &mut Brokers, make: &Path, tree: &Path, n: usize, way: Way) -> Result<Sample> {
    let make_args = ["-s", "--no-print-directory", "-f", "top.mk"];
    let (mut command, broker) = match way {
        Way::Own => {
            let mut command = Command::new(make);
            command.arg(format!("-j{n}")).args(make_args);
            (command, None)
        }
        Way::Fuse | Way::FuseNotifyAll | Way::Fifo => {
            let (flags, style): (&[&str], _) = match way {
                Way::FuseNotifyAll => (&["--fuse-notify-all"], "fuse"),
                Way::Fifo => (&["--no-fuse"], "fifo"),
                _ => (&[], "fuse"),
            };
            let mut command = Command::new(brokers.baton_bin());
            let broker = brokers.get(n as u32, flags)?;
            command
                .arg("run")
                .arg("--socket")
                .arg(broker.socket())
                .args(["--jobserver-style", style, "--"])
                .arg(make)
                .args(make_args);
            (command, Some(broker))
        }
    };
    command.current_dir(tree);
    measure_and_check(command, broker, n, way.name())
}

/// The 1-minute load average: the figures move with it on a shared machine.
fn load_average() -> f64 {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace()
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or(0.0)
}
