//! `docs/reference/` is kept true by these tests: every command and flag of
//! the command line (`cli.md`), every key of the config files the code
//! accepts (`config.md`) and every HTTP route of the servers
//! (`http.md`) must be on its page. Each list is taken from the real
//! definitions (clap's help of the built binary, serde's field lists of the
//! config types, the routers' source), so a new flag, key or route fails
//! here, naming itself, until it is documented.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn page(name: &str) -> String {
    let path = root().join("docs/reference").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// A code fence line (```` ```sh ````), not inline code that starts a line.
fn is_fence(line: &str) -> bool {
    line.starts_with("```") && !line.trim().trim_start_matches('`').contains('`')
}

/// The text under the first heading whose title starts with `title`, up to
/// the next heading (of any level).
fn section<'a>(doc: &'a str, title: &str) -> Option<&'a str> {
    let mut start = None;
    let mut offset = 0;
    let mut in_fence = false;
    for line in doc.split_inclusive('\n') {
        if is_fence(line) {
            in_fence = !in_fence;
        }
        let heading = !in_fence && line.starts_with('#');
        if heading {
            if let Some(s) = start {
                return Some(&doc[s..offset]);
            }
            if line.trim_start_matches('#').trim().starts_with(title) {
                start = Some(offset + line.len());
            }
        }
        offset += line.len();
    }
    start.map(|s| &doc[s..])
}

/// The text from the heading whose title starts with `title` up to the next
/// heading of the same or a higher level (its subsections included).
fn chapter<'a>(doc: &'a str, title: &str) -> Option<&'a str> {
    let mut start: Option<(usize, usize)> = None;
    let mut offset = 0;
    let mut in_fence = false;
    for line in doc.split_inclusive('\n') {
        if is_fence(line) {
            in_fence = !in_fence;
        }
        if !in_fence && line.starts_with('#') {
            let level = line.chars().take_while(|c| *c == '#').count();
            match start {
                Some((s, l)) if level <= l => return Some(&doc[s..offset]),
                None if line.trim_start_matches('#').trim().starts_with(title) => {
                    start = Some((offset, level))
                }
                _ => {}
            }
        }
        offset += line.len();
    }
    start.map(|(s, _)| &doc[s..])
}

/// The table rows (`| ... |` lines) of `text`.
fn rows(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter(|l| l.trim_start().starts_with('|'))
}

/// Whether `text` names `word` (`--flag`, a key) followed by a character
/// that cannot continue it.
fn names(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        let cont = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.';
        !before.is_some_and(cont) && !after.is_some_and(cont)
    })
}

// ---------------------------------------------------------------- CLI ----

fn help(words: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(words)
        .arg("--help")
        .output()
        .expect("temper runs");
    assert!(out.status.success(), "temper {words:?} --help failed");
    String::from_utf8(out.stdout).expect("utf-8 help")
}

/// The subcommands and long flags of one `--help` text. Flag lines start
/// at column 2 (`  -a, --agent`) or 6 (`      --model`); clap indents
/// descriptions and possible values further.
fn parse_help(text: &str) -> (Vec<String>, Vec<String>) {
    let (mut subs, mut flags) = (Vec::new(), Vec::new());
    let mut heading = "";
    for line in text.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            heading = line;
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        match heading {
            "Commands:" if indent == 2 => {
                let name = line.split_whitespace().next().unwrap_or_default();
                if name != "help" {
                    subs.push(name.to_string());
                }
            }
            "Options:" if (indent == 2 || indent == 6) && line.trim_start().starts_with('-') => {
                let flag = line
                    .split_whitespace()
                    .find(|w| w.starts_with("--"))
                    .map(|w| w.trim_end_matches(','));
                if let Some(flag) = flag {
                    flags.push(flag.to_string());
                }
            }
            _ => {}
        }
    }
    (subs, flags)
}

/// Every command path under `temper` (hidden ones are not in the help, so
/// not here), with its long flags.
fn command_tree() -> BTreeMap<Vec<String>, Vec<String>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![Vec::<String>::new()];
    while let Some(path) = todo.pop() {
        let (subs, flags) = parse_help(&help(&path));
        for s in subs {
            let mut p = path.clone();
            p.push(s);
            todo.push(p);
        }
        out.insert(path, flags);
    }
    out
}

#[test]
fn cli_md_documents_every_command_and_flag() {
    let doc = page("cli.md");
    let tree = command_tree();
    let global: BTreeSet<String> = tree[&Vec::new()].iter().cloned().collect();
    let globals = section(&doc, "Global flags").expect("cli.md: a `Global flags` heading");
    let mut missing = Vec::new();
    let mut flags = 0;
    for g in &global {
        if g != "--help" && g != "--version" && !rows(globals).any(|r| names(r, g)) {
            missing.push(format!("global flag {g}"));
        }
    }
    for (path, own) in &tree {
        if path.is_empty() {
            continue;
        }
        let name = format!("`temper {}`", path.join(" "));
        let Some(text) = section(&doc, &name) else {
            missing.push(format!("command {name} (a heading starting with it)"));
            continue;
        };
        for f in own {
            if f == "--help" || global.contains(f) {
                continue;
            }
            flags += 1;
            if !rows(text).any(|r| names(r, f)) {
                missing.push(format!("{name} {f} (a table row under its heading)"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/reference/cli.md lacks:\n  {}",
        missing.join("\n  ")
    );
    println!(
        "cli.md: {} commands, {} flags, {} global flags",
        tree.len() - 1,
        flags,
        global.len()
    );
}

// ------------------------------------------------------------- config ----

/// An error of the recording deserializer, with the key path it came from.
#[derive(Debug)]
struct RecError {
    msg: String,
    path: Option<String>,
}

impl std::fmt::Display for RecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at {:?}", self.msg, self.path)
    }
}

impl std::error::Error for RecError {}

impl de::Error for RecError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        RecError {
            msg: msg.to_string(),
            path: None,
        }
    }
}

/// A deserializer that hands every struct all its fields (as serde's
/// derive lists them) with placeholder values, recording each field's
/// dotted path: the keys a config type accepts, from its definition.
struct Rec<'a> {
    keys: &'a RefCell<BTreeSet<String>>,
    skip: &'a BTreeSet<String>,
    path: String,
}

impl<'a> Rec<'a> {
    fn at(&self, field: &str) -> Rec<'a> {
        Rec {
            keys: self.keys,
            skip: self.skip,
            path: if self.path.is_empty() {
                field.to_string()
            } else {
                format!("{}.{field}", self.path)
            },
        }
    }
}

macro_rules! leaf {
    ($($method:ident => $visit:ident($($value:expr)?)),* $(,)?) => {
        $(fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, RecError> {
            v.$visit($($value)?)
        })*
    };
}

impl<'de> de::Deserializer<'de> for Rec<'_> {
    type Error = RecError;

    leaf! {
        deserialize_any => visit_unit(),
        deserialize_bool => visit_bool(false),
        deserialize_i8 => visit_i64(0),
        deserialize_i16 => visit_i64(0),
        deserialize_i32 => visit_i64(0),
        deserialize_i64 => visit_i64(0),
        deserialize_u8 => visit_u64(0),
        deserialize_u16 => visit_u64(0),
        deserialize_u32 => visit_u64(0),
        deserialize_u64 => visit_u64(0),
        deserialize_f32 => visit_f64(0.0),
        deserialize_f64 => visit_f64(0.0),
        deserialize_char => visit_char('x'),
        deserialize_str => visit_str("x"),
        deserialize_string => visit_str("x"),
        deserialize_bytes => visit_bytes(b"x"),
        deserialize_byte_buf => visit_bytes(b"x"),
        deserialize_unit => visit_unit(),
        deserialize_identifier => visit_str("x"),
        deserialize_ignored_any => visit_unit(),
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, RecError> {
        v.visit_some(self)
    }
    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, RecError> {
        v.visit_unit()
    }
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, RecError> {
        v.visit_newtype_struct(self)
    }
    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, RecError> {
        v.visit_seq(Items(Some(self)))
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, v: V) -> Result<V::Value, RecError> {
        self.deserialize_seq(v)
    }
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        v: V,
    ) -> Result<V::Value, RecError> {
        self.deserialize_seq(v)
    }
    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, RecError> {
        v.visit_map(de::value::MapDeserializer::new(std::iter::empty::<(
            &str,
            &str,
        )>()))
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, RecError> {
        let mut keys = self.keys.borrow_mut();
        for f in fields {
            keys.insert(self.at(f).path);
        }
        drop(keys);
        let fields = fields
            .iter()
            .filter(|f| !self.skip.contains(&self.at(f).path))
            .copied()
            .collect();
        let at = |f: &str| self.at(f).path;
        let (keys, skip, path) = (self.keys, self.skip, self.path.clone());
        v.visit_map(Fields {
            rec: Rec { keys, skip, path },
            fields,
            next: 0,
        })
        .map_err(|mut e| {
            // An alias is in the field list too: given both, serde reports
            // the field twice; skip the field on the next try (the alias
            // stands in for it).
            if let Some(name) = e.msg.strip_prefix("duplicate field `") {
                e.path.get_or_insert(at(name.trim_end_matches('`')));
            }
            e
        })
    }
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, RecError> {
        v.visit_enum(IntoDeserializer::<RecError>::into_deserializer(variants[0]))
    }
}

/// One element of a list (`[[env]]`: its fields under the list's path).
struct Items<'a>(Option<Rec<'a>>);

impl<'de> de::SeqAccess<'de> for Items<'_> {
    type Error = RecError;
    fn next_element_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, RecError> {
        self.0.take().map(|r| seed.deserialize(r)).transpose()
    }
}

struct Fields<'a> {
    rec: Rec<'a>,
    fields: Vec<&'static str>,
    next: usize,
}

impl<'de> de::MapAccess<'de> for Fields<'_> {
    type Error = RecError;
    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, RecError> {
        match self.fields.get(self.next) {
            Some(f) => seed
                .deserialize(IntoDeserializer::<RecError>::into_deserializer(*f))
                .map(Some),
            None => Ok(None),
        }
    }
    fn next_value_seed<T: de::DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<T::Value, RecError> {
        let at = self.rec.at(self.fields[self.next]);
        self.next += 1;
        let path = at.path.clone();
        seed.deserialize(at).map_err(|mut e| {
            e.path.get_or_insert(path);
            e
        })
    }
}

/// The dotted key paths `T` accepts. A field whose value the placeholders
/// cannot build (a tagged enum, a free-form value) is left out on the next
/// try: its key is recorded, its inside is documented by hand. (A
/// `#[serde(flatten)]` field would be read as a map, its keys unseen; no
/// config type has one.)
fn keys_of<T: DeserializeOwned>() -> BTreeSet<String> {
    let keys = RefCell::new(BTreeSet::new());
    let mut skip = BTreeSet::new();
    loop {
        let rec = Rec {
            keys: &keys,
            skip: &skip,
            path: String::new(),
        };
        match T::deserialize(rec) {
            Ok(_) => break,
            Err(RecError { path: Some(p), .. }) if skip.insert(p.clone()) => {}
            // A required field the placeholders cannot fill would hide the
            // keys after it: fail rather than under-report.
            Err(e) => panic!("{}: cannot walk its keys: {e}", std::any::type_name::<T>()),
        }
    }
    keys.into_inner()
}

/// The fields serde lists in "unknown field `__probe`, expected one of
/// `a`, `b`" (what a `deny_unknown_fields` struct answers a probe with);
/// `None` when `message` is no such answer.
fn expected_fields(message: &str) -> Option<Vec<String>> {
    let rest = message.split("unknown field `__probe`").nth(1)?;
    let rest = rest.lines().next().unwrap_or_default();
    if rest.contains("there are no fields") {
        return Some(Vec::new());
    }
    Some(
        rest.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect(),
    )
}

/// Keys missing from the rows of `text` (a key is documented by a table
/// row whose first cell names it).
fn undocumented<'a>(text: &str, keys: impl IntoIterator<Item = &'a String>) -> Vec<String> {
    keys.into_iter()
        .filter(|k| {
            !rows(text).any(|r| {
                let first = r.trim().trim_start_matches('|').split('|').next();
                first.is_some_and(|c| names(c, &format!("`{k}`")))
            })
        })
        .cloned()
        .collect()
}

/// The keys that are not tables: a table (`[trainer]`, `[[env]]`) is
/// documented by its keys' rows.
fn leaves(keys: &BTreeSet<String>) -> BTreeSet<String> {
    keys.iter()
        .filter(|k| !keys.iter().any(|o| o.starts_with(&format!("{k}."))))
        .cloned()
        .collect()
}

/// The row of `key` in `text`, split into trimmed cells.
fn row_of(text: &str, key: &str) -> Option<Vec<String>> {
    rows(text)
        .map(|r| {
            r.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect::<Vec<_>>()
        })
        .find(|cells| cells.first().is_some_and(|c| names(c, key)))
}

/// The value at `path` in a serialized default config.
fn lookup<'a>(v: &'a toml::Value, path: &str) -> Option<&'a toml::Value> {
    path.split('.').try_fold(v, |cur, p| cur.get(p))
}

/// A default cell that is one TOML literal in backticks must equal the
/// serialized default; a key without a serialized default (unset) must not
/// claim one.
fn check_default(key: &str, cell: &str, default: Option<&toml::Value>, errs: &mut Vec<String>) {
    let literal = cell
        .strip_prefix('`')
        .and_then(|c| c.strip_suffix('`'))
        .filter(|c| !c.contains('`'))
        .and_then(|c| toml::from_str::<toml::Table>(&format!("v = {c}")).ok())
        .and_then(|mut t| t.remove("v"));
    let same = |a: &toml::Value, b: &toml::Value| match (a, b) {
        (toml::Value::Float(x), toml::Value::Float(y)) => (x - y).abs() <= 1e-12 * x.abs().max(1.0),
        (toml::Value::Float(x), toml::Value::Integer(y))
        | (toml::Value::Integer(y), toml::Value::Float(x)) => *x == *y as f64,
        _ => a == b,
    };
    match (literal, default) {
        (Some(lit), Some(d)) if !same(&lit, d) => errs.push(format!(
            "{key}: default documented as {cell}, the code's is {d}"
        )),
        (None, Some(d)) if !d.is_table() => errs.push(format!(
            "{key}: default cell {cell:?} is not the code's default `{d}` as one TOML literal"
        )),
        (Some(_), None) => errs.push(format!(
            "{key}: default documented as {cell}, but the code leaves it unset"
        )),
        _ => {}
    }
}

#[test]
fn config_md_documents_every_key() {
    use temper_rl::config::{DpoConfig, RlConfig, SftConfig};
    let doc = page("config.md");
    let mut missing = Vec::new();
    let mut counts = Vec::new();
    let mut need = |title: &str, keys: &BTreeSet<String>, missing: &mut Vec<String>| {
        let Some(text) = chapter(&doc, title) else {
            missing.push(format!("a heading starting with {title}"));
            return;
        };
        let leaves = leaves(keys);
        for k in undocumented(text, &leaves) {
            missing.push(format!("{title}: key `{k}`"));
        }
        counts.push(format!("{title} {}", leaves.len()));
    };

    // rl.toml and sft.toml: one table per section; the *in* column must say
    // which file accepts the key, the default column must be each file's
    // default.
    let rl = keys_of::<RlConfig>();
    let sft = keys_of::<SftConfig>();
    let dpo = keys_of::<DpoConfig>();
    let both: BTreeSet<String> = rl.union(&sft).chain(&dpo).cloned().collect();
    let training = "`rl.toml` and `sft.toml`";
    need(training, &both, &mut missing);
    let defaults = [
        ("rl", toml::Value::try_from(RlConfig::default()).unwrap()),
        ("sft", toml::Value::try_from(SftConfig::default()).unwrap()),
        ("dpo", toml::Value::try_from(DpoConfig::default()).unwrap()),
    ];
    if let Some(text) = chapter(&doc, training) {
        for k in &leaves(&both) {
            let Some(cells) = row_of(text, &format!("`{k}`")) else {
                continue;
            };
            let said: BTreeSet<&str> = cells
                .get(3)
                .map(|c| c.split(',').map(str::trim).collect())
                .unwrap_or_default();
            let truth: BTreeSet<&str> = [("rl", &rl), ("sft", &sft), ("dpo", &dpo)]
                .into_iter()
                .filter(|(_, set)| set.contains(k))
                .map(|(n, _)| n)
                .collect();
            if said != truth {
                missing.push(format!(
                    "{training}: `{k}` is read by {truth:?}, its row says {said:?}"
                ));
            }
            let cell = cells.get(2).map(String::as_str).unwrap_or_default();
            // Inside a list or an optional table there is no default to
            // serialize (`[[env]]`, `[data] env`).
            if k.starts_with("env.") || k.starts_with("data.env.") {
                continue;
            }
            for (file, d) in defaults.iter().filter(|(n, _)| truth.contains(n)) {
                check_default(&format!("{file} {k}"), cell, lookup(d, k), &mut missing);
            }
        }
    }

    // env.toml, its rubric functions' args, built-in environments' args.
    need(
        "`env.toml`",
        &keys_of::<temper_env::manifest::Manifest>(),
        &mut missing,
    );
    // `[parser]` is a tagged enum (one key, `parser`, for the walk): its
    // row must name every `type`.
    let e = toml::from_str::<temper_env::Parser>("type = \"__probe\"")
        .expect_err("an unknown parser type")
        .to_string();
    let types: Vec<&str> = e
        .split("unknown variant `__probe`, expected")
        .nth(1)
        .unwrap_or_else(|| panic!("no variant list in {e}"))
        .lines()
        .next()
        .unwrap_or_default()
        .split('`')
        .skip(1)
        .step_by(2)
        .collect();
    assert!(types.len() > 1, "parser types from {e}");
    let parser_row = chapter(&doc, "`env.toml`").and_then(|t| row_of(t, "`parser`"));
    for t in &types {
        if !parser_row
            .as_ref()
            .is_some_and(|r| r.iter().any(|c| names(c, &format!("\"{t}\""))))
        {
            missing.push(format!(
                "`env.toml`: parser type \"{t}\" in the `parser` row"
            ));
        }
    }

    let args_of = |title: &str, name: &str, args: Vec<String>, missing: &mut Vec<String>| {
        let Some(text) = chapter(&doc, title) else {
            missing.push(format!("a heading starting with {title}"));
            return 0;
        };
        let Some(row) = rows(text).find(|r| {
            let first = r.trim().trim_start_matches('|').split('|').next();
            first.is_some_and(|c| names(c, &format!("`{name}`")))
        }) else {
            missing.push(format!("{title}: a row for `{name}`"));
            return 0;
        };
        for a in &args {
            if !names(row, &format!("`{a}`")) {
                missing.push(format!("{title}: `{name}`'s argument `{a}`"));
            }
        }
        args.len()
    };
    let mut arg_count = 0;
    for function in temper_env::rubric::BUILTIN_REWARDS {
        let spec: temper_env::rubric::RewardSpec = toml::from_str(&format!(
            "function = {function:?}\nargs = {{ __probe = 1 }}"
        ))
        .expect("a rubric entry");
        // Functions with an argument struct list its fields; the others
        // read their few arguments by hand (documented, not enumerable).
        let args = temper_env::Reward::from_spec(&spec)
            .err()
            .and_then(|e| expected_fields(&e))
            .unwrap_or_default();
        arg_count += args_of("Rubric functions", function, args, &mut missing);
    }
    for env in temper_env::BUILTIN_ENVS {
        let probe = serde_json::json!({"__probe": 1});
        let Err(e) = temper_env::Loader::new().load(env, &probe) else {
            panic!("built-in environment {env} accepted an unknown argument");
        };
        let args = expected_fields(&e.to_string())
            .unwrap_or_else(|| panic!("{env}: no field list in {e}"));
        arg_count += args_of("Environment arguments", env, args, &mut missing);
    }
    need(
        "Arguments of Harbor task directories",
        &keys_of::<temper_tasks::TasksEnvArgs>(),
        &mut missing,
    );

    // eval.toml: the binary's private file type, asked through its error.
    let dir = tempfile::tempdir().unwrap();
    let probe = dir.path().join("eval.toml");
    std::fs::write(&probe, "__probe = 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(["eval", "--config"])
        .arg(&probe)
        .output()
        .expect("temper runs");
    let err = String::from_utf8_lossy(&out.stderr);
    let eval_keys = expected_fields(&err).unwrap_or_else(|| panic!("no field list in {err}"));
    need(
        "`eval.toml`",
        &eval_keys.into_iter().collect(),
        &mut missing,
    );

    // learn.toml (`temper serve --learn`): the binary's private file type,
    // asked through its error (the config is read before the model loads);
    // `[lora]`, `[trainer]` and `[eval]` are rl.toml's, checked above.
    let mut learn_keys = BTreeSet::new();
    for (probe_text, prefix) in [("__probe = 1\n", ""), ("[learn]\n__probe = 1\n", "learn.")] {
        std::fs::write(&probe, probe_text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_temper"))
            .args(["serve", "--model", "no-such-model", "--learn"])
            .arg(&probe)
            .output()
            .expect("temper runs");
        let err = String::from_utf8_lossy(&out.stderr);
        let keys = expected_fields(&err).unwrap_or_else(|| panic!("no field list in {err}"));
        learn_keys.extend(keys.into_iter().map(|k| format!("{prefix}{k}")));
    }
    // A table is documented by its keys' rows.
    learn_keys.remove("learn");
    need("`learn.toml`", &learn_keys, &mut missing);

    // task.toml (Harbor's format): the keys temper reads, defaults checked.
    let task = keys_of::<temper_tasks::TaskConfig>();
    need("`task.toml`", &task, &mut missing);
    let task_default = toml::Value::try_from(temper_tasks::TaskConfig::default()).unwrap();
    if let Some(text) = chapter(&doc, "`task.toml`") {
        for k in &leaves(&task) {
            if let Some(cells) = row_of(text, &format!("`{k}`")) {
                let cell = cells.get(2).map(String::as_str).unwrap_or_default();
                check_default(
                    &format!("task.toml {k}"),
                    cell,
                    lookup(&task_default, k),
                    &mut missing,
                );
            }
        }
    }

    assert!(
        missing.is_empty(),
        "docs/reference/config.md:\n  {}",
        missing.join("\n  ")
    );
    println!(
        "config.md keys: {}; rubric and environment arguments {arg_count}",
        counts.join(", ")
    );
}

// --------------------------------------------------------------- HTTP ----

/// `(method, path)` of every `.route(PATH, METHOD(..).METHOD(..))` in the
/// router source `file` (tests cut off). Nesting is not understood, so it
/// fails the test rather than hide routes.
fn routes(file: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(file).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    for unknown in [".nest(", ".nest_service(", ".route_service("] {
        assert!(
            !text.contains(unknown),
            "{}: {unknown} is not understood by this test; teach it",
            file.display()
        );
    }
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    for (at, _) in text.match_indices(".route(") {
        let mut i = at + ".route(".len();
        while bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        assert_eq!(
            bytes[i],
            b'"',
            "{}: a route path that is not a literal",
            file.display()
        );
        let end = i + 1 + text[i + 1..].find('"').unwrap();
        let path = &text[i + 1..end];
        // The methods: identifiers called at depth 0 of the handler argument.
        let mut depth: i32 = 0;
        let mut j = end + 1;
        let mut ident_start = None;
        while depth >= 0 {
            let c = bytes[j];
            if c.is_ascii_alphanumeric() || c == b'_' {
                ident_start.get_or_insert(j);
            } else {
                if c == b'(' && depth == 0 {
                    if let Some(s) = ident_start {
                        let ident = &text[s..j];
                        if ["get", "post", "put", "delete", "patch", "head", "options"]
                            .contains(&ident)
                        {
                            out.push((ident.to_uppercase(), path.to_string()));
                        }
                    }
                }
                match c {
                    b'(' | b'{' | b'[' => depth += 1,
                    b')' | b'}' | b']' => depth -= 1,
                    b'"' => j += text[j + 1..].find('"').unwrap() + 1,
                    _ => {}
                }
                ident_start = None;
            }
            j += 1;
        }
    }
    assert!(!out.is_empty(), "{}: no routes found", file.display());
    out
}

#[test]
fn http_md_documents_every_route() {
    let doc = page("http.md");
    let servers = [
        ("`temper serve`", "crates/temper-server/src/openai/mod.rs"),
        (
            "`temper api serve`",
            "crates/temper-server/src/training_api/mod.rs",
        ),
        ("`temper hub serve`", "crates/temper-hub/src/server.rs"),
        (
            "`temper sandbox serve`",
            "crates/temper-sandbox/src/service.rs",
        ),
        ("`temper view`", "crates/temper/src/view/server.rs"),
    ];
    let mut missing = Vec::new();
    let mut counts = Vec::new();
    for (title, file) in servers {
        let found = routes(&root().join(file));
        counts.push(format!("{title} {}", found.len()));
        let Some(text) = chapter(&doc, title) else {
            missing.push(format!("a heading starting with {title}"));
            continue;
        };
        for (method, path) in found {
            let documented = rows(text).any(|r| {
                let cells: Vec<&str> = r
                    .trim()
                    .trim_matches('|')
                    .split('|')
                    .map(str::trim)
                    .collect();
                cells.first().is_some_and(|c| names(c, &method))
                    && cells.get(1).is_some_and(|c| *c == format!("`{path}`"))
            });
            if !documented {
                missing.push(format!("{title}: {method} {path}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/reference/http.md lacks (a row `| METHOD | `PATH` | ...` under the server's heading):\n  {}",
        missing.join("\n  ")
    );
    println!("http.md routes: {}", counts.join(", "));
}
