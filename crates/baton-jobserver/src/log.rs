//! `baton run`'s own messages: one line on stderr, `baton: ` first, like
//! the broker's, so a build log shows which lines are baton's.

use std::fmt::Arguments;

pub fn warn(args: Arguments<'_>) {
    eprintln!("baton: {args}");
}
