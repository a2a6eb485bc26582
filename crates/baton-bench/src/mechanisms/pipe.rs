//! The GNU make jobserver's pipe: one byte per free token.

use super::{Pool, Tokens};
use crate::sys;
use anyhow::{bail, Context, Result};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// How readers wait for a byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// A blocking read(): the kernel queues readers and wakes one per byte.
    Blocking,
    /// poll() then a non-blocking read(), GNU make ≥ 4.3's way. O_NONBLOCK
    /// is set on the shared open file description, as make sets it, so
    /// every reader is non-blocking and every poller wakes on every byte.
    Poll,
}

pub struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    wait: Wait,
}

impl Pipe {
    pub fn new(tokens: u32, wait: Wait) -> Result<Self> {
        let (read, write) = sys::pipe().context("creating the token pipe")?;
        if wait == Wait::Poll {
            set_nonblocking(&read)?;
        }
        let pipe = Pipe { read, write, wait };
        (&pipe).release(tokens)?;
        Ok(pipe)
    }

    fn take_one(&self) -> Result<()> {
        let fd = self.read.as_raw_fd();
        loop {
            if self.wait == Wait::Poll {
                sys::poll_readable(fd, -1).context("polling the token pipe")?;
            }
            match sys::read(fd, &mut [0]) {
                Ok(1) => return Ok(()),
                Ok(_) => bail!("the token pipe was closed"),
                // Another poller took the byte first: the herd at work.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e).context("reading the token pipe"),
            }
        }
    }
}

fn set_nonblocking(fd: &OwnedFd) -> Result<()> {
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own; no memory involved.
    let flags = sys::check(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    sys::check(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(())
}

impl Pool for Pipe {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        Ok(Box::new(self))
    }
}

impl Tokens for &Pipe {
    fn acquire(&mut self, n: u32) -> Result<()> {
        (0..n).try_for_each(|_| self.take_one())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        let bytes = vec![b'+'; n as usize];
        sys::write_all(self.write.as_raw_fd(), &bytes).context("writing the token pipe")
    }
}
