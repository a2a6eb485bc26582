//! `baton serve --replace`: a new broker takes over from the one serving a
//! socket, with no client noticing.
//!
//! The running broker listens on `<socket>.handover` (0600, and only our
//! own uid is answered). The successor connects there; the running broker
//! stops between two rounds of its loop (it reads no FUSE request until it
//! knows how the handover went), and sends
//! its whole state as one JSON document followed by its descriptors (the
//! listening socket, every client connection, /dev/fuse) as SCM_RIGHTS
//! messages. The successor answers one byte once it has everything; only
//! then does the predecessor exit, without removing the socket or
//! unmounting, and the successor starts serving when it gets the lock the
//! predecessor held. Clients meanwhile wait in the kernel: their requests
//! sit in the connections' buffers, new connections in the listen backlog.
//! If the successor goes away before its answer, the predecessor goes on
//! serving.

use crate::broker::BrokerState;
use crate::fuse::FsState;
use crate::socket::ConnState;
use anyhow::{bail, ensure, Context, Result};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{Deserialize, Serialize};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

/// Descriptors per message: below the kernel's SCM_MAX_FD (253).
const FDS_PER_MESSAGE: usize = 200;

/// The successor's answer once it holds everything.
const TAKEN: u8 = b'1';

/// Everything the successor receives besides descriptors, which are named
/// by their index in the order they were sent.
#[derive(Debug, Serialize, Deserialize)]
pub struct State {
    pub broker: BrokerState,
    /// Index of the listening socket.
    pub listener: usize,
    /// Whether the socket's path is the broker's to remove (not systemd's).
    pub owns_socket: bool,
    pub conns: Vec<ConnState>,
    /// The token files and the index of /dev/fuse.
    pub fuse: Option<(FsState, usize)>,
}

/// Listens for a successor (the running broker, at start-up).
pub fn listen(socket: &Path) -> Result<UnixListener> {
    let path = crate::paths::handover_socket(socket);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)
        .with_context(|| format!("cannot listen at {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot make {} private (chmod 0600)", path.display()))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Sends the state and the descriptors, then waits for the successor to
/// say it has them. Err: it did not; the caller goes on serving.
pub fn send(mut stream: UnixStream, state: &State, fds: &[RawFd]) -> Result<()> {
    stream.set_nonblocking(false)?;
    // A successor that stops answering must not stop us for good.
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let json = serde_json::to_vec(state).context("cannot serialize the broker's state")?;
    stream.write_all(&(json.len() as u64).to_le_bytes())?;
    stream.write_all(&(fds.len() as u64).to_le_bytes())?;
    stream.write_all(&json)?;
    for chunk in fds.chunks(FDS_PER_MESSAGE) {
        let rights = [ControlMessage::ScmRights(chunk)];
        sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(&[0])],
            &rights,
            MsgFlags::empty(),
            None,
        )
        .context("cannot pass descriptors to the successor")?;
    }
    let mut answer = [0u8];
    stream
        .read_exact(&mut answer)
        .context("the successor did not confirm")?;
    ensure!(answer[0] == TAKEN, "the successor answered {:?}", answer[0]);
    Ok(())
}

/// What a successor received, not yet confirmed: until [`Handed::confirm`]
/// the predecessor waits, and serves on if we go away.
pub struct Handed {
    pub state: State,
    pub fds: Vec<OwnedFd>,
    stream: UnixStream,
}

impl Handed {
    /// Tells the predecessor we have everything: it exits, and its lock
    /// goes with it.
    pub fn confirm(mut self) -> Result<(State, Vec<OwnedFd>)> {
        self.stream
            .write_all(&[TAKEN])
            .context("the running broker went away before we confirmed")?;
        Ok((self.state, self.fds))
    }
}

/// Connects to the broker serving `socket` and takes its state and
/// descriptors (the successor, `baton serve --replace`).
pub fn receive(socket: &Path) -> Result<Handed> {
    let path = crate::paths::handover_socket(socket);
    let mut stream = UnixStream::connect(&path).with_context(|| {
        format!(
            "no broker to replace at {} (is one running there?)",
            socket.display()
        )
    })?;
    // Whoever answers there gets to hand us every client's connection and
    // the books we will serve by: only a broker of our own uid (or root's)
    // may, as only ours may take them from us ([`is_ours`]).
    let peer = crate::sys::peer(&stream).context("cannot ask who answers there")?;
    let ours = nix::unistd::getuid().as_raw();
    ensure!(
        peer.uid() == ours || peer.uid() == 0,
        "{} is answered by a process of uid {} (pid {}), not by a broker of yours (uid {ours}) \
         or root's: refusing to take over from it",
        path.display(),
        peer.uid(),
        peer.pid()
    );
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut header = [0u8; 16];
    stream
        .read_exact(&mut header)
        .context("the running broker sent no state")?;
    let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes")) as usize;
    let count = u64::from_le_bytes(header[8..].try_into().expect("8 bytes")) as usize;
    let mut json = vec![0u8; len];
    stream
        .read_exact(&mut json)
        .context("the running broker's state is cut short")?;
    let state: State = serde_json::from_slice(&json)
        .context("cannot read the running broker's state (is it a different version?)")?;
    let fds = receive_fds(&stream, count)?;
    Ok(Handed { state, fds, stream })
}

fn receive_fds(stream: &UnixStream, count: usize) -> Result<Vec<OwnedFd>> {
    let mut fds = Vec::with_capacity(count);
    while fds.len() < count {
        let mut byte = [0u8];
        let mut iov = [IoSliceMut::new(&mut byte)];
        let mut space = nix::cmsg_space!([RawFd; FDS_PER_MESSAGE]);
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .context("cannot receive descriptors")?;
        if msg.bytes == 0 {
            bail!(
                "the running broker went away after sending {} of {count} descriptors",
                fds.len()
            );
        }
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                // SAFETY: the kernel just gave us these descriptors.
                fds.extend(
                    received
                        .into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        ensure!(
            !msg.flags.contains(MsgFlags::MSG_CTRUNC),
            "descriptors were lost in passing (out of file descriptors?)"
        );
    }
    Ok(fds)
}
