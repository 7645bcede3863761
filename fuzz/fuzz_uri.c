/* fuzz_uri.c - libFuzzer target for URI resolution (st_vfs_resolve in src/io/vfs.c and the
 * fault injector's query parser in src/io/vfs_fault.c). Resolution only parses: no
 * backend method is called, so nothing touches the filesystem.
 *
 * The input, as a NUL-terminated string, is resolved twice: into a PATH_MAX buffer and into
 * a buffer just large enough for half of it (both heap-allocated to their exact size, so
 * ASan sees any write past cap). It is also appended as a query to "fault+file:///p?" to
 * reach the query parser directly. A success must give a backend of this version and a
 * non-empty path taken from the URI without trailing slashes; a failure must be EINVAL,
 * ESCHEME or ENOMEM with a message. Every backend instance is released (LeakSanitizer).
 * Also replayed by tests/test_fuzz_replay.c. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/vfs_fault.h"
#include "strata.h"

#define FU_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_uri: " __VA_ARGS__);                                          \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

/* Resolves uri into a path buffer of exactly cap bytes and checks the outcome. Returns the
 * rc; *path_copy (if not NULL) gets a malloc'd copy of the path on success. */
static int fu_resolve(const char *uri, size_t cap, char **path_copy)
{
    char *path = malloc(cap ? cap : 1);
    if (!path)
        return STRATA_ENOMEM;
    const st_vfs *v = NULL;
    int rc = st_vfs_resolve(uri, &v, path, cap);
    if (rc != 0) {
        if (rc != STRATA_EINVAL && rc != STRATA_ESCHEME && rc != STRATA_ENOMEM)
            FU_FAIL("resolve returned %s for '%s'", strata_error_name(rc), uri);
        if (strata_error_last()[0] == 0)
            FU_FAIL("resolve failed without a message for '%s'", uri);
        free(path);
        return rc;
    }
    if (!v || v->version != ST_VFS_VERSION || !v->scheme || !v->open || !v->close)
        FU_FAIL("resolve gave no usable backend for '%s'", uri);
    size_t n = strnlen(path, cap);
    if (n == 0 || n >= cap)
        FU_FAIL("resolve gave an empty or unterminated path for '%s'", uri);
    if (n > 1 && path[n - 1] == '/')
        FU_FAIL("path '%s' of '%s' keeps a trailing slash", path, uri);
    if (!strstr(uri, path))
        FU_FAIL("path '%s' does not come from '%s'", path, uri);
    int fault = strncmp(uri, "fault+", 6) == 0;
    if (strcmp(v->scheme, fault ? "fault" : "file") != 0)
        FU_FAIL("'%s' resolved to the %s backend", uri, v->scheme);
    if (!fault && strstr(uri, "://") && strncmp(uri, "file://", 7) != 0)
        FU_FAIL("unknown scheme accepted: '%s'", uri);
    if (path_copy)
        *path_copy = strdup(path);
    st_vfs_release(v);
    free(path);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_vfs_fault_register();
    char *uri = malloc(size + 1);
    if (!uri)
        return 0;
    memcpy(uri, data, size);
    uri[size] = 0;
    size_t len = strlen(uri);

    char *full = NULL, *half = NULL;
    int rc = fu_resolve(uri, PATH_MAX, &full);
    int rh = fu_resolve(uri, len / 2 + 1, &half);
    /* a smaller buffer can only turn success into EINVAL, and never changes the path */
    if (rh == 0 && (rc != 0 || !full || !half || strcmp(full, half) != 0))
        FU_FAIL("'%s' resolves differently with a smaller buffer", uri);
    if (rc != 0 && rh != 0 && rc != rh && rh != STRATA_EINVAL)
        FU_FAIL("'%s': %d with a large buffer, %d with a small one", uri, rc, rh);
    free(full);
    free(half);

    /* the input as the fault injector's query string */
    static const char prefix[] = "fault+file:///p?";
    char *q = malloc(sizeof prefix + len);
    if (q) {
        memcpy(q, prefix, sizeof prefix - 1);
        memcpy(q + sizeof prefix - 1, uri, len + 1);
        fu_resolve(q, PATH_MAX, NULL);
        free(q);
    }
    free(uri);
    return 0;
}
