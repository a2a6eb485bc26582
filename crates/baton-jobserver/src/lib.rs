//! The GNU jobserver bridge that `baton run` drives: a private FIFO (or
//! pipe, or FUSE token file) per build, fed from the pool.
//!
//! Unmodified make, ninja and cargo take tokens by reading a byte from a
//! pipe or FIFO named in MAKEFLAGS and give them back by writing one. The
//! bridge keeps at most one fresh token waiting in the build's FIFO. When the
//! build reads it, inotify tells us (IN_ACCESS) and we queue at the pool for
//! the next one, behind every other waiter. A token the build writes back
//! (IN_MODIFY) goes straight back to the pool, not to the build's next job:
//! otherwise a busy build would recycle its tokens forever and a build that
//! started later would never get a turn. So tokens enter a build only as it
//! uses them, the herd a FIFO causes is bounded by one build, and builds
//! take turns at the pool's one queue (oldest request first).
//!
//! Both styles read from the same FIFO. `fifo:PATH` clients (make ≥ 4.4,
//! ninja 1.13, cargo) open it by path for reading and writing, so a busy
//! build that writes a token back can read it again before we see it: it
//! keeps its tokens until we win that race or it runs out of work. The pipe
//! style (`R,W`, what GNU make 4.3 knows) closes that gap: R reads the FIFO,
//! but W is a separate pipe only we read, so every token given back reaches
//! the pool's queue. The FUSE style closes it for `fifo:` clients.
//!
//! It reaches the broker only through `baton-client` and the documented
//! protocol (docs/protocol.md), never through the broker's internals.
#![deny(missing_docs)]

mod autostart;
mod build_file;
mod feeder;
mod fifo;
mod log;
mod run;

use feeder::Feeder;
use fifo::Fifo;
pub use autostart::{log_path as autostart_log_path, Autostart};
pub use run::{run, RunOptions};

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// How the build is told where its jobserver is. The variants' docs are
/// `baton run --help`'s text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Style {
    /// --jobserver-auth=R,W (GNU make 4.3 and 4.4, cargo): tokens come back
    /// through a pipe only baton reads, so builds take strict turns
    Pipe,
    /// --jobserver-auth=fifo:PATH, a private FIFO (make >= 4.4, ninja 1.13,
    /// cargo)
    Fifo,
    /// fifo: a file on the broker's FUSE mount, one wake-up per token even
    /// for make's pselect() (make >= 4.4, cargo; not ninja)
    Fuse,
    /// ninja: fifo; GNU make < 4.4: pipe; make >= 4.4 and cargo: fuse if the
    /// broker has a mount, else fifo; anything else: fifo, or pipe if the
    /// make on PATH is older than 4.4
    Auto,
    /// No jobserver: only hold the tokens
    None,
}

/// What `auto` picks for a command.
///
/// - ninja → `fifo` (ninja 1.13 accepts only a real FIFO);
/// - GNU make older than 4.4 → `pipe` (it rejects `fifo:` and stops);
/// - GNU make 4.4 or later, and cargo → `fuse` (one wake-up per token),
///   which falls back to `fifo` where the broker has no FUSE mount;
/// - anything else (cmake, a script) → `fifo`, unless the `make` first on
///   PATH is older than 4.4: a script or build script that runs it would
///   stop on `fifo:`, and every client here also speaks `R,W`.
fn choose_style(command: &[OsString]) -> Style {
    let program = Path::new(&command[0]);
    let name = program.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if name == "ninja" {
        return Style::Fifo;
    }
    if name == "cargo" {
        return Style::Fuse;
    }
    let is_make = is_make_name(&name);
    let make = if is_make { program.to_path_buf() } else { PathBuf::from("make") };
    match gnu_make_version(&make) {
        Some(version) if version < (4, 4) => Style::Pipe,
        Some(_) if is_make => Style::Fuse,
        _ => Style::Fifo,
    }
}

fn is_make_name(name: &str) -> bool {
    matches!(name, "make" | "gmake" | "gnumake") || (name.ends_with("make") && !name.ends_with("cmake") && !name.ends_with("bmake"))
}

/// `(major, minor)` from `make --version`, if it is GNU make.
fn gnu_make_version(make: &Path) -> Option<(u32, u32)> {
    let out = Command::new(make).arg("--version").env_remove("MAKEFLAGS").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.lines().next()?.strip_prefix("GNU Make ")?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
}

/// `MAKEFLAGS` for the build: the flags it already had, without any older
/// jobserver or `-j` settings (clients use the last `--jobserver-auth`, but a
/// stale one is a trap for tools that take the first), then ours.
fn makeflags(inherited: Option<&str>, auth: &str) -> String {
    let kept: Vec<&str> = inherited
        .unwrap_or("")
        .split_whitespace()
        .filter(|w| !is_jobs_flag(w))
        .collect();
    let ours = format!("-j --jobserver-auth={auth}");
    match kept.first() {
        // A first word without a dash is a cluster of one-letter flags
        // ("ks" is -k -s); it must stay first to keep that meaning.
        Some(_) => format!("{} {ours}", kept.join(" ")),
        None => ours,
    }
}

fn is_jobs_flag(word: &str) -> bool {
    word.starts_with("--jobserver-auth=")
        || word.starts_with("--jobserver-fds=")
        || word.starts_with("--jobs")
        || (word.starts_with("-j") && word[2..].bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn makeflags_keep_other_flags_and_replace_jobserver_ones() {
        assert_eq!(makeflags(None, "fifo:/x"), "-j --jobserver-auth=fifo:/x");
        assert_eq!(makeflags(Some("ks -j8 --jobserver-auth=3,4 --no-print-directory"), "5,6"), "ks --no-print-directory -j --jobserver-auth=5,6");
        assert_eq!(makeflags(Some(" -j --jobserver-fds=3,4"), "fifo:/y"), "-j --jobserver-auth=fifo:/y");
    }

    #[test]
    fn make_names() {
        assert!(is_make_name("make") && is_make_name("gmake") && is_make_name("gnumake"));
        assert!(!is_make_name("cmake") && !is_make_name("ninja") && !is_make_name("bmake"));
    }

    #[test]
    fn ninja_gets_a_fifo() {
        assert_eq!(choose_style(&["ninja".into(), "-C".into(), "out".into()]), Style::Fifo);
    }
}
