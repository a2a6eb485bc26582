//! What the bench is doing, on stderr: one line redrawn in place on a
//! terminal, one line per step otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::time::Instant;

pub struct Progress {
    terminal: bool,
    started: Instant,
}

impl Progress {
    pub fn new() -> Progress {
        Progress {
            terminal: std::io::stderr().is_terminal(),
            started: Instant::now(),
        }
    }

    /// Announces step `index` (from 0) of `total`.
    pub fn step(&self, index: usize, total: usize, what: &str) {
        let elapsed = self.started.elapsed().as_secs();
        let text = format!("[{}/{total}] {what} ({elapsed} s so far)", index + 1);
        let mut err = std::io::stderr().lock();
        let _ = if self.terminal {
            write!(err, "\r\x1b[K{text}")
        } else {
            writeln!(err, "{text}")
        };
        let _ = err.flush();
    }

    /// Clears the redrawn line before the results are printed.
    pub fn done(&self) {
        if self.terminal {
            let _ = write!(std::io::stderr(), "\r\x1b[K");
        }
    }
}
