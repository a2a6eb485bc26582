//! Keeping a broker's lease alive, and noticing when it may be gone.

use crate::{ask, timed};
use anyhow::{bail, Context, Result};
use etcd_client::Client;
use std::cell::Cell;
use std::convert::Infallible;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Renews `lease` every third of `ttl` until a renewal fails. `renewed`
/// is when the last acknowledged renewal was *sent*: etcd restarted the
/// lease's clock no earlier than that, so the lease surely lives until
/// `renewed + ttl`.
pub async fn keep_alive(
    client: Client,
    lease: i64,
    ttl: Duration,
    renewed: Rc<Cell<Instant>>,
) -> Result<Infallible> {
    let (mut keeper, mut replies) = ask(
        &client,
        |mut c| async move { c.lease_keep_alive(lease).await },
    )
    .await?;
    loop {
        tokio::time::sleep(ttl / 3).await;
        let sent = Instant::now();
        timed(keeper.keep_alive()).await?;
        let reply = timed(replies.message())
            .await?
            .context("etcd closed the lease's keep-alive stream")?;
        if reply.ttl() <= 0 {
            bail!("the lease expired");
        }
        renewed.set(sent);
    }
}
