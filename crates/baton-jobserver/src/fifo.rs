//! The build's FIFO, and in the pipe style the separate pipe its tokens
//! come back through.

use crate::bmake;
use crate::claw::Claw;
use anyhow::{Context, Result};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use nix::sys::stat::Mode;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
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
    crate::sys::bytes_waiting(pipe)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::Scratch;
    use std::os::unix::fs::FileTypeExt;

    /// The FIFO's path, opened as a `fifo:` client opens it.
    fn open_as_client(fifo: &Fifo) -> File {
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(fifo.path())
            .unwrap()
    }

    #[test]
    fn each_run_gets_a_fifo_of_its_own_removed_when_it_ends() {
        let scratch = Scratch::new("fifo-create");
        // Left by a `baton run` that was killed: its pid is no process now.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let ns = pid_namespace();
        let left = scratch.file(&format!("jobserver-{ns}-{dead}.fifo"), "");
        // Another run's, still going (pid 1 always runs).
        let live = scratch.file(&format!("jobserver-{ns}-1.fifo"), "");
        // A pid not running here may run in another PID namespace.
        let theirs = scratch.file(&format!("jobserver-{}-{dead}.fifo", ns + 1), "");
        let fifo = Fifo::create(&scratch.0).unwrap();
        let path = fifo.path().to_path_buf();
        assert_eq!(
            path,
            scratch
                .0
                .join(format!("jobserver-{ns}-{}.fifo", std::process::id()))
        );
        assert!(theirs.exists(), "another namespace's FIFO is kept");
        assert!(std::fs::metadata(&path).unwrap().file_type().is_fifo());
        assert!(!left.exists(), "a dead run's FIFO is swept");
        assert!(live.exists(), "a live run's FIFO is kept");
        drop(fifo);
        assert!(!path.exists(), "removed when dropped");
    }

    #[test]
    fn tokens_put_in_are_queued_until_taken_out() {
        let scratch = Scratch::new("fifo-put");
        let mut fifo = Fifo::create(&scratch.0).unwrap();
        assert_eq!((fifo.queued(), fifo.returned()), (0, 0));
        fifo.put(3).unwrap();
        assert_eq!(fifo.queued(), 3);
        assert_eq!(fifo.take(2), 2);
        assert_eq!(fifo.queued(), 1);
        assert_eq!(fifo.take(5), 1, "only what is there");
        assert_eq!(fifo.take(1), 0);
        // What the build reads is what we put in: GNU make's `+`.
        fifo.put(1).unwrap();
        let mut byte = [0u8];
        open_as_client(&fifo).read_exact(&mut byte).unwrap();
        assert_eq!(byte, [bmake::TOKEN]);
        assert_eq!(fifo.queued(), 0);
    }

    #[test]
    fn the_pipe_style_s_tokens_come_back_through_a_pipe_of_their_own() {
        let scratch = Scratch::new("fifo-pipe");
        let mut fifo = Fifo::create(&scratch.0).unwrap();
        assert!(!fifo.has_return_pipe() && !fifo.in_use());
        assert_eq!(fifo.event_fds().len(), 1, "inotify only");
        let (read, write) = fifo.open_pipe_ends().unwrap();
        assert!(!fifo.path().exists(), "nobody opens it by path: unlinked");
        assert!(fifo.has_return_pipe() && fifo.in_use());
        assert_eq!(fifo.event_fds().len(), 2, "inotify and the return pipe");
        let (mut read, mut write) = (File::from(read), File::from(write));
        // R reads what we put in the FIFO; W writes into the return pipe.
        fifo.put(1).unwrap();
        let mut byte = [0u8];
        read.read_exact(&mut byte).unwrap();
        write.write_all(b"+++").unwrap();
        assert_eq!((fifo.queued(), fifo.returned()), (0, 3));
        fifo.put(1).unwrap();
        assert_eq!(fifo.take(2), 2, "from the return pipe first");
        assert_eq!((fifo.queued(), fifo.returned()), (1, 1));
        assert_eq!(fifo.recycle(5).unwrap(), 1, "what was returned, no more");
        assert_eq!((fifo.queued(), fifo.returned()), (2, 0));
        assert_eq!(fifo.take(3), 2);
    }

    #[test]
    fn a_client_opening_the_fifo_puts_it_in_use() {
        let scratch = Scratch::new("fifo-open");
        let mut fifo = Fifo::create(&scratch.0).unwrap();
        fifo.drain_events();
        assert!(!fifo.in_use());
        fifo.put(1).unwrap();
        fifo.take(1);
        fifo.drain_events();
        assert!(!fifo.in_use(), "our own reads and writes are no use");
        let _client = open_as_client(&fifo);
        fifo.drain_events();
        assert!(fifo.in_use());
    }

    #[test]
    fn bmake_s_abort_token_is_sorted_from_its_tokens() {
        let scratch = Scratch::new("fifo-bmake");
        let mut fifo = Fifo::create(&scratch.0).unwrap();
        let (_read, write) = fifo.open_pipe_ends().unwrap();
        fifo.sort_bmake_returns();
        assert_eq!(fifo.bmake_abort(), None);
        File::from(write).write_all(b"+E+I").unwrap();
        fifo.drain_events();
        assert_eq!(fifo.returned(), 2, "two tokens came back");
        assert_eq!(fifo.bmake_abort(), Some(b'E'), "the first abort token");
        assert_eq!(fifo.take(1), 1);
        assert_eq!(fifo.returned(), 1);
        assert_eq!(fifo.recycle(3).unwrap(), 1);
        assert_eq!((fifo.queued(), fifo.returned()), (1, 0));
    }

    #[test]
    fn an_abort_token_in_bmake_s_fifo_is_left_for_its_other_sub_makes() {
        let scratch = Scratch::new("fifo-bmake-both");
        let mut fifo = Fifo::create(&scratch.0).unwrap();
        let (_read, _write) = fifo.open_both_ends().unwrap();
        assert!(!fifo.path().exists() && fifo.in_use() && !fifo.has_return_pipe());
        fifo.sort_bmake_returns();
        fifo.put(2).unwrap();
        fifo.put_byte(b'E').unwrap();
        assert_eq!(fifo.take(3), 2, "the abort token is no token");
        assert_eq!(fifo.bmake_abort(), Some(b'E'));
        assert_eq!(fifo.queued(), 1, "the abort token was put back");
    }

    #[test]
    fn the_claw_wants_what_it_was_last_asked_for() {
        let scratch = Scratch::new("fifo-claw");
        let mut fifo = Fifo::create(&scratch.0).unwrap();
        fifo.claw(0).unwrap();
        assert_eq!(
            (fifo.clawing(), fifo.event_fds().len()),
            (0, 1),
            "not started"
        );
        fifo.claw(2).unwrap();
        assert_eq!((fifo.clawing(), fifo.event_fds().len()), (2, 2));
        fifo.claw(0).unwrap();
        assert_eq!(fifo.clawing(), 0);
    }

    /// The feeder sleeps on the inotify descriptor: each read and write of
    /// the build's wakes it.
    #[test]
    fn the_build_s_reads_and_writes_wake_the_feeder() {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let scratch = Scratch::new("fifo-wake");
        let mut fifo = Fifo::create(&scratch.0).unwrap();
        let mut client = open_as_client(&fifo);
        fifo.drain_events();
        let woken = |fifo: &Fifo| {
            let fds = fifo.event_fds();
            let mut polled = [PollFd::new(fds[0], PollFlags::POLLIN)];
            poll(&mut polled, PollTimeout::ZERO).unwrap() == 1
        };
        assert!(!woken(&fifo), "nothing done since");
        client.write_all(b"+").unwrap();
        assert!(woken(&fifo), "a token written back");
        fifo.drain_events();
        assert!(!woken(&fifo));
        client.read_exact(&mut [0u8]).unwrap();
        assert!(woken(&fifo), "a token read");
    }
}
