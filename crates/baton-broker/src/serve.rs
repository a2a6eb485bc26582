//! `baton serve`: start the broker, serve until SIGTERM/SIGINT, clean up.

use crate::broker::{Broker, Transport};
use crate::fuse::Mode as FuseMode;
use crate::gates::{Probe, Sampler};
use crate::log::LogLevel;
use baton_core::gates::GateConfig;
use crate::socket::SocketServer;
use crate::spin::SpinPolicy;
use crate::{fuse, log, paths};
use baton_core::paths::{is_chosen_by_baton, private_dir, socket_path};
use anyhow::{Context, Result};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// What `baton serve` was asked to do.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The pool's limit.
    pub jobs: u32,
    /// Where to listen; None: `baton_core::paths::default_socket_path`.
    pub socket: Option<PathBuf>,
    /// How the FUSE token files wake pollers; None: no FUSE mount.
    pub fuse: Option<FuseMode>,
    /// Longest spin of the socket loop before it sleeps, in µs (the spin
    /// module says when it engages).
    pub spin_us: u64,
    /// Send replies and sleep in one system call where io_uring allows
    /// (the uring module says why).
    pub io_uring: bool,
    /// How much the broker logs on stderr.
    pub log_level: LogLevel,
    /// Memory and load gates (docs/adaptive.md); the default has none.
    pub gates: GateConfig,
}

/// Serves until SIGTERM or SIGINT, then removes the socket and unmounts.
///
/// # Errors
/// The socket's directory is not ours, another broker serves the path, or
/// the socket or the event loop cannot be set up.
pub fn serve(opts: ServeOptions) -> Result<()> {
    log::set_level(opts.log_level);
    // Only the directories baton chooses itself are tightened to 0700.
    let chosen_by_us = is_chosen_by_baton(opts.socket.as_deref());
    let socket = socket_path(opts.socket);
    let dir = private_dir(&socket);
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
    broker.lock().expect("broker lock").set_gates(opts.gates);
    let _sampler = Sampler::spawn(broker.clone(), Probe::new(opts.gates.max_mem_pressure.is_some())).context("cannot start the gates' thread")?;
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

fn stop_signals() -> SigSet {
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
