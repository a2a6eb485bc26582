//! `baton serve`: start the broker, serve until SIGTERM/SIGINT, clean up.

use crate::admission::Admission;
use crate::broker::Broker;
use crate::fuse::Options as FuseOptions;
use crate::gates::{Probe, Sampler};
use crate::handover::{self, State};
use crate::log::LogLevel;
use crate::mailbox::{self, Mailbox};
use crate::socket::{SocketServer, Stop};
use crate::spin::SpinPolicy;
use crate::{activation, cluster, fuse, log, metrics, paths, socket};
use anyhow::{Context, Result};
use baton_core::gates::GateConfig;
use baton_core::idle::IdleTimer;
use baton_core::paths::{is_default_private_dir, private_dir, socket_path};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::Pid;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What `baton serve` was asked to do.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The pool's limit.
    pub jobs: u32,
    /// Where to listen; None: `baton_core::paths::default_socket_path`.
    pub socket: Option<PathBuf>,
    /// How the FUSE token files serve waiters; None: no FUSE mount.
    pub fuse: Option<FuseOptions>,
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
    /// A token pool shared with other brokers through etcd
    /// (docs/cluster.md); None: this machine's pool only.
    pub cluster: Option<baton_core::cluster::Config>,
    /// Take over from the broker serving the socket, with its state
    /// (crate::handover); the limit and gates are then the ones it had.
    pub replace: bool,
    /// After a broker died at the socket: how long nothing new is granted
    /// while its builds re-attach ([`Broker::start_reclaim`]); zero: no wait.
    pub reclaim_grace: Duration,
    /// Serve `GET /metrics` (the Prometheus text format) over HTTP at
    /// this address; port 0 takes a free one, logged at start. None: no
    /// HTTP endpoint.
    pub metrics_listen: Option<SocketAddr>,
    /// Other users this broker serves besides its own and root
    /// (`--allow-uid`): their own builds and `status`, nothing more.
    pub allow_uids: Vec<u32>,
    /// Groups whose members it serves (`--allow-group`: a name or a gid),
    /// by the peer's gid or supplementary groups.
    pub allow_groups: Vec<String>,
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
    let activated = if opts.replace {
        None
    } else {
        activation::inherited_listener()?
    };
    let socket = match &activated {
        Some((_, path)) => path.clone(),
        None => socket_path(opts.socket.clone()),
    };
    let dir = private_dir(&socket);
    // baton's own directories must be closed to others (as clients check
    // them); one systemd or the user named is left as it is, if ours.
    paths::prepare_private_dir(&dir, is_default_private_dir(&dir))?;
    let admission = admission(&opts, &dir)?;
    let max_clients = raise_fd_limit(opts.max_clients);
    let mut handed = if opts.replace {
        Some(handover::receive(&socket)?)
    } else {
        None
    };
    // Checked before we confirm: a state we cannot take leaves the
    // running broker serving.
    let restored = match &mut handed {
        Some(h) => Some(
            Broker::restore(std::mem::replace(
                &mut h.state.broker,
                Broker::new(1)?.snapshot(),
            ))
            .context("cannot take the running broker's state (it serves on)")?,
        ),
        None => None,
    };
    let mut handed = handed.map(handover::Handed::confirm).transpose()?;
    let _lock = match handed {
        Some(_) => paths::lock_socket_when_free(&socket)?,
        None => paths::lock_socket(&socket)?,
    };
    let a_broker_died_here =
        activated.is_none() && handed.is_none() && paths::clear_stale_socket(&socket)?;

    // Block the stop signals before any thread starts so that every thread
    // inherits the mask and only the signalfd sees them.
    let stop = stop_signals();
    stop.thread_block().context("cannot block SIGTERM/SIGINT")?;
    let signals = SignalFd::with_flags(&stop, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .context("cannot create a signalfd")?;

    let mut broker = match restored {
        Some(broker) => broker,
        None => {
            let mut broker = Broker::new(opts.jobs)?;
            broker.set_gates(opts.gates);
            broker
        }
    };
    let gates = broker.gate_config();
    // The event loop's poll and mailbox come first: every thread started
    // below reaches the broker through the mailbox, once the loop runs.
    let poll = mio::Poll::new().context("cannot create the event loop")?;
    let (mailbox, inbox) = mailbox::mailbox(poll.registry(), socket::WAKER)
        .context("cannot create the event loop's waker")?;
    watch_orphaned_builds(&mut broker, mailbox.clone());
    if a_broker_died_here && !opts.reclaim_grace.is_zero() {
        give_builds_time_to_reattach(&mut broker, mailbox.clone(), &socket, opts.reclaim_grace);
    } else if let Some(left) = broker.reclaim_left() {
        // The predecessor handed over while its builds re-attached: the
        // grace goes on here for what is left of it.
        end_reclaim_after(mailbox.clone(), left);
    }
    // Joined before the socket listens: no grant escapes the cluster's cap.
    let _cluster = opts
        .cluster
        .map(|config| cluster::join(config, &mut broker, mailbox.clone()))
        .transpose()?;
    let _sampler = Sampler::spawn(
        &mut broker,
        mailbox.clone(),
        Probe::new(gates.max_mem_pressure.is_some()),
    )
    .context("cannot start the gates' thread")?;
    let mut fds: Vec<Option<OwnedFd>> = handed
        .as_mut()
        .map(|(_, fds)| std::mem::take(fds).into_iter().map(Some).collect())
        .unwrap_or_default();
    let mut take_fd = |i: usize| {
        fds.get_mut(i)
            .and_then(Option::take)
            .context("the running broker named a descriptor it did not pass")
    };
    // Mounted before the socket listens: whoever finds the broker ready finds
    // its token files too (`baton run --jobserver-style auto`).
    let fuse = match handed.as_mut().and_then(|(state, _)| state.fuse.take()) {
        Some((fs, device)) => Some(fuse::adopt(
            &socket,
            &broker,
            poll.registry(),
            take_fd(device)?,
            fs,
            opts.fuse.unwrap_or_default(),
        )?),
        None if handed.is_some() => None,
        None => opts
            .fuse
            .and_then(|mode| fuse::mount(&socket, poll.registry(), mode)),
    };
    let parts = (inbox, broker, fuse);

    // Bound before the socket listens: whoever finds the broker answering
    // may replace it (`serve --replace` right after a start found no
    // handover socket, 2 runs in 33 of a served test on a loaded machine).
    let handover_listener = handover::listen(&socket);
    // A socket systemd bound is systemd's to remove.
    let (listener, owned_socket) = match (&handed, activated) {
        (Some((state, _)), _) => (
            take_fd(state.listener)?.into(),
            state.owns_socket.then(|| RemoveOnDrop(socket.clone())),
        ),
        (None, Some((listener, _))) => (listener, None),
        (None, None) => (
            listen(&socket, &admission)?,
            Some(RemoveOnDrop(socket.clone())),
        ),
    };

    let mut server = SocketServer::new(
        poll,
        parts,
        listener,
        signals,
        SpinPolicy::for_this_machine(opts.spin_us),
        opts.io_uring,
        max_clients,
        admission,
    )
    .context("cannot start the event loop")?;
    if let Some((state, _)) = handed {
        let conns = state
            .conns
            .into_iter()
            .map(|c| Ok((take_fd(c.fd)?, c)))
            .collect::<Result<Vec<_>>>()?;
        server
            .adopt(conns.into_iter().map(|(fd, c)| (c, fd)).collect())
            .context("cannot take the running broker's clients")?;
    }
    match handover_listener {
        Ok(listener) => server
            .watch_handover(listener)
            .context("cannot watch for a successor")?,
        Err(e) => log::warn(format_args!(
            "no handover socket ({e:#}): this broker cannot be replaced in place"
        )),
    }
    if let Some(timeout) = opts.idle_timeout {
        stop_when_idle(
            mailbox.clone(),
            timeout,
            owned_socket.as_ref().map(|s| s.0.clone()),
        );
    }
    if let Some(addr) = opts.metrics_listen {
        serve_metrics(addr, opts.replace, mailbox.clone())?;
    }
    let limit = server.broker().pool().limit();
    let noun = if limit == 1 { "token" } else { "tokens" };
    let how = if opts.replace {
        "took over: serving"
    } else {
        "serving"
    };
    log::info(format_args!(
        "{how} {limit} {noun} at {} (pid {})",
        socket.display(),
        std::process::id()
    ));
    let why = loop {
        match server.run().context("the event loop failed")? {
            Stop::Signal(name) => break name.to_string(),
            Stop::Asked(pid) => break format!("a STOP request (pid {pid}, baton stop)"),
            Stop::Handover(successor) => {
                match hand_over(successor, &mut server, owned_socket.is_some()) {
                    // The successor serves everything now: leave the socket
                    // and the mount as they are, without the destructors.
                    Ok(()) => {
                        if let Some(fuse) = server.fuse() {
                            fuse.dismiss_keeper();
                        }
                        log::info(format_args!("handed over to a successor: exiting"));
                        std::process::exit(0);
                    }
                    Err(e) => log::warn(format_args!("the handover failed ({e:#}); serving on")),
                }
            }
        }
    };
    {
        let broker = server.broker();
        log::info(format_args!(
            "stopping on {why}: {} of {} tokens held by {} client(s) at exit",
            broker.pool().held(),
            broker.pool().limit(),
            broker.pool().clients().count()
        ));
    }
    // A clean stop leaves nothing but the log: connections close (builds
    // carry on with what they hold), the mount goes, then the files.
    drop(server);
    drop(owned_socket);
    paths::remove_leftovers(&socket);
    Ok(())
}

/// Sends everything to the successor: the loop's state as it stands
/// between two rounds, and the descriptors it names.
fn hand_over(
    successor: std::os::unix::net::UnixStream,
    server: &mut SocketServer,
    owns_socket: bool,
) -> Result<()> {
    let socket::Snapshot {
        broker,
        conns,
        fds,
        fuse,
    } = server.hand_over();
    handover::send(
        successor,
        &State {
            broker,
            listener: 0,
            owns_socket,
            conns,
            fuse,
        },
        &fds,
    )
}

/// Binds the metrics endpoint and says where it is: with port 0, the log
/// line is where the port chosen is found.
fn serve_metrics(addr: SocketAddr, replace: bool, mailbox: Mailbox<Broker>) -> Result<()> {
    let listener = bind_metrics(addr, replace).with_context(|| {
        format!("cannot serve metrics at {addr} (--metrics-listen: is the port taken?)")
    })?;
    let bound = listener
        .local_addr()
        .context("the metrics listener has no address")?;
    metrics::serve_http(listener, mailbox).context("cannot start the metrics thread")?;
    log::info(format_args!("metrics at http://{bound}/metrics"));
    Ok(())
}

/// The metrics listener, with SO_REUSEPORT so that `serve --replace`
/// binds the same port while the broker it replaces still listens there
/// (it stops listening as it exits). A fresh broker first binds without
/// it: a port another process holds is then an error, not a port shared
/// with it.
fn bind_metrics(addr: SocketAddr, replace: bool) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{self, sockopt, AddressFamily, Backlog, SockFlag, SockType};
    use std::os::fd::AsRawFd;
    if !replace && addr.port() != 0 {
        drop(TcpListener::bind(addr)?);
    }
    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    socket::setsockopt(&fd, sockopt::ReusePort, &true)?;
    socket::bind(fd.as_raw_fd(), &socket::SockaddrStorage::from(addr))?;
    socket::listen(&fd, Backlog::new(64).expect("a valid backlog"))?;
    Ok(TcpListener::from(fd))
}

/// Binds the socket, open only to us, or, when others are admitted, to
/// them too: to the one allowed group (0660, that group's) or to all
/// (0666) when uids or several groups are. The file's mode only lets them
/// reach the broker: who is served is [`Admission`]'s to say, per
/// connection, from SO_PEERCRED. Changed by path right after bind, in a
/// directory `prepare_private_dir` found ours (or sticky): the name is
/// ours, and `lchown` would not follow a link even so.
fn listen(socket: &Path, admission: &Admission) -> Result<UnixListener> {
    let listener = UnixListener::bind(socket)
        .with_context(|| format!("cannot listen at {}", socket.display()))?;
    let mode = match admission.socket_group() {
        Some(gid) => {
            std::os::unix::fs::lchown(socket, None, Some(gid)).with_context(|| {
                format!("cannot give {} to group {gid} (chown)", socket.display())
            })?;
            0o660
        }
        None if admission.admits_others() => 0o666,
        None => 0o600,
    };
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set {}'s mode to {mode:04o}", socket.display()))?;
    Ok(listener)
}

/// Who may connect, from `--allow-uid` and `--allow-group`; refused
/// where the users admitted could not reach the socket anyway.
fn admission(opts: &ServeOptions, dir: &Path) -> Result<Admission> {
    let gids = opts
        .allow_groups
        .iter()
        .map(|g| crate::admission::resolve_group(g).map_err(anyhow::Error::msg))
        .collect::<Result<Vec<u32>>>()?;
    let admission = Admission::new(opts.allow_uids.clone(), gids);
    if !admission.admits_others() {
        return Ok(admission);
    }
    if is_default_private_dir(dir) {
        anyhow::bail!(
            "--allow-uid/--allow-group admit other users, but the socket would be in {}, baton's private \
             directory (mode 0700), which they cannot reach: serve with --socket in a directory they may \
             search, e.g. `install -d -m 0755 /run/baton` and `--socket /run/baton/socket` \
             (docs/containers.md)",
            dir.display()
        );
    }
    if let Ok(meta) = std::fs::symlink_metadata(dir) {
        use std::os::unix::fs::MetadataExt;
        if !admitted_can_search(meta.mode(), meta.gid(), &admission) {
            log::warn(format_args!(
                "{} (mode {:04o}) cannot be searched by the users --allow-uid/--allow-group admit: \
                 they will not reach the socket (chmod o+x, or g+x with the allowed group)",
                dir.display(),
                meta.mode() & 0o7777
            ));
        }
    }
    Ok(admission)
}

/// Whether the users `admission` lets in may search a directory of
/// `mode` and group `gid`: anyone may (o+x), or the socket's one allowed
/// group owns it and may (g+x).
fn admitted_can_search(mode: u32, gid: u32, admission: &Admission) -> bool {
    let by_group = mode & 0o010 != 0 && admission.socket_group() == Some(gid);
    mode & 0o001 != 0 || by_group
}

/// Stops the broker, as SIGTERM would, once it has had no client for
/// `timeout`: a broker started on demand does not outlive its use. The
/// signal reaches the event loop's signalfd, so shutdown takes one path.
/// Our own socket goes first, on the loop between two rounds: from then on
/// a new client finds no broker (and `baton run` starts a fresh one) rather
/// than one about to leave.
fn stop_when_idle(mailbox: Mailbox<Broker>, timeout: Duration, own_socket: Option<PathBuf>) {
    // Often enough that a short timeout is kept to within a second.
    let check_every = timeout.clamp(Duration::from_millis(100), Duration::from_secs(1));
    std::thread::spawn(move || {
        let mut timer = IdleTimer::new(timeout);
        loop {
            std::thread::sleep(check_every);
            let own_socket = own_socket.clone();
            // The timer goes to the loop and back: it looks at the clients
            // there, and removes the socket in the same step.
            let Some((back, stopping)) = mailbox.ask(move |broker| {
                let clients = broker.pool().clients().count();
                let expired = timer.expired(clients, Instant::now());
                if expired {
                    if let Some(socket) = &own_socket {
                        let _ = std::fs::remove_file(socket);
                    }
                }
                (timer, expired)
            }) else {
                return;
            };
            timer = back;
            if stopping {
                log::info(format_args!(
                    "no clients for {} s: stopping",
                    timeout.as_secs()
                ));
                let _ = kill(Pid::this(), Signal::SIGTERM);
                return;
            }
        }
    });
}

/// How often the processes of builds whose `baton run` died are looked
/// at: their tokens come back within this of their last job's end.
const ORPHANS_EVERY: Duration = Duration::from_millis(250);

/// Looks at orphaned builds' processes while there are any
/// ([`Broker::watch_orphans`]); sleeps otherwise, until the broker says a
/// build was orphaned. One read of /proc per process per look, only then.
fn watch_orphaned_builds(broker: &mut Broker, mailbox: Mailbox<Broker>) {
    let (wake, woken) = std::sync::mpsc::channel::<()>();
    broker.on_orphans(move || {
        let _ = wake.send(());
    });
    // Orphaned builds a predecessor handed over are there before any wake.
    let mut look = broker.has_orphans();
    std::thread::spawn(move || loop {
        if !look && woken.recv().is_err() {
            return;
        }
        look = false;
        while mailbox.ask(|broker| broker.watch_orphans()) == Some(true) {
            std::thread::sleep(ORPHANS_EVERY);
        }
    });
}

/// Grants nothing new for `grace` (see [`Broker::start_reclaim`]); set
/// before the socket listens, so no newcomer slips in first.
fn give_builds_time_to_reattach(
    broker: &mut Broker,
    mailbox: Mailbox<Broker>,
    socket: &Path,
    grace: Duration,
) {
    log::info(format_args!(
        "a broker died at {} without cleaning up: for {} ms nothing new is granted while its builds re-attach and say what they hold",
        socket.display(),
        grace.as_millis()
    ));
    broker.start_reclaim(grace);
    end_reclaim_after(mailbox, grace);
}

fn end_reclaim_after(mailbox: Mailbox<Broker>, grace: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(grace);
        mailbox.post(|broker| broker.end_reclaim());
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
/// so when even that is below `--max-clients`. Returns how many clients
/// the broker takes: more get `ERR full`, not a connection left waiting
/// for an accept() that fails for want of descriptors.
fn raise_fd_limit(max_clients: usize) -> usize {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return max_clients;
    };
    if soft < hard {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
    let Ok((usable, _)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return max_clients;
    };
    let allowed = usable.saturating_sub(FDS_BESIDE_CLIENTS as u64).max(1);
    if allowed < max_clients as u64 {
        log::warn(format_args!(
            "the open-file limit ({usable}) lets the broker serve {allowed} clients, not --max-clients {max_clients}: more are told the broker is full (raise it: ulimit -Hn, or LimitNOFILE= in its systemd unit)"
        ));
        return allowed as usize;
    }
    max_clients
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
#[cfg(test)]
mod tests {
    use super::*;

    /// Held by the tests that change or read this process's fd limit, so
    /// that neither sees the other's change.
    static FD_LIMIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn the_fd_limit_caps_the_clients_only_below_what_is_asked() {
        use nix::sys::resource::{getrlimit, Resource};
        let _alone = FD_LIMIT.lock().unwrap_or_else(|e| e.into_inner());
        assert_eq!(raise_fd_limit(10), 10);
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        assert_eq!(soft, hard, "the soft limit is raised to the hard one");
        let allowed = usize::try_from(hard - FDS_BESIDE_CLIENTS as u64).unwrap();
        if allowed < usize::MAX {
            assert_eq!(raise_fd_limit(usize::MAX), allowed);
        }
    }

    /// A soft limit below the hard one is raised to it. The test lowers
    /// its own soft limit by one first (it starts at the hard limit under
    /// cargo), and the call raises it back.
    #[test]
    fn a_soft_fd_limit_below_the_hard_one_is_raised_to_it() {
        use nix::sys::resource::{getrlimit, setrlimit, Resource};
        let _alone = FD_LIMIT.lock().unwrap_or_else(|e| e.into_inner());
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        setrlimit(Resource::RLIMIT_NOFILE, hard - 1, hard).unwrap();
        raise_fd_limit(10);
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (hard, hard));
    }

    /// Those `--allow-uid`/`--allow-group` admit reach the socket through
    /// a directory anyone may search, or one whose group is the socket's
    /// one allowed group and may search it; not through a directory of
    /// that group without g+x, nor one of another group.
    #[test]
    fn the_admitted_reach_the_socket_by_o_x_or_by_their_groups_g_x() {
        let group = Admission::new(Vec::new(), vec![4242]);
        let dir = 0o40000;
        assert!(admitted_can_search(dir | 0o701, 1, &group));
        assert!(admitted_can_search(dir | 0o710, 4242, &group));
        assert!(!admitted_can_search(dir | 0o700, 4242, &group), "no g+x");
        assert!(!admitted_can_search(dir | 0o710, 4243, &group));
        let uid = Admission::new(vec![1234], Vec::new());
        assert!(!admitted_can_search(dir | 0o710, 4242, &uid));
        assert!(admitted_can_search(dir | 0o711, 4242, &uid));
    }

    #[test]
    fn a_metrics_port_in_use_is_refused_unless_replacing() {
        let first = bind_metrics("127.0.0.1:0".parse().unwrap(), false).unwrap();
        let taken = first.local_addr().unwrap();
        let err = bind_metrics(taken, false).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
        let successor = bind_metrics(taken, true).unwrap();
        assert_eq!(successor.local_addr().unwrap(), taken);
    }

    #[test]
    fn remove_on_drop_removes_its_file() {
        let path = std::env::temp_dir().join(format!("baton-serve-test-{}", std::process::id()));
        std::fs::write(&path, "").unwrap();
        drop(RemoveOnDrop(path.clone()));
        assert!(!path.exists());
    }
}
