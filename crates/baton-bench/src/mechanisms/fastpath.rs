//! baton's fast path as far as it is built (docs/fastpath.md): the region,
//! a sealed memfd, and its ring. A process takes a token with
//! compare-and-swaps and sleeps on its own slot's futex word; a release
//! hands the token to the oldest waiter and wakes exactly that one. No
//! broker yet: the bench lays the region out as the broker will, and deals
//! the seats out itself. A release that meets a full ring (a process
//! stopped between two steps a lap back) returns its token through its
//! record, and the releaser gives it to the queue again as the broker
//! would.

use super::{Pool, Tokens};
use crate::sys::SharedMemory;
use anyhow::{bail, Result};
use baton_client::fastpath::{Futexes, Mapping};
use baton_core::fastpath::{ring, Acquired, Refused, Released, Ring, Seat};
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

/// Slots in the ring: far more than the tokens and the processes, so that
/// a process preempted between two steps rarely fills it.
const CAPACITY: usize = 4096;

pub struct Region {
    mapping: Mapping,
    /// The next seat to deal out, shared by the forked processes.
    next_seat: SharedMemory<AtomicU32>,
}

impl Region {
    pub fn new(tokens: u32) -> Result<Self> {
        let (mapping, _fd) = Mapping::create(CAPACITY, ring::MAX_SEATS, tokens)?;
        Ok(Region {
            mapping,
            next_seat: SharedMemory::new(1)?,
        })
    }
}

impl Pool for Region {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        let seat = self.next_seat[0].fetch_add(1, SeqCst) as usize;
        if seat >= ring::MAX_SEATS {
            bail!(
                "the fast path serves {} processes per region",
                ring::MAX_SEATS
            );
        }
        Ok(Box::new(Seated {
            ring: self.mapping.ring(),
            seat: Seat(seat as u16),
        }))
    }
}

struct Seated<'a> {
    ring: Ring<'a>,
    seat: Seat,
}

const HOST: Futexes<fn(baton_core::fastpath::Notice)> = Futexes { tell: |_| {} };

impl Seated<'_> {
    fn take(&self) -> Result<()> {
        loop {
            match self.ring.acquire(self.seat, &HOST, None) {
                Ok(Acquired::Token) => return Ok(()),
                Err(Refused::Full) => std::thread::yield_now(),
                other => bail!("fast-path acquire: {other:?}"),
            }
        }
    }

    fn give(&self) -> Result<()> {
        if self.ring.release(self.seat, &HOST)? == Released::Returned {
            // What the broker does on that notice.
            let mut in_hand = 0;
            self.ring.collect_step(self.seat, &mut in_hand)?;
            while in_hand > 0 {
                match self.ring.regrant_step(&mut in_hand, &HOST) {
                    Ok(Some(_)) | Err(Refused::Full) => std::thread::yield_now(),
                    Ok(None) => bail!("a barrier stands in a region without a broker"),
                    Err(e) => bail!("fast-path regrant: {e}"),
                }
            }
        }
        Ok(())
    }
}

impl Tokens for Seated<'_> {
    fn acquire(&mut self, n: u32) -> Result<()> {
        (0..n).try_for_each(|_| self.take())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        (0..n).try_for_each(|_| self.give())
    }
}
