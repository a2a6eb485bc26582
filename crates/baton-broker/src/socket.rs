//! The native transport: a Unix stream socket speaking docs/protocol.md.
//!
//! One thread runs a mio loop over the listener, every connection, a waker
//! (other transports' grants for our clients) and a signalfd (SIGTERM,
//! SIGINT). A waiting client blocks in read() on its own connection, so a
//! grant wakes exactly that process: the broker never broadcasts.

use crate::admission::{Access, Admission};
use crate::broker::{Broker, BrokerState, ClientMeta, Transport};
use crate::log;
use crate::spin::SpinPolicy;
use crate::uring::{SendAndWait, Sent};
use baton_core::protocol::{self, ErrorCode, Reply, Request, MAX_LINE};
use baton_core::{Acquired, ClientId, Grant, PoolError};
use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use nix::sys::signalfd::SignalFd;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
pub const WAKER: Token = Token(2);
const HANDOVER: Token = Token(3);
const FIRST_CONN: usize = 4;

/// The tag of a socket client's one pending ACQUIRE. A connection is
/// sequential, so it never has two.
const ACQUIRE_TAG: u64 = 0;

/// A client that does not read its replies cannot make the broker buffer
/// without end: past this much unsent output its requests are no longer
/// read (the kernel's socket buffer then stops its writes) until it reads.
const MAX_UNSENT: usize = 1 << 20;

/// At most this many connections at once unless told otherwise
/// (`--max-clients`); more get `ERR full`. Bounded by the file descriptor
/// limit, which `serve` raises to its hard maximum.
pub const MAX_CLIENTS: usize = 60_000;

/// Replies sent in the system call that sleeps; more go out by plain writes
/// first (a burst, such as a raised limit waking many clients at once).
const SEND_BATCH: u32 = 63;
/// Output longer than this (a STATUS listing a thousand clients) is
/// written before the loop sleeps, not sent by io_uring in the same call
/// as the sleep: a send that fills the socket leaves the rest for a
/// WRITABLE event, and the sleep in that call could not wait for one.
/// Grants and other one-line replies are far shorter.
const SEND_WITH_SLEEP_MAX: usize = 4096;

struct Conn {
    stream: UnixStream,
    pid: u32,
    /// Its uid (SO_PEERCRED), and what that lets it do.
    uid: u32,
    access: Access,
    client: Option<ClientId>,
    inbuf: Vec<u8>,
    outbuf: Vec<u8>,
    /// An ACQUIRE is pending: only CANCEL is allowed until it is answered.
    waiting: bool,
    /// A fatal error was sent: flush, then close.
    closing: bool,
    /// What the connection is registered for; changed only when needed,
    /// since each change is a system call.
    interest: Interest,
    /// Its output waits to be sent with the loop's next sleep.
    unsent: bool,
}

/// A connection as a successor broker receives it (crate::handover): what
/// it read but has not yet acted on (a partial line), what it has yet to
/// send, and whether its ACQUIRE waits. `fd` is its descriptor's index
/// among those passed.
#[derive(Debug, Serialize, Deserialize)]
pub struct ConnState {
    pub fd: usize,
    pid: u32,
    client: Option<ClientId>,
    inbuf: Vec<u8>,
    outbuf: Vec<u8>,
    waiting: bool,
    closing: bool,
}

/// Why the loop stopped.
pub enum Stop {
    /// SIGTERM or SIGINT, by name.
    Signal(&'static str),
    /// A successor asks for our state (crate::handover).
    Handover(std::os::unix::net::UnixStream),
    /// A client said STOP (`baton stop`); its pid.
    Asked(u32),
}

/// The socket server's state. Created by `serve`, run on its own thread.
pub struct SocketServer {
    poll: Poll,
    listener: UnixListener,
    signals: SignalFd,
    broker: Arc<Mutex<Broker>>,
    conns: HashMap<Token, Conn>,
    by_client: HashMap<ClientId, Token>,
    next_token: usize,
    spin: SpinPolicy,
    /// Connections written to since the last wait: clients likely woken.
    replied: usize,
    /// Sends replies in the system call that sleeps (crate::uring), where
    /// io_uring is available.
    sender: Option<SendAndWait>,
    /// Connections whose output waits for the next sleep, in order.
    unsent: Vec<Token>,
    /// More connections than this get `ERR full`.
    max_clients: usize,
    /// Where a successor asks for our state (crate::handover).
    handover: Option<std::os::unix::net::UnixListener>,
    /// The pid of a client that said STOP: the loop ends after this round.
    stop_asked: Option<u32>,
    /// Who may connect.
    admission: Admission,
    /// A descriptor kept in reserve: out of descriptors, it is closed for a
    /// moment so that one more connection can be accepted and told
    /// `ERR full`, rather than left waiting in the backlog.
    spare_fd: Option<std::fs::File>,
}

impl SocketServer {
    /// `io_uring`: send replies in the system call that sleeps, where the
    /// kernel allows (crate::uring).
    pub fn new(
        listener: std::os::unix::net::UnixListener,
        signals: SignalFd,
        broker: Arc<Mutex<Broker>>,
        spin: SpinPolicy,
        io_uring: bool,
        max_clients: usize,
        admission: Admission,
    ) -> io::Result<(Self, Arc<Waker>)> {
        let poll = Poll::new()?;
        listener.set_nonblocking(true)?;
        let mut listener = UnixListener::from_std(listener);
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        poll.registry().register(
            &mut SourceFd(&signals.as_raw_fd()),
            SIGNALS,
            Interest::READABLE,
        )?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let sender = if io_uring {
            io_uring_sender(&poll)
        } else {
            None
        };
        let server = SocketServer {
            poll,
            listener,
            signals,
            broker,
            conns: HashMap::new(),
            by_client: HashMap::new(),
            next_token: FIRST_CONN,
            spin,
            replied: 0,
            sender,
            unsent: Vec::new(),
            max_clients,
            handover: None,
            stop_asked: None,
            admission,
            spare_fd: std::fs::File::open("/dev/null").ok(),
        };
        Ok((server, waker))
    }

    /// Listens for a successor (crate::handover) on `listener`.
    pub fn watch_handover(&mut self, listener: std::os::unix::net::UnixListener) -> io::Result<()> {
        self.poll.registry().register(
            &mut SourceFd(&listener.as_raw_fd()),
            HANDOVER,
            Interest::READABLE,
        )?;
        self.handover = Some(listener);
        Ok(())
    }

    /// Serves until SIGTERM or SIGINT, or until a successor asks for our
    /// state; always between two rounds, with every grant delivered.
    pub fn run(&mut self) -> io::Result<Stop> {
        let mut events = Events::with_capacity(1024);
        let mut successor = None;
        loop {
            if let Some(stream) = successor.take() {
                return Ok(Stop::Handover(stream));
            }
            match self.wait(&mut events) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.accept_all(),
                    SIGNALS => {
                        if let Some(name) = self.stop_signal() {
                            return Ok(Stop::Signal(name));
                        }
                    }
                    HANDOVER => successor = successor.or_else(|| self.accept_successor()),
                    WAKER => {}
                    token => self.serve_conn(token),
                }
            }
            // Grants caused by this round (ours or other transports').
            self.deliver_grants();
            if let Some(pid) = self.stop_asked {
                return Ok(Stop::Asked(pid));
            }
        }
    }

    /// Waits for events, spinning first if recent waits were short
    /// (crate::spin says when and why).
    fn wait(&mut self, events: &mut Events) -> io::Result<()> {
        let started = Instant::now();
        let replied = std::mem::take(&mut self.replied);
        let broker = &self.broker;
        // The broker lock is taken only when the waits before say spin.
        let spin = self
            .spin
            .spin_for(|| replied.max(broker.lock().expect("broker lock").pool().held() as usize));
        if spin.is_zero() {
            if self.unsent.is_empty() {
                self.poll.poll(events, None)?;
            } else {
                self.send_and_wait(events)?;
            }
            self.spin.waited(started.elapsed(), false, false);
            return Ok(());
        }
        let unsent = std::mem::take(&mut self.unsent);
        self.write_held(unsent);
        let before = preemptions();
        let caught = self.spin_wait(events, started, spin)?;
        let preempted = preemptions() != before;
        if !caught {
            self.poll.poll(events, None)?;
        }
        self.spin.waited(started.elapsed(), true, preempted);
        Ok(())
    }

    /// Sends the unsent output and sleeps until events come, in one system
    /// call (crate::uring says why), then collects the events.
    fn send_and_wait(&mut self, events: &mut Events) -> io::Result<()> {
        let batch = self
            .sender
            .as_ref()
            .expect("output is held only with a sender")
            .batch();
        // More than a batch (a raised limit waking many): the first go out
        // by plain writes.
        let conns = &self.conns;
        let (long, held): (Vec<Token>, Vec<Token>) = self.unsent.drain(..).partition(|token| {
            conns
                .get(token)
                .is_some_and(|c| c.outbuf.len() > SEND_WITH_SLEEP_MAX)
        });
        self.write_held(long);
        let early = held.len().saturating_sub(batch);
        let (early, last) = held.split_at(early);
        self.write_held(early.iter().copied());
        let last: Vec<Token> = last
            .iter()
            .copied()
            .filter(|token| self.conns.contains_key(token))
            .collect();
        let sends: Vec<(RawFd, &[u8])> = last
            .iter()
            .map(|token| &self.conns[token])
            .map(|conn| (conn.stream.as_raw_fd(), &conn.outbuf[..]))
            .collect();
        match self
            .sender
            .as_mut()
            .expect("checked above")
            .send_then_wait(&sends)
        {
            Ok(results) => {
                for (token, result) in last.into_iter().zip(results) {
                    self.finish_send(token, result);
                }
                self.poll.poll(events, Some(Duration::ZERO))
            }
            Err(e) => {
                log::warn(format_args!(
                    "io_uring failed ({e}): from now on replies are written, then the loop sleeps"
                ));
                self.sender = None;
                self.write_held(last);
                self.poll.poll(events, None)
            }
        }
    }

    /// Takes note of what a send of held output did, then writes whatever
    /// is left as `flush_or_close` would have: a send that failed is tried
    /// once more by a plain write, which closes the connection if its peer
    /// is gone.
    fn finish_send(&mut self, token: Token, sent: Sent) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        conn.unsent = false;
        match sent {
            Sent::Bytes(n) => drop(conn.outbuf.drain(..n)),
            Sent::Failed(e) if e.kind() == ErrorKind::WouldBlock => {}
            Sent::Failed(e) => log::debug(format_args!(
                "pid {}: a send through io_uring failed ({e}); writing instead",
                conn.pid
            )),
            // Sending again could repeat a reply; closing cannot lose a
            // token (the pool takes back what the connection held).
            Sent::Unknown => return self.close(token),
        }
        self.send_now(token, false);
    }

    /// Sends these connections' held output now, by plain writes.
    fn write_held(&mut self, tokens: impl IntoIterator<Item = Token>) {
        for token in tokens {
            self.finish_send(token, Sent::Bytes(0));
        }
    }

    /// Looks for events without sleeping until `spin` has passed since
    /// `started`; whether any came.
    fn spin_wait(
        &mut self,
        events: &mut Events,
        started: Instant,
        spin: Duration,
    ) -> io::Result<bool> {
        loop {
            self.poll.poll(events, Some(Duration::ZERO))?;
            if !events.is_empty() {
                return Ok(true);
            }
            if started.elapsed() >= spin {
                return Ok(false);
            }
            std::hint::spin_loop();
        }
    }

    fn stop_signal(&mut self) -> Option<&'static str> {
        match self.signals.read_signal() {
            Ok(Some(info)) if info.ssi_signo == libc::SIGTERM as u32 => Some("SIGTERM"),
            Ok(Some(info)) if info.ssi_signo == libc::SIGINT as u32 => Some("SIGINT"),
            _ => None,
        }
    }

    fn accept_successor(&mut self) -> Option<std::os::unix::net::UnixStream> {
        let (stream, _) = self.handover.as_ref()?.accept().ok()?;
        if !crate::handover::is_ours(&stream) {
            log::warn(format_args!("refused a handover asked by another user"));
            return None;
        }
        log::info(format_args!("a successor asks for our state: handing over"));
        Some(stream)
    }

    /// Our state for a successor, with the descriptors it names: the
    /// listening socket first, then every connection. Grants filed since
    /// the last round go into their connections' output first, under the
    /// same lock as the snapshot, so that none is lost between the two.
    pub fn hand_over(&mut self) -> (BrokerState, Vec<ConnState>, Vec<RawFd>) {
        let mut broker = self.broker.lock().expect("broker lock");
        for grant in broker.take_grants(Transport::Socket) {
            let held = broker.pool().held_by(grant.client);
            let Some(conn) = self
                .by_client
                .get(&grant.client)
                .and_then(|t| self.conns.get_mut(t))
            else {
                continue;
            };
            conn.waiting = false;
            conn.outbuf.extend_from_slice(
                &Reply::Granted {
                    tokens: grant.tokens,
                    held,
                }
                .encode(),
            );
        }
        let mut fds = vec![self.listener.as_raw_fd()];
        let conns = self
            .conns
            .values()
            .map(|c| {
                fds.push(c.stream.as_raw_fd());
                ConnState {
                    fd: fds.len() - 1,
                    pid: c.pid,
                    client: c.client,
                    inbuf: c.inbuf.clone(),
                    outbuf: c.outbuf.clone(),
                    waiting: c.waiting,
                    closing: c.closing,
                }
            })
            .collect();
        (broker.snapshot(), conns, fds)
    }

    /// Takes on a predecessor's connections (crate::handover), then serves
    /// at once what they sent meanwhile and sends what they were owed.
    pub fn adopt(&mut self, conns: Vec<(ConnState, OwnedFd)>) -> io::Result<()> {
        let mut tokens = Vec::with_capacity(conns.len());
        for (state, fd) in conns {
            let stream = std::os::unix::net::UnixStream::from(fd);
            stream.set_nonblocking(true)?;
            // What it may do is ours to say, from the kernel's word on it:
            // one our options would refuse stays, since its build holds
            // tokens, but only as a member.
            let (uid, access) = match nix::sys::socket::getsockopt(
                &stream,
                nix::sys::socket::sockopt::PeerCredentials,
            ) {
                Ok(peer) => (
                    peer.uid(),
                    self.admission.check(&peer).unwrap_or(Access::Member),
                ),
                Err(_) => (u32::MAX, Access::Member),
            };
            let mut stream = UnixStream::from_std(stream);
            let token = Token(self.next_token);
            self.next_token += 1;
            self.poll
                .registry()
                .register(&mut stream, token, Interest::READABLE)?;
            if let Some(id) = state.client {
                self.by_client.insert(id, token);
            }
            let ConnState {
                pid,
                client,
                inbuf,
                outbuf,
                waiting,
                closing,
                ..
            } = state;
            self.conns.insert(
                token,
                Conn {
                    stream,
                    pid,
                    uid,
                    access,
                    client,
                    inbuf,
                    outbuf,
                    waiting,
                    closing,
                    interest: Interest::READABLE,
                    unsent: false,
                },
            );
            tokens.push(token);
        }
        for token in tokens {
            self.serve_conn(token);
            // Replies held behind a waiting ACQUIRE leave with its grant.
            if self
                .conns
                .get(&token)
                .is_some_and(|c| !c.outbuf.is_empty() && (!c.waiting || c.closing))
            {
                self.send_now(token, false);
            }
        }
        self.accept_all();
        self.deliver_grants();
        Ok(())
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.add_conn(stream),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::EMFILE) => {
                    log::warn(format_args!("cannot accept a connection: {e} (raise the broker's open-file limit: ulimit -Hn, or LimitNOFILE= in its systemd unit)"));
                    if !self.refuse_one_with_the_spare_fd() {
                        return;
                    }
                }
                Err(e) => {
                    // ENFILE and friends: log and keep serving those we have.
                    log::warn(format_args!("cannot accept a connection: {e}"));
                    return;
                }
            }
        }
    }

    /// Out of descriptors: gives back the one in reserve, accepts one
    /// connection with it to answer `ERR full`, and takes the reserve
    /// again. False if there was nobody to accept, or no reserve.
    fn refuse_one_with_the_spare_fd(&mut self) -> bool {
        if self.spare_fd.take().is_none() {
            return false;
        }
        if let Ok((mut stream, _)) = self.listener.accept() {
            let _ = stream.write(&self.full_reply());
        }
        self.spare_fd = std::fs::File::open("/dev/null").ok();
        self.spare_fd.is_some()
    }

    fn full_reply(&self) -> Vec<u8> {
        Reply::Err {
            code: ErrorCode::Full,
            message: format!(
                "the broker serves its maximum of {} clients",
                self.max_clients
            ),
        }
        .encode()
    }

    fn add_conn(&mut self, mut stream: UnixStream) {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        let Ok(peer) = getsockopt(&stream, PeerCredentials) else {
            return; // gone already
        };
        let pid = peer.pid() as u32;
        // Checked before anything else, whatever the socket file's mode:
        // another user's request is never read.
        let access = match self.admission.check(&peer) {
            Ok(access) => access,
            Err(why) => {
                log::warn(format_args!("refused pid {pid}: {why}"));
                let reply = Reply::Err {
                    code: ErrorCode::Denied,
                    message: why,
                };
                let _ = stream.write(&reply.encode());
                return;
            }
        };
        if self.conns.len() >= self.max_clients {
            self.reap_hung_up();
        }
        if self.conns.len() >= self.max_clients {
            let _ = stream.write(&self.full_reply());
            return;
        }
        let token = Token(self.next_token);
        self.next_token += 1;
        if let Err(e) = self
            .poll
            .registry()
            .register(&mut stream, token, Interest::READABLE)
        {
            log::warn(format_args!("cannot watch a new connection: {e}"));
            return;
        }
        log::debug(format_args!("connection from pid {pid}"));
        let conn = Conn {
            stream,
            pid,
            uid: peer.uid(),
            access,
            client: None,
            inbuf: Vec::new(),
            outbuf: Vec::new(),
            waiting: false,
            closing: false,
            interest: Interest::READABLE,
            unsent: false,
        };
        self.conns.insert(token, conn);
    }

    /// At the maximum, closes the connections whose peers have hung up but
    /// whose end of file the loop has not read yet, so that a client that
    /// has gone (a probe that connected and closed, a killed build) does not
    /// keep a newcomer out. Costs a poll of every connection, paid only at
    /// the maximum.
    fn reap_hung_up(&mut self) {
        let tokens: Vec<Token> = self.conns.keys().copied().collect();
        let mut fds: Vec<libc::pollfd> = tokens
            .iter()
            .map(|t| libc::pollfd {
                fd: self.conns[t].stream.as_raw_fd(),
                events: libc::POLLRDHUP,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a live array of `fds.len()` pollfds; a zero
        // timeout only reports, it never blocks. (nix's PollFlags lacks
        // POLLRDHUP, the one flag that tells a half-close.)
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
        if ready <= 0 {
            return;
        }
        let gone = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
        for (token, fd) in tokens.into_iter().zip(&fds) {
            if fd.revents & gone != 0 {
                // Reads what it sent before it went, answers it, then sees
                // the end of file and closes: the same path as the loop's.
                self.serve_conn(token);
            }
        }
    }

    fn serve_conn(&mut self, token: Token) {
        // Read and answer a chunk at a time, so a client streaming requests
        // is served as it goes rather than buffered whole.
        let finished = loop {
            let Some(conn) = self.conns.get_mut(&token) else {
                return;
            };
            if is_over_bound(conn) && !conn.closing {
                // Too much unsent: send what the client takes; read on only
                // below the bound (the next WRITABLE event brings us back).
                if flush(conn).is_err() {
                    return self.close(token);
                }
                if is_over_bound(conn) {
                    break false;
                }
                self.process_lines(token);
                continue;
            }
            match read_chunk(conn) {
                // A connection that is closing only drains its replies.
                Chunk::Data if conn.closing => conn.inbuf.clear(),
                Chunk::Data => self.process_lines(token),
                Chunk::Drained => break false,
                Chunk::Finished => break true,
            }
            if self.conns.get(&token).is_none_or(|c| c.closing) {
                break false;
            }
        };
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        // While ACQUIRE waits, replies to the requests sent before it wait
        // too and leave with its GRANTED, in order: a client that pipelines
        // RELEASE and ACQUIRE is then woken once per token, not twice.
        if conn.waiting && !conn.closing && !finished {
            return;
        }
        self.flush_or_close(token, finished);
    }

    /// Sends what can be sent; closes the connection if it is finished, had
    /// a fatal error, or its peer is gone. Watches for writability only
    /// while output is stuck.
    fn flush_or_close(&mut self, token: Token, finished: bool) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        if !conn.outbuf.is_empty() {
            self.replied += 1;
        }
        // A live connection's output waits for the loop's next sleep, which
        // sends it (crate::uring), unless earlier output is stuck.
        if self.sender.is_some()
            && !finished
            && !conn.closing
            && conn.interest == Interest::READABLE
        {
            if !conn.outbuf.is_empty() && !conn.unsent {
                conn.unsent = true;
                self.unsent.push(token);
            }
            return;
        }
        self.send_now(token, finished);
    }

    /// Writes what can be written now, then closes or watches as
    /// `flush_or_close` says.
    fn send_now(&mut self, token: Token, finished: bool) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        // Flush first: a fatal error's reply should reach the client.
        if flush(conn).is_err() {
            return self.close(token);
        }
        if finished || conn.closing {
            if conn.outbuf.is_empty() {
                return self.close(token);
            }
            // Replies are still to go, and a client that shut down only
            // its writing side (`nc -N`, a script) still reads them: the
            // connection stays until they are out, but its tokens come back
            // now, since it can no longer give them back itself.
            conn.closing = true;
            if let Some(id) = conn.client.take() {
                let pid = conn.pid;
                self.leave_pool(id, pid);
            }
        }
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let interest = if conn.outbuf.is_empty() {
            Interest::READABLE
        } else {
            Interest::READABLE | Interest::WRITABLE
        };
        if interest != conn.interest {
            conn.interest = interest;
            if self
                .poll
                .registry()
                .reregister(&mut conn.stream, token, interest)
                .is_err()
            {
                self.close(token);
            }
        }
    }

    fn process_lines(&mut self, token: Token) {
        loop {
            let Some(conn) = self.conns.get_mut(&token) else {
                return;
            };
            // Past the bound the rest waits, read but unanswered, until
            // the client reads (serve_conn resumes).
            if conn.closing || is_over_bound(conn) {
                return;
            }
            let Some(end) = conn.inbuf.iter().position(|&b| b == b'\n') else {
                if conn.inbuf.len() >= MAX_LINE {
                    let message = format!("request longer than {MAX_LINE} bytes");
                    conn.inbuf.clear();
                    self.reply_error(token, ErrorCode::TooLong, message);
                }
                return;
            };
            if end + 1 > MAX_LINE {
                self.reply_error(
                    token,
                    ErrorCode::TooLong,
                    format!("request longer than {MAX_LINE} bytes"),
                );
                return;
            }
            let line: Vec<u8> = conn.inbuf.drain(..=end).collect();
            let line = line.strip_suffix(b"\n").unwrap_or(&line);
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            match protocol::parse_request(line) {
                Ok(request) => self.handle(token, request),
                Err(e) => self.reply_error(token, ErrorCode::Malformed, e.0),
            }
        }
    }

    fn handle(&mut self, token: Token, request: Request) {
        let conn = self.conns.get_mut(&token).expect("caller checked");
        let reply = match (conn.client, request) {
            (None, Request::Hello { version, label }) => {
                if version != protocol::VERSION {
                    let msg = format!(
                        "this broker speaks protocol version {}, not {version}",
                        protocol::VERSION
                    );
                    return self.reply_error(token, ErrorCode::Version, msg);
                }
                let command = if label.is_empty() {
                    command_line(conn.pid)
                } else {
                    label
                };
                let mut broker = self.broker.lock().expect("broker lock");
                let id = broker.connect(ClientMeta::new(conn.pid, command, Transport::Socket));
                conn.client = Some(id);
                self.by_client.insert(id, token);
                Reply::Hello {
                    version: protocol::VERSION,
                    client: id.0,
                    limit: broker.pool().limit(),
                }
            }
            (None, _) => {
                return self.reply_error(
                    token,
                    ErrorCode::Hello,
                    "the first request must be HELLO 1 [label]".into(),
                )
            }
            (Some(_), Request::Hello { .. }) => {
                return self.reply_error(token, ErrorCode::Hello, "HELLO was already said".into())
            }
            (Some(id), Request::Cancel) => {
                let mut broker = self.broker.lock().expect("broker lock");
                // The grant won the race (another client's RELEASE earlier
                // in this round): GRANTED goes first, as the protocol says.
                if let Some(grant) = broker.take_grant_of(Transport::Socket, id, ACQUIRE_TAG) {
                    let held = broker.pool().held_by(id);
                    conn.outbuf.extend_from_slice(
                        &Reply::Granted {
                            tokens: grant.tokens,
                            held,
                        }
                        .encode(),
                    );
                }
                let tokens = broker.cancel(id, ACQUIRE_TAG);
                conn.waiting = false;
                Reply::Cancelled { tokens }
            }
            (Some(_), _) if conn.waiting => {
                return self.reply_error(
                    token,
                    ErrorCode::Busy,
                    "only CANCEL is allowed while ACQUIRE waits".into(),
                )
            }
            (Some(_), request @ (Request::Stop | Request::Limit(_) | Request::Gate { .. }))
                if !conn.access.may_administer() =>
            {
                let verb = match request {
                    Request::Stop => "stop the broker",
                    Request::Limit(_) => "change the limit",
                    _ => "set a gate",
                };
                let message = self.admission.admin_refusal(conn.uid, verb);
                return self.reply_error(token, ErrorCode::Denied, message);
            }
            (Some(id), Request::Hold(n)) if !conn.access.may_administer() => {
                // A member re-attaching after a restart holds what a broker
                // before us granted it: never more than the whole pool, so
                // that another user cannot hold the pool past its limit
                // for as long as it likes.
                let mut broker = self.broker.lock().expect("broker lock");
                let (held, limit) = (broker.pool().held_by(id), broker.pool().limit());
                if held.saturating_add(n) > limit {
                    let message = format!(
                        "uid {} may hold at most the limit ({limit}) of tokens a broker before us granted; \
                         it holds {held} and says {n} more",
                        conn.uid
                    );
                    drop(broker);
                    return self.reply_error(token, ErrorCode::Range, message);
                }
                match apply(&mut broker, id, Request::Hold(n)) {
                    Ok(Some(reply)) => reply,
                    Ok(None) => unreachable!("HOLD never waits"),
                    Err(e) => Reply::Err {
                        code: error_code(&e),
                        message: e.to_string(),
                    },
                }
            }
            (Some(_), Request::Stop) => {
                // The reply goes out at once and the connection closes; the
                // loop ends after this round, as on SIGTERM.
                conn.closing = true;
                self.stop_asked = Some(conn.pid);
                stopping(&self.broker.lock().expect("broker lock"))
            }
            (Some(id), request) => {
                let mut broker = self.broker.lock().expect("broker lock");
                match apply(&mut broker, id, request) {
                    Ok(Some(reply)) => reply,
                    Ok(None) => {
                        conn.waiting = true;
                        return;
                    }
                    Err(e) => Reply::Err {
                        code: error_code(&e),
                        message: e.to_string(),
                    },
                }
            }
        };
        conn.outbuf.extend_from_slice(&reply.encode());
    }

    fn reply_error(&mut self, token: Token, code: ErrorCode, message: String) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        log::info(format_args!(
            "pid {}: {code}: {message}{}",
            conn.pid,
            if code.is_fatal() {
                "; closing its connection"
            } else {
                ""
            }
        ));
        conn.outbuf
            .extend_from_slice(&Reply::Err { code, message }.encode());
        if code.is_fatal() {
            conn.closing = true;
        }
    }

    fn deliver_grants(&mut self) {
        // One lock for the whole batch: what each client holds now is read
        // with its grants.
        let grants: Vec<(ClientId, u32, u32)> = {
            let mut broker = self.broker.lock().expect("broker lock");
            let grants = broker.take_grants(Transport::Socket);
            grants
                .into_iter()
                .map(|Grant { client, tokens, .. }| (client, tokens, broker.pool().held_by(client)))
                .collect()
        };
        for (client, tokens, held) in grants {
            let Some(&token) = self.by_client.get(&client) else {
                continue;
            };
            let conn = self
                .conns
                .get_mut(&token)
                .expect("by_client and conns agree");
            conn.waiting = false;
            conn.outbuf
                .extend_from_slice(&Reply::Granted { tokens, held }.encode());
            self.flush_or_close(token, false);
        }
    }

    fn close(&mut self, token: Token) {
        let Some(mut conn) = self.conns.remove(&token) else {
            return;
        };
        let _ = self.poll.registry().deregister(&mut conn.stream);
        if let Some(id) = conn.client {
            self.leave_pool(id, conn.pid);
        }
    }

    /// A connection's client is gone from the pool: its tokens come back,
    /// its wait (if any) is withdrawn.
    fn leave_pool(&mut self, id: ClientId, pid: u32) {
        self.by_client.remove(&id);
        let mut broker = self.broker.lock().expect("broker lock");
        let command = broker
            .pool()
            .meta(id)
            .map(|m| m.command.clone())
            .unwrap_or_default();
        let reclaimed = broker.disconnect(id);
        if reclaimed > 0 {
            log::info(format_args!(
                "reclaimed {reclaimed} token(s) from pid {pid} ({command}): its connection closed"
            ));
        }
    }
}

/// The answer to STOP: who carries on without the broker.
fn stopping(broker: &Broker) -> Reply {
    let status = broker.status();
    let builds = status
        .builds
        .iter()
        .filter(|b| b.held + b.waiting > 0)
        .count();
    Reply::Stopping {
        pid: std::process::id(),
        builds: u32::try_from(builds).unwrap_or(u32::MAX),
        held: status.held,
    }
}

/// Applies a request of a connected client. `Ok(None)`: ACQUIRE queued,
/// the reply comes with the grant.
fn apply(broker: &mut Broker, id: ClientId, request: Request) -> Result<Option<Reply>, PoolError> {
    Ok(Some(match request {
        Request::Acquire(n) => match broker.acquire(id, ACQUIRE_TAG, n)? {
            Acquired::Granted => Reply::Granted {
                tokens: n,
                held: broker.pool().held_by(id),
            },
            Acquired::Queued => return Ok(None),
        },
        Request::Try(n) => match broker.try_acquire(id, n)? {
            true => Reply::Granted {
                tokens: n,
                held: broker.pool().held_by(id),
            },
            false => Reply::Busy {
                free: broker.pool().free(),
            },
        },
        Request::Release(n) => {
            broker.release(id, n)?;
            Reply::Released {
                tokens: n,
                held: broker.pool().held_by(id),
            }
        }
        Request::Status => Reply::Status {
            json: serde_json::to_string(&broker.status()).expect("status serializes"),
        },
        Request::Limit(n) => {
            let old = broker.set_limit(n)?;
            log::info(format_args!("limit changed from {old} to {n}"));
            Reply::Limit { old, new: n }
        }
        Request::Gate { name, value } => match broker.set_gate(&name, value) {
            Ok(value) => {
                log::info(format_args!(
                    "gate {name} set to {}",
                    value.map_or("off".to_string(), |v| v.to_string())
                ));
                Reply::Gate { name, value }
            }
            Err(message) => Reply::Err {
                code: ErrorCode::Range,
                message,
            },
        },
        Request::Build { weight, name } => {
            let (build, weight) = broker.start_build(id, weight, name)?;
            Reply::Build {
                build: build.0,
                weight,
            }
        }
        Request::Wanted => {
            let (tokens, free) = broker.wanted(id);
            Reply::Wanted { tokens, free }
        }
        Request::Stray(n) => {
            let total = broker.note_stray(id, n);
            log::warn(format_args!(
                "client {}: took {n} stray byte(s) out of its build's jobserver ({total} in all): \
                 written by a client that gave back more than it took, or by another process",
                id.0
            ));
            Reply::Stray { total }
        }
        Request::Hold(n) => {
            broker.hold(id, n)?;
            log::info(format_args!(
                "client {}: holds {n} token(s) a broker before us granted",
                id.0
            ));
            Reply::Granted {
                tokens: n,
                held: broker.pool().held_by(id),
            }
        }
        Request::Hello { .. } | Request::Cancel | Request::Stop => {
            unreachable!("handled by the caller")
        }
    }))
}

fn error_code(e: &PoolError) -> ErrorCode {
    match e {
        PoolError::OverRelease { .. } => ErrorCode::OverRelease,
        _ => ErrorCode::Range,
    }
}

enum Chunk {
    Data,
    Drained,
    /// End of file or a read error: the connection is finished.
    Finished,
}

fn read_chunk(conn: &mut Conn) -> Chunk {
    let mut buf = [0u8; 4096];
    loop {
        return match conn.stream.read(&mut buf) {
            Ok(0) => Chunk::Finished,
            Ok(n) => {
                conn.inbuf.extend_from_slice(&buf[..n]);
                Chunk::Data
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => Chunk::Drained,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => Chunk::Finished,
        };
    }
}

/// Writes what can be written now. Err: the peer is gone or hopelessly
/// behind.
fn flush(conn: &mut Conn) -> io::Result<()> {
    while !conn.outbuf.is_empty() {
        match conn.stream.write(&conn.outbuf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                conn.outbuf.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether a connection's unsent replies have reached the bound, past which
/// its requests are not read (a client that writes without reading cannot
/// grow the broker's memory, nor keep its loop from the others).
fn is_over_bound(conn: &Conn) -> bool {
    conn.outbuf.len() >= MAX_UNSENT
}

/// The io_uring that sends replies as the loop sleeps, if this kernel
/// lets us have one.
fn io_uring_sender(poll: &Poll) -> Option<SendAndWait> {
    SendAndWait::new(poll.as_raw_fd(), SEND_BATCH)
        .inspect(|_| {
            log::info(format_args!(
                "replies go out through io_uring as the loop sleeps"
            ))
        })
        .inspect_err(|e| {
            log::info(format_args!(
                "no io_uring here ({e}): replies are written, then the loop sleeps"
            ))
        })
        .ok()
}

/// How often this thread has been preempted so far (its involuntary
/// context switches).
fn preemptions() -> i64 {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(0, |usage| usage.involuntary_context_switches())
}

/// The process's command line from /proc, for status; empty if gone.
pub fn command_line(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    let line = words.join(" ");
    line.chars().take(protocol::MAX_LABEL).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn broker_with(limit: u32, pids: &[u32]) -> (Broker, Vec<ClientId>) {
        let mut broker = Broker::new(limit).unwrap();
        let ids = pids
            .iter()
            .map(|&pid| broker.connect(ClientMeta::new(pid, "make".into(), Transport::Socket)))
            .collect();
        (broker, ids)
    }

    #[test]
    fn releasing_more_than_held_is_over_release_and_other_errors_are_range() {
        let (mut broker, ids) = broker_with(2, &[1]);
        let e = broker.release(ids[0], 1).unwrap_err();
        assert_eq!(error_code(&e), ErrorCode::OverRelease);
        let e = broker.acquire(ids[0], 1, 3).unwrap_err();
        assert_eq!(error_code(&e), ErrorCode::Range);
        assert_eq!(error_code(&PoolError::ZeroTokens), ErrorCode::Range);
    }

    #[test]
    fn stop_counts_the_builds_that_hold_or_wait_and_the_tokens_held() {
        let (mut broker, ids) = broker_with(2, &[1, 2, 3, 4]);
        let [done, holder, waiter, _idle] = ids[..] else {
            unreachable!()
        };
        broker.acquire(done, 1, 1).unwrap();
        broker.release(done, 1).unwrap();
        broker.acquire(holder, 1, 2).unwrap();
        assert_eq!(broker.acquire(waiter, 1, 1).unwrap(), Acquired::Queued);
        assert_eq!(
            stopping(&broker),
            Reply::Stopping {
                pid: std::process::id(),
                builds: 2,
                held: 2,
            }
        );
    }

    #[test]
    fn a_connection_is_over_bound_at_a_mebibyte_unsent() {
        let (stream, _peer) = UnixStream::pair().unwrap();
        let mut conn = Conn {
            stream,
            pid: 1,
            uid: 0,
            access: crate::admission::Access::Owner,
            client: None,
            inbuf: Vec::new(),
            outbuf: Vec::new(),
            waiting: false,
            closing: false,
            interest: Interest::READABLE,
            unsent: false,
        };
        assert!(!is_over_bound(&conn));
        conn.outbuf.resize(MAX_UNSENT - 1, b'x');
        assert!(!is_over_bound(&conn));
        conn.outbuf.push(b'x');
        assert!(is_over_bound(&conn));
    }

    #[test]
    fn the_command_line_is_read_from_proc_with_spaces_between_words() {
        let line = command_line(std::process::id());
        let argv: Vec<String> = std::env::args().collect();
        let want: String = argv.join(" ").chars().take(protocol::MAX_LABEL).collect();
        assert_eq!(line, want);
        assert!(!line.is_empty());
        assert_eq!(command_line(4_000_000_000), "", "no such process");
    }
}
