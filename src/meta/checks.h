/* checks.h - the checks a foreign format carries, as the check table of its foreign index
 * (st_mcheck, meta.h): a stored zip entry's bytes and CRC-32. A source collects the entries
 * of the archives it opened (st_check_add_zip, src/source/zip.h) and sets them on its metadata
 * (st_meta_set_checks): those holding a byte of some tensor or blob are kept, sorted and
 * validated; the table travels with the index (st_meta_encode: FORMAT.md, "The foreign
 * index") so that every rank of a load checks what it reads. Pure; no I/O. */
#ifndef STRATA_CHECKS_H
#define STRATA_CHECKS_H
#include "meta.h"

/* The longest name of a check (a zip entry's: ST_ZIP_MAX_NAME, src/source/zip.h). */
#define ST_CHECK_MAX_NAME 4096

/* Candidates being collected (malloc'd; names in the set's arena). */
typedef struct st_check_set {
    st_arena arena;
    st_mcheck *v;
    size_t n, cap;
} st_check_set;

void st_check_set_free(st_check_set *s);

/* Sets the check table of the foreign m: its own checks (if any) and s's (may be NULL), keeping
 * those that hold a byte of some extent of m, sorted by (file, offset); an exact duplicate
 * is kept once. Errors: STRATA_EFORMAT naming `where` when two overlap or one runs past its
 * file's end, STRATA_ENOMEM. */
int st_meta_set_checks(st_meta *m, const st_check_set *s, const char *where);

/* The first check of file f (of m) ending after byte off; m->nchecks if none. */
size_t st_check_find(const st_meta *m, uint32_t f, uint64_t off);

/* The table's encoding in a foreign index (meta.c): count, then per check its file, offset,
 * bytes (varints), CRC-32 (u32) and name (a string of 1..ST_CHECK_MAX_NAME bytes). The reader
 * validates what st_meta_set_checks guarantees (file in range, inside it, non-empty, sorted,
 * disjoint) and fails r otherwise. */
void st_checks_put(st_buf *b, const st_meta *m);
int st_checks_read(st_rd *r, st_meta *m);

#endif
