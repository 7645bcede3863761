/* error.c - error codes, names and the thread-local last-error message. */
#include "error.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_msg[ST_ERR_BYTES];

const char *strata_error_last(void) { return last_msg; }

void st_clear_error(void) { last_msg[0] = 0; }

int st_err_keep(char *msg, int rc)
{
    snprintf(msg, ST_ERR_BYTES, "%s", rc ? last_msg : "");
    return rc;
}

int st_err_restore(int rc, const char *msg)
{
    if (msg != last_msg)
        snprintf(last_msg, sizeof last_msg, "%s", msg);
    return rc;
}

int st_fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_msg, sizeof last_msg, fmt, ap);
    va_end(ap);
    return code;
}

int strata_error_set(int code, const char *fmt, ...)
{
    if (!fmt) {
        last_msg[0] = 0;
        return code;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_msg, sizeof last_msg, fmt, ap);
    va_end(ap);
    return code;
}

int st_wrap(int code, const char *fmt, ...)
{
    char prefix[512], old[sizeof last_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, last_msg, sizeof old);
    size_t n = strlen(prefix);
    if (n > sizeof last_msg - 3)
        n = sizeof last_msg - 3;
    memcpy(last_msg, prefix, n);
    memcpy(last_msg + n, ": ", 2);
    const char *rest = old[0] ? old : strata_error_str(code);
    size_t m = strlen(rest);
    if (m > sizeof last_msg - n - 3)
        m = sizeof last_msg - n - 3;
    memcpy(last_msg + n + 2, rest, m);
    last_msg[n + 2 + m] = 0;
    return code;
}

const char *strata_error_name(int code)
{
    switch (code) {
#define X(name, val, msg) \
    case val:             \
        return "STRATA_" #name;
        STRATA_ERRNO_MAP(X)
#undef X
    }
    return "STRATA_E?";
}

const char *strata_error_str(int code)
{
    switch (code) {
#define X(name, val, msg) \
    case val:             \
        return msg;
        STRATA_ERRNO_MAP(X)
#undef X
    }
    return "unknown error";
}

int st_from_errno(int err)
{
    switch (err) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
        return STRATA_ENOSPC;
    case ENOENT:
    case ENOTDIR:
        return STRATA_ENOENT;
    case ENOMEM:
        return STRATA_ENOMEM;
    case EEXIST:
        return STRATA_EEXIST;
    default:
        return STRATA_EIO;
    }
}
