//! baton's fast path in its barging mode, the pile (docs/fastpath.md, "The
//! pile"), with no broker yet: the bench lays the words out in shared
//! memory as the broker will, and deals the seats out itself. A process
//! takes any free token word with a compare-and-swap; a release puts it
//! back and rings the bell for one sleeper, unless a wake-up is already in
//! flight.

use super::{Pool, Tokens};
use crate::sys::SharedMemory;
use anyhow::{bail, Result};
use baton_core::fastpath::pile::{self, Acquired, Bell, Pile};
use baton_core::fastpath::Seat;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::Instant;

pub struct Region {
    words: SharedMemory<AtomicU64>,
    /// The next seat to deal out, shared by the forked processes.
    next_seat: SharedMemory<AtomicU32>,
}

impl Region {
    pub fn new(tokens: u32) -> Result<Self> {
        let words = SharedMemory::new(pile::words_for(tokens as usize, pile::MAX_SEATS))?;
        Pile::init(&words, tokens as usize, pile::MAX_SEATS, tokens as usize)?;
        Ok(Region {
            words,
            next_seat: SharedMemory::new(1)?,
        })
    }
}

impl Pool for Region {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        let seat = self.next_seat[0].fetch_add(1, SeqCst) as usize;
        if seat >= pile::MAX_SEATS {
            bail!("a pile serves {} processes", pile::MAX_SEATS);
        }
        Ok(Box::new(Seated {
            pile: Pile::attach(&self.words)?,
            seat: Seat(seat as u16),
            held: Vec::new(),
        }))
    }
}

struct Seated<'a> {
    pile: Pile<'a>,
    seat: Seat,
    /// The token words this process holds, last taken first given.
    held: Vec<usize>,
}

/// futex(2) on the bell's low 32 bits, shared between processes.
struct Futex;

fn futex(word: &AtomicU64, op: libc::c_int, val: u32) -> libc::c_long {
    // SAFETY: the word lives in a shared mapping for as long as the pool;
    // the futex is its low half (little-endian), as the bell's sequence is.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr().cast::<u32>(),
            op,
            val,
            std::ptr::null::<libc::timespec>(),
        )
    }
}

impl Bell for Futex {
    fn wait(&self, word: &AtomicU64, expected: u32, _deadline: Option<Instant>) {
        futex(word, libc::FUTEX_WAIT, expected);
    }

    fn wake_one(&self, word: &AtomicU64) -> bool {
        futex(word, libc::FUTEX_WAKE, 1) > 0
    }
}

impl Tokens for Seated<'_> {
    fn acquire(&mut self, n: u32) -> Result<()> {
        for _ in 0..n {
            match self.pile.acquire(self.seat, &Futex, None, false)? {
                Acquired::Token(i) => self.held.push(i),
                Acquired::TimedOut => bail!("a pile acquire without a deadline timed out"),
            }
        }
        Ok(())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        for _ in 0..n {
            let Some(i) = self.held.pop() else {
                bail!("released a token this process does not hold");
            };
            self.pile.release(self.seat, i, &Futex)?;
        }
        Ok(())
    }
}
