/* I/O micro-benchmarks for bench/*.sh (BAOverlay Table 1 and 2). Built by the scripts with cc.
 *
 *   iobench writemany FILE BLOCK LEN      for every BLOCK of FILE: open, seek, write LEN bytes, close
 *   iobench randread FILE BLOCK PERCENT    read PERCENT% of the blocks, random order, one pread each
 *   iobench seqread FILE                   read the whole file in 1 MiB reads
 *
 * Prints one line: total_s=... first_us=... avg_us=... ops=... (seqread also MiB/s).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what) { perror(what); exit(1); }

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: see iobench.c\n"); return 2; }
    const char *mode = argv[1], *path = argv[2];
    struct stat st;
    if (stat(path, &st) < 0) die("stat");
    if (!strcmp(mode, "writemany") && argc == 5) {
        long block = atol(argv[3]), len = atol(argv[4]);
        char *buf = malloc(len);
        memset(buf, 'w', len);
        long n = st.st_size / block;
        double start = now(), first = 0;
        for (long i = 0; i < n; i++) {
            double t = now();
            int fd = open(path, O_WRONLY);
            if (fd < 0) die("open");
            if (lseek(fd, i * block, SEEK_SET) < 0) die("lseek");
            if (write(fd, buf, len) != len) die("write");
            if (close(fd) < 0) die("close");
            if (i == 0) first = now() - t;
        }
        double total = now() - start;
        printf("total_s=%.3f first_us=%.1f avg_us=%.2f ops=%ld\n", total, first * 1e6, total / n * 1e6, n);
    } else if (!strcmp(mode, "randread") && argc == 5) {
        long block = atol(argv[3]), pct = atol(argv[4]);
        long n = st.st_size / block, k = n * pct / 100;
        long *order = malloc(n * sizeof(long));
        for (long i = 0; i < n; i++) order[i] = i;
        srand(42);
        for (long i = n - 1; i > 0; i--) { long j = rand() % (i + 1); long t = order[i]; order[i] = order[j]; order[j] = t; }
        char *buf = malloc(block);
        int fd = open(path, O_RDONLY);
        if (fd < 0) die("open");
        double start = now(), first = 0;
        for (long i = 0; i < k; i++) {
            double t = now();
            if (pread(fd, buf, block, order[i] * block) != block) die("pread");
            if (i == 0) first = now() - t;
        }
        double total = now() - start;
        close(fd);
        printf("total_s=%.3f first_us=%.1f avg_us=%.2f ops=%ld\n", total, first * 1e6, total / k * 1e6, k);
    } else if (!strcmp(mode, "seqread")) {
        size_t chunk = 1 << 20;
        char *buf = malloc(chunk);
        int fd = open(path, O_RDONLY);
        if (fd < 0) die("open");
        double start = now();
        long long total = 0;
        ssize_t r;
        while ((r = read(fd, buf, chunk)) > 0) total += r;
        if (r < 0) die("read");
        double secs = now() - start;
        close(fd);
        printf("total_s=%.3f mib_s=%.1f bytes=%lld\n", secs, total / secs / (1 << 20), total);
    } else {
        fprintf(stderr, "usage: see iobench.c\n");
        return 2;
    }
    return 0;
}
