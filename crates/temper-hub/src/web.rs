//! The hub's web page: server-rendered HTML, no JavaScript. A list with a
//! search form, and a page per environment (README, versions, digest, the
//! commands to use it).

use base64::Engine;
use pulldown_cmark::{CowStr, Event, Options, Parser, Tag, TagEnd};
use sha2::{Digest, Sha256};

use crate::server::{PackageInfo, PackageSummary};

/// Escape text for HTML.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
a{color:#0b5cad;text-decoration:none}a:hover{text-decoration:underline}
header{display:flex;gap:1rem;align-items:baseline;border-bottom:1px solid #ddd;margin-bottom:1rem}
table{border-collapse:collapse;width:100%}td,th{text-align:left;padding:.3rem .5rem;border-bottom:1px solid #eee}
code,pre{background:#f5f5f5;border-radius:3px}pre{padding:.6rem;overflow-x:auto}
.tag{background:#eef;border-radius:3px;padding:0 .3rem;margin-right:.2rem;font-size:.9em}
.yanked{color:#a00}.readme{border:1px solid #eee;padding:0 1rem;margin:1rem 0}
input[type=search]{width:20rem;padding:.3rem}";

/// `sha256-...` of the page's one inline style, for the
/// `Content-Security-Policy` (which allows that style and nothing else).
pub fn style_hash() -> String {
    format!(
        "sha256-{}",
        base64::engine::general_purpose::STANDARD.encode(Sha256::digest(STYLE.as_bytes()))
    )
}

fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{t}</title><style>{STYLE}</style></head><body>\
         <header><h1><a href=\"/\">temper hub</a></h1><span>environments, versioned</span></header>\
         {body}</body></html>\n",
        t = esc(title)
    )
}

fn tags(tags: &[String]) -> String {
    tags.iter()
        .map(|t| {
            format!(
                "<a class=\"tag\" href=\"/?tag={u}\">{e}</a>",
                u = url_escape(t),
                e = esc(t)
            )
        })
        .collect()
}

/// Percent-encode a query value.
fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The list and search page.
pub fn index_page(q: &str, tag: Option<&str>, packages: &[PackageSummary]) -> String {
    let mut body = format!(
        "<form method=\"get\" action=\"/\"><input type=\"search\" name=\"q\" value=\"{}\" \
         placeholder=\"search environments\"> <button type=\"submit\">Search</button></form>",
        esc(q)
    );
    if let Some(t) = tag.filter(|t| !t.is_empty()) {
        body.push_str(&format!(
            "<p>Tagged <span class=\"tag\">{}</span> · <a href=\"/\">all</a></p>",
            esc(t)
        ));
    }
    body.push_str(&format!(
        "<p id=\"count\">{} environment{}</p>",
        packages.len(),
        if packages.len() == 1 { "" } else { "s" }
    ));
    if !packages.is_empty() {
        body.push_str("<table><thead><tr><th>environment</th><th>latest</th><th>description</th><th>tags</th></tr></thead><tbody>");
        for p in packages {
            body.push_str(&format!(
                "<tr><td><a href=\"/envs/{id}\">{id_e}</a></td><td>{v}</td><td>{d}</td><td>{t}</td></tr>",
                id = p.id,
                id_e = esc(&p.id),
                v = esc(&p.latest.version),
                d = esc(&p.latest.description),
                t = tags(&p.latest.tags)
            ));
        }
        body.push_str("</tbody></table>");
    }
    page("temper hub", &body)
}

/// Whether a README link or image may point at `url`: http(s), or no
/// scheme at all (relative, `/path`, `#anchor`, `//host`). Anything else
/// (`javascript:`, `data:`, `vbscript:`, `file:`...) is refused. The URL is
/// read as a browser reads it: entities are already decoded by the
/// markdown parser, and browsers drop ASCII whitespace and control
/// characters anywhere in a scheme and ignore its case.
pub fn safe_url(url: &str) -> bool {
    let squeezed: String = url
        .chars()
        .filter(|c| !c.is_ascii_whitespace() && !c.is_control())
        .collect::<String>()
        .to_ascii_lowercase();
    // A scheme is what comes before the first `:` when no `/`, `?` or `#`
    // comes first.
    match squeezed.find([':', '/', '?', '#']) {
        Some(i) if squeezed[i..].starts_with(':') => {
            matches!(&squeezed[..i], "http" | "https")
        }
        _ => true,
    }
}

/// Markdown to HTML, with raw HTML shown as text and links and images
/// allowed only to [`safe_url`]s (a README is untrusted): an unsafe link
/// keeps its text and points nowhere (`#`), an unsafe image becomes its
/// alt text.
pub fn render_markdown(md: &str) -> String {
    let options =
        Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH | Options::ENABLE_TASKLISTS;
    // Whether each open image (they nest, in alt text) was dropped.
    let mut images: Vec<bool> = Vec::new();
    let events = Parser::new_ext(md, options).filter_map(|e| match e {
        Event::Html(h) | Event::InlineHtml(h) => Some(Event::Text(h)),
        Event::Start(Tag::Link {
            link_type,
            dest_url,
            title,
            id,
        }) if !safe_url(&dest_url) => Some(Event::Start(Tag::Link {
            link_type,
            dest_url: CowStr::Borrowed("#"),
            title,
            id,
        })),
        Event::Start(Tag::Image { ref dest_url, .. }) => {
            let dropped = !safe_url(dest_url);
            images.push(dropped);
            (!dropped).then_some(e)
        }
        Event::End(TagEnd::Image) => {
            let dropped = images.pop().unwrap_or(false);
            (!dropped).then_some(e)
        }
        e => Some(e),
    });
    let mut out = String::new();
    pulldown_cmark::html::push_html(&mut out, events);
    out
}

/// An environment's page.
pub fn package_page(info: &PackageInfo, readme: Option<&str>) -> String {
    let l = &info.latest;
    let id = esc(&info.id);
    let mut body = format!(
        "<h2 id=\"env-id\">{id} <small>{v}</small></h2><p id=\"description\">{d}</p><p>{t}</p>",
        v = esc(&l.version),
        d = esc(&l.description),
        t = tags(&l.tags)
    );
    body.push_str(&format!(
        "<h3>Use it</h3><pre id=\"commands\">temper env pull {id}@{v}\n\
         temper eval {id}@{v} -m MODEL -b http://127.0.0.1:8000/v1</pre>\
         <p>In a training config: <code>[[env]] id = \"{id}@^{major}\"</code></p>",
        v = esc(&l.version),
        major = semver::Version::parse(&l.version).map_or(l.version.clone(), |v| {
            if v.major == 0 {
                format!("0.{}", v.minor)
            } else {
                v.major.to_string()
            }
        })
    ));
    body.push_str(&format!(
        "<table id=\"facts\"><tr><th>digest</th><td><code>{}</code></td></tr>\
         <tr><th>size</th><td>{} bytes</td></tr><tr><th>license</th><td>{}</td></tr>\
         <tr><th>temper</th><td>{}</td></tr><tr><th>published</th><td>{}</td></tr></table>",
        esc(&l.digest),
        l.size,
        esc(l.license.as_deref().unwrap_or("-")),
        esc(l.temper.as_deref().unwrap_or("any")),
        esc(&l.published_at)
    ));
    if let Some(md) = readme {
        body.push_str(&format!(
            "<div class=\"readme\" id=\"readme\">{}</div>",
            render_markdown(md)
        ));
    }
    body.push_str("<h3>Versions</h3><table id=\"versions\"><thead><tr><th>version</th><th>digest</th><th>published</th><th></th></tr></thead><tbody>");
    for v in info.versions.iter().rev() {
        body.push_str(&format!(
            "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
            esc(&v.version),
            esc(&v.digest),
            esc(&v.published_at),
            if v.yanked {
                "<span class=\"yanked\">yanked</span>"
            } else {
                ""
            }
        ));
    }
    body.push_str("</tbody></table>");
    page(&info.id, &body)
}

/// An error page.
pub fn error_page(status: u16, message: &str) -> String {
    page(
        "temper hub",
        &format!("<h2>{status}</h2><p>{}</p>", esc(message)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_html_is_shown_as_text_not_run() {
        let html = render_markdown("# Title\n\n<script>alert(1)</script>\n\nsome *text*");
        assert!(html.contains("<h1>Title</h1>"));
        assert!(html.contains("<em>text</em>"));
        assert!(!html.contains("<script>"), "{html}");
    }

    #[test]
    fn unsafe_images_become_their_alt_text_and_unsafe_links_point_nowhere() {
        let html = render_markdown(
            "![bad](javascript:x) ![good](/a.png) [x](data:text/html,y) ![outer ![inner](vbscript:z)](b.png)",
        );
        assert!(html.contains("bad"), "{html}");
        assert!(html.contains("<img src=\"/a.png\" alt=\"good\""), "{html}");
        assert!(html.contains("<a href=\"#\">x</a>"), "{html}");
        assert!(html.contains("<img src=\"b.png\""), "{html}");
        assert_eq!(html.matches("<img").count(), 2, "{html}");
        for dead in ["javascript:", "data:", "vbscript:"] {
            assert!(!html.contains(dead), "{html}");
        }
    }

    #[test]
    fn only_http_relative_and_anchor_urls_are_safe() {
        for ok in [
            "https://example.com/x",
            "HTTP://example.com",
            "docs/usage.md",
            "/envs/acme/x",
            "#usage",
            "//example.com/img.png",
            "?q=1",
            "a/b:c",
        ] {
            assert!(safe_url(ok), "{ok}");
        }
        for bad in [
            "javascript:alert(1)",
            "JaVaScRiPt:alert(1)",
            " javascript:alert(1)",
            "java\tscript:alert(1)",
            "java\nscript:alert(1)",
            "\u{1}javascript:alert(1)",
            "data:text/html,<script>alert(1)</script>",
            "vbscript:msgbox",
            "file:///etc/passwd",
            "mailto:x@y",
        ] {
            assert!(!safe_url(bad), "{bad:?}");
        }
    }
}
