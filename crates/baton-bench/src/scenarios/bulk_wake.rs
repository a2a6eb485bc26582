//! Chris Mason's sembench (LKML, 2010): a waker puts W tokens in per round for N waiters;
//! each of W waiters wakes, takes one, uses it up and reports done; the
//! waker waits for all W before the next round. Reports wake-ups per second
//! and how evenly they fell on the waiters.
//!
//! The mechanism under test carries the wake-ups; the reports of done go
//! back through one futex semaphore in every row, so rows differ only in
//! how the waiters are woken. baton adds tokens the only way it can: by
//! raising the limit by W and lowering it back at once.

use super::{cases, Bench, Defaults, Findings, Scale};
use crate::mechanisms::{Mechanism, Pool};
use crate::report::Row;
use crate::sys::SharedMemory;
use crate::team::{self, Counts, Start};
use anyhow::{ensure, Result};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

pub const DEFAULTS: Defaults = Defaults {
    waiters: &[64],
    ops: 20_000,
    tokens: 0,
    job_us: 0,
    wake: 8,
};

const MECHANISMS: &[Mechanism] = &[
    Mechanism::SysvSemaphore,
    Mechanism::Futex,
    Mechanism::BatonNative,
    Mechanism::BatonNativeNoSpin,
    Mechanism::BatonNativeNoUring,
];

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    ensure!(scale.wake >= 1, "--wake must be at least 1");
    let cases = cases(&scale.waiters, &bench.mechanisms(MECHANISMS));
    let rows = bench.each(
        &cases,
        |(n, m)| format!("bulk-wake: {} with {n} waiters", m.name()),
        |&(waiters, mechanism)| measure(bench, mechanism, waiters, scale),
    )?;
    let note = "operations are wake-ups of a waiter that got a token; min/max_per_waiter show how evenly they fell";
    Ok(Findings {
        rows,
        notes: vec![note.to_string()],
    })
}

struct Pools {
    work: Box<dyn Pool>,
    done: Box<dyn Pool>,
}

fn measure(bench: &Bench, mechanism: Mechanism, waiters: usize, scale: &Scale) -> Result<Row> {
    ensure!(
        scale.wake as usize <= waiters,
        "--wake ({}) must not exceed --waiters ({waiters})",
        scale.wake
    );
    let rounds = scale.ops.div_ceil(u64::from(scale.wake));
    // A broker's limit is at least 1: that one token stays with the waker.
    let initial = if mechanism.is_baton() { 1 } else { 0 };
    let pools = Pools {
        work: mechanism.create(initial, &bench.env)?,
        done: Mechanism::Futex.create(0, &bench.env)?,
    };
    let stop = SharedMemory::<AtomicBool>::new(1)?;
    // Child 0 is the waker; children 1..=waiters wait.
    let outcome = team::run(waiters + 1, pools.work.broker_pid(), |index, start| {
        if index == 0 {
            waker(&pools, start, &stop[0], scale.wake, rounds, waiters)
        } else {
            waiter(&pools, start, &stop[0])
        }
    })?;
    let per_waiter: Vec<u64> = outcome.per_child[1..].iter().map(|c| c.ops).collect();
    let row = Row::of_team(
        mechanism.name(),
        waiters,
        &outcome,
        pools.work.broker_pid().is_some(),
    )
    .with("wake", scale.wake)
    .with(
        "min_per_waiter",
        per_waiter.iter().copied().min().unwrap_or(0),
    )
    .with(
        "max_per_waiter",
        per_waiter.iter().copied().max().unwrap_or(0),
    );
    Ok(row)
}

fn waker(
    pools: &Pools,
    start: &mut Start,
    stop: &AtomicBool,
    wake: u32,
    rounds: u64,
    waiters: usize,
) -> Result<Counts> {
    let mut work = pools.work.open_waker()?;
    let mut done = pools.done.open()?;
    start.now()?;
    for _ in 0..rounds {
        work.add(wake)?;
        done.acquire(wake)?;
    }
    // One more token for every waiter, to wake it to the stop.
    stop.store(true, SeqCst);
    work.add(waiters as u32)?;
    Ok(Counts::default())
}

fn waiter(pools: &Pools, start: &mut Start, stop: &AtomicBool) -> Result<Counts> {
    let mut work = pools.work.open()?;
    let mut done = pools.done.open()?;
    start.now()?;
    let mut woken = 0;
    loop {
        work.acquire(1)?;
        if stop.load(SeqCst) {
            return Ok(Counts {
                ops: woken,
                wakeups: 0,
            });
        }
        woken += 1;
        work.use_up()?;
        done.release(1)?;
    }
}
