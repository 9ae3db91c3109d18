/* I/O micro-benchmarks for the scripts in bench/ (built by them with cc).
 *
 *   iobench writemany FILE BLOCK LEN      for every BLOCK of FILE: open, seek, write LEN bytes, close
 *   iobench randread FILE BLOCK PERCENT    read PERCENT% of the blocks, random order, one pread each
 *   iobench seqread FILE                   read the whole file in 1 MiB reads
 *   iobench stride FILE BLOCK LEN          one open; write LEN bytes at the start of every BLOCK
 *   iobench metamix DIR N                  create+write, stat, rename, mkdir, readdir, unlink, rmdir
 *   iobench nullrt FILE N                  N getxattr calls of a name FILE does not have (a request
 *                                          the daemon answers at once: the FUSE round trip)
 *   iobench openclose FILE N RDONLY|WRONLY  N open + close pairs
 *   iobench fxmark drbl|dwol DIR NPROC SECS  FxMark-style: NPROC processes each read (DRBL) or
 *                                          overwrite (DWOL) one 4 KiB block of its own file
 *                                          DIR/fx-<i>; prints ops/s
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
#include <dirent.h>
#include <sys/wait.h>
#include <sys/mman.h>
#include <sys/xattr.h>

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
    if (strcmp(mode, "fxmark") && stat(path, &st) < 0) die("stat");
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
    } else if (!strcmp(mode, "pwrites") && argc == 5) {
        /* pwrites PATH LEN N: LEN bytes at every 8th 4 KiB block, N times, one O_WRONLY open */
        long len = atol(argv[3]), n = atol(argv[4]);
        char *buf = malloc(len);
        memset(buf, 'p', len);
        int fd = open(path, O_WRONLY);
        if (fd < 0) die("open");
        double start = now();
        for (long i = 0; i < n; i++)
            if (pwrite(fd, buf, len, (i * 8 * 4096) % (st.st_size - len)) != len) die("pwrite");
        double total = now() - start;
        close(fd);
        printf("total_s=%.3f avg_us=%.2f ops=%ld\n", total, total / n * 1e6, n);
    } else if (!strcmp(mode, "stride") && argc == 5) {
        long block = atol(argv[3]), len = atol(argv[4]);
        char *buf = malloc(len);
        memset(buf, 's', len);
        int fd = open(path, O_WRONLY);
        if (fd < 0) die("open");
        long n = st.st_size / block;
        double start = now();
        for (long i = 0; i < n; i++)
            if (pwrite(fd, buf, len, i * block) != len) die("pwrite");
        if (fsync(fd) < 0) die("fsync");
        double total = now() - start;
        close(fd);
        printf("total_s=%.3f avg_us=%.2f ops=%ld\n", total, total / n * 1e6, n);
    } else if (!strcmp(mode, "metamix") && argc == 4) {
        long n = atol(argv[3]);
        char a[4096], b[4096];
        double start = now();
        long ops = 0;
        for (long i = 0; i < n; i++) {
            snprintf(a, sizeof a, "%s/f%ld", path, i);
            snprintf(b, sizeof b, "%s/g%ld", path, i);
            int fd = open(a, O_CREAT | O_WRONLY | O_EXCL, 0644);
            if (fd < 0) die("create");
            if (write(fd, "0123456789", 10) != 10) die("write");
            close(fd);
            struct stat s2;
            if (stat(a, &s2) < 0) die("stat");
            if (rename(a, b) < 0) die("rename");
            snprintf(a, sizeof a, "%s/d%ld", path, i);
            if (mkdir(a, 0755) < 0) die("mkdir");
            ops += 5;
            if (i % 50 == 49) {
                DIR *d = opendir(path);
                if (!d) die("opendir");
                while (readdir(d)) ops++;
                closedir(d);
            }
        }
        for (long i = 0; i < n; i++) {
            snprintf(b, sizeof b, "%s/g%ld", path, i);
            snprintf(a, sizeof a, "%s/d%ld", path, i);
            if (unlink(b) < 0) die("unlink");
            if (rmdir(a) < 0) die("rmdir");
            ops += 2;
        }
        double total = now() - start;
        printf("total_s=%.3f ops=%ld ops_s=%.0f\n", total, ops, ops / total);
    } else if (!strcmp(mode, "nullrt") && argc == 4) {
        long n = atol(argv[3]);
        char buf[64];
        double start = now();
        for (long i = 0; i < n; i++)
            if (getxattr(path, "user.mosaicfs-bench-none", buf, sizeof buf) >= 0) die("getxattr found it");
        double total = now() - start;
        printf("total_s=%.3f avg_us=%.2f ops=%ld\n", total, total / n * 1e6, n);
    } else if (!strcmp(mode, "openclose") && argc == 5) {
        long n = atol(argv[3]);
        int flags = !strcmp(argv[4], "WRONLY") ? O_WRONLY : O_RDONLY;
        double start = now();
        for (long i = 0; i < n; i++) {
            int fd = open(path, flags);
            if (fd < 0) die("open");
            if (close(fd) < 0) die("close");
        }
        double total = now() - start;
        printf("total_s=%.3f avg_us=%.2f ops=%ld\n", total, total / n * 1e6, n);
    } else if (!strcmp(mode, "fxmark") && argc == 6) {
        const char *kind = argv[2], *dir = argv[3];
        int nproc = atoi(argv[4]);
        double secs = atof(argv[5]);
        long *counts = mmap(NULL, sizeof(long) * nproc, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        for (int p = 0; p < nproc; p++) {
            if (fork() == 0) {
                char f[4096], buf[4096];
                memset(buf, 'x', sizeof buf);
                snprintf(f, sizeof f, "%s/fx-%d", dir, p);
                int write_mode = !strcmp(kind, "dwol");
                int fd = open(f, write_mode ? O_RDWR : O_RDONLY);
                if (fd < 0) die("open");
                long c = 0;
                double end = now() + secs;
                while (now() < end) {
                    for (int k = 0; k < 64; k++) {
                        ssize_t r = write_mode ? pwrite(fd, buf, 4096, 0) : pread(fd, buf, 4096, 0);
                        if (r != 4096) die("io");
                    }
                    c += 64;
                }
                counts[p] = c;
                _exit(0);
            }
        }
        for (int p = 0; p < nproc; p++) wait(NULL);
        long total = 0;
        for (int p = 0; p < nproc; p++) total += counts[p];
        printf("ops=%ld ops_s=%.0f\n", total, total / secs);
    } else {
        fprintf(stderr, "usage: see iobench.c\n");
        return 2;
    }
    return 0;
}
