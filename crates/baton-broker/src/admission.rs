//! Who may use this broker, decided in one place for every connection:
//! the kernel's word on the peer (SO_PEERCRED), never the socket file's
//! mode, which anyone sharing the socket may have opened (docs/security.md).
//!
//! The broker's own user and root always; other users only when told
//! (`baton serve --allow-uid UID`, `--allow-group GROUP`, or the config
//! file's `allow-uid`, `allow-group`: docs/containers.md). A user admitted
//! that way is a *member*: it takes and gives back its own tokens and reads
//! `status`, but may not change the limit or the gates, nor stop the
//! broker ([`Access::may_administer`]).
//!
//! The credentials are the kernel's, translated into the broker's
//! namespaces: a client in a user namespace is seen with its uid and gid on
//! the host, and SO_PEERCRED's pid is the client's pid in the broker's PID
//! namespace, so /proc/PID/status read here is the client's own.

use nix::sys::socket::UnixCredentials;

/// The users this broker serves.
#[derive(Debug, Clone)]
pub struct Admission {
    own_uid: u32,
    uids: Vec<u32>,
    gids: Vec<u32>,
}

/// What an admitted peer may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The broker's own uid or root: everything.
    Owner,
    /// Another uid admitted by `--allow-uid` or `--allow-group`: its own
    /// tokens and builds, and `status`.
    Member,
}

impl Access {
    /// Whether this peer may change the limit or the gates, or stop the
    /// broker.
    pub fn may_administer(self) -> bool {
        self == Access::Owner
    }
}

impl Admission {
    /// The broker's own user and root, and the users and groups named.
    pub fn new(uids: Vec<u32>, gids: Vec<u32>) -> Self {
        Admission {
            own_uid: nix::unistd::getuid().as_raw(),
            uids,
            gids,
        }
    }

    /// Whether anyone beyond the broker's own user and root is admitted.
    pub fn admits_others(&self) -> bool {
        !self.uids.is_empty() || !self.gids.is_empty()
    }

    /// The group to give the socket file to: the one allowed group, when
    /// no uid is allowed besides.
    pub fn socket_group(&self) -> Option<u32> {
        match (self.uids.as_slice(), self.gids.as_slice()) {
            ([], [gid]) => Some(*gid),
            _ => None,
        }
    }

    /// What `peer` may do, or why it may not use the broker at all (for
    /// the `ERR denied` line the client shows). Its supplementary groups
    /// are read from /proc only when a group is allowed and neither its
    /// uid nor its gid settles it.
    pub fn check(&self, peer: &UnixCredentials) -> Result<Access, String> {
        self.decide(peer.uid(), peer.gid(), || supplementary_groups(peer.pid()))
    }

    fn decide(
        &self,
        uid: u32,
        gid: u32,
        groups: impl FnOnce() -> Vec<u32>,
    ) -> Result<Access, String> {
        if uid == self.own_uid || uid == 0 {
            return Ok(Access::Owner);
        }
        if self.uids.contains(&uid) || self.gids.contains(&gid) {
            return Ok(Access::Member);
        }
        if !self.gids.is_empty() && groups().iter().any(|g| self.gids.contains(g)) {
            return Ok(Access::Member);
        }
        Err(self.refusal(uid))
    }

    fn refusal(&self, uid: u32) -> String {
        let serves = if self.own_uid == 0 {
            "uid 0 (root)".to_string()
        } else {
            format!("uid {} and root", self.own_uid)
        };
        let mut also = Vec::new();
        if !self.uids.is_empty() {
            also.push(format!("uid {}", join(&self.uids)));
        }
        if !self.gids.is_empty() {
            also.push(format!("members of gid {}", join(&self.gids)));
        }
        let also = if also.is_empty() {
            " only".to_string()
        } else {
            format!(", {}", also.join(", "))
        };
        format!(
            "uid {uid} may not use this broker: it serves {serves}{also}; to admit it, \
             start the broker with --allow-uid {uid} or --allow-group GROUP (a group uid {uid} is in), \
             or run a broker of its own (baton serve)"
        )
    }

    /// Why a member may not send `verb`, for the `ERR denied` line.
    pub fn admin_refusal(&self, uid: u32, verb: &str) -> String {
        format!(
            "uid {uid} may not {verb}: it may use this broker for its own builds \
             (--allow-uid/--allow-group), but only uid {} and root may change the limit \
             or the gates, or stop or replace the broker",
            self.own_uid
        )
    }
}

fn join(ids: &[u32]) -> String {
    ids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The supplementary groups of process `pid` (its `Groups:` line in
/// /proc/PID/status, as seen from our user namespace); none if it is gone.
fn supplementary_groups(pid: i32) -> Vec<u32> {
    u32::try_from(pid)
        .ok()
        .and_then(crate::sys::status)
        .map(|status| parse_groups(&status))
        .unwrap_or_default()
}

fn parse_groups(status: &str) -> Vec<u32> {
    crate::sys::status_field(status, "Groups:")
        .map(|groups| {
            groups
                .split_whitespace()
                .filter_map(|g| g.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The gid of `group`, a number or a name in the group database (the
/// system's, through getgrnam_r, so NSS groups count too).
///
/// # Errors
/// No group has that name, or the database cannot be read.
pub fn resolve_group(group: &str) -> Result<u32, String> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    match nix::unistd::Group::from_name(group) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(format!(
            "--allow-group {group}: no such group (give a group name from /etc/group or a numeric gid)"
        )),
        Err(e) => Err(format!(
            "--allow-group {group}: cannot read the group database: {e}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(uids: &[u32], gids: &[u32]) -> Admission {
        Admission {
            own_uid: 1000,
            uids: uids.to_vec(),
            gids: gids.to_vec(),
        }
    }

    fn no_groups() -> Vec<u32> {
        Vec::new()
    }

    #[test]
    fn only_our_own_user_and_root_are_admitted() {
        let a = admission(&[], &[]);
        assert_eq!(a.decide(1000, 1000, no_groups), Ok(Access::Owner));
        assert_eq!(a.decide(0, 0, no_groups), Ok(Access::Owner));
        let refusal = a.decide(1001, 1001, no_groups).unwrap_err();
        assert!(refusal.contains("uid 1001 may not"), "{refusal}");
        assert!(refusal.contains("uid 1000 and root only"), "{refusal}");
        assert!(refusal.contains("--allow-uid 1001"), "{refusal}");
        assert!(refusal.contains("--allow-group GROUP"), "{refusal}");
    }

    #[test]
    fn a_listed_uid_is_a_member_and_others_still_refused() {
        let a = admission(&[1234, 5000], &[]);
        assert_eq!(a.decide(1234, 1234, no_groups), Ok(Access::Member));
        assert_eq!(a.decide(5000, 1, no_groups), Ok(Access::Member));
        let refusal = a.decide(1235, 1235, no_groups).unwrap_err();
        assert!(refusal.contains("uid 1234, 5000"), "{refusal}");
    }

    #[test]
    fn a_group_admits_by_primary_or_supplementary_gid() {
        let a = admission(&[], &[600]);
        assert_eq!(a.decide(1234, 600, no_groups), Ok(Access::Member));
        assert_eq!(a.decide(1234, 1234, || vec![10, 600]), Ok(Access::Member));
        let refusal = a.decide(1234, 1234, || vec![10, 601]).unwrap_err();
        assert!(refusal.contains("members of gid 600"), "{refusal}");
    }

    #[test]
    fn groups_are_read_only_when_they_can_decide() {
        let a = admission(&[1234], &[]);
        let refused = a.decide(99, 99, || panic!("no group is allowed: nothing to read"));
        assert!(refused.is_err());
        let a = admission(&[], &[600]);
        let owner = a.decide(1000, 1, || panic!("the owner needs no groups"));
        assert_eq!(owner, Ok(Access::Owner));
    }

    #[test]
    fn only_the_owner_may_administer() {
        assert!(Access::Owner.may_administer());
        assert!(!Access::Member.may_administer());
        let words = admission(&[1234], &[]).admin_refusal(1234, "change the limit");
        assert!(
            words.starts_with("uid 1234 may not change the limit"),
            "{words}"
        );
    }

    #[test]
    fn the_groups_line_of_proc_status_is_parsed() {
        let status = "Name:\tmake\nUid:\t1 1 1 1\nGroups:\t4 24 27 600 \nNgid:\t0\n";
        assert_eq!(parse_groups(status), vec![4, 24, 27, 600]);
        assert_eq!(parse_groups("Groups:\t\n"), Vec::<u32>::new());
        assert_eq!(parse_groups("Name:\tx\n"), Vec::<u32>::new());
    }

    #[test]
    fn our_own_groups_are_read_from_proc() {
        // This process's own Groups: line, read the way a peer's is.
        let ours = supplementary_groups(std::process::id() as i32);
        let expected: Vec<u32> = nix::unistd::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        assert_eq!(ours, expected);
    }

    #[test]
    fn others_are_admitted_only_when_named_and_one_group_alone_owns_the_socket() {
        assert!(!admission(&[], &[]).admits_others());
        assert!(admission(&[1234], &[]).admits_others());
        assert!(admission(&[], &[600]).admits_others());
        assert_eq!(admission(&[], &[]).socket_group(), None);
        assert_eq!(admission(&[], &[600]).socket_group(), Some(600));
        assert_eq!(admission(&[1234], &[600]).socket_group(), None);
        assert_eq!(admission(&[], &[600, 601]).socket_group(), None);
    }

    #[test]
    fn a_peers_groups_are_read_from_its_proc_status() {
        if !nix::unistd::getuid().is_root() {
            return baton_testkit::skip(baton_testkit::Missing::Root, "setgroups needs root");
        }
        // A process with supplementary groups of its own, as a peer has.
        let mut peer = std::process::Command::new("sleep");
        peer.arg("30");
        // SAFETY: setgroups is async-signal-safe.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut peer, || {
                let groups = [4 as libc::gid_t, 24, 600];
                match libc::setgroups(groups.len(), groups.as_ptr()) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            });
        }
        let mut peer = peer.spawn().unwrap();
        let groups = supplementary_groups(peer.id() as i32);
        peer.kill().unwrap();
        peer.wait().unwrap();
        assert_eq!(groups, vec![4, 24, 600]);
        assert_eq!(
            supplementary_groups(-1),
            Vec::<u32>::new(),
            "no such process"
        );
    }

    #[test]
    fn a_group_is_a_number_or_a_name() {
        assert_eq!(resolve_group("4242"), Ok(4242));
        assert_eq!(resolve_group("root"), Ok(0));
        let unknown = resolve_group("no-such-group-here").unwrap_err();
        assert!(unknown.contains("no such group"), "{unknown}");
    }
}
