/* vfs_fault.h - the fault injector, a storage wrapper for tests (after SQLite's test_vfs):
 * "fault+<uri>?op=OP&n=N&errno=E[&short=1][&sticky=1]" fails the N-th OP (open, write,
 * fsync, rename (an exchange counts as one), read, mkdir, allocate, unlink, lock) of the
 * backend of <uri> with errno E (or
 * makes the write short); sticky fails every later one too. Not known to the resolver
 * until registered. */
#ifndef STRATA_VFS_FAULT_H
#define STRATA_VFS_FAULT_H
#include "vfs.h"

/* Registers the "fault" wrapper (idempotent, thread-safe). */
int st_vfs_fault_register(void);

#endif
