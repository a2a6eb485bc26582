//! The broker's log: one line per event on stderr, each with when (RFC
//! 3339, UTC, to the millisecond) and how serious (INFO, WARN, ERROR,
//! DEBUG), then `baton: ` and the event:
//!
//! ```text
//! 2026-11-25T17:20:41.123Z INFO baton: serving 8 tokens at ...
//! ```
//!
//! `-v` adds per-connection detail; `-q` keeps only warnings and errors.

use std::fmt::Arguments;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::SystemTime;

static LEVEL: AtomicU8 = AtomicU8::new(LogLevel::Info as u8);

/// How much the broker says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum LogLevel {
    /// Warnings only (`-q`).
    Warn = 0,
    /// Events worth knowing: start, stop, reclaims (the default).
    #[default]
    Info = 1,
    /// Every connection (`-v`).
    Debug = 2,
}

pub fn set_level(level: LogLevel) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

fn emit(min: LogLevel, label: &str, args: Arguments<'_>) {
    if LEVEL.load(Ordering::Relaxed) >= min as u8 {
        eprintln!("{}", line(SystemTime::now(), label, args));
    }
}

fn line(at: SystemTime, label: &str, args: Arguments<'_>) -> String {
    format!(
        "{} {label} baton: {args}",
        humantime::format_rfc3339_millis(at)
    )
}

/// What stops the broker: said whatever the level.
pub fn error(args: Arguments<'_>) {
    emit(LogLevel::Warn, "ERROR", args)
}

pub fn warn(args: Arguments<'_>) {
    emit(LogLevel::Warn, "WARN", args)
}

pub fn info(args: Arguments<'_>) {
    emit(LogLevel::Info, "INFO", args)
}

pub fn debug(args: Arguments<'_>) {
    emit(LogLevel::Debug, "DEBUG", args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn a_line_starts_with_utc_time_to_the_millisecond_and_the_level() {
        let at = UNIX_EPOCH + Duration::from_millis(1_764_091_241_123);
        assert_eq!(
            line(at, "WARN", format_args!("x")),
            "2025-11-25T17:20:41.123Z WARN baton: x"
        );
    }
}
