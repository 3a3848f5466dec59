//! References to packages: `owner/name`, `owner/name@1.2.3` (exactly that
//! version, yanked or not), `owner/name@^1` or `@1.2` (a semver
//! requirement: the highest matching version that is not yanked).

use std::fmt;

use crate::package::valid_name;
use crate::store::VersionInfo;
use crate::HubError;

/// Which version a reference asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionSpec {
    /// The highest version that is not yanked.
    Latest,
    /// Exactly this one (yanked ones included).
    Exact(semver::Version),
    /// The highest non-yanked version matching.
    Range(semver::VersionReq),
}

impl VersionSpec {
    /// Parse a full version as exact, anything else as a requirement.
    pub fn parse(s: &str) -> Result<Self, HubError> {
        let s = s.trim();
        if s.is_empty() || s == "*" || s == "latest" {
            return Ok(VersionSpec::Latest);
        }
        if let Ok(v) = semver::Version::parse(s) {
            return Ok(VersionSpec::Exact(v));
        }
        semver::VersionReq::parse(s)
            .map(VersionSpec::Range)
            .map_err(|e| HubError::BadRequest(format!("version {s:?}: {e}")))
    }

    /// Whether `v` satisfies it (ignoring yanks).
    pub fn matches(&self, v: &semver::Version) -> bool {
        match self {
            VersionSpec::Latest => v.pre.is_empty(),
            VersionSpec::Exact(x) => x == v,
            VersionSpec::Range(r) => r.matches(v),
        }
    }

    /// The version `versions` resolve to: the exact one, else the highest
    /// matching non-yanked one.
    pub fn pick<'a>(&self, versions: &'a [VersionInfo]) -> Option<&'a VersionInfo> {
        versions
            .iter()
            .filter_map(|v| semver::Version::parse(&v.version).ok().map(|p| (p, v)))
            .filter(|(p, v)| {
                self.matches(p) && (matches!(self, VersionSpec::Exact(_)) || !v.yanked)
            })
            .max_by(|a, b| a.0.cmp(&b.0))
            .map(|(_, v)| v)
    }
}

impl fmt::Display for VersionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VersionSpec::Latest => write!(f, "latest"),
            VersionSpec::Exact(v) => write!(f, "{v}"),
            VersionSpec::Range(r) => write!(f, "{r}"),
        }
    }
}

/// `owner/name[@version]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvRef {
    /// Owner.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Version wanted.
    pub spec: VersionSpec,
}

impl EnvRef {
    /// Parse `owner/name[@version]`.
    pub fn parse(s: &str) -> Result<Self, HubError> {
        let (id, ver) = match s.split_once('@') {
            Some((id, v)) => (id, v),
            None => (s, ""),
        };
        let Some((ns, name)) = id.split_once('/') else {
            return Err(HubError::BadRequest(format!(
                "{s:?}: use owner/name[@version]"
            )));
        };
        if !valid_name(ns) || !valid_name(name) {
            return Err(HubError::BadRequest(format!(
                "{s:?}: owner and name use a-z, 0-9, '-' and '_'"
            )));
        }
        Ok(EnvRef {
            namespace: ns.to_string(),
            name: name.to_string(),
            spec: VersionSpec::parse(ver)?,
        })
    }

    /// Whether `s` reads as a hub reference rather than a path, a built-in
    /// or a command: `owner/name[@...]` that is not an existing path.
    pub fn looks_like(s: &str) -> bool {
        !std::path::Path::new(s).exists() && Self::parse(s).is_ok()
    }

    /// `owner/name`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

impl fmt::Display for EnvRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.spec {
            VersionSpec::Latest => write!(f, "{}/{}", self.namespace, self.name),
            s => write!(f, "{}/{}@{s}", self.namespace, self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(version: &str, yanked: bool) -> VersionInfo {
        VersionInfo {
            namespace: "a".into(),
            name: "b".into(),
            version: version.into(),
            digest: String::new(),
            size: 0,
            description: String::new(),
            tags: vec![],
            license: None,
            temper: None,
            yanked,
            published_at: String::new(),
        }
    }

    #[test]
    fn ranges_skip_yanked_versions_but_exact_ones_do_not() {
        let vs = [
            v("1.0.0", false),
            v("1.2.0", false),
            v("1.3.0", true),
            v("2.0.0", false),
        ];
        let pick = |s: &str| {
            VersionSpec::parse(s)
                .ok()
                .and_then(|p| p.pick(&vs).map(|x| x.version.clone()))
        };
        assert_eq!(pick("^1").as_deref(), Some("1.2.0"));
        assert_eq!(pick("1.2").as_deref(), Some("1.2.0"));
        assert_eq!(pick("1.3.0").as_deref(), Some("1.3.0"));
        assert_eq!(pick("").as_deref(), Some("2.0.0"));
        assert_eq!(pick("^3").as_deref(), None);
    }

    #[test]
    fn references_parse_and_reject_bad_names() {
        let r = EnvRef::parse("acme/capitals@^1").map_err(|e| e.to_string());
        assert_eq!(r.as_ref().map(|r| r.id()), Ok("acme/capitals".to_string()));
        assert!(EnvRef::parse("capitals").is_err());
        assert!(EnvRef::parse("../x/y").is_err());
        assert!(EnvRef::parse("a/b@not a version").is_err());
    }
}
