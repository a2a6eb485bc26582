//! The native transport: a Unix stream socket speaking docs/protocol.md.
//!
//! One thread runs a mio loop over the listener, every connection, the
//! FUSE device, a waker (errands other threads post, crate::mailbox) and a
//! signalfd (SIGTERM, SIGINT). It owns the broker's state, the [`Broker`]
//! and the FUSE token files: the socket's sessions, the FUSE requests it
//! dispatches and the errands all act on it here, one after another. A waiting client blocks in read() on
//! its own connection, so a grant wakes exactly that process: the broker
//! never broadcasts.

use crate::admission::{Access, Admission};
use crate::broker::{Broker, BrokerState, Transport};
use crate::fastpath::Regions;
use crate::fuse::{FsState, FuseMount};
use crate::log;
use crate::mailbox::Inbox;
use crate::session::{Context, Session};
use crate::spin::SpinPolicy;
use crate::uring::{SendAndWait, Sent};
use baton_core::protocol::{ErrorCode, Reply};
use baton_core::{ClientId, Grant};
use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use nix::sys::signalfd::SignalFd;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

const LISTENER: Token = Token(0);
const SIGNALS: Token = Token(1);
pub const WAKER: Token = Token(2);
const HANDOVER: Token = Token(3);
const FUSE: Token = Token(4);
const FUSE_CLOCK: Token = Token(5);
/// The fast path's audit clock (below, [`SocketServer::follow_the_regions`]).
const AUDIT_CLOCK: Token = Token(6);
/// Connections from here up, below `fuse::procs::EXITS` (pidfds).
const FIRST_CONN: usize = 7;

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

/// A connection: its socket and how the loop watches it, around the
/// protocol's state (crate::session).
struct Conn {
    stream: UnixStream,
    session: Session,
    /// What the connection is registered for; changed only when needed,
    /// since each change is a system call.
    interest: Interest,
    /// Its output waits to be sent with the loop's next sleep.
    unsent: bool,
}

/// A connection as a successor broker receives it (crate::handover): its
/// session as it stands (a partial line read, replies yet to send, an
/// ACQUIRE waiting), and `fd`, its descriptor's index among those passed.
#[derive(Debug, Serialize, Deserialize)]
pub struct ConnState {
    pub fd: usize,
    #[serde(flatten)]
    session: Session,
}

/// The loop's state as a successor receives it (crate::handover): the
/// books, the connections, the descriptors they name (the listener first),
/// and the token files with the index of /dev/fuse, if mounted.
pub struct Snapshot {
    pub broker: BrokerState,
    pub conns: Vec<ConnState>,
    pub fds: Vec<RawFd>,
    pub fuse: Option<(FsState, usize)>,
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
    /// Errands from other threads.
    inbox: Inbox<Broker>,
    /// The pool's broker: the loop is its one owner.
    broker: Broker,
    /// The FUSE token files, with their session, served from this loop.
    fuse: Option<FuseMount>,
    /// The fast path's regions, one per build whose clients asked.
    regions: Regions,
    /// Wakes the loop every second while a region exists, so that the
    /// audit runs even when no client wakes the broker (an open region's
    /// clients never need to).
    audit_clock: Option<nix::sys::timerfd::TimerFd>,
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
    /// A loop on `poll`, whose waker for `inbox` is [`WAKER`] (see
    /// crate::mailbox::mailbox). `io_uring`: send replies in the system call
    /// that sleeps, where the kernel allows (crate::uring).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        poll: Poll,
        (inbox, broker, fuse): (Inbox<Broker>, Broker, Option<FuseMount>),
        listener: std::os::unix::net::UnixListener,
        signals: SignalFd,
        spin: SpinPolicy,
        io_uring: bool,
        max_clients: usize,
        admission: Admission,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let mut listener = UnixListener::from_std(listener);
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        poll.registry().register(
            &mut SourceFd(&signals.as_raw_fd()),
            SIGNALS,
            Interest::READABLE,
        )?;
        if let Some(mount) = fuse.as_ref() {
            if let Some(fd) = mount.source() {
                poll.registry()
                    .register(&mut SourceFd(&fd), FUSE, Interest::READABLE)?;
            }
            poll.registry().register(
                &mut SourceFd(&mount.clock()),
                FUSE_CLOCK,
                Interest::READABLE,
            )?;
        }
        let sender = if io_uring {
            io_uring_sender(&poll)
        } else {
            None
        };
        let mut server = SocketServer {
            poll,
            listener,
            signals,
            inbox,
            broker,
            fuse,
            regions: Regions::default(),
            audit_clock: None,
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
        // Token files taken over may hold reservations already.
        if let Some(mount) = server.fuse.as_mut() {
            mount.plan();
        }
        Ok(server)
    }

    /// The broker, for what `serve` does before and after the loop.
    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// The FUSE mount, if any.
    pub fn fuse(&mut self) -> Option<&mut FuseMount> {
        self.fuse.as_mut()
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
            let mut files = FilesEvents::default();
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
                    FUSE => {
                        self.serve_fuse();
                        files.touched = true;
                    }
                    FUSE_CLOCK => files.clock_fired = true,
                    AUDIT_CLOCK => self.audit_clock_fired(),
                    token => match crate::fuse::exited_pid(token) {
                        Some(pid) => files.exited.push(pid),
                        None => self.serve_conn(token),
                    },
                }
            }
            self.act_on_files(&mut files);
            self.inbox.run_all(&mut self.broker);
            self.fastpath_round();
            self.follow_the_regions();
            // Grants caused by this round (ours or other transports').
            files.touched |= self.deliver_grants();
            if let Some(mount) = self.fuse.as_mut().filter(|_| files.touched) {
                mount.plan();
            }
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
        let spin = self
            .spin
            .spin_for(|| replied.max(broker.pool().held() as usize));
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
                .is_some_and(|c| c.session.outbuf.len() > SEND_WITH_SLEEP_MAX)
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
            .map(|conn| (conn.stream.as_raw_fd(), &conn.session.outbuf[..]))
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
            Sent::Bytes(n) => drop(conn.session.outbuf.drain(..n)),
            Sent::Failed(e) if e.kind() == ErrorKind::WouldBlock => {}
            Sent::Failed(e) => log::debug(format_args!(
                "pid {}: a send through io_uring failed ({e}); writing instead",
                conn.session.pid
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
        if !crate::sys::peer_is_our_uid(&stream) {
            log::warn(format_args!("refused a handover asked by another user"));
            return None;
        }
        log::info(format_args!("a successor asks for our state: handing over"));
        Some(stream)
    }

    /// Our state for a successor, with the descriptors it names: the
    /// listening socket first, then every connection. Grants filed since
    /// the last round go into their connections' output first, so that none
    /// is lost between the two. The token files' state and the FUSE
    /// device's descriptor come last, if mounted: the loop reads no FUSE
    /// request while it hands over, so none is half-served.
    pub fn hand_over(&mut self) -> Snapshot {
        // A region dies with this broker: what its clients hold goes on
        // their connections, which the successor adopts.
        self.regions.evict_all(&mut self.broker);
        let broker = &mut self.broker;
        for grant in broker.take_grants(Transport::Socket) {
            let held = broker.pool().held_by(grant.client);
            let Some(conn) = self
                .by_client
                .get(&grant.client)
                .and_then(|t| self.conns.get_mut(t))
            else {
                continue;
            };
            conn.session.granted(grant.tokens, held);
        }
        let mut fds = vec![self.listener.as_raw_fd()];
        let conns = self
            .conns
            .values()
            .map(|c| {
                fds.push(c.stream.as_raw_fd());
                ConnState {
                    fd: fds.len() - 1,
                    session: c.session.clone(),
                }
            })
            .collect();
        let fuse = self.fuse.as_mut().map(|mount| {
            fds.push(mount.device());
            (mount.hand_over(broker), fds.len() - 1)
        });
        Snapshot {
            broker: broker.snapshot(),
            conns,
            fds,
            fuse,
        }
    }

    /// Acts on the processes that exited and the deadlines that came, if
    /// any (`fuse::control`).
    fn act_on_files(&mut self, events: &mut FilesEvents) {
        if events.exited.is_empty() && !events.clock_fired {
            return;
        }
        events.touched = true;
        if let Some(mount) = self.fuse.as_mut() {
            mount.act(&mut self.broker, &events.exited, events.clock_fired);
        }
    }

    /// Serves the FUSE requests waiting; stops watching the device once
    /// the session has ended.
    fn serve_fuse(&mut self) {
        let Some(mount) = self.fuse.as_mut() else {
            return;
        };
        let fd = mount.source();
        if !mount.serve_ready(&mut self.broker) {
            if let Some(fd) = fd {
                let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
            }
        }
    }

    /// Takes on a predecessor's connections (crate::handover), then serves
    /// at once what they sent meanwhile and sends what they were owed.
    pub fn adopt(&mut self, conns: Vec<(ConnState, OwnedFd)>) -> io::Result<()> {
        let mut tokens = Vec::with_capacity(conns.len());
        for (ConnState { mut session, .. }, fd) in conns {
            let stream = std::os::unix::net::UnixStream::from(fd);
            stream.set_nonblocking(true)?;
            // What it may do is ours to say, from the kernel's word on it:
            // one our options would refuse stays, since its build holds
            // tokens, but only as a member.
            (session.uid, session.access) = match crate::sys::peer(&stream) {
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
            if let Some(id) = session.client() {
                self.by_client.insert(id, token);
            }
            self.conns.insert(
                token,
                Conn {
                    stream,
                    session,
                    interest: Interest::READABLE,
                    unsent: false,
                },
            );
            tokens.push(token);
        }
        for token in tokens {
            self.serve_conn(token);
            // Replies held behind a waiting ACQUIRE leave with its grant.
            if self.conns.get(&token).is_some_and(|c| {
                !c.session.outbuf.is_empty() && (!c.session.is_waiting() || c.session.is_closing())
            }) {
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
        let Ok(peer) = crate::sys::peer(&stream) else {
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
            session: Session::new(pid, peer.uid(), access),
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
        let fds: Vec<RawFd> = tokens
            .iter()
            .map(|t| self.conns[t].stream.as_raw_fd())
            .collect();
        for (token, gone) in tokens.into_iter().zip(crate::sys::hung_up(&fds)) {
            if gone {
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
            if conn.session.is_over_bound() && !conn.session.is_closing() {
                // Too much unsent: send what the client takes; read on only
                // below the bound (the next WRITABLE event brings us back).
                if flush(conn).is_err() {
                    return self.close(token);
                }
                if conn.session.is_over_bound() {
                    break false;
                }
                self.process_lines(token);
                continue;
            }
            match read_chunk(conn) {
                Chunk::Data => self.process_lines(token),
                Chunk::Drained => break false,
                Chunk::Finished => break true,
            }
            if self
                .conns
                .get(&token)
                .is_none_or(|c| c.session.is_closing())
            {
                break false;
            }
        };
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        // While ACQUIRE waits, replies to the requests sent before it wait
        // too and leave with its GRANTED, in order: a client that pipelines
        // RELEASE and ACQUIRE is then woken once per token, not twice.
        if conn.session.is_waiting() && !conn.session.is_closing() && !finished {
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
        if !conn.session.outbuf.is_empty() {
            self.replied += 1;
        }
        // A live connection's output waits for the loop's next sleep, which
        // sends it (crate::uring), unless earlier output is stuck.
        if self.sender.is_some()
            && !finished
            && !conn.session.is_closing()
            && conn.interest == Interest::READABLE
        {
            if !conn.session.outbuf.is_empty() && !conn.unsent {
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
        if finished || conn.session.is_closing() {
            if conn.session.outbuf.is_empty() {
                return self.close(token);
            }
            // Replies are still to go, and a client that shut down only
            // its writing side (`nc -N`, a script) still reads them: the
            // connection stays until they are out, but its tokens come back
            // now, since it can no longer give them back itself.
            if let Some(id) = conn.session.hang_up() {
                let pid = conn.session.pid;
                self.leave_pool(id, pid);
            }
        }
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let interest = if conn.session.outbuf.is_empty() {
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

    /// Acts on the whole lines a connection sent (crate::session), with the
    /// pool locked once for them all.
    fn process_lines(&mut self, token: Token) {
        loop {
            let Some(conn) = self.conns.get_mut(&token) else {
                return;
            };
            if !conn.session.has_work() {
                return;
            }
            let outcome = conn.session.process(&mut Context {
                broker: &mut self.broker,
                admission: &self.admission,
                command_line: &crate::sys::command_line,
            });
            if let Some(id) = outcome.joined {
                self.by_client.insert(id, token);
            }
            if outcome.stop_asked {
                self.stop_asked = Some(conn.session.pid);
            }
            if !outcome.fastpath_asked {
                return;
            }
            self.answer_fastpath(token, outcome.fastpath_layout);
        }
    }

    /// Seats a client in its build's region and sends it the region's
    /// descriptor with the reply; or `ERR unavailable`, and it stays on
    /// the socket.
    fn answer_fastpath(&mut self, token: Token, layout: u32) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let Some(id) = conn.session.client() else {
            return;
        };
        // The descriptor rides with the reply's first byte, so the reply
        // leaves now, and what was before it must have left already.
        if flush(conn).is_err() || !conn.session.outbuf.is_empty() {
            let why = "the replies before FASTPATH are not read yet: send it when none is pending";
            return conn.session.refuse_fastpath(why.into());
        }
        let offer = match self.regions.offer(&mut self.broker, id, layout) {
            Ok(offer) => offer,
            Err(why) => return conn.session.refuse_fastpath(why),
        };
        let reply = Reply::Fastpath {
            seat: offer.seat,
            bytes: offer.bytes,
        }
        .encode();
        match crate::sys::send_with_fd(&conn.stream, &reply, offer.fd) {
            Ok(sent) => {
                // Never short in practice (a few bytes on an empty
                // socket); the rest would go as any reply does.
                conn.session.outbuf.extend_from_slice(&reply[sent..]);
                log::debug(format_args!("pid {}: a fast-path seat", conn.session.pid));
            }
            Err(e) => {
                log::warn(format_args!(
                    "pid {}: sending its region: {e}",
                    conn.session.pid
                ));
                self.regions.leave(&mut self.broker, id);
            }
        }
    }

    /// The fast path's moves after a round: grants to regions go into
    /// them, returns come back, each region opens or closes. Tokens one
    /// region gives back may be granted to another's lender at once: it
    /// is served in the same round, so that no waiter waits for the next
    /// event.
    fn fastpath_round(&mut self) {
        for _ in 0..8 {
            self.regions.round(&mut self.broker);
            if !self.broker.has_grants_for(Transport::Region) {
                return;
            }
        }
    }

    /// Runs the audit clock while a region exists, and stops it with the
    /// last one.
    fn follow_the_regions(&mut self) {
        use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
        match (self.regions.is_empty(), self.audit_clock.take()) {
            (false, None) => {
                let every = nix::sys::time::TimeSpec::from_duration(crate::fastpath::audit_every());
                let clock = TimerFd::new(
                    ClockId::CLOCK_MONOTONIC,
                    TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
                )
                .and_then(|t| {
                    t.set(Expiration::Interval(every), TimerSetTimeFlags::empty())?;
                    Ok(t)
                })
                .map_err(io::Error::from)
                .and_then(|t| {
                    let fd = std::os::fd::AsFd::as_fd(&t).as_raw_fd();
                    self.poll.registry().register(
                        &mut SourceFd(&fd),
                        AUDIT_CLOCK,
                        Interest::READABLE,
                    )?;
                    Ok(t)
                });
                match clock {
                    Ok(clock) => self.audit_clock = Some(clock),
                    Err(e) => log::warn(format_args!(
                        "fast path: no audit clock ({e}): regions are audited only when a client wakes the broker"
                    )),
                }
            }
            (true, Some(clock)) => {
                let fd = std::os::fd::AsFd::as_fd(&clock).as_raw_fd();
                let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
            }
            (_, clock) => self.audit_clock = clock,
        }
    }

    /// The audit clock ticked: its count is read (so that it is quiet
    /// again); the round after this wake-up audits, as it is due.
    fn audit_clock_fired(&mut self) {
        if let Some(clock) = &self.audit_clock {
            let mut count = [0u8; 8];
            let _ = nix::unistd::read(clock, &mut count);
        }
    }

    /// Delivers the grants this round filed: the token files' (to their
    /// blocked reads and polls), then the socket's. Whether the token
    /// files had any.
    fn deliver_grants(&mut self) -> bool {
        let mut settled = false;
        if let Some(mount) = self.fuse.as_mut() {
            if self.broker.has_grants_for(Transport::Fuse) {
                mount.settle(&mut self.broker);
                settled = true;
            }
        }
        // What each client holds now is read with its grants.
        let grants: Vec<(ClientId, u32, u32)> = {
            let broker = &mut self.broker;
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
            conn.session.granted(tokens, held);
            self.flush_or_close(token, false);
        }
        settled
    }

    fn close(&mut self, token: Token) {
        let Some(mut conn) = self.conns.remove(&token) else {
            return;
        };
        let _ = self.poll.registry().deregister(&mut conn.stream);
        if let Some(id) = conn.session.client() {
            self.leave_pool(id, conn.session.pid);
        }
    }

    /// A connection's client is gone from the pool: its tokens come back,
    /// its wait (if any) is withdrawn.
    fn leave_pool(&mut self, id: ClientId, pid: u32) {
        self.by_client.remove(&id);
        // What it held in its region is booked on its connection first,
        // and comes back (or stays with its build's running jobs) with it.
        self.regions.leave(&mut self.broker, id);
        let broker = &mut self.broker;
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

/// What a round brought the token files besides requests.
#[derive(Default)]
struct FilesEvents {
    /// Processes that exited (their pidfds turned readable).
    exited: Vec<u32>,
    /// Their clock fired: a deadline came.
    clock_fired: bool,
    /// Anything changed them: their clock is planned again.
    touched: bool,
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
                conn.session.receive(&buf[..n]);
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
    while !conn.session.outbuf.is_empty() {
        match conn.stream.write(&conn.session.outbuf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                conn.session.outbuf.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
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
