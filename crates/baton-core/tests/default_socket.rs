//! Where the socket is when nobody names it: `$BATON_SOCKET`, else
//! `$XDG_RUNTIME_DIR/baton/socket`, else `/tmp/baton-$UID/socket`.
//!
//! One test in a binary of its own: it sets environment variables, which
//! no other test in the same process may read meanwhile.

use baton_core::paths::{
    default_socket, default_socket_path, is_chosen_by_baton, is_default_private_dir,
    named_broker_uid, socket_path, standard_socket_path, trusts_broker_of,
};
use std::path::{Path, PathBuf};

#[test]
fn the_default_socket_follows_the_environment_in_its_order() {
    // SAFETY: getuid cannot fail and touches no memory.
    let uid = unsafe { libc::getuid() };
    let tmp = PathBuf::from(format!("/tmp/baton-{uid}"));

    std::env::set_var("BATON_SOCKET", "/x/named/socket");
    std::env::set_var("XDG_RUNTIME_DIR", "/run/user/77");
    assert_eq!(
        default_socket(),
        (PathBuf::from("/x/named/socket"), "$BATON_SOCKET")
    );
    assert_eq!(socket_path(None), Path::new("/x/named/socket"));
    assert_eq!(
        standard_socket_path(),
        Path::new("/run/user/77/baton/socket"),
        "where brokers meet unless told, $BATON_SOCKET aside"
    );
    assert!(!is_chosen_by_baton(None), "the user named it");

    std::env::set_var("BATON_SOCKET", "");
    let xdg = PathBuf::from("/run/user/77/baton");
    assert_eq!(default_socket(), (xdg.join("socket"), "$XDG_RUNTIME_DIR"));
    assert_eq!(default_socket_path(), xdg.join("socket"));
    assert!(is_chosen_by_baton(None), "an empty one names nothing");
    assert!(is_default_private_dir(&xdg));
    assert!(is_default_private_dir(&tmp));
    assert!(!is_default_private_dir(Path::new("/run/user/77")));

    std::env::remove_var("BATON_SOCKET");
    std::env::remove_var("XDG_RUNTIME_DIR");
    assert_eq!(default_socket(), (tmp.join("socket"), "/tmp/baton-$UID"));
    assert!(is_chosen_by_baton(None));
    assert!(!is_default_private_dir(&xdg));

    // $BATON_BROKER_UID names one more broker owner to trust (read here,
    // in the binary that owns the environment).
    std::env::remove_var("BATON_BROKER_UID");
    assert_eq!(named_broker_uid(), None);
    assert!(!trusts_broker_of(4242, uid.wrapping_add(1).max(1)));
    std::env::set_var("BATON_BROKER_UID", " 4242\n");
    assert_eq!(named_broker_uid(), Some(4242));
    assert!(trusts_broker_of(4242, uid.wrapping_add(1).max(1)));
    assert!(!trusts_broker_of(4243, uid.wrapping_add(1).max(1)));
    std::env::set_var("BATON_BROKER_UID", "nobody");
    assert_eq!(named_broker_uid(), None, "a uid is a number");
    std::env::remove_var("BATON_BROKER_UID");
}
