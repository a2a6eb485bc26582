//! Joining a cluster pool in etcd (docs/cluster.md): the link's thread
//! (`baton-cluster`, a cargo feature) sets the cap on local grants, by
//! errands to the event loop (crate::mailbox); the broker wakes it when its
//! demand changes.

use crate::broker::Broker;
use crate::mailbox::Mailbox;
use anyhow::Result;
use baton_core::cluster::Config;
#[cfg(feature = "cluster")]
use baton_core::cluster::Contact;
#[cfg(feature = "cluster")]
use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(feature = "cluster")]
use std::sync::Arc;

/// The running link; dropping it gives the cluster tokens back.
#[cfg(feature = "cluster")]
pub struct Link {
    /// Tells the link's calls to give up waiting on the loop, so that the
    /// loop's own thread can join it.
    stop: Arc<AtomicBool>,
    _link: baton_cluster::Link,
}

#[cfg(feature = "cluster")]
impl Drop for Link {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Without the cluster feature there is never a link.
#[cfg(not(feature = "cluster"))]
pub type Link = std::convert::Infallible;

/// Connects to etcd and caps the broker's grants at the cluster tokens it
/// holds (none yet), before the loop takes the broker and serves anyone.
#[cfg(feature = "cluster")]
pub fn join(config: Config, broker: &mut Broker, mailbox: Mailbox<Broker>) -> Result<Link> {
    let pool = config.pool.clone();
    let (jobs, endpoints) = (config.jobs, config.endpoints.join(","));
    broker.join_cluster(&config);
    let stop = Arc::new(AtomicBool::new(false));
    let local = BrokerPool {
        mailbox,
        stop: stop.clone(),
    };
    let link = baton_cluster::Link::start(config, Arc::new(local))?;
    broker.on_demand(link.waker());
    crate::log::info(format_args!(
        "cluster pool {pool}: {jobs} tokens across every broker, in etcd at {endpoints}"
    ));
    Ok(Link { stop, _link: link })
}

#[cfg(not(feature = "cluster"))]
pub fn join(_config: Config, _broker: &mut Broker, _mailbox: Mailbox<Broker>) -> Result<Link> {
    anyhow::bail!("this baton was built without cluster pools (build it with: cargo install --features cluster --path crates/baton)")
}

/// The local pool as the link sees it: the broker, on the event loop.
#[cfg(feature = "cluster")]
struct BrokerPool {
    mailbox: Mailbox<Broker>,
    stop: Arc<AtomicBool>,
}

#[cfg(feature = "cluster")]
impl BrokerPool {
    /// Runs `f` on the broker; a loop that has ended (the broker stops)
    /// answers as a pool with nothing held or wanted.
    fn ask<T: Default + Send + 'static>(
        &self,
        f: impl FnOnce(&mut Broker) -> T + Send + 'static,
    ) -> T {
        self.mailbox.ask_unless(&self.stop, f).unwrap_or_default()
    }
}

#[cfg(feature = "cluster")]
impl baton_cluster::LocalPool for BrokerPool {
    fn demand(&self) -> baton_core::cluster::Local {
        self.ask(|b| b.cluster_demand())
    }

    fn set_held(&self, held: u32, contact: Contact) -> baton_core::cluster::Local {
        self.ask(move |b| b.set_cluster_held(held, contact))
    }

    fn watched(&self, events: u64) {
        self.mailbox
            .post(move |broker| broker.note_watch_events(events));
    }

    fn log(&self, line: std::fmt::Arguments) {
        crate::log::warn(line);
    }
}
