/* crc32.h - the CRC-32 of zip entries (zlib's polynomial, reflected; what zlib's crc32 and
 * a zip's central directory give): ISA-L's crc32_gzip_refl where the build found ISA-L
 * (ST_HAVE_ISAL: 11-12 GB/s on this machine, zlib's 2.6-7), zlib's crc32 otherwise; the
 * same values either way. Runs of bytes are combined with zlib's crc32_combine. */
#ifndef STRATA_CRC32_H
#define STRATA_CRC32_H
#include <stddef.h>
#include <stdint.h>
#include <zlib.h>
#ifdef ST_HAVE_ISAL
#include <isa-l/crc.h>
#endif

/* The CRC-32 of crc's bytes followed by p[0, n) (crc 0: of p alone). */
static inline uint32_t st_crc32(uint32_t crc, const void *p, uint64_t n)
{
#ifdef ST_HAVE_ISAL
    return crc32_gzip_refl(crc, (const unsigned char *)p, n);
#else
    const Bytef *b = p;
    uLong c = crc;
    while (n) { /* zlib takes a uInt length */
        uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, b, k);
        b += k;
        n -= k;
    }
    return (uint32_t)c;
#endif
}

/* The CRC-32 of a's bytes followed by b's (blen bytes), from their CRC-32s. */
static inline uint32_t st_crc32_join(uint32_t a, uint32_t b, uint64_t blen)
{
    return (uint32_t)crc32_combine(a, b, (z_off_t)blen);
}

#endif
