//! The build's FIFO, and in the pipe style the separate pipe its tokens
//! come back through.

use crate::bmake;
use crate::claw::Claw;
use anyhow::{Context, Result};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use nix::sys::stat::Mode;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The build's FIFO: created in the broker's private directory, watched
/// with inotify, removed when dropped.
pub struct Fifo {
    path: PathBuf,
    /// Our own read-write handle: it keeps the FIFO open (so clients never
    /// see end of file) and is how we add and remove tokens.
    handle: File,
    /// Taken only when dropped (see `close_later`).
    inotify: Option<Inotify>,
    /// The pipe style unlinks the FIFO at once: nobody opens it by path.
    unlinked: bool,
    /// The pipe style's separate return pipe (our read end): the build's
    /// W descriptor writes here, never into the FIFO it reads.
    returns: Option<File>,
    /// Someone in the build has opened the FIFO (or, in the pipe style,
    /// could use it): until then there is no point putting a token in.
    in_use: bool,
    /// A bmake build's return pipe is read as it fills, to sort its abort
    /// token out of the tokens (see `bmake`): tokens read but not yet
    /// taken, and the abort token if one came.
    bmake_returns: Option<bmake::Returns>,
    /// The blocking taker of the fifo style, started the first time the
    /// feeder wants tokens back that the build is using (see `claw`).
    claw: Option<Claw>,
}

/// The identity of our PID namespace (the inode of /proc/self/ns/pid);
/// 0 where it cannot be read.
fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// Where `baton run` makes its build's FIFO: beside the socket, where the
/// broker's files are, if we may write there; else (a user the broker
/// admits with --allow-uid or --allow-group, whose socket directory is
/// the broker owner's) our temporary directory, as make 4.4 does.
pub fn dir_for(socket: &Path) -> std::path::PathBuf {
    use nix::unistd::{access, AccessFlags};
    let dir = baton_core::paths::private_dir(socket);
    match access(&dir, AccessFlags::W_OK | AccessFlags::X_OK) {
        Ok(()) => dir,
        Err(_) => std::env::temp_dir(),
    }
}

impl Fifo {
    /// Makes the build's FIFO in `dir`, named after our pid and our PID
    /// namespace: builds in containers that share the socket's directory
    /// may have the same pid, and a pid that is not running here may be
    /// running in another namespace, so only FIFOs of our own namespace
    /// are ever swept or replaced.
    pub fn create(dir: &Path) -> Result<Fifo> {
        let ns = pid_namespace();
        crate::sweep_left_by_dead_runs(dir, |name| {
            let (their_ns, pid) = name
                .strip_prefix("jobserver-")?
                .strip_suffix(".fifo")?
                .split_once('-')?;
            (their_ns.parse::<u64>().ok()? == ns).then(|| pid.parse().ok())?
        });
        let path = dir.join(format!("jobserver-{ns}-{}.fifo", std::process::id()));
        let _ = std::fs::remove_file(&path);
        nix::unistd::mkfifo(&path, Mode::from_bits_truncate(0o600))
            .with_context(|| format!("cannot create the jobserver FIFO {}", path.display()))?;
        let handle = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(&path)
            .with_context(|| format!("cannot open the jobserver FIFO {}", path.display()))?;
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .context("cannot create an inotify instance")?;
        inotify
            .add_watch(
                &path,
                AddWatchFlags::IN_ACCESS | AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_OPEN,
            )
            .with_context(|| format!("cannot watch {}", path.display()))?;
        Ok(Fifo {
            path,
            handle,
            inotify: Some(inotify),
            unlinked: false,
            returns: None,
            in_use: false,
            bmake_returns: None,
            claw: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the two descriptors the pipe style passes to the build (R on
    /// the FIFO, W on the return pipe), then unlinks the FIFO. The caller
    /// makes them inheritable.
    pub fn open_pipe_ends(&mut self) -> Result<(OwnedFd, OwnedFd)> {
        // Open for writing too, though the build only reads it: the
        // jobserver crate reopens an inherited FIFO through /proc/self/fd,
        // which blocks while no writer is left, and ours dies with us. With
        // R a writer itself, a rustc started after `baton run` was killed
        // still opens it (and then finds no token) instead of waiting for
        // good.
        let read = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .with_context(|| format!("cannot open {}", self.path.display()))?;
        let (returns, write) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
                .context("cannot create the jobserver's return pipe")?;
        // Only our end is non-blocking: the build's W must block like a
        // jobserver pipe's (make treats a failed token write as fatal).
        nix::fcntl::fcntl(
            &write,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
        )
        .context("cannot set up the return pipe")?;
        self.returns = Some(File::from(returns));
        std::fs::remove_file(&self.path).ok();
        self.unlinked = true;
        // Inherited descriptors are never opened by path: assume use.
        self.in_use = true;
        Ok((OwnedFd::from(read), write))
    }

    /// Opens the two descriptors bmake's shape of the fifo style passes
    /// (both on the FIFO: R non-blocking, W blocking, as in bmake's own
    /// pipe), then unlinks the FIFO. A token bmake gives back is there for
    /// its next job at once, and its abort token reaches its other
    /// sub-makes without us. The caller makes them inheritable.
    pub fn open_both_ends(&mut self) -> Result<(OwnedFd, OwnedFd)> {
        let open = |write: bool| {
            let flags = if write { 0 } else { libc::O_NONBLOCK };
            OpenOptions::new()
                .read(!write)
                .write(write)
                .custom_flags(flags)
                .open(&self.path)
        };
        let read = open(false).with_context(|| format!("cannot open {}", self.path.display()))?;
        let write = open(true).with_context(|| format!("cannot open {}", self.path.display()))?;
        std::fs::remove_file(&self.path).ok();
        self.unlinked = true;
        self.in_use = true;
        Ok((OwnedFd::from(read), OwnedFd::from(write)))
    }

    /// Bytes in the FIFO now: tokens the build has not taken (and, in the
    /// fifo style, tokens it wrote back).
    pub fn queued(&self) -> u32 {
        bytes_in(&self.handle)
    }

    /// Bytes in the return pipe: tokens the build gave back (and those
    /// the claw took back from it).
    pub fn returned(&self) -> u32 {
        match &self.bmake_returns {
            Some(sorted) => sorted.tokens,
            None => {
                self.returns.as_ref().map_or(0, bytes_in)
                    + self.claw.as_ref().map_or(0, |c| bytes_in(c.taken()))
            }
        }
    }

    /// Takes back `n` more tokens the build is using, as it writes them
    /// back, before it can read them again (see `claw`); 0 stops taking.
    pub fn claw(&mut self, n: u32) -> Result<()> {
        if self.claw.is_none() && n > 0 {
            self.claw = Some(Claw::start(self.handle.as_fd())?);
        }
        if let Some(claw) = &self.claw {
            claw.want(n);
        }
        Ok(())
    }

    /// Tokens the claw still waits to take.
    pub fn clawing(&self) -> u32 {
        self.claw.as_ref().map_or(0, Claw::wanted)
    }

    /// Takes up to `n` bytes out, from the return pipe first; returns how
    /// many there were.
    pub fn take(&mut self, n: u32) -> u32 {
        let from_returns = self.take_returned(n);
        from_returns + self.take_from_fifo(n - from_returns)
    }

    /// Takes up to `n` tokens the build gave back through the return pipe
    /// (already sorted from abort tokens, in a bmake build).
    fn take_returned(&mut self, n: u32) -> u32 {
        match self.bmake_returns.as_mut() {
            Some(sorted) => {
                let taken = sorted.tokens.min(n);
                sorted.tokens -= taken;
                taken
            }
            None => {
                let from_pipe = self.returns.as_ref().map_or(0, |r| read_up_to(r, n));
                from_pipe
                    + self
                        .claw
                        .as_ref()
                        .map_or(0, |c| read_up_to(c.taken(), n - from_pipe))
            }
        }
    }

    /// Takes up to `n` tokens out of the FIFO. In a bmake build an abort
    /// token found there is noted and put back at once, for the build's
    /// other sub-makes: it is never a token.
    fn take_from_fifo(&mut self, n: u32) -> u32 {
        let Some(sorted) = self.bmake_returns.as_mut() else {
            return read_up_to(&self.handle, n);
        };
        let mut buf = vec![0u8; n as usize];
        let got = (&self.handle).read(&mut buf).unwrap_or(0);
        let found = bmake::Returns::sort(&buf[..got]);
        if let Some(abort) = found.abort {
            sorted.abort = sorted.abort.or(Some(abort));
            let _ = (&self.handle).write_all(&[abort]);
        }
        found.tokens
    }

    /// From now on, keep bmake's abort token apart from the tokens: read
    /// the return pipe (if any) as it fills, and look at what we take out
    /// of the FIFO.
    pub fn sort_bmake_returns(&mut self) {
        self.bmake_returns = Some(bmake::Returns::default());
    }

    /// The abort token a bmake build wrote, if it did.
    pub fn bmake_abort(&self) -> Option<u8> {
        self.bmake_returns.and_then(|sorted| sorted.abort)
    }

    fn read_bmake_returns(&mut self) {
        let Some(sorted) = self.bmake_returns.as_mut() else {
            return;
        };
        let claw = self.claw.as_ref().map(Claw::taken);
        let mut buf = [0u8; 512];
        for returns in self.returns.iter().chain(claw) {
            while let Ok(got @ 1..) = (&*returns).read(&mut buf) {
                let new = bmake::Returns::sort(&buf[..got]);
                sorted.tokens += new.tokens;
                sorted.abort = sorted.abort.or(new.abort);
            }
        }
    }

    /// Moves up to `n` tokens from the return pipe into the FIFO, for the
    /// build's next job; returns how many.
    pub fn recycle(&mut self, n: u32) -> Result<u32> {
        let moved = self.take_returned(n);
        self.put(moved)?;
        Ok(moved)
    }

    /// Puts `n` tokens in, in one write: readers waiting wake once, not
    /// once a token. GNU make writes `+`; any byte will do.
    pub fn put(&mut self, n: u32) -> Result<()> {
        (&self.handle)
            .write_all(&vec![bmake::TOKEN; n as usize])
            .context("cannot write a token to the jobserver FIFO")
    }

    /// Puts one byte in: a token, or bmake's abort token.
    pub fn put_byte(&mut self, byte: u8) -> Result<()> {
        (&self.handle)
            .write_all(&[byte])
            .context("cannot write a token to the jobserver FIFO")
    }

    /// Readable when the build has read or written the FIFO, or given a
    /// token back through the return pipe.
    pub fn event_fds(&self) -> Vec<BorrowedFd<'_>> {
        let mut fds: Vec<_> = self.inotify.iter().map(|i| i.as_fd()).collect();
        fds.extend(self.returns.as_ref().map(|r| r.as_fd()));
        fds.extend(self.claw.as_ref().map(Claw::event_fd));
        fds
    }

    /// Whether the build gives tokens back through a return pipe (the pipe
    /// style) rather than into the FIFO.
    pub fn has_return_pipe(&self) -> bool {
        self.returns.is_some()
    }

    /// Whether a client has opened the FIFO (see `in_use`).
    pub fn in_use(&self) -> bool {
        self.in_use
    }

    /// Consumes pending inotify events. Reads and writes need no detail
    /// (we look at the FIFO itself); an open means the build uses it. A
    /// bmake build's return pipe is read here too.
    pub fn drain_events(&mut self) {
        while let Some(Ok(events)) = self.inotify.as_ref().map(Inotify::read_events) {
            if events.is_empty() {
                break;
            }
            self.in_use |= events
                .iter()
                .any(|e| e.mask.contains(AddWatchFlags::IN_OPEN));
        }
        self.read_bmake_returns();
    }
}

impl Drop for Fifo {
    fn drop(&mut self) {
        if !self.unlinked {
            let _ = std::fs::remove_file(&self.path);
        }
        if let Some(inotify) = self.inotify.take() {
            crate::close_later::drop_off_the_exit_path(inotify);
        }
    }
}

fn bytes_in(pipe: &File) -> u32 {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int to the pointer we pass.
    let rc = unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut n) };
    if rc < 0 {
        0
    } else {
        n as u32
    }
}

/// Reads up to `n` bytes from a non-blocking pipe; returns how many.
fn read_up_to(mut pipe: &File, n: u32) -> u32 {
    if n == 0 {
        return 0;
    }
    let mut buf = vec![0u8; n as usize];
    match pipe.read(&mut buf) {
        Ok(got) => got as u32,
        Err(e) if e.kind() == ErrorKind::WouldBlock => 0,
        Err(_) => 0,
    }
}
