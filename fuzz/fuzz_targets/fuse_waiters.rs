//! The FUSE token file's request handling (`fuse::waiters`, the pure part
//! the fuser callbacks call under the broker lock) under any sequence of
//! reads, writes, polls, closes, interrupts, exits, expiring reservations,
//! limit changes and a socket client beside: the pool's invariants hold
//! after every step, a process never gives back more than it read, every
//! blocked read and every held poll is answered once (unless its process
//! is gone), a held poll is answered ready only with a token reserved for
//! it, and when every process has gone every token is free.
#![no_main]

use arbitrary::Arbitrary;
use baton_broker::fuzzing::{
    Broker, Caller, ClientMeta, Fh, Mode, Pid, PollAnswer, PollCall, PollWaker, ReadReply,
    Transport, Waiters, HOLD, RESERVATION,
};
use libfuzzer_sys::fuzz_target;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

#[derive(Debug, Arbitrary)]
enum Op {
    Open {
        pid: u8,
    },
    Read {
        pid: u8,
        tid: u8,
        fh: u8,
        blocking: bool,
    },
    Write {
        pid: u8,
        tokens: u8,
    },
    Poll {
        pid: u8,
        fh: u8,
        will_wait: bool,
        hold: bool,
    },
    Close {
        fh: u8,
    },
    Interrupt {
        tid: u8,
    },
    /// The kernel's FUSE_INTERRUPT for request `unique`.
    Interrupted {
        unique: u8,
    },
    Exit {
        pid: u8,
    },
    Wait {
        ms: u8,
    },
    SetLimit {
        limit: u8,
    },
    SocketAcquire {
        tokens: u8,
    },
    SocketRelease {
        tokens: u8,
    },
}

#[derive(Debug, Arbitrary)]
struct Input {
    limit: u8,
    notify_all: bool,
    /// How long polls are held, in ms; 0: never.
    hold_ms: u8,
    ops: Vec<Op>,
}

/// What the processes saw: tokens each read and has not written back, and
/// reads that were dropped unanswered.
#[derive(Default)]
struct Seen {
    taken: HashMap<Pid, u32>,
    unanswered: Vec<Pid>,
    /// Handles whose polls were answered ready this step: each needs a
    /// token reserved for it, held by a process beyond those it read (by
    /// the one that polled, or, on a handle two processes share, the other).
    ready: Vec<(Pid, Fh)>,
}

type Shared = Rc<RefCell<Seen>>;

struct Reply {
    pid: Pid,
    seen: Shared,
    answered: bool,
}

impl ReadReply for Reply {
    fn token(mut self) {
        *self.seen.borrow_mut().taken.entry(self.pid).or_default() += 1;
        self.answered = true;
    }
    fn fail(mut self, _errno: i32) {
        self.answered = true;
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.answered {
            self.seen.borrow_mut().unanswered.push(self.pid);
        }
    }
}

struct Answer {
    pid: Pid,
    fh: Fh,
    seen: Shared,
    answered: bool,
}

impl PollAnswer for Answer {
    fn ready(mut self) {
        self.seen.borrow_mut().ready.push((self.pid, self.fh));
        self.answered = true;
    }
    fn not_ready(mut self) {
        self.answered = true;
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if !self.answered {
            self.seen.borrow_mut().unanswered.push(self.pid);
        }
    }
}

struct Waker;
impl PollWaker for Waker {
    fn wake(&self) {}
    /// Only a handover reads it; the target hands nothing over.
    fn handle(&self) -> u64 {
        0
    }
}

struct World {
    broker: Broker,
    waiters: Waiters<Reply, Waker, Answer>,
    /// The next request id.
    unique: u64,
    /// The herd control: a poll is ready while a token is free, reserved
    /// for nobody.
    notify_all: bool,
    seen: Shared,
    now: Instant,
    /// The socket client beside the FUSE processes, and what it holds and
    /// waits for.
    socket: baton_core::ClientId,
    socket_held: u32,
    socket_waits: bool,
}

impl World {
    fn apply(&mut self, op: Op) {
        let pid = |p: u8| Pid::from(p % 4) + 1;
        let fh = |f: u8| Fh::from(f % 6);
        match op {
            Op::Open { pid: p } => {
                let p = pid(p);
                self.waiters.process(&mut self.broker, p, || {
                    ClientMeta::new(p, format!("p{p}"), Transport::Fuse)
                });
            }
            Op::Read {
                pid: p,
                tid,
                fh: f,
                blocking,
            } => {
                let reply = Reply {
                    pid: pid(p),
                    seen: self.seen.clone(),
                    answered: false,
                };
                let caller = Caller {
                    tid: u32::from(tid % 8),
                    unique: self.next_unique(),
                };
                self.waiters
                    .read(&mut self.broker, pid(p), caller, fh(f), blocking, reply);
            }
            Op::Write { pid: p, tokens } => {
                let (p, tokens) = (pid(p), u32::from(tokens % 4));
                let taken = self.seen.borrow().taken.get(&p).copied().unwrap_or(0);
                if self.waiters.write(&mut self.broker, p, tokens).is_ok() {
                    assert!(
                        tokens <= taken,
                        "pid {p} gave back {tokens} tokens having read {taken}"
                    );
                    self.seen.borrow_mut().taken.insert(p, taken - tokens);
                }
            }
            Op::Poll {
                pid: p,
                fh: f,
                will_wait,
                hold,
            } => {
                let answer = Answer {
                    pid: pid(p),
                    fh: fh(f),
                    seen: self.seen.clone(),
                    answered: false,
                };
                let call = PollCall {
                    will_wait,
                    hold,
                    unique: self.next_unique(),
                    waker: Waker,
                    answer,
                };
                self.waiters
                    .poll(&mut self.broker, pid(p), fh(f), call, self.now);
            }
            Op::Interrupted { unique } => {
                // One of the last 16 requests, or one never sent.
                let unique = self.unique.saturating_sub(u64::from(unique % 17));
                self.waiters.interrupted(&mut self.broker, unique);
            }
            Op::Close { fh: f } => self.waiters.close(&mut self.broker, fh(f)),
            Op::Interrupt { tid } => self.waiters.interrupt(&mut self.broker, u32::from(tid % 8)),
            Op::Exit { pid: p } => {
                let p = pid(p);
                self.waiters.exited(&mut self.broker, p);
                self.seen.borrow_mut().taken.remove(&p);
                // Its blocked reads and held polls go with it.
                self.seen.borrow_mut().unanswered.retain(|&u| u != p);
                self.seen.borrow_mut().ready.retain(|&(u, _)| u != p);
            }
            Op::Wait { ms } => {
                self.now += Duration::from_millis(u64::from(ms));
                self.waiters.expire(&mut self.broker, self.now);
            }
            Op::SetLimit { limit } => {
                let _ = self.broker.set_limit(u32::from(limit % 8) + 1);
            }
            Op::SocketAcquire { tokens } if !self.socket_waits => {
                match self
                    .broker
                    .acquire(self.socket, 0, u32::from(tokens % 3) + 1)
                {
                    Ok(baton_core::Acquired::Granted) => {
                        self.socket_held += u32::from(tokens % 3) + 1
                    }
                    Ok(baton_core::Acquired::Queued) => self.socket_waits = true,
                    Err(_) => {}
                }
            }
            Op::SocketRelease { tokens } => {
                let tokens = u32::from(tokens % 3) + 1;
                if self.broker.release(self.socket, tokens).is_ok() {
                    self.socket_held -= tokens;
                }
            }
            Op::SocketAcquire { .. } => {}
        }
        self.settle();
    }

    fn next_unique(&mut self) -> u64 {
        self.unique += 1;
        self.unique
    }

    /// What the FUSE threads and the socket loop do after every request.
    fn settle(&mut self) {
        self.waiters.settle(&mut self.broker, self.now);
        for g in self.broker.take_grants(Transport::Socket) {
            assert!(
                self.socket_waits && g.client == self.socket,
                "a socket grant nobody asked for: {g:?}"
            );
            self.socket_waits = false;
            self.socket_held += g.tokens;
        }
    }

    fn check(&mut self) {
        let pool = self.broker.pool();
        pool.assert_invariants();
        assert_eq!(
            pool.held_by(self.socket),
            self.socket_held,
            "the socket client holds other than it was granted"
        );
        let mut seen = self.seen.borrow_mut();
        assert!(
            seen.unanswered.is_empty(),
            "reads or polls of live processes {:?} were dropped unanswered",
            seen.unanswered
        );
        let mut unread = 0;
        for c in pool.clients().filter(|c| c.id != self.socket) {
            let taken = seen.taken.get(&c.meta.pid).copied().unwrap_or(0);
            assert!(
                c.held >= taken,
                "pid {} read {taken} tokens but holds {}",
                c.meta.pid,
                c.held
            );
            unread += c.held - taken;
        }
        let mut ready: Vec<Fh> = seen.ready.drain(..).map(|(_, fh)| fh).collect();
        ready.sort_unstable();
        ready.dedup();
        assert!(
            self.notify_all || ready.len() as u32 <= unread,
            "handles {ready:?} were told a token is ready, but only {unread} are reserved"
        );
    }
}

fuzz_target!(|input: Input| {
    let Ok(mut broker) = Broker::new(u32::from(input.limit % 8) + 1) else {
        return;
    };
    let socket = broker.connect(ClientMeta::new(
        0,
        "socket client".into(),
        Transport::Socket,
    ));
    let mode = if input.notify_all {
        Mode::NotifyAll
    } else {
        Mode::OneAtATime
    };
    let mut world = World {
        broker,
        waiters: Waiters::new(
            mode,
            Duration::from_millis(u64::from(input.hold_ms % 4) * 100),
        ),
        unique: 0,
        notify_all: input.notify_all,
        seen: Shared::default(),
        now: Instant::now(),
        socket,
        socket_held: 0,
        socket_waits: false,
    };
    for op in input.ops {
        world.apply(op);
        world.check();
    }
    // Every reservation and hold runs out, every process and the socket
    // client go.
    world.now += RESERVATION.max(HOLD);
    world.waiters.expire(&mut world.broker, world.now);
    for pid in 1..=4 {
        world.waiters.exited(&mut world.broker, pid);
    }
    world.broker.disconnect(socket);
    world.seen.borrow_mut().unanswered.clear();
    let pool = world.broker.pool();
    pool.assert_invariants();
    assert_eq!(
        (pool.free(), pool.held()),
        (pool.limit(), 0),
        "tokens missing after every process left"
    );
});
