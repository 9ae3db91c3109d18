//! Tests of the inode table: numbers, generations, forgetting and finding nodes again.

use super::*;

fn file(ino: Ino) -> Found {
    Found {
        ino,
        kind: libc::S_IFREG,
        upper: false,
        lower: Some(LowerRef::new(PathBuf::from("f"), 1)),
        origin: false,
        origins: false,
        upper_ino: None,
        generation: None,
    }
}

fn table() -> InodeTable {
    InodeTable::new(true, None, false, Records::new(None).unwrap())
}

#[test]
fn a_retired_node_leads_lookups_to_a_second_identity_of_the_same_object() {
    let t = table();
    let first = t.remember(ROOT_INO, OsStr::new("f"), &file(42));
    assert_eq!((first.ino, first.st_ino()), (42, 42));
    assert!(t.retire(&first));
    let second = t.remember(ROOT_INO, OsStr::new("f"), &file(42));
    assert!(second.ino >= ALIAS_BASE && second.is_alias());
    assert_eq!(second.st_ino(), 42);
    // One object: a change through one identity shows through the other.
    second.state().upper = true;
    assert!(first.state().upper);
    // Later lookups keep naming the second identity, and it is never retired itself.
    let again = t.remember(ROOT_INO, OsStr::new("f"), &file(42));
    assert_eq!(again.ino, second.ino);
    assert!(!t.retire(&second));
    assert_eq!(
        t.get(42).unwrap().ino,
        42,
        "lookups by inode number still find the object"
    );
}

#[test]
fn identities_are_forgotten_in_either_order() {
    // The first forgotten first: it stays as long as the second identity lives.
    let t = table();
    let first = t.remember(ROOT_INO, OsStr::new("f"), &file(7));
    t.retire(&first);
    let second = t.remember(ROOT_INO, OsStr::new("f"), &file(7));
    t.forget(7, 1);
    assert!(t.get(7).is_some());
    assert_eq!(
        t.remember(ROOT_INO, OsStr::new("f"), &file(7)).ino,
        second.ino
    );
    t.forget(second.ino, 2);
    assert!(t.get(second.ino).is_none() && t.get(7).is_none());
    assert_eq!(t.len(), 1, "only the root is left");

    // The second forgotten first: the first, still known, makes a new one on next lookup.
    let first = t.remember(ROOT_INO, OsStr::new("f"), &file(8));
    t.retire(&first);
    let second = t.remember(ROOT_INO, OsStr::new("f"), &file(8));
    t.forget(second.ino, 1);
    assert!(t.get(second.ino).is_none());
    let third = t.remember(ROOT_INO, OsStr::new("f"), &file(8));
    assert!(third.is_alias() && third.ino != second.ino);
    t.forget(8, 1);
    t.forget(third.ino, 1);
    assert_eq!(t.len(), 1);
}

#[test]
fn a_number_is_always_held_or_recorded_while_its_node_leaves() {
    // A node leaving the table and the record of where it was are one step: a look in
    // between found neither, and a scan that had seen the whole tree then took the number
    // for gone (a directory's file handle answered ESTALE after drop_caches).
    let t = table();
    let f = t.remember(ROOT_INO, OsStr::new("f"), &file(42));
    t.forget(f.ino, 1);
    drop(f);
    // A whole scan that did not meet 42 (it was recorded then).
    t.scanned_whole(t.begin_scan());
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..200_000 {
                t.remember(ROOT_INO, OsStr::new("f"), &file(42));
                t.forget(42, 1);
            }
            done.store(true, Ordering::Relaxed);
        });
        let mut looks = 0u64;
        while !done.load(Ordering::Relaxed) {
            assert!(
                !t.surely_gone(42),
                "number 42 taken for gone after {looks} looks"
            );
            looks += 1;
        }
    });
}

#[test]
fn a_forgotten_node_leaves_where_it_was_and_its_generation() {
    let t = table();
    let f = t.remember(ROOT_INO, OsStr::new("f"), &file(42));
    t.forget(f.ino, 1);
    assert!(t.get(42).is_none());
    assert_eq!(t.seen(42), Seen::At(ROOT_INO, "f".into()));
    // A new object made under the number: the next generation.
    let new = t.remember_new(ROOT_INO, OsStr::new("g"), &file(42));
    assert_eq!(new.generation(), 1);
    // Removed, forgotten: gone; found again by a lookup, it keeps its generation.
    new.state().unlinked = true;
    t.forget(42, 1);
    assert_eq!(t.seen(42), Seen::Gone);
    assert_eq!(
        t.remember(ROOT_INO, OsStr::new("h"), &file(42))
            .generation(),
        1
    );
}

#[test]
fn a_node_found_by_number_keeps_its_parent_until_forgotten() {
    let t = table();
    let dir = Found {
        kind: libc::S_IFDIR,
        ..file(10)
    };
    let d = t.remember(ROOT_INO, OsStr::new("d"), &dir);
    let f = t.remember(d.ino, OsStr::new("f"), &file(11));
    // The reference finding `f` counted on its parent passes to `f`.
    t.get_counted(d.ino);
    t.hold_parent(&f, d.ino);
    // The kernel forgets the directory; the file's hold keeps it.
    t.forget(d.ino, 1);
    assert!(t.get(10).is_some());
    t.forget(f.ino, 1);
    assert!(t.get(10).is_none() && t.get(11).is_none());
    assert_eq!(t.seen(11), Seen::At(10, "f".into()));
    assert_eq!(t.seen(10), Seen::At(ROOT_INO, "d".into()));
}

#[test]
fn a_whole_scan_makes_unknown_numbers_surely_gone_until_a_record_is_dropped() {
    let t = table();
    assert!(!t.surely_gone(5), "no scan yet");
    let f = t.remember(ROOT_INO, OsStr::new("f"), &file(5));
    f.state().unlinked = true;
    t.forget(5, 1);
    let scan = t.begin_scan();
    t.note_seen(6, ROOT_INO, OsStr::new("g"));
    t.scanned_whole(scan);
    assert!(t.surely_gone(5) && t.surely_gone(7));
    assert!(!t.surely_gone(6), "seen by the scan");
    // Gone after the scan began: it may live on under a name the scan passed.
    let f = t.remember(ROOT_INO, OsStr::new("h"), &file(8));
    f.state().unlinked = true;
    t.forget(8, 1);
    assert!(!t.surely_gone(8));
    // A record displaced by another number's: nothing is sure any more.
    assert!(!t.note_seen(records::rival_of(6), ROOT_INO, OsStr::new("x")));
    assert!(!t.surely_gone(7));
}

#[test]
fn layer_inode_numbers_never_reach_the_second_identity_range() {
    for devices in [1, 3, 200] {
        let map = InoMap { devices };
        for dev in [0, 1, 125, 126, 199] {
            for st_ino in [0, 1, 2, 12345, 1 << 56, u64::MAX] {
                let ino = map.map(dev, st_ino);
                assert!(
                    ino < ALIAS_BASE && ino > ROOT_INO,
                    "{devices} {dev} {st_ino}"
                );
            }
        }
    }
}

#[test]
fn a_new_object_takes_its_stable_generation_or_the_next_one_below_2_to_the_32() {
    assert_eq!(next_generation(None, None), 0);
    assert_eq!(next_generation(Some(5), None), 6);
    assert_eq!(next_generation(None, Some(9)), 9);
    assert_eq!(
        next_generation(Some(5), Some(9)),
        9,
        "its own, the same in every mount"
    );
    assert_eq!(
        next_generation(Some(7), Some(7)),
        8,
        "never the old object's"
    );
    assert_eq!(next_generation(Some(0xffff_ffff), Some(0xffff_ffff)), 0);
    assert_eq!(next_generation(Some(0xffff_ffff), None), 0);
}

/// Every inode the kernel holds costs a node (docs/PERFORMANCE.md, "Memory per inode"): a
/// field added to these grows every node of a million-file tree, so it should be a choice.
#[test]
fn a_node_stays_small() {
    use std::mem::size_of;
    assert!(
        size_of::<LowerRef>() <= 32,
        "LowerRef: {}",
        size_of::<LowerRef>()
    );
    assert!(size_of::<Links>() <= 32, "Links: {}", size_of::<Links>());
    assert!(size_of::<Name>() <= 24, "Name: {}", size_of::<Name>());
    assert!(
        size_of::<NodeState>() <= 96,
        "NodeState: {}",
        size_of::<NodeState>()
    );
    // The state inline: with its `Arc`'s counts, 200 bytes, glibc's 208-byte chunk.
    assert!(size_of::<Node>() <= 184, "Node: {}", size_of::<Node>());
}

#[test]
fn links_keep_their_order_through_every_change() {
    let name = |s: &str| Name::new(std::ffi::OsStr::new(s));
    let mut l = Links::default();
    assert!(l.is_empty() && l.first().is_none());
    l.push((1, name("a")));
    l.push((2, name("b")));
    l.push_first((3, name("c")));
    let order = |l: &Links| l.iter().map(|(p, _)| *p).collect::<Vec<_>>();
    assert_eq!(order(&l), [3, 1, 2]);
    l.make_first(2);
    assert_eq!(order(&l), [2, 1, 3]);
    l.retain(|(p, _)| *p != 2);
    assert_eq!(order(&l), [1, 3]);
    assert_eq!(l.first(), Some(&(1, name("a"))));
    assert_eq!(l.len(), 2);
    l.retain(|(p, _)| *p != 3);
    assert_eq!((order(&l), l.len()), (vec![1], 1));
    assert!(matches!(l, Links::One(_)), "one name needs no allocation");
    l.push_first((4, name("d")));
    assert_eq!(order(&l), [4, 1]);
    l.retain(|_| false);
    assert!(l.is_empty() && l.first().is_none());
    l.push((5, name("e")));
    assert_eq!(order(&l), [5]);
    l.clear();
    assert!(l.is_empty());
}

#[test]
fn names_short_and_long_read_back_as_given() {
    for s in [
        "",
        "a",
        "f0000123",
        &"x".repeat(22),
        &"y".repeat(23),
        &"z".repeat(255),
    ] {
        let n = Name::new(std::ffi::OsStr::new(s));
        assert_eq!(n.as_os_str(), s);
        assert_eq!(matches!(n, Name::Short { .. }), s.len() <= 22, "{s:?}");
        assert_eq!(n, Name::new(std::ffi::OsStr::new(s)));
    }
    assert_ne!(Name::new("ab".as_ref()), Name::new("abc".as_ref()));
}

#[test]
fn a_shard_gives_back_its_room_once_it_empties() {
    let mut m: HashMap<Ino, u8> = (0..10_000).map(|i| (i, 0)).collect();
    let peak = m.capacity();
    for i in 0..5_000 {
        m.remove(&i);
        shrink_when_emptied(&mut m);
    }
    assert!(
        m.capacity() > 12_000,
        "half full, the room stays: {} of {peak}",
        m.capacity()
    );
    for i in 5_000..9_990 {
        m.remove(&i);
        shrink_when_emptied(&mut m);
    }
    assert_eq!(m.len(), 10);
    assert!(m.capacity() <= 256, "{} of {peak} left", m.capacity());
    assert!((9_990..10_000).all(|i| m.contains_key(&i)));
    for i in 9_990..10_000 {
        m.remove(&i);
        shrink_when_emptied(&mut m);
    }
    assert_eq!(m.capacity(), 0, "empty, it keeps nothing");
}

/// The few nodes a burst of FORGETs ends with are given back once the forgetting stops, not
/// at the next burst: fails without `trim_when_quiet` (no trim below 1,024 nodes).
#[test]
fn a_few_forgotten_nodes_are_trimmed_once_the_forgetting_stops() {
    let t = table();
    for ino in 100..110 {
        t.remember(ROOT_INO, OsStr::new(&format!("f{ino}")), &file(ino));
        t.forget(ino, 1);
    }
    give_back_after_forgets();
    let forgotten = FORGOTTEN.load(Ordering::SeqCst);
    // Other tests of this process forget nodes too: wait for a trim that counts ours.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while FORGOTTEN_AT_TRIM.load(Ordering::SeqCst) < forgotten {
        assert!(
            std::time::Instant::now() < deadline,
            "no trim after {forgotten} forgotten nodes"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
