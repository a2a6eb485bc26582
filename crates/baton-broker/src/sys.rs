//! The broker's one door to the process table: every /proc read and every
//! process system call (pidfd_open, kill, kcmp) the broker makes, each
//! written once, with the unsafe code they need; and the peer of a Unix
//! socket (SO_PEERCRED) and the lazy unmount. The modules above work on
//! the values these return, and their rules are tested on values made up.
//! (The FUSE keeper, a forked child that may call only async-signal-safe
//! functions, makes its own raw calls: see `fuse::keeper`.)

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// What the broker reads of a process's `/proc/PID/stat` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    /// The command name (at most 15 bytes; may hold spaces and parentheses).
    pub comm: String,
    /// R, S, D, T (stopped), t (stopped by a tracer), Z, X, ...
    pub state: char,
    pub ppid: u32,
    pub session: u32,
    /// Start time in clock ticks since boot.
    pub start: u64,
}

impl Stat {
    /// Parses `pid (comm) state ppid pgrp session ... starttime ...`. The
    /// command name may hold spaces and parentheses: it ends at the line's
    /// last `)`. None for a line cut short.
    pub fn parse(line: &str) -> Option<Stat> {
        let open = line.find('(')?;
        let close = line.rfind(')')?;
        let comm = line.get(open + 1..close)?.to_string();
        let fields: Vec<&str> = line.get(close + 2..)?.split(' ').collect();
        Some(Stat {
            comm,
            state: fields.first()?.chars().next()?,
            ppid: fields.get(1)?.parse().ok()?,
            session: fields.get(3)?.parse().ok()?,
            start: fields.get(19)?.parse().ok()?,
        })
    }

    /// Not a zombie, nor dead.
    pub fn is_live(&self) -> bool {
        !matches!(self.state, 'Z' | 'X')
    }

    /// Stopped by a signal (`T`) or under a tracer (`t`).
    pub fn is_stopped(&self) -> bool {
        matches!(self.state, 'T' | 't')
    }
}

/// Process `pid`'s stat (a thread id works too); None if it is gone.
pub fn stat(pid: u32) -> Option<Stat> {
    Stat::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Every process's pid, as /proc lists them now.
pub fn pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
}

/// The children of process `pid` (of its main thread, which is where a
/// single-threaded build tool forks); none if it is gone.
pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// `/proc/PID/status` of a process or thread; None if it is gone.
pub fn status(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status")).ok()
}

/// The value of one line of a status text (`name` with its colon, as
/// `"Uid:"`), trimmed.
pub fn status_field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(str::trim)
}

/// The process's command line from /proc, words joined by spaces, cut to
/// a label's length (for status); empty if it is gone.
pub fn command_line(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let words: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    let line = words.join(" ");
    line.chars().take(baton_core::protocol::MAX_LABEL).collect()
}

/// The value of `name` in the environment process `pid` was started with
/// (readable for our own processes, or as root).
pub fn environ_var(pid: u32, name: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    env.split(|&b| b == 0)
        .find_map(|e| e.strip_prefix(prefix.as_bytes()))
        .and_then(|v| Some(std::str::from_utf8(v).ok()?.to_string()))
}

/// The PID namespace of process `pid` (or `self`): the inode of
/// /proc/PID/ns/pid. None if it is gone.
pub fn pid_namespace_of(pid: &str) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|m| m.ino())
}

/// The cgroup v2 path of process `pid` (or `self`): its `0::` line in
/// /proc/PID/cgroup, relative to our cgroup namespace; None on a machine
/// with cgroup v1 alone, or if it is gone.
pub fn cgroup_of(pid: &str) -> Option<String> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    cgroups
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(str::to_string)
}

/// Resident bytes of one process (`/proc/<pid>/statm`, second field, in
/// pages); None if it is gone.
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split(' ').nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

/// Sends `signal` to process `pid`; one gone since is ESRCH, which is
/// ignored: the callers act on processes that may end at any moment.
pub fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) takes any pid and signal number.
    unsafe { libc::kill(pid as i32, signal) };
}

/// Who is at the other end of a Unix socket connection (SO_PEERCRED): the
/// kernel's word, taken when the peer connected.
pub fn peer(stream: &impl std::os::fd::AsFd) -> io::Result<nix::sys::socket::UnixCredentials> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    getsockopt(stream, PeerCredentials).map_err(io::Error::from)
}

/// Whether the peer of a Unix socket connection runs as our own uid: the
/// handover and the FUSE keeper give what they hold to nobody else, as
/// anyone else could take every client's connection.
pub fn peer_is_our_uid(stream: &std::os::unix::net::UnixStream) -> bool {
    peer(stream).is_ok_and(|c| c.uid() == nix::unistd::getuid().as_raw())
}

/// Sends `bytes` with `fd` attached (SCM_RIGHTS, unix(7)): the descriptor
/// arrives with the first byte. Returns the bytes sent.
pub fn send_with_fd(
    stream: &impl std::os::fd::AsFd,
    bytes: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> io::Result<usize> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};
    use std::os::fd::AsRawFd;
    let fds = [fd.as_raw_fd()];
    let control = [ControlMessage::ScmRights(&fds)];
    let iov = [io::IoSlice::new(bytes)];
    let socket = stream.as_fd().as_raw_fd();
    sendmsg::<UnixAddr>(socket, &iov, &control, MsgFlags::MSG_NOSIGNAL, None)
        .map_err(io::Error::from)
}

/// Which of these connections' peers have hung up (POLLRDHUP, POLLHUP,
/// POLLERR), in one poll(2) that does not wait; each answer in the order
/// asked. (nix's PollFlags lacks POLLRDHUP, the one flag that tells a
/// half-close.)
pub fn hung_up(fds: &[std::os::fd::RawFd]) -> Vec<bool> {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLRDHUP,
            revents: 0,
        })
        .collect();
    // SAFETY: `polled` is a live array of `polled.len()` pollfds; a zero
    // timeout only reports, it never blocks.
    let ready = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, 0) };
    let gone = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
    polled
        .iter()
        .map(|p| ready > 0 && p.revents & gone != 0)
        .collect()
}

/// This thread's scheduling priority (its nice value).
#[cfg(test)]
pub fn thread_priority() -> i32 {
    // SAFETY: gettid and getpriority on this thread have no preconditions.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
}

/// Sets this thread's nice value; the error where we may not (lowering it
/// needs CAP_SYS_NICE or an RLIMIT_NICE that allows it).
pub fn set_thread_priority(nice: i32) -> io::Result<()> {
    // SAFETY: gettid and setpriority on this thread have no preconditions.
    match unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Unmounts `path` lazily (MNT_DETACH), not following a link there;
/// false where we may not (not root).
pub fn detach_mount(path: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(cpath) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: umount2 reads a NUL-terminated path.
    unsafe { libc::umount2(cpath.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW) == 0 }
}

/// A descriptor that becomes readable when process `pid` exits (Linux 5.3).
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the fd was just returned to us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether processes `a` and `b` share one address space (kcmp(2),
/// `KCMP_VM`): true of a vfork child that has not exec'd yet and its
/// parent (make 4.3 starts its jobs so), of two threads of one process, and
/// of a process and itself. False on any error: one of them is gone, or
/// kcmp is not permitted (it asks for ptrace access to both; a kernel
/// without CONFIG_KCMP says ENOSYS).
pub fn shares_memory_with(a: u32, b: u32) -> bool {
    /// `enum kcmp_type` in linux/kcmp.h: compare the two `mm`s. It is 1:
    /// 0 is KCMP_FILE, which would compare the two processes' descriptor 0.
    const KCMP_VM: libc::c_int = 1;
    // SAFETY: kcmp takes two pids, a type and two integer arguments (unused
    // for KCMP_VM), reads and writes none of our memory, and returns 0 (the
    // same), 1, 2 or 3 (not the same, by order), or -1 with errno.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            a as libc::pid_t,
            b as libc::pid_t,
            KCMP_VM,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    r == 0
}

/// For tests: a real build tool's job caught between vfork and exec. A
/// forked helper, renamed `make`, that first starts `sleep 60` (fork and
/// exec), then vforks a child that never execs (it sleeps in pause()), as
/// make 4.3 starts a job and is then held in vfork until the job execs.
/// The vfork is glibc's posix_spawn's (which make 4.3 calls): clone with
/// CLONE_VM | CLONE_VFORK, the child on a stack of its own, which to the
/// kernel is vfork(2); libc::vfork itself is deprecated, as the compiler
/// does not know it returns twice (rust-lang/libc#1596).
/// On drop, whatever the test's outcome, both children are killed
/// (SIGKILL) by pid; the helper, let out of vfork, reaps them and exits,
/// and is reaped. Should it not (a test that failed before the children
/// were there), its process group, its own, is killed whole.
#[cfg(test)]
pub(crate) struct VforkedJob {
    /// The helper, named `make`.
    pub helper: u32,
}

#[cfg(test)]
impl VforkedJob {
    pub fn start() -> VforkedJob {
        use std::ffi::CString;
        // Everything the helper needs is made before the fork: after it,
        // in a copy of a process with threads, only async-signal-safe
        // calls (no allocation).
        let sleep = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join("sleep"))
            .find(|p| p.is_file())
            .expect("sleep on PATH");
        let sleep = CString::new(sleep.into_os_string().into_encoded_bytes()).unwrap();
        let sixty = CString::new("60").unwrap();
        let argv = [sleep.as_ptr(), sixty.as_ptr(), std::ptr::null()];
        let mut stack = vec![0u8; 64 * 1024];
        // The stack grows down: the child starts at its 16-byte aligned top.
        let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
        extern "C" fn never_exec(_: *mut libc::c_void) -> libc::c_int {
            loop {
                // SAFETY: pause has no preconditions.
                unsafe { libc::pause() };
            }
        }
        // SAFETY: fork; the child is handled below.
        let helper = unsafe { libc::fork() };
        assert!(helper >= 0, "fork: {}", io::Error::last_os_error());
        if helper == 0 {
            // SAFETY: the forked helper makes only async-signal-safe calls
            // (setpgid, prctl, fork, execv, clone, waitpid, _exit) on memory
            // made before the fork, and never returns into Rust code. The
            // cloned child runs never_exec on `stack`, which nothing else
            // uses, and calls nothing but pause.
            unsafe {
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_NAME, c"make".as_ptr());
                if libc::fork() == 0 {
                    libc::execv(argv[0], argv.as_ptr());
                    libc::_exit(127);
                }
                libc::clone(
                    never_exec,
                    top as *mut libc::c_void,
                    libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
                    std::ptr::null_mut(),
                );
                while libc::waitpid(-1, std::ptr::null_mut(), 0) > 0 {}
                libc::_exit(0);
            }
        }
        drop(stack);
        // SAFETY: setpgid on our own child (as it does itself: whichever
        // comes first), so that drop's kill of the group never misses it.
        unsafe { libc::setpgid(helper, helper) };
        VforkedJob {
            helper: helper as u32,
        }
    }

    /// The helper's children once both are there and `sleep` has exec'd:
    /// (the exec'd `sleep`, the vfork child).
    pub fn children(&self) -> (u32, u32) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let kids = children(self.helper);
            let named = |name: &str| {
                kids.iter()
                    .copied()
                    .find(|&k| stat(k).is_some_and(|s| s.comm == name))
            };
            if let (2, Some(sleep), Some(vforked)) = (kids.len(), named("sleep"), named("make")) {
                return (sleep, vforked);
            }
            assert!(std::time::Instant::now() < deadline, "never started");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

#[cfg(test)]
impl Drop for VforkedJob {
    fn drop(&mut self) {
        let helper = self.helper as i32;
        for child in children(self.helper) {
            signal(child, libc::SIGKILL);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // SAFETY: waitpid of our own child, kill(2) of the group it made
        // (our own processes only).
        unsafe {
            while libc::waitpid(helper, std::ptr::null_mut(), libc::WNOHANG) == 0 {
                if std::time::Instant::now() > deadline {
                    libc::kill(-helper, libc::SIGKILL);
                    libc::waitpid(helper, std::ptr::null_mut(), 0);
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_hung_up_is_told_from_one_still_there() {
        use std::os::fd::AsRawFd;
        let (gone, ours_gone) = std::os::unix::net::UnixStream::pair().unwrap();
        let (_there, ours_there) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(gone);
        let fds = [ours_there.as_raw_fd(), ours_gone.as_raw_fd()];
        assert_eq!(hung_up(&fds), [false, true]);
        assert_eq!(hung_up(&fds[..1]), [false]);
    }

    const LINE: &str =
        "4242 (make (x)) S 4000 4242 4001 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 987654 1000 100";

    #[test]
    fn a_stat_line_is_read_past_a_command_name_with_spaces_and_parentheses() {
        assert_eq!(
            Stat::parse(LINE),
            Some(Stat {
                comm: "make (x)".into(),
                state: 'S',
                ppid: 4000,
                session: 4001,
                start: 987654,
            })
        );
        let odd = LINE.replace("(make (x))", "(a) b) c)");
        assert_eq!(Stat::parse(&odd).unwrap().comm, "a) b) c");
        assert_eq!(Stat::parse(&odd).unwrap().ppid, 4000);
        assert_eq!(Stat::parse("4242 (truncated"), None);
        assert_eq!(
            Stat::parse("4242 (make) S 17 4242 17 0 -1"),
            None,
            "no start time"
        );
        assert_eq!(Stat::parse("42 make S 1 2 3"), None);
    }

    #[test]
    fn states() {
        let with = |state: char| Stat {
            state,
            ..Stat::parse(LINE).unwrap()
        };
        assert!(with('T').is_stopped() && with('t').is_stopped() && !with('S').is_stopped());
        assert!(!with('Z').is_live() && !with('X').is_live() && with('D').is_live());
    }

    #[test]
    fn our_own_entries() {
        let me = std::process::id();
        let stat = stat(me).unwrap();
        assert_eq!(stat.ppid, std::os::unix::process::parent_id());
        // SAFETY: getsid(0) has no preconditions.
        assert_eq!(stat.session, unsafe { libc::getsid(0) } as u32);
        assert!(stat.is_live() && !stat.is_stopped());
        assert!(pids().any(|p| p == me));
        let status = status(me).unwrap();
        assert_eq!(
            status_field(&status, "Tgid:"),
            Some(me.to_string().as_str())
        );
        assert_eq!(super::stat(4_000_000_000), None);
        assert_eq!(super::status(4_000_000_000), None);
    }

    #[test]
    fn the_command_line_is_read_from_proc_with_spaces_between_words() {
        let line = command_line(std::process::id());
        let argv: Vec<String> = std::env::args().collect();
        let want: String = argv
            .join(" ")
            .chars()
            .take(baton_core::protocol::MAX_LABEL)
            .collect();
        assert_eq!(line, want);
        assert!(!line.is_empty());
        assert_eq!(command_line(4_000_000_000), "", "no such process");
    }

    #[test]
    fn a_variable_of_a_childs_environment() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("BATON_SYS_TEST", "a=b c")
            .spawn()
            .unwrap();
        let pid = child.id();
        // Until exec has laid it out, the child's environment reads empty.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while environ_var(pid, "BATON_SYS_TEST").is_none() {
            assert!(std::time::Instant::now() < deadline, "never shown");
            std::thread::yield_now();
        }
        assert_eq!(environ_var(pid, "BATON_SYS_TEST").as_deref(), Some("a=b c"));
        assert_eq!(environ_var(pid, "BATON_SYS_TES"), None, "whole names only");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn resident_bytes_are_whole_pages_of_a_live_process() {
        let bytes = resident_bytes(std::process::id()).unwrap();
        assert!(bytes > 0 && bytes.is_multiple_of(page_size()), "{bytes}");
        assert_eq!(resident_bytes(4_000_000_000), None);
    }

    #[test]
    fn namespaces_and_cgroups_as_the_kernel_names_them() {
        // readlink gives "pid:[INODE]": the same number, by another call.
        let link = std::fs::read_link("/proc/self/ns/pid").unwrap();
        let inode = link
            .to_string_lossy()
            .trim_start_matches("pid:[")
            .trim_end_matches(']')
            .parse::<u64>()
            .unwrap();
        assert_eq!(pid_namespace_of("self"), Some(inode));
        assert_eq!(
            pid_namespace_of(&std::process::id().to_string()),
            Some(inode)
        );
        assert_eq!(pid_namespace_of("4000000000"), None);
        let text = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let unified = text.lines().any(|l| l.starts_with("0::"));
        match cgroup_of("self") {
            Some(path) => assert!(unified && path.starts_with('/'), "{path:?} from {text:?}"),
            None => assert!(!unified, "a 0:: line was not read: {text:?}"),
        }
        assert_eq!(cgroup_of("4000000000"), None);
    }

    #[test]
    fn a_page_is_a_power_of_two_of_at_least_4_kib() {
        let page = page_size();
        assert!(page >= 4096 && page.is_power_of_two(), "{page}");
    }

    #[test]
    fn a_signal_reaches_its_process() {
        use std::os::unix::process::ExitStatusExt;
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        signal(child.id(), libc::SIGKILL);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("the signal never came");
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        };
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn a_connection_from_our_own_uid_is_ours() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(peer_is_our_uid(&a));
    }

    /// A process of another uid that connects is not ours: the handover
    /// and the FUSE keeper give it nothing. The socket is abstract, so
    /// that uid can reach it; the process ends when we close our end.
    #[test]
    fn a_connection_from_another_uid_is_not_ours() {
        use std::os::linux::net::SocketAddrExt;
        use std::os::unix::net::{SocketAddr, UnixListener};
        use std::os::unix::process::CommandExt;
        if !nix::unistd::getuid().is_root() {
            return baton_testkit::skip(
                baton_testkit::Missing::Root,
                "starting a process as another uid needs root",
            );
        }
        let name = format!("baton-sys-test-peer-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&addr).unwrap();
        let mut other = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket, sys\n\
                 s = socket.socket(socket.AF_UNIX)\n\
                 s.connect('\\0' + sys.argv[1])\n\
                 s.recv(1)\n",
                &name,
            ])
            .uid(65534)
            .gid(65534)
            .spawn()
            .unwrap();
        // Waited for with a deadline: a process that could not connect
        // must fail the test, not hang it.
        listener.set_nonblocking(true).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let stream = loop {
            match listener.accept() {
                Ok((stream, _)) => break stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
            if other.try_wait().unwrap().is_some() || std::time::Instant::now() > deadline {
                let _ = other.kill();
                let _ = other.wait();
                panic!("the other uid's process never connected");
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        };
        assert!(!peer_is_our_uid(&stream));
        drop(stream);
        assert!(other.wait().unwrap().success());
    }

    #[test]
    fn a_pidfd_of_a_live_process_only() {
        assert!(pidfd_open(std::process::id()).is_ok());
        assert!(pidfd_open(4_000_000_000).is_err());
    }

    #[test]
    fn a_vfork_child_that_has_not_execd_shares_its_parents_memory() {
        let job = VforkedJob::start();
        let (sleep, vforked) = job.children();
        assert!(shares_memory_with(vforked, job.helper), "vforked, no exec");
        assert!(shares_memory_with(job.helper, vforked), "either way round");
        assert!(
            !shares_memory_with(sleep, job.helper),
            "forked and exec'd: a memory of its own"
        );
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = child.id();
        let exec_done = || {
            std::fs::read_link(format!("/proc/{pid}/exe"))
                .is_ok_and(|exe| exe.file_name().is_some_and(|n| n == "sleep"))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !exec_done() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let (execd, shares) = (exec_done(), shares_memory_with(pid, std::process::id()));
        let _ = child.kill();
        let _ = child.wait();
        assert!(execd, "never exec'd");
        assert!(!shares, "an exec'd child shares nothing with its parent");
        assert!(shares_memory_with(std::process::id(), std::process::id()));
        assert!(
            !shares_memory_with(4_000_000_000, std::process::id()),
            "gone"
        );
    }
}
