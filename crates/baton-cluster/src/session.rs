//! One lease's life: taking cluster tokens through the queue, giving them
//! back, lingering (docs/cluster.md says why each step is as it is).

use crate::{ask, keys, lease, LocalPool};
use anyhow::Result;
use baton_core::cluster::Config;
use baton_core::cluster::{step, Contact, Situation, Step};
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, GetResponse, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnResponse, WatchFilterType, WatchOptions,
};
use std::cell::Cell;
use std::convert::Infallible;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// What outlives a session cut short: the lease and the slots it held,
/// which are still ours if etcd kept the lease.
pub struct Kept {
    lease: i64,
    slots: Vec<u32>,
    renewed: Instant,
}

pub struct Session<'a> {
    config: &'a Config,
    client: Client,
    local: Arc<dyn LocalPool>,
    wake: Arc<Notify>,
    lease: Option<i64>,
    /// The token slots this broker holds.
    slots: Vec<u32>,
    /// Shared with the keep-alive, which runs beside the work in this task.
    renewed: Rc<Cell<Instant>>,
    spare_since: Option<Instant>,
    holder: String,
}

impl<'a> Session<'a> {
    pub fn new(
        config: &'a Config,
        client: Client,
        local: Arc<dyn LocalPool>,
        wake: Arc<Notify>,
        kept: Option<Kept>,
    ) -> Self {
        let (lease, slots, renewed) = match kept {
            Some(k) => (Some(k.lease), k.slots, k.renewed),
            None => (None, Vec::new(), Instant::now()),
        };
        Session {
            config,
            client,
            local,
            wake,
            lease,
            slots,
            renewed: Rc::new(Cell::new(renewed)),
            spare_since: None,
            holder: keys::holder(),
        }
    }

    /// Cluster tokens held, and until when they are surely ours.
    pub fn hold(&self) -> (u32, Instant) {
        (self.held(), self.renewed.get() + self.config.ttl)
    }

    pub fn into_kept(self) -> Option<Kept> {
        Some(Kept {
            lease: self.lease?,
            slots: self.slots,
            renewed: self.renewed.get(),
        })
    }

    /// Serves until etcd fails to answer.
    pub async fn serve(&mut self) -> Result<Infallible> {
        let lease = self.establish().await?;
        let (client, renewed) = (self.client.clone(), self.renewed.clone());
        tokio::select! {
            err = lease::keep_alive(client, lease, self.config.ttl, renewed) => err,
            err = self.work(lease) => err,
        }
    }

    /// Gives every token back at once (the broker stops): revoking the
    /// lease deletes its keys.
    pub async fn close(&mut self) {
        if let Some(lease) = self.lease.take() {
            let _ = ask(
                &self.client,
                |mut c| async move { c.lease_revoke(lease).await },
            )
            .await;
        }
        self.local.set_held(0, Contact::Lost);
    }

    fn held(&self) -> u32 {
        self.slots.len() as u32
    }

    /// A lease that survived the outage is kept with its slots; else a new
    /// one, holding nothing.
    async fn establish(&mut self) -> Result<i64> {
        if let Some(lease) = self.lease {
            let alive = ask(&self.client, |mut c| async move {
                c.lease_time_to_live(lease, None).await
            })
            .await?
            .ttl()
                > 0;
            if alive {
                self.slots = self.slots_of(lease).await?;
                let me = keys::waiter(&self.config.pool, lease);
                ask(&self.client, |mut c| {
                    let me = me.clone();
                    async move { c.delete(me, None).await }
                })
                .await?;
                return Ok(lease);
            }
            self.local.log(format_args!(
                "cluster pool {}: the lease expired while etcd was away: its {} cluster token(s) went back to the pool; taking new ones for the jobs still running here",
                self.config.pool,
                self.held()
            ));
            self.slots.clear();
        }
        let sent = Instant::now();
        let ttl = self.config.ttl.as_secs().max(1) as i64;
        let lease = ask(&self.client, |mut c| async move {
            c.lease_grant(ttl, None).await
        })
        .await?
        .id();
        self.lease = Some(lease);
        self.renewed.set(sent);
        Ok(lease)
    }

    /// The slots etcd has under `lease`: a request that timed out may
    /// still have taken one (etcd applied it, the answer was lost), and
    /// such a slot is ours to use or give back, not to leave held.
    async fn slots_of(&self, lease: i64) -> Result<Vec<u32>> {
        let prefix = keys::tokens(&self.config.pool);
        let slots = self
            .get(prefix.clone(), GetOptions::new().with_prefix())
            .await?;
        Ok(slots
            .kvs()
            .iter()
            .filter(|kv| kv.lease() == lease)
            .filter_map(|kv| kv.key_str().ok()?.strip_prefix(&prefix)?.parse().ok())
            .collect())
    }

    fn situation(&self) -> Situation {
        let spare_for = self.spare_since.map_or(Duration::ZERO, |t| t.elapsed());
        Situation {
            local: self.local.demand(),
            held: self.held(),
            others_waiting: false,
            spare_for,
            linger: self.config.linger,
        }
    }

    async fn work(&mut self, lease: i64) -> Result<Infallible> {
        loop {
            self.local.set_held(self.held(), Contact::Reachable);
            let mut s = self.situation();
            let mut next = step(s);
            if matches!(next, Step::Linger(_)) && self.others_waiting().await? {
                s.others_waiting = true;
                next = step(s);
            }
            match next {
                Step::Take => {
                    if let Some(slot) = self.take(lease).await? {
                        self.slots.push(slot);
                    }
                }
                Step::Give(n) => self.give(n).await?,
                Step::Linger(rest) => {
                    self.spare_since.get_or_insert_with(Instant::now);
                    let _ = tokio::time::timeout(rest, self.wake.notified()).await;
                }
                Step::Hold => {
                    self.spare_since = None;
                    self.wake.notified().await;
                }
            }
        }
    }

    async fn others_waiting(&mut self) -> Result<bool> {
        let count = GetOptions::new().with_prefix().with_count_only();
        Ok(self
            .get(keys::queue(&self.config.pool), count)
            .await?
            .count()
            > 0)
    }

    /// Gives `n` spare tokens back. The cap comes down first, under the
    /// broker's lock; a grant that slipped in before keeps its token.
    async fn give(&mut self, n: u32) -> Result<()> {
        let held = self.held();
        let in_use = self.local.set_held(held - n, Contact::Reachable).held;
        let n = held - in_use.max(held - n);
        let gone: Vec<u32> = self.slots.split_off(self.slots.len() - n as usize);
        let deletes: Vec<TxnOp> = gone
            .iter()
            .map(|&s| TxnOp::delete(keys::token(&self.config.pool, s), None))
            .collect();
        self.txn(Txn::new().and_then(deletes)).await?;
        self.spare_since = None;
        Ok(())
    }

    /// Whether the local pool still needs one more cluster token.
    fn short(&self) -> bool {
        step(self.situation()) == Step::Take
    }

    /// Queues for one token and takes it, or leaves the queue when the
    /// local pool stops needing it (None).
    async fn take(&mut self, lease: i64) -> Result<Option<u32>> {
        if self.config.watch_all {
            return self.take_racing(lease).await;
        }
        let me = keys::waiter(&self.config.pool, lease);
        let put = ask(&self.client, |mut c| {
            let (me, holder) = (me.clone(), self.holder.clone());
            async move {
                c.put(me, holder, Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        })
        .await?;
        let place = put.header().map_or(0, |h| h.revision());
        let taken = self.take_in_turn(&me, lease, place).await?;
        // The next broker in the queue learns it is the head.
        ask(&self.client, |mut c| {
            let me = me.clone();
            async move { c.delete(me, None).await }
        })
        .await?;
        Ok(taken)
    }

    async fn take_in_turn(&mut self, me: &str, lease: i64, place: i64) -> Result<Option<u32>> {
        let pool = self.config.pool.clone();
        loop {
            if !self.short() {
                return Ok(None);
            }
            let by_age = GetOptions::new()
                .with_prefix()
                .with_keys_only()
                .with_sort(SortTarget::Create, SortOrder::Ascend);
            let queue = self.get(keys::queue(&pool), by_age).await?;
            let revision = queue.header().map_or(0, |h| h.revision());
            if let Some(ahead) = queue
                .kvs()
                .iter()
                .rfind(|kv| kv.create_revision() < place && kv.key() != me.as_bytes())
            {
                self.wait_for_delete(ahead.key().to_vec(), false, revision + 1)
                    .await?;
                continue;
            }
            let slots = self
                .get(
                    keys::tokens(&pool),
                    GetOptions::new().with_prefix().with_keys_only(),
                )
                .await?;
            let used: Vec<&[u8]> = slots.kvs().iter().map(|kv| kv.key()).collect();
            let free =
                (0..self.config.jobs).find(|&s| !used.contains(&keys::token(&pool, s).as_bytes()));
            match free {
                Some(slot) if self.create(lease, slot).await? => return Ok(Some(slot)),
                Some(_) => continue,
                None => {
                    let revision = slots.header().map_or(0, |h| h.revision());
                    self.wait_for_delete(keys::tokens(&pool).into_bytes(), true, revision + 1)
                        .await?;
                }
            }
        }
    }

    /// The naive design, for `baton bench cluster` to measure beside the
    /// queue: every waiting broker watches every slot, and races for each
    /// one freed.
    async fn take_racing(&mut self, lease: i64) -> Result<Option<u32>> {
        let pool = self.config.pool.clone();
        while self.short() {
            let slots = self
                .get(
                    keys::tokens(&pool),
                    GetOptions::new().with_prefix().with_keys_only(),
                )
                .await?;
            let used: Vec<&[u8]> = slots.kvs().iter().map(|kv| kv.key()).collect();
            match (0..self.config.jobs).find(|&s| !used.contains(&keys::token(&pool, s).as_bytes()))
            {
                Some(slot) if self.create(lease, slot).await? => return Ok(Some(slot)),
                Some(_) => {}
                None => {
                    let revision = slots.header().map_or(0, |h| h.revision());
                    self.wait_for_delete(keys::tokens(&pool).into_bytes(), true, revision + 1)
                        .await?;
                }
            }
        }
        Ok(None)
    }

    /// Creates token slot `slot` under our lease, if nobody holds it.
    async fn create(&mut self, lease: i64, slot: u32) -> Result<bool> {
        let key = keys::token(&self.config.pool, slot);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                self.holder.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        Ok(self.txn(txn).await?.succeeded())
    }

    async fn get(&self, key: String, options: GetOptions) -> Result<GetResponse> {
        ask(&self.client, |mut c| {
            let (key, options) = (key.clone(), options.clone());
            async move { c.get(key, Some(options)).await }
        })
        .await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse> {
        ask(&self.client, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }

    /// Waits until `key` (or a key under it, with `prefix`) is deleted at
    /// or after `revision`, or until the local demand changes.
    async fn wait_for_delete(&mut self, key: Vec<u8>, prefix: bool, revision: i64) -> Result<()> {
        let mut options = WatchOptions::new()
            .with_start_revision(revision)
            .with_filters([WatchFilterType::NoPut]);
        if prefix {
            options = options.with_prefix();
        }
        let (_watcher, mut events) = ask(&self.client, |mut c| {
            let (key, options) = (key.clone(), options.clone());
            async move { c.watch(key, Some(options)).await }
        })
        .await?;
        loop {
            tokio::select! {
                reply = events.message() => {
                    let Some(reply) = reply? else { anyhow::bail!("etcd closed a watch") };
                    self.local.watched(reply.events().len() as u64);
                    if reply.events().iter().any(|e| e.event_type() == EventType::Delete) {
                        return Ok(());
                    }
                }
                _ = self.wake.notified() => return Ok(()),
            }
        }
    }
}
