//! Taking tokens back from a busy `fifo:` build.
//!
//! A `fifo:PATH` client (make ≥ 4.4, ninja 1.13, cargo, bmake's FIFO)
//! writes a token back into the same FIFO it reads, and a busy one reads it
//! again at once: the feeder, woken by the write like make's own pselect(),
//! rarely gets there first. So a build that uses every token it has would
//! never give one back, neither to a lowered limit nor to a waiting build
//! (issue #32: after `baton limit 1`, its next batch still ran 4 jobs).
//!
//! A reader blocked in read(2) does get there first: the write hands the
//! byte to a waiter already in the kernel, while a poller must wake, then
//! call read (DESIGN: blocking readers win tokens over pselect()ing make).
//! So while the feeder wants tokens back, a thread of ours waits in a
//! blocking read on the FIFO and passes every byte it takes through a pipe
//! the feeder reads as it reads the pipe style's return pipe: the byte is
//! then the feeder's to give back or put in again. Nothing is lost: a byte
//! taken after the feeder stopped wanting it is only a token returned.

use anyhow::{Context, Result};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::{Arc, Condvar, Mutex};

/// The blocking taker and the pipe it hands its bytes through.
pub struct Claw {
    /// How many more bytes to take; the thread waits while it is 0.
    wanted: Arc<(Mutex<u32>, Condvar)>,
    /// Our end of the hand-over pipe, non-blocking.
    taken: File,
}

impl Claw {
    /// Starts the taker on the FIFO that `fifo` is open on (reopened
    /// through /proc, so an unlinked FIFO works too), wanting nothing yet.
    pub fn start(fifo: BorrowedFd<'_>) -> Result<Claw> {
        // A FIFO opened for reading blocks until it has a writer: it has
        // one, the feeder's own read-write handle.
        let reader = File::open(format!("/proc/self/fd/{}", fifo.as_raw_fd()))
            .context("cannot reopen the jobserver FIFO for the token taker")?;
        let (taken, hand_over) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .context("cannot create the token taker's pipe")?;
        nix::fcntl::fcntl(
            &taken,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )
        .context("cannot set up the token taker's pipe")?;
        let wanted = Arc::new((Mutex::new(0), Condvar::new()));
        let theirs = wanted.clone();
        std::thread::Builder::new()
            .name("baton-claw".into())
            .spawn(move || take_while_wanted(reader, File::from(hand_over), &theirs))
            .context("cannot start the token taker")?;
        Ok(Claw {
            wanted,
            taken: File::from(taken),
        })
    }

    /// From now on take `n` more bytes (0: stop after the read under way,
    /// whose byte still arrives).
    pub fn want(&self, n: u32) {
        let (count, wake) = &*self.wanted;
        *count.lock().expect("claw lock") = n;
        wake.notify_one();
    }

    /// Bytes it still wants.
    pub fn wanted(&self) -> u32 {
        *self.wanted.0.lock().expect("claw lock")
    }

    /// The pipe its bytes arrive in: readable when it took one.
    pub fn taken(&self) -> &File {
        &self.taken
    }

    /// Readable when a byte arrived.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.taken.as_fd()
    }
}

/// The thread: waits until bytes are wanted, takes one with a blocking
/// read, hands it over. Ends when the FIFO has no writer left or the
/// feeder's end of the pipe is gone (the build ended).
fn take_while_wanted(mut fifo: File, mut hand_over: File, wanted: &(Mutex<u32>, Condvar)) {
    let (count, wake) = wanted;
    loop {
        let mut left = count.lock().expect("claw lock");
        while *left == 0 {
            left = wake.wait(left).expect("claw lock");
        }
        drop(left);
        let mut byte = [0u8];
        if !matches!(fifo.read(&mut byte), Ok(1)) {
            return;
        }
        let mut left = count.lock().expect("claw lock");
        *left = left.saturating_sub(1);
        drop(left);
        if hand_over.write_all(&byte).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn fifo(dir: &std::path::Path) -> File {
        let path = dir.join("f");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap()
    }

    fn bytes_in(f: &File) -> usize {
        let mut buf = [0u8; 64];
        (&*f).read(&mut buf).unwrap_or(0)
    }

    /// It takes what it is asked for, no more, and hands each byte over
    /// as it was: a token, or bmake's abort token.
    #[test]
    fn takes_what_is_wanted_and_hands_it_over() {
        let dir = tempdir();
        let mut f = fifo(&dir);
        let claw = Claw::start(f.as_fd()).unwrap();
        claw.want(2);
        f.write_all(b"+E+").unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            let mut poll = [nix::poll::PollFd::new(
                claw.event_fd(),
                nix::poll::PollFlags::POLLIN,
            )];
            nix::poll::poll(&mut poll, nix::poll::PollTimeout::from(30_000u16)).unwrap();
            let mut buf = [0u8; 8];
            if let Ok(n) = claw.taken().read(&mut buf) {
                got.extend_from_slice(&buf[..n]);
            }
        }
        assert_eq!(got, b"+E");
        assert_eq!(claw.wanted(), 0);
        // The third byte is left for the build.
        assert_eq!(bytes_in(&f), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempdir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "baton-claw-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// What it still wants is what it was last asked for, less what it
    /// took: here nothing, as the FIFO stays empty.
    #[test]
    fn wants_what_it_was_last_asked_for_until_it_takes_it() {
        let dir = tempdir();
        let f = fifo(&dir);
        let claw = Claw::start(f.as_fd()).unwrap();
        assert_eq!(claw.wanted(), 0);
        claw.want(3);
        assert_eq!(claw.wanted(), 3);
        claw.want(1);
        assert_eq!(claw.wanted(), 1, "asked again: the new count, not the sum");
        claw.want(0);
        assert_eq!(claw.wanted(), 0);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
