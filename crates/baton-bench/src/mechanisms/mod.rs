//! The ways a process can wait for a token, each behind the same two traits
//! so that every scenario runs every mechanism with one piece of code.
//!
//! A [`Pool`] is created by the parent before the benchmark processes are
//! forked (a pipe, a semaphore in shared memory, a broker process); each
//! process or thread then [`Pool::open`]s its own [`Tokens`] handle on it.
//! A new way in (baton's FUSE token file) is one more variant and one more
//! module.

pub mod baton;
mod eventfd;
mod fastpath;
mod fuse;
mod futex;
mod pile;
mod pipe;
mod semaphore;

use anyhow::Result;
use std::path::PathBuf;

/// A waiting mechanism under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    /// A pipe holding one byte per token; blocking `read` takes one. Since
    /// Linux 5.6 only one blocked reader wakes per byte (commit 0ddad21d3e).
    PipeBlocking,
    /// The same pipe, O_NONBLOCK, waited on with poll() as GNU make ≥ 4.3
    /// and bmake do: every poller wakes on every byte.
    PipePoll,
    /// An unnamed process-shared POSIX semaphore (a futex underneath).
    PosixSemaphore,
    /// A System V semaphore (sembench's).
    SysvSemaphore,
    /// An eventfd in EFD_SEMAPHORE mode: each read takes one.
    Eventfd,
    /// A counting semaphore on a bare futex word: FUTEX_WAKE of 1 per token.
    Futex,
    /// First come, first served on bare futexes: a ticket per acquire and a
    /// word per ticket, each release waking exactly the oldest waiter. The
    /// floor under any FIFO hand-off, the fast path's included.
    FutexFifo,
    /// baton's native protocol: each waiter blocks on its own connection.
    BatonNative,
    /// The same with the broker's adaptive spin turned off (`--spin-us 0`):
    /// a control measured in the same run, so the spin's effect is seen.
    BatonNativeNoSpin,
    /// The same with replies written before the broker sleeps, in two
    /// system calls, instead of one io_uring call (`--no-io-uring`): the
    /// control for that.
    BatonNativeNoUring,
    /// baton's native protocol waited on with poll(), as an event loop would.
    BatonPoll,
    /// baton's shared-memory fast path as built so far: the region's ring
    /// and its futexes, with no broker yet (docs/fastpath.md).
    FastpathRing,
    /// The fast path's barging mode, the pile, with no broker yet: any
    /// process takes any free token, as with a semaphore, and each token's
    /// word names its holder (docs/fastpath.md, "The pile").
    FastpathPile,
    /// baton's fast path served by a broker: every process a client of one
    /// build, with a seat in its region (docs/fastpath.md).
    BatonFastpath,
    /// The same with the build's region a pile (`FASTPATH 2`): tokens in
    /// no order, as with a semaphore (docs/fastpath.md, "The pile").
    BatonFastpathPile,
    /// baton's FUSE token file, polled as GNU make 4.4 polls its jobserver:
    /// the broker notifies one poller per freed token.
    BatonFuse,
    /// The same file with the broker notifying every poller: the herd, as a
    /// control measured in the same run.
    BatonFuseNotifyAll,
}

impl Mechanism {
    /// The name shown in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::PipeBlocking => "pipe, blocking read",
            Mechanism::PipePoll => "pipe, poll + non-blocking read",
            Mechanism::PosixSemaphore => "POSIX semaphore",
            Mechanism::SysvSemaphore => "SysV semaphore",
            Mechanism::Eventfd => "eventfd semaphore",
            Mechanism::Futex => "futex, FUTEX_WAKE 1",
            Mechanism::FutexFifo => "futex, FIFO hand-off",
            Mechanism::BatonNative => "baton native",
            Mechanism::BatonNativeNoSpin => "baton native, no spin",
            Mechanism::BatonNativeNoUring => "baton native, no io_uring",
            Mechanism::BatonPoll => "baton native, poll",
            Mechanism::FastpathRing => "baton fast path, ring only (no broker)",
            Mechanism::FastpathPile => "baton fast path, pile only (no broker)",
            Mechanism::BatonFastpath => "baton fast path",
            Mechanism::BatonFastpathPile => "baton fast path, pile",
            Mechanism::BatonFuse => "baton FUSE file, poll",
            Mechanism::BatonFuseNotifyAll => "baton FUSE file, notify-all",
        }
    }

    pub fn is_baton(self) -> bool {
        matches!(
            self,
            Mechanism::BatonNative
                | Mechanism::BatonNativeNoSpin
                | Mechanism::BatonNativeNoUring
                | Mechanism::BatonPoll
                | Mechanism::BatonFastpath
                | Mechanism::BatonFastpathPile
                | Mechanism::BatonFuse
                | Mechanism::BatonFuseNotifyAll
        )
    }

    /// The most waiters it serves, if it has a bound: a broker's region
    /// seats 1024 clients of a build (more would use the socket).
    pub fn max_waiters(self) -> Option<usize> {
        matches!(
            self,
            Mechanism::BatonFastpath | Mechanism::BatonFastpathPile
        )
        .then_some(1024)
    }

    /// Whether this machine can run it (FUSE needs /dev/fuse).
    pub fn available(self) -> bool {
        !matches!(self, Mechanism::BatonFuse | Mechanism::BatonFuseNotifyAll) || fuse::available()
    }

    /// Whether giving back a token one does not hold creates one. Every
    /// kernel counter does; baton refuses, since only its limit makes tokens.
    pub fn mints_on_release(self) -> bool {
        !self.is_baton() && !matches!(self, Mechanism::FastpathRing | Mechanism::FastpathPile)
    }

    /// A pool of `tokens` free tokens.
    pub fn create(self, tokens: u32, env: &Env) -> Result<Box<dyn Pool>> {
        Ok(match self {
            Mechanism::PipeBlocking => Box::new(pipe::Pipe::new(tokens, pipe::Wait::Blocking)?),
            Mechanism::PipePoll => Box::new(pipe::Pipe::new(tokens, pipe::Wait::Poll)?),
            Mechanism::PosixSemaphore => Box::new(semaphore::Posix::new(tokens)?),
            Mechanism::SysvSemaphore => Box::new(semaphore::Sysv::new(tokens)?),
            Mechanism::Eventfd => Box::new(eventfd::Eventfd::new(tokens)?),
            Mechanism::Futex => Box::new(futex::Futex::new(tokens)?),
            Mechanism::FutexFifo => Box::new(futex::FifoFutex::new(tokens)?),
            Mechanism::BatonNative => Box::new(baton::BrokerProcess::start(
                tokens,
                env,
                baton::Wait::Blocking,
            )?),
            Mechanism::BatonNativeNoSpin => Box::new(baton::BrokerProcess::start_with(
                tokens,
                env,
                baton::Wait::Blocking,
                &["--no-fuse", "--spin-us", "0"],
            )?),
            Mechanism::BatonNativeNoUring => Box::new(baton::BrokerProcess::start_with(
                tokens,
                env,
                baton::Wait::Blocking,
                &["--no-fuse", "--no-io-uring"],
            )?),
            Mechanism::BatonPoll => {
                Box::new(baton::BrokerProcess::start(tokens, env, baton::Wait::Poll)?)
            }
            Mechanism::FastpathRing => Box::new(fastpath::Region::new(tokens)?),
            Mechanism::FastpathPile => Box::new(pile::Region::new(tokens)?),
            Mechanism::BatonFastpath => Box::new(baton::BrokerProcess::start(
                tokens,
                env,
                baton::Wait::Fastpath,
            )?),
            Mechanism::BatonFastpathPile => Box::new(baton::BrokerProcess::start(
                tokens,
                env,
                baton::Wait::FastpathPile,
            )?),
            Mechanism::BatonFuse => {
                Box::new(fuse::TokenFile::start(tokens, env, fuse::Notify::One)?)
            }
            Mechanism::BatonFuseNotifyAll => {
                Box::new(fuse::TokenFile::start(tokens, env, fuse::Notify::All)?)
            }
        })
    }
}

/// What the mechanisms need from outside.
#[derive(Debug, Clone)]
pub struct Env {
    /// The `baton` binary, for `baton serve`.
    pub baton_bin: PathBuf,
    /// A private directory for sockets.
    pub tmp: PathBuf,
}

/// A mechanism's shared state, created before the benchmark processes fork.
pub trait Pool: Sync {
    /// This process's (or thread's) handle on the pool.
    fn open(&self) -> Result<Box<dyn Tokens + '_>>;

    /// A producer's handle, to put new tokens in.
    fn open_waker(&self) -> Result<Box<dyn Waker + '_>> {
        Ok(Box::new(Minting(self.open()?)))
    }

    /// The broker process to measure beside the benchmark processes.
    fn broker_pid(&self) -> Option<libc::pid_t> {
        None
    }
}

/// A producer of work: puts `n` new tokens in, each for one waiter, who
/// uses it up ([`Tokens::use_up`]) instead of giving it back.
pub trait Waker {
    fn add(&mut self, n: u32) -> Result<()>;
}

/// A kernel counter makes a token by giving back one nobody took.
struct Minting<'a>(Box<dyn Tokens + 'a>);

impl Waker for Minting<'_> {
    fn add(&mut self, n: u32) -> Result<()> {
        self.0.release(n)
    }
}

/// One process's or thread's way to take and give back tokens.
pub trait Tokens {
    /// Blocks until `n` tokens are this handle's.
    fn acquire(&mut self, n: u32) -> Result<()>;

    /// Gives back `n` tokens.
    fn release(&mut self, n: u32) -> Result<()>;

    /// Gives back `n` tokens and waits for `n` again: the loop of every job
    /// runner. A broker client sends both in one message (one wake-up of the
    /// broker instead of two).
    fn cycle(&mut self, n: u32) -> Result<()> {
        self.release(n)?;
        self.acquire(n)
    }

    /// Lets go of a token a [`Waker`] added: a kernel counter's is simply
    /// gone; a broker's must be given back, and retires since the limit
    /// went back down.
    fn use_up(&mut self) -> Result<()> {
        Ok(())
    }
}
