//! The workload of blocking-vs-polling and mass-poll: N job runners share a few tokens;
//! each takes one, holds it for a job, gives it back and asks again, until
//! the run's budget of acquisitions is spent. Every acquisition is counted,
//! including each runner's last one, which finds the budget spent and hands
//! the token straight on.

use super::{cases, Bench, Findings, Scale};
use crate::mechanisms::Mechanism;
use crate::report::Row;
use crate::sys::SharedMemory;
use crate::team::{self, Counts};
use anyhow::Result;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Duration;

struct Workload {
    waiters: usize,
    tokens: u32,
    acquisitions: u64,
    job_us: u64,
}

/// Measures each mechanism at each number of waiters.
pub fn run(
    bench: &Bench,
    scale: &Scale,
    scenario: &str,
    mechanisms: &[Mechanism],
) -> Result<Findings> {
    let cases = cases(&scale.waiters, &bench.mechanisms(mechanisms));
    let rows = bench.each(
        &cases,
        |(n, m)| format!("{scenario}: {} with {n} waiters", m.name()),
        |&(waiters, mechanism)| {
            measure(
                bench,
                mechanism,
                &Workload {
                    waiters,
                    tokens: scale.tokens,
                    acquisitions: scale.ops,
                    job_us: scale.job_us,
                },
            )
        },
    )?;
    let note = "operations are acquisitions; each waiter's last one finds the budget spent and passes the token on";
    Ok(Findings {
        rows,
        notes: vec![note.to_string()],
    })
}

fn measure(bench: &Bench, mechanism: Mechanism, work: &Workload) -> Result<Row> {
    let pool = mechanism.create(work.tokens, &bench.env)?;
    let budget = SharedMemory::<AtomicU64>::new(1)?;
    budget[0].store(work.acquisitions, SeqCst);
    let outcome = team::run(work.waiters, pool.broker_pid(), |_, start| {
        let mut tokens = pool.open()?;
        start.now()?;
        tokens.acquire(1)?;
        let mut acquisitions = 1;
        while budget[0]
            .fetch_update(SeqCst, SeqCst, |left| left.checked_sub(1))
            .is_ok()
        {
            job(work.job_us);
            tokens.cycle(1)?;
            acquisitions += 1;
        }
        tokens.release(1)?;
        Ok(Counts {
            ops: acquisitions,
            wakeups: 0,
        })
    })?;
    Ok(Row::of_team(
        mechanism.name(),
        work.waiters,
        &outcome,
        pool.broker_pid().is_some(),
    )
    .with("tokens", work.tokens)
    .with("job_us", work.job_us))
}

/// A job that sleeps, as a compiler waiting on its disk would, so that the
/// CPU left to the waiters is what the machine has: its own context switch
/// (the sleep) is part of every mechanism's figures alike.
fn job(us: u64) {
    if us > 0 {
        std::thread::sleep(Duration::from_micros(us));
    }
}
