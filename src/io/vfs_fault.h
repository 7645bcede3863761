/* vfs_fault.h - the fault injector, a storage wrapper for tests (after SQLite's test_vfs):
 * "fault+<uri>?op=OP&n=N&errno=E[&short=1][&sticky=1][&kill=1]" fails the N-th OP (open,
 * write, fsync, rename (an exchange counts as one), read, mkdir, allocate, unlink, lock,
 * exchange (exchanges alone) of the backend of <uri> with errno E (or makes the write short;
 * or, kill=1, SIGKILLs the process in that call); sticky fails every later one too. "lock=none" grants every lock without excluding anyone;
 * "lock=local" makes locks exclude only the callers of one resolved URI (NFS mounted
 * nolock, seen from two clients); either may come alone or with op and n. Not known to
 * the resolver until registered. */
#ifndef STRATA_VFS_FAULT_H
#define STRATA_VFS_FAULT_H
#include "vfs.h"

/* Registers the "fault" wrapper (idempotent, thread-safe). */
int st_vfs_fault_register(void);

#endif
