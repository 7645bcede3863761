/* fuzz_layout.c - libFuzzer target for the CLI's layout parser (layout_parse in
 * src/cli/synth.c, compiled into the target). The input, NUL-terminated, is parsed with an
 * error buffer of exact size (heap, so ASan sees overruns; its size comes from the input).
 * An accepted layout must be in range (tp, pp, dp >= 1, world <= 4096, zero 0 or 1) and
 * survive layout_format + layout_parse unchanged; a refused one must leave a message.
 * Also replayed by tests/test_fuzz_replay.c. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/synth.h"

#define FL_FAIL(...)                                                                         \
    do {                                                                                     \
        fprintf(stderr, "fuzz_layout: " __VA_ARGS__);                                       \
        fprintf(stderr, "\n");                                                               \
        abort();                                                                             \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (!s)
        return 0;
    memcpy(s, data, size);
    s[size] = 0;
    size_t errlen = size ? 1 + data[0] % 200 : 1; /* a small error buffer, sometimes */
    char *err = malloc(errlen);
    if (!err) {
        free(s);
        return 0;
    }
    err[0] = 0;
    layout l;
    memset(&l, 0x5A, sizeof l);
    if (layout_parse(&l, s, err, errlen) != 0) {
        if (errlen > 1 && err[0] == 0)
            FL_FAIL("'%s' refused without a message", s);
        if (strnlen(err, errlen) >= errlen)
            FL_FAIL("error message is not terminated");
    } else {
        int w = layout_world(&l);
        if (l.tp < 1 || l.pp < 1 || l.dp < 1 || (l.zero != 0 && l.zero != 1) || w < 1 || w > 4096)
            FL_FAIL("'%s' accepted as tp=%d pp=%d dp=%d zero=%d", s, l.tp, l.pp, l.dp, l.zero);
        char buf[96], buf2[96], e2[256];
        layout_format(&l, buf, sizeof buf);
        layout l2;
        if (layout_parse(&l2, buf, e2, sizeof e2) != 0)
            FL_FAIL("'%s' (from '%s') does not parse: %s", buf, s, e2);
        if (l2.tp != l.tp || l2.pp != l.pp || l2.dp != l.dp || l2.zero != l.zero)
            FL_FAIL("'%s' (from '%s') parses to another layout", buf, s);
        layout_format(&l2, buf2, sizeof buf2);
        if (strcmp(buf, buf2) != 0)
            FL_FAIL("format is not stable: '%s' vs '%s'", buf, buf2);
    }
    free(err);
    free(s);
    return 0;
}
