//! Who waits on the FUSE token file, and how each freed token reaches
//! exactly one of them.
//!
//! Every process using the file is one broker client (accounting is per
//! process: make reads through one handle and writes through another, the
//! jobserver crate reads from a helper thread; see docs/jobserver.md,
//! "What clients do"). Its waits go into the broker's one FIFO queue beside the socket
//! clients':
//!
//! - a blocking read is a request tagged with the FUSE request's id; the
//!   grant answers the read;
//! - a handle being poll()ed is a request tagged with the handle; the grant
//!   *reserves* the token for that handle and notifies only it. The token
//!   counts as held by the poller's process until it reads (the reservation
//!   becomes a taken token) or [`RESERVATION`] passes (the token is released
//!   to the next waiter), so no token sits free while a poller sleeps and a
//!   poller that found other work cannot keep one (one token, hundreds of
//!   woken pollers, as in FreeBSD's `make universe`: docs/benchmarks.md).
//! - on a file whose builds poll nothing else (GNU make ≥ 4.4 and cargo
//!   poll only the token file), a poll that would wait is *held*: not
//!   answered until a token is reserved for it, so the poller wakes once,
//!   readable, instead of being answered "not ready", notified and polling
//!   again. A held poll or blocked read whose thread gets a signal is
//!   answered at once (the kernel's FUSE_INTERRUPT), as a pipe's poll and
//!   read return `EINTR`.
//!
//! No I/O here: replies and notifications go through the [`ReadReply`] and
//! [`PollWaker`] traits and the clock is passed in, so the unit tests below
//! drive it with fakes.

use crate::broker::{Broker, ClientMeta, Transport};
use baton_core::{Acquired, ClientId, Grant, PoolError, Tag};
use serde::{Deserialize, Serialize};
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A process (thread group) id.
pub type Pid = u32;
/// An open handle of the token file.
pub type Fh = u64;

/// How long a notified poller has to read its reserved token. Long enough
/// for a woken make to be scheduled on a busy machine and come back through
/// poll() and read(); short enough that a poller that went on to other work
/// delays the next waiter only briefly.
pub const RESERVATION: Duration = Duration::from_millis(50);

/// How long a poll is held at most by default (`baton serve
/// --fuse-hold-ms`; see the module's documentation): the kernel does not
/// tell us a poll's timeout, and a held poll cannot time out, so a poller
/// that gave a timeout may see it run over by this much. After it the poll
/// is answered "not ready" and its poller sleeps on its handle as on any
/// other file, at the cost of that answer and a notification later. GNU
/// make gives a timeout only under `-l` (one second, to look at the load
/// again), cargo never; a second spans most waits for a token (1,024
/// pollers of 2 tokens held 1 ms each wait about half a second: at 250 ms
/// most holds ran out, and `bench mass-poll` cost 10.2 switches per
/// token there against 7.0–7.2 at 16–256).
pub const HOLD: Duration = Duration::from_secs(1);

/// Poll requests are tagged with their handle and this bit; blocking reads
/// with the FUSE request id, which never has it.
const POLL_TAG: Tag = 1 << 63;

/// The answer to a read that may have to wait.
pub trait ReadReply {
    /// One token byte.
    fn token(self);
    /// An error (`libc::EAGAIN`, `libc::EINTR`, ...).
    fn fail(self, errno: i32);
}

/// The answer to one poll request, which may be held (see the module's
/// documentation).
pub trait PollAnswer {
    /// A token is reserved for the poller: readable.
    fn ready(self);
    /// No token for it: not readable (a poll that waits then sleeps until
    /// its handle is woken).
    fn not_ready(self);
}

/// A poll request as the kernel sends it.
pub struct PollCall<N, A> {
    /// The caller sleeps until woken if we say "not ready" (it is not a
    /// poll with a zero timeout).
    pub will_wait: bool,
    /// The file's builds poll nothing but it: the answer may wait for a
    /// token.
    pub hold: bool,
    /// The kernel's id for the request, named again by an interrupt.
    pub unique: u64,
    pub waker: N,
    pub answer: A,
}

/// The thread behind a read, and the kernel's id for the request.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub tid: u32,
    pub unique: u64,
}

/// Wakes the poll()ers of one handle.
pub trait PollWaker {
    fn wake(&self);
    /// The kernel's handle for this poll, which a successor broker uses to
    /// wake the same poller.
    fn handle(&self) -> u64;
}

/// How freed tokens reach pollers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// Notify one handle and reserve the token for it.
    OneAtATime,
    /// Notify every polling handle and let them race, as a pipe does: only
    /// a control for the benchmark.
    NotifyAll,
}

struct BlockedRead<R> {
    reply: R,
    caller: Caller,
}

/// A poll answered only when a token is reserved for it, or its thread
/// gets a signal.
struct Held<A> {
    unique: u64,
    answer: A,
    until: Instant,
}

/// A poll()ed handle. A successor receives it as it is, with `N` the
/// kernel's poll handle: who polls, its place in the queue, the time its
/// reservation has left; a held poll is answered before (`hand_over`).
#[derive(Serialize, Deserialize)]
#[serde(bound(serialize = "N: Serialize", deserialize = "N: Deserialize<'de>"))]
struct Polled<N, A> {
    client: ClientId,
    #[serde(rename = "kernel_handle")]
    waker: N,
    queued: bool,
    #[serde(rename = "reserved_for", with = "time_left")]
    reserved_until: Option<Instant>,
    #[serde(skip)]
    held: Option<Held<A>>,
    /// A poller was answered "not ready" and sleeps until its handle is
    /// woken. (Never when the only poller is held: waking its handle would
    /// only rouse it in its request, for nothing.) A successor takes every
    /// poller to sleep.
    #[serde(skip)]
    sleeps: bool,
    /// Its process holds the whole pool, so its wait could not be queued
    /// (it would wait for itself): it is queued when the process gives a
    /// token back, as a pipe's poller is woken by its own write. Not
    /// carried across a handover (its poller sees the token at its next
    /// poll).
    #[serde(skip)]
    parked: bool,
}

impl<N, A: PollAnswer> Polled<N, A> {
    fn new(client: ClientId, waker: N) -> Self {
        Polled {
            client,
            waker,
            queued: false,
            reserved_until: None,
            held: None,
            sleeps: false,
            parked: false,
        }
    }
}

impl<N: PollWaker, A: PollAnswer> Polled<N, A> {
    /// A token is reserved for it now: its held poll is answered ready,
    /// and a sleeping poller woken.
    fn reserve(&mut self, now: Instant) {
        self.queued = false;
        self.parked = false;
        self.reserved_until = Some(now + RESERVATION);
        if let Some(held) = self.held.take() {
            held.answer.ready();
        }
        if std::mem::take(&mut self.sleeps) {
            self.waker.wake();
        }
    }

    /// Answers the held poll, if any, "not ready"; whether there was one.
    fn release_held(&mut self) -> bool {
        let Some(held) = self.held.take() else {
            return false;
        };
        held.answer.not_ready();
        true
    }
}

/// The FUSE file's waiters and reservations.
///
/// A successor broker receives this value itself (serde), as
/// [`Handed`]: which process is which client, and each polled handle by
/// its kernel poll handle. Blocked reads and held polls are bound to this
/// process and are answered before ([`Waiters::hand_over`]); how long polls
/// are held is the successor's to choose.
#[derive(Serialize, Deserialize)]
#[serde(bound(serialize = "N: Serialize", deserialize = "N: Deserialize<'de>"))]
pub struct Waiters<R, N, A> {
    mode: Mode,
    /// How long a poll is held at most; zero: never.
    #[serde(skip)]
    hold: Duration,
    /// The mount came from a killed broker: a process may give back more
    /// than it took from us (tokens that broker granted).
    #[serde(skip)]
    forgiving: bool,
    #[serde(with = "crate::pairs")]
    processes: HashMap<Pid, ClientId>,
    #[serde(skip)]
    reads: HashMap<(ClientId, Tag), BlockedRead<R>>,
    #[serde(with = "by_handle")]
    polled: HashMap<Fh, Polled<N, A>>,
}

/// The waiters as they travel to a successor: each poller by its kernel
/// poll handle.
pub type Handed<R, A> = Waiters<R, u64, A>;

impl<R, N, A> std::fmt::Debug for Waiters<R, N, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiters")
            .field("mode", &self.mode)
            .field("processes", &self.processes)
            .field("reads", &self.reads.len())
            .field("polled", &self.polled.len())
            .finish()
    }
}

/// A deadline as the time it has left when written, and read back as that
/// much from when it is read: an `Instant` means nothing in another
/// process.
mod time_left {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::time::{Duration, Instant};

    pub fn serialize<S: Serializer>(until: &Option<Instant>, s: S) -> Result<S::Ok, S::Error> {
        until
            .map(|t| t.saturating_duration_since(Instant::now()))
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Instant>, D::Error> {
        Ok(Option::<Duration>::deserialize(d)?.map(|left| Instant::now() + left))
    }
}

/// The polled handles as a list, each with its handle number beside its
/// fields (`{"fh": 7, "client": ..}`), as brokers before this one wrote them.
mod by_handle {
    use super::{Fh, Polled};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::HashMap;

    #[derive(Serialize, Deserialize)]
    struct Entry<P> {
        fh: Fh,
        #[serde(flatten)]
        polled: P,
    }

    pub fn serialize<N: Serialize, A, S: Serializer>(
        polled: &HashMap<Fh, Polled<N, A>>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(polled.iter().map(|(&fh, polled)| Entry { fh, polled }))
    }

    pub fn deserialize<'de, N: Deserialize<'de>, A, D: Deserializer<'de>>(
        d: D,
    ) -> Result<HashMap<Fh, Polled<N, A>>, D::Error> {
        Ok(Vec::<Entry<Polled<N, A>>>::deserialize(d)?
            .into_iter()
            .map(|e| (e.fh, e.polled))
            .collect())
    }
}

impl<R: ReadReply, N: PollWaker, A: PollAnswer> Waiters<R, N, A> {
    pub fn new(mode: Mode, hold: Duration) -> Self {
        Waiters {
            mode,
            hold,
            forgiving: false,
            processes: HashMap::new(),
            reads: HashMap::new(),
            polled: HashMap::new(),
        }
    }

    /// The waiters to hand a successor. A blocked read cannot travel (its
    /// reply is bound to this process): it fails with EINTR, as a signal
    /// would make it, and its request leaves the queue; readers retry. A
    /// held poll is answered "not ready": its poller sleeps on its handle,
    /// which the successor wakes. These waiters stay as they were besides,
    /// to carry on with should the handover fail.
    pub fn hand_over(&mut self, broker: &mut Broker) -> Handed<R, A> {
        for ((client, tag), read) in self.reads.drain() {
            broker.cancel(client, tag);
            read.reply.fail(libc::EINTR);
        }
        for p in self.polled.values_mut() {
            p.release_held();
        }
        let polled = self
            .polled
            .iter()
            .map(|(&fh, p)| {
                let handle = Polled {
                    queued: p.queued,
                    reserved_until: p.reserved_until,
                    ..Polled::new(p.client, p.waker.handle())
                };
                (fh, handle)
            })
            .collect();
        Waiters {
            mode: self.mode,
            hold: self.hold,
            forgiving: false,
            processes: self.processes.clone(),
            reads: HashMap::new(),
            polled,
        }
    }

    /// Carries on from a predecessor's waiters, holding polls for `hold`
    /// (ours to choose); `waker` makes the waker for a kernel poll handle.
    /// Every process and client named must be known to `broker`, which
    /// came with them.
    pub fn adopt(
        handed: Handed<R, A>,
        broker: &Broker,
        waker: impl Fn(u64) -> N,
        hold: Duration,
    ) -> Result<Self, &'static str> {
        let known = |pid: Pid, client: ClientId| {
            broker
                .pool()
                .meta(client)
                .is_some_and(|m| m.pid == pid && m.transport == Transport::Fuse)
        };
        if !handed
            .processes
            .iter()
            .all(|(&pid, &client)| known(pid, client))
        {
            return Err("a FUSE process is not the broker's FUSE client");
        }
        if !handed
            .polled
            .values()
            .all(|p| handed.processes.values().any(|&c| c == p.client))
        {
            return Err("a polled handle belongs to no FUSE process");
        }
        let polled = handed
            .polled
            .into_iter()
            .map(|(fh, p)| {
                // Whoever polled it may sleep on the handle.
                let adopted = Polled {
                    queued: p.queued,
                    reserved_until: p.reserved_until,
                    sleeps: true,
                    ..Polled::new(p.client, waker(p.waker))
                };
                (fh, adopted)
            })
            .collect();
        Ok(Waiters {
            processes: handed.processes,
            polled,
            ..Waiters::new(handed.mode, hold)
        })
    }

    /// How long a poll is held at most.
    pub fn hold(&self) -> Duration {
        self.hold
    }

    /// The processes using the file, to watch for their exit.
    pub fn pids(&self) -> impl Iterator<Item = Pid> + '_ {
        self.processes.keys().copied()
    }

    /// The broker client of a process; `describe` is asked for its metadata
    /// only the first time. `true`: the process is new here.
    pub fn process(
        &mut self,
        broker: &mut Broker,
        pid: Pid,
        describe: impl FnOnce() -> ClientMeta,
    ) -> (ClientId, bool) {
        if let Some(&id) = self.processes.get(&pid) {
            return (id, false);
        }
        let id = broker.connect(describe());
        self.processes.insert(pid, id);
        (id, true)
    }

    /// A read of one token by `caller`, a thread of `pid`, through handle `fh`.
    pub fn read(
        &mut self,
        broker: &mut Broker,
        pid: Pid,
        caller: Caller,
        fh: Fh,
        blocking: bool,
        reply: R,
    ) {
        let Some(&client) = self.processes.get(&pid) else {
            return reply.fail(libc::EPERM);
        };
        if self.take_reservation(broker, client, fh) {
            return reply.token();
        }
        if !blocking {
            return match broker.try_acquire(client, 1) {
                Ok(true) => reply.token(),
                // Even a process holding the whole pool only has to wait.
                Ok(false) | Err(PoolError::MoreThanLimit { .. }) => reply.fail(libc::EAGAIN),
                Err(e) => reply.fail(errno_of(&e)),
            };
        }
        let tag = self.read_tag(client);
        match broker.acquire(client, tag, 1) {
            Ok(Acquired::Granted) => reply.token(),
            Ok(Acquired::Queued) => {
                self.reads
                    .insert((client, tag), BlockedRead { reply, caller });
            }
            Err(e) => reply.fail(errno_of(&e)),
        }
    }

    /// Gives back `tokens` taken by `pid`. A process cannot give back more
    /// than it took (reserved tokens are not yet taken): ENOSPC, and the
    /// pool is unchanged. On a mount taken from a killed broker, what is
    /// beyond is that broker's, which our pool never counted: thrown away.
    pub fn write(&mut self, broker: &mut Broker, pid: Pid, tokens: u32) -> Result<(), i32> {
        let Some(&client) = self.processes.get(&pid) else {
            return Err(libc::ENOSPC);
        };
        let taken = self.taken(broker, client);
        if tokens > taken && !self.forgiving {
            return Err(libc::ENOSPC);
        }
        match tokens.min(taken) {
            0 => Ok(()),
            ours => {
                broker.release(client, ours).map_err(|e| errno_of(&e))?;
                self.unpark(broker, client, Instant::now());
                Ok(())
            }
        }
    }

    /// `client` gave tokens back: its polls that could not be queued while
    /// it held the whole pool are queued now (behind whoever waited first),
    /// or reserved at once if a token is free.
    fn unpark(&mut self, broker: &mut Broker, client: ClientId, now: Instant) {
        let parked = self
            .polled
            .iter_mut()
            .filter(|(_, p)| p.parked && p.client == client);
        for (&fh, p) in parked {
            match broker.acquire(client, fh | POLL_TAG, 1) {
                Ok(Acquired::Granted) => p.reserve(now),
                Ok(Acquired::Queued) => {
                    p.parked = false;
                    p.queued = true;
                }
                Err(_) => {} // still the whole pool: its next give-back
            }
        }
    }

    /// See [`Waiters::write`].
    pub fn forgive_strangers(&mut self) {
        self.forgiving = true;
    }

    /// A poll() of handle `fh` by `pid`, answered through `call.answer`:
    /// at once, or, held, when a token is reserved for it or its thread is
    /// interrupted.
    pub fn poll(
        &mut self,
        broker: &mut Broker,
        pid: Pid,
        fh: Fh,
        call: PollCall<N, A>,
        now: Instant,
    ) {
        let Some(&client) = self.processes.get(&pid) else {
            return call.answer.not_ready();
        };
        if self.mode == Mode::NotifyAll {
            return self.poll_herd(broker, client, fh, call);
        }
        let PollCall {
            will_wait,
            hold,
            unique,
            waker,
            answer,
        } = call;
        let p = match self.polled.entry(fh) {
            // Waiting or reserved already: it keeps its place in the queue.
            Entry::Occupied(known) => {
                let p = known.into_mut();
                p.waker = waker;
                p
            }
            Entry::Vacant(new) => {
                let mut parked = false;
                let reserved = if will_wait {
                    match broker.acquire(client, fh | POLL_TAG, 1) {
                        Ok(Acquired::Granted) => true,
                        Ok(Acquired::Queued) => false,
                        // It holds the whole pool: it waits for its own
                        // give-back ([`Waiters::unpark`]).
                        Err(PoolError::MoreThanLimit { .. }) => {
                            parked = true;
                            false
                        }
                        Err(_) => return answer.not_ready(),
                    }
                } else {
                    broker.try_acquire(client, 1).unwrap_or(false)
                };
                if !reserved && !will_wait {
                    return answer.not_ready();
                }
                let reserved_until = reserved.then_some(now + RESERVATION);
                new.insert(Polled {
                    queued: !reserved && !parked,
                    reserved_until,
                    parked,
                    ..Polled::new(client, waker)
                })
            }
        };
        if p.reserved_until.is_some() {
            return answer.ready();
        }
        if hold && will_wait && !self.hold.is_zero() && p.held.is_none() {
            p.held = Some(Held {
                unique,
                answer,
                until: now + self.hold,
            });
            return;
        }
        p.sleeps |= will_wait;
        answer.not_ready();
    }

    /// The pipe-like control: ready while a token is free; every poller is
    /// woken when one frees.
    fn poll_herd(&mut self, broker: &mut Broker, client: ClientId, fh: Fh, call: PollCall<N, A>) {
        if broker.pool().free() > 0 {
            return call.answer.ready();
        }
        if call.will_wait {
            self.polled.insert(
                fh,
                Polled {
                    queued: true,
                    sleeps: true,
                    ..Polled::new(client, call.waker)
                },
            );
        }
        call.answer.not_ready();
    }

    /// The handle is closed: its wait ends and its reservation is released.
    pub fn close(&mut self, broker: &mut Broker, fh: Fh) {
        let Some(mut p) = self.polled.remove(&fh) else {
            return;
        };
        p.release_held();
        if self.mode == Mode::NotifyAll {
            return;
        }
        if p.queued {
            broker.cancel(p.client, fh | POLL_TAG);
        }
        if p.reserved_until.is_some() {
            let _ = broker.release(p.client, 1);
        }
    }

    /// The process is gone: every token it held or had reserved comes back.
    /// Returns how many.
    pub fn exited(&mut self, broker: &mut Broker, pid: Pid) -> u32 {
        let Some(client) = self.processes.remove(&pid) else {
            return 0;
        };
        self.reads.retain(|&(c, _), _| c != client);
        // A held poll on a handle it shared is another process's: answered.
        for p in self.polled.values_mut().filter(|p| p.client == client) {
            p.release_held();
        }
        self.polled.retain(|_, p| p.client != client);
        broker.disconnect(client)
    }

    /// Delivers the grants the broker filed for the FUSE file, until none
    /// are left (a reservation released here may grant the next waiter).
    pub fn settle(&mut self, broker: &mut Broker, now: Instant) {
        loop {
            let grants = broker.take_grants(Transport::Fuse);
            if grants.is_empty() {
                break;
            }
            for grant in grants {
                self.deliver(broker, grant, now);
            }
        }
        if self.mode == Mode::NotifyAll && broker.pool().free() > 0 {
            for (_, p) in self.polled.drain() {
                p.waker.wake();
            }
        }
    }

    fn deliver(&mut self, broker: &mut Broker, grant: Grant, now: Instant) {
        if grant.tag & POLL_TAG != 0 {
            match self.polled.get_mut(&(grant.tag & !POLL_TAG)) {
                Some(p) if p.queued => p.reserve(now),
                _ => {
                    let _ = broker.release(grant.client, grant.tokens);
                }
            }
        } else if let Some(read) = self.reads.remove(&(grant.client, grant.tag)) {
            read.reply.token();
        } else {
            let _ = broker.release(grant.client, grant.tokens);
        }
    }

    /// Passes on every reservation not read in time, and answers every
    /// poll held for [`HOLD`] "not ready".
    pub fn expire(&mut self, broker: &mut Broker, now: Instant) {
        for p in self.polled.values_mut() {
            if p.reserved_until.is_some_and(|t| t <= now) {
                p.reserved_until = None;
                let _ = broker.release(p.client, 1);
            }
            if p.held.as_ref().is_some_and(|h| h.until <= now) {
                p.release_held();
                // It sleeps on its handle now, for the token to wake it.
                p.sleeps = true;
            }
        }
        self.polled
            .retain(|_, p| p.queued || p.parked || p.reserved_until.is_some());
    }

    /// When the next reservation or hold runs out.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.polled
            .values()
            .flat_map(|p| [p.reserved_until, p.held.as_ref().map(|h| h.until)])
            .flatten()
            .min()
    }

    /// Threads blocked in a read of the file.
    pub fn blocked_threads(&self) -> impl Iterator<Item = u32> + '_ {
        self.reads.values().map(|r| r.caller.tid)
    }

    /// Fails the blocked reads of thread `tid` with EINTR, as a signal
    /// interrupts a read of a pipe. A FUSE read waits uninterruptibly once
    /// we have it: even a killed thread cannot exit until it is answered.
    /// The kernel tells us through FUSE_INTERRUPT ([`Waiters::interrupted`]);
    /// this is for the caller's scan of pending signals, the safety net.
    pub fn interrupt(&mut self, broker: &mut Broker, tid: u32) {
        self.fail_reads(broker, |caller| caller.tid == tid);
    }

    /// The kernel asks that request `unique` end early (FUSE_INTERRUPT: its
    /// thread got a signal). A blocked read fails with EINTR and leaves the
    /// queue; a held poll is answered "not ready" and keeps its place, for
    /// the poller's next poll. Returns whether it was ours to answer (not
    /// answered already, nor read by a broker before us).
    pub fn interrupted(&mut self, broker: &mut Broker, unique: u64) -> bool {
        if self.fail_reads(broker, |caller| caller.unique == unique) > 0 {
            return true;
        }
        let held = self
            .polled
            .values_mut()
            .find(|p| p.held.as_ref().is_some_and(|h| h.unique == unique));
        held.is_some_and(Polled::release_held)
    }

    /// Fails the blocked reads `which` picks with EINTR; returns how many.
    fn fail_reads(&mut self, broker: &mut Broker, which: impl Fn(&Caller) -> bool) -> usize {
        let keys: Vec<_> = self
            .reads
            .iter()
            .filter(|(_, r)| which(&r.caller))
            .map(|(&k, _)| k)
            .collect();
        for &(client, tag) in &keys {
            broker.cancel(client, tag);
            if let Some(read) = self.reads.remove(&(client, tag)) {
                read.reply.fail(libc::EINTR);
            }
        }
        keys.len()
    }

    /// Takes the token reserved on `fh`, if any, for `client`.
    fn take_reservation(&mut self, broker: &mut Broker, client: ClientId, fh: Fh) -> bool {
        let Some(p) = self.polled.get_mut(&fh) else {
            return false;
        };
        if p.reserved_until.take().is_none() {
            return false;
        }
        let owner = p.client;
        self.polled.remove(&fh);
        if owner == client {
            return true;
        }
        // A handle shared by two processes: the token was counted to the
        // one that polled; move it to the one that reads.
        let _ = broker.release(owner, 1);
        broker.try_acquire(client, 1).unwrap_or(false)
    }

    /// Tokens a client took and may give back: what it holds, less its
    /// reservations.
    fn taken(&self, broker: &Broker, client: ClientId) -> u32 {
        let reserved = self
            .polled
            .values()
            .filter(|p| p.client == client && p.reserved_until.is_some())
            .count() as u32;
        broker.pool().held_by(client).saturating_sub(reserved)
    }

    /// A tag for a blocking read not in use by the client: reads of one
    /// process may wait in several threads at once.
    fn read_tag(&self, client: ClientId) -> Tag {
        (0..)
            .find(|t| !self.reads.contains_key(&(client, *t)))
            .expect("fewer than 2^63 reads")
    }
}

fn errno_of(e: &PoolError) -> i32 {
    match e {
        // Waiting for more than the pool can ever give would never end.
        PoolError::MoreThanLimit { .. } => libc::EDEADLK,
        PoolError::OverRelease { .. } => libc::ENOSPC,
        _ => libc::EINVAL,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;

    type Log = Rc<RefCell<Vec<String>>>;

    struct Reply(Log, &'static str);
    impl ReadReply for Reply {
        fn token(self) {
            self.0.borrow_mut().push(format!("{} token", self.1));
        }
        fn fail(self, errno: i32) {
            self.0
                .borrow_mut()
                .push(format!("{} errno {errno}", self.1));
        }
    }

    struct Waker(Log, &'static str);
    impl PollWaker for Waker {
        fn handle(&self) -> u64 {
            0
        }
        fn wake(&self) {
            self.0.borrow_mut().push(format!("{} woken", self.1));
        }
    }

    /// A poll's answer: into the log, and into the cell, which tells a
    /// test that expects an answer at once what it was.
    struct Answer(Log, &'static str, Rc<Cell<Option<bool>>>);
    impl PollAnswer for Answer {
        fn ready(self) {
            self.2.set(Some(true));
            self.0.borrow_mut().push(format!("{} ready", self.1));
        }
        fn not_ready(self) {
            self.2.set(Some(false));
            self.0.borrow_mut().push(format!("{} not ready", self.1));
        }
    }

    struct Fixture {
        broker: Broker,
        waiters: Waiters<Reply, Waker, Answer>,
        log: Log,
        now: Instant,
    }

    impl Fixture {
        fn new(limit: u32, mode: Mode, pids: &[Pid]) -> Self {
            let mut f = Fixture {
                broker: Broker::new(limit).unwrap(),
                waiters: Waiters::new(mode, HOLD),
                log: Log::default(),
                now: Instant::now(),
            };
            for &pid in pids {
                f.waiters.process(&mut f.broker, pid, || {
                    ClientMeta::new(pid, format!("p{pid}"), Transport::Fuse)
                });
            }
            f
        }
        /// Thread 1 holds the one token; then each of `pollers` (its pid
        /// and name) holds a poll, its request id the pid × 10.
        fn polls_held_behind_a_holder(pollers: &[(Pid, &'static str)]) -> Self {
            let pids: Vec<Pid> = std::iter::once(1)
                .chain(pollers.iter().map(|&(pid, _)| pid))
                .collect();
            let mut f = Fixture::new(1, Mode::OneAtATime, &pids);
            f.read(1, 10, false, "holder");
            for &(pid, name) in pollers {
                f.poll_held(pid, Fh::from(pid) * 10, name);
            }
            f
        }
        /// A read by thread `pid` of `pid`; its request id is `fh`.
        fn read(&mut self, pid: Pid, fh: Fh, blocking: bool, name: &'static str) {
            self.waiters.read(
                &mut self.broker,
                pid,
                Caller {
                    tid: pid,
                    unique: fh,
                },
                fh,
                blocking,
                Reply(self.log.clone(), name),
            );
            self.settle();
        }
        /// A poll that is answered at once: whether it is ready. Its answer
        /// is not logged.
        fn poll(&mut self, pid: Pid, fh: Fh, name: &'static str) -> bool {
            let answered = self.call(pid, fh, false, name);
            let ready = answered.get().expect("answered at once");
            self.log.borrow_mut().pop();
            ready
        }
        /// A poll on a file whose builds poll nothing else; its request id
        /// is `fh`. Its answer is logged, when it comes.
        fn poll_held(&mut self, pid: Pid, fh: Fh, name: &'static str) {
            self.call(pid, fh, true, name);
        }
        fn call(
            &mut self,
            pid: Pid,
            fh: Fh,
            hold: bool,
            name: &'static str,
        ) -> Rc<Cell<Option<bool>>> {
            let answered = Rc::new(Cell::new(None));
            let answer = Answer(self.log.clone(), name, answered.clone());
            let call = PollCall {
                will_wait: true,
                hold,
                unique: fh,
                waker: Waker(self.log.clone(), name),
                answer,
            };
            self.waiters.poll(&mut self.broker, pid, fh, call, self.now);
            self.settle();
            answered
        }
        fn write(&mut self, pid: Pid, tokens: u32) -> Result<(), i32> {
            let r = self.waiters.write(&mut self.broker, pid, tokens);
            self.settle();
            r
        }
        fn settle(&mut self) {
            self.waiters.settle(&mut self.broker, self.now);
            self.broker.pool().assert_invariants();
        }
        fn events(&self) -> Vec<String> {
            self.log.borrow_mut().drain(..).collect()
        }
        fn free(&self) -> u32 {
            self.broker.pool().free()
        }
    }

    #[test]
    fn blocking_reads_are_answered_one_per_token_oldest_first() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2, 3]);
        f.read(1, 10, true, "a");
        f.read(2, 20, true, "b");
        f.read(3, 30, true, "c");
        assert_eq!(f.events(), ["a token"]);
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["b token"]);
        f.write(2, 1).unwrap();
        assert_eq!(f.events(), ["c token"]);
    }

    #[test]
    fn a_non_blocking_read_without_a_token_gets_eagain() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2]);
        f.read(1, 10, false, "a");
        f.read(2, 20, false, "b");
        assert_eq!(
            f.events(),
            ["a token", format!("b errno {}", libc::EAGAIN).as_str()]
        );
    }

    #[test]
    fn a_process_gives_back_at_most_what_it_took() {
        let mut f = Fixture::new(2, Mode::OneAtATime, &[1, 2]);
        f.read(1, 10, false, "a");
        assert_eq!(f.write(1, 2), Err(libc::ENOSPC));
        assert_eq!(f.write(2, 1), Err(libc::ENOSPC));
        assert_eq!(f.write(9, 1), Err(libc::ENOSPC), "a process never seen");
        assert_eq!(f.free(), 1);
        f.write(1, 1).unwrap();
        assert_eq!(f.free(), 2);
    }

    #[test]
    fn a_freed_token_wakes_exactly_one_poller_and_is_reserved_for_it() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2, 3]);
        f.read(1, 10, false, "holder");
        assert!(!f.poll(2, 20, "p2"));
        assert!(!f.poll(3, 30, "p3"));
        f.events();
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p2 woken"]);
        // The woken poller sees it ready; the other does not, nor can anyone
        // else read it meanwhile.
        assert!(f.poll(2, 20, "p2"));
        assert!(!f.poll(3, 30, "p3"));
        f.read(1, 10, false, "thief");
        assert_eq!(f.events(), [format!("thief errno {}", libc::EAGAIN)]);
        f.read(2, 20, false, "p2 read");
        assert_eq!(f.events(), ["p2 read token"]);
        assert_eq!(f.free(), 0);
    }

    /// A process that holds the whole pool and polls for one more cannot
    /// be queued (it would wait for itself); its own give-back wakes its
    /// poll, with the token reserved for it, as a pipe's poller is woken
    /// by its own write.
    #[test]
    fn a_poller_holding_the_whole_pool_is_woken_by_its_own_give_back() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1]);
        f.read(1, 10, false, "holder");
        assert!(!f.poll(1, 11, "p1"), "nothing free");
        f.events();
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p1 woken"]);
        assert!(f.poll(1, 11, "p1"), "reserved for it");
        f.read(1, 11, false, "p1 read");
        assert_eq!(f.events(), ["p1 read token"]);
    }

    /// Its give-back queues it behind whoever waited first.
    #[test]
    fn a_poller_holding_the_whole_pool_queues_behind_earlier_waiters() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2]);
        f.read(1, 10, false, "holder");
        assert!(!f.poll(2, 20, "p2"));
        assert!(!f.poll(1, 11, "p1"));
        f.events();
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p2 woken"], "the earlier waiter first");
        f.read(2, 20, false, "p2 read");
        f.events();
        f.write(2, 1).unwrap();
        assert_eq!(f.events(), ["p1 woken"], "then the holder that gave back");
    }

    #[test]
    fn a_reservation_not_read_in_time_passes_to_the_next_waiter() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2, 3]);
        f.read(1, 10, false, "holder");
        f.poll(2, 20, "p2");
        f.poll(3, 30, "p3");
        f.write(1, 1).unwrap();
        f.events();
        assert_eq!(f.waiters.next_deadline(), Some(f.now + RESERVATION));
        assert_eq!(
            f.write(2, 1),
            Err(libc::ENOSPC),
            "a reserved token is not yet taken"
        );
        f.now += RESERVATION;
        f.waiters.expire(&mut f.broker, f.now);
        f.settle();
        assert_eq!(f.events(), ["p3 woken"]);
        f.read(2, 20, false, "late p2");
        assert_eq!(f.events(), [format!("late p2 errno {}", libc::EAGAIN)]);
        f.read(3, 30, false, "p3 read");
        assert_eq!(f.events(), ["p3 read token"]);
    }

    #[test]
    fn a_poll_with_a_free_token_reserves_it_at_once() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2]);
        assert!(f.poll(1, 10, "p1"));
        assert_eq!(f.free(), 0);
        f.read(2, 20, false, "other");
        f.read(1, 10, false, "p1 read");
        assert_eq!(
            f.events(),
            [
                format!("other errno {}", libc::EAGAIN),
                "p1 read token".into()
            ]
        );
    }

    #[test]
    fn closing_a_handle_releases_its_reservation_and_its_place() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2, 3]);
        assert!(f.poll(1, 10, "p1"));
        assert!(!f.poll(2, 20, "p2"));
        f.read(3, 30, true, "blocked");
        f.waiters.close(&mut f.broker, 20);
        f.waiters.close(&mut f.broker, 10);
        f.settle();
        assert_eq!(f.events(), ["blocked token"]);
    }

    #[test]
    fn an_exited_process_returns_taken_and_reserved_tokens() {
        let mut f = Fixture::new(3, Mode::OneAtATime, &[1, 2]);
        f.read(1, 10, false, "a");
        f.read(1, 10, false, "b");
        assert!(f.poll(1, 11, "p1"));
        f.read(2, 20, true, "waiting");
        assert_eq!(f.waiters.exited(&mut f.broker, 1), 3);
        f.settle();
        assert_eq!(f.events(), ["a token", "b token", "waiting token"]);
        assert_eq!(f.free(), 2);
    }

    #[test]
    fn a_killed_blocked_reader_is_answered_and_leaves_the_queue() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2, 3]);
        f.read(1, 10, false, "holder");
        f.read(2, 20, true, "doomed");
        f.read(3, 30, true, "next");
        assert_eq!(f.waiters.blocked_threads().count(), 2);
        f.waiters.interrupt(&mut f.broker, 2);
        f.write(1, 1).unwrap();
        assert_eq!(
            f.events(),
            [
                "holder token".to_string(),
                format!("doomed errno {}", libc::EINTR),
                "next token".into()
            ]
        );
    }

    #[test]
    fn a_held_poll_is_answered_ready_when_its_token_comes_and_nobody_is_woken() {
        let mut f = Fixture::polls_held_behind_a_holder(&[(2, "p2"), (3, "p3")]);
        assert_eq!(f.events(), ["holder token"], "held: no answer yet");
        f.write(1, 1).unwrap();
        assert_eq!(
            f.events(),
            ["p2 ready"],
            "only the first is answered, and no handle is woken"
        );
        f.read(2, 20, false, "p2 read");
        f.write(2, 1).unwrap();
        assert_eq!(f.events(), ["p2 read token", "p3 ready"]);
    }

    #[test]
    fn an_interrupted_held_poll_is_answered_not_ready_and_keeps_its_place() {
        let mut f = Fixture::polls_held_behind_a_holder(&[(2, "p2"), (3, "p3")]);
        f.events();
        assert!(f.waiters.interrupted(&mut f.broker, 20));
        assert!(
            !f.waiters.interrupted(&mut f.broker, 20),
            "answered already: not ours to answer again"
        );
        assert_eq!(f.events(), ["p2 not ready"], "answered once");
        // Its next poll is held again, still ahead of p3.
        f.poll_held(2, 20, "p2 again");
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p2 again ready"]);
    }

    #[test]
    fn an_interrupt_fails_the_blocked_read_it_names() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2, 3]);
        f.read(1, 10, false, "holder");
        f.read(2, 20, true, "doomed");
        f.read(3, 30, true, "next");
        assert!(f.waiters.interrupted(&mut f.broker, 20));
        assert!(
            !f.waiters.interrupted(&mut f.broker, 99),
            "a request we never held"
        );
        f.write(1, 1).unwrap();
        assert_eq!(
            f.events(),
            [
                "holder token".to_string(),
                format!("doomed errno {}", libc::EINTR),
                "next token".into()
            ]
        );
    }

    #[test]
    fn a_poll_held_too_long_is_answered_not_ready_and_its_handle_woken_later() {
        let mut f = Fixture::polls_held_behind_a_holder(&[(2, "p2")]);
        f.events();
        assert_eq!(f.waiters.next_deadline(), Some(f.now + HOLD));
        f.now += HOLD;
        f.waiters.expire(&mut f.broker, f.now);
        assert_eq!(f.events(), ["p2 not ready"]);
        assert_eq!(f.waiters.next_deadline(), None);
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p2 woken"]);
    }

    #[test]
    fn a_second_poll_of_a_held_handle_sleeps_and_is_woken_with_the_first_answered() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2]);
        f.read(1, 10, false, "holder");
        f.poll_held(2, 20, "first");
        assert!(!f.poll(2, 20, "second"));
        f.events();
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["first ready", "second woken"]);
    }

    #[test]
    fn a_handover_answers_held_polls_and_the_successor_wakes_them() {
        let mut f = Fixture::polls_held_behind_a_holder(&[(2, "p2")]);
        f.events();
        let state = f.waiters.hand_over(&mut f.broker);
        assert_eq!(f.events(), ["p2 not ready"]);
        let log = f.log.clone();
        f.waiters =
            Waiters::adopt(state, &f.broker, |_| Waker(log.clone(), "adopted p2"), HOLD).unwrap();
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["adopted p2 woken"]);
    }

    #[test]
    fn a_reservation_crosses_a_handover_and_still_runs_out() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2, 3]);
        f.read(1, 10, false, "holder");
        f.poll(2, 20, "p2");
        f.poll(3, 30, "p3");
        f.events();
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p2 woken"]);
        let handed = f.waiters.hand_over(&mut f.broker);
        let log = f.log.clone();
        f.waiters =
            Waiters::adopt(handed, &f.broker, |_| Waker(log.clone(), "adopted"), HOLD).unwrap();
        assert_eq!(
            f.waiters.hold(),
            HOLD,
            "polls are held as this broker was told"
        );
        assert_eq!(
            f.waiters.next_deadline(),
            Some(f.now + RESERVATION),
            "p2's reservation came along"
        );
        f.read(3, 30, false, "p3 too soon");
        assert_eq!(f.events(), [format!("p3 too soon errno {}", libc::EAGAIN)]);
        f.now += RESERVATION;
        f.waiters.expire(&mut f.broker, f.now);
        f.settle();
        assert_eq!(f.events(), ["adopted woken"], "then it passes to p3");
        f.read(3, 30, false, "p3 read");
        assert_eq!(f.events(), ["p3 read token"]);
    }

    #[test]
    fn two_blocked_reads_of_one_process_are_both_answered() {
        let mut f = Fixture::new(2, Mode::OneAtATime, &[1, 2]);
        f.read(1, 10, false, "h1");
        f.read(1, 11, false, "h2");
        f.events();
        f.read(2, 20, true, "first thread");
        f.read(2, 21, true, "second thread");
        f.write(1, 2).unwrap();
        assert_eq!(f.events(), ["first thread token", "second thread token"]);
        assert_eq!(f.free(), 0);
    }

    #[test]
    fn reading_more_than_the_pool_has_says_edeadlk_and_a_stranger_einval() {
        assert_eq!(
            errno_of(&PoolError::MoreThanLimit { asked: 3, limit: 2 }),
            libc::EDEADLK
        );
        assert_eq!(
            errno_of(&PoolError::OverRelease { asked: 2, held: 1 }),
            libc::ENOSPC
        );
        assert_eq!(
            errno_of(&PoolError::UnknownClient(ClientId(7))),
            libc::EINVAL
        );
    }

    /// A successor takes a lone process polling its own handle, and
    /// refuses processes that are not the broker's FUSE clients of their
    /// pid.
    #[test]
    fn a_successor_takes_consistent_waiters_and_refuses_mismatched_processes() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[2]);
        assert!(f.poll(2, 20, "p2"));
        let handed = f.waiters.hand_over(&mut f.broker);
        let log = f.log.clone();
        let adopted = Waiters::adopt(handed, &f.broker, |_| Waker(log.clone(), "p2"), HOLD);
        assert!(adopted.is_ok(), "one process polling its own handle");

        let mut f = Fixture::new(2, Mode::OneAtATime, &[1, 2]);
        let mut handed = f.waiters.hand_over(&mut f.broker);
        // Each pid named with the other's client: both clients are FUSE
        // clients, neither of that pid.
        let (c1, c2) = (handed.processes[&1], handed.processes[&2]);
        handed.processes.insert(1, c2);
        handed.processes.insert(2, c1);
        let log = f.log.clone();
        let adopted = Waiters::adopt(handed, &f.broker, |_| Waker(log.clone(), "x"), HOLD);
        assert!(adopted.is_err(), "a process named with another's client");
    }

    /// The processes a successor must watch for their exit are every
    /// process using the file.
    #[test]
    fn the_pids_to_watch_are_every_process_using_the_file() {
        let f = Fixture::new(1, Mode::OneAtATime, &[3, 1, 2]);
        let mut pids: Vec<Pid> = f.waiters.pids().collect();
        pids.sort();
        assert_eq!(pids, [1, 2, 3]);
    }

    /// On a mount taken from a killed broker, a process may give back
    /// tokens that broker granted: what is beyond what it took from us is
    /// accepted and thrown away, where a mount of our own refuses it.
    #[test]
    fn a_forgiving_mount_takes_back_more_than_was_taken_and_counts_only_ours() {
        let mut f = Fixture::new(2, Mode::OneAtATime, &[1]);
        f.read(1, 10, false, "a");
        assert_eq!(f.write(1, 2), Err(libc::ENOSPC));
        f.waiters.forgive_strangers();
        assert_eq!(f.write(1, 2), Ok(()));
        assert_eq!(
            f.free(),
            2,
            "the one it took came back, the other is not ours"
        );
    }

    /// A poll that finds a free token reserves it for RESERVATION from
    /// now: it stays the poller's until then.
    #[test]
    fn a_reservation_made_at_once_lasts_its_full_time() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1, 2]);
        assert!(f.poll(1, 10, "p1"));
        assert_eq!(f.waiters.next_deadline(), Some(f.now + RESERVATION));
        f.waiters.expire(&mut f.broker, f.now);
        f.settle();
        f.read(2, 20, false, "other");
        f.read(1, 10, false, "p1 read");
        assert_eq!(
            f.events(),
            [
                format!("other errno {}", libc::EAGAIN),
                "p1 read token".into()
            ]
        );
    }

    /// The pipe-like control answers a poll ready while a token is free.
    #[test]
    fn notify_all_answers_ready_while_a_token_is_free() {
        let mut f = Fixture::new(1, Mode::NotifyAll, &[1]);
        assert!(f.poll(1, 10, "p1"));
    }

    /// Closing a handle whose poll waits takes out that wait, and only
    /// it: a blocked read of the same process keeps its place.
    #[test]
    fn closing_a_polled_handle_leaves_the_same_process_blocked_read_waiting() {
        let mut f = Fixture::new(2, Mode::OneAtATime, &[1, 2]);
        f.read(1, 10, false, "holder");
        f.read(1, 10, false, "holder");
        assert!(!f.poll(2, 20, "p2"));
        f.read(2, 21, true, "p2 read");
        assert_eq!(f.events(), ["holder token", "holder token"]);
        f.waiters.close(&mut f.broker, 20);
        f.settle();
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p2 read token"]);
    }

    /// A process that exits takes its held polls with it, answered, and
    /// leaves the other processes' polls held and in their places.
    #[test]
    fn an_exited_process_answers_its_own_held_polls_and_no_one_elses() {
        let mut f = Fixture::polls_held_behind_a_holder(&[(2, "p2"), (3, "p3")]);
        f.events();
        f.waiters.exited(&mut f.broker, 2);
        f.settle();
        assert_eq!(f.events(), ["p2 not ready"]);
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p3 ready"]);
    }

    /// What a process waits for through a poll is not yet its own: it
    /// may still give back every token it took.
    #[test]
    fn a_process_waiting_in_a_poll_gives_back_all_it_took() {
        let mut f = Fixture::new(2, Mode::OneAtATime, &[1, 2]);
        f.read(1, 10, false, "took");
        f.read(2, 20, false, "other");
        assert!(!f.poll(1, 11, "p1"));
        assert!(f.waiters.polled[&11].queued, "its poll waits");
        assert_eq!(f.write(1, 1), Ok(()));
    }

    /// The waiters' Debug (part of the handover's state, which derives
    /// Debug) shows who waits by number: their replies have none.
    #[test]
    fn the_waiters_debug_shows_their_counts() {
        let mut f = Fixture::new(1, Mode::OneAtATime, &[1]);
        f.poll(1, 10, "p1");
        let shown = format!("{:?}", f.waiters);
        assert!(shown.starts_with("Waiters {"), "{shown}");
        assert!(shown.contains("reads: 0, polled: 1"), "{shown}");
    }

    #[test]
    fn notify_all_keeps_a_waiting_poller_past_a_round_of_expiries() {
        let mut f = Fixture::new(1, Mode::NotifyAll, &[1, 2]);
        f.read(1, 10, false, "holder");
        assert!(!f.poll(2, 20, "p2"));
        f.events();
        f.now += RESERVATION;
        f.waiters.expire(&mut f.broker, f.now);
        f.write(1, 1).unwrap();
        assert_eq!(f.events(), ["p2 woken"]);
    }

    #[test]
    fn notify_all_wakes_every_poller() {
        let mut f = Fixture::new(1, Mode::NotifyAll, &[1, 2, 3]);
        f.read(1, 10, false, "holder");
        assert!(!f.poll(2, 20, "p2"));
        assert!(!f.poll(3, 30, "p3"));
        f.events();
        f.write(1, 1).unwrap();
        let mut woken = f.events();
        woken.sort();
        assert_eq!(woken, ["p2 woken", "p3 woken"]);
    }
}
