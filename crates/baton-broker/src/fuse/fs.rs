//! The token filesystem: a directory of build files. Any file in it is a
//! token file: `read` of one byte takes a token, `write` gives one back,
//! `poll` waits for one. Files are created by `baton run` (one per build,
//! so `baton status` and `ls` tell builds apart) or by anyone with
//! `open(O_CREAT)`, and removed with `unlink`.
//!
//! fuser calls us on the event loop's thread (crate::socket), which owns
//! the file table ([`Files`]) and the broker and lends them to each request
//! it dispatches ([`lend`]). What the files act on by themselves (exits,
//! deadlines) the loop carries out too (`control`).

use super::procs::{Exits, Threads};
use super::waiters::{
    Caller, Fh, Handed, Pid, PollAnswer, PollCall, PollWaker, ReadReply, Waiters,
};
use crate::broker::{Broker, ClientMeta, Transport};
use crate::log;
use baton_core::protocol::{FUSE_POLLS_HOLD, FUSE_POLLS_NOTIFY, FUSE_POLLS_XATTR as POLLS_XATTR};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    Notifier, OpenFlags, PollEvents, PollFlags, PollHandle, PollNotifier, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyPoll, ReplyWrite,
    ReplyXattr, Request, RequestId, TimeOrNow, WriteFlags,
};
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::ptr::NonNull;
use std::time::{Duration, Instant, SystemTime};

/// Attributes never change behind the kernel's back except by our own
/// create/unlink, which the kernel sees: cache them briefly.
const TTL: Duration = Duration::from_secs(1);

/// Every read returns one byte, the GNU token. make and the jobserver
/// crate read one byte at a time anyway.
const TOKEN: &[u8] = b"+";

pub struct FuseRead(ReplyData);

impl ReadReply for FuseRead {
    fn token(self) {
        self.0.data(TOKEN);
    }
    fn fail(self, errno: i32) {
        self.0.error(Errno::from_i32(errno));
    }
}

/// The answer to a poll: a token to read (or an abort token, in a bmake
/// build) or not, and giving one back never waits.
pub struct FuseAnswer {
    reply: ReplyPoll,
    events: PollEvents,
}

impl FuseAnswer {
    fn answer(self, readable: bool) {
        let mut revents = self.events & (PollEvents::POLLOUT | PollEvents::POLLWRNORM);
        if readable {
            revents |= self.events & (PollEvents::POLLIN | PollEvents::POLLRDNORM);
        }
        self.reply.poll(revents);
    }
}

impl PollAnswer for FuseAnswer {
    fn ready(self) {
        self.answer(true);
    }
    fn not_ready(self) {
        self.answer(false);
    }
}

/// A poller to wake: one whose poll we answered, or one a predecessor
/// broker answered (crate::handover), known by the kernel's handle.
pub enum FusePoll {
    Answered(PollNotifier),
    Adopted(Notifier, PollHandle),
}

impl PollWaker for FusePoll {
    fn wake(&self) {
        // Fails only if the handle is gone, and then nobody waits on it.
        let _ = match self {
            FusePoll::Answered(notifier) => notifier.clone().notify(),
            FusePoll::Adopted(notifier, handle) => notifier.poll(*handle),
        };
    }
    fn handle(&self) -> u64 {
        match self {
            FusePoll::Answered(notifier) => notifier.handle().0,
            FusePoll::Adopted(_, handle) => handle.0,
        }
    }
}

/// Handles and inodes of a mount taken from a killed broker start here,
/// above any it can have made.
const ORPHAN_BASE: u64 = 1 << 40;

/// The token files as a successor broker receives them: the file table
/// as it is, and the waiters (whose blocked reads and poll wakers are
/// bound to this process: see `Waiters::hand_over`).
#[derive(Debug, Serialize, Deserialize)]
pub struct FsState {
    waiters: Handed<FuseRead, FuseAnswer>,
    #[serde(flatten)]
    table: FileTable,
}

/// The token files: their names by inode, the open handles, and which
/// files' pollers are held. Plain values, handed to a successor whole
/// (maps as lists of pairs, as brokers before this one wrote them).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct FileTable {
    #[serde(with = "crate::pairs")]
    files: BTreeMap<u64, String>,
    next_ino: u64,
    #[serde(with = "crate::pairs")]
    handles: BTreeMap<Fh, u64>,
    next_fh: Fh,
    /// Files whose pollers are held ([`POLLS_XATTR`]); absent from a
    /// predecessor that had none.
    #[serde(default)]
    holding: BTreeSet<u64>,
}

/// The token files as the event loop owns them: the table, who waits,
/// and the processes watched for their exit.
pub struct Files {
    pub waiters: Waiters<FuseRead, FusePoll, FuseAnswer>,
    pub threads: Threads,
    pub exits: Exits,
    /// When blocked readers were last checked for pending signals.
    pub scanned_at: Instant,
    table: FileTable,
    /// Files a bmake build wrote abort tokens to (see [`sort_written`]).
    aborted: BTreeMap<u64, Aborted>,
}

impl Files {
    pub fn new(waiters: Waiters<FuseRead, FusePoll, FuseAnswer>, exits: Exits) -> Self {
        Files {
            waiters,
            threads: Threads::default(),
            exits,
            scanned_at: Instant::now(),
            table: FileTable {
                files: BTreeMap::new(),
                next_ino: INodeNo::ROOT.0 + 1,
                handles: BTreeMap::new(),
                next_fh: 1,
                holding: BTreeSet::new(),
            },
            aborted: BTreeMap::new(),
        }
    }

    /// Carries on from a predecessor's token files; `notifier` wakes the
    /// pollers it answered.
    pub fn adopt(
        &mut self,
        state: FsState,
        broker: &Broker,
        notifier: &Notifier,
    ) -> Result<(), &'static str> {
        let waker = |handle| FusePoll::Adopted(notifier.clone(), PollHandle(handle));
        let hold = self.waiters.hold();
        self.waiters = Waiters::adopt(state.waiters, broker, waker, hold)?;
        self.table = state.table;
        let pids: Vec<Pid> = self.waiters.pids().collect();
        for pid in pids {
            if let Err(e) = self.exits.watch(pid) {
                // Gone meanwhile: the loop's first look at the files reclaims.
                log::debug(format_args!("cannot watch pid {pid}: {e}"));
            }
        }
        Ok(())
    }

    /// We serve a mount whose broker was killed (fuse::keeper): its
    /// handles and inodes are still open in the kernel, so ours are
    /// numbered far above theirs, and its processes may give back tokens
    /// it granted.
    pub fn take_orphan(&mut self) {
        self.table.next_fh = ORPHAN_BASE;
        self.table.next_ino = ORPHAN_BASE;
        self.waiters.forgive_strangers();
    }

    /// The token files for a successor. The loop calls it between two
    /// rounds, with no request half-served: every request read from the
    /// device was answered or is held in the waiters, which travel.
    pub fn hand_over(&mut self, broker: &mut Broker) -> FsState {
        FsState {
            waiters: self.waiters.hand_over(broker),
            table: self.table.clone(),
        }
    }

    /// After any change: delivers every grant for FUSE clients that
    /// followed. (The loop then plans its clock: `control::Clock::plan`.)
    pub fn settle(&mut self, broker: &mut Broker) {
        self.waiters.settle(broker, Instant::now());
    }
}

/// The token files and the broker, as the loop lends them to the FUSE
/// requests it dispatches.
type Lent = (NonNull<Files>, NonNull<Broker>);

thread_local! {
    static LENT: Cell<Option<Lent>> = const { Cell::new(None) };
}

/// Runs `serve` (the FUSE session's dispatch, on the loop's thread) with
/// `files` and `broker` lent to the filesystem's methods, which reach them
/// through [`with`]: fuser calls them through `&self` of a filesystem that
/// must be `'static`, so they cannot be handed the loop's state as an
/// argument.
pub fn lend<T>(files: &mut Files, broker: &mut Broker, serve: impl FnOnce() -> T) -> T {
    struct Restore(Option<Lent>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LENT.with(|lent| lent.set(self.0));
        }
    }
    let lent = (NonNull::from(files), NonNull::from(broker));
    let _restore = Restore(LENT.with(|cell| cell.replace(Some(lent))));
    serve()
}

/// Runs `f` on the token files and the broker the loop lent to the request
/// being served, then settles (see [`Files::settle`]).
///
/// # Panics
/// Outside a call of [`lend`] on this thread, or inside another call of
/// `with`: either would be a second owner.
fn with<T>(f: impl FnOnce(&mut Files, &mut Broker) -> T) -> T {
    struct GiveBack(Lent);
    impl Drop for GiveBack {
        fn drop(&mut self) {
            LENT.with(|lent| lent.set(Some(self.0)));
        }
    }
    let lent = LENT
        .with(Cell::take)
        .expect("FUSE requests are served by the event loop, one at a time");
    let back = GiveBack(lent);
    // SAFETY: the pointers are the `&mut` references that `lend` holds
    // borrowed, on this thread, for as long as its `serve` runs, and we run
    // within it. Taking them out of LENT until `back` drops means no other
    // reference to either is made meanwhile.
    let (files, broker) = unsafe { (&mut *back.0 .0.as_ptr(), &mut *back.0 .1.as_ptr()) };
    let out = f(files, broker);
    files.settle(broker);
    out
}

/// How often threads blocked in a read are checked for a pending signal
/// (see `Waiters::interrupt`). The kernel's FUSE_INTERRUPT answers them at
/// once (`Filesystem::interrupt`); this scan is the safety net for a mount
/// on which interrupts were turned off (a broker before this one, whose
/// fuser answered them `ENOSYS`, served it, and the kernel remembers that
/// for the mount's life). Short, because the jobserver crate (cargo,
/// rustc) stops its helper thread by signalling it until its blocked read
/// returns: at 100 ms, every rustc waited that long at its exit, and a
/// cargo build of 120 small crates took 1.43x its own -j6 wall time (1.0x
/// at 10 ms). The scan costs a /proc read per blocked thread, and only
/// runs while some thread is blocked.
pub const KILL_SCAN: Duration = Duration::from_millis(10);

impl Files {
    /// When the files must next act by themselves: a reservation runs out,
    /// or blocked readers are due for a signal check.
    pub fn next_wakeup(&self) -> Option<Instant> {
        let scan = self
            .waiters
            .blocked_threads()
            .next()
            .map(|_| self.scanned_at + KILL_SCAN);
        [self.waiters.next_deadline(), scan]
            .into_iter()
            .flatten()
            .min()
    }

    /// The process behind a request, registered with the broker and
    /// watched for its exit on first sight.
    fn process(&mut self, broker: &mut Broker, tid: u32, fh: Fh) -> Option<Pid> {
        let pid = self.threads.process_of(tid)?;
        let file = self
            .table
            .handles
            .get(&fh)
            .and_then(|ino| self.table.files.get(ino))
            .cloned()
            .unwrap_or_default();
        let describe = || {
            ClientMeta::new(
                pid,
                format!("{} [{file}]", crate::sys::command_line(pid)),
                Transport::Fuse,
            )
        };
        let (_, new) = self.waiters.process(broker, pid, describe);
        if new {
            if let Err(e) = self.exits.watch(pid) {
                // Gone already (or out of fds): do not keep what we cannot watch.
                log::debug(format_args!("cannot watch pid {pid}: {e}"));
                self.waiters.exited(broker, pid);
                self.threads.forget(pid);
                return None;
            }
        }
        Some(pid)
    }

    fn open_handle(&mut self, ino: u64) -> Fh {
        let fh = self.table.next_fh;
        self.table.next_fh += 1;
        self.table.handles.insert(fh, ino);
        fh
    }

    /// The abort state of the file behind `fh`, once an abort token was
    /// written to it.
    fn aborted(&mut self, fh: Fh) -> Option<&mut Aborted> {
        let ino = self.table.handles.get(&fh)?;
        self.aborted.get_mut(ino)
    }

    /// Marks the file behind `fh` aborted by `byte` (the first one stays).
    fn abort(&mut self, fh: Fh, byte: u8) {
        if let Some(&ino) = self.table.handles.get(&fh) {
            self.aborted
                .entry(ino)
                .or_insert_with(|| Aborted::new(byte));
        }
    }

    fn lookup(&self, name: &OsStr) -> Option<u64> {
        self.table
            .files
            .iter()
            .find(|(_, n)| OsStr::new(n.as_str()) == name)
            .map(|(&ino, _)| ino)
    }
}

/// bmake's abort tokens: a bmake whose job failed writes `E` (`I` after an
/// interrupt) where it would give a token back; a sub-make that reads one
/// drains the pipe until it finds it empty, writes the abort token back
/// for the next reader and stops. They are never tokens. Returns the
/// tokens among `data` and the first abort token.
pub fn sort_written(data: &[u8]) -> (u32, Option<u8>) {
    let is_abort = |b: &u8| matches!(b, b'E' | b'I');
    let tokens = data.iter().filter(|b| !is_abort(b)).count();
    (
        u32::try_from(tokens).unwrap_or(u32::MAX),
        data.iter().copied().find(is_abort),
    )
}

/// A file a bmake build wrote an abort token to. It answers as bmake's pipe
/// does with the stopper always put back, without the window in which a
/// reader has taken it out: every process's first read returns the abort
/// token, and its later reads find the file empty, which ends its drain.
/// No token is handed out to a build that is stopping; tokens its
/// sub-makes still hold come back as each exits.
#[derive(Debug, Clone)]
pub struct Aborted {
    byte: u8,
    drained: std::collections::BTreeSet<Pid>,
}

impl Aborted {
    fn new(byte: u8) -> Self {
        Aborted {
            byte,
            drained: Default::default(),
        }
    }

    /// What a read by `pid` returns: the abort token, or nothing to read.
    fn read(&mut self, pid: Pid) -> Result<u8, i32> {
        match self.drained.insert(pid) {
            true => Ok(self.byte),
            false => Err(libc::EAGAIN),
        }
    }

    /// Whether a read by `pid` would return the abort token.
    fn readable(&self, pid: Pid) -> bool {
        !self.drained.contains(&pid)
    }
}

/// The filesystem fuser serves. Its state is the loop's, lent to each
/// request (see [`with`]).
pub struct TokenFs;

impl TokenFs {
    fn with<T>(&self, f: impl FnOnce(&mut Files, &mut Broker) -> T) -> T {
        with(f)
    }
}

fn attr(ino: u64) -> FileAttr {
    let (kind, perm, nlink) = if ino == INodeNo::ROOT.0 {
        (FileType::Directory, 0o700, 2)
    } else {
        (FileType::RegularFile, 0o600, 1)
    };
    let now = SystemTime::now();
    FileAttr {
        ino: INodeNo(ino),
        size: 0,
        blocks: 0,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        kind,
        perm,
        nlink,
        uid: nix::unistd::getuid().as_raw(),
        gid: nix::unistd::getgid().as_raw(),
        rdev: 0,
        blksize: 512,
        flags: 0,
    }
}

/// Reads and writes go to us one system call at a time: no page cache, no
/// readahead, no offsets.
const OPEN_FLAGS: FopenFlags = FopenFlags::FOPEN_DIRECT_IO.union(FopenFlags::FOPEN_NONSEEKABLE);

impl Filesystem for TokenFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.with(|inner, _| {
            (parent == INodeNo::ROOT)
                .then(|| inner.lookup(name))
                .flatten()
        }) {
            Some(ino) => reply.entry(&TTL, &attr(ino), Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let exists =
            ino == INodeNo::ROOT || self.with(|inner, _| inner.table.files.contains_key(&ino.0));
        if exists {
            reply.attr(&TTL, &attr(ino.0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    /// `>` in a shell truncates: there is nothing to truncate, so accept it.
    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        self.getattr(req, ino, fh, reply);
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let Some(name) = name.to_str().filter(|_| parent == INodeNo::ROOT) else {
            return reply.error(Errno::EINVAL);
        };
        let (ino, fh) = self.with(|inner, _| {
            let ino = inner.lookup(OsStr::new(name)).unwrap_or_else(|| {
                let ino = inner.table.next_ino;
                inner.table.next_ino += 1;
                inner.table.files.insert(ino, name.to_string());
                ino
            });
            (ino, inner.open_handle(ino))
        });
        reply.created(&TTL, &attr(ino), Generation(0), FileHandle(fh), OPEN_FLAGS);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let removed = self.with(|inner, _| {
            let ino = inner.lookup(name).filter(|_| parent == INodeNo::ROOT)?;
            inner.aborted.remove(&ino);
            inner.table.holding.remove(&ino);
            inner.table.files.remove(&ino)
        });
        match removed {
            Some(_) => reply.ok(),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let fh = self.with(|inner, _| {
            inner
                .table
                .files
                .contains_key(&ino.0)
                .then(|| inner.open_handle(ino.0))
        });
        match fh {
            Some(fh) => reply.opened(FileHandle(fh), OPEN_FLAGS),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn read(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if size == 0 {
            return reply.data(&[]);
        }
        // make ≥ 4.3 reads with O_NONBLOCK after pselect(); the jobserver
        // crate reads blocking first (docs/jobserver.md, "What clients do").
        let blocking = flags.0 & libc::O_NONBLOCK == 0;
        let caller = Caller {
            tid: req.pid(),
            unique: req.unique().0,
        };
        self.with(|inner, broker| {
            let Some(pid) = inner.process(broker, caller.tid, fh.0) else {
                return reply.error(Errno::ESRCH);
            };
            match inner.aborted(fh.0).map(|aborted| aborted.read(pid)) {
                Some(Ok(byte)) => reply.data(&[byte]),
                Some(Err(errno)) => reply.error(Errno::from_i32(errno)),
                None => inner
                    .waiters
                    .read(broker, pid, caller, fh.0, blocking, FuseRead(reply)),
            }
        });
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Ok(written) = u32::try_from(data.len()) else {
            return reply.error(Errno::ENOSPC);
        };
        let (tokens, abort) = sort_written(data);
        let given = self.with(|inner, broker| {
            if let Some(byte) = abort {
                inner.abort(fh.0, byte);
            }
            if tokens == 0 {
                return Ok(());
            }
            let pid = inner.process(broker, req.pid(), fh.0).ok_or(libc::ESRCH)?;
            inner.waiters.write(broker, pid, tokens)
        });
        match given {
            Ok(()) => reply.written(written),
            Err(errno) => reply.error(Errno::from_i32(errno)),
        }
    }

    fn poll(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        ph: PollNotifier,
        events: PollEvents,
        flags: PollFlags,
        reply: ReplyPoll,
    ) {
        let answer = FuseAnswer { reply, events };
        if !events.intersects(PollEvents::POLLIN | PollEvents::POLLRDNORM) {
            return answer.not_ready();
        }
        self.with(|inner, broker| {
            let Some(pid) = inner.process(broker, req.pid(), fh.0) else {
                return answer.not_ready();
            };
            if let Some(aborted) = inner.aborted(fh.0) {
                let readable = aborted.readable(pid);
                return answer.answer(readable);
            }
            let call = PollCall {
                will_wait: flags.contains(PollFlags::FUSE_POLL_SCHEDULE_NOTIFY),
                hold: inner.table.holding.contains(&ino.0),
                unique: req.unique().0,
                waker: FusePoll::Answered(ph),
                answer,
            };
            inner.waiters.poll(broker, pid, fh.0, call, Instant::now());
        });
    }

    /// A thread whose read or poll we hold got a signal: answer it now, as
    /// a pipe's read or poll would return `EINTR`. One we do not hold was
    /// answered already, or read by a broker that died (a mount taken
    /// from the keeper): fuser answers it `EINTR`, which frees its caller.
    fn interrupt(&self, _req: &Request, unique: RequestId) -> bool {
        self.with(|inner, broker| inner.waiters.interrupted(broker, unique.0))
    }

    /// Only [`POLLS_XATTR`], with `hold` or `notify` (see `baton_core::protocol::FUSE_POLLS_XATTR`).
    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        if name != POLLS_XATTR {
            return reply.error(Errno::ENOTSUP);
        }
        let hold = match value {
            FUSE_POLLS_HOLD => true,
            FUSE_POLLS_NOTIFY => false,
            _ => return reply.error(Errno::EINVAL),
        };
        let known = self.with(|inner, _| {
            if !inner.table.files.contains_key(&ino.0) {
                return false;
            }
            if hold {
                inner.table.holding.insert(ino.0);
            } else {
                inner.table.holding.remove(&ino.0);
            }
            true
        });
        if known {
            reply.ok();
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if name != POLLS_XATTR {
            return reply.error(Errno::ENODATA);
        }
        let Some(hold) = self.with(|inner, _| {
            inner
                .table
                .files
                .contains_key(&ino.0)
                .then(|| inner.table.holding.contains(&ino.0))
        }) else {
            return reply.error(Errno::ENOENT);
        };
        let value = if hold {
            FUSE_POLLS_HOLD
        } else {
            FUSE_POLLS_NOTIFY
        };
        match size {
            0 => reply.size(value.len() as u32),
            n if n as usize >= value.len() => reply.data(value),
            _ => reply.error(Errno::ERANGE),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.with(|inner, broker| {
            inner.table.handles.remove(&fh.0);
            inner.waiters.close(broker, fh.0);
        });
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let mut entries = vec![
            (INodeNo::ROOT.0, FileType::Directory, ".".to_string()),
            (INodeNo::ROOT.0, FileType::Directory, "..".to_string()),
        ];
        self.with(|inner, _| {
            entries.extend(
                inner
                    .table
                    .files
                    .iter()
                    .map(|(&ino, name)| (ino, FileType::RegularFile, name.clone())),
            )
        });
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

#[cfg(test)]
mod tests {
    use super::sort_written;
    use super::*;
    use crate::fuse::waiters::HOLD;

    fn files() -> Files {
        let poll = mio::Poll::new().unwrap();
        let exits = super::super::procs::Exits::new(poll.registry().try_clone().unwrap());
        Files::new(
            Waiters::new(super::super::waiters::Mode::OneAtATime, HOLD),
            exits,
        )
    }

    #[test]
    fn what_is_lent_is_reached_within_and_only_within() {
        let (mut files, mut broker) = (files(), Broker::new(4).unwrap());
        let limit = lend(&mut files, &mut broker, || with(|_, b| b.pool().limit()));
        assert_eq!(limit, 4);
        let outside = std::panic::catch_unwind(|| with(|_, _| ()));
        assert!(outside.is_err(), "nothing is lent outside lend");
        let nested = lend(&mut files, &mut broker, || {
            with(|_, _| std::panic::catch_unwind(|| with(|_, _| ())).is_err())
        });
        assert!(nested, "a second borrow inside the first panics");
        // A request that panics gives the state back for the next one.
        let again = lend(&mut files, &mut broker, || {
            let _ = std::panic::catch_unwind(|| with(|_, _| panic!("a request failed")));
            with(|_, b| b.pool().limit())
        });
        assert_eq!(again, 4);
    }

    /// A successor reads the token files as brokers before this one wrote
    /// them (no `holding` before held polls), and writes them the same way.
    #[test]
    fn the_file_table_travels_under_the_names_and_shapes_it_always_had() {
        let old = serde_json::json!({
            "waiters": {"mode": "OneAtATime", "processes": [], "polled": []},
            "files": [[2, "make.1"], [3, "ninja.2"]],
            "next_ino": 4,
            "handles": [[1, 2]],
            "next_fh": 2,
        });
        let state: super::FsState = serde_json::from_value(old.clone()).unwrap();
        assert_eq!(state.table.files[&3], "ninja.2");
        assert_eq!(state.table.handles[&1], 2);
        assert!(state.table.holding.is_empty());
        let mut again = serde_json::to_value(&state).unwrap();
        assert_eq!(again["holding"], serde_json::json!([]));
        again.as_object_mut().unwrap().remove("holding");
        assert_eq!(again, old);
    }

    /// The waiters travel as the value they are, under the names and
    /// shapes the hand-copied form they replace had: each process with its
    /// client, each polled handle with its kernel handle, its place in the
    /// queue and the time its reservation has left.
    #[test]
    fn the_waiters_travel_under_the_names_and_shapes_they_always_had() {
        let old = serde_json::json!({
            "waiters": {
                "mode": "OneAtATime",
                "processes": [[4242, 3]],
                "polled": [
                    {"fh": 7, "client": 3, "kernel_handle": 99, "queued": true, "reserved_for": null},
                    {"fh": 8, "client": 3, "kernel_handle": 100, "queued": false,
                     "reserved_for": {"secs": 3600, "nanos": 0}},
                ],
            },
            "files": [[2, "make.1"]],
            "next_ino": 3,
            "handles": [[7, 2], [8, 2]],
            "next_fh": 9,
            "holding": [],
        });
        let state: super::FsState = serde_json::from_value(old.clone()).unwrap();
        let mut again = serde_json::to_value(&state).unwrap();
        let polled = again["waiters"]["polled"].as_array_mut().unwrap();
        polled.sort_by_key(|p| p["fh"].as_u64());
        let left = polled[1]["reserved_for"]["secs"].as_u64().unwrap();
        assert!(
            (3500..3600).contains(&left),
            "an hour's reservation has a little less than an hour left: {left} s"
        );
        polled[1]["reserved_for"] = serde_json::json!({"secs": 3600, "nanos": 0});
        assert_eq!(again, old);
    }

    /// Each open gets a handle of its own, which names its file: an abort
    /// token written through one handle marks that file, and only it.
    #[test]
    fn handles_are_numbered_apart_and_an_abort_marks_the_file_behind_one() {
        let mut files = files();
        let (bmake, other) = (files.open_handle(2), files.open_handle(3));
        assert_eq!((bmake, other), (1, 2));
        assert!(files.aborted(bmake).is_none());
        files.abort(bmake, b'E');
        files.abort(bmake, b'I');
        assert_eq!(
            files.aborted(bmake).map(|a| a.byte),
            Some(b'E'),
            "the first stays"
        );
        assert!(files.aborted(other).is_none());
        let again = files.open_handle(2);
        assert_eq!(
            files.aborted(again).map(|a| a.byte),
            Some(b'E'),
            "the file's, not the handle's"
        );
    }

    /// A mount taken from a killed broker: its handles are still open in
    /// the kernel, so ours are numbered above them, and its processes may
    /// give back tokens it granted.
    #[test]
    fn an_orphaned_mount_numbers_its_handles_above_the_dead_ones_and_forgives() {
        let (mut files, mut broker) = (files(), Broker::new(2).unwrap());
        files.take_orphan();
        assert_eq!(files.open_handle(2), ORPHAN_BASE);
        assert_eq!(files.table.next_ino, ORPHAN_BASE);
        files.waiters.process(&mut broker, 42, || {
            ClientMeta::new(42, "make".into(), Transport::Fuse)
        });
        assert_eq!(
            files.waiters.write(&mut broker, 42, 1),
            Ok(()),
            "a token the dead broker granted comes back"
        );
        assert_eq!(broker.pool().free(), 2);
    }

    #[test]
    fn abort_tokens_are_not_tokens() {
        assert_eq!(sort_written(b"++"), (2, None));
        assert_eq!(sort_written(b"+E+E"), (2, Some(b'E')));
        assert_eq!(sort_written(b"I"), (0, Some(b'I')));
        assert_eq!(sort_written(b""), (0, None));
    }

    #[test]
    fn every_reader_finds_the_abort_token_once_and_then_an_empty_file() {
        let mut aborted = super::Aborted::new(b'E');
        assert_eq!(aborted.read(10), Ok(b'E'));
        assert_eq!(aborted.read(10), Err(libc::EAGAIN), "its drain ends");
        assert!(aborted.readable(11) && !aborted.readable(10));
        assert_eq!(
            aborted.read(11),
            Ok(b'E'),
            "the next reader finds it too, however soon"
        );
    }
}
