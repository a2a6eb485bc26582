//! baton's FUSE token file, waited on exactly as GNU make 4.4 waits on its
//! jobserver FIFO: poll() for POLLIN, then a non-blocking one-byte read,
//! EAGAIN meaning "someone else got it, poll again". The broker notifies one
//! polling handle per freed token; started with `--fuse-notify-all` it
//! notifies every one, as a pipe would (the herd, as a control).

use super::baton::{BrokerProcess, Wait};
use super::{Env, Pool, Tokens};
use crate::sys;
use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

/// How the broker wakes pollers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notify {
    /// One polling handle per freed token (baton's way).
    One,
    /// Every polling handle (the control).
    All,
}

/// A broker with a FUSE mount and one token file, shared by every waiter.
pub struct TokenFile {
    broker: BrokerProcess,
    path: PathBuf,
}

/// Whether this machine can mount FUSE at all (the rows are skipped, with a
/// note, where it cannot).
pub fn available() -> bool {
    std::path::Path::new("/dev/fuse").exists()
}

impl TokenFile {
    pub fn start(tokens: u32, env: &Env, notify: Notify) -> Result<Self> {
        let flags: &[&str] = match notify {
            Notify::One => &[],
            Notify::All => &["--fuse-notify-all"],
        };
        let broker = BrokerProcess::start_with(tokens, env, Wait::Poll, flags)?;
        let mount = broker.socket().with_file_name("fuse");
        let path = mount.join("bench");
        // The broker mounts in the background: wait until the file can be made.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)
            {
                Ok(_) => break,
                Err(e) if std::time::Instant::now() > deadline => {
                    bail!(
                        "no FUSE token file at {} ({e}): is FUSE available to baton serve?",
                        path.display()
                    )
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
        // Its waiters poll it alone, as make does: as baton run marks a
        // GNU make build's file.
        baton_client::hold_polls(&path)
            .with_context(|| format!("asking the broker to hold polls of {}", path.display()))?;
        Ok(TokenFile { broker, path })
    }
}

impl Pool for TokenFile {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        Ok(Box::new(Handle { file }))
    }

    fn broker_pid(&self) -> Option<libc::pid_t> {
        self.broker.broker_pid()
    }
}

/// One process's open handle on the token file.
struct Handle {
    file: File,
}

impl Handle {
    /// As make 4.4's jobserver_acquire: pselect() first, then the read.
    /// (Reading first would cost a request make does not send: a read of
    /// the file is a round trip to the broker even when it fails.)
    fn take_one(&mut self) -> Result<()> {
        let mut byte = [0u8; 1];
        loop {
            sys::poll_readable(self.file.as_raw_fd(), -1).context("polling the token file")?;
            match sys::read(self.file.as_raw_fd(), &mut byte) {
                Ok(1) => return Ok(()),
                Ok(_) => bail!("the token file returned no byte"),
                // Our reservation ran out before we read: poll again.
                Err(e) if e.kind() == ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e).context("reading the token file"),
            }
        }
    }
}

impl Tokens for Handle {
    fn acquire(&mut self, n: u32) -> Result<()> {
        (0..n).try_for_each(|_| self.take_one())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        sys::write_all(self.file.as_raw_fd(), &vec![b'+'; n as usize])
            .context("writing the token file")
    }
}
