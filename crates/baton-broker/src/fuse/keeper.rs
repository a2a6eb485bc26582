//! The keeper: a small process that holds a copy of the mount's /dev/fuse
//! descriptor, so that the mount outlives a broker killed with SIGKILL.
//!
//! A FUSE connection ends when the last descriptor of its device closes:
//! with the broker gone, every open token file would fail (ENOTCONN) and
//! every FUSE-style build with it. While the keeper holds one, the builds'
//! requests wait in the kernel instead, until a new broker at the same
//! socket takes the descriptor from the keeper (`<socket>.fuse-keeper`)
//! and serves them (docs/fuse.md, "When the broker dies").
//!
//! The keeper is forked from the broker and runs no Rust beyond raw
//! system calls (the broker has threads; after fork only
//! async-signal-safe calls are allowed). It ends when the broker dismisses
//! it (a normal stop or a handover), when it has passed the descriptor on,
//! when the connection ends (the mount went away), or when no broker has
//! taken the descriptor within the grace after its broker died: then the
//! last descriptor closes, the kernel ends the connection, and every
//! request blocked in the mount fails with ENOTCONN, so builds end instead
//! of hanging for good (#32).

use anyhow::{Context, Result};
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

/// The keeper of this broker's mount; dismiss it when the mount ends.
pub struct Keeper {
    /// Its end of the life line: a byte dismisses it, EOF (we died) makes
    /// it wait for a successor.
    life: OwnedFd,
    pid: libc::pid_t,
}

impl Keeper {
    /// Forks a keeper holding `device`.
    pub fn spawn(socket: &Path, device: RawFd, grace: Duration) -> Result<Keeper> {
        let path = crate::paths::keeper_socket(socket);
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)
            .with_context(|| format!("cannot listen at {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        let (life_read, life) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("cannot make a pipe")?;
        // SAFETY: the child runs only `keep`, which makes raw system calls.
        match unsafe { libc::fork() } {
            -1 => Err(std::io::Error::last_os_error()).context("cannot fork the FUSE keeper"),
            0 => unsafe { keep(device, life_read.as_raw_fd(), listener.as_raw_fd(), grace) },
            pid => Ok(Keeper { life, pid }),
        }
    }

    /// The mount ends with us (a normal stop, or a successor holds the
    /// descriptor now): the keeper goes.
    pub fn dismiss(self) {
        // SAFETY: a one-byte write to our pipe, then reaping our child.
        unsafe {
            libc::write(self.life.as_raw_fd(), b"q".as_ptr().cast(), 1);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// Takes the descriptor from the keeper a broker killed at `socket` left,
/// if there is one. None: no keeper, or its broker still lives.
pub fn take(socket: &Path) -> Option<OwnedFd> {
    let stream = UnixStream::connect(crate::paths::keeper_socket(socket)).ok()?;
    // Only a keeper of ours: another user listening there (a --socket in
    // a shared directory) must not hand us a descriptor to serve.
    if !crate::sys::peer_is_our_uid(&stream) {
        crate::log::warn(format_args!(
            "{} is answered by another user: not taking a FUSE descriptor from it",
            crate::paths::keeper_socket(socket).display()
        ));
        return None;
    }
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut byte = [0u8];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(
        stream.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .ok()?;
    let fd = msg.cmsgs().ok()?.find_map(|c| match c {
        ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
        _ => None,
    })?;
    // SAFETY: the kernel just gave us this descriptor.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

const DEVICE: RawFd = 3;
const LIFE: RawFd = 4;
const LISTENER: RawFd = 5;

/// The keeper's whole life, in the forked child.
///
/// # Safety
/// Only in a child just forked: it takes over the process's descriptors.
unsafe fn keep(device: RawFd, life: RawFd, listener: RawFd, grace: Duration) -> ! {
    let grace_ms = grace.as_millis().min(i32::MAX as u128) as i32;
    // Ours go to 3, 4, 5 (by way of high numbers, as they may overlap);
    // everything else closes: a client connection or the listening socket
    // held here would hide the broker's death from its clients.
    let high = [device, life, listener].map(|fd| libc::fcntl(fd, libc::F_DUPFD, 1000));
    for (fd, to) in high.into_iter().zip([DEVICE, LIFE, LISTENER]) {
        libc::dup2(fd, to);
    }
    if libc::syscall(libc::SYS_close_range, 6u32, u32::MAX, 0u32) != 0 {
        for fd in 6..65536 {
            libc::close(fd);
        }
    }
    let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
    for fd in 0..3 {
        libc::dup2(null, fd);
    }
    libc::close(null);
    let mut none: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut none);
    libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
    libc::prctl(libc::PR_SET_NAME, c"baton-keeper".as_ptr());
    let mut orphaned = false;
    loop {
        // The device, for the end of the connection only (no events asked:
        // requests pending while we wait must not wake us).
        let mut fds = [
            libc::pollfd {
                fd: DEVICE,
                events: 0,
                revents: 0,
            },
            libc::pollfd {
                fd: if orphaned { -1 } else { LIFE },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: LISTENER,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Once orphaned, the wait is the grace: nobody took the device.
        let timeout = if orphaned { grace_ms } else { -1 };
        match libc::poll(fds.as_mut_ptr(), 3, timeout) {
            0 => libc::_exit(0),
            n if n < 0 => continue,
            _ => {}
        }
        if fds[0].revents != 0 {
            libc::_exit(0);
        }
        if fds[1].revents != 0 {
            let mut byte = 0u8;
            if libc::read(LIFE, (&mut byte as *mut u8).cast(), 1) == 1 {
                libc::_exit(0);
            }
            orphaned = true;
        }
        if fds[2].revents != 0 && pass_on(orphaned) {
            libc::_exit(0);
        }
    }
}

/// Accepts one connection and, if our broker is gone and the caller is
/// our user, sends it the device. Whether it was sent.
unsafe fn pass_on(orphaned: bool) -> bool {
    let conn = libc::accept4(
        LISTENER,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        libc::SOCK_CLOEXEC,
    );
    if conn < 0 {
        return false;
    }
    let mut cred: libc::ucred = std::mem::zeroed();
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let ours = libc::getsockopt(
        conn,
        libc::SOL_SOCKET,
        libc::SO_PEERCRED,
        (&mut cred as *mut libc::ucred).cast(),
        &mut len,
    ) == 0
        && cred.uid == libc::getuid();
    let sent = orphaned && ours && send_device(conn);
    libc::close(conn);
    sent
}

unsafe fn send_device(conn: RawFd) -> bool {
    // u64s: a cmsghdr must be aligned.
    let mut control = [0u64; 8];
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut msg: libc::msghdr = std::mem::zeroed();
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as _;
    let cmsg = libc::CMSG_FIRSTHDR(&msg);
    (*cmsg).cmsg_level = libc::SOL_SOCKET;
    (*cmsg).cmsg_type = libc::SCM_RIGHTS;
    (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
    std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), DEVICE);
    libc::sendmsg(conn, &msg, libc::MSG_NOSIGNAL) == 1
}
