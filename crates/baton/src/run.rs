//! `baton run -- CMD`: hold tokens from the broker while CMD runs.
//!
//! The tokens belong to this process's connection, so if it is killed the
//! broker takes them back at once; CMD gets SIGKILL through the parent-death
//! signal, so it cannot run on holding nothing.

use crate::{log, paths};
use anyhow::{Context, Result};
use baton_client::Client;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use std::ffi::OsString;
use std::io::ErrorKind;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};

/// What `baton run` was asked to do.
pub struct RunOptions {
    pub socket: Option<PathBuf>,
    pub tokens: u32,
    pub command: Vec<OsString>,
}

/// Runs the command; returns the exit code `baton run` should exit with.
pub fn run(opts: RunOptions) -> Result<i32> {
    let socket = absolute(&paths::socket_path(opts.socket));
    let mut client = Client::connect(&socket, &label(&opts.command))?;
    client.acquire(opts.tokens).context("waiting for tokens")?;

    let forwarded = forwarded_signals();
    forwarded.thread_block().context("cannot block signals")?;
    let signals = SignalFd::with_flags(&forwarded, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)?;

    let mut command = Command::new(&opts.command[0]);
    command.args(&opts.command[1..]).env("BATON_SOCKET", &socket);
    let child = match spawn_tied_to_us(&mut command, forwarded) {
        Ok(child) => child,
        Err(e) => return Ok(report_spawn_error(&opts.command[0], e)),
    };
    let status = supervise(child, &signals, &mut client, &socket)?;
    Ok(exit_code(status))
}

/// Starts CMD with the signal mask restored and the parent-death signal set,
/// so that CMD dies with us however we die.
fn spawn_tied_to_us(command: &mut Command, blocked: SigSet) -> std::io::Result<Child> {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls.
    unsafe {
        command.pre_exec(move || {
            blocked.thread_unblock().map_err(std::io::Error::from)?;
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // We may have died before prctl took effect.
            if libc::getppid() != parent {
                libc::_exit(137);
            }
            Ok(())
        });
    }
    command.spawn()
}

/// Waits for CMD to end, forwarding stop signals, and noticing (once) if
/// the broker goes away.
fn supervise(mut child: Child, signals: &SignalFd, client: &mut Client, socket: &Path) -> Result<ExitStatus> {
    let pidfd = pidfd_open(child.id())?;
    let mut broker_alive = true;
    loop {
        let mut fds = vec![
            PollFd::new(pidfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        let client_fd = unsafe { BorrowedFd::borrow_raw(client.as_raw_fd()) };
        if broker_alive {
            fds.push(PollFd::new(client_fd, PollFlags::POLLIN));
        }
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e).context("poll failed"),
        }
        let ready = |i: usize| fds.get(i).and_then(|f| f.revents()).is_some_and(|r| !r.is_empty());
        let (child_done, got_signal, broker_event) = (ready(0), ready(1), ready(2));
        if got_signal {
            forward_signals(signals, child.id());
        }
        if broker_event {
            // No request is pending, so anything readable is the end.
            broker_alive = false;
            log::warn(format_args!(
                "lost the broker at {}; the command goes on, but its tokens are no longer counted",
                socket.display()
            ));
        }
        if child_done {
            let status = child.wait().context("cannot collect the command's status")?;
            if broker_alive {
                give_back(client);
            }
            return Ok(status);
        }
    }
}

/// Returns our tokens explicitly, so the broker counts them as released
/// rather than reclaimed. If this fails the broker reclaims them anyway
/// when our connection closes.
fn give_back(client: &mut Client) {
    let held = client.held();
    if held > 0 {
        let _ = client.release(held);
    }
}

/// Signals someone sent to `baton run` go on to CMD. Terminal signals
/// (SIGINT, SIGQUIT from the keyboard) already reach CMD through its
/// process group, so those are not sent twice.
fn forward_signals(signals: &SignalFd, child: u32) {
    while let Ok(Some(info)) = signals.read_signal() {
        let from_kernel = info.ssi_code == libc::SI_KERNEL;
        let is_terminal_signal = matches!(info.ssi_signo as i32, libc::SIGINT | libc::SIGQUIT);
        if from_kernel && is_terminal_signal {
            continue;
        }
        // SAFETY: plain kill(2) on the child we spawned and have not reaped.
        unsafe { libc::kill(child as libc::pid_t, info.ssi_signo as i32) };
    }
}

fn forwarded_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP, Signal::SIGQUIT] {
        set.add(s);
    }
    set
}

fn pidfd_open(pid: u32) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("pidfd_open failed (Linux 5.3 or later is needed)");
    }
    // SAFETY: the fd was just returned to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A shell's exit codes: 127 not found, 126 found but not runnable.
fn report_spawn_error(program: &OsString, e: std::io::Error) -> i32 {
    let name = program.to_string_lossy();
    match e.kind() {
        ErrorKind::NotFound => {
            log::warn(format_args!("{name}: command not found"));
            127
        }
        _ => {
            log::warn(format_args!("{name}: cannot run: {e}"));
            126
        }
    }
}

/// CMD's exit code, or 128 + the signal that killed it.
fn exit_code(status: ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn label(command: &[OsString]) -> String {
    let words: Vec<_> = command.iter().map(|w| w.to_string_lossy()).collect();
    format!("baton run -- {}", words.join(" "))
}

/// CMD may change directory; the socket path it inherits must still work.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}
