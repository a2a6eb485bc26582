//! The one owner of the broker's state: the event loop's thread
//! (crate::socket). [`Owned`] is what it owns; other threads reach it by
//! errands through a [`Mailbox`] (crate::mailbox).

use crate::broker::Broker;
use crate::fuse::Files;

/// What the loop owns: the broker, and the FUSE token files when mounted.
pub struct Owned {
    pub broker: Broker,
    pub files: Option<Files>,
}

/// The mailbox to the loop's state.
pub type Mailbox = crate::mailbox::Mailbox<Owned>;
