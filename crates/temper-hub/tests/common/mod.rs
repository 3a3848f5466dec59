//! Helpers shared by the hub's integration tests.

use std::path::Path;

/// Every path under `root`, relative and sorted: a directory's visible state,
/// to show an operation left it as it was.
pub fn listing(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            out.push(p.strip_prefix(root).expect("prefix").display().to_string());
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

/// An archive built by hand, as an attacker would: a manifest for
/// `acme/capitals` at `version` listing exactly `files` (so only the rule
/// under test can fire), then the entries with their raw path bytes
/// (long ones through a GNU long-name entry). `trailer: false` cuts the
/// gzip stream's 8-byte CRC and length trailer.
pub fn crafted(version: &str, files: &[(&[u8], &[u8])], trailer: bool) -> Vec<u8> {
    use sha2::Digest;
    use temper_hub::package::{FileEntry, FORMAT, MANIFEST_FILE};
    let hex = |b: &[u8]| -> String {
        sha2::Sha256::digest(b)
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    };
    let manifest = serde_json::json!({
        "format": FORMAT,
        "namespace": "acme",
        "name": "capitals",
        "version": version,
        "description": "crafted",
        "tags": [],
        "license": null,
        "temper": null,
        "entry": {"kind": "env-toml"},
        "files": files.iter().map(|(p, d)| serde_json::to_value(FileEntry {
            path: String::from_utf8_lossy(p).into_owned(),
            size: d.len() as u64,
            sha256: hex(d),
            executable: false,
        }).expect("json")).collect::<Vec<_>>(),
    });
    let json = serde_json::to_vec(&manifest).expect("json");
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut t = tar::Builder::new(gz);
    let mut raw = |name: &[u8], data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        if name.len() > 100 {
            let mut long = tar::Header::new_gnu();
            long.set_entry_type(tar::EntryType::GNULongName);
            long.as_gnu_mut().expect("gnu").name[..13].copy_from_slice(b"././@LongLink");
            long.set_size(name.len() as u64 + 1);
            long.set_mode(0o644);
            long.set_cksum();
            let mut with_nul = name.to_vec();
            with_nul.push(0);
            t.append(&long, &with_nul[..]).expect("long name");
            h.as_gnu_mut()
                .expect("gnu")
                .name
                .copy_from_slice(&name[..100]);
        } else {
            h.as_gnu_mut().expect("gnu").name[..name.len()].copy_from_slice(name);
        }
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        t.append(&h, data).expect("append");
    };
    raw(MANIFEST_FILE.as_bytes(), &json);
    for (p, d) in files {
        raw(p, d);
    }
    let mut bytes = t.into_inner().expect("tar").finish().expect("gz");
    if !trailer {
        bytes.truncate(bytes.len() - 8);
    }
    bytes
}

/// `env.toml` for [`crafted`] archives.
pub const ENV_TOML: &[u8] = b"name = \"capitals\"\nnamespace = \"acme\"\nversion = \"1.0.0\"\n\
[dataset]\neval = \"eval.jsonl\"\n[[rubric]]\nfunction = \"exact_match\"\n";

/// Issue 31 item 8: packages the hub used to accept that cannot be
/// installed, each with a word its refusal must name.
pub fn uninstallable_packages() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let long_component = format!("data/{}", "x".repeat(300));
    let build = format!("1.0.0+{}", "b".repeat(100_000));
    let pre = format!("1.0.0-{}", "p".repeat(10_000));
    let env: (&[u8], &[u8]) = (b"env.toml", ENV_TOML);
    vec![
        (
            "a/b and a//b",
            crafted("1.0.0", &[(b"a/b", b"one"), (b"a//b", b"two"), env], true),
            "canonical",
        ),
        (
            "a file a plus a/b",
            crafted(
                "1.0.0",
                &[(b"a", b"file"), (b"a/b", b"under it"), env],
                true,
            ),
            "is a file",
        ),
        (
            "a file named temper-package.json/",
            crafted("1.0.0", &[(b"temper-package.json/", b"{}"), env], true),
            "canonical",
        ),
        (
            "a 300-byte path component",
            crafted("1.0.0", &[(long_component.as_bytes(), b"x"), env], true),
            "path component of 300 bytes",
        ),
        (
            "a 100 KB build-metadata version",
            crafted(&build, &[env], true),
            "build metadata",
        ),
        (
            "a 10 KB pre-release",
            crafted(&pre, &[env], true),
            "pre-release",
        ),
        (
            "a gzip missing its trailer",
            crafted("1.0.0", &[env], false),
            "gzip",
        ),
    ]
}
