//! What the bench is doing, on stderr, and the end of its temporary
//! directory.
//!
//! On a terminal, one line redrawn every second with the current step's
//! elapsed time, so that a hung step does not look like a slow one; in a
//! log or CI, one line per step. The redrawing is done by a watcher: a
//! process forked when the bench starts, in its own process group. It
//! reads the steps from a pipe, and when the pipe's end of file says the
//! bench is gone (finished, Ctrl-C, `timeout`'s SIGTERM, even kill -9) it
//! removes the bench's temporary directory. A process rather than a
//! thread (or indicatif's ticker thread): the bench forks its benchmark
//! processes, which is only sound from a single-threaded process; and a
//! process outlives the bench, which a thread or signal handler cannot.

use crate::sys;
use std::io::IsTerminal;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub struct Progress {
    terminal: bool,
    started: Instant,
    watcher: Option<Watcher>,
}

/// The forked watcher: steps go down `steps`; it answers a clear on `ack`.
struct Watcher {
    pid: libc::pid_t,
    steps: OwnedFd,
    ack: OwnedFd,
}

impl Progress {
    /// Starts the watcher that removes `tmp` once the bench is gone; without
    /// one (the process has threads already, or fork fails), `tmp` is
    /// removed only by a bench that ends normally.
    pub fn new(tmp: &Path) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        let watcher = match Watcher::start(tmp, terminal) {
            Ok(w) => Some(w),
            Err(e) => {
                eprintln!(
                    "baton bench: no watcher ({e}): {} stays behind if the bench is interrupted",
                    tmp.display()
                );
                None
            }
        };
        Progress {
            terminal,
            started: Instant::now(),
            watcher,
        }
    }

    /// Announces step `index` (from 0) of `total`.
    pub fn step(&self, index: usize, total: usize, what: &str) {
        let text = format!("[{}/{total}] {what}", index + 1);
        match &self.watcher {
            Some(w) if self.terminal => {
                let line = text.replace('\n', " ") + "\n";
                let _ = sys::write_all(w.steps.as_raw_fd(), line.as_bytes());
            }
            _ => eprintln!("{text} ({} s so far)", self.started.elapsed().as_secs()),
        }
    }

    /// Clears the redrawn line before the results (or an error) are
    /// printed, and waits until it is cleared.
    pub fn done(&self) {
        if let Some(w) = self.watcher.as_ref().filter(|_| self.terminal) {
            if sys::write_all(w.steps.as_raw_fd(), b"\n").is_ok() {
                let mut byte = [0u8];
                if sys::poll_readable(w.ack.as_raw_fd(), 2000).unwrap_or(false) {
                    let _ = sys::read(w.ack.as_raw_fd(), &mut byte);
                }
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.take() {
            let pid = w.pid;
            // End of file: the watcher removes the directory and exits.
            drop(w);
            let mut status = 0;
            // SAFETY: waits for our own child.
            let _ = sys::retry(|| unsafe { libc::waitpid(pid, &mut status, 0) });
        }
    }
}

impl Watcher {
    fn start(tmp: &Path, terminal: bool) -> std::io::Result<Watcher> {
        if !single_threaded() {
            return Err(std::io::Error::other("the process has threads"));
        }
        let (steps_in, steps) = sys::pipe()?;
        let (ack, ack_out) = sys::pipe()?;
        use std::io::Write;
        let _ = std::io::stderr().flush();
        let tmp = tmp.to_path_buf();
        // SAFETY: the process is single-threaded (checked above), so the
        // child inherits no lock held by another thread.
        let pid = sys::check(unsafe { libc::fork() })?;
        if pid == 0 {
            // Our copies of the bench's ends: with them open, the pipe
            // would never reach end of file.
            drop((steps, ack));
            watch(steps_in, ack_out, &tmp, terminal);
        }
        Ok(Watcher { pid, steps, ack })
    }
}

/// The watcher's life: redraw until the bench is gone, then remove `tmp`.
fn watch(steps: OwnedFd, ack: OwnedFd, tmp: &Path, terminal: bool) -> ! {
    // SAFETY: these calls affect only this process.
    unsafe {
        // Ctrl-C reaches the bench's process group, not this one: it must
        // outlive the bench to clean up after it.
        libc::setpgid(0, 0);
        // Not holding the bench's stdout open: `baton bench | head` ends
        // when the bench does.
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
        if null >= 0 {
            libc::dup2(null, 1);
        }
    }
    let started = Instant::now();
    let mut step: Option<(String, Instant)> = None;
    let mut pending = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let readable = sys::poll_readable(steps.as_raw_fd(), 1000).unwrap_or(true);
        if readable {
            match sys::read(steps.as_raw_fd(), &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            }
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line[..end]).into_owned();
                if line.is_empty() {
                    step = None;
                    clear_line(terminal);
                    let _ = sys::write_all(ack.as_raw_fd(), b".");
                } else {
                    step = Some((line, Instant::now()));
                }
            }
        }
        if let Some((what, since)) = &step {
            let line = format!(
                "\r\x1b[K{what}: {} s ({} s in all)",
                since.elapsed().as_secs(),
                started.elapsed().as_secs()
            );
            let _ = sys::write_all(2, line.as_bytes());
        }
    }
    if step.is_some() {
        clear_line(terminal);
    }
    remove_when_free(tmp);
    // SAFETY: _exit ends this forked process without running the bench's
    // destructors a second time.
    unsafe { libc::_exit(0) }
}

fn clear_line(terminal: bool) {
    if terminal {
        let _ = sys::write_all(2, b"\r\x1b[K");
    }
}

/// Removes `tmp`, trying again for a while: the brokers the bench started
/// stop as it goes (their parent-death signal) and unmount their FUSE
/// files inside it.
fn remove_when_free(tmp: &Path) {
    let tmp: PathBuf = tmp.to_path_buf();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match std::fs::remove_dir_all(&tmp) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => {
                eprintln!("baton bench: cannot remove {}: {e}", tmp.display());
                return;
            }
        }
    }
}

fn single_threaded() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("Threads:"))
            .is_some_and(|n| n.trim() == "1")
    })
}
