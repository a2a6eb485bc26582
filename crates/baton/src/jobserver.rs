//! The GNU jobserver bridge: a private FIFO per build, fed from the pool.
//!
//! Unmodified make, ninja and cargo take tokens by reading a byte from a
//! pipe or FIFO named in MAKEFLAGS and give them back by writing one. The
//! bridge keeps at most one fresh token waiting in the build's FIFO. When the
//! build reads it, inotify tells us (IN_ACCESS) and we queue at the pool for
//! the next one, behind every other waiter. A token the build writes back
//! (IN_MODIFY) goes straight back to the pool, not to the build's next job:
//! otherwise a busy build would recycle its tokens forever and a build that
//! started later would never get a turn. So tokens enter a build only as it
//! uses them, the herd a FIFO causes is bounded by one build, and builds
//! take turns at the pool's one queue (oldest request first).
//!
//! Both styles read from the same FIFO. `fifo:PATH` clients (make ≥ 4.4,
//! ninja 1.13, cargo) open it by path for reading and writing, so a busy
//! build that writes a token back can read it again before we see it: it
//! keeps its tokens until we win that race or it runs out of work. The pipe
//! style (`R,W`, what GNU make 4.3 knows) closes that gap: R reads the FIFO,
//! but W is a separate pipe only we read, so every token given back reaches
//! the pool's queue. The FUSE style closes it for `fifo:` clients.

use anyhow::{Context, Result};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use nix::sys::stat::Mode;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// How the build is told where its jobserver is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Style {
    /// `--jobserver-auth=R,W`: inherited descriptors (GNU make 4.3).
    Pipe,
    /// `--jobserver-auth=fifo:PATH` (make ≥ 4.4, ninja 1.13, cargo).
    Fifo,
    /// `fifo:` a file on the broker's FUSE mount: one wake-up per token even
    /// for poll()ing make (make ≥ 4.4, cargo; not ninja).
    Fuse,
    /// Pick per command: see [`choose_style`].
    Auto,
    /// No jobserver: only hold the tokens.
    None,
}

/// What `auto` picks for a command.
///
/// - ninja → `fifo` (ninja 1.13 accepts only a real FIFO);
/// - GNU make older than 4.4 → `pipe` (it rejects `fifo:` and stops);
/// - GNU make 4.4 or later, and cargo → `fuse` (one wake-up per token),
///   which falls back to `fifo` where the broker has no FUSE mount;
/// - anything else (cmake, a script) → `fifo`, unless the `make` first on
///   PATH is older than 4.4: a script or build script that runs it would
///   stop on `fifo:`, and every client here also speaks `R,W`.
pub fn choose_style(command: &[OsString]) -> Style {
    let program = Path::new(&command[0]);
    let name = program.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if name == "ninja" {
        return Style::Fifo;
    }
    if name == "cargo" {
        return Style::Fuse;
    }
    let is_make = is_make_name(&name);
    let make = if is_make { program.to_path_buf() } else { PathBuf::from("make") };
    match gnu_make_version(&make) {
        Some(version) if version < (4, 4) => Style::Pipe,
        Some(_) if is_make => Style::Fuse,
        _ => Style::Fifo,
    }
}

fn is_make_name(name: &str) -> bool {
    matches!(name, "make" | "gmake" | "gnumake") || (name.ends_with("make") && !name.ends_with("cmake") && !name.ends_with("bmake"))
}

/// `(major, minor)` from `make --version`, if it is GNU make.
fn gnu_make_version(make: &Path) -> Option<(u32, u32)> {
    let out = Command::new(make).arg("--version").env_remove("MAKEFLAGS").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.lines().next()?.strip_prefix("GNU Make ")?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
}

/// `MAKEFLAGS` for the build: the flags it already had, without any older
/// jobserver or `-j` settings (clients use the last `--jobserver-auth`, but a
/// stale one is a trap for tools that take the first), then ours.
pub fn makeflags(inherited: Option<&str>, auth: &str) -> String {
    let kept: Vec<&str> = inherited
        .unwrap_or("")
        .split_whitespace()
        .filter(|w| !is_jobs_flag(w))
        .collect();
    let ours = format!("-j --jobserver-auth={auth}");
    match kept.first() {
        // A first word without a dash is a cluster of one-letter flags
        // ("ks" is -k -s); it must stay first to keep that meaning.
        Some(_) => format!("{} {ours}", kept.join(" ")),
        None => ours,
    }
}

fn is_jobs_flag(word: &str) -> bool {
    word.starts_with("--jobserver-auth=")
        || word.starts_with("--jobserver-fds=")
        || word.starts_with("--jobs")
        || (word.starts_with("-j") && word[2..].bytes().all(|b| b.is_ascii_digit()))
}

/// The build's FIFO: created in the broker's private directory, watched
/// with inotify, removed when dropped.
pub struct Fifo {
    path: PathBuf,
    /// Our own read-write handle: it keeps the FIFO open (so clients never
    /// see end of file) and is how we add and remove tokens.
    handle: File,
    inotify: Inotify,
    /// The pipe style unlinks the FIFO at once: nobody opens it by path.
    unlinked: bool,
    /// The pipe style's separate return pipe (our read end): the build's
    /// W descriptor writes here, never into the FIFO it reads.
    returns: Option<File>,
    /// Someone in the build has opened the FIFO (or, in the pipe style,
    /// could use it): until then there is no point putting a token in.
    in_use: bool,
}

impl Fifo {
    pub fn create(dir: &Path) -> Result<Fifo> {
        sweep_stale_fifos(dir);
        let path = dir.join(format!("jobserver-{}.fifo", std::process::id()));
        let _ = std::fs::remove_file(&path);
        nix::unistd::mkfifo(&path, Mode::from_bits_truncate(0o600))
            .with_context(|| format!("cannot create the jobserver FIFO {}", path.display()))?;
        let handle = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
            .with_context(|| format!("cannot open the jobserver FIFO {}", path.display()))?;
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).context("cannot create an inotify instance")?;
        inotify
            .add_watch(&path, AddWatchFlags::IN_ACCESS | AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_OPEN)
            .with_context(|| format!("cannot watch {}", path.display()))?;
        Ok(Fifo { path, handle, inotify, unlinked: false, returns: None, in_use: false })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the two descriptors the pipe style passes to the build (R on
    /// the FIFO, W on the return pipe), then unlinks the FIFO. The caller
    /// makes them inheritable.
    pub fn open_pipe_ends(&mut self) -> Result<(OwnedFd, OwnedFd)> {
        // Our handle keeps a writer open, so O_RDONLY does not block.
        let read = File::open(&self.path).with_context(|| format!("cannot open {}", self.path.display()))?;
        let (returns, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
            .context("cannot create the jobserver's return pipe")?;
        // Only our end is non-blocking: the build's W must block like a
        // jobserver pipe's (make treats a failed token write as fatal).
        nix::fcntl::fcntl(&write, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty())).context("cannot set up the return pipe")?;
        self.returns = Some(File::from(returns));
        std::fs::remove_file(&self.path).ok();
        self.unlinked = true;
        // Inherited descriptors are never opened by path: assume use.
        self.in_use = true;
        Ok((OwnedFd::from(read), write))
    }

    /// Bytes in the FIFO now: tokens the build has not taken (and, in the
    /// fifo style, tokens it wrote back).
    pub fn queued(&self) -> u32 {
        bytes_in(&self.handle)
    }

    /// Bytes in the return pipe: tokens the build gave back.
    pub fn returned(&self) -> u32 {
        self.returns.as_ref().map_or(0, bytes_in)
    }

    /// Takes up to `n` bytes out, from the return pipe first; returns how
    /// many there were.
    pub fn take(&mut self, n: u32) -> u32 {
        let from_returns = self.returns.as_ref().map_or(0, |r| read_up_to(r, n));
        from_returns + read_up_to(&self.handle, n - from_returns)
    }

    /// Puts one token in. GNU make writes `+`; any byte will do.
    pub fn put(&mut self) -> Result<()> {
        (&self.handle).write_all(b"+").context("cannot write a token to the jobserver FIFO")
    }

    /// Readable when the build has read or written the FIFO, or given a
    /// token back through the return pipe.
    pub fn event_fds(&self) -> Vec<BorrowedFd<'_>> {
        let mut fds = vec![self.inotify.as_fd()];
        fds.extend(self.returns.as_ref().map(|r| r.as_fd()));
        fds
    }

    /// Whether a client has opened the FIFO (see `in_use`).
    pub fn in_use(&self) -> bool {
        self.in_use
    }

    /// Consumes pending inotify events. Reads and writes need no detail
    /// (we look at the FIFO itself); an open means the build uses it.
    pub fn drain_events(&mut self) {
        while let Ok(events) = self.inotify.read_events() {
            if events.is_empty() {
                break;
            }
            self.in_use |= events.iter().any(|e| e.mask.contains(AddWatchFlags::IN_OPEN));
        }
    }
}

impl Drop for Fifo {
    fn drop(&mut self) {
        if !self.unlinked {
            let _ = std::fs::remove_file(&self.path);
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

/// FIFOs of `baton run`s that were killed before they could remove theirs.
fn sweep_stale_fifos(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name.strip_prefix("jobserver-").and_then(|r| r.strip_suffix(".fifo"));
        if let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// What the feeder should do, from what it sees. Pure, so the rules are
/// tested on their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Plan {
    /// Bytes in the FIFO beyond what we put in: written by a client that
    /// gave back more than it took. Taken out and thrown away.
    pub discard: u32,
    /// Tokens the build wrote back: back to the pool.
    pub give_back: u32,
    /// Ask the pool for one more token.
    pub ask: bool,
}

/// What the feeder sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seen {
    /// Bytes in the FIFO.
    pub queued: u32,
    /// Bytes in the return pipe (pipe style).
    pub returned: u32,
    /// Pool tokens the build has beyond CMD's own: in the FIFO or in use.
    pub lent: u32,
    /// The token we put in last is still there, unread.
    pub fresh: bool,
    /// A request for one more token is waiting at the pool.
    pub pending: bool,
    /// At most this many may be lent.
    pub max_lent: u32,
}

pub fn plan(seen: Seen) -> Plan {
    let total = seen.queued + seen.returned;
    let discard = total.saturating_sub(seen.lent);
    // Whatever was discarded, the fresh token can only be in the FIFO.
    let fresh = seen.queued.min(total - discard).min(u32::from(seen.fresh));
    let give_back = total - discard - fresh;
    // Giving a token back withdraws a pending request first (the protocol
    // allows nothing else while ACQUIRE waits), so the build asks again.
    let waiting = seen.pending && give_back == 0;
    Plan { discard, give_back, ask: !waiting && fresh == 0 && seen.lent - give_back < seen.max_lent }
}

/// How long a token may wait unread in the FIFO before it goes back to the
/// pool for others (and we queue for it again). Doubles while nobody else
/// wants it, up to the maximum, so an idle build costs a couple of round
/// trips per second at most.
pub const IDLE_FIRST: Duration = Duration::from_millis(100);
pub const IDLE_MAX: Duration = Duration::from_millis(1600);

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(queued: u32, lent: u32, fresh: bool, pending: bool) -> Seen {
        Seen { queued, returned: 0, lent, fresh, pending, max_lent: 3 }
    }

    #[test]
    fn tokens_in_the_return_pipe_all_go_back() {
        let s = Seen { queued: 1, returned: 2, lent: 3, fresh: true, pending: false, max_lent: 3 };
        assert_eq!(plan(s), Plan { give_back: 2, ..Plan::default() });
        // Ten bytes written to W by a client that took one token.
        let s = Seen { queued: 0, returned: 10, lent: 1, fresh: false, pending: false, max_lent: 3 };
        assert_eq!(plan(s), Plan { discard: 9, give_back: 1, ask: true });
    }

    #[test]
    fn asks_for_a_token_when_the_fifo_is_empty() {
        assert_eq!(plan(seen(0, 0, false, false)), Plan { ask: true, ..Plan::default() });
        assert_eq!(plan(seen(0, 2, false, false)), Plan { ask: true, ..Plan::default() });
    }

    #[test]
    fn respects_the_cap_and_a_pending_request() {
        assert_eq!(plan(seen(0, 3, false, false)), Plan::default());
        assert_eq!(plan(seen(0, 1, false, true)), Plan::default());
    }

    #[test]
    fn keeps_the_fresh_token_and_asks_for_nothing_more() {
        assert_eq!(plan(seen(1, 1, true, false)), Plan::default());
    }

    #[test]
    fn tokens_written_back_go_to_the_pool_and_the_build_queues_again() {
        assert_eq!(plan(seen(1, 2, false, false)), Plan { give_back: 1, ask: true, ..Plan::default() });
        assert_eq!(plan(seen(3, 3, true, false)), Plan { give_back: 2, ..Plan::default() });
        // At the cap, giving one back makes room to ask again.
        assert_eq!(plan(seen(1, 3, false, false)), Plan { give_back: 1, ask: true, ..Plan::default() });
        // A pending request is withdrawn to give back, then made again.
        assert_eq!(plan(seen(1, 2, false, true)), Plan { give_back: 1, ask: true, ..Plan::default() });
    }

    #[test]
    fn bytes_beyond_what_was_lent_are_thrown_away() {
        // Lent 1, which is in use; the client wrote 10 bytes it never took.
        assert_eq!(plan(seen(10, 1, false, false)), Plan { discard: 9, give_back: 1, ask: true });
        assert_eq!(plan(seen(10, 0, false, false)), Plan { discard: 10, ask: true, ..Plan::default() });
    }

    #[test]
    fn makeflags_keep_other_flags_and_replace_jobserver_ones() {
        assert_eq!(makeflags(None, "fifo:/x"), "-j --jobserver-auth=fifo:/x");
        assert_eq!(makeflags(Some("ks -j8 --jobserver-auth=3,4 --no-print-directory"), "5,6"), "ks --no-print-directory -j --jobserver-auth=5,6");
        assert_eq!(makeflags(Some(" -j --jobserver-fds=3,4"), "fifo:/y"), "-j --jobserver-auth=fifo:/y");
    }

    #[test]
    fn make_names() {
        assert!(is_make_name("make") && is_make_name("gmake") && is_make_name("gnumake"));
        assert!(!is_make_name("cmake") && !is_make_name("ninja") && !is_make_name("bmake"));
    }

    #[test]
    fn ninja_gets_a_fifo() {
        assert_eq!(choose_style(&["ninja".into(), "-C".into(), "out".into()]), Style::Fifo);
    }
}
