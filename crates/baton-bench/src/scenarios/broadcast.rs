//! The futex requeue problem (Ingo Molnar, 2003): N threads wait on a condition; each round a
//! producer posts K work items and wakes waiters to take them, then waits
//! until all K are taken. pthread_cond_broadcast wakes all N for K items;
//! a directed hand-off wakes exactly the K that get one. baton's own case:
//! raising a running broker's limit by K grants exactly K waiters.
//!
//! The waiters are threads of one process, as in that test; wake-ups (returns
//! from waiting) are counted beside the context switches.

use super::{Bench, Defaults, Findings, Scale};
use crate::mechanisms::{Mechanism, Pool, Waker};
use crate::pthread::{Cond, Guard, Mutex};
use crate::report::Row;
use crate::team::{self, Counts, Start};
use anyhow::{ensure, Context, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Duration;

pub const DEFAULTS: Defaults = Defaults {
    waiters: &[64],
    ops: 20_000,
    tokens: 0,
    job_us: 0,
    wake: 2,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    /// One condition variable for all; the producer broadcasts.
    CondBroadcast,
    /// One condition variable per waiter; the producer hands each item to
    /// the waiter idle longest and signals that one.
    CondHandoff,
    /// Waiters block in ACQUIRE on a broker; the producer raises the limit
    /// by K and lowers it back at once, so the K granted tokens retire as
    /// their holders give them back.
    BatonLimit,
}

impl Flavor {
    fn name(self) -> &'static str {
        match self {
            Flavor::CondBroadcast => "pthread_cond_broadcast",
            Flavor::CondHandoff => "pthread directed hand-off",
            Flavor::BatonLimit => "baton native, limit +K",
        }
    }
}

pub fn run(bench: &Bench, scale: &Scale) -> Result<Findings> {
    ensure!(scale.wake >= 1, "--wake must be at least 1");
    let mut flavors = vec![Flavor::CondBroadcast, Flavor::CondHandoff];
    if bench.with_baton() {
        flavors.push(Flavor::BatonLimit);
    }
    let cases: Vec<(usize, Flavor)> = scale
        .waiters
        .iter()
        .flat_map(|&n| flavors.iter().map(move |&f| (n, f)))
        .collect();
    let rows = bench.each(
        &cases,
        |(n, f)| format!("broadcast: {} with {n} threads", f.name()),
        |&(waiters, flavor)| measure(bench, flavor, waiters, scale),
    )?;
    let note = "operations are items taken (baton: grants); wakeups_per_op counts returns from waiting per item";
    Ok(Findings {
        rows,
        notes: vec![note.to_string()],
    })
}

fn measure(bench: &Bench, flavor: Flavor, waiters: usize, scale: &Scale) -> Result<Row> {
    ensure!(
        scale.wake as usize <= waiters,
        "--wake ({}) must not exceed --waiters ({waiters})",
        scale.wake
    );
    let rounds = scale.ops.div_ceil(u64::from(scale.wake));
    let broker = match flavor {
        Flavor::BatonLimit => Some(Mechanism::BatonNative.create(1, &bench.env)?),
        _ => None,
    };
    let broker_pid = broker.as_ref().and_then(|b| b.broker_pid());
    let outcome = team::run(1, broker_pid, |_, start| {
        let room = Room::new(waiters);
        let plan = Plan {
            flavor,
            waiters,
            wake: scale.wake,
            rounds,
        };
        std::thread::scope(|scope| plan.run(scope, &room, broker.as_deref(), start))
    })?;
    let per_op = |x: u64| {
        if outcome.ops() == 0 {
            0.0
        } else {
            x as f64 / outcome.ops() as f64
        }
    };
    Ok(
        Row::of_team(flavor.name(), waiters, &outcome, broker.is_some())
            .with("wake", scale.wake)
            .with("wakeups_per_op", per_op(outcome.wakeups())),
    )
}

/// What the threads share.
struct Room {
    board: Mutex<Board>,
    /// The broadcast flavor's one condition.
    all: Cond,
    /// The hand-off flavor's condition per waiter.
    own: Vec<Cond>,
    /// The producer waits here for a round's items to be taken.
    done: Cond,
    taken: AtomicU64,
    wakeups: AtomicU64,
}

#[derive(Default)]
struct Board {
    /// Items posted and not yet taken (broadcast flavor).
    items: u64,
    /// Items of this round not yet taken (all flavors).
    outstanding: u64,
    /// Waiters waiting, longest first (hand-off flavor).
    idle: VecDeque<usize>,
    /// An item was handed to this waiter (hand-off flavor).
    handed: Vec<bool>,
    /// Threads currently waiting, or about to block in ACQUIRE.
    waiting: usize,
    stop: bool,
}

impl Room {
    fn new(waiters: usize) -> Room {
        Room {
            board: Mutex::new(Board {
                handed: vec![false; waiters],
                ..Board::default()
            }),
            all: Cond::default(),
            own: (0..waiters).map(|_| Cond::default()).collect(),
            done: Cond::default(),
            taken: AtomicU64::new(0),
            wakeups: AtomicU64::new(0),
        }
    }

    /// One item taken; the last of a round wakes the producer.
    fn take(&self, board: &mut Board) {
        self.taken.fetch_add(1, SeqCst);
        board.outstanding -= 1;
        if board.outstanding == 0 {
            self.done.signal();
        }
    }

    fn counts(&self) -> Counts {
        Counts {
            ops: self.taken.load(SeqCst),
            wakeups: self.wakeups.load(SeqCst),
        }
    }
}

struct Plan {
    flavor: Flavor,
    waiters: usize,
    wake: u32,
    rounds: u64,
}

impl Plan {
    /// The producer: starts the waiters, measures the rounds, stops them.
    fn run<'s>(
        &'s self,
        scope: &'s std::thread::Scope<'s, '_>,
        room: &'s Room,
        broker: Option<&'s dyn Pool>,
        start: &mut Start,
    ) -> Result<Counts> {
        let mut producer = broker.map(|b| b.open_waker()).transpose()?;
        let handles: Vec<_> = (0..self.waiters)
            .map(|i| scope.spawn(move || self.waiter(i, room, broker)))
            .collect();
        while room.board.lock().waiting < self.waiters {
            std::thread::sleep(Duration::from_millis(1));
        }
        start.now()?;
        for _ in 0..self.rounds {
            self.round(room, producer.as_deref_mut())?;
        }
        wait_round_done(&mut room.board.lock(), room);
        start.finish(room.counts());
        self.stop(room, producer.as_deref_mut())?;
        for handle in handles {
            handle
                .join()
                .map_err(|_| anyhow::anyhow!("a waiter thread panicked"))??;
        }
        Ok(room.counts())
    }

    fn round(&self, room: &Room, producer: Option<&mut (dyn Waker + '_)>) -> Result<()> {
        let mut board = room.board.lock();
        wait_round_done(&mut board, room);
        board.outstanding = u64::from(self.wake);
        match self.flavor {
            Flavor::CondBroadcast => {
                board.items += u64::from(self.wake);
                room.all.broadcast();
            }
            Flavor::CondHandoff => {
                for _ in 0..self.wake {
                    let i = board
                        .idle
                        .pop_front()
                        .context("fewer idle waiters than items")?;
                    board.handed[i] = true;
                    room.own[i].signal();
                }
            }
            Flavor::BatonLimit => {
                drop(board);
                producer.context("no broker connection")?.add(self.wake)?;
            }
        }
        Ok(())
    }

    fn stop(&self, room: &Room, producer: Option<&mut (dyn Waker + '_)>) -> Result<()> {
        room.board.lock().stop = true;
        room.all.broadcast();
        room.own.iter().for_each(Cond::signal);
        if let Some(producer) = producer {
            // A token for every waiter still blocked in ACQUIRE.
            producer.add(self.waiters as u32)?;
        }
        Ok(())
    }

    fn waiter(&self, i: usize, room: &Room, broker: Option<&dyn Pool>) -> Result<()> {
        match (self.flavor, broker) {
            (Flavor::CondBroadcast, _) => {
                broadcast_waiter(room);
                Ok(())
            }
            (Flavor::CondHandoff, _) => {
                handoff_waiter(i, room);
                Ok(())
            }
            (Flavor::BatonLimit, Some(broker)) => baton_waiter(room, broker),
            (Flavor::BatonLimit, None) => anyhow::bail!("no broker"),
        }
    }
}

fn wait_round_done(board: &mut Guard<'_, Board>, room: &Room) {
    while board.outstanding > 0 {
        room.done.wait(board);
    }
}

fn broadcast_waiter(room: &Room) {
    let mut board = room.board.lock();
    loop {
        board.waiting += 1;
        while board.items == 0 && !board.stop {
            room.all.wait(&mut board);
            room.wakeups.fetch_add(1, SeqCst);
        }
        board.waiting -= 1;
        if board.stop {
            return;
        }
        board.items -= 1;
        room.take(&mut board);
    }
}

fn handoff_waiter(i: usize, room: &Room) {
    let mut board = room.board.lock();
    loop {
        board.idle.push_back(i);
        board.waiting += 1;
        while !board.handed[i] && !board.stop {
            room.own[i].wait(&mut board);
            room.wakeups.fetch_add(1, SeqCst);
        }
        board.waiting -= 1;
        if board.stop {
            return;
        }
        board.handed[i] = false;
        room.take(&mut board);
    }
}

fn baton_waiter(room: &Room, broker: &dyn Pool) -> Result<()> {
    let mut tokens = broker.open()?;
    loop {
        room.board.lock().waiting += 1;
        tokens.acquire(1)?;
        room.wakeups.fetch_add(1, SeqCst);
        let mut board = room.board.lock();
        board.waiting -= 1;
        if board.stop {
            return Ok(());
        }
        // Given back before the round counts as done, so the broker has the
        // release before the producer's next raise.
        tokens.use_up()?;
        room.take(&mut board);
    }
}
