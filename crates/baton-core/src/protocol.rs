//! The native wire protocol: one request per line, one reply line per
//! request. docs/protocol.md is the contract; this module is its code, used
//! by both the broker and the Rust client so they cannot drift apart.
//!
//! Lines are ASCII words separated by single spaces and ended by `\n`. A line
//! may be at most [`MAX_LINE`] bytes, newline included.

use std::fmt;

/// Protocol version spoken by this code. HELLO names the version a client
/// speaks; the broker refuses versions it does not know.
pub const VERSION: u32 = 1;

/// The longest request line, newline included. Every request fits in a
/// fraction of this; the bound lets the broker refuse a client that streams
/// bytes without a newline instead of buffering them without end.
pub const MAX_LINE: usize = 256;

/// The longest client label accepted in HELLO (it is shown by status).
pub const MAX_LABEL: usize = 200;

/// The extended attribute of a FUSE token file that says how its pollers
/// are served: `hold` (the file's users poll nothing else, as GNU make
/// ≥ 4.4 and the jobserver crate do: a poll that would wait is answered
/// only when a token is there or its thread gets a signal) or `notify`
/// (answered "not ready" at once and woken later, as any file; the
/// default). docs/fuse.md, "Held polls".
pub const FUSE_POLLS_XATTR: &str = "user.baton.polls";
/// [`FUSE_POLLS_XATTR`]'s value for held polls.
pub const FUSE_POLLS_HOLD: &[u8] = b"hold";
/// [`FUSE_POLLS_XATTR`]'s value for polls answered at once (the default).
pub const FUSE_POLLS_NOTIFY: &[u8] = b"notify";

/// A request from client to broker.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// `HELLO <version> [<label>]`: must come first.
    Hello {
        /// Protocol version the client speaks.
        version: u32,
        /// Free text shown by status (a command line, say).
        label: String,
    },
    /// `ACQUIRE <n>`: block until n tokens are granted.
    Acquire(u32),
    /// `TRY <n>`: take n tokens only if free now.
    Try(u32),
    /// `RELEASE <n>`: give back n tokens.
    Release(u32),
    /// `CANCEL`: withdraw a pending ACQUIRE.
    Cancel,
    /// `STATUS`: the broker's state as JSON.
    Status,
    /// `LIMIT <n>`: change the pool's limit.
    Limit(u32),
    /// `GATE <name> <value|off>`: set or clear one gate's threshold
    /// (docs/adaptive.md): `mem-available` in bytes, `mem-pressure` in
    /// percent, `load` in runnable tasks, `min-jobs` in tokens.
    Gate {
        /// Which gate.
        name: String,
        /// The new threshold; None: `off`.
        value: Option<f64>,
    },
    /// `BUILD <weight> [<name>]`: this connection starts a build (a
    /// `baton run`): clients under its process join it, and the build's
    /// share of a busy pool is in proportion to `weight`.
    Build {
        /// The build's weight, 1 to [`crate::MAX_WEIGHT`].
        weight: u32,
        /// Shown by status; empty: the connection's label.
        name: String,
    },
    /// `WANTED`: how many tokens other builds wait for, and how many are free.
    Wanted,
    /// `HOLD <n>`: count n tokens this client already holds, granted by a
    /// broker that went away, as its own (a `baton run` re-attaching).
    Hold(u32),
    /// `STOP`: the broker stops as on SIGTERM (`baton stop`).
    Stop,
    /// `STRAY <n>`: the bridge took n bytes out of its build's jobserver
    /// that the pool never lent (written by a client that gave back more
    /// than it took, or by a stranger); counted in the build's status.
    Stray(u32),
    /// `FASTPATH <version>`: asks for a seat in the shared-memory fast
    /// path of this connection's build (docs/fastpath.md); the reply
    /// carries the region's descriptor (SCM_RIGHTS).
    Fastpath(u32),
    /// `NUDGE`: a fast-path client tells the broker to look at its region
    /// (it claimed a ticket behind the barrier, or returned a token
    /// there). No reply.
    Nudge,
}

/// The fast path's layout version that `FASTPATH` names.
pub const FASTPATH_VERSION: u32 = 1;
/// The layout `FASTPATH` names to ask for a pile: tokens anyone may take,
/// in no order (docs/fastpath.md, "The pile").
pub const FASTPATH_PILE: u32 = 2;

/// The names GATE accepts.
pub const GATE_NAMES: [&str; 4] = ["mem-available", "mem-pressure", "load", "min-jobs"];

/// A reply from broker to client.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// `OK <version> <client-id> <limit>`: answer to HELLO.
    Hello {
        /// Protocol version the broker speaks.
        version: u32,
        /// The broker's id for this connection.
        client: u64,
        /// The pool's limit.
        limit: u32,
    },
    /// `GRANTED <n> <held>`: n tokens are yours; you now hold `held`.
    Granted {
        /// Tokens granted by this reply.
        tokens: u32,
        /// Tokens the connection holds now.
        held: u32,
    },
    /// `BUSY <free>`: TRY found too few free tokens (or a queue ahead).
    Busy {
        /// Tokens free at that moment.
        free: u32,
    },
    /// `RELEASED <n> <held>`: n tokens went back; you now hold `held`.
    Released {
        /// Tokens given back.
        tokens: u32,
        /// Tokens the connection still holds.
        held: u32,
    },
    /// `CANCELLED <n>`: the pending wait for n tokens is withdrawn (0: none
    /// was pending, e.g. because GRANTED was already sent).
    Cancelled {
        /// Tokens the withdrawn request waited for.
        tokens: u32,
    },
    /// `STATUS <bytes>` followed by exactly `bytes` bytes of JSON and `\n`.
    Status {
        /// The document, see [`crate::status::Status`].
        json: String,
    },
    /// `LIMIT <old> <new>`.
    Limit {
        /// The limit before.
        old: u32,
        /// The limit now.
        new: u32,
    },
    /// `GATE <name> <value|off>`: the gate's threshold now.
    Gate {
        /// Which gate.
        name: String,
        /// Its threshold; None: off.
        value: Option<f64>,
    },
    /// `BUILD <build-id> <weight>`: answer to BUILD.
    Build {
        /// The broker's id for the build.
        build: u64,
        /// The build's weight now.
        weight: u32,
    },
    /// `WANTED <tokens> <free>`: answer to WANTED.
    Wanted {
        /// Tokens that requests of other builds wait for.
        tokens: u32,
        /// Tokens nobody holds.
        free: u32,
    },
    /// `STRAY <total>`: answer to STRAY: the stray bytes taken out of the
    /// build's jobserver so far.
    Stray {
        /// All the build's stray bytes so far.
        total: u32,
    },
    /// `STOPPING <pid> <builds> <held>`: answer to STOP; the broker
    /// closes the connection as it exits.
    Stopping {
        /// The broker's pid.
        pid: u32,
        /// Builds that hold or wait for tokens: they carry on without it.
        builds: u32,
        /// Tokens held at that moment.
        held: u32,
    },
    /// `FASTPATH <seat> <bytes>`: answer to FASTPATH; the region's
    /// descriptor rides with it, `bytes` long; the client is `seat`.
    Fastpath {
        /// The client's seat in the region.
        seat: u32,
        /// The region's length in bytes.
        bytes: u32,
    },
    /// `ERR <code> <message>`.
    Err {
        /// What kind of error.
        code: ErrorCode,
        /// What happened, for people.
        message: String,
    },
}

/// The environment variable `baton run` gives its command, naming its own
/// pid: every process of the build inherits it, so the broker finds the
/// build's processes after `baton run` died and they were re-parented, and
/// keeps their tokens until they end (docs/jobserver.md, #32).
pub const RUN_PID_VAR: &str = "BATON_RUN_PID";

/// Machine-readable error codes. Fatal ones close the connection after the
/// reply (its tokens go back to the pool); the others leave it usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// The line is not a request of this protocol. Fatal.
    Malformed,
    /// The line is longer than MAX_LINE. Fatal.
    TooLong,
    /// HELLO names a version the broker does not speak. Fatal.
    Version,
    /// The first request was not HELLO, or HELLO came twice. Fatal.
    Hello,
    /// A request other than CANCEL while ACQUIRE is pending. Fatal.
    Busy,
    /// RELEASE of more tokens than the connection holds. Refused, not fatal.
    OverRelease,
    /// A count out of range (0, above the limit or the per-client cap).
    Range,
    /// The broker cannot take more clients now. Fatal.
    Full,
    /// The broker does not serve the connecting user (docs/security.md).
    /// Fatal.
    Denied,
    /// The fast path is not offered to this connection (another user, a
    /// region full of seats, an old kernel): it stays on the socket. Not
    /// fatal.
    Unavailable,
}

impl ErrorCode {
    /// The code's word on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Malformed => "malformed",
            ErrorCode::TooLong => "too-long",
            ErrorCode::Version => "version",
            ErrorCode::Hello => "hello",
            ErrorCode::Busy => "busy",
            ErrorCode::OverRelease => "over-release",
            ErrorCode::Range => "range",
            ErrorCode::Full => "full",
            ErrorCode::Denied => "denied",
            ErrorCode::Unavailable => "unavailable",
        }
    }

    /// The code named by a word on the wire.
    pub fn parse(word: &str) -> Option<Self> {
        Some(match word {
            "malformed" => ErrorCode::Malformed,
            "too-long" => ErrorCode::TooLong,
            "version" => ErrorCode::Version,
            "hello" => ErrorCode::Hello,
            "busy" => ErrorCode::Busy,
            "over-release" => ErrorCode::OverRelease,
            "range" => ErrorCode::Range,
            "full" => ErrorCode::Full,
            "denied" => ErrorCode::Denied,
            "unavailable" => ErrorCode::Unavailable,
            _ => return None,
        })
    }

    /// Whether the broker closes the connection after this error.
    pub fn is_fatal(self) -> bool {
        !matches!(
            self,
            ErrorCode::OverRelease | ErrorCode::Range | ErrorCode::Unavailable
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a line could not be parsed; becomes `ERR malformed <reason>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

fn malformed(msg: impl Into<String>) -> ParseError {
    ParseError(msg.into())
}

/// Parses one request line, without its `\n`.
pub fn parse_request(line: &[u8]) -> Result<Request, ParseError> {
    let line = std::str::from_utf8(line).map_err(|_| malformed("request is not UTF-8 text"))?;
    let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
    let count = |what: &str| parse_count(rest, what);
    match verb {
        "HELLO" => {
            let (version, label) = rest.split_once(' ').unwrap_or((rest, ""));
            let version = parse_number(version)
                .ok_or_else(|| malformed("HELLO needs a protocol version: HELLO 1 [label]"))?;
            check_label(label, "HELLO label")?;
            Ok(Request::Hello {
                version,
                label: label.to_string(),
            })
        }
        "ACQUIRE" => count("ACQUIRE").map(Request::Acquire),
        "TRY" => count("TRY").map(Request::Try),
        "RELEASE" => count("RELEASE").map(Request::Release),
        "HOLD" => count("HOLD").map(Request::Hold),
        "STRAY" => count("STRAY").map(Request::Stray),
        "FASTPATH" => count("FASTPATH").map(Request::Fastpath),
        "LIMIT" => count("LIMIT").map(Request::Limit),
        "GATE" => parse_gate(rest).map(|(name, value)| Request::Gate { name, value }),
        "BUILD" => {
            let (weight, name) = rest.split_once(' ').unwrap_or((rest, ""));
            let weight = parse_number(weight)
                .ok_or_else(|| malformed("BUILD needs a weight: BUILD <weight> [name]"))?;
            check_label(name, "BUILD name")?;
            Ok(Request::Build {
                weight,
                name: name.to_string(),
            })
        }
        "WANTED" if rest.is_empty() => Ok(Request::Wanted),
        "CANCEL" if rest.is_empty() => Ok(Request::Cancel),
        "STATUS" if rest.is_empty() => Ok(Request::Status),
        "STOP" if rest.is_empty() => Ok(Request::Stop),
        "NUDGE" if rest.is_empty() => Ok(Request::Nudge),
        "CANCEL" | "STATUS" | "WANTED" | "STOP" | "NUDGE" => {
            Err(malformed(format!("{verb} takes no arguments")))
        }
        "" => Err(malformed("empty request")),
        _ => Err(malformed(format!(
            "unknown request {:?}",
            truncate(verb, 32)
        ))),
    }
}

fn parse_gate(rest: &str) -> Result<(String, Option<f64>), ParseError> {
    let usage = || {
        malformed(format!(
            "GATE needs a name ({}) and a value or off: GATE mem-available 2147483648",
            GATE_NAMES.join(", ")
        ))
    };
    let (name, value) = rest.split_once(' ').ok_or_else(usage)?;
    if !GATE_NAMES.contains(&name) {
        return Err(usage());
    }
    let value = match value {
        "off" => None,
        v => Some(parse_decimal(v).ok_or_else(usage)?),
    };
    Ok((name.to_string(), value))
}

/// A non-negative decimal such as `12` or `12.5`: digits, at most one dot.
/// Below [`MAX_DECIMAL`], so that the value the broker echoes back (its
/// shortest form) is one this accepts: 24 nines would round to 1e24,
/// whose 25 digits the client would refuse.
fn parse_decimal(word: &str) -> Option<f64> {
    let plain = !word.is_empty()
        && word.len() <= 24
        && word.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && word.bytes().filter(|&b| b == b'.').count() <= 1;
    plain
        .then(|| word.parse().ok())
        .flatten()
        .filter(|&v| v < MAX_DECIMAL)
}

/// Gate values are below this (no threshold comes near).
const MAX_DECIMAL: f64 = 1e24;

fn gate_value(value: Option<f64>) -> String {
    value.map_or_else(|| "off".to_string(), |v| v.to_string())
}

fn check_label(label: &str, what: &str) -> Result<(), ParseError> {
    if label.len() > MAX_LABEL || label.chars().any(char::is_control) {
        return Err(malformed(format!(
            "{what} must be at most {MAX_LABEL} bytes of printable text"
        )));
    }
    Ok(())
}

fn parse_count(rest: &str, verb: &str) -> Result<u32, ParseError> {
    parse_number(rest)
        .ok_or_else(|| malformed(format!("{verb} needs one whole number: {verb} <n>")))
}

/// Strict decimal: digits only, no sign, no spaces, fits in u32.
fn parse_number(word: &str) -> Option<u32> {
    if word.is_empty() || word.len() > 10 || !word.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    word.parse().ok()
}

fn truncate(s: &str, max: usize) -> &str {
    match s.char_indices().nth(max) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

impl fmt::Display for Request {
    /// The request's line, without `\n`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Request::Hello { version, label } if label.is_empty() => write!(f, "HELLO {version}"),
            Request::Hello { version, label } => write!(f, "HELLO {version} {label}"),
            Request::Acquire(n) => write!(f, "ACQUIRE {n}"),
            Request::Try(n) => write!(f, "TRY {n}"),
            Request::Release(n) => write!(f, "RELEASE {n}"),
            Request::Cancel => f.write_str("CANCEL"),
            Request::Status => f.write_str("STATUS"),
            Request::Limit(n) => write!(f, "LIMIT {n}"),
            Request::Gate { name, value } => write!(f, "GATE {name} {}", gate_value(*value)),
            Request::Build { weight, name } if name.is_empty() => write!(f, "BUILD {weight}"),
            Request::Build { weight, name } => write!(f, "BUILD {weight} {name}"),
            Request::Wanted => f.write_str("WANTED"),
            Request::Hold(n) => write!(f, "HOLD {n}"),
            Request::Stop => f.write_str("STOP"),
            Request::Stray(n) => write!(f, "STRAY {n}"),
            Request::Fastpath(n) => write!(f, "FASTPATH {n}"),
            Request::Nudge => f.write_str("NUDGE"),
        }
    }
}

impl Reply {
    /// The reply's bytes on the wire, newline(s) included.
    pub fn encode(&self) -> Vec<u8> {
        let line = match self {
            Reply::Hello {
                version,
                client,
                limit,
            } => format!("OK {version} {client} {limit}\n"),
            Reply::Granted { tokens, held } => format!("GRANTED {tokens} {held}\n"),
            Reply::Busy { free } => format!("BUSY {free}\n"),
            Reply::Released { tokens, held } => format!("RELEASED {tokens} {held}\n"),
            Reply::Cancelled { tokens } => format!("CANCELLED {tokens}\n"),
            Reply::Status { json } => format!("STATUS {}\n{json}\n", json.len()),
            Reply::Limit { old, new } => format!("LIMIT {old} {new}\n"),
            Reply::Gate { name, value } => format!("GATE {name} {}\n", gate_value(*value)),
            Reply::Build { build, weight } => format!("BUILD {build} {weight}\n"),
            Reply::Wanted { tokens, free } => format!("WANTED {tokens} {free}\n"),
            Reply::Stopping { pid, builds, held } => format!("STOPPING {pid} {builds} {held}\n"),
            Reply::Stray { total } => format!("STRAY {total}\n"),
            Reply::Fastpath { seat, bytes } => format!("FASTPATH {seat} {bytes}\n"),
            Reply::Err { code, message } => format!("ERR {code} {}\n", message.replace('\n', " ")),
        };
        line.into_bytes()
    }
}

/// Parses a reply's first line (without `\n`). For `STATUS <bytes>` the JSON
/// that follows must be read separately: this returns
/// `ReplyHead::StatusFollows(bytes)`.
pub fn parse_reply_line(line: &str) -> Result<ReplyHead, ParseError> {
    let mut words = line.split(' ');
    let verb = words.next().unwrap_or("");
    let mut num = || {
        words
            .next()
            .and_then(parse_number)
            .ok_or_else(|| malformed(format!("bad reply {line:?}")))
    };
    let reply = match verb {
        "OK" => Reply::Hello {
            version: num()?,
            client: u64::from(num()?),
            limit: num()?,
        },
        "GRANTED" => Reply::Granted {
            tokens: num()?,
            held: num()?,
        },
        "BUSY" => Reply::Busy { free: num()? },
        "RELEASED" => Reply::Released {
            tokens: num()?,
            held: num()?,
        },
        "CANCELLED" => Reply::Cancelled { tokens: num()? },
        "LIMIT" => Reply::Limit {
            old: num()?,
            new: num()?,
        },
        "BUILD" => Reply::Build {
            build: u64::from(num()?),
            weight: num()?,
        },
        "WANTED" => Reply::Wanted {
            tokens: num()?,
            free: num()?,
        },
        "STOPPING" => Reply::Stopping {
            pid: num()?,
            builds: num()?,
            held: num()?,
        },
        "STRAY" => Reply::Stray { total: num()? },
        "FASTPATH" => Reply::Fastpath {
            seat: num()?,
            bytes: num()?,
        },
        "STATUS" => return Ok(ReplyHead::StatusFollows(num()? as usize)),
        "GATE" => {
            let (name, value) = parse_gate(line.strip_prefix("GATE ").unwrap_or(""))
                .map_err(|_| malformed(format!("bad reply {line:?}")))?;
            Reply::Gate { name, value }
        }
        "ERR" => {
            let rest = line.strip_prefix("ERR ").unwrap_or("");
            let (code, message) = rest.split_once(' ').unwrap_or((rest, ""));
            let code = ErrorCode::parse(code)
                .ok_or_else(|| malformed(format!("unknown error code in {line:?}")))?;
            Reply::Err {
                code,
                message: message.to_string(),
            }
        }
        _ => return Err(malformed(format!("unknown reply {line:?}"))),
    };
    Ok(ReplyHead::Complete(reply))
}

/// The first line of a reply, parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyHead {
    /// A reply of one line.
    Complete(Reply),
    /// `STATUS <bytes>`: that many bytes of JSON and a `\n` follow.
    StatusFollows(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let requests = [
            Request::Hello {
                version: 1,
                label: "make -C src".into(),
            },
            Request::Hello {
                version: 1,
                label: String::new(),
            },
            Request::Acquire(3),
            Request::Try(1),
            Request::Release(2),
            Request::Cancel,
            Request::Status,
            Request::Limit(8),
            Request::Gate {
                name: "mem-available".into(),
                value: Some(2147483648.0),
            },
            Request::Gate {
                name: "mem-pressure".into(),
                value: Some(12.5),
            },
            Request::Gate {
                name: "load".into(),
                value: None,
            },
            Request::Build {
                weight: 2,
                name: "ninja -C out".into(),
            },
            Request::Build {
                weight: 1,
                name: String::new(),
            },
            Request::Wanted,
            Request::Hold(3),
            Request::Stop,
            Request::Stray(77),
            Request::Fastpath(1),
            Request::Nudge,
        ];
        for r in requests {
            assert_eq!(parse_request(r.to_string().as_bytes()), Ok(r));
        }
    }

    #[test]
    fn numbers_are_strict() {
        for bad in [
            "ACQUIRE",
            "ACQUIRE ",
            "ACQUIRE -1",
            "ACQUIRE +1",
            "ACQUIRE 1 2",
            "ACQUIRE 99999999999",
            "ACQUIRE x",
        ] {
            assert!(
                parse_request(bad.as_bytes()).is_err(),
                "{bad} should be refused"
            );
        }
    }

    #[test]
    fn garbage_is_refused() {
        for bad in [
            &b""[..],
            b"acquire 1",
            b"STATUS now",
            b"WANTED 1",
            b"BUILD",
            b"BUILD x",
            b"\xff\xfe",
            b"HELLO",
            b"HELLO 1 a\x07b",
        ] {
            assert!(parse_request(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn a_refusal_says_what_was_wrong() {
        let said = |line: &[u8]| parse_request(line).unwrap_err().to_string();
        for verb in ["CANCEL", "STATUS", "WANTED", "STOP", "NUDGE"] {
            let line = format!("{verb} 1");
            assert!(
                said(line.as_bytes()).contains(&format!("{verb} takes no arguments")),
                "{line}: {}",
                said(line.as_bytes())
            );
        }
        assert!(said(b"").contains("empty request"), "{}", said(b""));
        assert!(
            said(b"FLY 1").contains("unknown request"),
            "{}",
            said(b"FLY 1")
        );
    }

    #[test]
    fn boundaries_of_labels_and_counts() {
        let hello = |label: &str| parse_request(format!("HELLO 1 {label}").as_bytes());
        assert!(hello(&"x".repeat(MAX_LABEL)).is_ok());
        assert!(hello(&"x".repeat(MAX_LABEL + 1)).is_err());
        assert_eq!(
            parse_request(b"ACQUIRE 4294967295"),
            Ok(Request::Acquire(u32::MAX))
        );
        assert!(parse_request(b"ACQUIRE 00000000001").is_err(), "11 digits");
        let long = "Y".repeat(100);
        let said = parse_request(long.as_bytes()).unwrap_err().to_string();
        assert!(said.contains(&"Y".repeat(32)), "{said}");
        assert!(!said.contains(&"Y".repeat(33)), "cut to 32: {said}");
    }

    #[test]
    fn empty_labels_leave_no_trailing_space() {
        let hello = Request::Hello {
            version: 1,
            label: String::new(),
        };
        assert_eq!(hello.to_string(), "HELLO 1");
        let build = Request::Build {
            weight: 2,
            name: String::new(),
        };
        assert_eq!(build.to_string(), "BUILD 2");
    }

    #[test]
    fn replies_round_trip() {
        let replies = [
            Reply::Hello {
                version: 1,
                client: 7,
                limit: 4,
            },
            Reply::Granted { tokens: 1, held: 2 },
            Reply::Busy { free: 0 },
            Reply::Released { tokens: 1, held: 0 },
            Reply::Cancelled { tokens: 1 },
            Reply::Limit { old: 4, new: 8 },
            Reply::Gate {
                name: "load".into(),
                value: Some(3.0),
            },
            Reply::Gate {
                name: "min-jobs".into(),
                value: None,
            },
            Reply::Build {
                build: 3,
                weight: 2,
            },
            Reply::Wanted { tokens: 2, free: 0 },
            Reply::Stray { total: 78 },
            Reply::Fastpath {
                seat: 3,
                bytes: 12800,
            },
            Reply::Stopping {
                pid: 42,
                builds: 2,
                held: 3,
            },
            Reply::Err {
                code: ErrorCode::OverRelease,
                message: "cannot give back 2 tokens: only 1 held".into(),
            },
        ];
        for r in replies {
            let wire = String::from_utf8(r.encode()).unwrap();
            let line = wire.strip_suffix('\n').unwrap();
            assert_eq!(parse_reply_line(line), Ok(ReplyHead::Complete(r)));
        }
    }

    #[test]
    fn every_error_code_reads_back_and_only_three_leave_the_connection_open() {
        use ErrorCode::*;
        let codes = [
            Malformed,
            TooLong,
            Version,
            Hello,
            Busy,
            OverRelease,
            Range,
            Full,
            Denied,
            Unavailable,
        ];
        for code in codes {
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code), "{code}");
        }
        assert_eq!(ErrorCode::parse("nope"), None);
        let open: Vec<_> = codes.into_iter().filter(|c| !c.is_fatal()).collect();
        assert_eq!(open, [OverRelease, Range, Unavailable]);
    }

    #[test]
    fn status_reply_carries_its_length() {
        let wire = Reply::Status {
            json: "{\"limit\":4}".into(),
        }
        .encode();
        assert_eq!(wire, b"STATUS 11\n{\"limit\":4}\n");
        assert_eq!(
            parse_reply_line("STATUS 11"),
            Ok(ReplyHead::StatusFollows(11))
        );
    }

    #[test]
    fn bad_gate_requests_are_malformed() {
        for line in [
            "GATE",
            "GATE load",
            "GATE load -1",
            "GATE load abc",
            "GATE nope 3",
            "GATE load 1.2.3",
            "GATE load 3 4",
        ] {
            assert!(parse_request(line.as_bytes()).is_err(), "{line} accepted");
        }
        assert_eq!(
            parse_request(b"GATE min-jobs 2"),
            Ok(Request::Gate {
                name: "min-jobs".into(),
                value: Some(2.0)
            })
        );
    }

    /// Caught by the protocol fuzz target's round-trip check: 24 nines were accepted as
    /// 1e24, which the broker's reply spells with 25 digits, a line the
    /// client refused.
    #[test]
    fn an_accepted_gate_value_comes_back_in_a_form_that_is_accepted() {
        assert!(parse_request(b"GATE load 999999999999999999999999").is_err());
        let largest = parse_request(b"GATE load 999999999999999900000000").unwrap();
        assert_eq!(parse_request(largest.to_string().as_bytes()), Ok(largest));
    }
}
