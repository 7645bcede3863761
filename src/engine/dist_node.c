/* dist_node.c - the ranks of a communicator grouped by node, and one shared memory segment
 * per node that its ranks map: a distributed load reads each chunk once and hands it to
 * the other ranks of the reader's node through this segment instead of the communicator
 * (dist_load.c). Every function taking a strata_comm is a collective.
 *
 * A segment's name says whose it is: /strata-load-<uid>-<boot>-<pidns>-<pid>-<random>
 * (the creator's user, the first 8 characters of the boot id, its pid namespace and pid).
 * The name is unlinked as soon as every rank of the node has mapped it; a creator killed
 * before that leaves it in /dev/shm, and the next load on the node (or `strata gc`) removes
 * it (strata_reclaim_load_segments): this user's, this boot's, this pid namespace's, and its
 * creator gone. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "dist.h"

#define NAME_BYTES 128
#define SHM_DIR "/dev/shm" /* where glibc's shm_open puts its names */

/* The boot id (36 characters, "" if unknown) into id[40]. */
static void boot_id(char *id)
{
    memset(id, 0, 40);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(id, 40, f))
            id[0] = 0;
        fclose(f);
    }
    id[strcspn(id, "\n")] = 0;
}

/* This process's node: its host name and boot id (two containers of one host with one
 * name differ there, or fail to open each other's segment: then no segment is used). */
static uint64_t node_key(void)
{
    char id[512] = {0};
    gethostname(id, 255);
    boot_id(id + 256);
    return st_hash(id, sizeof id);
}

/* "strata-load-<uid>-<boot>-<pidns>-": the start of this process's segment names. */
static void name_prefix(char *out, size_t cap)
{
    char id[40], ns[64] = {0};
    boot_id(id);
    id[8] = 0;
    ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1); /* "pid:[4026531836]" */
    unsigned long long nsid = n > 5 ? strtoull(ns + 5, NULL, 10) : 0;
    snprintf(out, cap, "strata-load-%u-%s-%llu-", (unsigned)geteuid(), id[0] ? id : "x", nsid);
}

int strata_reclaim_load_segments(int *removed)
{
    st_clear_error();
    char prefix[NAME_BYTES];
    name_prefix(prefix, sizeof prefix);
    size_t plen = strlen(prefix);
    int n = 0;
    DIR *dir = opendir(SHM_DIR);
    struct dirent *e;
    while (dir && (e = readdir(dir))) {
        if (strncmp(e->d_name, prefix, plen) != 0)
            continue;
        char *end;
        long pid = strtol(e->d_name + plen, &end, 10);
        struct stat st;
        if (end == e->d_name + plen || *end != '-' || pid <= 0 || pid > INT32_MAX ||
            kill((pid_t)pid, 0) == 0 || errno != ESRCH) /* alive, or not ours to judge */
            continue;
        if (fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode) ||
            st.st_uid != geteuid())
            continue;
        char name[NAME_MAX + 2];
        snprintf(name, sizeof name, "/%s", e->d_name);
        n += shm_unlink(name) == 0;
    }
    if (dir)
        closedir(dir);
    if (removed)
        *removed = n;
    return 0;
}

void st_node_shm_close(st_node_shm *s)
{
    if (s->base)
        munmap(s->base, s->size);
    free(s->node);
    free(s->lidx);
    memset(s, 0, sizeof *s);
}

int st_node_shm_open(strata_comm *comm, size_t slot, st_node_shm *out)
{
    const int P = comm->size, me = comm->rank;
    memset(out, 0, sizeof *out);
    uint64_t *keys = malloc((size_t)P * sizeof *keys);
    char(*names)[NAME_BYTES] = malloc((size_t)P * NAME_BYTES);
    int32_t *sts = malloc((size_t)P * sizeof *sts);
    out->node = malloc((size_t)P * sizeof *out->node);
    out->lidx = malloc((size_t)P * sizeof *out->lidx);
    int rc = 0;
    if (!keys || !names || !sts || !out->node || !out->lidx) {
        rc = st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
        goto out;
    }
    /* 1. nodes: ranks with equal keys; STRATA_LOAD_NODES=k (tests) makes k groups of
     * consecutive ranks */
    const char *fake = getenv("STRATA_LOAD_NODES");
    uint64_t mine = fake && atoi(fake) > 0 ? (uint64_t)me * (uint64_t)atoi(fake) / (uint64_t)P
                                           : node_key();
    if ((rc = st_allgather(comm, &mine, sizeof mine, keys)))
        goto out;
    int shared = 0, nlocal = 0, leader = -1;
    for (int r = 0; r < P; r++) { /* a node is named by its lowest rank */
        int q = 0;
        while (keys[q] != keys[r])
            q++;
        out->node[r] = q;
        out->lidx[r] = 0; /* the ranks of its node below it */
        for (int k = q; k < r; k++)
            out->lidx[r] += out->node[k] == q;
        shared |= q != r;
    }
    for (int r = 0; r < P; r++)
        nlocal += out->node[r] == out->node[me];
    leader = out->node[me];
    if (!shared || !slot)
        goto out; /* the same decision on every rank: the keys and slot are the same */
    /* 2. each node's lowest rank makes the segment, sized and reserved (a tmpfs that is too
     * small refuses here, instead of killing a process with SIGBUS later) */
    size_t size = (size_t)nlocal * slot;
    int32_t st = 0;
    int fd = -1;
    char name[NAME_BYTES] = {0}; /* sent from its own buffer: MPI refuses aliased ones */
    if (leader == me) {
        strata_reclaim_load_segments(NULL); /* what loads killed on this node left */
        uint64_t r = st_mix64((uint64_t)getpid() ^ (uint64_t)time(NULL) << 20 ^
                              (uint64_t)(uintptr_t)&r ^ st_mix64((uint64_t)clock()));
        char prefix[NAME_BYTES - 40];
        name_prefix(prefix, sizeof prefix);
        snprintf(name, NAME_BYTES, "/%s%d-%016llx", prefix, (int)getpid(),
                 (unsigned long long)r);
        fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0 || posix_fallocate(fd, 0, (off_t)size) != 0)
            st = 1;
    }
    if ((rc = st_allgather(comm, name, NAME_BYTES, names)))
        goto fail_fd;
    if (leader != me && (fd = shm_open(names[leader], O_RDWR, 0)) < 0)
        st = 1;
    if (!st) {
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            st = 1;
        else
            out->base = p, out->size = size, out->slot = slot;
    }
    /* 3. all mapped (or someone failed: then nobody uses a segment); the name goes */
    rc = st_allgather(comm, &st, sizeof st, sts);
    for (int r = 0; !rc && r < P; r++)
        if (sts[r] && out->base) {
            munmap(out->base, out->size);
            out->base = NULL;
        }
fail_fd: /* the name goes in every case: a failed collective must not leave it in /dev/shm */
    if (leader == me && name[0])
        shm_unlink(name);
    if (fd >= 0)
        close(fd);
out:
    free(keys);
    free(names);
    free(sts);
    if (rc)
        st_node_shm_close(out);
    return rc;
}
