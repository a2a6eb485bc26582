//! Starting a broker on first use: when nothing answers at the socket,
//! `baton run` starts one in the background and goes on, as sccache starts
//! its server.
//!
//! Concurrent first calls start exactly one: each takes an exclusive lock
//! on `<socket>.autostart` before it looks again and starts a broker, so the
//! later ones find the first one's broker serving. (The broker's own lock on
//! `<socket>.lock` still keeps a broker started by hand at the same moment
//! from serving beside it.)

use anyhow::{bail, Context, Result};
use baton_client::{Client, Error as ClientError};
use baton_core::paths::private_dir;
use nix::fcntl::{Flock, FlockArg};
use std::ffi::OsString;
use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A broker that takes longer than this to listen is taken to be stuck
/// (a FUSE mount that hangs, say); its log says why.
const START_LIMIT: Duration = Duration::from_secs(30);
/// Brokers started, one after the other, before giving up (see
/// `start_then_connect`).
const START_ATTEMPTS: u32 = 3;

/// How to start a broker for a socket nobody serves.
#[derive(Debug, Clone)]
pub struct Autostart {
    /// The broker's program (`baton`).
    pub program: PathBuf,
    /// Its arguments (`serve --jobs N --idle-timeout S`).
    pub args: Vec<OsString>,
    /// A line for stderr once the broker we started serves: a broker
    /// started at an unusual socket (a mistyped `--socket`) is a second
    /// limit the user should hear of.
    pub announce: Option<String>,
}

/// Works out an [`Autostart`] only when a broker must start: a `baton run`
/// that finds one running (nearly every one) skips the work (counting
/// CPUs reads the cgroup's files; finding our own program, a link).
pub type LazyAutostart = Box<dyn Fn() -> Result<Autostart>>;

/// Connects to the broker at `socket`; if none answers and `autostart` is
/// given, starts one (detached, logging to [`log_path`]) and connects to it.
///
/// # Errors
/// No broker answers and none may or could be started, or the broker
/// refuses the connection.
pub fn connect(socket: &Path, label: &str, autostart: Option<&LazyAutostart>) -> Result<Client> {
    match (Client::connect(socket, label), autostart) {
        // Disconnected: we reached a broker that was stopping, idle.
        (Err(ClientError::NoBroker { .. } | ClientError::Disconnected), Some(start)) => {
            start_then_connect(socket, label, &start()?)
        }
        (client, _) => Ok(client?),
    }
}

/// Where an auto-started broker writes its log: beside its socket.
pub fn log_path(socket: &Path) -> PathBuf {
    private_dir(socket).join("broker.log")
}

fn start_then_connect(socket: &Path, label: &str, start: &Autostart) -> Result<Client> {
    let dir = private_dir(socket);
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .with_context(|| format!("cannot create the directory {}", dir.display()))?;
    refuse_unless_ours(&dir)?;
    let _only_us = lock_autostart(socket)?;
    // Whoever held the lock before us has started one.
    let mut attempts = 1;
    while !serving(socket) {
        let log = log_path(socket);
        let mut broker = spawn_detached(start, &log)?;
        match wait_until_serving(socket, &mut broker, &log) {
            Ok(()) => {
                if let Some(line) = &start.announce {
                    eprintln!("baton: {line}");
                }
                break;
            }
            // A broker stopping as idle holds its lock until it is gone;
            // ours then finds the socket taken and stops at once.
            Err(_) if attempts < START_ATTEMPTS => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return Err(e),
        }
        attempts += 1;
    }
    Ok(Client::connect(socket, label)?)
}

/// The directory we are about to write into, judged by lstat as the broker
/// and the client judge it: another user may have made it first.
fn refuse_unless_ours(dir: &Path) -> Result<()> {
    let meta =
        std::fs::symlink_metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let facts = (&meta).into();
    let me = nix::unistd::getuid().as_raw();
    let strict = baton_core::paths::is_default_private_dir(dir);
    match baton_core::paths::private_dir_problem(dir, facts, me, strict) {
        Some(problem) => bail!("{problem}"),
        None => Ok(()),
    }
}

fn lock_autostart(socket: &Path) -> Result<Flock<File>> {
    let path = baton_core::paths::autostart_lock_path(socket);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    Flock::lock(file, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .with_context(|| format!("cannot lock {}", path.display()))
}

/// A bare connect, no HELLO: the probe takes no client id.
fn serving(socket: &Path) -> bool {
    UnixStream::connect(socket).is_ok()
}

/// A log past this size is moved aside (to `broker.log.old`, replacing the
/// one before) when the next broker starts: a machine's log stays below
/// about twice this, plus what one broker writes in its life.
pub const LOG_KEPT_BYTES: u64 = 1 << 20;

/// Starts the broker in a session of its own, so that neither the build's
/// end nor the terminal's hang-up stops it, with its output in `log`.
fn spawn_detached(start: &Autostart, log: &Path) -> Result<Child> {
    if std::fs::metadata(log).is_ok_and(|m| m.len() > LOG_KEPT_BYTES) {
        let _ = std::fs::rename(log, log.with_extension("log.old"));
    }
    let log_file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(log)
        .with_context(|| format!("cannot open the broker's log {}", log.display()))?;
    let mut command = Command::new(&start.program);
    command
        .args(&start.args)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file);
    crate::sys::in_a_session_of_its_own(&mut command);
    command
        .spawn()
        .with_context(|| format!("cannot start a broker ({})", start.program.display()))
}

fn wait_until_serving(socket: &Path, broker: &mut Child, log: &Path) -> Result<()> {
    let started = Instant::now();
    while !serving(socket) {
        if let Some(status) = broker.try_wait().context("cannot wait for the broker")? {
            bail!(
                "the broker started for {} stopped ({status}): {} (its log: {})",
                socket.display(),
                last_line(log),
                log.display()
            );
        }
        if started.elapsed() > START_LIMIT {
            bail!(
                "the broker started for {} (pid {}) is not listening after {} s; its log is {}",
                socket.display(),
                broker.id(),
                START_LIMIT.as_secs(),
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// What a broker that stopped at once said last (why it stopped).
fn last_line(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .rev()
        .find(|line| !line.trim().is_empty())
        .unwrap_or("it said nothing")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::Scratch;

    fn program(script: &str) -> Autostart {
        Autostart {
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            announce: None,
        }
    }

    #[test]
    fn the_log_of_a_broker_started_for_a_socket_is_beside_it() {
        assert_eq!(
            log_path(Path::new("/run/user/1000/baton/socket")),
            PathBuf::from("/run/user/1000/baton/broker.log")
        );
    }

    #[test]
    fn a_socket_is_served_only_while_something_listens_there() {
        let scratch = Scratch::new("serving");
        let socket = scratch.0.join("socket");
        assert!(!serving(&socket), "nothing there");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        assert!(serving(&socket));
        drop(listener);
        assert!(!serving(&socket), "a socket file nobody listens on");
    }

    #[test]
    fn a_directory_that_is_a_link_or_no_directory_is_refused() {
        let scratch = Scratch::new("ours");
        let dir = scratch.0.join("dir");
        std::fs::create_dir(&dir).unwrap();
        assert!(refuse_unless_ours(&dir).is_ok());
        let link = scratch.0.join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(refuse_unless_ours(&link).is_err_and(|e| e.to_string().contains("symbolic link")));
        let file = scratch.file("file", "");
        assert!(refuse_unless_ours(&file).is_err_and(|e| e.to_string().contains("not a directory")));
        assert!(refuse_unless_ours(&scratch.0.join("missing")).is_err());
    }

    #[test]
    fn only_a_log_past_a_mebibyte_is_moved_aside() {
        let scratch = Scratch::new("log-kept");
        let log = scratch.0.join("broker.log");
        let old = scratch.0.join("broker.log.old");
        let start = program("echo started >&2");
        let run = |log: &Path| spawn_detached(&start, log).unwrap().wait().unwrap();
        std::fs::write(&log, "one broker's life\n").unwrap();
        run(&log);
        assert!(!old.exists(), "a short log is kept");
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "one broker's life\nstarted\n",
            "and the next broker writes after it"
        );
        std::fs::write(&log, vec![b'x'; LOG_KEPT_BYTES as usize]).unwrap();
        run(&log);
        assert!(!old.exists(), "at the size, not past it: kept");
        std::fs::write(&log, vec![b'x'; LOG_KEPT_BYTES as usize + 1]).unwrap();
        run(&log);
        assert_eq!(
            std::fs::metadata(&old).unwrap().len(),
            LOG_KEPT_BYTES + 1,
            "moved aside whole"
        );
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "started\n");
    }

    #[test]
    fn a_broker_that_stops_before_it_serves_is_reported_with_its_last_words() {
        let scratch = Scratch::new("stopped");
        let (socket, log) = (scratch.0.join("socket"), scratch.0.join("broker.log"));
        // It runs a moment, as a broker that fails to mount does, then
        // says why and stops.
        let start = program(
            "echo starting >&2; sleep 0.1; echo 'error: cannot bind' >&2; echo >&2; exit 1",
        );
        let mut broker = spawn_detached(&start, &log).unwrap();
        let e = wait_until_serving(&socket, &mut broker, &log).unwrap_err();
        let said = e.to_string();
        assert!(
            said.contains("stopped") && said.contains(": error: cannot bind (its log: "),
            "{said}"
        );
    }

    #[test]
    fn a_broker_is_waited_for_until_it_serves() {
        let scratch = Scratch::new("serves");
        let (socket, log) = (scratch.0.join("socket"), scratch.0.join("broker.log"));
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let mut broker = spawn_detached(&program("exit 0"), &log).unwrap();
        assert!(wait_until_serving(&socket, &mut broker, &log).is_ok());
        broker.wait().unwrap();
    }

    #[test]
    fn the_last_line_a_broker_wrote_says_why_it_stopped() {
        let scratch = Scratch::new("last-line");
        let log = scratch.file("log", "starting\nerror: no such mount point\n\n  \n");
        assert_eq!(last_line(&log), "error: no such mount point");
        let empty = scratch.file("empty", "\n");
        assert_eq!(last_line(&empty), "it said nothing");
        assert_eq!(last_line(&scratch.0.join("missing")), "it said nothing");
    }
}
