//! A tar stream writer for OCI image layers: POSIX ustar headers, PAX extended headers for
//! what ustar cannot hold (long names and link targets, sizes past 8 GiB, large ids, xattrs
//! as `SCHILY.xattr.NAME`), and sparse files in the PAX form GNU tar calls format 1.0, which
//! Go's archive/tar (containers/storage), GNU tar and Python's tarfile all read.
//!
//! The writer streams: a header, then the entry's data in pieces, never the whole file in
//! memory. It counts what the header promised and refuses more or fewer bytes.

use std::io::{self, Write};

const BLOCK: usize = 512;

/// What an entry is, with what its header needs for that type.
pub enum Kind<'a> {
    /// A regular file of `size` bytes. `sparse`: its data regions (offset, length), when it
    /// is written as a sparse entry; only those bytes follow the header.
    File {
        size: u64,
        sparse: Option<&'a [(u64, u64)]>,
    },
    Dir,
    Symlink(&'a [u8]),
    /// A hard link to an earlier entry (its name).
    Link(&'a [u8]),
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

/// One entry's header fields.
pub struct Entry<'a> {
    /// The name in the archive: relative, `/`-separated, directories ending in `/`.
    pub path: &'a [u8],
    pub kind: Kind<'a>,
    /// Permission bits with set-id and sticky bits (07777).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
    pub xattrs: &'a [(Vec<u8>, Vec<u8>)],
}

pub struct TarWriter<W: Write> {
    out: W,
    /// Data bytes the current entry still owes.
    owed: u64,
    /// Bytes of the current entry's data written, for the padding after it.
    in_entry: u64,
    written: u64,
}

/// One PAX record: "LEN KEY=VALUE\n", where LEN counts the whole record, itself included.
fn pax_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    let rest = 1 + key.len() + 1 + value.len() + 1; // " " KEY "=" VALUE "\n"
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    out.extend_from_slice(len.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

/// Writes `v` as a zero-padded octal field of `field.len()` bytes ending in NUL, or `false`
/// if it does not fit.
fn octal(field: &mut [u8], v: u64) -> bool {
    let digits = field.len() - 1;
    let s = format!("{v:0digits$o}");
    if s.len() > digits {
        return false;
    }
    field[..digits].copy_from_slice(s.as_bytes());
    field[digits] = 0;
    true
}

/// The sparse map that starts a format 1.0 entry's data: the number of regions, then each
/// region's offset and length, one decimal number a line, padded to a block.
fn sparse_map(regions: &[(u64, u64)]) -> Vec<u8> {
    let mut m = format!("{}\n", regions.len());
    for (off, len) in regions {
        m += &format!("{off}\n{len}\n");
    }
    let mut m = m.into_bytes();
    m.resize(m.len().div_ceil(BLOCK) * BLOCK, 0);
    m
}

impl<W: Write> TarWriter<W> {
    pub fn new(out: W) -> Self {
        TarWriter {
            out,
            owed: 0,
            in_entry: 0,
            written: 0,
        }
    }

    /// Bytes written so far.
    #[cfg(test)]
    pub fn written(&self) -> u64 {
        self.written
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    /// Starts entry `e`. A regular file's data must follow through `data` (its size, or for
    /// a sparse entry the lengths of its regions, in order), then `end`.
    pub fn entry(&mut self, e: &Entry) -> io::Result<()> {
        if self.owed != 0 {
            return Err(io::Error::other(
                "tar: an entry started before the last one's data was written",
            ));
        }
        let mut pax = Vec::new();
        let mut name = e.path.to_vec();
        let mut stored = 0;
        let mut map = Vec::new();
        match &e.kind {
            Kind::File { size, sparse: None } => stored = *size,
            Kind::File {
                size,
                sparse: Some(regions),
            } => {
                pax_record(&mut pax, b"GNU.sparse.major", b"1");
                pax_record(&mut pax, b"GNU.sparse.minor", b"0");
                pax_record(&mut pax, b"GNU.sparse.name", e.path);
                pax_record(
                    &mut pax,
                    b"GNU.sparse.realsize",
                    size.to_string().as_bytes(),
                );
                // The name readers that do not know the format would extract it under.
                let (dir, base) = match e.path.iter().rposition(|&c| c == b'/') {
                    Some(i) => (&e.path[..=i], &e.path[i + 1..]),
                    None => (&b""[..], e.path),
                };
                name = [dir, b"GNUSparseFile.0/", base].concat();
                map = sparse_map(regions);
                stored = map.len() as u64 + regions.iter().map(|r| r.1).sum::<u64>();
            }
            _ => {}
        }
        let mut h = [0u8; BLOCK];
        if name.len() <= 100 {
            h[..name.len()].copy_from_slice(&name);
        } else {
            if !matches!(
                e.kind,
                Kind::File {
                    sparse: Some(_),
                    ..
                }
            ) {
                pax_record(&mut pax, b"path", &name);
            }
            h[..100].copy_from_slice(&name[..100]);
        }
        let (flag, link): (u8, &[u8]) = match &e.kind {
            Kind::File { .. } => (b'0', b""),
            Kind::Link(t) => (b'1', t),
            Kind::Symlink(t) => (b'2', t),
            Kind::Char(..) => (b'3', b""),
            Kind::Block(..) => (b'4', b""),
            Kind::Dir => (b'5', b""),
            Kind::Fifo => (b'6', b""),
        };
        if link.len() <= 100 {
            h[157..157 + link.len()].copy_from_slice(link);
        } else {
            pax_record(&mut pax, b"linkpath", link);
            h[157..257].copy_from_slice(&link[..100]);
        }
        octal(&mut h[100..108], (e.mode & 0o7777) as u64);
        if !octal(&mut h[108..116], e.uid as u64) {
            pax_record(&mut pax, b"uid", e.uid.to_string().as_bytes());
            octal(&mut h[108..116], 0);
        }
        if !octal(&mut h[116..124], e.gid as u64) {
            pax_record(&mut pax, b"gid", e.gid.to_string().as_bytes());
            octal(&mut h[116..124], 0);
        }
        if !octal(&mut h[124..136], stored) {
            pax_record(&mut pax, b"size", stored.to_string().as_bytes());
            octal(&mut h[124..136], 0);
        }
        if !octal(&mut h[136..148], e.mtime.max(0) as u64) {
            pax_record(&mut pax, b"mtime", e.mtime.to_string().as_bytes());
            octal(&mut h[136..148], 0);
        }
        h[156] = flag;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        if let Kind::Char(major, minor) | Kind::Block(major, minor) = e.kind {
            octal(&mut h[329..337], major as u64);
            octal(&mut h[337..345], minor as u64);
        }
        for (k, v) in e.xattrs {
            pax_record(&mut pax, &[&b"SCHILY.xattr."[..], k].concat(), v);
        }
        if !pax.is_empty() {
            self.pax_header(&pax)?;
        }
        checksum(&mut h);
        self.put(&h)?;
        self.put(&map)?;
        self.owed = stored - map.len() as u64;
        self.in_entry = map.len() as u64;
        if self.owed == 0 {
            self.end()?;
        }
        Ok(())
    }

    fn pax_header(&mut self, records: &[u8]) -> io::Result<()> {
        let mut h = [0u8; BLOCK];
        let name = b"PaxHeaders/entry";
        h[..name.len()].copy_from_slice(name);
        octal(&mut h[100..108], 0o644);
        octal(&mut h[108..116], 0);
        octal(&mut h[116..124], 0);
        octal(&mut h[124..136], records.len() as u64);
        octal(&mut h[136..148], 0);
        h[156] = b'x';
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        checksum(&mut h);
        self.put(&h)?;
        self.put(records)?;
        self.pad(records.len() as u64)
    }

    fn pad(&mut self, len: u64) -> io::Result<()> {
        let rem = (len % BLOCK as u64) as usize;
        if rem != 0 {
            self.put(&[0u8; BLOCK][..BLOCK - rem])?;
        }
        Ok(())
    }

    /// The next piece of the current entry's data.
    pub fn data(&mut self, b: &[u8]) -> io::Result<()> {
        if b.len() as u64 > self.owed {
            return Err(io::Error::other(
                "tar: more data than the entry's header says",
            ));
        }
        self.put(b)?;
        self.owed -= b.len() as u64;
        self.in_entry += b.len() as u64;
        if self.owed == 0 {
            self.end()?;
        }
        Ok(())
    }

    fn end(&mut self) -> io::Result<()> {
        let n = self.in_entry;
        self.in_entry = 0;
        self.pad(n)
    }

    /// Ends the archive (two zero blocks) and hands back the output.
    pub fn finish(mut self) -> io::Result<W> {
        if self.owed != 0 {
            return Err(io::Error::other(
                "tar: the archive ended inside an entry's data",
            ));
        }
        self.put(&[0u8; 2 * BLOCK])?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Fills in a header's checksum: the sum of its bytes with the checksum field taken as spaces.
fn checksum(h: &mut [u8; BLOCK]) {
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| b as u32).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_record_lengths_count_themselves() {
        for value_len in [0, 1, 5, 6, 7, 90, 95, 96, 97, 990, 995, 996] {
            let mut r = Vec::new();
            pax_record(&mut r, b"path", &vec![b'a'; value_len]);
            let sp = r.iter().position(|&c| c == b' ').unwrap();
            let len: usize = std::str::from_utf8(&r[..sp]).unwrap().parse().unwrap();
            assert_eq!(len, r.len(), "value of {value_len} bytes");
        }
    }

    #[test]
    fn entries_are_padded_to_blocks_and_the_size_is_enforced() {
        let mut t = TarWriter::new(Vec::new());
        let e = Entry {
            path: b"a",
            kind: Kind::File {
                size: 3,
                sparse: None,
            },
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 1,
            xattrs: &[],
        };
        t.entry(&e).unwrap();
        assert!(t.data(b"abcd").is_err());
        t.data(b"abc").unwrap();
        assert_eq!(t.written(), 1024);
        let out = t.finish().unwrap();
        assert_eq!(out.len(), 2048);
        assert_eq!(&out[257..263], b"ustar\0");
    }
}
