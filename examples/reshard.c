/* Save a 6x4 f32 matrix as two row halves (rank 0 and 1), load it as one column half and
 * an FSDP-style flat piece of the other. Build against an installed strata:
 *   cc reshard.c $(pkg-config --cflags --libs strata)
 * or the build tree: cc reshard.c -Iinclude build/libstrata.a -lxxhash -lz -lpthread -ldl -lcurl
 * -lisal (-lcurl in a build with libcurl, -lisal in one with ISA-L: the default where each is
 * installed) */
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include "strata.h"

int main(int argc, char **argv) {
    char dir[] = "ckpts/c-XXXXXX"; /* without an argument, a new directory each run: */
    if (argc < 2) mkdir("ckpts", 0755); /* a committed checkpoint is never replaced */
    const char *uri = argc > 1 ? argv[1] : mkdtemp(dir);
    if (!uri) return perror("mkdtemp ckpts/c-XXXXXX"), 1;
    float m[24], left[12], right[7];
    for (int i = 0; i < 24; i++) m[i] = (float)i;
    uint64_t shape[2] = {6, 4}, top[2] = {0, 0}, bot[2] = {3, 0}, half[2] = {3, 4};
    strata_state *save[2], *load;
    strata_state_new(&save[0]), strata_state_new(&save[1]), strata_state_new(&load);
    strata_state_add_shard(save[0], &(strata_shard){"w", STRATA_F32, 2, shape, top, half, .data = m});
    strata_state_add_shard(save[1], &(strata_shard){"w", STRATA_F32, 2, shape, bot, half, .data = m + 12});
    int rc = strata_save(NULL, NULL, &uri, 1, save, 2, NULL); /* no saver: ranks in this process */

    uint64_t c0[2] = {0, 0}, c2[2] = {0, 2}, cols[2] = {6, 2}; /* columns 0-1, and 2-3 */
    strata_state_add_shard(load, &(strata_shard){"w", STRATA_F32, 2, shape, c0, cols, .data = left});
    strata_state_add_shard(load, &(strata_shard){"w", STRATA_F32, 2, shape, c2, cols, .flat = 1,
                                                 .flat_start = 3, .flat_end = 10, .data = right});
    if (!rc) rc = strata_load(NULL, NULL, &uri, 1, &load, 1, NULL); /* no communicator */
    if (rc) return fprintf(stderr, "%s: %s\n", strata_error_name(rc), strata_error_last()), 1;
    int bad = 0; /* left: m[r][c] for c < 2; right: elements 3..9 of the 6x2 box of columns 2-3 */
    for (int e = 0; e < 12; e++) bad += left[e] != m[e / 2 * 4 + e % 2];
    for (int e = 3; e < 10; e++) bad += right[e - 3] != m[e / 2 * 4 + 2 + e % 2];
    printf("%s: left[5]=%g (m[2][1]=9) right[0]=%g (m[1][3]=7) wrong=%d\n", uri, left[5], right[0],
           bad);
    strata_state_free(save[0]), strata_state_free(save[1]), strata_state_free(load);
    return bad != 0;
}
