//! Where a pool's state lives in etcd (the table in docs/cluster.md).

/// The pool's limit, written once by its first broker.
pub fn limit(pool: &str) -> String {
    format!("/baton/{pool}/limit")
}

/// The prefix of every token slot.
pub fn tokens(pool: &str) -> String {
    format!("/baton/{pool}/token/")
}

/// Token slot `slot` (0 ≤ slot < the limit).
pub fn token(pool: &str, slot: u32) -> String {
    format!("{}{slot}", tokens(pool))
}

/// The prefix of the queue of brokers waiting for a token.
pub fn queue(pool: &str) -> String {
    format!("/baton/{pool}/queue/")
}

/// The queue key of the broker holding `lease`.
pub fn waiter(pool: &str, lease: i64) -> String {
    format!("{}{lease:016x}", queue(pool))
}

/// What a broker writes into its keys: who holds or waits, for people
/// reading etcd.
pub fn holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_or_else(|_| "?".to_string(), |h| h.trim().to_string());
    format!("{host} {}", std::process::id())
}

/// The host and pid a [`holder`] value names.
pub fn parse_holder(value: &str) -> (String, u32) {
    match value.rsplit_once(' ') {
        Some((host, pid)) => (host.to_string(), pid.parse().unwrap_or(0)),
        None => (value.to_string(), 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_sit_under_the_token_prefix() {
        assert!(token("p", 3).starts_with(&tokens("p")));
        assert!(waiter("p", 0x2a).starts_with(&queue("p")));
        assert!(
            !token("p", 3).starts_with(&tokens("p2")) && !tokens("p").starts_with(&tokens("p2"))
        );
    }

    #[test]
    fn a_holder_reads_back() {
        let (host, pid) = parse_holder(&holder());
        assert_eq!(pid, std::process::id());
        assert!(!host.is_empty());
    }
}
