# mosaicfs — build, install, demo and test. See README.md.
PREFIX ?= /usr/local
SBINDIR ?= /usr/sbin
MANDIR ?= $(PREFIX)/share/man
CARGO ?= cargo

.PHONY: build daemon install uninstall deb static demo deps check test bench clean

# The snapshotter's gRPC code is generated at build time by protoc (Debian: protobuf-compiler).
build:
	@command -v protoc >/dev/null || { echo "installing protobuf-compiler (protoc) for mosaicfs-snapshotter"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq protobuf-compiler >/dev/null; }
	$(CARGO) build --release

# The daemon as installed, and as the test scripts run it: linked statically (glibc's
# static-pie). Every mount execs it, and loading its three libraries was a third of a mount's
# time (docs/PERFORMANCE.md, "Mounting"); static, it also maps less. `cargo build --release`
# still makes the dynamically linked one, in target/release.
HOST := $(shell rustc -vV | sed -n 's/^host: //p')
STATIC_RUSTFLAGS := -C target-feature=+crt-static
DAEMON := target/$(HOST)/release/mosaicfs
daemon:
	RUSTFLAGS="$(STATIC_RUSTFLAGS)" $(CARGO) build --release --target $(HOST) -p mosaicfs --bin mosaicfs

# The binaries (stripped: those in target/ keep their symbols for perf), the helpers mount(8) runs
# for `mount -t fuse.mosaicfs` and `mount -t fuse3.mosaicfs` (the type containerd's snapshots
# have; mount(8) looks in /sbin, which is /usr/sbin here, whatever PREFIX is), and the man page.
install: build daemon
	install -D -s -m 0755 $(DAEMON) $(DESTDIR)$(PREFIX)/bin/mosaicfs
	install -D -s -m 0755 target/release/mosaicfs-snapshotter $(DESTDIR)$(PREFIX)/bin/mosaicfs-snapshotter
	install -d $(DESTDIR)$(SBINDIR)
	ln -sf $(PREFIX)/bin/mosaicfs $(DESTDIR)$(SBINDIR)/mount.fuse.mosaicfs
	ln -sf $(PREFIX)/bin/mosaicfs $(DESTDIR)$(SBINDIR)/mount.fuse3.mosaicfs
	install -D -m 0644 docs/mosaicfs.1 $(DESTDIR)$(MANDIR)/man1/mosaicfs.1

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/mosaicfs $(DESTDIR)$(PREFIX)/bin/mosaicfs-snapshotter \
		$(DESTDIR)$(SBINDIR)/mount.fuse.mosaicfs $(DESTDIR)$(SBINDIR)/mount.fuse3.mosaicfs \
		$(DESTDIR)$(MANDIR)/man1/mosaicfs.1

# The Debian package (target/debian/mosaicfs_VERSION_ARCH.deb): binaries, mount helpers, man
# page, docs and examples (fstab, systemd units). packaging/deb.sh.
deb: build
	packaging/deb.sh

# Both binaries linked statically (glibc's static-pie: no library needed at run time, any
# distribution's kernel), stripped, in target/static/.
static: daemon
	@command -v protoc >/dev/null || $(MAKE) --no-print-directory build
	RUSTFLAGS="$(STATIC_RUSTFLAGS)" $(CARGO) build --release --target $(HOST) -p mosaicfs-snapshotter
	install -D -s -m 0755 $(DAEMON) target/static/mosaicfs
	install -D -s -m 0755 target/$(HOST)/release/mosaicfs-snapshotter target/static/mosaicfs-snapshotter

demo: build
	./demo.sh

# The everyday check (root and /dev/fuse; about 3 minutes on 2 CPUs, the build included):
# unit tests, the overlay core without a mount (tests/core.rs), the fsx model (on a disk upper;
# not the XFS reflink run, which needs a loop device in /var/tmp) and the main mount tests.
# Installs nothing, and writes only in target/ and /tmp.
CHECK_TESTS := --lib --test core --test fsx --test overlay --test partial --test complete --test caw
check:
	$(CARGO) test --profile checked -p mosaicfs $(CHECK_TESTS) -- --test-threads=2 --skip reflink

# The full test suite (needs root and /dev/fuse): unit and integration tests on real mounts,
# pjdfstest against a mount, and Podman running containers on mosaicfs.
# What the tests need from Debian's packages, installed when missing (tests/deps.sh).
deps:
	tests/deps.sh

# The cargo passes of mosaicfs build the `checked` profile (Cargo.toml): release code with its
# debug assertions on its invariants; the snapshotter's tests (no mosaicfs code, no mounts of
# its own) run once, as built by install; the scripts run the installed release binary.
test: deps install
	# The request files call only the ones their top comments allow (docs/ARCHITECTURE.md).
	dev/callgraph.py --check
	# The daemon's hot functions were linked together (src/hot.ld; docs/PERFORMANCE.md).
	dev/hotcode.py --check
	$(CARGO) test --profile checked -p mosaicfs -- --test-threads=2
	$(CARGO) test --release -p mosaicfs-snapshotter
	tests/pjdfstest/run.sh $(DAEMON)
	MOSAICFS_OPTS=xattr_permissions=2 tests/pjdfstest/run.sh $(DAEMON)
	# Under the kernel's writeback cache (writeback=auto: where nothing passes through).
	MOSAICFS_OPTS=passthrough=off,writeback=auto tests/pjdfstest/run.sh $(DAEMON)
	# The same random operations on kernel overlayfs and on mosaicfs, results and trees compared.
	tests/differential.py $(DAEMON) 1,2,3,4,5,6 2000
	tests/differential.py $(DAEMON) 1,2,3,4,5,6 2000 ,upper=memory
	tests/differential.py $(DAEMON) 1,2,3 2000 ,passthrough=off,writeback=auto
	tests/podman/run.sh $(DAEMON)
	tests/podman/rootless.sh $(DAEMON)
	# Podman over lazily pulled layers: a registry and a layer store started by the test (#59).
	tests/lazy/run.sh $(DAEMON)
	# containers/storage's own tests with mosaicfs as its overlay driver's mount program.
	tests/storage/run.sh $(DAEMON)
	# fuse-overlayfs' own test scripts, with `fuse-overlayfs` running mosaicfs.
	tests/fuse-overlayfs/run.sh $(DAEMON)
	# containerd (its snapshotter test suite, then ctr run) on mosaicfs-snapshotter, and Docker's
	# fuse-overlayfs driver running mosaicfs (issue #39).
	tests/containerd/run.sh target/release
	tests/docker/run.sh $(DAEMON)
	# The Debian package installed, used and purged; the static binaries (issue #38).
	tests/package/run.sh
	# xfstests' generic tests that take under 10 s here (issue #40; tests/xfstests/expected).
	tests/xfstests/run.sh --quick
	# The file handle tests again with the layers on ext4, which gives freed inode numbers out
	# at once (issue #58).
	XFSTESTS_FS=ext4 tests/xfstests/run.sh generic/426 generic/467 generic/477 generic/756 generic/777
	MOSAICFS_OPTS=passthrough=off,writeback=auto tests/xfstests/run.sh --quick
	# unionmount-testsuite, as kernel overlayfs and fuse-overlayfs run it (tests/unionmount).
	tests/unionmount/run.sh
	# Once more with the upper layer held by the daemon (upper=memory, issue #13): the same
	# tests, those that look into a disk upper dir skipped (tests/common: disk_upper).
	MOSAICFS_TEST_UPPER=memory $(CARGO) test --profile checked -p mosaicfs -- --test-threads=2
	MOSAICFS_OPTS=upper=memory tests/pjdfstest/run.sh $(DAEMON)
	MOSAICFS_OPTS=upper=memory tests/podman/run.sh $(DAEMON)
	# Once more over FUSE's io_uring transport (issue #15; docs/URING.md).
	tests/with-uring.sh $(CARGO) test --profile checked -p mosaicfs -- --test-threads=2
	tests/with-uring.sh env MOSAICFS_OPTS=uring=on tests/pjdfstest/run.sh $(DAEMON)
	tests/with-uring.sh tests/podman/run.sh $(DAEMON)
	tests/with-uring.sh tests/unionmount/run.sh --ov "--ov=3 --verify"

bench: build
	bench/run.sh

clean:
	$(CARGO) clean
