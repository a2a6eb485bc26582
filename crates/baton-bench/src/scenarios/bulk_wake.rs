//! Chris Mason's sembench (LKML, 2010): a waker puts W tokens in per round for N waiters;
//! each of W waiters wakes, takes one, uses it up and reports done; the
//! waker waits for all W before the next round. Reports wake-ups per second
//! and how evenly they fell on the waiters.
//!
//! The mechanism under test carries the wake-ups; the reports of done go
//! back through one futex semaphore in every row, so rows differ only in
//! how the waiters are woken. baton adds tokens the only way it can: by
//! raising the limit by W and lowering it back at once. Its fast path
//! cannot retire a token, so there the waker starts with every token the
//! run hands out and adds W by releasing W in the region, and each waiter
//! keeps what it is woken with (mechanisms/baton.rs, `Stock`).

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
    Mechanism::BatonFastpath,
];

/// The most tokens one fast-path record holds (its `held` is 16 bits),
/// so the most the fast path's waker can start with.
const FASTPATH_STOCK_MAX: u64 = u16::MAX as u64;

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    ensure!(scale.wake >= 1, "--wake must be at least 1");
    let cases = cases(&scale.waiters, &bench.mechanisms(MECHANISMS));
    // Refused before any row runs, not after the others took their time.
    for &(waiters, mechanism) in &cases {
        initial_tokens(mechanism, rounds(scale), scale.wake, waiters)?;
    }
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
    let rounds = rounds(scale);
    let initial = initial_tokens(mechanism, rounds, scale.wake, waiters)?;
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

fn rounds(scale: &Scale) -> u64 {
    scale.ops.div_ceil(u64::from(scale.wake))
}

/// The tokens the run starts with: none for a kernel counter (the waker
/// makes each); one for a broker, whose limit is at least 1 (the waker
/// holds it); for the fast path, every token the run hands out, one per
/// wake-up and one per waiter to wake it to the stop.
fn initial_tokens(mechanism: Mechanism, rounds: u64, wake: u32, waiters: usize) -> Result<u32> {
    if mechanism == Mechanism::BatonFastpath {
        let stock = rounds * u64::from(wake) + waiters as u64;
        ensure!(
            stock <= FASTPATH_STOCK_MAX,
            "bulk-wake's fast-path row starts with every token it hands out \
             ({stock} for these --ops, --wake and --waiters), and one client \
             holds at most {FASTPATH_STOCK_MAX} in a region: lower --ops"
        );
        return Ok(stock as u32);
    }
    Ok(u32::from(mechanism.is_baton()))
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
