#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

int baton_socket_path(char *buf, size_t size) {
    const char *explicit = getenv("BATON_SOCKET");
    const char *runtime = getenv("XDG_RUNTIME_DIR");
    int n;
    if (explicit && *explicit)
        n = snprintf(buf, size, "%s", explicit);
    else if (runtime && *runtime)
        n = snprintf(buf, size, "%s/baton/socket", runtime);
    else
        n = snprintf(buf, size, "/tmp/baton-%u/socket", (unsigned)getuid());
    if (n < 0 || (size_t)n >= size) {
        errno = ENAMETOOLONG;
        baton__say("the socket path (%s) does not fit in %zu bytes", explicit && *explicit ? "$BATON_SOCKET"
                   : runtime && *runtime ? "$XDG_RUNTIME_DIR/baton/socket" : "/tmp/baton-$UID/socket", size);
        return -1;
    }
    return n;
}
