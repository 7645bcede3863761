/* zip.h - a bounded reader of zip archives (the container of torch.save files): lists the
 * entries of the central directory (ZIP64 included) and reads stored entries whole, checking
 * their CRC-32. Nothing is decompressed: a compressed entry is listed with its method so
 * that a reader can name it, and refused when read. No I/O of its own: every byte comes
 * through the caller's read callback (a storage backend is behind it). Not thread-safe per
 * object; separate objects are independent.
 *
 * Rules (docs/FORMAT.md, "Reading pickle and zip"), each refusal STRATA_EFORMAT with a
 * message naming the file (and the entry):
 *   - the end of central directory record is found in the last 22 + 65535 bytes, its comment
 *     running exactly to the end of the file; one disk only; a ZIP64 locator before it is
 *     followed to the ZIP64 record, whose counts and offsets then replace the 32-bit ones;
 *   - the central directory lies before the end record, is at most ST_ZIP_MAX_CD bytes and
 *     holds exactly the number of entries the end record says;
 *   - every entry: not encrypted, a name of 1..ST_ZIP_MAX_NAME bytes without NUL or '\\',
 *     not absolute, no "." or ".." component, unique; a stored entry's two sizes are equal;
 *     its local header (signature, name, method, CRC and sizes unless a data descriptor
 *     follows) agrees with the central directory; local header and data lie before the
 *     central directory and no two entries overlap.
 * Memory is bounded by a small multiple of the central directory's size. */
#ifndef STRATA_ZIP_H
#define STRATA_ZIP_H
#include <stddef.h>
#include <stdint.h>

#include "../core/util.h"
#include "../meta/checks.h"
#include "strata_types.h"

#define ST_ZIP_MAX_CD (256ull << 20) /* bytes of central directory a reader accepts */
#define ST_ZIP_MAX_NAME ST_CHECK_MAX_NAME /* bytes of an entry's name */

/* Reads exactly len bytes at offset off into buf. Returns 0, or a negative STRATA_E* code
 * with strata_error_last() set (a short read is an error: the caller passes the size). */
typedef int (*st_zip_read_fn)(void *ctx, void *buf, size_t len, uint64_t off);

typedef struct st_zip_entry {
    char *name;          /* NUL-terminated */
    uint16_t method;     /* 0: stored; anything else is listed but never read */
    uint16_t flags;      /* general purpose bit flags */
    uint32_t crc;        /* CRC-32 of the uncompressed bytes */
    uint64_t csize;      /* bytes stored */
    uint64_t usize;      /* bytes uncompressed (= csize for a stored entry) */
    uint64_t header_off; /* the local header */
    uint64_t data_off;   /* the first byte of the data */
} st_zip_entry;

typedef struct st_zip {
    st_arena arena;      /* owns everything below */
    uint64_t file_size;
    uint64_t cd_off;     /* the central directory's first byte */
    int zip64;           /* a ZIP64 end record was used */
    size_t n;
    st_zip_entry *e;     /* in central directory order */
} st_zip;

/* Opens the archive of file_size bytes read through rd(ctx, ...): finds the end records,
 * lists and checks every entry (the rules above). On failure *z is empty (st_zip_free is
 * harmless). Errors: STRATA_EFORMAT naming file (NULL: "zip file") and the problem, the
 * callback's code, STRATA_ENOMEM. */
int st_zip_open(st_zip *z, uint64_t file_size, st_zip_read_fn rd, void *ctx, const char *file);
void st_zip_free(st_zip *z);

/* The entry named name, or NULL. */
const st_zip_entry *st_zip_find(const st_zip *z, const char *name);

/* Reads entry e whole into buf (e->usize bytes) and checks its CRC-32. Errors:
 * STRATA_EFORMAT for a compressed entry (naming it and its method), STRATA_ECHECKSUM when the
 * CRC differs (naming entry and file), the callback's code. */
int st_zip_read(const st_zip *z, const st_zip_entry *e, void *buf, st_zip_read_fn rd, void *ctx,
                const char *file);

/* The entries of z as checks of an index (st_check_set, meta/checks.h): every stored,
 * non-empty entry, its offsets counted from byte `base` of file `file` (a DCP item's archive
 * lies inside its .distcp file). A compressed entry is left out (strata reads none: its bytes
 * are never a tensor's). STRATA_ENOMEM on failure. */
int st_check_add_zip(st_check_set *s, const st_zip *z, uint32_t file, uint64_t base);

#endif
