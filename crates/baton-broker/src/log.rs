//! The broker's log: one line per event on stderr, `baton: ` first.
//! `-v` adds per-connection detail; `-q` keeps only warnings.

use std::fmt::Arguments;
use std::sync::atomic::{AtomicU8, Ordering};

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

fn emit(min: LogLevel, args: Arguments<'_>) {
    if LEVEL.load(Ordering::Relaxed) >= min as u8 {
        eprintln!("baton: {args}");
    }
}

pub fn warn(args: Arguments<'_>) {
    emit(LogLevel::Warn, args)
}

pub fn info(args: Arguments<'_>) {
    emit(LogLevel::Info, args)
}

pub fn debug(args: Arguments<'_>) {
    emit(LogLevel::Debug, args)
}
