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
use std::os::unix::process::CommandExt;
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
    // SAFETY: setsid is async-signal-safe and touches no memory.
    unsafe {
        command.pre_exec(|| match libc::setsid() {
            -1 => Err(std::io::Error::last_os_error()),
            _ => Ok(()),
        });
    }
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
