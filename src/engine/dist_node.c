/* dist_node.c - the ranks of a communicator grouped by node (a distributed load reads on each
 * node what its ranks need, and moves bytes through the communicator only between nodes:
 * dist_load.c), and the removal of the shared memory segments that loads of earlier strata
 * versions made in /dev/shm and could leave there when killed. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/checksum.h"
#include "../core/error.h"
#include "dist.h"

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

/* This process's node: its host name and boot id (two containers of one host with one name
 * share a page cache only if they share the boot id too; if not, they are two nodes). */
static uint64_t node_key(void)
{
    char id[512] = {0};
    gethostname(id, 255);
    boot_id(id + 256);
    return st_hash(id, sizeof id);
}

int st_nodes(strata_comm *comm, int *node)
{
    const int P = comm->size, me = comm->rank;
    uint64_t *keys = malloc((size_t)P * sizeof *keys);
    if (!keys)
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    /* STRATA_LOAD_NODES=k (tests) makes k groups of consecutive ranks */
    const char *fake = getenv("STRATA_LOAD_NODES");
    uint64_t mine = fake && atoi(fake) > 0 ? (uint64_t)me * (uint64_t)atoi(fake) / (uint64_t)P
                                           : node_key();
    int rc = st_allgather(comm, &mine, sizeof mine, keys);
    for (int r = 0; !rc && r < P; r++) { /* a node is named by its lowest rank */
        int q = 0;
        while (keys[q] != keys[r])
            q++;
        node[r] = q;
    }
    free(keys);
    return rc;
}

int st_node_map_open(strata_comm *comm, st_node_map *out)
{
    const int P = comm->size;
    out->node = malloc(((size_t)P + 1) * sizeof *out->node);
    out->lidx = malloc(((size_t)P + 1) * sizeof *out->lidx);
    if (!out->node || !out->lidx) {
        st_node_map_close(out);
        return st_fail(STRATA_ENOMEM, "out of memory"); /* the others time out */
    }
    int rc = st_nodes(comm, out->node);
    for (int r = 0; !rc && r < P; r++) {
        out->lidx[r] = 0;
        for (int q = 0; q < r; q++)
            out->lidx[r] += out->node[q] == out->node[r];
    }
    if (rc)
        st_node_map_close(out);
    return rc;
}

void st_node_map_close(st_node_map *m)
{
    free(m->node);
    free(m->lidx);
    m->node = m->lidx = NULL;
}

/* Those segments were named "strata-load-<uid>-<boot, 8 characters>-<pid
 * namespace>-<pid>-<random>": those of this user, boot and pid namespace whose creator is
 * gone are removed; a live process's, another user's (by name or owner), another boot's or
 * another namespace's never. */
int strata_reclaim_load_segments(int *removed)
{
    st_clear_error();
    char id[40], ns[64] = {0}, prefix[128];
    boot_id(id);
    id[8] = 0;
    ssize_t nl = readlink("/proc/self/ns/pid", ns, sizeof ns - 1); /* "pid:[4026531836]" */
    unsigned long long nsid = nl > 5 ? strtoull(ns + 5, NULL, 10) : 0;
    snprintf(prefix, sizeof prefix, "strata-load-%u-%s-%llu-", (unsigned)geteuid(),
             id[0] ? id : "x", nsid);
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
