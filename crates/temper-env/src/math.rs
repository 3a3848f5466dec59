//! Math answer equivalence: `0.5`, `1/2`, `\frac{1}{2}`, `50\%` and
//! `\boxed{\tfrac12}` are one answer.
//!
//! Both sides are normalised (LaTeX wrappers, `\left`/`\right`, `\text{}`,
//! units of degrees, `x = …`), split into tuples (ordered) or sets
//! (unordered), and each element parsed into an expression. Expressions
//! without variables are compared by value (relative tolerance 1e-8);
//! expressions with variables are evaluated at random points, which decides
//! simple algebraic identities such as `(x+1)^2 = x^2+2x+1`. What does not
//! parse is compared as normalised text.

use std::collections::BTreeSet;

use rand::{Rng, SeedableRng};

/// Whether `given` and `reference` are the same mathematical answer.
pub fn math_equal(given: &str, reference: &str) -> bool {
    let a = normalize(given);
    let b = normalize(reference);
    if a.is_empty() || b.is_empty() {
        return false;
    }
    if a == b {
        return true;
    }
    let (ka, ea) = split_collection(&a);
    let (kb, eb) = split_collection(&b);
    match (ka, kb) {
        (Collection::Scalar, Collection::Scalar) => scalar_equal(&ea[0], &eb[0]),
        (Collection::Set, Collection::Set) => {
            if ea.len() != eb.len() {
                return false;
            }
            let mut used = vec![false; eb.len()];
            ea.iter().all(|x| {
                let hit = eb
                    .iter()
                    .enumerate()
                    .find(|(i, y)| !used[*i] && scalar_equal(x, y))
                    .map(|(i, _)| i);
                hit.map(|i| used[i] = true).is_some()
            })
        }
        (Collection::Tuple, Collection::Tuple) => {
            ea.len() == eb.len() && ea.iter().zip(&eb).all(|(x, y)| scalar_equal(x, y))
        }
        _ => false,
    }
}

/// A plain number literal (`-12`, `3.50`, `1,234`) as f64; `None` for
/// anything else, expressions included. For tasks where the answer must be
/// computed, not restated (`12 + 34` is not an answer to "What is 12 + 34?").
pub fn parse_number_literal(s: &str) -> Option<f64> {
    let t = s.trim();
    let t = t.strip_prefix('+').unwrap_or(t);
    let grouped = regex_lite_grouped(t);
    let plain = grouped.as_deref().unwrap_or(t);
    let body = plain.strip_prefix('-').unwrap_or(plain);
    if body.is_empty()
        || !body.chars().all(|c| c.is_ascii_digit() || c == '.')
        || body.matches('.').count() > 1
        || body.starts_with('.')
        || body.ends_with('.')
    {
        return None;
    }
    plain.parse().ok()
}

/// `1,234,567` → `1234567` when the commas group thousands.
fn regex_lite_grouped(t: &str) -> Option<String> {
    if !t.contains(',') {
        return None;
    }
    let (int, frac) = t.split_once('.').unwrap_or((t, ""));
    let int = int.strip_prefix('-').unwrap_or(int);
    let groups: Vec<&str> = int.split(',').collect();
    let ok = !groups[0].is_empty()
        && groups[0].len() <= 3
        && groups[1..].iter().all(|g| g.len() == 3)
        && groups.iter().all(|g| g.chars().all(|c| c.is_ascii_digit()));
    ok.then(|| {
        let sign = if t.starts_with('-') { "-" } else { "" };
        let joined = groups.concat();
        if frac.is_empty() {
            format!("{sign}{joined}")
        } else {
            format!("{sign}{joined}.{frac}")
        }
    })
}

/// Strip LaTeX presentation and wrappers; keep the mathematics.
pub fn normalize(s: &str) -> String {
    let mut t = s.trim().to_string();
    if let Some(b) = crate::parser::last_boxed(&t) {
        t = b;
    }
    for (from, to) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\displaystyle", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\cdot", "*"),
        ("\\times", "*"),
        ("\\div", "/"),
        ("\\%", "%"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("°", ""),
        ("\\$", ""),
        ("$", ""),
        ("\\(", ""),
        ("\\)", ""),
        ("\\[", ""),
        ("\\]", ""),
        ("\\le", "<="),
        ("\\ge", ">="),
        ("−", "-"),
        ("×", "*"),
        ("÷", "/"),
        ("√", "\\sqrt"),
        ("π", "\\pi"),
    ] {
        t = t.replace(from, to);
    }
    // \text{..}, \mathrm{..}, \mbox{..}, \textbf{..} → their content.
    for cmd in ["\\text", "\\mathrm", "\\mbox", "\\textbf", "\\mathbf"] {
        while let Some(p) = t.find(&format!("{cmd}{{")) {
            let open = p + cmd.len();
            match matching_brace(&t, open) {
                Some(close) => {
                    let inner = t[open + 1..close].to_string();
                    t.replace_range(p..=close, &inner);
                }
                None => break,
            }
        }
    }
    let mut t = t.trim().trim_end_matches('.').trim().to_string();
    // `x = 5`, `y=3x+1`: the right-hand side when the left is one symbol.
    if let Some((lhs, rhs)) = t.split_once('=') {
        let lhs = lhs.trim();
        if !rhs.contains('=')
            && !lhs.is_empty()
            && lhs.len() <= 3
            && lhs
                .chars()
                .all(|c| c.is_alphabetic() || c == '_' || c.is_ascii_digit())
            && lhs.chars().next().is_some_and(char::is_alphabetic)
        {
            t = rhs.trim().to_string();
        }
    }
    t
}

fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let bytes = s.as_bytes();
    if bytes.get(open) != Some(&b'{') {
        return None;
    }
    let mut depth = 0i32;
    for (i, &b) in bytes.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Collection {
    Scalar,
    Tuple,
    Set,
}

/// Split `(a, b)`, `[a, b]`, `a, b` (tuples) and `\{a, b\}` / `{a, b}`
/// (sets) at top-level commas.
fn split_collection(s: &str) -> (Collection, Vec<String>) {
    if let Some(n) = regex_lite_grouped(s) {
        return (Collection::Scalar, vec![n]);
    }
    let (kind, inner) = if let Some(x) = s.strip_prefix("\\{").and_then(|x| x.strip_suffix("\\}")) {
        (Collection::Set, x)
    } else if let Some(x) = s
        .strip_prefix('{')
        .and_then(|x| x.strip_suffix('}'))
        .filter(|x| top_level_commas(x) > 0)
    {
        (Collection::Set, x)
    } else if let Some(x) = s
        .strip_prefix('(')
        .and_then(|x| x.strip_suffix(')'))
        .or_else(|| s.strip_prefix('[').and_then(|x| x.strip_suffix(']')))
        .filter(|x| top_level_commas(x) > 0 && balanced(x))
    {
        (Collection::Tuple, x)
    } else if top_level_commas(s) > 0 {
        (Collection::Tuple, s)
    } else {
        return (Collection::Scalar, vec![s.to_string()]);
    };
    (kind, split_top_level(inner))
}

fn balanced(s: &str) -> bool {
    let mut depth = 0i32;
    for c in s.chars() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            _ => {}
        }
    }
    depth == 0
}

fn top_level_commas(s: &str) -> usize {
    split_top_level(s).len() - 1
}

fn split_top_level(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur.trim().to_string());
    out
}

fn scalar_equal(a: &str, b: &str) -> bool {
    let sa: String = a.chars().filter(|c| !c.is_whitespace()).collect();
    let sb: String = b.chars().filter(|c| !c.is_whitespace()).collect();
    if sa.eq_ignore_ascii_case(&sb) {
        return true;
    }
    // A percentage equals its fraction and its bare number: 50% = 0.5 = 50.
    let variants = |s: &str| -> Vec<String> {
        if s.contains('%') {
            vec![s.to_string(), s.replace('%', "")]
        } else {
            vec![s.to_string()]
        }
    };
    for va in variants(&sa) {
        for vb in variants(&sb) {
            if let (Some(ea), Some(eb)) = (parse_expr(&va), parse_expr(&vb)) {
                if expr_equal(&ea, &eb) {
                    return true;
                }
            }
        }
    }
    false
}

fn close(x: f64, y: f64) -> bool {
    if x.is_infinite() || y.is_infinite() {
        return x == y;
    }
    (x - y).abs() <= 1e-12 + 1e-8 * x.abs().max(y.abs())
}

fn expr_equal(a: &Expr, b: &Expr) -> bool {
    let mut vars = BTreeSet::new();
    a.vars(&mut vars);
    b.vars(&mut vars);
    if vars.is_empty() {
        let (x, y) = (a.eval(&[]), b.eval(&[]));
        return x.is_finite() && y.is_finite() && close(x, y) || (x.is_infinite() && x == y);
    }
    let vars: Vec<String> = vars.into_iter().collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
    let mut checked = 0;
    for _ in 0..20 {
        let point: Vec<(String, f64)> = vars
            .iter()
            .map(|v| (v.clone(), rng.random_range(0.3..2.7)))
            .collect();
        let (x, y) = (a.eval(&point), b.eval(&point));
        if !x.is_finite() || !y.is_finite() {
            continue;
        }
        if !close(x, y) {
            return false;
        }
        checked += 1;
        if checked >= 6 {
            break;
        }
    }
    checked >= 3
}

#[derive(Debug, Clone)]
enum Expr {
    Num(f64),
    Var(String),
    Neg(Box<Expr>),
    Bin(char, Box<Expr>, Box<Expr>),
    Func(String, Box<Expr>),
    Root(Box<Expr>, Box<Expr>),
    Fact(Box<Expr>),
}

impl Expr {
    fn vars(&self, out: &mut BTreeSet<String>) {
        match self {
            Expr::Num(_) => {}
            Expr::Var(v) => {
                out.insert(v.clone());
            }
            Expr::Neg(x) | Expr::Func(_, x) | Expr::Fact(x) => x.vars(out),
            Expr::Bin(_, x, y) | Expr::Root(x, y) => {
                x.vars(out);
                y.vars(out);
            }
        }
    }

    fn eval(&self, at: &[(String, f64)]) -> f64 {
        match self {
            Expr::Num(x) => *x,
            Expr::Var(v) => at
                .iter()
                .find(|(n, _)| n == v)
                .map(|(_, x)| *x)
                .unwrap_or(f64::NAN),
            Expr::Neg(x) => -x.eval(at),
            Expr::Bin(op, x, y) => {
                let (x, y) = (x.eval(at), y.eval(at));
                match op {
                    '+' => x + y,
                    '-' => x - y,
                    '*' => x * y,
                    '/' => x / y,
                    '^' => x.powf(y),
                    _ => f64::NAN,
                }
            }
            Expr::Func(f, x) => {
                let x = x.eval(at);
                match f.as_str() {
                    "sqrt" => x.sqrt(),
                    "sin" => x.sin(),
                    "cos" => x.cos(),
                    "tan" => x.tan(),
                    "ln" => x.ln(),
                    "log" => x.log10(),
                    "exp" => x.exp(),
                    "abs" => x.abs(),
                    _ => f64::NAN,
                }
            }
            Expr::Root(n, x) => x.eval(at).powf(1.0 / n.eval(at)),
            Expr::Fact(x) => {
                let n = x.eval(at);
                if n < 0.0 || n.fract() != 0.0 || n > 170.0 {
                    f64::NAN
                } else {
                    (1..=n as u64).map(|k| k as f64).product()
                }
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Num(f64),
    Ident(String),
    Cmd(String),
    Op(char),
}

const FUNCS: [&str; 8] = ["sqrt", "sin", "cos", "tan", "ln", "log", "exp", "abs"];

fn lex(s: &str) -> Option<Vec<Tok>> {
    let cs: Vec<char> = s.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    while i < cs.len() {
        let c = cs[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit()
            || (c == '.' && cs.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            let start = i;
            while i < cs.len() && (cs[i].is_ascii_digit() || cs[i] == '.') {
                i += 1;
            }
            // Scientific notation: 1.5e3, 2E-4 (not `2e` alone: that is 2·e).
            if i < cs.len() && (cs[i] == 'e' || cs[i] == 'E') {
                let mut j = i + 1;
                if j < cs.len() && (cs[j] == '-' || cs[j] == '+') {
                    j += 1;
                }
                if j < cs.len() && cs[j].is_ascii_digit() {
                    while j < cs.len() && cs[j].is_ascii_digit() {
                        j += 1;
                    }
                    i = j;
                }
            }
            let text: String = cs[start..i].iter().collect();
            out.push(Tok::Num(text.parse().ok()?));
        } else if c == '\\' {
            let start = i + 1;
            i += 1;
            while i < cs.len() && cs[i].is_ascii_alphabetic() {
                i += 1;
            }
            let name: String = cs[start..i].iter().collect();
            if name.is_empty() {
                return None;
            }
            // `\frac12`: brace-less arguments are single digits.
            let digit_args = match name.as_str() {
                "frac" => 2,
                "sqrt" => 1,
                _ => 0,
            };
            out.push(Tok::Cmd(name));
            for _ in 0..digit_args {
                while i < cs.len() && cs[i] == ' ' {
                    i += 1;
                }
                match cs.get(i) {
                    Some(d) if d.is_ascii_digit() => {
                        out.push(Tok::Num(f64::from(d.to_digit(10)?)));
                        i += 1;
                    }
                    _ => break,
                }
            }
        } else if c.is_alphabetic() {
            // A run of letters: a function name, `pi`, or single-letter
            // variables multiplied together (`xy` = x·y).
            let start = i;
            while i < cs.len() && cs[i].is_alphabetic() {
                i += 1;
            }
            let word: String = cs[start..i].iter().collect();
            if FUNCS.contains(&word.as_str()) || word == "pi" || word == "inf" {
                out.push(Tok::Cmd(word));
            } else {
                for ch in word.chars() {
                    out.push(Tok::Ident(ch.to_string()));
                }
            }
        } else if "+-*/^()[]{}!%".contains(c) {
            out.push(Tok::Op(c));
            i += 1;
        } else if c == '_' {
            // Subscripts: x_1 → variable `x_1`.
            let prev = match out.pop() {
                Some(Tok::Ident(v)) => v,
                _ => return None,
            };
            i += 1;
            let (sub, next) = if cs.get(i) == Some(&'{') {
                let end = cs[i..].iter().position(|&c| c == '}')? + i;
                (cs[i + 1..end].iter().collect::<String>(), end + 1)
            } else {
                (cs.get(i)?.to_string(), i + 1)
            };
            out.push(Tok::Ident(format!("{prev}_{sub}")));
            i = next;
        } else {
            return None;
        }
    }
    Some(out)
}

/// The value of an arithmetic expression without variables (`2*(3+4)`,
/// `\frac{1}{2}`, `sqrt(16)`); `None` when it does not parse or has a
/// variable. The calculator tool's engine.
pub fn evaluate(s: &str) -> Option<f64> {
    let e = parse_expr(&normalize(s))?;
    let mut vars = BTreeSet::new();
    e.vars(&mut vars);
    vars.is_empty().then(|| e.eval(&[]))
}

fn parse_expr(s: &str) -> Option<Expr> {
    let toks = lex(s)?;
    if toks.is_empty() {
        return None;
    }
    let mut p = P { toks, pos: 0 };
    let e = p.expr()?;
    (p.pos == p.toks.len()).then_some(e)
}

struct P {
    toks: Vec<Tok>,
    pos: usize,
}

impl P {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn eat(&mut self, op: char) -> bool {
        if self.peek() == Some(&Tok::Op(op)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expr(&mut self) -> Option<Expr> {
        let mut lhs = self.term()?;
        loop {
            if self.eat('+') {
                lhs = Expr::Bin('+', Box::new(lhs), Box::new(self.term()?));
            } else if self.eat('-') {
                lhs = Expr::Bin('-', Box::new(lhs), Box::new(self.term()?));
            } else {
                return Some(lhs);
            }
        }
    }
    fn starts_primary(&self) -> bool {
        match self.peek() {
            Some(Tok::Num(_) | Tok::Ident(_)) => true,
            Some(Tok::Cmd(_)) => true,
            Some(Tok::Op(c)) => matches!(c, '(' | '{' | '['),
            None => false,
        }
    }
    fn term(&mut self) -> Option<Expr> {
        let mut lhs = self.unary()?;
        loop {
            if self.eat('*') {
                lhs = Expr::Bin('*', Box::new(lhs), Box::new(self.unary()?));
            } else if self.eat('/') {
                lhs = Expr::Bin('/', Box::new(lhs), Box::new(self.unary()?));
            } else if self.starts_primary() {
                // Implicit multiplication: 2x, 2\pi, (x+1)(x-1).
                lhs = Expr::Bin('*', Box::new(lhs), Box::new(self.power()?));
            } else {
                return Some(lhs);
            }
        }
    }
    fn unary(&mut self) -> Option<Expr> {
        if self.eat('-') {
            return Some(Expr::Neg(Box::new(self.unary()?)));
        }
        if self.eat('+') {
            return self.unary();
        }
        self.power()
    }
    fn power(&mut self) -> Option<Expr> {
        let base = self.postfix()?;
        if self.eat('^') {
            let exp = self.unary()?;
            return Some(Expr::Bin('^', Box::new(base), Box::new(exp)));
        }
        Some(base)
    }
    fn postfix(&mut self) -> Option<Expr> {
        let mut e = self.primary()?;
        loop {
            if self.eat('!') {
                e = Expr::Fact(Box::new(e));
            } else if self.eat('%') {
                e = Expr::Bin('/', Box::new(e), Box::new(Expr::Num(100.0)));
            } else {
                return Some(e);
            }
        }
    }
    fn group(&mut self) -> Option<Expr> {
        if self.eat('{') {
            let e = self.expr()?;
            self.eat('}').then_some(e)
        } else {
            // `\frac12`: single tokens.
            match self.toks.get(self.pos).cloned()? {
                Tok::Num(x) => {
                    self.pos += 1;
                    Some(Expr::Num(x))
                }
                Tok::Ident(v) => {
                    self.pos += 1;
                    Some(Expr::Var(v))
                }
                _ => None,
            }
        }
    }
    fn primary(&mut self) -> Option<Expr> {
        let tok = self.toks.get(self.pos).cloned()?;
        self.pos += 1;
        match tok {
            Tok::Num(x) => Some(Expr::Num(x)),
            Tok::Ident(v) if v == "e" => Some(Expr::Num(std::f64::consts::E)),
            Tok::Ident(v) => Some(Expr::Var(v)),
            Tok::Op('(') => {
                let e = self.expr()?;
                self.eat(')').then_some(e)
            }
            Tok::Op('[') => {
                let e = self.expr()?;
                self.eat(']').then_some(e)
            }
            Tok::Op('{') => {
                let e = self.expr()?;
                self.eat('}').then_some(e)
            }
            Tok::Cmd(c) => match c.as_str() {
                "pi" => Some(Expr::Num(std::f64::consts::PI)),
                "infty" | "inf" => Some(Expr::Num(f64::INFINITY)),
                "frac" => {
                    let n = self.group()?;
                    let d = self.group()?;
                    Some(Expr::Bin('/', Box::new(n), Box::new(d)))
                }
                "sqrt" => {
                    if self.eat('[') {
                        let n = self.expr()?;
                        if !self.eat(']') {
                            return None;
                        }
                        let x = self.group_or_paren()?;
                        Some(Expr::Root(Box::new(n), Box::new(x)))
                    } else {
                        Some(Expr::Func("sqrt".into(), Box::new(self.group_or_paren()?)))
                    }
                }
                f if FUNCS.contains(&f) => {
                    let arg = if matches!(self.peek(), Some(Tok::Op('(' | '{'))) {
                        self.primary()?
                    } else {
                        self.power()?
                    };
                    Some(Expr::Func(f.to_string(), Box::new(arg)))
                }
                _ => None,
            },
            Tok::Op(_) => None,
        }
    }
    fn group_or_paren(&mut self) -> Option<Expr> {
        if matches!(self.peek(), Some(Tok::Op('('))) {
            self.primary()
        } else {
            self.group()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (given, reference, equivalent?)
    const CASES: &[(&str, &str, bool)] = &[
        // integers and decimals
        ("42", "42", true),
        ("42", "42.0", true),
        ("-7", "-7.00", true),
        ("0.5", ".5", true),
        ("1,000", "1000", true),
        ("1,234,567", "1234567", true),
        ("42", "43", false),
        ("0.333", "1/3", false),
        ("3.14159", "\\pi", false),
        // fractions
        ("1/2", "0.5", true),
        ("\\frac{1}{2}", "0.5", true),
        ("\\dfrac{3}{4}", "0.75", true),
        ("\\tfrac12", "1/2", true),
        ("\\frac{2}{4}", "\\frac{1}{2}", true),
        ("-\\frac{1}{3}", "\\frac{-1}{3}", true),
        ("\\frac{1}{3}", "0.3333333333", true),
        ("\\frac{1}{2}", "\\frac{1}{3}", false),
        ("2/3", "3/2", false),
        // percentages
        ("50%", "0.5", true),
        ("50\\%", "50", true),
        ("12.5%", "1/8", true),
        ("50%", "0.05", false),
        // scientific notation
        ("1.5e3", "1500", true),
        ("1.5 \\times 10^{3}", "1500", true),
        ("2E-4", "0.0002", true),
        ("6.02 \\times 10^{23}", "6.02e23", true),
        ("1e3", "100", false),
        // roots and constants
        ("\\sqrt{2}", "2^{1/2}", true),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", true),
        ("2\\sqrt{3}", "\\sqrt{12}", true),
        ("\\sqrt[3]{27}", "3", true),
        ("\\sqrt{8}", "2\\sqrt{2}", true),
        ("2\\pi", "6.283185307", true),
        ("\\sqrt{2}", "1.41", false),
        ("\\sqrt{3}", "3^{1/3}", false),
        // boxed and wrappers
        ("\\boxed{7}", "7", true),
        ("$\\boxed{\\frac{1}{4}}$", "0.25", true),
        ("$7$", "7", true),
        ("\\(3\\)", "3", true),
        ("x = 5", "5", true),
        ("5.", "5", true),
        ("\\text{10}", "10", true),
        ("90^\\circ", "90", true),
        ("\\left( 1, 2 \\right)", "(1,2)", true),
        ("\\boxed{8}", "9", false),
        // algebra by evaluation
        ("(x+1)^2", "x^2+2x+1", true),
        ("x^2 - 1", "(x-1)(x+1)", true),
        ("2x + 3x", "5x", true),
        ("\\frac{x^2-1}{x-1}", "x+1", true),
        ("a b", "b a", true),
        ("y = 2x + 1", "1 + 2x", true),
        ("\\sin x", "\\cos x", false),
        ("(x+1)^2", "x^2+1", false),
        ("2x", "x^2", false),
        ("x_1 + x_2", "x_2 + x_1", true),
        ("x + y", "x - y", false),
        ("e^{0}", "1", true),
        ("\\ln(e^2)", "2", true),
        ("3!", "6", true),
        // tuples and sets
        ("(1, 2)", "(1,2)", true),
        ("(1, 2)", "(2, 1)", false),
        ("[1/2, 3]", "(0.5, 3)", true),
        ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", true),
        ("\\{1, 2\\}", "\\{1, 3\\}", false),
        ("\\{1, 2\\}", "\\{1, 2, 3\\}", false),
        ("1, 2", "(1, 2)", true),
        ("(1, 2, 3)", "(1, 2)", false),
        ("\\{1, 2\\}", "(1, 2)", false),
        // text fallback and junk
        ("yes", "Yes", true),
        ("blue", "red", false),
        ("", "0", false),
        ("4", "", false),
    ];

    #[test]
    fn math_equivalence_table() {
        assert!(CASES.len() >= 60, "{} cases", CASES.len());
        let mut failures = Vec::new();
        for &(a, b, want) in CASES {
            if math_equal(a, b) != want {
                failures.push(format!("math_equal({a:?}, {b:?}) should be {want}"));
            }
            // Symmetric.
            if math_equal(b, a) != want {
                failures.push(format!("math_equal({b:?}, {a:?}) should be {want}"));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn number_literals() {
        let cases: &[(&str, Option<f64>)] = &[
            ("42", Some(42.0)),
            (" -7 ", Some(-7.0)),
            ("+3", Some(3.0)),
            ("3.50", Some(3.5)),
            ("1,234", Some(1234.0)),
            ("12 + 34", None),
            ("1/2", None),
            ("4e2", None),
            ("", None),
            ("-", None),
            ("1.2.3", None),
            ("12,34", None),
            ("abc", None),
        ];
        for &(s, want) in cases {
            assert_eq!(parse_number_literal(s), want, "{s:?}");
        }
    }
}
