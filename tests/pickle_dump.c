/* pickle_dump.c - prints a canonical JSON description of a pickle read by the restricted
 * reader (src/source/pickle.c), for tests/python/test_pickle_reader.py. Usage:
 *   pickle_dump FILE        FILE is a torch.save zip: its DIR/data.pkl is parsed, every
 *                           storage a tensor names is read whole (CRC-32 checked)
 *   pickle_dump --raw FILE  FILE is a bare pickle (a DCP .metadata)
 * Values: null, true/false, ints (bigger than int64: {"bigint_le": hex}), floats (%.17g),
 * strings, {"bytes": hex}, {"tuple": [...]}, [...] for lists, {"dict": [[k, v]...],
 * "ordered": b, "state": s}, {"global": "mod.name"}, {"call": "mod.name", "newobj": b,
 * "args": a, "state": s}, {"pid": p}; a torch._utils._rebuild_tensor_v2 (or _v3) call whose storage is
 * read also gets "storage_crc" (zlib CRC-32 of the storage's bytes as read) and
 * "storage_bytes". Exit 0 and the JSON on stdout, or 1 and "ERROR <code name>: <message>". */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "source/pickle.h"
#include "source/zip.h"
#include "strata.h"

static int rd_fd(void *ctx, void *buf, size_t len, uint64_t off)
{
    int fd = *(int *)ctx;
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, (char *)buf + got, len - got, (off_t)(off + got));
        if (r <= 0)
            return STRATA_EIO;
        got += (size_t)r;
    }
    return 0;
}

static st_zip zip;
static int zfd = -1, have_zip;
static char prefix[4200];

static void put_str(const unsigned char *s, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned c = s[i];
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar((int)c);
    }
    putchar('"');
}

static void put_hex(const unsigned char *s, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++)
        printf("%02x", s[i]);
    putchar('"');
}

static void dump(const pk_val *v);

/* the storage of a _rebuild_tensor_v2 call: read whole from the zip */
static void storage_crc(const pk_val *v)
{
    if (!have_zip || v->args->n < 1 || v->args->items[0]->kind != PK_PID)
        return;
    const pk_val *pid = v->args->items[0]->args;
    if (pid->kind != PK_TUPLE || pid->n < 3 || pid->items[2]->kind != PK_STR)
        return;
    char name[4400];
    snprintf(name, sizeof name, "%sdata/%s", prefix, (const char *)pid->items[2]->s);
    const st_zip_entry *e = st_zip_find(&zip, name);
    if (!e) {
        printf(", \"storage_error\": \"no entry %s\"", name);
        return;
    }
    unsigned char *b = malloc(e->usize ? e->usize : 1);
    int rc = st_zip_read(&zip, e, b, rd_fd, &zfd, "dump");
    if (rc)
        printf(", \"storage_error\": \"%s\"", strata_error_name(rc));
    else
        printf(", \"storage_crc\": %lu, \"storage_bytes\": %llu",
               crc32(crc32(0L, Z_NULL, 0), b, (uInt)e->usize), (unsigned long long)e->usize);
    free(b);
}

static void dump(const pk_val *v)
{
    switch (v->kind) {
    case PK_NONE: printf("null"); break;
    case PK_BOOL: printf(v->i ? "true" : "false"); break;
    case PK_INT: printf("%lld", (long long)v->i); break;
    case PK_BIGINT: printf("{\"bigint_le\": "); put_hex(v->s, v->len); putchar('}'); break;
    case PK_FLOAT: printf("%.17g", v->f); break;
    case PK_STR: put_str(v->s, v->len); break;
    case PK_BYTES: printf("{\"bytes\": "); put_hex(v->s, v->len); putchar('}'); break;
    case PK_TUPLE: case PK_LIST:
        printf(v->kind == PK_TUPLE ? "{\"tuple\": [" : "[");
        for (size_t i = 0; i < v->n; i++) {
            if (i)
                printf(", ");
            dump(v->items[i]);
        }
        printf(v->kind == PK_TUPLE ? "]}" : "]");
        break;
    case PK_DICT:
        printf("{\"dict\": [");
        for (size_t i = 0; i < v->n; i++) {
            printf(i ? ", [" : "[");
            dump(v->items[2 * i]);
            printf(", ");
            dump(v->items[2 * i + 1]);
            printf("]");
        }
        printf("], \"ordered\": %s, \"state\": ", v->ordered ? "true" : "false");
        if (v->state)
            dump(v->state);
        else
            printf("null");
        putchar('}');
        break;
    case PK_GLOBAL:
        printf("{\"global\": \"%s.%s\"}", pk_global_module(v->g), pk_global_name(v->g));
        break;
    case PK_CALL:
        printf("{\"call\": \"%s.%s\", \"newobj\": %s, \"args\": ", pk_global_module(v->g),
               pk_global_name(v->g), v->newobj ? "true" : "false");
        dump(v->args);
        printf(", \"state\": ");
        if (v->state)
            dump(v->state);
        else
            printf("null");
        if (v->g == PK_G_REBUILD_TENSOR_V2 || v->g == PK_G_REBUILD_TENSOR_V3)
            storage_crc(v);
        putchar('}');
        break;
    case PK_PID: printf("{\"pid\": "); dump(v->args); putchar('}'); break;
    }
}

static int fail(int rc)
{
    printf("ERROR %s: %s\n", strata_error_name(rc), strata_error_last());
    return 1;
}

int main(int argc, char **argv)
{
    int raw = argc == 3 && strcmp(argv[1], "--raw") == 0;
    if (argc != 2 + raw) {
        fprintf(stderr, "usage: pickle_dump [--raw] FILE\n");
        return 2;
    }
    const char *path = argv[1 + raw];
    zfd = open(path, O_RDONLY);
    struct stat st;
    if (zfd < 0 || fstat(zfd, &st) != 0) {
        perror(path);
        return 2;
    }
    unsigned char *pk = NULL;
    size_t n = (size_t)st.st_size;
    char ctx[4400];
    int rc;
    if (raw) {
        pk = malloc(n ? n : 1);
        if ((rc = rd_fd(&zfd, pk, n, 0)) != 0)
            return fail(rc);
        snprintf(ctx, sizeof ctx, "%s", path);
    } else {
        if ((rc = st_zip_open(&zip, (uint64_t)st.st_size, rd_fd, &zfd, path)) != 0)
            return fail(rc);
        have_zip = 1;
        const st_zip_entry *e = NULL;
        for (size_t i = 0; i < zip.n && !e; i++) {
            const char *s = strrchr(zip.e[i].name, '/');
            if (s && strcmp(s, "/data.pkl") == 0 && strchr(zip.e[i].name, '/') == s)
                e = &zip.e[i];
        }
        if (!e) {
            printf("ERROR: no */data.pkl in %s\n", path);
            return 1;
        }
        snprintf(prefix, sizeof prefix, "%.*s/", (int)(strchr(e->name, '/') - e->name),
                 e->name);
        pk = malloc(e->usize ? e->usize : 1);
        n = e->usize;
        if ((rc = st_zip_read(&zip, e, pk, rd_fd, &zfd, path)) != 0)
            return fail(rc);
        snprintf(ctx, sizeof ctx, "%s: %s", path, e->name);
    }
    pk_doc doc;
    rc = pk_parse(&doc, pk, n, ctx);
    free(pk);
    if (rc)
        return fail(rc);
    dump(doc.root);
    putchar('\n');
    pk_free(&doc);
    st_zip_free(&zip);
    close(zfd);
    return 0;
}
