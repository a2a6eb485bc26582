//! Seed 003 on real bmake, at this machine's scale: a tree shaped like
//! FreeBSD's `make universe -DNO_CLEAN` (hundreds of sub-makes, most of
//! their targets up to date, a few short jobs each) and a flat one (hundreds
//! of sub-makes that all want tokens at once), built by bmake with its own
//! `-jN` token pipe and under `baton run` in each style baton offers bmake,
//! in alternating rounds. Everything the build and the broker spent is
//! counted by the kernel: the build's from getrusage(RUSAGE_CHILDREN) around
//! it, the broker's from /proc over the same window.

use super::{Bench, Defaults, Findings, Scale};
use crate::measure::Usage;
use crate::mechanisms::baton::{BrokerProcess, Brokers};
use crate::mechanisms::Pool;
use crate::report::Row;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// waiters: the `-jN`s (none given: 96, as in the FreeBSD post, and 4 × CPUs); ops:
/// rounds; job_us: each job's sleep.
pub const DEFAULTS: Defaults = Defaults {
    waiters: &[],
    ops: 3,
    tokens: 0,
    job_us: 20_000,
    wake: 0,
};

/// The two trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// 200 sub-makes, each 30 up-to-date targets and 3 jobs.
    Universe,
    /// 300 sub-makes of 4 jobs each.
    Flat,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Universe => "universe",
            Shape::Flat => "flat",
        }
    }

    /// (sub-makes, up-to-date targets each, jobs each)
    fn size(self) -> (usize, usize, usize) {
        match self {
            Shape::Universe => (200, 30, 3),
            Shape::Flat => (300, 0, 4),
        }
    }
}

/// How the build gets its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// bmake's own `-jN` token pipe.
    Own,
    /// `baton run --jobserver-style STYLE -- bmake` against a broker with
    /// `--jobs N`.
    Baton(&'static str),
}

impl Way {
    fn name(self) -> String {
        match self {
            Way::Own => "bmake -jN".to_string(),
            Way::Baton(style) => format!("baton run ({style})"),
        }
    }
}

const WAYS: [Way; 4] = [
    Way::Own,
    Way::Baton("fifo"),
    Way::Baton("pipe"),
    Way::Baton("fuse"),
];

/// What one build spent.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Sample {
    pub wall_s: f64,
    pub user_s: f64,
    pub sys_s: f64,
    pub usage: Usage,
    pub broker: Option<Usage>,
}

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    let bmake = find_bmake()?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ns = if scale.waiters.is_empty() {
        vec![96, 4 * cpus]
    } else {
        scale.waiters.clone()
    };
    // The FUSE style only where FUSE is.
    let fuse = Path::new("/dev/fuse").exists();
    let ways: Vec<Way> = WAYS
        .into_iter()
        .filter(|w| bench.with_baton() || *w == Way::Own)
        .filter(|w| fuse || *w != Way::Baton("fuse"))
        .collect();
    let shapes = [Shape::Universe, Shape::Flat];
    let trees: Vec<PathBuf> = shapes
        .iter()
        .map(|&s| write_tree(&bench.env.tmp, s, scale.job_us))
        .collect::<Result<_>>()?;
    let cases: Vec<(usize, usize, Way)> = (0..shapes.len())
        .flat_map(|s| {
            ns.iter()
                .flat_map(move |&n| WAYS.into_iter().map(move |w| (s, n, w)))
        })
        .filter(|c| ways.contains(&c.2))
        .collect();
    let rounds = scale.ops.max(1) as usize;
    let mut brokers = Brokers::new(&bench.env);
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); cases.len()];
    for round in 0..rounds {
        // Alternating: each round starts with a different case.
        for i in (0..cases.len()).map(|i| (i + round) % cases.len()) {
            let (s, n, way) = cases[i];
            let sample = build(&mut brokers, &bmake, &trees[s], n, way).with_context(|| {
                format!(
                    "round {}: {} at -j{n} ({})",
                    round + 1,
                    way.name(),
                    shapes[s].name()
                )
            })?;
            samples[i].push(sample);
        }
    }
    let mut rows = Vec::new();
    for (i, &(s, n, way)) in cases.iter().enumerate() {
        let own_samples = cases
            .iter()
            .position(|&(s2, n2, w2)| (s2, n2, w2) == (s, n, Way::Own))
            .map(|j| &samples[j]);
        let m = median_sample(&samples[i]);
        let (subs, _, jobs) = shapes[s].size();
        let wall = Duration::from_secs_f64(m.wall_s);
        let mut row = Row::new(
            &way.name(),
            n,
            (subs * jobs) as u64,
            m.usage,
            m.broker,
            wall,
        )
        .with("shape", shapes[s].name())
        .with("user_s", round2(m.user_s))
        .with("sys_s", round2(m.sys_s))
        .with(
            "sys_share",
            round2(m.sys_s / (m.user_s + m.sys_s).max(1e-9)),
        )
        .with("csw", m.usage.context_switches());
        if let Some(own_samples) = own_samples {
            let own = median_sample(own_samples);
            row = row
                .with("wall_x", round2(m.wall_s / own.wall_s))
                .with(
                    "wall_pair_x",
                    round3(median_paired_ratio(&samples[i], own_samples, |s| s.wall_s)),
                )
                .with("sys_x", round2(m.sys_s / own.sys_s.max(1e-9)))
                .with(
                    "csw_x",
                    round2(
                        m.usage.context_switches() as f64
                            / own.usage.context_switches().max(1) as f64,
                    ),
                );
        }
        rows.push(row);
    }
    let notes = vec![
        format!("medians of {rounds} alternating rounds; _x columns: ratio of medians to bmake's own -jN at the same N and shape, same run; wall_pair_x: median of each round's ratio to bmake's own build of that round"),
        "ops are the jobs run; CPU, user, sys and csw include every process of the build and, for baton, the broker".to_string(),
        "one broker per N (and one with the FUSE mount), kept running across rounds as a machine-wide one would be; every token back after each build".to_string(),
        "universe: 200 sub-makes, 30 up-to-date targets and 3 jobs each; flat: 300 sub-makes of 4 jobs".to_string(),
        format!("bmake: {} ({})", bmake.display(), bmake_version(&bmake)),
    ];
    Ok(Findings { rows, notes })
}

pub(super) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The median over rounds of `f(this round's sample) / f(the baseline's
/// sample of the same round)`. Builds of one round run close together, so
/// the pair shares the machine's state of the moment; the ratio of the two
/// medians also carries the drift between rounds.
pub(super) fn median_paired_ratio(
    samples: &[Sample],
    baseline: &[Sample],
    f: fn(&Sample) -> f64,
) -> f64 {
    let mut ratios: Vec<f64> = samples
        .iter()
        .zip(baseline)
        .map(|(s, b)| f(s) / f(b).max(1e-9))
        .collect();
    ratios.sort_by(f64::total_cmp);
    ratios[ratios.len() / 2]
}

/// What the bmake says its version is (a date), for the notes: a bmake
/// that polls its token pipe (scripts/polling-bmake) and one that does not
/// may carry the same one.
fn bmake_version(bmake: &Path) -> String {
    let out = Command::new(bmake)
        .args(["-r", "-f", "/dev/null", "-V", "MAKE_VERSION"])
        .output();
    out.ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "version unknown".into())
}

fn find_bmake() -> Result<PathBuf> {
    let path = std::env::var_os("BATON_BENCH_BMAKE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/bmake"));
    if !path.exists() {
        bail!(
            "{} not found (install bmake, e.g. apt-get install bmake, or set BATON_BENCH_BMAKE)",
            path.display()
        );
    }
    Ok(path)
}

/// Writes the tree of `shape` under `tmp` and brings its targets up to date
/// (sources first, then targets, so that every target is newer).
fn write_tree(tmp: &Path, shape: Shape, job_us: u64) -> Result<PathBuf> {
    let (subs, up_to_date, jobs) = shape.size();
    let dir = tmp.join(shape.name());
    let names = |prefix: &str, n: usize| {
        (0..n)
            .map(|i| format!("{prefix}{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let top = format!("SUBS = {}\nall: ${{SUBS}}\n${{SUBS}}:\n\t@cd ${{.CURDIR}}/$@ && ${{MAKE}} -f ../sub.mk\n.PHONY: all ${{SUBS}}\n", names("s", subs));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("Makefile"), top)?;
    let sleep = format!("{}.{:06}", job_us / 1_000_000, job_us % 1_000_000);
    let sub = format!(
        "OBJS = {objs}\nJOBS = {jobs}\nall: ${{OBJS}} ${{JOBS}}\n.for o in ${{OBJS}}\n${{o}}: ${{o:R}}.c\n\t@touch $@\n.endfor\n${{JOBS}}:\n\t@sleep {sleep}\n.PHONY: all ${{JOBS}}\n",
        objs = (0..up_to_date).map(|i| format!("o{i}.o")).collect::<Vec<_>>().join(" "),
        jobs = names("j", jobs),
    );
    std::fs::write(dir.join("sub.mk"), sub)?;
    for s in 0..subs {
        let sub_dir = dir.join(format!("s{s}"));
        std::fs::create_dir_all(&sub_dir)?;
        for i in 0..up_to_date {
            std::fs::write(sub_dir.join(format!("o{i}.c")), "")?;
        }
        for i in 0..up_to_date {
            std::fs::write(sub_dir.join(format!("o{i}.o")), "")?;
        }
    }
    Ok(dir)
}

fn build(brokers: &mut Brokers, bmake: &Path, tree: &Path, n: usize, way: Way) -> Result<Sample> {
    let (mut command, broker) = match way {
        Way::Own => {
            let mut command = Command::new(bmake);
            command.arg(format!("-j{n}"));
            (command, None)
        }
        Way::Baton(style) => {
            // The FUSE style needs the broker's mount; the others do without.
            let flags: &[&str] = if style == "fuse" { &[] } else { &["--no-fuse"] };
            let mut command = Command::new(brokers.baton_bin());
            let broker = brokers.get(n as u32, flags)?;
            command
                .arg("run")
                .arg("--socket")
                .arg(broker.socket())
                .args(["--jobserver-style", style, "--"])
                .arg(bmake);
            (command, Some(broker))
        }
    };
    command.current_dir(tree);
    measure_and_check(command, broker, n, &way.name())
}

/// [`measure`], then checks that every token of the broker (if any) came
/// back: the next build uses it too.
pub(super) fn measure_and_check(
    command: Command,
    broker: Option<&BrokerProcess>,
    tokens: usize,
    name: &str,
) -> Result<Sample> {
    let sample = measure(command, broker, name)?;
    if let Some(broker) = broker {
        broker
            .check_all_free(tokens as u32)
            .with_context(|| format!("after {name}"))?;
    }
    Ok(sample)
}

/// Runs a build to its end and returns what it and the broker (if any)
/// spent meanwhile. Only the jobserver the command gives is used: none
/// inherited from our caller.
pub(super) fn measure(
    mut command: Command,
    broker: Option<&BrokerProcess>,
    name: &str,
) -> Result<Sample> {
    command
        .env_remove("MAKEFLAGS")
        .env_remove("MAKELEVEL")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    let broker_pid = broker.and_then(|b| b.broker_pid());
    let broker_before = broker_pid.map(Usage::of_process).transpose()?;
    let before = children_rusage();
    let start = Instant::now();
    let status = command
        .status()
        .with_context(|| format!("running {name}"))?;
    let wall = start.elapsed();
    let after = children_rusage();
    let broker_after = broker_pid.map(Usage::of_process).transpose()?;
    if !status.success() {
        bail!("{name} failed ({status})");
    }
    let broker_usage = broker_before.zip(broker_after).map(|(b, a)| a - b);
    let spent = |f: fn(&libc::rusage) -> libc::timeval| secs(f(&after)) - secs(f(&before));
    let mut usage = Usage::from_rusage(&after) - Usage::from_rusage(&before);
    let (mut user_s, mut sys_s) = (spent(|r| r.ru_utime), spent(|r| r.ru_stime));
    if let (Some(b), Some(pid)) = (broker_usage, broker_pid) {
        usage = usage + b;
        // The broker's CPU split by /proc's ticks, its total by its clock.
        let (user, sys) = proc_user_sys(pid);
        let share = user / (user + sys).max(1e-9);
        user_s += b.cpu_us as f64 / 1e6 * share;
        sys_s += b.cpu_us as f64 / 1e6 * (1.0 - share);
    }
    Ok(Sample {
        wall_s: wall.as_secs_f64(),
        user_s,
        sys_s,
        usage,
        broker: broker_usage,
    })
}

fn secs(tv: libc::timeval) -> f64 {
    tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6
}

fn children_rusage() -> libc::rusage {
    // SAFETY: getrusage fills the struct it is given and nothing else.
    unsafe {
        let mut ru = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru);
        ru
    }
}

/// A process's user and system time so far, in /proc's ticks (seconds).
fn proc_user_sys(pid: libc::pid_t) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
            / hz
    };
    (tick(11), tick(12))
}

/// The median of each figure on its own.
pub(super) fn median_sample(samples: &[Sample]) -> Sample {
    fn median<T: Copy + PartialOrd>(mut xs: Vec<T>) -> T {
        xs.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        xs[xs.len() / 2]
    }
    let of = |f: fn(&Sample) -> f64| median(samples.iter().map(f).collect());
    let usage_of = |f: fn(&Usage) -> u64| median(samples.iter().map(|s| f(&s.usage)).collect());
    let broker = samples[0].broker.map(|_| Usage {
        voluntary_switches: median(
            samples
                .iter()
                .filter_map(|s| s.broker.map(|b| b.voluntary_switches))
                .collect(),
        ),
        involuntary_switches: median(
            samples
                .iter()
                .filter_map(|s| s.broker.map(|b| b.involuntary_switches))
                .collect(),
        ),
        cpu_us: median(
            samples
                .iter()
                .filter_map(|s| s.broker.map(|b| b.cpu_us))
                .collect(),
        ),
    });
    Sample {
        wall_s: of(|s| s.wall_s),
        user_s: of(|s| s.user_s),
        sys_s: of(|s| s.sys_s),
        usage: Usage {
            voluntary_switches: usage_of(|u| u.voluntary_switches),
            involuntary_switches: usage_of(|u| u.involuntary_switches),
            cpu_us: usage_of(|u| u.cpu_us),
        },
        broker,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walls(ws: &[f64]) -> Vec<Sample> {
        ws.iter()
            .map(|&wall_s| Sample {
                wall_s,
                ..Sample::default()
            })
            .collect()
    }

    #[test]
    fn paired_ratios_follow_the_rounds_not_the_sorted_medians() {
        // Baton 10% slower than bmake's own build in rounds 1 and 2, 10%
        // faster in round 3, on a machine that slowed down after round 1:
        // the pairs say 1.1, the ratio of the medians (1.9 / 2.0) 0.95.
        let own = walls(&[1.0, 2.0, 2.1]);
        let baton = walls(&[1.1, 2.2, 1.9]);
        assert!((median_paired_ratio(&baton, &own, |s| s.wall_s) - 1.1).abs() < 1e-9);
        assert!((median_sample(&baton).wall_s / median_sample(&own).wall_s - 0.95).abs() < 1e-9);
        assert!((median_paired_ratio(&own, &own, |s| s.wall_s) - 1.0).abs() < 1e-9);
    }
}
