//! The GNU jobserver bridge that `baton run` drives: a private FIFO (or
//! pipe, or FUSE token file) per build, fed from the pool.
//!
//! Unmodified make, ninja and cargo take tokens by reading a byte from a
//! pipe or FIFO named in MAKEFLAGS and give them back by writing one. The
//! bridge keeps a build's tokens, written back or unread, and fills its FIFO
//! with every free token ahead of its reads, as long as no other build waits
//! (ninja 1.13 reads a token only as it starts a job and stops at the first
//! empty read). While the build has spare tokens, the feeder asks the broker
//! whether other builds wait, at most every 50 ms (and on every change while
//! they do), and gives them the spare tokens: see `feeder`. The broker
//! decides which waiting build is served next (fair shares by weight).
//!
//! Both styles read from the same FIFO. `fifo:PATH` clients (make ≥ 4.4,
//! ninja 1.13, cargo) open it by path for reading and writing, so a busy
//! build that writes a token back can read it again before we see it: to
//! take tokens back from it, a blocking reader of ours gets there first
//! (see `claw`). The pipe
//! style (`R,W`, what GNU make 4.3 knows) closes that gap: R reads the FIFO,
//! but W is a separate pipe only we read, so every token given back reaches
//! the pool's queue. The FUSE style closes it for `fifo:` clients.
//!
//! It reaches the broker only through `baton-client` and the documented
//! protocol (docs/protocol.md), never through the broker's internals; and
//! the system calls no safe wrapper covers only through `sys`.
#![deny(missing_docs)]

mod autostart;
mod bmake;
mod build_file;
mod choice;
mod claw;
// Public for its test, which needs a process of its own (tests/close_later.rs).
#[doc(hidden)]
pub mod close_later;
mod feeder;
mod fifo;
mod log;
mod probe;
mod run;
mod submakes;
mod sys;

pub use autostart::{log_path as autostart_log_path, Autostart, LazyAutostart};
use feeder::Feeder;
use fifo::Fifo;
pub use run::{run, RunOptions};

/// The feeder's pure rules, for the fuzz targets (fuzz/) only.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::feeder::{plan, should_look, spare, Plan, Seen, Wanted};
}

use std::ffi::OsString;
use std::path::Path;

/// How the build is told where its jobserver is. The variants' docs are
/// `baton run --help`'s text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Style {
    /// --jobserver-auth=R,W (GNU make 4.3 and 4.4, gcc's LTO, cargo): tokens come back
    /// through a pipe only baton reads, so builds take strict turns
    Pipe,
    /// --jobserver-auth=fifo:PATH, a private FIFO (make >= 4.4, ninja 1.13,
    /// cargo)
    Fifo,
    /// fifo: a file on the broker's FUSE mount, one wake-up per token even
    /// for make's pselect() (make >= 4.4, cargo; not ninja)
    Fuse,
    /// the form every client the build may start reads: pipe where make < 4.4
    /// or gcc < 13 is found (ninja 1.13: only if it runs make); else make >=
    /// 4.4 and cargo: fuse (fifo without a mount); ninja and the rest: fifo;
    /// a Python program (pip, meson, scons), which closes inherited
    /// descriptors: fifo
    Auto,
    /// No jobserver: only hold the tokens
    None,
}

/// `MAKEFLAGS` for the build, laid out as GNU make writes its own
/// (`s -j2 --jobserver-auth=3,4 --no-print-directory -- V=1`): the cluster
/// of one-letter flags first (empty: a leading space), then `-jN` and the
/// auth string, then the other long options, then `--` and the variables.
/// Any older `-j` or jobserver setting is dropped (clients use the last
/// `--jobserver-auth`, but gcc's lto-wrapper takes the first), and the
/// variables are kept as they were, escaped spaces and all.
fn makeflags(inherited: Option<&str>, jobs: u32, auth: &str) -> String {
    let inherited = inherited.unwrap_or("");
    let (options, variables) = split_variables(inherited);
    let mut words = options.split_whitespace().peekable();
    let letters = words.next_if(|w| !w.starts_with('-')).unwrap_or("");
    let mut flags = format!("{letters} -j{jobs} --jobserver-auth={auth}");
    for word in words.filter(|w| !is_jobs_flag(w)) {
        flags.push(' ');
        flags.push_str(word);
    }
    if let Some(variables) = variables {
        flags.push_str(" -- ");
        flags.push_str(variables);
    }
    flags
}

/// MAKEFLAGS's options, and the variable definitions after its ` -- `.
fn split_variables(makeflags: &str) -> (&str, Option<&str>) {
    if let Some(rest) = makeflags.strip_prefix("-- ") {
        return ("", Some(rest));
    }
    match makeflags.split_once(" -- ") {
        Some((options, variables)) => (options, Some(variables)),
        None => (makeflags, None),
    }
}

/// Whether the command is a jobserver client that reads its jobserver as
/// soon as it starts (GNU make, ninja, cargo): its tokens can be put in
/// reach before it opens the FIFO.
fn reads_its_jobserver(command: &[OsString]) -> bool {
    let name = program_name(command);
    matches!(name.as_str(), "ninja" | "cargo") || choice::is_make_name(&name)
}

/// Whether the command polls its jobserver and no other descriptor in the
/// same poll: GNU make ≥ 4.4 (`pselect()` on the token descriptor alone)
/// and cargo (the jobserver crate's helper thread). bmake polls its jobs'
/// output beside it; the caller rules bmake out by what it is.
fn polls_its_jobserver_alone(command: &[OsString]) -> bool {
    let name = program_name(command);
    name == "cargo" || choice::is_make_name(&name)
}

/// The file name of the command's program ("make" for "/usr/bin/make").
fn program_name(command: &[OsString]) -> String {
    Path::new(&command[0])
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn is_jobs_flag(word: &str) -> bool {
    // "--jobs" begins --jobs, --jobs=N, --jobserver-auth= and --jobserver-fds=.
    word.starts_with("--jobs")
        || (word.starts_with("-j") && word[2..].bytes().all(|b| b.is_ascii_digit()))
}

/// Removes the files in `dir` that `baton run`s killed before they could
/// remove their own left behind: those whose name gives (`pid_in`) the
/// pid of a process that no longer runs.
fn sweep_left_by_dead_runs(dir: &std::path::Path, pid_in: impl Fn(&str) -> Option<u32>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = pid_in(&entry.file_name().to_string_lossy()) else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_gnu_make_and_cargo_poll_their_jobserver_alone() {
        let alone = |program: &str| polls_its_jobserver_alone(&[OsString::from(program)]);
        assert!(alone("/usr/bin/make") && alone("gmake") && alone("cargo"));
        // bmake polls its jobs' output beside it; ninja never polls the
        // FUSE file (it refuses it); anything else, we cannot know.
        assert!(!alone("bmake") && !alone("ninja") && !alone("sh") && !alone("cmake"));
    }

    /// Each expectation is what GNU make 4.3 and 4.4.1 write themselves
    /// (`make -j2 …` with a recipe that prints $MAKEFLAGS).
    #[test]
    fn makeflags_are_laid_out_as_gnu_make_writes_them() {
        assert_eq!(makeflags(None, 2, "3,4"), " -j2 --jobserver-auth=3,4");
        assert_eq!(makeflags(Some("s"), 2, "3,4"), "s -j2 --jobserver-auth=3,4");
        assert_eq!(
            makeflags(Some("ks --no-print-directory"), 2, "3,4"),
            "ks -j2 --jobserver-auth=3,4 --no-print-directory"
        );
        assert_eq!(
            makeflags(Some(" -- V=1"), 2, "fifo:/f"),
            " -j2 --jobserver-auth=fifo:/f -- V=1"
        );
        assert_eq!(
            makeflags(Some("-- V=1"), 2, "3,4"),
            " -j2 --jobserver-auth=3,4 -- V=1"
        );
    }

    #[test]
    fn makeflags_replace_older_jobserver_settings_and_keep_variables_whole() {
        assert_eq!(
            makeflags(
                Some("ks -j8 --jobserver-auth=3,4 --no-print-directory"),
                4,
                "5,6"
            ),
            "ks -j4 --jobserver-auth=5,6 --no-print-directory"
        );
        assert_eq!(
            makeflags(
                Some(" -j --jobserver-fds=3,4 --jobserver-auth=3,4"),
                3,
                "fifo:/y"
            ),
            " -j3 --jobserver-auth=fifo:/y"
        );
        assert_eq!(
            makeflags(Some("s -j2 -- CFLAGS=-O2\\ -j8"), 2, "3,4"),
            "s -j2 --jobserver-auth=3,4 -- CFLAGS=-O2\\ -j8"
        );
    }

    #[test]
    fn make_4_3_is_refused_a_fifo_but_not_a_pipe() {
        // The make 4.3 the suite names (scripts/test; crates/baton/tests
        // use the same), which must be that version: a 4.4 would prove
        // nothing here, and returning early would count as a pass.
        let path = std::env::var_os("BATON_TEST_MAKE43").unwrap_or_else(|| "/usr/bin/make".into());
        let make43 = || vec![path.clone()];
        let probes = probe::Probes::open(None);
        let found = choice::gnu_make(&probes, Path::new(&path));
        assert!(
            found
                .as_ref()
                .is_some_and(|m| (m.version.0, m.version.1) == (4, 3)),
            "{} is {}, not GNU make 4.3: set BATON_TEST_MAKE43 to a GNU make 4.3 \
             (scripts/test names Debian's /usr/bin/make)",
            Path::new(&path).display(),
            found.map_or("no GNU make".to_string(), |m| format!(
                "GNU make {}",
                m.version
            )),
        );
        for style in [Style::Fifo, Style::Fuse] {
            assert!(
                choice::unusable(&probes, &make43(), style)
                    .is_some_and(|e| e.contains("pipe or auto")),
                "{style:?}"
            );
        }
        for style in [Style::Pipe, Style::Auto, Style::None] {
            assert_eq!(
                choice::unusable(&probes, &make43(), style),
                None,
                "{style:?}"
            );
        }
        assert_eq!(
            choice::unusable(&probes, &["ninja".into()], Style::Fifo),
            None
        );
    }

    #[test]
    fn known_clients_read_their_jobserver() {
        for yes in ["ninja", "/usr/bin/make", "cargo", "gmake"] {
            assert!(reads_its_jobserver(&[yes.into()]), "{yes}");
        }
        for no in ["sh", "cmake", "bmake", "sleep"] {
            assert!(!reads_its_jobserver(&[no.into()]), "{no}");
        }
    }

    /// A directory of one test's own under the temporary directory, removed
    /// (with all it holds) when dropped, even by a failing test.
    pub(crate) struct Scratch(pub(crate) std::path::PathBuf);

    impl Scratch {
        pub(crate) fn new(test: &str) -> Scratch {
            let dir =
                std::env::temp_dir().join(format!("baton-jobserver-{test}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        /// Writes `text` to `name` (directories created as needed).
        pub(crate) fn file(&self, name: &str, text: &str) -> std::path::PathBuf {
            let path = self.0.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, text).unwrap();
            path
        }

        /// An executable `name` that runs `body` in sh. `install` copies it
        /// into place in a process of its own, so that no descriptor of
        /// ours open for writing (inherited by a child another test forks
        /// at that moment) can make its exec fail with ETXTBSY.
        pub(crate) fn tool(&self, name: &str, body: &str) -> std::path::PathBuf {
            let source = self.file(&format!("{name}.source"), &format!("#!/bin/sh\n{body}\n"));
            let tool = self.0.join(name);
            let installed = std::process::Command::new("install")
                .arg("-m")
                .arg("755")
                .arg(&source)
                .arg(&tool)
                .status()
                .unwrap();
            assert!(installed.success(), "install {}", tool.display());
            tool
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn make_4_4_the_first_to_read_fifo_is_not_refused_one() {
        let scratch = Scratch::new("make44");
        let make = scratch.tool("make", "echo 'GNU Make 4.4'");
        let probes = probe::Probes::open(None);
        for style in [Style::Fifo, Style::Fuse] {
            assert_eq!(
                choice::unusable(&probes, &[make.clone().into()], style),
                None,
                "{style:?}"
            );
        }
        let make43 = scratch.tool("old/make", "echo 'GNU Make 4.3'");
        assert!(choice::unusable(&probes, &[make43.into()], Style::Fifo)
            .is_some_and(|e| e.starts_with("GNU make 4.3 cannot open a fifo")));
    }

    #[test]
    fn jobs_flags_in_every_spelling_are_replaced() {
        for word in [
            "--jobs",
            "--jobs=8",
            "-j",
            "-j8",
            "--jobserver-auth=3,4",
            "--jobserver-fds=3,4",
        ] {
            assert!(is_jobs_flag(word), "{word}");
        }
        for word in ["-k", "-jx", "--no-print-directory", "-s"] {
            assert!(!is_jobs_flag(word), "{word}");
        }
        assert_eq!(
            makeflags(Some("k --jobs=8 --no-print-directory"), 2, "3,4"),
            "k -j2 --jobserver-auth=3,4 --no-print-directory"
        );
        assert_eq!(
            makeflags(Some(" --jobs --jobserver-auth=fifo:/x"), 4, "fifo:/y"),
            " -j4 --jobserver-auth=fifo:/y"
        );
    }

    #[test]
    fn files_of_dead_runs_are_swept_and_those_of_live_ones_kept() {
        let scratch = Scratch::new("sweep");
        // A run that has ended: its pid is no process now (pids are
        // handed out in turn, not reused at once).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let pid_in = |name: &str| name.strip_prefix("run-")?.parse().ok();
        let dead_file = scratch.file(&format!("run-{dead}"), "");
        let live_file = scratch.file(&format!("run-{}", std::process::id()), "");
        let other = scratch.file("notes", "");
        sweep_left_by_dead_runs(&scratch.0, pid_in);
        assert!(!dead_file.exists(), "the dead run's file is removed");
        assert!(live_file.exists(), "a running baton's file is kept");
        assert!(other.exists(), "a file named for no run is kept");
        // A missing directory is nothing to sweep, not an error.
        sweep_left_by_dead_runs(&scratch.0.join("missing"), pid_in);
    }
}
