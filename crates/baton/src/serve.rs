//! `baton serve`: start the broker, serve until SIGTERM/SIGINT, clean up.

use crate::broker::{Broker, Transport};
use crate::socket::SocketServer;
use crate::spin::SpinPolicy;
use crate::{fuse, log, paths};
use anyhow::{Context, Result};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// What `baton serve` was asked to do.
pub struct ServeOptions {
    pub jobs: u32,
    pub socket: Option<PathBuf>,
    /// How the FUSE token files wake pollers; None: no FUSE mount.
    pub fuse: Option<fuse::Mode>,
    /// Longest spin of the socket loop before it sleeps, in µs (crate::spin).
    pub spin_us: u64,
    /// Send replies and sleep in one system call where io_uring allows
    /// (crate::uring).
    pub io_uring: bool,
}

pub fn serve(opts: ServeOptions) -> Result<()> {
    // Only the directories baton chooses itself are tightened to 0700.
    let chosen_by_us = opts.socket.is_none() && std::env::var_os("BATON_SOCKET").is_none_or(|v| v.is_empty());
    let socket = paths::socket_path(opts.socket);
    let dir = paths::private_dir(&socket);
    paths::prepare_private_dir(&dir, chosen_by_us)?;
    let _lock = paths::lock_socket(&socket)?;
    paths::clear_stale_socket(&socket)?;
    raise_fd_limit();

    // Block the stop signals before any thread starts so that every thread
    // inherits the mask and only the signalfd sees them.
    let stop = stop_signals();
    stop.thread_block().context("cannot block SIGTERM/SIGINT")?;
    let signals = SignalFd::with_flags(&stop, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC).context("cannot create a signalfd")?;

    let broker = Arc::new(Mutex::new(Broker::new(opts.jobs)?));
    // Mounted before the socket listens: whoever finds the broker ready finds
    // its token files too (`baton run --jobserver-style auto`).
    let _fuse = opts.fuse.and_then(|mode| fuse::mount(&socket, broker.clone(), mode));

    let listener = std::os::unix::net::UnixListener::bind(&socket).with_context(|| format!("cannot listen at {}", socket.display()))?;
    let _remove_socket = RemoveOnDrop(socket.clone());
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot make {} private (chmod 0600)", socket.display()))?;

    let (mut server, waker) = SocketServer::new(listener, signals, broker.clone(), SpinPolicy::for_this_machine(opts.spin_us), opts.io_uring).context("cannot start the event loop")?;
    // Grants other transports cause for socket clients wake the socket
    // thread; it delivers its own at the end of each round.
    let socket_thread = std::thread::current().id();
    broker.lock().expect("broker lock").on_grants(Transport::Socket, move || {
        if std::thread::current().id() != socket_thread {
            let _ = waker.wake();
        }
    });
    let noun = if opts.jobs == 1 { "token" } else { "tokens" };
    log::info(format_args!("serving {} {noun} at {} (pid {})", opts.jobs, socket.display(), std::process::id()));
    let signal = server.run().context("the event loop failed")?;
    let broker = broker.lock().expect("broker lock");
    log::info(format_args!(
        "stopping on {signal}: {} of {} tokens held by {} client(s) at exit",
        broker.pool().held(),
        broker.pool().limit(),
        broker.pool().clients().count()
    ));
    Ok(())
}

pub fn stop_signals() -> SigSet {
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set
}

/// Every client costs the broker a file descriptor; the usual soft limit of
/// 1024 would cap a big build, so take what the hard limit allows.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
