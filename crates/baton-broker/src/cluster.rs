//! Joining a cluster pool in etcd (docs/cluster.md): the link's thread
//! (`baton-cluster`, a cargo feature) sets the cap on local grants; the
//! broker wakes it when its demand changes.

use crate::broker::Broker;
use anyhow::Result;
use baton_core::cluster::Config;
#[cfg(feature = "cluster")]
use baton_core::cluster::Contact;
use std::sync::{Arc, Mutex};

/// The running link; dropping it gives the cluster tokens back.
#[cfg(feature = "cluster")]
pub type Link = baton_cluster::Link;
/// Without the cluster feature there is never a link.
#[cfg(not(feature = "cluster"))]
pub type Link = std::convert::Infallible;

/// Connects to etcd and caps the broker's grants at the cluster tokens it
/// holds, before any client is served.
#[cfg(feature = "cluster")]
pub fn join(config: Config, broker: &Arc<Mutex<Broker>>) -> Result<Link> {
    let pool = config.pool.clone();
    let (jobs, endpoints) = (config.jobs, config.endpoints.join(","));
    broker.lock().expect("broker lock").join_cluster(&config);
    let link = baton_cluster::Link::start(config, Arc::new(BrokerPool(broker.clone())))?;
    broker.lock().expect("broker lock").on_demand(link.waker());
    crate::log::info(format_args!(
        "cluster pool {pool}: {jobs} tokens across every broker, in etcd at {endpoints}"
    ));
    Ok(link)
}

#[cfg(not(feature = "cluster"))]
pub fn join(_config: Config, _broker: &Arc<Mutex<Broker>>) -> Result<Link> {
    anyhow::bail!("this baton was built without cluster pools (build it with: cargo install --features cluster --path crates/baton)")
}

#[cfg(feature = "cluster")]
struct BrokerPool(Arc<Mutex<Broker>>);

#[cfg(feature = "cluster")]
impl baton_cluster::LocalPool for BrokerPool {
    fn demand(&self) -> baton_core::cluster::Local {
        self.0.lock().expect("broker lock").cluster_demand()
    }

    fn set_held(&self, held: u32, contact: Contact) -> baton_core::cluster::Local {
        self.0
            .lock()
            .expect("broker lock")
            .set_cluster_held(held, contact)
    }

    fn watched(&self, events: u64) {
        self.0
            .lock()
            .expect("broker lock")
            .note_watch_events(events);
    }

    fn log(&self, line: std::fmt::Arguments) {
        crate::log::warn(line);
    }
}
