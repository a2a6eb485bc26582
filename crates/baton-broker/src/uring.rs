//! Replies sent in the same system call as the wait for the next event.
//!
//! A write to a Unix socket wakes the reader with a "sync" wake-up: the
//! kernel assumes the writer is about to sleep and puts the reader on the
//! writer's CPU. The broker does sleep right after writing a grant, but on
//! a kernel that preempts only on the way back to user space (most
//! distribution kernels, `preempt=none` or `voluntary`), the woken client
//! preempts the broker as write() returns, before it reaches its sleep:
//! two context switches for one hand-off, the preemption and then the
//! sleep. Submitting the writes and the wait to io_uring in one
//! `io_uring_enter` leaves no return to user space in between, so the
//! broker goes straight to sleep and the client takes over its CPU: one
//! switch. A broker woken through io_uring is also woken without the sync
//! hint, so it no longer lands on, and preempts, the client that wrote to
//! it. docs/benchmarks.md measures both.
//!
//! Where io_uring is missing (old kernels, seccomp profiles that forbid
//! it), `SendAndWait::new` fails and the caller writes, then waits.

use io_uring::{opcode, squeue, types, IoUring, Probe};
use std::io;
use std::os::fd::RawFd;

/// Marks the completion of the wait, as opposed to a send's.
const WAIT: u64 = u64::MAX;

/// What one send did.
#[derive(Debug)]
pub enum Sent {
    /// These many bytes went out (fewer than asked if the socket filled).
    Bytes(usize),
    /// Nothing went out: the socket was full (`WouldBlock`), its peer gone,
    /// or the kernel refused the operation. A plain write tells which.
    Failed(io::Error),
    /// The ring failed before the send completed: whether it went out is
    /// not known.
    Unknown,
}

/// An io_uring that sends buffers to sockets, then sleeps until an epoll
/// instance has events.
pub struct SendAndWait {
    ring: IoUring,
    epoll: RawFd,
    /// Copies of what is being sent: the kernel reads them until each send
    /// completes.
    buffers: Vec<Vec<u8>>,
    /// A send's outcome was lost: its buffer may still be read by the
    /// kernel, so it is never freed, and the ring is not used again.
    broken: bool,
    /// `io_uring_enter` calls made: one per `send_then_wait` is the point.
    enters: u64,
}

impl SendAndWait {
    /// A ring for `epoll` (the event loop's epoll file descriptor), with
    /// room for `batch` sends per call. Fails where the kernel has no
    /// io_uring, refuses it, or lacks the two operations (before 5.6).
    pub fn new(epoll: RawFd, batch: u32) -> io::Result<Self> {
        let ring = IoUring::new((batch + 1).next_power_of_two())?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        for (code, name) in [
            (opcode::Send::CODE, "IORING_OP_SEND"),
            (opcode::PollAdd::CODE, "IORING_OP_POLL_ADD"),
        ] {
            if !probe.is_supported(code) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("this kernel's io_uring has no {name}"),
                ));
            }
        }
        Ok(SendAndWait {
            ring,
            epoll,
            buffers: Vec::new(),
            broken: false,
            enters: 0,
        })
    }

    /// The most sends one call takes.
    pub fn batch(&self) -> usize {
        self.ring.params().sq_entries() as usize - 1
    }

    /// Sends each buffer to its socket without blocking, then sleeps until
    /// `epoll` has events, or a signal interrupts the sleep. Returns what
    /// each send did, in order. `Err` only if nothing could be submitted:
    /// then nothing was sent and the caller should stop using the ring.
    pub fn send_then_wait(&mut self, sends: &[(RawFd, &[u8])]) -> io::Result<Vec<Sent>> {
        if self.broken {
            return Err(io::Error::other("an earlier io_uring call failed"));
        }
        assert!(
            sends.len() <= self.batch(),
            "more sends than the ring holds"
        );
        self.buffers.resize_with(sends.len(), Vec::new);
        let mut entries: Vec<squeue::Entry> = Vec::with_capacity(sends.len() + 1);
        for (i, &(fd, data)) in sends.iter().enumerate() {
            let buffer = &mut self.buffers[i];
            buffer.clear();
            buffer.extend_from_slice(data);
            // MSG_DONTWAIT: a full socket fails the send at once instead of
            // parking it in the kernel.
            let send = opcode::Send::new(types::Fd(fd), buffer.as_ptr(), buffer.len() as u32)
                .flags(libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
            entries.push(send.build().user_data(i as u64));
        }
        // Armed after the sends: the epoll file turns readable when the
        // loop has events.
        entries.push(
            opcode::PollAdd::new(types::Fd(self.epoll), libc::POLLIN as u32)
                .build()
                .user_data(WAIT),
        );
        // SAFETY: each buffer stays untouched until its send completes, or
        // forever if its completion is lost (`broken`).
        unsafe { self.ring.submission().push_multiple(&entries) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        self.complete(sends.len())
    }

    /// Collects the sends' completions and the wait's.
    fn complete(&mut self, sends: usize) -> io::Result<Vec<Sent>> {
        let mut results: Vec<Option<Sent>> = (0..sends).map(|_| None).collect();
        let mut submitted = false;
        let mut woken = false;
        loop {
            let sending = results.iter().filter(|r| r.is_none()).count();
            if sending == 0 && woken {
                break;
            }
            // Wait for every completion still due, the wait's included: the
            // sends complete as they are submitted, and waiting for them
            // alone would return without sleeping.
            self.enters += 1;
            match self.ring.submit_and_wait(sending + usize::from(!woken)) {
                Ok(_) => submitted = true,
                Err(e) if !submitted => {
                    // Nothing went in; the entries left in the queue must
                    // not go in later, after the caller has sent the same.
                    self.broken = true;
                    return Err(e);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    if sending == 0 {
                        break; // a wait left armed only ends a later one early
                    }
                }
                Err(_) => {
                    // The sends in flight can no longer be accounted for.
                    self.broken = true;
                    break;
                }
            }
            for cqe in self.ring.completion() {
                match cqe.user_data() {
                    WAIT => woken = true,
                    i => results[i as usize] = Some(outcome(cqe.result())),
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(Sent::Unknown))
            .collect())
    }
}

fn outcome(result: i32) -> Sent {
    if result < 0 {
        Sent::Failed(io::Error::from_raw_os_error(-result))
    } else {
        Sent::Bytes(result as usize)
    }
}

impl Drop for SendAndWait {
    fn drop(&mut self) {
        if self.broken {
            // The kernel may still read them.
            std::mem::forget(std::mem::take(&mut self.buffers));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_testkit::{skip, Missing};
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;

    /// An epoll instance watching one socket for input.
    struct Epoll(RawFd);

    impl Epoll {
        fn watching(fd: RawFd) -> Epoll {
            // SAFETY: plain system calls on descriptors we own.
            let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            assert!(epoll >= 0);
            let mut event = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: 7,
            };
            assert_eq!(
                unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, fd, &mut event) },
                0
            );
            Epoll(epoll)
        }
    }

    impl Drop for Epoll {
        fn drop(&mut self) {
            // SAFETY: ours to close.
            unsafe { libc::close(self.0) };
        }
    }

    fn ring(epoll: &Epoll) -> Option<SendAndWait> {
        match SendAndWait::new(epoll.0, 7) {
            Ok(ring) => Some(ring),
            Err(e) => {
                // Counted as skipped in scripts/test's tally, not passed.
                skip(
                    Missing::IoUring,
                    &format!(
                        "io_uring unavailable here ({e}): the socket loop's fallback is what runs"
                    ),
                );
                None
            }
        }
    }

    #[test]
    fn sends_then_sleeps_until_the_epoll_has_events() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (watched, poker) = UnixStream::pair().unwrap();
        let epoll = Epoll::watching(watched.as_raw_fd());
        let Some(mut ring) = ring(&epoll) else { return };
        let poked = Arc::new(AtomicBool::new(false));
        let poke = std::thread::spawn({
            let poked = poked.clone();
            move || {
                let mut theirs = theirs;
                let mut got = [0u8; 9];
                theirs.read_exact(&mut got).unwrap();
                // Only after the reply came, and a while later, does the
                // loop get an event: a call that returned without sleeping
                // would be back before it.
                std::thread::sleep(std::time::Duration::from_millis(50));
                poked.store(true, SeqCst);
                (&poker).write_all(b"x").unwrap();
                (got, poker)
            }
        });
        let results = ring
            .send_then_wait(&[(ours.as_raw_fd(), b"GRANTED 1")])
            .unwrap();
        assert!(poked.load(SeqCst), "returned before the epoll had events");
        assert_eq!(
            ring.enters, 1,
            "the send and the sleep took more than one system call"
        );
        assert!(matches!(results[..], [Sent::Bytes(9)]), "{results:?}");
        let (got, _poker) = poke.join().unwrap();
        assert_eq!(&got, b"GRANTED 1");
    }

    #[test]
    fn returns_at_once_when_events_are_already_there() {
        let (watched, poker) = UnixStream::pair().unwrap();
        (&poker).write_all(b"x").unwrap();
        let epoll = Epoll::watching(watched.as_raw_fd());
        let Some(mut ring) = ring(&epoll) else { return };
        // Twice: a wait's completion never carries over into the next call.
        for _ in 0..2 {
            assert!(ring.send_then_wait(&[]).unwrap().is_empty());
        }
    }

    #[test]
    fn a_full_socket_fails_its_send_and_not_the_others() {
        let (full, _full_peer) = UnixStream::pair().unwrap();
        full.set_nonblocking(true).unwrap();
        while (&full).write(&[0u8; 65536]).is_ok() {}
        let (ok, mut ok_peer) = UnixStream::pair().unwrap();
        let (watched, poker) = UnixStream::pair().unwrap();
        (&poker).write_all(b"x").unwrap();
        let epoll = Epoll::watching(watched.as_raw_fd());
        let Some(mut ring) = ring(&epoll) else { return };
        let results = ring
            .send_then_wait(&[(full.as_raw_fd(), b"lost"), (ok.as_raw_fd(), b"kept")])
            .unwrap();
        assert!(
            matches!(&results[..], [Sent::Failed(e), Sent::Bytes(4)] if e.kind() == io::ErrorKind::WouldBlock),
            "{results:?}"
        );
        let mut got = [0u8; 4];
        ok_peer.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"kept");
    }

    /// `new(epoll, 7)` makes room for 7 sends beside the wait: the ring
    /// rounds 8 entries up to a power of two, and one is the wait's.
    #[test]
    fn the_batch_is_the_ring_less_the_wait() {
        let (watched, _poker) = UnixStream::pair().unwrap();
        let epoll = Epoll::watching(watched.as_raw_fd());
        let Some(ring) = ring(&epoll) else { return };
        assert_eq!(ring.batch(), 7);
    }

    /// An empty reply is sent, not failed: a send of 0 bytes completes
    /// with 0, which is not an error.
    #[test]
    fn an_empty_send_is_zero_bytes_sent() {
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let (watched, poker) = UnixStream::pair().unwrap();
        (&poker).write_all(b"x").unwrap();
        let epoll = Epoll::watching(watched.as_raw_fd());
        let Some(mut ring) = ring(&epoll) else { return };
        let results = ring.send_then_wait(&[(ours.as_raw_fd(), b"")]).unwrap();
        assert!(matches!(results[..], [Sent::Bytes(0)]), "{results:?}");
    }

    /// With nothing to send, the call still waits, in one system call: it
    /// does not return before it has asked the kernel for the loop's
    /// events.
    #[test]
    fn with_nothing_to_send_it_still_waits_in_one_call() {
        let (watched, poker) = UnixStream::pair().unwrap();
        (&poker).write_all(b"x").unwrap();
        let epoll = Epoll::watching(watched.as_raw_fd());
        let Some(mut ring) = ring(&epoll) else { return };
        assert!(ring.send_then_wait(&[]).unwrap().is_empty());
        assert_eq!(ring.enters, 1, "returned without waiting");
    }

    /// A signal that interrupts the sleep ends the call, as the loop's
    /// wake-up would, and the ring stays usable: the next call sends and
    /// returns as usual. Signals are sent until the call returns (the
    /// first may land before the sleep began, or interrupt only the
    /// submission's wait, which the kernel does not report); a call
    /// that never returned for them is ended by an event after the
    /// deadline, and fails the test.
    #[test]
    fn a_signal_ends_the_wait_and_leaves_the_ring_usable() {
        use std::os::unix::thread::JoinHandleExt;
        extern "C" fn nothing(_: libc::c_int) {}
        // SAFETY: a handler that does nothing, installed without
        // SA_RESTART so that it interrupts system calls; SIGURG is
        // ignored by default and nothing else in these tests uses it.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = nothing as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut action.sa_mask);
            assert_eq!(
                libc::sigaction(libc::SIGURG, &action, std::ptr::null_mut()),
                0
            );
        }
        let (watched, poker) = UnixStream::pair().unwrap();
        let epoll = Epoll::watching(watched.as_raw_fd());
        let Some(mut ring) = ring(&epoll) else { return };
        let done = Arc::new(AtomicBool::new(false));
        let waiter = std::thread::spawn({
            let done = done.clone();
            move || {
                let result = ring.send_then_wait(&[]).map(|r| r.len());
                done.store(true, SeqCst);
                (ring, result)
            }
        });
        let thread = waiter.as_pthread_t();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut ended_by_an_event = false;
        while !done.load(SeqCst) {
            if std::time::Instant::now() > deadline {
                ended_by_an_event = true;
                (&poker).write_all(b"x").unwrap();
                break;
            }
            // SAFETY: the thread is alive until joined.
            unsafe { libc::pthread_kill(thread, libc::SIGURG) };
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let (mut ring, result) = waiter.join().unwrap();
        assert!(!ended_by_an_event, "signals did not end the wait");
        assert_eq!(result.unwrap(), 0);
        // The ring goes on: a send and an event already there.
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        (&poker).write_all(b"x").unwrap();
        let results = ring
            .send_then_wait(&[(ours.as_raw_fd(), b"GRANTED 1")])
            .unwrap();
        assert!(matches!(results[..], [Sent::Bytes(9)]), "{results:?}");
        let mut got = [0u8; 9];
        theirs.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"GRANTED 1");
    }

    #[test]
    fn a_closed_peer_is_an_error_not_a_signal() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        drop(theirs);
        let (watched, poker) = UnixStream::pair().unwrap();
        (&poker).write_all(b"x").unwrap();
        let epoll = Epoll::watching(watched.as_raw_fd());
        let Some(mut ring) = ring(&epoll) else { return };
        let results = ring
            .send_then_wait(&[(ours.as_raw_fd(), b"GRANTED 1")])
            .unwrap();
        assert!(
            matches!(&results[..], [Sent::Failed(e)] if e.raw_os_error() == Some(libc::EPIPE)),
            "{results:?}"
        );
    }
}
