//! One cluster pool in etcd (docs/cluster.md): N brokers, each a `baton
//! serve` process with one client that takes a token, holds it briefly and
//! gives it back, contend for a pool of a few cluster tokens. Measured
//! beside the naive design in the same run: every waiting broker watching
//! every token slot (`--cluster-watch-all`) instead of the queue where each
//! watches only its predecessor. The cross-machine herd shows as etcd
//! watch events delivered per grant: each one wakes a broker.

use super::{Bench, Defaults, Findings, Scale};
use crate::etcd::Etcd;
use crate::measure::Usage;
use crate::report::Row;
use anyhow::{bail, Context, Result};
use baton_client::Client;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// 1, 10 and 100 brokers on a pool of 4, each job 1 ms; spares go back at
/// once (no linger), so every grant is a trip through etcd.
pub const DEFAULTS: Defaults = Defaults {
    waiters: &[1, 10, 100],
    ops: 300,
    tokens: 4,
    job_us: 1000,
    wake: 1,
};

/// The two designs: the queue, and every waiter watching every slot.
const DESIGNS: &[(&str, bool)] = &[("etcd-queue", false), ("etcd-watch-all", true)];

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    anyhow::ensure!(
        bench.with_baton(),
        "the cluster scenario measures baton's brokers only: it needs baton"
    );
    let etcd = Etcd::start(1, &bench.env.tmp.join("etcd"))?;
    let cases: Vec<(usize, (&str, bool))> = scale
        .waiters
        .iter()
        .flat_map(|&n| DESIGNS.iter().map(move |&d| (n, d)))
        .collect();
    let rows = bench.each(
        &cases,
        |(n, (name, _))| format!("cluster: {name}, {n} brokers"),
        |&(brokers, design)| measure(bench, &etcd, brokers, design, scale),
    )?;
    let notes = vec![
        format!("operations are grants of a cluster token: {} tokens in etcd, one broker process per waiter with one client, each job {} µs, no linger; a client asks again once its broker has given its token back to etcd", scale.tokens, scale.job_us),
        "csw/op and CPU count every broker, etcd and the clients; watch_events_per_grant is the herd figure: etcd watch events the brokers received, per grant".to_string(),
    ];
    Ok(Findings { rows, notes })
}

fn measure(
    bench: &Bench,
    etcd: &Etcd,
    n: usize,
    (name, watch_all): (&str, bool),
    scale: &Scale,
) -> Result<Row> {
    let dir = bench.env.tmp.join(format!("{name}-{n}"));
    std::fs::create_dir_all(&dir)?;
    let pool = format!("bench-{name}-{n}");
    let brokers = (0..n)
        .map(|i| {
            PoolMember::start(
                &bench.env.baton_bin,
                &dir.join(format!("b{i}")),
                etcd,
                &pool,
                scale.tokens,
                watch_all,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let mut brokers = brokers;
    for broker in &mut brokers {
        broker.wait_until_ready()?;
    }
    let mut pids: Vec<i32> = brokers.iter().map(|b| b.child.id() as i32).collect();
    let broker_pids = pids.clone();
    pids.extend(
        etcd.members
            .iter()
            .filter_map(|m| m.pid())
            .map(|p| p as i32),
    );
    let usage = || -> Result<(Usage, Usage)> {
        let brokers: Usage = broker_pids
            .iter()
            .map(|&p| Usage::of_process(p))
            .sum::<Result<Usage>>()?;
        let rest: Usage = pids[broker_pids.len()..]
            .iter()
            .map(|&p| Usage::of_process(p))
            .sum::<Result<Usage>>()?;
        Ok((brokers, rest + Usage::of_self()))
    };

    let grants = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(n + 1));
    let threads: Vec<_> = brokers
        .iter()
        .map(|b| {
            let (socket, grants, start, ops, job) = (
                b.socket.clone(),
                grants.clone(),
                start.clone(),
                scale.ops,
                Duration::from_micros(scale.job_us),
            );
            std::thread::spawn(move || client(&socket, &grants, &start, ops, job))
        })
        .collect();
    let (brokers_before, rest_before) = usage()?;
    let began = Instant::now();
    start.wait();
    let mut latencies = Vec::new();
    for thread in threads {
        latencies.extend(
            thread
                .join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))??,
        );
    }
    let wall = began.elapsed();
    let (brokers_after, rest_after) = usage()?;
    let events: u64 = brokers
        .iter()
        .map(PoolMember::watch_events)
        .sum::<Result<u64>>()?;
    let ops = latencies.len() as u64;
    latencies.sort();
    let broker_usage = brokers_after - brokers_before;
    let row = Row::new(
        name,
        n,
        ops,
        broker_usage + (rest_after - rest_before),
        Some(broker_usage),
        wall,
    )
    .with("grant_p50_ms", ms(percentile(&latencies, 0.50)))
    .with("grant_p99_ms", ms(percentile(&latencies, 0.99)))
    .with(
        "watch_events_per_grant",
        (events as f64 / ops.max(1) as f64 * 100.0).round() / 100.0,
    );
    Ok(row)
}

/// One broker's client: take, hold for a job's time, give back, until the
/// run has had `ops` grants; returns how long each grant took. Before it
/// asks again it waits until its broker has given the cluster token back
/// to etcd: a broker whose builds keep asking would otherwise keep its
/// token and grant it again locally, and the run would measure that
/// instead of the hand-off between brokers.
fn client(
    socket: &Path,
    grants: &AtomicU64,
    start: &Barrier,
    ops: u64,
    job: Duration,
) -> Result<Vec<Duration>> {
    let mut client = Client::connect(socket, "bench cluster")?;
    start.wait();
    let mut latencies = Vec::new();
    while grants.fetch_add(1, SeqCst) < ops {
        let asked = Instant::now();
        client.acquire(1)?;
        latencies.push(asked.elapsed());
        std::thread::sleep(job);
        client.release(1)?;
        while client.status()?.cluster.is_some_and(|c| c.held > 0) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(latencies)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted
        .get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default()
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e5).round() / 100.0
}

/// A `baton serve` in the pool; SIGTERM by pid on drop.
struct PoolMember {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl PoolMember {
    fn start(
        baton: &Path,
        dir: &Path,
        etcd: &Etcd,
        pool: &str,
        tokens: u32,
        watch_all: bool,
    ) -> Result<PoolMember> {
        std::fs::create_dir_all(dir)?;
        let socket = dir.join("socket");
        let mut serve = Command::new(baton);
        serve
            .args(["serve", "--quiet", "--no-fuse", "--jobs", "1", "--socket"])
            .arg(&socket);
        serve.args([
            "--etcd",
            &etcd.endpoints(),
            "--cluster-pool",
            pool,
            "--cluster-jobs",
            &tokens.to_string(),
            "--cluster-linger-ms",
            "0",
        ]);
        if watch_all {
            serve.arg("--cluster-watch-all");
        }
        // Its own log, not our stderr: what it says would run into the
        // progress line, and an error quotes it whole.
        let log = dir.join("broker.log");
        let child = serve
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting baton serve")?;
        Ok(PoolMember { child, socket, log })
    }

    /// Waits until the broker listens; an error at once if it exits first
    /// (a baton built without cluster pools refuses --etcd).
    fn wait_until_ready(&mut self) -> Result<()> {
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "the cluster scenario cannot run: baton serve --etcd exited ({status}) before listening: {}",
                    std::fs::read_to_string(&self.log)
                        .unwrap_or_default()
                        .trim()
                );
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!(
                    "the broker at {} did not listen within 60 s",
                    self.socket.display()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    fn watch_events(&self) -> Result<u64> {
        let status = Client::connect(&self.socket, "bench cluster status")?.status()?;
        Ok(status.cluster.map_or(0, |c| c.watch_events))
    }
}

impl Drop for PoolMember {
    fn drop(&mut self) {
        // SAFETY: kill only sends a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}
