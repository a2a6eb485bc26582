//! A counting semaphore on a bare futex word, shared across processes: the
//! word is the number of free tokens; a giver adds one and wakes exactly one
//! sleeper (FUTEX_WAKE with a count of 1) per token.

use super::{Pool, Tokens};
use crate::sys::{self, SharedMemory};
use anyhow::{Context, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};

pub struct Futex {
    word: SharedMemory<AtomicU32>,
}

impl Futex {
    pub fn new(tokens: u32) -> Result<Self> {
        let word = SharedMemory::<AtomicU32>::new(1)?;
        word[0].store(tokens, SeqCst);
        Ok(Futex { word })
    }

    fn take_one(&self) -> Result<()> {
        let word = &self.word[0];
        loop {
            let free = word.load(SeqCst);
            if free == 0 {
                futex(word, libc::FUTEX_WAIT, 0).context("FUTEX_WAIT")?;
            } else if word
                .compare_exchange(free, free - 1, SeqCst, SeqCst)
                .is_ok()
            {
                return Ok(());
            }
        }
    }
}

/// futex(2) on a word shared between processes (so not FUTEX_PRIVATE).
/// FUTEX_WAIT returning EAGAIN (the word changed) is not an error.
fn futex(word: &AtomicU32, op: libc::c_int, val: u32) -> std::io::Result<()> {
    // SAFETY: the word lives in a shared mapping for as long as the pool.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op,
            val,
            std::ptr::null::<libc::timespec>(),
        )
    };
    match sys::check(ret as libc::c_int) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) => Ok(()),
        other => other.map(drop),
    }
}

impl Pool for Futex {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        Ok(Box::new(self))
    }
}

impl Tokens for &Futex {
    fn acquire(&mut self, n: u32) -> Result<()> {
        (0..n).try_for_each(|_| self.take_one())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        for _ in 0..n {
            self.word[0].fetch_add(1, SeqCst);
            futex(&self.word[0], libc::FUTEX_WAKE, 1).context("FUTEX_WAKE")?;
        }
        Ok(())
    }
}

/// Tickets a FIFO futex pool keeps a word for: more than any scenario's
/// waiters, so no two waiters ever share one.
const FIFO_SLOTS: usize = 2048;

/// The floor of any first-come-first-served hand-off: a ticket per
/// acquire, and a futex word per ticket's slot, so a release wakes exactly
/// the oldest waiter and nobody else (a partitioned ticket lock, counting
/// tokens). No broker, no records, no repair: the bare cost of FIFO order,
/// which the fast path keeps and a semaphore does not.
pub struct FifoFutex {
    shared: SharedMemory<FifoShared>,
}

struct FifoShared {
    /// The next ticket an acquire takes.
    next: AtomicU64,
    /// How many tickets may go: the tokens made, then one per release.
    granted: AtomicU64,
    /// Per slot: a count of grants to it (times 2), bit 0 set while its
    /// waiter sleeps, so a release makes the wake-up call only for a
    /// sleeper.
    slots: [AtomicU32; FIFO_SLOTS],
}

impl Default for FifoShared {
    fn default() -> Self {
        FifoShared {
            next: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            slots: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }
}

impl FifoFutex {
    pub fn new(tokens: u32) -> Result<Self> {
        let shared = SharedMemory::<FifoShared>::new(1)?;
        shared[0].granted.store(u64::from(tokens), SeqCst);
        Ok(FifoFutex { shared })
    }

    fn take_one(&self) -> Result<()> {
        let s = &self.shared[0];
        let ticket = s.next.fetch_add(1, SeqCst);
        let slot = &s.slots[ticket as usize % FIFO_SLOTS];
        loop {
            let seen = slot.load(SeqCst);
            if s.granted.load(SeqCst) > ticket {
                return Ok(());
            }
            let asleep = seen | 1;
            if seen == asleep || slot.compare_exchange(seen, asleep, SeqCst, SeqCst).is_ok() {
                futex(slot, libc::FUTEX_WAIT, asleep).context("FUTEX_WAIT")?;
            }
        }
    }

    fn give_one(&self) -> Result<()> {
        let s = &self.shared[0];
        let ticket = s.granted.fetch_add(1, SeqCst);
        let slot = &s.slots[ticket as usize % FIFO_SLOTS];
        // The next even count: clears the sleeping bit and moves on.
        let before = slot
            .fetch_update(SeqCst, SeqCst, |v| Some((v | 1).wrapping_add(1)))
            .expect("always Some");
        if before & 1 == 1 {
            futex(slot, libc::FUTEX_WAKE, 1).context("FUTEX_WAKE")?;
        }
        Ok(())
    }
}

impl Pool for FifoFutex {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        Ok(Box::new(self))
    }
}

impl Tokens for &FifoFutex {
    fn acquire(&mut self, n: u32) -> Result<()> {
        (0..n).try_for_each(|_| self.take_one())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        (0..n).try_for_each(|_| self.give_one())
    }
}
