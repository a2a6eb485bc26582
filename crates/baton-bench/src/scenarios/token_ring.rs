//! Linux commit 0ddad21d3e ("pipe: use exclusive waits when reading or
//! writing"): P processes pass one token around T times. As in its test
//! program, every second
//! transfer also puts an extra token in, which whoever takes it consumes
//! without passing on: it checks that a wake-up nobody uses still hands
//! the turn to the next waiter. baton cannot take part in that detail:
//! only its limit makes tokens, so its row passes the one token alone.

use super::{cases, Bench, Defaults, Findings, Scale};
use crate::mechanisms::{Mechanism, Tokens};
use crate::report::Row;
use crate::sys::SharedMemory;
use crate::team::{self, Counts};
use anyhow::Result;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

/// The commit's test passes the token 1,000,000 times among 64 processes;
/// that takes minutes on two cores with six mechanisms, so the default is
/// smaller (`--ops 1000000` reproduces its size).
pub const DEFAULTS: Defaults = Defaults {
    waiters: &[64],
    ops: 20_000,
    tokens: 1,
    job_us: 0,
    wake: 1,
};

const MECHANISMS: &[Mechanism] = &[
    Mechanism::PipeBlocking,
    Mechanism::PipePoll,
    Mechanism::PosixSemaphore,
    Mechanism::FutexFifo,
    Mechanism::SysvSemaphore,
    Mechanism::Eventfd,
    Mechanism::BatonNative,
    Mechanism::BatonNativeNoSpin,
    Mechanism::BatonNativeNoUring,
    Mechanism::FastpathRing,
    Mechanism::FastpathPile,
    Mechanism::BatonFastpath,
    Mechanism::BatonFastpathPile,
];

/// The ring's state, in memory shared by its processes.
#[derive(Default)]
struct Ring {
    /// Transfers done; only the holder of the real token touches it.
    transfers: AtomicU64,
    /// Extra tokens put in and not yet consumed.
    extra: AtomicU64,
}

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    let cases = cases(&scale.waiters, &bench.mechanisms(MECHANISMS));
    let rows = bench.each(
        &cases,
        |(n, m)| format!("token-ring: {} among {n} processes", m.name()),
        |&(processes, mechanism)| measure(bench, mechanism, processes, scale.ops),
    )?;
    let notes = vec![
        "operations are token transfers; every second one also puts in an extra token that its taker consumes (as in the Linux commit's test program), except for baton, where only the limit makes tokens".to_string(),
    ];
    Ok(Findings { rows, notes })
}

fn measure(bench: &Bench, mechanism: Mechanism, processes: usize, transfers: u64) -> Result<Row> {
    let pool = mechanism.create(1, &bench.env)?;
    let ring = SharedMemory::<Ring>::new(1)?;
    let outcome = team::run(processes, pool.broker_pid(), |_, start| {
        let mut tokens = pool.open()?;
        start.now()?;
        let done = pass_token(
            &mut *tokens,
            &ring[0],
            transfers,
            mechanism.mints_on_release(),
        )?;
        Ok(Counts {
            ops: done,
            wakeups: 0,
        })
    })?;
    Ok(Row::of_team(
        mechanism.name(),
        processes,
        &outcome,
        pool.broker_pid().is_some(),
    )
    .with("extra_token", mechanism.mints_on_release()))
}

/// One process's part of the ring; returns the transfers it made.
fn pass_token(
    tokens: &mut dyn Tokens,
    ring: &Ring,
    transfers: u64,
    with_extra: bool,
) -> Result<u64> {
    let mut made = 0;
    tokens.acquire(1)?;
    loop {
        if take_extra(ring) {
            // The test program's ignored token: consumed, not passed on.
            tokens.acquire(1)?;
            continue;
        }
        let done = ring.transfers.load(SeqCst);
        if done >= transfers {
            tokens.release(1)?;
            return Ok(made);
        }
        ring.transfers.store(done + 1, SeqCst);
        made += 1;
        if with_extra && done % 2 == 1 {
            // Counted before it is put in, so its taker knows it for extra.
            ring.extra.fetch_add(1, SeqCst);
            tokens.release(1)?;
        }
        tokens.cycle(1)?;
    }
}

/// Whether the token just taken counts as an extra one. Tokens are
/// interchangeable, so of two holders whichever claims first is the extra.
fn take_extra(ring: &Ring) -> bool {
    ring.extra
        .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
        .is_ok()
}
