//! stress-ng's own pipe-herd figure (`--pipeherd`: 100 processes passing a
//! counter through one pipe in blocking reads), reported beside ours where
//! stress-ng is installed. Its processes are counted by us too, from the
//! kernel (RUSAGE_CHILDREN before and after), as well as by itself.

use crate::measure::Usage;
use crate::report::Row;
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// stress-ng's fixed number of pipe-herd child processes.
const HERD: usize = 100;
/// How long it runs; on a machine so loaded that its hundred processes
/// passed nothing in that time, once more for longer.
const RUN: Duration = Duration::from_secs(3);
const LOADED_RUN: Duration = Duration::from_secs(10);

/// Runs one pipe-herd worker for a few seconds; `None` without stress-ng.
pub fn pipeherd() -> Result<Option<Row>> {
    let Some(stress_ng) = find_in_path("stress-ng") else {
        return Ok(None);
    };
    let row = pipeherd_for(&stress_ng, RUN)?;
    if row.operations > 0 {
        return Ok(Some(row));
    }
    Ok(Some(pipeherd_for(&stress_ng, LOADED_RUN)?))
}

fn pipeherd_for(stress_ng: &std::path::Path, run: Duration) -> Result<Row> {
    let before = children_usage();
    let started = Instant::now();
    let output = Command::new(stress_ng)
        .args([
            "--pipeherd",
            "1",
            "--timeout",
            &format!("{}s", run.as_secs()),
            "--metrics",
        ])
        .output()
        .with_context(|| format!("running {}", stress_ng.display()))?;
    let wall = started.elapsed();
    let usage = children_usage() - before;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(
        output.status.success(),
        "stress-ng --pipeherd failed ({}): {text}",
        output.status
    );
    let bogo_ops = bogo_ops(&text)
        .with_context(|| format!("no pipeherd bogo ops in stress-ng's output: {text}"))?;
    let own_figure = switches_per_bogo_op(&text).with_context(|| {
        format!("no context switches per bogo op in stress-ng's output: {text}")
    })?;
    Ok(Row::new(
        "stress-ng --pipeherd (blocking reads)",
        HERD,
        bogo_ops,
        usage,
        None,
        wall,
    )
    .with("stress_ng_context_switches_per_op", own_figure))
}

/// `stress-ng: metrc: [PID] pipeherd   20314619   59.97 ...`
fn bogo_ops(text: &str) -> Option<u64> {
    text.lines().filter(|l| l.contains("metrc:")).find_map(|l| {
        let mut words = l
            .split_whitespace()
            .skip_while(|w| *w != "pipeherd")
            .skip(1);
        words.next()?.parse().ok()
    })
}

/// `stress-ng: metrc: [PID] pipeherd   0.38 context switches per bogo op ...`
fn switches_per_bogo_op(text: &str) -> Option<f64> {
    let line = text
        .lines()
        .find(|l| l.contains("context switches per bogo op"))?;
    line.split_whitespace()
        .skip_while(|w| *w != "pipeherd")
        .nth(1)?
        .parse()
        .ok()
}

/// Every waited-for descendant's usage so far (getrusage RUSAGE_CHILDREN).
fn children_usage() -> Usage {
    // SAFETY: getrusage fills the struct it is given and nothing else.
    let ru = unsafe {
        let mut ru = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru);
        ru
    };
    Usage::from_rusage(&ru)
}

fn find_in_path(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}
