/* error.h - setting the thread-local error message that strata_error_last() returns. */
#ifndef STRATA_ERROR_H
#define STRATA_ERROR_H
#include "strata_types.h"

/* Records a formatted message for `code` and returns `code` (so: return st_fail(...)). */
int st_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prefixes the current message with context ("loading x: <old message>"); returns code. */
int st_wrap(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void st_clear_error(void);
/* The bytes of an error message: strata_error_last()'s buffer and every copy kept of one
 * (a status sent to other ranks, a background failure kept for its wait). */
#define ST_ERR_BYTES 1024
/* Keeps this thread's message in msg (ST_ERR_BYTES), or "" when rc is 0 (its message may be
 * stale then); returns rc. rc ST_ERR_ALWAYS keeps the message whatever it is. */
int st_err_keep(char *msg, int rc);
#define ST_ERR_ALWAYS (-0x7fff)
/* Makes a kept message this thread's again; returns rc. */
int st_err_restore(int rc, const char *msg);
/* Maps an errno value to a STRATA_E* code. */
int st_from_errno(int err);

#endif
