#include <errno.h>
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

/* The words for this thread's last failure: per thread, as errno is, so
 * that a failed baton_connect(), which has no connection to keep them in,
 * can still say what it found. */
static _Thread_local char message[BATON_MSG_MAX];

const char *baton_errmsg(void) { return message; }

void baton__say(const char *format, ...) {
    int e = errno;
    va_list args;
    va_start(args, format);
    vsnprintf(message, sizeof message, format, args);
    va_end(args);
    errno = e;
}
