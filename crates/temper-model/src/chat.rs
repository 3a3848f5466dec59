//! Chat templates: the model's own Jinja template rendered with minijinja the
//! way transformers' `apply_chat_template` renders it — `trim_blocks` and
//! `lstrip_blocks` on, Python string methods (`split`, `strip`, `startswith`,
//! ...), `raise_exception`, `strftime_now`, and a `tojson` that is Python's
//! `json.dumps(..., ensure_ascii=False)` (minijinja's own escapes `<>&'` and
//! drops the spaces after `,` and `:`, which changes the prompt).

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use crate::error::{ModelError, Result};

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compile `source` (the Jinja text from `chat_template.jinja` or
    /// `tokenizer_config.json`).
    ///
    /// ```
    /// use temper_model::ChatTemplate;
    /// let t = ChatTemplate::new(
    ///     "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}\
    ///      {% if add_generation_prompt %}<|assistant|>{% endif %}",
    ///     None, None,
    /// ).unwrap();
    /// let messages = serde_json::json!([{"role": "user", "content": " hi "}]);
    /// let text = t.render(&messages, None, true, &serde_json::Map::new()).unwrap();
    /// assert_eq!(text, "<|user|>hi\n<|assistant|>");
    /// ```
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |fmt: String| -> String {
            chrono::Local::now().format(&fmt).to_string()
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::Template(format!("cannot compile: {e}")))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Render `messages` (OpenAI-style chat messages as JSON), optional
    /// `tools` (a JSON list of tool schemas), `add_generation_prompt`, and any
    /// extra template variables (e.g. `enable_thinking`).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        let mut ctx = serde_json::Map::new();
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert(
            "tools".into(),
            tools.cloned().unwrap_or(serde_json::Value::Null),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            serde_json::Value::Bool(add_generation_prompt),
        );
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), serde_json::Value::String(b.clone()));
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), serde_json::Value::String(e.clone()));
        }
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| ModelError::Template(render_error(&e)))
    }
}

fn render_error(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

fn tojson_filter(value: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let opts = PyJson {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    opts.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` output format.
struct PyJson {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                (Some(i), _, _) => out.push_str(&i.to_string()),
                (_, Some(u), _) => out.push_str(&u.to_string()),
                (_, _, Some(f)) => out.push_str(&py_float(f)),
                _ => out.push_str(&n.to_string()),
            },
            J::String(s) => self.string(s, out),
            J::Array(a) => {
                if a.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    self.sep(i, level + 1, out);
                    self.write(x, level + 1, out);
                }
                self.close(level, out);
                out.push(']');
            }
            J::Object(o) => {
                if o.is_empty() {
                    out.push_str("{}");
                    return;
                }
                out.push('{');
                let mut items: Vec<_> = o.iter().collect();
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(b.0));
                }
                for (i, (k, x)) in items.into_iter().enumerate() {
                    self.sep(i, level + 1, out);
                    self.string(k, out);
                    out.push_str(": ");
                    self.write(x, level + 1, out);
                }
                self.close(level, out);
                out.push('}');
            }
        }
    }

    /// Item separator: `", "` compact, `",\n" + indent` when indenting.
    fn sep(&self, i: usize, level: usize, out: &mut String) {
        match self.indent {
            None => {
                if i > 0 {
                    out.push_str(", ");
                }
            }
            Some(n) => {
                if i > 0 {
                    out.push(',');
                }
                out.push('\n');
                out.push_str(&" ".repeat(n * level));
            }
        }
    }

    fn close(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && (c as u32) > 0x7e => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)`: shortest round-trip digits, scientific notation
/// outside 1e-4 <= |x| < 1e16.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sci = format!("{f:e}"); // e.g. "-1.2345e3", shortest digits
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if neg { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let body = if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                format!("{digits}{}.0", "0".repeat((int_len - n) as usize))
            } else {
                format!(
                    "{}.{}",
                    &digits[..int_len as usize],
                    &digits[int_len as usize..]
                )
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{body}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let es = if exp < 0 { "-" } else { "+" };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (1e16, "1e+16"),
            (123.456, "123.456"),
            (-2.5e-7, "-2.5e-07"),
            (0.0001, "0.0001"),
            (1234567890123456.0, "1234567890123456.0"),
        ] {
            assert_eq!(py_float(f), want);
        }
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", None, None)
            .expect("compiles");
        let mut extra = serde_json::Map::new();
        extra.insert(
            "x".into(),
            serde_json::json!({"b": "<a & 'q'> café\n", "a": [1, 2.5, null, true], "e": {}}),
        );
        let out = t
            .render(&serde_json::json!([]), None, false, &extra)
            .expect("renders");
        assert_eq!(
            out,
            "{\"b\": \"<a & 'q'> café\\n\", \"a\": [1, 2.5, null, true], \"e\": {}}|{\n  \"b\": \"<a & 'q'> café\\n\",\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"e\": {}\n}"
        );
    }

    #[test]
    fn raise_exception_is_an_error_with_the_message() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", None, None)
            .expect("compiles");
        let err = t
            .render(&serde_json::json!([]), None, false, &serde_json::Map::new())
            .expect_err("raises");
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }
}
