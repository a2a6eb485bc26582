//! `baton serve`: start the broker, serve until SIGTERM/SIGINT, clean up.

use crate::broker::{Broker, Transport};
use crate::fuse::Mode as FuseMode;
use crate::gates::{Probe, Sampler};
use crate::log::LogLevel;
use baton_core::gates::GateConfig;
use crate::socket::SocketServer;
use crate::spin::SpinPolicy;
use crate::{activation, fuse, log, paths};
use baton_core::idle::IdleTimer;
use baton_core::paths::{is_chosen_by_baton, private_dir, socket_path};
use anyhow::{Context, Result};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::Pid;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// At most this many connections at once; more get `ERR full`.
    pub max_clients: usize,
    /// Memory and load gates (docs/adaptive.md); the default has none.
    pub gates: GateConfig,
    /// Stop after this long with no clients at all (brokers started on
    /// demand); None: serve until stopped.
    pub idle_timeout: Option<Duration>,
}

/// Serves until SIGTERM or SIGINT (or, with `idle_timeout`, until nobody
/// has been connected that long), then removes the socket (unless systemd
/// passed it) and unmounts. Serves on the socket systemd passes if there is
/// one (socket activation), else binds its own.
///
/// # Errors
/// The socket's directory is not ours, another broker serves the path, or
/// the socket or the event loop cannot be set up.
pub fn serve(opts: ServeOptions) -> Result<()> {
    log::set_level(opts.log_level);
    // Taken before any thread starts: it edits the environment.
    let activated = activation::inherited_listener()?;
    // Only the directories baton chooses itself are tightened to 0700.
    let chosen_by_us = is_chosen_by_baton(opts.socket.as_deref());
    let socket = match &activated {
        Some((_, path)) => path.clone(),
        None => socket_path(opts.socket),
    };
    let dir = private_dir(&socket);
    paths::prepare_private_dir(&dir, chosen_by_us)?;
    let _lock = paths::lock_socket(&socket)?;
    if activated.is_none() {
        paths::clear_stale_socket(&socket)?;
    }
    raise_fd_limit(opts.max_clients);

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

    // A socket systemd bound is systemd's to remove.
    let (listener, owned_socket) = match activated {
        Some((listener, _)) => (listener, None),
        None => (listen(&socket)?, Some(RemoveOnDrop(socket.clone()))),
    };

    let (mut server, waker) = SocketServer::new(listener, signals, broker.clone(), SpinPolicy::for_this_machine(opts.spin_us), opts.io_uring, opts.max_clients).context("cannot start the event loop")?;
    // Grants other transports cause for socket clients wake the socket
    // thread; it delivers its own at the end of each round.
    let socket_thread = std::thread::current().id();
    broker.lock().expect("broker lock").on_grants(Transport::Socket, move || {
        if std::thread::current().id() != socket_thread {
            let _ = waker.wake();
        }
    });
    if let Some(timeout) = opts.idle_timeout {
        stop_when_idle(broker.clone(), timeout, owned_socket.as_ref().map(|s| s.0.clone()));
    }
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

fn listen(socket: &Path) -> Result<UnixListener> {
    let listener = UnixListener::bind(socket).with_context(|| format!("cannot listen at {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot make {} private (chmod 0600)", socket.display()))?;
    Ok(listener)
}

/// Stops the broker, as SIGTERM would, once it has had no client for
/// `timeout`: a broker started on demand does not outlive its use. The
/// signal reaches the event loop's signalfd, so shutdown takes one path.
/// Our own socket goes first, under the broker's lock: from then on a new
/// client finds no broker (and `baton run` starts a fresh one) rather than
/// one about to leave.
fn stop_when_idle(broker: Arc<Mutex<Broker>>, timeout: Duration, own_socket: Option<PathBuf>) {
    // Often enough that a short timeout is kept to within a second.
    let check_every = timeout.clamp(Duration::from_millis(100), Duration::from_secs(1));
    std::thread::spawn(move || {
        let mut timer = IdleTimer::new(timeout);
        loop {
            std::thread::sleep(check_every);
            let broker = broker.lock().expect("broker lock");
            if timer.expired(broker.pool().clients().count(), Instant::now()) {
                if let Some(socket) = &own_socket {
                    let _ = std::fs::remove_file(socket);
                }
                log::info(format_args!("no clients for {} s: stopping", timeout.as_secs()));
                let _ = kill(Pid::this(), Signal::SIGTERM);
                return;
            }
        }
    });
}

fn stop_signals() -> SigSet {
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set
}

/// Every client costs the broker a file descriptor; the usual soft limit of
/// 1024 would cap a big build, so take what the hard limit allows, and say
/// so when even that is below `--max-clients`.
fn raise_fd_limit(max_clients: usize) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else { return };
    if soft < hard {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
    if hard < (max_clients + FDS_BESIDE_CLIENTS) as u64 {
        log::warn(format_args!(
            "the open-file limit ({hard}) lets the broker serve about {} clients, not --max-clients {max_clients} (raise it: ulimit -Hn, or LimitNOFILE= in its systemd unit)",
            hard.saturating_sub(FDS_BESIDE_CLIENTS as u64)
        ));
    }
}

/// Descriptors the broker keeps open besides its clients' (the listening
/// socket, the event loops, the FUSE device, the lock, pidfds), with room.
const FDS_BESIDE_CLIENTS: usize = 64;

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
