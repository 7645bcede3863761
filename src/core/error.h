/* error.h - setting the thread-local error message that strata_error_last() returns. */
#ifndef STRATA_ERROR_H
#define STRATA_ERROR_H
#include "strata_types.h"

/* Records a formatted message for `code` and returns `code` (so: return st_fail(...)). */
int st_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prefixes the current message with context ("loading x: <old message>"); returns code. */
int st_wrap(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void st_clear_error(void);
/* Maps an errno value to a STRATA_E* code. */
int st_from_errno(int err);

#endif
