//! The fast path's shared memory (docs/fastpath.md, "The region"): a
//! sealed memfd mapped into the broker and each of its fast-path clients,
//! and the futex calls with which a waiter sleeps on its slot and a
//! releaser wakes exactly that one waiter. The steps themselves are
//! `baton_core::fastpath::Ring`'s; this module gives them memory and a
//! [`Host`].
//!
//! The broker makes the region ([`Mapping::create`]) and passes its
//! descriptor over the socket; a client maps what it was given
//! ([`Mapping::map`]) only if it is sealed against shrinking and growing:
//! a region truncated under a client's feet would kill it with SIGBUS.

use baton_core::fastpath::{pile, ring, Host, LayoutError, Notice, Ring};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

/// The seals a region must carry before a client maps it: no one may
/// shrink or grow it, nor change its seals again.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Why a region cannot be mapped.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// A system call failed.
    #[error("{what}: {source}")]
    Os {
        /// The call.
        what: &'static str,
        /// Its error.
        source: io::Error,
    },
    /// The descriptor can still be resized by someone.
    #[error("the region is not sealed against resizing (seals {0:#x})")]
    Unsealed(libc::c_int),
    /// Its words are not a region of this layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Its words are not a pile of this layout.
    #[error(transparent)]
    Pile(pile::LayoutError),
}

fn os(what: &'static str) -> MapError {
    MapError::Os {
        what,
        source: io::Error::last_os_error(),
    }
}

/// A region's words, mapped shared; unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    words: NonNull<AtomicU64>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory accessed only through
// atomics; it may be used and dropped from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above: every access is an atomic operation.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// The broker's side: a new sealed memfd laid out for `capacity`
    /// slots and `seats` seats with `lent` free tokens, mapped here, and
    /// its descriptor, to pass to clients.
    pub fn create(
        capacity: usize,
        seats: usize,
        lent: u32,
    ) -> Result<(Mapping, OwnedFd), MapError> {
        let (mapping, fd) = Mapping::sealed(ring::words_for(capacity, seats) * 8)?;
        Ring::init(mapping.words(), capacity, seats, lent)?;
        Ok((mapping, fd))
    }

    /// The broker's side for a pile (docs/fastpath.md, "The pile"): a new
    /// sealed memfd laid out for `tokens` token words, every one the
    /// broker's until it lends it, and `seats` seats.
    pub fn create_pile(tokens: usize, seats: usize) -> Result<(Mapping, OwnedFd), MapError> {
        let (mapping, fd) = Mapping::sealed(pile::words_for(tokens, seats) * 8)?;
        pile::Pile::init(mapping.words(), tokens, seats, 0).map_err(pile_layout)?;
        Ok((mapping, fd))
    }

    /// A new memfd of `len` zeroed bytes, sealed against resizing, and
    /// mapped here.
    fn sealed(len: usize) -> Result<(Mapping, OwnedFd), MapError> {
        // SAFETY: the name is a NUL-terminated string; flags are valid.
        let fd = unsafe {
            libc::memfd_create(
                c"baton-fastpath".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(os("memfd_create"));
        }
        // SAFETY: memfd_create returned a descriptor we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain calls on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os("ftruncate"));
        }
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(os("F_ADD_SEALS"));
        }
        Ok((Mapping::map_words(fd.as_raw_fd(), len)?, fd))
    }

    /// A client's side: maps the region `fd` names, once it is sure that
    /// nobody can resize it, and checks its layout.
    pub fn map(fd: BorrowedFd<'_>) -> Result<Mapping, MapError> {
        // SAFETY: F_GET_SEALS reads the descriptor's seals.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(os("F_GET_SEALS"));
        }
        if seals & SEALS != SEALS {
            return Err(MapError::Unsealed(seals));
        }
        // SAFETY: an all-zero stat is a valid value for fstat to fill.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: stat is valid for writes.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
            return Err(os("fstat"));
        }
        let mapping = Mapping::map_words(fd.as_raw_fd(), stat.st_size as usize)?;
        if mapping.is_pile() {
            pile::Pile::attach(mapping.words()).map_err(pile_layout)?;
        } else {
            Ring::attach(mapping.words())?;
        }
        // A child this process forks must not use a seat it does not own.
        // SAFETY: advice on our own mapping.
        unsafe {
            libc::madvise(
                mapping.words.as_ptr().cast(),
                mapping.len,
                libc::MADV_DONTFORK,
            )
        };
        Ok(mapping)
    }

    fn map_words(fd: libc::c_int, len: usize) -> Result<Mapping, MapError> {
        if len == 0 || !len.is_multiple_of(8) {
            return Err(LayoutError::Size {
                needed: 8,
                have: len / 8,
            }
            .into());
        }
        // SAFETY: a fresh shared mapping of `len` bytes of `fd`, which is
        // sealed against shrinking, so every page stays backed.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os("mmap"));
        }
        Ok(Mapping {
            words: NonNull::new(ptr.cast()).ok_or_else(|| os("mmap"))?,
            len,
        })
    }

    /// The region's words.
    pub fn words(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is `len` bytes, page-aligned, and lives as
        // long as `self`; AtomicU64 has the size and alignment of u64.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr(), self.len / 8) }
    }

    /// The ring on these words (a region that is not a pile).
    pub fn ring(&self) -> Ring<'_> {
        Ring::attach(self.words()).expect("checked when mapped")
    }

    /// Whether the region is a pile, not a ring: its first word says.
    pub fn is_pile(&self) -> bool {
        self.words()[0].load(std::sync::atomic::Ordering::SeqCst) == pile::MAGIC
    }

    /// The pile on these words (a region that is one).
    pub fn pile(&self) -> pile::Pile<'_> {
        pile::Pile::attach(self.words()).expect("checked when mapped")
    }

    /// The liveness word: where each layout keeps it.
    fn liveness(&self) -> &AtomicU64 {
        &self.words()[if self.is_pile() {
            pile::LIVENESS
        } else {
            ring::LIVENESS
        }]
    }

    /// The broker's side: makes the region's liveness word (line 1) a
    /// robust, process-shared mutex and locks it from the calling thread,
    /// which must serve for the broker's whole life. When that thread
    /// ends, however it ends, the kernel marks the word's owner dead
    /// (pthread_mutexattr_setrobust(3); the kernel's robust-futex-ABI),
    /// and clients see it in [`Mapping::broker_alive`].
    pub fn hold_liveness(&self) -> io::Result<()> {
        let mutex = self.liveness().as_ptr().cast::<libc::pthread_mutex_t>();
        // A pile keeps it in words 2 to 6 of its first line.
        const _: () = assert!(std::mem::size_of::<libc::pthread_mutex_t>() <= 40);
        // SAFETY: `mutex` is 40 bytes of our own shared mapping (the
        // ring's line 1, the pile's words 2 to 6: nothing else lives
        // there), aligned to 8; the
        // attribute lives on this stack for the calls that use it.
        unsafe {
            let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
            check(libc::pthread_mutexattr_init(&mut attr))?;
            check(libc::pthread_mutexattr_setpshared(
                &mut attr,
                libc::PTHREAD_PROCESS_SHARED,
            ))?;
            check(libc::pthread_mutexattr_setrobust(
                &mut attr,
                libc::PTHREAD_MUTEX_ROBUST,
            ))?;
            check(libc::pthread_mutex_init(mutex, &attr))?;
            libc::pthread_mutexattr_destroy(&mut attr);
            check(libc::pthread_mutex_lock(mutex))
        }
    }

    /// The broker's side, when the region dies before the broker does (its
    /// last client left, or a successor took over): unlocks the liveness
    /// word from the thread that locked it, so that the word says "no
    /// broker" to any client still looking. Unlocking also takes it off the
    /// thread's robust list, which must not name memory about to be
    /// unmapped.
    pub fn release_liveness(&self) -> io::Result<()> {
        let mutex = self.liveness().as_ptr().cast::<libc::pthread_mutex_t>();
        // SAFETY: the mutex was initialized and locked by this thread in
        // hold_liveness, in our own live mapping.
        check(unsafe { libc::pthread_mutex_unlock(mutex) })
    }

    /// Whether the thread that called [`Mapping::hold_liveness`] still
    /// lives: the word holds its thread id and not the kernel's
    /// owner-died bit. One load; a client looks before each operation.
    pub fn broker_alive(&self) -> bool {
        let word = self.liveness().load(std::sync::atomic::Ordering::SeqCst) as u32;
        word & libc::FUTEX_TID_MASK != 0 && word & libc::FUTEX_OWNER_DIED == 0
    }
}

/// A pile's layout error, as a region's.
fn pile_layout(e: pile::LayoutError) -> MapError {
    MapError::Pile(e)
}

fn check(rc: libc::c_int) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.words.as_ptr().cast(), self.len) };
    }
}

/// The futex calls on a slot's word, and where a client's notices go.
pub struct Futexes<F: Fn(Notice)> {
    /// Called with what the broker must hear: the client writes it to
    /// its socket.
    pub tell: F,
}

impl<F: Fn(Notice)> Host for Futexes<F> {
    fn wait(&self, word: &AtomicU64, expected: u32, deadline: Option<Instant>) {
        futex_wait(word, expected, deadline);
    }

    fn wake(&self, word: &AtomicU64) {
        futex_wake(word);
    }

    fn tell(&self, notice: Notice) {
        (self.tell)(notice)
    }
}

/// Reads one reply line from `socket` and the descriptor that may ride
/// with its first byte (SCM_RIGHTS, unix(7)): the answer to FASTPATH. The
/// descriptor is made close-on-exec as it arrives.
pub fn receive_with_fd(
    socket: &std::os::unix::net::UnixStream,
) -> io::Result<(String, Option<OwnedFd>)> {
    let mut line = Vec::new();
    let mut fd = None;
    while !line.ends_with(b"\n") {
        let mut buf = [0u8; 256];
        // The control buffer: room for one descriptor, aligned for cmsghdr.
        let mut control = [0u64; 8];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: if fd.is_none() && line.is_empty() {
                buf.len()
            } else {
                1
            },
        };
        // SAFETY: an all-zero msghdr is valid; its pointers are set below
        // to buffers that outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        // socklen_t on musl, size_t on glibc.
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: msg describes live buffers.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        // SAFETY: the kernel filled msg's control buffer; the CMSG macros
        // walk it within msg_controllen.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let raw = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>());
                    fd = Some(OwnedFd::from_raw_fd(raw));
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        line.extend_from_slice(&buf[..n as usize]);
    }
    let line = String::from_utf8(line).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    Ok((line, fd))
}

/// The low 32 bits of a slot's word: what a waiter sleeps on (futex(2)
/// waits on a 32-bit word; the region is little-endian, so they come
/// first).
fn low_half(word: &AtomicU64) -> *const u32 {
    const _: () = assert!(
        cfg!(target_endian = "little"),
        "the region's layout is little-endian"
    );
    word.as_ptr().cast::<u32>()
}

/// Sleeps while the low half of `word` is `expected`: until a wake, a
/// signal, `deadline`, or for no reason (the caller looks again). Not
/// `FUTEX_PRIVATE_FLAG`: the word is shared between processes.
pub fn futex_wait(word: &AtomicU64, expected: u32, deadline: Option<Instant>) {
    let timeout = deadline.map(|d| {
        let left = d.saturating_duration_since(Instant::now());
        libc::timespec {
            tv_sec: left.as_secs() as _,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        }
    });
    let timeout_ptr = timeout
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: the address is an aligned word of a live mapping; the
    // timeout, if any, outlives the call. Its result needs no look: the
    // caller reads the word again whatever happened.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            low_half(word),
            libc::FUTEX_WAIT,
            expected,
            timeout_ptr,
        )
    };
}

/// Wakes one process sleeping on `word`: the slot's one claimer.
pub fn futex_wake(word: &AtomicU64) {
    futex_wake_one(word);
}

/// Wakes one process sleeping on `word`; whether there was one.
pub fn futex_wake_one(word: &AtomicU64) -> bool {
    // SAFETY: the address is an aligned word of a live mapping.
    unsafe { libc::syscall(libc::SYS_futex, low_half(word), libc::FUTEX_WAKE, 1) > 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_core::fastpath::{Acquired, Seat};
    use std::os::fd::AsFd;
    use std::sync::atomic::Ordering::SeqCst;

    #[test]
    fn a_region_is_sealed_and_maps_again_with_the_same_words() {
        let (broker, fd) = Mapping::create(16, 2, 1).unwrap();
        let client = Mapping::map(fd.as_fd()).unwrap();
        assert_eq!(client.ring().capacity(), 16);
        broker.words()[ring::TAIL].store(7, SeqCst);
        assert_eq!(client.words()[ring::TAIL].load(SeqCst), 7, "one memory");
        // SAFETY: a call on our own descriptor.
        let grown = unsafe { libc::ftruncate(fd.as_raw_fd(), 1 << 20) };
        assert_eq!(grown, -1, "sealed against growing");
    }

    #[test]
    fn the_liveness_word_says_when_the_thread_holding_it_is_gone() {
        let region = std::sync::Arc::new(Mapping::create(16, 2, 0).unwrap().0);
        assert!(!region.broker_alive(), "nobody holds it yet");
        let (held_tx, held) = std::sync::mpsc::channel();
        let (end_tx, end) = std::sync::mpsc::channel::<()>();
        let shared = region.clone();
        let broker = std::thread::spawn(move || {
            shared.hold_liveness().unwrap();
            held_tx.send(()).unwrap();
            let _ = end.recv();
        });
        held.recv().unwrap();
        assert!(region.broker_alive());
        drop(end_tx);
        broker.join().unwrap();
        assert!(!region.broker_alive(), "the kernel marked its owner dead");
    }

    #[test]
    fn a_region_given_up_by_its_broker_says_so() {
        let (region, _fd) = Mapping::create(16, 2, 0).unwrap();
        region.hold_liveness().unwrap();
        assert!(region.broker_alive());
        region.release_liveness().unwrap();
        assert!(!region.broker_alive());
    }

    #[test]
    fn an_unsealed_descriptor_is_refused() {
        // SAFETY: as in Mapping::create.
        let fd = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) };
        assert!(matches!(
            Mapping::map(fd.as_fd()),
            Err(MapError::Unsealed(_))
        ));
    }

    #[test]
    fn a_waiter_sleeps_in_the_kernel_until_a_release_wakes_it() {
        let region = std::sync::Arc::new(Mapping::create(16, 2, 1).unwrap().0);
        let host = Futexes { tell: |_| {} };
        let ring = region.ring();
        assert_eq!(ring.acquire(Seat(0), &host, None), Ok(Acquired::Token));
        let (tid_tx, tid) = std::sync::mpsc::channel();
        let (done_tx, done) = std::sync::mpsc::channel();
        // Not a scoped thread: one never woken must not hang the test.
        let shared = region.clone();
        std::thread::spawn(move || {
            // SAFETY: gettid has no arguments and cannot fail.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            let host = Futexes { tell: |_| {} };
            let got = shared.ring().acquire(Seat(1), &host, None);
            done_tx.send(got).unwrap();
        });
        // In the kernel, in futex_wait, not merely about to be: so only a
        // wake can end its wait.
        let wchan = format!("/proc/self/task/{}/wchan", tid.recv().unwrap());
        while !std::fs::read_to_string(&wchan).unwrap().contains("futex") {
            std::thread::yield_now();
        }
        ring.release(Seat(0), &host).unwrap();
        let got = done.recv_timeout(std::time::Duration::from_secs(60));
        assert_eq!(got, Ok(Ok(Acquired::Token)), "the waiter was woken");
        assert_eq!(ring.record(Seat(1)).unwrap().held, 1);
    }

    #[test]
    fn a_wait_with_a_deadline_ends_in_the_kernel() {
        let (region, _fd) = Mapping::create(16, 2, 1).unwrap();
        let ring = region.ring();
        let host = Futexes { tell: |_| {} };
        ring.acquire(Seat(0), &host, None).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_millis(50);
        assert_eq!(
            ring.acquire(Seat(1), &host, Some(deadline)),
            Ok(Acquired::TimedOut)
        );
        assert!(Instant::now() >= deadline);
    }
}
