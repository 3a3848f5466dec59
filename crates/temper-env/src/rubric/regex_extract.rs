//! The `regex_extract` reward: a value captured by a pattern, compared
//! with the reference.

use serde::Deserialize;

use crate::math;

/// `regex_extract` arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegexExtractConfig {
    /// The pattern; the value is its group `answer`, else group 1, else the
    /// whole match.
    pub pattern: String,
    /// `exact` (trimmed; case-folded unless `case_sensitive`), `numeric`
    /// or `math` (as `math_equiv`). Default `exact`.
    #[serde(default)]
    pub compare: Option<String>,
    /// Use the first match instead of the last.
    #[serde(default)]
    pub first: bool,
    /// For `exact`.
    #[serde(default)]
    pub case_sensitive: bool,
}

/// A checked [`RegexExtractConfig`].
#[derive(Debug, Clone)]
pub struct RegexExtract {
    re: regex::Regex,
    compare: Compare,
    first: bool,
    case_sensitive: bool,
}

#[derive(Debug, Clone, Copy)]
enum Compare {
    Exact,
    Numeric,
    Math,
}

impl RegexExtract {
    /// Compile the pattern and check `compare`.
    pub fn new(cfg: RegexExtractConfig) -> Result<Self, String> {
        let re = regex::Regex::new(&cfg.pattern).map_err(|e| format!("regex_extract: {e}"))?;
        let compare = match cfg.compare.as_deref() {
            None | Some("exact") => Compare::Exact,
            Some("numeric") => Compare::Numeric,
            Some("math") => Compare::Math,
            Some(other) => {
                return Err(format!(
                    "regex_extract: compare `{other}` (use exact, numeric or math)"
                ))
            }
        };
        Ok(RegexExtract {
            re,
            compare,
            first: cfg.first,
            case_sensitive: cfg.case_sensitive,
        })
    }

    /// The captured value in `text`.
    pub fn extract(&self, text: &str) -> Option<String> {
        let mut caps = self.re.captures_iter(text);
        let c = if self.first { caps.next() } else { caps.last() }?;
        c.name("answer")
            .or_else(|| c.get(1))
            .or_else(|| c.get(0))
            .map(|m| m.as_str().trim().to_string())
    }

    /// Whether `got` equals the reference `want` under `compare`.
    pub fn same(&self, got: &str, want: &str) -> bool {
        match self.compare {
            Compare::Exact if self.case_sensitive => got.trim() == want.trim(),
            Compare::Exact => got.trim().to_lowercase() == want.trim().to_lowercase(),
            Compare::Numeric => match (
                math::parse_number_literal(got),
                math::parse_number_literal(want),
            ) {
                (Some(a), Some(b)) => (a - b).abs() < 1e-9,
                _ => false,
            },
            Compare::Math => math::math_equal(got, want),
        }
    }
}
