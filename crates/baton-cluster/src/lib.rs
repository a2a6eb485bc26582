//! The cluster link: a broker's share of a token pool kept in etcd
//! (docs/cluster.md).
//!
//! A thread of its own runs the etcd client (`etcd-client`, async on a
//! single-threaded tokio runtime). It holds a lease, keeps it alive, and
//! takes or gives back cluster tokens as `baton_core::cluster::step`
//! decides from what the local pool needs; the broker learns what it may
//! grant through [`LocalPool::set_held`]. The broker never waits on etcd:
//! it wakes the link ([`Link::waker`]) when its demand changes.
//!
//! - `keys`: the pool's key layout.
//! - `session`: one lease's life: taking tokens through the queue, giving
//!   them back, lingering.
//! - `lease`: keeping the lease alive, and noticing when it may be gone.

mod keys;
mod lease;
mod session;

use anyhow::{bail, Context, Result};
#[cfg(doc)]
use baton_core::cluster::admission_cap;
use baton_core::cluster::{Config, Contact, Local};
use baton_core::status::ClusterBroker;
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, Txn, TxnOp};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Notify};

/// How long one etcd request may take before etcd counts as unreachable.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a broker cut off from etcd tries again.
const RETRY: Duration = Duration::from_secs(1);
/// How long a failed request waits before it is made again.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// The broker, as the link sees it.
pub trait LocalPool: Send + Sync + 'static {
    /// What the local pool holds and waits for now.
    fn demand(&self) -> Local;
    /// The link holds `held` cluster tokens, as sure as `contact` says:
    /// the broker caps its grants at [`admission_cap`] of them. Returns
    /// the demand as it is under the new cap (read under the same lock).
    fn set_held(&self, held: u32, contact: Contact) -> Local;
    /// The link received `events` watch events (each one woke it).
    fn watched(&self, events: u64);
    /// One line for the broker's log.
    fn log(&self, line: std::fmt::Arguments);
}

/// A running link. Dropping it gives every cluster token back (revokes
/// the lease) and stops the thread.
pub struct Link {
    wake: Arc<Notify>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Link {
    /// Connects to etcd and checks the pool's limit, then serves in a
    /// thread of its own. Until it holds a cluster token, the local pool
    /// may grant nothing: the caller caps it at none before the start
    /// (its first [`LocalPool::set_held`] comes from the link's thread).
    ///
    /// # Errors
    /// etcd cannot be reached, or the pool exists with another limit.
    pub fn start(config: Config, local: Arc<dyn LocalPool>) -> Result<Link> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the etcd client's runtime")?;
        let client = runtime.block_on(connect(&config))?;
        let wake = Arc::new(Notify::new());
        let (stop, stopped) = oneshot::channel();
        let link = Runner {
            config,
            local,
            client,
            wake: wake.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("baton-cluster".into())
            .spawn(move || runtime.block_on(link.run(stopped)))
            .context("cannot start the cluster link's thread")?;
        Ok(Link {
            wake,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Wakes the link to look at the local demand again; cheap, and safe
    /// to call under the broker's lock.
    pub fn waker(&self) -> impl Fn() + Send + Sync + 'static {
        let wake = self.wake.clone();
        move || wake.notify_one()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Every broker of `pool` that holds or waits, as etcd has them now
/// (`baton status`), busiest first.
///
/// # Errors
/// etcd cannot be reached.
pub fn survey(endpoints: &[String], pool: &str) -> Result<Vec<ClusterBroker>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let options = ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT);
        let client = Client::connect(endpoints, Some(options)).await?;
        let read = |prefix: String| {
            let client = &client;
            async move {
                ask(client, |mut c| {
                    let prefix = prefix.clone();
                    async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
                })
                .await
            }
        };
        let (tokens, queue) = (
            read(keys::tokens(pool)).await?,
            read(keys::queue(pool)).await?,
        );
        let mut brokers: Vec<ClusterBroker> = Vec::new();
        let mut entry = |value: &[u8]| -> usize {
            let (host, pid) = keys::parse_holder(&String::from_utf8_lossy(value));
            match brokers.iter().position(|b| b.host == host && b.pid == pid) {
                Some(i) => i,
                None => {
                    brokers.push(ClusterBroker {
                        host,
                        pid,
                        held: 0,
                        waiting: false,
                    });
                    brokers.len() - 1
                }
            }
        };
        let held: Vec<usize> = tokens.kvs().iter().map(|kv| entry(kv.value())).collect();
        let waiting: Vec<usize> = queue.kvs().iter().map(|kv| entry(kv.value())).collect();
        held.into_iter().for_each(|i| brokers[i].held += 1);
        waiting.into_iter().for_each(|i| brokers[i].waiting = true);
        brokers.sort_by(|a, b| b.held.cmp(&a.held).then(a.pid.cmp(&b.pid)));
        Ok(brokers)
    })
}

/// Connects, and writes the pool's limit or checks it against ours.
async fn connect(config: &Config) -> Result<Client> {
    let endpoints = config.endpoints.join(",");
    let options = ConnectOptions::new()
        .with_connect_timeout(REQUEST_TIMEOUT)
        .with_timeout(REQUEST_TIMEOUT);
    let client = Client::connect(&config.endpoints, Some(options))
        .await
        .with_context(|| {
            format!("cannot reach etcd at {endpoints} (is it running? check --etcd)")
        })?;
    let key = keys::limit(&config.pool);
    let create = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(key.clone(), config.jobs.to_string(), None)])
        .or_else([TxnOp::get(key.clone(), None)]);
    let reply = ask(&client, |mut c| {
        let create = create.clone();
        async move { c.txn(create).await }
    })
    .await
    .with_context(|| {
        format!("cannot reach etcd at {endpoints} (is it running, with a quorum? check --etcd)")
    })?;
    if !reply.succeeded() {
        let found = client_value(&reply);
        if found.as_deref() != Some(config.jobs.to_string().as_str()) {
            bail!(
                "cluster pool {:?} has a limit of {} in etcd, and this broker was given --cluster-jobs {} (give every broker of the pool the same limit, or another --cluster-pool)",
                config.pool,
                found.unwrap_or_else(|| "?".into()),
                config.jobs
            );
        }
    }
    Ok(client)
}

fn client_value(reply: &etcd_client::TxnResponse) -> Option<String> {
    reply.op_responses().into_iter().find_map(|op| match op {
        etcd_client::TxnOpResponse::Get(get) => get
            .kvs()
            .first()
            .and_then(|kv| kv.value_str().ok().map(str::to_string)),
        _ => None,
    })
}

/// An etcd request, made again while it fails (a member down: the client
/// may pick another), for up to [`REQUEST_TIMEOUT`] in all.
async fn ask<T, F, Fut>(client: &Client, request: F) -> Result<T>
where
    F: Fn(Client) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, request(client.clone())).await {
            Ok(Ok(reply)) => return Ok(reply),
            Ok(Err(_)) if Instant::now() + RETRY_PAUSE < deadline => {
                tokio::time::sleep(RETRY_PAUSE).await
            }
            Ok(Err(err)) => return Err(err.into()),
            Err(_) => bail!("no answer from etcd within {} s", REQUEST_TIMEOUT.as_secs()),
        }
    }
}

/// A message on a stream (a watch, the lease's keep-alive) that gives up
/// after [`REQUEST_TIMEOUT`].
async fn timed<T>(
    request: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(reply) => Ok(reply?),
        Err(_) => bail!("no answer from etcd within {} s", REQUEST_TIMEOUT.as_secs()),
    }
}

/// The link's thread.
struct Runner {
    config: Config,
    local: Arc<dyn LocalPool>,
    client: Client,
    wake: Arc<Notify>,
}

impl Runner {
    /// Serves sessions until stopped; after each loss of contact, caps the
    /// local pool as [`admission_cap`] says and tries again.
    async fn run(self, mut stopped: oneshot::Receiver<()>) {
        let pool = &self.config.pool;
        let mut kept: Option<session::Kept> = None;
        loop {
            let mut session = session::Session::new(
                &self.config,
                self.client.clone(),
                self.local.clone(),
                self.wake.clone(),
                kept.take(),
            );
            let outcome = tokio::select! {
                outcome = session.serve() => outcome,
                _ = &mut stopped => {
                    session.close().await;
                    return;
                }
            };
            let err = match outcome {
                Ok(never) => match never {},
                Err(err) => err,
            };
            let (held, surely_until) = session.hold();
            kept = session.into_kept();
            // A member down breaks the streams through it; the others may answer.
            if self.answers().await {
                self.local.log(format_args!("cluster pool {pool}: lost a connection to etcd ({err:#}): going on through the members that answer"));
                continue;
            }
            self.local.log(format_args!(
                "cluster pool {pool}: etcd unreachable ({err:#}): no new cluster tokens; the {held} held here stay in use for at most {:.1} s more",
                surely_until.saturating_duration_since(Instant::now()).as_secs_f64()
            ));
            if self
                .wait_for_etcd(held, surely_until, &mut stopped)
                .await
                .is_err()
            {
                return;
            }
            self.local
                .log(format_args!("cluster pool {pool}: etcd answers again"));
        }
    }

    /// Caps the local pool while etcd is away, at what is surely held
    /// until the lease may have expired, then at nothing; returns when
    /// etcd answers (Err: stopped meanwhile).
    async fn wait_for_etcd(
        &self,
        held: u32,
        surely_until: Instant,
        stopped: &mut oneshot::Receiver<()>,
    ) -> std::result::Result<(), ()> {
        let mut lost = false;
        loop {
            let contact = if Instant::now() < surely_until {
                Contact::Unsure
            } else {
                Contact::Lost
            };
            if contact == Contact::Lost && !lost {
                lost = true;
                self.local.log(format_args!("cluster pool {}: the lease may have expired: granting nothing until etcd answers", self.config.pool));
            }
            self.local.set_held(held, contact);
            let until_lost = surely_until.saturating_duration_since(Instant::now());
            let pause = if lost { RETRY } else { RETRY.min(until_lost) };
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = &mut *stopped => return Err(()),
            }
            // A read of a silent etcd takes up to REQUEST_TIMEOUT to fail:
            // while the lease may still live, it is cut short where the
            // lease may end, so the broker stops granting then and not
            // up to that long after.
            let answered = if lost {
                self.answers().await
            } else {
                let left = surely_until.saturating_duration_since(Instant::now());
                tokio::time::timeout(left, self.answers())
                    .await
                    .unwrap_or(false)
            };
            if answered {
                return Ok(());
            }
        }
    }

    /// Whether etcd answers a read that needs its quorum.
    async fn answers(&self) -> bool {
        let key = keys::limit(&self.config.pool);
        ask(&self.client, |mut c| {
            let key = key.clone();
            async move { c.get(key, None).await }
        })
        .await
        .is_ok()
    }
}
