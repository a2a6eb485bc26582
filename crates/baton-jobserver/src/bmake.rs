//! bmake (NetBSD's make, FreeBSD's `make`, Debian's `bmake`): how to
//! recognise it, the jobserver form it takes, and its abort tokens.
//!
//! What bmake expects, from its `job.c` and `main.c` (NetBSD usr.bin/make,
//! sjg's portable bmake) and checked against Debian's bmake 20200710:
//!
//! - It parses `MAKEFLAGS` as its own command-line flags. The jobserver is
//!   `-J R,W` (inherited descriptors) with `-j N`; GNU's `-j
//!   --jobserver-auth=R,W` makes it stop at once ("illegal argument to -j").
//!   Descriptors that are not open are ignored and it makes its own pipe.
//!   It passes `-J R,W -j N` on to its sub-makes itself.
//! - Tokens are `+`. Every bmake runs one job without a token; when it has
//!   no job running it still reads a token, to look for an abort, and
//!   writes it straight back.
//! - The read end must be non-blocking: EAGAIN means "no token now"; a
//!   blocking read end hangs it once its jobs have ended. Its own pipe's
//!   read end is `O_NONBLOCK`, its write end blocking.
//! - A job that fails (without `-k`) makes it write an abort token, `E`
//!   (`I` after an interrupt), for every token it gives back, each time
//!   after draining the pipe. A bmake that reads one drains the pipe, puts
//!   the abort token back for the next, and stops: "A failure has been
//!   detected in another branch of the parallel make". With `-k` no abort
//!   token is written.
//! - Whether it waits on the pipe differs by version: job.c of 2020
//!   (NetBSD 1.326, Debian's 20200710) never polls the token descriptor
//!   and tries again only when one of its own jobs ends (or after 5 s);
//!   the 2018 FreeBSD bmake and job.c of 2022 (1.451) poll it once a read
//!   found it empty (`wantToken`). Either way a token must be in the pipe
//!   when bmake looks, and tokens bmake gives back reach the pool only
//!   through the pipe style's separate return pipe.

use crate::probe::Probes;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use std::os::fd::{AsFd, RawFd};
use std::path::Path;

/// bmake's token byte; any other byte in its pipe is an abort token.
pub const TOKEN: u8 = b'+';

/// Whether `program` is bmake, asked of the program itself: FreeBSD's and
/// NetBSD's `make` are bmake, and so may be a `make` first on PATH. Only
/// the names bmake goes by are asked (`make`, `bmake`, `pmake`, `bsdmake`,
/// and `bmake-VERSION`), so that no other tool (qmake, automake) is ever
/// run with flags it might act on. `-V` prints a variable and builds
/// nothing; GNU make rejects it.
///
/// Its answer is bmake's `MAKE_VERSION` (a date, as `20200710`; empty if
/// it has none); None if it is not bmake.
pub fn version(probes: &Probes, program: &Path) -> Option<String> {
    let name = program
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if !(matches!(name.as_str(), "make" | "bmake" | "pmake" | "bsdmake")
        || name.starts_with("bmake-"))
    {
        return None;
    }
    let answer = probes.ask(
        program,
        &["-r", "-f", "/dev/null", "-V", ".MAKE", "-V", "MAKE_VERSION"],
    )?;
    let mut lines = answer.stdout.lines();
    let is_bmake = answer.ok && lines.next().is_some_and(|l| !l.trim().is_empty());
    is_bmake.then(|| lines.next().unwrap_or("").trim().to_string())
}

/// `MAKEFLAGS` for a bmake build: the flags it already had, without any
/// jobserver or `-j` setting (bmake's two-word `-J R,W` and `-j N`, GNU's
/// one-word forms), then `-J R,W -j N`. (GNU make 4.3 reads `-J` as its
/// `--jobserver-auth` and finds the same pipe; make 4.4.1 rejects it.)
pub fn makeflags(inherited: Option<&str>, read: RawFd, write: RawFd, jobs: u32) -> String {
    let mut kept = Vec::new();
    let mut words = inherited.unwrap_or("").split_whitespace();
    while let Some(word) = words.next() {
        match word {
            // The value is the next word.
            "-J" | "-j" => {
                words.next();
            }
            w if crate::is_jobs_flag(w) || w.starts_with("-J") => {}
            w => kept.push(w),
        }
    }
    let (pipe, jobs) = (format!("{read},{write}"), jobs.to_string());
    kept.extend(["-J", &pipe, "-j", &jobs]);
    kept.join(" ")
}

/// bmake takes EAGAIN as "no token now" and hangs on a blocking read end.
/// The flag is on the open file description every sub-make shares.
pub fn make_non_blocking(read: impl AsFd) -> nix::Result<()> {
    let flags = OFlag::from_bits_truncate(fcntl(read.as_fd(), FcntlArg::F_GETFL)?);
    fcntl(read.as_fd(), FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map(drop)
}

/// Bytes a bmake build wrote back, sorted: tokens, and the abort token if
/// one came (`E` or `I`; the first one seen is kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Returns {
    pub tokens: u32,
    pub abort: Option<u8>,
}

impl Returns {
    pub fn sort(bytes: &[u8]) -> Returns {
        let tokens = bytes.iter().filter(|&&b| b == TOKEN).count() as u32;
        Returns {
            tokens,
            abort: bytes.iter().copied().find(|&b| b != TOKEN),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn makeflags_replace_both_jobserver_forms() {
        assert_eq!(makeflags(None, 5, 6, 8), "-J 5,6 -j 8");
        // What bmake passes its sub-makes, and what GNU make does.
        assert_eq!(
            makeflags(Some(" -j 4 -J 15,16 .MAKE.LEVEL.ENV=MAKELEVEL"), 5, 6, 8),
            ".MAKE.LEVEL.ENV=MAKELEVEL -J 5,6 -j 8"
        );
        assert_eq!(
            makeflags(Some("k -j4 --jobserver-auth=3,4"), 5, 6, 2),
            "k -J 5,6 -j 2"
        );
        assert_eq!(makeflags(Some("-J3,4 -j"), 5, 6, 2), "-J 5,6 -j 2");
    }

    #[test]
    fn abort_bytes_are_not_tokens() {
        assert_eq!(
            Returns::sort(b"++"),
            Returns {
                tokens: 2,
                abort: None
            }
        );
        assert_eq!(
            Returns::sort(b"+E+E"),
            Returns {
                tokens: 2,
                abort: Some(b'E')
            }
        );
        assert_eq!(
            Returns::sort(b"I"),
            Returns {
                tokens: 0,
                abort: Some(b'I')
            }
        );
    }

    #[test]
    fn only_make_names_are_asked() {
        let probes = Probes::open(None);
        for program in ["cmake", "qmake", "/no/such/bmake"] {
            assert_eq!(version(&probes, Path::new(program)), None, "{program}");
        }
    }

    #[test]
    fn bmake_is_recognised_by_its_answer_to_dash_v() {
        let scratch = crate::tests::Scratch::new("bmake-version");
        // What Debian's bmake prints for `-V .MAKE -V MAKE_VERSION`.
        let bmake = "echo bmake; echo 20200710";
        let probes = Probes::open(None);
        for name in ["bmake", "make", "bmake-20200710"] {
            let program = scratch.tool(name, bmake);
            assert_eq!(
                version(&probes, &program).as_deref(),
                Some("20200710"),
                "{name}"
            );
        }
        let no_version = scratch.tool("pmake", "echo pmake");
        assert_eq!(version(&probes, &no_version).as_deref(), Some(""));
    }

    #[test]
    fn a_make_that_fails_or_prints_no_dot_make_is_not_bmake() {
        let scratch = crate::tests::Scratch::new("not-bmake");
        let probes = Probes::open(None);
        let fails = scratch.tool("make", "echo 'make: invalid option'; exit 2");
        assert_eq!(version(&probes, &fails), None, "it exited 2");
        let silent = scratch.tool("quiet/make", "exit 0");
        assert_eq!(version(&probes, &silent), None, "it printed nothing");
        let blank = scratch.tool("blank/make", "echo; echo 20200710");
        assert_eq!(version(&probes, &blank), None, "its .MAKE is empty");
    }

    #[test]
    fn the_read_end_is_made_non_blocking_and_stays_so() {
        let (read, _write) = nix::unistd::pipe().unwrap();
        let non_blocking = |fd: &std::os::fd::OwnedFd| {
            OFlag::from_bits_truncate(fcntl(fd.as_fd(), FcntlArg::F_GETFL).unwrap())
                .contains(OFlag::O_NONBLOCK)
        };
        assert!(!non_blocking(&read));
        make_non_blocking(&read).unwrap();
        assert!(non_blocking(&read));
        // Asked again (as for every build sharing the pipe): still so.
        make_non_blocking(&read).unwrap();
        assert!(non_blocking(&read));
        // So an empty pipe answers EAGAIN, bmake's "no token now".
        let mut byte = [0u8];
        let read = std::fs::File::from(read);
        assert_eq!(
            std::io::Read::read(&mut &read, &mut byte)
                .unwrap_err()
                .kind(),
            std::io::ErrorKind::WouldBlock
        );
    }
}
