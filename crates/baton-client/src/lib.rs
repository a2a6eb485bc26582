//! Rust client for the baton token broker.
//!
//! ```no_run
//! let mut client = baton_client::Client::connect_default("my-tool")?;
//! let token = client.token()?; // blocks until the broker grants one
//! // ... run one job ...
//! drop(token); // gives it back
//! # Ok::<(), baton_client::Error>(())
//! ```
//!
//! Tokens belong to the connection: if the process dies, the broker takes
//! them back when the socket closes, so nothing leaks however it ends.
#![deny(missing_docs)]

pub mod fastpath;

use baton_core::fastpath::ring as fastpath_ring;
use baton_core::fastpath::{pile, Host, Notice, Refused, Ring, Seat};
use baton_core::protocol::{self, ErrorCode, Reply, ReplyHead, Request};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

pub use baton_core::paths::default_socket_path;
pub use baton_core::status::Status;

/// What can go wrong talking to the broker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Nothing listens at the socket path.
    #[error("no broker at {path} (start one with: baton serve --jobs N)")]
    NoBroker {
        /// The socket path tried.
        path: PathBuf,
    },
    /// The path exists but is not a socket.
    #[error("{path} is not a socket (is --socket or BATON_SOCKET right?)")]
    NotASocket {
        /// The path tried.
        path: PathBuf,
    },
    /// The socket or its directory is not ours.
    #[error("permission denied connecting to {path} (the broker belongs to another user? its owner admits others with baton serve --allow-uid UID or --allow-group GROUP)")]
    PermissionDenied {
        /// The path tried.
        path: PathBuf,
    },
    /// The process answering at the socket runs as another user: it is
    /// not our broker, and could lie about tokens or read our commands.
    #[error("{path} is answered by a process of uid {owner}, not by your own broker (uid {me}) or root's: refusing to talk to it (someone else's broker or an impostor; remove the socket or choose another --socket; if it is the broker you mean to use, seen from a user namespace or run by a CI runner's user, say so with BATON_BROKER_UID={owner})")]
    NotOurBroker {
        /// The socket path tried.
        path: PathBuf,
        /// The uid the kernel says the peer runs as.
        owner: u32,
        /// Our own uid.
        me: u32,
    },
    /// The socket's directory is one baton picks itself, but it is not a
    /// private directory of ours (squatted by another user, or a link).
    #[error("{0}")]
    UnsafeDirectory(String),
    /// The broker serves as many clients as it can (`ERR full`).
    #[error("the broker at {path} serves its maximum of {} clients (try again when some finish, or raise it: baton serve --max-clients N, and the broker's open-file limit)", max.map_or("its".to_string(), |n| n.to_string()))]
    Full {
        /// The socket path.
        path: PathBuf,
        /// The maximum, as the broker said it.
        max: Option<u64>,
    },
    /// The broker does not serve our uid (`ERR denied`).
    #[error("the broker at {path} refuses you: {message}")]
    Denied {
        /// The socket path.
        path: PathBuf,
        /// The broker's explanation.
        message: String,
    },
    /// The broker refused a request.
    #[error("broker refused: {message} ({code})")]
    Refused {
        /// The protocol's error code.
        code: ErrorCode,
        /// The broker's explanation.
        message: String,
    },
    /// The broker closed the connection (it stopped, or was killed).
    #[error("the broker closed the connection")]
    Disconnected,
    /// The broker sent something this client does not understand.
    #[error("unexpected reply from broker: {0}")]
    Protocol(String),
    /// Any other I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: io::Error,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// A connection to the broker. Tokens acquired through it are held until
/// released or until the connection closes.
#[derive(Debug)]
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    id: u64,
    limit: u32,
    /// Tokens the broker's books hold on this connection.
    held: u32,
    /// A seat in the fast path, once [`Client::enable_fastpath`] got one.
    fast: Option<Fast>,
}

/// This client's seat in its build's fast-path region.
#[derive(Debug)]
struct Fast {
    mapping: fastpath::Mapping,
    seat: Seat,
    /// Tokens held through the region (its record says the same).
    held: u32,
    /// The region is a pile: `tokens` are the words this client holds.
    pile: bool,
    tokens: Vec<usize>,
}

impl std::os::fd::AsFd for Client {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.writer.as_fd()
    }
}

impl Client {
    /// Connects to the broker at `path` and says hello. `label` is shown by
    /// `baton status` (a command line, say); at most 200 bytes, no newlines.
    pub fn connect(path: impl AsRef<Path>, label: &str) -> Result<Self> {
        let path = path.as_ref();
        refuse_squatted_dir(path)?;
        let stream = UnixStream::connect(path).map_err(|e| connect_error(path, e))?;
        refuse_other_users_broker(path, &stream)?;
        let writer = stream
            .try_clone()
            .map_err(|e| io_error("cloning the socket", e))?;
        let mut client = Client {
            reader: BufReader::new(stream),
            writer,
            id: 0,
            limit: 0,
            held: 0,
            fast: None,
        };
        let label: String = label
            .chars()
            .filter(|c| !c.is_control())
            .take(protocol::MAX_LABEL)
            .collect();
        let label = truncate_bytes(&label, protocol::MAX_LABEL);
        let hello = Request::Hello {
            version: protocol::VERSION,
            label: label.to_string(),
        };
        // A broker that refuses us (full, or not our uid) answers at once
        // and closes; our HELLO may then fail to send, but its answer is
        // there to read.
        let sent = client.send(&hello);
        let reply = client.read_reply().map_err(|e| match sent {
            Err(sent) if matches!(e, Error::Disconnected) => sent,
            _ => e,
        });
        match reply.map_err(|e| at_connect(path, e))? {
            Reply::Hello {
                client: id, limit, ..
            } => {
                client.id = id;
                client.limit = limit;
                Ok(client)
            }
            other => Err(unexpected(other)),
        }
    }

    /// Connects to the broker at [`default_socket_path`].
    pub fn connect_default(label: &str) -> Result<Self> {
        Self::connect(default_socket_path(), label)
    }

    /// The broker's id for this connection.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The pool's limit when this connection was made.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Tokens this connection holds (through the fast path too).
    pub fn held(&self) -> u32 {
        self.held + self.fast.as_ref().map_or(0, |f| f.held)
    }

    /// Asks the broker for a seat in the shared-memory fast path
    /// (docs/fastpath.md): from then on `acquire(1)`, `try_acquire(1)`
    /// and `release` take and give tokens in memory shared with the
    /// broker and the build's other fast-path clients, with no system call
    /// unless someone must be woken. `Ok(false)`, with the broker's
    /// reason, when it offers none (another user's broker, an old one, a
    /// full region): the client goes on over the socket. Do not use the
    /// client in a child after `fork`: the region is not mapped there.
    pub fn enable_fastpath(&mut self) -> Result<std::result::Result<(), String>> {
        self.ask_for_a_seat(protocol::FASTPATH_VERSION)
    }

    /// As [`Client::enable_fastpath`], in a pile (docs/fastpath.md, "The
    /// pile"): a freed token goes to whoever comes for it first, not to
    /// the oldest waiter, as with a semaphore. A waiter can be passed over
    /// for as long as others keep coming back; in exchange a hand-off
    /// wakes nobody when the releaser itself comes back for a token. Every
    /// fast-path client of a build uses the same kind of region: the first
    /// one's choice stands, and a client asking for the other kind is
    /// refused (it stays on the socket).
    pub fn enable_fastpath_pile(&mut self) -> Result<std::result::Result<(), String>> {
        self.ask_for_a_seat(protocol::FASTPATH_PILE)
    }

    /// FASTPATH `version`, and the region that comes with its answer.
    fn ask_for_a_seat(&mut self, version: u32) -> Result<std::result::Result<(), String>> {
        if self.fast.is_some() {
            return Ok(Ok(()));
        }
        if self.has_buffered_reply() {
            return Err(Error::Protocol(
                "a reply is unread; FASTPATH must come alone".into(),
            ));
        }
        self.send(&Request::Fastpath(version))?;
        let (line, fd) = fastpath::receive_with_fd(&self.writer)
            .map_err(|e| io_error("reading the FASTPATH reply", e))?;
        let reply = match protocol::parse_reply_line(line.trim_end_matches('\n')) {
            Ok(ReplyHead::Complete(reply)) => reply,
            _ => return Err(Error::Protocol(format!("bad reply to FASTPATH: {line:?}"))),
        };
        match (reply, fd) {
            (Reply::Fastpath { seat, bytes }, Some(fd)) => {
                let seat = u16::try_from(seat)
                    .map_err(|_| Error::Protocol(format!("seat {seat} out of range")))?;
                let mapping = fastpath::Mapping::map(std::os::fd::AsFd::as_fd(&fd))
                    .map_err(|e| Error::Protocol(format!("the broker's region: {e}")))?;
                let mapped = mapping.words().len() * 8;
                if mapped != bytes as usize {
                    return Err(Error::Protocol(format!(
                        "the broker said its region is {bytes} bytes, and it is {mapped}"
                    )));
                }
                let pile = version == protocol::FASTPATH_PILE;
                if mapping.is_pile() != pile {
                    return Err(Error::Protocol(format!(
                        "FASTPATH {version} came with a region of the other layout"
                    )));
                }
                self.fast = Some(Fast {
                    mapping,
                    seat: Seat(seat),
                    held: 0,
                    pile,
                    tokens: Vec::new(),
                });
                Ok(Ok(()))
            }
            (Reply::Fastpath { .. }, None) => Err(Error::Protocol(
                "FASTPATH came without the region's descriptor".into(),
            )),
            (
                Reply::Err {
                    code: ErrorCode::Unavailable,
                    message,
                },
                _,
            ) => Ok(Err(message)),
            (Reply::Err { code, message }, _) => Err(Error::Refused { code, message }),
            (other, _) => Err(unexpected(other)),
        }
    }

    /// Whether this client has a fast-path seat it can still use.
    pub fn uses_fastpath(&self) -> bool {
        self.fast.is_some()
    }

    /// One step on the fast path, if this client has a seat: `None` when
    /// it must use the socket instead (no seat, or the region refused:
    /// nothing changed there). A seat revoked, or a region whose broker is
    /// gone, is given up: what it held is the connection's (the broker
    /// booked it there when it revoked the seat).
    fn on_fastpath<T>(
        &mut self,
        op: impl FnOnce(&Ring, Seat, &dyn Host) -> std::result::Result<T, Refused>,
    ) -> Option<T> {
        let fast = self.fast.as_ref().filter(|f| !f.pile)?;
        let host = Sleeper {
            socket: &self.writer,
            mapping: &fast.mapping,
        };
        let outcome = if host.gone() {
            Err(Refused::Gone)
        } else {
            op(&fast.mapping.ring(), fast.seat, &host)
        };
        match outcome {
            Ok(done) => Some(done),
            Err(Refused::Busy | Refused::Full | Refused::NothingHeld) => None,
            Err(Refused::Revoked | Refused::Gone | Refused::Corrupt) => {
                self.leave_the_fastpath();
                None
            }
        }
    }

    /// The seat is gone (revoked, or its broker is): what it held is the
    /// connection's now (the broker booked it there).
    fn leave_the_fastpath(&mut self) {
        if let Some(fast) = self.fast.take() {
            self.held += fast.held;
        }
    }

    /// An acquire of one token on a pile, if this client has a seat in
    /// one: `None` when it must use the socket (no pile, nothing free for
    /// a TRY, or its broker gone).
    fn acquire_on_pile(&mut self, try_only: bool) -> Option<()> {
        let Client { writer, fast, .. } = self;
        let fast = fast.as_mut().filter(|f| f.pile)?;
        let host = Sleeper {
            socket: writer,
            mapping: &fast.mapping,
        };
        let got = if pile::Bell::gone(&host) {
            Err(pile::Refused::Gone)
        } else {
            fast.mapping
                .pile()
                .acquire(fast.seat, &host, None, try_only)
        };
        match got {
            Ok(pile::Acquired::Token(i)) => {
                fast.tokens.push(i);
                fast.held += 1;
                Some(())
            }
            Ok(pile::Acquired::TimedOut) | Err(pile::Refused::Busy) => None,
            Err(pile::Refused::Gone | pile::Refused::NotHeld) => {
                self.leave_the_fastpath();
                None
            }
        }
    }

    /// A release of one token held on a pile: back on the pile, or to the
    /// broker if it recalled it (it is told). `None` when this client
    /// holds none there, or its broker is gone.
    fn release_on_pile(&mut self) -> Option<()> {
        let Client { writer, fast, .. } = self;
        let fast = fast.as_mut().filter(|f| f.pile)?;
        let &token = fast.tokens.last()?;
        let host = Sleeper {
            socket: writer,
            mapping: &fast.mapping,
        };
        let released = if pile::Bell::gone(&host) {
            Err(pile::Refused::Gone)
        } else {
            fast.mapping.pile().release(fast.seat, token, &host)
        };
        match released {
            Ok(how) => {
                if how == pile::Released::ToBroker {
                    host.tell(Notice::Returned);
                }
                fast.tokens.pop();
                fast.held -= 1;
                Some(())
            }
            Err(_) => {
                self.leave_the_fastpath();
                None
            }
        }
    }

    /// Blocks until `n` tokens are granted.
    pub fn acquire(&mut self, n: u32) -> Result<()> {
        if n == 1 && self.acquire_on_pile(false).is_some() {
            return Ok(());
        }
        if n == 1 {
            let got = self.on_fastpath(|ring, seat, host| ring.acquire(seat, host, None));
            if let Some(got) = got {
                debug_assert_eq!(got, fastpath_ring::Acquired::Token, "no deadline");
                self.fast.as_mut().expect("used above").held += 1;
                return Ok(());
            }
        }
        match self.call(&Request::Acquire(n))? {
            Reply::Granted { held, .. } => {
                self.held = held;
                Ok(())
            }
            other => Err(unexpected(other)),
        }
    }

    /// Takes `n` tokens if they are free now; `Ok(false)` if not.
    pub fn try_acquire(&mut self, n: u32) -> Result<bool> {
        if n == 1 && self.acquire_on_pile(true).is_some() {
            return Ok(true);
        }
        if n == 1 && self.on_fastpath(|ring, seat, host| ring.try_acquire(seat, host)) == Some(()) {
            self.fast.as_mut().expect("used above").held += 1;
            return Ok(true);
        }
        match self.call(&Request::Try(n))? {
            Reply::Granted { held, .. } => {
                self.held = held;
                Ok(true)
            }
            Reply::Busy { .. } => Ok(false),
            other => Err(unexpected(other)),
        }
    }

    /// Tells a new broker that this client already holds `n` tokens a
    /// broker that went away granted (re-attaching after a crash).
    pub fn hold(&mut self, n: u32) -> Result<()> {
        match self.call(&Request::Hold(n))? {
            Reply::Granted { held, .. } => {
                self.held = held;
                Ok(())
            }
            other => Err(unexpected(other)),
        }
    }

    /// Gives back `n` tokens: those held through the fast path first.
    /// More than the connection holds goes to the broker whole: its books
    /// count only the socket's tokens, so it refuses (over-release) and
    /// nothing was given back anywhere, as over the socket alone.
    pub fn release(&mut self, n: u32) -> Result<()> {
        let mut left = n;
        let within = n <= self.held();
        while within && left > 0 && self.fast.as_ref().is_some_and(|f| f.held > 0) {
            if self.fast.as_ref().is_some_and(|f| f.pile) {
                if self.release_on_pile().is_none() {
                    break;
                }
                left -= 1;
                continue;
            }
            if self
                .on_fastpath(|ring, seat, host| ring.release(seat, host))
                .is_none()
            {
                break;
            }
            self.fast.as_mut().expect("used above").held -= 1;
            left -= 1;
        }
        if left == 0 && n > 0 {
            return Ok(());
        }
        match self.call(&Request::Release(left))? {
            Reply::Released { held, .. } => {
                self.held = held;
                Ok(())
            }
            other => Err(unexpected(other)),
        }
    }

    /// Blocks until one token is granted and returns it as a value that
    /// gives it back when dropped.
    pub fn token(&mut self) -> Result<Token<'_>> {
        self.acquire(1)?;
        Ok(Token { client: self })
    }

    /// The broker's state.
    pub fn status(&mut self) -> Result<Status> {
        match self.call(&Request::Status)? {
            Reply::Status { json } => serde_json::from_str(&json)
                .map_err(|e| Error::Protocol(format!("bad status JSON: {e}"))),
            other => Err(unexpected(other)),
        }
    }

    /// Takes up to `n` tokens, as many as are free, if nobody waits (TRY,
    /// then TRY of what the broker said was free); returns how many.
    pub fn try_up_to(&mut self, n: u32) -> Result<u32> {
        match self.call(&Request::Try(n))? {
            Reply::Granted { held, .. } => {
                self.held = held;
                Ok(n)
            }
            Reply::Busy { free } if free > 0 && free < n => {
                Ok(if self.try_acquire(free)? { free } else { 0 })
            }
            Reply::Busy { .. } => Ok(0),
            other => Err(unexpected(other)),
        }
    }

    /// Starts a build (as `baton run` does): clients started under this
    /// process join it, and its share of a busy pool is in proportion to
    /// `weight`. Returns the weight the build has (a `baton run` inside
    /// another stays in the outer build, with its weight).
    pub fn start_build(&mut self, weight: u32, name: &str) -> Result<u32> {
        match self.call(&Request::Build {
            weight,
            name: name.to_string(),
        })? {
            Reply::Build { weight, .. } => Ok(weight),
            other => Err(unexpected(other)),
        }
    }

    /// Tokens that other builds wait for, and tokens free now.
    pub fn wanted(&mut self) -> Result<(u32, u32)> {
        match self.call(&Request::Wanted)? {
            Reply::Wanted { tokens, free } => Ok((tokens, free)),
            other => Err(unexpected(other)),
        }
    }

    /// Tells the broker that `bytes` stray bytes were taken out of this
    /// build's jobserver (bytes the pool never lent); returns the build's
    /// count so far.
    pub fn stray(&mut self, bytes: u32) -> Result<u32> {
        match self.call(&Request::Stray(bytes))? {
            Reply::Stray { total } => Ok(total),
            other => Err(unexpected(other)),
        }
    }

    /// Asks the broker to stop, as SIGTERM would: its pid, the builds that
    /// carry on without it, and the tokens they hold. Waits until the
    /// broker has closed this connection; it then exits (it still holds
    /// its lock until its files are removed).
    pub fn stop(mut self) -> Result<Stopping> {
        let stopping = match self.call(&Request::Stop)? {
            Reply::Stopping { pid, builds, held } => Stopping { pid, builds, held },
            other => return Err(unexpected(other)),
        };
        let mut rest = Vec::new();
        let _ = self.reader.read_to_end(&mut rest);
        Ok(stopping)
    }

    /// Changes the pool's limit; returns the old one.
    pub fn set_limit(&mut self, limit: u32) -> Result<u32> {
        match self.call(&Request::Limit(limit))? {
            Reply::Limit { old, new } => {
                self.limit = new;
                Ok(old)
            }
            other => Err(unexpected(other)),
        }
    }

    /// Sets one gate of the broker (`mem-available` in bytes,
    /// `mem-pressure` in percent, `load` in runnable tasks, `min-jobs`);
    /// None turns it off. Returns its threshold now.
    pub fn set_gate(&mut self, name: &str, value: Option<f64>) -> Result<Option<f64>> {
        match self.call(&Request::Gate {
            name: name.to_string(),
            value,
        })? {
            Reply::Gate { value, .. } => Ok(value),
            other => Err(unexpected(other)),
        }
    }

    /// Sends one request without waiting for its reply. With
    /// [`Client::read_reply`] this lets a caller wait in its own poll loop
    /// (see [`Client::as_raw_fd`]) or cancel a pending ACQUIRE.
    pub fn send(&mut self, request: &Request) -> Result<()> {
        let line = format!("{request}\n");
        self.writer
            .write_all(line.as_bytes())
            .map_err(|e| stream_error("sending a request", e))
    }

    /// Reads the next reply. `ERR` replies come back as [`Error::Refused`].
    /// Updates [`Client::held`] from GRANTED and RELEASED.
    pub fn read_reply(&mut self) -> Result<Reply> {
        if !self.has_buffered_reply() {
            self.wait_readable()?;
        }
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .map_err(|e| stream_error("reading a reply", e))?;
        if n == 0 || !line.ends_with('\n') {
            return Err(Error::Disconnected);
        }
        let head = protocol::parse_reply_line(line.trim_end_matches('\n'))
            .map_err(|e| Error::Protocol(e.0))?;
        let reply = match head {
            ReplyHead::Complete(reply) => reply,
            ReplyHead::StatusFollows(len) => Reply::Status {
                json: self.read_status_body(len)?,
            },
        };
        match reply {
            Reply::Err { code, message } => Err(Error::Refused { code, message }),
            Reply::Granted { held, .. } | Reply::Released { held, .. } => {
                self.held = held;
                Ok(reply)
            }
            reply => Ok(reply),
        }
    }

    /// The socket's file descriptor, readable when a reply has arrived.
    /// Replies may already be buffered: check [`Client::has_buffered_reply`]
    /// before polling. (Also as a borrowed descriptor: `AsFd`.)
    pub fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.writer.as_raw_fd()
    }

    /// Whether bytes of a reply are already buffered (so polling the socket
    /// might wait for something that has already arrived).
    pub fn has_buffered_reply(&self) -> bool {
        !self.reader.buffer().is_empty()
    }

    /// Sleeps in poll() until the reply arrives, rather than in read().
    /// Measured (`baton bench mass-poll`): a client woken inside read()
    /// costs about 1.5 more context switches per grant, its own and the
    /// broker's, than one woken from poll() that then reads.
    fn wait_readable(&self) -> Result<()> {
        let mut fd = libc::pollfd {
            fd: self.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        loop {
            // SAFETY: one valid pollfd, for the duration of the call.
            if unsafe { libc::poll(&mut fd, 1, -1) } >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(io_error("waiting for a reply", e));
            }
        }
    }

    fn read_status_body(&mut self, len: usize) -> Result<String> {
        let mut body = vec![0; len + 1];
        self.reader
            .read_exact(&mut body)
            .map_err(|e| stream_error("reading status", e))?;
        if body.pop() != Some(b'\n') {
            return Err(Error::Protocol(
                "status body not followed by a newline".into(),
            ));
        }
        String::from_utf8(body).map_err(|_| Error::Protocol("status body is not UTF-8".into()))
    }

    fn call(&mut self, request: &Request) -> Result<Reply> {
        self.send(request)?;
        self.read_reply()
    }
}

/// The fast path's host for a client: futexes on the region's words,
/// NUDGE on the socket, and the broker's liveness word. A sleeper wakes
/// now and then to look at that word: a broker killed while it sleeps
/// cannot wake it.
struct Sleeper<'a> {
    socket: &'a UnixStream,
    mapping: &'a fastpath::Mapping,
}

/// How long a fast-path waiter sleeps before it looks whether the broker
/// still lives (a wake-up a second per sleeper, at most).
const LOOK_AT_THE_BROKER_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Host for Sleeper<'_> {
    fn wait(
        &self,
        word: &std::sync::atomic::AtomicU64,
        expected: u32,
        deadline: Option<std::time::Instant>,
    ) {
        let look = std::time::Instant::now() + LOOK_AT_THE_BROKER_EVERY;
        let until = deadline.map_or(look, |d| d.min(look));
        fastpath::futex_wait(word, expected, Some(until));
    }

    fn wake(&self, word: &std::sync::atomic::AtomicU64) {
        fastpath::futex_wake(word);
    }

    fn tell(&self, _: Notice) {
        // Either notice asks the same: look at the region. A broker that
        // is gone is found at the next operation.
        let _ = (&*self.socket).write_all(b"NUDGE\n");
    }

    fn gone(&self) -> bool {
        !self.mapping.broker_alive()
    }
}

/// On a pile, the same futexes on its bell; a client about to sleep while
/// the pile is closed tells the broker, which asks the pool for a token on
/// its behalf.
impl pile::Bell for Sleeper<'_> {
    fn wait(
        &self,
        word: &std::sync::atomic::AtomicU64,
        expected: u32,
        deadline: Option<std::time::Instant>,
    ) {
        let closed = self.mapping.pile().closed();
        if closed.load(std::sync::atomic::Ordering::SeqCst) != 0 {
            self.tell(Notice::Waiting);
        }
        Host::wait(self, word, expected, deadline);
    }

    fn wake_one(&self, word: &std::sync::atomic::AtomicU64) -> bool {
        fastpath::futex_wake_one(word)
    }

    fn gone(&self) -> bool {
        Host::gone(self)
    }
}

/// What a broker said as it stopped ([`Client::stop`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopping {
    /// The broker's pid.
    pub pid: u32,
    /// Builds holding or waiting for tokens: they carry on without it.
    pub builds: u32,
    /// Tokens they held.
    pub held: u32,
}

/// One token, given back to the broker when dropped.
#[derive(Debug)]
pub struct Token<'a> {
    client: &'a mut Client,
}

impl Token<'_> {
    /// Gives the token back now, reporting any error (drop ignores them:
    /// the broker reclaims tokens of a broken connection anyway).
    pub fn release(self) -> Result<()> {
        let result = self.client.release(1);
        std::mem::forget(self); // already released: Drop must not release again
        result
    }
}

impl Drop for Token<'_> {
    fn drop(&mut self) {
        let _ = self.client.release(1);
    }
}

fn truncate_bytes(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn connect_error(path: &Path, e: io::Error) -> Error {
    let path = path.to_path_buf();
    if is_not_a_socket(&path) {
        return Error::NotASocket { path };
    }
    match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => Error::NoBroker { path },
        io::ErrorKind::PermissionDenied => Error::PermissionDenied { path },
        _ => Error::Io {
            context: format!("connecting to {}", path.display()),
            source: e,
        },
    }
}

/// A refusal at connect, in words that name the broker.
fn at_connect(path: &Path, e: Error) -> Error {
    match e {
        Error::Refused {
            code: ErrorCode::Full,
            message,
        } => Error::Full {
            path: path.to_path_buf(),
            max: first_number(&message),
        },
        Error::Refused {
            code: ErrorCode::Denied,
            message,
        } => Error::Denied {
            path: path.to_path_buf(),
            message,
        },
        e => e,
    }
}

/// The first decimal number in `text` (the maximum in `ERR full`).
fn first_number(text: &str) -> Option<u64> {
    text.split(|c: char| !c.is_ascii_digit())
        .find(|w| !w.is_empty())
        .and_then(|w| w.parse().ok())
}

/// Refuses a socket in one of baton's own directories (`/tmp/baton-$UID`,
/// `$XDG_RUNTIME_DIR/baton`) unless that directory is a private one of
/// ours: another user may have made it first (docs/security.md).
fn refuse_squatted_dir(socket: &Path) -> Result<()> {
    let dir = baton_core::paths::private_dir(socket);
    if !baton_core::paths::is_default_private_dir(&dir) {
        return Ok(());
    }
    let Ok(meta) = std::fs::symlink_metadata(&dir) else {
        return Ok(()); // no directory, no broker: connect says so
    };
    match baton_core::paths::private_dir_problem(&dir, (&meta).into(), my_uid(), true) {
        Some(problem) => Err(Error::UnsafeDirectory(problem)),
        None => Ok(()),
    }
}

/// Refuses to talk to a process of another user (SO_PEERCRED: the uid the
/// peer had when it listened), however the socket got where it is.
fn refuse_other_users_broker(path: &Path, stream: &UnixStream) -> Result<()> {
    let owner = peer_uid(stream).map_err(|e| Error::Io {
        context: format!("asking who serves {}", path.display()),
        source: e,
    })?;
    let me = my_uid();
    if baton_core::paths::trusts_broker_of(owner, me) {
        Ok(())
    } else {
        Err(Error::NotOurBroker {
            path: path.to_path_buf(),
            owner,
            me,
        })
    }
}

fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid for writes of the sizes given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(cred.uid)
    } else {
        Err(io::Error::last_os_error())
    }
}

fn my_uid() -> u32 {
    // SAFETY: getuid cannot fail and touches no memory.
    unsafe { libc::getuid() }
}

fn is_not_a_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path)
        .map(|m| !m.file_type().is_socket())
        .unwrap_or(false)
}

fn stream_error(context: &str, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::UnexpectedEof => Error::Disconnected,
        _ => io_error(context, e),
    }
}

fn io_error(context: &str, source: io::Error) -> Error {
    Error::Io {
        context: context.to_string(),
        source,
    }
}

fn unexpected(reply: Reply) -> Error {
    Error::Protocol(format!("{reply:?}"))
}

/// Tells the broker that every user of the FUSE token file at `path` polls
/// it alone (as GNU make ≥ 4.4 and the jobserver crate do), so that a poll
/// that would wait is held until a token is there: one wake-up per token
/// instead of an answer, a notification and a second poll. Not for a
/// client that polls the file beside other descriptors (bmake, an event
/// loop): a held poll sees nothing else until a token comes or its thread
/// gets a signal. See [`baton_core::protocol::FUSE_POLLS_XATTR`].
///
/// # Errors
/// The file is not on a broker's mount, or the broker predates held polls
/// (`ENOTSUP`): the file then works as before.
pub fn hold_polls(path: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let name = std::ffi::CString::new(protocol::FUSE_POLLS_XATTR).expect("no NUL in the name");
    let value = protocol::FUSE_POLLS_HOLD;
    // SAFETY: both strings are NUL-terminated and outlive the call; the
    // value is read for its length only.
    let rc = unsafe {
        libc::setxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
