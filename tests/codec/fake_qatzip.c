/* A stand-in for libqatzip with the same C ABI, for testing kvshrink.codec.qat's ctypes binding on
 * machines without QAT (where the real library cannot be installed). Like QATzip on a host without
 * the hardware, qzInit reports QZ_NO_HW and compression runs in software; like QATzip, the output is
 * one gzip member per 64 KiB of input. Built by tests/codec/test_codec_qat.py with gcc and -lz. */
#include <string.h>
#include <zlib.h>

#define QZ_OK 0
#define QZ_PARAMS (-1)
#define QZ_FAIL (-2)
#define QZ_BUF_ERROR (-3)
#define QZ_NO_HW 11
#define MEMBER (64 * 1024)

typedef struct { long hw_session_stat; int thd_sess_stat; void *internal; unsigned long total_in, total_out; } QzSession_T;

int qzInit(QzSession_T *sess, unsigned char sw_backup) {
    if (!sess || !sw_backup) return QZ_PARAMS;
    sess->hw_session_stat = QZ_NO_HW;
    return QZ_NO_HW;
}

int qzCompress(QzSession_T *sess, const unsigned char *src, unsigned int *src_len, unsigned char *dest,
               unsigned int *dest_len, unsigned int last) {
    unsigned int done = 0, written = 0;
    if (!sess || !src_len || !dest_len || !last) return QZ_PARAMS;
    while (done < *src_len) {
        unsigned int n = *src_len - done < MEMBER ? *src_len - done : MEMBER;
        z_stream zs;
        memset(&zs, 0, sizeof zs);
        if (deflateInit2(&zs, 1, Z_DEFLATED, 31, 8, Z_DEFAULT_STRATEGY) != Z_OK) return QZ_FAIL;
        zs.next_in = (unsigned char *)src + done;
        zs.avail_in = n;
        zs.next_out = dest + written;
        zs.avail_out = *dest_len - written;
        int rc = deflate(&zs, Z_FINISH);
        written += (unsigned int)zs.total_out;
        deflateEnd(&zs);
        if (rc != Z_STREAM_END) return QZ_BUF_ERROR;
        done += n;
    }
    sess->total_in += done;
    sess->total_out += written;
    *dest_len = written;
    return QZ_OK;
}

int qzTeardownSession(QzSession_T *sess) { return sess ? QZ_OK : QZ_PARAMS; }
int qzClose(QzSession_T *sess) { return sess ? QZ_OK : QZ_PARAMS; }
