//! Real builds under one limit: GNU make 4.3, GNU make 4.4.1 and ninja 1.13
//! on generated graphs of independent jobs that sleep (a compiler waiting
//! on its disk), each job logging when it starts and ends.
//!
//! 1. Each tool alone (and cargo, where it is installed): under `baton run`
//!    on a pool of N, against the tool's own `-jN`: mean jobs running at
//!    once, and wall time. Cargo's jobs are rustc runs of a workspace of
//!    empty crates, each behind a wrapper that sleeps first and logs.
//! 2. The three at once on one limit of N: each build's share of the
//!    token-time while all three run, under baton and under one shared GNU
//!    FIFO (a machine-wide jobserver as its peers offer it: N - 3 tokens in
//!    the FIFO, as every top-level client runs one job on its own).
//! 3. The three at once under baton, with weights 1:1:2 (ninja 2).
//! 4. Three containers at once (unshare: PID, mount and network
//!    namespaces), one per tool, with jobs that spin instead of sleeping:
//!    each at its own `-j$(nproc)`, then each under `baton run` on one pool
//!    of `$(nproc)`: the most jobs running at once across the three (from
//!    their logs), wall time and context switches (docs/containers.md).
//!    Needs root; left out, and said so, without.
//!
//! The tools come from `BATON_BENCH_MAKE43` (default /usr/bin/make),
//! `BATON_BENCH_MAKE44` and `BATON_BENCH_NINJA` (default: `make` and
//! `ninja` on PATH, if they are those versions), and `BATON_BENCH_CARGO`
//! (default: `cargo` on PATH).

use super::{median, Bench, Defaults, Findings, Scale};
use crate::measure::Usage;
use crate::mechanisms::baton::{BrokerProcess, Wait};
use crate::report::Row;
use anyhow::{bail, Context, Result};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Jobs per build (`--ops`), the limit (`--tokens`), each job's length.
pub const DEFAULTS: Defaults = Defaults {
    waiters: &[3],
    ops: 40,
    tokens: 6,
    job_us: 100_000,
    wake: 0,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Make,
    /// bmake: the same makefile, but its shell is sh unless `.SHELL` says
    /// otherwise (bash, named as sh: bmake knows no shell called bash).
    Bmake,
    Ninja,
    Cargo,
}

struct Tool {
    name: &'static str,
    path: PathBuf,
    kind: Kind,
    /// Speaks `fifo:` (make 4.3 knows only `R,W`).
    fifo: bool,
}

fn tools() -> Result<Vec<Tool>> {
    let from = |var: &str, default: &str| {
        std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from)
    };
    let tools = vec![
        Tool {
            name: "make 4.3",
            path: from("BATON_BENCH_MAKE43", "/usr/bin/make"),
            kind: Kind::Make,
            fifo: false,
        },
        Tool {
            name: "make 4.4.1",
            path: from("BATON_BENCH_MAKE44", "make"),
            kind: Kind::Make,
            fifo: true,
        },
        Tool {
            name: "ninja 1.13",
            path: from("BATON_BENCH_NINJA", "ninja"),
            kind: Kind::Ninja,
            fifo: true,
        },
    ];
    for (tool, version) in tools.iter().zip(["GNU Make 4.3", "GNU Make 4.4", "1.13"]) {
        check_version(tool.name, &tool.path, version)?;
    }
    Ok(tools)
}

/// bmake, if it is here (Debian's `bmake`): it joins the builds that run
/// alone. It reads only its own `-J R,W` form, so it is no client of the
/// shared FIFO the three-at-once cases compare against.
fn bmake() -> Option<Tool> {
    let path = std::env::var_os("BATON_BENCH_BMAKE")
        .map_or_else(|| PathBuf::from("/usr/bin/bmake"), PathBuf::from);
    path.exists().then_some(Tool {
        name: "bmake",
        path,
        kind: Kind::Bmake,
        fifo: false,
    })
}

/// Cargo, if it runs here: it joins the builds that run alone.
fn cargo() -> Option<Tool> {
    let path =
        std::env::var_os("BATON_BENCH_CARGO").map_or_else(|| PathBuf::from("cargo"), PathBuf::from);
    let runs = Command::new(&path)
        .arg("--version")
        .env_remove("MAKEFLAGS")
        .output()
        .is_ok_and(|o| o.status.success());
    runs.then_some(Tool {
        name: "cargo",
        path,
        kind: Kind::Cargo,
        fifo: true,
    })
}

/// Fails unless `path --version` starts with `version`.
pub(super) fn check_version(name: &str, path: &Path, version: &str) -> Result<()> {
    let out = Command::new(path)
        .arg("--version")
        .env_remove("MAKEFLAGS")
        .output();
    let said = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    if !said.starts_with(version) {
        bail!(
            "{name} not found at {} (set BATON_BENCH_{}; it said {:?})",
            path.display(),
            name.replace([' ', '.'], "").to_uppercase(),
            said.lines().next().unwrap_or("")
        );
    }
    Ok(())
}

/// A build's directory with its graph and the log its jobs write.
struct Graph {
    dir: PathBuf,
    log: PathBuf,
}

impl Graph {
    fn write(root: &Path, name: &str, kind: Kind, jobs: u64, job_us: u64) -> Result<Graph> {
        let work = format!("sleep {}", job_us as f64 / 1e6);
        Self::write_doing(root, name, kind, jobs, &work)
    }

    /// A graph whose jobs spin `iterations` times in bash: CPU, as a
    /// compiler spends it, rather than a sleep.
    fn write_spinning(
        root: &Path,
        name: &str,
        kind: Kind,
        jobs: u64,
        iterations: u64,
    ) -> Result<Graph> {
        let work = format!("i=0; while ((i < {iterations})); do ((i++)); done");
        Self::write_doing(root, name, kind, jobs, &work)
    }

    /// A graph of `jobs` jobs, each doing `work` (bash, with `$$` for `$`)
    /// between the lines that log its start and end.
    fn write_doing(root: &Path, name: &str, kind: Kind, jobs: u64, work: &str) -> Result<Graph> {
        let dir = root.join(name.replace(' ', "-"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let log = dir.join("jobs.log");
        // $$ is a literal $ in both make and ninja.
        let job = format!(
            "echo S $$EPOCHREALTIME >> {log}; {work}; echo E $$EPOCHREALTIME >> {log}",
            log = log.display(),
        );
        let targets: Vec<String> = (0..jobs).map(|i| format!("j{i}")).collect();
        if kind == Kind::Cargo {
            write_workspace(&dir, &targets, &job)?;
            return Ok(Graph { dir, log });
        }
        let (file, text) = match kind {
            Kind::Make => (
                "Makefile",
                format!(
                    "SHELL := /bin/bash\nall: {t}\n{t}:\n\t@{job}\n.PHONY: all {t}\n",
                    t = targets.join(" ")
                ),
            ),
            Kind::Bmake => (
                "Makefile",
                format!(
                    ".SHELL: name=sh path=/bin/bash\nall: {t}\n{t}:\n\t@{job}\n.PHONY: all {t}\n",
                    t = targets.join(" ")
                ),
            ),
            Kind::Ninja => {
                let mut text = format!("rule job\n  command = bash -c '{job}; touch $out'\n");
                for t in &targets {
                    text.push_str(&format!("build {t}: job\n"));
                }
                ("build.ninja", text)
            }
            Kind::Cargo => unreachable!("written above"),
        };
        std::fs::write(dir.join(file), text)?;
        Ok(Graph { dir, log })
    }

    /// (time, +1 start / -1 end) of every job, in seconds.
    fn events(&self) -> Result<Vec<(f64, i32)>> {
        let text = std::fs::read_to_string(&self.log)
            .with_context(|| format!("reading {}", self.log.display()))?;
        let mut events: Vec<(f64, i32)> = text
            .lines()
            .filter_map(|l| {
                let (what, at) = l.split_once(' ')?;
                Some((at.parse().ok()?, if what == "S" { 1 } else { -1 }))
            })
            .collect();
        events.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(events)
    }
}

/// A workspace of empty library crates named after `targets`, built by
/// rustc behind `wrap` (the RUSTC_WRAPPER that [`command`] sets): it runs
/// `job` (the sleep, logged) before compiling one of them, and rustc alone
/// for what cargo asks it otherwise (its version, say).
fn write_workspace(dir: &Path, targets: &[String], job: &str) -> Result<()> {
    let members: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
    std::fs::write(
        dir.join("Cargo.toml"),
        format!(
            "[workspace]\nresolver = \"2\"\nmembers = [{}]\n",
            members.join(", ")
        ),
    )?;
    for t in targets {
        std::fs::create_dir_all(dir.join(t).join("src"))?;
        std::fs::write(
            dir.join(t).join("Cargo.toml"),
            format!("[package]\nname = \"{t}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n"),
        )?;
        std::fs::write(dir.join(t).join("src").join("lib.rs"), "")?;
    }
    // make and ninja unescape $$; this script is read by bash as it is.
    let job = job.replace("$$", "$");
    let wrap = format!(
        "#!/bin/bash\ncase \" $* \" in *\" --crate-name j\"[0-9]*) {job};; esac\nexec \"$@\"\n"
    );
    let path = dir.join("wrap.sh");
    std::fs::write(&path, wrap)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Job-seconds spent between `from` and `to`: the integral of the number of
/// jobs running.
fn busy(events: &[(f64, i32)], from: f64, to: f64) -> f64 {
    let (mut running, mut at, mut total) = (0i32, from, 0.0);
    for &(t, delta) in events {
        let t = t.clamp(from, to);
        total += f64::from(running) * (t - at);
        at = t;
        running += delta;
    }
    total + f64::from(running) * (to - at).max(0.0)
}

/// How one build is given its job slots.
enum Slots<'a> {
    /// The tool's own `-jN`.
    Own(u32),
    /// `baton run --weight W`.
    Baton {
        broker: &'a BrokerProcess,
        weight: u32,
    },
    /// One GNU jobserver FIFO shared by every build.
    SharedMemory(&'a SharedFifo),
}

fn command(bench: &Bench, tool: &Tool, graph: &Graph, slots: &Slots) -> Result<Command> {
    let program = match slots {
        Slots::Baton { .. } => &bench.env.baton_bin,
        _ => &tool.path,
    };
    let mut cmd = Command::new(program);
    // Only the jobserver this case gives: none inherited from our caller.
    cmd.current_dir(&graph.dir)
        .env_remove("MAKEFLAGS")
        .env_remove("CARGO_MAKEFLAGS")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    match slots {
        Slots::Own(n) if tool.kind == Kind::Cargo => {
            cmd.args(["build", "--offline", "--quiet", &format!("-j{n}")]);
        }
        Slots::Own(n) => {
            cmd.arg(format!("-j{n}"));
        }
        Slots::Baton { broker, weight } => {
            cmd.args(["run", "--socket"])
                .arg(broker.socket())
                .args(["--weight", &weight.to_string(), "--name", tool.name, "--"])
                .arg(&tool.path);
            if tool.kind == Kind::Cargo {
                cmd.args(["build", "--offline", "--quiet"]);
            }
        }
        Slots::SharedMemory(fifo) => fifo.hand_to(&mut cmd, tool.fifo)?,
    }
    if tool.kind == Kind::Cargo {
        cmd.env("RUSTC_WRAPPER", graph.dir.join("wrap.sh"))
            .env("CARGO_TARGET_DIR", graph.dir.join("target"))
            .env_remove("CARGO_BUILD_JOBS");
    }
    Ok(cmd)
}

/// A machine-wide jobserver as today's peers give it: one FIFO, one byte
/// per token, read and written by every build.
struct SharedFifo {
    path: PathBuf,
    /// Our handle keeps the FIFO open, so clients never see end of file.
    _keep: std::fs::File,
}

/// Where make 4.3 finds the shared FIFO's descriptors (`R,W`).
const SHARED_FDS: (i32, i32) = (100, 101);

impl SharedFifo {
    fn create(dir: &Path, tokens: u32) -> Result<SharedFifo> {
        use std::io::Write;
        let path = dir.join("shared.fifo");
        let _ = std::fs::remove_file(&path);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
        // SAFETY: mkfifo reads the path it is given.
        if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
            return Err(std::io::Error::last_os_error()).context("mkfifo");
        }
        let mut keep = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)?;
        keep.write_all(&vec![b'+'; tokens as usize])?;
        Ok(SharedFifo { path, _keep: keep })
    }

    fn hand_to(&self, cmd: &mut Command, fifo: bool) -> Result<()> {
        if fifo {
            cmd.env(
                "MAKEFLAGS",
                format!("-j --jobserver-auth=fifo:{}", self.path.display()),
            );
            return Ok(());
        }
        let read = std::fs::File::open(&self.path)?;
        let write = std::fs::OpenOptions::new().write(true).open(&self.path)?;
        cmd.env(
            "MAKEFLAGS",
            format!("-j --jobserver-auth={},{}", SHARED_FDS.0, SHARED_FDS.1),
        );
        use std::os::fd::AsRawFd;
        let (r, w) = (read.as_raw_fd(), write.as_raw_fd());
        // SAFETY: dup2 is async-signal-safe; the files outlive the spawn
        // (the closure holds them).
        unsafe {
            cmd.pre_exec(move || {
                let _ = (&read, &write);
                for (from, to) in [(r, SHARED_FDS.0), (w, SHARED_FDS.1)] {
                    if libc::dup2(from, to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }
}

/// A finished build: its wall time and job events.
struct Ran {
    wall: f64,
    events: Vec<(f64, i32)>,
}

fn children_usage() -> Usage {
    // SAFETY: getrusage fills the struct it is given and nothing else.
    let ru = unsafe {
        let mut ru = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru);
        ru
    };
    Usage::from_rusage(&ru)
}

/// Starts every build at once and waits for all; returns each build's
/// outcome and what all of them spent.
fn run_together(builds: Vec<(Command, &Graph)>) -> Result<(Vec<Ran>, Usage)> {
    let before = children_usage();
    let started = Instant::now();
    let mut children: Vec<(Child, &Graph)> = Vec::new();
    for (mut cmd, graph) in builds {
        children.push((cmd.spawn().context("starting a build")?, graph));
    }
    // Each build's wall time ends when it does, whatever the order.
    let mut walls: Vec<Option<f64>> = vec![None; children.len()];
    while walls.iter().any(Option::is_none) {
        for ((child, graph), wall) in children.iter_mut().zip(&mut walls) {
            if wall.is_some() {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    bail!("a build in {} failed: {status}", graph.dir.display());
                }
                *wall = Some(started.elapsed().as_secs_f64());
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let ran = children
        .iter()
        .zip(walls)
        .map(|((_, graph), wall)| {
            Ok(Ran {
                wall: wall.expect("every build ended"),
                events: graph.events()?,
            })
        })
        .collect::<Result<_>>()?;
    Ok((ran, children_usage() - before))
}

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    let tools = tools()?;
    let root = bench.env.tmp.join("builds");
    let n = scale.tokens;
    anyhow::ensure!(
        n >= 4,
        "--tokens must be at least 4: three builds each run one job of their own"
    );
    let mut rows = alone(
        bench,
        scale,
        tools.iter().chain(&bmake()).chain(&cargo()),
        &root,
    )?;
    let broker = BrokerProcess::start_with(n, &bench.env, Wait::Blocking, &[])?;
    rows.extend(together(
        bench,
        scale,
        &tools,
        &root,
        "three at once, baton",
        |_| Slots::Baton {
            broker: &broker,
            weight: 1,
        },
    )?);
    let fifo = SharedFifo::create(&root, n - tools.len() as u32)?;
    rows.extend(together(
        bench,
        scale,
        &tools,
        &root,
        "three at once, one shared FIFO",
        |_| Slots::SharedMemory(&fifo),
    )?);
    let contained = containers(bench, scale, &tools, &root)?;
    let contained_note = match &contained {
        Some(_) => format!(
            "containers: one per tool, made with unshare (PID, mount, network namespaces), at once; jobs spin {SPIN} \
             times in bash (CPU, not a sleep); each its own -j$(nproc), then each under baton run against one broker \
             of $(nproc) tokens; peak: most jobs running at once across the three, from their logs; ratios: medians \
             of each round's baton / own, of {} alternating round(s)",
            scale.rounds.max(1)
        ),
        None => "containers: not measured (needs root and unshare)".to_string(),
    };
    rows.extend(contained.unwrap_or_default());
    let weight = |t: &Tool| if t.kind == Kind::Ninja { 2 } else { 1 };
    rows.extend(together(
        bench,
        scale,
        &tools,
        &root,
        "weights 1:1:2, baton",
        |t| Slots::Baton {
            broker: &broker,
            weight: weight(t),
        },
    )?);
    let notes = vec![
        format!("{} jobs per build, each sleeping {} ms; limit {n}", scale.ops, scale.job_us / 1000),
        format!("alone: running and wall are baton run's over the tool's own -jN, medians of {} alternating round(s)", scale.rounds.max(1)),
        "share: the build's part of the job-seconds spent while all three builds ran jobs; fair_share by weight".into(),
        "shared FIFO: N - 3 tokens in one FIFO, as each top-level client runs one job of its own".into(),
        "context switches and CPU: every process of the builds (jobs included), not the broker".into(),
        contained_note,
    ];
    Ok(Findings { rows, notes })
}

/// Each tool alone: its own -jN, then baton run on a pool of N, in
/// `scale.rounds` alternating rounds. Each row is the round of median wall
/// time; the ratios are the medians of each round's baton / own.
fn alone<'a>(
    bench: &Bench,
    scale: &Scale,
    tools: impl IntoIterator<Item = &'a Tool>,
    root: &Path,
) -> Result<Vec<Row>> {
    let n = scale.tokens;
    let broker = BrokerProcess::start_with(n, &bench.env, Wait::Blocking, &[])?;
    let mut rows = Vec::new();
    for tool in tools {
        let ways = [
            (format!("own -j{n}"), Slots::Own(n)),
            (
                "baton run".to_string(),
                Slots::Baton {
                    broker: &broker,
                    weight: 1,
                },
            ),
        ];
        let mut rounds: [Vec<Alone>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..scale.rounds.max(1) {
            for ((_, slots), measured) in ways.iter().zip(&mut rounds) {
                // Afresh: nothing built, nothing logged.
                let graph = Graph::write(root, tool.name, tool.kind, scale.ops, scale.job_us)?;
                let (ran, usage) =
                    run_together(vec![(command(bench, tool, &graph, slots)?, &graph)])?;
                let ran = &ran[0];
                measured.push(Alone {
                    running: busy(&ran.events, 0.0, f64::MAX) / ran.wall,
                    wall: ran.wall,
                    usage,
                });
            }
        }
        let ratio = |of: fn(&Alone) -> f64| {
            median(
                rounds[1]
                    .iter()
                    .zip(&rounds[0])
                    .map(|(b, o)| of(b) / of(o))
                    .collect(),
            )
        };
        for ((label, _), measured) in ways.iter().zip(&rounds) {
            let typical = Alone::median_wall(measured);
            let row = Row::new(
                label,
                1,
                scale.ops,
                typical.usage,
                None,
                Duration::from_secs_f64(typical.wall),
            )
            .with("case", "alone")
            .with("tool", tool.name)
            .with("running", round(typical.running))
            .with("rounds", measured.len());
            rows.push(row);
        }
        let last = rows.pop().expect("baton's row");
        rows.push(
            last.with("running_ratio", round(ratio(|a| a.running)))
                .with("wall_ratio", round(ratio(|a| a.wall))),
        );
    }
    Ok(rows)
}

/// How many times each job of the containers case spins in bash: about
/// a tenth of a second of CPU here.
const SPIN: u64 = 50_000;

/// Three containers at once, one per tool (unshare: PID, mount and
/// network namespaces; the broker's socket is on the file system they
/// share), each running jobs that spin: a CI host running three jobs, each
/// in its own container. First each build at its own -j$(nproc), then each
/// under `baton run` against one broker of $(nproc) tokens, in
/// `scale.rounds` alternating rounds. Each row is the round of median wall
/// time; baton's has the medians of each round's ratios to own.
/// None where containers cannot be made (not root, no unshare).
fn containers(
    bench: &Bench,
    scale: &Scale,
    tools: &[Tool],
    root: &Path,
) -> Result<Option<Vec<Row>>> {
    let made = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount-proc",
            "--mount",
            "--net",
            "true",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !made {
        return Ok(None);
    }
    let n = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let broker = BrokerProcess::start_with(n, &bench.env, Wait::Blocking, &[])?;
    let ways = [
        (format!("own -j{n}"), Slots::Own(n)),
        (
            "baton run".to_string(),
            Slots::Baton {
                broker: &broker,
                weight: 1,
            },
        ),
    ];
    let mut rounds: [Vec<Contained>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..scale.rounds.max(1) {
        for ((_, slots), measured) in ways.iter().zip(&mut rounds) {
            let graphs: Vec<Graph> = tools
                .iter()
                .map(|t| {
                    let name = format!("container {}", t.name);
                    Graph::write_spinning(root, &name, t.kind, scale.ops, SPIN)
                })
                .collect::<Result<_>>()?;
            let builds = tools
                .iter()
                .zip(&graphs)
                .map(|(t, g)| Ok((in_a_container(&command(bench, t, g, slots)?), g)))
                .collect::<Result<Vec<_>>>()?;
            let (ran, usage) = run_together(builds)?;
            let mut events: Vec<(f64, i32)> = ran.iter().flat_map(|r| r.events.clone()).collect();
            events.sort_by(|a, b| a.0.total_cmp(&b.0));
            let wall = ran.iter().map(|r| r.wall).fold(0.0, f64::max);
            measured.push(Contained {
                peak: peak(&events),
                running: busy(&events, 0.0, f64::MAX) / wall,
                wall,
                usage,
            });
        }
    }
    let ratio = |of: fn(&Contained) -> f64| {
        median(
            rounds[1]
                .iter()
                .zip(&rounds[0])
                .map(|(b, o)| of(b) / of(o))
                .collect(),
        )
    };
    let mut rows = Vec::new();
    for ((label, _), measured) in ways.iter().zip(&rounds) {
        let mut sorted = measured.clone();
        sorted.sort_by(|a, b| a.wall.total_cmp(&b.wall));
        let typical = sorted[sorted.len() / 2];
        rows.push(
            Row::new(
                label,
                tools.len(),
                scale.ops * tools.len() as u64,
                typical.usage,
                None,
                Duration::from_secs_f64(typical.wall),
            )
            .with("case", "containers")
            .with("tool", format!("{} containers", tools.len()))
            .with("peak", typical.peak)
            .with("running", round(typical.running))
            .with("rounds", measured.len()),
        );
    }
    let last = rows.pop().expect("baton's row");
    rows.push(
        last.with("running_ratio", round(ratio(|c| c.running)))
            .with("wall_ratio", round(ratio(|c| c.wall)))
            .with("peak_ratio", round(ratio(|c| f64::from(c.peak))))
            .with(
                "csw_ratio",
                round(ratio(|c| c.usage.context_switches() as f64)),
            ),
    );
    Ok(Some(rows))
}

/// `cmd` run in a container of its own: new PID (with its /proc), mount
/// and network namespaces; killed with the container's init if unshare
/// dies.
fn in_a_container(cmd: &Command) -> Command {
    let mut c = Command::new("unshare");
    c.args([
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        "--mount",
        "--net",
        "--",
    ])
    .arg(cmd.get_program())
    .args(cmd.get_args())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    if let Some(dir) = cmd.get_current_dir() {
        c.current_dir(dir);
    }
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => c.env(key, value),
            None => c.env_remove(key),
        };
    }
    c
}

/// The most jobs running at once.
fn peak(events: &[(f64, i32)]) -> u32 {
    let (mut running, mut most) = (0i32, 0i32);
    for &(_, delta) in events {
        running += delta;
        most = most.max(running);
    }
    most.max(0) as u32
}

/// Three containers' builds, measured.
#[derive(Clone, Copy)]
struct Contained {
    peak: u32,
    /// Mean jobs running at once.
    running: f64,
    wall: f64,
    usage: Usage,
}

/// One build alone, measured.
#[derive(Clone, Copy)]
struct Alone {
    /// Mean jobs running at once.
    running: f64,
    wall: f64,
    usage: Usage,
}

impl Alone {
    /// The round of median wall time (the upper middle of an even count).
    fn median_wall(rounds: &[Alone]) -> Alone {
        let mut sorted = rounds.to_vec();
        sorted.sort_by(|a, b| a.wall.total_cmp(&b.wall));
        sorted[sorted.len() / 2]
    }
}

/// The three tools at once, each given its slots by `slots`.
fn together<'a>(
    bench: &Bench,
    scale: &Scale,
    tools: &'a [Tool],
    root: &Path,
    case: &str,
    slots: impl Fn(&'a Tool) -> Slots<'a>,
) -> Result<Vec<Row>> {
    let graphs: Vec<Graph> = tools
        .iter()
        .map(|t| Graph::write(root, t.name, t.kind, scale.ops, scale.job_us))
        .collect::<Result<_>>()?;
    let weights: Vec<u32> = tools
        .iter()
        .map(|t| match slots(t) {
            Slots::Baton { weight, .. } => weight,
            _ => 1,
        })
        .collect();
    let builds = tools
        .iter()
        .zip(&graphs)
        .map(|(t, g)| Ok((command(bench, t, g, &slots(t))?, g)))
        .collect::<Result<Vec<_>>>()?;
    let (ran, usage) = run_together(builds)?;
    // While all three ran jobs: from the last first start to the first last end.
    let from = ran
        .iter()
        .map(|r| r.events.first().map_or(0.0, |e| e.0))
        .fold(f64::MIN, f64::max);
    let to = ran
        .iter()
        .map(|r| r.events.last().map_or(0.0, |e| e.0))
        .fold(f64::MAX, f64::min);
    let spent: Vec<f64> = ran.iter().map(|r| busy(&r.events, from, to)).collect();
    let total: f64 = spent.iter().sum();
    let total_weight: u32 = weights.iter().sum();
    let mechanism = if case.contains("FIFO") {
        "shared FIFO"
    } else {
        "baton run"
    };
    Ok(tools
        .iter()
        .zip(&ran)
        .zip(spent.iter().zip(&weights))
        .map(|((tool, r), (&s, &w))| {
            Row::new(
                mechanism,
                tools.len(),
                scale.ops,
                usage,
                None,
                Duration::from_secs_f64(r.wall),
            )
            .with("case", case)
            .with("tool", tool.name)
            .with("running", round(busy(&r.events, 0.0, f64::MAX) / r.wall))
            .with("share", round(if total > 0.0 { s / total } else { 0.0 }))
            .with("fair_share", round(f64::from(w) / f64::from(total_weight)))
            .with("window_s", round(to - from))
        })
        .collect())
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
