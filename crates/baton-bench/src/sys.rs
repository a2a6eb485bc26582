//! The few raw system calls the benchmark shares between mechanisms:
//! errors from -1, EINTR retries, pipes, memory shared across fork.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Turns a system call's -1 into the errno it left.
pub fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Runs a system call again when a signal interrupted it. The benchmark
/// installs no handlers, but a stop signal (SIGSTOP/SIGCONT under a
/// debugger) can still interrupt a blocking call.
pub fn retry(mut call: impl FnMut() -> libc::c_int) -> io::Result<libc::c_int> {
    loop {
        match check(call()) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// A pipe whose ends close on exec, so the broker started beside the
/// benchmark's children never holds a token pipe open.
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    check(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: both descriptors are fresh and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Writes all of `bytes`.
pub fn write_all(fd: RawFd, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: the pointer and length describe a live slice.
        let n = retry(|| unsafe {
            libc::write(fd, bytes.as_ptr().cast(), bytes.len()) as libc::c_int
        })?;
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// Reads into `buf` once; 0 means end of file.
pub fn read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the pointer and length describe a live, writable slice.
    retry(|| unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) as libc::c_int })
        .map(|n| n as usize)
}

/// Waits until `fd` is readable, or `timeout_ms` passes (-1: forever).
/// Returns whether it is readable.
pub fn poll_readable(fd: RawFd, timeout_ms: libc::c_int) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, living on this stack frame.
    let n = retry(|| unsafe { libc::poll(&mut pfd, 1, timeout_ms) })?;
    Ok(n > 0)
}

/// `len` values of `T` in memory shared with every child forked after its
/// creation. `T` must be usable from several processes at once: atomics,
/// or process-shared primitives initialised in place.
pub struct SharedMemory<T> {
    ptr: *mut T,
    len: usize,
}

impl<T: Default> SharedMemory<T> {
    pub fn new(len: usize) -> io::Result<Self> {
        let bytes = (std::mem::size_of::<T>() * len.max(1)).max(1);
        // SAFETY: a fresh anonymous mapping; nothing else refers to it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = ptr.cast::<T>();
        for i in 0..len {
            // SAFETY: i < len, inside the mapping; mmap memory is page aligned.
            unsafe { ptr.add(i).write(T::default()) };
        }
        Ok(SharedMemory { ptr, len })
    }
}

impl<T> std::ops::Deref for SharedMemory<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised values live at `ptr` until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T> Drop for SharedMemory<T> {
    fn drop(&mut self) {
        let bytes = (std::mem::size_of::<T>() * self.len.max(1)).max(1);
        // SAFETY: unmapping exactly what new() mapped; no reference outlives self.
        unsafe { libc::munmap(self.ptr.cast(), bytes) };
    }
}

// SAFETY: SharedMemory only hands out shared references to its values, and T's
// own Sync/Send say whether those may cross threads.
unsafe impl<T: Sync> Sync for SharedMemory<T> {}
unsafe impl<T: Send> Send for SharedMemory<T> {}
