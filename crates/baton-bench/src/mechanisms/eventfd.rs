//! An eventfd in semaphore mode: its counter is the free tokens, each
//! read(2) takes one, a write(2) of n gives back n.

use super::{Pool, Tokens};
use crate::sys;
use anyhow::{Context, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub struct Eventfd {
    fd: OwnedFd,
}

impl Eventfd {
    pub fn new(tokens: u32) -> Result<Self> {
        // SAFETY: eventfd returns a fresh descriptor or -1.
        let fd =
            sys::check(unsafe { libc::eventfd(tokens, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC) })
                .context("creating an eventfd")?;
        // SAFETY: the descriptor is fresh and owned by nobody else.
        Ok(Eventfd {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }
}

impl Pool for Eventfd {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        Ok(Box::new(self))
    }
}

impl Tokens for &Eventfd {
    fn acquire(&mut self, n: u32) -> Result<()> {
        for _ in 0..n {
            sys::read(self.fd.as_raw_fd(), &mut [0; 8]).context("reading the eventfd")?;
        }
        Ok(())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        sys::write_all(self.fd.as_raw_fd(), &u64::from(n).to_ne_bytes())
            .context("writing the eventfd")
    }
}
