//! A counting semaphore on a bare futex word, shared across processes: the
//! word is the number of free tokens; a giver adds one and wakes exactly one
//! sleeper (FUTEX_WAKE with a count of 1) per token.

use super::{Pool, Tokens};
use crate::sys::{self, SharedMemory};
use anyhow::{Context, Result};
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

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
