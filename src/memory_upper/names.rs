//! Names of the memory upper layer: lookup, creation of every kind, links, removal and
//! `renameat2`, with the errors, link counts and timestamps of a local file system. Lock order
//! in mod.rs.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use super::changes::Txn;
use super::{
    Body, DirBody, Ino, MemoryUpper, Meta, NewNode, Node, RenameFlags, acl, check_name, data,
    is_root, now,
};
use crate::error::{Result, errno};
use crate::sys::Attr;

impl MemoryUpper {
    pub fn lookup(&self, dir: Ino, name: &OsStr) -> Result<Option<Ino>> {
        let d = self.node(dir)?;
        let entries = d.dir()?.read().unwrap();
        Ok(entries.entries.get(name).copied())
    }

    pub fn stat(&self, ino: Ino) -> Result<Attr> {
        Ok(self.node(ino)?.attr())
    }

    /// Makes `name` in `dir`: a file, directory, symlink, device, FIFO or socket. A directory
    /// with the setgid bit passes its group on, and the bit to subdirectories.
    pub fn make(&self, dir: Ino, name: &OsStr, new: &NewNode<'_>) -> Result<Ino> {
        check_name(name)?;
        self.keep_log_short();
        let _q = self.quiesce.read();
        let d = self.node(dir)?;
        d.changed();
        let mut entries = d.dir()?.write().unwrap();
        if entries.dead {
            return Err(errno(libc::ENOENT));
        }
        if entries.entries.contains_key(name) {
            return Err(errno(libc::EEXIST));
        }
        let t = now();
        let node = self.new_node(&d, new, t)?;
        let ino = node.ino;
        let is_dir = node.is_dir();
        let mut txn = self.txn();
        // No other thread reaches the new node before the directory's names are let go.
        txn.made(&node, &node.meta.lock().unwrap());
        self.insert(node);
        entries.entries.insert(name.to_owned(), ino);
        let mut m = d.meta.lock().unwrap();
        if is_dir {
            m.nlink += 1;
        }
        m.mtime = t;
        m.ctime = t;
        txn.entry(dir, name, Some(ino));
        txn.meta(&d, &m);
        self.log(&txn);
        Ok(ino)
    }

    /// An O_TMPFILE file: no name, gone when the last handle is dropped unless `link` names it.
    pub fn make_unnamed(&self, dir: Ino, new: &NewNode<'_>) -> Result<Arc<Node>> {
        if new.mode & libc::S_IFMT != libc::S_IFREG {
            return Err(errno(libc::EINVAL));
        }
        let d = self.node(dir)?;
        if d.dir()?.read().unwrap().dead {
            return Err(errno(libc::ENOENT));
        }
        let node = self.new_node(&d, new, now())?;
        let mut m = node.meta.lock().unwrap();
        m.nlink = 0;
        m.unnamed = true;
        drop(m);
        Ok(node)
    }

    fn new_node(&self, parent: &Node, new: &NewNode<'_>, t: (i64, u32)) -> Result<Arc<Node>> {
        let kind = new.mode & libc::S_IFMT;
        let (pgid, pmode, pdefault) = {
            let m = parent.meta.lock().unwrap();
            (
                m.gid,
                m.mode,
                m.xattrs.get(OsStr::new(acl::DEFAULT)).cloned(),
            )
        };
        // mkdir(2) keeps only the permission and sticky bits; set-group-ID comes from the
        // parent below.
        let asked = match kind {
            libc::S_IFDIR => new.mode & (libc::S_IFMT | 0o1777),
            _ => new.mode,
        };
        // A symlink's mode is always 0777 and takes no ACL.
        let inherited = match kind {
            libc::S_IFLNK => acl::Inherited {
                mode: asked,
                access: None,
                default: None,
            },
            _ => acl::inherit(asked, new.umask, pdefault.as_deref())?,
        };
        let mut xattrs = BTreeMap::new();
        if let Some(a) = inherited.access {
            xattrs.insert(acl::ACCESS.into(), a);
        }
        if let Some(d) = inherited.default {
            xattrs.insert(acl::DEFAULT.into(), d);
        }
        let mut mode = inherited.mode;
        let mut gid = new.gid;
        if pmode & libc::S_ISGID != 0 {
            gid = pgid;
            if kind == libc::S_IFDIR {
                mode |= libc::S_ISGID;
            }
        }
        let ino = self.next_ino.fetch_add(1, Ordering::Relaxed);
        let body = match kind {
            libc::S_IFDIR => Body::Dir(
                RwLock::new(DirBody {
                    entries: BTreeMap::new(),
                    dead: false,
                }),
                AtomicU64::new(parent.ino),
            ),
            libc::S_IFREG => Body::File(RwLock::new(data::FileBody::new(
                self.store.clone(),
                self.closing.clone(),
            ))),
            libc::S_IFLNK => {
                let target = new.target.ok_or_else(|| errno(libc::EINVAL))?;
                if target.is_empty() {
                    return Err(errno(libc::ENOENT));
                }
                if target.len() >= libc::PATH_MAX as usize {
                    return Err(errno(libc::ENAMETOOLONG));
                }
                Body::Symlink(target.to_owned())
            }
            libc::S_IFCHR | libc::S_IFBLK | libc::S_IFIFO | libc::S_IFSOCK => Body::Special,
            _ => return Err(errno(libc::EINVAL)),
        };
        Ok(Arc::new(Node {
            ino,
            dirty: AtomicBool::new(true),
            meta: Mutex::new(Meta {
                mode,
                uid: new.uid,
                gid,
                nlink: if kind == libc::S_IFDIR { 2 } else { 1 },
                rdev: if matches!(kind, libc::S_IFCHR | libc::S_IFBLK) {
                    new.rdev
                } else {
                    0
                },
                atime: t,
                mtime: t,
                ctime: t,
                xattrs,
                unnamed: false,
            }),
            body,
        }))
    }

    /// A new name `name` in `dir` for `node`, which is no directory; the first name of an
    /// O_TMPFILE file.
    pub fn link(&self, node: &Arc<Node>, dir: Ino, name: &OsStr) -> Result<()> {
        check_name(name)?;
        self.keep_log_short();
        let _q = self.quiesce.read();
        let d = self.node(dir)?;
        d.changed();
        let mut entries = d.dir()?.write().unwrap();
        if entries.dead {
            return Err(errno(libc::ENOENT));
        }
        // The new name is looked at first, as link(2) does: EEXIST before EPERM.
        if entries.entries.contains_key(name) {
            return Err(errno(libc::EEXIST));
        }
        if node.is_dir() {
            return Err(errno(libc::EPERM));
        }
        let t = now();
        node.changed();
        let mut txn = self.txn();
        // An O_TMPFILE file's first name: its data joins the tree with it.
        let data = match &node.body {
            Body::File(f) => Some(f.write().unwrap()),
            _ => None,
        };
        let mut metas = Metas::lock(&[node, &d]);
        let m = metas.get(node.ino);
        if m.nlink == 0 && !m.unnamed {
            return Err(errno(libc::ENOENT));
        }
        let first = m.nlink == 0;
        if first {
            m.unnamed = false;
            self.insert(node.clone());
        }
        m.nlink += 1;
        m.ctime = t;
        if first {
            txn.made(node, m);
            if let Some(f) = &data {
                txn.file(node.ino, f.size(), &f.whole_map());
            }
        } else {
            txn.meta(node, m);
        }
        entries.entries.insert(name.to_owned(), node.ino);
        let m = metas.get(d.ino);
        m.mtime = t;
        m.ctime = t;
        txn.entry(dir, name, Some(node.ino));
        txn.meta(&d, m);
        self.log(&txn);
        Ok(())
    }

    /// Removes the name of a non-directory.
    pub fn unlink(&self, dir: Ino, name: &OsStr) -> Result<()> {
        self.remove(dir, name, false)
    }

    /// Removes an empty directory.
    pub fn rmdir(&self, dir: Ino, name: &OsStr) -> Result<()> {
        self.remove(dir, name, true)
    }

    fn remove(&self, dir: Ino, name: &OsStr, want_dir: bool) -> Result<()> {
        self.keep_log_short();
        let _q = self.quiesce.read();
        let d = self.node(dir)?;
        d.changed();
        let mut entries = d.dir()?.write().unwrap();
        let ino = *entries
            .entries
            .get(name)
            .ok_or_else(|| errno(libc::ENOENT))?;
        let victim = self.node(ino)?;
        match (want_dir, victim.is_dir()) {
            (true, false) => return Err(errno(libc::ENOTDIR)),
            (false, true) => return Err(errno(libc::EISDIR)),
            (true, true) => kill_empty_dir(&victim)?,
            (false, false) => {}
        }
        entries.entries.remove(name);
        let t = now();
        let mut txn = self.txn();
        txn.entry(dir, name, None);
        let mut metas = Metas::lock(&[&victim, &d]);
        self.drop_link(&victim, metas.get(ino), t, &mut txn);
        let m = metas.get(dir);
        if want_dir {
            m.nlink -= 1;
        }
        m.mtime = t;
        m.ctime = t;
        txn.meta(&d, m);
        self.log(&txn);
        Ok(())
    }

    /// One name of `node` is gone (`m`, its attributes, locked): its link count drops (a
    /// directory's to 0), and at 0 it leaves the table; its data goes when the last handle
    /// does.
    fn drop_link(&self, node: &Arc<Node>, m: &mut Meta, t: (i64, u32), txn: &mut Txn) {
        node.changed();
        m.nlink = if node.is_dir() {
            0
        } else {
            m.nlink.saturating_sub(1)
        };
        m.ctime = t;
        if m.nlink == 0 {
            self.removed.lock().unwrap().push(node.ino);
            self.nodes
                .shard(node.ino)
                .write()
                .unwrap()
                .remove(&node.ino);
            txn.gone(node.ino);
        } else {
            txn.meta(node, m);
        }
    }

    /// `renameat2` within the layer. One piece: every check is made before anything changes,
    /// under the one lock of the tree, so that a refused rename changes nothing.
    pub fn rename(
        &self,
        sdir: Ino,
        sname: &OsStr,
        ddir: Ino,
        dname: &OsStr,
        flags: RenameFlags,
    ) -> Result<()> {
        if (flags.noreplace || flags.whiteout.is_some()) && flags.exchange {
            return Err(errno(libc::EINVAL));
        }
        check_name(dname)?;
        self.keep_log_short();
        let _q = self.quiesce.read();
        let _shape = (sdir != ddir).then(|| self.rename_lock.lock().unwrap());
        let s = self.node(sdir)?;
        let d = self.node(ddir)?;
        s.dir()?;
        d.dir()?;
        // Lock the two directories: an ancestor first, else by number (rename_lock held).
        let (mut sg, mut dg) = if sdir == ddir {
            (s.dir()?.write().unwrap(), None)
        } else if self.is_ancestor(sdir, ddir) || (!self.is_ancestor(ddir, sdir) && sdir < ddir) {
            let sg = s.dir()?.write().unwrap();
            (sg, Some(d.dir()?.write().unwrap()))
        } else {
            let dg = d.dir()?.write().unwrap();
            (s.dir()?.write().unwrap(), Some(dg))
        };
        let src = *sg.entries.get(sname).ok_or_else(|| errno(libc::ENOENT))?;
        let dst = match &dg {
            Some(g) => g.entries.get(dname).copied(),
            None => sg.entries.get(dname).copied(),
        };
        if dg.as_ref().is_some_and(|g| g.dead) {
            return Err(errno(libc::ENOENT));
        }
        // In renameat2's order: a taken target for NOREPLACE (its own name included), a
        // missing one for EXCHANGE, then the same name, then the ancestry checks.
        if flags.noreplace && dst.is_some() {
            return Err(errno(libc::EEXIST));
        }
        if flags.exchange && dst.is_none() {
            return Err(errno(libc::ENOENT));
        }
        if sdir == ddir && sname == dname {
            return Ok(());
        }
        let src_node = self.node(src)?;
        let dst_node = dst.map(|i| self.node(i)).transpose()?;
        for n in [Some(&s), Some(&d), Some(&src_node), dst_node.as_ref()]
            .into_iter()
            .flatten()
        {
            n.changed();
        }
        // A directory may not move below itself.
        if sdir != ddir {
            if src_node.is_dir() && (src == ddir || self.is_ancestor(src, ddir)) {
                return Err(errno(libc::EINVAL));
            }
            // Nor may the target be a directory above the source: not empty (it holds the
            // source), or for an exchange, a loop.
            if let Some(dn) = &dst_node
                && dn.is_dir()
                && (dn.ino == sdir || self.is_ancestor(dn.ino, sdir))
            {
                return Err(errno(if flags.exchange {
                    libc::EINVAL
                } else {
                    libc::ENOTEMPTY
                }));
            }
        }
        let t = now();
        let mut txn = self.txn();
        if flags.exchange {
            let dn = dst_node.ok_or_else(|| errno(libc::ENOENT))?;
            let dst = dn.ino;
            match &mut dg {
                Some(g) => {
                    g.entries.insert(dname.to_owned(), src);
                    sg.entries.insert(sname.to_owned(), dst);
                }
                None => {
                    sg.entries.insert(dname.to_owned(), src);
                    sg.entries.insert(sname.to_owned(), dst);
                }
            }
            txn.entry(ddir, dname, Some(src));
            txn.entry(sdir, sname, Some(dst));
            let mut metas = Metas::lock(&[&s, &d, &src_node, &dn]);
            if sdir != ddir {
                if let Some(p) = src_node.parent() {
                    p.store(ddir, Ordering::Relaxed);
                }
                if let Some(p) = dn.parent() {
                    p.store(sdir, Ordering::Relaxed);
                }
                let delta = src_node.is_dir() as i64 - dn.is_dir() as i64;
                add_nlink(metas.get(sdir), -delta);
                add_nlink(metas.get(ddir), delta);
            }
            metas.get(src).ctime = t;
            metas.get(dst).ctime = t;
            touch_dirs(&mut metas, sdir, ddir, t);
            metas.log_all(&mut txn, &[&s, &d, &src_node, &dn]);
            self.log(&txn);
            return Ok(());
        }
        if let Some(dn) = &dst_node {
            if flags.noreplace {
                return Err(errno(libc::EEXIST));
            }
            if dn.ino == src {
                return Ok(()); // two names of one file: nothing to do, as rename(2) says
            }
            match (src_node.is_dir(), dn.is_dir()) {
                (true, false) => return Err(errno(libc::ENOTDIR)),
                (false, true) => return Err(errno(libc::EISDIR)),
                (true, true) => kill_empty_dir(dn)?,
                (false, false) => {}
            }
        }
        // Made before anything moves: a whiteout that cannot be made fails the whole rename.
        let whiteout = match flags.whiteout {
            Some((uid, gid)) => {
                let new = NewNode {
                    mode: libc::S_IFCHR,
                    umask: 0,
                    uid,
                    gid,
                    rdev: 0,
                    target: None,
                };
                Some(self.new_node(&s, &new, t)?)
            }
            None => None,
        };
        sg.entries.remove(sname);
        match &mut dg {
            Some(g) => g.entries.insert(dname.to_owned(), src),
            None => sg.entries.insert(dname.to_owned(), src),
        };
        txn.entry(ddir, dname, Some(src));
        match whiteout {
            Some(w) => {
                sg.entries.insert(sname.to_owned(), w.ino);
                txn.made(&w, &w.meta.lock().unwrap());
                txn.entry(sdir, sname, Some(w.ino));
                self.insert(w);
            }
            None => txn.entry(sdir, sname, None),
        }
        let mut locked = vec![&s, &d, &src_node];
        locked.extend(dst_node.as_ref());
        let mut metas = Metas::lock(&locked);
        if let Some(dn) = &dst_node {
            self.drop_link(dn, metas.get(dn.ino), t, &mut txn);
            if dn.is_dir() {
                add_nlink(metas.get(ddir), -1);
            }
        }
        if sdir != ddir && src_node.is_dir() {
            if let Some(p) = src_node.parent() {
                p.store(ddir, Ordering::Relaxed);
            }
            add_nlink(metas.get(sdir), -1);
            add_nlink(metas.get(ddir), 1);
        }
        metas.get(src).ctime = t;
        touch_dirs(&mut metas, sdir, ddir, t);
        metas.log_all(&mut txn, &[&s, &d, &src_node]);
        self.log(&txn);
        Ok(())
    }

    /// Whether directory `a` lies above directory `b`. Parents change only under `rename_lock`,
    /// which the caller holds.
    fn is_ancestor(&self, a: Ino, b: Ino) -> bool {
        let mut at = b;
        // A tree deeper than its node count has a loop: stop rather than spin.
        for _ in 0..=self.node_count() {
            if is_root(at) {
                return false;
            }
            let Ok(n) = self.node(at) else { return false };
            let Some(p) = n.parent() else { return false };
            at = p.load(Ordering::Relaxed);
            if at == a {
                return true;
            }
        }
        false
    }

    /// The names in `dir` with their numbers and file types (S_IFMT bits), sorted by name.
    pub fn read_dir(&self, dir: Ino) -> Result<Vec<(OsString, Ino, u32)>> {
        let d = self.node(dir)?;
        let entries = d.dir()?.read().unwrap();
        let mut out = Vec::with_capacity(entries.entries.len());
        for (name, &ino) in &entries.entries {
            let kind = self.node(ino).map(|n| n.file_type()).unwrap_or(0);
            out.push((name.clone(), ino, kind));
        }
        Ok(out)
    }

    pub fn read_link(&self, ino: Ino) -> Result<OsString> {
        match &self.node(ino)?.body {
            Body::Symlink(t) => Ok(t.clone()),
            _ => Err(errno(libc::EINVAL)),
        }
    }
}

/// Marks the empty directory `victim` dead (it is being removed or renamed over); ENOTEMPTY if
/// it holds anything. The caller holds its parent's entries: parent before child.
fn kill_empty_dir(victim: &Node) -> Result<()> {
    let mut v = victim.dir()?.write().unwrap();
    if !v.entries.is_empty() {
        return Err(errno(libc::ENOTEMPTY));
    }
    v.dead = true;
    Ok(())
}

fn add_nlink(m: &mut Meta, delta: i64) {
    m.nlink = m.nlink.saturating_add_signed(delta);
}

fn touch_dirs(metas: &mut Metas<'_>, s: Ino, d: Ino, t: (i64, u32)) {
    for dir in [s, d] {
        let m = metas.get(dir);
        m.mtime = t;
        m.ctime = t;
    }
}

/// The attributes of the nodes a change of names touches, locked together until the change is
/// logged (changes.rs): in the order of their numbers, each once — the one order of every
/// change that holds more than one node's attributes (docs/ROBUSTNESS.md, "Lock order").
struct Metas<'a> {
    held: Vec<(Ino, MutexGuard<'a, Meta>)>,
}

impl<'a> Metas<'a> {
    fn lock(nodes: &[&'a Arc<Node>]) -> Metas<'a> {
        let mut nodes = nodes.to_vec();
        nodes.sort_by_key(|n| n.ino);
        nodes.dedup_by_key(|n| n.ino);
        Metas {
            held: nodes
                .into_iter()
                .map(|n| (n.ino, n.meta.lock().unwrap()))
                .collect(),
        }
    }

    fn get(&mut self, ino: Ino) -> &mut Meta {
        let i = self
            .held
            .iter()
            .position(|(i, _)| *i == ino)
            .expect("a node whose attributes the change locked");
        &mut self.held[i].1
    }

    /// Logs the attributes of `nodes` as they are now, each once.
    fn log_all(&mut self, txn: &mut Txn, nodes: &[&Arc<Node>]) {
        let mut done = Vec::new();
        for n in nodes {
            if !done.contains(&n.ino) {
                done.push(n.ino);
                txn.meta(n, self.get(n.ino));
            }
        }
    }
}
