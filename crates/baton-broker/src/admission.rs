//! Who may use this broker, decided in one place for every connection:
//! the kernel's word on the peer (SO_PEERCRED), never the socket file's
//! mode, which anyone sharing the socket may have opened (docs/security.md).
//! Today the broker's own user and root; an option admitting chosen uids
//! or a group would extend [`Admission`] and nothing else.

use nix::sys::socket::UnixCredentials;

/// The users this broker serves.
#[derive(Debug, Clone)]
pub struct Admission {
    own_uid: u32,
}

impl Admission {
    /// The broker's own user and root.
    pub fn own_user() -> Self {
        Admission {
            own_uid: nix::unistd::getuid().as_raw(),
        }
    }

    /// Ok if `peer` may use the broker; else why not, for the `ERR denied`
    /// line the client shows.
    pub fn check(&self, peer: &UnixCredentials) -> Result<(), String> {
        if peer.uid() == self.own_uid || peer.uid() == 0 {
            return Ok(());
        }
        Err(format!(
            "uid {} may not use this broker: it serves uid {} and root only (each user runs a broker of their own: baton serve)",
            peer.uid(),
            self.own_uid
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32) -> UnixCredentials {
        UnixCredentials::from(libc::ucred {
            pid: 1,
            uid,
            gid: uid,
        })
    }

    #[test]
    fn only_our_own_user_and_root_are_admitted() {
        let admission = Admission { own_uid: 1000 };
        assert!(admission.check(&peer(1000)).is_ok());
        assert!(admission.check(&peer(0)).is_ok());
        let refusal = admission.check(&peer(1001)).unwrap_err();
        assert!(refusal.contains("uid 1001"), "{refusal}");
    }
}
