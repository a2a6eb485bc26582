//! baton's native protocol: a `baton serve` process started for the
//! measurement, and one connection per waiting process or thread.

use super::{Env, Pool, Tokens, Waker};
use crate::sys;
use anyhow::{bail, Context, Result};
use baton_client::Client;
use baton_core::protocol::{Reply, Request};
use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How long a fresh broker may take to answer.
const STARTUP: Duration = Duration::from_secs(10);
/// How long a broker may take to stop after SIGTERM before it is killed.
const SHUTDOWN: Duration = Duration::from_secs(3);

/// How a client waits for its grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// A blocking read on the connection.
    Blocking,
    /// poll() on the connection, then read: what a client with an event loop
    /// (GNU make's pselect) would do. Only this connection becomes readable.
    Poll,
    /// The shared-memory fast path (docs/fastpath.md): each client asks for
    /// a seat in its build's region; the bench's processes are one build.
    Fastpath,
    /// The same in a pile (docs/fastpath.md, "The pile").
    FastpathPile,
}

impl Wait {
    fn fastpath(self) -> bool {
        matches!(self, Wait::Fastpath | Wait::FastpathPile)
    }
}

/// A `baton serve` child process, stopped when dropped.
pub struct BrokerProcess {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    wait: Wait,
    /// For the fast path: a connection that started a build, kept open, so
    /// that the bench's processes (its children) are one build and share
    /// one region.
    root: Option<Client>,
}

impl BrokerProcess {
    /// A broker without a FUSE mount, for the native protocol.
    pub fn start(tokens: u32, env: &Env, wait: Wait) -> Result<Self> {
        Self::start_with(tokens, env, wait, &["--no-fuse"])
    }

    /// A broker started with extra `serve` flags, in a directory of its own
    /// (its FUSE mount, if any, is `<that directory>/fuse`).
    pub fn start_with(tokens: u32, env: &Env, wait: Wait, flags: &[&str]) -> Result<Self> {
        Self::start_under(tokens, env, wait, flags, &[])
    }

    /// The same, started through `wrapper` (a command that ends by running
    /// its arguments, such as one that enters a cgroup first).
    pub fn start_under(
        tokens: u32,
        env: &Env,
        wait: Wait,
        flags: &[&str],
        wrapper: &[&str],
    ) -> Result<Self> {
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let n = STARTED.fetch_add(1, Relaxed);
        let dir = env.tmp.join(format!("broker-{n}"));
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("socket");
        let log = env.tmp.join(format!("broker-{n}.log"));
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&env.baton_bin);
                c
            }
            None => Command::new(&env.baton_bin),
        };
        command
            .args([
                "serve",
                "--quiet",
                "--jobs",
                &tokens.to_string(),
                "--socket",
            ])
            .arg(&socket)
            .args(flags);
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        // SAFETY: prctl is async-signal-safe and touches only the child.
        unsafe {
            // The broker must not outlive an interrupted bench.
            command.pre_exec(|| {
                sys::check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM)).map(drop)
            });
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {} serve", env.baton_bin.display()))?;
        let mut broker = BrokerProcess {
            child,
            socket,
            log,
            wait,
            root: None,
        };
        broker.wait_until_answering()?;
        if wait.fastpath() {
            let mut root = Client::connect(&broker.socket, "baton bench")?;
            root.start_build(1, "baton bench")?;
            broker.root = Some(root);
        }
        Ok(broker)
    }

    fn wait_until_answering(&mut self) -> Result<()> {
        let deadline = Instant::now() + STARTUP;
        loop {
            if Client::connect(&self.socket, "baton bench probe").is_ok() {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "baton serve exited ({status}) before answering: {}",
                    self.log_text()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "baton serve did not answer at {} within {STARTUP:?}: {}",
                    self.socket.display(),
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The socket the broker listens on.
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// Waits until every one of the broker's `tokens` is free again (a
    /// build's `baton run` gives its tokens back as it exits, and the broker
    /// may read that a moment later); an error if some never come back.
    pub fn check_all_free(&self, tokens: u32) -> Result<()> {
        let mut client = Client::connect(&self.socket, "baton bench check")?;
        let deadline = Instant::now() + STARTUP;
        loop {
            let (_, free) = client.wanted()?;
            if free == tokens {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} of the broker's {tokens} tokens are still out {STARTUP:?} after the build ended", tokens - free.min(tokens));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .trim()
            .to_string()
    }
}

/// Brokers kept running across a bench's builds, one per token count and
/// set of `serve` flags, as a machine-wide broker would be: a build then
/// pays what it pays under a running broker, not the broker's start nor
/// `baton run`'s first look at the build's tools (remembered beside the
/// socket, docs/jobserver.md).
pub struct Brokers<'a> {
    env: &'a Env,
    running: HashMap<(u32, Vec<String>), BrokerProcess>,
}

impl<'a> Brokers<'a> {
    pub fn new(env: &'a Env) -> Self {
        Brokers {
            env,
            running: HashMap::new(),
        }
    }

    /// The broker of `tokens` started with `flags`, started now if it is
    /// the first asked for.
    pub fn get(&mut self, tokens: u32, flags: &[&str]) -> Result<&BrokerProcess> {
        let key = (tokens, flags.iter().map(|f| f.to_string()).collect());
        if !self.running.contains_key(&key) {
            let broker = BrokerProcess::start_with(tokens, self.env, Wait::Blocking, flags)?;
            self.running.insert(key.clone(), broker);
        }
        Ok(&self.running[&key])
    }

    /// The `baton` binary the brokers run, for `baton run`.
    pub fn baton_bin(&self) -> &std::path::Path {
        &self.env.baton_bin
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        // SAFETY: signalling our own child, not yet reaped by us.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + SHUTDOWN;
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

impl Pool for BrokerProcess {
    fn open(&self) -> Result<Box<dyn Tokens + '_>> {
        let mut client = Client::connect(&self.socket, "baton bench")?;
        if self.wait.fastpath() {
            let seat = if self.wait == Wait::FastpathPile {
                client.enable_fastpath_pile()?
            } else {
                client.enable_fastpath()?
            };
            if let Err(why) = seat {
                bail!("the broker offers no fast path: {why}");
            }
            return Ok(Box::new(Seated { client }));
        }
        Ok(Box::new(Connection {
            client,
            unread_releases: 0,
            wait: self.wait,
        }))
    }

    /// The producer holds the pool's one base token (a broker started with
    /// `--jobs 1`), so only its raises free any. On the fast path it holds
    /// every token instead, taken through the region: see [`Stock`].
    fn open_waker(&self) -> Result<Box<dyn Waker + '_>> {
        let mut client = Client::connect(&self.socket, "baton bench producer")?;
        if self.wait == Wait::Fastpath {
            return Ok(Box::new(Stock::take_all(client)?));
        }
        client.acquire(1)?;
        Ok(Box::new(LimitRaiser { client }))
    }

    fn broker_pid(&self) -> Option<libc::pid_t> {
        Some(self.child.id() as libc::pid_t)
    }
}

/// baton's way to add tokens: only the limit makes them.
struct LimitRaiser {
    client: Client,
}

impl LimitRaiser {
    /// A raise with fewer than n waiters queued would leave tokens free,
    /// and the lowering right after would take them away again: wait for
    /// the takers (a waiter just served may still be on its way back).
    /// Asked with WANTED (the tokens other builds wait for: each waiter
    /// is a build of its own, asking for one), not STATUS, whose cost
    /// grows with the waiters listed and would be measured as the broker's.
    fn wait_for_waiters(&mut self, n: u32) -> Result<()> {
        while self.client.wanted()?.0 < n {
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }
}

impl Waker for LimitRaiser {
    /// LIMIT +n then back in one write: the broker grants n waiters, then
    /// retires those n tokens as they come back.
    fn add(&mut self, n: u32) -> Result<()> {
        self.wait_for_waiters(n)?;
        let base = self.client.limit();
        let text = format!("{}\n{}\n", Request::Limit(base + n), Request::Limit(base));
        sys::write_all(self.client.as_raw_fd(), text.as_bytes())
            .context("writing to the broker")?;
        for _ in 0..2 {
            self.client.read_reply()?;
        }
        Ok(())
    }
}

/// The fast path's producer. A region cannot retire a token (a lowered
/// limit closes it only a round later, and until then a waiter's release
/// is a hand-off that wakes another waiter: docs/fastpath.md, "Left
/// open"), so the broker is started with every token the run will hand
/// out, the producer takes them all through the region before the run
/// starts, and each waiter keeps what it is woken with ([`Seated`]'s
/// `use_up`). Each token the producer adds is then one release in the
/// region: a hand-off to the oldest claim and a `futex_wake` of exactly
/// that waiter, which is what bulk-wake measures.
struct Stock {
    client: Client,
}

impl Stock {
    fn take_all(mut client: Client) -> Result<Self> {
        if let Err(why) = client.enable_fastpath()? {
            bail!("the broker offers no fast path: {why}");
        }
        for _ in 0..client.limit() {
            client.acquire(1)?;
        }
        Ok(Stock { client })
    }
}

impl Waker for Stock {
    fn add(&mut self, n: u32) -> Result<()> {
        Ok(self.client.release(n)?)
    }
}

/// One client of the broker. Releases are sent without waiting for their
/// reply (it is read before the next grant), so giving back never blocks,
/// just as writing a byte to a pipe does not.
struct Connection {
    client: Client,
    unread_releases: u32,
    wait: Wait,
}

impl Connection {
    /// Sends requests in one write, so the broker wakes once for them all.
    fn send(&mut self, requests: &[Request]) -> Result<()> {
        let text: String = requests.iter().map(|r| format!("{r}\n")).collect();
        sys::write_all(self.client.as_raw_fd(), text.as_bytes()).context("writing to the broker")
    }

    fn next_reply(&mut self) -> Result<Reply> {
        if self.wait == Wait::Poll && !self.client.has_buffered_reply() {
            sys::poll_readable(self.client.as_raw_fd(), -1)
                .context("polling the broker connection")?;
        }
        Ok(self.client.read_reply()?)
    }

    /// Reads the replies to earlier releases, then the grant.
    fn await_grant(&mut self) -> Result<()> {
        loop {
            match self.next_reply()? {
                Reply::Released { .. } if self.unread_releases > 0 => self.unread_releases -= 1,
                Reply::Granted { .. } if self.unread_releases == 0 => return Ok(()),
                other => bail!("unexpected reply from the broker: {other:?}"),
            }
        }
    }
}

impl Tokens for Connection {
    fn acquire(&mut self, n: u32) -> Result<()> {
        self.send(&[Request::Acquire(n)])?;
        self.await_grant()
    }

    fn release(&mut self, n: u32) -> Result<()> {
        self.send(&[Request::Release(n)])?;
        self.unread_releases += 1;
        Ok(())
    }

    fn cycle(&mut self, n: u32) -> Result<()> {
        self.send(&[Request::Release(n), Request::Acquire(n)])?;
        self.unread_releases += 1;
        self.await_grant()
    }

    fn use_up(&mut self) -> Result<()> {
        self.release(1)
    }
}

/// A client with a seat in its build's region: a token taken or given in
/// shared memory, the broker woken only when its policy must decide.
struct Seated {
    client: Client,
}

impl Tokens for Seated {
    fn acquire(&mut self, n: u32) -> Result<()> {
        (0..n).try_for_each(|_| self.client.acquire(1))?;
        Ok(())
    }

    fn release(&mut self, n: u32) -> Result<()> {
        Ok(self.client.release(n)?)
    }

    /// Kept: a release would hand the token to the next waiter, a wake the
    /// producer did not cause. The producer started with every token the
    /// run hands out ([`Stock`]), so none has to come back.
    fn use_up(&mut self) -> Result<()> {
        Ok(())
    }
}
