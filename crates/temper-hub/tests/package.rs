//! The package format: deterministic packing, and unpacking that refuses
//! every way an archive can reach outside its directory or blow up.

mod common;
use common::listing;

use std::io::Write;
use std::path::Path;

use temper_hub::package::{self, pack_dir, read_archive, unpack, Limits, MANIFEST_FILE};
use temper_hub::{Cache, HubError, Wanted};

const HUB: &str = "http://hub.test:8700";

fn wanted(p: &temper_hub::Packed) -> Wanted {
    Wanted {
        namespace: p.manifest.namespace.clone(),
        name: p.manifest.name.clone(),
        version: p.manifest.version.clone(),
        digest: p.digest.clone(),
    }
}

fn write_env(dir: &Path, version: &str) {
    std::fs::create_dir_all(dir.join("data")).expect("mkdir");
    std::fs::write(
        dir.join("env.toml"),
        format!(
            "name = \"capitals\"\nnamespace = \"acme\"\nversion = \"{version}\"\n\
             description = \"Name the capital.\"\ntags = [\"geo\"]\nlicense = \"MIT\"\n\
             temper = \">=0.1\"\n[dataset]\neval = \"data/eval.jsonl\"\n\
             [[rubric]]\nfunction = \"exact_match\"\n"
        ),
    )
    .expect("write");
    std::fs::write(
        dir.join("data/eval.jsonl"),
        "{\"question\": \"France?\", \"answer\": \"Paris\"}\n",
    )
    .expect("write");
    std::fs::write(dir.join("README.md"), "# capitals\n\nName the capital.\n").expect("write");
}

#[test]
fn the_same_directory_packs_to_the_same_digest() {
    let a = tempfile::tempdir().expect("tmp");
    let b = tempfile::tempdir().expect("tmp");
    write_env(a.path(), "1.0.0");
    // Written later, in another place: mtimes, inode order and paths differ.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    write_env(b.path(), "1.0.0");
    std::fs::write(b.path().join(".DS_Store"), "junk").expect("write");
    let pa = pack_dir(a.path(), None).expect("pack a");
    let pb = pack_dir(b.path(), None).expect("pack b");
    assert_eq!(pa.digest, pb.digest);
    assert_eq!(pa.bytes, pb.bytes);
    let m = &pa.manifest;
    assert_eq!(
        (
            m.id(),
            m.version.to_string(),
            m.license.as_deref(),
            m.temper.as_deref()
        ),
        (
            "acme/capitals".to_string(),
            "1.0.0".to_string(),
            Some("MIT"),
            Some(">=0.1")
        )
    );
    let paths: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["README.md", "data/eval.jsonl", "env.toml"]);
    // A changed byte changes the digest.
    std::fs::write(b.path().join("README.md"), "# capitals!\n").expect("write");
    assert_ne!(pack_dir(b.path(), None).expect("pack").digest, pa.digest);
}

#[test]
fn a_packed_environment_unpacks_and_loads() {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), "1.0.0");
    let p = pack_dir(src.path(), None).expect("pack");
    let out = tempfile::tempdir().expect("tmp");
    let dest = out.path().join("pkg");
    let m = unpack(&p.bytes, &dest, &Limits::default()).expect("unpack");
    assert_eq!(m, p.manifest);
    assert!(dest.join(MANIFEST_FILE).is_file());
    let env = temper_env::Loader::new()
        .load(&dest.display().to_string(), &serde_json::Value::Null)
        .expect("load");
    // One data file: its rows are split by content hash; together they are all there.
    let mut rows = env.rows(temper_env::Split::Eval, 5, 0).expect("eval rows");
    rows.extend(
        env.rows(temper_env::Split::Train, 1, 0)
            .expect("train rows"),
    );
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].answer.as_deref(), Some("Paris"));
}

#[test]
fn packing_refuses_a_symlink() {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), "1.0.0");
    std::os::unix::fs::symlink("/etc/passwd", src.path().join("passwd")).expect("symlink");
    let e = pack_dir(src.path(), None).expect_err("symlink packed");
    assert!(e.to_string().contains("regular files only"), "{e}");
}

/// A gzipped tar whose first entry is a valid manifest (so the check that
/// fires is the one under test), then `entries` written with raw headers.
/// A raw entry: path bytes, type, content, link target.
type RawEntry<'a> = (&'a [u8], tar::EntryType, &'a [u8], Option<&'a str>);

fn evil_archive(entries: &[RawEntry<'_>]) -> Vec<u8> {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), "1.0.0");
    let good = pack_dir(src.path(), None).expect("pack");
    let json = serde_json::to_vec(&good.manifest).expect("json");
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut t = tar::Builder::new(gz);
    let mut raw = |name: &[u8], kind: tar::EntryType, data: &[u8], link: Option<&str>| {
        let mut h = tar::Header::new_old();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        if let Some(l) = link {
            h.as_old_mut().linkname[..l.len()].copy_from_slice(l.as_bytes());
        }
        h.set_cksum();
        t.append(&h, data).expect("append");
    };
    raw(
        MANIFEST_FILE.as_bytes(),
        tar::EntryType::Regular,
        &json,
        None,
    );
    for (name, kind, data, link) in entries {
        raw(name, *kind, data, *link);
    }
    t.into_inner().expect("tar").finish().expect("gz")
}

fn refused(archive: &[u8]) -> HubError {
    let out = tempfile::tempdir().expect("tmp");
    let dest = out.path().join("pkg");
    let e = unpack(archive, &dest, &Limits::default()).expect_err("unsafe archive accepted");
    assert!(!dest.exists(), "a refused archive left {}", dest.display());
    assert!(!out.path().join("evil").exists());
    e
}

/// An archive holding one `entry` is refused as unsafe, for a reason that
/// mentions `why` (any reason when `why` is empty).
fn refused_entry(entry: RawEntry<'_>, why: &str) {
    let e = refused(&evil_archive(&[entry]));
    assert!(
        matches!(&e, HubError::UnsafeEntry { reason, .. } if reason.contains(why)),
        "{e}"
    );
}

#[test]
fn dot_dot_paths_are_refused() {
    refused_entry((b"../evil", tar::EntryType::Regular, b"x", None), "..");
    refused_entry(
        (b"data/../../evil", tar::EntryType::Regular, b"x", None),
        "",
    );
}

#[test]
fn absolute_paths_are_refused() {
    refused_entry(
        (b"/tmp/evil", tar::EntryType::Regular, b"x", None),
        "absolute",
    );
}

#[test]
fn symlinks_and_hard_links_are_refused() {
    refused_entry(
        (b"evil", tar::EntryType::Symlink, b"", Some("/etc/passwd")),
        "symlink",
    );
    refused_entry(
        (b"evil", tar::EntryType::Link, b"", Some("../../etc/passwd")),
        "hard link",
    );
}

#[test]
fn device_files_are_refused() {
    refused_entry((b"evil", tar::EntryType::Char, b"", None), "device");
    refused_entry((b"evil", tar::EntryType::Block, b"", None), "device");
}

#[test]
fn size_bombs_are_refused() {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), "1.0.0");
    // Incompressible, so only the size limit can fire.
    let data: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(src.path().join("big.bin"), &data).expect("write");
    let p = pack_dir(src.path(), None).expect("pack");
    let limits = Limits {
        max_unpacked_bytes: 200_000,
        ..Limits::default()
    };
    let e = read_archive(&p.bytes, &limits).expect_err("size bomb accepted");
    assert!(matches!(e, HubError::TooLarge { limit: 200_000 }), "{e}");
    assert!(read_archive(&p.bytes, &Limits::default()).is_ok());
}

#[test]
fn ratio_bombs_are_refused() {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), "1.0.0");
    // 64 MiB of zeros gzip to ~64 KiB: a 1000x expansion.
    let mut f = std::fs::File::create(src.path().join("zeros.bin")).expect("create");
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..64 {
        f.write_all(&zeros).expect("write");
    }
    drop(f);
    let p = pack_dir(src.path(), None).expect("pack");
    assert!(p.bytes.len() < 1 << 20);
    let e = read_archive(&p.bytes, &Limits::default()).expect_err("ratio bomb accepted");
    assert!(matches!(e, HubError::RatioBomb { limit: 100, .. }), "{e}");
}

#[test]
fn a_file_that_differs_from_the_manifest_is_refused() {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), "1.0.0");
    let good = pack_dir(src.path(), None).expect("pack");
    let json = serde_json::to_vec(&good.manifest).expect("json");
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut t = tar::Builder::new(gz);
    let mut add = |path: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        t.append_data(&mut h, path, data).expect("append");
    };
    add(MANIFEST_FILE, &json);
    add("README.md", b"# capitals\n\nName the capital.\n");
    add(
        "data/eval.jsonl",
        b"{\"question\": \"France?\", \"answer\": \"Lyon\"}\n",
    );
    add(
        "env.toml",
        &std::fs::read(src.path().join("env.toml")).expect("read"),
    );
    let bytes = t.into_inner().expect("tar").finish().expect("gz");
    let e = read_archive(&bytes, &Limits::default()).expect_err("tampered file accepted");
    assert!(e.to_string().contains("data/eval.jsonl"), "{e}");
}

#[test]
fn a_digest_mismatch_leaves_the_cache_as_it_was() {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), "1.0.0");
    let v1 = pack_dir(src.path(), None).expect("pack");
    let root = tempfile::tempdir().expect("tmp");
    let cache = Cache::new(root.path());
    let c = cache
        .install(HUB, &v1.bytes, &wanted(&v1), &Limits::default())
        .expect("install");
    let before = listing(root.path());
    // 1.0.1's bytes offered under a digest they do not have.
    write_env(src.path(), "1.0.1");
    let v2 = pack_dir(src.path(), None).expect("pack");
    let e = cache
        .install(HUB, &v2.bytes, &wanted(&v1), &Limits::default())
        .expect_err("mismatch accepted");
    assert!(matches!(e, HubError::DigestMismatch { .. }), "{e}");
    assert_eq!(listing(root.path()), before);
    assert!(c.dir.join("env.toml").is_file());
    assert_eq!(package::digest(&v2.bytes), v2.digest);
}

#[test]
fn issue31_uninstallable_packages_are_refused_by_the_unpacker() {
    for (what, archive, word) in common::uninstallable_packages() {
        let out = tempfile::tempdir().expect("tmp");
        let dest = out.path().join("pkg");
        let e = unpack(&archive, &dest, &Limits::default()).expect_err(what);
        assert!(e.to_string().contains(word), "{what}: {e}");
        assert!(
            !dest.exists(),
            "{what}: a refused archive left {}",
            dest.display()
        );
    }
    // The well-formed twin of those archives unpacks: only the rule under
    // test refused each.
    let good = common::crafted(
        "1.0.0",
        &[(b"a/b", b"one"), (b"env.toml", common::ENV_TOML)],
        true,
    );
    let out = tempfile::tempdir().expect("tmp");
    let m = unpack(&good, &out.path().join("pkg"), &Limits::default()).expect("good archive");
    assert_eq!(m.files.len(), 2);
    assert_eq!(
        std::fs::read(out.path().join("pkg/a/b")).expect("a/b"),
        b"one"
    );
}

#[test]
fn issue31_packing_refuses_what_the_hub_would_refuse() {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), &format!("1.0.0-{}", "p".repeat(10_000)));
    let e = pack_dir(src.path(), None).expect_err("a 10 KB pre-release packed");
    assert!(e.to_string().contains("pre-release"), "{e}");
    for ok in ["a/b", "data/eval.jsonl", "x.y-z_w/README.md"] {
        package::check_path(ok).expect(ok);
    }
    for bad in [
        "a//b", "a/", "/a", "./a", "a/./b", "a/../b", "", "a\\b", "a\nb",
    ] {
        assert!(package::check_path(bad).is_err(), "{bad:?}");
    }
    assert!(package::check_path(&"x".repeat(255)).is_ok());
    assert!(package::check_path(&"x".repeat(256)).is_err());
}

#[test]
fn issue31_the_cache_refuses_an_archive_that_is_not_the_package_asked_for() {
    let src = tempfile::tempdir().expect("tmp");
    write_env(src.path(), "1.0.0");
    let p = pack_dir(src.path(), None).expect("pack");
    let root = tempfile::tempdir().expect("tmp");
    let cache = Cache::new(root.path());
    // A hub answering evil/thing (or another version) with acme/capitals@1.0.0.
    for want in [
        Wanted {
            namespace: "evil".into(),
            ..wanted(&p)
        },
        Wanted {
            name: "thing".into(),
            ..wanted(&p)
        },
        Wanted {
            version: semver::Version::new(1, 0, 1),
            ..wanted(&p)
        },
    ] {
        let e = cache
            .install(HUB, &p.bytes, &want, &Limits::default())
            .expect_err("planted");
        assert!(e.to_string().contains("asked for"), "{e}");
        assert!(
            listing(root.path())
                .iter()
                .all(|f| !f.contains("acme") && !f.contains("evil") && !f.contains(".staging")),
            "{:?}",
            listing(root.path())
        );
    }
    // Two hubs' copies of one name live apart; with no hub named, the
    // cache answers only when they agree.
    let other = "http://other.test:8700";
    let mine = cache
        .install(HUB, &p.bytes, &wanted(&p), &Limits::default())
        .expect("install");
    let r = temper_hub::EnvRef::parse("acme/capitals@1.0.0").expect("ref");
    assert_eq!(
        cache.find(Some(other), &r).expect("find").map(|c| c.dir),
        None
    );
    assert_eq!(
        cache.find(None, &r).expect("find").map(|c| c.dir),
        Some(mine.dir.clone())
    );
    std::fs::write(src.path().join("README.md"), "# another hub's capitals\n").expect("write");
    let theirs = pack_dir(src.path(), None).expect("pack");
    let t = cache
        .install(other, &theirs.bytes, &wanted(&theirs), &Limits::default())
        .expect("install");
    assert_ne!(t.dir, mine.dir);
    assert_eq!(
        cache.find(Some(HUB), &r).expect("find").map(|c| c.digest),
        Some(p.digest.clone())
    );
    assert_eq!(
        cache.find(Some(other), &r).expect("find").map(|c| c.digest),
        Some(theirs.digest.clone())
    );
    let e = cache.find(None, &r).expect_err("ambiguous");
    assert!(e.to_string().contains("several hubs"), "{e}");
    assert_ne!(Cache::hub_key(HUB), Cache::hub_key(other));
    assert_eq!(Cache::hub_key("http://Hub.Test:8700/"), Cache::hub_key(HUB));
}
