/* libbaton: C client for the baton token broker.
 *
 * A process takes job slots ("tokens") from the machine-wide pool before
 * running jobs and gives them back after; the broker hands each freed token
 * to the one waiter that has waited longest. The wire protocol is
 * docs/protocol.md of the baton project.
 *
 *   baton_t *c = baton_connect(NULL, "my-tool", NULL);
 *   if (!c || baton_acquire(c, 1, NULL) < 0) err(1, "baton");
 *   run_one_job();
 *   baton_release(c, 1, NULL);
 *   baton_close(c);
 *
 * Tokens belong to the connection: when the process exits, crashes or is
 * killed (even with SIGKILL), the broker takes them back at once.
 *
 * Deadlines: every call that waits for the broker takes `deadline`, an
 * absolute time on CLOCK_MONOTONIC (baton_deadline() makes one), or NULL to
 * wait as long as it takes. A call whose deadline passes fails with
 * ETIMEDOUT.
 *
 * Errors: functions return -1 (or NULL) and set errno. Each function lists
 * its errno values; any call may also fail with
 *   ECONNRESET  the broker closed the connection (it stopped or was killed);
 *               the connection is dead: baton_close() it.
 *   EPROTO      the broker said something this library does not expect, or
 *               refused a request as malformed (a bug here or a broker of
 *               another protocol version); the connection is dead.
 * baton_errmsg() says in words what the last failed call found (the socket,
 * the uid that answered there, the broker's maximum of clients, ...);
 * baton_refusal() gives the broker's own words for the last refusal on a
 * connection.
 *
 * Threads: the library has no global state (baton_errmsg()'s message is
 * kept per thread, as errno is). A connection must be used by
 * one thread at a time; give each thread its own connection (a waiting
 * baton_acquire() holds it, and the protocol allows nothing else on it
 * meanwhile). Writes use MSG_NOSIGNAL: a dead broker never raises SIGPIPE.
 */
#ifndef BATON_H
#define BATON_H

#include <stddef.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct baton baton_t;

/* Writes the socket path used when baton_connect() is given NULL, the same
 * as the baton CLI's: $BATON_SOCKET, else $XDG_RUNTIME_DIR/baton/socket,
 * else /tmp/baton-$UID/socket. Returns its length, or -1 with
 *   ENAMETOOLONG  it does not fit in `size` bytes (NUL included). */
int baton_socket_path(char *buf, size_t size);

/* Now + `ms` milliseconds on CLOCK_MONOTONIC, for the calls below. */
struct timespec baton_deadline(unsigned long ms);

/* Connects to the broker at `path` (NULL: baton_socket_path()) and says
 * HELLO. `label` (NULL: none) is shown by `baton status`; control characters
 * are dropped and it is cut to 200 bytes. Returns the connection, or NULL:
 *   ENOENT, ECONNREFUSED  no broker listens there (start one with:
 *                         baton serve --jobs N)
 *   EACCES        the socket belongs to another user, or the broker does
 *                 not serve our uid (ERR denied)
 *   EPERM         not our broker, refused before a word is sent: a process
 *                 of another user (neither ours nor root) answers there; or
 *                 the socket is in one of baton's own directories
 *                 ($XDG_RUNTIME_DIR/baton, /tmp/baton-$UID) and that
 *                 directory (by lstat) is a symbolic link, not a directory,
 *                 another user's, or open to group or world (mode & 077)
 *   ENAMETOOLONG  the path does not fit a Unix socket address
 *   EUSERS        the broker already serves its maximum of connections
 *                 (ERR full)
 *   ETIMEDOUT     no answer before the deadline
 *   ENOMEM        out of memory
 *   and any other errno of socket(2) or connect(2).
 * baton_errmsg() then names the socket, e.g.
 *   "PATH is answered by a process of uid 65534, not by your own broker
 *    (uid 1000) or root's: refusing to talk to it (...)"
 *   "/tmp/baton-1000 is open to other users (mode 0770): refusing to use a
 *    broker there (if it is yours: chmod 700 /tmp/baton-1000)"
 *   "the broker at PATH serves its maximum of 6 clients (try again when
 *    some finish, or raise it: ...)"
 *   "the broker at PATH refuses you: <the broker's words>"
 *   "no broker at PATH (start one with: baton serve --jobs N)" */
baton_t *baton_connect(const char *path, const char *label, const struct timespec *deadline);

/* Waits until `n` more tokens are this connection's, all at once (first
 * come, first served). Returns 0, or -1:
 *   ETIMEDOUT  the deadline passed: the request was withdrawn, nothing is
 *              held for it. (If the grant raced the deadline and won, the
 *              call returns 0: the tokens are yours.)
 *   ERANGE     n is 0, or held + n exceeds the pool's limit (it could never
 *              be granted); the connection stays usable. */
int baton_acquire(baton_t *c, unsigned n, const struct timespec *deadline);

/* Takes `n` tokens only if they are free now and nobody is waiting.
 * Returns 1 (taken), 0 (not free: nothing taken), or -1:
 *   ERANGE     as for baton_acquire()
 *   ETIMEDOUT  no answer before the deadline (the connection is then in
 *              an unknown state: close it). */
int baton_try_acquire(baton_t *c, unsigned n, const struct timespec *deadline);

/* Gives back `n` tokens. Returns 0, or -1:
 *   EINVAL     n is more than this connection holds: nothing was given
 *              back; the connection stays usable
 *   ERANGE     n is 0
 *   ETIMEDOUT  as for baton_try_acquire(). */
int baton_release(baton_t *c, unsigned n, const struct timespec *deadline);

/* The broker's state as the JSON document `baton status --json` prints
 * (docs/protocol.md lists its fields), NUL-terminated, to free() by the
 * caller. Returns NULL on error:
 *   ENOMEM     out of memory (the connection is then unusable: close it)
 *   ETIMEDOUT  as for baton_try_acquire(). */
char *baton_status_json(baton_t *c, const struct timespec *deadline);

/* Tokens this connection holds now (through the fast path too). */
unsigned baton_held(const baton_t *c);

/* The pool's limit when the connection was made. */
unsigned baton_limit(const baton_t *c);

/* The broker's message for the last request it refused ("" if none). */
const char *baton_refusal(const baton_t *c);

/* What the last call of this thread that failed found, in words, for
 * people (programs look at errno): no trailing newline, no "baton: "
 * prefix, "" if none failed yet. Calls that succeed leave it alone, as
 * they leave errno; the next failure in the same thread overwrites it, so
 * read or copy it before calling the library again:
 *   if (!c) errx(1, "baton: %s", baton_errmsg());
 * A refusal by the broker reads "broker refused: <its words> (<code>)",
 * except at connect, where ERR full and ERR denied name the socket (see
 * baton_connect()). Never NULL; the library owns the buffer. */
const char *baton_errmsg(void);

/* Asks the broker for a seat in the shared-memory fast path of the
 * connection's build (docs/fastpath.md). From then on baton_acquire(c, 1,
 * ...), baton_try_acquire(c, 1, ...) and baton_release() take and give
 * single tokens in memory the broker shares with the build's other
 * fast-path clients: compare-and-swaps, and one futex_wake when a waiter
 * must be woken; no round trip to the broker. Everything else (n > 1,
 * STATUS, ...) still goes over the socket, as does whatever the region
 * refuses: a TRY that finds no free token there (the pool may have one), a
 * full ring, a seat the broker revoked, a broker that died. Tokens taken
 * through the region belong to the connection just the same: baton_held()
 * counts them, and when the process dies the broker takes them back. A
 * deadline bounds a wait in the region as on the socket.
 *
 * A region is its build's: the connections of the processes under one
 * `baton run` (or under a process that sent BUILD) share one. A process
 * outside any build is a build of its own at each connection, and while
 * two builds have regions, or another build waits, the broker keeps every
 * region's barrier up and serves each token itself, at the socket's cost.
 *
 * Call it when no reply is pending (right after baton_connect(), or
 * between calls). A second call on a seated connection does nothing and
 * returns 0. The child of a fork() must not use a connection that has a
 * seat, not even baton_close() (the region is not mapped in the child, and
 * the socket is its parent's); exec or _exit drops it. Returns 0 (seated),
 * or -1:
 *   ENOTSUP    the broker offers no seat (ERR unavailable: another user's
 *              process, a full or closed region, ...); baton_refusal() and
 *              baton_errmsg() give its words. The connection stays
 *              usable, on the socket.
 *   EPROTO     a reply was already buffered, or the broker's reply or its
 *              region (unsealed, another layout) is not what this library
 *              expects; a broker older than the fast path refuses FASTPATH
 *              as malformed and closes the connection
 *   and any errno of recvmsg(2), fstat(2) or mmap(2). */
int baton_fastpath(baton_t *c);

/* As baton_fastpath(), in a pile (FASTPATH 2; docs/fastpath.md, "The
 * pile"): a freed token goes to whoever comes for it first, not to the
 * oldest waiter, as with a semaphore. A waiter can be passed over for as
 * long as others keep coming back; in exchange a process that releases
 * and takes again wakes nobody. The first fast-path client of a build
 * chooses its layout: asking for the other one is ENOTSUP with the
 * broker's reason, and the connection stays on the socket. Returns as
 * baton_fastpath(). */
int baton_fastpath_pile(baton_t *c);

/* 1 while the connection has a fast-path seat it still uses, else 0 (none
 * asked for, refused, or given up after the broker revoked it or died). */
int baton_uses_fastpath(const baton_t *c);

/* Closes the connection (the broker takes back every token it held) and
 * frees it. NULL is allowed. */
void baton_close(baton_t *c);

#ifdef __cplusplus
}
#endif

#endif
