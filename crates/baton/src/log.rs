//! The broker's log: one line per event on stderr, `baton: ` first.
//! `-v` adds per-connection detail; `-q` keeps only warnings.

use std::fmt::Arguments;
use std::sync::atomic::{AtomicU8, Ordering};

static LEVEL: AtomicU8 = AtomicU8::new(1);

/// 0: warnings only; 1: events worth knowing (default); 2: every connection.
pub fn set_level(level: u8) {
    LEVEL.store(level, Ordering::Relaxed);
}

fn emit(min: u8, args: Arguments<'_>) {
    if LEVEL.load(Ordering::Relaxed) >= min {
        eprintln!("baton: {args}");
    }
}

pub fn warn(args: Arguments<'_>) {
    emit(0, args)
}

pub fn info(args: Arguments<'_>) {
    emit(1, args)
}

pub fn debug(args: Arguments<'_>) {
    emit(2, args)
}
