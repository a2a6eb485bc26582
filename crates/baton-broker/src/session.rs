//! One connection's side of the native protocol (docs/protocol.md) as a
//! state machine: bytes in, replies out, the pool's calls in between.
//!
//! No I/O here. The socket loop (crate::socket) reads into `inbuf`, calls
//! [`Session::process`] with the pool locked, and writes `outbuf`; it is
//! told what it must act on (a client joined, STOP was asked). The rules
//! live here alone: HELLO first and once; while an ACQUIRE waits only
//! CANCEL; a grant that won the race with CANCEL is sent before
//! CANCELLED; members may not administer; fatal errors close after their
//! reply; a client that does not read stops being read.
//!
//! A session is also what `serve --replace` hands a successor (with the
//! connection's descriptor): the same type, serialized, so nothing is
//! copied by hand into a twin.

use crate::admission::{Access, Admission};
use crate::broker::{Broker, ClientMeta, Transport};
use crate::log;
use baton_core::protocol::{self, ErrorCode, Reply, Request, MAX_LINE};
use baton_core::{Acquired, ClientId, PoolError};
use serde::{Deserialize, Serialize};

/// The tag of a socket client's one pending ACQUIRE. A connection is
/// sequential, so it never has two.
pub const ACQUIRE_TAG: u64 = 0;

/// A client that does not read its replies cannot make the broker buffer
/// without end: past this much unsent output its requests are no longer
/// read (the kernel's socket buffer then stops its writes) until it reads.
pub const MAX_UNSENT: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Session {
    pub pid: u32,
    /// Its uid (SO_PEERCRED) and what that lets it do: the kernel's word,
    /// asked again by whoever adopts the connection, so never serialized.
    #[serde(skip, default = "unknown_uid")]
    pub uid: u32,
    #[serde(skip, default = "member")]
    pub access: Access,
    client: Option<ClientId>,
    /// Read, not yet acted on (a partial line, or lines past the bound).
    pub inbuf: Vec<u8>,
    /// Replies not yet sent.
    pub outbuf: Vec<u8>,
    /// An ACQUIRE is pending: only CANCEL is allowed until it is answered.
    waiting: bool,
    /// A fatal error was sent (or STOP, or the peer hung up): flush, then
    /// close.
    closing: bool,
}

fn unknown_uid() -> u32 {
    u32::MAX
}

fn member() -> Access {
    Access::Member
}

/// What the broker's side needs besides the pool: who may administer, and
/// how to name a client that gave no label (its command line, from /proc
/// in the broker; anything in tests).
pub struct Context<'a> {
    pub broker: &'a mut Broker,
    pub admission: &'a Admission,
    pub command_line: &'a dyn Fn(u32) -> String,
}

/// What the loop must act on after [`Session::process`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// HELLO was accepted: the client's id, for the loop's map from
    /// clients to connections (grants arrive by client).
    pub joined: Option<ClientId>,
    /// The client said STOP: the loop ends after this round.
    pub stop_asked: bool,
    /// The client asked for a fast-path seat (`FASTPATH 1`), and may have
    /// one: the loop answers, since the answer carries a descriptor
    /// (crate::fastpath). Lines after it wait until it is answered.
    pub fastpath_asked: bool,
    /// The layout it asked for: a ring, or a pile (`FASTPATH 2`).
    pub fastpath_layout: u32,
}

impl Session {
    pub fn new(pid: u32, uid: u32, access: Access) -> Self {
        Session {
            pid,
            uid,
            access,
            client: None,
            inbuf: Vec::new(),
            outbuf: Vec::new(),
            waiting: false,
            closing: false,
        }
    }

    /// Its client in the pool, once HELLO was accepted.
    pub fn client(&self) -> Option<ClientId> {
        self.client
    }

    pub fn is_waiting(&self) -> bool {
        self.waiting
    }

    pub fn is_closing(&self) -> bool {
        self.closing
    }

    /// Whether its unsent replies have reached the bound, past which its
    /// requests are not read (a client that writes without reading cannot
    /// grow the broker's memory, nor keep its loop from the others).
    pub fn is_over_bound(&self) -> bool {
        self.outbuf.len() >= MAX_UNSENT
    }

    /// Whether [`Session::process`] has anything to do: a whole line, or a
    /// partial one already too long.
    pub fn has_work(&self) -> bool {
        !self.closing
            && !self.is_over_bound()
            && (self.inbuf.contains(&b'\n') || self.inbuf.len() >= MAX_LINE)
    }

    /// Bytes that arrived. A closing session drops them: it only drains
    /// its replies.
    pub fn receive(&mut self, bytes: &[u8]) {
        if !self.closing {
            self.inbuf.extend_from_slice(bytes);
        }
    }

    /// Acts on every whole line received, in order, until none is left, the
    /// session closes, or its unsent replies reach the bound (the rest then
    /// wait until the client reads). An ACQUIRE that queues has no reply
    /// until its grant ([`Session::granted`]) or CANCEL; the loop holds the
    /// replies before it back to leave with that one.
    pub fn process(&mut self, cx: &mut Context) -> Outcome {
        let mut outcome = Outcome::default();
        while !self.closing && !self.is_over_bound() {
            let Some(end) = self.inbuf.iter().position(|&b| b == b'\n') else {
                if self.inbuf.len() >= MAX_LINE {
                    self.inbuf.clear();
                    self.error(ErrorCode::TooLong, too_long());
                }
                break;
            };
            if end + 1 > MAX_LINE {
                self.error(ErrorCode::TooLong, too_long());
                break;
            }
            let line: Vec<u8> = self.inbuf.drain(..=end).collect();
            let line = line.strip_suffix(b"\n").unwrap_or(&line);
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            match protocol::parse_request(line) {
                Ok(request) => self.handle(cx, request, &mut outcome),
                Err(e) => self.error(ErrorCode::Malformed, e.0),
            }
            if outcome.fastpath_asked {
                break;
            }
        }
        outcome
    }

    /// The pending ACQUIRE was granted.
    pub fn granted(&mut self, tokens: u32, held: u32) {
        self.waiting = false;
        self.push(Reply::Granted { tokens, held });
    }

    /// The peer hung up, or can no longer be written to: nothing more is
    /// read, and its client leaves the pool now (returned, at most once),
    /// while any replies still drain to a peer that only shut down its
    /// writing side.
    pub fn hang_up(&mut self) -> Option<ClientId> {
        self.closing = true;
        self.inbuf.clear();
        self.client.take()
    }

    fn handle(&mut self, cx: &mut Context, request: Request, outcome: &mut Outcome) {
        let Some(id) = self.client else {
            return self.hello(cx, request, outcome);
        };
        match request {
            Request::Hello { .. } => self.error(ErrorCode::Hello, "HELLO was already said".into()),
            Request::Cancel => self.cancel(cx.broker, id),
            _ if self.waiting => self.error(
                ErrorCode::Busy,
                "only CANCEL is allowed while ACQUIRE waits".into(),
            ),
            Request::Stop | Request::Limit(_) | Request::Gate { .. }
                if !self.access.may_administer() =>
            {
                let verb = match request {
                    Request::Stop => "stop the broker",
                    Request::Limit(_) => "change the limit",
                    _ => "set a gate",
                };
                self.error(
                    ErrorCode::Denied,
                    cx.admission.admin_refusal(self.uid, verb),
                );
            }
            Request::Hold(n) if !self.access.may_administer() => self.member_hold(cx.broker, id, n),
            Request::Fastpath(version) => self.fastpath(version, outcome),
            // Its only purpose is to wake the loop, whose round reads the
            // client's region (crate::fastpath); it has no reply.
            Request::Nudge => {}
            Request::Stop => {
                // The reply goes out at once and the connection closes; the
                // loop ends after this round, as on SIGTERM.
                self.closing = true;
                outcome.stop_asked = true;
                self.push(stopping(cx.broker));
            }
            request => match apply(cx.broker, id, request) {
                Ok(Some(reply)) => self.push(reply),
                Ok(None) => self.waiting = true,
                Err(e) => self.push(pool_error(&e)),
            },
        }
    }

    fn hello(&mut self, cx: &mut Context, request: Request, outcome: &mut Outcome) {
        let Request::Hello { version, label } = request else {
            return self.error(
                ErrorCode::Hello,
                "the first request must be HELLO 1 [label]".into(),
            );
        };
        if version != protocol::VERSION {
            let msg = format!(
                "this broker speaks protocol version {}, not {version}",
                protocol::VERSION
            );
            return self.error(ErrorCode::Version, msg);
        }
        let command = if label.is_empty() {
            (cx.command_line)(self.pid)
        } else {
            label
        };
        let id = cx
            .broker
            .connect(ClientMeta::new(self.pid, command, Transport::Socket));
        self.client = Some(id);
        outcome.joined = Some(id);
        self.push(Reply::Hello {
            version: protocol::VERSION,
            client: id.0,
            limit: cx.broker.pool().limit(),
        });
    }

    fn cancel(&mut self, broker: &mut Broker, id: ClientId) {
        // The grant won the race (another client's RELEASE earlier in this
        // round): GRANTED goes first, as the protocol says.
        if let Some(grant) = broker.take_grant_of(Transport::Socket, id, ACQUIRE_TAG) {
            let held = broker.pool().held_by(id);
            self.push(Reply::Granted {
                tokens: grant.tokens,
                held,
            });
        }
        let tokens = broker.cancel(id, ACQUIRE_TAG);
        self.waiting = false;
        self.push(Reply::Cancelled { tokens });
    }

    /// FASTPATH: only the broker's own user (and root) may share its
    /// memory, and only in the layout this broker makes.
    fn fastpath(&mut self, version: u32, outcome: &mut Outcome) {
        if ![protocol::FASTPATH_VERSION, protocol::FASTPATH_PILE].contains(&version) {
            let message = format!(
                "this broker's fast path is version {} (a ring) or {} (a pile), not {version}",
                protocol::FASTPATH_VERSION,
                protocol::FASTPATH_PILE
            );
            return self.refuse_fastpath(message);
        }
        if self.access != Access::Owner {
            let message = format!(
                "the fast path shares the broker's memory: only its own user gets it, not uid {}",
                self.uid
            );
            return self.refuse_fastpath(message);
        }
        outcome.fastpath_asked = true;
        outcome.fastpath_layout = version;
    }

    /// `ERR unavailable`: the client stays on the socket.
    pub fn refuse_fastpath(&mut self, message: String) {
        self.error(ErrorCode::Unavailable, message);
    }

    /// A member re-attaching after a restart holds what a broker before us
    /// granted it: never more than the whole pool, so that another user
    /// cannot hold the pool past its limit for as long as it likes.
    fn member_hold(&mut self, broker: &mut Broker, id: ClientId, n: u32) {
        let (held, limit) = (broker.pool().held_by(id), broker.pool().limit());
        if held.saturating_add(n) > limit {
            let message = format!(
                "uid {} may hold at most the limit ({limit}) of tokens a broker before us granted; \
                 it holds {held} and says {n} more",
                self.uid
            );
            return self.error(ErrorCode::Range, message);
        }
        match apply(broker, id, Request::Hold(n)) {
            Ok(Some(reply)) => self.push(reply),
            Ok(None) => unreachable!("HOLD never waits"),
            Err(e) => self.push(pool_error(&e)),
        }
    }

    fn push(&mut self, reply: Reply) {
        self.outbuf.extend_from_slice(&reply.encode());
    }

    /// An error reply; a fatal one closes the session after it is sent.
    fn error(&mut self, code: ErrorCode, message: String) {
        log::info(format_args!(
            "pid {}: {code}: {message}{}",
            self.pid,
            if code.is_fatal() {
                "; closing its connection"
            } else {
                ""
            }
        ));
        self.push(Reply::Err { code, message });
        if code.is_fatal() {
            self.closing = true;
        }
    }
}

fn too_long() -> String {
    format!("request longer than {MAX_LINE} bytes")
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

fn pool_error(e: &PoolError) -> Reply {
    Reply::Err {
        code: error_code(e),
        message: e.to_string(),
    }
}

/// A request that needs only the pool. `None`: it waits (ACQUIRE queued).
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
        Request::Hello { .. }
        | Request::Cancel
        | Request::Stop
        | Request::Fastpath(_)
        | Request::Nudge => {
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn named(pid: u32) -> String {
        format!("command of {pid}")
    }

    /// A pool of `limit`, the admission of this process's uid alone.
    fn pool(limit: u32) -> (Broker, Admission) {
        (Broker::new(limit).unwrap(), Admission::new(vec![], vec![]))
    }

    fn owner(pid: u32) -> Session {
        Session::new(pid, 0, Access::Owner)
    }

    /// Sends `lines` and acts on them; what was replied since the last call.
    fn exchange(
        s: &mut Session,
        broker: &mut Broker,
        admission: &Admission,
        lines: &str,
    ) -> (String, Outcome) {
        s.receive(lines.as_bytes());
        let outcome = s.process(&mut Context {
            broker,
            admission,
            command_line: &named,
        });
        let out = String::from_utf8(std::mem::take(&mut s.outbuf)).unwrap();
        (out, outcome)
    }

    /// A session that said HELLO, with its client id.
    fn joined(pid: u32, broker: &mut Broker, admission: &Admission) -> (Session, ClientId) {
        let mut s = owner(pid);
        let (_, outcome) = exchange(&mut s, broker, admission, &format!("HELLO 1 s{pid}\n"));
        (s, outcome.joined.unwrap())
    }

    #[test]
    fn hello_comes_first_and_once_and_in_this_version() {
        let (mut broker, adm) = pool(2);
        let mut s = owner(7);
        let (out, outcome) = exchange(&mut s, &mut broker, &adm, "STATUS\n");
        assert_eq!(out, "ERR hello the first request must be HELLO 1 [label]\n");
        assert_eq!(outcome, Outcome::default());
        assert!(s.is_closing() && s.client().is_none());

        let mut s = owner(7);
        let (out, _) = exchange(&mut s, &mut broker, &adm, "HELLO 2\n");
        assert_eq!(
            out,
            "ERR version this broker speaks protocol version 1, not 2\n"
        );
        assert!(s.is_closing());

        let mut s = owner(7);
        let (out, outcome) = exchange(&mut s, &mut broker, &adm, "HELLO 1\nHELLO 1\n");
        let id = outcome.joined.expect("the first HELLO joins");
        assert_eq!(s.client(), Some(id));
        assert_eq!(
            out,
            format!("OK 1 {} 2\nERR hello HELLO was already said\n", id.0)
        );
        assert!(s.is_closing());
        assert_eq!(
            broker.pool().meta(id).unwrap().command,
            "command of 7",
            "no label: its command line"
        );
    }

    #[test]
    fn a_label_names_the_client() {
        let (mut broker, adm) = pool(1);
        let (_, id) = joined(9, &mut broker, &adm);
        assert_eq!(broker.pool().meta(id).unwrap().command, "s9");
    }

    #[test]
    fn an_acquire_that_queues_has_no_reply_and_allows_only_cancel() {
        let (mut broker, adm) = pool(1);
        let (mut a, _) = joined(1, &mut broker, &adm);
        let (mut b, _) = joined(2, &mut broker, &adm);
        assert_eq!(
            exchange(&mut a, &mut broker, &adm, "ACQUIRE 1\n").0,
            "GRANTED 1 1\n"
        );
        let (out, _) = exchange(&mut b, &mut broker, &adm, "ACQUIRE 1\n");
        assert_eq!(out, "", "queued: the reply comes with the grant");
        assert!(b.is_waiting() && !b.is_closing());
        let (out, _) = exchange(&mut b, &mut broker, &adm, "STATUS\n");
        assert_eq!(out, "ERR busy only CANCEL is allowed while ACQUIRE waits\n");
        assert!(b.is_closing());
    }

    #[test]
    fn cancel_withdraws_a_wait() {
        let (mut broker, adm) = pool(1);
        let (mut a, _) = joined(1, &mut broker, &adm);
        let (mut b, bid) = joined(2, &mut broker, &adm);
        exchange(&mut a, &mut broker, &adm, "ACQUIRE 1\n");
        exchange(&mut b, &mut broker, &adm, "ACQUIRE 1\n");
        let (out, _) = exchange(&mut b, &mut broker, &adm, "CANCEL\n");
        assert_eq!(out, "CANCELLED 1\n");
        assert!(!b.is_waiting() && !b.is_closing());
        assert!(broker.status().waiters.is_empty());
        assert_eq!(broker.pool().held_by(bid), 0);
        // It may ask again, and is served in turn.
        assert_eq!(exchange(&mut b, &mut broker, &adm, "TRY 1\n").0, "BUSY 0\n");
    }

    #[test]
    fn a_grant_that_won_the_race_with_cancel_is_sent_before_cancelled() {
        let (mut broker, adm) = pool(1);
        let (mut a, _) = joined(1, &mut broker, &adm);
        let (mut b, bid) = joined(2, &mut broker, &adm);
        exchange(&mut a, &mut broker, &adm, "ACQUIRE 1\n");
        exchange(&mut b, &mut broker, &adm, "ACQUIRE 1\n");
        // A's release files a grant for b, which the loop has not sent yet.
        assert_eq!(
            exchange(&mut a, &mut broker, &adm, "RELEASE 1\n").0,
            "RELEASED 1 0\n"
        );
        let (out, _) = exchange(&mut b, &mut broker, &adm, "CANCEL\n");
        assert_eq!(out, "GRANTED 1 1\nCANCELLED 0\n");
        assert_eq!(broker.pool().held_by(bid), 1, "what GRANTED said is held");
        assert!(
            broker.take_grants(Transport::Socket).is_empty(),
            "sent once, not again by the loop"
        );
        assert!(!b.is_waiting());
    }

    #[test]
    fn a_grant_ends_the_wait() {
        let (mut broker, adm) = pool(1);
        let (mut b, _) = joined(2, &mut broker, &adm);
        b.waiting = true;
        b.granted(1, 1);
        assert!(!b.is_waiting());
        assert_eq!(b.outbuf, b"GRANTED 1 1\n");
    }

    #[test]
    fn the_fast_path_is_for_the_brokers_own_user_and_its_own_layout() {
        let (mut broker, adm) = pool(2);
        let mut m = Session::new(3, 4242, Access::Member);
        exchange(&mut m, &mut broker, &adm, "HELLO 1 member\n");
        let (out, outcome) = exchange(&mut m, &mut broker, &adm, "FASTPATH 1\nTRY 1\n");
        assert!(
            out.starts_with("ERR unavailable the fast path shares the broker's memory: only its own user gets it, not uid 4242\n"),
            "{out}"
        );
        assert!(out.ends_with("GRANTED 1 1\n"), "not fatal: {out}");
        assert!(!outcome.fastpath_asked && !m.is_closing());
        let (mut o, _) = joined(4, &mut broker, &adm);
        let (out, outcome) = exchange(&mut o, &mut broker, &adm, "FASTPATH 3\n");
        assert_eq!(
            out,
            "ERR unavailable this broker's fast path is version 1 (a ring) or 2 (a pile), not 3\n"
        );
        assert!(!outcome.fastpath_asked);
        let (out, outcome) = exchange(&mut o, &mut broker, &adm, "FASTPATH 2\n");
        assert_eq!(out, "");
        assert_eq!((outcome.fastpath_asked, outcome.fastpath_layout), (true, 2));
        o.inbuf.clear();
        // Asked for: the loop answers, with the descriptor; what follows
        // waits until then.
        let (out, outcome) = exchange(&mut o, &mut broker, &adm, "FASTPATH 1\nTRY 1\n");
        assert_eq!(out, "");
        assert_eq!((outcome.fastpath_asked, outcome.fastpath_layout), (true, 1));
        assert_eq!(o.inbuf, b"TRY 1\n");
        // NUDGE only wakes the loop: no reply, and nothing else changes.
        o.inbuf.clear();
        let (out, outcome) = exchange(&mut o, &mut broker, &adm, "NUDGE\nTRY 1\n");
        assert_eq!(out, "GRANTED 1 1\n");
        assert_eq!(outcome, Outcome::default());
    }

    #[test]
    fn a_member_may_not_administer_and_holds_at_most_the_limit() {
        let (mut broker, adm) = pool(2);
        let mut m = Session::new(3, 4242, Access::Member);
        let (_, outcome) = exchange(&mut m, &mut broker, &adm, "HELLO 1 member\n");
        let id = outcome.joined.unwrap();
        for (request, verb) in [
            ("LIMIT 1", "change the limit"),
            ("GATE load 4", "set a gate"),
            ("STOP", "stop the broker"),
        ] {
            let mut m = Session::new(3, 4242, Access::Member);
            m.client = Some(id);
            let (out, outcome) = exchange(&mut m, &mut broker, &adm, &format!("{request}\n"));
            assert_eq!(
                out,
                format!("ERR denied {}\n", adm.admin_refusal(4242, verb))
            );
            assert!(!outcome.stop_asked && m.is_closing());
        }
        assert_eq!(broker.pool().limit(), 2);
        let (out, _) = exchange(&mut m, &mut broker, &adm, "HOLD 3\n");
        assert!(
            out.starts_with("ERR range uid 4242 may hold at most the limit (2)"),
            "{out}"
        );
        assert!(!m.is_closing(), "range is not fatal");
        assert_eq!(
            exchange(&mut m, &mut broker, &adm, "HOLD 2\n").0,
            "GRANTED 2 2\n"
        );
        assert_eq!(broker.pool().held_by(id), 2);
        let (out, _) = exchange(&mut m, &mut broker, &adm, "HOLD 1\n");
        assert!(
            out.starts_with("ERR range"),
            "held + more past the limit: {out}"
        );
    }

    #[test]
    fn the_owner_may_administer() {
        let (mut broker, adm) = pool(2);
        let (mut o, _) = joined(1, &mut broker, &adm);
        assert_eq!(
            exchange(&mut o, &mut broker, &adm, "LIMIT 3\n").0,
            "LIMIT 2 3\n"
        );
        // An owner re-attaching to a broker started smaller is counted
        // whole, past the limit (the pool drains); a member could not.
        assert_eq!(
            exchange(&mut o, &mut broker, &adm, "HOLD 4\n").0,
            "GRANTED 4 4\n"
        );
        assert_eq!(
            exchange(&mut o, &mut broker, &adm, "RELEASE 1\n").0,
            "RELEASED 1 3\n"
        );
        let (out, outcome) = exchange(&mut o, &mut broker, &adm, "STOP\nSTATUS\n");
        assert_eq!(
            out,
            format!("STOPPING {} 1 3\n", std::process::id()),
            "STOP closes: nothing after it is answered"
        );
        assert!(outcome.stop_asked && o.is_closing());
    }

    #[test]
    fn lines_may_end_in_crlf_and_bad_ones_are_malformed_and_fatal() {
        let (mut broker, adm) = pool(2);
        let (mut s, _) = joined(1, &mut broker, &adm);
        assert_eq!(
            exchange(&mut s, &mut broker, &adm, "TRY 1\r\n").0,
            "GRANTED 1 1\n"
        );
        let (out, _) = exchange(&mut s, &mut broker, &adm, "RELEASE x\nRELEASE 1\n");
        assert_eq!(
            out,
            "ERR malformed RELEASE needs one whole number: RELEASE <n>\n"
        );
        assert!(s.is_closing());
    }

    #[test]
    fn over_release_and_range_are_answered_and_not_fatal() {
        let (mut broker, adm) = pool(2);
        let (mut s, _) = joined(1, &mut broker, &adm);
        let (out, _) = exchange(
            &mut s,
            &mut broker,
            &adm,
            "RELEASE 1\nACQUIRE 3\nACQUIRE 0\nTRY 2\n",
        );
        assert_eq!(
            out,
            "ERR over-release cannot give back 1 tokens: only 0 held\n\
             ERR range a client may hold and wait for at most 2 tokens (the limit); this request would make 3\n\
             ERR range a request must be for at least one token\n\
             GRANTED 2 2\n"
        );
        assert!(!s.is_closing());
    }

    #[test]
    fn a_line_may_be_as_long_as_the_bound_and_no_longer() {
        let (mut broker, adm) = pool(2);
        let (mut s, _) = joined(1, &mut broker, &adm);
        // The longest line the bound allows is decoded (and found wrong);
        // one byte more is too long.
        let pad = "x".repeat(MAX_LINE - "TRY 1 \n".len());
        let (out, _) = exchange(&mut s, &mut broker, &adm, &format!("TRY 1 {pad}\n"));
        assert!(
            out.starts_with("ERR malformed "),
            "MAX_LINE bytes are decoded: {out}"
        );
        let (mut s, _) = joined(3, &mut broker, &adm);
        let (out, _) = exchange(&mut s, &mut broker, &adm, &format!("TRY 1 x{pad}\n"));
        assert_eq!(
            out,
            format!("ERR too-long request longer than {MAX_LINE} bytes\n")
        );
        assert!(s.is_closing());
        // A partial line that reaches the bound is refused without its end.
        let (mut s, _) = joined(2, &mut broker, &adm);
        s.receive(&vec![b'x'; MAX_LINE - 1]);
        assert!(!s.has_work(), "one byte short: it may still end");
        let (out, _) = exchange(&mut s, &mut broker, &adm, "x");
        assert_eq!(
            out,
            format!("ERR too-long request longer than {MAX_LINE} bytes\n")
        );
        assert!(s.is_closing() && s.inbuf.is_empty());
    }

    #[test]
    fn a_session_past_the_bound_is_not_served_until_its_client_reads() {
        let (mut broker, adm) = pool(2);
        let (mut s, _) = joined(1, &mut broker, &adm);
        s.outbuf.resize(MAX_UNSENT - 1, b'x');
        assert!(!s.is_over_bound());
        s.outbuf.push(b'x');
        assert!(s.is_over_bound());
        s.receive(b"TRY 1\n");
        assert!(!s.has_work());
        s.process(&mut Context {
            broker: &mut broker,
            admission: &adm,
            command_line: &named,
        });
        assert_eq!(
            s.outbuf.len(),
            MAX_UNSENT,
            "nothing answered past the bound"
        );
        assert_eq!(s.inbuf, b"TRY 1\n", "kept for when it reads");
        s.outbuf.clear();
        assert!(s.has_work());
        assert_eq!(exchange(&mut s, &mut broker, &adm, "").0, "GRANTED 1 1\n");
    }

    #[test]
    fn a_closing_session_reads_nothing_more_and_leaves_the_pool_once() {
        let (mut broker, adm) = pool(2);
        let (mut s, id) = joined(1, &mut broker, &adm);
        assert_eq!(s.hang_up(), Some(id));
        assert_eq!(s.hang_up(), None, "its client leaves the pool once");
        s.receive(b"TRY 1\n");
        assert!(s.inbuf.is_empty() && !s.has_work());
    }

    #[test]
    fn error_codes_of_the_pools_errors() {
        let (mut broker, _) = pool(2);
        let id = broker.connect(ClientMeta::new(1, "make".into(), Transport::Socket));
        let e = broker.release(id, 1).unwrap_err();
        assert_eq!(error_code(&e), ErrorCode::OverRelease);
        let e = broker.acquire(id, 1, 3).unwrap_err();
        assert_eq!(error_code(&e), ErrorCode::Range);
        assert_eq!(error_code(&PoolError::ZeroTokens), ErrorCode::Range);
    }

    #[test]
    fn stop_counts_the_builds_that_hold_or_wait_and_the_tokens_held() {
        let (mut broker, _) = pool(2);
        let ids: Vec<ClientId> = (1..=4)
            .map(|pid| broker.connect(ClientMeta::new(pid, "make".into(), Transport::Socket)))
            .collect();
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
    fn a_successor_receives_the_session_under_the_same_names_but_not_its_rights() {
        let (mut broker, adm) = pool(2);
        let (mut s, id) = joined(5, &mut broker, &adm);
        s.receive(b"TRY");
        s.outbuf.extend_from_slice(b"GRANTED 1 1\n");
        s.waiting = true;
        let json: serde_json::Value = serde_json::to_value(&s).unwrap();
        assert_eq!(
            json.as_object().unwrap().keys().collect::<Vec<_>>(),
            ["client", "closing", "inbuf", "outbuf", "pid", "waiting"],
            "the names an older broker hands over: uid and access are asked of the kernel again"
        );
        let back: Session = serde_json::from_value(json).unwrap();
        assert_eq!(back.client(), Some(id));
        assert_eq!(
            (back.uid, back.access),
            (u32::MAX, Access::Member),
            "no rights until asked"
        );
        assert_eq!(
            Session {
                uid: s.uid,
                access: s.access,
                ..back
            },
            s
        );
    }

    /// A request line, well formed or not, from a small set that reaches
    /// every rule (STATUS aside: its body holds times that differ between
    /// two runs).
    fn request() -> impl Strategy<Value = String> {
        prop_oneof![
            (1u32..4).prop_map(|n| format!("ACQUIRE {n}\n")),
            (1u32..4).prop_map(|n| format!("TRY {n}\n")),
            (1u32..4).prop_map(|n| format!("RELEASE {n}\n")),
            (1u32..4).prop_map(|n| format!("HOLD {n}\n")),
            (1u32..4).prop_map(|n| format!("LIMIT {n}\n")),
            Just("CANCEL\n".to_string()),
            Just("WANTED\n".to_string()),
            Just("HELLO 1\n".to_string()),
            Just("BOGUS\n".to_string()),
            Just("TRY 1\r\n".to_string()),
        ]
    }

    proptest! {
        /// However the bytes arrive (a line split across reads, many lines
        /// in one), the replies and the pool end the same: the framing is
        /// the session's, not the reads'.
        #[test]
        fn replies_do_not_depend_on_how_the_bytes_arrive(
            lines in prop::collection::vec(request(), 1..12),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
            member in any::<bool>(),
        ) {
            let access = if member { Access::Member } else { Access::Owner };
            let wire: String = std::iter::once("HELLO 1 p\n".to_string()).chain(lines).collect();
            let run = |chunks: Vec<&[u8]>| {
                let (mut broker, adm) = pool(2);
                let mut s = Session::new(1, 4242, access);
                let mut stop = false;
                for chunk in chunks {
                    s.receive(chunk);
                    stop |= s.process(&mut Context { broker: &mut broker, admission: &adm, command_line: &named }).stop_asked;
                }
                let status = broker.status();
                prop_assert_eq!(status.free, status.limit.saturating_sub(status.held), "the books balance");
                Ok((s, stop, status.held, status.limit, status.waiters.len()))
            };
            let whole = run(vec![wire.as_bytes()])?;
            let mut at: Vec<usize> = cuts.iter().map(|i| i.index(wire.len())).collect();
            at.sort();
            at.dedup();
            let mut chunks = Vec::new();
            let mut from = 0;
            for cut in at {
                chunks.push(&wire.as_bytes()[from..cut]);
                from = cut;
            }
            chunks.push(&wire.as_bytes()[from..]);
            let pieces = run(chunks)?;
            prop_assert_eq!(String::from_utf8_lossy(&whole.0.outbuf), String::from_utf8_lossy(&pieces.0.outbuf));
            prop_assert_eq!((whole.0.is_waiting(), whole.0.is_closing()), (pieces.0.is_waiting(), pieces.0.is_closing()));
            prop_assert_eq!((whole.1, whole.2, whole.3, whole.4), (pieces.1, pieces.2, pieces.3, pieces.4));
            if member {
                prop_assert_eq!(whole.3, 2, "a member never changes the limit");
                prop_assert!(!whole.1, "nor stops the broker");
            }
        }
    }
}
